//! The clusters behind one arbiter, and where each request goes (ADR-07, ADR-08,
//! ADR-09; `docs/SCALE.md`).
//!
//! The arbiter holds one [`Store`] per etcd cluster (one client and key root each).
//! A key's store is decided here, never by the caller: keys of the map's coord
//! classes go to the coord cluster, every other key to its entity home (namespace
//! override, else rendezvous over the shards), by the shard map read from the coord
//! cluster (polled every second and re-read whenever a grant meets a moved home
//! record). Routing may be stale; the grant's home fence (`lock::home`) is what
//! makes it safe, and a grant refused with [`LockError::Moved`] is routed again.
//!
//! **Sessions.** A session is one lease id. It is opened on one cluster (the key's
//! home when the open names a key, else its class's tier) and **extended** with the
//! same lease id to any other cluster the first time it holds a key there; its home
//! records the extension. A keepalive renews the lease on every cluster and fails
//! (`session_expired`) if any cluster the session extends to lost it; a close revokes
//! it everywhere; listing its holds reads every cluster it extends to. With one
//! cluster none of this costs anything: every call goes straight to it.
//!
//! **Regions.** A key whose namespace is homed to another region is refused with
//! `421 wrong_region` naming the region, before any etcd is touched; nothing is
//! forwarded.

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock},
    time::Duration,
};

use futures::future::join_all;
use lockmesh_core::{
    class::{OnQuorumLoss, Tier},
    headers::SessionId,
    policy::ChangeNote,
    shard::{rendezvous, ShardMap},
    ClassRegistry, ClassSpec, LockKey,
};
/// The cancellation token the acquire calls take (re-exported for callers without
/// `tokio-util` of their own, such as the scenario tests that drive this library).
pub use tokio_util::sync::CancellationToken;

use crate::{
    failopen::{FailOpen, MemGrant},
    home::{MapRecord, COORD_CLUSTER},
    mutex::{AcquireRequest, Grant},
    now_ms,
    session::{cache, Caller, OwnHold},
    topology::{Region, Topology},
    LockError, Store,
};

/// How many times a request is routed again after a moved home record.
const REROUTES: usize = 3;

/// Whom an acquire holds for, which decides where its session comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldFor<'a> {
    /// A lock API caller: the request's session, or one opened for the acquire.
    Caller,
    /// A transparent request of `vm` behind the Envoy `envoy`: the VM's session
    /// on the key's home cluster; the request's `hold_id` names the hold.
    Vm {
        /// The Envoy's identity (it owns the VM's sessions).
        envoy: &'a str,
        /// The filter VM's id.
        vm: &'a str,
    },
}

/// What an acquire got: an etcd grant, or (a fail-open class during a declared
/// quorum loss, ADR-04) an unprotected one from memory.
pub enum Acquired {
    /// A fenced etcd grant and the cluster that granted it.
    Protected(Grant, Arc<Store>),
    /// An unprotected grant (token 0) and the fail-open state that holds it.
    Unprotected(MemGrant, Arc<FailOpen>),
}

/// Every cluster of one arbiter and its routing view.
pub struct Tiers {
    stores: BTreeMap<String, Arc<Store>>,
    fail_open: BTreeMap<String, Arc<FailOpen>>,
    /// How long a seal check waits for etcd ([`FailOpenSettings::check_timeout_ms`]).
    check_timeout: std::time::Duration,
    entity: Vec<String>,
    region: Option<Region>,
    map: RwLock<Option<ShardMap>>,
    /// The cluster each session was opened on (`session::cache`: bounded, an entry
    /// idle for three of its session's TTLs expires). A session's home never
    /// changes while it lives (it is extended to other clusters, never moved), and
    /// an entry of an ended session only sends a request to a cluster that answers
    /// `session_expired` (every use reads or compares the lease there); so an entry
    /// can cost a re-read, never a grant. Close and revoke-everywhere invalidate it.
    homes: moka::sync::Cache<SessionId, SessionHome>,
    bootstrapped: std::sync::atomic::AtomicBool,
    /// The coord cluster's shard map, home record, class map and class policies
    /// exist (the first part of [`Tiers::bootstrap`]): readiness waits for it, since
    /// a grant on a cluster without its class map answers `unavailable`.
    coord_bootstrapped: std::sync::atomic::AtomicBool,
}

/// Where a session was opened, and its TTL (which decides the entry's expiry).
#[derive(Debug, Clone)]
struct SessionHome {
    cluster: String,
    ttl_s: u64,
}

// === impl SessionHome ===

impl cache::SessionTtl for SessionHome {
    fn ttl_s(&self) -> u64 {
        self.ttl_s
    }
}

// === impl Tiers ===

/// What [`Tiers::connect`] needs of the arbiter's configuration.
#[derive(Debug, Clone, Copy)]
pub struct TiersConfig<'a> {
    /// The clusters besides the coord cluster, and the region.
    pub topology: &'a Topology,
    /// The key root every cluster uses.
    pub root: &'a str,
    /// Timeout of one etcd call.
    pub op_timeout: Duration,
    /// The coord cluster's marks file; other clusters get `<file>.<cluster>`.
    pub marks_file: Option<&'a std::path::Path>,
    /// Fail-open settings (spool files named like the marks files).
    pub fail_open: FailOpenSettings<'a>,
    /// The largest group and etcd's limits, for every cluster (`engine::group`).
    pub group: crate::GroupLimits,
}

/// The fail-open part of [`TiersConfig`].
#[derive(Debug, Clone, Copy)]
pub struct FailOpenSettings<'a> {
    /// The coord cluster's spool file, if fail-open classes may grant.
    pub spool_file: Option<&'a std::path::Path>,
    /// Spool cap, bytes.
    pub max_spool_bytes: u64,
    /// How long etcd must be unreachable before a quorum loss is declared, ms.
    pub quorum_loss_after_ms: u64,
    /// How long a seal check's read and member probe wait for etcd, ms (the
    /// operation timeout if shorter; [`crate::failopen::quorum`]).
    pub check_timeout_ms: u64,
}

impl Tiers {
    /// Connects to every configured cluster. The coord store is `coord`
    /// (connected by the caller from `etcd:`); the others share its runtime.
    pub async fn connect(config: &TiersConfig<'_>, coord: Arc<Store>) -> Result<Self, LockError> {
        let topo: &Topology = config.topology;
        let split = topo.is_split();
        coord.set_cluster(COORD_CLUSTER, split.then_some(&coord));
        coord.set_group_limits(config.group);
        let mut stores = BTreeMap::from([(COORD_CLUSTER.to_owned(), coord.clone())]);
        for c in &topo.clusters {
            let marks = Topology::marks_file(config.marks_file, &c.name);
            let (rt, marks) = (coord.runtime(), marks.as_deref());
            let s = Store::connect_with(&c.endpoints, config.root, config.op_timeout, marks, &c.auth, rt).await?;
            s.set_cluster(&c.name, Some(&coord));
            s.set_group_limits(config.group);
            stores.insert(c.name.clone(), s);
        }
        let fo = &config.fail_open;
        let fail_open = stores
            .keys()
            .map(|name| {
                let spool = Topology::marks_file(fo.spool_file, name);
                let f = FailOpen::open(name, spool.as_deref(), fo.max_spool_bytes, fo.quorum_loss_after_ms);
                (name.clone(), Arc::new(f))
            })
            .collect();
        let check_timeout = std::time::Duration::from_millis(fo.check_timeout_ms);
        Ok(Self { fail_open, check_timeout, ..Self::new(stores, topo.entity.clone(), topo.region.clone()) })
    }

    /// Tiers over connected stores (named already).
    pub fn new(stores: BTreeMap<String, Arc<Store>>, entity: Vec<String>, region: Option<Region>) -> Self {
        for name in stores.keys() {
            crate::vm::RENEWAL_FAILURES.declare(name);
        }
        Self {
            stores,
            fail_open: BTreeMap::new(),
            check_timeout: crate::failopen::quorum::CHECK_TIMEOUT,
            entity,
            region,
            map: RwLock::new(None),
            homes: cache::new(),
            bootstrapped: std::sync::atomic::AtomicBool::new(false),
            coord_bootstrapped: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The coord cluster's store.
    pub fn coord(&self) -> &Arc<Store> {
        &self.stores[COORD_CLUSTER]
    }

    /// A cluster's store by name.
    pub fn get(&self, name: &str) -> Option<&Arc<Store>> {
        self.stores.get(name)
    }

    /// Every store, coord first.
    pub fn stores(&self) -> impl Iterator<Item = &Arc<Store>> {
        std::iter::once(self.coord()).chain(self.stores.iter().filter(|(n, _)| *n != COORD_CLUSTER).map(|(_, s)| s))
    }

    fn split(&self) -> bool {
        self.stores.len() > 1
    }

    /// The fail-open state of a cluster (none without `Tiers::connect`).
    pub fn fail_open(&self, cluster: &str) -> Option<&Arc<FailOpen>> {
        self.fail_open.get(cluster)
    }

    /// Every cluster's fail-open state.
    pub fn fail_opens(&self) -> impl Iterator<Item = &Arc<FailOpen>> {
        self.fail_open.values()
    }

    /// The outcome of one seal check on `store` that started at `started_ms`, for
    /// the fail-open trigger. After a failed read the clients log in again (a
    /// restored member refuses the tokens it issued before), in the background:
    /// during a quorum loss the login waits out its own timeout, and the next
    /// check must not wait for it.
    pub async fn observe_quorum(&self, store: &Arc<Store>, started_ms: u64, read_ok: bool) {
        if let Some(fo) = self.fail_open.get(store.cluster_name()) {
            fo.observe(store, started_ms, read_ok, self.check_timeout).await;
        }
        if !read_ok {
            let store = store.clone();
            tokio::spawn(async move { store.cluster().relogin_after_failed_read().await });
        }
    }

    /// The key's store and its fail-open state, when its class fails open.
    async fn open_home(&self, req: &AcquireRequest) -> Option<(Arc<Store>, Arc<FailOpen>)> {
        if req.class.on_quorum_loss != OnQuorumLoss::Open {
            return None;
        }
        let store = self.route(&req.class, &req.key, false).await.ok()?;
        let fo = self.fail_open.get(store.cluster_name())?.clone();
        Some((store, fo))
    }

    /// [`Tiers::acquire_for`], except for a fail-open class (ADR-04): while its
    /// cluster's quorum loss is declared it is granted unprotected from memory
    /// (a VM's grant is owned by its Envoy); otherwise it first waits until no
    /// unprotected hold of the key is left here, and an etcd grant that fails
    /// `unavailable` falls back to memory only if the loss is declared by then.
    /// The one entry of the lock API's and transparent requests' acquires.
    pub async fn acquire_or_open(
        &self,
        req: &AcquireRequest,
        holder: HoldFor<'_>,
        reg: &ClassRegistry,
        cancel: &CancellationToken,
    ) -> Result<Acquired, LockError> {
        let envoy = match holder {
            HoldFor::Caller => None,
            HoldFor::Vm { envoy, .. } => Some(envoy),
        };
        let open = self.open_home(req).await;
        if let Some((store, fo)) = &open {
            if fo.declared().is_some() {
                let g = fo.grant(store, req, envoy, reg, cancel).await?;
                return Ok(Acquired::Unprotected(g, fo.clone()));
            }
            fo.wait_free(&req.key.digest(), req.deadline, req.try_once, cancel).await?;
        }
        match self.acquire_for(req, holder, cancel).await {
            Ok((g, s)) => Ok(Acquired::Protected(g, s)),
            Err(LockError::Unavailable(m)) => match &open {
                Some((store, fo)) if fo.declared().is_some() => {
                    let g = fo.grant(store, req, envoy, reg, cancel).await?;
                    Ok(Acquired::Unprotected(g, fo.clone()))
                }
                _ => Err(LockError::Unavailable(m)),
            },
            Err(e) => Err(e),
        }
    }

    /// Releases unprotected grant `grant` of `key` (any cluster's: memory only).
    pub async fn release_unprotected(&self, key: &LockKey, grant: &str, caller: &Caller) -> Result<(), LockError> {
        let d = key.digest();
        for fo in self.fail_open.values() {
            if fo.release(&d, grant, caller, None).await.is_ok() {
                return Ok(());
            }
        }
        Err(LockError::NotHolder)
    }

    /// Releases the unprotected transparent hold `hold_id` of `key`; false when
    /// there is none here.
    pub async fn release_unprotected_hold(&self, key: &LockKey, hold_id: &str, envoy: &str) -> bool {
        let d = key.digest();
        for fo in self.fail_open.values() {
            if fo.release_hold(&d, hold_id, envoy).await {
                return true;
            }
        }
        false
    }

    /// Creates what is missing: the coord cluster's shard map (from the config's
    /// entity clusters and the registry's coord classes), every cluster's home
    /// record (from that map) and class policy records. The first writer wins.
    pub async fn bootstrap(&self, reg: &ClassRegistry) -> Result<(), LockError> {
        let coord = self.coord();
        if coord.home().read_map().await?.is_none() {
            let coord_classes = reg.classes().iter().filter(|c| c.tier == Tier::Coord).map(|c| c.name.to_string());
            let map = ShardMap::initial(COORD_CLUSTER, &self.entity, coord_classes);
            let rec = MapRecord {
                current: map,
                pending: None,
                last: ChangeNote {
                    actor: "arbiter".into(),
                    reason: "bootstrap from the arbiter config and registry".into(),
                    at_ms: now_ms(),
                    action: "create".into(),
                },
            };
            coord.home().put_map(&rec, 0).await?;
        }
        let (map, _) = coord.home().read_map().await?.ok_or_else(|| LockError::Unavailable("no shard map".into()))?;
        for c in map.current.clusters() {
            if !self.stores.contains_key(&c) {
                tracing::warn!(cluster = %c, "the shard map homes keys on a cluster this arbiter's config does not name; its keys answer unavailable here");
            }
        }
        for s in self.stores() {
            s.home().create_if_missing(&map).await?;
            s.policies().bootstrap(reg).await?;
            if s.cluster_name() == COORD_CLUSTER {
                self.coord_bootstrapped.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.warn_tiers(reg, &map.current);
        self.set_map(map.current);
        self.bootstrapped.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Whether the coord cluster's records exist (its part of [`Tiers::bootstrap`]
    /// succeeded once). Until then the arbiter is not ready: every grant there would
    /// answer `unavailable`. A lost entity shard does not hold readiness back; its
    /// keys answer `unavailable` until its records exist.
    pub fn coord_bootstrapped(&self) -> bool {
        self.coord_bootstrapped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Creates missing class policy records on every cluster (a registry reload).
    pub async fn bootstrap_policies(&self, reg: &ClassRegistry) -> Result<(), LockError> {
        for s in self.stores() {
            s.policies().bootstrap(reg).await?;
        }
        if let Some(m) = self.current_map() {
            self.warn_tiers(reg, &m);
        }
        Ok(())
    }

    fn warn_tiers(&self, reg: &ClassRegistry, map: &ShardMap) {
        for c in reg.classes() {
            if (c.tier == Tier::Coord) != map.coord_classes.contains(c.name.as_str()) {
                tracing::warn!(class = %c.name, "the registry's tier of this class differs from the shard map's; it takes effect through lockctl shard apply (a fenced move), not before");
            }
        }
    }

    /// One cluster's seal round: its seal check, then the fail-open trigger with
    /// the outcome. The arbiter runs one round a second **per cluster, each in its
    /// own task** ([`Tiers::spawn_seal_rounds`]): a round of a stalled cluster lasts
    /// several operation timeouts (the read, a login, the member probe), and
    /// another cluster's quorum loss must still be declared, and ended, within
    /// seconds of its own checks (GUARANTEES G8h).
    pub async fn seal_round(&self, store: &Arc<Store>) -> Result<(), LockError> {
        static IN_TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _turn = match crate::test_faults::on(crate::test_faults::TestFault::SealRoundsInTurn) {
            true => Some(IN_TURN.lock().await), // PLANTED FAULT seal_rounds_in_turn
            false => None,
        };
        // Bounded by the fail-open check's timeout (`failopen::quorum`): a read
        // etcd has not answered by then fails the check.
        let started_ms = now_ms();
        let within = self.check_timeout.min(store.cluster().op_timeout());
        let r = match tokio::time::timeout(within, store.epoch().check_seal()).await {
            Ok(r) => r,
            Err(_) => Err(LockError::Unavailable(format!("the seal check got no answer within {within:?}"))),
        };
        self.observe_quorum(store, started_ms, r.is_ok()).await;
        r
    }

    /// Starts every cluster's seal round, once a second each (the coord cluster's
    /// included); `each` runs after every round with its store, outcome and length.
    pub fn spawn_seal_rounds(
        self: &Arc<Self>,
        each: impl Fn(&Store, &Result<(), LockError>, std::time::Duration) + Clone + Send + Sync + 'static,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        self.stores()
            .cloned()
            .map(|store| {
                let (tiers, each) = (self.clone(), each.clone());
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        if crate::test_faults::on(crate::test_faults::TestFault::NoSealRound) {
                            continue; // TEST SWITCH (restore scenario): requests alone notice a restore
                        }
                        let started = tokio::time::Instant::now();
                        let r = tiers.seal_round(&store).await;
                        each(&store, &r, started.elapsed());
                    }
                })
            })
            .collect()
    }

    /// One background round (every second): the bootstrap until it succeeded,
    /// and a fresh read of the shard map. (Seal checks run in their own tasks,
    /// [`Tiers::spawn_seal_rounds`].)
    pub async fn tick(&self, reg: &ClassRegistry) {
        if !self.bootstrapped.load(std::sync::atomic::Ordering::Relaxed) {
            if let Err(e) = self.bootstrap(reg).await {
                tracing::debug!(error = %e, "could not create the shard map or home records yet");
            }
            return;
        }
        if !self.split() || crate::test_faults::on(crate::test_faults::TestFault::SkipHomeGate) {
            return;
        }
        if let Err(e) = self.refresh_map().await {
            tracing::debug!(error = %e, "could not read the shard map");
        }
    }

    fn set_map(&self, m: ShardMap) {
        for s in self.stores.values() {
            s.home().cell().raise_floor(m.version);
        }
        let mut g = self.map.write().unwrap_or_else(|p| p.into_inner());
        if g.as_ref().is_none_or(|old| old.version <= m.version) {
            *g = Some(m);
        }
    }

    /// The routing map, as last read.
    pub(crate) fn current_map(&self) -> Option<ShardMap> {
        self.map.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Reads the coord map now.
    pub(crate) async fn refresh_map(&self) -> Result<ShardMap, LockError> {
        let (rec, _) =
            self.coord().home().read_map().await?.ok_or_else(|| LockError::Unavailable("no shard map yet".into()))?;
        self.set_map(rec.current.clone());
        Ok(rec.current)
    }

    async fn map(&self, fresh: bool) -> Result<ShardMap, LockError> {
        match self.current_map() {
            Some(m) if !fresh => Ok(m),
            cached => match self.refresh_map().await {
                // Never read (an arbiter started while the coord cluster was lost):
                // no key can be routed, a healthy shard's included (docs/SCALE.md).
                Err(LockError::Unavailable(m)) if cached.is_none() && !m.starts_with("no shard map") => {
                    Err(LockError::Unavailable(format!(
                        "no shard map yet: the coord cluster, which holds it, cannot be read ({m}); this arbiter \
                         routes no key until it can"
                    )))
                }
                r => r,
            },
        }
    }

    /// The store of `key` of class `class`; `fresh` re-reads the map first.
    pub async fn route(&self, class: &ClassSpec, key: &LockKey, fresh: bool) -> Result<Arc<Store>, LockError> {
        if !self.split() {
            return Ok(self.coord().clone());
        }
        let map = self.map(fresh).await?;
        let home = map.home(class.name.as_str(), key.as_str()).unwrap_or(COORD_CLUSTER);
        self.stores.get(home).cloned().ok_or_else(|| {
            LockError::Unavailable(format!(
                "the shard map homes this key on cluster {home}, which this arbiter's config does not name"
            ))
        })
    }

    /// The store a session of `class` opens on when no key is named: the coord
    /// cluster for a coord class, else the shard the class's name hashes to.
    async fn class_home(&self, class: &ClassSpec) -> Result<Arc<Store>, LockError> {
        if !self.split() {
            return Ok(self.coord().clone());
        }
        let map = self.map(false).await?;
        let home = if map.coord_classes.contains(class.name.as_str()) {
            COORD_CLUSTER
        } else {
            rendezvous(&map.shards, class.name.as_str()).unwrap_or(COORD_CLUSTER)
        };
        Ok(self.stores.get(home).unwrap_or(self.coord()).clone())
    }

    /// The region `key`'s namespace is homed to, when it is not this arbiter's.
    pub fn wrong_region(&self, key: &LockKey) -> Option<&str> {
        self.region.as_ref()?.elsewhere(key.namespace())
    }

    /// Acquires on the key's home, routing again after a moved home record. The
    /// grant's store comes back with it (a lost answer is undone there).
    pub async fn acquire(
        &self,
        req: &AcquireRequest,
        cancel: &CancellationToken,
    ) -> Result<(Grant, Arc<Store>), LockError> {
        self.acquire_for(req, HoldFor::Caller, cancel).await
    }

    /// [`Tiers::acquire`] for `holder`. A VM's session is the one of its class
    /// on the key's home cluster (found or opened there, [`Store::vm_session`]);
    /// one that expired, or whose TTL is not the class's (another arbiter's
    /// registry disagrees, or a TTL change retired it), is forgotten and replaced
    /// once. A key whose home moved is routed again, up to `REROUTES` times.
    pub async fn acquire_for(
        &self,
        req: &AcquireRequest,
        holder: HoldFor<'_>,
        cancel: &CancellationToken,
    ) -> Result<(Grant, Arc<Store>), LockError> {
        let (mut attempt, mut replaced) = (0, false);
        while attempt <= REROUTES {
            let store = self.route(&req.class, &req.key, attempt > 0).await?;
            let r = match holder {
                HoldFor::Caller => {
                    if let Some(sid) = req.session {
                        self.ensure_session(sid, req.session_owner.as_ref().unwrap_or(&req.caller), &store).await?;
                    }
                    store.acquire(req, cancel).await
                }
                HoldFor::Vm { envoy, vm } => {
                    let sid = store.vm_session(envoy, vm, &req.class).await?;
                    store.acquire(&AcquireRequest { session: Some(sid), ..req.clone() }, cancel).await
                }
            };
            match r {
                Err(LockError::Moved) => attempt += 1,
                Err(LockError::SessionExpired | LockError::SessionClassMismatch { .. })
                    if !replaced && matches!(holder, HoldFor::Vm { .. }) =>
                {
                    replaced = true;
                    if let HoldFor::Vm { vm, .. } = holder {
                        store.forget_vm_session(vm, req.class.name.as_str(), req.class.ttl_s).await;
                    }
                }
                Ok(g) => {
                    if g.new_session {
                        self.remember_home(g.session, &store, req.class.ttl_s);
                    }
                    return Ok((g, store));
                }
                Err(e) => return Err(e),
            }
        }
        Err(LockError::Unavailable("the key's home keeps moving; retry".into()))
    }

    /// Acquires every key of `reqs` (a multi-key acquire, `multi`) on their one
    /// home cluster; keys homed on different clusters are refused
    /// (`KeysSpanClusters`), since no one transaction can grant them.
    pub async fn acquire_all(
        &self,
        reqs: &[AcquireRequest],
        cancel: &CancellationToken,
    ) -> Result<(Vec<Grant>, Arc<Store>), LockError> {
        let first = reqs.first().ok_or_else(|| LockError::Internal("a multi-key acquire without keys".into()))?;
        for attempt in 0..=REROUTES {
            let mut stores: Vec<Arc<Store>> = Vec::with_capacity(reqs.len());
            for r in reqs {
                let s = self.route(&r.class, &r.key, attempt > 0).await?;
                if !stores.iter().any(|t| Arc::ptr_eq(t, &s)) {
                    stores.push(s);
                }
            }
            if stores.len() > 1 {
                return Err(LockError::KeysSpanClusters(stores.len()));
            }
            let store = stores.remove(0);
            if let Some(sid) = first.session {
                self.ensure_session(sid, first.session_owner.as_ref().unwrap_or(&first.caller), &store).await?;
            }
            match store.acquire_all(reqs, cancel).await {
                Err(LockError::Moved) => continue,
                Ok(gs) => {
                    if gs.first().is_some_and(|g| g.new_session) {
                        self.remember_home(gs[0].session, &store, first.class.ttl_s);
                    }
                    return Ok((gs, store));
                }
                Err(e) => return Err(e),
            }
        }
        Err(LockError::Unavailable("the keys' home keeps moving; retry".into()))
    }

    /// Opens a session of `class` on the home of `key` (or of the class); it
    /// counts against quota namespace `ns` (`ClassRegistry::session_namespace`).
    pub async fn open_session(
        &self,
        caller: &Caller,
        class: &ClassSpec,
        key: Option<&LockKey>,
        ns: &str,
    ) -> Result<SessionId, LockError> {
        let store = match key {
            Some(k) => self.route(class, k, false).await?,
            None => self.class_home(class).await?,
        };
        let sid = store.open_session(caller, class, ns).await?;
        self.remember_home(sid, &store, class.ttl_s);
        Ok(sid)
    }

    /// The cluster session `sid` was opened on: cached, else found by reading its
    /// record on every cluster.
    async fn session_home(&self, sid: SessionId) -> Result<Arc<Store>, LockError> {
        if !self.split() {
            return Ok(self.coord().clone());
        }
        if let Some(h) = self.homes.get(&sid) {
            if let Some(s) = self.stores.get(&h.cluster) {
                return Ok(s.clone());
            }
        }
        let reads = join_all(self.stores.values().map(|s| s.session_copy(sid))).await;
        let mut home = None;
        for (name, r) in self.stores.keys().zip(reads) {
            if let Ok(Some(c)) = r {
                home = Some((c.home.unwrap_or_else(|| name.clone()), c.record.ttl_s));
                break;
            }
        }
        let (home, ttl_s) = home.ok_or(LockError::SessionExpired)?;
        let store = self.stores.get(&home).cloned().ok_or(LockError::SessionExpired)?;
        self.homes.insert(sid, SessionHome { cluster: home, ttl_s });
        Ok(store)
    }

    fn remember_home(&self, sid: SessionId, store: &Store, ttl_s: u64) {
        self.homes.insert(sid, SessionHome { cluster: store.cluster_name().to_owned(), ttl_s });
    }

    /// Makes session `sid` (owned by `owner`) usable on `target`: nothing when it
    /// was opened there or already extends there, else an extension (its home's
    /// lease must be alive), recorded on its home.
    async fn ensure_session(&self, sid: SessionId, owner: &Caller, target: &Arc<Store>) -> Result<(), LockError> {
        if !self.split() {
            return Ok(());
        }
        let home = self.session_home(sid).await?;
        if Arc::ptr_eq(&home, target) {
            return Ok(());
        }
        // A session homed on a sealed cluster is doomed: the guarded epoch advance
        // revokes it, and closes its extensions with their holds. Nothing is
        // granted on it elsewhere meanwhile (its keepalive answers `sealed` too).
        if !crate::test_faults::on(crate::test_faults::TestFault::SessionsIgnoreSeal) {
            home.serving().await?;
        }
        // Already extended there (the record is cached after the first use; the
        // grant compares the lease in any case).
        match target.owned_session(sid, owner).await {
            Ok(_) => return Ok(()),
            Err(LockError::SessionExpired) => {}
            Err(e) => return Err(e),
        }
        let rec = home.owned_session(sid, owner).await?;
        if !home.lease_alive(sid).await? {
            home.forget_session(sid).await;
            return Err(LockError::SessionExpired);
        }
        target.extend_session(sid, &rec, home.cluster_name()).await?;
        if let Err(e) = home.mark_extension(sid, target.cluster_name()).await {
            let _ = target.revoke_lease(sid).await;
            return Err(e);
        }
        tracing::debug!(home = home.cluster_name(), to = target.cluster_name(), "session extended to another cluster");
        Ok(())
    }

    /// Renews a session everywhere; `SessionExpired` (and the session revoked
    /// everywhere) when a cluster it extends to lost it. Returns the TTL.
    pub async fn keepalive(&self, sid: SessionId, caller: &Caller) -> Result<u64, LockError> {
        let home = self.session_home(sid).await?;
        if !self.split() {
            return home.keepalive(sid, caller).await;
        }
        let others: Vec<&Arc<Store>> = self.stores.values().filter(|s| !Arc::ptr_eq(s, &home)).collect();
        if crate::test_faults::on(crate::test_faults::TestFault::RenewInTurn) {
            // PLANTED BUG (split scenarios): in turn, after the home, stopping at
            // the first failure.
            let ttl = home.keepalive(sid, caller).await?;
            let marked = home.extensions(sid).await?;
            for s in others {
                if !s.renew_lease(sid).await? && marked.iter().any(|m| m == s.cluster_name()) {
                    self.revoke_everywhere(sid).await;
                    return Err(LockError::SessionExpired);
                }
            }
            return Ok(ttl);
        }
        // The session's leases on the other clusters are renewed beside the home's
        // renewal, not after its success: a home that lost its quorum must not take
        // the session's holds on healthy clusters with it (the home's error still
        // reaches the holder, which is in jeopardy until a keepalive succeeds). Only
        // for the session's owner, as the home knows it (its record is cached where
        // the session was used).
        home.owned_session(sid, caller).await?;
        // A sealed cluster renews nothing (`Store::renewable`). The session's
        // holder is told (`sealed`) and is in jeopardy meanwhile; its lease there
        // lapses, and the guarded advance ends it everywhere anyway.
        home.renewable()?;
        // In a task of their own: a home that fails answers at once (a lost shard
        // takes an op timeout to answer), and the renewals still complete.
        let stores: Vec<Arc<Store>> = others.iter().map(|s| Arc::clone(s)).collect();
        let renewals = tokio::spawn(async move { join_all(stores.iter().map(|s| s.renew_unsealed(sid))).await });
        let ttl = home.keepalive(sid, caller).await?;
        let renewed = renewals.await.map_err(|e| LockError::Internal(format!("the renewals' task failed: {e}")))?;
        let marked = home.extensions(sid).await?;
        self.check_extensions(sid, &others, &marked, renewed).await?;
        Ok(ttl)
    }

    /// The renewals `renewed` of session `sid` on the clusters `others`: a lease
    /// lost on a cluster it extends to (`marked`) ends it everywhere.
    async fn check_extensions(
        &self,
        sid: SessionId,
        others: &[&Arc<Store>],
        marked: &[String],
        renewed: Vec<Result<bool, LockError>>,
    ) -> Result<(), LockError> {
        for (s, r) in others.iter().zip(renewed) {
            if !marked.iter().any(|m| m == s.cluster_name()) {
                continue;
            }
            match r {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!(
                        cluster = s.cluster_name(),
                        "a session lost its lease on a cluster it extends to: revoking it everywhere"
                    );
                    self.revoke_everywhere(sid).await;
                    return Err(LockError::SessionExpired);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn revoke_everywhere(&self, sid: SessionId) {
        for s in self.stores.values() {
            if let Err(e) = s.revoke_lease(sid).await {
                tracing::warn!(cluster = s.cluster_name(), error = %e, "could not revoke a lost session; it expires with its ttl");
            }
        }
        self.homes.invalidate(&sid);
    }

    /// Closes a session on every cluster (its home last).
    pub async fn close_session(&self, sid: SessionId, caller: &Caller) -> Result<(), LockError> {
        let home = self.session_home(sid).await?;
        if self.split() {
            home.owned_session(sid, caller).await?;
            // Each cluster it extends to ends it as a close too (its own close
            // marker), not as a bare revoke its delay watch and audit would read
            // as an expiry.
            for s in self.stores.values().filter(|s| !Arc::ptr_eq(s, &home)) {
                if crate::test_faults::on(crate::test_faults::TestFault::ExtensionBareRevoke) {
                    s.revoke_lease(sid).await?; // PLANTED BUG (recipe_edges scenario).
                } else {
                    s.end_session(sid).await?;
                }
            }
        }
        self.homes.invalidate(&sid);
        home.close_session(sid, caller).await
    }

    /// Whether an acquire opened session `sid` for itself (`SessionRecord::by_acquire`,
    /// the header-only path) rather than `POST /v1/sessions`. Right after a release
    /// naming the session its record is cached: no read.
    pub async fn opened_by_acquire(&self, sid: SessionId, caller: &Caller) -> Result<bool, LockError> {
        Ok(self.session_home(sid).await?.owned_session(sid, caller).await?.by_acquire)
    }

    /// Ends session `sid`, which an acquire opened ([`Tiers::opened_by_acquire`]),
    /// if it holds nothing any more, as a close: the audit reads a release and a
    /// close, never an expiry, and the lease does not linger for its TTL counted
    /// against the namespace's session quota. Answers whether it ended it.
    ///
    /// "Holds nothing" is decided once, by the home's closing transaction
    /// ([`Store::close_if_spent`]: the session's hold index empty, its record
    /// deleted, which every grant on it compares), not by the read before it: a
    /// grant on the session that commits after the read keeps it open, and one
    /// after the close is refused `session_expired`. The read stays for holds
    /// granted before their session's index existed and for the clusters a split
    /// session extends to (docs/GUARANTEES.md says what a grant there may race).
    pub async fn end_if_spent(&self, sid: SessionId, caller: &Caller) -> Result<bool, LockError> {
        if !self.session_holds(sid, caller).await?.is_empty() {
            return Ok(false);
        }
        let home = self.session_home(sid).await?;
        if !home.close_if_spent(sid, caller).await? {
            return Ok(false);
        }
        if self.split() {
            for s in self.stores.values().filter(|s| !Arc::ptr_eq(s, &home)) {
                if let Err(e) = s.end_session(sid).await {
                    tracing::warn!(cluster = s.cluster_name(), error = %e, "could not close a closed session's extension; it expires with its ttl");
                }
            }
        }
        self.homes.invalidate(&sid);
        Ok(true)
    }

    /// Every hold of a session, on every cluster it extends to.
    pub async fn session_holds(&self, sid: SessionId, caller: &Caller) -> Result<Vec<OwnHold>, LockError> {
        let home = self.session_home(sid).await?;
        let mut holds = home.session_holds(sid, caller).await?;
        if self.split() {
            for c in home.extensions(sid).await? {
                let Some(s) = self.stores.get(&c) else { continue };
                match s.session_holds(sid, caller).await {
                    Ok(h) => holds.extend(h),
                    // Lost there: the next keepalive says so.
                    Err(LockError::SessionExpired) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(holds)
    }

    /// Releases grant `token` of `key` on its home. A stale routing view (the map
    /// moved) is corrected once; a session that lives elsewhere but not here
    /// answers `not_holder`, not `session_expired`.
    pub async fn release(
        &self,
        class: &ClassSpec,
        key: &LockKey,
        token: lockmesh_core::FencingToken,
        caller: &Caller,
        session: Option<SessionId>,
    ) -> Result<(), LockError> {
        let mut store = self.route(class, key, false).await?;
        for attempt in 0..2 {
            match store.release(key, token, caller, session).await {
                Err(e @ (LockError::NotHolder | LockError::SessionExpired)) if self.split() => {
                    if attempt == 0 {
                        let fresh = self.route(class, key, true).await?;
                        if !Arc::ptr_eq(&fresh, &store) {
                            store = fresh;
                            continue;
                        }
                    }
                    if e == LockError::SessionExpired {
                        if let Some(sid) = session {
                            if self.alive_elsewhere(sid, &store).await {
                                return Err(LockError::NotHolder);
                            }
                        }
                    }
                    return Err(e);
                }
                r => return r,
            }
        }
        Err(LockError::NotHolder)
    }

    /// True when session `sid` is alive on its home and that home is not `here`.
    async fn alive_elsewhere(&self, sid: SessionId, here: &Arc<Store>) -> bool {
        match self.session_home(sid).await {
            Ok(home) if !Arc::ptr_eq(&home, here) => home.lease_alive(sid).await.unwrap_or(false),
            _ => false,
        }
    }

    /// The holders of `key` on its home. A session that does not extend there
    /// holds nothing there: it is checked on its home and not shown as a holder.
    pub async fn inspect(
        &self,
        class: &ClassSpec,
        key: &LockKey,
        caller: &Caller,
        session: Option<SessionId>,
    ) -> Result<(Vec<crate::mutex::HolderView>, Arc<Store>), LockError> {
        let store = self.route(class, key, false).await?;
        let mut session = session;
        if let (true, Some(sid)) = (self.split(), session) {
            if store.session_copy(sid).await?.is_none() {
                self.session_home(sid).await?.owned_session(sid, caller).await?;
                session = None;
            }
        }
        let holders = store.inspect(key, caller, session).await?;
        Ok((holders, store))
    }

    /// ValidateToken on the key's home (a stale routing view corrected once).
    /// `Sealed` when that cluster is sealed, by its record or by this arbiter's
    /// check (a restored shard: its holds are not current whatever they say).
    pub async fn is_current(
        &self,
        class: &ClassSpec,
        key: &LockKey,
        token: lockmesh_core::FencingToken,
    ) -> Result<bool, LockError> {
        let store = self.route(class, key, false).await?;
        store.unsealed()?;
        let current = crate::validate::is_current(&store, key, token).await?;
        if current || !self.split() {
            return Ok(current);
        }
        let fresh = self.route(class, key, true).await?;
        if Arc::ptr_eq(&fresh, &store) {
            return Ok(false);
        }
        fresh.unsealed()?;
        crate::validate::is_current(&fresh, key, token).await
    }

    /// Renews every transparent-mode VM session of `vm` on every cluster, each
    /// cluster on its own (at once): a cluster that cannot be reached, or a session
    /// there that cannot be renewed, stops nothing elsewhere. Each failure is
    /// counted for its cluster in [`crate::vm::RENEWAL_FAILURES`]; the answer is an
    /// error only when no cluster could be read at all, and its `min_ttl_s` is 0
    /// while any cluster failed (the filter then polls every second).
    pub async fn vm_keepalive(
        &self,
        envoy: &str,
        vm: &str,
        reconcile: Option<&crate::vm::Reconcile>,
    ) -> Result<crate::vm::VmStatus, LockError> {
        if crate::test_faults::on(crate::test_faults::TestFault::RenewInTurn) {
            return self.vm_keepalive_in_turn(envoy, vm, reconcile).await;
        }
        let stores: Vec<&Arc<Store>> = self.stores().collect();
        let answers = join_all(stores.iter().map(|s| s.vm_keepalive(envoy, vm, reconcile))).await;
        let mut total = crate::vm::VmStatus::default();
        let (mut answered, mut first_err, mut partial) = (0, None, false);
        for (s, r) in stores.iter().zip(answers) {
            match r {
                Ok(st) => {
                    answered += 1;
                    total.sessions += st.sessions;
                    total.reconciled += st.reconciled;
                    total.failed += st.failed;
                    if st.failed > 0 {
                        partial = true;
                        crate::vm::RENEWAL_FAILURES.add(s.cluster_name(), st.failed as u64);
                    }
                    if st.min_ttl_s > 0 {
                        total.min_ttl_s =
                            if total.min_ttl_s == 0 { st.min_ttl_s } else { total.min_ttl_s.min(st.min_ttl_s) };
                    }
                }
                Err(e) => {
                    partial = true;
                    crate::vm::RENEWAL_FAILURES.add(s.cluster_name(), 1);
                    tracing::warn!(cluster = s.cluster_name(), error = %e, "could not renew a VM's sessions on this cluster; the other clusters are renewed");
                    first_err.get_or_insert(e);
                }
            }
        }
        if answered == 0 {
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        if partial {
            total.min_ttl_s = 0;
        }
        Ok(total)
    }

    /// [`Tiers::vm_keepalive`] with [`crate::test_faults::TestFault::RenewInTurn`]
    /// planted: the clusters in turn, coord first, stopping at the first that fails.
    async fn vm_keepalive_in_turn(
        &self,
        envoy: &str,
        vm: &str,
        reconcile: Option<&crate::vm::Reconcile>,
    ) -> Result<crate::vm::VmStatus, LockError> {
        let mut total = crate::vm::VmStatus::default();
        for s in self.stores() {
            let st = s.vm_keepalive(envoy, vm, reconcile).await?; // PLANTED BUG (split scenarios)
            total.sessions += st.sessions;
            total.reconciled += st.reconciled;
            total.failed += st.failed;
            if st.min_ttl_s > 0 {
                total.min_ttl_s = if total.min_ttl_s == 0 { st.min_ttl_s } else { total.min_ttl_s.min(st.min_ttl_s) };
            }
        }
        Ok(total)
    }
}
