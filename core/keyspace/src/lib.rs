//! The etcd key layout and the records stored under it, shared by every component
//! that reads or writes lockmesh's keyspace: the arbiter (`lockmesh-extproc` through
//! `lockmesh-lock`), the operator workflows (`lockmesh-ops`), the audit tailer
//! (`lockmesh-audit`) and the tests. Nothing here does I/O.
//!
//! # Layout
//! - [`keys`]: where each record lives ([`Keys`], [`prefix_end`]).
//! - [`records`]: sessions, holds and election values.
//! - [`markers`]: release and close markers, durable waiters.
//! - [`epoch`]: the epoch record (ADR-03 in docs/DECISIONS.md).
//! - [`classmap`]: the authoritative prefix-to-class map.
//! - [`home`]: shard maps and per-cluster home records (ADR-07, ADR-09).
//! - [`spool`]: unprotected grants of fail-open classes, as spooled and shipped (ADR-04).
//! - [`upgrade`]: the keyspace version, its capabilities and each arbiter's advertisement (issue #19).
#![forbid(unsafe_code)]

pub mod classmap;
pub mod epoch;
pub mod home;
pub mod keys;
pub mod markers;
pub mod records;
pub mod spool;
pub mod upgrade;

pub use self::{
    classmap::ClassMapRecord,
    epoch::{cluster_hex, EpochRecord, FIRST_EPOCH},
    home::{Admit, ExtensionRecord, HomeRecord, MapRecord, COORD_CLUSTER},
    keys::{prefix_end, Keys},
    markers::{CloseMarker, DelayGuard, LockDelayRecord, ReleaseMarker, ShadowDecision, ShadowRecord, WaiterRecord},
    records::{ElectionValue, HoldRecord, SessionRecord},
    spool::{SpoolOp, SpoolRecord},
};

/// Unix time in ms.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
