"""The Python SDK's conformance driver (client/conformance/README.md): one JSON
request per stdin line, one reply per request and unsolicited events on stdout.
Each request runs on its own thread, so a waiting campaign blocks nothing else.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Union

import lockmesh
from lockmesh import _planted

_out = threading.Lock()
_state = threading.Lock()
sessions: Dict[str, lockmesh.Client] = {}
holds: Dict[str, Union[List[lockmesh.Hold], lockmesh.Leadership]] = {}


def emit(obj: Dict[str, Any]) -> None:
    line = json.dumps(obj)
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def t_ms() -> int:
    return int(time.monotonic() * 1000)


class Bad(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def arg(req: Dict[str, Any], name: str) -> Any:
    if name not in req:
        raise Bad("bad_request", f"missing argument {name}")
    return req[name]


def seconds(req: Dict[str, Any], name: str) -> Any:
    v = req.get(name)
    return None if v is None else v / 1000.0


def client(req: Dict[str, Any]) -> lockmesh.Client:
    with _state:
        c = sessions.get(arg(req, "session"))
    if c is None:
        raise Bad("unknown_name", "no such session")
    return c


def hold(req: Dict[str, Any], pop: bool = False) -> Any:
    with _state:
        h = holds.pop(arg(req, "hold"), None) if pop else holds.get(arg(req, "hold"))
    if h is None:
        raise Bad("unknown_name", "no such hold")
    return h


def put(req: Dict[str, Any], h: Any) -> None:
    if req.get("as"):
        with _state:
            holds[req["as"]] = h


def open_session(req: Dict[str, Any]) -> Dict[str, Any]:
    name = arg(req, "session")
    env = os.environ
    cfg = lockmesh.Config(env["LOCKMESH_ENDPOINT"], env["LOCKMESH_CA"], env["LOCKMESH_CERT"], env["LOCKMESH_CERT_KEY"])
    for field, key in (("margin", "margin_ms"), ("acquire_slack", "acquire_slack_ms"),
                       ("request_timeout", "request_timeout_ms")):
        if req.get(key) is not None:
            setattr(cfg, field, req[key] / 1000.0)

    def on_fence(ev: lockmesh.FenceEvent) -> None:
        emit({"event": "fenced", "session": name, "lease": ev.session, "keys": ev.keys, "reason": ev.reason,
              "t_ms": t_ms()})

    def on_jeopardy(ev: lockmesh.JeopardyEvent) -> None:
        emit({"event": ev.state, "session": name, "lease": ev.session, "keys": ev.keys, "t_ms": t_ms()})

    c = lockmesh.Client(cfg, on_fence, on_jeopardy)
    with _state:
        sessions[name] = c
    return {}


def handle(req: Dict[str, Any]) -> Dict[str, Any]:
    op = arg(req, "op")
    if op == "open_session":
        return open_session(req)
    if op == "close_session":
        client(req).shutdown()
        return {}
    if op == "acquire":
        c = client(req)
        wait = seconds(req, "wait_ms") or 0.0
        if "keys" in req:
            hs = c.lock_all(req["keys"], wait=wait, cls=req.get("class"), timeout=seconds(req, "timeout_ms"))
        else:
            hs = [c.lock(arg(req, "key"), wait=wait, permits=req.get("permits"), mode=req.get("mode"),
                         cls=req.get("class"), timeout=seconds(req, "timeout_ms"))]
        put(req, hs)
        toks = [str(h.token) for h in hs]
        return {"token": toks[0], "tokens": toks, "lease": hs[0].session, "ttl_s": hs[0].ttl}
    if op in ("release", "resign"):
        h = hold(req, pop=True)
        for g in h if isinstance(h, list) else [h]:
            g.release()
        return {}
    if op in ("can_start", "token", "claim"):
        h = hold(req)
        g = h[0] if isinstance(h, list) else h
        # Floored: a caller that read its clock before this request may add it to
        # that time and stay before the SDK's deadline.
        left = int(g.remaining_ttl() * 1000)
        return {"can_start": g.can_start(), "state": g.state(), "token": str(g.token), "proof": g.proof,
                "remaining_ms": left}
    if op == "held":
        return {"held": [[k, n] for k, n in client(req).held()]}
    if op == "campaign":
        lead = client(req).campaign(arg(req, "key"), value=req.get("value"), wait=seconds(req, "wait_ms"))
        put(req, lead)
        return {"token": str(lead.token), "lease": lead.session}
    if op == "proclaim":
        hold(req).proclaim(arg(req, "value"))
        return {}
    if op == "observe":
        o = client(req).observe(arg(req, "key")).next()
        if o.leader is None:
            return {"has_leader": False, "value": None}
        return {"has_leader": True, "value": o.leader.value}
    if op == "sleep":
        time.sleep(arg(req, "ms") / 1000.0)
        return {}
    raise Bad("bad_request", f"unknown op {op}")


def serve(req: Dict[str, Any]) -> None:
    rid = req.get("id")
    try:
        reply = handle(req)
        reply["ok"] = True
    except Bad as e:
        reply = {"ok": False, "error": e.code, "message": str(e)}
    except lockmesh.LockmeshError as e:
        reply = {"ok": False, "error": e.code, "message": str(e)}
    except Exception as e:  # noqa: BLE001 - reported to the runner, which fails the step
        reply = {"ok": False, "error": "driver_error", "message": f"{type(e).__name__}: {e}"}
    reply["id"] = rid
    emit(reply)


def main() -> None:
    fault = os.environ.get("LOCKMESH_SDK_PLANTED", "")
    if fault and not _planted.plant(fault):
        print(f"driver: this SDK plants no fault named {fault}", file=sys.stderr)
        sys.exit(64)
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError as e:
            emit({"id": None, "ok": False, "error": "bad_request", "message": f"not JSON: {e}"})
            continue
        if req.get("op") == "exit":
            emit({"id": req.get("id"), "ok": True})
            os._exit(0)
        threading.Thread(target=serve, args=(req,), daemon=True).start()
    os._exit(0)


if __name__ == "__main__":
    main()
