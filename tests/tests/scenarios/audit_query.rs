//! Issue #17 item 6: the audit query API answers operators only, on its own port.
//! Against a real etcd, arbiter, Envoy and `lockmesh-audit`, queried with the real
//! `lockctl audit`: a workload's certificate, no certificate, a certificate of
//! another CA and an operator's tool without its token are refused with the
//! operator plane's codes; the metrics port, which scrapers reach, answers a query
//! 404 and no event; the operator with certificate and token gets the history
//! (positive control); a planted `query:` section that admits nobody by name (no
//! identity check) is refused by `--check-config`. `lockmesh_audit::query_port`'s
//! unit tests show that an access check letting anyone through fails the refusal
//! assertion used here.

use std::process::Command;

use lockmesh_devcerts::jwt::Issuer;
use lockmesh_tests::{paths::profile_dir, probe::http_get, Stack};
use serde_json::Value;

use crate::{audit::Tailer, console::operator_token};

const ISS: &str = "https://idp.audit-query.test";
const KEY: &str = "payments/audit-query/k1";

/// The refusal code in `lockctl audit`'s error line (the tailer's `{"code",...}` body).
fn code_of(stderr: &str) -> Option<String> {
    let body = &stderr[stderr.find('{')?..];
    let v: Value = serde_json::from_str(body.lines().next()?.trim()).ok()?;
    v["code"].as_str().map(str::to_owned)
}

#[tokio::test]
async fn only_operators_query_the_audit_store_and_only_on_the_query_port() {
    let dir = tempfile::tempdir().unwrap();
    let idp = Issuer::generate("k1").unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, idp.jwks()).unwrap();
    let st = Stack::builder("audit-query").envoy_config("lock-tier").start().await.unwrap();
    let ops = format!(", operators: {{ jwks_file: {:?}, issuer: {ISS:?} }}", jwks.display().to_string());
    let tailer = Tailer::start_with(&st, "", &ops).await;
    let c = st.client("payments", "a").unwrap();
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", KEY)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let token = operator_token(&idp, ISS, "alice");
    let history = ["history", KEY];

    // Positive control: the operator's tool with its token gets the key's grant.
    let mut answer = Value::Null;
    for _ in 0..50 {
        let (code, stdout, stderr) = tailer.lockctl_as(Some(&tailer.operator), Some(&token), &history);
        assert_eq!(code, 0, "{stderr}");
        answer = serde_json::from_str(&stdout).unwrap();
        if answer["events"].as_array().is_some_and(|e| e.iter().any(|e| e["kind"] == "grant")) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let events = answer["events"].as_array().cloned().unwrap_or_default();
    assert!(events.iter().any(|e| e["kind"] == "grant" && e["key"] == KEY), "{answer}");

    // Callers without an operator identity: refused with the operator plane's codes, no event.
    let workload = st.pki().client("payments", "a").unwrap();
    let cases: [(&str, Option<&lockmesh_tests::ClientCert>, Option<&str>, &str); 3] = [
        ("a workload's certificate, with a valid token", Some(&workload), Some(&token), "admin.client_denied"),
        ("no client certificate, with a valid token", None, Some(&token), "admin.client_denied"),
        ("the operators' tool without a token", Some(&tailer.operator), None, "admin.token_missing"),
    ];
    for (what, cert, tok, want) in cases {
        let (code, stdout, stderr) = tailer.lockctl_as(cert, tok, &history);
        assert_eq!(code, 1, "{what}: {stdout} {stderr}");
        assert_eq!(code_of(&stderr).as_deref(), Some(want), "{what}: {stderr}");
        assert!(!stdout.contains(KEY) && !stderr.contains(KEY), "{what}: the key was answered");
        assert!(!stderr.contains(&token), "{what}: the token echoed");
    }
    let status = |stderr: &str, s: &str| stderr.contains(&format!(" {s} "));
    let (_, _, stderr) = tailer.lockctl_as(Some(&tailer.operator), Some("not.a.jwt"), &history);
    assert_eq!(code_of(&stderr).as_deref(), Some("admin.token_invalid"), "{stderr}");
    assert!(status(&stderr, "401 Unauthorized"), "{stderr}");
    let (_, _, stderr) = tailer.lockctl_as(Some(&workload), Some(&token), &history);
    assert!(status(&stderr, "403 Forbidden"), "{stderr}");
    // A certificate of another CA does not get through the handshake.
    let rogue = st.pki().rogue_as("lockmesh-system", "lockctl").unwrap();
    let (code, stdout, stderr) = tailer.lockctl_as(Some(&rogue), Some(&token), &history);
    assert_eq!(code, 1, "rogue CA: {stdout} {stderr}");
    assert!(!stdout.contains(KEY), "rogue CA: the key was answered");

    // The metrics port, which scrapers reach: no query answer.
    let metrics_url = format!("http://127.0.0.1:{}", tailer.admin_port);
    let out = Command::new(profile_dir().join("lockctl"))
        .args(["audit", "--url", &metrics_url, "--json", "history", KEY])
        .env("LOCKMESH_ADMIN_TOKEN", &token)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout} {stderr}");
    assert!(stderr.contains("404 Not Found") && stderr.contains("query port"), "{stderr}");
    assert!(!stdout.contains(KEY), "the metrics port answered the query");
    let m = http_get(tailer.admin_port, "/metrics").await.unwrap();
    assert!(m.body.contains("lockmesh_audit_leader 1") && !m.body.contains(KEY), "{}", m.body);

    // A planted config whose query API checks no identity: refused before it runs.
    let planted = tailer.dir.path().join("planted.yaml");
    let cfg = std::fs::read_to_string(tailer.dir.path().join("audit.yaml")).unwrap();
    let allowed = format!("allowed_clients: [{:?}]", tailer.operator.spiffe_id);
    assert!(cfg.contains(&allowed), "{cfg}");
    std::fs::write(&planted, cfg.replace(&allowed, "allowed_clients: []")).unwrap();
    let out = Command::new(profile_dir().join("lockmesh-audit")).arg("--check-config").arg(&planted).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("query.allowed_clients: must name at least one SPIFFE ID"), "{stderr}");
    // The real file passes, and says what it admits.
    let out = Command::new(profile_dir().join("lockmesh-audit"))
        .arg("--check-config")
        .arg(tailer.dir.path().join("audit.yaml"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(&tailer.operator.spiffe_id) && stdout.contains("verified operator token"), "{stdout}");

    // The tailer's log names refusals by code and never carries the token.
    let log = tailer.log();
    assert!(log.contains("admin.client_denied"), "{log}");
    assert!(!log.contains(&token), "the token in the tailer's log");
    tailer.process.kill();
}
