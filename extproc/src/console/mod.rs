//! The read-only web console on the admin port (`docs/OPERATIONS.md`).
//!
//! ```text
//! GET /console                      the page (static HTML, embedded in the binary)
//! GET /console/app.js, /app.css     its script and style (no framework, no CDN)
//! GET /console/api/state            everything the page shows, JSON   (operator token)
//! GET /console/api/waiters/<digest> waiters queued here for one key    (operator token)
//! ```
//!
//! The API checks the operator's token exactly as the admin actions do: a JWT in
//! `Authorization: Bearer`, verified against the JWKS, issuer, audience, role, MFA
//! and freshness of the arbiter's `operators` section ([`crate::config::Operators`]).
//! Refusals carry a stable code (`admin.token_missing`, `admin.token_invalid`,
//! `admin.token_expired`, `admin.token_stale` → 401; `admin.role_missing`,
//! `admin.mfa_missing` → 403; `admin.not_configured` → 404; `admin.jwks_invalid` →
//! 503). The page takes the token from the URL fragment (`/console#token=...`,
//! which browsers never send to a server) or a paste box, keeps it in the tab's
//! `sessionStorage` and sends it only in that header.
//!
//! What it shows carries no token and no raw key: keys are digests (the hold
//! records' raw keys are dropped as they are read), audit events are shown by
//! kind, class, digest and revision, and the only identity is the signed-in
//! operator's own `sub`. Nothing is logged per request but refusals' codes.

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    extract::{Path as AxPath, State as AxState},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use lockmesh_core::{
    class::{Enforcement, Fairness},
    KeyDigest,
};
use serde_json::{json, Value};

use lockmesh_core::wire::audit::{Answer, Query};
use lockmesh_ops::{
    admin::{jwt::Operator, AdminError},
    etcd_view::cluster_view,
    inspect::{read_policies, saturated, saturated_per_class, scan_holds, state_str},
    pause::{day_string, pause_status},
};

use crate::{
    lock::now_ms,
    metrics::{tier_label, ETCD},
    state::State,
};

/// Most holds one state request scans (beyond it the page says `truncated`).
pub const SCAN_MAX: usize = 50_000;
/// Saturated keys shown.
pub const TOP_SATURATED: usize = 20;

const INDEX_HTML: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const APP_CSS: &str = include_str!("app.css");

/// The page may load only its own script and style and call only its own API.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'none'; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The console's own state: per-member etcd connections, reused across requests.
pub struct Console {
    state: Arc<State>,
    members: tokio::sync::Mutex<HashMap<String, etcd_client::Client>>,
}

/// A refusal: HTTP status, stable code, message.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(json!({"code": self.code, "message": self.message}))).into_response();
        no_store(r.headers_mut());
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

fn no_store(h: &mut HeaderMap) {
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
}

/// The console routes, to merge into the admin router.
pub fn router(state: Arc<State>) -> Router {
    let console = Arc::new(Console { state, members: Default::default() });
    Router::new()
        .route("/console", get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/console/", get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/console/app.js", get(|| async { asset(APP_JS, "text/javascript; charset=utf-8") }))
        .route("/console/app.css", get(|| async { asset(APP_CSS, "text/css; charset=utf-8") }))
        .route("/console/api/state", get(api_state))
        .route("/console/api/waiters/{digest}", get(api_waiters))
        .with_state(console)
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    no_store(h);
    r
}

/// Verifies the bearer token as the admin actions do (`operators`).
fn authenticate(state: &State, headers: &HeaderMap) -> Result<Operator, Refusal> {
    let Some(ops) = state.config.operators.as_ref() else {
        return Err(Refusal {
            status: StatusCode::NOT_FOUND,
            code: "admin.not_configured",
            message: "this arbiter has no operators section: the console API is off (docs/OPERATIONS.md)".into(),
        });
    };
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let Some(token) = token else {
        return Err(Refusal {
            status: StatusCode::UNAUTHORIZED,
            code: "admin.token_missing",
            message: "sign in: an operator token is required (Authorization: Bearer)".into(),
        });
    };
    let verified = ops.verifier().and_then(|v| v.verify(token, now_ms() / 1000));
    verified.map_err(|e| {
        let status = match &e {
            AdminError::RoleMissing(_) | AdminError::MfaMissing => StatusCode::FORBIDDEN,
            AdminError::Jwks(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::UNAUTHORIZED,
        };
        // The code only: the message may quote claims, and the token never goes anywhere.
        tracing::info!(code = e.code(), "console: request refused");
        Refusal { status, code: e.code(), message: e.to_string() }
    })
}

fn json_response(v: Value) -> Response {
    let mut r = axum::Json(v).into_response();
    no_store(r.headers_mut());
    r
}

async fn api_waiters(
    AxState(c): AxState<Arc<Console>>,
    headers: HeaderMap,
    AxPath(digest): AxPath<String>,
) -> Result<Response, Refusal> {
    authenticate(&c.state, &headers)?;
    let d = KeyDigest::parse(&digest).ok_or(Refusal {
        status: StatusCode::BAD_REQUEST,
        code: "console.bad_digest",
        message: "digest: 64 lowercase hex digits (lockctl inspect KEY prints it)".into(),
    })?;
    Ok(json_response(json!({"digest": d.to_string(), "waiters": c.state.store.queues().len(&d)})))
}

async fn api_state(AxState(c): AxState<Arc<Console>>, headers: HeaderMap) -> Result<Response, Refusal> {
    let op = authenticate(&c.state, &headers)?;
    Ok(json_response(c.snapshot(&op).await))
}

fn enforcement(e: &Enforcement) -> Value {
    match e {
        Enforcement::Fenced => json!({"posture": "fenced"}),
        Enforcement::Advisory { risk_owner, waiver_expiry_day } => json!({
            "posture": "advisory", "risk_owner": risk_owner, "waiver_expiry": day_string(*waiver_expiry_day),
            "waiver_expired": *waiver_expiry_day < crate::registry::today(),
        }),
    }
}

// === impl Console ===

impl Console {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.state.config.op_timeout_ms)
    }

    /// A connection to one member (cached).
    async fn member(&self, url: String) -> Result<etcd_client::Client, String> {
        if let Some(c) = self.members.lock().await.get(&url) {
            return Ok(c.clone());
        }
        let opts = self.state.config.etcd_auth.apply(etcd_client::ConnectOptions::new()).with_timeout(self.timeout());
        let c = etcd_client::Client::connect([url.as_str()], Some(opts)).await.map_err(|e| e.to_string())?;
        self.members.lock().await.insert(url, c.clone());
        Ok(c)
    }

    /// Everything the page shows.
    async fn snapshot(&self, op: &Operator) -> Value {
        let state = &self.state;
        let (now, timeout) = (now_ms(), self.timeout());
        let root = state.config.etcd_root.clone();
        let reg = state.registry();
        let mut client = state.store.client();
        let policies = match tokio::time::timeout(timeout, read_policies(&mut client, &root)).await {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => Err(format!("class policies: {e}")),
            Err(_) => Err(format!("class policies: no answer within {timeout:?}")),
        };
        let scan = match tokio::time::timeout(timeout * 5, scan_holds(&mut client, &root, SCAN_MAX, now)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(format!("holds: {e}")),
            Err(_) => Err(format!("holds: the scan did not finish within {:?}", timeout * 5)),
        };
        let empty = Default::default();
        let pol = policies.as_ref().unwrap_or(&empty);
        let limits: HashMap<String, u32> = pol.values().map(|p| (p.class.clone(), p.limit)).collect();
        let sat_per_class = scan.as_ref().map(|s| saturated_per_class(s, &limits)).unwrap_or_default();
        let base = state.config.registry_file.parent().map(std::path::Path::to_owned).unwrap_or_default();
        let classes: Vec<Value> = reg
            .classes()
            .iter()
            .map(|c| {
                let name = c.name.as_str();
                let p = pol.get(name);
                let held = scan.as_ref().ok().and_then(|s| s.classes.get(name));
                let pause = matches!(c.enforcement, Enforcement::Fenced).then(|| {
                    let p = pause_status(&base, name, c.pause_test_result.as_deref(), now / 1000);
                    json!({"passing": p.passing, "expires_unix_s": p.expires_unix_s})
                });
                json!({
                    "name": name, "tier": tier_label(c.tier), "enforcement": enforcement(&c.enforcement),
                    "pause_test": pause, "ttl_s": c.ttl_s,
                    "fairness": match c.fairness { Fairness::Memory => "memory", Fairness::Durable => "durable" },
                    "desired_max_holders": c.max_holders, "prefixes": c.prefixes,
                    "limit": p.map(|p| p.limit), "state": p.map(state_str),
                    "pending_target": p.and_then(|p| p.pending_target),
                    "open_grants": held.map_or(0, |h| h.open), "keys_held": held.map_or(0, |h| h.keys),
                    "oldest_grant_age_ms": held.map(|h| h.oldest_age_ms),
                    "saturated_keys": sat_per_class.get(name).copied().unwrap_or(0),
                })
            })
            .collect();
        let draining: Vec<Value> = pol
            .values()
            .filter(|p| state_str(p) == "draining")
            .map(|p| {
                json!({
                    "class": p.class, "limit": p.limit, "pending_target": p.pending_target,
                    "change_epoch": p.change_epoch, "pending_move": p.pending_move,
                    "draining_age_ms": p.draining_age_ms(now),
                })
            })
            .collect();
        let top: Vec<Value> = scan
            .as_ref()
            .map(|s| saturated(s, &limits, None, TOP_SATURATED))
            .unwrap_or_default()
            .into_iter()
            .map(|k| {
                let waiters = KeyDigest::parse(&k.digest).map_or(0, |d| state.store.queues().len(&d));
                json!({"digest": k.digest, "class": k.class, "holders": k.holders, "limit": k.limit,
                       "oldest_age_ms": k.oldest_age_ms, "waiters_here": waiters})
            })
            .collect();
        let seal = state.store.seal().current();
        let epoch = state.store.epoch_state().await.ok();
        let endpoints = state.config.etcd_endpoints.len();
        let cluster = cluster_view(&mut client, timeout, |url| self.member(url)).await;
        let audit = self.audit().await;
        let rs = crate::registry::status_json(state).await;
        json!({
            "generated_ms": now,
            "version": env!("CARGO_PKG_VERSION"),
            "operator": {"sub": op.sub},
            "seal": {
                "sealed": seal.is_some(), "reason": seal.as_ref().map(|s| s.reason.as_str()),
                "detail": seal.as_ref().map(|s| s.detail.clone()), "since_ms": seal.as_ref().map(|s| s.since_ms),
                "epoch": epoch.as_ref().map(|e| e.epoch),
                "explicit": epoch.as_ref().and_then(|e| e.sealed.clone()),
            },
            "etcd": {
                "reachable": ETCD.reachable(), "failing_for_ms": ETCD.failing_for_ms(now),
                "endpoints": endpoints, "cluster": cluster,
            },
            "registry": rs["registry"],
            "classes": classes,
            "draining": draining,
            "saturated": top,
            "scan": match &scan {
                Ok(s) => json!({"holds": s.holds, "truncated": s.truncated, "revision": s.revision}),
                Err(e) => json!({"error": e}),
            },
            "policies_error": policies.as_ref().err(),
            "audit": audit,
        })
    }

    /// Recent audit events from the tailer (`console.audit_url`): kind, class,
    /// digest, revision, time; never the raw key, identity or session.
    async fn audit(&self) -> Value {
        let cfg = &self.state.config.console;
        let Some(url) = cfg.audit_url.as_deref() else {
            return json!({"configured": false, "message": "no audit store configured (console.audit_url)"});
        };
        let q = Query::Recent { limit: u64::try_from(cfg.audit_events).unwrap_or(u64::MAX) };
        let answer = lockmesh_ops::audit_client::query(url, &q, self.timeout()).await;
        match answer {
            Ok(Answer::Events { events }) => {
                let events: Vec<Value> = events
                    .into_iter()
                    .map(|e| {
                        json!({"kind": e.kind, "revision": e.revision, "epoch": e.epoch, "at_ms": e.at_ms,
                               "class": e.class, "digest": e.digest})
                    })
                    .collect();
                json!({"configured": true, "events": events})
            }
            Ok(_) => json!({"configured": true, "error": "the tailer answered another query"}),
            Err(e) => json!({"configured": true, "error": format!("audit tailer: {e}")}),
        }
    }
}
