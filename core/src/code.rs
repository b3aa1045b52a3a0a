//! Stable error codes. Each refusal carries one in its JSON body (`{code, message}`)
//! and in the `x-lockmesh-error` header; clients branch on the code, never on the
//! message. New codes may be added; none is renamed.

use std::fmt;

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
}

/// Why an acquire was not granted (with [`Code::Contended`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The key is at its limit of holders.
    KeyGated,
    /// A transient conflict with a concurrent grant.
    LockContended,
}

impl Code {
    /// Every code, for docs and tests.
    pub const ALL: [Code; 19] = [
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
    ];

    /// The wire string.
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
        }
    }

    /// The HTTP status.
    pub fn http_status(self) -> u16 {
        match self {
            Code::BadRequest | Code::ClassMismatch | Code::SessionClassMismatch => 400,
            Code::Unauthenticated => 401,
            Code::Denied => 403,
            Code::NotFound => 404,
            Code::WrongRegion => 421,
            Code::Contended | Code::Leaked | Code::NotHolder => 409,
            Code::SessionExpired => 410,
            Code::LockRequired => 428,
            Code::QueueFull | Code::RateLimited => 429,
            Code::Internal => 500,
            Code::Sealed | Code::Unavailable | Code::Draining | Code::SpoolFull => 503,
        }
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

impl Reason {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::KeyGated => "key_gated",
            Reason::LockContended => "lock_contended",
        }
    }
}

/// Writes the JSON error body `{"code":..,"message":..[,"reason":..]}` by hand (the
/// Wasm filter has no serde_json on its hot path). `message` is escaped.
pub fn error_body(code: Code, message: &str, reason: Option<Reason>) -> String {
    let mut s = String::with_capacity(48 + message.len());
    s.push_str("{\"code\":\"");
    s.push_str(code.as_str());
    s.push_str("\",\"message\":\"");
    for c in message.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            c if (c as u32) < 0x20 => s.push_str(&format!("\\u{:04x}", c as u32)),
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
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_unique() {
        for c in Code::ALL {
            assert_eq!(Code::parse(c.as_str()), Some(c));
        }
        let mut names: Vec<_> = Code::ALL.iter().map(|c| c.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Code::ALL.len());
    }

    #[test]
    fn error_body_is_json() {
        let b = error_body(Code::Contended, "a \"q\"\n", Some(Reason::KeyGated));
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["code"], "contended");
        assert_eq!(v["message"], "a \"q\"\n");
        assert_eq!(v["reason"], "key_gated");
    }
}
