//! Issues 4 and 5: a fleet of two Envoys and two arbiters on one etcd. Exactness is
//! checked from the store's own recorded history, never from timings: a watch with
//! `prev_kv` on every hold of the stack's root replays each grant (a hold created)
//! and each end (a hold deleted) in revision order; at no revision does a key have
//! more holders than its limit, every token a client received is one of those
//! creations, and every release a client was answered 200 for is one of those ends.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use lockmesh_core::LockKey;
use lockmesh_tests::Stack;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
/// The revision part of a fencing token (epoch x 2^48 + revision).
const REV_MASK: u64 = (1 << 48) - 1;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pool, prefixes: ["payments/pool"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// What the clients saw: per key, the revisions of the tokens granted and of the
/// grants whose release was answered 200.
#[derive(Default, Debug)]
struct Seen {
    granted: Vec<i64>,
    released: Vec<i64>,
}

/// One hold as the history shows it.
#[derive(Debug, Clone)]
struct Span {
    create: i64,
    end: Option<i64>,
}

/// The replayed history of every key under the root: its holds and the largest
/// number open at one revision.
#[derive(Debug, Default)]
struct Replay {
    spans: HashMap<String, Vec<Span>>,
    max: HashMap<String, usize>,
}

fn digest(key: &str) -> String {
    LockKey::parse(key.as_bytes()).unwrap().digest().to_string()
}

fn rev_of(token: &str) -> i64 {
    i64::try_from(token.parse::<u64>().unwrap() & REV_MASK).unwrap()
}

/// The next revision of the shared etcd (where a history starts).
async fn next_revision(st: &Stack) -> i64 {
    let mut c = st.etcd().client().await.unwrap();
    c.get("x", None).await.unwrap().header().unwrap().revision() + 1
}

/// Replays every put and delete under `<root>/l/` from `from` to now, grouped by
/// revision (a session's expiry deletes several holds in one revision).
async fn replay(st: &Stack, from: i64) -> Replay {
    let mut c = st.etcd().client().await.unwrap();
    let prefix = format!("{}/l/", st.root());
    // A sentinel under the prefix ends the history: the shared etcd's latest
    // revision may belong to another test's keys, which this watch never sees.
    let sentinel = format!("{prefix}~history-end");
    let end = c.put(sentinel.as_str(), "", None).await.unwrap().header().unwrap().revision();
    let opts = WatchOptions::new().with_prefix().with_start_revision(from).with_prev_key();
    let mut w = c.watch(prefix.as_str(), Some(opts)).await.unwrap();
    // slot key -> (digest, create revision) of the open holds
    let mut open: HashMap<Vec<u8>, (String, i64)> = HashMap::new();
    let mut out = Replay::default();
    let mut by_rev: BTreeMap<i64, Vec<(EventType, Vec<u8>, i64)>> = BTreeMap::new();
    let mut seen = from - 1;
    while seen < end {
        let r = tokio::time::timeout(Duration::from_secs(10), w.message()).await.unwrap().unwrap().unwrap();
        assert!(!r.canceled(), "the history watch was cancelled (compaction?)");
        for e in r.events() {
            let kv = e.kv().unwrap();
            seen = seen.max(kv.mod_revision());
            if kv.key() == sentinel.as_bytes() {
                continue;
            }
            let create = match e.event_type() {
                EventType::Put => kv.create_revision(),
                EventType::Delete => e.prev_kv().map(|p| p.create_revision()).unwrap_or(0),
            };
            by_rev.entry(kv.mod_revision()).or_default().push((e.event_type(), kv.key().to_vec(), create));
        }
    }
    for (rev, events) in by_rev {
        let mut touched = Vec::new();
        for (ty, key, create) in events {
            let k = String::from_utf8_lossy(&key).into_owned();
            let d = k.trim_start_matches(&prefix).split('/').next().unwrap().to_owned();
            match ty {
                EventType::Put => {
                    if let Some((_, was)) = open.insert(key.clone(), (d.clone(), create)) {
                        assert_eq!(was, create, "hold {k} rewritten at {rev} with another create revision");
                    } else {
                        out.spans.entry(d.clone()).or_default().push(Span { create, end: None });
                    }
                }
                EventType::Delete => {
                    if let Some((_, c)) = open.remove(&key) {
                        assert_eq!(c, create, "prev_kv of the delete at {rev} names another hold");
                        let s = out.spans.entry(d.clone()).or_default().iter_mut().find(|s| s.create == c).unwrap();
                        s.end = Some(rev);
                    }
                }
            }
            touched.push(d);
        }
        for d in touched {
            let n = open.values().filter(|(x, _)| *x == d).count();
            let m = out.max.entry(d).or_default();
            *m = (*m).max(n);
        }
    }
    out
}

/// Checks the clients' view against the history: every token is a hold created
/// for that key at the token's revision, every 200 release is that hold's end.
fn check_seen(r: &Replay, key: &str, seen: &Seen) {
    let spans = r.spans.get(&digest(key)).unwrap_or_else(|| panic!("no history for {key}"));
    for g in &seen.granted {
        assert!(spans.iter().any(|s| s.create == *g), "{key}: token revision {g} is not a recorded grant");
    }
    for rel in &seen.released {
        let s = spans.iter().find(|s| s.create == *rel).unwrap();
        assert!(s.end.is_some_and(|e| e > *rel), "{key}: released grant {rel} has no recorded end: {s:?}");
    }
    assert_eq!(spans.len(), seen.granted.len(), "{key}: recorded grants vs tokens handed out");
}

/// `clients` clients, spread over the stack's Envoys, each taking `key` `rounds`
/// times through its own session and releasing it after `hold`.
async fn race(st: &Stack, key: &'static str, clients: usize, rounds: usize, hold: Duration) -> Seen {
    let mut tasks = Vec::new();
    for i in 0..clients {
        let c = st.client_at(i % st.envoy_count(), "payments", &format!("c{i}")).unwrap();
        tasks.push(tokio::spawn(async move {
            let mut seen = Seen::default();
            let s = c.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
            assert_eq!(s.code(), 200, "{}", s.body);
            let sid = s.json["session"].as_str().unwrap().to_owned();
            for _ in 0..rounds {
                let h = [("x-lock-key", key), ("x-lock-session", sid.as_str()), ("x-lock-wait-ms", "30000")];
                let r = c.post(ACQ, &h).await.unwrap();
                assert_eq!(r.code(), 200, "{}", r.body);
                let t = r.json["token"].as_str().unwrap().to_owned();
                seen.granted.push(rev_of(&t));
                tokio::time::sleep(hold).await;
                let h = [("x-lock-key", key), ("x-lock-token", t.as_str()), ("x-lock-session", sid.as_str())];
                let rel = c.post(REL, &h).await.unwrap();
                assert_eq!(rel.code(), 200, "{}", rel.body);
                seen.released.push(rev_of(&t));
            }
            seen
        }));
    }
    let mut all = Seen::default();
    for t in tasks {
        let s = t.await.unwrap();
        all.granted.extend(s.granted);
        all.released.extend(s.released);
    }
    all
}

/// Acquire requests one arbiter answered (`/metrics`).
async fn acquires_served(st: &Stack, i: usize) -> u64 {
    let (_, m) = st.arbiter(i).admin_get("/metrics").await.unwrap();
    m.lines()
        .filter(|l| l.starts_with("lockmesh_arbiter_requests_total{route=\"acquire\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// Races N = 1 and N = 3 at once and checks both from the history.
async fn race_both(st: &Stack, mutex: &'static str, pool: &'static str) {
    let from = next_revision(st).await;
    let (m, p) = tokio::join!(
        race(st, mutex, 32, 2, Duration::from_millis(40)),
        race(st, pool, 32, 2, Duration::from_millis(80))
    );
    let r = replay(st, from).await;
    assert_eq!(r.max.get(&digest(mutex)), Some(&1), "a mutex had two holders: {:?}", r.spans.get(&digest(mutex)));
    // The pool reached its limit (the race was real) and never passed it.
    assert_eq!(r.max.get(&digest(pool)), Some(&3), "pool of 3: {:?}", r.spans.get(&digest(pool)));
    check_seen(&r, mutex, &m);
    check_seen(&r, pool, &p);
    assert_eq!((m.granted.len(), p.granted.len()), (64, 64));
}

#[tokio::test]
async fn two_envoys_two_arbiters_ring_never_exceed_the_limit() {
    let st = Stack::builder("fleet-ring")
        .envoy_config("lock-tier")
        .arbiters(2)
        .envoys(2)
        .registry(REGISTRY)
        .start()
        .await
        .unwrap();
    // Each Envoy's cluster lists both arbiters: keys spread over both.
    for i in 0..16 {
        let c = st.client_at(i % 2, "payments", "spread").unwrap();
        let key = format!("payments/spread-{i}");
        let r = c.post(ACQ, &[("x-lock-key", key.as_str())]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let t = r.json["token"].as_str().unwrap().to_owned();
        let rel = c.post(REL, &[("x-lock-key", key.as_str()), ("x-lock-token", t.as_str())]).await.unwrap();
        assert_eq!(rel.code(), 200, "{}", rel.body);
    }
    let (a0, a1) = (acquires_served(&st, 0).await, acquires_served(&st, 1).await);
    assert!(a0 > 0 && a1 > 0 && a0 + a1 == 16, "ring hash spread 16 keys as {a0} + {a1}");
    race_both(&st, "payments/mutex-r", "payments/pool/r").await;
}

#[tokio::test]
async fn two_arbiters_racing_for_every_key_never_exceed_the_limit() {
    // The Envoys disagree on membership (as during a rollout): Envoy 0 sends every
    // key to arbiter 0 and Envoy 1 to arbiter 1, so both arbiters grant each key.
    let st = Stack::builder("fleet-split")
        .envoy_config("lock-tier")
        .envoy_per_arbiter(2)
        .registry(REGISTRY)
        .start()
        .await
        .unwrap();
    race_both(&st, "payments/mutex-s", "payments/pool/s").await;
    let (a0, a1) = (acquires_served(&st, 0).await, acquires_served(&st, 1).await);
    assert_eq!((a0, a1), (64, 64), "each arbiter served its Envoy's 16 + 16 clients x 2 rounds");
}

/// Polls arbiter `i`'s `/status` until its registry has been reloaded `n` times.
async fn reloaded(st: &Stack, i: usize, n: u64) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = st.arbiter(i).admin_get("/status").await.unwrap();
        let s: serde_json::Value = serde_json::from_str(&body).unwrap();
        if s["classes"]["registry"]["reloads"].as_u64() >= Some(n) {
            return s["classes"].clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "arbiter {i} never reloaded: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs `lockctl class apply FILE` against the stack's etcd root.
fn apply(st: &Stack, file: &std::path::Path) -> (i32, serde_json::Value, String) {
    let eps = st.etcd().endpoints().join(",");
    let out = std::process::Command::new(lockmesh_tests::paths::profile_dir().join("lockctl"))
        .args(["class", "apply"])
        .arg(file)
        .args(["--endpoints", &eps, "--root", st.root(), "--actor", "test", "--reason", "split the pool"])
        .envs(st.etcd_env("lockmesh-classes"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), json, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn reassigning_a_prefix_drains_and_never_yields_two_holders_of_one_key() {
    let st = Stack::builder("fleet-move")
        .envoy_config("lock-tier")
        .arbiters(2)
        .envoys(2)
        .registry(REGISTRY)
        .start()
        .await
        .unwrap();
    let from = next_revision(&st).await;
    let key = "payments/pool/m/1";
    let (c0, c1) = (st.client_at(0, "payments", "a").unwrap(), st.client_at(1, "payments", "b").unwrap());
    let mut held = Vec::new();
    for c in [&c0, &c1] {
        let r = c.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
        assert_eq!((r.code(), r.json["class"].as_str()), (200, Some("pool")), "{}", r.body);
        held.push(r.json["token"].as_str().unwrap().to_owned());
    }
    // The registry moves payments/pool/m to a mutex class; every arbiter reloads it.
    let v2 = format!(
        "{REGISTRY}  - {{ name: solo, prefixes: [\"payments/pool/m\"], ttl_s: 15, enforcement: advisory, \
         risk_owner: t, waiver_expiry: \"2099-12-31\" }}\n"
    );
    for (i, a) in st.arbiters().iter().enumerate() {
        std::fs::write(a.config_path().with_file_name("registry.yaml"), &v2).unwrap();
        let s = reloaded(&st, i, 1).await;
        assert_eq!(s["map_matches_registry"], false, "{s}");
    }
    // Desired is not authoritative: the moved key is refused rather than guessed.
    let r = c0.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("unavailable")), "{}", r.body);
    // Apply while the key is held: both classes drain, nothing switches.
    let file = st.arbiter(0).config_path().with_file_name("registry.yaml");
    let (code, j, err) = apply(&st, &file);
    assert_eq!((code, j["outcome"].as_str(), j["held"].as_u64()), (2, Some("held"), Some(2)), "{j} {err}");
    assert_eq!(j["classes"], serde_json::json!(["pool", "solo"]), "{j}");
    let r = c1.post(ACQ, &[("x-lock-key", "payments/pool/other")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("draining")), "{}", r.body);
    for (c, t) in [(&c0, &held[0]), (&c1, &held[1])] {
        let r = c.post(REL, &[("x-lock-key", key), ("x-lock-token", t)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    // Released: the re-run applies the map and reopens both classes at once.
    let (code, j, err) = apply(&st, &file);
    assert_eq!((code, j["outcome"].as_str()), (0, Some("applied")), "{j} {err}");
    let mut etcd = st.etcd().client().await.unwrap();
    let m = etcd.get(format!("{}/sys/classmap", st.root()), None).await.unwrap();
    let switched = m.kvs()[0].mod_revision();
    for i in 0..2 {
        assert_eq!(reloaded(&st, i, 1).await["map_matches_registry"], true);
    }
    let r = c1.post(ACQ, &[("x-lock-key", "payments/pool/other")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    // The key is now a mutex across the fleet.
    let seen = race(&st, key, 8, 2, Duration::from_millis(30)).await;
    let before = replay(&st, from).await;
    let after = replay(&st, switched).await;
    assert_eq!(before.max.get(&digest(key)), Some(&2), "{:?}", before.spans.get(&digest(key)));
    assert_eq!(after.max.get(&digest(key)), Some(&1), "{:?}", after.spans.get(&digest(key)));
    check_seen(&after, key, &seen);
    assert!(before.spans[&digest(key)].iter().all(|s| s.end.is_some_and(|e| e < switched) || s.create > switched));
}
