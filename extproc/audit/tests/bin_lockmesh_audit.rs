//! `cargo test` builds `lockmesh-audit` with the test build's features for the scenarios
//! that start it (a binary is built by `cargo test` only for its own package's
//! integration tests), and this checks that it starts and answers `--help`.

#[test]
fn lockmesh_audit_starts_and_prints_its_usage() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockmesh-audit")).arg("--help").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"), "no usage printed");
}
