//! Routes: which resource a request touches, which lock guards it, and whether it
//! is a read.
//!
//! A path template is `/`-separated segments, each literal or `{var}` (one whole,
//! non-empty segment). Resource and lock key templates substitute `{var}` from the
//! path and `{header:name}` from a request header. A request no route matches is a
//! write on the `unlisted` guard, or refused when there is none (fail closed); a
//! method a route does not list as a read is a write.

use std::collections::HashMap;

use http::HeaderMap;
use lockmesh_core::LockKey;
use serde::Deserialize;

/// What an equal token may do (ADR-16/17).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EqualRule {
    /// Only a greater token writes: one write per grant per resource. A store
    /// failure after the mark advanced burns the grant. The default.
    Strict,
    /// An equal token writes too: a holder may write the resource several times
    /// under one grant.
    Allow,
}

/// One template segment.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Part {
    Lit(String),
    Var(String),
    Header(String),
}

/// A parsed template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
    is_path: bool,
}

/// A configured route.
#[derive(Clone, Debug)]
pub struct Route {
    /// Name (metrics, logs).
    pub name: String,
    /// Path template; `None` for the unlisted guard.
    pub path: Option<Template>,
    /// Methods passed through as reads; every other method is a write.
    pub reads: Vec<String>,
    /// Resource id template.
    pub resource: Template,
    /// Lock key template.
    pub lock_key: Template,
    /// Whether a token equal to the resource's mark may write (route's or `default_equal`).
    pub equal: EqualRule,
}

/// What a request is, once classified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Class {
    /// Pass through.
    Read,
    /// Needs a grant of `key` and a mark check on `resource`.
    Write {
        /// Resource id, the route's template filled in.
        resource: String,
        /// Guarding key.
        key: LockKey,
        /// Whether a token equal to the resource's mark may write.
        equal: EqualRule,
    },
}

/// Why a request could not be classified.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No route matched and there is no unlisted guard.
    #[error("no route matches this path; unlisted routes are writes nobody can authorise")]
    Unlisted,
    /// A template could not be filled (missing header, invalid key).
    #[error("{0}")]
    Unresolved(String),
}

// === impl Template ===

impl Template {
    /// Parses a path template (`/items/{id}`).
    pub(crate) fn parse_path(s: &str) -> Result<Self, String> {
        let Some(rest) = s.strip_prefix('/') else {
            return Err(format!("{s:?} must start with '/'"));
        };
        let mut parts = Vec::new();
        for seg in rest.split('/') {
            if let Some(v) = seg.strip_prefix('{').and_then(|v| v.strip_suffix('}')) {
                if !ident(v) {
                    return Err(format!("{s:?}: {{{v}}} is not a variable name ([a-z0-9_]+)"));
                }
                if parts.contains(&Part::Var(v.to_owned())) {
                    return Err(format!("{s:?}: {{{v}}} appears twice"));
                }
                parts.push(Part::Var(v.to_owned()));
            } else if seg.contains('{') || seg.contains('}') {
                return Err(format!("{s:?}: a variable must be a whole segment"));
            } else {
                parts.push(Part::Lit(seg.to_owned()));
            }
        }
        Ok(Self { parts, is_path: true })
    }

    /// Parses a text template using only `vars` and headers.
    pub fn parse(s: &str, vars: &[String]) -> Result<Self, String> {
        if s.is_empty() {
            return Err("must not be empty".into());
        }
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Lit(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(format!("{s:?}: unclosed '{{'"));
            };
            let name = &rest[open + 1..open + close];
            if let Some(h) = name.strip_prefix("header:") {
                if h.is_empty() || !h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
                    return Err(format!("{s:?}: {{header:{h}}} must name a lower-case header"));
                }
                parts.push(Part::Header(h.to_owned()));
            } else if vars.iter().any(|v| v == name) {
                parts.push(Part::Var(name.to_owned()));
            } else {
                return Err(format!("{s:?}: {{{name}}} is not a variable of the path"));
            }
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("{s:?}: unmatched '}}'"));
        }
        if !rest.is_empty() {
            parts.push(Part::Lit(rest.to_owned()));
        }
        Ok(Self { parts, is_path: false })
    }

    /// The variables of a path template.
    pub(crate) fn vars(&self) -> Vec<String> {
        self.parts
            .iter()
            .filter_map(|p| match p {
                Part::Var(v) => Some(v.clone()),
                _ => None,
            })
            .collect()
    }

    /// Matches a request path (without the query) against a path template.
    pub(crate) fn match_path(&self, path: &str) -> Option<HashMap<String, String>> {
        debug_assert!(self.is_path);
        let segs: Vec<&str> = path.strip_prefix('/')?.split('/').collect();
        if segs.len() != self.parts.len() {
            return None;
        }
        let mut vars = HashMap::new();
        for (p, s) in self.parts.iter().zip(segs) {
            match p {
                Part::Lit(l) if l == s => {}
                Part::Var(v) if !s.is_empty() => {
                    vars.insert(v.clone(), s.to_owned());
                }
                _ => return None,
            }
        }
        Some(vars)
    }

    /// Fills a text template.
    pub(crate) fn fill(&self, vars: &HashMap<String, String>, headers: &HeaderMap) -> Result<String, String> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Lit(l) => out.push_str(l),
                Part::Var(v) => out.push_str(vars.get(v).map(String::as_str).unwrap_or_default()),
                Part::Header(h) => {
                    let mut vals = headers.get_all(h.as_str()).iter();
                    match (vals.next().and_then(|v| v.to_str().ok()), vals.next()) {
                        (Some(v), None) if !v.is_empty() => out.push_str(v),
                        _ => return Err(format!("header {h} must appear exactly once, as non-empty text")),
                    }
                }
            }
        }
        Ok(out)
    }
}

fn ident(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

// === impl Route ===

/// Classifies a request by the first matching route, else the unlisted guard.
pub fn classify(
    routes: &[Route],
    unlisted: Option<&Route>,
    method: &str,
    path: &str,
    headers: &HeaderMap,
) -> Result<(String, Class), RouteError> {
    let found = routes.iter().find_map(|r| r.path.as_ref()?.match_path(path).map(|v| (r, v)));
    let (route, vars) = match (found, unlisted) {
        (Some(f), _) => f,
        (None, Some(u)) => (u, HashMap::new()),
        (None, None) => return Err(RouteError::Unlisted),
    };
    if route.reads.iter().any(|m| m == method) {
        return Ok((route.name.clone(), Class::Read));
    }
    let resource = route.resource.fill(&vars, headers).map_err(|e| RouteError::Unresolved(format!("resource: {e}")))?;
    let key = route.lock_key.fill(&vars, headers).map_err(|e| RouteError::Unresolved(format!("lock key: {e}")))?;
    let key = LockKey::parse(key.as_bytes())
        .map_err(|e| RouteError::Unresolved(format!("the route's lock key is not a valid key: {e}")))?;
    Ok((route.name.clone(), Class::Write { resource, key, equal: route.equal }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(path: &str, reads: &[&str], res: &str, key: &str) -> Route {
        let p = Template::parse_path(path).unwrap();
        let vars = p.vars();
        Route {
            name: "r".into(),
            path: Some(p),
            reads: reads.iter().map(|s| (*s).to_owned()).collect(),
            resource: Template::parse(res, &vars).unwrap(),
            lock_key: Template::parse(key, &vars).unwrap(),
            equal: EqualRule::Strict,
        }
    }

    #[test]
    fn classifies_reads_writes_and_unlisted() {
        let rs = [route("/items/{id}", &["GET", "HEAD"], "items/{id}", "orders/items/{id}")];
        let h = HeaderMap::new();
        assert_eq!(classify(&rs, None, "GET", "/items/7", &h).unwrap().1, Class::Read);
        let (_, c) = classify(&rs, None, "PUT", "/items/7", &h).unwrap();
        assert_eq!(
            c,
            Class::Write {
                resource: "items/7".into(),
                key: LockKey::parse(b"orders/items/7").unwrap(),
                equal: EqualRule::Strict
            }
        );
        // An unlisted method is a write.
        assert!(matches!(classify(&rs, None, "PATCH", "/items/7", &h).unwrap().1, Class::Write { .. }));
        assert!(matches!(classify(&rs, None, "get", "/items/7", &h).unwrap().1, Class::Write { .. }));
        // An unlisted path, even a GET, is refused without a guard and a write with one.
        assert_eq!(classify(&rs, None, "GET", "/other", &h), Err(RouteError::Unlisted));
        assert_eq!(classify(&rs, None, "GET", "/items/7/x", &h), Err(RouteError::Unlisted));
        assert_eq!(classify(&rs, None, "GET", "/items/", &h), Err(RouteError::Unlisted));
        let mut g = route("/x", &[], "store", "orders/all");
        g.path = None;
        assert!(matches!(classify(&rs, Some(&g), "GET", "/other", &h).unwrap().1, Class::Write { .. }));
        // A path value that makes an invalid key is refused, not normalised.
        assert!(matches!(classify(&rs, None, "PUT", "/items/..", &h), Err(RouteError::Unresolved(_))));
    }

    #[test]
    fn header_templates_need_exactly_one_value() {
        let rs = [route("/t/{id}", &[], "{header:x-tenant}/{id}", "orders/{header:x-tenant}/{id}")];
        let mut h = HeaderMap::new();
        assert!(classify(&rs, None, "PUT", "/t/1", &h).is_err());
        h.insert("x-tenant", "acme".parse().unwrap());
        let (_, c) = classify(&rs, None, "PUT", "/t/1", &h).unwrap();
        assert!(matches!(c, Class::Write { resource, .. } if resource == "acme/1"));
        h.append("x-tenant", "evil".parse().unwrap());
        assert!(classify(&rs, None, "PUT", "/t/1", &h).is_err());
    }

    #[test]
    fn templates_are_validated() {
        assert!(Template::parse_path("items/{id}").is_err());
        assert!(Template::parse_path("/items/x{id}").is_err());
        assert!(Template::parse_path("/a/{id}/{id}").is_err());
        assert!(Template::parse("k/{nope}", &["id".into()]).is_err());
        assert!(Template::parse("k/{id", &["id".into()]).is_err());
        assert!(Template::parse("k/{header:X-Up}", &[]).is_err());
        assert!(Template::parse("", &[]).is_err());
    }
}
