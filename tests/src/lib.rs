//! `lockmesh-tests`: the integration-test harness for lockmesh.
//!
//! It runs the real components as processes on loopback ports (etcd from the
//! pinned install, Envoy 1.40 with the built Wasm filter, the arbiter binary),
//! each with free ports, a temporary directory, a log file that is printed
//! when a test fails, and kill-on-drop. A missing binary fails the test with
//! the command that installs or builds it; nothing is skipped.
//!
//! # Layout
//!
//! - [`ports`]: free loopback ports, never handed out twice per binary.
//! - [`process`]: the supervised child process (signals, logs, readiness).
//! - [`certs`]: the dev PKI with SPIFFE identities ([`DevPki`]), from `lockmesh-devcerts`.
//! - [`etcd`]: [`EtcdCluster`] (1 or 3 members, restore) and [`shared_etcd`].
//! - [`envoy`]: [`EnvoyProcess`] from a shipped `envoy-config/*.yaml`.
//! - [`arbiter`]: [`ArbiterProcess`] (`lockmesh-extproc`).
//! - [`backend`]: [`Backend`], the recording upstream.
//! - [`fence`]: the grant signing key, [`fence::KvStore`] and [`fence::FenceProxyProcess`].
//! - [`demo_store`]: the quick start's key-value store behind fence-proxy (the
//!   `lockmesh-demo-store` binary that `scripts/up` runs).
//! - [`postgres`]: [`postgres::PostgresProcess`], a real PostgreSQL for the reference fence.
//! - [`s3`]: [`s3::MotoServer`], a real S3-compatible server (moto), and a tiny S3 client.
//! - [`client`]: [`LockClient`], an mTLS client per workload identity.
//! - [`kubelet`]: [`kubelet::SecretDir`], a directory updated as the kubelet updates a Secret volume.
//! - [`stack`]: [`Stack`], all of the above for one scenario.
//!
//! The scenarios themselves are in `tests/scenarios/` (one test binary). The
//! release gate is `lockmesh-gate` (`tests/gate/`), the load and benchmark tools
//! `lockmesh-load` (`tests/load/`), the dev PKI and token issuer
//! `lockmesh-devcerts` (`tests/devcerts/`).

// No `#![forbid(unsafe_code)]`: `process` needs one `allow` (pre_exec/kill);
// the workspace lint keeps `unsafe_code` denied everywhere else.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

pub mod arbiter;
pub mod backend;
pub mod clickhouse;
pub mod client;
pub mod demo_store;
pub mod envoy;
pub mod etcd;
pub mod fence;
pub mod kubelet;
pub mod latency;
pub mod paths;
pub mod ports;
pub mod postgres;
pub mod probe;
pub mod process;
pub mod s3;
pub mod stack;

pub use arbiter::{ArbiterBuilder, ArbiterProcess, DEFAULT_TEST_REGISTRY};
pub use backend::{Backend, RecordedRequest};
pub use client::{LockClient, Resp};
pub use envoy::{EnvoyBuilder, EnvoyProcess};
pub use etcd::{shared_etcd, EtcdBuilder, EtcdCluster, EtcdMember, EtcdUsers};
pub use lockmesh_devcerts::{self as certs, CertPair, ClientCert, DevPki, TEST_TRUST_DOMAIN};
pub use paths::repo_root;
pub use ports::free_port;
pub use stack::{Stack, StackBuilder};

/// How often [`eventually`] retries.
pub const EVENTUALLY_INTERVAL: Duration = Duration::from_millis(50);

/// Retries `check` every 50 ms until it returns `Ok`, and returns that value.
///
/// # Panics
///
/// After `deadline`, with the last error (a test assertion, by design).
pub async fn eventually<T>(deadline: Duration, mut check: impl AsyncFnMut() -> anyhow::Result<T>) -> T {
    let end = Instant::now() + deadline;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(e) if Instant::now() >= end => {
                panic!("condition not met within {deadline:?}: {e:#}")
            }
            Err(_) => tokio::time::sleep(EVENTUALLY_INTERVAL).await,
        }
    }
}

/// Like [`eventually`], but the check returns `bool`; the panic names `what`.
pub async fn eventually_true<F, Fut>(deadline: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + deadline;
    while !check().await {
        if Instant::now() >= end {
            panic!("{what}: not true within {deadline:?}");
        }
        tokio::time::sleep(EVENTUALLY_INTERVAL).await;
    }
}

/// `assert_eventually!(secs, async || -> anyhow::Result<T> { .. })`: awaits
/// [`eventually`] with a deadline in seconds (integer or float) and yields `T`.
///
/// ```no_run
/// # async fn demo(stack: &lockmesh_tests::Stack) {
/// lockmesh_tests::assert_eventually!(5, async || {
///     anyhow::ensure!(!stack.backend().requests().is_empty(), "no request yet");
///     Ok(())
/// });
/// # }
/// ```
#[macro_export]
macro_rules! assert_eventually {
    ($secs:expr, $check:expr $(,)?) => {
        $crate::eventually(::std::time::Duration::from_secs_f64($secs as f64), $check).await
    };
}

/// A unique etcd key prefix for one test: `/t/<name>-<8 hex digits>`.
pub fn unique_prefix(name: &str) -> String {
    format!("/t/{name}-{:08x}", rand::random::<u32>())
}

/// Installs a test-friendly tracing subscriber once (`RUST_LOG`, default
/// `info`); later calls do nothing.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
}
