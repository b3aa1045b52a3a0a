"""The two-stage loss clock of one session (ADR-12), pure: times are passed in
(monotonic seconds), so it is unit-tested without waiting.

The deadline is `send time of the last acknowledged keepalive + TTL - margin`
(the session open counts as the first). Jeopardy starts at the first failed
keepalive and ends only by an acknowledgement of a keepalive sent at or after
that failure (recovery), or by the loss. Loss is final and told once.
"""

from __future__ import annotations

from typing import Optional

SAFE = "safe"
JEOPARDY = "jeopardy"
LOST = "lost"

DEADLINE = "deadline"
SESSION_EXPIRED = "session_expired"
EPOCH_CHANGED = "epoch_changed"
CLOSED = "closed"


class KeepaliveClock:
    def __init__(self, opened_sent_at: float, ttl: float, margin: float) -> None:
        self.ttl = ttl
        self.margin = margin
        self.last_ack_sent = opened_sent_at
        self.failed_since: Optional[float] = None
        self.acked = 0
        self.failed = 0
        self.lost: Optional[str] = None

    def deadline(self) -> float:
        return self.last_ack_sent + max(self.ttl - self.margin, 0.0)

    def next_interval(self) -> float:
        """TTL/3 while safe; TTL/10 (0.1-1 s) while in jeopardy."""
        if self.failed_since is not None:
            return min(max(self.ttl / 10, 0.1), 1.0)
        return self.ttl / 3

    def on_ack(self, sent_at: float) -> bool:
        """A keepalive sent at `sent_at` was acknowledged; True if this ends jeopardy."""
        if self.lost is not None:
            return False
        self.acked += 1
        if sent_at > self.last_ack_sent:
            self.last_ack_sent = sent_at
        if self.failed_since is not None and sent_at >= self.failed_since:
            self.failed_since = None
            return True
        return False

    def on_fail(self, sent_at: float) -> bool:
        """A keepalive sent at `sent_at` failed; True if jeopardy starts now."""
        if self.lost is not None:
            return False
        self.failed += 1
        entered = self.failed_since is None
        self.failed_since = sent_at if self.failed_since is None else max(self.failed_since, sent_at)
        return entered

    def on_lost(self, reason: str) -> bool:
        """Marks the session lost; True only the first time."""
        if self.lost is not None:
            return False
        self.lost = reason
        return True

    def check(self, now: float) -> bool:
        """Applies the deadline at `now`: True if the session became lost just now."""
        return now >= self.deadline() and self.on_lost(DEADLINE)

    def state(self, now: float) -> str:
        if self.lost is not None or now >= self.deadline():
            return LOST
        return JEOPARDY if self.failed_since is not None else SAFE

    def can_start(self, now: float) -> bool:
        return self.state(now) == SAFE

    def remaining(self, now: float) -> float:
        if self.lost is not None:
            return 0.0
        return max(self.deadline() - now, 0.0)
