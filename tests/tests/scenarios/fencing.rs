//! Issue 6: enforcement at the resource. Grant proofs signed by the arbiter,
//! ValidateToken, fence-proxy in front of a real HTTP store with real grants, and
//! the pause test kit (SIGSTOP past the TTL) against the fence and the bare store.

use std::time::Duration;

use lockmesh_core::pause::{check_pause_result, PauseTestResult, Verdict};
use lockmesh_tests::{
    client::{LockClient, Resp},
    fence::{ensure_signing_key, pausekit_bin, FenceProxyProcess, KvStore, SigningKey},
    Stack,
};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const VALIDATE: &str = "/v1/tokens/validate";

/// The test payments identity also gets `validate` (the shipped grants do not).
const PAYMENTS_GRANT: &str = r#"{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments", "short"], "operations": ["acquire", "inspect"]}"#;
const PAYMENTS_GRANT_VALIDATE: &str = r#"{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments", "short"], "operations": ["acquire", "inspect", "validate"]}"#;

async fn signed_stack(name: &str) -> (Stack, SigningKey, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let st = Stack::builder(name)
        .envoy_config("lock-tier")
        .envoy_replace(PAYMENTS_GRANT, PAYMENTS_GRANT_VALIDATE)
        .arbiter_extra_yaml(key.arbiter_yaml())
        .start()
        .await
        .unwrap();
    (st, key, dir)
}

fn field(r: &Resp, f: &str) -> String {
    r.json[f].as_str().unwrap_or_else(|| panic!("no {f} in {}", r.body)).to_owned()
}

async fn acquire(c: &LockClient, key: &str) -> (String, String) {
    let r = c.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", "10000")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let proof = field(&r, "proof");
    assert_eq!(r.header("x-lock-proof"), Some(proof.as_str()));
    (field(&r, "token"), proof)
}

async fn validate(c: &LockClient, key: &str, token: &str) -> bool {
    let r = c.post(VALIDATE, &[("x-lock-key", key), ("x-lock-token", token)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    r.json["current"].as_bool().unwrap_or_else(|| panic!("no current in {}", r.body))
}

#[tokio::test]
async fn acquire_carries_a_proof_and_validate_tells_current_from_stale() {
    let (st, _key, _dir) = signed_stack("fence-validate").await;
    let a = st.client("payments", "a").unwrap();
    let k = "payments/validate-1";
    let (t1, p1) = acquire(&a, k).await;
    assert!(p1.starts_with("v1.dev1."), "proof form: {p1}");
    assert!(!p1.contains(k), "the proof never carries the raw key");
    assert!(validate(&a, k, &t1).await, "the current grant validates");
    assert!(!validate(&a, "payments/validate-other", &t1).await, "a token of another key is not current there");
    let rel = a.post(REL, &[("x-lock-key", k), ("x-lock-token", &t1)]).await.unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    assert!(!validate(&a, k, &t1).await, "a released grant is not current");
    let (t2, _) = acquire(&a, k).await;
    assert!(t2.parse::<u64>().unwrap() > t1.parse::<u64>().unwrap());
    assert!(!validate(&a, k, &t1).await, "the stale grant stays stale after the re-acquire");
    assert!(validate(&a, k, &t2).await);
    let r = a.post(VALIDATE, &[("x-lock-key", k)]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (400, Some("bad_request")), "{}", r.body);
}

async fn fence_for(store: &KvStore, key: &SigningKey) -> FenceProxyProcess {
    FenceProxyProcess::builder(store.port())
        .trust(&key.kid, &key.pub_file)
        .routes(
            "routes:\n  - name: items\n    path: /items/{id}\n    reads: [GET, HEAD]\n    resource: \"items/{id}\"\n    lock_key: \"payments/items/{id}\"\n  - name: short\n    path: /short/{id}\n    reads: [GET]\n    resource: \"short/{id}\"\n    lock_key: \"short/{id}\"",
        )
        .start()
        .await
        .unwrap()
}

async fn put(url: &str, token: &str, proof: &str, body: &str) -> (u16, String) {
    let r = reqwest::Client::new()
        .put(url)
        .header("x-lock-token", token)
        .header("x-lock-proof", proof)
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let code = r.headers().get("x-lockmesh-error").map(|v| v.to_str().unwrap_or_default().to_owned());
    (r.status().as_u16(), code.unwrap_or_default())
}

#[tokio::test]
async fn real_grants_through_the_fence_another_lock_and_a_stale_grant_are_refused() {
    let (st, key, _dir) = signed_stack("fence-grants").await;
    let store = KvStore::start().await.unwrap();
    let fence = fence_for(&store, &key).await;
    let a = st.client("payments", "a").unwrap();
    let (t1, p1) = acquire(&a, "payments/items/1").await;
    let (t2, p2) = acquire(&a, "payments/items/2").await;
    assert!(t2.parse::<u64>().unwrap() > t1.parse::<u64>().unwrap());
    let url = format!("{}/items/1", fence.url());
    // A genuine, higher grant of another lock under the guarded resource.
    assert_eq!(put(&url, &t2, &p2, "other-lock").await, (403, "wrong_key".into()));
    assert!(store.requests().is_empty(), "the store saw a refused write");
    assert_eq!(put(&url, &t1, &p1, "v1").await.0, 200);
    assert_eq!(store.get("/items/1").as_deref(), Some("v1"));
    a.post(REL, &[("x-lock-key", "payments/items/1"), ("x-lock-token", &t1)]).await.unwrap();
    let (t3, p3) = acquire(&a, "payments/items/1").await;
    assert_eq!(put(&url, &t3, &p3, "v3").await.0, 200);
    assert_eq!(put(&url, &t1, &p1, "stale").await, (409, "stale_token".into()));
    assert_eq!(store.get("/items/1").as_deref(), Some("v3"));
    assert!(store.requests().iter().all(|r| r.body != "stale" && r.body != "other-lock"));
    // The store receives the token, never the proof.
    let seen = &store.requests()[1];
    assert!(seen.headers.iter().any(|(k, v)| k == "x-lock-token" && *v == t3));
    assert!(!seen.headers.iter().any(|(k, _)| k == "x-lock-proof"));
}

async fn run_kit(st: &Stack, resource_url: &str, lock_key: &str, out: &std::path::Path) -> (i32, PauseTestResult) {
    let cert = st.pki().client("payments", "pausekit").unwrap();
    let status = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(pausekit_bin().unwrap())
            .arg("run")
            .args(["--lock-url", &format!("https://localhost:{}", st.envoy().listener_port())])
            .arg("--ca")
            .arg(st.pki().ca_cert_path())
            .arg("--cert")
            .arg(&cert.cert_path)
            .arg("--key")
            .arg(&cert.key_path)
            .args(["--lock-key", lock_key, "--resource-url", resource_url])
            .arg("--out")
            .arg(out)
            .status(),
    )
    .await
    .expect("the pause kit finishes within 60 s")
    .unwrap();
    let doc: PauseTestResult = serde_saphyr::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    (status.code().unwrap_or(-1), doc)
}

#[tokio::test]
async fn the_pause_kit_passes_behind_fence_proxy_and_fails_against_the_bare_store() {
    let (st, key, dir) = signed_stack("fence-pause").await;
    let store = KvStore::start().await.unwrap();
    let fence = fence_for(&store, &key).await;
    let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();

    // Behind the fence: the frozen holder's late write is refused, the store never sees it.
    let out = dir.path().join("fenced.yaml");
    let (code, doc) = run_kit(&st, &format!("{}/short/p1", fence.url()), "short/p1", &out).await;
    assert_eq!(code, 0, "{doc:#?}");
    assert_eq!(doc.verdict, Verdict::Pass);
    assert_eq!(doc.class, "short");
    assert_eq!(doc.evidence.late_write_status, 409, "{doc:#?}");
    assert!(doc.evidence.paused_ms > doc.evidence.ttl_s * 1000);
    assert!(!store.requests().iter().any(|r| r.body.ends_with("-late")), "the store saw the late write");
    assert!(store.get("/short/p1").unwrap().ends_with("-second"));
    assert_eq!(check_pause_result(&doc, "short", now()), Ok(()));
    assert!(check_pause_result(&doc, "default", now()).is_err());

    // The same store without the fence: the late write lands and the kit fails.
    let out = dir.path().join("bare.yaml");
    let bare = format!("http://127.0.0.1:{}/short/p2", store.port());
    let (code, doc) = run_kit(&st, &bare, "short/p2", &out).await;
    assert_eq!(code, 1, "{doc:#?}");
    assert_eq!(doc.verdict, Verdict::Fail);
    assert!(doc.evidence.resource_saw_late_write, "{doc:#?}");
    assert!(store.get("/short/p2").unwrap().ends_with("-late"));
    assert!(check_pause_result(&doc, "short", now()).is_err());
}

// --- fence-proxy alone (a real process in front of a real HTTP store) ---------

fn minter(key: &SigningKey) -> ed25519_dalek::SigningKey {
    use ed25519_dalek::pkcs8::DecodePrivateKey as _;
    ed25519_dalek::SigningKey::from_pkcs8_pem(&std::fs::read_to_string(&key.key_file).unwrap()).unwrap()
}

fn mint(k: &ed25519_dalek::SigningKey, lock_key: &str, token: u64) -> String {
    use lockmesh_core::{proof, ClassName, FencingToken, LockKey};
    let c = proof::GrantClaims::new(
        &LockKey::parse(lock_key.as_bytes()).unwrap(),
        FencingToken::from_packed(token).unwrap(),
        ClassName::parse("default").unwrap(),
    );
    proof::sign(k, &proof::KeyId::parse("dev1").unwrap(), &c)
}

async fn send(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut r = reqwest::Client::new().request(method.parse().unwrap(), url).body(body.to_owned());
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    let code = r.headers().get("x-lockmesh-error").map(|v| v.to_str().unwrap_or_default().to_owned());
    (r.status().as_u16(), code.unwrap_or_default())
}

const ALLOW_ROUTES: &str = "routes:\n  - name: items\n    path: /items/{id}\n    reads: [GET]\n    resource: \"items/{id}\"\n    lock_key: \"payments/items/{id}\"\n  - name: logs\n    path: /logs/{id}\n    resource: \"logs/{id}\"\n    lock_key: \"payments/logs/{id}\"\n    equal: allow";

async fn fence_alone(
    marks: Option<&std::path::Path>,
) -> (KvStore, FenceProxyProcess, ed25519_dalek::SigningKey, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let store = KvStore::start().await.unwrap();
    let mut b = FenceProxyProcess::builder(store.port()).trust(&key.kid, &key.pub_file).routes(ALLOW_ROUTES);
    if let Some(m) = marks {
        b = b.marks_dir(m);
    }
    let fence = b.start().await.unwrap();
    let k = minter(&key);
    (store, fence, k, dir)
}

#[tokio::test]
async fn missing_garbage_oversized_forged_and_unsigned_grants_are_refused_and_leave_the_mark() {
    let (store, fence, k, _dir) = fence_alone(None).await;
    let url = format!("{}/items/1", fence.url());
    let big = (1u64 << 50) + 5;
    let forged = mint(&ed25519_dalek::SigningKey::from_bytes(&[3; 32]), "payments/items/1", big);
    let oversized = format!("v1.dev1.{}.x", "A".repeat(600));
    type Case<'a> = (Vec<(&'a str, &'a str)>, u16, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (vec![], 428, "grant_required"),
        (vec![("x-lock-token", "999999")], 428, "grant_required"),
        (vec![("x-lock-proof", "garbage")], 400, "bad_token"),
        (vec![("x-lock-proof", &oversized)], 400, "bad_token"),
        (vec![("x-lock-proof", &forged)], 403, "bad_proof"),
    ];
    for (h, status, code) in &cases {
        assert_eq!(send("PUT", &url, h, "x").await, (*status, (*code).to_owned()), "{h:?}");
    }
    assert!(store.requests().is_empty(), "a refused write reached the store");
    // The forged large token did not raise the mark: a small genuine one still writes.
    let p = mint(&k, "payments/items/1", 7);
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p)], "ok7").await.0, 200);
    assert_eq!(store.get("/items/1").as_deref(), Some("ok7"));
}

#[tokio::test]
async fn unlisted_routes_and_methods_are_writes_and_reads_pass_through() {
    let (store, fence, k, _dir) = fence_alone(None).await;
    let base = fence.url();
    assert_eq!(send("GET", &format!("{base}/items/1"), &[], "").await.0, 404, "a read passes through to the store");
    assert_eq!(send("GET", &format!("{base}/other"), &[], "").await, (403, "unlisted_route".into()));
    assert_eq!(send("DELETE", &format!("{base}/items/1"), &[], "").await, (428, "grant_required".into()));
    assert_eq!(send("GET", &format!("{base}/logs/1"), &[], "").await, (428, "grant_required".into()));
    let p = mint(&k, "payments/items/1", 9);
    assert_eq!(send("DELETE", &format!("{base}/items/1"), &[("x-lock-proof", &p)], "").await.0, 200);
    assert_eq!(store.requests().len(), 2, "only the read and the granted delete reached the store");
}

#[tokio::test]
async fn strict_refuses_an_equal_token_and_allow_accepts_it() {
    let (store, fence, k, _dir) = fence_alone(None).await;
    let base = fence.url();
    let p = mint(&k, "payments/items/1", 20);
    assert_eq!(send("PUT", &format!("{base}/items/1"), &[("x-lock-proof", &p)], "a").await.0, 200);
    assert_eq!(
        send("PUT", &format!("{base}/items/1"), &[("x-lock-proof", &p)], "b").await,
        (409, "stale_token".into())
    );
    let p = mint(&k, "payments/logs/1", 20);
    assert_eq!(send("PUT", &format!("{base}/logs/1"), &[("x-lock-proof", &p)], "a").await.0, 200);
    assert_eq!(send("PUT", &format!("{base}/logs/1"), &[("x-lock-proof", &p)], "b").await.0, 200);
    let p = mint(&k, "payments/logs/1", 19);
    assert_eq!(send("PUT", &format!("{base}/logs/1"), &[("x-lock-proof", &p)], "c").await, (409, "stale_token".into()));
    assert_eq!((store.get("/items/1").as_deref(), store.get("/logs/1").as_deref()), (Some("a"), Some("b")));
}

#[tokio::test]
async fn marks_survive_a_restart_and_a_second_fence_on_the_same_marks_is_refused() {
    let marks = tempfile::tempdir().unwrap();
    let (store, fence, k, dir) = fence_alone(Some(marks.path())).await;
    let url = format!("{}/items/1", fence.url());
    let p10 = mint(&k, "payments/items/1", 10);
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p10)], "ten").await.0, 200);
    // A second fence-proxy on the same marks volume refuses to start.
    let key = ensure_signing_key(dir.path()).unwrap();
    let second = FenceProxyProcess::builder(store.port())
        .trust(&key.kid, &key.pub_file)
        .routes(ALLOW_ROUTES)
        .marks_dir(marks.path())
        .start()
        .await;
    assert!(second.is_err(), "a second fence on the same marks started");
    fence.restart().await.unwrap();
    let p9 = mint(&k, "payments/items/1", 9);
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p9)], "nine").await, (409, "stale_token".into()));
    assert_eq!(store.get("/items/1").as_deref(), Some("ten"));
}

#[tokio::test]
async fn concurrent_writes_to_one_resource_are_serialised() {
    let (store, fence, k, _dir) = fence_alone(None).await;
    let url = format!("{}/logs/1", fence.url());
    let writes = (1..=8u64).map(|t| {
        let (url, p) = (url.clone(), mint(&k, "payments/logs/1", 100 + t));
        async move { send("PUT", &url, &[("x-lock-proof", &p), ("x-test-delay-ms", "150")], &t.to_string()).await }
    });
    let results = futures::future::join_all(writes).await;
    assert!(results.iter().all(|(s, _)| *s == 200 || *s == 409), "{results:?}");
    assert_eq!(store.max_in_flight(), 1, "two writes to one resource were in the store at once");
    // Forwarded writes reached the store in increasing token order.
    let seen: Vec<u64> = store.requests().iter().map(|r| r.body.parse().unwrap()).collect();
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    // Different resources are not serialised against each other.
    let other = format!("{}/logs/2", fence.url());
    let (p2, p1) = (mint(&k, "payments/logs/2", 5), mint(&k, "payments/logs/1", 500));
    let (h2, h1) = (
        [("x-lock-proof", p2.as_str()), ("x-test-delay-ms", "300")],
        [("x-lock-proof", p1.as_str()), ("x-test-delay-ms", "300")],
    );
    let (a, b) = tokio::join!(send("PUT", &other, &h2, "x"), send("PUT", &url, &h1, "y"));
    assert_eq!((a.0, b.0), (200, 200));
    assert_eq!(store.max_in_flight(), 2);
}

#[tokio::test]
async fn store_down_answers_store_unavailable_and_nothing_is_forwarded_later() {
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let dead = lockmesh_tests::free_port();
    let fence =
        FenceProxyProcess::builder(dead).trust(&key.kid, &key.pub_file).routes(ALLOW_ROUTES).start().await.unwrap();
    let p = mint(&minter(&key), "payments/items/1", 30);
    assert_eq!(
        send("PUT", &format!("{}/items/1", fence.url()), &[("x-lock-proof", &p)], "x").await,
        (502, "store_unavailable".into())
    );
    // Strict: the mark advanced before forwarding, so the grant is used up.
    assert_eq!(
        send("PUT", &format!("{}/items/1", fence.url()), &[("x-lock-proof", &p)], "x").await,
        (409, "stale_token".into())
    );
    let (code, metrics) = fence.admin_get("/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(metrics.contains("outcome=\"store_unavailable\"") && !metrics.contains("items/1"), "{metrics}");
}

#[tokio::test]
async fn fence_proxy_takes_its_addresses_from_the_lockmesh_fence_env_over_its_file() {
    // The file names decoy ports, a dead upstream and another marks directory; the
    // LOCKMESH_FENCE_* variables (as the injector sets them) name the real ones.
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let store = KvStore::start().await.unwrap();
    let fence = FenceProxyProcess::builder(store.port())
        .trust(&key.kid, &key.pub_file)
        .routes(ALLOW_ROUTES)
        .addresses_from_env()
        .start()
        .await
        .expect("ready on the admin address of LOCKMESH_FENCE_ADMIN_LISTEN");
    let p = mint(&minter(&key), "payments/items/1", 40);
    let url = format!("{}/items/1", fence.url());
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p)], "via-env").await.0, 200);
    assert_eq!(store.get("/items/1").as_deref(), Some("via-env"), "forwarded to LOCKMESH_FENCE_UPSTREAM");
    assert!(fence.marks_dir().join("marks.redb").is_file(), "marks in LOCKMESH_FENCE_MARKS_DIR");
    let decoy = fence.config_path().parent().unwrap().join("decoy-marks");
    assert!(!decoy.exists(), "the file's marks_dir was used");
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p)], "again").await, (409, "stale_token".into()));
}

#[tokio::test]
async fn a_store_that_does_not_answer_in_time_gets_store_timeout_quarantine_and_the_strict_grant_is_used_up() {
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let store = KvStore::start().await.unwrap();
    let fence = FenceProxyProcess::builder(store.port())
        .trust(&key.kid, &key.pub_file)
        .routes(ALLOW_ROUTES)
        .upstream_timeout_ms(300)
        .start()
        .await
        .unwrap();
    let k = minter(&key);
    let url = format!("{}/items/1", fence.url());
    let p = mint(&k, "payments/items/1", 50);
    let started = tokio::time::Instant::now();
    let slow = [("x-lock-proof", p.as_str()), ("x-test-delay-ms", "1500")];
    assert_eq!(send("PUT", &url, &slow, "slow").await, (504, "store_timeout".into()));
    assert!(started.elapsed() < Duration::from_millis(1400), "answered after {:?}", started.elapsed());
    // The store did receive it: whether it landed is unknown to the client.
    assert!(store.requests().iter().any(|r| r.body == "slow"));
    // It may still land: the resource is quarantined until the store answers it, and
    // a later grant's write is refused meanwhile, not handed to the store.
    let p2 = mint(&k, "payments/items/1", 51);
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p2)], "early").await, (503, "fence_quarantined".into()));
    assert!(!store.requests().iter().any(|r| r.body == "early"));
    // The store answers the slow write (at 1.5 s): the quarantine lifts.
    tokio::time::sleep(Duration::from_millis(1500).saturating_sub(started.elapsed()) + Duration::from_millis(300))
        .await;
    // The mark advanced before forwarding: under strict the same grant is used up ...
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p)], "retry").await, (409, "stale_token".into()));
    // ... and the next grant writes (the quarantine did not touch the mark).
    assert_eq!(send("PUT", &url, &[("x-lock-proof", &p2)], "next").await.0, 200);
    let (_, metrics) = fence.admin_get("/metrics").await.unwrap();
    assert!(metrics.contains("outcome=\"store_timeout\"} 1"), "{metrics}");
    assert!(metrics.contains("outcome=\"fence_quarantined\"} 1"), "{metrics}");
}

#[tokio::test]
async fn validate_token_over_its_rate_gets_429_rate_limited_through_envoy() {
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let st = Stack::builder("fence-validate-rate")
        .envoy_config("lock-tier")
        .envoy_replace(PAYMENTS_GRANT, PAYMENTS_GRANT_VALIDATE)
        .arbiter_extra_yaml(key.arbiter_yaml())
        .arbiter_extra_yaml("validate_rate_per_s: 2")
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/validate-rate";
    let (t, _) = acquire(&a, k).await;
    let mut answers = Vec::new();
    for _ in 0..6 {
        answers.push(a.post(VALIDATE, &[("x-lock-key", k), ("x-lock-token", &t)]).await.unwrap());
    }
    let ok = answers.iter().filter(|r| r.code() == 200).count();
    let limited: Vec<&Resp> = answers.iter().filter(|r| r.code() == 429).collect();
    assert!((1..=3).contains(&ok), "the burst is the rate (2, +1 refill at most): {ok} answered 200");
    assert_eq!(ok + limited.len(), answers.len(), "only 200 or 429");
    let r = limited.first().expect("no request was rate limited");
    assert_eq!((r.json["code"].as_str(), r.header("x-lockmesh-error")), (Some("rate_limited"), Some("rate_limited")));
    assert_eq!(r.header("retry-after"), Some("1"), "{}", r.body);
    // Acquire is not rate limited by it, and the bucket refills.
    let a2 = a.post(ACQ, &[("x-lock-key", "payments/validate-rate-2")]).await.unwrap();
    assert_eq!(a2.code(), 200, "{}", a2.body);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(validate(&a, k, &t).await, "the bucket refilled");
}
