//! [`LockGuard`]: one counted hold. Dropping it (or [`LockGuard::release`]) ends
//! this count; the last one sends the release, which names the exact grant (token
//! and session), so it can never free someone else's hold.

use std::{sync::Arc, time::Duration};

use lockmesh_core::{Code, FencingToken};

use crate::{
    client::Inner,
    clock::{HoldState, LossReason},
    ledger::{Exit, Grant},
    session::Session,
    Error,
};

/// A hold of a key, counted once. Not `Clone`: each acquire gets its own guard.
#[must_use = "dropping the guard releases the lock"]
pub struct LockGuard {
    inner: Arc<Inner>,
    session: Arc<Session>,
    grant: Grant,
    done: bool,
    /// A leadership (`crate::election`): its end is sent as a resign.
    resign: bool,
}

// === impl LockGuard ===

impl LockGuard {
    pub(crate) fn new(inner: Arc<Inner>, session: Arc<Session>, grant: Grant) -> Self {
        Self { inner, session, grant, done: false, resign: false }
    }

    /// Makes this guard a leadership's: its end is a resign.
    pub(crate) fn leadership(mut self) -> Self {
        self.resign = true;
        self
    }

    /// The session the hold is on.
    pub(crate) fn session_handle(&self) -> &Arc<Session> {
        &self.session
    }

    /// The grant.
    pub(crate) fn grant(&self) -> &Grant {
        &self.grant
    }

    /// The client's shared state.
    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// The lock key.
    pub fn key(&self) -> &str {
        &self.grant.key
    }

    /// The fencing token: present it to the resource on every write. A
    /// capability: keep it out of logs.
    pub fn token(&self) -> FencingToken {
        self.grant.token
    }

    /// The signed grant proof, for a resource behind fence-proxy (send it as
    /// `x-lock-proof` with the token). `None` if the service signs no proofs, or
    /// the grant was adopted from a hold listing after an unknown outcome. A
    /// credential: keep it out of logs.
    pub fn proof(&self) -> Option<&str> {
        self.grant.proof.0.as_deref()
    }

    /// The token's epoch.
    pub fn epoch(&self) -> u64 {
        self.grant.token.epoch()
    }

    /// The token's etcd revision.
    pub fn revision(&self) -> u64 {
        self.grant.token.revision()
    }

    /// The session the hold is attached to (16 hex digits).
    pub fn session(&self) -> String {
        self.grant.session.to_string()
    }

    /// The session TTL.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.session.ttl_s)
    }

    /// The key's class, as the service named it.
    pub fn class(&self) -> &str {
        &self.grant.class
    }

    /// Whether a new unit of work may start under this hold: false from the first
    /// failed keepalive of its session (ADR-12) and once the hold is lost.
    pub fn can_start(&self) -> bool {
        self.session.status().can_start
    }

    /// Where the hold stands: [`HoldState::Safe`], [`HoldState::Jeopardy`] (a
    /// keepalive of its session failed and the fence deadline has not come: start
    /// no new work; a later acknowledged keepalive makes it safe again) or
    /// [`HoldState::Lost`] (final).
    pub fn state(&self) -> HoldState {
        self.session.status().state()
    }

    /// Whether the hold is in jeopardy now (see [`LockGuard::state`]).
    pub fn in_jeopardy(&self) -> bool {
        self.session.status().jeopardy
    }

    /// Time left before the fence deadline: decline work that will not finish
    /// within it. Zero once lost.
    pub fn remaining_ttl(&self) -> Duration {
        self.session.status().remaining
    }

    /// Set once the hold is lost (its session fenced, expired, closed or
    /// outdated by an epoch change).
    pub fn lost(&self) -> Option<LossReason> {
        self.session.lost()
    }

    /// Ends this count; if it was the last, releases the grant at the service,
    /// retrying until it is answered or the session is lost. Errors: the hold was
    /// already lost ([`Error::SessionLost`]) or the service says it is not the
    /// holder (`not_holder`: it ended meanwhile).
    pub async fn release(mut self) -> Result<(), Error> {
        self.done = true;
        let exit = self.inner.ledger().exit(&self.grant.key, self.grant.token);
        match exit {
            Exit::Nested(_) => Ok(()),
            Exit::Stale => match self.session.lost() {
                Some(r) => Err(Error::SessionLost(r)),
                None => Ok(()),
            },
            Exit::Release(g) => release_grant(&self.inner, &self.session, &g, self.resign).await,
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let exit = self.inner.ledger().exit(&self.grant.key, self.grant.token);
        if let Exit::Release(g) = exit {
            let (inner, session, resign) = (self.inner.clone(), self.session.clone(), self.resign);
            self.inner.runtime.spawn(async move {
                if let Err(e) = release_grant(&inner, &session, &g, resign).await {
                    tracing::debug!(code = e.code(), "release on drop ended without a release");
                }
            });
        }
    }
}

impl std::fmt::Debug for LockGuard {
    // No key or token in Debug output: guards end up in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard").field("class", &self.grant.class).finish_non_exhaustive()
    }
}

/// Sends the release (`resign`: the resign) of `g` until it is answered, then ends the ledger's
/// releasing state. A failure retries with backoff when sending it again may
/// succeed ([`crate::api::CallError::retryable`]: no answer, or a refusal whose code
/// [`Code::retryable`] says so); any other refusal ends the attempt with it, and so
/// does the session's loss (its holds are gone with it).
pub(crate) async fn release_grant(
    inner: &Arc<Inner>,
    session: &Arc<Session>,
    g: &Grant,
    resign: bool,
) -> Result<(), Error> {
    let mut backoff = Duration::from_millis(100);
    let result = loop {
        inner.count(2);
        match inner.api.release(g, resign, inner.config.request_timeout).await {
            Ok(()) => break Ok(()),
            Err(e) if e.code() == Some(Code::SessionExpired) => {
                inner.fence(session, LossReason::SessionExpired);
                break Err(Error::SessionLost(LossReason::SessionExpired));
            }
            Err(e) if !e.retryable() => break Err(e.into_error()),
            Err(_) => {
                let retry_at = tokio::time::Instant::now() + backoff;
                if !session.sleep_until_or_lost(retry_at).await {
                    break Err(Error::SessionLost(session.lost().unwrap_or(LossReason::Deadline)));
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    };
    inner.ledger().released(&g.key, g.token);
    inner.changed.notify_waiters();
    result
}
