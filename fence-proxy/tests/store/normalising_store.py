"""A store that reads paths the way many real HTTP stores do, for fence-proxy's
canonical-path tests (fence-proxy/tests/canonical.rs).

Before it looks a path up it drops the query, percent-decodes the path
(urllib.parse.unquote, so %38 is 8 and %2F is /), merges runs of '/' and resolves
'.' and '..' segments (posixpath.normpath). Every PUT or POST is recorded as
(normalised path, x-lock-token or "-") and answered 200; GET /_writes answers the
records as JSON lines; any other GET answers 200 "ok". It prints its port on stdout
once it listens on 127.0.0.1 (port 0: the system picks).
"""

import http.server
import json
import posixpath
import sys
import urllib.parse

WRITES = []


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

    def _write(self):
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)
        WRITES.append({"path": normalise(self.path), "token": self.headers.get("x-lock-token", "-")})
        self._answer("written")

    do_PUT = _write
    do_POST = _write

    def do_GET(self):
        if self.path == "/_writes":
            self._answer("".join(json.dumps(w) + "\n" for w in WRITES))
        else:
            self._answer("ok")

    def log_message(self, *args):
        pass


def main():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Store)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
