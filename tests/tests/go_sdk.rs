//! The Go SDK (client/go) inside the test command: `go vet` and `go test` of the
//! module, and the build of its conformance driver, with the toolchain
//! scripts/setup installs (scripts/setup.d/go.sh: Debian's golang-1.27 in
//! `.tools/go`). A missing toolchain fails loudly with the setup step; nothing is
//! skipped. No Go module proxy is reachable, and none is needed: the SDK uses only
//! the standard library (GOPROXY=off, GOTOOLCHAIN=local). Build and test caches live
//! under the cargo target directory (`target/go`), so a second run is fast.

use std::{
    path::PathBuf,
    process::{Command, Output},
    time::Instant,
};

use lockmesh_tests::paths::{repo_root, target_dir};

/// The `go` binary: `$LOCKMESH_GOROOT/bin/go`, else the GOROOT named by
/// `.tools/go/GOROOT`.
fn go() -> (PathBuf, PathBuf) {
    let root = std::env::var_os("LOCKMESH_GOROOT").filter(|r| !r.is_empty()).map(PathBuf::from).unwrap_or_else(|| {
        let file = repo_root().join(".tools/go/GOROOT");
        let named = std::fs::read_to_string(&file).unwrap_or_else(|e| {
            panic!(
                "the Go toolchain is not installed ({}: {e}): run scripts/setup (scripts/setup.d/go.sh)",
                file.display()
            )
        });
        PathBuf::from(named.trim())
    });
    let bin = root.join("bin/go");
    assert!(bin.is_file(), "the Go toolchain is not installed ({} missing): run scripts/setup", bin.display());
    (root, bin)
}

fn run(args: &[&str]) -> Output {
    let (root, bin) = go();
    let cache = target_dir().join("go");
    let started = Instant::now();
    let out = Command::new(&bin)
        .args(args)
        .current_dir(repo_root().join("client/go"))
        .env("GOROOT", &root)
        .env("GOTOOLCHAIN", "local")
        .env("GOPROXY", "off")
        .env("GOSUMDB", "off")
        .env("GOTELEMETRY", "off")
        .env("GOFLAGS", "-mod=readonly")
        .env("CGO_ENABLED", "0")
        .env("GOCACHE", cache.join("cache"))
        .env("GOPATH", cache.join("path"))
        .env("GOENV", "off")
        .env_remove("LOCKMESH_SDK_PLANTED")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    eprintln!("go {} took {:.1?}", args.join(" "), started.elapsed());
    assert!(
        out.status.success(),
        "go {} failed ({}):\n{}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn the_go_module_declares_the_installed_toolchain_and_no_dependency() {
    let (_, bin) = go();
    let version = Command::new(&bin).arg("version").env("GOTOOLCHAIN", "local").output().unwrap();
    let version = String::from_utf8_lossy(&version.stdout).to_string();
    let gomod = std::fs::read_to_string(repo_root().join("client/go/go.mod")).unwrap();
    let directive = gomod.lines().find_map(|l| l.strip_prefix("go ")).expect("a go directive").trim().to_owned();
    assert!(version.contains(&format!("go{directive}.")), "go.mod says go {directive}, the toolchain is {version}");
    assert!(!gomod.contains("require"), "the SDK uses only the standard library (no module proxy here)");
}

#[test]
fn go_vet_and_go_test_pass_and_the_sources_are_gofmt_clean() {
    let (root, _) = go();
    let fmt = Command::new(root.join("bin/gofmt"))
        .args(["-l", "."])
        .current_dir(repo_root().join("client/go"))
        .output()
        .unwrap();
    assert!(fmt.status.success() && fmt.stdout.is_empty(), "gofmt -l lists: {}", String::from_utf8_lossy(&fmt.stdout));
    run(&["vet", "./..."]);
    let out = run(&["test", "-count=1", "./..."]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(stdout.contains("ok  \tgithub.com/lockmesh/lockmesh/client/go\t"), "the SDK's tests ran: {stdout}");
}
