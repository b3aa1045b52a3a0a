//! `lockctl epoch-advance` and `lockctl restore`: the guarded epoch advance (seal,
//! advance and delete restored holds, revoke restored sessions, unseal; resumable),
//! and restoring an etcd snapshot with a revision bump into each member's data
//! directory, waiting for the members, then the advance. Safe to re-run after a
//! crash at any step; the runbook is docs/OPERATIONS.md.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Args;
use lockmesh_ops::etcd_retry::retry_auth;
use lockmesh_ops::restore::{self, Member, RestoreError, Target};

use crate::admin::EtcdArgs;

#[derive(Args)]
pub struct Advance {
    /// etcd (endpoints, root, TLS and user: the break-glass `lockmesh-admin-epoch`
    /// role, `lockctl etcd-roles`).
    #[command(flatten)]
    etcd: EtcdArgs,
    /// The epoch you believe is current; the advance is refused if it is not.
    #[arg(long)]
    expected_epoch: u64,
    /// The new epoch. Without it, one above the highest epoch in the --marks files.
    #[arg(long, conflicts_with = "epochs_from")]
    new_epoch: Option<u64>,
    /// A split deployment: the arbiter config (its `etcd:` names the coord
    /// cluster). The new epoch is allocated from the coord cluster's epoch counter,
    /// above --expected-epoch, the --marks files and every epoch any cluster was
    /// given, so an advanced or restored shard never shares an epoch with another
    /// cluster (docs/SCALE.md). --endpoints still names the cluster advanced.
    #[arg(long)]
    epochs_from: Option<PathBuf>,
    /// Arbiter marks files (their `marks_file`), to take the new epoch from.
    #[arg(long)]
    marks: Vec<PathBuf>,
}

#[derive(Args)]
pub struct Restore {
    /// The etcd snapshot file.
    #[arg(long)]
    snapshot: PathBuf,
    /// A member to restore: NAME=DATA_DIR=PEER_URL (repeat for each member).
    #[arg(long = "member", required = true)]
    members: Vec<String>,
    /// --initial-cluster-token of the restored cluster.
    #[arg(long)]
    initial_cluster_token: String,
    /// Revision bump (etcdutl --bump-revision).
    #[arg(long, default_value_t = restore::DEFAULT_BUMP)]
    bump_revision: u64,
    /// The etcdutl binary.
    #[arg(long, default_value = "etcdutl")]
    etcdutl: PathBuf,
    /// How long to wait for the restored members to answer.
    #[arg(long, default_value_t = 600)]
    wait_timeout_s: u64,
    #[command(flatten)]
    advance: Advance,
}

/// `lockctl epoch-advance`.
pub async fn epoch_advance(a: &Advance) -> ExitCode {
    exit(advance(a, &mut std::io::stdout()).await)
}

/// `lockctl restore`.
pub async fn main(r: &Restore) -> ExitCode {
    exit(restore_snapshot(r).await)
}

async fn restore_snapshot(r: &Restore) -> Result<(), RestoreError> {
    let mut out = std::io::stdout();
    let members = r.members.iter().map(|m| parse_member(m)).collect::<Result<Vec<_>, _>>()?;
    // The flags are checked before etcdutl writes anything.
    let conn = r.advance.etcd.connection().map_err(RestoreError::Other)?;
    let target = target_of(&r.advance).await?;
    println!("restore: new epoch will be {}", target.epoch());
    restore::restore_snapshot(&r.etcdutl, &r.snapshot, &members, &r.initial_cluster_token, r.bump_revision, &mut out)?;
    let mut c =
        restore::wait_for_etcd(&conn, &r.advance.etcd.root, Duration::from_secs(r.wait_timeout_s), &mut out).await?;
    restore::advance(&mut c, &r.advance.etcd.root, r.advance.expected_epoch, target, &mut out).await
}

/// Exit 64 for what the operator must change (no target, a target too low, the
/// epochs exhausted), 1 for a runtime failure.
fn exit(r: Result<(), RestoreError>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ (RestoreError::NoTarget | RestoreError::TargetTooLow { .. } | RestoreError::EpochExhausted(_))) => {
            eprintln!("lockctl: {e}");
            ExitCode::from(64)
        }
        Err(e) => {
            eprintln!("lockctl: {e}");
            ExitCode::from(1)
        }
    }
}

/// The new epoch: the operator's `--new-epoch`, or one lockctl chooses (each
/// run anew; a resumed advance keeps the epoch an earlier run took, see
/// [`Target::Chosen`]).
async fn target_of(a: &Advance) -> Result<Target, RestoreError> {
    let marks: Vec<&std::path::Path> = a.marks.iter().map(PathBuf::as_path).collect();
    let Some(config) = &a.epochs_from else {
        let e = restore::choose_epoch(a.expected_epoch, a.new_epoch, &marks)?;
        return Ok(if a.new_epoch.is_some() { Target::Given(e) } else { Target::Chosen(e) });
    };
    let floor = restore::epoch_floor(a.expected_epoch, &marks)?;
    let clusters = lockmesh_lock::clusters::Clusters::load_arbiter_file(config)
        .map_err(|e| RestoreError::Other(format!("--epochs-from: {}", e.join("; "))))?;
    lockmesh_lock::test_faults::install(&clusters.test_faults);
    let tiers = clusters.connect().await.map_err(|e| RestoreError::Other(format!("--epochs-from: {e}")))?;
    let coord = tiers.coord();
    // A refused allocation applied nothing (`retry_auth`): it is asked again.
    match retry_auth(&coord.cluster().client(), move |_| coord.home().allocate_epoch_above(floor)).await {
        // PLANTED BUG (scale scenario) when on: the allocated epoch taken as given.
        Ok(e) if lockmesh_lock::test_faults::on(lockmesh_lock::test_faults::TestFault::AdvanceEpochAsGiven) => {
            Ok(Target::Given(e))
        }
        Ok(e) => Ok(Target::Chosen(e)),
        Err(lockmesh_lock::LockError::Sealed(_)) => Err(RestoreError::EpochExhausted(floor + 1)),
        Err(e) => Err(RestoreError::Other(format!("--epochs-from: the coord epoch counter: {e}"))),
    }
}

async fn advance(a: &Advance, out: &mut std::io::Stdout) -> Result<(), RestoreError> {
    let conn = a.etcd.connection().map_err(RestoreError::Other)?;
    let target = target_of(a).await?;
    let mut c = restore::wait_for_etcd(&conn, &a.etcd.root, Duration::from_secs(30), out).await?;
    restore::advance(&mut c, &a.etcd.root, a.expected_epoch, target, out).await
}

fn parse_member(s: &str) -> Result<Member, RestoreError> {
    let mut parts = s.splitn(3, '=');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(name), Some(dir), Some(peer)) if !name.is_empty() && !dir.is_empty() && peer.starts_with("http") => {
            Ok(Member { name: name.into(), data_dir: dir.into(), peer_url: peer.into() })
        }
        _ => Err(RestoreError::Other(format!("--member {s:?}: expected NAME=DATA_DIR=PEER_URL"))),
    }
}
