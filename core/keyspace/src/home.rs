//! Shard maps and home records (ADR-07, ADR-09 in docs/DECISIONS.md; docs/SCALE.md):
//! the coord cluster's `<root>/sys/shardmap` and every cluster's `<root>/sys/home`.

use lockmesh_core::{policy::ChangeNote, shard::ShardMap};
use serde::{Deserialize, Serialize};

use crate::SessionRecord;

/// The name of the coord cluster, the `etcd:` section of the arbiter config (in a
/// deployment without `clusters:` it backs both tiers).
pub const COORD_CLUSTER: &str = "coord";

/// The coord cluster's shard map document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapRecord {
    /// The map arbiters route by.
    pub current: ShardMap,
    /// A change being applied (drained, not yet flipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<ShardMap>,
    /// The last transition.
    pub last: ChangeNote,
}

/// One cluster's home record: the maps grants on this cluster obey.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HomeRecord {
    /// The cluster's name; a config that calls these endpoints otherwise is refused.
    pub cluster: String,
    /// The map in force here.
    pub current: ShardMap,
    /// A change being applied: keys it moves are refused here until resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<ShardMap>,
    /// The last transition.
    pub last: ChangeNote,
}

/// What a home record says of one key on its cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Homed here under the current and the pending map: grants may commit.
    Here,
    /// Moving out of or into this cluster (a move is between drain and resume).
    Moving {
        /// The pending map's version.
        version: u64,
    },
    /// Homed on another cluster: the request must be routed there.
    Elsewhere,
}

/// The extension copy of a session record (with the cluster it was opened on).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExtensionRecord {
    /// The session record, as on its home.
    #[serde(flatten)]
    pub record: SessionRecord,
    /// The cluster the session was opened on; absent on the home itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home: Option<String>,
}

// === impl HomeRecord ===

impl HomeRecord {
    /// A record for `cluster` in force at `current` (and `pending`).
    pub fn new(cluster: &str, current: ShardMap, pending: Option<ShardMap>, last: ChangeNote) -> Self {
        Self { cluster: cluster.to_owned(), current, pending, last }
    }

    /// What this record says of `key` of `class` on its cluster.
    pub fn admits(&self, class: &str, key: &str) -> Admit {
        let me = Some(self.cluster.as_str());
        let now = self.current.home(class, key) == me;
        let then = self.pending.as_ref().map(|p| p.home(class, key) == me);
        match (now, then) {
            (true, None | Some(true)) => Admit::Here,
            (true, Some(false)) | (false, Some(true)) => {
                Admit::Moving { version: self.pending.as_ref().map_or(0, |p| p.version) }
            }
            (false, _) => Admit::Elsewhere,
        }
    }
}
