//! Operator identity: a JWT (an OIDC ID or access token) verified against a
//! configured JWKS, RS256 or ES256 only, with issuer, audience and expiry checked.
//!
//! `jsonwebtoken` parses the JWKS and the token and checks the signature, the
//! algorithm, `iss` and `aud`; the times (`exp`, `nbf`, `iat`) are checked here
//! against the caller's clock (`now_s`), and so are the role and MFA claims.
//! The token itself is never logged, stored or echoed: only its `iss` and `sub`.

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use jsonwebtoken::{
    errors::{Error as JwtError, ErrorKind},
    jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm},
    Algorithm, DecodingKey, Validation,
};
use serde::Deserialize;

use super::AdminError;

/// Clock skew tolerated on `exp` and `nbf`, seconds.
pub(crate) const LEEWAY_S: u64 = 30;

/// RSA modulus sizes accepted, bits: the range this verifier enforced before it
/// used `jsonwebtoken` (whose RSA backend would take 1024-bit keys). Shorter keys
/// are forgeable; longer ones only make each verification (of any token) slower.
const RSA_BITS: std::ops::RangeInclusive<usize> = 2048..=8192;

/// A JWKS: the keys operators' tokens may be signed with, by `kid`. Each key is
/// an RSA (RS256) or EC P-256 (ES256) public key.
#[derive(Debug, Clone)]
pub struct Jwks {
    keys: Vec<(Option<String>, DecodingKey)>,
}

/// Who an operator is: the verified token's issuer and subject.
pub use lockmesh_core::wire::admin::Operator;

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

/// The claims read beyond those `jsonwebtoken` validates (`iss`, `aud`).
#[derive(Deserialize)]
struct Claims {
    sub: Option<String>,
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

/// The `kty` of a key `jsonwebtoken` parsed, as the document spelled it.
fn kty_of(params: &AlgorithmParameters) -> String {
    serde_json::to_value(params)
        .ok()
        .and_then(|v| v.get("kty").and_then(|k| k.as_str().map(str::to_owned)))
        .unwrap_or_default()
}

// === impl Jwks ===

impl Jwks {
    /// Parses a JWKS document (`{"keys":[...]}`); each key is named by its index
    /// in errors (`keys[1].crv`). RSA keys of 2048 to 8192 bits (`alg` RS256 or
    /// unset) and EC P-256 keys are kept; other key types are refused rather
    /// than ignored.
    pub fn parse(text: &str) -> Result<Self, AdminError> {
        let set: JwkSet = serde_json::from_str(text).map_err(|e| AdminError::Jwks(format!("not a JWKS: {e}")))?;
        let mut keys = Vec::new();
        for (i, k) in set.keys.iter().enumerate() {
            let at = |f: &str| format!("keys[{i}].{f}");
            let bad = |f: &str, why: &str| AdminError::Jwks(format!("{}: {why}", at(f)));
            let rsa_alg_ok = k.common.key_algorithm.is_none_or(|a| a == KeyAlgorithm::RS256);
            let key = match &k.algorithm {
                AlgorithmParameters::RSA(p) => {
                    if !rsa_alg_ok {
                        return Err(bad("alg", "only RS256 for an RSA key"));
                    }
                    let n = b64(&at("n"), &p.n)?;
                    b64(&at("e"), &p.e)?;
                    let n = &n[n.iter().take_while(|b| **b == 0).count()..];
                    let bits = n.first().map_or(0, |b| n.len() * 8 - b.leading_zeros() as usize);
                    if !RSA_BITS.contains(&bits) {
                        return Err(bad("n", &format!("a {bits}-bit modulus; 2048 to 8192 bits are accepted")));
                    }
                    DecodingKey::from_rsa_components(&p.n, &p.e).map_err(|e| bad("n", &e.to_string()))?
                }
                AlgorithmParameters::EllipticCurve(p) => {
                    if p.curve != EllipticCurve::P256 {
                        return Err(bad("crv", "only P-256 (ES256)"));
                    }
                    let (x, y) = (b64(&at("x"), &p.x)?, b64(&at("y"), &p.y)?);
                    if x.len() != 32 || y.len() != 32 {
                        return Err(bad("x", "a P-256 coordinate is 32 bytes"));
                    }
                    DecodingKey::from_ec_components(&p.x, &p.y).map_err(|e| bad("x", &e.to_string()))?
                }
                // An RSA or EC key that lacks a member (or has one of the wrong
                // type) parses as "other": name the member.
                AlgorithmParameters::Other(o) => {
                    let member = |f: &str| o.fields.get(f).and_then(|v| v.as_str());
                    let missing = |fs: &[&str]| {
                        fs.iter().find(|f| member(f).is_none()).map(|f| bad(f, "required (a base64url string)"))
                    };
                    let why = match member("kty") {
                        Some("RSA") if !rsa_alg_ok => Some(bad("alg", "only RS256 for an RSA key")),
                        Some("RSA") => missing(&["n", "e"]),
                        Some("EC") if member("crv") != Some("P-256") => Some(bad("crv", "only P-256 (ES256)")),
                        Some("EC") => missing(&["x", "y"]),
                        other => Some(bad("kty", &format!("{:?} is not RSA or EC", other.unwrap_or_default()))),
                    };
                    return Err(why.unwrap_or_else(|| bad("kty", "not a usable RSA or EC key")));
                }
                other => return Err(bad("kty", &format!("{:?} is not RSA or EC", kty_of(other)))),
            };
            keys.push((k.common.key_id.clone(), key));
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
        let token = token.trim();
        if token.split('.').count() != 3 {
            return Err(invalid("not a compact JWS (three dot-separated parts)"));
        }
        // `none` is no `Algorithm`: such a header does not parse.
        let header =
            jsonwebtoken::decode_header(token).map_err(|_| invalid("header is not base64url JSON naming a JWS alg"))?;
        if !matches!(header.alg, Algorithm::RS256 | Algorithm::ES256) {
            return Err(invalid("alg must be RS256 or ES256"));
        }
        let mut validation = Validation::new(header.alg);
        // Times are checked below against `now_s`, not the library's wall clock.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        // Keys of the header's algorithm, by `kid` when both name one: an RS256
        // header is never checked against an EC key, nor ES256 against RSA.
        let candidates = self.jwks.keys.iter().filter(|(kid, key)| {
            key.family() == header.alg.family()
                && match (&header.kid, kid) {
                    (Some(want), Some(have)) => want == have,
                    _ => true,
                }
        });
        let mut verified = None;
        for (_, key) in candidates {
            match jsonwebtoken::decode::<Claims>(token, key, &validation) {
                Ok(data) => {
                    verified = Some(data.claims);
                    break;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::InvalidSignature | ErrorKind::InvalidEcdsaKey | ErrorKind::InvalidRsaKey(_)
                    ) => {}
                Err(e) => return Err(refusal(&e)),
            }
        }
        let claims = verified.ok_or_else(|| invalid("signature does not verify against the configured JWKS"))?;
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

/// Why a token whose signature verified (or that failed before any key was
/// tried) is refused, in the words the operator sees.
fn refusal(e: &JwtError) -> AdminError {
    let why = match e.kind() {
        ErrorKind::InvalidIssuer => "iss is not the configured issuer",
        ErrorKind::InvalidAudience => "aud does not contain the configured audience",
        ErrorKind::MissingRequiredClaim(c) | ErrorKind::InvalidClaimFormat(c) => match c.as_str() {
            "iss" => "iss is not the configured issuer",
            "aud" => "aud does not contain the configured audience",
            "exp" => "no exp claim",
            "sub" => "no sub claim",
            _ => "a registered claim is missing or malformed",
        },
        ErrorKind::InvalidAlgorithm => "alg must be RS256 or ES256",
        ErrorKind::Json(_) | ErrorKind::Utf8(_) => "claims are not base64url JSON of the expected shape",
        ErrorKind::Base64(_) => "a part is not base64url",
        _ => return AdminError::TokenInvalid(e.to_string()),
    };
    AdminError::TokenInvalid(why.to_owned())
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
        let hs = format!("{}.{}.{}", URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256","kid":"k1"}"#), parts[1], parts[2]);
        assert!(matches!(v.verify(&hs, now), Err(AdminError::TokenInvalid(w)) if w.contains("RS256 or ES256")));
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
        // RSA keys of 2048 to 8192 bits only.
        let rsa = |bytes: usize| {
            format!(r#"{{"keys":[{{"kty":"RSA","e":"AQAB","n":"{}"}}]}}"#, URL_SAFE_NO_PAD.encode(vec![0xc5u8; bytes]))
        };
        let e = Jwks::parse(&rsa(128)).unwrap_err();
        assert!(e.to_string().contains("keys[0].n: a 1024-bit modulus"), "{e}");
        assert!(Jwks::parse(&rsa(256)).is_ok());
        assert!(Jwks::parse(&rsa(1025)).is_err());
    }
}
