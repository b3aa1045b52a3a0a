//! One etcd cluster as the lock recipe reaches it: the client and one client per
//! member, the key layout, calls under the operation timeout or a request's
//! deadline, and logging in again when etcd's auth store moved or a restored
//! member holds old tokens back. Every part of a [`Store`](crate::Store) that
//! talks to etcd does it through this handle.

use std::time::Duration;

use etcd_client::Client;
use tokio::sync::Mutex;

use crate::{Keys, LockError};

/// The handle on one etcd cluster (see the module doc).
pub struct Cluster {
    client: Client,
    /// One client per endpoint, to find the member that leads (seal checks).
    members: Vec<Client>,
    keys: Keys,
    op_timeout: Duration,
    /// Whether the clients log in (`etcd.user`), and when they last logged in
    /// again after a failed read ([`Cluster::relogin_after_failed_read`]).
    relogin: Option<std::sync::Mutex<Option<tokio::time::Instant>>>,
    /// When the last login after an `auth store is old` refusal started
    /// ([`Cluster::relogin_after_auth_change`]); held across the login.
    auth_login: Mutex<Option<tokio::time::Instant>>,
}

/// How many calls of this process etcd refused with `revision of auth store is old`
/// (each followed by a new login, [`Cluster::call`]).
static AUTH_REFUSALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The count of [`AUTH_REFUSALS`]: a request that answered `unavailable` while it
/// moved was refused by etcd before anything was applied, because the users or
/// roles changed under the client's login, and the clients have logged in again
/// since; the arbiter runs it once more (`extproc` `server`).
pub fn auth_refusals() -> u64 {
    AUTH_REFUSALS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Shortest interval between two logins of [`Cluster::relogin_after_failed_read`]:
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

/// The lease the leader probe asks about: ids are positive, so this one never
/// exists and the answer is always the leader's `lease not found`.
const PROBE_LEASE: i64 = -1;

// === impl Cluster ===

impl Cluster {
    /// Connects to the cluster at `endpoints` with etcd TLS and a user
    /// (`etcd.tls`, `etcd.user`), its keys under `root`.
    pub async fn connect(
        endpoints: &[String],
        root: &str,
        op_timeout: Duration,
        auth: &crate::connect::EtcdClientAuth,
    ) -> Result<Self, LockError> {
        // The TLS files (the CA bundle, and a client certificate when set) are
        // re-read while the arbiter runs: every new connection (the first, and
        // each after a member restarts or the connection breaks) verifies the
        // member with the current bundle and presents the current certificate,
        // so an etcd CA roll needs no arbiter restart.
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
        // from starting and serving the keys of every other cluster: its clients
        // connect without a token and log in in the background; until then its
        // calls fail (`unavailable`), as they would without the login. A login
        // etcd refuses (a wrong password) still fails the start.
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
        Ok(Self {
            client,
            members,
            keys: Keys::new(root),
            op_timeout,
            relogin: auth.user.is_some().then(|| std::sync::Mutex::new(None)),
            auth_login: Mutex::new(None),
        })
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

    /// [`Cluster::relogin`] without waiting for it: for a call that already took its
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

    /// [`Cluster::call_by`] of a transaction sent through the group committer
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

    /// One client per member (endpoint).
    pub(crate) fn members(&self) -> &[Client] {
        &self.members
    }

    /// Whether any member answers a `Status` call naming a leader (all asked at
    /// once, each member's answer within `within`, or the operation timeout if
    /// shorter). A
    /// cluster that lost its majority has none once its election timeout ran out;
    /// an unreachable member names none. The fail-open trigger
    /// (`failopen::quorum`) needs this to be false.
    ///
    /// etcd 3.5 answers `Status` only to root under auth, and the arbiter's user is
    /// not root: a member that refuses it is asked `LeaseTimeToLive` of a lease that
    /// does not exist instead. A follower forwards that call to its leader, so an
    /// answer (`lease not found` included) proves a leader, and no leader means no
    /// answer within the timeout.
    pub(crate) async fn member_names_leader(&self, within: std::time::Duration) -> bool {
        let t = within.min(self.op_timeout);
        // One bound for each member's whole answer, the fallback call included.
        let asks = self.members.iter().map(|m| {
            let mut m = m.clone();
            let ask = async move {
                match m.status().await {
                    Ok(s) => s.leader() != 0,
                    Err(e) if e.to_string().contains("permission denied") => {
                        match m.lease_time_to_live(PROBE_LEASE, None).await {
                            Ok(_) => true,
                            Err(etcd_client::Error::GRpcStatus(st)) => {
                                st.message().contains("requested lease not found")
                            }
                            Err(_) => false,
                        }
                    }
                    Err(_) => false,
                }
            };
            async move { tokio::time::timeout(t, ask).await.unwrap_or(false) }
        });
        futures::future::join_all(asks).await.into_iter().any(|seen| seen)
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
