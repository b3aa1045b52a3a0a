//! The lock recipe on etcd (`lockmesh-lock`): sessions, grants, releases and
//! waiting on one cluster, and across the clusters of a split deployment. The
//! arbiter (`lockmesh-extproc`) serves it; the operator workflows
//! (`lockmesh-ops`) drive the same code for shard moves, so each etcd transaction
//! exists once.
//!
//! Every grant is one etcd transaction that compares the epoch record, the key's
//! holder slots and the session's lease, and puts the hold on that lease; the token
//! is `epoch x 2^48 + the commit revision` (ADR-02 in docs/DECISIONS.md). A watch
//! only triggers another transaction (ADR-15); nothing is granted from memory here
//! except a fail-open class's unprotected grants during a declared quorum loss
//! ([`failopen`], ADR-04).
//!
//! # Layout
//! A [`Store`] is the lock recipe on one cluster. What it is built from are
//! types of their own, each holding the [`Cluster`] handle it reaches etcd
//! through and nothing of the rest:
//! - [`cluster::Cluster`]: one etcd cluster's handle: clients, key layout, calls
//!   under a deadline, logins, the leader probe.
//! - [`home::Home`]: the keys' home record and fence, the coord map, the epoch
//!   counter (ADR-07, ADR-09).
//! - [`epoch::Epoch`]: the epoch record every grant compares, the seal that
//!   watches for a restore, the raft position check (ADR-03).
//! - [`policy::Policies`]: the authoritative class policies and map.
//! - [`delay::LockDelay`]: lock-delay guards, records and their watch.
//!
//! What still lives on [`Store`] (this file and the recipe files): sessions,
//! grants, releases, hand-offs, waiting.
//!
//! Modules:
//! - [`clusters`]: the clusters an arbiter config names, validated once.
//! - [`connect`]: how to reach etcd (endpoints, TLS, user), validated once (the
//!   `lockmesh-etcd` crate, which the audit tailer shares).
//! - [`topology`]: the clusters of a split deployment and regional homing.
//! - [`tiers`]: routing a key to its cluster, and sessions that span clusters.
//! - [`home`]: the home fence of every grant, epoch allocation, session extension
//!   (ADR-07, ADR-09).
//! - [`epoch`], [`seal`]: the epoch record and restore detection (ADR-03).
//! - [`delay`]: lock-delay (Consul's `LockDelay`).
//! - [`session`]: sessions (one lease each) and their owners (ADR-10).
//! - [`mutex`]: grant, release and inspection.
//! - [`election`]: leader election on the grant protocol: proclaim and observe.
//! - [`policy`]: the authoritative class limits every grant compares.
//! - [`quota`]: per-namespace quotas, counted without a counter in etcd.
//! - [`vm`]: transparent-mode sessions, one per filter worker VM and class.
//! - [`wait`]: the per-key FIFO of waiters on this arbiter, and the hand-off.
//! - [`steps`]: how long the etcd steps of a lock cycle take here.
//! - [`runtime`]: what one arbiter configures (hand-off, the registry's delays,
//!   candidates and quotas), passed to every store it opens.
//! - [`durable`]: waiters queued in etcd (`fairness: durable`, ADR-14).
//! - [`validate`]: ValidateToken's read.
//! - [`failopen`]: fail-open classes during a quorum loss (ADR-04).
//! - [`test_faults`]: planted bugs for the release gate, compiled in only with the
//!   feature `test-faults` (test builds).
#![forbid(unsafe_code)]

pub mod cluster;
pub mod clusters;
pub use lockmesh_etcd as connect;
pub mod delay;
pub mod durable;
pub mod election;
pub(crate) mod engine;
pub mod epoch;
pub mod failopen;
pub mod home;
pub mod multi;
pub mod mutex;
pub mod policy;
pub mod policy_watch;
pub mod quota;
pub mod runtime;
pub mod seal;
pub mod session;
pub mod shadow;
pub mod steps;
pub mod test_faults;
pub mod tiers;
pub mod topology;
pub mod upgrade;
pub mod validate;
pub mod vm;
pub mod wait;
pub mod watches;

pub use engine::group::{GroupStats, Limits as GroupLimits, Refusal as GroupRefusal, GROUPS};

use std::{sync::Arc, time::Duration};

use lockmesh_core::{headers::SessionId, Reason};
pub use lockmesh_keyspace::{keys, now_ms, HoldRecord, SessionRecord};
use tokio::sync::Mutex;

pub use self::{
    cluster::{auth_refusals, Cluster},
    epoch::EpochState,
    keys::Keys,
    runtime::Runtime,
};
pub(crate) use cluster::unavailable;

/// The message of a `contended` answer.
fn contended_message(r: Reason) -> &'static str {
    match r {
        Reason::LockDelay => {
            "the key is in its lock-delay: its last hold ended without a release (an expiry or a force release)"
        }
        Reason::KeyGated | Reason::LockContended => "the key is held",
    }
}

/// Why a lock operation did not succeed. Messages never carry a key or a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    /// Not granted before the deadline.
    #[error("{}", contended_message(*.0))]
    Contended(Reason),
    /// More slots asked (`x-lock-permits`, or an exclusive hold's N) than one
    /// acquire of the key can get: its authoritative limit, and at most
    /// `MAX_PERMITS`. Never grantable, so refused at once (`bad_request`).
    #[error("x-lock-permits: {asked} slots asked, at most {limit} can go to one acquire of this key")]
    PermitsAboveLimit { asked: u32, limit: u32 },
    /// The same identity and instance holds the key under another session (ADR-13).
    #[error("this identity and instance already hold the key under another session")]
    Leaked,
    /// The token is not a current grant of the key.
    #[error("the token is not a current grant of the key")]
    NotHolder,
    /// The session is unknown, expired or not the caller's.
    #[error("the session does not exist, has expired or is not yours")]
    SessionExpired,
    /// The session's TTL differs from the class TTL.
    #[error("session ttl {session}s does not match class {class} ttl {class_ttl}s; open a session for that class")]
    SessionClassMismatch {
        /// Session TTL.
        session: u64,
        /// The key's class.
        class: String,
        /// Its TTL.
        class_ttl: u64,
    },
    /// The cluster is sealed until an epoch advance.
    #[error("the lock service is sealed: {0}")]
    Sealed(String),
    /// etcd could not be reached or answered with an error; nothing was granted.
    #[error("etcd unavailable: {0}")]
    Unavailable(String),
    /// The caller went away; anything granted for it was released.
    #[error("the caller went away")]
    Cancelled,
    /// Unexpected state.
    #[error("internal error: {0}")]
    Internal(String),
    /// The key's class is draining a limit change: nothing is granted until it
    /// activates or is cancelled.
    #[error("{0}")]
    Draining(String),
    /// The key lives on another cluster than the one asked (a stale routing view
    /// met a moved home record): route again with a fresh shard map.
    #[error("the key's home cluster changed; the arbiter routes it again")]
    Moved,
    /// A fail-open class's unprotected grant could not be spooled: the spool is
    /// at its cap (`failopen::spool`). Nothing was granted.
    #[error("{0}")]
    SpoolFull(String),
    /// The key's namespace is at one of its quotas ([`quota`]): nothing was
    /// granted or opened.
    #[error("{0}")]
    QuotaExceeded(quota::Exceeded),
    /// A multi-key acquire's keys live on different etcd clusters: no one
    /// transaction can grant them (`multi`). Nothing was granted.
    #[error("x-lock-keys: the keys live on {0} etcd clusters; one acquire takes keys of one cluster")]
    KeysSpanClusters(usize),
    /// A multi-key acquire that can never be granted as sent (`bad_request`): the
    /// message starts with the header at fault and names no key.
    #[error("{0}")]
    BadKeys(String),
    /// The session already holds the key in another mode, or with another number
    /// of permits, than the acquire asks for: a re-acquire never changes a held
    /// key's mode (`mode_conflict`). Names what is held.
    #[error("{0}")]
    ModeConflict(String),
    /// The acquire needs a record kind the keyspace has not enabled yet
    /// (`upgrade`; `capability_disabled`). Names the capability.
    #[error("{0}")]
    CapabilityDisabled(String),
    /// A campaign on a key whose authoritative limit (the class's policy record,
    /// compared by the grant) is not 1: an election has one leader, so nothing is
    /// granted while an operator's limit change leaves its class above 1
    /// (`bad_request`).
    #[error("{0}")]
    NotElectionClass(String),
}

/// The arbiter's handle on etcd.
pub struct Store {
    /// The etcd cluster: client, members, key layout, calls, logins.
    cluster: Arc<cluster::Cluster>,
    /// The epoch record, the seal and the raft check ([`epoch`]).
    epoch: epoch::Epoch,
    /// Session records read or written here (`session::cache`: bounded, idle
    /// entries expire; never proof that a session is alive).
    sessions: moka::sync::Cache<SessionId, Arc<SessionRecord>>,
    vms: vm::VmSessions,
    marker: Mutex<Option<(i64, tokio::time::Instant)>>,
    queues: wait::Queues,
    /// The authoritative class policies and map ([`policy`]).
    policies: policy::Policies,
    /// The cluster's name, epoch source and home record (`home`).
    home: Arc<home::Home>,
    /// Sessions and holds by namespace, followed by a watch ([`quota`]).
    ledger: Arc<quota::Ledger>,
    /// The one watch stream the waiters' hints share ([`watches`]).
    watches: watches::Watches,
    /// What the keyspace gate lets this store's writers write, and the
    /// advertisement their transactions compare ([`upgrade::Guard`]).
    guard: upgrade::Guard,
    /// The arbiter's configuration and books this store follows ([`runtime`]).
    runtime: Arc<Runtime>,
    /// The lock-delay guards, records and their watch ([`delay`]).
    delay: Arc<delay::LockDelay>,
    /// The group committer of this cluster (`engine::group`).
    committer: Arc<engine::group::Committer>,
}

/// The outcome label of a release.
pub fn release_outcome<T>(r: &Result<T, crate::LockError>) -> &'static str {
    use crate::LockError as E;
    match r {
        Ok(_) => "released",
        Err(E::NotHolder) => "not_holder",
        Err(E::SessionExpired | E::SessionClassMismatch { .. }) => "session",
        Err(E::Sealed(_)) => "sealed",
        Err(E::Unavailable(_)) => "unavailable",
        Err(_) => "error",
    }
}

// === impl Store ===

impl Store {
    /// Connects to one cluster with etcd TLS and a user (`etcd.tls`,
    /// `etcd.user`), for the arbiter whose configuration is `runtime`. The epoch
    /// record is loaded (or created) by the first seal check.
    pub async fn connect_with(
        endpoints: &[String],
        root: &str,
        op_timeout: Duration,
        marks_file: Option<&std::path::Path>,
        auth: &crate::connect::EtcdClientAuth,
        runtime: &Arc<Runtime>,
    ) -> Result<Arc<Self>, LockError> {
        let cluster = Arc::new(cluster::Cluster::connect(endpoints, root, op_timeout, auth).await?);
        let seal = seal::Seal::load(marks_file, root).map_err(LockError::Internal)?;
        let committer = Arc::new(engine::group::Committer::new(cluster.client(), Keys::new(root), op_timeout));
        let delay = Arc::new(delay::LockDelay::new(cluster.clone(), runtime.clone()));
        let policies = policy::Policies::new(cluster.clone());
        let home = Arc::new(home::Home::new(cluster.clone(), root));
        let epoch = epoch::Epoch::new(cluster.clone(), home.clone(), seal);
        let store = Arc::new(Self {
            committer,
            cluster,
            epoch,
            sessions: session::cache::new(),
            vms: vm::VmSessions::default(),
            marker: Mutex::new(None),
            queues: wait::Queues::new(runtime.handoff(), runtime.quotas().clone()),
            runtime: runtime.clone(),
            delay,
            policies,
            home,
            ledger: Arc::default(),
            watches: watches::Watches::default(),
            guard: upgrade::Guard::default(),
        });
        Ok(store)
    }

    /// The etcd cluster this store works on.
    pub fn cluster(&self) -> &Arc<cluster::Cluster> {
        &self.cluster
    }

    /// The lock-delay of this cluster's keys.
    pub fn lock_delay(&self) -> &Arc<delay::LockDelay> {
        &self.delay
    }

    /// A lease to hang audit markers on; re-granted every minute (TTL 120 s) so
    /// markers do not accumulate.
    pub(crate) async fn marker_lease(&self) -> Result<i64, LockError> {
        let mut m = self.marker.lock().await;
        if let Some((id, at)) = *m {
            if at.elapsed() < Duration::from_secs(60) {
                return Ok(id);
            }
        }
        let r = self.cluster.call(self.cluster.client().lease_grant(120, None)).await?;
        *m = Some((r.id(), tokio::time::Instant::now()));
        Ok(r.id())
    }

    /// This cluster's group committer.
    pub(crate) fn committer(&self) -> &Arc<engine::group::Committer> {
        &self.committer
    }

    /// Commits grants and releases in groups of at most `limits.max_group`
    /// (`engine::group`; 1: each alone).
    pub fn set_group_limits(&self, limits: engine::group::Limits) {
        self.committer.set_limits(limits);
    }

    /// Forgets a cached marker lease (it was not found).
    pub(crate) async fn drop_marker_lease(&self) {
        *self.marker.lock().await = None;
    }

    /// The authoritative class policies and map.
    pub fn policies(&self) -> &policy::Policies {
        &self.policies
    }

    /// The arbiter's configuration and books this store follows.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// The waiter queues.
    pub fn queues(&self) -> &wait::Queues {
        &self.queues
    }

    /// What the keyspace gate lets this store write ([`upgrade::Guard`]).
    pub fn guard(&self) -> &upgrade::Guard {
        &self.guard
    }

    /// The seal state.
    pub fn seal(&self) -> &seal::Seal {
        self.epoch.seal()
    }

    /// The epoch record as this store follows it.
    pub fn epoch(&self) -> &epoch::Epoch {
        &self.epoch
    }

    /// Refuses with `Sealed` while sealed.
    pub fn unsealed(&self) -> Result<(), LockError> {
        match self.seal().current() {
            Some(s) => Err(LockError::Sealed(format!("{}: {}", s.reason.as_str(), s.detail))),
            None => Ok(()),
        }
    }

    /// Refuses with `Sealed` while this arbiter has sealed the cluster or its
    /// epoch record is sealed (as last read; the seal round reads it every
    /// second): what must not even start on a sealed cluster, such as a session.
    pub async fn serving(&self) -> Result<(), LockError> {
        self.unsealed()?;
        match self.epoch().state().await?.sealed {
            Some(why) => Err(LockError::Sealed(why)),
            None => Ok(()),
        }
    }

    /// Ready: etcd answers a linearizable read. A sealed arbiter stays ready: it
    /// answers every request with `sealed`, which callers must see (a removed
    /// endpoint would only show as an anonymous 503).
    pub async fn ready(&self) -> Result<(), LockError> {
        self.epoch().check_seal().await
    }
}
