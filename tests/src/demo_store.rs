//! The quick start's demo store (`lockmesh-demo-store`, started by `scripts/up`): a
//! tiny HTTP key-value service standing for a legacy store that checks nothing
//! itself, which is why fence-proxy guards it (docs/QUICKSTART.md).
//!
//! - `PUT` or `POST /path` stores the body under the path together with the
//!   `x-lock-token` the request carried (fence-proxy forwards the token it
//!   checked) and answers `stored /path under token N` (answers end without a
//!   newline: the walkthrough's `curl -w` appends the status or the time). `x-demo-delay-ms: N` (at
//!   most 30000) makes the store take N ms before it writes: a slow write, during
//!   which a second request for the same key can be seen waiting for the lock.
//! - `GET` or `HEAD /path` answers the value, with `x-demo-token` naming the token
//!   it was written under (`none` without one); `404` when there is none.
//! - `DELETE /path` removes it.
//!
//! The data survives restarts: after each change the whole map is written to the
//! data file (a temporary file, fsync, rename) and it is read back at start. The
//! store logs one line per request (method, path, status), never a token.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

/// Request header: how long the store takes before it writes, in ms.
pub const DELAY_HEADER: &str = "x-demo-delay-ms";
/// Response header of a read: the token the value was written under.
pub const TOKEN_HEADER: &str = "x-demo-token";
/// The longest delay a request may ask for, in ms.
pub const MAX_DELAY_MS: u64 = 30_000;

/// One stored value.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Entry {
    /// The body of the write that stored it (as text).
    pub value: String,
    /// The `x-lock-token` that write carried, if any.
    pub token: Option<String>,
}

struct Store {
    file: PathBuf,
    data: Mutex<BTreeMap<String, Entry>>,
}

/// Serves the store on `listener` until `shutdown` completes; `data_file` holds
/// the values (read at start if it exists, rewritten after each change).
pub async fn run(
    listener: TcpListener,
    data_file: PathBuf,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let data = load(&data_file)?;
    let store = Arc::new(Store { file: data_file, data: Mutex::new(data) });
    let app = Router::new().fallback(handle).with_state(store);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await.context("serve")
}

/// The values in `file`; none if it does not exist.
pub fn load(file: &Path) -> Result<BTreeMap<String, Entry>> {
    match std::fs::read(file) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).with_context(|| format!("{}: not a demo store data file", file.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(e).with_context(|| format!("read {}", file.display())),
    }
}

// === impl Store ===

impl Store {
    /// Applies `change` to the map and writes the map to the data file, under one lock
    /// so the file always holds the map of the last change.
    fn change(&self, change: impl FnOnce(&mut BTreeMap<String, Entry>)) -> Result<()> {
        let mut data = self.data.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut data);
        let bytes = serde_json::to_vec_pretty(&*data)?;
        let tmp = self.file.with_extension("tmp");
        {
            let mut f = std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
            std::io::Write::write_all(&mut f, &bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.file).with_context(|| format!("rename to {}", self.file.display()))
    }

    fn get(&self, path: &str) -> Option<Entry> {
        self.data.lock().unwrap_or_else(|p| p.into_inner()).get(path).cloned()
    }
}

async fn handle(
    State(store): State<Arc<Store>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let r = answer(&store, &method, &path, &headers, body).await;
    println!("{method} {path} {}", r.status().as_u16());
    r
}

async fn answer(store: &Store, method: &Method, path: &str, headers: &HeaderMap, body: Bytes) -> Response {
    match *method {
        Method::GET | Method::HEAD => match store.get(path) {
            Some(e) => {
                let token = HeaderValue::from_str(e.token.as_deref().unwrap_or("none"))
                    .unwrap_or(HeaderValue::from_static("none"));
                (StatusCode::OK, [(TOKEN_HEADER, token)], e.value).into_response()
            }
            None => (StatusCode::NOT_FOUND, format!("no value at {path}")).into_response(),
        },
        Method::DELETE => match store.change(|d| {
            d.remove(path);
        }) {
            Ok(()) => (StatusCode::OK, format!("deleted {path}")).into_response(),
            Err(e) => failed(&e),
        },
        Method::PUT | Method::POST => {
            let delay = match delay(headers) {
                Ok(d) => d,
                Err(msg) => return (StatusCode::BAD_REQUEST, msg).into_response(),
            };
            tokio::time::sleep(delay).await;
            let token = headers.get("x-lock-token").and_then(|v| v.to_str().ok()).map(str::to_owned);
            let entry = Entry { value: String::from_utf8_lossy(&body).into_owned(), token: token.clone() };
            match store.change(|d| {
                d.insert(path.to_owned(), entry);
            }) {
                Ok(()) => {
                    let under = token.map_or_else(|| "without a token".to_owned(), |t| format!("under token {t}"));
                    (StatusCode::OK, format!("stored {path} {under}")).into_response()
                }
                Err(e) => failed(&e),
            }
        }
        _ => (StatusCode::METHOD_NOT_ALLOWED, "GET, HEAD, PUT, POST or DELETE").into_response(),
    }
}

/// The write's `x-demo-delay-ms`, zero without one.
fn delay(headers: &HeaderMap) -> Result<Duration, String> {
    let Some(v) = headers.get(DELAY_HEADER) else {
        return Ok(Duration::ZERO);
    };
    match v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(ms) if ms <= MAX_DELAY_MS => Ok(Duration::from_millis(ms)),
        _ => Err(format!("{DELAY_HEADER} must be a number of ms from 0 to {MAX_DELAY_MS}")),
    }
}

fn failed(e: &anyhow::Error) -> Response {
    eprintln!("demo store: {e:#}");
    (StatusCode::INTERNAL_SERVER_ERROR, "the data file could not be written").into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn start(file: PathBuf) -> (u16, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Result<()>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(run(listener, file, async {
            let _ = rx.await;
        }));
        (port, tx, task)
    }

    #[tokio::test]
    async fn values_and_their_tokens_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data.json");
        let http = reqwest::Client::new();
        let (port, stop, task) = start(file.clone()).await;
        let url = format!("http://127.0.0.1:{port}/orders/42");
        let r = http.put(&url).header("x-lock-token", "281474976710700").body("first").send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap(), "stored /orders/42 under token 281474976710700");
        let r = http.put(format!("http://127.0.0.1:{port}/notes")).body("x").send().await.unwrap();
        assert_eq!(r.text().await.unwrap(), "stored /notes without a token");
        let r = http.put(&url).header(DELAY_HEADER, "30001").body("late").send().await.unwrap();
        assert_eq!(r.status(), 400, "a delay above the cap is refused");
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();

        let (port, _stop, _task) = start(file.clone()).await;
        let r = http.get(format!("http://127.0.0.1:{port}/orders/42")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()[TOKEN_HEADER], "281474976710700");
        assert_eq!(r.text().await.unwrap(), "first");
        let r = http.get(format!("http://127.0.0.1:{port}/notes")).send().await.unwrap();
        assert_eq!(r.headers()[TOKEN_HEADER], "none");
        let r = http.delete(format!("http://127.0.0.1:{port}/notes")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let r = http.get(format!("http://127.0.0.1:{port}/notes")).send().await.unwrap();
        assert_eq!(r.status(), 404);
        assert_eq!(load(&file).unwrap().len(), 1, "the delete reached the file");
    }

    #[tokio::test]
    async fn a_delayed_write_lands_after_its_delay() {
        let dir = tempfile::tempdir().unwrap();
        let (port, _stop, _task) = start(dir.path().join("data.json")).await;
        let http = reqwest::Client::new();
        let started = tokio::time::Instant::now();
        let r =
            http.put(format!("http://127.0.0.1:{port}/k")).header(DELAY_HEADER, "300").body("v").send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(started.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn a_file_that_is_not_a_data_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data.json");
        std::fs::write(&file, "not json").unwrap();
        let e = load(&file).unwrap_err().to_string();
        assert!(e.ends_with("not a demo store data file"), "{e}");
    }
}
