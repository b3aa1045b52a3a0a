//! Issue 5, item 7: durable fairness (ADR-14). Waiters of a `fairness: durable`
//! class queue as etcd keys and are granted in create-revision order across
//! arbiters; a waiter that leaves is removed at once and one whose arbiter died
//! vanishes with that arbiter's waiter lease: neither stalls the queue. Every order
//! is read from etcd's revisions, not from timings.

use std::time::Duration;

use etcd_client::{GetOptions, SortOrder, SortTarget};
use lockmesh_core::{FencingToken, LockKey};
use lockmesh_tests::{LockClient, Resp, Stack};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const KEY: &str = "payments/fair/k";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: fair, prefixes: ["payments/fair"], ttl_s: 15, fairness: durable, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// Three Envoys over two arbiters: Envoy i reaches only arbiter i % 2, so the
/// waiters sit on both arbiters and meet only in etcd.
async fn stack(name: &str) -> Stack {
    Stack::builder(name)
        .envoy_config("lock-tier")
        .registry(REGISTRY)
        .arbiters(2)
        .envoy_arbiters(0, &[0])
        .envoy_arbiters(1, &[1])
        .envoy_arbiters(2, &[0])
        .start()
        .await
        .unwrap()
}

/// The key's durable waiters as (owner identity, create revision), oldest first.
async fn waiters(st: &Stack) -> Vec<(String, i64)> {
    let mut etcd = st.etcd().client().await.unwrap();
    let d = LockKey::parse(KEY.as_bytes()).unwrap().digest();
    let opts = GetOptions::new().with_prefix().with_sort(SortTarget::Create, SortOrder::Ascend);
    let r = etcd.get(format!("{}/q/{d}/", st.root()), Some(opts)).await.unwrap();
    r.kvs()
        .iter()
        .map(|kv| {
            let v: serde_json::Value = serde_json::from_slice(kv.value()).unwrap();
            (v["owner"].as_str().unwrap().to_owned(), kv.create_revision())
        })
        .collect()
}

async fn waiters_reach(st: &Stack, n: usize) -> Vec<(String, i64)> {
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let w = waiters(st).await;
        if w.len() == n {
            return w;
        }
        assert!(tokio::time::Instant::now() < until, "expected {n} durable waiters, etcd has {w:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn token(r: &Resp) -> FencingToken {
    r.json["token"].as_str().unwrap().parse().unwrap()
}

async fn release(c: &LockClient, r: &Resp) {
    let (t, s) = (token(r).to_string(), r.json["session"].as_str().unwrap().to_owned());
    let r = c.post(REL, &[("x-lock-key", KEY), ("x-lock-token", &t), ("x-lock-session", &s)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
}

fn spawn_acquire(c: LockClient) -> tokio::task::JoinHandle<Resp> {
    tokio::spawn(async move { c.post(ACQ, &[("x-lock-key", KEY), ("x-lock-wait-ms", "25000")]).await.unwrap() })
}

fn spiffe(sa: &str) -> String {
    format!("spiffe://{}/ns/payments/sa/{sa}", lockmesh_tests::TEST_TRUST_DOMAIN)
}

#[tokio::test]
async fn durable_waiters_are_granted_in_queue_order_and_a_departed_one_is_gone_at_once() {
    let st = stack("durable-order").await;
    let h = st.client_at(0, "payments", "h").unwrap();
    let held = h.post(ACQ, &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(held.code(), 200, "{}", held.body);
    // w1 (arbiter 0), w2 (arbiter 1), w3 (arbiter 0): queued in that order.
    let mut tasks = Vec::new();
    for (i, (envoy, sa)) in [(0, "w1"), (1, "w2"), (2, "w3")].into_iter().enumerate() {
        tasks.push(spawn_acquire(st.client_at(envoy, "payments", sa).unwrap()));
        waiters_reach(&st, i + 1).await;
    }
    let queued = waiters(&st).await;
    let owners: Vec<&str> = queued.iter().map(|(o, _)| o.as_str()).collect();
    assert_eq!(owners, [spiffe("w1"), spiffe("w2"), spiffe("w3")], "{queued:?}");

    // w2 gives up (its caller disconnects): its key goes at once, not at a lease's
    // end; the revision of its delete precedes the holder's release.
    tasks.remove(1).abort();
    let left = waiters_reach(&st, 2).await;
    assert_eq!(left.iter().map(|(o, _)| o.clone()).collect::<Vec<_>>(), [spiffe("w1"), spiffe("w3")]);

    // A newcomer with a long wait joins behind them even on an idle arbiter's
    // Envoy, and a try-once is refused while the queue is not empty.
    let late = st.client_at(1, "payments", "w4").unwrap();
    let r = late.post(ACQ, &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(r.code(), 409, "{}", r.body);
    tasks.push(spawn_acquire(st.client_at(1, "payments", "w4").unwrap()));
    waiters_reach(&st, 3).await;

    // Releases walk the queue: each grantee releases at once.
    release(&h, &held).await;
    let mut grants = Vec::new();
    for (task, sa, envoy) in [(0, "w1", 0), (0, "w3", 2), (0, "w4", 1)] {
        let r = tasks.remove(task).await.unwrap();
        assert_eq!(r.code(), 200, "{sa}: {}", r.body);
        grants.push((sa, token(&r)));
        release(&st.client_at(envoy, "payments", sa).unwrap(), &r).await;
    }
    assert!(grants.windows(2).all(|w| w[0].1 < w[1].1), "granted in queue order: {grants:?}");
    assert!(grants[0].1 > token(&held));
    assert!(waiters(&st).await.is_empty(), "no waiter key left behind");
}

#[tokio::test]
async fn a_killed_arbiters_waiters_vanish_with_its_waiter_lease() {
    let st = stack("durable-kill").await;
    let h = st.client_at(0, "payments", "h").unwrap();
    let held = h.post(ACQ, &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(held.code(), 200, "{}", held.body);
    let doomed = spawn_acquire(st.client_at(1, "payments", "w1").unwrap());
    waiters_reach(&st, 1).await;
    let next = spawn_acquire(st.client_at(0, "payments", "w2").unwrap());
    waiters_reach(&st, 2).await;
    // Arbiter 1 dies with w1 queued first: w1's key goes with the arbiter's waiter
    // lease (3 s TTL), well before any session of the class (15 s) could end.
    let killed = tokio::time::Instant::now();
    st.arbiter(1).kill();
    let left = waiters_reach(&st, 1).await;
    assert_eq!(left[0].0, spiffe("w2"));
    assert!(killed.elapsed() < Duration::from_secs(12), "the dead arbiter's waiter stayed {:?}", killed.elapsed());
    release(&h, &held).await;
    let r = next.await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert!(token(&r) > token(&held));
    release(&st.client_at(0, "payments", "w2").unwrap(), &r).await;
    let r = doomed.await.unwrap();
    assert_ne!(r.code(), 200, "the dead arbiter's waiter is never granted: {}", r.body);
}
