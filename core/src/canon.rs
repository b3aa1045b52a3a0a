//! The one canonical form of a request path (issue #17).
//!
//! A route, a bound key template or a fence's resource decided on a path names the
//! resource the upstream serves only if the upstream reads the path the same way.
//! Upstreams disagree on how to read odd spellings: one percent-decodes before it
//! splits on `/`, another merges `//`, a third maps `\` to `/` or strips `;`
//! parameters. lockmesh therefore does not normalise: it accepts one spelling per
//! path, the one every such reading leaves unchanged, and refuses the rest with a
//! message naming the problem. The filter (on every request of a sidecar) and
//! fence-proxy (before it classifies a request) both call [`check`].
//!
//! A request target is **canonical** when all of these hold:
//!
//! 1. It is in origin form: it starts with `/`. Absolute form (`http://h/p`),
//!    authority form and `*` are refused.
//! 2. The path is the part before the first `?`; the query after it is opaque to
//!    routing and only has to pass rule 7.
//! 3. Segments are separated by exactly one `/`: no empty segment, except that the
//!    path may end in `/` (`/orders/` is canonical; `//orders` and `/a//b` are not).
//! 4. No segment is `.` or `..`.
//! 5. Every byte written plainly is an RFC 3986 path character other than `;`:
//!    `A-Z a-z 0-9 - . _ ~`, `! $ & ' ( ) * + , =`, `:` and `@`. So no `\`, no `;`
//!    (path parameters), no `#` (fragment), no space, control or non-ASCII byte.
//! 6. A percent escape is `%` and two upper-case hex digits, and encodes a byte that
//!    rule 5 does not allow plainly and that is not a delimiter: an escape of a
//!    byte rule 5 allows (`%41`, `%2E`, `%7E`, `%40`: it has a plain spelling, and two
//!    spellings would be two resources to a fence), of `/ \ ; ? #` (`%2F %5C %3B %3F %23`), of
//!    `%` itself (`%25`: a server that decodes twice would read what follows as an
//!    escape) or of NUL (`%00`) is refused, as is lower-case hex (`%2f`).
//! 7. The query holds no `#`, space, control or non-ASCII byte.
//!
//! Escapes of other bytes stay (`%20`, `%C3%A9`): they have one spelling, and no
//! decoding turns them into a separator or a dot segment. Case is kept: `/Orders`
//! and `/orders` are different paths, as they are to a case-sensitive upstream.

use std::fmt;

/// Longest request target accepted, in bytes. Envoy's default header limit is
/// larger; no lockmesh route needs more.
pub const MAX_TARGET_LEN: usize = 8192;

/// A canonical request target, split at the first `?`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Canon<'a> {
    path: &'a str,
    query: Option<&'a str>,
}

impl<'a> Canon<'a> {
    /// The path (before `?`), canonical.
    pub fn path(&self) -> &'a str {
        self.path
    }

    /// The query (after the first `?`), if the target has one.
    pub fn query(&self) -> Option<&'a str> {
        self.query
    }

    /// The path's segments (`/a/b/` gives `a`, `b`, ``), still percent-encoded:
    /// the canonical spelling is the segment's one spelling.
    pub fn segments(&self) -> impl Iterator<Item = &'a str> {
        self.path.get(1..).unwrap_or_default().split('/')
    }
}

/// Why a target is not canonical. Messages name the rule and the byte offset,
/// never the path itself (it may carry identifiers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CanonError {
    /// Empty target.
    Empty,
    /// Longer than [`MAX_TARGET_LEN`].
    TooLong(usize),
    /// Not origin form (absolute form, authority form, `*`).
    NotOriginForm,
    /// An empty segment (`//`) at this byte offset.
    EmptySegment(usize),
    /// A `.` or `..` segment starting at this byte offset.
    DotSegment(usize),
    /// A `\` at this byte offset.
    Backslash(usize),
    /// A `;` (path parameter) at this byte offset.
    PathParameter(usize),
    /// A `#` (fragment) at this byte offset.
    Fragment(usize),
    /// A space, control or non-ASCII byte, or a character outside the path
    /// characters, at this byte offset.
    BadByte(usize),
    /// A `%` not followed by two hex digits, or with lower-case hex, at this offset.
    BadEscape(usize),
    /// An escape of a byte that has a plain spelling at this offset.
    NeedlessEscape(usize),
    /// An escape of a delimiter (`/ \ ; ? # %`) or of NUL at this offset.
    EncodedDelimiter(usize),
}

impl fmt::Display for CanonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CanonError::Empty => write!(f, "path is empty"),
            CanonError::TooLong(n) => write!(f, "request target is {n} bytes, above the maximum {MAX_TARGET_LEN}"),
            CanonError::NotOriginForm => write!(f, "request target must be a path starting with '/' (origin form)"),
            CanonError::EmptySegment(i) => write!(f, "path has an empty segment ('//') at byte {i}"),
            CanonError::DotSegment(i) => write!(f, "path has a '.' or '..' segment at byte {i}"),
            CanonError::Backslash(i) => write!(f, "path has a backslash at byte {i}"),
            CanonError::PathParameter(i) => write!(f, "path has a ';' path parameter at byte {i}"),
            CanonError::Fragment(i) => write!(f, "request target has a '#' fragment at byte {i}"),
            CanonError::BadByte(i) => write!(f, "request target has a byte outside the path characters at byte {i}"),
            CanonError::BadEscape(i) => {
                write!(f, "path has a malformed or lower-case percent escape at byte {i} (use %XX, upper-case hex)")
            }
            CanonError::NeedlessEscape(i) => {
                write!(f, "path escapes a character that has a plain spelling at byte {i} (write it plainly)")
            }
            CanonError::EncodedDelimiter(i) => {
                write!(f, "path has an encoded '/', '\\', ';', '?', '#', '%' or NUL at byte {i}")
            }
        }
    }
}

impl std::error::Error for CanonError {}

/// RFC 3986 `unreserved`.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// A byte rule 5 allows plainly in a path segment.
fn plain_path_byte(b: u8) -> bool {
    unreserved(b) || matches!(b, b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b'=' | b':' | b'@')
}

fn upper_hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decides whether `target` (a `:path` header value, query included) is canonical.
pub fn check(target: &[u8]) -> Result<Canon<'_>, CanonError> {
    if target.is_empty() {
        return Err(CanonError::Empty);
    }
    if target.len() > MAX_TARGET_LEN {
        return Err(CanonError::TooLong(target.len()));
    }
    if target.first() != Some(&b'/') {
        return Err(CanonError::NotOriginForm);
    }
    let split = target.iter().position(|b| *b == b'?').unwrap_or(target.len());
    let (path, rest) = target.split_at(split);
    check_path(path)?;
    let query = match rest.split_first() {
        Some((_, q)) => {
            for (i, b) in q.iter().enumerate() {
                let at = split + 1 + i;
                match *b {
                    b'#' => return Err(CanonError::Fragment(at)),
                    b if !b.is_ascii_graphic() => return Err(CanonError::BadByte(at)),
                    _ => {}
                }
            }
            Some(q)
        }
        None => None,
    };
    // Every byte checked above is ASCII, so both halves are UTF-8.
    let path = std::str::from_utf8(path).map_err(|e| CanonError::BadByte(e.valid_up_to()))?;
    let query = match query {
        Some(q) => Some(std::str::from_utf8(q).map_err(|e| CanonError::BadByte(split + 1 + e.valid_up_to()))?),
        None => None,
    };
    Ok(Canon { path, query })
}

/// Rules 3 to 6 over the path (starts with `/`, no `?`).
fn check_path(path: &[u8]) -> Result<(), CanonError> {
    // Segment boundaries first, so a `/./` reads as a dot segment, not a byte.
    let mut start = 1;
    for seg in path.get(1..).unwrap_or_default().split(|b| *b == b'/') {
        let last = start + seg.len() == path.len();
        if seg.is_empty() && !last {
            return Err(CanonError::EmptySegment(start));
        }
        if seg == b"." || seg == b".." {
            return Err(CanonError::DotSegment(start));
        }
        start += seg.len() + 1;
    }
    let mut i = 0;
    while let Some(&b) = path.get(i) {
        match b {
            b'/' => {}
            b'\\' => return Err(CanonError::Backslash(i)),
            b';' => return Err(CanonError::PathParameter(i)),
            b'#' => return Err(CanonError::Fragment(i)),
            b'%' => {
                let hi = path.get(i + 1).copied().and_then(upper_hex);
                let lo = path.get(i + 2).copied().and_then(upper_hex);
                let (Some(hi), Some(lo)) = (hi, lo) else {
                    return Err(CanonError::BadEscape(i));
                };
                let decoded = hi * 16 + lo;
                if matches!(decoded, b'/' | b'\\' | b';' | b'?' | b'#' | b'%' | 0) {
                    return Err(CanonError::EncodedDelimiter(i));
                }
                if plain_path_byte(decoded) {
                    return Err(CanonError::NeedlessEscape(i));
                }
                i += 3;
                continue;
            }
            b if plain_path_byte(b) => {}
            _ => return Err(CanonError::BadByte(i)),
        }
        i += 1;
    }
    Ok(())
}

/// Whether path prefix `prefix` covers the canonical path `path` on a segment
/// boundary: `/orders` covers `/orders`, `/orders/` and `/orders/7`, not
/// `/ordersx`; `/orders/` covers `/orders/7` but not `/orders`; `/` covers all.
pub fn covers(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn err(t: &str) -> CanonError {
        match check(t.as_bytes()) {
            Err(e) => e,
            Ok(c) => panic!("{t:?} passed as {c:?}"),
        }
    }

    #[test]
    fn canonical_targets_pass() {
        for t in [
            "/",
            "/orders",
            "/orders/",
            "/orders/7",
            "/orders/7?x=1&y=%2F",
            "/a-b_c.d~e/f!$&'()*+,=:@",
            "/caf%C3%A9",
            "/with%20space",
            "/.well-known/x",
            "/a/...",
            "/a/.b",
            "/?",
        ] {
            let c = check(t.as_bytes()).unwrap_or_else(|e| panic!("{t:?}: {e}"));
            assert_eq!(c.path(), t.split('?').next().unwrap());
        }
        let c = check(b"/a/b/?q").unwrap();
        assert_eq!(c.segments().collect::<Vec<_>>(), ["a", "b", ""]);
        assert_eq!(c.query(), Some("q"));
    }

    #[test]
    fn each_rule_refuses_with_its_own_error() {
        assert_eq!(err(""), CanonError::Empty);
        assert_eq!(err("orders/1"), CanonError::NotOriginForm);
        assert_eq!(err("http://h/orders/1"), CanonError::NotOriginForm);
        assert_eq!(err("*"), CanonError::NotOriginForm);
        assert_eq!(err("//orders"), CanonError::EmptySegment(1));
        assert_eq!(err("/a//b"), CanonError::EmptySegment(3));
        assert_eq!(err("/public/../orders/1"), CanonError::DotSegment(8));
        assert_eq!(err("/./a"), CanonError::DotSegment(1));
        assert_eq!(err("/a/.."), CanonError::DotSegment(3));
        assert_eq!(err("/public/%2e%2e/orders/1"), CanonError::BadEscape(8));
        assert_eq!(err("/public/%2E%2E/orders/1"), CanonError::NeedlessEscape(8));
        assert_eq!(err("/public/..%2Forders/1"), CanonError::EncodedDelimiter(10));
        assert_eq!(err("/a%5Cb"), CanonError::EncodedDelimiter(2));
        assert_eq!(err("/a%00"), CanonError::EncodedDelimiter(2));
        assert_eq!(err("/a%252e"), CanonError::EncodedDelimiter(2));
        assert_eq!(err("/a%3Bb"), CanonError::EncodedDelimiter(2));
        assert_eq!(err("/items/%38"), CanonError::NeedlessEscape(7));
        assert_eq!(err("/a%40b"), CanonError::NeedlessEscape(2));
        assert_eq!(err("/a%2B"), CanonError::NeedlessEscape(2));
        assert_eq!(err("/a\\b"), CanonError::Backslash(2));
        assert_eq!(err("/a;x=1/b"), CanonError::PathParameter(2));
        assert_eq!(err("/a#f"), CanonError::Fragment(2));
        assert_eq!(err("/a?b#f"), CanonError::Fragment(4));
        assert_eq!(err("/a b"), CanonError::BadByte(2));
        assert_eq!(err("/a\u{e9}"), CanonError::BadByte(2));
        assert_eq!(err("/a?\x01"), CanonError::BadByte(3));
        assert_eq!(err("/a%4"), CanonError::BadEscape(2));
        assert_eq!(err("/a[b]"), CanonError::BadByte(2));
        let long = format!("/{}", "a".repeat(MAX_TARGET_LEN));
        assert_eq!(err(&long), CanonError::TooLong(MAX_TARGET_LEN + 1));
    }

    #[test]
    fn messages_never_echo_the_path() {
        let e = err("/secret-order-42/../x");
        assert!(!e.to_string().contains("secret"), "{e}");
    }

    #[test]
    fn covers_on_segment_boundaries() {
        assert!(covers("/orders", "/orders"));
        assert!(covers("/orders", "/orders/"));
        assert!(covers("/orders", "/orders/7"));
        assert!(!covers("/orders", "/ordersx"));
        assert!(covers("/orders/", "/orders/7"));
        assert!(!covers("/orders/", "/orders"));
        assert!(covers("/", "/anything"));
    }

    /// What an upstream that normalises does to a path: percent-decode every
    /// escape, map `\` to `/`, drop `;` parameters, merge slashes, resolve dot
    /// segments. Not a real server: the union of the readings the module doc names.
    fn normalise(path: &str) -> Vec<u8> {
        let bytes: Vec<u8> = decode(path).into_iter().map(|b| if b == b'\\' { b'/' } else { b }).collect();
        let mut out: Vec<&[u8]> = Vec::new();
        let trailing = bytes.ends_with(b"/");
        for seg in bytes.split(|b| *b == b'/') {
            let seg = seg.split(|b| *b == b';').next().unwrap_or_default();
            match seg {
                b"" | b"." => {}
                b".." => {
                    out.pop();
                }
                s => out.push(s),
            }
        }
        let mut n = Vec::new();
        for s in &out {
            n.push(b'/');
            n.extend_from_slice(s);
        }
        if n.is_empty() || (trailing && !out.is_empty()) {
            n.push(b'/');
        }
        n
    }

    fn decode(path: &str) -> Vec<u8> {
        let raw = path.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while let Some(&b) = raw.get(i) {
            if b == b'%' {
                if let Some(h) =
                    raw.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok())
                {
                    out.push(h);
                    i += 3;
                    continue;
                }
            }
            out.push(b);
            i += 1;
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        /// A canonical path is a fixed point of every normalising reading: a
        /// normalising upstream serves exactly the path lockmesh decided on.
        #[test]
        fn canonical_paths_survive_normalisation(t in "(/([a-zA-Z0-9._~;:@%\\\\-]|%[0-9A-Fa-f]{2}){0,6}){1,5}/?") {
            if let Ok(c) = check(t.as_bytes()) {
                prop_assert_eq!(normalise(c.path()), decode(c.path()), "{}", t);
            }
        }

        /// Two different canonical paths never read as the same path after
        /// decoding: one spelling per path.
        #[test]
        fn one_spelling_per_path(a in "(/([a.!@+]|%(61|2E|21|40|2B|20|C3)){1,3}){1,2}", b in "(/([a.!@+]|%(61|2E|21|40|2B|20|C3)){1,3}){1,2}") {
            if let (Ok(ca), Ok(cb)) = (check(a.as_bytes()), check(b.as_bytes())) {
                if ca.path() != cb.path() {
                    prop_assert_ne!(decode(ca.path()), decode(cb.path()));
                }
            }
        }

        /// Arbitrary bytes never panic, and whatever passes is ASCII printable.
        #[test]
        fn any_bytes_are_decided(t in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(c) = check(&t) {
                prop_assert!(c.path().bytes().all(|b| b.is_ascii_graphic()));
            }
        }
    }
}
