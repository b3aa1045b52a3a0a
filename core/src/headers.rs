//! Every header lockmesh reads or writes, and the parsers for their values.
//!
//! Callers send the `x-lock-*` headers. Headers starting with [`INTERNAL_PREFIX`] are
//! lockmesh's own: the Wasm filter removes any a client sent before it sets its own,
//! so the arbiter can trust them. Identity never travels in a header: the arbiter
//! reads the mTLS peer's SPIFFE ID from Envoy's connection attributes.

use crate::{
    key::{KeyError, LockKey},
    token::FencingToken,
};

/// The lock key; its first `/`-separated segment is the namespace.
pub const KEY: &str = "x-lock-key";
/// How long an acquire may wait, in milliseconds; `0` tries once.
pub const WAIT_MS: &str = "x-lock-wait-ms";
/// The session (etcd lease) the hold attaches to, 16 lowercase hex characters.
pub const SESSION: &str = "x-lock-session";
/// A per-process instance id, set by the SDK; enables leak detection (ADR-13).
pub const INSTANCE: &str = "x-lock-instance";
/// A fencing token: read by release, validate and fences; added to transparent
/// requests forwarded upstream; never forwarded from a client.
pub const TOKEN: &str = "x-lock-token";
/// The class the caller expects; refused if it is not the key's class.
pub const CLASS: &str = "x-lock-class";
/// Epoch of the token forwarded upstream in transparent mode (diagnostic only).
pub const EPOCH: &str = "x-lock-epoch";
/// Revision of the token forwarded upstream in transparent mode (diagnostic only).
pub const REVISION: &str = "x-lock-revision";
/// The arbiter's signed grant proof (`v1.<kid>.<payload>.<sig>`, see `proof`): on
/// acquire answers, and carried with the token on writes to a fenced resource.
pub const PROOF: &str = "x-lock-proof";

/// An unprotected grant's id (ADR-04): on the answer to an acquire that a
/// fail-open class got from the arbiter's memory during a quorum loss (its token
/// is `0`: no fence accepts it); a release of that grant names it instead of a
/// token. 32 lowercase hex characters.
pub const GRANT: &str = "x-lock-grant";

/// The token of an unprotected grant (fail-open class, quorum lost): no fencing
/// token, no fence accepts it.
pub const UNPROTECTED_TOKEN: &str = "0";

/// An election leader's proclaimed value (`/v1/elections/campaign` and
/// `/v1/elections/proclaim`): 1-[`MAX_ELECTION_VALUE_LEN`] bytes of printable
/// ASCII, no leading or trailing space. Public to whoever may observe the election.
pub const VALUE: &str = "x-lock-value";

/// An observer's resume point (`GET /v1/elections`): the `cursor` of the last
/// answer; the next answer is the first leadership change after it. Opaque
/// ([`ELECTION_CURSOR_LEN`] lowercase hex digits): it names no etcd revision, so an
/// observer learns no leader's token from it (docs/GUARANTEES.md, G7).
pub const AFTER: &str = "x-lock-after";

/// How many of the key's N slots an acquire takes (`1`-[`MAX_PERMITS`], default 1),
/// all in one transaction or none: k permits of an N-semaphore.
pub const PERMITS: &str = "x-lock-permits";

/// `shared` or `exclusive`: a read-write lock on a key of a class with
/// `max_holders` N. A shared hold takes one of the N slots, an exclusive hold all
/// N, so many readers or one writer hold the key, never both.
pub const MODE: &str = "x-lock-mode";

/// The keys of a multi-key acquire (`POST /v1/locks/acquire-all`): 2-[`MAX_KEYS`]
/// keys, each separated from the next by one space (a key never holds a space;
/// the header may appear once, like every lock header), granted all in one etcd
/// transaction or none.
pub const KEYS: &str = "x-lock-keys";

/// The most keys one multi-key acquire may name. Each key costs its grant
/// transaction at most five compares (its slot, no holder above the limit, a
/// durable queue, two lock-delay records) and two puts (its hold, a lock-delay
/// guard); with the transaction's own (epoch, session, clock, policy, map, home:
/// six compares, two puts) 16 keys stay within etcd's default `--max-txn-ops` of
/// 128 counting every compare and put together (`extproc/lock/src/multi.rs`
/// asserts the count).
pub const MAX_KEYS: usize = 16;

/// The most permits one acquire may ask for, and the most slots an exclusive
/// hold may take: each slot is a compare and a put in the grant transaction,
/// which with the grant's other operations stays under etcd's default
/// `--max-txn-ops` of 128.
pub const MAX_PERMITS: u32 = 64;

/// Every caller-facing lock header (each may appear at most once).
pub const LOCK_HEADERS: [&str; 12] =
    [KEY, WAIT_MS, SESSION, INSTANCE, TOKEN, CLASS, GRANT, VALUE, AFTER, PERMITS, MODE, KEYS];

/// Prefix of headers only lockmesh may set.
pub const INTERNAL_PREFIX: &str = "x-lockmesh-";
/// The stable error code of a refused request, on every error response.
pub const ERROR: &str = "x-lockmesh-error";
/// On a `wrong_region` answer (ADR-08): the region whose lock tier homes the key's
/// namespace (the body's `region` names it too).
pub const REGION: &str = "x-lockmesh-region";
/// The standard HTTP `retry-after` header (seconds), on the refusals whose
/// [`crate::Code::retry_after_s`] is set.
pub const RETRY_AFTER: &str = "retry-after";
/// Set by the filter: the wait budget left, in ms, when it passed the request on.
/// The arbiter counts the caller's deadline from this, so time queued in the filter
/// is part of the wait.
pub const BUDGET_MS: &str = "x-lockmesh-budget-ms";
/// Set by the filter: proof the request went through it (its value is the filter
/// protocol version). The arbiter refuses lock requests without it.
pub const FILTERED: &str = "x-lockmesh-filtered";
/// Filter protocol version carried in [`FILTERED`].
pub const FILTER_PROTOCOL: &str = "1";
/// Sealed state (`false` or the seal reason), on every answer the arbiter gives
/// through ext_proc (the lock API and transparent routes); not on the filter's
/// local answers, nor on the VM and admin routes, whose callers read `/status`.
pub const SEALED: &str = "x-lockmesh-sealed";
/// Set by the filter on a transparent-mode request: the id of the filter's worker
/// VM (32 hex characters), whose per-class sessions carry the request's hold.
pub const VM: &str = "x-lockmesh-vm";
/// Set by the filter on `POST /v1/sessions` without `x-lock-key`: the key
/// namespaces (first segments of the prefixes) the caller's grants let it
/// acquire in, comma-separated. The arbiter charges such a session to its class's
/// namespace only when the caller is granted there (no tenant spends another's
/// session quota).
pub const GRANTED_NS: &str = "x-lockmesh-granted-ns";
/// Set by the filter on a transparent-mode request: the hold id (a decimal counter,
/// unique within the VM), by which the filter releases the hold when the request ends.
pub const HOLD: &str = "x-lockmesh-hold";
/// The unlocked mark of filters before docs/DECISIONS.md ADR-29, a header. No filter
/// sets it now: the filter strips it from clients like every `x-lockmesh-*` header,
/// and the arbiter refuses a request that carries it.
pub const UNLOCKED: &str = "x-lockmesh-unlocked";
/// The unlocked mark (ADR-29): the Wasm property the filter sets on a request it lets
/// through unlocked, which Envoy keeps in the stream's filter state as
/// `wasm.lockmesh_unlocked`, where the sidecar's ext_proc matcher reads it.
pub const UNLOCKED_PROPERTY: &str = "lockmesh_unlocked";

/// Headers clients may try to forge to pass as someone else; always removed.
pub const FORGEABLE_IDENTITY: [&str; 3] = ["x-forwarded-client-cert", "x-spiffe-id", "x-lockmesh-identity"];

/// Headers the lock tier strips from a transparent request before the upstream sees
/// it (besides [`never_from_client`]): only the arbiter may hand the upstream a
/// token, and a client's own grant evidence must not look like one.
pub const UPSTREAM_RESERVED: [&str; 5] = [TOKEN, SESSION, INSTANCE, PROOF, GRANT];

/// Method override headers (folded): some frameworks (Rails, Symfony, Laravel,
/// Express's method-override, ASP.NET) run the method one names instead of the one
/// on the wire, so a lock or fence that classified the request by its method would
/// have classified another request than the one served.
pub const METHOD_OVERRIDES: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

/// Path override headers (folded): IIS and ASP.NET URL rewriting, Symfony and
/// Laravel serve the path one names instead of `:path`, so a lock derived from
/// `:path` would guard another resource than the one served.
pub const PATH_OVERRIDES: [&str; 2] = ["x-original-url", "x-rewrite-url"];

/// The override header (of [`METHOD_OVERRIDES`] and [`PATH_OVERRIDES`]) that `name`
/// spells in any case or `_`/`-` spelling ([`fold`]), if any: `X_Original_URL`
/// gives `Some("x-original-url")`. The Wasm filter and fence-proxy refuse a request
/// carrying one on every route.
pub fn override_header(name: &str) -> Option<&'static str> {
    let f = fold(name);
    METHOD_OVERRIDES.iter().chain(&PATH_OVERRIDES).copied().find(|h| *h == f)
}

/// A header name as a permissive server reads it: ASCII lower-case, `_` read as `-`.
/// CGI and WSGI servers (Python's `wsgiref` among them) map both `x_lock_token` and
/// `X-Lock-Token` to `HTTP_X_LOCK_TOKEN`, so every comparison that decides whether
/// a client header is lockmesh's compares folded names. Borrows when nothing changes.
pub fn fold(name: &str) -> std::borrow::Cow<'_, str> {
    if name.bytes().any(|b| b == b'_' || b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(name.chars().map(|c| if c == '_' { '-' } else { c.to_ascii_lowercase() }).collect())
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

/// Whether a client-sent header named `name`, in any spelling [`fold`] equates, is
/// one only lockmesh may set: an `x-lockmesh-*` header, a forgeable identity header
/// ([`FORGEABLE_IDENTITY`]) or the diagnostic [`EPOCH`] / [`REVISION`]. Every
/// stripper of client headers removes these from every request.
pub fn never_from_client(name: &str) -> bool {
    let f = fold(name);
    f.starts_with(INTERNAL_PREFIX) || FORGEABLE_IDENTITY.contains(&&*f) || f == EPOCH || f == REVISION
}

/// Whether `name`, folded, is one of [`UPSTREAM_RESERVED`]: stripped from a request
/// forwarded to an upstream in any spelling.
pub fn upstream_reserved(name: &str) -> bool {
    UPSTREAM_RESERVED.contains(&&*fold(name))
}

/// The lock header (of [`LOCK_HEADERS`]) that `name` spells otherwise than its one
/// accepted spelling, if any: `x_lock_key` gives `Some("x-lock-key")`. Letter case
/// is not a different spelling (HTTP names are case-insensitive, and Envoy delivers
/// them lower-case); an underscore is, because a server that reads `_` as `-` would
/// see a second value the lock tier never checked.
pub fn lock_header_twin(name: &str) -> Option<&'static str> {
    if !name.contains('_') {
        return None;
    }
    let f = fold(name);
    LOCK_HEADERS.iter().copied().find(|h| *h == f)
}

/// Longest value accepted for any lock header except the key.
pub const MAX_VALUE_LEN: usize = 64;

/// A refused header: which one and why. Messages never echo the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{header}: {why}")]
pub struct HeaderError {
    /// The header's name.
    pub header: &'static str,
    /// What is wrong, without the value.
    pub why: String,
}

impl HeaderError {
    fn new(header: &'static str, why: impl Into<String>) -> Self {
        Self { header, why: why.into() }
    }
}

/// A session id: an etcd lease id, shown as 16 lowercase hex characters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(i64);

impl SessionId {
    /// From an etcd lease id (must be positive).
    pub fn from_lease(id: i64) -> Option<Self> {
        (id > 0).then_some(Self(id))
    }
    /// The etcd lease id.
    pub fn lease(self) -> i64 {
        self.0
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A session id travels in JSON as its 16 hex digits, as in `x-lock-session`.
impl serde::Serialize for SessionId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Reads the form [`parse_session`] accepts.
impl<'de> serde::Deserialize<'de> for SessionId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        parse_session(s.as_bytes()).map_err(|e| serde::de::Error::custom(e.why))
    }
}

/// Parses `x-lock-key`.
pub fn parse_key(raw: &[u8]) -> Result<LockKey, HeaderError> {
    LockKey::parse(raw).map_err(|e: KeyError| HeaderError::new(KEY, e.to_string()))
}

fn decimal(header: &'static str, raw: &[u8], max_digits: usize) -> Result<u64, HeaderError> {
    if raw.is_empty() || raw.len() > max_digits || !raw.iter().all(u8::is_ascii_digit) {
        return Err(HeaderError::new(header, format!("must be 1-{max_digits} decimal digits")));
    }
    if raw.len() > 1 && raw[0] == b'0' {
        return Err(HeaderError::new(header, "must not have leading zeros"));
    }
    raw.iter()
        .try_fold(0u64, |acc, d| acc.checked_mul(10)?.checked_add(u64::from(d - b'0')))
        .ok_or_else(|| HeaderError::new(header, "is out of range"))
}

/// Parses `x-lock-wait-ms`: a canonical decimal of at most 7 digits (the maximum
/// wait is a configuration limit, checked by whoever applies it).
pub fn parse_wait_ms(raw: &[u8]) -> Result<u64, HeaderError> {
    decimal(WAIT_MS, raw, 7)
}

/// Parses the internal budget header (same form as the wait).
pub fn parse_budget_ms(raw: &[u8]) -> Result<u64, HeaderError> {
    decimal(BUDGET_MS, raw, 7)
}

/// Parses `x-lock-session`: exactly 16 lowercase hex characters, nonzero.
pub fn parse_session(raw: &[u8]) -> Result<SessionId, HeaderError> {
    let ok = raw.len() == 16 && raw.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
    let v = ok
        .then(|| std::str::from_utf8(raw).ok().and_then(|s| u64::from_str_radix(s, 16).ok()))
        .flatten()
        .and_then(|v| i64::try_from(v).ok())
        .and_then(SessionId::from_lease);
    v.ok_or_else(|| HeaderError::new(SESSION, "must be 16 lowercase hex characters naming a session"))
}

/// Parses `x-lock-instance`: 1-64 characters of `[A-Za-z0-9._:-]`.
pub fn parse_instance(raw: &[u8]) -> Result<String, HeaderError> {
    if raw.is_empty()
        || raw.len() > MAX_VALUE_LEN
        || !raw.iter().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(b))
    {
        return Err(HeaderError::new(INSTANCE, "must be 1-64 characters of [A-Za-z0-9._:-]"));
    }
    Ok(String::from_utf8_lossy(raw).into_owned())
}

/// Parses `x-lock-token`.
pub fn parse_token(raw: &[u8]) -> Result<FencingToken, HeaderError> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HeaderError::new(TOKEN, "must be a canonical decimal fencing token"))
}

/// Length of an unprotected grant id ([`GRANT`]).
pub const GRANT_ID_LEN: usize = 32;

/// Parses `x-lock-grant`: exactly 32 lowercase hex characters.
pub fn parse_grant(raw: &[u8]) -> Result<String, HeaderError> {
    if raw.len() != GRANT_ID_LEN || !raw.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)) {
        return Err(HeaderError::new(GRANT, "must be 32 lowercase hex characters naming an unprotected grant"));
    }
    Ok(String::from_utf8_lossy(raw).into_owned())
}

/// Longest election value ([`VALUE`]), bytes.
pub const MAX_ELECTION_VALUE_LEN: usize = 1024;

/// Parses `x-lock-value`: 1-1024 bytes of printable ASCII (space to `~`), no
/// leading or trailing space (a proxy may trim those: one spelling only).
pub fn parse_value(raw: &[u8]) -> Result<String, HeaderError> {
    let printable = raw.iter().all(|b| (b' '..=b'~').contains(b));
    let trimmed = raw.first() != Some(&b' ') && raw.last() != Some(&b' ');
    if raw.is_empty() || raw.len() > MAX_ELECTION_VALUE_LEN || !printable || !trimmed {
        return Err(HeaderError::new(
            VALUE,
            "must be 1-1024 bytes of printable ASCII without leading or trailing spaces",
        ));
    }
    Ok(String::from_utf8_lossy(raw).into_owned())
}

/// Length of an election observer's cursor ([`AFTER`]), hex digits.
pub const ELECTION_CURSOR_LEN: usize = 32;

/// Parses `x-lock-after`: an observer's cursor, [`ELECTION_CURSOR_LEN`] lowercase
/// hex digits as an answer gave it. Only its form is checked here; whether the
/// arbiter can resume from it is the arbiter's to say.
pub fn parse_after(raw: &[u8]) -> Result<String, HeaderError> {
    if raw.len() != ELECTION_CURSOR_LEN || !raw.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)) {
        return Err(HeaderError::new(AFTER, "must be the 32 lowercase hex digits of an answer's cursor"));
    }
    Ok(String::from_utf8_lossy(raw).into_owned())
}

/// Parses `x-lock-class`.
pub fn parse_class(raw: &[u8]) -> Result<crate::ClassName, HeaderError> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| crate::ClassName::parse(s).ok())
        .ok_or_else(|| HeaderError::new(CLASS, "must be 1-63 characters of [a-z0-9-]"))
}

/// Parses `x-lock-permits`: a canonical decimal from 1 to [`MAX_PERMITS`].
pub fn parse_permits(raw: &[u8]) -> Result<u32, HeaderError> {
    match decimal(PERMITS, raw, 2) {
        Ok(k) if (1..=u64::from(MAX_PERMITS)).contains(&k) => Ok(u32::try_from(k).unwrap_or(MAX_PERMITS)),
        Ok(_) => Err(HeaderError::new(PERMITS, format!("must be from 1 to {MAX_PERMITS}"))),
        Err(e) => Err(HeaderError::new(PERMITS, format!("{}; from 1 to {MAX_PERMITS}", e.why))),
    }
}

/// A read-write lock's mode ([`MODE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LockMode {
    /// One of the key's slots: beside other shared holders.
    Shared,
    /// All of the key's slots: alone.
    Exclusive,
}

impl LockMode {
    /// The header spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Exclusive => "exclusive",
        }
    }
}

/// Parses `x-lock-mode`: `shared` or `exclusive`, lower-case.
pub fn parse_mode(raw: &[u8]) -> Result<LockMode, HeaderError> {
    match raw {
        b"shared" => Ok(LockMode::Shared),
        b"exclusive" => Ok(LockMode::Exclusive),
        _ => Err(HeaderError::new(MODE, "must be shared or exclusive")),
    }
}

/// Parses `x-lock-keys`: 2-[`MAX_KEYS`] valid keys separated by single spaces, no
/// key twice. Errors name the position of the key at fault, never a key.
pub fn parse_keys(raw: &[u8]) -> Result<Vec<LockKey>, HeaderError> {
    let max_len = MAX_KEYS * (crate::key::MAX_KEY_LEN + 1);
    if raw.len() > max_len {
        return Err(HeaderError::new(KEYS, format!("is above {max_len} bytes")));
    }
    let mut keys: Vec<LockKey> = Vec::new();
    for (i, part) in raw.split(|b| *b == b' ').enumerate() {
        if keys.len() == MAX_KEYS {
            return Err(HeaderError::new(KEYS, format!("names more than {MAX_KEYS} keys")));
        }
        if part.is_empty() {
            return Err(HeaderError::new(KEYS, "keys are separated by exactly one space, none leading or trailing"));
        }
        let key = LockKey::parse(part).map_err(|e| HeaderError::new(KEYS, format!("key {}: {e}", i + 1)))?;
        if keys.contains(&key) {
            return Err(HeaderError::new(KEYS, format!("key {} names an earlier key again", i + 1)));
        }
        keys.push(key);
    }
    if keys.len() < 2 {
        return Err(HeaderError::new(KEYS, format!("names 2 to {MAX_KEYS} keys (one key: use {KEY})")));
    }
    Ok(keys)
}

/// What an acquire asks for: k of the key's slots, or all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Permits {
    /// `k` slots (`x-lock-permits`, or 1: a plain acquire or a shared hold).
    Count(u32),
    /// Every slot of the key's limit (an exclusive hold).
    All,
}

impl Default for Permits {
    fn default() -> Self {
        Self::Count(1)
    }
}

impl Permits {
    /// How many slots of a key limited to `limit` this takes.
    pub fn of(self, limit: u32) -> u32 {
        match self {
            Self::Count(k) => k,
            Self::All => limit,
        }
    }
}

/// The lock headers of one request, each validated, in canonical form.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LockHeaders {
    /// `x-lock-key`.
    pub key: Option<LockKey>,
    /// `x-lock-wait-ms`.
    pub wait_ms: Option<u64>,
    /// `x-lock-session`.
    pub session: Option<SessionId>,
    /// `x-lock-instance`.
    pub instance: Option<String>,
    /// `x-lock-token`.
    pub token: Option<FencingToken>,
    /// `x-lock-class`.
    pub class: Option<crate::ClassName>,
    /// `x-lock-grant`.
    pub grant: Option<String>,
    /// `x-lock-value`.
    pub value: Option<String>,
    /// `x-lock-after`.
    pub after: Option<String>,
    /// `x-lock-permits`.
    pub permits: Option<u32>,
    /// `x-lock-mode`.
    pub mode: Option<LockMode>,
    /// `x-lock-keys`, in the order sent.
    pub keys: Option<Vec<LockKey>>,
}

impl LockHeaders {
    /// What an acquire with these headers asks for. Both `x-lock-permits` and
    /// `x-lock-mode` leave it open (is `exclusive` with 2 permits 2 slots or all?),
    /// so asking both is refused.
    pub fn permits(&self) -> Result<Permits, HeaderError> {
        match (self.permits, self.mode) {
            (Some(_), Some(_)) => {
                Err(HeaderError::new(PERMITS, "cannot be sent with x-lock-mode: send one (exclusive takes every slot)"))
            }
            (Some(k), None) => Ok(Permits::Count(k)),
            (None, Some(LockMode::Exclusive)) => Ok(Permits::All),
            (None, Some(LockMode::Shared) | None) => Ok(Permits::Count(1)),
        }
    }
}

/// Parses every lock header from `(name, value)` pairs as the host delivers them
/// (names lowercase). A lock header that appears twice is refused, whatever the
/// values: two values leave it open which one a later hop would read. So is one
/// spelt with `_` for `-` ([`lock_header_twin`]), alone or beside the real one: a
/// server that folds names would read it as the lock header, while lockmesh would
/// not have checked it.
pub fn parse_lock_headers<'a, I>(headers: I) -> Result<LockHeaders, HeaderError>
where
    I: IntoIterator<Item = (&'a str, &'a [u8])>,
{
    let mut seen = [false; LOCK_HEADERS.len()];
    let mut out = LockHeaders::default();
    for (name, value) in headers {
        if let Some(h) = lock_header_twin(name) {
            return Err(HeaderError::new(
                h,
                format!("also spelt {name:?}, which a server may read as {h}: send {h} only, with '-'"),
            ));
        }
        let Some(i) = LOCK_HEADERS.iter().position(|h| name.eq_ignore_ascii_case(h)) else {
            continue;
        };
        if seen[i] {
            return Err(HeaderError::new(LOCK_HEADERS[i], "appears more than once"));
        }
        seen[i] = true;
        match i {
            0 => out.key = Some(parse_key(value)?),
            1 => out.wait_ms = Some(parse_wait_ms(value)?),
            2 => out.session = Some(parse_session(value)?),
            3 => out.instance = Some(parse_instance(value)?),
            4 => out.token = Some(parse_token(value)?),
            5 => out.class = Some(parse_class(value)?),
            6 => out.grant = Some(parse_grant(value)?),
            7 => out.value = Some(parse_value(value)?),
            8 => out.after = Some(parse_after(value)?),
            9 => out.permits = Some(parse_permits(value)?),
            10 => out.mode = Some(parse_mode(value)?),
            _ => out.keys = Some(parse_keys(value)?),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(h: &[(&'static str, &'static [u8])]) -> Result<LockHeaders, HeaderError> {
        parse_lock_headers(h.iter().map(|(n, v)| (*n, *v)))
    }

    #[test]
    fn parses_a_full_set() {
        let h = parse(&[
            ("x-lock-key", b"ns/a"),
            ("x-lock-wait-ms", b"1500"),
            ("x-lock-session", b"00000000000000ff"),
            ("x-lock-instance", b"pod-1:42"),
            ("x-lock-token", b"281474976710657"),
            ("x-lock-class", b"default"),
            ("x-other", b"\xff\xfe"),
        ])
        .unwrap();
        assert_eq!(h.wait_ms, Some(1500));
        assert_eq!(h.session.unwrap().lease(), 255);
        assert_eq!(h.session.unwrap().to_string(), "00000000000000ff");
        assert_eq!(h.token.unwrap().epoch(), 1);
    }

    #[test]
    fn permits_and_modes_parse_strictly_and_not_together() {
        let h = parse(&[("x-lock-permits", b"3")]).unwrap();
        assert_eq!(h.permits(), Ok(Permits::Count(3)));
        assert_eq!(parse(&[("x-lock-permits", b"64")]).unwrap().permits, Some(MAX_PERMITS));
        for bad in [&b"0"[..], b"65", b"03", b"+2", b"2 ", b"", b"100", b"two"] {
            assert_eq!(parse(&[("x-lock-permits", bad)]).unwrap_err().header, PERMITS, "{bad:?}");
        }
        assert_eq!(parse(&[("x-lock-mode", b"exclusive")]).unwrap().permits(), Ok(Permits::All));
        assert_eq!(parse(&[("x-lock-mode", b"shared")]).unwrap().permits(), Ok(Permits::Count(1)));
        for bad in [&b"EXCLUSIVE"[..], b"read", b"", b"shared "] {
            assert_eq!(parse(&[("x-lock-mode", bad)]).unwrap_err().header, MODE, "{bad:?}");
        }
        let both = parse(&[("x-lock-permits", b"2"), ("x-lock-mode", b"shared")]).unwrap();
        assert_eq!(both.permits().unwrap_err().header, PERMITS);
        assert_eq!(parse(&[]).unwrap().permits(), Ok(Permits::Count(1)));
        assert_eq!(parse(&[("x_lock_permits", b"2")]).unwrap_err().header, PERMITS);
        assert_eq!(parse(&[("x-lock-mode", b"shared"), ("x-lock-mode", b"shared")]).unwrap_err().header, MODE);
        assert_eq!((Permits::All.of(5), Permits::Count(2).of(5)), (5, 2));
    }

    #[test]
    fn names_the_header_and_never_echoes_the_value() {
        let e = parse(&[("x-lock-wait-ms", b"01")]).unwrap_err();
        assert_eq!(e.header, WAIT_MS);
        let e = parse(&[("x-lock-key", b"ns/a"), ("X-Lock-Key", b"ns/a")]).unwrap_err();
        assert_eq!(e.to_string(), "x-lock-key: appears more than once");
        let e = parse(&[("x-lock-session", b"SECRETSECRETSECR")]).unwrap_err();
        assert!(!e.to_string().contains("SECRET"));
        for bad in [&b""[..], b"0000000000000000", b"ffffffffffffffff", b"00000000000000FF", b"1"] {
            assert!(parse_session(bad).is_err());
        }
        assert!(parse_wait_ms(b"99999999").is_err());
        let g = parse(&[("x-lock-grant", b"0123456789abcdef0123456789abcdef")]).unwrap();
        assert_eq!(g.grant.as_deref(), Some("0123456789abcdef0123456789abcdef"));
        for bad in [&b""[..], b"0123456789ABCDEF0123456789abcdef", b"0123456789abcdef", b"0"] {
            assert_eq!(parse_grant(bad).unwrap_err().header, GRANT);
        }
        assert!(parse_instance(&[b'a'; 65]).is_err());
        assert_eq!(parse_value(b"10.0.0.7:8443 primary").unwrap(), "10.0.0.7:8443 primary");
        assert_eq!(parse_value(&[b'~'; 1024]).unwrap().len(), 1024);
        for bad in [&b""[..], b" lead", b"lead ", b"a\tb", b"\xc3\xa9", &[b'v'; 1025]] {
            assert_eq!(parse_value(bad).unwrap_err().header, VALUE, "{bad:?}");
        }
        let cursor = "0123456789abcdef0123456789abcdef";
        assert_eq!(parse_after(cursor.as_bytes()).unwrap(), cursor);
        let upper = cursor.to_ascii_uppercase();
        for bad in [&b"42"[..], upper.as_bytes(), &cursor.as_bytes()[1..], b"0123456789abcdef0123456789abcdeg", b""] {
            assert_eq!(parse_after(bad).unwrap_err().header, AFTER, "{bad:?}");
        }
    }

    #[test]
    fn fold_reads_underscores_as_dashes_and_ignores_case() {
        assert_eq!(fold("X_Lock_Token"), "x-lock-token");
        assert_eq!(fold("x-lock-token"), "x-lock-token");
        assert!(matches!(fold("x-lock-key"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(fold("_"), "-");
        // Non-ASCII bytes cannot occur in a header name Envoy accepts; they stay.
        assert_eq!(fold("x_\u{e9}"), "x-\u{e9}");
    }

    #[test]
    fn every_spelling_of_an_override_header_is_one() {
        for (sent, want) in [
            ("x-original-url", "x-original-url"),
            ("X_ORIGINAL_URL", "x-original-url"),
            ("x_rewrite-url", "x-rewrite-url"),
            ("x-http_method-override", "x-http-method-override"),
            ("X-HTTP-Method", "x-http-method"),
            ("x_method_override", "x-method-override"),
        ] {
            assert_eq!(override_header(sent), Some(want), "{sent}");
        }
        for other in ["x-request-url", "x-original-url-x", "x-http-methods", "x-lock-key", "", "_"] {
            assert_eq!(override_header(other), None, "{other}");
        }
    }

    #[test]
    fn every_spelling_of_a_reserved_header_is_reserved() {
        for n in ["x-lockmesh-budget-ms", "x_lockmesh_budget_ms", "X-LOCKMESH-VM", "x_lockmesh-x", "x-lockmesh_"] {
            assert!(never_from_client(n), "{n}");
        }
        for n in ["x_forwarded_client_cert", "X-Spiffe-Id", "x_spiffe_id", "x_lock_epoch", "x-lock_revision"] {
            assert!(never_from_client(n), "{n}");
        }
        for n in ["x-lockmeshx", "x-lock-key", "x_lock_token", "x-lockme", "x-forwarded-for", "x_forwarded_for"] {
            assert!(!never_from_client(n), "{n}");
        }
        for n in ["x_lock_token", "x-lock-token", "X_LOCK_PROOF", "x_lock-session", "x_lock_instance", "x_lock_grant"] {
            assert!(upstream_reserved(n), "{n}");
        }
        for n in ["x-lock-key", "x_lock_key", "x-lock-tokens", "x_lock_wait_ms"] {
            assert!(!upstream_reserved(n), "{n}");
        }
    }

    #[test]
    fn an_underscore_twin_of_a_lock_header_is_refused_alone_or_beside_it() {
        for h in LOCK_HEADERS {
            let twin = h.replace('-', "_");
            assert_eq!(lock_header_twin(&twin), Some(h));
            let mixed = h.replacen('-', "_", 1);
            assert_eq!(lock_header_twin(&mixed), Some(h));
            assert_eq!(lock_header_twin(h), None, "the real spelling is not a twin");
            let e = parse_lock_headers([(twin.as_str(), &b"1"[..])]).unwrap_err();
            assert_eq!(e.header, h);
            assert!(e.to_string().contains(&format!("{twin:?}")), "names what was sent: {e}");
        }
        // Beside the real header, with the same value or not, and before or after it.
        let e = parse(&[("x-lock-key", b"ns/a"), ("x_lock_key", b"ns/a")]).unwrap_err();
        assert_eq!(e.header, KEY);
        let e = parse(&[("x_lock_token", b"99999999999999999"), ("x-lock-key", b"ns/a")]).unwrap_err();
        assert_eq!(e.header, TOKEN);
        assert!(!e.to_string().contains("99999"), "never the value: {e}");
        // Not lock headers: left alone.
        assert_eq!(lock_header_twin("x_lock_proof"), None);
        assert_eq!(lock_header_twin("x_lock_keyz"), None);
        assert!(parse(&[("x_custom_header", b"1"), ("x-lock-key", b"ns/a")]).is_ok());
    }

    #[test]
    fn a_key_list_is_two_to_sixteen_distinct_keys_one_space_apart() {
        let ks = parse_keys(b"ns/b ns/a other/c,d").unwrap();
        let got: Vec<&str> = ks.iter().map(LockKey::as_str).collect();
        assert_eq!(got, ["ns/b", "ns/a", "other/c,d"], "kept in the order sent");
        for bad in
            [&b""[..], b"ns/a", b"ns/a  ns/b", b" ns/a ns/b", b"ns/a ns/b ", b"ns/a\tns/b", b"ns/a ns/a", b"ns/a ns"]
        {
            let e = parse_keys(bad).unwrap_err();
            assert_eq!(e.header, KEYS, "{bad:?}");
            assert!(!e.to_string().contains("ns/a"), "never a key: {e}");
        }
        let max: Vec<String> = (0..MAX_KEYS).map(|i| format!("ns/k{i}")).collect();
        assert_eq!(parse_keys(max.join(" ").as_bytes()).unwrap().len(), MAX_KEYS);
        let over: Vec<String> = (0..=MAX_KEYS).map(|i| format!("ns/k{i}")).collect();
        assert!(parse_keys(over.join(" ").as_bytes()).unwrap_err().why.contains("more than 16"));
        let h = parse(&[("x-lock-keys", b"ns/a ns/b"), ("x-lock-wait-ms", b"10")]).unwrap();
        assert_eq!(h.keys.map(|k| k.len()), Some(2));
        assert_eq!(parse(&[("x-lock-keys", b"ns/a ns/b"), ("X-Lock-Keys", b"ns/c ns/d")]).unwrap_err().header, KEYS);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        #[test]
        fn arbitrary_bytes_never_panic(
            which in 0usize..LOCK_HEADERS.len(),
            raw in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            let _ = parse_lock_headers([(LOCK_HEADERS[which], &raw[..])]);
        }

        /// The fold agrees with the rule it states: per byte, `_` to `-`, ASCII lower-case.
        #[test]
        fn fold_is_byte_wise(name in "[A-Za-z0-9_-]{0,24}") {
            let f = fold(&name);
            prop_assert_eq!(f.len(), name.len());
            prop_assert!(!f.contains('_') && !f.bytes().any(|b| b.is_ascii_uppercase()));
            prop_assert_eq!(fold(&f), f.clone());
            prop_assert_eq!(f.replace('-', "_"), name.to_ascii_lowercase().replace('-', "_"));
        }

        #[test]
        fn accepted_wait_values_round_trip(v in 0u64..10_000_000) {
            prop_assert_eq!(parse_wait_ms(v.to_string().as_bytes()).unwrap(), v);
        }
    }
}
