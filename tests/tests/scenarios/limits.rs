//! Issue 5: live limit changes on the authoritative class policy (drain, verify,
//! activate-or-refuse, resume, cancel) through the real `lockctl limit` against the
//! arbiters' etcd, with grants refused while draining and the draining class
//! visible in `/status` and `/metrics` with its age.

use std::process::Command;

use lockmesh_tests::{paths::profile_dir, Stack};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pool, prefixes: ["payments/pool"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// Runs `lockctl limit <args>` for class `pool`; returns (exit code, JSON or stderr).
fn lockctl(st: &Stack, args: &[&str]) -> (i32, serde_json::Value, String) {
    let eps = st.etcd().endpoints().join(",");
    let out = Command::new(profile_dir().join("lockctl"))
        .arg("limit")
        .args(args)
        .args(["--endpoints", &eps, "--root", st.root(), "--class", "pool", "--actor", "test", "--reason", "t"])
        .envs(st.etcd_env(if args.first() == Some(&"show") { "lockmesh-admin" } else { "lockmesh-classes" }))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), json, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test]
async fn lowering_drains_verifies_and_activates_only_within_the_target() {
    let st = Stack::builder("limits").envoy_config("lock-tier").arbiters(2).registry(REGISTRY).start().await.unwrap();
    let c = st.client("payments", "a").unwrap();
    let key = [("x-lock-key", "payments/pool/k")];
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let r = c.post(ACQ, &key).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        tokens.push(r.json["token"].as_str().unwrap().to_owned());
    }
    // 3 -> 1 while 3 are held: drained at once, verification reports 3 > 1.
    let (code, j, err) = lockctl(&st, &["change", "--to", "1"]);
    assert_eq!((code, j["outcome"].as_str()), (2, Some("over_target")), "{j} {err}");
    assert_eq!((j["observed"].as_u64(), j["policy"]["limit"].as_u64()), (Some(3), Some(3)), "{j}");
    let epoch = j["policy"]["change_epoch"].as_u64().unwrap();
    assert_eq!(j["policy"]["state"], "draining");
    // Draining refuses new grants, even of another key of the class.
    let r = c.post(ACQ, &[("x-lock-key", "payments/pool/other")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("draining")), "{}", r.body);
    // Visible in health and metrics with its age, on every arbiter.
    for a in st.arbiters() {
        let (_, status) = a.admin_get("/status").await.unwrap();
        let s: serde_json::Value = serde_json::from_str(&status).unwrap();
        let pool = s["classes"]["classes"].as_array().unwrap().iter().find(|c| c["name"] == "pool").unwrap().clone();
        assert_eq!((pool["state"].as_str(), pool["pending_target"].as_u64()), (Some("draining"), Some(1)), "{pool}");
        assert!(pool["draining_age_ms"].as_u64().is_some(), "{pool}");
        let (_, m) = a.admin_get("/metrics").await.unwrap();
        let line =
            m.lines().find(|l| l.starts_with("lockmesh_arbiter_class_draining_seconds{class=\"pool\"}")).unwrap();
        let age: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(age > 0.0, "{line}");
    }
    // A second change is refused while one is pending; stale resume and cancel are
    // refused without change.
    assert_eq!(lockctl(&st, &["change", "--to", "2"]).0, 3);
    assert_eq!(lockctl(&st, &["resume", "--epoch", &(epoch - 1).to_string(), "--to", "1"]).0, 3);
    assert_eq!(lockctl(&st, &["cancel", "--epoch", &epoch.to_string(), "--to", "2"]).0, 3);
    let (_, shown, _) = lockctl(&st, &["show"]);
    assert_eq!((shown["state"].as_str(), shown["change_epoch"].as_u64()), (Some("draining"), Some(epoch)), "{shown}");
    // Still over target after one release; within it after two.
    for (i, t) in tokens[..2].iter().enumerate() {
        let r = c.post(REL, &[key[0], ("x-lock-token", t)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let (code, j, _) = lockctl(&st, &["resume", "--epoch", &epoch.to_string(), "--to", "1"]);
        if i == 0 {
            assert_eq!((code, j["observed"].as_u64()), (2, Some(2)), "{j}");
        } else {
            assert_eq!((code, j["outcome"].as_str(), j["policy"]["limit"].as_u64()), (0, Some("activated"), Some(1)));
        }
    }
    // The new limit holds: one holder, the next acquire is gated.
    let r = c.post(ACQ, &key).await.unwrap();
    assert_eq!((r.code(), r.json["reason"].as_str()), (409, Some("key_gated")), "{}", r.body);
    // Raising is immediate; a lowering cancelled restores the old limit.
    assert_eq!(lockctl(&st, &["change", "--to", "3"]).1["outcome"], "raised");
    let r = c.post(ACQ, &key).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let (code, j, _) = lockctl(&st, &["change", "--to", "1"]);
    assert_eq!(code, 2, "{j}");
    let e2 = j["policy"]["change_epoch"].as_u64().unwrap();
    let (code, j, err) = lockctl(&st, &["cancel", "--epoch", &e2.to_string(), "--to", "1"]);
    assert_eq!(
        (code, j["policy"]["limit"].as_u64(), j["policy"]["state"].as_str()),
        (0, Some(3), Some("active")),
        "{err}"
    );
    assert_eq!(lockctl(&st, &["cancel", "--epoch", &e2.to_string(), "--to", "1"]).0, 3, "a replayed cancel is stale");
    let r = c.post(ACQ, &key).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert_eq!(j["policy"]["last"]["actor"], "test");
}

#[tokio::test]
async fn a_verification_that_times_out_leaves_the_old_limit_draining() {
    let st = Stack::builder("limits-vi").envoy_config("lock-tier").registry(REGISTRY).start().await.unwrap();
    let c = st.client("payments", "a").unwrap();
    let key = [("x-lock-key", "payments/pool/vi")];
    for _ in 0..2 {
        let r = c.post(ACQ, &key).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    // A zero bound: the scan cannot finish, so the answer is bounded and honest.
    let t0 = tokio::time::Instant::now();
    let (code, j, err) = lockctl(&st, &["change", "--to", "1", "--verify-timeout-ms", "0"]);
    assert!(t0.elapsed() < std::time::Duration::from_secs(5), "not bounded: {:?}", t0.elapsed());
    assert_eq!((code, j["outcome"].as_str()), (2, Some("verification_incomplete")), "{j} {err}");
    assert_eq!((j["policy"]["limit"].as_u64(), j["policy"]["state"].as_str()), (Some(3), Some("draining")), "{j}");
    let r = c.post(ACQ, &key).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("draining")), "{}", r.body);
    // With time to finish, the same pending change reports the truth (2 > 1).
    let epoch = j["policy"]["change_epoch"].as_u64().unwrap().to_string();
    let (code, j, _) = lockctl(&st, &["resume", "--epoch", &epoch, "--to", "1"]);
    assert_eq!((code, j["outcome"].as_str(), j["observed"].as_u64()), (2, Some("over_target"), Some(2)), "{j}");
    let (code, j, _) = lockctl(&st, &["cancel", "--epoch", &epoch, "--to", "1"]);
    assert_eq!((code, j["policy"]["limit"].as_u64()), (0, Some(3)), "{j}");
    let r = c.post(ACQ, &key).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
}
