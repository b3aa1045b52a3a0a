module github.com/lockmesh/lockmesh/client/go

// The toolchain scripts/setup.d/go.sh installs (Debian's golang-1.27). The SDK
// uses only the standard library: no dependencies.
go 1.27
