//! The load tool's core (`lockmesh-load`, docs/BENCHMARKS.md): C clients run
//! acquire → release cycles for D seconds in three workloads, one after the other,
//! against the same etcd:
//!
//! - `lockmesh`: the full path over mTLS HTTP/2, client → Envoy → Wasm filter →
//!   ext_proc arbiter → etcd. Each client opens its own session first and keeps it
//!   alive every TTL/3 in the background.
//! - `etcd-lock`: etcd's own v3lock service (`Lock` with a lease, then `Unlock`),
//!   each client with its own lease kept alive.
//! - `raw-txn`: the two-writes floor: a put-if-absent transaction on the key with
//!   the client's lease, then a delete; a refused client watches the key for its
//!   delete (1 s poll as a backstop) and tries again.
//! - `lockmesh-oneshot` (by name only): `lockmesh` without a session of its own:
//!   each acquire names no `x-lock-session`, so the arbiter opens one for it, and
//!   the release names the session the answer gave (the header-only path).
//! - `raw-txn-design` (by name only): lockmesh's etcd operations per cycle without
//!   the mesh (the grant's compares, hold and grant-clock puts and raft check; the
//!   release's delete, guard delete and marker): the etcd-side floor of its design.
//! - `raw-txn-marker` (by name only): `raw-txn` whose release transaction also puts
//!   a marker key on the client's lease, as lockmesh's release writes its release
//!   marker; beside `raw-txn` it prices the marker in etcd (docs/DECISIONS.md).
//! - `engine` (by name only): the grant engine (`lockmesh_lock`) in this process,
//!   no Envoy and no arbiter process: each client opens its own session on it
//!   and runs the acquire and release the arbiter would (the [`engine`] module);
//!   the project's own figure of what one transaction per grant costs.
//!
//! Every grant is recorded in grant order per key: tokens must strictly increase
//! per key (and, for `lockmesh` and `raw-txn`, be unique across keys), and where
//! several clients share a key the order of grants shows whether waiters were
//! served first come, first served.
//!
//! # Layout
//! - [`record`]: what one workload run records (latencies, grants, FIFO, errors).
//! - [`report`]: results, ratios and the summary table.
//! - [`cpu`]: CPU time and memory of etcd, Envoy, the arbiter and this process.
//! - [`renewal`]: many holds on few sessions kept alive (`--renewal`); [`scale`]:
//!   the same at scale for minutes, watching for false expiries (`--scale`).
//! - [`etcdwork`]: what etcd did in a window, from its counters; [`prom`]: the
//!   Prometheus text reader it and the scenarios share.
//! - [`engine`]: the `engine` workload's holders and their cycle loop.
//! - `drive`: one client's cycle loop; `lockmesh`, `v3lock`, `txn`, `lease`: the
//!   three workloads' clients.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use tokio::time::Instant;

use lockmesh_devcerts::DevPki;
use lockmesh_tests::stack::Stack;

pub mod cpu;
mod drive;
pub mod engine;
pub mod etcdwork;
mod lease;
mod lockmesh;
pub mod prom;
pub mod recipes;
pub mod record;
pub mod renewal;
pub mod report;
pub mod scale;
pub mod steps;
pub mod tax;
mod txn;
mod v3lock;

pub use self::record::GrantRecord;
pub use self::report::{Percentiles, Report, WorkloadResult};

/// Longest measurement a run accepts per workload (keeps memory and time bounded).
pub(crate) const MAX_SECONDS: f64 = 600.0;
/// Most clients one workload may run.
pub(crate) const MAX_CLIENTS: usize = 1024;
/// How long all clients of a workload may take to connect and open sessions.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);

/// A workload: what one acquire → release cycle goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Workload {
    /// The lock API through Envoy, the Wasm filter and the arbiter.
    Lockmesh,
    /// etcd's v3lock service.
    EtcdLock,
    /// A put-if-absent transaction and a delete.
    RawTxn,
    /// [`Workload::Lockmesh`] without a session of the client's own: the acquire
    /// names none (the arbiter opens one for it), the release names the one the
    /// answer gave (run by name, not in [`Workload::ALL`]).
    LockmeshOneShot,
    /// [`Workload::RawTxn`] whose release also writes a marker key on the
    /// client's lease in the delete's transaction, as lockmesh's release writes
    /// its release marker: the two side by side price the marker (run by name,
    /// not in [`Workload::ALL`]).
    RawTxnMarker,
    /// lockmesh's etcd operations without the mesh (run by name, issue 20's
    /// etcd-side floor): a grant transaction with lockmesh's compares (epoch
    /// record, the key's slots, the session's lease, the grant clock) that puts
    /// the hold and the grant clock, then a `Status` call (the grant-time raft
    /// check); a release transaction that deletes the hold and the lock-delay
    /// guard and puts the release marker.
    RawTxnDesign,
    /// The grant engine in this process (run by name, issue 42's "Now"):
    /// `lockmesh_lock`'s `Tiers` and `Store` as the arbiter connects them, each
    /// client on its own session, no Envoy and no arbiter process.
    Engine,
}

/// How clients map onto keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// C keys, one client each.
    Uncontended,
    /// One key, C clients.
    Hot,
    /// K keys, C clients each.
    Contended,
    /// K keys and C clients in all; each cycle draws its key from a Zipf
    /// distribution over the K keys (`LoadOptions::zipf`, the first key hottest).
    Zipf,
}

/// Keys and clients per key of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Number of keys.
    pub keys: usize,
    /// Clients per key; with `drawn`, the number of clients in all.
    pub per_key: usize,
    /// Each cycle draws its key (`Mode::Zipf`), so no client keeps one.
    pub drawn: bool,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Measured time per workload and mode.
    pub seconds: Duration,
    /// Cycles before the measurement starts (not counted; tokens still checked).
    pub warmup: Duration,
    /// Clients per key (`hot`, `contended`), or keys of one client each (`uncontended`).
    pub concurrency: usize,
    /// Keys in `contended` mode.
    pub keys: usize,
    /// Modes, run in this order.
    pub modes: Vec<Mode>,
    /// Workloads, run in this order within each mode.
    pub workloads: Vec<Workload>,
    /// `x-lock-wait-ms` of lockmesh acquires; every workload gives up an acquire
    /// after this (plus 5 s) and counts an error.
    pub wait_ms: u64,
    /// Speak HTTP/1.1 to the lock tier instead of HTTP/2 (prior knowledge).
    pub http1: bool,
    /// The Zipf exponent of `Mode::Zipf` (1.1 unless given): key i (from 1) is
    /// drawn with weight 1 / i^s.
    pub zipf: f64,
    /// The most holders per key (the class's `max_holders`) on a stack this tool
    /// starts: 1 (a mutex) unless given.
    pub limit: u32,
    /// Open loop: cycles per second offered by all clients together (each client
    /// starts one every clients/rate seconds; a late start goes at once and the
    /// schedule moves on, so no backlog builds). `None`: closed loop.
    pub rate: Option<f64>,
    /// Print a progress line each second on stderr.
    pub progress: bool,
    /// Keep every grant in [`WorkloadResult::grants`] (tests).
    pub keep_grants: bool,
    /// `engine`: the most grants and releases one etcd transaction may carry
    /// (1: one transaction each; [`engine::check_max_group`]).
    pub max_group: u32,
}

/// Where the load goes.
pub struct Target<'a> {
    lock_tier: Option<LockTier<'a>>,
    /// The arbiter's admin port (its `/metrics`), when the tool started the stack.
    arbiter_admin: Option<u16>,
    etcd: EtcdAccess,
    etcd_prefix: String,
    key_namespace: String,
    procs: cpu::Procs,
    /// How the `engine` workload connects (a stack this tool started).
    engine: Option<engine::EngineAccess>,
    /// Every etcd member's pid, when there is more than one (the `cpu` line
    /// counts member 0 only; a note sums them all).
    etcd_pids: Vec<u32>,
}

/// How the etcd workloads reach etcd, and where its counters are read.
#[derive(Clone, Default)]
pub(crate) struct EtcdAccess {
    endpoints: Vec<String>,
    /// TLS and a user (root) on the production-shaped etcd; `None`: plaintext,
    /// no auth.
    options: Option<etcd_client::ConnectOptions>,
    /// etcd's plain-HTTP `/metrics` listener.
    metrics: Option<String>,
}

impl EtcdAccess {
    /// A client of the workloads' own (one per client, as each workload keeps).
    pub(crate) async fn connect(&self) -> Result<etcd_client::Client> {
        etcd_client::Client::connect(&self.endpoints, self.options.clone())
            .await
            .with_context(|| format!("connect to etcd {:?}", self.endpoints))
    }
}

/// The lock-tier Envoy and how clients authenticate to it.
struct LockTier<'a> {
    port: u16,
    ca: PathBuf,
    identity: Identity<'a>,
}

enum Identity<'a> {
    /// One workload identity per client, `load/w<i>`, from the dev PKI.
    PerClient(&'a DevPki),
    /// Every client presents the same certificate.
    Shared { cert: PathBuf, key: PathBuf },
}

/// What one client of a workload needs to know.
#[derive(Clone)]
pub(crate) struct Plan {
    workload: Workload,
    window: Window,
    wait_ms: u64,
    cycles: Arc<AtomicU64>,
    /// Open loop: each client's time between cycle starts.
    every: Option<Duration>,
    /// `Mode::Zipf`: the distribution and the keys each cycle draws from.
    draw: Option<Arc<(Zipf, Vec<String>)>>,
}

/// The measured interval.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Window {
    start: Instant,
    end: Instant,
}

// === impl Workload ===

impl Workload {
    /// Every workload, in the order the tool runs them.
    pub const ALL: [Workload; 3] = [Workload::Lockmesh, Workload::EtcdLock, Workload::RawTxn];

    /// Every workload the command line names: [`Workload::ALL`] and those run
    /// only by name.
    pub const NAMED: [Workload; 7] = [
        Workload::Lockmesh,
        Workload::EtcdLock,
        Workload::RawTxn,
        Workload::RawTxnMarker,
        Workload::RawTxnDesign,
        Workload::LockmeshOneShot,
        Workload::Engine,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Lockmesh => "lockmesh",
            Workload::EtcdLock => "etcd-lock",
            Workload::RawTxn => "raw-txn",
            Workload::RawTxnMarker => "raw-txn-marker",
            Workload::RawTxnDesign => "raw-txn-design",
            Workload::LockmeshOneShot => "lockmesh-oneshot",
            Workload::Engine => "engine",
        }
    }

    /// Whether it goes through the lock tier (Envoy and the arbiter).
    pub fn lock_tier(self) -> bool {
        matches!(self, Workload::Lockmesh | Workload::LockmeshOneShot)
    }

    /// Whether tokens are commit revisions of write transactions, hence unique
    /// per key (a group's grants share one revision across keys, ADR-02).
    /// etcd-lock's token is the Lock response's header revision, which after a
    /// wait is a read's revision: only per-key order holds.
    pub fn tokens_unique(self) -> bool {
        !matches!(self, Workload::EtcdLock)
    }
}

impl FromStr for Workload {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Workload::NAMED.into_iter().find(|w| w.name() == s).with_context(|| {
            format!("unknown workload {s:?}: lockmesh, lockmesh-oneshot, etcd-lock, raw-txn, raw-txn-marker, raw-txn-design or engine")
        })
    }
}

// === impl Mode ===

impl Mode {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Uncontended => "uncontended",
            Mode::Hot => "hot",
            Mode::Contended => "contended",
            Mode::Zipf => "zipf",
        }
    }

    /// Keys and clients per key for `concurrency` and `keys` (see [`LoadOptions`]).
    pub fn shape(self, concurrency: usize, keys: usize) -> Shape {
        match self {
            Mode::Uncontended => Shape { keys: concurrency, per_key: 1, drawn: false },
            Mode::Hot => Shape { keys: 1, per_key: concurrency, drawn: false },
            Mode::Contended => Shape { keys, per_key: concurrency, drawn: false },
            Mode::Zipf => Shape { keys, per_key: concurrency, drawn: true },
        }
    }
}

impl FromStr for Mode {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        [Mode::Uncontended, Mode::Hot, Mode::Contended, Mode::Zipf]
            .into_iter()
            .find(|m| m.name() == s)
            .with_context(|| format!("unknown mode {s:?}: uncontended, hot, contended or zipf"))
    }
}

/// The harness's test registry with the load keys (`load...`) in a class of `limit`
/// holders per key (`--limit`).
pub fn limited_registry(limit: u32) -> String {
    format!(
        "{}  - name: load-limit\n    prefixes: [\"load\"]\n    ttl_s: 15\n    max_holders: {limit}\n    \
         enforcement: advisory\n    risk_owner: lockmesh-load\n    waiver_expiry: \"2099-12-31\"\n",
        lockmesh_tests::arbiter::DEFAULT_TEST_REGISTRY
    )
}

/// Parses a comma-separated list (`"lockmesh,raw-txn"`), refusing duplicates.
pub fn parse_list<T: FromStr<Err = anyhow::Error> + PartialEq>(s: &str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let v: T = part.parse()?;
        ensure!(!out.contains(&v), "{part:?} is listed twice");
        out.push(v);
    }
    ensure!(!out.is_empty(), "the list is empty");
    Ok(out)
}

// === impl Shape ===

impl Shape {
    /// Number of clients.
    pub fn clients(self) -> usize {
        if self.drawn {
            self.per_key
        } else {
            self.keys * self.per_key
        }
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.drawn {
            write!(f, "{}z{}", self.keys, self.per_key)
        } else {
            write!(f, "{}x{}", self.keys, self.per_key)
        }
    }
}

/// Draws key indices from a Zipf distribution over `n` keys: index i (from 0)
/// with weight 1 / (i + 1)^s, by inverting the cumulative weights.
#[derive(Debug)]
pub(crate) struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub(crate) fn new(n: usize, s: f64) -> Self {
        let weights: Vec<f64> = (1..=n.max(1)).map(|i| 1.0 / (i as f64).powf(s)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Self { cdf }
    }

    pub(crate) fn draw(&self) -> usize {
        let u: f64 = rand::random();
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

// === impl LoadOptions ===

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            seconds: Duration::from_secs(10),
            warmup: Duration::from_secs(1),
            concurrency: 8,
            keys: 16,
            modes: vec![Mode::Uncontended],
            workloads: Workload::ALL.to_vec(),
            wait_ms: 30_000,
            http1: false,
            zipf: 1.1,
            limit: 1,
            rate: None,
            progress: false,
            keep_grants: false,
            max_group: engine::ALONE_MAX_GROUP,
        }
    }
}

impl LoadOptions {
    /// Checks the bounds: at most [`MAX_SECONDS`] per workload and
    /// [`MAX_CLIENTS`] clients in any mode.
    pub fn validate(&self) -> Result<()> {
        let secs = self.seconds.as_secs_f64();
        ensure!(secs > 0.0 && secs <= MAX_SECONDS, "seconds: {secs} must be in (0, {MAX_SECONDS}]");
        ensure!(self.warmup.as_secs_f64() <= 60.0, "warmup: at most 60 s");
        ensure!(self.concurrency >= 1, "concurrency: at least 1");
        ensure!(self.keys >= 1, "keys: at least 1");
        ensure!(!self.modes.is_empty(), "modes: none given");
        ensure!(!self.workloads.is_empty(), "workloads: none given");
        ensure!((1..=60_000).contains(&self.wait_ms), "wait_ms: {} must be in 1..=60000", self.wait_ms);
        ensure!(self.zipf.is_finite() && (0.0..=5.0).contains(&self.zipf), "zipf: {} must be in 0..=5", self.zipf);
        ensure!((1..=64).contains(&self.limit), "limit: {} must be in 1..=64", self.limit);
        engine::check_max_group(self.max_group)?;
        if let Some(r) = self.rate {
            ensure!(r.is_finite() && (0.1..=100_000.0).contains(&r), "rate: {r} must be in 0.1..=100000 cycles/s");
        }
        for m in &self.modes {
            let n = m.shape(self.concurrency, self.keys).clients();
            ensure!(n <= MAX_CLIENTS, "{} mode would run {n} clients, above {MAX_CLIENTS}", m.name());
        }
        Ok(())
    }
}

// === impl Target ===

impl<'a> Target<'a> {
    /// A harness stack: its Envoy (one `load/w<i>` identity per client), its etcd,
    /// keys under its root, and its processes for CPU accounting.
    ///
    /// A stack without Envoy (and arbiters) serves the etcd and `engine`
    /// workloads only. The `engine` workload connects as the stack's arbiter
    /// would: its root, its etcd TLS and the shipped arbiter role's user.
    pub fn from_stack(st: &'a Stack) -> Result<Self> {
        let has_envoy = st.envoy_count() > 0;
        let procs = if has_envoy {
            cpu::Procs::of_stack(st)
        } else {
            cpu::Procs {
                etcd: st.etcd().members().first().and_then(|m| m.pid()),
                envoy: None,
                arbiter: st.arbiters().first().and_then(|a| a.pid()),
            }
        };
        let users = st.etcd_users();
        let mut auth = lockmesh_lock::connect::EtcdClientAuth::default();
        if let Some(ca) = users.ca() {
            auth.ca = Some(std::fs::read(ca).with_context(|| format!("read {}", ca.display()))?);
            auth.ca_file = Some(ca.to_path_buf());
        }
        if users.is_secure() {
            let file = users.password_file(engine::ARBITER_ROLE);
            let pw = std::fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))?;
            auth.user = Some((users.user(engine::ARBITER_ROLE), pw.trim().to_owned()));
        }
        let engine = engine::EngineAccess { endpoints: st.etcd().endpoints(), root: st.root().to_owned(), auth };
        Ok(Self {
            arbiter_admin: st.arbiters().first().map(|a| a.admin_port()),
            lock_tier: has_envoy.then(|| LockTier {
                port: st.envoy().listener_port(),
                ca: st.pki().ca_cert_path(),
                identity: Identity::PerClient(st.pki()),
            }),
            etcd: EtcdAccess {
                endpoints: st.etcd().endpoints(),
                // The peers connect as the etcd's root (over TLS with auth on the
                // production-shaped etcd, `--secure-etcd`); lockmesh's arbiter as
                // the shipped least-privilege role the stack made for it.
                options: Some(st.etcd().root_connect_options()?),
                metrics: st.etcd().members().first().map(|m| m.metrics_url()),
            },
            etcd_prefix: format!("{}/load", st.root()),
            key_namespace: "load".into(),
            procs,
            engine: Some(engine),
            etcd_pids: match st.etcd().members() {
                [_] => Vec::new(),
                ms => ms.iter().filter_map(|m| m.pid()).collect(),
            },
        })
    }

    /// An existing deployment on loopback: etcd `endpoints` (plain `http://`), and
    /// optionally the lock tier on `https://localhost:<envoy_port>` with one client
    /// certificate for every client. Keys: `load/...` (see [`Target::with_key_prefix`])
    /// and `/lockmesh-load/...`.
    pub fn external(etcd: Vec<String>, envoy_port: Option<u16>, ca: PathBuf, cert: PathBuf, key: PathBuf) -> Self {
        Self {
            arbiter_admin: None,
            lock_tier: envoy_port.map(|port| LockTier { port, ca, identity: Identity::Shared { cert, key } }),
            etcd: EtcdAccess { metrics: etcd.first().cloned(), endpoints: etcd, options: None },
            etcd_prefix: "/lockmesh-load".into(),
            key_namespace: "load".into(),
            procs: cpu::Procs::default(),
            engine: None,
            etcd_pids: Vec::new(),
        }
    }

    /// Lock keys start with `prefix` (`namespace[/more]`) instead of `load`, e.g. a
    /// prefix the client certificate's identity is granted.
    pub fn with_key_prefix(mut self, prefix: &str) -> Self {
        self.key_namespace = prefix.trim_end_matches('/').to_owned();
        self
    }

    fn key_name(&self, w: Workload, run: &str, mode: Mode, k: usize) -> String {
        match w {
            Workload::Lockmesh => format!("{}/{run}/{}/k{k:04}", self.key_namespace, mode.name()),
            Workload::LockmeshOneShot => format!("{}/{run}/{}/o{k:04}", self.key_namespace, mode.name()),
            Workload::Engine => format!("{}/{run}/{}/e{k:04}", self.key_namespace, mode.name()),
            _ => format!("{}/{run}/{}/{}/k{k:04}", self.etcd_prefix, w.name(), mode.name()),
        }
    }
}

// === impl LockTier ===

impl LockTier<'_> {
    /// Certificate and key of client `i`.
    fn identity(&self, i: usize) -> Result<(PathBuf, PathBuf)> {
        match &self.identity {
            Identity::PerClient(pki) => {
                let c = pki.client("load", &format!("w{i}"))?;
                Ok((c.cert_path, c.key_path))
            }
            Identity::Shared { cert, key } => Ok((cert.clone(), key.clone())),
        }
    }
}

// === impl Window ===

impl Window {
    fn contains(&self, t: Instant) -> bool {
        t >= self.start && t < self.end
    }
}

/// Runs every mode × workload of `opts` against `target`, one after the other.
/// A workload that cannot start is reported as failed; the others still run.
pub async fn run(target: &Target<'_>, opts: &LoadOptions) -> Result<Report> {
    run_noted(target, opts).await.map(|(r, _)| r)
}

/// etcd's count of WAL fsyncs (the count of its fsync duration histogram).
const WAL_FSYNCS: &str = "etcd_disk_wal_fsync_duration_seconds_count";

/// [`run`], and the lines its report's table does not carry, to print after it:
/// etcd's WAL fsyncs per cycle of each workload (`fsyncs ...`), and with the
/// `engine` workload the largest group it ran with (`engine ...`).
pub async fn run_noted(target: &Target<'_>, opts: &LoadOptions) -> Result<(Report, Vec<String>)> {
    opts.validate()?;
    let run_id = format!("{:08x}", rand::random::<u32>());
    let mut results = Vec::new();
    let mut notes = Vec::new();
    for &mode in &opts.modes {
        for &w in &opts.workloads {
            if w.lock_tier() && target.lock_tier.is_none() {
                bail!("the {} workload needs the lock tier (--envoy)", w.name());
            }
            if !w.lock_tier() && target.etcd.endpoints.is_empty() {
                bail!("the {} workload needs etcd endpoints (--etcd)", w.name());
            }
            if w == Workload::Engine && target.engine.is_none() {
                bail!("the engine workload needs a stack this tool starts (not --etcd or --envoy)");
            }
            if w == Workload::Engine && mode == Mode::Zipf {
                let mut r = WorkloadResult::new(mode, w, mode.shape(opts.concurrency, opts.keys));
                r.failed = Some("the engine workload keeps one key per client; zipf mode is not offered".into());
                results.push(r);
                continue;
            }
            let (r, fsyncs, all_etcd) = run_one(target, opts, &run_id, mode, w).await;
            if let Some(ms) = all_etcd {
                notes.push(format!(
                    "etcd-all {} {}: {ms:.3} ms of CPU per cycle over all {} etcd members",
                    mode.name(),
                    w.name(),
                    target.etcd_pids.len()
                ));
            }
            if let Some(f) = fsyncs {
                notes.push(format!(
                    "fsyncs {} {}: {f:.2} etcd WAL fsyncs per cycle (member 0's {WAL_FSYNCS})",
                    mode.name(),
                    w.name()
                ));
            }
            results.push(r);
        }
    }
    if let Some(access) = target.engine.as_ref().filter(|_| opts.workloads.contains(&Workload::Engine)) {
        let login = match &access.auth.user {
            Some(_) => "logged in as the shipped lockmesh-arbiter role",
            None => "no etcd login (plaintext etcd)",
        };
        notes.push(format!(
            "engine: lockmesh_lock in this process (no Envoy, no arbiter process), {login}; \
             at most {} grants and releases per etcd transaction (--max-group; 1 sends each alone)",
            opts.max_group
        ));
    }
    let floor = report::Floor::from_env();
    Ok((Report { run_id, seconds: opts.seconds.as_secs_f64(), rate: opts.rate, results, floor }, notes))
}

/// The `quotas:` section the `engine` workload's registry ends with.
const ENGINE_QUOTAS: &str =
    "quotas:\n  namespaces:\n    - {namespace: load, sessions: 100000, holds: 100000, waiters: 100000, \
                             acquires_per_s: 1000000}\n";

/// The `engine` workload's engine for one run (the registry the stack's arbiter
/// gets for `limit`).
async fn connect_engine(target: &Target<'_>, opts: &LoadOptions) -> Result<Arc<engine::Engine>> {
    let access = target.engine.as_ref().context("no engine access")?;
    let registry = match opts.limit {
        1 => lockmesh_tests::arbiter::DEFAULT_TEST_REGISTRY.to_owned(),
        n => limited_registry(n),
    };
    // The load's namespace gets quotas above any rate a run reaches: the
    // defaults (2,000 acquires a second per arbiter) would cap the engine, and
    // the figure would be the quota's, not the engine's.
    let registry = format!("{registry}{ENGINE_QUOTAS}");
    match tokio::time::timeout(SETUP_TIMEOUT, engine::Engine::connect(access, &registry, opts.max_group)).await {
        Ok(r) => r,
        Err(_) => bail!("not connected within {SETUP_TIMEOUT:?}"),
    }
}

/// CPU ticks (USER_HZ) of every process of `pids`; `None` if one cannot be read.
fn ticks_of(pids: &[u32]) -> Option<u64> {
    pids.iter()
        .map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            // utime and stime: the 12th and 13th fields after the command name.
            let f: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

async fn read_fsyncs(url: Option<&String>) -> Option<u64> {
    let text = etcdwork::metrics_text(url?).await.ok()?;
    etcdwork::counter(&text, WAL_FSYNCS)
}

async fn run_one(
    target: &Target<'_>,
    opts: &LoadOptions,
    run_id: &str,
    mode: Mode,
    workload: Workload,
) -> (WorkloadResult, Option<f64>, Option<f64>) {
    let shape = mode.shape(opts.concurrency, opts.keys);
    let mut result = WorkloadResult::new(mode, workload, shape);
    let engine = match workload {
        Workload::Engine => match connect_engine(target, opts).await {
            Ok(e) => Some(e),
            Err(e) => {
                result.failed = Some(format!("engine: {e:#}"));
                return (result, None, None);
            }
        },
        _ => None,
    };
    let keys: Vec<String> = (0..shape.keys).map(|k| target.key_name(workload, run_id, mode, k)).collect();
    // With more than one holder per key, concurrent grants answer in any order:
    // tokens are then checked for uniqueness, not for order per key.
    let ordered = opts.limit == 1 || !(workload.lock_tier() || workload == Workload::Engine);
    let rec = Arc::new(record::Recorder::new(shape.keys, workload.tokens_unique(), opts.keep_grants).ordered(ordered));
    if opts.progress {
        eprintln!(
            "[{} {}] {} clients on {} keys: connecting",
            mode.name(),
            workload.name(),
            shape.clients(),
            shape.keys
        );
    }
    let setups = (0..shape.clients()).map(|i| {
        let key = &keys[i % shape.keys];
        let (rec, engine) = (rec.clone(), engine.clone());
        drive::Worker::setup(workload, target, i, key, opts, rec, engine)
    });
    let workers = match tokio::time::timeout(SETUP_TIMEOUT, futures::future::try_join_all(setups)).await {
        Ok(Ok(w)) => w,
        Ok(Err(e)) => {
            result.failed = Some(format!("setup: {e:#}"));
            return (result, None, None);
        }
        Err(_) => {
            result.failed = Some(format!("setup: not done within {SETUP_TIMEOUT:?}"));
            return (result, None, None);
        }
    };
    result.http_version = workers.iter().find_map(drive::Worker::http_version);

    let t0 = Instant::now();
    let window = Window { start: t0 + opts.warmup, end: t0 + opts.warmup + opts.seconds };
    let every = opts.rate.map(|r| Duration::from_secs_f64(shape.clients() as f64 / r));
    let draw = shape.drawn.then(|| Arc::new((Zipf::new(shape.keys, opts.zipf), keys.clone())));
    let plan = Plan { workload, window, wait_ms: opts.wait_ms, cycles: Arc::new(AtomicU64::new(0)), every, draw };
    let tasks: Vec<_> = workers
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let key = i % shape.keys;
            let (plan, name, rec) = (plan.clone(), keys[key].clone(), rec.clone());
            tokio::spawn(drive::drive(c, plan, i, key, name, rec))
        })
        .collect();

    tokio::time::sleep_until(window.start).await;
    let c0 = cpu::Sample::take(&target.procs);
    let k0 = ticks_of(&target.etcd_pids).filter(|_| !target.etcd_pids.is_empty());
    let etcd_metrics = target.etcd.metrics.clone();
    let e0 = match &etcd_metrics {
        Some(url) => etcdwork::EtcdCounters::read(url).await,
        None => None,
    };
    let f0 = read_fsyncs(etcd_metrics.as_ref()).await;
    // The arbiter's etcd steps (a stack's own arbiter, lock-tier workloads only).
    let steps_port = target.arbiter_admin.filter(|_| workload.lock_tier());
    let s0 = match steps_port {
        Some(port) => steps::StepCounters::read(port).await,
        None => None,
    };
    let mut tick = window.start;
    let mut last = 0;
    // Zipf (issue 20 item 7): the oldest gated wait, from the arbiter's gauge.
    let gauge_port = target.arbiter_admin.filter(|_| mode == Mode::Zipf && workload.lock_tier());
    while tick < window.end {
        tick = (tick + Duration::from_secs(1)).min(window.end);
        tokio::time::sleep_until(tick).await;
        if let Some(port) = gauge_port {
            if let Some(g) = oldest_gated_s(port).await {
                result.oldest_gated_s = Some(result.oldest_gated_s.map_or(g, |m: f64| m.max(g)));
            }
        }
        let n = plan.cycles.load(Ordering::Relaxed);
        if opts.progress {
            eprintln!(
                "[{} {}] {:>5.1}s  cycles {n:>8}  (+{})",
                mode.name(),
                workload.name(),
                (tick - window.start).as_secs_f64(),
                n - last
            );
        }
        last = n;
    }
    let c1 = cpu::Sample::take(&target.procs);
    let k1 = ticks_of(&target.etcd_pids).filter(|_| !target.etcd_pids.is_empty());
    result.cpu = Some(c1.since(&c0));
    let e1 = match &etcd_metrics {
        Some(url) => etcdwork::EtcdCounters::read(url).await,
        None => None,
    };
    let f1 = read_fsyncs(etcd_metrics.as_ref()).await;
    let s1 = match steps_port {
        Some(port) => steps::StepCounters::read(port).await,
        None => None,
    };

    // Clients finish the cycle they are in; a stuck one is abandoned after the
    // longest acquire wait.
    let drain = Duration::from_millis(opts.wait_ms) + Duration::from_secs(15);
    let joined = tokio::time::timeout(drain, futures::future::join_all(tasks)).await;
    let mut driven = Vec::new();
    match joined {
        Ok(all) => {
            for r in all {
                match r {
                    Ok(d) => driven.push(d),
                    Err(e) => rec.error("client task", &e.to_string()),
                }
            }
        }
        Err(_) => rec.error("drain", "clients still busy after the deadline; abandoned"),
    }
    let mut acquire = Vec::new();
    let mut release = Vec::new();
    let mut closing = Vec::new();
    for d in driven {
        acquire.extend(d.acquire_us);
        release.extend(d.release_us);
        closing.push(d.worker.close());
    }
    futures::future::join_all(closing).await;
    drop(engine);
    result.finish(plan.cycles.load(Ordering::Relaxed), acquire, release, &rec);
    if let (Some(before), Some(after)) = (&e0, &e1) {
        result.etcd = after.per_cycle_since(before, result.cycles);
    }
    if let (Some(before), Some(after)) = (&s0, &s1) {
        result.steps = after.per_cycle_since(before, result.cycles);
    }
    if opts.progress {
        eprintln!("[{} {}] done: {:.1} cycles/s", mode.name(), workload.name(), result.cycles_per_s);
    }
    let fsyncs = match (f0, f1) {
        (Some(a), Some(b)) if result.cycles > 0 => Some(b.saturating_sub(a) as f64 / result.cycles as f64),
        _ => None,
    };
    // USER_HZ is 100 on Linux: a tick is 10 ms.
    let all_etcd = match (k0, k1) {
        (Some(a), Some(b)) if result.cycles > 0 => Some(b.saturating_sub(a) as f64 * 10.0 / result.cycles as f64),
        _ => None,
    };
    (result, fsyncs, all_etcd)
}

/// The largest `lockmesh_arbiter_oldest_gated_wait_seconds` over its label pairs
/// in the arbiter's `/metrics` on `port`; `None` if unreadable.
async fn oldest_gated_s(port: u16) -> Option<f64> {
    let resp = lockmesh_tests::probe::http_get(port, "/metrics").await.ok()?;
    max_gauge(&resp.body, "lockmesh_arbiter_oldest_gated_wait_seconds")
}

/// The largest value of gauge `name` (any labels) in Prometheus text.
fn max_gauge(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter(|rest| rest.starts_with('{') || rest.starts_with(' '))
        .filter_map(|rest| rest.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .reduce(f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gated_gauge_is_read_over_its_label_pairs() {
        let text = "# TYPE lockmesh_arbiter_oldest_gated_wait_seconds gauge\n\
            lockmesh_arbiter_oldest_gated_wait_seconds{namespace=\"load\",class=\"default\"} 0.25\n\
            lockmesh_arbiter_oldest_gated_wait_seconds{namespace=\"other\",class=\"default\"} 1.5\n\
            lockmesh_arbiter_oldest_gated_wait_seconds_other 9\n";
        assert_eq!(max_gauge(text, "lockmesh_arbiter_oldest_gated_wait_seconds"), Some(1.5));
        assert_eq!(max_gauge("", "lockmesh_arbiter_oldest_gated_wait_seconds"), None);
    }

    #[test]
    fn zipf_draws_favour_the_first_keys_and_cover_all() {
        let z = Zipf::new(4, 1.1);
        let mut n = [0u32; 4];
        for _ in 0..20_000 {
            n[z.draw()] += 1;
        }
        // Weights 1, 0.47, 0.30, 0.22 of 1.99: about 50 %, 23 %, 15 %, 11 %.
        assert!(n[0] > n[1] && n[1] > n[2] && n[2] > n[3] && n[3] > 1_000, "{n:?}");
        assert!((9_000..11_000).contains(&n[0]), "{n:?}");
        assert_eq!(Zipf::new(1, 1.1).draw(), 0);
    }
}
