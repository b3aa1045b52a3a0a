//! The release gate runs on production's etcd (docs/GATE.md "What runs"): client
//! TLS, auth on, the shipped roles, each gate part logged in as the narrowest user
//! it needs. `GateCluster::start` checks that every member of every cluster
//! refuses a plaintext, userless client, so a gate that fell back to plaintext
//! fails to start; this scenario shows that check passing on the default gate
//! and failing on its twin (`plaintext_etcd`), and that the parts' users are as
//! narrow as docs/GATE.md says.

use lockmesh_gate::harness::{refuses_plaintext, GateCluster, GateOptions, MUTEX_PREFIX};
use lockmesh_gate::recorder::EtcdLogin;
use lockmesh_tests::client::LockClient;

/// A coord cluster of one member and two single-member shards, one arbiter
/// through its fault proxies, one Envoy, no holders.
fn bare(name: &str, plaintext_etcd: bool) -> GateOptions {
    GateOptions {
        plaintext_etcd,
        members: 1,
        arbiters: 1,
        envoys: 1,
        clock_steps: false,
        transparent_holders: 0,
        ..GateOptions::rebalance(name)
    }
}

/// The default gate refuses a plaintext client and an anonymous TLS one on
/// every member of every cluster; an arbiter logged in as `lockmesh-arbiter`
/// through its fault proxy grants; the recorder, watching as the read-only
/// `lockmesh-admin`, records the grant and may write nothing; the gate's own
/// user writes under `<root>/gate/` and nowhere else. The twin, the same gate on
/// a plaintext etcd without auth, fails the check.
#[tokio::test]
async fn a_gate_member_refuses_a_plaintext_userless_client_and_each_part_logs_in_narrowly() {
    let g = GateCluster::start(bare("gate-tls", false)).await.unwrap();
    g.check_etcd_secured().await.unwrap();
    assert!(g.etcd.members().iter().all(|m| m.client_url().starts_with("https://")), "the coord cluster serves TLS");
    let cert = g.pki.client("payments", "gate-tls").unwrap();
    let c =
        LockClient::new(g.envoys[0].listener_port(), &g.pki.ca_cert_path(), Some((&cert.cert_path, &cert.key_path)))
            .unwrap();
    let key = format!("{MUTEX_PREFIX}/0");
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", key.as_str())]).await.unwrap();
    assert_eq!(r.code(), 200, "an arbiter on TLS + auth etcd grants: {}", r.body);
    let h = g.finish().await.unwrap();
    let held = |e: &&lockmesh_gate::history::EtcdEvent| e.put && e.value.contains(&key);
    let recorded = h
        .segments
        .iter()
        .flat_map(|s| &s.events)
        .chain(h.shards.iter().flat_map(|s| s.segments.iter().flat_map(|seg| &seg.events)));
    assert!(recorded.filter(held).count() > 0, "the recorder, watching as lockmesh-admin, saw the grant");
    for pick in [None, Some(0), Some(1)] {
        let (etcd, users) = match pick {
            None => (&g.etcd, g.etcd_users(None)),
            Some(i) => (&g.shards[i].etcd, g.etcd_users(Some(i))),
        };
        let watcher = EtcdLogin::role(users, "lockmesh-admin").unwrap();
        assert_eq!(watcher.user(), Some(users.user("lockmesh-admin").as_str()));
        let mut w = watcher.connect(&etcd.endpoints()).await.unwrap();
        w.get(format!("{}/sys/epoch", g.root), None).await.unwrap();
        let denied = w.put(format!("{}/gate/x", g.root), "1", None).await.unwrap_err();
        assert!(denied.to_string().contains("permission denied"), "the watcher wrote: {denied}");
        let mut m = g.marks_login(pick).connect(&etcd.endpoints()).await.unwrap();
        m.put(format!("{}/gate/x", g.root), "1", None).await.unwrap();
        let denied = m.put(format!("{}/l/x", g.root), "1", None).await.unwrap_err();
        assert!(denied.to_string().contains("permission denied"), "the gate's user wrote a hold: {denied}");
    }
    drop(g);

    // The twin: nothing refuses a plaintext client, and the check says so.
    let g = GateCluster::start(bare("gate-plain", true)).await.unwrap();
    let err = g.check_etcd_secured().await.unwrap_err();
    assert!(format!("{err:#}").contains("answered a plaintext client without a user"), "{err:#}");
    let err = refuses_plaintext(&g.shards[1].etcd).await.unwrap_err();
    assert!(format!("{err:#}").contains("answered a plaintext client"), "{err:#}");
}
