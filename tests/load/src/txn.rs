//! The `raw-txn` workload's client: the fewest etcd writes a lease-bound lock can
//! take. Acquire is one transaction, `create_revision(key) == 0 → put key (lease)`;
//! its commit revision is the token. Release is one delete. A refused client
//! watches the key from the revision of its refusal for a delete (a 1 s poll is the
//! backstop) and tries again: no queue, so no FIFO, and every waiter retries at
//! each release.
//!
//! The client keeps one watch stream for its life and adds and cancels one watch
//! per wait on it, so waiting costs no new gRPC stream.
//!
//! Shapes: `raw-txn` ([`TxnShape::Plain`]) as above; `raw-txn-marker` adds the
//! release marker; `raw-txn-design` ([`TxnShape::Design`]) does what lockmesh asks
//! of etcd per cycle, without the mesh: its etcd CPU per cycle is the etcd-side
//! floor of lockmesh's design (issue 20).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use etcd_client::{Client, Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchOptions, WatchStream};

use super::lease::Lease;
use super::record::Recorder;

/// Longest wait for a delete before trying again anyway.
const POLL: Duration = Duration::from_secs(1);

/// What a cycle writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TxnShape {
    /// Put-if-absent, delete.
    Plain,
    /// A release also puts `<key>/r` on the lease (`raw-txn-marker`).
    Marker,
    /// lockmesh's etcd operations (`raw-txn-design`), with an epoch record, a
    /// grant clock and client `i`'s session record under `root`.
    Design { root: String, i: usize },
}

/// One etcd client (its own connection), its lease and its watch stream.
pub(crate) struct RawTxnClient {
    client: Client,
    lease: Option<Lease>,
    watch: WatchStream,
    idle_key: String,
    shape: TxnShape,
    /// `Design`: the epoch record's mod revision (compared by every grant).
    epoch_rev: i64,
    rec: Arc<Recorder>,
}

async fn open_watch(client: &mut Client, idle_key: &str) -> Result<WatchStream> {
    // The stream is opened with a watch on a key nobody writes; its `created`
    // answer is read here so that later answers belong to later watches.
    let mut w = client.watch(idle_key, None).await.context("open watch")?;
    match w.message().await? {
        Some(r) if r.created() => Ok(w),
        _ => bail!("watch stream did not confirm its first watch"),
    }
}

// === impl RawTxnClient ===

impl RawTxnClient {
    /// Connects, grants the client's lease and opens its watch stream.
    pub async fn connect(
        etcd: &crate::EtcdAccess,
        idle_key: &str,
        shape: TxnShape,
        rec: Arc<Recorder>,
    ) -> Result<Self> {
        let mut client = etcd.connect().await?;
        let lease = Lease::grant(&mut client, "raw-txn keepalive", rec.clone()).await?;
        let watch = open_watch(&mut client, idle_key).await?;
        let mut epoch_rev = 0;
        if let TxnShape::Design { root, i } = &shape {
            // The epoch record (written once; every grant compares it) and this
            // client's session record on its lease, as lockmesh keeps them.
            let epoch = format!("{root}/sys/epoch");
            let have = client.get(epoch.as_str(), None).await?;
            epoch_rev = match have.kvs().first() {
                Some(kv) => kv.mod_revision(),
                None => {
                    let put = Txn::new()
                        .when([Compare::create_revision(epoch.as_str(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(epoch.as_str(), "1", None)]);
                    client.txn(put).await?;
                    let got = client.get(epoch.as_str(), None).await?;
                    got.kvs().first().map(|kv| kv.mod_revision()).context("epoch record not written")?
                }
            };
            let session = PutOptions::new().with_lease(lease.id());
            client.put(format!("{root}/s/{i}"), "session", Some(session)).await?;
        }
        Ok(Self { client, lease: Some(lease), watch, idle_key: idle_key.to_owned(), shape, epoch_rev, rec })
    }

    /// The grant transaction for `key` on `lease`.
    fn grant_txn(&self, key: &str, lease: i64) -> Txn {
        let opts = PutOptions::new().with_lease(lease);
        match &self.shape {
            TxnShape::Design { root, i } => {
                let slots = format!("{key}/");
                Txn::new()
                    .when([
                        Compare::mod_revision(format!("{root}/sys/epoch"), CompareOp::Equal, self.epoch_rev),
                        // Every slot of the key (`<key>/` up to `<key>0`, '/' + 1).
                        Compare::create_revision(slots.as_str(), CompareOp::Equal, 0).with_range(format!("{key}0")),
                        Compare::lease(format!("{root}/s/{i}"), CompareOp::Equal, lease),
                        Compare::mod_revision(format!("{root}/sys/clock"), CompareOp::Greater, -1),
                    ])
                    .and_then([
                        TxnOp::put(format!("{key}/0"), "held", Some(opts)),
                        TxnOp::put(format!("{root}/sys/clock"), "", None),
                    ])
            }
            _ => Txn::new().when([Compare::create_revision(key, CompareOp::Equal, 0)]).and_then([TxnOp::put(
                key,
                "held",
                Some(opts),
            )]),
        }
    }

    /// Put-if-absent until it succeeds; the commit revision.
    pub async fn acquire(&mut self, key: &str) -> Result<u64> {
        let Some(lease) = &self.lease else {
            bail!("no lease");
        };
        let lease = lease.id();
        loop {
            let r = self.client.txn(self.grant_txn(key, lease)).await?;
            let rev = r.header().context("txn answer without header")?.revision();
            if r.succeeded() {
                if matches!(self.shape, TxnShape::Design { .. }) {
                    // The grant-time raft check: the member's raft position.
                    self.client.status().await?;
                }
                return u64::try_from(rev).context("negative revision");
            }
            let watched = match self.shape {
                TxnShape::Design { .. } => format!("{key}/0"),
                _ => key.to_owned(),
            };
            self.wait_delete(&watched, rev).await?;
        }
    }

    /// Waits for a delete of `key` after `rev`, or [`POLL`].
    async fn wait_delete(&mut self, key: &str, rev: i64) -> Result<()> {
        let opts = WatchOptions::new().with_start_revision(rev + 1);
        self.watch.watch(key, Some(opts)).await?;
        let mut id = None;
        let waited = tokio::time::timeout(POLL, async {
            loop {
                let Some(r) = self.watch.message().await? else {
                    bail!("watch stream ended");
                };
                if id.is_none() {
                    // Answers of cancelled watches may still come; ours starts
                    // with its `created`.
                    if r.created() && !r.canceled() {
                        id = Some(r.watch_id());
                    }
                    continue;
                }
                if Some(r.watch_id()) != id {
                    continue;
                }
                if r.canceled() || r.events().iter().any(|e| e.event_type() == EventType::Delete) {
                    return Ok(());
                }
            }
        })
        .await;
        match (waited, id) {
            (Ok(Err(e)), _) => Err(e),
            (_, Some(id)) => {
                self.watch.cancel(id).await?;
                Ok(())
            }
            // No `created` within the poll: this stream can no longer tell whose
            // answers it carries; start a new one.
            (_, None) => {
                self.watch = open_watch(&mut self.client, &self.idle_key).await?;
                Ok(())
            }
        }
    }

    /// Deletes the key; with `marker`, and puts `<key>/r` on the lease in the
    /// same transaction (lockmesh's release marker has the same shape: a small
    /// value on a lease, overwritten at each release of the key).
    pub async fn release(&mut self, key: &str) -> Result<()> {
        match (&self.lease, &self.shape) {
            (Some(lease), TxnShape::Marker) => {
                let put = TxnOp::put(format!("{key}/r"), "released", Some(PutOptions::new().with_lease(lease.id())));
                self.client.txn(Txn::new().and_then([TxnOp::delete(key, None), put])).await?;
            }
            (Some(lease), TxnShape::Design { .. }) => {
                // Only the holder's own hold (lease compare), its lock-delay guard
                // (absent unless a class sets a delay) and the release marker.
                let hold = format!("{key}/0");
                let put = TxnOp::put(format!("{key}.r"), "released", Some(PutOptions::new().with_lease(lease.id())));
                let txn = Txn::new().when([Compare::lease(hold.as_str(), CompareOp::Equal, lease.id())]).and_then([
                    TxnOp::delete(hold.as_str(), None),
                    TxnOp::delete(format!("{key}.g"), None),
                    put,
                ]);
                self.client.txn(txn).await?;
            }
            _ => {
                self.client.delete(key, None).await?;
            }
        }
        Ok(())
    }

    /// Revokes the lease (deleting any key on it) and grants a new one.
    pub async fn reset(&mut self) -> Result<()> {
        if let Some(l) = self.lease.take() {
            l.revoke(&mut self.client).await?;
        }
        self.lease = Some(Lease::grant(&mut self.client, "raw-txn keepalive", self.rec.clone()).await?);
        Ok(())
    }

    /// Revokes the lease.
    pub async fn close(mut self) {
        if let Some(l) = self.lease.take() {
            if let Err(e) = l.revoke(&mut self.client).await {
                self.rec.error("raw-txn close", &format!("{e:#}"));
            }
        }
    }
}
