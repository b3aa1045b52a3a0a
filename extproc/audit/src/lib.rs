//! The audit tailer (ADR-21): every grant, release, expiry, session close, force
//! release, limit change and epoch change, read from etcd's own history rather
//! than reported by the arbiters (which never see expiries). `docs/AUDIT.md`.
//!
//! # Layout
//! - [`event`]: the events and their replay-stable unique keys.
//! - [`decode`]: the changes of one revision to events (pure).
//! - [`store`]: the embedded store (redb) with the checkpoint.
//! - [`query`]: history of a key, holds by identity, longest holds, expiries.
//! - [`tailer`]: election, watch, checkpoints, gaps, restore detection, metrics port.
//! - [`reader`]: the store the queries are answered from (embedded or ClickHouse).
//! - [`query_port`]: the operators' query API on its own mTLS port (`query:`).
//! - [`stats`]: the tailer's metrics.
//! - [`archive`]: daily Parquet files of closed grants, and force-release records
//!   under object lock, in S3.
//! - [`clickhouse`]: the optional ClickHouse sink and its DDL.
//! - [`config`]: the configuration file, `audit.yaml`.
//! - [`test_faults`]: planted faults, in test builds only.
//! - [`cli`]: the `lockctl audit` queries.

pub mod archive;
pub mod clickhouse;
pub mod config;
pub mod decode;
pub mod event;
pub mod query;
pub mod query_port;
pub mod reader;
pub mod stats;
pub mod store;
pub mod tailer;
pub mod test_faults;

pub use self::{
    config::Config,
    event::{AuditEvent, EventKind},
};
