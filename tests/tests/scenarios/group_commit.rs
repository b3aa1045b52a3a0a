//! Grants and releases committed in groups (GUARANTEES G1, G2; docs/DECISIONS.md
//! ADR-34): the arbiter sends the grants and releases that arrive while its
//! previous transaction is in flight as one etcd transaction of nested
//! transactions, each with its own compares and outcome.
//!
//! Every stack here has its own etcd (so its raft counters are the scenario's)
//! and reaches it through a latency proxy holding each request a few
//! milliseconds, as a remote etcd would: a group is in flight long enough for
//! the next one to gather, whatever the machine's speed.
//!
//! - 64 holders, each cycling its own key on its own session, cost etcd under
//!   0.2 raft proposals per grant (one per grant and one per release alone), and
//!   no group is refused (`group_clock_in_member`: every member puts the clock,
//!   etcd refuses the groups).
//! - 8 holders per key on 8 keys through two arbiters, trying once and holding
//!   briefly: never two holders of one key at a time, and no group refused
//!   (`group_same_key`: two operations on one key in a group, which etcd refuses
//!   as a whole).
//! - Holders whose sessions die while they keep acquiring are refused, and never
//!   fail their neighbours' group (`group_member_outcome_ignored`: a member
//!   refused inside a committed group is told it holds the key;
//!   `group_no_lease_guard`: the dead member puts on its dead lease and etcd
//!   refuses the group).
//! - A group whose answer is lost (`group_answer_lost`, as when it misses the
//!   deadline) is resolved member by member through the attempt fence: the holds
//!   on the session are exactly the keys answered 200
//!   (`group_unknown_guessed`: members answer `unavailable` without resolving).
//! - On an etcd started with small `--max-txn-ops` / `--max-request-bytes` and
//!   an arbiter told the same, groups grow to the limit and etcd refuses none
//!   (planted bad config: the arbiter told a larger limit than etcd's, and etcd
//!   refuses groups as too many operations / too large).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use lockmesh_tests::{client::Resp, LockClient, Stack};
use tokio::time::Instant;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

/// Each way on the arbiter's etcd link.
const LINK_DELAY: Duration = Duration::from_millis(8);

async fn stack(name: &str, faults: &[&str]) -> Stack {
    stack_of(name, faults, 1).await
}

/// With `n` arbiters, each behind its own Envoy: two holders of one key on two
/// Envoys are two arbiters racing for it, so grants are refused inside groups.
async fn stack_of(name: &str, faults: &[&str], n: usize) -> Stack {
    let mut b = Stack::builder(name).envoy_config("lock-tier").registry(REGISTRY).own_etcd(1).arbiter_etcd_latency();
    if n > 1 {
        b = b.arbiters(n);
        for i in 0..n {
            b = b.envoy_arbiters(i, &[i]);
        }
    }
    if !faults.is_empty() {
        b = b
            .arbiter_extra_yaml(format!("test_faults: [{}]", faults.join(", ")))
            .arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    let st = b.start().await.unwrap();
    st.etcd_latency().set_delay(LINK_DELAY);
    st
}

fn field(r: &Resp, name: &str) -> String {
    r.json[name].as_str().unwrap_or_else(|| panic!("no {name}: {}", r.body)).to_owned()
}

/// Opens a session of `key`'s class for `c`.
async fn open(c: &LockClient, key: &str) -> String {
    let r = c.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    field(&r, "session")
}

/// The arbiters' group counters, summed (the largest group: the largest of
/// any): (groups, members, largest, refusals by cause).
async fn groups(st: &Stack) -> (f64, f64, f64, HashMap<String, f64>) {
    let (mut groups, mut members, mut largest, mut refused) = (0.0, 0.0, 0.0f64, HashMap::new());
    for a in st.arbiters() {
        let (_, text) = a.admin_get("/metrics").await.unwrap();
        let value = |line: &str| line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        let find = |name: &str| text.lines().find(|l| l.starts_with(name)).map_or(0.0, value);
        for l in text.lines().filter(|l| l.starts_with("lockmesh_arbiter_group_refusals_total{")) {
            let cause = l.split('"').nth(1).unwrap_or_default().to_owned();
            *refused.entry(cause).or_insert(0.0) += value(l);
        }
        groups += find("lockmesh_arbiter_group_commits_total ");
        members += find("lockmesh_arbiter_group_members_total ");
        largest = largest.max(find("lockmesh_arbiter_group_largest "));
    }
    (groups, members, largest, refused)
}

/// Groups etcd refused before applying (every cause but `moved`).
fn refused_by_etcd(r: &HashMap<String, f64>) -> Vec<(String, f64)> {
    let mut v: Vec<_> =
        r.iter().filter(|(c, n)| c.as_str() != "moved" && **n > 0.0).map(|(c, n)| (c.clone(), *n)).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

async fn proposals(st: &Stack) -> f64 {
    st.etcd().member(0).metric("etcd_server_proposals_committed_total").await.unwrap()
}

/// What `holders` holders did in `secs` seconds of cycling.
#[derive(Debug, Default)]
struct Cycled {
    grants: u64,
    /// Acquires answered anything but 200 or `409 contended`, releases anything but 200.
    errors: Vec<String>,
    /// A holder answered 200 for a key another holder held (by this test's own book).
    overlaps: Vec<String>,
}

/// `holders` holders on `keys` keys (holder i on key i % keys, through Envoy
/// i % Envoys), each on its own session, cycling for `run`: acquire (trying
/// once), hold `hold`, release.
async fn cycle(st: &Stack, holders: usize, keys: usize, run: Duration, hold: Duration) -> Cycled {
    cycle_waiting(st, (holders, keys), run, hold, "0").await
}

/// [`cycle`] whose acquires wait up to `wait_ms` (a grant's etcd call may take
/// that long, not only the 500 ms a try-once acquire gets).
async fn cycle_waiting(
    st: &Stack,
    (holders, keys): (usize, usize),
    run: Duration,
    hold: Duration,
    wait_ms: &'static str,
) -> Cycled {
    let book: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let out: Arc<Mutex<Cycled>> = Arc::default();
    // Sessions opened together (16 at a time): one after the other, the first
    // would be older than the class TTL by the end of a run of 256 holders.
    let clients: Vec<_> = futures::stream::iter(0..holders)
        .map(|i| async move {
            let c = st.client_at(i % st.envoy_count(), "payments", &format!("h{i}")).unwrap();
            let key = format!("payments/group/k{}", i % keys);
            let sid = open(&c, &key).await;
            (i, c, key, sid)
        })
        .buffered(16)
        .collect()
        .await;
    let until = Instant::now() + run;
    let tasks = clients.into_iter().map(|(i, c, key, sid)| {
        let (book, out) = (book.clone(), out.clone());
        tokio::spawn(async move {
            while Instant::now() < until {
                let a =
                    c.post(ACQ, &[("x-lock-key", &key), ("x-lock-session", &sid), ("x-lock-wait-ms", wait_ms)]).await;
                let a = a.unwrap();
                match a.code() {
                    200 => {}
                    409 if a.body.contains("contended") => {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        continue;
                    }
                    _ => {
                        out.lock().unwrap().errors.push(format!("acquire {key}: {} {}", a.code(), a.body));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                }
                let token = field(&a, "token");
                if let Some(other) = book.lock().unwrap().insert(key.clone(), i) {
                    out.lock()
                        .unwrap()
                        .overlaps
                        .push(format!("{key}: holder {i} granted while holder {other} held it"));
                }
                out.lock().unwrap().grants += 1;
                tokio::time::sleep(hold).await;
                book.lock().unwrap().retain(|k, h| !(k == &key && *h == i));
                let r = c.post(REL, &[("x-lock-key", &key), ("x-lock-token", &token), ("x-lock-session", &sid)]).await;
                let r = r.unwrap();
                if r.code() != 200 {
                    out.lock().unwrap().errors.push(format!("release {key}: {} {}", r.code(), r.body));
                }
            }
        })
    });
    for t in tasks.collect::<Vec<_>>() {
        t.await.unwrap();
    }
    Arc::try_unwrap(out).unwrap().into_inner().unwrap()
}

/// 64 holders each cycling its own key: raft proposals per grant and the group
/// counters.
async fn many_keys(name: &str, faults: &[&str]) -> (f64, Cycled, (f64, f64, f64, HashMap<String, f64>)) {
    let st = stack(name, faults).await;
    // Sessions are opened inside `cycle`; count from the first acquire on.
    let warm = cycle(&st, 64, 64, Duration::from_millis(300), Duration::ZERO).await;
    assert!(warm.grants > 0, "{warm:?}");
    let before = proposals(&st).await;
    let c = cycle(&st, 64, 64, Duration::from_secs(3), Duration::ZERO).await;
    let spent = proposals(&st).await - before;
    // The second `cycle` opened 64 sessions: a lease grant and a session put each.
    let per_grant = (spent - 128.0).max(0.0) / c.grants.max(1) as f64;
    (per_grant, c, groups(&st).await)
}

/// Group commit happens: 64 holders cost under 0.2 raft proposals per grant,
/// releases included, and etcd refuses no group.
#[tokio::test]
async fn sixty_four_holders_cost_etcd_under_a_fifth_of_a_proposal_per_grant() {
    let (per_grant, c, (groups, members, largest, refused)) = many_keys("group-many", &[]).await;
    eprintln!("{per_grant:.3} proposals per grant; {} grants; {groups} groups of {members} members, largest {largest}; {refused:?}", c.grants);
    assert!(c.errors.is_empty(), "{:?}", &c.errors[..c.errors.len().min(5)]);
    assert!(c.grants >= 64, "{c:?}");
    assert!(largest >= 8.0, "no group of 8 formed: largest {largest}");
    assert_eq!(refused_by_etcd(&refused), vec![], "groups refused by etcd");
    assert!(per_grant < 0.2, "{per_grant:.3} raft proposals per grant");
}

/// Its planted twin: a member carrying the grant clock itself, as a lone grant
/// does, makes etcd refuse every group of two grants or more (the clock key put
/// twice); each member then goes alone.
#[tokio::test]
async fn planted_the_clock_inside_each_member_is_caught() {
    let (per_grant, c, (.., refused)) = many_keys("group-many-planted", &["group_clock_in_member"]).await;
    eprintln!("{per_grant:.3} proposals per grant; {} grants; {refused:?}", c.grants);
    assert!(!refused_by_etcd(&refused).is_empty() && per_grant >= 0.2, "the planted clock went unnoticed: {per_grant}");
}

/// 8 holders per key on 8 keys, trying once, half of them through each of two
/// arbiters: grants of one key race across the arbiters, so some are refused
/// inside a committed group.
async fn contended(name: &str, faults: &[&str]) -> (Cycled, HashMap<String, f64>, f64) {
    let st = stack_of(name, faults, 2).await;
    let c = cycle(&st, 64, 8, Duration::from_secs(3), Duration::from_millis(3)).await;
    let (.., largest, refused) = groups(&st).await;
    (c, refused, largest)
}

/// Never two holders of one key, and no group refused, while 64 holders contend
/// for 8 keys in groups.
#[tokio::test]
async fn holders_contending_in_groups_never_hold_one_key_together() {
    let (c, refused, largest) = contended("group-contended", &[]).await;
    eprintln!("{} grants, largest group {largest}, {refused:?}", c.grants);
    assert!(c.overlaps.is_empty(), "{:?}", c.overlaps);
    assert!(c.errors.is_empty(), "{:?}", &c.errors[..c.errors.len().min(5)]);
    assert!(c.grants >= 8 && largest >= 2.0, "{c:?} largest {largest}");
    assert_eq!(refused_by_etcd(&refused), vec![], "groups refused by etcd");
}

/// Its planted twin: grants of one key in one group (etcd refuses the group).
#[tokio::test]
async fn planted_two_grants_of_one_key_in_a_group_are_caught() {
    let (c, refused, _) = contended("group-contended-same-key", &["group_same_key"]).await;
    assert!(refused.get("duplicate_key").copied().unwrap_or(0.0) > 0.0, "{refused:?} ({} grants)", c.grants);
}

/// 32 holders cycling their own keys while 8 more keep acquiring on sessions
/// whose leases were revoked in etcd (as an expiry does, unseen by the arbiter):
/// (refusals by cause, the live holders' grants, what the dead ones were answered).
async fn dead_leases(name: &str, faults: &[&str]) -> (HashMap<String, f64>, u64, Vec<u16>) {
    let st = stack(name, faults).await;
    let mut etcd = st.etcd().client().await.unwrap();
    let mut dead = Vec::new();
    for i in 0..8 {
        let c = st.client("payments", &format!("d{i}")).unwrap();
        let key = format!("payments/group/dead{i}");
        let sid = open(&c, &key).await;
        etcd.lease_revoke(i64::from_str_radix(&sid, 16).unwrap()).await.unwrap();
        dead.push((c, key, sid));
    }
    let live = {
        let st = &st;
        async move { cycle(st, 32, 32, Duration::from_secs(3), Duration::ZERO).await }
    };
    let dying = async {
        let until = Instant::now() + Duration::from_secs(3);
        let mut codes = Vec::new();
        while Instant::now() < until {
            let sends = dead.iter().map(|(c, key, sid)| async move {
                c.post(ACQ, &[("x-lock-key", key.as_str()), ("x-lock-session", sid.as_str()), ("x-lock-wait-ms", "0")])
                    .await
            });
            for r in futures::future::join_all(sends).await {
                codes.push(r.unwrap().code());
            }
        }
        codes
    };
    let (c, codes) = tokio::join!(live, dying);
    assert!(c.errors.is_empty(), "{:?}", &c.errors[..c.errors.len().min(5)]);
    (groups(&st).await.3, c.grants, codes)
}

/// A member whose session lease is gone fails its own compare, never its group.
#[tokio::test]
async fn a_dead_session_in_a_group_never_fails_its_neighbours() {
    let (refused, grants, codes) = dead_leases("group-dead-lease", &[]).await;
    eprintln!("{grants} live grants; dead answered {:?}; {refused:?}", &codes[..codes.len().min(8)]);
    assert!(grants >= 32, "{grants}");
    assert!(codes.iter().all(|c| *c != 200), "a dead session was granted: {codes:?}");
    assert_eq!(refused_by_etcd(&refused), vec![], "groups refused by etcd");
}

/// A planted twin: a member refused inside a committed group (its session's
/// lease compare failed) is answered granted.
#[tokio::test]
async fn planted_a_members_outcome_ignored_is_caught() {
    let (_, _, codes) = dead_leases("group-dead-lease-ignored", &["group_member_outcome_ignored"]).await;
    assert!(codes.contains(&200), "no dead session granted under the planted outcome: {codes:?}");
}

/// Its planted twin: the member skips its lease compare; etcd refuses the whole
/// group for the dead lease.
#[tokio::test]
async fn planted_a_member_without_its_lease_guard_is_caught() {
    let (refused, ..) = dead_leases("group-dead-lease-planted", &["group_no_lease_guard"]).await;
    assert!(refused.get("lease_not_found").copied().unwrap_or(0.0) > 0.0, "{refused:?}");
}

/// Rounds of 12 concurrent try-once acquires on one session whose groups'
/// answers are lost: (answered 200, holds on the session nobody was answered for).
async fn answers_lost(name: &str, faults: &[&str]) -> (usize, Vec<String>) {
    let mut all = vec!["group_answer_lost"];
    all.extend_from_slice(faults);
    let st = stack(name, &all).await;
    let c = st.client("payments", "lost").unwrap();
    let (mut granted, mut leaked) = (0, Vec::new());
    for round in 0..3 {
        let sid = open(&c, "payments/lost/x").await;
        let keys: Vec<String> = (0..12).map(|i| format!("payments/lost/r{round}k{i}")).collect();
        let sends = keys.iter().map(|k| {
            let (c, sid) = (&c, &sid);
            async move {
                c.post(ACQ, &[("x-lock-key", k.as_str()), ("x-lock-session", sid.as_str()), ("x-lock-wait-ms", "0")])
                    .await
            }
        });
        let mut answered = Vec::new();
        for (k, r) in keys.iter().zip(futures::future::join_all(sends).await) {
            let r = r.unwrap();
            match r.code() {
                200 => answered.push(k.clone()),
                503 | 409 => {}
                _ => panic!("unexpected answer for {k}: {}", r.body),
            }
        }
        granted += answered.len();
        let h = c.get("/v1/sessions/holds", &[("x-lock-session", &sid)]).await.unwrap();
        assert_eq!(h.code(), 200, "{}", h.body);
        for hold in h.json["holds"].as_array().unwrap() {
            let k = hold["key"].as_str().unwrap().to_owned();
            if !answered.contains(&k) {
                leaked.push(k);
            }
        }
    }
    (granted, leaked)
}

/// A group etcd committed but whose answer never came is resolved member by
/// member: every grant it made is answered 200 to its holder.
#[tokio::test]
async fn a_group_whose_answer_is_lost_leaves_no_hold_its_holder_does_not_know() {
    let (granted, leaked) = answers_lost("group-lost", &[]).await;
    assert!(leaked.is_empty(), "holds nobody was answered for: {leaked:?}");
    assert!(granted >= 12, "{granted} granted: the lost answers were not resolved");
}

/// Its planted twin: the lost answer taken for a refusal.
#[tokio::test]
async fn planted_a_lost_group_answer_guessed_is_caught() {
    let (_, leaked) = answers_lost("group-lost-planted", &["group_unknown_guessed"]).await;
    assert!(!leaked.is_empty(), "the guessed outcome left no unknown hold");
}

/// `HOLDERS_AT_LIMITS` holders cycling their own keys, through one group in
/// flight at a time (so every other holder's operation waits for the next
/// group), on an etcd started with `etcd_flags`, the arbiter's `etcd:` block
/// given `arbiter`: (what they did, the largest group, refusals by cause).
async fn at_limits(name: &str, etcd_flags: &[&str], arbiter: &[&str]) -> (Cycled, f64, HashMap<String, f64>) {
    let mut b = Stack::builder(name).envoy_config("lock-tier").registry(REGISTRY).own_etcd(1).arbiter_etcd_latency();
    for f in etcd_flags {
        b = b.own_etcd_arg(*f);
    }
    for line in ["max_group: 1024", "groups_in_flight: 1"].iter().chain(arbiter) {
        b = b.arbiter_etcd_yaml(*line);
    }
    let st = b.start().await.unwrap();
    st.etcd_latency().set_delay(LINK_DELAY);
    let holders = (HOLDERS_AT_LIMITS, HOLDERS_AT_LIMITS);
    let c = cycle_waiting(&st, holders, Duration::from_secs(3), Duration::ZERO, "5000").await;
    let (.., largest, refused) = groups(&st).await;
    eprintln!("{name}: {} grants, largest group {largest}, {refused:?}", c.grants);
    // What the arbiter said of each group etcd refused (its size by both limits).
    let log = std::fs::read_to_string(st.arbiters()[0].log_path()).unwrap_or_default();
    for line in log.lines().filter(|l| l.contains("refused a group")).take(5) {
        eprintln!("{name}: {line}");
    }
    (c, largest, refused)
}

const HOLDERS_AT_LIMITS: usize = 256;

/// etcd's operation limit at its least the arbiter accepts (128, etcd's
/// default): an outer transaction of n members and the clock put leaves each
/// nested member `128 - (n + 1)` operations, so groups stop near 120 members.
const OPS_LIMIT: [&str; 1] = ["--max-txn-ops=128"];

/// Groups fill to etcd's operation limit and never past it: the largest group
/// is far above the 64 the default `max_group` would give (the limit, not the
/// holders, stopped it) and etcd refuses none.
#[tokio::test]
async fn groups_fill_to_etcds_operation_limit_and_never_past_it() {
    let (c, largest, refused) = at_limits("group-ops-limit", &OPS_LIMIT, &["max_txn_ops: 128"]).await;
    assert!(c.errors.is_empty(), "{:?}", &c.errors[..c.errors.len().min(5)]);
    assert!(largest >= 96.0 && largest < 128.0, "largest group {largest}: not at the operation limit");
    assert_eq!(refused_by_etcd(&refused), vec![], "groups refused by etcd");
}

/// Its planted bad config: the arbiter told a limit above etcd's sends groups
/// etcd refuses as too many operations (each member then goes alone).
#[tokio::test]
async fn planted_an_operation_limit_above_etcds_is_caught() {
    let (c, _, refused) = at_limits("group-ops-limit-planted", &OPS_LIMIT, &["max_txn_ops: 1024"]).await;
    assert!(c.errors.is_empty(), "{:?}", &c.errors[..c.errors.len().min(5)]);
    assert!(refused.get("too_many_ops").copied().unwrap_or(0.0) > 0.0, "{refused:?}");
}

/// etcd's request size limit at the least the arbiter accepts, with room for
/// more operations than the holders make. Groups are small under it (a
/// member's size is bounded by its text, several times its encoding), so the
/// holders wait longer than the default 500 ms deadline allows.
const BYTES_LIMIT: [&str; 2] = ["--max-request-bytes=65536", "--max-txn-ops=1024"];
const BYTES_ARBITER: [&str; 2] = ["max_txn_ops: 1024", "op_timeout_ms: 5000"];

/// Groups stay within etcd's request size limit: etcd refuses none, while the
/// same load with the arbiter told a larger size is refused (below).
#[tokio::test]
async fn groups_stay_within_etcds_request_size_limit() {
    let arbiter = [&BYTES_ARBITER[..], &["max_request_bytes: 65536"]].concat();
    let (c, largest, refused) = at_limits("group-bytes-limit", &BYTES_LIMIT, &arbiter).await;
    assert!(c.errors.is_empty(), "{:?}", &c.errors[..c.errors.len().min(5)]);
    assert!(largest >= 8.0, "largest group {largest}");
    assert_eq!(refused_by_etcd(&refused), vec![], "groups refused by etcd");
}

/// Its planted bad config: the arbiter told etcd takes 16 MiB sends groups etcd
/// refuses as too large (each member then goes alone).
#[tokio::test]
async fn planted_a_request_size_above_etcds_is_caught() {
    let arbiter = [&BYTES_ARBITER[..], &["max_request_bytes: 16777216"]].concat();
    let (c, _, refused) = at_limits("group-bytes-limit-planted", &BYTES_LIMIT, &arbiter).await;
    assert!(c.errors.is_empty(), "{:?}", &c.errors[..c.errors.len().min(5)]);
    assert!(refused.get("too_large").copied().unwrap_or(0.0) > 0.0, "{refused:?}");
}
