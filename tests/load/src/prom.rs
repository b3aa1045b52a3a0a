//! The one reader of Prometheus text expositions (format 0.0.4) the tests share:
//! etcd's `/metrics` for the load tool ([`crate::etcdwork`]) and the lockmesh
//! components' `/metrics` for the scenarios. It reads samples (name, labels,
//! value; a trailing timestamp is ignored) and the family names of `# HELP`
//! lines; it checks nothing else (`promtool check metrics` does that in the
//! observability scenario).

use std::collections::BTreeSet;

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The series name (`_total`, `_bucket`, `_sum`, `_count` suffixes included).
    pub name: String,
    /// Label names and unescaped values, in the order written.
    pub labels: Vec<(String, String)>,
    /// The value (`+Inf`, `-Inf` and `NaN` included).
    pub value: f64,
}

// === impl Sample ===

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Every sample of `text`; comment lines and lines that do not parse are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(sample).collect()
}

/// The family names that `# HELP` lines of `text` declare.
pub fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|rest| rest.split(' ').next())
        .map(str::to_owned)
        .collect()
}

fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let (parsed, after) = label_list(body)?;
        labels = parsed;
        rest = after;
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some(Sample { name, labels, value })
}

/// Parses `a="x",b="y"}` and returns the labels and the text after `}`.
fn label_list(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([',', ' ']);
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let (key, rest) = s.split_once('=')?;
        let rest = rest.strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((key.trim().to_owned(), value));
        s = &rest[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_names_labels_values_and_help_families() {
        let text = "# HELP a_total Things, by kind.\n# TYPE a_total counter\n\
                    a_total{kind=\"x\",note=\"q\\\"uo,te\\\\ \\n\"} 3\n\
                    b 1.5 1700000000000\n\
                    h_bucket{le=\"+Inf\"} 7\n\
                    g NaN\n\
                    not a sample\n";
        let s = parse(text);
        assert_eq!(s.len(), 4, "{s:?}");
        assert_eq!(s[0].name, "a_total");
        assert_eq!(s[0].label("kind"), Some("x"));
        assert_eq!(s[0].label("note"), Some("q\"uo,te\\ \n"));
        assert_eq!(s[0].value, 3.0);
        assert_eq!((s[1].name.as_str(), s[1].labels.len(), s[1].value), ("b", 0, 1.5));
        assert_eq!(s[2].label("le"), Some("+Inf"));
        assert!(s[3].value.is_nan());
        assert_eq!(s[0].label("missing"), None);
        assert_eq!(families(text).into_iter().collect::<Vec<_>>(), ["a_total"]);
    }
}
