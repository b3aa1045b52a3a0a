# shellcheck shell=bash
# Sourced by scripts/setup (its TOOLS, say, die and debian_uri exist here).
#
# The Go toolchain for the Go SDK (client/go) and its conformance driver: Debian
# trixie-backports' golang-1.27 (go + src packages, version and sha256 pinned),
# extracted into .tools/go; the system is left alone. .tools/go/GOROOT names the
# GOROOT to use. No Go module proxy is reachable here, so the SDK uses only the
# standard library and every go command runs with GOPROXY=off GOTOOLCHAIN=local.
#
# Why this suite: bookworm ships Go 1.19 and bookworm-backports 1.23, both past
# their upstream support (Go supports its two newest releases); trixie-backports
# carries 1.27, a supported release, and its binaries are static (they run on
# bookworm).
#
# Fallback rule: backports replace a version when a newer one lands. If the pinned
# version is gone from trixie-backports, setup takes the newest 1.27.x it offers
# (verified by apt against the suite's signed index, not by the pinned sha256) and
# says so loudly; if no 1.27.x is offered at all it fails: move GO_MINOR, GO_VERSION,
# both sha256 here and the `go` directive of client/go/go.mod together.
GO_MINOR=1.27
GO_VERSION=1.27.4-1~bpo13+1
GO_SUITE=trixie-backports
GO_GO_SHA256=76cf0572e0ca5787a802893a27a8fc92098e57d3116c3af7754f27937c1756aa
GO_SRC_SHA256=cc5912625aa0a1c22f41ca929684450c92f5add340c358e24df0b2612b3231d7
GO_DIR="$TOOLS/go"

go_ok() {
  local root
  root=$(cat "$GO_DIR/GOROOT" 2>/dev/null) || return 1
  [ -x "$root/bin/go" ] || return 1
  GOTOOLCHAIN=local GOPROXY=off "$root/bin/go" version 2>/dev/null | grep -q "go$GO_MINOR[. ]"
}

if [ "$(cat "$GO_DIR/VERSION" 2>/dev/null)" = "" ] || ! go_ok; then
  apt="$TOOLS/apt-$GO_SUITE"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/go-debs"
  echo "deb $(debian_uri) $GO_SUITE main" >"$apt/sources.list"
  opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=-"
        -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "APT::Get::List-Cleanup=0")
  say "reading the Debian $GO_SUITE index for golang-$GO_MINOR $GO_VERSION"
  apt-get "${opts[@]}" update -qq >/dev/null 2>&1 || die "apt-get update for Debian $GO_SUITE failed: cannot fetch Go"
  go_avail=$(apt-cache "${opts[@]}" madison "golang-$GO_MINOR-go" 2>/dev/null | awk -F'|' '{gsub(/ /,"",$2); print $2}' | sort -uV)
  go_use=$GO_VERSION; go_sha=$GO_GO_SHA256; src_sha=$GO_SRC_SHA256
  if ! grep -qxF "$GO_VERSION" <<<"$go_avail"; then
    go_use=$(tail -n1 <<<"$go_avail")
    [ -n "$go_use" ] || die "golang-$GO_MINOR $GO_VERSION is gone from Debian $GO_SUITE and no golang-$GO_MINOR is offered. Move the pin in scripts/setup.d/go.sh (GO_MINOR, GO_VERSION, both sha256) and the go directive of client/go/go.mod."
    printf '\n\033[1;33m[setup] WARNING: pinned golang-%s %s is gone from Debian %s; using %s (verified by apt against the signed index, not by the pinned sha256). Move GO_VERSION and the two sha256 in scripts/setup.d/go.sh.\033[0m\n\n' "$GO_MINOR" "$GO_VERSION" "$GO_SUITE" "$go_use" >&2
    go_sha=""; src_sha=""
  fi
  (cd "$apt/go-debs" && rm -f ./*.deb && apt-get "${opts[@]}" download -qq \
      "golang-$GO_MINOR-go=$go_use" "golang-$GO_MINOR-src=$go_use" >/dev/null 2>&1) \
    || die "apt-get download golang-$GO_MINOR-go=$go_use golang-$GO_MINOR-src=$go_use failed"
  go_deb=$(ls "$apt"/go-debs/golang-"$GO_MINOR"-go_*.deb) || die "no golang-$GO_MINOR-go .deb downloaded"
  src_deb=$(ls "$apt"/go-debs/golang-"$GO_MINOR"-src_*.deb) || die "no golang-$GO_MINOR-src .deb downloaded"
  if [ -n "$go_sha" ]; then
    echo "$go_sha  $go_deb" | sha256sum -c --quiet - || die "sha256 mismatch for $go_deb"
    echo "$src_sha  $src_deb" | sha256sum -c --quiet - || die "sha256 mismatch for $src_deb"
  fi
  rm -rf "$GO_DIR" && mkdir -p "$GO_DIR"
  dpkg -x "$go_deb" "$GO_DIR" || die "dpkg -x $go_deb failed"
  dpkg -x "$src_deb" "$GO_DIR" || die "dpkg -x $src_deb failed"
  echo "$GO_DIR/usr/lib/go-$GO_MINOR" >"$GO_DIR/GOROOT"
  echo "$go_use" >"$GO_DIR/VERSION"
  unset go_avail go_use go_sha src_sha go_deb src_deb
fi
go_ok || die "the Go toolchain in $(cat "$GO_DIR/GOROOT" 2>/dev/null || echo "$GO_DIR") does not run or is not go$GO_MINOR"
say "go $(GOTOOLCHAIN=local "$(cat "$GO_DIR/GOROOT")/bin/go" version | awk '{print $3}') (Debian $GO_SUITE $(cat "$GO_DIR/VERSION"), $(cat "$GO_DIR/GOROOT"))"
# The conformance driver, built into the cargo target directory (target/go, cached
# per source change): a cold build compiles the standard library without cgo, which
# would otherwise land inside the first conformance scenario's reply time.
"$ROOT/client/go/conformance-driver.sh" --build || die "building the Go conformance driver (client/go/conformance-driver.sh --build) failed"
