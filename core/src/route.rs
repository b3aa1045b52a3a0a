//! The lock API's routes (`docs/API.md`): the one table the Wasm filter classifies
//! requests by for authorisation and the arbiter dispatches, checks grants and
//! labels metrics by.
//!
//! A route is a method and a path, matched byte for byte: no case folding, no
//! trailing-slash or `//` leniency, no other normalisation. The path is matched
//! without its query, and removing the query is the caller's job: [`ApiRoute::of`]
//! takes a path with a `?` in it for no route at all. The filter classifies only a
//! canonical `:path` (`crate::canon`), and the arbiter sees the same `:path` Envoy
//! forwarded, so both read the same route from the same request.
//!
//! The operator routes are not in the table: the filter classifies any method
//! under [`ADMIN_PREFIX`] as an admin request, and no API route lies under it.

use crate::grant::Operation;

/// Prefix of the paths the filter classifies as operator routes, whatever their
/// method. No lock API route answers them; the arbiter's admin actions live under
/// `/internal/v1/admin/`.
pub const ADMIN_PREFIX: &str = "/v1/admin/";

/// A lock API route (`docs/API.md`). [`API_ROUTES`] gives each its method and path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApiRoute {
    /// `POST /v1/locks/acquire`.
    Acquire,
    /// `POST /v1/locks/acquire-all`: every key of `x-lock-keys` in one grant, or
    /// none. It waits at the arbiter, never in a key's queue: one queue cannot
    /// order it.
    AcquireAll,
    /// `POST /v1/locks/release`.
    Release,
    /// `GET /v1/locks`.
    Inspect,
    /// `POST /v1/sessions`.
    SessionOpen,
    /// `POST /v1/sessions/keepalive`.
    SessionKeepalive,
    /// `POST /v1/sessions/close`.
    SessionClose,
    /// `GET /v1/sessions/holds`.
    SessionHolds,
    /// `POST /v1/tokens/validate`.
    Validate,
    /// `POST /v1/elections/campaign`: an acquire of an election's key; it queues
    /// like one.
    Campaign,
    /// `POST /v1/elections/proclaim`.
    Proclaim,
    /// `POST /v1/elections/resign`: the release of a leadership.
    Resign,
    /// `GET /v1/elections`: the leadership, now or after a resume point. An
    /// observer's long poll: it waits at the arbiter, never in a key's queue.
    Observe,
}

/// Every API route: method, path (without the query, matched byte for byte) and
/// route.
pub const API_ROUTES: [(&str, &str, ApiRoute); 13] = [
    ("POST", "/v1/locks/acquire", ApiRoute::Acquire),
    ("POST", "/v1/locks/acquire-all", ApiRoute::AcquireAll),
    ("POST", "/v1/locks/release", ApiRoute::Release),
    ("GET", "/v1/locks", ApiRoute::Inspect),
    ("POST", "/v1/sessions", ApiRoute::SessionOpen),
    ("POST", "/v1/sessions/keepalive", ApiRoute::SessionKeepalive),
    ("POST", "/v1/sessions/close", ApiRoute::SessionClose),
    ("GET", "/v1/sessions/holds", ApiRoute::SessionHolds),
    ("POST", "/v1/tokens/validate", ApiRoute::Validate),
    ("POST", "/v1/elections/campaign", ApiRoute::Campaign),
    ("POST", "/v1/elections/proclaim", ApiRoute::Proclaim),
    ("POST", "/v1/elections/resign", ApiRoute::Resign),
    ("GET", "/v1/elections", ApiRoute::Observe),
];

// === impl ApiRoute ===

impl ApiRoute {
    /// The route of `method` and `path_without_query`, if it is one. Both are
    /// compared byte for byte with [`API_ROUTES`]; the caller removes the query
    /// first (a `?` left in the path matches no route).
    pub fn of(method: &[u8], path_without_query: &[u8]) -> Option<ApiRoute> {
        API_ROUTES
            .iter()
            .find(|(m, p, _)| m.as_bytes() == method && p.as_bytes() == path_without_query)
            .map(|(_, _, r)| *r)
    }

    /// Its method, as in [`API_ROUTES`].
    pub const fn method(self) -> &'static str {
        self.row().0
    }

    /// Its path, as in [`API_ROUTES`].
    pub const fn path(self) -> &'static str {
        self.row().1
    }

    /// Its row of [`API_ROUTES`]. The table is taken apart whole, so a route
    /// added without a row (or a row without a route) does not compile, and
    /// nothing here can index out of bounds; a test holds each binding to the
    /// row that names its route.
    const fn row(self) -> (&'static str, &'static str, ApiRoute) {
        let [acquire, acquire_all, release, inspect, session_open, session_keepalive, rest @ ..] = API_ROUTES;
        let [session_close, session_holds, validate, campaign, proclaim, resign, observe] = rest;
        match self {
            ApiRoute::Acquire => acquire,
            ApiRoute::AcquireAll => acquire_all,
            ApiRoute::Release => release,
            ApiRoute::Inspect => inspect,
            ApiRoute::SessionOpen => session_open,
            ApiRoute::SessionKeepalive => session_keepalive,
            ApiRoute::SessionClose => session_close,
            ApiRoute::SessionHolds => session_holds,
            ApiRoute::Validate => validate,
            ApiRoute::Campaign => campaign,
            ApiRoute::Proclaim => proclaim,
            ApiRoute::Resign => resign,
            ApiRoute::Observe => observe,
        }
    }

    /// The operation a LockGrant must allow for it: acquire, release and the
    /// session and election writes need `acquire`.
    pub fn operation(self) -> Operation {
        match self {
            ApiRoute::Acquire
            | ApiRoute::AcquireAll
            | ApiRoute::Release
            | ApiRoute::SessionOpen
            | ApiRoute::SessionKeepalive
            | ApiRoute::SessionClose
            | ApiRoute::SessionHolds
            | ApiRoute::Campaign
            | ApiRoute::Proclaim
            | ApiRoute::Resign => Operation::Acquire,
            ApiRoute::Inspect | ApiRoute::Observe => Operation::Inspect,
            ApiRoute::Validate => Operation::Validate,
        }
    }

    /// Routes that may wait (`x-lock-wait-ms`): the arbiter stretches Envoy's
    /// ext_proc message timer for them.
    pub fn waits(self) -> bool {
        matches!(self, ApiRoute::Acquire | ApiRoute::AcquireAll | ApiRoute::Campaign | ApiRoute::Observe)
    }

    /// The `route` label of `lockmesh_arbiter_requests_total`.
    pub fn label(self) -> &'static str {
        match self {
            ApiRoute::Acquire => "acquire",
            ApiRoute::AcquireAll => "acquire_all",
            ApiRoute::Release => "release",
            ApiRoute::Inspect => "inspect",
            ApiRoute::SessionOpen => "session_open",
            ApiRoute::SessionKeepalive => "keepalive",
            ApiRoute::SessionClose => "session_close",
            ApiRoute::SessionHolds => "session_holds",
            ApiRoute::Validate => "validate",
            ApiRoute::Campaign => "campaign",
            ApiRoute::Proclaim => "proclaim",
            ApiRoute::Resign => "resign",
            ApiRoute::Observe => "observe",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn every_row_is_found_by_its_method_and_path() {
        for (m, p, r) in API_ROUTES {
            assert_eq!(ApiRoute::of(m.as_bytes(), p.as_bytes()), Some(r), "{m} {p}");
            assert_eq!((r.method(), r.path(), r.row().2), (m, p, r), "{r:?}'s row");
        }
    }

    #[test]
    fn no_two_rows_share_a_route_a_method_and_path_or_a_label() {
        let mut routes = HashSet::new();
        let mut pairs = HashSet::new();
        let mut labels = HashSet::new();
        for (m, p, r) in API_ROUTES {
            assert!(routes.insert(r), "{r:?} has two rows");
            assert!(pairs.insert((m, p)), "two rows for {m} {p}");
            assert!(labels.insert(r.label()), "two routes share the label {}", r.label());
        }
    }

    #[test]
    fn nothing_but_the_exact_method_and_path_is_a_route() {
        for (m, p, _) in API_ROUTES {
            let lower = m.to_ascii_lowercase();
            let upper_path = p.to_ascii_uppercase();
            let misses = [
                (m.to_owned(), format!("{p}/")),
                (m.to_owned(), format!("/{p}")),
                (m.to_owned(), format!("{p}?")),
                (m.to_owned(), format!("{p}?x=1")),
                (m.to_owned(), format!("{p}#")),
                (m.to_owned(), format!(" {p}")),
                (m.to_owned(), upper_path),
                (m.to_owned(), p[..p.len() - 1].to_owned()),
                (lower, p.to_owned()),
                (format!("{m} "), p.to_owned()),
                (if m == "GET" { "HEAD" } else { "PUT" }.to_owned(), p.to_owned()),
            ];
            for (method, path) in misses {
                assert_eq!(ApiRoute::of(method.as_bytes(), path.as_bytes()), None, "{method:?} {path:?}");
            }
        }
        assert_eq!(ApiRoute::of(b"POST", b"/v1/validate"), None);
        assert_eq!(ApiRoute::of(b"POST", b"/v1/elections"), None);
        assert_eq!(ApiRoute::of(b"", b""), None);
    }

    #[test]
    fn no_route_lies_under_the_admin_prefix() {
        assert!(ADMIN_PREFIX.starts_with('/') && ADMIN_PREFIX.ends_with('/'));
        for (m, p, _) in API_ROUTES {
            assert!(!p.starts_with(ADMIN_PREFIX), "{m} {p}");
            assert!(!p.contains('?'), "{m} {p}: a path in the table has no query");
        }
    }

    #[test]
    fn operations_and_waits() {
        assert_eq!(ApiRoute::SessionHolds.operation(), Operation::Acquire);
        assert_eq!(ApiRoute::Resign.operation(), Operation::Acquire);
        assert_eq!(ApiRoute::Inspect.operation(), Operation::Inspect);
        assert_eq!(ApiRoute::Observe.operation(), Operation::Inspect);
        assert_eq!(ApiRoute::Validate.operation(), Operation::Validate);
        let waiting: Vec<ApiRoute> = API_ROUTES.iter().map(|r| r.2).filter(|r| r.waits()).collect();
        assert_eq!(waiting, [ApiRoute::Acquire, ApiRoute::AcquireAll, ApiRoute::Campaign, ApiRoute::Observe]);
    }

    /// The routes docs/API.md documents with a heading of their own
    /// (`### \`M /p\``) are rows of the table.
    #[test]
    fn every_documented_route_is_a_row() {
        let documented: Vec<(&str, &str)> = include_str!("../../docs/API.md")
            .lines()
            .filter_map(|l| {
                let (method, path) = l.strip_prefix("### `")?.strip_suffix('`')?.split_once(' ')?;
                path.starts_with("/v1/").then_some((method, path))
            })
            .collect();
        assert!(documented.len() >= 7, "docs/API.md's route headings as parsed: {documented:?}");
        for (m, p) in documented {
            assert!(ApiRoute::of(m.as_bytes(), p.as_bytes()).is_some(), "docs/API.md documents {m} {p}; no row has it");
        }
    }
}
