//! The lock API's routes, as the filter classifies them for authorisation
//! (`docs/API.md`). The table matches the arbiter's exactly: method and path without
//! the query, byte for byte, no normalisation beyond what Envoy's connection manager
//! already did (the arbiter sees the same `:path`). [`crate::decide`] classifies only
//! a canonical `:path` (`lockmesh_core::canon`), so no other spelling of an API path
//! (`/v1/admin/../locks/acquire`) ever reaches this table. An unknown route is answered
//! `404 not_found` by the filter: a route it cannot classify is a route it cannot
//! authorise.

use lockmesh_core::grant::Operation;

/// A lock API route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/locks/acquire`: the only route that queues.
    Acquire,
    /// `POST /v1/locks/release`.
    Release,
    /// `POST /v1/locks/acquire-all`: several keys (`x-lock-keys`) in one grant. It
    /// waits at the arbiter, never in a key's queue: one queue cannot order it.
    AcquireAll,
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
    /// `POST /v1/elections/campaign`: an acquire of an election's key; queues.
    Campaign,
    /// `POST /v1/elections/proclaim`.
    Proclaim,
    /// `POST /v1/elections/resign`.
    Resign,
    /// `GET /v1/elections`: an observer's long poll (it waits at the arbiter,
    /// never in a key's queue).
    Observe,
    /// Any method under `/v1/admin/`.
    Admin,
    /// A transparent-mode route (`docs/TRANSPARENT.md`): the request itself holds
    /// its `x-lock-key` for its life; queues like an acquire.
    Transparent,
}

/// Prefix of the operator routes.
pub(crate) const ADMIN_PREFIX: &[u8] = b"/v1/admin/";

// === impl Route ===

impl Route {
    /// Classifies `:method` and `:path` (the query is ignored).
    pub fn of(method: &[u8], path: &[u8]) -> Option<Route> {
        let path = path.split(|b| *b == b'?').next().unwrap_or_default();
        if path.starts_with(ADMIN_PREFIX) {
            return Some(Route::Admin);
        }
        Some(match (method, path) {
            (b"POST", b"/v1/locks/acquire") => Route::Acquire,
            (b"POST", b"/v1/locks/release") => Route::Release,
            (b"POST", b"/v1/locks/acquire-all") => Route::AcquireAll,
            (b"GET", b"/v1/locks") => Route::Inspect,
            (b"POST", b"/v1/sessions") => Route::SessionOpen,
            (b"POST", b"/v1/sessions/keepalive") => Route::SessionKeepalive,
            (b"POST", b"/v1/sessions/close") => Route::SessionClose,
            (b"GET", b"/v1/sessions/holds") => Route::SessionHolds,
            (b"POST", b"/v1/tokens/validate") => Route::Validate,
            (b"POST", b"/v1/elections/campaign") => Route::Campaign,
            (b"POST", b"/v1/elections/proclaim") => Route::Proclaim,
            (b"POST", b"/v1/elections/resign") => Route::Resign,
            (b"GET", b"/v1/elections") => Route::Observe,
            _ => return None,
        })
    }

    /// The operation a grant must allow.
    pub fn operation(self) -> Operation {
        match self {
            Route::Acquire
            | Route::AcquireAll
            | Route::Release
            | Route::SessionOpen
            | Route::SessionKeepalive
            | Route::SessionClose
            | Route::SessionHolds
            | Route::Campaign
            | Route::Proclaim
            | Route::Resign
            | Route::Transparent => Operation::Acquire,
            Route::Inspect | Route::Observe => Operation::Inspect,
            Route::Validate => Operation::Validate,
            Route::Admin => Operation::Admin,
        }
    }

    /// Routes that hold a key and so go through its queue.
    pub fn queues(self) -> bool {
        matches!(self, Route::Acquire | Route::Campaign | Route::Transparent)
    }

    /// Routes that cannot be answered without `x-lock-keys` (and take no `x-lock-key`).
    pub(crate) fn needs_keys(self) -> bool {
        matches!(self, Route::AcquireAll)
    }

    /// Routes that cannot be answered without `x-lock-key`.
    pub(crate) fn needs_key(self) -> bool {
        matches!(
            self,
            Route::Acquire
                | Route::Release
                | Route::Inspect
                | Route::Campaign
                | Route::Proclaim
                | Route::Resign
                | Route::Observe
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_the_api_and_nothing_else() {
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire"), Some(Route::Acquire));
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire?x=1"), Some(Route::Acquire));
        assert_eq!(Route::of(b"GET", b"/v1/locks/acquire"), None);
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire/"), None);
        assert_eq!(Route::of(b"POST", b"//v1/locks/acquire"), None);
        assert_eq!(Route::of(b"GET", b"/v1/locks"), Some(Route::Inspect));
        assert_eq!(Route::of(b"DELETE", b"/v1/admin/x"), Some(Route::Admin));
        assert_eq!(Route::of(b"GET", b"/v1/admin"), None);
        assert_eq!(Route::SessionHolds.operation(), Operation::Acquire);
        assert_eq!(Route::Validate.operation(), Operation::Validate);
        assert!(Route::Release.needs_key() && !Route::SessionOpen.needs_key());
        assert_eq!(Route::of(b"POST", b"/v1/elections/campaign"), Some(Route::Campaign));
        assert_eq!(Route::of(b"GET", b"/v1/elections?x=1"), Some(Route::Observe));
        assert_eq!(Route::of(b"POST", b"/v1/elections"), None);
        assert!(Route::Campaign.queues() && !Route::Observe.queues() && !Route::Proclaim.queues());
        assert_eq!(Route::Observe.operation(), Operation::Inspect);
        assert_eq!(Route::Resign.operation(), Operation::Acquire);
        assert_eq!(Route::of(b"POST", b"/v1/locks/acquire-all"), Some(Route::AcquireAll));
        assert!(!Route::AcquireAll.queues() && !Route::AcquireAll.needs_key() && Route::AcquireAll.needs_keys());
    }
}
