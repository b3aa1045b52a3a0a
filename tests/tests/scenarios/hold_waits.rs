//! Issue 21 item 4 (ADR-033): the oldest hold, gated waits and wake-ups in view.
//! On real processes (etcd, two arbiters, two Envoys routing to the first): a hold's
//! age in `lockmesh_arbiter_oldest_hold_seconds` grows with it, is the oldest
//! open hold's (not a younger one's) and is the same on the arbiter that granted
//! nothing (fleet-wide); two acquires queued behind it show in
//! `lockmesh_arbiter_gated_waiters` and `lockmesh_arbiter_oldest_gated_wait_seconds`
//! on the arbiter they wait at only (per arbiter); after the releases each grant
//! they got is one `lockmesh_arbiter_wakeups_per_grant` observation with at least
//! one wake-up, and one `lockmesh_arbiter_pickup_latency_seconds` observation no
//! longer than from the release's request to the waiter's answer; the console
//! shows the same figures by namespace and class (in Chromium); the exposition
//! passes promtool and names no key. Every age is checked against the interval
//! the test itself measured (request sent to answer received), never a speed.
//!
//! The planted twin (`oldest_hold_newest`: the ledger reports the newest open
//! hold as the oldest) fails the oldest-hold check as soon as a younger hold of
//! the same class exists.

use std::time::Duration;

use lockmesh_devcerts::jwt::Issuer;
use lockmesh_load::prom;
use lockmesh_tests::{LockClient, Stack};
use serde_json::Value;
use tokio::time::Instant;

use super::console::{cells, operator_token, operators_yaml, render, row, section};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const ISS: &str = "https://idp.holds.test";
/// The metrics' labels of every key here: the registry names `payments`.
const PAIR: &str = "{namespace=\"payments\",class=\"pay\"}";
/// Raw keys: never in a metric nor in the console's answer.
const K1: &str = "payments/hold-waits/secret-first";
const K2: &str = "payments/hold-waits/secret-second";
/// What the arbiter's clock and ours may disagree by over a few seconds, plus the
/// metric's millisecond rounding.
const SLACK: f64 = 0.05;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pay, prefixes: [payments], ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

/// One `/metrics` read: its text and when it was asked for and answered.
struct Scrape {
    text: String,
    sent: Instant,
    recv: Instant,
}

impl Scrape {
    /// The value of `family{namespace="payments",class="pay"}`.
    fn value(&self, family: &str) -> f64 {
        let prefix = format!("{family}{PAIR} ");
        let line = self.text.lines().find(|l| l.starts_with(&prefix));
        line.and_then(|l| l[prefix.len()..].parse().ok()).unwrap_or_else(|| panic!("no {prefix}in\n{}", self.text))
    }
}

async fn scrape(st: &Stack, i: usize) -> Scrape {
    let sent = Instant::now();
    let (code, text) = st.arbiter(i).admin_get("/metrics").await.unwrap();
    assert_eq!(code, 200, "{text}");
    Scrape { text, sent, recv: Instant::now() }
}

/// A grant as the test saw it: request sent, answer received.
#[derive(Clone, Copy)]
struct Seen {
    sent: Instant,
    recv: Instant,
}

async fn acquire(c: &LockClient, key: &str, wait_ms: &str) -> (String, Seen) {
    let sent = Instant::now();
    let r = c.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", wait_ms)]).await.unwrap();
    let recv = Instant::now();
    assert_eq!(r.code(), 200, "{key}: {}", r.body);
    (r.json["token"].as_str().unwrap().to_owned(), Seen { sent, recv })
}

async fn release(c: &LockClient, key: &str, token: &str) -> Instant {
    let sent = Instant::now();
    let r = c.post(REL, &[("x-lock-key", key), ("x-lock-token", token)]).await.unwrap();
    assert_eq!(r.code(), 200, "{key}: {}", r.body);
    sent
}

/// The oldest-hold age `age` (seconds) read by `s` is that of a hold granted
/// within `g`: at least from `g`'s answer to the scrape's request, at most from
/// `g`'s request to the scrape's answer.
fn age_of(age: f64, s: &Scrape, g: Seen, what: &str) -> Result<(), String> {
    let low = s.sent.saturating_duration_since(g.recv).as_secs_f64() - SLACK;
    let high = s.recv.duration_since(g.sent).as_secs_f64() + SLACK;
    if age < low || age > high {
        return Err(format!("oldest hold age {age} s is not {what}'s: outside [{low:.3}, {high:.3}] s"));
    }
    Ok(())
}

/// Waits until arbiter `i` reports `family` at `want` for the pair; returns that scrape.
async fn until(st: &Stack, i: usize, family: &str, want: f64) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = scrape(st, i).await;
        if s.value(family) == want {
            return s;
        }
        assert!(Instant::now() < deadline, "arbiter {i}: {family}{PAIR} not {want} within 10 s:\n{}", s.text);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Holds K1, then, at least 1.5 s later, K2 (both in the pair), and reads the
/// oldest hold once both are followed: `Ok` when arbiter 0 reports K1's age.
async fn oldest_of_two(st: &Stack, a: &LockClient) -> (Result<(), String>, [(String, Seen); 2]) {
    let first = acquire(a, K1, "0").await;
    until(st, 0, "lockmesh_arbiter_open_holds", 1.0).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = acquire(a, K2, "0").await;
    let s = until(st, 0, "lockmesh_arbiter_open_holds", 2.0).await;
    (age_of(s.value("lockmesh_arbiter_oldest_hold_seconds"), &s, first.1, "the first hold"), [first, second])
}

#[tokio::test]
async fn the_oldest_hold_gated_waiters_wakeups_and_pickups_show_by_namespace_and_class() {
    let dir = tempfile::tempdir().unwrap();
    let idp = Issuer::generate("k1").unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, idp.jwks()).unwrap();
    let st = Stack::builder("hold-waits")
        .envoy_config("lock-tier")
        .registry(REGISTRY)
        .arbiters(2)
        // Two Envoys, both to arbiter 0 only: a filter passes one acquire of a key
        // at a time per worker to the arbiter, so each waiter comes through its own
        // Envoy. Arbiter 1 serves nothing.
        .envoy_arbiters(0, &[0])
        .envoy_arbiters(1, &[0])
        .arbiter_extra_yaml(operators_yaml(&jwks, ISS))
        .start()
        .await
        .unwrap();
    let (a, b, c) = (
        st.client("payments", "hw-a").unwrap(),
        st.client("payments", "hw-b").unwrap(),
        st.client_at(1, "payments", "hw-c").unwrap(),
    );
    let oldest = "lockmesh_arbiter_oldest_hold_seconds";
    // Nothing held yet: the pair the registry declares is there at 0.
    let s = scrape(&st, 0).await;
    assert_eq!((s.value(oldest), s.value("lockmesh_arbiter_gated_waiters")), (0.0, 0.0));

    // The oldest hold is K1's, not the younger K2's, on both arbiters (arbiter 1
    // granted nothing: it follows the holds by its own watch), and it grows.
    let (checked, [(t1, g1), (t2, g2)]) = oldest_of_two(&st, &a).await;
    checked.unwrap();
    let before = scrape(&st, 0).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = scrape(&st, 0).await;
    age_of(after.value(oldest), &after, g1, "the first hold").unwrap();
    let grew = after.value(oldest) - before.value(oldest);
    let at_least = after.sent.duration_since(before.recv).as_secs_f64() - SLACK;
    assert!(grew >= at_least, "the oldest hold grew {grew} s in at least {at_least} s");
    let other = until(&st, 1, "lockmesh_arbiter_open_holds", 2.0).await;
    age_of(other.value(oldest), &other, g1, "the first hold (arbiter 1)").unwrap();

    // Two acquires wait for K1: gated at arbiter 0 (Envoy's), none at arbiter 1.
    let waiter = |c: LockClient| {
        tokio::spawn(async move {
            let sent = Instant::now();
            let r = c.post(ACQ, &[("x-lock-key", K1), ("x-lock-wait-ms", "30000")]).await.unwrap();
            (r, Seen { sent, recv: Instant::now() })
        })
    };
    let waits_from = Instant::now();
    let (mut wb, mut wc) = (waiter(b.clone()), waiter(c.clone()));
    let seen_two = until(&st, 0, "lockmesh_arbiter_gated_waiters", 2.0).await;
    assert_eq!(scrape(&st, 1).await.value("lockmesh_arbiter_gated_waiters"), 0.0, "gated waiters are per arbiter");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let s = scrape(&st, 0).await;
    let waited = s.value("lockmesh_arbiter_oldest_gated_wait_seconds");
    let (low, high) = (
        s.sent.duration_since(seen_two.recv).as_secs_f64() - SLACK,
        s.recv.duration_since(waits_from).as_secs_f64() + SLACK,
    );
    assert!(waited >= low && waited <= high, "oldest gated wait {waited} s outside [{low:.3}, {high:.3}] s");
    let (wakes0, grants0) =
        (s.value("lockmesh_arbiter_wakeups_per_grant_sum"), s.value("lockmesh_arbiter_wakeups_per_grant_count"));
    let (pickup0, pickups0) = (
        s.value("lockmesh_arbiter_pickup_latency_seconds_sum"),
        s.value("lockmesh_arbiter_pickup_latency_seconds_count"),
    );

    // The console, in Chromium and in its API: the pair's row while both wait.
    let admin = st.arbiter(0).admin_port();
    let token = operator_token(&idp, ISS, "alice");
    let asking = Instant::now();
    let r = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{admin}/console/api/state"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    let asked = Instant::now();
    let api: Value = r.json().await.unwrap();
    let text = api.to_string();
    assert!(!text.contains(K1) && !text.contains(K2), "a raw key in the console's answer");
    let rows = api["holds_and_waits"].as_array().unwrap();
    let pay = rows.iter().find(|r| r["namespace"] == "payments" && r["class"] == "pay").unwrap();
    assert_eq!((pay["open_holds"].as_u64(), pay["gated_waiters"].as_u64()), (Some(2), Some(2)), "{pay}");
    let ms = pay["oldest_hold_ms"].as_u64().unwrap();
    let (low, high) =
        (asking.duration_since(g1.recv).as_millis() as u64 - 50, asked.duration_since(g1.sent).as_millis() as u64 + 50);
    assert!(ms >= low && ms <= high, "the console's oldest hold {ms} ms outside [{low}, {high}] ms");
    assert!(pay["oldest_gated_wait_ms"].as_u64().unwrap() >= 1000, "{pay}");
    assert!(rows.iter().any(|r| r["namespace"] == "other" && r["class"] == "default"), "declared pairs: {rows:?}");
    let dom = render(&format!("http://127.0.0.1:{admin}/console#token={token}")).await;
    let cells = cells(row(section(&dom, "holdwaits"), "data-labels", "payments/pay"));
    assert_eq!((cells[0].as_str(), cells[1].as_str(), cells[2].as_str()), ("payments", "pay", "2"), "{cells:?}");
    assert!(cells[3].ends_with('s') && cells[3] != "-", "oldest hold shown as an age: {cells:?}");
    assert_eq!(cells[4], "2", "gated here: {cells:?}");
    assert!(cells[5].ends_with('s') && cells[5] != "-", "oldest gated wait shown as an age: {cells:?}");
    assert!(!dom.contains(K1) && !dom.contains(&token), "a raw key or the token in the DOM");

    // Release: the head takes K1, then the other waiter once the head lets go.
    let released = release(&a, K1, &t1).await;
    let (first_is_b, (r, first)) = tokio::select! {
        x = &mut wb => (true, x.unwrap()),
        x = &mut wc => (false, x.unwrap()),
    };
    let (holder, last, rest) = if first_is_b { (&b, &c, wc) } else { (&c, &b, wb) };
    assert_eq!(r.code(), 200, "{}", r.body);
    let mut pickup_bound = first.recv.duration_since(released).as_secs_f64();
    let released = release(holder, K1, r.json["token"].as_str().unwrap()).await;
    let (r, second) = rest.await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    pickup_bound += second.recv.duration_since(released).as_secs_f64();
    release(last, K1, r.json["token"].as_str().unwrap()).await;

    // Each grant after the wait: one wake-ups-per-grant observation with at least
    // one wake-up (a herd bound: a few polls a second at most), one pickup each,
    // no longer than from the release's request to the waiter's answer.
    let s = until(&st, 0, "lockmesh_arbiter_wakeups_per_grant_count", grants0 + 2.0).await;
    let wakes = s.value("lockmesh_arbiter_wakeups_per_grant_sum") - wakes0;
    assert!((2.0..=40.0).contains(&wakes), "{wakes} wake-ups over 2 grants");
    assert_eq!(s.value("lockmesh_arbiter_pickup_latency_seconds_count") - pickups0, 2.0, "{}", s.text);
    let pickup = s.value("lockmesh_arbiter_pickup_latency_seconds_sum") - pickup0;
    assert!(pickup > 0.0 && pickup <= pickup_bound + SLACK, "pickups {pickup} s, at most {pickup_bound:.3} s");

    // K1 is free: the oldest hold is K2's; then nothing, and no waiter.
    let s = until(&st, 0, "lockmesh_arbiter_open_holds", 1.0).await;
    age_of(s.value(oldest), &s, g2, "the second hold").unwrap();
    release(&a, K2, &t2).await;
    let s = until(&st, 0, "lockmesh_arbiter_open_holds", 0.0).await;
    assert_eq!(s.value(oldest), 0.0);
    assert_eq!(
        (s.value("lockmesh_arbiter_gated_waiters"), s.value("lockmesh_arbiter_oldest_gated_wait_seconds")),
        (0.0, 0.0)
    );
    until(&st, 1, "lockmesh_arbiter_open_holds", 0.0).await;

    // The exposition passes promtool; the new families carry namespace and class only.
    super::observability::promtool_check(&["metrics"], Some(&s.text));
    assert!(!s.text.contains(K1) && !s.text.contains(K2), "a raw key in /metrics");
    for sample in prom::parse(&s.text) {
        let ours = ["oldest_hold", "open_holds", "gated_wait", "wakeups_per_grant", "pickup_latency"];
        if ours.iter().any(|f| sample.name.contains(f)) {
            for (l, _) in &sample.labels {
                assert!(["namespace", "class", "le"].contains(&l.as_str()), "label {l} on {sample:?}");
            }
        }
    }
}

/// The planted twin: with `oldest_hold_newest` the arbiter reports the younger
/// hold's age, and the check above fails.
#[tokio::test]
async fn planted_reporting_the_newest_hold_fails_the_oldest_hold_check() {
    let st = Stack::builder("hold-waits-planted")
        .envoy_config("lock-tier")
        .registry(REGISTRY)
        .arbiter_extra_yaml("test_faults: [oldest_hold_newest]")
        .arbiter_env("LOCKMESH_TEST_FAULTS", "1")
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "hw-a").unwrap();
    let (checked, [_, (_, g2)]) = oldest_of_two(&st, &a).await;
    let e = checked.expect_err("the planted arbiter reports the newest hold");
    assert!(e.contains("is not the first hold's"), "{e}");
    // It is the younger hold's age that was reported.
    let s = scrape(&st, 0).await;
    age_of(s.value("lockmesh_arbiter_oldest_hold_seconds"), &s, g2, "the second hold").unwrap();
}
