//! Path and key templates (issue #17): one language for the filter's bound keys and
//! fence-proxy's routes, so both derive the same key from the same request.
//!
//! - A **path template** ([`PathTemplate`]) is `/`-separated segments, each literal or
//!   `{var}` (one whole, non-empty segment; `var` is `[a-z0-9_]+`, at most once per
//!   template). It is matched against a path already in canonical form
//!   ([`crate::canon`]): segment by segment, byte for byte, nothing decoded. A literal
//!   segment is itself canonical (no escapes, no `.`/`..`, only
//!   `[A-Za-z0-9-._~!$&'()*+,=:@]`), so a template can never name a path the canon
//!   refuses; only the last segment may be empty (a trailing `/`).
//! - A **text template** ([`TextTemplate`]: a resource id, a lock key) is literal text
//!   with `{var}` (a variable of the route's path template) and `{header:name}` (the
//!   one value of a request header, `name` lower-case `[a-z0-9-]+`). A header used by a
//!   template must appear exactly once, non-empty, as printable ASCII with no leading
//!   or trailing space: a missing, repeated or binary header fails the fill rather
//!   than picking a value, so header twins cannot choose between two resources.
//!
//! Headers come through a lookup ([`HeaderLookup`]) so this module needs no HTTP
//! crate and builds for `wasm32-wasip1`. Error messages name the template, a variable
//! or a header, never a header's value or a filled key.

use crate::key::{KeyError, LockKey};

/// A parsed path template (`/orders/{id}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathTemplate {
    source: String,
    segs: Vec<Seg>,
}

/// A parsed text template (`payments/order-{id}`, `{header:x-tenant}/{id}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextTemplate {
    source: String,
    parts: Vec<Part>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Lit(String),
    Var(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Lit(String),
    Var(String),
    Header(String),
}

/// The variables a path matched, in the order of the template's segments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vars(Vec<(String, String)>);

/// What a header lookup found for one header name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderLookup {
    /// The request has no such header.
    Absent,
    /// Exactly one value (raw bytes, as received).
    One(Vec<u8>),
    /// Two or more values (twins, repeated lines, a comma-joined list counts as one).
    Several,
}

/// A header lookup for requests that have no headers to offer (tests, templates
/// with no `{header:...}`): every name is [`HeaderLookup::Absent`].
pub fn no_headers(_: &str) -> HeaderLookup {
    HeaderLookup::Absent
}

/// Why a template was refused at parse time. The message names the template text
/// (configuration, never request data).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// A text template with no text.
    #[error("must not be empty")]
    Empty,
    /// A path template not starting with `/`.
    #[error("{0:?} must start with '/'")]
    NotAbsolute(String),
    /// `{x}` where `x` is not `[a-z0-9_]+`.
    #[error("{0:?}: {{{1}}} is not a variable name ([a-z0-9_]+)")]
    BadVarName(String, String),
    /// The same variable twice in a path template.
    #[error("{0:?}: {{{1}}} appears twice")]
    DuplicateVar(String, String),
    /// A variable that is only part of a path segment (`/x{id}`), or a stray brace.
    #[error("{0:?}: a variable must be a whole segment")]
    PartialSegment(String),
    /// A literal path segment the canonical form refuses (escape, dot segment, a
    /// byte outside the literal set) or an empty segment before the last.
    #[error("{0:?}: segment {1:?} is not canonical (literal segments use [A-Za-z0-9-._~!$&'()*+,=:@], are not '.' or '..', and only the last may be empty)")]
    BadLiteral(String, String),
    /// `{` with no `}`.
    #[error("{0:?}: unclosed '{{'")]
    Unclosed(String),
    /// `}` with no `{`.
    #[error("{0:?}: unmatched '}}'")]
    Unmatched(String),
    /// `{header:X}` where `X` is not a lower-case header name.
    #[error("{0:?}: {{header:{1}}} must name a lower-case header ([a-z0-9-]+)")]
    BadHeaderName(String, String),
    /// `{x}` where `x` is not a variable of the path template.
    #[error("{0:?}: {{{1}}} is not a variable of the path")]
    UnknownVar(String, String),
}

/// Why a template could not be filled for one request. The message names a header
/// or a variable, never a value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FillError {
    /// A `{header:name}` whose header is absent, repeated, empty or not printable
    /// ASCII.
    #[error("header {0} must appear exactly once, as non-empty printable text")]
    Header(String),
    /// A variable the given [`Vars`] do not carry (the vars are not from this route).
    #[error("variable {{{0}}} has no value")]
    MissingVar(String),
    /// A path variable value that is empty or holds a `/`.
    #[error("variable {{{0}}} must be one non-empty path segment")]
    BadSegment(String),
    /// The filled text is not a valid lock key.
    #[error("the filled lock key is not a valid key: {0}")]
    Key(#[from] KeyError),
}

fn ident(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

fn header_name(h: &str) -> bool {
    !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A literal path segment's bytes: RFC 3986 unreserved and sub-delims (without `;`,
/// which the canon refuses as a path parameter) and `:` `@`.
fn literal_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,=:@".contains(&b)
}

// === impl Vars ===

impl Vars {
    /// No variables.
    pub fn new() -> Self {
        Self::default()
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Sets `name` (replacing an earlier value).
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<String>) {
        let (name, value) = (name.into(), value.into());
        match self.0.iter_mut().find(|(k, _)| *k == name) {
            Some(slot) => slot.1 = value,
            None => self.0.push((name, value)),
        }
    }

    /// `(name, value)` pairs in template order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// How many variables.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

// === impl HeaderLookup ===

impl HeaderLookup {
    /// Classifies every value a request carries under one name.
    pub fn from_values<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut it = values.into_iter();
        match (it.next(), it.next()) {
            (None, _) => Self::Absent,
            (Some(v), None) => Self::One(v.to_vec()),
            (Some(_), Some(_)) => Self::Several,
        }
    }
}

// === impl PathTemplate ===

impl PathTemplate {
    /// Parses a path template (`/items/{id}`).
    pub fn parse(s: &str) -> Result<Self, TemplateError> {
        let Some(rest) = s.strip_prefix('/') else {
            return Err(TemplateError::NotAbsolute(s.to_owned()));
        };
        let raw: Vec<&str> = rest.split('/').collect();
        let mut segs = Vec::with_capacity(raw.len());
        for (i, seg) in raw.iter().enumerate() {
            if let Some(v) = seg.strip_prefix('{').and_then(|v| v.strip_suffix('}')) {
                if !ident(v) {
                    return Err(TemplateError::BadVarName(s.to_owned(), v.to_owned()));
                }
                if segs.contains(&Seg::Var(v.to_owned())) {
                    return Err(TemplateError::DuplicateVar(s.to_owned(), v.to_owned()));
                }
                segs.push(Seg::Var(v.to_owned()));
            } else if seg.contains('{') || seg.contains('}') {
                return Err(TemplateError::PartialSegment(s.to_owned()));
            } else if (seg.is_empty() && i + 1 < raw.len())
                || *seg == "."
                || *seg == ".."
                || !seg.bytes().all(literal_byte)
            {
                return Err(TemplateError::BadLiteral(s.to_owned(), (*seg).to_owned()));
            } else {
                segs.push(Seg::Lit((*seg).to_owned()));
            }
        }
        Ok(Self { source: s.to_owned(), segs })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The variable names, in segment order.
    pub fn vars(&self) -> Vec<&str> {
        self.segs
            .iter()
            .filter_map(|p| match p {
                Seg::Var(v) => Some(v.as_str()),
                Seg::Lit(_) => None,
            })
            .collect()
    }

    /// Matches a canonical path (no query; see [`crate::canon`]) segment by segment.
    /// A variable takes one whole non-empty segment, as sent (escapes stay escaped).
    pub fn match_path(&self, path: &str) -> Option<Vars> {
        let rest = path.strip_prefix('/')?;
        let mut vars = Vars(Vec::new());
        let mut segs = rest.split('/');
        for p in &self.segs {
            let s = segs.next()?;
            match p {
                Seg::Lit(l) if l == s => {}
                Seg::Var(v) if !s.is_empty() => vars.0.push((v.clone(), s.to_owned())),
                _ => return None,
            }
        }
        segs.next().is_none().then_some(vars)
    }

    /// The path this template names for `vars`: the inverse of
    /// [`PathTemplate::match_path`].
    pub fn fill(&self, vars: &Vars) -> Result<String, FillError> {
        let mut out = String::new();
        for p in &self.segs {
            out.push('/');
            match p {
                Seg::Lit(l) => out.push_str(l),
                Seg::Var(v) => {
                    let val = vars.get(v).ok_or_else(|| FillError::MissingVar(v.clone()))?;
                    if val.is_empty() || val.contains('/') {
                        return Err(FillError::BadSegment(v.clone()));
                    }
                    out.push_str(val);
                }
            }
        }
        Ok(out)
    }
}

// === impl TextTemplate ===

impl TextTemplate {
    /// Parses a text template whose `{var}`s must be among `vars` (a path template's
    /// [`PathTemplate::vars`]; empty for a route with no path).
    pub fn parse(s: &str, vars: &[&str]) -> Result<Self, TemplateError> {
        if s.is_empty() {
            return Err(TemplateError::Empty);
        }
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if rest[..open].contains('}') {
                return Err(TemplateError::Unmatched(s.to_owned()));
            }
            if open > 0 {
                parts.push(Part::Lit(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(TemplateError::Unclosed(s.to_owned()));
            };
            let name = &rest[open + 1..open + close];
            if name.contains('{') {
                return Err(TemplateError::Unclosed(s.to_owned()));
            }
            if let Some(h) = name.strip_prefix("header:") {
                if !header_name(h) {
                    return Err(TemplateError::BadHeaderName(s.to_owned(), h.to_owned()));
                }
                parts.push(Part::Header(h.to_owned()));
            } else if vars.contains(&name) {
                parts.push(Part::Var(name.to_owned()));
            } else {
                return Err(TemplateError::UnknownVar(s.to_owned(), name.to_owned()));
            }
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(TemplateError::Unmatched(s.to_owned()));
        }
        if !rest.is_empty() {
            parts.push(Part::Lit(rest.to_owned()));
        }
        Ok(Self { source: s.to_owned(), parts })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The header names the template reads (`{header:name}`), in order, repeats
    /// included.
    pub fn header_names(&self) -> Vec<&str> {
        self.parts
            .iter()
            .filter_map(|p| match p {
                Part::Header(h) => Some(h.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Fills the template from a path's variables and the request's headers.
    pub fn fill(&self, vars: &Vars, headers: &dyn Fn(&str) -> HeaderLookup) -> Result<String, FillError> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Lit(l) => out.push_str(l),
                Part::Var(v) => out.push_str(vars.get(v).ok_or_else(|| FillError::MissingVar(v.clone()))?),
                Part::Header(h) => match headers(h) {
                    HeaderLookup::One(v) if printable(&v) => {
                        // printable() admits ASCII only, so this never replaces anything.
                        out.push_str(&String::from_utf8_lossy(&v));
                    }
                    _ => return Err(FillError::Header(h.clone())),
                },
            }
        }
        Ok(out)
    }

    /// Fills the template and validates the result as a [`LockKey`]: a key template's
    /// fill either is a valid key or fails.
    pub fn fill_key(&self, vars: &Vars, headers: &dyn Fn(&str) -> HeaderLookup) -> Result<LockKey, FillError> {
        let text = self.fill(vars, headers)?;
        Ok(LockKey::parse(text.as_bytes())?)
    }
}

/// A header value a template may use: non-empty printable ASCII (space allowed
/// inside), no leading or trailing space.
fn printable(v: &[u8]) -> bool {
    !v.is_empty() && v.iter().all(|b| (0x20..0x7f).contains(b)) && v.first() != Some(&b' ') && v.last() != Some(&b' ')
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vars {
        let mut v = Vars::new();
        for (k, val) in pairs {
            v.insert(*k, *val);
        }
        v
    }

    #[test]
    fn path_templates_match_whole_segments() {
        let t = PathTemplate::parse("/items/{id}").unwrap();
        assert_eq!(t.vars(), ["id"]);
        assert_eq!(t.match_path("/items/7"), Some(vars(&[("id", "7")])));
        assert_eq!(t.match_path("/items/%20x"), Some(vars(&[("id", "%20x")])), "escapes stay escaped");
        for p in ["/items/", "/items", "/items/7/x", "items/7", "/Items/7", "", "/"] {
            assert_eq!(t.match_path(p), None, "{p}");
        }
        let root = PathTemplate::parse("/").unwrap();
        assert!(root.match_path("/").is_some());
        assert!(root.match_path("/x").is_none());
        let slash = PathTemplate::parse("/dir/{d}/").unwrap();
        assert_eq!(slash.match_path("/dir/a/"), Some(vars(&[("d", "a")])));
        assert_eq!(slash.match_path("/dir/a"), None);
        let two = PathTemplate::parse("/t/{tenant}/o/{id}").unwrap();
        assert_eq!(two.vars(), ["tenant", "id"]);
        assert_eq!(
            two.match_path("/t/acme/o/9").unwrap().iter().collect::<Vec<_>>(),
            [("tenant", "acme"), ("id", "9")]
        );
    }

    #[test]
    fn path_templates_are_validated() {
        let err = |s: &str| PathTemplate::parse(s).unwrap_err();
        assert_eq!(err("items/{id}"), TemplateError::NotAbsolute("items/{id}".into()));
        assert!(matches!(err("/items/x{id}"), TemplateError::PartialSegment(_)));
        assert!(matches!(err("/items/{id"), TemplateError::PartialSegment(_)));
        assert!(matches!(err("/a/{id}/{id}"), TemplateError::DuplicateVar(_, v) if v == "id"));
        assert!(matches!(err("/a/{Id}"), TemplateError::BadVarName(_, v) if v == "Id"));
        assert!(matches!(err("/a/{}"), TemplateError::BadVarName(..)));
        for bad in ["/a//b", "//a", "/a/../b", "/./a", "/a%2Fb", "/a;x", "/a b", "/a\\b", "/é"] {
            assert!(matches!(err(bad), TemplateError::BadLiteral(..)), "{bad}");
        }
        assert_eq!(
            err("/a/..").to_string(),
            "\"/a/..\": segment \"..\" is not canonical (literal segments use [A-Za-z0-9-._~!$&'()*+,=:@], are not '.' or '..', and only the last may be empty)"
        );
    }

    #[test]
    fn text_templates_are_validated() {
        let err = |s: &str| TextTemplate::parse(s, &["id"]).unwrap_err();
        assert_eq!(err(""), TemplateError::Empty);
        assert_eq!(err("k/{nope}").to_string(), "\"k/{nope}\": {nope} is not a variable of the path");
        assert_eq!(err("k/{id").to_string(), "\"k/{id\": unclosed '{'");
        assert_eq!(err("k/{{id}").to_string(), "\"k/{{id}\": unclosed '{'");
        assert_eq!(err("k/id}").to_string(), "\"k/id}\": unmatched '}'");
        assert_eq!(err("k}/{id}").to_string(), "\"k}/{id}\": unmatched '}'");
        assert_eq!(
            err("k/{header:X-Up}").to_string(),
            "\"k/{header:X-Up}\": {header:X-Up} must name a lower-case header ([a-z0-9-]+)"
        );
        assert!(matches!(err("k/{header:}"), TemplateError::BadHeaderName(..)));
        let t = TextTemplate::parse("{header:x-tenant}/{id}/{header:x-tenant}", &["id"]).unwrap();
        assert_eq!(t.header_names(), ["x-tenant", "x-tenant"]);
        assert_eq!(t.as_str(), "{header:x-tenant}/{id}/{header:x-tenant}");
    }

    #[test]
    fn fills_vars_and_exactly_one_header_value() {
        let t = TextTemplate::parse("orders/{header:x-tenant}/{id}", &["id"]).unwrap();
        let v = vars(&[("id", "7")]);
        let one = |name: &str| {
            assert_eq!(name, "x-tenant");
            HeaderLookup::One(b"acme".to_vec())
        };
        assert_eq!(t.fill(&v, &one).unwrap(), "orders/acme/7");
        assert_eq!(t.fill_key(&v, &one).unwrap().as_str(), "orders/acme/7");
        let bad = [
            HeaderLookup::Absent,
            HeaderLookup::Several,
            HeaderLookup::One(Vec::new()),
            HeaderLookup::One(b" acme".to_vec()),
            HeaderLookup::One(b"acme ".to_vec()),
            HeaderLookup::One(b"ac\tme".to_vec()),
            HeaderLookup::One("acmé".as_bytes().to_vec()),
            HeaderLookup::One(b"a\x7f".to_vec()),
        ];
        for b in bad {
            let e = t.fill(&v, &move |_: &str| b.clone()).unwrap_err();
            assert_eq!(e.to_string(), "header x-tenant must appear exactly once, as non-empty printable text");
        }
        assert_eq!(t.fill(&Vars::new(), &one), Err(FillError::MissingVar("id".into())));
        // The key is validated; the message never carries the key.
        let e = t.fill_key(&vars(&[("id", "..")]), &one).unwrap_err();
        assert_eq!(e.to_string(), "the filled lock key is not a valid key: key has an empty, '.' or '..' segment");
        let k = TextTemplate::parse("orders/{id}", &["id"]).unwrap();
        assert!(matches!(
            k.fill_key(&vars(&[("id", "a%20b")]), &no_headers),
            Err(FillError::Key(KeyError::BadChar(_)))
        ));
        assert_eq!(
            HeaderLookup::from_values([b"a".as_slice(), b"b".as_slice()]),
            HeaderLookup::Several,
            "twins are several"
        );
        assert_eq!(HeaderLookup::from_values([b"a".as_slice()]), HeaderLookup::One(b"a".to_vec()));
        assert_eq!(HeaderLookup::from_values(std::iter::empty()), HeaderLookup::Absent);
    }

    fn seg() -> impl Strategy<Value = String> {
        "[A-Za-z0-9._~:@!$&'()*+,=-]{1,8}".prop_filter("not a dot segment", |s| s != "." && s != "..")
    }

    /// A path template: a mix of literal and variable segments.
    fn path_template() -> impl Strategy<Value = (String, Vec<String>)> {
        proptest::collection::vec(prop_oneof![seg().prop_map(Some), Just(None)], 0..6).prop_map(|segs| {
            let mut names = Vec::new();
            let text: String = segs
                .into_iter()
                .enumerate()
                .map(|(i, s)| match s {
                    Some(l) => format!("/{l}"),
                    None => {
                        names.push(format!("v{i}"));
                        format!("/{{v{i}}}")
                    }
                })
                .collect();
            (if text.is_empty() { "/x".to_owned() } else { text }, names)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// A matched path's variables fill the template back to the same path, and
        /// filling then matching gives the same variables.
        #[test]
        fn match_and_fill_are_inverse(
            (t, names) in path_template(),
            values in proptest::collection::vec(seg(), 6),
            other in "(/[A-Za-z0-9%._~:@-]{0,6}){1,6}",
        ) {
            let t = PathTemplate::parse(&t).unwrap();
            let mut v = Vars::new();
            for (n, val) in names.iter().zip(&values) {
                v.insert(n.as_str(), val.as_str());
            }
            let path = t.fill(&v).unwrap();
            let m = t.match_path(&path).unwrap();
            prop_assert_eq!(&m, &v);
            prop_assert_eq!(t.fill(&m).unwrap(), path);
            if let Some(m) = t.match_path(&other) {
                prop_assert_eq!(t.fill(&m).unwrap(), other);
            }
        }

        /// A filled key is a valid LockKey or the fill fails; it never yields text
        /// that LockKey refuses, and it equals the plain fill.
        #[test]
        fn filled_keys_parse_or_fail(
            lits in proptest::collection::vec("[a-z0-9/._%-]{0,6}", 1..4),
            value in "[A-Za-z0-9/._%~ -]{0,8}",
            header in proptest::option::of("[ -~]{0,8}"),
        ) {
            let src = format!("{}{{id}}{}{{header:x-h}}{}", lits[0], lits.get(1).map_or("", String::as_str), lits.get(2).map_or("", String::as_str));
            let t = TextTemplate::parse(&src, &["id"]).unwrap();
            let v = vars(&[("id", value.as_str())]);
            let h = move |_: &str| header.clone().map_or(HeaderLookup::Absent, |h| HeaderLookup::One(h.into_bytes()));
            match (t.fill_key(&v, &h), t.fill(&v, &h)) {
                (Ok(k), Ok(text)) => {
                    prop_assert_eq!(k.as_str(), text.as_str());
                    prop_assert!(LockKey::parse(text.as_bytes()).is_ok());
                }
                (Err(FillError::Key(_)), Ok(text)) => prop_assert!(LockKey::parse(text.as_bytes()).is_err()),
                (Err(e), Err(e2)) => prop_assert_eq!(e, e2),
                (k, t) => prop_assert!(false, "fill_key {:?} vs fill {:?}", k.is_ok(), t.is_ok()),
            }
        }

        /// Parsing never panics on any text.
        #[test]
        fn parse_never_panics(s in "[{}a-z:/%._-]{0,24}") {
            let _ = PathTemplate::parse(&s);
            let _ = TextTemplate::parse(&s, &["id"]);
        }
    }
}
