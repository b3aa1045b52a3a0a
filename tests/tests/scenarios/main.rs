//! The one scenario test binary (one binary per STYLE §6: 2-core machines).
//!
//! Each module is a group of scenarios; they share the lazily started etcd
//! (`lockmesh_tests::shared_etcd`) and each uses its own key prefix.

// A test binary: assertions by unwrap are the point, helpers included.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod admin;
mod arbiter_direct;
mod audit;
mod audit_archive;
mod audit_clickhouse;
mod audit_query;
mod auth_churn;
mod bypass;
mod class_dir;
mod classes_min;
mod configs;
mod conformance;
mod console;
mod core_lock;
mod doctor;
mod durable;
mod edges_grant;
mod edges_vm;
mod edges_waiters;
mod election;
mod envoy_sds;
mod errors;
mod etcd_auth;
mod etcd_ca_roll;
mod fail_open;
mod fence_s3;
mod fence_smuggle;
mod fencing;
mod filter;
mod fleet;
mod gate;
mod gate_faults;
mod gate_ops;
mod gate_polyglot;
mod gate_tls;
mod group_commit;
mod handoff;
mod harness_selftest;
mod held_memo;
mod hold_waits;
mod holder_safety;
mod holds;
mod jeopardy;
mod limits;
mod load_smoke;
mod lock_delay;
mod multikey;
mod observability;
mod openapi;
mod otlp;
mod permits;
mod pg_fence;
mod quickstart;
mod quotas;
mod recipe_edges;
mod restore;
mod rotation;
mod rotation_stack;
mod runbooks;
mod scale;
mod sdk;
mod self_client;
mod semaphore;
mod shadow;
mod split_faults;
mod tenant_abuse;
mod tls_resumption;
mod transparent;
mod typed_keys;
mod upgrade;
mod watch_hub;

/// Held by the scenarios that race many clients (`multikey`, `permits`) and by
/// the planted restore scenarios of `gate`, whose bugs show only when a grant is
/// in flight across an epoch advance or lands in the seconds after a restore: on
/// two cores, a racing scenario beside them starves the holders of those
/// seconds, and the planted bug goes unseen (seen in full runs). They run one at
/// a time; the other scenarios still run beside each of them.
pub(crate) static CONTENDED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
