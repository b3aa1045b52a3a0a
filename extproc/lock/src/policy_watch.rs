//! The watch that keeps this arbiter's cache of the class policies and the class
//! map fresh (issue 20: the next head of a hot key skips its read).
//!
//! A waiter that finds a mutex key granted here by another session and caller
//! (`wait::HeldBy`) can only wait for that hold; what it must read before waiting is
//! the key's authoritative limit, since a `lockctl limit` change may have raised it
//! and a key with a free slot is granted, not waited for (docs/CLASSES.md). It takes
//! the limit from the cache instead, and only while this watch is open:
//!
//! - the watch (one stream, two watchers: `<root>/c/` and `<root>/sys/classmap`)
//!   drops the whole cache on every event, and once more when it opens, so a
//!   change committed before the open is not served from an older read;
//! - a read that began before a drop is not cached (`policy::PolicyCache`'s
//!   generation), so an old read cannot refill the cache after the event;
//! - while the watch is not open (starting, broken, refused) the cache is not
//!   trusted and every such waiter reads, as before.
//!
//! What remains is the time between a change's commit and its event here
//! (milliseconds): an acquire in that window waits for the holder's release, or
//! its next poll (about a second), whose grant transaction compares the policy's
//! revision and so sees the new limit. Grants never depend on this: each
//! compares the revisions of the records it obeys.

use std::{
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Arc, Weak,
    },
    time::Duration,
};

use etcd_client::WatchOptions;

use super::{test_faults, test_faults::TestFault, Store};

/// How long opening the watch may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// How long to wait before opening it again after it broke or could not open.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// Changes of the records this process's watches have seen (each dropped a cache).
pub static EVENTS: AtomicU64 = AtomicU64::new(0);

/// This process's policy watches that are open now (one per store at most).
pub static OPEN: AtomicI64 = AtomicI64::new(0);

impl Store {
    /// Starts this store's policy watch once (a task that ends with the store).
    pub(crate) fn watch_policies(self: &Arc<Self>) {
        self.policies().cache().watch_started.get_or_init(|| {
            tokio::spawn(run(Arc::downgrade(self)));
        });
    }

    /// Whether the policy watch is open, so the cache may be acted on without a
    /// compare.
    pub(crate) fn policies_watched(&self) -> bool {
        self.policies().cache().watched.load(Ordering::SeqCst)
    }
}

async fn run(store: Weak<Store>) {
    // Logged when it opens and when it stops being open, not once per retry.
    let mut failing = false;
    loop {
        let Some((client, policies, map)) = store
            .upgrade()
            .map(|s| (s.cluster().client(), s.cluster().keys().class_policies(), s.cluster().keys().class_map()))
        else {
            return;
        };
        let opened = match tokio::time::timeout(OPEN_TIMEOUT, open(client, policies, map)).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {OPEN_TIMEOUT:?}")),
        };
        match opened {
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "the policy watch cannot open; heads read each held key's limit until it does");
                }
                failing = true;
            }
            // `_sender` lives as long as the stream: dropping it would end the watch.
            Ok((_sender, mut responses)) => {
                let Some(s) = store.upgrade() else { return };
                // Events from here on drop the cache; what was read before may be older.
                s.policies().forget();
                s.policies().cache().watched.store(true, Ordering::SeqCst);
                OPEN.fetch_add(1, Ordering::Relaxed);
                drop(s);
                tracing::info!("the policy watch is open");
                loop {
                    let changed = match responses.message().await {
                        Ok(Some(r)) if !r.canceled() => !r.events().is_empty(),
                        _ => break,
                    };
                    let Some(s) = store.upgrade() else {
                        OPEN.fetch_sub(1, Ordering::Relaxed);
                        return;
                    };
                    if changed {
                        EVENTS.fetch_add(1, Ordering::Relaxed);
                        if !test_faults::on(TestFault::PolicyWatchKeepsCache) {
                            s.policies().forget();
                        }
                    }
                }
                OPEN.fetch_sub(1, Ordering::Relaxed);
                let Some(s) = store.upgrade() else { return };
                s.policies().cache().watched.store(false, Ordering::SeqCst);
                s.policies().forget();
                tracing::warn!("the policy watch broke; heads read each held key's limit until it reopens");
                failing = true;
            }
        }
        tokio::time::sleep(REOPEN_AFTER).await;
    }
}

/// Opens one stream with the two watchers and waits until etcd created both.
async fn open(
    client: etcd_client::Client,
    policies: String,
    map: String,
) -> Result<(etcd_client::WatchRequestSender, etcd_client::WatchResponseStream), etcd_client::Error> {
    let stream = client.clone().watch(policies, Some(WatchOptions::new().with_prefix())).await?;
    let (mut sender, mut responses) = stream.split();
    sender.watch(map, None).await?;
    let mut created = 0;
    while created < 2 {
        match responses.message().await? {
            Some(r) if r.canceled() => return Err(etcd_client::Error::WatchError(r.cancel_reason().to_owned())),
            Some(r) if r.created() => created += 1,
            Some(_) => {}
            None => return Err(etcd_client::Error::WatchError("the watch stream ended while opening".into())),
        }
    }
    Ok((sender, responses))
}
