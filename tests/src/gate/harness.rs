//! The gate's system under test: a 3-member etcd cluster, two arbiters that reach
//! each member through a [`FaultProxy`], two lock-tier Envoys (each listing both
//! arbiters), a key-value store behind fence-proxy, the history recorder and the
//! holder processes.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use tempfile::TempDir;

use super::clock::{ClockMode, FakeClock};
use super::faultproxy::{FaultProxy, LinkMode};
use super::history::{now_us, Fault, History, StoreWrite};
use super::holder::read_ops;
use super::recorder::Recorder;
use crate::arbiter::ArbiterProcess;
use crate::certs::{DevPki, TEST_TRUST_DOMAIN};
use crate::envoy::EnvoyProcess;
use crate::etcd::EtcdCluster;
use crate::fence::{ensure_signing_key, FenceProxyProcess, KvStore};
use crate::paths::{profile_dir, temp_dir};
use crate::process::ChildProcess;
use crate::unique_prefix;

/// Lock-key prefix of the gate's fenced mutex keys (`<prefix>/<i>`).
pub const MUTEX_PREFIX: &str = "payments/gate/m";
/// Lock-key prefix of the gate's advisory semaphore keys, N = [`SEM_N`].
pub const SEM_PREFIX: &str = "payments/gate/sem";
/// The environment variable that lets a process accept planted bugs.
pub const TEST_FAULTS_ENV: &str = "LOCKMESH_TEST_FAULTS";
/// Holders allowed per semaphore key.
pub const SEM_N: usize = 3;
/// TTL of both gate classes, seconds (a pause "past the TTL" lasts longer).
pub const GATE_TTL_S: u64 = 3;

/// The gate's registry: a fenced mutex class and an advisory class of N = 3.
pub const GATE_REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2 }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: gate, waiver_expiry: "2099-12-31" }
  - { name: gatem, prefixes: ["payments/gate/m"], ttl_s: 3, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }
  - { name: gatesem, prefixes: ["payments/gate/sem"], ttl_s: 3, max_holders: 3, enforcement: advisory,
      risk_owner: gate, waiver_expiry: "2099-12-31" }
"#;

/// Options of a gate cluster.
#[derive(Debug, Clone)]
pub struct GateOptions {
    /// Label of the etcd root.
    pub name: String,
    /// etcd members (3 for the gate; 1 for fast targeted scenarios).
    pub members: usize,
    /// Arbiters.
    pub arbiters: usize,
    /// Envoys (each lists every arbiter), unless `envoy_per_arbiter`.
    pub envoys: usize,
    /// Envoy i lists only arbiter i (to race grants across arbiters).
    pub envoy_per_arbiter: bool,
    /// Planted arbiter bugs (`test_faults`); sets `LOCKMESH_TEST_FAULTS=1`.
    pub arbiter_faults: Vec<String>,
    /// Planted fence bug (`accept_lower_tokens`).
    pub fence_accepts_lower: bool,
    /// Fenced mutex keys.
    pub mutex_keys: usize,
    /// Semaphore keys.
    pub sem_keys: usize,
    /// Run arbiters 0 and 1 and holders h0 and h1 under libfaketime (wall clock
    /// only for the first of each, wall and monotonic for the second), so the
    /// schedule can step their clocks ([`super::clock`]).
    pub clock_steps: bool,
}

/// A holder process and its output.
#[derive(Debug)]
pub struct HolderProc {
    /// Its label.
    pub name: String,
    /// The process.
    pub process: ChildProcess,
    /// Its JSON-lines output.
    pub out: PathBuf,
    /// Its stepped clock, if it runs under libfaketime.
    pub clock: Option<FakeClock>,
}

/// The running system, its recorder and what was injected.
#[derive(Debug)]
pub struct GateCluster {
    /// Holders (dropped first).
    pub holders: Vec<HolderProc>,
    /// Envoys.
    pub envoys: Vec<EnvoyProcess>,
    /// Arbiters.
    pub arbiters: Vec<ArbiterProcess>,
    /// `proxies[arbiter][member]`.
    pub proxies: Vec<Vec<FaultProxy>>,
    /// The stepped clock of each arbiter that runs under libfaketime.
    pub arbiter_clocks: Vec<Option<FakeClock>>,
    /// fence-proxy.
    pub fence: FenceProxyProcess,
    /// The store behind it.
    pub store: KvStore,
    /// The history recorder.
    pub recorder: Recorder,
    /// etcd.
    pub etcd: EtcdCluster,
    /// The etcd root.
    pub root: String,
    /// The PKI.
    pub pki: DevPki,
    opts: GateOptions,
    faults: Mutex<Vec<Fault>>,
    quorum_loss: Mutex<Vec<(u64, u64)>>,
    epoch: Mutex<u64>,
    dir: TempDir,
}

// === impl GateOptions ===

impl GateOptions {
    /// The full gate topology: 3 members, 2 arbiters, 2 Envoys.
    pub fn gate(name: &str) -> Self {
        Self {
            name: name.into(),
            members: 3,
            arbiters: 2,
            envoys: 2,
            envoy_per_arbiter: false,
            arbiter_faults: Vec::new(),
            fence_accepts_lower: false,
            mutex_keys: 3,
            sem_keys: 2,
            clock_steps: true,
        }
    }
}

// === impl GateCluster ===

impl GateCluster {
    /// Starts everything and the recorder (before the arbiters, so the history
    /// starts at revision 1).
    pub async fn start(opts: GateOptions) -> Result<Self> {
        let dir = temp_dir("gate-")?;
        let pki = DevPki::generate(dir.path().join("pki"), TEST_TRUST_DOMAIN)?;
        let key = ensure_signing_key(&dir.path().join("signing"))?;
        let etcd = EtcdCluster::builder().members(opts.members).start().await?;
        let root = unique_prefix(&opts.name);
        let recorder = Recorder::start(etcd.endpoints(), &root);
        let store = KvStore::start().await?;
        let mut fb = FenceProxyProcess::builder(store.port()).trust(&key.kid, &key.pub_file).routes(format!(
            "routes:\n  - name: items\n    path: /items/{{id}}\n    reads: [GET]\n    resource: \"items/{{id}}\"\n    lock_key: \"{MUTEX_PREFIX}/{{id}}\""
        ));
        if opts.fence_accepts_lower {
            fb = fb.extra_yaml("accept_lower_tokens: true").env(TEST_FAULTS_ENV, "1");
        }
        let fence = fb.start().await?;
        let mut proxies = Vec::new();
        for _ in 0..opts.arbiters {
            let mut row = Vec::new();
            for m in etcd.members() {
                row.push(FaultProxy::start(m.client_port()).await?);
            }
            proxies.push(row);
        }
        let mut arbiters = Vec::new();
        let mut arbiter_clocks = Vec::new();
        for (i, row) in proxies.iter().enumerate() {
            let mut b = ArbiterProcess::builder(&pki)
                .etcd_endpoints(row.iter().map(FaultProxy::url).collect())
                .root(&root)
                .registry(GATE_REGISTRY)
                .max_wait_ms(5000)
                .extra_yaml(key.arbiter_yaml())
                .extra_yaml(format!(
                    "marks_file: {:?}",
                    dir.path().join(format!("marks-{i}.json")).display().to_string()
                ));
            if !opts.arbiter_faults.is_empty() {
                b = b
                    .extra_yaml(format!("test_faults: [{}]", opts.arbiter_faults.join(", ")))
                    .env(TEST_FAULTS_ENV, "1");
            }
            let clock = match clock_mode(&opts, i) {
                Some(mode) => Some(FakeClock::new(dir.path(), &format!("arbiter {i}"), mode)?),
                None => None,
            };
            for (k, v) in clock.iter().flat_map(FakeClock::env) {
                b = b.env(k, v);
            }
            arbiter_clocks.push(clock);
            arbiters.push(b);
        }
        let arbiters = futures::future::try_join_all(arbiters.into_iter().map(|b| b.start())).await?;
        let ports: Vec<u16> = arbiters.iter().map(ArbiterProcess::grpc_port).collect();
        let envoys = futures::future::try_join_all((0..opts.envoys).map(|i| {
            let listed = if opts.envoy_per_arbiter { vec![ports[i % ports.len()]] } else { ports.clone() };
            EnvoyProcess::builder("lock-tier").cert_dir(pki.dir()).arbiter_ports(listed).start()
        }))
        .await?;
        Ok(Self {
            holders: Vec::new(),
            envoys,
            arbiters,
            proxies,
            arbiter_clocks,
            fence,
            store,
            recorder,
            etcd,
            root,
            pki,
            opts,
            faults: Mutex::new(Vec::new()),
            quorum_loss: Mutex::new(Vec::new()),
            epoch: Mutex::new(1),
            dir,
        })
    }

    /// The run's scratch directory.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The fenced mutex keys.
    pub fn mutex_keys(&self) -> Vec<String> {
        (0..self.opts.mutex_keys).map(|i| format!("{MUTEX_PREFIX}/{i}")).collect()
    }

    /// The semaphore keys.
    pub fn sem_keys(&self) -> Vec<String> {
        (0..self.opts.sem_keys).map(|i| format!("{SEM_PREFIX}/{i}")).collect()
    }

    /// Envoy listener ports.
    pub fn envoy_ports(&self) -> Vec<u16> {
        self.envoys.iter().map(EnvoyProcess::listener_port).collect()
    }

    /// Starts a holder process looping over `keys` (fenced writes if `fenced`).
    pub fn spawn_holder(&mut self, name: &str, keys: &[String], fenced: bool) -> Result<()> {
        self.spawn_holder_with_clock(name, keys, fenced, None)
    }

    /// [`GateCluster::spawn_holder`], under libfaketime with a clock in `mode` if given.
    pub fn spawn_holder_with_clock(
        &mut self,
        name: &str,
        keys: &[String],
        fenced: bool,
        mode: Option<ClockMode>,
    ) -> Result<()> {
        let cert = self.pki.client("payments", &format!("gate-{name}"))?;
        let out = self.dir.path().join(format!("ops-{name}.jsonl"));
        let ports: Vec<String> = self.envoy_ports().iter().map(u16::to_string).collect();
        let mut args = vec![
            "holder".to_owned(),
            format!("--name={name}"),
            format!("--envoy-ports={}", ports.join(",")),
            format!("--ca={}", self.pki.ca_cert_path().display()),
            format!("--cert={}", cert.cert_path.display()),
            format!("--key={}", cert.key_path.display()),
            format!("--keys={}", keys.join(",")),
            format!("--out={}", out.display()),
        ];
        if fenced {
            args.push(format!("--fence-url={}", self.fence.url()));
        }
        let clock = match mode {
            Some(mode) => Some(FakeClock::new(self.dir.path(), name, mode)?),
            None => None,
        };
        let mut process = ChildProcess::new(
            format!("holder-{name}"),
            gate_bin()?,
            args,
            self.dir.path().join(format!("holder-{name}.log")),
        );
        for (k, v) in clock.iter().flat_map(FakeClock::env) {
            process = process.env(k, v);
        }
        process.start()?;
        self.holders.push(HolderProc { name: name.into(), process, out, clock });
        Ok(())
    }

    /// Starts the standard workload: `fenced` holders on the mutex keys and `sem`
    /// holders on the semaphore keys. With `clock_steps`, h0 runs with a stepped
    /// wall clock and h1 with stepped wall and monotonic clocks.
    pub fn spawn_workload(&mut self, fenced: usize, sem: usize) -> Result<()> {
        let (m, s) = (self.mutex_keys(), self.sem_keys());
        for i in 0..fenced {
            let mode = clock_mode(&self.opts, i);
            self.spawn_holder_with_clock(&format!("h{i}"), &m, true, mode)?;
        }
        for i in 0..sem {
            self.spawn_holder(&format!("s{i}"), &s, false)?;
        }
        Ok(())
    }

    /// Records a fault that ran from `start_us` until now.
    pub fn note(&self, kind: &str, detail: impl Into<String>, start_us: u64) {
        let f = Fault { kind: kind.into(), detail: detail.into(), start_us, end_us: now_us() };
        tracing::info!(kind = %f.kind, detail = %f.detail, ms = (f.end_us - f.start_us) / 1000, "gate fault");
        self.faults.lock().unwrap_or_else(|p| p.into_inner()).push(f);
    }

    /// Records a window without an etcd majority.
    pub fn note_quorum_loss(&self, start_us: u64, end_us: u64) {
        self.quorum_loss.lock().unwrap_or_else(|p| p.into_inner()).push((start_us, end_us));
    }

    /// Sets every link of arbiter `i`.
    pub fn set_links(&self, i: usize, mode: LinkMode) {
        for p in &self.proxies[i] {
            p.set(mode);
        }
    }

    /// The index of the member that leads, asked directly.
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.etcd.members().iter().enumerate() {
            let Ok(Ok(mut c)) =
                tokio::time::timeout(Duration::from_secs(1), etcd_client::Client::connect([m.client_url()], None))
                    .await
            else {
                continue;
            };
            let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(1), c.status()).await else { continue };
            if s.header().is_some_and(|h| h.member_id() == s.leader()) {
                return Some(i);
            }
        }
        None
    }

    /// The current epoch (advanced by each restore).
    pub fn epoch(&self) -> u64 {
        *self.epoch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a snapshot now, lets the load run for `lost`, then restores it with
    /// the ORIGINAL cluster id (same `--initial-cluster` and token) and runs the
    /// guarded epoch advance. Returns the snapshot revision.
    pub async fn restore(&self, lost: Duration) -> Result<i64> {
        let snap = self.dir.path().join(format!("snap-{}.db", now_us()));
        self.etcd.snapshot_save(&snap).await?;
        let base = snapshot_revision(&snap).await?;
        tokio::time::sleep(lost).await;
        // The old cluster goes away now: cut the arbiters (the only writers) first,
        // so the barrier orders after every commit and nothing lands unrecorded
        // between the barrier and the shutdown.
        let modes: Vec<LinkMode> =
            self.proxies.iter().map(|row| row.first().map_or(LinkMode::Pass, FaultProxy::mode)).collect();
        for i in 0..self.proxies.len() {
            self.set_links(i, LinkMode::Cut);
        }
        self.recorder.barrier(Duration::from_secs(30)).await?;
        self.recorder.stop();
        self.etcd.restore_from(&snap, None).await?;
        self.recorder.new_segment(base);
        for (i, m) in modes.into_iter().enumerate() {
            self.set_links(i, m);
        }
        let expected = self.epoch();
        self.epoch_advance(expected, expected + 1).await?;
        *self.epoch.lock().unwrap_or_else(|p| p.into_inner()) = expected + 1;
        Ok(base)
    }

    /// `lockctl epoch-advance`, retried until it reports success (30 s).
    pub async fn epoch_advance(&self, expected: u64, new: u64) -> Result<()> {
        let end = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let out = tokio::process::Command::new(profile_dir().join("lockctl"))
                .args(["epoch-advance", "--endpoints", &self.etcd.endpoints().join(","), "--root", &self.root])
                .args(["--expected-epoch", &expected.to_string(), "--new-epoch", &new.to_string()])
                .kill_on_drop(true)
                .output()
                .await
                .context("run lockctl (cargo build -p lockmesh-extproc)")?;
            if out.status.success() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= end {
                bail!(
                    "lockctl epoch-advance {expected} -> {new} failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Stops the holders, heals every link, waits for the recorder to catch up and
    /// returns the whole history.
    pub async fn finish(&self) -> Result<History> {
        for h in &self.holders {
            let _ = h.process.resume();
            h.process.kill();
        }
        for i in 0..self.proxies.len() {
            self.set_links(i, LinkMode::Pass);
        }
        self.recorder.barrier(Duration::from_secs(60)).await?;
        self.recorder.stop();
        let (segments, gaps) = self.recorder.take();
        let mut ops = Vec::new();
        for h in &self.holders {
            ops.extend(read_ops(&h.out));
        }
        Ok(History {
            root: self.root.clone(),
            limits: vec![(SEM_PREFIX.to_owned(), SEM_N)],
            segments,
            ops,
            writes: self.store_writes(),
            faults: self.faults.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            quorum_loss: self.quorum_loss.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            gaps,
        })
    }

    /// The writes the store received through the fence, in arrival order.
    pub fn store_writes(&self) -> Vec<StoreWrite> {
        self.store
            .requests()
            .into_iter()
            .filter(|r| r.method != "GET")
            .map(|r| {
                let token =
                    r.headers.iter().find(|(k, _)| k == "x-lock-token").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
                let id = r.path.rsplit('/').next().unwrap_or_default().to_owned();
                StoreWrite { resource: r.path.clone(), lock_key: format!("{MUTEX_PREFIX}/{id}"), token, body: r.body }
            })
            .collect()
    }
}

/// The clock of arbiter or fenced holder `i` under `clock_steps`: the first runs
/// with a stepped wall clock, the second with stepped wall and monotonic clocks.
fn clock_mode(opts: &GateOptions, i: usize) -> Option<ClockMode> {
    match i {
        _ if !opts.clock_steps => None,
        0 => Some(ClockMode::Wall),
        1 => Some(ClockMode::WallAndMonotonic),
        _ => None,
    }
}

/// The revision a snapshot file holds (`etcdutl snapshot status`).
pub async fn snapshot_revision(snap: &std::path::Path) -> Result<i64> {
    let out = tokio::process::Command::new(crate::etcd::etcdutl_bin()?)
        .args(["snapshot", "status", "-w", "json"])
        .arg(snap)
        .output()
        .await?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("etcdutl snapshot status: {}", String::from_utf8_lossy(&out.stderr)))?;
    v["revision"].as_i64().context("snapshot status without revision")
}

/// The `lockmesh-gate` binary (holders run as its `holder` subcommand).
pub fn gate_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("LOCKMESH_GATE_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let p = profile_dir().join("lockmesh-gate");
    if !p.is_file() {
        bail!(
            "lockmesh-gate not built: run cargo build -p lockmesh-tests --bin lockmesh-gate; looked for {}",
            p.display()
        );
    }
    Ok(p)
}
