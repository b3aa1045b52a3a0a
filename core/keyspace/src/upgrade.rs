//! The keyspace version and its capabilities (issue #19): what every component
//! must understand before it may read or write this root, and what each arbiter
//! says it understands.
//!
//! ```text
//! <root>/sys/keyspace              {"version":1,"enabled":[..],..}      no lease
//! <root>/sys/arbiters/<lease:016x> {"version":1,"capabilities":[..],..} the arbiter's advertisement lease
//! ```
//!
//! - The **record** ([`KeyspaceRecord`]) names the keyspace version and the enabled
//!   capabilities. A component that meets a version above its own, or an enabled
//!   capability it does not know, refuses to serve ([`refusal`]). An absent record is
//!   version [`KEYSPACE_VERSION`] 1 with nothing enabled: the layout every build
//!   before the record wrote.
//! - An **advertisement** ([`Advertisement`]) is what one running arbiter supports,
//!   on a lease it keeps alive: it vanishes with the arbiter. A capability is
//!   enabled only by a transaction that compares every advertisement unchanged since
//!   it was read, all of them supporting it (`lockmesh_lock::upgrade`).
//! - A capability gates **new record kinds**: nothing of a kind is written before
//!   its capability is enabled, so a build that lacks it never meets one. A key
//!   no earlier build reads needs no gate: the grant clock (`<root>/sys/clock`,
//!   `Keys::clock`) is written by every build that has it, and an earlier build
//!   neither reads nor lists it. While earlier builds still grant, only the grants
//!   of builds with the clock move it, so restore detection by the clock covers
//!   what those granted.
//!
//! Names are strings on the wire, so a record naming a capability a build has never
//! heard of still parses and is refused by name; both records tolerate unknown
//! fields (serde's default), so a later build may add some.

use serde::{Deserialize, Serialize};

use crate::Keys;

/// The keyspace version this build reads and writes. Version 1 is the layout of
/// `keys` (holds, sessions, markers, waiters, the epoch and class records).
pub const KEYSPACE_VERSION: u32 = 1;

/// A capability: one record kind that is written only once enabled. This build
/// knows these names and supports all of them (`lockmesh_lock::upgrade` can switch
/// one off to stand in for an older build).
///
/// The first three names were advertised by every build since the record existed,
/// before any of their kinds did: an arbiter that advertises them may lack the
/// kinds, so they gate nothing and stay only so that records and advertisements
/// naming them still read. Each kind written today has a name of its own, which
/// no earlier build advertises, so none can be enabled while such a build runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Capability {
    /// Reserved (gates nothing; see above).
    SharedHolds,
    /// Reserved (gates nothing; see above).
    Permits,
    /// Reserved (gates nothing; see above).
    LockDelay,
    /// Lock-delay guards and delay records (`<root>/g/`, `<root>/d/`).
    LockDelayGuards,
    /// Holds of more than one slot in one grant (k permits, an exclusive hold of a
    /// class that allows more than one holder).
    MultiSlotHolds,
    /// Exclusion records (`<root>/l/<digest>/w`) of exclusive holds.
    ExclusionRecords,
    /// The hold index of a session an acquire opened (`<root>/s/<sid>/h/`).
    SessionHoldIndex,
    /// Grant attempt fences (`<root>/s/<sid>/a/`).
    AttemptFences,
    /// Shadow-decision audit records (`<root>/w/<class>`).
    ShadowRecords,
}

impl Capability {
    /// Every capability this build knows.
    pub const ALL: [Capability; 9] = [
        Capability::SharedHolds,
        Capability::Permits,
        Capability::LockDelay,
        Capability::LockDelayGuards,
        Capability::MultiSlotHolds,
        Capability::ExclusionRecords,
        Capability::SessionHoldIndex,
        Capability::AttemptFences,
        Capability::ShadowRecords,
    ];

    /// The capabilities that gate a record kind (all but the reserved names).
    pub const GATED: [Capability; 6] = [
        Capability::LockDelayGuards,
        Capability::MultiSlotHolds,
        Capability::ExclusionRecords,
        Capability::SessionHoldIndex,
        Capability::AttemptFences,
        Capability::ShadowRecords,
    ];

    /// The wire name (`lockctl upgrade enable NAME`, the records, metric labels).
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::SharedHolds => "shared_holds",
            Capability::Permits => "permits",
            Capability::LockDelay => "lock_delay",
            Capability::LockDelayGuards => "lock_delay_guards",
            Capability::MultiSlotHolds => "multi_slot_holds",
            Capability::ExclusionRecords => "exclusion_records",
            Capability::SessionHoldIndex => "session_hold_index",
            Capability::AttemptFences => "attempt_fences",
            Capability::ShadowRecords => "shadow_records",
        }
    }

    /// The capability of a wire name, if this build knows it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// The key prefixes (under the root, without it) that hold this capability's
    /// kind, for `lockctl doctor` and `lockctl upgrade disable` to count what is
    /// left; empty for the reserved names and for multi-slot holds (their slots are
    /// ordinary hold keys; doctor reads the hold records for them).
    pub fn prefixes(self) -> &'static [&'static str] {
        match self {
            Capability::LockDelayGuards => &["/g/", "/d/"],
            Capability::ShadowRecords => &["/w/"],
            _ => &[],
        }
    }
}

/// `<root>/sys/keyspace`: the version and the enabled capabilities. Written only by
/// `lockctl upgrade enable` (a guarded transaction); never on a lease.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyspaceRecord {
    /// The keyspace version.
    pub version: u32,
    /// The enabled capabilities by wire name, sorted, no duplicates.
    #[serde(default)]
    pub enabled: Vec<String>,
    /// Who made the last change and why (free text for people reading the record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed_by: Option<String>,
    /// When, unix ms.
    #[serde(default)]
    pub changed_ms: u64,
}

impl KeyspaceRecord {
    /// The record an absent key stands for: version 1, nothing enabled.
    pub fn baseline() -> Self {
        Self { version: KEYSPACE_VERSION, ..Self::default() }
    }

    /// Whether `cap` is enabled.
    pub fn is_enabled(&self, cap: Capability) -> bool {
        self.enabled.iter().any(|e| e == cap.as_str())
    }
}

/// `<root>/sys/arbiters/<lease:016x>`: one running arbiter's support, on its own
/// lease (it goes with the arbiter).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Advertisement {
    /// The highest keyspace version it reads and writes.
    pub version: u32,
    /// The capabilities it supports, by wire name.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// Its build (crate version), for `lockctl upgrade status` and doctor.
    #[serde(default)]
    pub build: String,
    /// Its ext_proc listen address, to tell arbiters apart.
    #[serde(default)]
    pub listen: String,
    /// Start time, unix ms.
    #[serde(default)]
    pub started_ms: u64,
}

impl Advertisement {
    /// Whether it supports `name`.
    pub fn supports(&self, name: &str) -> bool {
        self.capabilities.iter().any(|c| c == name)
    }
}

/// Why a component refuses to serve a keyspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The record's version is above the component's.
    Version {
        /// The record's.
        found: u32,
        /// The component's.
        supported: u32,
    },
    /// An enabled capability the component does not support (or does not know).
    Capability(String),
    /// The record is not a keyspace record at all.
    Unreadable(String),
}

impl Refusal {
    /// A stable code for logs, `/status`, stderr and the metric label.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Version { .. } => "keyspace_version_unsupported",
            Refusal::Capability(_) => "keyspace_capability_unsupported",
            Refusal::Unreadable(_) => "keyspace_record_unreadable",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Version { found, supported } => write!(
                f,
                "{}: the keyspace is version {found}, this build reads version {supported} at most: upgrade it",
                self.code()
            ),
            Refusal::Capability(c) => write!(
                f,
                "{}: capability {c} is enabled in the keyspace record and this build does not support it: upgrade it",
                self.code()
            ),
            Refusal::Unreadable(e) => write!(f, "{}: the keyspace record is unreadable: {e}", self.code()),
        }
    }
}

/// Whether a component supporting `version` and `supported` may serve a keyspace
/// whose record is `record` (`None`: the key is absent, the baseline). `Some` is
/// the reason to refuse. (A record that does not parse is [`Refusal::Unreadable`],
/// decided by the caller, which owns the JSON decoding.)
pub fn refusal(record: Option<&KeyspaceRecord>, version: u32, supported: &[&str]) -> Option<Refusal> {
    let rec = record?;
    if rec.version > version {
        return Some(Refusal::Version { found: rec.version, supported: version });
    }
    rec.enabled.iter().find(|e| !supported.contains(&e.as_str())).map(|e| Refusal::Capability(e.clone()))
}

impl Keys {
    /// `<root>/sys/`, from the epoch record's key (`keys` keeps the root private).
    fn sys(&self) -> String {
        let epoch = self.epoch();
        epoch.strip_suffix("epoch").unwrap_or(&epoch).to_owned()
    }

    /// The keyspace record ([`KeyspaceRecord`]).
    pub fn keyspace(&self) -> String {
        format!("{}keyspace", self.sys())
    }

    /// The prefix of every arbiter's advertisement.
    pub fn advertisements(&self) -> String {
        format!("{}arbiters/", self.sys())
    }

    /// One arbiter's advertisement, named by its lease.
    pub fn advertisement(&self, lease: i64) -> String {
        format!("{}arbiters/{lease:016x}", self.sys())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(version: u32, enabled: &[&str]) -> KeyspaceRecord {
        KeyspaceRecord { version, enabled: enabled.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    #[test]
    fn a_build_refuses_a_newer_version_and_every_capability_it_lacks() {
        let all: Vec<&str> = Capability::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(refusal(None, 1, &[]), None, "an absent record is the baseline");
        assert_eq!(refusal(Some(&rec(1, &[])), 1, &[]), None);
        assert_eq!(refusal(Some(&rec(1, &["permits"])), 1, &all), None);
        assert_eq!(refusal(Some(&rec(2, &[])), 1, &all), Some(Refusal::Version { found: 2, supported: 1 }),);
        assert_eq!(
            refusal(Some(&rec(1, &["permits", "lock_delay"])), 1, &["permits"]),
            Some(Refusal::Capability("lock_delay".into()))
        );
        // A name no build of today knows is refused by name, not as unreadable.
        let r = refusal(Some(&rec(1, &["from_the_future"])), 1, &all).unwrap();
        assert_eq!(r.code(), "keyspace_capability_unsupported");
        assert!(r.to_string().contains("from_the_future"), "{r}");
        // Unknown fields are tolerated (a later build may add some).
        let later: KeyspaceRecord =
            serde_json::from_str(r#"{"version":1,"enabled":["permits"],"by_region":{"eu":true}}"#).unwrap();
        assert_eq!(refusal(Some(&later), 1, &all), None);
    }

    #[test]
    fn names_round_trip_and_keys_sit_under_sys() {
        for c in Capability::ALL {
            assert_eq!(Capability::parse(c.as_str()), Some(c));
        }
        assert_eq!(Capability::parse("nope"), None);
        let k = Keys::new("/t");
        assert_eq!(k.keyspace(), "/t/sys/keyspace");
        assert!(k.advertisement(0x2a).starts_with(&k.advertisements()));
        assert_eq!(k.advertisement(0x2a), "/t/sys/arbiters/000000000000002a");
        let ad: Advertisement = serde_json::from_str(r#"{"version":1,"capabilities":["permits"],"extra":1}"#).unwrap();
        assert!(ad.supports("permits") && !ad.supports("lock_delay"));
        assert!(KeyspaceRecord { enabled: vec!["permits".into()], ..KeyspaceRecord::baseline() }
            .is_enabled(Capability::Permits));
    }
}
