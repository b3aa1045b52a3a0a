//! The read-only web console on the admin port (`docs/OPERATIONS.md`).
//!
//! ```text
//! GET /console                      the page (static HTML, embedded in the binary)
//! GET /console/app.js, /app.css     its script and style (no framework, no CDN)
//! GET /console/api/state            everything the page shows, JSON   (operator token)
//! GET /console/api/history          the plots' samples (`history`)     (operator token)
//! GET /console/api/classes/<class>  one class's drill-down             (operator token)
//! GET /console/api/waiters/<digest> waiters queued here for one key    (operator token)
//! ```
//!
//! The API checks the operator's token exactly as the admin actions do: a JWT in
//! `Authorization: Bearer`, verified against the JWKS, issuer, audience, role, MFA
//! and freshness of the arbiter's `operators` section ([`crate::config::Operators`]).
//! Refusals are the operator plane's one table ([`crate::respond::admin_refusal`],
//! the same statuses and bodies as the admin actions: `admin.token_missing`,
//! `admin.token_invalid`, `admin.token_expired`, `admin.token_stale` → 401;
//! `admin.role_missing`, `admin.mfa_missing` → 403; `console.bad_digest` → 400;
//! `admin.not_configured`, `console.unknown_class` → 404; `admin.jwks_invalid` → 503). Answers are the
//! types of `core::wire::console`. The page takes the token from the URL fragment (`/console#token=...`,
//! which browsers never send to a server) or a paste box, keeps it in the tab's
//! `sessionStorage` and sends it only in that header.
//!
//! On a split deployment (`clusters:`, docs/SCALE.md) every cluster the arbiter
//! knows is read, each through its own connection and in parallel: its class
//! policies, a hold scan, its members and its epoch. The tables name the cluster
//! of each row (`clusters`, each class's `clusters`, `draining`, `saturated`,
//! `quotas`); class totals are summed over the clusters. The waiters route counts
//! the key's waiters at this arbiter on every cluster.
//!
//! The holds-and-waits table (ADR-033) is by namespace and class, with the
//! arbiter's metrics' labels and figures (`hold_wait_rows`): no read of etcd.
//!
//! The plots (grants and refusals per second by class, gated waiters, the oldest
//! hold, etcd's latency) come from [`history`], a ring of the arbiter's own
//! figures sampled in memory; the hold-age distribution from the hold scans. A
//! class's drill-down (`classes/<class>`) scans the holds again for that class's
//! saturated keys, each with the acquires waiting for it here. The page links to
//! the Grafana dashboard of `console.grafana_url` when one is set.
//!
//! What it shows carries no token and no raw key: keys are digests (the hold
//! records' raw keys are dropped as they are read), audit events are shown by
//! kind, class, digest and revision, and the only identity is the signed-in
//! operator's own `sub`. Nothing is logged per request but refusals' codes.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

use axum::{
    extract::{Path as AxPath, State as AxState},
    http::{header, HeaderMap, HeaderValue},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use lockmesh_core::{
    class::{Enforcement, Fairness},
    policy::ClassPolicy,
    wire::{
        audit::{Answer, Query},
        console::{
            ClusterView, ConsoleAudit, ConsoleAuditEvent, ConsoleClass, ConsoleClassCluster, ConsoleClassDetail,
            ConsoleCluster, ConsoleDraining, ConsoleEnforcement, ConsoleEtcd, ConsoleHoldAges, ConsoleHoldWait,
            ConsoleOperator, ConsoleScan, ConsoleSeal, ConsoleState, ConsoleWaiters, PauseTest, ShadowCount,
        },
        inspect::SaturatedKey,
        status::ClassesStatus,
    },
    KeyDigest,
};
use lockmesh_lock::{connect::EtcdClientAuth, Store};
use lockmesh_ops::{
    admin::{jwt::Operator, AdminError},
    etcd_view::cluster_view,
    inspect::{read_policies, saturated, saturated_per_class, scan_holds, state_str, HoldScan, AGE_BOUNDS_MS},
    pause::{day_string, pause_status},
};
use serde::Serialize;

pub mod history;

use crate::{
    lock::now_ms,
    metrics::{tier_label, LockLabels, ETCD},
    state::State,
};

/// Most holds one state request scans (beyond it the page says `truncated`).
pub(crate) const SCAN_MAX: usize = 50_000;
/// Saturated keys shown.
pub(crate) const TOP_SATURATED: usize = 20;
/// Saturated keys of one class shown in its drill-down.
pub(crate) const CLASS_SATURATED: usize = 100;
/// Longest class name a refusal quotes.
const MAX_CLASS_QUOTED: usize = 64;

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

/// What one cluster's reads gave, for one snapshot.
struct ClusterRead {
    holds: ClusterHolds,
    view: ClusterView,
    epoch: Option<u64>,
}

/// One cluster's class policies and hold scan.
struct ClusterHolds {
    store: Arc<Store>,
    policies: Result<BTreeMap<String, ClassPolicy>, String>,
    scan: Result<HoldScan, String>,
}

impl std::ops::Deref for ClusterRead {
    type Target = ClusterHolds;

    fn deref(&self) -> &ClusterHolds {
        &self.holds
    }
}

impl ClusterHolds {
    fn name(&self) -> &str {
        self.store.cluster_name()
    }

    /// The authoritative limits of its policy records, by class.
    fn limits(&self) -> HashMap<String, u32> {
        self.policies.iter().flat_map(|p| p.values()).map(|p| (p.class.clone(), p.limit)).collect()
    }

    /// Its saturated keys (of `class`, or every class), at most `top`, each with
    /// the acquires waiting for it here.
    fn saturated(&self, limits: &HashMap<String, u32>, class: Option<&str>, top: usize) -> Vec<SaturatedKey> {
        let keys = self.scan.as_ref().map(|s| saturated(s, limits, class, top)).unwrap_or_default();
        keys.into_iter()
            .map(|k| {
                let waiters = KeyDigest::parse(&k.digest).map_or(0, |d| self.store.queues().len(&d));
                SaturatedKey {
                    class: k.class,
                    cluster: Some(self.name().to_owned()),
                    digest: k.digest,
                    holders: k.holders,
                    limit: k.limit,
                    oldest_age_ms: k.oldest_age_ms,
                    waiters_here: Some(waiters as u64),
                }
            })
            .collect()
    }
}

/// The hold scans of `reads` in one: holds summed, `truncated` if any was, the
/// first (coord) cluster's revision; or every failure, each naming its cluster
/// when there are several.
fn scan_summary<'a>(reads: impl Iterator<Item = &'a ClusterHolds> + Clone) -> ConsoleScan {
    let split = reads.clone().count() > 1;
    let errors: Vec<String> = reads
        .clone()
        .filter_map(|r| r.scan.as_ref().err().map(|e| if split { format!("{}: {e}", r.name()) } else { e.clone() }))
        .collect();
    if !errors.is_empty() {
        return ConsoleScan::Failed { error: errors.join("; ") };
    }
    let done = reads.clone().filter_map(|r| r.scan.as_ref().ok());
    ConsoleScan::Done {
        holds: done.clone().map(|s| s.holds as u64).sum(),
        revision: reads.clone().next().and_then(|r| r.scan.as_ref().ok()).map_or(0, |s| s.revision),
        truncated: done.clone().any(|s| s.truncated),
    }
}

/// The open holds by age of `class` (or every class) over `reads`; `None` when a
/// scan failed.
fn hold_ages<'a>(reads: impl Iterator<Item = &'a ClusterHolds>, class: Option<&str>) -> Option<ConsoleHoldAges> {
    let mut counts = vec![0u64; AGE_BOUNDS_MS.len() + 1];
    for r in reads {
        let scan = r.scan.as_ref().ok()?;
        for (_, h) in scan.classes.iter().filter(|(name, _)| class.is_none_or(|c| c == name.as_str())) {
            for (n, add) in counts.iter_mut().zip(h.ages) {
                *n += add;
            }
        }
    }
    Some(ConsoleHoldAges { bounds_ms: AGE_BOUNDS_MS.to_vec(), counts })
}

/// A refusal: the operator plane's one answer, with the console's no-store headers.
#[derive(Debug)]
struct Refusal(AdminError);

impl From<AdminError> for Refusal {
    fn from(e: AdminError) -> Self {
        Self(e)
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut r = crate::respond::admin_refusal(&self.0);
        no_store(r.headers_mut());
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
    let api_from = Arc::new(state.config.console.api_from.clone());
    let console = Arc::new(Console { state, members: Default::default() });
    let api = Router::new()
        .route("/console/api/state", get(api_state))
        .route("/console/api/history", get(api_history))
        .route("/console/api/classes/{class}", get(api_class))
        .route("/console/api/waiters/{digest}", get(api_waiters))
        .route_layer(axum::middleware::from_fn_with_state(api_from, peer_allowed))
        .with_state(console);
    Router::new()
        .route("/console", get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/console/", get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/console/app.js", get(|| async { asset(APP_JS, "text/javascript; charset=utf-8") }))
        .route("/console/app.css", get(|| async { asset(APP_CSS, "text/css; charset=utf-8") }))
        .merge(api)
}

/// The console API answers only peers in `console.api_from` (default loopback),
/// before the `Authorization` header is looked at: the admin port is plain HTTP,
/// so a token from anywhere else would have crossed the network in clear, and a
/// peer that cannot be told (no connection info) is refused too.
async fn peer_allowed(
    AxState(api_from): AxState<Arc<Vec<ipnet::IpNet>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let peer =
        request.extensions().get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip().to_canonical());
    match peer {
        Some(ip) if api_from.iter().any(|net| net.contains(&ip)) => next.run(request).await,
        _ => {
            let who = peer.map_or_else(|| "an unknown peer".to_owned(), |ip| ip.to_string());
            tracing::info!(code = "console.remote_refused", "console: request refused");
            Refusal(AdminError::RemoteRefused(who)).into_response()
        }
    }
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
    let ops = state.config.operators.as_ref().ok_or(AdminError::NotConfigured)?;
    let verified = lockmesh_ops::admin::bearer(headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()))
        .and_then(|token| ops.verifier()?.verify(token, now_ms() / 1000));
    verified.map_err(|e| {
        // The code only: the message may quote claims, and the token never goes anywhere.
        tracing::info!(code = e.code(), "console: request refused");
        Refusal(e)
    })
}

fn json_response(v: &impl Serialize) -> Response {
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
    let d = KeyDigest::parse(&digest).ok_or(AdminError::BadDigest)?;
    // The key's waiters queue on the store of its home: count every cluster's.
    let waiters = c.state.tiers.stores().map(|s| s.queues().len(&d) as u64).sum();
    Ok(json_response(&ConsoleWaiters { digest: d.to_string(), waiters }))
}

async fn api_history(AxState(c): AxState<Arc<Console>>, headers: HeaderMap) -> Result<Response, Refusal> {
    authenticate(&c.state, &headers)?;
    let classes = c.state.registry().classes().iter().map(|k| k.name.to_string()).collect::<Vec<_>>();
    Ok(json_response(&history::answer(classes)))
}

async fn api_class(
    AxState(c): AxState<Arc<Console>>,
    headers: HeaderMap,
    AxPath(class): AxPath<String>,
) -> Result<Response, Refusal> {
    authenticate(&c.state, &headers)?;
    let reg = c.state.registry();
    if !reg.classes().iter().any(|k| k.name.as_str() == class) {
        return Err(AdminError::UnknownClass(class.chars().take(MAX_CLASS_QUOTED).collect()).into());
    }
    Ok(json_response(&c.class_detail(&class, &reg).await))
}

async fn api_state(AxState(c): AxState<Arc<Console>>, headers: HeaderMap) -> Result<Response, Refusal> {
    let op = authenticate(&c.state, &headers)?;
    // The verified token goes on to the audit tailer's query port, which checks it again.
    let token = lockmesh_ops::admin::bearer(headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()))
        .ok()
        .map(str::to_owned);
    Ok(json_response(&c.snapshot(&op, token).await))
}

fn enforcement(e: &Enforcement) -> ConsoleEnforcement {
    match e {
        Enforcement::Fenced => ConsoleEnforcement::Fenced,
        Enforcement::Advisory { risk_owner, waiver_expiry_day } => ConsoleEnforcement::Advisory {
            risk_owner: risk_owner.clone(),
            waiver_expired: *waiver_expiry_day < crate::registry::today(),
            waiver_expiry: day_string(*waiver_expiry_day),
        },
    }
}

// === impl Console ===

impl Console {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.state.config.op_timeout_ms)
    }

    /// The TLS and user of cluster `name` (the coord cluster's: `etcd:`).
    fn auth_of(&self, name: &str) -> &EtcdClientAuth {
        let config = &self.state.config;
        config.topology.clusters.iter().find(|c| c.name == name).map_or(&config.etcd_auth, |c| &c.auth)
    }

    /// A connection to one member (cached), with its cluster's `auth`.
    async fn member(&self, url: String, auth: &EtcdClientAuth) -> Result<etcd_client::Client, String> {
        if let Some(c) = self.members.lock().await.get(&url) {
            return Ok(c.clone());
        }
        let certs = auth.reloading_certs(lockmesh_lock::connect::ETCD_CERT_RELOAD).map_err(|e| e.to_string())?;
        let timeouts = lockmesh_runtime::ChannelOptions {
            connect_timeout: self.timeout(),
            request_timeout: Some(self.timeout()),
            keep_alive: None,
        };
        let c = auth.connect(&[url.clone()], certs.as_ref(), timeouts).await.map_err(|e| e.to_string())?;
        self.members.lock().await.insert(url, c.clone());
        Ok(c)
    }

    /// One cluster's policies and hold scan, each bounded.
    async fn read_holds(&self, store: Arc<Store>, now: u64) -> ClusterHolds {
        let (timeout, root) = (self.timeout(), self.state.config.etcd_root.clone());
        let mut client = store.cluster().client();
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
        ClusterHolds { store, policies, scan }
    }

    /// One cluster's policies, hold scan, members and epoch, each bounded.
    async fn read_cluster(&self, store: Arc<Store>, now: u64) -> ClusterRead {
        let timeout = self.timeout();
        let holds = self.read_holds(store.clone(), now).await;
        let mut client = store.cluster().client();
        let auth = self.auth_of(store.cluster_name());
        let view = cluster_view(&mut client, timeout, |url| self.member(url, auth)).await;
        let epoch = match tokio::time::timeout(timeout, store.epoch().state()).await {
            Ok(Ok(e)) => Some(e.epoch),
            _ => None,
        };
        ClusterRead { holds, view, epoch }
    }

    /// One class's drill-down over every cluster (read in parallel): its saturated
    /// keys with their waiters here, its holds by age, its holds-and-waits rows.
    async fn class_detail(&self, class: &str, reg: &lockmesh_core::ClassRegistry) -> ConsoleClassDetail {
        let state = &self.state;
        let now = now_ms();
        let reads: Vec<ClusterHolds> =
            futures::future::join_all(state.tiers.stores().map(|s| self.read_holds(s.clone(), now))).await;
        let mut saturated_keys = 0;
        let mut open_grants = 0;
        let mut keys = Vec::new();
        for r in &reads {
            let limits = r.limits();
            if let Ok(scan) = &r.scan {
                saturated_keys += saturated_per_class(scan, &limits).get(class).copied().unwrap_or(0);
                open_grants += scan.classes.get(class).map_or(0, |h| h.open);
            }
            keys.extend(r.saturated(&limits, Some(class), CLASS_SATURATED));
        }
        keys.sort_by(|a, b| b.holders.cmp(&a.holders).then(b.oldest_age_ms.cmp(&a.oldest_age_ms)));
        keys.truncate(CLASS_SATURATED);
        ConsoleClassDetail {
            class: class.to_owned(),
            generated_ms: now,
            hold_ages: hold_ages(reads.iter(), Some(class)),
            holds_and_waits: hold_wait_rows(state, reg).into_iter().filter(|r| r.class == class).collect(),
            open_grants,
            saturated: keys,
            saturated_keys,
            scan: scan_summary(reads.iter()),
        }
    }

    /// Everything the page shows.
    async fn snapshot(&self, op: &Operator, token: Option<String>) -> ConsoleState {
        let state = &self.state;
        let now = now_ms();
        let reg = state.registry();
        // Every cluster, coord first, read in parallel.
        let reads: Vec<ClusterRead> =
            futures::future::join_all(state.tiers.stores().map(|s| self.read_cluster(s.clone(), now))).await;
        let split = reads.len() > 1;
        // An error names its cluster when there are several.
        let named = |r: &ClusterRead, e: &str| if split { format!("{}: {e}", r.name()) } else { e.to_owned() };
        let coord = &reads[0];
        let limits: Vec<HashMap<String, u32>> = reads.iter().map(|r| r.limits()).collect();
        let sat_per_class: Vec<HashMap<String, u64>> = reads
            .iter()
            .zip(&limits)
            .map(|(r, l)| r.scan.as_ref().map(|s| saturated_per_class(s, l)).unwrap_or_default())
            .collect();
        // The loader's base: the registry file's directory, or the manifest directory.
        let base = state.config.registry_source.pause_base();
        let classes = reg
            .classes()
            .iter()
            .map(|c| {
                let name = c.name.as_str();
                let per: Vec<ConsoleClassCluster> = reads
                    .iter()
                    .zip(&sat_per_class)
                    .map(|(r, sat)| {
                        let p = r.policies.as_ref().ok().and_then(|p| p.get(name));
                        let held = r.scan.as_ref().ok().and_then(|s| s.classes.get(name));
                        ConsoleClassCluster {
                            cluster: r.name().to_owned(),
                            keys_held: held.map_or(0, |h| h.keys),
                            limit: p.map(|p| p.limit),
                            oldest_grant_age_ms: held.map(|h| h.oldest_age_ms),
                            open_grants: held.map_or(0, |h| h.open),
                            saturated_keys: sat.get(name).copied().unwrap_or(0),
                            state: p.map(|p| state_str(p).to_owned()),
                        }
                    })
                    .collect();
                let p = coord.policies.as_ref().ok().and_then(|p| p.get(name));
                // A class drains while any cluster's record does (the draining table names it).
                let draining = reads
                    .iter()
                    .filter_map(|r| r.policies.as_ref().ok()?.get(name))
                    .find(|p| state_str(p) == "draining");
                let pause = matches!(c.enforcement, Enforcement::Fenced).then(|| {
                    let p = pause_status(&base, name, c.pause_test_result.as_deref(), now / 1000);
                    PauseTest { expires_unix_s: p.expires_unix_s, passing: p.passing }
                });
                ConsoleClass {
                    desired_max_holders: c.max_holders,
                    enforcement: enforcement(&c.enforcement),
                    fairness: match c.fairness {
                        Fairness::Memory => "memory",
                        Fairness::Durable => "durable",
                    }
                    .into(),
                    keys_held: per.iter().map(|k| k.keys_held).sum(),
                    limit: p.map(|p| p.limit),
                    name: name.to_owned(),
                    oldest_grant_age_ms: per.iter().filter_map(|k| k.oldest_grant_age_ms).max(),
                    open_grants: per.iter().map(|k| k.open_grants).sum(),
                    pause_test: pause,
                    pending_target: draining.or(p).and_then(|p| p.pending_target),
                    prefixes: c.prefixes.iter().map(ToString::to_string).collect(),
                    saturated_keys: per.iter().map(|k| k.saturated_keys).sum(),
                    state: draining.or(p).map(|p| state_str(p).to_owned()),
                    tier: tier_label(c.tier).to_owned(),
                    ttl_s: c.ttl_s,
                    clusters: per,
                }
            })
            .collect();
        let draining = reads
            .iter()
            .flat_map(|r| r.policies.iter().flat_map(|p| p.values()).map(move |p| (r, p)))
            .filter(|(_, p)| state_str(p) == "draining")
            .map(|(r, p)| ConsoleDraining {
                change_epoch: p.change_epoch,
                class: p.class.clone(),
                cluster: Some(r.name().to_owned()),
                draining_age_ms: p.draining_age_ms(now),
                limit: p.limit,
                pending_move: p.pending_move,
                pending_target: p.pending_target,
            })
            .collect();
        let mut saturated_keys: Vec<SaturatedKey> =
            reads.iter().zip(&limits).flat_map(|(r, l)| r.saturated(l, None, TOP_SATURATED)).collect();
        // Fullest, then oldest first, over every cluster (`saturated`'s order).
        saturated_keys.sort_by(|a, b| b.holders.cmp(&a.holders).then(b.oldest_age_ms.cmp(&a.oldest_age_ms)));
        saturated_keys.truncate(TOP_SATURATED);
        let scan = scan_summary(reads.iter().map(|r| &r.holds));
        let policy_errors: Vec<String> =
            reads.iter().filter_map(|r| r.policies.as_ref().err().map(|e| named(r, e))).collect();
        let clusters = reads
            .iter()
            .map(|r| ConsoleCluster {
                cluster: r.name().to_owned(),
                epoch: r.epoch,
                etcd: r.view.clone(),
                policies_error: r.policies.as_ref().err().cloned(),
                scan: match &r.scan {
                    Ok(s) => ConsoleScan::Done { holds: s.holds as u64, revision: s.revision, truncated: s.truncated },
                    Err(e) => ConsoleScan::Failed { error: e.clone() },
                },
                sealed: r.store.seal().current().map(|s| s.reason.as_str().to_owned()),
            })
            .collect();
        let seal = state.store.seal().current();
        let epoch = state.store.epoch().state().await.ok();
        let endpoints = state.config.etcd_endpoints.len() as u64;
        let cluster = coord.view.clone();
        let audit = self.audit(token).await;
        let registry = match crate::registry::classes_status(state).await {
            ClassesStatus::Read(r) => Some(r.registry),
            ClassesStatus::Unreadable { .. } => None,
        };
        ConsoleState {
            audit,
            classes,
            clusters,
            draining,
            etcd: ConsoleEtcd {
                cluster,
                endpoints,
                failing_for_ms: ETCD.failing_for_ms(now),
                reachable: ETCD.reachable(),
            },
            generated_ms: now,
            grafana_url: state.config.console.grafana_url.clone(),
            hold_ages: hold_ages(reads.iter().map(|r| &r.holds), None),
            holds_and_waits: hold_wait_rows(state, &reg),
            operator: ConsoleOperator { sub: op.sub.clone() },
            policies_error: (!policy_errors.is_empty()).then(|| policy_errors.join("; ")),
            registry,
            quotas: quota_rows(state.store.runtime()),
            saturated: saturated_keys,
            scan,
            shadow: shadow_rows(state.store.runtime()),
            seal: ConsoleSeal {
                detail: seal.as_ref().map(|s| s.detail.clone()),
                epoch: epoch.as_ref().map(|e| e.epoch),
                explicit: epoch.as_ref().and_then(|e| e.sealed.clone()),
                reason: seal.as_ref().map(|s| s.reason.as_str().to_owned()),
                sealed: seal.is_some(),
                since_ms: seal.as_ref().map(|s| s.since_ms),
            },
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    /// Recent audit events from the tailer (`console.audit_url`): kind, class,
    /// digest, revision, time; never the raw key, identity or session. The
    /// signed-in operator's `token` is forwarded to the tailer's query port.
    async fn audit(&self, token: Option<String>) -> ConsoleAudit {
        let cfg = &self.state.config.console;
        let none = ConsoleAudit { configured: true, error: None, events: None, message: None };
        let Some(url) = cfg.audit_url.as_deref() else {
            let message = Some("no audit store configured (console.audit_url)".to_owned());
            return ConsoleAudit { configured: false, message, ..none };
        };
        let q = Query::Recent { limit: u64::try_from(cfg.audit_events).unwrap_or(u64::MAX) };
        let tls = cfg.audit_tls.as_ref();
        let auth = lockmesh_ops::audit_client::QueryAuth {
            ca: tls.map(|t| t.ca.clone()),
            cert: tls.map(|t| t.cert.clone()),
            key: tls.map(|t| t.key.clone()),
            token,
        };
        match lockmesh_ops::audit_client::query(url, &q, &auth, self.timeout()).await {
            Ok(Answer::Events { events }) => {
                let events = events
                    .into_iter()
                    .map(|e| ConsoleAuditEvent {
                        at_ms: e.at_ms,
                        class: e.class,
                        digest: e.digest,
                        epoch: e.epoch,
                        kind: e.kind,
                        revision: e.revision,
                    })
                    .collect();
                ConsoleAudit { events: Some(events), ..none }
            }
            Ok(_) => ConsoleAudit { error: Some("the tailer answered another query".into()), ..none },
            Err(e) => ConsoleAudit { error: Some(format!("audit tailer: {e}")), ..none },
        }
    }
}

/// Holds and waits by namespace and class (ADR-033), as the arbiter's metrics
/// show them: the open holds and the oldest one from the quota ledgers (every
/// cluster, fleet-wide), gated waiters, wake-ups and pickups from the waiters'
/// books (`lock::wait`), and this arbiter's `key_gated` and `lock_contended`
/// answers. Every pair any of them knows, by labels.
fn hold_wait_rows(state: &State, reg: &lockmesh_core::ClassRegistry) -> Vec<ConsoleHoldWait> {
    let mut rows: BTreeMap<(String, String), ConsoleHoldWait> = BTreeMap::new();
    let rt = state.store.runtime();
    for ((ns, class), (holds, age_ms)) in crate::metrics::hold_rows(rt) {
        let r = hold_wait_row(&mut rows, &ns, &class);
        (r.open_holds, r.oldest_hold_ms) = (holds, age_ms);
    }
    for (l, g) in crate::lock::wait::gated(&rt.quotas().lock_labels()) {
        let r = hold_wait_row(&mut rows, &l.namespace, &l.class);
        (r.gated_waiters, r.oldest_gated_wait_ms) = (g.waiters, g.oldest_ms);
    }
    for (l, f) in crate::lock::wait::FIGURES.all() {
        let r = hold_wait_row(&mut rows, &l.namespace, &l.class);
        let t = f.totals();
        (r.grants_after_wait, r.wakeups, r.pickups) = (t.grants, t.wakeups, t.pickups);
        r.pickup_mean_ms = (t.pickups > 0).then(|| t.pickup_us / t.pickups / 1000);
    }
    let mut out: Vec<ConsoleHoldWait> = rows.into_values().collect();
    for r in &mut out {
        // The acquire counters' labels carry the class's tier (`metrics::lock_labels`).
        if let Some(c) = reg.classes().iter().find(|c| c.name.as_str() == r.class) {
            let labels =
                LockLabels { namespace: r.namespace.clone(), class: r.class.clone(), tier: tier_label(c.tier) };
            (r.key_gated, r.lock_contended) = state.metrics.refusals(&labels);
        }
    }
    out
}

/// The row of `namespace` and `class` in `rows` (all 0 when new).
fn hold_wait_row<'a>(
    rows: &'a mut BTreeMap<(String, String), ConsoleHoldWait>,
    namespace: &str,
    class: &str,
) -> &'a mut ConsoleHoldWait {
    rows.entry((namespace.to_owned(), class.to_owned())).or_insert_with(|| ConsoleHoldWait {
        class: class.to_owned(),
        gated_waiters: 0,
        grants_after_wait: 0,
        key_gated: 0,
        lock_contended: 0,
        namespace: namespace.to_owned(),
        oldest_gated_wait_ms: 0,
        oldest_hold_ms: 0,
        open_holds: 0,
        pickup_mean_ms: None,
        pickups: 0,
        wakeups: 0,
    })
}

/// What promoting each class's candidate would have changed over the last 24
/// hours at this arbiter (`lock::shadow::Shadow::last_day`), for the console and `/status`.
pub(crate) fn shadow_rows(rt: &crate::lock::Runtime) -> Vec<ShadowCount> {
    rt.shadow()
        .last_day()
        .into_iter()
        .map(|c| ShadowCount {
            class: c.class,
            count: c.count,
            decision: c.decision.as_str().to_owned(),
            reason: c.reason,
        })
        .collect()
}

/// The quota table: every namespace this arbiter counts (`lock::quota::Quotas::usage`).
fn quota_rows(rt: &crate::lock::Runtime) -> Vec<lockmesh_core::wire::console::ConsoleQuota> {
    use lockmesh_core::wire::console::{ConsoleQuota, QuotaUse};
    rt.quotas()
        .usage()
        .into_iter()
        .map(|u| {
            let (sessions, holds) =
                (QuotaUse::of(u.sessions, u.limits.sessions), QuotaUse::of(u.holds, u.limits.holds));
            let waiters = QuotaUse::of(u.waiters, u.waiters_share);
            ConsoleQuota {
                alert: sessions.alerting() || holds.alerting() || waiters.alerting(),
                cluster: u.cluster,
                namespace: u.namespace,
                sessions,
                holds,
                waiters: Some(waiters),
                acquires_per_s: u.limits.acquires_per_s,
            }
        })
        .collect()
}
