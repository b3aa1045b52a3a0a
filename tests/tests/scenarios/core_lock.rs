//! Issue 2: the core lock service end to end, through real Envoy (`lock-tier.yaml`,
//! two workers), the Wasm filter and the arbiter, on real etcd.

use std::time::Duration;

use lockmesh_tests::{client::LockClient, eventually_true, Stack, StackBuilder};
use tokio::time::Instant;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

/// The lock tier's backstop route, swapped for a route to the recording backend in
/// tests that must prove a request was never forwarded.
const BACKSTOP: &str = r#"direct_response:
                            status: 500
                            body: { inline_string: "{\"code\":\"internal\",\"message\":\"lock request was not answered by the arbiter\"}" }"#;

fn lock_tier(name: &str) -> StackBuilder {
    Stack::builder(name).envoy_config("lock-tier")
}

/// The lock tier with its backstop pointing at the recording backend, so "nothing
/// was forwarded" is observed rather than assumed.
fn lock_tier_with_upstream(name: &str) -> StackBuilder {
    lock_tier(name)
        .envoy_replace(BACKSTOP, "route: { cluster: backstop }")
        .envoy_replace(
            "  clusters:\n",
            "  clusters:\n    - name: backstop\n      type: STATIC\n      connect_timeout: 1s\n      load_assignment:\n        cluster_name: backstop\n        endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 18080 } } } }] }]\n",
        )
}

fn token(r: &lockmesh_tests::client::Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token in {}", r.body)).parse().unwrap()
}

fn s(r: &lockmesh_tests::client::Resp, field: &str) -> String {
    r.json[field].as_str().unwrap_or_else(|| panic!("no {field} in {}", r.body)).to_owned()
}

async fn holders(c: &LockClient, key: &str) -> Vec<serde_json::Value> {
    let r = c.get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    r.json["holders"].as_array().cloned().unwrap_or_default()
}

async fn waiting_here(c: &LockClient, key: &str) -> u64 {
    let r = c.get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
    r.json["waiting_here"].as_u64().unwrap_or(0)
}

#[tokio::test]
async fn acquire_release_and_the_waiter_gets_a_greater_token() {
    let st = lock_tier("core-acq").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();
    let k = "payments/order-1";
    let r1 = a.post(ACQ, &[("x-lock-key", k)]).await.unwrap();
    assert_eq!(r1.code(), 200, "{}", r1.body);
    let t1 = token(&r1);
    assert_eq!(r1.json["epoch"].as_u64(), Some(t1 >> 48));
    assert_eq!(r1.json["revision"].as_u64(), Some(t1 & ((1 << 48) - 1)));
    assert_eq!(r1.header("x-lock-token"), Some(t1.to_string().as_str()));

    let waiter =
        tokio::spawn(async move { b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "20000")]).await.unwrap() });
    eventually_true(Duration::from_secs(10), "b queued", || async { waiting_here(&a, k).await == 1 }).await;
    assert!(!waiter.is_finished(), "b was granted while a held the key");
    let rel = a.post(REL, &[("x-lock-key", k), ("x-lock-token", &t1.to_string())]).await.unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    let r2 = tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
    assert_eq!(r2.code(), 200, "{}", r2.body);
    assert!(token(&r2) > t1, "successor token {} not above {t1}", token(&r2));
    let h = holders(&a, k).await;
    assert_eq!(h.len(), 1);
    assert_eq!(h[0]["identity"], st.pki().workload_spiffe_id("payments", "b"));
}

#[tokio::test]
async fn try_once_and_deadline_answer_contended() {
    let st = lock_tier("core-try").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();
    let k = "payments/order-2";
    assert_eq!(a.post(ACQ, &[("x-lock-key", k)]).await.unwrap().code(), 200);

    let t = Instant::now();
    let r = b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "0")]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code"), s(&r, "reason")), (409, "contended".into(), "key_gated".into()));
    assert_eq!(r.header("x-lockmesh-error"), Some("contended"));
    assert!(t.elapsed() < Duration::from_secs(3), "try-once waited {:?}", t.elapsed());

    let t = Instant::now();
    let r = b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "800")]).await.unwrap();
    assert_eq!(r.code(), 409, "{}", r.body);
    assert!(t.elapsed() >= Duration::from_millis(800), "gave up early: {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(5), "deadline overrun: {:?}", t.elapsed());
    assert_eq!(holders(&a, k).await.len(), 1);
}

/// Envoy's ext_proc `message_timeout` is 3 s; the arbiter stretches it only for an
/// acquire still waiting after a second. Both a wait that ends in a grant and one
/// that runs out must get the arbiter's answer, never Envoy's timeout.
#[tokio::test]
async fn waits_longer_than_the_ext_proc_message_timeout_get_the_arbiters_answer() {
    let st = lock_tier("core-long-wait").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let (b, c) = (st.client("payments", "b").unwrap(), st.client("payments", "c").unwrap());
    let k = "payments/order-long";
    let r1 = a.post(ACQ, &[("x-lock-key", k)]).await.unwrap();
    assert_eq!(r1.code(), 200, "{}", r1.body);
    let started = Instant::now();
    let granted =
        tokio::spawn(async move { b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "20000")]).await.unwrap() });
    let refused =
        tokio::spawn(async move { c.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "4000")]).await.unwrap() });
    let r = tokio::time::timeout(Duration::from_secs(15), refused).await.unwrap().unwrap();
    assert_eq!((r.code(), s(&r, "code")), (409, "contended".into()), "{}", r.body);
    assert!(started.elapsed() >= Duration::from_secs(4), "gave up early: {:?}", started.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!granted.is_finished(), "b was answered while a held the key");
    let rel = a.post(REL, &[("x-lock-key", k), ("x-lock-token", &token(&r1).to_string())]).await.unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    let r2 = tokio::time::timeout(Duration::from_secs(10), granted).await.unwrap().unwrap();
    assert_eq!(r2.code(), 200, "after {:?}: {}", started.elapsed(), r2.body);
    assert!(token(&r2) > token(&r1));
}

#[tokio::test]
async fn session_expiry_frees_holds_and_the_session_is_gone() {
    let st = lock_tier("core-expiry").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();
    let k = "short/job-1"; // class `short`: ttl 3 s
    let r = a.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let sa = s(&r, "session");
    let ta = token(&a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &sa)]).await.unwrap());
    // a never renews: its hold must end with its session, and b get the key.
    let r = b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "20000")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert!(token(&r) > ta);
    let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", &sa)]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code")), (410, "session_expired".into()), "{}", r.body);
}

/// A session an acquire opened for itself (no `x-lock-session`: the header-only
/// path) ends with the release of its last hold, shortly after that release's
/// answer, as a close; while it holds another key it stays; a session opened by
/// `POST /v1/sessions` stays after the release of its only hold.
#[tokio::test]
async fn an_acquires_own_session_ends_with_its_last_release_and_an_opened_one_stays() {
    let st = lock_tier("core-oneshot").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let keepalive = async |sid: &str| {
        let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", sid)]).await.unwrap();
        (r.code(), r.json["code"].as_str().unwrap_or_default().to_owned())
    };
    let (k1, k2, k3) = ("payments/oneshot-1", "payments/oneshot-2", "payments/oneshot-3");
    let r1 = a.post(ACQ, &[("x-lock-key", k1)]).await.unwrap();
    assert_eq!((r1.code(), &r1.json["new_session"]), (200, &serde_json::json!(true)), "{}", r1.body);
    let sid = s(&r1, "session");
    let r2 = a.post(ACQ, &[("x-lock-key", k2), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!(r2.code(), 200, "{}", r2.body);
    let release = async |k: &str, r: &lockmesh_tests::client::Resp, sid: &str| {
        let t = s(r, "token");
        a.post(REL, &[("x-lock-key", k), ("x-lock-token", t.as_str()), ("x-lock-session", sid)]).await.unwrap().code()
    };
    assert_eq!(release(k1, &r1, &sid).await, 200);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(keepalive(&sid).await.0, 200, "the session still holds {k2}: it must stay");
    assert_eq!(release(k2, &r2, &sid).await, 200);
    let end = Instant::now() + Duration::from_secs(10);
    while keepalive(&sid).await != (410, "session_expired".to_owned()) {
        assert!(Instant::now() < end, "the acquire's own session did not end with its last hold");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A session the caller opened itself stays open without holds.
    let r = a.post("/v1/sessions", &[("x-lock-key", k3)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let own = s(&r, "session");
    let r3 = a.post(ACQ, &[("x-lock-key", k3), ("x-lock-session", &own)]).await.unwrap();
    assert_eq!((r3.code(), &r3.json["new_session"]), (200, &serde_json::json!(false)), "{}", r3.body);
    assert_eq!(release(k3, &r3, &own).await, 200);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(keepalive(&own).await.0, 200, "a session opened by POST /v1/sessions ended with its release");
}

#[tokio::test]
async fn a_session_that_expires_while_waiting_gets_nothing() {
    let st = lock_tier("core-expire-wait").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();
    let k = "short/job-2";
    let sa = s(&a.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap(), "session");
    let ta = token(&a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &sa)]).await.unwrap());
    // a keeps its session alive; b's session (never renewed) expires while b waits.
    let keeper = {
        let (a, sa) = (st.client("payments", "a").unwrap(), sa.clone());
        tokio::spawn(async move {
            loop {
                let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", &sa)]).await.unwrap();
                assert_eq!(r.code(), 200, "a's keepalive failed: {}", r.body);
                tokio::time::sleep(Duration::from_millis(700)).await;
            }
        })
    };
    let sb = s(&b.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap(), "session");
    let waiter = tokio::spawn(async move {
        b.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &sb), ("x-lock-wait-ms", "20000")]).await.unwrap()
    });
    tokio::time::sleep(Duration::from_secs(5)).await; // past b's 3 s TTL
    let rel =
        a.post(REL, &[("x-lock-key", k), ("x-lock-token", &ta.to_string()), ("x-lock-session", &sa)]).await.unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    let r = tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
    keeper.abort();
    assert_eq!((r.code(), s(&r, "code")), (410, "session_expired".into()), "{}", r.body);
    assert!(holders(&a, k).await.is_empty(), "the expired session was granted the key");
}

/// A retried release of a finished grant (a lost answer, say) must not free the
/// successor, even one of the same identity on the same session: then neither
/// the identity nor the session check tells the two grants apart, only the
/// compare on the grant's revision does. The scenario runs twice: with the
/// release-by-name bug planted (`test_faults: [release_by_key_name]`, which
/// deletes slot 0 of the caller's session by name, etcd #22082) the stale
/// release frees the successor, so this test can fail; without it, never.
#[tokio::test]
async fn a_stale_release_never_frees_the_successor() {
    for planted in [true, false] {
        let mut b = lock_tier(if planted { "core-stale-planted" } else { "core-stale" });
        if planted {
            b = b.arbiter_extra_yaml("test_faults: [release_by_key_name]").arbiter_env("LOCKMESH_TEST_FAULTS", "1");
        }
        let st = b.start().await.unwrap();
        let a = st.client("payments", "a").unwrap();
        let k = "payments/order-3";
        let opened = a.post("/v1/sessions", &[("x-lock-key", k)]).await.unwrap();
        assert_eq!(opened.code(), 200, "{}", opened.body);
        let sid = s(&opened, "session");
        let acq = [("x-lock-key", k), ("x-lock-session", sid.as_str())];
        let t1 = token(&a.post(ACQ, &acq).await.unwrap()).to_string();
        let rel1 = [("x-lock-key", k), ("x-lock-token", t1.as_str()), ("x-lock-session", sid.as_str())];
        assert_eq!(a.post(REL, &rel1).await.unwrap().code(), 200);
        // The same identity takes the key again on the same session.
        let t2 = token(&a.post(ACQ, &acq).await.unwrap());
        assert!(t2 > t1.parse().unwrap());
        // a retries its first release: it must not touch its own successor grant.
        let stale = a.post(REL, &rel1).await.unwrap();
        let own = a.get("/v1/locks", &acq).await.unwrap();
        assert_eq!(own.code(), 200, "{}", own.body);
        let held: Vec<String> = own.json["holders"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|h| h["token"].as_str().map(str::to_owned))
            .collect();
        if planted {
            assert_eq!(stale.code(), 200, "the planted arbiter deletes slot 0 by name: {}", stale.body);
            assert!(held.is_empty(), "the planted stale release should have freed the successor: {}", own.body);
            continue;
        }
        assert_eq!((stale.code(), s(&stale, "code")), (409, "not_holder".into()), "{}", stale.body);
        assert_eq!(held, [t2.to_string()], "the successor grant is still held: {}", own.body);
        // Another identity with the successor's token is refused too, and a made-up one.
        let b = st.client("payments", "b").unwrap();
        let r = b.post(REL, &[("x-lock-key", k), ("x-lock-token", &t2.to_string())]).await.unwrap();
        assert_eq!(r.code(), 409, "{}", r.body);
        let r = a.post(REL, &[("x-lock-key", k), ("x-lock-token", &(t2 + 1).to_string())]).await.unwrap();
        assert_eq!(r.code(), 409, "{}", r.body);
        let h = holders(&a, k).await;
        assert_eq!(h.len(), 1);
        assert_eq!(h[0]["identity"], st.pki().workload_spiffe_id("payments", "a"));
        let rel2 = [("x-lock-key", k), ("x-lock-token", &t2.to_string()), ("x-lock-session", &sid)];
        assert_eq!(a.post(REL, &rel2).await.unwrap().code(), 200);
        assert!(holders(&a, k).await.is_empty());
    }
}

#[tokio::test]
async fn reacquire_is_idempotent_and_a_leak_is_named() {
    let st = lock_tier("core-leak").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/order-4";
    let open = |inst: &'static str| {
        let a = &a;
        async move {
            let r = a.post("/v1/sessions", &[("x-lock-instance", inst)]).await.unwrap();
            assert_eq!(r.code(), 200, "{}", r.body);
            s(&r, "session")
        }
    };
    let s1 = open("pod-1").await;
    let r1 = a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &s1), ("x-lock-instance", "pod-1")]).await.unwrap();
    assert_eq!(r1.code(), 200, "{}", r1.body);
    let again = a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &s1), ("x-lock-instance", "pod-1")]).await.unwrap();
    assert_eq!(again.code(), 200, "{}", again.body);
    assert_eq!(token(&again), token(&r1));
    assert_eq!(again.json["existing"], true);
    // Same identity and instance, another session: a leak, not contention.
    let s2 = open("pod-1").await;
    let r = a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &s2), ("x-lock-instance", "pod-1")]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code")), (409, "leaked".into()), "{}", r.body);
    // Another instance (a replica) contends normally.
    let s3 = open("pod-2").await;
    let r = a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &s3), ("x-lock-instance", "pod-2")]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code")), (409, "contended".into()), "{}", r.body);
    // A session opened with an instance cannot be used without it.
    let r = a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &s1)]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code")), (410, "session_expired".into()), "{}", r.body);
    // The session's holder can list its holds (for a lost acquire answer).
    let r = a.get("/v1/sessions/holds", &[("x-lock-session", &s1), ("x-lock-instance", "pod-1")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert_eq!(r.json["holds"][0]["key"], k);
    assert_eq!(r.json["holds"][0]["token"].as_str(), Some(token(&r1).to_string().as_str()));
}

#[tokio::test]
async fn inspection_by_another_caller_reveals_no_token_revision_or_session() {
    let st = lock_tier("core-inspect").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let b = st.client("billing", "b").unwrap();
    let k = "payments/order-5";
    let r = a.post(ACQ, &[("x-lock-key", k)]).await.unwrap();
    let (t, rev, sid) = (token(&r), r.json["revision"].as_u64().unwrap(), s(&r, "session"));
    let seen = b.get("/v1/locks", &[("x-lock-key", k)]).await.unwrap();
    assert_eq!(seen.code(), 200, "{}", seen.body);
    assert_eq!(seen.json["holders"][0]["identity"], st.pki().workload_spiffe_id("payments", "a"));
    for secret in [t.to_string(), sid.clone(), format!("\"revision\":{rev}"), format!(":{rev},"), format!(":{rev}}}")] {
        assert!(!seen.body.contains(&secret), "inspection leaked {secret:?}: {}", seen.body);
    }
    // b naming a's session learns nothing either (not its session).
    let seen = b.get("/v1/locks", &[("x-lock-key", k), ("x-lock-session", &sid)]).await.unwrap();
    assert!(!seen.body.contains(&t.to_string()), "{}", seen.body);
    // The holder itself, naming its session, sees its token.
    let own = a.get("/v1/locks", &[("x-lock-key", k), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!(own.json["holders"][0]["token"].as_str(), Some(t.to_string().as_str()), "{}", own.body);
}

#[tokio::test]
async fn etcd_down_answers_unavailable_and_grants_nothing() {
    let st = lock_tier("core-etcd-down").own_etcd(1).start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let r = a.post("/v1/sessions", &[]).await.unwrap();
    let sid = s(&r, "session");
    assert_eq!(a.post(ACQ, &[("x-lock-key", "payments/before")]).await.unwrap().code(), 200);
    st.etcd().member(0).kill();
    let t = Instant::now();
    let r = a.post(ACQ, &[("x-lock-key", "payments/during"), ("x-lock-wait-ms", "3000")]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code")), (503, "unavailable".into()), "{}", r.body);
    assert!(t.elapsed() < Duration::from_secs(8), "took {:?}", t.elapsed());
    let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", &sid)]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code")), (503, "unavailable".into()), "{}", r.body);
    st.etcd().member(0).restart().await.unwrap();
    // Nothing was granted while etcd was down.
    lockmesh_tests::eventually(Duration::from_secs(15), async || {
        let r = a.get("/v1/locks", &[("x-lock-key", "payments/during")]).await?;
        anyhow::ensure!(r.code() == 200, "not ready: {}", r.body);
        anyhow::ensure!(r.json["holders"].as_array().is_some_and(|h| h.is_empty()), "granted: {}", r.body);
        Ok(())
    })
    .await;
}

#[tokio::test]
async fn a_caller_that_leaves_while_waiting_leaves_nothing_behind() {
    let st = lock_tier("core-leave").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/order-6";
    let t1 = token(&a.post(ACQ, &[("x-lock-key", k)]).await.unwrap());
    let b = st.client("payments", "b").unwrap();
    let url = format!("{}{ACQ}", b.base_url());
    let req = b.http().post(url).header("x-lock-key", k).header("x-lock-wait-ms", "20000");
    let gone = tokio::time::timeout(Duration::from_millis(1500), req.send()).await;
    assert!(gone.is_err(), "the waiter was answered while a held the key");
    eventually_true(Duration::from_secs(10), "waiter left the queue", || async { waiting_here(&a, k).await == 0 })
        .await;
    assert_eq!(a.post(REL, &[("x-lock-key", k), ("x-lock-token", &t1.to_string())]).await.unwrap().code(), 200);
    tokio::time::sleep(Duration::from_millis(1500)).await; // longer than one poll period
    assert!(holders(&a, k).await.is_empty(), "the departed waiter was granted the key");
}

#[tokio::test]
async fn many_waiters_are_all_served_without_5xx() {
    let st = lock_tier("core-many").start().await.unwrap();
    let k = "payments/hot";
    let mut tasks = Vec::new();
    for i in 0..40 {
        let c = st.client("payments", &format!("w{}", i % 4)).unwrap();
        tasks.push(tokio::spawn(async move {
            let r = c.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "30000")]).await.unwrap();
            assert_eq!(r.code(), 200, "waiter {i}: {}", r.body);
            let t = token(&r);
            let rel = c
                .post(
                    REL,
                    &[("x-lock-key", k), ("x-lock-token", &t.to_string()), ("x-lock-session", &s(&r, "session"))],
                )
                .await
                .unwrap();
            assert_eq!(rel.code(), 200, "release {i}: {}", rel.body);
            t
        }));
    }
    let mut tokens = Vec::new();
    for t in tasks {
        tokens.push(t.await.unwrap());
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 40, "tokens are not unique");
}

#[tokio::test]
async fn killing_the_arbiter_mid_wait_fails_closed() {
    let st = lock_tier_with_upstream("core-kill-arb").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/order-7";
    assert_eq!(a.post(ACQ, &[("x-lock-key", k)]).await.unwrap().code(), 200);
    let b = st.client("payments", "b").unwrap();
    let waiter =
        tokio::spawn(async move { b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "20000")]).await.unwrap() });
    eventually_true(Duration::from_secs(10), "b queued", || async { waiting_here(&a, k).await == 1 }).await;
    st.arbiter(0).kill();
    let r = tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
    assert!(r.code() >= 500, "killed arbiter answered {}: {}", r.code(), r.body);
    // Later requests fail too, and none ever reaches the upstream.
    let r = a.post(ACQ, &[("x-lock-key", "payments/x")]).await.unwrap();
    assert!(r.code() >= 500, "{}", r.body);
    assert!(st.backend().requests().is_empty(), "a request reached the upstream: {:?}", st.backend().requests());
}

/// The shipped Wasm module has no test trap: the trap's code is absent from its
/// bytes (present in the test build, so the check can fail), and a shipped
/// filter given `test_trap_header` refuses the config, so Envoy does not start
/// with it (the header can never trap a shipped VM).
#[tokio::test]
async fn the_shipped_filter_has_no_test_trap() {
    let contains = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
    let shipped = std::fs::read(lockmesh_tests::envoy::wasm_module().unwrap()).unwrap();
    let test = std::fs::read(lockmesh_tests::envoy::wasm_test_module().unwrap()).unwrap();
    assert!(contains(&test, b"lockmesh test trap"), "the test build lost its trap: this check proves nothing");
    assert!(!contains(&shipped, b"lockmesh test trap"), "the shipped filter carries the test trap");
    let started = lock_tier_with_upstream("core-vm-shipped-trap")
        .envoy_replace(r#"'{"max_wait_ms": 30000, "#, r#"'{"max_wait_ms": 30000, "test_trap_header": "x-test-trap", "#)
        .envoy_concurrency(1)
        .start()
        .await;
    assert!(started.is_err(), "a shipped filter accepted test_trap_header");
}

#[tokio::test]
async fn overflowing_the_ext_proc_cluster_fails_closed() {
    let st = lock_tier_with_upstream("core-overflow")
        .envoy_replace("max_requests: 100000", "max_requests: 1")
        .envoy_concurrency(1)
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/order-8";
    assert_eq!(a.post(ACQ, &[("x-lock-key", k)]).await.unwrap().code(), 200);
    let b = st.client("payments", "b").unwrap();
    // b's wait occupies the only ext_proc stream the cluster allows.
    let _waiter = tokio::spawn(async move { b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "20000")]).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = a.post(ACQ, &[("x-lock-key", "payments/other")]).await.unwrap();
    assert!(r.code() >= 500, "overflow answered {}: {}", r.code(), r.body);
    let overflow = st.envoy().stat("cluster.lockmesh_arbiter.upstream_rq_pending_overflow").await.unwrap().unwrap_or(0)
        + st.envoy().stat("cluster.lockmesh_arbiter.upstream_rq_active_overflow").await.unwrap().unwrap_or(0);
    assert!(overflow > 0, "no overflow counted");
    assert!(st.backend().requests().is_empty(), "a request reached the upstream: {:?}", st.backend().requests());
}

#[tokio::test]
async fn a_crashed_filter_vm_fails_closed() {
    let st = lock_tier_with_upstream("core-vm-crash")
        .envoy_test_filter()
        .envoy_replace(r#"'{"max_wait_ms": 30000, "#, r#"'{"max_wait_ms": 30000, "test_trap_header": "x-test-trap", "#)
        .envoy_concurrency(1)
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "a").unwrap();
    let r = a.post(ACQ, &[("x-lock-key", "payments/vm"), ("x-test-trap", "1")]).await.unwrap();
    assert!(r.code() >= 500, "trap answered {}: {}", r.code(), r.body);
    // The VM is dead (FAIL_CLOSED): later requests fail, none is forwarded.
    let r = a.post(ACQ, &[("x-lock-key", "payments/vm")]).await.unwrap();
    assert!(r.code() >= 500, "after the trap {}: {}", r.code(), r.body);
    assert!(st.backend().requests().is_empty(), "a request reached the upstream: {:?}", st.backend().requests());
}

#[tokio::test]
async fn forged_identity_and_internal_headers_are_ignored() {
    let st = lock_tier("core-forge").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let other = st.pki().workload_spiffe_id("billing", "boss");
    let xfcc = format!("By=spiffe://x;URI={other}");
    let forged: [(&str, &str); 5] = [
        ("x-forwarded-client-cert", &xfcc),
        ("x-spiffe-id", &other),
        ("x-lockmesh-identity", &other),
        ("x-lockmesh-filtered", "1"),
        ("x-lockmesh-budget-ms", "20000"),
    ];
    let mut h = vec![("x-lock-key", "payments/order-9")];
    h.extend(forged);
    let r = a.post(ACQ, &h).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let seen = holders(&a, "payments/order-9").await;
    assert_eq!(seen[0]["identity"], st.pki().workload_spiffe_id("payments", "a"));
    // A forged budget does not turn a try-once into a wait.
    let b = st.client("payments", "b").unwrap();
    let mut h = vec![("x-lock-key", "payments/order-9")];
    h.extend(forged);
    let t = Instant::now();
    let r = b.post(ACQ, &h).await.unwrap();
    assert_eq!(r.code(), 409, "{}", r.body);
    assert!(t.elapsed() < Duration::from_secs(3), "a forged budget made it wait {:?}", t.elapsed());
    // Duplicated and malformed lock headers are refused by the filter, naming them.
    let r = a.post(ACQ, &[("x-lock-key", "payments/a"), ("x-lock-key", "payments/a")]).await.unwrap();
    assert_eq!((r.code(), s(&r, "code")), (400, "bad_request".into()), "{}", r.body);
    assert!(s(&r, "message").contains("x-lock-key"), "{}", r.body);
    let r = a.post(ACQ, &[("x-lock-key", "payments/a"), ("x-lock-wait-ms", "1e3")]).await.unwrap();
    assert!(s(&r, "message").contains("x-lock-wait-ms"), "{}", r.body);
}

#[tokio::test]
async fn the_lock_tier_refuses_callers_without_a_valid_certificate() {
    let st = lock_tier("core-mtls").start().await.unwrap();
    assert!(st.anonymous_client().unwrap().post(ACQ, &[("x-lock-key", "payments/x")]).await.is_err());
    assert!(st.rogue_client("payments", "a").unwrap().post(ACQ, &[("x-lock-key", "payments/x")]).await.is_err());
}
