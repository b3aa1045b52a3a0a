//! Quota enforcement (issue #19; the quotas themselves: `lockmesh_core::quota`).
//!
//! Every acquire passes [`Quotas::admit`] before anything is written, and a session
//! opened on its own passes [`Quotas::admit_session`]: over a quota the answer is
//! `429 quota_exceeded` naming the quota, and nothing is granted or opened.
//!
//! # Counting, and how far off it can be
//!
//! No counter is written to etcd (a hot mutable key per namespace would serialise
//! every grant of the namespace, which ADR-15's one-write grant path refuses).
//! Instead:
//!
//! - **sessions, holds**: each arbiter keeps a [`Ledger`] per cluster: it lists
//!   `<root>/s/` and `<root>/l/` once (paged, at one revision) and follows both
//!   with a watch, so it knows every live session record and hold and the
//!   namespace each counts against (the hold record's key; the session record's
//!   `ns`). Its own grants and opens are entered at once, before their watch
//!   event. What it can miss is what *other* arbiters granted in the last watch
//!   delivery (milliseconds; while a watch is broken, until it is listed again),
//!   and its own acquires admitted together before any of them committed: so a
//!   namespace can overshoot its sessions or holds quota by at most its acquires
//!   in flight here (the `waiters` share) plus what the other arbiters admit for
//!   it in that window, which the acquire-rate quota bounds (`acquires_per_s` x
//!   the lag). The hard backstop is etcd's own
//!   backend quota, which `lockctl doctor` reports and the `LockmeshEtcdDbSize`
//!   alert watches.
//! - **waiters, acquire rate**: counted where they happen, at each arbiter (an
//!   acquire waiting or running; a token bucket). Each arbiter enforces its share,
//!   the quota divided by the live arbiters (the keyspace advertisements,
//!   `upgrade`), rounded up: exact per arbiter, and the cluster-wide figure is
//!   off only as far as Envoy's ring hash spreads a namespace's keys unevenly.
//!
//! A ledger that has never listed its cluster (etcd down since the arbiter
//! started) enforces neither sessions nor holds; the other two always apply.
//!
//! Cost: one paged list per cluster at start and after a broken watch, then one
//! watch event per session and hold change; memory about 100 bytes per live
//! session and hold (10^5 of each: about 20 MB per arbiter).
//!
//! # The oldest hold
//!
//! The same ledger keeps each hold's class and grant time (`acquired_ms`, the
//! granting arbiter's wall clock) in a per-(namespace, class) multiset, so
//! [`oldest_holds`] answers the age of the oldest open hold of every namespace and
//! class on every cluster without a read: what `lockmesh_arbiter_oldest_hold_seconds`
//! and the console show. It is fleet-wide (every arbiter follows every hold), so
//! every arbiter reports the same figure, off by its watch lag and by how far the
//! arbiters' wall clocks disagree (an age below 0 counts as 0). A hold this arbiter
//! granted is counted at once but aged from its watch event (milliseconds later).

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex, OnceLock, RwLock, Weak,
    },
    time::Duration,
};

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use lockmesh_core::{
    quota::{self as q, Limits, Quota, QuotaTable, UNSCOPED},
    ClassRegistry,
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge, MetricType},
    registry::Registry,
};
use tokio::time::Instant;

use super::{keys::prefix_end, HoldRecord, Keys, LockError, SessionRecord, Store};

/// Page size of a ledger's list.
const PAGE: i64 = 1000;
/// Rate buckets kept before the refilled ones are dropped (namespaces are bounded
/// by the grants; this bounds the memory whatever they say).
const MAX_BUCKETS: usize = 10_000;
/// The metrics label of every namespace the registry does not name.
const OTHER: &str = "other";

/// A refusal: which quota, and of which namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exceeded {
    /// The quota.
    pub quota: Quota,
    /// The namespace.
    pub namespace: String,
    /// Its use as counted.
    pub used: u64,
    /// The limit (for `waiters` and `acquire_rate`, this arbiter's share).
    pub limit: u64,
}

impl std::fmt::Display for Exceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Exceeded { quota, namespace, used, limit } = self;
        match quota {
            Quota::AcquireRate => write!(
                f,
                "namespace {namespace} is over its acquire_rate quota ({limit} acquires per second at this arbiter)"
            ),
            Quota::Waiters => write!(
                f,
                "namespace {namespace} is at its waiters quota ({used} of {limit} acquires waiting at this arbiter)"
            ),
            _ => write!(f, "namespace {namespace} is at its {quota} quota ({used} of {limit})"),
        }
    }
}

/// A token bucket: `rate` tokens a second, at most `rate` kept.
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// One arbiter's quota state ([`crate::runtime::Runtime::quotas`]): the table in
/// force, the live arbiters, and what is counted here (waiters, rate buckets,
/// refusals, every cluster's ledger).
pub struct Quotas {
    table: RwLock<Arc<QuotaTable>>,
    /// Class name to the one namespace of its prefixes (sessions with no `ns`).
    class_ns: RwLock<Arc<HashMap<String, String>>>,
    /// Namespaces the registry names (metrics labels).
    labels: RwLock<Arc<HashSet<String>>>,
    /// The lock metrics' labels (`lockmesh_telemetry::labels::lock_labels`): the
    /// namespaces of the registry's prefixes, and its classes.
    lock_labels: RwLock<Arc<LockLabelSet>>,
    arbiters: AtomicUsize,
    buckets: Mutex<HashMap<String, Bucket>>,
    waiting: Mutex<HashMap<String, u64>>,
    refusals: Mutex<HashMap<(String, Quota), u64>>,
    ledgers: Mutex<Vec<Weak<Ledger>>>,
}

impl Default for Quotas {
    fn default() -> Self {
        Self {
            table: RwLock::new(Arc::new(QuotaTable::default())),
            class_ns: RwLock::new(Arc::default()),
            labels: RwLock::new(Arc::default()),
            lock_labels: RwLock::new(Arc::default()),
            arbiters: AtomicUsize::new(1),
            buckets: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
            refusals: Mutex::new(HashMap::new()),
            ledgers: Mutex::new(Vec::new()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read<T: Clone>(m: &RwLock<T>) -> T {
    m.read().unwrap_or_else(|p| p.into_inner()).clone()
}

fn write<T>(m: &RwLock<T>, v: T) {
    *m.write().unwrap_or_else(|p| p.into_inner()) = v;
}

impl Quotas {
    /// Takes the quotas of a (re)loaded registry.
    pub fn set_registry(&self, reg: &ClassRegistry) {
        let class_ns = reg
            .classes()
            .iter()
            .filter_map(|c| reg.class_namespace(c.name.as_str()).map(|n| (c.name.to_string(), n.to_owned())))
            .collect();
        let mut labels: HashSet<String> = reg
            .classes()
            .iter()
            .flat_map(|c| c.prefixes.iter().map(|p| p.split('/').next().unwrap_or_default().to_owned()))
            .collect();
        let lock_labels = LockLabelSet::of(reg, &labels);
        labels.extend(reg.quotas().listed().map(|(n, _)| n.to_owned()));
        labels.insert(UNSCOPED.to_owned());
        write(&self.table, Arc::new(reg.quotas().clone()));
        write(&self.class_ns, Arc::new(class_ns));
        write(&self.labels, Arc::new(labels));
        write(&self.lock_labels, Arc::new(lock_labels));
    }
}

/// What the lock metrics may name: the namespaces of the registry's prefixes and
/// its classes (anything else is `other`), and the (namespace, class) pairs its
/// prefixes declare, whose hold and wait series start at 0.
#[derive(Debug, Default)]
pub struct LockLabelSet {
    namespaces: HashSet<String>,
    classes: HashSet<String>,
    pairs: Vec<(String, String)>,
}

impl LockLabelSet {
    fn of(reg: &ClassRegistry, namespaces: &HashSet<String>) -> Self {
        let mut pairs: Vec<(String, String)> = reg
            .classes()
            .iter()
            .flat_map(|c| {
                let name = c.name.to_string();
                let mut nss: Vec<String> =
                    c.prefixes.iter().map(|p| p.split('/').next().unwrap_or_default().to_owned()).collect();
                if nss.is_empty() {
                    // A class without prefixes (the default) takes keys of any
                    // namespace: its unnamed ones are `other`.
                    nss.push(OTHER.to_owned());
                }
                nss.into_iter().map(move |n| (n, name.clone()))
            })
            .collect();
        pairs.sort();
        pairs.dedup();
        Self {
            namespaces: namespaces.clone(),
            classes: reg.classes().iter().map(|c| c.name.to_string()).collect(),
            pairs,
        }
    }

    /// The labels of a key's namespace `ns` and class `class`.
    pub fn label(&self, ns: &str, class: &str) -> (String, String) {
        let ns = if self.namespaces.contains(ns) { ns } else { OTHER };
        let class = if self.classes.contains(class) { class } else { OTHER };
        (ns.to_owned(), class.to_owned())
    }

    /// The (namespace, class) label pairs the registry's prefixes declare.
    pub fn pairs(&self) -> &[(String, String)] {
        &self.pairs
    }
}

impl Quotas {
    /// The lock metrics' label set of the registry in force.
    pub fn lock_labels(&self) -> Arc<LockLabelSet> {
        read(&self.lock_labels)
    }

    /// The number of live arbiters (the keyspace advertisements), for the shares.
    pub fn set_arbiters(&self, n: usize) {
        self.arbiters.store(n.max(1), Ordering::Relaxed);
    }

    /// The table in force.
    pub fn table(&self) -> Arc<QuotaTable> {
        read(&self.table)
    }

    /// The metrics label of namespace `ns`: itself when the registry names it.
    pub fn label(&self, ns: &str) -> String {
        if read(&self.labels).contains(ns) {
            ns.to_owned()
        } else {
            OTHER.to_owned()
        }
    }

    /// The quota namespace of a session record.
    fn session_ns(&self, rec: &SessionRecord) -> String {
        match &rec.ns {
            Some(n) => n.clone(),
            None => read(&self.class_ns).get(&rec.class).cloned().unwrap_or_else(|| UNSCOPED.to_owned()),
        }
    }
}

/// An acquire admitted against the `waiters` quota; dropping it ends its count.
pub struct Admitted {
    ns: String,
    quotas: Arc<Quotas>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut w = lock(&self.quotas.waiting);
        if let Some(n) = w.get_mut(&self.ns) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                w.remove(&self.ns);
            }
        }
    }
}

impl Quotas {
    fn refuse(&self, e: Exceeded) -> LockError {
        *lock(&self.refusals).entry((self.label(&e.namespace), e.quota)).or_default() += 1;
        LockError::QuotaExceeded(e)
    }

    fn check_ledger(&self, ledger: &Ledger, ns: &str, limits: &Limits, quota: Quota) -> Result<(), LockError> {
        let Some(u) = ledger.use_of(ns) else { return Ok(()) };
        let used = match quota {
            Quota::Sessions => u.sessions,
            _ => u.holds,
        };
        let limit = limits.of(quota);
        if used >= limit {
            return Err(self.refuse(Exceeded { quota, namespace: ns.to_owned(), used, limit }));
        }
        Ok(())
    }

    /// Admits an acquire of a key in `ns` on `store`'s cluster, in this order: the
    /// acquire rate, the waiters, the sessions (when it opens one), the holds. The
    /// returned guard counts it as waiting until dropped.
    pub fn admit(self: &Arc<Self>, store: &Store, ns: &str, opens_session: bool) -> Result<Admitted, LockError> {
        let table = self.table();
        let limits = *table.limits(ns);
        let arbiters = self.arbiters.load(Ordering::Relaxed);
        if test_faults_skip() {
            return Ok(self.count_waiting(ns));
        }
        let rate = q::share(limits.acquires_per_s, arbiters);
        {
            let mut buckets = lock(&self.buckets);
            let now = Instant::now();
            if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(ns) {
                // A refilled bucket says nothing a new one would not: drop those.
                buckets.retain(|_, b| now.duration_since(b.at) < Duration::from_secs(1));
            }
            let b = buckets.entry(ns.to_owned()).or_insert(Bucket { tokens: rate as f64, at: now });
            b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate as f64).min(rate as f64);
            b.at = now;
            if b.tokens < 1.0 {
                drop(buckets);
                return Err(self.refuse(Exceeded {
                    quota: Quota::AcquireRate,
                    namespace: ns.to_owned(),
                    used: rate,
                    limit: rate,
                }));
            }
            b.tokens -= 1.0;
        }
        let waiters = q::share(limits.waiters, arbiters);
        let admitted = {
            let mut w = lock(&self.waiting);
            let used = w.get(ns).copied().unwrap_or(0);
            if used >= waiters {
                drop(w);
                return Err(self.refuse(Exceeded {
                    quota: Quota::Waiters,
                    namespace: ns.to_owned(),
                    used,
                    limit: waiters,
                }));
            }
            *w.entry(ns.to_owned()).or_default() += 1;
            Admitted { ns: ns.to_owned(), quotas: self.clone() }
        };
        // A refusal below drops `admitted`, which ends its count.
        if opens_session {
            self.check_ledger(store.ledger(), ns, &limits, Quota::Sessions)?;
        }
        self.check_ledger(store.ledger(), ns, &limits, Quota::Holds)?;
        Ok(admitted)
    }

    fn count_waiting(self: &Arc<Self>, ns: &str) -> Admitted {
        *lock(&self.waiting).entry(ns.to_owned()).or_default() += 1;
        Admitted { ns: ns.to_owned(), quotas: self.clone() }
    }

    /// Admits a session opened on its own (`POST /v1/sessions`) for `ns`.
    pub fn admit_session(&self, store: &Store, ns: &str) -> Result<(), LockError> {
        if test_faults_skip() {
            return Ok(());
        }
        let limits = *self.table().limits(ns);
        self.check_ledger(store.ledger(), ns, &limits, Quota::Sessions)
    }
}

fn test_faults_skip() -> bool {
    super::test_faults::on(super::test_faults::TestFault::SkipQuota)
}

// === Ledger ===

/// Sessions and holds of one namespace on one cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Use {
    /// Live session records.
    pub sessions: u64,
    /// Live holds.
    pub holds: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Session,
    Hold,
}

/// A hold's class and grant time, unix ms (from its record).
#[derive(Clone, Debug, PartialEq, Eq)]
struct HoldAge {
    class: String,
    acquired_ms: u64,
}

/// A listed or watched session or hold: the namespace it counts against and, for
/// a hold, its age.
struct Seen {
    kind: Kind,
    key: Vec<u8>,
    ns: String,
    age: Option<HoldAge>,
}

/// One followed key.
struct Entry {
    kind: Kind,
    ns: Arc<str>,
    /// A hold's class and grant time; `None` for a session, and for a hold this
    /// arbiter noted before its watch event.
    age: Option<(Arc<str>, u64)>,
}

/// The open holds of one namespace and class: how many, and their grant times.
#[derive(Default)]
struct Ages {
    holds: u64,
    /// Grant time (unix ms) to the holds granted then.
    acquired: std::collections::BTreeMap<u64, u32>,
}

#[derive(Default)]
struct LedgerState {
    /// Listed at least once.
    synced: bool,
    /// The last revision applied, per kind (the list's, then each event's).
    applied: [i64; 2],
    keys: HashMap<Vec<u8>, Entry>,
    by_ns: HashMap<Arc<str>, Use>,
    /// Aged holds by (namespace, class).
    ages: HashMap<(Arc<str>, Arc<str>), Ages>,
    /// Class names, shared by the holds of a class.
    classes: HashSet<Arc<str>>,
}

impl LedgerState {
    fn slot(kind: Kind) -> usize {
        match kind {
            Kind::Session => 0,
            Kind::Hold => 1,
        }
    }

    fn count(&mut self, kind: Kind, ns: &Arc<str>, up: bool) {
        let u = self.by_ns.entry(ns.clone()).or_default();
        let c = match kind {
            Kind::Session => &mut u.sessions,
            Kind::Hold => &mut u.holds,
        };
        *c = if up { *c + 1 } else { c.saturating_sub(1) };
        if *u == Use::default() {
            self.by_ns.remove(ns);
        }
    }

    fn class(&mut self, class: &str) -> Arc<str> {
        if let Some(c) = self.classes.get(class) {
            return c.clone();
        }
        let c: Arc<str> = Arc::from(class);
        self.classes.insert(c.clone());
        c
    }

    fn age(&mut self, ns: &Arc<str>, class: &Arc<str>, acquired_ms: u64, up: bool) {
        let pair = (ns.clone(), class.clone());
        let a = self.ages.entry(pair.clone()).or_default();
        if up {
            a.holds += 1;
            *a.acquired.entry(acquired_ms).or_default() += 1;
        } else {
            a.holds = a.holds.saturating_sub(1);
            if let Some(n) = a.acquired.get_mut(&acquired_ms) {
                *n -= 1;
                if *n == 0 {
                    a.acquired.remove(&acquired_ms);
                }
            }
            if a.holds == 0 {
                self.ages.remove(&pair);
            }
        }
    }

    fn put(&mut self, kind: Kind, key: &[u8], ns: &str, age: Option<HoldAge>) {
        if let Some(e) = self.keys.get(key) {
            // Noted by this arbiter before its watch event: the event brings the age.
            if let (None, Some(a)) = (&e.age, age) {
                let ns = e.ns.clone();
                let class = self.class(&a.class);
                self.age(&ns, &class, a.acquired_ms, true);
                if let Some(e) = self.keys.get_mut(key) {
                    e.age = Some((class, a.acquired_ms));
                }
            }
            return;
        }
        let ns: Arc<str> = Arc::from(ns);
        let age = age.map(|a| {
            let class = self.class(&a.class);
            self.age(&ns, &class, a.acquired_ms, true);
            (class, a.acquired_ms)
        });
        self.keys.insert(key.to_vec(), Entry { kind, ns: ns.clone(), age });
        self.count(kind, &ns, true);
    }

    fn delete(&mut self, key: &[u8]) {
        if let Some(e) = self.keys.remove(key) {
            self.count(e.kind, &e.ns, false);
            if let Some((class, acquired_ms)) = e.age {
                self.age(&e.ns, &class, acquired_ms, false);
            }
        }
    }
}

/// One cluster's sessions and holds by namespace, as this arbiter follows them.
#[derive(Default)]
pub struct Ledger {
    state: Mutex<LedgerState>,
    started: AtomicBool,
    cluster: Mutex<String>,
    /// The store it follows (set when it starts), whose waiters' book hears of
    /// this arbiter's grants.
    store: OnceLock<Weak<Store>>,
}

/// The namespace a listed or watched `kv` counts against, and a hold's age.
fn seen(quotas: &Quotas, kind: Kind, kv: &KeyValue) -> Option<Seen> {
    let (ns, age) = match kind {
        Kind::Hold => {
            let h: HoldRecord = serde_json::from_slice(kv.value()).ok()?;
            let ns = h.key.split('/').next()?.to_owned();
            (ns, Some(HoldAge { class: h.class, acquired_ms: h.acquired_ms }))
        }
        Kind::Session => {
            let r: SessionRecord = serde_json::from_slice(kv.value()).ok()?;
            (quotas.session_ns(&r), None)
        }
    };
    Some(Seen { kind, key: kv.key().to_vec(), ns, age })
}

impl Ledger {
    /// The use of `ns`, or `None` before the first list.
    pub fn use_of(&self, ns: &str) -> Option<Use> {
        let s = lock(&self.state);
        s.synced.then(|| s.by_ns.get(ns).copied().unwrap_or_default())
    }

    /// Whether the ledger has listed its cluster.
    pub fn synced(&self) -> bool {
        lock(&self.state).synced
    }

    /// Every namespace with a live session or hold.
    pub fn usage(&self) -> Vec<(String, Use)> {
        let s = lock(&self.state);
        let mut v: Vec<(String, Use)> = s.by_ns.iter().map(|(n, u)| (n.to_string(), *u)).collect();
        v.sort();
        v
    }

    /// Enters this arbiter's own write of `key` (created at `revision`) before its
    /// watch event arrives. Skipped when the watch has already gone past it (it
    /// then showed the put, or its delete).
    fn note(&self, kind: Kind, key: &[u8], revision: i64, ns: &str) {
        let mut s = lock(&self.state);
        if s.synced && revision > s.applied[LedgerState::slot(kind)] {
            s.put(kind, key, ns, None);
        }
    }

    /// Enters this arbiter's own grant of hold `key`, and tells the store's
    /// waiters' book (`wait`) that the key was granted here.
    pub(crate) fn note_hold(&self, key: &[u8], revision: i64, ns: &str) {
        if let Some(store) = self.store.get().and_then(Weak::upgrade) {
            store.queues().granted_hold(store.cluster().keys(), key);
        }
        self.note(Kind::Hold, key, revision, ns);
    }

    pub(crate) fn note_session(&self, key: &[u8], revision: i64, ns: &str) {
        self.note(Kind::Session, key, revision, ns);
    }

    fn replace(&self, listed: Vec<Seen>, revision: i64) {
        let mut s = LedgerState { synced: true, applied: [revision; 2], ..Default::default() };
        for e in listed {
            s.put(e.kind, &e.key, &e.ns, e.age);
        }
        *lock(&self.state) = s;
    }

    /// The oldest open hold of every namespace and class with one: `(namespace,
    /// class, holds, oldest grant time unix ms)`, raw names (not labels).
    pub fn oldest(&self) -> Vec<(String, String, u64, u64)> {
        let s = lock(&self.state);
        s.ages
            .iter()
            .filter_map(|((ns, class), a)| {
                let (t, _) = if super::test_faults::on(super::test_faults::TestFault::OldestHoldNewest) {
                    a.acquired.last_key_value()? // PLANTED BUG (tests only): the newest hold.
                } else {
                    a.acquired.first_key_value()?
                };
                Some((ns.to_string(), class.to_string(), a.holds, *t))
            })
            .collect()
    }

    fn apply(&self, quotas: &Quotas, kind: Kind, ev: &etcd_client::Event) {
        let Some(kv) = ev.kv() else { return };
        let mut s = lock(&self.state);
        let i = LedgerState::slot(kind);
        s.applied[i] = s.applied[i].max(kv.mod_revision());
        match ev.event_type() {
            EventType::Put => {
                if let Some(e) = seen(quotas, kind, kv) {
                    s.put(kind, &e.key, &e.ns, e.age);
                }
            }
            EventType::Delete => s.delete(kv.key()),
        }
    }
}

/// Lists every key under `prefix` at one revision, a page at a time, each page
/// within `timeout`: `(kvs, revision)`.
async fn list(
    client: &mut Client,
    prefix: &str,
    at: Option<i64>,
    timeout: Duration,
) -> Result<(Vec<KeyValue>, i64), String> {
    let end = prefix_end(prefix);
    let mut from = prefix.as_bytes().to_vec();
    let mut out = Vec::new();
    let mut revision = at.unwrap_or(0);
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
        if revision > 0 {
            opts = opts.with_revision(revision);
        }
        let r = tokio::time::timeout(timeout, client.get(from.clone(), Some(opts)))
            .await
            .map_err(|_| format!("etcd did not answer within {timeout:?}"))?
            .map_err(|e| e.to_string())?;
        if revision == 0 {
            revision = r.header().map_or(0, |h| h.revision());
        }
        let kvs = r.kvs();
        if let Some(last) = kvs.last() {
            from = [last.key(), b"\0"].concat();
        }
        out.extend_from_slice(kvs);
        if !r.more() || kvs.is_empty() {
            return Ok((out, revision));
        }
    }
}

/// Counts the sessions and holds of every namespace under `keys` with one paged
/// list at one revision (what a ledger starts from; `lockctl class cost`).
/// Sessions of earlier builds count by their class, as `quotas`' registry maps it.
pub async fn count(
    quotas: &Quotas,
    client: &mut Client,
    keys: &Keys,
    timeout: Duration,
) -> Result<(HashMap<String, Use>, i64), String> {
    let (listed, revision) = list_all(quotas, client, keys, timeout).await?;
    let mut s = LedgerState::default();
    for e in listed {
        s.put(e.kind, &e.key, &e.ns, None);
    }
    Ok((s.by_ns.into_iter().map(|(n, u)| (n.to_string(), u)).collect(), revision))
}

type Listed = Vec<Seen>;

async fn list_all(quotas: &Quotas, client: &mut Client, k: &Keys, timeout: Duration) -> Result<(Listed, i64), String> {
    let (sessions, revision) = list(client, &k.all_sessions(), None, timeout).await?;
    let (holds, _) = list(client, &k.all_locks(), Some(revision), timeout).await?;
    let mut out = Vec::with_capacity(sessions.len() + holds.len());
    for (kind, kvs) in [(Kind::Session, sessions), (Kind::Hold, holds)] {
        for kv in kvs {
            if kind == Kind::Hold && k.slot_of(kv.key()).is_none() {
                continue;
            }
            if let Some(e) = seen(quotas, kind, &kv) {
                out.push(e);
            }
        }
    }
    Ok((out, revision))
}

impl Store {
    /// This cluster's ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Starts following this cluster's sessions and holds (once; the arbiter calls
    /// it for every cluster it serves). The task ends with the store.
    pub fn start_ledger(self: &Arc<Self>) {
        if self.ledger.started.swap(true, Ordering::SeqCst) {
            return;
        }
        *lock(&self.ledger.cluster) = self.cluster_name().to_owned();
        let weak = Arc::downgrade(self);
        let _ = self.ledger.store.set(weak.clone());
        lock(&self.runtime().quotas().ledgers).push(Arc::downgrade(&self.ledger));
        tokio::spawn(async move {
            loop {
                let Some(store) = weak.upgrade() else { return };
                if let Err(e) = follow(&store).await {
                    tracing::debug!(error = %e, "the quota ledger lost its watch; listing again");
                }
                drop(store);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
}

/// Lists, then follows the watch until it breaks.
async fn follow(store: &Store) -> Result<(), LockError> {
    let quotas = store.runtime().quotas();
    let (listed, revision) =
        list_all(quotas, &mut store.cluster().client(), store.cluster().keys(), store.cluster().op_timeout())
            .await
            .map_err(LockError::Unavailable)?;
    store.ledger.replace(listed, revision);
    let k = store.cluster().keys();
    let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
    let mut client = store.cluster().client();
    let mut sessions = client.watch(k.all_sessions(), Some(opts.clone())).await.map_err(super::unavailable)?;
    let mut holds = client.watch(k.all_locks(), Some(opts)).await.map_err(super::unavailable)?;
    loop {
        let (kind, msg) = tokio::select! {
            m = sessions.message() => (Kind::Session, m),
            m = holds.message() => (Kind::Hold, m),
        };
        let r = match msg {
            Ok(Some(r)) => r,
            Ok(None) => return Err(LockError::Unavailable("the watch ended".into())),
            Err(e) => return Err(super::unavailable(e)),
        };
        if r.canceled() || r.compact_revision() > 0 {
            return Err(LockError::Unavailable("the watch was cancelled or compacted".into()));
        }
        for ev in r.events() {
            if kind == Kind::Hold && ev.kv().is_some_and(|kv| k.slot_of(kv.key()).is_none()) {
                continue;
            }
            if kind == Kind::Hold && ev.event_type() == EventType::Delete {
                // A grant noted for the next head (`wait::HeldBy`) that ended
                // without passing through here is forgotten.
                if let Some((d, kv)) = ev.kv().and_then(|kv| Some((k.digest_of_hold(kv.key())?, kv))) {
                    store.queues().forget_held_before(&d, kv.mod_revision());
                }
            }
            store.ledger.apply(quotas, kind, ev);
        }
    }
}

// === what the console, `/status` and the metrics show ===

/// One namespace's use against its quota on one cluster (the console's rows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceUse {
    /// The cluster.
    pub cluster: String,
    /// The namespace.
    pub namespace: String,
    /// Its use; `waiters` is this arbiter's.
    pub sessions: u64,
    /// Live holds.
    pub holds: u64,
    /// Acquires waiting or running at this arbiter.
    pub waiters: u64,
    /// The limits (cluster-wide).
    pub limits: Limits,
    /// This arbiter's share of `waiters` and `acquires_per_s`.
    pub waiters_share: u64,
    /// This arbiter's share of the acquire rate.
    pub rate_share: u64,
}

impl Quotas {
    /// Every namespace with a session, a hold or a waiter, or listed in the table.
    pub fn usage(&self) -> Vec<NamespaceUse> {
        let table = self.table();
        let arbiters = self.arbiters.load(Ordering::Relaxed);
        let waiting = lock(&self.waiting).clone();
        let ledgers: Vec<Arc<Ledger>> = lock(&self.ledgers).iter().filter_map(Weak::upgrade).collect();
        let mut out = Vec::new();
        for l in &ledgers {
            let cluster = lock(&l.cluster).clone();
            let mut seen: HashMap<String, Use> = l.usage().into_iter().collect();
            for (n, _) in table.listed() {
                seen.entry(n.to_owned()).or_default();
            }
            for n in waiting.keys() {
                seen.entry(n.clone()).or_default();
            }
            for (namespace, u) in seen {
                let limits = *table.limits(&namespace);
                out.push(NamespaceUse {
                    cluster: cluster.clone(),
                    waiters: waiting.get(&namespace).copied().unwrap_or(0),
                    sessions: u.sessions,
                    holds: u.holds,
                    waiters_share: q::share(limits.waiters, arbiters),
                    rate_share: q::share(limits.acquires_per_s, arbiters),
                    limits,
                    namespace,
                });
            }
        }
        out.sort_by(|a, b| (&a.cluster, &a.namespace).cmp(&(&b.cluster, &b.namespace)));
        out
    }
}

/// The oldest open hold of one namespace and class label over every cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OldestHold {
    /// The namespace label (`other` for one the registry does not name).
    pub namespace: String,
    /// The class label (`other` for one the registry does not name).
    pub class: String,
    /// Open holds under these labels, over every cluster.
    pub holds: u64,
    /// Age of the oldest of them, ms (0 when there is none).
    pub age_ms: u64,
}

impl Quotas {
    /// The oldest open hold of every (namespace, class) label pair, over every
    /// cluster's ledger, at wall time `now_ms`; every pair the registry's prefixes
    /// declare is there, at 0 without a hold. Sorted by labels.
    pub fn oldest_holds(&self, now_ms: u64) -> Vec<OldestHold> {
        let labels = self.lock_labels();
        let mut rows: HashMap<(String, String), (u64, u64)> =
            labels.pairs().iter().map(|p| (p.clone(), (0, 0))).collect();
        let ledgers: Vec<Arc<Ledger>> = lock(&self.ledgers).iter().filter_map(Weak::upgrade).collect();
        for l in &ledgers {
            for (ns, class, holds, acquired_ms) in l.oldest() {
                let r = rows.entry(labels.label(&ns, &class)).or_default();
                r.0 += holds;
                r.1 = r.1.max(now_ms.saturating_sub(acquired_ms));
            }
        }
        let mut out: Vec<OldestHold> = rows
            .into_iter()
            .map(|((namespace, class), (holds, age_ms))| OldestHold { namespace, class, holds, age_ms })
            .collect();
        out.sort_by(|a, b| (&a.namespace, &a.class).cmp(&(&b.namespace, &b.class)));
        out
    }
}

/// Adds the quota families to `registry`, read at scrape time:
/// `lockmesh_quota_refusals_total{namespace,quota}`,
/// `lockmesh_quota_use{cluster,namespace,quota}`,
/// `lockmesh_quota_limit{cluster,namespace,quota}` and
/// `lockmesh_quota_use_ratio{cluster,namespace,quota}` (use over limit; for
/// `waiters`, this arbiter's over its share). Namespaces the registry does not
/// name share the label `other`, which carries the highest use among them.
pub fn register(registry: &mut Registry, quotas: Arc<Quotas>) {
    registry.register_collector(Box::new(QuotaCollector(quotas)));
}

struct QuotaCollector(Arc<Quotas>);

impl std::fmt::Debug for QuotaCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QuotaCollector")
    }
}

impl Collector for QuotaCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let refusals = lock(&self.0.refusals).clone();
        let mut family = encoder.encode_descriptor(
            "lockmesh_quota_refusals",
            "Acquires and session opens refused with quota_exceeded, by namespace and quota.",
            None,
            MetricType::Counter,
        )?;
        let mut rows: Vec<_> = refusals.into_iter().collect();
        rows.sort();
        for ((ns, quota), n) in rows {
            ConstCounter::new(n)
                .encode(family.encode_family(&[("namespace", ns.as_str()), ("quota", quota.as_str())])?)?;
        }
        // (cluster, label, quota) -> (use, limit), the highest ratio per label.
        let mut rows: HashMap<(String, String, Quota), (u64, u64)> = HashMap::new();
        for u in self.0.usage() {
            let l = self.0.label(&u.namespace);
            for (quota, used, limit) in [
                (Quota::Sessions, u.sessions, u.limits.sessions),
                (Quota::Holds, u.holds, u.limits.holds),
                (Quota::Waiters, u.waiters, u.waiters_share),
            ] {
                let e = rows.entry((u.cluster.clone(), l.clone(), quota)).or_insert((used, limit));
                if (used as f64 / limit.max(1) as f64) > (e.0 as f64 / e.1.max(1) as f64) {
                    *e = (used, limit);
                }
            }
        }
        let mut rows: Vec<_> = rows.into_iter().collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, help, pick) in [
            ("lockmesh_quota_use", "Use of a quota as this arbiter counts it (waiters: at this arbiter).", 0u8),
            ("lockmesh_quota_limit", "A quota's limit (waiters: this arbiter's share).", 1),
        ] {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for ((cluster, ns, quota), (used, limit)) in &rows {
                let v = if pick == 0 { *used } else { *limit };
                ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(family.encode_family(&[
                    ("cluster", cluster.as_str()),
                    ("namespace", ns.as_str()),
                    ("quota", quota.as_str()),
                ])?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "lockmesh_quota_use_ratio",
            "Use over limit of a quota (the alert fires at 0.8).",
            None,
            MetricType::Gauge,
        )?;
        for ((cluster, ns, quota), (used, limit)) in &rows {
            ConstGauge::new(*used as f64 / (*limit).max(1) as f64).encode(family.encode_family(&[
                ("cluster", cluster.as_str()),
                ("namespace", ns.as_str()),
                ("quota", quota.as_str()),
            ])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(kind: Kind, key: &[u8], ns: &str, age: Option<(&str, u64)>) -> Seen {
        let age = age.map(|(class, acquired_ms)| HoldAge { class: class.into(), acquired_ms });
        Seen { kind, key: key.to_vec(), ns: ns.into(), age }
    }

    #[test]
    fn the_ledger_counts_puts_once_and_skips_its_own_writes_the_watch_has_passed() {
        let l = Ledger::default();
        assert_eq!(l.use_of("a"), None, "not listed yet: nothing enforced");
        l.replace(vec![seen(Kind::Session, b"s1", "a", None), seen(Kind::Hold, b"h1", "a", Some(("c", 5)))], 10);
        assert_eq!(l.use_of("a"), Some(Use { sessions: 1, holds: 1 }));
        l.note_hold(b"h2", 11, "a");
        l.note_hold(b"h2", 11, "a");
        assert_eq!(l.use_of("a").unwrap().holds, 2, "a second note of one key is not a second hold");
        // The watch already went past revision 12 (a put and its delete): a late
        // note of a key created at 12 must not bring it back.
        lock(&l.state).applied[1] = 13;
        l.note_hold(b"h3", 12, "a");
        assert_eq!(l.use_of("a").unwrap().holds, 2);
        lock(&l.state).delete(b"h1");
        lock(&l.state).delete(b"h1");
        assert_eq!(l.use_of("a"), Some(Use { sessions: 1, holds: 1 }));
        assert_eq!(l.use_of("b"), Some(Use::default()));
    }

    #[test]
    fn the_oldest_hold_of_a_namespace_and_class_is_the_earliest_grant_still_open() {
        let l = Ledger::default();
        l.replace(
            vec![
                seen(Kind::Hold, b"h1", "a", Some(("c", 100))),
                seen(Kind::Hold, b"h2", "a", Some(("c", 100))),
                seen(Kind::Hold, b"h3", "a", Some(("c", 300))),
                seen(Kind::Hold, b"h4", "a", Some(("d", 50))),
                seen(Kind::Session, b"s1", "a", None),
            ],
            10,
        );
        let mut o = l.oldest();
        o.sort();
        assert_eq!(o, [("a".into(), "c".into(), 3, 100), ("a".into(), "d".into(), 1, 50)]);
        // Two holds granted in the same ms: the first to go leaves the other.
        lock(&l.state).delete(b"h1");
        assert!(l.oldest().contains(&("a".into(), "c".into(), 2, 100)));
        lock(&l.state).delete(b"h2");
        assert!(l.oldest().contains(&("a".into(), "c".into(), 1, 300)));
        lock(&l.state).delete(b"h3");
        lock(&l.state).delete(b"h4");
        assert_eq!(l.oldest(), [], "no hold, no row");
        assert!(lock(&l.state).ages.is_empty());
        // A hold noted by this arbiter has no age until its watch event brings it;
        // the event does not count it twice.
        l.note_hold(b"h5", 11, "a");
        assert_eq!(l.oldest(), []);
        lock(&l.state).put(Kind::Hold, b"h5", "a", Some(HoldAge { class: "c".into(), acquired_ms: 700 }));
        assert_eq!(l.oldest(), [("a".into(), "c".into(), 1, 700)]);
        assert_eq!(l.use_of("a").unwrap().holds, 1);
        lock(&l.state).delete(b"h5");
        assert_eq!((l.oldest(), l.use_of("a").unwrap().holds), (vec![], 0));
    }

    #[test]
    fn hold_labels_name_only_what_the_registry_names() {
        let reg = lockmesh_registry::parse(
            "classes:\n  - name: pay\n    prefixes: [payments, payments/x, refunds/y]\n    ttl_s: 60\n    enforcement: advisory\n    risk_owner: t\n    waiver_expiry: \"2099-12-31\"\n  - name: d\n    default: true\n    ttl_s: 60\n    enforcement: advisory\n    risk_owner: t\n    waiver_expiry: \"2099-12-31\"\n",
        )
        .unwrap();
        let nss = ["payments", "refunds"].iter().map(|s| s.to_string()).collect();
        let l = LockLabelSet::of(&reg, &nss);
        assert_eq!(l.label("payments", "pay"), ("payments".into(), "pay".into()));
        assert_eq!(l.label("attacker-chosen", "pay"), ("other".into(), "pay".into()));
        assert_eq!(l.label("payments", "a-class-since-removed"), ("payments".into(), "other".into()));
        let pairs: Vec<(&str, &str)> = l.pairs().iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
        assert_eq!(pairs, [("other", "d"), ("payments", "pay"), ("refunds", "pay")]);
    }
}
