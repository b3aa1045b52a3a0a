//! Issue #16 item 3: certificates rotate under a running component, and the CA
//! rolls, by the atomic directory swap the SPIFFE helper and Kubernetes secret
//! volumes make (`..data` a link to a timestamped directory, each file a link
//! through `..data`, a swap one `rename(2)` of a new `..data` link).
//!
//! The roll, in five sets of files, each of which works with the one before it
//! (so a component that has not polled yet still talks to one that has):
//!
//! 0. the first leaves, signed by CA A; the bundle is A;
//! 1. every leaf reissued (new keys), still A;
//! 2. the bundle A+B everywhere, the leaves of step 1;
//! 3. every leaf reissued by CA B, the bundle still A+B;
//! 4. the bundle B: the old CA removed.
//!
//! Covered here: the audit tailer's mTLS query port (`query.tls`, re-read every
//! `reload_ms`). Queries run all along, on one kept-open connection and on a fresh
//! connection per round made from the files of the moment (as `lockctl audit`
//! makes one per call): none is refused or dropped; after each swap a fresh
//! handshake sees the new server certificate; after the roll a client still
//! presenting an expired certificate, or one of the old CA only, is refused in the
//! handshake. The planted counterpart is a tailer with `reload_ms: 0`: the same
//! handshake check after the roll fails against it (it still serves the first
//! certificate, which a B-only client does not trust).
//!
//! The same roll across the whole stack (both Envoys, the arbiter, SDK holds,
//! waiters and transparent requests) is [`crate::rotation_stack`]; `issue` and
//! `expired` below make its sets too.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use lockmesh_tests::kubelet::{read_plain_files, Files, SecretDir};
use lockmesh_tests::{certs::TEST_TRUST_DOMAIN, DevPki, Stack};

use crate::audit::Tailer;

/// The operators' tool's identity, which the tailer's query port admits.
const OPERATOR: (&str, &str) = ("lockmesh-system", "lockctl");

/// A full set of leaves (the stack's and `clients`'), new keys: signed by the CA
/// of `ca` (a set holding `ca.pem` and `ca-key.pem`), or by a new CA without it.
pub(super) fn issue(ca: Option<&Files>, clients: &[(&str, &str)]) -> Files {
    let t = tempfile::tempdir().unwrap();
    if let Some(ca) = ca {
        for f in ["ca.pem", "ca-key.pem", "rogue-ca.pem", "rogue-ca-key.pem", "trust-domain"] {
            std::fs::write(t.path().join(f), &ca[f]).unwrap();
        }
    }
    let pki = DevPki::generate(t.path(), TEST_TRUST_DOMAIN).unwrap();
    for (ns, sa) in clients {
        pki.client(ns, sa).unwrap();
    }
    read_plain_files(pki.dir()).unwrap()
}

/// The DER of the first certificate in `pem`.
fn der(pem: &[u8]) -> Vec<u8> {
    x509_parser::pem::parse_x509_pem(pem).unwrap().1.contents
}

/// A client certificate for `spiffe_id` signed by the CA of `ca` and expired since 2021.
pub(super) fn expired(ca: &Files, spiffe_id: &str) -> (Vec<u8>, Vec<u8>) {
    use rcgen::{date_time_ymd, CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose, SanType};
    let ca_key = KeyPair::from_pem(std::str::from_utf8(&ca["ca-key.pem"]).unwrap()).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(std::str::from_utf8(&ca["ca.pem"]).unwrap(), ca_key).unwrap();
    let mut p = CertificateParams::default();
    p.not_before = date_time_ymd(2020, 1, 1);
    p.not_after = date_time_ymd(2021, 1, 1);
    p.use_authority_key_identifier_extension = true;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    p.distinguished_name.push(DnType::CommonName, "lockctl");
    p.subject_alt_names = vec![SanType::URI(spiffe_id.try_into().unwrap())];
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &issuer).unwrap();
    (cert.pem().into_bytes(), key.serialize_pem().into_bytes())
}

/// An HTTPS client of the query port on `port` trusting `ca` (every certificate
/// in it) and presenting `identity` (certificate PEM, key PEM).
fn query_client(port: u16, ca: &[u8], identity: (&[u8], &[u8])) -> reqwest::Client {
    let mut pem = identity.0.to_vec();
    pem.push(b'\n');
    pem.extend_from_slice(identity.1);
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca).unwrap())
        .identity(reqwest::Identity::from_pem(&pem).unwrap())
        .resolve("localhost", SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
        .tls_info(true)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// One `recent` query: the status and the server certificate (DER) of the
/// connection it went on.
async fn query(c: &reqwest::Client, port: u16) -> anyhow::Result<(u16, Vec<u8>)> {
    let r = c
        .post(format!("https://localhost:{port}/v1/audit/query"))
        .json(&serde_json::json!({"query": "recent", "limit": 1}))
        .send()
        .await?;
    let leaf = r.extensions().get::<reqwest::tls::TlsInfo>().and_then(|t| t.peer_certificate()).map(<[u8]>::to_vec);
    Ok((r.status().as_u16(), leaf.unwrap_or_default()))
}

/// A query on a fresh connection made from the operator's files in `files`.
async fn fresh_query(port: u16, files: &Files) -> anyhow::Result<(u16, Vec<u8>)> {
    let (ns, sa) = OPERATOR;
    let (cert, key) = (&files[&format!("{ns}_{sa}.pem")], &files[&format!("{ns}_{sa}-key.pem")]);
    query(&query_client(port, &files["ca.pem"], (cert, key)), port).await
}

/// What the background queries saw.
#[derive(Default)]
struct Traffic {
    answered: AtomicU64,
    refused: AtomicU64,
    fresh_handshakes: AtomicU64,
}

/// A tailer over a kubelet-style copy of the stack's certificates, re-reading its
/// query port's files every `reload_ms` (0: never).
async fn tailer(st: &Stack, reload_ms: u64) -> (Tailer, SecretDir) {
    st.pki().client(OPERATOR.0, OPERATOR.1).unwrap();
    let dir = SecretDir::adopt(st.pki().dir()).unwrap();
    let t = Tailer::start(st, "").await;
    let path = t.dir.path().join("audit.yaml");
    let cfg = std::fs::read_to_string(&path).unwrap();
    let ca = st.pki().ca_cert_path().display().to_string();
    let (from, to) = (format!("client_ca: {ca:?} }}"), format!("client_ca: {ca:?}, reload_ms: {reload_ms} }}"));
    assert!(cfg.contains(&from), "{cfg}");
    std::fs::write(&path, cfg.replace(&from, &to)).unwrap();
    t.crash_and_restart().await;
    (t, dir)
}

/// Runs the roll (steps 1 to 4) under query traffic; after each swap waits until
/// a fresh handshake sees the set's server certificate. Returns the sets of steps
/// 0, 1 and 4 and the traffic counters; `Err` names the step whose certificate
/// never showed.
async fn roll(t: &Tailer, dir: &SecretDir) -> (Vec<Files>, Arc<Traffic>, Result<(), String>) {
    let port = t.query_port;
    let first = dir.current().unwrap();
    let traffic = Arc::new(Traffic::default());
    let stop = Arc::new(AtomicBool::new(false));
    // One kept-open connection, made from the first files.
    let held = {
        let (cert, key) = (&first["lockmesh-system_lockctl.pem"], &first["lockmesh-system_lockctl-key.pem"]);
        let (c, tr, stop) = (query_client(port, &first["ca.pem"], (cert, key)), traffic.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match query(&c, port).await {
                    Ok((200, _)) => tr.answered.fetch_add(1, Ordering::SeqCst),
                    _ => tr.refused.fetch_add(1, Ordering::SeqCst),
                };
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    // A fresh connection per round from the files of the moment.
    let fresh = {
        let (tr, stop, live) = (traffic.clone(), stop.clone(), dir.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let Ok(files) = live.current() else { continue };
                match fresh_query(port, &files).await {
                    Ok((200, _)) => tr.answered.fetch_add(1, Ordering::SeqCst),
                    _ => tr.refused.fetch_add(1, Ordering::SeqCst),
                };
                tr.fresh_handshakes.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;

    let clients = [OPERATOR];
    let rotated = issue(Some(&first), &clients);
    let new_ca = issue(None, &clients);
    let bundle = [first["ca.pem"].clone(), new_ca["ca.pem"].clone()].concat();
    let with_ca = |mut f: Files, ca: &[u8]| {
        f.insert("ca.pem".into(), ca.to_vec());
        f
    };
    // What shows that the port loaded a step beyond its server certificate: at
    // step 2 a client of CA B is let in, at step 4 a client of CA A no longer is.
    let op = |f: &Files| (f["lockmesh-system_lockctl.pem"].clone(), f["lockmesh-system_lockctl-key.pem"].clone());
    let (b_client, a_client) = (op(&new_ca), op(&rotated));
    let steps = [
        ("1 leaves reissued, CA A", rotated.clone(), None),
        ("2 bundle A+B", with_ca(rotated.clone(), &bundle), Some((bundle.clone(), b_client, true))),
        ("3 leaves of CA B, bundle A+B", with_ca(new_ca.clone(), &bundle), None),
        ("4 bundle B", new_ca.clone(), Some((new_ca["ca.pem"].clone(), a_client, false))),
    ];
    let mut result = Ok(());
    for (what, files, also) in &steps {
        dir.swap(files).unwrap();
        let want = der(&files["arbiter.pem"]);
        let seen = tokio::time::timeout(Duration::from_secs(15), async {
            loop {
                let leaf_ok =
                    matches!(fresh_query(port, &dir.current().unwrap()).await, Ok((200, leaf)) if leaf == want);
                let also_ok = match also {
                    None => true,
                    Some((ca, (cert, key), admitted)) => {
                        query(&query_client(port, ca, (cert, key)), port).await.is_ok_and(|(s, _)| s == 200)
                            == *admitted
                    }
                };
                if leaf_ok && also_ok {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        if seen.is_err() {
            result = Err(format!("step {what}: a fresh handshake never saw the new set"));
            break;
        }
        println!("rotation: step {what}: fresh handshakes see the new set");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let _ = tokio::join!(held, fresh);
    (vec![first, rotated, new_ca], traffic, result)
}

#[tokio::test]
async fn the_audit_query_port_follows_a_leaf_rotation_and_a_ca_roll_with_queries_in_flight() {
    let st = Stack::builder("rotation-audit").start().await.unwrap();
    let (t, dir) = tailer(&st, 200).await;
    let (sets, traffic, result) = roll(&t, &dir).await;
    result.unwrap();
    let (first, rotated, new_ca) = (&sets[0], &sets[1], &sets[2]);
    let answered = traffic.answered.load(Ordering::SeqCst);
    let refused = traffic.refused.load(Ordering::SeqCst);
    println!(
        "rotation: audit query port: {answered} queries answered, {} on fresh handshakes, refused: {refused}",
        traffic.fresh_handshakes.load(Ordering::SeqCst)
    );
    assert_eq!(refused, 0, "queries were refused or dropped during the roll");
    assert!(answered > 20, "too few queries ran: {answered}");

    // After the roll: the new CA's certificate on fresh handshakes ...
    let (status, leaf) = fresh_query(t.query_port, new_ca).await.unwrap();
    assert_eq!((status, &leaf), (200, &der(&new_ca["arbiter.pem"])), "the new CA's certificate is served");
    assert_ne!(leaf, der(&first["arbiter.pem"]));
    // ... an expired certificate of the new CA is refused in the handshake ...
    let id = st.pki().workload_spiffe_id(OPERATOR.0, OPERATOR.1);
    let (cert, key) = expired(new_ca, &id);
    let c = query_client(t.query_port, &new_ca["ca.pem"], (&cert, &key));
    assert!(query(&c, t.query_port).await.is_err(), "an expired client certificate was accepted");
    // ... and so is a valid certificate of the old CA only.
    let old = (&rotated["lockmesh-system_lockctl.pem"][..], &rotated["lockmesh-system_lockctl-key.pem"][..]);
    let c = query_client(t.query_port, &new_ca["ca.pem"], old);
    assert!(query(&c, t.query_port).await.is_err(), "a certificate of the removed CA was accepted");
    let log = t.log();
    assert!(log.contains("certificates reloaded"), "the tailer logged no reload");
}

/// The planted counterpart: a query port that does not re-read its files keeps
/// the first certificate, and the roll's handshake check fails against it.
#[tokio::test]
async fn a_query_port_that_does_not_reload_fails_the_roll() {
    let st = Stack::builder("rotation-audit-planted").start().await.unwrap();
    let (t, dir) = tailer(&st, 0).await;
    let (_, _, result) = roll(&t, &dir).await;
    let e = result.expect_err("the roll passed against a tailer that never reloads");
    assert!(e.contains("step 1"), "{e}");
}
