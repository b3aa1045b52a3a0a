//! The admin HTTP listener: `/healthz` (the process runs), `/readyz` (etcd answers a
//! linearizable read of the epoch record, or a declared quorum loss leaves
//! fail-open classes to serve), `/status` (version, seal, marks, classes, fail-open),
//! `/metrics`, and the read-only console (`/console`, [`crate::console`]).

use std::sync::Arc;

use axum::{extract::State as AxState, http::StatusCode, routing::get, Router};

use lockmesh_core::wire::status::{ClassesStatus, FailOpenStatus, Marks, OperatorsStatus, StatusReply};

use crate::state::State;

/// Serves the admin routes until `shutdown` resolves.
pub async fn run(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(health))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .route("/status", get(status))
        .with_state(state.clone())
        .merge(crate::console::router(state));
    // The peer's address: the console API answers only `console.api_from`.
    axum::serve(listener, app.into_make_service_with_connect_info::<std::net::SocketAddr>())
        .with_graceful_shutdown(shutdown)
        .await
}

fn seal_line(state: &State) -> String {
    match state.store.seal().current() {
        Some(s) => format!("sealed: {} ({})\n", s.reason.as_str(), s.detail),
        None => "sealed: false\n".into(),
    }
}

async fn health(AxState(state): AxState<Arc<State>>) -> String {
    format!("ok\n{}", seal_line(&state))
}

async fn ready(AxState(state): AxState<Arc<State>>) -> (StatusCode, String) {
    match state.store.ready().await {
        // Started, but the class and shard records are not there yet (the first
        // bootstrap failed and is retried every second): not ready, or the first
        // callers routed here would get `unavailable`.
        Ok(()) if !state.tiers.coord_bootstrapped() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the shard map and class records are not created yet; retried every second\n".into(),
        ),
        Ok(()) => (StatusCode::OK, format!("ready\n{}", seal_line(&state))),
        // A declared quorum loss with a fail-open class to serve (ADR-04): this
        // arbiter still answers those, so it stays in its Service; every other
        // class answers `unavailable`.
        Err(e) if fail_open_serving(&state) => {
            (StatusCode::OK, format!("ready: quorum lost, fail-open classes only ({e})\n{}", seal_line(&state)))
        }
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
    }
}

fn fail_open_serving(state: &State) -> bool {
    let open = state.registry().classes().iter().any(|c| c.on_quorum_loss == lockmesh_core::class::OnQuorumLoss::Open);
    open && state.tiers.fail_opens().any(|f| f.has_spool() && f.declared().is_some())
}

async fn metrics(AxState(state): AxState<Arc<State>>) -> axum::response::Response {
    use axum::{http::header, response::IntoResponse};
    let classes = crate::registry::class_values(&state).await;
    let seal = state.store.seal().current().map(|s| (s.reason, s.since_ms));
    match state.metrics.encode(state.store.queues().keys_waiting(), seal, &classes) {
        Ok(text) => ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// Version, seal state and marks ([`StatusReply`]; numbers only: no key, token or
/// identity).
/// How long `/status` waits for etcd's class policies. The rest of the answer is
/// the arbiter's own state, and `/status` is what an operator reads while etcd is
/// slow (a restored member holds every old auth token back until its own wait
/// runs out, about 2 s): the page answers in time and says the policies were
/// unreadable.
const STATUS_ETCD_WAIT: std::time::Duration = std::time::Duration::from_millis(800);

async fn status(AxState(state): AxState<Arc<State>>) -> axum::Json<StatusReply> {
    let seal = state.store.seal().current();
    let m = state.store.seal().marks();
    let clock_off = state.store.seal().clock_off();
    let classes = tokio::time::timeout(STATUS_ETCD_WAIT, crate::registry::classes_status(&state)).await;
    axum::Json(StatusReply {
        classes: classes.unwrap_or_else(|_| ClassesStatus::Unreadable {
            error: format!("etcd did not answer within {STATUS_ETCD_WAIT:?}"),
        }),
        fail_open: state
            .tiers
            .fail_opens()
            .map(|f| FailOpenStatus {
                cluster: f.cluster().to_owned(),
                outage: f.declared().map(|o| o.id),
                quorum_loss_declared: f.declared().is_some(),
                spool: f.has_spool(),
                spool_bytes: f.spool_bytes(),
                unprotected_holds: f.holds() as u64,
            })
            .collect(),
        operators: state.config.operators.as_ref().map(|o| OperatorsStatus {
            force_record_retention_s: o.force_record_retention_s,
            max_token_age_s: o.max_token_age_s,
            require_mfa: o.require_mfa,
            weakened: o.weakened(),
        }),
        marks: Marks {
            clock: m.clock,
            clock_off,
            cluster_id: m.cluster_id,
            epoch: m.epoch,
            raft_index: m.raft_index,
            raft_term: m.raft_term,
            revision: m.revision,
            updated_ms: m.updated_ms,
        },
        seal_detail: seal.as_ref().map(|s| s.detail.clone()),
        seal_reason: seal.as_ref().map(|s| s.reason.as_str().to_owned()),
        sealed: seal.is_some(),
        sealed_since_ms: seal.as_ref().map(|s| s.since_ms),
        shadow: crate::console::shadow_rows(state.store.runtime()),
        version: env!("CARGO_PKG_VERSION").to_owned(),
    })
}
