//! Grant proofs: the arbiter's Ed25519 signature over one grant, so a fence can check
//! offline that a token was granted for the lock that guards its resource.
//!
//! Tokens are comparable across keys (they are etcd revisions), so a fence that only
//! compared numbers would let a genuine, higher token of another lock through, and a
//! made-up large number would raise its mark for good. A proof binds the token to the
//! key (as its [`KeyDigest`], never the raw key), the class and the signing key id.
//!
//! # Wire form
//!
//! ```text
//! v1.<kid>.<base64url(payload)>.<base64url(signature)>        (no padding)
//! payload   = "<key digest, 64 hex>:<token, decimal>:<class>"
//! signed    = "lockmesh/grant-proof/v1\0" || kid || "\0" || payload
//! ```
//!
//! The key id is inside the signed message, so a proof cannot be replayed under
//! another key id. The whole text is at most [`MAX_PROOF_LEN`] bytes; the parser is
//! strict (one canonical form, no padding, no whitespace) and never echoes input.
//!
//! Verification needs the `proof` cargo feature (ed25519-dalek); the Wasm filter
//! builds core without it.

use std::{collections::BTreeMap, fmt};

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};

use crate::{ClassName, FencingToken, KeyDigest, LockKey};

/// Version prefix of the wire form.
pub const VERSION: &str = "v1";
/// Domain separator of the signed message: a proof signature is never a valid
/// signature of anything else lockmesh signs.
pub const SIGNING_DOMAIN: &[u8] = b"lockmesh/grant-proof/v1\0";
/// Longest proof text accepted, in bytes.
pub const MAX_PROOF_LEN: usize = 512;
/// Longest key id, in bytes.
pub const MAX_KEY_ID_LEN: usize = 32;

/// A signing key id: 1-32 characters of `[a-z0-9_-]`, chosen by the operator
/// (e.g. `k2026-01`). Fences look the public key up by it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(String);

/// What a proof asserts: the arbiter granted `token` on the key with digest `key`,
/// of class `class`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantClaims {
    /// Digest of the granted key.
    pub key: KeyDigest,
    /// The grant's fencing token.
    pub token: FencingToken,
    /// The key's class at grant time.
    pub class: ClassName,
}

/// A parsed, not yet verified, proof.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantProof {
    kid: KeyId,
    claims: GrantClaims,
    payload: String,
    signature: [u8; 64],
}

/// The public keys a fence trusts, by key id (several during a rotation).
#[derive(Clone, Debug, Default)]
pub struct Verifier {
    keys: BTreeMap<KeyId, VerifyingKey>,
}

/// Why a proof was refused. Messages never echo the proof.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    /// Longer than [`MAX_PROOF_LEN`].
    #[error("proof is {0} bytes, above the maximum {MAX_PROOF_LEN}")]
    TooLong(usize),
    /// Not the `v1.<kid>.<payload>.<sig>` form; the field says which part.
    #[error("proof is malformed: {0}")]
    Malformed(&'static str),
    /// Signed with a key id this verifier does not trust.
    #[error("proof is signed with a key id this fence does not trust")]
    UnknownKeyId,
    /// The signature does not verify.
    #[error("proof signature does not verify")]
    BadSignature,
}

// === impl KeyId ===

impl KeyId {
    /// Validates a key id.
    pub fn parse(s: &str) -> Result<Self, String> {
        let ok = !s.is_empty()
            && s.len() <= MAX_KEY_ID_LEN
            && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(format!("key id must be 1-{MAX_KEY_ID_LEN} characters of [a-z0-9_-]"))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

// === impl GrantClaims ===

impl GrantClaims {
    /// Claims for a grant of `key`.
    pub fn new(key: &LockKey, token: FencingToken, class: ClassName) -> Self {
        Self { key: key.digest(), token, class }
    }

    /// The canonical payload text.
    pub fn payload(&self) -> String {
        format!("{}:{}:{}", self.key, self.token, self.class)
    }

    fn parse_payload(p: &str) -> Result<Self, ProofError> {
        let mut it = p.split(':');
        let (Some(d), Some(t), Some(c), None) = (it.next(), it.next(), it.next(), it.next()) else {
            return Err(ProofError::Malformed("payload must be digest:token:class"));
        };
        let key = KeyDigest::parse(d).ok_or(ProofError::Malformed("payload key digest is not 64 lowercase hex"))?;
        let token = t.parse().map_err(|_| ProofError::Malformed("payload token is not a canonical fencing token"))?;
        let class = ClassName::parse(c).map_err(|_| ProofError::Malformed("payload class is not a class name"))?;
        Ok(Self { key, token, class })
    }
}

fn signed_message(kid: &KeyId, payload: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGNING_DOMAIN.len() + kid.0.len() + 1 + payload.len());
    m.extend_from_slice(SIGNING_DOMAIN);
    m.extend_from_slice(kid.0.as_bytes());
    m.push(0);
    m.extend_from_slice(payload.as_bytes());
    m
}

/// Signs `claims` with `key` under key id `kid`, in the wire form.
pub fn sign(key: &SigningKey, kid: &KeyId, claims: &GrantClaims) -> String {
    let payload = claims.payload();
    let sig = key.sign(&signed_message(kid, &payload));
    format!("{VERSION}.{kid}.{}.{}", URL_SAFE_NO_PAD.encode(payload.as_bytes()), URL_SAFE_NO_PAD.encode(sig.to_bytes()))
}

// === impl GrantProof ===

impl GrantProof {
    /// Parses the wire form strictly. Nothing is verified yet.
    pub fn parse(raw: &[u8]) -> Result<Self, ProofError> {
        if raw.len() > MAX_PROOF_LEN {
            return Err(ProofError::TooLong(raw.len()));
        }
        let s = std::str::from_utf8(raw).map_err(|_| ProofError::Malformed("not ASCII"))?;
        let mut parts = s.split('.');
        let (Some(v), Some(kid), Some(p), Some(sig), None) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(ProofError::Malformed("must be v1.<kid>.<payload>.<signature>"));
        };
        if v != VERSION {
            return Err(ProofError::Malformed("unknown version (expected v1)"));
        }
        let kid = KeyId::parse(kid).map_err(|_| ProofError::Malformed("key id is not [a-z0-9_-]{1,32}"))?;
        let payload = URL_SAFE_NO_PAD.decode(p).map_err(|_| ProofError::Malformed("payload is not base64url"))?;
        let payload = String::from_utf8(payload).map_err(|_| ProofError::Malformed("payload is not ASCII"))?;
        let claims = GrantClaims::parse_payload(&payload)?;
        // Canonical form only: a payload that re-encodes differently is refused, so
        // one grant has exactly one proof text.
        if claims.payload() != payload {
            return Err(ProofError::Malformed("payload is not canonical"));
        }
        let sig = URL_SAFE_NO_PAD.decode(sig).map_err(|_| ProofError::Malformed("signature is not base64url"))?;
        let signature: [u8; 64] = sig.try_into().map_err(|_| ProofError::Malformed("signature is not 64 bytes"))?;
        Ok(Self { kid, claims, payload, signature })
    }

    /// The key id it claims to be signed with.
    pub fn kid(&self) -> &KeyId {
        &self.kid
    }

    /// The claims, unverified.
    pub fn claims(&self) -> &GrantClaims {
        &self.claims
    }
}

// === impl Verifier ===

impl Verifier {
    /// An empty verifier (refuses everything).
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts `key` under `kid` (replacing an earlier key of that id).
    pub fn insert(&mut self, kid: KeyId, key: VerifyingKey) {
        self.keys.insert(kid, key);
    }

    /// The trusted key ids.
    pub fn key_ids(&self) -> impl Iterator<Item = &KeyId> {
        self.keys.keys()
    }

    /// Verifies `proof` and returns its claims. Strict verification: weak and
    /// non-canonical signatures are refused.
    pub fn verify<'p>(&self, proof: &'p GrantProof) -> Result<&'p GrantClaims, ProofError> {
        let key = self.keys.get(&proof.kid).ok_or(ProofError::UnknownKeyId)?;
        let sig = Signature::from_bytes(&proof.signature);
        key.verify_strict(&signed_message(&proof.kid, &proof.payload), &sig).map_err(|_| ProofError::BadSignature)?;
        Ok(&proof.claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn claims(k: &str, t: u64) -> GrantClaims {
        GrantClaims::new(
            &LockKey::parse(k.as_bytes()).unwrap(),
            FencingToken::from_packed(t).unwrap(),
            ClassName::parse("default").unwrap(),
        )
    }

    fn verifier(kid: &str, k: &SigningKey) -> Verifier {
        let mut v = Verifier::new();
        v.insert(KeyId::parse(kid).unwrap(), k.verifying_key());
        v
    }

    #[test]
    fn signs_and_verifies_round_trip() {
        let k = key(1);
        let kid = KeyId::parse("k1").unwrap();
        let c = claims("ns/a", (1 << 48) + 7);
        let text = sign(&k, &kid, &c);
        assert!(text.starts_with("v1.k1."), "{text}");
        assert!(text.len() <= MAX_PROOF_LEN);
        let p = GrantProof::parse(text.as_bytes()).unwrap();
        assert_eq!(verifier("k1", &k).verify(&p).unwrap(), &c);
        // The raw key never appears in the proof.
        assert!(!text.contains("ns/a"));
    }

    #[test]
    fn refuses_other_keys_ids_and_tampering() {
        let k = key(1);
        let text = sign(&k, &KeyId::parse("k1").unwrap(), &claims("ns/a", (1 << 48) + 7));
        let p = GrantProof::parse(text.as_bytes()).unwrap();
        assert_eq!(verifier("k2", &k).verify(&p), Err(ProofError::UnknownKeyId));
        assert_eq!(verifier("k1", &key(2)).verify(&p), Err(ProofError::BadSignature));
        // Same signature, key id swapped: the id is signed, so it fails.
        let mut v = verifier("k1", &k);
        v.insert(KeyId::parse("k2").unwrap(), k.verifying_key());
        let swapped = text.replacen("v1.k1.", "v1.k2.", 1);
        assert_eq!(v.verify(&GrantProof::parse(swapped.as_bytes()).unwrap()), Err(ProofError::BadSignature));
        // A payload for a larger token with the old signature fails.
        let parts: Vec<&str> = text.split('.').collect();
        let forged_payload = URL_SAFE_NO_PAD.encode(claims("ns/a", (1 << 48) + 9999).payload());
        let forged = format!("v1.k1.{forged_payload}.{}", parts[3]);
        assert_eq!(v.verify(&GrantProof::parse(forged.as_bytes()).unwrap()), Err(ProofError::BadSignature));
    }

    #[test]
    fn parser_is_strict_and_bounded() {
        let k = key(1);
        let good = sign(&k, &KeyId::parse("k1").unwrap(), &claims("ns/a", 5));
        let cases: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b"garbage".to_vec(),
            b"v2.k1.a.b".to_vec(),
            b"v1.K1.a.b".to_vec(),
            format!("{good}.x").into_bytes(),
            format!("{good}=").into_bytes(),
            format!(" {good}").into_bytes(),
            good.replacen("v1.k1.", "v1.k1.AA", 1).into_bytes(),
            vec![0xff; 40],
        ];
        for c in cases {
            assert!(matches!(GrantProof::parse(&c), Err(ProofError::Malformed(_))), "{c:?}");
        }
        let long = vec![b'a'; MAX_PROOF_LEN + 1];
        assert_eq!(GrantProof::parse(&long), Err(ProofError::TooLong(MAX_PROOF_LEN + 1)));
        // A non-canonical payload (leading zero token) is refused even if signed.
        let p = format!("{}:05:default", LockKey::parse(b"ns/a").unwrap().digest());
        let msg = signed_message(&KeyId::parse("k1").unwrap(), &p);
        let bad = format!("v1.k1.{}.{}", URL_SAFE_NO_PAD.encode(&p), URL_SAFE_NO_PAD.encode(k.sign(&msg).to_bytes()));
        assert!(matches!(GrantProof::parse(bad.as_bytes()), Err(ProofError::Malformed(_))));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]
        #[test]
        fn arbitrary_bytes_never_panic_nor_verify(raw in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(p) = GrantProof::parse(&raw) {
                prop_assert!(verifier("k1", &key(1)).verify(&p).is_err());
            }
        }

        #[test]
        fn every_token_round_trips(t in 1u64..(1u64 << 62)) {
            if let Ok(tok) = FencingToken::from_packed(t) {
                let c = GrantClaims::new(&LockKey::parse(b"ns/x").unwrap(), tok, ClassName::parse("c").unwrap());
                let s = sign(&key(3), &KeyId::parse("k").unwrap(), &c);
                let p = GrantProof::parse(s.as_bytes()).unwrap();
                prop_assert_eq!(verifier("k", &key(3)).verify(&p).unwrap(), &c);
            }
        }
    }
}
