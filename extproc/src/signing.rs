//! Grant proofs (`lockmesh_core::proof`): the arbiter signs each grant with an
//! Ed25519 key so fences can verify offline that a token was granted for the lock
//! that guards their resource.
//!
//! The key is a PKCS#8 PEM file (`-----BEGIN PRIVATE KEY-----`, as written by
//! `openssl genpkey -algorithm ed25519` or `lockmesh-devcerts`), named with its key id
//! in the config's `signing` block. Without a `signing` block the arbiter serves and
//! omits proofs; fence-proxy then refuses every write of its callers
//! (`grant_required`). Rotation: see `docs/FENCING.md`.

use std::{fmt, path::Path};

use ed25519_dalek::{pkcs8::DecodePrivateKey as _, SigningKey};
use lockmesh_core::{
    proof::{self, GrantClaims, KeyId},
    ClassName, FencingToken, LockKey,
};

/// The arbiter's signing key and its id. Debug output never shows the key.
#[derive(Clone)]
pub struct Signer {
    kid: KeyId,
    key: SigningKey,
}

// === impl Signer ===

impl Signer {
    /// A signer from key material (tests, tools).
    pub fn new(kid: KeyId, key: SigningKey) -> Self {
        Self { kid, key }
    }

    /// Loads a PKCS#8 PEM Ed25519 private key. The error names the file, never
    /// the key's bytes.
    pub fn load(path: &Path, kid: &str) -> Result<Self, String> {
        let kid = KeyId::parse(kid).map_err(|e| format!("key_id: {e}"))?;
        let pem =
            std::fs::read_to_string(path).map_err(|e| format!("key_file: cannot read {}: {e}", path.display()))?;
        let key = SigningKey::from_pkcs8_pem(&pem).map_err(|_| {
            format!("key_file: {} is not a PKCS#8 PEM Ed25519 private key (BEGIN PRIVATE KEY)", path.display())
        })?;
        Ok(Self { kid, key })
    }

    /// The key id.
    pub fn kid(&self) -> &KeyId {
        &self.kid
    }

    /// The public key, 32 bytes.
    pub fn public_key(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    /// Signs one grant.
    pub fn sign(&self, claims: &GrantClaims) -> String {
        proof::sign(&self.key, &self.kid, claims)
    }

    /// A secret for another purpose, derived from the signing key under `label`
    /// (SHA-256 of the label, a zero byte and the key): every arbiter with this
    /// key derives the same one, and it tells nothing about the key
    /// (`crate::cursor`).
    pub fn derive_secret(&self, label: &str) -> [u8; 32] {
        let mut msg = label.as_bytes().to_vec();
        msg.push(0);
        msg.extend_from_slice(&self.key.to_bytes());
        let d = ring::digest::digest(&ring::digest::SHA256, &msg);
        let mut out = [0u8; 32];
        out.copy_from_slice(d.as_ref());
        out
    }
}

impl fmt::Debug for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Signer({})", self.kid)
    }
}

/// The proof for a grant of `key` with `token` in `class`, or `None` when no signing
/// key is configured (or `class` is not a valid class name, which a grant's class
/// always is). Used by the acquire answer and by transparent mode.
pub(crate) fn proof_for(signer: Option<&Signer>, key: &LockKey, token: FencingToken, class: &str) -> Option<String> {
    let signer = signer?;
    let class = ClassName::parse(class).ok()?;
    Some(signer.sign(&GrantClaims::new(key, token, class)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockmesh_core::proof::{GrantProof, Verifier};

    #[test]
    fn proofs_verify_with_the_public_key_and_name_the_grant() {
        let s = Signer::new(KeyId::parse("k1").unwrap(), SigningKey::from_bytes(&[7; 32]));
        let key = LockKey::parse(b"ns/a").unwrap();
        let t = FencingToken::mint(1, 42).unwrap();
        let text = proof_for(Some(&s), &key, t, "default").unwrap();
        let mut v = Verifier::new();
        v.insert(s.kid().clone(), ed25519_dalek::VerifyingKey::from_bytes(&s.public_key()).unwrap());
        let p = GrantProof::parse(text.as_bytes()).unwrap();
        let c = v.verify(&p).unwrap();
        assert_eq!((c.key.clone(), c.token, c.class.as_str()), (key.digest(), t, "default"));
        assert_eq!(proof_for(None, &key, t, "default"), None);
        assert!(!format!("{s:?}").contains("7"));
    }

    #[test]
    fn load_names_the_field_and_refuses_non_pem() {
        let dir = std::env::temp_dir().join(format!("lockmesh-signing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.pem");
        std::fs::write(&p, "not a key").unwrap();
        assert!(Signer::load(&p, "k1").unwrap_err().starts_with("key_file: "));
        assert!(Signer::load(&p, "K 1").unwrap_err().starts_with("key_id: "));
        assert!(Signer::load(&dir.join("missing.pem"), "k1").unwrap_err().contains("cannot read"));
        let pem = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIAcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcH\n-----END PRIVATE KEY-----\n";
        std::fs::write(&p, pem).unwrap();
        let s = Signer::load(&p, "k1").unwrap();
        assert_eq!(s.public_key(), SigningKey::from_bytes(&[7; 32]).verifying_key().to_bytes());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
