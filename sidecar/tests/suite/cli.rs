//! The `lockmesh-inject` binary on multi-document YAML: the golden output,
//! idempotence, untouched documents, and refusals with exit code 65.

use std::{
    io::Write,
    process::{Command, Output, Stdio},
};

use serde_json::Value;

use crate::fixtures;

fn run(input: &str, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockmesh-inject"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn docs(yaml: &str) -> Vec<Value> {
    // Null documents are skipped by the parser.
    serde_saphyr::from_multiple::<Value>(yaml).unwrap()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn multi_document_manifest_is_injected_like_kube_inject() {
    let input = std::fs::read_to_string(fixtures::dir().join("manifests/store.yaml")).unwrap();
    let out = run(&input, &["-f", "-"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let yaml = String::from_utf8(out.stdout).unwrap();
    fixtures::golden_yaml("manifests/store.injected.yaml", &yaml);
    assert!(stderr.contains("injected 2 object(s)"), "{stderr}");
    assert!(stderr.contains("warning: document 3 (StatefulSet payments/orders-store): container \"orders\" readinessProbe (GET /health on port 8080)"), "{stderr}");

    let before = docs(&input);
    let after = docs(&yaml);
    assert_eq!(after.len(), before.len() + 2, "two NetworkPolicies appended (ports 15081 and 9090)");
    // Untouched documents come out equal.
    for (kind, name) in [("Deployment", "web"), ("ConfigMap", "orders-fence"), ("Service", "orders-store")] {
        assert_eq!(find(&after, kind, name), find(&before, kind, name), "{kind} {name} changed");
    }
    // The StatefulSet gets a marks claim per replica, sized by annotation.
    let sts = find(&after, "StatefulSet", "orders-store");
    let templates = sts["spec"]["volumeClaimTemplates"].as_array().unwrap();
    let marks = templates.iter().find(|t| t["metadata"]["name"] == "lockmesh-fence-marks").unwrap();
    assert_eq!(marks["spec"]["resources"]["requests"]["storage"], "2Gi");
    assert!(sts["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .all(|v| v["name"] != "lockmesh-fence-marks"));
    // The Deployment mounts the named claim; its store was already on 9090.
    let dep = find(&after, "Deployment", "ledger-store");
    let vols = dep["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
    assert!(vols.iter().any(|v| v["persistentVolumeClaim"]["claimName"] == "ledger-fence-marks"));
    let np = find(&after, "NetworkPolicy", "lockmesh-fence-backend-9090");
    assert_eq!(np["metadata"]["namespace"], "payments");
}

#[test]
fn injecting_the_output_again_changes_nothing() {
    let input = std::fs::read_to_string(fixtures::dir().join("manifests/store.yaml")).unwrap();
    let once = run(&input, &[]);
    assert!(once.status.success());
    let once = String::from_utf8(once.stdout).unwrap();
    let twice = run(&once, &[]);
    let stderr = String::from_utf8_lossy(&twice.stderr);
    assert!(twice.status.success(), "{stderr}");
    assert!(stderr.contains("injected 0 object(s)"), "{stderr}");
    assert_eq!(String::from_utf8(twice.stdout).unwrap(), once);
}

#[test]
fn refused_objects_fail_with_every_reason() {
    let input = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: cache, namespace: shop}\nspec:\n  replicas: 3\n  selector: {matchLabels: {app: cache}}\n  template:\n    metadata:\n      labels: {app: cache}\n      annotations: {lockmesh.io/fence: enabled, lockmesh.io/fence-config: cache-fence, lockmesh.io/fence-backend-port: '9090', lockmesh.io/fence-marks-claim: cache-marks}\n    spec:\n      containers: [{name: cache, image: c, ports: [{containerPort: 8080}]}]\n---\nkind: DaemonSet\napiVersion: apps/v1\nmetadata: {name: d}\nspec:\n  template:\n    metadata: {annotations: {lockmesh.io/fence: enabled}}\n";
    let out = run(input, &[]);
    assert_eq!(out.status.code(), Some(65));
    assert!(out.stdout.is_empty(), "nothing is written when a document is refused");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("document 1 (Deployment shop/cache): [workload_shape] spec.replicas: a fenced Deployment must have at most 1 replica, got 3"), "{stderr}");
    assert!(
        stderr.contains(
            "[workload_shape] spec.strategy.type: must be Recreate for a fenced Deployment, got RollingUpdate"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("document 2 (DaemonSet d): [workload_shape]"), "{stderr}");
}

#[test]
fn check_config_uses_the_startup_parser() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "admin_port: 0\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockmesh-inject")).arg("--check-config").arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin_port: must be a port in 1..=65535, got 0"));
    let good = repo_root_file("deploy/base/webhook/injector.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_lockmesh-inject")).arg("--check-config").arg(&good).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn repo_root_file(rel: &str) -> std::path::PathBuf {
    fixtures::repo_root().join(rel)
}

/// The example ConfigMap's fence-proxy.yaml (routes and keys only) is accepted by
/// fence-proxy's own loader with the env the injector gives the fence container,
/// which supplies the addresses; without that env it is refused.
#[test]
fn example_fence_config_is_accepted_by_fence_proxy_with_the_injected_env() {
    let input = std::fs::read_to_string(fixtures::dir().join("manifests/store.yaml")).unwrap();
    let all = docs(&input);
    let cm = find(&all, "ConfigMap", "orders-fence");
    let dir = tempfile::tempdir().unwrap();
    let mount = format!("{}/", dir.path().display());
    for (key, value) in cm["data"].as_object().unwrap() {
        let text = value.as_str().unwrap().replace("/etc/lockmesh/fence/", &mount);
        std::fs::write(dir.path().join(key), text).unwrap();
    }
    let file = dir.path().join("fence-proxy.yaml");
    let out = run(&input, &[]);
    let after = docs(&String::from_utf8(out.stdout).unwrap());
    let sts = find(&after, "StatefulSet", "orders-store");
    let fence = sts["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == lockmesh_sidecar::inject::CONTAINER)
        .unwrap();
    let env: std::collections::HashMap<String, String> = fence["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_owned(), e["value"].as_str().unwrap_or_default().to_owned()))
        .collect();
    let config = lockmesh_fence_proxy::Config::load_with(&file, &env)
        .unwrap_or_else(|errs| panic!("fence-proxy refuses the example config with the injected env: {errs:#?}"));
    use lockmesh_sidecar::inject::{ENV_ADMIN_LISTEN, ENV_LISTEN, ENV_MARKS_DIR, ENV_UPSTREAM};
    assert_eq!(config.listen.to_string(), env[ENV_LISTEN]);
    assert_eq!(config.admin_listen.to_string(), env[ENV_ADMIN_LISTEN]);
    assert_eq!(config.upstream, env[ENV_UPSTREAM]);
    assert_eq!(config.marks_dir.display().to_string(), env[ENV_MARKS_DIR]);
    // The names the injector sets are the ones fence-proxy reads.
    let read: Vec<&str> = lockmesh_fence_proxy::config::env::OVERRIDES.iter().map(|(v, _)| *v).collect();
    assert_eq!(read, [ENV_LISTEN, ENV_ADMIN_LISTEN, ENV_UPSTREAM, ENV_MARKS_DIR]);
    // Without the env the file lacks the addresses.
    let errs = lockmesh_fence_proxy::Config::load_with(&file, &lockmesh_fence_proxy::config::env::NoEnv).unwrap_err();
    assert_eq!(errs.len(), 4, "{errs:#?}");
}
