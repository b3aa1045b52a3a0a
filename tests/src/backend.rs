//! A recording HTTP/1.1 upstream: what the protected service saw.
//!
//! Every request is recorded (method, path with query, all headers, body,
//! arrival time) before it is answered, so a test can see a request that is
//! still being held. It answers 200 with body `ok`; a request carrying
//! `x-test-delay-ms: N` is answered N ms later (a slow critical section).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use axum::Router;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::ports;

/// The request header that delays the backend's answer, in milliseconds.
pub const DELAY_HEADER: &str = "x-test-delay-ms";

/// One request as the backend received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// `GET`, `POST`, ...
    pub method: String,
    /// Path and query, e.g. `/jobs/run?x=1`.
    pub path: String,
    /// All headers in arrival order, names lowercase.
    pub headers: Vec<(String, String)>,
    /// The request body.
    pub body: Bytes,
    /// When the request arrived.
    pub received_at: Instant,
}

/// The running backend; it stops accepting connections on drop.
#[derive(Debug)]
pub struct Backend {
    port: u16,
    requests: Arc<Mutex<Vec<RecordedRequest>>>,
    task: JoinHandle<()>,
}

type Recorded = Arc<Mutex<Vec<RecordedRequest>>>;

// === impl RecordedRequest ===

impl RecordedRequest {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

// === impl Backend ===

impl Backend {
    /// Binds a free loopback port and starts serving on the current runtime.
    pub async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.context("bind backend")?;
        let port = listener.local_addr()?.port();
        ports::reserve(port);
        let requests: Recorded = Arc::default();
        let app = Router::new().fallback(handle).with_state(Arc::clone(&requests));
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "test backend failed");
            }
        });
        Ok(Self { port, requests, task })
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A copy of every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.lock().clone()
    }

    /// Forgets the requests received so far.
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RecordedRequest>> {
        self.requests.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // Stops accepting; connections in flight end with the test's runtime.
        self.task.abort();
    }
}

async fn handle(
    State(requests): State<Recorded>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> &'static str {
    let delay = headers.get(DELAY_HEADER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let record = RecordedRequest {
        method: method.to_string(),
        path: uri.path_and_query().map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned()),
        headers: headers
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect(),
        body,
        received_at: Instant::now(),
    };
    requests.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(record);
    if let Some(ms) = delay {
        // The requested hold time of the simulated critical section.
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    "ok"
}
