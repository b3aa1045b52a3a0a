use proptest::prelude::*;

use super::*;

fn cfg() -> Config {
    crate::config::parse(
        br#"{"grants": [
            {"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments"], "operations": ["acquire", "inspect"]},
            {"identity": "spiffe://lockmesh.test/ns/ops/sa/admin", "prefixes": ["payments"], "operations": ["admin"]}]}"#,
    )
    .unwrap()
}

fn h(method: &str, path: &str, pairs: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    [(":method", method.as_bytes()), (":path", path.as_bytes())]
        .iter()
        .chain(pairs)
        .map(|(n, v)| (n.to_string(), v.to_vec()))
        .collect()
}

fn acq(pairs: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    h("POST", "/v1/locks/acquire", pairs)
}

const ID: &[u8] = b"spiffe://lockmesh.test/ns/payments/sa/worker";
const BILLING: &[u8] = b"spiffe://lockmesh.test/ns/billing/sa/job";

fn http_status(d: &Decision) -> u32 {
    match d {
        Decision::Reject { status, .. } => *status,
        Decision::Pass(_) => 200,
    }
}

#[test]
fn unauthenticated_is_refused_first() {
    let d = on_request_headers(&cfg(), &h("GET", "/nope", &[("x-lock-key", b"bad key")]), None);
    assert!(matches!(d, Decision::Reject { status: 401, code: Code::Unauthenticated, .. }));
    let d = on_request_headers(&cfg(), &[], Some(b"https://evil"));
    assert_eq!(http_status(&d), 401);
}

#[test]
fn unknown_routes_and_bad_headers() {
    assert_eq!(http_status(&on_request_headers(&cfg(), &h("GET", "/x", &[]), Some(ID))), 404);
    let d = on_request_headers(&cfg(), &acq(&[("x-lock-wait-ms", b"-1")]), Some(ID));
    let Decision::Reject { status, body, .. } = d else { panic!() };
    assert_eq!(status, 400);
    assert!(body.contains("x-lock-wait-ms"), "{body}");
    let d = on_request_headers(&cfg(), &acq(&[("x-lock-key", b"payments/a"), ("x-lock-wait-ms", b"30001")]), Some(ID));
    assert_eq!(http_status(&d), 400);
    let d = on_request_headers(&cfg(), &acq(&[]), Some(ID));
    assert_eq!(d, Decision::reject(Code::BadRequest, "x-lock-key: required"));
}

#[test]
fn a_multi_key_acquire_is_authorised_key_by_key_and_denied_as_one() {
    let all = |keys: &[u8]| h("POST", "/v1/locks/acquire-all", &[("x-lock-keys", keys)]);
    let d = on_request_headers(&cfg(), &all(b"payments/a payments/b"), Some(ID));
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert_eq!((p.route, p.key), (Route::Api(ApiRoute::AcquireAll), None), "never queued under a key");
    // One key outside the caller's grants denies the request, wherever it stands,
    // with the one denial's bytes.
    let first = on_request_headers(&cfg(), &all(b"billing/x payments/b"), Some(ID));
    let last = on_request_headers(&cfg(), &all(b"payments/a payments/b billing/x"), Some(ID));
    let single = on_request_headers(&cfg(), &acq(&[("x-lock-key", b"billing/x")]), Some(ID));
    assert_eq!(first, Decision::denied());
    assert_eq!((&last, &single), (&first, &first));
    // x-lock-keys on this route only, required there, never beside x-lock-key.
    let none = on_request_headers(&cfg(), &h("POST", "/v1/locks/acquire-all", &[]), Some(ID));
    assert_eq!(none, Decision::reject(Code::BadRequest, "x-lock-keys: required"));
    let both =
        h("POST", "/v1/locks/acquire-all", &[("x-lock-keys", b"payments/a payments/b"), ("x-lock-key", b"payments/a")]);
    assert_eq!(http_status(&on_request_headers(&cfg(), &both, Some(ID))), 400);
    let on_acquire = acq(&[("x-lock-key", b"payments/a"), ("x-lock-keys", b"payments/a payments/b")]);
    let Decision::Reject { status: 400, body, .. } = on_request_headers(&cfg(), &on_acquire, Some(ID)) else {
        panic!("x-lock-keys on a single-key acquire")
    };
    assert!(body.contains("x-lock-keys"), "{body}");
    let twice = h("POST", "/v1/locks/acquire-all", &[("x-lock-keys", b"payments/a payments/a")]);
    assert_eq!(http_status(&on_request_headers(&cfg(), &twice, Some(ID))), 400);
}

#[test]
fn denial_is_one_answer_decided_by_grants() {
    let held = on_request_headers(&cfg(), &acq(&[("x-lock-key", b"payments/held")]), Some(BILLING));
    let missing = on_request_headers(&cfg(), &acq(&[("x-lock-key", b"payments/none")]), Some(BILLING));
    assert_eq!(held, missing);
    assert_eq!(
        held,
        Decision::Reject {
            status: 403,
            code: Code::Denied,
            body: r#"{"code":"denied","message":"not permitted"}"#.into()
        }
    );
    // Keyless session routes need some acquire grant.
    let open = h("POST", "/v1/sessions", &[]);
    assert_eq!(http_status(&on_request_headers(&cfg(), &open, Some(BILLING))), 403);
    assert_eq!(http_status(&on_request_headers(&cfg(), &open, Some(ID))), 200);
    // Operations are separate: inspect yes, admin no; outside the prefix no.
    let insp = h("GET", "/v1/locks", &[("x-lock-key", b"payments/a")]);
    assert_eq!(http_status(&on_request_headers(&cfg(), &insp, Some(ID))), 200);
    let admin = h("POST", "/v1/admin/seal", &[]);
    assert_eq!(http_status(&on_request_headers(&cfg(), &admin, Some(ID))), 403);
    let admin_id = b"spiffe://lockmesh.test/ns/ops/sa/admin";
    assert_eq!(http_status(&on_request_headers(&cfg(), &admin, Some(admin_id))), 200);
    let other = acq(&[("x-lock-key", b"payments-archive/a")]);
    assert_eq!(http_status(&on_request_headers(&cfg(), &other, Some(ID))), 403);
}

#[test]
fn strips_internal_and_identity_headers() {
    let d = on_request_headers(
        &cfg(),
        &acq(&[
            ("x-lock-key", b"payments/a"),
            ("x-lock-wait-ms", b"250"),
            ("x-lockmesh-budget-ms", b"999999"),
            ("x-forwarded-client-cert", b"By=spiffe://x"),
            ("x-lock-epoch", b"9"),
        ]),
        Some(ID),
    );
    let Decision::Pass(p) = d else { panic!() };
    assert_eq!(p.remove, vec!["x-forwarded-client-cert", "x-lock-epoch", "x-lockmesh-budget-ms"]);
    assert_eq!(p.set, vec![(headers::FILTERED, "1".to_string())]);
    assert_eq!((p.route, p.wait_ms), (Route::Api(ApiRoute::Acquire), 250));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn never_panics(
        method in prop_oneof![Just(b"POST".to_vec()), Just(b"GET".to_vec()), proptest::collection::vec(any::<u8>(), 0..8)],
        path in prop_oneof![Just(b"/v1/locks/acquire".to_vec()), Just(b"/v1/sessions".to_vec()),
                            Just(b"/v1/admin/x".to_vec()), proptest::collection::vec(any::<u8>(), 0..40)],
        names in proptest::collection::vec(prop_oneof![
            Just("x-lock-key".to_string()), Just("x-lock-wait-ms".to_string()),
            Just("x-lock-session".to_string()), Just("x-lock-token".to_string()),
            Just("x-lock-class".to_string()), Just("x-lock-instance".to_string()),
            Just("x-lockmesh-x".to_string()), Just("x_original_url".to_string()),
            Just("x-http-method-override".to_string()), "[a-z_-]{1,12}"], 0..8),
        vals in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..600), 8),
        id in proptest::option::of(prop_oneof![Just(ID.to_vec()), proptest::collection::vec(any::<u8>(), 0..64)]),
    ) {
        let mut hdrs = vec![(":method".to_string(), method), (":path".to_string(), path)];
        hdrs.extend(names.into_iter().zip(vals));
        let d = on_request_headers(&cfg(), &hdrs, id.as_deref());
        if let Decision::Pass(p) = d {
            prop_assert!(!p.route.needs_key() || p.key.is_some());
            prop_assert!(p.wait_ms <= cfg().max_wait_ms);
        }
    }
}

fn sidecar() -> Config {
    crate::config::parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "lockmesh_arbiter",
              "routes": [{"path_prefix": "/", "default_wait_ms": 2000, "caller_chooses_key": true},
                         {"path_prefix": "/public", "allow_unlocked": true, "caller_chooses_key": true}]},
             "grants": [{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments"], "operations": ["acquire"]}]}"#,
    )
    .unwrap()
}

#[test]
fn a_transparent_route_needs_a_key_unless_it_allows_unlocked_requests() {
    let d = on_request_headers(&sidecar(), &h("POST", "/orders/1", &[]), Some(ID));
    let Decision::Reject { status, code, body } = d else { panic!("{d:?}") };
    assert_eq!((status, code), (428, Code::LockRequired));
    assert!(body.contains("x-lock-key"), "{body}");
    // Unlocked, with every lock and internal header stripped (a client-sent copy of
    // the old header mark included) and no header set: its mark is filter state.
    let d = on_request_headers(
        &sidecar(),
        &h(
            "GET",
            "/public/x?y=1",
            &[("x-lock-token", b"5"), ("x-lockmesh-unlocked", b"1"), ("x-lock-session", b"00000000000000ff")],
        ),
        Some(BILLING),
    );
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert!(p.unlocked && p.key.is_none() && p.route == Route::Transparent);
    assert_eq!(p.remove, ["x-lock-session", "x-lock-token", "x-lockmesh-unlocked"]);
    assert!(p.set.is_empty(), "{:?}", p.set);
    // `/public-old` is not under `/public`: it is a locked route.
    assert_eq!(http_status(&on_request_headers(&sidecar(), &h("GET", "/public-old", &[]), Some(ID))), 428);
}

#[test]
fn a_transparent_request_is_authorised_queued_and_stripped_of_tokens() {
    let d = on_request_headers(
        &sidecar(),
        &h("POST", "/orders/1", &[("x-lock-key", b"payments/o-1"), ("x-lock-token", b"42"), ("x-lock-proof", b"v1.x")]),
        Some(ID),
    );
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert!(!p.unlocked && p.route.queues());
    assert_eq!(p.wait_ms, 2000, "the route's default wait");
    assert_eq!(p.remove, ["x-lock-proof", "x-lock-token"]);
    assert!(!p.set.iter().any(|(n, _)| *n == headers::UNLOCKED));
    // An explicit wait wins; over the maximum is refused.
    let d = on_request_headers(
        &sidecar(),
        &h("POST", "/o", &[("x-lock-key", b"payments/o-1"), ("x-lock-wait-ms", b"0")]),
        Some(ID),
    );
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert_eq!(p.wait_ms, 0);
    // Another namespace: the one denial.
    let d = on_request_headers(&sidecar(), &h("POST", "/o", &[("x-lock-key", b"billing/o-1")]), Some(ID));
    assert_eq!(d, Decision::denied());
    // The API routes are not served on a sidecar (api: false): they are app paths.
    let d = on_request_headers(&sidecar(), &acq(&[("x-lock-key", b"payments/o-1")]), Some(ID));
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert_eq!(p.route, Route::Transparent);
}

#[test]
fn headers_are_stripped_by_the_name_a_server_will_read() {
    // Internal, identity and diagnostic headers in any `_`/case spelling, on the API.
    let d = on_request_headers(
        &cfg(),
        &acq(&[
            ("x-lock-key", b"payments/a"),
            ("x_lockmesh_budget_ms", b"999999"),
            ("x-lockmesh_filtered", b"1"),
            ("x_forwarded_client_cert", b"By=spiffe://x"),
            ("x_spiffe_id", b"spiffe://lockmesh.test/ns/ops/sa/admin"),
            ("x_lock_epoch", b"9"),
            ("x_lock_revision", b"9"),
            ("x_custom", b"kept"),
        ]),
        Some(ID),
    );
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert_eq!(
        p.remove,
        [
            "x-lockmesh_filtered",
            "x_forwarded_client_cert",
            "x_lock_epoch",
            "x_lock_revision",
            "x_lockmesh_budget_ms",
            "x_spiffe_id"
        ]
    );
    // On a transparent route, the proof's twin too (the filter does not read it).
    let d = on_request_headers(
        &sidecar(),
        &h(
            "POST",
            "/orders/1",
            &[("x-lock-key", b"payments/o-1"), ("x_lock_proof", b"v1.x"), ("x_lockmesh_hold", b"1")],
        ),
        Some(ID),
    );
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert_eq!(p.remove, ["x_lock_proof", "x_lockmesh_hold"]);
    // ... and on the unlocked route, where nothing reaches the arbiter.
    let d = on_request_headers(&sidecar(), &h("GET", "/public/x", &[("x_lockmesh_unlocked", b"0")]), Some(BILLING));
    let Decision::Pass(p) = d else { panic!("{d:?}") };
    assert!(p.unlocked);
    assert_eq!(p.remove, ["x_lockmesh_unlocked"]);
}

#[test]
fn a_twin_of_a_lock_header_the_filter_reads_is_refused() {
    let refused = |cfg: &Config, hdrs: &[(String, Vec<u8>)], name: &str| {
        let d = on_request_headers(cfg, hdrs, Some(ID));
        let Decision::Reject { status, code, body } = d else { panic!("{name}: {d:?}") };
        assert_eq!((status, code), (400, Code::BadRequest), "{name}: {body}");
        assert!(body.contains(&format!("\\\"{name}\\\"")), "{name}: names what was sent: {body}");
    };
    for lock_header in headers::LOCK_HEADERS {
        let twin = lock_header.replace('-', "_");
        // Alone, and next to the real header (an ambiguity, not a second value).
        refused(&cfg(), &acq(&[(twin.as_str(), b"1")]), &twin);
        refused(&cfg(), &acq(&[("x-lock-key", b"payments/a"), (twin.as_str(), b"payments/a")]), &twin);
        // On a transparent route, locked or unlocked: the issue's forged token.
        refused(&sidecar(), &h("POST", "/orders/1", &[("x-lock-key", b"payments/o-1"), (twin.as_str(), b"1")]), &twin);
        refused(&sidecar(), &h("POST", "/public/1", &[(twin.as_str(), b"99999999999999999")]), &twin);
    }
    let d =
        on_request_headers(&sidecar(), &h("POST", "/public/1", &[("x_lock_token", b"99999999999999999")]), Some(ID));
    let Decision::Reject { body, .. } = d else { panic!("{d:?}") };
    assert!(!body.contains("99999"), "never the value: {body}");
    // Unauthenticated still comes first, and an unknown API route is still 404.
    let d = on_request_headers(&cfg(), &acq(&[("x_lock_key", b"payments/a")]), None);
    assert_eq!(http_status(&d), 401);
    assert_eq!(http_status(&on_request_headers(&cfg(), &h("GET", "/x", &[("x_lock_key", b"a/b")]), Some(ID))), 404);
}

#[test]
fn an_override_header_in_any_spelling_is_refused_on_every_route() {
    let spellings = [
        "x-original-url",
        "x_original_url",
        "X_ORIGINAL_URL",
        "x-original_url",
        "x-rewrite-url",
        "x_rewrite-url",
        "x-http-method-override",
        "x_http_method_override",
        "x-http_method-override",
        "x-http-method",
        "x_http_method",
        "x-method-override",
        "x_method_override",
        "X-Method-Override",
    ];
    let refused = |cfg: &Config, hdrs: &[(String, Vec<u8>)], name: &str| {
        let d = on_request_headers(cfg, hdrs, Some(ID));
        let Decision::Reject { status, code, body } = d else { panic!("{name}: {d:?}") };
        assert_eq!((status, code), (400, Code::BadRequest), "{name}: {body}");
        assert!(body.contains(&format!("\\\"{name}\\\"")), "{name}: names what was sent: {body}");
        assert!(body.contains("override header") && !body.contains("/orders/2"), "never the value: {body}");
    };
    for name in spellings {
        let v: &[u8] = if name.contains("url") || name.contains("URL") { b"/orders/2" } else { b"PUT" };
        // The unlocked route (the finding: /public served as a locked path), a
        // locked one, a bound one, and the lock API.
        refused(&sidecar(), &h("GET", "/public/info", &[(name, v)]), name);
        refused(&sidecar(), &h("POST", "/orders/1", &[("x-lock-key", b"payments/o-1"), (name, v)]), name);
        refused(&bound(), &h("GET", "/orders/1", &[(name, v)]), name);
        refused(&cfg(), &acq(&[("x-lock-key", b"payments/a"), (name, v)]), name);
    }
    // Headers that only look alike pass.
    for other in ["x-request-url", "x-original-host", "x-http-methods", "x-forwarded-method"] {
        let d = on_request_headers(&sidecar(), &h("GET", "/public/info", &[(other, b"/orders/2")]), Some(ID));
        assert!(matches!(d, Decision::Pass(_)), "{other}: {d:?}");
    }
    // Unauthenticated still comes first.
    let d = on_request_headers(&sidecar(), &h("GET", "/public/info", &[("x_original_url", b"/orders/2")]), None);
    assert_eq!(http_status(&d), 401);
}

/// The issue's bypasses and every other class the canon refuses, each with the
/// word its message must carry.
const NOT_CANONICAL: &[(&str, &str)] = &[
    ("/public/../orders/1", "'..' segment"),
    ("/public/./orders/1", "'..' segment"),
    ("/public/..", "'..' segment"),
    ("/public/..%2Forders/1", "encoded '/'"),
    ("/public%2F..%2Forders/1", "encoded '/'"),
    ("/public/%2e%2e/orders/1", "lower-case percent escape"),
    ("/public/%2E%2E/orders/1", "plain spelling"),
    ("/public/%2Eorders", "plain spelling"),
    ("/orders/%38", "plain spelling"),
    ("/public/..%5Corders/1", "encoded"),
    ("/public/%00/x", "NUL"),
    ("/public/%252E%252E/orders/1", "'%'"),
    ("/public/..\\orders/1", "backslash"),
    ("/public\\..\\orders", "backslash"),
    ("/public;x=1", "';' path parameter"),
    ("/orders/1;jsessionid=x", "';' path parameter"),
    ("//orders/1", "empty segment"),
    ("/public//orders", "empty segment"),
    ("http://app/orders/1", "origin form"),
    ("orders/1", "origin form"),
    ("*", "origin form"),
    ("", "empty"),
    ("/orders/1#x", "fragment"),
    ("/orders/1?x=1#y", "fragment"),
    ("/orders/1 x", "outside the path characters"),
    ("/orders/\u{e9}", "outside the path characters"),
    ("/orders/\t1", "outside the path characters"),
    ("/orders/%4", "malformed"),
];

#[test]
fn a_sidecar_refuses_every_path_not_in_canonical_form_before_matching_a_route() {
    for (path, why) in NOT_CANONICAL {
        // Unlocked route, locked route with a key, and an identity with no grant:
        // the same 400 naming the problem, whatever route the raw path would match.
        for (hdrs, id) in
            [(h("POST", path, &[]), BILLING), (h("POST", path, &[("x-lock-key", b"payments/order-1")]), ID)]
        {
            let d = on_request_headers(&sidecar(), &hdrs, Some(id));
            let Decision::Reject { status, code, body } = d else { panic!("{path:?}: {d:?}") };
            assert_eq!((status, code), (400, Code::BadRequest), "{path:?}: {body}");
            assert!(body.contains(":path: ") && body.contains(why), "{path:?}: wants {why:?}: {body}");
        }
    }
    // Unauthenticated still comes first.
    assert_eq!(http_status(&on_request_headers(&sidecar(), &h("GET", "/public/../x", &[]), None)), 401);
    // Too long a target, in bytes.
    let long = format!("/public/{}", "a".repeat(lockmesh_core::canon::MAX_TARGET_LEN));
    assert_eq!(http_status(&on_request_headers(&sidecar(), &h("GET", &long, &[]), Some(ID))), 400);
}

#[test]
fn canonical_paths_pass_and_match_on_segment_boundaries() {
    for path in ["/public", "/public/", "/public/x", "/public/x?y=1&z=%2F..", "/public/%20x", "/public/caf%C3%A9"] {
        let d = on_request_headers(&sidecar(), &h("GET", path, &[]), Some(BILLING));
        let Decision::Pass(p) = d else { panic!("{path:?}: {d:?}") };
        assert!(p.unlocked, "{path:?} is under /public");
    }
    for path in ["/public-old", "/publicx/1", "/Public/x", "/orders/1", "/", "/orders/", "/o?x=/public"] {
        let d = on_request_headers(&sidecar(), &h("GET", path, &[]), Some(BILLING));
        assert_eq!(http_status(&d), 428, "{path:?} is not under /public: a locked route");
    }
    let d = on_request_headers(&sidecar(), &h("POST", "/orders/1?a=b", &[("x-lock-key", b"payments/o-1")]), Some(ID));
    assert!(matches!(d, Decision::Pass(Pass { unlocked: false, .. })), "{d:?}");
}

#[test]
fn on_the_lock_tier_a_path_not_in_canonical_form_matches_no_api_route() {
    let key: &[(&str, &[u8])] = &[("x-lock-key", b"payments/a")];
    for path in [
        "/v1/locks/./acquire",
        "/v1/admin/../locks/acquire",
        "/v1/admin/%2E%2E/seal",
        "/v1/admin/..%2Fseal",
        "//v1/locks/acquire",
        "/v1/locks/acquire;x",
        "/v1/locks/acquire#x",
        "/v1/admin\\seal",
        "http://tier/v1/locks/acquire",
    ] {
        let d = on_request_headers(&cfg(), &h("POST", path, key), Some(b"spiffe://lockmesh.test/ns/ops/sa/admin"));
        assert_eq!(d, Decision::reject(Code::NotFound, "no such route"), "{path:?}");
    }
    assert_eq!(http_status(&on_request_headers(&cfg(), &h("POST", "/v1/locks/acquire?x=1", key), Some(ID))), 200);
}

fn bound() -> Config {
    crate::config::parse(
        br#"{"api": false, "transparent": {"arbiter_cluster": "lockmesh_arbiter",
              "routes": [{"path": "/orders/{id}", "key": "payments/order-{id}"},
                         {"path": "/t/{id}", "key": "payments/{header:x-tenant}/{id}"},
                         {"path_prefix": "/", "key": "payments/app"}]},
             "grants": [{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments"], "operations": ["acquire"]}]}"#,
    )
    .unwrap()
}

fn passed(cfg: &Config, hdrs: &[(String, Vec<u8>)]) -> Pass {
    match on_request_headers(cfg, hdrs, Some(ID)) {
        Decision::Pass(p) => p,
        d => panic!("{d:?}"),
    }
}

#[test]
fn a_bound_route_derives_the_key_and_sets_it_for_ext_proc_and_the_upstream() {
    let key = |k: &str| LockKey::parse(k.as_bytes()).unwrap();
    let p = passed(&bound(), &h("POST", "/orders/7", &[]));
    assert_eq!(p.key, Some(key("payments/order-7")));
    assert!(!p.unlocked && p.route.queues());
    assert_eq!(
        p.set,
        [(headers::KEY, "payments/order-7".to_owned()), (headers::FILTERED, headers::FILTER_PROTOCOL.to_owned())]
    );
    // The caller may send the same key (an SDK that always sends one).
    let p = passed(&bound(), &h("POST", "/orders/7?x=1", &[("x-lock-key", b"payments/order-7")]));
    assert_eq!(p.key, Some(key("payments/order-7")));
    // A prefix route with a literal key: one key for its whole subtree.
    assert_eq!(passed(&bound(), &h("GET", "/anything/else", &[])).key, Some(key("payments/app")));
    // One header variable, read under every spelling that folds to it.
    let p = passed(&bound(), &h("POST", "/t/9", &[("x-tenant", b"acme")]));
    assert_eq!(p.key, Some(key("payments/acme/9")));
}

#[test]
fn a_bound_route_refuses_another_key_and_requests_it_cannot_key() {
    let refused = |hdrs: Vec<(String, Vec<u8>)>, want: &str| {
        let d = on_request_headers(&bound(), &hdrs, Some(ID));
        let Decision::Reject { status, code, body } = d else { panic!("{want}: {d:?}") };
        assert_eq!((status, code), (400, Code::BadRequest), "{body}");
        assert!(body.contains(want), "wants {want:?}: {body}");
        assert!(!body.contains("order-7") && !body.contains("acme"), "no key, no header value: {body}");
    };
    // The issue's attack: another caller's key for order 7, or any other key.
    refused(h("POST", "/orders/7", &[("x-lock-key", b"payments/anything")]), "the one sent differs");
    refused(h("POST", "/orders/7", &[("x-lock-key", b"payments/order-8")]), "the one sent differs");
    // A segment that makes no valid key (an escape: '%' is not a key character).
    refused(h("POST", "/orders/%20x", &[]), "not a valid key");
    // The header variable: absent, repeated, or twinned with '_'.
    refused(h("POST", "/t/9", &[]), "header x-tenant must appear exactly once");
    refused(h("POST", "/t/9", &[("x-tenant", b"acme"), ("x-tenant", b"evil")]), "header x-tenant");
    refused(h("POST", "/t/9", &[("x-tenant", b"acme"), ("x_tenant", b"evil")]), "header x-tenant");
    refused(h("POST", "/t/9", &[("x-tenant", b"ac me/x\xff")]), "header x-tenant");
    // Outside the caller's grants: the one denial, on the derived key.
    let d = on_request_headers(&bound(), &h("POST", "/orders/7", &[]), Some(BILLING));
    assert_eq!(d, Decision::denied());
    // A non-canonical spelling of a bound path is refused before any key is derived.
    for p in ["/orders/%37", "/orders/./7", "/orders//7", "/x/../orders/7"] {
        assert_eq!(http_status(&on_request_headers(&bound(), &h("POST", p, &[]), Some(ID))), 400, "{p}");
    }
}

/// Spellings of order 7 (and values that wrap to 7) a caller may send instead of
/// `/orders/7`: under an untyped `{id}` several derive another key, so they never
/// wait for a holder of order 7's key.
pub(crate) const ORDER_7_VARIANTS: &[&str] = &[
    "/orders/07",
    "/orders/007",
    "/orders/00000000000000000007",
    "/orders/+7",
    "/orders/-7",
    "/orders/7.json",
    "/orders/7.",
    "/orders/7.0",
    "/orders/7,",
    "/orders/7~",
    "/orders/7:",
    "/orders/7@",
    "/orders/7=",
    "/orders/7-",
    "/orders/7_",
    "/orders/7e0",
    "/orders/0x7",
    "/orders/%37",
    "/orders/%2B7",
    "/orders/7%20",
    "/orders/7 ",
    "/orders/18446744073709551623",
    "/orders/07/",
    "/orders/+7/",
    "/orders/7.json/",
];

/// The shipped inbound sidecar's routes (`envoy-config/src/plugins.json`), with the
/// id placeholder as `id` (`{id}` untyped, `{id:uint}` typed).
fn shipped_shape(id: &str) -> Config {
    let doc = serde_json::json!({"api": false, "transparent": {"arbiter_cluster": "lockmesh_arbiter", "routes": [
        {"path": format!("/orders/{id}"), "key": "payments/order-{id}"},
        {"path": format!("/orders/{id}/"), "key": "payments/order-{id}"},
        {"path_prefix": "/", "caller_chooses_key": true},
        {"path_prefix": "/public", "allow_unlocked": true, "caller_chooses_key": true}]},
        "grants": [{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments"], "operations": ["acquire"]}]});
    crate::config::parse(doc.to_string().as_bytes()).unwrap()
}

/// How many variants pass with a key other than order 7's, and the refusals.
fn other_keys(cfg: &Config, extra: &[(&str, &[u8])]) -> (Vec<String>, Vec<(String, String)>) {
    let (mut other, mut refused) = (Vec::new(), Vec::new());
    for p in ORDER_7_VARIANTS {
        match on_request_headers(cfg, &h("POST", p, extra), Some(ID)) {
            Decision::Pass(pass) if pass.key.as_ref().map(LockKey::as_str) != Some("payments/order-7") => {
                other.push(format!("{p:?} -> {:?}", pass.key.as_ref().map(LockKey::as_str)));
            }
            Decision::Pass(_) => {}
            Decision::Reject { status, body, .. } => refused.push((p.to_string(), format!("{status} {body}"))),
        }
    }
    (other, refused)
}

#[test]
fn a_typed_id_refuses_every_other_spelling_of_the_order() {
    let typed = shipped_shape("{id:uint}");
    let p = passed(&typed, &h("POST", "/orders/7", &[]));
    assert_eq!(p.key.as_ref().map(LockKey::as_str), Some("payments/order-7"));
    assert_eq!(passed(&typed, &h("POST", "/orders/7/", &[])).key, p.key);
    assert_eq!(
        passed(&typed, &h("POST", "/orders/0", &[])).key.map(|k| k.as_str().to_owned()).as_deref(),
        Some("payments/order-0")
    );
    // With the caller's key, too: a mistyped id never falls to the `/` route where
    // the caller chooses.
    for extra in [&[][..], &[("x-lock-key", b"payments/anything".as_slice())][..]] {
        let (other, refused) = other_keys(&typed, extra);
        assert!(other.is_empty(), "derived another key: {other:#?}");
        assert_eq!(refused.len(), ORDER_7_VARIANTS.len());
        for (p, answer) in refused {
            assert!(answer.starts_with("400 "), "{p}: {answer}");
            // The canon refuses some first (`%37`, `%2B7`, a space); the rest name
            // the placeholder, never the value.
            assert!(answer.contains("\":path: "), "{p}: {answer}");
            if !answer.contains(":path: path segment {id} must be a uint") {
                assert!(["/orders/%37", "/orders/%2B7", "/orders/7 "].contains(&p.as_str()), "{p}: {answer}");
            }
            let seg = p.trim_start_matches("/orders/").trim_end_matches('/');
            assert!(!answer.contains(&format!("{seg}\"")) && !answer.contains(&format!(" {seg} ")), "{p}: {answer}");
        }
    }
}

/// The detector, on the untyped template the configs shipped before: most
/// variants lock a key other than order 7's.
#[test]
fn an_untyped_id_lets_other_spellings_derive_other_keys() {
    let (other, _) = other_keys(&shipped_shape("{id}"), &[]);
    assert_eq!(other.len(), 21, "{other:#?}");
    assert!(other.iter().any(|o| o == "\"/orders/07\" -> Some(\"payments/order-07\")"), "{other:#?}");
}
