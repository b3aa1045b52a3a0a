"""The lockmesh holder SDK for Python (docs/SDK.md, Python section).

    from lockmesh import Client, Config

    client = Client(Config("https://lock-tier:18000", "ca.pem", "svid.pem", "svid-key.pem"),
                    on_fence=lambda ev: print("lost", len(ev.keys), "locks:", ev.reason))
    with client.lock("payments/order-42", wait=5.0) as hold:
        while hold.can_start() and hold.remaining_ttl() > 2.0:
            write_with_fence(hold.token)  # one unit of work, fenced by the token
"""

from .aio import AsyncClient, AsyncHold
from .client import Client, Config, FenceEvent, Hold, JeopardyEvent, instance_id
from .clock import CLOSED, DEADLINE, EPOCH_CHANGED, JEOPARDY, LOST, SAFE, SESSION_EXPIRED, KeepaliveClock
from .election import LeaderInfo, Leadership, Observation, Observer
from .errors import (
    ConfigError,
    Contended,
    Draining,
    FailedOpen,
    LockmeshError,
    OutcomeUnknown,
    Refused,
    SessionLost,
    Unavailable,
)

__all__ = [
    "AsyncClient", "AsyncHold", "Client", "Config", "FenceEvent", "Hold", "JeopardyEvent", "instance_id",
    "KeepaliveClock", "SAFE", "JEOPARDY", "LOST", "DEADLINE", "SESSION_EXPIRED", "EPOCH_CHANGED", "CLOSED",
    "LeaderInfo", "Leadership", "Observation", "Observer",
    "ConfigError", "Contended", "Draining", "FailedOpen", "LockmeshError", "OutcomeUnknown", "Refused",
    "SessionLost", "Unavailable",
]
