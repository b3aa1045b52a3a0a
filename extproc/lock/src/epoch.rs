//! The epoch record (ADR-03): the current epoch and the etcd cluster it was minted
//! for. Every grant compares the record's mod revision, so a grant can never carry
//! an epoch that is not current at its commit. The restore seal that builds on it
//! (cluster id mismatch, durable high-water marks, the guarded epoch advance) has
//! its own module once restore safety lands; this one refuses to serve on a cluster
//! id mismatch already.

use etcd_client::{Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse};

use super::test_faults::{self, TestFault};

use std::sync::Arc;

use super::{
    home::{internal, Home},
    seal::Seal,
    Cluster, LockError,
};

pub use lockmesh_keyspace::epoch::{cluster_hex, EpochRecord, FIRST_EPOCH};

/// What the arbiter knows of the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochState {
    pub epoch: u64,
    /// Mod revision of the record; grants compare it.
    pub mod_revision: i64,
    /// Cluster id the epoch is bound to.
    pub cluster_id: u64,
    /// Explicit seal reason, if any.
    pub sealed: Option<String>,
    /// Earlier epochs whose holds may still be live ([`EpochRecord::prior`]).
    pub prior: Vec<u64>,
}

impl EpochState {
    /// True when a hold granted in `epoch` may still be live on this cluster: the
    /// current epoch, or one a move's advance kept.
    pub(crate) fn holds_epoch(&self, epoch: u64) -> bool {
        epoch == self.epoch || self.prior.contains(&epoch)
    }
}

/// Cached epoch state.
#[derive(Default)]
pub struct EpochCell(std::sync::RwLock<Option<EpochState>>);

/// The epoch record of one cluster as this arbiter follows it: the cached state
/// every grant compares, the seal that watches for a restore ([`super::seal`]),
/// and the raft position check a grant makes before it answers.
pub struct Epoch {
    cluster: Arc<Cluster>,
    home: Arc<Home>,
    cell: EpochCell,
    seal: Seal,
    /// When the last raft position check started, and its answer
    /// ([`Epoch::raft_at_mark_since`]).
    raft_checked: tokio::sync::Mutex<Option<(tokio::time::Instant, Result<(), LockError>)>>,
}

// === impl Epoch ===

impl Epoch {
    pub(crate) fn new(cluster: Arc<Cluster>, home: Arc<Home>, seal: Seal) -> Self {
        Self { cluster, home, cell: EpochCell::default(), seal, raft_checked: tokio::sync::Mutex::new(None) }
    }

    /// The seal state.
    pub fn seal(&self) -> &Seal {
        &self.seal
    }

    /// The cached epoch state, loading it on first use.
    pub async fn state(&self) -> Result<EpochState, LockError> {
        if let Some(s) = self.cell.0.read().ok().and_then(|g| g.clone()) {
            return Ok(s);
        }
        self.refresh().await
    }

    /// The epoch as last read, without reading (`None` before the first read).
    pub(crate) fn cached(&self) -> Option<u64> {
        self.cell.0.read().ok().and_then(|g| g.as_ref().map(|s| s.epoch))
    }

    /// Checks a response's cluster id against the epoch record's.
    pub(crate) fn check_cluster(&self, state: &EpochState, header_cluster: Option<u64>) -> Result<(), LockError> {
        match header_cluster {
            Some(c) if c != state.cluster_id => {
                let detail = format!(
                    "etcd cluster id {} differs from the epoch record's {}",
                    cluster_hex(c),
                    cluster_hex(state.cluster_id)
                );
                self.seal.seal(super::seal::SealReason::ClusterIdMismatch, detail.clone());
                Err(LockError::Sealed(detail))
            }
            _ => Ok(()),
        }
    }

    /// Reads the epoch record (linearizable), creating epoch 1 on a fresh root.
    pub async fn refresh(&self) -> Result<EpochState, LockError> {
        self.load().await.map(|(state, ..)| state)
    }

    /// `NotHolder` unless the current epoch holds `epoch`, for a call naming a
    /// grant of it (a release, a proclaim): the cache decides a yes, a fresh read a
    /// no. The cache may predate an advance (a shard move's, or another
    /// arbiter's grant in the new epoch), so a refusal is decided on a fresh read,
    /// once, never on the cache (the SDK takes `not_holder` as final).
    pub(crate) async fn ensure_holds(&self, epoch: u64) -> Result<(), LockError> {
        if self.state().await?.holds_epoch(epoch) || self.refresh().await?.holds_epoch(epoch) {
            Ok(())
        } else {
            Err(LockError::NotHolder)
        }
    }

    /// [`Epoch::refresh`], also returning the read's header revision,
    /// cluster id and raft term (the seal check compares them, so it needs no
    /// second read).
    async fn load(&self) -> Result<(EpochState, i64, u64, u64), LockError> {
        let key = self.cluster.keys().epoch();
        for _ in 0..3 {
            let r = self.cluster.call(self.cluster.client().get(key.as_str(), None)).await?;
            let header_cluster = r.header().map(|h| h.cluster_id());
            let header_revision = r.header().map_or(0, |h| h.revision());
            let header_term = r.header().map_or(0, |h| h.raft_term());
            if let Some(kv) = r.kvs().first() {
                let rec: EpochRecord = serde_json::from_slice(kv.value())
                    .map_err(|e| LockError::Internal(format!("epoch record is not valid: {e}")))?;
                let cluster_id = u64::from_str_radix(&rec.cluster_id, 16)
                    .map_err(|_| LockError::Internal("epoch record cluster_id is not hex".into()))?;
                let state = EpochState {
                    epoch: rec.epoch,
                    mod_revision: kv.mod_revision(),
                    cluster_id,
                    sealed: rec.sealed,
                    prior: rec.prior,
                };
                self.check_cluster(&state, header_cluster)?;
                if let Ok(mut g) = self.cell.0.write() {
                    *g = Some(state.clone());
                }
                return Ok((state, header_revision, header_cluster.unwrap_or(cluster_id), header_term));
            }
            // A fresh root: create epoch 1 bound to this cluster, once.
            let cluster = header_cluster.ok_or_else(|| LockError::Internal("etcd response without header".into()))?;
            if self.seal.marks().epoch > 0 {
                // This arbiter has seen an epoch here before: a missing record means
                // the store went back to before it existed.
                let why = "the epoch record is missing".to_string();
                self.seal.seal(super::seal::SealReason::EpochBehindMark, why.clone());
                return Err(LockError::Sealed(why));
            }
            // One cluster: epoch 1. Several: allocated from the coord cluster's
            // counter, so no two clusters share an epoch (`lock::home`).
            let first = self.home.first_epoch().await?;
            let rec = EpochRecord {
                epoch: first,
                cluster_id: cluster_hex(cluster),
                sealed: None,
                target: None,
                prior: Vec::new(),
            };
            let value = serde_json::to_vec(&rec).map_err(|e| LockError::Internal(e.to_string()))?;
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.as_str(), value, None::<PutOptions>)]);
            self.cluster.call(self.cluster.client().txn(txn)).await?;
            tracing::info!(epoch = first, cluster = %cluster_hex(cluster), "created the epoch record");
        }
        Err(LockError::Internal("epoch record could not be read".into()))
    }

    /// One seal check (see [`super::seal`]): a linearizable read of the epoch
    /// record, the leader's raft position, then the comparison with the marks,
    /// which are persisted when they moved.
    pub async fn check_seal(&self) -> Result<(), LockError> {
        let floor = self.seal.revision_floor();
        let (state, revision, cluster, term) = match self.load().await {
            Ok(s) => s,
            Err(LockError::Sealed(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let clock_floor = self.seal.marks().clock;
        let clock = self.read_clock().await?;
        let raft = self.leader_position().await;
        self.seal.check(&super::seal::Observation {
            cluster,
            record_cluster: state.cluster_id,
            epoch: state.epoch,
            explicit: state.sealed.as_deref(),
            floor,
            revision,
            raft,
            clock_floor,
            clock,
            term,
            prior: &state.prior,
        });
        if let Err(e) = self.seal.persist() {
            tracing::error!(error = %e, "cannot persist the high-water marks");
        }
        Ok(())
    }

    /// The grant clock's mod revision (0: absent; `lock::seal`), read by a
    /// transaction whose never-taken branch puts it: etcd checks the permission of
    /// every operation of both branches, so an answer proves the role may read and
    /// write the clock. A role without that grant turns the clock off (`None`;
    /// grants then neither compare nor put it) and back on once it has it.
    async fn read_clock(&self) -> Result<Option<i64>, LockError> {
        if test_faults::on(TestFault::SkipClockCompare) {
            self.seal.set_clock_off(Some("planted fault skip_clock_compare".into()));
            return Ok(None);
        }
        let key = self.cluster.keys().clock();
        let txn = Txn::new()
            .when([Compare::version(key.as_str(), CompareOp::Less, 0)])
            .and_then([TxnOp::put(key.as_str(), Vec::<u8>::new(), None::<PutOptions>)])
            .or_else([TxnOp::get(key.as_str(), None)]);
        match self.cluster.call(self.cluster.client().txn(txn)).await {
            Ok(r) => {
                if self.seal.set_clock_off(None) && self.seal.marks().updated_ms > 0 {
                    tracing::warn!("the grant clock is on: grants compare it again (restore detection under any role)");
                }
                let got = r.op_responses().into_iter().find_map(|o| match o {
                    TxnOpResponse::Get(g) => Some(g.kvs().first().map_or(0, KeyValue::mod_revision)),
                    _ => None,
                });
                got.map(Some).ok_or_else(|| LockError::Internal("grant clock read without its get".into()))
            }
            Err(LockError::Unavailable(e)) if e.contains("permission denied") => {
                let why = "the etcd role may not read and write sys/clock: a restore with --bump-revision is then \
                           seen only by the raft check, which needs root (docs/ADMIN.md, roles)"
                    .to_owned();
                if self.seal.set_clock_off(Some(why.clone())) {
                    tracing::warn!(reason = %why, "the grant clock is off");
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The (term, index) of the member that leads, taken only from a member that
    /// serves a linearizable read itself (a deposed or lagging member cannot).
    async fn leader_position(&self) -> Option<(u64, u64)> {
        if test_faults::on(TestFault::NoRaftCheck) {
            return None; // TEST SWITCH (release gate): as under a non-root etcd role.
        }
        for m in self.cluster.members() {
            let Ok(s) = self.cluster.call(m.clone().status()).await else { continue };
            let Some(h) = s.header() else { continue };
            if s.leader() != h.member_id() {
                continue;
            }
            if self.cluster.call(m.clone().get(self.cluster.keys().epoch(), None)).await.is_err() {
                return None;
            }
            let Ok(s2) = self.cluster.call(m.clone().status()).await else { return None };
            if s2.leader() == h.member_id() && s2.raft_term() == s.raft_term() {
                return Some((s2.raft_term(), s2.raft_index()));
            }
            return None;
        }
        None
    }

    /// Whether the etcd cluster that just committed a grant is at or past this
    /// arbiter's raft mark (ADR-03). A restore with `--bump-revision` passes the
    /// revision floor every grant compares; only the raft position, which restarts
    /// with the restored log, tells it apart, and the seal check reads it once a
    /// second: a grant committed in between would hand out a key the restored
    /// store forgot was held. So every grant asks here before it answers.
    ///
    /// Every member is asked at once and the first at or past the mark answers
    /// yes (a healthy cluster has one, however far a follower lags). A no refuses
    /// the grant (`unavailable`) and never seals: a lagging follower is behind the
    /// mark too, and the seal check, which reads the proven leader, decides. A
    /// member that refuses `Status` (etcd 3.5 auth for a non-root user) cannot be
    /// asked; when every member refuses, the check is skipped, as the seal check's
    /// raft comparison is (docs/OPERATIONS.md).
    pub async fn raft_at_mark(&self) -> Result<(), LockError> {
        let m = self.seal.marks();
        let mark = (m.raft_term, m.raft_index);
        if mark == (0, 0) {
            return Ok(());
        }
        super::steps::timed(super::steps::Step::RaftCheck, self.members_at(mark)).await
    }

    /// [`Epoch::raft_at_mark`] for a grant answered at `answered`: a check that
    /// started after it answers for it too, so the grants of one group (answered
    /// together) share one check rather than asking every member each.
    pub(crate) async fn raft_at_mark_since(&self, answered: tokio::time::Instant) -> Result<(), LockError> {
        let mut last = self.raft_checked.lock().await;
        if let Some((_, r)) = last.as_ref().filter(|(started, _)| *started >= answered) {
            return r.clone();
        }
        let started = tokio::time::Instant::now();
        let r = self.raft_at_mark().await;
        *last = Some((started, r.clone()));
        r
    }

    /// The question of [`Epoch::raft_at_mark`], asked of every member.
    async fn members_at(&self, mark: (u64, u64)) -> Result<(), LockError> {
        use futures::stream::StreamExt;
        let mut asks: futures::stream::FuturesUnordered<_> = self
            .cluster
            .members()
            .iter()
            .map(|c| {
                let mut c = c.clone();
                async move { self.cluster.call(c.status()).await }
            })
            .collect();
        let (mut refused, mut highest) = (0, None);
        while let Some(r) = asks.next().await {
            match r {
                Ok(s) if (s.raft_term(), s.raft_index()) >= mark => return Ok(()),
                Ok(s) => highest = highest.max(Some((s.raft_term(), s.raft_index()))),
                Err(LockError::Unavailable(e)) if e.contains("permission denied") => refused += 1,
                Err(_) => {}
            }
        }
        if refused == self.cluster.members().len() {
            return Ok(());
        }
        Err(LockError::Unavailable(match highest {
            Some((t, i)) => format!(
                "no etcd member is at the raft mark ({}, {}): the highest answered ({t}, {i}); a restored or lagging \
                 cluster, the seal check decides",
                mark.0, mark.1
            ),
            None => "no etcd member answered its raft position after the grant committed".into(),
        }))
    }

    /// Drops the cached state so the next grant reloads it.
    pub(crate) fn forget(&self) {
        if let Ok(mut g) = self.cell.0.write() {
            *g = None;
        }
    }

    /// The epoch record as stored now (linearizable), if any.
    pub async fn read_record(&self) -> Result<Option<EpochRecord>, LockError> {
        let r = self.cluster.call(self.cluster.client().get(self.cluster.keys().epoch(), None)).await?;
        r.kvs().first().map(|kv| serde_json::from_slice(kv.value()).map_err(internal)).transpose()
    }

    /// Advances this cluster's epoch above `floor` (a move's old home's epoch)
    /// with an epoch allocated from `coord`, keeping the holds of its current and
    /// older epochs valid (`prior`). Returns the epoch in force; no change when it
    /// is already above `floor`.
    pub async fn advance_above(&self, floor: u64, coord: &Home) -> Result<u64, LockError> {
        let key = self.cluster.keys().epoch();
        for _ in 0..3 {
            let r = self.cluster.call(self.cluster.client().get(key.as_str(), None)).await?;
            let kv = r.kvs().first().ok_or_else(|| {
                LockError::Unavailable(format!("cluster {} has no epoch record yet", self.home.name()))
            })?;
            let rec: EpochRecord = serde_json::from_slice(kv.value()).map_err(internal)?;
            if rec.epoch > floor {
                return Ok(rec.epoch);
            }
            if let Some(why) = rec.sealed {
                return Err(LockError::Sealed(why));
            }
            let next = coord.allocate_epoch(floor).await?;
            let mut prior = rec.prior.clone();
            prior.push(rec.epoch);
            let advanced = EpochRecord { epoch: next, prior, ..rec };
            let txn = Txn::new()
                .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, kv.mod_revision())])
                .and_then([TxnOp::put(key.as_str(), serde_json::to_vec(&advanced).map_err(internal)?, None)]);
            if self.cluster.call(self.cluster.client().txn(txn)).await?.succeeded() {
                self.forget();
                tracing::info!(cluster = self.home.name(), epoch = next, "epoch advanced for a move (holds kept)");
                return Ok(next);
            }
        }
        Err(LockError::Unavailable("the epoch record keeps changing".into()))
    }
}
