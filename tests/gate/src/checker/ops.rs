//! The checks of the operator actions' workloads (docs/GATE.md "Checks"), each
//! what the docs promise and no more:
//!
//! - `quota_holds_bounded` (docs/OPERATIONS.md "Quotas", "How exact"): outside
//!   fault windows, a quota'd namespace never has more live hold slots on a
//!   cluster than its `holds` quota plus each arbiter's acquires admitted
//!   together (its `waiters` share): [`History::quotas`] carries that bound. A
//!   broken watch (a fault) may let other arbiters admit more for about a
//!   second, which only the acquire rate bounds: not checked there.
//! - `candidate_never_decides` (docs/CLASSES.md "Shadow policies", GUARANTEES
//!   G15): outside fault windows, no acquire of a key of a class with a candidate
//!   policy is refused `contended` while the store shows fewer holds of the key
//!   than the *enforced* limit for the whole of its call (holds counted from the
//!   call of the acquire that was answered them, or 1 s before their commit was
//!   observed, to the observation of their delete: leaning towards "held"), and
//!   no other client's acquire of the key was in flight beside it (an arbiter
//!   lets the first acquire of a key it serves try first, whatever the limit,
//!   so a short wait can run out behind another acquire's slow grant).
//! - On the whole history, before the fail-open exemption ([`unprotected`], run
//!   by [`super::open::check_with_open`]), for keys of fail-open classes
//!   (GUARANTEES G8h, docs/API.md "Token 0"):
//!   - `unprotected_marked`: an answer of token 0 says `"unprotected": true`
//!     (the holder records the code `unprotected`), and one that says so carries
//!     token 0;
//!   - `unprotected_only_in_outage`: a token-0 answer is given only while the
//!     arbiter can have declared its cluster's quorum lost: its call lies in the
//!     window (plus 5 s) of a quorum loss or of a fault that cuts, stalls or stops
//!     etcd or an arbiter's links to it, or steps an arbiter's clock;
//!   - `unprotected_never_fenced`: no fence accepted a write carrying token 0
//!     (neither a holder's write answered success nor a store write with token 0).

use std::collections::HashMap;

use super::{Budget, Grant, TimedOut, Violation};
use crate::history::{ClientOp, History, Outcome};

/// A fault window is widened by this much before its start ...
const FAULT_BEFORE_US: u64 = 1_000_000;
/// ... and this much after its end, for the two checks outside fault windows.
const FAULT_AFTER_US: u64 = 5_000_000;
/// How long before its commit was observed a hold no client was answered with
/// may have been committed (leaning towards "held").
const COMMIT_SLACK_US: u64 = 1_000_000;
/// The code a fail-open holder records on an answer that says it is unprotected.
pub(crate) const UNPROTECTED_CODE: &str = "unprotected";
/// The kinds of fault during which an arbiter can lose etcd's quorum from its
/// view long enough to declare it (`fail_open.quorum_loss_after_ms`). Every
/// restore cuts the restored cluster off while etcd is stopped and restored,
/// `restore_move`'s shard included.
const OUTAGE_KINDS: [&str; 14] = [
    "quorum_loss",
    "member_kill",
    "leader_pause",
    "leader_isolation",
    "arbiter_partition",
    "one_way_link",
    "lossy_link",
    "write_stall",
    "restore",
    "restore_bumped",
    "restore_crash",
    "restore_move",
    "cluster_partition",
    "arbiter_clock_step",
];

pub(super) fn check(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    quotas(h, b, grants, v)?;
    candidates(h, b, grants, v)?;
    Ok(())
}

/// Every fault window, widened.
fn fault_windows(h: &History) -> Vec<(u64, u64)> {
    h.faults
        .iter()
        .map(|f| (f.start_us, f.end_us))
        .chain(h.quorum_loss.iter().copied())
        .map(|(s, e)| (s.saturating_sub(FAULT_BEFORE_US), e.saturating_add(FAULT_AFTER_US)))
        .collect()
}

fn in_any(windows: &[(u64, u64)], at: u64) -> bool {
    windows.iter().any(|(s, e)| *s <= at && at <= *e)
}

/// The quota namespace of a key: its first segment.
fn namespace(key: &str) -> &str {
    key.split('/').next().unwrap_or_default()
}

/// `quota_holds_bounded` (see the module doc). Per cluster and store segment,
/// over the holds that segment committed, in observation order (one recorder's
/// clock: revision order).
fn quotas(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    if h.quotas.is_empty() {
        return Ok(());
    }
    let windows = fault_windows(h);
    let bound: HashMap<&str, usize> = h.quotas.iter().map(|(n, b)| (n.as_str(), *b)).collect();
    // (segment, namespace) -> [(time, +1 | -1, index)]
    let mut edges: HashMap<(usize, &str), Vec<(u64, i32, usize)>> = HashMap::new();
    for (i, g) in grants.iter().enumerate() {
        let ns = namespace(&g.key);
        if !bound.contains_key(ns) {
            continue;
        }
        let e = edges.entry((g.segment, ns)).or_default();
        e.push((g.observed_us, 1, i));
        if let (Some(end), Some((seg, _))) = (g.closed_us, g.close) {
            if seg == g.segment {
                e.push((end, -1, i));
            }
        }
    }
    for ((segment, ns), mut list) in edges {
        // Deletes before puts at one time: a hand-off is a release, then a grant.
        list.sort_unstable_by_key(|(t, d, i)| (*t, *d, *i));
        let limit = bound[ns];
        let mut open: Vec<usize> = Vec::new();
        let mut reported = false;
        for (at, d, i) in list {
            b.tick("quotas")?;
            if d < 0 {
                open.retain(|x| *x != i);
                if open.len() <= limit {
                    reported = false;
                }
                continue;
            }
            open.push(i);
            if open.len() > limit && !reported && !in_any(&windows, at) {
                reported = true;
                let who: Vec<String> = open
                    .iter()
                    .map(|x| {
                        format!("{} token {} (revision {})", grants[*x].key, grants[*x].token, grants[*x].revision)
                    })
                    .collect();
                v.push(Violation {
                    check: "quota_holds_bounded",
                    explanation: format!(
                        "namespace {ns} had {} live hold slots at {at}, with no fault in force, above {limit} (its holds \
                         quota plus each arbiter's waiters share): {}",
                        open.len(),
                        who.join("; ")
                    ),
                    segment,
                    revisions: (open.iter().map(|x| grants[*x].revision).min().unwrap_or(0), grants[i].revision),
                    time_us: (open.iter().map(|x| grants[*x].observed_us).min().unwrap_or(at), at),
                });
            }
        }
    }
    Ok(())
}

/// `candidate_never_decides` (see the module doc).
fn candidates(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    if h.shadow.is_empty() {
        return Ok(());
    }
    let windows = fault_windows(h);
    let mut called: HashMap<(&str, u64), u64> = HashMap::new();
    for o in h.ops.iter().filter(|o| o.asks_grant() && o.outcome == Outcome::Ok) {
        if let Some(t) = o.token {
            let e = called.entry((o.key.as_str(), t)).or_insert(u64::MAX);
            *e = (*e).min(o.call_us);
        }
    }
    let mut held: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    for g in grants.iter().filter(|g| h.is_shadow(&g.key)) {
        let from =
            called.get(&(g.key.as_str(), g.token)).copied().unwrap_or(g.observed_us.saturating_sub(COMMIT_SLACK_US));
        let to = if g.close.is_some() { g.closed_us.unwrap_or(u64::MAX) } else { u64::MAX };
        held.entry(g.key.as_str()).or_default().push((from.min(g.observed_us), to));
    }
    // Every acquire of a shadow key, whatever its outcome: (process, call, answer).
    let mut asked: HashMap<&str, Vec<(&str, u64, u64)>> = HashMap::new();
    for o in h.ops.iter().filter(|o| o.asks_grant() && h.is_shadow(&o.key)) {
        asked.entry(o.key.as_str()).or_default().push((o.process.as_str(), o.call_us, o.ret_us));
    }
    for o in h.ops.iter().filter(|o| o.asks_grant() && o.outcome == Outcome::Fail && h.is_shadow(&o.key)) {
        b.tick("candidates")?;
        if o.code.as_deref() != Some("contended") {
            continue;
        }
        if windows.iter().any(|(s, e)| *s < o.ret_us && *e > o.call_us) {
            continue;
        }
        let beside = asked.get(o.key.as_str()).into_iter().flatten();
        if beside.into_iter().any(|(p, call, ret)| *p != o.process && *call < o.ret_us && *ret > o.call_us) {
            continue;
        }
        let limit = h.limit_of(&o.key);
        // The most holds open at once within [call, ret].
        let mut points: Vec<(u64, i32)> = Vec::new();
        for (from, to) in held.get(o.key.as_str()).into_iter().flatten() {
            if *to <= o.call_us || *from >= o.ret_us {
                continue;
            }
            points.push(((*from).max(o.call_us), 1));
            points.push(((*to).min(o.ret_us), -1));
        }
        points.sort_unstable_by_key(|(t, d)| (*t, -*d));
        let (mut now, mut most) = (0i32, 0i32);
        for (_, d) in points {
            now += d;
            most = most.max(now);
        }
        if (most as usize) < limit {
            v.push(Violation {
                check: "candidate_never_decides",
                explanation: format!(
                    "{}'s acquire of {} (called {}, answered {} contended at {}) was refused while the key had at most {most} \
                     hold(s), below its enforced limit {limit}, with no fault in force: a candidate policy decided",
                    o.process, o.key, o.call_us, o.status, o.ret_us
                ),
                segment: 0,
                revisions: (0, 0),
                time_us: (o.call_us, o.ret_us),
            });
        }
    }
    Ok(())
}

/// The token-0 checks on the whole history (see the module doc). `is_open`
/// says whether a key is of a fail-open class.
pub(crate) fn unprotected(h: &History, is_open: &dyn Fn(&str) -> bool) -> Vec<Violation> {
    let mut v = Vec::new();
    let outages: Vec<(u64, u64)> = h
        .faults
        .iter()
        .filter(|f| OUTAGE_KINDS.contains(&f.kind.as_str()))
        .map(|f| (f.start_us, f.end_us))
        .chain(h.quorum_loss.iter().copied())
        .map(|(s, e)| (s, e.saturating_add(FAULT_AFTER_US)))
        .collect();
    let violation = |check: &'static str, o: &ClientOp, why: String| Violation {
        check,
        explanation: format!(
            "{}'s {} of {} (called {}, answered {}): {why}",
            o.process, o.op, o.key, o.call_us, o.ret_us
        ),
        segment: 0,
        revisions: (0, 0),
        time_us: (o.call_us, o.ret_us),
    };
    for o in h.ops.iter().filter(|o| o.asks_grant() && o.outcome == Outcome::Ok && is_open(&o.key)) {
        let marked = o.code.as_deref() == Some(UNPROTECTED_CODE);
        let zero = o.token == Some(0);
        if zero != marked {
            let why = if zero {
                "answered token 0 without saying it is unprotected".to_owned()
            } else {
                format!("said it is unprotected but carried token {:?}", o.token)
            };
            v.push(violation("unprotected_marked", o, why));
        }
        if zero && !in_any(&outages, o.call_us) {
            v.push(violation(
                "unprotected_only_in_outage",
                o,
                "an unprotected grant (token 0) while no fault could have cut its arbiter from etcd's quorum"
                    .to_owned(),
            ));
        }
    }
    for o in h.ops.iter().filter(|o| o.op == "write" && o.token == Some(0) && o.outcome == Outcome::Ok) {
        v.push(violation("unprotected_never_fenced", o, "a fence accepted a write with token 0".to_owned()));
    }
    for w in h.writes.iter().filter(|w| w.token == 0) {
        v.push(Violation {
            check: "unprotected_never_fenced",
            explanation: format!(
                "the store received a write to {} with token 0 through the fence ({})",
                w.resource, w.body
            ),
            segment: 0,
            revisions: (0, 0),
            time_us: (0, 0),
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::checker::check;
    use crate::history::{EtcdEvent, Fault, Segment, StoreWrite};

    const ROOT: &str = "/g";

    fn ev(revision: i64, put: bool, key: String, value: String, create: i64, at: u64) -> EtcdEvent {
        EtcdEvent {
            revision,
            put,
            key,
            value,
            create_revision: create,
            lease: 7,
            prev_value: None,
            prev_create_revision: None,
            observed_us: at,
        }
    }

    fn epoch() -> EtcdEvent {
        ev(1, true, format!("{ROOT}/sys/epoch"), r#"{"epoch":1}"#.into(), 1, 1)
    }

    /// The hold of `key` in slot `slot`, granted at `rev` (observed at `at`).
    fn grant(rev: i64, key: &str, slot: u32, at: u64) -> EtcdEvent {
        let d: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        ev(rev, true, format!("{ROOT}/l/{d}/h/{slot}"), format!(r#"{{"key":"{key}","epoch":1}}"#), rev, at)
    }

    /// The delete of that hold at `rev` with its release marker (its holder released it).
    fn release(rev: i64, key: &str, slot: u32, granted: i64, at: u64) -> Vec<EtcdEvent> {
        let d: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        let mut e = ev(rev, false, format!("{ROOT}/l/{d}/h/{slot}"), String::new(), 0, at);
        e.prev_value = Some(format!(r#"{{"key":"{key}","epoch":1}}"#));
        e.prev_create_revision = Some(granted);
        let m = ev(rev, true, format!("{ROOT}/r/{d}"), format!(r#"{{"epoch":1,"revision":{granted}}}"#), rev, at);
        vec![e, m]
    }

    fn op(process: &str, op: &str, key: &str, token: Option<u64>, (call, ret): (u64, u64), ok: bool) -> ClientOp {
        ClientOp {
            process: process.into(),
            op: op.into(),
            key: key.into(),
            token,
            call_us: call,
            ret_us: ret,
            outcome: if ok { Outcome::Ok } else { Outcome::Fail },
            status: if ok { 200 } else { 409 },
            code: (!ok).then(|| "contended".to_owned()),
            ..ClientOp::default()
        }
    }

    fn names(h: &History) -> Vec<&'static str> {
        check(h, Duration::from_secs(5)).violations().iter().map(|v| v.check).collect()
    }

    fn t(rev: i64) -> u64 {
        crate::history::token_of(1, rev)
    }

    /// Three holds of namespace `short` open at once (bound 2).
    fn quota_history() -> History {
        let mut events = vec![epoch()];
        events.push(grant(2, "short/q/0", 0, 1_000_000));
        events.push(grant(3, "short/q/1", 0, 1_100_000));
        events.push(grant(4, "short/q/2", 0, 1_200_000));
        events.extend(release(5, "short/q/0", 0, 2, 1_500_000));
        History {
            root: ROOT.into(),
            quotas: vec![("short".into(), 2)],
            segments: vec![Segment { base_revision: 0, bump: 0, events }],
            ..History::default()
        }
    }

    #[test]
    fn holds_of_a_namespace_above_its_quota_bound_are_caught_outside_faults() {
        let h = quota_history();
        assert_eq!(names(&h), ["quota_holds_bounded"]);
        // Within the bound: the third hold after the first's release.
        let mut ok = quota_history();
        ok.quotas = vec![("short".into(), 3)];
        assert!(names(&ok).is_empty(), "{:?}", names(&ok));
        // During a fault (a broken watch may let another arbiter admit more).
        let mut faulted = quota_history();
        faulted.faults.push(Fault {
            kind: "arbiter_partition".into(),
            detail: String::new(),
            start_us: 0,
            end_us: 900_000,
        });
        assert!(names(&faulted).is_empty(), "{:?}", names(&faulted));
    }

    /// One hold of a shadow key (enforced limit 2) from 1 s to 3 s; an acquire
    /// called at `call` is refused `contended` 1 s later.
    fn shadow_history(call: u64, second: bool) -> History {
        let key = "p/sh/0";
        let mut events = vec![epoch(), grant(2, key, 0, 1_000_000)];
        if second {
            events.push(grant(3, key, 1, 1_200_000));
        }
        events.extend(release(9, key, 0, 2, 3_000_000));
        let mut ops = vec![op("v0", "acquire", key, Some(t(2)), (900_000, 1_000_500), true)];
        if second {
            ops.push(op("v2", "acquire", key, Some(t(3)), (1_100_000, 1_200_500), true));
        }
        ops.push(op("v1", "acquire", key, None, (call, call + 1_000_000), false));
        History {
            root: ROOT.into(),
            limits: vec![("p/sh".into(), 2)],
            shadow: vec!["p/sh".into()],
            segments: vec![Segment { base_revision: 0, bump: 0, events }],
            ops,
            ..History::default()
        }
    }

    #[test]
    fn a_shadow_key_refused_below_its_enforced_limit_is_caught() {
        assert_eq!(names(&shadow_history(1_300_000, false)), ["candidate_never_decides"]);
        // At the enforced limit the refusal is the enforced policy's.
        let full = shadow_history(1_300_000, true);
        assert!(names(&full).is_empty(), "{:?}", names(&full));
        // Another client's acquire of the key in flight beside it (answered after
        // the refusal was called): the refusal may be the wait behind it.
        let mut beside = shadow_history(1_300_000, false);
        beside.ops.push(op("v2", "acquire", "p/sh/0", None, (1_200_000, 1_400_000), false));
        assert!(names(&beside).is_empty(), "{:?}", names(&beside));
        // One answered before the refusal was called is not beside it (and, itself
        // refused below the limit with nothing beside it, is caught too).
        let mut before = shadow_history(1_300_000, false);
        before.ops.push(op("v2", "acquire", "p/sh/0", None, (1_100_000, 1_250_000), false));
        assert_eq!(names(&before), ["candidate_never_decides", "candidate_never_decides"]);
    }

    fn open_history(ops: Vec<ClientOp>, writes: Vec<StoreWrite>) -> History {
        History {
            root: ROOT.into(),
            open: vec!["p/o".into()],
            segments: vec![Segment { base_revision: 0, bump: 0, events: vec![epoch()] }],
            quorum_loss: vec![(10_000_000, 16_000_000)],
            ops,
            writes,
            ..History::default()
        }
    }

    fn zero(call: u64, marked: bool) -> ClientOp {
        ClientOp {
            code: marked.then(|| UNPROTECTED_CODE.to_owned()),
            ..op("o0", "acquire", "p/o/0", Some(0), (call, call + 1000), true)
        }
    }

    #[test]
    fn an_unprotected_grant_in_a_quorum_loss_that_no_fence_accepts_passes() {
        let refused = ClientOp { status: 409, ..op("o0", "write", "p/m/o0", Some(0), (13_100_000, 13_101_000), false) };
        let h = open_history(vec![zero(13_000_000, true), refused], Vec::new());
        assert!(names(&h).is_empty(), "{:?}", names(&h));
    }

    #[test]
    fn an_unprotected_grant_outside_an_outage_unmarked_or_fenced_is_caught() {
        let h = open_history(vec![zero(2_000_000, true)], Vec::new());
        assert_eq!(names(&h), ["unprotected_only_in_outage"]);
        // A shard restore (`restore_move`) cuts its cluster off: an outage.
        let mut h = open_history(vec![zero(2_000_000, true)], Vec::new());
        let restore = |kind: &str| crate::history::Fault {
            kind: kind.into(),
            detail: "shard-a restored".into(),
            start_us: 1_000_000,
            end_us: 1_500_000,
        };
        h.faults = vec![restore("restore_move")];
        assert!(names(&h).is_empty(), "{:?}", names(&h));
        h.faults = vec![restore("rebalance")];
        assert_eq!(names(&h), ["unprotected_only_in_outage"]);
        let h = open_history(vec![zero(13_000_000, false)], Vec::new());
        assert_eq!(names(&h), ["unprotected_marked"]);
        let accepted = op("o0", "write", "p/m/o0", Some(0), (13_100_000, 13_101_000), true);
        let store =
            StoreWrite { resource: "/items/o0".into(), lock_key: "p/m/o0".into(), token: 0, body: "o0:0".into() };
        let h = open_history(vec![zero(13_000_000, true), accepted], vec![store]);
        let n = names(&h);
        assert_eq!(n.iter().filter(|c| **c == "unprotected_never_fenced").count(), 2, "{n:?}");
    }
}
