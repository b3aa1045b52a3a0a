//! Issue #18 ("correct at the edges"), the sessions-and-epochs items: transparent-mode
//! VM sessions across clusters and class TTL reloads, and ValidateToken on a
//! restored shard. These drive the arbiter's lock library (`lockmesh_lock`) as the
//! arbiter does, over real etcd processes of their own (one per cluster, so one can
//! be frozen or restored without touching another): the coord cluster and one
//! entity shard, connected from an arbiter config file exactly as `lockctl shard`
//! connects (`Clusters::load_arbiter_file`).

use std::{sync::Arc, time::Duration};

use etcd_client::{GetOptions, LeaseTimeToLiveOptions};
use lockmesh_core::{ClassRegistry, ClassSpec, LockKey};
use lockmesh_lock::tiers::CancellationToken;
use lockmesh_lock::{
    clusters::Clusters,
    mutex::{AcquireRequest, Grant},
    session::Caller,
    tiers::Tiers,
    vm, LockError, Store,
};
use lockmesh_tests::EtcdCluster;
use tokio::time::Instant;

const ENVOY: &str = "spiffe://cluster.local/ns/lock/sa/envoy";
const VM: &str = "0123456789abcdef0123456789abcdef";

/// One entity class (`default`) of TTL `ttl_s`, and a coord class.
fn registry(ttl_s: u64) -> ClassRegistry {
    let yaml = format!(
        r#"platform: {{ min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }}
classes:
  - {{ name: default, default: true, ttl_s: {ttl_s}, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }}
  - {{ name: leader, prefixes: ["billing/elect"], tier: coord, ttl_s: 15, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }}
"#
    );
    let raw: lockmesh_core::class::RawRegistry = serde_saphyr::from_str(&yaml).unwrap();
    ClassRegistry::try_from_raw(&raw).unwrap_or_else(|e| panic!("{e:?}"))
}

/// The coord cluster and (with `shard`) one entity shard `shard-a`, each its own
/// single-member etcd, and the arbiter's view of them.
struct Split {
    coord: EtcdCluster,
    shard: Option<EtcdCluster>,
    root: String,
    config: tempfile::TempDir,
}

impl Split {
    async fn start(name: &str, shard: bool) -> Split {
        let coord = EtcdCluster::builder().members(1).plaintext().start().await.unwrap();
        let shard = match shard {
            true => Some(EtcdCluster::builder().members(1).plaintext().start().await.unwrap()),
            false => None,
        };
        let root = lockmesh_tests::unique_prefix(name);
        Split { coord, shard, root, config: tempfile::tempdir().unwrap() }
    }

    /// A new arbiter's view (its own caches), bootstrapped with `reg`.
    async fn tiers(&self, reg: &ClassRegistry) -> Tiers {
        let mut yaml = format!(
            "etcd:\n  endpoints: [{:?}]\n  root: {:?}\n  op_timeout_ms: 500\n",
            self.coord.endpoints()[0],
            self.root
        );
        if let Some(s) = &self.shard {
            yaml.push_str(&format!("clusters:\n  shard-a:\n    endpoints: [{:?}]\n", s.endpoints()[0]));
            yaml.push_str("tiers:\n  entity: [shard-a]\n");
        }
        let path = self.config.path().join(format!("arbiter-{:08x}.yaml", rand::random::<u32>()));
        std::fs::write(&path, yaml).unwrap();
        let tiers = Clusters::load_arbiter_file(&path).unwrap_or_else(|e| panic!("{e:?}")).connect().await.unwrap();
        for s in tiers.stores() {
            s.epoch().check_seal().await.unwrap();
        }
        tiers.bootstrap(reg).await.unwrap();
        tiers
    }

    async fn etcd_of(&self, cluster: &str) -> etcd_client::Client {
        match cluster {
            "coord" => self.coord.client().await.unwrap(),
            _ => self.shard.as_ref().unwrap().client().await.unwrap(),
        }
    }

    /// The hold ids of transparent holds on `cluster` now.
    async fn hold_ids_on(&self, cluster: &str) -> Vec<String> {
        let mut c = self.etcd_of(cluster).await;
        let r = c.get(format!("{}/l/", self.root), Some(GetOptions::new().with_prefix())).await.unwrap();
        let mut ids: Vec<String> = r
            .kvs()
            .iter()
            .filter_map(|kv| {
                let v: serde_json::Value = serde_json::from_slice(kv.value()).ok()?;
                v["hold_id"].as_str().map(str::to_owned)
            })
            .collect();
        ids.sort();
        ids
    }

    /// The remaining TTL etcd reports for session `sid` on `cluster` (-1: gone).
    async fn lease_ttl(&self, cluster: &str, sid: lockmesh_core::headers::SessionId) -> i64 {
        let mut c = self.etcd_of(cluster).await;
        c.lease_time_to_live(sid.lease(), Some(LeaseTimeToLiveOptions::new())).await.unwrap().ttl()
    }
}

fn key(k: &str) -> LockKey {
    LockKey::parse(k.as_bytes()).unwrap()
}

/// A transparent request's grant of `k` as hold `hold` of the VM, the way
/// `extproc::transparent` makes it: on the VM's session for the class, on the key's home.
async fn transparent_grant(
    tiers: &Tiers,
    class: &ClassSpec,
    k: &str,
    hold: u64,
) -> Result<(Grant, Arc<Store>), LockError> {
    let store = tiers.route(class, &key(k), false).await?;
    let sid = store.vm_session(ENVOY, VM, class).await?;
    let req = AcquireRequest {
        key: key(k),
        class: class.clone(),
        caller: Caller { identity: "spiffe://cluster.local/ns/payments/sa/a".into(), instance: None },
        session: Some(sid),
        deadline: Instant::now(),
        try_once: true,
        hold_id: Some(vm::hold_id(VM, hold)),
        session_owner: Some(Store::vm_owner(ENVOY, VM)),
        unverified_caller: None,
        permits: Default::default(),
        mode: None,
        election: false,
        session_indexed: false,
    };
    let g = store.acquire(&req, &CancellationToken::new()).await?;
    Ok((g, store))
}

/// Runs the filter's keepalive (every 500 ms) for `d`.
async fn renew_for(tiers: &Tiers, d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        let _ = tiers.vm_keepalive(ENVOY, VM, None).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Item 1: with the coord cluster unreachable (its etcd frozen), a transparent
/// hold on a healthy shard is still renewed, past several of its TTLs, and the
/// coord cluster's failures are counted under its name.
#[tokio::test]
async fn an_unreachable_coord_cluster_does_not_stop_vm_renewals_on_a_shard() {
    let split = Split::start("edges-vm-renew", true).await;
    let reg = registry(3);
    let tiers = split.tiers(&reg).await;
    let class = reg.class_of(&key("payments/long-1")).clone();
    let (_g, store) = transparent_grant(&tiers, &class, "payments/long-1", 1).await.unwrap();
    assert_eq!(store.cluster_name(), "shard-a");
    // The VM also has a session on the coord cluster (a coord-tier key).
    let leader = reg.class_of(&key("billing/elect/primary")).clone();
    let (_g, coord) = transparent_grant(&tiers, &leader, "billing/elect/primary", 2).await.unwrap();
    assert_eq!(coord.cluster_name(), "coord");
    let before = failures_of("coord");

    split.coord.member(0).pause().unwrap();
    // Three TTLs of the shard's session: unrenewed it would lapse after one.
    renew_for(&tiers, Duration::from_secs(9)).await;
    let held = split.hold_ids_on("shard-a").await;
    split.coord.member(0).resume().unwrap();
    assert_eq!(held, vec![vm::hold_id(VM, 1)], "the shard's hold lapsed while the coord cluster was unreachable");
    let st = tiers.vm_keepalive(ENVOY, VM, None).await.unwrap();
    assert!(st.sessions >= 1, "{st:?}");
    assert!(failures_of("coord") > before, "coord failures not counted: {:?}", vm::RENEWAL_FAILURES.snapshot());
}

fn failures_of(cluster: &str) -> u64 {
    vm::RENEWAL_FAILURES.snapshot().into_iter().find(|(c, _)| c == cluster).map_or(0, |(_, n)| n)
}

/// Item 2: a class TTL change (a registry reload) while a transparent request
/// holds a key. The rule (`lockmesh_lock::vm`): the live session keeps its TTL and
/// is renewed for as long as it carries holds; new requests of the class get a
/// session of the new TTL, on the reloaded arbiter and on one that never cached
/// the old session; once its last hold ends the old session lapses.
#[tokio::test]
async fn a_class_ttl_reload_keeps_the_old_vm_session_while_it_holds_and_opens_a_new_one() {
    let split = Split::start("edges-vm-ttl", false).await;
    let (old, new) = (registry(3), registry(4));
    let a = split.tiers(&old).await;
    let old_class = old.class_of(&key("payments/t-1")).clone();
    let (g1, store_a) = transparent_grant(&a, &old_class, "payments/t-1", 1).await.unwrap();
    assert_eq!(g1.ttl_s, 3);

    // Arbiter a reloads its registry: its next request of the class is granted on a
    // session of the new TTL (not refused session_class_mismatch).
    a.bootstrap_policies(&new).await.unwrap();
    let new_class = new.class_of(&key("payments/t-2")).clone();
    let (g2, _) = transparent_grant(&a, &new_class, "payments/t-2", 2).await.unwrap();
    assert_ne!(g2.session, g1.session, "granted on the old TTL's session");
    assert_eq!(g2.ttl_s, 4);

    // Arbiter b starts with the new registry and no cache: it finds the class's
    // session, and the old one is still renewed (by either arbiter's keepalive).
    let b = split.tiers(&new).await;
    let (g3, _) = transparent_grant(&b, &new_class, "payments/t-3", 3).await.unwrap();
    assert_eq!(g3.session, g2.session, "arbiter b opened a third session");
    renew_for(&b, Duration::from_secs(8)).await;
    assert_eq!(
        split.hold_ids_on("coord").await,
        vec![vm::hold_id(VM, 1), vm::hold_id(VM, 2), vm::hold_id(VM, 3)],
        "a hold lapsed across the TTL change"
    );
    assert!(split.lease_ttl("coord", g1.session).await > 0, "the old session was not renewed");

    // The old session's last hold ends: it is not renewed any more and lapses
    // within its TTL; the new one lives on.
    assert!(store_a.vm_release(ENVOY, VM, &key("payments/t-1"), 1).await.unwrap());
    renew_for(&b, Duration::from_secs(5)).await;
    assert_eq!(split.lease_ttl("coord", g1.session).await, -1, "the old session outlived its holds");
    assert!(split.lease_ttl("coord", g2.session).await > 0);
    let st = b.vm_keepalive(ENVOY, VM, None).await.unwrap();
    assert_eq!((st.sessions, st.min_ttl_s), (1, 4), "{st:?}");
}

/// Item 6: a shard restored from a snapshot is sealed by the arbiter's check; a
/// token of a hold the snapshot still has is then not answered `current: true`
/// (the coord cluster, whose seal the API checked before, is fine).
#[tokio::test]
async fn validate_token_refuses_on_a_restored_sealed_shard() {
    let split = Split::start("edges-vm-restore", true).await;
    let reg = registry(15);
    let tiers = split.tiers(&reg).await;
    let class = reg.class_of(&key("payments/v-1")).clone();
    let (g, store) = transparent_grant(&tiers, &class, "payments/v-1", 1).await.unwrap();
    assert_eq!(store.cluster_name(), "shard-a");
    assert_eq!(tiers.is_current(&class, &key("payments/v-1"), g.token).await, Ok(true));

    let shard = split.shard.as_ref().unwrap();
    let snap = split.config.path().join("shard-a.db");
    shard.snapshot_save(&snap).await.unwrap();
    // Writes after the snapshot, seen by the seal check (its marks rise past them).
    let mut c = shard.client().await.unwrap();
    for i in 0..20 {
        c.put(format!("{}/x/{i}", split.root), "x", None).await.unwrap();
    }
    let _ = tiers.seal_round(&store).await;
    shard.restore_from(&snap, None).await.unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while store.seal().current().is_none() {
        assert!(Instant::now() < until, "the restored shard was never sealed");
        let _ = tiers.seal_round(&store).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(tiers.coord().unsealed().is_ok());
    let r = tiers.is_current(&class, &key("payments/v-1"), g.token).await;
    assert!(matches!(r, Err(LockError::Sealed(_))), "validate on a sealed shard answered {r:?}");
}

/// A transparent grant as `extproc::transparent` retries it: a session that ended
/// (or whose TTL another arbiter's registry disagrees with) is forgotten once and
/// the class's live session found or opened.
async fn transparent_grant_retried(
    tiers: &Tiers,
    class: &ClassSpec,
    k: &str,
    hold: u64,
) -> Result<(Grant, Arc<Store>), LockError> {
    match transparent_grant(tiers, class, k, hold).await {
        Err(LockError::SessionExpired | LockError::SessionClassMismatch { .. }) => {
            let store = tiers.route(class, &key(k), false).await?;
            store.forget_vm_session(VM, class.name.as_str(), class.ttl_s).await;
            transparent_grant(tiers, class, k, hold).await
        }
        r => r,
    }
}

/// Whether a grant made in the last second of a retired VM session's lease, by an
/// arbiter whose registry still has the old TTL (a rolling reload), outlives the
/// next renewal round. The filter renews every second; a hold must live until then.
async fn a_grant_in_a_retired_sessions_last_second(name: &str) -> Result<(), String> {
    let split = Split::start(name, false).await;
    let (old, new) = (registry(4), registry(5));
    let (a, b) = (split.tiers(&old).await, split.tiers(&old).await);
    let old_class = old.class_of(&key("payments/r-1")).clone();
    // Both arbiters grant on (and cache) the VM's session of the old TTL.
    let (g1, store_a) = transparent_grant(&a, &old_class, "payments/r-1", 1).await.unwrap();
    let (g2, store_b) = transparent_grant(&b, &old_class, "payments/r-2", 2).await.unwrap();
    assert_eq!(g1.session, g2.session);
    assert!(store_a.vm_release(ENVOY, VM, &key("payments/r-1"), 1).await.unwrap());
    assert!(store_b.vm_release(ENVOY, VM, &key("payments/r-2"), 2).await.unwrap());
    // Arbiter a reloads: its next grant retires the old session (it carries
    // nothing now) and opens one of the new TTL. Arbiter b has not reloaded.
    a.bootstrap_policies(&new).await.unwrap();
    let new_class = new.class_of(&key("payments/r-3")).clone();
    let (g3, _) = transparent_grant(&a, &new_class, "payments/r-3", 3).await.unwrap();
    assert_ne!(g3.session, g1.session);
    // A renewal round finds the retired session empty.
    a.vm_keepalive(ENVOY, VM, None).await.unwrap();
    // Its lease's last second (or it is gone already: closed by the round).
    let until = Instant::now() + Duration::from_secs(6);
    while split.lease_ttl("coord", g1.session).await > 1 {
        assert!(Instant::now() < until, "the retired session kept being renewed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Arbiter b, still on the old TTL with the old session cached, grants.
    let (g4, _) = transparent_grant_retried(&b, &old_class, "payments/r-4", 4).await.unwrap();
    // The next round comes within the filter's second, plus the lessor's grain.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let _ = a.vm_keepalive(ENVOY, VM, None).await;
    let held = split.hold_ids_on("coord").await;
    if !held.contains(&vm::hold_id(VM, 4)) {
        return Err(format!(
            "the hold granted on session {} (the old one: {}) was lost before the next renewal; holds now {held:?}",
            g4.session,
            g4.session == g1.session
        ));
    }
    if split.lease_ttl("coord", g4.session).await <= 0 {
        return Err("the hold's session was not renewed".into());
    }
    Ok(())
}

/// A retired VM session that carries no hold is closed by the renewal round (one
/// transaction comparing its hold index empty and deleting its record), so an
/// arbiter still on the old TTL cannot grant on it in its last second: its grant is
/// refused and lands on a live session, renewed like any other.
#[tokio::test]
async fn an_arbiter_on_the_old_ttl_never_grants_on_a_retired_session_about_to_lapse() {
    a_grant_in_a_retired_sessions_last_second("edges-vm-retired").await.unwrap();
}

/// Its planted twin, in a child process of this test binary (planted faults are
/// per process): with `retired_lapse_by_read` the retired session is only left to
/// lapse, and the grant in its last second is lost.
#[tokio::test]
async fn planted_retired_session_left_to_lapse_loses_a_grant_in_its_last_second() {
    let out = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["edges_vm::planted_child_retired_lapse", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("LOCKMESH_EDGES_VM_PLANT", "retired_lapse_by_read")
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("1 passed"), "the planted child did not run or failed: {text}");
}

/// The planted run (ignored: started only by its twin above, with the fault named
/// in `LOCKMESH_EDGES_VM_PLANT`).
#[tokio::test]
#[ignore = "a child of planted_retired_session_left_to_lapse_loses_a_grant_in_its_last_second"]
async fn planted_child_retired_lapse() {
    let name = std::env::var("LOCKMESH_EDGES_VM_PLANT").expect("run by its twin");
    let fault = lockmesh_lock::test_faults::TestFault::parse(&name).expect("a planted fault of lockmesh-lock");
    lockmesh_lock::test_faults::install(&[fault]);
    let r = a_grant_in_a_retired_sessions_last_second("edges-vm-retired-planted").await;
    assert!(r.is_err(), "with {name} planted the grant in the retired session's last second survived");
    eprintln!("planted {name}: {}", r.unwrap_err());
}
