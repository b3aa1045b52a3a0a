//! The fault schedule: each fault is injected, held, healed and recorded with its
//! start and end time. Pauses "past the TTL" last [`PAST_TTL`]; clock steps are
//! held for [`CLOCK_HOLD`] (their effect is the step itself, see [`super::clock`]).
//!
//! A run with shards (`GateOptions::shards`) draws from [`rebalance_kinds`]: a
//! [`FaultKind::Rebalance`] moves every gate key to the other shard (and the next
//! one back), and the member faults pick the coord cluster or a shard.

use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use rand::seq::SliceRandom as _;

use super::clock::{ClockStep, FakeClock, STEPS};
use super::faultproxy::{FaultProxy, LinkMode};
use super::harness::{snapshot_revision, GateCluster, GATE_TTL_S, MUTEX_PREFIX};
use super::history::now_us;
use super::recorder::EtcdLogin;
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
    /// Restore plus shard move (runs with shards only): snapshot the entity shard
    /// that homes the gate keys, restore it 1 s later (same cluster id), move
    /// every gate key off it at once while it is sealed (`lockctl shard apply`),
    /// then its guarded epoch advance (`lockctl epoch-advance --epochs-from`)
    /// and `lockctl shard apply` without a change, as docs/SCALE.md says.
    RestoreMove,
    /// Two operators force-release the victim holder's live hold (`lockctl admin
    /// request force-release`, `approve`); its next write must be refused by the
    /// fence (`super::actions::force_release`).
    ForceRelease,
    /// Move a prefix between two classes (registry reload, `lockctl class apply`:
    /// drain, verify, apply) while its holders contend (`super::actions::class_apply`).
    ClassApply,
    /// Lower the read-write class's limit from 3 to 2 (`lockctl limit change`:
    /// drain, verify, activate), or raise it back (`super::actions::rw_limit_change`).
    RwLimitChange,
}

/// How long the arbiters reach a restored cluster before its epoch advance.
pub(crate) const ADVANCE_AFTER: Duration = Duration::from_secs(1);

/// How far a [`FaultKind::RestoreBumped`] moves revisions ahead.
pub(crate) const BUMP: u64 = 1_000_000;

/// Every kind, in the quick gate's order.
pub const ALL: [FaultKind; 24] = [
    FaultKind::HolderPause,
    FaultKind::ForceRelease,
    FaultKind::RwLimitChange,
    FaultKind::ClassApply,
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
            FaultKind::RestoreMove => "restore_move",
            FaultKind::ForceRelease => "force_release",
            FaultKind::ClassApply => "class_apply",
            FaultKind::RwLimitChange => "rw_limit_change",
        }
    }
}

/// The kinds of a run with shards: [`FaultKind::Rebalance`],
/// [`FaultKind::ClusterPartition`], [`FaultKind::RestoreMove`] and every kind of [`ALL`] but [`FaultKind::QuorumLoss`] (its check, `quorum_loss_grants_nothing`,
/// knows one cluster; the gate keys live on the shards) and the restores of the
/// coord cluster (a restored coord cluster can take the shard map back: a manual
/// repair, docs/SCALE.md).
pub(crate) fn rebalance_kinds() -> Vec<FaultKind> {
    let others = ALL.into_iter().filter(|k| {
        !matches!(k, FaultKind::QuorumLoss | FaultKind::Restore | FaultKind::RestoreBumped | FaultKind::RestoreCrash)
    });
    [FaultKind::Rebalance, FaultKind::ClusterPartition, FaultKind::RestoreMove].into_iter().chain(others).collect()
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

/// Injects `kind`, holds it, heals it, checks that it took effect and records
/// it with what its probe saw. A fault that did not take effect (or finds
/// nothing to act on) is an error naming its kind: the run fails.
pub async fn inject(g: &GateCluster, kind: FaultKind) -> Result<()> {
    let start = now_us();
    let name = kind.name();
    // A kind planted inert (`GateCluster::plant_inert_faults`) skips its action
    // and keeps its probe: the twin of every took-effect assertion.
    let live = !g.is_inert(name);
    let hold = |d: Duration| tokio::time::sleep(if live { d } else { INERT_HOLD });
    match kind {
        FaultKind::MemberKill => {
            let (etcd, cluster) = cluster_of(g, pick_cluster(g));
            let i = rand::random_range(0..etcd.members().len());
            let m = etcd.member(i);
            let before = m.pid();
            if live {
                m.kill();
            }
            // Took effect: the process is gone and its client port refuses.
            let exited = m.pid().is_none();
            let refused = tokio::net::TcpStream::connect(("127.0.0.1", m.client_port())).await.is_err();
            hold(Duration::from_secs(3)).await;
            if live {
                m.restart().await?;
            }
            let (after, healthy) = (m.pid(), m.is_healthy().await);
            ensure!(
                exited && refused,
                "member_kill: {cluster}m{i} did not go down (pid {} running after the kill: {}, client port refused: {refused}): the fault did not take effect",
                pid(before),
                !exited
            );
            ensure!(
                healthy && after.is_some() && after != before,
                "member_kill: {cluster}m{i} did not answer again after its restart (pid {} -> {}, healthy: {healthy})",
                pid(before),
                pid(after)
            );
            g.note(
                name,
                format!(
                    "{cluster}m{i}: pid {} exited, its client port refused; pid {} healthy again",
                    pid(before),
                    pid(after)
                ),
                start,
            );
        }
        FaultKind::QuorumLoss => {
            let n = g.etcd.members().len();
            let a = rand::random_range(0..n);
            // Two members of three; the only member of a one-member cluster.
            let killed: Vec<usize> = if n > 1 { vec![a, (a + 1) % n] } else { vec![a] };
            let on = (0..n).find(|i| !killed.contains(i)).unwrap_or(a);
            let mut c = member_client(g.marks_login(None), g.etcd.member(on)).await?;
            if live {
                for &i in &killed {
                    g.etcd.member(i).kill();
                }
            }
            let lost = now_us();
            let t = tokio::time::Instant::now();
            // Took effect: a linearizable read through the member left (through
            // the killed one, on one member) is refused or times out.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let key = format!("{}/gate/stall", g.root);
            let refused = match tokio::time::timeout(Duration::from_secs(2), c.get(key, None)).await {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(format!("refused ({e})")),
                Err(_) => Some("not answered in 2 s".to_owned()),
            };
            let down = killed.iter().map(|i| format!("m{i}")).collect::<Vec<_>>().join("+");
            if live {
                tokio::time::sleep(Duration::from_secs(6).saturating_sub(t.elapsed())).await;
                g.note_quorum_loss(lost, now_us());
                futures::future::try_join_all(killed.iter().map(|&i| g.etcd.member(i).restart())).await?;
            }
            let Some(refused) = refused else {
                bail!("quorum_loss: a linearizable read through m{on} was answered while {down} were down: the fault did not take effect")
            };
            g.note(name, format!("{down}; a linearizable read through m{on} {refused}"), start);
        }
        FaultKind::LeaderPause => {
            let pick = pick_cluster(g);
            let (etcd, cluster) = cluster_of(g, pick);
            // A single-member shard's only member is its leader.
            let i = if pick.is_none() { g.leader().await.unwrap_or(0) } else { 0 };
            let m = etcd.member(i);
            let mut c = member_client(g.marks_login(pick), m).await?;
            if live {
                m.pause()?;
            }
            // Took effect: the process is stopped (state T) the whole pause,
            // and a put sent through it at the stop is not answered.
            let at = m.pid().and_then(proc_state);
            let key = format!("{}/gate/stall", g.root);
            let put = tokio::spawn(async move { c.put(key, "1", None).await });
            hold(PAST_TTL).await;
            let (waited, end) = (!put.is_finished(), m.pid().and_then(proc_state));
            if live {
                m.resume()?;
            }
            put.abort();
            ensure!(
                at == Some('T') && end == Some('T') && waited,
                "leader_pause: {cluster}m{i} was not stopped (process state {at:?} at the pause, {end:?} at its end; a put through it answered: {}): the fault did not take effect",
                !waited
            );
            g.note(
                name,
                format!(
                    "{cluster}m{i}: process state T the whole pause; a put through it waited {} ms",
                    PAST_TTL.as_millis()
                ),
                start,
            );
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
            let before = cut_count(&links);
            if live {
                for p in &links {
                    p.set(LinkMode::Cut);
                }
            }
            hold(PAST_TTL).await;
            if live {
                for p in &links {
                    p.set(LinkMode::Pass);
                }
            }
            // Took effect: the proxies closed or refused connections.
            let cut = cut_count(&links) - before;
            ensure!(cut > 0, "leader_isolation: the links to {member} closed or refused no connection: the fault did not take effect");
            g.note(name, format!("{member} cut from every arbiter: {cut} connection(s) closed or refused"), start);
        }
        FaultKind::ArbiterPartition | FaultKind::SlowLink => {
            let i = rand::random_range(0..g.arbiters.len());
            let links = arbiter_links(g, i);
            let delay = Duration::from_millis(150);
            let before = (cut_count(&links), links.iter().map(|p| p.delayed()).sum::<u64>());
            let mode = if kind == FaultKind::SlowLink { LinkMode::Delay(delay) } else { LinkMode::Cut };
            if live {
                g.set_links(i, mode);
            }
            hold(PAST_TTL).await;
            if live {
                g.set_links(i, LinkMode::Pass);
            }
            // Took effect: the proxies cut connections, or held chunks for at
            // least the delay (the arbiter renews sessions every second).
            let seen = if kind == FaultKind::SlowLink {
                let n = links.iter().map(|p| p.delayed()).sum::<u64>() - before.1;
                ensure!(n > 0, "slow_link on arbiter {i} delayed no chunk by {delay:?}: the fault did not take effect");
                format!("{n} chunk(s) delayed >= {} ms", delay.as_millis())
            } else {
                let n = cut_count(&links) - before.0;
                ensure!(
                    n > 0,
                    "arbiter_partition of arbiter {i} closed or refused no connection: the fault did not take effect"
                );
                format!("{n} connection(s) closed or refused")
            };
            g.note(name, format!("arbiter {i}: {seen}"), start);
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
            let Some(&i) = fenced.get(rand::random_range(0..fenced.len().max(1))) else {
                bail!("holder_pause: no fenced holder runs")
            };
            let h = &g.holders[i];
            if live {
                h.process.pause()?;
            }
            let at = h.process.pid().and_then(proc_state);
            hold(PAST_TTL).await;
            let end = h.process.pid().and_then(proc_state);
            if live {
                h.process.resume()?;
            }
            ensure!(
                at == Some('T') && end == Some('T'),
                "holder_pause: {} was not stopped (process state {at:?} at the pause, {end:?} at its end): the fault did not take effect",
                h.name
            );
            g.note(name, format!("{}: process state T the whole pause", h.name), start);
        }
        FaultKind::OneWayLink | FaultKind::LossyLink => {
            let i = rand::random_range(0..g.arbiters.len());
            let links = || g.proxies[i].iter().chain(g.shards.iter().map(|s| &s.proxies[i]));
            let sum = || links().map(FaultProxy::held).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
            let before = sum();
            let mode = if kind == FaultKind::OneWayLink { LinkMode::OneWay } else { LinkMode::Lossy(20) };
            if live {
                g.set_links(i, mode);
            }
            hold(PAST_TTL).await;
            if live {
                g.set_links(i, LinkMode::Pass);
            }
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
            // As the gate's own user, which may write only under `<root>/gate/`.
            let mut c = g.marks_login(pick).connect(&[m.client_url()]).await?;
            let root = g.root.clone();
            if live {
                m.pause()?;
            }
            let sent = tokio::time::Instant::now();
            // The wait is measured where the answer arrives (a wait measured
            // after the stall would always be 900 ms).
            let put = tokio::spawn(async move {
                let r = c.put(format!("{}/gate/stall", root), "1", None).await;
                (r, sent.elapsed())
            });
            tokio::time::sleep(Duration::from_millis(900)).await;
            if live {
                m.resume()?;
            }
            let waited = match tokio::time::timeout(Duration::from_secs(10), put).await {
                Ok(Ok((Ok(_), waited))) => waited,
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
            // Took effect: `compact` reads at the revision before and needs it refused.
            let rev = if live { g.compact(pick).await? } else { not_compacted(g, pick).await? };
            g.note(name, format!("{}compacted at revision {rev}", cluster_of(g, pick).1), start);
        }
        FaultKind::ArbiterPause => {
            let i = rand::random_range(0..g.arbiters.len());
            let a = &g.arbiters[i];
            if live {
                a.pause()?;
            }
            let at = a.pid().and_then(proc_state);
            hold(PAST_TTL).await;
            let end = a.pid().and_then(proc_state);
            if live {
                a.resume()?;
            }
            ensure!(
                at == Some('T') && end == Some('T'),
                "arbiter_pause: arbiter {i} was not stopped (process state {at:?} at the pause, {end:?} at its end): the fault did not take effect"
            );
            g.note(name, format!("arbiter {i}: process state T the whole pause"), start);
        }
        FaultKind::ArbiterRestart => {
            let i = rand::random_range(0..g.arbiters.len());
            let a = &g.arbiters[i];
            let before = a.pid();
            if live {
                a.kill();
                a.restart().await?;
            }
            // Took effect: a new process that answers its ready check.
            let after = a.pid();
            let ready = ready_within(async || Ok(a.admin_get("/readyz").await?.0)).await;
            ensure!(
                after.is_some() && after != before && ready == Some(200),
                "arbiter_restart: arbiter {i} is not a new ready process (pid {} -> {}, /readyz {ready:?}): the fault did not take effect",
                pid(before),
                pid(after)
            );
            g.note(
                name,
                format!("arbiter {i} killed and started: pid {} -> {}, /readyz 200", pid(before), pid(after)),
                start,
            );
        }
        FaultKind::EnvoyRestart => {
            let i = rand::random_range(0..g.envoys.len());
            let e = &g.envoys[i];
            let before = pids_naming(e.config_path());
            if live {
                e.restart().await?;
            }
            let seen =
                envoy_renewed(e, &before).await.map_err(|why| anyhow::anyhow!("envoy_restart: envoy {i} {why}"))?;
            g.note(name, format!("envoy {i}: {seen}"), start);
        }
        FaultKind::HolderClockStep | FaultKind::ArbiterClockStep => {
            let clocks: Vec<&FakeClock> = if kind == FaultKind::HolderClockStep {
                g.holders.iter().filter_map(|h| h.clock.as_ref()).collect()
            } else {
                g.arbiter_clocks.iter().flatten().collect()
            };
            let Some(c) = clocks.get(rand::random_range(0..clocks.len().max(1))) else {
                bail!("{name}: no process runs under libfaketime (GateOptions::clock_steps)")
            };
            let step = STEPS[rand::random_range(0..STEPS.len())];
            step_clock_probed(g, name, c, step, live).await?;
        }
        FaultKind::Rebalance => {
            // Recorded by the harness (a `rebalance` fault and a move).
            let before = g.shard_map().await?.version;
            if live {
                g.rebalance().await?;
            }
            // Took effect: the coord cluster's shard map changed.
            let after = g.shard_map().await?.version;
            ensure!(
                after > before,
                "rebalance: the shard map stayed at version {before}: the fault did not take effect"
            );
            g.annotate(name, &format!("the coord shard map at version {after}"));
        }
        FaultKind::Restore | FaultKind::RestoreBumped => {
            let bump = (kind == FaultKind::RestoreBumped).then_some(BUMP);
            let before = restore_marks(g).await?;
            let base = if live { g.restore_with(Duration::from_secs(2), bump, ADVANCE_AFTER).await? } else { 0 };
            let seen = restored(g, name, before).await?;
            let bumped = bump.map_or(String::new(), |b| format!(", revisions bumped by {b}"));
            g.note(
                name,
                format!(
                    "snapshot at revision {base}, same cluster id{bumped}, epoch advanced to {}; {seen}",
                    g.epoch()
                ),
                start,
            );
        }
        FaultKind::RestoreCrash => {
            let i = rand::random_range(0..g.arbiters.len());
            let before = restore_marks(g).await?;
            let (base, lost) = if live {
                g.arbiters[i].kill();
                let restored = g.restore_unadvanced(Duration::from_secs(2), None).await?;
                let advance = async {
                    tokio::time::sleep(ADVANCE_AFTER).await;
                    g.advance_epoch().await
                };
                // The runbook's order (docs/OPERATIONS.md): an arbiter down since
                // before the snapshot stays down until the advance has sealed the
                // epoch record; before that only the raft-term mark, blind when
                // the cluster never changed leader since it was restored, could
                // tell it (`restore::an_arbiter_down_since_before_the_snapshot_seals_on_the_raft_term`).
                let restart = async {
                    wait_epoch_sealed(g).await?;
                    g.arbiters[i].restart().await
                };
                let (started, advanced) = tokio::join!(restart, advance);
                started?;
                advanced?;
                (restored.base, restored.grant_lost)
            } else {
                (0, false)
            };
            let seen = restored(g, name, before).await?;
            g.note(
                name,
                format!(
                    "arbiter {i} killed before the snapshot at revision {base}, started again before the epoch advance to {}{}; {seen}",
                    g.epoch(),
                    if lost { "; the restore lost a grant" } else { "" }
                ),
                start,
            );
        }
        FaultKind::PolicyChange => {
            // Recorded by the harness.
            let before = policies(g, 0).await?;
            if live {
                g.policy_change().await?;
            }
            let seen = policy_changed(g, before).await?;
            g.annotate(name, &seen);
        }
        FaultKind::SidecarKill => {
            // Recorded by the harness.
            let Some(e) = &g.sidecar else {
                bail!("sidecar_kill: no inbound sidecar runs (GateOptions::transparent_holders is 0)")
            };
            let before = pids_naming(e.config_path());
            if live {
                g.sidecar_kill().await?;
            }
            let seen = envoy_renewed(e, &before)
                .await
                .map_err(|why| anyhow::anyhow!("sidecar_kill: the inbound sidecar {why}"))?;
            g.annotate(name, &seen);
        }
        FaultKind::ClusterPartition => {
            // Recorded by the harness; without shards there is no other cluster.
            ensure!(!g.shards.is_empty(), "cluster_partition: runs with shards only (GateOptions::shards)");
            let pick = pick_cluster(g);
            let links: Vec<&FaultProxy> = match pick {
                None => g.proxies.iter().flatten().collect(),
                Some(i) => g.shards[i].proxies.iter().collect(),
            };
            let before = cut_count(&links);
            if live {
                g.cluster_partition(pick).await?;
            } else {
                hold(PAST_TTL).await;
            }
            let cut = cut_count(&links) - before;
            let label = cluster_of(g, pick).1;
            ensure!(
                cut > 0,
                "cluster_partition: the links to {}closed or refused no connection: the fault did not take effect",
                if label.is_empty() { "the coord cluster ".to_owned() } else { label.replace('/', " ") }
            );
            g.annotate(name, &format!("{cut} connection(s) closed or refused"));
        }
        FaultKind::RestoreMove => restore_move(g, live, start).await?,
        FaultKind::ForceRelease => super::actions::force_release(g).await?,
        FaultKind::ClassApply => super::actions::class_apply(g).await?,
        FaultKind::RwLimitChange => super::actions::rw_limit_change(g).await?,
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

/// How long a fault planted inert holds: long enough for its probe to look.
const INERT_HOLD: Duration = Duration::from_millis(300);

/// A pid for a fault's detail.
fn pid(p: Option<u32>) -> String {
    p.map_or_else(|| "none".to_owned(), |p| p.to_string())
}

/// The state of process `pid` (`/proc/<pid>/stat`: `T` stopped, `S` sleeping..).
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// The live processes whose command line names `path` (an Envoy's config file).
fn pids_naming(path: &std::path::Path) -> Vec<u32> {
    let needle = path.display().to_string();
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(&needle) && !matches!(proc_state(*p), Some('Z') | None)
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// Polls `status` for up to 5 s until it answers 200; the last answer.
async fn ready_within(mut status: impl AsyncFnMut() -> Result<u16>) -> Option<u16> {
    let end = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = status().await.ok();
        if s == Some(200) || tokio::time::Instant::now() >= end {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An Envoy restarted: its processes differ from `before` and it answers `/ready`.
async fn envoy_renewed(e: &lockmesh_tests::EnvoyProcess, before: &[u32]) -> std::result::Result<String, String> {
    let port = e.admin_port();
    let ready = ready_within(async || Ok(lockmesh_tests::probe::http_get(port, "/ready").await?.status)).await;
    let after = pids_naming(e.config_path());
    if after.is_empty() || after == before || ready != Some(200) {
        return Err(format!(
            "is not a new ready process (pids {before:?} -> {after:?}, /ready {ready:?}): the fault did not take effect"
        ));
    }
    Ok(format!("pid {before:?} -> {after:?}, /ready 200"))
}

/// Every link of arbiter `i` (to every member of every cluster).
fn arbiter_links(g: &GateCluster, i: usize) -> Vec<&FaultProxy> {
    g.proxies[i].iter().chain(g.shards.iter().map(|s| &s.proxies[i])).collect()
}

/// Connections `links` closed or refused for a cut, so far.
fn cut_count(links: &[&FaultProxy]) -> u64 {
    links.iter().map(|p| p.cut()).sum()
}

/// A client of member `m` alone (3 s to connect), logged in as `login`.
async fn member_client(login: &EtcdLogin, m: &lockmesh_tests::EtcdMember) -> Result<etcd_client::Client> {
    tokio::time::timeout(Duration::from_secs(3), login.connect(&[m.client_url()]))
        .await
        .with_context(|| format!("connect to etcd member {}: timed out", m.name()))?
        .with_context(|| format!("connect to etcd member {}", m.name()))
}

/// The probe of a compaction that did not run: a read at the revision before
/// the one the recorder has reached is answered, so the run fails.
async fn not_compacted(g: &GateCluster, pick: Option<usize>) -> Result<i64> {
    let (recorder, etcd) = match pick {
        None => (&g.recorder, &g.etcd),
        Some(i) => (&g.shards[i].recorder, &g.shards[i].etcd),
    };
    let rev = recorder.barrier(Duration::from_secs(30)).await?;
    // As `GateCluster::compact` reads (root: etcd 3.5 answers Compact to root only).
    let mut c = etcd.client().await?;
    match c.get(g.root.as_str(), Some(etcd_client::GetOptions::new().with_revision(rev - 1))).await {
        Err(e) if e.to_string().contains("compacted") => Ok(rev),
        other => bail!(
            "compaction at revision {rev} did not take effect: a read at {} was answered ({})",
            rev - 1,
            if other.is_ok() { "ok".to_owned() } else { format!("{other:?}") }
        ),
    }
}

/// The coord cluster's store segments recorded so far and its epoch record's epoch.
async fn restore_marks(g: &GateCluster) -> Result<(usize, u64)> {
    let mut c = g.reader(None)?.connect(&g.etcd.endpoints()).await?;
    let r = c.get(format!("{}/sys/epoch", g.root), None).await?;
    let epoch = match r.kvs().first() {
        Some(kv) => serde_json::from_slice::<serde_json::Value>(kv.value())?["epoch"].as_u64().unwrap_or(0),
        None => 0,
    };
    Ok((g.recorder.take().0.len(), epoch))
}

/// Waits (at most 60 s) until the coord cluster's epoch record carries an
/// explicit seal or a newer epoch than `restore_marks` read: the first step of
/// `lockctl epoch-advance` is done.
async fn wait_epoch_sealed(g: &GateCluster) -> Result<()> {
    let from = g.epoch();
    let end = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut c = g.reader(None)?.connect(&g.etcd.endpoints()).await?;
    loop {
        if let Ok(r) = c.get(format!("{}/sys/epoch", g.root), None).await {
            if let Some(kv) = r.kvs().first() {
                let rec: serde_json::Value = serde_json::from_slice(kv.value())?;
                if !rec["sealed"].is_null() || rec["epoch"].as_u64().unwrap_or(0) > from {
                    return Ok(());
                }
            }
        }
        ensure!(tokio::time::Instant::now() < end, "restore_crash: the epoch record was not sealed within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The took-effect probe of a restore: the recorder started a new segment and the
/// epoch record advanced, since `before` ([`restore_marks`]).
async fn restored(g: &GateCluster, name: &str, before: (usize, u64)) -> Result<String> {
    let after = restore_marks(g).await?;
    ensure!(
        after.0 > before.0 && after.1 > before.1,
        "{name}: no restore took effect: store segments {} -> {}, epoch record {} -> {}",
        before.0,
        after.0,
        before.1,
        after.1
    );
    Ok(format!("store segment {} recorded, epoch record {} -> {}", after.0, before.1, after.1))
}

/// What arbiter `i`'s `/status` says of the policy-change classes: the
/// authoritative limits of `gatesem` and `gatelead` and the registry TTL of `gatem`.
async fn policies(g: &GateCluster, i: usize) -> Result<(Option<u64>, Option<u64>, Option<u64>)> {
    let (code, body) = g.arbiters[i].admin_get("/status").await?;
    ensure!(code == 200, "arbiter {i} /status: {code}");
    let v: serde_json::Value = serde_json::from_str(&body).context("arbiter /status")?;
    let field = |class: &str, f: &str| find_class(&v, class).and_then(|c| c[f].as_u64());
    Ok((field(super::harness::SEM_CLASS, "limit"), field(super::harness::LEAD_CLASS, "limit"), field("gatem", "ttl_s")))
}

/// The class object named `name` anywhere in `v` (`/status` `classes`).
fn find_class<'a>(v: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    match v {
        serde_json::Value::Object(m)
            if m.get("name").and_then(|n| n.as_str()) == Some(name) && m.contains_key("ttl_s") =>
        {
            Some(v)
        }
        serde_json::Value::Object(m) => m.values().find_map(|x| find_class(x, name)),
        serde_json::Value::Array(a) => a.iter().find_map(|x| find_class(x, name)),
        _ => None,
    }
}

/// The took-effect probe of a policy change: every arbiter's `/status` shows the
/// authoritative limits and the registry TTL the change set (from `before`, what
/// arbiter 0 showed: lowered and raised, or set back), within 5 s.
async fn policy_changed(g: &GateCluster, before: (Option<u64>, Option<u64>, Option<u64>)) -> Result<String> {
    use super::harness::{GATE_TTL_RAISED_S, SEM_LOWERED, SEM_N};
    let lowered = u64::try_from(SEM_LOWERED)?;
    let back = before.0 == Some(lowered);
    let sem = if back { u64::try_from(SEM_N)? } else { lowered };
    let ttl = if back { GATE_TTL_S } else { GATE_TTL_RAISED_S };
    let lead = (g.options().elections > 0).then_some(if back { 1 } else { 2 });
    let end = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut seen = Vec::new();
    loop {
        seen.clear();
        for i in 0..g.arbiters.len() {
            seen.push(policies(g, i).await.ok());
        }
        let ok = |p: &Option<(Option<u64>, Option<u64>, Option<u64>)>| {
            p.is_some_and(|(s, l, t)| s == Some(sem) && t == Some(ttl) && (lead.is_none() || l == lead))
        };
        if seen.iter().all(ok) {
            let lead = lead.map_or(String::new(), |l| format!(", gatelead limit {l}"));
            return Ok(format!("every arbiter's /status shows gatesem limit {sem}{lead}, gatem ttl_s {ttl}"));
        }
        if tokio::time::Instant::now() >= end {
            bail!(
                "policy_change: the arbiters' /status do not show gatesem limit {sem}, gatelead limit {lead:?}, gatem ttl_s {ttl} (before: {before:?}; seen (gatesem, gatelead, gatem ttl) per arbiter: {seen:?}): the fault did not take effect"
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Restore plus shard move ([`FaultKind::RestoreMove`]).
async fn restore_move(g: &GateCluster, live: bool, start: u64) -> Result<()> {
    let name = FaultKind::RestoreMove.name();
    ensure!(g.shards.len() >= 2, "{name}: runs with shards only (GateOptions::shards)");
    let key = format!("{MUTEX_PREFIX}/0");
    let home = g.shard_map().await?.home("gatem", &key).context("the shard map homes no gate key")?.to_owned();
    let a = g.shards.iter().position(|s| s.name == home).context("the gate keys' home is no entity shard")?;
    let shard = &g.shards[a];
    let segments = shard.recorder.take().0.len();
    let snap = g.dir().join(format!("snap-{}-{}.db", shard.name, now_us()));
    shard.etcd.snapshot_save(&snap).await?;
    let base = snapshot_revision(&snap).await?;
    // The lost stretch: the holders keep going on the shard.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut moved, mut epochs, mut apply) = (None, None, String::new());
    if live {
        g.restore_shard(a, &snap, base).await?;
        // Right after the restore, before its epoch advance: the shard is sealed
        // (its arbiters' marks are ahead of it) and every gate key moves off it.
        moved = Some(g.rebalance().await?);
        epochs = Some(g.shard_epoch_advance(a).await?);
        apply = g.shard_apply_unchanged().await?;
    }
    // Took effect: the shard's recorder started a new segment (the restore), the
    // keys live elsewhere (the move), its epoch record advanced (the guarded
    // advance) and its home record is at the coord map's version.
    let after = shard.recorder.take().0.len();
    ensure!(after > segments, "{name}: {} recorded no new segment: no restore took effect", shard.name);
    let map = g.shard_map().await?;
    let now = map.home("gatem", &key).unwrap_or_default().to_owned();
    ensure!(now != home, "{name}: the gate keys are still homed on the restored {home}: no move took effect");
    let Some((e0, e1)) = epochs else { bail!("{name}: no epoch advance ran") };
    ensure!(e1 > e0, "{name}: the epoch record of {home} stayed at {e0}: the guarded advance did not take effect");
    let version = g.shard_record(a, "home").await?["current"]["version"].as_u64();
    ensure!(
        version == Some(map.version),
        "{name}: the home record of {home} is at version {version:?}, the coord map at {}",
        map.version
    );
    let outcome = apply.lines().rev().find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
    let outcome = outcome.as_ref().and_then(|v| v["outcome"].as_str()).unwrap_or("?").to_owned();
    g.note(
        name,
        format!(
            "{home} restored to revision {base} (store segment {after}), then {}/* moved {} -> {} (shard map v{}), epoch of {home} advanced {e0} -> {e1}, shard apply without a change: {outcome}; its home record at v{}",
            super::harness::GATE_NAMESPACE,
            moved.as_ref().map_or("?", |m| m.from.as_str()),
            moved.as_ref().map_or("?", |m| m.to.as_str()),
            map.version,
            map.version
        ),
        start,
    );
    Ok(())
}

/// A clock step with its took-effect probe ([`FaultKind::HolderClockStep`],
/// [`FaultKind::ArbiterClockStep`]): steps `clock` (unless planted inert), holds
/// it at least [`CLOCK_HOLD`] and until the process shows the step (4 s more at
/// most), steps it back unless kept, and records it. The probe: the faketime file
/// holds the step, and the process read it: a holder recorded an operation with
/// that skew, or an arbiter stamped its marks (`/status`, each second) or a hold
/// it granted with that offset. A process whose monotonic clock steps back may
/// show nothing while its timers stall: that alone is not a failure.
async fn step_clock_probed(g: &GateCluster, kind: &str, clock: &FakeClock, step: ClockStep, live: bool) -> Result<()> {
    let start = now_us();
    let want = clock.step_offset() + step.seconds();
    if live {
        clock.step(step)?;
    }
    let file =
        clock.env().into_iter().find(|(k, _)| k == "FAKETIME_TIMESTAMP_FILE").map(|(_, v)| v).unwrap_or_default();
    let held = std::fs::read_to_string(&file).ok().and_then(|s| s.trim().parse::<i64>().ok());
    let t = tokio::time::Instant::now();
    let most = if live { CLOCK_HOLD + Duration::from_secs(4) } else { Duration::from_secs(2) };
    let mut seen = None;
    loop {
        if seen.is_none() {
            seen = clock_seen(g, clock, want, start).await;
        }
        if (seen.is_some() && t.elapsed() >= CLOCK_HOLD) || t.elapsed() >= most {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (end, how) = if step.kept() || !live { (clock.step_offset(), "kept") } else { (clock.heal()?, "then back") };
    let label = clock.label();
    ensure!(
        held == Some(want),
        "{kind}: the faketime file of {label} holds {held:?}, not the step to {want:+} s: the fault did not take effect"
    );
    let stalls = clock.mode() == super::clock::ClockMode::WallAndMonotonic && step.seconds() < 0;
    let seen = match seen {
        Some(s) => s,
        None if stalls => "not seen while its timers stalled (monotonic clock stepped back)".to_owned(),
        None => {
            bail!("{kind}: {label} never showed its clock at {want:+} s in {most:?}: the fault did not take effect")
        }
    };
    g.note(
        kind,
        format!(
            "{label} ({} clock) stepped {:+} s, {how}; offset now {end:+} s; the file held {want:+} s; {seen}",
            clock.mode().name(),
            step.seconds()
        ),
        start,
    );
    Ok(())
}

/// Whether the process of `clock` shows an offset of `want` seconds since `since`
/// (unix µs, real): what it saw, if so.
async fn clock_seen(g: &GateCluster, clock: &FakeClock, want: i64, since: u64) -> Option<String> {
    let want_ms = want * 1000;
    let now_ms = i64::try_from(now_us() / 1000).ok()?;
    if let Some(h) = g.holders.iter().find(|h| h.clock.as_ref().is_some_and(|c| std::ptr::eq(c, clock))) {
        let ops = super::holder::read_ops(&h.out);
        let o = ops.iter().find(|o| o.call_us >= since && (o.skew_ms - want_ms).abs() <= 2000)?;
        return Some(format!("{} recorded a {} with a skew of {:+} ms", h.name, o.op, o.skew_ms));
    }
    let i = g.arbiter_clocks.iter().position(|c| c.as_ref().is_some_and(|c| std::ptr::eq(c, clock)))?;
    if let Ok((200, body)) = g.arbiters[i].admin_get("/status").await {
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        if let Some(skew) = v["marks"]["updated_ms"].as_i64().map(|u| u - now_ms) {
            if (skew - want_ms).abs() <= 2500 {
                return Some(format!("arbiter {i} stamped its marks {skew:+} ms off the real clock"));
            }
        }
    }
    // A hold it granted, unless another arbiter's clock is near the same offset.
    let others = g.arbiter_clocks.iter().flatten().filter(|c| !std::ptr::eq(*c, clock));
    if others.into_iter().any(|c| (c.step_offset() - want).abs() < 10) {
        return None;
    }
    let clusters = std::iter::once((None, g.etcd.endpoints()))
        .chain(g.shards.iter().enumerate().map(|(i, s)| (Some(i), s.etcd.endpoints())));
    for (pick, eps) in clusters {
        let Ok(login) = g.reader(pick) else { continue };
        let Ok(mut c) = login.connect(&eps).await else { continue };
        // Holds sit in slots `<root>/l/<digest>/h/<slot>`.
        let prefix = format!("{}/l/", g.root);
        let Ok(r) = c.get(prefix, Some(etcd_client::GetOptions::new().with_prefix())).await else { continue };
        for kv in r.kvs().iter().filter(|kv| String::from_utf8_lossy(kv.key()).contains("/h/")) {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(kv.value()) else { continue };
            let Some(skew) = v["acquired_ms"].as_i64().map(|a| a - now_ms) else { continue };
            if (want_ms - 8000..=want_ms + 1500).contains(&skew) {
                return Some(format!(
                    "a hold granted {skew:+} ms off the real clock (arbiter {i} alone is stepped so far)"
                ));
            }
        }
    }
    None
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
            assert!(v.contains(&FaultKind::RestoreMove) && !ALL.contains(&FaultKind::RestoreMove), "{v:?}");
            let short = random_rebalance(3);
            assert!(short.iter().filter(|k| **k == FaultKind::Rebalance).count() >= 2, "{short:?}");
        }
    }
}
