//! Which cluster a key lives on, and the fence every grant passes (ADR-07, ADR-09;
//! `docs/SCALE.md`).
//!
//! ```text
//! coord cluster:  <root>/sys/shardmap     MapRecord {current, pending?}     no lease
//!                 <root>/sys/epochs       {"last": E}, the epoch counter     no lease
//! every cluster:  <root>/sys/home         HomeRecord {cluster, current, pending?}
//!                 <root>/sx/<sid>/<name>  "this session extends to <name>"   session lease
//! ```
//!
//! The coord cluster's map is what arbiters **route** by; it may be stale in any
//! arbiter. What makes a grant safe is the granting cluster's own home record: a
//! grant of key `k` of class `c` on cluster `X` commits only if `X`'s record, whose
//! mod revision the grant transaction compares ([`HomeGate`]), homes `k` on `X` under
//! its current map **and** under its pending map, if a move is in progress. The move
//! protocol (`crate::shardctl`) writes the pending map into every cluster before it
//! verifies that the moving keys have no holds left on their old home, and clears it
//! (resume) only after the coord map flipped: so a key never has grants on two
//! clusters, and the new home's first grant comes after the old home's last hold
//! ended and after its epoch was advanced above the old home's.
//!
//! Epochs of every cluster are allocated from the coord cluster's counter
//! ([`Home::allocate_epoch`]), so two clusters created through it never share one.
//! A move that needs it advances the new home's epoch **softly**
//! ([`crate::epoch::Epoch::advance_above`]): the record keeps its older epochs in
//! `prior`, because holds granted under them are still live (unlike a restore
//! advance, which deletes every hold).
//!
//! A session is one lease id; it is opened on one cluster (its home) and extended
//! to another cluster, with the same lease id, the first time it holds a key there
//! ([`Store::extend_session`]); the home keeps a marker per extension, so keepalive,
//! close and listing reach every cluster the session touched (`crate::tiers`).

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc, Mutex, OnceLock, Weak,
};

use etcd_client::{Compare, CompareOp, GetOptions, LeaseGrantOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use lockmesh_core::{headers::SessionId, policy::ChangeNote, shard::ShardMap, LockKey};
use serde::{Deserialize, Serialize};

use super::{
    epoch::{cluster_hex, EpochRecord, FIRST_EPOCH},
    now_ms, LockError, SessionRecord, Store,
};
pub use lockmesh_keyspace::home::{Admit, ExtensionRecord, HomeRecord, MapRecord, COORD_CLUSTER};

/// Epochs stay below 2^15 (ADR-02).
const EPOCH_LIMIT: u64 = 1 << 15;

/// The compare one grant transaction adds: the home record it was decided on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HomeGate {
    key: String,
    rev: i64,
}

/// A store's cluster identity and cached home record.
pub struct HomeCell {
    root: String,
    name: OnceLock<String>,
    epoch_source: OnceLock<Weak<Home>>,
    record: Mutex<Option<(HomeRecord, i64)>>,
    /// The newest coord map version this arbiter has read: a record behind it
    /// (a restored cluster) admits nothing until repaired.
    floor: AtomicU64,
}

/// The epoch counter on the coord cluster.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct EpochCounter {
    last: u64,
}

pub(crate) fn internal(e: impl std::fmt::Display) -> LockError {
    LockError::Internal(e.to_string())
}

fn note(actor: &str, action: &str, reason: &str) -> ChangeNote {
    ChangeNote { actor: actor.into(), reason: reason.into(), at_ms: now_ms(), action: action.into() }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// === impl HomeGate ===

impl HomeGate {
    /// The compare a grant transaction adds.
    pub fn compare(&self) -> Compare {
        Compare::mod_revision(self.key.as_str(), CompareOp::Equal, self.rev)
    }

    /// Adds the read of its failure branch.
    pub(crate) fn add_read(&self, b: &mut crate::engine::txn::TxnBuilder) -> crate::engine::txn::Read {
        b.read(crate::engine::txn::Branch::Failure, self.key.as_str(), None)
    }

    #[cfg(test)]
    pub(crate) fn for_test(key: &str, rev: i64) -> Self {
        Self { key: key.into(), rev }
    }

    /// True when `got` (the failure branch's read) shows another record.
    pub fn moved(&self, got: Option<&etcd_client::GetResponse>) -> bool {
        got.and_then(|g| g.kvs().first()).map_or(0, etcd_client::KeyValue::mod_revision) != self.rev
    }
}

// === impl HomeCell ===

impl HomeCell {
    /// The cell of a store under `root`.
    pub fn new(root: &str) -> Self {
        Self {
            root: root.trim_end_matches('/').to_owned(),
            name: OnceLock::new(),
            epoch_source: OnceLock::new(),
            record: Mutex::new(None),
            floor: AtomicU64::new(0),
        }
    }

    /// Raises the map version this cluster's record must have reached.
    pub(crate) fn raise_floor(&self, version: u64) {
        self.floor.fetch_max(version, Ordering::Relaxed);
    }

    /// `<root>/sys/home`.
    pub fn home_key(&self) -> String {
        format!("{}/sys/home", self.root)
    }

    /// `<root>/sys/shardmap` (coord cluster).
    pub fn map_key(&self) -> String {
        format!("{}/sys/shardmap", self.root)
    }

    /// `<root>/sys/epochs` (coord cluster).
    pub(crate) fn counter_key(&self) -> String {
        format!("{}/sys/epochs", self.root)
    }

    /// `<root>/sx/<sid>/`, the extension markers of a session (on its home).
    pub(crate) fn extensions_prefix(&self, sid: SessionId) -> String {
        format!("{}/sx/{sid}/", self.root)
    }
}

/// The home of one cluster's keys: its home record (read, cached, written),
/// the coord map, the epoch counter, and the fence every grant passes.
pub struct Home {
    cluster: Arc<crate::Cluster>,
    cell: HomeCell,
}

// === impl Home ===

impl Home {
    pub(crate) fn new(cluster: Arc<crate::Cluster>, root: &str) -> Self {
        Self { cluster, cell: HomeCell::new(root) }
    }

    /// The record keys and cached record.
    pub(crate) fn cell(&self) -> &HomeCell {
        &self.cell
    }

    /// This cluster's name ([`COORD_CLUSTER`] unless set).
    pub fn name(&self) -> &str {
        self.cell.name.get().map_or(COORD_CLUSTER, String::as_str)
    }

    /// [`Home::allocate_epoch`] for an operator tool (`lockctl epoch-advance
    /// --epochs-from`): an epoch above `floor` and above every epoch the coord
    /// counter ever handed out, so a shard restored or advanced by hand never
    /// shares an epoch with another cluster. Call it on the coord cluster.
    pub async fn allocate_epoch_above(&self, floor: u64) -> Result<u64, LockError> {
        self.allocate_epoch(floor).await
    }

    /// Allocates a new epoch above `floor` from this (coord) cluster's counter: one
    /// above the counter, this cluster's own epoch record and `floor`.
    pub(crate) async fn allocate_epoch(&self, floor: u64) -> Result<u64, LockError> {
        let ck = self.cell.counter_key();
        for _ in 0..5 {
            let r = self
                .cluster
                .call(self.cluster.client().txn(
                    Txn::new().and_then([TxnOp::get(ck.as_str(), None), TxnOp::get(self.cluster.keys().epoch(), None)]),
                ))
                .await?;
            let mut gets = r.op_responses().into_iter().filter_map(|o| match o {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            });
            let (Some(c), Some(e)) = (gets.next(), gets.next()) else {
                return Err(internal("epoch counter read without its ranges"));
            };
            let (counter, rev) = match c.kvs().first() {
                Some(kv) => (serde_json::from_slice::<EpochCounter>(kv.value()).map_err(internal)?, kv.mod_revision()),
                None => (EpochCounter::default(), 0),
            };
            let own = match e.kvs().first() {
                Some(kv) => serde_json::from_slice::<EpochRecord>(kv.value()).map_err(internal)?.epoch,
                None => 0,
            };
            let next = counter.last.max(own).max(floor) + 1;
            if next >= EPOCH_LIMIT {
                return Err(LockError::Sealed(format!("epoch {next} would reach 2^15: no epoch left to allocate")));
            }
            let v = serde_json::to_vec(&EpochCounter { last: next }).map_err(internal)?;
            let txn = Txn::new()
                .when([Compare::mod_revision(ck.as_str(), CompareOp::Equal, rev)])
                .and_then([TxnOp::put(ck.as_str(), v, None)]);
            if self.cluster.call(self.cluster.client().txn(txn)).await?.succeeded() {
                return Ok(next);
            }
        }
        Err(LockError::Unavailable("the epoch counter keeps changing".into()))
    }

    /// Reads this cluster's home record now.
    pub async fn read(&self) -> Result<Option<(HomeRecord, i64)>, LockError> {
        let r = self.cluster.call(self.cluster.client().get(self.cell.home_key(), None)).await?;
        r.kvs()
            .first()
            .map(|kv| Ok((serde_json::from_slice(kv.value()).map_err(internal)?, kv.mod_revision())))
            .transpose()
    }

    /// The cached home record, read if not cached.
    async fn record(&self) -> Result<(HomeRecord, i64), LockError> {
        if let Some(r) = lock(&self.cell.record).clone() {
            return Ok(r);
        }
        let found = self.read().await?.ok_or_else(|| {
            LockError::Unavailable(format!(
                "cluster {} has no home record yet (the arbiter creates it from the shard map)",
                self.name()
            ))
        })?;
        *lock(&self.cell.record) = Some(found.clone());
        Ok(found)
    }

    /// Drops the cached home record (it moved).
    pub(crate) fn forget(&self) {
        *lock(&self.cell.record) = None;
    }

    /// The home fence of one grant of `key` (authoritative class `class`) on this
    /// cluster: `Moved` if the key lives elsewhere, `Draining` while it moves. A
    /// refusal is decided on a fresh read.
    pub(crate) async fn gate(&self, class: &str, key: &LockKey) -> Result<HomeGate, LockError> {
        let floor = self.cell.floor.load(Ordering::Relaxed);
        let behind = |r: &HomeRecord| r.pending.as_ref().map_or(r.current.version, |p| p.version) < floor;
        let (mut rec, mut rev) = self.record().await?;
        let mut verdict = rec.admits(class, key.as_str());
        if verdict != Admit::Here || behind(&rec) {
            self.forget();
            (rec, rev) = self.record().await?;
            verdict = rec.admits(class, key.as_str());
        }
        if behind(&rec) {
            // Every cluster that homes keys is resumed to each map it homes them in,
            // so a record behind the coord map homes nothing now, unless the cluster
            // was restored from an older snapshot: refuse until `lockctl shard
            // apply` (no change) brings it forward.
            tracing::error!(
                cluster = self.name(),
                recorded = rec.current.version,
                floor,
                "the home record is behind the shard map (a restored cluster?); refusing its keys"
            );
            return Err(LockError::Unavailable(format!(
                "cluster {}'s home record (version {}) is behind the shard map (version {floor}); run lockctl \
                 shard apply to repair it",
                self.name(),
                rec.current.version
            )));
        }
        if verdict == Admit::Elsewhere && crate::test_faults::on(crate::test_faults::TestFault::SkipHomeGate) {
            verdict = Admit::Here; // PLANTED BUG (scale scenarios): a moved key is granted here.
        }
        if rec.cluster != self.name() {
            tracing::error!(
                configured = self.name(),
                recorded = %rec.cluster,
                "the etcd cluster at these endpoints calls itself otherwise: check the arbiter's clusters"
            );
            return Err(LockError::Unavailable(format!(
                "this arbiter calls the cluster {}, its home record says {}: refusing rather than guessing",
                self.name(),
                rec.cluster
            )));
        }
        match verdict {
            Admit::Here => Ok(HomeGate { key: self.cell.home_key(), rev }),
            Admit::Moving { version } => Err(LockError::Draining(format!(
                "the key's range is moving between clusters (shard map version {version}); retry shortly"
            ))),
            Admit::Elsewhere => Err(LockError::Moved),
        }
    }

    /// Creates this cluster's home record from the coord map if it has none.
    pub(crate) async fn create_if_missing(&self, map: &MapRecord) -> Result<(), LockError> {
        let rec = HomeRecord::new(
            self.name(),
            map.current.clone(),
            map.pending.clone(),
            note("arbiter", "create", "bootstrap from the coord map"),
        );
        let key = self.cell.home_key();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), serde_json::to_vec(&rec).map_err(internal)?, None)]);
        self.cluster.call(self.cluster.client().txn(txn)).await.map(|_| ())
    }

    /// Writes this cluster's home record if its mod revision is still `expect`
    /// (0: absent). Returns whether it was written.
    pub async fn put(&self, rec: &HomeRecord, expect: i64) -> Result<bool, LockError> {
        let key = self.cell.home_key();
        let txn = Txn::new()
            .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, expect)])
            .and_then([TxnOp::put(key.as_str(), serde_json::to_vec(rec).map_err(internal)?, None)]);
        let ok = self.cluster.call(self.cluster.client().txn(txn)).await?.succeeded();
        self.forget();
        Ok(ok)
    }

    /// The coord map document now (coord cluster).
    pub async fn read_map(&self) -> Result<Option<(MapRecord, i64)>, LockError> {
        let r = self.cluster.call(self.cluster.client().get(self.cell.map_key(), None)).await?;
        r.kvs()
            .first()
            .map(|kv| Ok((serde_json::from_slice(kv.value()).map_err(internal)?, kv.mod_revision())))
            .transpose()
    }

    /// Writes the coord map document if its mod revision is still `expect`.
    pub async fn put_map(&self, rec: &MapRecord, expect: i64) -> Result<bool, LockError> {
        let key = self.cell.map_key();
        let txn = Txn::new()
            .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, expect)])
            .and_then([TxnOp::put(key.as_str(), serde_json::to_vec(rec).map_err(internal)?, None)]);
        Ok(self.cluster.call(self.cluster.client().txn(txn)).await?.succeeded())
    }

    /// How many holds on this cluster belong to keys that leave it going from
    /// `from` to `to`, and the revision of the (linearizable, paged) read.
    pub async fn moving_holds(&self, from: &ShardMap, to: &ShardMap) -> Result<(usize, i64), LockError> {
        let prefix = self.cluster.keys().all_locks();
        let end = super::keys::prefix_end(&prefix);
        let mut start = prefix.into_bytes();
        let (mut count, mut revision) = (0, 0);
        loop {
            let opts = GetOptions::new().with_range(end.clone()).with_limit(1000);
            let r = self.cluster.call(self.cluster.client().get(start.clone(), Some(opts))).await?;
            if revision == 0 {
                revision = r.header().map_or(0, etcd_client::ResponseHeader::revision);
            }
            for kv in r.kvs() {
                let Some(h) = super::mutex::hold_of(kv) else { continue };
                if from.moves_away(to, &h.class, &h.key, self.name()) {
                    count += 1;
                }
            }
            match r.kvs().last() {
                Some(kv) if r.more() => {
                    start = kv.key().to_vec();
                    start.push(0);
                }
                _ => return Ok((count, revision)),
            }
        }
    }

    /// The epoch of a fresh epoch record: allocated from the coord counter in a
    /// deployment of several clusters, else [`FIRST_EPOCH`].
    pub(crate) async fn first_epoch(&self) -> Result<u64, LockError> {
        match self.cell.epoch_source.get().and_then(Weak::upgrade) {
            Some(coord) => coord.allocate_epoch(0).await,
            None => Ok(FIRST_EPOCH),
        }
    }
}

// === impl Store ===

impl Store {
    /// Names this store's cluster and, in a deployment of several clusters, the
    /// coord store its fresh epoch records are allocated from. Call once, before
    /// serving; later calls change nothing.
    pub(crate) fn set_cluster(&self, name: &str, epoch_source: Option<&Arc<Store>>) {
        let _ = self.home.cell.name.set(name.to_owned());
        if let Some(s) = epoch_source {
            let _ = self.home.cell.epoch_source.set(Arc::downgrade(&s.home));
        }
    }

    /// This store's cluster name ([`COORD_CLUSTER`] unless set).
    pub fn cluster_name(&self) -> &str {
        self.home.name()
    }

    /// The home of this cluster's keys: its record, the shard map, epochs.
    pub fn home(&self) -> &Home {
        &self.home
    }

    /// The record of session `sid` on this cluster, when its lease is `sid` here,
    /// with the cluster it was opened on (`None`: this one).
    pub(crate) async fn session_copy(&self, sid: SessionId) -> Result<Option<ExtensionRecord>, LockError> {
        let r = self.cluster.call(self.cluster.client().get(self.cluster.keys().session(sid), None)).await?;
        Ok(r.kvs()
            .first()
            .filter(|kv| kv.lease() == sid.lease())
            .and_then(|kv| serde_json::from_slice::<ExtensionRecord>(kv.value()).ok()))
    }

    /// Extends session `sid` (opened on cluster `home` with `rec`) to this cluster:
    /// a lease with the same id and TTL, and a copy of the record on it. An
    /// extension another arbiter made first is accepted; a foreign lease that
    /// happens to have the id is not (`SessionExpired`: open another session).
    pub(crate) async fn extend_session(
        &self,
        sid: SessionId,
        rec: &SessionRecord,
        home: &str,
    ) -> Result<(), LockError> {
        let ttl = i64::try_from(rec.ttl_s).map_err(internal)?;
        let granted = self
            .cluster
            .call(self.cluster.client().lease_grant(ttl, Some(LeaseGrantOptions::new().with_id(sid.lease()))))
            .await;
        match granted {
            Ok(_) => {}
            Err(LockError::Unavailable(m)) if m.contains("lease already exists") => {}
            Err(e) => return Err(e),
        }
        let copy = ExtensionRecord { record: rec.clone(), home: Some(home.to_owned()) };
        let key = self.cluster.keys().session(sid);
        let txn =
            Txn::new().when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
                key.as_str(),
                serde_json::to_vec(&copy).map_err(internal)?,
                Some(PutOptions::new().with_lease(sid.lease())),
            )]);
        match self.cluster.call(self.cluster.client().txn(txn)).await {
            Ok(r) if r.succeeded() => Ok(()),
            Ok(_) => match self.session_copy(sid).await? {
                Some(c) if c.record.owner == rec.owner && c.record.instance == rec.instance => Ok(()),
                _ => {
                    tracing::warn!(cluster = self.cluster_name(), "a session id collides with a foreign lease here");
                    Err(LockError::SessionExpired)
                }
            },
            // A lease that vanished meanwhile (revoked by a close): the session ended.
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => Err(LockError::SessionExpired),
            Err(e) => Err(e),
        }
    }

    /// Records on this (home) cluster that session `sid` extends to `cluster`.
    pub(crate) async fn mark_extension(&self, sid: SessionId, cluster: &str) -> Result<(), LockError> {
        let key = format!("{}{cluster}", self.home.cell.extensions_prefix(sid));
        let opts = Some(PutOptions::new().with_lease(sid.lease()));
        match self.cluster.call(self.cluster.client().put(key, "", opts)).await {
            Ok(_) => Ok(()),
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => Err(LockError::SessionExpired),
            Err(e) => Err(e),
        }
    }

    /// The clusters session `sid` extends to, as its home records them.
    pub async fn extensions(&self, sid: SessionId) -> Result<Vec<String>, LockError> {
        let prefix = self.home.cell.extensions_prefix(sid);
        let r = self
            .cluster
            .call(self.cluster.client().get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_keys_only())))
            .await?;
        Ok(r.kvs()
            .iter()
            .filter_map(|kv| std::str::from_utf8(kv.key()).ok()?.strip_prefix(prefix.as_str()).map(str::to_owned))
            .collect())
    }

    /// True when lease `sid` exists here (read without renewing it: nothing renews
    /// a session on its holder's behalf).
    pub(crate) async fn lease_alive(&self, sid: SessionId) -> Result<bool, LockError> {
        let r = self.cluster.call(self.cluster.client().lease_time_to_live(sid.lease(), None)).await?;
        Ok(r.ttl() > 0)
    }

    /// Renews lease `sid` here once: `Ok(false)` when it does not exist here.
    pub(crate) async fn renew_lease(&self, sid: SessionId) -> Result<bool, LockError> {
        match self.cluster.call(self.cluster.client().lease_keep_alive(sid.lease())).await {
            Ok(_) => Ok(true),
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => {
                self.forget_session(sid).await;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether leases may be renewed here: not while sealed (`Sealed`). A
    /// restored cluster's holds are the snapshot's; renewing them would keep them
    /// standing until the guarded advance, holding up a move of their keys off it
    /// (`Tiers::keepalive`, `Store::vm_keepalive`).
    pub(crate) fn renewable(&self) -> Result<(), LockError> {
        if crate::test_faults::on(crate::test_faults::TestFault::RenewSealed) {
            return Ok(()); // PLANTED BUG (recipe_edges scenario): renew while sealed.
        }
        self.unsealed()
    }

    /// [`Store::renew_lease`] if [`Store::renewable`].
    pub(crate) async fn renew_unsealed(&self, sid: SessionId) -> Result<bool, LockError> {
        self.renewable()?;
        self.renew_lease(sid).await
    }

    /// Revokes lease `sid` here: `Ok(false)` when it did not exist here.
    pub(crate) async fn revoke_lease(&self, sid: SessionId) -> Result<bool, LockError> {
        let r = self.cluster.call(self.cluster.client().lease_revoke(sid.lease())).await;
        self.forget_session(sid).await;
        match r {
            Ok(_) => Ok(true),
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The header revision and cluster id of a linearizable read now.
    pub async fn position(&self) -> Result<(i64, String), LockError> {
        let r = self.cluster.call(self.cluster.client().get(self.cluster.keys().epoch(), None)).await?;
        let h = r.header().ok_or_else(|| internal("etcd response without header"))?;
        Ok((h.revision(), cluster_hex(h.cluster_id())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn maps() -> (ShardMap, ShardMap) {
        let a = ShardMap::initial("coord", &["coord".into()], ["leader".into()]);
        let mut b = a.clone();
        b.version = 2;
        b.shards.push("shard-b".into());
        (a, b)
    }

    #[test]
    fn a_record_admits_only_keys_homed_here_under_both_maps() {
        let (a, b) = maps();
        let n = || note("t", "t", "t");
        let key = (0..100).map(|i| format!("ns/k{i}")).find(|k| b.home("c", k) == Some("shard-b")).unwrap();
        let stays = (0..100).map(|i| format!("ns/k{i}")).find(|k| b.home("c", k) == Some("coord")).unwrap();
        let main = HomeRecord::new("coord", a.clone(), None, n());
        assert_eq!(main.admits("c", &key), Admit::Here);
        let draining = HomeRecord::new("coord", a.clone(), Some(b.clone()), n());
        assert_eq!(draining.admits("c", &key), Admit::Moving { version: 2 });
        assert_eq!(draining.admits("c", &stays), Admit::Here);
        assert_eq!(draining.admits("leader", &key), Admit::Here);
        let flipped = HomeRecord::new("coord", b.clone(), None, n());
        assert_eq!(flipped.admits("c", &key), Admit::Elsewhere);
        let dest_before_resume = HomeRecord::new("shard-b", a.clone(), Some(b.clone()), n());
        assert_eq!(dest_before_resume.admits("c", &key), Admit::Moving { version: 2 });
        assert_eq!(dest_before_resume.admits("c", &stays), Admit::Elsewhere);
        let dest = HomeRecord::new("shard-b", b, None, n());
        assert_eq!(dest.admits("c", &key), Admit::Here);
        assert_eq!(dest.admits("leader", &key), Admit::Elsewhere);
    }

    #[test]
    fn extension_records_read_as_session_records() {
        let rec = SessionRecord {
            owner: "spiffe://t/a".into(),
            instance: None,
            class: "default".into(),
            ttl_s: 15,
            created_ms: 1,
            ns: Some("ns".into()),
            by_acquire: false,
        };
        let copy = ExtensionRecord { record: rec.clone(), home: Some("coord".into()) };
        let v = serde_json::to_vec(&copy).unwrap();
        assert_eq!(serde_json::from_slice::<SessionRecord>(&v).unwrap(), rec);
        let back: ExtensionRecord = serde_json::from_slice(&serde_json::to_vec(&rec).unwrap()).unwrap();
        assert_eq!(back.home, None);
    }
}
