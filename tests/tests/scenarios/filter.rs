//! The Wasm filter end to end (real Envoy with two workers, the arbiter, etcd):
//! prefix grants (ADR-19), key-affine queueing (ADR-14), Tier-1 local limits,
//! metrics (ADR-22), and that no header set can crash it.
//!
//! The shipped `lock-tier.yaml` grants the harness's test trust domain
//! (`lockmesh.test`): each test namespace's workloads lock and inspect their own
//! namespace, `payments` also `short`, and `billing` may inspect `payments`.
//! Anything else is denied.

use std::time::Duration;

use futures::{stream, StreamExt};
use lockmesh_tests::{client::LockClient, eventually_true, probe::http_get, EnvoyProcess, Resp};
use lockmesh_tests::{Stack, StackBuilder};
use rand::{rngs::StdRng, Rng, SeedableRng};
use reqwest::Method;
use tokio::time::Instant;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

/// The shipped lock tier.
fn lock_tier(name: &str) -> StackBuilder {
    Stack::builder(name).envoy_config("lock-tier")
}

/// `lock_tier` with `fields` (JSON members, e.g. `"max_queue_per_key": 2`) added to
/// the plugin configuration.
fn lock_tier_with(name: &str, fields: &str) -> StackBuilder {
    lock_tier(name).envoy_replace(r#"'{"max_wait_ms": 30000, "#, format!(r#"'{{"max_wait_ms": 30000, {fields}, "#))
}

fn token(r: &Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token in {}", r.body)).parse().unwrap()
}

fn field(r: &Resp, name: &str) -> String {
    r.json[name].as_str().unwrap_or_default().to_owned()
}

async fn acquire(c: &LockClient, key: &str, wait_ms: &str) -> Resp {
    c.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", wait_ms)]).await.unwrap()
}

async fn release(c: &LockClient, key: &str, r: &Resp) -> Resp {
    let t = token(r).to_string();
    let sid = field(r, "session");
    c.post(REL, &[("x-lock-key", key), ("x-lock-token", &t), ("x-lock-session", &sid)]).await.unwrap()
}

/// Sum of the arbiter's `lockmesh_arbiter_requests_total` over every label set.
async fn arbiter_requests(st: &Stack) -> u64 {
    let (status, body) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    assert_eq!(status, 200, "{body}");
    body.lines()
        .filter(|l| l.starts_with("lockmesh_arbiter_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// A stat of the filter from admin `/stats` (`name` without the `wasmcustom.` prefix).
async fn filter_stat(st: &Stack, name: &str) -> Option<u64> {
    let stats = st.envoy().stats().await.unwrap();
    let name = format!("{name}: ");
    stats.lines().find_map(|l| l.split_once(name.as_str()).map(|(_, n)| n.trim().parse().unwrap()))
}

/// Connections accepted so far by each of the listener's two workers.
async fn connections_per_worker(st: &Stack) -> [u64; 2] {
    let stats = st.envoy().stats().await.unwrap();
    let mut n = [0; 2];
    for line in stats.lines().filter(|l| l.starts_with("listener.") && !l.contains("admin")) {
        for (w, slot) in n.iter_mut().enumerate() {
            let suffix = format!(".worker_{w}.downstream_cx_total: ");
            if let Some((_, v)) = line.split_once(suffix.as_str()) {
                *slot += v.trim().parse::<u64>().unwrap();
            }
        }
    }
    n
}

/// Opens `c`'s connection and answers which worker accepted it.
async fn worker_of(st: &Stack, c: &LockClient) -> usize {
    let before = connections_per_worker(st).await;
    assert_eq!(c.get("/v1/locks", &[("x-lock-key", "payments/warm")]).await.unwrap().code(), 200);
    let after = connections_per_worker(st).await;
    (0..2)
        .find(|w| after[*w] > before[*w])
        .unwrap_or_else(|| panic!("no worker took the connection: {before:?} -> {after:?}"))
}

/// Waiters for `k` in the `payments` namespace: queued in the filter (all workers)
/// plus waiting at the arbiter.
async fn queued(st: &Stack, c: &LockClient, k: &str) -> u64 {
    let in_filter = filter_stat(st, "lockmesh_filter_queue_depth.ns.payments").await;
    let r = c.get("/v1/locks", &[("x-lock-key", k)]).await.unwrap();
    in_filter.unwrap_or(0) + r.json["waiting_here"].as_u64().unwrap_or(0)
}

/// Waits until `n` waiters are queued for `k` (in the filter or at the arbiter).
async fn wait_queued(st: &Stack, c: &LockClient, k: &str, n: u64) {
    eventually_true(Duration::from_secs(10), "waiters queued", || async { queued(st, c, k).await == n }).await;
}

/// The filter's request counter for `ns` and `outcome`, from admin `/stats`.
async fn filter_requests(st: &Stack, ns: &str, outcome: &str) -> u64 {
    let name = format!("lockmesh_filter_requests.ns.{ns}.outcome.{outcome}");
    filter_stat(st, &name).await.unwrap_or_else(|| panic!("no counter {name}"))
}

async fn prometheus(st: &Stack) -> String {
    http_get(st.envoy().admin_port(), "/stats/prometheus").await.unwrap().body
}

#[tokio::test]
async fn a_denial_is_one_answer_whether_or_not_the_key_exists_and_reaches_no_arbiter() {
    let st = lock_tier("filter-deny").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let held = acquire(&a, "payments/held", "0").await;
    assert_eq!(held.code(), 200, "{}", held.body);
    let before = arbiter_requests(&st).await;
    assert!(before >= 1, "the arbiter counted nothing");

    let b = st.client("billing", "b").unwrap();
    let mut answers = Vec::new();
    for key in ["payments/held", "payments/missing", "payments/held/child"] {
        answers.push(acquire(&b, key, "0").await);
        answers.push(acquire(&b, key, "5000").await);
    }
    let t = token(&held).to_string();
    answers.push(b.post(REL, &[("x-lock-key", "payments/held"), ("x-lock-token", &t)]).await.unwrap());
    let s = st.client("short", "s").unwrap();
    answers.push(acquire(&s, "billing/x", "0").await);
    answers.push(s.get("/v1/locks", &[("x-lock-key", "payments/held")]).await.unwrap());
    let want = r#"{"code":"denied","message":"not permitted"}"#;
    let shape = |r: &Resp| {
        let mut h: Vec<(String, String)> = r
            .headers
            .iter()
            .filter(|(n, _)| *n != "date")
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("?").to_owned()))
            .collect();
        h.sort();
        (r.code(), r.body.clone(), h)
    };
    for r in &answers {
        assert_eq!((r.code(), r.body.as_str()), (403, want));
        assert_eq!(r.header("x-lockmesh-error"), Some("denied"));
        assert_eq!(shape(r), shape(&answers[0]), "denials differ");
    }
    assert_eq!(arbiter_requests(&st).await, before, "a denial reached the arbiter");
    // The holder is untouched, and billing may still inspect payments keys.
    let seen = b.get("/v1/locks", &[("x-lock-key", "payments/held")]).await.unwrap();
    assert_eq!(seen.code(), 200, "{}", seen.body);
    assert_eq!(seen.json["holders"].as_array().map(Vec::len), Some(1));

    let prom = prometheus(&st).await;
    let line = prom
        .lines()
        .find(|l| {
            l.starts_with("lockmesh_filter_requests{")
                && l.contains(r#"outcome="denied""#)
                && l.contains(r#"ns="payments""#)
        })
        .unwrap_or_else(|| panic!("no labelled denial counter in:\n{prom}"));
    let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= 7, "{line}");
    assert!(!prom.contains("payments/held"), "a key reached the metrics");
}

#[tokio::test]
async fn waiters_are_granted_in_arrival_order_and_releases_never_wait_behind_them() {
    let st = lock_tier("filter-order").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/fifo";
    let held = acquire(&a, k, "0").await;
    assert_eq!(held.code(), 200, "{}", held.body);
    // Waiters on workers A, A, B, B, A in that receipt order: per-worker head-only
    // forwarding alone would let B's first waiter overtake A's second (A's second
    // waits in A's filter while B's goes straight to the arbiter). Each connection is
    // open before the sequence starts, and each waiter is seen queued before the next
    // is sent, so the receipt order is the order asserted below.
    let mut on: [Vec<LockClient>; 2] = [Vec::new(), Vec::new()];
    for i in 0..40 {
        if on[0].len() >= 3 && on[1].len() >= 2 || on[1].len() >= 3 && on[0].len() >= 2 {
            break;
        }
        let c = st.client("payments", &format!("w{i}")).unwrap();
        let w = worker_of(&st, &c).await;
        on[w].push(c);
    }
    let (big, small) = if on[0].len() >= 3 && on[1].len() >= 2 { (0, 1) } else { (1, 0) };
    assert!(on[big].len() >= 3 && on[small].len() >= 2, "connections did not spread over both workers");
    let mut clients = Vec::new();
    for w in [big, big, small, small, big] {
        clients.push(on[w].pop().unwrap());
    }
    let mut waiters = Vec::new();
    for (i, c) in clients.into_iter().enumerate() {
        waiters.push(tokio::spawn(async move {
            let r = acquire(&c, k, "20000").await;
            assert_eq!(r.code(), 200, "waiter {i}: {}", r.body);
            assert_eq!(release(&c, k, &r).await.code(), 200);
            token(&r)
        }));
        wait_queued(&st, &a, k, i as u64 + 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Five waiters are queued (in the filter or at the arbiter): inspection and the
    // holder's release go straight through.
    let t = Instant::now();
    let seen = a.get("/v1/locks", &[("x-lock-key", k)]).await.unwrap();
    assert_eq!(seen.code(), 200, "{}", seen.body);
    assert!(t.elapsed() < Duration::from_secs(2), "inspect took {:?}", t.elapsed());
    let t = Instant::now();
    let rel = release(&a, k, &held).await;
    assert_eq!(rel.code(), 200, "{}", rel.body);
    assert!(t.elapsed() < Duration::from_secs(2), "release took {:?}", t.elapsed());
    let mut tokens = Vec::new();
    for w in waiters {
        tokens.push(tokio::time::timeout(Duration::from_secs(20), w).await.unwrap().unwrap());
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "grants out of arrival order: {tokens:?}");
    assert!(tokens[0] > token(&held));
}

#[tokio::test]
async fn a_try_once_never_overtakes_a_waiter() {
    let st = lock_tier("filter-try").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/busy";
    let held = acquire(&a, k, "0").await;
    let b = st.client("payments", "b").unwrap();
    let first = tokio::spawn(async move {
        let r = acquire(&b, k, "20000").await;
        assert_eq!(r.code(), 200, "{}", r.body);
        assert_eq!(release(&b, k, &r).await.code(), 200);
    });
    wait_queued(&st, &a, k, 1).await;
    let c = st.client("payments", "c").unwrap();
    let (granted_tx, mut granted_rx) = tokio::sync::oneshot::channel();
    let second = tokio::spawn(async move {
        let r = acquire(&c, k, "20000").await;
        assert_eq!(r.code(), 200, "{}", r.body);
        let _ = granted_tx.send(());
        r // c keeps the key: the try-once loop below must never have won it
    });
    wait_queued(&st, &a, k, 2).await;
    let d = st.client("payments", "d").unwrap();
    let mut tries = 0;
    let mut released = false;
    loop {
        if !released && tries == 5 {
            assert_eq!(release(&a, k, &held).await.code(), 200);
            released = true;
        }
        if granted_rx.try_recv().is_ok() {
            break;
        }
        let t = Instant::now();
        let r = acquire(&d, k, "0").await;
        assert_eq!(
            (r.code(), field(&r, "code"), field(&r, "reason")),
            (409, "contended".into(), "key_gated".into()),
            "try-once #{tries} overtook the waiters: {}",
            r.body
        );
        assert!(t.elapsed() < Duration::from_secs(2), "try-once waited {:?}", t.elapsed());
        tries += 1;
        assert!(tries < 2000, "the waiters were never granted");
    }
    first.await.unwrap();
    let r = second.await.unwrap();
    assert!(token(&r) > token(&held));
}

#[tokio::test]
async fn a_full_key_queue_answers_queue_full() {
    let st = lock_tier("filter-bound")
        .envoy_replace(r#""max_queue_per_key": 1000"#, r#""max_queue_per_key": 2"#)
        .envoy_concurrency(1)
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/crowded";
    assert_eq!(acquire(&a, k, "0").await.code(), 200);
    // The head goes on to the arbiter and waits there; two more queue in the filter
    // with a short wait, so they expire there.
    let head = st.client("payments", "head").unwrap();
    let head = tokio::spawn(async move { acquire(&head, k, "20000").await });
    wait_queued(&st, &a, k, 1).await;
    let mut waiters = Vec::new();
    for i in 0..2 {
        let c = st.client("payments", &format!("w{i}")).unwrap();
        waiters.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = acquire(&c, k, "1500").await;
            (r, t.elapsed())
        }));
        wait_queued(&st, &a, k, i + 2).await;
    }
    let t = Instant::now();
    let r = acquire(&st.client("payments", "late").unwrap(), k, "10000").await;
    assert_eq!((r.code(), field(&r, "code")), (429, "queue_full".into()), "{}", r.body);
    assert_eq!(r.header("x-lockmesh-error"), Some("queue_full"));
    assert!(t.elapsed() < Duration::from_secs(2));
    // Queued waiters whose deadline passes are answered contended by the filter, at
    // their deadline (plus at most a tick), while the head still waits.
    for w in waiters {
        let (r, took) = tokio::time::timeout(Duration::from_secs(10), w).await.unwrap().unwrap();
        assert_eq!(
            (r.code(), field(&r, "code"), field(&r, "reason")),
            (409, "contended".into(), "key_gated".into()),
            "{}",
            r.body
        );
        assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(3), "took {took:?}");
    }
    assert!(!head.is_finished(), "the head was answered early");
    head.abort();
    assert_eq!(filter_requests(&st, "payments", "queue_full").await, 1);
    assert_eq!(filter_requests(&st, "payments", "contended_local").await, 2);
    // The gauge is back to zero and the wait histogram has both waiters (Envoy
    // publishes histograms at its stats flush, every 5 s), labelled by namespace only.
    lockmesh_tests::eventually(Duration::from_secs(12), async || {
        let prom = prometheus(&st).await;
        for want in [
            r#"lockmesh_filter_queue_depth{ns="payments"} 0"#,
            r#"lockmesh_filter_queue_wait_ms_count{ns="payments"} 2"#,
            r#"lockmesh_filter_requests{ns="payments",outcome="contended_local"} 2"#,
        ] {
            anyhow::ensure!(prom.lines().any(|l| l == want), "no {want} in:\n{prom}");
        }
        Ok(())
    })
    .await;
}

#[tokio::test]
async fn a_queued_waiter_that_disconnects_leaves_the_queue_at_once() {
    let st = lock_tier("filter-leave").envoy_concurrency(1).start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let k = "payments/leaver";
    let held = acquire(&a, k, "0").await;
    let head = st.client("payments", "head").unwrap();
    let head = tokio::spawn(async move { acquire(&head, k, "20000").await });
    wait_queued(&st, &a, k, 1).await;
    // This one queues in the filter behind the head, then its caller gives up.
    let w = st.client("payments", "w").unwrap();
    let req = w.http().post(format!("{}{ACQ}", w.base_url())).header("x-lock-key", k).header("x-lock-wait-ms", "20000");
    let gone = tokio::time::timeout(Duration::from_millis(1000), req.send()).await;
    assert!(gone.is_err(), "the queued waiter was answered");
    wait_queued(&st, &a, k, 1).await;
    assert_eq!(filter_requests(&st, "payments", "cancelled").await, 1);
    // The head is served next; the departed waiter is never handed the key.
    assert_eq!(release(&a, k, &held).await.code(), 200);
    let r = tokio::time::timeout(Duration::from_secs(10), head).await.unwrap().unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert_eq!(release(&st.client("payments", "head").unwrap(), k, &r).await.code(), 200);
    // Time for a wrong hand-over to the departed waiter to show (three ticks).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = a.get("/v1/locks", &[("x-lock-key", k)]).await.unwrap();
    assert_eq!(seen.json["holders"].as_array().map(Vec::len), Some(0), "{}", seen.body);
}

#[tokio::test]
async fn a_local_limit_refuses_the_request_over_it_on_one_envoy() {
    let limit = r#""local_limits": [{"prefix": "payments/reports", "max_in_flight": 2, "approximate": true}]"#;
    let st = lock_tier_with("filter-limit", limit).start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let (x, y) = ("payments/reports/x", "payments/reports/y");
    let hx = acquire(&a, x, "0").await;
    assert_eq!(acquire(&a, y, "0").await.code(), 200);
    // Two waiters, on separate connections (so likely both workers), take both slots.
    let mut waiters = Vec::new();
    for (i, key) in [x, y].into_iter().enumerate() {
        let c = st.client("payments", &format!("w{i}")).unwrap();
        waiters.push(tokio::spawn(async move {
            let r = acquire(&c, key, "15000").await;
            (r.code(), r.body)
        }));
    }
    wait_queued(&st, &a, x, 1).await;
    wait_queued(&st, &a, y, 1).await;
    let d = st.client("payments", "d").unwrap();
    for _ in 0..4 {
        let r = acquire(&st.client("payments", "d").unwrap(), "payments/reports/free", "0").await;
        assert_eq!((r.code(), field(&r, "code")), (429, "queue_full".into()), "{}", r.body);
        assert!(field(&r, "message").contains("local in-flight limit"), "{}", r.body);
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    // Other prefixes are not limited, nor are releases.
    assert_eq!(acquire(&d, "payments/unlimited", "0").await.code(), 200);
    assert_eq!(release(&a, x, &hx).await.code(), 200);
    let (code, body) = waiters.remove(0).await.unwrap();
    assert_eq!(code, 200, "{body}");
    // The granted waiter's request ended, so its slot is free again.
    eventually_true(Duration::from_secs(5), "a slot came back", || async {
        acquire(&d, "payments/reports/free", "0").await.code() == 200
    })
    .await;
    assert!(filter_requests(&st, "payments", "limited_approx").await >= 4);
}

#[tokio::test]
async fn envoy_rejects_a_bad_grant_naming_its_field() {
    let out = EnvoyProcess::builder("lock-tier")
        .replace("spiffe://lockmesh.local/ns/payments/", "spiffe://lockmesh.local/ns//p/")
        .replace(r#""prefixes": ["billing"]"#, r#""prefixes": ["billing//x"]"#)
        .validate()
        .await
        .unwrap()
        .expect_err("envoy accepted a bad grant");
    for want in [
        "grants[0].identity: \"spiffe://lockmesh.local/ns//p/\" has an empty",
        "grants[1].prefixes[0]: \"billing//x\" is not a namespace or namespace/path",
    ] {
        let escaped = want.replace('"', "\\\"");
        assert!(out.contains(want) || out.contains(&escaped), "missing {want} in:\n{out}");
    }
}

/// One header set that the filter must refuse: at least one lock header is broken,
/// or the route is unknown.
fn malformed(rng: &mut StdRng) -> (Method, String, Vec<(String, Vec<u8>)>) {
    const NAMES: [&str; 6] =
        ["x-lock-key", "x-lock-wait-ms", "x-lock-session", "x-lock-instance", "x-lock-token", "x-lock-class"];
    const BROKEN: [&[u8]; 16] = [
        b"Payments/x",
        b"payments//x",
        b"payments/./x",
        b"/x",
        b"payments",
        b"payments/a b",
        b"-1",
        b"01",
        b"1e3",
        b"99999999",
        b"30001",
        b"00000000000000FF",
        b"0000000000000000",
        b"18446744073709551616",
        b"Bad Class",
        b"a\xffb",
    ];
    let mut hdrs: Vec<(String, Vec<u8>)> = Vec::new();
    let text = |rng: &mut StdRng, max: usize| -> Vec<u8> {
        let n = rng.random_range(1..max);
        let mut v: Vec<u8> = (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 => rng.random_range(0x80..=0xffu8),
                1 => b'/',
                _ => rng.random_range(0x21..=0x7eu8),
            })
            .collect();
        v[0] = b'x'; // no leading or trailing whitespace: HTTP/2 would reset the stream
        v
    };
    for _ in 0..rng.random_range(0..5) {
        let name = NAMES[rng.random_range(0..NAMES.len())];
        let value = match rng.random_range(0..4) {
            0 => BROKEN[rng.random_range(0..BROKEN.len())].to_vec(),
            1 => text(rng, 700),
            2 => b"payments/ok".to_vec(),
            _ => rng.random_range(0..40000u32).to_string().into_bytes(),
        };
        hdrs.push((name.into(), value));
    }
    // Guarantee at least one refusal reason.
    match rng.random_range(0..5) {
        0 => {
            hdrs.push(("x-lock-key".into(), b"payments/dup".to_vec()));
            hdrs.push(("x-lock-key".into(), b"payments/dup".to_vec()));
        }
        1 => hdrs.push(("x-lock-wait-ms".into(), BROKEN[rng.random_range(6..11)].to_vec())),
        2 => hdrs.push(("x-lock-token".into(), text(rng, 30))),
        3 => hdrs.push(("x-lock-session".into(), text(rng, 17))),
        _ => hdrs.push(("x-lock-key".into(), BROKEN[rng.random_range(0..6)].to_vec())),
    }
    if rng.random_bool(0.5) {
        hdrs.push(("x-lock-key".into(), b"payments/dup".to_vec())); // a duplicate
    }
    for forged in ["x-lockmesh-budget-ms", "x-lockmesh-filtered", "x-spiffe-id"] {
        if rng.random_bool(0.2) {
            hdrs.push((forged.into(), text(rng, 40)));
        }
    }
    let routes = [
        (Method::POST, "/v1/locks/acquire"),
        (Method::POST, "/v1/locks/release"),
        (Method::GET, "/v1/locks"),
        (Method::POST, "/v1/sessions"),
        (Method::GET, "/v1/sessions/holds"),
        (Method::POST, "/v1/admin/seal"),
        (Method::PUT, "/v1/locks/acquire"),
        (Method::POST, "/v1/locks/acquire/../release"),
        (Method::from_bytes(b"LOCK").unwrap(), "/%00"),
    ];
    let (m, p) = routes[rng.random_range(0..routes.len())].clone();
    let path = if rng.random_bool(0.1) { format!("{p}?q={}", rng.random::<u16>()) } else { p.into() };
    (m, path, hdrs)
}

#[tokio::test]
async fn ten_thousand_malformed_header_sets_never_crash_the_filter() {
    let st = lock_tier("filter-storm").start().await.unwrap();
    let clients: Vec<LockClient> = (0..4).map(|i| st.client("payments", &format!("storm{i}")).unwrap()).collect();
    let mut rng = StdRng::seed_from_u64(0x10c4_3e5b);
    let requests: Vec<_> = (0..10_000).map(|i| (i, malformed(&mut rng))).collect();
    let t = Instant::now();
    let results: Vec<(u16, String)> = stream::iter(requests)
        .map(|(i, (method, path, hdrs))| {
            let c = clients[i % clients.len()].clone();
            async move {
                let url = format!("{}{path}", c.base_url());
                let mut req = c.http().request(method, url);
                for (n, v) in &hdrs {
                    req = req.header(n.as_str(), reqwest::header::HeaderValue::from_bytes(v).unwrap());
                }
                let resp = req.send().await.unwrap();
                let code = resp.status().as_u16();
                (code, resp.text().await.unwrap_or_default())
            }
        })
        .buffer_unordered(128)
        .collect()
        .await;
    let elapsed = t.elapsed();
    for (code, body) in &results {
        assert!(matches!(code, 400 | 404), "a malformed request was answered {code}: {body}");
    }
    assert!(results.iter().filter(|(c, _)| *c == 400).count() > 5000);
    assert!(elapsed < Duration::from_secs(30), "the storm took {elapsed:?}");
    // Both workers' VMs are alive: good requests on fresh connections succeed.
    for i in 0..6 {
        let c = st.client("payments", &format!("after{i}")).unwrap();
        let r = acquire(&c, &format!("payments/after-{i}"), "0").await;
        assert_eq!(r.code(), 200, "after the storm: {}", r.body);
    }
}

#[tokio::test]
async fn the_lock_tier_rate_limits_each_identity_on_its_own() {
    let st = lock_tier("flt-ratelimit")
        .envoy_replace(
            "token_bucket: { max_tokens: 2000, tokens_per_fill: 2000, fill_interval: 1s }",
            "token_bucket: { max_tokens: 3, tokens_per_fill: 3, fill_interval: 3600s }",
        )
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "noisy").unwrap();
    let b = st.client("payments", "quiet").unwrap();
    let inspect = |c: LockClient| async move { c.get("/v1/locks", &[("x-lock-key", "payments/rl")]).await.unwrap() };
    for _ in 0..3 {
        assert_eq!(inspect(a.clone()).await.code(), 200);
    }
    let before = arbiter_requests(&st).await;
    let r = inspect(a.clone()).await;
    assert_eq!(r.code(), 429, "{}", r.body);
    assert_eq!(r.header("x-lockmesh-error"), Some("rate_limited"));
    assert_eq!(arbiter_requests(&st).await, before, "a rate-limited request reached the arbiter");
    // Another identity has its own bucket.
    assert_eq!(inspect(b).await.code(), 200);
}
