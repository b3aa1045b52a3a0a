#!/usr/bin/env bash
# Starts the Go SDK's conformance driver (client/conformance/README.md): builds it
# with the toolchain scripts/setup installs (.tools/go, or $LOCKMESH_GOROOT) into
# <cargo target>/go/bin, once per source change (Go's build cache makes a rebuild of
# unchanged sources a cache check; a lock serialises concurrent starts), then execs
# it with stdin, stdout and the environment the runner gave. Exits 127 naming the
# setup step when the toolchain is missing. `--build` only builds (scripts/setup
# runs it, so the first scenario does not pay a cold build of the standard library).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
GOROOT=${LOCKMESH_GOROOT:-$(cat "$ROOT/.tools/go/GOROOT" 2>/dev/null || true)}
if [ -z "$GOROOT" ] || [ ! -x "$GOROOT/bin/go" ]; then
  echo "go-driver: the Go toolchain is not installed (.tools/go/GOROOT): run scripts/setup" >&2
  exit 127
fi
T=${CARGO_TARGET_DIR:-$ROOT/target}
case "$T" in /*) ;; *) T="$ROOT/$T" ;; esac
T="$T/go"
mkdir -p "$T/bin"
export GOROOT GOTOOLCHAIN=local GOPROXY=off GOSUMDB=off GOTELEMETRY=off GOENV=off \
  GOFLAGS=-mod=readonly CGO_ENABLED=0 GOCACHE="$T/cache" GOPATH="$T/path"
bin="$T/bin/lockmesh-go-conformance-driver"
(
  flock 9
  cd "$ROOT/client/go"
  "$GOROOT/bin/go" build -o "$bin.tmp" ./cmd/conformance-driver >&2
  mv -f "$bin.tmp" "$bin"
) 9>"$T/bin/.build.lock" || { echo "go-driver: go build ./cmd/conformance-driver failed" >&2; exit 1; }
[ "${1:-}" = --build ] && exit 0
exec "$bin"
