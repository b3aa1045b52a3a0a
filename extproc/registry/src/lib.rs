//! The class registry file (docs/CLASSES.md): one loader for the arbiter's startup
//! and hot reload, `lockctl class check`, `lockctl doctor` and the audit tailer.
//! Every error carries the file and the field path.

use std::path::Path;

use lockmesh_core::{
    class::RawRegistry,
    pause::{check_pause_result, PauseTestResult},
    ClassRegistry,
};
use lockmesh_keyspace::now_ms;

pub mod crd;

/// Days since 1970-01-01 now (UTC).
pub fn today() -> i64 {
    i64::try_from(now_ms() / 86_400_000).unwrap_or(i64::MAX)
}

/// Loads and validates a registry file; errors are `file: path: message`, every
/// one. A fenced class must name a PauseTestResult file (`pause_test_result`, a
/// path relative to the registry file's directory, or absolute) holding a
/// passing, unexpired result for that class (ADR-17); the file is read at every
/// load, so a reload after it expired refuses the registry.
///
/// A registry that lowers a platform floor (accepted only with its
/// `platform.lowered_floors_reason`) is logged as a warning at every load, naming
/// each lowered floor and the reason: the arbiter's startup and every hot reload
/// go through here.
pub fn load(path: &Path) -> Result<ClassRegistry, Vec<String>> {
    let name = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| vec![format!("{name}: cannot read: {e}")])?;
    let base = path.parent().unwrap_or(Path::new("."));
    let reg =
        parse_at(&text, base).map_err(|errs| errs.into_iter().map(|e| format!("{name}: {e}")).collect::<Vec<_>>())?;
    let (lowered, reason) = reg.lowered_floors();
    if !lowered.is_empty() {
        let floors = lowered.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        tracing::warn!(
            file = %name,
            floors = %floors,
            reason = reason.unwrap_or_default(),
            "class registry lowers platform TTL floors below the ADR-11 defaults; the shipped CRDs encode the \
             defaults (regenerate them: lockctl class crds FILE)"
        );
    }
    Ok(reg)
}

/// Parses and validates registry text; pause-test files resolve against the
/// current directory.
pub fn parse(text: &str) -> Result<ClassRegistry, Vec<String>> {
    parse_at(text, Path::new("."))
}

/// Parses and validates registry text; pause-test files resolve against `base`.
pub fn parse_at(text: &str, base: &Path) -> Result<ClassRegistry, Vec<String>> {
    let raw: RawRegistry = lockmesh_runtime::parse_yaml(text).map_err(|e| vec![e.to_string()])?;
    let now = now_ms() / 1000;
    let check = |class: &str, file: Option<&str>| check_pause_file(base, class, file, now);
    ClassRegistry::try_from_raw_with(&raw, &check).map_err(|errs| errs.into_iter().map(|e| e.to_string()).collect())
}

/// The pause-test verdict of a fenced class: `file` (relative to `base`) must
/// hold a passing, unexpired PauseTestResult for `class` at `now_unix_s`.
pub fn check_pause_file(base: &Path, class: &str, file: Option<&str>, now_unix_s: u64) -> Result<(), String> {
    let Some(file) = file else {
        return Err("required for a fenced class (ADR-17): the PauseTestResult file of a passing pause test \
                    (lockmesh-pausekit --out), relative to the registry file"
            .into());
    };
    let path = base.join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{file:?}: cannot read {}: {e}", path.display()))?;
    let doc: PauseTestResult =
        lockmesh_runtime::parse_yaml(&text).map_err(|e| format!("{file:?}: not a PauseTestResult: {e}"))?;
    check_pause_result(&doc, class, now_unix_s).map_err(|m| format!("{file:?}: {m}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(max_holders: u32) -> String {
        format!(
            "classes:\n  - {{ name: default, default: true, ttl_s: 30, enforcement: advisory, \
             risk_owner: t, waiver_expiry: \"2099-12-31\" }}\n  - {{ name: pool, prefixes: [\"pool\"], ttl_s: 30, \
             max_holders: {max_holders}, enforcement: advisory, risk_owner: t, waiver_expiry: \"2099-12-31\" }}\n"
        )
    }

    /// Slot names have four digits (`lockmesh_keyspace::keys`): a limit above
    /// 9999 names slot `10000`, which sorts inside the limit compare's range.
    #[test]
    fn max_holders_is_capped_where_slot_names_stop_sorting() {
        let reg = parse(&pool(lockmesh_core::class::MAX_HOLDERS)).unwrap();
        assert_eq!(reg.classes().iter().map(|c| c.max_holders).max(), Some(9_999));
        let errs = parse(&pool(10_000)).unwrap_err();
        assert!(
            errs.iter().any(|e| e.starts_with("classes[1].max_holders: 10000 is above 9999")),
            "the loader accepted max_holders 10000: {errs:?}"
        );
    }
}
