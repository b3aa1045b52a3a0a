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
//! An arbiter paused for longer than [`AD_TTL_S`] while a flip commits cannot
//! grant once resumed: every grant and hand-off transaction compares its
//! arbiter's advertisement on that cluster ([`Guard`]: the key exists only while
//! its lease lives), so the first one fails, the store refuses grants
//! (`unavailable`) and the gate advertises again and reads the record before it
//! grants again (or seals). Builds before this compare (every build up to the one
//! that introduced it) can still serve about a second after such a flip: the
//! mixed-version rehearsal (`scripts/rehearse-upgrade`) runs one.
//!
//! # Gated kinds, a fresh install, an existing keyspace
//!
//! Each record kind written since the gate exists has a capability of its own
//! ([`Capability::GATED`]); its writers ask [`Guard::enabled`] and, when it is
//! off, write nothing of the kind and fall back: lock-delay classes are granted
//! without a guard (no delay), k permits and exclusive holds of more than one slot
//! are refused `capability_disabled`, an exclusive hold puts no exclusion record
//! (and `lockctl limit change` refuses raises), an acquire-opened session keeps no
//! hold index (and is not closed at its last release: it lapses with its TTL), a
//! grant on a caller's session has no attempt fence (an unknown outcome ends the
//! session instead), and shadow decisions are only counted. Records of every kind
//! already in the keyspace are honoured whatever the record says.
//!
//! A fresh install (no record, nothing under `l/`, `s/`, `g/`, `d/`, `w/`) gets a
//! record enabling every gated capability all live arbiters support, written by
//! the first arbiter's first gate round ([`bootstrap`]). A keyspace that holds
//! anything and has no record (written by builds before the gate) keeps nothing
//! enabled until `lockctl upgrade enable all`, run once every arbiter runs a
//! build that supports them.
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
/// record, compared unchanged. Arbiters stop writing the kind within a gate round
/// (about a second); records of it already written stay until they end with their
/// holds or sessions (every gated kind but the lock-delay guard is on a lease), and
/// this build honours them meanwhile. A build that lacks the capability must not
/// run until they are gone (docs/OPERATIONS.md, "Rolling upgrades").
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

/// What one store's writers may write, as its arbiter's gate last decided: the
/// enabled capabilities and the advertisement key on that store's cluster that
/// every grant transaction compares (`Compare::lease(key) == lease`: the key
/// exists only while the arbiter's advertisement lease lives).
///
/// A store no gate attached (`lockctl`, the ops crate, unit tests) writes every
/// kind and compares nothing: those never grant. An attached store whose
/// advertisement lapsed refuses every grant until the gate advertised again and
/// read the record again, so an arbiter paused through a flip cannot write (or
/// grant beside) a kind it has not yet learnt is enabled.
#[derive(Debug, Default)]
pub struct Guard {
    state: Mutex<GuardState>,
}

#[derive(Debug, Default, Clone)]
struct GuardState {
    attached: bool,
    ad: Option<(String, i64)>,
    enabled: u32,
}

/// Why a grant may not be written now (the advertisement lapsed or was never put).
pub const NOT_ADVERTISED: &str =
    "this arbiter's keyspace advertisement is not in etcd (lapsed or not yet put); it advertises again within a second";

impl Guard {
    fn state(&self) -> std::sync::MutexGuard<'_, GuardState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a record kind gated by `cap` may be written by this store now.
    pub fn enabled(&self, cap: Capability) -> bool {
        if crate::test_faults::on(crate::test_faults::TestFault::UngatedWrites) {
            return true; // PLANTED BUG (upgrade scenario): the gate is not asked.
        }
        let g = self.state();
        !g.attached || g.enabled & bit(cap) != 0
    }

    /// The advertisement a grant transaction compares: `Ok(None)` for a store no
    /// gate is attached to, an error while attached without a live advertisement.
    pub fn advertisement(&self) -> Result<Option<(String, i64)>, String> {
        if crate::test_faults::on(crate::test_faults::TestFault::UngatedWrites) {
            return Ok(None); // PLANTED BUG (upgrade scenario): nothing compared.
        }
        let g = self.state();
        match (&g.ad, g.attached) {
            (_, false) => Ok(None),
            (Some(ad), true) => Ok(Some(ad.clone())),
            (None, true) => Err(NOT_ADVERTISED.into()),
        }
    }

    /// A transaction found advertisement `key` gone: nothing is granted until the
    /// gate has advertised again and read the record after it.
    pub fn lapsed(&self, key: &str) {
        let mut g = self.state();
        if g.ad.as_ref().is_some_and(|(k, _)| k == key) {
            tracing::warn!(
                "a grant found this arbiter's keyspace advertisement gone; refusing grants until it is put again"
            );
            g.ad = None;
        }
    }

    /// The failure branch's read of advertisement `ad` (as a grant compared it):
    /// gone or on another lease means the compare failed, so the advertisement is
    /// marked lapsed and the grant refused `unavailable`.
    pub fn check_read(
        &self,
        ad: &Option<(String, i64)>,
        read: Option<&etcd_client::GetResponse>,
    ) -> Result<(), crate::LockError> {
        let Some((key, lease)) = ad else { return Ok(()) };
        if read.and_then(|g| g.kvs().first()).map(etcd_client::KeyValue::lease) == Some(*lease) {
            return Ok(());
        }
        self.lapsed(key);
        Err(crate::LockError::Unavailable(NOT_ADVERTISED.into()))
    }

    fn attach(&self) {
        self.state().attached = true;
    }

    fn set_ad(&self, ad: Option<(String, i64)>) {
        self.state().ad = ad;
    }

    fn set_enabled(&self, bits: u32) {
        self.state().enabled = bits;
    }

    fn ad_lease(&self) -> Option<i64> {
        self.state().ad.as_ref().map(|(_, l)| *l)
    }
}

fn bit(cap: Capability) -> u32 {
    Capability::ALL.iter().position(|c| *c == cap).map_or(0, |i| 1 << i)
}

/// The key prefixes (under the root) whose keys make a keyspace not fresh.
const DATA_PREFIXES: [&str; 5] = ["/l/", "/s/", "/g/", "/d/", "/w/"];

/// A fresh install: no record, and nothing under [`DATA_PREFIXES`]. The record is
/// written enabling every gated capability that every live arbiter supports, in
/// one transaction comparing the record absent, every advertisement unchanged
/// since the read and every data prefix empty; a keyspace that holds anything
/// keeps the absent record (nothing enabled) until `lockctl upgrade enable`.
/// Answers the record written, if it wrote one.
pub async fn bootstrap(client: &mut Client, root: &str, actor: &str) -> Result<Option<KeyspaceRecord>, UpgradeError> {
    // Arbiters that start together race here: one's advertisement changes the
    // range another compared, so a transaction that failed only on that (no
    // record yet, no data) reads again and tries again rather than leaving its
    // arbiter serving with nothing enabled until its next round.
    for _ in 0..8 {
        match bootstrap_once(client, root, actor).await? {
            Bootstrapped::Raced => continue,
            Bootstrapped::Wrote(rec) => return Ok(Some(rec)),
            Bootstrapped::Not => return Ok(None),
        }
    }
    Ok(None)
}

/// What one bootstrap transaction did.
enum Bootstrapped {
    Wrote(KeyspaceRecord),
    /// A record exists, the keyspace holds data, or nothing can be enabled.
    Not,
    /// It failed only because the advertisements changed after the read.
    Raced,
}

async fn bootstrap_once(client: &mut Client, root: &str, actor: &str) -> Result<Bootstrapped, UpgradeError> {
    let keys = Keys::new(root);
    let view = read_view(client, &keys).await?;
    if view.record.is_some() {
        return Ok(Bootstrapped::Not);
    }
    let caps: Vec<String> = Capability::GATED
        .iter()
        .filter(|c| view.advertisements.iter().all(|(_, ad, _)| ad.as_ref().is_some_and(|a| a.supports(c.as_str()))))
        .map(|c| c.as_str().to_owned())
        .collect();
    if view.advertisements.is_empty() || caps.is_empty() {
        return Ok(Bootstrapped::Not);
    }
    let mut rec = KeyspaceRecord::baseline();
    rec.enabled = caps;
    rec.enabled.sort();
    rec.changed_by = Some(format!("{actor}: a fresh keyspace, every capability of the live arbiters enabled"));
    rec.changed_ms = now_ms();
    let value = serde_json::to_vec(&rec).map_err(|e| UpgradeError::Etcd(e.to_string()))?;
    let ads = keys.advertisements();
    let root_prefix = keys.root();
    let mut when = vec![
        Compare::create_revision(keys.keyspace(), CompareOp::Equal, 0),
        Compare::mod_revision(ads.as_str(), CompareOp::Less, view.revision + 1).with_range(prefix_end(&ads)),
    ];
    // The failure branch reads what else could have failed: the record, and one
    // key of each data prefix.
    let mut failed = vec![TxnOp::get(keys.keyspace(), Some(GetOptions::new().with_keys_only()))];
    for p in DATA_PREFIXES {
        let p = format!("{root_prefix}{p}");
        when.push(Compare::create_revision(p.as_str(), CompareOp::Equal, 0).with_range(prefix_end(&p)));
        let opts = GetOptions::new().with_range(prefix_end(&p)).with_keys_only().with_limit(1);
        failed.push(TxnOp::get(p.as_str(), Some(opts)));
    }
    let txn = Txn::new().when(when).and_then([TxnOp::put(keys.keyspace(), value, None)]).or_else(failed);
    let r = client.txn(txn).await.map_err(|e| UpgradeError::Etcd(e.to_string()))?;
    if r.succeeded() {
        return Ok(Bootstrapped::Wrote(rec));
    }
    let other = r.op_responses().into_iter().any(|op| matches!(op, TxnOpResponse::Get(g) if !g.kvs().is_empty()));
    Ok(if other { Bootstrapped::Not } else { Bootstrapped::Raced })
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
    /// The coord cluster's advertisement lease (each store's is in its [`Guard`]).
    lease: Option<i64>,
    refusal: Option<Refusal>,
    unguarded: Option<String>,
}

/// One arbiter's side of the protocol: its advertisement, the record it last read,
/// and its refusal.
pub struct Gate {
    support: Support,
    inner: Mutex<Inner>,
    /// What `/metrics` shows of the gate ([`register`]), kept apart from `inner`
    /// so a scrape never waits for it.
    shown: Shown,
}

/// The gate's state as its metric families show it.
#[derive(Default)]
struct Shown {
    /// 0 none; 1 version; 2 capability; 3 unreadable.
    refused: AtomicU8,
    advertised: AtomicBool,
    /// Bit i: [`Capability::ALL`]`[i]` is enabled in the record.
    enabled: AtomicU32,
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Gate {
    /// A gate for `support`; nothing happens until [`Gate::start`].
    pub fn new(support: Support) -> Arc<Self> {
        Arc::new(Self { support, inner: Mutex::new(Inner::default()), shown: Shown::default() })
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

    /// Advertises on every store's cluster (`stores[0]` is the coord cluster,
    /// which holds the record and the advertisements `lockctl upgrade enable`
    /// reads; the others hold one only for their grants to compare), reads the
    /// record (sealing the stores if it must refuse, writing it first on a fresh
    /// install: [`bootstrap`]), then keeps doing so every second in a task that
    /// ends once the gate is dropped. `listen` tells arbiters apart in the
    /// advertisements. Each store's writers are attached to the gate
    /// ([`Guard`]) before the first round.
    pub async fn start(self: Arc<Self>, stores: Vec<Arc<Store>>, listen: String) -> tokio::task::JoinHandle<()> {
        for s in &stores {
            s.guard().attach();
        }
        // Nothing is served before one round has read the record (and, on a fresh
        // install, written it): a failed round is tried again for a while (an
        // auth-store refusal while roles change, a member electing).
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while !self.tick(&stores, &listen).await && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let weak = Arc::downgrade(&self);
        drop(self);
        tokio::spawn(run(weak, stores, listen))
    }

    /// One round: renew (or put again) each advertisement, then read the record.
    /// Answers whether the record was read (and a fresh keyspace's written).
    async fn tick(&self, stores: &[Arc<Store>], listen: &str) -> bool {
        let Some(coord) = stores.first() else { return true };
        for (i, store) in stores.iter().enumerate() {
            if let Some(id) = store.guard().ad_lease() {
                if let Err(e) = store.cluster().call(store.cluster().client().lease_keep_alive(id)).await {
                    if e.to_string().contains("lease not found") {
                        tracing::warn!(
                            cluster = store.cluster_name(),
                            "the keyspace advertisement lapsed; advertising again"
                        );
                        store.guard().set_ad(None);
                        if i == 0 {
                            lock(&self.inner).lease = None;
                            self.shown.advertised.store(false, Ordering::Relaxed);
                        }
                    }
                }
            }
            if store.guard().ad_lease().is_none() {
                if let Err(e) = self.advertise(store, listen, i == 0).await {
                    if i == 0 {
                        self.etcd_failed(stores, "advertise", &e);
                        return false;
                    }
                    tracing::debug!(cluster = store.cluster_name(), error = %e, "keyspace gate: cannot advertise yet");
                }
            }
        }
        // The record is read after the advertisements' puts (the module docs' second order).
        if planted_ignore_record() {
            // It writes what its build supports, as a build without the record would.
            let own = self.support.capabilities.iter().fold(0, |b, c| b | bit(*c));
            for s in stores {
                s.guard().set_enabled(own);
            }
            return true;
        }
        let mut client = coord.cluster().client();
        let read = async {
            let view = read_view(&mut client, coord.cluster().keys()).await?;
            if view.record.is_none() {
                match bootstrap(&mut client, coord.cluster().keys().root(), listen).await {
                    Ok(Some(rec)) => {
                        tracing::info!(enabled = ?rec.enabled, "a fresh keyspace: wrote its record");
                        return Ok((read_view(&mut client, coord.cluster().keys()).await?, true));
                    }
                    // Another arbiter may have written it meanwhile.
                    Ok(None) => return Ok((read_view(&mut client, coord.cluster().keys()).await?, true)),
                    Err(e) => {
                        tracing::warn!(error = %e, "could not write a fresh keyspace's record (the arbiter's role needs sys/keyspace); nothing is enabled until `lockctl upgrade enable all`");
                        return Ok((view, false));
                    }
                }
            }
            Ok((view, true))
        };
        match tokio::time::timeout(Duration::from_secs(3), read).await {
            Ok(Ok((view, complete))) => {
                // The quotas counted at each arbiter are shared among the live ones.
                coord.runtime().quotas().set_arbiters(view.advertisements.len());
                self.observe(stores, view.record);
                complete
            }
            Ok(Err(UpgradeError::Refused(r))) => {
                self.refuse(stores, r);
                true
            }
            Ok(Err(e)) => {
                self.etcd_failed(stores, "read the keyspace record", &e.to_string());
                false
            }
            Err(_) => false,
        }
    }

    async fn advertise(&self, store: &Store, listen: &str, coord: bool) -> Result<(), String> {
        let mut client = store.cluster().client();
        let lease = store.cluster().call(client.lease_grant(AD_TTL_S, None)).await.map_err(|e| e.to_string())?.id();
        let ad = Advertisement {
            version: self.support.version,
            capabilities: self.support.names().into_iter().map(String::from).collect(),
            build: env!("CARGO_PKG_VERSION").into(),
            listen: listen.into(),
            started_ms: now_ms(),
        };
        let value = serde_json::to_vec(&ad).map_err(|e| e.to_string())?;
        let key = store.cluster().keys().advertisement(lease);
        store
            .cluster()
            .call(client.put(key.as_str(), value, Some(PutOptions::new().with_lease(lease))))
            .await
            .map_err(|e| e.to_string())?;
        store.guard().set_ad(Some((key, lease)));
        if coord {
            let mut g = lock(&self.inner);
            g.lease = Some(lease);
            g.unguarded = None;
            self.shown.advertised.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// etcd refused or failed a gate call. A refused permission (an etcd role
    /// without the grant on `sys/arbiters/` or `sys/keyspace`, which the shipped
    /// `lockmesh-arbiter` role has) fails closed: an arbiter that cannot advertise is
    /// invisible to `lockctl upgrade enable`, which could then enable a capability
    /// it lacks, so it refuses every request (sealed) until restarted with the
    /// grants. A plain failure is retried at the next tick (the lock calls fail
    /// closed on their own).
    fn etcd_failed(&self, stores: &[Arc<Store>], what: &str, e: &str) {
        if e.contains("permission denied") {
            let mut g = lock(&self.inner);
            if g.unguarded.is_none() {
                tracing::error!(error = %e, "cannot {what}: the etcd role lacks the keyspace grants; this arbiter would be invisible to `lockctl upgrade enable`");
            }
            g.unguarded = Some(format!("{what}: {e}"));
            self.shown.advertised.store(false, Ordering::Relaxed);
            drop(g);
            self.refuse(
                stores,
                Refusal::Unreadable(format!(
                    "cannot {what}: the etcd role lacks the keyspace grants (read sys/keyspace, write sys/arbiters/)"
                )),
            );
        } else {
            tracing::debug!(error = %e, "keyspace gate: cannot {what} yet");
        }
    }

    fn observe(&self, stores: &[Arc<Store>], record: Option<KeyspaceRecord>) {
        let refusal = self.support.refusal(record.as_ref());
        let bits = enabled_bits(record.as_ref());
        self.shown.enabled.store(bits, Ordering::Relaxed);
        // What this build may write: enabled in the record and supported here.
        let own = self.support.capabilities.iter().fold(0, |b, c| b | bit(*c));
        let writable = if refusal.is_some() { 0 } else { bits & own };
        for s in stores {
            s.guard().set_enabled(writable);
        }
        lock(&self.inner).record = record;
        if let Some(r) = refusal {
            self.refuse(stores, r);
        }
    }

    fn refuse(&self, stores: &[Arc<Store>], r: Refusal) {
        let mut g = lock(&self.inner);
        if g.refusal.is_none() {
            tracing::error!(code = r.code(), "{r}; this arbiter refuses every request (sealed)");
            self.shown.refused.store(reason_index(&r), Ordering::Relaxed);
            g.refusal = Some(r.clone());
        }
        drop(g);
        for s in stores {
            s.guard().set_enabled(0);
            reseal(s, &r);
        }
    }

    fn reassert(&self, stores: &[Arc<Store>]) {
        if let Some(r) = self.refusal() {
            for s in stores {
                reseal(s, &r);
            }
        }
    }
}

/// Declares the refusal as the store's seal unless one is declared.
fn reseal(store: &Store, r: &Refusal) {
    if store.seal().current().is_none() {
        store.seal().seal(SealReason::Explicit, r.to_string());
    }
}

async fn run(gate: Weak<Gate>, stores: Vec<Arc<Store>>, listen: String) {
    loop {
        let steps = (TICK.as_millis() / RESEAL.as_millis()).max(1);
        for _ in 0..steps {
            tokio::time::sleep(RESEAL).await;
            match gate.upgrade() {
                Some(g) => g.reassert(&stores),
                None => return,
            }
            // A grant that found an advertisement gone does not wait for the tick.
            if stores.iter().any(|s| s.guard().ad_lease().is_none()) {
                break;
            }
        }
        let Some(g) = gate.upgrade() else { return };
        g.tick(&stores, &listen).await;
    }
}

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
pub fn register(registry: &mut Registry, gate: Arc<Gate>) {
    registry.register_collector(Box::new(GateCollector(gate)));
}

struct GateCollector(Arc<Gate>);

impl std::fmt::Debug for GateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GateCollector")
    }
}

impl Collector for GateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let shown = &self.0.shown;
        let refused = shown.refused.load(Ordering::Relaxed);
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
        ConstGauge::new(i64::from(shown.advertised.load(Ordering::Relaxed))).encode(encoder.encode_descriptor(
            "lockmesh_arbiter_keyspace_advertised",
            "1 while this arbiter's capability advertisement is in etcd (lockctl upgrade enable sees it).",
            None,
            MetricType::Gauge,
        )?)?;
        let bits = shown.enabled.load(Ordering::Relaxed);
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
        register(&mut r, Gate::new(Support::full()));
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
