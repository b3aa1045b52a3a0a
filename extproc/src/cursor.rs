//! Election observers' cursors (`x-lock-after`, docs/API.md "Elections"): an etcd
//! revision sealed so that an observer can hand it back but not read it.
//!
//! A token, revision or session id is shown only to its holder (docs/GUARANTEES.md,
//! G7). An observer resumes from a revision of the election's history, and the
//! revision of a leadership change that is a grant *is* the leader's token's
//! revision (and on a quiet cluster the latest revision may be another key's
//! grant). So answers carry the revision sealed:
//!
//! ```text
//! cursor = hex( tag || (revision XOR pad) )                16 bytes, 32 hex digits
//! tag    = HMAC-SHA256(K, "tag" 0 cluster 0 key digest 0 revision)[..8]
//! pad    = HMAC-SHA256(K, "pad" 0 tag)[..8]
//! ```
//!
//! Opening unpads the revision and recomputes its tag: a cursor made for another
//! cluster or key, under another `K`, or altered does not open, and the arbiter
//! answers the state now with `gap: true`. `K` is derived from the grant-signing
//! key when the arbiter has one (the arbiters of a deployment share it, so a
//! cursor resumes on any of them and across restarts), else drawn at random when
//! the arbiter starts (a cursor resumes only on the arbiter that answered it, until
//! it restarts).

use lockmesh_core::{headers::ELECTION_CURSOR_LEN, KeyDigest};
use ring::hmac;

use crate::signing::Signer;

/// The label `K` is derived under from the signing key.
const LABEL: &str = "lockmesh/election-cursor/v1";

/// The cursor sealing key `K`. Debug output never shows it.
pub struct CursorKey {
    key: hmac::Key,
    /// Whether `K` comes from the signing key (shared by the deployment).
    shared: bool,
}

// === impl CursorKey ===

impl CursorKey {
    /// `K` from `signer`'s key, or random when there is none.
    pub fn new(signer: Option<&Signer>) -> Self {
        let (secret, shared) = match signer {
            Some(s) => (s.derive_secret(LABEL), true),
            None => (rand::random::<[u8; 32]>(), false),
        };
        Self { key: hmac::Key::new(hmac::HMAC_SHA256, &secret), shared }
    }

    /// Whether cursors open on every arbiter sharing the signing key.
    pub fn shared(&self) -> bool {
        self.shared
    }

    fn tag(&self, cluster: &str, d: &KeyDigest, revision: i64) -> [u8; 8] {
        let msg = format!("tag\0{cluster}\0{d}\0{revision}");
        first8(hmac::sign(&self.key, msg.as_bytes()).as_ref())
    }

    fn pad(&self, tag: &[u8; 8]) -> [u8; 8] {
        let mut msg = b"pad\0".to_vec();
        msg.extend_from_slice(tag);
        first8(hmac::sign(&self.key, &msg).as_ref())
    }

    /// The cursor of `revision` of key `d`'s history on `cluster`.
    pub fn seal(&self, cluster: &str, d: &KeyDigest, revision: i64) -> String {
        let tag = self.tag(cluster, d, revision);
        let pad = self.pad(&tag);
        let body = u64::from_be_bytes(revision.to_be_bytes()) ^ u64::from_be_bytes(pad);
        let mut out = String::with_capacity(ELECTION_CURSOR_LEN);
        for b in tag.iter().chain(body.to_be_bytes().iter()) {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }

    /// The revision `cursor` seals for key `d` on `cluster`, if it opens here.
    pub fn open(&self, cluster: &str, d: &KeyDigest, cursor: &str) -> Option<i64> {
        if cursor.len() != ELECTION_CURSOR_LEN {
            return None;
        }
        let bytes: Vec<u8> =
            (0..16).map(|i| u8::from_str_radix(cursor.get(2 * i..2 * i + 2)?, 16).ok()).collect::<Option<_>>()?;
        let tag = first8(&bytes[..8]);
        let body = u64::from_be_bytes(first8(&bytes[8..]));
        let revision = i64::from_be_bytes((body ^ u64::from_be_bytes(self.pad(&tag))).to_be_bytes());
        // Compared without an early exit: the tag is a MAC.
        let diff = self.tag(cluster, d, revision).iter().zip(&tag).fold(0u8, |acc, (x, y)| acc | (x ^ y));
        let ok = diff == 0;
        (ok && revision > 0).then_some(revision)
    }
}

impl std::fmt::Debug for CursorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CursorKey").field("shared", &self.shared).finish_non_exhaustive()
    }
}

fn first8(b: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    for (o, i) in out.iter_mut().zip(b) {
        *o = *i;
    }
    out
}

#[cfg(test)]
mod tests {
    use lockmesh_core::LockKey;

    use super::*;

    fn digest(k: &str) -> KeyDigest {
        LockKey::parse(k.as_bytes()).unwrap().digest()
    }

    #[test]
    fn a_cursor_opens_only_for_its_cluster_and_key_under_its_key_and_shows_no_revision() {
        let k = CursorKey::new(None);
        let (a, b) = (digest("payments/leader"), digest("payments/other"));
        for rev in [1_i64, 2, 7, 281_474_976_710_655, i64::MAX] {
            let c = k.seal("coord", &a, rev);
            assert_eq!(c.len(), ELECTION_CURSOR_LEN);
            assert!(lockmesh_core::headers::parse_after(c.as_bytes()).is_ok(), "{c}");
            assert!(!c.contains(&format!("{rev:x}")) || rev < 16, "{c} shows {rev:x}");
            assert!(!c.contains(&rev.to_string()) || rev < 1000, "{c} shows {rev}");
            assert_eq!(k.open("coord", &a, &c), Some(rev));
            assert_eq!(k.open("shard-1", &a, &c), None, "another cluster");
            assert_eq!(k.open("coord", &b, &c), None, "another key");
            assert_eq!(CursorKey::new(None).open("coord", &a, &c), None, "another arbiter's random key");
            // Any altered digit fails.
            for i in 0..c.len() {
                let mut bytes = c.clone().into_bytes();
                bytes[i] = if bytes[i] == b'0' { b'1' } else { b'0' };
                assert_eq!(k.open("coord", &a, std::str::from_utf8(&bytes).unwrap()), None, "digit {i} of {c}");
            }
        }
        // Consecutive revisions share no visible structure (the pad depends on the tag).
        let (c1, c2) = (k.seal("coord", &a, 41), k.seal("coord", &a, 42));
        assert_ne!(c1[16..], c2[16..]);
        assert_eq!(k.open("coord", &a, "not hex at all, thirty-two chars"), None);
        assert_eq!(k.open("coord", &a, "00"), None);
        assert!(!k.shared() && format!("{k:?}") == "CursorKey { shared: false, .. }");
    }

    #[test]
    fn arbiters_sharing_a_signing_key_open_each_others_cursors() {
        let signer = |seed: u8| {
            let kid = lockmesh_core::proof::KeyId::parse("k1").unwrap();
            Signer::new(kid, ed25519_dalek::SigningKey::from_bytes(&[seed; 32]))
        };
        let (one, two, other) =
            (CursorKey::new(Some(&signer(7))), CursorKey::new(Some(&signer(7))), CursorKey::new(Some(&signer(8))));
        let d = digest("payments/leader");
        let c = one.seal("coord", &d, 99);
        assert!(one.shared());
        assert_eq!(two.open("coord", &d, &c), Some(99));
        assert_eq!(other.open("coord", &d, &c), None);
    }
}
