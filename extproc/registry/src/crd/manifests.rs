//! The class registry as a directory of `LockClass` and `LockGrant` manifests
//! (ADR-24, the arbiter's `registry_dir`): the resources themselves, as a GitOps
//! sync or a projected ConfigMap volume lays them down, read without the
//! Kubernetes API.
//!
//! Lay-out. The directory's `*.yaml` and `*.yml` entries are read, in name order,
//! following symlinks; entries whose name starts with `.` are skipped (a kubelet
//! volume keeps its data in `..<timestamp>/` behind the `..data` link it swaps
//! atomically, and links each file to `..data/<file>`), as are other names,
//! directories and links whose target is gone (a file the last swap removed). A
//! file holds one or more YAML documents; empty documents are skipped and are not
//! counted in a document's index.
//!
//! Validation, every error at once, each naming the file, the document index and
//! the field (`classes.yaml: document 1 (LockClass payments): spec.ttlSeconds: ...`):
//!
//! 1. The envelope: `apiVersion: lockmesh.dev/v1alpha1`, `kind` `LockClass` or
//!    `LockGrant`, `metadata.name` a DNS subdomain name (as the API server
//!    requires), each name once per kind across the directory.
//! 2. The structure of the CRD's `openAPIV3Schema` (the one [`super::crds_for`]
//!    generates): no field the CRD does not know (the CRD is structural, and the
//!    registry file's snake_case spellings are not CRD fields), required fields,
//!    and each field's type.
//! 3. The registry loader's own checks on the registry the documents make
//!    ([`super::registry_of`]'s mapping): the value rules the CRD carries as
//!    OpenAPI keywords and CEL rules (`extproc/tests/class_floors.rs` proves they
//!    refuse the same classes on the same fields), plus what only the loader knows
//!    (pause results, duplicate prefixes, exactly one default).
//!
//! Manifests carry no `platform:` section: the TTL limits are the arbiter's
//! `registry_platform` (the ADR-11 defaults unless it says otherwise, and a
//! lowered floor needs its reason there, as in a registry file). A fenced class's
//! `pauseTestResult` is relative to the directory; such a file must not end in
//! `.yaml` or `.yml` (it would be read as a manifest and refused).

use std::{
    collections::BTreeMap,
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
};

use lockmesh_core::{
    class::{FieldError, Platform, RawPlatform, RawRegistry},
    grant::RawGrant,
    quota::RawQuotas,
    ClassRegistry,
};
use lockmesh_keyspace::now_ms;
use serde_json::Value;

use super::{CLASS_FIELDS, GRANT_FIELDS};

/// The `apiVersion` every manifest carries.
pub const API_VERSION: &str = "lockmesh.dev/v1alpha1";

/// One manifest file as read: its name in the directory and its bytes.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ManifestFile {
    /// The entry's name (`classes.yaml`), not the path its link resolves to.
    pub name: String,
    /// The content.
    pub bytes: Vec<u8>,
}

/// A directory's manifest files read at one moment, in name order: what one load
/// validates and what the hot reload compares ([`Snapshot::hash`]), so a swap
/// between the two cannot pair one content's hash with another's registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The directory.
    pub dir: PathBuf,
    /// Its manifest files.
    pub files: Vec<ManifestFile>,
}

/// Where a document of the directory came from, for its errors.
#[derive(Clone, Debug)]
struct Origin {
    file: String,
    doc: usize,
    kind: &'static str,
    name: String,
}

// === impl Snapshot ===

impl Snapshot {
    /// Reads the manifest files of `dir` (see the module's lay-out rules). An
    /// unreadable directory or file is an error naming it; a link whose target is
    /// gone is skipped.
    pub fn read(dir: &Path) -> Result<Self, String> {
        let entries =
            std::fs::read_dir(dir).map_err(|e| format!("{}: cannot read the directory: {e}", dir.display()))?;
        let mut files = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| format!("{}: cannot list the directory: {e}", dir.display()))?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if name.starts_with('.') || !(name.ends_with(".yaml") || name.ends_with(".yml")) {
                continue;
            }
            let path = entry.path();
            match std::fs::metadata(&path) {
                Ok(m) if m.is_file() => {}
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(format!("{}: cannot read: {e}", path.display())),
            }
            let bytes = std::fs::read(&path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
            files.push(ManifestFile { name, bytes });
        }
        files.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Self { dir: dir.to_owned(), files })
    }

    /// A hash of every file's name and content: a change of either (a file
    /// added, removed, renamed or edited) changes it.
    pub fn hash(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.files.hash(&mut h);
        h.finish()
    }

    /// Validates the documents and loads the registry they make under the TTL
    /// limits `platform`; pause results resolve against the directory. Errors:
    /// every one, each `file: document N (Kind name): field: message` (the file as
    /// a path under the directory).
    pub fn parse(&self, platform: &RawPlatform) -> Result<ClassRegistry, Vec<String>> {
        self.parse_with(platform, &RawQuotas::default())
    }

    /// [`Snapshot::parse`] with the registry's `quotas:` section (the arbiter's
    /// `registry_quotas`; manifests carry none).
    pub fn parse_with(&self, platform: &RawPlatform, quotas: &RawQuotas) -> Result<ClassRegistry, Vec<String>> {
        let mut errs = Vec::new();
        let (mut classes, mut grants) = (Vec::new(), Vec::new());
        let mut class_origins: Vec<Origin> = Vec::new();
        let mut grant_origins: Vec<Origin> = Vec::new();
        let mut seen: BTreeMap<(&'static str, String), Origin> = BTreeMap::new();
        let schemas = Schemas::new();
        for f in &self.files {
            let path = self.dir.join(&f.name).display().to_string();
            let text = match std::str::from_utf8(&f.bytes) {
                Ok(t) => t,
                Err(e) => {
                    errs.push(format!("{path}: not UTF-8: {e}"));
                    continue;
                }
            };
            let options = serde_saphyr::options! { with_snippet: false };
            let docs: Vec<Value> = match serde_saphyr::from_multiple_with_options(text, options) {
                Ok(d) => d,
                Err(e) => {
                    errs.push(format!("{path}: not YAML: {}", one_line(&e.to_string())));
                    continue;
                }
            };
            for (i, d) in docs.into_iter().enumerate() {
                let Some((origin, spec)) = envelope(&d, &f.name, i, &mut |m| {
                    errs.push(format!("{path}: document {i}: {m}"));
                }) else {
                    continue;
                };
                let at = format!("{path}: document {i} ({} {})", origin.kind, origin.name);
                if let Some(first) = seen.get(&(origin.kind, origin.name.clone())) {
                    errs.push(format!(
                        "{at}: metadata.name: {} {:?} is also document {} of {}: each name once",
                        origin.kind,
                        origin.name,
                        first.doc,
                        self.dir.join(&first.file).display()
                    ));
                    continue;
                }
                seen.insert((origin.kind, origin.name.clone()), origin.clone());
                let mut structure = Vec::new();
                check_structure(&d, schemas.root(origin.kind), "", &mut structure);
                if !structure.is_empty() {
                    errs.extend(structure.into_iter().map(|m| format!("{at}: {m}")));
                    continue;
                }
                if origin.kind == "LockClass" {
                    let mut spec = spec;
                    spec["name"] = Value::String(origin.name.clone());
                    match serde_json::from_value(spec) {
                        Ok(c) => {
                            classes.push(c);
                            class_origins.push(origin);
                        }
                        Err(e) => errs.push(format!("{at}: spec: {e}")),
                    }
                } else {
                    match serde_json::from_value::<RawGrant>(spec) {
                        Ok(g) => {
                            grants.push(g);
                            grant_origins.push(origin);
                        }
                        Err(e) => errs.push(format!("{at}: spec: {e}")),
                    }
                }
            }
        }
        let raw = RawRegistry { platform: platform.clone(), classes, grants, quotas: quotas.clone() };
        let now = now_ms() / 1000;
        let check = |class: &str, file: Option<&str>| crate::check_pause_file(&self.dir, class, file, now);
        // With a document refused above, the registry-wide verdicts (exactly one
        // default, ...) judge an incomplete set: they wait for the documents' fix.
        let partial = !errs.is_empty();
        let reg = ClassRegistry::try_from_raw_with(&raw, &check).map_err(|field_errs| {
            field_errs
                .iter()
                .filter(|e| !(partial && e.path == "classes"))
                .map(|e| self.place(e, &class_origins, &grant_origins))
                .collect::<Vec<_>>()
        });
        match reg {
            Ok(reg) if errs.is_empty() => Ok(reg),
            Ok(_) => Err(errs),
            Err(more) => {
                errs.extend(more);
                Err(errs)
            }
        }
    }

    /// A loader error at its document: `classes[i].ttl_s` is the `spec.ttlSeconds`
    /// of the i-th LockClass read, `classes[i].name` its `metadata.name`; the
    /// platform's fields are the arbiter's `registry_platform`.
    fn place(&self, e: &FieldError, classes: &[Origin], grants: &[Origin]) -> String {
        let at =
            |o: &Origin| format!("{}: document {} ({} {})", self.dir.join(&o.file).display(), o.doc, o.kind, o.name);
        let mut message = e.message.clone();
        for (i, o) in classes.iter().enumerate() {
            message = message.replace(&format!("classes[{i}]"), &format!("LockClass {} ({})", o.name, o.file));
        }
        let indexed = |list: &str| -> Option<(usize, String)> {
            let rest = e.path.strip_prefix(list)?.strip_prefix('[')?;
            let (n, field) = rest.split_once(']')?;
            Some((n.parse().ok()?, field.strip_prefix('.').unwrap_or(field).to_owned()))
        };
        if let Some((i, field)) = indexed("classes") {
            if let Some(o) = classes.get(i) {
                let field =
                    if field == "name" { "metadata.name".to_owned() } else { spec_field(&field, &CLASS_FIELDS) };
                return format!("{}: {field}: {message}", at(o));
            }
        }
        if let Some((i, field)) = indexed("grants") {
            if let Some(o) = grants.get(i) {
                return format!("{}: {}: {message}", at(o), spec_field(&field, &GRANT_FIELDS));
            }
        }
        let path = match (e.path.strip_prefix("platform."), e.path.strip_prefix("quotas.")) {
            (Some(f), _) => format!("registry_platform.{f}"),
            (_, Some(f)) => format!("registry_quotas.{f}"),
            _ => e.path.clone(),
        };
        format!("{}: {path}: {message}", self.dir.display())
    }
}

/// `ttl_s` -> `spec.ttlSeconds`, `prefixes[0]` -> `spec.prefixes[0]`.
fn spec_field(field: &str, fields: &[(&str, &str)]) -> String {
    let (head, tail) = field.find('[').map_or((field, ""), |n| field.split_at(n));
    let crd = fields.iter().find(|(_, r)| *r == head).map_or(head, |(c, _)| *c);
    format!("spec.{crd}{tail}")
}

/// The generated CRDs' `openAPIV3Schema`s (the default TTL limits: the structure
/// checked here does not depend on them).
struct Schemas {
    class: Value,
    grant: Value,
}

impl Schemas {
    fn new() -> Self {
        let schema = |kind: &str| {
            super::crds_for(&Platform::DEFAULT)
                .into_iter()
                .map(|(_, v)| v)
                .find(|v| v["spec"]["names"]["kind"] == kind)
                .map(|v| v["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone())
                .unwrap_or_default()
        };
        Self { class: schema("LockClass"), grant: schema("LockGrant") }
    }

    fn root(&self, kind: &str) -> &Value {
        if kind == "LockClass" {
            &self.class
        } else {
            &self.grant
        }
    }
}

/// The envelope of document `doc` of `file`: its kind and name, and its spec
/// (`Value::Null` if absent; [`check_structure`] reports it). Errors go to `err`.
fn envelope(d: &Value, file: &str, doc: usize, err: &mut dyn FnMut(String)) -> Option<(Origin, Value)> {
    let Some(m) = d.as_object() else {
        err("not a mapping (a LockClass or LockGrant resource)".into());
        return None;
    };
    let mut ok = true;
    match m.get("apiVersion").and_then(Value::as_str) {
        Some(API_VERSION) => {}
        v => {
            err(format!("apiVersion: {v:?} is not {API_VERSION}"));
            ok = false;
        }
    }
    let kind = match m.get("kind").and_then(Value::as_str) {
        Some("LockClass") => "LockClass",
        Some("LockGrant") => "LockGrant",
        v => {
            err(format!("kind: {v:?} is not LockClass or LockGrant"));
            return None;
        }
    };
    let name = match d["metadata"]["name"].as_str() {
        Some(n) if dns_subdomain(n) => n.to_owned(),
        Some(n) => {
            err(format!("metadata.name: {n:?} is not a DNS subdomain name (lowercase letters, digits, '-' and '.')"));
            return None;
        }
        None => {
            err("metadata.name: required".into());
            return None;
        }
    };
    ok.then(|| (Origin { file: file.to_owned(), doc, kind, name }, d.get("spec").cloned().unwrap_or(Value::Null)))
}

/// A Kubernetes object name (RFC 1123 subdomain): at most 253 characters of
/// `[a-z0-9.-]`, starting and ending with a letter or digit.
fn dns_subdomain(n: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    n.len() <= 253
        && edge(n.chars().next())
        && edge(n.chars().last())
        && n.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// The structural part of an OpenAPI schema the generated CRDs use: `type`,
/// `required`, `properties` (a key the schema does not list is refused: the
/// CRD is structural, without `x-kubernetes-preserve-unknown-fields`) and
/// `items`. The value keywords (`enum`, `minimum`, `pattern`, ...) and the CEL
/// rules are the registry loader's checks, which refuse the same values.
fn check_structure(v: &Value, schema: &Value, path: &str, errs: &mut Vec<String>) {
    let at = |f: &str| if path.is_empty() { f.to_owned() } else { format!("{path}.{f}") };
    let here = if path.is_empty() { "<root>" } else { path };
    let ty = schema["type"].as_str().unwrap_or("");
    let ok = match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "boolean" => v.is_boolean(),
        _ => true,
    };
    if !ok {
        errs.push(format!("{here}: must be {} {ty}, got {}", if ty == "integer" { "an" } else { "a" }, kind_of(v)));
        return;
    }
    if let (Some(m), Some(props)) = (v.as_object(), schema["properties"].as_object()) {
        for r in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !m.contains_key(r) {
                errs.push(format!("{}: required", at(r)));
            }
        }
        for (k, child) in m {
            match props.get(k) {
                Some(s) => check_structure(child, s, &at(k), errs),
                None => {
                    let known = props.keys().map(String::as_str).collect::<Vec<_>>().join(", ");
                    errs.push(format!("{}: unknown field (the CRD's fields here: {known})", at(k)));
                }
            }
        }
    }
    if let (Some(items), Some(schema)) = (v.as_array(), schema.get("items")) {
        for (i, item) in items.iter().enumerate() {
            check_structure(item, schema, &format!("{here}[{i}]"), errs);
        }
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a fraction",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Loads the registry of the manifests in `dir` under the TTL limits `platform`
/// ([`Snapshot::read`], then [`Snapshot::parse`]). A registry that lowers a
/// platform floor is logged as a warning, as [`crate::load`] logs a
/// registry file's.
pub fn load_dir(dir: &Path, platform: &RawPlatform) -> Result<ClassRegistry, Vec<String>> {
    load_dir_with(dir, platform, &RawQuotas::default())
}

/// [`load_dir`] with the registry's `quotas:` section (`registry_quotas`).
pub fn load_dir_with(dir: &Path, platform: &RawPlatform, quotas: &RawQuotas) -> Result<ClassRegistry, Vec<String>> {
    let snapshot = Snapshot::read(dir).map_err(|e| vec![e])?;
    let reg = snapshot.parse_with(platform, quotas)?;
    warn_lowered(dir, &reg);
    Ok(reg)
}

/// The warning a registry with lowered floors gets at every load (startup and
/// each hot reload), naming the directory.
pub fn warn_lowered(dir: &Path, reg: &ClassRegistry) {
    let (lowered, reason) = reg.lowered_floors();
    if !lowered.is_empty() {
        let floors = lowered.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        tracing::warn!(
            dir = %dir.display(),
            floors = %floors,
            reason = reason.unwrap_or_default(),
            "class registry (registry_platform) lowers platform TTL floors below the ADR-11 defaults; the shipped \
             CRDs encode the defaults, and the API server refuses what they refuse"
        );
    }
}
