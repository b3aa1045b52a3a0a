"""A store that reads paths the way many real HTTP stores do, for fence-proxy's
canonical-path tests (fence-proxy/tests/canonical.rs) and the smuggling scenarios
(tests/tests/scenarios/fence_smuggle.rs).

Before it looks a path up it drops the query, percent-decodes the path
(urllib.parse.unquote, so %38 is 8 and %2F is /), merges runs of '/' and resolves
'.' and '..' segments (posixpath.normpath). Every PUT or POST is recorded as
(normalised path, x-lock-token or "-") and answered 200; GET /_writes answers the
records as JSON lines; any other GET answers 200 "ok". It prints its port on stdout
once it listens on 127.0.0.1 (port 0: the system picks; `--port N` picks N).

Like many stores it is lenient where a fence must not be:
- it keeps connections alive (HTTP/1.1) and never reads the body of a GET, HEAD
  or DELETE, so body bytes there are read as the next request on the connection;
- it honours the method override headers (`X-HTTP-Method-Override`,
  `X-HTTP-Method`, `X-Method-Override`: a GET carrying `PUT` is a write) and the
  path override headers (`X-Original-URL`, `X-Rewrite-URL`: the path written);
- a write carrying `x-test-drop: 1` is applied and its connection cut, unanswered;
- a write carrying `x-test-delay-ms: N` is applied (recorded) N ms after it
  arrived, then answered; records carry the time it was applied (`at`, seconds
  since the epoch) and every x-lock-* header as Python read it (`lock_headers`).
"""

import http.server
import json
import posixpath
import socket
import sys
import threading
import time
import urllib.parse

WRITES = []
LOCK = threading.Lock()
OVERRIDES = ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override")
PATHS = ("X-Original-URL", "X-Rewrite-URL")


def normalise(target):
    path = target.split("?", 1)[0]
    path = urllib.parse.unquote(path)
    path = posixpath.normpath("/" + path.lstrip("/"))
    return path.replace("//", "/")


class Store(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self, body):
        data = body.encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _write(self, read_body=True):
        n = int(self.headers.get("content-length") or 0)
        if n and read_body:
            self.rfile.read(n)
        delay = int(self.headers.get("x-test-delay-ms") or 0)
        if delay:
            time.sleep(delay / 1000)
        path = self.path
        for h in PATHS:
            if self.headers.get(h):
                path = self.headers.get(h)
        lock = {k.lower(): v for k, v in self.headers.items() if k.lower().replace("_", "-").startswith("x-lock")}
        rec = {
            "method": self.command,
            "path": normalise(path),
            "token": self.headers.get("x-lock-token", "-"),
            "lock_headers": lock,
            "at": time.time(),
        }
        with LOCK:
            WRITES.append(rec)
        if self.headers.get("x-test-drop"):
            # Applied, never answered: the connection is cut.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._answer("written")

    do_PUT = _write
    do_POST = _write
    do_PATCH = _write

    def do_DELETE(self):
        self._write(read_body=False)

    def do_GET(self):
        for h in OVERRIDES:
            if (self.headers.get(h) or "").upper() in ("PUT", "POST", "PATCH", "DELETE"):
                return self._write(read_body=False)
        if self.path == "/_writes":
            with LOCK:
                body = "".join(json.dumps(w) + "\n" for w in WRITES)
            self._answer(body)
        else:
            self._answer("ok")

    def log_message(self, *args):
        pass


def main():
    port = int(sys.argv[sys.argv.index("--port") + 1]) if "--port" in sys.argv else 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Store)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
