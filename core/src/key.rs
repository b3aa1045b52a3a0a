//! Lock keys and their digests.
//!
//! A key is `namespace/segment[/segment...]`, compared byte for byte: there is one
//! canonical form and anything else is refused rather than normalised, so two
//! spellings can never name two locks for one resource. In etcd, logs and metrics a
//! key appears only as its domain-separated SHA-256 digest ([`KeyDigest`]).

use std::fmt;

use sha2::{Digest, Sha256};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 512;
/// Longest namespace (the first segment), in bytes.
pub const MAX_NAMESPACE_LEN: usize = 63;
/// Domain separator of the key digest: a digest of a key is never equal to a digest
/// of anything else lockmesh hashes.
pub const DIGEST_DOMAIN: &[u8] = b"lockmesh/lock-key/v1\0";

/// A validated lock key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey(String);

/// The hex SHA-256 digest of `DIGEST_DOMAIN || key`: 64 lowercase hex characters.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyDigest(String);

/// Why a key was refused. Messages never echo the key itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key is empty")]
    Empty,
    /// Longer than [`MAX_KEY_LEN`].
    #[error("key is {0} bytes, above the maximum {MAX_KEY_LEN}")]
    TooLong(usize),
    /// A byte outside the allowed set.
    #[error("key has a character outside [A-Za-z0-9._~:@+=,-] and '/' at byte {0}")]
    BadChar(usize),
    /// Empty segment (leading, trailing or doubled `/`) or a `.`/`..` segment.
    #[error("key has an empty, '.' or '..' segment")]
    BadSegment,
    /// Only a namespace, no path below it.
    #[error("key needs a namespace and at least one more segment (namespace/name)")]
    NoPath,
    /// The namespace is not a lowercase DNS label.
    #[error("namespace must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric")]
    BadNamespace,
}

fn allowed(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"._~:@+=,-".contains(&b)
}

/// Checks a namespace: a lowercase DNS label.
pub fn valid_namespace(ns: &str) -> bool {
    let b = ns.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAMESPACE_LEN
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

// === impl LockKey ===

impl LockKey {
    /// Validates raw header bytes as a key.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if raw.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(raw.len()));
        }
        if let Some(i) = raw.iter().position(|b| !(allowed(*b) || *b == b'/')) {
            return Err(KeyError::BadChar(i));
        }
        // All bytes are ASCII now.
        let s = String::from_utf8_lossy(raw).into_owned();
        let mut segs = s.split('/');
        let ns = segs.next().unwrap_or_default();
        if ns.is_empty() {
            return Err(KeyError::BadSegment);
        }
        if !valid_namespace(ns) {
            return Err(KeyError::BadNamespace);
        }
        let mut n = 0;
        for seg in segs {
            if seg.is_empty() || seg == "." || seg == ".." {
                return Err(KeyError::BadSegment);
            }
            n += 1;
        }
        if n == 0 {
            return Err(KeyError::NoPath);
        }
        Ok(Self(s))
    }

    /// The key text. Never log it: log [`LockKey::digest`] instead.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first segment.
    pub fn namespace(&self) -> &str {
        self.0.split('/').next().unwrap_or_default()
    }

    /// The domain-separated digest used in etcd key names, logs and metrics.
    pub fn digest(&self) -> KeyDigest {
        let mut h = Sha256::new();
        h.update(DIGEST_DOMAIN);
        h.update(self.0.as_bytes());
        KeyDigest(hex(&h.finalize()))
    }

    /// True when `prefix` covers this key on a `/` boundary: `a/b` covers `a/b` and
    /// `a/b/c`, not `a/bc`.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        covers(prefix, &self.0)
    }
}

/// True when `prefix` covers `key` on a `/` boundary (an empty prefix covers all).
pub fn covers(prefix: &str, key: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty()
        || (key.starts_with(prefix) && (key.len() == prefix.len() || key.as_bytes()[prefix.len()] == b'/'))
}

fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

impl fmt::Debug for LockKey {
    /// Debug output shows the digest only, so a stray `{:?}` never logs a key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockKey({})", &self.digest().0[..16])
    }
}

// === impl KeyDigest ===

impl KeyDigest {
    /// The 64 hex characters.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Parses 64 lowercase hex characters (as shown by inspection tools).
    pub fn parse(s: &str) -> Option<Self> {
        (s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
            .then(|| Self(s.to_owned()))
    }

    /// A 16-character prefix, enough to tell keys apart in a log line.
    pub fn short(&self) -> &str {
        &self.0[..16]
    }
}

impl fmt::Display for KeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyDigest({})", self.short())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_canonical_keys() {
        let k = LockKey::parse(b"payments/orders/42").unwrap();
        assert_eq!(k.namespace(), "payments");
        assert!(k.has_prefix("payments/orders"));
        assert!(k.has_prefix("payments/orders/"));
        assert!(!k.has_prefix("payments/ord"));
        assert!(!LockKey::parse(b"payments/orders-archive").unwrap().has_prefix("payments/orders"));
    }

    #[test]
    fn refuses_non_canonical_keys() {
        let cases: &[(&[u8], KeyError)] = &[
            (b"", KeyError::Empty),
            (b"/a/b", KeyError::BadSegment),
            (b"a//b", KeyError::BadSegment),
            (b"a/b/", KeyError::BadSegment),
            (b"a/./b", KeyError::BadSegment),
            (b"a/../b", KeyError::BadSegment),
            (b"payments", KeyError::NoPath),
            (b"Payments/x", KeyError::BadNamespace),
            (b"-x/y", KeyError::BadNamespace),
            (b"a/b c", KeyError::BadChar(3)),
            (b"a/\xff", KeyError::BadChar(2)),
            (b"a/b\n", KeyError::BadChar(3)),
        ];
        for (raw, want) in cases {
            assert_eq!(LockKey::parse(raw).unwrap_err(), *want, "{raw:?}");
        }
        let long = [b"a/".as_slice(), &[b'x'; MAX_KEY_LEN]].concat();
        assert_eq!(LockKey::parse(&long).unwrap_err(), KeyError::TooLong(MAX_KEY_LEN + 2));
    }

    #[test]
    fn digest_is_domain_separated_and_stable() {
        let d = LockKey::parse(b"ns/k").unwrap().digest();
        assert_eq!(d.as_str().len(), 64);
        let mut h = Sha256::new();
        h.update(b"ns/k");
        assert_ne!(d.as_str(), hex(&h.finalize()));
        assert_eq!(d, LockKey::parse(b"ns/k").unwrap().digest());
        assert!(!format!("{:?}", LockKey::parse(b"ns/secret").unwrap()).contains("secret"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]
        #[test]
        fn never_panics_and_accepted_keys_are_canonical(raw in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(k) = LockKey::parse(&raw) {
                prop_assert_eq!(k.as_str().as_bytes(), &raw[..]);
                prop_assert!(k.as_str().len() <= MAX_KEY_LEN);
                prop_assert!(valid_namespace(k.namespace()));
            }
        }
    }
}
