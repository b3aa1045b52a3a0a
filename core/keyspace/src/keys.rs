//! The etcd key layout. Every key lives under the configured root so several
//! deployments (or tests) share one etcd. A lock key appears only as its digest.
//!
//! ```text
//! <root>/sys/epoch                 {"epoch":E,"cluster_id":"..."}      no lease
//! <root>/sys/clock                 empty; every grant puts it (restores) no lease
//! <root>/s/<session>               session record                      session lease
//! <root>/l/<digest>/h/<slot:04>    one hold (slot 0..N-1)              session lease
//! <root>/l/<digest>/h/<slot:04>.1  the same slot, after a hand-off     session lease
//! <root>/l/<digest>/e              an election leader's proclaimed value the leader's session lease
//! <root>/l/<digest>/w              exclusion record of an exclusive hold the holder's session lease
//! <root>/s/<session>/h/<digest>    hold index of an acquire-opened session the session's lease
//! <root>/s/<session>/a/<attempt>   a grant attempt fenced off (unknown outcome) marker lease
//! <root>/q/<digest>/<waiter>       a durable waiter (fairness: durable) arbiter lease
//! <root>/r/<digest>                last release marker (audit)         marker lease
//! <root>/x/<session>               session-close marker (audit)        marker lease
//! <root>/sys/classmap              authoritative prefix-to-class map   no lease
//! <root>/c/<class>                 authoritative class policy          no lease
//! <root>/v/<vm>/<class>            transparent-mode VM session id      session lease
//! <root>/u/<grant>/<op>            a shipped unprotected-grant record   ship lease (10 min)
//! <root>/g/<digest>                lock-delay guard: the holder's session no lease
//! <root>/d/<digest>                lock-delay in force (cause, delay)   delay lease (lock_delay_s)
//! <root>/w/<class>                 latest shadow decision (audit)      no lease
//! ```
//!
//! The last two exist only for keys of classes with `lock_delay_s`
//! (`lockmesh_lock::delay`): every grant of such a key puts its guard, every
//! release deletes it, so a guard whose hold is gone marks an end without a
//! release (an expiry or a force release), which an arbiter turns into the delay
//! record on a lease of the class's delay.
//!
//! An election (`lockmesh_lock::election`) is a mutex key: its leader is its hold.
//! The value its leader proclaims sits beside the slots (`e`, outside `h/`, so no
//! grant compare sees it), naming the token it was proclaimed under, so one watch
//! of `l/<digest>/` orders every leadership change and every proclamation. Readers
//! of holds ignore it: it is no slot ([`Keys::slot_of`]) and its value is no
//! [`crate::HoldRecord`]. No earlier build reads it, so it needs no capability
//! (`crate::upgrade`).
//!
//! Holds sit in numbered slots under `h/` so a key can have N holders without a
//! migration; a mutex uses slot `0000`. A hold's create revision is its grant's
//! commit revision, so the token needs no extra state.
//!
//! A slot has two names, `<slot:04>` and `<slot:04>.1`, both inside the slot's
//! range `[<slot:04>, <slot+1:04>)`, and at most one of them exists. A hand-off
//! (`mutex`) deletes the releasing hold and creates the next holder's under the
//! slot's other name in one transaction: etcd refuses a transaction that deletes
//! and puts the same key, and overwriting the key would keep its create revision
//! (the old holder's token). Grants compare the whole slot range empty.

use lockmesh_core::{headers::SessionId, KeyDigest};

/// Key builder for one root prefix.
#[derive(Clone, Debug)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// `root` without a trailing slash, e.g. `/lockmesh`.
    pub fn new(root: &str) -> Self {
        Self { root: root.trim_end_matches('/').to_owned() }
    }

    /// The root, without a trailing slash.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// The epoch record.
    pub fn epoch(&self) -> String {
        format!("{}/sys/epoch", self.root)
    }

    /// The grant clock: every grant and hand-off puts it, so its mod revision is
    /// the latest grant's commit revision; a restore brings back an older one
    /// (`lockmesh_lock::seal`).
    pub fn clock(&self) -> String {
        format!("{}/sys/clock", self.root)
    }

    /// A session record.
    pub fn session(&self, s: SessionId) -> String {
        format!("{}/s/{s}", self.root)
    }

    /// Everything of a key under `l/`: its hold slots and its election value.
    pub fn lock_entries(&self, d: &KeyDigest) -> String {
        format!("{}/l/{d}/", self.root)
    }

    /// The value an election's leader proclaimed ([`crate::ElectionValue`]).
    pub fn election_value(&self, d: &KeyDigest) -> String {
        format!("{}/l/{d}/e", self.root)
    }

    /// The exclusion record of a key: put by an exclusive grant (`x-lock-mode:
    /// exclusive`) in its own transaction, on its session's lease, created at the
    /// grant's revision; every other grant of the key compares it absent, so no
    /// change of the key's limit can seat a holder beside an exclusive one. Outside
    /// `h/`: no slot, no hold record.
    pub fn exclusion(&self, d: &KeyDigest) -> String {
        format!("{}/l/{d}/w", self.root)
    }

    /// The hold index of a session an acquire opened for itself: one key per key
    /// it holds, put by the grant and deleted by the release, on the session's
    /// lease. Closing such a session at its last release compares this range empty
    /// in the closing transaction (`lockmesh_lock::session`).
    ///
    /// It and [`Keys::attempt`] sit under the session's own prefix, beside (not at)
    /// its record: every reader of `s/`, of this build and of earlier ones (the
    /// quota ledger, the audit decoder, the gate checker), reads only session
    /// records there and ignores a key that is none, and the arbiter role already
    /// covers `s/`.
    pub fn hold_index(&self, s: SessionId, d: &KeyDigest) -> String {
        format!("{}/s/{s}/h/{d}", self.root)
    }

    /// The prefix of a session's hold index ([`Keys::hold_index`]).
    pub fn hold_indexes(&self, s: SessionId) -> String {
        format!("{}/s/{s}/h/", self.root)
    }

    /// A grant attempt's fence: every grant on a session the caller keeps
    /// compares this key absent; an arbiter that got no answer for the grant puts
    /// it in a transaction of its own, after which the grant can no longer
    /// commit, and reads whether it had (`lockmesh_lock::mutex`).
    pub fn attempt(&self, s: SessionId, id: &str) -> String {
        format!("{}/s/{s}/a/{id}", self.root)
    }

    /// The prefix of every hold of a key (`.../h/`).
    pub fn holds(&self, d: &KeyDigest) -> String {
        format!("{}/l/{d}/h/", self.root)
    }

    /// One hold slot.
    pub fn slot(&self, d: &KeyDigest, slot: u32) -> String {
        format!("{}/l/{d}/h/{slot:04}", self.root)
    }

    /// The slot's other name: `<slot:04>` <-> `<slot:04>.1` (see the module docs).
    pub fn other_name(hold_key: &[u8]) -> Vec<u8> {
        match hold_key.strip_suffix(b".1") {
            Some(base) => base.to_vec(),
            None => [hold_key, b".1"].concat(),
        }
    }

    /// The slot number of a hold key's last segment (`0003` or `0003.1`).
    pub fn parse_slot(last: &str) -> Option<u32> {
        let n = last.strip_suffix(".1").unwrap_or(last);
        if n.len() < 4 || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        n.parse().ok()
    }

    /// The slot of a hold key, when it is one.
    pub fn slot_of(&self, hold_key: &[u8]) -> Option<u32> {
        let s = std::str::from_utf8(hold_key).ok()?;
        let rest = s.strip_prefix(&self.all_locks())?;
        let (_, slot) = rest.split_once("/h/")?;
        Self::parse_slot(slot)
    }

    /// The prefix of every durable waiter of every key.
    pub fn all_waiters(&self) -> String {
        format!("{}/q/", self.root)
    }

    /// The prefix of a key's durable waiters (`fairness: durable`).
    pub fn waiters(&self, d: &KeyDigest) -> String {
        format!("{}/q/{d}/", self.root)
    }

    /// One durable waiter: `<arbiter lease:016x>-<seq:016x>`.
    pub fn waiter(&self, d: &KeyDigest, lease: i64, seq: u64) -> String {
        format!("{}/q/{d}/{lease:016x}-{seq:016x}", self.root)
    }

    /// The prefix of every session record.
    pub fn all_sessions(&self) -> String {
        format!("{}/s/", self.root)
    }

    /// The prefix of all holds of all keys.
    pub fn all_locks(&self) -> String {
        format!("{}/l/", self.root)
    }

    /// Digest of the key a hold key belongs to.
    pub fn digest_of_hold(&self, hold_key: &[u8]) -> Option<KeyDigest> {
        let s = std::str::from_utf8(hold_key).ok()?;
        let rest = s.strip_prefix(&self.all_locks())?;
        KeyDigest::parse(rest.split('/').next()?)
    }

    /// The release marker of a key.
    pub fn release_marker(&self, d: &KeyDigest) -> String {
        format!("{}/r/{d}", self.root)
    }

    /// The session of a transparent-mode filter VM for one class (value: the session
    /// id; on the session's lease, so it goes with it).
    pub fn vm_session(&self, vm: &str, class: &str) -> String {
        format!("{}/v/{vm}/{class}", self.root)
    }

    /// The prefix of every session of a filter VM.
    pub fn vm_sessions(&self, vm: &str) -> String {
        format!("{}/v/{vm}/", self.root)
    }

    /// The authoritative prefix-to-class map (`lock::policy`).
    pub fn class_map(&self) -> String {
        format!("{}/sys/classmap", self.root)
    }

    /// The authoritative policy of a class.
    pub fn class_policy(&self, class: &str) -> String {
        format!("{}/c/{class}", self.root)
    }

    /// The prefix of every class policy.
    pub fn class_policies(&self) -> String {
        format!("{}/c/", self.root)
    }

    /// The close marker of a session.
    pub fn close_marker(&self, s: SessionId) -> String {
        format!("{}/x/{s}", self.root)
    }

    /// The force-release record of a key (an approved admin force release).
    pub fn force_record(&self, d: &KeyDigest) -> String {
        format!("{}/f/{d}", self.root)
    }

    /// The shadow-decision audit record of a class (`lockmesh_lock::shadow`).
    pub fn shadow_record(&self, class: &str) -> String {
        format!("{}/w/{class}", self.root)
    }

    /// The lock-delay guard of a key (`lockmesh_lock::delay`).
    pub fn delay_guard(&self, d: &KeyDigest) -> String {
        format!("{}/g/{d}", self.root)
    }

    /// The lock-delay record of a key (`lockmesh_lock::delay`).
    pub fn lock_delay(&self, d: &KeyDigest) -> String {
        format!("{}/d/{d}", self.root)
    }

    /// A shipped unprotected-grant record (`failopen`): `op` is grant, release or
    /// expiry of grant id `grant`. The audit tailer reads it from the history.
    pub fn unprotected(&self, grant: &str, op: &str) -> String {
        format!("{}/u/{grant}/{op}", self.root)
    }
}

/// The end of the range of every key starting with `prefix` (etcd's prefix end:
/// the prefix with its last byte incremented).
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockmesh_core::LockKey;

    #[test]
    fn layout_never_contains_the_raw_key() {
        let k = Keys::new("/t/x/");
        let key = LockKey::parse(b"payments/secret-order").unwrap();
        let d = key.digest();
        let slot = k.slot(&d, 0);
        assert!(slot.starts_with("/t/x/l/") && slot.ends_with("/h/0000"));
        assert!(!slot.contains("secret"));
        assert!(slot.starts_with(&k.holds(&d)));
        assert_eq!(k.digest_of_hold(slot.as_bytes()), Some(d));
        assert_eq!(k.session(SessionId::from_lease(0x1f).unwrap()), "/t/x/s/000000000000001f");
    }

    #[test]
    fn a_slots_two_names_sort_inside_its_range() {
        let k = Keys::new("/t");
        let d = LockKey::parse(b"ns/k").unwrap().digest();
        let (s0, s1) = (k.slot(&d, 0), k.slot(&d, 1));
        let alt = Keys::other_name(s0.as_bytes());
        assert_eq!(alt, format!("{s0}.1").into_bytes());
        assert_eq!(Keys::other_name(&alt), s0.as_bytes());
        assert!(s0.as_bytes() < alt.as_slice() && alt.as_slice() < s1.as_bytes());
        assert_eq!(k.slot_of(&alt), Some(0));
        assert_eq!(k.slot_of(s1.as_bytes()), Some(1));
        assert_eq!(k.slot_of(k.waiters(&d).as_bytes()), None);
        assert_eq!(Keys::parse_slot("12"), None);
        assert_eq!(Keys::parse_slot("0012.2"), None);
        assert!(k.waiter(&d, 1, 2).starts_with(&k.waiters(&d)));
        assert!(!k.waiter(&d, 1, 2).starts_with(&k.all_locks()));
        assert!(k.waiter(&d, 1, 2).starts_with(&k.all_waiters()));
    }

    #[test]
    fn an_election_value_sits_beside_the_slots_and_is_none() {
        let k = Keys::new("/t");
        let d = LockKey::parse(b"ns/leader").unwrap().digest();
        let e = k.election_value(&d);
        assert!(e.starts_with(&k.lock_entries(&d)) && k.holds(&d).starts_with(&k.lock_entries(&d)));
        assert!(!e.starts_with(&k.holds(&d)), "a grant compares the slots' range empty");
        assert_eq!(k.slot_of(e.as_bytes()), None);
        let v = crate::ElectionValue { token: "281474976710659".into(), value: "a".into(), proclaimed_ms: 1 };
        let bytes = serde_json::to_vec(&v).unwrap();
        assert!(serde_json::from_slice::<crate::HoldRecord>(&bytes).is_err(), "no reader takes it for a hold");
        assert_eq!(serde_json::from_slice::<crate::ElectionValue>(&bytes).unwrap(), v);
    }
}
