"""A thin HTTP front on ClickHouse's engine (chdb-core, in-process) for the tests.

It is NOT ClickHouse's server. It lets the audit tailer's ClickHouse sink
(`extproc/audit/src/clickhouse.rs`) and the report queries reach ClickHouse's own
engine over the HTTP interface's request shape, so that the DDL
(`extproc/audit/src/clickhouse.sql`), the inserts and the queries are parsed,
typed and executed by ClickHouse itself (MergeTree parts on disk in a persistent
session directory, background merges, FINAL).

What it accepts, as ClickHouse's HTTP interface does:
  - `POST /?query=<start>` with the rest of the statement in the body (an INSERT's
    data); `POST /` with the whole statement in the body; `GET /?query=...`.
  - `database=<db>` (the statement runs with it as the current database) and
    `default_format=<fmt>` (the output format when the statement names none;
    TabSeparated otherwise).
  - credentials as `X-ClickHouse-User`/`X-ClickHouse-Key`, `user`/`password`
    parameters or HTTP Basic; checked against `--user` and `--password-file`
    when given (a mismatch is `403`, `Code: 516 ... (AUTHENTICATION_FAILED)`).
  - request bodies with `Content-Length` or `Transfer-Encoding: chunked`.
  - `GET /ping` answers `Ok.`.
  - errors: the engine's own `Code: N. DB::Exception: ...` text, status 404 for
    unknown tables and databases (60, 81), 400 for syntax errors (62), 500 otherwise,
    with `X-ClickHouse-Exception-Code`.
  - more than one statement in a request is refused (Code 62), as ClickHouse's
    HTTP interface refuses multi-statements (the engine alone would run them).

What it does NOT do or check (a production server may differ here):
  - users, roles, grants, quotas, `readonly` (GET is not made read-only), and
    settings passed as URL parameters other than the two above;
  - compressed bodies (`Content-Encoding`, `compress=1`) are refused with 415;
  - sessions (`session_id`), query ids, progress headers, `wait_end_of_query`;
  - concurrency: one statement at a time (a server runs many); each connection
    has its own thread, so an idle keep-alive connection blocks no one;
  - replication, distributed tables, TTLs over days, storage policies.

Usage: chdb_front.py --port P --path DIR [--user U --password-file F] [--init-sql FILE]
`--init-sql` runs each statement of FILE before listening (split at a `;` that
ends a line, `--` comment lines dropped, as `lockmesh_audit::clickhouse::ddl_statements`
splits the shipped DDL); `scripts/up --clickhouse` applies `clickhouse.sql` so.
It prints `chdb front ready on 127.0.0.1:P (engine <version>)` when it listens.
"""

import argparse
import base64
import http.server
import re
import sys
import threading
import urllib.parse

from chdb import session as chdb_session

STATUS_BY_CODE = {60: 404, 81: 404, 62: 400, 516: 403}


def statements_in(sql):
    """How many statements `sql` holds, ignoring quoted text and comments."""
    count, i, n, seen = 0, 0, len(sql), False
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = i + 1
            while j < n and sql[j] != c:
                j += 2 if sql[j] == "\\" else 1
            i, seen = j + 1, True
            continue
        if sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j
            continue
        if sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        if c == ";":
            count += 1 if seen else 0
            seen = False
        elif not c.isspace():
            seen = True
        i += 1
    return count + (1 if seen else 0)


class Front(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "chdb-front"

    def log_message(self, fmt, *args):  # one line per request, never the statement or the body
        sys.stderr.write("%s %s\n" % (self.command, args[1] if len(args) > 1 else ""))

    def answer(self, status, text, code=None, ctype="text/plain; charset=UTF-8"):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if code is not None:
            self.send_header("X-ClickHouse-Exception-Code", str(code))
        self.end_headers()
        self.wfile.write(body)

    def fail(self, code, name, message):
        self.answer(STATUS_BY_CODE.get(code, 500), "Code: %d. DB::Exception: %s. (%s)\n" % (code, message, name), code)

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def authorized(self, params):
        want_user, want_key = self.server.user, self.server.password
        user = self.headers.get("X-ClickHouse-User") or params.get("user")
        key = self.headers.get("X-ClickHouse-Key") or params.get("password")
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            try:
                user, _, key = base64.b64decode(auth[6:]).decode().partition(":")
            except ValueError:
                return False
        if want_user is None:
            return True
        return (user or "default") == want_user and (key or "") == (want_key or "")

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/ping":
            return self.answer(200, "Ok.\n")
        self.run(url, b"")

    def do_POST(self):
        url = urllib.parse.urlsplit(self.path)
        data = self.body()
        if self.headers.get("Content-Encoding") or "compress=1" in (url.query or ""):
            return self.answer(415, "chdb front: compressed bodies are not supported\n")
        self.run(url, data)

    def run(self, url, data):
        if url.path not in ("/", ""):
            return self.answer(404, "There is no handle %s\n" % url.path)
        params = dict(urllib.parse.parse_qsl(url.query or "", keep_blank_values=True))
        if not self.authorized(params):
            return self.fail(516, "AUTHENTICATION_FAILED", "%s: Authentication failed: password is incorrect, or there is no user with such name" % (self.headers.get("X-ClickHouse-User") or params.get("user") or "default"))
        query = params.get("query")
        head = query if query is not None else data.decode("utf-8", "replace")
        if statements_in(head) > 1:
            return self.fail(62, "SYNTAX_ERROR", "Syntax error (Multi-statements are not allowed)")
        if query is not None and data:
            sql = query + "\n" + data.decode("utf-8", "replace")
        else:
            sql = head
        if not sql.strip():
            return self.fail(62, "SYNTAX_ERROR", "Empty query")
        db = params.get("database")
        if db is not None and not re.fullmatch(r"[A-Za-z0-9_]+", db):
            return self.fail(81, "UNKNOWN_DATABASE", "Database %s does not exist" % db)
        fmt = params.get("default_format") or "TabSeparated"
        s = self.server.session
        with self.server.lock:
            self.execute(s, db, sql, fmt)

    def execute(self, s, db, sql, fmt):
        try:
            if db:
                s.query("USE " + db)
            try:
                res = s.query(sql, fmt)
            finally:
                if db:
                    s.query("USE default")
        except Exception as e:  # chdb raises its engine's exception text
            text = str(e).strip()
            m = re.match(r"Code: (\d+)\.", text)
            code = int(m.group(1)) if m else 1000
            return self.answer(STATUS_BY_CODE.get(code, 500), text + "\n", code)
        self.answer(200, res.data() if res is not None else "")


def statements_of(text):
    """The statements of a DDL file, as `ddl_statements` splits them."""
    out, cur = [], []
    for line in text.splitlines():
        if line.lstrip().startswith("--"):
            continue
        stripped = line.rstrip()
        cur.append(stripped.rstrip(";"))
        if stripped.endswith(";"):
            out.append("\n".join(cur).strip())
            cur = []
    if "\n".join(cur).strip():
        out.append("\n".join(cur).strip())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--path", required=True, help="the engine's data directory (kept across restarts)")
    ap.add_argument("--user")
    ap.add_argument("--password-file")
    ap.add_argument("--init-sql", help="statements to run before listening (idempotent DDL)")
    a = ap.parse_args()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), Front)
    srv.daemon_threads = True
    srv.lock = threading.Lock()
    srv.session = chdb_session.Session(a.path)
    srv.user = a.user
    srv.password = open(a.password_file).read().strip() if a.password_file else None
    if a.init_sql:
        for stmt in statements_of(open(a.init_sql).read()):
            srv.session.query(stmt)
    version = srv.session.query("SELECT version()", "TabSeparated").data().strip()
    print("chdb front ready on 127.0.0.1:%d (engine %s)" % (a.port, version), flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
