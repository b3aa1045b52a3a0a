package lockmesh

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"
)

// tier is a fake lock tier behind mTLS (httptest): sessions, keepalives, acquires,
// releases and the hold listing, with knobs to fail or delay answers.
type tier struct {
	t   *testing.T
	srv *httptest.Server
	dir string

	mu           sync.Mutex
	ttlS         uint64
	nextRev      uint64
	holds        map[string]map[string]uint64 // session -> key -> token
	acquires     int
	releases     int
	keepalives   int
	failKA       bool     // keepalives answer 503 unavailable
	expireKA     bool     // keepalives answer 410 session_expired
	hangAcquire  bool     // grant, then never answer
	acquireCode  string   // refuse acquires with this code
	releaseCodes []string // refuse the next releases with these codes, in turn
	unprotected  bool     // answer acquires with an unprotected grant
	relByGrant   int
	lastInstance string
	kaDelay      time.Duration // keepalive answers come this much after arrival
	kaArrived    []time.Time
}

func newTier(t *testing.T, ttlS uint64) *tier {
	t.Helper()
	tr := &tier{t: t, ttlS: ttlS, nextRev: 1, holds: map[string]map[string]uint64{}, dir: t.TempDir()}
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test ca"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	leaf := func(serial int64, server bool) tls.Certificate {
		k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature}
		if server {
			tmpl.DNSNames = []string{"localhost"}
			tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		} else {
			u, _ := url.Parse("spiffe://lockmesh.local/ns/payments/sa/test")
			tmpl.URIs = []*url.URL{u}
			tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kd, _ := x509.MarshalECPrivateKey(k)
		if !server {
			write(t, filepath.Join(tr.dir, "cert.pem"), "CERTIFICATE", der)
			write(t, filepath.Join(tr.dir, "key.pem"), "EC PRIVATE KEY", kd)
		}
		return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: k}
	}
	write(t, filepath.Join(tr.dir, "ca.pem"), "CERTIFICATE", caDER)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	tr.srv = httptest.NewUnstartedServer(http.HandlerFunc(tr.serve))
	tr.srv.EnableHTTP2 = true
	tr.srv.TLS = &tls.Config{Certificates: []tls.Certificate{leaf(2, true)}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool}
	leaf(3, false)
	tr.srv.StartTLS()
	t.Cleanup(tr.srv.Close)
	return tr
}

func write(t *testing.T, path, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func (tr *tier) config() Config {
	_, port, _ := net.SplitHostPort(tr.srv.Listener.Addr().String())
	c := NewConfig("https://localhost:"+port, filepath.Join(tr.dir, "ca.pem"), filepath.Join(tr.dir, "cert.pem"), filepath.Join(tr.dir, "key.pem"))
	c.Resolve = tr.srv.Listener.Addr().String()
	c.RequestTimeout = 500 * time.Millisecond
	c.AcquireSlack = 300 * time.Millisecond
	c.TierRequestTimeout = 0
	return c
}

func refuse(w http.ResponseWriter, status int, code string) {
	w.Header().Set("x-lockmesh-error", code)
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"code": code, "message": "test"})
}

func (tr *tier) serve(w http.ResponseWriter, r *http.Request) {
	if len(r.TLS.PeerCertificates) == 0 {
		refuse(w, 401, "unauthenticated")
		return
	}
	tr.mu.Lock()
	tr.lastInstance = r.Header.Get("x-lock-instance")
	sid := r.Header.Get("x-lock-session")
	key := r.Header.Get("x-lock-key")
	answer := func(v any) { tr.mu.Unlock(); _ = json.NewEncoder(w).Encode(v) }
	switch r.URL.Path {
	case "/v1/sessions":
		sid = fmt.Sprintf("%016x", len(tr.holds)+1)
		tr.holds[sid] = map[string]uint64{}
		answer(map[string]any{"session": sid, "ttl_s": tr.ttlS, "class": "default"})
	case "/v1/sessions/keepalive":
		tr.keepalives++
		tr.kaArrived = append(tr.kaArrived, time.Now())
		if d := tr.kaDelay; d > 0 {
			tr.mu.Unlock()
			time.Sleep(d)
			tr.mu.Lock()
		}
		switch {
		case tr.expireKA:
			tr.mu.Unlock()
			refuse(w, 410, "session_expired")
		case tr.failKA:
			tr.mu.Unlock()
			refuse(w, 503, "unavailable")
		default:
			answer(map[string]any{"session": sid, "ttl_s": tr.ttlS})
		}
	case "/v1/locks/acquire":
		tr.acquires++
		if tr.acquireCode != "" {
			code := tr.acquireCode
			tr.mu.Unlock()
			refuse(w, 409, code)
			return
		}
		if tr.unprotected {
			answer(map[string]any{"token": "0", "epoch": 1, "session": nil, "ttl_s": 20, "class": "batch", "unprotected": true, "grant": "5f0c2b7e91d4a8c3e07b6a5d4c3b2a19"})
			return
		}
		tok := uint64(1)<<48 + tr.nextRev
		tr.nextRev++
		tr.holds[sid][key] = tok
		if tr.hangAcquire {
			tr.mu.Unlock()
			<-r.Context().Done()
			return
		}
		answer(map[string]any{"token": strconv.FormatUint(tok, 10), "epoch": 1, "session": sid, "ttl_s": tr.ttlS, "class": "default", "proof": "p", "unprotected": false})
	case "/v1/locks/release":
		tr.releases++
		if len(tr.releaseCodes) > 0 {
			code := tr.releaseCodes[0]
			tr.releaseCodes = tr.releaseCodes[1:]
			tr.mu.Unlock()
			refuse(w, 503, code)
			return
		}
		if r.Header.Get("x-lock-grant") != "" {
			tr.relByGrant++
			answer(map[string]any{"released": true, "unprotected": true})
			return
		}
		tok, _ := strconv.ParseUint(r.Header.Get("x-lock-token"), 10, 64)
		if tr.holds[sid][key] != tok || tok == 0 {
			tr.mu.Unlock()
			refuse(w, 409, "not_holder")
			return
		}
		delete(tr.holds[sid], key)
		answer(map[string]any{"released": true})
	case "/v1/sessions/holds":
		var hs []map[string]any
		for k, tok := range tr.holds[sid] {
			hs = append(hs, map[string]any{"key": k, "token": strconv.FormatUint(tok, 10), "epoch": 1, "class": "default"})
		}
		answer(map[string]any{"session": sid, "holds": hs})
	case "/v1/sessions/close":
		delete(tr.holds, sid)
		answer(map[string]any{"closed": true})
	default:
		tr.mu.Unlock()
		refuse(w, 404, "not_found")
	}
}

func (tr *tier) held(key string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	n := 0
	for _, hs := range tr.holds {
		if _, ok := hs[key]; ok {
			n++
		}
	}
	return n
}

type fences struct {
	mu sync.Mutex
	ev []FenceEvent
	j  []JeopardyEvent
}

func (f *fences) fence(e FenceEvent)       { f.mu.Lock(); f.ev = append(f.ev, e); f.mu.Unlock() }
func (f *fences) jeopardy(e JeopardyEvent) { f.mu.Lock(); f.j = append(f.j, e); f.mu.Unlock() }
func (f *fences) get() ([]FenceEvent, []JeopardyEvent) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]FenceEvent(nil), f.ev...), append([]JeopardyEvent(nil), f.j...)
}

func newClient(t *testing.T, cfg Config) (*Client, *fences) {
	t.Helper()
	f := &fences{}
	c, err := New(cfg, f.fence, WithJeopardy(f.jeopardy))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Shutdown(context.Background()) })
	return c, f
}

func eventually(t *testing.T, within time.Duration, what string, ok func() bool) {
	t.Helper()
	end := time.Now().Add(within)
	for !ok() {
		if time.Now().After(end) {
			t.Fatalf("not within %v: %s", within, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestNestedAcquiresReachTheServiceOnceAndTheLastUnlockReleases(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 15)
	c, _ := newClient(t, tr.config())
	ctx := context.Background()
	g1, err := c.Lock(ctx, "payments/a", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	g2, err := c.Lock(ctx, "payments/a", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if g1.Token() != g2.Token() || g1.Proof() != "p" || !g1.CanStartWork() || g1.TTL() != 15*time.Second {
		t.Fatal("one grant for both guards")
	}
	if c.Held()["payments/a"] != 2 || tr.acquires != 1 {
		t.Fatalf("held %v, acquires %d", c.Held(), tr.acquires)
	}
	if err := g2.Unlock(); err != nil || tr.releases != 0 || g1.Context().Err() != nil {
		t.Fatalf("a nested unlock sent a release (%v, %d)", err, tr.releases)
	}
	if g2.Context().Err() == nil || !errors.Is(context.Cause(g2.Context()), ErrReleased) {
		t.Fatal("an unlocked guard's context ends")
	}
	if err := g1.Unlock(); err != nil || tr.releases != 1 || tr.held("payments/a") != 0 {
		t.Fatalf("the last unlock releases (%v, %d)", err, tr.releases)
	}
	if err := g1.Unlock(); err != nil || tr.releases != 1 {
		t.Fatal("a second unlock sends nothing")
	}
	if tr.lastInstance != InstanceID() || InstanceID() == "" {
		t.Fatal("every request carries the instance id")
	}
}

func TestAFailedKeepaliveStopsNewWorkAndTheFenceCancelsTheContextAtTheDeadline(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 3) // keepalive every 1 s; deadline 2 s after the last acknowledged send
	cfg := tr.config()
	c, f := newClient(t, cfg)
	g, err := c.Lock(context.Background(), "short/a", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	tr.failKA = true
	tr.mu.Unlock()
	start := time.Now()
	eventually(t, 3*time.Second, "jeopardy told", func() bool { _, j := f.get(); return len(j) == 1 })
	if g.CanStartWork() || g.State() != StateJeopardy {
		t.Fatal("no new work in jeopardy")
	}
	if _, err := c.Lock(context.Background(), "short/b", LockOptions{}); !errors.Is(err, ErrDraining) {
		t.Fatalf("a lock on a draining session: %v", err)
	}
	select {
	case <-g.Context().Done():
	case <-time.After(4 * time.Second):
		t.Fatal("the fence did not cancel the guard's context")
	}
	if el := time.Since(start); el > 2500*time.Millisecond {
		t.Fatalf("fenced %v after the cut, past TTL - margin", el)
	}
	var e *Error
	if !errors.As(context.Cause(g.Context()), &e) || e.Code != "session_lost" || e.Reason != "deadline" {
		t.Fatalf("cause %v", context.Cause(g.Context()))
	}
	// The context is cancelled first (work stops at once), then the callback runs.
	eventually(t, time.Second, "the fence callback", func() bool { ev, _ := f.get(); return len(ev) == 1 })
	ev, j := f.get()
	if len(ev) != 1 || ev[0].Reason != LossDeadline || len(ev[0].Keys) != 1 || len(j) != 1 || j[0].State != StateJeopardy {
		t.Fatalf("fence %+v, jeopardy %+v", ev, j)
	}
	if g.CanStartWork() || g.RemainingTTL() != 0 || g.State() != StateLost {
		t.Fatal("a fenced guard is lost")
	}
	if err := g.Unlock(); !errors.Is(err, ErrSessionLost) {
		t.Fatalf("unlock of a lost hold: %v", err)
	}
}

func TestAJeopardyEndsWithRecovery(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 6)
	c, f := newClient(t, tr.config())
	g, err := c.Lock(context.Background(), "payments/j", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	tr.failKA = true
	tr.mu.Unlock()
	eventually(t, 4*time.Second, "jeopardy", func() bool { _, j := f.get(); return len(j) == 1 })
	tr.mu.Lock()
	tr.failKA = false
	tr.mu.Unlock()
	eventually(t, 2*time.Second, "recovery", func() bool { _, j := f.get(); return len(j) == 2 })
	_, j := f.get()
	if j[1].State != StateSafe || !g.CanStartWork() {
		t.Fatal("recovered")
	}
	if ev, _ := f.get(); len(ev) != 0 {
		t.Fatal("no fence after a recovery")
	}
}

func TestSessionExpiredFencesAtOnce(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 3)
	c, f := newClient(t, tr.config())
	g, err := c.Lock(context.Background(), "short/x", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	tr.expireKA = true
	tr.mu.Unlock()
	<-g.Context().Done()
	eventually(t, time.Second, "the fence callback", func() bool { ev, _ := f.get(); return len(ev) == 1 })
	ev, j := f.get()
	if len(ev) != 1 || ev[0].Reason != LossSessionExpired || len(j) != 0 {
		t.Fatalf("fence %+v jeopardy %+v", ev, j)
	}
}

func TestALostAnswerIsOutcomeUnknownAndTheGrantIsReleased(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 15)
	c, _ := newClient(t, tr.config())
	tr.mu.Lock()
	tr.hangAcquire = true
	tr.mu.Unlock()
	_, err := c.Lock(context.Background(), "payments/lost", LockOptions{Timeout: 300 * time.Millisecond})
	if !errors.Is(err, ErrOutcomeUnknown) {
		t.Fatalf("lost answer: %v", err)
	}
	if tr.held("payments/lost") != 1 {
		t.Fatal("the tier granted it")
	}
	eventually(t, 3*time.Second, "the SDK released the grant it found", func() bool { return tr.held("payments/lost") == 0 })
	if c.Stats().HoldListings == 0 {
		t.Fatal("resolved from the hold listing")
	}
	tr.mu.Lock()
	tr.hangAcquire = false
	tr.mu.Unlock()
	eventually(t, 2*time.Second, "the key is free here again", func() bool { return len(c.Held()) == 0 })
	g, err := c.Lock(context.Background(), "payments/lost", LockOptions{Wait: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	_ = g.Unlock()
}

func TestACallerThatStopsWaitingLeavesNoHold(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 15)
	c, _ := newClient(t, tr.config())
	tr.mu.Lock()
	tr.hangAcquire = true
	tr.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := c.Lock(ctx, "payments/gone", LockOptions{Wait: 100 * time.Millisecond}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("%v", err)
	}
	eventually(t, 3*time.Second, "released", func() bool { return tr.held("payments/gone") == 0 && len(c.Held()) == 0 })
}

func TestARetryableRefusalOfAReleaseIsRetriedAndTheHoldReleased(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 15)
	c, _ := newClient(t, tr.config())
	g, err := c.Lock(context.Background(), "payments/rr", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	tr.releaseCodes = []string{"unavailable", "sealed"}
	tr.mu.Unlock()
	if err := g.Unlock(); err != nil {
		t.Fatalf("unlock: %v", err)
	}
	if tr.releases != 3 || tr.held("payments/rr") != 0 {
		t.Fatalf("releases %d, held %d: the hold was given up on", tr.releases, tr.held("payments/rr"))
	}
	// A refusal not worth retrying is answered at once.
	g, err = c.Lock(context.Background(), "payments/rr", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	tr.releaseCodes = []string{"denied"}
	tr.mu.Unlock()
	var e *Error
	if err := g.Unlock(); !errors.As(err, &e) || e.Code != "denied" || tr.releases != 4 {
		t.Fatalf("denied: %v after %d releases", err, tr.releases)
	}
}

func TestRefusalsKeepTheirStableCodes(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 15)
	c, _ := newClient(t, tr.config())
	for _, code := range []string{"leaked", "contended", "denied"} {
		tr.mu.Lock()
		tr.acquireCode = code
		tr.mu.Unlock()
		_, err := c.Lock(context.Background(), "payments/r", LockOptions{})
		var e *Error
		if !errors.As(err, &e) || e.Code != code {
			t.Fatalf("%s: %v", code, err)
		}
		if code == "leaked" && (!errors.Is(err, ErrLeaked) || e.Retryable()) {
			t.Fatal("leaked is a bug in the process, not retryable")
		}
	}
	if _, err := c.Lock(context.Background(), "payments/r", LockOptions{Permits: 2, Mode: Shared}); !errors.Is(err, ErrConfig) {
		t.Fatalf("permits and mode: %v", err)
	}
	if _, err := c.LockAll(context.Background(), []string{"payments/r"}, LockOptions{}); !errors.Is(err, ErrConfig) {
		t.Fatalf("one key: %v", err)
	}
}

func TestAnUnprotectedGrantIsReleasedAndRefusedFailedOpen(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 15)
	c, _ := newClient(t, tr.config())
	tr.mu.Lock()
	tr.unprotected = true
	tr.mu.Unlock()
	if _, err := c.Lock(context.Background(), "batch/u", LockOptions{}); !errors.Is(err, ErrFailedOpen) {
		t.Fatalf("%v", err)
	}
	if tr.relByGrant != 1 {
		t.Fatal("released by its grant id")
	}
}

func TestBadConfigIsRefusedWithTheConfigCode(t *testing.T) {
	t.Parallel()
	tr := newTier(t, 15)
	cfg := tr.config()
	cfg.Endpoint = "http://plain"
	if _, err := New(cfg, func(FenceEvent) {}); !errors.Is(err, ErrConfig) {
		t.Fatalf("%v", err)
	}
	if _, err := New(tr.config(), nil); !errors.Is(err, ErrConfig) {
		t.Fatal("the fence callback is required")
	}
	cfg = tr.config()
	cfg.Margin = 20 * time.Second
	c, _ := newClient(t, cfg)
	if _, err := c.Lock(context.Background(), "payments/m", LockOptions{}); !errors.Is(err, ErrConfig) {
		t.Fatalf("a margin above the TTL: %v", err)
	}
}

// deadlineOffset holds a 3 s key while keepalives are answered 400 ms after they
// arrive, and returns how far the session's fence deadline lies past the first
// keepalive's arrival + TTL - margin (about zero when counted from the send).
func deadlineOffset(t *testing.T, planted string) time.Duration {
	tr := newTier(t, 3)
	tr.kaDelay = 400 * time.Millisecond
	c, _ := newClient(t, tr.config())
	c.planted = planted
	g, err := c.Lock(context.Background(), "short/send", LockOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Unlock()
	var arrived time.Time
	eventually(t, 3*time.Second, "a keepalive acknowledged", func() bool {
		g.s.mu.Lock()
		acked := g.s.clock.acked
		g.s.mu.Unlock()
		tr.mu.Lock()
		defer tr.mu.Unlock()
		if acked >= 1 && len(tr.kaArrived) >= 1 {
			arrived = tr.kaArrived[0]
			return true
		}
		return false
	})
	g.s.mu.Lock()
	defer g.s.mu.Unlock()
	return g.s.clock.deadline().Sub(arrived.Add(3*time.Second - time.Second))
}

func TestTheKeepaliveLoopCountsTheDeadlineFromTheSend(t *testing.T) {
	t.Parallel()
	if off := deadlineOffset(t, ""); off > 100*time.Millisecond {
		t.Fatalf("the deadline lies %v past send + TTL - margin: counted from the answer", off)
	}
}

// The twin: the planted fault of the conformance suite (the deadline counted from
// the answer) is seen by the same measurement.
func TestThePlantedDeadlineFromTheAnswerIsSeen(t *testing.T) {
	t.Parallel()
	if off := deadlineOffset(t, "deadline_from_answer"); off < 300*time.Millisecond {
		t.Fatalf("the planted fault moved the deadline by only %v", off)
	}
}
