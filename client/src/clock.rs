//! The two-stage loss clock of one session (ADR-12), with no I/O and no clock
//! reads: every method takes the instant it is about.
//!
//! - **Jeopardy** (draining) starts at the first failed keepalive:
//!   [`KeepaliveClock::can_start`] is false from then until a later keepalive is
//!   acknowledged (*recovery*), which ends it. Work already started may finish.
//!   [`KeepaliveClock::on_fail`] and [`KeepaliveClock::on_ack`] say when it starts
//!   and ends, so the SDK can tell the holder ([`HoldState`]).
//! - **Fenced** starts at the deadline, `send time of the last acknowledged
//!   keepalive + TTL - margin`, or at once when the service says the session is gone
//!   or the epoch changed. It is final.
//!
//! Why the *send* time: etcd restarts a lease's TTL when its leader receives the
//! renewal, which is after the client sent it, so a deadline counted from the send
//! always falls before the leader's expiry for that renewal (and etcd may keep a
//! lease longer after a leader change, never shorter).

use std::time::Duration;

use tokio::time::Instant;

/// Why a session, and every hold on it, is considered lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossReason {
    /// The local deadline passed without an acknowledged keepalive.
    Deadline,
    /// The service answered `session_expired`: it no longer knows the session.
    SessionExpired,
    /// A grant or hold listing showed a newer epoch than the session's holds
    /// (a restore was fenced off): every older grant is void.
    EpochChanged,
    /// The client closed the session (shutdown).
    Closed,
}

/// Where a session (and every hold on it) stands, from the holder's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HoldState {
    /// Every keepalive since the last acknowledged one was acknowledged (or none
    /// was sent yet): new work may start.
    Safe,
    /// A keepalive failed since the last acknowledged one and the fence deadline has
    /// not passed: start no new work. An acknowledged keepalive returns to
    /// [`HoldState::Safe`]; the deadline makes it [`HoldState::Lost`].
    Jeopardy,
    /// Lost, and final.
    Lost(LossReason),
}

/// Keepalive bookkeeping of one session.
#[derive(Clone, Debug)]
pub struct KeepaliveClock {
    ttl: Duration,
    margin: Duration,
    /// Send time of the last acknowledged keepalive (or of the session open).
    last_ack_sent: Instant,
    /// Send time of the latest failed keepalive not followed by a later ack.
    failed_since: Option<Instant>,
    acked: u64,
    failed: u64,
    lost: Option<LossReason>,
}

/// One consistent reading of a [`KeepaliveClock`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockStatus {
    /// Whether new work may start now.
    pub can_start: bool,
    /// In jeopardy now: a keepalive failed since the last acknowledged one, and
    /// neither the deadline nor any other loss came yet.
    pub jeopardy: bool,
    /// Time left before the fence deadline (zero once lost).
    pub remaining: Duration,
    /// The fence deadline.
    pub deadline: Instant,
    /// Keepalives acknowledged so far.
    pub acked: u64,
    /// Keepalives that failed so far.
    pub failed: u64,
    /// Set once the session is lost.
    pub lost: Option<LossReason>,
}

// === impl LossReason ===

impl LossReason {
    /// A stable name, for logs and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::Deadline => "deadline",
            LossReason::SessionExpired => "session_expired",
            LossReason::EpochChanged => "epoch_changed",
            LossReason::Closed => "closed",
        }
    }
}

// === impl HoldState ===

impl HoldState {
    /// A stable name, for logs and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            HoldState::Safe => "safe",
            HoldState::Jeopardy => "jeopardy",
            HoldState::Lost(_) => "lost",
        }
    }
}

impl std::fmt::Display for HoldState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for LossReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

// === impl KeepaliveClock ===

impl KeepaliveClock {
    /// A clock for a session opened by a request sent at `opened_sent_at` (the lease
    /// was granted after that, so it counts as the first acknowledged keepalive).
    /// `margin` must be below `ttl` (checked where sessions are opened).
    pub fn new(opened_sent_at: Instant, ttl: Duration, margin: Duration) -> Self {
        Self { ttl, margin, last_ack_sent: opened_sent_at, failed_since: None, acked: 0, failed: 0, lost: None }
    }

    /// The session TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// `last acknowledged send time + TTL - margin`.
    pub fn deadline(&self) -> Instant {
        self.last_ack_sent + self.ttl.saturating_sub(self.margin)
    }

    /// How long to wait before the next keepalive: TTL/3 while healthy (the API's
    /// rate), faster while draining so a blip ends the drain soon.
    pub fn next_interval(&self) -> Duration {
        if self.failed_since.is_some() {
            (self.ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
        } else {
            self.ttl / 3
        }
    }

    /// A keepalive sent at `sent_at` was acknowledged. The deadline only moves
    /// forward; a lost session stays lost. Returns true if this ends jeopardy
    /// (recovery): the keepalive was sent at or after the latest failed one. An ack
    /// of a keepalive sent before that failure ends nothing.
    pub fn on_ack(&mut self, sent_at: Instant) -> bool {
        if self.lost.is_some() {
            return false;
        }
        self.acked += 1;
        if sent_at > self.last_ack_sent {
            self.last_ack_sent = sent_at;
        }
        if self.failed_since.is_some_and(|f| sent_at >= f) {
            self.failed_since = None;
            return true;
        }
        false
    }

    /// A keepalive sent at `sent_at` failed (no answer, or an answer other than
    /// success or `session_expired`): jeopardy (draining) starts. Returns true if it
    /// starts now (no failure was pending and the session is not lost).
    pub fn on_fail(&mut self, sent_at: Instant) -> bool {
        if self.lost.is_some() {
            return false;
        }
        self.failed += 1;
        let entered = self.failed_since.is_none();
        self.failed_since = Some(self.failed_since.map_or(sent_at, |f| f.max(sent_at)));
        entered
    }

    /// Marks the session lost; returns true only the first time (the fence runs
    /// once).
    pub fn on_lost(&mut self, reason: LossReason) -> bool {
        if self.lost.is_some() {
            return false;
        }
        self.lost = Some(reason);
        true
    }

    /// Applies the deadline at `now`: true if the session became lost just now.
    pub fn check(&mut self, now: Instant) -> bool {
        now >= self.deadline() && self.on_lost(LossReason::Deadline)
    }

    /// Whether the session is lost (without applying the deadline).
    pub fn lost(&self) -> Option<LossReason> {
        self.lost
    }

    /// Whether new work may start at `now`: not lost, no failed keepalive since
    /// the last acknowledged one, and before the deadline.
    pub fn can_start(&self, now: Instant) -> bool {
        self.lost.is_none() && self.failed_since.is_none() && now < self.deadline()
    }

    /// Whether the session is in jeopardy at `now`: a keepalive failed since the
    /// last acknowledged one, and it is neither lost nor past its deadline.
    pub fn in_jeopardy(&self, now: Instant) -> bool {
        self.lost.is_none() && self.failed_since.is_some() && now < self.deadline()
    }

    /// The state at `now` (the deadline applied, as [`KeepaliveClock::status`]).
    pub fn state(&self, now: Instant) -> HoldState {
        self.status(now).state()
    }

    /// Time left at `now` before the fence deadline; zero once lost.
    pub fn remaining(&self, now: Instant) -> Duration {
        if self.lost.is_some() {
            return Duration::ZERO;
        }
        self.deadline().saturating_duration_since(now)
    }

    /// Everything at once, at `now`.
    pub fn status(&self, now: Instant) -> ClockStatus {
        ClockStatus {
            can_start: self.can_start(now),
            jeopardy: self.in_jeopardy(now),
            remaining: self.remaining(now),
            deadline: self.deadline(),
            acked: self.acked,
            failed: self.failed,
            lost: self.lost.or_else(|| (now >= self.deadline()).then_some(LossReason::Deadline)),
        }
    }
}

// === impl ClockStatus ===

impl ClockStatus {
    /// The state this reading shows.
    pub fn state(&self) -> HoldState {
        match self.lost {
            Some(r) => HoldState::Lost(r),
            None if self.jeopardy => HoldState::Jeopardy,
            None => HoldState::Safe,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(15);
    const MARGIN: Duration = Duration::from_secs(1);

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[tokio::test(start_paused = true)]
    async fn deadline_counts_from_the_send_time_of_the_last_ack() {
        let t0 = Instant::now();
        let mut c = KeepaliveClock::new(t0, TTL, MARGIN);
        assert_eq!(c.deadline(), t0 + s(14));
        tokio::time::advance(s(5)).await;
        let sent = Instant::now();
        tokio::time::advance(s(2)).await; // a slow answer: the deadline ignores it
        c.on_ack(sent);
        assert_eq!(c.deadline(), sent + s(14));
        assert_eq!(c.remaining(Instant::now()), s(12));
        // An older ack arriving late never moves the deadline back.
        c.on_ack(t0 + s(1));
        assert_eq!(c.deadline(), sent + s(14));
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_failed_keepalive_stops_new_work_and_an_ack_resumes_it() {
        let t0 = Instant::now();
        let mut c = KeepaliveClock::new(t0, TTL, MARGIN);
        assert!(c.can_start(t0));
        assert_eq!(c.next_interval(), s(5));
        tokio::time::advance(s(5)).await;
        let f = Instant::now();
        c.on_fail(f);
        assert!(!c.can_start(f), "can_start must be false from the first failed keepalive");
        assert_eq!(c.next_interval(), s(1), "retries faster while draining");
        // Draining does not move the deadline: it still counts from t0.
        assert_eq!(c.remaining(f), s(9));
        // An ack of a keepalive sent before the failure does not end the drain.
        c.on_ack(t0 + s(1));
        assert!(!c.can_start(f));
        tokio::time::advance(s(1)).await;
        let ok = Instant::now();
        c.on_ack(ok);
        assert!(c.can_start(ok));
        assert_eq!(c.deadline(), ok + s(14));
        assert_eq!((c.status(ok).acked, c.status(ok).failed), (2, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn the_fence_fires_once_at_the_deadline_and_is_final() {
        let t0 = Instant::now();
        let mut c = KeepaliveClock::new(t0, TTL, MARGIN);
        c.on_fail(t0 + s(5));
        assert!(!c.check(t0 + s(13)));
        assert_eq!(c.status(t0 + s(13)).lost, None);
        assert!(c.check(t0 + s(14)), "the deadline is send + ttl - margin");
        assert!(!c.check(t0 + s(15)), "the fence runs once");
        assert_eq!(c.lost(), Some(LossReason::Deadline));
        c.on_ack(t0 + s(14));
        assert_eq!(c.deadline(), t0 + s(14), "no ack revives a lost session");
        assert_eq!(c.remaining(t0), Duration::ZERO);
        assert!(!c.can_start(t0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_service_forgetting_the_session_is_loss_at_once() {
        let t0 = Instant::now();
        let mut c = KeepaliveClock::new(t0, TTL, MARGIN);
        assert!(c.on_lost(LossReason::SessionExpired));
        assert!(!c.on_lost(LossReason::EpochChanged));
        assert_eq!(c.lost(), Some(LossReason::SessionExpired));
        assert!(!c.can_start(t0));
        assert!(!c.check(t0 + s(100)));
    }

    #[tokio::test(start_paused = true)]
    async fn jeopardy_starts_at_the_first_failure_and_a_later_ack_ends_it_each_reported_once() {
        let t0 = Instant::now();
        let mut c = KeepaliveClock::new(t0, TTL, MARGIN);
        assert_eq!((c.state(t0), c.status(t0).jeopardy), (HoldState::Safe, false));
        assert!(!c.on_ack(t0 + s(1)), "an ack while safe ends nothing");
        assert!(c.on_fail(t0 + s(5)), "the first failure enters jeopardy");
        assert_eq!(c.state(t0 + s(6)), HoldState::Jeopardy);
        assert!(c.in_jeopardy(t0 + s(6)) && !c.can_start(t0 + s(6)));
        assert!(!c.on_fail(t0 + s(6)), "a second failure enters nothing");
        // An ack of a keepalive sent before the latest failure is no recovery.
        assert!(!c.on_ack(t0 + s(5)));
        assert_eq!(c.state(t0 + s(7)), HoldState::Jeopardy);
        assert!(c.on_ack(t0 + s(7)), "an ack sent after the failure recovers");
        let st = c.status(t0 + s(8));
        assert_eq!((st.state(), st.jeopardy, st.can_start), (HoldState::Safe, false, true));
        assert_eq!(st.deadline, t0 + s(7) + s(14));
        assert!(!c.on_ack(t0 + s(8)), "recovery is reported once");
        // A new failure is a new jeopardy.
        assert!(c.on_fail(t0 + s(9)));
        assert_eq!(c.state(t0 + s(9)), HoldState::Jeopardy);
    }

    #[tokio::test(start_paused = true)]
    async fn jeopardy_ends_in_loss_at_the_deadline_and_nothing_recovers_from_it() {
        let t0 = Instant::now();
        let mut c = KeepaliveClock::new(t0, TTL, MARGIN);
        assert!(c.on_fail(t0 + s(5)));
        // Jeopardy lasts from the failure to the deadline, t0 + ttl - margin.
        assert_eq!(c.state(t0 + s(14) - Duration::from_millis(1)), HoldState::Jeopardy);
        assert_eq!(c.state(t0 + s(14)), HoldState::Lost(LossReason::Deadline), "the deadline ends jeopardy");
        assert!(!c.in_jeopardy(t0 + s(14)));
        assert!(c.check(t0 + s(14)));
        assert!(!c.on_ack(t0 + s(13)), "no ack recovers a lost session");
        assert!(!c.on_fail(t0 + s(15)), "a lost session enters no jeopardy");
        assert_eq!(c.state(t0 + s(15)), HoldState::Lost(LossReason::Deadline));
        // The service forgetting a session in jeopardy: lost at once.
        let mut c = KeepaliveClock::new(t0, TTL, MARGIN);
        assert!(c.on_fail(t0 + s(5)));
        assert!(c.on_lost(LossReason::SessionExpired));
        assert_eq!(c.state(t0 + s(6)), HoldState::Lost(LossReason::SessionExpired));
        assert!(!c.status(t0 + s(6)).jeopardy);
    }

    #[tokio::test(start_paused = true)]
    async fn status_reports_the_deadline_as_lost_before_check_runs() {
        let t0 = Instant::now();
        let c = KeepaliveClock::new(t0, Duration::from_secs(3), MARGIN);
        let st = c.status(t0 + s(2));
        assert_eq!((st.can_start, st.remaining, st.lost), (false, Duration::ZERO, Some(LossReason::Deadline)));
    }
}
