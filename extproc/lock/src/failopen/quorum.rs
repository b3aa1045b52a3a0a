//! When a quorum loss is declared (the trigger of every unprotected grant).
//!
//! A request whose etcd call fails never decides it: one lost round trip, a slow
//! leader or a restarting member must not turn into an unprotected grant. The
//! decision is the arbiter's 1 s seal check's, and it needs all of:
//!
//! 1. the check's linearizable read of the epoch record failed (etcd did not answer
//!    within the check's timeout, `fail_open.check_timeout_ms` (default
//!    [`CHECK_TIMEOUT`]) or `etcd.op_timeout_ms` if shorter, or answered an error);
//! 2. no member answered a `Status` call naming a leader within that timeout (a
//!    slow cluster still has one; a cluster without a majority has none once its
//!    election timeout ran out, and a member that cannot be reached names none);
//! 3. both held in at least [`MIN_ROUNDS`] consecutive checks spanning at least
//!    `fail_open.quorum_loss_after_ms`, counted from the start of the first
//!    failed check (its read was sent then and never answered).
//!
//! The check's timeout is short because the second condition, not the read, is
//! what tells a lost quorum from a slow one: a read that is late because etcd is
//! busy fails the check, and the leader its members name keeps the loss
//! undeclared. A check whose read, login and member probe each waited out the
//! operation timeout made each failed round last several of them, so two rounds
//! took most of a 12 s outage before the loss was declared.
//!
//! One successful read or one member naming a leader ends the declaration at once
//! (fail closed again). The state is pure here ([`QuorumWatch::observe`] takes the
//! time), so its rules are unit-tested without etcd.

use std::sync::Mutex;

/// Consecutive failed checks needed before a loss is declared.
pub(crate) const MIN_ROUNDS: u32 = 2;

/// The longest a seal check's read and member probe wait for etcd by default
/// (`fail_open.check_timeout_ms`; less when `etcd.op_timeout_ms` is shorter).
pub const CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A declared quorum loss on one cluster, as this arbiter saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outage {
    /// `<cluster>-<declared at, unix ms>`: recorded with every unprotected grant of
    /// the outage (`lockctl audit unprotected --outage`).
    pub id: String,
    /// When the failing checks began, unix ms.
    pub since_ms: u64,
    /// When it was declared, unix ms.
    pub declared_ms: u64,
}

/// What one observation changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// The observation changed nothing.
    None,
    /// The loss is declared from now on.
    Declared(Outage),
    /// The declared loss ended.
    Recovered(Outage),
}

#[derive(Debug, Default)]
struct Inner {
    failing_since_ms: Option<u64>,
    rounds: u32,
    declared: Option<Outage>,
}

/// The declaration state of one cluster.
#[derive(Debug)]
pub struct QuorumWatch {
    cluster: String,
    after_ms: u64,
    inner: Mutex<Inner>,
}

// === impl QuorumWatch ===

impl QuorumWatch {
    /// A watch over cluster `cluster` declaring after `after_ms` of failed checks.
    pub fn new(cluster: &str, after_ms: u64) -> Self {
        Self { cluster: cluster.to_owned(), after_ms, inner: Mutex::new(Inner::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One seal check that started at `started_ms` and ended at `now_ms`: whether
    /// its linearizable read succeeded and whether any member named a leader.
    pub fn observe(&self, started_ms: u64, now_ms: u64, read_ok: bool, leader_seen: bool) -> Transition {
        let mut g = self.lock();
        if read_ok || leader_seen {
            g.failing_since_ms = None;
            g.rounds = 0;
            return g.declared.take().map_or(Transition::None, Transition::Recovered);
        }
        let since = *g.failing_since_ms.get_or_insert(started_ms.min(now_ms));
        g.rounds = g.rounds.saturating_add(1);
        if g.declared.is_none() && g.rounds >= MIN_ROUNDS && now_ms.saturating_sub(since) >= self.after_ms {
            let o = Outage { id: format!("{}-{now_ms}", self.cluster), since_ms: since, declared_ms: now_ms };
            g.declared = Some(o.clone());
            return Transition::Declared(o);
        }
        Transition::None
    }

    /// The declared loss, if any.
    pub fn declared(&self) -> Option<Outage> {
        self.lock().declared.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_failed_check_or_a_slow_cluster_declares_nothing() {
        let w = QuorumWatch::new("coord", 3000);
        // Reads fail but a member names a leader (slow etcd): never declared.
        for t in 0..20 {
            assert_eq!(w.observe(t * 1000, t * 1000, false, true), Transition::None);
        }
        // One failed check between good ones: never declared.
        for t in 20..40 {
            assert_eq!(w.observe(t * 1000, t * 1000, t % 2 == 0, false), Transition::None);
        }
        assert_eq!(w.declared(), None);
    }

    #[test]
    fn a_loss_is_declared_after_the_delay_and_ends_with_one_good_check() {
        let w = QuorumWatch::new("coord", 3000);
        assert_eq!(w.observe(10_000, 10_000, false, false), Transition::None);
        assert_eq!(w.observe(11_000, 11_000, false, false), Transition::None);
        assert_eq!(w.observe(12_000, 12_000, false, false), Transition::None);
        let Transition::Declared(o) = w.observe(13_000, 13_000, false, false) else { panic!("not declared") };
        assert_eq!((o.id.as_str(), o.since_ms, o.declared_ms), ("coord-13000", 10_000, 13_000));
        assert_eq!(w.observe(14_000, 14_000, false, false), Transition::None);
        assert_eq!(w.declared(), Some(o.clone()));
        // A member naming a leader again ends it (fail closed at once).
        assert_eq!(w.observe(15_000, 15_000, false, true), Transition::Recovered(o));
        assert_eq!(w.declared(), None);
        // The delay counts again from the next failure.
        assert_eq!(w.observe(16_000, 16_000, false, false), Transition::None);
        assert_eq!(w.observe(18_000, 18_000, false, false), Transition::None);
        assert!(matches!(w.observe(19_000, 19_000, false, false), Transition::Declared(_)));
        assert!(matches!(w.observe(20_000, 20_000, true, false), Transition::Recovered(_)));
    }

    #[test]
    fn a_long_single_check_still_needs_two_rounds() {
        let w = QuorumWatch::new("shard-a", 1000);
        assert_eq!(w.observe(0, 0, false, false), Transition::None);
        assert!(matches!(w.observe(5000, 5000, false, false), Transition::Declared(o) if o.id == "shard-a-5000"));
    }

    #[test]
    fn a_loss_counts_from_the_start_of_its_first_failed_check() {
        let w = QuorumWatch::new("coord", 3000);
        // A check sent at 10 s whose read got no answer until 12 s, then one from 13 s
        // to 15 s: no answer for 5 s, declared at the second check's end.
        assert_eq!(w.observe(10_000, 12_000, false, false), Transition::None);
        let Transition::Declared(o) = w.observe(13_000, 15_000, false, false) else { panic!("not declared") };
        assert_eq!((o.since_ms, o.declared_ms), (10_000, 15_000));
        // Two short failed checks spanning less than the delay declare nothing.
        let w = QuorumWatch::new("coord", 3000);
        assert_eq!(w.observe(10_000, 10_500, false, false), Transition::None);
        assert_eq!(w.observe(11_500, 12_000, false, false), Transition::None);
        assert!(matches!(w.observe(13_000, 13_500, false, false), Transition::Declared(_)));
    }
}
