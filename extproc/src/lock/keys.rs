//! The etcd key layout. Every key lives under the configured root so several
//! deployments (or tests) share one etcd. A lock key appears only as its digest.
//!
//! ```text
//! <root>/sys/epoch                 {"epoch":E,"cluster_id":"..."}      no lease
//! <root>/s/<session>               session record                      session lease
//! <root>/l/<digest>/h/<slot:04>    one hold (slot 0..N-1)              session lease
//! <root>/r/<digest>                last release marker (audit)         marker lease
//! <root>/x/<session>               session-close marker (audit)        marker lease
//! <root>/sys/classmap              authoritative prefix-to-class map   no lease
//! <root>/c/<class>                 authoritative class policy          no lease
//! <root>/v/<vm>/<class>            transparent-mode VM session id      session lease
//! ```
//!
//! Holds sit in numbered slots under `h/` so a key can have N holders without a
//! migration; a mutex uses slot `0000`. A hold's create revision is its grant's
//! commit revision, so the token needs no extra state.

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

    /// The epoch record.
    pub fn epoch(&self) -> String {
        format!("{}/sys/epoch", self.root)
    }

    /// A session record.
    pub fn session(&self, s: SessionId) -> String {
        format!("{}/s/{s}", self.root)
    }

    /// The prefix of every hold of a key (`.../h/`).
    pub fn holds(&self, d: &KeyDigest) -> String {
        format!("{}/l/{d}/h/", self.root)
    }

    /// One hold slot.
    pub fn slot(&self, d: &KeyDigest, slot: u32) -> String {
        format!("{}/l/{d}/h/{slot:04}", self.root)
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
}
