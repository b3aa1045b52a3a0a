package lockmesh

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

var (
	instanceOnce sync.Once
	instance     string
)

// InstanceID is this process's id, sent as x-lock-instance on every request:
// p<pid>-<64 random bits in hex>. A session opened with it can only be used by this
// process, and the service answers `leaked` instead of contention if this process
// holds a key under another session.
func InstanceID() string {
	instanceOnce.Do(func() {
		var b [8]byte
		_, _ = rand.Read(b[:])
		instance = fmt.Sprintf("p%d-%s", os.Getpid(), hex.EncodeToString(b[:]))
	})
	return instance
}

type api struct {
	http     *http.Client
	base     string
	instance string
}

func newAPI(cfg Config, instance string) (*api, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	u, err := url.Parse(cfg.Endpoint)
	if err != nil || u.Host == "" {
		return nil, configErr("endpoint", "not a URL")
	}
	src := &certSource{cfg: cfg}
	if _, _, err := src.load(time.Now()); err != nil {
		return nil, err
	}
	dialer := &net.Dialer{Timeout: cfg.RequestTimeout}
	tr := &http.Transport{
		TLSClientConfig:     src.tlsConfig(u.Hostname()),
		ForceAttemptHTTP2:   true,
		TLSHandshakeTimeout: cfg.RequestTimeout,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if cfg.Resolve != "" {
				addr = cfg.Resolve
			}
			return dialer.DialContext(ctx, network, addr)
		},
	}
	return &api{http: &http.Client{Transport: tr}, base: strings.TrimRight(cfg.Endpoint, "/"), instance: instance}, nil
}

type hdr [2]string

// call sends one request and decodes a 2xx answer into out, or classifies the
// failure: not sent (no request headers were written), refused (a lockmesh error
// body), or unknown (anything else after sending).
func (a *api) call(ctx context.Context, method, path string, hs []hdr, timeout time.Duration, out any) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var wrote atomic.Bool
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteHeaders: func() { wrote.Store(true) }})
	req, err := http.NewRequestWithContext(ctx, method, a.base+path, nil)
	if err != nil {
		return &callError{kind: callNotSent, message: "bad request URL"}
	}
	req.Header.Set("x-lock-instance", a.instance)
	for _, h := range hs {
		req.Header.Set(h[0], h[1])
	}
	resp, err := a.http.Do(req)
	if err != nil {
		if !wrote.Load() {
			return &callError{kind: callNotSent, message: path + ": not sent: " + scrub(err)}
		}
		return &callError{kind: callUnknown, message: path + ": " + scrub(err)}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return &callError{kind: callUnknown, message: path + ": reading the answer: " + scrub(err)}
	}
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		if err := json.Unmarshal(body, out); err != nil {
			// The decoder's message is not shown: it may quote a value.
			return &callError{kind: callUnknown, message: fmt.Sprintf("%s: status %d with an answer that is not its body", path, resp.StatusCode)}
		}
		return nil
	}
	var eb struct {
		Code    string `json:"code"`
		Message string `json:"message"`
		Reason  string `json:"reason"`
	}
	hasCode := resp.Header.Get("x-lockmesh-error") != ""
	if json.Unmarshal(body, &eb) == nil && eb.Code != "" && (hasCode || resp.StatusCode < 500) {
		return &callError{kind: callRefused, status: resp.StatusCode, code: eb.Code, message: eb.Message, reason: eb.Reason}
	}
	return &callError{kind: callUnknown, message: fmt.Sprintf("%s: status %d without a lockmesh error body", path, resp.StatusCode)}
}

// scrub keeps a transport error's text without the URL (the URL names no key, but
// errors.As would let a caller's wrapper print headers; keep it short and safe).
func scrub(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return err.Error()
}

type opened struct {
	Session string `json:"session"`
	TTLS    uint64 `json:"ttl_s"`
	Class   string `json:"class"`
}

func (a *api) openSession(ctx context.Context, key string, timeout time.Duration) (opened, error) {
	var o opened
	err := a.call(ctx, http.MethodPost, "/v1/sessions", []hdr{{"x-lock-key", key}}, timeout, &o)
	if err == nil && (o.Session == "" || o.TTLS == 0) {
		err = &callError{kind: callUnknown, message: "session answer without a session or ttl"}
	}
	return o, err
}

// keepalive is acknowledged only when the answer names this session and a TTL
// above zero; anything else counts as a failed renewal, never as one that moves
// the deadline.
func (a *api) keepalive(ctx context.Context, session string, timeout time.Duration) error {
	var r opened
	if err := a.call(ctx, http.MethodPost, "/v1/sessions/keepalive", []hdr{{"x-lock-session", session}}, timeout, &r); err != nil {
		return err
	}
	return renewed(session, r)
}

func renewed(session string, r opened) error {
	if r.Session != session {
		return &callError{kind: callUnknown, message: "the keepalive answer names another session"}
	}
	if r.TTLS == 0 {
		return &callError{kind: callUnknown, message: "the keepalive answer renewed no ttl"}
	}
	return nil
}

type acquiredBody struct {
	Token        string  `json:"token"`
	Epoch        uint64  `json:"epoch"`
	Session      *string `json:"session"`
	TTLS         uint64  `json:"ttl_s"`
	Class        string  `json:"class"`
	Cluster      string  `json:"cluster"`
	Proof        *string `json:"proof"`
	Unprotected  bool    `json:"unprotected"`
	Grant        string  `json:"grant"`
	HonouredFrom *uint64 `json:"honoured_from"`
	Keys         []struct {
		Key   string  `json:"key"`
		Token string  `json:"token"`
		Proof *string `json:"proof"`
	} `json:"keys"`
}

const epochShift = 48

// acquire on session, or campaign (value != nil: proclaimed with the leadership).
func (a *api) acquire(ctx context.Context, key, session string, wait time.Duration, ask []hdr, campaign bool, value *string, timeout time.Duration) (grant, *uint64, error) {
	hs := []hdr{{"x-lock-key", key}, {"x-lock-session", session}, {"x-lock-wait-ms", strconv.FormatInt(wait.Milliseconds(), 10)}}
	hs = append(hs, ask...)
	path := "/v1/locks/acquire"
	if campaign {
		path = "/v1/elections/campaign"
		if value != nil {
			hs = append(hs, hdr{"x-lock-value", *value})
		}
	}
	var b acquiredBody
	if err := a.call(ctx, http.MethodPost, path, hs, timeout, &b); err != nil {
		return grant{}, nil, err
	}
	if b.Unprotected {
		// Token 0 fences nothing and the grant is on no session: hand it back.
		var r struct{}
		_ = a.call(context.Background(), http.MethodPost, "/v1/locks/release", []hdr{{"x-lock-key", key}, {"x-lock-grant", b.Grant}}, timeout, &r)
		return grant{}, nil, &callError{kind: callFailedOpen}
	}
	tok, err := strconv.ParseUint(b.Token, 10, 64)
	if err != nil || tok == 0 || b.Session == nil {
		return grant{}, nil, &callError{kind: callUnknown, message: "answer without a valid token or session"}
	}
	if *b.Session != session {
		return grant{}, nil, &callError{kind: callUnknown, message: "the grant names another session"}
	}
	g := grant{key: key, token: tok, session: session, ttlS: b.TTLS, class: b.Class, cluster: b.Cluster, epoch: tok >> epochShift}
	if b.Proof != nil {
		g.proof = *b.Proof
	}
	return g, b.HonouredFrom, nil
}

func (a *api) acquireAll(ctx context.Context, keys []string, session string, wait time.Duration, class string, timeout time.Duration) ([]grant, error) {
	hs := []hdr{{"x-lock-keys", strings.Join(keys, " ")}, {"x-lock-session", session}, {"x-lock-wait-ms", strconv.FormatInt(wait.Milliseconds(), 10)}}
	if class != "" {
		hs = append(hs, hdr{"x-lock-class", class})
	}
	var b acquiredBody
	if err := a.call(ctx, http.MethodPost, "/v1/locks/acquire-all", hs, timeout, &b); err != nil {
		return nil, err
	}
	if b.Session == nil || *b.Session != session {
		return nil, &callError{kind: callUnknown, message: "the grant names another session"}
	}
	out := make([]grant, 0, len(keys))
	for _, k := range keys {
		found := false
		for _, kb := range b.Keys {
			if kb.Key != k {
				continue
			}
			tok, err := strconv.ParseUint(kb.Token, 10, 64)
			if err != nil || tok == 0 {
				return nil, &callError{kind: callUnknown, message: "answer without a valid token"}
			}
			g := grant{key: k, token: tok, session: session, ttlS: b.TTLS, class: b.Class, cluster: b.Cluster, epoch: tok >> epochShift}
			if kb.Proof != nil {
				g.proof = *kb.Proof
			}
			out = append(out, g)
			found = true
		}
		if !found {
			return nil, &callError{kind: callUnknown, message: "answer without every key"}
		}
	}
	return out, nil
}

func (a *api) release(ctx context.Context, g grant, resign bool, timeout time.Duration) error {
	path := "/v1/locks/release"
	if resign {
		path = "/v1/elections/resign"
	}
	var r struct{}
	return a.call(ctx, http.MethodPost, path, []hdr{{"x-lock-key", g.key}, {"x-lock-token", strconv.FormatUint(g.token, 10)}, {"x-lock-session", g.session}}, timeout, &r)
}

func (a *api) proclaim(ctx context.Context, g grant, value string, timeout time.Duration) error {
	var r struct{}
	return a.call(ctx, http.MethodPost, "/v1/elections/proclaim", []hdr{{"x-lock-key", g.key}, {"x-lock-token", strconv.FormatUint(g.token, 10)}, {"x-lock-session", g.session}, {"x-lock-value", value}}, timeout, &r)
}

type electionBody struct {
	Leader *struct {
		Identity string  `json:"identity"`
		Value    *string `json:"value"`
		SinceMS  uint64  `json:"since_ms"`
		Token    *string `json:"token"`
		You      bool    `json:"you"`
	} `json:"leader"`
	Cursor  string `json:"cursor"`
	Changed bool   `json:"changed"`
	Gap     bool   `json:"gap"`
}

func (a *api) observe(ctx context.Context, key, after string, wait time.Duration, session string, timeout time.Duration) (electionBody, error) {
	hs := []hdr{{"x-lock-key", key}, {"x-lock-wait-ms", strconv.FormatInt(wait.Milliseconds(), 10)}}
	if after != "" {
		hs = append(hs, hdr{"x-lock-after", after})
	}
	if session != "" {
		hs = append(hs, hdr{"x-lock-session", session})
	}
	var e electionBody
	err := a.call(ctx, http.MethodGet, "/v1/elections", hs, timeout, &e)
	return e, err
}

func (a *api) holds(ctx context.Context, session string, timeout time.Duration) ([]grant, error) {
	var l struct {
		Holds []struct {
			Key     string `json:"key"`
			Token   string `json:"token"`
			Class   string `json:"class"`
			Cluster string `json:"cluster"`
		} `json:"holds"`
	}
	if err := a.call(ctx, http.MethodGet, "/v1/sessions/holds", []hdr{{"x-lock-session", session}}, timeout, &l); err != nil {
		return nil, err
	}
	out := make([]grant, 0, len(l.Holds))
	for _, h := range l.Holds {
		tok, err := strconv.ParseUint(h.Token, 10, 64)
		if err != nil {
			return nil, &callError{kind: callUnknown, message: "hold listing without a valid token"}
		}
		out = append(out, grant{key: h.Key, token: tok, session: session, class: h.Class, cluster: h.Cluster, epoch: tok >> epochShift})
	}
	return out, nil
}

func (a *api) close(ctx context.Context, session string, timeout time.Duration) error {
	var r struct{}
	return a.call(ctx, http.MethodPost, "/v1/sessions/close", []hdr{{"x-lock-session", session}}, timeout, &r)
}
