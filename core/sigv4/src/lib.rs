//! AWS Signature Version 4 for S3 requests: the signer lockmesh's S3 clients share
//! (the S3 reference fence in `lockmesh-fence-proxy` and the audit tailer's
//! archives in `lockmesh-audit`), so neither depends on the other.
//!
//! Written over RustCrypto's `hmac` 0.13 and `sha2` 0.11, which the workspace
//! already builds (for tokio-postgres and jsonwebtoken): no new crate compiles.
//! `aws-sigv4` would bring the aws-smithy runtime crates, and `rusty-s3` a second
//! `hmac`/`sha2`/`md-5` generation, `quick-xml` and `time` for presigned URLs
//! nothing here needs. The signer reproduces AWS's published example signature
//! (the unit test below) and passes moto's botocore-based verification
//! (tests/tests/scenarios/fence_s3.rs).

use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit as _, Mac as _};
use sha2::{Digest as _, Sha256};

/// The hex SHA-256 of `bytes` (a request's payload hash).
pub fn sha256_hex(bytes: &[u8]) -> String {
    to_hex(&Sha256::digest(bytes))
}

/// AWS credentials. `Debug` never shows the secret or the session token.
#[derive(Clone)]
pub struct Credentials {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("access_key_id", &self.access_key_id).finish_non_exhaustive()
    }
}

// === impl Credentials ===

impl Credentials {
    /// Credentials from their parts.
    pub fn new(access_key_id: &str, secret_access_key: &str, session_token: Option<&str>) -> Self {
        Self {
            access_key_id: access_key_id.to_owned(),
            secret_access_key: secret_access_key.to_owned(),
            session_token: session_token.map(str::to_owned),
        }
    }

    /// The session token (`x-amz-security-token`), for temporary credentials.
    pub fn session_token(&self) -> Option<&str> {
        self.session_token.as_deref()
    }

    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and, if set, `AWS_SESSION_TOKEN`.
    pub fn from_env() -> Result<Self, &'static str> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let id = var("AWS_ACCESS_KEY_ID").ok_or("AWS_ACCESS_KEY_ID is not set")?;
        let secret = var("AWS_SECRET_ACCESS_KEY").ok_or("AWS_SECRET_ACCESS_KEY is not set")?;
        Ok(Self::new(&id, &secret, var("AWS_SESSION_TOKEN").as_deref()))
    }
}

/// S3's URI encoding: every byte but `A-Za-z0-9-._~` as `%XX`; `/` too when
/// `slash` (query values), else kept (object paths).
pub fn uri_encode(s: &str, slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') || (b == b'/' && !slash) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `YYYYMMDDTHHMMSSZ` (UTC).
pub fn amz_date(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Lower-case hex.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    // HMAC takes keys of any length: new_from_slice cannot fail.
    let mut m = <Hmac<Sha256>>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

/// AWS Signature Version 4 for S3: the `Authorization` header value. `path` is the
/// URI-encoded path, `query` the canonical query string, `headers` every header
/// signed (lower-case names; `host` included), `payload` the body's hex SHA-256.
#[allow(clippy::too_many_arguments)]
pub fn sign_v4(
    method: &str,
    path: &str,
    query: &str,
    headers: &[(String, String)],
    payload: &str,
    amz_date: &str,
    region: &str,
    creds: &Credentials,
) -> String {
    let mut hs: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.split_whitespace().collect::<Vec<_>>().join(" ")))
        .collect();
    hs.sort();
    let canonical_headers: String = hs.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let signed_headers = hs.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(";");
    let canonical = format!("{method}\n{path}\n{query}\n{canonical_headers}\n{signed_headers}\n{payload}");
    let date = &amz_date[..8.min(amz_date.len())];
    let scope = format!("{date}/{region}/s3/aws4_request");
    let to_sign = format!("AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}", to_hex(&Sha256::digest(canonical.as_bytes())));
    let k = hmac(format!("AWS4{}", creds.secret_access_key).as_bytes(), date.as_bytes());
    let k = hmac(&k, region.as_bytes());
    let k = hmac(&k, b"s3");
    let k = hmac(&k, b"aws4_request");
    let sig = to_hex(&hmac(&k, to_sign.as_bytes()));
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed_headers}, Signature={sig}",
        creds.access_key_id
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_signer_reproduces_aws_s3_example_signature() {
        // AWS's "Signature Calculations for the Authorization Header" example:
        // GET Object /test.txt, Range bytes=0-9, 2013-05-24, us-east-1.
        let creds = Credentials::new("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", None);
        let empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let h = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        let headers = [
            h("host", "examplebucket.s3.amazonaws.com"),
            h("range", "bytes=0-9"),
            h("x-amz-content-sha256", empty),
            h("x-amz-date", "20130524T000000Z"),
        ];
        let auth = sign_v4("GET", "/test.txt", "", &headers, empty, "20130524T000000Z", "us-east-1", &creds);
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
        assert!(!format!("{creds:?}").contains("wJalr"), "Debug shows the secret");
    }

    #[test]
    fn dates_and_paths_are_in_s3s_forms() {
        assert_eq!(amz_date(UNIX_EPOCH), "19700101T000000Z");
        assert_eq!(amz_date(UNIX_EPOCH + Duration::from_secs(1_369_353_600)), "20130524T000000Z");
        assert_eq!(amz_date(UNIX_EPOCH + Duration::from_secs(951_825_599)), "20000229T115959Z");
        assert_eq!(uri_encode("a b/c~d+é", false), "a%20b/c~d%2B%C3%A9");
        assert_eq!(uri_encode("a/b", true), "a%2Fb");
    }
}
