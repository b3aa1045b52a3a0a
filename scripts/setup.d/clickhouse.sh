# shellcheck shell=bash
# Sourced by scripts/setup (TOOLS, say, die in scope): ClickHouse's engine for the
# audit scenarios (docs/AUDIT.md, "ClickHouse sink: what was run").
#
#   chdb-core 26.9.0 (PyPI): ClickHouse's own engine in-process, run behind the
#            test's HTTP front (tests/support/chdb_front.py) by
#            tests/tests/scenarios/audit_clickhouse.rs.
#   pyarrow 26.0.1 (PyPI): reads the tailer's Parquet archives back
#            (tests/tests/scenarios/audit_archive.rs).
#
# Both in the venv .tools/chdb. Idempotent: a venv whose versions match and whose
# engine answers a query is left alone (a fraction of a second).
CHDB_VERSION=26.9.0
PYARROW_VERSION=26.0.1
CHDB_VENV="$TOOLS/chdb"
chdb_ok() {
  "$CHDB_VENV/bin/python" - "$CHDB_VERSION" "$PYARROW_VERSION" >/dev/null 2>&1 <<'PY' || return 1
import sys
from importlib.metadata import version
if (version("chdb-core"), version("pyarrow")) != tuple(sys.argv[1:3]):
    sys.exit(1)
import chdb, pyarrow.parquet  # noqa: F401
sys.exit(0 if chdb.query("SELECT 1 + 1", "CSV").data().strip() == "2" else 1)
PY
}
if ! chdb_ok; then
  say "installing chdb-core $CHDB_VERSION and pyarrow $PYARROW_VERSION (PyPI) into $CHDB_VENV"
  rm -rf "$CHDB_VENV"
  python3 -m venv "$CHDB_VENV" || die "python3 -m venv $CHDB_VENV failed (Debian: apt-get install python3-venv)"
  "$CHDB_VENV/bin/pip" install --quiet --disable-pip-version-check \
    "chdb-core==$CHDB_VERSION" "pyarrow==$PYARROW_VERSION" \
    || die "pip install chdb-core==$CHDB_VERSION pyarrow==$PYARROW_VERSION failed"
  chdb_ok || die "chdb-core $CHDB_VERSION / pyarrow $PYARROW_VERSION not runnable from $CHDB_VENV after install (SELECT 1 + 1 failed)"
fi
say "chdb-core $CHDB_VERSION, pyarrow $PYARROW_VERSION ($CHDB_VENV)"
