//! Operator workflows as a library (`lockmesh-ops`): what `lockctl`, the arbiter's
//! admin port and the console do to a deployment beyond serving locks. No CLI
//! parsing here (that is `lockmesh-lockctl`) and nothing of the arbiter's server.
//!
//! # Layout
//! - [`admin`]: two-person force release and epoch advance (ADR-20 in
//!   docs/DECISIONS.md), operator tokens, and the least-privilege etcd roles.
//! - [`restore`]: the guarded epoch advance and restoring an etcd snapshot (ADR-03).
//! - [`reconcile`]: live limit changes and class map changes (drain, verify,
//!   activate; docs/CLASSES.md).
//! - [`inspect`]: a key's holders and waiters, saturated keys by digest.
//! - [`etcd_retry`]: etcd calls sent again when etcd refuses them because its
//!   users or roles changed under the login (nothing applied).
//! - [`etcd_view`]: the cluster's members, leader and health.
//! - [`pause`]: pause-test verdicts of fenced classes (ADR-17).
//! - [`audit_client`]: the audit tailer's query API, as a client.
#![forbid(unsafe_code)]

pub mod admin;
pub mod audit_client;
pub mod etcd_retry;
pub mod etcd_view;
pub mod inspect;
pub mod pause;
pub mod reconcile;
pub mod restore;
