//! The etcd CA roll (issue #16 item 3; docs/OPERATIONS.md, "Rolling the CA"): etcd
//! 3.5 re-reads its own certificate at each handshake but never its trusted CA
//! files, so its CA roll is a rolling restart of the members, while lockmesh's
//! etcd clients follow their CA bundle file without a restart.
//!
//! A 3-member etcd in production's shape whose members read their TLS files from
//! directories in the kubelet's Secret layout ([`EtcdBuilder::secret_volumes`]),
//! an arbiter reaching it as deploy/base/arbiter/configmap.yaml does (`etcd.tls.ca`
//! only, a user and a password; its bundle a Secret directory of its own) and the
//! lock-tier Envoy. A hold is taken before the roll and kept alive through it;
//! two callers contend for another key in a loop (open a session, acquire with
//! `x-lock-wait-ms`, release, close), so waiters are in flight at every step.
//! The roll, the arbiter never restarted:
//!
//! 1. every bundle (each member's `ca.crt`, the arbiter's, the harness clients')
//!    becomes old + new; the members restart one at a time, each healthy before
//!    the next; the arbiter logs its bundle reloaded;
//! 2. each member's `tls.crt`/`tls.key` is reissued by the new CA in one `..data`
//!    swap, no restart: a fresh handshake to each member presents the new
//!    certificate (its serial) and verifies against the new CA alone;
//! 3. every bundle becomes the new CA alone; the members restart one at a time
//!    (so every arbiter connection is made again, verified by the reloaded
//!    bundle); the arbiter logs its second reload.
//!
//! Checked: no request refused or dropped for the certificates, the hold kept
//! (its token, then released by it), after step 3 a client trusting only the old
//! CA is refused by every member while the arbiter still serves a fresh lock round.
//!
//! A member restart refuses a few requests by itself, whatever the certificates
//! (seen: 0 to 9 per roll of 6 restarts, of about a thousand): etcd fails the
//! proposals in flight when its leader stops (`etcdserver: leader changed`), a
//! request dispatched on the arbiter's connection to the member that stops is
//! cancelled before it is sent (`hyper::Error(Canceled, "connection closed")`)
//! or ends with the member's GOAWAY, or one outlives its timeout during the
//! election; the arbiter answers each `503 unavailable` and does not retry it.
//! Refusals of requests that overlap a restart (from the member's stop until the
//! cluster is healthy again) and do not name a certificate are counted apart
//! ([`Refusal::by_restart`]) and bounded; every other refusal fails the roll, and
//! so does any that names a certificate (the planted failure's).
//!
//! Planted ([`planted_an_arbiter_bundle_that_is_never_reread_fails_the_roll`]):
//! the same roll with the arbiter's bundle left at the old CA, which is what an
//! etcd client that reads its CA once at connect sees (the CA-only client before
//! it re-read its bundle). Its open connections survive step 2, but once step 3's
//! restarts break them it cannot verify any member again, so requests are refused
//! and the check fails. Chosen because it changes nothing but one file write: the
//! members' part of the roll is the same.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockmesh_tests::etcd::{harness_pki, member_identity, TLS_CA, TLS_CERT};
use lockmesh_tests::kubelet::{Files, SecretDir};
use lockmesh_tests::paths::temp_dir;
use lockmesh_tests::{ArbiterProcess, Backend, DevPki, EnvoyProcess, EtcdCluster, LockClient, TEST_TRUST_DOMAIN};
use tokio::time::Instant;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const OPEN: &str = "/v1/sessions";
const CLOSE: &str = "/v1/sessions/close";
const KEEPALIVE: &str = "/v1/sessions/keepalive";
/// The key held from before the roll to after it.
const HELD: &str = "payments/etcd-ca-roll/held";
/// The key two callers contend for throughout.
const BUSY: &str = "payments/etcd-ca-roll/busy";
/// How long the arbiter may take to log a bundle reload (it polls every 5 s,
/// `lockmesh_etcd::ETCD_CERT_RELOAD`).
const RELOAD_WITHIN: Duration = Duration::from_secs(15);

/// What one roll saw.
#[derive(Debug)]
struct Outcome {
    /// Requests answered 200 (acquires, releases, closes, keepalives).
    answered: u64,
    /// Requests answered otherwise or not at all, with what came back, other than
    /// those [`Refusal::by_restart`].
    refused: Vec<String>,
    /// Requests refused by a member restart itself ([`Refusal::by_restart`]).
    refused_by_restarts: Vec<String>,
    /// Fresh TLS handshakes to a member checked.
    handshakes: u64,
    /// After step 2: members whose handshake did not present their new-CA
    /// certificate, with what it presented.
    not_rotated: Vec<String>,
    /// After step 3: members a client trusting only the old CA could still reach.
    old_ca_admitted: Vec<String>,
    /// Member restarts.
    restarts: u64,
    /// The arbiter's `certificates reloaded` lines for its etcd bundle.
    arbiter_reloads: usize,
    /// Whether the hold taken before the roll was still held by its token after.
    hold_kept: Result<(), String>,
    /// A fresh lock round through Envoy after step 3.
    serves_after: Result<(), String>,
}

// === impl Outcome ===

impl Outcome {
    /// The roll's check: every failure, in words; empty when the roll passed.
    fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if !self.refused.is_empty() {
            f.push(format!("{} requests refused: {:?}", self.refused.len(), self.refused));
        }
        // Generous (seen: 0 to 9 per roll): a storm of them is a failure of its own.
        if self.refused_by_restarts.len() as u64 > 5 * self.restarts {
            f.push(format!(
                "{} requests refused by {} member restarts: {:?}",
                self.refused_by_restarts.len(),
                self.restarts,
                self.refused_by_restarts
            ));
        }
        if let Err(e) = &self.serves_after {
            f.push(format!("the arbiter does not serve after the roll: {e}"));
        }
        if let Err(e) = &self.hold_kept {
            f.push(format!("the hold was not kept: {e}"));
        }
        if !self.not_rotated.is_empty() {
            f.push(format!("members not presenting their new certificate: {:?}", self.not_rotated));
        }
        if !self.old_ca_admitted.is_empty() {
            f.push(format!("members still reachable trusting only the old CA: {:?}", self.old_ca_admitted));
        }
        f
    }
}

/// One request answered otherwise than 200, or not at all.
#[derive(Debug)]
struct Refusal {
    /// What was asked and what came back.
    text: String,
    /// When the request was sent and when it ended.
    sent: Instant,
    ended: Instant,
}

// === impl Refusal ===

impl Refusal {
    /// Whether a member restart explains it (the module documentation): it
    /// overlaps one of `restarts` and names no certificate.
    fn by_restart(&self, restarts: &[(Instant, Instant)]) -> bool {
        let tls = ["certificate", "Certificate", "UnknownIssuer"].iter().any(|w| self.text.contains(w));
        !tls && restarts.iter().any(|&(from, to)| self.sent <= to && self.ended >= from)
    }
}

/// A short name for what refused a request, for the printed summary.
fn kind(refusal: &str) -> &'static str {
    if refusal.contains("leader changed") {
        "leader changed"
    } else if refusal.contains("connection closed") || refusal.contains("GoAway") {
        "connection closed"
    } else if refusal.contains("ConnectionRefused") {
        "connection refused"
    } else if ["Timeout", "timed out", "did not answer within"].iter().any(|w| refusal.contains(w)) {
        "timeout"
    } else if refusal.contains("ertificate") || refusal.contains("UnknownIssuer") {
        "certificate"
    } else {
        "other"
    }
}

/// Counters shared with the traffic tasks.
#[derive(Default)]
struct Traffic {
    answered: AtomicU64,
    refused: Mutex<Vec<Refusal>>,
    /// Each member restart, from its stop until the cluster is healthy.
    restarts: Mutex<Vec<(Instant, Instant)>>,
    stop: AtomicBool,
}

// === impl Traffic ===

impl Traffic {
    /// Sends one request and counts it: 200 is answered, anything else refused
    /// (and returned in words).
    async fn send(
        &self,
        what: &str,
        request: impl std::future::Future<Output = anyhow::Result<lockmesh_tests::Resp>>,
    ) -> Result<lockmesh_tests::Resp, String> {
        let sent = Instant::now();
        let text = match request.await {
            Ok(r) if r.status == 200 => {
                self.answered.fetch_add(1, Ordering::SeqCst);
                return Ok(r);
            }
            Ok(r) => format!("{what} {}: {}", r.status, r.body.trim()),
            Err(e) => format!("{what}: {e:#}"),
        };
        self.refused.lock().unwrap().push(Refusal { text: text.clone(), sent, ended: Instant::now() });
        Err(text)
    }
}

/// The certificate serial (lowercase hex) of the first PEM certificate in `pem`.
fn serial_of(pem: &[u8]) -> Result<String, String> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem).map_err(|e| format!("no PEM certificate: {e}"))?;
    let cert = block.parse_x509().map_err(|e| format!("not a certificate: {e}"))?;
    Ok(cert.serial.to_str_radix(16))
}

/// A fresh TLS handshake to `port` (`openssl s_client`) verifying the member's
/// certificate (chain and IP SAN 127.0.0.1) against `ca` alone: the serial it
/// presented, or why verification failed.
async fn handshake(port: u16, ca: &Path) -> Result<String, String> {
    let out = tokio::process::Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}"), "-verify_ip", "127.0.0.1"])
        .args(["-verify_return_error", "-CAfile"])
        .arg(ca)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| format!("openssl (Debian package openssl): {e}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !text.contains("Verify return code: 0 (ok)") {
        let why = text.lines().find(|l| l.contains("verify error") || l.contains("error")).unwrap_or("no handshake");
        return Err(why.trim().to_owned());
    }
    serial_of(text.as_bytes())
}

/// How many times the arbiter logged its etcd bundle `ca` reloaded.
fn reloads_logged(log: &Path, ca: &Path) -> usize {
    let ca = ca.display().to_string();
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter(|l| l.contains("certificates reloaded") && l.contains(&ca)).count()
}

/// Waits until the arbiter has logged `n` reloads of `ca`.
async fn await_reloads(log: &Path, ca: &Path, n: usize) {
    let end = Instant::now() + RELOAD_WITHIN;
    while reloads_logged(log, ca) < n {
        assert!(
            Instant::now() < end,
            "the arbiter did not log reload {n} of {} within {RELOAD_WITHIN:?}",
            ca.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One contended round on [`BUSY`] in a session of its own: open it, acquire
/// (waiting), hold briefly, release, close the session. `Err`: the first refusal.
///
/// The close is retried until the session is gone (as a caller retries any
/// `unavailable`): a hold whose release, or whose grant's answer, a restart
/// refused goes with its session, instead of gating the key until the session's
/// TTL runs out.
async fn round(c: &LockClient, t: &Traffic) -> Result<(), String> {
    let opened = t.send("open", c.post(OPEN, &[("x-lock-key", BUSY)])).await?;
    let session = opened.json["session"].as_str().unwrap_or_default().to_owned();
    let held = async {
        let acq = [("x-lock-key", BUSY), ("x-lock-session", &session), ("x-lock-wait-ms", "5000")];
        let r = t.send("acquire", c.post(ACQ, &acq)).await?;
        let token = r.json["token"].as_str().unwrap_or_default().to_owned();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let rel = [("x-lock-key", BUSY), ("x-lock-token", &token), ("x-lock-session", &session)];
        t.send("release", c.post(REL, &rel)).await.map(drop)
    }
    .await;
    let mut closed = Err(String::new());
    for _ in 0..40 {
        closed = match t.send("close", c.post(CLOSE, &[("x-lock-session", &session)])).await {
            Err(e) if e.contains(" 410 ") => Ok(()),
            r => r.map(drop),
        };
        if closed.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    held.and(closed)
}

/// Restarts every member in turn, each (and the cluster) healthy before the
/// next, noting each restart's window in `t`.
async fn rolling_restart(etcd: &EtcdCluster, t: &Traffic, restarts: &mut u64) {
    for m in etcd.members() {
        let from = Instant::now();
        m.restart().await.unwrap();
        etcd.wait_healthy().await.unwrap();
        t.restarts.lock().unwrap().push((from, Instant::now()));
        *restarts += 1;
    }
}

/// `files` with `ca.crt` set to `bundle`.
fn with_ca(bundle: &[u8]) -> Files {
    Files::from([(TLS_CA.to_owned(), bundle.to_vec())])
}

/// Runs the roll; `plant` leaves the arbiter's bundle at the old CA.
async fn roll(name: &str, plant: bool) -> Outcome {
    let started = Instant::now();
    let dir = temp_dir("etcd-ca-roll-").unwrap();
    let etcd = EtcdCluster::builder().members(3).secret_volumes().start().await.unwrap();
    let pki = DevPki::generate(dir.path().join("pki"), TEST_TRUST_DOMAIN).unwrap();
    // The new etcd CA: a second PKI, of which only the CA signs anything here.
    let new = DevPki::generate(dir.path().join("etcd-ca2"), "etcd-ca2.test").unwrap();
    let (old_ca, new_ca) = (harness_pki().ca_cert_path(), new.ca_cert_path());
    let both_path = dir.path().join("old-and-new.pem");
    lockmesh_devcerts::write_bundle(&both_path, &[old_ca.clone(), new_ca.clone()]).unwrap();
    let (old_pem, both, new_pem) =
        (std::fs::read(&old_ca).unwrap(), std::fs::read(&both_path).unwrap(), std::fs::read(&new_ca).unwrap());

    // The arbiter's bundle, mounted as the arbiter's own Secret (deploy/base/arbiter).
    let arbiter_ca = SecretDir::create(dir.path().join("arbiter-etcd-ca"), &with_ca(&old_pem)).unwrap();
    let arbiter_ca_file: PathBuf = arbiter_ca.path().join(TLS_CA);
    let root = lockmesh_tests::unique_prefix(name);
    std::fs::create_dir_all(dir.path().join("users")).unwrap();
    let users = etcd.users_for(&root, &dir.path().join("users")).await.unwrap();
    let mut b = ArbiterProcess::builder(&pki).etcd_endpoints(etcd.endpoints()).root(&root);
    b = b.etcd_yaml(format!("tls: {{ ca: {:?} }}", arbiter_ca_file.display().to_string()));
    for line in users.arbiter_yaml("lockmesh-arbiter").into_iter().filter(|l| !l.starts_with("tls:")) {
        b = b.etcd_yaml(line);
    }
    let arbiter = b.start().await.unwrap();
    let backend = Backend::start().await.unwrap();
    let envoy = EnvoyProcess::builder("lock-tier")
        .cert_dir(pki.dir())
        .upstream_port(backend.port())
        .arbiter_port(arbiter.grpc_port())
        .start()
        .await
        .unwrap();
    let client = |sa: &str| {
        let cert = pki.client("payments", sa).unwrap();
        LockClient::new(envoy.listener_port(), &pki.ca_cert_path(), Some((&cert.cert_path, &cert.key_path))).unwrap()
    };
    let unchecked = || Err("not checked".to_owned());
    let mut out = Outcome {
        answered: 0,
        refused: Vec::new(),
        refused_by_restarts: Vec::new(),
        handshakes: 0,
        not_rotated: Vec::new(),
        old_ca_admitted: Vec::new(),
        restarts: 0,
        arbiter_reloads: 0,
        hold_kept: unchecked(),
        serves_after: unchecked(),
    };
    let t = Arc::new(Traffic::default());

    // The hold, kept alive through the roll.
    let holder = client("holder");
    let held = t.send("hold", holder.post(ACQ, &[("x-lock-key", HELD)])).await.expect("the hold is granted");
    let hold_token = held.json["token"].as_str().unwrap().to_owned();
    let hold_session = held.json["session"].as_str().unwrap().to_owned();
    let keeper = {
        let (c, t, s) = (holder.clone(), t.clone(), hold_session.clone());
        tokio::spawn(async move {
            while !t.stop.load(Ordering::SeqCst) {
                let _ = t.send("keepalive", c.post(KEEPALIVE, &[("x-lock-session", &s)])).await;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let contenders: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|sa| {
            let (c, t) = (client(sa), t.clone());
            tokio::spawn(async move {
                while !t.stop.load(Ordering::SeqCst) {
                    let _ = round(&c, &t).await;
                }
            })
        })
        .collect();
    let setup = started.elapsed();

    // Step 1: every bundle holds old and new; members restart to read theirs.
    for m in etcd.members() {
        m.tls_dir().unwrap().swap(&with_ca(&both)).unwrap();
    }
    etcd.client_ca_dir().unwrap().swap(&with_ca(&both)).unwrap();
    if !plant {
        arbiter_ca.swap(&with_ca(&both)).unwrap();
    }
    rolling_restart(&etcd, &t, &mut out.restarts).await;
    if !plant {
        await_reloads(arbiter.log_path(), &arbiter_ca_file, 1).await;
    }

    // Step 2: new-CA member certificates, swapped in with no restart.
    for m in etcd.members() {
        m.tls_dir().unwrap().swap(&member_identity(&new).unwrap()).unwrap();
    }
    for m in etcd.members() {
        let want = serial_of(&m.tls_dir().unwrap().current().unwrap()[TLS_CERT]).unwrap();
        out.handshakes += 1;
        match handshake(m.client_port(), &new_ca).await {
            Ok(seen) if seen == want => {}
            Ok(seen) => out.not_rotated.push(format!("{}: serial {seen}, want {want}", m.name())),
            Err(e) => out.not_rotated.push(format!("{}: {e}", m.name())),
        }
    }

    // Step 3: the new CA alone; members restart to drop the old one.
    for m in etcd.members() {
        m.tls_dir().unwrap().swap(&with_ca(&new_pem)).unwrap();
    }
    etcd.client_ca_dir().unwrap().swap(&with_ca(&new_pem)).unwrap();
    if !plant {
        arbiter_ca.swap(&with_ca(&new_pem)).unwrap();
    }
    rolling_restart(&etcd, &t, &mut out.restarts).await;
    if !plant {
        await_reloads(arbiter.log_path(), &arbiter_ca_file, 2).await;
    }
    for m in etcd.members() {
        out.handshakes += 1;
        if let Ok(serial) = handshake(m.client_port(), &old_ca).await {
            out.old_ca_admitted.push(format!("{}: serial {serial}", m.name()));
        }
    }

    // The arbiter, on connections its reloaded bundle verified, still serves.
    out.serves_after = round(&client("fresh"), &t).await;
    t.stop.store(true, Ordering::SeqCst);
    for c in contenders {
        c.await.unwrap();
    }
    keeper.await.unwrap();
    let seen = [("x-lock-key", HELD), ("x-lock-session", &hold_session)];
    out.hold_kept = match t.send("hold check", holder.get("/v1/locks", &seen)).await {
        Ok(r) if r.json["holders"][0]["token"].as_str() == Some(hold_token.as_str()) => {
            let rel = [("x-lock-key", HELD), ("x-lock-token", &hold_token), ("x-lock-session", &hold_session)];
            t.send("hold release", holder.post(REL, &rel)).await.map(drop)
        }
        Ok(r) => Err(format!("holders {}", r.json["holders"])),
        Err(e) => Err(e),
    };
    out.answered = t.answered.load(Ordering::SeqCst);
    let refused = std::mem::take(&mut *t.refused.lock().unwrap());
    let restarts = t.restarts.lock().unwrap().clone();
    let (by_restarts, others): (Vec<Refusal>, Vec<Refusal>) =
        refused.into_iter().partition(|r| r.by_restart(&restarts));
    out.refused_by_restarts = by_restarts.into_iter().map(|r| r.text).collect();
    out.refused = others.into_iter().map(|r| r.text).collect();
    out.arbiter_reloads = reloads_logged(arbiter.log_path(), &arbiter_ca_file);
    if let Some(other) = out.refused_by_restarts.iter().find(|r| kind(r) == "other") {
        println!("etcd-ca-roll: {name}: a refusal by a restart: {other}");
    }
    let kinds = |v: &[String]| {
        let mut n = std::collections::BTreeMap::<&str, usize>::new();
        v.iter().for_each(|r| *n.entry(kind(r)).or_default() += 1);
        n
    };
    println!(
        "etcd-ca-roll: {name}: answered {}, refused {} {:?}, refused by the restarts themselves {} {:?}, \
         handshakes checked {}, member restarts {}, arbiter bundle reloads {}, setup {:.1} s, total {:.1} s",
        out.answered,
        out.refused.len(),
        kinds(&out.refused),
        out.refused_by_restarts.len(),
        kinds(&out.refused_by_restarts),
        out.handshakes,
        out.restarts,
        out.arbiter_reloads,
        setup.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    out
}

/// The documented etcd CA roll with a hold and waiters in flight and the arbiter
/// never restarted: nothing refused, the hold kept, each member presents its
/// new-CA certificate after step 2, an old-CA-only client is refused after step 3
/// while the arbiter (its CA-only bundle reloaded twice) still serves.
#[tokio::test]
async fn the_etcd_ca_rolls_with_rolling_restarts_and_the_arbiter_follows_its_bundle() {
    let out = roll("etcd-ca-roll", false).await;
    assert_eq!(out.failures(), Vec::<String>::new());
    assert_eq!(out.arbiter_reloads, 2, "the arbiter re-read its etcd bundle at steps 1 and 3");
    assert_eq!((out.restarts, out.handshakes), (6, 6));
    assert!(out.answered > 20, "traffic ran through the roll: {} answered", out.answered);
}

/// Planted: the arbiter's bundle is never changed, as an etcd client that read
/// its CA once at connect sees it; once step 3's restarts close its connections it
/// verifies no member again, so the roll's check fails on refused requests.
#[tokio::test]
async fn planted_an_arbiter_bundle_that_is_never_reread_fails_the_roll() {
    let out = roll("etcd-ca-roll-planted", true).await;
    let failures = out.failures();
    println!("etcd-ca-roll: planted: first refusal: {:?}", out.refused.first());
    assert!(
        failures.iter().any(|f| f.contains("requests refused")) && out.serves_after.is_err(),
        "a client that keeps the old CA must fail the check: {failures:?}"
    );
    // The members' part of the roll was the same and passed.
    assert!(out.not_rotated.is_empty() && out.old_ca_admitted.is_empty(), "{failures:?}");
}
