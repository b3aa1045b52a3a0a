"""The blocking client: sessions renewed in the background (one thread per
session), two-stage loss, re-entrant holds counted locally, unknown outcomes
resolved without leaking a hold. The contract is docs/SDK.md's, as the Rust SDK
(`client/src`) implements it.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from . import _planted
from ._api import Api, Grant, NotSent, Unknown
from .clock import CLOSED, DEADLINE, EPOCH_CHANGED, JEOPARDY, LOST, SAFE, SESSION_EXPIRED, KeepaliveClock
from .errors import (
    ConfigError,
    Contended,
    Draining,
    LockmeshError,
    OutcomeUnknown,
    Refused,
    SessionLost,
    Unavailable,
)

log = logging.getLogger("lockmesh")

MAX_KEYS = 16
MAX_PERMITS = 64

_instance: Tuple[int, str] = (0, "")


def instance_id() -> str:
    """One id per process (`p<pid>-<64 random bits>`), sent as `x-lock-instance`."""
    global _instance
    pid = os.getpid()
    if _instance[0] != pid:
        _instance = (pid, f"p{pid}-{secrets.token_hex(8)}")
    return _instance[1]


def _now() -> float:
    return time.monotonic()


@dataclass
class Config:
    """`endpoint` is the lock tier's `https://host:port`; `ca`, `cert`, `key` are PEM
    files (the tier's trust root, the workload's SVID and its key). Times in seconds."""

    endpoint: str
    ca: str
    cert: str
    key: str
    margin: float = 1.0
    acquire_slack: float = 5.0
    request_timeout: float = 5.0
    tier_request_timeout: float = 45.0

    def validate(self) -> None:
        if not self.endpoint.startswith("https://"):
            raise ConfigError("endpoint: an https:// URL")
        for name in ("ca", "cert", "key"):
            if not os.path.isfile(getattr(self, name)):
                raise ConfigError(f"{name}: no such file")
        if self.margin < 0 or self.acquire_slack < 0 or self.request_timeout <= 0:
            raise ConfigError("margin, acquire_slack: >= 0; request_timeout: > 0")


@dataclass(frozen=True)
class FenceEvent:
    """Every hold of `session` is gone: stop using its tokens."""

    session: str
    reason: str
    keys: List[str]


@dataclass(frozen=True)
class JeopardyEvent:
    """`state` is `jeopardy` (a keepalive failed: start nothing new) or `safe` (recovered)."""

    session: str
    state: str
    remaining: float
    keys: List[str]


OnFence = Callable[[FenceEvent], None]
OnJeopardy = Callable[[JeopardyEvent], None]


class _Session:
    def __init__(self, client: "Client", sid: str, ttl_s: int, cls: str, opened_sent_at: float) -> None:
        self.client = client
        self.id = sid
        self.ttl_s = ttl_s
        self.cls = cls
        self.clock = KeepaliveClock(opened_sent_at, float(ttl_s), client.config.margin)
        # Guards the clock's changes and the callbacks (told in order under it).
        self.lock = threading.Lock()
        self.keys: Set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockmesh-keepalive", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def lost(self) -> Optional[str]:
        return self.clock.lost

    def state(self) -> str:
        return self.clock.state(_now())

    def lose(self, reason: str) -> None:
        self._lose(reason)
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()

    def _tell(self, state: str) -> None:
        cb = self.client._on_jeopardy
        if cb is None:
            return
        ev = JeopardyEvent(self.id, state, self.clock.remaining(_now()), sorted(self.keys))
        try:
            cb(ev)
        except Exception:  # noqa: BLE001 - a callback's failure must not stop the renewals
            log.exception("jeopardy callback failed")

    def _lose(self, reason: str) -> None:
        with self.lock:
            if not self.clock.on_lost(reason):
                return
            keys = sorted(self.keys)
            if reason != CLOSED:
                log.warning("session lost: %s (%d holds, ttl %ss)", reason, len(keys), self.ttl_s)
                try:
                    self.client._on_fence(FenceEvent(self.id, reason, keys))
                except Exception:  # noqa: BLE001
                    log.exception("fence callback failed")
        self.client._forget(self)
        if reason != CLOSED:
            threading.Thread(target=self._close_quietly, daemon=True).start()

    def _close_quietly(self) -> None:
        try:
            self.client._api.close_session(self.id, self.client.config.request_timeout)
        except (LockmeshError, NotSent, Unknown):
            pass

    def _run(self) -> None:
        self._lose(self._loop())

    def _loop(self) -> str:
        cfg = self.client.config
        ka_timeout = min(self.ttl_s / 6, cfg.request_timeout)
        while True:
            if self.clock.lost is not None:
                return self.clock.lost
            deadline = self.clock.deadline()
            interval = self.clock.next_interval()
            now = _now()
            if self._stop.wait(max(min(now + interval, deadline) - now, 0.0)):
                return CLOSED
            sent = _now()
            if sent >= deadline:
                return DEADLINE
            ok = False
            try:
                self.client._api.keepalive(self.id, max(min(ka_timeout, deadline - sent), 0.001))
                ok = True
            except Refused as e:
                if e.code == "session_expired":
                    return SESSION_EXPIRED
                log.info("keepalive refused: %s", e.code)
            except (LockmeshError, NotSent, Unknown) as e:
                log.info("keepalive failed: %s", type(e).__name__)
            if self._stop.is_set():
                return CLOSED
            answered = _now()
            # A renewal still hanging (or answered) at the deadline is the loss, not jeopardy.
            if answered >= deadline:
                return DEADLINE
            with self.lock:
                if ok:
                    counted = answered if _planted.DEADLINE_FROM_ANSWER else sent
                    if self.clock.on_ack(counted):
                        log.info("keepalive acknowledged: jeopardy ended (ttl %ss)", self.ttl_s)
                        self._tell(SAFE)
                elif self.clock.on_fail(sent):
                    log.warning("keepalive failed: jeopardy (ttl %ss)", self.ttl_s)
                    self._tell(JEOPARDY)


class _Held:
    """One grant held by this process, counted (ADR-13)."""

    def __init__(self, grant: Grant, session: _Session, election: bool) -> None:
        self.grant = grant
        self.session = session
        self.count = 1
        self.election = election


class Hold:
    """A hold of one key: a guard of a counted grant. Use it as a context manager
    (`with client.lock("k") as hold:`) or call `release()`."""

    def __init__(self, client: "Client", held: _Held) -> None:
        self._client = client
        self._held = held
        self._released = False

    @property
    def key(self) -> str:
        return self._held.grant.key

    @property
    def token(self) -> int:
        """The fencing token: send it with every write (`x-lock-token`)."""
        return self._held.grant.token

    @property
    def proof(self) -> Optional[str]:
        """The grant's signed proof (`x-lock-proof`), if the service signs them."""
        return self._held.grant.proof

    @property
    def session(self) -> str:
        return self._held.session.id

    @property
    def ttl(self) -> int:
        return self._held.session.ttl_s

    def state(self) -> str:
        """`safe`, `jeopardy` or `lost`."""
        return self._held.session.state()

    def can_start(self) -> bool:
        """Whether new work may start under this hold: false from the first failed keepalive."""
        return not self._released and self.state() == SAFE

    def in_jeopardy(self) -> bool:
        return self.state() == JEOPARDY

    def lost(self) -> Optional[str]:
        s = self._held.session
        if s.lost is not None:
            return s.lost
        return DEADLINE if s.state() == LOST else None

    def remaining_ttl(self) -> float:
        """Seconds left to the fence deadline: decline work that will not finish inside it."""
        return self._held.session.clock.remaining(_now())

    def release(self) -> None:
        """Releases this guard; the grant is released when its last guard is. Raises
        `SessionLost` if the session was lost (its holds went with it)."""
        if self._released:
            return
        self._released = True
        self._client._release(self._held)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.release()
        except LockmeshError:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        # No key, no token: both are credentials in logs.
        return f"Hold(state={self.state()})"


class Client:
    """One client per workload identity: one session per TTL, every hold of that TTL on it.

    `on_fence` is required (ADR-12): it runs once per lost session, on a background
    thread, and must not block. `on_jeopardy` is told when a session enters
    jeopardy and when it recovers."""

    def __init__(self, config: Config, on_fence: OnFence, on_jeopardy: Optional[OnJeopardy] = None) -> None:
        config.validate()
        self.config = config
        self._on_fence = on_fence
        self._on_jeopardy = on_jeopardy
        self._api = self._make_api()
        self._cond = threading.Condition()
        self._sessions: Dict[int, _Session] = {}
        self._key_ttl: Dict[str, int] = {}
        self._held: Dict[str, _Held] = {}
        self._busy: Set[str] = set()
        self._epochs: Dict[Optional[str], int] = {}

    def _make_api(self) -> Api:
        c = self.config
        try:
            return Api(c.endpoint, c.ca, c.cert, c.key, instance_id(), c.request_timeout)
        except (OSError, ValueError) as e:
            # ssl.SSLError is an OSError: a PEM file that is not what it should be.
            raise ConfigError(f"ca, cert, key: not a usable CA, certificate and key ({type(e).__name__})") from None

    # --- sessions ---

    def _forget(self, s: _Session) -> None:
        with self._cond:
            if self._sessions.get(s.ttl_s) is s:
                del self._sessions[s.ttl_s]
            for k in [k for k, h in self._held.items() if h.session is s]:
                del self._held[k]
            self._cond.notify_all()

    def _session_for(self, key: str, cls: Optional[str]) -> _Session:
        with self._cond:
            ttl = self._key_ttl.get(key)
            s = self._sessions.get(ttl) if ttl is not None else None
            if s is not None and s.lost is None and s.state() != LOST:
                return s
        sent = _now()
        try:
            headers_key = key
            sid, ttl_s, c = self._api.open_session(headers_key, self.config.request_timeout)
        except NotSent as e:
            raise Unavailable(str(e)) from None
        except Unknown as e:
            # At most an empty lease, which expires with its TTL.
            raise Unavailable(str(e)) from None
        if cls is not None and c != cls:
            threading.Thread(target=self._close_id, args=(sid,), daemon=True).start()
            raise ConfigError("class: the key is of another class")
        if self.config.margin >= ttl_s:
            threading.Thread(target=self._close_id, args=(sid,), daemon=True).start()
            raise ConfigError("margin: must be below every TTL")
        with self._cond:
            self._key_ttl[key] = ttl_s
            existing = self._sessions.get(ttl_s)
            if existing is not None and existing.lost is None and existing.state() != LOST:
                threading.Thread(target=self._close_id, args=(sid,), daemon=True).start()
                return existing
            s = _Session(self, sid, ttl_s, c, sent)
            self._sessions[ttl_s] = s
        s.start()
        return s

    def _close_id(self, sid: str) -> None:
        try:
            self._api.close_session(sid, self.config.request_timeout)
        except (LockmeshError, NotSent, Unknown):
            pass

    # --- acquire ---

    def _enter(self, key: str, wait: float, election: bool) -> Optional[Hold]:
        """A nested hold of `key` if this process holds it, else None with `key` marked busy."""
        end = _now() + wait
        with self._cond:
            while True:
                h = self._held.get(key)
                if h is not None and h.session.lost is None:
                    if h.session.state() != SAFE:
                        raise Draining("the session is in jeopardy")
                    if h.election != election:
                        raise Contended("acquiring_here")
                    h.count += 1
                    return Hold(self, h)
                if key not in self._busy:
                    self._busy.add(key)
                    return None
                left = end - _now()
                if left <= 0:
                    raise Contended("acquiring_here")
                self._cond.wait(left)

    def _unbusy(self, keys: Sequence[str]) -> None:
        with self._cond:
            for k in keys:
                self._busy.discard(k)
            self._cond.notify_all()

    def _register(self, grants: List[Grant], s: _Session, honoured: Optional[int], election: bool) -> List[_Held]:
        with self._cond:
            if s.lost is not None:
                raise SessionLost(s.lost)
            out = []
            for g in grants:
                h = _Held(g, s, election)
                self._held[g.key] = h
                s.keys.add(g.key)
                out.append(h)
        self._note_epoch(grants[0], honoured)
        return out

    def _note_epoch(self, g: Grant, honoured: Optional[int]) -> None:
        """A grant of a newer epoch voids every older hold of its cluster (a restore)."""
        floor = honoured if isinstance(honoured, int) else g.epoch
        with self._cond:
            stale = {h.session for h in self._held.values() if h.grant.cluster == g.cluster and h.grant.epoch < floor}
        for s in stale:
            s.lose(EPOCH_CHANGED)

    def _send_acquire(
        self,
        keys: List[str],
        s: _Session,
        wait: float,
        ask: Dict[str, str],
        cls: Optional[str],
        timeout: Optional[float],
        election: bool,
        value: Optional[str],
        multi: bool = False,
    ) -> List[Hold]:
        """Sends one acquire of `keys` (marked busy) and registers the grant. The busy
        mark is cleared here, or by the resolution of an unknown outcome."""
        resolving = False
        try:
            if s.state() != SAFE:
                raise Draining("the session is in jeopardy")
            sent = _now()
            req_timeout = timeout if timeout is not None else wait + self.config.acquire_slack
            try:
                if not multi:
                    g, honoured = self._api.acquire(keys[0], s.id, wait, ask, election, value, req_timeout)
                    grants = [g]
                else:
                    grants, honoured = self._api.acquire_all(keys, s.id, wait, cls, req_timeout), None
            except Unknown:
                resolving = True
                self._resolve_later(keys, s, sent, wait, election)
                raise OutcomeUnknown("the answer was lost; it is resolved in the background") from None
            except NotSent as e:
                raise Unavailable(str(e)) from None
            except Refused as e:
                if e.code == "session_expired":
                    s.lose(SESSION_EXPIRED)
                    raise SessionLost(SESSION_EXPIRED) from None
                raise
            return [Hold(self, h) for h in self._register(grants, s, honoured, election)]
        finally:
            if not resolving:
                self._unbusy(keys)

    def lock(
        self,
        key: str,
        wait: float = 0.0,
        permits: Optional[int] = None,
        mode: Optional[str] = None,
        cls: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Hold:
        """Takes `key`, waiting up to `wait` seconds (0: try once). A key this process
        holds returns another guard of the same grant and sends nothing.
        `permits`: k of a class's N slots; `mode`: `shared` (1) or `exclusive` (all N)."""
        ask: Dict[str, str] = {}
        if permits is not None and mode is not None:
            raise ConfigError("permits and mode: set one")
        if permits is not None:
            if not 1 <= permits <= MAX_PERMITS:
                raise ConfigError(f"permits: 1 to {MAX_PERMITS}")
            ask["x-lock-permits"] = str(permits)
        if mode is not None:
            if mode not in ("shared", "exclusive"):
                raise ConfigError("mode: shared or exclusive")
            ask["x-lock-mode"] = mode
        if cls is not None:
            ask["x-lock-class"] = cls
        nested = self._enter(key, wait, election=False)
        if nested is not None:
            return nested
        try:
            s = self._session_for(key, cls)
        except BaseException:
            self._unbusy([key])
            raise
        return self._send_acquire([key], s, wait, ask, cls, timeout, False, None)[0]

    def lock_all(self, keys: Sequence[str], wait: float = 0.0, cls: Optional[str] = None,
                 timeout: Optional[float] = None) -> List[Hold]:
        """Takes 2 to 16 keys of one class in one grant: every key or none. One hold
        per key, in the order given, all with the same token."""
        keys = list(keys)
        if not 2 <= len(keys) <= MAX_KEYS or len(set(keys)) != len(keys):
            raise ConfigError(f"keys: 2 to {MAX_KEYS} distinct keys")
        with self._cond:
            if any(k in self._busy or k in self._held for k in keys):
                raise Contended("acquiring_here")
            self._busy.update(keys)
        try:
            s = self._session_for(keys[0], cls)
        except BaseException:
            self._unbusy(keys)
            raise
        return self._send_acquire(keys, s, wait, {}, cls, timeout, False, None, multi=True)

    # --- unknown outcomes ---

    def _resolve_later(self, keys: List[str], s: _Session, sent: float, wait: float, election: bool) -> None:
        def run() -> None:
            try:
                self._sleep_until(s, sent + wait + self.config.acquire_slack)
                self._resolve(keys, s, election)
            finally:
                self._unbusy(keys)
            # Once more after the tier's own timeout, for a request that sat in the tier.
            self._sleep_until(s, sent + self.config.tier_request_timeout)
            with self._cond:
                free = [k for k in keys if k not in self._busy and k not in self._held]
                self._busy.update(free)
            try:
                if free:
                    self._resolve(free, s, election)
            finally:
                self._unbusy(free)

        threading.Thread(target=run, name="lockmesh-resolve", daemon=True).start()

    def _sleep_until(self, s: _Session, t: float) -> None:
        while s.lost is None and _now() < t:
            time.sleep(min(t - _now(), 0.1) if t > _now() else 0)

    def _resolve(self, keys: List[str], s: _Session, election: bool) -> None:
        """Lists the session's holds (until answered) and releases any grant of `keys`."""
        while s.lost is None:
            try:
                holds = self._api.holds(s.id, self.config.request_timeout)
                break
            except Refused as e:
                if e.code == "session_expired":
                    s.lose(SESSION_EXPIRED)
                    return
                time.sleep(0.5)
            except (LockmeshError, NotSent, Unknown):
                time.sleep(0.5)
        else:
            return
        for key, token in holds:
            if key in keys:
                g = Grant(key, token, s.id, s.ttl_s, s.cls)
                log.info("releasing a grant whose answer was lost")
                self._send_release(g, s, election)

    # --- release ---

    def _send_release(self, g: Grant, s: _Session, resign: bool) -> None:
        """Retried with backoff until answered or the session is lost."""
        backoff = 0.1
        while s.lost is None:
            try:
                self._api.release(g, resign, self.config.request_timeout)
                return
            except Refused as e:
                if e.code == "session_expired":
                    s.lose(SESSION_EXPIRED)
                    return
                if e.code == "not_holder":
                    return
                if not e.retryable:
                    raise
            except (NotSent, Unknown, LockmeshError):
                pass
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def _release(self, h: _Held) -> None:
        s = h.session
        with self._cond:
            if s.lost is not None:
                raise SessionLost(s.lost)
            if self._held.get(h.grant.key) is not h:
                return
            h.count -= 1
            if h.count > 0:
                return
            del self._held[h.grant.key]
            s.keys.discard(h.grant.key)
            self._busy.add(h.grant.key)
        try:
            self._send_release(h.grant, s, h.election)
        finally:
            self._unbusy([h.grant.key])
        if s.lost is not None:
            raise SessionLost(s.lost)

    # --- elections ---

    def campaign(self, key: str, value: Optional[str] = None, wait: Optional[float] = None,
                 cls: Optional[str] = None, round: float = 30.0) -> "Leadership":
        """Campaigns until leader (`wait` None) or up to `wait` seconds (0: one try).
        The campaign stops with `SessionLost` when its session is lost; it never
        opens another session to carry on."""
        from .election import Leadership

        nested = self._enter(key, wait if wait is not None else 1e9, election=True)
        if nested is not None:
            lead = Leadership(self, nested._held)
            if value is not None:
                lead.proclaim(value)
            return lead
        try:
            s = self._session_for(key, cls)
        except BaseException:
            self._unbusy([key])
            raise
        end = None if wait is None else _now() + wait
        ask = {"x-lock-class": cls} if cls else {}
        while True:
            if s.lost is not None:
                self._unbusy([key])
                raise SessionLost(s.lost)
            this = round if end is None else max(min(round, end - _now()), 0.0)
            # Every request ends before the session's deadline: a campaign never outlives it.
            this = max(min(this, s.clock.remaining(_now()) - 0.5), 0.0)
            with self._cond:
                self._busy.add(key)
            try:
                hold = self._send_acquire([key], s, this, ask, cls, None, True, value)[0]
                return Leadership(self, hold._held)
            except Contended:
                if end is not None and _now() >= end:
                    raise
            except Draining:
                if s.lost is not None:
                    raise SessionLost(s.lost) from None
                if end is not None and _now() >= end:
                    raise
                time.sleep(min(s.clock.next_interval(), 0.5))

    def observe(self, key: str, poll: float = 30.0) -> "Observer":
        from .election import Observer

        return Observer(self, key, None, poll)

    # --- introspection ---

    def held(self) -> List[Tuple[str, int]]:
        """(key, count) of every hold of this client, sorted by key."""
        with self._cond:
            return sorted((k, h.count) for k, h in self._held.items() if h.session.lost is None)

    def is_idle(self) -> bool:
        with self._cond:
            return not self._held and not self._busy

    def shutdown(self) -> None:
        """Closes every session (each releases all its holds in one committed entry)."""
        with self._cond:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.lose(CLOSED)
            self._close_id(s.id)
        self._api.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
