//! Limit changes on the authoritative class policies (`lockctl limit`), through
//! the protocol of `lockmesh_core::policy`: each step is one etcd transaction that
//! compares the policy record's mod revision, so a step computed from a state that
//! has since moved never commits.
//!
//! - [`Admin::change`]: raise at once, or step 1 (drain) then steps 2 and 3.
//! - [`Admin::resume`]: validate the pending (epoch, target), then steps 2 and 3.
//! - [`Admin::cancel`]: the old limit, active again, in one transaction.
//!
//! Step 2 (verification) reads the authoritative map and then every hold under
//! the root in pages, outside any exclusive window, under a bounded timeout; it
//! counts the holds of each key whose authoritative class is the class. It starts
//! after reading the draining record (so every grant of the class committed
//! before the drain is visible) and step 3 compares that record's mod revision, so
//! an activation from a verification that a cancel or another change overtook
//! never commits.

use std::{collections::HashMap, time::Duration};

use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp};
use lockmesh_core::policy::{ChangeNote, ClassPolicy, PolicyError};
use serde::Serialize;
use tokio::time::Instant;

use crate::etcd_retry::Etcd;
use lockmesh_lock::{connect::EtcdConnection, keys::prefix_end, now_ms, policy::ClassMapRecord, HoldRecord, Keys};

mod apply;

pub use apply::{tier_crossings, ApplyOutcome};

/// Holds read per verification page.
pub const VERIFY_PAGE: i64 = 500;

/// What a limit command did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The limit was raised (immediate).
    Raised {
        /// The record now.
        policy: ClassPolicy,
    },
    /// The lower limit is authoritative.
    Activated {
        /// The largest open count verified.
        observed: u32,
        /// The record now.
        policy: ClassPolicy,
    },
    /// A key is above the target: still draining, the old limit stays.
    OverTarget {
        /// The largest open count seen.
        observed: u32,
        /// The pending record (its epoch and target are what resume and cancel carry).
        policy: ClassPolicy,
    },
    /// Verification did not finish in time: still draining, the old limit stays.
    VerificationIncomplete {
        /// Holds read before the timeout.
        holds_read: u64,
        /// The pending record.
        policy: ClassPolicy,
    },
    /// The pending change was cancelled: the old limit, active.
    Cancelled {
        /// The record now.
        policy: ClassPolicy,
    },
    /// Nothing to do on this cluster: the limit is already the target, active
    /// (a fleet-wide change re-run after it finished here), or nothing is pending
    /// to cancel.
    Unchanged {
        /// The record.
        policy: ClassPolicy,
    },
}

/// Why a limit command failed. Nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The protocol refused the step (stale, pending, zero, no change).
    #[error("{0}")]
    Refused(PolicyError),
    /// The class has no policy record.
    #[error("no policy record for class {0}")]
    NoClass(String),
    /// The record moved between read and write; retry.
    #[error("the policy record of class {0} changed concurrently; nothing was written, retry")]
    Conflict(String),
    /// etcd failed.
    #[error("etcd: {0}")]
    Etcd(String),
    /// A class map change would move keys between the coord cluster and the
    /// entity clusters outside the fenced move (`apply::tier_crossings`).
    #[error("{0}")]
    CrossTier(String),
    /// The change needs a capability the keyspace has not enabled.
    #[error("{0}")]
    NotEnabled(String),
}

impl AdminError {
    /// True when the protocol refused the step and nothing changed (exit 3).
    pub fn refused(&self) -> bool {
        matches!(self, Self::Refused(_) | Self::CrossTier(_) | Self::NotEnabled(_))
    }
}

/// An operator's handle on the policy records of one root.
pub struct Admin {
    /// This cluster (every call sent again on an `auth store is old` refusal).
    client: Etcd,
    keys: Keys,
    /// This cluster's home record and (coord cluster) shard map.
    home: lockmesh_lock::home::HomeCell,
    actor: String,
    /// Where the keyspace record is read (the coord cluster's client; this
    /// cluster's own unless [`Admin::with_keyspace`]).
    keyspace: Etcd,
}

fn etcd(e: impl std::fmt::Display) -> AdminError {
    AdminError::Etcd(e.to_string())
}

/// `fut`'s output if it finishes within `bound`, else `None`. A zero bound is
/// `None` without running `fut`: tokio's timer fires at its next tick (about a
/// millisecond), and a loopback etcd can answer a whole scan before that, so a
/// zero bound would otherwise verify by chance.
pub(crate) async fn within<T>(bound: Duration, fut: impl std::future::Future<Output = T>) -> Option<T> {
    if bound.is_zero() {
        return None;
    }
    tokio::time::timeout_at(Instant::now() + bound, fut).await.ok()
}

// === impl Admin ===

impl Admin {
    /// Connects with `conn`'s TLS, user and timeouts; `actor` is recorded with
    /// every change.
    pub async fn connect(conn: &EtcdConnection, root: &str, actor: &str) -> Result<Self, AdminError> {
        let client = conn.connect().await.map_err(etcd)?;
        Ok(Self::from_client(client, root, actor))
    }

    /// The same over an existing client (a cluster of `lockmesh_lock::tiers::Tiers`).
    pub fn from_client(client: Client, root: &str, actor: &str) -> Self {
        let home = lockmesh_lock::home::HomeCell::new(root);
        let client = Etcd::new(client);
        Self { keyspace: client.clone(), client, keys: Keys::new(root), home, actor: actor.to_owned() }
    }

    /// The same, reading the keyspace record through `coord` (a shard cluster's
    /// handle: the record lives on the coord cluster only).
    pub fn with_keyspace(self, coord: Client) -> Self {
        Self { keyspace: Etcd::new(coord), ..self }
    }

    /// Refuses a raise while `exclusion_records` is not enabled (`lockctl upgrade
    /// enable`): before it, an exclusive hold is sized by the limit at its grant,
    /// and a raise would seat holders beside it.
    async fn raise_allowed(&self, class: &str) -> Result<(), AdminError> {
        use lockmesh_lock::upgrade::Capability;
        let keys = &self.keys;
        let read = |mut c| async move { lockmesh_lock::upgrade::read_view(&mut c, keys).await };
        let view = self.keyspace.call(read).await.map_err(etcd)?;
        if view.record.as_ref().is_some_and(|r| r.is_enabled(Capability::ExclusionRecords)) {
            return Ok(());
        }
        Err(AdminError::NotEnabled(format!(
            "refused: raising the limit of class {class} needs the capability {} enabled (an exclusive hold is \
             otherwise sized by the limit at its grant); finish the rolling upgrade and run `lockctl upgrade enable \
             {}`; nothing was written",
            Capability::ExclusionRecords.as_str(),
            Capability::ExclusionRecords.as_str()
        )))
    }

    /// One cluster's step of a fleet-wide change to `target` (`lockctl limit
    /// change --config`), safe to run again: a change already pending for
    /// `target` is resumed (its own epoch, read here), a limit already at `target`
    /// and active is [`Outcome::Unchanged`], anything else is [`Admin::change`].
    pub async fn converge(
        &self,
        class: &str,
        target: u32,
        reason: &str,
        verify_timeout: Duration,
    ) -> Result<Outcome, AdminError> {
        let (p, _) = self.read(class).await?;
        if p.pending_target == Some(target) && !p.admits() {
            return self.resume(class, p.change_epoch, target, reason, verify_timeout).await;
        }
        if p.limit == target && p.admits() {
            return Ok(Outcome::Unchanged { policy: p });
        }
        self.change(class, target, reason, verify_timeout).await
    }

    /// Cancels whatever limit change is pending on this cluster (its own epoch and
    /// target, read here); [`Outcome::Unchanged`] when none is.
    pub async fn cancel_pending(&self, class: &str, reason: &str) -> Result<Outcome, AdminError> {
        let (p, _) = self.read(class).await?;
        match p.pending_target {
            Some(t) if !p.admits() && !p.pending_move => self.cancel(class, p.change_epoch, t, reason).await,
            _ => Ok(Outcome::Unchanged { policy: p }),
        }
    }

    fn note(&self, action: &str, reason: &str) -> ChangeNote {
        ChangeNote { actor: self.actor.clone(), reason: reason.into(), at_ms: now_ms(), action: action.into() }
    }

    /// The record of `class` and its mod revision.
    pub async fn read(&self, class: &str) -> Result<(ClassPolicy, i64), AdminError> {
        let r = self.client.get(self.keys.class_policy(class), None).await.map_err(etcd)?;
        let kv = r.kvs().first().ok_or_else(|| AdminError::NoClass(class.to_owned()))?;
        Ok((serde_json::from_slice(kv.value()).map_err(etcd)?, kv.mod_revision()))
    }

    /// Writes `p` if the record's mod revision is still `rev`.
    async fn put_if(&self, p: &ClassPolicy, rev: i64) -> Result<(), AdminError> {
        let key = self.keys.class_policy(&p.class);
        let txn = Txn::new().when([Compare::mod_revision(key.as_str(), CompareOp::Equal, rev)]).and_then([TxnOp::put(
            key.as_str(),
            serde_json::to_vec(p).map_err(etcd)?,
            None,
        )]);
        let r = self.client.txn(txn).await.map_err(etcd)?;
        if r.succeeded() {
            Ok(())
        } else {
            Err(AdminError::Conflict(p.class.clone()))
        }
    }

    /// Changes the limit of `class` to `target`: a raise is immediate; a lowering
    /// drains, verifies within `verify_timeout`, and activates only within target.
    pub async fn change(
        &self,
        class: &str,
        target: u32,
        reason: &str,
        verify_timeout: Duration,
    ) -> Result<Outcome, AdminError> {
        let (p, rev) = self.read(class).await?;
        if target > p.limit {
            self.raise_allowed(class).await?;
            let n = p.raise(target, self.note("raise", reason)).map_err(AdminError::Refused)?;
            self.put_if(&n, rev).await?;
            return Ok(Outcome::Raised { policy: n });
        }
        let n = p.begin_lower(target, self.note("drain", reason)).map_err(AdminError::Refused)?;
        self.put_if(&n, rev).await?;
        self.verify_and_activate(class, n.change_epoch, target, reason, verify_timeout).await
    }

    /// Resumes the pending change `(epoch, target)`: validated without a write,
    /// then verified and activated (or reported) like step 2 and 3.
    pub async fn resume(
        &self,
        class: &str,
        epoch: u64,
        target: u32,
        reason: &str,
        verify_timeout: Duration,
    ) -> Result<Outcome, AdminError> {
        let (p, _) = self.read(class).await?;
        p.check_pending(epoch, target).map_err(AdminError::Refused)?;
        self.verify_and_activate(class, epoch, target, reason, verify_timeout).await
    }

    /// Cancels the pending change `(epoch, target)`.
    pub async fn cancel(&self, class: &str, epoch: u64, target: u32, reason: &str) -> Result<Outcome, AdminError> {
        let (p, rev) = self.read(class).await?;
        let n = p.cancel(epoch, target, self.note("cancel", reason)).map_err(AdminError::Refused)?;
        self.put_if(&n, rev).await?;
        Ok(Outcome::Cancelled { policy: n })
    }

    async fn verify_and_activate(
        &self,
        class: &str,
        epoch: u64,
        target: u32,
        reason: &str,
        timeout: Duration,
    ) -> Result<Outcome, AdminError> {
        // The draining record first: the scan below then sees every grant that
        // committed under the old policy.
        let (p, rev) = self.read(class).await?;
        p.check_pending(epoch, target).map_err(AdminError::Refused)?;
        let (observed, read) = match within(timeout, self.max_open(class)).await {
            Some(r) => r?,
            None => return Ok(Outcome::VerificationIncomplete { holds_read: 0, policy: p }),
        };
        match p.activate(epoch, target, observed, self.note("activate", reason)) {
            Ok(n) => {
                self.put_if(&n, rev).await?;
                Ok(Outcome::Activated { observed, policy: n })
            }
            Err(PolicyError::OverTarget { observed, .. }) => Ok(Outcome::OverTarget { observed, policy: p }),
            Err(e) => {
                let _ = read;
                Err(AdminError::Refused(e))
            }
        }
    }

    /// The largest number of holds of any key whose authoritative class is
    /// `class`, and how many holds were read.
    pub async fn max_open(&self, class: &str) -> Result<(u32, u64), AdminError> {
        let m = self.client.get(self.keys.class_map(), None).await.map_err(etcd)?;
        let map: ClassMapRecord = m
            .kvs()
            .first()
            .and_then(|kv| serde_json::from_slice(kv.value()).ok())
            .ok_or_else(|| AdminError::Etcd("no authoritative class map".into()))?;
        let mut counts: HashMap<Vec<u8>, u32> = HashMap::new();
        let keys = self.keys.clone();
        let read = self
            .scan_holds(|h, hold_key| {
                if map.class_of(&h.key) == class {
                    let d = keys.digest_of_hold(hold_key).map(|d| d.to_string().into_bytes());
                    *counts.entry(d.unwrap_or_else(|| hold_key.to_vec())).or_default() += 1;
                }
            })
            .await?;
        Ok((counts.values().copied().max().unwrap_or(0), read))
    }

    /// Reads every hold under the root in pages of [`VERIFY_PAGE`], calling `f`
    /// with each record and its etcd key; returns how many were read.
    async fn scan_holds(&self, mut f: impl FnMut(&HoldRecord, &[u8])) -> Result<u64, AdminError> {
        let prefix = self.keys.all_locks();
        let end = prefix_end(&prefix);
        let mut from = prefix.clone().into_bytes();
        let mut read = 0u64;
        loop {
            let opts = GetOptions::new().with_range(end.clone()).with_limit(VERIFY_PAGE);
            let r = self.client.get(from.clone(), Some(opts)).await.map_err(etcd)?;
            for kv in r.kvs() {
                read += 1;
                let Ok(h) = serde_json::from_slice::<HoldRecord>(kv.value()) else { continue };
                f(&h, kv.key());
            }
            match r.kvs().last() {
                Some(last) if r.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        Ok(read)
    }
}
