//! Issue 21 item 1: lock-delay (`lock_delay_s`, `lockmesh_lock::delay`). A key
//! whose holder's session expired stays ungrantable for the class's delay, on every
//! arbiter and across an arbiter restart, and no longer; a release, and the
//! holder's own session close, free it at once. With the grant's guard compare
//! planted away (`skip_lock_delay`) the expired key is granted at once.

use std::time::Duration;

use etcd_client::GetOptions;
use lockmesh_tests::{LockClient, Stack, StackBuilder};
use tokio::time::Instant;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

/// TTL 2 s, lock-delay 3 s.
const DELAY_MS: u64 = 3000;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: delayed, prefixes: ["payments/ld"], ttl_s: 2, lock_delay_s: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// Two arbiters, Envoy i talking to arbiter i only.
fn stack(name: &str) -> StackBuilder {
    Stack::builder(name).envoy_config("lock-tier").registry(REGISTRY).envoy_per_arbiter(2)
}

async fn holds(st: &Stack) -> i64 {
    let mut c = st.etcd().client().await.unwrap();
    let prefix = format!("{}/l/", st.root());
    c.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
}

/// Opens a session, acquires `key` on it and never renews it: the hold ends by
/// expiry. Returns when the test sees the hold gone (at most 100 ms after it went).
async fn hold_until_expired(st: &Stack, a: &LockClient, key: &str) -> Instant {
    let s = a.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(s.code(), 200, "{}", s.body);
    let sid = s.json["session"].as_str().unwrap().to_owned();
    let r = a.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let end = Instant::now() + Duration::from_secs(15);
    while holds(st).await > 0 {
        assert!(Instant::now() < end, "the hold did not expire");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Instant::now()
}

fn try_once(key: &str) -> [(&str, &str); 2] {
    [("x-lock-key", key), ("x-lock-wait-ms", "0")]
}

#[tokio::test]
async fn an_expired_holders_key_waits_out_its_delay_on_every_arbiter_and_across_a_restart() {
    let st = stack("lock-delay").start().await.unwrap();
    let a = st.client_at(0, "payments", "a").unwrap();
    let b = st.client_at(1, "payments", "b").unwrap();
    let key = "payments/ld/1";

    // A's session (through arbiter 0) expires; B (through arbiter 1) is refused
    // `lock_delay`, sees the time left, and is granted once the delay is over.
    let gone = hold_until_expired(&st, &a, key).await;
    let r = b.post(ACQ, &try_once(key)).await.unwrap();
    assert_eq!(
        (r.code(), r.json["code"].as_str(), r.json["reason"].as_str()),
        (409, Some("contended"), Some("lock_delay")),
        "{}",
        r.body
    );
    let info = b.get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
    let left = info.json["lock_delay_ms"].as_u64().unwrap_or_else(|| panic!("no lock_delay_ms: {}", info.body));
    assert!(left > 0 && left <= DELAY_MS, "{}", info.body);
    let r = b.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", "15000")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let waited = gone.elapsed();
    assert!(waited >= Duration::from_millis(DELAY_MS - 100), "granted {waited:?} after the expiry");
    assert!(waited < Duration::from_millis(DELAY_MS + 6000), "the delay lasted {waited:?}");
    let t = r.json["token"].as_str().unwrap();
    let rel = b.post(REL, &[("x-lock-key", key), ("x-lock-token", t)]).await.unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);

    // A release frees the key at once.
    let r = a.post(ACQ, &try_once(key)).await.unwrap();
    assert_eq!(r.code(), 200, "a released key is free at once: {}", r.body);
    let t = r.json["token"].as_str().unwrap();
    assert_eq!(a.post(REL, &[("x-lock-key", key), ("x-lock-token", t)]).await.unwrap().code(), 200);
    let r = b.post(ACQ, &try_once(key)).await.unwrap();
    assert_eq!(r.code(), 200, "after a release: {}", r.body);
    let t = r.json["token"].as_str().unwrap();
    assert_eq!(b.post(REL, &[("x-lock-key", key), ("x-lock-token", t)]).await.unwrap().code(), 200);

    // The holder's own session close is a release, not an expiry.
    let s = a.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    assert_eq!(a.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &sid)]).await.unwrap().code(), 200);
    assert_eq!(a.post("/v1/sessions/close", &[("x-lock-session", &sid)]).await.unwrap().code(), 200);
    let r = b.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", "1000")]).await.unwrap();
    assert_eq!(r.code(), 200, "after the holder closed its session: {}", r.body);
    let t = r.json["token"].as_str().unwrap();
    assert_eq!(b.post(REL, &[("x-lock-key", key), ("x-lock-token", t)]).await.unwrap().code(), 200);

    // A close that comes after the session expired is no release (the long gate's
    // finding): the arbiter that opened the session still has it cached and takes
    // the close, but writes no close marker for a dead session, so the expiry keeps
    // its delay.
    let s = a.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    assert_eq!(a.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &sid)]).await.unwrap().code(), 200);
    let end = Instant::now() + Duration::from_secs(15);
    while holds(&st).await > 0 {
        assert!(Instant::now() < end, "the hold did not expire");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let gone = Instant::now();
    let c = a.post("/v1/sessions/close", &[("x-lock-session", &sid)]).await.unwrap();
    assert_ne!(c.code(), 200, "closing an expired session: {}", c.body);
    let mut etcd = st.etcd().client().await.unwrap();
    let marker = etcd.get(format!("{}/x/{sid}", st.root()), None).await.unwrap();
    assert!(marker.kvs().is_empty(), "a close marker was written for an expired session");
    if gone.elapsed() < Duration::from_millis(DELAY_MS - 500) {
        let r = b.post(ACQ, &try_once(key)).await.unwrap();
        assert_eq!((r.code(), r.json["reason"].as_str()), (409, Some("lock_delay")), "after a late close: {}", r.body);
    }
    let r = b.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", "15000")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert!(gone.elapsed() >= Duration::from_millis(DELAY_MS - 100), "granted {:?} after the expiry", gone.elapsed());
    let t = r.json["token"].as_str().unwrap();
    assert_eq!(b.post(REL, &[("x-lock-key", key), ("x-lock-token", t)]).await.unwrap().code(), 200);

    // An expiry, then the arbiter B talks to restarts: the delay is etcd's, it holds.
    let gone = hold_until_expired(&st, &a, key).await;
    st.arbiter(1).kill();
    st.arbiter(1).restart().await.unwrap();
    if gone.elapsed() < Duration::from_millis(DELAY_MS - 500) {
        let r = b.post(ACQ, &try_once(key)).await.unwrap();
        assert_eq!((r.code(), r.json["reason"].as_str()), (409, Some("lock_delay")), "after a restart: {}", r.body);
    }
    let r = b.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", "15000")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert!(gone.elapsed() >= Duration::from_millis(DELAY_MS - 100), "granted {:?} after the expiry", gone.elapsed());
}

/// The planted twin: grants that skip the guard and the delay record
/// (`skip_lock_delay`) hand an expired holder's key to the next caller at once.
#[tokio::test]
async fn planted_without_the_lock_delay_compare_an_expired_key_is_granted_at_once() {
    let st = stack("lock-delay-planted")
        .arbiter_extra_yaml("test_faults: [skip_lock_delay]")
        .arbiter_env("LOCKMESH_TEST_FAULTS", "1")
        .start()
        .await
        .unwrap();
    let a = st.client_at(0, "payments", "a").unwrap();
    let b = st.client_at(1, "payments", "b").unwrap();
    let key = "payments/ld/2";
    let gone = hold_until_expired(&st, &a, key).await;
    let r = b.post(ACQ, &try_once(key)).await.unwrap();
    assert_eq!(r.code(), 200, "the planted arbiter grants inside the delay: {}", r.body);
    assert!(gone.elapsed() < Duration::from_millis(DELAY_MS), "{:?}", gone.elapsed());
}
