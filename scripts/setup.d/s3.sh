# shellcheck shell=bash
# Sourced by scripts/setup (TOOLS, say, die in scope): an S3-compatible server for
# the S3 reference fence (docs/FENCING.md, "S3 conditional put") and the archive
# scenarios.
#
#   moto 5.2.5 (PyPI) with its s3 extra, Flask 3.1.3, flask-cors 6.0.5 and
#            Werkzeug 3.1.9, in the venv .tools/s3: `.tools/s3/bin/moto_server`,
#            started by the harness (tests/src/s3.rs, `lockmesh_tests::s3`).
#
# moto's `server` extra would also install what its other services need (cfn-lint,
# docker, aws-xray-sdk, graphql-core, ...); S3 needs only the `s3` extra and the two
# packages moto.server imports (flask, flask_cors). Werkzeug is pinned because the
# harness runs its development server (moto_server's own, or single-threaded).
# Idempotent: a venv whose versions match and whose moto_server starts is left alone.
MOTO_VERSION=5.2.5
FLASK_VERSION=3.1.3
FLASK_CORS_VERSION=6.0.5
WERKZEUG_VERSION=3.1.9
S3_VENV="$TOOLS/s3"
s3_ok() {
  [ -x "$S3_VENV/bin/moto_server" ] || return 1
  "$S3_VENV/bin/python" - "$MOTO_VERSION" "$FLASK_VERSION" "$FLASK_CORS_VERSION" "$WERKZEUG_VERSION" >/dev/null 2>&1 <<'PY' || return 1
import sys
from importlib.metadata import version
got = (version("moto"), version("flask"), version("flask-cors"), version("werkzeug"))
if got != tuple(sys.argv[1:5]):
    sys.exit(1)
import moto.server, moto.s3.responses  # noqa: F401  (what moto_server loads for S3)
PY
}
if ! s3_ok; then
  say "installing moto $MOTO_VERSION (s3), flask $FLASK_VERSION, flask-cors $FLASK_CORS_VERSION, werkzeug $WERKZEUG_VERSION (PyPI) into $S3_VENV"
  rm -rf "$S3_VENV"
  python3 -m venv "$S3_VENV" || die "python3 -m venv $S3_VENV failed (Debian: apt-get install python3-venv)"
  "$S3_VENV/bin/pip" install --quiet --disable-pip-version-check \
    "moto[s3]==$MOTO_VERSION" "flask==$FLASK_VERSION" "flask-cors==$FLASK_CORS_VERSION" "werkzeug==$WERKZEUG_VERSION" \
    || die "pip install moto[s3]==$MOTO_VERSION flask==$FLASK_VERSION flask-cors==$FLASK_CORS_VERSION werkzeug==$WERKZEUG_VERSION failed"
  s3_ok || die "moto $MOTO_VERSION not runnable from $S3_VENV after install (no $S3_VENV/bin/moto_server, or moto.server / moto.s3 do not import)"
fi
say "moto $MOTO_VERSION ($S3_VENV/bin/moto_server)"
