//! Leader election on the grant protocol (issue 22, docs/API.md "Elections").
//!
//! An election is a key of a mutex class (`max_holders: 1`, failing closed). Its
//! leader is the key's holder, so everything the grant protocol promises holds for
//! leaderships: one transaction per grant, FIFO waiting, the token `epoch x 2^48 +
//! commit revision`, a hold on the leader's session that ends with it, and no grant
//! to a session that is gone at commit (etcd #11456: a campaign cannot win on a lost
//! session). What this module adds is the leader's value and the observation:
//!
//! ```text
//! campaign   an acquire of the key (`mutex`), then a proclaim if a value is sent
//! proclaim   compare  create_revision(<leader's hold>) == the token's revision
//!                     lease(<leader's hold>) == the hold's lease
//!            then     put <root>/l/<d>/e = {token, value}   (lease: the hold's)
//! resign     a release (`mutex`)
//! observe    read <root>/l/<d>/ at revision A, then watch it from A + 1; answer the
//!            state right after the first revision whose events change it
//! ```
//!
//! The revisions here are the store's; the arbiter hands them to observers only
//! sealed (`lockmesh_extproc::cursor`), since a grant's revision is its token's.
//!
//! The value names the token it was proclaimed under, and a reader shows it only
//! while that hold leads: a value left by a leader that resigned (a release does
//! not delete it) is never shown for its successor, and goes with its session's
//! lease or the next proclamation. The value sits beside the hold slots, so one
//! watch of `l/<d>/` sees grants, ends and proclamations in one revision order:
//! an observer that resumes from the last revision it was answered misses no
//! change while etcd keeps the history.

use std::collections::BTreeMap;

use etcd_client::{Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use lockmesh_core::{headers::SessionId, FencingToken, LockKey};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    mutex::hold_of,
    now_ms,
    session::Caller,
    test_faults::{self, TestFault},
    LockError, Store,
};
use lockmesh_keyspace::ElectionValue;

/// An election's leader as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderView {
    /// The holder's SPIFFE ID.
    pub identity: String,
    /// The leadership's token (shown only to the leader: docs/GUARANTEES.md, G7).
    pub token: FencingToken,
    /// The leader's session lease (its hold's).
    pub lease: i64,
    /// The value proclaimed under this token, if any.
    pub value: Option<String>,
    /// Grant time, unix ms (informational).
    pub since_ms: u64,
}

/// One observation of an election.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The leader at `revision`.
    pub leader: Option<LeaderView>,
    /// The etcd revision described.
    pub revision: i64,
    /// True when this is the state right after the first change after the
    /// resume point.
    pub changed: bool,
    /// True when the resume point could not be used (compacted away, or a
    /// revision etcd has not reached): this is the state now.
    pub gap: bool,
}

/// The entries of `l/<d>/` an observation follows: etcd key -> what it needs.
#[derive(Debug, Clone, Default)]
struct Entries(BTreeMap<Vec<u8>, Entry>);

#[derive(Debug, Clone)]
struct Entry {
    create_revision: i64,
    lease: i64,
    value: Vec<u8>,
}

// === impl Entries ===

impl Entries {
    fn put(&mut self, kv: &etcd_client::KeyValue) {
        let e = Entry { create_revision: kv.create_revision(), lease: kv.lease(), value: kv.value().to_vec() };
        self.0.insert(kv.key().to_vec(), e);
    }

    /// The leader: the hold granted first (a mutex has one), with the value
    /// proclaimed under its token.
    fn leader(&self, store: &Store, d: &lockmesh_core::KeyDigest) -> Option<LeaderView> {
        let k = store.cluster().keys();
        let (hold, rev, lease) = self
            .0
            .iter()
            .filter(|(key, _)| k.slot_of(key).is_some())
            .filter_map(|(_, e)| {
                let h = serde_json::from_slice::<lockmesh_keyspace::HoldRecord>(&e.value).ok()?;
                Some((h, e.create_revision, e.lease))
            })
            .min_by_key(|(_, rev, _)| *rev)?;
        let token = FencingToken::mint(hold.epoch, u64::try_from(rev).ok()?).ok()?;
        let value = self
            .0
            .get(k.election_value(d).as_bytes())
            .and_then(|e| serde_json::from_slice::<ElectionValue>(&e.value).ok())
            .filter(|v| v.token == token.to_string())
            .map(|v| v.value);
        Some(LeaderView { identity: hold.owner, token, lease, value, since_ms: hold.acquired_ms })
    }
}

fn entries(kvs: &[etcd_client::KeyValue]) -> Entries {
    let mut e = Entries::default();
    for kv in kvs {
        e.put(kv);
    }
    e
}

// === impl Store ===

impl Store {
    /// Stores `value` as the proclamation of leadership `token` of `key`: only the
    /// current leader's hold, granted at the token's revision, may (a stale token
    /// answers `NotHolder` and writes nothing). Only the holder's identity may, and
    /// through its own session when it names one. Returns the revision that
    /// stored it.
    pub async fn proclaim(
        &self,
        key: &LockKey,
        token: FencingToken,
        caller: &Caller,
        session: Option<SessionId>,
        value: &str,
    ) -> Result<i64, LockError> {
        if let Some(sid) = session {
            self.owned_session(sid, caller).await?;
        }
        self.epoch().ensure_holds(token.epoch()).await?;
        let d = key.digest();
        let rev = i64::try_from(token.revision()).map_err(|e| LockError::Internal(e.to_string()))?;
        let holds = self
            .cluster
            .call(self.cluster.client().get(self.cluster.keys().holds(&d), Some(GetOptions::new().with_prefix())))
            .await?;
        let mine = |kv: &&etcd_client::KeyValue| {
            hold_of(kv).is_some_and(|h| h.owner == caller.identity && session.is_none_or(|s| s.lease() == kv.lease()))
        };
        let found = if test_faults::on(TestFault::ProclaimWithoutToken) {
            // PLANTED BUG (the election scenario): the caller's identity holds the
            // key, whatever grant its token names: a stale leader of the same
            // workload overwrites its successor's value.
            holds.kvs().iter().find(mine)
        } else {
            holds
                .kvs()
                .iter()
                .filter(|kv| kv.create_revision() == rev && hold_of(kv).is_some_and(|h| h.epoch == token.epoch()))
                .find(mine)
        };
        let kv = found.ok_or(LockError::NotHolder)?;
        let hold = hold_of(kv).ok_or(LockError::NotHolder)?;
        let leader = FencingToken::mint(hold.epoch, u64::try_from(kv.create_revision()).unwrap_or(0))
            .map_err(|e| LockError::Internal(e.to_string()))?;
        let record = ElectionValue { token: leader.to_string(), value: value.to_owned(), proclaimed_ms: now_ms() };
        let record = serde_json::to_vec(&record).map_err(|e| LockError::Internal(e.to_string()))?;
        let txn = Txn::new()
            .when([
                Compare::create_revision(kv.key(), CompareOp::Equal, kv.create_revision()),
                Compare::lease(kv.key(), CompareOp::Equal, kv.lease()),
            ])
            .and_then([TxnOp::put(
                self.cluster.keys().election_value(&d),
                record,
                Some(PutOptions::new().with_lease(kv.lease())),
            )]);
        match self.cluster.call(self.cluster.client().txn(txn)).await {
            Ok(r) if r.succeeded() => Ok(r.header().map_or(0, |h| h.revision())),
            Ok(_) => Err(LockError::NotHolder),
            // The hold's lease ended between the read and the put.
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => Err(LockError::NotHolder),
            Err(e) => Err(e),
        }
    }

    /// The leadership of `key`: without `after`, now; with it, the state right
    /// after the first change after revision `after`, or (`changed: false`) the
    /// state at `after` when `deadline` comes first. An `after` etcd no longer
    /// keeps (compacted), or has not reached, is answered at once with the state
    /// now (`gap`). A named `session` must be the caller's, as for an inspection.
    pub async fn observe(
        &self,
        key: &LockKey,
        caller: &Caller,
        session: Option<SessionId>,
        after: Option<i64>,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<Observed, LockError> {
        if let Some(sid) = session {
            self.owned_session(sid, caller).await?;
        }
        let d = key.digest();
        let prefix = self.cluster.keys().lock_entries(&d);
        let Some(after) = after else {
            return self.observe_now(key, false).await;
        };
        let opts = GetOptions::new().with_prefix().with_revision(after);
        let base = match self.cluster.call(self.cluster.client().get(prefix.as_str(), Some(opts))).await {
            Ok(r) => r,
            Err(LockError::Unavailable(m)) if m.contains("compacted") => return self.observe_now(key, true).await,
            Err(LockError::Unavailable(m)) if m.contains("future revision") => {
                return self.observe_now(key, true).await;
            }
            Err(e) => return Err(e),
        };
        let mut state = entries(base.kvs());
        let before = state.leader(self, &d);
        if test_faults::on(TestFault::ObserveCoalesces) {
            // PLANTED BUG (the election scenario): wait for any change, then answer
            // the state now: changes between two polls merge into one.
            return self.observe_coalesced(key, after, before, deadline, cancel).await;
        }
        let opts = WatchOptions::new().with_prefix().with_start_revision(after + 1);
        let mut client = self.cluster.client();
        let mut watch = self.cluster.call(client.watch(prefix.as_str(), Some(opts))).await?;
        loop {
            let msg = tokio::select! {
                m = watch.message() => m,
                () = tokio::time::sleep_until(deadline) => {
                    return Ok(Observed { leader: before, revision: after, changed: false, gap: false });
                }
                () = cancel.cancelled() => return Err(LockError::Cancelled),
            };
            let r = match msg {
                Ok(Some(r)) => r,
                Ok(None) => return Err(LockError::Unavailable("the election watch ended".into())),
                Err(e) => return Err(super::unavailable(e)),
            };
            if r.compact_revision() > 0 {
                return self.observe_now(key, true).await;
            }
            if r.canceled() {
                return Err(LockError::Unavailable("the election watch was cancelled".into()));
            }
            // etcd sends a revision's events in one response (it batches whole
            // revisions), so the state after each revision's last event is one
            // that existed.
            let events = r.events();
            for (i, ev) in events.iter().enumerate() {
                let Some(kv) = ev.kv() else { continue };
                match ev.event_type() {
                    EventType::Put => state.put(kv),
                    EventType::Delete => {
                        state.0.remove(kv.key());
                    }
                }
                let rev = kv.mod_revision();
                let last_of_revision = events.get(i + 1).and_then(|e| e.kv()).is_none_or(|n| n.mod_revision() != rev);
                if !last_of_revision {
                    continue;
                }
                let now = state.leader(self, &d);
                if now != before {
                    return Ok(Observed { leader: now, revision: rev, changed: true, gap: false });
                }
            }
        }
    }

    /// The leadership now, by one read (`gap`: in place of a resume point that
    /// could not be used).
    async fn observe_now(&self, key: &LockKey, gap: bool) -> Result<Observed, LockError> {
        let d = key.digest();
        let r = self
            .cluster
            .call(
                self.cluster.client().get(self.cluster.keys().lock_entries(&d), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let revision = r.header().map_or(0, |h| h.revision());
        Ok(Observed { leader: entries(r.kvs()).leader(self, &d), revision, changed: gap, gap })
    }

    /// [`TestFault::ObserveCoalesces`]: the state now, once it differs from `before`.
    async fn observe_coalesced(
        &self,
        key: &LockKey,
        after: i64,
        before: Option<LeaderView>,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<Observed, LockError> {
        loop {
            let now = self.observe_now(key, false).await?;
            if now.leader != before {
                return Ok(Observed { changed: true, ..now });
            }
            tokio::select! {
                () = tokio::time::sleep(std::time::Duration::from_millis(300)) => {}
                () = tokio::time::sleep_until(deadline) => {
                    return Ok(Observed { leader: before, revision: after, changed: false, gap: false });
                }
                () = cancel.cancelled() => return Err(LockError::Cancelled),
            }
        }
    }
}
