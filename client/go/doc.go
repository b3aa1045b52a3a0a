// Package lockmesh is the Go holder SDK of lockmesh: a client of the lock tier's
// HTTP API (docs/API.md) that does what a holder must do and is easy to get wrong.
//
//   - One session per TTL, renewed by one keepalive every TTL/3 in a goroutine,
//     however many holds it carries (ADR-10, ADR-11).
//   - Two-stage loss (ADR-12): [Guard.CanStartWork] is false from the first failed
//     keepalive (jeopardy); at the fence deadline, counted from the monotonic SEND
//     time of the last acknowledged keepalive (send + TTL - margin), the session is
//     fenced: the fence callback runs once and every guard's [Guard.Context] is
//     cancelled. Also at once on session_expired or an epoch change.
//   - Re-entrant acquires are counted locally (ADR-13): the service sees one
//     acquire and one release per outermost hold. The service answers `leaked`
//     (Error.Code "leaked") when this process holds the key on another session.
//   - Unknown outcomes never leak a hold: an acquire whose answer is lost returns
//     [ErrOutcomeUnknown] and is resolved from the session's hold listing, and a
//     grant made after its caller stopped waiting is released.
//   - Tokens and proofs are handed to the caller's write ([Guard.Token],
//     [Guard.Proof]); neither is ever logged or put in an error message.
//
// The Rust SDK (client/src) is the reference; docs/SDK.md describes both.
package lockmesh
