//! The class registry as a directory of LockClass/LockGrant manifests (ADR-24,
//! `registry_dir`, `lockmesh_registry::crd::manifests`): the shipped example
//! (deploy/overlays/registry-dir/classes) loads; the kubelet's `..data` swap is
//! seen as one change of the directory's content hash; envelopes, unknown fields
//! and duplicates are refused naming file, document and field; and a planted
//! check: the test of "every file is read and validated" fails a loader that
//! reads only the first file, and one that maps manifests without the CRD's
//! structure (`crd::registry_of`, which accepts the registry file's snake_case
//! spellings the API server would prune).
//! The class table of class_floors.rs runs through the directory path there.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use lockmesh_core::{class::RawPlatform, ClassRegistry};
use lockmesh_registry::{
    self as registry,
    crd::{self, manifests::Snapshot},
};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Self {
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("class-dir-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Publishes `files` into `dir` as the kubelet updates a ConfigMap volume: the
/// content in a new `..<version>` directory, the `..data` link swapped to it by
/// one rename, then the per-file links (`name -> ..data/name`) added or removed.
fn publish(dir: &Path, version: &str, files: &[(&str, &str)]) {
    let ts = format!("..{version}");
    std::fs::create_dir_all(dir.join(&ts)).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(&ts).join(name), text).unwrap();
    }
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&ts, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if !name.starts_with('.') && !files.iter().any(|(n, _)| *n == name) {
            std::fs::remove_file(dir.join(&name)).unwrap();
        }
    }
    for (name, _) in files {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("..data/{name}"), &link).unwrap();
        }
    }
}

fn class(name: &str, spec: &str) -> String {
    format!("apiVersion: lockmesh.dev/v1alpha1\nkind: LockClass\nmetadata:\n  name: {name}\nspec:\n{spec}")
}

const ADVISORY: &str = "  enforcement: advisory\n  riskOwner: t\n  waiverExpiry: \"2099-12-31\"\n";

fn default_class() -> String {
    class("default", &format!("  default: true\n  ttlSeconds: 30\n{ADVISORY}"))
}

fn reports_class() -> String {
    class("reports", &format!("  prefixes: [reports]\n  ttlSeconds: 45\n{ADVISORY}"))
}

fn load(dir: &Path) -> Result<ClassRegistry, Vec<String>> {
    crd::load_dir(dir, &RawPlatform::default())
}

#[test]
fn the_example_overlay_manifests_load_as_the_registry_they_declare() {
    let dir = repo().join("deploy/overlays/registry-dir/classes");
    let reg = load(&dir).unwrap();
    let names: Vec<&str> = reg.classes().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["default", "payments", "payments-batch"], "files in name order, documents in file order");
    let batch = reg.get("payments-batch").unwrap();
    assert_eq!((batch.ttl_s, batch.max_holders), (120, 3));
    let grants = reg.grants().expect("the LockGrant documents");
    let op = lockmesh_core::grant::Operation::Acquire;
    let key = lockmesh_core::key::LockKey::parse(b"payments/order-1").unwrap();
    assert!(grants.allowed("spiffe://cluster.local/ns/payments/sa/a", &key, op));
    assert!(!grants.allowed("spiffe://cluster.local/ns/billing/sa/a", &key, op));
}

#[test]
fn a_kubelet_data_swap_is_one_change_of_the_directory_and_dotfiles_are_not_read() {
    let s = Scratch::new("swap");
    publish(&s.0, "v1", &[("default.yaml", &default_class())]);
    let one = Snapshot::read(&s.0).unwrap();
    assert_eq!(one.files.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(), ["default.yaml"], "..data skipped");
    assert_eq!(Snapshot::read(&s.0).unwrap().hash(), one.hash(), "an unchanged directory keeps its hash");
    assert_eq!(one.parse(&RawPlatform::default()).unwrap().classes().len(), 1);
    // A new file arrives with the swap: a new hash, and its class.
    publish(&s.0, "v2", &[("default.yaml", &default_class()), ("reports.yaml", &reports_class())]);
    let two = Snapshot::read(&s.0).unwrap();
    assert_ne!(two.hash(), one.hash());
    assert!(two.parse(&RawPlatform::default()).unwrap().get("reports").is_some());
    // A file removed by the swap is gone, and a dangling link (the moment between
    // the swap and the link's removal) is skipped rather than an error.
    std::fs::remove_dir_all(s.0.join("..v1")).unwrap();
    std::os::unix::fs::symlink("..data/gone.yaml", s.0.join("gone.yaml")).unwrap();
    let three = Snapshot::read(&s.0).unwrap();
    assert_eq!(three.hash(), two.hash(), "a dangling link is not content");
    // A renamed file is a change even with the same bytes.
    std::fs::remove_file(s.0.join("gone.yaml")).unwrap();
    publish(&s.0, "v3", &[("default.yaml", &default_class()), ("reports2.yaml", &reports_class())]);
    assert_ne!(Snapshot::read(&s.0).unwrap().hash(), two.hash());
    // A bad swap: refused (the arbiter's reload keeps the last good registry,
    // tests/tests/scenarios/class_dir.rs), naming the file and the field.
    publish(&s.0, "v4", &[("default.yaml", &default_class().replace("ttlSeconds: 30", "ttlSeconds: 3"))]);
    let errs = load(&s.0).unwrap_err();
    let file = s.0.join("default.yaml");
    assert_eq!(
        errs,
        [format!(
            "{}: document 0 (LockClass default): spec.ttlSeconds: 3s is outside the platform range 5s to 300s",
            file.display()
        )]
    );
}

#[test]
fn envelopes_unknown_fields_types_and_duplicates_are_refused_naming_file_document_and_field() {
    let s = Scratch::new("bad");
    let grant = "apiVersion: lockmesh.dev/v1alpha1\nkind: LockGrant\nmetadata: { name: g }\nspec:\n  identity: \
                 spiffe://t/ns/a/\n  prefixes: [a]\n  operations: [acquire]\n";
    let files = [
        ("a.yaml", default_class()),
        (
            "b.yml",
            [
                "apiVersion: lockmesh.dev/v1beta9\nkind: LockClass\nmetadata: { name: x }\nspec: {}\n".to_owned(),
                "apiVersion: lockmesh.dev/v1alpha1\nkind: ConfigMap\nmetadata: { name: x }\n".into(),
                "apiVersion: lockmesh.dev/v1alpha1\nkind: LockClass\nmetadata: { name: Upper }\nspec: {}\n".into(),
                class("snake", &format!("  ttl_s: 30\n{ADVISORY}")),
                class("typed", &format!("  ttlSeconds: \"30\"\n{ADVISORY}")),
                class("default", &format!("  ttlSeconds: 30\n{ADVISORY}")),
                format!("{}status: {{}}\n", class("extra", &format!("  ttlSeconds: 30\n{ADVISORY}"))),
                "apiVersion: lockmesh.dev/v1alpha1\nkind: LockClass\nmetadata: { name: nospec }\n".into(),
                grant.replace("[acquire]", "[acquire, steal]"),
            ]
            .join("---\n"),
        ),
        ("c.yaml.bak", "not: read".to_owned()),
        (".hidden.yaml", "not: read".to_owned()),
    ];
    for (n, t) in &files {
        std::fs::write(s.0.join(n), t).unwrap();
    }
    let errs = load(&s.0).unwrap_err();
    let b = s.0.join("b.yml").display().to_string();
    let a = s.0.join("a.yaml").display().to_string();
    let want = [
        format!("{b}: document 0: apiVersion: Some(\"lockmesh.dev/v1beta9\") is not lockmesh.dev/v1alpha1"),
        format!("{b}: document 1: kind: Some(\"ConfigMap\") is not LockClass or LockGrant"),
        format!(
            "{b}: document 2: metadata.name: \"Upper\" is not a DNS subdomain name (lowercase letters, digits, '-' and \
             '.')"
        ),
        format!(
            "{b}: document 3 (LockClass snake): spec.ttl_s: unknown field (the CRD's fields here: candidate, default, \
             enforcement, fairness, lockDelaySeconds, maxHolders, onQuorumLoss, pauseTestResult, prefixes, purpose, riskOwner, tier, \
             ttlSeconds, waiverExpiry)"
        ),
        format!("{b}: document 4 (LockClass typed): spec.ttlSeconds: must be an integer, got a string"),
        format!(
            "{b}: document 5 (LockClass default): metadata.name: LockClass \"default\" is also document 0 of {a}: \
             each name once"
        ),
        format!(
            "{b}: document 6 (LockClass extra): status: unknown field (the CRD's fields here: apiVersion, kind, \
             metadata, spec)"
        ),
        format!("{b}: document 7 (LockClass nospec): spec: required"),
        format!("{b}: document 8 (LockGrant g): spec.operations[1]: unknown operation \"steal\""),
    ];
    // The last line is the loader's own wording for the grant's operation.
    assert_eq!(errs[..want.len() - 1], want[..want.len() - 1], "{errs:#?}");
    assert!(errs[want.len() - 1].starts_with(&format!("{b}: document 8 (LockGrant g): spec.operations")), "{errs:#?}");
    assert_eq!(errs.len(), want.len(), "{errs:#?}");
}

/// The check this test plants failures against: every file of the directory is
/// read, and every document is checked against the CRD's structure, not only
/// mapped. `Err` says which property a loader misses.
fn every_file_read_and_validated(load: &dyn Fn(&Path) -> Result<ClassRegistry, Vec<String>>) -> Result<(), String> {
    let s = Scratch::new("planted");
    // Three files; the class of the last one must be there.
    publish(
        &s.0,
        "v1",
        &[
            ("a-default.yaml", &default_class()),
            ("b-grants.yaml", "apiVersion: lockmesh.dev/v1alpha1\nkind: LockGrant\nmetadata: { name: g }\nspec: { identity: \"spiffe://t/ns/a/\", prefixes: [reports], operations: [acquire] }\n"),
            ("c-reports.yaml", &reports_class()),
        ],
    );
    let reg = load(&s.0).map_err(|e| format!("a valid directory refused: {e:?}"))?;
    if reg.get("reports").is_none() || reg.grants().is_none() {
        return Err("a file of the directory was not read".into());
    }
    // A later file's spec in the registry file's spelling (`ttl_s`): not a CRD
    // field, so the API server would prune it and admit a 15 s advisory class
    // only if its CEL rules let it; the directory must refuse it, at that file.
    let snake = class("late", &format!("  prefixes: [late]\n  ttl_s: 60\n{ADVISORY}"));
    publish(
        &s.0,
        "v2",
        &[("a-default.yaml", &default_class()), ("c-reports.yaml", &reports_class()), ("d-late.yaml", &snake)],
    );
    match load(&s.0) {
        Ok(_) => Err("a spec field the CRD does not have was accepted: the CRD's structure was not checked".into()),
        Err(errs) if errs.iter().any(|e| e.contains("d-late.yaml") && e.contains("spec.ttl_s")) => Ok(()),
        Err(errs) => Err(format!("refused, but not at d-late.yaml spec.ttl_s: {errs:?}")),
    }
}

#[test]
fn the_directory_loader_reads_and_validates_every_file_and_the_check_fails_planted_loaders() {
    every_file_read_and_validated(&load).unwrap();
    // Planted: a loader that reads only the first manifest file.
    let first_only = |dir: &Path| {
        let mut snap = Snapshot::read(dir).map_err(|e| vec![e])?;
        snap.files.truncate(1);
        snap.parse(&RawPlatform::default())
    };
    let e = every_file_read_and_validated(&first_only).unwrap_err();
    assert!(e.contains("was not read") || e.contains("refused"), "{e}");
    // Planted: a loader that maps each document straight into the registry
    // (`crd::registry_of`), skipping the CRD's structure.
    let unchecked = |dir: &Path| {
        let snap = Snapshot::read(dir).map_err(|e| vec![e])?;
        let mut docs = Vec::new();
        for f in &snap.files {
            let text = String::from_utf8(f.bytes.clone()).unwrap();
            docs.extend(serde_saphyr::from_multiple::<Value>(&text).unwrap());
        }
        let reg = crd::registry_of(&docs, serde_json::json!({})).map_err(|e| vec![e])?;
        registry::parse_at(&serde_saphyr::to_string(&reg).unwrap(), dir)
    };
    let e = every_file_read_and_validated(&unchecked).unwrap_err();
    assert!(e.contains("structure was not checked"), "{e}");
}
