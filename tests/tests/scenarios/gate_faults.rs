//! Every gate fault kind asserts that it took effect (docs/GATE.md "Faults"):
//! planted inert (`GateCluster::plant_inert_faults`: `schedule::inject` skips
//! the kill, pause, cut, restore, step or move and keeps the probe), each kind
//! must fail the run naming itself; the cheap kinds then run for real on the
//! small topology and their probes pass (the quick gate runs every one-cluster
//! kind for real on the full topology). Restore plus shard move runs on the
//! rebalance topology among moves, and the history must pass the checks across
//! homes.

use std::time::Duration;

use lockmesh_gate::harness::{GateCluster, GateOptions};
use lockmesh_gate::schedule::{self, FaultKind};
use lockmesh_gate::{History, Verdict};

/// One member, one arbiter and one Envoy; arbiter 0 and h0 run under
/// libfaketime (wall clock), h1 with wall and monotonic clocks; an inbound
/// sidecar with one transparent holder (for `sidecar_kill`).
fn small(name: &str) -> GateOptions {
    GateOptions {
        members: 1,
        arbiters: 1,
        envoys: 1,
        clock_steps: true,
        sdk_holders: 0,
        durable_holders: 0,
        transparent_holders: 1,
        rw_holders: 0,
        campaigners: 0,
        multi_holders: 0,
        reuse_holders: 0,
        permit_holders: 0,
        ..GateOptions::gate(name)
    }
}

/// Finishes the run and checks its history; on failure the report is written
/// and the test fails with it.
async fn passed(g: &GateCluster) -> History {
    let (h, v, failed) = lockmesh_gate::finish_and_check(g).await.unwrap();
    if let Some(text) = failed {
        panic!("{text}");
    }
    let Verdict::Pass(s) = v else { unreachable!() };
    assert!(s.grants > 10, "the workload ran: {s:?}");
    h
}

/// Injects each of `kinds` planted inert: each must fail naming its kind.
/// Returns the errors, for the log.
async fn inert_each_fails(g: &GateCluster, kinds: &[FaultKind]) -> Vec<String> {
    let mut missed = Vec::new();
    let mut said = Vec::new();
    for &k in kinds {
        g.plant_inert_faults(&[k.name()]);
        let t = std::time::Instant::now();
        match schedule::inject(g, k).await {
            Err(e) if format!("{e:#}").contains(k.name()) => {
                said.push(format!("{} ({} ms): {e:#}", k.name(), t.elapsed().as_millis()));
            }
            Err(e) => missed.push(format!("{}: failed without naming its kind: {e:#}", k.name())),
            Ok(()) => missed.push(format!("{}: passed while planted inert", k.name())),
        }
    }
    g.plant_inert_faults(&[]);
    assert!(missed.is_empty(), "{missed:#?}");
    said
}

/// The fault kinds of a one-cluster run whose took-effect probes this file
/// plants away (the operator actions of `schedule::ALL` have their own).
const ONE_CLUSTER: [FaultKind; 21] = [
    FaultKind::MemberKill,
    FaultKind::QuorumLoss,
    FaultKind::LeaderPause,
    FaultKind::LeaderIsolation,
    FaultKind::ArbiterPartition,
    FaultKind::SlowLink,
    FaultKind::HolderPause,
    FaultKind::ArbiterPause,
    FaultKind::ArbiterRestart,
    FaultKind::EnvoyRestart,
    FaultKind::Restore,
    FaultKind::RestoreBumped,
    FaultKind::RestoreCrash,
    FaultKind::PolicyChange,
    FaultKind::HolderClockStep,
    FaultKind::ArbiterClockStep,
    FaultKind::SidecarKill,
    FaultKind::OneWayLink,
    FaultKind::LossyLink,
    FaultKind::WriteStall,
    FaultKind::Compaction,
];

#[tokio::test]
async fn every_fault_kind_that_does_nothing_fails_the_run_naming_it() {
    let mut g = GateCluster::start(small("gate-inert")).await.unwrap();
    g.spawn_workload(2, 1).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for line in inert_each_fails(&g, &ONE_CLUSTER).await {
        eprintln!("inert {line}");
    }
    // The control: the same probes pass when the faults act (the kinds that
    // hold past the TTL run in the quick gate).
    let real = [
        FaultKind::MemberKill,
        FaultKind::QuorumLoss,
        FaultKind::WriteStall,
        FaultKind::Compaction,
        FaultKind::ArbiterRestart,
        FaultKind::EnvoyRestart,
        FaultKind::SidecarKill,
        FaultKind::HolderClockStep,
        FaultKind::ArbiterClockStep,
    ];
    for k in real {
        schedule::inject(&g, k).await.unwrap_or_else(|e| panic!("{} did not take effect: {e:#}", k.name()));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let h = passed(&g).await;
    for f in &h.faults {
        eprintln!("{}: {}", f.kind, f.detail);
    }
    let kinds: Vec<String> = h.faults_by_kind().into_iter().map(|(k, _)| k).collect();
    assert_eq!(kinds.len(), real.len(), "only the real faults are recorded: {kinds:?}");
}

/// The gate keys move to the other shard, then restore plus shard move restores
/// their home from a snapshot taken a second before and moves them off it at
/// once (back), then one shard or the coord cluster is partitioned; every check
/// must pass across homes. Then each rebalance kind planted inert must fail.
#[tokio::test]
async fn restore_plus_shard_move_takes_effect_and_keeps_the_checks_across_homes() {
    let opts = GateOptions {
        members: 1,
        clock_steps: false,
        sdk_holders: 0,
        durable_holders: 0,
        transparent_holders: 0,
        rw_holders: 0,
        campaigners: 0,
        ..GateOptions::rebalance("gate-restore-move")
    };
    let mut g = GateCluster::start(opts).await.unwrap();
    g.spawn_workload(3, 2).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let kinds = [FaultKind::Rebalance, FaultKind::RestoreMove, FaultKind::ClusterPartition];
    for k in kinds {
        schedule::inject(&g, k).await.unwrap_or_else(|e| panic!("{} did not take effect: {e:#}", k.name()));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for line in inert_each_fails(&g, &kinds).await {
        eprintln!("inert {line}");
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let h = passed(&g).await;
    for f in &h.faults {
        eprintln!("{}: {}", f.kind, f.detail);
    }
    assert_eq!(h.moves.len(), 2, "the rebalance and the move after the restore: {:?}", h.moves);
    assert_eq!((&h.moves[0].from, &h.moves[0].to), (&h.moves[1].to, &h.moves[1].from), "there and back");
    let restored = &h.moves[1].from;
    let shard = h.shards.iter().find(|s| &s.name == restored).unwrap();
    assert_eq!(shard.segments.len(), 2, "{restored} was restored once");
    // Not vacuous: the move off the restored shard had a key granted on both sides.
    let across = h.keys_granted_across(&h.moves[1]);
    eprintln!("granted on both sides of the move after the restore: {across:?}");
    assert!(!across.is_empty(), "no key granted on both sides of {:?}", h.moves[1]);
}
