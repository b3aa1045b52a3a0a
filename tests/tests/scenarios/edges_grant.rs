//! Issue 18: the grant and release transactions at the edges, each on real
//! processes (etcd, Envoy, arbiters): a bumped restore is never served before the
//! seal (item 4), a release is not refused by an arbiter's stale epoch cache
//! (item 7), a semaphore re-acquire on its own session is idempotent and the
//! mutex fast path obeys the authoritative limit (item 8).

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use lockmesh_tests::{eventually, Stack};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pool, prefixes: ["payments/pool"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

fn token_epoch(r: &lockmesh_tests::Resp) -> u64 {
    let t: u64 = r.json["token"].as_str().unwrap_or_else(|| panic!("no token: {}", r.body)).parse().unwrap();
    t >> 48
}

/// Item 7. The epoch record advances the way a shard move's advance leaves it
/// (a new epoch, the old one kept in `prior`). Arbiter 0 grants in the new epoch
/// (its grant's epoch compare fails and it re-reads); the release goes through
/// arbiter 1 at once, before its once-a-second seal check re-read the record: its
/// cached epoch is the old one, and the release must still free the hold.
#[tokio::test]
async fn a_release_after_an_epoch_advance_is_not_refused_by_a_stale_epoch_cache() {
    let st = Stack::builder("edges-stale-epoch")
        .envoy_config("lock-tier")
        .registry(REGISTRY)
        .envoy_per_arbiter(2)
        .start()
        .await
        .unwrap();
    let (a0, a1) = (st.client_at(0, "payments", "a").unwrap(), st.client_at(1, "payments", "a").unwrap());
    // Both arbiters have read epoch 1.
    for c in [&a0, &a1] {
        let r = c.post(ACQ, &[("x-lock-key", "payments/warm")]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let t = r.json["token"].as_str().unwrap();
        let rel = c.post(REL, &[("x-lock-key", "payments/warm"), ("x-lock-token", t)]).await.unwrap();
        assert_eq!(rel.code(), 200, "{}", rel.body);
    }
    let mut etcd = st.etcd().client().await.unwrap();
    let epoch_key = format!("{}/sys/epoch", st.root());
    for round in 0..3 {
        let cur = etcd.get(epoch_key.as_str(), None).await.unwrap();
        let mut rec: serde_json::Value = serde_json::from_slice(cur.kvs()[0].value()).unwrap();
        let old = rec["epoch"].as_u64().unwrap();
        rec["prior"] = serde_json::json!([old]);
        rec["epoch"] = serde_json::json!(old + 1);
        etcd.put(epoch_key.as_str(), serde_json::to_vec(&rec).unwrap(), None).await.unwrap();
        let key = format!("payments/stale-{round}");
        let r = a0.post(ACQ, &[("x-lock-key", &key)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        assert_eq!(token_epoch(&r), old + 1, "{}", r.body);
        let t = r.json["token"].as_str().unwrap();
        let rel = a1.post(REL, &[("x-lock-key", &key), ("x-lock-token", t)]).await.unwrap();
        assert_eq!(rel.code(), 200, "round {round}: the release through the arbiter with a stale cache: {}", rel.body);
        let h = a1.get("/v1/locks", &[("x-lock-key", &key)]).await.unwrap();
        assert_eq!(h.json["holders"].as_array().map(Vec::len), Some(0), "{}", h.body);
    }
}

/// Item 8: a session holding slot 1 of a pool re-acquires after slot 0 was freed:
/// the answer is its grant (`existing: true`, the same token), not a second slot.
#[tokio::test]
async fn a_semaphore_re_acquire_on_its_session_answers_existing() {
    let st = Stack::builder("edges-sem-again").envoy_config("lock-tier").registry(REGISTRY).start().await.unwrap();
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let key = "payments/pool/again";
    let first = b.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(first.code(), 200, "{}", first.body);
    let s = a.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    let mine = a.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!((mine.code(), mine.json["existing"].as_bool()), (200, Some(false)), "{}", mine.body);
    let t = first.json["token"].as_str().unwrap();
    let rel = b.post(REL, &[("x-lock-key", key), ("x-lock-token", t)]).await.unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    let again = a.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!(again.code(), 200, "{}", again.body);
    assert_eq!(again.json["existing"].as_bool(), Some(true), "a second slot for the same session: {}", again.body);
    assert_eq!(again.json["token"], mine.json["token"], "{}", again.body);
    let h = a.get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(h.json["holders"].as_array().map(Vec::len), Some(1), "{}", h.body);
}

/// Item 8: the registry says mutex, the authoritative policy record says 3 (as
/// after `lockctl limit` raised it ahead of a registry apply). A key this arbiter
/// granted is "most likely held" to its fast path; the second acquire must still
/// be granted at once under the authoritative limit, not wait for a release.
#[tokio::test]
async fn the_mutex_fast_path_obeys_the_authoritative_limit() {
    let st = Stack::builder("edges-fast-limit").envoy_config("lock-tier").registry(REGISTRY).start().await.unwrap();
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let key = "payments/raised";
    let r = a.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert_eq!(st.write_class_limit("default", 3).await.unwrap(), 1);
    // The fast path serves acquires on the caller's own session.
    let s = b.post("/v1/sessions", &[("x-lock-key", key)]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap_or_else(|| panic!("{}", s.body)).to_owned();
    let started = tokio::time::Instant::now();
    let second =
        b.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &sid), ("x-lock-wait-ms", "4000")]).await.unwrap();
    assert_eq!(second.code(), 200, "under the authoritative limit 3: {}", second.body);
    assert!(started.elapsed() < Duration::from_secs(2), "granted only after {:?}", started.elapsed());
    let h = a.get("/v1/locks", &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(h.json["holders"].as_array().map(Vec::len), Some(2), "{}", h.body);
}

/// Item 4. Keys granted after the snapshot are held when etcd is restored with
/// `--bump-revision` (revisions jump ahead, so the revision floor passes) while
/// the arbiter runs; in the restored store they are free. Clients hammer them
/// from before the restore until well after the seal: no acquire may succeed,
/// neither in the window before the seal check sees the restore nor after.
///
/// In the shipped shape (TLS, auth, the non-root arbiter role, to which etcd 3.5
/// refuses `Status`, so no raft position): the grant clock is what sees it.
#[tokio::test]
async fn a_bumped_restore_grants_no_key_held_before_it() {
    let (granted, sealed) = bumped_restore_under_load("edges-bump", false).await;
    assert_eq!(granted, Vec::<String>::new(), "keys held before the restore were granted again");
    assert_eq!(sealed.as_deref(), Some("clock_behind_mark"));
}

/// The same with the grant clock planted away (`skip_clock_compare`): nothing
/// else sees a bumped restore under the shipped role, and keys the restored store
/// forgot are granted again. Proves the scenario above can fail.
#[tokio::test]
async fn planted_without_the_grant_clock_a_bumped_restore_grants_held_keys_again() {
    let (granted, sealed) = bumped_restore_under_load("edges-bump-planted", true).await;
    assert!(!granted.is_empty(), "nothing was granted again; sealed: {sealed:?}");
}

/// Holds keys granted after a snapshot, restores it with a bump under try-once
/// load, and returns the bodies of the acquires granted after the restore and the
/// seal reason (`None`: not sealed within 15 s).
async fn bumped_restore_under_load(name: &str, planted: bool) -> (Vec<String>, Option<String>) {
    let (st, dir) = marked_stack(name, true, planted.then_some("skip_clock_compare")).await;
    let marks = dir.path().join("marks.json");
    let a = st.client("payments", "a").unwrap();
    let warm = a.post(ACQ, &[("x-lock-key", "payments/before-snapshot")]).await.unwrap();
    assert_eq!(warm.code(), 200, "{}", warm.body);
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    let keys: Vec<String> = (0..8).map(|i| format!("payments/after-snapshot-{i}")).collect();
    for k in &keys {
        let r = a.post(ACQ, &[("x-lock-key", k)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    // The seal check has persisted marks past these grants (the clock's, unless
    // planted away).
    eventually(Duration::from_secs(10), async || {
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&marks)?)?;
        anyhow::ensure!(m["revision"].as_i64().unwrap_or(0) >= 10, "marks {m}");
        anyhow::ensure!(planted || m["clock"].as_i64().unwrap_or(0) >= 10, "marks {m}");
        Ok(())
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let granted = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (c, keys, stop, granted) =
            (st.client("payments", "b").unwrap(), keys.clone(), stop.clone(), granted.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = t;
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let k = &keys[i % keys.len()];
                i += 1;
                match c.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "0")]).await {
                    Ok(r) if r.code() == 200 => {
                        granted.fetch_add(1, Ordering::Relaxed);
                        seen.push(r.body);
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
            seen
        }));
    }
    st.etcd().restore_from(&snap, Some(1_000_000)).await.unwrap();
    // Until sealed, or (planted) until something was granted again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut sealed = None;
    while tokio::time::Instant::now() < deadline {
        if let Ok((_, body)) = st.arbiter(0).admin_get("/status").await {
            let s: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if s["sealed"] == true {
                sealed = Some(s["seal_reason"].as_str().unwrap_or_default().to_owned());
                break;
            }
        }
        if planted && granted.load(Ordering::Relaxed) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut bodies = Vec::new();
    for t in tasks {
        bodies.extend(t.await.unwrap());
    }
    if !planted {
        // Nothing but the snapshot's own hold is in the restored store.
        let mut etcd = st.etcd().client().await.unwrap();
        let held =
            etcd.get(format!("{}/l/", st.root()), Some(etcd_client::GetOptions::new().with_prefix())).await.unwrap();
        assert_eq!(held.kvs().len(), 1, "only the restored hold may exist");
    }
    (bodies, sealed)
}

/// A bumped restore from a snapshot after which only releases happened (no
/// grant): releases put the grant clock too, so the restore is sealed
/// (`clock_behind_mark`) and the released hold is never honoured again; the
/// holder released it and another caller is refused only `sealed`, never
/// `contended`. Shipped shape (TLS, auth, the non-root arbiter role).
#[tokio::test]
async fn a_bumped_restore_that_lost_only_releases_is_sealed() {
    let (contended, sealed) = restore_after_releases("edges-rel-bump", false).await;
    assert_eq!(contended, 0, "the released hold was honoured again (sealed: {sealed:?})");
    assert_eq!(sealed.as_deref(), Some("clock_behind_mark"));
}

/// The same with releases that leave the clock alone (`release_skips_clock`):
/// nothing sees the restore and the released hold stands again.
#[tokio::test]
async fn planted_releases_without_the_grant_clock_leave_a_released_hold_standing() {
    let (contended, sealed) = restore_after_releases("edges-rel-bump-planted", true).await;
    assert!(contended > 0, "the released hold was not honoured again; sealed: {sealed:?}");
}

/// Holds keys, snapshots, releases them all (nothing granted after the snapshot),
/// waits until the marks hold the clock of the last release (the grant's when
/// planted), restores with a bump and asks for the keys as another caller for a
/// few seconds. Returns how many answers were `409 contended` (a restored hold
/// honoured) and the seal reason. Every other answer must be `503 sealed`.
async fn restore_after_releases(name: &str, planted: bool) -> (usize, Option<String>) {
    let (st, dir) = marked_stack(name, true, planted.then_some("release_skips_clock")).await;
    let marks = dir.path().join("marks.json");
    let a = st.client("payments", "a").unwrap();
    let keys: Vec<String> = (0..4).map(|i| format!("payments/released-{i}")).collect();
    let sessions = a.post("/v1/sessions", &[("x-lock-key", keys[0].as_str())]).await.unwrap();
    assert_eq!(sessions.code(), 200, "{}", sessions.body);
    let sid = sessions.json["session"].as_str().unwrap().to_owned();
    let mut tokens = Vec::new();
    for k in &keys {
        let r = a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &sid)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        tokens.push(r.json["token"].as_str().unwrap().to_owned());
    }
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    for (k, t) in keys.iter().zip(&tokens) {
        let r = a.post(REL, &[("x-lock-key", k), ("x-lock-token", t), ("x-lock-session", &sid)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    // The holder keeps its session alive (it holds nothing now): a restored hold
    // on it would stand as long as it does.
    let stop = Arc::new(AtomicBool::new(false));
    let renew = {
        let (stop, a, sid) = (stop.clone(), st.client("payments", "a").unwrap(), sid.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = a.post("/v1/sessions/keepalive", &[("x-lock-session", &sid)]).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    // The marks are persisted with the clock of the last release (or, planted,
    // of the last grant: the releases left the clock where the grants put it).
    let mut etcd = st.etcd().client().await.unwrap();
    let clock = etcd.get(format!("{}/sys/clock", st.root()), None).await.unwrap().kvs()[0].mod_revision();
    eventually(Duration::from_secs(10), async || {
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&marks)?)?;
        anyhow::ensure!(m["clock"].as_i64().unwrap_or(0) >= clock, "marks {m}, clock {clock}");
        Ok(())
    })
    .await;
    st.etcd().restore_from(&snap, Some(1_000_000)).await.unwrap();
    let b = st.client("payments", "b").unwrap();
    let (mut contended, mut sealed) = (0, None);
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    while tokio::time::Instant::now() < until {
        for k in &keys {
            let Ok(r) = b.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "0")]).await else { continue };
            match (r.code(), r.json["code"].as_str()) {
                (409, _) => contended += 1,
                (503, Some("sealed")) => {}
                // A freed key granted after the restore: planted, where nothing
                // sees the restore, once the restored hold has ended.
                (200, _) if planted => {}
                _ => panic!("{k}: {}", r.body),
            }
        }
        if let Ok((_, body)) = st.arbiter(0).admin_get("/status").await {
            let s: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if s["sealed"] == true {
                sealed = Some(s["seal_reason"].as_str().unwrap_or_default().to_owned());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    renew.await.unwrap();
    (contended, sealed)
}

/// A clean stop writes the marks as they are: a grant made right after a seal
/// check (so the next check has not run) is in the marks file once the arbiter
/// has stopped, revision and clock, and the restarted arbiter starts from it.
#[tokio::test]
async fn a_clean_stop_writes_the_marks_of_its_last_grant() {
    let (granted, marks) = stop_right_after_a_grant("edges-stop-marks", false).await;
    assert!(marks["revision"].as_i64().unwrap() >= granted, "marks {marks} miss the grant at {granted}");
    assert!(marks["clock"].as_i64().unwrap() >= granted, "marks {marks} miss the grant's clock at {granted}");
}

/// The same with the stop's write planted away (`no_persist_at_stop`): the file
/// holds only what the last once-a-second check wrote, without the grant.
#[tokio::test]
async fn planted_a_stop_that_leaves_the_marks_misses_the_last_grant() {
    let (granted, marks) = stop_right_after_a_grant("edges-stop-marks-planted", true).await;
    assert!(
        marks["revision"].as_i64().unwrap() < granted,
        "the planted stop wrote the marks: {marks}, grant {granted}"
    );
}

/// Grants one key, waits until a seal check has persisted the marks past it,
/// grants a second at once and stops the arbiter cleanly (SIGTERM). Returns the
/// second grant's revision and the marks file after the stop.
async fn stop_right_after_a_grant(name: &str, planted: bool) -> (i64, serde_json::Value) {
    let (st, dir) = marked_stack(name, false, planted.then_some("no_persist_at_stop")).await;
    let marks = dir.path().join("marks.json");
    let a = st.client("payments", "a").unwrap();
    let revision =
        |r: &lockmesh_tests::Resp| -> i64 { r.json["revision"].as_i64().unwrap_or_else(|| panic!("{}", r.body)) };
    let r = a.post(ACQ, &[("x-lock-key", "payments/stop-first")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let first = revision(&r);
    let read = || -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&marks).unwrap_or_default()).unwrap_or_default()
    };
    // A check has just written the marks: the next one is about a second away.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while read()["revision"].as_i64().unwrap_or(0) < first {
        assert!(std::time::Instant::now() < until, "no check wrote the marks past {first}: {}", read());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = a.post(ACQ, &[("x-lock-key", "payments/stop-second")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let granted = revision(&r);
    st.arbiter(0).stop().await.unwrap();
    (granted, read())
}

/// A lock tier whose arbiter keeps marks in `<dir>/marks.json`, on an etcd of its
/// own in the shipped shape (TLS, auth, the non-root role) when `own`, with the
/// planted `fault` if any. The directory lives as long as the caller keeps it.
async fn marked_stack(name: &str, own: bool, fault: Option<&str>) -> (Stack, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let mut b = Stack::builder(name)
        .envoy_config("lock-tier")
        .registry(REGISTRY)
        .arbiter_extra_yaml(format!("marks_file: {:?}", marks.display().to_string()));
    if own {
        b = b.own_etcd(1).secure_etcd();
    }
    if let Some(f) = fault {
        b = b.arbiter_extra_yaml(format!("test_faults: [{f}]")).arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    (b.start().await.unwrap(), dir)
}
