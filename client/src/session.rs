//! One session (an etcd lease at the service) and its background keepalive: one
//! renewal every TTL/3 however many holds the session carries (ADR-10), and the
//! two-stage loss of [`crate::clock`] applied with real (tokio) time: jeopardy from
//! the first failed keepalive (reported when it starts and when a later keepalive
//! ends it), the fence at the deadline.

use std::{
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use lockmesh_core::{headers::SessionId, Code};
use tokio::{
    sync::watch,
    task::AbortHandle,
    time::{sleep_until, Instant},
};

use crate::{
    api::CallError,
    client::Inner,
    clock::{ClockStatus, HoldState, KeepaliveClock, LossReason},
};

/// A session of this process.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) id: SessionId,
    pub(crate) ttl_s: u64,
    clock: Mutex<KeepaliveClock>,
    lost_tx: watch::Sender<Option<LossReason>>,
    task: Mutex<Option<AbortHandle>>,
    /// Held while the holder is told anything (jeopardy, recovery, the fence), so
    /// nothing is told after the fence.
    telling: Mutex<()>,
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
        Arc::new(Self { id, ttl_s, clock: Mutex::new(clock), lost_tx, task: Mutex::new(None), telling: Mutex::new(()) })
    }

    fn clock(&self) -> std::sync::MutexGuard<'_, KeepaliveClock> {
        self.clock.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Serializes what the holder is told about this session (see `telling`).
    pub(crate) fn telling(&self) -> std::sync::MutexGuard<'_, ()> {
        self.telling.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

/// Renews `session` until it is lost, then fences it.
async fn keepalive_loop(inner: Weak<Inner>, session: Arc<Session>) {
    let Some((api, request_timeout)) = inner.upgrade().map(|i| (i.api.clone(), i.config.request_timeout)) else {
        return;
    };
    // Well inside the interval, so a failure is seen long before the deadline.
    let timeout = request_timeout.min(Duration::from_secs(session.ttl_s) / 6);
    let told = inner.clone();
    let on_change = |state: HoldState| {
        if let Some(inner) = told.upgrade() {
            inner.jeopardy(&session, state);
        }
    };
    let reason = renew_until_lost(&session, || api.keepalive(session.id, timeout), on_change).await;
    match inner.upgrade() {
        Some(inner) => inner.fence(&session, reason),
        None => {
            session.mark_lost(reason);
        }
    }
}

/// The keepalive schedule: one `renew` every TTL/3 (faster in jeopardy), the first
/// failure starting jeopardy (`on_change(Jeopardy)`), a later acknowledged renewal
/// ending it (`on_change(Safe)`), `session_expired` ending the session at once. The
/// deadline is raced against every sleep and every renewal, so the loss is
/// returned on time even while a renewal hangs; the loss itself is the caller's to
/// report (the fence), never an `on_change`.
async fn renew_until_lost<F, Fut>(session: &Session, mut renew: F, mut on_change: impl FnMut(HoldState)) -> LossReason
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), CallError>>,
{
    loop {
        let (deadline, interval) = {
            let c = session.clock();
            (c.deadline(), c.next_interval())
        };
        tokio::select! {
            _ = sleep_until(deadline) => return LossReason::Deadline,
            _ = sleep_until(Instant::now() + interval) => {}
        }
        let sent = Instant::now();
        let answer = tokio::select! {
            _ = sleep_until(deadline) => return LossReason::Deadline,
            r = renew() => r,
        };
        match answer {
            Ok(()) => {
                // The conformance suite's planted fault counts from the answer.
                let counted_from = if crate::planted::deadline_from_answer() { Instant::now() } else { sent };
                let recovered = session.clock().on_ack(counted_from);
                if recovered {
                    tracing::info!(ttl_s = session.ttl_s, "keepalive acknowledged: jeopardy ended");
                    on_change(HoldState::Safe);
                }
            }
            Err(e) if e.code() == Some(Code::SessionExpired) => return LossReason::SessionExpired,
            Err(e) => {
                let entered = session.clock().on_fail(sent);
                // No session id, key or token in logs (ADR-22).
                tracing::warn!(ttl_s = session.ttl_s, error = ?e.code_str(), "keepalive failed: in jeopardy, no new work may start");
                if entered {
                    on_change(HoldState::Jeopardy);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::time::advance;

    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// What `on_change` was told, and when.
    type Told = Arc<std::sync::Mutex<Vec<(Instant, HoldState)>>>;

    /// A session of TTL 3 s and margin 1 s, renewed by `renew` on a task.
    fn start<F, Fut>(renew: F) -> (Arc<Session>, Instant, tokio::task::JoinHandle<LossReason>, Told)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(), CallError>> + Send,
    {
        let t0 = Instant::now();
        let s = Session::new(SessionId::from_lease(7).unwrap(), 3, t0, Duration::from_secs(1));
        let s2 = s.clone();
        let told = Told::default();
        let t = told.clone();
        let on_change = move |st| t.lock().unwrap().push((Instant::now(), st));
        let task = tokio::spawn(async move { renew_until_lost(&s2, renew, on_change).await });
        (s, t0, task, told)
    }

    async fn at(t: Instant) {
        tokio::time::sleep_until(t).await;
    }

    #[tokio::test(start_paused = true)]
    async fn one_renewal_per_interval_and_the_drain_starts_at_the_first_failure() {
        // Renewal 1 succeeds at once, renewal 2 is answered 200 ms after it was sent;
        // from the 3rd on they hang for 500 ms (the keepalive timeout) and fail.
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let (s, t0, task, told) = start(move || {
            let n = c.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n == 1 {
                    Ok(())
                } else if n == 2 {
                    tokio::time::sleep(ms(200)).await;
                    Ok(())
                } else {
                    tokio::time::sleep(ms(500)).await;
                    Err(CallError::Unknown("timed out".into()))
                }
            }
        });
        at(t0 + ms(2900)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one renewal per TTL/3");
        assert!(s.status().can_start);
        // The 3rd renewal is sent at 3.2 s (1 s after the 2nd was answered) and
        // fails at 3.7 s.
        at(t0 + ms(3690)).await;
        assert!(s.status().can_start, "drained before any renewal failed");
        at(t0 + ms(3710)).await;
        let st = s.status();
        assert!(!st.can_start, "can_start must turn false at the first failed keepalive");
        assert_eq!((st.failed, st.lost), (1, None));
        // The deadline counts from the *send* time of the last ack (2 s, not its
        // answer at 2.2 s): 2 s + 3 s - 1 s = 4 s.
        assert_eq!(st.deadline, t0 + ms(4000));
        at(t0 + ms(3990)).await;
        assert_eq!(s.status().lost, None);
        advance(ms(20)).await;
        assert_eq!(task.await.unwrap(), LossReason::Deadline);
        // Jeopardy was told once, at the failure; the loss is the fence's to tell.
        assert_eq!(*told.lock().unwrap(), vec![(t0 + ms(3700), HoldState::Jeopardy)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_renewal_does_not_delay_the_fence() {
        let (s, t0, task, told) = start(std::future::pending);
        let reason = task.await.unwrap();
        assert_eq!(reason, LossReason::Deadline);
        assert_eq!(Instant::now(), t0 + ms(2000), "fenced at open send time + ttl - margin");
        assert!(!s.status().can_start);
        // A renewal that hangs past the deadline never failed: no jeopardy was told.
        assert!(told.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_blip_ends_the_drain_and_moves_the_deadline() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let (s, t0, task, told) = start(move || {
            let n = c.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n == 1 {
                    Err(CallError::Refused {
                        status: 503,
                        code: Code::Unavailable.into(),
                        message: String::new(),
                        reason: None,
                    })
                } else {
                    Ok(())
                }
            }
        });
        at(t0 + ms(1100)).await;
        assert!(!s.status().can_start, "the failed renewal at 1 s drains");
        assert_eq!(s.status().state(), HoldState::Jeopardy);
        // Retried 300 ms later (TTL/10), acknowledged: work may start again.
        at(t0 + ms(1400)).await;
        let st = s.status();
        assert!(st.can_start);
        assert_eq!(st.deadline, t0 + ms(1300) + ms(2000));
        assert_eq!((st.jeopardy, st.state()), (false, HoldState::Safe));
        assert_eq!(*told.lock().unwrap(), vec![(t0 + ms(1000), HoldState::Jeopardy), (t0 + ms(1300), HoldState::Safe)]);
        assert!(!task.is_finished());
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn session_expired_is_loss_at_once() {
        let (_s, t0, task, told) = start(|| async {
            Err(CallError::Refused {
                status: 410,
                code: Code::SessionExpired.into(),
                message: String::new(),
                reason: None,
            })
        });
        assert_eq!(task.await.unwrap(), LossReason::SessionExpired);
        assert_eq!(Instant::now(), t0 + ms(1000), "at the first renewal, not at the deadline");
        assert!(told.lock().unwrap().is_empty(), "session_expired is loss, not jeopardy");
    }
}
