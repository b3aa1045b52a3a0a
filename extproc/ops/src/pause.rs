//! The pause-test verdict of a fenced class as operators see it (`lockctl doctor`,
//! the console): the same check the registry loader runs (ADR-17 in
//! docs/DECISIONS.md), reported rather than refused.

use std::path::{Path, PathBuf};

use lockmesh_core::pause::{check_pause_result, PauseTestResult};
use serde::Serialize;

/// A pause-test verdict for one fenced class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PauseStatus {
    /// A passing, unexpired result for the class.
    pub passing: bool,
    /// Why not, or what it rests on.
    pub detail: String,
    /// When the result stops counting, unix seconds (when it could be read).
    pub expires_unix_s: Option<u64>,
}

/// The pause-test status of fenced class `class` whose registry (in directory
/// `base`) names `file` (ADR-17; the arbiter's loader runs the same check).
pub fn pause_status(base: &Path, class: &str, file: Option<&str>, now_unix_s: u64) -> PauseStatus {
    let fail = |detail: String, expires_unix_s| PauseStatus { passing: false, detail, expires_unix_s };
    let Some(file) = file else {
        return fail(
            "no pause_test_result: a fenced class needs a passing pause test (lockmesh-pausekit)".into(),
            None,
        );
    };
    let path = if Path::new(file).is_absolute() { PathBuf::from(file) } else { base.join(file) };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => return fail(format!("{file:?}: cannot read {}: {e}", path.display()), None),
    };
    let doc: PauseTestResult = match lockmesh_runtime::parse_yaml(&text) {
        Ok(d) => d,
        Err(e) => return fail(format!("{file:?}: not a PauseTestResult: {e}"), None),
    };
    match check_pause_result(&doc, class, now_unix_s) {
        Ok(()) => PauseStatus {
            passing: true,
            detail: format!("{file:?} passed against {}", doc.resource),
            expires_unix_s: Some(doc.expires_unix_s),
        },
        Err(m) => fail(format!("{file:?}: {m}"), Some(doc.expires_unix_s)),
    }
}

/// `YYYY-MM-DD` of a day number (days since 1970-01-01, proleptic Gregorian).
pub fn day_string(days: i64) -> String {
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
