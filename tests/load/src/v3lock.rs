//! The `etcd-lock` workload's client: etcd's own v3lock service. `Lock(name,
//! lease)` waits server-side until the client's key is the oldest under `name/`,
//! and answers with that key; `Unlock(key)` deletes it by name.
//!
//! The token recorded is the `Lock` answer's header revision: the commit revision
//! of the lock's put when it was free, else the revision of the read etcd makes
//! after the wait. It strictly increases per name in grant order, but two names can
//! share one (see [`super::Workload::tokens_unique`]).

use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use etcd_client::{Client, LockOptions};

use super::lease::Lease;
use super::record::Recorder;

/// One etcd client (its own connection) with its lease.
pub(crate) struct EtcdLockClient {
    client: Client,
    lease: Option<Lease>,
    held: Option<Vec<u8>>,
    rec: Arc<Recorder>,
}

// === impl EtcdLockClient ===

impl EtcdLockClient {
    /// Connects and grants the client's lease.
    pub async fn connect(etcd: &crate::EtcdAccess, rec: Arc<Recorder>) -> Result<Self> {
        let mut client = etcd.connect().await?;
        let lease = Lease::grant(&mut client, "etcd-lock keepalive", rec.clone()).await?;
        Ok(Self { client, lease: Some(lease), held: None, rec })
    }

    /// `Lock(key)` on the client's lease; the token.
    pub async fn acquire(&mut self, key: &str) -> Result<u64> {
        let Some(lease) = &self.lease else {
            bail!("no lease");
        };
        let r = self.client.lock(key, Some(LockOptions::new().with_lease(lease.id()))).await?;
        let rev = r.header().context("lock answer without header")?.revision();
        self.held = Some(r.key().to_vec());
        u64::try_from(rev).context("negative revision")
    }

    /// `Unlock` of the key the last `Lock` returned.
    pub async fn release(&mut self) -> Result<()> {
        let Some(key) = self.held.take() else {
            bail!("nothing to release");
        };
        self.client.unlock(key).await?;
        Ok(())
    }

    /// Revokes the lease (ending any hold) and grants a new one.
    pub async fn reset(&mut self) -> Result<()> {
        self.held = None;
        if let Some(l) = self.lease.take() {
            l.revoke(&mut self.client).await?;
        }
        self.lease = Some(Lease::grant(&mut self.client, "etcd-lock keepalive", self.rec.clone()).await?);
        Ok(())
    }

    /// Revokes the lease.
    pub async fn close(mut self) {
        if let Some(l) = self.lease.take() {
            if let Err(e) = l.revoke(&mut self.client).await {
                self.rec.error("etcd-lock close", &format!("{e:#}"));
            }
        }
    }
}
