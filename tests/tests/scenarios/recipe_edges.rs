//! The recipe edges found by reading the grant paths (docs/GUARANTEES.md G5, G13,
//! Restore and moves), each reproduced on real processes with a planted twin that
//! switches its fix off and must fail:
//!
//! - A shard sealed after a restore stays sealed through a shard move's soft epoch
//!   advance, and its restored holds are refused until the guarded advance
//!   (`soft_advance_unseals`).
//! - The lock-delay watch resumes from the last revision it saw after a break: an
//!   expiry in the gap still starts the key's delay at once (`delay_rewatch_from_now`).

use std::{
    collections::BTreeMap,
    process::Command,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use lockmesh_core::shard::ShardMap;
use lockmesh_tests::{client::Resp, eventually, paths::profile_dir, EtcdCluster, Stack};
use tokio::time::Instant;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const KEEPALIVE: &str = "/v1/sessions/keepalive";

fn token(r: &Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token in {}", r.body)).parse().unwrap()
}

fn field(r: &Resp, name: &str) -> String {
    r.json[name].as_str().unwrap_or_else(|| panic!("no {name}: {}", r.body)).to_owned()
}

// === a restored shard across a move (S4) ===

const SHARD_REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: delayed, prefixes: ["payments/ld0", "payments/ld1", "payments/ld2", "payments/ld3", "payments/ld4",
      "payments/ld5", "payments/ld6", "payments/ld7"], ttl_s: 15, lock_delay_s: 8, enforcement: advisory,
      risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

/// A lock tier over the shared etcd (coord) and two single-member entity shards,
/// both in the map, with a marks file.
struct Shards {
    st: Stack,
    shards: BTreeMap<String, EtcdCluster>,
    _dir: tempfile::TempDir,
    users: BTreeMap<String, lockmesh_tests::EtcdUsers>,
    /// The arbiter's config names planted faults (lockctl reads it too).
    faulted: bool,
}

async fn shards(name: &str, fault: Option<&str>) -> Shards {
    let names = ["shard-a", "shard-b"];
    let clusters =
        futures::future::try_join_all(names.iter().map(|_| EtcdCluster::builder().members(1).start())).await.unwrap();
    let shards: BTreeMap<String, EtcdCluster> = names.iter().map(|s| (*s).to_owned()).zip(clusters).collect();
    let dir = tempfile::tempdir().unwrap();
    let (root, _) = lockmesh_tests::shared_etcd().await.users_for_new_root(name, dir.path()).await.unwrap();
    let mut yaml = format!("marks_file: {:?}\nclusters:\n", dir.path().join("marks.json").display().to_string());
    let mut users = BTreeMap::new();
    for (n, c) in &shards {
        yaml.push_str(&format!("  {n}:\n    endpoints: [{:?}]\n", c.endpoints()[0]));
        let u = c.users_for(&root, dir.path()).await.unwrap();
        for line in u.arbiter_yaml("lockmesh-arbiter") {
            yaml.push_str(&format!("    {line}\n"));
        }
        users.insert(n.clone(), u);
    }
    yaml.push_str("tiers:\n  entity: [shard-a, shard-b]\n");
    if let Some(f) = fault {
        yaml.push_str(&format!("test_faults: [{f}]\n"));
    }
    let mut b =
        Stack::builder(name).root(root).envoy_config("lock-tier").registry(SHARD_REGISTRY).arbiter_extra_yaml(yaml);
    if fault.is_some() {
        b = b.arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    Shards { st: b.start().await.unwrap(), shards, _dir: dir, users, faulted: fault.is_some() }
}

impl Shards {
    /// `lockctl shard <args> --config <the arbiter's config>`: (exit code, stderr).
    fn shard(&self, args: &[&str]) -> (i32, String) {
        let config = self.st.arbiter(0).config_path().display().to_string();
        let out = Command::new(profile_dir().join("lockctl"))
            .arg("shard")
            .args(args)
            .args(["--config", &config, "--actor", "test", "--reason", "recipe edges"])
            .envs(self.faulted.then_some(("LOCKMESH_TEST_FAULTS", "1")))
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.code().unwrap_or(-1), text)
    }

    async fn epoch_record(&self, shard: &str) -> serde_json::Value {
        let mut c = self.shards[shard].client().await.unwrap();
        let r = c.get(format!("{}/sys/epoch", self.st.root()), None).await.unwrap();
        serde_json::from_slice(r.kvs()[0].value()).unwrap()
    }
}

/// A key of `prefix` that map `m` homes on `shard`.
fn homed(m: &ShardMap, prefix: &str, shard: &str) -> String {
    (0..256).map(|i| format!("{prefix}{i}")).find(|k| m.home("default", k) == Some(shard)).unwrap()
}

/// Restores shard-a from a snapshot holding a hold its holder released after it,
/// then moves every key onto shard-a (`lockctl shard apply --remove shard-b`,
/// whose step 3 advances shard-a's epoch softly). Returns, for the seconds after
/// the move, whether the arbiter served shard-a again (a grant there) and
/// whether it honoured the restored hold (another caller refused `contended`),
/// then checks the guarded advance still recovers the shard.
async fn restored_shard_across_a_move(fault: Option<&str>) -> (bool, bool) {
    let s = shards(if fault.is_some() { "edge-s4-planted" } else { "edge-s4" }, fault).await;
    let both: Vec<String> = vec!["shard-a".into(), "shard-b".into()];
    let m = ShardMap::initial("coord", &both, Vec::<String>::new());
    let (a, b) = (s.st.client("payments", "a").unwrap(), s.st.client("payments", "b").unwrap());
    let k = homed(&m, "payments/s4-", "shard-a");
    let held = a.post(ACQ, &[("x-lock-key", &k)]).await.unwrap();
    assert_eq!((held.code(), held.json["cluster"].as_str()), (200, Some("shard-a")), "{}", held.body);
    let (restored_token, restored_session) = (token(&held), field(&held, "session"));
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap.db");
    s.shards["shard-a"].snapshot_save(&snap).await.unwrap();
    // After the snapshot: the hold is released, and more grants on shard-a move
    // the arbiter's marks past the snapshot.
    let r = a.post(REL, &[("x-lock-key", &k), ("x-lock-token", &restored_token.to_string())]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let mut top = restored_token;
    for i in 0..3 {
        let key = homed(&m, &format!("payments/s4-after{i}-"), "shard-a");
        let r = a.post(ACQ, &[("x-lock-key", &key)]).await.unwrap();
        assert_eq!((r.code(), r.json["cluster"].as_str()), (200, Some("shard-a")), "{}", r.body);
        top = top.max(token(&r));
        let r = a.post(REL, &[("x-lock-key", &key), ("x-lock-token", &token(&r).to_string())]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    s.shards["shard-a"].restore_from(&snap, None).await.unwrap();
    // The restored holder keeps its session alive, as a live holder does.
    let stop = Arc::new(AtomicBool::new(false));
    let renew = {
        let (stop, a, sid) = (stop.clone(), s.st.client("payments", "a").unwrap(), restored_session.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = a.post(KEEPALIVE, &[("x-lock-session", &sid)]).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let probe = homed(&m, "payments/s4-probe", "shard-a");
    eventually(Duration::from_secs(20), async || {
        let r = b.post(ACQ, &[("x-lock-key", &probe), ("x-lock-wait-ms", "0")]).await?;
        assert_ne!(r.code(), 200, "shard-a granted a key after its restore: {}", r.body);
        anyhow::ensure!(r.code() == 503 && r.json["code"] == "sealed", "not sealed yet: {}", r.body);
        Ok(())
    })
    .await;
    let before = s.epoch_record("shard-a").await["epoch"].as_u64().unwrap();
    let (code, out) = s.shard(&["apply", "--remove", "shard-b", "--verify-timeout-ms", "10000"]);
    assert_eq!(code, 0, "{out}");
    let rec = s.epoch_record("shard-a").await;
    let soft = rec["epoch"].as_u64().unwrap();
    assert!(soft > before, "the move did not advance shard-a's epoch: {rec}");
    assert!(rec["prior"].as_array().is_some_and(|p| p.iter().any(|e| e.as_u64() == Some(before))), "{rec}");
    // For 6 s after the move (the seal check runs every second): does shard-a
    // serve again, and does the restored hold stand?
    let (mut served, mut honoured) = (false, false);
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        let r = b.post(ACQ, &[("x-lock-key", &probe), ("x-lock-wait-ms", "0")]).await.unwrap();
        if r.code() == 200 {
            served = true;
            let t = token(&r).to_string();
            let _ = b.post(REL, &[("x-lock-key", &probe), ("x-lock-token", &t)]).await.unwrap();
        } else {
            assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("sealed")), "{}", r.body);
        }
        let r = b.post(ACQ, &[("x-lock-key", &k), ("x-lock-wait-ms", "0")]).await.unwrap();
        match r.code() {
            409 => honoured = true,
            503 => assert_eq!(r.json["code"], "sealed", "{}", r.body),
            _ => panic!("the restored key was granted to another caller: {}", r.body),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, Ordering::Relaxed);
    renew.await.unwrap();
    // The guarded advance (epoch from the coord counter) unseals shard-a and ends
    // every restored hold: the key is granted above every token of before.
    let config = s.st.arbiter(0).config_path().display().to_string();
    let out = Command::new(profile_dir().join("lockctl"))
        .args(["epoch-advance", "--endpoints", &s.shards["shard-a"].endpoints()[0], "--root", s.st.root()])
        .args(["--expected-epoch", &soft.to_string(), "--epochs-from", &config])
        .envs(s.users["shard-a"].env("lockmesh-admin-epoch"))
        .envs(s.faulted.then_some(("LOCKMESH_TEST_FAULTS", "1")))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let after = eventually(Duration::from_secs(20), async || {
        let r = b.post(ACQ, &[("x-lock-key", &k), ("x-lock-wait-ms", "0")]).await?;
        anyhow::ensure!(r.code() == 200, "{}", r.body);
        Ok(token(&r))
    })
    .await;
    assert!(after > top, "token {after} after the guarded advance is not above {top}");
    let r = a.post(KEEPALIVE, &[("x-lock-session", &restored_session)]).await.unwrap();
    assert_eq!(r.code(), 410, "the restored session outlived the guarded advance: {}", r.body);
    (served, honoured)
}

#[tokio::test]
async fn a_shard_sealed_after_a_restore_stays_sealed_through_a_move() {
    let (served, honoured) = restored_shard_across_a_move(None).await;
    assert!(!served, "shard-a served grants after the move, before the guarded advance");
    assert!(!honoured, "the restored hold was honoured after the move");
}

#[tokio::test]
async fn planted_a_move_that_unseals_a_restored_shard_is_caught() {
    let (served, honoured) = restored_shard_across_a_move(Some("soft_advance_unseals")).await;
    assert!(served && honoured, "the planted arbiter stayed sealed (served {served}, honoured {honoured})");
}

/// A holder keeps renewing its session (homed on the healthy shard) while the
/// other shard, where it holds a key, is restored (sealed until its guarded
/// advance); then the namespace is moved off the restored shard (`lockctl shard
/// apply --assign payments=<home>`, which waits for the holds of moving keys to
/// end). A keepalive
/// renews nothing on a sealed cluster, so the snapshot's hold lapses with its
/// lease there and the move finishes. Returns lockctl's exit code and output, and
/// the last keepalive's answer.
async fn move_off_a_sealed_shard_while_its_holder_renews(fault: Option<&str>) -> (i32, String, Resp) {
    let s = shards(if fault.is_some() { "edge-renew-sealed-planted" } else { "edge-renew-sealed" }, fault).await;
    let both: Vec<String> = vec!["shard-a".into(), "shard-b".into()];
    let m = ShardMap::initial("coord", &both, Vec::<String>::new());
    // A session with no key opens on the shard its class hashes to; the key is
    // on the other one, which is restored.
    let home = lockmesh_core::shard::rendezvous(&both, "default").unwrap().to_owned();
    let victim = both.iter().find(|n| **n != home).unwrap().clone();
    let a = s.st.client("payments", "a").unwrap();
    let opened = a.post("/v1/sessions", &[]).await.unwrap();
    assert_eq!(opened.code(), 200, "{}", opened.body);
    let sid = field(&opened, "session");
    let k = homed(&m, "payments/rs-", &victim);
    let held = a.post(ACQ, &[("x-lock-key", &k), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!((held.code(), held.json["cluster"].as_str()), (200, Some(victim.as_str())), "{}", held.body);
    let held_token = token(&held);
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap.db");
    s.shards[&victim].snapshot_save(&snap).await.unwrap();
    // After the snapshot the hold is released and more grants move the marks on.
    let r = a
        .post(REL, &[("x-lock-key", &k), ("x-lock-token", &held_token.to_string()), ("x-lock-session", &sid)])
        .await
        .unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    for i in 0..3 {
        let key = homed(&m, &format!("payments/rs-after{i}-"), &victim);
        let r = a.post(ACQ, &[("x-lock-key", &key)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let r = a.post(REL, &[("x-lock-key", &key), ("x-lock-token", &token(&r).to_string())]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    s.shards[&victim].restore_from(&snap, None).await.unwrap();
    // The restored hold's holder renews its session, as a live holder does.
    let stop = Arc::new(AtomicBool::new(false));
    let renew = {
        let (stop, a, sid) = (stop.clone(), s.st.client("payments", "a").unwrap(), sid.clone());
        tokio::spawn(async move {
            let mut last = None;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(r) = a.post(KEEPALIVE, &[("x-lock-session", &sid)]).await {
                    last = Some(r);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            last.expect("no keepalive answered")
        })
    };
    let probe = homed(&m, "payments/rs-probe", &victim);
    let b = s.st.client("payments", "b").unwrap();
    eventually(Duration::from_secs(20), async || {
        let r = b.post(ACQ, &[("x-lock-key", &probe), ("x-lock-wait-ms", "0")]).await?;
        anyhow::ensure!(r.code() == 503 && r.json["code"] == "sealed", "not sealed yet: {}", r.body);
        Ok(())
    })
    .await;
    let assign = format!("payments={home}");
    let (code, out) = s.shard(&["apply", "--assign", &assign, "--verify-timeout-ms", "25000"]);
    stop.store(true, Ordering::Relaxed);
    (code, out, renew.await.unwrap())
}

// Multi-threaded: `lockctl shard apply` runs as a blocking child process, and the
// holder's renewals must go on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_off_a_sealed_shard_finishes_while_a_restored_holder_renews() {
    let (code, out, last) = move_off_a_sealed_shard_while_its_holder_renews(None).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!((last.code(), last.json["code"].as_str()), (503, Some("sealed")), "{}", last.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_renewals_on_a_sealed_shard_hold_a_move_off_it_forever() {
    let (code, out, last) = move_off_a_sealed_shard_while_its_holder_renews(Some("renew_sealed")).await;
    assert_eq!(code, 2, "the restored hold lapsed although its session was renewed there: {out} {}", last.body);
    assert!(out.contains("held"), "{out}");
}

// === lock-delay across a watch break (L5) ===

const DELAY_REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: delayed, prefixes: ["payments/ld"], ttl_s: 2, lock_delay_s: 12, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

async fn holds_of(st: &Stack) -> i64 {
    let mut c = st.etcd().client().await.unwrap();
    let prefix = format!("{}/l/", st.root());
    c.get(prefix, Some(etcd_client::GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
}

/// The lock-delay watch breaks after a release (test fault `delay_watch_gap`: 5 s
/// without a watch); in that gap a holder's session expires. Returns whether the
/// key's delay record appeared within 9 s of the break with no grant attempt on
/// the key (the watch, resumed, saw the expiry).
async fn expiry_in_a_watch_gap(planted: bool) -> bool {
    let faults = if planted { "[delay_watch_gap, delay_rewatch_from_now]" } else { "[delay_watch_gap]" };
    let st = Stack::builder(if planted { "edge-ld-gap-planted" } else { "edge-ld-gap" })
        .envoy_config("lock-tier")
        .registry(DELAY_REGISTRY)
        .arbiter_extra_yaml(format!("test_faults: {faults}"))
        .arbiter_env("LOCKMESH_TEST_FAULTS", "1")
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "a").unwrap();
    // The watch starts within a second of the arbiter (its classes set a delay).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = a.post(ACQ, &[("x-lock-key", "payments/ld/0")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t = field(&r, "token");
    let r = a.post(REL, &[("x-lock-key", "payments/ld/0"), ("x-lock-token", &t)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let gap = Instant::now();
    // In the gap: a hold whose session is never renewed (TTL 2 s).
    let key = "payments/ld/1";
    let s = a.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(s.code(), 200, "{}", s.body);
    let sid = field(&s, "session");
    let r = a.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    while holds_of(&st).await > 0 {
        assert!(gap.elapsed() < Duration::from_secs(5), "the hold did not expire inside the watch's gap");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Inspection reads the delay record without turning a guard into one.
    while gap.elapsed() < Duration::from_secs(9) {
        let info = a.get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
        assert_eq!(info.code(), 200, "{}", info.body);
        if info.json["lock_delay_ms"].as_u64().is_some_and(|ms| ms > 0) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

#[tokio::test]
async fn an_expiry_while_the_delay_watch_is_down_still_starts_its_delay() {
    assert!(expiry_in_a_watch_gap(false).await, "the resumed watch did not turn the expiry into its delay");
}

#[tokio::test]
async fn planted_a_delay_watch_that_resumes_from_now_is_caught() {
    assert!(!expiry_in_a_watch_gap(true).await, "the planted watch saw the expiry in its gap");
}

/// A session whose home is shard-a holds a lock-delay key homed on shard-b (the
/// session extends there). Its holder closes the session: on shard-b too that is
/// a close (shard-b's own close marker), so the key is free at once for the next
/// caller, not held back by the lock-delay an expiry would start.
#[tokio::test]
async fn a_closed_sessions_keys_on_the_clusters_it_extends_to_are_free_at_once() {
    let answer = close_across_clusters(None).await;
    assert_eq!(answer.0, 200, "the key on the extension waited after a close: {}", answer.1);
}

/// The same with the close revoking the extension bare (`extension_bare_revoke`):
/// shard-b reads the end as an expiry and the key waits out its lock-delay.
#[tokio::test]
async fn planted_a_bare_revoke_of_an_extension_reads_as_an_expiry() {
    let (code, body) = close_across_clusters(Some("extension_bare_revoke")).await;
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("lock_delay"), "{body}");
}

/// Opens a session on a shard-a key, takes a shard-b key on it, closes the
/// session and answers another caller's try-once acquire of the shard-b key.
async fn close_across_clusters(fault: Option<&str>) -> (u16, String) {
    let s = shards(if fault.is_some() { "edge-close-planted" } else { "edge-close" }, fault).await;
    let both: Vec<String> = vec!["shard-a".into(), "shard-b".into()];
    let m = ShardMap::initial("coord", &both, Vec::<String>::new());
    let on = |shard: &str| {
        (0..8).map(|i| format!("payments/ld{i}/k")).find(|k| m.home("delayed", k) == Some(shard)).unwrap()
    };
    let (ka, kb) = (on("shard-a"), on("shard-b"));
    let (a, b) = (s.st.client("payments", "a").unwrap(), s.st.client("payments", "b").unwrap());
    let r = a.post(ACQ, &[("x-lock-key", &ka)]).await.unwrap();
    assert_eq!((r.code(), r.json["cluster"].as_str()), (200, Some("shard-a")), "{}", r.body);
    assert_eq!(r.json["class"], "delayed", "{}", r.body);
    let sid = field(&r, "session");
    let r = a.post(ACQ, &[("x-lock-key", &kb), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!((r.code(), r.json["cluster"].as_str()), (200, Some("shard-b")), "{}", r.body);
    let r = a.post("/v1/sessions/close", &[("x-lock-session", &sid)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    // The key on shard-a is free at once either way (its home wrote the marker).
    let r = b.post(ACQ, &[("x-lock-key", &ka), ("x-lock-wait-ms", "0")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let r = b.post(ACQ, &[("x-lock-key", &kb), ("x-lock-wait-ms", "0")]).await.unwrap();
    (r.code(), r.body)
}
