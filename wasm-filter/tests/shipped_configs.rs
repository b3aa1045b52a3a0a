//! Runs the filter's configuration parser over every plugin configuration embedded
//! in `envoy-config/*.yaml` (Proxy-Wasm has no offline validation hook), and checks
//! that every shipped filter fails closed and has no test-only switch set (the
//! shipped build's parser refuses `test_trap_header`), and that every shipped HTTP
//! connection manager normalises paths and refuses underscore header names
//! (issue #17, docs/DEPLOY.md "Path normalisation"), that every ext_proc receives
//! the headers the arbiter reads, and that the transparent filter's renewal cluster
//! sends the two calls of a renewal to two arbiters (docs/TRANSPARENT.md).

// A test binary: assertions by unwrap are the point, helpers included.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::Value;

const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

/// Every rendered Envoy bootstrap that ships: `envoy-config/*.yaml` and the
/// Kubernetes lock tier that `scripts/gen-envoy-configs` renders into `deploy/`.
fn shipped_bootstraps() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut out: Vec<_> = std::fs::read_dir(root.join("envoy-config"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"))
        .collect();
    out.push(root.join("deploy/base/lock-tier/envoy.yaml"));
    out.sort();
    out
}

fn find_typed<'a>(v: &'a Value, ty: &str, out: &mut Vec<&'a Value>) {
    match v {
        Value::Object(m) => {
            if m.get("@type").and_then(Value::as_str) == Some(ty) {
                out.push(v);
            }
            m.values().for_each(|c| find_typed(c, ty, out));
        }
        Value::Array(s) => s.iter().for_each(|c| find_typed(c, ty, out)),
        _ => {}
    }
}

/// What an HTTP connection manager lacks of the path and header safety settings
/// (empty when it has them all): `normalize_path` and `merge_slashes` true,
/// `path_with_escaped_slashes_action` and
/// `common_http_protocol_options.headers_with_underscores_action` `REJECT_REQUEST`.
fn hcm_safety_problems(hcm: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    for flag in ["normalize_path", "merge_slashes"] {
        if hcm[flag].as_bool() != Some(true) {
            problems.push(format!("{flag} is not true"));
        }
    }
    if hcm["path_with_escaped_slashes_action"].as_str() != Some("REJECT_REQUEST") {
        problems.push("path_with_escaped_slashes_action is not REJECT_REQUEST".into());
    }
    if hcm["common_http_protocol_options"]["headers_with_underscores_action"].as_str() != Some("REJECT_REQUEST") {
        problems.push("common_http_protocol_options.headers_with_underscores_action is not REJECT_REQUEST".into());
    }
    problems
}

/// Every HCM in `doc` with what it lacks; `Err` lists the offenders, `Ok` the count.
fn check_hcms(doc: &Value) -> Result<usize, Vec<String>> {
    let mut hcms = Vec::new();
    find_typed(doc, HCM_TYPE, &mut hcms);
    let bad: Vec<String> = hcms
        .iter()
        .filter_map(|h| {
            let p = hcm_safety_problems(h);
            (!p.is_empty()).then(|| format!("HCM {}: {}", h["stat_prefix"].as_str().unwrap_or("?"), p.join(", ")))
        })
        .collect();
    if bad.is_empty() {
        Ok(hcms.len())
    } else {
        Err(bad)
    }
}

fn walk<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
    match v {
        Value::Object(m) => {
            if m.get("@type").and_then(Value::as_str) == Some(WASM_TYPE) {
                out.push(v);
            }
            m.values().for_each(|c| walk(c, out));
        }
        Value::Array(s) => s.iter().for_each(|c| walk(c, out)),
        _ => {}
    }
}

/// `scripts/up`'s identities (trust domain `lockmesh.local`) can use the demo.
fn demo_identities_are_granted_their_own_namespace(c: &lockmesh_wasm_filter::config::Config) {
    use lockmesh_core::{grant::Operation, LockKey};
    let key = |k: &str| LockKey::parse(k.as_bytes()).unwrap();
    let worker = "spiffe://lockmesh.local/ns/payments/sa/worker";
    let job = "spiffe://lockmesh.local/ns/billing/sa/job";
    for op in [Operation::Acquire, Operation::Inspect] {
        assert!(c.grants.allowed(worker, &key("payments/order-42"), op));
        assert!(c.grants.allowed(job, &key("billing/batch/1"), op));
        assert!(!c.grants.allowed(job, &key("payments/order-42"), op));
    }
    assert!(!c.grants.allowed(worker, &key("payments/x"), Operation::Admin));
}

#[test]
fn every_shipped_plugin_configuration_parses_and_fails_closed() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy-config");
    let mut found = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let doc: Value = serde_saphyr::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut filters = Vec::new();
        walk(&doc, &mut filters);
        for f in filters {
            let name = path.display();
            let cfg = &f["config"];
            assert_eq!(cfg["failure_policy"].as_str(), Some("FAIL_CLOSED"), "{name}: wasm filter must fail closed");
            let value = cfg["configuration"]["value"].as_str().unwrap_or("");
            let parsed = lockmesh_wasm_filter::config::parse(value.as_bytes())
                .unwrap_or_else(|e| panic!("{name}: plugin configuration refused: {e:?}"));
            // A shipped build refuses the field outright (the parse above); a test
            // build takes it, so check it is unset.
            #[cfg(feature = "test-trap")]
            assert_eq!(parsed.test_trap_header, None, "{name}: test-only switch set in a shipped config");
            if path.ends_with("lock-tier.yaml") {
                demo_identities_are_granted_their_own_namespace(&parsed);
            }
            found += 1;
        }
    }
    assert!(found >= 1, "no Wasm filter found in envoy-config/");
}

#[test]
fn every_shipped_connection_manager_normalises_paths_and_refuses_underscore_headers() {
    let mut total = 0;
    for path in shipped_bootstraps() {
        let doc: Value = serde_saphyr::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        match check_hcms(&doc) {
            Ok(0) => panic!("{}: no HTTP connection manager found", path.display()),
            Ok(n) => total += n,
            Err(bad) => panic!("{}: {}", path.display(), bad.join("; ")),
        }
    }
    // lock tier, inbound and application sidecars, the Kubernetes lock tier and its
    // health listener.
    assert!(total >= 5, "only {total} HCMs found");
}

/// The check above can fail: the shipped inbound sidecar with any one of the four
/// settings taken out is refused, naming the missing setting.
#[test]
fn a_connection_manager_without_one_safety_setting_fails_the_check() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy-config/inbound-sidecar.yaml");
    let doc: Value = serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(check_hcms(&doc), Ok(1));
    for (setting, named) in [
        ("normalize_path", "normalize_path"),
        ("merge_slashes", "merge_slashes"),
        ("path_with_escaped_slashes_action", "path_with_escaped_slashes_action"),
        ("common_http_protocol_options", "headers_with_underscores_action"),
    ] {
        let mut planted = doc.clone();
        let mut hcms = Vec::new();
        find_typed(&doc, HCM_TYPE, &mut hcms);
        let pointer = json_pointer_to(&doc, hcms[0]).unwrap();
        planted.pointer_mut(&pointer).unwrap().as_object_mut().unwrap().remove(setting).unwrap();
        let err = check_hcms(&planted).expect_err(setting);
        assert!(err.len() == 1 && err[0].contains(named), "{setting}: {err:?}");
    }
}

/// The JSON pointer of `target` (by address) inside `root`.
fn json_pointer_to(root: &Value, target: &Value) -> Option<String> {
    if std::ptr::eq(root, target) {
        return Some(String::new());
    }
    match root {
        Value::Object(m) => m.iter().find_map(|(k, v)| {
            json_pointer_to(v, target).map(|p| format!("/{}{p}", k.replace('~', "~0").replace('/', "~1")))
        }),
        Value::Array(s) => {
            s.iter().enumerate().find_map(|(i, v)| json_pointer_to(v, target).map(|p| format!("/{i}{p}")))
        }
        _ => None,
    }
}

const EXT_PROC_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor";

/// Whether one `forward_rules.allowed_headers` pattern (exact or prefix, as the
/// shipped configs write them) lets header `name` through.
fn pattern_allows(p: &Value, name: &str) -> bool {
    match (p["exact"].as_str(), p["prefix"].as_str()) {
        (Some(e), _) => e == name,
        (_, Some(pre)) => name.starts_with(pre),
        _ => panic!("unexpected forward_rules pattern {p}"),
    }
}

/// Every header the arbiter reads (issue 20: ext_proc receives only these) that an
/// ext_proc filter's `forward_rules` would keep from it, and the headers it must
/// not receive that the rules let through. Empty when the rules are right.
fn forward_rule_problems(ext_proc: &Value) -> Vec<String> {
    use lockmesh_core::headers as h;
    let Some(patterns) = ext_proc["forward_rules"]["allowed_headers"]["patterns"].as_array() else {
        return vec!["no forward_rules.allowed_headers: every request header is sent to the arbiter".into()];
    };
    let allowed = |n: &str| patterns.iter().any(|p| pattern_allows(p, n));
    let mut read: Vec<&str> = vec![":method", ":path", h::FILTERED, h::BUDGET_MS, h::VM, h::HOLD, h::UNLOCKED];
    read.extend(h::LOCK_HEADERS);
    // A twin spelt with '_' must reach the arbiter too: it refuses it.
    let twins: Vec<String> = h::LOCK_HEADERS.iter().map(|n| n.replace('-', "_")).collect();
    let mut problems: Vec<String> = read
        .into_iter()
        .chain(twins.iter().map(String::as_str))
        .filter(|n| !allowed(n))
        .map(|n| format!("{n} is not forwarded"))
        .collect();
    for other in ["cookie", "user-agent", "authorization", "traceparent", ":authority", "x-forwarded-client-cert"] {
        if allowed(other) {
            problems.push(format!("{other} is forwarded, and the arbiter does not read it"));
        }
    }
    problems
}

#[test]
fn every_shipped_ext_proc_receives_exactly_the_headers_the_arbiter_reads() {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let mut docs: Vec<(std::path::PathBuf, Value)> = shipped_bootstraps()
        .into_iter()
        .map(|p| {
            let doc = serde_saphyr::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            (p, doc)
        })
        .collect();
    // The Istio patch is a list of documents; its ext_proc is in the first.
    let istio = root.join("deploy/istio/envoyfilter.yaml");
    let text = std::fs::read_to_string(&istio).unwrap();
    let first = text.split("\n---").find(|d| d.contains(EXT_PROC_TYPE)).unwrap();
    docs.push((istio, serde_saphyr::from_str(first).unwrap()));
    let mut total = 0;
    for (path, doc) in &docs {
        let mut found = Vec::new();
        find_typed(doc, EXT_PROC_TYPE, &mut found);
        for e in found {
            total += 1;
            let problems = forward_rule_problems(e);
            assert!(problems.is_empty(), "{}: {}", path.display(), problems.join("; "));
        }
    }
    // lock tier, inbound sidecar, the Kubernetes lock tier, the Istio patch.
    assert!(total >= 4, "only {total} ext_proc filters found");
    // The check can fail: rules that drop the budget header, or forward everything.
    let mut found = Vec::new();
    find_typed(&docs[0].1, EXT_PROC_TYPE, &mut found);
    let mut planted = found[0].clone();
    planted["forward_rules"]["allowed_headers"]["patterns"] =
        serde_json::json!([{ "exact": ":method" }, { "exact": ":path" }, { "prefix": "x-lock-" }]);
    let p = forward_rule_problems(&planted);
    assert!(p.iter().any(|m| m.contains(lockmesh_core::headers::BUDGET_MS)), "{p:?}");
    planted.as_object_mut().unwrap().remove("forward_rules");
    assert_eq!(forward_rule_problems(&planted).len(), 1);
    planted["forward_rules"]["allowed_headers"]["patterns"] = serde_json::json!([{ "prefix": "" }]);
    assert!(forward_rule_problems(&planted).iter().any(|m| m.contains("cookie")));
}

/// Why cluster `c` may not carry the transparent filter's own calls (empty when it
/// may): the filter sends each renewal as two calls at once and relies on them
/// reaching two different arbiters (wasm-filter/src/transparent.rs, "Renewal").
/// Round robin (Envoy's default) gives two consecutive picks on one worker two
/// hosts. Least-request counts only requests already on a connection, so while
/// connections are opening both calls tie and ties go to a random host; ring hash
/// and Maglev send calls without a hash to one random host each; random is random.
fn calls_cluster_problems(c: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(p) = c.get("lb_policy").and_then(Value::as_str) {
        if p != "ROUND_ROBIN" {
            problems.push(format!("lb_policy {p}: two calls of one renewal may reach the same arbiter"));
        }
    }
    let mut policies = Vec::new();
    walk_names(&c["load_balancing_policy"], &mut policies);
    for name in policies {
        if name != "envoy.load_balancing_policies.round_robin" {
            problems.push(format!("load_balancing_policy {name}: two calls of one renewal may reach the same arbiter"));
        }
    }
    problems
}

fn walk_names(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            if let (Some(Value::String(n)), Some(_)) = (m.get("name"), m.get("typed_config")) {
                out.push(n.clone());
            }
            m.values().for_each(|c| walk_names(c, out));
        }
        Value::Array(s) => s.iter().for_each(|c| walk_names(c, out)),
        _ => {}
    }
}

#[test]
fn every_shipped_renewal_cluster_sends_the_two_calls_of_a_renewal_to_two_arbiters() {
    let mut checked = 0;
    let mut planted_from = None;
    for path in shipped_bootstraps() {
        let doc: Value = serde_saphyr::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut filters = Vec::new();
        walk(&doc, &mut filters);
        for f in filters {
            let value = f["config"]["configuration"]["value"].as_str().unwrap_or("");
            let parsed = lockmesh_wasm_filter::config::parse(value.as_bytes()).unwrap();
            let Some(t) = parsed.transparent else { continue };
            let clusters = doc["static_resources"]["clusters"].as_array().unwrap();
            let c = clusters
                .iter()
                .find(|c| c["name"].as_str() == Some(t.arbiter_cluster.as_str()))
                .unwrap_or_else(|| panic!("{}: no cluster {}", path.display(), t.arbiter_cluster));
            let problems = calls_cluster_problems(c);
            assert!(problems.is_empty(), "{}: {}", path.display(), problems.join("; "));
            planted_from.get_or_insert_with(|| c.clone());
            checked += 1;
        }
    }
    // The inbound sidecar (the transparent shape that ships as a bootstrap).
    assert!(checked >= 1, "no transparent filter found in the shipped bootstraps");
    // The check can fail: the least-request cluster this replaced, and ring hash.
    let mut planted = planted_from.unwrap();
    planted["load_balancing_policy"] = serde_json::json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
            "selection_method": "FULL_SCAN"}}}]});
    assert_eq!(calls_cluster_problems(&planted).len(), 1);
    planted.as_object_mut().unwrap().remove("load_balancing_policy");
    planted["lb_policy"] = Value::from("RING_HASH");
    assert_eq!(calls_cluster_problems(&planted).len(), 1);
}
