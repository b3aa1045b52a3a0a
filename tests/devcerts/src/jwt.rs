//! Operator tokens for tests and the local demo: an ES256 issuer that mints JWTs
//! and publishes its JWKS, the shape an OIDC provider (Keycloak, ADR-20 in
//! docs/DECISIONS.md) gives the arbiter. Never part of a shipped binary: only the
//! dev PKI tool, the harness and the quick start use it.

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use ring::{
    rand::SystemRandom,
    signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING},
};

/// An ES256 signing key with a `kid`.
pub struct Issuer {
    key: EcdsaKeyPair,
    kid: String,
    rng: SystemRandom,
}

impl Issuer {
    /// A fresh P-256 key.
    pub fn generate(kid: &str) -> Result<Self, String> {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).map_err(|e| e.to_string())?;
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
            .map_err(|e| e.to_string())?;
        Ok(Self { key, kid: kid.to_owned(), rng })
    }

    /// The JWKS publishing this key.
    pub fn jwks(&self) -> String {
        let p = self.key.public_key().as_ref();
        let (x, y) = (&p[1..33], &p[33..65]);
        serde_json::json!({"keys": [{"kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig",
            "kid": self.kid, "x": URL_SAFE_NO_PAD.encode(x), "y": URL_SAFE_NO_PAD.encode(y)}]})
        .to_string()
    }

    /// Signs `claims` (a JSON object) as an ES256 JWT.
    pub fn token(&self, claims: &serde_json::Value) -> Result<String, String> {
        let h = serde_json::json!({"alg": "ES256", "typ": "JWT", "kid": self.kid});
        let signing =
            format!("{}.{}", URL_SAFE_NO_PAD.encode(h.to_string()), URL_SAFE_NO_PAD.encode(claims.to_string()));
        let sig = self.key.sign(&self.rng, signing.as_bytes()).map_err(|e| e.to_string())?;
        Ok(format!("{signing}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref())))
    }
}
