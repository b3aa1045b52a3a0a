//! etcd calls that survive a change of etcd's users or roles under the login.
//!
//! etcd 3.5 refuses every request of a client whose token predates a change of
//! its users or roles (a user added, a role granted, a password changed) with
//! `etcdserver: revision of auth store is old` (gRPC `InvalidArgument`). etcd
//! checks the token's auth revision before it applies anything, so such a request
//! was **not** applied. `etcd-client` renews its token on an invalid or expired
//! token only, not on this refusal, so a long-lived login (an operator command
//! that makes several calls, while another tool adds users) fails now and then.
//!
//! [`retry_auth`] runs one etcd call; on that refusal it logs the client in again
//! ([`Client::refresh_token`]: the stored credentials, a new token shared by every
//! clone of the client) and sends the same request again, for at most
//! [`AUTH_RETRY_FOR`] with a short pause. Every other error returns at once:
//! only this refusal is one etcd guarantees was not applied, so only it is sent
//! again. [`Etcd`] is a client whose calls all go through it, and
//! [`auth_retries`] counts the requests sent again in this process (`lockctl`
//! says on stderr when there were some).
//!
//! Not promised: a call refused for longer than [`AUTH_RETRY_FOR`] (users or
//! roles changing without pause) fails with the refusal; a failed login fails the
//! call with the login's error.

use std::{
    future::Future,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use etcd_client::{
    AlarmAction, AlarmResponse, AlarmType, Client, DeleteOptions, DeleteResponse, GetOptions, GetResponse,
    LeaseGrantOptions, LeaseGrantResponse, LeaseLeasesResponse, LeaseRevokeResponse, LeaseTimeToLiveOptions,
    LeaseTimeToLiveResponse, MemberListResponse, PutOptions, PutResponse, StatusResponse, Txn, TxnResponse,
};
use tokio::time::Instant;

/// How long one call is sent again while etcd refuses it as
/// [`AUTH_STORE_OLD`].
pub const AUTH_RETRY_FOR: Duration = Duration::from_secs(10);

/// The pause before each login after the first (a burst of user changes is
/// waited out rather than answered with a login per change).
const PAUSE: Duration = Duration::from_millis(100);

/// etcd's text for the refusal (`rpctypes.ErrGRPCAuthOldRevision`).
pub const AUTH_STORE_OLD: &str = "revision of auth store is old";

/// Requests of this process that etcd refused as [`AUTH_STORE_OLD`] and
/// [`retry_auth`] sent again.
static AUTH_RETRIES: AtomicU64 = AtomicU64::new(0);

/// How many requests of this process etcd refused as [`AUTH_STORE_OLD`] and
/// [`retry_auth`] sent again after a new login.
pub fn auth_retries() -> u64 {
    AUTH_RETRIES.load(Ordering::Relaxed)
}

/// An error that may be etcd's [`AUTH_STORE_OLD`] refusal.
pub trait AuthRefusal: Sized {
    /// Whether etcd refused the call because its users or roles changed since
    /// the client logged in (nothing of the call was applied).
    fn auth_store_old(&self) -> bool;
    /// The failure of the new login, as this error.
    fn login_failed(e: etcd_client::Error) -> Self;
}

impl AuthRefusal for etcd_client::Error {
    fn auth_store_old(&self) -> bool {
        matches!(self, etcd_client::Error::GRpcStatus(s) if s.message().contains(AUTH_STORE_OLD))
    }
    fn login_failed(e: etcd_client::Error) -> Self {
        e
    }
}

/// The errors callers keep as text (etcd's message is in it).
impl AuthRefusal for String {
    fn auth_store_old(&self) -> bool {
        self.contains(AUTH_STORE_OLD)
    }
    fn login_failed(e: etcd_client::Error) -> Self {
        format!("etcd login: {e}")
    }
}

impl AuthRefusal for lockmesh_lock::upgrade::UpgradeError {
    fn auth_store_old(&self) -> bool {
        matches!(self, Self::Etcd(m) if m.contains(AUTH_STORE_OLD))
    }
    fn login_failed(e: etcd_client::Error) -> Self {
        Self::Etcd(format!("login: {e}"))
    }
}

/// A store's answer: `unavailable` with etcd's message.
impl AuthRefusal for lockmesh_lock::LockError {
    fn auth_store_old(&self) -> bool {
        matches!(self, Self::Unavailable(m) if m.contains(AUTH_STORE_OLD))
    }
    fn login_failed(e: etcd_client::Error) -> Self {
        Self::Unavailable(format!("etcd login: {e}"))
    }
}

/// Runs `call` with a clone of `client`; while etcd refuses it as
/// [`AUTH_STORE_OLD`] (users or roles changed since the login; etcd applied
/// nothing), logs `client` in again and runs `call` again, for at most
/// [`AUTH_RETRY_FOR`]. Only that refusal is sent again: every other error, and a
/// failed login, is returned at once. `call` is run again from its start, so it
/// must be safe to rerun after a refused request: one request, reads, or steps
/// that each compare what they read before they write.
///
/// `call` takes its client by value (a clone sharing the channel and the token),
/// so the future it returns borrows nothing of this function's and is `Send`
/// whenever what it captures is.
pub async fn retry_auth<T, E, Fut>(client: &Client, mut call: impl FnMut(Client) -> Fut) -> Result<T, E>
where
    E: AuthRefusal,
    Fut: Future<Output = Result<T, E>>,
{
    let until = Instant::now() + AUTH_RETRY_FOR;
    let mut refused = 0u32;
    loop {
        match call(client.clone()).await {
            Err(e) if e.auth_store_old() && Instant::now() < until => {
                AUTH_RETRIES.fetch_add(1, Ordering::Relaxed);
                if refused > 0 {
                    tokio::time::sleep(PAUSE).await;
                }
                refused += 1;
                tracing::debug!(refused, "etcd's users or roles changed under this login; logging in again");
                // The clones of a client share its token: every holder of
                // `client` gets the new one.
                client.refresh_token().await.map_err(E::login_failed)?;
            }
            r => return r,
        }
    }
}

/// An etcd client whose every call goes through [`retry_auth`]. Cheap to clone
/// (the channel and the token are shared).
#[derive(Clone)]
pub struct Etcd {
    client: Client,
}

impl Etcd {
    /// Wraps `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// Wraps a clone of `client` (sharing its channel and token).
    pub fn of(client: &Client) -> Self {
        Self::new(client.clone())
    }

    /// The client (its calls made directly are not sent again).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Any call (or reads, or compared steps) through [`retry_auth`].
    pub async fn call<T, E: AuthRefusal, Fut: Future<Output = Result<T, E>>>(
        &self,
        call: impl FnMut(Client) -> Fut,
    ) -> Result<T, E> {
        retry_auth(&self.client, call).await
    }

    /// `Range`.
    pub async fn get(
        &self,
        key: impl Into<Vec<u8>>,
        opts: Option<GetOptions>,
    ) -> Result<GetResponse, etcd_client::Error> {
        let key = key.into();
        self.call(|mut c| {
            let (key, opts) = (key.clone(), opts.clone());
            async move { c.get(key, opts).await }
        })
        .await
    }

    /// `Put`.
    pub async fn put(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        opts: Option<PutOptions>,
    ) -> Result<PutResponse, etcd_client::Error> {
        let (key, value) = (key.into(), value.into());
        self.call(|mut c| {
            let (key, value, opts) = (key.clone(), value.clone(), opts.clone());
            async move { c.put(key, value, opts).await }
        })
        .await
    }

    /// `DeleteRange`.
    pub async fn delete(
        &self,
        key: impl Into<Vec<u8>>,
        opts: Option<DeleteOptions>,
    ) -> Result<DeleteResponse, etcd_client::Error> {
        let key = key.into();
        self.call(|mut c| {
            let (key, opts) = (key.clone(), opts.clone());
            async move { c.delete(key, opts).await }
        })
        .await
    }

    /// `Txn` (refused as a whole: none of its operations applied).
    pub async fn txn(&self, txn: Txn) -> Result<TxnResponse, etcd_client::Error> {
        self.call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    /// `LeaseGrant`.
    pub async fn lease_grant(
        &self,
        ttl: i64,
        opts: Option<LeaseGrantOptions>,
    ) -> Result<LeaseGrantResponse, etcd_client::Error> {
        self.call(|mut c| {
            let opts = opts.clone();
            async move { c.lease_grant(ttl, opts).await }
        })
        .await
    }

    /// `LeaseRevoke`.
    pub async fn lease_revoke(&self, id: i64) -> Result<LeaseRevokeResponse, etcd_client::Error> {
        self.call(|mut c| async move { c.lease_revoke(id).await }).await
    }

    /// `LeaseTimeToLive`.
    pub async fn lease_time_to_live(
        &self,
        id: i64,
        opts: Option<LeaseTimeToLiveOptions>,
    ) -> Result<LeaseTimeToLiveResponse, etcd_client::Error> {
        self.call(|mut c| {
            let opts = opts.clone();
            async move { c.lease_time_to_live(id, opts).await }
        })
        .await
    }

    /// `LeaseLeases`.
    pub async fn leases(&self) -> Result<LeaseLeasesResponse, etcd_client::Error> {
        self.call(|mut c| async move { c.leases().await }).await
    }

    /// `MemberList`.
    pub async fn member_list(&self) -> Result<MemberListResponse, etcd_client::Error> {
        self.call(|mut c| async move { c.member_list().await }).await
    }

    /// `Status` of the member the client reaches.
    pub async fn status(&self) -> Result<StatusResponse, etcd_client::Error> {
        self.call(|mut c| async move { c.status().await }).await
    }

    /// `Alarm`.
    pub async fn alarm(&self, action: AlarmAction, kind: AlarmType) -> Result<AlarmResponse, etcd_client::Error> {
        self.call(|mut c| async move { c.alarm(action, kind, None).await }).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_old_auth_store_refusal_is_retried() {
        let old = "grpc request error: status: InvalidArgument, message: \"etcdserver: revision of auth store is old\"";
        assert!(old.to_owned().auth_store_old());
        assert!(!"etcdserver: permission denied".to_owned().auth_store_old());
        assert!(lockmesh_lock::LockError::Unavailable(old.into()).auth_store_old());
        assert!(!lockmesh_lock::LockError::Unavailable("etcd did not answer".into()).auth_store_old());
        assert!(lockmesh_lock::upgrade::UpgradeError::Etcd(old.into()).auth_store_old());
    }
}
