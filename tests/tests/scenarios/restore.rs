//! Issue 3: restore safety. Each scenario issues real tokens, takes a real etcd
//! snapshot, restores it with the ORIGINAL `--initial-cluster` and token (so the
//! cluster id stays the same), and checks that the arbiter seals, grants nothing,
//! and that after the guarded epoch advance every new token is above every token
//! issued before the restore.

use std::{path::PathBuf, process::Stdio, time::Duration};

use lockmesh_tests::{client::LockClient, eventually, paths::profile_dir, Stack};
use tokio::io::{AsyncBufReadExt, BufReader};

const ACQ: &str = "/v1/locks/acquire";

fn lockctl() -> PathBuf {
    profile_dir().join("lockctl")
}

fn token(r: &lockmesh_tests::Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token: {}", r.body)).parse().unwrap()
}

async fn status(st: &Stack, i: usize) -> serde_json::Value {
    let (code, body) = st.arbiter(i).admin_get("/status").await.unwrap();
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// A stack on its own one-member etcd with a durable marks file.
async fn stack(name: &str, marks: &std::path::Path) -> Stack {
    Stack::builder(name)
        .envoy_config("lock-tier")
        .own_etcd(1)
        .arbiter_extra_yaml(format!("marks_file: {:?}", marks.display().to_string()))
        .start()
        .await
        .unwrap()
}

/// Waits until the marks file holds at least `rev` (the checker persists every second).
async fn marks_reach(marks: &std::path::Path, rev: u64) {
    eventually(Duration::from_secs(10), async || {
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(marks)?)?;
        anyhow::ensure!(m["revision"].as_u64().unwrap_or(0) >= rev, "marks at {}", m["revision"]);
        Ok(())
    })
    .await;
}

async fn wait_sealed(st: &Stack) -> String {
    eventually(Duration::from_secs(15), async || {
        let s = status(st, 0).await;
        anyhow::ensure!(s["sealed"] == true, "not sealed: {s}");
        Ok(s["seal_reason"].as_str().unwrap_or_default().to_owned())
    })
    .await
}

async fn grants(c: &LockClient, prefix: &str, n: usize) -> Vec<u64> {
    let mut v = Vec::new();
    for i in 0..n {
        let r = c.post(ACQ, &[("x-lock-key", &format!("payments/{prefix}-{i}"))]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        v.push(token(&r));
    }
    v
}

async fn advance(st: &Stack, expected: u64, new: u64) -> std::process::Output {
    tokio::process::Command::new(lockctl())
        .args(["epoch-advance", "--endpoints", &st.etcd().endpoints().join(","), "--root", st.root()])
        .args(["--expected-epoch", &expected.to_string(), "--new-epoch", &new.to_string()])
        .envs(st.etcd_env("lockmesh-admin-epoch"))
        .output()
        .await
        .unwrap()
}

async fn assert_refused_sealed(c: &LockClient, reason: &str) {
    let r = c.post(ACQ, &[("x-lock-key", "payments/while-sealed")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("sealed")), "{}", r.body);
    assert_eq!(r.header("x-lockmesh-sealed"), Some(reason), "{:?}", r.headers);
}

/// Which detector a hand-run restore scenario runs with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Detector {
    /// The shipped shape: TLS, auth, the least-privilege arbiter role (no root,
    /// so no raft position): the grant clock sees a bumped restore.
    Shipped,
    /// The raft check alone: the grant clock planted away
    /// (`skip_clock_compare`), on a plaintext etcd whose Status the arbiter may
    /// read (etcd 3.5 serves it to root only).
    RaftOnly,
}

/// The shared body of the hand-run restore scenarios.
async fn hand_run_restore(name: &str, bump: Option<u64>, restart_arbiter: bool, want_reason: &str) {
    hand_run_restore_with(name, bump, restart_arbiter, Detector::Shipped, want_reason).await
}

async fn hand_run_restore_with(
    name: &str,
    bump: Option<u64>,
    restart_arbiter: bool,
    detector: Detector,
    want_reason: &str,
) {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let st = match detector {
        Detector::Shipped => stack(name, &marks).await,
        Detector::RaftOnly => Stack::builder(name)
            .envoy_config("lock-tier")
            .own_etcd(1)
            .plaintext_etcd()
            .arbiter_extra_yaml(format!("marks_file: {:?}", marks.display().to_string()))
            .arbiter_extra_yaml("test_faults: [skip_clock_compare]")
            .arbiter_env("LOCKMESH_TEST_FAULTS", "1")
            .start()
            .await
            .unwrap(),
    };
    let a = st.client("payments", "a").unwrap();
    // A hold that the snapshot captures, then more grants after the snapshot.
    let restored = a.post(ACQ, &[("x-lock-key", "payments/restored")]).await.unwrap();
    let restored_session = restored.json["session"].as_str().unwrap().to_owned();
    let mut before = grants(&a, "pre", 3).await;
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    before.extend(grants(&a, "post", 5).await);
    let max_before = *before.iter().max().unwrap();
    marks_reach(&marks, max_before & ((1 << 48) - 1)).await;

    if restart_arbiter {
        st.arbiter(0).stop().await.unwrap();
    }
    st.etcd().restore_from(&snap, bump).await.unwrap();
    if restart_arbiter {
        st.arbiter(0).restart().await.unwrap();
    }
    let reason = wait_sealed(&st).await;
    assert_eq!(reason, want_reason);
    assert_refused_sealed(&a, want_reason).await;
    let (_, health) = st.arbiter(0).admin_get("/healthz").await.unwrap();
    assert!(health.contains(&format!("sealed: {want_reason}")), "{health}");
    let (_, metrics) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    assert!(metrics.contains(&format!("lockmesh_arbiter_sealed{{reason=\"{want_reason}\"}} 1")), "{metrics}");
    // Nothing was granted while sealed: the key stays free in etcd.
    let mut etcd = st.etcd().client().await.unwrap();
    let r = a.get("/v1/locks", &[("x-lock-key", "payments/while-sealed")]).await.unwrap();
    assert_eq!(r.code(), 503, "{}", r.body);
    let held = etcd.get(format!("{}/l/", st.root()), Some(etcd_client::GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(held.kvs().len(), 4, "only the restored holds may exist");

    let out = advance(&st, 1, 2).await;
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eventually(Duration::from_secs(10), async || {
        let s = status(&st, 0).await;
        anyhow::ensure!(s["sealed"] == false, "still sealed: {s}");
        Ok(())
    })
    .await;
    let after = grants(&a, "after", 3).await;
    for t in &after {
        assert!(*t > max_before, "token {t} after the restore is not above {max_before}");
        assert_eq!(t >> 48, 2, "token {t} is not in epoch 2");
    }
    // The holder whose hold the snapshot brought back cannot renew.
    let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", &restored_session)]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (410, Some("session_expired")), "{}", r.body);
}

#[tokio::test]
async fn hand_run_restore_without_bump_seals_while_the_arbiter_runs() {
    hand_run_restore("restore-nobump", None, false, "revision_behind_mark").await;
}

#[tokio::test]
async fn hand_run_restore_with_bump_seals_after_an_arbiter_restart() {
    hand_run_restore("restore-bump", Some(1_000_000), true, "clock_behind_mark").await;
}

#[tokio::test]
async fn a_stale_epoch_advance_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let st = stack("restore-stale", &dir.path().join("marks.json")).await;
    let a = st.client("payments", "a").unwrap();
    let t1 = token(&a.post(ACQ, &[("x-lock-key", "payments/x")]).await.unwrap());
    let mut etcd = st.etcd().client().await.unwrap();
    let epoch_key = format!("{}/sys/epoch", st.root());
    let before = etcd.get(epoch_key.as_str(), None).await.unwrap().kvs()[0].clone();
    let out = advance(&st, 7, 8).await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expected epoch 7 but the epoch record holds 1: nothing changed")
    );
    let after = etcd.get(epoch_key.as_str(), None).await.unwrap().kvs()[0].clone();
    assert_eq!((before.mod_revision(), before.value()), (after.mod_revision(), after.value()));
    // The hold is untouched and the service unsealed.
    let h = a.get("/v1/locks", &[("x-lock-key", "payments/x")]).await.unwrap();
    assert_eq!(h.json["holders"].as_array().map(Vec::len), Some(1), "{}", h.body);
    assert_eq!(status(&st, 0).await["sealed"], false);
    assert!(t1 >> 48 == 1);
}

#[tokio::test]
async fn the_restore_command_runs_end_to_end_and_resumes_after_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let st = stack("restore-cmd", &marks).await;
    let a = st.client("payments", "a").unwrap();
    let restored = a.post(ACQ, &[("x-lock-key", "payments/held")]).await.unwrap();
    let session = restored.json["session"].as_str().unwrap().to_owned();
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    let before = grants(&a, "later", 4).await;
    let max_before = *before.iter().max().unwrap();
    marks_reach(&marks, max_before & ((1 << 48) - 1)).await;

    let m = st.etcd().member(0);
    m.stop().await.unwrap();
    std::fs::remove_dir_all(m.data_dir()).unwrap();
    let etcdutl = lockmesh_tests::etcd::etcdutl_bin().unwrap();
    let cmd = || {
        let mut c = tokio::process::Command::new(lockctl());
        c.args(["restore", "--snapshot", snap.to_str().unwrap()])
            .arg(format!("--member={}={}={}", m.name(), m.data_dir().display(), m.peer_url()))
            .args(["--initial-cluster-token", st.etcd().token(), "--etcdutl", etcdutl.to_str().unwrap()])
            .args(["--endpoints", &st.etcd().endpoints().join(","), "--root", st.root()])
            .args(["--expected-epoch", "1", "--marks", marks.to_str().unwrap(), "--wait-timeout-s", "60"])
            .envs(st.etcd_env("lockmesh-admin-epoch"))
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        c
    };
    // First run: restores, waits for etcd; we start etcd, and kill the command as
    // soon as it says it has sealed (step 1); it may have gone further by then.
    let mut first = cmd().spawn().unwrap();
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    let mut log = Vec::new();
    while let Some(l) = lines.next_line().await.unwrap() {
        log.push(l.clone());
        if l.starts_with("waiting for etcd") {
            m.restart().await.unwrap();
        }
        if l.starts_with("1/4 sealed") {
            first.kill().await.unwrap();
            break;
        }
    }
    assert!(log.iter().any(|l| l.contains("headroom")), "{log:?}");
    // Where the kill landed (the command runs on while its output is read behind
    // it): killed in epoch 1 with the explicit seal, the arbiter is sealed by
    // whichever detector saw it first, its grant clock (the restore was bumped)
    // or that seal; killed after the advance (epoch 2, still sealed) it refuses
    // with the explicit seal; killed after the last step the new epoch stands.
    let mut etcd = st.etcd().client().await.unwrap();
    let rec = etcd.get(format!("{}/sys/epoch", st.root()), None).await.unwrap();
    let rec: serde_json::Value = serde_json::from_slice(rec.kvs()[0].value()).unwrap();
    let killed_at = (rec["epoch"].as_u64(), rec["sealed"].is_string());
    match killed_at {
        (Some(1), true) => {
            let reason = wait_sealed(&st).await;
            assert!(reason == "explicit" || reason == "clock_behind_mark", "{reason}");
            assert_refused_sealed(&a, &reason).await;
        }
        (Some(2), true) => {
            let reason = wait_sealed(&st).await;
            assert!(reason == "explicit" || reason == "clock_behind_mark", "{reason}");
            assert_refused_sealed(&a, &reason).await;
        }
        (Some(2), false) => {}
        _ => panic!("the epoch record is neither sealed in epoch 1 or 2 nor advanced: {rec}"),
    }
    // Re-run: the restore is kept, the advance resumes from the record's state.
    let out = cmd().output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("already holds this restore"), "{text}");
    let resumed = ["3/4 revoked", "4/4 unsealed"].iter().all(|l| text.contains(l));
    match killed_at {
        (Some(1), true) => assert!(text.contains("2/4 advanced:") && resumed, "{text}"),
        (Some(2), true) => assert!(text.contains("2/4 advanced earlier") && resumed, "{text}"),
        _ => assert!(text.contains("done: epoch 2 is current"), "{text}"),
    }
    // A third run finds nothing to do.
    let out = cmd().output().await.unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("done: epoch 2 is current"));
    eventually(Duration::from_secs(10), async || {
        anyhow::ensure!(status(&st, 0).await["sealed"] == false, "still sealed");
        Ok(())
    })
    .await;
    let after = token(&a.post(ACQ, &[("x-lock-key", "payments/held")]).await.unwrap());
    assert!(after > max_before && after >> 48 == 2, "{after} vs {max_before}");
    let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", &session)]).await.unwrap();
    assert_eq!(r.code(), 410, "{}", r.body);
}

#[tokio::test]
async fn a_lagging_member_does_not_seal_a_healthy_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let st = Stack::builder("restore-lag")
        .envoy_config("lock-tier")
        .own_etcd(3)
        .arbiter_extra_yaml(format!("marks_file: {:?}", dir.path().join("marks.json").display().to_string()))
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "a").unwrap();
    grants(&a, "warm", 3).await;
    // Find a follower and freeze it while the others keep committing.
    let mut lagging = None;
    for i in 0..3 {
        let mut c = st.etcd().client_on(&[st.etcd().member(i).client_url()]).await.unwrap();
        let s = c.status().await.unwrap();
        if s.leader() != s.header().unwrap().member_id() {
            lagging = Some(i);
            break;
        }
    }
    let f = st.etcd().member(lagging.unwrap());
    f.pause().unwrap();
    let mut ok = 0;
    for i in 0..20 {
        let r = a.post(ACQ, &[("x-lock-key", &format!("payments/lag-{i}"))]).await.unwrap();
        if r.code() == 200 {
            ok += 1;
        }
    }
    assert!(ok > 0, "nothing was granted while one member of three was paused");
    tokio::time::sleep(Duration::from_secs(3)).await;
    f.resume().unwrap();
    // While it catches up, and after, nothing seals.
    for _ in 0..6 {
        assert_eq!(status(&st, 0).await["sealed"], false);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let r = a.post(ACQ, &[("x-lock-key", "payments/after-lag")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
}

#[tokio::test]
async fn hand_run_restore_without_bump_seals_after_an_arbiter_restart() {
    hand_run_restore("restore-nobump-restart", None, true, "revision_behind_mark").await;
}

#[tokio::test]
async fn hand_run_restore_with_bump_seals_while_the_arbiter_runs() {
    hand_run_restore("restore-bump-running", Some(1_000_000), false, "clock_behind_mark").await;
}

/// The raft check on its own (the grant clock planted away, on an etcd whose
/// Status the arbiter may read): a second, independent detector of a bumped
/// restore, kept tested.
#[tokio::test]
async fn hand_run_restore_with_bump_is_sealed_by_the_raft_check_alone() {
    hand_run_restore_with("restore-bump-raft", Some(1_000_000), false, Detector::RaftOnly, "raft_behind_mark").await;
}

/// An arbiter down since before the snapshot: its revision and grant-clock
/// marks predate the snapshot, so neither can tell the cluster it comes back to
/// was restored. The raft term in every linearizable answer can, once the
/// cluster before the restore had a leader change (here: its member restarted),
/// since the restored raft log starts over: the first grant it commits seals
/// `term_behind_mark` and is taken back. Shipped shape (TLS, auth, the
/// least-privilege arbiter role: no `Status`). Returns the first acquire's answer
/// after the restore.
async fn slept_through_a_restore(name: &str, faults: Option<&str>) -> (Stack, lockmesh_tests::Resp, usize) {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let mut b = Stack::builder(name)
        .envoy_config("lock-tier")
        .own_etcd(1)
        .arbiter_extra_yaml(format!("marks_file: {:?}", marks.display().to_string()));
    if let Some(f) = faults {
        b = b.arbiter_extra_yaml(format!("test_faults: [{f}]")).arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    let st = b.start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    grants(&a, "first", 2).await;
    // A leader change: the member restarts and elects itself in a new term.
    st.etcd().member(0).restart().await.unwrap();
    let after = eventually(Duration::from_secs(20), async || {
        let r = a.post(ACQ, &[("x-lock-key", "payments/after-election")]).await?;
        anyhow::ensure!(r.code() == 200, "{}", r.body);
        Ok(token(&r))
    })
    .await;
    marks_reach(&marks, after & ((1 << 48) - 1)).await;
    if faults.is_none() {
        eventually(Duration::from_secs(10), async || {
            let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&marks)?)?;
            anyhow::ensure!(m["term"].as_u64().unwrap_or(0) >= 3, "marks file term {}", m["term"]);
            Ok(())
        })
        .await;
    }

    st.arbiter(0).stop().await.unwrap();
    let held = hold_count(&st).await;
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    st.etcd().restore_from(&snap, None).await.unwrap();
    let mut etcd = st.etcd().client().await.unwrap();
    let term = etcd.get("x", None).await.unwrap().header().unwrap().raft_term();
    assert!(term < 3, "the restored cluster's raft term {term} is not below the mark");
    st.arbiter(0).restart().await.unwrap();
    let r = a.post(ACQ, &[("x-lock-key", "payments/after-restore")]).await.unwrap();
    (st, r, held)
}

/// Keys under the stack's lock prefix (holds and their records).
async fn hold_count(st: &Stack) -> usize {
    let mut etcd = st.etcd().client().await.unwrap();
    let opts = etcd_client::GetOptions::new().with_prefix().with_keys_only();
    etcd.get(format!("{}/l/", st.root()), Some(opts)).await.unwrap().kvs().len()
}

#[tokio::test]
async fn an_arbiter_down_since_before_the_snapshot_seals_on_the_raft_term() {
    let (st, r, held) = slept_through_a_restore("restore-slept", None).await;
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("sealed")), "{}", r.body);
    assert_eq!(r.header("x-lockmesh-sealed"), Some("term_behind_mark"), "{:?}", r.headers);
    assert_eq!(wait_sealed(&st).await, "term_behind_mark");
    // The sealed grant was taken back: no more than the snapshot's holds (some
    // of which may have expired since).
    assert!(hold_count(&st).await <= held, "a grant on the restored cluster stayed");

    let out = advance(&st, 1, 2).await;
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let a = st.client("payments", "a").unwrap();
    eventually(Duration::from_secs(10), async || {
        let r = a.post(ACQ, &[("x-lock-key", "payments/after-advance")]).await?;
        anyhow::ensure!(r.code() == 200, "{}", r.body);
        anyhow::ensure!(token(&r) >> 48 == 2, "token {} not in epoch 2", token(&r));
        Ok(())
    })
    .await;
}

/// The twin: without the term mark the arbiter grants in the old epoch on the
/// restored cluster.
#[tokio::test]
async fn planted_without_the_term_mark_an_arbiter_that_slept_through_a_restore_grants_in_the_old_epoch() {
    let (_st, r, _) = slept_through_a_restore("restore-slept-planted", Some("skip_term_mark")).await;
    assert_eq!(r.code(), 200, "{}", r.body);
    assert_eq!(token(&r) >> 48, 1, "{}", r.body);
}

/// A re-acquire on a session that holds the key is answered from a read of the
/// key's holds (`existing: true`). That read gets the checks a refused grant's
/// answer gets: right after a restore, before anything else noticed it, a
/// holder whose hold the snapshot brought back re-acquired on its session and
/// was answered 200 with that hold's token, although the hold had been released
/// and the key granted again after the snapshot (the rebalance gate's
/// `tokens_increase` found it: one token handed twice). Now the read's revision
/// is below the arbiter's mark: it seals and refuses. The seal round is switched
/// off (`no_seal_round`) so that only the request can notice the restore. Twin:
/// `unchecked_existing_read`.
async fn re_acquire_after_restore(name: &str, planted: bool) -> (lockmesh_tests::Resp, u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let registry = format!(
        "{}  - {{ name: pair, prefixes: [\"payments/pair\"], max_holders: 2, ttl_s: 15, enforcement: advisory, \
         risk_owner: t, waiver_expiry: \"2099-12-31\" }}\n",
        lockmesh_tests::DEFAULT_TEST_REGISTRY
    );
    let faults = if planted { "[no_seal_round, unchecked_existing_read]" } else { "[no_seal_round]" };
    let st = Stack::builder(name)
        .envoy_config("lock-tier")
        .own_etcd(1)
        .registry(registry)
        .arbiter_extra_yaml(format!("marks_file: {:?}", marks.display().to_string()))
        .arbiter_extra_yaml(format!("test_faults: {faults}"))
        .arbiter_env("LOCKMESH_TEST_FAULTS", "1")
        .start()
        .await
        .unwrap();
    let (a, b) = (st.client("payments", "a").unwrap(), st.client("payments", "b").unwrap());
    let key = "payments/pair/k";
    let first = a.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(first.code(), 200, "{}", first.body);
    let (t1, session) = (token(&first), first.json["session"].as_str().unwrap().to_owned());
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    // After the snapshot: released, and the key granted again above it.
    let rel = a
        .post(
            "/v1/locks/release",
            &[("x-lock-key", key), ("x-lock-session", &session), ("x-lock-token", &t1.to_string())],
        )
        .await
        .unwrap();
    assert_eq!(rel.code(), 200, "{}", rel.body);
    let later = token(&b.post(ACQ, &[("x-lock-key", key)]).await.unwrap());
    // (The marks file is written by the seal round, switched off here: the marks
    // in memory are the ones compared.)
    grants(&b, "after-snap", 3).await;
    st.etcd().restore_from(&snap, None).await.unwrap();
    let r = a.post(ACQ, &[("x-lock-key", key), ("x-lock-session", &session)]).await.unwrap();
    (r, t1, later)
}

#[tokio::test]
async fn a_hold_a_restore_brought_back_is_not_answered_as_held() {
    let (r, _, _) = re_acquire_after_restore("restore-existing", false).await;
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("sealed")), "{}", r.body);
    assert_eq!(r.header("x-lockmesh-sealed"), Some("revision_behind_mark"), "{:?} {}", r.headers, r.body);
}

#[tokio::test]
async fn planted_unchecked_existing_read_answers_a_restored_hold_as_held() {
    let (r, t1, later) = re_acquire_after_restore("restore-existing-planted", true).await;
    assert_eq!((r.code(), r.json["existing"].as_bool()), (200, Some(true)), "{}", r.body);
    // The hold released before `later` was granted, answered as held.
    assert!(token(&r) == t1 && t1 < later, "{} vs {later}", r.body);
}
