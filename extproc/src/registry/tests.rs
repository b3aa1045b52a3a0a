use std::path::PathBuf;

use lockmesh_core::pause::{PauseEvidence, PauseTestResult, Verdict, SCHEMA_VERSION};

use super::*;

/// A scratch directory, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("lockmesh-registry-{tag}-{}-{}", std::process::id(), now_ms()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A result produced now (never a dated fixture): `age_s` ago, valid `valid_s`.
fn result(class: &str, verdict: Verdict, age_s: u64, valid_s: u64) -> String {
    let now = now_ms() / 1000;
    let doc = PauseTestResult {
        schema_version: SCHEMA_VERSION.into(),
        class: class.into(),
        resource: "fence-proxy http://127.0.0.1:1/items/{id}".into(),
        time_unix_s: now - age_s,
        expires_unix_s: now - age_s + valid_s,
        verdict,
        evidence: PauseEvidence {
            ttl_s: 3,
            paused_ms: 5000,
            first_write_status: 200,
            second_write_status: 200,
            late_write_status: if verdict == Verdict::Pass { 409 } else { 200 },
            second_token_greater: true,
            resource_saw_late_write: verdict == Verdict::Fail,
            steps: vec!["paused past the ttl".into()],
        },
    };
    serde_saphyr::to_string(&doc).unwrap()
}

fn registry(file: &str) -> String {
    format!(
        "classes:\n  - {{ name: d, default: true, enforcement: advisory, risk_owner: t, waiver_expiry: \"2099-12-31\", \
         ttl_s: 30 }}\n  - {{ name: orders, prefixes: [orders], enforcement: fenced, pause_test_result: {file} }}\n"
    )
}

#[test]
fn a_fenced_class_needs_a_passing_unexpired_pause_test_of_its_own() {
    let dir = Dir::new("pause");
    std::fs::create_dir_all(dir.0.join("results")).unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.0.join("results").join(name), text).unwrap();
    write("pass.yaml", &result("orders", Verdict::Pass, 60, 3600));
    write("fail.yaml", &result("orders", Verdict::Fail, 60, 3600));
    write("expired.yaml", &result("orders", Verdict::Pass, 7200, 3600));
    write("other.yaml", &result("payments", Verdict::Pass, 60, 3600));
    write("junk.yaml", "verdict: pass\n");
    let file = dir.0.join("registry.yaml");
    let load_with = |result: &str| {
        std::fs::write(&file, registry(result)).unwrap();
        load(&file)
    };
    // Relative to the registry file's directory.
    let r = load_with("results/pass.yaml").unwrap();
    assert_eq!(r.get("orders").unwrap().enforcement, Enforcement::Fenced);
    let name = file.display();
    let refused = |result: &str, why: &str| {
        let errs = load_with(result).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        let want = format!("{name}: classes[1].pause_test_result: \"{result}\": ");
        assert!(errs[0].starts_with(&want) && errs[0].contains(why), "{} (want {want}..{why})", errs[0]);
    };
    refused("results/fail.yaml", "verdict is fail");
    refused("results/expired.yaml", "expired");
    refused("results/other.yaml", "class \"payments\", not \"orders\"");
    refused("results/junk.yaml", "not a PauseTestResult");
    refused("results/missing.yaml", "cannot read");
    // Absent altogether.
    std::fs::write(&file, registry("x").replace(", pause_test_result: x", "")).unwrap();
    let errs = load(&file).unwrap_err();
    assert_eq!(errs, vec![format!("{name}: classes[1].pause_test_result: required for a fenced class (ADR-17): the PauseTestResult file of a passing pause test (lockmesh-pausekit --out), relative to the registry file")]);
}

/// A fenced class's relative `pause_test_result` resolves against the registry
/// file's directory, or against the manifest directory itself: the loader and the
/// console (`console::state`) both take the base from here.
#[test]
fn pause_results_resolve_against_the_file_directory_or_the_manifest_directory() {
    let file = RegistrySource::File(PathBuf::from("/etc/lockmesh/registry.yaml"));
    assert_eq!(file.pause_base(), PathBuf::from("/etc/lockmesh"));
    let dir = RegistrySource::Dir {
        dir: PathBuf::from("/etc/lockmesh/classes"),
        platform: Default::default(),
        quotas: Default::default(),
    };
    assert_eq!(dir.pause_base(), PathBuf::from("/etc/lockmesh/classes"), "not the directory's parent");
}
