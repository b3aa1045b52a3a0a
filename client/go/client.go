package lockmesh

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// FenceEvent tells the holder that every hold of a session is gone (ADR-12):
// stop using their tokens. Keys are the keys held on it.
type FenceEvent struct {
	Session string
	Reason  LossReason
	Keys    []string
}

// JeopardyEvent tells a change of a session's state: StateJeopardy at its first
// failed keepalive, StateSafe at recovery. Remaining is the time to the fence
// deadline.
type JeopardyEvent struct {
	Session   string
	State     HoldState
	Remaining time.Duration
	Keys      []string
}

// LockMode is a read-write lock's side.
type LockMode string

// Modes of x-lock-mode.
const (
	Shared    LockMode = "shared"
	Exclusive LockMode = "exclusive"
)

// LockOptions of one acquire. The zero value tries once.
type LockOptions struct {
	// Wait is how long the acquire may wait for the key (0: try once). The
	// caller's context bounds it too.
	Wait time.Duration
	// Class, when set, makes the service refuse a key of another class and skips
	// the round trip that learns the key's TTL once the class's TTL is known.
	Class string
	// Permits takes k of the key's N slots in one grant (0: not asked).
	Permits int
	// Mode takes one slot (Shared) or all N (Exclusive). Not with Permits.
	Mode LockMode
	// Timeout is the acquire request's own timeout (default Wait + AcquireSlack);
	// past it the outcome is unknown and resolved.
	Timeout time.Duration
}

// Stats counts requests of each kind this client sent.
type Stats struct {
	SessionsOpened, Acquires, Releases, HoldListings uint64
}

// Option configures a Client.
type Option func(*Client)

// WithJeopardy sets the jeopardy callback. Like the fence callback it runs on the
// SDK's goroutine and must not block.
func WithJeopardy(f func(JeopardyEvent)) Option { return func(c *Client) { c.onJeopardy = f } }

// WithLogger sets the logger (default: slog.Default()). The SDK logs classes and
// codes only, never a key or a token.
func WithLogger(l *slog.Logger) Option { return func(c *Client) { c.log = l } }

// Client is one workload identity's client of the lock tier: one session per TTL,
// holds counted per key and process. Safe for concurrent use.
type Client struct {
	api        *api
	cfg        Config
	onFence    func(FenceEvent)
	onJeopardy func(JeopardyEvent)
	log        *slog.Logger
	planted    string

	opening sync.Mutex // one session open at a time

	mu       sync.Mutex
	sessions map[uint64]*session // by TTL (seconds)
	keyTTL   map[string]uint64
	classTTL map[string]uint64
	ledger   *ledger
	changed  chan struct{} // closed and replaced at every ledger change
	maxEpoch map[string]uint64

	sessionsOpened, acquires, releases, holdListings atomic.Uint64
}

// New builds a client. onFence is required (ADR-12): it runs once per lost
// session, on an SDK goroutine, and must not block.
func New(cfg Config, onFence func(FenceEvent), opts ...Option) (*Client, error) {
	if onFence == nil {
		return nil, configErr("onFence", "required: the holder must be told when its holds are gone")
	}
	a, err := newAPI(cfg, InstanceID())
	if err != nil {
		return nil, err
	}
	c := &Client{
		api: a, cfg: cfg, onFence: onFence, log: slog.Default(),
		sessions: map[uint64]*session{}, keyTTL: map[string]uint64{}, classTTL: map[string]uint64{},
		ledger: newLedger(), changed: make(chan struct{}), maxEpoch: map[string]uint64{},
		// A planted fault of the conformance suite (client/conformance): never set in
		// production; the suite shows it makes the scenario that must catch it fail.
		planted: os.Getenv("LOCKMESH_SDK_PLANTED"),
	}
	for _, o := range opts {
		o(c)
	}
	return c, nil
}

// notifyLocked wakes every waiter on a ledger change; c.mu is held.
func (c *Client) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

func checkKey(key string) error {
	if key == "" || len(key) > 512 || strings.ContainsAny(key, " \t\r\n") || strings.HasPrefix(key, "/") || !strings.Contains(key, "/") {
		return configErr("key", "must be namespace/name (docs/API.md, x-lock-key)")
	}
	return nil
}

func (o *LockOptions) shape() ([]hdr, error) {
	var hs []hdr
	if o.Class != "" {
		hs = append(hs, hdr{"x-lock-class", o.Class})
	}
	switch {
	case o.Permits != 0 && o.Mode != "":
		return nil, configErr("permits", "permits and mode cannot both be set (exclusive takes every slot)")
	case o.Permits != 0:
		if o.Permits < 1 || o.Permits > 64 {
			return nil, configErr("permits", "1 to 64")
		}
		hs = append(hs, hdr{"x-lock-permits", itoa(o.Permits)})
	case o.Mode != "":
		if o.Mode != Shared && o.Mode != Exclusive {
			return nil, configErr("mode", "shared or exclusive")
		}
		hs = append(hs, hdr{"x-lock-mode", string(o.Mode)})
	}
	if o.Wait < 0 {
		return nil, configErr("wait", "not negative")
	}
	return hs, nil
}

// Lock takes key, waiting up to opts.Wait (and no longer than ctx allows), and
// returns a guard of a definite grant. A key this process already holds returns
// another guard of the same grant and sends nothing (re-entrancy, ADR-13); the
// hold is released when its last guard is unlocked. Use it as
//
//	g, err := client.Lock(ctx, "payments/order-42", lockmesh.LockOptions{Wait: 5 * time.Second})
//	if err != nil { return err }
//	defer g.Unlock()
//
// If ctx ends first the acquire still completes in the background and a grant it
// makes is released at once. An answer that was lost returns ErrOutcomeUnknown
// and is resolved from the session's holds; calling Lock again is always safe.
func (c *Client) Lock(ctx context.Context, key string, opts LockOptions) (*Guard, error) {
	return c.take(ctx, key, opts, nil, nil)
}

// TryLock tries once: LockOptions.Wait is ignored.
func (c *Client) TryLock(ctx context.Context, key string, opts LockOptions) (*Guard, error) {
	opts.Wait = 0
	return c.take(ctx, key, opts, nil, nil)
}

type campaignAsk struct{ value *string }

func (c *Client) take(ctx context.Context, key string, opts LockOptions, camp *campaignAsk, pinned *session) (*Guard, error) {
	if err := checkKey(key); err != nil {
		return nil, err
	}
	ask, err := opts.shape()
	if err != nil {
		return nil, err
	}
	giveUp := time.Now().Add(opts.Wait)
	relearnt := false
	for {
		s := pinned
		if s == nil {
			if s, err = c.sessionFor(ctx, key, opts.Class); err != nil {
				return nil, err
			}
		}
		if r := s.lost(); r != "" {
			c.fence(s, r)
			if pinned != nil {
				return nil, sessionLost(r)
			}
			continue
		}
		if !s.canStart() {
			return nil, ErrDraining
		}
		c.mu.Lock()
		res, g := c.ledger.enter(key, s.id)
		changed := c.changed
		c.mu.Unlock()
		switch res {
		case enterNested:
			hs := c.sessionByID(g.session)
			if hs == nil {
				hs = s
			}
			gd := newGuard(c, hs, g, camp != nil)
			if camp != nil && camp.value != nil {
				if err := gd.proclaim(ctx, *camp.value); err != nil {
					_ = gd.Unlock()
					return nil, err
				}
			}
			return gd, nil
		case enterBusy:
			t := time.NewTimer(time.Until(giveUp))
			select {
			case <-changed:
				t.Stop()
				continue
			case <-t.C:
				return nil, contended("acquiring_here")
			case <-ctx.Done():
				t.Stop()
				return nil, ctx.Err()
			}
		}
		wait := max(time.Until(giveUp), 0)
		out := make(chan acquireResult, 1)
		timeout := opts.Timeout
		if timeout <= 0 {
			timeout = wait + c.cfg.AcquireSlack
		}
		go c.acquire(s, key, wait, timeout, ask, camp, out)
		select {
		case r := <-out:
			var e *Error
			if !relearnt && errors.As(r.err, &e) && e.Code == "session_class_mismatch" {
				relearnt = true
				c.forgetTTL(key, opts.Class)
				if pinned == nil {
					continue
				}
			}
			return r.guard, r.err
		case <-ctx.Done():
			// The caller stopped waiting: the acquire completes; a grant is released.
			go func() {
				if r := <-out; r.guard != nil {
					_ = r.guard.Unlock()
				}
			}()
			return nil, ctx.Err()
		}
	}
}

type acquireResult struct {
	guard *Guard
	err   error
}

// acquire runs one outermost acquire to its end, whether or not its caller still
// waits: a definite grant or refusal is handed over, a lost answer is resolved.
func (c *Client) acquire(s *session, key string, wait, timeout time.Duration, ask []hdr, camp *campaignAsk, out chan<- acquireResult) {
	sent := time.Now()
	c.acquires.Add(1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type answer struct {
		g   grant
		hf  *uint64
		err error
	}
	ans := make(chan answer, 1)
	go func() {
		var value *string
		if camp != nil {
			value = camp.value
		}
		g, hf, err := c.api.acquire(ctx, key, s.id, wait, ask, camp != nil, value, timeout)
		ans <- answer{g, hf, err}
	}()
	var a answer
	if camp != nil {
		// A campaign stops when its session is lost: the request is dropped (the
		// tier gives up the wait and undoes a grant committing as it leaves).
		select {
		case a = <-ans:
		case <-s.lostCh:
			cancel()
			r := s.lost()
			c.fence(s, r)
			c.mu.Lock()
			c.ledger.notAcquired(key, s.id)
			c.notifyLocked()
			c.mu.Unlock()
			out <- acquireResult{err: sessionLost(r)}
			return
		}
	} else {
		a = <-ans
	}
	if a.err == nil {
		g := a.g
		g.ttlS = s.ttlS
		c.observeEpoch(g.cluster, g.epoch, a.hf)
		c.mu.Lock()
		ok := c.ledger.acquired(g)
		c.notifyLocked()
		c.mu.Unlock()
		if ok {
			out <- acquireResult{guard: newGuard(c, s, g, camp != nil)}
		} else {
			r := s.lost()
			if r == "" {
				r = LossEpochChanged
			}
			out <- acquireResult{err: sessionLost(r)}
		}
		return
	}
	ce := asCall(a.err)
	if ce.kind == callUnknown {
		c.log.Warn("lockmesh: acquire answer lost: resolving from the session's holds")
		out <- acquireResult{err: ErrOutcomeUnknown}
		c.resolve(s, key, sent, wait, camp != nil)
		return
	}
	out <- acquireResult{err: c.refused(s, []string{key}, ce)}
}

func (c *Client) refused(s *session, keys []string, ce *callError) error {
	c.mu.Lock()
	for _, k := range keys {
		c.ledger.notAcquired(k, s.id)
	}
	c.notifyLocked()
	c.mu.Unlock()
	if ce.kind == callRefused && ce.code == "session_expired" {
		c.fence(s, LossSessionExpired)
		return sessionLost(LossSessionExpired)
	}
	return ce.public()
}

// resolve settles an acquire whose answer was lost: once the service can no
// longer grant it (send + wait + slack), the session's holds are listed and the
// key's grant, if there, is released; once more after the tier's own request
// timeout. If the session is lost first, nothing of it is held.
func (c *Client) resolve(s *session, key string, sent time.Time, wait time.Duration, resign bool) {
	first := sent.Add(wait + c.cfg.AcquireSlack)
	found, g := c.listAfter(s, key, first)
	c.mu.Lock()
	release := false
	switch found {
	case listedLost, listedAbsent:
		c.ledger.notAcquired(key, s.id)
	case listedPresent:
		release = c.ledger.resolvedGranted(g)
	}
	c.notifyLocked()
	c.mu.Unlock()
	if release {
		_ = c.releaseGrant(s, g, resign)
	}
	if found == listedLost {
		return
	}
	late := sent.Add(c.cfg.TierRequestTimeout + c.cfg.AcquireSlack)
	if !late.After(first) {
		return
	}
	if found, g := c.listAfter(s, key, late); found == listedPresent {
		c.mu.Lock()
		adopt := c.ledger.adopt(g)
		c.mu.Unlock()
		if adopt {
			_ = c.releaseGrant(s, g, resign)
		}
	}
}

type listed int

const (
	listedLost listed = iota
	listedAbsent
	listedPresent
)

func (c *Client) listAfter(s *session, key string, at time.Time) (listed, grant) {
	if !s.sleepOrLost(time.Until(at)) {
		return listedLost, grant{}
	}
	backoff := 200 * time.Millisecond
	for {
		c.holdListings.Add(1)
		holds, err := c.api.holds(context.Background(), s.id, c.cfg.RequestTimeout)
		if err == nil {
			for _, h := range holds {
				c.observeEpoch(h.cluster, h.epoch, nil)
			}
			for _, h := range holds {
				if h.key == key {
					h.ttlS = s.ttlS
					return listedPresent, h
				}
			}
			return listedAbsent, grant{}
		}
		if ce := asCall(err); ce.kind == callRefused && ce.code == "session_expired" {
			c.fence(s, LossSessionExpired)
			return listedLost, grant{}
		}
		if !s.sleepOrLost(backoff) {
			return listedLost, grant{}
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

// LockAll takes 2 to 16 keys of one class in one grant: every key or none
// (POST /v1/locks/acquire-all). It returns one guard per key, in the order given;
// each releases its own key. Waiting holds nothing, so callers whose key sets
// overlap cannot deadlock. A key this client holds or is acquiring is refused
// contended (acquiring_here): a multi-key grant is never nested into a hold.
func (c *Client) LockAll(ctx context.Context, keys []string, opts LockOptions) ([]*Guard, error) {
	if len(keys) < 2 || len(keys) > 16 {
		return nil, configErr("keys", "2 to 16 keys")
	}
	seen := map[string]bool{}
	for _, k := range keys {
		if err := checkKey(k); err != nil {
			return nil, err
		}
		if seen[k] {
			return nil, configErr("keys", "a key named twice")
		}
		seen[k] = true
	}
	if opts.Permits != 0 || opts.Mode != "" {
		return nil, configErr("permits", "a multi-key acquire takes one slot of each key")
	}
	var s *session
	for {
		var err error
		if s, err = c.sessionFor(ctx, keys[0], opts.Class); err != nil {
			return nil, err
		}
		if r := s.lost(); r != "" {
			c.fence(s, r)
			continue
		}
		break
	}
	if !s.canStart() {
		return nil, ErrDraining
	}
	c.mu.Lock()
	var entered []string
	for _, k := range keys {
		res, g := c.ledger.enter(k, s.id)
		if res == enterAcquire {
			entered = append(entered, k)
			continue
		}
		if res == enterNested {
			c.ledger.exit(k, g.token)
		}
		for _, e := range entered {
			c.ledger.notAcquired(e, s.id)
		}
		c.notifyLocked()
		c.mu.Unlock()
		return nil, contended("acquiring_here")
	}
	c.mu.Unlock()
	out := make(chan allResult, 1)
	go c.acquireAll(s, keys, opts, out)
	select {
	case r := <-out:
		return r.guards, r.err
	case <-ctx.Done():
		go func() {
			for _, g := range (<-out).guards {
				_ = g.Unlock()
			}
		}()
		return nil, ctx.Err()
	}
}

type allResult struct {
	guards []*Guard
	err    error
}

func (c *Client) acquireAll(s *session, keys []string, opts LockOptions, out chan<- allResult) {
	sent := time.Now()
	c.acquires.Add(1)
	timeout := opts.Timeout
	if timeout <= 0 {
		timeout = opts.Wait + c.cfg.AcquireSlack
	}
	grants, err := c.api.acquireAll(context.Background(), keys, s.id, opts.Wait, opts.Class, timeout)
	if err == nil {
		guards := make([]*Guard, 0, len(grants))
		lost := false
		for _, g := range grants {
			g.ttlS = s.ttlS
			c.observeEpoch(g.cluster, g.epoch, nil)
			c.mu.Lock()
			ok := c.ledger.acquired(g)
			c.mu.Unlock()
			if ok {
				guards = append(guards, newGuard(c, s, g, false))
			} else {
				lost = true
			}
		}
		c.mu.Lock()
		c.notifyLocked()
		c.mu.Unlock()
		if lost {
			r := s.lost()
			if r == "" {
				r = LossEpochChanged
			}
			out <- allResult{err: sessionLost(r)}
			return
		}
		out <- allResult{guards: guards}
		return
	}
	ce := asCall(err)
	if ce.kind == callUnknown {
		c.log.Warn("lockmesh: multi-key acquire answer lost: resolving from the session's holds")
		out <- allResult{err: ErrOutcomeUnknown}
		for _, k := range keys {
			c.resolve(s, k, sent, opts.Wait, false)
		}
		return
	}
	out <- allResult{err: c.refused(s, keys, ce)}
}

func (c *Client) liveSessionForKey(key, class string) *session {
	c.mu.Lock()
	defer c.mu.Unlock()
	ttl, ok := c.keyTTL[key]
	if !ok && class != "" {
		ttl, ok = c.classTTL[class]
	}
	if !ok {
		return nil
	}
	if s := c.sessions[ttl]; s != nil && s.lost() == "" {
		return s
	}
	return nil
}

// sessionFor returns the live session of key's TTL, opening one (which learns the
// TTL) when there is none.
func (c *Client) sessionFor(ctx context.Context, key, class string) (*session, error) {
	if s := c.liveSessionForKey(key, class); s != nil {
		return s, nil
	}
	c.opening.Lock()
	defer c.opening.Unlock()
	if s := c.liveSessionForKey(key, class); s != nil {
		return s, nil
	}
	sent := time.Now()
	c.sessionsOpened.Add(1)
	o, err := c.api.openSession(ctx, key, c.cfg.RequestTimeout)
	if err != nil {
		return nil, asCall(err).public()
	}
	if c.planted == "deadline_from_answer" {
		sent = time.Now()
	}
	c.mu.Lock()
	if len(c.keyTTL) >= 65536 {
		clear(c.keyTTL)
	}
	c.keyTTL[key] = o.TTLS
	if o.Class != "" {
		c.classTTL[o.Class] = o.TTLS
	}
	existing := c.sessions[o.TTLS]
	if existing != nil && existing.lost() != "" {
		existing = nil
	}
	c.mu.Unlock()
	if existing != nil || c.cfg.Margin >= time.Duration(o.TTLS)*time.Second {
		go func() { _ = c.api.close(context.Background(), o.Session, c.cfg.RequestTimeout) }()
		if existing != nil {
			return existing, nil
		}
		return nil, configErr("margin", "not below the session ttl of the key's class")
	}
	s := newSession(o.Session, o.TTLS, sent, c.cfg.Margin)
	c.mu.Lock()
	c.sessions[o.TTLS] = s
	c.mu.Unlock()
	go c.keepalive(s)
	return s, nil
}

func (c *Client) sessionByID(id string) *session {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.sessions {
		if s.id == id {
			return s
		}
	}
	return nil
}

func (c *Client) forgetTTL(key, class string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.keyTTL, key)
	if class != "" {
		delete(c.classTTL, class)
	}
}

// fence acts on a session's loss once: the ledger forgets its holds, every guard's
// context is cancelled, the fence callback runs, and the session is closed in the
// background (best effort).
func (c *Client) fence(s *session, r LossReason) {
	s.telling.Lock()
	defer s.telling.Unlock()
	if !s.markLost(r) {
		return
	}
	s.stopKeepalive()
	c.mu.Lock()
	if cur := c.sessions[s.ttlS]; cur == s {
		delete(c.sessions, s.ttlS)
	}
	keys := c.ledger.forgetSession(s.id)
	c.notifyLocked()
	c.mu.Unlock()
	c.log.Warn("lockmesh: session fenced", "reason", string(r), "holds", len(keys), "ttl_s", s.ttlS)
	c.onFence(FenceEvent{Session: s.id, Reason: r, Keys: keys})
	if r != LossSessionExpired {
		go func() { _ = c.api.close(context.Background(), s.id, c.cfg.RequestTimeout) }()
	}
}

func (c *Client) tellJeopardy(s *session, st HoldState) {
	s.telling.Lock()
	defer s.telling.Unlock()
	if s.lost() != "" {
		return
	}
	c.mu.Lock()
	keys := c.ledger.keysOn(s.id)
	c.mu.Unlock()
	rem := s.remaining()
	c.log.Info("lockmesh: session jeopardy changed", "state", string(st), "holds", len(keys), "ttl_s", s.ttlS, "remaining_ms", rem.Milliseconds())
	if c.onJeopardy != nil {
		c.onJeopardy(JeopardyEvent{Session: s.id, State: st, Remaining: rem, Keys: keys})
	}
}

// observeEpoch fences every session holding a grant of cluster older than the
// floor a newer epoch honours (a restore was fenced off).
func (c *Client) observeEpoch(cluster string, epoch uint64, honouredFrom *uint64) {
	c.mu.Lock()
	if prev, ok := c.maxEpoch[cluster]; ok && epoch <= prev {
		c.mu.Unlock()
		return
	}
	c.maxEpoch[cluster] = epoch
	floor := epoch
	if honouredFrom != nil && *honouredFrom <= epoch {
		floor = *honouredFrom
	}
	stale := c.ledger.sessionsBelowEpoch(cluster, floor)
	c.mu.Unlock()
	for _, id := range stale {
		if s := c.sessionByID(id); s != nil {
			c.fence(s, LossEpochChanged)
		}
	}
}

// releaseGrant sends the release of exactly this grant, retried with backoff
// while its answer is lost, until answered or the session is lost.
func (c *Client) releaseGrant(s *session, g grant, resign bool) error {
	defer func() {
		c.mu.Lock()
		c.ledger.released(g.key, g.token)
		c.notifyLocked()
		c.mu.Unlock()
	}()
	backoff := 100 * time.Millisecond
	for {
		c.releases.Add(1)
		err := c.api.release(context.Background(), g, resign, c.cfg.RequestTimeout)
		if err == nil {
			return nil
		}
		ce := asCall(err)
		if ce.kind == callRefused {
			if ce.code == "session_expired" {
				c.fence(s, LossSessionExpired)
				return ce.public()
			}
			// A refusal the service names as worth retrying (an arbiter cut from
			// etcd answers unavailable) is retried like an unanswered call, as
			// the Rust SDK does: given up, the hold would stay on the live session
			// while this client forgot it.
			if !releaseRetryable(ce.code) {
				return ce.public()
			}
		}
		if !s.sleepOrLost(backoff) {
			return sessionLost(s.lost())
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

// releaseRetryable is the service's list of refusals worth retrying
// (lockmesh_core::Code::retryable) that can answer a release.
func releaseRetryable(code string) bool {
	switch code {
	case "unavailable", "sealed", "draining", "rate_limited", "spool_full", "queue_full", "quota_exceeded",
		"capability_disabled", "contended":
		return true
	}
	return false
}

// Held lists the keys this client holds and their re-entrancy counts.
func (c *Client) Held() map[string]uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]uint32{}
	for k := range c.ledger.slots {
		if n := c.ledger.count(k); n > 0 {
			out[k] = n
		}
	}
	return out
}

// Stats counts the requests sent so far.
func (c *Client) Stats() Stats {
	return Stats{c.sessionsOpened.Load(), c.acquires.Load(), c.releases.Load(), c.holdListings.Load()}
}

// Instance is the x-lock-instance this client sends.
func (c *Client) Instance() string { return c.api.instance }

// Shutdown closes every session (each releases all its holds in one committed
// entry). Guards of them report LossClosed.
func (c *Client) Shutdown(ctx context.Context) {
	c.mu.Lock()
	ss := make([]*session, 0, len(c.sessions))
	for _, s := range c.sessions {
		ss = append(ss, s)
	}
	clear(c.sessions)
	c.mu.Unlock()
	for _, s := range ss {
		s.stopKeepalive()
		if s.markLost(LossClosed) {
			c.mu.Lock()
			c.ledger.forgetSession(s.id)
			c.notifyLocked()
			c.mu.Unlock()
			_ = c.api.close(ctx, s.id, c.cfg.RequestTimeout)
		}
	}
}

func itoa(n int) string {
	return strconvItoa(n)
}
