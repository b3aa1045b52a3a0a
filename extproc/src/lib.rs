//! The lockmesh arbiter: an Envoy ext_proc gRPC service that answers the lock API
//! (`docs/API.md`) by granting locks in etcd and minting fencing tokens.
//!
//! The arbiter is the server only. What it serves is the lock recipe of
//! `lockmesh-lock`; operator workflows it runs for the admin port and the console
//! come from `lockmesh-ops`. An API request walks down: [`server`] (the ext_proc
//! stream) → [`api`] (route, authorise and classify) → `lockmesh_lock::tiers`
//! (choose the cluster) → `lockmesh_lock` (the recipe) → etcd.
//!
//! # Layout
//! - [`config`]: the YAML configuration and its validation.
//! - [`server`]: the ext_proc stream handling (the commit point is the answer to
//!   `request_headers`).
//! - [`api`]: routes of the HTTP API.
//! - [`transparent`]: request-scoped locks held for a request's life.
//! - [`internal`]: the filter's own calls (VM session renewal, releases).
//! - [`validate`]: ValidateToken, the linearizable "is this token current" read.
//! - [`registry`]: the class registry's hot reload, the LockGrant re-check, and the
//!   class part of `/status` and `/metrics`.
//! - [`respond`]: the one error-to-response table.
//! - [`signing`]: grant proofs for fences.
//! - [`cursor`]: election observers' sealed resume points.
//! - [`state`]: what every request handler shares.
//! - [`metrics`]: the arbiter's Prometheus metrics.
//! - [`admin`]: health, readiness and metrics on the admin port.
//! - [`admin_actions`]: two-person force release and epoch advance routes
//!   (`lockctl admin`; the workflow is `lockmesh_ops::admin`).
//! - [`console`]: the read-only web console on the admin port.
#![forbid(unsafe_code)]

pub mod admin;
pub mod admin_actions;
pub mod api;
pub mod config;
pub mod console;
pub mod cursor;
#[cfg(feature = "bench-floor")]
pub mod floor;
pub mod internal;
pub mod metrics;
pub mod registry;
pub mod respond;
pub mod server;
pub mod signing;
pub mod state;
pub mod transparent;
pub mod validate;

use std::{sync::Arc, time::Duration};

pub(crate) use lockmesh_lock::{self as lock, failopen, test_faults, tiers, topology};
pub(crate) use lockmesh_telemetry as telemetry;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tonic::transport::Server;

pub use self::config::Config;

/// Longest a client's TLS handshake on the gRPC port may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the arbiter on bound listeners until `shutdown` resolves.
pub async fn run(
    grpc: tokio::net::TcpListener,
    admin: tokio::net::TcpListener,
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // What this arbiter configures, shared by every cluster's store.
    let handoff = lock::wait::Handoff { on: config.handoff, grace: Duration::from_millis(config.handoff_grace_ms) };
    let runtime = lock::Runtime::new(handoff);
    let store = lock::Store::connect_with(
        &config.etcd_endpoints,
        &config.etcd_root,
        Duration::from_millis(config.op_timeout_ms),
        config.marks_file.as_deref(),
        &config.etcd_auth,
        &runtime,
    )
    .await?;
    // Every other cluster; names the clusters before any epoch record is created.
    let tiers = Arc::new(tiers::Tiers::connect(&config.tiers_config(), store.clone()).await?);
    crate::test_faults::install(&config.test_faults);
    if config.signing.is_none() {
        tracing::warn!("no signing key: grants carry no proof and fence-proxy will refuse their writes");
    }
    if config.marks_file.is_none() {
        tracing::warn!("no marks_file: restores are detected only while this arbiter runs, not across its restarts");
    }
    // Check the seal (and load or create the epoch record) before serving; a
    // checker repeats it every second so a restore is noticed without traffic.
    if let Err(e) = store.epoch().check_seal().await {
        tracing::warn!(error = %e, "etcd not reachable yet; every request fails closed until it is");
    }
    // Every other cluster's too (the seal rounds repeat them every second): its
    // marks are based before its first grant.
    for s in tiers.stores().skip(1) {
        if let Err(e) = s.epoch().check_seal().await {
            tracing::warn!(cluster = s.cluster_name(), error = %e, "etcd of this cluster not reachable yet; its requests fail closed until it is");
        }
    }
    // One seal round a second per cluster, each in its own task (a stalled
    // cluster's long round never delays another's): restores are noticed
    // without traffic, and the fail-open trigger (ADR-04) declares and ends a
    // quorum loss and ships the spool once the quorum is back.
    let checkers = tiers.spawn_seal_rounds({
        let coord = store.clone();
        move |s, r, took| {
            if std::ptr::eq(s, &*coord) {
                metrics::ETCD.observe(r.is_ok(), took);
            }
            if let Err(e) = r {
                tracing::debug!(cluster = s.cluster_name(), error = %e, "seal check could not reach etcd");
            }
        }
    });
    // mTLS with a client certificate required, re-read every `tls.reload_ms`: each
    // new handshake presents the current certificate and verifies the client with
    // the current bundle; established streams keep theirs (`lockmesh_runtime::certs`).
    let certs = lockmesh_runtime::ReloadingCerts::watch(config.tls_files.clone(), config.tls_reload)
        .map_err(|e| anyhow::anyhow!("tls: {e}"))?;
    let tls = certs.server_config(lockmesh_runtime::ClientAuth::Required, &[b"h2"]);
    let state = Arc::new(state::State::new(config, store).with_tiers(tiers));
    // The keyspace version and capabilities (issue #19, `lock::upgrade`): advertise
    // what this build supports, then seal if the record names what it lacks; again
    // every second while `state` lives.
    // The coord store first: it holds the record and the advertisements lockctl reads.
    let mut gated = vec![state.store.clone()];
    gated.extend(state.tiers.stores().filter(|s| !Arc::ptr_eq(s, &state.store)).cloned());
    let _upgrade = state.upgrade.clone().start(gated, state.config.listen.to_string()).await;
    // The quota ledgers (`lock::quota`): each cluster's sessions and holds by
    // namespace, listed once and followed by a watch.
    for s in state.tiers.stores() {
        s.start_ledger();
        // Lock-delay (`lock::delay`): a watch of hold deletes while a class sets one.
        s.lock_delay().start_watch();
    }
    // The authoritative class records (created from the registry if missing), and
    // the registry's hot reload.
    // With the shard map and every cluster's home record (`tiers`), retried every
    // second until it succeeds.
    if let Err(e) = state.tiers.bootstrap(&state.registry()).await {
        tracing::warn!(error = %e, "could not create the shard map, home or class policy records yet; retrying");
    }
    let tiers_task = tokio::spawn({
        let state = state.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                state.tiers.tick(&state.registry()).await;
            }
        }
    });
    let reloader = tokio::spawn(registry::watch(state.clone(), state.config.registry_file.clone()));
    // The console's plots: the arbiter's own figures, sampled into memory.
    let history = console::history::start(state.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let admin_task = tokio::spawn(admin::run(admin, state.clone(), {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.changed().await;
        }
    }));
    let svc = ExternalProcessorServer::new(server::Arbiter::new(state.clone()));
    // The filter's own calls share the port (and its mTLS) with ext_proc.
    // So do the two-person admin actions, for `operators.allowed_clients` only.
    let routes = tonic::service::Routes::new(svc)
        .into_axum_router()
        .merge(internal::router(state.clone()))
        .merge(admin_actions::router(state.clone()));
    tracing::info!(listen = %state.config.listen, admin = %state.config.admin_listen, "arbiter serving");
    Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .add_routes(tonic::service::Routes::from(routes))
        // TCP_NODELAY: an answer is several small writes on one stream; with Nagle
        // the last one waits for Envoy's delayed ACK (~40 ms per request).
        .serve_with_incoming_shutdown(lockmesh_runtime::tls_incoming(grpc, tls, HANDSHAKE_TIMEOUT, "grpc"), shutdown)
        .await?;
    let _ = stop_tx.send(true);
    for c in &checkers {
        c.abort();
    }
    tiers_task.abort();
    // The marks as they are now, not as the last once-a-second check left them:
    // a restart after a clean stop starts from every grant this process saw.
    let persist = !lock::test_faults::on(lock::test_faults::TestFault::NoPersistAtStop);
    for s in state.tiers.stores().filter(|_| persist) {
        if let Err(e) = s.seal().persist() {
            tracing::error!(cluster = s.cluster_name(), error = %e, "cannot persist the high-water marks at stop");
        }
    }
    reloader.abort();
    history.abort();
    let _ = admin_task.await;
    Ok(())
}
