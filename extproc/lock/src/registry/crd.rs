//! The `LockClass` and `LockGrant` CustomResourceDefinitions (group
//! `lockmesh.dev`, version `v1alpha1`), generated from the registry schema
//! (`lockmesh_core::class::RawClass`, `lockmesh_core::grant::RawGrant`) without
//! Kubernetes client crates. A LockClass is one `classes` entry with its `name`
//! in `metadata.name` and the rest, in the CRD spellings, in `spec`; a LockGrant
//! is one `grants` entry. `extproc/tests/crds.rs` checks that the files in
//! `deploy/crds/` are this output and that every property maps to a registry
//! field (`LOCKMESH_WRITE_CRDS=1` rewrites them).

use serde_json::{json, Value};

/// The API group.
pub const GROUP: &str = "lockmesh.dev";
/// The served and stored version.
pub const VERSION: &str = "v1alpha1";

/// `(CRD spec property, registry field)` of a LockClass, in schema order.
pub const CLASS_FIELDS: [(&str, &str); 11] = [
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
    ("pauseTestResult", "pause_test_result"),
];

/// `(CRD spec property, registry field)` of a LockGrant.
pub const GRANT_FIELDS: [(&str, &str); 3] =
    [("identity", "identity"), ("prefixes", "prefixes"), ("operations", "operations")];

fn prefixes() -> Value {
    json!({ "type": "array", "description": "Key prefixes (namespace or namespace/path), matched on / boundaries.",
            "items": { "type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(/[^/]+)*$" } })
}

fn class_spec() -> Value {
    json!({
        "type": "object",
        "required": ["enforcement"],
        "properties": {
            "prefixes": prefixes(),
            "tier": { "type": "string", "enum": ["coord", "entity"], "description": "Cluster tier (ADR-07). Default entity." },
            "ttlSeconds": { "type": "integer", "minimum": 2, "maximum": 300,
                            "description": "Session TTL, seconds: 5 to 300 in production, default 15; advisory classes at least 30." },
            "enforcement": { "type": "string", "enum": ["fenced", "advisory"], "description": "ADR-01: fenced (needs a passing pause test) or advisory (needs riskOwner and waiverExpiry)." },
            "riskOwner": { "type": "string", "minLength": 1, "description": "Advisory classes: who owns the risk." },
            "waiverExpiry": { "type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "description": "Advisory classes: waiver end, YYYY-MM-DD (UTC)." },
            "onQuorumLoss": { "type": "string", "enum": ["closed", "open"], "description": "ADR-04: closed (default) or open: grant from the arbiter's memory with token 0 during a quorum loss, spooled and audited as unprotected. open needs enforcement advisory and purpose efficiency." },
            "purpose": { "type": "string", "enum": ["correctness", "efficiency"], "description": "ADR-04: what a second holder costs. Only an efficiency class may declare onQuorumLoss open." },
            "maxHolders": { "type": "integer", "minimum": 1, "description": "Most holders of one key; fenced classes need 1. 0 is refused: it would pause every key of the class." },
            "fairness": { "type": "string", "enum": ["memory", "durable"], "description": "Waiter order (ADR-14). Default memory." },
            "pauseTestResult": { "type": "string", "minLength": 1, "description": "Fenced classes: the PauseTestResult file, relative to the registry file." },
            "default": { "type": "boolean", "description": "The class of keys no prefix covers; exactly one class sets it." }
        },
        "x-kubernetes-validations": [
            { "rule": "self.enforcement != 'fenced' || !has(self.maxHolders) || self.maxHolders == 1",
              "message": "a fenced class admits one holder at a time (maxHolders 1)" },
            { "rule": "self.enforcement != 'advisory' || (has(self.riskOwner) && has(self.waiverExpiry))",
              "message": "an advisory class needs riskOwner and waiverExpiry (ADR-01)" },
            { "rule": "self.enforcement != 'fenced' || has(self.pauseTestResult)",
              "message": "a fenced class needs pauseTestResult (ADR-17)" },
            { "rule": "!has(self.onQuorumLoss) || self.onQuorumLoss != 'open' || (self.enforcement == 'advisory' && has(self.purpose) && self.purpose == 'efficiency')",
              "message": "onQuorumLoss open needs enforcement advisory and purpose efficiency (ADR-04)" }
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

fn crd(kind: &str, plural: &str, short: &str, spec: Value, columns: Value) -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": format!("{plural}.{GROUP}"), "labels": { "app.kubernetes.io/part-of": "lockmesh" } },
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
    })
}

/// The two CRDs as `(file name, object)`.
pub fn crds() -> Vec<(&'static str, Value)> {
    let class_cols = json!([
        { "name": "Enforcement", "type": "string", "jsonPath": ".spec.enforcement" },
        { "name": "MaxHolders", "type": "integer", "jsonPath": ".spec.maxHolders" },
        { "name": "TTL", "type": "integer", "jsonPath": ".spec.ttlSeconds" }
    ]);
    let grant_cols = json!([{ "name": "Identity", "type": "string", "jsonPath": ".spec.identity" }]);
    vec![
        ("lockclass.yaml", crd("LockClass", "lockclasses", "lkc", class_spec(), class_cols)),
        ("lockgrant.yaml", crd("LockGrant", "lockgrants", "lkg", grant_spec(), grant_cols)),
    ]
}

/// A CRD as YAML, with a header naming its generator. Every string stays on one
/// line (no folded block scalars), so a CEL rule reads as written.
pub fn render(v: &Value) -> Result<String, serde_saphyr::SerializeError> {
    let options = serde_saphyr::ser_options! { prefer_block_scalars: false };
    Ok(format!(
        "# GENERATED by extproc/src/registry/crd.rs (LOCKMESH_WRITE_CRDS=1 cargo test -p lockmesh-extproc --test crds): do not edit.\n{}",
        serde_saphyr::to_string_with_options(v, options)?
    ))
}
