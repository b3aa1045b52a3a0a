//! Per-key limits of N holders (`max_holders`), checked from the store's own
//! revision-ordered history rather than from timings: replaying every put and
//! delete of the key's holder slots, never more than N exist at any revision.

use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use lockmesh_tests::Stack;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: short, prefixes: ["short"], ttl_s: 3, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pool, prefixes: ["payments/pool"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// Replays the holder history of every key under the root and returns, per key
/// digest, the largest number of simultaneous holders.
///
/// The replay ends at a barrier key this test puts under its own root, and the
/// watch covers the whole root, so the last event it waits for is one of its
/// own: the shared etcd's current revision is no end, since another test's
/// write can be the last one and no event of this root ever reaches it.
async fn max_concurrent(st: &Stack, from: i64) -> std::collections::HashMap<String, usize> {
    let mut c = st.etcd().client().await.unwrap();
    let root = format!("{}/", st.root());
    let prefix = format!("{}/l/", st.root());
    let barrier = format!("{}/test/semaphore-barrier", st.root());
    let opts = WatchOptions::new().with_prefix().with_start_revision(from).with_prev_key();
    let mut w = c.watch(root.as_str(), Some(opts)).await.unwrap();
    let put = c.put(barrier.as_str(), "end", None).await.unwrap();
    let end = put.header().unwrap().revision();
    let mut held: std::collections::HashMap<String, std::collections::HashSet<Vec<u8>>> = Default::default();
    let mut max: std::collections::HashMap<String, usize> = Default::default();
    let mut seen = from;
    while seen < end {
        let r = tokio::time::timeout(Duration::from_secs(10), w.message()).await.unwrap().unwrap().unwrap();
        for e in r.events() {
            let kv = e.kv().unwrap();
            seen = seen.max(kv.mod_revision());
            if !kv.key().starts_with(prefix.as_bytes()) || kv.mod_revision() > end {
                continue;
            }
            let k = String::from_utf8_lossy(kv.key()).into_owned();
            let digest = k.split("/h/").next().unwrap().to_owned();
            let set = held.entry(digest.clone()).or_default();
            match e.event_type() {
                EventType::Put => {
                    set.insert(kv.key().to_vec());
                }
                EventType::Delete => {
                    set.remove(kv.key());
                }
            }
            let m = max.entry(digest).or_default();
            *m = (*m).max(set.len());
        }
    }
    max
}

async fn race(st: &Stack, key: &'static str, clients: usize, rounds: usize) {
    let mut tasks = Vec::new();
    for i in 0..clients {
        let c = st.client("payments", &format!("c{i}")).unwrap();
        tasks.push(tokio::spawn(async move {
            let s = c.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
            let sid = s.json["session"].as_str().unwrap().to_owned();
            for _ in 0..rounds {
                let r = c
                    .post(
                        "/v1/locks/acquire",
                        &[("x-lock-key", key), ("x-lock-session", &sid), ("x-lock-wait-ms", "30000")],
                    )
                    .await
                    .unwrap();
                assert_eq!(r.code(), 200, "{}", r.body);
                let t = r.json["token"].as_str().unwrap().to_owned();
                tokio::time::sleep(Duration::from_millis(150)).await;
                let rel = c
                    .post("/v1/locks/release", &[("x-lock-key", key), ("x-lock-token", &t), ("x-lock-session", &sid)])
                    .await
                    .unwrap();
                assert_eq!(rel.code(), 200, "{}", rel.body);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

async fn start_revision(st: &Stack) -> i64 {
    let mut c = st.etcd().client().await.unwrap();
    c.get("x", None).await.unwrap().header().unwrap().revision() + 1
}

#[tokio::test]
async fn never_more_than_n_holders_under_32_racing_clients() {
    let st = Stack::builder("sem-race").envoy_config("lock-tier").registry(REGISTRY).start().await.unwrap();
    let from = start_revision(&st).await;
    let (r3, r1) = tokio::join!(race(&st, "payments/pool/a", 32, 3), race(&st, "payments/mutex-a", 32, 2));
    let _ = (r3, r1);
    // The pool key reached its limit (the race was real) and never passed it; the
    // mutex never had two holders.
    let seen = max_concurrent(&st, from).await;
    let mut maxima: Vec<usize> = seen.values().copied().collect();
    maxima.sort_unstable();
    assert_eq!(maxima, vec![1, 3], "max simultaneous holders per key (mutex, pool of 3): {seen:?}");
    let c = st.client("payments", "x").unwrap();
    let r = c.get("/v1/locks", &[("x-lock-key", "payments/pool/a")]).await.unwrap();
    assert_eq!(r.json["max_holders"], 3, "{}", r.body);
}

#[tokio::test]
async fn a_full_pool_gates_and_a_release_admits_the_next() {
    let st = Stack::builder("sem-gate").envoy_config("lock-tier").registry(REGISTRY).start().await.unwrap();
    let c = st.client("payments", "a").unwrap();
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let r = c.post("/v1/locks/acquire", &[("x-lock-key", "payments/pool/b")]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        tokens.push(r.json["token"].as_str().unwrap().to_owned());
    }
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", "payments/pool/b")]).await.unwrap();
    assert_eq!((r.code(), r.json["reason"].as_str()), (409, Some("key_gated")), "{}", r.body);
    let rel =
        c.post("/v1/locks/release", &[("x-lock-key", "payments/pool/b"), ("x-lock-token", &tokens[1])]).await.unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", "payments/pool/b")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t4: u64 = r.json["token"].as_str().unwrap().parse().unwrap();
    assert!(tokens.iter().all(|t| t.parse::<u64>().unwrap() < t4));
}
