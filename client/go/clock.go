package lockmesh

import "time"

// LossReason says why a session, and every hold on it, is lost.
type LossReason string

// Loss reasons (stable names, as the Rust SDK's).
const (
	LossDeadline       LossReason = "deadline"
	LossSessionExpired LossReason = "session_expired"
	LossEpochChanged   LossReason = "epoch_changed"
	LossClosed         LossReason = "closed"
)

// HoldState is where a session (and every hold on it) stands, from the holder's side.
type HoldState string

// Hold states.
const (
	StateSafe     HoldState = "safe"
	StateJeopardy HoldState = "jeopardy"
	StateLost     HoldState = "lost"
)

// keepaliveClock is the two-stage loss clock of one session (ADR-12), with no I/O
// and no clock reads: every method takes the instant it is about. Go's time.Time
// from time.Now carries a monotonic reading, which Sub and comparisons use.
//
// The deadline is counted from the send time of the last acknowledged keepalive:
// etcd restarts a lease's TTL when its leader receives the renewal, after it was
// sent, so a deadline counted from the send falls before the leader's expiry.
type keepaliveClock struct {
	ttl, margin time.Duration
	lastAckSent time.Time  // send time of the last acknowledged keepalive (or the open)
	failedSince *time.Time // send time of the latest failed keepalive not followed by an ack
	acked       uint64
	failed      uint64
	lost        LossReason // "" while not lost
}

func newClock(openedSentAt time.Time, ttl, margin time.Duration) *keepaliveClock {
	return &keepaliveClock{ttl: ttl, margin: margin, lastAckSent: openedSentAt}
}

// deadline is lastAckSent + TTL - margin.
func (c *keepaliveClock) deadline() time.Time {
	d := c.ttl - c.margin
	if d < 0 {
		d = 0
	}
	return c.lastAckSent.Add(d)
}

// nextInterval: TTL/3 while safe, TTL/10 (0.1-1 s) while in jeopardy.
func (c *keepaliveClock) nextInterval() time.Duration {
	if c.failedSince != nil {
		return min(max(c.ttl/10, 100*time.Millisecond), time.Second)
	}
	return c.ttl / 3
}

// onAck records an acknowledged keepalive sent at sentAt. It returns true when it
// ends jeopardy (recovery): only a keepalive sent at or after the latest failed
// one does.
func (c *keepaliveClock) onAck(sentAt time.Time) bool {
	if c.lost != "" {
		return false
	}
	c.acked++
	if sentAt.After(c.lastAckSent) {
		c.lastAckSent = sentAt
	}
	if c.failedSince != nil && !sentAt.Before(*c.failedSince) {
		c.failedSince = nil
		return true
	}
	return false
}

// onFail records a failed keepalive sent at sentAt; true when jeopardy starts now.
func (c *keepaliveClock) onFail(sentAt time.Time) bool {
	if c.lost != "" {
		return false
	}
	c.failed++
	entered := c.failedSince == nil
	if entered || sentAt.After(*c.failedSince) {
		t := sentAt
		c.failedSince = &t
	}
	return entered
}

// onLost marks the session lost; true only the first time.
func (c *keepaliveClock) onLost(r LossReason) bool {
	if c.lost != "" {
		return false
	}
	c.lost = r
	return true
}

// check applies the deadline at now: true if the session became lost just now.
func (c *keepaliveClock) check(now time.Time) bool {
	return !now.Before(c.deadline()) && c.onLost(LossDeadline)
}

func (c *keepaliveClock) canStart(now time.Time) bool {
	return c.lost == "" && c.failedSince == nil && now.Before(c.deadline())
}

func (c *keepaliveClock) inJeopardy(now time.Time) bool {
	return c.lost == "" && c.failedSince != nil && now.Before(c.deadline())
}

func (c *keepaliveClock) remaining(now time.Time) time.Duration {
	if c.lost != "" {
		return 0
	}
	if r := c.deadline().Sub(now); r > 0 {
		return r
	}
	return 0
}

// lostAt is the loss reason at now, the deadline applied ("" while held).
func (c *keepaliveClock) lostAt(now time.Time) LossReason {
	if c.lost != "" {
		return c.lost
	}
	if !now.Before(c.deadline()) {
		return LossDeadline
	}
	return ""
}

func (c *keepaliveClock) state(now time.Time) HoldState {
	switch {
	case c.lostAt(now) != "":
		return StateLost
	case c.failedSince != nil:
		return StateJeopardy
	default:
		return StateSafe
	}
}
