//! k permits of an N-semaphore (`x-lock-permits`) and read-write locks
//! (`x-lock-mode`), issue 22 items 2 and 4, checked from etcd's own history.
//!
//! One grant transaction puts all k of a grant's slot keys (so they share one
//! create revision, the token's), under a compare that each is free and that no
//! slot at N or above is held; an exclusive grant takes all N. The replay below
//! reads every put and delete of the keys' hold slots in revision order and checks,
//! after each revision: never more than N slots held; every grant's slots present
//! all together or not at all (its record says how many it took); an exclusive
//! grant never beside any other grant. Clients race through two Envoys, each
//! talking to its own arbiter, so two arbiters grant the same keys.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use lockmesh_tests::{LockClient, Stack, StackBuilder};
use serde_json::Value;

use super::holds::{hold_events, start_revision};

const N: usize = 4;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pool, prefixes: ["payments/perm", "payments/rw"], ttl_s: 15, max_holders: 4, enforcement: advisory,
      risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

/// Two arbiters, Envoy i talking to arbiter i only.
fn stack(name: &str) -> StackBuilder {
    Stack::builder(name).envoy_config("lock-tier").registry(REGISTRY).envoy_per_arbiter(2)
}

/// One grant as the history shows it: its slots' shared create revision, how many
/// slots its record says it took, and whether it is exclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    grant: i64,
    permits: usize,
    exclusive: bool,
}

/// What the replay found: the most slots held at once per key, and every breach
/// of the three properties (empty: none).
#[derive(Debug, Default)]
struct Replay {
    max_held: HashMap<String, usize>,
    exclusive_grants: usize,
    multi_grants: usize,
    breaches: Vec<String>,
}

/// Checks the state of one key after revision `rev`.
fn check_key(rev: i64, digest: &str, held: &BTreeMap<Vec<u8>, Held>, out: &mut Replay) {
    let m = out.max_held.entry(digest.to_owned()).or_default();
    *m = (*m).max(held.len());
    if held.len() > N {
        out.breaches.push(format!("revision {rev}: {} slots of {digest} held, limit {N}", held.len()));
    }
    let mut grants: BTreeMap<i64, (usize, Held)> = BTreeMap::new();
    for h in held.values() {
        grants.entry(h.grant).or_insert((0, *h)).0 += 1;
    }
    for (g, (slots, h)) in &grants {
        if *slots != h.permits {
            out.breaches.push(format!("revision {rev}: grant {g} of {digest} has {slots} of its {} slots", h.permits));
        }
        if h.exclusive && grants.len() > 1 {
            out.breaches
                .push(format!("revision {rev}: exclusive grant {g} of {digest} beside {} others", grants.len() - 1));
        }
    }
}

/// Replays every hold slot put and delete of the run (`holds::hold_events`),
/// checking each key a revision touched once that revision is complete.
async fn replay(st: &Stack, from: i64) -> Replay {
    let mut held: HashMap<String, BTreeMap<Vec<u8>, Held>> = HashMap::new();
    let mut out = Replay::default();
    let mut touched: Vec<String> = Vec::new();
    let mut at = 0;
    for e in hold_events(st, from).await {
        if e.revision != at {
            for d in touched.drain(..) {
                check_key(at, &d, &held[&d], &mut out);
            }
            at = e.revision;
        }
        let slots = held.entry(e.digest.clone()).or_default();
        if e.put {
            let permits = e.value["permits"].as_u64().map_or(1, |p| p as usize);
            let exclusive = e.value["mode"] == "exclusive";
            if e.create_revision == e.revision && slots.values().all(|h| h.grant != e.create_revision) {
                out.exclusive_grants += usize::from(exclusive);
                out.multi_grants += usize::from(permits > 1);
            }
            slots.insert(e.key, Held { grant: e.create_revision, permits, exclusive });
        } else {
            slots.remove(&e.key);
        }
        if !touched.contains(&e.digest) {
            touched.push(e.digest);
        }
    }
    for d in touched.drain(..) {
        check_key(at, &d, &held[&d], &mut out);
    }
    out
}

/// `rounds` acquire/hold/release cycles of `key` by one client with `extra`
/// headers (its permits or mode), on a session of its own.
async fn cycle(c: LockClient, key: &'static str, extra: Vec<(&'static str, String)>, rounds: usize) {
    let s = c.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(s.code(), 200, "{}", s.body);
    let sid = s.json["session"].as_str().unwrap().to_owned();
    for _ in 0..rounds {
        let mut h: Vec<(&str, &str)> = vec![("x-lock-key", key), ("x-lock-session", &sid), ("x-lock-wait-ms", "30000")];
        h.extend(extra.iter().map(|(k, v)| (*k, v.as_str())));
        let r = c.post("/v1/locks/acquire", &h).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let t = r.json["token"].as_str().unwrap().to_owned();
        tokio::time::sleep(Duration::from_millis(120)).await;
        let rel = c
            .post("/v1/locks/release", &[("x-lock-key", key), ("x-lock-token", &t), ("x-lock-session", &sid)])
            .await
            .unwrap();
        assert_eq!(rel.code(), 200, "{}", rel.body);
    }
}

/// Clients racing on both Envoys: k-permit takers (k = 1..3) of one key, shared
/// and exclusive holders of another.
async fn race(st: &Stack) {
    let mut tasks = Vec::new();
    for i in 0..12 {
        let c = st.client_at(i % 2, "payments", &format!("p{i}")).unwrap();
        let k = 1 + i % 3;
        tasks.push(tokio::spawn(cycle(c, "payments/perm/a", vec![("x-lock-permits", k.to_string())], 4)));
    }
    for i in 0..10 {
        let c = st.client_at(i % 2, "payments", &format!("rw{i}")).unwrap();
        let mode = if i % 3 == 0 { "exclusive" } else { "shared" };
        tasks.push(tokio::spawn(cycle(c, "payments/rw/a", vec![("x-lock-mode", mode.to_owned())], 3)));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn permits_and_modes_keep_the_limit_all_or_nothing_under_racing_clients_on_two_arbiters() {
    let _one_at_a_time = super::CONTENDED.lock().await;
    let st = stack("permits-race").start().await.unwrap();
    let from = start_revision(&st).await;
    race(&st).await;
    let r = replay(&st, from).await;
    assert!(r.breaches.is_empty(), "{:#?}", r.breaches);
    // The race was real: multi-slot and exclusive grants happened and a key
    // reached its limit.
    assert!(r.multi_grants >= 8 && r.exclusive_grants >= 12, "{r:?}");
    assert!(r.max_held.values().any(|m| *m == N), "{r:?}");
}

/// The same race against arbiters that count the holders and then put a grant's
/// slots without comparing (`test_faults: [count_before_lock]`): the replay must
/// find more than N slots held.
#[tokio::test]
async fn planted_permits_counted_before_the_grant_are_caught() {
    let _one_at_a_time = super::CONTENDED.lock().await;
    let st = stack("permits-planted")
        .arbiter_extra_yaml("test_faults: [count_before_lock]")
        .arbiter_env("LOCKMESH_TEST_FAULTS", "1")
        .start()
        .await
        .unwrap();
    let from = start_revision(&st).await;
    race(&st).await;
    let r = replay(&st, from).await;
    assert!(r.breaches.iter().any(|b| b.contains("limit 4")), "not caught: {r:?}");
}

/// Waiting is FIFO across modes: a writer queued behind two readers is granted
/// before a reader that came after it, although that reader's slot was free all
/// along; the reader follows the writer's release with a higher token.
#[tokio::test]
async fn a_waiting_writer_is_not_overtaken_by_later_readers() {
    let st = stack("permits-fifo").start().await.unwrap();
    let key = "payments/rw/fifo";
    let acquire = |who: &str, mode: &'static str| {
        let c = st.client("payments", who).unwrap();
        async move {
            let h = [("x-lock-key", key), ("x-lock-mode", mode), ("x-lock-wait-ms", "20000")];
            let r = c.post("/v1/locks/acquire", &h).await.unwrap();
            assert_eq!(r.code(), 200, "{}", r.body);
            (c, r.json["token"].as_str().unwrap().to_owned())
        }
    };
    let release = |c: &LockClient, t: &str| {
        let (c, t) = (c.clone(), t.to_owned());
        async move {
            let r = c.post("/v1/locks/release", &[("x-lock-key", key), ("x-lock-token", &t)]).await.unwrap();
            assert_eq!(r.code(), 200, "{}", r.body);
        }
    };
    let (r1, t1) = acquire("r1", "shared").await;
    let (r2, t2) = acquire("r2", "shared").await;
    let w = tokio::spawn(acquire("w", "exclusive"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let r3 = tokio::spawn(acquire("r3", "shared"));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!w.is_finished() && !r3.is_finished(), "the writer waits for the readers; the later reader behind it");
    release(&r1, &t1).await;
    release(&r2, &t2).await;
    let (wc, tw) = tokio::time::timeout(Duration::from_secs(10), w).await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!r3.is_finished(), "a reader beside the writer");
    release(&wc, &tw).await;
    let (_, t3) = tokio::time::timeout(Duration::from_secs(10), r3).await.unwrap().unwrap();
    assert!(tw.parse::<u64>().unwrap() < t3.parse::<u64>().unwrap(), "writer {tw}, later reader {t3}");
}

/// Bad asks get `400 bad_request` naming the header, and nothing is held after them;
/// a release frees exactly the grant's k slots, and a re-acquire on the same
/// session answers the existing grant.
#[tokio::test]
async fn bad_asks_are_refused_and_a_release_frees_exactly_its_permits() {
    let st = stack("permits-edges").start().await.unwrap();
    let c = st.client("payments", "a").unwrap();
    let key = "payments/perm/edges";
    for (h, v) in [
        ("x-lock-permits", "0"),
        ("x-lock-permits", "5"),
        ("x-lock-permits", "65"),
        ("x-lock-permits", "two"),
        ("x-lock-permits", "+2"),
        ("x-lock-mode", "read"),
        ("x-lock-mode", "EXCLUSIVE"),
    ] {
        let r = c.post("/v1/locks/acquire", &[("x-lock-key", key), (h, v)]).await.unwrap();
        assert_eq!((r.code(), r.header("x-lockmesh-error")), (400, Some("bad_request")), "{h}: {v}: {}", r.body);
        assert!(r.body.contains(h), "{h}: {}", r.body);
    }
    // Both at once leave it open what was asked.
    let r = c
        .post("/v1/locks/acquire", &[("x-lock-key", key), ("x-lock-permits", "2"), ("x-lock-mode", "shared")])
        .await
        .unwrap();
    assert_eq!(r.code(), 400, "{}", r.body);
    // (Their `_` twins are refused like every lock header's: the bypass corpus,
    // `bypass.rs`, sends them over HTTP/1.1 and HTTP/2.)
    // The slots in use: a multi-slot holder shows once, with its `permits`.
    let in_use = |c: LockClient| async move {
        let r = c.get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        r.json["holders"].as_array().unwrap().iter().map(|h| h["permits"].as_u64().unwrap_or(1)).sum::<u64>()
    };
    assert_eq!(in_use(c.clone()).await, 0);

    let s = c.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    let take = |k: &'static str| {
        let (c, sid) = (c.clone(), sid.clone());
        async move {
            c.post("/v1/locks/acquire", &[("x-lock-key", key), ("x-lock-permits", k), ("x-lock-session", &sid)])
                .await
                .unwrap()
        }
    };
    let a = take("3").await;
    assert_eq!((a.code(), &a.json["permits"]), (200, &Value::from(3)), "{}", a.body);
    // The same session asking again: the grant it has.
    let again = take("3").await;
    assert_eq!(
        (again.code(), &again.json["existing"], &again.json["token"]),
        (200, &Value::Bool(true), &a.json["token"])
    );
    // One slot is left: another holder's 2 are gated, 1 is granted.
    let b = st.client("payments", "b").unwrap();
    let r = b.post("/v1/locks/acquire", &[("x-lock-key", key), ("x-lock-permits", "2")]).await.unwrap();
    assert_eq!((r.code(), r.json["reason"].as_str()), (409, Some("key_gated")), "{}", r.body);
    let one = b.post("/v1/locks/acquire", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(one.code(), 200, "{}", one.body);
    assert_eq!(in_use(c.clone()).await, 4);
    // Releasing the 3-permit grant frees its 3 slots, not the other holder's.
    let t = a.json["token"].as_str().unwrap();
    let rel = c
        .post("/v1/locks/release", &[("x-lock-key", key), ("x-lock-token", t), ("x-lock-session", &sid)])
        .await
        .unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    assert_eq!(in_use(c.clone()).await, 1);
    let r = b.post("/v1/locks/acquire", &[("x-lock-key", key), ("x-lock-permits", "3")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert_eq!(in_use(c).await, 4);
}

/// The SDK's `LockOptions::permits` and `LockOptions::mode` send the headers and
/// hold what they asked for: a shared and a 2-permit holder leave one of 4 slots,
/// so an exclusive ask is refused at once; once both release, it is granted, with a
/// token above both; asking both options at once is a configuration error.
#[tokio::test]
async fn the_sdk_takes_permits_and_modes() {
    use lockmesh_client::{Error, LockMode, LockOptions};
    let st = stack("permits-sdk").start().await.unwrap();
    let key = "payments/perm/sdk";
    let clients: Vec<_> =
        ["a", "b", "c"].iter().map(|sa| super::sdk::sdk(super::sdk::config(&st, "payments", sa)).0).collect();
    let shared = clients[0].lock(key, LockOptions::default().mode(LockMode::Shared)).await.unwrap();
    let two = clients[1].lock(key, LockOptions::default().permits(2)).await.unwrap();
    let r = st.client("payments", "x").unwrap().get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
    let used: u64 = r.json["holders"].as_array().unwrap().iter().map(|h| h["permits"].as_u64().unwrap_or(1)).sum();
    assert_eq!(used, 3, "{}", r.body);
    let exclusive = LockOptions::default().mode(LockMode::Exclusive);
    assert!(matches!(clients[2].lock(key, exclusive.clone()).await, Err(Error::Contended { .. })));
    let both = LockOptions::default().permits(2).mode(LockMode::Shared);
    assert!(matches!(clients[2].lock(key, both).await, Err(Error::Config { field: "permits", .. })));
    let (t1, t2) = (shared.token(), two.token());
    shared.release().await.unwrap();
    two.release().await.unwrap();
    let w = clients[2].lock(key, exclusive.wait(Duration::from_secs(10))).await.unwrap();
    assert!(w.token() > t1 && w.token() > t2);
    let r = st.client("payments", "x").unwrap().get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.json["holders"][0]["permits"], N as u64, "{}", r.body);
    assert_eq!(r.json["holders"][0]["mode"], "exclusive", "{}", r.body);
    w.release().await.unwrap();
    for c in &clients {
        c.shutdown().await;
    }
}
