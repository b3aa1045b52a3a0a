//! The CRDs in deploy/crds/ are the generator's output (`LOCKMESH_WRITE_CRDS=1`
//! rewrites them), every schema property is a registry field, and example
//! custom resources pass the CRD schema (jsonschema from the venv scripts/setup
//! installs) and, as a registry, the arbiter's own loader.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{path::PathBuf, process::Command};

use lockmesh_core::{class::RawClass, grant::RawGrant};
use lockmesh_registry::{self as registry, crd};
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn deploy_crds_are_fresh() {
    let write = std::env::var("LOCKMESH_WRITE_CRDS").is_ok_and(|v| v == "1");
    for (file, v) in crd::crds() {
        let path = repo().join("deploy/crds").join(file);
        let text = crd::render(&v).unwrap();
        if write {
            std::fs::write(&path, &text).unwrap();
        }
        let shipped = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            shipped == text,
            "{} is stale: run LOCKMESH_WRITE_CRDS=1 cargo test -p lockmesh-extproc --test crds",
            path.display()
        );
    }
}

fn spec_props(kind: usize) -> serde_json::Map<String, Value> {
    let v = &crd::crds()[kind].1;
    v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        .as_object()
        .unwrap()
        .clone()
}

fn sample(schema: &Value) -> Value {
    match schema["type"].as_str().unwrap() {
        "array" => json!(["a"]),
        "integer" => json!(1),
        "boolean" => json!(true),
        "object" => json!({}),
        _ => json!("x"),
    }
}

#[test]
fn every_crd_property_is_a_registry_field_and_back() {
    let props = spec_props(0);
    for (p, schema) in &props {
        // deny_unknown_fields: the CRD spelling must be a field or an alias.
        let doc = json!({ "name": "x", p.as_str(): sample(schema) });
        serde_json::from_value::<RawClass>(doc).unwrap_or_else(|e| panic!("LockClass spec.{p}: {e}"));
        assert!(p == "default" || crd::CLASS_FIELDS.iter().any(|(c, _)| c == p), "{p} not in CLASS_FIELDS");
    }
    let raw = serde_json::to_value(RawClass::default()).unwrap();
    for k in raw.as_object().unwrap().keys().filter(|k| *k != "name" && *k != "default") {
        let (c, _) = crd::CLASS_FIELDS.iter().find(|(_, r)| r == k).unwrap_or_else(|| panic!("{k} has no CRD field"));
        assert!(props.contains_key(*c), "{c} missing from the LockClass schema");
    }
    let props = spec_props(1);
    let raw = serde_json::to_value(RawGrant::default()).unwrap();
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let props: Vec<String> = props.keys().cloned().collect();
    assert_eq!(sorted(raw.as_object().unwrap().keys().cloned().collect()), props);
    assert_eq!(
        sorted(
            crd::GRANT_FIELDS
                .iter()
                .map(|(c, r)| {
                    assert_eq!(c, r);
                    (*c).to_owned()
                })
                .collect()
        ),
        props
    );
}

/// Validates every document of `file` against the CRD of its kind; one line per
/// document: `name: OK` or `name: path: message; ...`.
fn validate(file: &str) -> Vec<String> {
    let py = repo().join(".tools/k8s-validate/bin/python");
    assert!(py.is_file(), "{} is missing: run ./scripts/setup", py.display());
    let script = r#"
import sys, yaml, jsonschema
crds = {}
for f in sys.argv[2:]:
    c = yaml.safe_load(open(f))
    crds[c["spec"]["names"]["kind"]] = c["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
for d in yaml.safe_load_all(open(sys.argv[1])):
    v = jsonschema.Draft202012Validator(crds[d["kind"]])
    errs = sorted(v.iter_errors(d), key=lambda e: list(map(str, e.absolute_path)))
    print(d["metadata"]["name"] + ": " + ("; ".join("/".join(map(str, e.absolute_path)) + ": " + e.validator for e in errs) or "OK"))
"#;
    let out = Command::new(py)
        .args(["-c", script])
        .arg(repo().join("extproc/tests/crd").join(file))
        .arg(repo().join("deploy/crds/lockclass.yaml"))
        .arg(repo().join("deploy/crds/lockgrant.yaml"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect()
}

#[test]
fn example_resources_pass_the_crd_schema_and_the_arbiter_loader() {
    assert_eq!(validate("examples.yaml"), ["default: OK", "payments: OK", "payments-workers: OK"]);
    assert_eq!(
        validate("invalid.yaml"),
        [
            "zero: spec/maxHolders: minimum",
            "typo: spec/ttlSeconds: maximum",
            "noposture: spec/enforcement: enum; spec/tier: enum",
            "nothing: spec/identity: pattern; spec/operations/0: enum; spec/prefixes: minItems",
        ]
    );
    // The same resources as a registry file: accepted by the arbiter's loader.
    let text = std::fs::read_to_string(repo().join("extproc/tests/crd/examples.yaml")).unwrap();
    let docs = serde_saphyr::from_multiple::<Value>(&text).unwrap();
    let reg = crd::registry_of(&docs, json!({})).unwrap();
    let reg = registry::parse(&serde_saphyr::to_string(&reg).unwrap()).unwrap();
    assert_eq!(reg.get("payments").unwrap().max_holders, 3);
    assert!(reg.grants().is_some());
}
