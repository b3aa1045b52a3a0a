//! The arbiter (`lockmesh-extproc`) as a real process.
//!
//! The builder writes `arbiter.yaml` and `registry.yaml` into a temporary
//! directory and runs `lockmesh-extproc --config arbiter.yaml` with
//! `RUST_LOG=info`. Readiness is admin `GET /readyz` answering 200.
//!
//! Binary: `ARBITER_BIN`, else `<target>/<profile>/lockmesh-extproc` next to
//! this test binary; build it with `cargo build -p lockmesh-extproc`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use tempfile::TempDir;

use crate::certs::DevPki;
use crate::paths::{profile_dir, temp_dir};
use crate::ports::free_port;
use crate::probe::http_get;
use crate::process::ChildProcess;

/// The registry the scenarios use unless they need another one.
pub const DEFAULT_TEST_REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - name: default
    default: true
    ttl_s: 15
    enforcement: advisory
    risk_owner: lockmesh-tests
    waiver_expiry: "2099-12-31"
  - name: short
    prefixes: ["short"]
    ttl_s: 3
    enforcement: advisory
    risk_owner: lockmesh-tests
    waiver_expiry: "2099-12-31"
"#;

/// How long the arbiter may take until `/readyz` answers 200.
pub const ARBITER_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Options for an [`ArbiterProcess`].
#[derive(Clone, Debug)]
pub struct ArbiterBuilder {
    cert_dir: PathBuf,
    trust_domain: String,
    endpoints: Vec<String>,
    root: String,
    registry: String,
    extra_yaml: Vec<String>,
    etcd_yaml: Vec<String>,
    self_clients: Vec<String>,
    sidecar_grants: bool,
    tls_reload_ms: Option<u64>,
    max_wait_ms: u64,
    grpc_port: Option<u16>,
    admin_port: Option<u16>,
    rust_log: String,
    envs: Vec<(String, String)>,
    /// Another build's binary (the mixed-version rehearsal); this build's if `None`.
    binary: Option<PathBuf>,
}

/// A running arbiter; killed on drop, its log printed if the test panics.
#[derive(Debug)]
pub struct ArbiterProcess {
    grpc_port: u16,
    admin_port: u16,
    config_path: PathBuf,
    process: ChildProcess,
    _dir: TempDir,
}

// === impl ArbiterBuilder ===

impl ArbiterBuilder {
    /// etcd client URLs (`etcd.endpoints`).
    pub fn etcd_endpoints(mut self, endpoints: Vec<String>) -> Self {
        self.endpoints = endpoints;
        self
    }

    /// The key prefix all of this arbiter's keys live under (`etcd.root`).
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = root.into();
        self
    }

    /// The registry YAML text, written to `registry.yaml`. Default
    /// [`DEFAULT_TEST_REGISTRY`].
    pub fn registry(mut self, yaml: impl Into<String>) -> Self {
        self.registry = yaml.into();
        self
    }

    /// A self client (`tls.self_clients`, beside the vouching Envoy ID in
    /// `tls.allowed_clients`): the arbiter believes no caller it claims and
    /// authorises its requests by its own LockGrants, so the registry needs some
    /// (see [`ArbiterBuilder::inbound_sidecar`]).
    pub fn self_client(mut self, spiffe_id: impl Into<String>) -> Self {
        self.self_clients.push(spiffe_id.into());
        self
    }

    /// The shipped inbound sidecar calls this arbiter: its pod's own SVID
    /// (`spiffe_id`, [`crate::envoy::sidecar_svid`]) is a self client, and the
    /// registry written at start gains the test trust domain's LockGrants
    /// ([`registry_with_sidecar_grants`]) unless it declares `grants:` itself.
    pub fn inbound_sidecar(mut self, spiffe_id: impl Into<String>) -> Self {
        let id = spiffe_id.into();
        if !self.self_clients.contains(&id) {
            self.self_clients.push(id);
        }
        self.sidecar_grants = true;
        self
    }

    /// `max_wait_ms`. Default 30000.
    pub fn max_wait_ms(mut self, ms: u64) -> Self {
        self.max_wait_ms = ms;
        self
    }

    /// A raw YAML line appended to the config (for fields the builder does
    /// not know). Top-level keys start in column 0.
    pub fn extra_yaml(mut self, line: impl Into<String>) -> Self {
        self.extra_yaml.push(line.into());
        self
    }

    /// The gRPC port. Default: a free port.
    pub fn grpc_port(mut self, port: u16) -> Self {
        self.grpc_port = Some(port);
        self
    }

    /// The admin port. Default: a free port.
    pub fn admin_port(mut self, port: u16) -> Self {
        self.admin_port = Some(port);
        self
    }

    /// `RUST_LOG` for the arbiter. Default `info`.
    pub fn rust_log(mut self, filter: impl Into<String>) -> Self {
        self.rust_log = filter.into();
        self
    }

    /// Runs another build's arbiter binary (the mixed-version rehearsal).
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.binary = Some(path.into());
        self
    }

    /// An environment variable for the arbiter process.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// `tls.reload_ms`: how often the listener re-reads its certificate files
    /// (the arbiter's default, 5000, unless set).
    pub fn tls_reload_ms(mut self, ms: u64) -> Self {
        self.tls_reload_ms = Some(ms);
        self
    }

    /// A line added under `etcd:` (e.g. `user: arbiter`), for etcd TLS and auth.
    pub fn etcd_yaml(mut self, line: impl Into<String>) -> Self {
        self.etcd_yaml.push(line.into());
        self
    }

    /// The config YAML for the given ports and registry file.
    pub fn render(&self, grpc_port: u16, admin_port: u16, registry_file: &Path) -> String {
        let d = self.cert_dir.display();
        let quoted = |v: &[String]| v.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
        let mut yaml = format!(
            "listen: \"127.0.0.1:{grpc_port}\"\n\
             admin_listen: \"127.0.0.1:{admin_port}\"\n\
             tls:\n  \
               cert: \"{d}/arbiter.pem\"\n  \
               key: \"{d}/arbiter-key.pem\"\n  \
               client_ca: \"{d}/ca.pem\"\n  \
               allowed_clients: [\"spiffe://{td}/lockmesh/envoy\"]\n\
             etcd:\n  \
               endpoints: [{endpoints}]\n  \
               root: {root:?}\n\
             registry_file: \"{registry}\"\n\
             max_wait_ms: {max_wait}\n",
            td = self.trust_domain,
            endpoints = quoted(&self.endpoints),
            root = self.root,
            registry = registry_file.display(),
            max_wait = self.max_wait_ms,
        );
        if !self.self_clients.is_empty() {
            let at = yaml.find("etcd:\n").unwrap_or(yaml.len());
            yaml.insert_str(at, &format!("  self_clients: [{}]\n", quoted(&self.self_clients)));
        }
        if let Some(ms) = self.tls_reload_ms {
            let at = yaml.find("etcd:\n").unwrap_or(yaml.len());
            yaml.insert_str(at, &format!("  reload_ms: {ms}\n"));
        }
        if !self.etcd_yaml.is_empty() {
            let at = yaml.find("registry_file:").unwrap_or(yaml.len());
            let lines: String = self.etcd_yaml.iter().map(|l| format!("  {l}\n")).collect();
            yaml.insert_str(at, &lines);
        }
        for line in &self.extra_yaml {
            yaml.push_str(line);
            yaml.push('\n');
        }
        yaml
    }

    /// The registry as [`ArbiterBuilder::start`] writes it: the given text, with
    /// the inbound sidecar's LockGrants added ([`ArbiterBuilder::inbound_sidecar`]).
    pub fn registry_text(&self) -> Result<String> {
        if self.sidecar_grants {
            registry_with_sidecar_grants(&self.registry, &self.trust_domain, &self.self_clients)
        } else {
            Ok(self.registry.clone())
        }
    }

    /// Writes the config, starts the arbiter and waits until `/readyz` is 200.
    pub async fn start(self) -> Result<ArbiterProcess> {
        ensure!(!self.endpoints.is_empty(), "arbiter needs etcd endpoints");
        ensure!(self.root.starts_with('/'), "etcd root {:?} must start with /", self.root);
        let bin = match &self.binary {
            Some(b) => b.clone(),
            None => arbiter_bin()?,
        };
        let dir = temp_dir("arbiter-")?;
        let grpc_port = self.grpc_port.unwrap_or_else(free_port);
        let admin_port = self.admin_port.unwrap_or_else(free_port);
        let registry_file = dir.path().join("registry.yaml");
        std::fs::write(&registry_file, self.registry_text()?)?;
        let config_path = dir.path().join("arbiter.yaml");
        std::fs::write(&config_path, self.render(grpc_port, admin_port, &registry_file))?;
        let mut process = ChildProcess::new(
            "arbiter",
            bin,
            vec!["--config".into(), config_path.display().to_string()],
            dir.path().join("arbiter.log"),
        )
        .env("RUST_LOG", &self.rust_log);
        for (k, v) in &self.envs {
            process = process.env(k, v);
        }
        let arbiter = ArbiterProcess { grpc_port, admin_port, config_path, process, _dir: dir };
        arbiter.process.start()?;
        arbiter.wait_ready().await?;
        Ok(arbiter)
    }
}

// === impl ArbiterProcess ===

impl ArbiterProcess {
    /// A builder using `pki`'s `arbiter.pem`, `ca.pem` and Envoy's SPIFFE ID.
    pub fn builder(pki: &DevPki) -> ArbiterBuilder {
        ArbiterBuilder {
            cert_dir: pki.dir().to_path_buf(),
            trust_domain: pki.trust_domain().to_owned(),
            endpoints: Vec::new(),
            root: String::new(),
            registry: DEFAULT_TEST_REGISTRY.to_owned(),
            extra_yaml: Vec::new(),
            etcd_yaml: Vec::new(),
            self_clients: Vec::new(),
            sidecar_grants: false,
            tls_reload_ms: None,
            max_wait_ms: 30_000,
            grpc_port: None,
            admin_port: None,
            // LOCKMESH_TEST_ARBITER_LOG: a RUST_LOG filter for every arbiter a run starts.
            rust_log: std::env::var("LOCKMESH_TEST_ARBITER_LOG").unwrap_or_else(|_| "info".into()),
            envs: Vec::new(),
            binary: None,
        }
    }

    /// The ext_proc gRPC (mTLS) port.
    pub fn grpc_port(&self) -> u16 {
        self.grpc_port
    }

    /// The admin HTTP port.
    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }

    /// The config file in use (`registry.yaml` is next to it).
    pub fn config_path(&self) -> &Path {
        &self.config_path
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

    /// SIGTERM, then wait (SIGKILL after 10 s).
    pub async fn stop(&self) -> Result<()> {
        self.process.stop(Duration::from_secs(10)).await
    }

    /// SIGSTOP.
    pub fn pause(&self) -> Result<()> {
        self.process.pause()
    }

    /// SIGCONT.
    pub fn resume(&self) -> Result<()> {
        self.process.resume()
    }

    /// Stops it if running, starts it again with the same config and ports,
    /// and waits until ready.
    pub async fn restart(&self) -> Result<()> {
        self.stop().await?;
        self.process.start()?;
        self.wait_ready().await
    }

    /// Admin `GET path` (status, body), e.g. `/metrics`.
    pub async fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        let resp = http_get(self.admin_port, path).await?;
        Ok((resp.status, resp.body))
    }

    /// The value of the first `/metrics` line that starts with `line_prefix` (a
    /// name, with its labels as exported: `name_total{step="held_read"}`), or
    /// `None` when no line does.
    pub async fn metric(&self, line_prefix: &str) -> Result<Option<f64>> {
        let (_, m) = self.admin_get("/metrics").await?;
        Ok(m.lines().find(|l| l.starts_with(line_prefix)).and_then(|l| l.rsplit(' ').next()?.parse().ok()))
    }

    async fn wait_ready(&self) -> Result<()> {
        let port = self.admin_port;
        self.process
            .wait_ready(ARBITER_READY_TIMEOUT, async || {
                let resp = http_get(port, "/readyz").await?;
                if resp.status != 200 {
                    bail!("/readyz: {} {}", resp.status, resp.body.trim());
                }
                Ok(())
            })
            .await
    }
}

/// The filter's LockGrant documents as shipped (`envoy-config/src/grants.json`,
/// from the frozen copy's `envoy-config/` when there is one).
pub const SHIPPED_GRANTS: &str = "envoy-config/src/grants.json";

/// The LockGrant documents (a `grants:` block) of a stack the shipped inbound
/// sidecar calls, for `trust_domain`, as `scripts/up` writes the quick start's:
///
/// - every grant of [`SHIPPED_GRANTS`] for the trust domain (the filters enforce
///   the same ones for their callers; with grants present the arbiter checks
///   them for the lock tier's callers too, ADR-19);
/// - for each self client in `self_clients` (the sidecar's pod SVID), `acquire`
///   on every prefix those grants name: in the harness one sidecar fronts the
///   application every test identity calls, so its own identity may lock what
///   its filter lets any of them lock. The filter still checks each caller's own
///   grants first; the arbiter records the hold under the sidecar's identity,
///   the caller only as `unverified_caller` (docs/DEPLOY.md section 10).
pub fn sidecar_grants(trust_domain: &str, self_clients: &[String]) -> Result<String> {
    let path = crate::paths::frozen_bin_dir()
        .map(|d| d.join(SHIPPED_GRANTS))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| crate::paths::repo_root().join(SHIPPED_GRANTS));
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let all: Vec<serde_json::Value> =
        serde_json::from_str(&text).with_context(|| format!("{}: not a JSON list of grants", path.display()))?;
    let td = format!("spiffe://{trust_domain}/");
    let ours: Vec<&serde_json::Value> =
        all.iter().filter(|g| g["identity"].as_str().is_some_and(|i| i.starts_with(&td))).collect();
    ensure!(!ours.is_empty(), "{}: no grant for trust domain {trust_domain}", path.display());
    let mut prefixes: Vec<&str> = Vec::new();
    for p in ours.iter().filter_map(|g| g["prefixes"].as_array()).flatten().filter_map(|p| p.as_str()) {
        if !prefixes.contains(&p) {
            prefixes.push(p);
        }
    }
    let mut yaml = String::from("grants:\n");
    for g in &ours {
        yaml.push_str(&format!("  - {g}\n"));
    }
    for id in self_clients {
        let g = serde_json::json!({ "identity": id, "prefixes": prefixes, "operations": ["acquire"] });
        yaml.push_str(&format!("  - {g}\n"));
    }
    Ok(yaml)
}

/// `registry` with [`sidecar_grants`] appended, unless it declares a top-level
/// `grants:` of its own (then the scenario owns the LockGrants, and must grant
/// the sidecar's identity itself): the registry of an arbiter the shipped inbound
/// sidecar calls (a self client, which the arbiter refuses without LockGrants).
pub fn registry_with_sidecar_grants(registry: &str, trust_domain: &str, self_clients: &[String]) -> Result<String> {
    if registry.lines().any(|l| l.starts_with("grants:")) {
        return Ok(registry.to_owned());
    }
    let mut out = registry.to_owned();
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str("# Added by the harness: LockGrant documents (the inbound sidecar is a self client).\n");
    out.push_str(&sidecar_grants(trust_domain, self_clients)?);
    Ok(out)
}

/// The arbiter binary, or a fix-it error.
pub fn arbiter_bin() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("ARBITER_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let path = profile_dir().join("lockmesh-extproc");
    if !path.is_file() {
        bail!(
            "arbiter not built: run cargo build -p lockmesh-extproc (scripts/test does it); looked for {}",
            path.display()
        );
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_documented_fields() {
        let dir = tempfile::tempdir().unwrap();
        let pki = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
        let yaml = ArbiterProcess::builder(&pki)
            .etcd_endpoints(vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()])
            .root("/t/x-1")
            .extra_yaml("future_field: 1")
            .render(10, 11, Path::new("/r/registry.yaml"));
        let d = pki.dir().display();
        assert_eq!(
            yaml,
            format!(
                r#"listen: "127.0.0.1:10"
admin_listen: "127.0.0.1:11"
tls:
  cert: "{d}/arbiter.pem"
  key: "{d}/arbiter-key.pem"
  client_ca: "{d}/ca.pem"
  allowed_clients: ["spiffe://lockmesh.test/lockmesh/envoy"]
etcd:
  endpoints: ["http://127.0.0.1:1", "http://127.0.0.1:2"]
  root: "/t/x-1"
registry_file: "/r/registry.yaml"
max_wait_ms: 30000
future_field: 1
"#
            )
        );
    }

    /// The inbound sidecar's arbiter: the sidecar a self client beside the
    /// vouching Envoy, and a registry whose LockGrants the arbiter's loader takes
    /// (the grants the filters carry for the test trust domain, and the sidecar's
    /// own); a registry with grants of its own is left alone.
    #[test]
    fn an_inbound_sidecars_arbiter_lists_it_as_a_self_client_with_grants() {
        let dir = tempfile::tempdir().unwrap();
        let pki = DevPki::generate(dir.path(), "lockmesh.test").unwrap();
        let store = crate::envoy::sidecar_svid(&pki).unwrap();
        assert_eq!(store.spiffe_id, "spiffe://lockmesh.test/ns/payments/sa/store");
        let b = ArbiterProcess::builder(&pki)
            .etcd_endpoints(vec!["http://127.0.0.1:1".into()])
            .root("/t/x")
            .tls_reload_ms(200)
            .inbound_sidecar(&store.spiffe_id);
        let yaml = b.render(10, 11, Path::new("/r/registry.yaml"));
        assert!(
            yaml.contains(
                "  allowed_clients: [\"spiffe://lockmesh.test/lockmesh/envoy\"]\n  \
                 self_clients: [\"spiffe://lockmesh.test/ns/payments/sa/store\"]\n  reload_ms: 200\netcd:\n"
            ),
            "{yaml}"
        );
        let registry = b.registry_text().unwrap();
        assert!(registry.starts_with(DEFAULT_TEST_REGISTRY), "{registry}");
        let doc: serde_json::Value = serde_saphyr::from_str(&registry).unwrap();
        let grants = doc["grants"].as_array().unwrap();
        let raw: Vec<lockmesh_core::grant::RawGrant> =
            grants.iter().map(|g| serde_json::from_value(g.clone()).unwrap()).collect();
        let set = lockmesh_core::grant::GrantSet::try_from_raw(&raw).unwrap();
        let key = |k: &str| lockmesh_core::LockKey::parse(k.as_bytes()).unwrap();
        let acquire = lockmesh_core::grant::Operation::Acquire;
        for k in ["payments/order-1", "short/job-1", "billing/x", "load/tax-1"] {
            assert!(set.allowed(&store.spiffe_id, &key(k), acquire), "the sidecar may lock {k}");
        }
        let worker = pki.workload_spiffe_id("payments", "worker");
        assert!(set.allowed(&worker, &key("payments/a"), acquire));
        assert!(!set.allowed(&worker, &key("billing/a"), acquire), "the shipped grants, not a blanket one");
        assert!(!set.allowed(&store.spiffe_id, &key("payments/a"), lockmesh_core::grant::Operation::Admin));

        let own = format!("{DEFAULT_TEST_REGISTRY}grants:\n  - {{ identity: \"spiffe://lockmesh.test/\", prefixes: [x], operations: [acquire] }}\n");
        assert_eq!(registry_with_sidecar_grants(&own, "lockmesh.test", &[store.spiffe_id]).unwrap(), own);
    }
}
