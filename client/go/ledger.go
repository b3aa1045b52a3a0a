package lockmesh

// grant is one hold the service made on one of this client's sessions.
type grant struct {
	key     string
	token   uint64
	session string
	ttlS    uint64
	class   string
	cluster string
	proof   string // "" when the service signs none
	epoch   uint64
}

type slotState int

const (
	slotAcquiring slotState = iota
	slotHeld
	slotReleasing
)

type slot struct {
	state   slotState
	session string // acquiring: the session asked on
	grant   grant  // held, releasing
	count   uint32 // held
}

type enterResult int

const (
	enterAcquire enterResult = iota // send an acquire
	enterNested                     // counted locally, nothing sent
	enterBusy                       // an acquire or release of the key is in flight
)

// ledger counts re-entrant holds per key and process (ADR-13): only the outermost
// acquire and the final release reach the service, one acquire of a key is in
// flight at a time, and a key is not acquired again until its release is answered.
// Not safe for concurrent use: the Client guards it with its mutex.
type ledger struct {
	slots map[string]*slot
}

func newLedger() *ledger { return &ledger{slots: map[string]*slot{}} }

func (l *ledger) enter(key, session string) (enterResult, grant) {
	s, ok := l.slots[key]
	if !ok {
		l.slots[key] = &slot{state: slotAcquiring, session: session}
		return enterAcquire, grant{}
	}
	if s.state == slotHeld {
		s.count++
		return enterNested, s.grant
	}
	return enterBusy, grant{}
}

// acquired records the grant of an acquire in flight on its session; false when
// the session was lost meanwhile (the grant is not handed out).
func (l *ledger) acquired(g grant) bool {
	s, ok := l.slots[g.key]
	if !ok || s.state != slotAcquiring || s.session != g.session {
		return false
	}
	l.slots[g.key] = &slot{state: slotHeld, grant: g, count: 1}
	return true
}

func (l *ledger) notAcquired(key, session string) {
	if s, ok := l.slots[key]; ok && s.state == slotAcquiring && s.session == session {
		delete(l.slots, key)
	}
}

// resolvedGranted: an acquire whose answer was lost turned out granted: release
// it (true) unless the slot moved on.
func (l *ledger) resolvedGranted(g grant) bool {
	s, ok := l.slots[g.key]
	if ok && s.state == slotAcquiring && s.session == g.session {
		l.slots[g.key] = &slot{state: slotReleasing, grant: g}
		return true
	}
	return false
}

// adopt: a late listing shows a hold of the key; release it (true) unless the
// key is accounted for here.
func (l *ledger) adopt(g grant) bool {
	if _, ok := l.slots[g.key]; ok {
		return false
	}
	l.slots[g.key] = &slot{state: slotReleasing, grant: g}
	return true
}

type exitResult int

const (
	exitStale   exitResult = iota // not held under this token: send nothing
	exitNested                    // still held by an outer guard
	exitRelease                   // the last guard: send the release
)

func (l *ledger) exit(key string, token uint64) (exitResult, grant) {
	s, ok := l.slots[key]
	if !ok || s.state != slotHeld || s.grant.token != token {
		return exitStale, grant{}
	}
	s.count--
	if s.count > 0 {
		return exitNested, grant{}
	}
	g := s.grant
	l.slots[key] = &slot{state: slotReleasing, grant: g}
	return exitRelease, g
}

func (l *ledger) released(key string, token uint64) {
	if s, ok := l.slots[key]; ok && s.state == slotReleasing && s.grant.token == token {
		delete(l.slots, key)
	}
}

// forgetSession drops every slot of a lost session; returns the held keys.
func (l *ledger) forgetSession(session string) []string {
	var lost []string
	for k, s := range l.slots {
		switch {
		case s.state == slotAcquiring && s.session == session:
			delete(l.slots, k)
		case s.state != slotAcquiring && s.grant.session == session:
			if s.state == slotHeld {
				lost = append(lost, k)
			}
			delete(l.slots, k)
		}
	}
	sortStrings(lost)
	return lost
}

// sessionsBelowEpoch names the sessions holding a grant of cluster older than epoch.
func (l *ledger) sessionsBelowEpoch(cluster string, epoch uint64) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range l.slots {
		if s.state != slotAcquiring && s.grant.cluster == cluster && s.grant.epoch < epoch && !seen[s.grant.session] {
			seen[s.grant.session] = true
			out = append(out, s.grant.session)
		}
	}
	sortStrings(out)
	return out
}

func (l *ledger) keysOn(session string) []string {
	var out []string
	for k, s := range l.slots {
		if s.state == slotHeld && s.grant.session == session {
			out = append(out, k)
		}
	}
	sortStrings(out)
	return out
}

func (l *ledger) count(key string) uint32 {
	if s, ok := l.slots[key]; ok && s.state == slotHeld {
		return s.count
	}
	return 0
}
