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
//! - [`Store`] (this file): one cluster's handle: calls under a deadline, sessions,
//!   the seal.
//! - [`clusters`]: the clusters an arbiter config names, validated once.
//! - [`connect`]: how to reach etcd (endpoints, TLS, user), validated once (the
//!   `lockmesh-etcd` crate, which the audit tailer shares).
//! - [`topology`]: the clusters of a split deployment and regional homing.
//! - [`tiers`]: routing a key to its cluster, and sessions that span clusters.
//! - [`home`]: the home fence of every grant, epoch allocation, session extension
//!   (ADR-07, ADR-09).
//! - [`epoch`], [`seal`]: the epoch record and restore detection (ADR-03).
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

use etcd_client::Client;
use lockmesh_core::{headers::SessionId, Reason};
pub use lockmesh_keyspace::{keys, now_ms, HoldRecord, SessionRecord};
use tokio::sync::Mutex;

pub use self::{epoch::EpochState, keys::Keys, runtime::Runtime};

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
    client: Client,
    keys: Keys,
    op_timeout: Duration,
    epoch: epoch::EpochCell,
    /// Session records read or written here (`session::cache`: bounded, idle
    /// entries expire; never proof that a session is alive).
    sessions: moka::sync::Cache<SessionId, Arc<SessionRecord>>,
    vms: vm::VmSessions,
    marker: Mutex<Option<(i64, tokio::time::Instant)>>,
    queues: wait::Queues,
    seal: seal::Seal,
    policies: policy::PolicyCache,
    /// One client per endpoint, to find the member that leads (seal checks).
    members: Vec<Client>,
    /// Whether the clients log in (`etcd.user`), and when they last logged in
    /// again after a failed read ([`Store::relogin_after_failed_read`]).
    relogin: Option<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// When the last login after an `auth store is old` refusal started
    /// ([`Store::relogin_after_auth_change`]); held across the login.
    auth_login: Mutex<Option<tokio::time::Instant>>,
    /// The cluster's name, epoch source and home record (`home`).
    home: home::HomeCell,
    /// Sessions and holds by namespace, followed by a watch ([`quota`]).
    ledger: Arc<quota::Ledger>,
    /// The one watch stream the waiters' hints share ([`watches`]).
    watches: watches::Watches,
    /// What the keyspace gate lets this store's writers write, and the
    /// advertisement their transactions compare ([`upgrade::Guard`]).
    guard: upgrade::Guard,
    /// The arbiter's configuration and books this store follows ([`runtime`]).
    runtime: Arc<Runtime>,
    /// Whether the watch of hold deletes runs ([`Store::start_delay_watch`]).
    delay_watch: std::sync::atomic::AtomicBool,
    /// The group committer of this cluster (`engine::group`).
    committer: Arc<engine::group::Committer>,
    /// When the last raft position check started, and its answer
    /// ([`Store::raft_at_mark_since`]).
    raft_checked: Mutex<Option<(tokio::time::Instant, Result<(), LockError>)>>,
}

/// How many calls of this process etcd refused with `revision of auth store is old`
/// (each followed by a new login, [`Store::call`]).
static AUTH_REFUSALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The count of [`AUTH_REFUSALS`]: a request that answered `unavailable` while it
/// moved was refused by etcd before anything was applied, because the users or
/// roles changed under the client's login, and the clients have logged in again
/// since; the arbiter runs it once more (`extproc` `server`).
pub fn auth_refusals() -> u64 {
    AUTH_REFUSALS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Shortest interval between two logins of [`Store::relogin_after_failed_read`]:
/// an etcd that is merely down is not asked for a bcrypt check on every probe.
const RELOGIN_EVERY: Duration = Duration::from_secs(3);

/// How often a login deferred at start is retried ([`crate::connect::login_later`]).
const LOGIN_RETRY: Duration = Duration::from_secs(1);
/// Calls refused together by one auth change share one login.
const RELOGIN_DEDUP: Duration = Duration::from_millis(200);

pub(crate) fn unavailable(e: etcd_client::Error) -> LockError {
    // etcd's errors do not echo keys or values.
    LockError::Unavailable(e.to_string())
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
        // The TLS files (the CA bundle, and a client certificate when set) are
        // re-read while the arbiter runs: every new connection (the first, and
        // each after a member restarts or the connection breaks) verifies the
        // member with the current bundle and presents the current certificate
        // (issue #16), so an etcd CA roll needs no arbiter restart.
        let certs = auth
            .reloading_certs(crate::connect::ETCD_CERT_RELOAD)
            .map_err(|e| LockError::Unavailable(format!("etcd tls: {e}")))?;
        let timeouts = lockmesh_runtime::ChannelOptions {
            connect_timeout: op_timeout,
            request_timeout: Some(op_timeout),
            keep_alive: Some((Duration::from_secs(5), Duration::from_secs(3))),
        };
        let connect = |eps: Vec<String>, login: crate::connect::Login| {
            let certs = certs.clone();
            async move {
                tokio::time::timeout(op_timeout, auth.connect_as(&eps, certs.as_ref(), timeouts, login))
                    .await
                    .map_err(|_| etcd_client::Error::IoError(std::io::ErrorKind::TimedOut.into()))?
            }
        };
        let connect_all = |login: crate::connect::Login| async move {
            let client = connect(endpoints.to_vec(), login).await?;
            let mut members = Vec::new();
            for e in endpoints {
                members.push(connect(vec![e.clone()], login).await?);
            }
            Ok::<_, etcd_client::Error>((client, members))
        };
        // Under etcd auth the client logs in when it connects. A cluster that does
        // not answer that login (unreachable, no quorum) must not keep the arbiter
        // from starting and serving the keys of every other cluster (issue 18 item
        // 9): its clients connect without a token and log in in the background;
        // until then its calls fail (`unavailable`), as they would without the
        // login. A login etcd refuses (a wrong password) still fails the start.
        let (client, members) = match connect_all(crate::connect::Login::Now).await {
            Ok(c) => c,
            Err(e) if auth.user.is_some() && crate::connect::login_may_wait(&e) => {
                let (client, members) = connect_all(crate::connect::Login::Later).await.map_err(unavailable)?;
                tracing::warn!(root, error = %e, "etcd did not answer the login at start; logging in in the background");
                let clients = std::iter::once(&client).chain(members.iter()).cloned().collect();
                let user = auth.user.clone().unwrap_or_default();
                crate::connect::login_later(clients, user, LOGIN_RETRY, endpoints.join(","));
                (client, members)
            }
            Err(e) => return Err(unavailable(e)),
        };
        let seal = seal::Seal::load(marks_file, root).map_err(LockError::Internal)?;
        let committer = Arc::new(engine::group::Committer::new(client.clone(), Keys::new(root), op_timeout));
        let store = Arc::new(Self {
            committer,
            raft_checked: Mutex::new(None),
            client,
            keys: Keys::new(root),
            op_timeout,
            epoch: epoch::EpochCell::default(),
            sessions: session::cache::new(),
            vms: vm::VmSessions::default(),
            marker: Mutex::new(None),
            queues: wait::Queues::new(runtime.handoff(), runtime.quotas().clone()),
            runtime: runtime.clone(),
            delay_watch: std::sync::atomic::AtomicBool::new(false),
            seal,
            policies: policy::PolicyCache::default(),
            members,
            relogin: auth.user.is_some().then(|| std::sync::Mutex::new(None)),
            auth_login: Mutex::new(None),
            home: home::HomeCell::new(root),
            ledger: Arc::default(),
            watches: watches::Watches::default(),
            guard: upgrade::Guard::default(),
        });
        Ok(store)
    }

    /// After a failed seal-check read, logs every client in again (at most once per
    /// [`RELOGIN_EVERY`]), when the clients have a user.
    ///
    /// etcd's simple auth token names the raft index it was issued at, and a member
    /// holds a request back until it has applied that index. A cluster restored
    /// from a snapshot is behind the index of every token issued before: it never
    /// answers `invalid auth token` (the one error etcd-client's own refresh reacts
    /// to), each call just runs into its deadline. Only a new login, which etcd
    /// answers with a token at its current index, gets the arbiter served again.
    pub async fn relogin_after_failed_read(&self) {
        self.relogin(RELOGIN_EVERY).await;
    }

    /// Logs every client in again unless that was done less than `every` ago (a
    /// zero `every` still skips a login another task has just started).
    async fn relogin(&self, every: Duration) {
        if self.relogin_due(every) {
            self.logins().await;
        }
    }

    /// After etcd refused a call at `refused` because its users or roles changed:
    /// one login that started after the refusal, shared by every call refused
    /// before it started (they wait for it, so each returns with a fresh token
    /// in place and its rerun is served). Not rate-limited like the other
    /// relogins: each auth change refuses each login once, and a change is an
    /// operator's act, not a flood.
    async fn relogin_after_auth_change(&self, refused: tokio::time::Instant) {
        if self.relogin.is_none() {
            return;
        }
        let mut last = self.auth_login.lock().await;
        if last.is_some_and(|started| started >= refused) {
            return;
        }
        *last = Some(tokio::time::Instant::now());
        self.logins().await;
    }

    /// [`Store::relogin`] without waiting for it: for a call that already took its
    /// whole time. Without a quorum a login (a raft request) waits out its own
    /// timeout too, and answering only after it would overrun the caller's deadline
    /// (Envoy's ext_proc message timeout answers 504 then).
    fn relogin_in_background(&self, every: Duration) {
        if self.relogin_due(every) {
            tokio::spawn(self.logins());
        }
    }

    /// Whether a login is due, marking it started when it is.
    fn relogin_due(&self, every: Duration) -> bool {
        let Some(last) = &self.relogin else { return false };
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        let now = tokio::time::Instant::now();
        let min = every.max(RELOGIN_DEDUP);
        if last.is_some_and(|t| now.duration_since(t) < min) {
            return false;
        }
        *last = Some(now);
        true
    }

    /// Logs every client in again (the clients share their token with their clones).
    fn logins(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let clients: Vec<Client> = std::iter::once(&self.client).chain(self.members.iter()).cloned().collect();
        let op_timeout = self.op_timeout;
        async move {
            let logins = clients.iter().map(|c| tokio::time::timeout(op_timeout, c.refresh_token()));
            let results = futures::future::join_all(logins).await;
            let failed = results.into_iter().filter(|r| !matches!(r, Ok(Ok(())))).count();
            if failed > 0 {
                tracing::debug!(failed, "etcd login after a failed read did not succeed everywhere; retried later");
            }
        }
    }

    /// The key layout.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The timeout of one etcd call.
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// A client handle (cheap clone sharing the channel).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Runs an etcd call under the operation timeout.
    pub async fn call<T, F>(&self, f: F) -> Result<T, LockError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        match tokio::time::timeout(self.op_timeout, f).await {
            Ok(r) => self.checked(r).await,
            Err(_) => Err(LockError::Unavailable(format!("etcd did not answer within {:?}", self.op_timeout))),
        }
    }

    /// An etcd answer as a lock result. An `auth store is old` refusal means etcd's
    /// users or roles changed since this client logged in (a user added, a password
    /// rotated): etcd refused the call before applying it, and etcd-client's own
    /// refresh does not react to it. The clients log in again before this call
    /// answers `unavailable`, and the arbiter runs the request once more
    /// ([`auth_refusals`]).
    async fn checked<T>(&self, r: Result<T, etcd_client::Error>) -> Result<T, LockError> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => {
                let text = e.to_string();
                if text.contains("revision of auth store is old") {
                    self.relogin_after_auth_change(tokio::time::Instant::now()).await;
                    AUTH_REFUSALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                } else if text.contains("Timeout expired") {
                    // A restored member holds every token issued before the restore
                    // back until the call's deadline (see
                    // `relogin_after_failed_read`): log in again, at most once per
                    // RELOGIN_EVERY, so the next call is served; in the background,
                    // as this call has already used its time.
                    self.relogin_in_background(RELOGIN_EVERY);
                }
                Err(unavailable(e))
            }
        }
    }

    /// Runs an etcd call for a request with a deadline: the call may take the
    /// caller's remaining wait, at least 500 ms and at most the operation timeout
    /// ([`call_budget`]), so an unreachable etcd answers `unavailable` close to the
    /// caller's deadline.
    pub(crate) async fn call_by<T, F>(&self, deadline: tokio::time::Instant, f: F) -> Result<T, LockError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        // A `lockmesh.etcd` span (op by response type; the txn is the grant's).
        self.call_by_in(deadline, lockmesh_telemetry::etcd_span::<T>(), f).await
    }

    /// [`Store::call_by`] of a transaction sent through the group committer
    /// (`engine::group`), traced as the transaction it is.
    pub(crate) async fn txn_by<T, F>(&self, deadline: tokio::time::Instant, f: F) -> Result<T, LockError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_by_in(deadline, lockmesh_telemetry::etcd_span::<etcd_client::TxnResponse>(), f).await
    }

    async fn call_by_in<T, F>(&self, deadline: tokio::time::Instant, span: tracing::Span, f: F) -> Result<T, LockError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let t = call_budget(deadline.saturating_duration_since(tokio::time::Instant::now()), self.op_timeout);
        let r = tokio::time::timeout(t, tracing::Instrument::instrument(f, span.clone())).await;
        lockmesh_telemetry::finish(&span, if matches!(r, Ok(Ok(_))) { "ok" } else { "error" }, None);
        match r {
            Ok(r) => self.checked(r).await,
            Err(_) => Err(LockError::Unavailable(format!("etcd did not answer within {t:?}"))),
        }
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
        let r = self.call(self.client().lease_grant(120, None)).await?;
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

    /// The cached authoritative class policies.
    pub(crate) fn policy_cache(&self) -> &policy::PolicyCache {
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
        &self.seal
    }

    /// Refuses with `Sealed` while sealed.
    pub fn unsealed(&self) -> Result<(), LockError> {
        match self.seal.current() {
            Some(s) => Err(LockError::Sealed(format!("{}: {}", s.reason.as_str(), s.detail))),
            None => Ok(()),
        }
    }

    /// Refuses with `Sealed` while this arbiter has sealed the cluster or its
    /// epoch record is sealed (as last read; the seal round reads it every
    /// second): what must not even start on a sealed cluster, such as a session.
    pub async fn serving(&self) -> Result<(), LockError> {
        self.unsealed()?;
        match self.epoch_state().await?.sealed {
            Some(why) => Err(LockError::Sealed(why)),
            None => Ok(()),
        }
    }

    /// Ready: etcd answers a linearizable read. A sealed arbiter stays ready: it
    /// answers every request with `sealed`, which callers must see (a removed
    /// endpoint would only show as an anonymous 503).
    pub async fn ready(&self) -> Result<(), LockError> {
        self.check_seal().await
    }
}

/// How long an etcd call of a request with `left` until its deadline may take:
/// `left`, but at least 500 ms (a try-once acquire still gets a round trip) and
/// at most the operation timeout, which wins when it is set below 500 ms (a
/// clamp would panic there: every request would fail).
fn call_budget(left: Duration, op_timeout: Duration) -> Duration {
    left.max(Duration::from_millis(500)).min(op_timeout)
}

#[cfg(test)]
mod call_budget_tests {
    use super::*;

    #[test]
    fn a_call_budget_never_panics_and_the_op_timeout_bounds_it() {
        let ms = Duration::from_millis;
        assert_eq!(call_budget(ms(0), ms(2000)), ms(500));
        assert_eq!(call_budget(ms(1200), ms(2000)), ms(1200));
        assert_eq!(call_budget(ms(9000), ms(2000)), ms(2000));
        // An operation timeout below 500 ms wins (it once panicked here).
        assert_eq!(call_budget(ms(0), ms(400)), ms(400));
        assert_eq!(call_budget(ms(9000), ms(400)), ms(400));
    }
}
