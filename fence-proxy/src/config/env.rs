//! The `LOCKMESH_FENCE_*` environment overrides: the one place they are declared.
//!
//! The injector (`lockmesh-sidecar`, `sidecar/src/inject.rs`) sets them on the
//! fence container, so one ConfigMap can serve every pod whatever port it moved.
//! Each one replaces the same field of the file and is validated like it; an
//! error names the variable (`LOCKMESH_FENCE_LISTEN (overrides listen): ...`). A
//! variable set to an empty string is an error, not "unset": a broken injection
//! must not silently fall back to the file. The file may leave a field out when
//! the variable supplies it; if neither does, the field is reported missing.
//!
//! The environment is read through [`EnvSource`], so tests pass a map and never
//! call `std::env::set_var`.

use std::collections::HashMap;

/// Overrides `listen`: the client-facing address, `host:port`.
pub(crate) const LISTEN: &str = "LOCKMESH_FENCE_LISTEN";
/// Overrides `admin_listen`: the admin address (`/healthz`, `/readyz`, `/metrics`).
pub(crate) const ADMIN_LISTEN: &str = "LOCKMESH_FENCE_ADMIN_LISTEN";
/// Overrides `upstream`: the store, `http://host:port`.
pub(crate) const UPSTREAM: &str = "LOCKMESH_FENCE_UPSTREAM";
/// Overrides `marks_dir`: the marks directory (a persistent volume).
pub const MARKS_DIR: &str = "LOCKMESH_FENCE_MARKS_DIR";

/// Not an override: `1` lets a config enable the release gate's planted bug
/// (`accept_lower_tokens`, docs/GATE.md); never set in production.
pub(crate) const TEST_FAULTS: &str = "LOCKMESH_TEST_FAULTS";

/// Every override as (variable, config field), in the order they are applied.
pub const OVERRIDES: [(&str, &str); 4] =
    [(LISTEN, "listen"), (ADMIN_LISTEN, "admin_listen"), (UPSTREAM, "upstream"), (MARKS_DIR, "marks_dir")];

/// Where the overrides come from.
pub trait EnvSource {
    /// The variable's value, if set. A value that is not UTF-8 comes back with
    /// U+FFFD in it, and validation refuses it.
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment (what `main` uses).
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEnv;

/// No overrides.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEnv;

// === impl ProcessEnv ===

impl EnvSource for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
    }
}

impl EnvSource for NoEnv {
    fn var(&self, _: &str) -> Option<String> {
        None
    }
}

impl EnvSource for HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl<const N: usize> EnvSource for [(&str, &str); N] {
    fn var(&self, name: &str) -> Option<String> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }
}

/// The value of `field`: the variable's when set (checked for empty and non-UTF-8),
/// else the file's. `Err` carries the message for the variable.
pub(crate) fn pick(env: &dyn EnvSource, var: &str, file: Option<&String>) -> Result<Option<(String, Origin)>, String> {
    match env.var(var) {
        Some(v) if v.is_empty() => Err("is set but empty".into()),
        Some(v) if v.contains('\u{FFFD}') => Err("is not valid UTF-8".into()),
        Some(v) => Ok(Some((v, Origin::Env))),
        None => Ok(file.map(|f| (f.clone(), Origin::File))),
    }
}

/// Where a value came from (decides how an error names it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The config file.
    File,
    /// The environment variable.
    Env,
}
