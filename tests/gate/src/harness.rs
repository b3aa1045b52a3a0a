//! The gate's system under test: a 3-member etcd cluster, two arbiters that reach
//! each member through a [`FaultProxy`], two lock-tier Envoys (each listing both
//! arbiters), a key-value store behind fence-proxy, the history recorder and the
//! holder processes.
//!
//! With [`GateOptions::shards`] (a *rebalance* run, `docs/GATE.md`) that cluster is
//! the coord cluster and each named entity shard is one more etcd cluster (one
//! member each: two cores), reached by each arbiter through its own fault proxy
//! and recorded by its own recorder; every gate key starts on its rendezvous home
//! and [`GateCluster::rebalance`] moves them all between the shards through the
//! real `lockctl shard apply`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use lockmesh_core::shard::ShardMap;
use tempfile::TempDir;

use super::clock::{ClockMode, FakeClock};
use super::faultproxy::{FaultProxy, LinkMode};
use super::history::{now_us, ClientOp, ClusterHistory, Fault, History, Move, Outcome, StoreWrite};
use super::holder::read_ops;
use super::recorder::{EtcdLogin, Recorder, Ticker};
use super::upstream::Upstream;
use lockmesh_devcerts::{DevPki, TEST_TRUST_DOMAIN};
use lockmesh_tests::arbiter::ArbiterProcess;
use lockmesh_tests::envoy::EnvoyProcess;
use lockmesh_tests::etcd::{EtcdCluster, EtcdUsers};
use lockmesh_tests::fence::{ensure_signing_key, FenceProxyProcess, KvStore};
use lockmesh_tests::paths::{profile_dir, temp_dir};
use lockmesh_tests::ports::free_port;
use lockmesh_tests::process::ChildProcess;
use lockmesh_tests::unique_prefix;

/// Lock-key prefix of the gate's fenced mutex keys (`<prefix>/<i>`).
pub const MUTEX_PREFIX: &str = "payments/gate/m";
/// Lock-key prefix of the gate's advisory semaphore keys, N = [`SEM_N`].
pub const SEM_PREFIX: &str = "payments/gate/sem";
/// The environment variable that lets a process accept planted bugs.
pub(crate) const TEST_FAULTS_ENV: &str = "LOCKMESH_TEST_FAULTS";
/// Holders allowed per semaphore key.
pub(crate) const SEM_N: usize = 3;
/// TTL of both gate classes, seconds (a pause "past the TTL" lasts longer).
pub(crate) const GATE_TTL_S: u64 = 3;
/// The lock-key namespace of every gate key: a rebalance moves it (one
/// namespace override), so every gate key changes home at once.
pub(crate) const GATE_NAMESPACE: &str = "payments";
/// The fenced mutex class's lock-delay, seconds: a paused holder's key waits it
/// out after the holder's session expires (`lock_delay_kept`).
pub(crate) const GATE_LOCK_DELAY_S: u64 = 2;
/// The entity shards of [`GateOptions::rebalance`].
pub(crate) const REBALANCE_SHARDS: [&str; 2] = ["shard-a", "shard-b"];
/// How long `lockctl shard apply` waits for holds of moving keys (the gate's
/// holds are short; a paused holder's lasts the TTL).
pub(crate) const MOVE_VERIFY_TIMEOUT_MS: u64 = 10_000;

/// The shipped etcd role (`lockmesh_ops::admin::etcd_roles`) the arbiters log in as.
pub(crate) const ARBITER_ROLE: &str = "lockmesh-arbiter";
/// The shipped role of the gate's `lockctl` config (limit changes, `class apply`):
/// `lockmesh-classes`, as `etcd_roles::COMMAND_ROLES` says.
pub(crate) const OPERATOR_ROLE: &str = "lockmesh-classes";
/// The shipped break-glass role of `lockctl epoch-advance` after a restore, and
/// of `lockctl shard` ([`SHARD_CONFIG`]).
pub(crate) const EPOCH_ROLE: &str = "lockmesh-admin-epoch";
/// The config `lockctl shard` runs with (in the run's directory), logged in as
/// [`EPOCH_ROLE`], as `etcd_roles::COMMAND_ROLES` says: `shard apply`'s soft
/// epoch advance puts each shard's epoch record (`<root>/sys/epoch`).
pub(crate) const SHARD_CONFIG: &str = "lockctl-shard.yaml";
/// The shipped read-only role (read the root, write nothing) the recorder watches as.
pub(crate) const WATCH_ROLE: &str = "lockmesh-admin";

/// Lock-key prefix of the gate's transparent keys (`<prefix>/<i>`): the inbound
/// sidecar derives `payments/gate/t/<id>` from `/orders/<id>`.
pub const TRANSPARENT_PREFIX: &str = "payments/gate/t";
/// How long a transparent holder's long requests stay at the upstream, ms: past
/// the class TTL, so the hold must be renewed while the request runs.
pub(crate) const TRANSPARENT_LONG_MS: u64 = GATE_TTL_S * 1000 + 600;

/// Lock-key prefix of the gate's durable-fairness mutex keys (advisory).
pub const DURABLE_PREFIX: &str = "payments/gate/dur";
/// Prefix of the read-write keys (class `gaterw`, [`RW_N`] slots: a shared hold
/// takes one, an exclusive hold all).
pub const RW_PREFIX: &str = "payments/gate/rw";
/// Slots of a read-write key.
pub(crate) const RW_N: usize = 3;
/// Prefix of the election keys (class `gatelead`, a mutex that fails closed).
pub const LEAD_PREFIX: &str = "payments/gate/lead";
/// The class of the election keys, whose limit a `policy_change` raises to 2
/// (campaigns must then be refused) and sets back to 1.
pub const LEAD_CLASS: &str = "gatelead";
/// Prefix of the multi-key holders' keys (class `gatemk`, an advisory mutex).
pub const MULTI_PREFIX: &str = "payments/gate/mk";
/// Prefix of the reuse holders' keys (class `gatere`, an advisory mutex).
pub const REUSE_PREFIX: &str = "payments/gate/re";
/// Prefix of the permit holders' keys (class `gatepm`, [`PERMITS_N`] slots).
pub const PERMITS_PREFIX: &str = "payments/gate/pm";
/// Slots of a permits key.
pub(crate) const PERMITS_N: usize = 4;
/// The most permits a permit holder asks for at once.
pub(crate) const PERMITS_ASKED: u32 = 3;
/// How long the reuse holders' first acquire waits, ms: longer than the
/// checker's bound on a wait for a free key (`no_waiter_on_a_free_key`).
pub(crate) const REUSE_WAIT_MS: u64 = 5000;
/// The class of the semaphore keys, whose limit a `policy_change` lowers.
pub(crate) const SEM_CLASS: &str = "gatesem";
/// The limit a `policy_change` lowers the semaphore class to.
pub(crate) const SEM_LOWERED: usize = 2;
/// The TTL a `policy_change` raises the fenced mutex class to, seconds.
pub(crate) const GATE_TTL_RAISED_S: u64 = 5;
/// Prefix of the quota holders' keys (class `gateq`, advisory mutex keys of
/// namespace [`QUOTA_NAMESPACE`], whose quotas are [`QUOTA_HOLDS`] and [`QUOTA_WAITERS`]).
pub const QUOTA_PREFIX: &str = "short/gate/q";
/// The quota'd namespace (the lock tier lets the gate's `payments` identities acquire it).
pub const QUOTA_NAMESPACE: &str = "short";
/// The `holds` quota of [`QUOTA_NAMESPACE`].
pub(crate) const QUOTA_HOLDS: usize = 1;
/// The `waiters` quota of [`QUOTA_NAMESPACE`] (each arbiter enforces its share, rounded up).
pub(crate) const QUOTA_WAITERS: usize = 1;
/// Prefix of the fail-open holders' keys (class `gateo`: advisory, `purpose: efficiency`,
/// `on_quorum_loss: open`).
pub const OPEN_PREFIX: &str = "payments/gate/o";
/// Prefix of the shadow holders' key (class `gatesh`, [`SHADOW_N`] slots enforced,
/// a candidate of one slot: evaluated, counted, audited, never enforced).
pub const SHADOW_PREFIX: &str = "payments/gate/sh";
/// The enforced limit of the shadow class (its candidate's is 1).
pub(crate) const SHADOW_N: usize = 2;
/// Prefix of the class-apply holders' keys: class `gatecaa` (TTL 3 s) until a
/// `class_apply` moves it to `gatecab` (TTL 4 s), and back (`super::actions`).
pub const APPLY_PREFIX: &str = "payments/gate/ca";
/// The prefix `class_apply` swaps with [`APPLY_PREFIX`] (no key uses it).
pub(crate) const APPLY_SPARE_PREFIX: &str = "payments/gate/cz";
/// The force-release victim's key: a fenced mutex key (class `gatem`, route
/// `/items/f0`) no other holder uses (`force_release`, `super::actions`).
pub const STICKY_KEY: &str = "payments/gate/m/f0";

/// The gate's registry, with the fenced mutex class at `ttl_m` seconds: that
/// class (with a lock-delay of [`GATE_LOCK_DELAY_S`]), an advisory class of N = 3, a durable-fairness advisory mutex class and
/// the transparent holders' mutex class.
pub(crate) fn gate_registry(ttl_m: u64) -> String {
    format!(
        r#"platform: {{ min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }}
classes:
  - {{ name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: gatem, prefixes: ["{MUTEX_PREFIX}"], ttl_s: {ttl_m}, lock_delay_s: {GATE_LOCK_DELAY_S}, enforcement: advisory,
      risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: {SEM_CLASS}, prefixes: ["{SEM_PREFIX}"], ttl_s: {GATE_TTL_S}, max_holders: {SEM_N}, enforcement: advisory,
      risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: gatedur, prefixes: ["{DURABLE_PREFIX}"], ttl_s: {GATE_TTL_S}, fairness: durable, enforcement: advisory,
      risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: gatet, prefixes: ["{TRANSPARENT_PREFIX}"], ttl_s: {GATE_TTL_S}, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }}
  - {{ name: gaterw, prefixes: ["{RW_PREFIX}"], ttl_s: {GATE_TTL_S}, max_holders: {RW_N}, enforcement: advisory,
      risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: {LEAD_CLASS}, prefixes: ["{LEAD_PREFIX}"], ttl_s: {GATE_TTL_S}, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }}
  - {{ name: gatemk, prefixes: ["{MULTI_PREFIX}"], ttl_s: {GATE_TTL_S}, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }}
  - {{ name: gatere, prefixes: ["{REUSE_PREFIX}"], ttl_s: {GATE_TTL_S}, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }}
  - {{ name: gatepm, prefixes: ["{PERMITS_PREFIX}"], ttl_s: {GATE_TTL_S}, max_holders: {PERMITS_N}, enforcement: advisory,
      risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: gateq, prefixes: ["{QUOTA_PREFIX}"], ttl_s: {GATE_TTL_S}, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }}
  - {{ name: gateo, prefixes: ["{OPEN_PREFIX}"], ttl_s: {GATE_TTL_S}, enforcement: advisory, purpose: efficiency,
      on_quorum_loss: open, risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: gatesh, prefixes: ["{SHADOW_PREFIX}"], ttl_s: {GATE_TTL_S}, max_holders: {SHADOW_N}, candidate: {{ max_holders: 1 }},
      enforcement: advisory, risk_owner: gate, waiver_expiry: "2099-12-31" }}
  - {{ name: gatecaa, prefixes: ["{APPLY_PREFIX}"], ttl_s: {GATE_TTL_S}, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }}
  - {{ name: gatecab, prefixes: ["{APPLY_SPARE_PREFIX}"], ttl_s: 4, enforcement: advisory, risk_owner: gate,
      waiver_expiry: "2099-12-31" }}
quotas:
  namespaces:
    - {{ namespace: {QUOTA_NAMESPACE}, holds: {QUOTA_HOLDS}, waiters: {QUOTA_WAITERS} }}
"#
    )
}

/// Options of a gate cluster.
#[derive(Debug, Clone)]
pub struct GateOptions {
    /// Label of the etcd root.
    pub name: String,
    /// Run etcd plaintext and without auth (every part connecting anonymously)
    /// instead of production's shape (client TLS, auth, the shipped roles: the
    /// default). The twin of the check that a gate member refuses a plaintext,
    /// userless client (`gate_tls`), and the quick gate's etcd: its
    /// `restore_crash` is sealed only by the raft check, which needs etcd's
    /// root-only `Status` (docs/GATE.md "What runs").
    pub plaintext_etcd: bool,
    /// etcd members (3 for the gate; 1 for fast targeted scenarios).
    pub members: usize,
    /// Arbiter processes to start.
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
    /// SDK holders ([`GateCluster::spawn_workload`]: `k0`, `k1`, .. on the fenced
    /// mutex keys, holding through `lockmesh-client`).
    pub sdk_holders: usize,
    /// Python SDK holders (`kpy0`, ..) and Go SDK holders (`kgo0`, ..): the SDK
    /// holders' loop through that language's SDK, by its conformance driver
    /// (`holder --driver`, [`super::polyglot`]), on the fenced mutex keys, holder
    /// i through Envoy i mod n. They run beside the Rust SDK holders: none when
    /// `sdk_holders` is 0.
    pub python_holders: usize,
    /// See [`GateOptions::python_holders`].
    pub go_holders: usize,
    /// Durable-fairness keys.
    pub durable_keys: usize,
    /// Holders on the durable keys ([`GateCluster::spawn_workload`]: `d0`, ..).
    pub durable_holders: usize,
    /// Transparent keys (`payments/gate/t/<i>`).
    pub transparent_keys: usize,
    /// Transparent holders ([`GateCluster::spawn_workload`]: `t0`, ..): requests
    /// through an inbound-sidecar Envoy (listing every arbiter) to the gate's
    /// recording [`Upstream`], which the sidecar holds the key for. With none, no
    /// sidecar runs.
    pub transparent_holders: usize,
    /// Run arbiters 0 and 1 and holders h0 and h1 under libfaketime (wall clock
    /// only for the first of each, wall and monotonic for the second), so the
    /// schedule can step their clocks ([`super::clock`]).
    pub clock_steps: bool,
    /// Entity shards, each a single-member etcd cluster of its own (the coord
    /// cluster is the `members` one). Empty: one cluster backs both tiers.
    pub shards: Vec<String>,
    /// Planted bugs of `lockctl shard apply` (`test_faults` of the config it is
    /// given, e.g. `skip_move_epoch_advance`); sets `LOCKMESH_TEST_FAULTS=1` for it.
    pub move_faults: Vec<String>,
    /// Read-write keys (`payments/gate/rw/<i>`).
    pub rw_keys: usize,
    /// Read-write holders ([`GateCluster::spawn_workload`]: `w0`, ..): shared
    /// holds, and exclusive ones one time in three.
    pub rw_holders: usize,
    /// Election keys (`payments/gate/lead/<i>`).
    pub elections: usize,
    /// Campaigners ([`GateCluster::spawn_workload`]: `e0`, ..): campaign on a
    /// session of their own, lead, resign.
    pub campaigners: usize,
    /// Multi-key keys (`payments/gate/mk/<i>`).
    pub multi_keys: usize,
    /// Multi-key holders (`x0`, ..): two keys in one grant.
    pub multi_holders: usize,
    /// Reuse keys (`payments/gate/re/<i>`).
    pub reuse_keys: usize,
    /// Reuse holders (`u0`, ..): a header-only session reused across its release.
    pub reuse_holders: usize,
    /// Permit holders (`p0`, ..) on one key of [`PERMITS_N`] slots, asking 1 to
    /// [`PERMITS_ASKED`] permits.
    pub permit_holders: usize,
    /// Quota holders (`q0`, ..) on the keys of namespace [`QUOTA_NAMESPACE`]
    /// ([`QUOTA_KEYS`] of them), each hold up to 1 s. This and the next four are
    /// the operator actions' workloads: [`GateCluster::spawn_workload`] starts
    /// them on a three-member cluster only ([`GateCluster::spawn_ops_workload`]).
    pub quota_holders: usize,
    /// Fail-open holders (`o0`, ..) on the keys of the fail-open class.
    pub open_holders: usize,
    /// Shadow holders (`v0`, ..) on the shadow class's one key.
    pub shadow_holders: usize,
    /// Class-apply holders (`c0`, ..) on the keys `class_apply` moves between classes.
    pub apply_holders: usize,
    /// Run the force-release victim (`f0`, `holder --sticky-ms`) on [`STICKY_KEY`].
    pub sticky_holder: bool,
}

/// Keys of the quota holders (`short/gate/q/<i>`).
pub(crate) const QUOTA_KEYS: usize = 4;
/// How long the force-release victim keeps each hold (renewing) before its
/// fenced write, ms: long enough for a force release, the key's lock-delay and
/// a probe's grant and write in between (`super::actions`).
pub(crate) const STICKY_MS: u64 = 10_000;

/// An entity shard of a run with shards: its etcd, recorder and clock ticks.
#[derive(Debug)]
pub struct GateShard {
    /// Its name in the arbiters' `clusters:`.
    pub name: String,
    /// Its fault proxy for each arbiter (`proxies[arbiter]`).
    pub proxies: Vec<FaultProxy>,
    pub recorder: Recorder,
    /// Its single-member etcd cluster.
    pub etcd: EtcdCluster,
    /// Its users of the shipped roles.
    pub users: EtcdUsers,
    /// The gate's own user on it ([`EtcdLogin::gate_marks`]).
    marks: EtcdLogin,
}

/// A holder process and its output.
#[derive(Debug)]
pub struct HolderProc {
    pub name: String,
    pub process: ChildProcess,
    /// Its JSON-lines output.
    pub out: PathBuf,
    /// Its stepped clock, if it runs under libfaketime.
    pub clock: Option<FakeClock>,
}

/// How long a restore's lost stretch may be drawn out waiting for a grant in it
/// ([`GateCluster::restore_unadvanced`]).
pub const LOST_GRANT_WAIT: Duration = Duration::from_secs(10);

/// What [`GateCluster::restore_unadvanced`] did.
#[derive(Debug, Clone, Copy)]
pub struct Restored {
    /// The snapshot's revision.
    pub base: i64,
    /// When the arbiters' links to the restored cluster came back, unix µs.
    pub back_us: u64,
    /// Whether a holder was answered a grant it called after the snapshot (so
    /// the restore lost it).
    pub grant_lost: bool,
}

/// The running system, its recorder and what was injected.
#[derive(Debug)]
pub struct GateCluster {
    /// Holders (dropped first).
    pub holders: Vec<HolderProc>,
    /// The transparent holders' inbound sidecar (if any run).
    pub sidecar: Option<EnvoyProcess>,
    /// The upstream behind it.
    pub upstream: Option<Upstream>,
    pub envoys: Vec<EnvoyProcess>,
    pub arbiters: Vec<ArbiterProcess>,
    /// `proxies[arbiter][member]`.
    pub proxies: Vec<Vec<FaultProxy>>,
    /// The stepped clock of each arbiter that runs under libfaketime.
    pub arbiter_clocks: Vec<Option<FakeClock>>,
    pub fence: FenceProxyProcess,
    /// The store behind it.
    pub store: KvStore,
    /// The history recorder.
    pub recorder: Recorder,
    /// Entity shards (empty unless [`GateOptions::shards`]).
    pub shards: Vec<GateShard>,
    /// etcd (the coord cluster when there are shards).
    pub etcd: EtcdCluster,
    /// The etcd root.
    pub root: String,
    pub pki: DevPki,
    opts: GateOptions,
    faults: Mutex<Vec<Fault>>,
    /// Whether a `policy_change` is in force (limit lowered, TTL raised).
    changed: Mutex<bool>,
    quorum_loss: Mutex<Vec<(u64, u64)>>,
    epoch: Mutex<u64>,
    moves: Mutex<Vec<Move>>,
    /// Fault kinds planted inert ([`GateCluster::plant_inert_faults`]).
    inert: Mutex<Vec<String>>,
    /// The coord cluster's users of the shipped roles.
    users: EtcdUsers,
    /// The gate's own user on the coord cluster ([`EtcdLogin::gate_marks`]).
    marks: EtcdLogin,
    tickers: Vec<Ticker>,
    lockctl_config: PathBuf,
    dir: TempDir,
}

// === impl GateOptions ===

impl GateOptions {
    /// The full gate topology: 3 members, 2 arbiters, 2 Envoys.
    pub fn gate(name: &str) -> Self {
        Self {
            name: name.into(),
            plaintext_etcd: false,
            members: 3,
            arbiters: 2,
            envoys: 2,
            envoy_per_arbiter: false,
            arbiter_faults: Vec::new(),
            fence_accepts_lower: false,
            mutex_keys: 3,
            sem_keys: 2,
            sdk_holders: 2,
            python_holders: 1,
            go_holders: 1,
            durable_keys: 1,
            durable_holders: 2,
            transparent_keys: 2,
            transparent_holders: 2,
            clock_steps: true,
            shards: Vec::new(),
            move_faults: Vec::new(),
            rw_keys: 1,
            rw_holders: 3,
            elections: 1,
            campaigners: 2,
            multi_keys: 3,
            multi_holders: 2,
            reuse_keys: 4,
            reuse_holders: 2,
            permit_holders: 2,
            quota_holders: 2,
            open_holders: 1,
            shadow_holders: 2,
            apply_holders: 1,
            sticky_holder: true,
        }
    }

    /// The gate topology with a coord cluster and two entity shards
    /// ([`REBALANCE_SHARDS`]), on which [`GateCluster::rebalance`] moves the gate keys.
    pub fn rebalance(name: &str) -> Self {
        Self { shards: REBALANCE_SHARDS.iter().map(|s| (*s).to_owned()).collect(), ..Self::gate(name) }
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
        // Production's etcd whatever LOCKMESH_TEST_ETCD says, unless the options ask
        // for plaintext (docs/GATE.md "What runs"): client TLS with the harness CA,
        // auth on, the shipped roles; each gate part logs in as the narrowest user
        // it needs, and every cluster is checked to refuse a client without TLS or
        // a user before anything uses it.
        let builder = |members: usize| {
            let b = EtcdCluster::builder().members(members);
            if opts.plaintext_etcd {
                b.plaintext()
            } else {
                b.secure()
            }
        };
        let (etcd, shard_etcd) = tokio::try_join!(
            builder(opts.members).start(),
            futures::future::try_join_all(opts.shards.iter().map(|_| builder(1).start())),
        )?;
        let root = unique_prefix(&opts.name);
        let users_dir = dir.path().join("etcd-users");
        std::fs::create_dir_all(&users_dir)?;
        let (users, marks) = cluster_logins(&etcd, &root, &users_dir, opts.plaintext_etcd).await?;
        let recorder = Recorder::start(etcd.endpoints(), &root, EtcdLogin::role(&users, WATCH_ROLE)?, marks.clone());
        let mut shards = Vec::new();
        for (name, etcd) in opts.shards.iter().zip(shard_etcd) {
            let (users, marks) = cluster_logins(&etcd, &root, &users_dir, opts.plaintext_etcd).await?;
            let mut proxies = Vec::new();
            for _ in 0..opts.arbiters {
                proxies.push(FaultProxy::start(etcd.members()[0].client_port()).await?);
            }
            let watch = EtcdLogin::role(&users, WATCH_ROLE)?;
            let recorder = Recorder::start(etcd.endpoints(), &root, watch, marks.clone());
            shards.push(GateShard { name: name.clone(), proxies, recorder, etcd, users, marks });
        }
        // Clock ticks order the commits of different clusters (`checker::homes`).
        let tickers: Vec<Ticker> = if shards.is_empty() {
            Vec::new()
        } else {
            std::iter::once((etcd.endpoints(), &marks))
                .chain(shards.iter().map(|s| (s.etcd.endpoints(), &s.marks)))
                .map(|(eps, marks)| Ticker::start(eps, &root, marks.clone()))
                .collect()
        };
        let lockctl_config = write_lockctl_config(dir.path(), &pki, &opts, &etcd, &users, &shards, &root)?;
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
        // The transparent holders' sidecar presents its pod's own SVID to the
        // arbiters, a self client: they list it and carry LockGrants for it.
        let sidecar_svid =
            if opts.transparent_holders > 0 { Some(lockmesh_tests::envoy::sidecar_svid(&pki)?) } else { None };
        let mut arbiters = Vec::new();
        let mut arbiter_clocks = Vec::new();
        for (i, row) in proxies.iter().enumerate() {
            let mut b = ArbiterProcess::builder(&pki)
                .etcd_endpoints(row.iter().map(|p| proxy_url(p, &etcd)).collect())
                .root(&root)
                .registry(gate_registry(GATE_TTL_S))
                .max_wait_ms(5000)
                .extra_yaml(key.arbiter_yaml())
                .extra_yaml(super::actions::operators_yaml(dir.path())?)
                // The fail-open class's trigger at its floor (1 s of failed checks),
                // so a 6 s quorum loss leaves seconds of declared loss.
                .extra_yaml("fail_open: { quorum_loss_after_ms: 1000 }")
                .extra_yaml(format!(
                    "marks_file: {:?}",
                    dir.path().join(format!("marks-{i}.json")).display().to_string()
                ));
            for line in users.arbiter_yaml(ARBITER_ROLE) {
                b = b.etcd_yaml(line);
            }
            if !shards.is_empty() {
                b = b.extra_yaml(shards_yaml(shards.iter().map(|s| {
                    (s.name.as_str(), proxy_url(&s.proxies[i], &s.etcd), s.users.arbiter_yaml(ARBITER_ROLE))
                })));
            }
            if let Some(svid) = &sidecar_svid {
                b = b.inbound_sidecar(&svid.spiffe_id);
            }
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
        let (sidecar, upstream) = if opts.transparent_holders > 0 {
            let upstream = Upstream::start().await?;
            let sidecar = sidecar_builder(&pki, &ports, upstream.port()).start().await?;
            (Some(sidecar), Some(upstream))
        } else {
            (None, None)
        };
        Ok(Self {
            holders: Vec::new(),
            sidecar,
            upstream,
            envoys,
            arbiters,
            proxies,
            arbiter_clocks,
            fence,
            store,
            recorder,
            shards,
            etcd,
            root,
            pki,
            opts,
            faults: Mutex::new(Vec::new()),
            changed: Mutex::new(false),
            quorum_loss: Mutex::new(Vec::new()),
            epoch: Mutex::new(1),
            moves: Mutex::new(Vec::new()),
            inert: Mutex::new(Vec::new()),
            users,
            marks,
            tickers,
            lockctl_config,
            dir,
        })
    }

    /// The run's scratch directory.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The users of the shipped roles on the coord cluster (`None`) or shard
    /// `Some(i)`: how a part or a test logs in as one ([`EtcdLogin::role`],
    /// `EtcdUsers::env` for `lockctl`).
    pub fn etcd_users(&self, pick: Option<usize>) -> &EtcdUsers {
        match pick {
            None => &self.users,
            Some(i) => &self.shards[i].users,
        }
    }

    /// The read-only login (the shipped `lockmesh-admin` role: reads the root,
    /// writes nothing) on the coord cluster (`None`) or shard `Some(i)`: for a
    /// probe that reads records straight from the members.
    pub fn reader(&self, pick: Option<usize>) -> Result<EtcdLogin> {
        EtcdLogin::role(self.etcd_users(pick), WATCH_ROLE)
    }

    /// The gate's own user ([`EtcdLogin::gate_marks`]) on the coord cluster
    /// (`None`) or shard `Some(i)`: for a probe that writes under `<root>/gate/`.
    pub fn marks_login(&self, pick: Option<usize>) -> &EtcdLogin {
        match pick {
            None => &self.marks,
            Some(i) => &self.shards[i].marks,
        }
    }

    /// Checks that every member of every cluster refuses a client without TLS
    /// or a user ([`refuses_plaintext`]), as [`GateCluster::start`] did.
    pub async fn check_etcd_secured(&self) -> Result<()> {
        refuses_plaintext(&self.etcd).await?;
        for s in &self.shards {
            refuses_plaintext(&s.etcd).await.with_context(|| s.name.clone())?;
        }
        Ok(())
    }

    /// The fenced mutex keys.
    pub fn mutex_keys(&self) -> Vec<String> {
        (0..self.opts.mutex_keys).map(|i| format!("{MUTEX_PREFIX}/{i}")).collect()
    }

    /// The semaphore keys.
    pub fn sem_keys(&self) -> Vec<String> {
        (0..self.opts.sem_keys).map(|i| format!("{SEM_PREFIX}/{i}")).collect()
    }

    /// The transparent keys.
    pub fn transparent_keys(&self) -> Vec<String> {
        (0..self.opts.transparent_keys).map(|i| format!("{TRANSPARENT_PREFIX}/{i}")).collect()
    }

    /// The read-write keys.
    pub fn rw_keys(&self) -> Vec<String> {
        (0..self.opts.rw_keys).map(|i| format!("{RW_PREFIX}/{i}")).collect()
    }

    /// The election keys.
    pub fn election_keys(&self) -> Vec<String> {
        (0..self.opts.elections).map(|i| format!("{LEAD_PREFIX}/{i}")).collect()
    }

    /// Starts a read-write holder (`holder --rw`) on `keys`.
    pub fn spawn_rw_holder(&mut self, name: &str, keys: &[String]) -> Result<()> {
        let ports = self.envoy_ports();
        self.spawn_holder_args(name, &ports, keys, false, None, &["--rw".to_owned()])
    }

    /// The multi-key holders' keys.
    pub fn multi_keys(&self) -> Vec<String> {
        (0..self.opts.multi_keys).map(|i| format!("{MULTI_PREFIX}/{i}")).collect()
    }

    /// The reuse holders' keys.
    pub fn reuse_keys(&self) -> Vec<String> {
        (0..self.opts.reuse_keys).map(|i| format!("{REUSE_PREFIX}/{i}")).collect()
    }

    /// Starts a multi-key holder (`holder --multi`) on `keys`.
    pub fn spawn_multi_holder(&mut self, name: &str, keys: &[String]) -> Result<()> {
        let ports = self.envoy_ports();
        self.spawn_holder_args(name, &ports, keys, false, None, &["--multi".to_owned()])
    }

    /// Starts a reuse holder (`holder --reuse`) on `keys`, its first acquire
    /// waiting [`REUSE_WAIT_MS`].
    pub fn spawn_reuse_holder(&mut self, name: &str, keys: &[String]) -> Result<()> {
        let ports = self.envoy_ports();
        let extra = ["--reuse".to_owned(), format!("--wait-ms={REUSE_WAIT_MS}")];
        self.spawn_holder_args(name, &ports, keys, false, None, &extra)
    }

    /// Starts a permit holder (`holder --permits`) on the permits key.
    pub fn spawn_permit_holder(&mut self, name: &str) -> Result<()> {
        let ports = self.envoy_ports();
        let keys = [format!("{PERMITS_PREFIX}/0")];
        self.spawn_holder_args(name, &ports, &keys, false, None, &[format!("--permits={PERMITS_ASKED}")])
    }

    /// Starts a campaigner (`holder --campaign`) on the elections `keys`.
    pub fn spawn_campaigner(&mut self, name: &str, keys: &[String]) -> Result<()> {
        let ports = self.envoy_ports();
        self.spawn_holder_args(name, &ports, keys, false, None, &["--campaign".to_owned()])
    }

    /// Starts a quota holder (`holder --work-ms 1000`) on the quota'd namespace's keys.
    pub fn spawn_quota_holder(&mut self, name: &str) -> Result<()> {
        let ports = self.envoy_ports();
        let keys: Vec<String> = (0..QUOTA_KEYS).map(|i| format!("{QUOTA_PREFIX}/{i}")).collect();
        self.spawn_holder_args(name, &ports, &keys, false, None, &["--work-ms=1000".to_owned()])
    }

    /// Starts a fail-open holder (`holder --open`) on the fail-open class's keys.
    pub fn spawn_open_holder(&mut self, name: &str) -> Result<()> {
        let ports = self.envoy_ports();
        let keys: Vec<String> = (0..2).map(|i| format!("{OPEN_PREFIX}/{i}")).collect();
        let fence = format!("--open-fence-url={}", self.fence.url());
        self.spawn_holder_args(name, &ports, &keys, false, None, &["--open".to_owned(), fence])
    }

    /// Starts a shadow holder on the shadow class's key (plain rounds, holds up to
    /// 800 ms, waits up to 300 ms: shorter than a hold, so a candidate that
    /// decided would refuse).
    pub fn spawn_shadow_holder(&mut self, name: &str) -> Result<()> {
        let ports = self.envoy_ports();
        let keys = [format!("{SHADOW_PREFIX}/0")];
        let extra = ["--work-ms=800".to_owned(), "--wait-ms=300".to_owned()];
        self.spawn_holder_args(name, &ports, &keys, false, None, &extra)
    }

    /// Starts a class-apply holder (plain rounds) on the keys `class_apply` moves.
    pub fn spawn_apply_holder(&mut self, name: &str) -> Result<()> {
        let ports = self.envoy_ports();
        let keys: Vec<String> = (0..2).map(|i| format!("{APPLY_PREFIX}/{i}")).collect();
        self.spawn_holder_args(name, &ports, &keys, false, None, &[])
    }

    /// Starts the force-release victim (`holder --sticky-ms`, fenced) on [`STICKY_KEY`].
    pub fn spawn_sticky_holder(&mut self, name: &str) -> Result<()> {
        let ports = self.envoy_ports();
        let keys = [STICKY_KEY.to_owned()];
        self.spawn_holder_args(name, &ports, &keys, true, None, &[format!("--sticky-ms={STICKY_MS}")])
    }

    /// The durable-fairness keys.
    pub fn durable_keys(&self) -> Vec<String> {
        (0..self.opts.durable_keys).map(|i| format!("{DURABLE_PREFIX}/{i}")).collect()
    }

    /// Envoy listener ports.
    pub(crate) fn envoy_ports(&self) -> Vec<u16> {
        self.envoys.iter().map(EnvoyProcess::listener_port).collect()
    }

    /// Starts a holder process looping over `keys` (fenced writes if `fenced`).
    pub fn spawn_holder(&mut self, name: &str, keys: &[String], fenced: bool) -> Result<()> {
        self.spawn_holder_with_clock(name, keys, fenced, None)
    }

    /// Starts a raw holder on `keys` whose acquires try once (`--wait-ms=0`): an
    /// arbiter answers such an acquire of a held key from its holders as read by
    /// the refused grant, never from its memo of the key's holder, so a try-once
    /// holder beside another meets the other's hold every round it is held.
    pub fn spawn_try_once_holder(&mut self, name: &str, keys: &[String]) -> Result<()> {
        let ports = self.envoy_ports();
        self.spawn_holder_args(name, &ports, keys, false, None, &["--wait-ms=0".to_owned()])
    }

    /// Starts an SDK holder process (`holder --sdk`) looping over `keys`, with
    /// fenced writes, keeping each hold `hold_ms` after its write.
    pub fn spawn_sdk_holder(&mut self, name: &str, keys: &[String], hold_ms: u64) -> Result<()> {
        let ports = self.envoy_ports();
        self.spawn_holder_args(name, &ports, keys, true, None, &["--sdk".to_owned(), format!("--hold-ms={hold_ms}")])
    }

    /// Starts a driver holder (`holder --driver`, [`super::polyglot`]): the SDK
    /// holders' loop through `lang`'s SDK, its endpoint `port` (an Envoy's
    /// listener, or a proxy in front of one), fenced writes if `fenced`, `extra`
    /// arguments after. A missing Python venv or Go toolchain is an error that
    /// names its setup step: never skipped.
    pub fn spawn_driver_holder(
        &mut self,
        name: &str,
        lang: super::polyglot::Lang,
        keys: &[String],
        port: u16,
        fenced: bool,
        extra: &[String],
    ) -> Result<()> {
        lang.driver_command().with_context(|| format!("gate holder {name} ({} SDK)", lang.name()))?;
        let mut args = vec![format!("--driver={}", lang.name())];
        args.extend(extra.iter().cloned());
        self.spawn_holder_args(name, &[port], keys, fenced, None, &args)
    }

    /// The options' Python and Go holders on `keys`, fenced (see
    /// [`GateOptions::python_holders`]).
    fn spawn_driver_holders(&mut self, keys: &[String]) -> Result<()> {
        use super::polyglot::Lang;
        if self.opts.sdk_holders == 0 || keys.is_empty() {
            return Ok(());
        }
        let ports = self.envoy_ports();
        ensure!(!ports.is_empty(), "driver holders need an Envoy");
        let mut n = 0;
        for (lang, count) in [(Lang::Python, self.opts.python_holders), (Lang::Go, self.opts.go_holders)] {
            for i in 0..count {
                let name = format!("{}{i}", lang.label());
                self.spawn_driver_holder(&name, lang, keys, ports[n % ports.len()], true, &[])?;
                n += 1;
            }
        }
        Ok(())
    }

    /// [`GateCluster::spawn_holder`], under libfaketime with a clock in `mode` if given.
    pub(crate) fn spawn_holder_with_clock(
        &mut self,
        name: &str,
        keys: &[String],
        fenced: bool,
        mode: Option<ClockMode>,
    ) -> Result<()> {
        let ports = self.envoy_ports();
        self.spawn_holder_args(name, &ports, keys, fenced, mode, &[])
    }

    /// Starts a transparent holder (`holder --transparent`) sending requests for
    /// `keys` through the inbound sidecar, one in four staying
    /// [`TRANSPARENT_LONG_MS`] at the upstream.
    pub fn spawn_transparent_holder(&mut self, name: &str, keys: &[String]) -> Result<()> {
        let port = self.sidecar.as_ref().context("no inbound sidecar: GateOptions::transparent_holders is 0")?;
        let ports = [port.listener_port()];
        let extra = ["--transparent".to_owned(), format!("--long-ms={TRANSPARENT_LONG_MS}")];
        self.spawn_holder_args(name, &ports, keys, false, None, &extra)
    }

    fn spawn_holder_args(
        &mut self,
        name: &str,
        ports: &[u16],
        keys: &[String],
        fenced: bool,
        mode: Option<ClockMode>,
        extra: &[String],
    ) -> Result<()> {
        let cert = self.pki.client("payments", &format!("gate-{name}"))?;
        let out = self.dir.path().join(format!("ops-{name}.jsonl"));
        let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
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
        args.extend(extra.iter().cloned());
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
    /// holders on the semaphore keys, then the options' SDK holders (on the mutex
    /// keys, fenced), durable-fairness holders (advisory) and transparent holders
    /// (through the inbound sidecar). With
    /// `clock_steps`, h0 runs with a stepped wall clock and h1 with stepped wall
    /// and monotonic clocks; SDK holders keep the real clock (docs/GATE.md).
    pub fn spawn_workload(&mut self, fenced: usize, sem: usize) -> Result<()> {
        let (m, s, d) = (self.mutex_keys(), self.sem_keys(), self.durable_keys());
        for i in 0..fenced {
            let mode = clock_mode(&self.opts, i);
            self.spawn_holder_with_clock(&format!("h{i}"), &m, true, mode)?;
        }
        for i in 0..sem {
            self.spawn_holder(&format!("s{i}"), &s, false)?;
        }
        for i in 0..self.opts.sdk_holders {
            self.spawn_sdk_holder(&format!("k{i}"), &m, 0)?;
        }
        self.spawn_driver_holders(&m)?;
        if !d.is_empty() {
            for i in 0..self.opts.durable_holders {
                self.spawn_holder(&format!("d{i}"), &d, false)?;
            }
        }
        let t = self.transparent_keys();
        if !t.is_empty() {
            for i in 0..self.opts.transparent_holders {
                self.spawn_transparent_holder(&format!("t{i}"), &t)?;
            }
        }
        let rw = self.rw_keys();
        if !rw.is_empty() {
            for i in 0..self.opts.rw_holders {
                self.spawn_rw_holder(&format!("w{i}"), &rw)?;
            }
        }
        let lead = self.election_keys();
        if !lead.is_empty() {
            for i in 0..self.opts.campaigners {
                self.spawn_campaigner(&format!("e{i}"), &lead)?;
            }
        }
        let mk = self.multi_keys();
        if mk.len() > 1 {
            for i in 0..self.opts.multi_holders {
                self.spawn_multi_holder(&format!("x{i}"), &mk)?;
            }
        }
        let re = self.reuse_keys();
        if re.len() > 1 {
            for i in 0..self.opts.reuse_holders {
                self.spawn_reuse_holder(&format!("u{i}"), &re)?;
            }
        }
        for i in 0..self.opts.permit_holders {
            self.spawn_permit_holder(&format!("p{i}"))?;
        }
        // The operator actions' workloads run on the full topology only (three
        // members): the targeted scenarios' one-member runs start them by name.
        if self.opts.members >= 3 {
            self.spawn_ops_workload()?;
        }
        Ok(())
    }

    /// The operator actions' workloads of the options: quota holders (`q*`),
    /// fail-open holders (`o*`), shadow holders (`v*`), class-apply holders
    /// (`c*`) and the force-release victim (`f0`).
    pub fn spawn_ops_workload(&mut self) -> Result<()> {
        for i in 0..self.opts.quota_holders {
            self.spawn_quota_holder(&format!("q{i}"))?;
        }
        for i in 0..self.opts.open_holders {
            self.spawn_open_holder(&format!("o{i}"))?;
        }
        for i in 0..self.opts.shadow_holders {
            self.spawn_shadow_holder(&format!("v{i}"))?;
        }
        for i in 0..self.opts.apply_holders {
            self.spawn_apply_holder(&format!("c{i}"))?;
        }
        if self.opts.sticky_holder {
            self.spawn_sticky_holder("f0")?;
        }
        Ok(())
    }

    /// Raises the fenced mutex class's TTL to `ttl_s` (or sets it back) in every
    /// arbiter's registry file (written whole, then renamed into place) and waits
    /// for the hot reload (a second; 2.5 s allowed).
    pub async fn set_ttl(&self, ttl_s: u64) -> Result<()> {
        let mut text = super::actions::registry_for(&self.root, ttl_s);
        if self.sidecar.is_some() {
            // Without the sidecar's LockGrants the reloaded registry would deny it.
            let id = lockmesh_tests::envoy::sidecar_svid(&self.pki)?.spiffe_id;
            text = lockmesh_tests::arbiter::registry_with_sidecar_grants(&text, self.pki.trust_domain(), &[id])?;
        }
        for a in &self.arbiters {
            let dir = a.config_path().parent().context("arbiter config without a directory")?;
            let tmp = dir.join("registry.yaml.new");
            std::fs::write(&tmp, &text)?;
            std::fs::rename(&tmp, dir.join("registry.yaml"))?;
        }
        tokio::time::sleep(Duration::from_millis(2500)).await;
        Ok(())
    }

    /// `lockctl limit change --class gatesem --to <limit>` on every cluster (a
    /// lowered limit drains, verifies and activates), run again until it reports
    /// success (60 s at most).
    pub async fn set_limit(&self, limit: usize) -> Result<()> {
        self.set_class_limit(SEM_CLASS, limit).await
    }

    /// `lockctl limit change --class <class> --to <limit>` (a raise commits at
    /// once; a lowering drains, verifies and activates), run again until it
    /// reports success (60 s at most).
    pub async fn set_class_limit(&self, class: &str, limit: usize) -> Result<()> {
        let args: Vec<String> = ["limit", "change", "--class", class, "--to", &limit.to_string()]
            .into_iter()
            .map(str::to_owned)
            .chain(["--verify-timeout-ms".to_owned(), MOVE_VERIFY_TIMEOUT_MS.to_string()])
            .collect();
        let end = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (code, out, err) = self.lockctl(&args).await?;
            if code == 0 {
                return Ok(());
            }
            if tokio::time::Instant::now() >= end {
                bail!("lockctl {} did not finish in 60 s: exit {code}: {out}{err}", args.join(" "));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// A `policy_change` step: lowers the semaphore class's limit to
    /// [`SEM_LOWERED`] and raises the fenced mutex class's TTL to
    /// [`GATE_TTL_RAISED_S`], or (the next one) sets both back, while the
    /// holders contend. Recorded as a fault.
    pub async fn policy_change(&self) -> Result<()> {
        let start = now_us();
        let was = *self.changed.lock().unwrap_or_else(|p| p.into_inner());
        let (limit, ttl, lead) = if was { (SEM_N, GATE_TTL_S, 1) } else { (SEM_LOWERED, GATE_TTL_RAISED_S, 2) };
        self.set_limit(limit).await?;
        self.set_ttl(ttl).await?;
        if self.opts.elections > 0 {
            self.set_class_limit(LEAD_CLASS, lead).await?;
        }
        *self.changed.lock().unwrap_or_else(|p| p.into_inner()) = !was;
        self.note(
            "policy_change",
            format!("{SEM_CLASS} limit -> {limit}, gatem ttl_s -> {ttl}, {LEAD_CLASS} limit -> {lead}"),
            start,
        );
        Ok(())
    }

    /// A `sidecar_kill` step: SIGKILL the inbound sidecar while a transparent
    /// request is at the upstream (waiting up to 3 s for one), start it again 1 s
    /// later with the same ports. Its VM's sessions stop being renewed, so its
    /// holds end with them within the TTL; the new process is a new VM.
    pub async fn sidecar_kill(&self) -> Result<()> {
        let start = now_us();
        let (Some(sidecar), Some(upstream)) = (&self.sidecar, &self.upstream) else { return Ok(()) };
        let open = || upstream.seen().iter().filter(|e| e.left_us.is_none()).count();
        let end = tokio::time::Instant::now() + Duration::from_secs(3);
        while open() == 0 && tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let at_upstream = open();
        sidecar.kill();
        tokio::time::sleep(Duration::from_secs(1)).await;
        sidecar.restart().await?;
        self.note(
            "sidecar_kill",
            format!("inbound sidecar killed with {at_upstream} request(s) at the upstream, started again"),
            start,
        );
        Ok(())
    }

    /// A `cluster_partition` step (a run with shards): cut every arbiter's links to
    /// one cluster, the coord cluster or a shard (`Some(i)`), past the TTL, while
    /// keys on the others are held and renewed. Recorded as `<cluster> cut from
    /// every arbiter`.
    pub async fn cluster_partition(&self, pick: Option<usize>) -> Result<()> {
        let start = now_us();
        let (links, name): (Vec<&FaultProxy>, &str) = match pick {
            None => (self.proxies.iter().flatten().collect(), super::history::COORD),
            Some(i) => (self.shards[i].proxies.iter().collect(), self.shards[i].name.as_str()),
        };
        for p in &links {
            p.set(LinkMode::Cut);
        }
        tokio::time::sleep(super::schedule::PAST_TTL).await;
        for p in &links {
            p.set(LinkMode::Pass);
        }
        self.note("cluster_partition", format!("{name} cut from every arbiter"), start);
        Ok(())
    }

    /// Compacts the coord cluster (`None`) or shard `Some(i)` at the revision
    /// its recorder has reached (a barrier first: the recorder has every event up
    /// to it, so its watch never needs a compacted revision), and checks that it
    /// took effect: a read at the revision before is refused as compacted.
    /// Returns that revision.
    pub async fn compact(&self, pick: Option<usize>) -> Result<i64> {
        let (recorder, etcd) = match pick {
            None => (&self.recorder, &self.etcd),
            Some(i) => (&self.shards[i].recorder, &self.shards[i].etcd),
        };
        let rev = recorder.barrier(Duration::from_secs(30)).await?;
        // etcd 3.5 answers Compact to root only.
        let mut c = etcd.client().await?;
        c.compact(rev, None).await.context("compact")?;
        let old = c.get(self.root.as_str(), Some(etcd_client::GetOptions::new().with_revision(rev - 1))).await;
        match old {
            Err(e) if e.to_string().contains("compacted") => Ok(rev),
            other => bail!("compaction at revision {rev} did not take effect: a read at {} gave {other:?}", rev - 1),
        }
    }

    /// Records a fault that ran from `start_us` until now.
    pub fn note(&self, kind: &str, detail: impl Into<String>, start_us: u64) {
        let f = Fault { kind: kind.into(), detail: detail.into(), start_us, end_us: now_us() };
        tracing::info!(kind = %f.kind, detail = %f.detail, ms = (f.end_us - f.start_us) / 1000, "gate fault");
        self.faults.lock().unwrap_or_else(|p| p.into_inner()).push(f);
    }

    /// Records a window without an etcd majority.
    pub(crate) fn note_quorum_loss(&self, start_us: u64, end_us: u64) {
        self.quorum_loss.lock().unwrap_or_else(|p| p.into_inner()).push((start_us, end_us));
    }

    /// Sets every link of arbiter `i` (to every member of every cluster).
    pub fn set_links(&self, i: usize, mode: LinkMode) {
        for p in self.proxies[i].iter().chain(self.shards.iter().map(|s| &s.proxies[i])) {
            p.set(mode);
        }
    }

    /// The index of the member that leads, asked directly: each member's own
    /// `etcd_server_is_leader` gauge on its plain-HTTP metrics listener (as
    /// deploy/base/etcd serves it to probes and Prometheus), which needs no etcd
    /// user. etcd 3.5 answers `Status` to root only, and a login needs a quorum.
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.etcd.members().iter().enumerate() {
            let Ok(Ok(v)) = tokio::time::timeout(Duration::from_secs(1), m.metric("etcd_server_is_leader")).await
            else {
                continue;
            };
            if v == 1.0 {
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
        self.restore_with(lost, None, Duration::ZERO).await
    }

    /// [`GateCluster::restore`], with `etcdutl snapshot restore --bump-revision
    /// <bump> --mark-compacted` if `bump` is given: the restored cluster's
    /// revisions then continue above every revision the lost stretch used, so
    /// only the grant clock and the raft check tell the arbiters it was
    /// restored (`lock::seal`). The arbiters reach the restored cluster
    /// `advance_after` before the epoch advance starts, as they do when an
    /// operator runs `lockctl epoch-advance` once the cluster is up: every grant
    /// in between must be refused.
    pub async fn restore_with(&self, lost: Duration, bump: Option<u64>, advance_after: Duration) -> Result<i64> {
        let restored = self.restore_unadvanced(lost, bump).await?;
        tokio::time::sleep(advance_after).await;
        self.advance_epoch().await?;
        Ok(restored.base)
    }

    /// The first half of [`GateCluster::restore_with`]: snapshot, the lost
    /// stretch, cut, restore and the links back, but no epoch advance: the caller
    /// runs [`GateCluster::advance_epoch`] when it chooses (grants in between must
    /// be refused). The lost stretch lasts `lost` and then, at most
    /// [`LOST_GRANT_WAIT`] more, until a holder is answered a grant it called
    /// after the snapshot: a restore that loses no grant is one the grant clock
    /// rightly does not see (docs/GUARANTEES.md), and checks nothing.
    pub async fn restore_unadvanced(&self, lost: Duration, bump: Option<u64>) -> Result<Restored> {
        // Restoring the coord cluster can take the shard map back behind the
        // shards' home records: a manual repair (docs/SCALE.md), not a gate fault.
        ensure!(self.shards.is_empty(), "a restore of the coord cluster is not run with shards");
        let snap = self.dir.path().join(format!("snap-{}.db", now_us()));
        self.etcd.snapshot_save(&snap).await?;
        let taken = now_us();
        let base = snapshot_revision(&snap).await?;
        tokio::time::sleep(lost).await;
        let lost_grant =
            |o: &ClientOp| o.op == "acquire" && o.outcome == Outcome::Ok && o.token.is_some() && o.call_us >= taken;
        let grant_lost = self.wait_for_op(LOST_GRANT_WAIT, lost_grant).await;
        let modes = self.cut_and_restore(&snap, base, bump).await?;
        for (i, m) in modes.into_iter().enumerate() {
            self.set_links(i, m);
        }
        Ok(Restored { base, back_us: now_us(), grant_lost })
    }

    /// A restore that loses nothing, with the epoch advanced before the arbiters
    /// reach the restored cluster: the arbiters are cut off first, the snapshot
    /// taken after the barrier (so it holds every write and no grant-clock or
    /// revision mark is ahead of it), restored with the original cluster id, and
    /// `lockctl epoch-advance` run before the links come back. Each arbiter then
    /// comes back with the old epoch in its cache and nothing else to tell it of
    /// the restore, until its next seal check or a refused grant reads the record:
    /// only a grant's compare of the epoch record keeps a grant of the old epoch
    /// out in between (`lock::mutex`), deterministically, not by the timing of
    /// an advance against grants in flight. Returns the snapshot revision.
    pub async fn restore_advanced_while_cut(&self) -> Result<i64> {
        ensure!(self.shards.is_empty(), "a restore of the coord cluster is not run with shards");
        let snap = self.dir.path().join(format!("snap-{}.db", now_us()));
        let modes = self.cut_links().await?;
        self.etcd.snapshot_save(&snap).await?;
        let base = snapshot_revision(&snap).await?;
        self.etcd.restore_from(&snap, None).await?;
        self.recorder.new_segment(base, 0);
        self.advance_epoch().await?;
        for (i, m) in modes.into_iter().enumerate() {
            self.set_links(i, m);
        }
        Ok(base)
    }

    /// Cuts every arbiter's links (the only writers) and stops the recorder after
    /// its barrier, so the barrier orders after every commit and nothing lands
    /// unrecorded before the old cluster goes away. Returns the links' modes.
    async fn cut_links(&self) -> Result<Vec<LinkMode>> {
        let modes: Vec<LinkMode> =
            self.proxies.iter().map(|row| row.first().map_or(LinkMode::Pass, FaultProxy::mode)).collect();
        for i in 0..self.proxies.len() {
            self.set_links(i, LinkMode::Cut);
        }
        self.recorder.barrier(Duration::from_secs(30)).await?;
        self.recorder.stop();
        Ok(modes)
    }

    /// [`GateCluster::cut_links`], then the restore of `snap` (revision `base`)
    /// and a new history segment. The links stay cut: returns their modes.
    async fn cut_and_restore(&self, snap: &Path, base: i64, bump: Option<u64>) -> Result<Vec<LinkMode>> {
        let modes = self.cut_links().await?;
        self.etcd.restore_from(snap, bump).await?;
        self.recorder.new_segment(base, bump.map_or(0, |b| i64::try_from(b).unwrap_or(i64::MAX)));
        Ok(modes)
    }

    /// The guarded epoch advance from the current epoch to the next.
    pub async fn advance_epoch(&self) -> Result<()> {
        let expected = self.epoch();
        self.epoch_advance(expected, expected + 1).await?;
        *self.epoch.lock().unwrap_or_else(|p| p.into_inner()) = expected + 1;
        Ok(())
    }

    /// `lockctl epoch-advance`, retried until it reports success (30 s).
    pub async fn epoch_advance(&self, expected: u64, new: u64) -> Result<()> {
        let end = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let out = tokio::process::Command::new(profile_dir().join("lockctl"))
                .args(["epoch-advance", "--endpoints", &self.etcd.endpoints().join(","), "--root", &self.root])
                .args(["--expected-epoch", &expected.to_string(), "--new-epoch", &new.to_string()])
                .envs(self.users.env(EPOCH_ROLE))
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

    /// The last operation holder `name` recorded (its output file, read now).
    pub fn last_op(&self, name: &str) -> Option<ClientOp> {
        let h = self.holders.iter().find(|h| h.name == name)?;
        read_ops(&h.out).pop()
    }

    /// Waits (at most `within`) until some holder has recorded an operation that
    /// satisfies `what`; `Ok(false)` if none did in time.
    pub async fn wait_for_op(&self, within: Duration, what: impl Fn(&ClientOp) -> bool) -> bool {
        let end = tokio::time::Instant::now() + within;
        loop {
            if self.holders.iter().any(|h| read_ops(&h.out).iter().any(&what)) {
                return true;
            }
            if tokio::time::Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Copies the logs of the run's arbiters, Envoys and holders into `dir/logs/`
    /// (a failing history's report: what the arbiters declared and refused is
    /// often the only way to tell a product fault from a checker's).
    pub fn keep_logs(&self, dir: &std::path::Path) -> Result<()> {
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let mut files: Vec<(String, std::path::PathBuf)> = Vec::new();
        files.extend(
            self.arbiters.iter().enumerate().map(|(i, a)| (format!("arbiter-{i}.log"), a.log_path().to_owned())),
        );
        files.extend(self.envoys.iter().enumerate().map(|(i, e)| (format!("envoy-{i}.log"), e.log_path())));
        files.extend(self.holders.iter().map(|h| (format!("holder-{}.log", h.name), h.process.log_path().to_owned())));
        for (name, from) in files {
            if let Err(e) = std::fs::copy(&from, logs.join(&name)) {
                std::fs::write(logs.join(format!("{name}.missing")), format!("{}: {e}\n", from.display()))?;
            }
        }
        Ok(())
    }

    /// Stops the holders, heals every link, waits for the recorder to catch up and
    /// returns the whole history.
    pub async fn finish(&self) -> Result<History> {
        // A driver holder whose driver exited (it cannot start, or it broke) fails
        // the run: its SDK must not drop out of the gate unnoticed.
        for h in self.holders.iter().filter(|h| h.process.command_line().contains(" --driver=")) {
            if let Some(st) = h.process.exit_status() {
                bail!("holder {} exited ({st}) before the run ended: see {}", h.name, h.process.log_path().display());
            }
        }
        for h in &self.holders {
            let _ = h.process.resume();
            h.process.kill();
        }
        for i in 0..self.proxies.len() {
            self.set_links(i, LinkMode::Pass);
        }
        for t in &self.tickers {
            t.stop();
        }
        self.recorder.barrier(Duration::from_secs(60)).await?;
        self.recorder.stop();
        let (segments, mut gaps) = self.recorder.take();
        let mut shards = Vec::new();
        for s in &self.shards {
            s.recorder.barrier(Duration::from_secs(60)).await?;
            s.recorder.stop();
            let (segs, g) = s.recorder.take();
            gaps.extend(g.into_iter().map(|g| format!("{}: {g}", s.name)));
            shards.push(ClusterHistory { name: s.name.clone(), segments: segs });
        }
        let mut ops = Vec::new();
        for h in &self.holders {
            ops.extend(read_ops(&h.out));
        }
        Ok(History {
            root: self.root.clone(),
            limits: vec![
                (SEM_PREFIX.to_owned(), SEM_N),
                (RW_PREFIX.to_owned(), RW_N),
                (PERMITS_PREFIX.to_owned(), PERMITS_N),
                (SHADOW_PREFIX.to_owned(), SHADOW_N),
            ],
            classes: vec![
                (SEM_PREFIX.to_owned(), SEM_CLASS.to_owned()),
                (LEAD_PREFIX.to_owned(), LEAD_CLASS.to_owned()),
                (RW_PREFIX.to_owned(), super::actions::RW_CLASS.to_owned()),
            ],
            quotas: vec![(QUOTA_NAMESPACE.to_owned(), super::actions::quota_bound(self.arbiters.len()))],
            open: vec![OPEN_PREFIX.to_owned()],
            shadow: vec![SHADOW_PREFIX.to_owned()],
            durable: vec![DURABLE_PREFIX.to_owned()],
            delayed: vec![MUTEX_PREFIX.to_owned()],
            elections: vec![LEAD_PREFIX.to_owned()],
            segments,
            shards,
            moves: self.moves.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            ops,
            writes: self.store_writes(),
            upstream: self.upstream.as_ref().map(Upstream::seen).unwrap_or_default(),
            faults: self.faults.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            quorum_loss: self.quorum_loss.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            gaps,
        })
    }

    /// Moves every gate key (namespace [`GATE_NAMESPACE`]) to the other entity
    /// shard through the real `lockctl shard apply` (intent, drain, verify, epochs,
    /// flip, resume): `--assign payments=<other shard>` while the keys are on
    /// their rendezvous home, `--unassign payments` (back) while assigned. An
    /// apply that stops short (exit 2 `held`, 1 etcd) is run again without a
    /// change, which finishes it (60 s at most). Records the move and a
    /// `rebalance` fault.
    pub async fn rebalance(&self) -> Result<Move> {
        ensure!(self.shards.len() >= 2, "a rebalance needs two entity shards (GateOptions::shards)");
        let key = format!("{MUTEX_PREFIX}/0");
        let map = self.shard_map().await?;
        let from = map.home("gatem", &key).context("the shard map homes no gate key")?.to_owned();
        let (change, to) = if map.overrides.contains_key(GATE_NAMESPACE) {
            let mut back = map.clone();
            back.overrides.remove(GATE_NAMESPACE);
            let to = back.home("gatem", &key).context("the shard map homes no gate key")?.to_owned();
            (vec!["--unassign".to_owned(), GATE_NAMESPACE.to_owned()], to)
        } else {
            let to = self.shards.iter().map(|s| s.name.clone()).find(|s| *s != from).context("one shard only")?;
            (vec!["--assign".to_owned(), format!("{GATE_NAMESPACE}={to}")], to)
        };
        ensure!(from != to, "the change would not move {GATE_NAMESPACE} (it is on {from})");
        let start_us = now_us();
        let verify = ["--verify-timeout-ms".to_owned(), MOVE_VERIFY_TIMEOUT_MS.to_string()];
        let mut args: Vec<String> = ["apply".to_owned()].into_iter().chain(change).chain(verify.clone()).collect();
        let end = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut tries = 0;
        loop {
            tries += 1;
            let (code, out, err) = self.lockctl_shard(&args).await?;
            if code == 0 {
                break;
            }
            if tokio::time::Instant::now() >= end {
                bail!(
                    "lockctl shard {} did not finish the move {from} -> {to} in 60 s: exit {code}: {out}{err}",
                    args.join(" ")
                );
            }
            tracing::info!(code, "gate rebalance: lockctl shard apply stopped short; applying again");
            args = ["apply".to_owned()].into_iter().chain(verify.clone()).collect();
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let after = self.shard_map().await?;
        let home = after.home("gatem", &key).unwrap_or_default();
        ensure!(home == to, "after the move the shard map homes {GATE_NAMESPACE} on {home}, not {to}");
        let m = Move {
            namespace: GATE_NAMESPACE.to_owned(),
            from,
            to,
            versions: (map.version, after.version),
            start_us,
            end_us: now_us(),
        };
        self.note(
            "rebalance",
            format!(
                "{}/*: {} -> {} (shard map v{} -> v{}, lockctl shard apply x{tries})",
                m.namespace, m.from, m.to, m.versions.0, m.versions.1
            ),
            start_us,
        );
        self.moves.lock().unwrap_or_else(|p| p.into_inner()).push(m.clone());
        Ok(m)
    }

    /// The coord cluster's current shard map (`lockctl shard show`).
    pub(crate) async fn shard_map(&self) -> Result<ShardMap> {
        let (code, out, err) = self.lockctl_shard(&["show".to_owned()]).await?;
        ensure!(code == 0, "lockctl shard show: exit {code}: {out}{err}");
        let shown: serde_json::Value = serde_json::from_str(out.trim()).context("lockctl shard show output")?;
        serde_json::from_value(shown["map"]["current"].clone()).context("lockctl shard show: map.current")
    }

    /// `lockctl shard <args> --config <the gate's lockctl config>`: exit code,
    /// stdout and stderr.
    async fn lockctl_shard(&self, args: &[String]) -> Result<(i32, String, String)> {
        let args: Vec<String> = std::iter::once("shard".to_owned()).chain(args.iter().cloned()).collect();
        self.lockctl_as(&self.dir.path().join(SHARD_CONFIG), &args).await
    }

    /// `lockctl <args> --config <the gate's lockctl config>` as the gate's
    /// operator: exit code, stdout and stderr.
    async fn lockctl(&self, args: &[String]) -> Result<(i32, String, String)> {
        self.lockctl_as(&self.lockctl_config, args).await
    }

    /// [`GateCluster::lockctl`] with the config at `config`.
    async fn lockctl_as(&self, config: &Path, args: &[String]) -> Result<(i32, String, String)> {
        let mut cmd = tokio::process::Command::new(profile_dir().join("lockctl"));
        cmd.args(args).arg("--config").arg(config);
        cmd.args(["--actor", "lockmesh-gate", "--reason", "gate fault"]).kill_on_drop(true);
        if !self.opts.move_faults.is_empty() {
            cmd.env(TEST_FAULTS_ENV, "1");
        }
        let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
            .await
            .context("lockctl did not return in 90 s")?
            .context("run lockctl (cargo build -p lockmesh-extproc)")?;
        let (stdout, stderr) =
            (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        tracing::debug!(%stdout, %stderr, "lockctl");
        Ok((out.status.code().unwrap_or(-1), stdout, stderr))
    }

    /// Plants fault kinds (by name, `FaultKind::name`) that do nothing: from now
    /// on `schedule::inject` skips their action (the kill, pause, cut, restore,
    /// step or move) and still runs their took-effect probe, which must fail
    /// the run naming the kind. Empty: every kind acts again.
    pub fn plant_inert_faults(&self, kinds: &[&str]) {
        *self.inert.lock().unwrap_or_else(|p| p.into_inner()) = kinds.iter().map(|k| (*k).to_owned()).collect();
    }

    /// Appends `; <seen>` to the detail of the last fault of `kind` recorded (a
    /// took-effect probe saying what it saw, for kinds the harness records).
    pub(crate) fn annotate(&self, kind: &str, seen: &str) {
        let mut faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = faults.iter_mut().rev().find(|f| f.kind == kind) {
            f.detail = format!("{}; {seen}", f.detail);
        }
    }

    /// Whether fault kind `kind` is planted inert.
    pub fn is_inert(&self, kind: &str) -> bool {
        self.inert.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|k| k == kind)
    }

    /// The options the system was started with.
    pub fn options(&self) -> &GateOptions {
        &self.opts
    }

    /// Restores entity shard `i` from `snap` (revision `base`) with its original
    /// cluster id: every arbiter's link to it cut, its recorder stopped after a
    /// barrier (so nothing lands unrecorded before the old data goes away), the
    /// restore, a new segment of its history, the links back as they were. No
    /// epoch advance: see [`GateCluster::shard_epoch_advance`].
    pub(crate) async fn restore_shard(&self, i: usize, snap: &Path, base: i64) -> Result<()> {
        let s = &self.shards[i];
        let modes: Vec<LinkMode> = s.proxies.iter().map(FaultProxy::mode).collect();
        for p in &s.proxies {
            p.set(LinkMode::Cut);
        }
        s.recorder.barrier(Duration::from_secs(30)).await?;
        s.recorder.stop();
        s.etcd.restore_from(snap, None).await?;
        s.recorder.new_segment(base, 0);
        for (p, m) in s.proxies.iter().zip(modes) {
            p.set(m);
        }
        Ok(())
    }

    /// Record `<root>/sys/<name>` (`epoch`, `home`) of entity shard `i`, read
    /// straight from its member.
    pub(crate) async fn shard_record(&self, i: usize, name: &str) -> Result<serde_json::Value> {
        let mut c = self.reader(Some(i))?.connect(&self.shards[i].etcd.endpoints()).await?;
        let r = c.get(format!("{}/sys/{name}", self.root), None).await?;
        let kv = r.kvs().first().with_context(|| format!("{}: no sys/{name} record", self.shards[i].name))?;
        serde_json::from_slice(kv.value()).with_context(|| format!("{}: sys/{name} record", self.shards[i].name))
    }

    /// The guarded epoch advance of entity shard `i` (`lockctl epoch-advance
    /// --expected-epoch <its record's epoch> --epochs-from <the lockctl config>`:
    /// the new epoch comes from the coord cluster's counter, docs/SCALE.md), run
    /// again until it reports success (30 s). Returns the epoch before and after,
    /// read from the record.
    pub(crate) async fn shard_epoch_advance(&self, i: usize) -> Result<(u64, u64)> {
        let before = self.shard_record(i, "epoch").await?["epoch"].as_u64().context("epoch record without epoch")?;
        let end = tokio::time::Instant::now() + Duration::from_secs(30);
        // Every failed run's output, so a failure names its first cause too.
        let mut failed = Vec::new();
        loop {
            let out = tokio::process::Command::new(profile_dir().join("lockctl"))
                .args([
                    "epoch-advance",
                    "--endpoints",
                    &self.shards[i].etcd.endpoints().join(","),
                    "--root",
                    &self.root,
                ])
                .args(["--expected-epoch", &before.to_string(), "--epochs-from"])
                .arg(&self.lockctl_config)
                .envs(self.shards[i].users.env(EPOCH_ROLE))
                .kill_on_drop(true)
                .output()
                .await
                .context("run lockctl (cargo build -p lockmesh-extproc)")?;
            if out.status.success() {
                break;
            }
            failed.push(format!(
                "run {}: {}{}",
                failed.len() + 1,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
            if tokio::time::Instant::now() >= end {
                bail!("lockctl epoch-advance of {} from {before} failed: {}", self.shards[i].name, failed.join("\n"));
            }
            tracing::warn!(shard = %self.shards[i].name, output = %failed.last().map_or("", String::as_str), "lockctl epoch-advance failed; running it again");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let after = self.shard_record(i, "epoch").await?["epoch"].as_u64().context("epoch record without epoch")?;
        Ok((before, after))
    }

    /// `lockctl shard apply` without a change (it finishes an interrupted move
    /// and brings forward a home record behind the map), run again until it
    /// exits 0 (60 s). Returns its output.
    pub(crate) async fn shard_apply_unchanged(&self) -> Result<String> {
        let args = ["apply".to_owned(), "--verify-timeout-ms".to_owned(), MOVE_VERIFY_TIMEOUT_MS.to_string()];
        let end = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (code, out, err) = self.lockctl_shard(&args).await?;
            if code == 0 {
                return Ok(format!("{out}{err}"));
            }
            if tokio::time::Instant::now() >= end {
                bail!("lockctl shard apply (no change) did not finish in 60 s: exit {code}: {out}{err}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The writes the store received through the fence, in arrival order.
    pub(crate) fn store_writes(&self) -> Vec<StoreWrite> {
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

/// The `clusters:` and `tiers:` YAML of a run with shards: each shard reached at
/// the given URL, every shard in the first map's entity tier.
/// The transparent holders' inbound sidecar: the shipped `inbound-sidecar`
/// config listing every arbiter (presenting its pod's own SVID, a self client of
/// theirs: its holds are recorded under that identity), in front of the gate's upstream, its bound
/// route `/orders/{id}` deriving the gate's transparent key `payments/gate/t/<id>`,
/// and its reconcile every second (the shortest allowed), so a reconcile that
/// released an open hold would do so while long requests run.
fn sidecar_builder(pki: &DevPki, arbiters: &[u16], upstream: u16) -> lockmesh_tests::envoy::EnvoyBuilder {
    EnvoyProcess::builder("inbound-sidecar")
        .cert_dir(pki.dir())
        .arbiter_ports(arbiters.iter().copied())
        .upstream_port(upstream)
        .replace(r#""key": "payments/order-{id}""#, format!(r#""key": "{TRANSPARENT_PREFIX}/{{id}}""#))
        .replace(
            r#""arbiter_cluster": "lockmesh_arbiter_calls","#,
            r#""arbiter_cluster": "lockmesh_arbiter_calls", "reconcile_every_ms": 1000,"#,
        )
}

fn shards_yaml<'a>(shards: impl Iterator<Item = (&'a str, String, Vec<String>)>) -> String {
    let (mut yaml, mut names) = (String::from("clusters:\n"), Vec::new());
    for (name, url, lines) in shards {
        yaml.push_str(&format!("  {name}:\n    endpoints: [{url:?}]\n"));
        for line in lines {
            yaml.push_str(&format!("    {line}\n"));
        }
        names.push(name);
    }
    yaml.push_str(&format!("tiers:\n  entity: [{}]", names.join(", ")));
    yaml
}

/// The config `lockctl` is run with: the arbiters' clusters and key root,
/// reached straight (not through the fault proxies: a partitioned arbiter does
/// not partition the operator) as the operators' shipped role on each
/// ([`OPERATOR_ROLE`]), and the planted `lockctl` bugs, if any; and beside it
/// the same as [`EPOCH_ROLE`] for `lockctl shard` ([`SHARD_CONFIG`]).
fn write_lockctl_config(
    dir: &std::path::Path,
    pki: &DevPki,
    opts: &GateOptions,
    etcd: &EtcdCluster,
    users: &EtcdUsers,
    shards: &[GateShard],
    root: &str,
) -> Result<PathBuf> {
    let registry = dir.join("lockctl-registry.yaml");
    std::fs::write(&registry, gate_registry(GATE_TTL_S))?;
    for (role, file) in [(EPOCH_ROLE, SHARD_CONFIG), (OPERATOR_ROLE, "lockctl.yaml")] {
        let mut b = ArbiterProcess::builder(pki)
            .etcd_endpoints(etcd.endpoints())
            .root(root)
            .registry(gate_registry(GATE_TTL_S));
        for line in users.arbiter_yaml(role) {
            b = b.etcd_yaml(line);
        }
        if !shards.is_empty() {
            b = b.extra_yaml(shards_yaml(
                shards.iter().map(|s| (s.name.as_str(), s.etcd.endpoints()[0].clone(), s.users.arbiter_yaml(role))),
            ));
        }
        if !opts.move_faults.is_empty() {
            b = b.extra_yaml(format!("test_faults: [{}]", opts.move_faults.join(", ")));
        }
        std::fs::write(dir.join(file), b.render(free_port(), free_port(), &registry))?;
    }
    Ok(dir.join("lockctl.yaml"))
}

/// A cluster's logins for key root `root`: the shipped roles' users
/// (`EtcdCluster::users_for`, password files in `dir`) and the gate's own
/// ([`EtcdLogin::gate_marks`]); unless `plaintext`, the cluster is first checked
/// to refuse a client without TLS or a user ([`refuses_plaintext`]).
async fn cluster_logins(etcd: &EtcdCluster, root: &str, dir: &Path, plaintext: bool) -> Result<(EtcdUsers, EtcdLogin)> {
    if !plaintext {
        refuses_plaintext(etcd).await.context("the gate's etcd is not production's shape (TLS, auth)")?;
    }
    let users = etcd.users_for(root, dir).await?;
    let marks = EtcdLogin::gate_marks(etcd, root).await?;
    Ok((users, marks))
}

/// Checks that every member of `etcd` refuses a client without TLS or a user:
/// a plaintext (`http://`) client gets no answer to a read within 3 s, and a
/// TLS client without a user is refused with `user name is empty`. A gate whose
/// etcd fell back to plaintext or to no auth fails here.
pub async fn refuses_plaintext(etcd: &EtcdCluster) -> Result<()> {
    for m in etcd.members() {
        let url = format!("http://127.0.0.1:{}", m.client_port());
        let plain = async {
            let mut c = etcd_client::Client::connect([url.as_str()], None).await?;
            c.get("/", None).await.map_err(anyhow::Error::from)
        };
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(3), plain).await {
            bail!("etcd member {} answered a plaintext client without a user at {url}", m.name());
        }
        let ca = etcd.tls().with_context(|| format!("etcd member {} serves no client TLS", m.name()))?;
        let mut c = EtcdLogin::new(Some(&ca.ca), None)?.connect(&[m.client_url()]).await?;
        match tokio::time::timeout(Duration::from_secs(3), c.get("/", None)).await {
            Ok(Err(e)) if e.to_string().contains("user name is empty") => {}
            Ok(Ok(_)) => bail!("etcd member {} answered a TLS client without a user", m.name()),
            other => {
                bail!("etcd member {}: a TLS client without a user got {other:?}, not `user name is empty`", m.name())
            }
        }
    }
    Ok(())
}

/// The URL an arbiter reaches a member through fault proxy `p` with: `https://`
/// when `etcd` serves client TLS. The proxy forwards bytes on 127.0.0.1, which
/// the members' certificate names (SAN 127.0.0.1), so the arbiter's server-name
/// check holds through it.
fn proxy_url(p: &FaultProxy, etcd: &EtcdCluster) -> String {
    let scheme = if etcd.tls().is_some() { "https" } else { "http" };
    format!("{scheme}://127.0.0.1:{}", p.port())
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
pub(crate) async fn snapshot_revision(snap: &std::path::Path) -> Result<i64> {
    let out = tokio::process::Command::new(lockmesh_tests::etcd::etcdutl_bin()?)
        .args(["snapshot", "status", "-w", "json"])
        .arg(snap)
        .output()
        .await?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("etcdutl snapshot status: {}", String::from_utf8_lossy(&out.stderr)))?;
    v["revision"].as_i64().context("snapshot status without revision")
}

/// The `lockmesh-gate` binary (holders run as its `holder` subcommand).
pub(crate) fn gate_bin() -> Result<PathBuf> {
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
