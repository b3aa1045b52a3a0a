//! Real Envoy processes started from the shipped `envoy-config/*.yaml` files.
//!
//! The shipped configs use fixed defaults that the harness rewrites (text
//! substitution, so the file under test is the file that ships):
//!
//! | In the file | Becomes |
//! | --- | --- |
//! | `port_value: 18000` | the downstream listener port |
//! | `port_value: 18001` | the admin port |
//! | `port_value: 18051` | the arbiter's ext_proc gRPC port |
//! | `port_value: 18080` | the test backend's port |
//! | `run/certs/` | the Envoy's own TLS directory (absolute, trailing `/`), see below |
//! | `envoy-config/sds` | the Envoy's own copy of the SDS secrets (`envoy-config/sds/*.yaml`) |
//! | `target/wasm32-wasip1/release/lockmesh_wasm_filter.wasm` | the built module, absolute |
//!
//! Certificates (issue #16 item 3): the shipped configs load every certificate
//! and CA through SDS from `envoy-config/sds/*.yaml`, which name files in
//! `run/certs` and watch that directory. `start` and `validate` give each Envoy a
//! TLS directory laid out as the kubelet lays out a mounted Secret: the files are
//! symlinks `<name> -> ..data/<name>`, `..data` is a symlink to a generation
//! directory holding copies of every file of the `cert_dir` PKI. The SDS files are
//! written beside it with `run/certs` pointing there.
//! [`EnvoyProcess::rotate_certs`] swaps `..data` to a new generation in one
//! rename, as a Secret update does; [`reissued_pki`] makes new certificates from
//! the same CA to rotate to.
//!
//! Ports not given are replaced by fresh free ports, so a test never talks
//! to a stray process on a default port. Extra `(from, to)` replacements are
//! applied first, to the text as shipped, and each must match at least once.
//!
//! Binary: `ENVOY_BIN` or `<repo>/.tools/envoy/envoy` (from `scripts/setup`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use tempfile::TempDir;

use crate::certs::{ClientCert, DevPki, TEST_TRUST_DOMAIN};
use crate::kubelet::{read_plain_files, SecretDir};
use crate::paths::{repo_root, target_dir, temp_dir, tool};
use crate::ports::free_port;
use crate::probe::http_get;
use crate::process::ChildProcess;

/// Shipped default of the downstream listener port.
pub const DEFAULT_LISTENER_PORT: u16 = 18000;
/// Shipped default of the admin port.
pub const DEFAULT_ADMIN_PORT: u16 = 18001;
/// Shipped default of the arbiter (ext_proc) port.
pub const DEFAULT_ARBITER_PORT: u16 = 18051;
/// Shipped default of the upstream backend port.
pub const DEFAULT_UPSTREAM_PORT: u16 = 18080;
/// The certificate path prefix in shipped configs.
pub const CERT_DIR_PREFIX: &str = "run/certs/";
/// The certificate directory as the shipped SDS secrets name and watch it.
pub const CERT_DIR: &str = "run/certs";
/// Where the shipped configs find their SDS secrets (relative to the repository):
/// `envoy-config/sds/<name>.yaml`, watched as a directory.
pub const SDS_DIR: &str = "envoy-config/sds";
/// The Wasm module path in shipped configs (relative to the repository).
pub const WASM_MODULE_PATH: &str = "target/wasm32-wasip1/release/lockmesh_wasm_filter.wasm";

/// How long Envoy may take until admin `/ready` says `LIVE`.
pub const ENVOY_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Options for an [`EnvoyProcess`].
#[derive(Clone, Debug)]
pub struct EnvoyBuilder {
    config: PathBuf,
    listener_port: Option<u16>,
    admin_port: Option<u16>,
    arbiter_port: Option<u16>,
    arbiter_ports: Vec<u16>,
    upstream_port: Option<u16>,
    cert_dir: Option<PathBuf>,
    replacements: Vec<(String, String)>,
    sds_replacements: Vec<(String, String)>,
    concurrency: u32,
    log_level: String,
    test_filter: bool,
}

/// A running Envoy; killed on drop, its logs printed if the test panics.
#[derive(Debug)]
pub struct EnvoyProcess {
    listener_port: u16,
    admin_port: u16,
    config_path: PathBuf,
    tls_dir: PathBuf,
    process: ChildProcess,
    _dir: TempDir,
}

/// The rendered config with the ports it uses.
struct Rendered {
    text: String,
    listener_port: u16,
    admin_port: u16,
}

// === impl EnvoyBuilder ===

impl EnvoyBuilder {
    /// Downstream listener port (replaces `port_value: 18000`). Default: free port.
    pub fn listener_port(mut self, port: u16) -> Self {
        self.listener_port = Some(port);
        self
    }

    /// Admin port (replaces `port_value: 18001`). Default: free port.
    pub fn admin_port(mut self, port: u16) -> Self {
        self.admin_port = Some(port);
        self
    }

    /// Arbiter gRPC port (replaces `port_value: 18051`). Default: an unused free port.
    pub fn arbiter_port(mut self, port: u16) -> Self {
        self.arbiter_port = Some(port);
        self
    }

    /// Several arbiter gRPC ports: the arbiter endpoint entry (the `- endpoint:`
    /// block ending in `port_value: 18051`) is rendered once per port, so the
    /// cluster's ring hash spreads keys over all of them. Overrides
    /// [`EnvoyBuilder::arbiter_port`]; rendering fails if the config has no such
    /// entry.
    pub fn arbiter_ports(mut self, ports: impl IntoIterator<Item = u16>) -> Self {
        self.arbiter_ports = ports.into_iter().collect();
        self
    }

    /// Upstream backend port (replaces `port_value: 18080`). Default: an unused free port.
    pub fn upstream_port(mut self, port: u16) -> Self {
        self.upstream_port = Some(port);
        self
    }

    /// The PKI directory replacing `run/certs/`. Required by `start` when the
    /// config uses certificates; `validate` generates a throwaway PKI otherwise.
    pub fn cert_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cert_dir = Some(dir.into());
        self
    }

    /// Replaces every `from` with `to` in the shipped text, before the standard
    /// substitutions. Rendering fails if `from` does not occur.
    pub fn replace(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.replacements.push((from.into(), to.into()));
        self
    }

    /// Replaces every `from` with `to` in the SDS secrets (`envoy-config/sds/*.yaml`)
    /// this Envoy is given, before the standard substitutions: a planted secret
    /// (say, one that no longer watches its directory). Starting fails if `from`
    /// occurs in none of them.
    pub fn sds_replace(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.sds_replacements.push((from.into(), to.into()));
        self
    }

    /// Loads the test build of the Wasm filter (feature `test-trap`: its
    /// `test_trap_header` traps the VM) instead of the shipped one. Only the
    /// scenario that proves a trapped VM fails closed uses it.
    pub fn test_filter(mut self) -> Self {
        self.test_filter = true;
        self
    }

    /// `--concurrency` (worker threads). Default 2.
    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = n;
        self
    }

    /// `-l` log level. Default `info`.
    pub fn log_level(mut self, level: impl Into<String>) -> Self {
        self.log_level = level.into();
        self
    }

    /// The config text after all substitutions, `run/certs/` pointing at the
    /// `cert_dir` itself. `envoy-config/sds` is left as shipped: only `start` and
    /// `validate` write the SDS secrets and the TLS directory they name.
    pub fn render(&self) -> Result<String> {
        Ok(self.render_inner(self.cert_dir.as_deref(), None)?.text)
    }

    /// Writes the TLS directory (kubelet layout, a copy of `cert_dir`) and the SDS
    /// secrets naming it into `dir`; returns the TLS and SDS directories.
    fn materialize(&self, dir: &Path, cert_dir: &Path) -> Result<(PathBuf, PathBuf)> {
        let tls = dir.join("tls");
        std::fs::create_dir_all(&tls).with_context(|| format!("create {}", tls.display()))?;
        let tls = tls.canonicalize()?;
        SecretDir::create(&tls, &read_plain_files(cert_dir)?)?;
        let sds = dir.join("sds");
        std::fs::create_dir_all(&sds).with_context(|| format!("create {}", sds.display()))?;
        let sds = sds.canonicalize()?;
        let source = sds_source_dir();
        let mut texts = Vec::new();
        for entry in std::fs::read_dir(&source).with_context(|| format!("read SDS secrets {}", source.display()))? {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) == Some("yaml") {
                let text = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
                texts.push((path, text));
            }
        }
        for (from, to) in &self.sds_replacements {
            if !texts.iter().any(|(_, t)| t.contains(from.as_str())) {
                bail!("{}: requested SDS replacement {from:?} not found in any secret", source.display());
            }
            for (_, text) in &mut texts {
                *text = text.replace(from.as_str(), to);
            }
        }
        self.check_secret_files(&texts, cert_dir)?;
        for (path, text) in texts {
            let text = text.replace(CERT_DIR, &tls.display().to_string());
            let name = path.file_name().context("SDS secret file name")?;
            std::fs::write(sds.join(name), text)?;
        }
        Ok((tls, sds))
    }

    /// Fails, naming the file, if an SDS secret the config uses names a
    /// certificate file `cert_dir` lacks (Envoy would only fail to become ready):
    /// the inbound sidecar's own SVID ([`sidecar_svid`]) is not among the fixed
    /// files of a dev PKI.
    fn check_secret_files(&self, secrets: &[(PathBuf, String)], cert_dir: &Path) -> Result<()> {
        let mut config = std::fs::read_to_string(&self.config).unwrap_or_default();
        for (from, to) in &self.replacements {
            config = config.replace(from.as_str(), to);
        }
        for (path, text) in secrets {
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            let used = format!("{SDS_DIR}/{name}");
            if !config.lines().any(|l| !l.trim_start().starts_with('#') && l.contains(&used)) {
                continue;
            }
            let named = format!("filename: {CERT_DIR_PREFIX}");
            let files = text
                .lines()
                .filter(|l| !l.trim_start().starts_with('#'))
                .flat_map(|l| l.split(named.as_str()).skip(1))
                .filter_map(|rest| rest.split([' ', '}', ',']).next());
            for file in files {
                if !cert_dir.join(file).exists() {
                    let hint = if name == SIDECAR_SVID_SDS {
                        ": the inbound sidecar's own SVID, made by envoy::sidecar_svid (StackBuilder::inbound_sidecar \
                         also lists it in the arbiters' tls.self_clients)"
                    } else {
                        ""
                    };
                    bail!(
                        "{}: SDS secret {name} names {file}, which {} lacks{hint}",
                        self.config.display(),
                        cert_dir.display()
                    );
                }
            }
        }
        Ok(())
    }

    fn render_inner(&self, cert_dir: Option<&Path>, sds_dir: Option<&Path>) -> Result<Rendered> {
        let path = &self.config;
        let mut text =
            std::fs::read_to_string(path).with_context(|| format!("read envoy config {}", path.display()))?;
        for (from, to) in &self.replacements {
            if !text.contains(from.as_str()) {
                bail!("{}: requested replacement {from:?} not found in the config", path.display());
            }
            text = text.replace(from.as_str(), to);
        }
        // Every port goes in as a placeholder first and becomes a number only at
        // the end: a port equal to a shipped default (a free port may be 18080)
        // must not be rewritten again by a later substitution.
        let mut ports: Vec<u16> = Vec::new();
        let mut slot = |p: u16| {
            ports.push(p);
            format!("port_value: {PORT_MARK}{}{PORT_MARK}", ports.len() - 1)
        };
        if !self.arbiter_ports.is_empty() {
            let slots: Vec<String> = self.arbiter_ports.iter().map(|p| slot(*p)).collect();
            text = render_endpoints(&text, &slots).with_context(|| format!("{}: arbiter endpoints", path.display()))?;
        }
        let listener_port = self.listener_port.unwrap_or_else(free_port);
        let admin_port = self.admin_port.unwrap_or_else(free_port);
        for (default, port) in [
            (DEFAULT_LISTENER_PORT, Some(listener_port)),
            (DEFAULT_ADMIN_PORT, Some(admin_port)),
            (DEFAULT_ARBITER_PORT, self.arbiter_port),
            (DEFAULT_UPSTREAM_PORT, self.upstream_port),
        ] {
            let from = format!("port_value: {default}");
            if contains_token(&text, &from) {
                let to = slot(port.unwrap_or_else(free_port));
                text = replace_token(&text, &from, &to);
            }
        }
        for (i, p) in ports.iter().enumerate() {
            text = text.replace(&format!("{PORT_MARK}{i}{PORT_MARK}"), &p.to_string());
        }
        if text.contains(CERT_DIR_PREFIX) {
            let Some(dir) = cert_dir else {
                bail!("{} uses {CERT_DIR_PREFIX} but no cert_dir was given", path.display());
            };
            let dir = dir.canonicalize().with_context(|| format!("cert dir {}", dir.display()))?;
            text = text.replace(CERT_DIR_PREFIX, &format!("{}/", dir.display()));
        }
        if let Some(sds) = sds_dir {
            text = text.replace(SDS_DIR, &sds.display().to_string());
        }
        if text.contains(WASM_MODULE_PATH) {
            let module = if self.test_filter { wasm_test_module()? } else { wasm_module()? };
            text = text.replace(WASM_MODULE_PATH, &module.display().to_string());
        }
        Ok(Rendered { text, listener_port, admin_port })
    }

    /// Renders the config, starts Envoy and waits until admin `/ready` is `LIVE`.
    ///
    /// A port the harness picked (listener, admin) can still be bound by another
    /// program on a shared machine between the pick and Envoy's bind (below the
    /// ephemeral range only an explicit bind can take it, `ports`): Envoy then
    /// exits with `Address already in use`, and the start is tried again on new
    /// ports, at most three times. Ports the caller chose are never changed.
    pub async fn start(self) -> Result<EnvoyProcess> {
        let picked = self.listener_port.is_none() && self.admin_port.is_none();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.start_once().await {
                Err(e) if picked && attempt < 3 && format!("{e:#}").contains("Address already in use") => {
                    eprintln!("lockmesh-tests: envoy lost a picked port to another program; starting on new ports");
                }
                r => return r,
            }
        }
    }

    async fn start_once(&self) -> Result<EnvoyProcess> {
        let envoy = envoy_bin()?;
        let dir = temp_dir("envoy-")?;
        let (tls_dir, rendered) = self.render_materialized(dir.path(), self.cert_dir.as_deref())?;
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, &rendered.text)?;
        let log = dir.path().join("envoy.log");
        let args = vec![
            "-c".into(),
            config_path.display().to_string(),
            "--concurrency".into(),
            self.concurrency.to_string(),
            "--disable-hot-restart".into(),
            "--log-path".into(),
            log.display().to_string(),
            "-l".into(),
            self.log_level.clone(),
            "--drain-time-s".into(),
            "1".into(),
            // Envoy flushes its log file every 10 s by default: a failing test's
            // dump (taken while Envoy runs) would miss the lines that explain it.
            "--file-flush-interval-msec".into(),
            "200".into(),
        ];
        let process = ChildProcess::new("envoy", envoy, args, dir.path().join("envoy.stdio.log")).extra_log(log);
        let envoy = EnvoyProcess {
            listener_port: rendered.listener_port,
            admin_port: rendered.admin_port,
            config_path,
            tls_dir,
            process,
            _dir: dir,
        };
        envoy.process.start()?;
        envoy.wait_ready().await?;
        Ok(envoy)
    }

    /// Renders the config and runs `envoy --mode validate` on it.
    ///
    /// The outer error is a harness failure (no binary, bad replacement); the
    /// inner result is Envoy's verdict with its output.
    pub async fn validate(self) -> Result<std::result::Result<String, String>> {
        let envoy = envoy_bin()?;
        let dir = temp_dir("envoy-validate-")?;
        let cert_dir = match &self.cert_dir {
            Some(d) => d.clone(),
            None => {
                let pki = DevPki::generate(dir.path().join("certs"), TEST_TRUST_DOMAIN)?;
                // The application sidecar presents the demo workload's certificate,
                // the inbound sidecar its pod's own.
                pki.client("payments", "worker")?;
                sidecar_svid(&pki)?;
                pki.dir().to_path_buf()
            }
        };
        let (_, rendered) = self.render_materialized(dir.path(), Some(&cert_dir))?;
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, &rendered.text)?;
        let out = tokio::process::Command::new(&envoy)
            .arg("--mode")
            .arg("validate")
            .arg("-c")
            .arg(&config_path)
            .arg("-l")
            .arg(&self.log_level)
            .kill_on_drop(true)
            .output()
            .await
            .with_context(|| format!("run {}", envoy.display()))?;
        let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        Ok(if out.status.success() { Ok(output) } else { Err(output) })
    }
}

impl EnvoyBuilder {
    /// The config rendered for a process in `dir`: given a `cert_dir`, the TLS
    /// directory and the SDS secrets are written there first and `run/certs/`
    /// points at that TLS directory. Returns the TLS directory (`dir/tls`, absent
    /// without a `cert_dir`) and the rendered config.
    fn render_materialized(&self, dir: &Path, cert_dir: Option<&Path>) -> Result<(PathBuf, Rendered)> {
        let Some(cert_dir) = cert_dir else {
            let rendered = self.render_inner(None, None)?;
            if rendered.text.contains(SDS_DIR) {
                bail!("{} uses {SDS_DIR} but no cert_dir was given", self.config.display());
            }
            return Ok((dir.join("tls"), rendered));
        };
        let (tls, sds) = self.materialize(dir, cert_dir)?;
        Ok((tls.clone(), self.render_inner(Some(&tls), Some(&sds))?))
    }
}

// === impl EnvoyProcess ===

impl EnvoyProcess {
    /// A builder for `<repo>/envoy-config/<name>.yaml` (or the frozen copy
    /// `$LOCKMESH_BIN_DIR/envoy-config/<name>.yaml` when there is one); `name`
    /// may also be a path to a YAML file (anything containing `/` or ending in
    /// `.yaml`).
    pub fn builder(name: &str) -> EnvoyBuilder {
        let frozen = crate::paths::frozen_bin_dir()
            .map(|d| d.join("envoy-config").join(format!("{name}.yaml")))
            .filter(|p| p.is_file());
        let config = if name.contains('/') || name.ends_with(".yaml") {
            PathBuf::from(name)
        } else if let Some(p) = frozen {
            p
        } else {
            repo_root().join("envoy-config").join(format!("{name}.yaml"))
        };
        EnvoyBuilder {
            config,
            listener_port: None,
            admin_port: None,
            arbiter_port: None,
            arbiter_ports: Vec::new(),
            upstream_port: None,
            cert_dir: None,
            replacements: Vec::new(),
            sds_replacements: Vec::new(),
            concurrency: 2,
            log_level: "info".into(),
            test_filter: false,
        }
    }

    /// Runs `envoy --mode validate` on `config_path` (a path, or a name in
    /// `envoy-config/` as for [`EnvoyProcess::builder`]) after the standard
    /// substitutions (throwaway PKI, free ports). See [`EnvoyBuilder::validate`].
    pub async fn validate(config_path: impl AsRef<Path>) -> Result<std::result::Result<String, String>> {
        let path = config_path.as_ref().display().to_string();
        Self::builder(&path).validate().await
    }

    /// The downstream listener port.
    pub fn listener_port(&self) -> u16 {
        self.listener_port
    }

    /// The admin port.
    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }

    /// The rendered config file in use.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// This Envoy's TLS directory (kubelet Secret layout: `<name> -> ..data/<name>`),
    /// which its SDS secrets name and watch.
    pub fn tls_dir(&self) -> &Path {
        &self.tls_dir
    }

    /// Rotates this Envoy's certificates as a Kubernetes Secret update does: a new
    /// generation directory holding the current files overlaid with every file of
    /// `from` (for example a [`reissued_pki`] directory), then `..data` switched to
    /// it by one `rename`, then the old generation removed. Envoy, watching the
    /// directory through its SDS secrets, loads the new files without a restart;
    /// returns once the swap is done (Envoy's reload follows within moments: poll
    /// [`EnvoyProcess::cert_serials`] or a handshake).
    pub fn rotate_certs(&self, from: &Path) -> Result<()> {
        SecretDir::open(&self.tls_dir).swap(&read_plain_files(from)?)
    }

    /// The serial numbers (lowercase hex, as Envoy's admin `/certs` prints them) of
    /// every certificate Envoy has loaded (listener and cluster chains, CAs), in
    /// the order `/certs` lists them.
    pub async fn cert_serials(&self) -> Result<Vec<String>> {
        let resp = http_get(self.admin_port, "/certs").await?;
        if resp.status != 200 {
            bail!("envoy /certs: {} {}", resp.status, resp.body);
        }
        let doc: serde_json::Value = serde_json::from_str(&resp.body).context("envoy /certs is not JSON")?;
        let mut out = Vec::new();
        collect_serials(&doc, &mut out);
        Ok(out)
    }

    /// SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// SIGSTOP.
    pub fn pause(&self) -> Result<()> {
        self.process.pause()
    }

    /// SIGCONT.
    pub fn resume(&self) -> Result<()> {
        self.process.resume()
    }

    /// Stops (SIGTERM, SIGKILL after 5 s), starts again with the same config
    /// and ports, and waits until ready.
    pub async fn restart(&self) -> Result<()> {
        self.process.stop(Duration::from_secs(5)).await?;
        self.process.start()?;
        self.wait_ready().await
    }

    /// The main log file (`--log-path`).
    pub fn log_path(&self) -> PathBuf {
        self.config_path.with_file_name("envoy.log")
    }

    /// Admin `/stats` as text.
    pub async fn stats(&self) -> Result<String> {
        let resp = http_get(self.admin_port, "/stats").await?;
        if resp.status != 200 {
            bail!("envoy /stats: {} {}", resp.status, resp.body);
        }
        Ok(resp.body)
    }

    /// The value of counter or gauge `name`, `None` if Envoy has no such stat.
    pub async fn stat(&self, name: &str) -> Result<Option<u64>> {
        Ok(parse_stat(&self.stats().await?, name))
    }

    async fn wait_ready(&self) -> Result<()> {
        let port = self.admin_port;
        self.process
            .wait_ready(ENVOY_READY_TIMEOUT, async || {
                let resp = http_get(port, "/ready").await?;
                if resp.status != 200 || resp.body.trim() != "LIVE" {
                    bail!("/ready: {} {}", resp.status, resp.body.trim());
                }
                Ok(())
            })
            .await
    }
}

/// A new PKI in `dir` with the same CA (and rogue CA) as `pki` and freshly issued
/// leaves: the same names, identities and SANs, new keys and new serial numbers.
/// Rotating an Envoy to it ([`EnvoyProcess::rotate_certs`]) keeps every peer's
/// trust: the CA does not change.
pub fn reissued_pki(pki: &DevPki, dir: impl AsRef<Path>) -> Result<DevPki> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    for name in ["ca.pem", "ca-key.pem", "rogue-ca.pem", "rogue-ca-key.pem", "trust-domain"] {
        std::fs::copy(pki.dir().join(name), dir.join(name)).with_context(|| format!("copy {name}"))?;
    }
    DevPki::generate(dir, pki.trust_domain())
}

/// The SDS secret (in [`SDS_DIR`]) the shipped inbound sidecar presents to the
/// arbiters: its pod's own SVID, a self client of the arbiter (never the lock
/// tier's vouching `arbiter-client-cert.yaml`).
pub const SIDECAR_SVID_SDS: &str = "sidecar-svid.yaml";

/// The workload `(namespace, service account)` of the certificate the shipped
/// inbound sidecar presents to the arbiters: its SDS secret ([`SIDECAR_SVID_SDS`])
/// names `run/certs/<ns>_<sa>.pem` (`payments_store.pem`, the demo store's pod).
pub fn sidecar_svid_name() -> Result<(String, String)> {
    let path = sds_source_dir().join(SIDECAR_SVID_SDS);
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let file = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|l| l.split("certificate_chain: { filename: ").nth(1))
        .and_then(|rest| rest.split([' ', '}']).next())
        .with_context(|| format!("{}: no certificate_chain filename", path.display()))?;
    let stem = file
        .strip_prefix(CERT_DIR_PREFIX)
        .and_then(|f| f.strip_suffix(".pem"))
        .with_context(|| format!("{}: {file} is not {CERT_DIR_PREFIX}<name>.pem", path.display()))?;
    let (ns, sa) = stem
        .split_once('_')
        .with_context(|| format!("{}: {file} is not a workload's <ns>_<sa>.pem", path.display()))?;
    Ok((ns.to_owned(), sa.to_owned()))
}

/// The shipped inbound sidecar's own certificate in `pki` ([`sidecar_svid_name`]:
/// `spiffe://<td>/ns/payments/sa/store`), created if missing. An arbiter the
/// sidecar calls must list its SPIFFE ID in `tls.self_clients`
/// ([`crate::ArbiterBuilder::inbound_sidecar`], [`crate::StackBuilder::inbound_sidecar`]).
pub fn sidecar_svid(pki: &DevPki) -> Result<ClientCert> {
    let (ns, sa) = sidecar_svid_name()?;
    pki.client(&ns, &sa)
}

/// Where the SDS secrets come from: the frozen copy's `envoy-config/sds` when
/// there is one, else the repository's.
fn sds_source_dir() -> PathBuf {
    crate::paths::frozen_bin_dir()
        .map(|d| d.join(SDS_DIR))
        .filter(|d| d.is_dir())
        .unwrap_or_else(|| repo_root().join(SDS_DIR))
}

/// Every `serial_number` string under `v`, in document order.
fn collect_serials(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("serial_number", serde_json::Value::String(s)) => out.push(s.to_ascii_lowercase()),
                    _ => collect_serials(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_serials(x, out)),
        _ => {}
    }
}

/// The built Wasm filter, or a fix-it error.
pub fn wasm_module() -> Result<PathBuf> {
    let path = match crate::paths::frozen_bin_dir() {
        Some(dir) => dir.join("lockmesh_wasm_filter.wasm"),
        None => target_dir().join("wasm32-wasip1/release/lockmesh_wasm_filter.wasm"),
    };
    if !path.is_file() {
        bail!(
            "wasm filter not built: run cargo build --release --target wasm32-wasip1 -p lockmesh-wasm-filter (scripts/test does it); looked for {}",
            path.display()
        );
    }
    Ok(path)
}

/// The test build of the Wasm filter (`--features test-trap`, which
/// `scripts/test` builds first and copies beside the shipped module), or a fix-it
/// error.
pub fn wasm_test_module() -> Result<PathBuf> {
    let name = "lockmesh_wasm_filter_test.wasm";
    let path = match crate::paths::frozen_bin_dir() {
        Some(dir) => dir.join(name),
        None => target_dir().join("wasm32-wasip1/release").join(name),
    };
    if !path.is_file() {
        bail!(
            "test build of the wasm filter missing: run scripts/test, or cargo build --release --target \
             wasm32-wasip1 -p lockmesh-wasm-filter --features test-trap and copy the module to {}",
            path.display()
        );
    }
    Ok(path)
}

/// The Envoy binary (`ENVOY_BIN` or the pinned install).
pub fn envoy_bin() -> Result<PathBuf> {
    tool("ENVOY_BIN", repo_root().join(".tools/envoy/envoy"), "envoy")
}

/// Finds `name: <u64>` in admin `/stats` text.
fn parse_stat(stats: &str, name: &str) -> Option<u64> {
    stats.lines().find_map(|line| {
        let (key, value) = line.split_once(": ")?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

/// Marks a port placeholder while a config is rendered (never in a shipped file).
const PORT_MARK: &str = "@@lockmesh-port@@";

/// Repeats every `- endpoint:` entry that ends with `port_value: 18051` once per
/// port (each with its own `port_value: ...` text from `ports`), keeping its
/// indentation: a config may have several clusters of the arbiters (the key's
/// ring hash, and the transparent filter's own calls).
fn render_endpoints(text: &str, ports: &[String]) -> Result<String> {
    let needle = format!("port_value: {DEFAULT_ARBITER_PORT}");
    let (mut out, mut rest, mut found) = (String::with_capacity(text.len()), text, false);
    while let Some((at, _)) = rest.match_indices(&needle).find(|(i, _)| !next_is_digit(rest, i + needle.len())) {
        let Some(entry) = rest[..at].rfind("- endpoint:") else {
            bail!("{needle:?} is not inside a `- endpoint:` entry");
        };
        let start = rest[..entry].rfind('\n').map_or(0, |i| i + 1);
        let end = rest[at..].find('\n').map_or(rest.len(), |i| at + i + 1);
        let block = &rest[start..end];
        out.push_str(&rest[..start]);
        out.extend(ports.iter().map(|p| replace_token(block, &needle, p)));
        rest = &rest[end..];
        found = true;
    }
    if !found {
        bail!("no {needle:?} to render arbiter endpoints at");
    }
    out.push_str(rest);
    Ok(out)
}

/// Whether `needle` occurs not followed by another digit.
fn contains_token(text: &str, needle: &str) -> bool {
    text.match_indices(needle).any(|(i, _)| !next_is_digit(text, i + needle.len()))
}

/// Replaces `needle` wherever it is not followed by another digit
/// (`port_value: 18000` must not rewrite `port_value: 180001`).
fn replace_token(text: &str, needle: &str, to: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = 0;
    for (i, _) in text.match_indices(needle) {
        let end = i + needle.len();
        if !next_is_digit(text, end) {
            out.push_str(&text[rest..i]);
            out.push_str(to);
            rest = end;
        }
    }
    out.push_str(&text[rest..]);
    out
}

fn next_is_digit(text: &str, at: usize) -> bool {
    text[at..].chars().next().is_some_and(|c| c.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn substitutes_ports_certs_and_extras() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("x.yaml");
        std::fs::write(
            &cfg,
            "a: {port_value: 18000}\nb: {port_value: 180001}\nadmin: {port_value: 18001}\n\
             arb: {port_value: 18051}\ncert: run/certs/envoy.pem\nmode: strict\n",
        )
        .unwrap();
        let builder = EnvoyProcess::builder(cfg.to_str().unwrap())
            .listener_port(1111)
            .admin_port(2222)
            .arbiter_port(3333)
            .cert_dir(dir.path())
            .replace("mode: strict", "mode: lax");
        let text = builder.render().unwrap();
        let abs = dir.path().canonicalize().unwrap();
        assert_eq!(
            text,
            format!(
                "a: {{port_value: 1111}}\nb: {{port_value: 180001}}\nadmin: {{port_value: 2222}}\n\
                 arb: {{port_value: 3333}}\ncert: {}/envoy.pem\nmode: lax\n",
                abs.display()
            )
        );
        let missing = builder.replace("no such text", "x").render().unwrap_err();
        assert!(missing.to_string().contains("not found"), "{missing}");
        let no_certs = EnvoyProcess::builder(cfg.to_str().unwrap()).render().unwrap_err();
        assert!(no_certs.to_string().contains("no cert_dir"), "{no_certs}");
    }

    #[test]
    fn renders_one_endpoint_per_arbiter() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("x.yaml");
        let entry =
            "          - lb_endpoints:\n              - endpoint:\n                  address:\n                    \
                     socket_address: { address: 127.0.0.1, port_value: 18051 }\n";
        std::fs::write(&cfg, format!("a: 1\n{entry}tls: {{}}\n")).unwrap();
        let text = EnvoyProcess::builder(cfg.to_str().unwrap()).arbiter_ports([7001, 7002]).render().unwrap();
        let one = |p: u16| {
            format!(
                "              - endpoint:\n                  address:\n                    \
                 socket_address: {{ address: 127.0.0.1, port_value: {p} }}\n"
            )
        };
        assert_eq!(text, format!("a: 1\n          - lb_endpoints:\n{}{}tls: {{}}\n", one(7001), one(7002)));
        // Every cluster of the arbiters gets them.
        std::fs::write(&cfg, format!("a: 1\n{entry}b: 2\n{entry}tls: {{}}\n")).unwrap();
        let text = EnvoyProcess::builder(cfg.to_str().unwrap()).arbiter_ports([7001, 7002]).render().unwrap();
        let both = format!("          - lb_endpoints:\n{}{}", one(7001), one(7002));
        assert_eq!(text, format!("a: 1\n{both}b: 2\n{both}tls: {{}}\n"));
        std::fs::write(&cfg, "a: {port_value: 18051}\n").unwrap();
        let err = EnvoyProcess::builder(cfg.to_str().unwrap()).arbiter_ports([1]).render().unwrap_err();
        assert!(format!("{err:#}").contains("endpoint"), "{err:#}");
    }

    /// A port equal to a shipped default (a free port may be 18080, as happened
    /// to an arbiter in a full run) stays what it was given: no later
    /// substitution rewrites it.
    #[test]
    fn ports_equal_to_shipped_defaults_are_not_rewritten_again() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("x.yaml");
        let entry = "  - endpoint:\n      socket_address: { port_value: 18051 }\n";
        std::fs::write(
            &cfg,
            format!("l: {{port_value: 18000}}\nadmin: {{port_value: 18001}}\n{entry}up: {{port_value: 18080}}\n"),
        )
        .unwrap();
        let text = EnvoyProcess::builder(cfg.to_str().unwrap())
            .listener_port(18080)
            .admin_port(18051)
            .upstream_port(18000)
            .arbiter_ports([18001, 18080])
            .render()
            .unwrap();
        let one = |p: u16| format!("  - endpoint:\n      socket_address: {{ port_value: {p} }}\n");
        assert_eq!(
            text,
            format!(
                "l: {{port_value: 18080}}\nadmin: {{port_value: 18051}}\n{}{}up: {{port_value: 18000}}\n",
                one(18001),
                one(18080)
            )
        );
    }

    #[test]
    fn collects_serials_from_admin_certs() {
        let doc = serde_json::json!({"certificates": [{"ca_cert": [{"serial_number": "0A"}],
            "cert_chain": [{"serial_number": "bc", "subject_alt_names": []}]}]});
        let mut out = Vec::new();
        collect_serials(&doc, &mut out);
        assert_eq!(out, ["0a", "bc"]);
    }

    #[test]
    fn parses_stats() {
        let stats = "http.x.rq_total: 7\ncluster.a.upstream_rq_time: P0(nan,1)\ngauge.y: 0\n";
        assert_eq!(parse_stat(stats, "http.x.rq_total"), Some(7));
        assert_eq!(parse_stat(stats, "gauge.y"), Some(0));
        assert_eq!(parse_stat(stats, "cluster.a.upstream_rq_time"), None);
        assert_eq!(parse_stat(stats, "missing"), None);
    }
}
