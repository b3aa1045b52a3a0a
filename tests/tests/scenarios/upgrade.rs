//! Rolling upgrades: the keyspace record, the arbiters' advertisements and the
//! gated record kinds (`lockmesh_lock::upgrade`).
//!
//! - A fresh keyspace gets a record enabling every gated capability; one that
//!   holds anything and has no record gets none
//!   (`a_fresh_keyspace_enables_every_gated_kind_and_an_existing_one_none`).
//! - With the capabilities off, no gated kind is written (exclusion records, hold
//!   indexes, lock-delay guards), k permits are refused `capability_disabled`, a
//!   limit raise is refused; planted `ungated_writes` writes them
//!   (`no_gated_kind_is_written_before_its_capability_is_enabled`).
//! - An arbiter paused past its advertisement's lease while a capability it lacks
//!   is enabled grants nothing once resumed: its grant compares the advertisement
//!   (planted `ungated_writes` grants).
//! - A mixed-version fleet with a stand-in for an older build (this build with the
//!   gated capabilities switched off, `LOCKMESH_CAPABILITIES_OFF`), each arbiter
//!   behind its own lock-tier Envoy, one etcd root:
//!   1. both advertise and both grant; no gated kind is written (etcd's history);
//!   2. `lockctl upgrade enable all` is refused (exit 2) while the old one lives,
//!      naming it;
//!   3. once it stopped the flip succeeds; the new arbiter reads the enabled record;
//!   4. the old build started again refuses every request (`503 sealed`, the
//!      refusal's code, `lockmesh_arbiter_keyspace_refused{reason="capability"} 1`);
//!   5. at no revision do two holds of one key exist.
//!   The planted bug (an old arbiter that ignores the keyspace record) fails step 4.
//! - `mixed_version_rehearsal` (ignored; `scripts/rehearse-upgrade`): the same
//!   with a real older build, its own registry and its own (older) etcd role.
//!
//! etcd runs with TLS, auth and the shipped roles; `lockctl upgrade` runs as
//! `lockmesh-classes`.

use std::{collections::HashMap, process::Command, time::Duration};

use etcd_client::{EventType, WatchOptions};
use lockmesh_tests::{paths::profile_dir, ArbiterProcess, EnvoyProcess, LockClient, Stack, DEFAULT_TEST_REGISTRY};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const KEYS: [&str; 3] = ["payments/upgrade-a", "payments/upgrade-b", "payments/upgrade-c"];

/// Runs `lockctl upgrade <extra>` as the shipped `lockmesh-classes` role over the
/// stack's etcd (TLS and auth by default): (exit code, stdout, stderr).
fn ctl(st: &Stack, extra: &[&str]) -> (i32, String, String) {
    let out = Command::new(profile_dir().join("lockctl"))
        .arg("upgrade")
        .args(extra)
        .args(["--root", st.root()])
        .envs(st.etcd_env("lockmesh-classes"))
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Acquire and release every key `rounds` times through `c`, contending with the
/// other arbiter's client; returns the number of grants.
async fn churn(c: &LockClient, rounds: usize) -> usize {
    let mut granted = 0;
    for _ in 0..rounds {
        for k in KEYS {
            let r = c.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "2000")]).await.unwrap();
            if r.code() != 200 {
                continue;
            }
            granted += 1;
            let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            let token = body["token"].as_str().unwrap().to_owned();
            tokio::time::sleep(Duration::from_millis(5)).await;
            let r = c.post(REL, &[("x-lock-key", k), ("x-lock-token", &token)]).await.unwrap();
            assert_eq!(r.code(), 200, "release: {}", r.body);
        }
    }
    granted
}

/// The revision the next write will get.
async fn next_revision(st: &Stack) -> i64 {
    let mut c = st.etcd().client().await.unwrap();
    c.get("x", None).await.unwrap().header().unwrap().revision() + 1
}

/// Every event under the root from `from` to now, in revision order:
/// (revision, put?, key relative to the root).
async fn history(st: &Stack, from: i64) -> Vec<(i64, bool, String)> {
    let mut c = st.etcd().client().await.unwrap();
    let root = format!("{}/", st.root());
    let sentinel = format!("{root}~history-end");
    let end = c.put(sentinel.as_str(), "", None).await.unwrap().header().unwrap().revision();
    let opts = WatchOptions::new().with_prefix().with_start_revision(from);
    let mut w = c.watch(root.as_str(), Some(opts)).await.unwrap();
    let mut out = Vec::new();
    'outer: while let Some(resp) = w.message().await.unwrap() {
        for e in resp.events() {
            let kv = e.kv().unwrap();
            let key = String::from_utf8_lossy(kv.key()).trim_start_matches(root.as_str()).to_owned();
            if kv.mod_revision() >= end || key == "~history-end" {
                break 'outer;
            }
            out.push((kv.mod_revision(), e.event_type() == EventType::Put, key));
        }
    }
    out
}

/// The most holds one key had open at one revision (holds are `l/<digest>/h/<slot>`).
fn max_open_holds(h: &[(i64, bool, String)]) -> usize {
    let mut open: HashMap<String, std::collections::HashSet<String>> = HashMap::new();
    let mut max = 0;
    let mut i = 0;
    while i < h.len() {
        let rev = h[i].0;
        while i < h.len() && h[i].0 == rev {
            let (_, put, key) = &h[i];
            if let Some(rest) = key.strip_prefix("l/") {
                if let Some((digest, _)) = rest.split_once("/h/") {
                    let slots = open.entry(digest.to_owned()).or_default();
                    if *put {
                        slots.insert(key.clone());
                    } else {
                        slots.remove(key);
                    }
                }
            }
            i += 1;
        }
        max = max.max(open.values().map(|s| s.len()).max().unwrap_or(0));
    }
    max
}

/// Whether `key` (relative to the root) is of a gated kind
/// (`lockmesh_keyspace::upgrade::Capability::GATED`): a lock-delay guard or
/// record, a shadow record, an exclusion record, a session's hold index or an
/// attempt fence.
fn gated_kind(key: &str) -> bool {
    let seg: Vec<&str> = key.split('/').collect();
    matches!(seg.first(), Some(&"g") | Some(&"d") | Some(&"w"))
        || (seg.first() == Some(&"l") && seg.get(2) == Some(&"w"))
        || (seg.first() == Some(&"s") && matches!(seg.get(2), Some(&"h") | Some(&"a")))
}

/// The key kinds of keyspace version 1 (`lockmesh_keyspace::keys`), plus the
/// advertisements and the record of `lockmesh_keyspace::upgrade`.
fn known_kind(key: &str) -> bool {
    // `clock`: the grant clock, written ungated (no build reads it but one that
    // writes it; `lockmesh_keyspace::upgrade`).
    const SYS: [&str; 8] = ["epoch", "clock", "classmap", "shardmap", "epochs", "home", "keyspace", "audit-leader"];
    if let Some(rest) = key.strip_prefix("sys/") {
        return SYS.contains(&rest) || rest.starts_with("home") || rest.starts_with("arbiters/");
    }
    let first = key.split('/').next().unwrap_or("");
    ["s", "l", "r", "x", "c", "v", "q", "u", "sx", "f", "adm"].contains(&first)
}

/// Every gated capability's name, comma-separated (an older build's stand-in
/// switches them off).
const GATED_OFF: &str =
    "lock_delay_guards,multi_slot_holds,exclusion_records,session_hold_index,attempt_fences,shadow_records";

async fn old_arbiter(st: &Stack, planted: bool) -> ArbiterProcess {
    let mut b = ArbiterProcess::builder(st.pki())
        .etcd_endpoints(st.etcd().endpoints())
        .root(st.root())
        .registry(DEFAULT_TEST_REGISTRY)
        .env("LOCKMESH_CAPABILITIES_OFF", GATED_OFF);
    for line in st.etcd_users().arbiter_yaml("lockmesh-arbiter") {
        b = b.etcd_yaml(line);
    }
    if planted {
        b = b.env("LOCKMESH_TEST_FAULTS", "1").env("LOCKMESH_TEST_FAULT_UPGRADE", "ignore_keyspace_record");
    }
    b.start().await.unwrap()
}

/// A lock-tier Envoy in front of the older arbiter `old` only, and a client of it.
async fn old_side(st: &Stack, old: &ArbiterProcess) -> (EnvoyProcess, LockClient) {
    let envoy = EnvoyProcess::builder("lock-tier")
        .cert_dir(st.pki().dir())
        .upstream_port(st.backend().port())
        .arbiter_port(old.grpc_port())
        .start()
        .await
        .unwrap();
    let cert = st.pki().client("payments", "old-side").unwrap();
    let client =
        LockClient::new(envoy.listener_port(), &st.pki().ca_cert_path(), Some((&cert.cert_path, &cert.key_path)))
            .unwrap();
    (envoy, client)
}

async fn metric(a: &ArbiterProcess, line: &str) -> bool {
    let (_, m) = a.admin_get("/metrics").await.unwrap();
    m.lines().any(|l| l == line)
}

/// The scenario; `Err` names the first expectation that failed.
async fn mixed_version(planted: bool) -> Result<(), String> {
    let st = Stack::builder(if planted { "upgrade-planted" } else { "upgrade" })
        .envoy_config("lock-tier")
        .start()
        .await
        .unwrap();
    let ctl = |extra: &[&str]| ctl(&st, extra);
    // An existing keyspace: nothing enabled (the fresh install's record undone).
    let (code, out, err) = ctl(&["disable", "all"]);
    if code != 0 {
        return Err(format!("0: disable all: exit {code}: {out}{err}"));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let start = next_revision(&st).await;
    let old = old_arbiter(&st, planted).await;
    let (_old_envoy, old_client) = old_side(&st, &old).await;
    let new_client = st.client("payments", "new-side").unwrap();

    // 1. Both advertise and both grant.
    let (code, out, err) = ctl(&["status", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&out).map_err(|e| format!("status {code}: {e}: {err}"))?;
    let ads = status["arbiters"].as_array().map_or(0, Vec::len);
    if ads != 2 {
        return Err(format!("1: expected two advertisements, got {ads}: {out}"));
    }
    let (a, b) = tokio::join!(churn(&new_client, 4), churn(&old_client, 4));
    if a == 0 || b == 0 {
        return Err(format!("1: both arbiters grant before the flip: new {a}, old {b}"));
    }
    let before_flip = history(&st, start).await;
    if let Some((_, _, k)) = before_flip.iter().find(|(_, _, k)| !known_kind(k) || gated_kind(k) || k == "sys/keyspace")
    {
        return Err(format!("1: nothing new is written before the flip, found {k}"));
    }

    // 2. The flip is refused while the old arbiter lives.
    let (code, _, err) = ctl(&["enable", "all"]);
    if code != 2 || !err.contains(&old.grpc_port().to_string()) {
        return Err(format!("2: the flip must be refused naming the old arbiter: exit {code}: {err}"));
    }

    // 3. Once it stopped, the flip succeeds and the new arbiter follows it.
    old.stop().await.unwrap();
    let (code, out, err) = ctl(&["enable", "all", "--wait-s", "30", "--actor", "scenario"]);
    if code != 0 {
        return Err(format!("3: the flip after the old arbiter stopped: exit {code}: {out}{err}"));
    }
    let enabled = "lockmesh_arbiter_keyspace_capability_enabled{capability=\"session_hold_index\"} 1";
    let mut followed = false;
    for _ in 0..50 {
        if metric(&st.arbiter(0), enabled).await {
            followed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if !followed {
        return Err("3: the new arbiter reads the enabled record".into());
    }

    // 4. The old build started again refuses everything; the new one serves.
    old.restart().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = old_client.post(ACQ, &[("x-lock-key", KEYS[0])]).await.unwrap();
    if r.code() != 503 || !r.body.contains("keyspace_capability_unsupported") {
        return Err(format!("4: the old build served after the flip: {} {}", r.code(), r.body));
    }
    if !metric(&old, "lockmesh_arbiter_keyspace_refused{reason=\"capability\"} 1").await {
        return Err("4: the refusal's metric".into());
    }
    let (a, b) = tokio::join!(churn(&new_client, 3), churn(&old_client, 1));
    if a == 0 || b != 0 {
        return Err(format!("4: after the flip only the new arbiter grants: new {a}, old {b}"));
    }
    let (code, out, _) = ctl(&["status"]);
    if code != 0 || !out.contains("session_hold_index") {
        return Err(format!("4: status shows the flip: {code} {out}"));
    }

    // 5. No two holds of one key at any revision.
    let all = history(&st, start).await;
    let max = max_open_holds(&all);
    if max != 1 {
        return Err(format!("5: at most one hold per key at any revision, saw {max}"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_capability_is_enabled_only_once_no_live_arbiter_lacks_it_and_an_old_build_then_refuses() {
    mixed_version(false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn planted_an_old_arbiter_that_ignores_the_keyspace_record_is_caught() {
    let Err(e) = mixed_version(true).await else { panic!("the planted bug must fail the scenario") };
    assert!(e.starts_with("4: the old build served after the flip"), "{e}");
}

// === the gated kinds ===

const GATED_REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: rw, prefixes: ["payments/rw"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
  - { name: delay, prefixes: ["payments/delay"], ttl_s: 15, lock_delay_s: 2, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// Every key under the stack's root, relative to it.
async fn keys_now(st: &Stack) -> Vec<String> {
    let mut c = st.etcd().client().await.unwrap();
    let root = format!("{}/", st.root());
    let r = c.get(root.as_str(), Some(etcd_client::GetOptions::new().with_prefix().with_keys_only())).await.unwrap();
    r.kvs().iter().map(|kv| String::from_utf8_lossy(kv.key())[root.len()..].to_owned()).collect()
}

/// The enabled capabilities `lockctl upgrade status --json` shows.
fn enabled(st: &Stack) -> Vec<String> {
    let (code, out, err) = ctl(st, &["status", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["enabled"].as_array().unwrap().iter().map(|e| e.as_str().unwrap().to_owned()).collect()
}

/// What the writers did with every gated capability off: (gated keys found, the
/// k-permit answer, the raise's exit code).
async fn with_capabilities_off(fault: Option<&str>) -> (Vec<String>, u16, i32) {
    let mut b = Stack::builder("gated-off").envoy_config("lock-tier").registry(GATED_REGISTRY);
    if let Some(f) = fault {
        b = b.arbiter_extra_yaml(format!("test_faults: [{f}]")).arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    let st = b.start().await.unwrap();
    let (code, out, err) = ctl(&st, &["disable", "all", "--actor", "scenario"]);
    assert_eq!(code, 0, "{out}{err}");
    // The gate reads the record every second.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let c = st.client("payments", "worker").unwrap();
    // A header-only acquire (a hold index if enabled), an exclusive one of a
    // mutex (an exclusion record), one of a lock-delay class (a guard), each held.
    for (key, extra) in [("payments/idx", None), ("payments/excl", Some("exclusive")), ("payments/delay/k", None)] {
        let mut h = vec![("x-lock-key", key)];
        if let Some(m) = extra {
            h.push(("x-lock-mode", m));
        }
        let r = c.post(ACQ, &h).await.unwrap();
        assert_eq!(r.code(), 200, "{key}: {}", r.body);
    }
    // Two permits of a class of three.
    let p = c.post(ACQ, &[("x-lock-key", "payments/rw/k"), ("x-lock-permits", "2")]).await.unwrap();
    if p.code() != 200 {
        assert_eq!((p.code(), p.json["code"].as_str()), (503, Some("capability_disabled")), "{}", p.body);
    }
    let eps = st.etcd().endpoints().join(",");
    // etcd refuses a login whose users changed under it (other stacks create
    // theirs): such a refusal applied nothing and is sent again.
    let mut raise = None;
    for _ in 0..3 {
        let out = Command::new(profile_dir().join("lockctl"))
            .args(["limit", "change", "--to", "5", "--endpoints", &eps, "--root", st.root()])
            .args(["--class", "rw", "--actor", "test", "--reason", "t"])
            .envs(st.etcd_env("lockmesh-classes"))
            .output()
            .unwrap();
        let again = String::from_utf8_lossy(&out.stderr).contains("revision of auth store is old");
        raise = Some(out);
        if !again {
            break;
        }
    }
    let raise = raise.unwrap();
    let found = keys_now(&st).await.into_iter().filter(|k| gated_kind(k)).collect();
    (found, p.code(), raise.status.code().unwrap_or(-1))
}

#[tokio::test]
async fn no_gated_kind_is_written_before_its_capability_is_enabled() {
    let (found, permits, raise) = with_capabilities_off(None).await;
    assert!(found.is_empty(), "gated kinds written while disabled: {found:?}");
    assert_eq!(permits, 503, "k permits before multi_slot_holds");
    assert_eq!(raise, 3, "a limit raise before exclusion_records is refused (exit 3)");
}

#[tokio::test]
async fn planted_a_writer_that_skips_the_gate_is_caught() {
    let (found, permits, _) = with_capabilities_off(Some("ungated_writes")).await;
    assert!(!found.is_empty() && permits == 200, "the planted writer must write gated kinds: {found:?} {permits}");
    for kind in ["h", "w", "g"] {
        assert!(
            found.iter().any(|k| k.split('/').any(|s| s == kind) || k.starts_with(&format!("{kind}/"))),
            "no {kind} key in {found:?}"
        );
    }
}

#[tokio::test]
async fn a_fresh_keyspace_enables_every_gated_kind_and_an_existing_one_none() {
    let st = Stack::builder("gated-fresh").envoy_config("lock-tier").start().await.unwrap();
    let all = [
        "attempt_fences",
        "exclusion_records",
        "lock_delay_guards",
        "multi_slot_holds",
        "session_hold_index",
        "shadow_records",
    ];
    assert_eq!(enabled(&st), all, "a fresh install enables every gated capability");
    // An existing keyspace without a record (written by builds before the record
    // kinds were gated): a hold is left, the record removed, the arbiter restarted.
    let c = st.client("payments", "worker").unwrap();
    let r = c.post(ACQ, &[("x-lock-key", "payments/existing")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    st.arbiter(0).stop().await.unwrap();
    let mut e = st.etcd().client().await.unwrap();
    e.delete(format!("{}/sys/keyspace", st.root()), None).await.unwrap();
    st.arbiter(0).restart().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(enabled(&st).is_empty(), "an existing keyspace is not bootstrapped");
    let r = c.post(ACQ, &[("x-lock-key", "payments/existing-2"), ("x-lock-permits", "1")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let (code, out, err) = ctl(&st, &["enable", "all"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(enabled(&st), all);
}

// === an arbiter paused through a flip ===

/// A stand-in old arbiter (multi-slot holds off) is paused past its
/// advertisement's lease; `multi_slot_holds` is enabled meanwhile; at once after
/// it resumes, acquires are sent to it for 800 ms. Returns their statuses.
async fn paused_through_a_flip() -> Vec<u16> {
    let st = Stack::builder("flip-pause")
        .envoy_config("lock-tier")
        .arbiter_env("LOCKMESH_CAPABILITIES_OFF", "multi_slot_holds")
        .start()
        .await
        .unwrap();
    assert!(!enabled(&st).contains(&"multi_slot_holds".to_owned()), "bootstrapped only what every arbiter supports");
    let c = st.client("payments", "worker").unwrap();
    let r = c.post(ACQ, &[("x-lock-key", "payments/pause/0")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    st.arbiter(0).pause().unwrap();
    // The advertisement's lease is 10 s.
    let (code, out, err) = ctl(&st, &["enable", "multi_slot_holds", "--wait-s", "30"]);
    st.arbiter(0).resume().unwrap();
    assert_eq!(code, 0, "{out}{err}");
    let mut codes = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_millis(800);
    let mut i = 1;
    while tokio::time::Instant::now() < until {
        let r = c.post(ACQ, &[("x-lock-key", &format!("payments/pause/{i}")), ("x-lock-wait-ms", "0")]).await.unwrap();
        codes.push(r.code());
        i += 1;
    }
    codes
}

/// The arbiter's advertisement key removed under it (as a lapsed lease removes
/// it): the statuses of an acquire sent at once and of the first acquire granted
/// after it (`None` if none within 5 s).
async fn advertisement_removed(fault: Option<&str>) -> (u16, Option<u16>) {
    let mut b = Stack::builder("ad-removed").envoy_config("lock-tier");
    if let Some(f) = fault {
        b = b.arbiter_extra_yaml(format!("test_faults: [{f}]")).arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    let st = b.start().await.unwrap();
    let c = st.client("payments", "worker").unwrap();
    let r = c.post(ACQ, &[("x-lock-key", "payments/ad/0")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let mut e = st.etcd().client().await.unwrap();
    let ads = format!("{}/sys/arbiters/", st.root());
    let gone = e.delete(ads.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await.unwrap();
    assert_eq!(gone.deleted(), 1, "one advertisement");
    let first = c.post(ACQ, &[("x-lock-key", "payments/ad/1"), ("x-lock-wait-ms", "0")]).await.unwrap().code();
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut i = 2;
    while tokio::time::Instant::now() < until {
        let r = c.post(ACQ, &[("x-lock-key", &format!("payments/ad/{i}")), ("x-lock-wait-ms", "0")]).await.unwrap();
        if r.code() == 200 {
            return (first, Some(200));
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (first, None)
}

#[tokio::test]
async fn an_arbiter_paused_through_a_flip_grants_nothing_before_it_reads_the_record() {
    let codes = paused_through_a_flip().await;
    assert!(!codes.is_empty() && codes.iter().all(|c| *c == 503), "{codes:?}");
    // Without a flip: the grant that finds the advertisement gone is refused, and
    // grants resume once the gate has put it again.
    assert_eq!(advertisement_removed(None).await, (503, Some(200)));
}

#[tokio::test]
async fn planted_an_arbiter_that_does_not_compare_its_advertisement_is_caught() {
    let (first, _) = advertisement_removed(Some("ungated_writes")).await;
    assert_eq!(first, 200, "the planted arbiter grants with its advertisement gone");
}

// === the mixed-version rehearsal (a real older build) ===

/// The older build's registry: no field it does not know (no lock-delay).
const OLD_REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: rw, prefixes: ["payments/rw"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
  - { name: delay, prefixes: ["payments/delay"], ttl_s: 15, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// A user for the older build with its own `lockmesh-arbiter` role, as its
/// `lockctl etcd-roles` prints it; the arbiter config's etcd lines.
async fn old_role_user(st: &Stack, old: &std::path::Path, dir: &std::path::Path) -> Vec<String> {
    let out = Command::new(old.join("lockctl")).args(["etcd-roles", "--root", st.root()]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (role, user, pw) = ("old-arbiter-role", "old-arbiter", "old-arbiter-pw");
    let mut c = st.etcd().client().await.unwrap();
    c.role_add(role).await.unwrap();
    let mut grants = 0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("etcdctl role grant-permission lockmesh-arbiter ") else { continue };
        let (prefix, rest) = match rest.strip_prefix("--prefix=true ") {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let (perm, key) = rest.split_once(' ').unwrap();
        let mut p = match perm {
            "read" => etcd_client::Permission::read(key),
            "write" => etcd_client::Permission::write(key),
            _ => etcd_client::Permission::read_write(key),
        };
        if prefix {
            p = p.with_prefix();
        }
        c.role_grant_permission(role, p).await.unwrap();
        grants += 1;
    }
    assert!(grants > 10, "the older lockctl printed its arbiter role: {text}");
    c.user_add(user, pw, None).await.unwrap();
    c.user_grant_role(user, role).await.unwrap();
    let pw_file = dir.join("old-arbiter.pw");
    std::fs::write(&pw_file, pw).unwrap();
    let mut lines: Vec<String> =
        st.etcd_users().arbiter_yaml("lockmesh-arbiter").into_iter().filter(|l| l.starts_with("tls:")).collect();
    lines.push(format!("user: {user:?}"));
    lines.push(format!("password_file: {:?}", pw_file.display().to_string()));
    lines
}

/// `scripts/rehearse-upgrade`: a real older build (`LOCKMESH_OLD_BUILD`, the
/// directory holding its `lockmesh-extproc` and `lockctl`) beside this one on TLS
/// + auth etcd, each with its own registry and etcd role.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an older build: scripts/rehearse-upgrade"]
async fn mixed_version_rehearsal() {
    let old_dir = std::path::PathBuf::from(std::env::var("LOCKMESH_OLD_BUILD").expect("LOCKMESH_OLD_BUILD"));
    let st = Stack::builder("rehearsal").envoy_config("lock-tier").registry(GATED_REGISTRY).start().await.unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // An existing keyspace: the fresh install's record undone.
    let (code, out, err) = ctl(&st, &["disable", "all", "--actor", "rehearsal"]);
    assert_eq!(code, 0, "{out}{err}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let start = next_revision(&st).await;
    let mut b = ArbiterProcess::builder(st.pki())
        .binary(old_dir.join("lockmesh-extproc"))
        .etcd_endpoints(st.etcd().endpoints())
        .root(st.root())
        .registry(OLD_REGISTRY);
    for line in old_role_user(&st, &old_dir, tmp.path()).await {
        b = b.etcd_yaml(line);
    }
    let old = b.start().await.expect("the older arbiter starts");
    let (_old_envoy, old_client) = old_side(&st, &old).await;
    let new_client = st.client("payments", "new-side").unwrap();
    let (_, status, _) = ctl(&st, &["status"]);
    println!("rehearsal: status with both builds:\n{status}");

    // 1. Both grant the same keys; the new one's gated writers write nothing.
    let (a, b) = tokio::join!(churn(&new_client, 6), churn(&old_client, 6));
    println!("rehearsal: grants before the flip: new {a}, old {b}");
    assert!(a > 0 && b > 0, "both builds grant: new {a}, old {b}");
    let p = new_client.post(ACQ, &[("x-lock-key", "payments/rw/k"), ("x-lock-permits", "2")]).await.unwrap();
    assert_eq!((p.code(), p.json["code"].as_str()), (503, Some("capability_disabled")), "{}", p.body);
    let d = new_client.post(ACQ, &[("x-lock-key", "payments/delay/k")]).await.unwrap();
    assert_eq!(d.code(), 200, "{}", d.body);
    let before = history(&st, start).await;
    let gated: Vec<&String> = before.iter().map(|(_, _, k)| k).filter(|k| gated_kind(k)).collect();
    assert!(gated.is_empty(), "gated kinds written beside the older build: {gated:?}");

    // 2. The flip is refused while the older arbiter lives.
    let (code, _, err) = ctl(&st, &["enable", "all"]);
    assert!(code == 2 && err.contains(&old.grpc_port().to_string()), "exit {code}: {err}");
    println!("rehearsal: enable all with the older build live: exit {code}: {}", err.lines().next().unwrap_or(""));

    // 3. The older arbiter gone, the flip passes and the kinds are written.
    old.stop().await.unwrap();
    let (code, out, err) = ctl(&st, &["enable", "all", "--wait-s", "30", "--actor", "rehearsal"]);
    assert_eq!(code, 0, "{out}{err}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let p = new_client.post(ACQ, &[("x-lock-key", "payments/rw/k"), ("x-lock-permits", "2")]).await.unwrap();
    assert_eq!(p.code(), 200, "{}", p.body);
    let r = new_client.post(ACQ, &[("x-lock-key", "payments/idx-after")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert!(keys_now(&st).await.iter().any(|k| gated_kind(k)), "the enabled kinds are written after the flip");

    // 4. The older build started again refuses every request.
    old.restart().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = old_client.post(ACQ, &[("x-lock-key", KEYS[0])]).await.unwrap();
    assert_eq!(r.code(), 503, "the older build after the flip: {}", r.body);
    assert!(r.body.contains("keyspace_capability_unsupported"), "{}", r.body);
    println!("rehearsal: the older build after the flip: {} {}", r.code(), r.body);

    // 5. No two holds of one mutex key at any revision.
    let all = history(&st, start).await;
    let mutex: Vec<_> = all.into_iter().filter(|(_, _, k)| !k.contains(&digest_of("payments/rw/k"))).collect();
    assert_eq!(max_open_holds(&mutex), 1, "at most one hold per mutex key at any revision");
    println!("rehearsal: clean ({} events checked)", mutex.len());
}

/// The digest under which `key`'s holds live (`lockmesh_core::KeyDigest`).
fn digest_of(key: &str) -> String {
    lockmesh_core::LockKey::parse(key.as_bytes()).unwrap().digest().to_string()
}
