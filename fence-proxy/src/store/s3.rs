//! The S3 reference fence: a conditional put (`If-Match` on the object's ETag, the
//! first write `If-None-Match: *`) whose ETag depends on the fencing token.
//!
//! **The ABA hole.** A single-part PUT's ETag is the MD5 of its bytes, and metadata
//! does not change it. A fence that kept the token in metadata and wrote the value
//! bytes as they are would let this through: holder A (token 10) reads ETag `e` and
//! checks its token; a newer holder B (token 20) writes the *same bytes* with token 20
//! in metadata, and the ETag is `e` again; A's `PUT If-Match: e` passes and writes
//! token 10 over token 20. So every object is stored as an **envelope** whose bytes
//! carry the token:
//!
//! ```text
//! lockmesh-fence/1 token=<decimal token> <live|deleted>\n<the value's bytes>
//! ```
//!
//! Two writes with different tokens have different bytes, so different ETags: once a
//! newer token wrote, an older holder's `If-Match` can no longer pass. Readers strip
//! the first line ([`S3Fence::read`]).
//!
//! **A write** ([`S3Fence::write`]) reads the envelope's first line and the ETag (a
//! ranged GET of its first [`HEAD_BYTES`] bytes; the ETag is the whole object's),
//! refuses a token below the stored one (an equal token per the [`EqualRule`], as the
//! PostgreSQL fence: `strict` refuses it, `allow` writes), then PUTs with
//! `If-Match: <etag>`, or `If-None-Match: *` when there is no object. `412` (the
//! object changed since the read), `409` (S3's `ConditionalRequestConflict`, two
//! conditional writes at once) and `404` on an `If-Match` (the object went away) all
//! mean "read again": the fence re-reads and re-checks, at most [`MAX_ATTEMPTS`]
//! times. Safety rests on the conditional PUT alone: a stale read only costs a retry.
//!
//! **A delete** ([`S3Fence::delete`]) is a *tombstone*: an envelope `deleted` with the
//! token, written under the same rule and precondition. It is not a conditional
//! DeleteObject (moto 5.2 honours `If-Match` on DeleteObject; other stores' support
//! varies by product and bucket type): a deleted object forgets its token, and the
//! next write, `If-None-Match: *`, would pass for any holder, a stale one included.
//! [`S3Fence::read`] reads a tombstone as absent. Removing tombstones (by hand or a
//! lifecycle rule) reopens that hole for the removed keys.
//!
//! **What the fence cannot know.** A key that never had an object takes any token
//! (as a missing PostgreSQL row does); an object removed or written around the fence
//! loses its token (an object without an envelope is refused:
//! [`S3FenceError::NotEnveloped`]). Tokens are comparable across keys: the
//! application passes the token of the lock that guards the object.
//!
//! **Requests** are path-style (`<endpoint>/<bucket>/<key>`), signed with AWS
//! Signature Version 4 by `lockmesh-sigv4` (its docs say why it is written there);
//! the HTTP client is the workspace's reqwest.

use std::time::{Duration, SystemTime};

use lockmesh_core::FencingToken;
use lockmesh_sigv4::sha256_hex;
pub use lockmesh_sigv4::{amz_date, sign_v4, uri_encode, Credentials};

use crate::route::EqualRule;

/// The envelope's first word (its format version).
pub const ENVELOPE_MAGIC: &str = "lockmesh-fence/1";
/// How many bytes a state read fetches: the envelope's first line is at most 52.
pub const HEAD_BYTES: u64 = 128;
/// How many conditional PUTs one write tries before [`S3FenceError::Contended`].
pub const MAX_ATTEMPTS: u32 = 64;
/// Longest object key S3 accepts, bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Per-request timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Metadata header of the planted token-in-metadata fence.
const META_TOKEN: &str = "x-amz-meta-lockmesh-fence-token";

/// Why a fenced S3 operation could not run. [`S3FenceError::code`] is stable.
#[derive(Debug, thiserror::Error)]
pub enum S3FenceError {
    /// Not an S3 bucket name.
    #[error("bucket {0:?} must be 3 to 63 characters of [a-z0-9.-], starting and ending with a letter or digit")]
    BadBucket(String),
    /// The object key is empty or longer than S3 allows.
    #[error("the object key must be 1 to 1024 bytes (got {0})")]
    BadKey(usize),
    /// The endpoint is not a usable `http(s)://host[:port]` URL.
    #[error("endpoint {0}")]
    BadEndpoint(String),
    /// No credentials.
    #[error("no S3 credentials: {0}")]
    Credentials(&'static str),
    /// The object's bytes are not an envelope (written around the fence).
    #[error("the object is not a lockmesh fence envelope ({0}): it was written around the fence")]
    NotEnveloped(&'static str),
    /// The store answered with an error.
    #[error("S3 {op} answered {status} {code}")]
    Status {
        /// The operation.
        op: &'static str,
        /// HTTP status.
        status: u16,
        /// The `<Code>` of S3's error document (empty when none).
        code: String,
    },
    /// Every conditional PUT of one write lost to another writer.
    #[error("gave up after {0} conditional writes that each lost to another writer")]
    Contended(u32),
    /// The request failed (connection, timeout).
    #[error("S3 {0} request failed")]
    Http(&'static str, #[source] reqwest::Error),
}

// === impl S3FenceError ===

impl S3FenceError {
    /// A stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::BadBucket(_) => "bad_bucket",
            Self::BadKey(_) => "bad_key",
            Self::BadEndpoint(_) => "bad_endpoint",
            Self::Credentials(_) => "no_credentials",
            Self::NotEnveloped(_) => "not_enveloped",
            Self::Status { .. } => "store_error",
            Self::Contended(_) => "contended",
            Self::Http(..) => "store_unavailable",
        }
    }
}

/// A minimal S3 client: path-style object requests signed with SigV4.
#[derive(Clone, Debug)]
pub struct S3Client {
    http: reqwest::Client,
    endpoint: reqwest::Url,
    region: String,
    creds: Credentials,
}

// === impl S3Client ===

impl S3Client {
    /// A client for `endpoint` (`http(s)://host[:port]`, no path, query or
    /// credentials) in `region`.
    pub fn new(endpoint: &str, region: &str, creds: Credentials) -> Result<Self, S3FenceError> {
        let bad = |why: &str| S3FenceError::BadEndpoint(format!("{endpoint:?} {why}"));
        let url = reqwest::Url::parse(endpoint).map_err(|e| bad(&format!("is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(bad("must be http(s)://host[:port]"));
        }
        if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
            return Err(bad("must have no path, query or fragment (requests are path-style)"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad("must not carry credentials (use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"));
        }
        if region.is_empty() || !region.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
            return Err(S3FenceError::BadEndpoint(format!("region {region:?} must be [a-z0-9-]+")));
        }
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| S3FenceError::Http("client setup", e))?;
        Ok(Self { http, endpoint: url, region: region.to_owned(), creds })
    }

    /// The endpoint without a trailing `/`.
    pub fn endpoint(&self) -> String {
        self.endpoint.as_str().trim_end_matches('/').to_owned()
    }

    /// One signed request for `/<bucket>/<key>`; `headers` are sent and signed.
    async fn send(
        &self,
        op: &'static str,
        method: reqwest::Method,
        bucket: &str,
        key: &str,
        headers: &[(&str, String)],
        body: Vec<u8>,
    ) -> Result<reqwest::Response, S3FenceError> {
        let path = format!("/{}/{}", uri_encode(bucket, false), uri_encode(key, false));
        let url = format!("{}{path}", self.endpoint());
        let host = match self.endpoint.port() {
            Some(p) => format!("{}:{p}", self.endpoint.host_str().unwrap_or_default()),
            None => self.endpoint.host_str().unwrap_or_default().to_owned(),
        };
        let payload = sha256_hex(&body);
        let amz_date = amz_date(SystemTime::now());
        let mut signed: Vec<(String, String)> = vec![
            ("host".into(), host),
            ("x-amz-content-sha256".into(), payload.clone()),
            ("x-amz-date".into(), amz_date.clone()),
        ];
        if let Some(t) = self.creds.session_token() {
            signed.push(("x-amz-security-token".into(), t.to_owned()));
        }
        signed.extend(headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone())));
        let auth = sign_v4(method.as_str(), &path, "", &signed, &payload, &amz_date, &self.region, &self.creds);
        let mut req = self.http.request(method, url).header("authorization", auth).body(body);
        for (k, v) in signed.iter().filter(|(k, _)| k != "host") {
            req = req.header(k.as_str(), v.as_str());
        }
        req.send().await.map_err(|e| S3FenceError::Http(op, e))
    }

    /// The error for an unexpected answer, with S3's `<Code>`.
    async fn status_error(op: &'static str, r: reqwest::Response) -> S3FenceError {
        let status = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        let code = text
            .split_once("<Code>")
            .and_then(|(_, rest)| rest.split_once("</Code>"))
            .map(|(c, _)| c.chars().filter(|c| c.is_ascii_alphanumeric()).take(64).collect())
            .unwrap_or_default();
        S3FenceError::Status { op, status, code }
    }
}

/// A stored object as the fence sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectState {
    /// The whole object's ETag, as the store sent it (quotes included).
    pub etag: String,
    /// The token of the write that stored it.
    pub token: FencingToken,
    /// A tombstone ([`S3Fence::delete`]).
    pub deleted: bool,
}

/// The precondition of the next conditional PUT.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Precondition {
    /// `If-None-Match: *`: there was no object.
    Absent,
    /// `If-Match: <etag>`.
    Match(String),
}

/// A write whose token passed the check against the object as it was read; the
/// PUT is still to come ([`S3Fence::commit`]).
#[derive(Clone, Debug)]
pub struct Prepared {
    key: String,
    token: FencingToken,
    cond: Precondition,
}

/// What [`S3Fence::prepare`] found.
#[derive(Clone, Debug)]
pub enum Prepare {
    /// The token passes; the PUT will carry the read's precondition.
    Ready(Prepared),
    /// The token is below the stored one (or equal under `strict`).
    Stale,
}

/// What a fenced write or delete did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Stored; the object's token is now the write's.
    Applied,
    /// The token did not pass the fence: nothing written.
    Stale,
}

/// Faults a test plants in the fence (cargo feature `test-faults`, never in a
/// release build) to show that its tests see them.
#[cfg(feature = "test-faults")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlantedFault {
    /// PUTs carry no `If-Match` / `If-None-Match`: check-then-write.
    OmitCondition,
    /// The token goes in metadata and the bytes are the value's: the ABA hole.
    TokenInMetadata,
}

/// A fenced bucket.
#[derive(Clone, Debug)]
pub struct S3Fence {
    client: S3Client,
    bucket: String,
    equal: EqualRule,
    #[cfg(feature = "test-faults")]
    fault: Option<PlantedFault>,
}

/// The bytes a write stores: the envelope's first line, then the value.
pub fn envelope(token: FencingToken, value: Option<&[u8]>) -> Vec<u8> {
    let state = if value.is_some() { "live" } else { "deleted" };
    let mut out = format!("{ENVELOPE_MAGIC} token={} {state}\n", token.get()).into_bytes();
    out.extend_from_slice(value.unwrap_or_default());
    out
}

/// Reads an envelope's first line: the token, whether it is a tombstone, and where
/// the value starts.
pub fn parse_envelope(bytes: &[u8]) -> Result<(FencingToken, bool, usize), S3FenceError> {
    let nl = bytes.iter().position(|&b| b == b'\n').ok_or(S3FenceError::NotEnveloped("no first line"))?;
    let line = std::str::from_utf8(&bytes[..nl]).map_err(|_| S3FenceError::NotEnveloped("first line not UTF-8"))?;
    let mut words = line.split(' ');
    if words.next() != Some(ENVELOPE_MAGIC) {
        return Err(S3FenceError::NotEnveloped("no lockmesh-fence/1 mark"));
    }
    let token = words
        .next()
        .and_then(|w| w.strip_prefix("token="))
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()) && (d.len() == 1 || !d.starts_with('0')))
        .and_then(|d| d.parse::<u64>().ok())
        .and_then(|t| FencingToken::from_packed(t).ok())
        .ok_or(S3FenceError::NotEnveloped("no valid token"))?;
    let deleted = match (words.next(), words.next()) {
        (Some("live"), None) => false,
        (Some("deleted"), None) => true,
        _ => return Err(S3FenceError::NotEnveloped("no live/deleted state")),
    };
    if deleted && bytes.len() > nl + 1 {
        return Err(S3FenceError::NotEnveloped("a tombstone with a value"));
    }
    Ok((token, deleted, nl + 1))
}

// === impl S3Fence ===

impl S3Fence {
    /// A fence over `bucket` with the equal-token rule `equal`.
    pub fn try_new(client: S3Client, bucket: &str, equal: EqualRule) -> Result<Self, S3FenceError> {
        let b = bucket.as_bytes();
        let ok = (3..=63).contains(&b.len())
            && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'.' || *c == b'-')
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric();
        if !ok {
            return Err(S3FenceError::BadBucket(bucket.to_owned()));
        }
        Ok(Self {
            client,
            bucket: bucket.to_owned(),
            equal,
            #[cfg(feature = "test-faults")]
            fault: None,
        })
    }

    /// The same fence with a planted fault.
    #[cfg(feature = "test-faults")]
    pub fn planted(mut self, fault: PlantedFault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Planted: PUTs without a precondition.
    #[cfg(feature = "test-faults")]
    fn omit_condition(&self) -> bool {
        self.fault == Some(PlantedFault::OmitCondition)
    }

    /// Planted: the token in metadata, the value's bytes as they are.
    #[cfg(feature = "test-faults")]
    fn token_in_metadata(&self) -> bool {
        self.fault == Some(PlantedFault::TokenInMetadata)
    }

    #[cfg(not(feature = "test-faults"))]
    fn omit_condition(&self) -> bool {
        false
    }

    #[cfg(not(feature = "test-faults"))]
    fn token_in_metadata(&self) -> bool {
        false
    }

    /// The planted fence's token, from the metadata header.
    fn meta_token(r: &reqwest::Response) -> Result<FencingToken, S3FenceError> {
        r.headers()
            .get(META_TOKEN)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .and_then(|t| FencingToken::from_packed(t).ok())
            .ok_or(S3FenceError::NotEnveloped("no token metadata"))
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The equal-token rule.
    pub fn equal(&self) -> EqualRule {
        self.equal
    }

    pub fn client(&self) -> &S3Client {
        &self.client
    }

    fn check_key(key: &str) -> Result<(), S3FenceError> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(S3FenceError::BadKey(key.len()));
        }
        Ok(())
    }

    /// The object's ETag and envelope header, or `None` when there is no object.
    pub async fn state(&self, key: &str) -> Result<Option<ObjectState>, S3FenceError> {
        Self::check_key(key)?;
        let range = ("range", format!("bytes=0-{}", HEAD_BYTES - 1));
        let r = self.client.send("read", reqwest::Method::GET, &self.bucket, key, &[range], Vec::new()).await?;
        match r.status().as_u16() {
            200 | 206 => {}
            404 => return Self::not_found("read", r).await,
            416 => return Err(S3FenceError::NotEnveloped("an empty object")),
            _ => return Err(S3Client::status_error("read", r).await),
        }
        let etag = r
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or(S3FenceError::Status { op: "read", status: 200, code: "NoETag".into() })?;
        if self.token_in_metadata() {
            return Ok(Some(ObjectState { etag, token: Self::meta_token(&r)?, deleted: false }));
        }
        let head = r.bytes().await.map_err(|e| S3FenceError::Http("read", e))?;
        let (token, deleted, _) = parse_envelope(&head)?;
        Ok(Some(ObjectState { etag, token, deleted }))
    }

    /// `Ok(None)` for a missing key; an error for a missing bucket.
    async fn not_found<T>(op: &'static str, r: reqwest::Response) -> Result<Option<T>, S3FenceError> {
        match S3Client::status_error(op, r).await {
            S3FenceError::Status { code, .. } if code == "NoSuchKey" || code.is_empty() => Ok(None),
            e => Err(e),
        }
    }

    /// Reads the object and checks `token` against it: the first half of a write.
    pub async fn prepare(&self, key: &str, token: FencingToken) -> Result<Prepare, S3FenceError> {
        let cond = match self.state(key).await? {
            None => Precondition::Absent,
            Some(s) => {
                let passes = match self.equal {
                    EqualRule::Strict => token > s.token,
                    EqualRule::Allow => token >= s.token,
                };
                if !passes {
                    return Ok(Prepare::Stale);
                }
                Precondition::Match(s.etag)
            }
        };
        Ok(Prepare::Ready(Prepared { key: key.to_owned(), token, cond }))
    }

    /// The conditional PUT of a prepared write (`value` `None`: a tombstone). When
    /// the object changed since the read it reads and checks again.
    pub async fn commit(&self, prepared: Prepared, value: Option<&[u8]>) -> Result<WriteOutcome, S3FenceError> {
        let mut p = prepared;
        for _ in 0..MAX_ATTEMPTS {
            let status = self.put(&p, value).await?;
            if status != Retry::Again {
                return Ok(WriteOutcome::Applied);
            }
            p = match self.prepare(&p.key, p.token).await? {
                Prepare::Ready(p) => p,
                Prepare::Stale => return Ok(WriteOutcome::Stale),
            };
        }
        Err(S3FenceError::Contended(MAX_ATTEMPTS))
    }

    /// One conditional PUT.
    async fn put(&self, p: &Prepared, value: Option<&[u8]>) -> Result<Retry, S3FenceError> {
        let mut headers = vec![("content-type", "application/octet-stream".to_owned())];
        let body = if self.token_in_metadata() {
            headers.push((META_TOKEN, p.token.get().to_string()));
            value.unwrap_or_default().to_vec()
        } else {
            envelope(p.token, value)
        };
        if !self.omit_condition() {
            headers.push(match &p.cond {
                Precondition::Absent => ("if-none-match", "*".to_owned()),
                Precondition::Match(etag) => ("if-match", etag.clone()),
            });
        }
        let r = self.client.send("write", reqwest::Method::PUT, &self.bucket, &p.key, &headers, body).await?;
        match r.status().as_u16() {
            200..=299 => Ok(Retry::Done),
            // 412: the precondition failed; 409: ConditionalRequestConflict (S3, two
            // conditional writes at once).
            412 | 409 => Ok(Retry::Again),
            // 404 on If-Match: the object went away (a missing bucket stays an error).
            404 if matches!(p.cond, Precondition::Match(_)) => {
                Self::not_found::<()>("write", r).await.map(|_| Retry::Again)
            }
            _ => Err(S3Client::status_error("write", r).await),
        }
    }

    /// Writes `value` to `key` if `token` passes the fence.
    pub async fn write(&self, key: &str, value: &[u8], token: FencingToken) -> Result<WriteOutcome, S3FenceError> {
        match self.prepare(key, token).await? {
            Prepare::Ready(p) => self.commit(p, Some(value)).await,
            Prepare::Stale => Ok(WriteOutcome::Stale),
        }
    }

    /// Deletes `key` if `token` passes the fence: writes a tombstone that keeps the
    /// token (a key that never existed gets one too).
    pub async fn delete(&self, key: &str, token: FencingToken) -> Result<WriteOutcome, S3FenceError> {
        match self.prepare(key, token).await? {
            Prepare::Ready(p) => self.commit(p, None).await,
            Prepare::Stale => Ok(WriteOutcome::Stale),
        }
    }

    /// The value and its token; `None` for a missing key or a tombstone.
    pub async fn read(&self, key: &str) -> Result<Option<(Vec<u8>, FencingToken)>, S3FenceError> {
        Self::check_key(key)?;
        let r = self.client.send("read", reqwest::Method::GET, &self.bucket, key, &[], Vec::new()).await?;
        match r.status().as_u16() {
            200 => {}
            404 => return Self::not_found("read", r).await,
            _ => return Err(S3Client::status_error("read", r).await),
        }
        if self.token_in_metadata() {
            let token = Self::meta_token(&r)?;
            let b = r.bytes().await.map_err(|e| S3FenceError::Http("read", e))?;
            return Ok(Some((b.to_vec(), token)));
        }
        let b = r.bytes().await.map_err(|e| S3FenceError::Http("read", e))?;
        let (token, deleted, at) = parse_envelope(&b)?;
        Ok((!deleted).then(|| (b[at..].to_vec(), token)))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Retry {
    Done,
    Again,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(v: u64) -> FencingToken {
        FencingToken::from_packed(v).unwrap()
    }

    #[test]
    fn the_envelope_carries_the_token_so_equal_bytes_under_two_tokens_differ() {
        let a = envelope(tok(10), Some(b"same"));
        let b = envelope(tok(20), Some(b"same"));
        assert_ne!(a, b);
        assert_eq!(&a[..], b"lockmesh-fence/1 token=10 live\nsame");
        assert_eq!(parse_envelope(&a).unwrap(), (tok(10), false, 31));
        let t = envelope(tok(7), None);
        assert_eq!(parse_envelope(&t).unwrap(), (tok(7), true, t.len()));
        let max = FencingToken::mint(lockmesh_core::token::EPOCH_LIMIT - 1, lockmesh_core::token::REVISION_LIMIT - 1)
            .unwrap();
        let line = envelope(max, Some(b""));
        assert!(line.len() as u64 <= HEAD_BYTES, "{} bytes", line.len());
        assert_eq!(parse_envelope(&line).unwrap().0, max);
        for bad in [
            &b"plain value"[..],
            b"lockmesh-fence/2 token=1 live\n",
            b"lockmesh-fence/1 token=01 live\n",
            b"lockmesh-fence/1 token= live\n",
            b"lockmesh-fence/1 token=1 gone\n",
            b"lockmesh-fence/1 token=1 live extra\n",
            b"lockmesh-fence/1 token=1 deleted\nvalue",
            b"lockmesh-fence/1 token=99999999999999999999 live\n",
        ] {
            let e = parse_envelope(bad).unwrap_err();
            assert_eq!(e.code(), "not_enveloped", "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn bad_buckets_endpoints_and_keys_are_refused_with_stable_codes() {
        let c = || Credentials::new("id", "secret", None);
        let client = S3Client::new("http://127.0.0.1:9000", "us-east-1", c()).unwrap();
        for bad in ["ab", "Abc", "-abc", "abc-", "a_bc", &"a".repeat(64)] {
            let e = S3Fence::try_new(client.clone(), bad, EqualRule::Strict).unwrap_err();
            assert_eq!(e.code(), "bad_bucket", "{bad}");
        }
        for bad in ["ftp://h", "http://h/path", "http://u:p@h", "http://h?x=1", "not a url"] {
            assert_eq!(S3Client::new(bad, "us-east-1", c()).unwrap_err().code(), "bad_endpoint", "{bad}");
        }
        assert_eq!(S3Client::new("http://h", "US", c()).unwrap_err().code(), "bad_endpoint");
        assert!(S3Client::new("https://s3.eu-west-1.amazonaws.com/", "eu-west-1", c()).is_ok());
        assert_eq!(S3Fence::check_key("").unwrap_err().code(), "bad_key");
        assert_eq!(S3Fence::check_key(&"k".repeat(1025)).unwrap_err().code(), "bad_key");
    }
}
