//! The fault schedule: each fault is injected, held, healed and recorded with its
//! start and end time. Pauses "past the TTL" last [`PAST_TTL`]; clock steps are
//! held for [`CLOCK_HOLD`] (their effect is the step itself, see [`super::clock`]).
//!
//! A run with shards (`GateOptions::shards`) draws from [`rebalance_kinds`]: a
//! [`FaultKind::Rebalance`] moves every gate key to the other shard (and the next
//! one back), and the member faults pick the coord cluster or a shard.

use std::time::Duration;

use anyhow::Result;
use rand::seq::SliceRandom as _;

use super::clock::{ClockStep, FakeClock, STEPS};
use super::faultproxy::{FaultProxy, LinkMode};
use super::harness::{GateCluster, GATE_TTL_S};
use super::history::now_us;
use lockmesh_tests::etcd::EtcdCluster;

/// How long a pause or a partition lasts: past the TTL of the gate classes.
pub const PAST_TTL: Duration = Duration::from_millis(GATE_TTL_S * 1000 + 1500);

/// How long a clock step that is stepped back is held: longer than a preloaded
/// process takes to see it ([`super::clock::CACHE_S`]).
pub(crate) const CLOCK_HOLD: Duration = Duration::from_secs(2);

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
    /// [`FaultKind::Restore`] with `--bump-revision` [`BUMP`] and
    /// `--mark-compacted`: revisions continue above the lost stretch's.
    RestoreBumped,
    /// Lower the semaphore class's limit (`lockctl limit change`: drain, verify,
    /// activate) and raise the fenced mutex class's TTL (a registry reload), or
    /// set both back.
    PolicyChange,
    /// Step the clock of a fenced holder (libfaketime; wall, or wall and monotonic).
    HolderClockStep,
    /// Step the clock of an arbiter (libfaketime; wall, or wall and monotonic).
    ArbiterClockStep,
    /// Move every gate key to the other entity shard, or back, with `lockctl
    /// shard apply` while the holders contend (runs with shards only).
    Rebalance,
    /// SIGKILL the transparent holders' inbound sidecar mid-request, start it again.
    SidecarKill,
    /// Cut every arbiter's links to one cluster (coord or a shard) past the TTL
    /// while keys on the others are held and renewed (runs with shards only).
    ClusterPartition,
    /// One arbiter's links pass its requests but hold etcd's answers past the
    /// TTL (a one-way link): transactions commit whose answers come late or never.
    OneWayLink,
    /// One arbiter's links hold one chunk in five for 200-600 ms, both ways (a
    /// lossy link: retransmissions), past the TTL.
    LossyLink,
    /// SIGSTOP the etcd leader for 900 ms, under the election timeout (a write
    /// stall): writes in flight wait, nobody takes over.
    WriteStall,
    /// Compact the cluster's history at the revision the recorder has reached:
    /// watches and reads of older revisions are refused from then on.
    Compaction,
    /// [`FaultKind::Restore`] with an arbiter killed before the snapshot and
    /// started again while the restored cluster waits for its epoch advance: it
    /// comes back to a rolled-back store with only its marks file to tell.
    RestoreCrash,
}

/// How long the arbiters reach a restored cluster before its epoch advance.
pub(crate) const ADVANCE_AFTER: Duration = Duration::from_secs(1);

/// How far a [`FaultKind::RestoreBumped`] moves revisions ahead.
pub(crate) const BUMP: u64 = 1_000_000;

/// Every kind, in the quick gate's order.
pub const ALL: [FaultKind; 21] = [
    FaultKind::HolderPause,
    FaultKind::OneWayLink,
    FaultKind::Compaction,
    FaultKind::LossyLink,
    FaultKind::WriteStall,
    FaultKind::SidecarKill,
    FaultKind::PolicyChange,
    FaultKind::HolderClockStep,
    FaultKind::MemberKill,
    FaultKind::ArbiterPartition,
    FaultKind::LeaderPause,
    FaultKind::SlowLink,
    FaultKind::ArbiterPause,
    FaultKind::ArbiterClockStep,
    FaultKind::LeaderIsolation,
    FaultKind::ArbiterRestart,
    FaultKind::EnvoyRestart,
    FaultKind::RestoreBumped,
    FaultKind::RestoreCrash,
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
            FaultKind::RestoreBumped => "restore_bumped",
            FaultKind::PolicyChange => "policy_change",
            FaultKind::HolderClockStep => "holder_clock_step",
            FaultKind::ArbiterClockStep => "arbiter_clock_step",
            FaultKind::Rebalance => "rebalance",
            FaultKind::SidecarKill => "sidecar_kill",
            FaultKind::ClusterPartition => "cluster_partition",
            FaultKind::OneWayLink => "one_way_link",
            FaultKind::LossyLink => "lossy_link",
            FaultKind::WriteStall => "write_stall",
            FaultKind::Compaction => "compaction",
            FaultKind::RestoreCrash => "restore_crash",
        }
    }
}

/// The kinds of a run with shards: [`FaultKind::Rebalance`],
/// [`FaultKind::ClusterPartition`] and every kind of [`ALL`] but [`FaultKind::QuorumLoss`] (its check, `quorum_loss_grants_nothing`,
/// knows one cluster; the gate keys live on the shards) and the restores (a
/// restored coord cluster can take the shard map back: a manual repair,
/// docs/SCALE.md).
pub(crate) fn rebalance_kinds() -> Vec<FaultKind> {
    let others = ALL.into_iter().filter(|k| {
        !matches!(k, FaultKind::QuorumLoss | FaultKind::Restore | FaultKind::RestoreBumped | FaultKind::RestoreCrash)
    });
    [FaultKind::Rebalance, FaultKind::ClusterPartition].into_iter().chain(others).collect()
}

/// A random schedule of `n` faults (each kind at least once when `n` allows).
pub fn random(n: usize) -> Vec<FaultKind> {
    random_of(&ALL, n)
}

/// A random schedule of `n` steps for a run with shards: at least two
/// rebalances (there and back) when `n` is 2 or more, and each of
/// [`rebalance_kinds`] at least once when `n` allows (one more than there are
/// kinds).
pub fn random_rebalance(n: usize) -> Vec<FaultKind> {
    let mut v = random_of(&rebalance_kinds(), n);
    while n >= 2 && v.iter().filter(|k| **k == FaultKind::Rebalance).count() < 2 {
        // Replace a kind that runs twice if there is one, else any other kind.
        let twice = |k: &FaultKind| *k != FaultKind::Rebalance && v.iter().filter(|x| *x == k).count() > 1;
        let Some(i) = v.iter().rposition(twice).or_else(|| v.iter().rposition(|k| *k != FaultKind::Rebalance)) else {
            break;
        };
        v[i] = FaultKind::Rebalance;
    }
    v
}

fn random_of(kinds: &[FaultKind], n: usize) -> Vec<FaultKind> {
    let mut rng = rand::rng();
    let mut v: Vec<FaultKind> = kinds.iter().copied().take(n).collect();
    while v.len() < n {
        v.push(kinds[rand::random_range(0..kinds.len())]);
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
            let (etcd, cluster) = cluster_of(g, pick_cluster(g));
            let i = rand::random_range(0..etcd.members().len());
            etcd.member(i).kill();
            tokio::time::sleep(Duration::from_secs(3)).await;
            etcd.member(i).restart().await?;
            g.note(name, format!("{cluster}m{i}"), start);
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
            let pick = pick_cluster(g);
            let (etcd, cluster) = cluster_of(g, pick);
            // A single-member shard's only member is its leader.
            let i = if pick.is_none() { g.leader().await.unwrap_or(0) } else { 0 };
            etcd.member(i).pause()?;
            tokio::time::sleep(PAST_TTL).await;
            etcd.member(i).resume()?;
            g.note(name, format!("{cluster}m{i}"), start);
        }
        FaultKind::LeaderIsolation => {
            let pick = pick_cluster(g);
            let (links, member): (Vec<&FaultProxy>, String) = match pick {
                // A single-member shard: its only member is its leader.
                Some(s) => (g.shards[s].proxies.iter().collect(), format!("{}m0", cluster_of(g, pick).1)),
                None => {
                    let i = g.leader().await.unwrap_or(0);
                    (g.proxies.iter().map(|row| &row[i]).collect(), format!("m{i}"))
                }
            };
            for p in &links {
                p.set(LinkMode::Cut);
            }
            tokio::time::sleep(PAST_TTL).await;
            for p in &links {
                p.set(LinkMode::Pass);
            }
            g.note(name, format!("{member} cut from every arbiter"), start);
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
            // A fenced holder: raw (`h*`) or SDK (`k*`).
            let fenced: Vec<usize> = g
                .holders
                .iter()
                .enumerate()
                .filter(|(_, h)| h.name.starts_with('h') || h.name.starts_with('k'))
                .map(|(i, _)| i)
                .collect();
            if let Some(&i) = fenced.get(rand::random_range(0..fenced.len().max(1))) {
                let h = &g.holders[i];
                h.process.pause()?;
                tokio::time::sleep(PAST_TTL).await;
                h.process.resume()?;
                g.note(name, h.name.clone(), start);
            }
        }
        FaultKind::OneWayLink | FaultKind::LossyLink => {
            let i = rand::random_range(0..g.arbiters.len());
            let links = || g.proxies[i].iter().chain(g.shards.iter().map(|s| &s.proxies[i]));
            let sum = || links().map(FaultProxy::held).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
            let before = sum();
            let mode = if kind == FaultKind::OneWayLink { LinkMode::OneWay } else { LinkMode::Lossy(20) };
            g.set_links(i, mode);
            tokio::time::sleep(PAST_TTL).await;
            g.set_links(i, LinkMode::Pass);
            let after = sum();
            let took = if kind == FaultKind::OneWayLink { after.0 - before.0 } else { after.1 - before.1 };
            // The arbiter renews sessions and watches every second: a link that
            // held nothing did not take effect, and the run fails.
            anyhow::ensure!(took > 0, "{name} on arbiter {i} held nothing: the fault did not take effect");
            g.note(name, format!("arbiter {i}: {took} chunk(s) held"), start);
        }
        FaultKind::WriteStall => {
            let pick = pick_cluster(g);
            let (etcd, cluster) = cluster_of(g, pick);
            let i = if pick.is_none() { g.leader().await.unwrap_or(0) } else { 0 };
            let m = etcd.member(i);
            let mut c = etcd_client::Client::connect([m.client_url()], None).await?;
            let root = g.root.clone();
            m.pause()?;
            let sent = tokio::time::Instant::now();
            let put = tokio::spawn(async move { c.put(format!("{}/gate/stall", root), "1", None).await });
            tokio::time::sleep(Duration::from_millis(900)).await;
            m.resume()?;
            let waited = match tokio::time::timeout(Duration::from_secs(10), put).await {
                Ok(Ok(Ok(_))) => sent.elapsed(),
                other => anyhow::bail!("write_stall: the probe write through {cluster}m{i} failed: {other:?}"),
            };
            // A put sent to the stopped member is answered only after it runs
            // again: an answer much sooner means the stall did not happen.
            anyhow::ensure!(
                waited >= Duration::from_millis(700),
                "write_stall: a write through the paused {cluster}m{i} was answered in {waited:?}"
            );
            g.note(
                name,
                format!("{cluster}m{i} stopped 900 ms; a write through it waited {} ms", waited.as_millis()),
                start,
            );
        }
        FaultKind::Compaction => {
            let pick = pick_cluster(g);
            let rev = g.compact(pick).await?;
            g.note(name, format!("{}compacted at revision {rev}", cluster_of(g, pick).1), start);
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
        FaultKind::HolderClockStep | FaultKind::ArbiterClockStep => {
            let clocks: Vec<&FakeClock> = if kind == FaultKind::HolderClockStep {
                g.holders.iter().filter_map(|h| h.clock.as_ref()).collect()
            } else {
                g.arbiter_clocks.iter().flatten().collect()
            };
            if let Some(c) = clocks.get(rand::random_range(0..clocks.len().max(1))) {
                let step = STEPS[rand::random_range(0..STEPS.len())];
                step_clock(g, name, c, step, CLOCK_HOLD).await?;
            }
        }
        FaultKind::Rebalance => {
            // Recorded by the harness (a `rebalance` fault and a move).
            g.rebalance().await?;
        }
        FaultKind::Restore | FaultKind::RestoreBumped => {
            let bump = (kind == FaultKind::RestoreBumped).then_some(BUMP);
            let base = g.restore_with(Duration::from_secs(2), bump, ADVANCE_AFTER).await?;
            let bumped = bump.map_or(String::new(), |b| format!(", revisions bumped by {b}"));
            g.note(
                name,
                format!("snapshot at revision {base}, same cluster id{bumped}, epoch advanced to {}", g.epoch()),
                start,
            );
        }
        FaultKind::RestoreCrash => {
            let i = rand::random_range(0..g.arbiters.len());
            g.arbiters[i].kill();
            let restored = g.restore_unadvanced(Duration::from_secs(2), None).await?;
            let advance = async {
                tokio::time::sleep(ADVANCE_AFTER).await;
                g.advance_epoch().await
            };
            let (started, advanced) = tokio::join!(g.arbiters[i].restart(), advance);
            started?;
            advanced?;
            g.note(
                name,
                format!(
                    "arbiter {i} killed before the snapshot at revision {}, started again before the epoch advance to {}{}",
                    restored.base,
                    g.epoch(),
                    if restored.grant_lost { "; the restore lost a grant" } else { "" }
                ),
                start,
            );
        }
        FaultKind::PolicyChange => {
            // Recorded by the harness.
            g.policy_change().await?;
        }
        FaultKind::SidecarKill => {
            // Recorded by the harness.
            g.sidecar_kill().await?;
        }
        FaultKind::ClusterPartition => {
            // Recorded by the harness; without shards there is no other cluster.
            if !g.shards.is_empty() {
                g.cluster_partition(pick_cluster(g)).await?;
            }
        }
    }
    Ok(())
}

/// The cluster a member fault hits: the coord cluster, or with shards one of the
/// coord cluster and the shards at random (`Some(i)`: shard `i`).
fn pick_cluster(g: &GateCluster) -> Option<usize> {
    rand::random_range(0..=g.shards.len()).checked_sub(1)
}

/// The etcd cluster [`pick_cluster`] picked and its label in a fault's detail
/// (`""` for the coord cluster, `"shard-a/"` for a shard).
fn cluster_of(g: &GateCluster, pick: Option<usize>) -> (&EtcdCluster, String) {
    match pick {
        None => (&g.etcd, String::new()),
        Some(i) => (&g.shards[i].etcd, format!("{}/", g.shards[i].name)),
    }
}

/// Steps `clock` by `step`, holds it for `hold` and steps it back unless the step
/// is kept; records the fault as `kind`.
pub async fn step_clock(g: &GateCluster, kind: &str, clock: &FakeClock, step: ClockStep, hold: Duration) -> Result<()> {
    let start = now_us();
    clock.step(step)?;
    tokio::time::sleep(hold).await;
    let (end, how) = if step.kept() { (clock.step_offset(), "kept") } else { (clock.heal()?, "then back") };
    g.note(
        kind,
        format!(
            "{} ({} clock) stepped {:+} s, {how}; offset now {end:+} s",
            clock.label(),
            clock.mode().name(),
            step.seconds()
        ),
        start,
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rebalance_schedule_moves_there_and_back_and_runs_every_kind_when_it_can() {
        for _ in 0..50 {
            let v = random_rebalance(rebalance_kinds().len() + 1);
            assert_eq!(v.len(), rebalance_kinds().len() + 1);
            assert!(v.iter().filter(|k| **k == FaultKind::Rebalance).count() >= 2, "{v:?}");
            assert!(rebalance_kinds().iter().all(|k| v.contains(k)), "{v:?}");
            assert!(!v.contains(&FaultKind::Restore) && !v.contains(&FaultKind::QuorumLoss));
            assert!(!v.contains(&FaultKind::RestoreBumped) && !v.contains(&FaultKind::RestoreCrash));
            let short = random_rebalance(3);
            assert!(short.iter().filter(|k| **k == FaultKind::Rebalance).count() >= 2, "{short:?}");
        }
    }
}
