# Sourced by scripts/setup (its say, die and TOOLS): the Python SDK (client/python)
# in a project-local venv, $TOOLS/python-sdk, for the SDK conformance suite's Python
# driver and the SDK's unit tests (both run by `cargo test`).
#
#   httpx 0.28.1 (PyPI, the SDK's one dependency) and the package itself, installed
#   editable from client/python, so the tests always run the tree's code; wheel
#   0.45.1 (PyPI) builds it with the venv's own setuptools (no build download).
#
# Idempotent: a venv whose python imports lockmesh from this tree with the pinned
# httpx is left as it is.
PYSDK_VENV="$TOOLS/python-sdk"
PYSDK_HTTPX=0.28.1
PYSDK_WHEEL=0.45.1
pysdk_ok() {
  [ -x "$PYSDK_VENV/bin/python" ] && "$PYSDK_VENV/bin/python" - "$ROOT/client/python/src" "$PYSDK_HTTPX" <<'PY' 2>/dev/null
import os, sys
import httpx, lockmesh
assert httpx.__version__ == sys.argv[2], httpx.__version__
assert os.path.dirname(os.path.dirname(os.path.realpath(lockmesh.__file__))) == os.path.realpath(sys.argv[1])
PY
}
if ! pysdk_ok; then
  say "installing the Python SDK (client/python, editable) + httpx $PYSDK_HTTPX (PyPI) into $PYSDK_VENV"
  rm -rf "$PYSDK_VENV"
  python3 -m venv "$PYSDK_VENV" || die "python3 -m venv $PYSDK_VENV failed (Debian: apt-get install python3-venv)"
  "$PYSDK_VENV/bin/pip" install --quiet --disable-pip-version-check "httpx==$PYSDK_HTTPX" "wheel==$PYSDK_WHEEL" \
    || die "pip install httpx==$PYSDK_HTTPX wheel==$PYSDK_WHEEL into $PYSDK_VENV failed"
  "$PYSDK_VENV/bin/pip" install --quiet --disable-pip-version-check --no-build-isolation --no-deps \
    -e "$ROOT/client/python" || die "pip install -e client/python into $PYSDK_VENV failed"
  pysdk_ok || die "lockmesh (client/python) or httpx $PYSDK_HTTPX not importable from $PYSDK_VENV after install"
fi
say "python sdk $("$PYSDK_VENV/bin/python" --version 2>&1), httpx $PYSDK_HTTPX ($PYSDK_VENV)"
