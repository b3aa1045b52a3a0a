//! Issue 9 item 5: `lockctl doctor`, `lockctl inspect` and `lockctl saturated`
//! against a real etcd and arbiter. Doctor starts healthy (exit 0), then a class
//! draining a limit change, an expired advisory waiver and an expired pause test
//! of a fenced class each fail it (exit 1, with what to run), and an explicitly
//! sealed cluster shows sealed both in etcd and on the arbiter. The console API of
//! an arbiter without an audit store says so.

use std::process::Command;

use lockmesh_devcerts::jwt::Issuer;
use lockmesh_tests::{eventually, paths::profile_dir, Stack};
use serde_json::Value;

use crate::console::{operator_token, operators_yaml, pause_result, pause_result_at};

const ISS: &str = "https://idp.doctor.test";

fn registry(waiver: &str, pause: &std::path::Path) -> String {
    format!(
        r#"platform: {{ min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }}
classes:
  - {{ name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }}
  - {{ name: pool, prefixes: ["payments/pool"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: pool-team,
      waiver_expiry: "{waiver}" }}
  - {{ name: ledger, prefixes: ["payments/ledger"], ttl_s: 15, enforcement: fenced, pause_test_result: {:?} }}
"#,
        pause.display().to_string()
    )
}

/// Runs lockctl with `args`; returns (exit code, stdout, stderr).
/// `env`: the `LOCKMESH_ETCD_*` variables of the etcd user to run as.
fn lockctl(env: Vec<(String, String)>, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(profile_dir().join("lockctl")).args(args).envs(env).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

struct Doctor<'a> {
    st: &'a Stack,
    /// etcd root's variables: doctor reports the member's version and leader from
    /// etcd's Status, which etcd 3.5 under auth answers only to root (as lockmesh-admin
    /// it says "version unknown": etcd_auth runs doctor that way).
    root_env: Vec<(String, String)>,
    registry: std::path::PathBuf,
    admin_url: String,
}

impl Doctor<'_> {
    /// `lockctl doctor --json`: (exit code, report).
    fn json(&self) -> (i32, Value) {
        let eps = self.st.etcd().endpoints().join(",");
        let reg = self.registry.display().to_string();
        let (code, out, err) = lockctl(
            self.root_env.clone(),
            &[
                "doctor",
                "--json",
                "--endpoints",
                &eps,
                "--root",
                self.st.root(),
                "--registry",
                &reg,
                "--admin-url",
                &self.admin_url,
            ],
        );
        (code, serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}")))
    }

    /// `lockctl doctor` (human): (exit code, text).
    fn human(&self) -> (i32, String) {
        let eps = self.st.etcd().endpoints().join(",");
        let reg = self.registry.display().to_string();
        let (code, out, _) = lockctl(
            self.root_env.clone(),
            &[
                "doctor",
                "--endpoints",
                &eps,
                "--root",
                self.st.root(),
                "--registry",
                &reg,
                "--admin-url",
                &self.admin_url,
            ],
        );
        (code, out)
    }
}

/// The findings of `check` about `subject` (any subject when None).
fn findings<'a>(r: &'a Value, check: &str, subject: Option<&str>) -> Vec<&'a Value> {
    r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["check"] == check && subject.is_none_or(|s| f["subject"] == s))
        .collect()
}

fn status<'a>(r: &'a Value, check: &str, subject: &str) -> &'a str {
    let f = findings(r, check, Some(subject));
    assert_eq!(f.len(), 1, "{check} {subject}: {r:#}");
    f[0]["status"].as_str().unwrap()
}

#[tokio::test]
async fn doctor_finds_draining_classes_expired_waivers_and_pause_tests_and_seals() {
    let dir = tempfile::tempdir().unwrap();
    let pause = dir.path().join("ledger-pause.yaml");
    std::fs::write(&pause, pause_result("ledger")).unwrap();
    let idp = Issuer::generate("k1").unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, idp.jwks()).unwrap();
    let st = Stack::builder("doctor")
        .registry(registry("2099-12-31", &pause))
        .arbiter_extra_yaml(operators_yaml(&jwks, ISS))
        .start()
        .await
        .unwrap();
    let reg_file = dir.path().join("registry.yaml");
    std::fs::write(&reg_file, registry("2099-12-31", &pause)).unwrap();
    let d = Doctor {
        st: &st,
        root_env: st.etcd().client_env(dir.path()).unwrap(),
        registry: reg_file.clone(),
        admin_url: format!("http://127.0.0.1:{}", st.arbiter(0).admin_port()),
    };

    // Healthy: versions of lockctl, the arbiter and etcd; quorum; nothing to act on.
    let (code, r) = d.json();
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["failures"], 0, "{r:#}");
    let v = env!("CARGO_PKG_VERSION");
    assert_eq!(findings(&r, "lockctl.version", None)[0]["detail"], v);
    assert_eq!(status(&r, "arbiter.version", &d.admin_url), "ok");
    assert_eq!(findings(&r, "arbiter.version", None)[0]["detail"], v);
    assert_eq!(status(&r, "arbiter.seal", &d.admin_url), "ok");
    let members = findings(&r, "etcd.member", None);
    assert_eq!(members.len(), 1, "{r:#}");
    assert!(members[0]["detail"].as_str().unwrap().starts_with("etcd 3.5.30, leader"), "{r:#}");
    assert_eq!(findings(&r, "etcd.quorum", None)[0]["status"], "ok");
    assert_eq!(status(&r, "seal.epoch", st.root()), "ok");
    assert_eq!(status(&r, "class.draining", st.root()), "ok");
    assert_eq!(status(&r, "class.pause_test", "ledger"), "ok");
    assert_eq!(status(&r, "class.waiver", "pool"), "ok");
    let (code, text) = d.human();
    assert_eq!(code, 0);
    assert!(text.contains("0 failing, 0 warnings: healthy"), "{text}");

    // inspect of a free key: its class and limit, no holders; waiters need a token.
    let eps = st.etcd().endpoints().join(",");
    let (code, out, err) = lockctl(
        st.etcd_env("lockmesh-admin"),
        &[
            "inspect",
            "payments/pool/k",
            "--json",
            "--endpoints",
            &eps,
            "--root",
            st.root(),
            "--admin-url",
            &d.admin_url,
        ],
    );
    assert_eq!(code, 64, "--admin-url without a token: {out} {err}");
    let token = operator_token(&idp, ISS, "bob");
    let out = Command::new(profile_dir().join("lockctl"))
        .args(["inspect", "payments/pool/k", "--json", "--endpoints", &eps, "--root", st.root()])
        .args(["--admin-url", &d.admin_url])
        .envs(st.etcd_env("lockmesh-admin"))
        .env("LOCKMESH_ADMIN_TOKEN", &token)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!stdout.contains(&token), "token printed");
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let k: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (k["class"].as_str(), k["limit"].as_u64(), k["state"].as_str()),
        (Some("pool"), Some(3), Some("active"))
    );
    assert_eq!((k["holders"].as_array().unwrap().len(), k["waiters"].as_u64()), (0, Some(0)), "{k}");

    // Lower pool's limit with a verification bound of zero: it stays draining.
    let (code, out, _) = lockctl(
        st.etcd_env("lockmesh-classes"),
        &[
            "limit",
            "change",
            "--class",
            "pool",
            "--to",
            "1",
            "--verify-timeout-ms",
            "0",
            "--endpoints",
            &eps,
            "--root",
            st.root(),
        ],
    );
    assert_eq!(code, 2, "{out}");
    let change: Value = serde_json::from_str(out.trim()).unwrap();
    let epoch = change["policy"]["change_epoch"].as_u64().unwrap();
    // The waiver expires and the pause test result expires, in the file the
    // arbiter would read at its next reload.
    std::fs::write(&reg_file, registry("2020-01-31", &pause)).unwrap();
    std::fs::write(&pause, pause_result_at("ledger", now_s() - 86_400, now_s() - 30)).unwrap();
    let (code, r) = d.json();
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["failures"], 3, "{r:#}");
    let drain = findings(&r, "class.draining", Some("pool"));
    assert_eq!(drain[0]["status"], "fail");
    let detail = drain[0]["detail"].as_str().unwrap();
    assert!(detail.starts_with("draining a limit change 3 -> 1 for "), "{detail}");
    assert!(detail.contains(&format!("lockctl limit resume|cancel --class pool --epoch {epoch} --to 1")), "{detail}");
    assert_eq!(status(&r, "class.waiver", "pool"), "fail");
    assert!(findings(&r, "class.waiver", Some("pool"))[0]["detail"]
        .as_str()
        .unwrap()
        .contains("expired on 2020-01-31"));
    assert_eq!(status(&r, "class.pause_test", "ledger"), "fail");
    assert!(findings(&r, "class.pause_test", Some("ledger"))[0]["detail"].as_str().unwrap().contains("expired"));
    assert_eq!(status(&r, "class.waiver", "default"), "ok");
    let (code, text) = d.human();
    assert_eq!(code, 1);
    assert!(text.contains("FAIL  class.draining") && text.contains("3 failing"), "{text}");

    // Cancelled, the class drains no more.
    assert_eq!(
        lockctl(
            st.etcd_env("lockmesh-classes"),
            &[
                "limit",
                "cancel",
                "--class",
                "pool",
                "--epoch",
                &epoch.to_string(),
                "--to",
                "1",
                "--endpoints",
                &eps,
                "--root",
                st.root()
            ]
        )
        .0,
        0
    );

    // The console API of an arbiter without an audit store says so.
    let api = format!("{}/console/api/state", d.admin_url);
    let s: Value = reqwest::Client::new().get(&api).bearer_auth(&token).send().await.unwrap().json().await.unwrap();
    assert_eq!(s["audit"]["configured"], false, "{s}");
    assert_eq!(s["audit"]["message"], "no audit store configured (console.audit_url)");

    // An explicit seal (step 1 of an epoch advance, left unfinished) seals every
    // arbiter: doctor shows it in etcd and on the arbiter.
    let mut etcd = st.etcd().client().await.unwrap();
    let key = format!("{}/sys/epoch", st.root());
    let rec = etcd.get(key.as_str(), None).await.unwrap();
    let mut epoch_rec: Value = serde_json::from_slice(rec.kvs()[0].value()).unwrap();
    epoch_rec["sealed"] = "epoch advance in progress (test)".into();
    epoch_rec["target"] = 2.into();
    etcd.put(key.as_str(), epoch_rec.to_string(), None).await.unwrap();
    eventually(std::time::Duration::from_secs(10), async || {
        let (_, body) = st.arbiter(0).admin_get("/status").await?;
        anyhow::ensure!(body.contains("\"sealed\":true"), "not sealed yet: {body}");
        Ok(())
    })
    .await;
    let (code, r) = d.json();
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(status(&r, "arbiter.seal", &d.admin_url), "fail");
    let seal = findings(&r, "arbiter.seal", None)[0]["detail"].as_str().unwrap();
    assert!(seal.starts_with("sealed (explicit)"), "{seal}");
    assert_eq!(status(&r, "seal.epoch", st.root()), "fail");
    let seal = findings(&r, "seal.epoch", None)[0]["detail"].as_str().unwrap();
    assert!(seal.contains("lockctl epoch-advance --expected-epoch 1 --new-epoch 2"), "{seal}");
}

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}
