//! Issue 20: the next head of a mutex key this arbiter granted waits for the
//! holder's release without reading the key first, but only when that read could
//! not have answered it: the hold is another session's and another caller's, and
//! the key's limit is 1 by the policy cache while the policy watch keeps that cache
//! fresh (`lockmesh_lock::policy_watch`). Each read shows in the arbiter's step
//! counter `lockmesh_arbiter_etcd_steps_total{step="held_read"}`, so the
//! scenarios count reads; what the reads decide (an idempotent re-acquire, a leak,
//! a limit raised by `lockctl limit`) is asserted from the answers.
//!
//! Planted: `skip_read_for_anyone` (the holder's own session and caller skip the
//! read too) and `policy_watch_keeps_cache` (the watch sees a limit change but
//! keeps the cache); each is caught by the read count its control asserts.

use std::time::Duration;

use lockmesh_tests::{Resp, Stack};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const KEY: &str = "payments/memo/k";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

const READS: &str = "lockmesh_arbiter_etcd_steps_total{step=\"held_read\"}";
const GRANTED: &str = "lockmesh_arbiter_handoffs_total{outcome=\"granted\"}";

async fn stack(name: &str, fault: Option<&str>) -> Stack {
    let mut b = Stack::builder(name).envoy_config("lock-tier").registry(REGISTRY);
    if let Some(f) = fault {
        b = b.arbiter_extra_yaml(format!("test_faults: [{f}]")).arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    b.start().await.unwrap()
}

/// A metric's value on arbiter 0 (0 when absent).
async fn metric(st: &Stack, line_prefix: &str) -> u64 {
    st.arbiter(0).metric(line_prefix).await.unwrap().unwrap_or(0.0) as u64
}

/// Waits (10 s at most) until `line_prefix` on arbiter 0 reaches `n`.
async fn metric_reaches(st: &Stack, line_prefix: &str, n: u64) {
    metric_until(st, line_prefix, |v| v >= n).await;
}

/// Waits (10 s at most) until the value of `line_prefix` on arbiter 0 satisfies `ok`.
async fn metric_until(st: &Stack, line_prefix: &str, ok: impl Fn(u64) -> bool) {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while !ok(metric(st, line_prefix).await) {
        assert!(tokio::time::Instant::now() < until, "{line_prefix} did not reach its value within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn field(r: &Resp, name: &str) -> String {
    r.json[name].as_str().unwrap_or_else(|| panic!("no {name}: {}", r.body)).to_owned()
}

/// Starts the arbiter's policy watch (its first acquire does) and waits until it
/// is open, then takes and releases a key of the class, so the policy cache holds
/// the class's limit read under the open watch.
async fn watch_open(st: &Stack) {
    let a = st.client("payments", "warm").unwrap();
    for _ in 0..2 {
        let r = a.post(ACQ, &[("x-lock-key", "payments/memo/warm")]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let (t, s) = (field(&r, "token"), field(&r, "session"));
        let r =
            a.post(REL, &[("x-lock-key", "payments/memo/warm"), ("x-lock-token", &t), ("x-lock-session", &s)]).await;
        assert_eq!(r.unwrap().code(), 200);
        metric_reaches(st, "lockmesh_arbiter_policy_watches_open ", 1).await;
    }
}

/// Opens a session for client `c` (with `instance`, if any).
async fn session(c: &lockmesh_tests::client::LockClient, instance: Option<&str>) -> String {
    let mut h = vec![("x-lock-key", KEY)];
    if let Some(i) = instance {
        h.push(("x-lock-instance", i));
    }
    let r = c.post("/v1/sessions", &h).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    field(&r, "session")
}

/// The reads the next heads made: (another caller's head, the holder's own
/// session re-acquiring, the holder's caller and instance on another session).
struct Reads {
    other: u64,
    own: u64,
    leak: u64,
}

/// A (caller a, instance pod-1, its own session) holds KEY, granted here. B (another
/// caller, its own session) waits for it and is handed it by A's release; then B
/// re-acquires on its own session (existing), and B's caller and instance (pod-2)
/// acquire on a new session (`leaked`). Returns the reads each made.
async fn next_heads(fault: Option<&str>) -> Reads {
    let st = stack(&format!("held-memo-{}", fault.unwrap_or("ok")), fault).await;
    watch_open(&st).await;
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let sa = session(&a, Some("pod-1")).await;
    let r = a.post(ACQ, &[("x-lock-key", KEY), ("x-lock-session", &sa), ("x-lock-instance", "pod-1")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let ta = field(&r, "token");

    // Another caller's head: waits with no read, and is handed the key.
    let sb = session(&b, Some("pod-2")).await;
    let (reads, granted) = (metric(&st, READS).await, metric(&st, GRANTED).await);
    let b2 = st.client("payments", "b").unwrap();
    let sb2 = sb.clone();
    let waiter = tokio::spawn(async move {
        let h = [("x-lock-key", KEY), ("x-lock-session", sb2.as_str()), ("x-lock-instance", "pod-2")];
        b2.post(ACQ, &[h[0], h[1], h[2], ("x-lock-wait-ms", "20000")]).await
    });
    metric_reaches(&st, "lockmesh_arbiter_handoff_offers ", 1).await;
    let other = metric(&st, READS).await - reads;
    let h = [("x-lock-key", KEY), ("x-lock-token", ta.as_str()), ("x-lock-session", sa.as_str())];
    let r = a.post(REL, &[h[0], h[1], h[2], ("x-lock-instance", "pod-1")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let rb = waiter.await.unwrap().unwrap();
    assert_eq!(rb.code(), 200, "{}", rb.body);
    assert_eq!(metric(&st, GRANTED).await, granted + 1, "B was handed the key by A's release");
    let tb = field(&rb, "token");
    assert!(tb.parse::<u64>().unwrap() > ta.parse::<u64>().unwrap());

    // The holder's own session: an idempotent re-acquire, answered with its hold.
    let reads = metric(&st, READS).await;
    let h = [("x-lock-key", KEY), ("x-lock-session", sb.as_str()), ("x-lock-instance", "pod-2")];
    let again = b.post(ACQ, &[h[0], h[1], h[2], ("x-lock-wait-ms", "20000")]).await.unwrap();
    let own = metric(&st, READS).await - reads;
    assert_eq!(again.code(), 200, "{}", again.body);
    assert_eq!((again.json["existing"].as_bool(), field(&again, "token")), (Some(true), tb.clone()), "{}", again.body);

    // The holder's caller and instance on another session: a leak, named.
    let sb3 = session(&b, Some("pod-2")).await;
    let reads = metric(&st, READS).await;
    let h = [("x-lock-key", KEY), ("x-lock-session", sb3.as_str()), ("x-lock-instance", "pod-2")];
    let leaked = b.post(ACQ, &[h[0], h[1], h[2], ("x-lock-wait-ms", "20000")]).await.unwrap();
    let leak = metric(&st, READS).await - reads;
    assert_eq!((leaked.code(), leaked.json["code"].as_str()), (409, Some("leaked")), "{}", leaked.body);
    Reads { other, own, leak }
}

#[tokio::test]
async fn the_next_head_reads_only_when_the_read_could_answer_it() {
    let r = next_heads(None).await;
    assert_eq!(r.other, 0, "another caller's head read the key it can only wait for");
    assert_eq!(r.own, 1, "the holder's own session did not read its hold");
    assert_eq!(r.leak, 1, "the holder's caller and instance did not read the hold");
}

#[tokio::test]
async fn planted_a_head_that_skips_the_read_for_its_own_hold_is_caught() {
    let r = next_heads(Some("skip_read_for_anyone")).await;
    assert_eq!(r.other, 0);
    assert_eq!((r.own, r.leak), (0, 0), "the planted head read its own hold");
}

/// A holds KEY (limit 1, granted here; the cache says 1 under the open watch). The
/// class's policy record is raised to 3 in etcd (as `lockctl limit` leaves it),
/// and once the watch has seen it, B's acquire must read the limit (the cache was
/// dropped) and be granted beside A at once. Returns B's reads.
async fn raised_limit(fault: Option<&str>) -> u64 {
    let st = stack(&format!("held-memo-limit-{}", fault.unwrap_or("ok")), fault).await;
    watch_open(&st).await;
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let r = a.post(ACQ, &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let events = metric(&st, "lockmesh_arbiter_policy_watch_events_total ").await;
    assert_eq!(st.write_class_limit("default", 3).await.unwrap(), 1);
    metric_reaches(&st, "lockmesh_arbiter_policy_watch_events_total ", events + 1).await;
    let sb = session(&b, None).await;
    let reads = metric(&st, READS).await;
    let second = b.post(ACQ, &[("x-lock-key", KEY), ("x-lock-session", &sb), ("x-lock-wait-ms", "20000")]).await;
    let second = second.unwrap();
    let read = metric(&st, READS).await - reads;
    assert_eq!(second.code(), 200, "under the authoritative limit 3: {}", second.body);
    let h = a.get("/v1/locks", &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(h.json["holders"].as_array().map(Vec::len), Some(2), "{}", h.body);
    read
}

#[tokio::test]
async fn a_limit_raised_under_the_policy_watch_is_read_by_the_next_head() {
    assert_eq!(raised_limit(None).await, 1, "the head waited on a cached limit the watch had seen change");
}

#[tokio::test]
async fn planted_a_policy_watch_that_keeps_the_cache_is_caught() {
    assert_eq!(raised_limit(Some("policy_watch_keeps_cache")).await, 0, "the planted head read the limit");
}

/// A (its own session) holds KEY, granted here, so the arbiter notes the grant for
/// the next head. A's lease is then revoked straight in etcd, as an expiry ends a
/// hold: nothing passes through the arbiter, whose quota ledger sees the hold's
/// delete. B's acquire must then find the key free and be granted without being
/// made to wait (no gated waiter: `lockmesh_arbiter_wakeups_per_grant` records a
/// grant only for a key with a gated waiter). Returns how many such grants B's
/// acquire recorded.
async fn hold_ended_elsewhere(fault: Option<&str>) -> u64 {
    const WAITED: &str = "lockmesh_arbiter_wakeups_per_grant_count";
    let st = stack(&format!("held-memo-ended-{}", fault.unwrap_or("ok")), fault).await;
    watch_open(&st).await;
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let sa = session(&a, None).await;
    let r = a.post(ACQ, &[("x-lock-key", KEY), ("x-lock-session", &sa)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    metric_reaches(&st, "lockmesh_arbiter_open_holds{", 1).await;
    let mut etcd = st.etcd().client().await.unwrap();
    etcd.lease_revoke(i64::from_str_radix(&sa, 16).unwrap()).await.unwrap();
    // The ledger has seen A's hold end.
    metric_until(&st, "lockmesh_arbiter_open_holds{", |v| v == 0).await;
    let sb = session(&b, None).await;
    let waited = metric(&st, WAITED).await;
    let r = b.post(ACQ, &[("x-lock-key", KEY), ("x-lock-session", &sb), ("x-lock-wait-ms", "20000")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    metric(&st, WAITED).await - waited
}

#[tokio::test]
async fn a_hold_that_ended_elsewhere_does_not_make_the_next_head_wait() {
    assert_eq!(hold_ended_elsewhere(None).await, 0, "B waited for a hold the arbiter had seen end");
}

#[tokio::test]
async fn planted_a_noted_grant_kept_after_its_hold_ended_is_caught() {
    assert_eq!(hold_ended_elsewhere(Some("keep_ended_held")).await, 1, "the planted B was not made to wait");
}

/// A (header-only: its acquire opens its session) holds KEY, granted here. B,
/// another caller, header-only too, waits for it: its acquire offers the record of
/// the session it opened, and A's release hands the key over in its transaction,
/// which puts that record beside B's hold. Returns the grant transactions B's
/// acquire ran (the record used to cost B a refused grant first) and the status
/// of B's release by the session it was answered.
async fn header_only_handed(fault: Option<&str>) -> (u64, u16) {
    const GRANT_TXNS: &str = "lockmesh_arbiter_etcd_steps_total{step=\"grant_txn\"}";
    let st = stack(&format!("held-memo-header-only-{}", fault.unwrap_or("ok")), fault).await;
    watch_open(&st).await;
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let r = a.post(ACQ, &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let (ta, sa) = (field(&r, "token"), field(&r, "session"));

    let (txns, granted) = (metric(&st, GRANT_TXNS).await, metric(&st, GRANTED).await);
    let b2 = st.client("payments", "b").unwrap();
    let waiter = tokio::spawn(async move { b2.post(ACQ, &[("x-lock-key", KEY), ("x-lock-wait-ms", "20000")]).await });
    metric_reaches(&st, "lockmesh_arbiter_handoff_offers ", 1).await;
    let r = a.post(REL, &[("x-lock-key", KEY), ("x-lock-token", &ta), ("x-lock-session", &sa)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let rb = waiter.await.unwrap().unwrap();
    assert_eq!(rb.code(), 200, "{}", rb.body);
    assert_eq!(metric(&st, GRANTED).await, granted + 1, "B was handed the key by A's release");
    let by_b = metric(&st, GRANT_TXNS).await - txns;
    let (tb, sb) = (field(&rb, "token"), field(&rb, "session"));
    assert_ne!(sb, sa, "B got a session of its own");
    assert!(tb.parse::<u64>().unwrap() > ta.parse::<u64>().unwrap());

    // Another caller cannot use B's session; B releases by it.
    let h = [("x-lock-key", KEY), ("x-lock-token", tb.as_str()), ("x-lock-session", sb.as_str())];
    let stolen = a.post(REL, &h).await.unwrap();
    assert_ne!(stolen.code(), 200, "A released B's hold by B's session: {}", stolen.body);
    let released = b.post(REL, &h).await.unwrap();
    (by_b, released.code())
}

#[tokio::test]
async fn a_header_only_waiter_is_handed_the_key_with_its_session() {
    let (by_b, released) = header_only_handed(None).await;
    assert_eq!(by_b, 0, "B ran a grant transaction of its own before the hand-off");
    assert_eq!(released, 200, "B could not release by the session the hand-off opened");
}

#[tokio::test]
async fn planted_a_hand_off_that_drops_the_waiters_session_record_is_caught() {
    let (by_b, released) = header_only_handed(Some("handoff_drops_record")).await;
    assert_eq!(by_b, 0);
    assert_ne!(released, 200, "the planted hand-off left a session B could still release by");
}
