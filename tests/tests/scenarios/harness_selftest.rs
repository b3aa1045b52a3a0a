//! Self-tests of the harness itself: real etcd processes, the PKI, the backend.
//! (Envoy and the arbiter are exercised by the scenarios that need them.)

use std::time::Duration;

use lockmesh_tests::{assert_eventually, eventually, shared_etcd, Backend, DevPki, EtcdCluster, LockClient};
use x509_parser::extensions::GeneralName;
use x509_parser::pem::parse_x509_pem;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_etcd_single_member_is_healthy_and_serves_keys() {
    let etcd = EtcdCluster::builder().members(1).start().await.unwrap();
    let m = etcd.member(0);
    assert!(m.is_healthy().await);
    assert_eq!(etcd.endpoints(), vec![m.client_url()]);
    assert!(m.data_dir().join("member").is_dir());

    let mut client = etcd.client().await.unwrap();
    client.put("/t/selftest/k", "v", None).await.unwrap();
    let got = client.get("/t/selftest/k", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"v");

    // Pause: health probes time out or fail; resume: healthy again.
    m.pause().unwrap();
    assert!(!m.is_healthy().await);
    m.resume().unwrap();
    assert_eventually!(10, async || {
        anyhow::ensure!(m.is_healthy().await, "not healthy after SIGCONT");
        Ok(())
    });

    // Crash and restart on the same ports and data: the key survives.
    m.kill();
    assert!(m.pid().is_none());
    m.restart().await.unwrap();
    let mut client = etcd.client().await.unwrap();
    let got = client.get("/t/selftest/k", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"v");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_etcd_three_members_survive_one_kill() {
    let etcd = EtcdCluster::builder().members(3).token("selftest-3").start().await.unwrap();
    assert_eq!(etcd.endpoints().len(), 3);
    assert_eq!(etcd.token(), "selftest-3");
    for m in etcd.members() {
        assert!(m.is_healthy().await, "{} unhealthy", m.name());
    }
    etcd.member(0).kill();
    // The other two keep (or re-elect) a leader and stay healthy.
    assert_eventually!(15, async || {
        for m in &etcd.members()[1..] {
            anyhow::ensure!(m.is_healthy().await, "{} unhealthy", m.name());
        }
        Ok(())
    });
    assert!(!etcd.member(0).is_healthy().await);
    let mut client = etcd.client_on(&etcd.endpoints()[1..]).await.unwrap();
    client.put("/t/selftest3/k", "v", None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_etcd_snapshot_restore_with_bumped_revision() {
    let etcd = EtcdCluster::builder().start().await.unwrap();
    let mut client = etcd.client().await.unwrap();
    let put = client.put("/t/restore/k", "before", None).await.unwrap();
    let rev_before = put.header().unwrap().revision();
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("snap.db");
    etcd.snapshot_save(&snap).await.unwrap();
    client.put("/t/restore/k", "after", None).await.unwrap();

    etcd.restore_from(&snap, Some(1_000)).await.unwrap();
    let mut client = etcd.client().await.unwrap();
    let got = client.get("/t/restore/k", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"before");
    assert!(got.header().unwrap().revision() >= rev_before + 1_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_shared_etcd_is_one_instance() {
    let a = shared_etcd().await;
    let b = shared_etcd().await;
    assert!(std::ptr::eq(a, b));
    assert!(a.member(0).is_healthy().await);
}

#[test]
fn harness_pki_workload_cert_has_exactly_the_spiffe_uri_san() {
    let dir = tempfile::tempdir().unwrap();
    let pki = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
    let worker = pki.client("payments", "worker").unwrap();
    assert_eq!(worker.spiffe_id, "spiffe://lockmesh.test/ns/payments/sa/worker");

    let pem = std::fs::read(&worker.cert_path).unwrap();
    let (_, pem) = parse_x509_pem(&pem).unwrap();
    let cert = pem.parse_x509().unwrap();
    let sans = &cert.subject_alternative_name().unwrap().unwrap().value.general_names;
    assert_eq!(sans, &vec![GeneralName::URI("spiffe://lockmesh.test/ns/payments/sa/worker")]);
    let cn: Vec<_> = cert.subject().iter_common_name().map(|c| c.as_str().unwrap()).collect();
    assert_eq!(cn, ["worker"]);
    let eku = cert.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth);

    // Signed by the CA, not by the rogue CA.
    let ca_pem = std::fs::read(pki.ca_cert_path()).unwrap();
    let (_, ca_pem) = parse_x509_pem(&ca_pem).unwrap();
    let ca = ca_pem.parse_x509().unwrap();
    assert_eq!(cert.issuer(), ca.subject());
    cert.verify_signature(Some(ca.public_key())).unwrap();
    let rogue_pem = std::fs::read(pki.rogue().cert_path).unwrap();
    let (_, rogue_pem) = parse_x509_pem(&rogue_pem).unwrap();
    let rogue = rogue_pem.parse_x509().unwrap();
    assert!(rogue.verify_signature(Some(ca.public_key())).is_err());

    // Envoy's client identity and the server SANs.
    let envoy_client = pki.envoy_client();
    assert_eq!(envoy_client.spiffe_id, "spiffe://lockmesh.test/lockmesh/envoy");
    let server_pem = std::fs::read(pki.envoy_server().cert_path).unwrap();
    let (_, server_pem) = parse_x509_pem(&server_pem).unwrap();
    let server = server_pem.parse_x509().unwrap();
    let sans = &server.subject_alternative_name().unwrap().unwrap().value.general_names;
    assert_eq!(sans.len(), 2);
    assert!(sans.contains(&GeneralName::DNSName("localhost")));
    assert!(sans.contains(&GeneralName::IPAddress(&[127, 0, 0, 1])));
}

#[tokio::test]
async fn harness_backend_records_requests_and_delays() {
    let backend = Backend::start().await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{}/jobs/run?x=1", backend.port());
    let started = tokio::time::Instant::now();
    let resp = http
        .post(&url)
        .header("x-selftest", "job-1")
        .header("x-test-delay-ms", "200")
        .body("payload")
        .send()
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "ok");
    let reqs = backend.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].method, "POST");
    assert_eq!(reqs[0].path, "/jobs/run?x=1");
    assert_eq!(reqs[0].header("X-Selftest"), Some("job-1"));
    assert_eq!(&reqs[0].body[..], b"payload");
    let n = eventually(Duration::from_secs(1), async || Ok(backend.requests().len())).await;
    assert_eq!(n, 1);
}

#[test]
fn harness_lock_client_accepts_the_pki() {
    let dir = tempfile::tempdir().unwrap();
    let pki = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
    let c = pki.client("billing", "job").unwrap();
    let client = LockClient::new(1, &pki.ca_cert_path(), Some((&c.cert_path, &c.key_path))).unwrap();
    assert_eq!(client.base_url(), "https://localhost:1");
    LockClient::new(1, &pki.ca_cert_path(), None).unwrap();
}

/// The harness's own Envoy fixture (not a shipped config): mTLS in, backend out.
fn envoy_fixture() -> String {
    lockmesh_tests::repo_root().join("tests/fixtures/envoy-selftest.yaml").display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_envoy_fixture_validates_and_a_bad_edit_does_not() {
    let ok = lockmesh_tests::EnvoyProcess::validate(envoy_fixture()).await.unwrap();
    assert!(ok.is_ok(), "{ok:?}");
    let bad = lockmesh_tests::EnvoyProcess::builder(&envoy_fixture())
        .replace("SANITIZE_SET", "NO_SUCH_MODE")
        .validate()
        .await
        .unwrap();
    assert!(bad.is_err(), "envoy accepted an invalid enum: {bad:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_stack_envoy_mtls_identities_reach_the_backend() {
    let stack = lockmesh_tests::Stack::builder("harness-envoy")
        .envoy_config(envoy_fixture())
        .arbiters(0)
        .start()
        .await
        .unwrap();
    // Its own key root under /t/ (on the shared etcd, one whose users were made
    // when it started: `EtcdCluster::users_for_new_root`).
    assert!(stack.root().starts_with("/t/") && stack.root().len() > "/t/".len(), "{}", stack.root());

    let worker = stack.client("payments", "worker").unwrap();
    let resp = worker.post("/jobs/run", &[("x-selftest", "job-1")]).await.unwrap();
    assert_eq!(resp.status, 200, "{resp:?}");
    assert_eq!(resp.body, "ok");
    assert_eq!(resp.version, reqwest::Version::HTTP_2);
    let reqs = stack.backend().requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].header("x-selftest"), Some("job-1"));
    // Envoy always adds the cert hash; the URI field is the one identity.
    let xfcc = reqs[0].header("x-forwarded-client-cert").unwrap_or_default();
    assert!(xfcc.ends_with(";URI=spiffe://lockmesh.test/ns/payments/sa/worker"), "{xfcc}");

    // No client certificate, or one from the rogue CA: no request gets through.
    let anonymous = stack.anonymous_client().unwrap().get("/", &[]).await;
    assert!(anonymous.is_err(), "{anonymous:?}");
    let rogue = stack.rogue_client("payments", "worker").unwrap().get("/", &[]).await;
    assert!(rogue.is_err(), "{rogue:?}");
    assert_eq!(stack.backend().requests().len(), 1);

    let envoy = stack.envoy();
    assert_eventually!(5, async || {
        let n = envoy.stat("http.selftest.downstream_rq_2xx").await?;
        anyhow::ensure!(n == Some(1), "downstream_rq_2xx = {n:?}");
        Ok(())
    });
    assert!(envoy.stat("no.such.stat").await.unwrap().is_none());
}

/// Past the shared etcd's pool of users, a stack gets the users of a root whose
/// stacks have all ended, with that root's keys deleted; a root still used by a
/// stack, or taken without one, is never handed out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_a_returned_key_root_comes_back_empty_with_working_users() {
    let etcd = EtcdCluster::builder().members(1).secure().start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    for d in ["a", "b", "c", "d"] {
        std::fs::create_dir(dir.path().join(d)).unwrap();
    }
    let (root, users) = etcd.users_for_new_root("recycle", &dir.path().join("a")).await.unwrap();
    etcd.lend_root(&root);
    let mut arbiter = users.client("lockmesh-arbiter").await.unwrap();
    arbiter.put(format!("{root}/sys/epoch"), "7", None).await.unwrap();

    // Shared by a second stack: the first ending does not give it back.
    etcd.share_root(&root);
    etcd.return_root(&root);
    let (other, _) = etcd.users_for_new_root("recycle", &dir.path().join("b")).await.unwrap();
    assert_ne!(other, root, "a root still in use was handed out");

    // The last stack ends: the next stack gets it, empty, and its users work.
    etcd.return_root(&root);
    let (again, users) = etcd.users_for_new_root("recycle", &dir.path().join("c")).await.unwrap();
    assert_eq!(again, root);
    let mut c = etcd.client().await.unwrap();
    let left = c.get(format!("{root}/"), Some(etcd_client::GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(left.count(), 0, "the returned root kept its keys");
    let mut arbiter = users.client("lockmesh-arbiter").await.unwrap();
    arbiter.put(format!("{root}/sys/epoch"), "1", None).await.unwrap();

    // A root taken without a stack (`other`, never lent) is never handed out again.
    etcd.return_root(&other);
    let (fresh, _) = etcd.users_for_new_root("recycle", &dir.path().join("d")).await.unwrap();
    assert!(fresh != other && fresh != root, "{fresh}");
}
