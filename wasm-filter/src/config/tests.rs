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

#[test]
fn transparent_routes_and_their_errors() {
    let c = parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "arb", "routes": [
              {"path_prefix": "/"}, {"path_prefix": "/orders", "allow_unlocked": true, "default_wait_ms": 100}]}}"#,
    )
    .unwrap();
    assert!(!c.api);
    let t = c.transparent.as_ref().unwrap();
    assert_eq!(
        (t.arbiter_authority.as_str(), t.callout_timeout_ms, t.reconcile_every_ms),
        ("lockmesh-arbiter", 2000, 5000)
    );
    assert_eq!(c.transparent_route("/orders/1").unwrap().default_wait_ms, 100);
    assert_eq!(c.transparent_route("/orders").unwrap().path_prefix, "/orders");
    assert_eq!(c.transparent_route("/orders-old").unwrap().path_prefix, "/");
    assert_eq!(c.transparent_route("/x").unwrap().default_wait_ms, 5000);
    let e = parse(
        br#"{"api": false, "max_wait_ms": 1000, "transparent": {"arbiter_cluster": "", "callout_timeout_ms": 5,
              "reconcile_every_ms": 1, "routes": [{"path_prefix": "orders"}, {"path_prefix": "/a"},
              {"path_prefix": "/a"}, {"path_prefix": "/b", "default_wait_ms": 5000}, {"path": "/c"}]}}"#,
    )
    .unwrap_err();
    let want = [
        "transparent.arbiter_cluster: required",
        "transparent.callout_timeout_ms: 5 is outside",
        "transparent.reconcile_every_ms: 1 is outside",
        "transparent.routes[0].path_prefix: \"orders\" must start with '/'",
        "transparent.routes[2].path_prefix: \"/a\" is listed twice",
        "transparent.routes[3].default_wait_ms: above max_wait_ms 1000",
        "transparent.routes[4]: unknown field `path`",
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
        let doc = serde_json::json!({"api": false, "transparent": {"arbiter_cluster": "a", "routes": [{"path_prefix": prefix}]}});
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
