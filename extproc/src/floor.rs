//! BENCHMARK ONLY: the mesh floor (issue 20, docs/DECISIONS.md ADR-28). Compiled
//! in only with the cargo feature `bench-floor`, which no crate of the workspace turns on
//! (`tests/tests/layout.rs` checks it); `scripts/bench floor` builds it into a
//! target directory of its own (`target/floor`), never the shipped binary.
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
//! - `etcd`, the **etcd floor**: the mesh floor plus the etcd requests of an
//!   uncontended lockmesh cycle, made by the arbiter's own etcd client: the grant
//!   transaction (the epoch, slot-range, above-the-limit, session-lease and
//!   grant-clock compares; the hold record on the session's lease and the grant
//!   clock put), the grant-time raft check where etcd answers it
//!   (`Store::raft_at_mark`), and the release transaction (the hold's create
//!   revision compared; the hold and the lock-delay guard deleted, the release
//!   marker put on a lease). Left out is the lock logic around them: no session
//!   cache, no policy gate, queue, hand-off offer, quota ledger or seal
//!   bookkeeping. What a cycle costs above this floor is that logic; a goal this
//!   floor misses cannot be met by any change to it. The acquire must name its
//!   session (`x-lock-session`, opened as shipped); a hot key's hand-over here is
//!   a release and a grant in series, not lockmesh's one-transaction hand-off, so
//!   only uncontended cycles are a floor.
//!
//! One thing both levels keep of a lock: a key has one holder at a time, in
//! arrival order, held in memory (a fair semaphore per key) from the grant to its
//! release, so a hot key's hand-offs are serialised as they are through etcd and
//! the mesh floor is comparable with one (issue 20's hot-key row).
//!
//! Such a build grants every acquire: it must never serve. It refuses to start
//! unless the environment sets [`ENV`] to `1` or `etcd`, and says at start what it
//! is.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Arc, LazyLock, Mutex,
    },
};

use etcd_client::{Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};
use lockmesh_core::{headers::SessionId, FencingToken, LockKey};
use lockmesh_lock::{
    keys::prefix_end,
    mutex::{AcquireRequest, Grant},
    HoldRecord, LockError, Store,
};
use tokio::sync::{OnceCell, Semaphore};
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

/// The grant of a floor build, once [`hold`] took the key here: at the mesh
/// level without etcd, at the etcd level with the grant's etcd requests.
pub(crate) async fn grant(store: &Store, req: &AcquireRequest) -> Result<Grant, LockError> {
    match *LEVEL {
        Some(Level::Etcd) => etcd_grant(store, req).await,
        _ => mesh_grant(req.session, &req.class.name.to_string(), req.class.ttl_s),
    }
}

/// The release of a floor build: at the etcd level the release transaction
/// first; then the key is given back here ([`unhold`]).
pub(crate) async fn release(store: &Store, key: &LockKey, token: FencingToken) -> Result<(), LockError> {
    let r = match *LEVEL {
        Some(Level::Etcd) => etcd_release(store, key, token).await,
        _ => Ok(()),
    };
    unhold(key);
    r
}

/// The grant transaction of an uncontended acquire in the caller's session
/// (slot 0 of a mutex), then the grant-time raft check; the token is the
/// commit's revision in the current epoch.
async fn etcd_grant(store: &Store, req: &AcquireRequest) -> Result<Grant, LockError> {
    let sid = req
        .session
        .ok_or_else(|| LockError::Internal("the etcd floor needs the acquire to name its session".into()))?;
    let ep = store.epoch_state().await?;
    let (k, d) = (store.keys(), req.key.digest());
    let (slot, holds, sess) = (k.slot(&d, 0), k.holds(&d), k.session(sid));
    let on_lease = PutOptions::new().with_lease(sid.lease());
    let hold = HoldRecord {
        key: req.key.as_str().to_owned(),
        owner: req.caller.identity.clone(),
        instance: req.caller.instance.clone(),
        epoch: ep.epoch,
        class: req.class.name.to_string(),
        acquired_ms: lockmesh_lock::now_ms(),
        hold_id: None,
        unverified_caller: None,
        permits: None,
        mode: req.mode,
        keys: None,
    };
    let hold = serde_json::to_vec(&hold).map_err(|e| LockError::Internal(e.to_string()))?;
    let txn = Txn::new()
        .when([
            Compare::mod_revision(k.epoch(), CompareOp::Equal, ep.mod_revision),
            Compare::create_revision(slot.as_str(), CompareOp::Equal, 0).with_range(k.slot(&d, 1)),
            Compare::create_revision(k.slot(&d, 1), CompareOp::Equal, 0).with_range(prefix_end(&holds)),
            Compare::lease(sess.as_str(), CompareOp::Equal, sid.lease()),
            Compare::mod_revision(k.clock(), CompareOp::Greater, -1),
        ])
        .and_then([TxnOp::put(slot.as_str(), hold, Some(on_lease)), TxnOp::put(k.clock(), Vec::<u8>::new(), None)])
        .or_else([
            TxnOp::get(holds.as_str(), Some(GetOptions::new().with_prefix())),
            TxnOp::get(sess.as_str(), None),
            TxnOp::get(k.epoch(), None),
            TxnOp::get(k.clock(), None),
        ]);
    let r = store.call(store.client().txn(txn)).await?;
    let revision = r.header().map(|h| h.revision()).unwrap_or(0);
    if !r.succeeded() {
        unhold(&req.key);
        return Err(LockError::Internal("the etcd floor's grant transaction failed its compares".into()));
    }
    if let Err(e) = store.raft_at_mark().await {
        unhold(&req.key);
        return Err(e);
    }
    let revision = u64::try_from(revision).map_err(|e| LockError::Internal(e.to_string()))?;
    let token = FencingToken::mint(ep.epoch, revision).map_err(|e| LockError::Internal(e.to_string()))?;
    Ok(Grant {
        token,
        session: sid,
        ttl_s: req.class.ttl_s,
        class: req.class.name.to_string(),
        existing: false,
        new_session: false,
        permits: 1,
    })
}

/// The release transaction of a grant of [`etcd_grant`].
async fn etcd_release(store: &Store, key: &LockKey, token: FencingToken) -> Result<(), LockError> {
    let lease = *MARKER_LEASE
        .get_or_try_init(|| async { store.call(store.client().lease_grant(MARKER_TTL_S, None)).await.map(|l| l.id()) })
        .await?;
    let (k, d) = (store.keys(), key.digest());
    let slot = k.slot(&d, 0);
    let revision = i64::try_from(token.revision()).map_err(|e| LockError::Internal(e.to_string()))?;
    let txn = Txn::new().when([Compare::create_revision(slot.as_str(), CompareOp::Equal, revision)]).and_then([
        TxnOp::delete(slot.as_str(), None::<DeleteOptions>),
        TxnOp::put(k.release_marker(&d), "released", Some(PutOptions::new().with_lease(lease))),
        TxnOp::delete(k.delay_guard(&d), None::<DeleteOptions>),
    ]);
    let r = store.call(store.client().txn(txn)).await?;
    if r.succeeded() {
        Ok(())
    } else {
        Err(LockError::NotHolder)
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

/// One fair semaphore of one permit per key that was ever acquired here.
static KEYS: LazyLock<Mutex<HashMap<String, Arc<Semaphore>>>> = LazyLock::new(Mutex::default);

fn key_slot(key: &LockKey) -> Arc<Semaphore> {
    let mut keys = KEYS.lock().unwrap_or_else(|p| p.into_inner());
    keys.entry(key.as_str().to_owned()).or_insert_with(|| Arc::new(Semaphore::new(1))).clone()
}

/// Waits (in arrival order) until `key` has no holder here, and takes it.
pub(crate) async fn hold(key: &LockKey, cancel: &CancellationToken) -> Result<(), LockError> {
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
