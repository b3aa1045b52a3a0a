//! Leader election (docs/SDK.md "Elections"): [`Client::campaign`] waits for an
//! election's leadership and returns a [`Leadership`]; [`Client::observe`] and
//! [`Leadership::observe`] follow who leads.
//!
//! A leadership is a hold of the election's key (`POST /v1/elections/campaign` is
//! an acquire), so it is counted, renewed and lost like a [`LockGuard`]: it ends
//! with its session, its fence deadline comes first, and the fence callback is
//! told. What is added:
//! - **A campaign stops when its session is lost.** It pins the session it
//!   started on (a campaign longer than one request, [`CampaignOptions::round`],
//!   is sent again on that session only) and races each request against the
//!   session's loss: a lost session ends the campaign with
//!   [`Error::SessionLost`], never with a leadership on another session.
//! - **Proclaim** updates the leader's value under its token; a stale token is
//!   refused (`not_holder`) and changes nothing.
//! - **Observe** is a long poll with a resume point (the answer's opaque cursor):
//!   each [`Observer::next`] returns the first change after the last one it
//!   returned, so an observer that polls late or loses a connection misses none
//!   (unless the service says `gap`).

use std::{sync::Arc, time::Duration};

use lockmesh_core::{
    headers::{self, SessionId},
    wire::api::Election,
    Code, FencingToken,
};
use tokio::time::Instant;

use crate::{client::Inner, clock::LossReason, Client, Error, HoldState, LockGuard, LockOptions};

/// The longest wait of one campaign request and of one observer poll by default:
/// the lock tier's default maximum wait (`x-lock-wait-ms`, 30 s).
pub const DEFAULT_ROUND: Duration = Duration::from_secs(30);

/// Options of one [`Client::campaign`].
#[derive(Clone, Debug, Default)]
pub struct CampaignOptions {
    /// How long to campaign. `None` (the default): until leader, or until the
    /// campaign's session is lost. `Some(0)`: one try.
    pub wait: Option<Duration>,
    /// The value to proclaim with the leadership (`x-lock-value`: 1-1024 bytes
    /// of printable ASCII without leading or trailing spaces). Whoever may
    /// observe the election sees it.
    pub value: Option<String>,
    /// Refuse unless the election's class is this one (`x-lock-class`).
    pub class: Option<String>,
    /// The longest wait of one campaign request (default [`DEFAULT_ROUND`]; keep
    /// it within the tier's maximum wait). A longer campaign sends the next one
    /// when a request's wait ends; between two requests it loses its place in line.
    pub round: Option<Duration>,
}

/// An election's leadership: a counted hold of its key. Dropping it (or
/// [`Leadership::resign`]) ends it. Not `Clone`.
#[must_use = "dropping the leadership resigns it"]
pub struct Leadership {
    guard: LockGuard,
    value: Option<String>,
}

/// One observation of an election ([`Observer::next`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// Who leads, or `None` when nobody does.
    pub leader: Option<LeaderInfo>,
    /// True when this is a change after the previous observation (the first
    /// observation of an observer is the state then, `false`).
    pub changed: bool,
    /// True when the service could not resume from the previous observation
    /// (history compacted, or answered by another arbiter without a shared
    /// signing key): this is the state now and changes between may be missing.
    pub gap: bool,
    /// Where this observation stands (opaque): [`Observer::resume_from`] it to
    /// carry on in another process.
    pub cursor: String,
}

/// An election's leader as observed.
#[derive(Clone, PartialEq, Eq)]
pub struct LeaderInfo {
    /// The leader's SPIFFE ID.
    pub identity: String,
    /// The value it proclaimed under this leadership, if any.
    pub value: Option<String>,
    /// When the leadership was granted, unix ms (the service's clock).
    pub since_ms: u64,
    /// The leadership's token: only when the observer is the leader
    /// ([`Leadership::observe`]). A capability: keep it out of logs.
    pub token: Option<FencingToken>,
    /// True when the observer is the leader.
    pub you: bool,
}

/// Follows an election: [`Client::observe`], [`Leadership::observe`].
pub struct Observer {
    inner: Arc<Inner>,
    key: String,
    session: Option<SessionId>,
    cursor: Option<String>,
    poll: Duration,
}

// === impl Client ===

impl Client {
    /// Campaigns for the leadership of election `key` (a key of a class with
    /// `max_holders: 1` that fails closed): waits in line like an acquire, for
    /// `opts.wait` or until leader. Returns the leadership, whose token fences
    /// the leader's writes. Re-entrant like [`Client::lock`]: campaigning for an
    /// election this process leads counts the leadership once more (and
    /// proclaims `opts.value`, if given).
    ///
    /// The campaign runs on one session and stops when it is lost
    /// ([`Error::SessionLost`]); it never leads on a session it counts as lost.
    /// Errors: [`Error::Contended`] when `opts.wait` ended first, the service's
    /// refusals (`bad_request` for a class that cannot hold an election).
    pub async fn campaign(&self, key: &str, opts: CampaignOptions) -> Result<Leadership, Error> {
        headers::parse_key(key.as_bytes()).map_err(|e| Error::Config { field: "key", why: e.why })?;
        if let Some(v) = &opts.value {
            headers::parse_value(v.as_bytes()).map_err(|e| Error::Config { field: "value", why: e.why })?;
        }
        let until = opts.wait.map(|w| Instant::now() + w);
        let round = opts.round.unwrap_or(DEFAULT_ROUND);
        let mut session = self.session_for(key, opts.class.as_deref()).await?;
        let mut repinned = false;
        loop {
            let wait = until.map_or(round, |u| u.saturating_duration_since(Instant::now()).min(round));
            let lock = LockOptions { wait, class: opts.class.clone(), ..LockOptions::default() };
            match self.take(key, &lock, Some(opts.value.as_deref()), Some(&session)).await {
                Ok(guard) => return Leadership::won(self.inner(), guard, opts.value).await,
                Err(Error::Contended { .. }) if until.is_none_or(|u| Instant::now() < u) => continue,
                // The class's TTL changed: campaign on a session of the new one.
                Err(Error::Refused { code, .. }) if code == Code::SessionClassMismatch && !repinned => {
                    repinned = true;
                    session = self.session_for(key, opts.class.as_deref()).await?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// An observer of election `key`: its first [`Observer::next`] tells who
    /// leads now, each later one the next change. Needs the `inspect` operation
    /// on the key; shows no token (the leader's own: [`Leadership::observe`]).
    pub fn observe(&self, key: &str) -> Observer {
        Observer::new(self.inner().clone(), key, None)
    }
}

// === impl Leadership ===

impl Leadership {
    /// Wraps a campaign's guard; a re-entered leadership proclaims `value` itself
    /// (the service proclaimed it with a new one).
    async fn won(inner: &Arc<Inner>, guard: LockGuard, value: Option<String>) -> Result<Self, Error> {
        let nested = inner.ledger().count(guard.key()) > 1;
        let mut l = Self { guard: guard.leadership(), value: None };
        match value {
            Some(v) if nested => l.proclaim(v).await?,
            v => l.value = v,
        }
        Ok(l)
    }

    /// The election's key.
    pub fn key(&self) -> &str {
        self.guard.key()
    }

    /// The leadership's fencing token: present it to the resource on every
    /// write. A later leader's is larger. A capability: keep it out of logs.
    pub fn token(&self) -> FencingToken {
        self.guard.token()
    }

    /// The signed grant proof, for a resource behind fence-proxy.
    pub fn proof(&self) -> Option<&str> {
        self.guard.proof()
    }

    /// The value this process last proclaimed under this leadership.
    pub fn value(&self) -> Option<&str> {
        self.value.as_deref()
    }

    /// The session the leadership is on (16 hex digits).
    pub fn session(&self) -> String {
        self.guard.session()
    }

    /// The leadership as a lock guard (token, epoch, revision, TTL, state).
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Whether a new unit of leader work may start: false from the first failed
    /// keepalive of its session and once lost ([`LockGuard::can_start`]).
    pub fn can_start(&self) -> bool {
        self.guard.can_start()
    }

    /// [`HoldState::Safe`], [`HoldState::Jeopardy`] or [`HoldState::Lost`].
    pub fn state(&self) -> HoldState {
        self.guard.state()
    }

    /// Time left before the fence deadline; zero once lost.
    pub fn remaining_ttl(&self) -> Duration {
        self.guard.remaining_ttl()
    }

    /// Set once the leadership is lost (its session fenced, expired, closed or
    /// outdated by an epoch change).
    pub fn lost(&self) -> Option<LossReason> {
        self.guard.lost()
    }

    /// Resolves when the leadership is lost (the fence deadline, at the latest):
    /// stop leading then.
    pub async fn wait_lost(&self) -> LossReason {
        self.guard.session_handle().wait_lost().await
    }

    /// Replaces the leader's value, keeping the leadership: stored only while
    /// this token leads. Retried while the answer is lost or worth retrying.
    /// Errors: [`Error::SessionLost`]; `not_holder` (this leadership ended);
    /// [`Error::Config`] for a malformed value.
    pub async fn proclaim(&mut self, value: impl Into<String>) -> Result<(), Error> {
        let value = value.into();
        headers::parse_value(value.as_bytes()).map_err(|e| Error::Config { field: "value", why: e.why })?;
        let inner = self.guard.inner();
        let session = self.guard.session_handle();
        let mut backoff = Duration::from_millis(100);
        loop {
            if let Some(r) = session.lost() {
                return Err(Error::SessionLost(r));
            }
            match inner.api.proclaim(self.guard.grant(), &value, inner.config.request_timeout).await {
                Ok(()) => {
                    self.value = Some(value);
                    return Ok(());
                }
                Err(e) if e.code() == Some(Code::SessionExpired) => {
                    inner.fence(session, LossReason::SessionExpired);
                    return Err(Error::SessionLost(LossReason::SessionExpired));
                }
                Err(e) if !e.retryable() => return Err(e.into_error()),
                Err(_) => {
                    if !session.sleep_until_or_lost(Instant::now() + backoff).await {
                        return Err(Error::SessionLost(session.lost().unwrap_or(LossReason::Deadline)));
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Ends this count of the leadership; the last resigns it at the service (the
    /// next campaigner in line leads), as [`LockGuard::release`].
    pub async fn resign(self) -> Result<(), Error> {
        self.guard.release().await
    }

    /// An observer of this election that sees this leadership's token (`you`).
    pub fn observe(&self) -> Observer {
        let sid = self.guard.grant().session;
        Observer::new(self.guard.inner().clone(), self.key(), Some(sid))
    }
}

impl std::fmt::Debug for Leadership {
    // No key, token or value in Debug output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership").field("class", &self.guard.class()).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for LeaderInfo {
    // No token in Debug output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderInfo")
            .field("identity", &self.identity)
            .field("value", &self.value)
            .field("since_ms", &self.since_ms)
            .field("you", &self.you)
            .finish_non_exhaustive()
    }
}

// === impl Observer ===

impl Observer {
    fn new(inner: Arc<Inner>, key: &str, session: Option<SessionId>) -> Self {
        Self { inner, key: key.to_owned(), session, cursor: None, poll: DEFAULT_ROUND }
    }

    /// Carries on from `cursor` (an [`Observation::cursor`]): the next
    /// observation is the first change after it.
    pub fn resume_from(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = Some(cursor.into());
        self
    }

    /// The longest wait of one poll (default [`DEFAULT_ROUND`]; keep it within the
    /// tier's maximum wait). A poll that ends without a change is sent again.
    pub fn poll(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// Where the last observation stands, if there was one.
    pub fn cursor(&self) -> Option<&str> {
        self.cursor.as_deref()
    }

    /// The first observation: who leads now. Every later one: the first change
    /// after the previous, waiting as long as it takes. An error (the service
    /// unreachable, an answer lost) leaves the cursor where it was: call again
    /// and nothing is missed.
    pub async fn next(&mut self) -> Result<Observation, Error> {
        let timeout_slack = self.inner.config.request_timeout;
        loop {
            let first = self.cursor.is_none();
            let wait = if first { Duration::ZERO } else { self.poll };
            let r = self.inner.api.observe(&self.key, self.cursor.as_deref(), wait, self.session, wait + timeout_slack);
            let e: Election = r.await.map_err(crate::api::CallError::into_error)?;
            self.cursor = Some(e.cursor.clone());
            if first || e.changed {
                return Ok(observation(e, !first));
            }
        }
    }
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer").field("poll", &self.poll).finish_non_exhaustive()
    }
}

fn observation(e: Election, changed: bool) -> Observation {
    let leader = e.leader.map(|l| LeaderInfo {
        identity: l.identity,
        value: l.value,
        since_ms: l.since_ms,
        token: l.token,
        you: l.you,
    });
    Observation { leader, changed: changed && e.changed, gap: e.gap, cursor: e.cursor }
}
