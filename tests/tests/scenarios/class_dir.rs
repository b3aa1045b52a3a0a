//! Classes the cluster delivers (ADR-24, issue #16): a real arbiter, etcd and
//! Envoy with the registry read from a directory of LockClass/LockGrant manifests
//! (`registry_dir`) laid down as the kubelet lays down a ConfigMap volume (content
//! in `..<version>/`, the `..data` link swapped by one rename). A LockGrant file
//! removed by a swap refuses its identity at the next reload; a LockClass added by
//! a new file governs its prefix once `lockctl class apply DIR` makes the map
//! authoritative (until then its keys are refused, never guessed); a bad swap is
//! refused naming file, document and field, and the last good registry keeps
//! serving (planted bad config: the swap carries a snake_case spec field the CRD
//! does not have, which a loader skipping the CRD's structure would accept).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use lockmesh_tests::kubelet::{Files, SecretDir};
use lockmesh_tests::Stack;
use serde_json::Value;

const ACQ: &str = "/v1/locks/acquire";

/// The stack's first registry file: the same classes as [`default_class`], so
/// the authoritative map the first start writes is the directory's.
const FILE_REGISTRY: &str = r#"classes:
  - { name: default, default: true, ttl_s: 30, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

const ADVISORY: &str = "  enforcement: advisory\n  riskOwner: t\n  waiverExpiry: \"2099-12-31\"\n";

fn class(name: &str, spec: &str) -> String {
    format!("apiVersion: lockmesh.dev/v1alpha1\nkind: LockClass\nmetadata:\n  name: {name}\nspec:\n{spec}{ADVISORY}")
}

fn default_class() -> String {
    class("default", "  default: true\n  ttlSeconds: 30\n")
}

fn reports_class() -> String {
    class("reports", "  prefixes: [payments/reports]\n  ttlSeconds: 45\n")
}

fn grant(sa: &str) -> String {
    format!(
        "apiVersion: lockmesh.dev/v1alpha1\nkind: LockGrant\nmetadata:\n  name: payments-{sa}\nspec:\n  identity: \
         spiffe://lockmesh.test/ns/payments/sa/{sa}\n  prefixes: [payments]\n  operations: [acquire, inspect]\n"
    )
}

/// Publishes `files` into `dir` as the kubelet updates a ConfigMap volume
/// (`version` names the step for the reader; the generation is named by time).
fn publish(dir: &Path, version: &str, files: &[(&str, String)]) {
    let files: Files = files.iter().map(|(n, t)| ((*n).to_owned(), t.clone().into_bytes())).collect();
    SecretDir::open(dir).replace(&files).unwrap_or_else(|e| panic!("publish {version}: {e:#}"));
}

/// Polls `/status` until `done` holds for `classes.registry`, at most 10 s.
async fn registry_status(st: &Stack, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = st.arbiter(0).admin_get("/status").await.unwrap();
        let s: Value = serde_json::from_str(&body).unwrap();
        let r = s["classes"]["registry"].clone();
        if done(&r) {
            return r;
        }
        assert!(tokio::time::Instant::now() < deadline, "registry status never changed: {r}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `lockctl class apply DIR` against the stack's etcd root.
fn apply(st: &Stack, dir: &Path) -> (i32, String) {
    let eps = st.etcd().endpoints().join(",");
    let out = std::process::Command::new(lockmesh_tests::paths::profile_dir().join("lockctl"))
        .args(["class", "apply"])
        .arg(dir)
        .args(["--endpoints", &eps, "--root", st.root(), "--actor", "test", "--reason", "reports class"])
        .envs(st.etcd_env("lockmesh-classes"))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// Points the arbiter's config at `dir` (`registry_dir` in place of
/// `registry_file`) and restarts it.
async fn restart_on(st: &Stack, dir: &Path) {
    let config = st.arbiter(0).config_path().to_owned();
    let yaml = std::fs::read_to_string(&config).unwrap();
    let yaml: String = yaml
        .lines()
        .map(|l| {
            if l.starts_with("registry_file:") {
                format!("registry_dir: {:?}", dir.display().to_string())
            } else {
                l.into()
            }
        })
        .map(|l| l + "\n")
        .collect();
    assert!(yaml.contains("registry_dir:"), "{yaml}");
    std::fs::write(&config, yaml).unwrap();
    st.arbiter(0).restart().await.unwrap();
}

#[tokio::test]
async fn the_arbiter_serves_the_manifests_of_a_directory_and_follows_its_swaps() {
    let st = Stack::builder("class-dir").envoy_config("lock-tier").registry(FILE_REGISTRY).start().await.unwrap();
    let dir: PathBuf = st.arbiter(0).config_path().with_file_name("classes");
    std::fs::create_dir_all(&dir).unwrap();
    publish(
        &dir,
        "v1",
        &[("default.yaml", default_class()), ("grant-a.yaml", grant("a")), ("grant-b.yaml", grant("b"))],
    );
    restart_on(&st, &dir).await;
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    for (c, key) in [(&a, "payments/a-1"), (&b, "payments/b-1")] {
        let r = c.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
        assert_eq!((r.code(), r.json["class"].as_str(), r.json["ttl_s"].as_u64()), (200, Some("default"), Some(30)));
    }

    // Swap 2: grant-b.yaml is gone, reports.yaml is new.
    publish(
        &dir,
        "v2",
        &[("default.yaml", default_class()), ("grant-a.yaml", grant("a")), ("reports.yaml", reports_class())],
    );
    let r = registry_status(&st, |r| r["reloads"].as_u64() == Some(1)).await;
    assert_eq!(r["valid"], true, "{r}");
    // The removed LockGrant refuses b at the arbiter (the filter passed it on).
    let r = b.post(ACQ, &[("x-lock-key", "payments/b-2")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (403, Some("denied")), "{}", r.body);
    // The new class's keys would move from default to reports: refused until the
    // map is applied, never granted under a guessed class.
    let r = a.post(ACQ, &[("x-lock-key", "payments/reports/1")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("unavailable")), "{}", r.body);
    let (code, out) = apply(&st, &dir);
    assert_eq!(code, 0, "lockctl class apply DIR: {out}");
    let r = a.post(ACQ, &[("x-lock-key", "payments/reports/1")]).await.unwrap();
    assert_eq!((r.code(), r.json["class"].as_str(), r.json["ttl_s"].as_u64()), (200, Some("reports"), Some(45)));

    // Swap 3, planted bad config: reports.yaml in the registry file's spelling
    // (`ttl_s`, not a CRD field). Refused at that file, document and field; the
    // last good registry keeps serving.
    let bad = reports_class().replace("ttlSeconds: 45", "ttl_s: 60");
    publish(&dir, "v3", &[("default.yaml", default_class()), ("grant-a.yaml", grant("a")), ("reports.yaml", bad)]);
    let r = registry_status(&st, |r| r["refused"].as_u64() == Some(1)).await;
    assert_eq!(r["valid"], false, "{r}");
    let errs: Vec<&str> = r["errors"].as_array().unwrap().iter().map(|e| e.as_str().unwrap()).collect();
    let want =
        format!("{}: document 0 (LockClass reports): spec.ttl_s: unknown field", dir.join("reports.yaml").display());
    assert!(errs.len() == 1 && errs[0].starts_with(&want), "{errs:?}");
    let r = a.post(ACQ, &[("x-lock-key", "payments/reports/2")]).await.unwrap();
    assert_eq!((r.code(), r.json["class"].as_str(), r.json["ttl_s"].as_u64()), (200, Some("reports"), Some(45)));
    let r = b.post(ACQ, &[("x-lock-key", "payments/b-3")]).await.unwrap();
    assert_eq!(r.code(), 403, "the refused swap does not bring grant-b back: {}", r.body);
    let (_, m) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    assert!(m.lines().any(|l| l == "lockmesh_arbiter_registry_reload_errors 1"), "{m}");
}
