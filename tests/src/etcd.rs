//! Real etcd clusters on loopback ports.
//!
//! [`EtcdCluster::builder`] starts 1 or more members, each with its own client
//! and peer port, data directory and log file. [`shared_etcd`] is one
//! lazily-started member for a whole test binary; tests keep apart by using
//! their own key prefix (etcd's `NewLazyCluster`).
//!
//! Binaries: `ETCD_BIN` (and `ETCDCTL_BIN`, `ETCDUTL_BIN`) or the pinned
//! install in `<repo>/.tools/etcd/usr/bin/` made by `scripts/setup`.
//!
//! # Production's shape (issue #16)
//!
//! The shipped deployment (deploy/, docs/ADMIN.md) runs etcd with client TLS,
//! authentication on and one least-privilege role per component
//! (`lockmesh_ops::admin::etcd_roles::roles`). So does the harness by default
//! (`LOCKMESH_TEST_ETCD` unset or `secure`): every cluster it starts ([`shared_etcd`], [`EtcdCluster::builder`],
//! `StackBuilder::own_etcd`) serves client TLS with a harness CA ([`harness_pki`])
//! and has auth on with a random root password; [`EtcdCluster::client`] then logs
//! in as root, and [`EtcdCluster::users_for`] creates the shipped roles for one
//! key root under unique names ([`EtcdUsers`]), which the processes a test starts
//! log in as (on the shared etcd, users made when it starts:
//! [`EtcdCluster::users_for_new_root`]). `LOCKMESH_TEST_ETCD=plain` runs everything
//! against a plaintext, unauthenticated etcd instead; a test about such an etcd
//! asks for it with [`EtcdBuilder::plaintext`] whatever the switch says.
//!
//! # Secret volumes (an etcd CA roll)
//!
//! [`EtcdBuilder::secret_volumes`] runs the members as deploy/base/etcd does with
//! its Secret mounted at `/etc/etcd/tls`: each member reads `tls.crt` and
//! `tls.key` (its certificate for clients and peers) and `ca.crt` (the CA its
//! peers must chain to) from its own directory in the kubelet's layout
//! ([`EtcdMember::tls_dir`], a [`SecretDir`]), and the bundle the harness's own
//! clients and [`EtcdUsers`] trust is a Secret directory too
//! ([`EtcdCluster::client_ca_dir`]). A test rolls the CA by swapping those
//! directories and restarting members (docs/OPERATIONS.md, "Rolling the CA").

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use etcd_client::Permission;
use lockmesh_ops::admin::etcd_roles::{roles, Perm};
use tempfile::TempDir;
use tokio::sync::OnceCell;

use crate::certs::{DevPki, TEST_TRUST_DOMAIN};
use crate::kubelet::{Files, SecretDir};
use crate::paths::{repo_root, temp_dir, tool};
use crate::ports::free_port;
use crate::probe::http_get_within;
use crate::process::ChildProcess;

/// How long a member (or the whole cluster) may take to report healthy.
pub const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// etcd's backend quota in the harness (`--quota-backend-bytes`): 2 GiB, etcd's
/// default and what deploy/base/etcd sets, stated so tests and `lockctl doctor`
/// can compare against it.
pub const QUOTA_BACKEND_BYTES: u64 = 2 * 1024 * 1024 * 1024;

/// How many key roots the shared etcd prepares users for at start, under auth
/// ([`EtcdCluster::users_for_new_root`]). Past them, roots of stacks that have
/// ended are wiped and handed out again, so no user is created while arbiters
/// run. etcd 3.5 rebuilds its permission cache for every user on each auth
/// write, so filling takes time quadratic in this number (224: 31 s, 320: 61 s
/// on a developer machine); recycling keeps it small.
const SHARED_USER_POOL: usize = 160;

/// How long `stop()` waits after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// A member's certificate in its secret directory ([`EtcdBuilder::secret_volumes`]),
/// as deploy/base/etcd names it: `--cert-file` and `--peer-cert-file`.
pub const TLS_CERT: &str = "tls.crt";
/// A member's key in its secret directory: `--key-file` and `--peer-key-file`.
pub const TLS_KEY: &str = "tls.key";
/// The CA bundle in a secret directory: a member's `--peer-trusted-ca-file`; in
/// [`EtcdCluster::client_ca_dir`], the bundle clients verify the members with.
pub const TLS_CA: &str = "ca.crt";

/// A running etcd cluster; members are killed on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
    token: String,
    initial_cluster: String,
    client_tls: Option<EtcdTls>,
    /// The clients' bundle directory ([`EtcdBuilder::secret_volumes`]).
    client_ca_dir: Option<PathBuf>,
    /// The root user's password when the harness turned auth on ([`EtcdBuilder::secure`]).
    root_password: Option<String>,
    /// Key roots whose users already exist, not yet handed out
    /// ([`EtcdCluster::users_for_new_root`]).
    pool: std::sync::Mutex<Vec<PooledUsers>>,
    /// Key roots handed out or created here, so a second [`EtcdCluster::users_for`]
    /// of the same root reuses its users instead of changing etcd's auth.
    made: std::sync::Mutex<Vec<PooledUsers>>,
    /// Roots handed out by [`EtcdCluster::users_for_new_root`] to stacks
    /// ([`EtcdCluster::lend_root`]) and how many live stacks use each.
    lent: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    /// Lent roots whose last stack has ended: their users are handed out again,
    /// after their keys are deleted, once the pool is empty.
    returned: std::sync::Mutex<Vec<PooledUsers>>,
    // Dropped after the members (fields drop in declaration order).
    _dir: TempDir,
}

/// How a cluster is secured.
#[derive(Clone, Debug)]
enum Security {
    /// Whatever `LOCKMESH_TEST_ETCD` says ([`secure_by_default`]).
    Default,
    /// Plaintext, no auth.
    Plain,
    /// Client TLS with the given files, auth left to the test.
    Tls(EtcdTls),
    /// Client TLS with the harness CA, auth on, root logged in by [`EtcdCluster::client`].
    Secure,
}

/// Whether clusters run secured unless a test says otherwise: `LOCKMESH_TEST_ETCD`
/// is `secure` (TLS + auth + roles; the default, production's shape) or `plain`
/// (plaintext, no auth: to tell a fault of the secured path from one of the
/// protocol); anything else is refused so a typo cannot silently test plaintext.
///
/// # Panics
///
/// On any other value of `LOCKMESH_TEST_ETCD`.
pub fn secure_by_default() -> bool {
    match std::env::var("LOCKMESH_TEST_ETCD").as_deref() {
        Ok("secure") | Ok("") | Err(_) => true,
        Ok("plain") => false,
        Ok(other) => panic!("LOCKMESH_TEST_ETCD={other:?}: expected plain or secure"),
    }
}

/// The binary-wide PKI whose CA signs every harness etcd's server certificate
/// (`arbiter.pem`: SAN 127.0.0.1), generated once in the scratch directory.
///
/// # Panics
///
/// If it cannot be generated (no scratch directory).
pub fn harness_pki() -> &'static DevPki {
    static PKI: std::sync::OnceLock<DevPki> = std::sync::OnceLock::new();
    PKI.get_or_init(|| {
        // Kept for the binary's lifetime; the next binary's sweep removes it.
        let pki = temp_dir("etcd-pki-").and_then(|dir| DevPki::generate(dir.keep(), TEST_TRUST_DOMAIN));
        match pki {
            Ok(pki) => pki,
            Err(e) => panic!("cannot generate the harness etcd PKI: {e:#}"),
        }
    })
}

/// The harness etcd's JWT signing key pair (ES256; private key PKCS#8 PEM, public
/// key SPKI PEM), made once per test binary next to [`harness_pki`].
fn harness_jwt_keys() -> &'static (PathBuf, PathBuf) {
    static KEYS: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        let make = || -> Result<(PathBuf, PathBuf)> {
            let dir = temp_dir("etcd-jwt-")?.keep();
            let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
            let (private, public) = (dir.join("jwt.key"), dir.join("jwt.pub"));
            std::fs::write(&private, key.serialize_pem())?;
            std::fs::write(&public, key.public_key_pem())?;
            Ok((private, public))
        };
        make().unwrap_or_else(|e| panic!("cannot generate the harness etcd JWT key: {e:#}"))
    })
}

fn harness_tls() -> EtcdTls {
    let pki = harness_pki();
    let server = pki.arbiter_server();
    EtcdTls { cert: server.cert_path, key: server.key_path, ca: pki.ca_cert_path() }
}

/// Options for [`EtcdCluster`].
#[derive(Clone, Debug)]
pub struct EtcdBuilder {
    members: usize,
    token: Option<String>,
    heartbeat_ms: u64,
    election_ms: u64,
    extra_args: Vec<String>,
    security: Security,
    secret_volumes: bool,
}

/// Client TLS of an etcd cluster (ADR-05): server certificate, key and the CA
/// clients trust.
#[derive(Clone, Debug)]
pub struct EtcdTls {
    /// Server certificate PEM (SAN 127.0.0.1).
    pub cert: PathBuf,
    /// Server key PEM.
    pub key: PathBuf,
    /// CA that signed `cert` (what clients pass as their trust root).
    pub ca: PathBuf,
}

/// One etcd process of a cluster.
#[derive(Debug)]
pub struct EtcdMember {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    process: ChildProcess,
    scheme: &'static str,
    peer_scheme: &'static str,
    health_port: u16,
    /// The member's secret directory ([`EtcdBuilder::secret_volumes`]).
    tls_dir: Option<PathBuf>,
}

// === impl EtcdBuilder ===

impl EtcdBuilder {
    /// Number of members (1 or 3 in practice). Default 1.
    pub fn members(mut self, n: usize) -> Self {
        self.members = n;
        self
    }

    /// `--initial-cluster-token`. Default: a random one per cluster.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// `--heartbeat-interval` and `--election-timeout` in ms. Default 100/1000
    /// (etcd's defaults; lower values cause spurious elections on 2 busy cores).
    pub fn timing(mut self, heartbeat_ms: u64, election_ms: u64) -> Self {
        self.heartbeat_ms = heartbeat_ms;
        self.election_ms = election_ms;
        self
    }

    /// Extra command-line flags for every member.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Client TLS: `https://` client URLs served with `tls`; `/health` moves to a
    /// plain-HTTP metrics listener for the harness's probes.
    /// The test sets up auth itself ([`EtcdCluster::enable_auth`]); [`EtcdCluster::client`]
    /// stays anonymous.
    pub fn client_tls(mut self, tls: EtcdTls) -> Self {
        self.security = Security::Tls(tls);
        self
    }

    /// Plaintext and unauthenticated whatever `LOCKMESH_TEST_ETCD` says: for a test
    /// about such an etcd (its doc comment says why).
    pub fn plaintext(mut self) -> Self {
        self.security = Security::Plain;
        self
    }

    /// Production's shape whatever `LOCKMESH_TEST_ETCD` says: client TLS with the
    /// harness CA ([`harness_pki`]), a random root password, auth on.
    pub fn secure(mut self) -> Self {
        self.security = Security::Secure;
        self
    }

    /// Production's shape ([`EtcdBuilder::secure`]: the harness CA, auth on) with
    /// every TLS file read from a directory in the kubelet's layout, as
    /// deploy/base/etcd mounts its Secret (the module documentation): per member
    /// `tls.crt` and `tls.key` ([`member_identity`] of [`harness_pki`], served to
    /// clients and peers; re-read by etcd at each handshake) and `ca.crt` (the
    /// `--peer-trusted-ca-file`: peers authenticate by certificate,
    /// `--peer-client-cert-auth`, so peer URLs are `https://`; read by etcd at
    /// start only), and the clients' bundle in [`EtcdCluster::client_ca_dir`].
    ///
    /// No client `--trusted-ca-file`: with it etcd 3.5 asks every client for a
    /// certificate whatever `--client-cert-auth` says (seen with 3.5.30: the
    /// handshake fails with `tls: certificate required`), and lockmesh's clients
    /// present none (a CA and a user, as deploy/base/arbiter configures them).
    pub fn secret_volumes(mut self) -> Self {
        self.security = Security::Secure;
        self.secret_volumes = true;
        self
    }

    /// Starts all members at once and waits until each reports healthy.
    pub async fn start(self) -> Result<EtcdCluster> {
        let dir = temp_dir("etcd-")?;
        self.start_in(dir).await
    }

    async fn start_in(self, dir: TempDir) -> Result<EtcdCluster> {
        ensure!(self.members >= 1, "an etcd cluster needs at least one member");
        let etcd = etcd_bin()?;
        let token = self.token.unwrap_or_else(|| format!("lockmesh-test-{:016x}", rand::random::<u64>()));
        let ports: Vec<(u16, u16)> = (0..self.members).map(|_| (free_port(), free_port())).collect();
        let peer_scheme = if self.secret_volumes { "https" } else { "http" };
        let initial_cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}={peer_scheme}://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::with_capacity(self.members);
        let secure = match self.security {
            Security::Default => secure_by_default(),
            Security::Secure => true,
            Security::Plain | Security::Tls(_) => false,
        };
        ensure!(!self.secret_volumes || secure, "secret volumes need the harness's TLS and auth (EtcdBuilder::secure)");
        let mut client_tls = match &self.security {
            Security::Tls(t) => Some(t.clone()),
            _ if secure => Some(harness_tls()),
            _ => None,
        };
        let mut client_ca_dir = None;
        if self.secret_volumes {
            // The harness's clients and the stack's users trust the bundle in
            // clients/ca.crt, which the test rolls like any client's.
            let ca = std::fs::read(harness_pki().ca_cert_path()).context("read the harness CA")?;
            let clients = SecretDir::create(dir.path().join("clients"), &Files::from([(TLS_CA.to_owned(), ca)]))?;
            let m0 = dir.path().join("m0").join("tls");
            client_tls =
                Some(EtcdTls { cert: m0.join(TLS_CERT), key: m0.join(TLS_KEY), ca: clients.path().join(TLS_CA) });
            client_ca_dir = Some(clients.path().to_path_buf());
        }
        let scheme = if client_tls.is_some() { "https" } else { "http" };
        for (i, &(client_port, peer_port)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let member_dir = dir.path().join(&name);
            std::fs::create_dir_all(&member_dir)?;
            let data_dir = member_dir.join("data");
            let mut args = vec![
                format!("--name={name}"),
                format!("--data-dir={}", data_dir.display()),
                format!("--listen-client-urls={scheme}://127.0.0.1:{client_port}"),
                format!("--advertise-client-urls={scheme}://127.0.0.1:{client_port}"),
                format!("--listen-peer-urls={peer_scheme}://127.0.0.1:{peer_port}"),
                format!("--initial-advertise-peer-urls={peer_scheme}://127.0.0.1:{peer_port}"),
                format!("--initial-cluster={initial_cluster}"),
                format!("--initial-cluster-token={token}"),
                "--initial-cluster-state=new".into(),
                format!("--heartbeat-interval={}", self.heartbeat_ms),
                format!("--election-timeout={}", self.election_ms),
                "--logger=zap".into(),
                "--log-level=info".into(),
                // Production sets a backend quota (deploy/base/etcd); so does the
                // harness, so a test sees the NOSPACE alarm a full etcd raises.
                format!("--quota-backend-bytes={QUOTA_BACKEND_BYTES}"),
            ];
            let mut health_port = client_port;
            let mut tls_dir = None;
            if self.secret_volumes {
                let mut files = member_identity(harness_pki())?;
                files.insert(TLS_CA.to_owned(), std::fs::read(harness_pki().ca_cert_path())?);
                let tls = SecretDir::create(member_dir.join("tls"), &files)?.path().to_path_buf();
                let at = |f: &str| tls.join(f).display().to_string();
                health_port = free_port();
                args.extend([
                    format!("--cert-file={}", at(TLS_CERT)),
                    format!("--key-file={}", at(TLS_KEY)),
                    format!("--peer-cert-file={}", at(TLS_CERT)),
                    format!("--peer-key-file={}", at(TLS_KEY)),
                    format!("--peer-trusted-ca-file={}", at(TLS_CA)),
                    "--peer-client-cert-auth=true".into(),
                    format!("--listen-metrics-urls=http://127.0.0.1:{health_port}"),
                ]);
                tls_dir = Some(tls);
            } else if let Some(t) = &client_tls {
                health_port = free_port();
                args.push(format!("--cert-file={}", t.cert.display()));
                args.push(format!("--key-file={}", t.key.display()));
                args.push(format!("--listen-metrics-urls=http://127.0.0.1:{health_port}"));
            }
            if secure {
                // bcrypt's minimum cost: every Authenticate (each client connect, each
                // lockctl run) hashes the password. Production keeps etcd's default (10).
                args.push("--bcrypt-cost=4".into());
                // Signed tokens, as deploy/base/etcd runs: etcd's default simple
                // tokens name the raft index they were issued at, and a member
                // restored from a snapshot holds each one back until its deadline
                // (docs/OPERATIONS.md "etcd auth tokens").
                let (private, public) = harness_jwt_keys();
                args.push(format!(
                    "--auth-token=jwt,pub-key={},priv-key={},sign-method=ES256,ttl=10m",
                    public.display(),
                    private.display()
                ));
            }
            args.extend(self.extra_args.iter().cloned());
            let process = ChildProcess::new(format!("etcd-{name}"), &etcd, args, member_dir.join("etcd.log"));
            members.push(EtcdMember {
                name,
                client_port,
                peer_port,
                data_dir,
                process,
                scheme,
                peer_scheme,
                health_port,
                tls_dir,
            });
        }
        let mut cluster = EtcdCluster {
            members,
            token,
            initial_cluster,
            client_tls,
            client_ca_dir,
            root_password: None,
            pool: std::sync::Mutex::new(Vec::new()),
            made: std::sync::Mutex::new(Vec::new()),
            lent: std::sync::Mutex::new(std::collections::HashMap::new()),
            returned: std::sync::Mutex::new(Vec::new()),
            _dir: dir,
        };
        // All members must run before any can elect a leader and be healthy.
        for m in &cluster.members {
            m.process.start()?;
        }
        cluster.wait_healthy().await?;
        if secure {
            let password = format!("root-{:016x}", rand::random::<u64>());
            cluster.enable_auth(&password).await?;
            cluster.root_password = Some(password);
        }
        Ok(cluster)
    }
}

// === impl EtcdCluster ===

impl EtcdCluster {
    /// A builder for a 1-member cluster.
    pub fn builder() -> EtcdBuilder {
        EtcdBuilder {
            members: 1,
            token: None,
            heartbeat_ms: 100,
            election_ms: 1000,
            extra_args: Vec::new(),
            security: Security::Default,
            secret_volumes: false,
        }
    }

    /// Client URLs of all members, `http://127.0.0.1:<port>`.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdMember::client_url).collect()
    }

    /// Member `i` (panics if out of range).
    pub fn member(&self, i: usize) -> &EtcdMember {
        &self.members[i]
    }

    pub fn members(&self) -> &[EtcdMember] {
        &self.members
    }

    /// The `--initial-cluster-token`.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The `--initial-cluster` value (`m0=http://127.0.0.1:<peer>,...`; `https://`
    /// with [`EtcdBuilder::secret_volumes`]).
    pub fn initial_cluster(&self) -> &str {
        &self.initial_cluster
    }

    /// Waits (in parallel) until every *running* member reports healthy.
    pub async fn wait_healthy(&self) -> Result<()> {
        let waits = self
            .members
            .iter()
            .filter(|m| m.process.pid().is_some() || m.process.exit_status().is_some())
            .map(EtcdMember::wait_healthy);
        futures::future::try_join_all(waits).await?;
        Ok(())
    }

    /// A gRPC client on all endpoints (over TLS when the cluster has it; logged in
    /// as root when the harness turned auth on): for test code that inspects or
    /// plants keys directly.
    pub async fn client(&self) -> Result<etcd_client::Client> {
        self.client_on(&self.endpoints()).await
    }

    /// [`EtcdCluster::client`] whose calls are sent again while etcd refuses them
    /// because its users or roles changed since the login (nothing applied;
    /// `lockmesh_ops::etcd_retry`): scenarios add users to a shared etcd all the
    /// time, so a root login of test code is refused now and then.
    pub async fn retrying_client(&self) -> Result<lockmesh_ops::etcd_retry::Etcd> {
        Ok(lockmesh_ops::etcd_retry::Etcd::new(self.client().await?))
    }

    /// Like [`EtcdCluster::client`], on the given endpoints only (e.g. one member).
    pub async fn client_on(&self, endpoints: &[String]) -> Result<etcd_client::Client> {
        let root = self.root_password.as_deref().map(|p| ("root", p));
        self.connect(endpoints, root).await
    }

    /// A gRPC client logged in as `user` (auth enabled).
    pub async fn client_as(&self, user: &str, password: &str) -> Result<etcd_client::Client> {
        self.connect(&self.endpoints(), Some((user, password))).await
    }

    /// The client TLS settings, if any. With [`EtcdBuilder::secret_volumes`]:
    /// member 0's certificate and key, and the clients' bundle
    /// ([`EtcdCluster::client_ca_dir`]).
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.client_tls.as_ref()
    }

    /// The secret directory holding `ca.crt`, the bundle the harness's clients
    /// ([`EtcdCluster::client`], `etcdctl` flags) and [`EtcdUsers`] trust, read
    /// at each connect; with [`EtcdBuilder::secret_volumes`] only.
    pub fn client_ca_dir(&self) -> Option<SecretDir> {
        self.client_ca_dir.as_ref().map(SecretDir::open)
    }

    /// Whether the harness turned auth on ([`EtcdBuilder::secure`]).
    pub fn is_secure(&self) -> bool {
        self.root_password.is_some()
    }

    /// `LOCKMESH_ETCD_*` variables for a child process (lockctl, a gate or load
    /// tool) reaching this cluster as root: endpoints, and with TLS the CA, with
    /// auth the root user and a password file in `dir`. For clusters a test owns
    /// outright; a stack's processes use their own role ([`EtcdUsers::env`]).
    pub fn client_env(&self, dir: &Path) -> Result<Vec<(String, String)>> {
        let mut env = vec![("LOCKMESH_ETCD_ENDPOINTS".to_owned(), self.endpoints().join(","))];
        if let Some(t) = &self.client_tls {
            env.push(("LOCKMESH_ETCD_CA".into(), t.ca.display().to_string()));
        }
        if let Some(p) = &self.root_password {
            let file = dir.join("etcd-root.pw");
            std::fs::write(&file, format!("{p}\n")).with_context(|| format!("write {}", file.display()))?;
            env.push(("LOCKMESH_ETCD_USER".into(), "root".into()));
            env.push(("LOCKMESH_ETCD_PASSWORD_FILE".into(), file.display().to_string()));
        }
        Ok(env)
    }

    /// `etcdctl` flags reaching this cluster as root (`--cacert`, `--user`), empty
    /// for a plaintext cluster.
    pub fn etcdctl_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        if let Some(t) = &self.client_tls {
            flags.push(format!("--cacert={}", t.ca.display()));
        }
        if let Some(p) = &self.root_password {
            flags.push(format!("--user=root:{p}"));
        }
        flags
    }

    /// Creates the shipped roles (`etcd_roles::roles(root)`) for key root `root`
    /// under names unique to this call (`<role>-<8 hex digits>`, since several
    /// stacks share one etcd) and one user per role with a random password
    /// (files in `dir`). On a cluster without harness auth nothing is created and
    /// the [`EtcdUsers`] only carries the endpoints (and CA).
    pub async fn users_for(&self, root: &str, dir: &Path) -> Result<EtcdUsers> {
        let users = self.blank_users(dir);
        if !users.secure {
            return Ok(users);
        }
        let known = self
            .made
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|p| p.root == root)
            .map(|p| (p.suffix.clone(), p.secret));
        if let Some((suffix, secret)) = known {
            let users = EtcdUsers { suffix, secret, ..users };
            users.write_password_files()?;
            return Ok(users);
        }
        let c = self.client().await?;
        self.create_users(&c, root, &users).await?;
        users.write_password_files()?;
        self.remember(root, &users);
        Ok(users)
    }

    fn remember(&self, root: &str, users: &EtcdUsers) {
        let mut made = self.made.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        made.push(PooledUsers { root: root.to_owned(), suffix: users.suffix.clone(), secret: users.secret });
    }

    /// A fresh key root `/t/<name>-<random>` and its users ([`EtcdCluster::users_for`]).
    ///
    /// Every change to etcd's users or roles makes every token issued before it
    /// "old": etcd refuses the next call of every logged-in client once (its auth
    /// revision moved), which the arbiters answer `unavailable`. So on the shared
    /// etcd, which many stacks use at once, the users of [`SHARED_USER_POOL`] roots
    /// are created when it starts, and a stack takes one here (the root is then
    /// `/t/p<n>-<random>`, not named after the test); only past the pool are users
    /// created while others run.
    pub async fn users_for_new_root(&self, name: &str, dir: &Path) -> Result<(String, EtcdUsers)> {
        let mut pooled = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        if pooled.is_none() && self.is_secure() {
            let returned = self.returned.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
            if let Some(p) = returned {
                self.wipe_root(&p.root).await.with_context(|| format!("wipe returned root {}", p.root))?;
                pooled = Some(p);
            }
        }
        if let Some(p) = pooled {
            let users = EtcdUsers { suffix: p.suffix.clone(), secret: p.secret, ..self.blank_users(dir) };
            users.write_password_files()?;
            self.made.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(p.clone());
            return Ok((p.root, users));
        }
        if self.is_secure()
            && self.made.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len() >= SHARED_USER_POOL
        {
            // Past the pool: the users are made now, and every other stack's next
            // etcd call fails once. Raise SHARED_USER_POOL when this shows up.
            eprintln!(
                "lockmesh-tests: the etcd user pool is used up and no stack has ended; \
                 creating users for {name} while others run"
            );
        }
        let root = crate::unique_prefix(name);
        let users = self.users_for(&root, dir).await?;
        Ok((root, users))
    }

    /// Marks `root` (from [`EtcdCluster::users_for_new_root`]) as used by one
    /// more live stack; when the last of them ends ([`EtcdCluster::return_root`])
    /// its users may be handed out again. Roots taken without this are never
    /// handed out again (a test may keep using them without a stack).
    pub fn lend_root(&self, root: &str) {
        let known = self.made.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().any(|p| p.root == root);
        if known {
            *self.lent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(root.to_owned()).or_insert(0) +=
                1;
        }
    }

    /// Another stack on a root already lent (a no-op for roots never lent).
    pub fn share_root(&self, root: &str) {
        if let Some(n) = self.lent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_mut(root) {
            *n += 1;
        }
    }

    /// One stack on a lent root ended; after the last, the root's users go back
    /// to be handed out again, its keys deleted first.
    pub fn return_root(&self, root: &str) {
        let mut lent = self.lent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(n) = lent.get_mut(root) else { return };
        *n -= 1;
        if *n > 0 {
            return;
        }
        lent.remove(root);
        drop(lent);
        let made = self.made.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = made.iter().find(|p| p.root == root) {
            self.returned.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(p.clone());
        }
    }

    /// Deletes every key of a returned root (as root, which may), so that the
    /// next stack finds it as fresh as a new one.
    async fn wipe_root(&self, root: &str) -> Result<()> {
        let mut c = self.client().await?;
        c.delete(format!("{root}/"), Some(etcd_client::DeleteOptions::new().with_prefix())).await?;
        c.delete(root, None).await?;
        let left =
            c.get(format!("{root}/"), Some(etcd_client::GetOptions::new().with_prefix().with_count_only())).await?;
        ensure!(left.count() == 0, "{} keys left under {root}", left.count());
        Ok(())
    }

    /// Creates the users of `n` key roots for [`EtcdCluster::users_for_new_root`].
    async fn fill_pool(&self, n: usize) -> Result<()> {
        if !self.is_secure() {
            return Ok(());
        }
        let c = self.client().await?;
        let nowhere = Path::new("/nonexistent");
        let slots: Vec<(String, EtcdUsers)> =
            (0..n).map(|i| (crate::unique_prefix(&format!("p{i}")), self.blank_users(nowhere))).collect();
        // A few roots at a time: each is about 40 auth writes.
        for chunk in slots.chunks(8) {
            futures::future::try_join_all(chunk.iter().map(|(root, users)| self.create_users(&c, root, users))).await?;
        }
        let mut pool = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pool.extend(slots.into_iter().map(|(root, u)| PooledUsers { root, suffix: u.suffix, secret: u.secret }));
        Ok(())
    }

    fn blank_users(&self, dir: &Path) -> EtcdUsers {
        EtcdUsers {
            endpoints: self.endpoints(),
            ca: self.client_tls.as_ref().map(|t| t.ca.clone()),
            secure: self.is_secure(),
            suffix: format!("{:08x}", rand::random::<u32>()),
            secret: rand::random(),
            dir: dir.to_path_buf(),
        }
    }

    /// The shipped roles for `root`, under `users`' names, and one user per role.
    async fn create_users(&self, c: &etcd_client::Client, root: &str, users: &EtcdUsers) -> Result<()> {
        let make = roles(root).into_iter().map(|role| {
            let mut c = c.clone();
            let (name, pw) = (users.user(role.name), users.password(role.name));
            async move {
                c.role_add(name.as_str()).await.with_context(|| format!("role add {name}"))?;
                for g in &role.grants {
                    let mut p = match g.perm {
                        Perm::Read => Permission::read(g.key.as_str()),
                        Perm::Write => Permission::write(g.key.as_str()),
                        Perm::ReadWrite => Permission::read_write(g.key.as_str()),
                    };
                    if g.prefix {
                        p = p.with_prefix();
                    }
                    c.role_grant_permission(name.as_str(), p).await.with_context(|| format!("grant {name}"))?;
                }
                c.user_add(name.as_str(), pw.as_str(), None).await.with_context(|| format!("user add {name}"))?;
                c.user_grant_role(name.as_str(), name.as_str()).await.with_context(|| format!("grant role {name}"))?;
                Ok::<_, anyhow::Error>(())
            }
        });
        futures::future::try_join_all(make).await?;
        Ok(())
    }

    /// The options [`EtcdCluster::client`] connects with (TLS when the cluster has
    /// it, root when auth is on): for a tool that makes its own clients, such as
    /// the load tool's etcd workloads.
    pub fn root_connect_options(&self) -> Result<etcd_client::ConnectOptions> {
        self.connect_options(self.root_password.as_deref().map(|p| ("root", p)))
    }

    fn connect_options(&self, user: Option<(&str, &str)>) -> Result<etcd_client::ConnectOptions> {
        let mut opts = etcd_client::ConnectOptions::new();
        if let Some(t) = &self.client_tls {
            let ca = std::fs::read(&t.ca).with_context(|| format!("read {}", t.ca.display()))?;
            opts = opts.with_tls(etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca)));
        }
        if let Some((u, p)) = user {
            // A restarted or restored member forgets simple auth tokens: the test's
            // own clients log in again instead of failing with "invalid auth token".
            opts = opts.with_user(u, p).with_auto_token_refresh(true);
        }
        Ok(opts)
    }

    async fn connect(&self, endpoints: &[String], user: Option<(&str, &str)>) -> Result<etcd_client::Client> {
        let opts = self.connect_options(user)?;
        etcd_client::Client::connect(endpoints, Some(opts))
            .await
            .with_context(|| format!("connect etcd client to {endpoints:?}"))
    }

    /// Enables auth: creates `root` (password `root_password`) with the root
    /// role, then turns auth on. Every later client must log in.
    pub async fn enable_auth(&self, root_password: &str) -> Result<()> {
        let mut c = self.connect(&self.endpoints(), None).await?;
        c.user_add("root", root_password, None).await.context("user add root")?;
        c.user_grant_role("root", "root").await.context("grant root")?;
        c.auth_enable().await.context("auth enable")?;
        Ok(())
    }

    /// `etcdctl snapshot save <path>` against the first running member.
    pub async fn snapshot_save(&self, path: impl AsRef<Path>) -> Result<()> {
        let member =
            self.members.iter().find(|m| m.process.is_running()).context("snapshot_save: no etcd member is running")?;
        let path = path.as_ref();
        let mut args = vec![format!("--endpoints={}", member.client_url())];
        args.extend(self.etcdctl_flags());
        args.extend(["snapshot".into(), "save".into(), path.display().to_string()]);
        run_tool(etcdctl_bin()?, &args).await?;
        Ok(())
    }

    /// Disaster recovery: stops every member, replaces each data directory
    /// with `etcdutl snapshot restore` of `snapshot` (same names, peer URLs and
    /// token; with `bump = Some(n)`, `--bump-revision n --mark-compacted`), and
    /// starts the members again on their old ports.
    pub async fn restore_from(&self, snapshot: impl AsRef<Path>, bump: Option<u64>) -> Result<()> {
        let snapshot = snapshot.as_ref();
        ensure!(snapshot.is_file(), "snapshot {} does not exist", snapshot.display());
        let etcdutl = etcdutl_bin()?;
        futures::future::try_join_all(self.members.iter().map(EtcdMember::stop)).await?;
        for m in &self.members {
            if m.data_dir.exists() {
                std::fs::remove_dir_all(&m.data_dir).with_context(|| format!("remove {}", m.data_dir.display()))?;
            }
            let mut args = vec![
                "snapshot".into(),
                "restore".into(),
                snapshot.display().to_string(),
                format!("--data-dir={}", m.data_dir.display()),
                format!("--name={}", m.name),
                format!("--initial-cluster={}", self.initial_cluster),
                format!("--initial-cluster-token={}", self.token),
                format!("--initial-advertise-peer-urls={}", m.peer_url()),
            ];
            if let Some(n) = bump {
                args.push(format!("--bump-revision={n}"));
                args.push("--mark-compacted".into());
            }
            run_tool(etcdutl.clone(), &args).await?;
        }
        for m in &self.members {
            m.process.start()?;
        }
        self.wait_healthy().await
    }
}

/// One key root's etcd users on a cluster ([`EtcdCluster::users_for`]): the
/// shipped roles under unique names, how a process logs in as each. Methods take
/// the shipped role name (`lockmesh-arbiter`, `lockmesh-admin`, `lockmesh-admin-epoch`,
/// `lockmesh-classes`, `lockmesh-audit`; `etcd_roles::COMMAND_ROLES` says which
/// lockctl command needs which). On a cluster without harness auth they carry
/// only the endpoints (and CA), so callers need no branch.
#[derive(Clone, Debug)]
pub struct EtcdUsers {
    endpoints: Vec<String>,
    ca: Option<PathBuf>,
    secure: bool,
    suffix: String,
    /// Random per call: the passwords are `pw-<role>-<secret>`.
    secret: u64,
    dir: PathBuf,
}

impl EtcdUsers {
    /// The etcd user (and role) name standing for shipped role `role`.
    pub fn user(&self, role: &str) -> String {
        format!("{role}-{}", self.suffix)
    }

    /// Whether the users exist (the cluster has harness auth).
    pub fn is_secure(&self) -> bool {
        self.secure
    }

    /// The CA file clients trust, with client TLS.
    pub fn ca(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    fn password(&self, role: &str) -> String {
        format!("pw-{role}-{:016x}", self.secret)
    }

    fn write_password_files(&self) -> Result<()> {
        if !self.secure {
            return Ok(());
        }
        for role in roles("/") {
            let file = self.password_file(role.name);
            let pw = self.password(role.name);
            std::fs::write(&file, format!("{pw}\n")).with_context(|| format!("write {}", file.display()))?;
        }
        Ok(())
    }

    /// The file holding `role`'s user's password (one line).
    pub fn password_file(&self, role: &str) -> PathBuf {
        self.dir.join(format!("{}.pw", self.user(role)))
    }

    /// `LOCKMESH_ETCD_*` variables for a lockctl (or any `EtcdArgs`) child process
    /// logging in as `role`'s user: endpoints, CA, user, password file.
    pub fn env(&self, role: &str) -> Vec<(String, String)> {
        let mut env = vec![("LOCKMESH_ETCD_ENDPOINTS".to_owned(), self.endpoints.join(","))];
        if let Some(ca) = &self.ca {
            env.push(("LOCKMESH_ETCD_CA".into(), ca.display().to_string()));
        }
        if self.secure {
            env.push(("LOCKMESH_ETCD_USER".into(), self.user(role)));
            env.push(("LOCKMESH_ETCD_PASSWORD_FILE".into(), self.password_file(role).display().to_string()));
        }
        env
    }

    /// The arbiter config's `etcd:` lines (`tls`, `user`, `password_file`) for
    /// `role`'s user, for [`crate::ArbiterBuilder::etcd_yaml`]; empty in plaintext.
    pub fn arbiter_yaml(&self, role: &str) -> Vec<String> {
        let mut lines = Vec::new();
        if let Some(ca) = &self.ca {
            lines.push(format!("tls: {{ ca: {:?} }}", ca.display().to_string()));
        }
        if self.secure {
            lines.push(format!("user: {:?}", self.user(role)));
            lines.push(format!("password_file: {:?}", self.password_file(role).display().to_string()));
        }
        lines
    }

    /// The audit tailer config's top-level lines (`etcd_tls`, `etcd_user`,
    /// `etcd_password_file`) for `role`'s user, each ending in a newline.
    pub fn audit_yaml(&self, role: &str) -> String {
        let mut yaml = String::new();
        if let Some(ca) = &self.ca {
            yaml.push_str(&format!("etcd_tls: {{ ca: {:?} }}\n", ca.display().to_string()));
        }
        if self.secure {
            yaml.push_str(&format!("etcd_user: {:?}\n", self.user(role)));
            yaml.push_str(&format!("etcd_password_file: {:?}\n", self.password_file(role).display().to_string()));
        }
        yaml
    }

    /// A gRPC client logged in as `role`'s user (anonymous in plaintext).
    pub async fn client(&self, role: &str) -> Result<etcd_client::Client> {
        let mut opts = etcd_client::ConnectOptions::new();
        if let Some(ca) = &self.ca {
            let pem = std::fs::read(ca).with_context(|| format!("read {}", ca.display()))?;
            opts =
                opts.with_tls(etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(pem)));
        }
        if self.secure {
            opts = opts.with_user(self.user(role), self.password(role)).with_auto_token_refresh(true);
        }
        etcd_client::Client::connect(&self.endpoints, Some(opts))
            .await
            .with_context(|| format!("connect etcd client as {role} to {:?}", self.endpoints))
    }
}

/// A key root whose users exist (their password files are written per taker).
#[derive(Debug, Clone)]
struct PooledUsers {
    root: String,
    suffix: String,
    secret: u64,
}

// === impl EtcdMember ===

impl EtcdMember {
    /// The member name (`m0`, `m1`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `http://127.0.0.1:<client port>` (`https://` with client TLS).
    pub fn client_url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.client_port)
    }

    /// `http://127.0.0.1:<peer port>` (`https://` with [`EtcdBuilder::secret_volumes`]).
    pub fn peer_url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.peer_scheme, self.peer_port)
    }

    /// The member's secret directory ([`EtcdBuilder::secret_volumes`]): `tls.crt`,
    /// `tls.key` (re-read by etcd at each handshake: swap them in, no restart)
    /// and `ca.crt` (`--peer-trusted-ca-file`, read at start: a restart applies a
    /// new one).
    pub fn tls_dir(&self) -> Option<SecretDir> {
        self.tls_dir.as_ref().map(SecretDir::open)
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The data directory (`--data-dir`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The log file (stdout and stderr, appended across restarts).
    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    /// The pid while running.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// SIGKILL (a crash).
    pub fn kill(&self) {
        self.process.kill();
    }

    /// SIGTERM, then wait for the exit (SIGKILL after 10 s).
    pub async fn stop(&self) -> Result<()> {
        self.process.stop(STOP_GRACE).await
    }

    /// SIGSTOP.
    pub fn pause(&self) -> Result<()> {
        self.process.pause()
    }

    /// SIGCONT.
    pub fn resume(&self) -> Result<()> {
        self.process.resume()
    }

    /// Stops the member if it runs, starts it again with the same data
    /// directory and ports, and waits until it is healthy (which needs a quorum).
    pub async fn restart(&self) -> Result<()> {
        self.stop().await?;
        self.process.start()?;
        self.wait_healthy().await
    }

    /// Whether `/health` answers `"health":"true"` within 1 s.
    pub async fn is_healthy(&self) -> bool {
        self.check_health(Duration::from_secs(1)).await.is_ok()
    }

    /// Polls `/health` until it answers `"health":"true"` ([`ETCD_READY_TIMEOUT`]).
    pub async fn wait_healthy(&self) -> Result<()> {
        self.process.wait_ready(ETCD_READY_TIMEOUT, async || self.check_health(Duration::from_secs(2)).await).await
    }

    /// The URL of the member's plain-HTTP listener (`/metrics`, `/health`): its
    /// client URL on a plaintext cluster, a separate metrics port on a TLS one.
    pub fn metrics_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.health_port)
    }

    /// etcd's Prometheus text (`/metrics`), from the member's plain-HTTP listener.
    pub async fn metrics_text(&self) -> Result<String> {
        let resp = http_get_within(self.health_port, "/metrics", Duration::from_secs(5)).await?;
        if resp.status != 200 {
            bail!("/metrics: {}", resp.status);
        }
        Ok(resp.body)
    }

    /// One gauge or counter without labels from [`EtcdMember::metrics_text`].
    pub async fn metric(&self, name: &str) -> Result<f64> {
        let text = self.metrics_text().await?;
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
            .with_context(|| format!("etcd exports no {name}"))
    }

    async fn check_health(&self, timeout: Duration) -> Result<()> {
        let resp = http_get_within(self.health_port, "/health", timeout).await?;
        let body: String = resp.body.chars().filter(|c| !c.is_whitespace()).collect();
        if resp.status != 200 || !body.contains(r#""health":"true""#) {
            bail!("/health: {} {}", resp.status, resp.body.trim());
        }
        Ok(())
    }
}

/// A member certificate (`tls.crt`) and key (`tls.key`) signed by `pki`'s CA
/// (its `ca.pem` and `ca-key.pem`), for a member's secret directory
/// ([`EtcdBuilder::secret_volumes`]): SANs IP 127.0.0.1 and DNS `localhost`, for
/// server and client use (a member is its peers' client), valid 2020 to 2100,
/// a fresh key and serial each call.
pub fn member_identity(pki: &DevPki) -> Result<Files> {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType};
    let read = |f: &str| {
        let path = pki.dir().join(f);
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
    };
    let issuer = Issuer::from_ca_cert_pem(&read("ca.pem")?, KeyPair::from_pem(&read("ca-key.pem")?)?)?;
    let mut params = CertificateParams::default();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2100, 1, 1);
    params.distinguished_name.push(DnType::CommonName, "lockmesh-etcd");
    params.subject_alt_names = vec![
        SanType::IpAddress(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
        SanType::DnsName("localhost".try_into()?),
    ];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer).context("sign an etcd member certificate")?;
    Ok(Files::from([
        (TLS_CERT.to_owned(), cert.pem().into_bytes()),
        (TLS_KEY.to_owned(), key.serialize_pem().into_bytes()),
    ]))
}

/// The binary-wide shared 1-member etcd, started on first use.
///
/// Tests must keep to their own key prefix (see [`crate::unique_prefix`]) and
/// must not kill, pause or restore it. It dies with the test binary (its
/// parent-death signal is SIGKILL); its data directory, in the binary's
/// [`crate::paths::scratch_dir`], is removed when the next test binary starts.
///
/// # Panics
///
/// If etcd cannot be started (not installed, no port): every test using it
/// would fail anyway, and this keeps test code free of `?` noise.
pub async fn shared_etcd() -> &'static EtcdCluster {
    static SHARED: OnceCell<EtcdCluster> = OnceCell::const_new();
    SHARED
        .get_or_init(|| async {
            match start_shared().await {
                Ok(cluster) => cluster,
                Err(e) => panic!("cannot start the shared etcd: {e:#}"),
            }
        })
        .await
}

async fn start_shared() -> Result<EtcdCluster> {
    // The TempDir lives in a static and is never dropped: a later test
    // binary's sweep of the scratch directory removes it.
    let dir = temp_dir("shared-etcd-")?;
    let cluster = EtcdCluster::builder().start_in(dir).await?;
    cluster.fill_pool(SHARED_USER_POOL).await.context("create the shared etcd's users")?;
    Ok(cluster)
}

fn etcd_dir() -> PathBuf {
    repo_root().join(".tools/etcd/usr/bin")
}

/// The etcd server binary (`ETCD_BIN` or the pinned install).
pub fn etcd_bin() -> Result<PathBuf> {
    tool("ETCD_BIN", etcd_dir().join("etcd"), "etcd")
}

/// `etcdctl` (`ETCDCTL_BIN`, else next to `ETCD_BIN`, else the pinned install).
pub fn etcdctl_bin() -> Result<PathBuf> {
    tool("ETCDCTL_BIN", sibling_of_etcd("etcdctl"), "etcdctl")
}

/// `etcdutl` (`ETCDUTL_BIN`, else next to `ETCD_BIN`, else the pinned install).
pub fn etcdutl_bin() -> Result<PathBuf> {
    tool("ETCDUTL_BIN", sibling_of_etcd("etcdutl"), "etcdutl")
}

fn sibling_of_etcd(name: &str) -> PathBuf {
    std::env::var_os("ETCD_BIN")
        .filter(|p| !p.is_empty())
        .and_then(|p| PathBuf::from(p).parent().map(|d| d.join(name)))
        .unwrap_or_else(|| etcd_dir().join(name))
}

/// Runs a short-lived etcd tool, failing with its output on a non-zero exit.
async fn run_tool(program: PathBuf, args: &[String]) -> Result<String> {
    let out = tokio::process::Command::new(&program)
        .args(args)
        .env("ETCDCTL_API", "3")
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("run {}", program.display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{} {} failed ({}):\n{text}", program.display(), args.join(" "), out.status);
    }
    Ok(text)
}
