//! The proxy: classify, verify the grant, check and advance the mark, forward.
//!
//! Every request first passes the canonical-form check (`lockmesh_core::canon`, the
//! definition in docs/TRANSPARENT.md): a target in any other spelling (`%38` for
//! `8`, `//`, dot segments, `%2F`, `\`, `;`, absolute form, `*`) answers
//! `400 bad_request` naming the problem, read or write, and is neither forwarded
//! nor marked. A store that decodes or merges what it receives then reads the same
//! path fence-proxy classified, and one resource has one mark.
//!
//! A write goes through these phases; each failure answers from the one table in
//! `respond.rs` and the store never sees the request unless the last phase runs:
//! 1. classify the canonical path (route, resource, guarding key; unlisted →
//!    refused or the guard);
//! 2. verify the grant (`token::verify_grant`), before anything else is read;
//! 3. read the body (bounded by `max_body_bytes`), outside the resource lock, so a
//!    slow client cannot hold it;
//! 4. take the resource's lock (one check-advance-forward per resource at a time);
//! 5. check and advance the mark, durable (fsync) before returning;
//! 6. forward and stream the answer back; the lock is held until the store's
//!    response headers arrive (or `upstream_timeout_ms` passes).
//!
//! Reads skip 2-5. A store that cannot be reached answers `502 store_unavailable`; a
//! store that does not answer in time `504 store_timeout`: then the write may have
//! landed, and under `strict` the grant is used up either way (the mark advanced).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, HeaderValue, Uri},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use lockmesh_core::{
    canon::{self, CanonError},
    headers,
};
use tokio::sync::OwnedMutexGuard;

use crate::{
    config::Config,
    marks::Marks,
    metrics::{self, Metrics},
    respond::FenceError,
    route::{classify, Class, RouteError},
    token::{verify_grant, MarkDecision},
};

/// The instance id header forwarded to the store with every request.
pub(crate) const INSTANCE_HEADER: &str = "x-lockmesh-fence-instance";

/// Shared state of one fence-proxy.
pub struct Fence {
    config: Config,
    marks: Arc<Marks>,
    client: Client<HttpConnector, Body>,
    locks: ResourceLocks,
    metrics: Metrics,
}

#[derive(Default)]
struct ResourceLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

struct ResourceGuard<'a> {
    locks: &'a ResourceLocks,
    resource: String,
    guard: Option<OwnedMutexGuard<()>>,
}

/// Why fence-proxy could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The marks store could not be opened.
    #[error(transparent)]
    Marks(#[from] crate::marks::MarksError),
    /// A listener failed.
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

// === impl ResourceLocks ===

impl ResourceLocks {
    async fn lock(&self, resource: &str) -> ResourceGuard<'_> {
        let m = {
            let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(resource.to_owned()).or_default().clone()
        };
        ResourceGuard { locks: self, resource: resource.to_owned(), guard: Some(m.lock_owned().await) }
    }
}

impl Drop for ResourceGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self.locks.0.lock().unwrap_or_else(|p| p.into_inner());
        // Only the map's own reference left: nobody holds or waits; forget it.
        if map.get(&self.resource).is_some_and(|m| Arc::strong_count(m) == 1) {
            map.remove(&self.resource);
        }
    }
}

// === impl Fence ===

impl Fence {
    /// Opens the marks store (refused if another process holds it).
    pub fn new(config: Config) -> Result<Arc<Self>, RunError> {
        let marks = Arc::new(Marks::open(&config.marks_dir)?);
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(Arc::new(Self { config, marks, client, locks: ResourceLocks::default(), metrics: Metrics::default() }))
    }

    /// The marks store's instance id.
    pub fn instance(&self) -> &str {
        self.marks.instance()
    }

    fn count(&self, route: &str, outcome: &'static str) {
        self.metrics.request(route, outcome);
    }

    async fn handle(self: Arc<Self>, req: Request) -> Result<Response, (String, FenceError)> {
        let (parts, body) = req.into_parts();
        let method = parts.method.as_str().to_owned();
        let target = request_target(&parts).map_err(|e| ("unlisted".to_owned(), FenceError::NotCanonical(e)))?;
        let path =
            canon::check(target.as_bytes()).map_err(|e| ("unlisted".to_owned(), FenceError::NotCanonical(e)))?.path();
        let (route, class) =
            classify(&self.config.routes, self.config.unlisted.as_ref(), &method, path, &parts.headers).map_err(
                |e| match e {
                    RouteError::Unlisted => ("unlisted".to_owned(), FenceError::UnlistedRoute),
                    RouteError::Unresolved(m) => ("unlisted".to_owned(), FenceError::BadRequest(m)),
                },
            )?;
        let (resource, key, equal) = match class {
            Class::Read => {
                let r = self.forward(parts, &target, body).await.map_err(|e| (route.clone(), e))?;
                self.count(&route, "read");
                return Ok(r);
            }
            Class::Write { resource, key, equal } => (resource, key, equal),
        };
        let fail = |e: FenceError| (route.clone(), e);
        let token = verify_grant(&parts.headers, &self.config.verifier, &key).map_err(fail)?;
        let body =
            axum::body::to_bytes(body, self.config.max_body_bytes).await.map_err(|_| fail(FenceError::BodyTooLarge))?;
        let _guard = self.locks.lock(&resource).await;
        let marks = self.marks.clone();
        let res = resource.clone();
        let d = tokio::task::spawn_blocking(move || marks.check_and_advance(&res, token, equal))
            .await
            .map_err(|e| fail(FenceError::MarksUnavailable(e.to_string())))?
            .map_err(|e| fail(FenceError::MarksUnavailable(e.to_string())))?;
        match d {
            // TEST ONLY: the release gate's planted bug (refused without LOCKMESH_TEST_FAULTS=1).
            MarkDecision::Stale if self.config.accept_lower_tokens => {}
            MarkDecision::Stale => {
                let why =
                    if equal == crate::route::EqualRule::Strict { " (strict: an equal token is refused)" } else { "" };
                return Err(fail(FenceError::StaleToken(why)));
            }
            MarkDecision::Advance | MarkDecision::Equal => {}
        }
        let r = self.forward(parts, &target, Body::from(body)).await.map_err(fail)?;
        self.count(&route, "write");
        Ok(r)
    }

    /// Sends the request to the store with `target`, the canonical target the request
    /// was classified on, byte for byte.
    async fn forward(&self, mut parts: http::request::Parts, target: &str, body: Body) -> Result<Response, FenceError> {
        let uri: Uri = format!("{}{target}", self.config.upstream)
            .parse()
            .map_err(|_| FenceError::BadRequest("the request path does not form a valid upstream URI".into()))?;
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        // The proof is for fences; the store gets the token (it may check it too).
        parts.headers.remove(headers::PROOF);
        parts.headers.remove(header::HOST);
        if let Ok(v) = HeaderValue::from_str(self.instance()) {
            parts.headers.insert(INSTANCE_HEADER, v);
        }
        let req = http::Request::from_parts(parts, body);
        let resp = match tokio::time::timeout(self.config.upstream_timeout, self.client.request(req)).await {
            Err(_) => return Err(FenceError::StoreTimeout),
            Ok(Err(e)) if e.is_connect() => {
                return Err(FenceError::StoreUnavailable(
                    "connection refused or failed; the store did not receive the request".into(),
                ))
            }
            Ok(Err(_)) => {
                return Err(FenceError::StoreUnavailable(
                    "the connection failed after the request was sent; the write may or may not have landed".into(),
                ))
            }
            Ok(Ok(r)) => r,
        };
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(parts, Body::new(body)))
    }

    fn metrics_response(&self) -> Response {
        match self.metrics.encode() {
            Ok(text) => ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
            Err(_) => (http::StatusCode::INTERNAL_SERVER_ERROR, "cannot encode the metrics").into_response(),
        }
    }
}

/// The request target as the client sent it, for [`canon::check`]. HTTP/1 gives the
/// target line: hyper hands an absolute-form (`PUT http://host/p`) or authority-form
/// target to the service as a URI with a scheme or an authority and `*` as the path
/// `*`, never rewritten to origin form, so those are refused here (`*` by the
/// check). HTTP/2 always carries `:scheme` and `:authority` beside `:path`; there
/// the target is `:path` (which hyper keeps in the URI's path and query).
fn request_target(parts: &http::request::Parts) -> Result<String, CanonError> {
    let uri = &parts.uri;
    if parts.version < http::Version::HTTP_2 && (uri.scheme().is_some() || uri.authority().is_some()) {
        return Err(CanonError::NotOriginForm);
    }
    uri.path_and_query().map(|pq| pq.as_str().to_owned()).ok_or(CanonError::NotOriginForm)
}

fn strip_hop_by_hop(h: &mut http::HeaderMap) {
    for name in ["connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"] {
        h.remove(name);
    }
}

async fn proxy(State(f): State<Arc<Fence>>, req: Request) -> Response {
    match f.clone().handle(req).await {
        Ok(r) => r,
        Err((route, e)) => {
            f.count(&route, e.code());
            tracing::debug!(route, code = e.code(), "refused");
            e.into_response()
        }
    }
}

/// The client-facing router.
pub fn router(fence: Arc<Fence>) -> Router {
    Router::new().fallback(proxy).with_state(fence)
}

/// The admin router: `/healthz`, `/readyz` (marks store readable; shows the
/// instance id), `/metrics`.
pub(crate) fn admin_router(fence: Arc<Fence>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(f): State<Arc<Fence>>| async move {
                let marks = f.marks.clone();
                match tokio::task::spawn_blocking(move || marks.get("")).await {
                    Ok(Ok(_)) => {
                        (http::StatusCode::OK, format!("{{\"ready\":true,\"instance\":\"{}\"}}", f.instance()))
                    }
                    _ => (http::StatusCode::SERVICE_UNAVAILABLE, "{\"ready\":false}".to_owned()),
                }
            }),
        )
        .route("/metrics", get(|State(f): State<Arc<Fence>>| async move { f.metrics_response() }))
        .with_state(fence)
}

/// Serves on bound listeners until `shutdown` resolves; requests in flight finish
/// (graceful), then the marks store closes.
pub async fn run(
    listener: tokio::net::TcpListener,
    admin: tokio::net::TcpListener,
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let fence = Fence::new(config)?;
    tracing::info!(
        listen = %fence.config.listen,
        admin = %fence.config.admin_listen,
        instance = fence.instance(),
        marks = %fence.marks.path().display(),
        "fence-proxy serving"
    );
    let (tx, rx) = tokio::sync::watch::channel(false);
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.changed().await;
    };
    let admin_app = admin_router(fence.clone());
    let admin_task = tokio::spawn(async move { axum::serve(admin, admin_app).with_graceful_shutdown(wait(rx)).await });
    let main = axum::serve(listener, router(fence.clone())).with_graceful_shutdown(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    main.await?;
    let _ = admin_task.await;
    tracing::info!("fence-proxy stopped");
    Ok(())
}
