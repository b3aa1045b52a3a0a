//! The lock API's routes, as the filter classifies them for authorisation
//! (`docs/API.md`). The API routes are core's table (`lockmesh_core::route`), the
//! one the arbiter dispatches by: method and path without the query, byte for byte,
//! no normalisation beyond what Envoy's connection manager already did (the arbiter
//! sees the same `:path`). [`crate::decide`] classifies only a canonical `:path`
//! (`lockmesh_core::canon`), so no other spelling of an API path
//! (`/v1/admin/../locks/acquire`) ever reaches the table. An unknown route is
//! answered `404 not_found` by the filter: a route it cannot classify is a route it
//! cannot authorise.

use lockmesh_core::{
    grant::Operation,
    route::{ApiRoute, ADMIN_PREFIX},
};

/// A route the filter authorises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// A lock API route. Of these, only an acquire and a campaign queue.
    Api(ApiRoute),
    /// Any method under `/v1/admin/` ([`ADMIN_PREFIX`]).
    Admin,
    /// A transparent-mode route (`docs/TRANSPARENT.md`): the request itself holds
    /// its `x-lock-key` for its life; queues like an acquire.
    Transparent,
}

// === impl Route ===

impl Route {
    /// Classifies `:method` and `:path`: the query is ignored, the admin prefix is
    /// tested first, then core's table.
    pub fn of(method: &[u8], path: &[u8]) -> Option<Route> {
        let path = path.split(|b| *b == b'?').next().unwrap_or_default();
        if path.starts_with(ADMIN_PREFIX.as_bytes()) {
            return Some(Route::Admin);
        }
        ApiRoute::of(method, path).map(Route::Api)
    }

    /// The operation a grant must allow.
    pub fn operation(self) -> Operation {
        match self {
            Route::Api(r) => r.operation(),
            Route::Admin => Operation::Admin,
            Route::Transparent => Operation::Acquire,
        }
    }

    /// Routes that hold a key and so go through its queue.
    pub fn queues(self) -> bool {
        matches!(self, Route::Api(ApiRoute::Acquire | ApiRoute::Campaign) | Route::Transparent)
    }

    /// Routes that cannot be answered without `x-lock-keys` (and take no `x-lock-key`).
    pub(crate) fn needs_keys(self) -> bool {
        matches!(self, Route::Api(ApiRoute::AcquireAll))
    }

    /// Routes that cannot be answered without `x-lock-key`.
    pub(crate) fn needs_key(self) -> bool {
        matches!(
            self,
            Route::Api(
                ApiRoute::Acquire
                    | ApiRoute::Release
                    | ApiRoute::Inspect
                    | ApiRoute::Campaign
                    | ApiRoute::Proclaim
                    | ApiRoute::Resign
                    | ApiRoute::Observe
            )
        )
    }
}

#[cfg(test)]
mod tests {
    use lockmesh_core::route::API_ROUTES;

    use super::*;

    #[test]
    fn classifies_the_api_and_nothing_else() {
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire"), Some(Route::Api(ApiRoute::Acquire)));
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire?x=1"), Some(Route::Api(ApiRoute::Acquire)));
        assert_eq!(Route::of(b"GET", b"/v1/locks/acquire"), None);
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire/"), None);
        assert_eq!(Route::of(b"POST", b"//v1/locks/acquire"), None);
        assert_eq!(Route::of(b"GET", b"/v1/locks"), Some(Route::Api(ApiRoute::Inspect)));
        assert_eq!(Route::of(b"DELETE", b"/v1/admin/x"), Some(Route::Admin));
        assert_eq!(Route::of(b"GET", b"/v1/admin/?x=1"), Some(Route::Admin));
        assert_eq!(Route::of(b"GET", b"/v1/admin"), None);
        assert_eq!(Route::of(b"GET", b"/v1/admin?/"), None);
        assert_eq!(Route::Api(ApiRoute::SessionHolds).operation(), Operation::Acquire);
        assert_eq!(Route::Api(ApiRoute::Validate).operation(), Operation::Validate);
        assert_eq!(Route::Admin.operation(), Operation::Admin);
        assert_eq!(Route::Transparent.operation(), Operation::Acquire);
        assert!(Route::Api(ApiRoute::Release).needs_key() && !Route::Api(ApiRoute::SessionOpen).needs_key());
        assert_eq!(Route::of(b"POST", b"/v1/elections/campaign"), Some(Route::Api(ApiRoute::Campaign)));
        assert_eq!(Route::of(b"GET", b"/v1/elections?x=1"), Some(Route::Api(ApiRoute::Observe)));
        assert_eq!(Route::of(b"POST", b"/v1/elections"), None);
        assert!(Route::Api(ApiRoute::Campaign).queues());
        assert!(!Route::Api(ApiRoute::Observe).queues() && !Route::Api(ApiRoute::Proclaim).queues());
        assert!(Route::Transparent.queues() && !Route::Admin.queues());
        assert_eq!(Route::Api(ApiRoute::Observe).operation(), Operation::Inspect);
        assert_eq!(Route::Api(ApiRoute::Resign).operation(), Operation::Acquire);
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire-all"), Some(Route::Api(ApiRoute::AcquireAll)));
        let all = Route::Api(ApiRoute::AcquireAll);
        assert!(!all.queues() && !all.needs_key() && all.needs_keys());
    }

    /// Every row of the table the arbiter dispatches by is the API route the
    /// filter classifies its method and path as, with a query or without.
    #[test]
    fn every_row_of_the_arbiters_table_is_classified_as_itself() {
        for (m, p, r) in API_ROUTES {
            assert_eq!(Route::of(m.as_bytes(), p.as_bytes()), Some(Route::Api(r)), "{m} {p}");
            assert_eq!(Route::of(m.as_bytes(), format!("{p}?a=b").as_bytes()), Some(Route::Api(r)), "{m} {p}?a=b");
            assert_eq!(Route::of(m.as_bytes(), format!("{p}?").as_bytes()), Some(Route::Api(r)), "{m} {p}?");
            assert_eq!(Route::of(m.as_bytes(), format!("{p}/").as_bytes()), None, "{m} {p}/");
        }
    }
}
