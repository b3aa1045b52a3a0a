"""Elections on the lock grants (docs/API.md, Elections): `Client.campaign`,
`Leadership`, `Observer`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional

from ._api import NotSent, Unknown
from .client import Hold, _Held
from .errors import LockmeshError, Unavailable

if TYPE_CHECKING:
    from .client import Client


class Leadership(Hold):
    """A counted hold on an election: the token of the leadership, `can_start`,
    `state`, plus `proclaim` and `resign`."""

    def __init__(self, client: "Client", held: _Held) -> None:
        super().__init__(client, held)

    def proclaim(self, value: str) -> None:
        """Replaces the value under this leadership's token; retried while the answer is
        lost. `not_holder` (a `Refused`) means the leadership ended."""
        deadline = time.monotonic() + self._client.config.request_timeout * 3
        while True:
            try:
                self._client._api.proclaim(self._held.grant, value, self._client.config.request_timeout)
                return
            except (NotSent, Unknown) as e:
                if time.monotonic() > deadline:
                    raise Unavailable(type(e).__name__) from None
                time.sleep(0.2)

    def resign(self) -> None:
        """Releases the leadership on the election route: the next campaigner leads."""
        self.release()

    def observe(self) -> "Observer":
        return Observer(self._client, self.key, self.session, 30.0)


@dataclass(frozen=True)
class LeaderInfo:
    identity: str
    value: Optional[str]
    since_ms: int
    token: Optional[int]
    you: bool


@dataclass(frozen=True)
class Observation:
    leader: Optional[LeaderInfo]
    changed: bool
    gap: bool
    cursor: str


def _observation(b: Dict[str, Any]) -> Observation:
    lead = b.get("leader")
    info = None
    if isinstance(lead, dict):
        tok = lead.get("token")
        info = LeaderInfo(
            identity=str(lead.get("identity", "")),
            value=lead.get("value"),
            since_ms=int(lead.get("since_ms", 0)),
            token=int(tok) if tok is not None else None,
            you=bool(lead.get("you", False)),
        )
    return Observation(info, bool(b.get("changed", False)), bool(b.get("gap", False)), str(b.get("cursor", "")))


class Observer:
    """The first `next()` is the state now; each later one the first change after
    the previous observation (long polls of `poll` seconds, sent again until a
    change comes). An error leaves the cursor where it was."""

    def __init__(self, client: "Client", key: str, session: Optional[str], poll: float) -> None:
        self._client = client
        self._key = key
        self._session = session
        self._poll = poll
        self._cursor: Optional[str] = None

    @property
    def cursor(self) -> Optional[str]:
        return self._cursor

    def resume_from(self, cursor: str) -> "Observer":
        self._cursor = cursor
        return self

    def next(self) -> Observation:
        api, cfg = self._client._api, self._client.config
        while True:
            wait = 0.0 if self._cursor is None else self._poll
            try:
                b = api.observe(self._key, self._cursor, wait, self._session, wait + cfg.request_timeout)
            except (NotSent, Unknown) as e:
                raise Unavailable(type(e).__name__) from None
            o = _observation(b)
            first = self._cursor is None
            self._cursor = o.cursor or self._cursor
            if first or o.changed or o.gap:
                return o


__all__ = ["Leadership", "LeaderInfo", "Observation", "Observer", "LockmeshError"]
