//! One client's cycle loop, the same for every workload.
//!
//! Until the window ends: note the request, acquire (bounded by the wait plus 5 s),
//! record the grant, release. Latencies count when the grant (acquire) or the
//! release's answer falls inside the window; a cycle counts when its release
//! answered inside the window. An error is counted, the client pauses 50 ms, and
//! after a failed release or a timed-out acquire its session or lease is replaced
//! so nothing it may still hold blocks the others.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tokio::time::Instant;

use super::engine::{Engine, Holder};
use super::lockmesh::LockmeshClient;
use super::record::Recorder;
use super::txn::{RawTxnClient, TxnShape};
use super::v3lock::EtcdLockClient;
use super::{LoadOptions, Plan, Target, Workload};

/// Pause after an error, so a failing client does not spin.
const ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Longest wait for a release's answer.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// A client of one workload (boxed: the clients differ much in size).
pub(crate) enum Worker {
    Lockmesh(Box<LockmeshClient>),
    EtcdLock(Box<EtcdLockClient>),
    RawTxn(Box<RawTxnClient>),
    /// An `engine` holder: the grant engine in this process (`crate::engine`).
    Engine(Box<Holder>),
}

/// What a client hands back when its loop ends.
pub(crate) struct Driven {
    pub worker: Worker,
    pub acquire_us: Vec<u32>,
    pub release_us: Vec<u32>,
}

// === impl Worker ===

impl Worker {
    /// Connects client `i` (and opens its session or lease); an `engine` holder
    /// opens its session on `engine`.
    pub async fn setup(
        w: Workload,
        target: &Target<'_>,
        i: usize,
        key: &str,
        opts: &LoadOptions,
        rec: Arc<Recorder>,
        engine: Option<Arc<Engine>>,
    ) -> Result<Self> {
        Ok(match w {
            Workload::Lockmesh | Workload::LockmeshOneShot => {
                let tier = target.lock_tier.as_ref().ok_or_else(|| anyhow::anyhow!("no lock tier"))?;
                let (cert, pem_key) = tier.identity(i)?;
                let session = w == Workload::Lockmesh;
                Worker::Lockmesh(Box::new(
                    LockmeshClient::connect(
                        tier.port,
                        &tier.ca,
                        (&cert, &pem_key),
                        opts.http1,
                        (key, session),
                        opts.wait_ms,
                        rec,
                    )
                    .await?,
                ))
            }
            Workload::EtcdLock => Worker::EtcdLock(Box::new(EtcdLockClient::connect(&target.etcd, rec).await?)),
            Workload::RawTxn | Workload::RawTxnMarker | Workload::RawTxnDesign => {
                let idle = format!("{}/.idle/{i}", target.etcd_prefix);
                let shape = match w {
                    Workload::RawTxnMarker => TxnShape::Marker,
                    Workload::RawTxnDesign => TxnShape::Design { root: format!("{}/.design", target.etcd_prefix), i },
                    _ => TxnShape::Plain,
                };
                Worker::RawTxn(Box::new(RawTxnClient::connect(&target.etcd, &idle, shape, rec).await?))
            }
            Workload::Engine => {
                let engine = engine.ok_or_else(|| anyhow::anyhow!("the engine workload without its engine"))?;
                Worker::Engine(Box::new(Holder::open(engine, i, key, opts.wait_ms, rec).await?))
            }
        })
    }

    /// The HTTP version the lock tier answered with (lockmesh only).
    pub fn http_version(&self) -> Option<String> {
        match self {
            Worker::Lockmesh(c) => Some(c.http_version().to_owned()),
            _ => None,
        }
    }

    async fn acquire(&mut self, key: &str) -> Result<u64> {
        match self {
            Worker::Lockmesh(c) => c.acquire(key).await,
            Worker::EtcdLock(c) => c.acquire(key).await,
            Worker::RawTxn(c) => c.acquire(key).await,
            Worker::Engine(h) => h.acquire().await,
        }
    }

    async fn release(&mut self, key: &str) -> Result<()> {
        match self {
            Worker::Lockmesh(c) => c.release(key).await,
            Worker::EtcdLock(c) => c.release().await,
            Worker::RawTxn(c) => c.release(key).await,
            Worker::Engine(h) => h.release().await,
        }
    }

    /// Replaces the session or lease (ending whatever it held).
    async fn reset(&mut self) -> Result<()> {
        match self {
            Worker::Lockmesh(c) => c.reset().await,
            Worker::EtcdLock(c) => c.reset().await,
            Worker::RawTxn(c) => c.reset().await,
            Worker::Engine(h) => h.reset().await,
        }
    }

    /// Closes the session or revokes the lease.
    pub async fn close(self) {
        match self {
            Worker::Lockmesh(c) => (*c).close().await,
            Worker::EtcdLock(c) => (*c).close().await,
            Worker::RawTxn(c) => (*c).close().await,
            Worker::Engine(h) => (*h).close().await,
        }
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Runs client `client` on key index `k` (`key`) until the plan's window ends.
pub(crate) async fn drive(
    mut w: Worker,
    plan: Plan,
    client: usize,
    k: usize,
    key: String,
    rec: Arc<Recorder>,
) -> Driven {
    let name = plan.workload.name();
    let acquire_timeout = Duration::from_millis(plan.wait_ms) + Duration::from_secs(5);
    let mut acquire_us = Vec::new();
    let mut release_us = Vec::new();
    // Open loop: starts spread over one period, then one per period.
    let mut next = plan.every.map(|e| Instant::now() + e.mul_f64((client % 64) as f64 / 64.0));
    while Instant::now() < plan.window.end {
        if let (Some(at), Some(every)) = (next.as_mut(), plan.every) {
            tokio::time::sleep_until(*at).await;
            *at = (*at + every).max(Instant::now());
        }
        // Zipf: each cycle draws its key (an engine holder keeps its own key:
        // its class and session are of that key).
        let (k, key) = match &plan.draw {
            Some(d) if !matches!(w, Worker::Engine(_)) => {
                let i = d.0.draw();
                (i, d.1[i].as_str())
            }
            _ => (k, key.as_str()),
        };
        let asked = Instant::now();
        rec.requested(k, client);
        let token = match tokio::time::timeout(acquire_timeout, w.acquire(key)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                rec.withdrawn(k, client);
                rec.error(&format!("{name} acquire"), &format!("{e:#}"));
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
            Err(_) => {
                rec.withdrawn(k, client);
                rec.error(&format!("{name} acquire"), "no answer in time");
                if let Err(e) = w.reset().await {
                    rec.error(&format!("{name} reset"), &format!("{e:#}"));
                }
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        let granted = Instant::now();
        rec.granted(k, client, token);
        if plan.window.contains(granted) {
            acquire_us.push(micros(granted - asked));
        }
        let r = tokio::time::timeout(RELEASE_TIMEOUT, w.release(key)).await;
        let done = Instant::now();
        match r {
            Ok(Ok(())) => {
                if plan.window.contains(done) {
                    release_us.push(micros(done - granted));
                    plan.cycles.fetch_add(1, Ordering::Relaxed);
                }
            }
            failed => {
                let msg = match failed {
                    Ok(Err(e)) => format!("{e:#}"),
                    _ => "no answer in time".into(),
                };
                rec.error(&format!("{name} release"), &msg);
                if let Err(e) = w.reset().await {
                    rec.error(&format!("{name} reset"), &format!("{e:#}"));
                }
                tokio::time::sleep(ERROR_PAUSE).await;
            }
        }
    }
    Driven { worker: w, acquire_us, release_us }
}
