//! The proxy: screen, classify, verify the grant, check and advance the mark, forward.
//!
//! Every request first passes the canonical-form check (`lockmesh_core::canon`, the
//! definition in docs/TRANSPARENT.md): a target in any other spelling (`%38` for
//! `8`, `//`, dot segments, `%2F`, `\`, `;`, absolute form, `*`) answers
//! `400 bad_request` naming the problem, read or write, and is neither forwarded
//! nor marked. A store that decodes or merges what it receives then reads the same
//! path fence-proxy classified, and one resource has one mark. Then the headers and
//! the body are screened (`screen.rs`): twins of lock headers, duplicate lock
//! headers, method and path overrides, and bodies on GET, HEAD, OPTIONS, TRACE (and
//! DELETE unless the route allows them) are refused, read or write.
//!
//! A write goes through these phases; each failure answers from the one table in
//! `respond.rs` and the store never sees the request unless the last phase runs:
//! 1. classify the canonical path (route, resource, guarding key; unlisted →
//!    refused or the guard);
//! 2. verify the grant (`token::verify_grant`), before anything else is read;
//! 3. read the body (bounded by `max_body_bytes`), outside the resource lock, so a
//!    slow client cannot hold it;
//! 4. take the resource's lock (one check-advance-forward per resource at a time)
//!    and refuse the write if the resource is quarantined;
//! 5. check and advance the mark, durable (fsync) before returning;
//! 6. forward on a task of its own, which holds the resource's lock until the
//!    store's response headers arrive, whether or not the client is still there.
//!    If they do not arrive within `upstream_timeout_ms`, or the connection is
//!    lost after the request was sent, the write may still land: the resource is
//!    quarantined (its writes answer `503 fence_quarantined`) until the store
//!    answers that write or `quarantine_ms` passes.
//!
//! Reads skip 2-5 and carry no body. The store gets no lock header but a write's
//! verified token (`x-lock-token`) and the fence's instance id. A store that cannot
//! be reached answers `502 store_unavailable`; a store that does not answer in time
//! `504 store_timeout`: then the write may have landed, and under `strict` the
//! grant is used up either way (the mark advanced).
//!
//! Upstream connections: a read without a body goes on a pooled keep-alive
//! connection (the fence sends it without a body, so nothing is left on the
//! connection for the store to read as another request). Every request with a
//! body (writes, and reads a route declares for a method other than GET, HEAD,
//! OPTIONS or TRACE) goes on a connection of its own that is never reused: the
//! fence frames that body itself, but a store that answers without reading all of
//! it would take the rest for the next request on the connection.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, Uri},
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
    FencingToken,
};
use tokio::{sync::OwnedMutexGuard, time::Instant};

use crate::{
    config::Config,
    marks::Marks,
    metrics::{self, Metrics},
    respond::FenceError,
    route::{classify, route_for, Class, DeleteBody, RouteError},
    screen::{screen_body, screen_headers, upstream_headers, BodyFrame, BODILESS},
    token::{verify_grant, MarkDecision},
};

/// The instance id header forwarded to the store with every request.
pub(crate) const INSTANCE_HEADER: &str = "x-lockmesh-fence-instance";

/// Shared state of one fence-proxy.
pub struct Fence {
    config: Config,
    marks: Arc<Marks>,
    /// Bodiless reads: pooled keep-alive connections.
    reads: Client<HttpConnector, Body>,
    /// Every request with a body: a connection per request, never reused.
    writes: Client<HttpConnector, Body>,
    locks: Arc<ResourceLocks>,
    quarantine: Quarantine,
    metrics: Metrics,
}

#[derive(Default)]
struct ResourceLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

/// Holds one resource's lock; owned, so a task can keep it after the client left.
struct ResourceGuard {
    locks: Arc<ResourceLocks>,
    resource: String,
    guard: Option<OwnedMutexGuard<()>>,
}

/// Resources whose last write's outcome is unknown: until when their writes are
/// refused, and which write put them there (a late answer to that write lifts it).
#[derive(Default)]
struct Quarantine(Mutex<HashMap<String, (Instant, u64)>>);

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
    async fn lock(self: &Arc<Self>, resource: &str) -> ResourceGuard {
        let m = {
            let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(resource.to_owned()).or_default().clone()
        };
        ResourceGuard { locks: self.clone(), resource: resource.to_owned(), guard: Some(m.lock_owned().await) }
    }
}

impl Drop for ResourceGuard {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self.locks.0.lock().unwrap_or_else(|p| p.into_inner());
        // Only the map's own reference left: nobody holds or waits; forget it.
        if map.get(&self.resource).is_some_and(|m| Arc::strong_count(m) == 1) {
            map.remove(&self.resource);
        }
    }
}

// === impl Quarantine ===

impl Quarantine {
    /// Whether writes to `resource` are refused now (an expired entry is dropped).
    fn holds(&self, resource: &str) -> bool {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(resource) {
            Some((until, _)) if *until > Instant::now() => true,
            Some(_) => {
                map.remove(resource);
                false
            }
            None => false,
        }
    }

    /// Quarantines `resource` for `bound`; returns the entry's id.
    fn enter(&self, resource: &str, bound: std::time::Duration) -> u64 {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now = Instant::now();
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Expired entries of resources nobody wrote since go here.
        map.retain(|_, (until, _)| *until > now);
        map.insert(resource.to_owned(), (now + bound, id));
        id
    }

    /// Lifts entry `id` of `resource` (the store answered that write), if it is
    /// still the resource's entry.
    fn lift(&self, resource: &str, id: u64) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(resource).is_some_and(|(_, i)| *i == id) {
            map.remove(resource);
        }
    }
}

// === impl Fence ===

impl Fence {
    /// Opens the marks store (refused if another process holds it).
    pub fn new(config: Config) -> Result<Arc<Self>, RunError> {
        let marks = Arc::new(Marks::open(&config.marks_dir)?);
        let reads = Client::builder(TokioExecutor::new()).build_http();
        let writes = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build_http();
        Ok(Arc::new(Self {
            config,
            marks,
            reads,
            writes,
            locks: Arc::default(),
            quarantine: Quarantine::default(),
            metrics: Metrics::default(),
        }))
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
        let unlisted = |e: FenceError| ("unlisted".to_owned(), e);
        let target = request_target(&parts).map_err(|e| unlisted(FenceError::NotCanonical(e)))?;
        let path = canon::check(target.as_bytes()).map_err(|e| unlisted(FenceError::NotCanonical(e)))?.path();
        let route_err = |e: RouteError| match e {
            RouteError::Unlisted => unlisted(FenceError::UnlistedRoute),
            RouteError::Unresolved(m) => unlisted(FenceError::BadRequest(m)),
        };
        let route = route_for(&self.config.routes, self.config.unlisted.as_ref(), path).map_err(route_err)?;
        let fail = |e: FenceError| (route.name.clone(), e);
        screen_headers(&parts.headers).map_err(fail)?;
        let frame = BodyFrame::of(&parts.headers, &body);
        screen_body(&parts.method, frame, route.delete_body == DeleteBody::Allow).map_err(fail)?;
        let (route, class) =
            classify(&self.config.routes, self.config.unlisted.as_ref(), &method, path, &parts.headers)
                .map_err(route_err)?;
        let fail = |e: FenceError| (route.clone(), e);
        let (resource, key, equal) = match class {
            Class::Read => {
                let r = self.read(parts, &target, body, frame).await.map_err(fail)?;
                self.count(&route, "read");
                return Ok(r);
            }
            Class::Write { resource, key, equal } => (resource, key, equal),
        };
        let token = verify_grant(&parts.headers, &self.config.verifier, &key).map_err(fail)?;
        let body =
            axum::body::to_bytes(body, self.config.max_body_bytes).await.map_err(|_| fail(FenceError::BodyTooLarge))?;
        let guard = self.locks.lock(&resource).await;
        if self.quarantine.holds(&resource) {
            return Err(fail(FenceError::Quarantined));
        }
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
        let req = self.upstream_request(parts, &target, Some(token), Some(body)).map_err(fail)?;
        // The exchange runs on its own task with the resource's lock: if the client
        // goes away, the next write to the resource still waits for the store.
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(self.clone().write_exchange(req, resource, guard, tx));
        let r = rx
            .await
            .map_err(|_| fail(FenceError::StoreUnavailable("the forwarding task ended without an answer".into())))?;
        let r = r.map_err(fail)?;
        self.count(&route, "write");
        Ok(r)
    }

    /// The request for the store: `target`, the canonical target the request was
    /// classified on, byte for byte; the headers of `screen::upstream_headers`; the
    /// body the fence read (`None`: no body).
    fn upstream_request(
        &self,
        mut parts: http::request::Parts,
        target: &str,
        token: Option<FencingToken>,
        body: Option<bytes::Bytes>,
    ) -> Result<http::Request<Body>, FenceError> {
        let uri: Uri = format!("{}{target}", self.config.upstream)
            .parse()
            .map_err(|_| FenceError::BadRequest("the request path does not form a valid upstream URI".into()))?;
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        parts.extensions = http::Extensions::new();
        upstream_headers(&mut parts.headers, token, self.instance(), body.as_ref().map(bytes::Bytes::len));
        if body.is_some() {
            // A store must not read another request on this connection (RFC 9112
            // 9.6): if it answers without reading the whole body, the rest is never
            // taken for a request. The writes client pools nothing either.
            parts.headers.insert(header::CONNECTION, http::HeaderValue::from_static("close"));
        }
        Ok(http::Request::from_parts(parts, body.map_or_else(Body::empty, Body::from)))
    }

    /// A read: bodiless ones on the pooled client; one with a body (a method the
    /// route declares a read besides GET, HEAD, OPTIONS, TRACE) is read by the fence
    /// and sent on a connection of its own.
    async fn read(
        &self,
        parts: http::request::Parts,
        target: &str,
        body: Body,
        frame: BodyFrame,
    ) -> Result<Response, FenceError> {
        let (client, body) = if BODILESS.contains(&parts.method) || !frame.has_body() {
            (&self.reads, None)
        } else {
            let b =
                axum::body::to_bytes(body, self.config.max_body_bytes).await.map_err(|_| FenceError::BodyTooLarge)?;
            (&self.writes, Some(b))
        };
        let req = self.upstream_request(parts, target, None, body)?;
        match tokio::time::timeout(self.config.upstream_timeout, client.request(req)).await {
            Err(_) => Err(FenceError::StoreTimeout),
            Ok(Err(e)) => Err(store_error(&e)),
            Ok(Ok(r)) => Ok(answer(r)),
        }
    }

    /// Sends a write and answers on `tx`, holding the resource's lock until the
    /// store's response headers arrive or the write's outcome is given up on
    /// (timeout, connection lost after sending): then the resource is quarantined,
    /// and the task keeps waiting for the store's answer up to `quarantine_ms`, which
    /// lifts the quarantine if it comes.
    async fn write_exchange(
        self: Arc<Self>,
        req: http::Request<Body>,
        resource: String,
        guard: ResourceGuard,
        tx: tokio::sync::oneshot::Sender<Result<Response, FenceError>>,
    ) {
        let exchange = self.writes.request(req);
        tokio::pin!(exchange);
        let (id, answer_now) = match tokio::time::timeout(self.config.upstream_timeout, &mut exchange).await {
            Ok(Ok(r)) => {
                drop(guard);
                let _ = tx.send(Ok(answer(r)));
                return;
            }
            Ok(Err(e)) if e.is_connect() => {
                drop(guard);
                let _ = tx.send(Err(store_error(&e)));
                return;
            }
            Ok(Err(e)) => {
                // No answer can come on a lost connection: the quarantine runs its bound.
                self.quarantine.enter(&resource, self.config.quarantine);
                drop(guard);
                tracing::warn!(error = %e, "write in flight lost its connection; resource quarantined");
                let _ = tx.send(Err(store_error(&e)));
                return;
            }
            Err(_) => (self.quarantine.enter(&resource, self.config.quarantine), Err(FenceError::StoreTimeout)),
        };
        drop(guard);
        tracing::warn!("write timed out; resource quarantined until the store answers it or quarantine_ms passes");
        let _ = tx.send(answer_now);
        if let Ok(Ok(_)) = tokio::time::timeout(self.config.quarantine, exchange).await {
            // The store answered the write: it is no longer in flight.
            self.quarantine.lift(&resource, id);
        }
    }

    fn metrics_response(&self) -> Response {
        match self.metrics.encode() {
            Ok(text) => ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
            Err(_) => (http::StatusCode::INTERNAL_SERVER_ERROR, "cannot encode the metrics").into_response(),
        }
    }
}

/// The store's answer, hop-by-hop headers removed.
fn answer(r: http::Response<hyper::body::Incoming>) -> Response {
    let (mut parts, body) = r.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, Body::new(body))
}

/// What a failed exchange answers.
fn store_error(e: &hyper_util::client::legacy::Error) -> FenceError {
    if e.is_connect() {
        FenceError::StoreUnavailable("connection refused or failed; the store did not receive the request".into())
    } else {
        FenceError::StoreUnavailable(
            "the connection failed after the request was sent; a write may or may not have landed \
             (writes to this resource are refused until quarantine_ms passes)"
                .into(),
        )
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_quarantine_holds_until_its_bound_or_its_own_lift() {
        let q = Quarantine::default();
        assert!(!q.holds("r"));
        let id = q.enter("r", Duration::from_secs(60));
        assert!(q.holds("r") && !q.holds("other"));
        // A lift by an older entry's id changes nothing; its own lifts it.
        q.lift("r", id.wrapping_sub(1));
        assert!(q.holds("r"));
        q.lift("r", id);
        assert!(!q.holds("r"));
        // A newer entry is not lifted by the late answer of an older write.
        let old = q.enter("r", Duration::from_secs(60));
        let new = q.enter("r", Duration::from_secs(60));
        q.lift("r", old);
        assert!(q.holds("r"));
        q.lift("r", new);
        // The bound passes: the entry is gone.
        q.enter("r", Duration::from_millis(50));
        assert!(q.holds("r"));
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(!q.holds("r"));
        assert!(q.0.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_resource_guard_outlives_its_handler_when_a_task_owns_it() {
        let locks: Arc<ResourceLocks> = Arc::default();
        let g = locks.lock("r").await;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _g = g;
            let _ = rx.await;
        });
        // Another writer waits while the task holds the guard ...
        assert!(tokio::time::timeout(Duration::from_millis(50), locks.lock("r")).await.is_err());
        // ... and gets it once the task lets go; the map forgets an unused entry.
        let _ = tx.send(());
        task.await.unwrap();
        drop(tokio::time::timeout(Duration::from_secs(1), locks.lock("r")).await.unwrap());
        assert!(locks.0.lock().unwrap().is_empty());
    }
}
