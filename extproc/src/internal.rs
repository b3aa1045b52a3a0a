//! The Wasm filter's own calls to the arbiter, on the ext_proc port (HTTP/2 over the
//! same mTLS, so only the allowed lockmesh Envoys reach them). The filter makes them
//! from its root context (`dispatch_http_call`), never from a request's context: a
//! callout from a finished request would be cancelled with it.
//!
//! | Route | Body | Answer |
//! |---|---|---|
//! | `POST /internal/v1/vm/keepalive` | [`VmKeepalive`] | [`VmKeepaliveReply`] |
//! | `POST /internal/v1/vm/release` | [`VmRelease`] | [`VmReleaseReply`] |
//!
//! Refusals are the API's ([`crate::respond`]: same codes, statuses, bodies and
//! headers). Keys never appear in logs.

use std::sync::Arc;

use axum::{
    extract::{Request, State as AxState},
    response::{IntoResponse, Response},
    routing::post,
    Json, Router,
};
use lockmesh_core::{
    wire::vm::{VmKeepalive, VmKeepaliveReply, VmRelease, VmReleaseReply},
    Code, LockKey,
};
use serde::Deserialize;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::{
    lock::vm::{valid_vm_id, Reconcile, MAX_OPEN_HOLDS},
    respond::ApiError,
    state::State,
};

/// Path of the VM keepalive.
pub(crate) const KEEPALIVE: &str = "/internal/v1/vm/keepalive";
/// Path of a transparent hold's release.
pub(crate) const RELEASE: &str = "/internal/v1/vm/release";
/// Largest request body accepted, bytes.
const MAX_BODY: usize = 2 * 1024 * 1024;

/// The routes, to merge with the ext_proc service.
pub fn router(state: Arc<State>) -> Router {
    Router::new().route(KEEPALIVE, post(keepalive)).route(RELEASE, post(release)).with_state(state)
}

/// The calling Envoy's SPIFFE ID, if it is an allowed lockmesh Envoy: a vouching
/// or a self client (`tls.self_clients`). Either one reaches only the VM sessions
/// recorded under its own SPIFFE ID (`Store::vm_owner`).
fn envoy_of(state: &State, req: &Request) -> Result<String, ApiError> {
    req.extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.peer_certs())
        .and_then(|certs| certs.first().and_then(|c| lockmesh_runtime::spiffe_id_of_cached(c.as_ref())))
        .filter(|id| state.config.client_kind(id).is_some())
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
        let b: VmKeepalive = body(req).await?;
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
        // etcd refuses calls for an auth store that moved under the login (nothing
        // applied; the clients log in again): renewed again at once rather than
        // left to the VM's next renewal a third of a TTL later, a few times.
        let mut runs = 0u32;
        let mut s = loop {
            let refusals = lockmesh_lock::auth_refusals();
            match state.tiers.vm_keepalive(&envoy, &b.vm, reconcile.as_ref()).await {
                Err(lockmesh_lock::LockError::Unavailable(_))
                    if runs < 4 && lockmesh_lock::auth_refusals() != refusals =>
                {
                    runs += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(25 << runs)).await;
                }
                r => break r?,
            }
        };
        s.reconciled += unprotected;
        // Renew three times per shortest TTL; without sessions, poll every second.
        let renew_ms = if s.min_ttl_s == 0 { 1000 } else { (s.min_ttl_s * 1000 / 3).max(500) };
        state.metrics.request("vm_keepalive", "ok");
        Ok::<_, ApiError>(Json(VmKeepaliveReply {
            reconciled: s.reconciled as u64,
            renew_ms,
            sessions: s.sessions as u64,
        }))
    };
    match run.await {
        Ok(j) => j.into_response(),
        Err(e) => {
            state.metrics.request("vm_keepalive", e.code.as_str());
            e.into_response()
        }
    }
}

async fn release(AxState(state): AxState<Arc<State>>, req: Request) -> Response {
    let run = async {
        let envoy = envoy_of(&state, &req)?;
        let b: VmRelease = body(req).await?;
        check_vm(&b.vm)?;
        let key = LockKey::parse(b.key.as_bytes()).map_err(|e| ApiError::new(Code::BadRequest, format!("key: {e}")))?;
        // An unprotected hold (ADR-04) is released from memory, without etcd.
        let hold_id = crate::lock::vm::hold_id(&b.vm, b.hold);
        if state.tiers.release_unprotected_hold(&key, &hold_id, &envoy).await {
            state.metrics.request("vm_release", "ok");
            return Ok(Json(VmReleaseReply { released: true }));
        }
        let class = state.registry().class_of(&key).clone();
        let store = state.tiers.route(&class, &key, false).await?;
        let released = store.vm_release(&envoy, &b.vm, &key, b.hold).await?;
        state.metrics.request("vm_release", "ok");
        Ok::<_, ApiError>(Json(VmReleaseReply { released }))
    };
    match run.await {
        Ok(j) => j.into_response(),
        Err(e) => {
            state.metrics.request("vm_release", e.code.as_str());
            e.into_response()
        }
    }
}
