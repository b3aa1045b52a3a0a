//! Unprotected grants (ADR-04) in the checker: a fail-open class's acquire
//! answered during a quorum loss carries **token 0**, granted from an arbiter's
//! memory with no etcd commit behind it. Such an operation is exempt from every
//! property (mutual exclusion, token order, genuineness, grants during a quorum
//! loss) **only** when its key belongs to a class the run declared open; a token-0
//! answer for any other key is a violation of its own,
//! `unprotected_only_if_declared` (and the other checks still see it). Store
//! writes are never exempt: no fence accepts token 0, and a fenced class cannot
//! be declared open.
//!
//! [`super::check`] is [`check_with_open`] with the history's own fail-open
//! prefixes ([`History::open`]); with none, any token 0 fails. The gate's runs
//! declare one fail-open class (`harness::OPEN_PREFIX`), whose token-0 answers
//! are held to the checks of `ops::unprotected` instead.

use std::time::Duration;

use super::{check, Verdict, Violation};
use crate::history::History;

/// The unprotected token.
pub const UNPROTECTED_TOKEN: u64 = 0;

fn covers(prefix: &str, key: &str) -> bool {
    key == prefix || key.strip_prefix(prefix).is_some_and(|r| r.starts_with('/'))
}

/// [`check`] for a run whose registry declares fail-open classes: `open` lists
/// their key prefixes (`namespace` or `namespace/path`, on `/` boundaries).
pub fn check_with_open(h: &History, open: &[String], budget: Duration) -> Verdict {
    let is_open = |key: &str| open.iter().any(|p| covers(p, key));
    let mut undeclared = super::ops::unprotected(h, &is_open);
    let mut kept = h.clone();
    kept.open.clear();
    kept.ops.retain(|op| {
        if op.token != Some(UNPROTECTED_TOKEN) {
            return true;
        }
        if is_open(&op.key) {
            return false;
        }
        if op.op == "acquire" && op.outcome == super::Outcome::Ok {
            undeclared.push(Violation {
                check: "unprotected_only_if_declared",
                explanation: format!(
                    "{}'s acquire of {} answered token 0 (an unprotected grant) at {}, but its class does not declare \
                     on_quorum_loss: open",
                    op.process, op.key, op.ret_us
                ),
                segment: 0,
                revisions: (0, 0),
                time_us: (op.call_us, op.ret_us),
            });
        }
        true
    });
    match check(&kept, budget) {
        Verdict::Pass(stats) if undeclared.is_empty() => Verdict::Pass(stats),
        Verdict::Pass(stats) => Verdict::Fail(stats, undeclared),
        Verdict::Fail(stats, mut v) => {
            v.extend(undeclared);
            Verdict::Fail(stats, v)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{ClientOp, Outcome};

    fn op(process: &str, op: &str, key: &str, token: u64, call: u64, ret: u64) -> ClientOp {
        ClientOp {
            process: process.into(),
            op: op.into(),
            key: key.into(),
            token: Some(token),
            call_us: call,
            ret_us: ret,
            outcome: Outcome::Ok,
            status: 200,
            code: None,
            skew_ms: 0,
            valid_until_us: None,
            session: None,
            ..Default::default()
        }
    }

    fn checks(v: &Verdict) -> Vec<&'static str> {
        v.violations().iter().map(|x| x.check).collect()
    }

    /// Two processes hold `jobs/a` at once with token 0 during a quorum loss
    /// (each answer said it is unprotected: the holder's mark).
    fn loss_history(key: &str) -> History {
        let marked = |o: ClientOp| ClientOp { code: Some(super::super::ops::UNPROTECTED_CODE.to_owned()), ..o };
        History {
            root: "/g".into(),
            ops: vec![
                marked(op("h0", "acquire", key, 0, 5_000_000, 5_100_000)),
                marked(op("h1", "acquire", key, 0, 5_200_000, 5_300_000)),
                op("h0", "release", key, 0, 6_000_000, 6_100_000),
            ],
            quorum_loss: vec![(1_000_000, 9_000_000)],
            ..History::default()
        }
    }

    #[test]
    fn token_zero_grants_of_a_declared_open_class_are_exempt() {
        let h = loss_history("jobs/a");
        let v = check_with_open(&h, &["jobs".to_owned()], Duration::from_secs(5));
        assert!(v.passed(), "{}", v.explain());
        // A sibling namespace sharing the prefix's letters is not covered.
        let h = loss_history("jobs-archive/a");
        let v = check_with_open(&h, &["jobs".to_owned()], Duration::from_secs(5));
        assert!(checks(&v).contains(&"unprotected_only_if_declared"), "{}", v.explain());
    }

    #[test]
    fn token_zero_of_any_other_class_is_a_violation() {
        let h = loss_history("payments/a");
        let v = check_with_open(&h, &["jobs".to_owned()], Duration::from_secs(5));
        let c = checks(&v);
        assert_eq!(c.iter().filter(|c| **c == "unprotected_only_if_declared").count(), 2, "{}", v.explain());
        // ...and the ordinary properties still see it.
        assert!(c.contains(&"tokens_increase") && c.contains(&"quorum_loss_grants_nothing"), "{c:?}");
        // The plain check (no open class) fails it too.
        assert!(!check(&h, Duration::from_secs(5)).passed());
    }
}
