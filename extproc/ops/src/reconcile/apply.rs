//! `lockctl class apply`: making a registry's prefix-to-class map authoritative
//! through the drain discipline of limit changes, so one key is never two locks.
//!
//! 1. Every class that gains or loses keys (for each prefix the maps disagree
//!    on: its class under the old and under the new map; both defaults if the
//!    default changes) is drained, one compare-and-put per policy record: from
//!    then on no grant of those classes commits, under either map.
//! 2. Verification, outside any exclusive window, under a bounded timeout: no open
//!    hold may sit on a key whose class changes. A held key leaves everything
//!    draining (`held`, re-run `apply` to resume, or `--cancel`).
//! 3. One transaction writes the new map and reopens every drained class,
//!    comparing the map's and each record's mod revision as read in steps 1 and
//!    2: a grant cannot have slipped in (the classes were draining) and a
//!    concurrent apply or limit change makes it fail without change.
//!
//! Arbiters whose registry file is older than the map refuse the moved keys
//! (`unavailable`) until they reload it; none guesses.
//!
//! **Tiers.** A key's cluster follows its class: the shard map homes the keys of
//! its `coord_classes` on the coord cluster and every other key on an entity
//! shard (`lockmesh_core::shard::ShardMap::home`). A change that gives keys a
//! class of the other tier would move them to another cluster with neither the
//! home fence nor the epoch advance of a fenced move (docs/SCALE.md): the old
//! cluster's holds could overlap the new cluster's grants and the key's tokens
//! could fall. Such a change is refused before anything is written
//! ([`tier_crossings`], `AdminError::CrossTier`), on a split deployment (a map
//! whose entity keys live off the coord cluster) only; the map of the cluster's
//! home record and, on the coord cluster, the shard map (current and pending)
//! decide. Per cluster, each apply is otherwise independent: a key whose class
//! changes within one tier stays on its cluster, so that cluster's drain and
//! verification fence it (`lockctl class apply --config` runs it on every cluster).

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use lockmesh_core::{policy::ClassPolicy, shard::ShardMap, ClassRegistry};
use serde::Serialize;
use tokio::time::Duration;

use super::{etcd, Admin, AdminError};
use lockmesh_lock::{
    home::{HomeRecord, MapRecord},
    policy::ClassMapRecord,
};

/// What `lockctl class apply` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ApplyOutcome {
    /// The authoritative map already is the registry's.
    Unchanged,
    /// The new map is authoritative and the drained classes are open again.
    Applied {
        /// The classes drained and reopened.
        classes: Vec<String>,
    },
    /// Keys whose class changes still have open grants: still draining.
    Held {
        /// Open holds on moving keys.
        held: u64,
        /// The classes left draining.
        classes: Vec<String>,
    },
    /// Verification did not finish in time: still draining.
    VerificationIncomplete {
        /// The classes left draining.
        classes: Vec<String>,
    },
    /// A pending move was cancelled: the old map, the classes open again.
    Cancelled {
        /// The classes reopened.
        classes: Vec<String>,
    },
}

/// Where the keys of each class pair that `old` to `new` moves between lie on
/// different tiers of a split map in `maps`: one line per crossing, `prefix P
/// (or the default): class A (coord tier) to class B (entity tier)`. Empty when
/// every moved key keeps its cluster: both classes on one tier, or no map whose
/// entity keys live off its coord cluster.
pub fn tier_crossings(old: &ClassMapRecord, new: &ClassMapRecord, maps: &[ShardMap]) -> Vec<String> {
    let split: Vec<&ShardMap> =
        maps.iter().filter(|m| m.shards.iter().chain(m.overrides.values()).any(|c| *c != m.coord)).collect();
    let tier = |m: &ShardMap, class: &str| if m.coord_classes.contains(class) { "coord" } else { "entity" };
    let diff = old.map.iter().filter(|e| !new.map.contains(e)).chain(new.map.iter().filter(|e| !old.map.contains(e)));
    let mut pairs: Vec<(String, &str, &str)> =
        diff.map(|(prefix, _)| (format!("prefix {prefix:?}"), old.class_of(prefix), new.class_of(prefix))).collect();
    pairs.push(("keys no prefix covers".into(), old.default.as_str(), new.default.as_str()));
    let mut out: Vec<String> = Vec::new();
    for (what, a, b) in pairs {
        let Some(m) = split.iter().find(|m| a != b && tier(m, a) != tier(m, b)) else { continue };
        let line = format!("{what}: class {a} ({} tier) to class {b} ({} tier)", tier(m, a), tier(m, b));
        if !out.contains(&line) {
            out.push(line);
        }
    }
    out
}

// === impl Admin ===

impl Admin {
    /// The shard maps in force on this cluster: its home record's current and
    /// pending map and, on the coord cluster, the shard map's (none on a
    /// deployment that never ran split).
    async fn shard_maps(&self) -> Result<Vec<ShardMap>, AdminError> {
        let mut maps = Vec::new();
        let r = self.client.get(self.home.home_key(), None).await.map_err(etcd)?;
        if let Some(kv) = r.kvs().first() {
            let h: HomeRecord = serde_json::from_slice(kv.value()).map_err(etcd)?;
            maps.push(h.current);
            maps.extend(h.pending);
        }
        let r = self.client.get(self.home.map_key(), None).await.map_err(etcd)?;
        if let Some(kv) = r.kvs().first() {
            let m: MapRecord = serde_json::from_slice(kv.value()).map_err(etcd)?;
            maps.push(m.current);
            maps.extend(m.pending);
        }
        Ok(maps)
    }

    /// Refuses (nothing written) a change of `current` to `desired` that moves
    /// keys between tiers ([`tier_crossings`]).
    async fn refuse_tier_crossing(&self, current: &ClassMapRecord, desired: &ClassMapRecord) -> Result<(), AdminError> {
        use lockmesh_lock::test_faults::{on, TestFault};
        let crossings = tier_crossings(current, desired, &self.shard_maps().await?);
        if crossings.is_empty() || on(TestFault::SkipTierCheck) {
            return Ok(());
        }
        Err(AdminError::CrossTier(format!(
            "refused, nothing changed: this class map change gives keys a class of the other tier, which would move \
             them between the coord cluster and an entity shard outside the fenced move (no drain of the old \
             cluster, no epoch advance of the new one): {}. Put both classes on one tier first (lockctl shard apply \
             --tier CLASS=coord|entity, a fenced move), then apply the map",
            crossings.join("; ")
        )))
    }

    /// The authoritative map and its mod revision (`None`: not created yet).
    async fn read_map(&self) -> Result<Option<(ClassMapRecord, i64)>, AdminError> {
        let r = self.client.get(self.keys.class_map(), None).await.map_err(etcd)?;
        match r.kvs().first() {
            None => Ok(None),
            Some(kv) => Ok(Some((serde_json::from_slice(kv.value()).map_err(etcd)?, kv.mod_revision()))),
        }
    }

    /// Makes `reg`'s prefix map authoritative (steps 1 to 3 above), or with
    /// `cancel` reopens the classes a pending apply drained, keeping the old map.
    pub async fn apply_map(
        &self,
        reg: &ClassRegistry,
        reason: &str,
        verify_timeout: Duration,
        cancel: bool,
    ) -> Result<ApplyOutcome, AdminError> {
        let desired = ClassMapRecord::from_registry(reg, self.note("apply", reason));
        let Some((current, map_rev)) = self.read_map().await? else {
            let key = self.keys.class_map();
            let v = serde_json::to_vec(&desired).map_err(etcd)?;
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.as_str(), v, None)]);
            let r = self.client.txn(txn).await.map_err(etcd)?;
            return if r.succeeded() {
                Ok(ApplyOutcome::Applied { classes: vec![] })
            } else {
                Err(AdminError::Conflict("map".into()))
            };
        };
        if cancel {
            return self.cancel_move(reason).await;
        }
        self.refuse_tier_crossing(&current, &desired).await?;
        // Records of classes new in the registry (no key maps to them yet).
        for c in reg.classes() {
            self.create_policy(c.name.as_str(), c.max_holders).await?;
        }
        let involved = current.moved_classes(&desired);
        if involved.is_empty() && current.matches(reg) {
            return Ok(ApplyOutcome::Unchanged);
        }
        // Step 1: drain.
        let mut drained: Vec<(ClassPolicy, i64)> = Vec::new();
        for class in &involved {
            let (p, rev) = match self.read(class).await {
                Ok(r) => r,
                Err(AdminError::NoClass(_)) => continue, // never granted: nothing to drain
                Err(e) => return Err(e),
            };
            let n = p.begin_move(self.note("drain-move", reason)).map_err(AdminError::Refused)?;
            if n == p {
                drained.push((p, rev));
            } else {
                self.put_if(&n, rev).await?;
                drained.push(self.read(class).await?);
            }
        }
        let classes: Vec<String> = drained.iter().map(|(p, _)| p.class.clone()).collect();
        // Step 2: verify, after the drains committed.
        let held = match super::within(verify_timeout, self.held_moving(&current, &desired)).await {
            Some(r) => r?,
            None => return Ok(ApplyOutcome::VerificationIncomplete { classes }),
        };
        if held > 0 {
            return Ok(ApplyOutcome::Held { held, classes });
        }
        // Step 3: the new map and the reopened classes, in one transaction.
        let map_key = self.keys.class_map();
        let mut when = vec![Compare::mod_revision(map_key.as_str(), CompareOp::Equal, map_rev)];
        let mut then = vec![TxnOp::put(map_key.as_str(), serde_json::to_vec(&desired).map_err(etcd)?, None)];
        for (p, rev) in &drained {
            let key = self.keys.class_policy(&p.class);
            let n = p.finish_move(p.change_epoch, self.note("apply", reason)).map_err(AdminError::Refused)?;
            when.push(Compare::mod_revision(key.as_str(), CompareOp::Equal, *rev));
            then.push(TxnOp::put(key.as_str(), serde_json::to_vec(&n).map_err(etcd)?, None));
        }
        let r = self.client.txn(Txn::new().when(when).and_then(then)).await.map_err(etcd)?;
        if r.succeeded() {
            Ok(ApplyOutcome::Applied { classes })
        } else {
            Err(AdminError::Conflict("map".into()))
        }
    }

    /// Reopens every class drained by a pending apply (the map stays).
    async fn cancel_move(&self, reason: &str) -> Result<ApplyOutcome, AdminError> {
        let r = self
            .client
            .get(self.keys.class_policies(), Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .map_err(etcd)?;
        let mut classes = Vec::new();
        for kv in r.kvs() {
            let Ok(p) = serde_json::from_slice::<ClassPolicy>(kv.value()) else { continue };
            if p.pending_move {
                let n = p.finish_move(p.change_epoch, self.note("cancel-move", reason)).map_err(AdminError::Refused)?;
                self.put_if(&n, kv.mod_revision()).await?;
                classes.push(p.class);
            }
        }
        Ok(ApplyOutcome::Cancelled { classes })
    }

    /// Creates the record of `class` if it has none (first writer wins).
    async fn create_policy(&self, class: &str, limit: u32) -> Result<(), AdminError> {
        let key = self.keys.class_policy(class);
        let p = ClassPolicy::new(
            class,
            &format!("{class}/{}", lockmesh_lock::now_ms()),
            limit,
            self.note("create", "apply"),
        )
        .map_err(AdminError::Refused)?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), serde_json::to_vec(&p).map_err(etcd)?, None)]);
        self.client.txn(txn).await.map_err(etcd).map(|_| ())
    }

    /// Open holds on keys whose class differs between `old` and `new`.
    async fn held_moving(&self, old: &ClassMapRecord, new: &ClassMapRecord) -> Result<u64, AdminError> {
        let mut held = 0;
        self.scan_holds(|h, _| {
            if old.class_of(&h.key) != new.class_of(&h.key) {
                held += 1;
            }
        })
        .await?;
        Ok(held)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use lockmesh_core::policy::ChangeNote;

    use super::*;

    fn map(entries: &[(&str, &str)], default: &str) -> ClassMapRecord {
        ClassMapRecord {
            map: entries.iter().map(|(p, c)| ((*p).to_owned(), (*c).to_owned())).collect(),
            default: default.into(),
            last: ChangeNote { actor: "t".into(), reason: String::new(), at_ms: 0, action: "create".into() },
        }
    }

    #[test]
    fn the_classes_that_gain_or_lose_keys_are_drained() {
        let old = map(&[("payments/x/y", "c"), ("payments", "a")], "d");
        let set = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<BTreeSet<_>>();
        // A new longer prefix takes keys from the class covering it.
        let new = map(&[("payments/x/y", "c"), ("payments/x", "b"), ("payments", "a")], "d");
        assert_eq!(old.moved_classes(&new), set(&["a", "b"]));
        // A removed prefix hands its keys to the default.
        let new = map(&[("payments/x/y", "c")], "d");
        assert_eq!(old.moved_classes(&new), set(&["a", "d"]));
        // A prefix that changes class; a new default.
        let new = map(&[("payments/x/y", "e"), ("payments", "a")], "f");
        assert_eq!(old.moved_classes(&new), set(&["c", "e", "d", "f"]));
        assert!(old.moved_classes(&old).is_empty());
        // Every key whose class changes is in a drained class.
        for key in ["payments/x/y/1", "payments/x/1", "payments/1", "other/1"] {
            for new in [map(&[("payments/x", "b")], "d"), map(&[("payments/x/y", "c"), ("payments", "a")], "z")] {
                let moved = old.moved_classes(&new);
                if old.class_of(key) != new.class_of(key) {
                    assert!(moved.contains(old.class_of(key)) && moved.contains(new.class_of(key)), "{key}");
                }
            }
        }
    }

    #[test]
    fn a_change_of_tier_is_a_crossing_on_a_split_map_only() {
        let shard = |coord_classes: &[&str], shards: &[&str]| {
            let shards: Vec<String> = shards.iter().map(|s| (*s).to_owned()).collect();
            ShardMap::initial("coord", &shards, coord_classes.iter().map(|c| (*c).to_owned()))
        };
        let split = shard(&["leader"], &["shard-a", "shard-b"]);
        let old = map(&[("billing/elect", "leader"), ("payments", "a")], "default");
        // Within the entity tier, and a new prefix of a coord class carved out of
        // another coord class: every key keeps its cluster.
        let entity = map(&[("billing/elect", "leader"), ("payments/x", "b"), ("payments", "a")], "default");
        assert!(tier_crossings(&old, &entity, &[split.clone()]).is_empty());
        // A coord-tier prefix handed to an entity class, and an entity prefix to
        // the coord class; a default that changes tier.
        let to_entity = map(&[("payments", "a")], "default");
        assert_eq!(
            tier_crossings(&old, &to_entity, &[split.clone()]),
            ["prefix \"billing/elect\": class leader (coord tier) to class default (entity tier)"]
        );
        let to_coord = map(&[("billing/elect", "leader"), ("payments", "leader")], "default");
        assert_eq!(tier_crossings(&old, &to_coord, &[split.clone()]).len(), 1);
        let default_coord = map(&[("billing/elect", "leader"), ("payments", "a")], "leader");
        assert_eq!(
            tier_crossings(&old, &default_coord, &[split.clone()]),
            ["keys no prefix covers: class default (entity tier) to class leader (coord tier)"]
        );
        // One cluster backs both tiers (or no map at all): nothing changes cluster.
        assert!(tier_crossings(&old, &to_entity, &[shard(&["leader"], &["coord"])]).is_empty());
        assert!(tier_crossings(&old, &to_entity, &[]).is_empty());
        // A pending move that makes a class coord-tier counts too.
        assert_eq!(tier_crossings(&old, &entity, &[split.clone(), shard(&["leader", "b"], &["shard-a"])]).len(), 1);
    }
}
