//! Operator identity: a JWT (an OIDC ID or access token) verified against a
//! configured JWKS, RS256 or ES256 only, with issuer, audience and expiry checked.
//!
//! The token itself is never logged, stored or echoed: only its `iss` and `sub`.

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};
use serde::Deserialize;

use super::AdminError;

/// Clock skew tolerated on `exp` and `nbf`, seconds.
pub const LEEWAY_S: u64 = 30;

/// One verification key of a JWKS.
#[derive(Debug, Clone)]
enum Key {
    /// RSA public key (`n`, `e`, big-endian).
    Rsa { n: Vec<u8>, e: Vec<u8> },
    /// P-256 public key, uncompressed SEC1 point (`04 || x || y`).
    P256(Vec<u8>),
}

/// A JWKS: the keys operators' tokens may be signed with, by `kid`.
#[derive(Debug, Clone)]
pub struct Jwks {
    keys: Vec<(Option<String>, Key)>,
}

#[derive(Deserialize)]
struct RawJwks {
    keys: Vec<RawJwk>,
}

#[derive(Deserialize)]
struct RawJwk {
    kty: String,
    kid: Option<String>,
    alg: Option<String>,
    crv: Option<String>,
    n: Option<String>,
    e: Option<String>,
    x: Option<String>,
    y: Option<String>,
}

/// Who an operator is: the verified token's issuer and subject.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Operator {
    /// `iss`.
    pub iss: String,
    /// `sub`.
    pub sub: String,
}

/// Verifies operators' tokens.
#[derive(Debug, Clone)]
pub struct Verifier {
    jwks: Jwks,
    issuer: String,
    audience: String,
    role: Option<String>,
    require_mfa: bool,
    max_age_s: Option<u64>,
}

#[derive(Deserialize)]
struct Header {
    alg: String,
    kid: Option<String>,
}

#[derive(Deserialize)]
struct Claims {
    iss: Option<String>,
    sub: Option<String>,
    #[serde(default)]
    aud: Option<serde_json::Value>,
    exp: Option<u64>,
    nbf: Option<u64>,
    iat: Option<u64>,
    #[serde(default)]
    roles: Vec<String>,
    #[serde(default)]
    realm_access: Option<RealmAccess>,
    #[serde(default)]
    amr: Vec<String>,
}

/// Keycloak's realm roles claim.
#[derive(Deserialize, Default)]
struct RealmAccess {
    #[serde(default)]
    roles: Vec<String>,
}

fn b64(field: &str, s: &str) -> Result<Vec<u8>, AdminError> {
    URL_SAFE_NO_PAD
        .decode(s.trim_end_matches('='))
        .map_err(|e| AdminError::Jwks(format!("{field}: not base64url: {e}")))
}

// === impl Jwks ===

impl Jwks {
    /// Parses a JWKS document (`{"keys":[...]}`); each key is named by its index
    /// in errors (`keys[1].crv`). RSA and EC P-256 keys are kept; other key types
    /// are refused rather than ignored.
    pub fn parse(text: &str) -> Result<Self, AdminError> {
        let raw: RawJwks = serde_json::from_str(text).map_err(|e| AdminError::Jwks(format!("not a JWKS: {e}")))?;
        let mut keys = Vec::new();
        for (i, k) in raw.keys.iter().enumerate() {
            let at = |f: &str| format!("keys[{i}].{f}");
            let need = |f: &str, v: &Option<String>| -> Result<Vec<u8>, AdminError> {
                let s = v.as_deref().ok_or_else(|| AdminError::Jwks(format!("{}: required", at(f))))?;
                b64(&at(f), s)
            };
            let key = match k.kty.as_str() {
                "RSA" => {
                    if k.alg.as_deref().is_some_and(|a| a != "RS256") {
                        return Err(AdminError::Jwks(format!("{}: only RS256 for an RSA key", at("alg"))));
                    }
                    Key::Rsa { n: need("n", &k.n)?, e: need("e", &k.e)? }
                }
                "EC" => {
                    if k.crv.as_deref() != Some("P-256") {
                        return Err(AdminError::Jwks(format!("{}: only P-256 (ES256)", at("crv"))));
                    }
                    let (x, y) = (need("x", &k.x)?, need("y", &k.y)?);
                    if x.len() != 32 || y.len() != 32 {
                        return Err(AdminError::Jwks(format!("{}: a P-256 coordinate is 32 bytes", at("x"))));
                    }
                    let mut p = vec![4u8];
                    p.extend(x);
                    p.extend(y);
                    Key::P256(p)
                }
                other => {
                    return Err(AdminError::Jwks(format!("{}: {other:?} is not RSA or EC", at("kty"))));
                }
            };
            keys.push((k.kid.clone(), key));
        }
        if keys.is_empty() {
            return Err(AdminError::Jwks("keys: empty".into()));
        }
        Ok(Self { keys })
    }
}

// === impl Verifier ===

impl Verifier {
    /// A verifier accepting tokens of `issuer` for `audience` signed by a key of `jwks`.
    pub fn new(jwks: Jwks, issuer: impl Into<String>, audience: impl Into<String>) -> Self {
        Self { jwks, issuer: issuer.into(), audience: audience.into(), role: None, require_mfa: false, max_age_s: None }
    }

    /// Also require a recent sign-in: `iat` present and at most `max_age_s`
    /// seconds old (the freshness of an approval). `None` or 0: no such check.
    pub fn with_max_age(mut self, max_age_s: Option<u64>) -> Self {
        self.max_age_s = max_age_s.filter(|s| *s > 0);
        self
    }

    /// Also require this role in `roles` or Keycloak's `realm_access.roles`.
    pub fn with_role(mut self, role: Option<String>) -> Self {
        self.role = role.filter(|r| !r.is_empty());
        self
    }

    /// Also require an MFA sign-in: `amr` holding `mfa`, `otp`, `hwk` or `swk`.
    pub fn with_mfa(mut self, require: bool) -> Self {
        self.require_mfa = require;
        self
    }

    /// Verifies `token` at unix time `now_s`: signature (RS256/ES256 by a JWKS key,
    /// by `kid` when the header names one), `iss`, `aud`, `exp` (required) and
    /// `nbf`, then returns the operator.
    pub fn verify(&self, token: &str, now_s: u64) -> Result<Operator, AdminError> {
        let invalid = |why: &str| AdminError::TokenInvalid(why.to_owned());
        let mut parts = token.trim().split('.');
        let (h, c, s) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(h), Some(c), Some(s), None) => (h, c, s),
            _ => return Err(invalid("not a compact JWS (three dot-separated parts)")),
        };
        let header: Header = URL_SAFE_NO_PAD
            .decode(h)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| invalid("header is not base64url JSON"))?;
        let sig = URL_SAFE_NO_PAD.decode(s).map_err(|_| invalid("signature is not base64url"))?;
        let signed = &token.trim().as_bytes()[..h.len() + 1 + c.len()];
        let candidates = self.jwks.keys.iter().filter(|(kid, _)| match (&header.kid, kid) {
            (Some(want), Some(have)) => want == have,
            _ => true,
        });
        let mut verified = false;
        for (_, key) in candidates {
            let ok = match (header.alg.as_str(), key) {
                ("RS256", Key::Rsa { n, e }) => {
                    RsaPublicKeyComponents { n, e }.verify(&signature::RSA_PKCS1_2048_8192_SHA256, signed, &sig).is_ok()
                }
                ("ES256", Key::P256(p)) => {
                    UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, p).verify(signed, &sig).is_ok()
                }
                _ => false,
            };
            if ok {
                verified = true;
                break;
            }
        }
        if !matches!(header.alg.as_str(), "RS256" | "ES256") {
            return Err(invalid("alg must be RS256 or ES256"));
        }
        if !verified {
            return Err(invalid("signature does not verify against the configured JWKS"));
        }
        let claims: Claims = URL_SAFE_NO_PAD
            .decode(c)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| invalid("claims are not base64url JSON"))?;
        let exp = claims.exp.ok_or_else(|| invalid("no exp claim"))?;
        if now_s > exp.saturating_add(LEEWAY_S) {
            return Err(AdminError::TokenExpired { ago_s: now_s - exp });
        }
        if claims.nbf.is_some_and(|nbf| nbf > now_s.saturating_add(LEEWAY_S)) {
            return Err(invalid("not valid yet (nbf)"));
        }
        if let Some(max) = self.max_age_s {
            let iat = claims.iat.ok_or_else(|| invalid("no iat claim (a sign-in time is required)"))?;
            if iat > now_s.saturating_add(LEEWAY_S) {
                return Err(invalid("issued in the future (iat)"));
            }
            let age_s = now_s.saturating_sub(iat);
            if age_s > max.saturating_add(LEEWAY_S) {
                return Err(AdminError::TokenStale { age_s, max_s: max });
            }
        }
        if claims.iss.as_deref() != Some(self.issuer.as_str()) {
            return Err(invalid("iss is not the configured issuer"));
        }
        let aud_ok = match &claims.aud {
            Some(serde_json::Value::String(a)) => *a == self.audience,
            Some(serde_json::Value::Array(v)) => v.iter().any(|a| a.as_str() == Some(self.audience.as_str())),
            _ => false,
        };
        if !aud_ok {
            return Err(invalid("aud does not contain the configured audience"));
        }
        let sub = claims.sub.filter(|s| !s.is_empty()).ok_or_else(|| invalid("no sub claim"))?;
        if let Some(role) = &self.role {
            let realm = claims.realm_access.as_ref().map_or(&[][..], |r| r.roles.as_slice());
            if !claims.roles.iter().chain(realm).any(|r| r == role) {
                return Err(AdminError::RoleMissing(role.clone()));
            }
        }
        if self.require_mfa && !claims.amr.iter().any(|a| matches!(a.as_str(), "mfa" | "otp" | "hwk" | "swk")) {
            return Err(AdminError::MfaMissing);
        }
        Ok(Operator { iss: self.issuer.clone(), sub })
    }
}

#[cfg(test)]
mod tests {
    use lockmesh_devcerts::jwt::Issuer;

    use super::*;
    use serde_json::json;

    fn claims(sub: &str, exp: u64) -> serde_json::Value {
        json!({"iss": "https://idp.test", "aud": "lockmesh-admin", "sub": sub, "exp": exp, "iat": exp - 300})
    }

    #[test]
    fn es256_tokens_verify_and_every_check_refuses() {
        let idp = Issuer::generate("k1").unwrap();
        let v = Verifier::new(Jwks::parse(&idp.jwks()).unwrap(), "https://idp.test", "lockmesh-admin");
        let now = 1_800_000_000;
        let t = idp.token(&claims("alice", now + 600)).unwrap();
        assert_eq!(v.verify(&t, now).unwrap().sub, "alice");
        assert!(matches!(
            v.verify(&idp.token(&claims("alice", now - 600)).unwrap(), now),
            Err(AdminError::TokenExpired { ago_s: 600 })
        ));
        // Another key, a tampered payload, another issuer or audience.
        let rogue = Issuer::generate("k1").unwrap();
        assert!(matches!(
            v.verify(&rogue.token(&claims("alice", now + 600)).unwrap(), now),
            Err(AdminError::TokenInvalid(_))
        ));
        let mut parts: Vec<String> = t.split('.').map(str::to_owned).collect();
        parts[1] = URL_SAFE_NO_PAD.encode(claims("mallory", now + 600).to_string());
        assert!(matches!(v.verify(&parts.join("."), now), Err(AdminError::TokenInvalid(_))));
        let mut c = claims("alice", now + 600);
        c["iss"] = json!("https://other");
        assert!(matches!(v.verify(&idp.token(&c).unwrap(), now), Err(AdminError::TokenInvalid(_))));
        c = claims("alice", now + 600);
        c["aud"] = json!(["x", "lockmesh-admin"]);
        assert!(v.verify(&idp.token(&c).unwrap(), now).is_ok());
        c["aud"] = json!("x");
        assert!(matches!(v.verify(&idp.token(&c).unwrap(), now), Err(AdminError::TokenInvalid(_))));
        // alg none and HS256 are refused.
        let none = format!("{}.{}.", URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#), parts[1]);
        assert!(matches!(v.verify(&none, now), Err(AdminError::TokenInvalid(_))));
        assert!(matches!(v.verify("garbage", now), Err(AdminError::TokenInvalid(_))));
        // Role and MFA, when required.
        let v = v.with_role(Some("lock-operator".into())).with_mfa(true);
        assert!(matches!(v.verify(&t, now), Err(AdminError::RoleMissing(_))));
        c = claims("alice", now + 600);
        c["realm_access"] = json!({"roles": ["lock-operator"]});
        assert!(matches!(v.verify(&idp.token(&c).unwrap(), now), Err(AdminError::MfaMissing)));
        c["amr"] = json!(["pwd", "otp"]);
        assert_eq!(v.verify(&idp.token(&c).unwrap(), now).unwrap().sub, "alice");
        // Freshness: iat present, not in the future, at most max_age_s old.
        let v = v.with_max_age(Some(900));
        c["iat"] = json!(now - 60);
        assert!(v.verify(&idp.token(&c).unwrap(), now).is_ok(), "signed in a minute ago: fresh");
        c["exp"] = json!(now + 7200);
        c["iat"] = json!(now - 1800);
        assert!(matches!(
            v.verify(&idp.token(&c).unwrap(), now),
            Err(AdminError::TokenStale { age_s: 1800, max_s: 900 })
        ));
        c.as_object_mut().unwrap().remove("iat");
        assert!(matches!(v.verify(&idp.token(&c).unwrap(), now), Err(AdminError::TokenInvalid(_))));
        c["iat"] = json!(now + 3600);
        assert!(matches!(v.verify(&idp.token(&c).unwrap(), now), Err(AdminError::TokenInvalid(_))));
    }

    #[test]
    fn jwks_errors_name_the_field() {
        let e = Jwks::parse(r#"{"keys":[{"kty":"EC","crv":"P-384","x":"AA","y":"AA"}]}"#).unwrap_err();
        assert!(e.to_string().contains("keys[0].crv"), "{e}");
        let e = Jwks::parse(r#"{"keys":[{"kty":"oct","k":"AA"}]}"#).unwrap_err();
        assert!(e.to_string().contains("keys[0].kty"), "{e}");
        let e = Jwks::parse(r#"{"keys":[{"kty":"RSA","e":"AQAB"}]}"#).unwrap_err();
        assert!(e.to_string().contains("keys[0].n: required"), "{e}");
    }
}
