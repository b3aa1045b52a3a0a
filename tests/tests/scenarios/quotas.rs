//! Issue 19 item 3: per-namespace quotas on real etcd, Envoy and arbiter. One
//! namespace is stopped at each quota (sessions, holds, waiters, acquire rate)
//! with `429 quota_exceeded` naming it, nothing is granted or opened by a
//! refusal (counted from etcd by the real `lockctl class cost --json`), another
//! namespace is served normally throughout, and nothing is left held. The
//! planted twin (`skip_quota`) shows the first check is what stops it.

use std::{process::Command, time::Duration};

use lockmesh_core::wire::console::QuotaReport;
use lockmesh_tests::{client::Resp, paths::profile_dir, Stack};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const CLOSE: &str = "/v1/sessions/close";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pay, prefixes: ["payments"], ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: bill, prefixes: ["billing"], ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
quotas:
  namespaces:
    - { namespace: payments, sessions: 3, holds: 4, waiters: 2 }
    - { namespace: short, acquires_per_s: 3 }
"#;

fn quota_of(r: &Resp) -> (u16, Option<&str>, Option<&str>) {
    (r.code(), r.json["code"].as_str(), r.json["quota"].as_str())
}

/// `lockctl class cost FILE --endpoints .. --json`: the use etcd holds now.
fn cost(st: &Stack, file: &std::path::Path) -> QuotaReport {
    let eps = st.etcd().endpoints().join(",");
    let out = Command::new(profile_dir().join("lockctl"))
        .args(["class", "cost"])
        .arg(file)
        .args(["--endpoints", &eps, "--root", st.root(), "--json"])
        .envs(st.etcd_env("lockmesh-admin"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// (sessions, holds) of `ns` as etcd holds them.
fn used(st: &Stack, file: &std::path::Path, ns: &str) -> (u64, u64) {
    let r = cost(st, file);
    r.namespaces.iter().find(|q| q.namespace == ns).map_or((0, 0), |q| (q.sessions.used, q.holds.used))
}

fn registry_file(st_name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lockmesh-quotas-{st_name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("registry.yaml");
    std::fs::write(&f, REGISTRY).unwrap();
    f
}

async fn metric(st: &Stack, prefix: &str) -> Option<f64> {
    st.arbiter(0).metric(prefix).await.unwrap()
}

#[tokio::test]
async fn one_namespace_is_stopped_at_each_quota_while_another_is_served() {
    let st = Stack::builder("quotas").envoy_config("lock-tier").registry(REGISTRY).start().await.unwrap();
    let file = registry_file("main");
    let pay = st.client("payments", "a").unwrap();
    let bill = st.client("billing", "b").unwrap();
    let served = || async {
        let r = bill.post(ACQ, &[("x-lock-key", "billing/steady")]).await.unwrap();
        assert_eq!(r.code(), 200, "billing is served normally: {}", r.body);
        let (t, s) = (r.json["token"].as_str().unwrap().to_owned(), r.json["session"].as_str().unwrap().to_owned());
        let r = bill.post(CLOSE, &[("x-lock-session", &s)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        t
    };

    // Sessions: three acquires that each open one; the fourth is refused.
    let mut sessions = Vec::new();
    for i in 0..3 {
        let r = pay.post(ACQ, &[("x-lock-key", &format!("payments/s{i}"))]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        sessions.push(r.json["session"].as_str().unwrap().to_owned());
    }
    let r = pay.post(ACQ, &[("x-lock-key", "payments/s3")]).await.unwrap();
    assert_eq!(quota_of(&r), (429, Some("quota_exceeded"), Some("sessions")), "{}", r.body);
    assert_eq!(r.headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    served().await;
    // Holds: on an open session, one more hold fits (4), the next does not.
    let s0 = sessions[0].clone();
    let r = pay.post(ACQ, &[("x-lock-key", "payments/h4"), ("x-lock-session", &s0)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let r = pay.post(ACQ, &[("x-lock-key", "payments/h5"), ("x-lock-session", &s0)]).await.unwrap();
    assert_eq!(quota_of(&r), (429, Some("quota_exceeded"), Some("holds")), "{}", r.body);
    served().await;
    // Nothing was granted or opened by the refusals: etcd has 3 sessions, 4 holds.
    assert_eq!(used(&st, &file, "payments"), (3, 4));
    let report = cost(&st, &file);
    let row = report.namespaces.iter().find(|q| q.namespace == "payments").unwrap();
    assert!(row.alert && row.sessions.percent == 100 && row.holds.limit == 4, "{row:?}");
    assert!(!report.namespaces.iter().find(|q| q.namespace == "billing").is_some_and(|q| q.alert), "{report:?}");
    for q in ["sessions", "holds"] {
        let line = format!("lockmesh_quota_refusals_total{{namespace=\"payments\",quota=\"{q}\"}}");
        assert_eq!(metric(&st, &line).await, Some(1.0), "{line}");
    }
    let ratio = "lockmesh_quota_use_ratio{cluster=\"coord\",namespace=\"payments\",quota=\"holds\"}";
    assert_eq!(metric(&st, ratio).await, Some(1.0), "{ratio}");
    for s in &sessions {
        assert_eq!(pay.post(CLOSE, &[("x-lock-session", s)]).await.unwrap().code(), 200);
    }
    assert_eq!(used(&st, &file, "payments"), (0, 0), "closing released everything");

    // Waiters: a session holds w1..w3; two acquires wait on w1 and w2 (each opens
    // a session: 3 in all); a third acquire is refused at the waiters quota.
    let r = pay.post(ACQ, &[("x-lock-key", "payments/w1")]).await.unwrap();
    assert_eq!(r.code(), 200, "the ledger saw the closes: {}", r.body);
    let holder = r.json["session"].as_str().unwrap().to_owned();
    let mut tokens = vec![r.json["token"].as_str().unwrap().to_owned()];
    for k in ["payments/w2", "payments/w3"] {
        let r = pay.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &holder)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        tokens.push(r.json["token"].as_str().unwrap().to_owned());
    }
    let waiters: Vec<_> = ["payments/w1", "payments/w2"]
        .into_iter()
        .map(|k| {
            let c = pay.clone();
            tokio::spawn(async move { c.post(ACQ, &[("x-lock-key", k), ("x-lock-wait-ms", "20000")]).await.unwrap() })
        })
        .collect();
    let gauge = "lockmesh_quota_use{cluster=\"coord\",namespace=\"payments\",quota=\"waiters\"}";
    let t0 = std::time::Instant::now();
    while metric(&st, gauge).await != Some(2.0) {
        assert!(t0.elapsed() < Duration::from_secs(15), "the two acquires never waited at the arbiter");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = pay.post(ACQ, &[("x-lock-key", "payments/w4"), ("x-lock-session", &holder)]).await.unwrap();
    assert_eq!(quota_of(&r), (429, Some("quota_exceeded"), Some("waiters")), "{}", r.body);
    served().await;
    // The waiters are still served in turn once their keys are released.
    for (k, t) in ["payments/w1", "payments/w2"].iter().zip(&tokens) {
        let r = pay.post(REL, &[("x-lock-key", k), ("x-lock-token", t), ("x-lock-session", &holder)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    for w in waiters {
        let r = w.await.unwrap();
        assert_eq!(r.code(), 200, "a waiter admitted before the refusal is granted: {}", r.body);
        assert_eq!(
            pay.post(CLOSE, &[("x-lock-session", r.json["session"].as_str().unwrap())]).await.unwrap().code(),
            200
        );
    }
    assert_eq!(pay.post(CLOSE, &[("x-lock-session", &holder)]).await.unwrap().code(), 200);

    // Acquire rate: `short` allows 3 a second. Bursts of acquires are refused
    // `acquire_rate` once the bucket is empty, and never more are granted than
    // the bucket plus its refill allow.
    let t0 = std::time::Instant::now();
    let (mut granted, mut refused, mut sent) = (0u64, 0u64, 0u64);
    while refused == 0 && sent < 120 {
        let burst: Vec<_> = (0..12)
            .map(|i| {
                let c = pay.clone();
                let k = format!("short/r{}", sent + i);
                tokio::spawn(async move { c.post(ACQ, &[("x-lock-key", k.as_str())]).await.unwrap() })
            })
            .collect();
        sent += 12;
        for b in burst {
            let r = b.await.unwrap();
            match quota_of(&r) {
                (200, _, _) => {
                    granted += 1;
                    let s = r.json["session"].as_str().unwrap().to_owned();
                    assert_eq!(pay.post(CLOSE, &[("x-lock-session", &s)]).await.unwrap().code(), 200);
                }
                (429, Some("quota_exceeded"), Some("acquire_rate")) => refused += 1,
                other => panic!("{other:?}: {}", r.body),
            }
        }
    }
    let allowed = 3.0 + 3.0 * t0.elapsed().as_secs_f64() + 1.0;
    assert!(refused > 0, "{sent} acquires, none refused at acquire_rate");
    assert!((granted as f64) <= allowed, "{granted} granted in {:?}: more than the rate allows", t0.elapsed());
    served().await;

    // Nothing is left held in any namespace.
    for ns in ["payments", "short", "billing"] {
        assert_eq!(used(&st, &file, ns), (0, 0), "{ns}");
    }
}

/// The planted twin: with the quota checks skipped (`skip_quota`), the fourth
/// session opens and the namespace goes past its quota. The scenario above
/// would fail on its first refusal.
#[tokio::test]
async fn planted_without_quota_checks_a_namespace_opens_past_its_quota() {
    let st = Stack::builder("quotas-planted")
        .envoy_config("lock-tier")
        .registry(REGISTRY)
        .arbiter_extra_yaml("test_faults: [skip_quota]")
        .arbiter_env("LOCKMESH_TEST_FAULTS", "1")
        .start()
        .await
        .unwrap();
    let file = registry_file("planted");
    let pay = st.client("payments", "a").unwrap();
    for i in 0..4 {
        let r = pay.post(ACQ, &[("x-lock-key", &format!("payments/s{i}"))]).await.unwrap();
        assert_eq!(r.code(), 200, "planted: nothing refuses: {}", r.body);
    }
    assert_eq!(used(&st, &file, "payments"), (4, 4), "past the sessions quota of 3");
}
