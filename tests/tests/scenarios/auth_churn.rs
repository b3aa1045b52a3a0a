//! Operator tools under a change of etcd's users or roles (`lockmesh_ops::etcd_retry`).
//!
//! etcd 3.5 refuses every request of a client whose login predates a change of
//! its users or roles with `revision of auth store is old`, before applying
//! anything; `etcd-client` does not log in again on it. `lockctl`'s commands log
//! in once and make many calls, so while another tool adds users (test stacks
//! sharing one etcd do) a step used to fail the whole command. Each call now logs
//! in again and is sent again on that refusal only, and `lockctl` says on stderr
//! how many were.
//!
//! - [`multi_step_lockctl_commands_finish_while_users_are_added`]: `class apply`
//!   (drain, verify, one transaction) and `limit change` (drain, verify,
//!   activate) against a secured etcd while a task adds a user every ~10 ms:
//!   every command succeeds, its result is in etcd, and over the rounds etcd did
//!   refuse requests (the commands said they sent them again).
//! - [`the_raw_call_is_refused_and_the_helpers_call_is_served`]: the twin, at the
//!   library level on the same kind of etcd: after another client adds a user,
//!   the raw call is refused; the helper's call of the same client is served, a
//!   guarded create sent again is applied once, and any other refusal (a
//!   permission) returns at once.

use std::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc,
};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use lockmesh_ops::etcd_retry::{auth_retries, Etcd, AUTH_STORE_OLD};
use lockmesh_tests::{paths::profile_dir, unique_prefix, EtcdCluster};
use tokio::time::Instant;

/// A registry with a pool class and the default; `solo` (when present) takes
/// `payments/solo` from the default.
fn registry(with_solo: bool) -> String {
    let mut r = String::from(
        "platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: \"test registry: short TTLs\" }\n\
         classes:\n  \
         - { name: default, default: true, ttl_s: 15, max_holders: 8, enforcement: advisory, risk_owner: t, waiver_expiry: \"2099-12-31\" }\n  \
         - { name: pool, prefixes: [\"payments/pool\"], ttl_s: 15, max_holders: 64, enforcement: advisory, risk_owner: t, waiver_expiry: \"2099-12-31\" }\n",
    );
    if with_solo {
        r.push_str(
            "  - { name: solo, prefixes: [\"payments/solo\"], ttl_s: 15, enforcement: advisory, risk_owner: t, \
             waiver_expiry: \"2099-12-31\" }\n",
        );
    }
    r
}

/// A task adding users to `etcd` (as root) every ~10 ms until stopped; counts them.
struct Churn {
    stop: Arc<AtomicBool>,
    added: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Churn {
    async fn start(etcd: &EtcdCluster, tag: &str) -> Self {
        let mut root = etcd.client().await.unwrap();
        let (stop, added) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let (s, a, tag) = (stop.clone(), added.clone(), tag.to_owned());
        let task = tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                let n = a.fetch_add(1, Ordering::Relaxed);
                root.user_add(format!("churn-{tag}-{n}"), "churn-password", None).await.unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        Self { stop, added, task }
    }

    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        self.added.load(Ordering::Relaxed)
    }
}

/// How many requests a `lockctl` run said it sent again (its stderr line).
fn retried(stderr: &str) -> u64 {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("lockctl: etcd refused "))
        .filter(|l| l.contains("logged in again and sent them again"))
        .filter_map(|l| l.split(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Runs lockctl with `env` (endpoints, CA, user) and `--root root`: (exit code,
/// stdout as JSON, stderr).
async fn lockctl(env: &[(String, String)], root: &str, args: &[&str]) -> (i32, serde_json::Value, String) {
    let out = tokio::process::Command::new(profile_dir().join("lockctl"))
        .args(args)
        .args(["--root", root, "--actor", "test", "--reason", "auth churn"])
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or(serde_json::Value::String(stdout));
    (out.status.code().unwrap_or(-1), json, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn multi_step_lockctl_commands_finish_while_users_are_added() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::builder().secure().start().await.unwrap();
    let root = unique_prefix("auth-churn");
    let users = etcd.users_for(&root, dir.path()).await.unwrap();
    assert!(users.is_secure(), "the scenario needs etcd's auth on");
    let env = users.env("lockmesh-classes");
    let (reg1, reg2) = (dir.path().join("reg1.yaml"), dir.path().join("reg2.yaml"));
    std::fs::write(&reg1, registry(false)).unwrap();
    std::fs::write(&reg2, registry(true)).unwrap();
    let (reg1, reg2) = (reg1.display().to_string(), reg2.display().to_string());
    // Before the churn: the map, then every class's policy record.
    for _ in 0..2 {
        let (code, out, err) = lockctl(&env, &root, &["class", "apply", &reg1]).await;
        assert_eq!(code, 0, "class apply (setup): {out} {err}");
    }
    let admin = Etcd::new(etcd.client().await.unwrap());
    let limit_of = async |class: &str| {
        let r = admin.get(format!("{root}/c/{class}"), None).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(r.kvs()[0].value()).unwrap();
        (v["limit"].as_u64().unwrap(), v["state"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(limit_of("pool").await.0, 64);

    let churn = Churn::start(&etcd, "a").await;
    let started = Instant::now();
    let mut refusals = 0;
    let mut runs = 0;
    // At least 3 rounds, and on until the commands met a few refusals (each
    // round takes tens of milliseconds; at most 30 rounds).
    let mut round = 0u64;
    while (round < 3 || refusals < 3) && round < 30 {
        // A prefix moves to a new class and back: drain both classes, verify,
        // then the new map and the reopened classes in one transaction.
        for (reg, classes) in [(&reg2, ["default", "solo"]), (&reg1, ["default", "solo"])] {
            let (code, out, err) = lockctl(&env, &root, &["class", "apply", reg]).await;
            assert_eq!(code, 0, "class apply under user churn (round {round}): {out} {err}");
            assert_eq!(out["outcome"], "applied", "{out} {err}");
            let mut moved: Vec<&str> = out["classes"].as_array().unwrap().iter().filter_map(|c| c.as_str()).collect();
            moved.sort_unstable();
            assert_eq!(moved, classes, "{out}");
            refusals += retried(&err);
            runs += 1;
        }
        let map = admin.get(format!("{root}/sys/classmap"), None).await.unwrap();
        let map = String::from_utf8_lossy(map.kvs()[0].value()).into_owned();
        assert!(!map.contains("payments/solo"), "the map applied last is reg1's: {map}");
        // A lowering: drain, verify (no holds), activate.
        let to = (63 - round).to_string();
        let (code, out, err) = lockctl(&env, &root, &["limit", "change", "--class", "pool", "--to", &to]).await;
        assert_eq!(code, 0, "limit change under user churn (round {round}): {out} {err}");
        assert_eq!(out["outcome"], "activated", "{out} {err}");
        assert_eq!(limit_of("pool").await, (63 - round, "active".to_owned()));
        refusals += retried(&err);
        runs += 1;
        round += 1;
    }
    let added = churn.stop().await;
    eprintln!(
        "auth churn: {runs} lockctl runs in {:?}, {added} users added meanwhile, {refusals} requests refused and \
         sent again",
        started.elapsed()
    );
    // The scenario is only a test of the retry if etcd did refuse requests of
    // the commands while they ran.
    assert!(refusals > 0, "no lockctl run saw a refusal: {added} users added over {runs} runs");
}

#[tokio::test]
async fn the_raw_call_is_refused_and_the_helpers_call_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::builder().secure().start().await.unwrap();
    let root = unique_prefix("auth-twin");
    let users = etcd.users_for(&root, dir.path()).await.unwrap();
    assert!(users.is_secure(), "the scenario needs etcd's auth on");
    let mut admin = etcd.client().await.unwrap();
    // lockmesh-classes may write class policies under the root.
    let client = users.client("lockmesh-classes").await.unwrap();
    let key = format!("{root}/c/twin");
    let mut n = 0;
    let mut add_user = async || {
        n += 1;
        admin.user_add(format!("bystander-{n}"), "bystander-password", None).await.unwrap();
    };

    // The raw call after a user change: refused, even with etcd-client's own
    // token refresh on.
    add_user().await;
    let raw = client.clone().get(key.as_str(), None).await;
    let e = raw.err().expect("etcd served a login older than its auth store");
    assert!(e.to_string().contains(AUTH_STORE_OLD), "{e}");

    // The helper's call of the same client (its login still old): served.
    let before = auth_retries();
    let etcd_r = Etcd::of(&client);
    let r = etcd_r.get(key.as_str(), None).await.unwrap();
    assert_eq!(r.kvs().len(), 0);
    assert!(auth_retries() > before, "the helper did not count the refused request");

    // A guarded create refused once, sent again: applied exactly once (the
    // refused one applied nothing, or the guard would have failed it).
    add_user().await;
    let create = Txn::new().when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
        key.as_str(),
        "v1",
        None,
    )]);
    let before = auth_retries();
    let t = etcd_r.txn(create).await.unwrap();
    assert!(t.succeeded(), "the create sent again found the key: the refused one was applied");
    assert!(auth_retries() > before, "the create was not refused first");
    let r = etcd_r.get(key.as_str(), None).await.unwrap();
    assert_eq!((r.kvs().len(), r.kvs()[0].version()), (1, 1), "one write of the key");

    // Any other refusal returns at once: lockmesh-classes may not write a hold.
    add_user().await;
    let started = Instant::now();
    let denied = etcd_r.put(format!("{root}/l/x/h/0"), "x", None).await.unwrap_err();
    assert!(denied.to_string().contains("permission denied"), "{denied}");
    assert!(started.elapsed() < Duration::from_secs(3), "a permission refusal was retried: {:?}", started.elapsed());
}
