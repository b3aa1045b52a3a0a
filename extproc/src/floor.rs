//! BENCHMARK ONLY: the mesh floor (issue 20, docs/DECISIONS.md ADR-28). Compiled
//! in only with the cargo feature `bench-floor`, which no crate of the workspace turns on
//! (`tests/tests/layout.rs` checks it); `scripts/bench floor` builds it into a
//! target directory of its own (`target/floor`), never the shipped binary.
//!
//! With it, an acquire is granted and a release answered **without etcd**: no
//! transaction, no session, no wait. Everything else a lock request costs stays
//! as shipped: Envoy (TLS, HTTP/2, the Wasm filter, ext_proc and its gRPC stream),
//! the arbiter's stream handling, header parsing, identity, registry lookups,
//! metrics, spans and the JSON answer. What a lock cycle costs above this floor is
//! what the lock logic and etcd cost; what this floor costs is what any design
//! that answers locks from an ext_proc service behind Envoy pays.
//!
//! One thing the floor keeps of a lock: a key has one holder at a time, in
//! arrival order, held in memory (a fair semaphore per key) from the grant to its
//! release, so a hot key's hand-offs are serialised as they are through etcd and
//! its floor is comparable with one (issue 20's hot-key row).
//!
//! Such a build grants every acquire: it must never serve. It refuses to start
//! unless the environment sets [`ENV`] to `1`, and says at start what it is.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Arc, LazyLock, Mutex,
    },
};

use lockmesh_core::{headers::SessionId, FencingToken, LockKey};
use lockmesh_lock::{mutex::Grant, LockError};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// The environment variable that must be `1` for a floor build to start.
pub const ENV: &str = "LOCKMESH_BENCH_FLOOR";

/// The last revision handed out (tokens still increase, as the load tool checks).
static REVISION: AtomicU64 = AtomicU64::new(1);
/// The last session id handed out to an acquire that named none.
static SESSION: AtomicI64 = AtomicI64::new(1 << 40);

/// Whether this process may run: the environment opted in.
pub fn allowed() -> bool {
    std::env::var(ENV).as_deref() == Ok("1")
}

/// A grant made without etcd: epoch 1, the next revision, the named session (or
/// a new id, as if the acquire had opened one).
pub(crate) fn grant(session: Option<SessionId>, class: &str, ttl_s: u64) -> Result<Grant, LockError> {
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
pub(crate) fn unhold(key: &LockKey) {
    let slot = key_slot(key);
    if slot.available_permits() == 0 {
        slot.add_permits(1);
    }
}
