//! The upstream behind the gate's inbound sidecar: what the protected service saw
//! of the transparent holders' requests.
//!
//! Each request is recorded when it arrives (its forwarded `x-lock-key` and
//! `x-lock-token`, the holder named by the body's `<process>:` prefix) and again
//! when it is answered, `x-test-delay-ms` later (the critical section). A request
//! reset before its answer (the sidecar killed, the caller gone) keeps no answer
//! time: hyper drops the handler, so the second record never happens. Times are
//! on the gate's real time line ([`now_us`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Router;
use tokio::task::JoinHandle;

use super::history::{now_us, UpstreamExec};
use lockmesh_tests::backend::DELAY_HEADER;

type Seen = Arc<Mutex<Vec<UpstreamExec>>>;

/// The running upstream; it stops on drop.
#[derive(Debug)]
pub struct Upstream {
    port: u16,
    seen: Seen,
    task: JoinHandle<()>,
}

// === impl Upstream ===

impl Upstream {
    /// Binds a free loopback port and serves on the current runtime.
    pub async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.context("bind the gate upstream")?;
        let port = listener.local_addr()?.port();
        lockmesh_tests::ports::reserve(port);
        let seen: Seen = Arc::default();
        let app = Router::new().fallback(handle).with_state(Arc::clone(&seen));
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "gate upstream failed");
            }
        });
        Ok(Self { port, seen, task })
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Every request seen, in arrival order.
    pub fn seen(&self) -> Vec<UpstreamExec> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(State(seen): State<Seen>, headers: HeaderMap, body: Bytes) -> &'static str {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let exec = UpstreamExec {
        key: text("x-lock-key").unwrap_or_default(),
        token: text("x-lock-token").and_then(|t| t.parse().ok()),
        process: String::from_utf8_lossy(&body).split(':').next().unwrap_or_default().to_owned(),
        arrived_us: now_us(),
        left_us: None,
    };
    let i = {
        let mut s = seen.lock().unwrap_or_else(|p| p.into_inner());
        s.push(exec);
        s.len() - 1
    };
    if let Some(ms) = text(DELAY_HEADER).and_then(|v| v.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    // Read just before the answer is written: the request was still here then.
    seen.lock().unwrap_or_else(|p| p.into_inner())[i].left_us = Some(now_us());
    "ok"
}
