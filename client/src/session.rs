//! One session (an etcd lease at the service) and its background keepalive: one
//! renewal every TTL/3 however many holds the session carries (ADR-10), and the
//! two-stage loss of [`crate::clock`] applied with real (tokio) time.

use std::{
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use lockmesh_core::headers::SessionId;
use tokio::{
    sync::watch,
    task::AbortHandle,
    time::{sleep_until, Instant},
};

use crate::{
    client::Inner,
    clock::{ClockStatus, KeepaliveClock, LossReason},
};

/// A session of this process.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) id: SessionId,
    pub(crate) ttl_s: u64,
    clock: Mutex<KeepaliveClock>,
    lost_tx: watch::Sender<Option<LossReason>>,
    task: Mutex<Option<AbortHandle>>,
}

/// A reading of one session, for observability.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionStatus {
    /// The session id (16 hex digits).
    pub session: String,
    /// Its TTL in seconds.
    pub ttl_s: u64,
    /// The clock reading (can_start, remaining, deadline, keepalive counts, loss).
    pub clock: ClockStatus,
}

// === impl Session ===

impl Session {
    /// A session whose open request was sent at `sent`.
    pub(crate) fn new(id: SessionId, ttl_s: u64, sent: Instant, margin: Duration) -> Arc<Self> {
        let clock = KeepaliveClock::new(sent, Duration::from_secs(ttl_s), margin);
        let (lost_tx, _) = watch::channel(None);
        Arc::new(Self { id, ttl_s, clock: Mutex::new(clock), lost_tx, task: Mutex::new(None) })
    }

    fn clock(&self) -> std::sync::MutexGuard<'_, KeepaliveClock> {
        self.clock.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The clock now.
    pub(crate) fn status(&self) -> ClockStatus {
        self.clock().status(Instant::now())
    }

    /// A public reading.
    pub(crate) fn public_status(&self) -> SessionStatus {
        SessionStatus { session: self.id.to_string(), ttl_s: self.ttl_s, clock: self.status() }
    }

    /// Lost, or past its deadline (even if the keepalive task has not run yet).
    pub(crate) fn lost(&self) -> Option<LossReason> {
        self.status().lost
    }

    /// Marks the session lost; true only the first time.
    pub(crate) fn mark_lost(&self, reason: LossReason) -> bool {
        let first = self.clock().on_lost(reason);
        if first {
            self.lost_tx.send_replace(Some(reason));
        }
        first
    }

    /// Resolves once the session is lost (marked, or its deadline passed).
    pub(crate) async fn wait_lost(&self) -> LossReason {
        let mut rx = self.lost_tx.subscribe();
        loop {
            if let Some(r) = self.lost() {
                return r;
            }
            let deadline = self.status().deadline;
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return self.lost().unwrap_or(LossReason::Closed);
                    }
                }
                _ = sleep_until(deadline) => {}
            }
        }
    }

    /// Sleeps until `at`; false if the session is lost first.
    pub(crate) async fn sleep_until_or_lost(&self, at: Instant) -> bool {
        tokio::select! {
            _ = sleep_until(at) => self.lost().is_none(),
            _ = self.wait_lost() => false,
        }
    }

    /// Starts the keepalive task.
    pub(crate) fn start_keepalive(self: &Arc<Self>, inner: Weak<Inner>, runtime: &tokio::runtime::Handle) {
        let task = runtime.spawn(keepalive_loop(inner, self.clone()));
        *self.task.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(task.abort_handle());
    }

    /// Stops the keepalive task.
    pub(crate) fn stop_keepalive(&self) {
        if let Some(t) = self.task.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            t.abort();
        }
    }
}

/// Renews `session` until it is lost. The deadline is raced against every sleep
/// and every request, so the fence runs on time even while a keepalive hangs.
async fn keepalive_loop(inner: Weak<Inner>, session: Arc<Session>) {
    let reason = loop {
        let (deadline, interval) = {
            let c = session.clock();
            (c.deadline(), c.next_interval())
        };
        tokio::select! {
            _ = sleep_until(deadline) => break LossReason::Deadline,
            _ = sleep_until(Instant::now() + interval) => {}
        }
        let Some(api) = inner.upgrade().map(|i| (i.api.clone(), i.config.request_timeout)) else {
            return;
        };
        let (api, request_timeout) = api;
        // Well inside the interval, so a failure is seen long before the deadline.
        let timeout = request_timeout.min(Duration::from_secs(session.ttl_s) / 6);
        let sent = Instant::now();
        let answer = tokio::select! {
            _ = sleep_until(deadline) => break LossReason::Deadline,
            r = api.keepalive(session.id, timeout) => r,
        };
        match answer {
            Ok(()) => session.clock().on_ack(sent),
            Err(e) if e.code() == Some("session_expired") => break LossReason::SessionExpired,
            Err(e) => {
                session.clock().on_fail(sent);
                // No session id, key or token in logs (ADR-22).
                tracing::warn!(ttl_s = session.ttl_s, error = ?e.code(), "keepalive failed: no new work may start");
            }
        }
    };
    match inner.upgrade() {
        Some(inner) => inner.fence(&session, reason),
        None => {
            session.mark_lost(reason);
        }
    }
}
