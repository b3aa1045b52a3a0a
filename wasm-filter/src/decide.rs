//! Pure request decisions, tested on the host. [`crate::http`] gathers host state,
//! calls [`on_request_headers`] and applies the [`Decision`]; queueing and local
//! limits come after it, in [`crate::worker`].
//!
//! The checks run in this order, and the first that fails answers:
//! 1. `401 unauthenticated`: no verified SPIFFE ID (an unauthenticated caller learns
//!    nothing about its request);
//! 2. the `:path`, query included, must be canonical (`lockmesh_core::canon::check`;
//!    docs/TRANSPARENT.md defines it): in a configuration with transparent routes
//!    (a sidecar, whose paths are the application's) anything else is answered
//!    `400 bad_request` with the canon's message, before any route is matched, so
//!    `/public/../orders/1` can never match `/public`; in a lock-tier configuration
//!    (API routes only) it is an unknown route, `404 not_found` as in step 3: the
//!    API's paths are a fixed table of canonical spellings;
//! 3. `400 bad_request`: on a transparent `path` route with a typed variable, a path
//!    of its shape whose value does not fit the type (`/orders/07` against
//!    `/orders/{id:uint}`; `lockmesh_core::template::select`), naming the variable,
//!    never the value: no other route (a prefix where the caller chooses the key)
//!    may take it; then `404 not_found`: a route the filter cannot classify, so
//!    cannot authorise;
//! 4. `400 bad_request`: a malformed, duplicated or (for the route) missing lock
//!    header, a lock header also sent spelt with `_` (`x_lock_key`: a server that
//!    reads `_` as `-` would see a value the filter never checked), a path or
//!    method override header in any spelling (`headers::override_header`:
//!    `X-Original-URL`, `x_http_method_override`; see below), a wait above
//!    `max_wait_ms`, or on a transparent route with a `key` template a request the
//!    template cannot derive a valid key from, or whose own `x-lock-key` differs
//!    from the derived one;
//! 5. `403 denied` (ADR-19): no grant lets the identity do the route's operation to
//!    the key (routes without a key: the identity holds the operation nowhere). The
//!    answer depends on the configuration and the request only, never on the key's
//!    state, so it is the same bytes whether or not the key exists or is held.
//!
//! Override headers are refused, not removed: the shipped connection managers
//! remove the exact names before any filter runs and refuse `_` in a name, so one
//! that reaches the filter was sent in a spelling no ordinary client uses, or the
//! filter runs without those settings (a mesh's own HCM). Removing it would leave
//! the request's meaning to whichever spellings the filter knew; refusing it answers
//! a clear `400` and forwards nothing, as fence-proxy does for the same names.
//!
//! A passed request loses every header only lockmesh may set, compared by the name
//! a server will read (`headers::fold`: lower-case, `_` as `-`): `x-lockmesh-*`, the
//! forgeable identity headers, the token's epoch and revision; on a transparent
//! route also `headers::UPSTREAM_RESERVED` (token, session, instance, proof, grant).

use lockmesh_core::{canon, code::error_body, headers, route::ApiRoute, template::HeaderLookup, Code, LockKey};

use crate::{
    config::{Config, KeySource, TransparentRoute},
    route::Route,
};

/// Longest SPIFFE ID accepted (the SPIFFE spec's URI limit).
pub(crate) const MAX_SPIFFE_ID_LEN: usize = 2048;
/// The message of every denial: it names nothing, so it reveals nothing.
pub(crate) const DENIED_MESSAGE: &str = "not permitted";

/// What to do with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Answer locally; nothing reaches the arbiter.
    Reject {
        /// HTTP status.
        status: u32,
        /// Stable code.
        code: Code,
        /// JSON body.
        body: String,
    },
    /// The request may go on (an acquire through its key's queue).
    Pass(Pass),
}

/// A request that passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pass {
    pub route: Route,
    /// The key: on a bound transparent route the one derived from the request,
    /// else `x-lock-key` if sent.
    pub key: Option<LockKey>,
    /// `x-lock-wait-ms`; 0 when absent (try once).
    pub wait_ms: u64,
    /// Header names to remove (client-supplied internal or identity headers).
    pub remove: Vec<String>,
    /// Headers to set before it goes on ([`crate::worker`] adds the budget): the
    /// filter's mark and, on a bound route, `x-lock-key` as derived, so ext_proc's
    /// ring hash, the arbiter and the upstream all read it. None for an unlocked
    /// request: its mark is filter state ([`crate::abi::set_unlocked_mark`]).
    pub set: Vec<(&'static str, String)>,
    /// A transparent route's request without `x-lock-key`, allowed through unlocked.
    pub unlocked: bool,
}

impl Decision {
    /// A local refusal with `code`'s status and the standard body.
    pub fn reject(code: Code, message: &str) -> Self {
        Decision::Reject { status: u32::from(code.http_status()), code, body: error_body(code, message, None) }
    }

    /// The one denial answer.
    pub fn denied() -> Self {
        Self::reject(Code::Denied, DENIED_MESSAGE)
    }
}

/// Checks a SPIFFE ID's shape: `spiffe://trust-domain/path`, printable ASCII.
pub(crate) fn valid_spiffe_id(id: &[u8]) -> bool {
    let Some(rest) = id.strip_prefix(b"spiffe://") else {
        return false;
    };
    let td_len = rest.iter().position(|b| *b == b'/').unwrap_or(rest.len());
    id.len() <= MAX_SPIFFE_ID_LEN
        && td_len > 0
        && rest
            .get(..td_len)
            .is_some_and(|td| td.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(b)))
        && rest.iter().all(|b| b.is_ascii_graphic())
}

fn header<'a>(hdrs: &'a [(String, Vec<u8>)], name: &str) -> &'a [u8] {
    hdrs.iter().find(|(n, _)| n == name).map_or(&[], |(_, v)| v.as_slice())
}

/// Every value of header `name` for a key template, under any name that folds to it
/// (`headers::fold`): `x_tenant` beside `x-tenant` is two values, so the fill fails
/// rather than picking the one the upstream might not read.
fn header_values(hdrs: &[(String, Vec<u8>)], name: &str) -> HeaderLookup {
    HeaderLookup::from_values(hdrs.iter().filter(|(n, _)| headers::fold(n) == name).map(|(_, v)| v.as_slice()))
}

/// Decides a request from its headers (names lowercase, raw value bytes, pseudo
/// headers included) and the mTLS peer's URI SAN, if any.
pub(crate) fn on_request_headers(cfg: &Config, hdrs: &[(String, Vec<u8>)], peer_uri_san: Option<&[u8]>) -> Decision {
    // There is no insecure mode: without a verified SPIFFE ID nothing passes.
    let identity = match peer_uri_san.filter(|p| valid_spiffe_id(p)).and_then(|p| std::str::from_utf8(p).ok()) {
        Some(id) => id,
        None => return Decision::reject(Code::Unauthenticated, "a verified SPIFFE client certificate is required"),
    };
    // Routes are matched on the canonical path only (step 2 of the module doc).
    let path = match canon::check(header(hdrs, ":path")) {
        Ok(c) => c.path(),
        Err(e) if cfg.transparent.is_some() => return Decision::reject(Code::BadRequest, &format!(":path: {e}")),
        Err(_) => return Decision::reject(Code::NotFound, "no such route"),
    };
    let api_route = if cfg.api { Route::of(header(hdrs, ":method"), path.as_bytes()) } else { None };
    // A typed path variable's value that does not fit (`/orders/07` against
    // `/orders/{id:uint}`) is refused here, before any other route could take it.
    let matched = match api_route {
        Some(_) => None,
        None => match cfg.transparent_route(path) {
            Ok(m) => m,
            Err(e) => return Decision::reject(Code::BadRequest, &format!(":path: {e}; the request was not forwarded")),
        },
    };
    let transparent = matched.as_ref().map(|(t, _)| *t);
    let route = match (api_route, transparent) {
        (Some(r), _) => r,
        (None, Some(_)) => Route::Transparent,
        (None, None) => return Decision::reject(Code::NotFound, "no such route"),
    };
    // An application that obeys a path or method override serves another request
    // than the one the lock is for (module doc): refused in every spelling.
    if let Some((sent, h)) = hdrs.iter().find_map(|(n, _)| headers::override_header(n).map(|h| (n, h))) {
        let msg = format!(
            "{sent:?}: a path or method override header (read as {h}) is not accepted: an application may \
             serve another path or method than the one locked; the request was not forwarded"
        );
        return Decision::reject(Code::BadRequest, &msg);
    }
    let mut lock = match headers::parse_lock_headers(hdrs.iter().map(|(n, v)| (n.as_str(), v.as_slice()))) {
        Ok(h) => h,
        Err(e) => return Decision::reject(Code::BadRequest, &e.to_string()),
    };
    // A bound route's key is the one its template derives from the request; the
    // caller may send it too, but not another.
    let mut set = Vec::new();
    if let Some((TransparentRoute { key: KeySource::Bound(template), .. }, vars)) = &matched {
        let derived = match template.fill_key(vars, &|name| header_values(hdrs, name)) {
            Ok(k) => k,
            Err(e) => {
                let msg = format!("{}: this route derives its key from the request, and {e}", headers::KEY);
                return Decision::reject(Code::BadRequest, &msg);
            }
        };
        if lock.key.as_ref().is_some_and(|sent| *sent != derived) {
            let msg = format!(
                "{}: this route derives its key from the request; the one sent differs (send none, or the same)",
                headers::KEY
            );
            return Decision::reject(Code::BadRequest, &msg);
        }
        set.push((headers::KEY, derived.as_str().to_owned()));
        lock.key = Some(derived);
    }
    if let Some(w) = lock.wait_ms {
        if w > cfg.max_wait_ms {
            let msg = format!("{}: {w} ms is above the maximum {} ms", headers::WAIT_MS, cfg.max_wait_ms);
            return Decision::reject(Code::BadRequest, &msg);
        }
    }
    if route.needs_key() && lock.key.is_none() {
        return Decision::reject(Code::BadRequest, &format!("{}: required", headers::KEY));
    }
    // Several keys only on the multi-key route, and there instead of one.
    match (route.needs_keys(), &lock.keys, &lock.key) {
        (true, None, _) => return Decision::reject(Code::BadRequest, &format!("{}: required", headers::KEYS)),
        (true, Some(_), Some(_)) => {
            let msg = format!("{}: a multi-key acquire names its keys in {} only", headers::KEY, headers::KEYS);
            return Decision::reject(Code::BadRequest, &msg);
        }
        (false, Some(_), _) => {
            let msg = format!("{}: only on POST /v1/locks/acquire-all", headers::KEYS);
            return Decision::reject(Code::BadRequest, &msg);
        }
        _ => {}
    }
    let unlocked = match (transparent, &lock.key) {
        (Some(t), None) if t.allow_unlocked => true,
        (Some(_), None) => {
            let msg = format!("{}: required on this route; the request was not forwarded", headers::KEY);
            return Decision::reject(Code::LockRequired, &msg);
        }
        _ => false,
    };
    // A transparent request waits by default (its route's default wait).
    let wait_ms = lock.wait_ms.or(transparent.map(|t| t.default_wait_ms)).unwrap_or(0);
    let op = route.operation();
    let allowed = match (&lock.key, &lock.keys) {
        // Every key: one denied denies the request, with the one answer.
        (None, Some(keys)) => keys.iter().all(|key| cfg.grants.allowed(identity, key, op)),
        (Some(key), _) => cfg.grants.allowed(identity, key, op),
        // An unlocked request on a transparent route needs no lock grant.
        (None, None) if unlocked => true,
        (None, None) => cfg.grants.holds_any(identity, op),
    };
    if !allowed {
        return Decision::denied();
    }
    // Compared by folded name (`headers::fold`): a server that reads `_` as `-`
    // would take `x_lockmesh_vm` for `x-lockmesh-vm`. Each is removed by the name it
    // was sent with. The lock headers this filter reads cannot get here in another
    // spelling: `parse_lock_headers` refused their twins above.
    let transparent_route = route == Route::Transparent;
    let mut remove: Vec<String> = hdrs
        .iter()
        .map(|(n, _)| n)
        .filter(|n| {
            headers::never_from_client(n)
                // The upstream must never see a lock header it could mistake for a grant.
                || (transparent_route && headers::upstream_reserved(n))
        })
        .cloned()
        .collect();
    remove.sort_unstable();
    remove.dedup();
    // An unlocked request skips ext_proc and needs only the unlocked mark, which is
    // filter state, not a header (set by `crate::http`: no client can send it, no
    // upstream sees it, and a header write would cost the request a route
    // re-resolution); everything else carries the filter's stamp, which the arbiter
    // requires.
    if !unlocked {
        set.push((headers::FILTERED, headers::FILTER_PROTOCOL.to_owned()));
    }
    // A session opened without a key: the namespaces the caller may acquire in,
    // so the arbiter charges the session to its class's namespace only there.
    if route == Route::Api(ApiRoute::SessionOpen) && lock.key.is_none() {
        set.push((headers::GRANTED_NS, cfg.grants.namespaces(identity, op).join(",")));
    }
    Decision::Pass(Pass { route, key: lock.key, wait_ms, remove, set, unlocked })
}

#[cfg(test)]
mod tests;
