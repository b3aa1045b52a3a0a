package lockmesh

import (
	"context"
	"errors"
	"strconv"
	"time"
)

// CampaignOptions of Client.Campaign.
type CampaignOptions struct {
	// Value is proclaimed with the leadership (nil: none).
	Value *string
	// TryOnce: one try (contended if someone leads); otherwise the campaign waits
	// until leader, or until ctx ends (ctx's error; a grant committing as it ends
	// is released).
	TryOnce bool
	// Class, as LockOptions.Class.
	Class string
	// Round is the longest wait of one request (default 30 s, the tier's default
	// maximum wait); a longer campaign sends the next request when one ends.
	Round time.Duration
}

// Leadership is a counted hold of an election: a Guard (token, proof,
// CanStartWork, Context, ...) plus Proclaim, Resign and Observe.
type Leadership struct {
	*Guard
}

// Campaign campaigns for the election key (a class with max_holders 1 that fails
// closed) until leader. It pins the session it starts on and stops with
// session_lost when that session is lost: it never opens another session to carry
// on. Campaigning again for an election this process leads counts the leadership
// once more and proclaims the new value, if one is given.
func (c *Client) Campaign(ctx context.Context, key string, opts CampaignOptions) (*Leadership, error) {
	if err := checkKey(key); err != nil {
		return nil, err
	}
	round := opts.Round
	if round <= 0 {
		round = 30 * time.Second
	}
	s, err := c.sessionFor(ctx, key, opts.Class)
	if err != nil {
		return nil, err
	}
	for {
		wait := round
		if opts.TryOnce {
			wait = 0
		} else if dl, ok := ctx.Deadline(); ok {
			wait = max(min(wait, time.Until(dl)), 0)
		}
		g, err := c.take(ctx, key, LockOptions{Wait: wait, Class: opts.Class}, &campaignAsk{value: opts.Value}, s)
		if err == nil {
			return &Leadership{g}, nil
		}
		var e *Error
		if opts.TryOnce || ctx.Err() != nil || !errors.As(err, &e) || e.Code != "contended" || e.Reason == "acquiring_here" {
			return nil, err
		}
	}
}

// Proclaim replaces the leader's value under this leadership's token, retried
// while the answer is lost; not_holder means the leadership ended.
func (l *Leadership) Proclaim(ctx context.Context, value string) error { return l.proclaim(ctx, value) }

// Resign gives the leadership up (the election route's release); the next
// campaigner leads.
func (l *Leadership) Resign() error { return l.Unlock() }

// Observe returns an observer that also sees this leadership's own token.
func (l *Leadership) Observe() *Observer {
	return &Observer{c: l.c, key: l.g.key, session: l.g.session, poll: 30 * time.Second}
}

// LeaderInfo is who leads.
type LeaderInfo struct {
	Identity string
	Value    string
	SinceMS  uint64
	Token    uint64 // only through Leadership.Observe (the leader's own)
	You      bool
}

// Observation is one answer of an Observer.
type Observation struct {
	Leader  *LeaderInfo // nil: nobody leads
	Changed bool
	Gap     bool // the service could not resume: this is the state now
	Cursor  string
}

// Observer follows an election. Its first Next is the state now; each later one
// is the first change after the previous observation, however late it is called.
// An error leaves its cursor where it was: calling Next again misses nothing.
type Observer struct {
	c       *Client
	key     string
	session string
	cursor  string
	poll    time.Duration
}

// Observe returns an observer of the election key.
func (c *Client) Observe(key string) *Observer {
	return &Observer{c: c, key: key, poll: 30 * time.Second}
}

// ResumeFrom sets the observation point (another process's Observation.Cursor).
func (o *Observer) ResumeFrom(cursor string) { o.cursor = cursor }

// Poll sets the long poll of one request (default 30 s).
func (o *Observer) Poll(d time.Duration) { o.poll = d }

// Next waits for the next observation (or ctx).
func (o *Observer) Next(ctx context.Context) (Observation, error) {
	for {
		wait := o.poll
		if o.cursor == "" {
			wait = 0
		}
		e, err := o.c.api.observe(ctx, o.key, o.cursor, wait, o.session, wait+o.c.cfg.AcquireSlack)
		if err != nil {
			if ctx.Err() != nil {
				return Observation{}, ctx.Err()
			}
			return Observation{}, asCall(err).public()
		}
		first := o.cursor == ""
		o.cursor = e.Cursor
		if !first && !e.Changed {
			continue
		}
		ob := Observation{Changed: e.Changed, Gap: e.Gap, Cursor: e.Cursor}
		if e.Leader != nil {
			li := &LeaderInfo{Identity: e.Leader.Identity, SinceMS: e.Leader.SinceMS, You: e.Leader.You}
			if e.Leader.Value != nil {
				li.Value = *e.Leader.Value
			}
			if e.Leader.Token != nil {
				li.Token, _ = strconv.ParseUint(*e.Leader.Token, 10, 64)
			}
			ob.Leader = li
		}
		return ob, nil
	}
}
