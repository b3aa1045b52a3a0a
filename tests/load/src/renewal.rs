//! Many holds on few sessions, kept alive through the lock tier: the machinery of
//! `lockmesh-load --renewal HOLDS:SESSIONS` (what renewing costs: [`run`]) and of
//! `--scale HOLDS:SESSIONS` (whether one etcd carries them for minutes without a
//! false expiry: [`super::scale`]).
//!
//! - [`Fleet::attach`] spreads HOLDS holds of distinct keys over SESSIONS sessions
//!   (hold `j` on session `j mod SESSIONS`), every request through Envoy, the Wasm
//!   filter and ext_proc to the arbiter, over [`CONNECTIONS`] HTTP/2 connections of
//!   one workload identity. A session is opened by its first acquire (no
//!   `x-lock-session`: the grant transaction writes the session record); its other
//!   holds attach with `x-lock-session`.
//! - A [`Renewer`] sends each session one `POST /v1/sessions/keepalive` per TTL/3,
//!   spread evenly over that interval (SESSIONS / (TTL/3) keepalives a second, never
//!   a burst), from the moment the session opens until it is stopped, through the
//!   same full path. It counts answers, `410 session_expired` refusals (a false
//!   expiry: nobody closes these sessions) and other failures, the longest gap
//!   between two acknowledged renewals of one session, and how late it sent.
//!
//! `--renewal` then reads etcd's own Prometheus counters over three renewal
//! intervals: `etcd_server_proposals_committed_total` (raft proposals: a keepalive
//! is not one) and `etcd_debugging_lease_renewed_total` (lease renewals etcd
//! served). Holds ride their session's lease, so renewal cost is per session, not
//! per hold.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use futures::{stream, StreamExt};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::etcdwork::{counter, metrics_text};
use super::lockmesh::{lock_tier_http, post};
use lockmesh_tests::client::REQUEST_TIMEOUT;
use lockmesh_tests::stack::Stack;

/// HTTP/2 connections to the lock tier (requests go round-robin over them, so
/// both Envoy workers get some).
pub(crate) const CONNECTIONS: usize = 8;
/// Keepalives in flight at most; when all are out, the renewer falls behind its
/// schedule (reported as lag).
const MAX_INFLIGHT: usize = 256;
/// Attaching stops starting acquires after this many failed.
const MAX_ATTACH_ERRORS: u64 = 100;
/// Attempts per hold while the lock tier answers `503 unavailable` (etcd slower
/// than the arbiter's operation timeout on a starved machine, say) or the request
/// fails in transport, one second apart. A retry is safe: with the session named
/// it returns the same grant (`existing: true`) if the first one committed; a
/// session the first attempt opened is revoked by the arbiter when it answers 503.
const ATTEMPTS: u32 = 5;
/// Pause before a retry.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

/// The lock tier as one workload identity (`load/<sa>`) over several connections.
#[derive(Clone)]
pub(crate) struct Tier {
    clients: Arc<Vec<reqwest::Client>>,
    base: String,
}

/// What a [`Fleet`] holds.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    /// Holds in all.
    pub holds: usize,
    /// Sessions carrying them.
    pub sessions: usize,
    /// Lock keys are `<key_prefix>/s<session>/k<n>` (the prefix picks the class).
    pub key_prefix: String,
    /// Acquires in flight while attaching.
    pub concurrency: usize,
    /// A progress line on stderr this often while attaching; `None`: quiet.
    pub progress: Option<Duration>,
    /// Sessions `0..starve` are never renewed, so they expire one TTL after they
    /// open: a planted fault showing that a false-expiry check can fail. 0 normally.
    pub starve: usize,
}

/// Sessions, filled in as they open, and what the renewer knows of each.
struct Sessions {
    ids: Vec<OnceLock<String>>,
    /// Milliseconds from `t0` to the last acknowledged renewal (or the open), plus
    /// one; 0: not open yet.
    last_ack_ms: Vec<AtomicU64>,
    /// Answered `session_expired` once: not renewed again.
    expired: Vec<AtomicBool>,
    /// Sessions `0..starve` are not renewed ([`FleetSpec::starve`]).
    starve: usize,
    t0: Instant,
}

/// Holds attached to sessions through the lock tier.
pub(crate) struct Fleet {
    tier: Tier,
    spec: FleetSpec,
    sessions: Arc<Sessions>,
    attached: Arc<AtomicU64>,
    /// Per hold: its grant's revision (the hold key's create revision); 0 until
    /// granted.
    granted: Vec<AtomicI64>,
    /// Acquires sent again after a 503 or a transport failure.
    retries: Arc<AtomicU64>,
}

/// What attaching took.
pub(crate) struct Attached {
    /// The sessions' TTL, seconds, as the lock tier answered.
    pub ttl_s: u64,
    /// Renewing every session since it opened; stop it when done.
    pub renewer: Renewer,
    /// Seconds from the first acquire to the last grant.
    pub secs: f64,
}

/// Keepalive counters (totals since the renewer started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenewCounts {
    /// Keepalives sent.
    pub sent: u64,
    /// Answered 200.
    pub ok: u64,
    /// Answered `410 session_expired`.
    pub expired: u64,
    /// Any other answer or a transport failure.
    pub errors: u64,
}

#[derive(Default)]
struct RenewStats {
    sent: AtomicU64,
    ok: AtomicU64,
    expired: AtomicU64,
    errors: AtomicU64,
    max_gap_ms: AtomicU64,
    max_lag_ms: AtomicU64,
    first_error: Mutex<Option<String>>,
}

/// Renews every open session once per TTL/3 in the background.
pub(crate) struct Renewer {
    stats: Arc<RenewStats>,
    inflight: Arc<Semaphore>,
    task: JoinHandle<()>,
}

/// What the `--renewal` window cost.
#[derive(Debug, Clone)]
pub struct RenewalReport {
    /// Holds attached.
    pub holds: usize,
    /// Sessions carrying them.
    pub sessions: usize,
    /// Session TTL, seconds.
    pub ttl_s: u64,
    /// Seconds spent attaching the holds.
    pub setup_s: f64,
    /// Renewal intervals measured.
    pub intervals: u32,
    /// Keepalives answered 200 during the window.
    pub keepalives: u64,
    /// Keepalives that failed during the window (any answer but 200).
    pub keepalive_failures: u64,
    /// Raft proposals committed during the window (etcd's counter).
    pub proposals: Option<u64>,
    /// Lease renewals etcd served during the window (etcd's counter).
    pub lease_renewals: Option<u64>,
    /// Holds still present at the end (must be all).
    pub holds_after: usize,
}

/// How many keys etcd has under `prefix`.
pub(crate) async fn count_prefix(etcd: &mut etcd_client::Client, prefix: String) -> Result<usize> {
    let opts = etcd_client::GetOptions::new().with_prefix().with_count_only();
    Ok(etcd.get(prefix, Some(opts)).await.context("count keys")?.count() as usize)
}

fn ms_since(t0: Instant) -> u64 {
    t0.elapsed().as_millis() as u64 + 1
}

// === impl Tier ===

impl Tier {
    /// `connections` connections to the stack's lock tier as `load/<sa>`.
    pub fn connect(st: &Stack, sa: &str, connections: usize) -> Result<Self> {
        let cert = st.pki().client("load", sa)?;
        let ca = st.pki().ca_cert_path();
        let port = st.envoy().listener_port();
        let clients = (0..connections.max(1))
            .map(|_| lock_tier_http(port, &ca, &cert.cert_path, &cert.key_path, false))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { clients: Arc::new(clients), base: format!("https://localhost:{port}") })
    }

    /// `POST path` on connection `i mod connections`: status and JSON body.
    async fn post(&self, i: usize, path: &str, headers: &[(&str, &str)]) -> Result<(u16, serde_json::Value)> {
        let http = &self.clients[i % self.clients.len()];
        let (status, _, json) = post(http, &format!("{}{path}", self.base), headers).await?;
        Ok((status.as_u16(), json))
    }
}

// === impl FleetSpec ===

impl FleetSpec {
    /// Checks the shape: at least one session and one hold per session.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.sessions > 0 && self.holds >= self.sessions,
            "HOLDS:SESSIONS needs HOLDS >= SESSIONS >= 1 (got {}:{})",
            self.holds,
            self.sessions
        );
        ensure!(self.concurrency >= 1, "attach concurrency: at least 1");
        ensure!(self.starve < self.sessions, "starve: fewer than all sessions");
        Ok(())
    }

    fn key(&self, hold: usize) -> String {
        format!("{}/s{}/k{}", self.key_prefix, hold % self.sessions, hold / self.sessions)
    }
}

// === impl Fleet ===

impl Fleet {
    /// A fleet of `spec` on `tier`; nothing is sent yet.
    pub fn new(tier: Tier, spec: FleetSpec) -> Result<Self> {
        spec.validate()?;
        let n = spec.sessions;
        let sessions = Sessions {
            ids: (0..n).map(|_| OnceLock::new()).collect(),
            last_ack_ms: (0..n).map(|_| AtomicU64::new(0)).collect(),
            expired: (0..n).map(|_| AtomicBool::new(false)).collect(),
            starve: spec.starve,
            t0: Instant::now(),
        };
        let granted = (0..spec.holds).map(|_| AtomicI64::new(0)).collect();
        Ok(Self {
            tier,
            spec,
            sessions: Arc::new(sessions),
            attached: Arc::new(AtomicU64::new(0)),
            granted,
            retries: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Acquires sent again so far (after a 503 or a transport failure).
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// The revisions of every grant answered 200 (each hold key's create revision).
    pub(crate) fn granted_revisions(&self) -> HashSet<i64> {
        self.granted.iter().map(|r| r.load(Ordering::Relaxed)).filter(|&r| r > 0).collect()
    }

    /// The sessions the lock tier opened for this fleet.
    pub(crate) fn session_ids(&self) -> HashSet<String> {
        self.sessions.ids.iter().filter_map(|s| s.get().cloned()).collect()
    }

    /// Holds granted so far.
    pub fn attached(&self) -> u64 {
        self.attached.load(Ordering::Relaxed)
    }

    /// Sessions opened so far.
    pub fn opened(&self) -> usize {
        self.sessions.ids.iter().filter(|s| s.get().is_some()).count()
    }

    /// Acquires hold `j` (the first hold of a session opens it), retrying a 503
    /// or a transport failure up to [`ATTEMPTS`] times; the grant's answer.
    async fn acquire(&self, j: usize) -> Result<serde_json::Value> {
        let s = j % self.spec.sessions;
        let key = self.spec.key(j);
        let sid = self.sessions.ids[s].get();
        if sid.is_none() && j >= self.spec.sessions {
            bail!("session s{s} is not open (its first acquire failed)");
        }
        let mut headers = vec![("x-lock-key", key.as_str())];
        if let Some(sid) = sid {
            headers.push(("x-lock-session", sid.as_str()));
        }
        let mut attempt = 1;
        let json = loop {
            let e = match self.tier.post(j, "/v1/locks/acquire", &headers).await {
                Ok((200, json)) => break json,
                Ok((status, json)) => {
                    let e = anyhow::anyhow!(
                        "acquire: {status} {}",
                        json["code"].as_str().unwrap_or("(no lockmesh error code)")
                    );
                    if status != 503 {
                        return Err(e);
                    }
                    e
                }
                Err(e) => e,
            };
            if attempt == ATTEMPTS {
                return Err(e.context(format!("after {ATTEMPTS} attempts")));
            }
            attempt += 1;
            self.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(RETRY_PAUSE).await;
        };
        let revision = json["revision"].as_i64().context("acquire: no revision in the answer")?;
        self.granted[j].store(revision, Ordering::Relaxed);
        if sid.is_none() {
            let sid = json["session"].as_str().context("acquire: no session in the answer")?;
            self.sessions.last_ack_ms[s].store(ms_since(self.sessions.t0), Ordering::Relaxed);
            let _ = self.sessions.ids[s].set(sid.to_owned());
        }
        self.attached.fetch_add(1, Ordering::Relaxed);
        Ok(json)
    }

    /// Attaches every hold: session 0 first (its answer gives the TTL), then the
    /// renewer starts, then the other sessions' first holds, then the rest. Fails
    /// if any acquire fails (after at most [`MAX_ATTACH_ERRORS`] failures), saying
    /// how far it got.
    pub async fn attach(&self) -> Result<Attached> {
        let start = Instant::now();
        let s0 = self.sessions.ids[0].get().is_none();
        ensure!(s0, "attach runs once");
        let json = self.acquire(0).await.context("first acquire")?;
        let ttl_s = json["ttl_s"].as_u64().context("first acquire: no ttl_s in the answer")?;
        let renewer = Renewer::start(self.tier.clone(), self.sessions.clone(), ttl_s);

        let progress = self.spec.progress.map(|every| {
            let (attached, sessions, stats, retries, total) = (
                self.attached.clone(),
                self.sessions.clone(),
                renewer.stats.clone(),
                self.retries.clone(),
                self.spec.holds,
            );
            tokio::spawn(async move {
                let mut last = 0;
                loop {
                    tokio::time::sleep(every).await;
                    let n = attached.load(Ordering::Relaxed);
                    let opened = sessions.ids.iter().filter(|s| s.get().is_some()).count();
                    let c = stats.counts();
                    eprintln!(
                        "[attach {:>6.0}s] holds {n:>7}/{total} (+{:.0}/s)  sessions {opened:>6}  retried {}  \
                         keepalives ok {} expired {} failed {}{}",
                        start.elapsed().as_secs_f64(),
                        (n - last) as f64 / every.as_secs_f64(),
                        retries.load(Ordering::Relaxed),
                        c.ok,
                        c.expired,
                        c.errors,
                        load_suffix()
                    );
                    last = n;
                }
            })
        });
        let errors = AtomicU64::new(0);
        let first_error = Mutex::new(None::<String>);
        let stop = AtomicBool::new(false);
        // Every session's first hold (holds 1..SESSIONS), then every other hold:
        // the first phase is over before the second starts, so a hold's session
        // is open when it is sent.
        let phases = [1..self.spec.sessions, self.spec.sessions..self.spec.holds];
        for jobs in phases {
            stream::iter(jobs)
                .take_while(|_| futures::future::ready(!stop.load(Ordering::Relaxed)))
                .for_each_concurrent(self.spec.concurrency, |j| {
                    let (errors, first_error, stop) = (&errors, &first_error, &stop);
                    async move {
                        if let Err(e) = self.acquire(j).await {
                            let n = errors.fetch_add(1, Ordering::Relaxed) + 1;
                            first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(format!("{e:#}"));
                            if n >= MAX_ATTACH_ERRORS {
                                stop.store(true, Ordering::Relaxed);
                            }
                        }
                    }
                })
                .await;
        }
        if let Some(p) = progress {
            p.abort();
        }
        let secs = start.elapsed().as_secs_f64();
        let failed = errors.load(Ordering::Relaxed);
        if failed > 0 {
            let first = first_error.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
            let keepalives = renewer.counts();
            renewer.stop().await;
            bail!(
                "attach: {} of {} holds attached ({} of {} sessions open) in {secs:.0} s; {failed} acquires failed, \
                 first: {first}; keepalives so far: {keepalives:?}",
                self.attached(),
                self.spec.holds,
                self.opened(),
                self.spec.sessions
            );
        }
        Ok(Attached { ttl_s, renewer, secs })
    }
}

/// `  load 3.10` (the 1-minute load average), or nothing.
pub(crate) fn load_suffix() -> String {
    super::cpu::load_average().map(|l| format!("  load {:.2}", l[0])).unwrap_or_default()
}

// === impl RenewStats ===

impl RenewStats {
    fn counts(&self) -> RenewCounts {
        RenewCounts {
            sent: self.sent.load(Ordering::Relaxed),
            ok: self.ok.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }

    fn failed(&self, what: String) {
        self.first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(what);
    }
}

// === impl RenewCounts ===

impl RenewCounts {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &RenewCounts) -> RenewCounts {
        RenewCounts {
            sent: self.sent - earlier.sent,
            ok: self.ok - earlier.ok,
            expired: self.expired - earlier.expired,
            errors: self.errors - earlier.errors,
        }
    }
}

// === impl Renewer ===

impl Renewer {
    /// Starts renewing: slot `k mod n` at `start + k * (TTL/3) / n`, skipping
    /// sessions not open yet and sessions that answered `session_expired`.
    fn start(tier: Tier, sessions: Arc<Sessions>, ttl_s: u64) -> Self {
        let stats = Arc::new(RenewStats::default());
        let inflight = Arc::new(Semaphore::new(MAX_INFLIGHT));
        let period = Duration::from_millis(ttl_s.max(1) * 1000 / 3);
        let task = {
            let (stats, inflight) = (stats.clone(), inflight.clone());
            tokio::spawn(async move {
                let n = sessions.ids.len() as u64;
                let start = Instant::now();
                for k in 0u64.. {
                    let due = start + period.mul_f64(k as f64 / n as f64);
                    tokio::time::sleep_until(due).await;
                    let Ok(permit) = inflight.clone().acquire_owned().await else { return };
                    let lag = Instant::now().saturating_duration_since(due).as_millis() as u64;
                    stats.max_lag_ms.fetch_max(lag, Ordering::Relaxed);
                    let slot = (k % n) as usize;
                    let Some(sid) = sessions.ids[slot].get().cloned() else { continue };
                    if slot < sessions.starve || sessions.expired[slot].load(Ordering::Relaxed) {
                        continue;
                    }
                    stats.sent.fetch_add(1, Ordering::Relaxed);
                    let (tier, sessions, stats) = (tier.clone(), sessions.clone(), stats.clone());
                    tokio::spawn(async move {
                        let _permit = permit;
                        let r = tier.post(slot, "/v1/sessions/keepalive", &[("x-lock-session", &sid)]).await;
                        match r {
                            Ok((200, _)) => {
                                stats.ok.fetch_add(1, Ordering::Relaxed);
                                let now = ms_since(sessions.t0);
                                let prev = sessions.last_ack_ms[slot].swap(now, Ordering::Relaxed);
                                if prev > 0 {
                                    stats.max_gap_ms.fetch_max(now.saturating_sub(prev), Ordering::Relaxed);
                                }
                            }
                            Ok((410, j)) if j["code"] == "session_expired" => {
                                stats.expired.fetch_add(1, Ordering::Relaxed);
                                sessions.expired[slot].store(true, Ordering::Relaxed);
                                stats.failed(format!("session s{slot}: keepalive answered 410 session_expired"));
                            }
                            Ok((status, j)) => {
                                stats.errors.fetch_add(1, Ordering::Relaxed);
                                let code = j["code"].as_str().unwrap_or("(no lockmesh error code)").to_owned();
                                stats.failed(format!("session s{slot}: keepalive answered {status} {code}"));
                            }
                            Err(e) => {
                                stats.errors.fetch_add(1, Ordering::Relaxed);
                                stats.failed(format!("session s{slot}: keepalive: {e:#}"));
                            }
                        }
                    });
                }
            })
        };
        Self { stats, inflight, task }
    }

    /// The counters so far.
    pub fn counts(&self) -> RenewCounts {
        self.stats.counts()
    }

    /// The longest gap between two acknowledged renewals of one session (or its
    /// open and its first renewal) since the last call, and resets it.
    pub(crate) fn take_max_gap(&self) -> Duration {
        Duration::from_millis(self.stats.max_gap_ms.swap(0, Ordering::Relaxed))
    }

    /// How late the renewer sent a keepalive at most, since the last call.
    pub(crate) fn take_max_lag(&self) -> Duration {
        Duration::from_millis(self.stats.max_lag_ms.swap(0, Ordering::Relaxed))
    }

    /// The first failure seen, if any.
    pub(crate) fn first_error(&self) -> Option<String> {
        self.stats.first_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stops sending and waits (up to the request timeout) for the keepalives in
    /// flight.
    pub async fn stop(self) {
        self.task.abort();
        let all = MAX_INFLIGHT as u32;
        let _ = tokio::time::timeout(REQUEST_TIMEOUT + Duration::from_secs(5), self.inflight.acquire_many(all)).await;
    }
}

impl Drop for Renewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs the `--renewal` measurement on its own stack (one etcd member, one arbiter,
/// the lock tier): attach, then three renewal intervals of TTL/3 with etcd's
/// counters read around them.
pub async fn run(holds: usize, sessions: usize, progress: bool) -> Result<RenewalReport> {
    let spec = FleetSpec {
        holds,
        sessions,
        key_prefix: "load/renewal".into(),
        concurrency: 32,
        progress: progress.then_some(Duration::from_secs(10)),
        starve: 0,
    };
    spec.validate().context("--renewal")?;
    // Plaintext whatever LOCKMESH_TEST_ETCD says, until the load tools are converted to
    // production's TLS + auth etcd (issue #16 item 2): they read etcd's counters from
    // its client port and connect without TLS or a user.
    let st = Stack::builder("renewal").envoy_config("lock-tier").plaintext_etcd().start().await?;
    let etcd_url = st.etcd().endpoints().first().cloned().context("etcd endpoint")?;
    let fleet = Fleet::new(Tier::connect(&st, "renewal", CONNECTIONS)?, spec)?;
    let Attached { ttl_s, renewer, secs: setup_s } = fleet.attach().await?;
    // The measured window: only renewals (and the arbiter's own 1 s seal check,
    // a read) reach etcd.
    let intervals = 3u32;
    let before = metrics_text(&etcd_url).await?;
    let c0 = renewer.counts();
    tokio::time::sleep(Duration::from_millis(ttl_s * 1000 / 3) * intervals).await;
    let c1 = renewer.counts();
    let after = metrics_text(&etcd_url).await?;
    renewer.stop().await;
    let window = c1.since(&c0);
    let delta = |m: &str| Some(counter(&after, m)?.saturating_sub(counter(&before, m)?));
    let mut etcd = st.etcd().client().await?;
    let holds_after = count_prefix(&mut etcd, format!("{}/l/", st.root())).await?;
    Ok(RenewalReport {
        holds,
        sessions,
        ttl_s,
        setup_s,
        intervals,
        keepalives: window.ok,
        keepalive_failures: window.expired + window.errors,
        proposals: delta("etcd_server_proposals_committed_total"),
        lease_renewals: delta("etcd_debugging_lease_renewed_total"),
        holds_after,
    })
}

/// Renders the report as the text summary.
pub fn render(r: &RenewalReport) -> String {
    let opt = |v: Option<u64>| v.map_or_else(|| "n/a".to_owned(), |v| v.to_string());
    format!(
        "renewal: {} holds on {} sessions (TTL {} s; attached in {:.0} s)\n\
         window: {} renewal intervals of TTL/3: {} keepalives answered ({:.1} per interval, spread over it), {} failed\n\
         etcd during the window: {} raft proposals committed, {} lease renewals served\n\
         holds still present after the window: {} of {}\n{}\n",
        r.holds,
        r.sessions,
        r.ttl_s,
        r.setup_s,
        r.intervals,
        r.keepalives,
        r.keepalives as f64 / f64::from(r.intervals),
        r.keepalive_failures,
        opt(r.proposals),
        opt(r.lease_renewals),
        r.holds_after,
        r.holds,
        goal(r)
    )
}

/// Issue #8's renewal goal: about one keepalive per session per interval (not per
/// hold), no raft proposal, every hold still there.
fn goal(r: &RenewalReport) -> String {
    let per_interval = r.keepalives as f64 / f64::from(r.intervals.max(1));
    let sessions = r.sessions as f64;
    let met =
        (0.9 * sessions..=1.1 * sessions).contains(&per_interval) && r.proposals == Some(0) && r.holds_after == r.holds;
    format!(
        "goal renewal: ~{} keepalives per interval for {} holds and 0 raft proposals: {per_interval:.1} per interval, {} proposals, {} of {} holds kept, {}",
        r.sessions,
        r.holds,
        r.proposals.map_or_else(|| "n/a".to_owned(), |p| p.to_string()),
        r.holds_after,
        r.holds,
        if met { "met" } else { "NOT met" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_holds_over_sessions_with_distinct_keys() {
        let spec =
            FleetSpec { holds: 7, sessions: 3, key_prefix: "load/x".into(), concurrency: 1, progress: None, starve: 0 };
        let keys: Vec<String> = (0..7).map(|j| spec.key(j)).collect();
        assert_eq!(keys[0], "load/x/s0/k0");
        assert_eq!(keys[3], "load/x/s0/k1");
        assert_eq!(keys[6], "load/x/s0/k2");
        assert_eq!(keys[5], "load/x/s2/k1");
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), 7);
        assert!(FleetSpec { holds: 2, ..spec.clone() }.validate().is_err());
        assert!(FleetSpec { sessions: 0, ..spec }.validate().is_err());
    }
}
