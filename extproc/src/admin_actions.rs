//! The arbiter's side of the two-person admin actions: `lockctl admin` calls these
//! routes on the ext_proc port (HTTP/2 over its mTLS), and the arbiter verifies the
//! operators' tokens and executes with **its own** etcd role. The etcd role
//! `lockmesh-admin` therefore writes nothing: only the arbiter's role, which
//! grants holds anyway, can delete or put one (`docs/ADMIN.md`).
//!
//! | Route | Body | Token | Answer |
//! |---|---|---|---|
//! | `POST /internal/v1/admin/request` | [`RequestBody`] | requester | [`flow::Preview`] |
//! | `POST /internal/v1/admin/show` | [`ShowBody`] | none | [`flow::Preview`] |
//! | `POST /internal/v1/admin/approve` | [`ApproveBody`] | approver | [`ApproveReply`] |
//! | `POST /internal/v1/admin/list` | `{}` | none | [`ListReply`] |
//!
//! Every route first checks the caller's certificate: its SPIFFE ID must be one of
//! `operators.allowed_clients` (never a lock-tier Envoy). Tokens come in
//! `authorization: Bearer`, are verified against `operators.jwks_file` (re-read on
//! each call) with the freshness bound `operators.max_token_age_s`, and are never
//! logged or stored: only their `iss` and `sub`. Refusals are the operator plane's
//! one table ([`crate::respond::admin_refusal`]: `{code, message}` with the status
//! of `AdminError::status`, as on the console); those of `request` and `approve`
//! by an allowed client are recorded in the action log.

use std::{sync::Arc, time::Duration};

use axum::{
    extract::{Request, State as AxState},
    http::header::AUTHORIZATION,
    response::{IntoResponse, Response},
    routing::post,
    Json, Router,
};
use lockmesh_core::{
    wire::admin::{ApproveBody, ApproveReply, ListReply, RequestBody, ShowBody},
    KeyDigest,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::{config::Operators, state::State};
use lockmesh_ops::admin::{
    flow::{self, Action},
    jwt::Operator,
    AdminError,
};

pub use lockmesh_ops::admin::routes::{APPROVE, LIST, REQUEST, SHOW};
/// Largest request body accepted, bytes.
const MAX_BODY: usize = 64 * 1024;
/// Longest an admin call may run (an epoch advance revokes every session).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// The routes, to merge with the ext_proc service.
pub fn router(state: Arc<State>) -> Router {
    Router::new()
        .route(REQUEST, post(request))
        .route(SHOW, post(show))
        .route(APPROVE, post(approve))
        .route(LIST, post(list))
        .with_state(state)
}

/// The operators' settings, after checking that the caller's certificate is an
/// allowed admin client.
fn admitted<'a>(state: &'a State, req: &Request) -> Result<&'a Operators, AdminError> {
    let ops = state.config.operators.as_ref().ok_or(AdminError::NotConfigured)?;
    let id = req
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.peer_certs())
        .and_then(|certs| certs.first().and_then(|c| lockmesh_runtime::spiffe_id_of(c.as_ref())));
    match id {
        Some(id) if ops.allowed_clients.contains(&id) => Ok(ops),
        Some(id) => Err(AdminError::ClientDenied(id)),
        None => Err(AdminError::ClientDenied("no SPIFFE ID".into())),
    }
}

/// Verifies the bearer token of `req`.
fn operator(ops: &Operators, req: &Request) -> Result<Operator, AdminError> {
    let token = lockmesh_ops::admin::bearer(req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()))?;
    ops.verifier()?.verify(token, crate::lock::now_ms() / 1000)
}

async fn body<T: for<'de> Deserialize<'de>>(req: Request) -> Result<T, AdminError> {
    let bytes = axum::body::to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|_| AdminError::BadCall(format!("body: larger than {MAX_BODY} bytes or unreadable")))?;
    serde_json::from_slice(&bytes).map_err(|e| AdminError::BadCall(format!("body: {e}")))
}

fn check_action(a: &Action) -> Result<(), AdminError> {
    match a {
        Action::ForceRelease { digest, .. } if KeyDigest::parse(digest).is_none() => {
            Err(AdminError::BadKey(format!("action.digest: {digest:?} is not a key digest")))
        }
        Action::EpochAdvance { expected_epoch, new_epoch } if new_epoch <= expected_epoch => {
            Err(AdminError::BadCall("action.new_epoch: must be above expected_epoch".into()))
        }
        _ => Ok(()),
    }
}

/// What one call did: the operator (once verified), the request id (once known)
/// and the answer.
type Done = (Option<Operator>, Option<String>, Result<Value, AdminError>);

/// Runs one admin call: the caller check, then `run` under the call timeout;
/// counts it, logs it (never an identity or token) and records a refusal of a
/// state-changing step.
async fn serve<F, Fut>(state: Arc<State>, req: Request, step: &'static str, run: F) -> Response
where
    F: FnOnce(Arc<State>, Operators, Request) -> Fut,
    Fut: std::future::Future<Output = Done>,
{
    let route: &'static str = match step {
        "request" => "admin_request",
        "approve" => "admin_approve",
        "show" => "admin_show",
        _ => "admin_list",
    };
    let ops = match admitted(&state, &req) {
        Ok(ops) => ops.clone(),
        Err(e) => {
            state.metrics.request(route, e.code());
            tracing::warn!(step, code = e.code(), "admin call refused: the caller is not an admin client");
            return crate::respond::admin_refusal(&e);
        }
    };
    let (who, id, res) = match tokio::time::timeout(CALL_TIMEOUT, run(state.clone(), ops, req)).await {
        Ok(done) => done,
        Err(_) => (
            None,
            None,
            Err(AdminError::Io(format!("the call did not finish within {CALL_TIMEOUT:?}; show the request"))),
        ),
    };
    match res {
        Ok(v) => {
            state.metrics.request(route, "ok");
            tracing::info!(step, request = id.as_deref().unwrap_or("-"), "admin call done");
            Json(v).into_response()
        }
        Err(e) => {
            state.metrics.request(route, e.code());
            tracing::info!(step, request = id.as_deref().unwrap_or("-"), code = e.code(), "admin call refused");
            if matches!(step, "request" | "approve") {
                let mut c = state.store.cluster().client();
                flow::log_refusal(&mut c, &state.config.etcd_root, step, id.as_deref(), who.as_ref(), &e).await;
            }
            crate::respond::admin_refusal(&e)
        }
    }
}

fn to_json(v: impl Serialize) -> Result<Value, AdminError> {
    serde_json::to_value(v).map_err(lockmesh_ops::admin::io)
}

async fn request(AxState(state): AxState<Arc<State>>, req: Request) -> Response {
    serve(state, req, "request", |state, ops, req| async move {
        let op = match operator(&ops, &req) {
            Ok(op) => op,
            Err(e) => return (None, None, Err(e)),
        };
        let run = async {
            let b: RequestBody = body(req).await?;
            check_action(&b.action)?;
            if !(1..=ops.max_request_ttl_s).contains(&b.ttl_s) {
                return Err(AdminError::BadCall(format!(
                    "ttl_s: {} is outside 1 to {}",
                    b.ttl_s, ops.max_request_ttl_s
                )));
            }
            let (mut c, root) = (state.store.cluster().client(), state.config.etcd_root.as_str());
            let r = flow::request(&mut c, root, b.action, &b.reason, &op, b.ttl_s).await?;
            let reg = state.registry();
            let at = holds_at(&state, &r.id).await?;
            let p = flow::preview(&mut c, at, root, &r.id, Some(&reg)).await?;
            Ok((r.id, to_json(&p)?))
        };
        match run.await {
            Ok((id, v)) => (Some(op), Some(id), Ok(v)),
            Err(e) => (Some(op), None, Err(e)),
        }
    })
    .await
}

async fn show(AxState(state): AxState<Arc<State>>, req: Request) -> Response {
    serve(state, req, "show", |state, _ops, req| async move {
        let b: ShowBody = match body(req).await {
            Ok(b) => b,
            Err(e) => return (None, None, Err(e)),
        };
        let (mut c, reg) = (state.store.cluster().client(), state.registry());
        let r = match holds_at(&state, &b.id).await {
            Ok(at) => flow::preview(&mut c, at, &state.config.etcd_root, &b.id, Some(&reg)).await.and_then(to_json),
            Err(e) => Err(e),
        };
        (None, Some(b.id), r)
    })
    .await
}

async fn approve(AxState(state): AxState<Arc<State>>, req: Request) -> Response {
    serve(state, req, "approve", |state, ops, req| async move {
        let op = operator(&ops, &req);
        let b: ApproveBody = match body(req).await {
            Ok(b) => b,
            Err(e) => return (op.ok(), None, Err(e)),
        };
        let op = match op {
            Ok(op) => op,
            Err(e) => return (None, Some(b.id), Err(e)),
        };
        let (mut c, root, reg) = (state.store.cluster().client(), state.config.etcd_root.as_str(), state.registry());
        let run = async {
            let at = holds_at(&state, &b.id).await?;
            let p = flow::preview(&mut c, at.clone(), root, &b.id, Some(&reg)).await?;
            let retention = ops.force_record_retention_s;
            let o = flow::approve(&mut c, at, root, &b.id, &op, Some(&reg), b.shown.as_deref(), retention).await?;
            to_json(ApproveReply { outcome: o, preview: p })
        };
        let r = run.await;
        (Some(op), Some(b.id), r)
    })
    .await
}

async fn list(AxState(state): AxState<Arc<State>>, req: Request) -> Response {
    serve(state, req, "list", |state, _ops, _req| async move {
        let (mut c, root) = (state.store.cluster().client(), state.config.etcd_root.as_str());
        let run = async {
            let requests = flow::list(&mut c, root).await?;
            let log = flow::read_log(&mut c, root).await?;
            to_json(ListReply { log, requests })
        };
        (None, None, run.await)
    })
    .await
}

/// Where the holds of request `id`'s key are, on a split deployment: the one
/// cluster other than the coord cluster that has any (`None`: the coord cluster,
/// a single-cluster deployment, or an epoch advance). A key's holds are on its
/// home; holds on two clusters at once mean a shard move left them (drained but
/// not yet verified): the request is refused until `lockctl shard apply` finishes.
async fn holds_at(state: &State, id: &str) -> Result<Option<flow::HoldsAt>, AdminError> {
    if state.tiers.stores().count() < 2 {
        return Ok(None);
    }
    let root = state.config.etcd_root.as_str();
    let Some(digest) = flow::request_digest(&mut state.store.cluster().client(), root, id).await? else {
        return Ok(None);
    };
    let mut found = Vec::new();
    for s in state.tiers.stores() {
        if flow::hold_count(&mut s.cluster().client(), root, &digest).await? > 0 {
            found.push(s.clone());
        }
    }
    match found.as_slice() {
        [] => Ok(None),
        [s] if s.cluster_name() == state.store.cluster_name() => Ok(None),
        [s] => Ok(Some(flow::HoldsAt { cluster: s.cluster_name().to_owned(), client: s.cluster().client() })),
        many => Err(AdminError::BadCall(format!(
            "the key has holds on {} clusters ({}): a shard move is in progress; finish it (lockctl shard apply) \
             and ask again",
            many.len(),
            many.iter().map(|s| s.cluster_name()).collect::<Vec<_>>().join(", ")
        ))),
    }
}
