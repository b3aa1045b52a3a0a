//! A whole scenario stack: etcd, arbiter(s), Envoy, a backend and clients.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use lockmesh_tests::Stack;
//! let stack = Stack::builder("grant-and-release")
//!     .envoy_config("lock-tier")
//!     .start()
//!     .await?;
//! let worker = stack.client("payments", "worker")?;
//! let resp = worker.post("/jobs/run", &[]).await?;
//! assert_eq!(resp.status, 200);
//! # Ok(()) }
//! ```
//!
//! Start order: etcd (the binary-wide shared one unless `own_etcd`), the
//! backend and the PKI together; then the stack's etcd users (the shipped roles
//! for its root, [`EtcdCluster::users_for`]; none on a plaintext etcd); then the
//! arbiters (logged in as the arbiter role's user) and Envoy together (their
//! ports are chosen up front, and Envoy is ready before its upstreams are).
//!
//! Identities to the arbiter (docs/DEPLOY.md section 10): the lock tier presents
//! the vouching `envoy-client.pem` (`tls.allowed_clients`); a stack with the
//! inbound sidecar ([`StackBuilder::inbound_sidecar`]) also has the sidecar's own
//! SVID in `tls.self_clients` and LockGrants in its registry, as `scripts/up`
//! configures the quick start.

use std::ops::Deref;
use std::time::Duration;

use anyhow::{Context as _, Result};
use tempfile::TempDir;

use crate::arbiter::{ArbiterProcess, DEFAULT_TEST_REGISTRY};
use crate::backend::Backend;
use crate::certs::{ClientCert, DevPki, TEST_TRUST_DOMAIN};
use crate::client::LockClient;
use crate::envoy::EnvoyProcess;
use crate::etcd::{shared_etcd, EtcdCluster, EtcdUsers};
use crate::latency::LatencyProxy;
use crate::paths::temp_dir;
use crate::ports::free_port;

/// The shipped inbound sidecar's config name: a stack running it is
/// [`StackBuilder::inbound_sidecar`].
pub const INBOUND_SIDECAR: &str = "inbound-sidecar";

/// Options for a [`Stack`].
#[derive(Clone, Debug)]
pub struct StackBuilder {
    name: String,
    envoy_config: Option<String>,
    envoy_concurrency: u32,
    envoy_replacements: Vec<(String, String)>,
    envoy_test_filter: bool,
    registry: String,
    arbiters: usize,
    arbiter_extra_yaml: Vec<String>,
    arbiter_env: Vec<(String, String)>,
    arbiter_tls_reload_ms: Option<u64>,
    max_wait_ms: Option<u64>,
    own_etcd: Option<usize>,
    own_etcd_args: Vec<String>,
    plaintext_etcd: bool,
    secure_etcd: bool,
    root: Option<String>,
    fleet: Option<usize>,
    envoy_arbiters: Vec<(usize, Vec<usize>)>,
    inbound_sidecar: bool,
    arbiter_etcd_latency: bool,
    arbiter_etcd_yaml: Vec<String>,
}

/// A running scenario stack. Drop order: Envoys, arbiters, backend, etcd, PKI.
#[derive(Debug)]
pub struct Stack {
    envoy: Option<EnvoyProcess>,
    /// Envoys 1.. of a fleet ([`StackBuilder::envoys`]).
    more_envoys: Vec<EnvoyProcess>,
    arbiters: Vec<ArbiterProcess>,
    backend: Backend,
    etcd: EtcdHandle,
    users: EtcdUsers,
    root: String,
    pki: DevPki,
    sidecar_svid: Option<ClientCert>,
    latency: Option<LatencyProxy>,
    _pki_dir: TempDir,
    _users_dir: TempDir,
    _watchdog: Watchdog,
}

/// Aborts the process, naming the stack, if a stack lives longer than
/// `LOCKMESH_STACK_WATCHDOG_S` seconds (unset or 0: never; `scripts/test` sets
/// it). A scenario that hangs then fails the run with its name, instead of
/// holding the run until CI's own limit kills it with nothing said.
#[derive(Debug)]
struct Watchdog {
    _stop: Option<std::sync::mpsc::Sender<()>>,
}

impl Watchdog {
    fn start(name: &str) -> Self {
        let limit = std::env::var("LOCKMESH_STACK_WATCHDOG_S").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        if limit == 0 {
            return Self { _stop: None };
        }
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let name = name.to_owned();
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_secs(limit)) {
                eprintln!(
                    "lockmesh-tests watchdog: stack {name:?} of test {test} has run {limit} s \
                     (LOCKMESH_STACK_WATCHDOG_S); aborting the run so that it fails here"
                );
                std::process::abort();
            }
        });
        Self { _stop: Some(tx) }
    }
}

/// The shared etcd or a cluster owned by one stack.
#[derive(Debug)]
pub enum EtcdHandle {
    /// [`shared_etcd`]: never killed by a test.
    Shared(&'static EtcdCluster),
    /// Started for this stack (`own_etcd`); free to kill, pause, restore.
    Owned(EtcdCluster),
}

// === impl StackBuilder ===

impl StackBuilder {
    /// Envoy config `<repo>/envoy-config/<name>.yaml`. Without it no Envoy runs.
    pub fn envoy_config(mut self, name: impl Into<String>) -> Self {
        self.envoy_config = Some(name.into());
        self
    }

    /// The shipped inbound sidecar calls this stack's arbiters: its own certificate
    /// ([`crate::envoy::sidecar_svid`], `payments/store`) is made in the PKI, the
    /// arbiters list it in `tls.self_clients` and their registry gains the test
    /// trust domain's LockGrants ([`crate::arbiter::sidecar_grants`]; with grants
    /// present the arbiter checks them for the lock tier's callers too). Implied
    /// by `envoy_config("inbound-sidecar")`; call it when a scenario starts the
    /// inbound sidecar itself ([`EnvoyProcess::builder`]) against the stack.
    ///
    /// The sidecar is a self client: the arbiter records its holds under the
    /// sidecar's identity, the caller only as `unverified_caller`.
    pub fn inbound_sidecar(mut self) -> Self {
        self.inbound_sidecar = true;
        self
    }

    /// Envoy `--concurrency`. Default 2.
    pub fn envoy_concurrency(mut self, n: u32) -> Self {
        self.envoy_concurrency = n;
        self
    }

    /// Envoys load the test build of the Wasm filter ([`crate::envoy::EnvoyBuilder::test_filter`]).
    pub fn envoy_test_filter(mut self) -> Self {
        self.envoy_test_filter = true;
        self
    }

    /// An extra text replacement in the Envoy config (must match).
    pub fn envoy_replace(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.envoy_replacements.push((from.into(), to.into()));
        self
    }

    /// The registry YAML for the arbiters. Default [`DEFAULT_TEST_REGISTRY`].
    pub fn registry(mut self, yaml: impl Into<String>) -> Self {
        self.registry = yaml.into();
        self
    }

    /// Number of arbiter replicas (same etcd root). Envoy talks to the first.
    /// Default 1.
    pub fn arbiters(mut self, n: usize) -> Self {
        self.arbiters = n;
        self
    }

    /// A raw YAML line appended to every arbiter config.
    pub fn arbiter_extra_yaml(mut self, line: impl Into<String>) -> Self {
        self.arbiter_extra_yaml.push(line.into());
        self
    }

    /// The arbiters' `tls.reload_ms` (how often their listener re-reads its
    /// certificate files). Default: the arbiter's own (5000).
    pub fn arbiter_tls_reload_ms(mut self, ms: u64) -> Self {
        self.arbiter_tls_reload_ms = Some(ms);
        self
    }

    /// The arbiters' `max_wait_ms`. Default 30000.
    pub fn max_wait_ms(mut self, ms: u64) -> Self {
        self.max_wait_ms = Some(ms);
        self
    }

    /// A fleet of `n` Envoys (same config), each with an arbiter cluster listing
    /// every arbiter (one endpoint per arbiter, ring hash on `x-lock-key` as
    /// shipped). Without this call one Envoy talks to the first arbiter only.
    pub fn envoys(mut self, n: usize) -> Self {
        self.fleet = Some(n.max(1));
        self
    }

    /// Envoy `envoy` of a fleet lists only the arbiters `arbiters` (indices), e.g.
    /// to make two Envoys disagree on membership so that two arbiters race for
    /// every key. Implies [`StackBuilder::envoys`] of at least `envoy + 1`.
    pub fn envoy_arbiters(mut self, envoy: usize, arbiters: &[usize]) -> Self {
        self.fleet = Some(self.fleet.unwrap_or(1).max(envoy + 1));
        self.envoy_arbiters.push((envoy, arbiters.to_vec()));
        self
    }

    /// `n` arbiters and `n` Envoys, Envoy i talking to arbiter i only: every
    /// key is granted by two (or more) arbiters racing, whatever the ring hash.
    pub fn envoy_per_arbiter(self, n: usize) -> Self {
        (0..n).fold(self.arbiters(n).envoys(n), |b, i| b.envoy_arbiters(i, &[i]))
    }

    /// An environment variable for every arbiter process.
    pub fn arbiter_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.arbiter_env.push((key.into(), value.into()));
        self
    }

    /// Starts a private etcd cluster of `members` instead of the shared one.
    pub fn own_etcd(mut self, members: usize) -> Self {
        self.own_etcd = Some(members);
        self
    }

    /// One more command-line flag for every member of a private etcd (of
    /// `own_etcd` members, default 1), e.g. `--max-txn-ops=128`.
    pub fn own_etcd_arg(mut self, arg: impl Into<String>) -> Self {
        self.own_etcd_args.push(arg.into());
        self.own_etcd = Some(self.own_etcd.unwrap_or(1));
        self
    }

    /// A private plaintext, unauthenticated etcd ([`crate::EtcdBuilder::plaintext`];
    /// of `own_etcd` members, default 1) whatever `LOCKMESH_TEST_ETCD` says: for a
    /// scenario about such an etcd (its doc comment says why).
    pub fn plaintext_etcd(mut self) -> Self {
        self.plaintext_etcd = true;
        self.own_etcd = Some(self.own_etcd.unwrap_or(1));
        self
    }

    /// A private etcd in production's shape ([`crate::EtcdBuilder::secure`]: TLS,
    /// auth, the shipped roles; of `own_etcd` members, default 1) whatever
    /// `LOCKMESH_TEST_ETCD` says: for a scenario about that shape (the runbooks).
    pub fn secure_etcd(mut self) -> Self {
        self.secure_etcd = true;
        self.own_etcd = Some(self.own_etcd.unwrap_or(1));
        self
    }

    /// The arbiters reach etcd (member 0) through a [`LatencyProxy`] the stack
    /// owns ([`Stack::etcd_latency`]; no delay until the scenario sets one).
    pub fn arbiter_etcd_latency(mut self) -> Self {
        self.arbiter_etcd_latency = true;
        self
    }

    /// One more line of the arbiters' `etcd:` block (e.g. `op_timeout_ms: 5000`).
    pub fn arbiter_etcd_yaml(mut self, line: impl Into<String>) -> Self {
        self.arbiter_etcd_yaml.push(line.into());
        self
    }

    /// The etcd root, instead of a fresh `/t/<name>-<random>`: for a scenario that
    /// prepares other etcd clusters for the same root before the stack starts
    /// (their users: [`EtcdCluster::users_for`]).
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = Some(root.into());
        self
    }

    /// Starts everything and waits until each part is ready.
    pub async fn start(self) -> Result<Stack> {
        let watchdog = Watchdog::start(&self.name);
        let pki_dir = temp_dir("pki-")?;
        let users_dir = temp_dir("etcd-users-")?;
        let etcd = async {
            Ok::<_, anyhow::Error>(match self.own_etcd {
                None => EtcdHandle::Shared(shared_etcd().await),
                Some(n) => {
                    let mut b = EtcdCluster::builder().members(n);
                    for a in &self.own_etcd_args {
                        b = b.arg(a.clone());
                    }
                    if self.plaintext_etcd {
                        b = b.plaintext();
                    } else if self.secure_etcd {
                        b = b.secure();
                    }
                    EtcdHandle::Owned(b.start().await?)
                }
            })
        };
        let pki = async { DevPki::generate(pki_dir.path(), TEST_TRUST_DOMAIN) };
        let (etcd, backend, pki) = tokio::try_join!(etcd, Backend::start(), pki)?;
        let sidecar = self.inbound_sidecar || self.envoy_config.as_deref() == Some(INBOUND_SIDECAR);
        let sidecar_svid = if sidecar { Some(crate::envoy::sidecar_svid(&pki)?) } else { None };

        let (root, users) = match &self.root {
            Some(root) => (root.clone(), etcd.users_for(root, users_dir.path()).await),
            None => match etcd.users_for_new_root(&self.name, users_dir.path()).await {
                Ok((root, users)) => (root, Ok(users)),
                Err(e) => (String::new(), Err(e)),
            },
        };
        let users = users.context("create the stack's etcd users")?;
        let latency = match self.arbiter_etcd_latency {
            true => Some(LatencyProxy::start(etcd.member(0).client_port()).await?),
            false => None,
        };
        let arbiter_etcd = match &latency {
            Some(p) => {
                let scheme = etcd.endpoints().first().and_then(|e| e.split("://").next()).unwrap_or("http").to_owned();
                vec![format!("{scheme}://127.0.0.1:{}", p.port())]
            }
            None => etcd.endpoints(),
        };
        let grpc_ports: Vec<u16> = (0..self.arbiters).map(|_| free_port()).collect();
        let arbiters = grpc_ports.iter().map(|&port| {
            let mut b = ArbiterProcess::builder(&pki)
                .etcd_endpoints(arbiter_etcd.clone())
                .root(&root)
                .registry(&self.registry)
                .grpc_port(port);
            for line in users.arbiter_yaml("lockmesh-arbiter").into_iter().chain(self.arbiter_etcd_yaml.clone()) {
                b = b.etcd_yaml(line);
            }
            if let Some(ms) = self.max_wait_ms {
                b = b.max_wait_ms(ms);
            }
            if let Some(ms) = self.arbiter_tls_reload_ms {
                b = b.tls_reload_ms(ms);
            }
            for line in &self.arbiter_extra_yaml {
                b = b.extra_yaml(line);
            }
            for (k, v) in &self.arbiter_env {
                b = b.env(k, v);
            }
            if let Some(svid) = &sidecar_svid {
                b = b.inbound_sidecar(&svid.spiffe_id);
            }
            b.start()
        });
        let envoy_at = |i: usize| {
            let config = self.envoy_config.clone();
            let (pki, backend, grpc_ports) = (&pki, &backend, &grpc_ports);
            let this = &self;
            async move {
                let Some(config) = config else {
                    return Ok(None);
                };
                let mut b = EnvoyProcess::builder(&config)
                    .concurrency(this.envoy_concurrency)
                    .cert_dir(pki.dir())
                    .upstream_port(backend.port());
                if this.fleet.is_some() {
                    let only = this.envoy_arbiters.iter().rev().find(|(e, _)| *e == i).map(|(_, a)| a);
                    let ports: Vec<u16> = match only {
                        Some(idx) => idx.iter().filter_map(|&a| grpc_ports.get(a).copied()).collect(),
                        None => grpc_ports.clone(),
                    };
                    b = b.arbiter_ports(ports);
                } else if let Some(&port) = grpc_ports.first() {
                    b = b.arbiter_port(port);
                }
                for (from, to) in &this.envoy_replacements {
                    b = b.replace(from, to);
                }
                if this.envoy_test_filter {
                    b = b.test_filter();
                }
                b.start().await.map(Some)
            }
        };
        let envoys = futures::future::try_join_all((0..self.fleet.unwrap_or(1)).map(envoy_at));
        let (arbiters, envoys) = tokio::try_join!(futures::future::try_join_all(arbiters), envoys)
            .with_context(|| format!("start stack {}", self.name))?;
        let mut envoys = envoys.into_iter().flatten();
        let envoy = envoys.next();
        let more_envoys = envoys.collect();
        match self.root.is_none() {
            true => etcd.lend_root(&root),
            false => etcd.share_root(&root),
        }
        Ok(Stack {
            envoy,
            more_envoys,
            arbiters,
            backend,
            etcd,
            users,
            root,
            pki,
            sidecar_svid,
            latency,
            _pki_dir: pki_dir,
            _users_dir: users_dir,
            _watchdog: watchdog,
        })
    }
}

// === impl Stack ===

impl Drop for Stack {
    /// Stops every process that writes to the stack's key root, then gives the
    /// root back ([`EtcdCluster::return_root`]): a later stack on the shared
    /// etcd may get its users, with its keys deleted.
    fn drop(&mut self) {
        self.envoy.take();
        self.more_envoys.clear();
        self.arbiters.clear();
        self.latency.take();
        self.etcd.return_root(&self.root);
    }
}

impl Stack {
    /// A builder; `name` labels the etcd root (`/t/<name>-<random>`).
    pub fn builder(name: impl Into<String>) -> StackBuilder {
        StackBuilder {
            name: name.into(),
            envoy_config: None,
            envoy_concurrency: 2,
            envoy_replacements: Vec::new(),
            envoy_test_filter: false,
            registry: DEFAULT_TEST_REGISTRY.to_owned(),
            arbiters: 1,
            arbiter_extra_yaml: Vec::new(),
            arbiter_env: Vec::new(),
            arbiter_tls_reload_ms: None,
            max_wait_ms: None,
            own_etcd: None,
            own_etcd_args: Vec::new(),
            plaintext_etcd: false,
            secure_etcd: false,
            root: None,
            fleet: None,
            envoy_arbiters: Vec::new(),
            inbound_sidecar: false,
            arbiter_etcd_latency: false,
            arbiter_etcd_yaml: Vec::new(),
        }
    }

    /// The Envoy process.
    ///
    /// # Panics
    ///
    /// If the stack was built without `envoy_config`.
    pub fn envoy(&self) -> &EnvoyProcess {
        match &self.envoy {
            Some(envoy) => envoy,
            None => panic!("this stack has no Envoy: call .envoy_config(..) on the builder"),
        }
    }

    /// The proxy between the arbiters and etcd ([`StackBuilder::arbiter_etcd_latency`]).
    ///
    /// # Panics
    ///
    /// If the stack was built without it.
    pub fn etcd_latency(&self) -> &LatencyProxy {
        match &self.latency {
            Some(p) => p,
            None => panic!("this stack has no etcd latency proxy: call .arbiter_etcd_latency() on the builder"),
        }
    }

    /// Envoy `i` of a fleet (0 is [`Stack::envoy`]).
    ///
    /// # Panics
    ///
    /// If there is no Envoy `i`.
    pub fn envoy_at(&self, i: usize) -> &EnvoyProcess {
        match i {
            0 => self.envoy(),
            _ => match self.more_envoys.get(i - 1) {
                Some(envoy) => envoy,
                None => panic!("this stack has no Envoy {i}: call .envoys(n) on the builder"),
            },
        }
    }

    /// How many Envoys run.
    pub fn envoy_count(&self) -> usize {
        usize::from(self.envoy.is_some()) + self.more_envoys.len()
    }

    /// Arbiter replica `i` (panics if out of range).
    pub fn arbiter(&self, i: usize) -> &ArbiterProcess {
        &self.arbiters[i]
    }

    /// All arbiter replicas.
    pub fn arbiters(&self) -> &[ArbiterProcess] {
        &self.arbiters
    }

    /// The recording upstream.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The etcd cluster (shared or owned).
    pub fn etcd(&self) -> &EtcdCluster {
        &self.etcd
    }

    /// The stack's etcd users: the shipped roles for its root, under unique names.
    pub fn etcd_users(&self) -> &EtcdUsers {
        &self.users
    }

    /// `LOCKMESH_ETCD_*` variables for a child process (lockctl, ...) reaching the
    /// stack's etcd as shipped role `role`'s user ([`EtcdUsers::env`]).
    pub fn etcd_env(&self, role: &str) -> Vec<(String, String)> {
        self.users.env(role)
    }

    /// The etcd key prefix of this stack's arbiters (`etcd.root`).
    pub fn root(&self) -> &str {
        &self.root
    }

    /// Writes class `class`'s authoritative limit straight into its policy record
    /// in etcd, with the change epoch moved on (as `lockctl limit change` leaves an
    /// immediate raise), bypassing the arbiters. Returns the limit it replaced.
    pub async fn write_class_limit(&self, class: &str, limit: u32) -> Result<u64> {
        let mut etcd = self.etcd.client().await?;
        let key = format!("{}/c/{class}", self.root);
        let cur = etcd.get(key.as_str(), None).await?;
        let kv = cur.kvs().first().with_context(|| format!("no policy record for class {class}"))?;
        let mut p: serde_json::Value = serde_json::from_slice(kv.value())?;
        let before = p["limit"].as_u64().context("the policy record has no limit")?;
        let epoch = p["change_epoch"].as_u64().context("the policy record has no change_epoch")?;
        p["limit"] = serde_json::json!(limit);
        p["change_epoch"] = serde_json::json!(epoch + 1);
        etcd.put(key.as_str(), serde_json::to_vec(&p)?, None).await?;
        Ok(before)
    }

    /// The inbound sidecar's own certificate (its pod's SVID, a self client of the
    /// arbiters), if the stack serves one ([`StackBuilder::inbound_sidecar`]).
    pub fn sidecar_svid(&self) -> Option<&ClientCert> {
        self.sidecar_svid.as_ref()
    }

    /// The stack's PKI (trust domain `lockmesh.test`).
    pub fn pki(&self) -> &DevPki {
        &self.pki
    }

    /// A client presenting the workload identity `spiffe://lockmesh.test/ns/<ns>/sa/<sa>`.
    pub fn client(&self, ns: &str, sa: &str) -> Result<LockClient> {
        let cert = self.pki.client(ns, sa)?;
        self.client_with(Some((&cert.cert_path, &cert.key_path)))
    }

    /// Like [`Stack::client`], through Envoy `i` of a fleet.
    pub fn client_at(&self, i: usize, ns: &str, sa: &str) -> Result<LockClient> {
        let cert = self.pki.client(ns, sa)?;
        LockClient::new(
            self.envoy_at(i).listener_port(),
            &self.pki.ca_cert_path(),
            Some((&cert.cert_path, &cert.key_path)),
        )
    }

    /// A client presenting no client certificate.
    pub fn anonymous_client(&self) -> Result<LockClient> {
        self.client_with(None)
    }

    /// A client presenting `spiffe://lockmesh.test/ns/<ns>/sa/<sa>` signed by
    /// the rogue CA.
    pub fn rogue_client(&self, ns: &str, sa: &str) -> Result<LockClient> {
        let cert = self.pki.rogue_as(ns, sa)?;
        self.client_with(Some((&cert.cert_path, &cert.key_path)))
    }

    fn client_with(&self, identity: Option<(&std::path::Path, &std::path::Path)>) -> Result<LockClient> {
        LockClient::new(self.envoy().listener_port(), &self.pki.ca_cert_path(), identity)
    }
}

// === impl EtcdHandle ===

impl Deref for EtcdHandle {
    type Target = EtcdCluster;

    fn deref(&self) -> &EtcdCluster {
        match self {
            EtcdHandle::Shared(cluster) => cluster,
            EtcdHandle::Owned(cluster) => cluster,
        }
    }
}
