//! The checks of the recipes' own promises (docs/GATE.md "Checks"):
//!
//! - `close_only_when_asked`: a hold handed to a client and ended by its
//!   session's close (the close marker) was released or closed by that client
//!   before, or its SDK fenced the session (the SDK closes a session it fences
//!   for any reason but its expiry, so that its holds end at once): a
//!   header-only session reused across releases must not lose its new hold to
//!   the close its earlier release started.
//! - `advisory_intervals_within_limit`: a holder that keeps the SDK's margin may
//!   treat its hold as its own from the answer until the earlier of its release
//!   call and its call time + TTL − margin; those intervals never overlap beyond
//!   the key's limit (permits counted).
//! - `no_waiter_on_a_free_key`: outside fault windows, a waiting acquire of a
//!   plain mutex key is not left waiting longer than [`WAIT_BOUND_US`] while the
//!   key, per the store's history, was free the whole time.

use std::collections::HashMap;

use super::{parse_kind, Budget, End, Grant, PolicyValue, TimedOut, Violation};
use crate::history::{ClientOp, History, Outcome, SDK_MARGIN_US};

/// How long a waiter may wait on a key that is free the whole time (generous: an
/// arbiter wakes a waiter on the key's watch, or polls about once a second).
pub(crate) const WAIT_BOUND_US: u64 = 3_000_000;
/// A fault window is widened by this much before its start ...
const FAULT_BEFORE_US: u64 = 1_000_000;
/// ... and this much after its end, for `no_waiter_on_a_free_key`.
const FAULT_AFTER_US: u64 = 5_000_000;

pub(super) fn check(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    closes(h, b, grants, v)?;
    intervals(h, b, v)?;
    waiters(h, b, grants, v)?;
    Ok(())
}

/// Grants handed to clients: (key, token) → the ops that were answered them.
fn handed(h: &History) -> HashMap<(&str, u64), Vec<&ClientOp>> {
    let mut m: HashMap<(&str, u64), Vec<&ClientOp>> = HashMap::new();
    for o in h.ops.iter().filter(|o| o.asks_grant() && o.outcome == Outcome::Ok) {
        if let Some(t) = o.token {
            m.entry((o.key.as_str(), t)).or_default().push(o);
        }
    }
    m
}

/// `close_only_when_asked` (see the module doc).
fn closes(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    let handed = handed(h);
    // The first call that ended a grant by its token: a release or resign of the
    // key, or a close of the session (recorded with the round's token).
    let mut released: HashMap<(&str, &str, u64), u64> = HashMap::new();
    let mut closed: HashMap<(&str, u64), u64> = HashMap::new();
    for o in &h.ops {
        let Some(t) = o.token else { continue };
        if o.ends_grant() {
            let e = released.entry((o.process.as_str(), o.key.as_str(), t)).or_insert(u64::MAX);
            *e = (*e).min(o.call_us);
        } else if o.op == "close" {
            let e = closed.entry((o.process.as_str(), t)).or_insert(u64::MAX);
            *e = (*e).min(o.call_us);
        }
    }
    // SDK fences that close their session, by process and key: a fence names the
    // keys the session held (no token), and for every reason but the session's
    // expiry the SDK then closes the session itself.
    let mut fenced: HashMap<(&str, &str), Vec<u64>> = HashMap::new();
    for o in h.ops.iter().filter(|o| o.op == "fenced" && o.code.as_deref() != Some("session_expired")) {
        for key in o.key.split(',') {
            fenced.entry((o.process.as_str(), key)).or_default().push(o.call_us);
        }
    }
    for g in grants.iter().filter(|g| g.end == Some(End::SessionClosed)) {
        b.tick("closes")?;
        let (Some(at), Some(ops)) = (g.closed_us, handed.get(&(g.key.as_str(), g.token))) else { continue };
        for o in ops {
            let p = o.process.as_str();
            let asked = released.get(&(p, g.key.as_str(), g.token)).is_some_and(|c| *c <= at)
                || closed.get(&(p, g.token)).is_some_and(|c| *c <= at)
                || fenced.get(&(p, g.key.as_str())).is_some_and(|f| f.iter().any(|f| (o.call_us..=at).contains(f)));
            if asked {
                continue;
            }
            v.push(Violation {
                check: "close_only_when_asked",
                explanation: format!(
                    "{p} was answered grant {} of {} at {} (session {}), and the hold was deleted by its session's close at {} \
                     although {p} had neither released it, closed that session nor had it fenced by its SDK: a hold lost to a \
                     close its holder did not ask for",
                    g.token,
                    g.key,
                    o.ret_us,
                    o.session.clone().unwrap_or_else(|| format!("{:016x}", g.lease)),
                    at
                ),
                segment: g.segment,
                revisions: (g.revision, g.close.map_or(g.revision, |c| c.1)),
                time_us: (o.call_us, at),
            });
        }
    }
    Ok(())
}

/// The largest limit `key` ever had: its registry limit and every limit its
/// class's policy record carried in the history (a lowered limit drains, so
/// holds of the old one may still be open).
fn max_limit(h: &History, key: &str, policy: &HashMap<String, usize>) -> usize {
    let base = h.limit_of(key);
    h.class_of(key).and_then(|c| policy.get(c)).map_or(base, |l| base.max(*l))
}

/// Every limit each class's policy record carried, the largest.
fn policy_limits(h: &History) -> HashMap<String, usize> {
    let mut m: HashMap<String, usize> = HashMap::new();
    for (_, seg) in h.store_segments() {
        for e in seg.events.iter().filter(|e| e.put) {
            if let Some(("policy", class)) = parse_kind(&h.root, &e.key) {
                if let Ok(p) = serde_json::from_str::<PolicyValue>(&e.value) {
                    let l = m.entry(class.to_owned()).or_default();
                    *l = (*l).max(p.limit);
                }
            }
        }
    }
    m
}

/// One holder's interval: (from, to, permits, process, token).
type Interval<'a> = (u64, u64, u32, &'a str, u64);

/// `advisory_intervals_within_limit` (see the module doc). Intervals are compared
/// per key and epoch: a restore or a move ends the holds of an epoch (fenced by
/// the epoch, not by time).
fn intervals(h: &History, b: &mut Budget, v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    let mut released: HashMap<(&str, &str, u64), u64> = HashMap::new();
    for o in h.ops.iter().filter(|o| o.ends_grant() || o.op == "close") {
        if let Some(t) = o.token {
            let e = released.entry((o.process.as_str(), o.key.as_str(), t)).or_insert(u64::MAX);
            *e = (*e).min(o.call_us);
        }
    }
    let mut by_key: HashMap<(&str, u64), Vec<Interval<'_>>> = HashMap::new();
    for o in h.ops.iter().filter(|o| o.op == "acquire" && o.outcome == Outcome::Ok) {
        let (Some(t), Some(ttl_ms)) = (o.token, o.ttl_ms) else { continue };
        let kept = (o.call_us + ttl_ms * 1000).saturating_sub(SDK_MARGIN_US);
        let rel = released.get(&(o.process.as_str(), o.key.as_str(), t)).copied().unwrap_or(u64::MAX);
        let to = kept.min(rel);
        if to > o.ret_us {
            by_key.entry((o.key.as_str(), t >> 48)).or_default().push((
                o.ret_us,
                to,
                o.permits.unwrap_or(1).max(1),
                o.process.as_str(),
                t,
            ));
        }
    }
    let policy = policy_limits(h);
    for ((key, epoch), mut list) in by_key {
        let limit = max_limit(h, key, &policy);
        list.sort_unstable();
        let mut active: Vec<Interval<'_>> = Vec::new();
        for iv in list {
            b.tick("intervals")?;
            active.retain(|a| a.1 > iv.0);
            active.push(iv);
            let held: u32 = active.iter().map(|a| a.2).sum();
            if held as usize > limit {
                let who: Vec<String> = active
                    .iter()
                    .map(|a| format!("{} token {} ({} permit(s), {}..{})", a.3, a.4, a.2, a.0, a.1))
                    .collect();
                v.push(Violation {
                    check: "advisory_intervals_within_limit",
                    explanation: format!(
                        "{key} (epoch {epoch}, limit {limit}): {held} permits held at once by holders that keep the SDK's margin, \
                         each from its answer to the earlier of its release and its call + TTL − {} ms: {}",
                        SDK_MARGIN_US / 1000,
                        who.join("; ")
                    ),
                    segment: 0,
                    revisions: (0, 0),
                    time_us: (active.iter().map(|a| a.0).min().unwrap_or(iv.0), iv.1),
                });
                // One report per overlap: start over from this interval.
                active.clear();
                active.push(iv);
            }
        }
    }
    Ok(())
}

/// Whether `no_waiter_on_a_free_key` judges acquires of `key`: a plain mutex
/// (limit 1, no policy class, no lock-delay, no durable queue, no election).
fn plain_mutex(h: &History, key: &str) -> bool {
    h.limit_of(key) == 1 && h.class_of(key).is_none() && !h.is_delayed(key) && !h.is_durable(key) && !h.is_election(key)
}

/// `no_waiter_on_a_free_key` (see the module doc). A hold counts from the
/// earlier of its commit's observation and its answer, to the observation of
/// its delete (never, if the delete is in another segment): both ends lean
/// towards "held".
fn waiters(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    let mut answered: HashMap<(&str, u64), u64> = HashMap::new();
    for o in h.ops.iter().filter(|o| o.asks_grant() && o.outcome == Outcome::Ok) {
        if let Some(t) = o.token {
            let e = answered.entry((o.key.as_str(), t)).or_insert(u64::MAX);
            *e = (*e).min(o.ret_us);
        }
    }
    let mut held: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for g in grants {
        let from = answered.get(&(g.key.as_str(), g.token)).map_or(g.observed_us, |a| (*a).min(g.observed_us));
        let to = if g.close.is_some() { g.closed_us.unwrap_or(u64::MAX) } else { u64::MAX };
        held.entry(g.key.as_str()).or_default().push((from, to));
    }
    for l in held.values_mut() {
        l.sort_unstable();
    }
    let windows: Vec<(u64, u64)> = h
        .faults
        .iter()
        .map(|f| (f.start_us, f.end_us))
        .chain(h.quorum_loss.iter().copied())
        .map(|(s, e)| (s.saturating_sub(FAULT_BEFORE_US), e.saturating_add(FAULT_AFTER_US)))
        .collect();
    for o in h.ops.iter().filter(|o| o.asks_grant() && !o.multi && o.outcome != Outcome::Unknown) {
        b.tick("waiters")?;
        if o.ret_us.saturating_sub(o.call_us) <= WAIT_BOUND_US || !plain_mutex(h, &o.key) {
            continue;
        }
        if windows.iter().any(|(s, e)| *s < o.ret_us && *e > o.call_us) {
            continue;
        }
        // The longest stretch of [call, ret] with no hold of the key open.
        let mut at = o.call_us;
        let mut longest = (0, at, at);
        for (from, to) in held.get(o.key.as_str()).into_iter().flatten() {
            if *to <= at {
                continue;
            }
            if *from >= o.ret_us {
                break;
            }
            if *from > at && *from - at > longest.0 {
                longest = (*from - at, at, *from);
            }
            at = at.max(*to);
        }
        if at < o.ret_us && o.ret_us - at > longest.0 {
            longest = (o.ret_us - at, at, o.ret_us);
        }
        if longest.0 > WAIT_BOUND_US {
            v.push(Violation {
                check: "no_waiter_on_a_free_key",
                explanation: format!(
                    "{}'s {} of {} (called {}, answered {} {:?}) waited {} ms while the key was free the whole time ({}..{}), with no fault in force",
                    o.process,
                    o.op,
                    o.key,
                    o.call_us,
                    o.status,
                    o.code,
                    longest.0 / 1000,
                    longest.1,
                    longest.2
                ),
                segment: 0,
                revisions: (0, 0),
                time_us: (longest.1, longest.2),
            });
        }
    }
    Ok(())
}
