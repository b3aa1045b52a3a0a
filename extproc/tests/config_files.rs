//! Every invalid configuration fixture under `tests/config/` is refused with exactly
//! the messages in its `.expected` file (file and field path, every error), and the
//! valid fixture and the shipped demo configuration pass the same code as startup.

use std::path::Path;

use lockmesh_extproc::Config;

fn dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/config"))
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
        // Messages name files relative to the fixture folder.
        let errs = Config::load(&yaml).unwrap_err();
        let prefix = format!("{}/", dir().display());
        let got: Vec<String> = errs.iter().map(|e| e.replace(&prefix, "")).collect();
        assert_eq!(got.join("\n"), want.trim_end(), "{}", yaml.display());
        checked += 1;
    }
    assert!(checked >= 2, "no fixtures found");
}

#[test]
fn the_valid_fixture_loads() {
    let c = Config::load(&dir().join("valid.yaml")).unwrap();
    assert_eq!(c.etcd_root, "/lockmesh");
    assert_eq!(c.max_wait_ms, 30_000);
    assert_eq!(c.registry.classes().len(), 2);
}
