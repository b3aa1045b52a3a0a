//! The SDK's one error type. Every variant has a stable [`Error::code`]; service
//! refusals keep the service's own code. Messages never contain a key or a token.
//! Whether an error is worth retrying is [`Code::retryable`]'s decision for every
//! service code; the SDK's own variants map onto the code of the same meaning.

use lockmesh_core::{code::AnyCode, Code};

use crate::clock::LossReason;

/// Why an SDK call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A configuration value or an argument (`key`) is invalid; `field` names it.
    #[error("{field}: {why}")]
    Config {
        /// The configuration field.
        field: &'static str,
        /// What is wrong.
        why: String,
    },
    /// The key was not granted within the wait (`contended`): it is at its limit
    /// of holders, a grant raced, or this process's own acquire of the key was
    /// still in flight (`reason` `acquiring_here`).
    #[error("not granted within the wait ({reason})")]
    Contended {
        /// The service's reason (`key_gated`, `lock_contended`) or `acquiring_here`.
        reason: String,
    },
    /// The service refused the request with a code other than `contended`.
    #[error("refused: {status} {code}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The service's stable error code (possibly one this build does not know).
        code: AnyCode,
        /// The service's message (never a key or token).
        message: String,
    },
    /// Nothing reached the lock service (connection refused, TLS failure, or an
    /// error answer from Envoy before the arbiter): nothing was granted.
    #[error("lock service unreachable: {0}")]
    Unavailable(String),
    /// The acquire was sent but its answer was lost (timeout, connection reset,
    /// Envoy 5xx after forwarding). The SDK resolves it in the background and
    /// releases the hold if one was made; calling `lock` again is safe.
    #[error("the acquire's outcome is unknown; it is being resolved and any hold released")]
    OutcomeUnknown,
    /// The session (and every hold on it) is lost.
    #[error("session lost ({0})")]
    SessionLost(LossReason),
    /// The session for this key cannot start new work (a keepalive failed).
    #[error("the session is draining: a keepalive failed, no new work may start")]
    Draining,
    /// The key's class failed open during a quorum loss (ADR-04) and the service
    /// answered with an unprotected grant (token 0). The SDK takes protected
    /// grants only: it released that grant at once (if the release was lost, the
    /// hold lapses after the class TTL). Nothing is held; try again once the
    /// quorum is back.
    #[error("the class failed open during a quorum loss; the unprotected grant was released, nothing is held")]
    FailedOpen,
}

// === impl Error ===

impl Error {
    /// A stable code: the service's code for refusals, else one of `config`,
    /// `contended`, `unavailable`, `outcome_unknown`, `session_lost`, `draining`.
    pub fn code(&self) -> &str {
        match self {
            Error::Config { .. } => "config",
            Error::Contended { .. } => "contended",
            Error::Refused { code, .. } => code.as_str(),
            Error::Unavailable(_) => "unavailable",
            Error::OutcomeUnknown => "outcome_unknown",
            Error::SessionLost(_) => "session_lost",
            Error::Draining => "draining",
            Error::FailedOpen => "failed_open",
        }
    }

    /// Whether trying the same call again later may succeed. A refusal is
    /// [`Code::retryable`] (never for a code this build does not know); `contended`
    /// and `unavailable` are their codes' decision too. The SDK's own states are
    /// retryable because the next call starts afresh: after `outcome_unknown` the
    /// acquire is resolved in the background, after `session_lost` the next `lock`
    /// opens a new session, `draining` ends with the next acknowledged keepalive,
    /// and `failed_open` ends with the quorum loss. `config` needs a change.
    pub fn retryable(&self) -> bool {
        match self {
            Error::Config { .. } => false,
            Error::Contended { .. } => Code::Contended.retryable(),
            Error::Unavailable(_) => Code::Unavailable.retryable(),
            Error::Refused { code, .. } => code.retryable(),
            Error::OutcomeUnknown | Error::SessionLost(_) | Error::Draining | Error::FailedOpen => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_cross_tasks_and_threads() {
        send_sync::<crate::Client>();
        send_sync::<crate::LockGuard>();
        send_sync::<Error>();
    }

    #[test]
    fn codes_are_stable_and_refusals_keep_the_service_code() {
        let e = Error::Refused { status: 409, code: Code::Leaked.into(), message: "m".into() };
        assert_eq!((e.code(), e.retryable()), ("leaked", false));
        let e = Error::Refused { status: 503, code: Code::Sealed.into(), message: "m".into() };
        assert!(e.retryable());
        let e = Error::Refused { status: 418, code: AnyCode::parse("teapot"), message: "m".into() };
        assert_eq!((e.code(), e.retryable()), ("teapot", false));
        assert_eq!(Error::SessionLost(LossReason::Deadline).to_string(), "session lost (deadline)");
        assert_eq!(Error::OutcomeUnknown.code(), "outcome_unknown");
    }

    /// The SDK's retry decision for every service code is core's: both for the
    /// error a caller sees and for the release loop's own retries.
    #[test]
    fn every_code_retries_as_core_decides() {
        use crate::api::CallError;
        for code in Code::ALL {
            let call =
                CallError::Refused { status: code.status(), code: code.into(), message: "m".into(), reason: None };
            assert_eq!(call.retryable(), code.retryable(), "{code}: the release loop");
            let e = call.into_error();
            assert_eq!(e.code(), code.as_str());
            assert_eq!(e.retryable(), code.retryable(), "{code}: Error::retryable");
        }
        assert_eq!(Error::Unavailable("x".into()).retryable(), Code::Unavailable.retryable());
    }
}
