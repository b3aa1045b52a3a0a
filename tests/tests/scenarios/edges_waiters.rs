//! Issue 18, item 3: durable waiter keys never outlive their waiter for long
//! (`lock::durable`, "Orphans"). A waiter key on an arbiter's waiter lease that
//! no waiter of that arbiter owns (its delete failed, or its put timed out yet
//! committed) used to stay as long as the arbiter ran, ahead of every later
//! arrival; now the arbiter's sweep deletes it.

use std::time::Duration;

use etcd_client::{GetOptions, PutOptions, SortOrder, SortTarget};
use lockmesh_core::LockKey;
use lockmesh_tests::{Resp, Stack};
use tokio::time::Instant;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const KEY: &str = "payments/fair/orphan";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: fair, prefixes: ["payments/fair"], ttl_s: 15, fairness: durable, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// The key's durable waiters as (etcd key, lease), oldest first.
async fn waiters(st: &Stack) -> Vec<(String, i64)> {
    let mut etcd = st.etcd().client().await.unwrap();
    let d = LockKey::parse(KEY.as_bytes()).unwrap().digest();
    let opts = GetOptions::new().with_prefix().with_sort(SortTarget::Create, SortOrder::Ascend);
    let r = etcd.get(format!("{}/q/{d}/", st.root()), Some(opts)).await.unwrap();
    r.kvs().iter().map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.lease())).collect()
}

async fn waiters_reach(st: &Stack, n: usize, within: Duration) -> Vec<(String, i64)> {
    let until = Instant::now() + within;
    loop {
        let w = waiters(st).await;
        if w.len() == n {
            return w;
        }
        assert!(Instant::now() < until, "expected {n} durable waiters within {within:?}, etcd has {w:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn token(r: &Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token in {}", r.body)).parse().unwrap()
}

/// The state a waiter whose put timed out but committed leaves (or one whose
/// delete failed): a waiter key on the arbiter's live waiter lease that no
/// waiter owns. The scenario writes it as such a put would (same lease, name
/// shape and record) and then checks that a later arrival is granted once the
/// holder releases, well within its wait: the orphan is swept, not waited on.
/// Against the arbiter before the sweep (commit 9841528's parent) the newcomer
/// was answered 409 `key_gated` at its deadline, the orphan still first.
#[tokio::test]
async fn an_orphaned_durable_waiter_key_is_swept_and_never_blocks_the_queue() {
    let st = Stack::builder("edges-orphan").envoy_config("lock-tier").registry(REGISTRY).start().await.unwrap();
    let h = st.client("payments", "h").unwrap();
    let held = h.post(ACQ, &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(held.code(), 200, "{}", held.body);

    // A real waiter shows the arbiter's waiter lease and key shape.
    let w1 = st.client("payments", "w1").unwrap();
    let first = tokio::spawn(async move { w1.post(ACQ, &[("x-lock-key", KEY), ("x-lock-wait-ms", "25000")]).await });
    let queued = waiters_reach(&st, 1, Duration::from_secs(15)).await;
    let (w1_key, lease) = queued[0].clone();
    let (prefix, name) = w1_key.rsplit_once('/').unwrap();
    let (lease_hex, _) = name.split_once('-').unwrap();
    assert_eq!(i64::from_str_radix(lease_hex, 16).unwrap(), lease, "waiter keys are named after their lease");

    // The orphan: queued after w1 on the same lease, with a sequence this
    // arbiter has not reached (so it is no waiter's key).
    let orphan = format!("{prefix}/{lease_hex}-00000000fffffff0");
    let record = format!(
        r#"{{"owner":"spiffe://{}/ns/payments/sa/ghost","session":"000000000000002a"}}"#,
        lockmesh_tests::TEST_TRUST_DOMAIN
    );
    let mut etcd = st.etcd().client().await.unwrap();
    etcd.put(orphan.as_str(), record, Some(PutOptions::new().with_lease(lease))).await.unwrap();
    let planted = Instant::now();

    // w1 leaves (its caller disconnects): its key goes, the orphan is now first.
    first.abort();
    let left = waiters_reach(&st, 1, Duration::from_secs(10)).await;
    assert_eq!(left[0].0, orphan, "only the orphan is left: {left:?}");

    // The holder releases; a newcomer waits up to 20 s. Before the sweep it
    // queued behind the orphan until its deadline (409); now it is granted.
    let rel = h
        .post(
            REL,
            &[
                ("x-lock-key", KEY),
                ("x-lock-token", &token(&held).to_string()),
                ("x-lock-session", held.json["session"].as_str().unwrap()),
            ],
        )
        .await
        .unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    let w2 = st.client("payments", "w2").unwrap();
    let r = w2.post(ACQ, &[("x-lock-key", KEY), ("x-lock-wait-ms", "20000")]).await.unwrap();
    assert_eq!(r.code(), 200, "the newcomer queued behind the orphan: {}", r.body);
    assert!(token(&r) > token(&held));
    let swept = planted.elapsed();
    // The sweep runs at least every 10 renewals of the waiter lease (1 s each).
    assert!(swept < Duration::from_secs(18), "the orphan blocked the queue for {swept:?}");
    assert!(waiters(&st).await.iter().all(|(k, _)| *k != orphan), "the orphan key was deleted");
}
