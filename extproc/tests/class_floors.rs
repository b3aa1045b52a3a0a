//! The class table (issue #16, ADR-11, ADR-24): on a table of good and bad
//! LockClass specs, the arbiter's loader, the LockClass CRD's OpenAPI schema and
//! its CEL rules refuse the same classes, on the same fields (the wording differs).
//!
//! - The loader: each spec becomes a one-class registry the way a LockClass maps
//!   to a registry class (`crd::registry_of`), read by `registry::parse_at` (pause
//!   results checked, as at the arbiter's startup).
//! - The schema: the CRD's `openAPIV3Schema` with jsonschema (Draft 2020-12, the
//!   `date` format checked, as the API server checks it); the CRD object itself with
//!   kubernetes-validate (strict, Kubernetes 1.30 and 1.37), so a rule's `fieldPath`
//!   is a field the API server knows.
//! - The CEL rules: each `x-kubernetes-validations` rule evaluated with cel-python
//!   (module `celpy`). This is an approximation of the API server's CEL (cel-go with
//!   the Kubernetes libraries and cost limits): the same language and rules, not the
//!   same implementation. A rule that fails to evaluate fails the test (the API
//!   server would report it as an error, not a verdict).
//!
//! Each row says which layer refuses which field; the loader must refuse exactly
//! the union, whether the class comes in a registry file or as the LockClass
//! manifest itself in a directory (`registry_dir`). The default table runs against the shipped deploy/crds/lockclass.yaml;
//! a second table against CRDs generated for a registry that lowers the floors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeSet,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use lockmesh_core::{
    class::Platform,
    pause::{PauseEvidence, PauseTestResult, Verdict, SCHEMA_VERSION},
};
use lockmesh_registry::{self as registry, crd};
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The class name of every row, and the pause-test file its fenced rows name.
const CLASS: &str = "t";
const PAUSE_FILE: &str = "pause.yaml";

/// One row: a LockClass spec and the CRD fields each admission layer refuses.
struct Row {
    what: &'static str,
    spec: Value,
    /// Fields the OpenAPI schema refuses.
    schema: &'static [&'static str],
    /// Fields the CEL rules refuse (their `fieldPath`).
    cel: &'static [&'static str],
}

fn row(what: &'static str, spec: Value, schema: &'static [&'static str], cel: &'static [&'static str]) -> Row {
    Row { what, spec, schema, cel }
}

/// A fenced spec resting on the table's pause result, with `extra` merged in.
fn fenced(extra: Value) -> Value {
    merge(json!({ "enforcement": "fenced", "pauseTestResult": PAUSE_FILE }), extra)
}

/// An advisory spec with its waiver, with `extra` merged in (a `null` removes a field).
fn advisory(extra: Value) -> Value {
    merge(json!({ "enforcement": "advisory", "riskOwner": "team-t", "waiverExpiry": "2099-12-31" }), extra)
}

fn merge(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            base.as_object_mut().unwrap().remove(k);
        } else {
            base[k] = v.clone();
        }
    }
    base["default"] = json!(true);
    base
}

/// The table against the default floors (5-300 s, advisory 30 s).
fn default_rows() -> Vec<Row> {
    const TTL: &[&str] = &["ttlSeconds"];
    vec![
        row("fenced ttl 2", fenced(json!({ "ttlSeconds": 2 })), TTL, TTL),
        row("fenced ttl 4", fenced(json!({ "ttlSeconds": 4 })), TTL, TTL),
        row("fenced ttl 5", fenced(json!({ "ttlSeconds": 5 })), &[], &[]),
        row("fenced ttl unset (15)", fenced(json!({})), &[], &[]),
        row("fenced ttl 300", fenced(json!({ "ttlSeconds": 300 })), &[], &[]),
        row("fenced ttl 301", fenced(json!({ "ttlSeconds": 301 })), TTL, TTL),
        row("advisory ttl 2", advisory(json!({ "ttlSeconds": 2 })), TTL, TTL),
        row("advisory ttl 29", advisory(json!({ "ttlSeconds": 29 })), &[], TTL),
        row("advisory ttl 30", advisory(json!({ "ttlSeconds": 30 })), &[], &[]),
        row("advisory ttl unset (15)", advisory(json!({})), &[], TTL),
        row("advisory ttl 300", advisory(json!({ "ttlSeconds": 300 })), &[], &[]),
        row("advisory ttl 301", advisory(json!({ "ttlSeconds": 301 })), TTL, TTL),
        row("fenced maxHolders 1", fenced(json!({ "maxHolders": 1 })), &[], &[]),
        row("fenced maxHolders 2", fenced(json!({ "maxHolders": 2 })), &[], &["maxHolders"]),
        row("advisory maxHolders 5", advisory(json!({ "ttlSeconds": 30, "maxHolders": 5 })), &[], &[]),
        row("advisory maxHolders 0", advisory(json!({ "ttlSeconds": 30, "maxHolders": 0 })), &["maxHolders"], &[]),
        row(
            "advisory without riskOwner",
            advisory(json!({ "ttlSeconds": 30, "riskOwner": null })),
            &[],
            &["riskOwner"],
        ),
        row(
            "advisory with a blank riskOwner",
            advisory(json!({ "ttlSeconds": 30, "riskOwner": " " })),
            &["riskOwner"],
            &[],
        ),
        row(
            "advisory without waiverExpiry",
            advisory(json!({ "ttlSeconds": 30, "waiverExpiry": null })),
            &[],
            &["waiverExpiry"],
        ),
        row(
            "advisory waiverExpiry not a date",
            advisory(json!({ "ttlSeconds": 30, "waiverExpiry": "2026-02-30" })),
            &["waiverExpiry"],
            &[],
        ),
        row("fenced with a riskOwner", fenced(json!({ "riskOwner": "team-t" })), &[], &["riskOwner"]),
        row("fenced with a waiverExpiry", fenced(json!({ "waiverExpiry": "2099-12-31" })), &[], &["waiverExpiry"]),
        row("fenced without pauseTestResult", fenced(json!({ "pauseTestResult": null })), &[], &["pauseTestResult"]),
        row(
            "advisory with a pauseTestResult",
            advisory(json!({ "ttlSeconds": 30, "pauseTestResult": PAUSE_FILE })),
            &[],
            &["pauseTestResult"],
        ),
        row(
            "fenced onQuorumLoss open",
            fenced(json!({ "onQuorumLoss": "open", "purpose": "efficiency" })),
            &[],
            &["onQuorumLoss"],
        ),
        row(
            "advisory onQuorumLoss open, no purpose",
            advisory(json!({ "ttlSeconds": 30, "onQuorumLoss": "open" })),
            &[],
            &["onQuorumLoss"],
        ),
        row(
            "advisory onQuorumLoss open, purpose correctness",
            advisory(json!({ "ttlSeconds": 30, "onQuorumLoss": "open", "purpose": "correctness" })),
            &[],
            &["onQuorumLoss"],
        ),
        row(
            "advisory onQuorumLoss open, purpose efficiency",
            advisory(json!({ "ttlSeconds": 30, "onQuorumLoss": "open", "purpose": "efficiency" })),
            &[],
            &[],
        ),
        row("fenced onQuorumLoss closed", fenced(json!({ "onQuorumLoss": "closed" })), &[], &[]),
        row("no enforcement", json!({ "default": true, "ttlSeconds": 30 }), &["enforcement"], &[]),
        row(
            "enforcement maybe",
            fenced(json!({ "enforcement": "maybe", "pauseTestResult": null })),
            &["enforcement"],
            &[],
        ),
        row("tier edge", fenced(json!({ "tier": "edge" })), &["tier"], &[]),
        row("tier coord, fairness durable", fenced(json!({ "tier": "coord", "fairness": "durable" })), &[], &[]),
        row("prefix not a namespace", fenced(json!({ "prefixes": ["Bad"] })), &["prefixes"], &[]),
    ]
}

/// The table against CRDs generated for a registry that lowers both floors to 2 s.
fn lowered_rows() -> Vec<Row> {
    const TTL: &[&str] = &["ttlSeconds"];
    vec![
        row("lowered: fenced ttl 2", fenced(json!({ "ttlSeconds": 2 })), &[], &[]),
        row("lowered: fenced ttl 1", fenced(json!({ "ttlSeconds": 1 })), TTL, TTL),
        row("lowered: advisory ttl 2", advisory(json!({ "ttlSeconds": 2 })), &[], &[]),
        row("lowered: advisory ttl unset (15)", advisory(json!({})), &[], &[]),
        row("lowered: advisory ttl 301", advisory(json!({ "ttlSeconds": 301 })), TTL, TTL),
    ]
}

const LOWERED: Platform = Platform { min_ttl_s: 2, max_ttl_s: 300, advisory_min_ttl_s: 2 };

/// A scratch directory holding a passing pause result for [`CLASS`], removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Self {
        Self::named("table")
    }

    /// One per test: tests of this binary run at once, and each drop removes its own.
    fn named(what: &str) -> Self {
        let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("class-floors-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let doc = PauseTestResult {
            schema_version: SCHEMA_VERSION.into(),
            class: CLASS.into(),
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
                steps: vec![],
            },
        };
        std::fs::write(p.join(PAUSE_FILE), serde_json::to_string(&doc).unwrap()).unwrap();
        Self(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The loader's verdict: the CRD names of the fields it refuses.
fn loader_fields(spec: &Value, platform: &Value, base: &Path) -> BTreeSet<String> {
    let cr = json!({ "apiVersion": "lockmesh.dev/v1alpha1", "kind": "LockClass", "metadata": { "name": CLASS }, "spec": spec });
    let reg = crd::registry_of(&[cr], platform.clone()).unwrap();
    let Err(errs) = registry::parse_at(&serde_saphyr::to_string(&reg).unwrap(), base) else {
        return BTreeSet::new();
    };
    errs.iter()
        .map(|e| {
            // `classes[0].ttl_s: message` or `classes[0].prefixes[0]: message`.
            let path = e.split(": ").next().unwrap();
            let field = path.strip_prefix("classes[0].").unwrap_or_else(|| panic!("not a class field: {e}"));
            let field = field.split('[').next().unwrap();
            let (c, _) = crd::CLASS_FIELDS
                .iter()
                .find(|(_, r)| *r == field)
                .unwrap_or_else(|| panic!("registry field {field} has no CRD field: {e}"));
            (*c).to_owned()
        })
        .collect()
}

/// The CRD object checked with kubernetes-validate, then per row the schema's and
/// the CEL rules' refused fields.
const CHECK: &str = r#"
import json, sys
import celpy, jsonschema, kubernetes_validate

req = json.load(sys.stdin)
env = celpy.Environment()
out = {"crds": [], "rows": []}
compiled = []
for crd in req["crds"]:
    problems = []
    for version in ("1.30.0", "1.37.0"):
        try:
            kubernetes_validate.validate(crd, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append("Kubernetes %s: %s: %s" % (version, "/".join(map(str, e.path)), e.message))
    out["crds"].append(problems)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [(r["fieldPath"].lstrip("."), r["rule"], env.program(env.compile(r["rule"])))
             for r in schema["properties"]["spec"]["x-kubernetes-validations"]]
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    compiled.append((v, rules))
for row in req["rows"]:
    validator, rules = compiled[row["crd"]]
    doc = {"apiVersion": "lockmesh.dev/v1alpha1", "kind": "LockClass", "metadata": {"name": "t"}, "spec": row["spec"]}
    schema_fields = set()
    for e in validator.iter_errors(doc):
        path = list(map(str, e.absolute_path))
        if e.validator == "required" and path == ["spec"]:
            schema_fields.update(p for p in e.validator_value if p not in e.instance)
        else:
            schema_fields.add(path[1] if len(path) > 1 else "/".join(path) or "<root>")
    cel_fields, cel_errors = set(), []
    for field, text, prog in rules:
        try:
            verdict = prog.evaluate({"self": celpy.json_to_cel(row["spec"])})
        except celpy.CELEvalError as e:
            cel_errors.append("%s: %s" % (text, e))
            continue
        if not isinstance(verdict, celpy.celtypes.BoolType):
            cel_errors.append("%s: not a bool: %r" % (text, verdict))
        elif not verdict:
            cel_fields.add(field)
    out["rows"].append({"schema": sorted(schema_fields), "cel": sorted(cel_fields), "cel_errors": cel_errors})
print(json.dumps(out))
"#;

/// Runs [`CHECK`] in the venv scripts/setup installs.
fn admission(crds: &[Value], rows: &[(usize, &Value)]) -> Value {
    let py = repo().join(".tools/k8s-validate/bin/python");
    assert!(py.is_file(), "{} is missing: run ./scripts/setup", py.display());
    let req =
        json!({ "crds": crds, "rows": rows.iter().map(|(c, s)| json!({ "crd": c, "spec": s })).collect::<Vec<_>>() });
    let mut child = Command::new(py)
        .args(["-c", CHECK])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(req.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the admission check failed (cel-python missing? run ./scripts/setup): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn set(fields: &[&str]) -> BTreeSet<String> {
    fields.iter().map(|f| (*f).to_owned()).collect()
}

fn strings(v: &Value) -> BTreeSet<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_owned()).collect()
}

#[test]
fn the_loader_the_crd_schema_and_its_cel_rules_refuse_the_same_classes_on_the_same_fields() {
    let shipped = std::fs::read_to_string(repo().join("deploy/crds/lockclass.yaml")).unwrap();
    let shipped: Value = serde_saphyr::from_str(&shipped).unwrap();
    let lowered = crd::crds_for(&LOWERED).into_iter().find(|(f, _)| *f == "lockclass.yaml").unwrap().1;
    let lowered_platform = json!({
        "min_ttl_s": LOWERED.min_ttl_s, "advisory_min_ttl_s": LOWERED.advisory_min_ttl_s,
        "lowered_floors_reason": "test registry: short TTLs"
    });
    let tables = [(0, default_rows(), json!({})), (1, lowered_rows(), lowered_platform)];
    let specs: Vec<(usize, &Value)> =
        tables.iter().flat_map(|(c, rows, _)| rows.iter().map(move |r| (*c, &r.spec))).collect();
    let verdicts = admission(&[shipped, lowered], &specs);
    for (i, problems) in verdicts["crds"].as_array().unwrap().iter().enumerate() {
        assert_eq!(problems, &json!([]), "CRD {i} is not a valid CustomResourceDefinition");
    }
    let dir = Dir::new();
    let mut verdicts = verdicts["rows"].as_array().unwrap().iter();
    let (mut refused, mut accepted) = (0, 0);
    for (_, rows, platform) in &tables {
        for r in rows {
            let v = verdicts.next().unwrap();
            let what = r.what;
            assert_eq!(v["cel_errors"], json!([]), "{what}: a CEL rule did not evaluate to a bool");
            let (schema, cel) = (strings(&v["schema"]), strings(&v["cel"]));
            assert_eq!(schema, set(r.schema), "{what}: the OpenAPI schema refuses other fields");
            assert_eq!(cel, set(r.cel), "{what}: the CEL rules refuse other fields");
            let crd_fields: BTreeSet<String> = schema.union(&cel).cloned().collect();
            let loader = loader_fields(&r.spec, platform, &dir.0);
            assert_eq!(loader, crd_fields, "{what}: the loader and CRD admission disagree on {}", r.spec);
            if loader.is_empty() {
                accepted += 1;
            } else {
                refused += 1;
            }
        }
    }
    assert!(verdicts.next().is_none());
    assert!(refused >= 20 && accepted >= 10, "{refused} refused, {accepted} accepted");
}

/// The shipped CRDs encode the default floors, and the generator reads them from
/// core's `Platform`, the value the loader checks: the CRDs for lowered floors
/// differ only where the floors appear.
#[test]
fn the_crds_carry_the_platform_floors_they_were_generated_for() {
    let ttl = |p: &Platform| {
        let v = crd::crds_for(p).into_iter().next().unwrap().1;
        let s = v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"].clone();
        (s["properties"]["ttlSeconds"]["minimum"].clone(), s["properties"]["ttlSeconds"]["maximum"].clone(), v)
    };
    let (min, max, v) = ttl(&Platform::DEFAULT);
    assert_eq!((min, max), (json!(5), json!(300)));
    assert_eq!(v, crd::crds()[0].1, "crds() is crds_for(Platform::DEFAULT)");
    assert_eq!(v["metadata"]["annotations"][crd::LIMITS_ANNOTATION], "5-300 s, advisory >= 30 s (ADR-11 defaults)");
    let (min, _, v) = ttl(&LOWERED);
    assert_eq!(min, json!(2));
    assert_eq!(
        v["metadata"]["annotations"][crd::LIMITS_ANNOTATION],
        "2-300 s, advisory >= 2 s (lowered: lockctl class crds)"
    );
    let rules = v.to_string();
    assert!(rules.contains(">= 2 && (has(self.ttlSeconds) ? self.ttlSeconds : 15) <= 300"), "{rules}");
}

/// The directory path's verdict (`registry_dir`): the CRD names of the fields it
/// refuses when the row's LockClass is the one manifest of a directory. The
/// table's pause result sits beside the directory (a `.yaml` inside would be read
/// as a manifest), so a fenced row names `../pause.yaml`.
fn directory_fields(spec: &Value, platform: &Value, base: &Path) -> BTreeSet<String> {
    let dir = base.join("manifests");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut spec = spec.clone();
    if spec.get("pauseTestResult").is_some() {
        spec["pauseTestResult"] = json!(format!("../{PAUSE_FILE}"));
    }
    let cr = json!({ "apiVersion": "lockmesh.dev/v1alpha1", "kind": "LockClass", "metadata": { "name": CLASS }, "spec": spec });
    std::fs::write(dir.join("class.yaml"), serde_saphyr::to_string(&cr).unwrap()).unwrap();
    let platform: lockmesh_core::class::RawPlatform = serde_json::from_value(platform.clone()).unwrap();
    let Err(errs) = crd::load_dir(&dir, &platform) else {
        return BTreeSet::new();
    };
    let at = format!("{}: document 0 (LockClass {CLASS}): ", dir.join("class.yaml").display());
    errs.iter()
        .map(|e| {
            // `...: document 0 (LockClass t): spec.ttlSeconds: message`.
            let rest = e.strip_prefix(&at).unwrap_or_else(|| panic!("not at the manifest: {e}"));
            let field = rest.strip_prefix("spec.").unwrap_or_else(|| panic!("not a spec field: {e}"));
            field.split([':', '[']).next().unwrap().to_owned()
        })
        .collect()
}

/// The same table through the directory of manifests: the loader refuses the same
/// classes on the same fields whether they come as a registry file or as the
/// LockClass resources themselves (which the rows above prove the CRD's schema and
/// CEL rules refuse on those fields too).
#[test]
fn the_manifest_directory_refuses_the_table_on_the_same_fields_as_the_registry_file() {
    let dir = Dir::named("directory");
    let lowered_platform = json!({
        "min_ttl_s": LOWERED.min_ttl_s, "advisory_min_ttl_s": LOWERED.advisory_min_ttl_s,
        "lowered_floors_reason": "test registry: short TTLs"
    });
    let (mut refused, mut accepted) = (0, 0);
    for (rows, platform) in [(default_rows(), json!({})), (lowered_rows(), lowered_platform)] {
        for r in rows {
            let file = loader_fields(&r.spec, &platform, &dir.0);
            let want: BTreeSet<String> = set(r.schema).union(&set(r.cel)).cloned().collect();
            assert_eq!(file, want, "{}: the registry file path", r.what);
            assert_eq!(directory_fields(&r.spec, &platform, &dir.0), want, "{}: the directory path", r.what);
            if want.is_empty() {
                accepted += 1;
            } else {
                refused += 1;
            }
        }
    }
    assert!(refused >= 20 && accepted >= 10, "{refused} refused, {accepted} accepted");
}
