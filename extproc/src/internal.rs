//! The Wasm filter's own calls to the arbiter, on the ext_proc port (HTTP/2 over the
//! same mTLS, so only the allowed lockmesh Envoys reach them). The filter makes them
//! from its root context (`dispatch_http_call`), never from a request's context: a
//! callout from a finished request would be cancelled with it.
//!
//! | Route | Body | Answer |
//! |---|---|---|
//! | `POST /internal/v1/vm/keepalive` | `{"vm", "open"?: [n], "next"?: n}` | `{"sessions", "renew_ms", "reconciled"}` |
//! | `POST /internal/v1/vm/release` | `{"vm", "key", "hold": n}` | `{"released": bool}` |
//!
//! Errors are `{code, message}` with the API's codes and statuses. Keys never appear
//! in logs.

use std::sync::Arc;

use axum::{
    extract::{Request, State as AxState},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
    Json, Router,
};
use lockmesh_core::{Code, LockKey};
use serde::Deserialize;
use serde_json::json;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::{
    lock::vm::{valid_vm_id, Reconcile, MAX_OPEN_HOLDS},
    respond::ApiError,
    state::State,
};

/// Path of the VM keepalive.
pub const KEEPALIVE: &str = "/internal/v1/vm/keepalive";
/// Path of a transparent hold's release.
pub const RELEASE: &str = "/internal/v1/vm/release";
/// Largest request body accepted, bytes.
const MAX_BODY: usize = 2 * 1024 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeepaliveBody {
    vm: String,
    open: Option<Vec<u64>>,
    next: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    vm: String,
    key: String,
    hold: u64,
}

/// The routes, to merge with the ext_proc service.
pub fn router(state: Arc<State>) -> Router {
    Router::new().route(KEEPALIVE, post(keepalive)).route(RELEASE, post(release)).with_state(state)
}

fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(json!({ "code": e.code.as_str(), "message": e.message }))).into_response()
}

/// The calling Envoy's SPIFFE ID, if it is an allowed lockmesh Envoy.
fn envoy_of(state: &State, req: &Request) -> Result<String, ApiError> {
    req.extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.peer_certs())
        .and_then(|certs| certs.first().and_then(|c| lockmesh_runtime::spiffe_id_of(c.as_ref())))
        .filter(|id| state.config.allowed_clients.contains(id))
        .ok_or_else(|| ApiError::new(Code::Denied, "client certificate is not an allowed lockmesh Envoy"))
}

async fn body<T: for<'de> Deserialize<'de>>(req: Request) -> Result<T, ApiError> {
    let bytes = axum::body::to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|_| ApiError::new(Code::BadRequest, format!("body: larger than {MAX_BODY} bytes or unreadable")))?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::new(Code::BadRequest, format!("body: {e}")))
}

fn check_vm(vm: &str) -> Result<(), ApiError> {
    if valid_vm_id(vm) {
        Ok(())
    } else {
        Err(ApiError::new(Code::BadRequest, "vm: must be 32 lowercase hex characters"))
    }
}

async fn keepalive(AxState(state): AxState<Arc<State>>, req: Request) -> Response {
    let run = async {
        let envoy = envoy_of(&state, &req)?;
        let b: KeepaliveBody = body(req).await?;
        check_vm(&b.vm)?;
        let reconcile = match (b.open, b.next) {
            (Some(open), Some(next)) if open.len() <= MAX_OPEN_HOLDS => Some(Reconcile { open, next }),
            (None, None) => None,
            _ => return Err(ApiError::new(Code::BadRequest, "open, next: both or neither, at most 100000 open")),
        };
        state.store.unsealed()?;
        // Unprotected holds of this VM (ADR-04) are renewed or reconciled first:
        // they need no etcd, which may be what is missing.
        let mut unprotected = 0;
        for fo in state.tiers.fail_opens() {
            let r = reconcile.as_ref().map(|r| (r.open.as_slice(), r.next));
            unprotected += fo.vm_keepalive(&envoy, &b.vm, r).await;
        }
        let mut s = state.tiers.vm_keepalive(&envoy, &b.vm, reconcile.as_ref()).await?;
        s.reconciled += unprotected;
        // Renew three times per shortest TTL; without sessions, poll every second.
        let renew_ms = if s.min_ttl_s == 0 { 1000 } else { (s.min_ttl_s * 1000 / 3).max(500) };
        state.metrics.request("vm_keepalive", "ok");
        Ok::<_, ApiError>(Json(json!({ "sessions": s.sessions, "renew_ms": renew_ms, "reconciled": s.reconciled })))
    };
    match run.await {
        Ok(j) => j.into_response(),
        Err(e) => {
            state.metrics.request("vm_keepalive", e.code.as_str());
            error(e)
        }
    }
}

async fn release(AxState(state): AxState<Arc<State>>, req: Request) -> Response {
    let run = async {
        let envoy = envoy_of(&state, &req)?;
        let b: ReleaseBody = body(req).await?;
        check_vm(&b.vm)?;
        let key = LockKey::parse(b.key.as_bytes()).map_err(|e| ApiError::new(Code::BadRequest, format!("key: {e}")))?;
        // An unprotected hold (ADR-04) is released from memory, without etcd.
        let hold_id = crate::lock::vm::hold_id(&b.vm, b.hold);
        if state.tiers.release_unprotected_hold(&key, &hold_id, &envoy).await {
            state.metrics.request("vm_release", "ok");
            return Ok(Json(json!({ "released": true })));
        }
        let class = state.registry().class_of(&key).clone();
        let store = state.tiers.route(&class, &key, false).await?;
        let released = store.vm_release(&envoy, &b.vm, &key, b.hold).await?;
        state.metrics.request("vm_release", "ok");
        Ok::<_, ApiError>(Json(json!({ "released": released })))
    };
    match run.await {
        Ok(j) => j.into_response(),
        Err(e) => {
            state.metrics.request("vm_release", e.code.as_str());
            error(e)
        }
    }
}
