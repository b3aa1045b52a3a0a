//! [`Client`]: one workload identity talking to one lock tier; its sessions (one
//! per TTL), its re-entrancy ledger, its fence callback and its optional jeopardy
//! callback.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, OnceLock,
    },
    time::Duration,
};

use lockmesh_core::{
    headers::{self, LockMode, SessionId},
    Code,
};
use tokio::{sync::Notify, time::Instant};

use crate::{
    api::Api,
    clock::{HoldState, LossReason},
    guard::LockGuard,
    ledger::{Enter, Ledger},
    session::{Session, SessionStatus},
    Config, Error,
};

/// Most keys whose session TTL is remembered (the memory is cleared past this).
const MAX_KNOWN_KEYS: usize = 65_536;

/// Most clusters whose epoch is remembered; a deployment has a handful. Past it the
/// memory is cleared (an epoch seen again is then new: it fences only grants of an
/// older epoch of that same cluster, which are void anyway).
const MAX_CLUSTERS: usize = 1024;

/// What the fence callback is told: the session and every hold it carried are
/// lost. Stop using their tokens; the resource's fence rejects them anyway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceEvent {
    /// The lost session (16 hex digits).
    pub session: String,
    /// Why it is lost.
    pub reason: LossReason,
    /// The keys held on it when it was lost, sorted.
    pub keys: Vec<String>,
}

/// The fence callback type: called once per lost session, on a runtime thread; it
/// must not block.
pub type OnFence = Arc<dyn Fn(FenceEvent) + Send + Sync>;

/// What the jeopardy callback is told: a session entered jeopardy (a keepalive
/// failed: start no new work under its holds) or left it by recovery (a later
/// keepalive was acknowledged before the fence deadline). Jeopardy that ends in
/// loss is told by the fence callback instead, never here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JeopardyEvent {
    /// The session (16 hex digits).
    pub session: String,
    /// [`HoldState::Jeopardy`] on entering, [`HoldState::Safe`] on recovery.
    pub state: HoldState,
    /// Time left before the fence deadline when the change was seen (on entering:
    /// how long a recovery may still take).
    pub remaining: Duration,
    /// The keys held on the session, sorted.
    pub keys: Vec<String>,
}

/// The jeopardy callback type: called on a runtime thread; it must not block.
/// For one session the calls alternate (entered, recovered, entered, ...) and all
/// come before that session's fence callback.
pub type OnJeopardy = Arc<dyn Fn(JeopardyEvent) + Send + Sync>;

/// Options of one [`Client::lock`] call.
#[derive(Clone, Debug, Default)]
pub struct LockOptions {
    /// How long the acquire may wait for the key (`x-lock-wait-ms`). Default 0:
    /// try once.
    pub wait: Duration,
    /// Refuse unless the key's class is this one (`x-lock-class`). Default none.
    pub class: Option<String>,
    /// Client-side bound of the acquire request. Default `wait + acquire_slack`.
    /// Past it the outcome is unknown and resolved in the background.
    pub timeout: Option<Duration>,
    /// Take `k` of the key's N slots at once (`x-lock-permits`). Default none: one.
    pub permits: Option<u32>,
    /// A read-write lock (`x-lock-mode`): shared takes one slot, exclusive all N.
    pub mode: Option<LockMode>,
}

/// Requests this client sent, by route (for tests and dashboards).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// `POST /v1/sessions`.
    pub sessions_opened: u64,
    /// `POST /v1/locks/acquire`.
    pub acquires: u64,
    /// `POST /v1/locks/release`.
    pub releases: u64,
    /// `GET /v1/sessions/holds`.
    pub hold_listings: u64,
}

/// A handle to the SDK; cheap to clone. Create one per workload identity.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

/// Shared state behind [`Client`] and every [`LockGuard`].
pub(crate) struct Inner {
    pub(crate) api: Api,
    pub(crate) config: Config,
    on_fence: OnFence,
    on_jeopardy: Option<OnJeopardy>,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    opening: tokio::sync::Mutex<()>,
    /// TTL of keys and classes seen in session opens (which the registry decides).
    key_ttl: Mutex<HashMap<String, u64>>,
    class_ttl: Mutex<HashMap<String, u64>>,
    pub(crate) ledger: Mutex<Ledger>,
    /// Notified when a key stops being acquired or released.
    pub(crate) changed: Notify,
    pub(crate) runtime: tokio::runtime::Handle,
    /// The highest epoch seen per etcd cluster (the grant names it; `None`: an
    /// older service that names none). Bounded by [`MAX_CLUSTERS`].
    max_epoch: Mutex<HashMap<Option<String>, u64>>,
    pub(crate) counters: [AtomicU64; 4],
}

// === impl LockOptions ===

impl LockOptions {
    /// Wait up to `wait` for the key.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Expect the key's class to be `class`.
    pub fn class(mut self, class: impl Into<String>) -> Self {
        self.class = Some(class.into());
        self
    }

    /// Bound the acquire request to `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Take `k` of the key's N slots, all at once or none (1 to 64). The guard's
    /// one token releases them all. Not with [`LockOptions::mode`].
    pub fn permits(mut self, k: u32) -> Self {
        self.permits = Some(k);
        self
    }

    /// Hold the key shared (one slot, beside other readers) or exclusive (all N
    /// slots, alone). Not with [`LockOptions::permits`].
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.mode = Some(mode);
        self
    }

    /// The `x-lock-permits` or `x-lock-mode` header these options send, if any.
    fn shape(&self) -> Option<(&'static str, String)> {
        match (self.permits, self.mode) {
            (Some(k), _) => Some((headers::PERMITS, k.to_string())),
            (None, Some(m)) => Some((headers::MODE, m.as_str().to_owned())),
            (None, None) => None,
        }
    }
}

// === impl Client ===

impl Client {
    /// A client for `config`. `on_fence` is required (ADR-12): it runs once for
    /// each session lost, with the keys it held. Must be called inside a tokio
    /// runtime (the keepalives run on it).
    pub fn new(config: Config, on_fence: impl Fn(FenceEvent) + Send + Sync + 'static) -> Result<Self, Error> {
        Self::build(config, Arc::new(on_fence), None)
    }

    /// [`Client::new`] that also tells `on_jeopardy` when a session enters
    /// jeopardy (its first failed keepalive) and when it recovers (a later
    /// keepalive acknowledged before the fence deadline): Chubby's jeopardy and
    /// safe events. A session that does not recover gets the fence callback at its
    /// deadline, after its jeopardy event. Polling works too: [`LockGuard::state`].
    pub fn with_jeopardy(
        config: Config,
        on_fence: impl Fn(FenceEvent) + Send + Sync + 'static,
        on_jeopardy: impl Fn(JeopardyEvent) + Send + Sync + 'static,
    ) -> Result<Self, Error> {
        Self::build(config, Arc::new(on_fence), Some(Arc::new(on_jeopardy)))
    }

    fn build(config: Config, on_fence: OnFence, on_jeopardy: Option<OnJeopardy>) -> Result<Self, Error> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::Config {
            field: "runtime",
            why: "Client::new must run inside a tokio runtime".into(),
        })?;
        let api = Api::new(&config, instance_id().to_owned())?;
        let inner = Inner {
            api,
            config,
            on_fence,
            on_jeopardy,
            sessions: Mutex::new(HashMap::new()),
            opening: tokio::sync::Mutex::new(()),
            key_ttl: Mutex::new(HashMap::new()),
            class_ttl: Mutex::new(HashMap::new()),
            ledger: Mutex::new(Ledger::default()),
            changed: Notify::new(),
            runtime,
            max_epoch: Mutex::new(HashMap::new()),
            counters: Default::default(),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Acquires `key`, or counts one more nesting if this process holds it
    /// (ADR-13: only the outermost acquire reaches the service). Refused with
    /// [`Error::Draining`] while the key's session cannot start new work.
    ///
    /// Cancel-safe: if this future is dropped, an acquire already sent runs to its
    /// end in the background and any hold it made is released. An acquire whose
    /// answer is lost returns [`Error::OutcomeUnknown`] and is resolved the same
    /// way; calling `lock` again is safe.
    pub async fn lock(&self, key: &str, opts: LockOptions) -> Result<LockGuard, Error> {
        self.take(key, &opts, None, None).await
    }

    /// Acquires every key of `keys` (2 to 16, of one class, on one etcd cluster)
    /// in one grant, or none (`POST /v1/locks/acquire-all`): one guard per key, in
    /// the order given, all with the same token; each guard releases its key.
    /// The keys are held on one session. Waiting (`opts.wait`) holds nothing, so
    /// two callers whose key sets overlap cannot deadlock. `opts.permits` and
    /// `opts.mode` are not offered here ([`Error::Config`]). A key this client
    /// already holds or is acquiring is refused `Contended { reason:
    /// "acquiring_here" }`: a multi-key grant is never nested into holds.
    ///
    /// Cancel-safe like [`Client::lock`]: a grant whose caller left is released.
    pub async fn lock_all(&self, keys: &[&str], opts: LockOptions) -> Result<Vec<LockGuard>, Error> {
        let list = keys.join(" ");
        headers::parse_keys(list.as_bytes()).map_err(|e| Error::Config { field: "keys", why: e.why })?;
        if opts.permits.is_some() || opts.mode.is_some() {
            let why = "a multi-key acquire takes one slot of each key".to_owned();
            return Err(Error::Config { field: "permits", why });
        }
        let inner = &self.inner;
        let session = loop {
            let s = inner.session_for(keys[0], opts.class.as_deref()).await?;
            match s.lost() {
                Some(r) => inner.fence(&s, r),
                None => break s,
            }
        };
        if !session.status().can_start {
            return Err(Error::Draining);
        }
        // Every key enters the ledger as this acquire's, or none does.
        let mut entered: Vec<&str> = Vec::with_capacity(keys.len());
        for k in keys {
            // Bound first: the ledger's lock must be free again in the arms.
            let e = inner.ledger().enter(k, session.id);
            match e {
                Enter::Acquire => entered.push(k),
                other => {
                    if let Enter::Nested(g) = other {
                        // Counted once more by `enter`: uncount it.
                        let _ = inner.ledger().exit(k, g.token);
                    }
                    for e in &entered {
                        inner.ledger().not_acquired(e, session.id);
                    }
                    return Err(Error::Contended { reason: "acquiring_here".into() });
                }
            }
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = crate::acquire::AcquireAll {
            inner: inner.clone(),
            session,
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            wait: opts.wait,
            class: opts.class.clone(),
            timeout: opts.timeout.unwrap_or(opts.wait + inner.config.acquire_slack),
        };
        inner.runtime.spawn(task.run(tx));
        rx.await.unwrap_or(Err(Error::OutcomeUnknown))
    }

    /// [`Client::lock`], or a campaign (`campaign`: the value to proclaim, if
    /// any) on `pinned`, the campaign's one session: when it is lost this ends
    /// with [`Error::SessionLost`] instead of opening another.
    pub(crate) async fn take(
        &self,
        key: &str,
        opts: &LockOptions,
        campaign: Option<Option<&str>>,
        pinned: Option<&Arc<Session>>,
    ) -> Result<LockGuard, Error> {
        headers::parse_key(key.as_bytes()).map_err(|e| Error::Config { field: "key", why: e.why })?;
        if let Some(k) = opts.permits {
            headers::parse_permits(k.to_string().as_bytes())
                .map_err(|e| Error::Config { field: "permits", why: e.why })?;
            if opts.mode.is_some() {
                let why = "permits and mode cannot both be set (exclusive takes every slot)".to_owned();
                return Err(Error::Config { field: "permits", why });
            }
        }
        let give_up = Instant::now() + opts.wait;
        let inner = &self.inner;
        let mut relearnt = false;
        loop {
            let session = match pinned {
                Some(s) => s.clone(),
                None => inner.session_for(key, opts.class.as_deref()).await?,
            };
            if let Some(r) = session.lost() {
                inner.fence(&session, r);
                if pinned.is_some() {
                    return Err(Error::SessionLost(r));
                }
                continue;
            }
            if !session.status().can_start {
                return Err(Error::Draining);
            }
            let notified = inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let entered = inner.ledger().enter(key, session.id);
            match entered {
                Enter::Nested(grant) => {
                    let session = inner.session_by_id(grant.session).unwrap_or(session);
                    return Ok(LockGuard::new(inner.clone(), session, grant));
                }
                Enter::Busy => {
                    tokio::select! {
                        _ = notified => continue,
                        _ = tokio::time::sleep_until(give_up) => {
                            return Err(Error::Contended { reason: "acquiring_here".into() })
                        }
                    }
                }
                Enter::Acquire => {
                    let wait = give_up.saturating_duration_since(Instant::now());
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let task = crate::acquire::Acquire {
                        inner: inner.clone(),
                        session,
                        key: key.to_owned(),
                        wait,
                        class: opts.class.clone(),
                        shape: opts.shape(),
                        timeout: opts.timeout.unwrap_or(wait + inner.config.acquire_slack),
                        campaign: campaign.map(|v| v.map(str::to_owned)),
                    };
                    inner.runtime.spawn(task.run(tx));
                    let r = rx.await.unwrap_or(Err(Error::OutcomeUnknown));
                    // The class TTL changed since this key's TTL was learnt: learn it
                    // again (one new session open) and acquire once more (a campaign
                    // is told, and pins a session of the new TTL).
                    if !relearnt
                        && matches!(&r, Err(Error::Refused { code, .. }) if *code == Code::SessionClassMismatch)
                    {
                        relearnt = true;
                        inner.forget_ttl(key, opts.class.as_deref());
                        if pinned.is_none() {
                            continue;
                        }
                    }
                    return r;
                }
            }
        }
    }

    /// The live session for `key`'s TTL, opening one if needed (a campaign pins it).
    pub(crate) async fn session_for(&self, key: &str, class: Option<&str>) -> Result<Arc<Session>, Error> {
        self.inner.session_for(key, class).await
    }

    /// The shared state (`crate::election`).
    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// The per-process instance id this client sends as `x-lock-instance`.
    pub fn instance(&self) -> &str {
        self.inner.api.instance()
    }

    /// Keys this process holds, with their re-entrancy counts.
    pub fn held(&self) -> Vec<(String, u32)> {
        self.inner.ledger().held()
    }

    /// Whether no key is held, being acquired or being released.
    pub fn is_idle(&self) -> bool {
        self.inner.ledger().is_empty()
    }

    /// The live sessions.
    pub fn sessions(&self) -> Vec<SessionStatus> {
        let mut v: Vec<_> = self.inner.sessions().values().map(|s| s.public_status()).collect();
        v.sort_by_key(|s| s.ttl_s);
        v
    }

    /// Requests sent so far.
    pub fn stats(&self) -> Stats {
        let c = &self.inner.counters;
        let get = |i: usize| c[i].load(Ordering::Relaxed);
        Stats { sessions_opened: get(0), acquires: get(1), releases: get(2), hold_listings: get(3) }
    }

    /// Closes every session (each releases all its holds in one committed
    /// entry). Guards still alive report [`LossReason::Closed`]; the fence callback
    /// is not called. Failures are ignored: an unclosed session expires with its TTL.
    pub async fn shutdown(&self) {
        let sessions: Vec<_> = self.inner.sessions().drain().map(|(_, s)| s).collect();
        for s in sessions {
            s.stop_keepalive();
            if s.mark_lost(LossReason::Closed) {
                self.inner.ledger().forget_session(s.id);
                let _ = self.inner.api.close(s.id, self.inner.config.request_timeout).await;
            }
        }
        self.inner.changed.notify_waiters();
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("endpoint", &self.inner.config.endpoint).finish_non_exhaustive()
    }
}

// === impl Inner ===

impl Inner {
    pub(crate) fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn count(&self, i: usize) {
        self.counters[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The live session for the TTL of `key` (or of the class the caller named, if
    /// its TTL is known).
    fn live_session_for_key(&self, key: &str, class: Option<&str>) -> Option<Arc<Session>> {
        let by_key = self.key_ttl.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(key).copied();
        let by_class = || {
            let classes = self.class_ttl.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            class.and_then(|c| classes.get(c).copied())
        };
        let ttl = by_key.or_else(by_class)?;
        self.sessions().get(&ttl).filter(|s| s.lost().is_none()).cloned()
    }

    /// The live session for `key`'s TTL, opening one if needed (one per TTL: the
    /// service attaches a key only to a session with its class's TTL). The first
    /// use of a key discovers its TTL by opening a session for it (the registry
    /// decides the class), unless `class` names a class whose TTL is known.
    async fn session_for(self: &Arc<Self>, key: &str, class: Option<&str>) -> Result<Arc<Session>, Error> {
        if let Some(s) = self.live_session_for_key(key, class) {
            return Ok(s);
        }
        let _opening = self.opening.lock().await;
        if let Some(s) = self.live_session_for_key(key, class) {
            return Ok(s);
        }
        let sent = Instant::now();
        self.count(0);
        let opened = self.api.open_session(key, self.config.request_timeout).await.map_err(|e| e.into_error())?;
        {
            let mut known = self.key_ttl.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if known.len() >= MAX_KNOWN_KEYS {
                known.clear();
            }
            known.insert(key.to_owned(), opened.ttl_s);
        }
        if !opened.class.is_empty() {
            let mut classes = self.class_ttl.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            classes.insert(opened.class.clone(), opened.ttl_s);
        }
        let existing = self.sessions().get(&opened.ttl_s).filter(|s| s.lost().is_none()).cloned();
        let margin = self.config.margin;
        let problem = if existing.is_some() {
            None
        } else if margin >= Duration::from_secs(opened.ttl_s) {
            Some(Error::Config {
                field: "margin",
                why: format!("{margin:?} is not below the session ttl {}s", opened.ttl_s),
            })
        } else {
            None
        };
        if existing.is_some() || problem.is_some() {
            // Not needed (another key of this TTL opened one first) or not usable.
            let (api, sid, t) = (self.api.clone(), opened.session, self.config.request_timeout);
            self.runtime.spawn(async move { api.close(sid, t).await });
        }
        if let Some(e) = problem {
            return Err(e);
        }
        if let Some(s) = existing {
            return Ok(s);
        }
        let session = Session::new(opened.session, opened.ttl_s, sent, margin);
        session.start_keepalive(Arc::downgrade(self), &self.runtime);
        self.sessions().insert(opened.ttl_s, session.clone());
        Ok(session)
    }

    pub(crate) fn session_by_id(&self, id: SessionId) -> Option<Arc<Session>> {
        self.sessions().values().find(|s| s.id == id).cloned()
    }

    /// The session and every hold on it are lost: forget them, run the fence
    /// callback once, and (unless the service already dropped it) close the
    /// session in the background so its holds end as soon as the service hears.
    pub(crate) fn fence(&self, session: &Arc<Session>, reason: LossReason) {
        let _telling = session.telling();
        if !session.mark_lost(reason) {
            return;
        }
        session.stop_keepalive();
        {
            let mut sessions = self.sessions();
            if sessions.get(&session.ttl_s).is_some_and(|s| s.id == session.id) {
                sessions.remove(&session.ttl_s);
            }
        }
        let lost = self.ledger().forget_session(session.id);
        self.changed.notify_waiters();
        tracing::warn!(reason = reason.as_str(), holds = lost.len(), ttl_s = session.ttl_s, "session fenced");
        let keys = lost.into_iter().map(|g| g.key).collect();
        (self.on_fence)(FenceEvent { session: session.id.to_string(), reason, keys });
        if reason != LossReason::SessionExpired {
            let (api, sid, t) = (self.api.clone(), session.id, self.config.request_timeout);
            self.runtime.spawn(async move { api.close(sid, t).await });
        }
    }

    /// `session` entered jeopardy (`state` [`HoldState::Jeopardy`]) or recovered
    /// ([`HoldState::Safe`]): logs it and runs the jeopardy callback, unless the
    /// session is lost by now (the fence callback told, or will tell, the rest).
    pub(crate) fn jeopardy(&self, session: &Arc<Session>, state: HoldState) {
        let _telling = session.telling();
        let status = session.status();
        if status.lost.is_some() {
            return;
        }
        let keys = self.ledger().keys_on(session.id);
        // No session id, key or token in logs (ADR-22).
        let remaining_ms = u64::try_from(status.remaining.as_millis()).unwrap_or(u64::MAX);
        tracing::info!(
            state = state.as_str(),
            holds = keys.len(),
            ttl_s = session.ttl_s,
            remaining_ms,
            "session jeopardy changed"
        );
        if let Some(f) = &self.on_jeopardy {
            f(JeopardyEvent { session: session.id.to_string(), state, remaining: status.remaining, keys });
        }
    }

    /// A grant or listing showed `epoch` of etcd cluster `cluster`: every session
    /// holding a grant *of that cluster* older than the epochs still honoured is
    /// lost (the service advanced that cluster's epoch; its older tokens are
    /// void). `honoured_from` is the lowest epoch the service said it still
    /// honours (a shard move's soft advance keeps earlier epochs' holds); without
    /// it, only `epoch`. Each cluster has its own epoch (`docs/SCALE.md`): a
    /// higher epoch on one shard says nothing about another's.
    pub(crate) fn observe_epoch(&self, cluster: Option<&str>, epoch: u64, honoured_from: Option<u64>) {
        {
            let mut seen = self.max_epoch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let key = cluster.map(str::to_owned);
            if seen.get(&key).is_some_and(|prev| epoch <= *prev) {
                return;
            }
            if seen.len() >= MAX_CLUSTERS && !seen.contains_key(&key) {
                seen.clear();
            }
            seen.insert(key, epoch);
        }
        let honoured_from = honoured_from.filter(|_| !crate::planted::ignore_honoured_from());
        let stale = self.ledger().sessions_below_epoch(cluster, crate::ledger::fence_floor(epoch, honoured_from));
        for sid in stale {
            if let Some(s) = self.session_by_id(sid) {
                self.fence(&s, LossReason::EpochChanged);
            }
        }
    }

    /// Forgets the TTL learnt for `key` (and for `class`, if named): the service
    /// answered `session_class_mismatch`, so the class's TTL changed (a registry
    /// reload). The next acquire opens a session for the key again, which reports
    /// the new TTL; sessions of the old TTL keep renewing their holds until they end.
    pub(crate) fn forget_ttl(&self, key: &str, class: Option<&str>) {
        self.key_ttl.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(key);
        if let Some(c) = class {
            self.class_ttl.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(c);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Sessions are not closed here (no runtime to await on): they expire with
        // their TTL, and so do their holds. `Client::shutdown` closes them.
        for s in self.sessions().values() {
            s.stop_keepalive();
        }
    }
}

/// This process's instance id (`x-lock-instance`): the pid and 64 random bits,
/// chosen once per process.
pub fn instance_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| format!("p{}-{:016x}", std::process::id(), rand::random::<u64>()))
}
