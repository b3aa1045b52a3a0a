//! BENCHMARK ONLY: the mesh floor (issue 20, docs/DECISIONS.md ADR-28). Compiled
//! in only with the cargo feature `bench-floor`, which no crate of the workspace turns on
//! (`tests/tests/layout.rs` checks it); `scripts/bench` (its `floor`, `shipped` and
//! `etcdfloor` sections) builds it into a target directory of its own
//! (`target/floor`), never the shipped binary.
//!
//! Two levels, chosen by [`ENV`]:
//!
//! - `1`, the **mesh floor**: an acquire is granted and a release answered
//!   **without etcd**: no transaction, no session, no wait. Everything else a lock
//!   request costs stays as shipped: Envoy (TLS, HTTP/2, the Wasm filter, ext_proc
//!   and its gRPC stream), the arbiter's stream handling, header parsing,
//!   identity, registry lookups, metrics, spans and the JSON answer. What a lock
//!   cycle costs above this floor is what the lock logic and etcd cost; what this
//!   floor costs is what any design that answers locks from an ext_proc service
//!   behind Envoy pays.
//! - `etcd`, the **etcd floor**: the mesh floor plus the etcd requests of
//!   lockmesh's cycle, made by the arbiter's own etcd client: the grant
//!   transaction (the epoch, slot-range, above-the-limit, session-lease and
//!   grant-clock compares; the hold record on the session's lease and the grant
//!   clock put), the grant-time raft check where etcd answers it
//!   (`Epoch::raft_at_mark`), and the release transaction (the hold's create
//!   revision compared; the hold and the lock-delay guard deleted, the release
//!   marker put on a lease). A release with a waiter queued here hands the key
//!   over in that one transaction, as lockmesh's hand-off does (the waiter's hold
//!   put under the slot's other name, its session's lease compared), then the
//!   raft check; a release of a key it handed over last, finding no waiter, waits
//!   up to the shipped hand-off grace for one, as lockmesh's does. Left out is the
//!   lock logic around those requests: no session cache, policy gate, durable
//!   queue, quota ledger or seal bookkeeping, and no recovery beyond freeing the
//!   key. What a cycle costs above
//!   this floor is that logic; a goal this floor misses cannot be met by any
//!   change to it. The acquire must name its session (`x-lock-session`, opened
//!   as shipped).
//!
//! Both levels keep a key's holders one at a time, in arrival order, in memory
//! (the mesh floor with a fair semaphore per key, the etcd floor with a queue per
//! key), so a hot key's hand-offs are serialised as they are through etcd and
//! each floor is comparable with lockmesh's hot key (issue 20's hot-key row).
//!
//! Such a build grants every acquire: it must never serve. It refuses to start
//! unless the environment sets [`ENV`] to `1` or `etcd`, and says at start what it
//! is.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Arc, LazyLock, Mutex,
    },
};

use etcd_client::{Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};
use lockmesh_core::{headers::SessionId, FencingToken, LockKey};
use lockmesh_keyspace::CloseMarker;
use lockmesh_lock::{
    keys::prefix_end,
    mutex::{AcquireRequest, Grant},
    LockError, SessionRecord, Store,
};
use tokio::sync::{oneshot, Notify, OnceCell, Semaphore};
use tokio_util::sync::CancellationToken;

/// The environment variable that must be `1` (the mesh floor) or `etcd` (the etcd
/// floor) for a floor build to start.
pub const ENV: &str = "LOCKMESH_BENCH_FLOOR";

/// How much of a lock cycle a floor build does (the value of [`ENV`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// `1`: nothing of etcd.
    Mesh,
    /// `etcd`: the etcd requests of an uncontended cycle, no lock logic around them.
    Etcd,
}

/// The level the environment chose; `None` when it chose none (no start).
pub fn level() -> Option<Level> {
    match std::env::var(ENV).as_deref() {
        Ok("1") => Some(Level::Mesh),
        Ok("etcd") => Some(Level::Etcd),
        _ => None,
    }
}

static LEVEL: LazyLock<Option<Level>> = LazyLock::new(level);

/// The etcd floor's release-marker lease (granted at its first release; it
/// outlives any benchmark run and is never renewed).
static MARKER_LEASE: OnceCell<i64> = OnceCell::const_new();
const MARKER_TTL_S: i64 = 3600;

/// The last revision handed out (tokens still increase, as the load tool checks).
static REVISION: AtomicU64 = AtomicU64::new(1);
/// The last session id handed out to an acquire that named none.
static SESSION: AtomicI64 = AtomicI64::new(1 << 40);

/// Whether this process may run: the environment opted in.
pub fn allowed() -> bool {
    level().is_some()
}

/// The acquire of a floor build: at the mesh level the key taken here and a
/// grant made without etcd, at the etcd level with the etcd requests of
/// lockmesh's cycle ([`etcd_acquire`]).
pub(crate) async fn acquire(
    store: &Store,
    req: &AcquireRequest,
    cancel: &CancellationToken,
) -> Result<Grant, LockError> {
    match *LEVEL {
        Some(Level::Etcd) => etcd_acquire(store, req, cancel).await,
        _ => {
            hold(&req.key, cancel).await?;
            mesh_grant(req.session, &req.class.name.to_string(), req.class.ttl_s)
        }
    }
}

/// The release of a floor build: at the mesh level the key given back here, at
/// the etcd level the release (or hand-off) transaction ([`etcd_release`]).
/// `session` is the session the release names.
pub(crate) async fn release(
    store: &Store,
    key: &LockKey,
    token: FencingToken,
    session: Option<SessionId>,
) -> Result<(), LockError> {
    match *LEVEL {
        Some(Level::Etcd) => etcd_release(store, key, token, session).await,
        _ => {
            unhold(key);
            Ok(())
        }
    }
}

/// The etcd floor's acquire: the key taken here in arrival order; the first
/// holder of a free key makes the grant transaction itself, a waiter is handed
/// the key by the release before it in that release's transaction (as
/// lockmesh's one-transaction hand-off), or told to make its own grant when the
/// release before it handed nothing over.
async fn etcd_acquire(store: &Store, req: &AcquireRequest, cancel: &CancellationToken) -> Result<Grant, LockError> {
    let ep = store.epoch_state().await?;
    let waiter = match req.session {
        Some(sid) => Waiter::new(req, sid, ep.epoch, None)?,
        None => {
            // The header-only path: a session (lease) of this acquire's own,
            // its record put by the grant, ended by the release.
            let ttl = i64::try_from(req.class.ttl_s).map_err(internal)?;
            let lease = store.call(store.client().lease_grant(ttl, None)).await?.id();
            let sid = SessionId::from_lease(lease).ok_or_else(|| internal("lease id out of range"))?;
            let record = SessionRecord {
                owner: req.caller.identity.clone(),
                instance: req.caller.instance.clone(),
                class: req.class.name.to_string(),
                ttl_s: req.class.ttl_s,
                created_ms: lockmesh_lock::now_ms(),
                ns: Some(req.key.namespace().to_owned()),
                by_acquire: true,
            };
            lock(&OPENED).insert(sid.lease());
            Waiter::new(req, sid, ep.epoch, Some(serde_json::to_vec(&record).map_err(internal)?))?
        }
    };
    let state = key_state(&req.key);
    let rx = {
        let mut st = lock(&state);
        if st.holder.is_none() {
            st.holder = Some(store.keys().slot(&req.key.digest(), 0));
            None
        } else {
            let (tx, rx) = oneshot::channel();
            st.waiters.push_back((waiter.clone(), tx));
            st.arrived.notify_one();
            Some(rx)
        }
    };
    if let Some(mut rx) = rx {
        let turn = tokio::select! {
            t = &mut rx => t.map_err(|_| LockError::Internal("the etcd floor dropped a waiter".into()))?,
            () = cancel.cancelled() => {
                rx.close();
                match rx.try_recv() {
                    // Handed over as the wait ended: give it back.
                    Ok(Turn::Granted(g)) => drop(etcd_release(store, &req.key, g.token, Some(g.session)).await),
                    Ok(Turn::Yours) => pass_on(store, &req.key),
                    Ok(Turn::Failed(_)) | Err(_) => {}
                }
                return Err(LockError::Cancelled);
            }
        };
        match turn {
            Turn::Granted(g) => return Ok(g),
            Turn::Failed(e) => return Err(e),
            Turn::Yours => {}
        }
    }
    let name = lock(&state).holder.clone().unwrap_or_default();
    match etcd_grant(store, &waiter, &name).await {
        Ok(g) => Ok(g),
        Err(e) => {
            pass_on(store, &req.key);
            Err(e)
        }
    }
}

/// What a waiter is told when its turn comes.
enum Turn {
    /// The release before it handed it the key: its grant.
    Granted(Grant),
    /// The key is free and its own: make the grant transaction.
    Yours,
    /// The hand-over to it failed.
    Failed(LockError),
}

/// What a grant to one acquire writes.
#[derive(Clone)]
struct Waiter {
    sid: SessionId,
    key: LockKey,
    hold: Vec<u8>,
    /// The session record of a session this acquire opened (put with the hold).
    record: Option<Vec<u8>>,
    class: String,
    ttl_s: u64,
}

impl Waiter {
    fn new(req: &AcquireRequest, sid: SessionId, epoch: u64, record: Option<Vec<u8>>) -> Result<Self, LockError> {
        Ok(Self {
            sid,
            key: req.key.clone(),
            hold: lockmesh_lock::mutex::hold_record(req, epoch, 1, None, None)?,
            record,
            class: req.class.name.to_string(),
            ttl_s: req.class.ttl_s,
        })
    }

    fn grant(&self, epoch: u64, revision: i64) -> Result<Grant, LockError> {
        let token = FencingToken::mint(epoch, u64::try_from(revision).map_err(internal)?).map_err(internal)?;
        Ok(Grant {
            token,
            session: self.sid,
            ttl_s: self.ttl_s,
            class: self.class.clone(),
            existing: false,
            new_session: self.record.is_some(),
            permits: 1,
            mode: None,
        })
    }

    /// The compare and puts of its session: alive on its lease, or (opened by
    /// this acquire) its record put with the hold.
    fn session_ops(&self, k: &lockmesh_lock::Keys) -> (Compare, Vec<TxnOp>) {
        let sess = k.session(self.sid);
        match &self.record {
            Some(r) => (
                Compare::create_revision(sess.as_str(), CompareOp::Equal, 0),
                vec![TxnOp::put(sess.as_str(), r.clone(), Some(PutOptions::new().with_lease(self.sid.lease())))],
            ),
            None => (Compare::lease(sess.as_str(), CompareOp::Equal, self.sid.lease()), Vec::new()),
        }
    }
}

/// Sessions the etcd floor opened for an acquire (ended by their release).
static OPENED: LazyLock<Mutex<std::collections::HashSet<i64>>> = LazyLock::new(Mutex::default);

fn internal(e: impl std::fmt::Display) -> LockError {
    LockError::Internal(e.to_string())
}

/// One key of the etcd floor: the hold key its holder has (or is being granted
/// under), its waiters in arrival order, whether its last release handed it over
/// (a chain), and a wake-up for a release waiting for a waiter to arrive.
#[derive(Default)]
struct KeyState {
    holder: Option<String>,
    waiters: VecDeque<(Waiter, oneshot::Sender<Turn>)>,
    chained: bool,
    arrived: Arc<Notify>,
}

impl KeyState {
    /// The first waiter still waiting.
    fn next_live(&mut self) -> Option<(Waiter, oneshot::Sender<Turn>)> {
        loop {
            match self.waiters.pop_front() {
                Some((_, tx)) if tx.is_closed() => continue,
                other => return other,
            }
        }
    }
}

/// The next live waiter of a chained key, waiting for one to arrive up to the
/// shipped hand-off grace (`handoff_grace_ms`, as `lockmesh_lock::wait` does:
/// on a hot key the next head is on its way through the mesh).
async fn next_within_grace(
    state: &Mutex<KeyState>,
    grace: std::time::Duration,
) -> Option<(Waiter, oneshot::Sender<Turn>)> {
    let arrived = {
        let mut st = lock(state);
        if let Some(n) = st.next_live() {
            return Some(n);
        }
        if grace.is_zero() || !st.chained {
            return None;
        }
        st.arrived.clone()
    };
    let until = tokio::time::Instant::now() + grace;
    loop {
        let woke = tokio::time::timeout_at(until, arrived.notified()).await.is_ok();
        let next = lock(state).next_live();
        if next.is_some() || !woke {
            return next;
        }
    }
}

static ETCD_KEYS: LazyLock<Mutex<HashMap<String, Arc<Mutex<KeyState>>>>> = LazyLock::new(Mutex::default);

fn key_state(key: &LockKey) -> Arc<Mutex<KeyState>> {
    lock(&ETCD_KEYS).entry(key.as_str().to_owned()).or_default().clone()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The key is free here again: its next live waiter is told to make its own
/// grant, or the key has no holder.
fn pass_on(store: &Store, key: &LockKey) {
    let state = key_state(key);
    let mut st = lock(&state);
    while let Some((_, tx)) = st.waiters.pop_front() {
        if tx.send(Turn::Yours).is_ok() {
            st.holder = Some(store.keys().slot(&key.digest(), 0));
            return;
        }
    }
    st.holder = None;
}

/// The grant transaction of an acquire (slot 0 of a mutex, under `name`), then
/// the grant-time raft check; the token is the commit's revision in the
/// current epoch.
async fn etcd_grant(store: &Store, w: &Waiter, name: &str) -> Result<Grant, LockError> {
    let ep = store.epoch_state().await?;
    let (k, d) = (store.keys(), w.key.digest());
    let (holds, sess) = (k.holds(&d), k.session(w.sid));
    let (alive, mut then) = w.session_ops(k);
    // A session opened for this acquire is put on either branch, as lockmesh's is.
    let mut els = then.clone();
    then.push(TxnOp::put(name, w.hold.clone(), Some(PutOptions::new().with_lease(w.sid.lease()))));
    then.push(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
    els.extend([
        TxnOp::get(holds.as_str(), Some(GetOptions::new().with_prefix())),
        TxnOp::get(sess.as_str(), None),
        TxnOp::get(k.epoch(), None),
        TxnOp::get(k.clock(), None),
    ]);
    let when = [
        Compare::mod_revision(k.epoch(), CompareOp::Equal, ep.mod_revision),
        Compare::create_revision(k.slot(&d, 0), CompareOp::Equal, 0).with_range(k.slot(&d, 1)),
        Compare::create_revision(k.slot(&d, 1), CompareOp::Equal, 0).with_range(prefix_end(&holds)),
        alive,
        Compare::mod_revision(k.clock(), CompareOp::Greater, -1),
    ];
    let txn = Txn::new().when(when).and_then(then).or_else(els);
    let r = store.call(store.client().txn(txn)).await?;
    if !r.succeeded() {
        return Err(internal("the etcd floor's grant transaction failed its compares"));
    }
    store.raft_at_mark().await?;
    w.grant(ep.epoch, r.header().map_or(0, |h| h.revision()))
}

/// The etcd floor's release of `token` on `key`: handed to the key's next live
/// waiter in one transaction (the hold deleted, the waiter's put under the
/// slot's other name, the release marker and the grant clock put), then the
/// raft check; with no waiter, the release transaction alone. A session the
/// acquire opened (`session`) ends with it: its close marker put in the same
/// transaction (while the session is alive), its lease revoked after the answer.
async fn etcd_release(
    store: &Store,
    key: &LockKey,
    token: FencingToken,
    session: Option<SessionId>,
) -> Result<(), LockError> {
    let marker = *MARKER_LEASE
        .get_or_try_init(|| async { store.call(store.client().lease_grant(MARKER_TTL_S, None)).await.map(|l| l.id()) })
        .await?;
    let ends = session.filter(|s| lock(&OPENED).remove(&s.lease()));
    let r = release_or_hand_off(store, key, token, marker, ends).await;
    if let Some(sid) = ends {
        let client = store.client();
        tokio::spawn(async move {
            let _ = client.clone().lease_revoke(sid.lease()).await;
        });
    }
    r
}

/// [`etcd_release`]'s transactions; `ends`: the releaser's session ends here.
async fn release_or_hand_off(
    store: &Store,
    key: &LockKey,
    token: FencingToken,
    marker: i64,
    mut ends: Option<SessionId>,
) -> Result<(), LockError> {
    let state = key_state(key);
    let (k, d) = (store.keys(), key.digest());
    let mut revision = i64::try_from(token.revision()).map_err(internal)?;
    let Some(mut name) = lock(&state).holder.clone() else {
        return Err(LockError::NotHolder);
    };
    loop {
        let next = next_within_grace(&state, store.runtime().handoff().grace).await;
        let mut held = vec![Compare::create_revision(name.as_str(), CompareOp::Equal, revision)];
        let mut released = vec![
            TxnOp::delete(name.as_str(), None::<DeleteOptions>),
            TxnOp::put(k.release_marker(&d), "released", Some(PutOptions::new().with_lease(marker))),
            TxnOp::delete(k.delay_guard(&d), None::<DeleteOptions>),
        ];
        if let Some(sid) = ends {
            let close = serde_json::to_string(&CloseMarker { closed_ms: lockmesh_lock::now_ms() }).map_err(internal)?;
            held.push(Compare::lease(k.session(sid), CompareOp::Equal, sid.lease()));
            released.push(TxnOp::put(k.close_marker(sid), close, Some(PutOptions::new().with_lease(marker))));
        }
        let Some((w, tx)) = next else {
            let r = store.call(store.client().txn(Txn::new().when(held).and_then(released))).await;
            lock(&state).chained = false;
            pass_on(store, key);
            return match r? {
                r if r.succeeded() => Ok(()),
                _ => Err(LockError::NotHolder),
            };
        };
        let ep = store.epoch_state().await?;
        let other = String::from_utf8(lockmesh_lock::Keys::other_name(name.as_bytes())).map_err(internal)?;
        let (alive, mut then) = w.session_ops(k);
        then.extend(released);
        then.push(TxnOp::put(other.as_str(), w.hold.clone(), Some(PutOptions::new().with_lease(w.sid.lease()))));
        then.push(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
        held.extend([
            Compare::mod_revision(k.epoch(), CompareOp::Equal, ep.mod_revision),
            alive,
            Compare::create_revision(other.as_str(), CompareOp::Equal, 0),
            Compare::create_revision(k.slot(&d, 1), CompareOp::Equal, 0).with_range(prefix_end(&k.holds(&d))),
            Compare::mod_revision(k.clock(), CompareOp::Greater, -1),
        ]);
        let txn = Txn::new().when(held).and_then(then);
        let r = match store.call(store.client().txn(txn)).await {
            Ok(r) => r,
            Err(e) => {
                // Unknown outcome: the waiter fails, the key is freed for the next.
                let _ = tx.send(Turn::Failed(e.clone()));
                pass_on(store, key);
                return Err(e);
            }
        };
        if !r.succeeded() {
            let _ = tx.send(Turn::Failed(internal("the etcd floor's hand-off failed its compares")));
            pass_on(store, key);
            return Err(LockError::NotHolder);
        }
        let new_revision = r.header().map_or(0, |h| h.revision());
        {
            let mut st = lock(&state);
            st.holder = Some(other.clone());
            st.chained = true;
        }
        let turn = match store.raft_at_mark().await {
            Ok(()) => w.grant(ep.epoch, new_revision).map_or_else(Turn::Failed, Turn::Granted),
            Err(e) => Turn::Failed(e),
        };
        let failed = matches!(turn, Turn::Failed(_));
        if tx.send(turn).is_ok() && !failed {
            return Ok(());
        }
        // The waiter is gone (or its grant failed after the commit): its hold is
        // released in turn (its session, if its acquire opened one, expires).
        (name, revision, ends) = (other, new_revision, None);
    }
}

/// A grant made without etcd: epoch 1, the next revision, the named session (or
/// a new id, as if the acquire had opened one).
fn mesh_grant(session: Option<SessionId>, class: &str, ttl_s: u64) -> Result<Grant, LockError> {
    let revision = REVISION.fetch_add(1, Ordering::Relaxed) + 1;
    let token = FencingToken::mint(1, revision).map_err(|e| LockError::Internal(e.to_string()))?;
    let (session, new_session) = match session {
        Some(s) => (s, false),
        None => {
            let id = SESSION.fetch_add(1, Ordering::Relaxed) + 1;
            (SessionId::from_lease(id).ok_or_else(|| LockError::Internal("session id overflow".into()))?, true)
        }
    };
    Ok(Grant { token, session, ttl_s, class: class.to_owned(), existing: false, new_session, permits: 1 })
}

/// The mesh floor's keys: one fair semaphore of one permit per key that was
/// ever acquired here.
static KEYS: LazyLock<Mutex<HashMap<String, Arc<Semaphore>>>> = LazyLock::new(Mutex::default);

fn key_slot(key: &LockKey) -> Arc<Semaphore> {
    lock(&KEYS).entry(key.as_str().to_owned()).or_insert_with(|| Arc::new(Semaphore::new(1))).clone()
}

/// Waits (in arrival order) until `key` has no holder here, and takes it.
async fn hold(key: &LockKey, cancel: &CancellationToken) -> Result<(), LockError> {
    let slot = key_slot(key);
    tokio::select! {
        permit = slot.acquire_owned() => {
            permit.map_err(|e| LockError::Internal(e.to_string()))?.forget();
            Ok(())
        }
        () = cancel.cancelled() => Err(LockError::Cancelled),
    }
}

/// Gives `key` back (to its next waiter). A release of a key not held here
/// changes nothing.
fn unhold(key: &LockKey) {
    let slot = key_slot(key);
    if slot.available_permits() == 0 {
        slot.add_permits(1);
    }
}
