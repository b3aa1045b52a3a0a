//! The HTTP API, answered by the arbiter through ext_proc (`docs/API.md`).
//!
//! Envoy hands the request headers over; nothing here reads a body. Every route is
//! answered with an `ImmediateResponse`, so a lock API request never reaches an
//! upstream.

use std::sync::Arc;

use lockmesh_core::{
    class::OnQuorumLoss,
    headers::{self, LockHeaders, Permits},
    wire::api::{
        Acquired as AcquiredBody, AcquiredAll, Election, Holder, KeyGrant, Leader, LockInfo, Proclaimed, Released,
        SessionClosed, SessionHold, SessionHolds, SessionOpened, SessionRenewed, TokenValidity,
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
    tiers::{Acquired, HoldFor},
};

/// A lock API route: core's table (`lockmesh_core::route`), which the Wasm filter
/// classifies requests by too. The dispatch, the grant check
/// ([`Route::operation`]) and the metrics label read it.
pub use lockmesh_core::route::ApiRoute as Route;

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
    /// The identity the request acts as: the caller's SPIFFE ID as a vouching
    /// client claims it, or a self client's own SPIFFE ID.
    pub identity: String,
    /// A self client's claimed caller, when it differs from its own identity: kept
    /// as unverified in the hold record, never used to authorise.
    pub unverified_caller: Option<String>,
    /// True when the ext_proc client is a self client (`tls.self_clients`).
    pub self_client: bool,
    /// The filter's `x-lockmesh-granted-ns` on a session opened without a key: the
    /// key namespaces the caller's grants let it acquire in.
    pub granted_ns: Option<Vec<String>>,
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
    /// A multi-key grant: one per key, all on `store`.
    Grants { reqs: Vec<AcquireRequest>, grants: Vec<crate::lock::mutex::Grant>, store: Arc<Store> },
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
            Undo::Grants { reqs, grants, store } => store.undo_all(reqs, grants).await,
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

/// What an acquire asks for (`x-lock-permits`, `x-lock-mode`). A fail-open class
/// grants from memory during a quorum loss, one slot at a time, so more than one
/// slot is not offered there; nor on elections (one leader). Asking for more
/// slots than the key's limit is refused by the grant, which reads that limit.
pub(crate) fn permits_of(lock: &LockHeaders, class: &ClassSpec) -> Result<Permits, ApiError> {
    let p = lock.permits().map_err(|e| ApiError::new(Code::BadRequest, e.to_string()))?;
    if p.of(class.max_holders) != 1 && class.on_quorum_loss == OnQuorumLoss::Open {
        return Err(ApiError::new(
            Code::BadRequest,
            format!(
                "{}: more than one slot is not offered on the fail-open class {} (its quorum-loss grants take one)",
                headers::PERMITS,
                class.name
            ),
        ));
    }
    Ok(p)
}

/// Refuses `x-lock-permits` and `x-lock-mode` on a route whose grant takes one
/// slot: `bad_request` naming the first sent, then `why`.
pub(crate) fn one_slot_only(lock: &LockHeaders, why: &str) -> Result<(), ApiError> {
    let sent = [(lock.permits.is_some(), headers::PERMITS), (lock.mode.is_some(), headers::MODE)];
    match sent.into_iter().find_map(|(s, h)| s.then_some(h)) {
        Some(h) => Err(ApiError::new(Code::BadRequest, format!("{h}: {why}"))),
        None => Ok(()),
    }
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
    crate::registry::authorise(state, req, crate::registry::api_operation(&req.method, &req.path))?;
    // A key homed in another region is redirected, never forwarded (ADR-08).
    for key in lock.key.iter().chain(lock.keys.iter().flatten()) {
        if let Some(region) = tiers.wrong_region(key) {
            return Err(ApiError::wrong_region(key.namespace(), region));
        }
    }
    let Some(route) = Route::of(req.method.as_bytes(), req.path.as_bytes()) else {
        return Err(ApiError::new(Code::NotFound, format!("no route {} {}", req.method, req.path)));
    };
    let r = match route {
        Route::Acquire => return acquire(state, req, caller, false, cancel).await,
        Route::AcquireAll => return acquire_all(state, req, caller, cancel).await,
        Route::Release if lock.grant.is_some() => {
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
        Route::Release => release(state, lock, &caller).await?,
        Route::Campaign => return campaign(state, req, caller, cancel).await,
        Route::Proclaim => proclaim(state, lock, &caller).await?,
        Route::Resign if lock.grant.is_some() => {
            return Err(ApiError::new(
                Code::BadRequest,
                format!("{}: a leadership is never unprotected; resign names its {}", headers::GRANT, headers::TOKEN),
            ));
        }
        Route::Resign => {
            election_class(state, lock, &need(lock.key.clone(), headers::KEY)?)?;
            release(state, lock, &caller).await?
        }
        Route::Observe => observe(state, req, &caller, cancel).await?,
        Route::Inspect => {
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
                    permits: (h.permits > 1).then_some(h.permits),
                    mode: h.mode,
                })
                .collect();
            let lock_delay_ms = if class.lock_delay_s > 0 {
                store
                    .lock_delay()
                    .record_left(&key.digest())
                    .await?
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            } else {
                None
            };
            ApiResponse::ok(&LockInfo {
                class: class.name.to_string(),
                holders,
                max_holders: class.max_holders,
                waiting_here: store.queues().len(&key.digest()) as u64,
                lock_delay_ms,
            })
        }
        Route::SessionOpen => {
            let class = match (&lock.class, &lock.key) {
                (_, Some(key)) => class_for(state, lock, key)?,
                (Some(c), None) => state
                    .registry()
                    .get(c.as_str())
                    .cloned()
                    .ok_or_else(|| ApiError::new(Code::BadRequest, format!("{}: no class {c}", headers::CLASS)))?,
                (None, None) => state.registry().default_class().clone(),
            };
            let mut ns = state.registry().session_namespace(class.name.as_str(), lock.key.as_ref());
            if lock.key.is_none() {
                ns = keyless_namespace(state, req, ns)?;
            }
            let sid = tiers.open_session(&caller, &class, lock.key.as_ref(), &ns).await?;
            let opened = SessionOpened { class: class.name.to_string(), session: sid, ttl_s: class.ttl_s };
            let mut r = if crate::test_faults::on(crate::test_faults::TestFault::WireDrift) {
                // PLANTED BUG (the OpenAPI scenario): `ttl_s` as a string.
                #[derive(serde::Serialize)]
                struct Drifted {
                    class: String,
                    session: lockmesh_core::headers::SessionId,
                    ttl_s: String,
                }
                ApiResponse::ok(&Drifted { class: opened.class, session: sid, ttl_s: opened.ttl_s.to_string() })
            } else {
                ApiResponse::ok(&opened)
            };
            r.headers.push((headers::SESSION, sid.to_string()));
            r
        }
        Route::SessionKeepalive => {
            let sid = need(lock.session, headers::SESSION)?;
            let ttl = tiers.keepalive(sid, &caller).await.inspect_err(|e| state.metrics.renewal_failure(e))?;
            ApiResponse::ok(&SessionRenewed { session: sid, ttl_s: ttl })
        }
        Route::SessionClose => {
            let sid = need(lock.session, headers::SESSION)?;
            tiers.close_session(sid, &caller).await?;
            ApiResponse::ok(&SessionClosed { closed: true })
        }
        Route::SessionHolds => {
            let sid = need(lock.session, headers::SESSION)?;
            let mut holds = Vec::new();
            for h in tiers.session_holds(sid, &caller).await? {
                // The epochs its cluster still honours, as an acquire's answer
                // says them: a holder fences nothing those keep valid.
                let honoured_from = match tiers.stores().find(|s| s.cluster_name() == h.cluster) {
                    Some(s) => honoured_from(s, h.token.epoch()).await,
                    None => None,
                };
                holds.push(SessionHold {
                    acquired_ms: h.acquired_ms,
                    class: h.class,
                    cluster: Some(h.cluster),
                    epoch: h.token.epoch(),
                    honoured_from,
                    key: h.key,
                    revision: h.token.revision(),
                    token: h.token,
                });
            }
            ApiResponse::ok(&SessionHolds { holds, session: sid })
        }
        Route::Validate => {
            let key = need(lock.key.clone(), headers::KEY)?;
            let token = need(lock.token, headers::TOKEN)?;
            if !state.validate_limiter.try_take() {
                return Ok((crate::validate::rate_limited(), None));
            }
            let class = state.registry().class_of(&key).clone();
            let current = tiers.is_current(&class, &key, token).await?;
            ApiResponse::ok(&TokenValidity { current })
        }
    };
    Ok((r, None))
}

/// The release of a protected grant (`/v1/locks/release`, `/v1/elections/resign`).
async fn release(state: &Arc<State>, lock: &LockHeaders, caller: &Caller) -> Result<ApiResponse, ApiError> {
    let key = need(lock.key.clone(), headers::KEY)?;
    let token = need(lock.token, headers::TOKEN)?;
    let class = state.registry().class_of(&key).clone();
    let span = crate::telemetry::release_span(&state.registry(), &key);
    #[cfg(not(feature = "bench-floor"))]
    let r = state.tiers.release(&class, &key, token, caller, lock.session).instrument(span.clone()).await;
    // The mesh floor (benchmark builds only, `crate::floor`): released without etcd.
    #[cfg(feature = "bench-floor")]
    let r = {
        let _ = (&class, caller);
        crate::floor::release(&state.store, &key, token, lock.session).await
    };
    crate::telemetry::finish(&span, crate::lock::release_outcome(&r), None);
    r?;
    // A session an acquire opened for itself ends with its last hold: after the
    // answer, which waits on nothing but the release's own transaction (the
    // record was read, and cached, by the release). Other sessions cost no task.
    #[cfg(not(feature = "bench-floor"))]
    if let Some(sid) = lock.session {
        if state.tiers.opened_by_acquire(sid, caller).await.unwrap_or(false) {
            let (state, caller) = (state.clone(), caller.clone());
            tokio::spawn(async move {
                if let Err(e) = state.tiers.end_if_spent(sid, &caller).await {
                    tracing::debug!(error = %e, "an acquire's own session could not be ended at its last release; it expires with its ttl");
                }
            });
        }
    }
    Ok(ApiResponse::ok(&Released { released: true, unprotected: false }))
}

/// The quota namespace a session opened without a key is charged to: its class's
/// (`ns`), when the caller is granted there, by the registry's grants when it has
/// any, else by what the filter verified (`x-lockmesh-granted-ns`); refused
/// `denied` when the caller is shown not to be (a tenant never spends another's
/// session quota). With no proof either way (a filter older than this arbiter),
/// the unscoped namespace, never another tenant's.
fn keyless_namespace(state: &State, req: &ApiRequest, ns: String) -> Result<String, ApiError> {
    if ns == lockmesh_core::quota::UNSCOPED || crate::test_faults::on(crate::test_faults::TestFault::ChargeAnyNamespace)
    {
        return Ok(ns); // PLANTED BUG (holder_safety scenario) when the fault is on.
    }
    let granted = match state.registry().grants() {
        Some(g) => Some(g.namespaces(&req.identity, lockmesh_core::grant::Operation::Acquire)),
        None => req.granted_ns.clone(),
    };
    match granted {
        Some(list) if list.contains(&ns) => Ok(ns),
        Some(_) => Err(ApiError::new(Code::Denied, "not permitted")),
        None => Ok(lockmesh_core::quota::UNSCOPED.to_owned()),
    }
}

/// The key's class, when it can hold an election: a mutex (one leader) that fails
/// closed (a leadership always carries a token).
fn election_class(state: &State, lock: &LockHeaders, key: &LockKey) -> Result<ClassSpec, ApiError> {
    let class = class_for(state, lock, key)?;
    if class.max_holders != 1 {
        return Err(ApiError::new(
            Code::BadRequest,
            format!(
                "{}: the key's class {} allows {} holders; an election needs a class with max_holders 1",
                headers::KEY,
                class.name,
                class.max_holders
            ),
        ));
    }
    if class.on_quorum_loss == OnQuorumLoss::Open {
        return Err(ApiError::new(
            Code::BadRequest,
            format!(
                "{}: the key's class {} grants without a token when etcd's quorum is lost; an election needs a \
                 class that fails closed",
                headers::KEY,
                class.name
            ),
        ));
    }
    Ok(class)
}

/// `POST /v1/elections/campaign`: an acquire of the election's key (the same
/// queue, grant and answer), then the value proclaimed under the new token. A
/// value that cannot be stored undoes the grant: the caller is not leader.
async fn campaign(
    state: &Arc<State>,
    req: &ApiRequest,
    caller: Caller,
    cancel: &CancellationToken,
) -> Result<(ApiResponse, Option<Undo>), ApiError> {
    let lock = &req.lock;
    let key = need(lock.key.clone(), headers::KEY)?;
    election_class(state, lock, &key)?;
    one_slot_only(lock, "an election has one leader; send it on acquires only")?;
    let mut granted = acquire(state, req, caller.clone(), true, cancel).await;
    if crate::test_faults::on(crate::test_faults::TestFault::CampaignAfterSessionLoss)
        && lock.session.is_some()
        && matches!(&granted, Err(e) if e.code == Code::SessionExpired)
    {
        // PLANTED BUG (the election scenario): the campaign's session is gone, and
        // it campaigns on with a new one (etcd's phantom leadership).
        let mut again = req.clone();
        again.lock.session = None;
        granted = acquire(state, &again, caller.clone(), true, cancel).await;
    }
    let (r, undo) = granted?;
    let (Some(value), Some(Undo::Grant { grant, store, .. })) = (&lock.value, &undo) else {
        return Ok((r, undo));
    };
    if let Err(e) = store.proclaim(&key, grant.token, &caller, Some(grant.session), value).await {
        if let Some(u) = &undo {
            u.run().await;
        }
        return Err(e.into());
    }
    Ok((r, undo))
}

/// The election named by `lock`: its key, class and the cluster that homes it
/// (proclaim and observe; a campaign routes as an acquire).
async fn election_home(
    state: &State,
    lock: &LockHeaders,
) -> Result<(LockKey, ClassSpec, Arc<lockmesh_lock::Store>), ApiError> {
    let key = need(lock.key.clone(), headers::KEY)?;
    let class = election_class(state, lock, &key)?;
    let store = state.tiers.route(&class, &key, false).await?;
    Ok((key, class, store))
}

/// `POST /v1/elections/proclaim`.
async fn proclaim(state: &Arc<State>, lock: &LockHeaders, caller: &Caller) -> Result<ApiResponse, ApiError> {
    let (key, _, store) = election_home(state, lock).await?;
    let token = need(lock.token, headers::TOKEN)?;
    let value = need(lock.value.as_deref(), headers::VALUE)?;
    store.unsealed()?;
    store.proclaim(&key, token, caller, lock.session, value).await?;
    Ok(ApiResponse::ok(&Proclaimed { proclaimed: true }))
}

/// `GET /v1/elections`: the leadership now, or (with `x-lock-after`) after the
/// first change past that cursor, waiting up to the request's wait. Shows what an
/// inspection shows (G7): the leader's token only to the leader naming its
/// session, and revisions only sealed into cursors (`crate::cursor`).
async fn observe(
    state: &Arc<State>,
    req: &ApiRequest,
    caller: &Caller,
    cancel: &CancellationToken,
) -> Result<ApiResponse, ApiError> {
    let lock = &req.lock;
    let (key, class, store) = election_home(state, lock).await?;
    let wait = wait_of(state, req)?;
    let d = key.digest();
    let cluster = store.cluster_name().to_owned();
    // A cursor that does not open here (another arbiter's, an earlier run's, or
    // made up) resumes nothing: the state now, with the gap said.
    let (after, unopened) = match lock.after.as_deref() {
        None => (None, false),
        Some(c) => match state.cursor.open(&cluster, &d, c) {
            Some(rev) => (Some(rev), false),
            None => (None, true),
        },
    };
    let o = store.observe(&key, caller, lock.session, after, req.received + wait, cancel).await?;
    let leader = o.leader.map(|l| {
        let you = l.identity == caller.identity && lock.session.is_some_and(|s| s.lease() == l.lease);
        Leader { identity: l.identity, since_ms: l.since_ms, token: you.then_some(l.token), value: l.value, you }
    });
    Ok(ApiResponse::ok(&Election {
        changed: o.changed || unopened,
        class: class.name.to_string(),
        cursor: state.cursor.seal(&cluster, &d, o.revision),
        gap: o.gap || unopened,
        leader,
    }))
}

/// `POST /v1/locks/acquire-all`: every key of `x-lock-keys` (of one class, homed
/// on one cluster) in one grant transaction, or none (`lock::multi`).
async fn acquire_all(
    state: &Arc<State>,
    req: &ApiRequest,
    caller: Caller,
    cancel: &CancellationToken,
) -> Result<(ApiResponse, Option<Undo>), ApiError> {
    let lock = &req.lock;
    let bad = |m: String| Err(ApiError::new(Code::BadRequest, m));
    let mut keys = need(lock.keys.clone(), headers::KEYS)?;
    if lock.key.is_some() {
        return bad(format!("{}: a multi-key acquire names its keys in {} only", headers::KEY, headers::KEYS));
    }
    one_slot_only(lock, "a multi-key acquire takes one slot of each key")?;
    keys.sort();
    let classes = keys.iter().map(|k| class_for(state, lock, k)).collect::<Result<Vec<_>, _>>()?;
    let class = classes[0].clone();
    let distinct = {
        let mut names: Vec<&str> = classes.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.len()
    };
    if distinct > 1 {
        return bad(format!(
            "{}: the keys are of {distinct} classes; one acquire takes keys of one class",
            headers::KEYS
        ));
    }
    if class.on_quorum_loss == OnQuorumLoss::Open {
        return bad(format!(
            "{}: a multi-key acquire is not offered on the fail-open class {} (its quorum-loss grants take one key)",
            headers::KEYS,
            class.name
        ));
    }
    let wait = wait_of(state, req)?;
    let reqs: Vec<AcquireRequest> = keys
        .into_iter()
        .map(|key| AcquireRequest {
            key,
            class: class.clone(),
            caller: caller.clone(),
            session: lock.session,
            deadline: req.received + wait,
            try_once: wait.is_zero(),
            hold_id: None,
            session_owner: None,
            unverified_caller: req.unverified_caller.clone(),
            permits: Permits::Count(1),
            mode: None,
            election: false,
            session_indexed: false,
        })
        .collect();
    let reg = state.registry();
    let span = crate::telemetry::acquire_span(&reg, &reqs[0].key);
    let result = state.tiers.acquire_all(&reqs, cancel).instrument(span.clone()).await;
    let outcome = crate::metrics::outcome_label(&result);
    crate::telemetry::finish(&span, outcome, Some(req.received.elapsed()));
    let labels = crate::metrics::lock_labels(&reg, &reqs[0].key);
    state.metrics.acquire(labels, outcome, req.received.elapsed().as_secs_f64());
    let (grants, store) = result?;
    let g = grants.first().ok_or_else(|| ApiError::new(Code::Internal, "a multi-key grant without grants"))?;
    let signing = state.config.signing.as_ref();
    let body = AcquiredAll {
        class: g.class.clone(),
        cluster: store.cluster_name().to_owned(),
        epoch: g.token.epoch(),
        honoured_from: honoured_from(&store, g.token.epoch()).await,
        existing: g.existing,
        new_session: g.new_session,
        revision: g.token.revision(),
        session: g.session,
        token: g.token.to_string(),
        ttl_s: g.ttl_s,
        keys: reqs
            .iter()
            .zip(&grants)
            .map(|(r, kg)| KeyGrant {
                key: r.key.as_str().to_owned(),
                token: kg.token.to_string(),
                proof: crate::signing::proof_for(signing, &r.key, kg.token, &kg.class),
            })
            .collect(),
    };
    let mut r = ApiResponse::ok(&body);
    r.headers.push((headers::TOKEN, g.token.to_string()));
    r.headers.push((headers::SESSION, g.session.to_string()));
    Ok((r, Some(Undo::Grants { reqs, grants, store })))
}

/// The lowest epoch of `store`'s cluster whose holds are still honoured, when it
/// is below `epoch` (a move's soft advance keeps them: `prior`). From the epoch
/// state the grant itself used (cached), so no read.
async fn honoured_from(store: &Store, epoch: u64) -> Option<u64> {
    let st = store.epoch().state().await.ok()?;
    st.prior.iter().copied().filter(|p| *p < epoch).min()
}

/// An acquire (`election`: a campaign's, granted only under a limit of 1).
async fn acquire(
    state: &Arc<State>,
    req: &ApiRequest,
    caller: Caller,
    election: bool,
    cancel: &CancellationToken,
) -> Result<(ApiResponse, Option<Undo>), ApiError> {
    let lock = &req.lock;
    let key = need(lock.key.clone(), headers::KEY)?;
    let class = class_for(state, lock, &key)?;
    let wait = wait_of(state, req)?;
    let permits = permits_of(lock, &class)?;
    let areq = AcquireRequest {
        key,
        class,
        caller,
        session: lock.session,
        deadline: req.received + wait,
        try_once: wait.is_zero(),
        hold_id: None,
        session_owner: None,
        unverified_caller: req.unverified_caller.clone(),
        permits,
        mode: lock.mode,
        election,
        session_indexed: false,
    };
    let span = crate::telemetry::acquire_span(&state.registry(), &areq.key);
    let reg = state.registry();
    #[cfg(not(feature = "bench-floor"))]
    let result = state.tiers.acquire_or_open(&areq, HoldFor::Caller, &reg, cancel).instrument(span.clone()).await;
    // The mesh floor (benchmark builds only, `crate::floor`): granted without etcd.
    #[cfg(feature = "bench-floor")]
    let result =
        crate::floor::acquire(&state.store, &areq, cancel).await.map(|g| Acquired::Protected(g, state.store.clone()));
    let labels = crate::metrics::lock_labels(&reg, &areq.key);
    let (result, store) = match result {
        Ok(Acquired::Protected(g, s)) => (Ok(g), Some(s)),
        Ok(Acquired::Unprotected(g, fo)) => {
            crate::telemetry::finish(&span, "unprotected", Some(req.received.elapsed()));
            state.metrics.acquire(labels, "unprotected", req.received.elapsed().as_secs_f64());
            let mut r = ApiResponse::ok(&AcquiredBody {
                class: g.class.clone(),
                cluster: None,
                epoch: g.epoch,
                honoured_from: None,
                existing: g.existing,
                grant: Some(g.grant.clone()),
                new_session: false,
                permits: None,
                mode: areq.mode,
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
    let honoured_from = match &store {
        Some(s) => honoured_from(s, g.token.epoch()).await,
        None => None,
    };
    let mut r = ApiResponse::ok(&AcquiredBody {
        class: g.class.to_string(),
        cluster: store.as_ref().map(|s| s.cluster_name().to_owned()),
        epoch: g.token.epoch(),
        honoured_from,
        existing: g.existing,
        grant: None,
        new_session: g.new_session,
        permits: (g.permits > 1).then_some(g.permits),
        mode: g.mode,
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

#[cfg(test)]
mod tests {
    use lockmesh_core::grant::Operation;

    use super::*;

    /// Core's table is the one both the filter (its tests hold its classification
    /// to every row) and this dispatch read; docs/API.md is held to it in core.
    #[test]
    fn every_route_is_found_with_its_operation_and_label_and_nothing_else_is() {
        let mut labels = std::collections::HashSet::new();
        for (m, p, r) in lockmesh_core::route::API_ROUTES {
            assert_eq!(Route::of(m.as_bytes(), p.as_bytes()), Some(r), "{m} {p}");
            assert!(labels.insert(r.label()), "two routes share the label {}", r.label());
            assert_eq!(crate::metrics::route_label(m, p), r.label(), "{m} {p}");
            let op = crate::registry::api_operation(m, p);
            assert_eq!(op, r.operation(), "{m} {p}");
        }
        // The grant check's operations, as the filter decides them (wasm-filter/src/route.rs).
        assert_eq!(crate::registry::api_operation("POST", "/v1/tokens/validate"), Operation::Validate);
        assert_eq!(crate::registry::api_operation("GET", "/v1/locks"), Operation::Inspect);
        assert_eq!(crate::registry::api_operation("POST", "/v1/sessions/close"), Operation::Acquire);
        assert_eq!(crate::registry::api_operation("DELETE", "/v1/admin/x"), Operation::Admin);
        // The old prefix test's false friend is no route and needs `acquire`.
        assert_eq!(Route::of(b"POST", b"/v1/validate"), None);
        assert_eq!(crate::registry::api_operation("POST", "/v1/validate"), Operation::Acquire);
        for (m, p) in [("GET", "/v1/locks/acquire"), ("POST", "/v1/locks/acquire/"), ("POST", "//v1/locks/acquire")] {
            assert_eq!(Route::of(m.as_bytes(), p.as_bytes()), None, "{m} {p}");
        }
        assert_eq!(crate::metrics::route_label("POST", "/v1/tokens/validate"), "validate");
        assert_eq!(crate::metrics::route_label("POST", "/nowhere"), "other");
    }
}
