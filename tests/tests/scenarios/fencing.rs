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
    let doc: PauseTestResult = serde_yaml::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
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
