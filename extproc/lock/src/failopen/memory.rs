//! Unprotected holds in this arbiter's memory: the N-holder predicate of a key,
//! kept by this process only (best effort: another arbiter, or this one after a
//! restart, knows nothing of them), with the class TTL as expiry.
//!
//! A grant is reserved here first (it counts against the limit while its spool
//! line is written), then confirmed; a failed spool write takes the reservation
//! back. Nothing in here does I/O.

use std::collections::HashMap;

use lockmesh_core::KeyDigest;
use tokio::time::{Duration, Instant};

/// One unprotected hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemHold {
    /// The grant id (32 hex characters), the holder's handle for its release.
    pub grant: String,
    /// The raw key (for the spool; never logged).
    pub key: String,
    /// The key's class.
    pub class: String,
    /// The holder's identity.
    pub identity: String,
    /// Its declared instance.
    pub instance: Option<String>,
    /// Transparent mode: the filter's hold id, and the Envoy that owns it.
    pub hold: Option<(String, String)>,
    /// The class TTL, seconds.
    pub ttl_s: u64,
    /// When it lapses unless released (or renewed by its VM's keepalive).
    pub expires: Instant,
    /// The outage it was granted in.
    pub outage: String,
    /// The epoch this arbiter last read on the cluster when it granted (0 if none).
    pub epoch: u64,
    /// Still being spooled (counts against the limit, not yet answered).
    pub pending: bool,
}

/// What a reservation found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    /// Reserved (pending until [`Memory::confirm`]).
    Reserved,
    /// The same transparent hold already holds the key.
    Existing(Box<MemHold>),
    /// The same identity and instance already hold the key (ADR-13).
    Leaked,
    /// The key is at its limit.
    Full,
}

/// Every unprotected hold of one cluster on this arbiter.
#[derive(Debug, Default)]
pub struct Memory {
    holds: HashMap<KeyDigest, Vec<MemHold>>,
}

// === impl Memory ===

impl Memory {
    /// Holds (pending included).
    pub fn len(&self) -> usize {
        self.holds.values().map(Vec::len).sum()
    }

    /// True without holds.
    pub fn is_empty(&self) -> bool {
        self.holds.is_empty()
    }

    /// Whether `d` has any hold (pending included).
    pub fn held(&self, d: &KeyDigest) -> bool {
        self.holds.get(d).is_some_and(|v| !v.is_empty())
    }

    /// Reserves `h` on `d` under `limit` holders.
    pub fn reserve(&mut self, d: &KeyDigest, h: MemHold, limit: u32) -> Reserve {
        let v = self.holds.entry(d.clone()).or_default();
        if let Some(hold) = &h.hold {
            if let Some(e) = v.iter().find(|x| x.hold.as_ref().is_some_and(|o| o.0 == hold.0)) {
                return Reserve::Existing(Box::new(e.clone()));
            }
        }
        if h.instance.is_some() && v.iter().any(|x| x.identity == h.identity && x.instance == h.instance) {
            return Reserve::Leaked;
        }
        if v.len() >= usize::try_from(limit.max(1)).unwrap_or(usize::MAX) {
            return Reserve::Full;
        }
        v.push(h);
        Reserve::Reserved
    }

    /// The spool line is durable: the reservation is a hold.
    pub fn confirm(&mut self, d: &KeyDigest, grant: &str) {
        if let Some(h) = self.holds.get_mut(d).and_then(|v| v.iter_mut().find(|h| h.grant == grant)) {
            h.pending = false;
        }
    }

    /// Removes grant `grant` of `d` when `matches` accepts it; returns it.
    pub fn remove(&mut self, d: &KeyDigest, grant: &str, matches: impl Fn(&MemHold) -> bool) -> Option<MemHold> {
        let v = self.holds.get_mut(d)?;
        let i = v.iter().position(|h| h.grant == grant && !h.pending && matches(h))?;
        let h = v.remove(i);
        if v.is_empty() {
            self.holds.remove(d);
        }
        Some(h)
    }

    /// Takes a reservation back (its spool line failed).
    pub(crate) fn unreserve(&mut self, d: &KeyDigest, grant: &str) {
        if let Some(v) = self.holds.get_mut(d) {
            v.retain(|h| h.grant != grant);
            if v.is_empty() {
                self.holds.remove(d);
            }
        }
    }

    /// The grant id of the transparent hold `hold_id` of `d` owned by `envoy`.
    pub(crate) fn find_hold(&self, d: &KeyDigest, hold_id: &str, envoy: &str) -> Option<String> {
        self.holds
            .get(d)?
            .iter()
            .find(|h| !h.pending && h.hold.as_ref().is_some_and(|(i, e)| i == hold_id && e == envoy))
            .map(|h| h.grant.clone())
    }

    /// A filter VM's keepalive: its holds whose number is below `next` and not in
    /// `open` are removed and returned (ended requests); the others lapse a TTL
    /// from `now` again.
    pub fn vm_keepalive(
        &mut self,
        envoy: &str,
        vm: &str,
        reconcile: Option<(&[u64], u64)>,
        now: Instant,
    ) -> Vec<(KeyDigest, MemHold)> {
        let prefix = format!("{vm}/");
        let mut ended = Vec::new();
        for (d, v) in &mut self.holds {
            v.retain_mut(|h| {
                let Some(n) = h
                    .hold
                    .as_ref()
                    .filter(|(_, e)| e == envoy)
                    .and_then(|(id, _)| id.strip_prefix(&prefix))
                    .and_then(|n| n.parse::<u64>().ok())
                else {
                    return true;
                };
                if h.pending {
                    return true;
                }
                if let Some((open, next)) = reconcile {
                    if n < next && !open.contains(&n) {
                        ended.push((d.clone(), h.clone()));
                        return false;
                    }
                }
                h.expires = now + Duration::from_secs(h.ttl_s);
                true
            });
        }
        self.holds.retain(|_, v| !v.is_empty());
        ended
    }

    /// Removes and returns the holds that lapsed by `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<(KeyDigest, MemHold)> {
        let mut gone = Vec::new();
        for (d, v) in &mut self.holds {
            v.retain(|h| {
                let keep = h.pending || h.expires > now;
                if !keep {
                    gone.push((d.clone(), h.clone()));
                }
                keep
            });
        }
        self.holds.retain(|_, v| !v.is_empty());
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockmesh_core::LockKey;

    fn hold(grant: &str, who: &str, instance: Option<&str>, hold: Option<&str>, now: Instant) -> MemHold {
        MemHold {
            grant: grant.into(),
            key: "jobs/a".into(),
            class: "batch".into(),
            identity: who.into(),
            instance: instance.map(str::to_owned),
            hold: hold.map(|h| (h.to_owned(), "spiffe://td/envoy".to_owned())),
            ttl_s: 10,
            expires: now + Duration::from_secs(10),
            outage: "coord-1".into(),
            epoch: 1,
            pending: true,
        }
    }

    #[test]
    fn the_limit_counts_pending_holds_and_releases_need_the_holder() {
        let now = Instant::now();
        let d = LockKey::parse(b"jobs/a").unwrap().digest();
        let mut m = Memory::default();
        assert_eq!(m.reserve(&d, hold("g1", "a", None, None, now), 1), Reserve::Reserved);
        // Pending still counts: a concurrent grant cannot pass the limit.
        assert_eq!(m.reserve(&d, hold("g2", "b", None, None, now), 1), Reserve::Full);
        // A pending hold cannot be released before it was answered.
        assert!(m.remove(&d, "g1", |_| true).is_none());
        m.confirm(&d, "g1");
        assert!(m.remove(&d, "g1", |h| h.identity == "b").is_none(), "another identity");
        assert!(m.remove(&d, "g1", |h| h.identity == "a").is_some());
        assert!(m.is_empty());
        // N holders, and the same identity+instance twice is a leak.
        assert_eq!(m.reserve(&d, hold("g3", "a", Some("i1"), None, now), 2), Reserve::Reserved);
        assert_eq!(m.reserve(&d, hold("g4", "a", Some("i1"), None, now), 2), Reserve::Leaked);
        assert_eq!(m.reserve(&d, hold("g5", "b", None, None, now), 2), Reserve::Reserved);
        assert_eq!(m.reserve(&d, hold("g6", "c", None, None, now), 2), Reserve::Full);
        m.unreserve(&d, "g5");
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn holds_expire_and_vm_keepalives_renew_or_reconcile_them() {
        let now = Instant::now();
        let d = LockKey::parse(b"jobs/a").unwrap().digest();
        let e = LockKey::parse(b"jobs/b").unwrap().digest();
        let vm = "0123456789abcdef0123456789abcdef";
        let mut m = Memory::default();
        for (dd, g, n) in [(&d, "g1", 1), (&e, "g2", 2)] {
            assert_eq!(m.reserve(dd, hold(g, "a", None, Some(&format!("{vm}/{n}")), now), 1), Reserve::Reserved);
            m.confirm(dd, g);
        }
        assert_eq!(m.find_hold(&d, &format!("{vm}/1"), "spiffe://td/envoy"), Some("g1".into()));
        assert_eq!(m.find_hold(&d, &format!("{vm}/1"), "spiffe://td/other"), None);
        // Renewed at +8 s: alive at +15 s.
        assert!(m.vm_keepalive("spiffe://td/envoy", vm, None, now + Duration::from_secs(8)).is_empty());
        assert!(m.expire(now + Duration::from_secs(15)).is_empty());
        // Reconcile: hold 1 ended (below next, not open), hold 2 still open.
        let ended = m.vm_keepalive("spiffe://td/envoy", vm, Some((&[2], 3)), now + Duration::from_secs(16));
        assert_eq!(ended.iter().map(|(_, h)| h.grant.as_str()).collect::<Vec<_>>(), ["g1"]);
        let gone = m.expire(now + Duration::from_secs(27));
        assert_eq!(gone.iter().map(|(_, h)| h.grant.as_str()).collect::<Vec<_>>(), ["g2"]);
        assert!(m.is_empty() && !m.held(&e));
    }
}
