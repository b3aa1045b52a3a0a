//! Issue #16 item 3, the whole stack: every certificate rotates mid-run and then
//! the CA rolls, with holds, waiters and transparent requests in flight, through
//! the same five sets of files as the tailer's roll in [`crate::rotation`]
//! (leaves reissued; bundle A+B; leaves of CA B; bundle B), each swapped in as the
//! kubelet updates a Secret volume ([`SecretDir`]).
//!
//! The components, each reading its own copy of the files as it would in a pod:
//!
//! - the lock tier's Envoy (`lock-tier.yaml`): listener certificate, client
//!   certificate to the arbiter and both CAs through SDS `watched_directory`;
//! - an inbound sidecar Envoy (`inbound-sidecar.yaml`), the transparent shape,
//!   the same way, presenting its pod's own SVID (`payments_store.pem`, a self
//!   client of the arbiter) rather than the lock tier's `envoy-client.pem`;
//! - the arbiter: its mTLS listener re-reads its set every `tls.reload_ms`;
//! - SDK clients: `Config::cert_reload`.
//!
//! In flight all along: an SDK hold taken before the roll and kept past it; two
//! SDK clients cycling one key, so one always waits for the other; two
//! transparent requests on one key through the sidecar, one waiting for the
//! other, each on a fresh connection made from the files of the moment; a client
//! on a connection opened before the roll; header acquires on fresh connections to
//! the lock tier. None may be refused or dropped.
//!
//! After each swap a fresh handshake to each listener (the lock tier, the sidecar,
//! the arbiter) must present the set's certificate, and each Envoy's `/certs`
//! its client certificate; at step 2 a client of CA B is admitted, at step 4 a
//! client of CA A no longer is. After the roll, an expired certificate of CA B and
//! a valid one of CA A are refused, and the lock tier is restarted so every SDK
//! connection handshakes again: the reloading SDK clients carry on, and the
//! planted one (`cert_reload: None`, files read once) is refused.
//!
//! Not here: the arbiter's etcd client certificate (etcd's own PKI) and etcd's
//! CA roll, which is a rolling restart of the members (`crate::etcd_ca_roll`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockmesh_client::{Client, Config, LockOptions};
use lockmesh_tests::backend::DELAY_HEADER;
use lockmesh_tests::kubelet::{Files, SecretDir};
use lockmesh_tests::{EnvoyProcess, LockClient, Stack};

use crate::envoy_sds::normalise;
use crate::rotation::{expired, issue};

const HELD_KEY: &str = "payments/rot-held";
const CYCLE_KEY: &str = "payments/rot-cycle";
/// The sidecar's locked route derives the key from the path: `/orders/77`
/// locks `payments/order-77`.
const TRANSPARENT_KEY: &str = "payments/order-77";
const HEADER_KEY: &str = "payments/rot-hdr";

/// Every identity the scenario presents (`payments/<sa>`).
const HOLDER: &str = "rot-holder";
const CYCLERS: [&str; 2] = ["rot-a", "rot-b"];
const TRANSPARENT: [&str; 2] = ["rot-tp-a", "rot-tp-b"];
const PROBE: &str = "rot-probe";
const PLANTED: &str = "rot-once";

/// Every workload certificate the roll reissues: the scenario's identities and
/// the inbound sidecar's own SVID (`payments/store`, which it presents to the
/// arbiter as a self client).
fn identities() -> Vec<(String, String)> {
    let sidecar = lockmesh_tests::envoy::sidecar_svid_name().unwrap();
    [HOLDER, PROBE, PLANTED]
        .into_iter()
        .chain(CYCLERS)
        .chain(TRANSPARENT)
        .map(|sa| ("payments".to_owned(), sa.to_owned()))
        .chain(std::iter::once(sidecar))
        .collect()
}

/// The certificate file the inbound sidecar presents to the arbiter (its pod's
/// own SVID, `payments_store.pem`); the lock tier presents `envoy-client.pem`.
fn sidecar_client_file() -> String {
    let (ns, sa) = lockmesh_tests::envoy::sidecar_svid_name().unwrap();
    format!("{ns}_{sa}.pem")
}

fn cert_of<'a>(f: &'a Files, sa: &str) -> (&'a [u8], &'a [u8]) {
    (&f[&format!("payments_{sa}.pem")], &f[&format!("payments_{sa}-key.pem")])
}

/// What the traffic saw: answered, refused and the first refusals' texts.
#[derive(Default)]
struct Traffic {
    answered: AtomicU64,
    fresh_handshakes: AtomicU64,
    refused: AtomicU64,
    first_refusals: Mutex<Vec<String>>,
}

impl Traffic {
    fn answered(&self, fresh: bool) {
        self.answered.fetch_add(1, Ordering::SeqCst);
        if fresh {
            self.fresh_handshakes.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn refused(&self, what: String) {
        self.refused.fetch_add(1, Ordering::SeqCst);
        let mut first = self.first_refusals.lock().unwrap();
        if first.len() < 20 {
            first.push(what);
        }
    }
}

/// The serial of the first certificate in `pem`, lowercase hex without leading
/// zeros (as [`handshake_serial`] normalises what openssl prints).
fn serial(pem: &[u8]) -> String {
    let der = x509_parser::pem::parse_x509_pem(pem).unwrap().1.contents;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    normalise(&cert.tbs_certificate.serial.to_str_radix(16))
}

/// The serial of the certificate the listener on `port` presents on a new
/// handshake (`openssl s_client`), the client presenting `identity` of `files`.
async fn handshake_serial(port: u16, files: &Files, cert: &str) -> Result<String, String> {
    let t = tempfile::tempdir().map_err(|e| e.to_string())?;
    for (name, bytes) in [
        ("ca.pem", &files["ca.pem"]),
        ("c.pem", &files[&format!("{cert}.pem")]),
        ("k.pem", &files[&format!("{cert}-key.pem")]),
    ] {
        std::fs::write(t.path().join(name), bytes).map_err(|e| e.to_string())?;
    }
    let d = t.path().display();
    let script = format!(
        "openssl s_client -connect 127.0.0.1:{port} -servername localhost -CAfile {d}/ca.pem -cert {d}/c.pem \
         -key {d}/k.pem </dev/null 2>/dev/null | openssl x509 -noout -serial"
    );
    let out = tokio::process::Command::new("sh").arg("-c").arg(script).output().await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let s = text.trim().strip_prefix("serial=").ok_or_else(|| format!("no certificate from the handshake: {text}"))?;
    Ok(normalise(s))
}

/// Whether the listener on `port` admits a client trusting `ca` and presenting
/// (`cert`, `key`) on a fresh connection: any HTTP answer is admission, a failed
/// handshake (TLS 1.3 reports a refused client certificate at the first read) is
/// refusal.
async fn admitted(port: u16, ca: &[u8], (cert, key): (&[u8], &[u8])) -> bool {
    let Ok(c) = LockClient::from_pem(port, ca, Some((cert, key))) else { return false };
    // No lock header: on the sidecar a request with one would take a lock.
    c.get("/", &[]).await.is_ok()
}

/// A stack of the lock tier, an arbiter re-reading its set every
/// `arbiter_reload_ms` (0: never) and an
/// inbound sidecar Envoy, over one kubelet-style certificate directory (the
/// stack's PKI directory, adopted in place) that the two Envoys copy at each step.
struct Rig {
    st: Stack,
    sidecar: EnvoyProcess,
    dir: SecretDir,
}

async fn rig(name: &str, arbiter_reload_ms: u64) -> Rig {
    let st = Stack::builder(name)
        .envoy_config("lock-tier")
        .inbound_sidecar()
        .arbiter_tls_reload_ms(arbiter_reload_ms)
        .start()
        .await
        .unwrap();
    for (ns, sa) in identities() {
        st.pki().client(&ns, &sa).unwrap();
    }
    let sidecar = EnvoyProcess::builder("inbound-sidecar")
        .cert_dir(st.pki().dir())
        .upstream_port(st.backend().port())
        .arbiter_port(st.arbiter(0).grpc_port())
        .start()
        .await
        .unwrap();
    let dir = SecretDir::adopt(st.pki().dir()).unwrap();
    Rig { st, sidecar, dir }
}

/// An SDK client of `payments/<sa>` over the rig's (kubelet-style) files,
/// re-reading them every 200 ms, or never (`reload: false`, the planted one).
fn sdk(r: &Rig, sa: &str, reload: bool) -> (Client, Arc<Mutex<Vec<String>>>) {
    let port = r.st.envoy().listener_port();
    let d = r.dir.path();
    let mut c = Config::new(
        format!("https://localhost:{port}"),
        d.join("ca.pem"),
        d.join(format!("payments_{sa}.pem")),
        d.join(format!("payments_{sa}-key.pem")),
    );
    c.resolve = Some(std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port)));
    c.cert_reload = reload.then(|| Duration::from_millis(200));
    let fences: Arc<Mutex<Vec<String>>> = Arc::default();
    let f = fences.clone();
    let client = Client::new(c, move |ev| f.lock().unwrap().push(format!("{ev:?}"))).unwrap();
    (client, fences)
}

/// The set of the moment, read consistently (a read racing a swap is retried).
async fn files_now(dir: &SecretDir) -> Files {
    loop {
        if let Ok(f) = dir.current() {
            return f;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One transparent request on `key` through the sidecar on a connection made now
/// from `files` as `payments/<sa>`, held 50 ms by the backend.
async fn transparent(port: u16, c: &LockClient) -> Result<(), String> {
    let r = c
        .post("/orders/77", &[("x-lock-key", TRANSPARENT_KEY), ("x-lock-wait-ms", "20000"), (DELAY_HEADER, "50")])
        .await
        .map_err(|e| format!("transparent via :{port}: {e:#}"))?;
    if r.code() != 200 {
        return Err(format!("transparent via :{port}: {} {}", r.code(), r.body));
    }
    Ok(())
}

/// A header acquire and its release on the lock tier.
async fn header_round(c: &LockClient) -> Result<(), String> {
    let r = c
        .post("/v1/locks/acquire", &[("x-lock-key", HEADER_KEY), ("x-lock-wait-ms", "20000")])
        .await
        .map_err(|e| format!("{e:#}"))?;
    if r.code() != 200 {
        return Err(format!("header acquire {}: {}", r.code(), r.body));
    }
    let (token, session) =
        (r.json["token"].as_str().unwrap_or_default(), r.json["session"].as_str().unwrap_or_default());
    let rel = c
        .post("/v1/locks/release", &[("x-lock-key", HEADER_KEY), ("x-lock-token", token), ("x-lock-session", session)])
        .await
        .map_err(|e| format!("{e:#}"))?;
    if rel.code() != 200 {
        return Err(format!("header release {}: {}", rel.code(), rel.body));
    }
    Ok(())
}

/// Starts every kind of traffic; returns the handles and what they count.
fn traffic(r: &Rig, first: &Files, stop: &Arc<AtomicBool>) -> (Vec<tokio::task::JoinHandle<()>>, Arc<Traffic>) {
    let tr = Arc::new(Traffic::default());
    let mut tasks = Vec::new();
    // Two SDK clients cycling one key: one always waits for the other.
    for sa in CYCLERS {
        let (client, _) = sdk(r, sa, true);
        let (tr, stop) = (tr.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let opts = LockOptions { wait: Duration::from_secs(20), ..LockOptions::default() };
                match client.lock(CYCLE_KEY, opts).await {
                    Ok(g) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        match g.release().await {
                            Ok(()) => tr.answered(false),
                            Err(e) => tr.refused(format!("sdk {sa} release: {e}")),
                        }
                    }
                    Err(e) => tr.refused(format!("sdk {sa} lock: {e}")),
                }
            }
        }));
    }
    // Two transparent callers of one key, a fresh connection per request.
    let sidecar = r.sidecar.listener_port();
    for sa in TRANSPARENT {
        let (tr, stop, dir) = (tr.clone(), stop.clone(), r.dir.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let f = files_now(&dir).await;
                let c = LockClient::from_pem(sidecar, &f["ca.pem"], Some(cert_of(&f, sa))).unwrap();
                match transparent(sidecar, &c).await {
                    Ok(()) => tr.answered(true),
                    Err(e) => tr.refused(format!("{sa}: {e}")),
                }
            }
        }));
    }
    // A transparent caller on a connection opened before the roll.
    {
        let c = LockClient::from_pem(sidecar, &first["ca.pem"], Some(cert_of(first, TRANSPARENT[0]))).unwrap();
        let (tr, stop) = (tr.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match transparent(sidecar, &c).await {
                    Ok(()) => tr.answered(false),
                    Err(e) => tr.refused(format!("kept-open: {e}")),
                }
            }
        }));
    }
    // Header acquires on the lock tier, a fresh connection per round.
    {
        let tier = r.st.envoy().listener_port();
        let (tr, stop, dir) = (tr.clone(), stop.clone(), r.dir.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let f = files_now(&dir).await;
                let c = LockClient::from_pem(tier, &f["ca.pem"], Some(cert_of(&f, PROBE))).unwrap();
                match header_round(&c).await {
                    Ok(()) => tr.answered(true),
                    Err(e) => tr.refused(format!("header: {e}")),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }
    (tasks, tr)
}

/// What a listener must show after a swap: the serial it presents on a new
/// handshake (its own certificate in `files`) and, for an Envoy, the serial of
/// its client certificate to the arbiter in `/certs`.
async fn step_seen(r: &Rig, files: &Files) -> Result<(), String> {
    let server = serial(&files["envoy.pem"]);
    for (what, port) in [("lock tier", r.st.envoy().listener_port()), ("sidecar", r.sidecar.listener_port())] {
        let seen = handshake_serial(port, files, &format!("payments_{PROBE}")).await?;
        if seen != server {
            return Err(format!("{what} presents {seen}, not {server}"));
        }
    }
    let sidecar_client = sidecar_client_file();
    for (what, envoy, file) in
        [("lock tier", r.st.envoy(), "envoy-client.pem"), ("sidecar", &r.sidecar, sidecar_client.as_str())]
    {
        let client = serial(&files[file]);
        let serials: Vec<String> =
            envoy.cert_serials().await.map_err(|e| e.to_string())?.iter().map(|s| normalise(s)).collect();
        if !serials.contains(&client) {
            return Err(format!("{what}'s /certs lacks its client certificate {client}: {serials:?}"));
        }
    }
    let arbiter = serial(&files["arbiter.pem"]);
    let seen = handshake_serial(r.st.arbiter(0).grpc_port(), files, "envoy-client").await?;
    if seen != arbiter {
        return Err(format!("arbiter presents {seen}, not {arbiter}"));
    }
    Ok(())
}

/// Runs the roll under traffic. `Err` names the step a listener never showed.
async fn roll(r: &Rig, within: Duration) -> (Vec<Files>, Arc<Traffic>, Result<(), String>) {
    let first = files_now(&r.dir).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (tasks, tr) = traffic(r, &first, &stop);
    tokio::time::sleep(Duration::from_secs(1)).await;

    let owned = identities();
    let ids: Vec<(&str, &str)> = owned.iter().map(|(ns, sa)| (ns.as_str(), sa.as_str())).collect();
    let rotated = issue(Some(&first), &ids);
    let new_ca = issue(None, &ids);
    let bundle = [first["ca.pem"].clone(), new_ca["ca.pem"].clone()].concat();
    let with_ca = |mut f: Files, ca: &[u8]| {
        f.insert("ca.pem".into(), ca.to_vec());
        f
    };
    // Admission beyond the certificates: at step 2 every listener lets a client of
    // CA B in, at step 4 no longer one of CA A.
    let (b_probe, a_probe) = (cert_of(&new_ca, PROBE), cert_of(&rotated, PROBE));
    let (b_envoy, a_envoy) = (
        (&new_ca["envoy-client.pem"][..], &new_ca["envoy-client-key.pem"][..]),
        (&rotated["envoy-client.pem"][..], &rotated["envoy-client-key.pem"][..]),
    );
    let steps: [(&str, Files, Option<(&[u8], bool)>); 4] = [
        ("1 leaves reissued, CA A", rotated.clone(), None),
        ("2 bundle A+B", with_ca(rotated.clone(), &bundle), Some((&bundle[..], true))),
        ("3 leaves of CA B, bundle A+B", with_ca(new_ca.clone(), &bundle), None),
        ("4 bundle B", new_ca.clone(), Some((&new_ca["ca.pem"][..], false))),
    ];
    let mut result = Ok(());
    for (what, files, admission) in &steps {
        let before = tr.fresh_handshakes.load(Ordering::SeqCst);
        r.dir.swap(files).unwrap();
        r.st.envoy().rotate_certs(r.dir.path()).unwrap();
        r.sidecar.rotate_certs(r.dir.path()).unwrap();
        let now = files_now(&r.dir).await;
        let mut last = String::new();
        let seen = tokio::time::timeout(within, async {
            loop {
                let shown = step_seen(r, &now).await;
                let admits = match admission {
                    None => Ok(()),
                    Some((ca, want)) => {
                        let (probe, envoy) = if *want { (b_probe, b_envoy) } else { (a_probe, a_envoy) };
                        let tiers = [r.st.envoy().listener_port(), r.sidecar.listener_port()];
                        let mut bad = Vec::new();
                        for port in tiers {
                            if admitted(port, ca, probe).await != *want {
                                bad.push(format!("envoy :{port}"));
                            }
                        }
                        if admitted(r.st.arbiter(0).grpc_port(), ca, envoy).await != *want {
                            bad.push("arbiter".to_owned());
                        }
                        if bad.is_empty() {
                            Ok(())
                        } else {
                            Err(format!(
                                "admission of the {} CA's client wrong at {bad:?}",
                                if *want { "new" } else { "old" }
                            ))
                        }
                    }
                };
                match shown.and(admits) {
                    Ok(()) => return,
                    Err(e) => last = e,
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        if seen.is_err() {
            result = Err(format!("step {what}: {last}"));
            break;
        }
        println!(
            "rotation: step {what}: every listener presents the new set ({} fresh client handshakes answered since the last step)",
            tr.fresh_handshakes.load(Ordering::SeqCst) - before
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    (vec![first, rotated, new_ca], tr, result)
}

#[tokio::test]
async fn every_component_follows_a_rotation_and_a_ca_roll_with_holds_waiters_and_requests_in_flight() {
    let r = rig("rotation-stack", 200).await;
    let (holder, holder_fences) = sdk(&r, HOLDER, true);
    let (planted, _) = sdk(&r, PLANTED, false);
    let held = holder.lock(HELD_KEY, LockOptions::default()).await.unwrap();
    planted
        .lock(CYCLE_KEY, LockOptions { wait: Duration::from_secs(20), ..LockOptions::default() })
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    let (sets, tr, result) = roll(&r, Duration::from_secs(15)).await;
    result.unwrap();
    let (rotated, new_ca) = (&sets[1], &sets[2]);
    let refused = tr.refused.load(Ordering::SeqCst);
    let answered = tr.answered.load(Ordering::SeqCst);
    println!(
        "rotation: stack: {answered} requests answered ({} on fresh handshakes), holds kept: 1 of 1, refused: {}",
        tr.fresh_handshakes.load(Ordering::SeqCst),
        refused
    );
    assert_eq!(refused, 0, "requests were refused or dropped during the roll: {:?}", tr.first_refusals.lock().unwrap());
    assert!(answered > 40, "too little traffic ran: {answered}");
    assert!(tr.fresh_handshakes.load(Ordering::SeqCst) > 10, "too few fresh handshakes");

    // The hold taken before the roll is still the same hold, never fenced.
    assert!(held.can_start(), "the hold kept through the roll lost its footing");
    assert!(holder_fences.lock().unwrap().is_empty(), "the holder was fenced: {:?}", holder_fences.lock().unwrap());

    // After the roll: an expired certificate of the new CA and a valid one of the
    // old CA only are refused by every listener.
    let probe_id = r.st.pki().workload_spiffe_id("payments", PROBE);
    let (x_cert, x_key) = expired(new_ca, &probe_id);
    let envoy_id = r.st.pki().envoy_spiffe_id();
    let (xe_cert, xe_key) = expired(new_ca, &envoy_id);
    for port in [r.st.envoy().listener_port(), r.sidecar.listener_port()] {
        assert!(
            !admitted(port, &new_ca["ca.pem"], (&x_cert, &x_key)).await,
            "envoy :{port} admitted an expired certificate"
        );
        assert!(
            !admitted(port, &new_ca["ca.pem"], cert_of(rotated, PROBE)).await,
            "envoy :{port} admitted the removed CA"
        );
        assert!(admitted(port, &new_ca["ca.pem"], cert_of(new_ca, PROBE)).await, "envoy :{port} refused the new CA");
    }
    let arbiter = r.st.arbiter(0).grpc_port();
    assert!(
        !admitted(arbiter, &new_ca["ca.pem"], (&xe_cert, &xe_key)).await,
        "the arbiter admitted an expired certificate"
    );
    let old_envoy = (&rotated["envoy-client.pem"][..], &rotated["envoy-client-key.pem"][..]);
    assert!(!admitted(arbiter, &new_ca["ca.pem"], old_envoy).await, "the arbiter admitted the removed CA");

    // Every SDK connection handshakes again: the lock tier restarts (it trusts CA
    // B only now). The holder's client, made before the roll, carries on with the
    // files it re-read; the hold is kept (its keepalives resume within the TTL);
    // the client that read its files once (CA A) is refused.
    r.st.envoy().restart().await.unwrap();
    // A keepalive that met the restart puts the session in draining (no new work
    // until the next keepalive is answered): the SDK's retryable refusal, waited out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let g = loop {
        match holder.lock(CYCLE_KEY, LockOptions { wait: Duration::from_secs(20), ..LockOptions::default() }).await {
            Err(lockmesh_client::Error::Draining) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            r => break r.unwrap(),
        }
    };
    g.release().await.unwrap();
    let e = planted
        .lock(CYCLE_KEY, LockOptions { wait: Duration::from_secs(5), ..LockOptions::default() })
        .await
        .expect_err("a client holding only the removed CA's files was answered after the roll");
    println!("rotation: the planted client (files read once) is refused after the roll: {e}");
    lockmesh_tests::eventually_true(Duration::from_secs(20), "the holder's keepalive resumes", || async {
        held.can_start()
    })
    .await;
    held.release().await.unwrap();
    assert!(holder_fences.lock().unwrap().is_empty(), "the holder was fenced: {:?}", holder_fences.lock().unwrap());
}

/// The planted counterpart: an arbiter that reads its files once (`tls.reload_ms:
/// 0`) keeps presenting the first certificate, and the roll fails at step 1
/// naming it.
#[tokio::test]
async fn an_arbiter_that_does_not_reload_fails_the_roll() {
    let r = rig("rotation-stack-planted", 0).await;
    let (_, _, result) = roll(&r, Duration::from_secs(5)).await;
    let e = result.expect_err("the roll passed against an arbiter that never reloads");
    assert!(e.starts_with("step 1") && e.contains("arbiter presents"), "{e}");
}
