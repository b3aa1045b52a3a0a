//! The `raw-txn` workload's client: the fewest etcd writes a lease-bound lock can
//! take. Acquire is one transaction, `create_revision(key) == 0 → put key (lease)`;
//! its commit revision is the token. Release is one delete. A refused client
//! watches the key from the revision of its refusal for a delete (a 1 s poll is the
//! backstop) and tries again: no queue, so no FIFO, and every waiter retries at
//! each release.
//!
//! The client keeps one watch stream for its life and adds and cancels one watch
//! per wait on it, so waiting costs no new gRPC stream.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use etcd_client::{Client, Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchOptions, WatchStream};

use super::lease::Lease;
use super::record::Recorder;

/// Longest wait for a delete before trying again anyway.
const POLL: Duration = Duration::from_secs(1);

/// One etcd client (its own connection), its lease and its watch stream.
pub(crate) struct RawTxnClient {
    client: Client,
    lease: Option<Lease>,
    watch: WatchStream,
    idle_key: String,
    /// Whether a release also puts `<key>/r` on the lease (`raw-txn-marker`).
    marker: bool,
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
    pub async fn connect(endpoints: &[String], idle_key: &str, marker: bool, rec: Arc<Recorder>) -> Result<Self> {
        let mut client =
            Client::connect(endpoints, None).await.with_context(|| format!("connect to etcd {endpoints:?}"))?;
        let lease = Lease::grant(&mut client, "raw-txn keepalive", rec.clone()).await?;
        let watch = open_watch(&mut client, idle_key).await?;
        Ok(Self { client, lease: Some(lease), watch, idle_key: idle_key.to_owned(), marker, rec })
    }

    /// Put-if-absent until it succeeds; the commit revision.
    pub async fn acquire(&mut self, key: &str) -> Result<u64> {
        let Some(lease) = &self.lease else {
            bail!("no lease");
        };
        let opts = PutOptions::new().with_lease(lease.id());
        loop {
            let txn = Txn::new().when([Compare::create_revision(key, CompareOp::Equal, 0)]).and_then([TxnOp::put(
                key,
                "held",
                Some(opts.clone()),
            )]);
            let r = self.client.txn(txn).await?;
            let rev = r.header().context("txn answer without header")?.revision();
            if r.succeeded() {
                return u64::try_from(rev).context("negative revision");
            }
            self.wait_delete(key, rev).await?;
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
        match (&self.lease, self.marker) {
            (Some(lease), true) => {
                let put = TxnOp::put(format!("{key}/r"), "released", Some(PutOptions::new().with_lease(lease.id())));
                self.client.txn(Txn::new().and_then([TxnOp::delete(key, None), put])).await?;
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
