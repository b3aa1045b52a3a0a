//! `lockmesh-inject`'s rewrite of a multi-document YAML stream, like
//! `istioctl kube-inject`: every Pod, Deployment and StatefulSet (also inside a
//! `List`) goes through [`inject`]; other documents pass through unchanged. For each
//! namespace and backend port injected, the NetworkPolicy keeping other pods off
//! the store's port is appended unless the stream already holds it.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::{
    config::Config,
    inject::{inject, Outcome},
    policy,
    refusal::InjectError,
};

/// What the rewrite adds besides the injected objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Append the NetworkPolicy for each (namespace, backend port) injected.
    pub network_policies: bool,
}

/// The rewritten stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Rewritten {
    /// The output documents, `---`-separated.
    pub yaml: String,
    /// How many objects were injected now.
    pub injected: usize,
    /// Advice from the injections, each prefixed with its document.
    pub warnings: Vec<String>,
}

/// Why a stream cannot be rewritten.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// A document is not YAML that maps onto JSON.
    #[error("document {index}: not a YAML object: {source}")]
    Yaml {
        /// 1-based document number.
        index: usize,
        /// The parser's error.
        #[source]
        source: serde_saphyr::Error,
    },
    /// An object opted in but cannot be injected.
    #[error("document {index} ({what}): {error}")]
    Refused {
        /// 1-based document number.
        index: usize,
        /// `Kind namespace/name` of the object.
        what: String,
        /// Every reason.
        error: InjectError,
    },
    /// The output could not be serialised.
    #[error("cannot write YAML: {0}")]
    Write(#[source] serde_saphyr::SerializeError),
}

/// Rewrites `text`; returns every error of every document, or the new stream.
pub fn rewrite(text: &str, config: &Config, options: Options) -> Result<Rewritten, Vec<ManifestError>> {
    let mut docs = Vec::new();
    let mut errs = Vec::new();
    // Empty and null documents are skipped by the parser and not numbered. After a
    // document that does not map onto JSON the next ones are still read; after a
    // syntax error the stream ends there.
    let mut input = text.as_bytes();
    for (i, doc) in serde_saphyr::read::<_, Value>(&mut input).enumerate() {
        match doc {
            Ok(Value::Null) => {}
            Ok(v) => docs.push((i + 1, v)),
            Err(source) => errs.push(ManifestError::Yaml { index: i + 1, source }),
        }
    }
    let mut out = Rewritten { yaml: String::new(), injected: 0, warnings: Vec::new() };
    let mut wanted = BTreeSet::new();
    let mut present = BTreeSet::new();
    for (index, doc) in &mut docs {
        if doc.get("kind").and_then(Value::as_str) == Some("List") {
            if let Some(items) = doc.get_mut("items").and_then(Value::as_array_mut) {
                for item in items {
                    one(*index, item, config, &mut out, &mut wanted, &mut present, &mut errs);
                }
            }
        } else {
            one(*index, doc, config, &mut out, &mut wanted, &mut present, &mut errs);
        }
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    if options.network_policies {
        for (ns, port) in wanted {
            if !present.contains(&(ns.clone(), policy::name(port))) {
                docs.push((0, policy::network_policy(ns.as_deref(), port)));
            }
        }
    }
    for (i, (_, doc)) in docs.iter().enumerate() {
        if i > 0 {
            out.yaml.push_str("---\n");
        }
        out.yaml.push_str(&serde_saphyr::to_string(doc).map_err(|e| vec![ManifestError::Write(e)])?);
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn one(
    index: usize,
    doc: &mut Value,
    config: &Config,
    out: &mut Rewritten,
    wanted: &mut BTreeSet<(Option<String>, u16)>,
    present: &mut BTreeSet<(Option<String>, String)>,
    errs: &mut Vec<ManifestError>,
) {
    let ns = doc.pointer("/metadata/namespace").and_then(Value::as_str).map(str::to_owned);
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("?").to_owned();
    let name = doc.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("?").to_owned();
    if kind == "NetworkPolicy" {
        present.insert((ns.clone(), name.clone()));
    }
    match inject(doc, config) {
        Ok(Outcome::Injected(i)) => {
            let what = format!("{kind} {}{name}", ns.as_deref().map(|n| format!("{n}/")).unwrap_or_default());
            out.warnings.extend(i.warnings.iter().map(|w| format!("document {index} ({what}): {w}")));
            out.injected += 1;
            wanted.insert((ns, i.backend_port));
            *doc = i.object;
        }
        Ok(Outcome::Untouched | Outcome::AlreadyInjected) => {}
        Err(error) => {
            let what = format!("{kind} {}{name}", ns.as_deref().map(|n| format!("{n}/")).unwrap_or_default());
            errs.push(ManifestError::Refused { index, what, error });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewrite_errors(text: &str) -> Vec<String> {
        let opts = Options { network_policies: false };
        rewrite(text, &Config::default(), opts).unwrap_err().iter().map(ToString::to_string).collect()
    }

    #[test]
    fn documents_pass_through_and_empty_ones_are_dropped() {
        let opts = Options { network_policies: false };
        let out = rewrite("---\nkind: ConfigMap\n---\n---\nkind: Service\n", &Config::default(), opts).unwrap();
        assert_eq!(out.yaml, "kind: ConfigMap\n---\nkind: Service\n");
        assert_eq!(out.injected, 0);
    }

    #[test]
    fn a_syntax_error_names_its_document_and_line() {
        assert_eq!(
            rewrite_errors("kind: ConfigMap\n---\nkind: [Service\n"),
            ["document 2: not a YAML object: unclosed bracket '[' at line 3, column 7"]
        );
    }
}
