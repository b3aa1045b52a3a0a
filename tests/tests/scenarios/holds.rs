//! Reading back a scenario's holds from etcd's own history: every put and delete
//! of a hold slot under the stack's root, in revision order (`permits.rs`,
//! `multikey.rs` replay them against their properties).

use std::time::Duration;

use etcd_client::{EventType, WatchOptions};
use lockmesh_tests::Stack;
use serde_json::Value;

/// One put or delete of a hold slot (`<root>/l/<digest>/h/<slot>`).
pub(super) struct HoldEvent {
    /// Its commit revision.
    pub revision: i64,
    pub put: bool,
    /// The slot key.
    pub key: Vec<u8>,
    /// The lock key's digest (the slot key's `<root>/l/<digest>` part).
    pub digest: String,
    /// The slot's create revision (its grant's token revision) after a put.
    pub create_revision: i64,
    /// The hold record of a put (`Null` for a delete).
    pub value: Value,
}

/// The revision the next write of the shared etcd will get: replay from here.
pub(super) async fn start_revision(st: &Stack) -> i64 {
    let mut c = st.etcd().client().await.unwrap();
    c.get("x", None).await.unwrap().header().unwrap().revision() + 1
}

/// Every hold slot event under the stack's root from revision `from` up to a
/// barrier key of its own (the shared etcd's last revision may be another
/// test's), in revision order.
pub(super) async fn hold_events(st: &Stack, from: i64) -> Vec<HoldEvent> {
    let mut c = st.etcd().client().await.unwrap();
    let root = format!("{}/", st.root());
    let prefix = format!("{}/l/", st.root());
    let barrier = format!("{}/test/holds-barrier", st.root());
    let opts = WatchOptions::new().with_prefix().with_start_revision(from);
    let mut w = c.watch(root.as_str(), Some(opts)).await.unwrap();
    let end = c.put(barrier.as_str(), "end", None).await.unwrap().header().unwrap().revision();
    let (mut out, mut seen) = (Vec::new(), from);
    while seen < end {
        let r = tokio::time::timeout(Duration::from_secs(10), w.message()).await.unwrap().unwrap().unwrap();
        for e in r.events() {
            let kv = e.kv().unwrap();
            seen = seen.max(kv.mod_revision());
            let k = String::from_utf8_lossy(kv.key()).into_owned();
            if !k.starts_with(&prefix) || !k.contains("/h/") || kv.mod_revision() > end {
                continue;
            }
            let put = e.event_type() == EventType::Put;
            out.push(HoldEvent {
                revision: kv.mod_revision(),
                put,
                key: kv.key().to_vec(),
                digest: k.split("/h/").next().unwrap().to_owned(),
                create_revision: kv.create_revision(),
                value: if put { serde_json::from_slice(kv.value()).unwrap() } else { Value::Null },
            });
        }
    }
    out
}
