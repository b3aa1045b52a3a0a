//! The pause test result (ADR-17): the document the pause test kit writes after it
//! froze a holder past its TTL against a real fenced resource, and the pure check a
//! class registry runs before it accepts `enforcement: fenced` for a class.
//!
//! Times are unix seconds (UTC). A result is valid for at most
//! [`MAX_VALIDITY_S`] after it was produced; the kit sets `expires_unix_s`.

use serde::{Deserialize, Serialize};

/// The schema version this crate writes and accepts.
pub const SCHEMA_VERSION: &str = "lockmesh.dev/pause-test/v1";
/// Longest validity of a result: 90 days.
pub const MAX_VALIDITY_S: u64 = 90 * 24 * 3600;
/// Clock skew tolerated for a result produced "in the future", seconds.
pub const MAX_CLOCK_SKEW_S: u64 = 300;

/// The outcome of one pause test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The late write of the paused holder was refused and the resource never saw it.
    Pass,
    /// The late write landed (the resource is not fenced), or the run could not prove
    /// the opposite.
    Fail,
}

/// A pause test result document (YAML or JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseTestResult {
    /// Must equal [`SCHEMA_VERSION`]; a document with another version is refused.
    pub schema_version: String,
    /// The lock class the test ran under.
    pub class: String,
    /// What was tested: the fence kind and the resource, e.g.
    /// `fence-proxy http://10.0.0.5:8080/items/{id}`. Never a token.
    pub resource: String,
    /// When the run finished, unix seconds.
    pub time_unix_s: u64,
    /// When the result stops counting, unix seconds (at most [`MAX_VALIDITY_S`]
    /// after `time_unix_s`).
    pub expires_unix_s: u64,
    /// Pass or fail.
    pub verdict: Verdict,
    /// What was observed.
    pub evidence: PauseEvidence,
}

/// What the kit observed, step by step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseEvidence {
    /// The class TTL, seconds.
    pub ttl_s: u64,
    /// How long the first holder was stopped (SIGSTOP to SIGCONT), ms.
    pub paused_ms: u64,
    /// HTTP status (or SQL outcome as 200/409) of the first holder's write before the pause.
    pub first_write_status: u16,
    /// Status of the second holder's write.
    pub second_write_status: u16,
    /// Status of the first holder's late write after it resumed.
    pub late_write_status: u16,
    /// Whether the first grant's token was below the second's (it must be).
    pub second_token_greater: bool,
    /// Whether the resource itself holds the late write's value afterwards.
    pub resource_saw_late_write: bool,
    /// Progress lines, in order.
    pub steps: Vec<String>,
}

// === impl PauseTestResult ===

impl PauseTestResult {
    /// The verdict the evidence supports: pass only when the late write was
    /// refused, the resource never saw it, and both earlier writes succeeded in
    /// token order.
    pub fn verdict_of(e: &PauseEvidence) -> Verdict {
        let ok = (200..300).contains(&e.first_write_status)
            && (200..300).contains(&e.second_write_status)
            && !(200..300).contains(&e.late_write_status)
            && e.second_token_greater
            && !e.resource_saw_late_write
            && e.paused_ms > e.ttl_s.saturating_mul(1000);
        if ok {
            Verdict::Pass
        } else {
            Verdict::Fail
        }
    }
}

/// Accepts `doc` as proof that `class_name` is fenced at `now_unix_s`: the schema is
/// known, the verdict is a pass that its own evidence supports, the class matches,
/// and the result is neither expired nor from the future. The error says why not.
pub fn check_pause_result(doc: &PauseTestResult, class_name: &str, now_unix_s: u64) -> Result<(), String> {
    if doc.schema_version != SCHEMA_VERSION {
        return Err(format!("schema_version {:?} is not {SCHEMA_VERSION:?}", doc.schema_version));
    }
    if doc.class != class_name {
        return Err(format!("the result is for class {:?}, not {class_name:?}", doc.class));
    }
    if doc.verdict != Verdict::Pass {
        return Err("verdict is fail: the paused holder's late write was not refused".into());
    }
    if PauseTestResult::verdict_of(&doc.evidence) != Verdict::Pass {
        return Err("verdict says pass but the evidence does not support it".into());
    }
    if doc.time_unix_s > now_unix_s.saturating_add(MAX_CLOCK_SKEW_S) {
        return Err(format!("time_unix_s {} is in the future (now {now_unix_s})", doc.time_unix_s));
    }
    if doc.expires_unix_s <= doc.time_unix_s || doc.expires_unix_s - doc.time_unix_s > MAX_VALIDITY_S {
        return Err(format!("expires_unix_s must be within {MAX_VALIDITY_S} s after time_unix_s"));
    }
    if now_unix_s >= doc.expires_unix_s {
        return Err(format!(
            "the result expired at {} (now {now_unix_s}): run the pause test kit again",
            doc.expires_unix_s
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passing(now: u64) -> PauseTestResult {
        PauseTestResult {
            schema_version: SCHEMA_VERSION.into(),
            class: "orders".into(),
            resource: "fence-proxy http://127.0.0.1:1/items/{id}".into(),
            time_unix_s: now,
            expires_unix_s: now + 3600,
            verdict: Verdict::Pass,
            evidence: PauseEvidence {
                ttl_s: 3,
                paused_ms: 5000,
                first_write_status: 200,
                second_write_status: 200,
                late_write_status: 409,
                second_token_greater: true,
                resource_saw_late_write: false,
                steps: vec!["acquired".into()],
            },
        }
    }

    #[test]
    fn accepts_a_passing_unexpired_result_for_its_class() {
        let d = passing(1000);
        assert_eq!(check_pause_result(&d, "orders", 1001), Ok(()));
        assert!(check_pause_result(&d, "other", 1001).unwrap_err().contains("class"));
        assert!(check_pause_result(&d, "orders", 1000 + 3600).unwrap_err().contains("expired"));
        assert!(check_pause_result(&d, "orders", 1000 - MAX_CLOCK_SKEW_S - 1).unwrap_err().contains("future"));
    }

    #[test]
    fn refuses_fail_and_unsupported_pass() {
        let mut d = passing(1000);
        d.verdict = Verdict::Fail;
        assert!(check_pause_result(&d, "orders", 1001).unwrap_err().contains("fail"));
        let mut d = passing(1000);
        d.evidence.late_write_status = 200;
        assert!(check_pause_result(&d, "orders", 1001).unwrap_err().contains("evidence"));
        let mut d = passing(1000);
        d.evidence.resource_saw_late_write = true;
        assert!(check_pause_result(&d, "orders", 1001).is_err());
        let mut d = passing(1000);
        d.evidence.paused_ms = 2000;
        assert!(check_pause_result(&d, "orders", 1001).is_err());
        let mut d = passing(1000);
        d.expires_unix_s = 1000 + MAX_VALIDITY_S + 1;
        assert!(check_pause_result(&d, "orders", 1001).unwrap_err().contains("within"));
        let mut d = passing(1000);
        d.schema_version = "v0".into();
        assert!(check_pause_result(&d, "orders", 1001).is_err());
    }

    #[test]
    fn round_trips_as_json_and_refuses_unknown_fields() {
        let d = passing(7);
        let s = serde_json::to_string(&d).unwrap();
        assert!(s.contains("\"verdict\":\"pass\""));
        assert_eq!(serde_json::from_str::<PauseTestResult>(&s).unwrap(), d);
        let extra = s.replacen('{', "{\"x\":1,", 1);
        assert!(serde_json::from_str::<PauseTestResult>(&extra).is_err());
    }
}
