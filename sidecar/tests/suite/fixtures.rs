//! Fixture and golden-file helpers. `LOCKMESH_BLESS=1` rewrites a golden file from
//! the current output instead of comparing (review the diff before committing).

use std::path::PathBuf;

use serde_json::Value;

pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

pub fn admission(name: &str) -> Vec<u8> {
    std::fs::read(dir().join("admission").join(name)).unwrap()
}

pub fn json(rel: &str) -> Value {
    serde_json::from_slice(&std::fs::read(dir().join(rel)).unwrap()).unwrap()
}

fn bless() -> bool {
    std::env::var_os("LOCKMESH_BLESS").is_some_and(|v| v == "1")
}

/// Compares `got` with the golden JSON file `rel`, printing both on a mismatch.
pub fn golden_json(rel: &str, got: &Value) {
    let path = dir().join(rel);
    if bless() {
        std::fs::write(&path, serde_json::to_string_pretty(got).unwrap() + "\n").unwrap();
        return;
    }
    let want: Value = serde_json::from_slice(
        &std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run with LOCKMESH_BLESS=1 to create it)", path.display())),
    )
    .unwrap();
    assert!(
        *got == want,
        "{} differs from the output:\n--- golden\n{}\n--- got\n{}",
        path.display(),
        serde_json::to_string_pretty(&want).unwrap(),
        serde_json::to_string_pretty(got).unwrap()
    );
}

/// Compares YAML text with the golden file `rel` (as parsed documents, then as text).
pub fn golden_yaml(rel: &str, got: &str) {
    let path = dir().join(rel);
    if bless() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap();
    assert_eq!(got, want, "{} differs from the output", path.display());
}
