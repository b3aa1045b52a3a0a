//! The HTTP API, answered by the arbiter through ext_proc (`docs/API.md`).
//!
//! Envoy hands the request headers over; nothing here reads a body. Every route is
//! answered with an `ImmediateResponse`, so a lock API request never reaches an
//! upstream.

use std::sync::Arc;

use lockmesh_core::{
    headers::{self, LockHeaders},
    wire::api::{
        Acquired as AcquiredBody, Holder, LockInfo, Released, SessionClosed, SessionHold, SessionHolds, SessionOpened,
        SessionRenewed, TokenValidity,
    },
    ClassSpec, Code, LockKey,
};
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    failopen::FailOpen,
    lock::{mutex::AcquireRequest, session::Caller, Store},
    respond::{ApiError, ApiResponse},
    state::State,
    tiers::Acquired,
};

/// A request as the arbiter sees it.
#[derive(Debug, Clone)]
pub struct ApiRequest {
    /// `:method`.
    pub method: String,
    /// `:path` without the query.
    pub path: String,
    /// Parsed lock headers.
    pub lock: LockHeaders,
    /// The filter's budget, ms (time already spent queued in the filter removed).
    pub budget_ms: Option<u64>,
    /// Verified SPIFFE ID from Envoy's connection attributes.
    pub identity: String,
    /// When this arbiter received the request.
    pub received: Instant,
}

/// What an acquire needs to undo if its answer cannot be delivered.
pub enum Undo {
    /// An etcd grant.
    Grant {
        req: AcquireRequest,
        grant: crate::lock::mutex::Grant,
        /// The cluster that granted it.
        store: Arc<Store>,
    },
    /// An unprotected grant (ADR-04): released from memory, its end spooled.
    Unprotected {
        /// The fail-open state holding it.
        fail_open: Arc<FailOpen>,
        req: AcquireRequest,
        /// The grant id.
        grant: String,
    },
}

impl Undo {
    /// Releases the grant nobody received.
    pub async fn run(&self) {
        match self {
            Undo::Grant { req, grant, store } => store.undo(req, grant).await,
            Undo::Unprotected { fail_open, req, grant } => {
                let _ = fail_open.release(&req.key.digest(), grant, &req.caller, Some("caller_gone")).await;
            }
        }
    }
}

fn need<T>(v: Option<T>, header: &str) -> Result<T, ApiError> {
    v.ok_or_else(|| ApiError::new(Code::BadRequest, format!("{header}: required")))
}

/// The key's class from the registry; refuses an `x-lock-class` that names another.
pub(crate) fn class_for(state: &State, lock: &LockHeaders, key: &LockKey) -> Result<ClassSpec, ApiError> {
    let reg = state.registry();
    let class = reg.class_of(key).clone();
    if let Some(asked) = &lock.class {
        if asked.as_str() != class.name.as_str() {
            return Err(ApiError::new(
                Code::ClassMismatch,
                format!("{}: the key's class is {}, not {asked}", headers::CLASS, class.name),
            ));
        }
    }
    Ok(class)
}

/// The wait this request may spend, from the filter's budget (or its own header).
pub(crate) fn wait_of(state: &State, req: &ApiRequest) -> Result<Duration, ApiError> {
    let ms = req.budget_ms.or(req.lock.wait_ms).unwrap_or(0);
    if ms > state.config.max_wait_ms {
        return Err(ApiError::new(
            Code::BadRequest,
            format!("{}: {ms} ms is above the maximum {} ms", headers::WAIT_MS, state.config.max_wait_ms),
        ));
    }
    Ok(Duration::from_millis(ms))
}

/// Answers one API request. `undo` receives a grant whose answer may be lost.
pub async fn handle(state: &Arc<State>, req: &ApiRequest, cancel: &CancellationToken) -> (ApiResponse, Option<Undo>) {
    match route(state, req, cancel).await {
        Ok(r) => r,
        Err(e) => (e.into(), None),
    }
}

async fn route(
    state: &Arc<State>,
    req: &ApiRequest,
    cancel: &CancellationToken,
) -> Result<(ApiResponse, Option<Undo>), ApiError> {
    let tiers = &state.tiers;
    let caller = Caller { identity: req.identity.clone(), instance: req.lock.instance.clone() };
    let lock = &req.lock;
    // Sealed: every request is refused until the epoch advances.
    state.store.unsealed()?;
    // Defence in depth: the registry's LockGrants, when it carries any.
    crate::registry::authorise(state, req)?;
    // A key homed in another region is redirected, never forwarded (ADR-08).
    if let Some(key) = &lock.key {
        if let Some(region) = tiers.wrong_region(key) {
            return Err(ApiError::wrong_region(key.namespace(), region));
        }
    }
    let r = match (req.method.as_str(), req.path.as_str()) {
        ("POST", "/v1/locks/acquire") => return acquire(state, req, caller, cancel).await,
        ("POST", "/v1/locks/release") if lock.grant.is_some() => {
            // An unprotected grant (ADR-04) is released by its grant id, from memory.
            let key = need(lock.key.clone(), headers::KEY)?;
            if lock.token.is_some() {
                return Err(ApiError::new(
                    Code::BadRequest,
                    format!("{} and {}: name one grant, not both", headers::TOKEN, headers::GRANT),
                ));
            }
            let grant = lock.grant.as_deref().unwrap_or_default();
            tiers.release_unprotected(&key, grant, &caller).await?;
            ApiResponse::ok(&Released { released: true, unprotected: true })
        }
        ("POST", "/v1/locks/release") => {
            let key = need(lock.key.clone(), headers::KEY)?;
            let token = need(lock.token, headers::TOKEN)?;
            let class = state.registry().class_of(&key).clone();
            let span = crate::telemetry::release_span(&state.registry(), &key);
            let r = tiers.release(&class, &key, token, &caller, lock.session).instrument(span.clone()).await;
            crate::telemetry::finish(&span, crate::lock::release_outcome(&r), None);
            r?;
            ApiResponse::ok(&Released { released: true, unprotected: false })
        }
        ("GET", "/v1/locks") => {
            let key = need(lock.key.clone(), headers::KEY)?;
            let class = class_for(state, lock, &key)?;
            let (holders, store) = tiers.inspect(&class, &key, &caller, lock.session).await?;
            let holders = holders
                .into_iter()
                .map(|h| Holder {
                    age_ms: h.age_ms,
                    identity: h.identity,
                    session: h.own.map(|(_, s)| s),
                    token: h.own.map(|(t, _)| t),
                    you: h.own.is_some(),
                })
                .collect();
            ApiResponse::ok(&LockInfo {
                class: class.name.to_string(),
                holders,
                max_holders: class.max_holders,
                waiting_here: store.queues().len(&key.digest()) as u64,
            })
        }
        ("POST", "/v1/sessions") => {
            let class = match (&lock.class, &lock.key) {
                (_, Some(key)) => class_for(state, lock, key)?,
                (Some(c), None) => state
                    .registry()
                    .get(c.as_str())
                    .cloned()
                    .ok_or_else(|| ApiError::new(Code::BadRequest, format!("{}: no class {c}", headers::CLASS)))?,
                (None, None) => state.registry().default_class().clone(),
            };
            let sid = tiers.open_session(&caller, &class, lock.key.as_ref()).await?;
            let mut r =
                ApiResponse::ok(&SessionOpened { class: class.name.to_string(), session: sid, ttl_s: class.ttl_s });
            r.headers.push((headers::SESSION, sid.to_string()));
            r
        }
        ("POST", "/v1/sessions/keepalive") => {
            let sid = need(lock.session, headers::SESSION)?;
            let ttl = tiers.keepalive(sid, &caller).await.inspect_err(|e| state.metrics.renewal_failure(e))?;
            ApiResponse::ok(&SessionRenewed { session: sid, ttl_s: ttl })
        }
        ("POST", "/v1/sessions/close") => {
            let sid = need(lock.session, headers::SESSION)?;
            tiers.close_session(sid, &caller).await?;
            ApiResponse::ok(&SessionClosed { closed: true })
        }
        ("GET", "/v1/sessions/holds") => {
            let sid = need(lock.session, headers::SESSION)?;
            let holds = tiers.session_holds(sid, &caller).await?;
            let holds = holds
                .into_iter()
                .map(|h| SessionHold {
                    acquired_ms: h.acquired_ms,
                    class: h.class,
                    epoch: h.token.epoch(),
                    key: h.key,
                    revision: h.token.revision(),
                    token: h.token,
                })
                .collect();
            ApiResponse::ok(&SessionHolds { holds, session: sid })
        }
        ("POST", "/v1/tokens/validate") => {
            let key = need(lock.key.clone(), headers::KEY)?;
            let token = need(lock.token, headers::TOKEN)?;
            if !state.validate_limiter.try_take() {
                return Ok((crate::validate::rate_limited(), None));
            }
            let class = state.registry().class_of(&key).clone();
            let current = tiers.is_current(&class, &key, token).await?;
            ApiResponse::ok(&TokenValidity { current })
        }
        (m, p) => return Err(ApiError::new(Code::NotFound, format!("no route {m} {p}"))),
    };
    Ok((r, None))
}

async fn acquire(
    state: &Arc<State>,
    req: &ApiRequest,
    caller: Caller,
    cancel: &CancellationToken,
) -> Result<(ApiResponse, Option<Undo>), ApiError> {
    let lock = &req.lock;
    let key = need(lock.key.clone(), headers::KEY)?;
    let class = class_for(state, lock, &key)?;
    let wait = wait_of(state, req)?;
    let areq = AcquireRequest {
        key,
        class,
        caller,
        session: lock.session,
        deadline: req.received + wait,
        try_once: wait.is_zero(),
        hold_id: None,
        session_owner: None,
    };
    let span = crate::telemetry::acquire_span(&state.registry(), &areq.key);
    let reg = state.registry();
    let result = state.tiers.acquire_or_open(&areq, None, &reg, cancel).instrument(span.clone()).await;
    let labels = crate::metrics::lock_labels(&reg, &areq.key);
    let (result, store) = match result {
        Ok(Acquired::Protected(g, s)) => (Ok(g), Some(s)),
        Ok(Acquired::Unprotected(g, fo)) => {
            crate::telemetry::finish(&span, "unprotected", Some(req.received.elapsed()));
            state.metrics.acquire(labels, "unprotected", req.received.elapsed().as_secs_f64());
            let mut r = ApiResponse::ok(&AcquiredBody {
                class: g.class.clone(),
                epoch: g.epoch,
                existing: g.existing,
                grant: Some(g.grant.clone()),
                new_session: false,
                outage: Some(g.outage.clone()),
                proof: None,
                revision: 0,
                session: None,
                token: headers::UNPROTECTED_TOKEN.to_owned(),
                ttl_s: g.ttl_s,
                unprotected: true,
            });
            r.headers.push((headers::TOKEN, headers::UNPROTECTED_TOKEN.to_owned()));
            r.headers.push((headers::GRANT, g.grant.clone()));
            let undo = (!g.existing).then(|| Undo::Unprotected { fail_open: fo, req: areq, grant: g.grant });
            return Ok((r, undo));
        }
        Err(e) => (Err(e), None),
    };
    let outcome = crate::metrics::outcome_label(&result);
    crate::telemetry::finish(&span, outcome, Some(req.received.elapsed()));
    state.metrics.acquire(labels, outcome, req.received.elapsed().as_secs_f64());
    let grant = result?;
    let g = &grant;
    let proof = crate::signing::proof_for(state.config.signing.as_ref(), &areq.key, g.token, &g.class);
    let mut r = ApiResponse::ok(&AcquiredBody {
        class: g.class.to_string(),
        epoch: g.token.epoch(),
        existing: g.existing,
        grant: None,
        new_session: g.new_session,
        outage: None,
        proof: proof.clone(),
        revision: g.token.revision(),
        session: Some(g.session),
        token: g.token.to_string(),
        ttl_s: g.ttl_s,
        unprotected: false,
    });
    r.headers.push((headers::TOKEN, g.token.to_string()));
    if let Some(p) = proof {
        r.headers.push((headers::PROOF, p));
    }
    r.headers.push((headers::SESSION, g.session.to_string()));
    Ok((r, store.map(|store| Undo::Grant { req: areq, grant, store })))
}
