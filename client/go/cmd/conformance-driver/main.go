// Command conformance-driver is the Go SDK's driver of the SDK conformance suite
// (client/conformance/README.md): one JSON request per stdin line, one reply per
// request and unsolicited events on stdout. Each request runs in its own
// goroutine, so a waiting campaign blocks nothing else. It never prints a token or
// a key to stderr.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	lockmesh "github.com/lockmesh/lockmesh/client/go"
)

// hold is a named hold: the guards of one acquire, or a leadership.
type hold struct {
	guards []*lockmesh.Guard
	leader *lockmesh.Leadership
}

func (h *hold) first() *lockmesh.Guard {
	if h.leader != nil {
		return h.leader.Guard
	}
	return h.guards[0]
}

type driver struct {
	mu       sync.Mutex
	sessions map[string]*lockmesh.Client
	holds    map[string]*hold
	outMu    sync.Mutex
	out      *bufio.Writer
	start    time.Time
}

type fail struct{ code, message string }

func (f *fail) Error() string { return f.code + ": " + f.message }

func bad(format string, a ...any) error { return &fail{"bad_request", fmt.Sprintf(format, a...)} }

func unknown(what string) error { return &fail{"unknown_name", "no such " + what} }

func (d *driver) emit(v map[string]any) {
	b, _ := json.Marshal(v)
	d.outMu.Lock()
	defer d.outMu.Unlock()
	// A closed stdout means the runner is gone; nothing to tell.
	_, _ = d.out.Write(append(b, '\n'))
	_ = d.out.Flush()
}

func (d *driver) tMS() int64 { return time.Since(d.start).Milliseconds() }

type req map[string]any

func (r req) str(name string) (string, error) {
	if s, ok := r[name].(string); ok {
		return s, nil
	}
	return "", bad("missing string argument %s", name)
}

func (r req) ms(name string) (time.Duration, bool, error) {
	v, ok := r[name]
	if !ok || v == nil {
		return 0, false, nil
	}
	n, ok := v.(float64)
	if !ok || n < 0 || n != float64(int64(n)) {
		return 0, false, bad("%s: not ms", name)
	}
	return time.Duration(n) * time.Millisecond, true, nil
}

func (d *driver) client(r req) (*lockmesh.Client, error) {
	name, err := r.str("session")
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if c := d.sessions[name]; c != nil {
		return c, nil
	}
	return nil, unknown("session")
}

func (d *driver) takeHold(r req) (string, *hold, error) {
	name, err := r.str("hold")
	if err != nil {
		return "", nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	h := d.holds[name]
	if h == nil {
		return "", nil, unknown("hold")
	}
	delete(d.holds, name)
	return name, h, nil
}

func (d *driver) putHold(name string, h *hold) {
	if name == "" {
		return
	}
	d.mu.Lock()
	d.holds[name] = h
	d.mu.Unlock()
}

func (d *driver) openSession(r req) (map[string]any, error) {
	name, err := r.str("session")
	if err != nil {
		return nil, err
	}
	env := func(k string) (string, error) {
		if v := os.Getenv(k); v != "" {
			return v, nil
		}
		return "", &fail{"config", k + " is not set"}
	}
	var vals [4]string
	for i, k := range []string{"LOCKMESH_ENDPOINT", "LOCKMESH_CA", "LOCKMESH_CERT", "LOCKMESH_CERT_KEY"} {
		if vals[i], err = env(k); err != nil {
			return nil, err
		}
	}
	cfg := lockmesh.NewConfig(vals[0], vals[1], vals[2], vals[3])
	cfg.Resolve = os.Getenv("LOCKMESH_RESOLVE")
	for name, dst := range map[string]*time.Duration{"margin_ms": &cfg.Margin, "acquire_slack_ms": &cfg.AcquireSlack, "request_timeout_ms": &cfg.RequestTimeout} {
		v, ok, err := r.ms(name)
		if err != nil {
			return nil, err
		}
		if ok {
			*dst = v
		}
	}
	c, err := lockmesh.New(cfg,
		func(f lockmesh.FenceEvent) {
			d.emit(map[string]any{"event": "fenced", "session": name, "lease": f.Session, "keys": nonNil(f.Keys), "reason": string(f.Reason), "t_ms": d.tMS()})
		},
		lockmesh.WithJeopardy(func(j lockmesh.JeopardyEvent) {
			kind := "safe"
			if j.State == lockmesh.StateJeopardy {
				kind = "jeopardy"
			}
			d.emit(map[string]any{"event": kind, "session": name, "lease": j.Session, "keys": nonNil(j.Keys), "t_ms": d.tMS()})
		}),
		lockmesh.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, nil))))
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.sessions[name] = c
	d.mu.Unlock()
	return map[string]any{}, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func (d *driver) handle(ctx context.Context, r req) (map[string]any, error) {
	op, err := r.str("op")
	if err != nil {
		return nil, err
	}
	switch op {
	case "open_session":
		return d.openSession(r)
	case "close_session":
		c, err := d.client(r)
		if err != nil {
			return nil, err
		}
		c.Shutdown(ctx)
		return map[string]any{}, nil
	case "acquire":
		c, err := d.client(r)
		if err != nil {
			return nil, err
		}
		var opts lockmesh.LockOptions
		if opts.Wait, _, err = r.ms("wait_ms"); err != nil {
			return nil, err
		}
		if opts.Timeout, _, err = r.ms("timeout_ms"); err != nil {
			return nil, err
		}
		if p, ok := r["permits"]; ok {
			n, ok := p.(float64)
			if !ok || n != float64(int(n)) {
				return nil, bad("permits")
			}
			opts.Permits = int(n)
		}
		if m, ok := r["mode"]; ok {
			switch m {
			case "shared":
				opts.Mode = lockmesh.Shared
			case "exclusive":
				opts.Mode = lockmesh.Exclusive
			default:
				return nil, bad("mode: shared or exclusive")
			}
		}
		if cl, ok := r["class"].(string); ok {
			opts.Class = cl
		}
		var guards []*lockmesh.Guard
		if ks, ok := r["keys"]; ok {
			list, ok := ks.([]any)
			if !ok {
				return nil, bad("keys: a list")
			}
			keys := make([]string, 0, len(list))
			for _, k := range list {
				s, ok := k.(string)
				if !ok {
					return nil, bad("keys: strings")
				}
				keys = append(keys, s)
			}
			if guards, err = c.LockAll(ctx, keys, opts); err != nil {
				return nil, err
			}
		} else {
			key, err := r.str("key")
			if err != nil {
				return nil, err
			}
			g, err := c.Lock(ctx, key, opts)
			if err != nil {
				return nil, err
			}
			guards = []*lockmesh.Guard{g}
		}
		tokens := make([]string, len(guards))
		for i, g := range guards {
			tokens[i] = strconv.FormatUint(g.Token(), 10)
		}
		as, _ := r["as"].(string)
		d.putHold(as, &hold{guards: guards})
		return map[string]any{"token": tokens[0], "tokens": tokens, "lease": guards[0].Session(), "ttl_s": int64(guards[0].TTL() / time.Second)}, nil
	case "release", "resign":
		_, h, err := d.takeHold(r)
		if err != nil {
			return nil, err
		}
		if h.leader != nil {
			return map[string]any{}, h.leader.Resign()
		}
		var first error
		for _, g := range h.guards {
			if err := g.Unlock(); err != nil && first == nil {
				first = err
			}
		}
		return map[string]any{}, first
	case "can_start", "token", "claim":
		name, err := r.str("hold")
		if err != nil {
			return nil, err
		}
		d.mu.Lock()
		h := d.holds[name]
		d.mu.Unlock()
		if h == nil {
			return nil, unknown("hold")
		}
		g := h.first()
		var proof any
		if p := g.Proof(); p != "" {
			proof = p
		}
		// Truncated to whole ms: a caller that read its clock before this request
		// may add it to that time and stay before the SDK's deadline.
		return map[string]any{"can_start": g.CanStartWork(), "state": string(g.State()), "token": strconv.FormatUint(g.Token(), 10),
			"proof": proof, "remaining_ms": g.RemainingTTL().Milliseconds()}, nil
	case "held":
		c, err := d.client(r)
		if err != nil {
			return nil, err
		}
		held := c.Held()
		keys := make([]string, 0, len(held))
		for k := range held {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		out := make([][2]any, 0, len(keys))
		for _, k := range keys {
			out = append(out, [2]any{k, held[k]})
		}
		return map[string]any{"held": out}, nil
	case "campaign":
		c, err := d.client(r)
		if err != nil {
			return nil, err
		}
		key, err := r.str("key")
		if err != nil {
			return nil, err
		}
		var opts lockmesh.CampaignOptions
		if v, ok := r["value"].(string); ok {
			opts.Value = &v
		}
		cctx := ctx
		if w, ok, err := r.ms("wait_ms"); err != nil {
			return nil, err
		} else if ok {
			if w == 0 {
				opts.TryOnce = true
			} else {
				var cancel context.CancelFunc
				cctx, cancel = context.WithTimeout(ctx, w)
				defer cancel()
			}
		}
		l, err := c.Campaign(cctx, key, opts)
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) {
				return nil, &fail{"contended", "not leader within wait_ms"}
			}
			return nil, err
		}
		as, _ := r["as"].(string)
		d.putHold(as, &hold{leader: l})
		return map[string]any{"token": strconv.FormatUint(l.Token(), 10), "lease": l.Session()}, nil
	case "proclaim":
		name, err := r.str("hold")
		if err != nil {
			return nil, err
		}
		value, err := r.str("value")
		if err != nil {
			return nil, err
		}
		d.mu.Lock()
		h := d.holds[name]
		d.mu.Unlock()
		if h == nil {
			return nil, unknown("hold")
		}
		if h.leader == nil {
			return nil, bad("not a leadership")
		}
		return map[string]any{}, h.leader.Proclaim(ctx, value)
	case "observe":
		c, err := d.client(r)
		if err != nil {
			return nil, err
		}
		key, err := r.str("key")
		if err != nil {
			return nil, err
		}
		o, err := c.Observe(key).Next(ctx)
		if err != nil {
			return nil, err
		}
		if o.Leader == nil {
			return map[string]any{"has_leader": false, "value": nil}, nil
		}
		return map[string]any{"has_leader": true, "value": o.Leader.Value}, nil
	case "sleep":
		ms, _, err := r.ms("ms")
		if err != nil {
			return nil, err
		}
		time.Sleep(ms)
		return map[string]any{}, nil
	}
	return nil, bad("unknown op %s", op)
}

func main() {
	if f := os.Getenv("LOCKMESH_SDK_PLANTED"); f != "" && f != "deadline_from_answer" {
		fmt.Fprintf(os.Stderr, "driver: this SDK plants no fault named %s\n", f)
		os.Exit(64)
	}
	d := &driver{sessions: map[string]*lockmesh.Client{}, holds: map[string]*hold{}, out: bufio.NewWriter(os.Stdout), start: time.Now()}
	in := bufio.NewReaderSize(os.Stdin, 1<<16)
	var wg sync.WaitGroup
	for {
		line, err := in.ReadBytes('\n')
		if len(line) > 0 {
			var r req
			if jerr := json.Unmarshal(line, &r); jerr != nil {
				d.emit(map[string]any{"id": nil, "ok": false, "error": "bad_request", "message": "not JSON"})
			} else if r["op"] == "exit" {
				d.emit(map[string]any{"id": r["id"], "ok": true})
				os.Exit(0)
			} else {
				wg.Add(1)
				go func() {
					defer wg.Done()
					reply, err := d.handle(context.Background(), r)
					if reply == nil {
						reply = map[string]any{}
					}
					if err != nil {
						reply = map[string]any{"ok": false, "error": code(err), "message": err.Error()}
					} else {
						reply["ok"] = true
					}
					reply["id"] = r["id"]
					d.emit(reply)
				}()
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "driver: reading stdin:", err)
			os.Exit(1)
		}
	}
	// stdin closed: exit 0. Replies already due are written (up to a second); a
	// request still waiting (a campaign) is abandoned, as the runner is gone.
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Second):
	}
}

func code(err error) string {
	var f *fail
	if errors.As(err, &f) {
		return f.code
	}
	var e *lockmesh.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return "unavailable"
}
