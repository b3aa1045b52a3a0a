"""Errors with stable codes (the Rust SDK's `Error::code()`, docs/SDK.md).

Messages never contain a key or a token.
"""

from __future__ import annotations

from typing import Optional

# Service codes worth retrying later (core `Code::retryable`'s set as the SDK needs it).
_RETRYABLE_SERVICE = {
    "contended", "sealed", "unavailable", "draining", "queue_full", "rate_limited",
    "spool_full", "quota_exceeded", "capability_disabled",
}


class LockmeshError(Exception):
    """Base class. `code` is stable; `retryable` says whether trying later may succeed."""

    code: str = "error"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)

    @property
    def retryable(self) -> bool:
        return False


class ConfigError(LockmeshError):
    code = "config"


class Contended(LockmeshError):
    """Not granted within the wait. `reason` is the service's (or `acquiring_here`)."""

    code = "contended"

    def __init__(self, reason: str = "key_gated") -> None:
        super().__init__(f"contended ({reason})")
        self.reason = reason

    @property
    def retryable(self) -> bool:
        return True


class Refused(LockmeshError):
    """The service's refusal: `code` is its stable code (`denied`, `leaked`, ...)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code} ({status}): {message}")
        self.status = status
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.code in _RETRYABLE_SERVICE


class Unavailable(LockmeshError):
    """The tier could not be reached (nothing was sent), or a call with no effect to resolve failed."""

    code = "unavailable"

    @property
    def retryable(self) -> bool:
        return True


class OutcomeUnknown(LockmeshError):
    """An acquire's answer was lost; the SDK resolves it in the background (no hold leaks)."""

    code = "outcome_unknown"

    @property
    def retryable(self) -> bool:
        return True


class SessionLost(LockmeshError):
    """The session (and every hold on it) is lost: `reason` is `deadline`, `session_expired`,
    `epoch_changed` or `closed`."""

    code = "session_lost"

    def __init__(self, reason: str) -> None:
        super().__init__(f"session lost ({reason})")
        self.reason = reason

    @property
    def retryable(self) -> bool:
        return True


class Draining(LockmeshError):
    """A keepalive of the session failed: no new work (nor acquire) until one is acknowledged."""

    code = "draining"

    @property
    def retryable(self) -> bool:
        return True


class FailedOpen(LockmeshError):
    """A fail-open class answered an unprotected grant (token 0), which the SDK released."""

    code = "failed_open"

    @property
    def retryable(self) -> bool:
        return True


def error_from_refusal(status: int, code: str, message: str, reason: Optional[str]) -> LockmeshError:
    if code == "contended":
        return Contended(reason or "key_gated")
    return Refused(status, code, message)
