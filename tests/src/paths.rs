//! Where the repository, the cargo target directory and the pinned tools are.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context as _, Result};
use tempfile::TempDir;

/// The repository root (the parent of this crate's folder).
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cargo target directory: `CARGO_TARGET_DIR` if set (relative to the
/// repository root if relative), else derived from the running executable
/// (`<target>/<profile>/deps/<test>-<hash>` or `<target>/<profile>/<bin>`),
/// else `<repo>/target`.
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        return if dir.is_absolute() { dir } else { repo_root().join(dir) };
    }
    profile_dir_from_exe()
        .and_then(|profile| profile.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| repo_root().join("target"))
}

/// The environment variable naming a frozen copy of the built binaries (see
/// [`profile_dir`]).
pub const BIN_DIR_ENV: &str = "LOCKMESH_BIN_DIR";

/// A frozen copy of the built binaries, if `LOCKMESH_BIN_DIR` names one.
///
/// A long gate run (docs/GATE.md) lasts an hour while others rebuild
/// `target/debug`; it copies `lockmesh-gate`, `lockmesh-extproc`, `lockctl`,
/// `lockmesh-fence-proxy` and `lockmesh_wasm_filter.wasm` into one directory and
/// runs them from there.
pub fn frozen_bin_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os(BIN_DIR_ENV).filter(|d| !d.is_empty())?);
    Some(if dir.is_absolute() { dir } else { repo_root().join(dir) })
}

/// The directory of the host build profile this binary was built with
/// (`<target>/debug` normally), where workspace binaries such as
/// `lockmesh-extproc` are; `LOCKMESH_BIN_DIR` overrides it ([`frozen_bin_dir`]).
pub fn profile_dir() -> PathBuf {
    if let Some(dir) = frozen_bin_dir() {
        return dir;
    }
    if let Some(profile) = profile_dir_from_exe() {
        // Only trust the executable's location if it is under the target dir
        // (it is not when CARGO_TARGET_DIR points elsewhere than it was built).
        if profile.parent() == Some(target_dir().as_path()) {
            return profile;
        }
    }
    target_dir().join("debug")
}

fn profile_dir_from_exe() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let parent = exe.parent()?;
    if parent.file_name()? == "deps" {
        parent.parent().map(Path::to_path_buf)
    } else {
        Some(parent.to_path_buf())
    }
}

/// A pinned binary: `$env_var` if set, else `default`; fails with
/// `"<what> not installed: run scripts/setup"` when it does not exist.
pub fn tool(env_var: &str, default: PathBuf, what: &str) -> Result<PathBuf> {
    let path = std::env::var_os(env_var).filter(|p| !p.is_empty()).map(PathBuf::from).unwrap_or(default);
    if !path.is_file() {
        bail!("{what} not installed: run scripts/setup (looked for {}; override with {env_var})", path.display());
    }
    Ok(path)
}

/// This test binary's scratch directory, `$TMPDIR/lockmesh-tests/<pid>/`.
///
/// Every temporary directory of the harness lives under it. `Drop` removes
/// each one; what a killed test binary leaves behind (and the shared etcd's
/// data, whose static is never dropped) is removed by the next binary: the
/// first call removes the directories of pids that no longer run.
pub fn scratch_dir() -> Result<PathBuf> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    if let Some(dir) = DIR.get() {
        return Ok(dir.clone());
    }
    let base = std::env::temp_dir().join("lockmesh-tests");
    std::fs::create_dir_all(&base).with_context(|| format!("create {}", base.display()))?;
    sweep_dead(&base);
    let own = base.join(std::process::id().to_string());
    std::fs::create_dir_all(&own).with_context(|| format!("create {}", own.display()))?;
    Ok(DIR.get_or_init(|| own).clone())
}

/// A new temporary directory `<scratch>/<prefix>XXXXXX`, removed on drop.
pub fn temp_dir(prefix: &str) -> Result<TempDir> {
    let scratch = scratch_dir()?;
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&scratch)
        .with_context(|| format!("create a temp dir in {}", scratch.display()))
}

/// Removes `<base>/<pid>` directories whose process is gone.
fn sweep_dead(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_root_holds_the_workspace() {
        assert!(repo_root().join("Cargo.toml").is_file());
        assert!(repo_root().join("tests").is_dir());
    }

    #[test]
    fn missing_tool_names_the_setup_command() {
        let err = tool("LOCKMESH_TESTS_NO_SUCH_VAR", "/nonexistent/x".into(), "frob").unwrap_err().to_string();
        assert!(err.starts_with("frob not installed: run scripts/setup"), "{err}");
    }
}
