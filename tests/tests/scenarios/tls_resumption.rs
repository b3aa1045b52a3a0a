//! Scenarios: tls_resumption (issue 41 row 8), against real etcd, an arbiter and
//! the shipped lock-tier Envoy.
//!
//! A resumed TLS session skips the client certificate's verification: a workload
//! whose SVID has expired could go on locking on a session ticket (TLS 1.3 and
//! 1.2) or a cached session id (TLS 1.2). A client (Python's `ssl`, OpenSSL)
//! with a short-lived SVID acquires a lock over TLS 1.3 and over TLS 1.2 and keeps
//! each session; once the SVID has expired a fresh handshake is refused, and so is
//! every resumption: the shipped listener resumes nothing (`session_reused` false,
//! handshake refused, no lock). Planted controls on the same stack: the lock tier
//! with resumption on (as shipped before) resumes both sessions after expiry and
//! grants the locks; with only the stateful kind on, the TLS 1.2 session id still
//! resumes and locks (why both flags are needed).

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockmesh_tests::{DevPki, EnvoyProcess, Stack, TEST_TRUST_DOMAIN};
use serde_json::Value;

/// How long the short-lived SVID is valid: enough for the first acquires.
const SVID_TTL: Duration = Duration::from_secs(4);

/// The client: for each TLS version, a full handshake that acquires a key and
/// keeps the session; after the SVID's expiry (argv[6], Unix seconds) a fresh
/// handshake and a resumption of the kept session, each acquiring another key.
/// Prints one JSON object: {"1.3": {"first", "fresh", "resumed"}, "1.2": {...}},
/// each attempt {"reused", "status"} or {"error"}.
const CLIENT: &str = r#"
import json, socket, ssl, sys, time
port, ca, cert, key, prefix, expiry = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], float(sys.argv[6])
def context(version):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    ctx.load_cert_chain(cert, key)
    ctx.minimum_version = ctx.maximum_version = version
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
def acquire(ctx, key_name, session=None):
    try:
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        tls = ctx.wrap_socket(raw, server_hostname="localhost", session=session)
        reused = tls.session_reused
        tls.sendall(("POST /v1/locks/acquire HTTP/1.1\r\nhost: localhost\r\nx-lock-key: %s\r\n"
                     "content-length: 0\r\nconnection: close\r\n\r\n" % key_name).encode())
        data = b""
        while True:
            chunk = tls.recv(65536)
            if not chunk:
                break
            data += chunk
        out = {"reused": reused, "status": data.split(b"\r\n", 1)[0].decode(errors="replace")}
        kept = tls.session
        tls.close()
        return out, kept
    except (OSError, ssl.SSLError) as e:
        return {"error": repr(e)}, None
versions = {"1.3": ssl.TLSVersion.TLSv1_3, "1.2": ssl.TLSVersion.TLSv1_2}
ctxs = {v: context(t) for v, t in versions.items()}
result, sessions = {}, {}
for v, ctx in ctxs.items():
    first, sessions[v] = acquire(ctx, "%s-%s-first" % (prefix, v))
    result[v] = {"first": first}
time.sleep(max(0.0, expiry + 1.5 - time.time()))
for v, ctx in ctxs.items():
    result[v]["fresh"], _ = acquire(ctx, "%s-%s-fresh" % (prefix, v))
    result[v]["resumed"], _ = acquire(ctx, "%s-%s-resumed" % (prefix, v), sessions[v])
print(json.dumps(result))
"#;

/// A client certificate for payments/worker from the stack's CA, valid from a
/// minute ago until [`SVID_TTL`] from now, and its expiry (Unix seconds).
fn short_svid(pki: &DevPki, dir: &Path) -> (lockmesh_tests::ClientCert, u64) {
    for f in ["ca.pem", "ca-key.pem", "rogue-ca.pem", "rogue-ca-key.pem", "trust-domain"] {
        std::fs::copy(pki.dir().join(f), dir.join(f)).unwrap();
    }
    let start = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let short = DevPki::generate_with_ttl(dir, TEST_TRUST_DOMAIN, SVID_TTL).unwrap();
    let cert = short.client("payments", "worker").unwrap();
    (cert, (start + SVID_TTL).as_secs() + 1)
}

/// Runs [`CLIENT`] against the Envoy on `port`.
async fn run_client(pki: &DevPki, port: u16, cert: &lockmesh_tests::ClientCert, expiry: u64, prefix: &str) -> Value {
    let out = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(CLIENT)
        .arg(port.to_string())
        .arg(pki.ca_cert_path())
        .arg(&cert.cert_path)
        .arg(&cert.key_path)
        .arg(prefix)
        .arg(expiry.to_string())
        .kill_on_drop(true)
        .output()
        .await
        .expect("python3 runs");
    assert!(out.status.success(), "client: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// Whether an attempt acquired its key (a 200 over its connection).
fn granted(attempt: &Value) -> bool {
    attempt["status"].as_str().is_some_and(|s| s.starts_with("HTTP/1.1 200"))
}

fn reused(attempt: &Value) -> bool {
    attempt["reused"].as_bool() == Some(true)
}

/// The lock tier's config as the harness would load it (the frozen copy under
/// `LOCKMESH_BIN_DIR` if there is one), without the lines that contain any of
/// `drop`, written into `dir`: a planted listener.
fn planted_lock_tier(dir: &Path, name: &str, drop: &[&str]) -> std::path::PathBuf {
    let frozen = lockmesh_tests::paths::frozen_bin_dir().map(|d| d.join("envoy-config/lock-tier.yaml"));
    let path = frozen
        .filter(|p| p.is_file())
        .unwrap_or_else(|| lockmesh_tests::repo_root().join("envoy-config/lock-tier.yaml"));
    let text = std::fs::read_to_string(path).unwrap();
    let kept: String = text.lines().filter(|l| !drop.iter().any(|d| l.contains(d))).map(|l| format!("{l}\n")).collect();
    let out = dir.join(format!("{name}.yaml"));
    std::fs::write(&out, kept).unwrap();
    out
}

const STATELESS: &str = "disable_stateless_session_resumption:";
const STATEFUL: &str = "disable_stateful_session_resumption:";

#[tokio::test]
async fn an_expired_svid_cannot_resume_a_session_to_take_a_lock() {
    let st = Stack::builder("tls-resumption").start().await.unwrap();
    let configs = lockmesh_tests::paths::temp_dir("planted-tiers-").unwrap();
    let resumable = planted_lock_tier(configs.path(), "resumable", &[STATELESS, STATEFUL]);
    let stateful = planted_lock_tier(configs.path(), "stateful", &[STATEFUL]);
    let envoy = |config: &str| {
        EnvoyProcess::builder(config).cert_dir(st.pki().dir()).arbiter_port(st.arbiter(0).grpc_port()).start()
    };
    let (shipped, resumable, stateful) =
        tokio::try_join!(envoy("lock-tier"), envoy(resumable.to_str().unwrap()), envoy(stateful.to_str().unwrap()))
            .unwrap();
    let dir = lockmesh_tests::paths::temp_dir("short-svid-").unwrap();
    let (cert, expiry) = short_svid(st.pki(), dir.path());
    let pki = st.pki();
    let (shipped, resumable, stateful) = tokio::join!(
        run_client(pki, shipped.listener_port(), &cert, expiry, "payments/resume-shipped"),
        run_client(pki, resumable.listener_port(), &cert, expiry, "payments/resume-planted"),
        run_client(pki, stateful.listener_port(), &cert, expiry, "payments/resume-stateful"),
    );
    for (name, r) in [("shipped", &shipped), ("resumable", &resumable), ("stateful", &stateful)] {
        for v in ["1.3", "1.2"] {
            // While the SVID is valid every listener grants; after it, a full
            // handshake is refused everywhere.
            assert!(granted(&r[v]["first"]), "{name} TLS {v}: {r}");
            assert!(!granted(&r[v]["fresh"]), "{name} TLS {v}: an expired SVID made a full handshake: {r}");
        }
    }
    for v in ["1.3", "1.2"] {
        let resumed = &shipped[v]["resumed"];
        assert!(!reused(resumed), "TLS {v}: the shipped lock tier resumed a session: {shipped}");
        assert!(!granted(resumed), "TLS {v}: an expired SVID took a lock on the shipped lock tier: {shipped}");
        // The planted control: resumption on, the expired SVID resumes and locks.
        let resumed = &resumable[v]["resumed"];
        assert!(reused(resumed) && granted(resumed), "TLS {v}: the planted listener did not resume: {resumable}");
    }
    // Only tickets off: TLS 1.2's session id still resumes (TLS 1.3 resumes only
    // by ticket in BoringSSL).
    let resumed = &stateful["1.2"]["resumed"];
    assert!(reused(resumed) && granted(resumed), "the stateful cache did not resume TLS 1.2: {stateful}");
    assert!(!reused(&stateful["1.3"]["resumed"]), "{stateful}");
}
