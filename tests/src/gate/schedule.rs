//! The fault schedule: each fault is injected, held, healed and recorded with its
//! start and end time. Pauses "past the TTL" last [`PAST_TTL`].

use std::time::Duration;

use anyhow::Result;
use rand::seq::SliceRandom as _;

use super::faultproxy::LinkMode;
use super::harness::{GateCluster, GATE_TTL_S};
use super::history::now_us;

/// How long a pause or a partition lasts: past the TTL of the gate classes.
pub const PAST_TTL: Duration = Duration::from_millis(GATE_TTL_S * 1000 + 1500);

/// One kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL an etcd member, restart it later.
    MemberKill,
    /// SIGKILL two members (no majority), restart both.
    QuorumLoss,
    /// SIGSTOP the etcd leader past the TTL.
    LeaderPause,
    /// Cut both arbiters' links to the etcd leader (the leader isolated from its clients).
    LeaderIsolation,
    /// Cut every link of one arbiter (the arbiter partitioned from etcd).
    ArbiterPartition,
    /// Delay every link of one arbiter by 150 ms.
    SlowLink,
    /// SIGSTOP a fenced holder past the TTL.
    HolderPause,
    /// SIGSTOP an arbiter past the TTL.
    ArbiterPause,
    /// SIGKILL an arbiter and start it again.
    ArbiterRestart,
    /// SIGTERM an Envoy and start it again.
    EnvoyRestart,
    /// Snapshot, keep serving, restore with the original cluster id, advance the epoch.
    Restore,
}

/// Every kind, in the quick gate's order.
pub const ALL: [FaultKind; 11] = [
    FaultKind::HolderPause,
    FaultKind::MemberKill,
    FaultKind::ArbiterPartition,
    FaultKind::LeaderPause,
    FaultKind::SlowLink,
    FaultKind::ArbiterPause,
    FaultKind::LeaderIsolation,
    FaultKind::ArbiterRestart,
    FaultKind::EnvoyRestart,
    FaultKind::QuorumLoss,
    FaultKind::Restore,
];

// === impl FaultKind ===

impl FaultKind {
    /// The name in histories and summaries.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::MemberKill => "member_kill",
            FaultKind::QuorumLoss => "quorum_loss",
            FaultKind::LeaderPause => "leader_pause",
            FaultKind::LeaderIsolation => "leader_isolation",
            FaultKind::ArbiterPartition => "arbiter_partition",
            FaultKind::SlowLink => "slow_link",
            FaultKind::HolderPause => "holder_pause",
            FaultKind::ArbiterPause => "arbiter_pause",
            FaultKind::ArbiterRestart => "arbiter_restart",
            FaultKind::EnvoyRestart => "envoy_restart",
            FaultKind::Restore => "restore",
        }
    }
}

/// A random schedule of `n` faults (each kind at least once when `n` allows).
pub fn random(n: usize) -> Vec<FaultKind> {
    let mut rng = rand::rng();
    let mut v: Vec<FaultKind> = ALL.iter().copied().take(n).collect();
    while v.len() < n {
        v.push(ALL[rand::random_range(0..ALL.len())]);
    }
    v.shuffle(&mut rng);
    v
}

/// Injects `kind`, holds it, heals it and records it.
pub async fn inject(g: &GateCluster, kind: FaultKind) -> Result<()> {
    let start = now_us();
    let name = kind.name();
    match kind {
        FaultKind::MemberKill => {
            let i = rand::random_range(0..g.etcd.members().len());
            g.etcd.member(i).kill();
            tokio::time::sleep(Duration::from_secs(3)).await;
            g.etcd.member(i).restart().await?;
            g.note(name, format!("m{i}"), start);
        }
        FaultKind::QuorumLoss => {
            let n = g.etcd.members().len();
            let a = rand::random_range(0..n);
            let b = (a + 1) % n;
            g.etcd.member(a).kill();
            g.etcd.member(b).kill();
            let lost = now_us();
            tokio::time::sleep(Duration::from_secs(6)).await;
            g.note_quorum_loss(lost, now_us());
            let (ra, rb) = tokio::join!(g.etcd.member(a).restart(), g.etcd.member(b).restart());
            ra?;
            rb?;
            g.note(name, format!("m{a}+m{b}"), start);
        }
        FaultKind::LeaderPause => {
            let i = g.leader().await.unwrap_or(0);
            g.etcd.member(i).pause()?;
            tokio::time::sleep(PAST_TTL).await;
            g.etcd.member(i).resume()?;
            g.note(name, format!("m{i}"), start);
        }
        FaultKind::LeaderIsolation => {
            let i = g.leader().await.unwrap_or(0);
            for row in &g.proxies {
                row[i].set(LinkMode::Cut);
            }
            tokio::time::sleep(PAST_TTL).await;
            for row in &g.proxies {
                row[i].set(LinkMode::Pass);
            }
            g.note(name, format!("m{i} cut from every arbiter"), start);
        }
        FaultKind::ArbiterPartition | FaultKind::SlowLink => {
            let i = rand::random_range(0..g.arbiters.len());
            let mode =
                if kind == FaultKind::SlowLink { LinkMode::Delay(Duration::from_millis(150)) } else { LinkMode::Cut };
            g.set_links(i, mode);
            tokio::time::sleep(PAST_TTL).await;
            g.set_links(i, LinkMode::Pass);
            g.note(name, format!("arbiter {i}"), start);
        }
        FaultKind::HolderPause => {
            let fenced: Vec<usize> =
                g.holders.iter().enumerate().filter(|(_, h)| h.name.starts_with('h')).map(|(i, _)| i).collect();
            if let Some(&i) = fenced.get(rand::random_range(0..fenced.len().max(1))) {
                let h = &g.holders[i];
                h.process.pause()?;
                tokio::time::sleep(PAST_TTL).await;
                h.process.resume()?;
                g.note(name, h.name.clone(), start);
            }
        }
        FaultKind::ArbiterPause => {
            let i = rand::random_range(0..g.arbiters.len());
            g.arbiters[i].pause()?;
            tokio::time::sleep(PAST_TTL).await;
            g.arbiters[i].resume()?;
            g.note(name, format!("arbiter {i}"), start);
        }
        FaultKind::ArbiterRestart => {
            let i = rand::random_range(0..g.arbiters.len());
            g.arbiters[i].kill();
            g.arbiters[i].restart().await?;
            g.note(name, format!("arbiter {i} killed and started"), start);
        }
        FaultKind::EnvoyRestart => {
            let i = rand::random_range(0..g.envoys.len());
            g.envoys[i].restart().await?;
            g.note(name, format!("envoy {i}"), start);
        }
        FaultKind::Restore => {
            let base = g.restore(Duration::from_secs(2)).await?;
            g.note(
                name,
                format!("snapshot at revision {base}, same cluster id, epoch advanced to {}", g.epoch()),
                start,
            );
        }
    }
    Ok(())
}

/// Runs `schedule` with `gap` of fault-free load between faults.
pub async fn run(g: &GateCluster, schedule: &[FaultKind], gap: Duration) -> Result<()> {
    for &k in schedule {
        tokio::time::sleep(gap).await;
        inject(g, k).await?;
    }
    tokio::time::sleep(gap).await;
    Ok(())
}
