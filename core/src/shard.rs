//! Where a key lives (ADR-07, ADR-09): the versioned shard map, rendezvous hashing
//! and what a map change may move (`docs/SCALE.md`).
//!
//! A key's **home** is one etcd cluster:
//! - keys of a class the map lists in `coord_classes` live on the `coord` cluster;
//! - every other key lives on an entity cluster: its namespace's override if the map
//!   has one, else the shard with the highest rendezvous score for the key's **unit**.
//!
//! The unit is the key's first two segments (`namespace/name` of
//! `namespace/name/more...`): keys that share them share a home, and a move moves
//! them together. The score is `SHA-256(HRW_DOMAIN || cluster || 0 || unit)`'s first
//! 8 bytes (big endian); the highest wins, a tie goes to the smaller name. Adding a
//! shard moves exactly the units whose top score becomes the new shard's (about
//! 1/N of them) and nothing between the old shards.
//!
//! The map is desired state until an operator applies it through the move protocol
//! (drain, verify, epoch advance, flip, resume); the arbiter fences every grant with
//! the copy of the map recorded in the granting cluster (`HomeRecord` in the
//! arbiter). Pure functions only: this module builds for wasm32.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::key::valid_namespace;

/// Domain separator of the rendezvous score.
pub const HRW_DOMAIN: &[u8] = b"lockmesh/hrw/v1\0";

/// The versioned shard map (ADR-09), as stored in the coord cluster and copied into
/// every cluster's home record.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardMap {
    /// Incremented by every applied change.
    pub version: u64,
    /// The cluster of the coord tier (leader election and other coord classes).
    pub coord: String,
    /// The entity shards keys are spread over by rendezvous hashing.
    pub shards: Vec<String>,
    /// Per-namespace manual assignment (a tenant on its own shard): namespace to
    /// cluster. Entity-tier keys only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub overrides: BTreeMap<String, String>,
    /// Classes whose keys live on `coord` (their tier is `coord`).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub coord_classes: BTreeSet<String>,
}

/// Which clusters a map change may take keys from and give keys to (a superset of
/// the real pairs: the units that exist are not enumerable).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MoveScope {
    /// Clusters that may lose keys.
    pub losers: BTreeSet<String>,
    /// Clusters that may gain keys.
    pub gainers: BTreeSet<String>,
}

/// Checks a cluster name: a lowercase DNS label (like a namespace).
pub fn valid_cluster_name(s: &str) -> bool {
    valid_namespace(s)
}

/// The hashing unit of a key: its first two segments.
pub fn unit_of(key: &str) -> &str {
    match key.match_indices('/').nth(1) {
        Some((i, _)) => &key[..i],
        None => key,
    }
}

/// The namespace of a key (its first segment).
pub fn namespace_of(key: &str) -> &str {
    key.split('/').next().unwrap_or(key)
}

/// The rendezvous score of `cluster` for `unit`.
pub fn score(cluster: &str, unit: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(HRW_DOMAIN);
    h.update(cluster.as_bytes());
    h.update([0u8]);
    h.update(unit.as_bytes());
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_be_bytes(b)
}

/// The shard with the highest score for `unit` (ties: the smaller name).
pub fn rendezvous<'a>(shards: &'a [String], unit: &str) -> Option<&'a str> {
    shards
        .iter()
        .map(|s| (score(s, unit), s.as_str()))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, s)| s)
}

// === impl ShardMap ===

impl ShardMap {
    /// The map of a deployment whose coord cluster is `coord`, entity shards
    /// `shards` and coord-tier classes `coord_classes`, at version 1.
    pub fn initial(coord: &str, shards: &[String], coord_classes: impl IntoIterator<Item = String>) -> Self {
        let mut shards = shards.to_vec();
        shards.sort();
        shards.dedup();
        Self {
            version: 1,
            coord: coord.to_owned(),
            shards,
            overrides: BTreeMap::new(),
            coord_classes: coord_classes.into_iter().collect(),
        }
    }

    /// Every problem, with its field path.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errs = Vec::new();
        if !valid_cluster_name(&self.coord) {
            errs.push(format!("coord: {:?} is not a cluster name ([a-z0-9-], 1-63)", self.coord));
        }
        if self.shards.is_empty() {
            errs.push("shards: at least one entity shard is required".into());
        }
        for (i, s) in self.shards.iter().enumerate() {
            if !valid_cluster_name(s) {
                errs.push(format!("shards[{i}]: {s:?} is not a cluster name ([a-z0-9-], 1-63)"));
            }
            if self.shards[..i].contains(s) {
                errs.push(format!("shards[{i}]: {s:?} is listed twice"));
            }
        }
        for (ns, c) in &self.overrides {
            if !valid_namespace(ns) {
                errs.push(format!("overrides.{ns}: not a namespace"));
            }
            if !valid_cluster_name(c) {
                errs.push(format!("overrides.{ns}: {c:?} is not a cluster name"));
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }

    /// The home cluster of `key` of class `class` (`None` only for a map without
    /// shards, which [`ShardMap::validate`] refuses).
    pub fn home(&self, class: &str, key: &str) -> Option<&str> {
        if self.coord_classes.contains(class) {
            return Some(&self.coord);
        }
        if let Some(c) = self.overrides.get(namespace_of(key)) {
            return Some(c);
        }
        rendezvous(&self.shards, unit_of(key))
    }

    /// Every cluster the map homes keys on.
    pub fn clusters(&self) -> BTreeSet<String> {
        let mut s: BTreeSet<String> = self.shards.iter().cloned().collect();
        s.insert(self.coord.clone());
        s.extend(self.overrides.values().cloned());
        s
    }

    /// Every cluster that homes entity keys (shards and override targets).
    fn entity_clusters(&self) -> BTreeSet<String> {
        let mut s: BTreeSet<String> = self.shards.iter().cloned().collect();
        s.extend(self.overrides.values().cloned());
        s
    }

    /// True when `key` of `class` leaves `cluster` going from `self` to `next`
    /// (homed there now, elsewhere then).
    pub fn moves_away(&self, next: &ShardMap, class: &str, key: &str, cluster: &str) -> bool {
        self.home(class, key) == Some(cluster) && next.home(class, key) != Some(cluster)
    }

    /// The clusters a change to `next` may take keys from and give them to.
    pub fn move_scope(&self, next: &ShardMap) -> MoveScope {
        let mut m = MoveScope::default();
        let mut pair = |from: BTreeSet<String>, to: BTreeSet<String>| {
            m.losers.extend(from);
            m.gainers.extend(to);
        };
        let one = |c: &str| BTreeSet::from([c.to_owned()]);
        if self.coord != next.coord {
            pair(one(&self.coord), one(&next.coord));
        }
        for c in self.coord_classes.symmetric_difference(&next.coord_classes) {
            if next.coord_classes.contains(c) {
                pair(self.entity_clusters(), one(&next.coord));
            } else {
                pair(one(&self.coord), next.entity_clusters());
            }
        }
        let (old_s, new_s): (BTreeSet<&String>, BTreeSet<&String>) =
            (self.shards.iter().collect(), next.shards.iter().collect());
        if old_s != new_s {
            let added: BTreeSet<String> = new_s.difference(&old_s).map(|s| (*s).clone()).collect();
            let removed: BTreeSet<String> = old_s.difference(&new_s).map(|s| (*s).clone()).collect();
            // Rendezvous: an added shard takes from every old shard, a removed
            // shard's units go to the remaining ones; nothing else moves.
            if !added.is_empty() {
                pair(old_s.iter().map(|s| (*s).clone()).collect(), added);
            }
            if !removed.is_empty() {
                pair(removed, new_s.iter().map(|s| (*s).clone()).collect());
            }
        }
        let namespaces: BTreeSet<&String> = self.overrides.keys().chain(next.overrides.keys()).collect();
        for ns in namespaces {
            let (a, b) = (self.overrides.get(ns), next.overrides.get(ns));
            if a == b {
                continue;
            }
            let from = a.map_or_else(|| self.shards.iter().cloned().collect(), |c| one(c));
            let to = b.map_or_else(|| next.shards.iter().cloned().collect(), |c| one(c));
            pair(from, to);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("shard-{i}")).collect()
    }

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("ns{}/k{i}/x", i % 37)).collect()
    }

    #[test]
    fn the_unit_is_the_first_two_segments() {
        assert_eq!(unit_of("payments/orders/42"), "payments/orders");
        assert_eq!(unit_of("payments/o"), "payments/o");
        assert_eq!(unit_of("a/b/c/d"), "a/b");
        assert_eq!(namespace_of("payments/o"), "payments");
    }

    #[test]
    fn the_score_is_frozen() {
        // A changed hash would silently rehome every key without a move: never.
        assert_eq!(score("shard-a", "payments/orders"), score("shard-a", "payments/orders"));
        assert_ne!(score("shard-a", "payments/orders"), score("shard-b", "payments/orders"));
        assert_eq!(format!("{:016x}", score("shard-a", "payments/orders")), FROZEN_SCORE);
    }

    const FROZEN_SCORE: &str = "4907cf59c3e92b39";

    #[test]
    fn adding_a_shard_moves_about_one_in_n_and_only_to_the_new_shard() {
        for n in [1usize, 2, 3, 5, 8] {
            let old = ShardMap::initial("coord", &names(n), []);
            let mut next = old.clone();
            next.shards.push(format!("shard-{n}"));
            next.version += 1;
            let ks = keys(20_000);
            let mut moved = 0usize;
            for k in &ks {
                let (a, b) = (old.home("c", k).unwrap(), next.home("c", k).unwrap());
                if a != b {
                    moved += 1;
                    assert_eq!(b, format!("shard-{n}"), "a key moved between old shards");
                }
            }
            // Units, not keys, move: 20000 keys are 20000 units here.
            let expected = ks.len() as f64 / (n + 1) as f64;
            let got = moved as f64;
            assert!((got - expected).abs() < expected * 0.1, "n={n}: moved {moved}, expected about {expected}");
        }
    }

    #[test]
    fn removing_a_shard_moves_only_its_keys() {
        let old = ShardMap::initial("coord", &names(4), []);
        let mut next = old.clone();
        next.shards.retain(|s| s != "shard-2");
        for k in keys(5000) {
            let (a, b) = (old.home("c", &k).unwrap(), next.home("c", &k).unwrap());
            if a != "shard-2" {
                assert_eq!(a, b);
            } else {
                assert_ne!(b, "shard-2");
            }
        }
    }

    #[test]
    fn keys_of_one_unit_stay_together_overrides_win_and_coord_classes_go_to_coord() {
        let mut m = ShardMap::initial("coord", &names(5), ["leader".to_owned()]);
        let h = m.home("c", "tenant/orders/1").unwrap().to_owned();
        for i in 0..50 {
            assert_eq!(m.home("c", &format!("tenant/orders/{i}")), Some(h.as_str()));
        }
        m.overrides.insert("tenant".into(), "big-tenant".into());
        assert_eq!(m.home("c", "tenant/anything"), Some("big-tenant"));
        assert_eq!(m.home("leader", "tenant/anything"), Some("coord"));
        assert_eq!(m.home("leader", "other/x"), Some("coord"));
        assert!(m.clusters().contains("big-tenant") && m.clusters().contains("coord"));
    }

    #[test]
    fn the_move_scope_covers_every_real_move() {
        let base = ShardMap::initial("coord", &names(3), ["leader".to_owned()]);
        let mut changes = Vec::new();
        let mut add = base.clone();
        add.shards.push("shard-9".into());
        changes.push(add);
        let mut rm = base.clone();
        rm.shards.retain(|s| s != "shard-1");
        changes.push(rm);
        let mut ov = base.clone();
        ov.overrides.insert("ns3".into(), "shard-0".into());
        changes.push(ov.clone());
        let mut unov = ov.clone();
        unov.overrides.clear();
        let mut tier = base.clone();
        tier.coord_classes.clear();
        changes.push(tier);
        let mut to_coord = base.clone();
        to_coord.coord_classes.insert("c".into());
        changes.push(to_coord);
        let mut pairs: Vec<(ShardMap, ShardMap)> = changes.into_iter().map(|c| (base.clone(), c)).collect();
        pairs.push((ov, unov));
        for (a, b) in pairs {
            let scope = a.move_scope(&b);
            for k in keys(3000) {
                for class in ["c", "leader"] {
                    let (x, y) = (a.home(class, &k).unwrap(), b.home(class, &k).unwrap());
                    if x != y {
                        assert!(scope.losers.contains(x) && scope.gainers.contains(y), "{x} -> {y} not in {scope:?}");
                    }
                }
            }
        }
        let none = base.move_scope(&base);
        assert!(none.losers.is_empty() && none.gainers.is_empty());
    }

    #[test]
    fn validation_names_each_field() {
        let mut m = ShardMap::initial("Coord", &[], []);
        m.shards = vec!["a".into(), "a".into(), "B".into()];
        m.overrides.insert("ns".into(), "X".into());
        let errs = m.validate().unwrap_err();
        for want in ["coord:", "shards[1]:", "shards[2]:", "overrides.ns:"] {
            assert!(errs.iter().any(|e| e.starts_with(want)), "{want}: {errs:?}");
        }
        assert!(ShardMap::initial("coord", &names(1), []).validate().is_ok());
    }
}
