//! Routes: which resource a request touches, which lock guards it, and whether it
//! is a read.
//!
//! The template language (path templates, `{var}` and `{header:name}` in resource and
//! key templates, the one-header-value rule) is `lockmesh_core::template`, shared with
//! the Wasm filter's bound keys. Requests are classified on their canonical path
//! (`lockmesh_core::canon`; the server refuses every other spelling first), so one
//! resource has one spelling here and one mark. A request no route matches is a
//! write on the `unlisted` guard, or refused when there is none (fail closed); a
//! method a route does not list as a read is a write. A path of a route's shape
//! whose typed variable does not fit (`/orders/07` against `/orders/{id:uint}`) is
//! refused `400 bad_request` whatever the method, never given to the `unlisted`
//! guard: under the guard's lock a store that reads `07` as 7 would take a write to
//! order 7 that order 7's lock never saw.

use http::HeaderMap;
use lockmesh_core::{
    template::{self, FillError, HeaderLookup, PathTemplate, Selected, TextTemplate, Vars},
    LockKey,
};
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

/// Whether a DELETE may carry a body on a route (`delete_body`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeleteBody {
    /// A DELETE with a body is refused (`400 body_not_allowed`). The default: RFC
    /// 9110 gives a DELETE body no meaning and many stores never read one, and a
    /// body a store does not read is taken for the next request on its connection.
    #[default]
    Refuse,
    /// The fence reads the body (bounded by `max_body_bytes`) and forwards it with
    /// its own `content-length`, on a connection used for that request only.
    Allow,
}

/// A configured route.
#[derive(Clone, Debug)]
pub struct Route {
    /// Name (metrics, logs).
    pub name: String,
    /// Path template; `None` for the unlisted guard.
    pub path: Option<PathTemplate>,
    /// Methods passed through as reads; every other method is a write.
    pub reads: Vec<String>,
    /// Resource id template.
    pub resource: TextTemplate,
    /// Lock key template.
    pub lock_key: TextTemplate,
    /// Whether a token equal to the resource's mark may write (route's or `default_equal`).
    pub equal: EqualRule,
    /// Whether a DELETE may carry a body.
    pub delete_body: DeleteBody,
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
    /// A template could not be filled (missing header, invalid key), or a typed
    /// path variable's value does not fit its type (the message names the
    /// variable, never the value). Answered `400 bad_request`.
    #[error("{0}")]
    Unresolved(String),
}

// === impl Route ===

/// The route a request takes: the first whose path template matches, else (when no
/// route has the path's shape with a mistyped value: refused) the unlisted guard,
/// with the path's variables. The same choice as the Wasm filter's
/// (`template::select`).
fn find<'a>(routes: &'a [Route], unlisted: Option<&'a Route>, path: &str) -> Result<(&'a Route, Vars), RouteError> {
    let templates = routes.iter().filter_map(|r| r.path.as_ref().map(|p| (r, p)));
    match (template::select(templates, path), unlisted) {
        (Selected::Matched(r, v), _) => Ok((r, v)),
        (Selected::Mistyped(m), _) => Err(RouteError::Unresolved(format!("path: {m}"))),
        (Selected::NoMatch, Some(u)) => Ok((u, Vars::new())),
        (Selected::NoMatch, None) => Err(RouteError::Unlisted),
    }
}

/// The route `path` takes (see [`classify`]), for its per-route rules.
pub fn route_for<'a>(routes: &'a [Route], unlisted: Option<&'a Route>, path: &str) -> Result<&'a Route, RouteError> {
    find(routes, unlisted, path).map(|(r, _)| r)
}

/// Classifies a request by the first matching route, else the unlisted guard.
/// `path` is the request's canonical path, without the query.
pub fn classify(
    routes: &[Route],
    unlisted: Option<&Route>,
    method: &str,
    path: &str,
    headers: &HeaderMap,
) -> Result<(String, Class), RouteError> {
    let (route, vars) = find(routes, unlisted, path)?;
    if route.reads.iter().any(|m| m == method) {
        return Ok((route.name.clone(), Class::Read));
    }
    let lookup = |name: &str| HeaderLookup::from_values(headers.get_all(name).iter().map(|v| v.as_bytes()));
    let resource = route.resource.fill(&vars, &lookup).map_err(|e| RouteError::Unresolved(format!("resource: {e}")))?;
    let key = route.lock_key.fill_key(&vars, &lookup).map_err(|e| match e {
        FillError::Key(e) => RouteError::Unresolved(format!("the route's lock key is not a valid key: {e}")),
        e => RouteError::Unresolved(format!("lock key: {e}")),
    })?;
    Ok((route.name.clone(), Class::Write { resource, key, equal: route.equal }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(path: &str, reads: &[&str], res: &str, key: &str) -> Route {
        let p = PathTemplate::parse(path).unwrap();
        let vars = p.vars();
        let (resource, lock_key) = (TextTemplate::parse(res, &vars).unwrap(), TextTemplate::parse(key, &vars).unwrap());
        Route {
            name: "r".into(),
            path: Some(p),
            reads: reads.iter().map(|s| (*s).to_owned()).collect(),
            resource,
            lock_key,
            equal: EqualRule::Strict,
            delete_body: DeleteBody::Refuse,
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

    /// Spellings of item 7 other than `7`; each names another resource and another
    /// key under an untyped `{id}`, and a store that parses numbers reads it as 7.
    const ITEM_7_VARIANTS: &[&str] = &[
        "/items/07",
        "/items/007",
        "/items/+7",
        "/items/7.json",
        "/items/7.",
        "/items/7,",
        "/items/7~",
        "/items/7:",
        "/items/7@",
        "/items/7=",
        "/items/7-",
        "/items/7_",
        "/items/0x7",
        "/items/7e0",
        "/items/18446744073709551623",
    ];

    fn guard() -> Route {
        let mut g = route("/x", &[], "store", "orders/all");
        g.path = None;
        g.name = "unlisted".into();
        g
    }

    #[test]
    fn a_typed_id_refuses_other_spellings_instead_of_the_unlisted_guard() {
        let rs = [route("/items/{id:uint}", &["GET"], "items/{id}", "orders/items/{id}")];
        let (h, g) = (HeaderMap::new(), guard());
        let (_, c) = classify(&rs, Some(&g), "PUT", "/items/7", &h).unwrap();
        assert!(
            matches!(c, Class::Write { resource, key, .. } if resource == "items/7" && key.as_str() == "orders/items/7")
        );
        for p in ITEM_7_VARIANTS {
            for m in ["PUT", "GET", "DELETE"] {
                let e = classify(&rs, Some(&g), m, p, &h).unwrap_err();
                let RouteError::Unresolved(msg) = &e else { panic!("{p}: {e:?}") };
                assert!(msg.starts_with("path: path segment {id} must be a uint"), "{p}: {msg}");
                let seg = p.trim_start_matches("/items/");
                assert!(!msg.contains(seg) || seg.chars().all(|c| c.is_ascii_digit()), "{p}: names the value: {msg}");
                assert!(route_for(&rs, Some(&g), p).is_err(), "{p}");
            }
        }
        // Another shape still goes to the guard.
        assert_eq!(route_for(&rs, Some(&g), "/items/7/x").unwrap().name, "unlisted");
    }

    /// The detector, on the untyped template: each variant is a write on another
    /// resource and key than item 7's.
    #[test]
    fn an_untyped_id_classifies_other_spellings_as_other_resources() {
        let rs = [route("/items/{id}", &["GET"], "items/{id}", "orders/items/{id}")];
        let h = HeaderMap::new();
        let other = ITEM_7_VARIANTS
            .iter()
            .filter(|p| {
                matches!(classify(&rs, None, "PUT", p, &h), Ok((_, Class::Write { resource, .. })) if resource != "items/7")
            })
            .count();
        assert_eq!(other, ITEM_7_VARIANTS.len());
    }
}
