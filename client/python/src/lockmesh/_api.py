"""The lock tier's HTTP API (docs/API.md), one method per route, every failure
classified by what it says about the request's effect:

- `NotSent`: no connection was made; nothing happened.
- a `LockmeshError` refusal: the service answered `{code, message}`.
- `Unknown`: the request may have been acted on (timeout, reset, an answer
  without a lockmesh error body such as Envoy's 500/504).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import httpx

from .errors import FailedOpen, LockmeshError, error_from_refusal

ERROR_HEADER = "x-lockmesh-error"


class NotSent(Exception):
    """The connection could not be made: nothing was sent."""


class Unknown(Exception):
    """Sent; the effect is unknown."""


@dataclass
class Grant:
    key: str
    token: int
    session: str
    ttl_s: int
    cls: str
    cluster: Optional[str] = None
    proof: Optional[str] = field(default=None, repr=False)

    @property
    def epoch(self) -> int:
        return self.token >> 48


def _token(v: Any) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.isdigit():
        return int(v)
    raise Unknown("answer without a valid token")


class Api:
    def __init__(self, endpoint: str, ca: str, cert: str, key: str, instance: str, connect_timeout: float) -> None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        ctx.load_cert_chain(cert, key)
        self._http = httpx.Client(verify=ctx, timeout=httpx.Timeout(connect_timeout))
        self._base = endpoint.rstrip("/")
        self.instance = instance
        self._connect_timeout = connect_timeout

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, headers: Dict[str, str], timeout: float) -> Dict[str, Any]:
        hdrs = {"x-lock-instance": self.instance}
        hdrs.update(headers)
        t = httpx.Timeout(timeout, connect=min(self._connect_timeout, timeout))
        try:
            resp = self._http.request(method, self._base + path, headers=hdrs, timeout=t)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise NotSent(type(e).__name__) from None
        except httpx.HTTPError as e:
            # The exception text may quote the URL, never a key: still keep only its type.
            raise Unknown(type(e).__name__) from None
        status = resp.status_code
        try:
            body = json.loads(resp.content)
        except ValueError:
            body = None
        if 200 <= status < 300:
            if not isinstance(body, dict):
                raise Unknown(f"{path}: status {status} with an answer that is not its body")
            return body
        if isinstance(body, dict) and isinstance(body.get("code"), str) and (ERROR_HEADER in resp.headers or status < 500):
            raise error_from_refusal(status, body["code"], str(body.get("message", "")), body.get("reason"))
        raise Unknown(f"status {status} without a lockmesh error body")

    # --- routes ---

    def open_session(self, key: str, timeout: float) -> Tuple[str, int, str]:
        b = self.call("POST", "/v1/sessions", {"x-lock-key": key}, timeout)
        return str(b["session"]), int(b["ttl_s"]), str(b.get("class", ""))

    def keepalive(self, session: str, timeout: float) -> None:
        b = self.call("POST", "/v1/sessions/keepalive", {"x-lock-session": session}, timeout)
        # Acknowledged only when the answer names this session and a renewed TTL.
        if b.get("session") != session:
            raise Unknown("the keepalive answer names another session")
        if not b.get("ttl_s"):
            raise Unknown("the keepalive answer renewed no ttl")

    def acquire(
        self,
        key: str,
        session: str,
        wait: float,
        ask: Dict[str, str],
        campaign: bool,
        value: Optional[str],
        timeout: float,
    ) -> Tuple[Grant, Optional[int]]:
        h = {"x-lock-key": key, "x-lock-session": session, "x-lock-wait-ms": str(int(wait * 1000))}
        h.update(ask)
        if campaign and value is not None:
            h["x-lock-value"] = value
        path = "/v1/elections/campaign" if campaign else "/v1/locks/acquire"
        b = self.call("POST", path, h, timeout)
        if b.get("unprotected"):
            grant = b.get("grant")
            if isinstance(grant, str):
                try:
                    self.call("POST", "/v1/locks/release", {"x-lock-key": key, "x-lock-grant": grant}, timeout)
                except (LockmeshError, NotSent, Unknown):
                    pass  # it lapses after the class TTL
            raise FailedOpen("an unprotected grant was released")
        if b.get("session") != session:
            raise Unknown("the grant names another session")
        g = Grant(
            key=key,
            token=_token(b.get("token")),
            session=session,
            ttl_s=int(b.get("ttl_s", 0)),
            cls=str(b.get("class", "")),
            cluster=b.get("cluster"),
            proof=b.get("proof"),
        )
        return g, b.get("honoured_from")

    def acquire_all(self, keys: List[str], session: str, wait: float, cls: Optional[str], timeout: float) -> List[Grant]:
        h = {"x-lock-keys": " ".join(keys), "x-lock-session": session, "x-lock-wait-ms": str(int(wait * 1000))}
        if cls:
            h["x-lock-class"] = cls
        b = self.call("POST", "/v1/locks/acquire-all", h, timeout)
        if b.get("session") != session:
            raise Unknown("the grant names another session")
        by_key = {k.get("key"): k for k in b.get("keys", [])}
        out = []
        for key in keys:
            k = by_key.get(key)
            if k is None:
                raise Unknown("answer without a valid keys")
            out.append(
                Grant(key, _token(k.get("token")), session, int(b.get("ttl_s", 0)), str(b.get("class", "")),
                      b.get("cluster"), k.get("proof"))
            )
        return out

    def release(self, g: Grant, resign: bool, timeout: float) -> None:
        h = {"x-lock-key": g.key, "x-lock-token": str(g.token), "x-lock-session": g.session}
        self.call("POST", "/v1/elections/resign" if resign else "/v1/locks/release", h, timeout)

    def proclaim(self, g: Grant, value: str, timeout: float) -> None:
        h = {"x-lock-key": g.key, "x-lock-token": str(g.token), "x-lock-session": g.session, "x-lock-value": value}
        self.call("POST", "/v1/elections/proclaim", h, timeout)

    def observe(self, key: str, after: Optional[str], wait: float, session: Optional[str], timeout: float) -> Dict[str, Any]:
        h = {"x-lock-key": key, "x-lock-wait-ms": str(int(wait * 1000))}
        if after:
            h["x-lock-after"] = after
        if session:
            h["x-lock-session"] = session
        return self.call("GET", "/v1/elections", h, timeout)

    def holds(self, session: str, timeout: float) -> List[Tuple[str, int]]:
        b = self.call("GET", "/v1/sessions/holds", {"x-lock-session": session}, timeout)
        return [(str(h["key"]), _token(h["token"])) for h in b.get("holds", [])]

    def close_session(self, session: str, timeout: float) -> None:
        self.call("POST", "/v1/sessions/close", {"x-lock-session": session}, timeout)
