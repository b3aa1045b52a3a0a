//! The arbiter config's cluster topology (ADR-07, ADR-08, ADR-09;
//! `docs/SCALE.md`): more etcd clusters, which of them back the entity tier, and
//! the region each namespace is homed to.
//!
//! ```yaml
//! etcd: { endpoints: [...], root: /lockmesh }   # the coord cluster, named `coord`
//! clusters:                                     # optional: more clusters
//!   shard-a: { endpoints: [...], tls: {...}, user: ..., password_file: ... }
//!   shard-b: { endpoints: [...] }
//! tiers:
//!   entity: [shard-a, shard-b]                  # default [coord]: one cluster backs both tiers
//! region:                                       # optional (ADR-08)
//!   name: eu-1
//!   namespaces: { payments: eu-1, search: us-1 }
//!   default: eu-1                               # namespaces not listed; default: this region
//! ```
//!
//! `tiers.entity` only seeds the shard map the first time an arbiter creates it in
//! the coord cluster; after that the map there is authoritative and changes only
//! through `lockctl shard apply` (the fenced move).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use lockmesh_core::{key::valid_namespace, shard::valid_cluster_name};
use serde::Deserialize;

use crate::{
    connect::{EtcdClientAuth, RawEtcd, RawEtcdTls},
    home::COORD_CLUSTER,
};

/// One more etcd cluster as written (`clusters.<name>`): `etcd:` without `root`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    /// Client URLs.
    pub endpoints: Vec<String>,
    /// Client TLS.
    pub tls: Option<RawEtcdTls>,
    /// etcd user, with `password_file`.
    pub user: Option<String>,
    /// File holding the user's password.
    pub password_file: Option<String>,
}

/// `tiers:` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTiers {
    /// The clusters of the entity tier's first shard map. Default `[coord]`.
    pub entity: Vec<String>,
}

/// `region:` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRegion {
    /// This arbiter's region.
    pub name: String,
    /// Namespace to its home region.
    #[serde(default)]
    pub namespaces: BTreeMap<String, String>,
    /// Home region of namespaces not listed. Default: this region.
    pub default: Option<String>,
}

/// A connected cluster's settings.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Its name (`coord` for `etcd:`).
    pub name: String,
    /// Client URLs.
    pub endpoints: Vec<String>,
    /// TLS and user.
    pub auth: EtcdClientAuth,
}

/// Regional homing (ADR-08).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    /// This arbiter's region.
    pub name: String,
    /// Namespace to home region.
    pub namespaces: BTreeMap<String, String>,
    /// Home region of namespaces not listed.
    pub default: String,
}

/// The validated topology.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// Clusters other than the coord (`etcd:`) one, by name.
    pub clusters: Vec<ClusterConfig>,
    /// The entity tier's clusters for a first shard map.
    pub entity: Vec<String>,
    /// Regional homing, if configured.
    pub region: Option<Region>,
}

// === impl Region ===

impl Region {
    /// The home region of `namespace` when it is not this one.
    pub fn elsewhere(&self, namespace: &str) -> Option<&str> {
        let home = self.namespaces.get(namespace).unwrap_or(&self.default);
        (home != &self.name).then_some(home.as_str())
    }
}

// === impl Topology ===

impl Topology {
    /// True when the deployment has more than one cluster.
    pub(crate) fn is_split(&self) -> bool {
        !self.clusters.is_empty()
    }

    /// The marks file of cluster `name`: `marks_file` for the coord cluster,
    /// `<marks_file>.<name>` for the others (each cluster has its own marks).
    pub fn marks_file(marks_file: Option<&Path>, name: &str) -> Option<PathBuf> {
        let m = marks_file?;
        if name == COORD_CLUSTER {
            return Some(m.to_owned());
        }
        let mut s = m.as_os_str().to_owned();
        s.push(format!(".{name}"));
        Some(PathBuf::from(s))
    }

    /// Validates `clusters`, `tiers` and `region`; errors are `file: field: message`.
    /// `auth` validates one cluster's TLS and user like `etcd:`'s (its messages say
    /// `etcd.`, rewritten here to the cluster's path).
    pub fn from_raw(
        clusters: &BTreeMap<String, RawCluster>,
        tiers: Option<&RawTiers>,
        region: Option<&RawRegion>,
        name: &str,
        errs: &mut Vec<String>,
        auth: &mut dyn FnMut(&RawEtcd, &mut Vec<String>) -> EtcdClientAuth,
    ) -> Self {
        let mut out = Topology::default();
        for (c, raw) in clusters {
            let at = format!("clusters.{c}");
            if !valid_cluster_name(c) || c == COORD_CLUSTER {
                errs.push(format!(
                    "{name}: {at}: {c:?} must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric, and \
                     not {COORD_CLUSTER:?} (the etcd: section is the coord cluster)"
                ));
            }
            if raw.endpoints.is_empty() {
                errs.push(format!("{name}: {at}.endpoints: must list at least one endpoint"));
            }
            for (i, e) in raw.endpoints.iter().enumerate() {
                if !(e.starts_with("http://") || e.starts_with("https://")) {
                    errs.push(format!("{name}: {at}.endpoints[{i}]: {e:?} must start with http:// or https://"));
                }
            }
            let as_etcd = RawEtcd {
                endpoints: raw.endpoints.clone(),
                root: "/unused".into(),
                op_timeout_ms: None,
                max_group: None,
                groups_in_flight: None,
                max_txn_ops: None,
                max_request_bytes: None,
                tls: raw.tls.clone(),
                user: raw.user.clone(),
                password_file: raw.password_file.clone(),
            };
            let mut mine = Vec::new();
            let a = auth(&as_etcd, &mut mine);
            let from = format!("{name}: etcd.");
            errs.extend(mine.into_iter().map(|m| m.replacen(&from, &format!("{name}: {at}."), 1)));
            out.clusters.push(ClusterConfig { name: c.clone(), endpoints: raw.endpoints.clone(), auth: a });
        }
        let known = |c: &str| c == COORD_CLUSTER || clusters.contains_key(c);
        out.entity = match tiers {
            None => vec![COORD_CLUSTER.to_owned()],
            Some(t) => {
                if t.entity.is_empty() {
                    errs.push(format!("{name}: tiers.entity: must name at least one cluster"));
                }
                for (i, c) in t.entity.iter().enumerate() {
                    if !known(c) {
                        errs.push(format!(
                            "{name}: tiers.entity[{i}]: {c:?} is not {COORD_CLUSTER:?} or a cluster under clusters"
                        ));
                    } else if t.entity[..i].contains(c) {
                        errs.push(format!("{name}: tiers.entity[{i}]: {c:?} is listed twice"));
                    }
                }
                t.entity.clone()
            }
        };
        if let Some(r) = region {
            let label = |field: &str, v: &str, errs: &mut Vec<String>| {
                if !valid_namespace(v) {
                    errs.push(format!("{name}: {field}: {v:?} is not a region name ([a-z0-9-], 1-63)"));
                }
            };
            label("region.name", &r.name, errs);
            for (ns, home) in &r.namespaces {
                if !valid_namespace(ns) {
                    errs.push(format!("{name}: region.namespaces.{ns}: not a namespace"));
                }
                label(&format!("region.namespaces.{ns}"), home, errs);
            }
            if let Some(d) = &r.default {
                label("region.default", d, errs);
            }
            out.region = Some(Region {
                name: r.name.clone(),
                namespaces: r.namespaces.clone(),
                default: r.default.clone().unwrap_or_else(|| r.name.clone()),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(endpoints: &[&str]) -> RawCluster {
        RawCluster {
            endpoints: endpoints.iter().map(|s| (*s).to_owned()).collect(),
            tls: None,
            user: None,
            password_file: None,
        }
    }

    fn check(
        clusters: BTreeMap<String, RawCluster>,
        tiers: Option<RawTiers>,
        region: Option<RawRegion>,
    ) -> (Topology, Vec<String>) {
        let mut errs = Vec::new();
        let mut auth = |r: &RawEtcd, e: &mut Vec<String>| {
            if r.user.is_some() {
                e.push("a.yaml: etcd.password_file: required with etcd.user".into());
            }
            EtcdClientAuth::default()
        };
        let t = Topology::from_raw(&clusters, tiers.as_ref(), region.as_ref(), "a.yaml", &mut errs, &mut auth);
        (t, errs)
    }

    #[test]
    fn one_cluster_backs_both_tiers_by_default() {
        let (t, errs) = check(BTreeMap::new(), None, None);
        assert!(errs.is_empty(), "{errs:?}");
        assert!(!t.is_split());
        assert_eq!(t.entity, vec!["coord".to_owned()]);
    }

    #[test]
    fn clusters_tiers_and_regions_are_validated_with_field_paths() {
        let mut cs = BTreeMap::new();
        cs.insert("shard-a".to_owned(), cluster(&["http://127.0.0.1:1"]));
        cs.insert("coord".to_owned(), cluster(&["http://127.0.0.1:2"]));
        cs.insert("Bad".to_owned(), cluster(&["ftp://x"]));
        let mut with_user = cluster(&["http://127.0.0.1:3"]);
        with_user.user = Some("arb".into());
        cs.insert("shard-u".to_owned(), with_user);
        let tiers = RawTiers { entity: vec!["shard-a".into(), "nope".into(), "shard-a".into()] };
        let region = RawRegion {
            name: "EU".into(),
            namespaces: BTreeMap::from([("payments".into(), "us-1".into()), ("Bad".into(), "eu".into())]),
            default: None,
        };
        let (_, errs) = check(cs, Some(tiers), Some(region));
        for want in [
            "a.yaml: clusters.coord:",
            "a.yaml: clusters.Bad:",
            "a.yaml: clusters.Bad.endpoints[0]:",
            "a.yaml: clusters.shard-u.password_file: required",
            "a.yaml: tiers.entity[1]:",
            "a.yaml: tiers.entity[2]:",
            "a.yaml: region.name:",
            "a.yaml: region.namespaces.Bad:",
        ] {
            assert!(errs.iter().any(|e| e.starts_with(want)), "{want}: {errs:?}");
        }
    }

    #[test]
    fn a_namespace_homed_elsewhere_names_its_region() {
        let r = Region {
            name: "eu-1".into(),
            namespaces: BTreeMap::from([("search".into(), "us-1".into()), ("payments".into(), "eu-1".into())]),
            default: "eu-1".into(),
        };
        assert_eq!(r.elsewhere("search"), Some("us-1"));
        assert_eq!(r.elsewhere("payments"), None);
        assert_eq!(r.elsewhere("other"), None);
        let r2 = Region { default: "ap-1".into(), ..r };
        assert_eq!(r2.elsewhere("other"), Some("ap-1"));
    }

    #[test]
    fn each_cluster_has_its_own_marks_file() {
        let m = Path::new("/var/lib/lockmesh/marks.json");
        assert_eq!(Topology::marks_file(Some(m), "coord").unwrap(), m);
        assert_eq!(
            Topology::marks_file(Some(m), "shard-a").unwrap(),
            Path::new("/var/lib/lockmesh/marks.json.shard-a")
        );
        assert_eq!(Topology::marks_file(None, "shard-a"), None);
    }
}
