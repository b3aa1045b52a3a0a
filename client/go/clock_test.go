package lockmesh

import (
	"testing"
	"time"
)

func TestDeadlineIsCountedFromTheSendTimeOfTheLastAcknowledgedKeepalive(t *testing.T) {
	t0 := time.Now()
	c := newClock(t0, 15*time.Second, time.Second)
	if got := c.deadline().Sub(t0); got != 14*time.Second {
		t.Fatalf("deadline %v after the open's send, want 14s", got)
	}
	sent := t0.Add(5 * time.Second)
	// Answered 1.8 s later: the deadline moves to the send + TTL - margin, not the answer.
	c.onAck(sent)
	if got := c.deadline().Sub(sent); got != 14*time.Second {
		t.Fatalf("deadline %v after the send, want 14s", got)
	}
	// An older ack arriving late never moves the deadline back.
	c.onAck(t0.Add(time.Second))
	if got := c.deadline().Sub(sent); got != 14*time.Second {
		t.Fatalf("deadline moved back: %v", got)
	}
	if c.nextInterval() != 5*time.Second {
		t.Fatalf("interval %v, want TTL/3", c.nextInterval())
	}
}

func TestCanStartTurnsFalseAtTheFirstFailureAndOnlyALaterAckRecovers(t *testing.T) {
	t0 := time.Now()
	c := newClock(t0, 6*time.Second, time.Second)
	if !c.canStart(t0) || c.state(t0) != StateSafe {
		t.Fatal("a fresh session is safe")
	}
	f := t0.Add(2 * time.Second)
	if !c.onFail(f) {
		t.Fatal("the first failure enters jeopardy")
	}
	if c.onFail(f.Add(600 * time.Millisecond)) {
		t.Fatal("jeopardy is entered once")
	}
	now := f.Add(time.Second)
	if c.canStart(now) || c.state(now) != StateJeopardy || !c.inJeopardy(now) {
		t.Fatal("no new work in jeopardy")
	}
	if c.nextInterval() != 600*time.Millisecond {
		t.Fatalf("retry interval %v, want TTL/10", c.nextInterval())
	}
	// An ack of a keepalive sent before the latest failure ends nothing.
	if c.onAck(f.Add(-time.Millisecond)) || c.canStart(now) {
		t.Fatal("an ack sent before the failure recovered")
	}
	if !c.onAck(f.Add(700*time.Millisecond)) || !c.canStart(now) {
		t.Fatal("an ack sent after the failure recovers")
	}
}

func TestTheFenceComesAtTheDeadlineOnceAndIsFinal(t *testing.T) {
	t0 := time.Now()
	c := newClock(t0, 3*time.Second, time.Second)
	c.onFail(t0.Add(time.Second))
	if c.check(t0.Add(1999 * time.Millisecond)) {
		t.Fatal("fenced before the deadline")
	}
	if !c.check(t0.Add(2 * time.Second)) {
		t.Fatal("not fenced at the deadline")
	}
	if c.check(t0.Add(3 * time.Second)) {
		t.Fatal("fenced twice")
	}
	later := t0.Add(2500 * time.Millisecond)
	if c.onAck(later) || c.canStart(later) || c.remaining(later) != 0 || c.state(later) != StateLost {
		t.Fatal("a lost session recovered")
	}
	if c.lostAt(later) != LossDeadline {
		t.Fatalf("reason %q", c.lostAt(later))
	}
}

func TestTheLedgerSendsOnlyTheOutermostAcquireAndTheFinalRelease(t *testing.T) {
	l := newLedger()
	if r, _ := l.enter("ns/a", "s1"); r != enterAcquire {
		t.Fatal("first enter acquires")
	}
	if r, _ := l.enter("ns/a", "s1"); r != enterBusy {
		t.Fatal("one acquire in flight")
	}
	g := grant{key: "ns/a", token: 7, session: "s1"}
	if !l.acquired(g) {
		t.Fatal("recorded")
	}
	for i := 0; i < 2; i++ {
		if r, ng := l.enter("ns/a", "s1"); r != enterNested || ng.token != 7 {
			t.Fatal("nested")
		}
	}
	if l.count("ns/a") != 3 {
		t.Fatalf("count %d", l.count("ns/a"))
	}
	for i := 0; i < 2; i++ {
		if r, _ := l.exit("ns/a", 7); r != exitNested {
			t.Fatal("nested exit sends nothing")
		}
	}
	if r, _ := l.exit("ns/a", 7); r != exitRelease {
		t.Fatal("the last exit releases")
	}
	if r, _ := l.enter("ns/a", "s1"); r != enterBusy {
		t.Fatal("no acquire before the release is answered")
	}
	if r, _ := l.exit("ns/a", 7); r != exitStale {
		t.Fatal("a double release sends nothing")
	}
	l.released("ns/a", 7)
	if r, _ := l.enter("ns/a", "s1"); r != enterAcquire {
		t.Fatal("acquired again after the release")
	}
}

func TestALostSessionForgetsItsHoldsAndUnknownOutcomesAreReleased(t *testing.T) {
	l := newLedger()
	for i, k := range []string{"ns/b", "ns/a"} {
		l.enter(k, "s1")
		l.acquired(grant{key: k, token: uint64(10 + i), session: "s1"})
	}
	l.enter("ns/c", "s2")
	l.acquired(grant{key: "ns/c", token: 20, session: "s2"})
	l.enter("ns/d", "s1")
	if got := l.forgetSession("s1"); len(got) != 2 || got[0] != "ns/a" || got[1] != "ns/b" {
		t.Fatalf("lost %v", got)
	}
	if l.acquired(grant{key: "ns/d", token: 30, session: "s1"}) {
		t.Fatal("a grant on a lost session is not handed out")
	}
	// An acquire whose answer was lost, found granted: released.
	l.enter("ns/e", "s2")
	g := grant{key: "ns/e", token: 40, session: "s2"}
	if !l.resolvedGranted(g) {
		t.Fatal("a resolved grant is released")
	}
	l.released("ns/e", 40)
	// Found by the late check while nothing accounts for it: released; held: left.
	if !l.adopt(g) {
		t.Fatal("adopted for release")
	}
	l.released("ns/e", 40)
	if l.adopt(grant{key: "ns/c", token: 20, session: "s2"}) {
		t.Fatal("a held key is left alone")
	}
}
