//! The authoritative prefix-to-class map (`<root>/sys/classmap`, docs/CLASSES.md).

use std::collections::BTreeSet;

use lockmesh_core::{key::covers, policy::ChangeNote, ClassRegistry};
use serde::{Deserialize, Serialize};

/// The authoritative prefix-to-class map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassMapRecord {
    /// `(prefix, class)`, longest prefix first.
    pub map: Vec<(String, String)>,
    /// The class of keys no prefix covers.
    pub default: String,
    /// Who wrote it, when and why.
    pub last: ChangeNote,
}

// === impl ClassMapRecord ===

impl ClassMapRecord {
    /// The map a registry desires.
    pub fn from_registry(reg: &ClassRegistry, note: ChangeNote) -> Self {
        let (map, default) = reg.prefix_map();
        Self { map, default, last: note }
    }

    /// The class of `key`: the longest covering prefix, else the default.
    pub fn class_of(&self, key: &str) -> &str {
        self.map.iter().find(|(p, _)| covers(p, key)).map_or(self.default.as_str(), |(_, c)| c.as_str())
    }

    /// True when `reg` desires exactly this map.
    pub fn matches(&self, reg: &ClassRegistry) -> bool {
        let (map, default) = reg.prefix_map();
        self.map == map && self.default == default
    }

    /// Every class that gains or loses a key between `self` and `new` (a
    /// superset is safe: it only drains more).
    pub fn moved_classes(&self, new: &ClassMapRecord) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let diff =
            self.map.iter().filter(|e| !new.map.contains(e)).chain(new.map.iter().filter(|e| !self.map.contains(e)));
        for (prefix, _) in diff {
            let (a, b) = (self.class_of(prefix), new.class_of(prefix));
            if a != b {
                out.insert(a.to_owned());
                out.insert(b.to_owned());
            }
        }
        if self.default != new.default {
            out.insert(self.default.clone());
            out.insert(new.default.clone());
        }
        out
    }
}
