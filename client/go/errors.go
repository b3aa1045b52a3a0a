package lockmesh

import (
	"errors"
	"fmt"
)

// Error is every error the SDK returns. Code is stable: the service's code for
// its refusals ("denied", "leaked", "sealed", ...), else one of the SDK's own:
// "config", "contended", "unavailable", "outcome_unknown", "session_lost",
// "draining", "failed_open". Messages never contain a key or a token.
type Error struct {
	Code    string
	Status  int    // the HTTP status of a refusal; 0 for the SDK's own errors
	Reason  string // contended: key_gated, lock_contended, lock_delay, acquiring_here; session_lost: the loss reason
	Message string
}

func (e *Error) Error() string {
	s := "lockmesh: " + e.Code
	if e.Reason != "" {
		s += " (" + e.Reason + ")"
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// Is matches errors by Code, so errors.Is(err, ErrContended) works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && (t.Reason == "" || t.Reason == e.Reason)
}

// Retryable says whether trying later may succeed.
func (e *Error) Retryable() bool {
	switch e.Code {
	case "contended", "unavailable", "outcome_unknown", "session_lost", "draining", "failed_open",
		"queue_full", "quota_exceeded", "rate_limited", "sealed", "spool_full", "capability_disabled",
		"session_expired", "session_class_mismatch":
		return true
	}
	return false
}

// Sentinels for errors.Is.
var (
	ErrConfig         = &Error{Code: "config"}
	ErrContended      = &Error{Code: "contended"}
	ErrUnavailable    = &Error{Code: "unavailable"}
	ErrOutcomeUnknown = &Error{Code: "outcome_unknown", Message: "the answer was lost; the SDK resolves the outcome and releases any grant it made"}
	ErrSessionLost    = &Error{Code: "session_lost"}
	ErrDraining       = &Error{Code: "draining", Message: "a keepalive of the session failed: no new work starts on it until one is acknowledged"}
	ErrFailedOpen     = &Error{Code: "failed_open", Message: "the service granted an unprotected hold (quorum loss, fail-open class); it was released"}
	ErrLeaked         = &Error{Code: "leaked"}
)

func configErr(field, why string) error {
	return &Error{Code: "config", Message: field + ": " + why}
}

func contended(reason string) error { return &Error{Code: "contended", Reason: reason} }

func sessionLost(r LossReason) error { return &Error{Code: "session_lost", Reason: string(r)} }

// callKind classifies how a call failed, by what it says about its effect.
type callKind int

const (
	callNotSent    callKind = iota + 1 // nothing was sent
	callRefused                        // the service answered {code, message}
	callUnknown                        // sent; the effect is unknown
	callFailedOpen                     // an unprotected grant, released again
)

type callError struct {
	kind    callKind
	status  int
	code    string
	reason  string
	message string
}

func (c *callError) Error() string {
	if c.kind == callRefused {
		return fmt.Sprintf("status %d %s", c.status, c.code)
	}
	return c.message
}

// public turns a call error into the SDK's error (no resolution needed).
func (c *callError) public() error {
	switch c.kind {
	case callNotSent, callUnknown:
		return &Error{Code: "unavailable", Message: c.message}
	case callFailedOpen:
		return ErrFailedOpen
	}
	if c.code == "contended" {
		r := c.reason
		if r == "" {
			r = "key_gated"
		}
		return contended(r)
	}
	return &Error{Code: c.code, Status: c.status, Reason: c.reason, Message: c.message}
}

func asCall(err error) *callError {
	var c *callError
	if errors.As(err, &c) {
		return c
	}
	return &callError{kind: callUnknown, message: err.Error()}
}
