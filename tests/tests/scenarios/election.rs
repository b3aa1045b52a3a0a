//! Issue 22 item 1: leader election (`/v1/elections/*`, `lockmesh_lock::election`)
//! on real etcd, arbiters and Envoys, checked from etcd's own history as the fleet
//! tests are: a watch with `prev_kv` of the stack's root replays every hold, every
//! proclaimed value and every session record in revision order.
//!
//! - Racing campaigners through two Envoys on two arbiters (each Envoy its own
//!   arbiter, so both grant the one key): at most one leader at any revision, the
//!   terms follow each other with increasing tokens, every token a campaigner was
//!   answered is a recorded term, every leader is on a session a campaigner opened,
//!   and a leadership ends no later than its session (a lapsed leader's hold goes
//!   with its lease; a campaigner whose session expired while it waited is answered
//!   `session_expired` and never leads).
//! - An observer that polls late and drops every fifth poll sees exactly the
//!   history's sequence of leadership states (leader, grant time, value), each
//!   once, in order: the resume point loses nothing and invents nothing.
//! - A stale token proclaims nothing, even from the same workload; strangers
//!   neither lead, resign nor proclaim, and see what an inspection shows (no token,
//!   no revision, no session).
//! - The SDK (`Client::campaign`, `Leadership`, `Observer`) and `lockctl elect`.
//!
//! Each planted fault (`lockmesh_lock::test_faults`) makes its check fail:
//! `observe_coalesces` (the observer misses states), `campaign_after_session_loss`
//! (a campaigner leads on a session it never opened) and `proclaim_without_token`
//! (the stale proclaim is stored).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{Ipv4Addr, SocketAddr},
    process::Stdio,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use etcd_client::{EventType, WatchOptions};
use lockmesh_client::{CampaignOptions, Client, Config, Error};
use lockmesh_core::LockKey;
use lockmesh_tests::{client::LockClient, eventually_true, paths::profile_dir, Stack, StackBuilder};
use tokio::time::{sleep, Instant};

const CAMPAIGN: &str = "/v1/elections/campaign";
const PROCLAIM: &str = "/v1/elections/proclaim";
const RESIGN: &str = "/v1/elections/resign";
const OBSERVE: &str = "/v1/elections";
/// The revision part of a fencing token (epoch x 2^48 + revision).
const REV_MASK: u64 = (1 << 48) - 1;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: brief, prefixes: ["payments/brief"], ttl_s: 2, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
  - { name: pool, prefixes: ["payments/pool"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

fn stack(name: &str) -> StackBuilder {
    Stack::builder(name).envoy_config("lock-tier").registry(REGISTRY)
}

/// One arbiter and one Envoy, with `fault` planted.
fn planted(name: &str, fault: &str) -> StackBuilder {
    stack(name).arbiter_extra_yaml(format!("test_faults: [{fault}]")).arbiter_env("LOCKMESH_TEST_FAULTS", "1")
}

/// Starts `b` and waits until every Envoy's arbiter serves a session open: an
/// arbiter reports ready once etcd answers, which under load can come before its
/// class map exists (it then answers `unavailable` for a moment).
async fn start(b: StackBuilder) -> Stack {
    let st = b.start().await.unwrap();
    for i in 0..st.envoy_count() {
        let c = st.client_at(i, "payments", "ready").unwrap();
        lockmesh_tests::eventually(Duration::from_secs(20), async || {
            let r = c.post("/v1/sessions", &[("x-lock-key", "payments/ready")]).await?;
            anyhow::ensure!(r.code() == 200, "not serving yet: {}", r.body);
            let sid = s(&r, "session");
            c.post("/v1/sessions/close", &[("x-lock-session", sid.as_str())]).await?;
            Ok(())
        })
        .await;
    }
    st
}

fn s(r: &lockmesh_tests::client::Resp, field: &str) -> String {
    r.json[field].as_str().unwrap_or_default().to_owned()
}

fn rev_of(token: &str) -> i64 {
    i64::try_from(token.parse::<u64>().unwrap() & REV_MASK).unwrap()
}

fn lease_of(session: &str) -> i64 {
    i64::from_str_radix(session, 16).unwrap()
}

/// The next revision of the shared etcd (where a history starts).
async fn next_revision(st: &Stack) -> i64 {
    let mut c = st.etcd().client().await.unwrap();
    c.get("x", None).await.unwrap().header().unwrap().revision() + 1
}

/// Opens a session of `key`'s class for `c`; returns its id.
async fn open(c: &LockClient, key: &str) -> String {
    let r = c.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    s(&r, "session")
}

/// Renews `sid` every `every` until the task is aborted.
fn keep_alive(c: &LockClient, sid: &str, every: Duration) -> tokio::task::JoinHandle<()> {
    let (c, sid) = (c.clone(), sid.to_owned());
    tokio::spawn(async move {
        loop {
            sleep(every).await;
            let _ = c.post("/v1/sessions/keepalive", &[("x-lock-session", sid.as_str())]).await;
        }
    })
}

// === the history ===

/// One put or delete under the stack's root.
#[derive(Debug, Clone)]
struct Ev {
    rev: i64,
    put: bool,
    key: String,
    create: i64,
    lease: i64,
    value: Vec<u8>,
}

/// Every event under the stack's root from `from` to now (a sentinel of the
/// caller's own ends it: the shared etcd's latest revision may be another test's).
async fn history(st: &Stack, from: i64, name: &str) -> Vec<Ev> {
    let mut c = st.etcd().client().await.unwrap();
    let root = format!("{}/", st.root());
    let sentinel = format!("{}/test/election-history-end-{name}", st.root());
    let end = c.put(sentinel.as_str(), "", None).await.unwrap().header().unwrap().revision();
    let opts = WatchOptions::new().with_prefix().with_start_revision(from).with_prev_key();
    let mut w = c.watch(root.as_str(), Some(opts)).await.unwrap();
    let mut out = Vec::new();
    let mut seen = from - 1;
    while seen < end {
        let r = tokio::time::timeout(Duration::from_secs(10), w.message()).await.unwrap().unwrap().unwrap();
        assert!(!r.canceled(), "the history watch was cancelled (compaction?)");
        for e in r.events() {
            let kv = e.kv().unwrap();
            seen = seen.max(kv.mod_revision());
            if kv.mod_revision() > end || kv.key() == sentinel.as_bytes() {
                continue;
            }
            let put = e.event_type() == EventType::Put;
            let prev = e.prev_kv();
            out.push(Ev {
                rev: kv.mod_revision(),
                put,
                key: String::from_utf8_lossy(kv.key()).into_owned(),
                create: if put { kv.create_revision() } else { prev.map_or(0, |p| p.create_revision()) },
                lease: if put { kv.lease() } else { prev.map_or(0, |p| p.lease()) },
                value: if put { kv.value().to_vec() } else { Vec::new() },
            });
        }
    }
    out
}

/// A leadership as the history shows it.
#[derive(Debug, Clone)]
struct Term {
    create: i64,
    end: Option<i64>,
    lease: i64,
    owner: String,
}

/// A leadership state as an observer sees it: leader, grant time, value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    identity: String,
    since_ms: u64,
    value: Option<String>,
}

/// One election key's history.
#[derive(Debug, Default)]
struct Election {
    terms: Vec<Term>,
    /// The most holds open at one revision.
    max_leaders: usize,
    /// The leadership state after each revision that changed it, from before the
    /// first event on.
    states: Vec<Option<Seen>>,
}

/// Replays `key`'s holds and proclaimed value (as `lockmesh_lock::election` reads
/// them: the hold granted first leads; a value shows only under the token it names).
fn replay(st: &Stack, events: &[Ev], key: &str) -> Election {
    let d = LockKey::parse(key.as_bytes()).unwrap().digest();
    let prefix = format!("{}/l/{d}/", st.root());
    let mut by_rev: BTreeMap<i64, Vec<&Ev>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.key.starts_with(&prefix)) {
        by_rev.entry(e.rev).or_default().push(e);
    }
    let mut entries: HashMap<String, &Ev> = HashMap::new();
    let mut out = Election { states: vec![None], ..Default::default() };
    for (rev, evs) in by_rev {
        for e in evs {
            let hold = e.key.contains("/h/");
            if e.put {
                if hold && !entries.contains_key(&e.key) {
                    let rec: serde_json::Value = serde_json::from_slice(&e.value).unwrap();
                    let owner = rec["owner"].as_str().unwrap().to_owned();
                    out.terms.push(Term { create: e.create, end: None, lease: e.lease, owner });
                }
                entries.insert(e.key.clone(), e);
            } else {
                entries.remove(&e.key);
                if hold {
                    if let Some(t) = out.terms.iter_mut().find(|t| t.create == e.create) {
                        t.end = Some(rev);
                    }
                }
            }
        }
        let holds: Vec<&&Ev> = entries.iter().filter(|(k, _)| k.contains("/h/")).map(|(_, e)| e).collect();
        out.max_leaders = out.max_leaders.max(holds.len());
        let state = holds.iter().min_by_key(|e| e.create).map(|h| {
            let rec: serde_json::Value = serde_json::from_slice(&h.value).unwrap();
            let token = (rec["epoch"].as_u64().unwrap() << 48) + u64::try_from(h.create).unwrap();
            let value = entries.get(&format!("{prefix}e")).and_then(|e| {
                let v: serde_json::Value = serde_json::from_slice(&e.value).ok()?;
                (v["token"].as_str() == Some(token.to_string().as_str()))
                    .then(|| v["value"].as_str().unwrap().to_owned())
            });
            Seen {
                identity: rec["owner"].as_str().unwrap().to_owned(),
                since_ms: rec["acquired_ms"].as_u64().unwrap(),
                value,
            }
        });
        if out.states.last() != Some(&state) {
            out.states.push(state);
        }
    }
    out
}

/// Session records: lease -> the revision its record was deleted (expiry, close or
/// revoke), if it was.
fn session_ends(st: &Stack, events: &[Ev]) -> HashMap<i64, Option<i64>> {
    let prefix = format!("{}/s/", st.root());
    let mut out = HashMap::new();
    // Records only: a session an acquire opened also keeps its hold index under
    // its own prefix (`<root>/s/<session>/h/<digest>`).
    for e in events.iter().filter(|e| e.key.starts_with(&prefix) && !e.key[prefix.len()..].contains('/')) {
        let lease = lease_of(e.key.trim_start_matches(&prefix));
        if e.put {
            out.entry(lease).or_insert(None);
        } else {
            out.insert(lease, Some(e.rev));
        }
    }
    out
}

/// The safety checks on `key`'s terms: one leader at a time with increasing
/// tokens; every leader on a session the campaigners opened (`opened`); no
/// leadership outlives its session, nor begins after it.
fn check_terms(key: &str, e: &Election, opened: &HashSet<i64>, sessions: &HashMap<i64, Option<i64>>) -> Vec<String> {
    let mut v = Vec::new();
    if e.max_leaders > 1 {
        v.push(format!("{key}: {} leaders at one revision: {:?}", e.max_leaders, e.terms));
    }
    for w in e.terms.windows(2) {
        if w[1].create <= w[0].create || w[0].end.is_none_or(|end| w[1].create < end) {
            v.push(format!("{key}: term {:?} began before term {:?} ended", w[1], w[0]));
        }
    }
    for t in &e.terms {
        if !opened.contains(&t.lease) {
            v.push(format!(
                "{key}: {} led on session {:016x}, which no campaigner opened (phantom leadership)",
                t.owner, t.lease
            ));
        }
        if let Some(Some(gone)) = sessions.get(&t.lease) {
            if t.create > *gone || t.end.is_none_or(|end| end > *gone) {
                v.push(format!("{key}: term {t:?} outlived its session, gone at {gone}"));
            }
        }
    }
    v
}

// === racing campaigners and an observer ===

/// `n` campaigners, spread over the stack's Envoys, each leading `rounds` times on
/// its own session with a value of its own; then one more leads with value `end`.
/// Returns the token revisions answered and the sessions opened.
async fn race(st: &Stack, key: &'static str, n: usize, rounds: usize) -> (Vec<i64>, HashSet<i64>) {
    let mut tasks = Vec::new();
    for i in 0..n {
        let c = st.client_at(i % st.envoy_count(), "payments", &format!("c{i}")).unwrap();
        tasks.push(tokio::spawn(async move {
            let sid = open(&c, key).await;
            let ka = keep_alive(&c, &sid, Duration::from_secs(3));
            let mut got = Vec::new();
            for r in 0..rounds {
                let value = format!("c{i}-r{r}");
                let h = [
                    ("x-lock-key", key),
                    ("x-lock-session", sid.as_str()),
                    ("x-lock-wait-ms", "30000"),
                    ("x-lock-value", value.as_str()),
                ];
                let a = c.post(CAMPAIGN, &h).await.unwrap();
                assert_eq!(a.code(), 200, "{}", a.body);
                let t = s(&a, "token");
                got.push(rev_of(&t));
                sleep(Duration::from_millis(40)).await;
                let h = [("x-lock-key", key), ("x-lock-token", t.as_str()), ("x-lock-session", sid.as_str())];
                let rel = c.post(RESIGN, &h).await.unwrap();
                assert_eq!(rel.code(), 200, "{}", rel.body);
            }
            ka.abort();
            (got, lease_of(&sid))
        }));
    }
    let (mut tokens, mut opened) = (Vec::new(), HashSet::new());
    for t in tasks {
        let (got, lease) = t.await.unwrap();
        tokens.extend(got);
        opened.insert(lease);
    }
    let fin = st.client("payments", "fin").unwrap();
    let sid = open(&fin, key).await;
    opened.insert(lease_of(&sid));
    let h = [("x-lock-key", key), ("x-lock-session", sid.as_str()), ("x-lock-value", "end")];
    let a = fin.post(CAMPAIGN, &h).await.unwrap();
    assert_eq!(a.code(), 200, "{}", a.body);
    let t = s(&a, "token");
    tokens.push(rev_of(&t));
    let h = [("x-lock-key", key), ("x-lock-token", t.as_str()), ("x-lock-session", sid.as_str())];
    assert_eq!(fin.post(RESIGN, &h).await.unwrap().code(), 200);
    (tokens, opened)
}

fn seen_of(v: &serde_json::Value) -> Option<Seen> {
    let l = v.get("leader").filter(|l| !l.is_null())?;
    Some(Seen {
        identity: l["identity"].as_str().unwrap().to_owned(),
        since_ms: l["since_ms"].as_u64().unwrap(),
        value: l["value"].as_str().map(str::to_owned),
    })
}

/// Follows `key` through `c` until it sees value `end` (or, once `done` is set, a
/// poll finds no change): the first answer is the state now; then it pauses
/// before every third poll and drops the first and every fifth after it (the
/// answer is never read), resuming from the last cursor it read. The first is
/// dropped so that a drop happens however few polls reach the end (an observer
/// that skips states needs very few). Returns the states seen and how many
/// polls were dropped. Every answer is checked to show no token (the observer
/// leads nothing).
async fn observe_until_end(c: &LockClient, key: &'static str, done: Arc<AtomicBool>) -> (Vec<Option<Seen>>, usize) {
    let first = c.get(OBSERVE, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(first.code(), 200, "{}", first.body);
    let mut states = vec![seen_of(&first.json)];
    let mut cursor = s(&first, "cursor");
    let deadline = Instant::now() + Duration::from_secs(90);
    let (mut dropped, mut i) = (0, 0usize);
    while states.last().and_then(|s| s.as_ref()).and_then(|s| s.value.as_deref()) != Some("end") {
        assert!(Instant::now() < deadline, "the observer never saw the end: {states:?}");
        i += 1;
        if i % 3 == 0 {
            sleep(Duration::from_millis(300)).await;
        }
        let h = [("x-lock-key", key), ("x-lock-after", cursor.as_str()), ("x-lock-wait-ms", "2000")];
        if i % 5 == 1 {
            let (c, after) = (c.clone(), cursor.clone());
            let lost = tokio::spawn(async move {
                let h = [("x-lock-key", key), ("x-lock-after", after.as_str()), ("x-lock-wait-ms", "2000")];
                c.get(OBSERVE, &h).await
            });
            sleep(Duration::from_millis(100)).await;
            lost.abort();
            dropped += 1;
            continue;
        }
        let r = c.get(OBSERVE, &h).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let leader = &r.json["leader"];
        assert!(leader.is_null() || leader.get("token").is_none(), "an observer was shown a token: {}", r.body);
        cursor = s(&r, "cursor");
        if r.json["changed"] == true {
            states.push(seen_of(&r.json));
        } else if done.load(Ordering::SeqCst) {
            break;
        }
    }
    (states, dropped)
}

/// Racing campaigners and a late, lossy observer on `key`. Returns the violations
/// of the history's checks and of the observer's view.
async fn race_and_observe(st: &Stack, key: &'static str, n: usize, rounds: usize) -> Vec<String> {
    let from = next_revision(st).await;
    let obs = st.client_at(st.envoy_count() - 1, "billing", "observer").unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let observer = {
        let (obs, done) = (obs.clone(), done.clone());
        tokio::spawn(async move { observe_until_end(&obs, key, done).await })
    };
    sleep(Duration::from_millis(300)).await;
    let (tokens, opened) = race(st, key, n, rounds).await;
    done.store(true, Ordering::SeqCst);
    let (seen, dropped) = observer.await.unwrap();
    assert!(dropped > 0, "no poll was dropped: the resume after a drop went untested");
    let events = history(st, from, "race").await;
    let e = replay(st, &events, key);
    let mut v = check_terms(key, &e, &opened, &session_ends(st, &events));
    let creates: Vec<i64> = e.terms.iter().map(|t| t.create).collect();
    let mut sorted = tokens.clone();
    sorted.sort_unstable();
    if sorted != creates {
        v.push(format!("{key}: tokens answered {sorted:?} vs terms recorded {creates:?}"));
    }
    assert_eq!(e.terms.len(), n * rounds + 1, "{key}: the race led {} times: {:?}", e.terms.len(), e.terms);
    // The observer saw the history's states from the one it started at, each once
    // and in order, up to the final leader's value.
    let start = e.states.iter().position(|x| *x == seen[0]);
    let end = e.states.iter().position(|x| x.as_ref().and_then(|s| s.value.as_deref()) == Some("end"));
    match (start, end) {
        (Some(a), Some(b)) if e.states[a..=b] == seen[..] => {}
        _ => v.push(format!(
            "{key}: the observer saw {} states, the history has {}: observer {seen:?} history {:?}",
            seen.len(),
            e.states.len(),
            e.states
        )),
    }
    v
}

// === sessions that end ===

/// A campaigner waits on a session that is never renewed while another leads; a
/// leader's session is never renewed while another waits. Returns the violations:
/// the waiter must be answered `session_expired` and never lead, the lapsed
/// leader's term must end with its session, and no leader may sit on a session
/// nobody opened.
async fn sessions_that_end(st: &Stack, waited: &'static str, lapsed: &'static str) -> Vec<String> {
    let from = next_revision(st).await;
    let mut opened = HashSet::new();
    let (l, p, q, r) = (
        st.client("payments", "l").unwrap(),
        st.client("payments", "p").unwrap(),
        st.client("payments", "q").unwrap(),
        st.client("payments", "r").unwrap(),
    );
    // L leads `waited` and renews; P waits for it on a session nobody renews.
    let sl = open(&l, waited).await;
    let ka_l = keep_alive(&l, &sl, Duration::from_millis(500));
    let a = l.post(CAMPAIGN, &[("x-lock-key", waited), ("x-lock-session", &sl)]).await.unwrap();
    assert_eq!(a.code(), 200, "{}", a.body);
    let tl = s(&a, "token");
    let sp = open(&p, waited).await;
    let waiter = {
        let (p, sp) = (p.clone(), sp.clone());
        tokio::spawn(async move {
            let h = [("x-lock-key", waited), ("x-lock-session", sp.as_str()), ("x-lock-wait-ms", "20000")];
            p.post(CAMPAIGN, &h).await.unwrap()
        })
    };
    // Q leads `lapsed` on a session nobody renews; R waits for it and renews.
    let sq = open(&q, lapsed).await;
    let a = q.post(CAMPAIGN, &[("x-lock-key", lapsed), ("x-lock-session", &sq)]).await.unwrap();
    assert_eq!(a.code(), 200, "{}", a.body);
    let sr = open(&r, lapsed).await;
    let ka_r = keep_alive(&r, &sr, Duration::from_millis(500));
    let h = [("x-lock-key", lapsed), ("x-lock-session", sr.as_str()), ("x-lock-wait-ms", "20000")];
    let after_lapse = r.post(CAMPAIGN, &h).await.unwrap();
    assert_eq!(after_lapse.code(), 200, "R leads once Q's session lapsed: {}", after_lapse.body);
    for sid in [&sl, &sp, &sq, &sr] {
        opened.insert(lease_of(sid));
    }
    // P's session is gone too by now (same TTL, opened before Q's): then L resigns.
    let mut etcd = st.etcd().client().await.unwrap();
    let rec = format!("{}/s/{sp}", st.root());
    let gone = Instant::now() + Duration::from_secs(10);
    while etcd.get(rec.as_str(), None).await.unwrap().count() > 0 {
        assert!(Instant::now() < gone, "P's session never expired");
        sleep(Duration::from_millis(100)).await;
    }
    let h = [("x-lock-key", waited), ("x-lock-token", tl.as_str()), ("x-lock-session", sl.as_str())];
    assert_eq!(l.post(RESIGN, &h).await.unwrap().code(), 200);
    let answer = tokio::time::timeout(Duration::from_secs(25), waiter).await.unwrap().unwrap();
    ka_l.abort();
    ka_r.abort();
    let mut v = Vec::new();
    if answer.code() != 410 || s(&answer, "code") != "session_expired" {
        v.push(format!(
            "a campaign whose session expired while it waited was answered {}: {}",
            answer.code(),
            answer.body
        ));
    }
    let events = history(st, from, "sessions").await;
    let sessions = session_ends(st, &events);
    for key in [waited, lapsed] {
        v.extend(check_terms(key, &replay(st, &events, key), &opened, &sessions));
    }
    // The lapsed leader's term ended at its session's end (checked above), and R's
    // began after it.
    let e = replay(st, &events, lapsed);
    assert_eq!(e.terms.len(), 2, "{lapsed}: {:?}", e.terms);
    v
}

#[tokio::test]
async fn racing_campaigners_on_two_arbiters_lead_one_at_a_time_and_never_past_their_session() {
    let st = start(stack("election-race").envoy_per_arbiter(2)).await;
    let t = Instant::now();
    let (raced, ended) = tokio::join!(
        race_and_observe(&st, "payments/leader-race", 6, 2),
        sessions_that_end(&st, "payments/brief/waited", "payments/brief/lapsed")
    );
    assert!(raced.is_empty(), "{raced:#?}");
    assert!(ended.is_empty(), "{ended:#?}");
    eprintln!("election race: {:?}", t.elapsed());
}

#[tokio::test]
async fn planted_an_observer_answered_the_state_now_misses_leaderships() {
    let st = start(planted("election-planted-observe", "observe_coalesces")).await;
    let v = race_and_observe(&st, "payments/leader-coalesced", 6, 2).await;
    assert!(v.iter().any(|m| m.contains("the observer saw")), "the planted observer missed nothing: {v:#?}");
}

#[tokio::test]
async fn planted_a_campaign_that_outlives_its_session_leads_on_a_session_nobody_opened() {
    let st = start(planted("election-planted-session", "campaign_after_session_loss")).await;
    let v = sessions_that_end(&st, "payments/brief/waited-p", "payments/brief/lapsed-p").await;
    assert!(v.iter().any(|m| m.contains("session expired while it waited was answered 200")), "{v:#?}");
    assert!(v.iter().any(|m| m.contains("phantom leadership")), "{v:#?}");
}

// === proclaim, and what strangers can do ===

/// A leader resigns and the same workload leads again on another session; the
/// first leadership's token then proclaims. Returns the violations: the stale
/// proclaim must be refused `not_holder` and the value stay the current leader's.
async fn stale_proclaim(st: &Stack, key: &str) -> (Vec<String>, String, String, String) {
    let (a1, a2) = (st.client("payments", "a").unwrap(), st.client("payments", "a").unwrap());
    let obs = st.client("billing", "observer").unwrap();
    let s1 = open(&a1, key).await;
    let r =
        a1.post(CAMPAIGN, &[("x-lock-key", key), ("x-lock-session", &s1), ("x-lock-value", "first")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t1 = s(&r, "token");
    let h = [("x-lock-key", key), ("x-lock-token", t1.as_str()), ("x-lock-session", s1.as_str())];
    assert_eq!(a1.post(RESIGN, &h).await.unwrap().code(), 200);
    let s2 = open(&a2, key).await;
    let r =
        a2.post(CAMPAIGN, &[("x-lock-key", key), ("x-lock-session", &s2), ("x-lock-value", "second")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t2 = s(&r, "token");
    assert!(t2.parse::<u64>().unwrap() > t1.parse::<u64>().unwrap(), "{t1} then {t2}");
    let mut v = Vec::new();
    let stale =
        a1.post(PROCLAIM, &[("x-lock-key", key), ("x-lock-token", &t1), ("x-lock-value", "stale")]).await.unwrap();
    if (stale.code(), s(&stale, "code").as_str()) != (409, "not_holder") {
        v.push(format!("a stale token's proclaim was answered {}: {}", stale.code(), stale.body));
    }
    let now = obs.get(OBSERVE, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(now.code(), 200, "{}", now.body);
    if now.json["leader"]["value"] != "second" {
        v.push(format!("the leader's value is not its own after a stale proclaim: {}", now.body));
    }
    (v, t2, s2, now.json["cursor"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_stale_token_proclaims_nothing_and_strangers_neither_lead_nor_see_tokens() {
    let st = start(stack("election-stale")).await;
    let key = "payments/leader-stale";
    let (v, t2, s2, cursor) = stale_proclaim(&st, key).await;
    assert!(v.is_empty(), "{v:#?}");
    let a2 = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();
    let obs = st.client("billing", "observer").unwrap();
    let refused = |r: &lockmesh_tests::client::Resp| (r.code(), s(r, "code"));
    // A leadership is one slot: permits and modes are refused, naming the header.
    for (h, v) in [("x-lock-permits", "2"), ("x-lock-mode", "shared")] {
        let r = b.post(CAMPAIGN, &[("x-lock-key", key), (h, v)]).await.unwrap();
        assert_eq!(refused(&r), (400, "bad_request".to_owned()), "{h}: {}", r.body);
        assert!(s(&r, "message").starts_with(h), "{}", r.body);
    }

    // The leader proclaims under its token, on its session.
    let h = [("x-lock-key", key), ("x-lock-token", t2.as_str()), ("x-lock-session", s2.as_str())];
    let r = a2.post(PROCLAIM, &[h[0], h[1], h[2], ("x-lock-value", "10.0.0.7:8443 primary")]).await.unwrap();
    assert_eq!((r.code(), r.json["proclaimed"].as_bool()), (200, Some(true)), "{}", r.body);
    // Another workload of the same namespace, with the leader's token: nothing.
    for path in [PROCLAIM, RESIGN] {
        let r = b.post(path, &[h[0], h[1], ("x-lock-value", "b")]).await.unwrap();
        assert_eq!(refused(&r), (409, "not_holder".into()), "{path}: {}", r.body);
    }
    // A workload that may only inspect `payments`: denied, like an acquire.
    for path in [CAMPAIGN, PROCLAIM, RESIGN] {
        let r = obs.post(path, &[h[0], h[1], ("x-lock-value", "obs")]).await.unwrap();
        assert_eq!(refused(&r), (403, "denied".into()), "{path}: {}", r.body);
    }
    // What it sees: who leads, since when and the value; no token, revision or session.
    let seen = obs.get(OBSERVE, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(seen.code(), 200, "{}", seen.body);
    assert_eq!(seen.json["leader"]["identity"], st.pki().workload_spiffe_id("payments", "a"), "{}", seen.body);
    assert_eq!(seen.json["leader"]["value"], "10.0.0.7:8443 primary", "{}", seen.body);
    let rev = rev_of(&t2);
    for secret in [t2.clone(), s2.clone(), format!("\"revision\":{rev}"), format!(":{rev},"), format!(":{rev}}}")] {
        assert!(!seen.body.contains(&secret), "observation leaked {secret:?}: {}", seen.body);
    }
    // The cursor is 32 hex digits: a MAC tag and the revision under a pad. Its
    // plain encoding must not show (a decimal substring check was no test: two
    // digits occur in random hex about one time in eight).
    let sealed = seen.json["cursor"].as_str().unwrap();
    assert!(!sealed.contains(&format!("{rev:016x}")), "the cursor shows the revision in the clear: {}", seen.body);
    // Naming another's session shows nothing either; the leader naming its own sees its token.
    let r = b.get(OBSERVE, &[("x-lock-key", key), ("x-lock-session", &s2)]).await.unwrap();
    assert_eq!(refused(&r), (410, "session_expired".into()), "{}", r.body);
    let own = a2.get(OBSERVE, &[("x-lock-key", key), ("x-lock-session", &s2)]).await.unwrap();
    assert_eq!(
        (own.json["leader"]["token"].as_str(), own.json["leader"]["you"].as_bool()),
        (Some(t2.as_str()), Some(true))
    );

    // A resume point: the proclamation is the one change after the stale-check's cursor.
    let r =
        obs.get(OBSERVE, &[("x-lock-key", key), ("x-lock-after", &cursor), ("x-lock-wait-ms", "2000")]).await.unwrap();
    assert_eq!(
        (r.json["changed"].as_bool(), r.json["leader"]["value"].as_str()),
        (Some(true), Some("10.0.0.7:8443 primary"))
    );
    let next = s(&r, "cursor");
    let t = Instant::now();
    let r = obs.get(OBSERVE, &[("x-lock-key", key), ("x-lock-after", &next), ("x-lock-wait-ms", "300")]).await.unwrap();
    assert_eq!((r.json["changed"].as_bool(), s(&r, "cursor")), (Some(false), next.clone()), "{}", r.body);
    assert!(t.elapsed() >= Duration::from_millis(250), "the poll did not wait: {:?}", t.elapsed());
    // A cursor this arbiter did not make resumes nothing, and says so.
    let r =
        obs.get(OBSERVE, &[("x-lock-key", key), ("x-lock-after", "0123456789abcdef0123456789abcdef")]).await.unwrap();
    assert_eq!(
        (r.code(), r.json["gap"].as_bool(), r.json["changed"].as_bool()),
        (200, Some(true), Some(true)),
        "{}",
        r.body
    );

    // Bad input, with the header named.
    for (path, hdrs, header) in [
        (OBSERVE, vec![("x-lock-key", key), ("x-lock-after", "42")], "x-lock-after"),
        (CAMPAIGN, vec![("x-lock-key", key), ("x-lock-value", " lead")], "x-lock-value"),
        (PROCLAIM, vec![("x-lock-key", key), ("x-lock-token", t2.as_str())], "x-lock-value"),
        (CAMPAIGN, vec![("x-lock-key", "payments/pool/leader")], "x-lock-key"),
        (OBSERVE, vec![("x-lock-key", "payments/pool/leader")], "x-lock-key"),
        (RESIGN, vec![("x-lock-key", key), ("x-lock-grant", "5f0c2b7e91d4a8c3e07b6a5d4c3b2a19")], "x-lock-grant"),
    ] {
        let m = if path == OBSERVE { reqwest::Method::GET } else { reqwest::Method::POST };
        let r = a2.request(m, path, &hdrs, Vec::new()).await.unwrap();
        assert_eq!(refused(&r), (400, "bad_request".into()), "{path} {hdrs:?}: {}", r.body);
        assert!(s(&r, "message").starts_with(header), "{path}: {}", r.body);
    }
    // Resigned: nobody leads, and the token is spent.
    assert_eq!(a2.post(RESIGN, &h).await.unwrap().code(), 200);
    assert_eq!(refused(&a2.post(RESIGN, &h).await.unwrap()), (409, "not_holder".into()));
    assert!(obs.get(OBSERVE, &[("x-lock-key", key)]).await.unwrap().json["leader"].is_null());
}

#[tokio::test]
async fn planted_a_proclaim_that_checks_the_identity_only_takes_a_stale_token() {
    let st = start(planted("election-planted-proclaim", "proclaim_without_token")).await;
    let (v, ..) = stale_proclaim(&st, "payments/leader-stale-p").await;
    assert!(v.iter().any(|m| m.contains("stale token's proclaim was answered 200")), "{v:#?}");
    assert!(v.iter().any(|m| m.contains("not its own")), "{v:#?}");
}

// === the SDK and lockctl elect ===

fn config(st: &Stack, sa: &str) -> Config {
    let cert = st.pki().client("payments", sa).unwrap();
    let port = st.envoy().listener_port();
    let mut c =
        Config::new(format!("https://localhost:{port}"), st.pki().ca_cert_path(), cert.cert_path, cert.key_path);
    c.resolve = Some(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    c
}

fn sdk(st: &Stack, sa: &str) -> Client {
    Client::new(config(st, sa), |_| {}).unwrap()
}

fn opts(value: &str) -> CampaignOptions {
    CampaignOptions { value: Some(value.into()), ..Default::default() }
}

#[tokio::test]
async fn the_sdk_campaigns_observes_proclaims_and_stops_a_campaign_with_its_session() {
    let st = start(stack("election-sdk")).await;
    let from = next_revision(&st).await;
    let key = "payments/leader-sdk";
    let (a, b, c) = (sdk(&st, "a"), sdk(&st, "b"), sdk(&st, "c"));
    let id = |sa: &str| st.pki().workload_spiffe_id("payments", sa);

    let mut lead_a = a.campaign(key, opts("a")).await.unwrap();
    let mut watch = b.observe(key);
    let o = watch.next().await.unwrap();
    let l = o.leader.clone().unwrap();
    assert_eq!((l.identity, l.value.as_deref(), l.token, l.you, o.changed), (id("a"), Some("a"), None, false, false));
    lead_a.proclaim("a2").await.unwrap();
    let l = watch.next().await.unwrap().leader.unwrap();
    assert_eq!((l.value.as_deref(), lead_a.value()), (Some("a2"), Some("a2")));
    let own = lead_a.observe().next().await.unwrap().leader.unwrap();
    assert_eq!((own.you, own.token), (true, Some(lead_a.token())));
    // C campaigns behind A for longer than one round: it stays in, on one session.
    let rounds = CampaignOptions { round: Some(Duration::from_millis(700)), ..opts("c") };
    let behind = {
        let c = c.clone();
        tokio::spawn(async move { c.campaign(key, rounds).await })
    };
    sleep(Duration::from_millis(1800)).await;
    assert!(!behind.is_finished(), "C's campaign ended while A led");
    let ta = lead_a.token();
    lead_a.resign().await.unwrap();
    let lead_c = behind.await.unwrap().unwrap();
    assert!(lead_c.token() > ta, "a later leader's token is larger");
    // B saw every change in order: nobody, C, C's value.
    let mut after = Vec::new();
    while after.last().map(|o: &lockmesh_client::Observation| o.leader.as_ref().and_then(|l| l.value.clone()))
        != Some(Some("c".into()))
    {
        after.push(tokio::time::timeout(Duration::from_secs(10), watch.next()).await.unwrap().unwrap());
    }
    let mut seen: Vec<_> =
        after.iter().map(|o| o.leader.as_ref().map(|l| (l.identity.clone(), l.value.clone()))).collect();
    // A resign that hands the key to a waiter on the same arbiter leaves no
    // revision without a leader.
    if seen.first() == Some(&None) {
        seen.remove(0);
    }
    assert_eq!(seen, vec![Some((id("c"), None)), Some((id("c"), Some("c".into())))], "{after:?}");
    assert!(after.iter().all(|o| o.changed && !o.gap));
    lead_c.resign().await.unwrap();

    // D campaigns behind H on a brief session (TTL 2 s), and the arbiter stops
    // (SIGSTOP): no keepalive and no answer. D's fence deadline passes while its
    // campaign request hangs: the campaign ends then, with the loss, while the
    // arbiter is still stopped; the arbiter resumes only once etcd dropped D's
    // session, and D never leads.
    let brief = "payments/brief/sdk";
    let h = st.client("payments", "h").unwrap();
    let sh = open(&h, brief).await;
    let ka = keep_alive(&h, &sh, Duration::from_millis(500));
    let r = h.post(CAMPAIGN, &[("x-lock-key", brief), ("x-lock-session", &sh)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let d = sdk(&st, "d");
    let campaign = {
        let d = d.clone();
        tokio::spawn(async move { d.campaign(brief, CampaignOptions::default()).await })
    };
    let sid = {
        let d = d.clone();
        lockmesh_tests::eventually(Duration::from_secs(10), async || {
            let s = d.sessions().into_iter().next().ok_or_else(|| anyhow::anyhow!("no session yet"))?;
            anyhow::ensure!(s.clock.acked >= 1, "no keepalive acknowledged yet");
            Ok(s.session)
        })
        .await
    };
    sleep(Duration::from_millis(200)).await;
    assert!(!campaign.is_finished(), "D's campaign ended while H led");
    st.arbiter(0).pause().unwrap();
    let paused = Instant::now();
    let mut etcd = st.etcd().client().await.unwrap();
    let rec = format!("{}/s/{sid}", st.root());
    while !campaign.is_finished() || etcd.get(rec.as_str(), None).await.unwrap().count() > 0 {
        if paused.elapsed() > Duration::from_secs(8) {
            st.arbiter(0).resume().unwrap();
            panic!("8 s after the arbiter stopped: campaign ended {}", campaign.is_finished());
        }
        sleep(Duration::from_millis(50)).await;
    }
    let stopped_for = paused.elapsed();
    st.arbiter(0).resume().unwrap();
    let ended = campaign.await.unwrap();
    assert!(matches!(ended, Err(Error::SessionLost(_))), "{ended:?}");
    ka.abort();
    sleep(Duration::from_millis(500)).await;
    let events = history(&st, from, "sdk").await;
    let terms = replay(&st, &events, brief).terms;
    assert!(terms.iter().all(|t| t.owner != id("d")), "D led after its session was lost: {terms:?}");
    assert!(d.held().is_empty());
    eprintln!("the campaign ended, and etcd dropped its session, {stopped_for:?} after the arbiter stopped");
    for cl in [a, b, c, d] {
        cl.shutdown().await;
    }
}

fn lockctl_elect(st: &Stack, sa: &str, name: &str, extra: &[&str], script: &str) -> tokio::process::Command {
    let cert = st.pki().client("payments", sa).unwrap();
    let port = st.envoy().listener_port();
    let mut cmd = tokio::process::Command::new(profile_dir().join("lockctl"));
    cmd.arg("elect")
        .arg("--endpoint")
        .arg(format!("https://localhost:{port}"))
        .arg("--resolve")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--ca")
        .arg(st.pki().ca_cert_path())
        .arg("--cert")
        .arg(&cert.cert_path)
        .arg("--cert-key")
        .arg(&cert.key_path)
        .args(extra)
        .arg(name)
        .args(["--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

async fn file_line(path: &std::path::Path) -> String {
    let read = || std::fs::read_to_string(path).unwrap_or_default();
    eventually_true(Duration::from_secs(15), "the command started as leader", || async { read().ends_with('\n') })
        .await;
    read()
}

#[tokio::test]
async fn lockctl_elect_runs_the_command_only_while_leader() {
    let st = start(stack("election-lockctl")).await;
    let from = next_revision(&st).await;
    let name = "payments/brief/cron";
    let dir = tempfile::tempdir().unwrap();
    let (out1, out2) = (dir.path().join("one"), dir.path().join("two"));
    let obs = st.client("billing", "observer").unwrap();
    // One: leads, and is stopped (SIGTERM) when its session is revoked.
    let s1 = format!(
        "echo \"$LOCKMESH_SESSION $LOCKMESH_TOKEN\" > {o}; trap 'echo term >> {o}; exit 42' TERM; while :; do sleep 0.1; done",
        o = out1.display()
    );
    let one = lockctl_elect(&st, "one", name, &["--value", "host-one", "--grace-ms", "5000"], &s1).spawn().unwrap();
    let line = file_line(&out1).await;
    let (session1, token1) = line.trim().split_once(' ').unwrap();
    let seen = obs.get(OBSERVE, &[("x-lock-key", name)]).await.unwrap();
    assert_eq!(seen.json["leader"]["value"], "host-one", "{}", seen.body);
    // Two: campaigns behind it; its command must not start while One leads.
    let s2 = format!("echo \"$LOCKMESH_TOKEN\" > {o}; sleep 0.3; exit 7", o = out2.display());
    let two = lockctl_elect(&st, "two", name, &["--value", "host-two"], &s2).spawn().unwrap();
    sleep(Duration::from_millis(1500)).await;
    assert!(!out2.exists(), "two ran its command while one led");
    st.etcd().client().await.unwrap().lease_revoke(lease_of(session1)).await.unwrap();
    let o = tokio::time::timeout(Duration::from_secs(10), one.wait_with_output()).await.unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(42), "{stderr}");
    assert!(stderr.contains("lockctl elect: leadership lost (session_expired)"), "{stderr}");
    assert!(std::fs::read_to_string(&out1).unwrap().ends_with("term\n"), "one's command got no SIGTERM");
    // Two leads with a larger token, runs, exits 7 and resigns.
    let o = tokio::time::timeout(Duration::from_secs(15), two.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", String::from_utf8_lossy(&o.stderr));
    let token2: u64 = std::fs::read_to_string(&out2).unwrap().trim().parse().unwrap();
    assert!(token2 > token1.parse::<u64>().unwrap());
    assert!(obs.get(OBSERVE, &[("x-lock-key", name)]).await.unwrap().json["leader"].is_null(), "two did not resign");
    // From the history: Two's term began after One's ended.
    let events = history(&st, from, "lockctl").await;
    let e = replay(&st, &events, name);
    assert_eq!(e.terms.len(), 2, "{:?}", e.terms);
    assert!(e.terms[0].end.is_some_and(|end| end <= e.terms[1].create), "{:?}", e.terms);
    // Not leader within --wait-ms: 75, and the command never runs.
    let a = st.client("payments", "a").unwrap();
    let r = a.post(CAMPAIGN, &[("x-lock-key", name)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let o = lockctl_elect(&st, "three", name, &["--wait-ms", "200"], "exit 0").output().await.unwrap();
    assert_eq!(o.status.code(), Some(75), "{}", String::from_utf8_lossy(&o.stderr));
}
