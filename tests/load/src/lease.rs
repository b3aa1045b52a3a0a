//! An etcd lease kept alive in the background (every TTL/3), as each `etcd-lock`
//! and `raw-txn` client holds one, like a lockmesh session.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use etcd_client::Client;
use tokio::task::JoinHandle;

use super::record::Recorder;

/// Lease TTL, seconds: the lock tier's default class TTL in the harness registry.
pub(crate) const LEASE_TTL_S: i64 = 15;

/// A granted lease and its keep-alive task (aborted on drop).
pub(crate) struct Lease {
    id: i64,
    keeper: JoinHandle<()>,
}

// === impl Lease ===

impl Lease {
    /// Grants a lease and starts renewing it.
    pub async fn grant(client: &mut Client, what: &'static str, rec: Arc<Recorder>) -> Result<Self> {
        let id = client.lease_grant(LEASE_TTL_S, None).await.context("lease grant")?.id();
        let (mut keeper, mut stream) = client.lease_keep_alive(id).await.context("lease keepalive")?;
        let keeper = tokio::spawn(async move {
            let period = Duration::from_millis(LEASE_TTL_S as u64 * 1000 / 3);
            loop {
                tokio::time::sleep(period).await;
                if let Err(e) = keeper.keep_alive().await {
                    rec.error(what, &e.to_string());
                    return;
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    Ok(_) => {
                        rec.error(what, "lease lost");
                        return;
                    }
                    Err(e) => {
                        rec.error(what, &e.to_string());
                        return;
                    }
                }
            }
        });
        Ok(Self { id, keeper })
    }

    /// The lease id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Stops renewing and revokes the lease (deleting every key on it).
    pub async fn revoke(self, client: &mut Client) -> Result<()> {
        self.keeper.abort();
        client.lease_revoke(self.id).await.context("lease revoke")?;
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}
