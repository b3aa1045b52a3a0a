//! Fencing pieces of the harness: the grant signing key, a tiny key-value HTTP
//! store ([`KvStore`]) and fence-proxy as a real process ([`FenceProxyProcess`]).
//!
//! Binaries: `FENCE_PROXY_BIN` / `PAUSEKIT_BIN`, else `<target>/<profile>/...`;
//! build them with `cargo build -p lockmesh-fence-proxy`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Router;
use tempfile::TempDir;
use tokio::task::JoinHandle;

use crate::paths::{profile_dir, temp_dir};
use crate::ports::{self, free_port};
use crate::probe::http_get;
use crate::process::ChildProcess;

pub use lockmesh_devcerts::signing::{ensure_signing_key, SigningKey, DEV_KEY_ID, SIGNING_KEY_FILE, SIGNING_PUB_FILE};

/// One request the store saw.
#[derive(Clone, Debug)]
pub struct StoreRequest {
    pub method: String,
    pub path: String,
    /// Body as text.
    pub body: String,
    /// Headers, names lowercase.
    pub headers: Vec<(String, String)>,
}

#[derive(Default)]
struct KvState {
    data: Mutex<HashMap<String, String>>,
    seen: Mutex<Vec<StoreRequest>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// A tiny HTTP key-value store: `PUT`/`POST` store the body under the path, `GET`
/// returns it (404 if none), `DELETE` removes it. Every request is recorded. A
/// request with `x-test-delay-ms: N` is answered N ms later; the most requests in
/// flight at once is recorded.
pub struct KvStore {
    port: u16,
    state: Arc<KvState>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for KvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvStore({})", self.port)
    }
}

impl KvStore {
    /// Starts on a free loopback port.
    pub async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        ports::reserve(port);
        let state = Arc::new(KvState::default());
        let app = Router::new().fallback(kv).with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { port, state, task })
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The value stored under `path`.
    pub fn get(&self, path: &str) -> Option<String> {
        self.state.data.lock().unwrap_or_else(|p| p.into_inner()).get(path).cloned()
    }

    /// Every request seen.
    pub fn requests(&self) -> Vec<StoreRequest> {
        self.state.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The most requests that were in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }
}

impl Drop for KvStore {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn kv(
    State(s): State<Arc<KvState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let n = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    s.max_in_flight.fetch_max(n, Ordering::SeqCst);
    let path = uri.path().to_owned();
    let body = String::from_utf8_lossy(&body).into_owned();
    s.seen.lock().unwrap_or_else(|p| p.into_inner()).push(StoreRequest {
        method: method.to_string(),
        path: path.clone(),
        body: body.clone(),
        headers: headers
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect(),
    });
    if let Some(ms) = headers.get(crate::backend::DELAY_HEADER).and_then(|v| v.to_str().ok()?.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let r = {
        let mut d = s.data.lock().unwrap_or_else(|p| p.into_inner());
        match method {
            Method::GET | Method::HEAD => match d.get(&path) {
                Some(v) => (StatusCode::OK, v.clone()),
                None => (StatusCode::NOT_FOUND, String::new()),
            },
            Method::DELETE => {
                d.remove(&path);
                (StatusCode::OK, String::new())
            }
            _ => {
                d.insert(path, body);
                (StatusCode::OK, "stored".to_owned())
            }
        }
    };
    s.in_flight.fetch_sub(1, Ordering::SeqCst);
    r
}

/// Options for a [`FenceProxyProcess`].
#[derive(Clone, Debug)]
pub struct FenceProxyBuilder {
    upstream_port: u16,
    trusted: Vec<(String, PathBuf)>,
    routes_yaml: String,
    extra_yaml: Vec<String>,
    marks_dir: Option<PathBuf>,
    envs: Vec<(String, String)>,
    from_env: bool,
    upstream_timeout_ms: u64,
}

/// A running fence-proxy; killed on drop.
#[derive(Debug)]
pub struct FenceProxyProcess {
    port: u16,
    admin_port: u16,
    marks_dir: PathBuf,
    config_path: PathBuf,
    process: ChildProcess,
    _dir: TempDir,
}

impl FenceProxyBuilder {
    /// The `routes:` block (YAML, top-level key included).
    pub fn routes(mut self, yaml: impl Into<String>) -> Self {
        self.routes_yaml = yaml.into();
        self
    }

    /// Trusts another public key.
    pub fn trust(mut self, kid: &str, pub_file: &Path) -> Self {
        self.trusted.push((kid.to_owned(), pub_file.to_owned()));
        self
    }

    /// An extra top-level YAML line.
    pub fn extra_yaml(mut self, line: impl Into<String>) -> Self {
        self.extra_yaml.push(line.into());
        self
    }

    /// An environment variable for the fence-proxy process.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// Keep the marks in `dir` (default: the process's temp dir).
    pub fn marks_dir(mut self, dir: &Path) -> Self {
        self.marks_dir = Some(dir.to_owned());
        self
    }

    /// `upstream_timeout_ms` (default 3000).
    pub fn upstream_timeout_ms(mut self, ms: u64) -> Self {
        self.upstream_timeout_ms = ms;
        self
    }

    /// Give `listen`, `admin_listen`, `upstream` and `marks_dir` in the
    /// `LOCKMESH_FENCE_*` variables, as the injector does, and write decoys (other
    /// free ports, a dead upstream, another directory) into the file: the fence only
    /// becomes ready, and only reaches the store, if the variables win.
    pub fn addresses_from_env(mut self) -> Self {
        self.from_env = true;
        self
    }

    /// Writes the config, starts the fence and waits for `/readyz`.
    pub async fn start(mut self) -> Result<FenceProxyProcess> {
        let dir = temp_dir("fence-")?;
        let (port, admin_port) = (free_port(), free_port());
        let marks_dir = self.marks_dir.clone().unwrap_or_else(|| dir.path().join("marks"));
        let upstream = format!("http://127.0.0.1:{}", self.upstream_port);
        let (f_port, f_admin, f_upstream, f_marks) = if self.from_env {
            self.envs.extend([
                ("LOCKMESH_FENCE_LISTEN".to_owned(), format!("127.0.0.1:{port}")),
                ("LOCKMESH_FENCE_ADMIN_LISTEN".to_owned(), format!("127.0.0.1:{admin_port}")),
                ("LOCKMESH_FENCE_UPSTREAM".to_owned(), upstream),
                ("LOCKMESH_FENCE_MARKS_DIR".to_owned(), marks_dir.display().to_string()),
            ]);
            (free_port(), free_port(), format!("http://127.0.0.1:{}", free_port()), dir.path().join("decoy-marks"))
        } else {
            (port, admin_port, upstream, marks_dir.clone())
        };
        let mut yaml = format!(
            "listen: \"127.0.0.1:{f_port}\"\nadmin_listen: \"127.0.0.1:{f_admin}\"\nupstream: \"{f_upstream}\"\nmarks_dir: {:?}\nupstream_timeout_ms: {}\ntrusted_keys:\n",
            f_marks.display().to_string(),
            self.upstream_timeout_ms
        );
        for (kid, f) in &self.trusted {
            yaml.push_str(&format!("  - {{ key_id: {kid:?}, public_key_file: {:?} }}\n", f.display().to_string()));
        }
        yaml.push_str(&self.routes_yaml);
        yaml.push('\n');
        for l in &self.extra_yaml {
            yaml.push_str(l);
            yaml.push('\n');
        }
        let config_path = dir.path().join("fence.yaml");
        std::fs::write(&config_path, yaml)?;
        let mut process = ChildProcess::new(
            "fence-proxy",
            fence_proxy_bin()?,
            vec!["--config".into(), config_path.display().to_string()],
            dir.path().join("fence.log"),
        )
        .env("RUST_LOG", "info");
        for (k, v) in &self.envs {
            process = process.env(k, v);
        }
        let f = FenceProxyProcess { port, admin_port, marks_dir, config_path, process, _dir: dir };
        f.process.start()?;
        f.wait_ready().await?;
        Ok(f)
    }
}

impl FenceProxyProcess {
    /// A builder for a fence in front of `127.0.0.1:upstream_port`.
    pub fn builder(upstream_port: u16) -> FenceProxyBuilder {
        FenceProxyBuilder {
            upstream_port,
            trusted: Vec::new(),
            routes_yaml: String::new(),
            extra_yaml: Vec::new(),
            marks_dir: None,
            envs: Vec::new(),
            from_env: false,
            upstream_timeout_ms: 3000,
        }
    }

    /// Client-facing port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Admin port.
    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }

    /// The marks directory.
    pub fn marks_dir(&self) -> &Path {
        &self.marks_dir
    }

    /// The config file.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// SIGTERM and wait.
    pub async fn stop(&self) -> Result<()> {
        self.process.stop(Duration::from_secs(10)).await
    }

    /// Stop, start again with the same config and marks, wait until ready.
    pub async fn restart(&self) -> Result<()> {
        self.stop().await?;
        self.process.start()?;
        self.wait_ready().await
    }

    /// Admin `GET path`.
    pub async fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        let r = http_get(self.admin_port, path).await?;
        Ok((r.status, r.body))
    }

    async fn wait_ready(&self) -> Result<()> {
        let port = self.admin_port;
        self.process
            .wait_ready(Duration::from_secs(15), async || {
                let r = http_get(port, "/readyz").await?;
                if r.status != 200 {
                    bail!("/readyz: {}", r.status);
                }
                Ok(())
            })
            .await
    }
}

fn built(env: &str, name: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let p = profile_dir().join(name);
    if !p.is_file() {
        bail!(
            "{name} not built: run cargo build -p lockmesh-fence-proxy (scripts/test does it); looked for {}",
            p.display()
        );
    }
    Ok(p)
}

/// The fence-proxy binary, or a fix-it error.
pub fn fence_proxy_bin() -> Result<PathBuf> {
    built("FENCE_PROXY_BIN", "lockmesh-fence-proxy")
}

/// The pause kit binary, or a fix-it error.
pub fn pausekit_bin() -> Result<PathBuf> {
    built("PAUSEKIT_BIN", "lockmesh-pausekit").context("pause kit")
}
