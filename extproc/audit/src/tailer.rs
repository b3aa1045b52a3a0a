//! The tailer: election, the watch from the checkpoint, batching, gaps, restore
//! detection and the metrics endpoint (the query API is on its own port,
//! [`crate::query_port`]).
//!
//! # Election
//! One tailer writes per cluster root. Replicas campaign for
//! `<root>/sys/audit-leader` with a create-if-absent transaction putting their
//! name on a lease (`election_ttl_s`, default 10 s) they renew every third of
//! it. A replica that cannot renew stops tailing at once (it may have lost the
//! key); the key goes with the lease and
//! another replica takes over from the checkpoint in *its* store. Two tailers
//! briefly overlapping would write the same events under the same keys (each to
//! its own store), so an overlap duplicates nothing.
//!
//! # Checkpoints
//! Events are buffered and committed with the checkpoint (the last revision all
//! of whose events are in the batch) every `checkpoint_interval_ms`, in one
//! store transaction (and first to ClickHouse when configured).

use std::{collections::HashSet, sync::Arc, time::Duration};

use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use lockmesh_core::wire::audit::{self as wire, CheckpointReply, GapDetail, RestoreDetail};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{
    config::Config,
    decode::{self, Change, Context, Op, Prev},
    event::{AuditEvent, EventKind},
    stats::Stats,
    store::{Checkpoint, Store},
};
use lockmesh_keyspace::{
    epoch::{cluster_hex, EpochRecord},
    keys::Keys,
    now_ms,
};

/// A running tailer's shared parts.
pub struct Tailer {
    cfg: Config,
    /// The etcd TLS files (the CA bundle, and the client certificate when one is
    /// configured), re-read every `ETCD_CERT_RELOAD`: each (re)connect verifies
    /// and presents the ones current at its handshake. `None` on plaintext.
    etcd_certs: Option<Arc<lockmesh_runtime::ReloadingCerts>>,
    store: Arc<Store>,
    stats: Stats,
    keys: Keys,
}

type Error = String;

fn e2s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Runs the tailer until `shutdown` resolves: metrics on `admin`, the query API
/// on `query` (bound to `cfg.query.listen`; `None` when `query` is not configured).
pub async fn run(
    cfg: Config,
    admin: tokio::net::TcpListener,
    query: Option<tokio::net::TcpListener>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    if let Some(q) = &cfg.query {
        crate::query_port::check(q)?;
        for w in q.weakened() {
            tracing::warn!("{w}");
        }
    }
    crate::test_faults::install(&cfg.test_faults);
    let store = Arc::new(Store::open(&cfg.store_file)?);
    let etcd_certs = cfg.etcd_auth.reloading_certs(lockmesh_etcd::ETCD_CERT_RELOAD)?;
    let t = Arc::new(Tailer { keys: Keys::new(&cfg.etcd_root), store, stats: Stats::default(), etcd_certs, cfg });
    t.stats.set_window(t.cfg.compaction_window_s);
    if let Some(cp) = t.store.checkpoint()? {
        t.stats.progress(cp.revision, cp.revision, cp.updated_ms);
    }
    let stop = CancellationToken::new();
    let admin_task = tokio::spawn(serve_admin(admin, t.clone(), stop.clone()));
    let query_task = match (query, t.cfg.query.clone()) {
        (Some(listener), Some(q)) => {
            let (reader, stop) = (crate::reader::for_config(&t.cfg, t.store.clone()), stop.clone());
            tracing::info!(store = reader.name(), "audit queries are answered from the {} store", reader.name());
            Some(tokio::spawn(async move {
                if let Err(e) = crate::query_port::serve(listener, &q, reader, stop.cancelled_owned()).await {
                    tracing::error!(error = %e, "audit query listener failed");
                }
            }))
        }
        _ => None,
    };
    let archive_task =
        t.cfg.archive.clone().map(|a| tokio::spawn(crate::archive::run(a, t.store.clone(), stop.clone())));
    let work = {
        let (t, stop) = (t.clone(), stop.clone());
        async move {
            loop {
                if let Err(e) = t.clone().lead(&stop).await {
                    tracing::warn!(error = %e, "audit tailer interrupted; retrying");
                }
                t.stats.set_leader(false);
                if stop.is_cancelled() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    tokio::select! {
        _ = shutdown => {}
        _ = work => {}
    }
    stop.cancel();
    let _ = admin_task.await;
    if let Some(a) = archive_task {
        let _ = a.await;
    }
    if let Some(q) = query_task {
        let _ = q.await;
    }
    Ok(())
}

/// Connects to etcd over `lockmesh_etcd::EtcdClientAuth::connect`'s
/// failover channel (reloading the CA bundle, and the client certificate when one
/// is configured).
async fn connect(cfg: &Config, certs: Option<&Arc<lockmesh_runtime::ReloadingCerts>>) -> Result<Client, Error> {
    let (connect_timeout, keep_alive) = (Duration::from_secs(3), (Duration::from_secs(5), Duration::from_secs(3)));
    let timeouts =
        lockmesh_runtime::ChannelOptions { connect_timeout, request_timeout: None, keep_alive: Some(keep_alive) };
    tokio::time::timeout(Duration::from_secs(5), cfg.etcd_auth.connect(&cfg.etcd_endpoints, certs, timeouts))
        .await
        .map_err(|_| "etcd connect timed out".to_owned())?
        .map_err(e2s)
}

// === impl Tailer ===

impl Tailer {
    fn leader_key(&self) -> String {
        format!("{}/sys/audit-leader", self.cfg.etcd_root)
    }

    /// Campaigns, then tails while leader.
    async fn lead(self: Arc<Self>, stop: &CancellationToken) -> Result<(), Error> {
        let mut client = connect(&self.cfg, self.etcd_certs.as_ref()).await?;
        let lease =
            loop {
                let ttl = i64::try_from(self.cfg.election_ttl_s).unwrap_or(10);
                let lease = client.lease_grant(ttl, None).await.map_err(e2s)?.id();
                let key = self.leader_key();
                let txn = Txn::new().when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)]).and_then([
                    TxnOp::put(key.as_str(), self.cfg.instance.as_str(), Some(PutOptions::new().with_lease(lease))),
                ]);
                if client.txn(txn).await.map_err(e2s)?.succeeded() {
                    break lease;
                }
                let _ = client.lease_revoke(lease).await;
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            };
        tracing::info!(instance = %self.cfg.instance, "audit tailer elected");
        self.stats.set_leader(true);
        let lost = stop.child_token();
        let keeper = tokio::spawn({
            let (mut c, lost) = (client.clone(), lost.clone());
            let period = Duration::from_millis(self.cfg.election_ttl_s * 1000 / 3);
            async move {
                loop {
                    tokio::time::sleep(period).await;
                    let r = tokio::time::timeout(period, c.lease_keep_alive(lease)).await;
                    if !matches!(r, Ok(Ok(_))) {
                        tracing::warn!("audit tailer could not renew its election lease; stepping down");
                        lost.cancel();
                        return;
                    }
                }
            }
        });
        let r = self.tail(&mut client, &lost).await;
        keeper.abort();
        let _ = client.lease_revoke(lease).await;
        r
    }

    /// Reads the cluster id, head revision and epoch record.
    async fn head(&self, client: &mut Client) -> Result<(String, i64, Option<(EpochRecord, i64)>), Error> {
        let r = client.get(self.keys.epoch(), None).await.map_err(e2s)?;
        let h = r.header().ok_or("etcd response without header")?;
        let rec = r.kvs().first().and_then(|kv| Some((serde_json::from_slice(kv.value()).ok()?, kv.mod_revision())));
        Ok((cluster_hex(h.cluster_id()), h.revision(), rec))
    }

    /// Seals the lock service the way `lockctl epoch-advance` step 1 does: an
    /// explicit seal in the epoch record with the target epoch, guarded by the
    /// record's mod revision. The operator finishes with
    /// `lockctl epoch-advance --expected-epoch E --new-epoch <target>`.
    async fn seal(&self, client: &mut Client, why: &str, max_epoch: u64) -> Result<Option<u64>, Error> {
        let (_, _, rec) = self.head(client).await?;
        let Some((rec, mod_rev)) = rec else { return Ok(None) };
        if rec.sealed.is_some() {
            return Ok(rec.target);
        }
        let target = rec.epoch.max(max_epoch) + 1;
        let sealed = EpochRecord { sealed: Some(why.to_owned()), target: Some(target), ..rec };
        let txn = Txn::new()
            .when([Compare::mod_revision(self.keys.epoch(), CompareOp::Equal, mod_rev)])
            .and_then([TxnOp::put(self.keys.epoch(), serde_json::to_vec(&sealed).map_err(e2s)?, None)]);
        client.txn(txn).await.map_err(e2s)?;
        Ok(Some(target))
    }

    /// [`Self::seal`], unless the tailer's etcd user may not write the epoch record:
    /// the shipped `lockmesh-audit` role reads the root and writes only its election
    /// key (`lockmesh_ops::admin::etcd_roles`). Then the restore is recorded unsealed
    /// (`sealed_target: null`) and tailing goes on, rather than failing and retrying
    /// forever: the arbiters' own marks seal them (docs/OPERATIONS.md, restore
    /// runbook) and the operator runs the epoch advance.
    async fn seal_if_permitted(&self, client: &mut Client, why: &str, max_epoch: u64) -> Result<Option<u64>, Error> {
        match self.seal(client, why, max_epoch).await {
            Err(e) if e.contains("permission denied") => {
                tracing::error!(error = %e, "RESTORE DETECTED: the audit tailer's etcd role may not write the epoch \
                    record; recorded unsealed, the arbiters' marks seal them, run lockctl epoch-advance");
                Ok(None)
            }
            r => r,
        }
    }

    /// An event of the tailer's own (a restore, a gap) at `revision`, with `detail`.
    fn marker(&self, cp: &Checkpoint, kind: EventKind, revision: i64, detail: &impl Serialize) -> AuditEvent {
        AuditEvent {
            cluster_id: cp.cluster_id.clone(),
            timeline: cp.timeline,
            epoch: cp.epoch,
            revision,
            etcd_key: format!("{}/", self.cfg.etcd_root),
            kind,
            digest: None,
            key: None,
            identity: None,
            instance: None,
            class: None,
            session: None,
            grant_revision: None,
            slot: None,
            at_ms: now_ms(),
            detail: serde_json::to_value(detail).ok(),
            unprotected: false,
        }
    }

    /// Commits `pending` with `cp` (ClickHouse first, when configured).
    async fn commit(&self, pending: &mut Vec<AuditEvent>, cp: &mut Checkpoint) -> Result<(), Error> {
        // A `lockmesh.audit_commit` span for a batch that carries events (OTLP, when configured).
        let span = (!pending.is_empty()).then(|| lockmesh_telemetry::audit_commit_span(pending.len()));
        let r = self.commit_batch(pending, cp).await;
        if let Some(span) = &span {
            lockmesh_telemetry::finish(span, if r.is_ok() { "ok" } else { "error" }, None);
        }
        r
    }

    async fn commit_batch(&self, pending: &mut Vec<AuditEvent>, cp: &mut Checkpoint) -> Result<(), Error> {
        if let Some(sink) = &self.cfg.clickhouse {
            sink.insert(pending).await.map_err(e2s)?;
            if !pending.is_empty() && crate::test_faults::pause_once() {
                tracing::error!(events = pending.len(), "AUDIT TEST: batch sent to clickhouse");
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
        }
        cp.updated_ms = now_ms();
        let a = self.store.apply(pending, cp).map_err(e2s)?;
        self.stats.committed(pending, a.new, a.replayed, self.cfg.registry.as_ref(), now_ms());
        pending.clear();
        Ok(())
    }

    /// Rebuilds the open-hold gauge from etcd's current holds.
    async fn resync_open(&self, client: &mut Client, timeline: u32) -> Result<(), Error> {
        let r = client.get(self.keys.all_locks(), Some(GetOptions::new().with_prefix())).await.map_err(e2s)?;
        let open = r
            .kvs()
            .iter()
            .filter_map(|kv| {
                let h: lockmesh_keyspace::HoldRecord = serde_json::from_slice(kv.value()).ok()?;
                let labels = match &self.cfg.registry {
                    Some(reg) => lockmesh_telemetry::labels::labels_of_raw(reg, &h.key),
                    None => lockmesh_telemetry::labels::LockLabels {
                        namespace: "other".into(),
                        class: h.class.clone(),
                        tier: "entity",
                    },
                };
                Some((
                    format!("{timeline}/{}/{}", kv.create_revision(), String::from_utf8_lossy(kv.key())),
                    labels,
                    h.acquired_ms,
                ))
            })
            .collect();
        self.stats.reset_open(open);
        Ok(())
    }

    async fn tail(&self, client: &mut Client, lost: &CancellationToken) -> Result<(), Error> {
        let (cluster, head, rec) = self.head(client).await?;
        let rec_epoch = rec.as_ref().map_or(0, |(r, _)| r.epoch);
        let mut pending = Vec::new();
        let mut cp = match self.store.checkpoint().map_err(e2s)? {
            Some(cp) if cp.cluster_id == cluster && head < cp.revision => {
                // The cluster went back behind what we stored: a restore.
                let why = format!(
                    "audit tailer: cluster {cluster} is at revision {head}, behind the audit checkpoint {}: restored",
                    cp.revision
                );
                tracing::error!(%why, "RESTORE DETECTED by the audit tailer");
                let mut next = Checkpoint { timeline: cp.timeline + 1, revision: head, epoch: rec_epoch, ..cp.clone() };
                let target = if self.cfg.seal_on_restore {
                    self.seal_if_permitted(client, &why, cp.max_epoch).await?
                } else {
                    None
                };
                let detail = RestoreDetail { checkpoint: cp.revision, current: head, sealed_target: target };
                pending.push(self.marker(&next, EventKind::Restore, head, &detail));
                self.commit(&mut pending, &mut next).await?;
                next
            }
            Some(cp) if cp.cluster_id != cluster => {
                tracing::error!(from = %cp.cluster_id, to = %cluster, "the audited etcd is another cluster: recording a gap");
                let mut next = Checkpoint {
                    cluster_id: cluster.clone(),
                    timeline: cp.timeline + 1,
                    revision: 0,
                    epoch: rec_epoch,
                    ..cp.clone()
                };
                let detail = GapDetail::ClusterChanged { from_cluster: cp.cluster_id, from_revision: cp.revision };
                pending.push(self.marker(&next, EventKind::Gap, 0, &detail));
                self.commit(&mut pending, &mut next).await?;
                next
            }
            Some(cp) => cp,
            None => Checkpoint {
                cluster_id: cluster.clone(),
                timeline: 0,
                revision: 0,
                epoch: 0,
                max_epoch: 0,
                updated_ms: 0,
            },
        };
        self.resync_open(client, cp.timeline).await?;
        let mut closed_here: HashSet<String> = HashSet::new();
        let prefix = format!("{}/", self.cfg.etcd_root);
        let mut tick = tokio::time::interval(Duration::from_millis(self.cfg.checkpoint_interval_ms));
        'watch: loop {
            let opts = WatchOptions::new()
                .with_prefix()
                .with_prev_key()
                .with_progress_notify()
                .with_start_revision(cp.revision + 1);
            let mut stream = client.watch(prefix.as_str(), Some(opts)).await.map_err(e2s)?;
            loop {
                tokio::select! {
                    _ = lost.cancelled() => {
                        self.commit(&mut pending, &mut cp).await?;
                        return Ok(());
                    }
                    _ = tick.tick() => {
                        self.commit(&mut pending, &mut cp).await?;
                        closed_here.clear();
                        let (c, h, _) = self.head(client).await?;
                        if c != cp.cluster_id || h < cp.revision {
                            return Err(format!("cluster {c} at revision {h} is not the history at checkpoint {}", cp.revision));
                        }
                        if self.stats.progress(cp.revision, h, cp.updated_ms) {
                            tracing::error!(lag_s = self.stats.lag_seconds(), window_s = self.cfg.compaction_window_s,
                                "AUDIT LAG ALARM: behind by half of etcd's compaction window; history may be compacted before it is read");
                        }
                    }
                    msg = stream.message() => {
                        let Some(resp) = msg.map_err(e2s)? else { return Err("watch ended".into()) };
                        if resp.compact_revision() > 0 {
                            // Compacted past the checkpoint: what lies between is lost.
                            let gap_to = resp.compact_revision() - 1;
                            tracing::error!(from = cp.revision + 1, to = gap_to, "AUDIT GAP: etcd compacted past the checkpoint");
                            self.commit(&mut pending, &mut cp).await?;
                            let detail = GapDetail::Compacted { from_revision: cp.revision + 1, to_revision: gap_to };
                            pending.push(self.marker(&cp, EventKind::Gap, gap_to, &detail));
                            cp.revision = gap_to;
                            self.commit(&mut pending, &mut cp).await?;
                            self.resync_open(client, cp.timeline).await?;
                            continue 'watch;
                        }
                        if resp.canceled() {
                            return Err(format!("watch cancelled: {}", resp.cancel_reason()));
                        }
                        let head = resp.header().map_or(0, |h| h.revision());
                        self.apply_events(&resp, &mut cp, &mut pending, &mut closed_here)?;
                        if resp.events().is_empty() && !resp.created() && head > cp.revision {
                            // A progress notification: every event up to `head` was sent.
                            cp.revision = head;
                        }
                        self.stats.progress(cp.revision, head, cp.updated_ms);
                    }
                }
            }
        }
    }

    fn apply_events(
        &self,
        resp: &etcd_client::WatchResponse,
        cp: &mut Checkpoint,
        pending: &mut Vec<AuditEvent>,
        closed_here: &mut HashSet<String>,
    ) -> Result<(), Error> {
        let evs = resp.events();
        let mut i = 0;
        while i < evs.len() {
            let rev = evs[i].kv().map_or(0, |kv| kv.mod_revision());
            let mut changes = Vec::new();
            while i < evs.len() && evs[i].kv().map_or(0, |kv| kv.mod_revision()) == rev {
                let e = &evs[i];
                if let Some(kv) = e.kv() {
                    changes.push(Change {
                        op: if e.event_type() == EventType::Delete { Op::Delete } else { Op::Put },
                        key: kv.key().to_vec(),
                        value: kv.value().to_vec(),
                        lease: kv.lease(),
                        create_revision: kv.create_revision(),
                        prev: e.prev_kv().map(|p| Prev {
                            value: p.value().to_vec(),
                            lease: p.lease(),
                            create_revision: p.create_revision(),
                        }),
                    });
                }
                i += 1;
            }
            let store = &self.store;
            let (cluster, timeline) = (cp.cluster_id.clone(), cp.timeline);
            let closed =
                |sid: &str| closed_here.contains(sid) || store.is_closed(&cluster, timeline, sid).unwrap_or(false);
            let ctx = Context {
                root: &self.cfg.etcd_root,
                cluster_id: &cp.cluster_id,
                timeline,
                epoch: cp.epoch,
                now_ms: now_ms(),
                closed: &closed,
            };
            let d = decode::decode(&ctx, rev, &changes);
            closed_here.extend(d.closed);
            if let Some(e) = d.epoch {
                cp.epoch = e;
                cp.max_epoch = cp.max_epoch.max(e);
            }
            pending.extend(d.events);
            cp.revision = cp.revision.max(rev);
        }
        Ok(())
    }
}

/// The store's checkpoint as `GET /v1/audit/checkpoint` answers it.
fn wire_checkpoint(cp: Checkpoint) -> wire::Checkpoint {
    let Checkpoint { cluster_id, timeline, revision, epoch, max_epoch, updated_ms } = cp;
    wire::Checkpoint { cluster_id, timeline, revision, epoch, max_epoch, updated_ms }
}

async fn serve_admin(listener: tokio::net::TcpListener, t: Arc<Tailer>, stop: CancellationToken) {
    use axum::{extract::State, http::StatusCode, routing::get, Json, Router};
    async fn metrics(State(t): State<Arc<Tailer>>) -> axum::response::Response {
        use axum::{http::header, response::IntoResponse};
        match t.stats.encode(now_ms()) {
            Ok(text) => ([(header::CONTENT_TYPE, crate::stats::CONTENT_TYPE)], text).into_response(),
            Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        }
    }
    async fn checkpoint(State(t): State<Arc<Tailer>>) -> Json<CheckpointReply> {
        Json(CheckpointReply { checkpoint: t.store.checkpoint().ok().flatten().map(wire_checkpoint) })
    }
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/v1/audit/checkpoint", get(checkpoint))
        // No `/v1/audit/query` here: scrapers reach this port (a query answers 404).
        .with_state(t);
    if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await {
        tracing::error!(error = %e, "audit admin listener failed");
    }
}
