//! A configuration file's YAML into its serde type.

use std::fmt;

use serde::de::DeserializeOwned;
use serde_path_to_error::{Path, Segment};

/// YAML text that does not deserialise into its type.
///
/// Displayed as `<path>: <message>`, or `<message>` when no field is to blame
/// (a syntax error, a wrong root); for example
/// `routes[0].reads: expected sequence start at line 5, column 12`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct YamlError {
    /// The field path (`routes[0].reads`; an unknown field's own name ends it), if
    /// the error concerns a field.
    pub path: Option<String>,
    /// The parser's message, ending with the line and column when it knows them.
    pub message: String,
}

/// Parses YAML `text` into `T` (one document; empty text is an empty document).
///
/// Duplicate keys are refused, as are unknown fields where `T` denies them. The
/// message is one line, without a source snippet, so a caller's report keeps one
/// `file: field: message` line per error (STYLE §5).
pub fn parse_yaml<T: DeserializeOwned>(text: &str) -> Result<T, YamlError> {
    let options = serde_saphyr::options! { with_snippet: false };
    let mut path = None;
    serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = field_path(e.path());
            e.into_inner()
        })
    })
    .map_err(|e| YamlError { path, message: e.to_string() })
}

/// `None` for the root (`.`) or a path of unknown segments only (`?`).
fn field_path(p: &Path) -> Option<String> {
    p.iter().any(|s| !matches!(s, Segment::Unknown)).then(|| p.to_string())
}

// === impl YamlError ===

impl fmt::Display for YamlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{p}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for YamlError {}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Raw {
        listen: Option<String>,
        timeout_ms: Option<u64>,
        #[serde(default)]
        routes: Vec<Route>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Route {
        name: String,
        #[serde(default)]
        reads: Vec<String>,
    }

    fn err(text: &str) -> String {
        parse_yaml::<Raw>(text).unwrap_err().to_string()
    }

    #[test]
    fn a_document_parses() {
        let raw: Raw = parse_yaml("listen: a\nroutes:\n  - { name: r, reads: [GET] }\n").unwrap();
        assert_eq!(raw.routes, [Route { name: "r".into(), reads: vec!["GET".into()] }]);
        assert_eq!(parse_yaml::<Raw>("").unwrap(), Raw::default());
        assert_eq!(parse_yaml::<Raw>("# only a comment\n").unwrap(), Raw::default());
    }

    #[test]
    fn errors_name_the_field_and_the_line() {
        assert_eq!(err("timeout_ms: abc\n"), "timeout_ms: invalid u64 at line 1, column 13");
        assert_eq!(
            err("routes:\n  - name: a\n  - name: b\n    reads: GET\n"),
            "routes[1].reads: expected sequence start at line 4, column 12"
        );
        assert_eq!(err("routes:\n  - reads: []\n"), "routes[0]: missing field `name` at line 2, column 5");
        assert_eq!(
            err("listen: a\ntimeout_msx: 1\n"),
            "timeout_msx: unknown field `timeout_msx`, expected one of listen, timeout_ms, routes at line 2, column 1"
        );
        assert_eq!(
            err("routes:\n  - name: a\n    bogus: 1\n"),
            "routes[0].bogus: unknown field `bogus`, expected one of name, reads at line 3, column 5"
        );
    }

    #[test]
    fn errors_without_a_field_have_no_path() {
        let e = parse_yaml::<Raw>("- a\n").unwrap_err();
        assert_eq!((e.path.as_deref(), e.message.as_str()), (None, "expected mapping start at line 1, column 1"));
        let e = parse_yaml::<Raw>("listen: a\nlisten: b\n").unwrap_err();
        assert_eq!(e.path, None, "{e}");
        assert!(e.message.starts_with("duplicate mapping key: listen"), "{e}");
        assert!(err("listen: a\n---\nlisten: b\n").starts_with("multiple YAML documents detected"));
        assert!(err("listen: [a\n").starts_with("listen: "), "a syntax error inside a field names it");
    }
}
