//! What `lockctl shard` prints (`extproc/src/shardctl.rs`; docs/SCALE.md): `show`
//! prints a [`ShardShow`], `apply` a [`MoveReport`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::opaque::Opaque;

/// What one `lockctl shard apply` did. Members in the order it prints them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveReport {
    /// `applied`, `resumed` or `unchanged`.
    pub outcome: String,
    /// The map version moved from.
    pub from: u64,
    /// The map version in force now.
    pub to: u64,
    /// Clusters that could lose keys.
    pub losers: Vec<String>,
    /// Clusters that could gain keys.
    pub gainers: Vec<String>,
    /// The epoch of each gainer after the move, by cluster name.
    pub epochs: BTreeMap<String, u64>,
    /// Per cluster, the etcd revision at which no hold of a leaving key remained.
    pub verified_at: BTreeMap<String, i64>,
    /// Time from the drain to verified, ms.
    pub drain_ms: u64,
    /// Time of the whole apply, ms.
    pub total_ms: u64,
}

/// `lockctl shard show`: the coord cluster's map document and every cluster's home
/// record and epoch. The record types are `lockmesh-keyspace`'s (`MapRecord`,
/// `HomeRecord`), which core cannot name: the producer fills `M` and `H` with them,
/// a reader without keyspace reads them as [`Opaque`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(serialize = "M: Serialize, H: Serialize", deserialize = "M: Deserialize<'de>, H: Deserialize<'de>"))]
pub struct ShardShow<M = Opaque, H = Opaque> {
    /// Every cluster of the arbiter config, by name.
    pub clusters: BTreeMap<String, ClusterHome<H>>,
    /// The coord cluster's map document, or `null` before the first apply.
    pub map: Option<M>,
}

/// One cluster in [`ShardShow`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(serialize = "H: Serialize", deserialize = "H: Deserialize<'de>"))]
pub struct ClusterHome<H = Opaque> {
    /// The cluster's current epoch, or `null` without an epoch record.
    pub epoch: Option<u64>,
    /// The cluster's home record, or `null` before the first apply.
    pub home: Option<H>,
    /// Earlier epochs whose holds may still be live (a move keeps them), or `null`
    /// without an epoch record.
    pub prior_epochs: Option<Vec<u64>>,
}
