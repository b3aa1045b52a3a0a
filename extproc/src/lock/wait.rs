//! Waiting (ADR-14, ADR-15).
//!
//! Waiters for one key on this arbiter form a FIFO: only the head runs grant
//! transactions, so a release wakes one attempt, not a herd. Envoy ring-hashes the
//! ext_proc stream on the lock key, so all waiters of a key normally meet here.
//!
//! The head waits for any of: a watch event on the key's holders from the revision
//! of its failed transaction (no event between the check and the watch is lost), a
//! release through this arbiter, or a jittered ~1 s poll that covers a lost
//! notification or a watch cancelled by compaction. None of them grants anything:
//! each only triggers another grant transaction.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use etcd_client::{EventType, WatchOptions};
use lockmesh_core::{KeyDigest, Reason};
use rand::Rng;
use tokio::{sync::Notify, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{LockError, Store};

/// Base poll period while gated.
pub const POLL: Duration = Duration::from_millis(1000);

#[derive(Default)]
struct KeyQueue {
    order: VecDeque<u64>,
    /// Woken when the head changes or a release of the key passed through here.
    notify: Arc<Notify>,
}

/// Per-key FIFO queues of waiters on this arbiter.
#[derive(Default)]
pub struct Queues {
    next: AtomicU64,
    map: Mutex<HashMap<KeyDigest, KeyQueue>>,
}

/// A place in a key's queue; leaving (drop) hands the head to the next waiter.
pub struct Ticket<'a> {
    queues: &'a Queues,
    digest: KeyDigest,
    id: u64,
    notify: Arc<Notify>,
}

// === impl Queues ===

impl Queues {
    /// Joins the queue of `d`.
    pub fn enter(&self, d: &KeyDigest) -> Ticket<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let q = map.entry(d.clone()).or_default();
        q.order.push_back(id);
        Ticket { queues: self, digest: d.clone(), id, notify: q.notify.clone() }
    }

    /// Wakes the head of `d`'s queue (a release of `d` went through here).
    pub fn hint(&self, d: &KeyDigest) {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = map.get(d) {
            q.notify.notify_waiters();
        }
    }

    /// Waiters queued for `d` here.
    pub fn len(&self, d: &KeyDigest) -> usize {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(d).map_or(0, |q| q.order.len())
    }

    /// Keys with waiters here.
    pub fn keys_waiting(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn is_head(&self, d: &KeyDigest, id: u64) -> bool {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        map.get(d).and_then(|q| q.order.front()) == Some(&id)
    }

    fn leave(&self, d: &KeyDigest, id: u64) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = map.get_mut(d) {
            let was_head = q.order.front() == Some(&id);
            q.order.retain(|x| *x != id);
            if q.order.is_empty() {
                map.remove(d);
            } else if was_head {
                q.notify.notify_waiters();
            }
        }
    }
}

// === impl Ticket ===

impl Ticket<'_> {
    /// True when this waiter is first in line.
    pub fn is_head(&self) -> bool {
        self.queues.is_head(&self.digest, self.id)
    }

    /// Waits until first in line, the deadline (`Contended`) or cancellation.
    pub async fn wait_head(&self, deadline: Instant, cancel: &CancellationToken) -> Result<(), LockError> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_head() {
                return Ok(());
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => return Err(LockError::Contended(Reason::KeyGated)),
                _ = cancel.cancelled() => return Err(LockError::Cancelled),
            }
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.queues.leave(&self.digest, self.id);
    }
}

/// A short jittered pause after a transient conflict.
pub async fn backoff(deadline: Instant, cancel: &CancellationToken) -> Result<(), LockError> {
    let ms = rand::rng().random_range(5..40);
    let until = (Instant::now() + Duration::from_millis(ms)).min(deadline);
    tokio::select! {
        _ = tokio::time::sleep_until(until) => Ok(()),
        _ = cancel.cancelled() => Err(LockError::Cancelled),
    }
}

// === impl Store ===

impl Store {
    /// Waits for a reason to retry a gated grant.
    pub(crate) async fn wait_change(
        &self,
        d: &KeyDigest,
        revision: i64,
        deadline: Instant,
        cancel: &CancellationToken,
        ticket: &Ticket<'_>,
    ) -> Result<(), LockError> {
        let notified = ticket.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let jitter = rand::rng().random_range(0.8..1.2);
        let poll = Instant::now() + POLL.mul_f64(jitter);
        let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let holds = self.keys().holds(d);
        let watch = async {
            let mut client = self.client();
            match tokio::time::timeout(Duration::from_secs(2), client.watch(holds.as_str(), Some(opts))).await {
                Ok(Ok(mut stream)) => loop {
                    match stream.message().await {
                        Ok(Some(r)) if r.canceled() => return, // compacted: retry now
                        Ok(Some(r)) if r.events().iter().any(|e| e.event_type() == EventType::Delete) => return,
                        Ok(Some(_)) => {}
                        // A broken watch is only a lost hint: the poll still runs.
                        Ok(None) | Err(_) => std::future::pending::<()>().await,
                    }
                },
                _ => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = watch => Ok(()),
            _ = &mut notified => Ok(()),
            _ = tokio::time::sleep_until(poll.min(deadline)) => Ok(()),
            _ = cancel.cancelled() => Err(LockError::Cancelled),
        }
    }
}
