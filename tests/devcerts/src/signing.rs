//! The Ed25519 key the arbiter signs grant proofs with and fences verify
//! (docs/FENCING.md), for tests and the local demo.

use std::path::{Path, PathBuf};

use anyhow::Result;

/// Key id of the dev and test signing key.
pub const DEV_KEY_ID: &str = "dev1";
/// File name of the signing key (PKCS#8 PEM) in a cert dir.
pub const SIGNING_KEY_FILE: &str = "grant-signing-key.pem";
/// File name of its public key (SPKI PEM).
pub const SIGNING_PUB_FILE: &str = "grant-signing-pub.pem";

/// The grant signing key files in a directory.
#[derive(Clone, Debug)]
pub struct SigningKey {
    /// Key id.
    pub kid: String,
    /// PKCS#8 PEM private key.
    pub key_file: PathBuf,
    /// SPKI PEM public key.
    pub pub_file: PathBuf,
}

/// Writes an Ed25519 signing key pair into `dir` unless one is there (idempotent).
pub fn ensure_signing_key(dir: &Path) -> Result<SigningKey> {
    let key_file = dir.join(SIGNING_KEY_FILE);
    let pub_file = dir.join(SIGNING_PUB_FILE);
    if !(key_file.is_file() && pub_file.is_file()) {
        std::fs::create_dir_all(dir)?;
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)?;
        std::fs::write(&key_file, kp.serialize_pem())?;
        std::fs::write(&pub_file, kp.public_key_pem())?;
    }
    Ok(SigningKey { kid: DEV_KEY_ID.into(), key_file, pub_file })
}

impl SigningKey {
    /// The arbiter config block naming this key.
    pub fn arbiter_yaml(&self) -> String {
        format!("signing: {{ key_file: {:?}, key_id: {:?} }}", self.key_file.display().to_string(), self.kid)
    }
}
