//! `lockmesh-load --scale HOLDS:SESSIONS`: as many held locks and sessions as one
//! etcd carries, kept for `--hold-minutes` with no false expiry (issue #8).
//!
//! The tool starts its own stack (one etcd member, one arbiter, the lock-tier Envoy)
//! whose registry is the test registry plus a class `scale` (prefix `load/scale`,
//! TTL `--ttl`, default 300 s: the platform's longest, so 40,000 sessions need
//! 400 keepalives a second). [`Fleet::attach`](super::renewal) attaches the holds
//! through the lock tier and renews every session once per TTL/3 through the full
//! path (client → Envoy → Wasm filter → ext_proc → arbiter → etcd) from the moment
//! it opens; then the holds are kept for the window, renewals still running.
//!
//! Nobody releases a hold or closes a session, so each of these is a **false
//! expiry**, and the run fails on any:
//! - a DELETE under the stack's holds (`<root>/l/`) or session records
//!   (`<root>/s/`), seen by an etcd watch (deletes only, filtered by etcd) opened
//!   before the first acquire: an expired lease deletes its keys;
//! - a keepalive answered `410 session_expired`;
//! - a hold or session record missing from etcd at the end.
//!
//! A watch that ends early fails the run too (nothing could be seen after it).
//!
//! Figures: attach time and rate; keepalives a second, the longest gap between two
//! acknowledged renewals of one session and how late the renewer ran; etcd's lease
//! renewals, raft proposals, revoked leases, keys and db size (its `/metrics`); RSS
//! (`VmRSS`) and peak (`VmHWM`) of etcd, Envoy, the arbiter and this tool before
//! attaching, at the window's start and at its end; CPU per process over the attach
//! and over the window; the load average.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context as _, Result};
use etcd_client::{EventType, GetOptions, WatchFilterType, WatchOptions};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::cpu::{self, Memory, Procs, Usage};
use super::etcdwork::{bucket, counter, metrics_text};
use super::renewal::{Attached, Fleet, FleetSpec, RenewCounts, Tier};
use lockmesh_tests::arbiter::DEFAULT_TEST_REGISTRY;
use lockmesh_tests::stack::Stack;

/// Shortest TTL `--scale` accepts (the platform allows advisory classes from 30 s
/// and others from 5 s; the test registry is advisory and lowers that to 2 s).
pub(crate) const MIN_TTL_S: u64 = 5;
/// Longest TTL (the platform's `max_ttl_s`).
pub const MAX_TTL_S: u64 = 300;
/// Longest hold window.
pub(crate) const MAX_HOLD: Duration = Duration::from_secs(3600);
/// Issue #8's scale goal: holds, sessions and how long they are kept.
pub(crate) const GOAL: (usize, usize, Duration) = (250_000, 40_000, Duration::from_secs(600));
/// Key prefix of the holds; the registry maps it to the class `scale`.
const KEY_PREFIX: &str = "load/scale";

/// What to run.
#[derive(Clone, Debug)]
pub struct ScaleOptions {
    /// Holds in all.
    pub holds: usize,
    /// Sessions carrying them.
    pub sessions: usize,
    /// How long to keep them after attaching.
    pub hold: Duration,
    /// TTL of the class `scale`, seconds.
    pub ttl_s: u64,
    /// Acquires in flight while attaching.
    pub attach_concurrency: usize,
    /// Envoy `--concurrency`.
    pub envoy_concurrency: u32,
    /// Top-level lines added to the arbiter's config.
    pub arbiter_yaml: Vec<String>,
    /// A progress line on stderr this often; `None`: quiet.
    pub progress: Option<Duration>,
    /// Sessions left unrenewed on purpose ([`FleetSpec::starve`]): a planted
    /// fault for the smoke test, which must then see them expire. 0 normally.
    pub starve: usize,
}

/// Counters from etcd's `/metrics` at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EtcdFigures {
    /// `etcd_debugging_lease_renewed_total`.
    pub lease_renewals: Option<u64>,
    /// `etcd_debugging_lease_revoked_total` (revoked or expired).
    pub leases_revoked: Option<u64>,
    /// `etcd_server_proposals_committed_total`.
    pub proposals: Option<u64>,
    /// `etcd_debugging_mvcc_keys_total`.
    pub keys: Option<u64>,
    /// `etcd_mvcc_db_total_size_in_bytes`.
    pub db_bytes: Option<u64>,
    /// `etcd_mvcc_db_total_size_in_use_in_bytes`.
    pub db_in_use_bytes: Option<u64>,
    /// WAL fsyncs (`etcd_disk_wal_fsync_duration_seconds_count`).
    pub fsyncs: Option<u64>,
    /// WAL fsyncs slower than 1.024 s (the histogram's count above that bucket): a
    /// disk shared with other work stalls etcd past the arbiter's 2 s timeout.
    pub slow_fsyncs: Option<u64>,
}

/// One delete of a hold or a session record, as the watch saw it.
#[derive(Clone, Debug)]
struct Deleted {
    key: Vec<u8>,
    /// The deleted key's create revision (`None`: etcd sent no previous value).
    created: Option<i64>,
    /// Seconds after attaching began.
    at_s: f64,
    /// The delete's revision.
    revision: i64,
}

/// Deletes the watch saw under the stack's root.
#[derive(Default)]
struct Deletes {
    /// Under `<root>/l/` and `<root>/s/`, classified at the end.
    seen: Mutex<Vec<Deleted>>,
    /// Their number so far (progress lines).
    count: AtomicU64,
    other: AtomicU64,
    ended: Mutex<Option<String>>,
}

/// Deletes seen, by kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeleteCounts {
    /// Holds the tool was granted (the deleted key's create revision is a grant's
    /// revision), or whose previous value etcd did not send: false expiries.
    pub holds: u64,
    /// Session records of sessions the tool was given: false expiries.
    pub sessions: u64,
    /// Holds and session records the tool was never given: an acquire answered
    /// 503 whose new session the arbiter revoked (informational).
    pub orphans: u64,
    /// Anything else under the root (informational).
    pub other: u64,
    /// The first false expiry: its time since attaching began, kind and revision.
    pub first: Option<String>,
    /// Why the watch ended before the run did, if it did.
    pub watch_ended: Option<String>,
}

/// Memory of etcd, Envoy, the arbiter and this tool at one instant.
pub type MemorySample = [Option<Memory>; 4];

/// What a `--scale` run measured.
#[derive(Clone, Debug)]
pub struct ScaleReport {
    /// When the hold window started (UTC, `YYYY-MM-DD HH:MM`).
    pub date: String,
    /// Holds attached.
    pub holds: usize,
    /// Sessions carrying them.
    pub sessions: usize,
    /// Sessions not renewed on purpose (a planted fault; 0 normally).
    pub starved: usize,
    /// Session TTL, seconds, as the lock tier answered.
    pub ttl_s: u64,
    /// Acquires in flight while attaching.
    pub attach_concurrency: usize,
    /// Seconds from the first acquire to the last grant.
    pub attach_s: f64,
    /// Acquires sent again after a `503` or a transport failure while attaching.
    pub attach_retries: u64,
    /// Seconds the holds were kept after attaching.
    pub window_s: f64,
    /// Keepalives while attaching.
    pub keepalives_attach: RenewCounts,
    /// Keepalives in the window.
    pub keepalives_window: RenewCounts,
    /// Longest gap between two acknowledged renewals of one session (or its open
    /// and its first renewal) while attaching.
    pub max_gap_attach: Duration,
    /// The same in the window.
    pub max_gap_window: Duration,
    /// How late the renewer sent a keepalive at most (whole run).
    pub max_lag: Duration,
    /// The first keepalive failure, if any.
    pub first_keepalive_error: Option<String>,
    /// Deletes under the root from the first acquire to the end.
    pub deletes: DeleteCounts,
    /// Holds in etcd at the end.
    pub holds_after: usize,
    /// Session records in etcd at the end.
    pub sessions_after: usize,
    /// etcd's counters before attaching, at the window's start and at its end.
    pub etcd: [EtcdFigures; 3],
    /// Memory before attaching, at the window's start and at its end.
    pub memory: [MemorySample; 3],
    /// CPU while attaching.
    pub cpu_attach: Usage,
    /// CPU in the window.
    pub cpu_window: Usage,
    /// Load averages before attaching, at the window's start and at its end.
    pub load: [Option<[f64; 3]>; 3],
}

// === impl ScaleOptions ===

impl Default for ScaleOptions {
    fn default() -> Self {
        Self {
            holds: 250_000,
            sessions: 40_000,
            hold: Duration::from_secs(600),
            ttl_s: MAX_TTL_S,
            attach_concurrency: 64,
            envoy_concurrency: 2,
            arbiter_yaml: Vec::new(),
            progress: Some(Duration::from_secs(10)),
            starve: 0,
        }
    }
}

impl ScaleOptions {
    /// Checks the bounds.
    pub fn validate(&self) -> Result<()> {
        self.fleet().validate()?;
        ensure!(
            (MIN_TTL_S..=MAX_TTL_S).contains(&self.ttl_s),
            "ttl: {} s must be in {MIN_TTL_S}..={MAX_TTL_S}",
            self.ttl_s
        );
        ensure!(!self.hold.is_zero() && self.hold <= MAX_HOLD, "hold: must be in (0, {} min]", MAX_HOLD.as_secs() / 60);
        Ok(())
    }

    fn fleet(&self) -> FleetSpec {
        FleetSpec {
            holds: self.holds,
            sessions: self.sessions,
            key_prefix: KEY_PREFIX.into(),
            concurrency: self.attach_concurrency,
            progress: self.progress,
            starve: self.starve,
        }
    }

    /// The test registry plus the class `scale`.
    fn registry(&self) -> String {
        format!(
            "{DEFAULT_TEST_REGISTRY}  - name: scale\n    prefixes: [\"{KEY_PREFIX}\"]\n    ttl_s: {}\n    \
             enforcement: advisory\n    risk_owner: lockmesh-tests\n    waiver_expiry: \"2099-12-31\"\n",
            self.ttl_s
        )
    }
}

// === impl EtcdFigures ===

impl EtcdFigures {
    fn parse(text: &str) -> Self {
        Self {
            lease_renewals: counter(text, "etcd_debugging_lease_renewed_total"),
            leases_revoked: counter(text, "etcd_debugging_lease_revoked_total"),
            proposals: counter(text, "etcd_server_proposals_committed_total"),
            keys: counter(text, "etcd_debugging_mvcc_keys_total"),
            db_bytes: counter(text, "etcd_mvcc_db_total_size_in_bytes"),
            db_in_use_bytes: counter(text, "etcd_mvcc_db_total_size_in_use_in_bytes"),
            fsyncs: counter(text, "etcd_disk_wal_fsync_duration_seconds_count"),
            slow_fsyncs: counter(text, "etcd_disk_wal_fsync_duration_seconds_count")
                .zip(bucket(text, "etcd_disk_wal_fsync_duration_seconds_bucket", "1.024"))
                .map(|(all, fast)| all.saturating_sub(fast)),
        }
    }

    async fn read(url: &str) -> Self {
        metrics_text(url).await.map(|t| Self::parse(&t)).unwrap_or_default()
    }
}

// === impl Deletes ===

impl Deletes {
    /// Holds and session records deleted so far, of any origin.
    fn seen(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Sorts every delete seen into false expiries (of a grant in `granted` or a
    /// session in `sessions`) and orphans.
    fn classify(&self, root: &str, granted: &HashSet<i64>, sessions: &HashSet<String>) -> DeleteCounts {
        let (holds_prefix, sessions_prefix) = (format!("{root}/l/"), format!("{root}/s/"));
        let mut c = DeleteCounts {
            other: self.other.load(Ordering::Relaxed),
            watch_ended: self.ended.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            ..DeleteCounts::default()
        };
        for d in self.seen.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let kind = if d.key.starts_with(holds_prefix.as_bytes()) {
                if d.created.is_some_and(|r| !granted.contains(&r)) {
                    c.orphans += 1;
                    continue;
                }
                c.holds += 1;
                "hold"
            } else {
                let sid = String::from_utf8_lossy(&d.key[sessions_prefix.len().min(d.key.len())..]).into_owned();
                if !sessions.contains(&sid) {
                    c.orphans += 1;
                    continue;
                }
                c.sessions += 1;
                "session record"
            };
            c.first.get_or_insert_with(|| {
                format!("a {kind} deleted {:.1} s after attaching began (revision {})", d.at_s, d.revision)
            });
        }
        c
    }
}

/// Watches every delete under `root` from `revision` on; counts them by kind.
async fn watch_deletes(st: &Stack, root: &str, revision: i64, t0: Instant) -> Result<(Arc<Deletes>, JoinHandle<()>)> {
    let mut client = st.etcd().client().await?;
    let opts = WatchOptions::new()
        .with_prefix()
        .with_filters([WatchFilterType::NoPut])
        .with_prev_key()
        .with_start_revision(revision);
    let mut stream = client.watch(format!("{root}/"), Some(opts)).await.context("open the delete watch")?;
    let deletes = Arc::new(Deletes::default());
    let (holds, sessions) = (format!("{root}/l/"), format!("{root}/s/"));
    let d = deletes.clone();
    let task = tokio::spawn(async move {
        let _client = client;
        let end = loop {
            match stream.message().await {
                Ok(Some(r)) if r.canceled() => break format!("watch cancelled: {}", r.cancel_reason()),
                Ok(Some(r)) => {
                    for ev in r.events().iter().filter(|e| e.event_type() == EventType::Delete) {
                        let key = ev.kv().map(|kv| kv.key()).unwrap_or_default();
                        if !key.starts_with(holds.as_bytes()) && !key.starts_with(sessions.as_bytes()) {
                            d.other.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        d.count.fetch_add(1, Ordering::Relaxed);
                        d.seen.lock().unwrap_or_else(|p| p.into_inner()).push(Deleted {
                            key: key.to_vec(),
                            created: ev.prev_kv().map(|kv| kv.create_revision()),
                            at_s: t0.elapsed().as_secs_f64(),
                            revision: ev.kv().map_or(0, |kv| kv.mod_revision()),
                        });
                    }
                }
                Ok(None) => break "watch stream ended".to_owned(),
                Err(e) => break format!("watch failed: {e}"),
            }
        };
        *d.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(end);
    });
    Ok((deletes, task))
}

/// Every key under `prefix` with its create revision, read in pages at one revision.
async fn scan(etcd: &mut etcd_client::Client, prefix: &str) -> Result<Vec<(Vec<u8>, i64)>> {
    const PAGE: i64 = 10_000;
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let mut from = prefix.as_bytes().to_vec();
    let mut at = 0;
    let mut out = Vec::new();
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_keys_only().with_limit(PAGE);
        if at > 0 {
            opts = opts.with_revision(at);
        }
        let r = etcd.get(from.clone(), Some(opts)).await.context("scan keys")?;
        if at == 0 {
            at = r.header().map_or(0, |h| h.revision());
        }
        out.extend(r.kvs().iter().map(|kv| (kv.key().to_vec(), kv.create_revision())));
        match r.kvs().last() {
            Some(kv) if r.more() => {
                from = kv.key().to_vec();
                from.push(0);
            }
            _ => return Ok(out),
        }
    }
}

/// Runs `opts` on a stack of its own.
pub async fn run(opts: &ScaleOptions) -> Result<ScaleReport> {
    opts.validate()?;
    let mut b = Stack::builder("scale")
        .envoy_config("lock-tier")
        .envoy_concurrency(opts.envoy_concurrency)
        // Plaintext until converted to TLS + auth (issue #16 item 2): counters come
        // from the client port, the clients connect without TLS or a user.
        .plaintext_etcd()
        .registry(opts.registry());
    for line in &opts.arbiter_yaml {
        b = b.arbiter_extra_yaml(line.clone());
    }
    let st = b.start().await.context(
        "start the stack (scripts/setup installs etcd and Envoy; build the arbiter and the Wasm filter first)",
    )?;
    let procs = Procs::of_stack(&st);
    let etcd_url = st.etcd().endpoints().first().cloned().context("etcd endpoint")?;
    let mut etcd = st.etcd().client().await?;
    let root = st.root().to_owned();
    let head = etcd.get(format!("{root}/"), Some(GetOptions::new().with_count_only())).await?;
    let revision = head.header().context("etcd answered without a header")?.revision();

    let fleet = Fleet::new(Tier::connect(&st, "scale", super::renewal::CONNECTIONS)?, opts.fleet())?;
    let t0 = Instant::now();
    let (deletes, watch) = watch_deletes(&st, &root, revision + 1, t0).await?;
    let (mem0, etcd0, load0, cpu0) =
        (procs.memory(), EtcdFigures::read(&etcd_url).await, cpu::load_average(), cpu::Sample::take(&procs));
    if opts.progress.is_some() {
        eprintln!(
            "[scale] attaching {} holds to {} sessions (class scale, TTL {} s), {} acquires in flight",
            opts.holds, opts.sessions, opts.ttl_s, opts.attach_concurrency
        );
    }
    let Attached { ttl_s, renewer, secs: attach_s } = fleet.attach().await?;
    ensure!(ttl_s == opts.ttl_s, "the lock tier answered TTL {ttl_s} s for class scale, not {} s", opts.ttl_s);

    let date = utc_now();
    let w0 = Instant::now();
    let (mem1, etcd1, load1, cpu1) =
        (procs.memory(), EtcdFigures::read(&etcd_url).await, cpu::load_average(), cpu::Sample::take(&procs));
    let k1 = renewer.counts();
    let max_gap_attach = renewer.take_max_gap();
    let mut max_gap_window = Duration::ZERO;
    let end = w0 + opts.hold;
    let every = opts.progress.unwrap_or(Duration::from_secs(10));
    let mut last = k1;
    while Instant::now() < end {
        tokio::time::sleep_until((Instant::now() + every).min(end)).await;
        let gap = renewer.take_max_gap();
        max_gap_window = max_gap_window.max(gap);
        let k = renewer.counts();
        if opts.progress.is_some() {
            let tick = k.since(&last);
            let mib = |m: Option<Memory>| m.map_or_else(|| "?".into(), |m| format!("{:.0}", m.rss_kib as f64 / 1024.0));
            let mem = procs.memory();
            eprintln!(
                "[hold {:>5.0}/{:.0}s] keepalives +{} ({:.0}/s) expired {} failed {}  gap max {:.1}s  deletes {}  \
                 RSS MiB etcd {} envoy {} arbiter {}{}",
                w0.elapsed().as_secs_f64(),
                opts.hold.as_secs_f64(),
                tick.ok,
                tick.ok as f64 / every.as_secs_f64(),
                k.expired,
                k.errors,
                gap.as_secs_f64(),
                deletes.seen(),
                mib(mem[0]),
                mib(mem[1]),
                mib(mem[2]),
                super::renewal::load_suffix()
            );
        }
        last = k;
    }
    let window_s = w0.elapsed().as_secs_f64();
    let k2 = renewer.counts();
    max_gap_window = max_gap_window.max(renewer.take_max_gap());
    let (mem2, etcd2, load2, cpu2) =
        (procs.memory(), EtcdFigures::read(&etcd_url).await, cpu::load_average(), cpu::Sample::take(&procs));
    // Present at the end: the holds whose create revision is a grant's, and the
    // records of the sessions the tool was given.
    let (granted, session_ids) = (fleet.granted_revisions(), fleet.session_ids());
    let holds_after = scan(&mut etcd, &format!("{root}/l/")).await?.iter().filter(|(_, r)| granted.contains(r)).count();
    let sessions_prefix = format!("{root}/s/");
    let sessions_after = scan(&mut etcd, &sessions_prefix)
        .await?
        .iter()
        .filter(|(k, _)| session_ids.contains(String::from_utf8_lossy(&k[sessions_prefix.len()..]).as_ref()))
        .count();
    let max_lag = renewer.take_max_lag();
    let first_keepalive_error = renewer.first_error();
    renewer.stop().await;
    // A delete committed just before the counts reaches the watch a moment later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let deletes = deletes.classify(&root, &granted, &session_ids);
    watch.abort();
    Ok(ScaleReport {
        date,
        holds: opts.holds,
        sessions: opts.sessions,
        starved: opts.starve,
        ttl_s,
        attach_concurrency: opts.attach_concurrency,
        attach_s,
        attach_retries: fleet.retries(),
        window_s,
        keepalives_attach: k1,
        keepalives_window: k2.since(&k1),
        max_gap_attach,
        max_gap_window,
        max_lag,
        first_keepalive_error,
        deletes,
        holds_after,
        sessions_after,
        etcd: [etcd0, etcd1, etcd2],
        memory: [mem0, mem1, mem2],
        cpu_attach: cpu1.since(&cpu0),
        cpu_window: cpu2.since(&cpu1),
        load: [load0, load1, load2],
    })
}

// === impl ScaleReport ===

impl ScaleReport {
    /// Holds lost: the larger of the hold deletes the watch saw and the holds
    /// missing at the end.
    pub fn holds_lost(&self) -> u64 {
        self.deletes.holds.max(self.holds.saturating_sub(self.holds_after) as u64)
    }

    /// Sessions lost: the largest of the session-record deletes the watch saw, the
    /// records missing at the end and the keepalives answered `session_expired`.
    pub fn sessions_lost(&self) -> u64 {
        let expired = self.keepalives_attach.expired + self.keepalives_window.expired;
        let missing = self.sessions.saturating_sub(self.sessions_after) as u64;
        self.deletes.sessions.max(missing).max(expired)
    }

    /// False expiries: holds and sessions lost (nobody released or closed any).
    pub(crate) fn false_expiries(&self) -> u64 {
        self.holds_lost() + self.sessions_lost()
    }

    /// No false expiry, and the watch saw the whole run.
    pub fn passed(&self) -> bool {
        self.false_expiries() == 0 && self.deletes.watch_ended.is_none()
    }

    /// The `goal scale:` line: issue #8's [`GOAL`] and whether this run met it (a
    /// smaller run never does, whatever it kept).
    pub fn goal(&self) -> String {
        let (holds, sessions, hold) = GOAL;
        // The window ends on a timer tick: allow a second of slack.
        let met = self.passed()
            && self.holds >= holds
            && self.sessions >= sessions
            && self.window_s + 1.0 >= hold.as_secs_f64();
        format!(
            "goal scale: {holds} holds on {sessions} sessions kept {} min with no false expiry: {} holds on {} \
             sessions kept {:.1} min, {} holds and {} sessions lost, {}",
            hold.as_secs() / 60,
            self.holds,
            self.sessions,
            self.window_s / 60.0,
            self.holds_lost(),
            self.sessions_lost(),
            if met { "met" } else { "NOT met" }
        )
    }

    /// The report: plain text lines ending with the verdict and the goal line
    /// (`scripts/bench` puts it in a fenced block of docs/BENCHMARKS.md).
    pub fn render(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "n/a".to_owned(), |v| v.to_string());
        let delta = |i: usize, j: usize, f: fn(&EtcdFigures) -> Option<u64>| {
            opt(f(&self.etcd[j]).zip(f(&self.etcd[i])).map(|(a, b)| a.saturating_sub(b)))
        };
        let mib = |b: Option<u64>| b.map_or_else(|| "n/a".to_owned(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
        let period = self.ttl_s as f64 / 3.0;
        let kw = &self.keepalives_window;
        let ka = &self.keepalives_attach;
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        line(format!(
            "scale: {} holds on {} sessions, kept {:.0} s after attaching (window from {} UTC)",
            self.holds, self.sessions, self.window_s, self.date
        ));
        line(format!(
            "renewals: class scale, TTL {} s, one keepalive per session every {period:.1} s spread evenly, through the \
             full path (client -> Envoy -> Wasm filter -> ext_proc -> arbiter -> etcd)",
            self.ttl_s
        ));
        line(format!(
            "attach: {} holds in {:.0} s = {:.0} holds/s through the lock tier ({} acquires in flight over {} HTTP/2 \
             connections; each session opened by its first acquire; {} acquires retried after a 503); keepalives \
             meanwhile: {} ok, {} expired, {} failed",
            self.holds,
            self.attach_s,
            self.holds as f64 / self.attach_s.max(1e-9),
            self.attach_concurrency,
            super::renewal::CONNECTIONS,
            self.attach_retries,
            ka.ok,
            ka.expired,
            ka.errors
        ));
        line(format!(
            "window: {} keepalives answered 200 = {:.1}/s (schedule {:.1}/s), {} session_expired, {} failed; longest \
             gap between one session's acknowledged renewals {:.1} s (while attaching {:.1} s) against TTL {} s; \
             renewer at most {} ms late",
            kw.ok,
            kw.ok as f64 / self.window_s.max(1e-9),
            self.sessions as f64 / period,
            kw.expired,
            kw.errors,
            self.max_gap_window.as_secs_f64(),
            self.max_gap_attach.as_secs_f64(),
            self.ttl_s,
            self.max_lag.as_millis()
        ));
        if let Some(e) = &self.first_keepalive_error {
            line(format!("first keepalive failure: {e}"));
        }
        let d = &self.deletes;
        if self.starved > 0 {
            line(format!("PLANTED FAULT: {} sessions never renewed, so they must expire", self.starved));
        }
        line(format!(
            "false expiries: {} holds and {} sessions lost (etcd watch from the first acquire: {} deletes of granted \
             holds, {} of the tool's session records, {} of holds and sessions never handed out (503s cleaned up), {} \
             other deletes under the root; keepalives answered session_expired: {}; at the end etcd has {} of {} \
             granted holds and {} of {} session records)",
            self.holds_lost(),
            self.sessions_lost(),
            d.holds,
            d.sessions,
            d.orphans,
            d.other,
            ka.expired + kw.expired,
            self.holds_after,
            self.holds,
            self.sessions_after,
            self.sessions
        ));
        if let Some(f) = &d.first {
            line(format!("first false expiry: {f}"));
        }
        if let Some(e) = &d.watch_ended {
            line(format!("WATCH ENDED EARLY: {e}"));
        }
        line(format!(
            "etcd in the window: {} lease renewals served, {} raft proposals committed, {} leases revoked, {} WAL \
             fsyncs ({} over 1 s); while attaching {} proposals, {} WAL fsyncs ({} over 1 s)",
            delta(1, 2, |e| e.lease_renewals),
            delta(1, 2, |e| e.proposals),
            delta(1, 2, |e| e.leases_revoked),
            delta(1, 2, |e| e.fsyncs),
            delta(1, 2, |e| e.slow_fsyncs),
            delta(0, 1, |e| e.proposals),
            delta(0, 1, |e| e.fsyncs),
            delta(0, 1, |e| e.slow_fsyncs),
        ));
        line(format!(
            "etcd keys {} at the end; db size {} before attaching, {} at the window's start, {} at its end ({} in use)",
            opt(self.etcd[2].keys),
            mib(self.etcd[0].db_bytes),
            mib(self.etcd[1].db_bytes),
            mib(self.etcd[2].db_bytes),
            mib(self.etcd[2].db_in_use_bytes),
        ));
        line("memory (MiB)  RSS before  RSS window start  RSS window end  peak (VmHWM)".into());
        let names = ["etcd", "envoy", "arbiter", "load tool"];
        let m = |s: Option<Memory>, peak: bool| {
            s.map_or_else(
                || "n/a".into(),
                |m| format!("{:.0}", (if peak { m.peak_kib } else { m.rss_kib }) as f64 / 1024.0),
            )
        };
        for (i, name) in names.iter().enumerate() {
            line(format!(
                "{name:<12}  {:>10}  {:>16}  {:>14}  {:>12}",
                m(self.memory[0][i], false),
                m(self.memory[1][i], false),
                m(self.memory[2][i], false),
                m(self.memory[2][i], true)
            ));
        }
        line("cpu (% of one core)  attach  window".into());
        let pct = |u: &Usage, v: Option<f64>| {
            v.map_or_else(|| "n/a".into(), |v| format!("{:.0}", 100.0 * v / u.secs.max(1e-9)))
        };
        let (a, w) = (&self.cpu_attach, &self.cpu_window);
        for (name, fa, fw) in [
            ("etcd", a.etcd, w.etcd),
            ("envoy", a.envoy, w.envoy),
            ("arbiter", a.arbiter, w.arbiter),
            ("load tool", a.load, w.load),
            ("other processes", a.other(), w.other()),
            ("machine (all cores)", a.machine, w.machine),
        ] {
            line(format!("{name:<19}  {:>6}  {:>6}", pct(a, fa), pct(w, fw)));
        }
        let la =
            |l: Option<[f64; 3]>| l.map_or_else(|| "n/a".into(), |l| format!("{:.2} {:.2} {:.2}", l[0], l[1], l[2]));
        line(format!(
            "load average ({} cores): {} before attaching, {} at the window's start, {} at its end",
            a.cores,
            la(self.load[0]),
            la(self.load[1]),
            la(self.load[2])
        ));
        line(if self.passed() {
            format!(
                "verdict: {} holds on {} sessions kept {:.0} s with no false expiry",
                self.holds, self.sessions, self.window_s
            )
        } else {
            format!("verdict: FAILED: {} holds and {} sessions lost", self.holds_lost(), self.sessions_lost())
        });
        line(self.goal());
        out
    }
}

/// Now, UTC, as `YYYY-MM-DD HH:MM`.
fn utc_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}", rem / 3600, rem % 3600 / 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_adds_a_scale_class_with_the_ttl() {
        let opts = ScaleOptions { ttl_s: 120, ..ScaleOptions::default() };
        let raw: lockmesh_core::class::RawRegistry = serde_saphyr::from_str(&opts.registry()).unwrap();
        let reg = lockmesh_core::ClassRegistry::try_from_raw(&raw).expect("a valid registry");
        let key = lockmesh_core::LockKey::parse(b"load/scale/s1/k2").unwrap();
        let class = reg.class_of(&key);
        assert_eq!((class.name.as_str(), class.ttl_s), ("scale", 120));
    }

    #[test]
    fn bounds_are_checked() {
        let ok = ScaleOptions { holds: 10, sessions: 2, ..ScaleOptions::default() };
        ok.validate().unwrap();
        assert!(ScaleOptions { ttl_s: 4, ..ok.clone() }.validate().is_err());
        assert!(ScaleOptions { ttl_s: 301, ..ok.clone() }.validate().is_err());
        assert!(ScaleOptions { hold: Duration::ZERO, ..ok.clone() }.validate().is_err());
        assert!(ScaleOptions { holds: 1, ..ok }.validate().is_err());
    }

    #[test]
    fn counts_slow_fsyncs_from_the_histogram() {
        let f = EtcdFigures::parse(
            "etcd_disk_wal_fsync_duration_seconds_bucket{le=\"1.024\"} 7\netcd_disk_wal_fsync_duration_seconds_count 9\n",
        );
        assert_eq!((f.fsyncs, f.slow_fsyncs), (Some(9), Some(2)));
    }

    #[test]
    fn formats_a_utc_date() {
        let s = utc_now();
        assert_eq!(s.len(), 16, "{s}");
        assert!(s.starts_with("20"), "{s}");
    }
}
