//! Fail-open efficiency classes (ADR-04, `docs/GUARANTEES.md` G9).
//!
//! Every class fails closed on a quorum loss unless it declares
//! `on_quorum_loss: open`, which the registry allows only for an advisory class
//! of purpose efficiency. For such a class, while this arbiter has **declared** a
//! quorum loss on the key's cluster ([`quorum`]), an acquire is granted from this
//! arbiter's memory ([`memory`]) with **token 0** and a grant id, after its line
//! is durable in the local spool ([`spool`]); a spool that is full or cannot be
//! written refuses the grant (`spool_full`, `unavailable`). Once the cluster
//! answers again, the spool is **shipped**: each line is put under
//! `<root>/u/<grant id>/<op>` (a 10-minute lease keeps etcd clean; the audit
//! tailer reads the put from etcd's history), and only after etcd accepted the
//! puts is the spool cut. The tailer turns each put into an audit event marked
//! `unprotected` whose key does not depend on the revision it shipped at, so a
//! crash between shipping and cutting ships again without counting twice.
//!
//! What a token-0 grant is: no fencing token (no fence accepts it), no session
//! (a session can neither be opened nor renewed without a quorum), mutual
//! exclusion among this arbiter's own unprotected holds only, and an expiry one
//! class TTL after the grant (a transparent hold's is renewed by its VM's
//! keepalive). It is released by its grant id (`x-lock-grant`), or by the filter's
//! hold number in transparent mode. After the quorum returns, an etcd grant of a
//! key that still has an unprotected hold here waits for it.
//!
//! # Layout
//! - [`quorum`]: when a loss is declared.
//! - [`memory`]: the unprotected holds.
//! - [`spool`]: the local append-only file.

pub mod memory;
pub mod quorum;
pub mod spool;

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Arc, LazyLock, Mutex},
};

use etcd_client::{PutOptions, Txn, TxnOp};
use lockmesh_core::{ClassRegistry, KeyDigest};
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use self::{
    memory::{MemHold, Memory, Reserve},
    quorum::{Outage, QuorumWatch, Transition},
    spool::{Spool, SpoolError, SpoolOp, SpoolRecord},
};
use lockmesh_telemetry::labels::{Described, LockLabels};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{mutex::AcquireRequest, now_ms, session::Caller, LockError, Store};

/// TTL of the lease shipped records hang on, seconds: the tailer reads them from
/// etcd's history (a watch from its checkpoint), so the keys only need to outlive
/// the ship round; the lease keeps them from piling up.
pub(crate) const SHIP_LEASE_TTL_S: i64 = 600;
/// Records per ship transaction (etcd's default limit is 128 operations).
pub(crate) const SHIP_BATCH: usize = 64;

/// An unprotected grant as the API answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemGrant {
    /// The grant id (`x-lock-grant`).
    pub grant: String,
    pub class: String,
    /// The class TTL, seconds.
    pub ttl_s: u64,
    /// The epoch this arbiter last read on the cluster (0 if none).
    pub epoch: u64,
    /// Id of the outage it was granted in (`<cluster>-<declared at, unix ms>`).
    pub outage: String,
    /// The same transparent hold already held the key.
    pub existing: bool,
}

/// Fail-open state of one etcd cluster on this arbiter.
pub struct FailOpen {
    cluster: String,
    spool: Result<Arc<Spool>, String>,
    memory: Mutex<Memory>,
    changed: tokio::sync::Notify,
    quorum: QuorumWatch,
    shipping: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for FailOpen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailOpen").field("cluster", &self.cluster).finish_non_exhaustive()
    }
}

fn new_grant_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn spool_err(e: SpoolError) -> LockError {
    match e {
        SpoolError::Full { .. } => LockError::SpoolFull(e.to_string()),
        SpoolError::Io(_) => LockError::Unavailable(e.to_string()),
    }
}

// === impl FailOpen ===

impl FailOpen {
    /// The fail-open state of cluster `cluster`, with its spool at `spool` (`None`:
    /// not configured, so fail-open classes fail closed). A spool that cannot be
    /// opened is logged and fails closed too. Grants of an earlier run still open
    /// in the spool are ended there (`expiry`, reason `arbiter_restart`): this
    /// process does not hold them.
    pub fn open(cluster: &str, spool: Option<&Path>, max_bytes: u64, after_ms: u64) -> Self {
        let spool = match spool {
            None => Err("no fail_open.spool_file (or marks_file) is configured".to_owned()),
            Some(p) => match Spool::open(p, max_bytes) {
                Ok((s, records)) => {
                    let ends = restart_ends(&records, now_ms());
                    if !ends.is_empty() {
                        tracing::warn!(
                            cluster,
                            holds = ends.len(),
                            "unprotected holds of an earlier run are recorded as ended by the restart"
                        );
                        if let Err(e) = s.append(&ends, false) {
                            tracing::error!(cluster, error = %e, "could not record the end of an earlier run's unprotected holds");
                        }
                    }
                    Ok(Arc::new(s))
                }
                Err(e) => {
                    tracing::error!(cluster, error = %e, "the unprotected-grant spool cannot be opened: fail-open classes fail closed on this cluster");
                    Err(e.to_string())
                }
            },
        };
        let fo = Self {
            cluster: cluster.to_owned(),
            spool,
            memory: Mutex::new(Memory::default()),
            changed: tokio::sync::Notify::new(),
            quorum: QuorumWatch::new(cluster, after_ms),
            shipping: tokio::sync::Mutex::new(()),
        };
        fo.publish();
        fo
    }

    fn mem(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Name of the etcd cluster this state is for.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The declared quorum loss, if any.
    pub fn declared(&self) -> Option<Outage> {
        self.quorum.declared()
    }

    /// Whether a spool is open (fail-open classes can be served at all).
    pub fn has_spool(&self) -> bool {
        self.spool.is_ok()
    }

    /// Bytes waiting in the spool.
    pub fn spool_bytes(&self) -> u64 {
        self.spool.as_ref().map_or(0, |s| s.len())
    }

    /// Unprotected holds in memory.
    pub fn holds(&self) -> usize {
        self.mem().len()
    }

    fn publish(&self) {
        STATS.set_cluster(&self.cluster, self.spool_bytes(), self.declared().is_some());
    }

    /// One seal check's outcome (`read_ok`), with a member probe when it failed;
    /// then lapsed holds are ended and, with the quorum back, the spool shipped
    /// (in the background, one ship at a time).
    pub async fn observe(self: &Arc<Self>, store: &Arc<Store>, started_ms: u64, read_ok: bool, within: Duration) {
        let leader_seen = read_ok || store.cluster().member_names_leader(within).await;
        match self.quorum.observe(started_ms, now_ms(), read_ok, leader_seen) {
            Transition::Declared(o) => tracing::warn!(
                cluster = %self.cluster,
                outage = %o.id,
                failing_ms = o.declared_ms.saturating_sub(o.since_ms),
                "QUORUM LOST: no linearizable read and no member names a leader; fail-open classes now grant \
                 unprotected (token 0) from memory, every other class fails closed"
            ),
            Transition::Recovered(o) => tracing::warn!(
                cluster = %self.cluster,
                outage = %o.id,
                "quorum back: fail-open classes grant from etcd again; shipping the unprotected-grant spool"
            ),
            Transition::None => {}
        }
        self.expire(Instant::now()).await;
        if read_ok && self.declared().is_none() && self.spool_bytes() > 0 {
            let (me, store) = (self.clone(), store.clone());
            tokio::spawn(async move {
                if let Err(e) = me.ship(&store).await {
                    tracing::warn!(cluster = %me.cluster, error = %e, "shipping the unprotected-grant spool failed; retrying");
                }
            });
        }
        self.publish();
    }

    async fn write(&self, records: Vec<SpoolRecord>, capped: bool) -> Result<(), SpoolError> {
        if records.is_empty() {
            return Ok(());
        }
        let spool = self.spool.as_ref().map_err(|e| SpoolError::Io(e.clone()))?.clone();
        // A few ms of write + fsync: off the async workers.
        let r = tokio::task::spawn_blocking(move || spool.append(&records, capped))
            .await
            .unwrap_or_else(|e| Err(SpoolError::Io(e.to_string())));
        self.publish();
        r
    }

    fn record(&self, op: SpoolOp, d: &KeyDigest, h: &MemHold, reason: Option<&str>) -> SpoolRecord {
        SpoolRecord {
            op,
            grant: h.grant.clone(),
            key: h.key.clone(),
            digest: d.to_string(),
            class: h.class.clone(),
            identity: h.identity.clone(),
            instance: h.instance.clone(),
            hold_id: h.hold.as_ref().map(|(id, _)| id.clone()),
            epoch: h.epoch,
            cluster: self.cluster.clone(),
            outage: h.outage.clone(),
            at_ms: now_ms(),
            ttl_s: (op == SpoolOp::Grant).then_some(h.ttl_s),
            reason: reason.map(str::to_owned),
        }
    }

    /// Grants `req` unprotected (the caller checked that its class is open and the
    /// loss declared), waiting up to its deadline for room. `envoy` names the
    /// Envoy that owns a transparent hold (`req.hold_id`).
    pub async fn grant(
        &self,
        store: &Store,
        req: &AcquireRequest,
        envoy: Option<&str>,
        reg: &ClassRegistry,
        cancel: &CancellationToken,
    ) -> Result<MemGrant, LockError> {
        let outage = self.declared().ok_or_else(|| LockError::Unavailable("etcd unavailable".into()))?;
        if let Err(e) = &self.spool {
            return Err(LockError::Unavailable(format!(
                "class {} fails open, but this arbiter has no unprotected-grant spool: {e}",
                req.class.name
            )));
        }
        let class = req.class.name.as_str();
        // The authoritative map and policy as last read (nothing can be read now).
        let limit = store.policies().cached_limit(class, &req.key)?.unwrap_or(req.class.max_holders);
        let epoch = store.epoch().cached().unwrap_or(0);
        let d = req.key.digest();
        let grant = new_grant_id();
        loop {
            let hold = MemHold {
                grant: grant.clone(),
                key: req.key.as_str().to_owned(),
                class: class.to_owned(),
                identity: req.caller.identity.clone(),
                instance: req.caller.instance.clone(),
                hold: req.hold_id.clone().zip(envoy.map(str::to_owned)),
                ttl_s: req.class.ttl_s,
                expires: Instant::now() + Duration::from_secs(req.class.ttl_s),
                outage: outage.id.clone(),
                epoch,
                pending: true,
            };
            let notified = self.changed.notified();
            let r = self.mem().reserve(&d, hold.clone(), limit);
            match r {
                Reserve::Reserved => {
                    let rec = self.record(SpoolOp::Grant, &d, &hold, None);
                    if let Err(e) = self.write(vec![rec], true).await {
                        self.mem().unreserve(&d, &grant);
                        self.changed.notify_waiters();
                        STATS.refused(matches!(e, SpoolError::Full { .. }));
                        tracing::error!(cluster = %self.cluster, key = %d.short(), error = %e, "an unprotected grant was refused: its spool line could not be written");
                        return Err(spool_err(e));
                    }
                    self.mem().confirm(&d, &grant);
                    STATS.granted(lockmesh_telemetry::labels::lock_labels(reg, &req.key));
                    tracing::info!(cluster = %self.cluster, class, key = %d.short(), outage = %outage.id, "UNPROTECTED grant (token 0) from memory: quorum lost");
                    return Ok(MemGrant {
                        grant,
                        class: class.to_owned(),
                        ttl_s: req.class.ttl_s,
                        epoch,
                        outage: outage.id,
                        existing: false,
                    });
                }
                Reserve::Existing(h) => {
                    let h = *h;
                    return Ok(MemGrant {
                        grant: h.grant,
                        class: h.class,
                        ttl_s: h.ttl_s,
                        epoch: h.epoch,
                        outage: h.outage,
                        existing: true,
                    });
                }
                Reserve::Leaked => return Err(LockError::Leaked),
                Reserve::Full => {
                    let now = Instant::now();
                    if req.try_once || now >= req.deadline {
                        return Err(LockError::Contended(lockmesh_core::Reason::KeyGated));
                    }
                    // Woken by a release or an expiry; a short cap re-checks lapses.
                    let until = req.deadline.min(now + Duration::from_millis(200));
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(until) => { self.expire(Instant::now()).await; }
                        _ = cancel.cancelled() => return Err(LockError::Cancelled),
                    }
                }
            }
        }
    }

    /// Releases unprotected grant `grant` of `d`, held by `caller`'s identity.
    /// `reason` is recorded (`caller_gone` for an undone grant).
    pub async fn release(
        &self,
        d: &KeyDigest,
        grant: &str,
        caller: &Caller,
        reason: Option<&str>,
    ) -> Result<(), LockError> {
        let h = self.mem().remove(d, grant, |h| h.identity == caller.identity).ok_or(LockError::NotHolder)?;
        self.end(SpoolOp::Release, d, &h, reason).await;
        Ok(())
    }

    /// Releases the transparent hold `hold_id` of `d` owned by `envoy`; false when
    /// this arbiter has no such unprotected hold.
    pub(crate) async fn release_hold(&self, d: &KeyDigest, hold_id: &str, envoy: &str) -> bool {
        let h = {
            let mut m = self.mem();
            let Some(grant) = m.find_hold(d, hold_id, envoy) else { return false };
            m.remove(d, &grant, |_| true)
        };
        if let Some(h) = h {
            self.end(SpoolOp::Release, d, &h, None).await;
        }
        true
    }

    /// A filter VM's keepalive: renews its unprotected holds, and ends those the
    /// reconcile says ended. Returns how many it ended.
    pub async fn vm_keepalive(&self, envoy: &str, vm: &str, reconcile: Option<(&[u64], u64)>) -> usize {
        let ended = self.mem().vm_keepalive(envoy, vm, reconcile, Instant::now());
        let n = ended.len();
        for (d, h) in ended {
            self.end(SpoolOp::Release, &d, &h, Some("reconcile")).await;
        }
        n
    }

    /// Ends every hold that lapsed by `now` (spooled as `expiry`, reason `ttl`).
    pub async fn expire(&self, now: Instant) {
        let gone = self.mem().expire(now);
        if gone.is_empty() {
            return;
        }
        let recs = gone.iter().map(|(d, h)| self.record(SpoolOp::Expiry, d, h, Some("ttl"))).collect();
        self.changed.notify_waiters();
        if let Err(e) = self.write(recs, false).await {
            tracing::error!(cluster = %self.cluster, error = %e, "could not spool the expiry of unprotected holds");
        }
    }

    async fn end(&self, op: SpoolOp, d: &KeyDigest, h: &MemHold, reason: Option<&str>) {
        self.changed.notify_waiters();
        let rec = self.record(op, d, h, reason);
        if let Err(e) = self.write(vec![rec], false).await {
            // The hold is gone either way; the audit store will show it open.
            tracing::error!(cluster = %self.cluster, key = %d.short(), error = %e, "could not spool the end of an unprotected hold");
        }
    }

    /// True when `d` has an unprotected hold here.
    pub fn held(&self, d: &KeyDigest) -> bool {
        self.mem().held(d)
    }

    /// After a quorum loss: waits (up to `deadline`) until `d` has no unprotected
    /// hold here, so an etcd grant never joins one this arbiter handed out.
    pub async fn wait_free(
        &self,
        d: &KeyDigest,
        deadline: Instant,
        try_once: bool,
        cancel: &CancellationToken,
    ) -> Result<(), LockError> {
        loop {
            let notified = self.changed.notified();
            if !self.held(d) {
                return Ok(());
            }
            let now = Instant::now();
            if try_once || now >= deadline {
                return Err(LockError::Contended(lockmesh_core::Reason::KeyGated));
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep_until(deadline.min(now + Duration::from_millis(200))) => {
                    self.expire(Instant::now()).await;
                }
                _ = cancel.cancelled() => return Err(LockError::Cancelled),
            }
        }
    }

    /// Ships the spool to etcd (`<root>/u/<grant>/<op>`, on a lease), then cuts
    /// what was shipped. Returns the records shipped.
    pub async fn ship(&self, store: &Store) -> Result<usize, LockError> {
        let Ok(spool) = self.spool.clone() else { return Ok(0) };
        // One ship at a time; a check that finds one running leaves it to finish.
        let Ok(_one) = self.shipping.try_lock() else { return Ok(0) };
        let (records, upto) = spool.read().map_err(|e| LockError::Internal(e.to_string()))?;
        if records.is_empty() {
            if upto > 0 {
                spool.consume(upto).map_err(|e| LockError::Internal(e.to_string()))?;
            }
            return Ok(0);
        }
        let r = self.put_records(store, &records).await;
        STATS.shipped(r.is_ok(), if r.is_ok() { records.len() } else { 0 });
        r?;
        let s = spool.clone();
        tokio::task::spawn_blocking(move || s.consume(upto))
            .await
            .map_err(|e| LockError::Internal(e.to_string()))?
            .map_err(|e| LockError::Internal(e.to_string()))?;
        self.publish();
        tracing::info!(cluster = %self.cluster, records = records.len(), "shipped unprotected grants to the audit store (via etcd)");
        Ok(records.len())
    }

    async fn put_records(&self, store: &Store, records: &[SpoolRecord]) -> Result<(), LockError> {
        let lease = store.cluster().call(store.cluster().client().lease_grant(SHIP_LEASE_TTL_S, None)).await?.id();
        let opts = PutOptions::new().with_lease(lease);
        for chunk in records.chunks(SHIP_BATCH) {
            let mut ops = Vec::with_capacity(chunk.len());
            for r in chunk {
                let v = serde_json::to_vec(r).map_err(|e| LockError::Internal(e.to_string()))?;
                ops.push(TxnOp::put(
                    store.cluster().keys().unprotected(&r.grant, r.op.as_str()),
                    v,
                    Some(opts.clone()),
                ));
            }
            store.cluster().call(store.cluster().client().txn(Txn::new().and_then(ops))).await?;
        }
        Ok(())
    }
}

/// End lines for the grants of `records` that have none: the process that held
/// them is gone.
pub(crate) fn restart_ends(records: &[SpoolRecord], at_ms: u64) -> Vec<SpoolRecord> {
    let ended: std::collections::HashSet<&str> =
        records.iter().filter(|r| r.op != SpoolOp::Grant).map(|r| r.grant.as_str()).collect();
    records
        .iter()
        .filter(|r| r.op == SpoolOp::Grant && !ended.contains(r.grant.as_str()))
        .map(|r| SpoolRecord {
            op: SpoolOp::Expiry,
            at_ms,
            ttl_s: None,
            reason: Some("arbiter_restart".into()),
            ..r.clone()
        })
        .collect()
}

/// Fail-open metrics (process-wide; labels: namespace, class, tier, reason, outcome).
#[derive(Debug)]
pub struct FailOpenStats {
    granted: Described<Family<LockLabels, Counter>>,
    refused: Family<ReasonLabel, Counter>,
    /// Per cluster: spool bytes and whether a loss is declared; the gauges are their sum and any.
    clusters: Mutex<BTreeMap<String, (u64, bool)>>,
    spool_bytes: Gauge,
    declared: Gauge,
    ships: Family<OutcomeLabel, Counter>,
    records_shipped: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// The arbiter's fail-open metrics.
pub static STATS: LazyLock<FailOpenStats> = LazyLock::new(FailOpenStats::new);

// === impl FailOpenStats ===

impl Default for FailOpenStats {
    fn default() -> Self {
        Self::new()
    }
}

impl FailOpenStats {
    /// Zeroed metrics; the fixed reasons and outcomes exist from the start at 0.
    pub fn new() -> Self {
        let s = Self {
            granted: Described::default(),
            refused: Family::default(),
            clusters: Mutex::new(BTreeMap::new()),
            spool_bytes: Gauge::default(),
            declared: Gauge::default(),
            ships: Family::default(),
            records_shipped: Counter::default(),
        };
        for reason in ["spool_full", "io"] {
            s.refused.get_or_create_owned(&ReasonLabel { reason });
        }
        for outcome in ["ok", "error"] {
            s.ships.get_or_create_owned(&OutcomeLabel { outcome });
        }
        s
    }

    /// Adds the fail-open families to `registry` (the registry's copies share these values).
    pub fn register(&self, registry: &mut Registry) {
        // prometheus-client appends `_total` to a counter's name and `.` to its help.
        registry.register(
            "lockmesh_arbiter_unprotected_grants",
            "Grants of fail-open classes made from memory with token 0 during a declared quorum loss (ADR-04)",
            self.granted.clone(),
        );
        registry.register(
            "lockmesh_arbiter_unprotected_refused",
            "Unprotected grants refused because the spool was full (spool_full) or could not be written (io)",
            self.refused.clone(),
        );
        registry.register(
            "lockmesh_arbiter_unprotected_spool_bytes",
            "Bytes of unprotected-grant records not yet shipped to the audit store",
            self.spool_bytes.clone(),
        );
        registry.register(
            "lockmesh_arbiter_quorum_loss_declared",
            "1 while this arbiter has declared a quorum loss (fail-open classes grant unprotected)",
            self.declared.clone(),
        );
        registry.register("lockmesh_arbiter_unprotected_ships", "Spool ship rounds, by outcome", self.ships.clone());
        registry.register(
            "lockmesh_arbiter_unprotected_records_shipped",
            "Spool records shipped to the audit store",
            self.records_shipped.clone(),
        );
    }

    fn granted(&self, labels: LockLabels) {
        self.granted.get_or_create(&labels).inc();
    }

    fn refused(&self, full: bool) {
        self.refused.get_or_create(&ReasonLabel { reason: if full { "spool_full" } else { "io" } }).inc();
    }

    fn shipped(&self, ok: bool, records: usize) {
        self.ships.get_or_create(&OutcomeLabel { outcome: if ok { "ok" } else { "error" } }).inc();
        self.records_shipped.inc_by(u64::try_from(records).unwrap_or(0));
    }

    fn set_cluster(&self, cluster: &str, spool_bytes: u64, declared: bool) {
        let mut clusters = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        clusters.insert(cluster.to_owned(), (spool_bytes, declared));
        let (bytes, declared) = clusters.values().fold((0u64, false), |(b, d), (bb, dd)| (b + bb, d || *dd));
        self.spool_bytes.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.declared.set(i64::from(declared));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_ends_the_grants_it_no_longer_holds() {
        let rec = |op, g: &str| SpoolRecord {
            op,
            grant: g.into(),
            key: "jobs/a".into(),
            digest: "dd".into(),
            class: "batch".into(),
            identity: "spiffe://td/x".into(),
            instance: None,
            hold_id: None,
            epoch: 1,
            cluster: "coord".into(),
            outage: "coord-1".into(),
            at_ms: 1,
            ttl_s: Some(30),
            reason: None,
        };
        let recs = [rec(SpoolOp::Grant, "a"), rec(SpoolOp::Grant, "b"), rec(SpoolOp::Release, "a")];
        let ends = restart_ends(&recs, 9);
        assert_eq!(ends.len(), 1);
        assert_eq!((ends[0].op, ends[0].grant.as_str(), ends[0].at_ms), (SpoolOp::Expiry, "b", 9));
        assert_eq!(ends[0].reason.as_deref(), Some("arbiter_restart"));
        assert_eq!(ends[0].ttl_s, None);
    }

    #[test]
    fn metrics_have_bounded_labels() {
        let st = FailOpenStats::new();
        st.granted(LockLabels { namespace: "jobs".into(), class: "batch".into(), tier: "entity" });
        st.refused(true);
        st.shipped(true, 3);
        st.set_cluster("coord", 120, true);
        let mut registry = Registry::default();
        st.register(&mut registry);
        let mut s = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut s, &registry).unwrap();
        assert!(s.contains(
            "lockmesh_arbiter_unprotected_grants_total{namespace=\"jobs\",class=\"batch\",tier=\"entity\"} 1\n"
        ));
        assert!(s.contains("lockmesh_arbiter_unprotected_refused_total{reason=\"spool_full\"} 1\n"));
        assert!(s.contains("lockmesh_arbiter_unprotected_spool_bytes 120\n"));
        assert!(s.contains("lockmesh_arbiter_quorum_loss_declared 1\n"));
        assert!(s.contains("lockmesh_arbiter_unprotected_records_shipped_total 3\n"));
    }
}
