//! Stable error codes and the one table that turns a code into an answer. Each
//! refusal carries its code in its JSON body ([`crate::wire::error::ErrorBody`]) and
//! in the `x-lockmesh-error` header; clients branch on the code, never on the
//! message. New codes may be added; none is renamed.
//!
//! Everything a refusal's answer depends on besides its message is decided here,
//! per code: the HTTP status ([`Code::status`]), whether the same request may
//! succeed later ([`Code::retryable`]), whether the answer carries `retry-after`
//! and its value ([`Code::retry_after_s`]), and the headers of the answer
//! ([`Code::error_headers`]). The arbiter, the Wasm filter and the SDK all read
//! this table; none keeps its own.
//!
//! | Code | Status | Retryable | `retry-after` |
//! |---|---|---|---|
//! | `bad_request` | 400 | no | |
//! | `unauthenticated` | 401 | no | |
//! | `denied` | 403 | no | |
//! | `class_mismatch` | 400 | no | |
//! | `contended` | 409 | yes | |
//! | `leaked` | 409 | no | |
//! | `not_holder` | 409 | no | |
//! | `session_expired` | 410 | no (open a new session) | |
//! | `session_class_mismatch` | 400 | no | |
//! | `sealed` | 503 | yes | 1 |
//! | `unavailable` | 503 | yes | 1 |
//! | `draining` | 503 | yes | 1 |
//! | `queue_full` | 429 | yes | 1 |
//! | `not_found` | 404 | no | |
//! | `lock_required` | 428 | no | |
//! | `rate_limited` | 429 | yes | 1 |
//! | `internal` | 500 | no | |
//! | `wrong_region` | 421 | no (send it to the named region) | |
//! | `spool_full` | 503 | yes | 1 |
//! | `quota_exceeded` | 429 | yes | 1 |
//! | `keys_span_clusters` | 409 | no (name keys of one cluster) | |
//! | `mode_conflict` | 409 | no (release first, or ask the held mode) | |
//! | `capability_disabled` | 503 | yes (once an operator enables it) | 1 |

use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

use crate::headers;

/// A stable error code and the HTTP status it is answered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    /// A malformed, oversized, duplicated or missing header or parameter.
    BadRequest,
    /// No verifiable caller identity (no mTLS peer SPIFFE ID).
    Unauthenticated,
    /// The identity may not do this to this key. Same bytes whether or not the key exists.
    Denied,
    /// `x-lock-class` names a class other than the key's.
    ClassMismatch,
    /// Not granted before the deadline; see [`Reason`].
    Contended,
    /// The same identity and instance already holds the key under another session.
    Leaked,
    /// The token is not the current grant of the key (release, validate).
    NotHolder,
    /// The session does not exist, has expired, or is not the caller's.
    SessionExpired,
    /// The session's TTL is not the key's class TTL.
    SessionClassMismatch,
    /// The cluster is sealed (restore detected or explicit) until the epoch advances.
    Sealed,
    /// No etcd quorum or the arbiter cannot reach etcd: nothing was granted.
    Unavailable,
    /// The class is draining a limit change; new grants are refused.
    Draining,
    /// Too many requests are already queued for this key.
    QueueFull,
    /// The route is unknown.
    NotFound,
    /// A transparent-mode route requires `x-lock-key` and the request has none.
    LockRequired,
    /// The caller is over a rate limit (its identity's on the lock tier, or
    /// ValidateToken's); nothing was queued or read.
    RateLimited,
    /// A bug or an unexpected state; nothing was granted.
    Internal,
    /// The key's namespace is homed in another region (ADR-08); the answer names
    /// it. Nothing was forwarded.
    WrongRegion,
    /// A fail-open class's unprotected grant could not be spooled (the spool is at
    /// its size cap or cannot be written, ADR-04): nothing was granted.
    SpoolFull,
    /// The key's namespace is at one of its quotas (sessions, holds, waiters,
    /// acquire rate; the body's `quota` names it): nothing was granted or opened.
    QuotaExceeded,
    /// A multi-key acquire named keys that live on different etcd clusters (the
    /// shard map homes them apart): one transaction cannot grant them, so nothing
    /// was granted.
    KeysSpanClusters,
    /// The session already holds the key in another mode or with another number
    /// of permits than this acquire asks for (`x-lock-mode`, `x-lock-permits`): a
    /// held key's mode is never changed by a re-acquire. The body says what is held.
    ModeConflict,
    /// The acquire needs a record kind the keyspace has not enabled yet (a rolling
    /// upgrade not finished: `lockctl upgrade enable`): k permits or an exclusive
    /// hold of more than one slot before `multi_slot_holds`. Nothing was granted.
    CapabilityDisabled,
}

/// Why an acquire was not granted (with [`Code::Contended`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The key is at its limit of holders.
    KeyGated,
    /// A transient conflict with a concurrent grant.
    LockContended,
    /// The key is free but in its class's lock-delay: its last hold ended without
    /// its holder releasing it (the session expired, or a force release), and the
    /// class keeps the key ungrantable for `lock_delay_s` after that was seen.
    LockDelay,
}

/// A code as read off the wire: one this build knows, or one it does not (a newer
/// service). Readers must accept codes they do not know: the set grows. An unknown
/// code is never retryable and has no status of its own (the answer's status is
/// what the reader has).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AnyCode {
    /// A code of [`Code::ALL`].
    Known(Code),
    /// Any other string, kept as sent.
    Unknown(String),
}

/// A [`Reason`] as read off the wire, or one this build does not know.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AnyReason {
    /// A reason this build knows.
    Known(Reason),
    /// Any other string, kept as sent.
    Unknown(String),
}

/// The value of `retry-after`, in seconds, on every answer that carries it.
pub const RETRY_AFTER_S: u32 = 1;
/// [`RETRY_AFTER_S`] as the header value.
const RETRY_AFTER_VALUE: &str = "1";

// === impl Code ===

impl Code {
    /// Every code, for docs and tests.
    pub const ALL: [Code; 23] = [
        Code::BadRequest,
        Code::Unauthenticated,
        Code::Denied,
        Code::ClassMismatch,
        Code::Contended,
        Code::Leaked,
        Code::NotHolder,
        Code::SessionExpired,
        Code::SessionClassMismatch,
        Code::Sealed,
        Code::Unavailable,
        Code::Draining,
        Code::QueueFull,
        Code::NotFound,
        Code::LockRequired,
        Code::RateLimited,
        Code::Internal,
        Code::WrongRegion,
        Code::SpoolFull,
        Code::QuotaExceeded,
        Code::KeysSpanClusters,
        Code::ModeConflict,
        Code::CapabilityDisabled,
    ];

    /// The wire string (snake_case), as in the body's `code` and `x-lockmesh-error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::BadRequest => "bad_request",
            Code::Unauthenticated => "unauthenticated",
            Code::Denied => "denied",
            Code::ClassMismatch => "class_mismatch",
            Code::Contended => "contended",
            Code::Leaked => "leaked",
            Code::NotHolder => "not_holder",
            Code::SessionExpired => "session_expired",
            Code::SessionClassMismatch => "session_class_mismatch",
            Code::Sealed => "sealed",
            Code::Unavailable => "unavailable",
            Code::Draining => "draining",
            Code::QueueFull => "queue_full",
            Code::NotFound => "not_found",
            Code::LockRequired => "lock_required",
            Code::RateLimited => "rate_limited",
            Code::Internal => "internal",
            Code::WrongRegion => "wrong_region",
            Code::SpoolFull => "spool_full",
            Code::QuotaExceeded => "quota_exceeded",
            Code::KeysSpanClusters => "keys_span_clusters",
            Code::ModeConflict => "mode_conflict",
            Code::CapabilityDisabled => "capability_disabled",
        }
    }

    /// The HTTP status every answer with this code has (docs/API.md, Errors).
    pub fn status(self) -> u16 {
        match self {
            Code::BadRequest | Code::ClassMismatch | Code::SessionClassMismatch => 400,
            Code::Unauthenticated => 401,
            Code::Denied => 403,
            Code::NotFound => 404,
            Code::WrongRegion => 421,
            Code::Contended | Code::Leaked | Code::NotHolder | Code::KeysSpanClusters | Code::ModeConflict => 409,
            Code::SessionExpired => 410,
            Code::LockRequired => 428,
            Code::QueueFull | Code::RateLimited | Code::QuotaExceeded => 429,
            Code::Internal => 500,
            Code::Sealed | Code::Unavailable | Code::Draining | Code::SpoolFull | Code::CapabilityDisabled => 503,
        }
    }

    /// The same as [`Code::status`]; kept until the arbiter and the filter call
    /// `status`.
    pub fn http_status(self) -> u16 {
        self.status()
    }

    /// Whether the *same* request, sent again later without any change, may
    /// succeed: the refusal describes a state of the service or of the key that
    /// passes by itself (contention, a quorum loss, a seal until the operator's
    /// epoch advance, a drain, a full queue or spool, a rate limit). Nothing was
    /// granted or changed by a refusal, so a retry is always safe; this says
    /// whether it is useful.
    ///
    /// Not retryable: a request that must change first. That includes
    /// `session_expired` (the session is gone for good: open a new one and send the
    /// request on it; the SDK does this itself and reports the loss as its own
    /// retryable `SessionLost`), `wrong_region` (send it to the named region),
    /// `leaked` (fix the leak) and `internal` (a bug: report it; the same request
    /// most likely meets the same bug).
    pub fn retryable(self) -> bool {
        match self {
            Code::Contended
            | Code::Sealed
            | Code::Unavailable
            | Code::Draining
            | Code::QueueFull
            | Code::RateLimited
            | Code::SpoolFull
            | Code::QuotaExceeded
            | Code::CapabilityDisabled => true,
            Code::BadRequest
            | Code::Unauthenticated
            | Code::Denied
            | Code::ClassMismatch
            | Code::Leaked
            | Code::NotHolder
            | Code::SessionExpired
            | Code::SessionClassMismatch
            | Code::NotFound
            | Code::LockRequired
            | Code::Internal
            | Code::WrongRegion
            | Code::KeysSpanClusters
            | Code::ModeConflict => false,
        }
    }

    /// The `retry-after` an answer with this code carries, in seconds
    /// ([`RETRY_AFTER_S`]), or none. Only retryable codes carry it, and only those
    /// whose wait the client cannot judge itself: a contended key has no
    /// `retry-after` (the caller chose its wait).
    pub fn retry_after_s(self) -> Option<u32> {
        self.carries_retry_after().then_some(RETRY_AFTER_S)
    }

    fn carries_retry_after(self) -> bool {
        matches!(
            self,
            Code::Sealed
                | Code::Unavailable
                | Code::Draining
                | Code::QueueFull
                | Code::RateLimited
                | Code::SpoolFull
                | Code::QuotaExceeded
                | Code::CapabilityDisabled
        )
    }

    /// The headers of every answer refusing with this code, in order:
    /// `x-lockmesh-error: <code>`, then `retry-after` when
    /// [`Code::retry_after_s`] is set. Answer-specific headers (`content-type`, a
    /// `wrong_region` answer's [`headers::REGION`]) are the answering component's.
    pub fn error_headers(self) -> impl Iterator<Item = (&'static str, &'static str)> {
        let retry = self.carries_retry_after().then_some((headers::RETRY_AFTER, RETRY_AFTER_VALUE));
        std::iter::once((headers::ERROR, self.as_str())).chain(retry)
    }

    /// Parses the wire string.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Code {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Strict: an unknown string is an error. Readers of answers use [`AnyCode`].
impl<'de> Deserialize<'de> for Code {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Code::parse(&s).ok_or_else(|| de::Error::custom(format!("unknown error code {s:?}")))
    }
}

// === impl Reason ===

impl Reason {
    /// Every reason, for tests.
    pub const ALL: [Reason; 3] = [Reason::KeyGated, Reason::LockContended, Reason::LockDelay];

    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::KeyGated => "key_gated",
            Reason::LockContended => "lock_contended",
            Reason::LockDelay => "lock_delay",
        }
    }

    /// Parses the wire string.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Strict: an unknown string is an error. Readers of answers use [`AnyReason`].
impl<'de> Deserialize<'de> for Reason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Reason::parse(&s).ok_or_else(|| de::Error::custom(format!("unknown reason {s:?}")))
    }
}

// === impl AnyCode ===

impl AnyCode {
    /// Classifies a wire string.
    pub fn parse(s: &str) -> Self {
        Code::parse(s).map_or_else(|| AnyCode::Unknown(s.to_owned()), AnyCode::Known)
    }

    /// The code, if this build knows it.
    pub fn known(&self) -> Option<Code> {
        match self {
            AnyCode::Known(c) => Some(*c),
            AnyCode::Unknown(_) => None,
        }
    }

    /// The wire string, as sent.
    pub fn as_str(&self) -> &str {
        match self {
            AnyCode::Known(c) => c.as_str(),
            AnyCode::Unknown(s) => s,
        }
    }

    /// [`Code::retryable`]; false for a code this build does not know.
    pub fn retryable(&self) -> bool {
        self.known().is_some_and(Code::retryable)
    }
}

impl From<Code> for AnyCode {
    fn from(c: Code) -> Self {
        AnyCode::Known(c)
    }
}

impl PartialEq<Code> for AnyCode {
    fn eq(&self, other: &Code) -> bool {
        self.known() == Some(*other)
    }
}

impl fmt::Display for AnyCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for AnyCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for AnyCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Ok(AnyCode::parse(&s))
    }
}

// === impl AnyReason ===

impl AnyReason {
    /// Classifies a wire string.
    pub fn parse(s: &str) -> Self {
        Reason::parse(s).map_or_else(|| AnyReason::Unknown(s.to_owned()), AnyReason::Known)
    }

    /// The reason, if this build knows it.
    pub fn known(&self) -> Option<Reason> {
        match self {
            AnyReason::Known(r) => Some(*r),
            AnyReason::Unknown(_) => None,
        }
    }

    /// The wire string, as sent.
    pub fn as_str(&self) -> &str {
        match self {
            AnyReason::Known(r) => r.as_str(),
            AnyReason::Unknown(s) => s,
        }
    }
}

impl From<Reason> for AnyReason {
    fn from(r: Reason) -> Self {
        AnyReason::Known(r)
    }
}

impl fmt::Display for AnyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for AnyReason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for AnyReason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Ok(AnyReason::parse(&s))
    }
}

/// Writes the JSON error body `{"code":..,"message":..[,"reason":..]}` by hand (the
/// Wasm filter has no serde_json on its hot path): byte for byte what serde_json
/// writes for [`crate::wire::error::ErrorBody`] without a region (a test proves it
/// for every code). `message` is escaped as serde_json escapes strings.
pub fn error_body(code: Code, message: &str, reason: Option<Reason>) -> String {
    let mut s = String::with_capacity(48 + message.len());
    s.push_str("{\"code\":\"");
    s.push_str(code.as_str());
    s.push_str("\",\"message\":\"");
    for c in message.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\u{8}' => s.push_str("\\b"),
            '\u{c}' => s.push_str("\\f"),
            '\n' => s.push_str("\\n"),
            '\r' => s.push_str("\\r"),
            '\t' => s.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let b = c as u32 as usize;
                s.push_str("\\u00");
                s.push(char::from(HEX[b >> 4]));
                s.push(char::from(HEX[b & 0xf]));
            }
            c => s.push(c),
        }
    }
    s.push('"');
    if let Some(r) = reason {
        s.push_str(",\"reason\":\"");
        s.push_str(r.as_str());
        s.push('"');
    }
    s.push('}');
    s
}

#[cfg(test)]
mod tests;
