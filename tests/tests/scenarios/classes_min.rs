//! Issue 2, minimal classes: the registry decides a key's class from the key;
//! `x-lock-class` may only confirm it, and a session carries holds of its own
//! class's TTL only.

use lockmesh_tests::Stack;

const ACQ: &str = "/v1/locks/acquire";

#[tokio::test]
async fn the_registry_decides_the_class_and_its_ttl() {
    let st = Stack::builder("classes-min").envoy_config("lock-tier").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    // The class comes from the key (longest prefix), with its TTL.
    let r = a.post(ACQ, &[("x-lock-key", "short/job")]).await.unwrap();
    assert_eq!(
        (r.code(), r.json["class"].as_str(), r.json["ttl_s"].as_u64()),
        (200, Some("short"), Some(3)),
        "{}",
        r.body
    );
    let r = a.post(ACQ, &[("x-lock-key", "payments/p")]).await.unwrap();
    assert_eq!((r.json["class"].as_str(), r.json["ttl_s"].as_u64()), (Some("default"), Some(15)), "{}", r.body);
    // A caller cannot choose another class.
    let r = a.post(ACQ, &[("x-lock-key", "payments/q"), ("x-lock-class", "short")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (400, Some("class_mismatch")), "{}", r.body);
    let r = a.post(ACQ, &[("x-lock-key", "payments/q"), ("x-lock-class", "default")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    // A session of class `short` (3 s) cannot carry a hold of class `default` (15 s).
    let s = a.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    let r = a.post(ACQ, &[("x-lock-key", "payments/r"), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (400, Some("session_class_mismatch")), "{}", r.body);
    let held = a.get("/v1/locks", &[("x-lock-key", "payments/r")]).await.unwrap();
    assert_eq!(held.json["holders"].as_array().map(Vec::len), Some(0), "{}", held.body);
    // An unknown class is refused when opening a session.
    let r = a.post("/v1/sessions", &[("x-lock-class", "nope")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (400, Some("bad_request")), "{}", r.body);
}

/// Polls the arbiter's `/status` until `done` holds for its `classes.registry`
/// (the reload task reads the file every second), at most 10 s.
async fn registry_status(st: &Stack, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (_, body) = st.arbiter(0).admin_get("/status").await.unwrap();
        let s: serde_json::Value = serde_json::from_str(&body).unwrap();
        let r = s["classes"]["registry"].clone();
        if done(&r) {
            return r;
        }
        assert!(tokio::time::Instant::now() < deadline, "registry status never changed: {r}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

const GOOD: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: short, prefixes: ["short"], ttl_s: TTL, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

#[tokio::test]
async fn a_bad_registry_file_is_refused_with_every_path_and_the_last_good_keeps_serving() {
    let st = Stack::builder("registry-reload")
        .envoy_config("lock-tier")
        .registry(GOOD.replace("TTL", "3"))
        .start()
        .await
        .unwrap();
    let file = st.arbiter(0).config_path().with_file_name("registry.yaml");
    let a = st.client("payments", "a").unwrap();
    // Three errors at once: a TTL under the floor, a zero limit, a fenced class
    // without its pause test.
    let bad = GOOD.replace("TTL", "1").replace(
        "  - { name: short",
        "  - { name: zero, prefixes: [\"payments/zero\"], max_holders: 0, enforcement: fenced }\n  - { name: short",
    );
    std::fs::write(&file, bad).unwrap();
    let r = registry_status(&st, |r| r["refused"].as_u64() == Some(1)).await;
    assert_eq!(r["valid"], false, "{r}");
    let errs: Vec<String> = r["errors"].as_array().unwrap().iter().map(|e| e.as_str().unwrap().to_owned()).collect();
    let paths: Vec<&str> = errs.iter().map(|e| e.split(": ").nth(1).unwrap()).collect();
    assert_eq!(
        paths,
        vec!["classes[1].max_holders", "classes[1].pause_test_result", "classes[2].ttl_s"],
        "every error with its field path: {errs:?}"
    );
    assert!(errs.iter().all(|e| e.starts_with(&format!("{}: ", file.display()))), "{errs:?}");
    let (_, m) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    assert!(m.lines().any(|l| l == "lockmesh_arbiter_registry_reload_errors 3"), "{m}");
    // The last good registry keeps serving: class short with its 3 s TTL, and no
    // class `zero` (its key falls to the default class).
    let r = a.post(ACQ, &[("x-lock-key", "short/after-bad")]).await.unwrap();
    assert_eq!((r.code(), r.json["class"].as_str(), r.json["ttl_s"].as_u64()), (200, Some("short"), Some(3)));
    let r = a.post(ACQ, &[("x-lock-key", "payments/zero/k")]).await.unwrap();
    assert_eq!((r.code(), r.json["class"].as_str()), (200, Some("default")), "{}", r.body);
    // A good file takes over at once; the new TTL applies to new sessions.
    std::fs::write(&file, GOOD.replace("TTL", "4")).unwrap();
    let r = registry_status(&st, |r| r["valid"] == true && r["reloads"].as_u64() == Some(1)).await;
    assert_eq!(r["errors"].as_array().map(Vec::len), Some(0), "{r}");
    let r = a.post(ACQ, &[("x-lock-key", "short/after-good")]).await.unwrap();
    assert_eq!((r.code(), r.json["ttl_s"].as_u64()), (200, Some(4)), "{}", r.body);
    let (_, m) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    assert!(m.lines().any(|l| l == "lockmesh_arbiter_registry_reload_errors 0"), "{m}");
}

#[tokio::test]
async fn the_arbiter_rechecks_lock_grants_the_filter_passed() {
    // The Envoy's filter lets every payments workload take payments/...; the
    // arbiter's registry grants only payments/a, and only under payments/a-only.
    let registry = format!(
        "{}grants:\n  - {{ identity: \"spiffe://lockmesh.test/ns/payments/sa/a\", prefixes: [\"payments/a-only\"], \
         operations: [acquire, inspect] }}\n",
        GOOD.replace("TTL", "3")
    );
    let st = Stack::builder("grant-recheck").envoy_config("lock-tier").registry(registry).start().await.unwrap();
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let r = a.post(ACQ, &[("x-lock-key", "payments/a-only/1")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    for (c, key) in [(&a, "payments/elsewhere"), (&b, "payments/a-only/2")] {
        let r = c.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
        assert_eq!((r.code(), r.json["code"].as_str()), (403, Some("denied")), "{key}: {}", r.body);
    }
    // The refusals came from the arbiter (the filter passed them on).
    let (_, m) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    let denied: u64 = m
        .lines()
        .filter(|l| l.starts_with("lockmesh_arbiter_requests_total{route=\"acquire\"") && l.contains("denied"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(denied, 2, "{m}");
    let held = a.get("/v1/locks", &[("x-lock-key", "payments/elsewhere")]).await.unwrap();
    assert_eq!(held.code(), 403, "{}", held.body);
}
