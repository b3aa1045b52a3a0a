//! Offline validation of every shipped manifest in deploy/ and of the injector's
//! output: built-in kinds against Kubernetes' schemas (kubernetes-validate,
//! strict), Istio kinds against deploy/schemas/*.json, failing on any warning.
//! The validator runs from the venv scripts/setup installs; if it is missing the
//! test fails with the command that installs it, it never skips. Also: the
//! kustomize layout references only files that exist and leaves none out, the
//! shipped NetworkPolicy is the one the code generates, and the Istio example's
//! plugin configuration is accepted by the Wasm filter's own parser.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize;
use serde_json::Value;

use crate::fixtures::{self, repo_root};

/// YAML files in deploy/ that are not Kubernetes objects (`rules.yaml` is a plain
/// Prometheus rules file, checked by promtool in the observability scenario;
/// `envoy.yaml` is the lock tier's Envoy config, rendered by
/// scripts/gen-envoy-configs and checked by `envoy --mode validate` in the
/// configs scenario).
// rules_test.yaml: promtool's unit tests of rules.yaml, not a Kubernetes object.
const NOT_OBJECTS: [&str; 5] = ["kustomization.yaml", "injector.yaml", "rules.yaml", "rules_test.yaml", "envoy.yaml"];

fn python() -> PathBuf {
    let p = repo_root().join(".tools/k8s-validate/bin/python");
    assert!(
        p.is_file(),
        "{} is missing: run ./scripts/setup (it installs kubernetes-validate and jsonschema into .tools/k8s-validate)",
        p.display()
    );
    p
}

/// Runs deploy/schemas/validate.py; returns (success, combined output).
fn validate(files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(python()).arg(repo_root().join("deploy/schemas/validate.py")).args(files).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
    out.sort();
}

/// The files kustomizations turn into ConfigMap data (configMapGenerator `files`).
fn generator_files() -> Vec<PathBuf> {
    let mut all = Vec::new();
    yaml_files(&repo_root().join("deploy"), &mut all);
    let mut out = Vec::new();
    for k in all.iter().filter(|p| p.file_name().unwrap() == "kustomization.yaml") {
        let parsed: Kustomization = serde_saphyr::from_str(&std::fs::read_to_string(k).unwrap()).unwrap();
        for f in parsed.generators.iter().flat_map(|g| &g.files) {
            if let Ok(p) = k.parent().unwrap().join(f).canonicalize() {
                out.push(p);
            }
        }
    }
    out
}

/// Whether a YAML file declares a Kubernetes object (a top-level `apiVersion` and `kind`).
fn declares_object(p: &Path) -> bool {
    let text = std::fs::read_to_string(p).unwrap();
    text.lines().any(|l| l.starts_with("apiVersion:")) && text.lines().any(|l| l.starts_with("kind:"))
}

/// Every shipped Kubernetes object. ConfigMap data that is not an object (the Envoy
/// SDS files, an arbiter config overlay) is left out; data that is (LockClass and
/// LockGrant manifests the arbiter reads from a volume) is validated, against the
/// CRDs in deploy/crds/.
fn shipped_objects() -> Vec<PathBuf> {
    let mut all = Vec::new();
    yaml_files(&repo_root().join("deploy"), &mut all);
    all.retain(|p| !NOT_OBJECTS.contains(&p.file_name().unwrap().to_str().unwrap()));
    let data = generator_files();
    all.retain(|p| !data.contains(&p.canonicalize().unwrap()) || declares_object(p));
    assert!(all.len() >= 10, "expected the shipped manifests, found {all:?}");
    all
}

#[test]
fn shipped_manifests_validate_against_kubernetes_and_istio_schemas() {
    let files = shipped_objects();
    let (ok, out) = validate(&files);
    assert!(ok, "{out}");
    assert!(!out.contains("WARN") && !out.contains("ERROR"), "{out}");
    // The lock tier and the audit tailer are in the base (issue 9).
    for obj in ["Deployment/lockmesh-lock-tier", "StatefulSet/lockmesh-audit", "PodDisruptionBudget/lockmesh-audit"] {
        assert!(out.contains(&format!(" {obj}")), "{obj} was not validated:\n{out}");
    }
    for kind in [
        "MutatingWebhookConfiguration",
        "Deployment",
        "StatefulSet",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "WasmPlugin",
        "EnvoyFilter",
        "DestinationRule",
    ] {
        assert!(out.contains(&format!(" {kind}/")), "{kind} was not validated:\n{out}");
    }
}

#[test]
fn injector_output_validates() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = vec![fixtures::dir().join("manifests/store.injected.yaml")];
    for golden in ["pod-opted-in", "pod-statefulset-replica"] {
        let pod = fixtures::json(&format!("golden/{golden}.json"));
        let path = dir.path().join(format!("{golden}.yaml"));
        std::fs::write(&path, serde_saphyr::to_string(&pod).unwrap()).unwrap();
        files.push(path);
    }
    let (ok, out) = validate(&files);
    assert!(ok, "{out}");
    assert_eq!(out.matches("OK ").count(), 10, "{out}");
}

#[test]
fn the_validator_fails_on_bad_builtin_and_custom_objects_and_unknown_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("pod.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers: [{name: a, image: b, imagePullPolicy: Sometimes, bogus: 1}]\n", "'bogus' was unexpected"),
        ("ef.yaml", "apiVersion: networking.istio.io/v1alpha3\nkind: EnvoyFilter\nmetadata: {name: e}\nspec:\n  configPatches: [{applyTo: HTTP_FILTR}]\n", "'HTTP_FILTR' is not one of"),
        ("wp.yaml", "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nmetadata: {name: w}\nspec: {failStrategy: FAIL_CLOSE}\n", "'url' is a required property"),
        ("dr.yaml", "apiVersion: networking.istio.io/v1beta1\nkind: DestinationRule\nmetadata: {name: d}\nspec: {host: h, subsets: [{name: calls, trafficPolicy: {loadBalancer: {simple: ROUND_ROBN}}}]}\n", "'ROUND_ROBN' is not one of"),
        ("lc.yaml", "apiVersion: lockmesh.dev/v1alpha1\nkind: LockClass\nmetadata: {name: l}\nspec: {enforcement: advisory, bogus: 1}\n", "'bogus' was unexpected"),
        ("crd.yaml", "apiVersion: cert-manager.io/v1\nkind: Certificate\nmetadata: {name: c}\nspec: {}\n", "no schema for cert-manager.io/v1 Certificate"),
    ];
    for (name, text, want) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let (ok, out) = validate(&[path]);
        assert!(!ok, "{name} passed:\n{out}");
        assert!(out.contains(want), "{name}: expected {want:?} in:\n{out}");
    }
}

#[derive(Deserialize)]
struct Kustomization {
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default, rename = "configMapGenerator")]
    generators: Vec<Generator>,
}

#[derive(Deserialize)]
struct Generator {
    #[serde(default)]
    files: Vec<String>,
}

/// Every kustomization references existing files or folders with a
/// kustomization, and every shipped object is referenced by one.
#[test]
fn kustomize_layout_is_closed() {
    let mut all = Vec::new();
    yaml_files(&repo_root().join("deploy"), &mut all);
    let mut referenced = Vec::new();
    for k in all.iter().filter(|p| p.file_name().unwrap() == "kustomization.yaml") {
        let dir = k.parent().unwrap();
        let parsed: Kustomization = serde_saphyr::from_str(&std::fs::read_to_string(k).unwrap()).unwrap();
        for r in &parsed.resources {
            let target = dir.join(r);
            assert!(
                target.is_file() || target.join("kustomization.yaml").is_file(),
                "{}: resource {r} does not exist",
                k.display()
            );
            if target.is_file() {
                referenced.push(target.canonicalize().unwrap());
            }
        }
        for f in parsed.generators.iter().flat_map(|g| &g.files) {
            assert!(dir.join(f).is_file(), "{}: generator file {f} does not exist", k.display());
            referenced.push(dir.join(f).canonicalize().unwrap());
        }
    }
    for obj in shipped_objects() {
        assert!(referenced.contains(&obj.canonicalize().unwrap()), "{} is in no kustomization", obj.display());
    }
}

#[test]
fn shipped_network_policy_is_the_generated_one() {
    let path = repo_root().join("deploy/fence/networkpolicy-backend-15081.yaml");
    let shipped: Value = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(shipped, lockmesh_sidecar::policy::network_policy(None, lockmesh_sidecar::config::DEFAULT_BACKEND_PORT));
    let path = repo_root().join("deploy/fence/networkpolicy-store-namespace-15081.yaml");
    let shipped: Value = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(
        shipped,
        lockmesh_sidecar::policy::store_namespace_policy(None, lockmesh_sidecar::config::DEFAULT_BACKEND_PORT)
    );
    // The example store namespace applies both.
    let k = std::fs::read_to_string(repo_root().join("deploy/overlays/example/payments/kustomization.yaml")).unwrap();
    assert!(k.contains("../../../fence"), "{k}");
}

/// Issue 41: the shipped webhook configuration sends store namespaces (label
/// `lockmesh.io/fence-injection=store`, the admins') to `/mutate/store` and opt-in
/// namespaces to `/mutate`, both failing closed, neither skippable by a pod's
/// labels; the shipped injector configs (base and example) select stores and pin
/// the fence ConfigMap; the example's store namespace carries the store label.
#[test]
fn shipped_webhook_configuration_selects_by_namespace_label() {
    let text =
        std::fs::read_to_string(repo_root().join("deploy/base/webhook/mutatingwebhookconfiguration.yaml")).unwrap();
    let mwc: Value = serde_saphyr::from_str(&text).unwrap();
    let hooks = mwc["webhooks"].as_array().unwrap();
    let mut paths = Vec::new();
    for h in hooks {
        assert_eq!(h["failurePolicy"], "Fail", "{h}");
        assert!(h.get("objectSelector").is_none(), "a pod's own labels must not decide: {h}");
        assert_eq!(h["rules"][0]["operations"], serde_json::json!(["CREATE"]));
        assert_eq!(h["rules"][0]["resources"], serde_json::json!(["pods"]));
        assert_eq!(h["rules"][1]["operations"], serde_json::json!(["UPDATE"]));
        assert_eq!(h["rules"][1]["resources"], serde_json::json!(["pods", "pods/ephemeralcontainers"]));
        let exprs = h["namespaceSelector"]["matchExpressions"].as_array().unwrap();
        let value = exprs.iter().find(|e| e["key"] == "lockmesh.io/fence-injection").unwrap()["values"].clone();
        assert!(
            exprs.iter().any(|e| e["key"] == "kubernetes.io/metadata.name"
                && e["operator"] == "NotIn"
                && e["values"] == serde_json::json!(["kube-system", "lockmesh-system"])),
            "{h}"
        );
        paths.push((h["clientConfig"]["service"]["path"].as_str().unwrap().to_owned(), value));
    }
    paths.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        paths,
        [
            ("/mutate".to_owned(), serde_json::json!(["enabled"])),
            ("/mutate/store".to_owned(), serde_json::json!(["store"]))
        ]
    );
    for file in ["deploy/base/webhook/injector.yaml", "deploy/overlays/example/injector.yaml"] {
        let c = lockmesh_sidecar::Config::load(&repo_root().join(file)).unwrap();
        assert!(!c.store_selector.is_empty(), "{file}");
        assert_eq!(c.fence_config_map.as_deref(), Some("lockmesh-fence"), "{file}");
    }
    let ns: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo_root().join("deploy/overlays/example/payments/namespace.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(ns["metadata"]["labels"]["lockmesh.io/fence-injection"], "store");
}

#[test]
fn istio_example_plugin_config_is_accepted_by_the_filter_and_fails_closed() {
    let root = repo_root().join("deploy/istio");
    let plugin: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("wasmplugin.yaml")).unwrap()).unwrap();
    assert_eq!(plugin["spec"]["failStrategy"], "FAIL_CLOSE");
    let config = serde_json::to_vec(&plugin["spec"]["pluginConfig"]).unwrap();
    if let Err(errs) = lockmesh_wasm_filter::config::parse(&config) {
        panic!("the filter refuses the WasmPlugin's pluginConfig: {errs:?}");
    }
    // ext_proc in the EnvoyFilter never fails open.
    let filter: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("envoyfilter.yaml")).unwrap()).unwrap();
    let proc =
        &filter["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["extension_config"]["typed_config"];
    assert_eq!(proc["failure_mode_allow"], false);
    // ext_proc calls the ring-hashed subset of the arbiter Service, the filter's own
    // calls a round-robin subset of the same Service (docs/TRANSPARENT.md).
    let rule: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(root.join("destinationrule.yaml")).unwrap()).unwrap();
    let ext_proc_cluster = proc["grpc_service"]["envoy_grpc"]["cluster_name"].as_str().unwrap();
    let calls_cluster = plugin["spec"]["pluginConfig"]["transparent"]["arbiter_cluster"].as_str().unwrap();
    let problems = istio_cluster_problems(&rule, &filter, ext_proc_cluster, calls_cluster);
    assert!(problems.is_empty(), "{problems:?}");
    // The check can fail: the filter's calls on the ext_proc cluster (as shipped
    // before), on Istio's default cluster of the Service, on a subset the rule
    // does not round-robin, or with the ring hash patched into every subset.
    assert!(!istio_cluster_problems(&rule, &filter, ext_proc_cluster, ext_proc_cluster).is_empty());
    let whole = "outbound|18051||lockmesh-arbiter.lockmesh-system.svc.cluster.local";
    assert!(!istio_cluster_problems(&rule, &filter, ext_proc_cluster, whole).is_empty());
    let mut planted = rule.clone();
    planted["spec"]["subsets"][1]["trafficPolicy"]["loadBalancer"]["simple"] = Value::from("LEAST_REQUEST");
    assert!(!istio_cluster_problems(&planted, &filter, ext_proc_cluster, calls_cluster).is_empty());
    let mut planted = filter.clone();
    for p in planted["spec"]["configPatches"].as_array_mut().unwrap() {
        if let Some(m) = p["match"]["cluster"].as_object_mut() {
            m.remove("subset");
        }
    }
    assert!(!istio_cluster_problems(&rule, &planted, ext_proc_cluster, calls_cluster).is_empty());
    let text = std::fs::read_to_string(root.join("envoyfilter.yaml")).unwrap();
    assert!(text.contains("envoy.reloadable_features.ext_proc_fail_close_spurious_resp: true"));
}

/// Why the Istio example's clusters are not as the transparent filter needs them
/// (empty when they are): `ext_proc` is the outbound cluster of a subset of the
/// rule's host that the EnvoyFilter ring-hashes; `calls` (the filter's keepalives
/// and releases) is another subset's cluster of the same host and port, round
/// robin in the rule and touched by no cluster patch of the EnvoyFilter (a patch
/// whose match names no subset patches every subset's cluster).
fn istio_cluster_problems(rule: &Value, filter: &Value, ext_proc: &str, calls: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let parse = |c: &str| -> Option<(String, String, String)> {
        let parts: Vec<&str> = c.split('|').collect();
        match parts.as_slice() {
            ["outbound", port, subset, host] => Some(((*port).to_owned(), (*subset).to_owned(), (*host).to_owned())),
            _ => None,
        }
    };
    let (Some((ep_port, ep_subset, ep_host)), Some((c_port, c_subset, c_host))) = (parse(ext_proc), parse(calls))
    else {
        return vec![format!("not Istio outbound cluster names: {ext_proc}, {calls}")];
    };
    if (ep_port.as_str(), ep_host.as_str()) != (c_port.as_str(), c_host.as_str()) {
        problems.push("the two clusters are not of the same service and port".into());
    }
    if rule["spec"]["host"].as_str() != Some(c_host.as_str()) {
        problems.push(format!("the DestinationRule is not for {c_host}"));
    }
    if ep_subset.is_empty() || c_subset.is_empty() || ep_subset == c_subset {
        problems.push(format!("ext_proc ({ext_proc}) and the calls ({calls}) need two subsets of their own"));
    }
    let subset = |name: &str| rule["spec"]["subsets"].as_array().and_then(|v| v.iter().find(|s| s["name"] == name));
    match subset(&c_subset) {
        Some(s) if s["trafficPolicy"]["loadBalancer"]["simple"] == "ROUND_ROBIN" => {}
        _ => problems.push(format!("the rule does not make subset {c_subset:?} round robin")),
    }
    if subset(&ep_subset).is_none() {
        problems.push(format!("the rule has no subset {ep_subset:?}"));
    }
    let mut ring_hashed = false;
    for p in filter["spec"]["configPatches"].as_array().into_iter().flatten() {
        if p["applyTo"] != "CLUSTER" {
            continue;
        }
        let m = &p["match"]["cluster"];
        let hits = |subset: &str| {
            m["service"].as_str().is_none_or(|s| s == c_host)
                && m["portNumber"].as_u64().is_none_or(|n| n.to_string() == c_port)
                && m["subset"].as_str().is_none_or(|s| s.is_empty() || s == subset)
        };
        if hits(&c_subset) {
            problems.push(format!("a cluster patch of the EnvoyFilter also changes the calls' subset {c_subset:?}"));
        }
        if hits(&ep_subset) && p["patch"]["value"]["lb_policy"] == "RING_HASH" {
            ring_hashed = true;
        }
    }
    if !ring_hashed {
        problems.push(format!("no cluster patch ring-hashes the ext_proc subset {ep_subset:?}"));
    }
    problems
}
