//! The authoritative class policies and prefix-to-class map in etcd, and the gate
//! every grant transaction passes (`docs/CLASSES.md`).
//!
//! ```text
//! <root>/sys/classmap      {"map":[[prefix,class]..],"default":class,...}   no lease
//! <root>/c/<class>         ClassPolicy {limit,state,change_epoch,...}        no lease
//! ```
//!
//! The YAML registry is desired state; these records are what grants obey. Each
//! grant transaction compares the mod revision of the class map and of its class's
//! policy record as this arbiter read them, so a grant commits only under the map
//! and limit that are authoritative at its commit: an arbiter with an older view
//! fails the compare, re-reads and retries, and two arbiters never apply different
//! classes or limits to one key. A draining policy admits nothing (`draining`). A
//! key whose class in this arbiter's registry is not its authoritative class is
//! refused (`unavailable`) rather than guessed.
//!
//! Missing records are created from the registry (compare-create, so concurrent
//! arbiters agree on the first writer's). Changes after that go through
//! `lockctl limit` ([`crate::reconcile`]).
//!
//! The gate also carries the key's home fence (`lock::home`): the grant compares
//! the granting cluster's home record, so a grant never commits on a cluster the
//! shard map has moved the key away from (or while it moves).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, OnceLock,
    },
};

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use lockmesh_core::{
    policy::{ChangeNote, ClassPolicy},
    ClassRegistry, LockKey,
};
use serde::Serialize;

use super::{mutex::AcquireRequest, now_ms, Cluster, LockError, Store};
use crate::engine::txn::{mod_revision, Answer, Branch, Read, TxnBuilder};
pub use lockmesh_keyspace::ClassMapRecord;

/// This arbiter's cached view of the records, with their mod revisions.
///
/// Grants never trust it: each compares the mod revisions it holds, and a
/// mismatch drops it (`policy_moved`). The one reader that acts on it without a
/// compare, a waiter that skips its read of a held key (`mutex`), does so only
/// while [`crate::policy_watch`] keeps it fresh: the watch drops the cache on
/// every change of a record, and a read that began before a drop is not cached
/// (the generation).
///
/// The records are kept behind `Arc`s: a grant reads both on every acquire, and
/// a clone of the map (every prefix and class name) or of a policy (its notes)
/// would allocate on that path (the `next_head` criterion bench, its `policy cache` cases).
#[derive(Default)]
pub struct PolicyCache {
    policies: Mutex<HashMap<String, (Arc<ClassPolicy>, i64)>>,
    map: Mutex<Option<(Arc<ClassMapRecord>, i64)>>,
    /// Bumped by every drop of the cache, under the `policies` lock.
    generation: AtomicU64,
    /// The policy watch is open: every change since the cache was filled dropped it.
    pub(crate) watched: AtomicBool,
    /// The policy watch's task was started.
    pub(crate) watch_started: OnceLock<()>,
}

impl PolicyCache {
    /// Bumped by every drop of the cache: a read that began at an older
    /// generation is not cached ([`PolicyCache::keep_map`], [`PolicyCache::keep_policy`]).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The cached class map and its mod revision.
    pub fn map(&self) -> Option<(Arc<ClassMapRecord>, i64)> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The cached policy of `class` and its mod revision.
    pub fn policy(&self, class: &str) -> Option<(Arc<ClassPolicy>, i64)> {
        self.policies.lock().unwrap_or_else(|p| p.into_inner()).get(class).cloned()
    }

    /// Caches the map read at `generation`, unless the cache was dropped since.
    pub fn keep_map(&self, map: Arc<ClassMapRecord>, revision: i64, generation: u64) {
        let mut cached = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if self.generation() == generation {
            *cached = Some((map, revision));
        }
    }

    /// Caches `class`'s policy read at `generation`, unless the cache was dropped since.
    pub fn keep_policy(&self, class: &str, policy: Arc<ClassPolicy>, revision: i64, generation: u64) {
        let mut policies = self.policies.lock().unwrap_or_else(|p| p.into_inner());
        if self.generation() == generation {
            policies.insert(class.to_owned(), (policy, revision));
        }
    }

    /// Drops every cached record.
    pub fn forget(&self) {
        {
            let mut policies = self.policies.lock().unwrap_or_else(|p| p.into_inner());
            self.generation.fetch_add(1, Ordering::SeqCst);
            policies.clear();
        }
        // After the generation moved: a map read that checked it before is dropped here.
        *self.map.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The authoritative limit of `class` for `key` as last read, without reading:
    /// `None` when nothing was cached; refused like a grant when the cached map
    /// gives the key another class or the cached policy is draining. No
    /// allocation unless it refuses.
    pub fn limit(&self, class: &str, key: &str) -> Result<Option<u32>, LockError> {
        if let Some((map, _)) = self.map.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let auth = map.class_of(key);
            if auth != class {
                return Err(LockError::Unavailable(format!(
                    "this arbiter's registry gives the key class {class}, the authoritative map gives {auth}: refusing \
                     rather than guessing"
                )));
            }
        }
        match self.policies.lock().unwrap_or_else(|p| p.into_inner()).get(class) {
            Some((p, _)) if !p.admits() => {
                Err(LockError::Draining(format!("class {class} is draining a limit change; new grants wait")))
            }
            Some((p, _)) => Ok(Some(p.limit.max(1))),
            None => Ok(None),
        }
    }
}

/// What one grant transaction adds: the limit, and the compares that pin it.
#[derive(Debug, Clone)]
pub struct PolicyGate {
    /// The authoritative limit of holders per key.
    pub limit: u32,
    /// The class the map gives the key.
    pub class: String,
    policy_key: String,
    policy_rev: i64,
    map_key: String,
    map_rev: i64,
    home: super::home::HomeGate,
}

// === impl PolicyGate ===

impl PolicyGate {
    /// The compares a grant transaction must add.
    pub fn compares(&self) -> Vec<Compare> {
        vec![
            Compare::mod_revision(self.policy_key.as_str(), CompareOp::Equal, self.policy_rev),
            Compare::mod_revision(self.map_key.as_str(), CompareOp::Equal, self.map_rev),
            self.home.compare(),
        ]
    }

    /// Adds the gate's compares and its failure-branch reads to a grant.
    pub(crate) fn add_to(&self, b: &mut TxnBuilder) -> GateReads {
        b.compares(self.compares());
        GateReads {
            policy: b.read(Branch::Failure, self.policy_key.as_str(), None),
            map: b.read(Branch::Failure, self.map_key.as_str(), None),
            home: self.home.add_read(b),
        }
    }

    /// A gate of the given records, for the transaction builders' tests.
    #[cfg(test)]
    pub(crate) fn for_test(limit: u32, policy: (&str, i64), map: (&str, i64), home: (&str, i64)) -> Self {
        Self {
            limit,
            class: "test".into(),
            policy_key: policy.0.into(),
            policy_rev: policy.1,
            map_key: map.0.into(),
            map_rev: map.1,
            home: super::home::HomeGate::for_test(home.0, home.1),
        }
    }
}

/// Where a grant's failure branch read the gate's records.
pub(crate) struct GateReads {
    policy: Read,
    map: Read,
    home: Read,
}

fn note(actor: &str, action: &str, reason: &str) -> ChangeNote {
    ChangeNote { actor: actor.into(), reason: reason.into(), at_ms: now_ms(), action: action.into() }
}

fn internal(e: impl std::fmt::Display) -> LockError {
    LockError::Internal(e.to_string())
}

/// The authoritative class policies and map of one cluster: read through
/// [`PolicyCache`], created from the registry when missing.
pub struct Policies {
    cluster: Arc<Cluster>,
    cache: PolicyCache,
}

// === impl Policies ===

impl Policies {
    pub(crate) fn new(cluster: Arc<Cluster>) -> Self {
        Self { cluster, cache: PolicyCache::default() }
    }

    /// The cached view of the records.
    pub(crate) fn cache(&self) -> &PolicyCache {
        &self.cache
    }

    /// The authoritative limit of `class` for `key` as last read, without reading
    /// (for an unprotected grant, when nothing can be read): `None` when nothing
    /// was cached; refused like a grant when the cached map gives the key another
    /// class or the cached policy is draining.
    pub(crate) fn cached_limit(&self, class: &str, key: &LockKey) -> Result<Option<u32>, LockError> {
        self.cache.limit(class, key.as_str())
    }

    /// Drops the cached records (they moved).
    pub(crate) fn forget(&self) {
        self.cache.forget();
    }

    pub(crate) async fn class_map(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<(Arc<ClassMapRecord>, i64), LockError> {
        if let Some(m) = self.cache.map() {
            return Ok(m);
        }
        let key = self.cluster.keys().class_map();
        let generation = self.cache.generation();
        let r = self.cluster.call_by(deadline, self.cluster.client().get(key.as_str(), None)).await?;
        let m: (Arc<ClassMapRecord>, i64) = match r.kvs().first() {
            Some(kv) => (Arc::new(serde_json::from_slice(kv.value()).map_err(internal)?), kv.mod_revision()),
            None => {
                return Err(LockError::Unavailable("no authoritative class map yet; the arbiter creates it".into()))
            }
        };
        self.cache.keep_map(m.0.clone(), m.1, generation);
        Ok(m)
    }

    /// The authoritative policy of `class` (cached), created with `create_limit`
    /// if it does not exist yet.
    pub async fn class_policy(
        &self,
        class: &str,
        create_limit: Option<u32>,
    ) -> Result<(Arc<ClassPolicy>, i64), LockError> {
        if let Some(p) = self.cache.policy(class) {
            return Ok(p);
        }
        let key = self.cluster.keys().class_policy(class);
        let generation = self.cache.generation();
        let r = self.cluster.call(self.cluster.client().get(key.as_str(), None)).await?;
        let found: (Arc<ClassPolicy>, i64) = match r.kvs().first() {
            Some(kv) => (Arc::new(serde_json::from_slice(kv.value()).map_err(internal)?), kv.mod_revision()),
            None => {
                let limit =
                    create_limit.ok_or_else(|| LockError::Unavailable(format!("no policy for class {class}")))?;
                let p = ClassPolicy::new(
                    class,
                    &format!("{class}/{}", now_ms()),
                    limit,
                    note("arbiter", "create", "bootstrap from the registry"),
                )
                .map_err(internal)?;
                self.create_if_missing(&key, &p).await?;
                return Box::pin(self.class_policy(class, None)).await;
            }
        };
        self.cache.keep_policy(class, found.0.clone(), found.1, generation);
        Ok(found)
    }

    async fn create_if_missing<T: Serialize>(&self, key: &str, v: &T) -> Result<(), LockError> {
        let txn = Txn::new().when([Compare::create_revision(key, CompareOp::Equal, 0)]).and_then([TxnOp::put(
            key,
            serde_json::to_vec(v).map_err(internal)?,
            None,
        )]);
        self.cluster.call(self.cluster.client().txn(txn)).await.map(|_| ())
    }

    /// Creates the map and every class's policy that do not exist yet from
    /// `reg` (the first writer wins; later differences are reported, not applied).
    pub async fn bootstrap(&self, reg: &ClassRegistry) -> Result<(), LockError> {
        let map = ClassMapRecord::from_registry(reg, note("arbiter", "create", "bootstrap from the registry"));
        self.create_if_missing(&self.cluster.keys().class_map(), &map).await?;
        for c in reg.classes() {
            self.class_policy(c.name.as_str(), Some(c.max_holders)).await?;
        }
        self.forget();
        Ok(())
    }

    /// Every policy record and the map, read now (for `/status` and metrics).
    pub async fn read_all(&self) -> Result<(Vec<ClassPolicy>, Option<ClassMapRecord>), LockError> {
        let prefix = self.cluster.keys().class_policies();
        let r = self
            .cluster
            .call(self.cluster.client().get(prefix.as_str(), Some(GetOptions::new().with_prefix())))
            .await?;
        let policies = r.kvs().iter().filter_map(|kv| serde_json::from_slice(kv.value()).ok()).collect();
        let m = self.cluster.call(self.cluster.client().get(self.cluster.keys().class_map(), None)).await?;
        let map = m.kvs().first().and_then(|kv| serde_json::from_slice(kv.value()).ok());
        Ok((policies, map))
    }
}

// === impl Store ===

impl Store {
    /// The gate of one grant: the authoritative class and limit of `req.key`.
    pub(crate) async fn policy_gate(&self, req: &AcquireRequest) -> Result<PolicyGate, LockError> {
        let (mut map, mut map_rev) = self.policies.class_map(req.deadline).await?;
        if map.class_of(req.key.as_str()) != req.class.name.as_str() {
            // The cached map may predate an apply: a refusal is decided on a fresh read.
            self.policies.forget();
            (map, map_rev) = self.policies.class_map(req.deadline).await?;
        }
        let class = map.class_of(req.key.as_str()).to_owned();
        if class != req.class.name.as_str() {
            return Err(LockError::Unavailable(format!(
                "this arbiter's registry gives the key class {}, the authoritative map gives {class}: refusing \
                 rather than guessing until the registry is applied",
                req.class.name
            )));
        }
        let (mut policy, mut policy_rev) = self.policies.class_policy(&class, Some(req.class.max_holders)).await?;
        if !policy.admits() {
            // A cached draining record may have been activated or cancelled since:
            // a refusal is decided on a fresh read (an admitting cache is checked
            // by the grant's compare instead).
            self.policies.forget();
            (policy, policy_rev) = self.policies.class_policy(&class, Some(req.class.max_holders)).await?;
        }
        if !policy.admits() {
            return Err(LockError::Draining(format!(
                "class {class} is draining a limit change to {} (change epoch {}); new grants wait for its \
                 activation or cancel",
                policy.pending_target.unwrap_or(policy.limit),
                policy.change_epoch
            )));
        }
        if policy.limit > lockmesh_core::class::MAX_HOLDERS {
            // Slot names have four digits: above the cap, the limit's range compare
            // no longer covers every slot at or above the limit.
            return Err(LockError::Unavailable(format!(
                "class {class}'s authoritative limit {} is above {}, the most holder slots a key can name; lower it \
                 with lockctl limit change",
                policy.limit,
                lockmesh_core::class::MAX_HOLDERS
            )));
        }
        // Where the key lives: refused here if the shard map homes it elsewhere or
        // it is moving (compared by the grant like the records above).
        let home = self.home().gate(&class, &req.key).await?;
        Ok(PolicyGate {
            limit: policy.limit.max(1),
            class: class.clone(),
            policy_key: self.cluster.keys().class_policy(&class),
            policy_rev,
            map_key: self.cluster.keys().class_map(),
            map_rev,
            home,
        })
    }

    /// After a failed grant transaction: true (and caches dropped) when the policy,
    /// the map or the home record moved since the gate was read, so the grant must
    /// be retried.
    pub(crate) fn policy_moved(&self, gate: &PolicyGate, reads: &GateReads, a: &Answer) -> bool {
        let home_moved = gate.home.moved(a.get(reads.home));
        let moved = mod_revision(a.get(reads.policy)) != gate.policy_rev
            || mod_revision(a.get(reads.map)) != gate.map_rev
            || home_moved;
        if moved {
            self.policies.forget();
        }
        if home_moved {
            self.home().forget();
        }
        moved
    }
}
