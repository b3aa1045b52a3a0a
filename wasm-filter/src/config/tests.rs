use proptest::prelude::*;

use super::*;

#[test]
fn defaults() {
    let c = parse(b"").unwrap();
    assert_eq!(c.max_wait_ms, 30_000);
    assert_eq!(c.max_queue_per_key, 1000);
    assert!(c.grants.is_empty() && c.local_limits.is_empty() && c.namespaces.is_empty());
    assert_eq!(parse(br#"{"max_wait_ms": 5000}"#).unwrap().max_wait_ms, 5000);
}

#[test]
fn a_full_configuration() {
    let c = parse(
        br#"{"max_wait_ms": 20000, "max_queue_per_key": 3, "namespaces": ["payments", "billing"],
             "grants": [{"identity": "spiffe://lockmesh.local/ns/payments/", "prefixes": ["payments"],
                         "operations": ["acquire", "inspect"]}],
             "local_limits": [{"prefix": "payments", "max_in_flight": 9, "approximate": true},
                              {"prefix": "payments/reports", "max_in_flight": 2, "approximate": true}]}"#,
    )
    .unwrap();
    assert_eq!(c.max_queue_per_key, 3);
    assert_eq!(c.grants.len(), 1);
    let k = |s: &str| LockKey::parse(s.as_bytes()).unwrap();
    assert_eq!(c.ns_label(Some("payments/x")), "payments");
    assert_eq!(c.ns_label(Some("zzz/x")), "other");
    assert_eq!(c.ns_label(None), "other");
    assert_eq!(c.local_limit(&k("payments/reports/1")).unwrap().max_in_flight, 2);
    assert_eq!(c.local_limit(&k("payments/reports-old")).unwrap().max_in_flight, 9);
    assert!(c.local_limit(&k("billing/x")).is_none());
}

/// What `"test_trap_header": "X"` is refused with in this build.
const TRAP_ERROR: &str = if cfg!(feature = "test-trap") {
    "test_trap_header: must be a lowercase header name"
} else {
    "test_trap_header: only in a test build of the filter"
};

#[cfg(not(feature = "test-trap"))]
#[test]
fn the_shipped_parser_refuses_the_test_trap() {
    // A well-formed trap header too: the shipped module has no trap to set.
    let e = parse(br#"{"max_wait_ms": 30000, "test_trap_header": "x-test-trap"}"#).unwrap_err();
    assert_eq!(e, vec!["test_trap_header: only in a test build of the filter"]);
    let e = parse(br#"{"test_trap_header": null, "max_queue_per_key": 0}"#).unwrap_err();
    assert_eq!(e, vec!["max_queue_per_key: 0 is outside 1 to 100000"], "null is the field's absence");
}

#[cfg(feature = "test-trap")]
#[test]
fn a_test_build_takes_the_trap_header() {
    let c = parse(br#"{"test_trap_header": "x-test-trap"}"#).unwrap();
    assert_eq!(c.test_trap_header.as_deref(), Some("x-test-trap"));
    assert_eq!(parse(br#"{"test_trap_header": ""}"#).unwrap_err(), vec![TRAP_ERROR]);
}

#[test]
fn every_error_is_reported_with_its_path() {
    let e = parse(
        br#"{"max_wait_ms": 99999999, "max_queue_per_key": 0, "test_trap_header": "X",
             "namespaces": ["ok", "Not OK", "ok"],
             "grants": [{"identity": "spiffe://a/", "prefixes": ["a"], "operations": ["acquire"]},
                        {"identity": "spiffe://a/", "prefix": ["a"]},
                        {"identity": "spiffe://a/x", "prefixes": ["a//b"], "operations": ["lock"]}],
             "local_limits": [{"prefix": "a", "max_in_flight": 0},
                              {"prefix": "a", "max_in_flight": 1, "approximate": true},
                              {"prefix": "a", "max_in_flight": 1, "approximate": true, "x": 1}]}"#,
    )
    .unwrap_err();
    assert_eq!(
        e,
        vec![
            "max_wait_ms: 99999999 is above the ceiling 3600000",
            "max_queue_per_key: 0 is outside 1 to 100000",
            "namespaces[1]: \"Not OK\" must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric",
            "namespaces[2]: \"ok\" is listed twice",
            "grants[1]: unknown field `prefix`, expected one of `identity`, `prefixes`, `operations`",
            "grants[2].prefixes[0]: \"a//b\" is not a namespace or namespace/path",
            "grants[2].operations[0]: \"lock\" is not one of acquire, inspect, validate, admin",
            "local_limits[0].max_in_flight: 0 is outside 1 to 100000",
            "local_limits[0].approximate: must be true: the limit holds per Envoy, so across the fleet it is max_in_flight x lock-tier replicas",
            "local_limits[2]: unknown field `x`, expected one of `prefix`, `max_in_flight`, `approximate`",
            TRAP_ERROR,
        ]
    );
    assert!(parse(br#"{"max_wait": 1}"#).unwrap_err()[0].contains("unknown field"));
    assert!(parse(b"[1]").unwrap_err()[0].starts_with("configuration: "));
    let dup = parse(
        br#"{"local_limits": [{"prefix": "a", "max_in_flight": 1, "approximate": true},
                              {"prefix": "a", "max_in_flight": 1, "approximate": true}]}"#,
    )
    .unwrap_err();
    assert_eq!(dup, vec!["local_limits[1].prefix: \"a\" is listed twice"]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = parse(&bytes);
    }

    /// Structurally plausible JSON with arbitrary leaves: parse answers, never panics.
    #[test]
    fn plausible_json_never_panics(
        wait in prop_oneof![Just(serde_json::json!(null)), any::<i64>().prop_map(serde_json::Value::from), "\\PC{0,5}".prop_map(serde_json::Value::from)],
        ns in proptest::collection::vec("\\PC{0,8}", 0..4),
        ids in proptest::collection::vec("\\PC{0,30}", 0..4),
        prefixes in proptest::collection::vec("[a-z/.]{0,12}", 0..4),
        ops in proptest::collection::vec(prop_oneof![Just("acquire".to_string()), Just("admin".to_string()), "\\PC{0,6}"], 0..4),
        max in any::<i64>(),
        approximate in proptest::option::of(any::<bool>()),
    ) {
        let grants: Vec<_> = ids.iter().map(|id| serde_json::json!({
            "identity": id, "prefixes": prefixes, "operations": ops,
        })).collect();
        let limits: Vec<_> = prefixes.iter().map(|p| serde_json::json!({
            "prefix": p, "max_in_flight": max, "approximate": approximate,
        })).collect();
        let doc = serde_json::json!({
            "max_wait_ms": wait, "namespaces": ns, "grants": grants, "local_limits": limits,
            "max_queue_per_key": max,
        });
        let _ = parse(doc.to_string().as_bytes());
    }
}

fn prefix(r: &TransparentRoute) -> &str {
    match &r.matcher {
        RouteMatch::Prefix(p) => p,
        RouteMatch::Template(t) => t.as_str(),
    }
}

#[test]
fn transparent_routes_and_their_errors() {
    let c = parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "arb", "routes": [
              {"path_prefix": "/", "caller_chooses_key": true},
              {"path_prefix": "/orders", "allow_unlocked": true, "default_wait_ms": 100, "caller_chooses_key": true}]}}"#,
    )
    .unwrap();
    assert!(!c.api);
    let t = c.transparent.as_ref().unwrap();
    assert_eq!(
        (t.arbiter_authority.as_str(), t.callout_timeout_ms, t.reconcile_every_ms),
        ("lockmesh-arbiter", 2000, 5000)
    );
    let route = |p: &str| c.transparent_route(p).unwrap().unwrap().0;
    assert_eq!(route("/orders/1").default_wait_ms, 100);
    assert_eq!(prefix(route("/orders")), "/orders");
    assert_eq!(prefix(route("/orders-old")), "/");
    assert_eq!(route("/x").default_wait_ms, 5000);
    // Each caller-chosen route is warned about, by its path.
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
    assert!(c.warnings[1].starts_with("transparent.routes[1]: caller_chooses_key: the caller names the key"));
    let e = parse(
        br#"{"api": false, "max_wait_ms": 1000, "transparent": {"arbiter_cluster": "", "callout_timeout_ms": 5,
              "reconcile_every_ms": 1, "routes": [{"path_prefix": "orders", "caller_chooses_key": true},
              {"path_prefix": "/a", "caller_chooses_key": true}, {"path_prefix": "/a", "caller_chooses_key": true},
              {"path_prefix": "/b", "default_wait_ms": 5000, "caller_chooses_key": true},
              {"path_prefix": "/c", "prefix": "/c"}]}}"#,
    )
    .unwrap_err();
    let want = [
        "transparent.arbiter_cluster: required",
        "transparent.callout_timeout_ms: 5 is outside",
        "transparent.reconcile_every_ms: 1 is outside",
        "transparent.routes[0].path_prefix: \"orders\" must start with '/'",
        "transparent.routes[2].path_prefix: \"/a\" is listed twice",
        "transparent.routes[3].default_wait_ms: above max_wait_ms 1000",
        "transparent.routes[4]: unknown field `prefix`",
    ];
    for w in want {
        assert!(e.iter().any(|m| m.starts_with(w)), "missing {w:?} in {e:#?}");
    }
    // A prefix no canonical path can be under is refused, naming the problem.
    for (prefix, why) in [
        ("/a/../b", "'..' segment"),
        ("/a%2Fb", "encoded"),
        ("/a;x", "';' path parameter"),
        ("/a?x", "without a query"),
        ("/a//b", "empty segment"),
        ("/a#b", "fragment"),
        ("/%2e", "lower-case"),
        ("/caf\u{e9}", "outside the path characters"),
    ] {
        let doc = serde_json::json!({"api": false, "transparent": {"arbiter_cluster": "a",
            "routes": [{"path_prefix": prefix, "caller_chooses_key": true}]}});
        let e = parse(doc.to_string().as_bytes()).unwrap_err();
        assert!(
            e[0].starts_with("transparent.routes[0].path_prefix: ") && e[0].contains("canonical") && e[0].contains(why),
            "{prefix:?}: {e:?}"
        );
    }
    let e = parse(br#"{"api": false}"#).unwrap_err();
    assert!(e[0].starts_with("api: false needs transparent routes"), "{e:?}");
    let e = parse(br#"{"transparent": {"arbiter_cluster": "a", "routes": []}}"#).unwrap_err();
    assert!(e[0].starts_with("transparent.routes: at least one"), "{e:?}");
}

#[test]
fn a_bound_route_derives_its_key_from_a_path_template() {
    let c = parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "arb", "routes": [
              {"path": "/orders/{id}", "key": "payments/order-{id}"},
              {"path": "/t/{tenant}/o/{id}", "key": "payments/{tenant}/{header:x-region}/{id}"},
              {"path_prefix": "/reports", "key": "payments/reports"},
              {"path": "/orders/new", "key": "payments/order-new"},
              {"path_prefix": "/", "key": "payments/app"}]}}"#,
    )
    .unwrap();
    assert!(c.warnings.is_empty(), "bound routes warn about nothing: {:?}", c.warnings);
    let (r, vars) = c.transparent_route("/orders/7").unwrap().unwrap();
    assert!(matches!(&r.key, KeySource::Bound(t) if t.as_str() == "payments/order-{id}"));
    assert_eq!(vars.get("id"), Some("7"));
    // A template route wins over every prefix; among templates the first listed.
    assert_eq!(prefix(c.transparent_route("/orders/new").unwrap().unwrap().0), "/orders/{id}");
    assert_eq!(prefix(c.transparent_route("/reports/q3").unwrap().unwrap().0), "/reports");
    // A path of another shape falls to the prefixes.
    for p in ["/orders/7/items", "/orders", "/orders/", "/x"] {
        let (r, vars) = c.transparent_route(p).unwrap().unwrap();
        assert_eq!((prefix(r), vars.len()), ("/", 0), "{p}");
    }
}

#[test]
fn every_route_says_where_its_key_comes_from() {
    let errs = |route: serde_json::Value| {
        let doc = serde_json::json!({"api": false, "transparent": {"arbiter_cluster": "a", "routes": [route]}});
        parse(doc.to_string().as_bytes()).unwrap_err()
    };
    let cases = [
        (serde_json::json!({"path_prefix": "/"}), "transparent.routes[0].key: required: a key template"),
        (serde_json::json!({"path_prefix": "/", "caller_chooses_key": false}), "transparent.routes[0].key: required"),
        (
            serde_json::json!({"path": "/o/{id}", "key": "p/{id}", "caller_chooses_key": true}),
            "transparent.routes[0].caller_chooses_key: true and a key template are exclusive",
        ),
        (
            serde_json::json!({"path": "/o/{id}", "path_prefix": "/o", "key": "p/{id}"}),
            "transparent.routes[0]: path_prefix and path are exclusive",
        ),
        (serde_json::json!({"key": "p/x"}), "transparent.routes[0]: a path_prefix"),
        (
            serde_json::json!({"path": "/o/{id}", "key": "p/{other}"}),
            "transparent.routes[0].key: \"p/{other}\": {other} is not a variable",
        ),
        (
            serde_json::json!({"path_prefix": "/o", "key": "p/{id}"}),
            "transparent.routes[0].key: \"p/{id}\": {id} is not a variable",
        ),
        (serde_json::json!({"path": "/o/{id", "key": "p/x"}), "transparent.routes[0].path: "),
        (serde_json::json!({"path": "/o/%2E/{id}", "key": "p/{id}"}), "transparent.routes[0].path: "),
        (
            serde_json::json!({"path": "/o/{id}", "key": "p/{header:x-a}/{header:x-b}/{id}"}),
            "transparent.routes[0].key: \"p/{header:x-a}/{header:x-b}/{id}\" reads 2 headers; at most one",
        ),
        (
            serde_json::json!({"path": "/o/{id}", "key": "{header:x-lock-key}"}),
            "transparent.routes[0].key: {header:x-lock-key} is a lockmesh header",
        ),
        (
            serde_json::json!({"path": "/o/{id}", "key": "p/{header:x-lockmesh-vm}"}),
            "transparent.routes[0].key: {header:x-lockmesh-vm} is a lockmesh header",
        ),
        (
            serde_json::json!({"path": "/o/{id}", "key": "p//{id}"}),
            "transparent.routes[0].key: \"p//{id}\" gives no valid key even for plain values",
        ),
        (
            serde_json::json!({"path": "/o/{id}", "key": "Payments/{id}"}),
            "transparent.routes[0].key: \"Payments/{id}\" gives no valid key",
        ),
        (
            serde_json::json!({"path": "/o/{id}", "key": "p/{id}", "allow_unlocked": true}),
            "transparent.routes[0].allow_unlocked: true needs caller_chooses_key",
        ),
    ];
    for (route, want) in cases {
        let e = errs(route.clone());
        assert!(e.iter().any(|m| m.starts_with(want)), "{route}: missing {want:?} in {e:#?}");
    }
    let e = parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "a", "routes": [
              {"path": "/o/{id}", "key": "p/{id}"}, {"path": "/o/{id}", "key": "p/x-{id}"}]}}"#,
    )
    .unwrap_err();
    assert_eq!(e[0], "transparent.routes[1].path: \"/o/{id}\" is listed twice");
}

#[test]
fn a_typed_path_variable_refuses_other_spellings_instead_of_falling_through() {
    let c = parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "arb", "routes": [
              {"path": "/orders/{id:uint}", "key": "payments/order-{id}"},
              {"path": "/orders/new", "key": "payments/order-new"},
              {"path_prefix": "/orders", "key": "payments/orders"},
              {"path_prefix": "/", "caller_chooses_key": true}]}}"#,
    )
    .unwrap();
    let (r, vars) = c.transparent_route("/orders/7").unwrap().unwrap();
    assert_eq!((prefix(r), vars.get("id")), ("/orders/{id:uint}", Some("7")));
    // A literal route listed after the typed one still takes its path.
    assert_eq!(prefix(c.transparent_route("/orders/new").unwrap().unwrap().0), "/orders/new");
    for p in ["/orders/07", "/orders/+7", "/orders/7.json", "/orders/7%20", "/orders/18446744073709551616"] {
        let e = c.transparent_route(p).unwrap_err();
        assert_eq!(e.to_string().split(':').next(), Some("path segment {id} must be a uint"), "{p}");
    }
    // Another shape falls to the prefixes as before.
    for (p, want) in [("/orders/7/items", "/orders"), ("/orders", "/orders"), ("/other", "/")] {
        assert_eq!(prefix(c.transparent_route(p).unwrap().unwrap().0), want, "{p}");
    }
    let errs = |route: serde_json::Value| {
        let doc = serde_json::json!({"api": false, "transparent": {"arbiter_cluster": "a", "routes": [route]}});
        parse(doc.to_string().as_bytes()).unwrap_err()
    };
    assert_eq!(
        errs(serde_json::json!({"path": "/o/{id:int}", "key": "p/{id}"}))[0],
        "transparent.routes[0].path: \"/o/{id:int}\": {id:int}: unknown type \"int\" (known: uint; write {id} for any segment)"
    );
    assert_eq!(
        errs(serde_json::json!({"path": "/o/{id:uint}", "key": "p/{id:uint}"}))[0],
        "transparent.routes[0].key: \"p/{id:uint}\": {id:uint}: a variable's type goes in the path template; write {id} here"
    );
    // The key check fills a typed variable with a value of its type.
    assert!(parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "a", "routes": [
        {"path": "/o/{id:uint}", "key": "p/{id}"}]}}"#
    )
    .is_ok());
}

/// Every shipped transparent route whose path names an id (`{id}`, `{..._id}`)
/// types it: the shipped ids are numeric, and an untyped one lets `/orders/07`
/// lock a key other than `/orders/7`'s.
#[test]
fn every_shipped_id_placeholder_is_typed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let plugins: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("envoy-config/src/plugins.json")).unwrap()).unwrap();
    let mut configs: Vec<(String, serde_json::Value)> = plugins
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, spec)| (format!("plugins.json {name}"), spec["fields"].clone()))
        .collect();
    let istio = std::fs::read_to_string(root.join("deploy/istio/wasmplugin.yaml")).unwrap();
    for doc in istio.split("\n---") {
        let v: serde_json::Value = serde_saphyr::from_str(doc).unwrap();
        if let Some(c) = v.pointer("/spec/pluginConfig") {
            configs.push(("deploy/istio/wasmplugin.yaml".into(), c.clone()));
        }
    }
    // The rendered configs carry the plugin configuration as a JSON string.
    fn plugin_strings(v: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
        match v {
            serde_json::Value::String(s) => {
                if let Ok(j @ serde_json::Value::Object(_)) = serde_json::from_str::<serde_json::Value>(s) {
                    if j.get("transparent").is_some() {
                        out.push(j);
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| plugin_strings(x, out)),
            serde_json::Value::Object(o) => o.values().for_each(|x| plugin_strings(x, out)),
            _ => {}
        }
    }
    for rendered in
        ["envoy-config/inbound-sidecar.yaml", "envoy-config/lock-tier.yaml", "envoy-config/app-sidecar.yaml"]
    {
        let v: serde_json::Value =
            serde_saphyr::from_str(&std::fs::read_to_string(root.join(rendered)).unwrap()).unwrap();
        let mut found = Vec::new();
        plugin_strings(&v, &mut found);
        configs.extend(found.into_iter().map(|c| (rendered.to_owned(), c)));
    }
    let mut templates = 0;
    let mut untyped = Vec::new();
    for (name, c) in &configs {
        let cfg = parse(c.to_string().as_bytes()).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        for r in cfg.transparent.iter().flat_map(|t| &t.routes) {
            if let RouteMatch::Template(t) = &r.matcher {
                templates += 1;
                for (v, kind) in t.var_kinds() {
                    if (v == "id" || v.ends_with("_id")) && kind != lockmesh_core::template::Kind::Uint {
                        untyped.push(format!("{name}: {} {{{v}}}", t.as_str()));
                    }
                }
            }
        }
    }
    assert!(templates >= 6, "found {templates} shipped path templates: {configs:?}");
    assert!(untyped.is_empty(), "untyped id placeholders: {untyped:#?}");
}
