//! Fencing tokens (ADR-02): `epoch x 2^48 + R`, where `R` is the etcd revision at
//! which the granting transaction committed. Revisions are cluster-wide, strictly
//! increasing and never reused within a cluster's life; the epoch moves the whole
//! space above anything issued before a restore (ADR-03). The epoch stays below 2^15
//! so the packed value is positive in a signed 64-bit column.

use std::{fmt, str::FromStr};

/// Bits reserved for the revision.
pub const REVISION_BITS: u32 = 48;
/// Exclusive upper bound of a revision that may be packed.
pub const REVISION_LIMIT: u64 = 1 << REVISION_BITS;
/// Exclusive upper bound of an epoch (2^15: the token stays positive as an `i64`).
pub const EPOCH_LIMIT: u64 = 1 << 15;

/// A packed fencing token. Ordering is the packed integer's ordering, which is what
/// resources compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

/// Why a token cannot be minted or parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The epoch has reached 2^15; an epoch advance would overflow the signed column.
    #[error("epoch {0} is at or above the limit 32768")]
    EpochExhausted(u64),
    /// The etcd revision has reached 2^48; advance the epoch on a fresh cluster.
    #[error("etcd revision {0} is at or above the limit 2^48")]
    RevisionExhausted(u64),
    /// Revision 0 is never a commit revision.
    #[error("revision 0 is not a commit revision")]
    ZeroRevision,
    /// Not a canonical decimal `u64`.
    #[error("token must be a decimal integer without sign or leading zeros")]
    Malformed,
}

// === impl FencingToken ===

impl FencingToken {
    /// Packs `epoch` and a commit `revision`; refuses values that do not fit.
    pub fn mint(epoch: u64, revision: u64) -> Result<Self, TokenError> {
        if epoch >= EPOCH_LIMIT {
            return Err(TokenError::EpochExhausted(epoch));
        }
        if revision >= REVISION_LIMIT {
            return Err(TokenError::RevisionExhausted(revision));
        }
        if revision == 0 {
            return Err(TokenError::ZeroRevision);
        }
        Ok(Self((epoch << REVISION_BITS) | revision))
    }

    /// Reinterprets a packed value (as read from a header or a column).
    pub fn from_packed(v: u64) -> Result<Self, TokenError> {
        let t = Self(v);
        Self::mint(t.epoch(), t.revision())
    }

    /// The packed value.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The epoch in the top bits.
    pub fn epoch(self) -> u64 {
        self.0 >> REVISION_BITS
    }

    /// The etcd commit revision of the granting transaction.
    pub fn revision(self) -> u64 {
        self.0 & (REVISION_LIMIT - 1)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for FencingToken {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let b = s.as_bytes();
        if b.is_empty() || b.len() > 20 || !b.iter().all(u8::is_ascii_digit) || (b[0] == b'0') {
            return Err(TokenError::Malformed);
        }
        let v: u64 = s.parse().map_err(|_| TokenError::Malformed)?;
        Self::from_packed(v)
    }
}

/// A token travels in JSON as its decimal string (`"281474976710659"`): JSON
/// numbers above 2^53 lose precision in many readers.
impl serde::Serialize for FencingToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Reads the decimal string form; refuses anything [`FromStr`] refuses (including
/// the unprotected token `"0"`, which is not a fencing token).
impl<'de> serde::Deserialize<'de> for FencingToken {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn packs_and_orders_by_epoch_first() {
        let a = FencingToken::mint(1, REVISION_LIMIT - 1).unwrap();
        let b = FencingToken::mint(2, 1).unwrap();
        assert!(b > a);
        assert_eq!(b.epoch(), 2);
        assert_eq!(b.revision(), 1);
        assert_eq!(b.get(), (2 << 48) + 1);
    }

    #[test]
    fn refuses_exhausted_epoch_and_revision() {
        assert_eq!(FencingToken::mint(EPOCH_LIMIT, 1), Err(TokenError::EpochExhausted(EPOCH_LIMIT)));
        assert_eq!(FencingToken::mint(0, REVISION_LIMIT), Err(TokenError::RevisionExhausted(REVISION_LIMIT)));
        assert_eq!(FencingToken::mint(0, 0), Err(TokenError::ZeroRevision));
        assert!(FencingToken::mint(EPOCH_LIMIT - 1, REVISION_LIMIT - 1).unwrap().get() <= i64::MAX as u64);
    }

    #[test]
    fn parses_only_canonical_decimal() {
        assert_eq!("281474976710657".parse::<FencingToken>().unwrap().epoch(), 1);
        for bad in ["", "0", "01", "+1", "-1", "1.0", " 1", "abc", "99999999999999999999999"] {
            assert!(bad.parse::<FencingToken>().is_err(), "{bad:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn round_trips(epoch in 0u64..EPOCH_LIMIT, rev in 1u64..REVISION_LIMIT) {
            let t = FencingToken::mint(epoch, rev).unwrap();
            prop_assert_eq!(t.to_string().parse::<FencingToken>().unwrap(), t);
            prop_assert_eq!((t.epoch(), t.revision()), (epoch, rev));
        }

        #[test]
        fn order_is_lexicographic_on_epoch_then_revision(
            e1 in 0u64..EPOCH_LIMIT, r1 in 1u64..REVISION_LIMIT,
            e2 in 0u64..EPOCH_LIMIT, r2 in 1u64..REVISION_LIMIT,
        ) {
            let a = FencingToken::mint(e1, r1).unwrap();
            let b = FencingToken::mint(e2, r2).unwrap();
            prop_assert_eq!(a.cmp(&b), (e1, r1).cmp(&(e2, r2)));
        }
    }
}
