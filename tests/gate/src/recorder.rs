//! Records the store's own history: an etcd watch on the run's root with previous
//! values, from revision 1, connected straight to the members (never through the
//! fault proxies) as a read-only user ([`EtcdLogin`]). It resumes after member failures from the last revision seen;
//! a restore starts a new segment from the snapshot's revision. A compacted or
//! otherwise lost stretch is recorded as a gap, which fails the run.
//!
//! With more than one cluster a [`Ticker`] per cluster writes the real time into
//! the cluster every [`TICK_PERIOD`]: a commit after a tick happened after the
//! time the tick carries, which is what orders commits of different clusters
//! (`checker::homes`).
//!
//! On production's etcd (client TLS, auth, the shipped roles: the gate's default)
//! each of them logs in as the narrowest user it needs: the watch as the shipped
//! read-only role `lockmesh-admin`, the barrier and the ticks as the gate's own
//! user, which may read and write `<root>/gate/` only ([`EtcdLogin::gate_marks`]).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use etcd_client::{Certificate, Client, ConnectOptions, EventType, Permission, TlsOptions, WatchOptions};
use lockmesh_tests::etcd::{EtcdCluster, EtcdUsers};
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

/// The prefix under the run's root that the gate itself writes (barrier, ticks,
/// the write-stall probe's put), and all its own etcd user may touch.
pub(crate) const GATE_KEYS: &str = "gate/";

/// How a gate part reaches one etcd cluster straight (never through the fault
/// proxies): the CA its members' certificates chain to, with client TLS, and the
/// user it logs in as, with auth. Both absent on a plaintext cluster.
#[derive(Clone, Default)]
pub struct EtcdLogin {
    /// The CA (PEM).
    ca: Option<Vec<u8>>,
    /// User and password.
    user: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdLogin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        write!(f, "EtcdLogin(tls: {}, user: {:?})", self.ca.is_some(), self.user.as_ref().map(|u| &u.0))
    }
}

// === impl EtcdLogin ===

impl EtcdLogin {
    /// TLS with the CA in file `ca` (if any), logged in as `user` (if any).
    pub fn new(ca: Option<&Path>, user: Option<(String, String)>) -> Result<Self> {
        let ca = ca.map(|p| std::fs::read(p).with_context(|| format!("read {}", p.display()))).transpose()?;
        Ok(Self { ca, user })
    }

    /// The user of shipped role `role` among `users` (`EtcdCluster::users_for`),
    /// with its cluster's CA; anonymous on a cluster without auth.
    pub fn role(users: &EtcdUsers, role: &str) -> Result<Self> {
        let user = if users.is_secure() {
            let file = users.password_file(role);
            let pw = std::fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))?;
            Some((users.user(role), pw.trim_end().to_owned()))
        } else {
            None
        };
        Self::new(users.ca(), user)
    }

    /// The gate's own user on `etcd` for key root `root`, made now with a role of
    /// its own that may read and write `<root>/gate/` and nothing else: the
    /// recorder's barrier, the clock ticks and the write-stall probe put there,
    /// which no shipped role may (each covers lockmesh's records, or the whole
    /// root). Made before any arbiter logs in: a change of users makes etcd
    /// refuse every older token once. Anonymous on a cluster without auth.
    pub async fn gate_marks(etcd: &EtcdCluster, root: &str) -> Result<Self> {
        let ca = etcd.tls().map(|t| t.ca.clone());
        if !etcd.is_secure() {
            return Self::new(ca.as_deref(), None);
        }
        let name = format!("lockmesh-gate-{:08x}", rand::random::<u32>());
        let password = format!("pw-gate-{:016x}", rand::random::<u64>());
        let mut c = etcd.client().await?;
        c.role_add(name.as_str()).await.with_context(|| format!("role add {name}"))?;
        let keys = Permission::read_write(format!("{root}/{GATE_KEYS}")).with_prefix();
        c.role_grant_permission(name.as_str(), keys).await.with_context(|| format!("grant {name}"))?;
        c.user_add(name.as_str(), password.as_str(), None).await.with_context(|| format!("user add {name}"))?;
        c.user_grant_role(name.as_str(), name.as_str()).await.with_context(|| format!("grant role {name}"))?;
        Self::new(ca.as_deref(), Some((name, password)))
    }

    /// The user it logs in as, if any.
    pub fn user(&self) -> Option<&str> {
        self.user.as_ref().map(|u| u.0.as_str())
    }

    /// A client of `endpoints` over TLS (with a CA) logged in (with a user); a
    /// token etcd forgot (a restarted or restored member) is fetched again.
    pub async fn connect(&self, endpoints: &[String]) -> Result<Client> {
        let mut opts = ConnectOptions::new();
        if let Some(ca) = &self.ca {
            opts = opts.with_tls(TlsOptions::new().ca_certificate(Certificate::from_pem(ca.clone())));
        }
        if let Some((user, password)) = &self.user {
            opts = opts.with_user(user.as_str(), password.as_str()).with_auto_token_refresh(true);
        }
        Client::connect(endpoints, Some(opts))
            .await
            .with_context(|| format!("connect to etcd {endpoints:?} as {self:?}"))
    }
}

#[derive(Default)]
struct RecState {
    segments: Vec<Segment>,
    last_rev: i64,
    gaps: Vec<String>,
}

/// The running watch.
pub struct Recorder {
    endpoints: Vec<String>,
    /// The watch's login (read-only).
    watch: EtcdLogin,
    /// The barrier's login ([`EtcdLogin::gate_marks`]).
    marks: EtcdLogin,
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
    /// Starts watching `root` (prefix) from revision 1, logged in as `watch`;
    /// barriers are written as `marks`.
    pub fn start(endpoints: Vec<String>, root: &str, watch: EtcdLogin, marks: EtcdLogin) -> Self {
        let state = Arc::new(Mutex::new(RecState { segments: vec![Segment::default()], ..RecState::default() }));
        let r = Self { endpoints, watch, marks, root: format!("{root}/"), state, task: Mutex::new(None) };
        r.spawn();
        r
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RecState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn spawn(&self) {
        let (endpoints, root, state) = (self.endpoints.clone(), self.root.clone(), self.state.clone());
        let login = self.watch.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Err(e) = follow(&login, &endpoints, &root, &state).await {
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
                let mut c = self.marks.connect(&self.endpoints).await?;
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
/// proxies, as the gate's own user: [`EtcdLogin::gate_marks`]), until dropped. A tick that fails (a member down) is skipped.
pub struct Ticker(JoinHandle<()>);

impl std::fmt::Debug for Ticker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticker")
    }
}

// === impl Ticker ===

impl Ticker {
    /// Starts ticking into the cluster at `endpoints` under `root`, logged in as `marks`.
    pub fn start(endpoints: Vec<String>, root: &str, marks: EtcdLogin) -> Self {
        let key = format!("{root}/{TICK_KEY}");
        Self(tokio::spawn(async move {
            let mut client: Option<Client> = None;
            let mut every = tokio::time::interval(TICK_PERIOD);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let c = match client.as_mut() {
                    Some(c) => c,
                    None => match tokio::time::timeout(Duration::from_secs(1), marks.connect(&endpoints)).await {
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

async fn follow(login: &EtcdLogin, endpoints: &[String], root: &str, state: &Mutex<RecState>) -> Result<()> {
    let mut c = login.connect(endpoints).await?;
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
