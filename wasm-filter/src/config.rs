//! Plugin configuration: a JSON object in `PluginConfig.configuration`
//! (a `google.protobuf.StringValue`). Parsing is pure so a host-side test can run it
//! over every configuration embedded in `envoy-config/*.yaml`.
//!
//! ```json
//! {"max_wait_ms": 30000, "max_queue_per_key": 1000,
//!  "namespaces": ["payments", "billing"],
//!  "grants": [{"identity": "spiffe://lockmesh.local/ns/payments/",
//!              "prefixes": ["payments"], "operations": ["acquire", "inspect"]}],
//!  "local_limits": [{"prefix": "payments/reports", "max_in_flight": 20, "approximate": true}],
//!  "api": false,
//!  "transparent": {"arbiter_cluster": "lockmesh_arbiter",
//!                  "routes": [{"path": "/orders/{id}", "key": "payments/order-{id}"},
//!                             {"path_prefix": "/public", "allow_unlocked": true, "caller_chooses_key": true}]}}
//! ```
//!
//! Every transparent route says where its key comes from: a `key` template, or
//! `caller_chooses_key: true` (which [`Config::warnings`] reports); neither is an error.

use lockmesh_core::{
    canon,
    grant::{valid_key_prefix, GrantSet, RawGrant},
    headers,
    key::{covers, valid_namespace},
    template::{self, HeaderLookup, Mistyped, PathTemplate, Selected, TextTemplate, Vars},
    LockKey,
};
use serde::Deserialize;
use serde_json::Value;

/// Upper bound of `max_wait_ms`: an hour, Envoy's own ext_proc timeout ceiling.
pub const MAX_WAIT_CEILING_MS: u64 = 3_600_000;
/// Default of `max_queue_per_key`.
pub(crate) const DEFAULT_MAX_QUEUE_PER_KEY: usize = 1000;
/// Upper bound of `max_queue_per_key` and of `local_limits[].max_in_flight`.
pub(crate) const MAX_QUEUE_CEILING: u64 = 100_000;
/// Most `namespaces` (each is a metric label value).
pub(crate) const MAX_NAMESPACES: usize = 256;
/// The metric label of a namespace not in `namespaces`, or of a request without a key.
pub(crate) const OTHER_NAMESPACE: &str = "other";

/// The filter's configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Longest `x-lock-wait-ms` accepted, ms; longer asks get `400 bad_request`. Must
    /// stay below the listener's request timeout and the ext_proc `max_message_timeout`.
    /// Default 30000.
    pub max_wait_ms: u64,
    /// Most acquire requests queued for one key on one worker, not counting the one
    /// passed on; one more is answered `429 queue_full`. Default 1000.
    pub max_queue_per_key: usize,
    /// The registry's namespaces: the only values the `ns` metric label takes (others
    /// are counted as `other`). Default none.
    pub namespaces: Vec<String>,
    /// Who may do what to which key prefixes (ADR-19). Default none: every request is
    /// answered `403 denied`.
    pub grants: GrantSet,
    /// Tier-1 approximate in-flight limits per key prefix. Default none.
    pub local_limits: Vec<LocalLimit>,
    /// TEST ONLY, and only in a build with the `test-trap` feature: a request
    /// carrying this header traps the VM, so tests can prove a VM crash fails closed.
    /// The shipped module refuses the field. Default none.
    #[cfg(feature = "test-trap")]
    pub test_trap_header: Option<String>,
    /// Serve the lock API routes (`/v1/...`). Default true; an inbound sidecar in
    /// front of an application sets it false, so its paths are the application's.
    pub api: bool,
    /// Transparent, request-scoped locks (`docs/TRANSPARENT.md`). Default none.
    pub transparent: Option<Transparent>,
    /// What the configuration allows that weakens a guarantee (a route whose caller
    /// chooses its key), each with its field path: logged at `warn` on load.
    pub warnings: Vec<String>,
}

/// Transparent mode: routes whose requests hold a key for their life: the key the
/// route derives from the request, or (`caller_chooses_key`) the caller's `x-lock-key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transparent {
    /// The Envoy cluster of the arbiters (the ext_proc cluster): the filter's root
    /// context calls it to renew its VM's sessions and to release holds.
    pub arbiter_cluster: String,
    /// `:authority` of those calls. Default `lockmesh-arbiter`.
    pub arbiter_authority: String,
    /// Timeout of each call, ms. Default 2000.
    pub callout_timeout_ms: u64,
    /// How often the VM's keepalive also reconciles (releases holds of requests that
    /// ended but whose release was lost), ms. Default 5000.
    pub reconcile_every_ms: u64,
    /// The transparent routes: the first listed `path` route that matches, else the
    /// longest matching `path_prefix`.
    pub routes: Vec<TransparentRoute>,
}

/// One transparent route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransparentRoute {
    /// Which canonical paths the route takes.
    pub matcher: RouteMatch,
    /// Where the request's key comes from.
    pub key: KeySource,
    /// Let requests without `x-lock-key` through unlocked (only with
    /// `caller_chooses_key`). Default false: they are answered `428 lock_required` and
    /// never reach the upstream.
    pub allow_unlocked: bool,
    /// The wait when the request has no `x-lock-wait-ms`, ms. Default 5000.
    pub default_wait_ms: u64,
}

/// How a transparent route matches a request's canonical path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteMatch {
    /// `path_prefix`: a canonical path matched on segment boundaries
    /// (`canon::covers`: `/orders` matches `/orders` and `/orders/1`, not
    /// `/orders-archive`); `/` matches every path.
    Prefix(String),
    /// `path`: a path template (`/orders/{id}`, `lockmesh_core::template`) matching
    /// whole paths of its shape; its variables feed the route's `key`.
    Template(PathTemplate),
}

/// Where a transparent request's lock key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// `key`: a text template over the `path` variables and at most one header,
    /// filled for each request. The filter sets the result as `x-lock-key` and
    /// refuses a caller's `x-lock-key` that differs.
    Bound(TextTemplate),
    /// `caller_chooses_key: true`: the caller's `x-lock-key`, whatever it names. The
    /// lock then guards the key, not the resource the request touches; config load
    /// warns.
    CallerChooses,
}

/// A Tier-1 local limit (seed ADR-033 Tier 1): at most `max_in_flight` acquire
/// requests for keys under `prefix` inside one Envoy at once (queued in the filter or
/// waiting at the arbiter). Exact per Envoy, approximate across the fleet: the
/// fleet-wide bound is `max_in_flight x lock-tier Envoy replicas`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalLimit {
    /// Key prefix (`namespace` or `namespace/path`), matched on `/` boundaries; a key
    /// counts against the longest matching prefix only.
    pub prefix: String,
    /// Most acquire requests in flight in this Envoy.
    pub max_in_flight: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    max_wait_ms: Option<u64>,
    max_queue_per_key: Option<u64>,
    #[serde(default)]
    namespaces: Vec<String>,
    /// Deserialised one by one, so an error names its element.
    #[serde(default)]
    grants: Vec<Value>,
    #[serde(default)]
    local_limits: Vec<Value>,
    /// Known in every build so that the shipped one refuses it by name.
    test_trap_header: Option<String>,
    api: Option<bool>,
    transparent: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTransparent {
    #[serde(default)]
    arbiter_cluster: String,
    arbiter_authority: Option<String>,
    callout_timeout_ms: Option<u64>,
    reconcile_every_ms: Option<u64>,
    #[serde(default)]
    routes: Vec<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTransparentRoute {
    path_prefix: Option<String>,
    path: Option<String>,
    key: Option<String>,
    caller_chooses_key: Option<bool>,
    allow_unlocked: Option<bool>,
    default_wait_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLocalLimit {
    #[serde(default)]
    prefix: String,
    max_in_flight: Option<u64>,
    /// Must be `true`: the operator acknowledges the limit is approximate.
    approximate: Option<bool>,
}

// === impl Config ===

impl Config {
    /// The metric label of `key`'s namespace (`key` is a validated key's text).
    pub(crate) fn ns_label<'a>(&'a self, key: Option<&str>) -> &'a str {
        let ns = key.and_then(|k| k.split('/').next());
        ns.and_then(|ns| self.namespaces.iter().find(|n| n.as_str() == ns)).map_or(OTHER_NAMESPACE, String::as_str)
    }

    /// The transparent route of `path`, a canonical path (`canon::check`'s
    /// [`Canon::path`](lockmesh_core::canon::Canon::path): no query), if any, with the
    /// variables its `path` template matched (none for a prefix route): the first
    /// listed `path` route that matches, else the longest matching `path_prefix`.
    ///
    /// `Err` when no `path` route matches but one has the path's shape with a typed
    /// value that does not fit (`/orders/07` against `/orders/{id:uint}`,
    /// `template::select`): the request is refused, never given to a prefix route,
    /// where its spelling would name another key or let the caller choose one.
    pub(crate) fn transparent_route(&self, path: &str) -> Result<Option<(&TransparentRoute, Vars)>, Mistyped> {
        let Some(t) = self.transparent.as_ref() else {
            return Ok(None);
        };
        let templates = t.routes.iter().filter_map(|r| match &r.matcher {
            RouteMatch::Template(p) => Some((r, p)),
            RouteMatch::Prefix(_) => None,
        });
        match template::select(templates, path) {
            Selected::Matched(r, v) => return Ok(Some((r, v))),
            Selected::Mistyped(m) => return Err(m),
            Selected::NoMatch => {}
        }
        Ok(t.routes
            .iter()
            .filter_map(|r| match &r.matcher {
                RouteMatch::Prefix(p) if canon::covers(p, path) => Some((r, p.len())),
                _ => None,
            })
            .max_by_key(|(_, len)| *len)
            .map(|(r, _)| (r, Vars::new())))
    }

    /// The local limit `key` counts against: the longest covering prefix.
    pub(crate) fn local_limit(&self, key: &LockKey) -> Option<&LocalLimit> {
        self.local_limits.iter().filter(|l| covers(&l.prefix, key.as_str())).max_by_key(|l| l.prefix.len())
    }
}

/// Parses the plugin configuration; every error carries its field path.
pub fn parse(bytes: &[u8]) -> Result<Config, Vec<String>> {
    let raw: RawConfig = if bytes.iter().all(u8::is_ascii_whitespace) {
        RawConfig::default()
    } else {
        serde_json::from_slice(bytes).map_err(|e| vec![format!("configuration: {e}")])?
    };
    let mut errs = Vec::new();
    let max_wait_ms = raw.max_wait_ms.unwrap_or(30_000);
    if max_wait_ms > MAX_WAIT_CEILING_MS {
        errs.push(format!("max_wait_ms: {max_wait_ms} is above the ceiling {MAX_WAIT_CEILING_MS}"));
    }
    let max_queue = raw.max_queue_per_key.unwrap_or(DEFAULT_MAX_QUEUE_PER_KEY as u64);
    if max_queue == 0 || max_queue > MAX_QUEUE_CEILING {
        errs.push(format!("max_queue_per_key: {max_queue} is outside 1 to {MAX_QUEUE_CEILING}"));
    }
    if raw.namespaces.len() > MAX_NAMESPACES {
        errs.push(format!(
            "namespaces: {} entries, above the maximum {MAX_NAMESPACES} (each is a metric label)",
            raw.namespaces.len()
        ));
    }
    for (i, ns) in raw.namespaces.iter().enumerate() {
        if !valid_namespace(ns) {
            errs.push(format!(
                "namespaces[{i}]: {ns:?} must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric"
            ));
        } else if raw.namespaces[..i].contains(ns) {
            errs.push(format!("namespaces[{i}]: {ns:?} is listed twice"));
        }
    }
    let mut raw_grants = Vec::with_capacity(raw.grants.len());
    for (i, v) in raw.grants.into_iter().enumerate() {
        match RawGrant::deserialize(v) {
            Ok(g) => raw_grants.push(g),
            Err(e) => {
                errs.push(format!("grants[{i}]: {e}"));
                // Keep indexes aligned for the validation below.
                raw_grants.push(RawGrant {
                    identity: "spiffe://invalid/".into(),
                    prefixes: vec!["invalid".into()],
                    operations: vec!["inspect".into()],
                });
            }
        }
    }
    let grants = match GrantSet::try_from_raw(&raw_grants) {
        Ok(g) => g,
        Err(e) => {
            errs.extend(e.iter().map(ToString::to_string));
            GrantSet::default()
        }
    };
    let local_limits = local_limits(raw.local_limits, &mut errs);
    #[cfg(feature = "test-trap")]
    if raw.test_trap_header.as_deref().is_some_and(|h| !crate::trap::valid_header(h)) {
        errs.push("test_trap_header: must be a lowercase header name".into());
    }
    // Refused, not ignored: a shipped config naming the trap is a mistake worth a
    // loud failure, and the shipped module has no trap to set.
    #[cfg(not(feature = "test-trap"))]
    if raw.test_trap_header.is_some() {
        errs.push("test_trap_header: only in a test build of the filter".into());
    }
    let mut warnings = Vec::new();
    let transparent = raw.transparent.and_then(|v| transparent(v, max_wait_ms, &mut errs, &mut warnings));
    let api = raw.api.unwrap_or(true);
    if !api && transparent.is_none() {
        errs.push("api: false needs transparent routes, or the filter would refuse every request".into());
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    Ok(Config {
        api,
        transparent,
        warnings,
        max_wait_ms,
        max_queue_per_key: usize::try_from(max_queue).unwrap_or(DEFAULT_MAX_QUEUE_PER_KEY),
        namespaces: raw.namespaces,
        grants,
        local_limits,
        #[cfg(feature = "test-trap")]
        test_trap_header: raw.test_trap_header,
    })
}

/// Longest `path_prefix`.
const MAX_PATH_PREFIX_LEN: usize = 1024;

/// Why `p` cannot be a `path_prefix`: a prefix must itself be a canonical path
/// (no query), or no canonical request path could ever be under it.
fn path_prefix_error(p: &str) -> Option<String> {
    if p.len() > MAX_PATH_PREFIX_LEN {
        return Some(format!("is {} bytes, above the maximum {MAX_PATH_PREFIX_LEN}", p.len()));
    }
    match canon::check(p.as_bytes()) {
        Err(e) => Some(e.to_string()),
        Ok(c) if c.query().is_some() => Some("has a '?': a prefix is a path, without a query".into()),
        Ok(_) => None,
    }
}

fn transparent(v: Value, max_wait_ms: u64, errs: &mut Vec<String>, warnings: &mut Vec<String>) -> Option<Transparent> {
    let t = match RawTransparent::deserialize(v) {
        Ok(t) => t,
        Err(e) => {
            errs.push(format!("transparent: {e}"));
            return None;
        }
    };
    let before = errs.len();
    let cluster_ok = !t.arbiter_cluster.is_empty()
        && t.arbiter_cluster.len() <= 255
        // `|` too: Istio names outbound clusters `outbound|<port>||<host>`.
        && t.arbiter_cluster.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.|".contains(&b));
    if !cluster_ok {
        errs.push("transparent.arbiter_cluster: required, the name of the arbiters' Envoy cluster".into());
    }
    let authority = t.arbiter_authority.unwrap_or_else(|| "lockmesh-arbiter".into());
    if authority.is_empty() || !authority.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)) {
        errs.push("transparent.arbiter_authority: must be a host name".into());
    }
    let callout_timeout_ms = t.callout_timeout_ms.unwrap_or(2000);
    if !(100..=60_000).contains(&callout_timeout_ms) {
        errs.push(format!("transparent.callout_timeout_ms: {callout_timeout_ms} is outside 100 to 60000"));
    }
    let reconcile_every_ms = t.reconcile_every_ms.unwrap_or(5000);
    if !(1000..=600_000).contains(&reconcile_every_ms) {
        errs.push(format!("transparent.reconcile_every_ms: {reconcile_every_ms} is outside 1000 to 600000"));
    }
    if t.routes.is_empty() {
        errs.push("transparent.routes: at least one route is required".into());
    }
    let mut routes: Vec<TransparentRoute> = Vec::new();
    for (i, v) in t.routes.into_iter().enumerate() {
        let at = |f: &str| format!("transparent.routes[{i}].{f}");
        let r = match RawTransparentRoute::deserialize(v) {
            Ok(r) => r,
            Err(e) => {
                errs.push(format!("transparent.routes[{i}]: {e}"));
                continue;
            }
        };
        let matcher = match (r.path_prefix, r.path) {
            (Some(p), None) => {
                if let Some(e) = path_prefix_error(&p) {
                    errs.push(format!(
                        "{}: {p:?} must start with '/' and be a canonical path (docs/TRANSPARENT.md): {e}",
                        at("path_prefix")
                    ));
                    continue;
                }
                RouteMatch::Prefix(p)
            }
            (None, Some(p)) => match PathTemplate::parse(&p) {
                Ok(t) => RouteMatch::Template(t),
                Err(e) => {
                    errs.push(format!("{}: {e}", at("path")));
                    continue;
                }
            },
            (Some(_), Some(_)) => {
                errs.push(format!("transparent.routes[{i}]: path_prefix and path are exclusive: give one"));
                continue;
            }
            (None, None) => {
                errs.push(format!(
                    "transparent.routes[{i}]: a path_prefix (\"/orders\") or a path template (\"/orders/{{id}}\") is required"
                ));
                continue;
            }
        };
        if routes.iter().any(|o| o.matcher == matcher) {
            let (field, text) = match &matcher {
                RouteMatch::Prefix(p) => ("path_prefix", p.as_str()),
                RouteMatch::Template(t) => ("path", t.as_str()),
            };
            errs.push(format!("{}: {text:?} is listed twice", at(field)));
            continue;
        }
        let allow_unlocked = r.allow_unlocked.unwrap_or(false);
        let Some(key) = key_source(&matcher, r.key, r.caller_chooses_key, allow_unlocked, &at, errs) else {
            continue;
        };
        if key == KeySource::CallerChooses {
            warnings.push(format!(
                "transparent.routes[{i}]: caller_chooses_key: the caller names the key, so the lock guards whatever \
                 key it sends, not the resource the request touches (two callers can each hold a different key and \
                 reach the same resource); bind it with \"key\" (docs/TRANSPARENT.md)"
            ));
        }
        let default_wait_ms = r.default_wait_ms.unwrap_or(5000).min(max_wait_ms);
        if r.default_wait_ms.is_some_and(|w| w > max_wait_ms) {
            errs.push(format!("{}: above max_wait_ms {max_wait_ms}", at("default_wait_ms")));
        }
        routes.push(TransparentRoute { matcher, key, allow_unlocked, default_wait_ms });
    }
    (errs.len() == before).then_some(Transparent {
        arbiter_cluster: t.arbiter_cluster,
        arbiter_authority: authority,
        callout_timeout_ms,
        reconcile_every_ms,
        routes,
    })
}

/// A route's key source from `key` and `caller_chooses_key`: exactly one of them.
/// A `key` template may use the `path` template's variables and at most one header,
/// never a header lockmesh reads or reserves (`{header:x-lock-key}` would hand the
/// choice back to the caller), and must give a valid key for plain values.
fn key_source(
    matcher: &RouteMatch,
    key: Option<String>,
    caller_chooses: Option<bool>,
    allow_unlocked: bool,
    at: &dyn Fn(&str) -> String,
    errs: &mut Vec<String>,
) -> Option<KeySource> {
    let kinds = match matcher {
        RouteMatch::Template(t) => t.var_kinds(),
        RouteMatch::Prefix(_) => Vec::new(),
    };
    let vars: Vec<&str> = kinds.iter().map(|(v, _)| *v).collect();
    match (key, caller_chooses == Some(true)) {
        (Some(_), true) => {
            errs.push(format!("{}: true and a key template are exclusive: give one", at("caller_chooses_key")));
            None
        }
        (None, true) => Some(KeySource::CallerChooses),
        (None, false) => {
            errs.push(format!(
                "{}: required: a key template over the path's variables (\"payments/order-{{id}}\"), or \
                 caller_chooses_key: true to let the caller name any key (weaker: docs/TRANSPARENT.md)",
                at("key")
            ));
            None
        }
        (Some(k), false) => {
            let t = match TextTemplate::parse(&k, &vars) {
                Ok(t) => t,
                Err(e) => {
                    errs.push(format!("{}: {e}", at("key")));
                    return None;
                }
            };
            let mut names = t.header_names();
            names.sort_unstable();
            names.dedup();
            if names.len() > 1 {
                errs.push(format!("{}: {k:?} reads {} headers; at most one", at("key"), names.len()));
                return None;
            }
            if let Some(h) = names.iter().find(|h| {
                headers::LOCK_HEADERS.contains(h) || headers::never_from_client(h) || headers::upstream_reserved(h)
            }) {
                errs.push(format!(
                    "{}: {{header:{h}}} is a lockmesh header: a key read from it is the caller's choice",
                    at("key")
                ));
                return None;
            }
            // Plain values for every variable and header: a template that cannot give
            // a valid key even then is a typo, not a request's fault.
            let mut sample = Vars::new();
            for (v, kind) in &kinds {
                sample.insert(*v, kind.sample());
            }
            if let Err(e) = t.fill_key(&sample, &|_| HeaderLookup::One(b"x".to_vec())) {
                errs.push(format!("{}: {k:?} gives no valid key even for plain values: {e}", at("key")));
                return None;
            }
            if allow_unlocked {
                errs.push(format!(
                    "{}: true needs caller_chooses_key: a route with a key template locks every request",
                    at("allow_unlocked")
                ));
                return None;
            }
            Some(KeySource::Bound(t))
        }
    }
}

fn local_limits(raw: Vec<Value>, errs: &mut Vec<String>) -> Vec<LocalLimit> {
    let mut out: Vec<LocalLimit> = Vec::new();
    for (i, v) in raw.into_iter().enumerate() {
        let l = match RawLocalLimit::deserialize(v) {
            Ok(l) => l,
            Err(e) => {
                errs.push(format!("local_limits[{i}]: {e}"));
                continue;
            }
        };
        let at = |f: &str| format!("local_limits[{i}].{f}");
        let mut ok = true;
        if !valid_key_prefix(&l.prefix) {
            errs.push(format!("{}: {:?} is not a namespace or namespace/path", at("prefix"), l.prefix));
            ok = false;
        } else if out.iter().any(|o| o.prefix == l.prefix) {
            errs.push(format!("{}: {:?} is listed twice", at("prefix"), l.prefix));
            ok = false;
        }
        let max = l.max_in_flight.unwrap_or(0);
        if max == 0 || max > MAX_QUEUE_CEILING {
            errs.push(format!("{}: {max} is outside 1 to {MAX_QUEUE_CEILING}", at("max_in_flight")));
            ok = false;
        }
        if l.approximate != Some(true) {
            errs.push(format!(
                "{}: must be true: the limit holds per Envoy, so across the fleet it is max_in_flight x lock-tier replicas",
                at("approximate")
            ));
            ok = false;
        }
        if ok {
            out.push(LocalLimit { prefix: l.prefix, max_in_flight: u32::try_from(max).unwrap_or(u32::MAX) });
        }
    }
    out
}

#[cfg(test)]
mod tests;
