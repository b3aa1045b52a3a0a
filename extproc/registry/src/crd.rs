//! The `LockClass` and `LockGrant` CustomResourceDefinitions (group
//! `lockmesh.dev`, version `v1alpha1`), generated from the registry schema
//! (`lockmesh_core::class::RawClass`, `lockmesh_core::grant::RawGrant`) without
//! Kubernetes client crates. A LockClass is one `classes` entry with its `name`
//! in `metadata.name` and the rest, in the CRD spellings, in `spec`; a LockGrant
//! is one `grants` entry. `extproc/tests/crds.rs` checks that the files in
//! `deploy/crds/` are this output and that every property maps to a registry
//! field (`LOCKMESH_WRITE_CRDS=1` rewrites them).
//!
//! The TTL limits come from the same [`Platform`] value the arbiter's loader
//! checks (`lockmesh_core::class`): `ttlSeconds` carries them as OpenAPI
//! `minimum`/`maximum` and as CEL rules (the range, with the default TTL when
//! unset, and the advisory floor). The shipped files encode
//! [`Platform::DEFAULT`]; [`crds_for`] renders them for a registry's own floors
//! (`lockctl class crds FILE`). `extproc/tests/class_floors.rs` checks on a table
//! of classes that the loader, the schema and the CEL rules refuse the same ones
//! on the same fields.

use lockmesh_core::class::{Platform, MAX_LOCK_DELAY_S, PLATFORM_DEFAULT_TTL_S};
use serde_json::{json, Value};

pub mod manifests;

pub use manifests::load_dir;

/// The API group.
pub(crate) const GROUP: &str = "lockmesh.dev";
/// The served and stored version.
pub const VERSION: &str = "v1alpha1";

/// `(CRD spec property, registry field)` of a LockClass, in schema order.
pub const CLASS_FIELDS: [(&str, &str); 13] = [
    ("prefixes", "prefixes"),
    ("tier", "tier"),
    ("ttlSeconds", "ttl_s"),
    ("enforcement", "enforcement"),
    ("riskOwner", "risk_owner"),
    ("waiverExpiry", "waiver_expiry"),
    ("onQuorumLoss", "on_quorum_loss"),
    ("purpose", "purpose"),
    ("maxHolders", "max_holders"),
    ("fairness", "fairness"),
    ("lockDelaySeconds", "lock_delay_s"),
    ("candidate", "candidate"),
    ("pauseTestResult", "pause_test_result"),
];

/// `(CRD spec property, registry field)` of a LockGrant.
pub const GRANT_FIELDS: [(&str, &str); 3] =
    [("identity", "identity"), ("prefixes", "prefixes"), ("operations", "operations")];

fn prefixes() -> Value {
    json!({ "type": "array", "description": "Key prefixes (namespace or namespace/path), matched on / boundaries.",
            "items": { "type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(/[^/]+)*$" } })
}

/// One CEL rule refused at `field` (the API server reports it there, as the
/// arbiter's loader reports the registry field).
fn rule(rule: String, field: &str, message: String) -> Value {
    json!({ "rule": rule, "fieldPath": format!(".{field}"), "message": message })
}

fn class_spec(p: &Platform) -> Value {
    let Platform { min_ttl_s: min, max_ttl_s: max, advisory_min_ttl_s: adv } = *p;
    let d = PLATFORM_DEFAULT_TTL_S;
    // The CEL rules must not fail on an absent field (a runtime error, not a
    // verdict): `enforcement` is required by the schema, but tested with has().
    let fenced = "(has(self.enforcement) && self.enforcement == 'fenced')";
    let advisory = "(has(self.enforcement) && self.enforcement == 'advisory')";
    let ttl = format!("(has(self.ttlSeconds) ? self.ttlSeconds : {d})");
    json!({
        "type": "object",
        "required": ["enforcement"],
        "properties": {
            "prefixes": prefixes(),
            "tier": { "type": "string", "enum": ["coord", "entity"], "description": "Cluster tier (ADR-07). Default entity." },
            "ttlSeconds": { "type": "integer", "minimum": min, "maximum": max,
                            "description": format!("Session TTL, seconds (ADR-11): {min} to {max}, default {d}; advisory classes at least {adv}.") },
            "enforcement": { "type": "string", "enum": ["fenced", "advisory"], "description": "ADR-01: fenced (needs a passing pause test) or advisory (needs riskOwner and waiverExpiry)." },
            "riskOwner": { "type": "string", "minLength": 1, "pattern": "\\S", "description": "Advisory classes: who owns the risk (not blank)." },
            "waiverExpiry": { "type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "format": "date", "description": "Advisory classes: waiver end, YYYY-MM-DD (UTC)." },
            "onQuorumLoss": { "type": "string", "enum": ["closed", "open"], "description": "ADR-04: closed (default) or open: grant from the arbiter's memory with token 0 during a quorum loss, spooled and audited as unprotected. open needs enforcement advisory and purpose efficiency." },
            "purpose": { "type": "string", "enum": ["correctness", "efficiency"], "description": "ADR-04: what a second holder costs. Only an efficiency class may declare onQuorumLoss open." },
            "maxHolders": { "type": "integer", "minimum": 1, "description": "Most holders of one key; fenced classes need 1. 0 is refused: it would pause every key of the class." },
            "fairness": { "type": "string", "enum": ["memory", "durable"], "description": "Waiter order (ADR-14). Default memory." },
            "lockDelaySeconds": { "type": "integer", "minimum": 0, "maximum": MAX_LOCK_DELAY_S,
                                  "description": format!("Seconds a key stays ungrantable after its hold ended without a release (session expired, force release). Default 0 (off), at most {MAX_LOCK_DELAY_S}; mutex classes only (maxHolders 1).") },
            "candidate": { "type": "object", "additionalProperties": false, "minProperties": 1,
                           "description": "Shadow mode: a policy evaluated beside the enforced one; every decision it would make differently is counted and audited (would_refuse, would_grant). It never decides.",
                           "properties": {
                               "maxHolders": { "type": "integer", "minimum": 1, "maximum": lockmesh_core::class::MAX_HOLDERS },
                               "lockDelaySeconds": { "type": "integer", "minimum": 0, "maximum": MAX_LOCK_DELAY_S },
                               "ttlSeconds": { "type": "integer", "minimum": min, "maximum": max } } },
            "pauseTestResult": { "type": "string", "minLength": 1, "description": "Fenced classes: the PauseTestResult file, relative to the registry file." },
            "default": { "type": "boolean", "description": "The class of keys no prefix covers; exactly one class sets it." }
        },
        "x-kubernetes-validations": [
            rule(format!("{ttl} >= {min} && {ttl} <= {max}"), "ttlSeconds",
                 format!("ttlSeconds (default {d}) must be within the platform range {min} to {max} s (ADR-11)")),
            rule(format!("!{advisory} || {ttl} >= {adv}"), "ttlSeconds",
                 format!("an advisory class needs ttlSeconds (default {d}) of at least {adv} s: it has no fence, its TTL is the only protection against a paused holder (ADR-11)")),
            rule(format!("!{fenced} || !has(self.maxHolders) || self.maxHolders == 1"), "maxHolders",
                 "a fenced class admits one holder at a time (maxHolders 1)".into()),
            rule("!has(self.lockDelaySeconds) || self.lockDelaySeconds == 0 || !has(self.maxHolders) || self.maxHolders == 1".into(),
                 "lockDelaySeconds", "lock-delay is defined for mutex classes (maxHolders 1)".into()),
            rule(format!("!{advisory} || has(self.riskOwner)"), "riskOwner",
                 "an advisory class needs riskOwner (ADR-01)".into()),
            rule(format!("!{advisory} || has(self.waiverExpiry)"), "waiverExpiry",
                 "an advisory class needs waiverExpiry (ADR-01)".into()),
            rule(format!("!{fenced} || !has(self.riskOwner)"), "riskOwner",
                 "only advisory classes carry a waiver (riskOwner)".into()),
            rule(format!("!{fenced} || !has(self.waiverExpiry)"), "waiverExpiry",
                 "only advisory classes carry a waiver (waiverExpiry)".into()),
            rule(format!("!{fenced} || has(self.pauseTestResult)"), "pauseTestResult",
                 "a fenced class needs pauseTestResult (ADR-17)".into()),
            rule(format!("{fenced} || !has(self.pauseTestResult)"), "pauseTestResult",
                 "only a fenced class rests on a pause test (pauseTestResult)".into()),
            rule(format!("!has(self.onQuorumLoss) || self.onQuorumLoss != 'open' || ({advisory} && has(self.purpose) && self.purpose == 'efficiency')"), "onQuorumLoss",
                 "onQuorumLoss open needs enforcement advisory and purpose efficiency (ADR-04)".into())
        ]
    })
}

fn grant_spec() -> Value {
    json!({
        "type": "object",
        "required": ["identity", "prefixes", "operations"],
        "properties": {
            "identity": { "type": "string", "pattern": "^spiffe://", "description": "An exact SPIFFE ID, or an ID prefix ending in /." },
            "prefixes": { "minItems": 1, "type": "array", "items": prefixes()["items"].clone(), "description": prefixes()["description"].clone() },
            "operations": { "type": "array", "minItems": 1,
                            "items": { "type": "string", "enum": ["acquire", "inspect", "validate", "admin"] } }
        }
    })
}

/// The annotation naming the TTL limits a generated CRD encodes.
pub const LIMITS_ANNOTATION: &str = "lockmesh.dev/ttl-limits";

fn limits(p: &Platform) -> String {
    let lowered = if p.lowered_floors().is_empty() { "ADR-11 defaults" } else { "lowered: lockctl class crds" };
    format!("{}-{} s, advisory >= {} s ({lowered})", p.min_ttl_s, p.max_ttl_s, p.advisory_min_ttl_s)
}

fn crd(kind: &str, plural: &str, short: &str, spec: Value, columns: Value, annotations: Value) -> Value {
    let mut v = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": format!("{plural}.{GROUP}"), "labels": { "app.kubernetes.io/part-of": "lockmesh" },
                      "annotations": annotations },
        "spec": {
            "group": GROUP,
            "scope": "Cluster",
            "names": { "kind": kind, "listKind": format!("{kind}List"), "plural": plural,
                       "singular": kind.to_lowercase(), "shortNames": [short] },
            "versions": [{
                "name": VERSION, "served": true, "storage": true,
                "additionalPrinterColumns": columns,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "description": format!("lockmesh {kind} (docs/CLASSES.md); generated from the registry schema, do not edit."),
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": { "type": "string" }, "kind": { "type": "string" }, "metadata": { "type": "object" },
                        "spec": spec
                    }
                }}
            }]
        }
    });
    if annotations.as_object().is_some_and(serde_json::Map::is_empty) {
        if let Some(m) = v["metadata"].as_object_mut() {
            m.remove("annotations");
        }
    }
    v
}

/// The two CRDs as `(file name, object)`, for the default TTL limits: what
/// deploy/crds ships.
pub fn crds() -> Vec<(&'static str, Value)> {
    crds_for(&Platform::DEFAULT)
}

/// The two CRDs as `(file name, object)`, encoding the TTL limits `p` (a
/// registry's [`ClassRegistry::platform`](lockmesh_core::ClassRegistry::platform)).
pub fn crds_for(p: &Platform) -> Vec<(&'static str, Value)> {
    let class_cols = json!([
        { "name": "Enforcement", "type": "string", "jsonPath": ".spec.enforcement" },
        { "name": "MaxHolders", "type": "integer", "jsonPath": ".spec.maxHolders" },
        { "name": "TTL", "type": "integer", "jsonPath": ".spec.ttlSeconds" }
    ]);
    let grant_cols = json!([{ "name": "Identity", "type": "string", "jsonPath": ".spec.identity" }]);
    vec![
        (
            "lockclass.yaml",
            crd("LockClass", "lockclasses", "lkc", class_spec(p), class_cols, json!({ LIMITS_ANNOTATION: limits(p) })),
        ),
        ("lockgrant.yaml", crd("LockGrant", "lockgrants", "lkg", grant_spec(), grant_cols, json!({}))),
    ]
}

/// A CRD as YAML, with a header naming its generator. Every string stays on one
/// line (no folded block scalars), so a CEL rule reads as written.
pub fn render(v: &Value) -> Result<String, serde_saphyr::SerializeError> {
    let options = serde_saphyr::ser_options! { prefer_block_scalars: false };
    Ok(format!(
        "# GENERATED by extproc/registry/src/crd.rs (LOCKMESH_WRITE_CRDS=1 cargo test -p lockmesh-extproc --test crds; for a registry's own TTL floors: lockctl class crds FILE): do not edit.\n{}",
        serde_saphyr::to_string_with_options(v, options)?
    ))
}

/// A registry document (the YAML the arbiter's loader reads, as JSON) from
/// LockClass and LockGrant custom resources: a LockClass's `metadata.name` becomes
/// the class's `name` and its `spec` the rest; a LockGrant's `spec` is one `grants`
/// entry. `platform` is the registry's `platform:` section (CRs carry none).
pub fn registry_of(resources: &[Value], platform: Value) -> Result<Value, String> {
    let (mut classes, mut grants) = (vec![], vec![]);
    for (i, d) in resources.iter().enumerate() {
        let mut spec = d.get("spec").cloned().ok_or_else(|| format!("resource {i}: no spec"))?;
        match d["kind"].as_str() {
            Some("LockClass") => {
                let name = d["metadata"]["name"].as_str().ok_or_else(|| format!("resource {i}: no metadata.name"))?;
                spec["name"] = json!(name);
                classes.push(spec);
            }
            Some("LockGrant") => grants.push(spec),
            k => return Err(format!("resource {i}: kind {k:?} is not LockClass or LockGrant")),
        }
    }
    Ok(json!({ "platform": platform, "classes": classes, "grants": grants }))
}
