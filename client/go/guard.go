package lockmesh

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"time"
)

func sortStrings(s []string) { slices.Sort(s) }

func strconvItoa(n int) string { return strconv.Itoa(n) }

// ErrReleased is the cause of a guard's context after Unlock.
var ErrReleased = errors.New("lockmesh: the guard was unlocked")

// Guard is one counted hold of a key. Hand Token (as x-lock-token) and Proof (as
// x-lock-proof) to every write the hold protects; check CanStartWork before each
// unit of work; stop when Context is done (the fence). Unlock once, typically by
// defer; a second Unlock does nothing.
type Guard struct {
	c      *Client
	s      *session
	g      grant
	resign bool // a leadership: released on the election route

	ctx    context.Context
	cancel context.CancelCauseFunc
	once   sync.Once
	err    error
}

func newGuard(c *Client, s *session, g grant, resign bool) *Guard {
	ctx, cancel := context.WithCancelCause(s.ctx)
	return &Guard{c: c, s: s, g: g, resign: resign, ctx: ctx, cancel: cancel}
}

// Key is the key held.
func (g *Guard) Key() string { return g.g.key }

// Token is the grant's fencing token: send it with every write (x-lock-token). A
// capability: never log it.
func (g *Guard) Token() uint64 { return g.g.token }

// Proof is the grant's signed proof for a resource behind fence-proxy
// (x-lock-proof); "" when the service signs none, and for a hold adopted from a
// hold listing. A credential like the token.
func (g *Guard) Proof() string { return g.g.proof }

// Session is the session the hold is on.
func (g *Guard) Session() string { return g.g.session }

// Class is the key's class.
func (g *Guard) Class() string { return g.g.class }

// TTL is the session's TTL.
func (g *Guard) TTL() time.Duration { return g.s.ttl() }

// Epoch is the token's epoch.
func (g *Guard) Epoch() uint64 { return g.g.epoch }

// CanStartWork is false from the session's first failed keepalive (jeopardy)
// until a later one is acknowledged, and for good once the hold is lost or
// unlocked.
func (g *Guard) CanStartWork() bool { return g.ctx.Err() == nil && g.s.canStart() }

// State is StateSafe, StateJeopardy or StateLost.
func (g *Guard) State() HoldState {
	if g.ctx.Err() != nil {
		return StateLost
	}
	return g.s.state()
}

// Lost is the loss reason ("" while held).
func (g *Guard) Lost() LossReason { return g.s.lost() }

// RemainingTTL is the time left to the fence deadline: decline a unit of work
// that will not finish inside it. Zero once lost.
func (g *Guard) RemainingTTL() time.Duration {
	if g.ctx.Err() != nil {
		return 0
	}
	return g.s.remaining()
}

// Context is cancelled at the fence deadline (counted from the send time of the
// last acknowledged keepalive), at session_expired or an epoch change, and at
// Unlock. Pass it to the work the hold protects. Its cause (context.Cause) is an
// *Error with Code "session_lost" and the loss reason, or ErrReleased.
func (g *Guard) Context() context.Context { return g.ctx }

// Unlock gives up this guard. The last guard of a hold sends the release of
// exactly its grant (a stale release frees nothing), retried while its answer is
// lost until answered or the session is lost; nested guards send nothing. On a
// lost hold it returns session_lost (the hold is gone already).
func (g *Guard) Unlock() error {
	g.once.Do(func() {
		if r := g.s.lost(); r != "" {
			g.c.fence(g.s, r)
			g.cancel(ErrReleased)
			g.err = sessionLost(r)
			return
		}
		g.cancel(ErrReleased)
		g.c.mu.Lock()
		res, gr := g.c.ledger.exit(g.g.key, g.g.token)
		g.c.mu.Unlock()
		if res == exitRelease {
			g.err = g.c.releaseGrant(g.s, gr, g.resign)
		}
	})
	return g.err
}

func (g *Guard) proclaim(ctx context.Context, value string) error {
	backoff := 100 * time.Millisecond
	for {
		err := g.c.api.proclaim(ctx, g.g, value, g.c.cfg.RequestTimeout)
		if err == nil {
			return nil
		}
		ce := asCall(err)
		if ce.kind == callRefused {
			return ce.public()
		}
		if g.s.lost() != "" {
			return sessionLost(g.s.lost())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}
