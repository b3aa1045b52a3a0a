//! Multi-key acquire (`POST /v1/locks/acquire-all`, `x-lock-keys`): every key of
//! the request in one grant transaction, or none.
//!
//! ```text
//! compare  mod_revision(<root>/sys/epoch) == E.mod_revision      epoch unchanged
//!          for each key d:  slot range of d empty, no holder of d above N
//!                           (durable class: no durable waiter of d queued)
//!                           (lock-delay class: neither guard nor delay record of d)
//!          lease(<root>/s/<sid>) == sid                           session alive at commit
//!          grant clock, class policy, class map, home record      as a single-key grant
//! then     put each key's hold (lease sid), its lock-delay guard
//! else     get each key's holders, the session, the epoch, ...   classify the refusal
//! ```
//!
//! All holds are put at one commit revision, so each key's token is that
//! revision at the cluster's epoch: a token of each key higher than any earlier
//! one of that key (the keys share the number, never a key's history).
//!
//! Waiting: a multi-key waiter holds nothing while it waits (no deadlock, however
//! the waiters' key sets overlap) and takes no place in any key's FIFO. It tries
//! again when etcd shows a release of any of its keys, and at least once a
//! second; single-key waiters of its keys may be granted before it
//! (docs/GUARANTEES.md, G18).

use std::sync::Arc;

use etcd_client::{GetOptions, KeyValue, PutOptions, WatchOptions};
use futures::future::select_all;
use lockmesh_core::{class::Fairness, headers::SessionId, FencingToken, KeyDigest, Reason};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::{
    commit::{Sending, Sent},
    grant::{GrantReads, GrantTxn, KeyGrant, SlotCompares},
    txn::{found, Answer, Branch, Read, TxnBuilder},
};

use super::{
    mutex::{existing_grant, hold_of, hold_record, AcquireRequest, Fair, Grant, Next, Retries},
    test_faults::{self, TestFault},
    upgrade::Capability,
    wait::HeldBy,
    LockError, SessionRecord, Store,
};

/// The most compares and puts, together, that one multi-key grant transaction
/// of [`lockmesh_core::headers::MAX_KEYS`] keys may carry: etcd's default
/// `--max-txn-ops`.
pub const MAX_TXN_OPS: usize = 128;

/// The longest list (compares, puts or failure reads; etcd bounds each by
/// `--max-txn-ops`) of a grant of `keys` keys at most: its compares (each key:
/// its slot, no holder above the limit, a durable queue, two lock-delay records,
/// the exclusion record; the transaction: epoch, session, clock, policy, map,
/// home, attempt) and its failure reads (each key: holders, two lock-delay records, the
/// exclusion record; the transaction: session, epoch, clock, policy, map, home)
/// are the longest, at six per key; the puts are three per key (hold, guard,
/// session index) and two more.
pub const fn worst_case_ops(keys: usize) -> usize {
    keys * 6 + 8
}

const _: () = assert!(worst_case_ops(lockmesh_core::headers::MAX_KEYS) <= MAX_TXN_OPS);

enum Attempt {
    Granted(Vec<Grant>),
    /// Refused; `free` is, per key, the lowest slot the refusal saw free.
    Refused {
        reason: Reason,
        revision: i64,
        free: Vec<u32>,
    },
    EpochMoved,
}

fn internal(e: impl std::fmt::Display) -> LockError {
    LockError::Internal(e.to_string())
}

/// The request's keys once each, in key order (the SDK and the API sort; a
/// transaction reads the same whatever the order, but errors and answers are
/// stable this way).
fn digests(reqs: &[AcquireRequest]) -> Vec<KeyDigest> {
    reqs.iter().map(|r| r.key.digest()).collect()
}

// === impl Store ===

impl Store {
    /// Acquires every key of `reqs` (one request per key, all of one class, the
    /// same caller, session and deadline) in one transaction, waiting up to the
    /// deadline. The grants come back in the order of `reqs`, all with the same
    /// token. A grant that commits after `cancel` fired is released before this
    /// returns `Cancelled`.
    pub async fn acquire_all(
        self: &Arc<Self>,
        reqs: &[AcquireRequest],
        cancel: &CancellationToken,
    ) -> Result<Vec<Grant>, LockError> {
        let first = reqs.first().ok_or_else(|| internal("a multi-key acquire without keys"))?;
        let mut namespaces: Vec<&str> = reqs.iter().map(|r| r.key.namespace()).collect();
        namespaces.sort_unstable();
        namespaces.dedup();
        // Quotas first (`quota`): each namespace's; over one, nothing is granted.
        let _admitted = namespaces
            .iter()
            .map(|ns| self.runtime().quotas().admit(self, ns, first.session.is_none()))
            .collect::<Result<Vec<_>, _>>()?;
        let (mut gs, opened) = self
            .in_session(first, async |sid, rec, indexed| {
                let reqs: Vec<AcquireRequest> =
                    reqs.iter().map(|r| super::mutex::indexed_on(r, indexed).into_owned()).collect();
                self.acquire_all_in(&reqs, sid, rec, cancel).await
            })
            .await?;
        for g in &mut gs {
            g.new_session = opened;
        }
        if cancel.is_cancelled() {
            self.undo_all(reqs, &gs).await;
            return Err(LockError::Cancelled);
        }
        Ok(gs)
    }

    /// Releases a multi-key grant nobody received: the session it opened, or
    /// each key's hold by its token.
    pub async fn undo_all(&self, reqs: &[AcquireRequest], gs: &[Grant]) {
        match gs.first() {
            Some(g) if g.existing => {}
            Some(g) if g.new_session => {
                for r in reqs.iter().filter(|r| r.class.lock_delay_s > 0) {
                    // The revoke ends the hold: not an expiry (`delay`).
                    self.delay.drop_guard(&r.key.digest(), g.session).await;
                }
                self.revoke_quietly(g.session).await;
            }
            _ => {
                for (r, g) in reqs.iter().zip(gs) {
                    self.undo(r, g).await;
                }
            }
        }
    }

    async fn acquire_all_in(
        self: &Arc<Self>,
        reqs: &[AcquireRequest],
        sid: SessionId,
        mut new_record: Option<SessionRecord>,
        cancel: &CancellationToken,
    ) -> Result<Vec<Grant>, LockError> {
        let first = &reqs[0];
        // Each key's digest, once for the whole acquire.
        let ds = digests(reqs);
        if new_record.is_none() {
            // A retry whose answer was lost finds its grant; a session that holds
            // some of the keys otherwise could only wait for itself.
            if let Some(gs) = self.own_holds_all(reqs, &ds, sid).await? {
                return Ok(gs);
            }
        }
        let mut retries = Retries::default();
        let mut slots = vec![0u32; reqs.len()];
        loop {
            match self.try_grant_all(reqs, &ds, sid, new_record.as_ref(), &slots).await? {
                Attempt::Granted(gs) => {
                    if let Some(g) = gs.first().filter(|_| first.class.max_holders == 1) {
                        let rev = i64::try_from(g.token.revision()).unwrap_or(i64::MAX);
                        for d in &ds {
                            self.queues().note_held(d, HeldBy::of(first, g, rev));
                        }
                    }
                    return Ok(gs);
                }
                Attempt::EpochMoved => retries.epoch_moved()?,
                Attempt::Refused { reason, revision, free } => {
                    // The failure branch wrote an opened session's record.
                    new_record = None;
                    slots = free;
                    if let Next::Now = retries.refused(reason, first)? {
                        continue;
                    }
                    match reason {
                        Reason::LockContended => super::wait::backoff(first.deadline, cancel).await?,
                        Reason::KeyGated | Reason::LockDelay => {
                            self.wait_any(&ds, revision, first.deadline, cancel).await?;
                        }
                    }
                }
            }
        }
    }

    /// Waits until etcd shows a delete under any of the keys' holds after
    /// `revision`, the poll interval passes, or the deadline.
    async fn wait_any(
        &self,
        ds: &[KeyDigest],
        revision: i64,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<(), LockError> {
        let watches = ds.iter().map(|d| {
            let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
            Box::pin(self.delete_seen(self.cluster.keys().holds(d), opts))
        });
        let any = select_all(watches);
        tokio::select! {
            _ = any => Ok(()),
            _ = tokio::time::sleep_until(super::wait::next_poll().min(deadline)) => Ok(()),
            _ = cancel.cancelled() => Err(LockError::Cancelled),
        }
    }

    /// Reads every key's holders once (no proposal). All held by session `sid` in
    /// one grant: that grant, answered `existing`. Some held by `sid`: refused.
    async fn own_holds_all(
        &self,
        reqs: &[AcquireRequest],
        ds: &[KeyDigest],
        sid: SessionId,
    ) -> Result<Option<Vec<Grant>>, LockError> {
        let reads = |b: &mut TxnBuilder| -> Vec<Read> {
            ds.iter()
                .map(|d| b.read(Branch::Success, self.cluster.keys().holds(d), Some(GetOptions::new().with_prefix())))
                .collect()
        };
        let Some((_, a, reads)) = self.checked_read(reqs[0].deadline, reads).await? else { return Ok(None) };
        let mut own: Vec<Option<KeyValue>> = Vec::with_capacity(reqs.len());
        for (req, read) in reqs.iter().zip(reads) {
            own.push(
                a.must(read)?
                    .kvs()
                    .iter()
                    .find(|kv| kv.lease() == sid.lease() && hold_of(kv).is_some_and(|h| h.hold_id == req.hold_id))
                    .cloned(),
            );
        }
        let held = own.iter().filter(|o| o.is_some()).count();
        if held == 0 {
            return Ok(None);
        }
        let revs: Vec<i64> = own.iter().flatten().map(KeyValue::create_revision).collect();
        if held == reqs.len() && revs.windows(2).all(|w| w[0] == w[1]) {
            let mut gs = Vec::with_capacity(reqs.len());
            for (req, kv) in reqs.iter().zip(own.iter().flatten()) {
                let epoch = hold_of(kv).map_or(0, |h| h.epoch);
                gs.push(existing_grant(req, sid, kv, epoch)?);
            }
            return Ok(Some(gs));
        }
        Err(LockError::BadKeys(format!(
            "{}: this session already holds {held} of these {} keys by other grants: release those, or send the others",
            lockmesh_core::headers::KEYS,
            reqs.len()
        )))
    }

    /// One grant transaction for every key of `reqs`, into slot `slots[i]` of
    /// key i (the lowest free one the last refusal saw).
    async fn try_grant_all(
        self: &Arc<Self>,
        reqs: &[AcquireRequest],
        ds: &[KeyDigest],
        sid: SessionId,
        new_record: Option<&SessionRecord>,
        slots: &[u32],
    ) -> Result<Attempt, LockError> {
        let first = &reqs[0];
        // Every key's class as the authoritative map gives it; the first key's
        // compares cover all of them (one class map record, one class policy).
        let basis = self.grant_basis(first).await?;
        for r in &reqs[1..] {
            self.policy_gate(r).await?;
        }
        let ep = &basis.ep;
        let (k, n) = (self.cluster.keys(), basis.gate.limit.max(1));
        let lease = PutOptions::new().with_lease(sid.lease());
        let count = u32::try_from(reqs.len()).unwrap_or(u32::MAX);
        let delay =
            if n == 1 && self.guard().enabled(Capability::LockDelayGuards) { first.class.lock_delay_s } else { 0 };
        let fair = if first.class.fairness == Fairness::Durable { Fair::Arrival } else { Fair::Memory };
        let first_only = test_faults::on(TestFault::MultiKeyFirstOnly);
        // The attempt's fence (`Keys::attempt`, as a single-key grant's).
        let attempt =
            (new_record.is_none() && self.guard().enabled(Capability::AttemptFences)).then(super::mutex::attempt_id);
        let mut each = Vec::with_capacity(reqs.len());
        for (i, (req, d)) in reqs.iter().zip(ds).enumerate() {
            let slot = slots.get(i).copied().unwrap_or(0).min(n - 1);
            each.push(KeyGrant {
                d,
                slots: vec![(slot, k.slot(d, slot))],
                // PLANTED BUG (multi-key scenario) when only the first key is compared.
                slot_compares: if !first_only || i == 0 { SlotCompares::Limit(n) } else { SlotCompares::Skipped },
                hold: hold_record(req, ep.epoch, 1, Some(count), attempt.as_deref())?,
                exclusion: super::mutex::exclusion_ops(k, d, req, &lease, self.guard()),
                indexed: req.session_indexed && self.guard().enabled(Capability::SessionHoldIndex),
                delay: (delay > 0).then(|| self.delay.grant_ops(d, sid)),
                fair,
                count_after: false,
            });
        }
        let holds: Vec<(String, &str)> = each
            .iter()
            .zip(reqs)
            .flat_map(|(key, req)| key.slots.iter().map(|(_, name)| (name.clone(), req.key.namespace())))
            .collect();
        let spec = GrantTxn {
            keys: k,
            sid,
            opened: new_record.map(serde_json::to_vec).transpose().map_err(internal)?,
            epoch_rev: Some(ep.mod_revision),
            attempt: attempt.as_deref(),
            each,
            clock: basis.clock,
            advert: basis.advert.as_ref(),
            gate: &basis.gate,
        };
        let sending = Sending {
            basis: &basis,
            sid,
            new_record,
            attempt: attempt.as_deref(),
            first: &ds[0],
            holds: &holds,
            deadline: first.deadline,
        };
        let (sent, reads) = self.send_grant(&spec, sending).await?;
        let (a, revision) = match sent {
            Sent::Granted { token, .. } => return Ok(Attempt::Granted(key_grants(reqs, token, sid))),
            Sent::Resolved(g) => return Ok(Attempt::Granted(key_grants(reqs, g.token, sid))),
            Sent::Moved => return Ok(Attempt::EpochMoved),
            Sent::Refused { answer, revision } => (answer, revision),
        };
        self.refusal_all(reqs, ds, sid, slots, (n, delay), (&a, &reads), revision).await
    }

    /// What a refused multi-key grant means (`a`, read through `reads`, at
    /// `revision`): a lock-delay on a key, or for each key the free slot to try
    /// next (`0` and gated when it has none below its limit or an exclusive hold).
    #[allow(clippy::too_many_arguments)]
    async fn refusal_all(
        self: &Arc<Self>,
        reqs: &[AcquireRequest],
        ds: &[KeyDigest],
        sid: SessionId,
        slots: &[u32],
        (n, delay): (u32, u64),
        (a, reads): (&Answer, &GrantReads),
        revision: i64,
    ) -> Result<Attempt, LockError> {
        let k = self.cluster.keys();
        let holders = reads.holders.iter().map(|h| a.must(*h)).collect::<Result<Vec<_>, _>>()?;
        // Per key: whether a guard or a delay record is left (`delay`).
        let delay_kept: Vec<bool> = reads
            .delay
            .iter()
            .map(|r| r.is_some_and(|[guard, rec]| found(a.get(guard)) || found(a.get(rec))))
            .collect();
        // Per key: whether an exclusive hold's record stands.
        let excluded: Vec<bool> = reads.exclusion.iter().map(|r| r.is_some_and(|x| found(a.get(x)))).collect();
        let mut gated = false;
        let mut free = Vec::with_capacity(reqs.len());
        for ((((req, d), h), kept), excluded) in reqs.iter().zip(ds).zip(&holders).zip(&delay_kept).zip(&excluded) {
            // Its own hold appearing since the first read (a concurrent request on
            // the same session) occupies the key like any other.
            if let Some(Err(e)) = self.classify_holders(req, sid, h.kvs()) {
                return Err(e);
            }
            if *kept && h.kvs().is_empty() {
                // No holder and a lock-delay record: turned into the delay here if
                // no arbiter has yet (`delay`).
                if self.delay.left(d, delay).await?.is_some() {
                    return Ok(Attempt::Refused { reason: Reason::LockDelay, revision, free: slots.to_vec() });
                }
            }
            let taken: Vec<u32> = h.kvs().iter().filter_map(|kv| k.slot_of(kv.key())).collect();
            let within = h.kvs().iter().all(|kv| kv.key() < k.slot(d, n).as_bytes());
            match (0..n).find(|s| !taken.contains(s)) {
                Some(s) if within && !excluded => free.push(s),
                _ => {
                    gated = true;
                    free.push(0);
                }
            }
        }
        let reason = if gated { Reason::KeyGated } else { Reason::LockContended };
        Ok(Attempt::Refused { reason, revision, free })
    }
}

/// The grants of a multi-key acquire of `reqs` committed under `token` on `sid`:
/// one per key, in the order of `reqs`, all with the one token.
fn key_grants(reqs: &[AcquireRequest], token: FencingToken, sid: SessionId) -> Vec<Grant> {
    // Multi-key acquires take one exclusive slot of each key: no read-write mode.
    reqs.iter().map(|req| Grant { mode: None, ..Grant::new(req, token, sid, 1) }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_keys_stay_within_etcds_default_max_txn_ops() {
        let max = lockmesh_core::headers::MAX_KEYS;
        assert!(worst_case_ops(max) <= MAX_TXN_OPS, "{} ops", worst_case_ops(max));
        // etcd bounds each list (compares, puts, failure reads) by the limit, not
        // their sum: the longest, the compares, leaves room for four more keys.
        assert!(worst_case_ops(max + 5) > MAX_TXN_OPS, "the bound is near the limit, not far below it");
    }
}
