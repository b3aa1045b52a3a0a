//! Real etcd clusters on loopback ports.
//!
//! [`EtcdCluster::builder`] starts 1 or more members, each with its own client
//! and peer port, data directory and log file. [`shared_etcd`] is one
//! lazily-started member for a whole test binary; tests keep apart by using
//! their own key prefix (etcd's `NewLazyCluster`).
//!
//! Binaries: `ETCD_BIN` (and `ETCDCTL_BIN`, `ETCDUTL_BIN`) or the pinned
//! install in `<repo>/.tools/etcd/usr/bin/` made by `scripts/setup`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use tempfile::TempDir;
use tokio::sync::OnceCell;

use crate::paths::{repo_root, temp_dir, tool};
use crate::ports::free_port;
use crate::probe::http_get_within;
use crate::process::ChildProcess;

/// How long a member (or the whole cluster) may take to report healthy.
pub const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long `stop()` waits after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// A running etcd cluster; members are killed on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
    token: String,
    initial_cluster: String,
    client_tls: Option<EtcdTls>,
    // Dropped after the members (fields drop in declaration order).
    _dir: TempDir,
}

/// Options for [`EtcdCluster`].
#[derive(Clone, Debug)]
pub struct EtcdBuilder {
    members: usize,
    token: Option<String>,
    heartbeat_ms: u64,
    election_ms: u64,
    extra_args: Vec<String>,
    client_tls: Option<EtcdTls>,
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
    health_port: u16,
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
    pub fn client_tls(mut self, tls: EtcdTls) -> Self {
        self.client_tls = Some(tls);
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
        let initial_cluster = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::with_capacity(self.members);
        let scheme = if self.client_tls.is_some() { "https" } else { "http" };
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
                format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
                format!("--initial-cluster={initial_cluster}"),
                format!("--initial-cluster-token={token}"),
                "--initial-cluster-state=new".into(),
                format!("--heartbeat-interval={}", self.heartbeat_ms),
                format!("--election-timeout={}", self.election_ms),
                "--logger=zap".into(),
                "--log-level=info".into(),
            ];
            let mut health_port = client_port;
            if let Some(t) = &self.client_tls {
                health_port = free_port();
                args.push(format!("--cert-file={}", t.cert.display()));
                args.push(format!("--key-file={}", t.key.display()));
                args.push(format!("--listen-metrics-urls=http://127.0.0.1:{health_port}"));
            }
            args.extend(self.extra_args.iter().cloned());
            let process = ChildProcess::new(format!("etcd-{name}"), &etcd, args, member_dir.join("etcd.log"));
            members.push(EtcdMember { name, client_port, peer_port, data_dir, process, scheme, health_port });
        }
        let cluster = EtcdCluster { members, token, initial_cluster, client_tls: self.client_tls, _dir: dir };
        // All members must run before any can elect a leader and be healthy.
        for m in &cluster.members {
            m.process.start()?;
        }
        cluster.wait_healthy().await?;
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
            client_tls: None,
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

    /// The `--initial-cluster` value (`m0=http://127.0.0.1:<peer>,...`).
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

    /// A gRPC client on all endpoints (over TLS when the cluster has it).
    pub async fn client(&self) -> Result<etcd_client::Client> {
        self.connect(None).await
    }

    /// A gRPC client logged in as `user` (auth enabled).
    pub async fn client_as(&self, user: &str, password: &str) -> Result<etcd_client::Client> {
        self.connect(Some((user, password))).await
    }

    /// The client TLS settings, if any.
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.client_tls.as_ref()
    }

    async fn connect(&self, user: Option<(&str, &str)>) -> Result<etcd_client::Client> {
        let endpoints = self.endpoints();
        let mut opts = etcd_client::ConnectOptions::new();
        if let Some(t) = &self.client_tls {
            let ca = std::fs::read(&t.ca).with_context(|| format!("read {}", t.ca.display()))?;
            opts = opts.with_tls(etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca)));
        }
        if let Some((u, p)) = user {
            opts = opts.with_user(u, p);
        }
        etcd_client::Client::connect(&endpoints, Some(opts))
            .await
            .with_context(|| format!("connect etcd client to {endpoints:?}"))
    }

    /// Enables auth: creates `root` (password `root_password`) with the root
    /// role, then turns auth on. Every later client must log in.
    pub async fn enable_auth(&self, root_password: &str) -> Result<()> {
        let mut c = self.client().await?;
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
        run_tool(
            etcdctl_bin()?,
            &[
                format!("--endpoints={}", member.client_url()),
                "snapshot".into(),
                "save".into(),
                path.display().to_string(),
            ],
        )
        .await?;
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

    /// `http://127.0.0.1:<peer port>`.
    pub fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
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

    async fn check_health(&self, timeout: Duration) -> Result<()> {
        let resp = http_get_within(self.health_port, "/health", timeout).await?;
        let body: String = resp.body.chars().filter(|c| !c.is_whitespace()).collect();
        if resp.status != 200 || !body.contains(r#""health":"true""#) {
            bail!("/health: {} {}", resp.status, resp.body.trim());
        }
        Ok(())
    }
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
    EtcdCluster::builder().start_in(dir).await
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
