package lockmesh

import (
	"context"
	"sync"
	"time"
)

// session is one lease of one TTL carrying every hold of that TTL.
type session struct {
	id   string
	ttlS uint64

	mu     sync.Mutex
	clock  *keepaliveClock
	fenced bool // the loss was acted on (told once)

	// ctx is cancelled at the loss (cause: the *Error of the loss).
	ctx    context.Context
	cancel context.CancelCauseFunc
	lostCh chan struct{} // closed at the loss
	stop   chan struct{} // closed to end the keepalive goroutine
	once   sync.Once

	// telling serialises the jeopardy and fence callbacks of this session.
	telling sync.Mutex
}

func newSession(id string, ttlS uint64, sent time.Time, margin time.Duration) *session {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &session{
		id: id, ttlS: ttlS, clock: newClock(sent, time.Duration(ttlS)*time.Second, margin),
		ctx: ctx, cancel: cancel, lostCh: make(chan struct{}), stop: make(chan struct{}),
	}
}

func (s *session) ttl() time.Duration { return time.Duration(s.ttlS) * time.Second }

// lost is the loss reason now, the deadline applied ("" while held).
func (s *session) lost() LossReason {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clock.lostAt(time.Now())
}

func (s *session) canStart() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clock.canStart(time.Now())
}

func (s *session) state() HoldState {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clock.state(time.Now())
}

func (s *session) remaining() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clock.remaining(time.Now())
}

// markLost marks the loss once: true the first time.
func (s *session) markLost(r LossReason) bool {
	s.mu.Lock()
	s.clock.onLost(r)
	first := !s.fenced
	s.fenced = true
	s.mu.Unlock()
	if first {
		s.cancel(sessionLost(r))
		close(s.lostCh)
	}
	return first
}

func (s *session) stopKeepalive() { s.once.Do(func() { close(s.stop) }) }

// sleepOrLost sleeps d; false if the session was lost first.
func (s *session) sleepOrLost(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return s.lost() == ""
	case <-s.lostCh:
		return false
	}
}

// keepalive renews the session every TTL/3 (TTL/10 while in jeopardy) until it
// is lost or stopped. Each keepalive's timeout is min(request timeout, TTL/6); the
// fence deadline is watched while sleeping and while a keepalive is in flight.
func (c *Client) keepalive(s *session) {
	timeout := min(c.cfg.RequestTimeout, s.ttl()/6)
	for {
		s.mu.Lock()
		next, deadline := s.clock.nextInterval(), s.clock.deadline()
		s.mu.Unlock()
		dl := time.NewTimer(time.Until(deadline))
		sleep := time.NewTimer(next)
		select {
		case <-s.stop:
			dl.Stop()
			sleep.Stop()
			return
		case <-dl.C:
			sleep.Stop()
			c.deadlinePassed(s)
			return
		case <-sleep.C:
		}
		sent := time.Now()
		ctx, cancel := context.WithCancel(context.Background())
		res := make(chan error, 1)
		go func() { res <- c.api.keepalive(ctx, s.id, timeout) }()
		var err error
		select {
		case <-s.stop:
			cancel()
			dl.Stop()
			return
		case <-dl.C:
			cancel()
			c.deadlinePassed(s)
			return
		case err = <-res:
			cancel()
			dl.Stop()
		}
		now := time.Now()
		s.mu.Lock()
		late := s.clock.check(now) // an answer after the deadline changes nothing
		s.mu.Unlock()
		if late {
			c.fence(s, LossDeadline)
			return
		}
		if err == nil {
			at := sent
			if c.planted == "deadline_from_answer" {
				at = now // the planted fault: the deadline counted from the answer
			}
			s.mu.Lock()
			recovered := s.clock.onAck(at)
			s.mu.Unlock()
			if recovered {
				c.tellJeopardy(s, StateSafe)
			}
			continue
		}
		if ce := asCall(err); ce.kind == callRefused && ce.code == "session_expired" {
			c.fence(s, LossSessionExpired)
			return
		}
		s.mu.Lock()
		entered := s.clock.onFail(sent)
		s.mu.Unlock()
		if entered {
			c.tellJeopardy(s, StateJeopardy)
		}
	}
}

func (c *Client) deadlinePassed(s *session) {
	s.mu.Lock()
	s.clock.check(time.Now())
	s.mu.Unlock()
	c.fence(s, LossDeadline)
}
