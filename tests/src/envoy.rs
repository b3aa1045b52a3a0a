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
//! | `run/certs/` | the test's PKI directory (absolute, trailing `/`) |
//! | `target/wasm32-wasip1/release/lockmesh_wasm_filter.wasm` | the built module, absolute |
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

use crate::certs::{DevPki, TEST_TRUST_DOMAIN};
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

    /// The config text after all substitutions.
    pub fn render(&self) -> Result<String> {
        Ok(self.render_inner(self.cert_dir.as_deref())?.text)
    }

    fn render_inner(&self, cert_dir: Option<&Path>) -> Result<Rendered> {
        let path = &self.config;
        let mut text =
            std::fs::read_to_string(path).with_context(|| format!("read envoy config {}", path.display()))?;
        for (from, to) in &self.replacements {
            if !text.contains(from.as_str()) {
                bail!("{}: requested replacement {from:?} not found in the config", path.display());
            }
            text = text.replace(from.as_str(), to);
        }
        if !self.arbiter_ports.is_empty() {
            text = render_endpoints(&text, &self.arbiter_ports)
                .with_context(|| format!("{}: arbiter endpoints", path.display()))?;
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
                let to = format!("port_value: {}", port.unwrap_or_else(free_port));
                text = replace_token(&text, &from, &to);
            }
        }
        if text.contains(CERT_DIR_PREFIX) {
            let Some(dir) = cert_dir else {
                bail!("{} uses {CERT_DIR_PREFIX} but no cert_dir was given", path.display());
            };
            let dir = dir.canonicalize().with_context(|| format!("cert dir {}", dir.display()))?;
            text = text.replace(CERT_DIR_PREFIX, &format!("{}/", dir.display()));
        }
        if text.contains(WASM_MODULE_PATH) {
            let module = if self.test_filter { wasm_test_module()? } else { wasm_module()? };
            text = text.replace(WASM_MODULE_PATH, &module.display().to_string());
        }
        Ok(Rendered { text, listener_port, admin_port })
    }

    /// Renders the config, starts Envoy and waits until admin `/ready` is `LIVE`.
    pub async fn start(self) -> Result<EnvoyProcess> {
        let envoy = envoy_bin()?;
        let rendered = self.render_inner(self.cert_dir.as_deref())?;
        let dir = temp_dir("envoy-")?;
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
        ];
        let process = ChildProcess::new("envoy", envoy, args, dir.path().join("envoy.stdio.log")).extra_log(log);
        let envoy = EnvoyProcess {
            listener_port: rendered.listener_port,
            admin_port: rendered.admin_port,
            config_path,
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
                // The application sidecar presents the demo workload's certificate.
                pki.client("payments", "worker")?;
                pki.dir().to_path_buf()
            }
        };
        let rendered = self.render_inner(Some(&cert_dir))?;
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

/// Repeats the `- endpoint:` entry that ends with `port_value: 18051` once per
/// port (each with its port), keeping its indentation.
fn render_endpoints(text: &str, ports: &[u16]) -> Result<String> {
    let needle = format!("port_value: {DEFAULT_ARBITER_PORT}");
    let Some((at, _)) = text.match_indices(&needle).find(|(i, _)| !next_is_digit(text, i + needle.len())) else {
        bail!("no {needle:?} to render arbiter endpoints at");
    };
    let Some(entry) = text[..at].rfind("- endpoint:") else {
        bail!("{needle:?} is not inside a `- endpoint:` entry");
    };
    let start = text[..entry].rfind('\n').map_or(0, |i| i + 1);
    let end = text[at..].find('\n').map_or(text.len(), |i| at + i + 1);
    let block = &text[start..end];
    let rendered: String = ports.iter().map(|p| replace_token(block, &needle, &format!("port_value: {p}"))).collect();
    Ok(format!("{}{rendered}{}", &text[..start], &text[end..]))
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
        std::fs::write(&cfg, "a: {port_value: 18051}\n").unwrap();
        let err = EnvoyProcess::builder(cfg.to_str().unwrap()).arbiter_ports([1]).render().unwrap_err();
        assert!(format!("{err:#}").contains("endpoint"), "{err:#}");
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
