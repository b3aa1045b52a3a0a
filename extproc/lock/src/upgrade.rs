//! The keyspace version and capabilities at run time (issue #19; the records are
//! `lockmesh_keyspace::upgrade`): each arbiter advertises what it supports on a
//! lease of its own, every component reads the keyspace record at start and on
//! change and refuses to serve what it does not know, and `lockctl upgrade enable`
//! enables a capability only while every live arbiter supports it.
//!
//! # The flip and an arbiter starting without the capability
//!
//! [`enable`] reads the record and every advertisement in one transaction (one
//! revision `R`), refuses if any advertisement lacks the capability, and commits
//! the new record only if the record is unchanged and **no advertisement was
//! written after `R`** (a range compare of the whole advertisement prefix:
//! `mod_revision < R + 1` holds only if it holds for every key in it, including
//! one created later). An arbiter ([`Gate::start`]) puts its advertisement first
//! and only then reads the record. Both orders are safe:
//!
//! - the advertisement commits first: the flip either read it (and refuses) or its
//!   compare fails (the key's revision is above `R`) and it reads again;
//! - the flip commits first: the arbiter's read of the record is linearizable and
//!   later than the flip, so it sees the capability enabled and refuses (seals).
//!
//! An advertisement lives on a lease of [`AD_TTL_S`] that the arbiter renews every
//! second; one that lapsed (a paused arbiter) is put again, followed by a fresh
//! read of the record, before the gate reports the arbiter admitted again.
//!
//! # Refusing
//!
//! A refused arbiter seals its store (`Store::seal`, reason `explicit`, the
//! refusal's code first in the detail): every request answers `503 sealed`, and
//! `lockmesh_arbiter_keyspace_refused{reason}` is 1. The seal clears only with an
//! epoch advance, after which the gate seals again within [`RESEAL`]; a build that
//! lacks an enabled capability never gains it, so the refusal lasts until the
//! process is replaced by a newer build.
//!
//! What stays open: an arbiter paused for longer than [`AD_TTL_S`] while a flip
//! commits serves, once resumed, until its next gate tick (at most about a
//! second) before it seals. The capabilities of today ([`Capability`]) gate no
//! record kind yet, so nothing is at stake; the first one that does must also make
//! its writers' transactions compare their arbiter's advertisement key (it exists
//! only while the lease lives).
//!
//! # Switching a capability off
//!
//! `LOCKMESH_CAPABILITIES_OFF=a,b` (names of [`Capability`]) makes this build
//! advertise and accept less: it stands in for an older build in the mixed-version
//! scenario, and lets an operator keep a capability from being enabled.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering},
        Arc, Mutex, Weak,
    },
    time::Duration,
};

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{gauge::ConstGauge, MetricType},
    registry::Registry,
};
use serde::Serialize;

pub use lockmesh_keyspace::upgrade::{refusal, Advertisement, Capability, KeyspaceRecord, Refusal, KEYSPACE_VERSION};

use crate::{keys::prefix_end, now_ms, seal::SealReason, Keys, Store};

/// The environment variable naming capabilities this process does not support.
pub const CAPABILITIES_OFF_ENV: &str = "LOCKMESH_CAPABILITIES_OFF";

/// TTL of an arbiter's advertisement lease, seconds: how long a stopped (or
/// paused) arbiter keeps a flip refused.
pub const AD_TTL_S: i64 = 10;

/// How often a refused arbiter makes sure its seal is still declared.
pub const RESEAL: Duration = Duration::from_millis(250);

/// How often the gate renews the advertisement and re-reads the record.
const TICK: Duration = Duration::from_secs(1);

/// TEST ONLY: with `LOCKMESH_TEST_FAULTS=1` in a build with the feature
/// `test-faults`, `LOCKMESH_TEST_FAULT_UPGRADE=ignore_keyspace_record` plants the
/// bug the mixed-version scenario must catch: the gate advertises but never reads
/// the record, so a build lacking an enabled capability serves anyway. (The
/// `TestFault` list of `test_faults` is another file's; this one is read here.)
const PLANTED_ENV: &str = "LOCKMESH_TEST_FAULT_UPGRADE";

fn planted_ignore_record() -> bool {
    crate::test_faults::ENABLED
        && std::env::var(crate::test_faults::ENV).as_deref() == Ok("1")
        && std::env::var(PLANTED_ENV).as_deref() == Ok("ignore_keyspace_record")
}

/// What this process reads and writes: a keyspace version and capabilities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Support {
    version: u32,
    capabilities: Vec<Capability>,
}

impl Support {
    /// Everything this build knows.
    pub fn full() -> Self {
        Self { version: KEYSPACE_VERSION, capabilities: Capability::ALL.to_vec() }
    }

    /// This build without `off`.
    pub fn without(off: &[Capability]) -> Self {
        let mut s = Self::full();
        s.capabilities.retain(|c| !off.contains(c));
        s
    }

    /// [`Support::full`] minus the names in [`CAPABILITIES_OFF_ENV`]; an unknown
    /// name is an error naming it.
    pub fn from_env() -> Result<Self, String> {
        let raw = std::env::var(CAPABILITIES_OFF_ENV).unwrap_or_default();
        let mut off = Vec::new();
        for name in raw.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match Capability::parse(name) {
                Some(c) => off.push(c),
                None => {
                    let known: Vec<&str> = Capability::ALL.iter().map(|c| c.as_str()).collect();
                    return Err(format!("{CAPABILITIES_OFF_ENV}: unknown capability {name:?} (known: {known:?})"));
                }
            }
        }
        Ok(Self::without(&off))
    }

    /// The keyspace version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The supported capabilities' wire names.
    pub fn names(&self) -> Vec<&'static str> {
        self.capabilities.iter().map(|c| c.as_str()).collect()
    }

    /// Why a keyspace with record `record` must not be served, if it must not.
    pub fn refusal(&self, record: Option<&KeyspaceRecord>) -> Option<Refusal> {
        refusal(record, self.version, &self.names())
    }
}

/// The record and every advertisement, read at one revision.
#[derive(Debug, Clone)]
pub struct View {
    /// The revision of the read.
    pub revision: i64,
    /// The record (`None`: absent, the baseline).
    pub record: Option<KeyspaceRecord>,
    /// The record's mod revision (0 when absent).
    pub record_mod_revision: i64,
    /// Every advertisement: its key, its value (`None`: unreadable) and its lease.
    pub advertisements: Vec<(String, Option<Advertisement>, i64)>,
}

/// Why a check, a flip or a read failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpgradeError {
    /// The keyspace names what this build does not know.
    #[error("{0}")]
    Refused(Refusal),
    /// Live arbiters lack the capability: (advertisement key, build, listen).
    #[error("refused: {} live arbiter(s) do not support {cap}: {}", lacking.len(), lacking.iter().map(|(k, b, l)| format!("{k} (build {b}, listen {l})")).collect::<Vec<_>>().join(", "))]
    Lacking {
        /// The capability.
        cap: String,
        /// Each arbiter lacking it.
        lacking: Vec<(String, String, String)>,
    },
    /// The record or an advertisement kept changing under the flip.
    #[error("the keyspace record or the advertisements kept changing; try again")]
    Raced,
    /// etcd failed.
    #[error("etcd: {0}")]
    Etcd(String),
}

/// Reads the record and every advertisement in one transaction (linearizable).
pub async fn read_view(client: &mut Client, keys: &Keys) -> Result<View, UpgradeError> {
    let ads = keys.advertisements();
    let txn = Txn::new().and_then([
        TxnOp::get(keys.keyspace(), None),
        TxnOp::get(ads.as_str(), Some(GetOptions::new().with_range(prefix_end(&ads)))),
    ]);
    let r = client.txn(txn).await.map_err(|e| UpgradeError::Etcd(e.to_string()))?;
    let revision = r.header().map_or(0, |h| h.revision());
    let mut view = View { revision, record: None, record_mod_revision: 0, advertisements: Vec::new() };
    for (i, op) in r.op_responses().into_iter().enumerate() {
        let TxnOpResponse::Get(g) = op else { continue };
        for kv in g.kvs() {
            if i == 0 {
                let rec = serde_json::from_slice::<KeyspaceRecord>(kv.value())
                    .map_err(|e| UpgradeError::Refused(Refusal::Unreadable(e.to_string())))?;
                view.record = Some(rec);
                view.record_mod_revision = kv.mod_revision();
            } else {
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                view.advertisements.push((key, serde_json::from_slice(kv.value()).ok(), kv.lease()));
            }
        }
    }
    Ok(view)
}

/// The check every component that is not an arbiter runs at start and on a change
/// of `<root>/sys/keyspace` (the audit tailer, `lockctl`): the record, or why this
/// build must not serve the keyspace (a version above [`KEYSPACE_VERSION`], an
/// enabled capability it does not know, an unreadable record).
pub async fn check_keyspace(client: &mut Client, root: &str) -> Result<KeyspaceRecord, UpgradeError> {
    let view = read_view(client, &Keys::new(root)).await?;
    if let Some(r) = Support::full().refusal(view.record.as_ref()) {
        return Err(UpgradeError::Refused(r));
    }
    Ok(view.record.unwrap_or_else(KeyspaceRecord::baseline))
}

/// What a flip did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Flipped {
    /// The record as committed (or as found, when nothing was to change).
    pub record: KeyspaceRecord,
    /// Whether it changed (false: already in that state).
    pub changed: bool,
    /// The revision of the commit (or of the read).
    pub revision: i64,
    /// How many live arbiters' advertisements were compared.
    pub arbiters: usize,
}

/// Attempts of a flip against concurrent writers before [`UpgradeError::Raced`].
const FLIP_ATTEMPTS: usize = 8;

/// `lockctl upgrade enable CAP`: enables `cap` in one transaction that compares the
/// record unchanged and every advertisement unchanged since the read in which each
/// supported `cap` (see the module docs for why a starting arbiter cannot slip in).
pub async fn enable(client: &mut Client, root: &str, cap: Capability, actor: &str) -> Result<Flipped, UpgradeError> {
    flip(client, root, cap, actor, true).await
}

/// `lockctl upgrade disable CAP` (the rollback after a flip): removes `cap` from the
/// record, compared unchanged. Safe for the capabilities of today, whose record
/// kinds nobody writes yet; a capability that gates a real kind must first check
/// here that no record of its kind is left.
pub async fn disable(client: &mut Client, root: &str, cap: Capability, actor: &str) -> Result<Flipped, UpgradeError> {
    flip(client, root, cap, actor, false).await
}

async fn flip(
    client: &mut Client,
    root: &str,
    cap: Capability,
    actor: &str,
    on: bool,
) -> Result<Flipped, UpgradeError> {
    let keys = Keys::new(root);
    for _ in 0..FLIP_ATTEMPTS {
        let view = read_view(client, &keys).await?;
        // lockctl itself must understand what it rewrites.
        if let Some(r) = Support::full().refusal(view.record.as_ref()) {
            return Err(UpgradeError::Refused(r));
        }
        let mut rec = view.record.clone().unwrap_or_else(KeyspaceRecord::baseline);
        let live = view.advertisements.len();
        if rec.is_enabled(cap) == on {
            return Ok(Flipped { record: rec, changed: false, revision: view.revision, arbiters: live });
        }
        if on {
            let lacking: Vec<(String, String, String)> = view
                .advertisements
                .iter()
                .filter(|(_, ad, _)| !ad.as_ref().is_some_and(|a| a.supports(cap.as_str()) && a.version >= rec.version))
                .map(|(k, ad, _)| {
                    let (b, l) =
                        ad.as_ref().map_or(("unreadable".into(), "-".into()), |a| (a.build.clone(), a.listen.clone()));
                    (k.clone(), b, l)
                })
                .collect();
            if !lacking.is_empty() {
                return Err(UpgradeError::Lacking { cap: cap.as_str().into(), lacking });
            }
            rec.enabled.push(cap.as_str().into());
            rec.enabled.sort();
            rec.enabled.dedup();
        } else {
            rec.enabled.retain(|e| e != cap.as_str());
        }
        rec.changed_by = Some(format!("{actor}: {} {}", if on { "enable" } else { "disable" }, cap.as_str()));
        rec.changed_ms = now_ms();
        let value = serde_json::to_vec(&rec).map_err(|e| UpgradeError::Etcd(e.to_string()))?;
        let ads = keys.advertisements();
        let txn = Txn::new()
            .when([
                Compare::mod_revision(keys.keyspace(), CompareOp::Equal, view.record_mod_revision),
                Compare::mod_revision(ads.as_str(), CompareOp::Less, view.revision + 1).with_range(prefix_end(&ads)),
            ])
            .and_then([TxnOp::put(keys.keyspace(), value, None)]);
        let r = client.txn(txn).await.map_err(|e| UpgradeError::Etcd(e.to_string()))?;
        if r.succeeded() {
            let revision = r.header().map_or(0, |h| h.revision());
            return Ok(Flipped { record: rec, changed: true, revision, arbiters: live });
        }
    }
    Err(UpgradeError::Raced)
}

/// The gate's state as `/status` and doctor show it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GateStatus {
    /// This build's keyspace version.
    pub version: u32,
    /// The capabilities it advertises.
    pub supported: Vec<&'static str>,
    /// The capabilities the record enables (as last read).
    pub enabled: Vec<String>,
    /// The advertisement key, while advertised.
    pub advertisement: Option<String>,
    /// Why it refuses (the refusal's text, code first), if it does.
    pub refused: Option<String>,
    /// Why the gate cannot advertise or read (etcd refused it, e.g. a role without
    /// the grant), if it cannot.
    pub unguarded: Option<String>,
}

#[derive(Default)]
struct Inner {
    record: Option<KeyspaceRecord>,
    lease: Option<i64>,
    refusal: Option<Refusal>,
    unguarded: Option<String>,
}

/// One arbiter's side of the protocol: its advertisement, the record it last read,
/// and its refusal.
pub struct Gate {
    support: Support,
    inner: Mutex<Inner>,
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Gate {
    /// A gate for `support`; nothing happens until [`Gate::start`].
    pub fn new(support: Support) -> Arc<Self> {
        Arc::new(Self { support, inner: Mutex::new(Inner::default()) })
    }

    /// What this process supports.
    pub fn support(&self) -> &Support {
        &self.support
    }

    /// Whether a record kind gated by `cap` may be written now: this build supports
    /// it, the record enables it, and the gate does not refuse.
    pub fn enabled(&self, cap: Capability) -> bool {
        let g = lock(&self.inner);
        g.refusal.is_none()
            && self.support.capabilities.contains(&cap)
            && g.record.as_ref().is_some_and(|r| r.is_enabled(cap))
    }

    /// The refusal, if the gate refuses.
    pub fn refusal(&self) -> Option<Refusal> {
        lock(&self.inner).refusal.clone()
    }

    /// The state for `/status`.
    pub fn status(&self) -> GateStatus {
        let g = lock(&self.inner);
        GateStatus {
            version: self.support.version,
            supported: self.support.names(),
            enabled: g.record.as_ref().map(|r| r.enabled.clone()).unwrap_or_default(),
            advertisement: g.lease.map(|l| format!("{l:016x}")),
            refused: g.refusal.as_ref().map(|r| r.to_string()),
            unguarded: g.unguarded.clone(),
        }
    }

    /// Advertises, reads the record (sealing `store` if it must refuse), then keeps
    /// doing so every second in a task that ends once the gate is dropped. `listen`
    /// tells arbiters apart in the advertisements.
    pub async fn start(self: Arc<Self>, store: Arc<Store>, listen: String) -> tokio::task::JoinHandle<()> {
        self.tick(&store, &listen).await;
        let weak = Arc::downgrade(&self);
        drop(self);
        tokio::spawn(run(weak, store, listen))
    }

    /// One round: renew (or put again) the advertisement, then read the record.
    async fn tick(&self, store: &Store, listen: &str) {
        let lease = lock(&self.inner).lease;
        if let Some(id) = lease {
            if let Err(e) = store.call(store.client().lease_keep_alive(id)).await {
                if e.to_string().contains("lease not found") {
                    tracing::warn!("the keyspace advertisement lapsed; advertising again");
                    lock(&self.inner).lease = None;
                    ADVERTISED.store(false, Ordering::Relaxed);
                }
            }
        }
        let lapsed = lock(&self.inner).lease.is_none();
        if lapsed {
            if let Err(e) = self.advertise(store, listen).await {
                self.etcd_failed(store, "advertise", &e);
                return;
            }
        }
        // The record is read after the advertisement's put (the module docs' second order).
        if planted_ignore_record() {
            return;
        }
        let mut client = store.client();
        match tokio::time::timeout(Duration::from_secs(3), read_view(&mut client, store.keys())).await {
            Ok(Ok(view)) => {
                // The quotas counted at each arbiter are shared among the live ones.
                super::quota::set_arbiters(view.advertisements.len());
                self.observe(store, view.record)
            }
            Ok(Err(UpgradeError::Refused(r))) => self.refuse(store, r),
            Ok(Err(e)) => self.etcd_failed(store, "read the keyspace record", &e.to_string()),
            Err(_) => {}
        }
    }

    async fn advertise(&self, store: &Store, listen: &str) -> Result<(), String> {
        let mut client = store.client();
        let lease = store.call(client.lease_grant(AD_TTL_S, None)).await.map_err(|e| e.to_string())?.id();
        let ad = Advertisement {
            version: self.support.version,
            capabilities: self.support.names().into_iter().map(String::from).collect(),
            build: env!("CARGO_PKG_VERSION").into(),
            listen: listen.into(),
            started_ms: now_ms(),
        };
        let value = serde_json::to_vec(&ad).map_err(|e| e.to_string())?;
        let key = store.keys().advertisement(lease);
        store
            .call(client.put(key, value, Some(PutOptions::new().with_lease(lease))))
            .await
            .map_err(|e| e.to_string())?;
        let mut g = lock(&self.inner);
        g.lease = Some(lease);
        g.unguarded = None;
        ADVERTISED.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// etcd refused or failed a gate call. A refused permission (an etcd role
    /// without the grant on `sys/arbiters/` or `sys/keyspace`, which the shipped
    /// `lockmesh-arbiter` role has) fails closed: an arbiter that cannot advertise is
    /// invisible to `lockctl upgrade enable`, which could then enable a capability
    /// it lacks, so it refuses every request (sealed) until restarted with the
    /// grants. A plain failure is retried at the next tick (the lock calls fail
    /// closed on their own).
    fn etcd_failed(&self, store: &Store, what: &str, e: &str) {
        if e.contains("permission denied") {
            let mut g = lock(&self.inner);
            if g.unguarded.is_none() {
                tracing::error!(error = %e, "cannot {what}: the etcd role lacks the keyspace grants; this arbiter would be invisible to `lockctl upgrade enable`");
            }
            g.unguarded = Some(format!("{what}: {e}"));
            ADVERTISED.store(false, Ordering::Relaxed);
            drop(g);
            self.refuse(
                store,
                Refusal::Unreadable(format!(
                    "cannot {what}: the etcd role lacks the keyspace grants (read sys/keyspace, write sys/arbiters/)"
                )),
            );
        } else {
            tracing::debug!(error = %e, "keyspace gate: cannot {what} yet");
        }
    }

    fn observe(&self, store: &Store, record: Option<KeyspaceRecord>) {
        let refusal = self.support.refusal(record.as_ref());
        ENABLED.store(enabled_bits(record.as_ref()), Ordering::Relaxed);
        lock(&self.inner).record = record;
        if let Some(r) = refusal {
            self.refuse(store, r);
        }
    }

    fn refuse(&self, store: &Store, r: Refusal) {
        let mut g = lock(&self.inner);
        if g.refusal.is_none() {
            tracing::error!(code = r.code(), "{r}; this arbiter refuses every request (sealed)");
            REFUSED.store(reason_index(&r), Ordering::Relaxed);
            g.refusal = Some(r.clone());
        }
        drop(g);
        reseal(store, &r);
    }

    fn reassert(&self, store: &Store) {
        if let Some(r) = self.refusal() {
            reseal(store, &r);
        }
    }
}

/// Declares the refusal as the store's seal unless one is declared.
fn reseal(store: &Store, r: &Refusal) {
    if store.seal().current().is_none() {
        store.seal().seal(SealReason::Explicit, r.to_string());
    }
}

async fn run(gate: Weak<Gate>, store: Arc<Store>, listen: String) {
    loop {
        let steps = (TICK.as_millis() / RESEAL.as_millis()).max(1);
        for _ in 0..steps {
            tokio::time::sleep(RESEAL).await;
            match gate.upgrade() {
                Some(g) => g.reassert(&store),
                None => return,
            }
        }
        let Some(g) = gate.upgrade() else { return };
        g.tick(&store, &listen).await;
    }
}

/// 0 none; 1 version; 2 capability; 3 unreadable.
static REFUSED: AtomicU8 = AtomicU8::new(0);
static ADVERTISED: AtomicBool = AtomicBool::new(false);
/// Bit i: [`Capability::ALL`]`[i]` is enabled in the record.
static ENABLED: AtomicU32 = AtomicU32::new(0);

const REASONS: [&str; 3] = ["version", "capability", "unreadable"];

fn reason_index(r: &Refusal) -> u8 {
    match r {
        Refusal::Version { .. } => 1,
        Refusal::Capability(_) => 2,
        Refusal::Unreadable(_) => 3,
    }
}

fn enabled_bits(r: Option<&KeyspaceRecord>) -> u32 {
    Capability::ALL
        .iter()
        .enumerate()
        .filter(|(_, c)| r.is_some_and(|r| r.is_enabled(**c)))
        .fold(0, |b, (i, _)| b | 1 << i)
}

/// Adds the gate's families to `registry`, read at scrape time:
/// `lockmesh_arbiter_keyspace_refused{reason}` (1 while refusing for that reason),
/// `lockmesh_arbiter_keyspace_advertised` and
/// `lockmesh_arbiter_keyspace_capability_enabled{capability}`.
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(GateCollector));
}

#[derive(Debug)]
struct GateCollector;

impl Collector for GateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let refused = REFUSED.load(Ordering::Relaxed);
        let mut family = encoder.encode_descriptor(
            "lockmesh_arbiter_keyspace_refused",
            "1 while this arbiter refuses every request because the keyspace record names a version or an enabled capability it does not support.",
            None,
            MetricType::Gauge,
        )?;
        for (i, reason) in REASONS.iter().enumerate() {
            let v = i64::from(usize::from(refused) == i + 1);
            ConstGauge::new(v).encode(family.encode_family(&[("reason", *reason)])?)?;
        }
        ConstGauge::new(i64::from(ADVERTISED.load(Ordering::Relaxed))).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_keyspace_advertised",
            "1 while this arbiter's capability advertisement is in etcd (lockctl upgrade enable sees it).",
            None,
            MetricType::Gauge,
        )?)?;
        let bits = ENABLED.load(Ordering::Relaxed);
        let mut family = encoder.encode_descriptor(
            "lockmesh_arbiter_keyspace_capability_enabled",
            "1 when the keyspace record enables the capability (as this arbiter last read it).",
            None,
            MetricType::Gauge,
        )?;
        for (i, c) in Capability::ALL.iter().enumerate() {
            ConstGauge::new(i64::from(bits & (1 << i) != 0))
                .encode(family.encode_family(&[("capability", c.as_str())])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn support_from_the_environment_names_what_is_off_and_refuses_an_unknown_name() {
        let s = Support::without(&[Capability::LockDelay]);
        assert!(!s.names().contains(&"lock_delay") && s.names().contains(&"permits"));
        let rec = KeyspaceRecord { enabled: vec!["lock_delay".into()], ..KeyspaceRecord::baseline() };
        assert_eq!(s.refusal(Some(&rec)), Some(Refusal::Capability("lock_delay".into())));
        assert_eq!(Support::full().refusal(Some(&rec)), None);
        assert_eq!(enabled_bits(Some(&rec)), 1 << 2);
        assert_eq!(enabled_bits(None), 0);
    }

    #[test]
    fn the_collector_declares_every_label_from_zero() {
        let mut r = Registry::default();
        register(&mut r);
        let mut s = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut s, &r).unwrap();
        for line in [
            "lockmesh_arbiter_keyspace_refused{reason=\"capability\"} 0\n",
            "lockmesh_arbiter_keyspace_capability_enabled{capability=\"permits\"} 0\n",
            "# TYPE lockmesh_arbiter_keyspace_advertised gauge\n",
        ] {
            assert!(s.contains(line), "{line}:\n{s}");
        }
    }
}
