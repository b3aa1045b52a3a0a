//! Certificate rotation in a real lock-tier Envoy (issue #16 item 3): the shipped
//! `lock-tier.yaml` loads its listener certificate and its client certificate to
//! the arbiter through SDS from files it watches (`envoy-config/sds/`). The harness
//! lays the files out as the kubelet lays out a mounted Secret and rotates them by
//! switching `..data` in one rename ([`EnvoyProcess::rotate_certs`]). A new
//! handshake then sees the new serial, the admin `/certs` lists the new client
//! certificate, the arbiter admits it on a fresh connection, and requests are
//! answered throughout. Planted: the same config with the certificates inline
//! (`tls_certificates` with filenames, as the configs were before SDS) keeps the
//! old serials, so the check fails on it.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockmesh_tests::envoy::reissued_pki;
use lockmesh_tests::paths::temp_dir;
use lockmesh_tests::{EnvoyProcess, Stack};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

/// The listener's certificate as SDS delivers it in the shipped lock tier.
const LISTENER_SDS: &str = "                tls_certificate_sds_secret_configs:
                  - name: server_cert
                    sds_config:
                      resource_api_version: V3
                      path_config_source: { path: envoy-config/sds/server-cert.yaml, watched_directory: { path: envoy-config/sds } }
";
/// The planted listener certificate: files named inline, read once at start.
const LISTENER_INLINE: &str = "                tls_certificates:
                  - certificate_chain: { filename: run/certs/envoy.pem }
                    private_key: { filename: run/certs/envoy-key.pem }
";
/// The arbiter cluster's client certificate as SDS delivers it.
const CLUSTER_SDS: &str = "            tls_certificate_sds_secret_configs:
              - name: arbiter_client_cert
                sds_config:
                  resource_api_version: V3
                  path_config_source: { path: envoy-config/sds/arbiter-client-cert.yaml, watched_directory: { path: envoy-config/sds } }
";
/// The planted client certificate, inline.
const CLUSTER_INLINE: &str = "            tls_certificates:
              - certificate_chain: { filename: run/certs/envoy-client.pem }
                private_key: { filename: run/certs/envoy-client-key.pem }
";

/// The serial of a PEM certificate file, as normalised hex (`openssl x509`).
async fn file_serial(pem: &Path) -> String {
    let out = tokio::process::Command::new("openssl")
        .args(["x509", "-noout", "-serial", "-in"])
        .arg(pem)
        .output()
        .await
        .expect("openssl (Debian package openssl) runs");
    assert!(out.status.success(), "openssl x509 {}: {}", pem.display(), String::from_utf8_lossy(&out.stderr));
    normalise(String::from_utf8_lossy(&out.stdout).trim().trim_start_matches("serial="))
}

/// The serial of the certificate Envoy's listener presents on a new handshake
/// (`openssl s_client`, presenting `client` so the mTLS handshake completes).
async fn handshake_serial(port: u16, client: &lockmesh_tests::ClientCert, ca: &Path) -> Result<String, String> {
    let script = format!(
        "openssl s_client -connect 127.0.0.1:{port} -servername localhost -CAfile '{}' -cert '{}' -key '{}' \
         </dev/null 2>/dev/null | openssl x509 -noout -serial",
        ca.display(),
        client.cert_path.display(),
        client.key_path.display()
    );
    let out = tokio::process::Command::new("sh").arg("-c").arg(script).output().await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let serial =
        text.trim().strip_prefix("serial=").ok_or_else(|| format!("no certificate from the handshake: {text}"))?;
    Ok(normalise(serial))
}

/// Lowercase hex without leading zeros (openssl and Envoy's `/certs` differ there).
pub(super) fn normalise(hex: &str) -> String {
    let s = hex.trim().to_ascii_lowercase();
    let s = s.trim_start_matches('0');
    if s.is_empty() {
        "0".into()
    } else {
        s.into()
    }
}

/// Rotates `envoy` to the freshly issued leaves in `new_dir` and waits up to
/// `within` for both rotations to show: a new handshake on the listener presents
/// the new server serial, and `/certs` lists the new client certificate and no
/// longer the old one. `Err` says which did not change.
async fn rotation_seen(envoy: &EnvoyProcess, st: &Stack, new_dir: &Path, within: Duration) -> Result<(), String> {
    let pki = st.pki();
    let caller = pki.client("payments", "worker").unwrap();
    let (old_server, new_server) =
        (file_serial(&pki.envoy_server().cert_path).await, file_serial(&new_dir.join("envoy.pem")).await);
    let (old_client, new_client) =
        (file_serial(&pki.envoy_client().cert_path).await, file_serial(&new_dir.join("envoy-client.pem")).await);
    assert_ne!(old_server, new_server, "a reissued certificate has a new serial");
    assert_ne!(old_client, new_client);
    assert_eq!(handshake_serial(envoy.listener_port(), &caller, &pki.ca_cert_path()).await?, old_server);
    let serials: Vec<String> = envoy.cert_serials().await.unwrap().iter().map(|s| normalise(s)).collect();
    assert!(serials.contains(&old_client), "/certs lists the client certificate in use: {serials:?}");

    envoy.rotate_certs(new_dir).unwrap();
    let end = tokio::time::Instant::now() + within;
    loop {
        let seen = handshake_serial(envoy.listener_port(), &caller, &pki.ca_cert_path()).await?;
        let serials: Vec<String> = envoy.cert_serials().await.unwrap().iter().map(|s| normalise(s)).collect();
        let client_rotated = serials.contains(&new_client) && !serials.contains(&old_client);
        if seen == new_server && client_rotated {
            return Ok(());
        }
        if tokio::time::Instant::now() >= end {
            return Err(format!(
                "after {within:?}: listener presents {seen} (new {new_server}, old {old_server}); \
                 client certificate rotated: {client_rotated} (/certs {serials:?})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One acquire and its release for `key`; `Err` with what came back otherwise.
async fn lock_round(c: &lockmesh_tests::LockClient, key: &str) -> Result<(), String> {
    let r = c.post(ACQ, &[("x-lock-key", key)]).await.map_err(|e| format!("{e:#}"))?;
    if r.status != 200 {
        return Err(format!("acquire {}: {}", r.status, r.body));
    }
    let token = r.json["token"].as_str().unwrap_or_default().to_owned();
    let session = r.json["session"].as_str().unwrap_or_default().to_owned();
    let rel = c
        .post(REL, &[("x-lock-key", key), ("x-lock-token", &token), ("x-lock-session", &session)])
        .await
        .map_err(|e| format!("{e:#}"))?;
    if rel.status != 200 {
        return Err(format!("release {}: {}", rel.status, rel.body));
    }
    Ok(())
}

/// The shipped lock tier rotates its listener and arbiter-client certificates on
/// an atomic directory swap, with no restart and no request refused.
#[tokio::test]
async fn the_lock_tier_rotates_its_certificates_on_a_directory_swap() {
    let st = Stack::builder("envoy-sds").envoy_config("lock-tier").start().await.unwrap();
    let client = st.client("payments", "worker").unwrap();
    lock_round(&client, "payments/sds-0").await.unwrap();

    // Requests keep flowing on their open connection through the rotation.
    let (done, failures, rounds) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let traffic = {
        let (c, done, failures, rounds) = (client.clone(), done.clone(), failures.clone(), rounds.clone());
        tokio::spawn(async move {
            let mut errors = Vec::new();
            while done.load(Ordering::SeqCst) == 0 {
                if let Err(e) = lock_round(&c, "payments/sds-traffic").await {
                    failures.fetch_add(1, Ordering::SeqCst);
                    errors.push(e);
                }
                rounds.fetch_add(1, Ordering::SeqCst);
            }
            errors
        })
    };

    let new_dir = temp_dir("envoy-sds-new-").unwrap();
    let new = reissued_pki(st.pki(), new_dir.path()).unwrap();
    rotation_seen(st.envoy(), &st, new.dir(), Duration::from_secs(15)).await.unwrap();

    // Every round on the open connection during the rotation was answered.
    done.store(1, Ordering::SeqCst);
    let errors = traffic.await.unwrap();
    let n = rounds.load(Ordering::SeqCst);
    assert!(n > 0, "traffic ran during the rotation");
    assert!(
        errors.is_empty(),
        "{} of {n} rounds refused during the rotation: {errors:?}",
        failures.load(Ordering::SeqCst)
    );

    // A new connection (a new client) handshakes with the new certificate, which
    // chains to the same CA: answered.
    let fresh = st.client("payments", "worker").unwrap();
    lock_round(&fresh, "payments/sds-1").await.unwrap();
    // A fresh upstream connection: Envoy presents the new client certificate and
    // the arbiter (same CA, same SPIFFE ID) admits it.
    st.arbiter(0).restart().await.unwrap();
    lockmesh_tests::eventually(Duration::from_secs(15), async || {
        lock_round(&fresh, "payments/sds-2").await.map_err(anyhow::Error::msg)
    })
    .await;
}

/// Planted: the lock tier with its certificates inline (no SDS) keeps serving the
/// old serials after the same swap, so [`rotation_seen`] fails on it.
#[tokio::test]
async fn planted_inline_certificates_keep_the_old_serials() {
    let st = Stack::builder("envoy-sds-planted")
        .envoy_config("lock-tier")
        .envoy_replace(LISTENER_SDS, LISTENER_INLINE)
        .envoy_replace(CLUSTER_SDS, CLUSTER_INLINE)
        .start()
        .await
        .unwrap();
    let client = st.client("payments", "worker").unwrap();
    lock_round(&client, "payments/sds-planted").await.unwrap();
    let new_dir = temp_dir("envoy-sds-new-").unwrap();
    let new = reissued_pki(st.pki(), new_dir.path()).unwrap();
    let verdict = rotation_seen(st.envoy(), &st, new.dir(), Duration::from_secs(5)).await;
    let err = verdict
        .expect_err("inline certificate files must not rotate: the check would pass a config that never reloads");
    assert!(err.contains("old"), "{err}");
}
