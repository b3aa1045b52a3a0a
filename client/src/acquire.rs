//! The outermost acquire of a key, run as its own task so that it ends the same
//! way whether or not its caller is still waiting, and the resolution of an
//! acquire whose answer was lost.
//!
//! Leak-freedom: every grant the service makes on one of our sessions ends in one
//! of three ways: a guard counts it (and its last drop releases it); nobody wants it
//! (the caller left, or was told the outcome was unknown) and it is released here;
//! or the session ends, taking the hold with it. An acquire whose answer is lost
//! is checked by listing the session's holds once the service can no longer grant
//! it (`sent + wait + acquire_slack`), and again after the tier's own request
//! timeout, in case it sat in the tier past its wait.
//!
//! A campaign (`crate::election`) is the same acquire on the election route, with
//! one difference: it stops when its session is lost. Its request is raced
//! against the session's loss and dropped at the loss (the tier then gives up its
//! wait; a grant that commits as it leaves is undone, and the session's close
//! ends anything else), so a campaigner never becomes leader on a session it
//! already counts as lost.

use std::{sync::Arc, time::Duration};

use lockmesh_core::Code;
use tokio::{sync::oneshot, time::Instant};

use crate::{
    api::CallError,
    client::Inner,
    clock::LossReason,
    guard::{release_grant, LockGuard},
    ledger::{Adopt, Grant},
    session::Session,
    Error,
};

/// One acquire to send.
pub(crate) struct Acquire {
    pub(crate) inner: Arc<Inner>,
    pub(crate) session: Arc<Session>,
    pub(crate) key: String,
    pub(crate) wait: Duration,
    pub(crate) class: Option<String>,
    /// `x-lock-permits` or `x-lock-mode`, when the options ask for one.
    pub(crate) shape: Option<(&'static str, String)>,
    pub(crate) timeout: Duration,
    /// A campaign, with the value to proclaim if any (`None`: a plain acquire).
    pub(crate) campaign: Option<Option<String>>,
}

// === impl Acquire ===

impl Acquire {
    /// Sends the acquire and delivers its outcome on `tx`. A guard that cannot be
    /// delivered (the caller left) is dropped, which releases it.
    pub(crate) async fn run(self, tx: oneshot::Sender<Result<LockGuard, Error>>) {
        let Acquire { inner, session, key, wait, class, shape, timeout, campaign } = self;
        let sent = Instant::now();
        inner.count(1);
        let value = campaign.as_ref().map(Option::as_deref);
        let ask: Vec<(&'static str, String)> =
            class.map(|c| (lockmesh_core::headers::CLASS, c)).into_iter().chain(shape).collect();
        let request = inner.api.acquire(&key, session.id, wait, &ask, value, timeout);
        let answer = if campaign.is_some() {
            tokio::select! {
                a = request => a,
                r = session.wait_lost() => {
                    // Dropping the request ends the wait at the tier; the fence
                    // (once per session, whoever sees the loss first) closes the
                    // session and forgets the key's slot.
                    inner.fence(&session, r);
                    inner.ledger().not_acquired(&key, session.id);
                    inner.changed.notify_waiters();
                    let _ = tx.send(Err(Error::SessionLost(r)));
                    return;
                }
            }
        } else {
            request.await
        };
        let result = match answer {
            Ok(a) => {
                let mut grant = a.grant;
                grant.ttl_s = session.ttl_s;
                inner.observe_epoch(grant.cluster.as_deref(), grant.token.epoch(), a.honoured_from);
                let recorded = inner.ledger().acquired(&grant);
                inner.changed.notify_waiters();
                if recorded {
                    Ok(LockGuard::new(inner.clone(), session.clone(), grant))
                } else {
                    // The session was lost while the acquire was in flight; the
                    // hold ends with it (the fence closes the session).
                    Err(Error::SessionLost(session.lost().unwrap_or(LossReason::EpochChanged)))
                }
            }
            Err(CallError::Unknown(m)) => {
                tracing::warn!(error = %m, "acquire answer lost: resolving from the session's holds");
                let _ = tx.send(Err(Error::OutcomeUnknown));
                resolve(&inner, &session, &key, sent, wait).await;
                return;
            }
            Err(e) => Err(refused(&inner, &session, std::slice::from_ref(&key), e)),
        };
        // If the caller is gone the guard comes back and is dropped: released.
        let _ = tx.send(result);
    }
}

/// One multi-key acquire to send (`Client::lock_all`): every key was entered in
/// the ledger as `Acquire` by the caller.
pub(crate) struct AcquireAll {
    pub(crate) inner: Arc<Inner>,
    pub(crate) session: Arc<Session>,
    pub(crate) keys: Vec<String>,
    pub(crate) wait: Duration,
    pub(crate) class: Option<String>,
    pub(crate) timeout: Duration,
}

impl AcquireAll {
    /// Sends the acquire and delivers one guard per key on `tx` (in the order of
    /// `keys`). Guards that cannot be delivered are dropped, which releases them.
    pub(crate) async fn run(self, tx: oneshot::Sender<Result<Vec<LockGuard>, Error>>) {
        let AcquireAll { inner, session, keys, wait, class, timeout } = self;
        let sent = Instant::now();
        inner.count(1);
        let answer = inner.api.acquire_all(&keys, session.id, wait, class.as_deref(), timeout).await;
        let result = match answer {
            Ok((grants, honoured_from)) => {
                let mut guards = Vec::with_capacity(grants.len());
                let mut lost = false;
                for mut grant in grants {
                    grant.ttl_s = session.ttl_s;
                    inner.observe_epoch(grant.cluster.as_deref(), grant.token.epoch(), honoured_from);
                    if inner.ledger().acquired(&grant) {
                        guards.push(LockGuard::new(inner.clone(), session.clone(), grant));
                    } else {
                        lost = true;
                    }
                }
                inner.changed.notify_waiters();
                if lost {
                    // The session was lost while the acquire was in flight: the holds
                    // end with it; the guards made are dropped (released).
                    Err(Error::SessionLost(session.lost().unwrap_or(LossReason::EpochChanged)))
                } else {
                    Ok(guards)
                }
            }
            Err(CallError::Unknown(m)) => {
                tracing::warn!(error = %m, "multi-key acquire answer lost: resolving from the session's holds");
                let _ = tx.send(Err(Error::OutcomeUnknown));
                // Each key's hold is an ordinary hold of the session (in turn: after
                // the first, the others' check times have passed).
                for k in &keys {
                    resolve(&inner, &session, k, sent, wait).await;
                }
                return;
            }
            Err(e) => Err(refused(&inner, &session, &keys, e)),
        };
        let _ = tx.send(result);
    }
}

/// An acquire of `keys` on `session` answered with a refusal: nothing is held,
/// and a `session_expired` answer fences the session.
fn refused(inner: &Arc<Inner>, session: &Arc<Session>, keys: &[String], e: CallError) -> Error {
    for k in keys {
        inner.ledger().not_acquired(k, session.id);
    }
    inner.changed.notify_waiters();
    if e.code() == Some(Code::SessionExpired) {
        inner.fence(session, LossReason::SessionExpired);
        Error::SessionLost(LossReason::SessionExpired)
    } else {
        e.into_error()
    }
}

/// Resolves an acquire of `key` sent at `sent` whose answer was lost.
async fn resolve(inner: &Arc<Inner>, session: &Arc<Session>, key: &str, sent: Instant, wait: Duration) {
    let first = sent + wait + inner.config.acquire_slack;
    let found = list_after(inner, session, key, first).await;
    let lost = matches!(found, Listed::Lost);
    match found {
        Listed::Lost | Listed::Absent => inner.ledger().not_acquired(key, session.id),
        Listed::Present(g) => {
            let decision = inner.ledger().resolved_granted(&g);
            if let Adopt::Release(g) = decision {
                let _ = release_grant(inner, session, &g, false).await;
            }
        }
    }
    inner.changed.notify_waiters();
    if lost {
        return;
    }
    // A late check, in case the request sat in the lock tier past its wait.
    let late = sent + inner.config.tier_request_timeout + inner.config.acquire_slack;
    if late <= first {
        return;
    }
    if let Listed::Present(g) = list_after(inner, session, key, late).await {
        let decision = inner.ledger().adopt(&g);
        if let Adopt::Release(g) = decision {
            let _ = release_grant(inner, session, &g, false).await;
        }
    }
}

#[derive(Debug)]
enum Listed {
    /// The session was lost first: nothing of it is held.
    Lost,
    /// The session holds no grant of the key.
    Absent,
    /// The session holds this grant of the key.
    Present(Grant),
}

/// Lists the session's holds at or after `at`, retrying until answered or the
/// session is lost.
async fn list_after(inner: &Arc<Inner>, session: &Arc<Session>, key: &str, at: Instant) -> Listed {
    if !session.sleep_until_or_lost(at).await {
        return Listed::Lost;
    }
    let mut backoff = Duration::from_millis(200);
    loop {
        inner.count(3);
        match inner.api.holds(session.id, inner.config.request_timeout).await {
            Ok(holds) => {
                for (h, honoured_from) in &holds {
                    inner.observe_epoch(h.cluster.as_deref(), h.token.epoch(), *honoured_from);
                }
                return match holds.into_iter().map(|(h, _)| h).find(|h| h.key == key) {
                    Some(mut g) => {
                        g.ttl_s = session.ttl_s;
                        Listed::Present(g)
                    }
                    None => Listed::Absent,
                };
            }
            Err(e) if e.code() == Some(Code::SessionExpired) => {
                inner.fence(session, LossReason::SessionExpired);
                return Listed::Lost;
            }
            Err(_) => {
                if !session.sleep_until_or_lost(Instant::now() + backoff).await {
                    return Listed::Lost;
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}
