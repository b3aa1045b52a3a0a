//! The real webhook process: HTTPS (rustls) on a free loopback port, answering an
//! AdmissionReview POST from a client that verifies its certificate against a CA
//! (as the API server does with the caBundle), then draining on SIGTERM.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use base64::Engine;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::Value;

use crate::fixtures;

/// Kills the webhook if a test fails before it stops it.
pub(crate) struct Webhook(Child);

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A CA and a serving certificate for `localhost`, written as PEM files.
pub(crate) fn pki(dir: &std::path::Path) -> String {
    let mut ca_params = CertificateParams::default();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let ca = Issuer::new(ca_params, ca_key);
    let params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
    ca_cert.pem()
}

fn start(dir: &std::path::Path) -> (Webhook, String) {
    start_with(dir, &[])
}

/// [`start`] with more arguments (e.g. `--config FILE`).
pub(crate) fn start_with(dir: &std::path::Path, extra: &[&std::ffi::OsStr]) -> (Webhook, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockmesh-sidecar-webhook"))
        .args(extra)
        .args(["--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(dir.join("tls.crt"))
        .arg("--tls-key")
        .arg(dir.join("tls.key"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let port = addr.rsplit(':').next().unwrap().to_owned();
    (Webhook(child), format!("https://localhost:{port}"))
}

#[tokio::test]
async fn tls_webhook_process_answers_an_admission_review() {
    let dir = tempfile::tempdir().unwrap();
    let ca = pki(dir.path());
    let (mut webhook, base) = start(dir.path());
    let client = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();

    let health = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);

    let body = fixtures::admission("pod-opted-in.json");
    let resp = client
        .post(format!("{base}/mutate"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), reqwest::Version::HTTP_11);
    let review: Value = resp.json().await.unwrap();
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    let r = &review["response"];
    assert_eq!(r["uid"], "0f3c7a52-5d1e-4b8e-9a64-2f1f3c1d9e01");
    assert_eq!(r["allowed"], true);
    assert_eq!(r["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD.decode(r["patch"].as_str().unwrap()).unwrap();
    let patch: Value = serde_json::from_slice(&patch).unwrap();
    assert!(patch.as_array().unwrap().iter().any(|op| op["path"] == "/spec/containers"), "{patch}");

    let untouched =
        client.post(format!("{base}/mutate")).body(fixtures::admission("pod-no-annotation.json")).send().await.unwrap();
    let review: Value = untouched.json().await.unwrap();
    assert_eq!(review["response"]["allowed"], true);
    assert!(review["response"].get("patch").is_none());

    let bad = client.post(format!("{base}/mutate")).body("{}").send().await.unwrap();
    assert_eq!(bad.status(), 400);

    // A client that does not trust the CA cannot talk to it.
    let stranger = reqwest::Client::builder().use_rustls_tls().tls_built_in_root_certs(false).build().unwrap();
    assert!(stranger.get(format!("{base}/healthz")).send().await.is_err());

    // SIGTERM drains and exits 0.
    let pid = webhook.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = webhook.0.try_wait().unwrap() {
            break s;
        }
        assert!(tokio::time::Instant::now() < deadline, "webhook did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
}

/// A rotated pair is served after `reload`; a broken rotation is an error and the
/// old pair stays.
#[test]
fn certificate_rotation_is_picked_up_and_a_broken_one_ignored() {
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let files = lockmesh_sidecar::server::CertFiles::load(&cert, &key).unwrap();
    let first = files.leaf().unwrap();
    assert!(!files.reload().unwrap(), "nothing changed");
    let touch = |p: &std::path::Path, secs: u64| {
        let t = std::time::SystemTime::now() + Duration::from_secs(secs);
        std::fs::File::options().write(true).open(p).unwrap().set_modified(t).unwrap();
    };
    pki(dir.path());
    touch(&cert, 10);
    assert!(files.reload().unwrap());
    let second = files.leaf().unwrap();
    assert_ne!(first, second);
    std::fs::write(&key, "not a key").unwrap();
    touch(&key, 20);
    assert!(files.reload().is_err());
    assert_eq!(files.leaf().unwrap(), second, "the old pair is kept");
}
