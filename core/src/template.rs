//! Path and key templates (issue #17): one language for the filter's bound keys and
//! fence-proxy's routes, so both derive the same key from the same request.
//!
//! - A **path template** ([`PathTemplate`]) is `/`-separated segments, each literal or
//!   `{var}` (one whole, non-empty segment; `var` is `[a-z0-9_]+`, at most once per
//!   template) or a typed `{var:kind}` ([`Kind`]; `{id:uint}`). It is matched against
//!   a path already in canonical form ([`crate::canon`]): segment by segment, byte for
//!   byte, nothing decoded. A literal segment is itself canonical (no escapes, no
//!   `.`/`..`, only `[A-Za-z0-9-._~!$&'()*+,=:@]`), so a template can never name a
//!   path the canon refuses; only the last segment may be empty (a trailing `/`).
//! - A **typed variable** admits one spelling per value: `{id:uint}` takes `7`, never
//!   `07`, `+7`, `7.json` or `7%20`, so every request for order 7 derives the one key
//!   of order 7. A path of the template's shape whose typed value does not fit is
//!   neither a match nor another shape: [`PathTemplate::match_path`] says
//!   [`PathMatch::Mistyped`], and callers refuse the request (`400 bad_request`)
//!   rather than try another route, where the spelling would name another key or
//!   none ([`select`] is the one route choice both the filter and fence-proxy use).
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
    Var(String, Kind),
}

/// The type of a path variable: `{id}` is [`Kind::Any`], `{id:uint}` [`Kind::Uint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Any non-empty segment, as sent (escapes stay escaped).
    Any,
    /// An unsigned integer in its one decimal spelling: `0` or `[1-9][0-9]*`, at
    /// most `u64::MAX` (18446744073709551615). No sign, no leading zero, no
    /// fraction, suffix, escape or space.
    Uint,
}

/// A path of a template's shape whose typed variable's value does not fit the type.
/// The message names the variable and the type, never the value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("path segment {{{var}}} must be {}", kind.describe())]
pub struct Mistyped {
    /// The variable (the first mistyped one, in segment order).
    pub var: String,
    /// Its type.
    pub kind: Kind,
}

/// What matching a path against one template found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathMatch {
    /// The path has the template's shape and every typed value fits its type.
    Matched(Vars),
    /// The path has the template's shape (as many segments, every literal equal,
    /// no empty variable segment), but a typed value does not fit. Not a match; a
    /// caller refuses the request instead of trying another route.
    Mistyped(Mistyped),
    /// Another shape.
    NoMatch,
}

/// Which of several templates a path takes ([`select`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selected<T> {
    /// The first candidate, in order, that matches, with its variables.
    Matched(T, Vars),
    /// None matches, and some candidate has the path's shape with a mistyped value
    /// (the first such): refuse the request.
    Mistyped(Mistyped),
    /// No candidate has the path's shape: the caller's fallback (prefix routes,
    /// fence-proxy's `unlisted` guard).
    NoMatch,
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
    /// `{var:kind}` in a path template with a kind that is not known.
    #[error("{0:?}: {{{1}:{2}}}: unknown type {2:?} (known: uint; write {{{1}}} for any segment)")]
    UnknownKind(String, String, String),
    /// `{var:kind}` in a text template: the type belongs to the path template.
    #[error("{0:?}: {{{1}:{2}}}: a variable's type goes in the path template; write {{{1}}} here")]
    TypeInText(String, String, String),
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
    /// A path variable value that does not fit the variable's type.
    #[error(transparent)]
    Mistyped(#[from] Mistyped),
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

// === impl Kind ===

impl Kind {
    /// The kind a `{var:name}` names; `None` for an unknown name. (`{var}` with no
    /// type is [`Kind::Any`]; `any` is not a name.)
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "uint" => Some(Self::Uint),
            _ => None,
        }
    }

    /// The name written in a template (`uint`; `any` for an untyped variable).
    pub fn name(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::Uint => "uint",
        }
    }

    /// What a value of this kind looks like (error messages).
    pub fn describe(self) -> &'static str {
        match self {
            Self::Any => "one non-empty path segment",
            Self::Uint => {
                "a uint: decimal digits with no sign, leading zero, fraction, suffix or escape, at most \
                 18446744073709551615"
            }
        }
    }

    /// Whether a non-empty path segment (as sent) is a value of this kind.
    pub fn admits(self, seg: &str) -> bool {
        match self {
            Self::Any => !seg.is_empty() && !seg.contains('/'),
            Self::Uint => {
                // Digits only (so `str::parse`'s leading `+` never gets there), one
                // spelling per value (no leading zero), and within u64.
                let b = seg.as_bytes();
                !b.is_empty()
                    && b.len() <= 20
                    && b.iter().all(u8::is_ascii_digit)
                    && (b.len() == 1 || b.first() != Some(&b'0'))
                    && seg.parse::<u64>().is_ok()
            }
        }
    }

    /// A plain value of this kind (configuration checks fill templates with it).
    pub fn sample(self) -> &'static str {
        match self {
            Self::Any => "x",
            Self::Uint => "1",
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// === impl PathMatch ===

impl PathMatch {
    /// The variables of a match; `None` for a mistyped path or another shape.
    pub fn matched(self) -> Option<Vars> {
        match self {
            Self::Matched(v) => Some(v),
            Self::Mistyped(_) | Self::NoMatch => None,
        }
    }
}

/// The route a canonical path takes among `candidates` (in their order): the first
/// whose template matches; else, when a template has the path's shape but a typed
/// value does not fit, [`Selected::Mistyped`] (the first such; the request is to be
/// refused, never given to a fallback route); else [`Selected::NoMatch`].
///
/// A later template that matches wins over an earlier mistyped one: with
/// `/orders/{id:uint}` and `/orders/new` listed in either order, `/orders/new` takes
/// the literal route and `/orders/07` is refused.
pub fn select<'t, T>(candidates: impl IntoIterator<Item = (T, &'t PathTemplate)>, path: &str) -> Selected<T> {
    let mut mistyped = None;
    for (c, t) in candidates {
        match t.match_path(path) {
            PathMatch::Matched(v) => return Selected::Matched(c, v),
            PathMatch::Mistyped(m) => {
                mistyped.get_or_insert(m);
            }
            PathMatch::NoMatch => {}
        }
    }
    mistyped.map_or(Selected::NoMatch, Selected::Mistyped)
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
            if let Some(inner) = seg.strip_prefix('{').and_then(|v| v.strip_suffix('}')) {
                let (v, kind) = match inner.split_once(':') {
                    None => (inner, Kind::Any),
                    Some((v, k)) => {
                        if !ident(v) {
                            return Err(TemplateError::BadVarName(s.to_owned(), v.to_owned()));
                        }
                        let Some(kind) = Kind::from_name(k) else {
                            return Err(TemplateError::UnknownKind(s.to_owned(), v.to_owned(), k.to_owned()));
                        };
                        (v, kind)
                    }
                };
                if !ident(v) {
                    return Err(TemplateError::BadVarName(s.to_owned(), v.to_owned()));
                }
                if segs.iter().any(|p| matches!(p, Seg::Var(n, _) if n == v)) {
                    return Err(TemplateError::DuplicateVar(s.to_owned(), v.to_owned()));
                }
                segs.push(Seg::Var(v.to_owned(), kind));
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
        self.var_kinds().into_iter().map(|(v, _)| v).collect()
    }

    /// The variables and their types, in segment order.
    pub fn var_kinds(&self) -> Vec<(&str, Kind)> {
        self.segs
            .iter()
            .filter_map(|p| match p {
                Seg::Var(v, k) => Some((v.as_str(), *k)),
                Seg::Lit(_) => None,
            })
            .collect()
    }

    /// Matches a canonical path (no query; see [`crate::canon`]) segment by segment.
    /// A variable takes one whole non-empty segment, as sent (escapes stay escaped);
    /// a typed variable only a value of its [`Kind`], else the path is
    /// [`PathMatch::Mistyped`] (when every other segment fits: same shape).
    pub fn match_path(&self, path: &str) -> PathMatch {
        let Some(rest) = path.strip_prefix('/') else {
            return PathMatch::NoMatch;
        };
        let mut vars = Vars(Vec::new());
        let mut mistyped = None;
        let mut segs = rest.split('/');
        for p in &self.segs {
            let Some(s) = segs.next() else {
                return PathMatch::NoMatch;
            };
            match p {
                Seg::Lit(l) if l == s => {}
                Seg::Var(v, kind) if !s.is_empty() => {
                    if !kind.admits(s) && mistyped.is_none() {
                        mistyped = Some(Mistyped { var: v.clone(), kind: *kind });
                    }
                    vars.0.push((v.clone(), s.to_owned()));
                }
                _ => return PathMatch::NoMatch,
            }
        }
        match (segs.next(), mistyped) {
            (Some(_), _) => PathMatch::NoMatch,
            (None, Some(m)) => PathMatch::Mistyped(m),
            (None, None) => PathMatch::Matched(vars),
        }
    }

    /// The path this template names for `vars`: the inverse of
    /// [`PathTemplate::match_path`].
    pub fn fill(&self, vars: &Vars) -> Result<String, FillError> {
        let mut out = String::new();
        for p in &self.segs {
            out.push('/');
            match p {
                Seg::Lit(l) => out.push_str(l),
                Seg::Var(v, kind) => {
                    let val = vars.get(v).ok_or_else(|| FillError::MissingVar(v.clone()))?;
                    if val.is_empty() || val.contains('/') {
                        return Err(FillError::BadSegment(v.clone()));
                    }
                    if !kind.admits(val) {
                        return Err(Mistyped { var: v.clone(), kind: *kind }.into());
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
            } else if let Some((v, k)) = name.split_once(':').filter(|(v, _)| vars.contains(v)) {
                return Err(TemplateError::TypeInText(s.to_owned(), v.to_owned(), k.to_owned()));
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
        assert_eq!(t.match_path("/items/7").matched(), Some(vars(&[("id", "7")])));
        assert_eq!(t.match_path("/items/%20x").matched(), Some(vars(&[("id", "%20x")])), "escapes stay escaped");
        for p in ["/items/", "/items", "/items/7/x", "items/7", "/Items/7", "", "/"] {
            assert_eq!(t.match_path(p).matched(), None, "{p}");
        }
        let root = PathTemplate::parse("/").unwrap();
        assert!(root.match_path("/").matched().is_some());
        assert!(root.match_path("/x").matched().is_none());
        let slash = PathTemplate::parse("/dir/{d}/").unwrap();
        assert_eq!(slash.match_path("/dir/a/").matched(), Some(vars(&[("d", "a")])));
        assert_eq!(slash.match_path("/dir/a").matched(), None);
        let two = PathTemplate::parse("/t/{tenant}/o/{id}").unwrap();
        assert_eq!(two.vars(), ["tenant", "id"]);
        assert_eq!(
            two.match_path("/t/acme/o/9").matched().unwrap().iter().collect::<Vec<_>>(),
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

    /// The spellings of order 7 (and of other values) that a `{id:uint}` segment must
    /// refuse: each, under an untyped `{id}`, derives a key other than order 7's or a
    /// key at all. `%37` and a raw space never reach a template (the canon refuses
    /// them first); they are refused here too.
    const NOT_UINT: &[&str] = &[
        "07",
        "007",
        "00",
        "+7",
        "-7",
        "7.json",
        "7.0",
        "7.",
        ".7",
        "7,",
        "7~",
        "7:",
        "7@",
        "7=",
        "7-",
        "7_",
        "1e1",
        "0x7",
        "%37",
        "7%20",
        "%207",
        "7 ",
        " 7",
        "7\t",
        "seven",
        "\u{ff17}",
        "18446744073709551616",
        "99999999999999999999",
        "000000000000000000007",
        "7/",
        "/7",
        "",
    ];

    #[test]
    fn typed_placeholders_parse_and_unknown_kinds_are_refused() {
        let t = PathTemplate::parse("/t/{tenant}/orders/{id:uint}").unwrap();
        assert_eq!(t.var_kinds(), [("tenant", Kind::Any), ("id", Kind::Uint)]);
        assert_eq!(t.vars(), ["tenant", "id"]);
        assert_eq!(t.as_str(), "/t/{tenant}/orders/{id:uint}");
        let err = |s: &str| PathTemplate::parse(s).unwrap_err();
        assert_eq!(
            err("/orders/{id:int}").to_string(),
            "\"/orders/{id:int}\": {id:int}: unknown type \"int\" (known: uint; write {id} for any segment)"
        );
        for bad in ["/o/{id:}", "/o/{id:UINT}", "/o/{id:uint:x}", "/o/{id:any}", "/o/{id: uint}"] {
            assert!(matches!(err(bad), TemplateError::UnknownKind(_, v, _) if v == "id"), "{bad}");
        }
        assert!(matches!(err("/o/{:uint}"), TemplateError::BadVarName(_, v) if v.is_empty()));
        assert!(matches!(err("/o/{Id:uint}"), TemplateError::BadVarName(_, v) if v == "Id"));
        assert!(matches!(err("/o/{id}/{id:uint}"), TemplateError::DuplicateVar(_, v) if v == "id"));
        assert!(matches!(err("/o/x{id:uint}"), TemplateError::PartialSegment(_)));
        // A key template names the variable; its type is the path's.
        assert_eq!(
            TextTemplate::parse("payments/order-{id:uint}", &["id"]).unwrap_err().to_string(),
            "\"payments/order-{id:uint}\": {id:uint}: a variable's type goes in the path template; write {id} here"
        );
        assert!(matches!(TextTemplate::parse("k/{x:uint}", &["id"]), Err(TemplateError::UnknownVar(..))));
    }

    #[test]
    fn uint_admits_one_spelling_per_value() {
        for ok in ["0", "7", "10", "42", "18446744073709551615"] {
            assert!(Kind::Uint.admits(ok), "{ok}");
            assert!(Kind::Any.admits(ok), "{ok}");
        }
        for bad in NOT_UINT {
            assert!(!Kind::Uint.admits(bad), "{bad:?}");
        }
        assert_eq!("+7".parse::<u64>(), Ok(7), "why admits checks digits before parsing");
    }

    #[test]
    fn a_mistyped_value_of_the_right_shape_is_neither_a_match_nor_another_shape() {
        let t = PathTemplate::parse("/orders/{id:uint}").unwrap();
        assert_eq!(t.match_path("/orders/7"), PathMatch::Matched(vars(&[("id", "7")])));
        assert_eq!(t.match_path("/orders/0"), PathMatch::Matched(vars(&[("id", "0")])));
        let mistyped = PathMatch::Mistyped(Mistyped { var: "id".into(), kind: Kind::Uint });
        for v in NOT_UINT.iter().filter(|v| !v.is_empty() && !v.contains('/')) {
            assert_eq!(t.match_path(&format!("/orders/{v}")), mistyped, "{v:?}");
        }
        for other in ["/orders/7/", "/orders/7/items", "/orders/", "/orders", "/Orders/7", "orders/7", "/orders//7"] {
            assert_eq!(t.match_path(other), PathMatch::NoMatch, "{other}");
        }
        // Shape first: a literal that differs after a mistyped value is another shape.
        let two = PathTemplate::parse("/orders/{id:uint}/items/{item:uint}").unwrap();
        assert_eq!(two.match_path("/orders/07/other/1"), PathMatch::NoMatch);
        assert_eq!(
            two.match_path("/orders/7/items/01"),
            PathMatch::Mistyped(Mistyped { var: "item".into(), kind: Kind::Uint })
        );
        assert_eq!(
            two.match_path("/orders/07/items/01"),
            PathMatch::Mistyped(Mistyped { var: "id".into(), kind: Kind::Uint }),
            "the first mistyped variable, in segment order"
        );
        // The message names the placeholder and the type, never the value.
        let PathMatch::Mistyped(m) = t.match_path("/orders/7.secret") else { panic!() };
        let msg = m.to_string();
        assert_eq!(
            msg,
            "path segment {id} must be a uint: decimal digits with no sign, leading zero, fraction, suffix or \
             escape, at most 18446744073709551615"
        );
        assert!(!msg.contains("secret"));
        // Filling refuses what matching would: fill and match stay inverse.
        assert_eq!(t.fill(&vars(&[("id", "07")])), Err(FillError::Mistyped(m)));
        assert_eq!(t.fill(&vars(&[("id", "7")])).unwrap(), "/orders/7");
    }

    #[test]
    fn select_takes_the_first_match_then_refuses_a_mistyped_shape() {
        let typed = PathTemplate::parse("/orders/{id:uint}").unwrap();
        let new = PathTemplate::parse("/orders/new").unwrap();
        let any = PathTemplate::parse("/items/{id}").unwrap();
        for order in [[("typed", &typed), ("new", &new)], [("new", &new), ("typed", &typed)]] {
            let cands = || order.iter().copied().chain([("any", &any)]);
            assert_eq!(select(cands(), "/orders/7"), Selected::Matched("typed", vars(&[("id", "7")])));
            assert_eq!(select(cands(), "/orders/new"), Selected::Matched("new", Vars::new()));
            assert_eq!(
                select(cands(), "/orders/07"),
                Selected::Mistyped(Mistyped { var: "id".into(), kind: Kind::Uint })
            );
            assert_eq!(select(cands(), "/items/07"), Selected::Matched("any", vars(&[("id", "07")])));
            assert_eq!(select(cands(), "/orders/7/x"), Selected::NoMatch);
        }
        assert_eq!(select(std::iter::empty::<((), &PathTemplate)>(), "/"), Selected::NoMatch);
    }

    /// A template's text from its parsed segments (the parser's inverse).
    fn render(t: &PathTemplate) -> String {
        t.segs
            .iter()
            .map(|s| match s {
                Seg::Lit(l) => format!("/{l}"),
                Seg::Var(v, Kind::Any) => format!("/{{{v}}}"),
                Seg::Var(v, k) => format!("/{{{v}:{k}}}"),
            })
            .collect()
    }

    /// A path template with typed variables: `(text, [(name, kind)])`.
    fn typed_template() -> impl Strategy<Value = (String, Vec<(String, Kind)>)> {
        let seg_kind = prop_oneof![seg().prop_map(Ok), Just(Err(Kind::Any)), Just(Err(Kind::Uint))];
        (proptest::collection::vec(seg_kind, 1..6), any::<bool>()).prop_map(|(segs, slash)| {
            let mut names = Vec::new();
            let mut text: String = segs
                .into_iter()
                .enumerate()
                .map(|(i, s)| match s {
                    Ok(l) => format!("/{l}"),
                    Err(k) => {
                        names.push((format!("v{i}"), k));
                        if k == Kind::Any {
                            format!("/{{v{i}}}")
                        } else {
                            format!("/{{v{i}:{k}}}")
                        }
                    }
                })
                .collect();
            if slash {
                text.push('/');
            }
            (text, names)
        })
    }

    /// A segment that is not a uint: a uint spelled another way, or other text.
    fn not_uint() -> impl Strategy<Value = String> {
        prop_oneof![
            (any::<u64>(), "0{1,3}").prop_map(|(n, z)| format!("{z}{n}")),
            (any::<u64>(), "[-+ ]|%20|%2B").prop_map(|(n, p)| format!("{p}{n}")),
            (any::<u64>(), "[.,~:@=_-][a-z0-9]{0,4}|%20| |e[0-9]").prop_map(|(n, s)| format!("{n}{s}")),
            (any::<u64>(), 1u64..=9).prop_map(|(n, d)| format!("{n}{d:0>20}")),
            "[A-Za-z0-9%._~:@!$&'()*+,=-]{1,8}",
        ]
        .prop_filter("not a uint", |s| !Kind::Uint.admits(s))
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
            let m = t.match_path(&path).matched().unwrap();
            prop_assert_eq!(&m, &v);
            prop_assert_eq!(t.fill(&m).unwrap(), path);
            if let Some(m) = t.match_path(&other).matched() {
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

        /// `uint` admits exactly the decimal spellings of u64 values: every value's,
        /// and nothing that is not one (so two admitted segments of equal value are
        /// the same text).
        #[test]
        fn uint_admits_exactly_the_decimal_spelling_of_a_u64(
            n in any::<u64>(),
            s in "[0-9]{0,21}|[0-9+ .%eEx-]{0,22}",
            t in "[0-9]{0,21}|[0-9+ .%eEx-]{0,22}",
        ) {
            prop_assert!(Kind::Uint.admits(&n.to_string()));
            let canonical = |s: &str| s.parse::<u64>().is_ok_and(|v| v.to_string() == s);
            prop_assert_eq!(Kind::Uint.admits(&s), canonical(&s), "{:?}", s);
            if Kind::Uint.admits(&s) && Kind::Uint.admits(&t) && s.parse::<u64>() == t.parse::<u64>() {
                prop_assert_eq!(&s, &t);
            }
        }

        /// Typed templates: the parser's segments render back to the text; filling
        /// with values of each type and matching are inverse; a value of the wrong
        /// type in one variable makes the same path shape mistyped, naming that
        /// variable.
        #[test]
        fn typed_templates_round_trip_and_refuse_other_spellings(
            (text, names) in typed_template(),
            anys in proptest::collection::vec(seg(), 6),
            uints in proptest::collection::vec(any::<u64>(), 6),
            wrong in not_uint(),
            pick in any::<proptest::sample::Index>(),
        ) {
            let t = PathTemplate::parse(&text).unwrap();
            prop_assert_eq!(render(&t), text.clone());
            let kinds: Vec<(&str, Kind)> = names.iter().map(|(n, k)| (n.as_str(), *k)).collect();
            prop_assert_eq!(t.var_kinds(), kinds);
            let mut v = Vars::new();
            for (i, (n, k)) in names.iter().enumerate() {
                match k {
                    Kind::Any => v.insert(n.as_str(), anys[i].as_str()),
                    Kind::Uint => v.insert(n.as_str(), uints[i].to_string()),
                }
            }
            let path = t.fill(&v).unwrap();
            prop_assert_eq!(t.match_path(&path), PathMatch::Matched(v.clone()));
            let typed: Vec<&str> = names.iter().filter(|(_, k)| *k == Kind::Uint).map(|(n, _)| n.as_str()).collect();
            if !typed.is_empty() && !wrong.contains('/') {
                let var = *pick.get(&typed);
                let mut bad = v.clone();
                bad.insert(var, wrong.as_str());
                prop_assert_eq!(
                    t.fill(&bad),
                    Err(FillError::Mistyped(Mistyped { var: var.to_owned(), kind: Kind::Uint }))
                );
                // The same path with the wrong spelling, built by hand.
                let bad_path: String = t
                    .segs
                    .iter()
                    .map(|s| match s {
                        Seg::Lit(l) => format!("/{l}"),
                        Seg::Var(n, _) => format!("/{}", bad.get(n).unwrap_or_default()),
                    })
                    .collect();
                prop_assert_eq!(
                    t.match_path(&bad_path),
                    PathMatch::Mistyped(Mistyped { var: var.to_owned(), kind: Kind::Uint })
                );
            }
        }

        /// Parsing never panics on any text.
        #[test]
        fn parse_never_panics(s in "[{}a-z:/%._-]{0,24}", p in "[/0-9a-z:%._+-]{0,12}") {
            if let Ok(t) = PathTemplate::parse(&s) {
                let _ = t.match_path(&p);
            }
            let _ = TextTemplate::parse(&s, &["id"]);
        }
    }
}
