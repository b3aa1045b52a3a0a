//! The admin HTTP listener: `/healthz` (the process runs), `/readyz` (etcd answers a
//! linearizable read of the epoch record) and `/metrics`.

use std::sync::Arc;

use axum::{extract::State as AxState, http::StatusCode, routing::get, Router};

use crate::state::State;

/// Serves the admin routes until `shutdown` resolves.
pub async fn run(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn ready(AxState(state): AxState<Arc<State>>) -> (StatusCode, String) {
    match state.store.ready().await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
    }
}

async fn metrics(AxState(state): AxState<Arc<State>>) -> String {
    state.metrics.render(state.store.queues().keys_waiting())
}
