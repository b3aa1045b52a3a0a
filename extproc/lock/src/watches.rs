//! One multiplexed etcd watch stream per store for the waiters' hints (issue 20,
//! docs/DECISIONS.md ADR-27).
//!
//! A gated waiter watches its key's holders from the revision of its failed
//! transaction, and stops at the first delete (`wait`, `durable`, `multi`). Opened
//! one gRPC stream per wait, every wake-up of every waiter cost an HTTP/2 stream,
//! a watch stream in etcd (its goroutines and buffers) and its teardown. Here a
//! store keeps one stream and adds a watcher to it per wait (etcd multiplexes
//! watchers on a stream by watch id), cancelling it when the delete arrives or the
//! wait ends.
//!
//! What a waiter is promised is unchanged: [`Watches::delete_seen`] resolves when
//! etcd reports a delete of the watched key (or a key under it) from the start
//! revision on, or cancels the watcher (compacted past its start: look again now).
//! It never resolves when the watcher cannot be set up or the stream breaks: a lost
//! watch is only a lost hint, and every waiter's poll still runs. A watcher etcd
//! refuses for any other reason (its permissions, a login that went stale on the
//! open stream) does not wake its waiter either (that would spin a grant
//! transaction per refusal); the stream is closed instead, so the next waiter's
//! watcher goes on a fresh stream under the client's current login.
//!
//! # How watch ids are matched
//!
//! etcd answers the creates on one stream in the order they were sent (each with a
//! `created` response carrying the new watch id), so the hub task, the only sender,
//! keeps the waiters whose creates are in flight in a FIFO and takes the next one
//! for each `created` response. A waiter that leaves before its id is known is
//! marked, and its watcher cancelled when the id arrives.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering},
        OnceLock,
    },
    time::Duration,
};

use etcd_client::{EventType, WatchOptions, WatchRequestSender, WatchResponse, WatchResponseStream};
use tokio::sync::{mpsc, oneshot};

/// How long opening the stream may take before the waiters that asked for it are
/// left to their polls.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

/// After an open failed, how long waiters are left to their polls without
/// another attempt: while etcd is unreachable, the hub does not queue one
/// [`OPEN_TIMEOUT`] per wait behind another.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// The store's watch hub: a handle on the task that owns the stream.
#[derive(Default)]
pub struct Watches {
    cmds: OnceLock<mpsc::UnboundedSender<Cmd>>,
    next: AtomicU64,
    /// Streams opened so far (a gauge of churn: one per break or refusal).
    opened: std::sync::Arc<AtomicU64>,
}

enum Cmd {
    Watch { id: u64, key: Vec<u8>, opts: WatchOptions, wake: oneshot::Sender<()> },
    Leave { id: u64 },
}

/// Cancels the waiter's watcher when its wait ends, however it ends.
struct Leave<'a> {
    cmds: &'a mpsc::UnboundedSender<Cmd>,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let _ = self.cmds.send(Cmd::Leave { id: self.id });
    }
}

impl Watches {
    /// Resolves when etcd reports a delete of `key` (of a key under it, with a
    /// prefix in `opts`) from `opts`' start revision on, or cancels the watcher
    /// because that revision is compacted. Never resolves when the watcher cannot
    /// be set up or the stream breaks (see the module doc).
    pub async fn delete_seen(&self, client: &etcd_client::Client, key: impl Into<Vec<u8>>, opts: WatchOptions) {
        let cmds = self.cmds.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(hub(client.clone(), rx, self.opened.clone()));
            tx
        });
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (wake, woken) = oneshot::channel();
        if cmds.send(Cmd::Watch { id, key: key.into(), opts, wake }).is_err() {
            return std::future::pending().await;
        }
        let _leave = Leave { cmds, id };
        if woken.await.is_err() {
            // The watcher is gone without a delete (refused, stream broken).
            std::future::pending::<()>().await;
        }
    }

    /// How many streams this store's hub has opened.
    pub fn streams_opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }
}

/// A waiter known to the hub.
enum Waiter {
    /// Its create is in flight.
    Creating { wake: oneshot::Sender<()> },
    /// Its create is in flight and it already left: cancel when the id arrives.
    LeftWhileCreating,
    /// Watching under this watch id.
    Active { watch_id: i64, wake: oneshot::Sender<()> },
}

struct Stream {
    sender: WatchRequestSender,
    responses: WatchResponseStream,
    /// Local ids whose creates are in flight, in the order sent.
    creating: VecDeque<u64>,
    /// Watch id → local id.
    by_watch: HashMap<i64, u64>,
}

async fn hub(client: etcd_client::Client, mut cmds: mpsc::UnboundedReceiver<Cmd>, opened: std::sync::Arc<AtomicU64>) {
    let mut waiters: HashMap<u64, Waiter> = HashMap::new();
    let mut stream: Option<Stream> = None;
    let mut reopen_at: Option<tokio::time::Instant> = None;
    loop {
        let event = match stream.as_mut() {
            Some(s) => tokio::select! {
                c = cmds.recv() => Event::Cmd(c),
                m = s.responses.message() => Event::Msg(m),
            },
            None => Event::Cmd(cmds.recv().await),
        };
        match event {
            Event::Cmd(None) => return,
            Event::Cmd(Some(Cmd::Watch { id, key, opts, wake })) => {
                waiters.insert(id, Waiter::Creating { wake });
                let sent = match stream.as_mut() {
                    Some(s) => s.sender.watch(key, Some(opts)).await.is_ok(),
                    None if reopen_at.is_some_and(|t| tokio::time::Instant::now() < t) => false,
                    None => match tokio::time::timeout(OPEN_TIMEOUT, client.clone().watch(key, Some(opts))).await {
                        Ok(Ok(ws)) => {
                            opened.fetch_add(1, Ordering::Relaxed);
                            reopen_at = None;
                            let (sender, responses) = ws.split();
                            stream =
                                Some(Stream { sender, responses, creating: VecDeque::new(), by_watch: HashMap::new() });
                            true
                        }
                        _ => {
                            reopen_at = Some(tokio::time::Instant::now() + REOPEN_AFTER);
                            false
                        }
                    },
                };
                match (sent, stream.as_mut()) {
                    (true, Some(s)) => s.creating.push_back(id),
                    // The waiter's poll covers it; its sender is dropped.
                    _ => {
                        waiters.remove(&id);
                        if stream.is_some() {
                            close(&mut stream, &mut waiters);
                        }
                    }
                }
            }
            Event::Cmd(Some(Cmd::Leave { id })) => match waiters.remove(&id) {
                Some(Waiter::Creating { .. }) => {
                    waiters.insert(id, Waiter::LeftWhileCreating);
                }
                Some(Waiter::Active { watch_id, .. }) => {
                    if let Some(s) = stream.as_mut() {
                        s.by_watch.remove(&watch_id);
                        if s.sender.cancel(watch_id).await.is_err() {
                            close(&mut stream, &mut waiters);
                        }
                    }
                }
                Some(Waiter::LeftWhileCreating) | None => {}
            },
            Event::Msg(Ok(Some(r))) => {
                if !on_response(&r, &mut stream, &mut waiters).await {
                    close(&mut stream, &mut waiters);
                }
            }
            // The stream broke or ended: every watcher on it is lost (hints only).
            Event::Msg(Ok(None) | Err(_)) => close(&mut stream, &mut waiters),
        }
    }
}

enum Event {
    Cmd(Option<Cmd>),
    Msg(Result<Option<WatchResponse>, etcd_client::Error>),
}

/// Drops the stream and every waiter on it (their senders drop: no wake-up).
fn close(stream: &mut Option<Stream>, waiters: &mut HashMap<u64, Waiter>) {
    if let Some(s) = stream.take() {
        for id in s.creating.iter().chain(s.by_watch.values()) {
            waiters.remove(id);
        }
    }
}

/// Handles one response; `false` when the stream must be closed.
async fn on_response(r: &WatchResponse, stream: &mut Option<Stream>, waiters: &mut HashMap<u64, Waiter>) -> bool {
    let Some(s) = stream.as_mut() else {
        return true;
    };
    let watch_id = r.watch_id();
    if r.created() {
        let Some(id) = s.creating.pop_front() else {
            // A create answer nobody sent: the stream is not what we think.
            return false;
        };
        match waiters.remove(&id) {
            Some(Waiter::Creating { wake }) => {
                if r.canceled() {
                    // Refused at creation. Compacted: look again now. Anything
                    // else (permissions, a stale login): no wake-up, a new stream.
                    if r.compact_revision() != 0 {
                        let _ = wake.send(());
                        return true;
                    }
                    tracing::debug!(reason = r.cancel_reason(), "etcd refused a waiter's watch; opening a new stream");
                    return false;
                }
                waiters.insert(id, Waiter::Active { watch_id, wake });
                s.by_watch.insert(watch_id, id);
            }
            // It left while its create was in flight: nothing to wake, cancel it.
            Some(Waiter::LeftWhileCreating) if !r.canceled() => return s.sender.cancel(watch_id).await.is_ok(),
            _ => {}
        }
        // Events may ride on the created response only for a watcher just
        // registered above; fall through to look at them.
    }
    let Some(&id) = s.by_watch.get(&watch_id) else {
        // A watcher already cancelled (its cancel answer, or events in flight).
        return true;
    };
    let deleted = r.events().iter().any(|e| e.event_type() == EventType::Delete);
    if !(deleted || r.canceled()) {
        return true;
    }
    s.by_watch.remove(&watch_id);
    if let Some(Waiter::Active { wake, .. }) = waiters.remove(&id) {
        let _ = wake.send(());
    }
    // etcd ends a cancelled watcher itself; one that saw its delete is cancelled.
    r.canceled() || s.sender.cancel(watch_id).await.is_ok()
}
