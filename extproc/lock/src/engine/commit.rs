//! Sending a grant transaction and the checks every grant's answer gets, for
//! one key and for several alike: the unknown outcome resolved by the attempt
//! fence, the post-commit seal checks, the quota ledger's notes, the token, and
//! on a refusal the checks that say "try again" or "stop" before a recipe
//! decides what the refusal means for its keys.

use std::sync::Arc;

use etcd_client::KeyValue;
use lockmesh_core::{headers::SessionId, FencingToken, KeyDigest};
use tokio::time::Instant;

use super::grant::{self, Form, GrantReads, GrantTxn};
use super::group::{Grouped, Member, Outer};
use super::txn::Answer;
use crate::{
    mutex::{outcome_unknown, AcquireRequest, Grant},
    policy::PolicyGate,
    steps::{timed, Step},
    test_faults::{self, TestFault},
    EpochState, LockError, SessionRecord, Store,
};

/// What a grant transaction came to.
pub(crate) enum Sent {
    /// Committed under `token` (every key's holds carry it).
    Granted { token: FencingToken, answer: Answer },
    /// etcd never answered; the attempt fence found the grant committed.
    Resolved(Grant),
    /// Refused at `revision`, past the checks every refusal gets: what it means
    /// for each key is the recipe's to read from `answer`.
    Refused { answer: Answer, revision: i64 },
    /// The epoch record, the class policy, the class map or the home record
    /// moved since they were read: read them again and retry.
    Moved,
}

/// What every grant is built and its answer checked against, read before it.
pub(crate) struct Basis {
    /// This arbiter's advertisement (`upgrade::Guard`), compared.
    pub advert: Option<(String, i64)>,
    /// The epoch record, compared.
    pub ep: EpochState,
    /// The authoritative class and limit of the first key (the policy records,
    /// the class map and the home record), compared.
    pub gate: PolicyGate,
    /// The revision floor and the grant clock's mark.
    pub floor: i64,
    pub clock: Option<i64>,
}

/// One grant transaction's answer is checked against these.
pub(crate) struct Sending<'a> {
    pub basis: &'a Basis,
    pub sid: SessionId,
    pub new_record: Option<&'a SessionRecord>,
    pub attempt: Option<&'a str>,
    /// The key an unknown outcome is resolved through (every key's hold
    /// carries the attempt and they commit together or not at all).
    pub first: &'a KeyDigest,
    /// Every hold the grant puts, with the namespace the quota counts it in.
    pub holds: &'a [(String, &'a str)],
    pub deadline: Instant,
}

// === impl Store ===

impl Store {
    /// What a grant of `req` (the first key of several) is built against: none
    /// while this cluster is sealed, or while this arbiter is not advertised.
    pub(crate) async fn grant_basis(&self, req: &AcquireRequest) -> Result<Basis, LockError> {
        self.unsealed()?;
        // The keyspace gate (`upgrade::Guard`): the advertisement a grant
        // compares, and which record kinds it may write.
        let advert = self.guard().advertisement().map_err(LockError::Unavailable)?;
        let ep = self.epoch().state().await?;
        if let Some(why) = &ep.sealed {
            return Err(LockError::Sealed(why.clone()));
        }
        let gate = self.policy_gate(req).await?;
        let (floor, clock) = (self.seal().revision_floor(), self.seal().clock_floor(ep.epoch));
        Ok(Basis { advert, ep, gate, floor, clock })
    }

    /// Sends the grant transaction of `g` and checks its answer, with the
    /// reads of the form it was sent in. Grouping on (`engine::group`), a grant on
    /// the caller's session goes as a member of a group; one that opens its own
    /// session, or whose group did not run as one, goes alone. An unknown outcome
    /// (timeout) may still commit: with a session opened for this acquire the
    /// caller revokes it; with the caller's own session the attempt is fenced off
    /// and what it did is read ([`Store::resolve_attempt`]), or, before attempt
    /// fences are enabled, the session is ended.
    pub(crate) async fn send_grant(
        self: &Arc<Self>,
        g: &GrantTxn<'_>,
        s: Sending<'_>,
    ) -> Result<(Sent, GrantReads), LockError> {
        let mut grouped = None;
        if s.new_record.is_none() && self.committer().enabled() {
            let (txn, reads, lengths) = grant::build(g, Form::Member);
            let keys = g.each.iter().map(|k| k.d.as_str().as_bytes().to_vec()).collect();
            let outer = Outer { epoch_rev: g.epoch_rev, clock: g.clock };
            let member = Member::new(keys, lengths, txn, outer);
            let answered = timed(Step::GrantTxn, self.cluster.txn_by(s.deadline, self.grouped(member))).await;
            match answered {
                Ok(Some(a)) => grouped = Some((a, reads)),
                Ok(None) => {}
                Err(e) if test_faults::on(TestFault::GroupUnknownGuessed) && outcome_unknown(&e) => {
                    // PLANTED BUG (group scenarios): the unknown outcome guessed.
                    return Err(LockError::Unavailable("the group's outcome taken for a refusal".into()));
                }
                Err(e) => return self.unanswered(e, &s).await.map(|sent| (sent, reads)),
            }
        }
        let (answer, reads) = match grouped {
            Some(a) => a,
            None => {
                let (txn, reads, _) = grant::build(g, Form::Alone);
                match timed(Step::GrantTxn, self.cluster.call_by(s.deadline, self.cluster.client().txn(txn))).await {
                    Ok(r) => (Answer::of(&r), reads),
                    Err(e) => return self.unanswered(e, &s).await.map(|sent| (sent, reads)),
                }
            }
        };
        self.checked_grant(answer, &reads, s).await.map(|sent| (sent, reads))
    }

    /// A grant etcd did not answer.
    async fn unanswered(self: &Arc<Self>, e: LockError, s: &Sending<'_>) -> Result<Sent, LockError> {
        match s.attempt {
            Some(a) if outcome_unknown(&e) => Ok(Sent::Resolved(self.resolve_attempt(s.first, s.sid, a, e).await?)),
            None if s.new_record.is_none() && outcome_unknown(&e) => {
                self.end_unfenced(s.sid);
                Err(e)
            }
            _ => Err(e),
        }
    }

    /// A member through this cluster's committer: its answer, `None` to send it
    /// alone, or an unknown outcome as `unavailable`.
    pub(crate) async fn grouped(&self, member: Member) -> Result<Option<Answer>, etcd_client::Error> {
        match self.committer().submit(member).await {
            Grouped::Answered { nested, header } => {
                let mut a = Answer::member(&nested, header);
                if test_faults::on(TestFault::GroupMemberOutcomeIgnored) {
                    // PLANTED BUG (group scenarios): a refused member answered granted.
                    a.planted_success();
                }
                Ok(Some(a))
            }
            Grouped::Alone => Ok(None),
            Grouped::Unknown(text) => Err(etcd_client::Error::InvalidArgs(text)),
        }
    }

    /// The checks every grant's answer gets.
    async fn checked_grant(
        self: &Arc<Self>,
        answer: Answer,
        reads: &GrantReads,
        s: Sending<'_>,
    ) -> Result<Sent, LockError> {
        if let Some(rec) = s.new_record {
            // Either branch put it: the release that names the session finds its
            // owner here, with no read (`owned_session`).
            self.sessions.insert(s.sid, Arc::new(rec.clone()));
        }
        let names: Vec<String> = s.holds.iter().map(|(name, _)| name.clone()).collect();
        let b = s.basis;
        let revision = self.settle(&b.ep, b.floor, b.clock, &answer, &names, s.sid).await?;
        if answer.succeeded() {
            // Counted at once, before the ledger's watch shows it (`quota`).
            for (name, ns) in s.holds {
                self.ledger().note_hold(name.as_bytes(), revision, ns);
            }
            if let (Some(_), Some((_, ns))) = (s.new_record, s.holds.first()) {
                self.ledger().note_session(self.cluster.keys().session(s.sid).as_bytes(), revision, ns);
            }
            let rev = u64::try_from(revision).unwrap_or(u64::MAX);
            return match FencingToken::mint(b.ep.epoch, rev) {
                Ok(token) => Ok(Sent::Granted { token, answer }),
                Err(e) => {
                    // Revision space exhausted: never hand out a token that does not fit.
                    self.take_back(&names, revision, s.sid).await;
                    Err(LockError::Sealed(e.to_string()))
                }
            };
        }
        // A member's clock was compared by its group, which committed.
        let clock_read = b.clock.zip(reads.clock).map(|(c, r)| (c, answer.get(r)));
        if self.refusal_moved(&b.ep, answer.must(reads.epoch)?, clock_read)? {
            return Ok(Sent::Moved);
        }
        if let Some(read) = reads.advert {
            self.guard().check_read(&b.advert, answer.get(read))?;
        }
        if self.policy_moved(&b.gate, &reads.gate, &answer) {
            return Ok(Sent::Moved);
        }
        let sess = answer.must(reads.session)?;
        if s.new_record.is_none() && sess.kvs().first().map(KeyValue::lease) != Some(s.sid.lease()) {
            self.forget_session(s.sid).await;
            return Err(LockError::SessionExpired);
        }
        Ok(Sent::Refused { answer, revision })
    }
}
