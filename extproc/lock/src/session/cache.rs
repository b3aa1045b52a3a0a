//! The arbiter's session caches: session records ([`Store`](crate::Store)), the
//! cluster each session was opened on ([`Tiers`](crate::tiers::Tiers)) and the
//! session of each transparent-mode VM and class ([`crate::vm`]).
//!
//! Each is a [`moka::sync::Cache`] of at most [`MAX_ENTRIES`] entries (the least
//! useful are evicted first), and each entry expires after [`IDLE_TTLS`] of its
//! session's TTLs without being read or written ([`IdleTtls`]).
//!
//! **Why no expiry here can grant on stale data.** What these caches hold never
//! changes while the session lives: a session record is written once, on the
//! session's lease, and only the lease's end removes it; a session's home is the
//! cluster it was opened on (docs/SCALE.md: it is extended to others, never moved);
//! a VM's session for a class is replaced only after it ended. A session's end is
//! always learnt from etcd, never from here: every grant transaction compares the
//! session record's lease, and keepalive, close and listing holds renew, revoke or
//! read the lease itself, each dropping the entry when the lease is gone. So an
//! entry of an ended session can only make a request ask etcd and be refused
//! (`session_expired`), and an expired entry only makes the next request read the
//! record again. Expiry bounds memory and the life of entries for sessions nobody
//! uses; it is not what keeps grants correct.

use std::{hash::Hash, sync::Arc, time::Duration};

use moka::{sync::Cache, Expiry};

use crate::SessionRecord;

/// Most entries one cache keeps.
pub(crate) const MAX_ENTRIES: u64 = 100_000;

/// How many of its session's TTLs an entry stays cached without use. A holder
/// renews every third of its TTL or so (the SDK and the filter do), and each
/// renewal through this arbiter reads the entry: an entry idle for three TTLs
/// belongs to a session that has ended, or that is renewed through other arbiters
/// (then the next use here reads its record again: one etcd read).
pub(crate) const IDLE_TTLS: u32 = 3;

/// A cached value that belongs to one session, with that session's TTL.
pub(crate) trait SessionTtl {
    /// The session's lease TTL, seconds.
    fn ttl_s(&self) -> u64;
}

/// Expires each entry [`IDLE_TTLS`] of its session's TTLs after it was last
/// written or read (time to idle, per entry).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IdleTtls;

/// A cache of session entries: bounded at [`MAX_ENTRIES`], expiring by [`IdleTtls`].
pub(crate) fn new<K, V>() -> Cache<K, V>
where
    K: Hash + Eq + Send + Sync + 'static,
    V: SessionTtl + Clone + Send + Sync + 'static,
{
    with_capacity(MAX_ENTRIES)
}

fn with_capacity<K, V>(max: u64) -> Cache<K, V>
where
    K: Hash + Eq + Send + Sync + 'static,
    V: SessionTtl + Clone + Send + Sync + 'static,
{
    Cache::builder().max_capacity(max).expire_after(IdleTtls).build()
}

/// How long an entry of a session with TTL `ttl_s` stays cached without use.
pub(crate) fn idle_for(ttl_s: u64) -> Duration {
    Duration::from_secs(ttl_s.max(1)).saturating_mul(IDLE_TTLS)
}

// === impl SessionTtl ===

impl SessionTtl for Arc<SessionRecord> {
    fn ttl_s(&self) -> u64 {
        self.ttl_s
    }
}

// === impl IdleTtls ===

// moka's callbacks name std's Instant (moka keeps its own clock, not tokio's);
// the times are not used: the expiry depends only on the session's TTL.
#[allow(clippy::disallowed_types)]
impl<K, V: SessionTtl> Expiry<K, V> for IdleTtls {
    fn expire_after_create(&self, _: &K, v: &V, _: std::time::Instant) -> Option<Duration> {
        Some(idle_for(v.ttl_s()))
    }

    fn expire_after_read(
        &self,
        _: &K,
        v: &V,
        _: std::time::Instant,
        _: Option<Duration>,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(idle_for(v.ttl_s()))
    }

    fn expire_after_update(&self, _: &K, v: &V, _: std::time::Instant, _: Option<Duration>) -> Option<Duration> {
        Some(idle_for(v.ttl_s()))
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_types)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Ttl(u64);

    impl SessionTtl for Ttl {
        fn ttl_s(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn an_entry_lives_three_of_its_ttls_from_its_last_use() {
        let (now, p) = (Instant::now(), IdleTtls);
        let v = Ttl(30);
        assert_eq!(Expiry::<u8, _>::expire_after_create(&p, &0, &v, now), Some(Duration::from_secs(90)));
        // A read restarts the idle time whatever was left of it.
        let left = Some(Duration::from_secs(1));
        assert_eq!(p.expire_after_read(&0u8, &v, now, left, now), Some(Duration::from_secs(90)));
        assert_eq!(p.expire_after_update(&0u8, &Ttl(5), now, left), Some(Duration::from_secs(15)));
        // A zero TTL (never granted by etcd) still expires.
        assert_eq!(idle_for(0), Duration::from_secs(3));
        assert_eq!(idle_for(u64::MAX), Duration::MAX);
    }

    #[test]
    fn the_cache_keeps_at_most_its_capacity() {
        let c = with_capacity::<u32, Ttl>(100);
        for i in 0..1_000 {
            c.insert(i, Ttl(30));
        }
        c.run_pending_tasks();
        assert!(c.entry_count() <= 100, "{} entries", c.entry_count());
        assert!(c.entry_count() > 0);
        assert_eq!(new::<u32, Ttl>().policy().max_capacity(), Some(MAX_ENTRIES));
        assert_eq!(MAX_ENTRIES, 100_000, "the bound the arbiter's caches always had");
    }

    #[test]
    fn invalidate_forgets_at_once() {
        let c = new::<u32, Ttl>();
        c.insert(1, Ttl(30));
        c.insert(2, Ttl(30));
        c.invalidate(&1);
        assert_eq!((c.get(&1), c.get(&2)), (None, Some(Ttl(30))));
    }
}
