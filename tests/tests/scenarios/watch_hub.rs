//! Issue 20: the waiters' watches share one etcd watch stream per store
//! (`lock::watches`). Against a real etcd (TLS and auth, as the harness runs it by
//! default): many watchers, one stream; each wakes on its own key's delete and on
//! nothing else; a waiter that leaves takes its watcher out of etcd; a start
//! revision already compacted wakes at once (look again). A hub that opened a
//! stream per wait, woke on a put or on another key's delete, or leaked watchers
//! in etcd fails here.

use std::{sync::Arc, time::Duration};

use etcd_client::WatchOptions;
use lockmesh_lock::watches::Watches;
use lockmesh_tests::EtcdCluster;
use tokio::{sync::mpsc, time::Instant};

const N: usize = 24;

/// Polls etcd's gauge `name` until `ok` holds (10 s; these only wait for etcd to
/// apply what the test already did).
async fn gauge_until(etcd: &EtcdCluster, name: &str, what: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let v = etcd.member(0).metric(name).await.unwrap();
        if ok(v) {
            return v;
        }
        assert!(Instant::now() < until, "{name} = {v}: expected {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_share_one_watch_stream_and_wake_only_on_their_own_delete() {
    let etcd = EtcdCluster::builder().start().await.unwrap();
    let mut client = etcd.client().await.unwrap();
    let streams0 = etcd.member(0).metric("etcd_debugging_mvcc_watch_stream_total").await.unwrap();
    let watchers0 = etcd.member(0).metric("etcd_debugging_mvcc_watcher_total").await.unwrap();
    let mut rev = 0;
    for i in 0..N {
        rev = client.put(format!("hub/k{i}/h"), "held", None).await.unwrap().header().unwrap().revision();
    }
    let hub = Arc::new(Watches::default());
    let (done_tx, mut done) = mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for i in 0..N {
        let (hub, client, done_tx) = (hub.clone(), client.clone(), done_tx.clone());
        tasks.push(tokio::spawn(async move {
            let opts = WatchOptions::new().with_prefix().with_start_revision(rev + 1);
            hub.delete_seen(&client, format!("hub/k{i}/"), opts).await;
            let _ = done_tx.send(i);
        }));
    }
    // Every watcher is in etcd, on one stream.
    gauge_until(&etcd, "etcd_debugging_mvcc_watcher_total", "every watcher created", |v| v >= watchers0 + N as f64)
        .await;
    let streams = etcd.member(0).metric("etcd_debugging_mvcc_watch_stream_total").await.unwrap();
    assert_eq!(streams, streams0 + 1.0, "{N} waiters should share one watch stream");
    assert_eq!(hub.streams_opened(), 1);

    // A put under a watched key and a delete elsewhere wake nobody; each delete
    // wakes its own waiter only, in the order of the deletes.
    client.put("hub/k1/other", "x", None).await.unwrap();
    client.delete("hub/elsewhere", None).await.unwrap();
    for i in 0..N / 2 {
        client.delete(format!("hub/k{i}/h"), None).await.unwrap();
        let woke = tokio::time::timeout(Duration::from_secs(10), done.recv()).await.unwrap().unwrap();
        assert_eq!(woke, i, "the delete of key {i} woke waiter {woke}");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(done.try_recv().is_err(), "a waiter woke without its key's delete");
    // The woken waiters' watchers are cancelled: N/2 remain.
    gauge_until(&etcd, "etcd_debugging_mvcc_watcher_total", "the woken waiters' watchers cancelled", |v| {
        v == watchers0 + (N / 2) as f64
    })
    .await;

    // Waiters that leave (their wait ended otherwise) take their watchers with them.
    for t in &tasks[N / 2..] {
        t.abort();
    }
    gauge_until(&etcd, "etcd_debugging_mvcc_watcher_total", "every watcher of a departed waiter cancelled", |v| {
        v == watchers0
    })
    .await;

    // A start revision etcd has compacted away wakes at once: look again.
    let now = client.put("hub/compact", "x", None).await.unwrap().header().unwrap().revision();
    client.compact(now, None).await.unwrap();
    let opts = WatchOptions::new().with_prefix().with_start_revision(2);
    tokio::time::timeout(Duration::from_secs(10), hub.delete_seen(&client, "hub/k23/", opts))
        .await
        .expect("a compacted start revision must wake the waiter");
    assert_eq!(hub.streams_opened(), 1, "still the one stream");
    assert_eq!(etcd.member(0).metric("etcd_debugging_mvcc_watch_stream_total").await.unwrap(), streams0 + 1.0);
}
