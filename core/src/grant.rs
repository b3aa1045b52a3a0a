//! Prefix grants (ADR-19): which SPIFFE identities may do what under which key
//! prefixes.
//!
//! A grant names an identity pattern, key prefixes and operations. The identity is an
//! exact SPIFFE ID (`spiffe://lockmesh.test/ns/payments/sa/worker`) or an ID prefix
//! ending in `/` (`spiffe://lockmesh.test/ns/payments/` covers every workload of that
//! namespace; `spiffe://lockmesh.test/` a whole trust domain). Key prefixes are
//! `namespace` or `namespace/path` and match on `/` boundaries ([`covers`]):
//! `payments/orders` covers `payments/orders` and `payments/orders/7`, never
//! `payments/orders-archive`.
//!
//! Grants only add: there are no denials, so a request is allowed when any grant
//! matching its identity covers its key with its operation. The raw documents
//! ([`RawGrant`]) are what the filter configuration (and later the LockGrant CRDs)
//! carry. [`GrantSet::try_from_raw`] validates them, reports every error with its
//! field path, and compiles them once into hash indexes: identity pattern, then key
//! prefix, then an operation bit set. A lookup walks the identity's `/` prefixes and
//! the key's `/` prefixes from the longest down (longest-prefix match), so it costs
//! `O(identity segments x key segments)` hash probes whatever the number of grants.

use std::{collections::HashMap, fmt, hash::BuildHasherDefault};

use serde::{Deserialize, Serialize};

use crate::{
    class::FieldError,
    key::{covers, valid_namespace, LockKey},
};

/// Longest identity pattern accepted (the SPIFFE ID length limit).
pub const MAX_IDENTITY_LEN: usize = 2048;
/// The SPIFFE URI scheme.
pub const SPIFFE_SCHEME: &str = "spiffe://";

/// SipHash with fixed keys. Grant sets are built from configuration, not from callers,
/// and the fixed keys spare the Wasm filter a `random_get` per table.
type Hasher = BuildHasherDefault<std::collections::hash_map::DefaultHasher>;

/// What a request does to a key; each route maps to one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    /// Take, renew and give back locks and sessions.
    Acquire,
    /// See a key's holders.
    Inspect,
    /// Validate a fencing token (resources that cannot store a mark).
    Validate,
    /// Operator actions.
    Admin,
}

/// A set of [`Operation`]s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpSet(u8);

/// One grant as written in the configuration (a LockGrant document).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawGrant {
    /// An exact SPIFFE ID, or an ID prefix ending in `/`.
    #[serde(default)]
    pub identity: String,
    /// Key prefixes (`namespace` or `namespace/path`), matched on `/` boundaries.
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// Operations: `acquire`, `inspect`, `validate`, `admin`.
    #[serde(default)]
    pub operations: Vec<String>,
}

/// The compiled, validated grants.
#[derive(Debug, Clone, Default)]
pub struct GrantSet {
    /// Exact SPIFFE ID → what it may do.
    exact: HashMap<String, Scope, Hasher>,
    /// SPIFFE ID prefix (ending in `/`) → what every ID under it may do.
    prefixed: HashMap<String, Scope, Hasher>,
    len: usize,
}

/// Everything one identity pattern may do.
#[derive(Debug, Clone, Default)]
struct Scope {
    /// Key prefix → operations.
    by_prefix: HashMap<String, OpSet, Hasher>,
    /// Union of every operation the pattern holds anywhere.
    any: OpSet,
}

// === impl Operation ===

impl Operation {
    /// Every operation.
    pub const ALL: [Operation; 4] = [Operation::Acquire, Operation::Inspect, Operation::Validate, Operation::Admin];

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Acquire => "acquire",
            Operation::Inspect => "inspect",
            Operation::Validate => "validate",
            Operation::Admin => "admin",
        }
    }

    /// Parses the configuration spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == s)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// === impl OpSet ===

impl OpSet {
    pub fn insert(&mut self, op: Operation) {
        self.0 |= op.bit();
    }
    /// True when `op` is in the set.
    pub fn contains(self, op: Operation) -> bool {
        self.0 & op.bit() != 0
    }
    fn union(&mut self, other: OpSet) {
        self.0 |= other.0;
    }
}

// === impl RawGrant ===

impl RawGrant {
    /// True when this grant's identity pattern matches `identity`.
    pub fn matches_identity(&self, identity: &str) -> bool {
        if self.identity.ends_with('/') {
            identity.starts_with(&self.identity)
        } else {
            identity == self.identity
        }
    }

    /// The uncompiled rule: does this grant alone allow `op` on `key` for `identity`?
    /// [`GrantSet::allowed`] answers the same question for a whole set, faster.
    pub fn allows(&self, identity: &str, key: &str, op: Operation) -> bool {
        self.matches_identity(identity)
            && self.operations.iter().any(|o| o == op.as_str())
            && self.prefixes.iter().any(|p| covers(p, key))
    }
}

/// Checks an identity pattern; `Ok(true)` for a prefix pattern (ends in `/`).
pub fn parse_identity_pattern(s: &str) -> Result<bool, String> {
    let Some(rest) = s.strip_prefix(SPIFFE_SCHEME) else {
        return Err("must start with spiffe://".into());
    };
    if s.len() > MAX_IDENTITY_LEN {
        return Err(format!("is {} bytes, above the maximum {MAX_IDENTITY_LEN}", s.len()));
    }
    let (td, path) = rest.split_once('/').unwrap_or((rest, ""));
    if td.is_empty() || !td.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b)) {
        return Err("needs a trust domain of [a-z0-9-._]".into());
    }
    if !rest.contains('/') {
        return Err(format!("names no workload; write spiffe://{td}/ to grant the whole trust domain"));
    }
    let prefix = path.is_empty() || path.ends_with('/');
    let body = path.strip_suffix('/').unwrap_or(path);
    let segments_ok = body.is_empty()
        || body.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
        });
    if !segments_ok {
        return Err("has an empty, '.' or '..' path segment or a character outside [A-Za-z0-9-._]".into());
    }
    Ok(prefix)
}

/// Checks a key prefix: a namespace, or a valid key (`namespace/path`).
pub fn valid_key_prefix(p: &str) -> bool {
    if p.contains('/') {
        LockKey::parse(p.as_bytes()).is_ok()
    } else {
        valid_namespace(p)
    }
}

// === impl GrantSet ===

impl GrantSet {
    /// Validates and compiles `grants` (the `grants` list of a configuration),
    /// collecting every error with its path (`grants[3].prefixes[0]: ...`).
    pub fn try_from_raw(grants: &[RawGrant]) -> Result<Self, Vec<FieldError>> {
        let mut errs = Vec::new();
        let mut set = GrantSet::default();
        for (i, g) in grants.iter().enumerate() {
            let at = |f: &str| format!("grants[{i}].{f}");
            let mut ok = true;
            let prefix_pattern = match parse_identity_pattern(&g.identity) {
                Ok(p) => p,
                Err(m) => {
                    errs.push(FieldError { path: at("identity"), message: format!("{:?} {m}", g.identity) });
                    ok = false;
                    false
                }
            };
            if g.prefixes.is_empty() {
                errs.push(FieldError { path: at("prefixes"), message: "must list at least one key prefix".into() });
                ok = false;
            }
            for (j, p) in g.prefixes.iter().enumerate() {
                let message = if !valid_key_prefix(p) {
                    format!("{p:?} is not a namespace or namespace/path")
                } else if g.prefixes[..j].contains(p) {
                    format!("{p:?} is listed twice")
                } else {
                    continue;
                };
                errs.push(FieldError { path: at(&format!("prefixes[{j}]")), message });
                ok = false;
            }
            let mut ops = OpSet::default();
            if g.operations.is_empty() {
                errs.push(FieldError {
                    path: at("operations"),
                    message: "must list at least one of acquire, inspect, validate, admin".into(),
                });
                ok = false;
            }
            for (j, o) in g.operations.iter().enumerate() {
                let message = match Operation::parse(o) {
                    None => format!("{o:?} is not one of acquire, inspect, validate, admin"),
                    Some(_) if g.operations[..j].contains(o) => format!("{o:?} is listed twice"),
                    Some(op) => {
                        ops.insert(op);
                        continue;
                    }
                };
                errs.push(FieldError { path: at(&format!("operations[{j}]")), message });
                ok = false;
            }
            if ok {
                let index = if prefix_pattern { &mut set.prefixed } else { &mut set.exact };
                let scope = index.entry(g.identity.clone()).or_default();
                for p in &g.prefixes {
                    scope.by_prefix.entry(p.clone()).or_default().union(ops);
                }
                scope.any.union(ops);
                set.len += 1;
            }
        }
        if errs.is_empty() {
            Ok(set)
        } else {
            Err(errs)
        }
    }

    /// Number of grants compiled in.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no grant was configured: every request is denied.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The scopes that apply to `identity`: its exact entry, then every prefix entry
    /// from the longest `/`-terminated prefix of the ID down to the trust domain.
    fn scopes<'a>(&'a self, identity: &'a str) -> impl Iterator<Item = &'a Scope> + 'a {
        let exact = self.exact.get(identity);
        let start = SPIFFE_SCHEME.len();
        let prefixes = identity
            .char_indices()
            .rev()
            .filter(move |(i, c)| *c == '/' && *i >= start)
            .filter_map(move |(i, _)| identity.get(..=i))
            .filter_map(move |p| self.prefixed.get(p));
        exact.into_iter().chain(prefixes)
    }

    /// True when some grant lets `identity` do `op` to `key`.
    pub fn allowed(&self, identity: &str, key: &LockKey, op: Operation) -> bool {
        let key = key.as_str();
        // The key itself, then each prefix ending before a '/', longest first.
        let key_prefixes = std::iter::once(key)
            .chain(key.char_indices().rev().filter(|(_, c)| *c == '/').filter_map(|(i, _)| key.get(..i)));
        let key_prefixes: Vec<&str> = key_prefixes.collect();
        self.scopes(identity)
            .any(|scope| key_prefixes.iter().any(|p| scope.by_prefix.get(*p).is_some_and(|ops| ops.contains(op))))
    }

    /// The key namespaces (each prefix's first segment) in which `identity` holds
    /// `op` on some prefix, sorted, without repeats.
    pub fn namespaces(&self, identity: &str, op: Operation) -> Vec<String> {
        let mut out: Vec<String> = self
            .scopes(identity)
            .flat_map(|s| s.by_prefix.iter())
            .filter(|(_, ops)| ops.contains(op))
            .map(|(p, _)| p.split('/').next().unwrap_or_default().to_owned())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// True when `identity` holds `op` on at least one prefix (routes without a key,
    /// such as opening a session, need this).
    pub fn holds_any(&self, identity: &str, op: Operation) -> bool {
        self.scopes(identity).any(|s| s.any.contains(op))
    }
}

#[cfg(test)]
mod tests;
