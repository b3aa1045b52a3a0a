//! Records the store's own history: an etcd watch on the run's root with previous
//! values, from revision 1, connected straight to the members (never through the
//! fault proxies). It resumes after member failures from the last revision seen;
//! a restore starts a new segment from the snapshot's revision. A compacted or
//! otherwise lost stretch is recorded as a gap, which fails the run.
//!
//! With more than one cluster a [`Ticker`] per cluster writes the real time into
//! the cluster every [`TICK_PERIOD`]: a commit after a tick happened after the
//! time the tick carries, which is what orders commits of different clusters
//! (`checker::homes`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Result};
use etcd_client::{Client, EventType, WatchOptions};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::history::{now_us, EtcdEvent, Segment};

/// The barrier key under the run's root; its value is the real time (unix µs)
/// read before it was written.
pub(crate) const BARRIER_KEY: &str = "gate/barrier";

/// The tick key under the run's root; its value is the real time (unix µs) read
/// before it was written.
pub(crate) const TICK_KEY: &str = "gate/tick";

/// How often a [`Ticker`] writes.
pub(crate) const TICK_PERIOD: Duration = Duration::from_millis(50);

#[derive(Default)]
struct RecState {
    segments: Vec<Segment>,
    last_rev: i64,
    gaps: Vec<String>,
}

/// The running watch.
pub struct Recorder {
    endpoints: Vec<String>,
    root: String,
    state: Arc<Mutex<RecState>>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recorder({})", self.root)
    }
}

// === impl Recorder ===

impl Recorder {
    /// Starts watching `root` (prefix) from revision 1.
    pub fn start(endpoints: Vec<String>, root: &str) -> Self {
        let state = Arc::new(Mutex::new(RecState { segments: vec![Segment::default()], ..RecState::default() }));
        let r = Self { endpoints, root: format!("{root}/"), state, task: Mutex::new(None) };
        r.spawn();
        r
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RecState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn spawn(&self) {
        let (endpoints, root, state) = (self.endpoints.clone(), self.root.clone(), self.state.clone());
        let task = tokio::spawn(async move {
            loop {
                if let Err(e) = follow(&endpoints, &root, &state).await {
                    tracing::debug!(error = %e, "gate recorder: watch interrupted; resuming");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        if let Some(old) = self.task.lock().unwrap_or_else(|p| p.into_inner()).replace(task) {
            old.abort();
        }
    }

    /// Stops following the store.
    pub fn stop(&self) {
        if let Some(t) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }

    /// After a restore to `base_revision` (with `--bump-revision` `bump`, 0 if
    /// none): a new segment, followed from above `base_revision + bump` (a bumped
    /// restore is marked compacted there).
    pub(crate) fn new_segment(&self, base_revision: i64, bump: i64) {
        self.stop();
        {
            let mut s = self.lock();
            s.segments.push(Segment { base_revision, bump, events: Vec::new() });
            s.last_rev = base_revision + bump;
        }
        self.spawn();
    }

    /// Writes a barrier key under the root and waits until the watch has seen it,
    /// so everything committed before the call is recorded.
    pub(crate) async fn barrier(&self, deadline: Duration) -> Result<i64> {
        let end = Instant::now() + deadline;
        let rev = loop {
            let attempt = async {
                let mut c = Client::connect(&self.endpoints, None).await?;
                let r = c.put(format!("{}{BARRIER_KEY}", self.root), now_us().to_string(), None).await?;
                Ok::<_, anyhow::Error>(r.header().map_or(0, |h| h.revision()))
            };
            match tokio::time::timeout(Duration::from_secs(3), attempt).await {
                Ok(Ok(rev)) => break rev,
                _ if Instant::now() >= end => bail!("gate recorder: the barrier could not be written"),
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        while self.lock().last_rev < rev {
            if Instant::now() >= end {
                bail!("gate recorder: the watch did not reach revision {rev}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(rev)
    }

    /// The segments and gaps recorded so far.
    pub fn take(&self) -> (Vec<Segment>, Vec<String>) {
        let s = self.lock();
        (s.segments.clone(), s.gaps.clone())
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Writes `<root>/gate/tick` = the real time read before the put, every
/// [`TICK_PERIOD`], straight to a cluster's members (never through the fault
/// proxies), until dropped. A tick that fails (a member down) is skipped.
pub struct Ticker(JoinHandle<()>);

impl std::fmt::Debug for Ticker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticker")
    }
}

// === impl Ticker ===

impl Ticker {
    /// Starts ticking into the cluster at `endpoints` under `root`.
    pub fn start(endpoints: Vec<String>, root: &str) -> Self {
        let key = format!("{root}/{TICK_KEY}");
        Self(tokio::spawn(async move {
            let mut client: Option<Client> = None;
            let mut every = tokio::time::interval(TICK_PERIOD);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let c = match client.as_mut() {
                    Some(c) => c,
                    None => match tokio::time::timeout(Duration::from_secs(1), Client::connect(&endpoints, None)).await
                    {
                        Ok(Ok(c)) => client.insert(c),
                        _ => continue,
                    },
                };
                // The value is read before the put is sent: the commit is later.
                let put = c.put(key.as_str(), now_us().to_string(), None);
                if !matches!(tokio::time::timeout(Duration::from_secs(1), put).await, Ok(Ok(_))) {
                    client = None;
                }
            }
        }))
    }

    /// Stops ticking.
    pub fn stop(&self) {
        self.0.abort();
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn follow(endpoints: &[String], root: &str, state: &Mutex<RecState>) -> Result<()> {
    let mut c = Client::connect(endpoints, None).await?;
    let from = state.lock().unwrap_or_else(|p| p.into_inner()).last_rev + 1;
    let opts = WatchOptions::new().with_prefix().with_prev_key().with_start_revision(from);
    let mut stream = c.watch(root, Some(opts)).await?;
    while let Some(resp) = stream.message().await? {
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        if resp.compact_revision() > 0 {
            let gap = format!("watch compacted at {} while following from {from}", resp.compact_revision());
            s.gaps.push(gap);
            bail!("compacted");
        }
        if resp.canceled() {
            bail!("watch cancelled: {}", resp.cancel_reason());
        }
        let observed_us = now_us();
        for e in resp.events() {
            let Some(kv) = e.kv() else { continue };
            if kv.mod_revision() <= s.last_rev {
                continue;
            }
            let prev = e.prev_kv();
            let ev = EtcdEvent {
                revision: kv.mod_revision(),
                put: e.event_type() == EventType::Put,
                key: String::from_utf8_lossy(kv.key()).into_owned(),
                value: String::from_utf8_lossy(kv.value()).into_owned(),
                create_revision: kv.create_revision(),
                lease: kv.lease(),
                prev_value: prev.map(|p| String::from_utf8_lossy(p.value()).into_owned()),
                prev_create_revision: prev.map(|p| p.create_revision()),
                observed_us,
            };
            if let Some(seg) = s.segments.last_mut() {
                seg.events.push(ev);
            }
        }
        // Only after the whole response: a txn's events arrive together.
        if let Some(max) = resp.events().iter().filter_map(|e| e.kv().map(|kv| kv.mod_revision())).max() {
            s.last_rev = s.last_rev.max(max);
        }
    }
    Ok(())
}
