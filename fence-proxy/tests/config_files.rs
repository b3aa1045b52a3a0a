//! fence-proxy's configuration fixtures (`tests/config/`): every invalid fixture is
//! refused with exactly the messages in its `.expected` file (file and field path,
//! or the overriding variable, every error). A fixture's `.env` file, if any, holds
//! the `LOCKMESH_FENCE_*` overrides it is loaded with (through the `EnvSource`
//! trait, never `set_var`). `--check-config` runs the same code as startup.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use lockmesh_fence_proxy::{config::env::NoEnv, route::EqualRule, Config};

fn dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/config"))
}

/// The overrides of `<fixture>.env` (KEY=VALUE lines; values kept verbatim).
fn env_of(yaml: &Path) -> Option<HashMap<String, String>> {
    let text = std::fs::read_to_string(yaml.with_extension("env")).ok()?;
    Some(text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
}

fn load(yaml: &Path) -> Result<Config, Vec<String>> {
    match env_of(yaml) {
        Some(env) => Config::load_with(yaml, &env),
        None => Config::load_with(yaml, &NoEnv),
    }
}

fn relative(errs: &[String]) -> String {
    let prefix = format!("{}/", dir().display());
    errs.iter().map(|e| e.replace(&prefix, "")).collect::<Vec<_>>().join("\n")
}

#[test]
fn invalid_fixtures_report_every_error_with_its_path() {
    let mut checked = 0;
    for entry in std::fs::read_dir(dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("expected") {
            continue;
        }
        let yaml = path.with_extension("yaml");
        let want = std::fs::read_to_string(&path).unwrap();
        let errs = load(&yaml).err().unwrap_or_else(|| panic!("{} loaded", yaml.display()));
        assert_eq!(relative(&errs), want.trim_end(), "{}", yaml.display());
        checked += 1;
    }
    assert!(checked >= 4, "fixtures missing: {checked}");
}

#[test]
fn the_valid_fixture_loads_with_its_defaults_and_paths() {
    let c = load(&dir().join("valid.yaml")).unwrap();
    assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.upstream, "http://127.0.0.1:9000", "the trailing slash is dropped");
    assert_eq!(c.marks_dir, dir().join("marks"), "relative to the config file");
    assert_eq!(c.upstream_timeout.as_millis(), 2500);
    assert_eq!(c.max_body_bytes, lockmesh_fence_proxy::config::DEFAULT_MAX_BODY_BYTES);
    assert_eq!(
        c.routes.iter().map(|r| (r.name.as_str(), r.equal)).collect::<Vec<_>>(),
        [("items", EqualRule::Strict), ("logs", EqualRule::Allow)]
    );
    assert!(c.unlisted.is_some());
}

#[test]
fn overrides_replace_the_file_and_may_stand_in_for_it() {
    // The injector's shape: the file has no address fields at all.
    let c = load(&dir().join("env-only.yaml")).unwrap();
    assert_eq!(c.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(c.admin_listen.to_string(), "0.0.0.0:15300");
    assert_eq!(c.upstream, "http://127.0.0.1:15081");
    assert_eq!(c.marks_dir, PathBuf::from("/var/lib/lockmesh/marks"));
    // Over a complete file, each variable wins over its field; the rest stay.
    let env = [("LOCKMESH_FENCE_LISTEN", "127.0.0.1:9999"), ("LOCKMESH_FENCE_MARKS_DIR", "rel")];
    let c = Config::load_with(&dir().join("valid.yaml"), &env).unwrap();
    assert_eq!(c.listen.to_string(), "127.0.0.1:9999");
    assert_eq!(c.admin_listen.to_string(), "127.0.0.1:8081");
    assert_eq!(c.marks_dir, PathBuf::from("rel"), "an env path is not relative to the file");
}

fn check_config(path: &Path, env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockmesh-fence-proxy"));
    cmd.arg("--check-config").arg(path);
    for (k, _) in lockmesh_fence_proxy::config::env::OVERRIDES {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_uses_the_startup_code_and_the_process_environment() {
    let (code, out, _) = check_config(&dir().join("valid.yaml"), &[]);
    assert_eq!((code, out.trim_end().ends_with("valid.yaml: OK")), (Some(0), true), "{out}");
    let (code, _, err) = check_config(&dir().join("many-errors.yaml"), &[]);
    assert_eq!(code, Some(64), "{err}");
    let want = std::fs::read_to_string(dir().join("many-errors.expected")).unwrap();
    let prefix = format!("{}/", dir().display());
    let err = err.replace(&prefix, "");
    assert!(err.starts_with(&format!("invalid configuration ({} errors):", want.lines().count())), "{err}");
    for line in want.lines() {
        assert!(err.contains(&format!("  {line}\n")), "--check-config does not say {line:?}:\n{err}");
    }
    // The real environment is read: a bad override fails a valid file.
    let (code, _, err) = check_config(&dir().join("valid.yaml"), &[("LOCKMESH_FENCE_UPSTREAM", "store:9000")]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("LOCKMESH_FENCE_UPSTREAM (overrides "), "{err}");
    let (code, _, err) = check_config(&dir().join("env-only.yaml"), &[]);
    assert_eq!(code, Some(64), "{err}");
    let (code, out, err) = check_config(
        &dir().join("env-only.yaml"),
        &[
            ("LOCKMESH_FENCE_LISTEN", "0.0.0.0:8080"),
            ("LOCKMESH_FENCE_ADMIN_LISTEN", "0.0.0.0:15300"),
            ("LOCKMESH_FENCE_UPSTREAM", "http://127.0.0.1:15081"),
            ("LOCKMESH_FENCE_MARKS_DIR", "/var/lib/lockmesh/marks"),
        ],
    );
    assert_eq!(code, Some(0), "{out}{err}");
}
