//! Per-namespace quotas (issue #19): what one namespace may hold of one cluster,
//! so a workload with a valid SVID cannot open sessions, holds and waiters until
//! etcd runs out of leases or raises `NOSPACE` for every tenant.
//!
//! A quota namespace is a lock key's first segment (the unit classes, grants and
//! metrics already use). Four quotas, each per namespace and per cluster:
//!
//! | Quota | Counts | Where it is counted |
//! |---|---|---|
//! | `sessions` | live session records | etcd, through each arbiter's watch |
//! | `holds` | live holds (slots) | etcd, through each arbiter's watch |
//! | `waiters` | acquires waiting or running at the arbiters | each arbiter, its share |
//! | `acquire_rate` | acquires per second | each arbiter, its share |
//!
//! A session counts against the namespace it was opened for (the key of its
//! first acquire or of `POST /v1/sessions`); a session opened with no key, for a
//! class whose prefixes span several namespaces, counts against [`UNSCOPED`].
//!
//! The registry's `quotas:` section sets them (`docs/OPERATIONS.md`, "Quotas"):
//!
//! ```yaml
//! quotas:
//!   default: {sessions: 10000, holds: 20000, waiters: 2000, acquires_per_s: 2000}
//!   namespaces:
//!     - {namespace: payments, holds: 50000}
//! ```
//!
//! A namespace entry overrides only what it names; the rest comes from `default`,
//! whose unnamed fields come from [`DEFAULT_LIMITS`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::key::valid_namespace;

/// The quota bucket of sessions that name no namespace (see the module docs).
pub const UNSCOPED: &str = "*";

/// Which quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Quota {
    /// Live sessions.
    Sessions,
    /// Live holds.
    Holds,
    /// Acquires waiting (or running their grant) at the arbiters.
    Waiters,
    /// Acquires per second.
    AcquireRate,
}

impl Quota {
    /// Every quota, for docs, metrics and tests.
    pub const ALL: [Quota; 4] = [Quota::Sessions, Quota::Holds, Quota::Waiters, Quota::AcquireRate];

    /// The wire name: the `quota` member of a `quota_exceeded` answer and the
    /// `quota` metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Quota::Sessions => "sessions",
            Quota::Holds => "holds",
            Quota::Waiters => "waiters",
            Quota::AcquireRate => "acquire_rate",
        }
    }

    /// Parses the wire name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|q| q.as_str() == s)
    }
}

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One namespace's limits on one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Live sessions.
    pub sessions: u64,
    /// Live holds.
    pub holds: u64,
    /// Acquires waiting or running at once, over all arbiters.
    pub waiters: u64,
    /// Acquires per second, over all arbiters.
    pub acquires_per_s: u64,
}

/// The limits of a namespace the registry does not name. They keep one cluster
/// inside its planned capacity (docs/SCALE.md: about 10^5 live sessions per
/// cluster): one namespace takes at most a tenth of it, so ten namespaces at
/// their quota still fit.
pub const DEFAULT_LIMITS: Limits = Limits { sessions: 10_000, holds: 20_000, waiters: 2_000, acquires_per_s: 2_000 };

impl Limits {
    /// The limit of `q`.
    pub fn of(&self, q: Quota) -> u64 {
        match q {
            Quota::Sessions => self.sessions,
            Quota::Holds => self.holds,
            Quota::Waiters => self.waiters,
            Quota::AcquireRate => self.acquires_per_s,
        }
    }
}

/// Limits as written: every field optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// Live sessions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<u64>,
    /// Live holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holds: Option<u64>,
    /// Acquires waiting or running at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiters: Option<u64>,
    /// Acquires per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquires_per_s: Option<u64>,
}

/// One namespace's entry as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawNamespaceQuota {
    /// The namespace (a key's first segment), or [`UNSCOPED`].
    pub namespace: String,
    /// Live sessions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<u64>,
    /// Live holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holds: Option<u64>,
    /// Acquires waiting or running at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiters: Option<u64>,
    /// Acquires per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquires_per_s: Option<u64>,
}

/// The registry's `quotas:` section as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawQuotas {
    /// Limits of every namespace not listed.
    #[serde(default)]
    pub default: RawLimits,
    /// Per-namespace overrides.
    #[serde(default)]
    pub namespaces: Vec<RawNamespaceQuota>,
}

/// The validated quotas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaTable {
    default: Limits,
    namespaces: BTreeMap<String, Limits>,
}

impl Default for QuotaTable {
    fn default() -> Self {
        Self { default: DEFAULT_LIMITS, namespaces: BTreeMap::new() }
    }
}

fn fill(base: Limits, sessions: Option<u64>, holds: Option<u64>, waiters: Option<u64>, rate: Option<u64>) -> Limits {
    Limits {
        sessions: sessions.unwrap_or(base.sessions),
        holds: holds.unwrap_or(base.holds),
        waiters: waiters.unwrap_or(base.waiters),
        acquires_per_s: rate.unwrap_or(base.acquires_per_s),
    }
}

fn zero_fields(l: &Limits) -> Vec<&'static str> {
    Quota::ALL.into_iter().filter(|q| l.of(*q) == 0).map(Quota::as_str).collect()
}

impl QuotaTable {
    /// Validates `raw`; each error is `(path, message)` under `quotas.`.
    pub fn try_from_raw(raw: &RawQuotas) -> Result<Self, Vec<(String, String)>> {
        let mut errs = Vec::new();
        let d = &raw.default;
        let default = fill(DEFAULT_LIMITS, d.sessions, d.holds, d.waiters, d.acquires_per_s);
        for f in zero_fields(&default) {
            errs.push((format!("quotas.default.{f}"), "0 would refuse everything; a quota is at least 1".into()));
        }
        let mut namespaces = BTreeMap::new();
        for (i, n) in raw.namespaces.iter().enumerate() {
            if n.namespace != UNSCOPED && !valid_namespace(&n.namespace) {
                errs.push((
                    format!("quotas.namespaces[{i}].namespace"),
                    format!("{:?} is not a namespace (a key's first segment) or {UNSCOPED:?}", n.namespace),
                ));
                continue;
            }
            let l = fill(default, n.sessions, n.holds, n.waiters, n.acquires_per_s);
            for f in zero_fields(&l) {
                errs.push((
                    format!("quotas.namespaces[{i}].{f}"),
                    "0 would refuse everything; a quota is at least 1".into(),
                ));
            }
            if namespaces.insert(n.namespace.clone(), l).is_some() {
                errs.push((format!("quotas.namespaces[{i}].namespace"), format!("{} is listed twice", n.namespace)));
            }
        }
        if errs.is_empty() {
            Ok(Self { default, namespaces })
        } else {
            Err(errs)
        }
    }

    /// The limits of namespace `ns`.
    pub fn limits(&self, ns: &str) -> &Limits {
        self.namespaces.get(ns).unwrap_or(&self.default)
    }

    /// The limits of a namespace the registry does not list.
    pub fn default_limits(&self) -> &Limits {
        &self.default
    }

    /// The namespaces listed, with their limits.
    pub fn listed(&self) -> impl Iterator<Item = (&str, &Limits)> {
        self.namespaces.iter().map(|(n, l)| (n.as_str(), l))
    }
}

/// One arbiter's share of a quota counted at the arbiters (`waiters`,
/// `acquire_rate`) when `arbiters` arbiters serve the cluster: the quota divided
/// evenly, rounded up, at least 1.
pub fn share(limit: u64, arbiters: usize) -> u64 {
    let n = u64::try_from(arbiters.max(1)).unwrap_or(u64::MAX);
    limit.div_ceil(n).max(1)
}

/// Use against a limit as a whole percentage (rounded down; 0 for a zero limit).
pub fn percent(used: u64, limit: u64) -> u64 {
    if limit == 0 {
        return 0;
    }
    u64::try_from(u128::from(used) * 100 / u128::from(limit)).unwrap_or(u64::MAX)
}

/// The share at which `lockmesh_quota_use_ratio` alerts (deploy/base/alerts).
pub const ALERT_RATIO: f64 = 0.8;

#[cfg(test)]
mod tests {
    use super::*;

    // The tests write the section as JSON, which serde reads the same way the
    // registry's YAML loader does.
    fn raw(j: &str) -> RawQuotas {
        serde_json::from_str(j).unwrap()
    }

    #[test]
    fn unnamed_fields_fall_back_to_the_default_then_to_the_built_in_limits() {
        let t = QuotaTable::try_from_raw(&raw(
            r#"{"default":{"holds":5},"namespaces":[{"namespace":"pay","sessions":3},{"namespace":"*","waiters":9}]}"#,
        ))
        .unwrap();
        assert_eq!(*t.limits("pay"), Limits { sessions: 3, holds: 5, ..DEFAULT_LIMITS });
        assert_eq!(*t.limits("other"), Limits { holds: 5, ..DEFAULT_LIMITS });
        assert_eq!(t.limits(UNSCOPED).waiters, 9);
        assert_eq!(*QuotaTable::default().limits("x"), DEFAULT_LIMITS);
    }

    #[test]
    fn zero_bad_and_duplicate_namespaces_are_refused_with_their_paths() {
        let e = QuotaTable::try_from_raw(&raw(
            r#"{"default":{"sessions":0},"namespaces":[{"namespace":"Pay"},{"namespace":"a","holds":0},{"namespace":"a"}]}"#,
        ))
        .unwrap_err();
        let paths: Vec<&str> = e.iter().map(|(p, _)| p.as_str()).collect();
        assert!(paths.contains(&"quotas.default.sessions"), "{paths:?}");
        assert!(paths.contains(&"quotas.namespaces[0].namespace"), "{paths:?}");
        assert!(paths.contains(&"quotas.namespaces[1].holds"), "{paths:?}");
        assert!(paths.contains(&"quotas.namespaces[2].namespace"), "{paths:?}");
        assert!(serde_json::from_str::<RawQuotas>(r#"{"default":{"leases":1}}"#).is_err(), "unknown field");
    }

    #[test]
    fn shares_round_up_and_never_reach_zero() {
        assert_eq!(share(10, 3), 4);
        assert_eq!(share(10, 0), 10);
        assert_eq!(share(1, 5), 1);
        assert_eq!(percent(8, 10), 80);
        assert_eq!(percent(1, 0), 0);
        for q in Quota::ALL {
            assert_eq!(Quota::parse(q.as_str()), Some(q));
        }
    }
}
