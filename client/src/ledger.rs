//! The re-entrancy ledger (ADR-13), with no I/O: per key, whether this process is
//! acquiring it, holds it (and how many guards count it), or is releasing it.
//!
//! Only the outermost acquire and the final release reach the service. One acquire
//! per key is in flight at a time (later callers wait for its outcome and then count
//! on the same grant), and a key being released is not acquired again until the
//! release is answered: otherwise a nested acquire could be answered `existing` for
//! a grant whose release is already on its way, and believe it holds a freed key.

use std::collections::HashMap;

use lockmesh_core::{headers::SessionId, FencingToken};

/// One grant the service made to this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The lock key.
    pub key: String,
    /// The fencing token (epoch and revision inside).
    pub token: FencingToken,
    /// The session the hold is attached to.
    pub session: SessionId,
    /// The session TTL in seconds.
    pub ttl_s: u64,
    /// The key's class.
    pub class: String,
    /// The etcd cluster holding it, as the service named it (`None` from an older
    /// service): its epoch is that cluster's own (`docs/SCALE.md`).
    pub cluster: Option<String>,
    /// The signed grant proof the service answered with, for a resource behind
    /// fence-proxy (`x-lock-proof`).
    pub proof: Proof,
}

/// A grant's signed proof (`v1.<kid>.<payload>.<sig>`), if the service sent one:
/// none from a service without a signing key, nor for a grant adopted from a
/// session's hold listing (after an unknown outcome). A credential like the
/// token: its `Debug` prints no content, and it takes no part in comparing
/// grants (the same grant, listed, carries none).
#[derive(Clone, Default)]
pub struct Proof(pub Option<String>);

// === impl Proof ===

impl PartialEq for Proof {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Proof {}

impl std::fmt::Debug for Proof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Proof(..)" } else { "Proof(none)" })
    }
}

/// Per-key state of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Slot {
    /// An acquire on `session` is in flight or its outcome is being resolved.
    Acquiring { session: SessionId },
    /// Held, counted by `count` guards.
    Held { grant: Grant, count: u32 },
    /// The final release is in flight.
    Releasing { grant: Grant },
}

/// The ledger of one client.
#[derive(Debug, Default)]
pub struct Ledger {
    slots: HashMap<String, Slot>,
}

/// What [`Ledger::enter`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Enter {
    /// Already held: counted once more, nothing to send.
    Nested(Grant),
    /// An acquire or release of the key is in flight: wait for it and try again.
    Busy,
    /// Not held: the caller now owns the acquisition and must end it with
    /// [`Ledger::acquired`] or [`Ledger::not_acquired`].
    Acquire,
}

/// What [`Ledger::exit`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exit {
    /// Still counted by other guards: nothing to send.
    Nested(u32),
    /// The last guard: send the release, then call [`Ledger::released`].
    Release(Grant),
    /// Not a current hold (the session was lost, or the grant replaced).
    Stale,
}

/// What [`Ledger::adopt`] decided about a hold the service listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Adopt {
    /// Nobody here wants it: release it, then call [`Ledger::released`].
    Release(Grant),
    /// A guard counts it, or an acquire or release of the key is in flight.
    Leave,
}

// === impl Ledger ===

impl Ledger {
    /// Starts an acquisition of `key` on `session`, or counts one more nesting.
    pub fn enter(&mut self, key: &str, session: SessionId) -> Enter {
        match self.slots.get_mut(key) {
            Some(Slot::Held { grant, count }) => {
                *count += 1;
                Enter::Nested(grant.clone())
            }
            Some(Slot::Acquiring { .. } | Slot::Releasing { .. }) => Enter::Busy,
            None => {
                self.slots.insert(key.to_owned(), Slot::Acquiring { session });
                Enter::Acquire
            }
        }
    }

    /// The acquisition of `grant.key` succeeded: held once. False (and nothing
    /// recorded) if the acquisition was abandoned meanwhile (its session lost).
    pub fn acquired(&mut self, grant: &Grant) -> bool {
        match self.slots.get(&grant.key) {
            Some(Slot::Acquiring { session }) if *session == grant.session => {
                self.slots.insert(grant.key.clone(), Slot::Held { grant: grant.clone(), count: 1 });
                true
            }
            _ => false,
        }
    }

    /// The acquisition of `key` on `session` ended without a hold.
    pub fn not_acquired(&mut self, key: &str, session: SessionId) {
        if matches!(self.slots.get(key), Some(Slot::Acquiring { session: s }) if *s == session) {
            self.slots.remove(key);
        }
    }

    /// The acquisition of `key` on `session`, whose answer was lost, turned out
    /// to have granted `grant`: release it at once (its caller was already told
    /// the outcome was unknown).
    pub fn resolved_granted(&mut self, grant: &Grant) -> Adopt {
        match self.slots.get(&grant.key) {
            Some(Slot::Acquiring { session }) if *session == grant.session => {
                self.slots.insert(grant.key.clone(), Slot::Releasing { grant: grant.clone() });
                Adopt::Release(grant.clone())
            }
            _ => Adopt::Leave,
        }
    }

    /// A guard of `token` on `key` ends.
    pub fn exit(&mut self, key: &str, token: FencingToken) -> Exit {
        let Some(Slot::Held { grant, count }) = self.slots.get_mut(key) else {
            return Exit::Stale;
        };
        if grant.token != token {
            return Exit::Stale;
        }
        *count = count.saturating_sub(1);
        if *count > 0 {
            return Exit::Nested(*count);
        }
        let grant = grant.clone();
        self.slots.insert(key.to_owned(), Slot::Releasing { grant: grant.clone() });
        Exit::Release(grant)
    }

    /// The release of `token` on `key` was answered (or is moot).
    pub fn released(&mut self, key: &str, token: FencingToken) {
        if matches!(self.slots.get(key), Some(Slot::Releasing { grant }) if grant.token == token) {
            self.slots.remove(key);
        }
    }

    /// A hold the service listed on one of our sessions, found by a late check for
    /// a lost answer: release it unless something here accounts for it.
    pub fn adopt(&mut self, grant: &Grant) -> Adopt {
        if self.slots.contains_key(&grant.key) {
            return Adopt::Leave;
        }
        self.slots.insert(grant.key.clone(), Slot::Releasing { grant: grant.clone() });
        Adopt::Release(grant.clone())
    }

    /// The session is lost: forgets every slot on it and returns the holds lost.
    pub fn forget_session(&mut self, session: SessionId) -> Vec<Grant> {
        let mut lost = Vec::new();
        self.slots.retain(|_, slot| match slot {
            Slot::Acquiring { session: s } => *s != session,
            Slot::Releasing { grant } => grant.session != session,
            Slot::Held { grant, .. } => {
                if grant.session == session {
                    lost.push(grant.clone());
                    false
                } else {
                    true
                }
            }
        });
        lost.sort_by(|a, b| a.key.cmp(&b.key));
        lost
    }

    /// Sessions holding a grant of cluster `cluster` of an epoch below `epoch`
    /// (each lost, ADR-03). Each cluster has its own epoch: a grant of another
    /// cluster is never compared (a grant that names no cluster, from an older
    /// service, is compared with other such grants only).
    pub fn sessions_below_epoch(&self, cluster: Option<&str>, epoch: u64) -> Vec<SessionId> {
        // (`fence_floor` says which epoch a grant's answer makes the floor.)
        let mut out: Vec<SessionId> = self
            .slots
            .values()
            .filter_map(|s| match s {
                Slot::Held { grant, .. } | Slot::Releasing { grant }
                    if grant.cluster.as_deref() == cluster && grant.token.epoch() < epoch =>
                {
                    Some(grant.session)
                }
                _ => None,
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The keys held on `session`, sorted.
    pub fn keys_on(&self, session: SessionId) -> Vec<String> {
        let mut out: Vec<String> = self
            .slots
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Held { grant, .. } if grant.session == session => Some(k.clone()),
                _ => None,
            })
            .collect();
        out.sort();
        out
    }

    /// How many guards count `key` (0 if not held).
    pub fn count(&self, key: &str) -> u32 {
        match self.slots.get(key) {
            Some(Slot::Held { count, .. }) => *count,
            _ => 0,
        }
    }

    /// The keys held, with their counts, sorted by key.
    pub fn held(&self) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = self
            .slots
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Held { count, .. } => Some((k.clone(), *count)),
                _ => None,
            })
            .collect();
        out.sort();
        out
    }

    /// Whether nothing is held, acquiring or releasing.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// The epoch below which a cluster's grants are void, after an answer showed
/// `epoch` with the lowest still-honoured epoch `honoured_from` (a shard move's
/// soft advance keeps earlier epochs' holds valid; absent: only `epoch`).
pub(crate) fn fence_floor(epoch: u64, honoured_from: Option<u64>) -> u64 {
    honoured_from.filter(|f| *f <= epoch).unwrap_or(epoch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(n: i64) -> SessionId {
        SessionId::from_lease(n).unwrap()
    }

    fn grant(key: &str, session: i64, epoch: u64, rev: u64) -> Grant {
        Grant {
            key: key.into(),
            token: FencingToken::mint(epoch, rev).unwrap(),
            session: sid(session),
            ttl_s: 15,
            class: "default".into(),
            cluster: None,
            proof: Proof::default(),
        }
    }

    #[test]
    fn only_the_outermost_acquire_and_the_final_release_are_sent() {
        let mut l = Ledger::default();
        let g = grant("ns/a", 1, 1, 7);
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Acquire);
        assert!(l.acquired(&g));
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Nested(g.clone()));
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Nested(g.clone()));
        assert_eq!(l.count("ns/a"), 3);
        assert_eq!(l.exit("ns/a", g.token), Exit::Nested(2));
        assert_eq!(l.exit("ns/a", g.token), Exit::Nested(1));
        assert_eq!(l.exit("ns/a", g.token), Exit::Release(g.clone()));
        // While the release is in flight, a new acquire waits.
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Busy);
        assert_eq!(l.exit("ns/a", g.token), Exit::Stale, "a double release sends nothing");
        l.released("ns/a", g.token);
        assert!(l.is_empty());
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Acquire);
    }

    #[test]
    fn one_acquire_per_key_is_in_flight() {
        let mut l = Ledger::default();
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Acquire);
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Busy);
        assert_eq!(l.enter("ns/b", sid(1)), Enter::Acquire);
        l.not_acquired("ns/a", sid(1));
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Acquire);
    }

    #[test]
    fn a_lost_session_forgets_its_holds_and_late_guards_are_stale() {
        let mut l = Ledger::default();
        let (a, b, c) = (grant("ns/a", 1, 1, 7), grant("ns/b", 1, 1, 8), grant("ns/c", 2, 1, 9));
        for g in [&a, &b, &c] {
            assert_eq!(l.enter(&g.key, g.session), Enter::Acquire);
            assert!(l.acquired(g));
        }
        assert_eq!(l.enter("ns/d", sid(1)), Enter::Acquire);
        assert_eq!(l.forget_session(sid(1)), vec![a.clone(), b.clone()]);
        assert_eq!(l.exit("ns/a", a.token), Exit::Stale);
        assert_eq!(l.held(), vec![("ns/c".to_owned(), 1)]);
        // The in-flight acquire on the lost session records nothing.
        assert!(!l.acquired(&grant("ns/d", 1, 1, 10)));
        assert_eq!(l.enter("ns/d", sid(3)), Enter::Acquire);
    }

    #[test]
    fn an_unknown_outcome_is_released_unless_accounted_for() {
        let mut l = Ledger::default();
        let g = grant("ns/a", 1, 1, 7);
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Acquire);
        assert_eq!(l.resolved_granted(&g), Adopt::Release(g.clone()));
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Busy);
        l.released("ns/a", g.token);
        // A late check finds a hold nobody counts: release; one a guard counts: leave.
        assert_eq!(l.adopt(&g), Adopt::Release(g.clone()));
        l.released("ns/a", g.token);
        assert_eq!(l.enter("ns/a", sid(1)), Enter::Acquire);
        assert!(l.acquired(&g));
        assert_eq!(l.adopt(&g), Adopt::Leave);
        assert_eq!(l.count("ns/a"), 1);
    }

    #[test]
    fn a_soft_advance_keeps_the_holds_of_the_epochs_it_honours() {
        let mut l = Ledger::default();
        for g in [grant("k1", 1, 4, 10), grant("k2", 2, 3, 11)] {
            let g = Grant { cluster: Some("shard-a".into()), ..g };
            l.enter(&g.key, g.session);
            l.acquired(&g);
        }
        // A grant at epoch 5 whose answer says epochs from 4 are honoured.
        assert_eq!(l.sessions_below_epoch(Some("shard-a"), fence_floor(5, Some(4))), vec![sid(2)]);
        // Without it (an older arbiter), every older epoch is void.
        assert_eq!(l.sessions_below_epoch(Some("shard-a"), fence_floor(5, None)), vec![sid(1), sid(2)]);
        // A floor above the epoch is no floor.
        assert_eq!(fence_floor(5, Some(9)), 5);
    }

    #[test]
    fn an_epoch_change_names_the_sessions_of_older_grants() {
        let mut l = Ledger::default();
        for g in [grant("ns/a", 1, 1, 7), grant("ns/b", 2, 2, 3), grant("ns/c", 3, 1, 9)] {
            l.enter(&g.key, g.session);
            l.acquired(&g);
        }
        assert_eq!(l.sessions_below_epoch(None, 2), vec![sid(1), sid(3)]);
        assert!(l.sessions_below_epoch(None, 1).is_empty());
    }

    #[test]
    fn each_cluster_has_its_own_epoch() {
        let mut l = Ledger::default();
        let on = |mut g: Grant, c: &str| {
            g.cluster = Some(c.to_owned());
            g
        };
        // One session holds a key of the coord cluster (epoch 5) and one of a
        // shard (epoch 9): neither epoch voids the other's grant.
        for g in [on(grant("ns/a", 1, 5, 7), "coord"), on(grant("ns/b", 1, 9, 3), "shard-a")] {
            l.enter(&g.key, g.session);
            l.acquired(&g);
        }
        assert!(l.sessions_below_epoch(Some("shard-a"), 9).is_empty());
        assert!(l.sessions_below_epoch(Some("shard-b"), 12).is_empty());
        assert!(l.sessions_below_epoch(None, 12).is_empty());
        assert_eq!(l.sessions_below_epoch(Some("coord"), 6), vec![sid(1)]);
        assert_eq!(l.sessions_below_epoch(Some("shard-a"), 10), vec![sid(1)]);
    }
}
