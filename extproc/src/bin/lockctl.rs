//! `lockctl`: operator commands for lockmesh.
//!
//! - `lockctl epoch-advance`: the guarded epoch advance (seal, advance and delete
//!   restored holds, revoke restored sessions, unseal); resumable.
//! - `lockctl restore`: restore an etcd snapshot with a revision bump into each
//!   member's data directory, wait for the members to be started, then run the
//!   epoch advance. Safe to re-run after a crash at any step.
//! - `lockctl run KEY -- CMD ARGS...`: run a command under a lock (the holder
//!   SDK's `lockmesh_client::run`).
//!
//! - `lockctl class check|cost FILE`, `lockctl limit change|resume|cancel|show`:
//!   class registries and limit changes (`docs/CLASSES.md`).
//! - `lockctl inspect KEY`, `lockctl saturated`, `lockctl doctor`: read-only views
//!   of a key, of the keys at their limit (by digest) and of everything an
//!   operator must act on (`docs/OPERATIONS.md`).
//!
//! The restore runbook is `docs/OPERATIONS.md`.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand};
use lockmesh_extproc::restore::{self, Member, RestoreError};

/// lockmesh operator commands.
#[derive(Parser)]
#[command(
    version,
    about = "lockmesh operator commands: inspect a key, saturated keys by digest, class check and cost, \
             limit change/resume/cancel, two-person force release and epoch advance, restore, audit \
             queries, running a command under a lock, and doctor",
    after_help = "Every command's --help explains it; docs/OPERATIONS.md, docs/CLASSES.md, docs/AUDIT.md \
                  and docs/ADMIN.md are the runbooks."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// A key's holders (identity, session, epoch, age), authoritative class, limit
    /// and state; with --admin-url and an operator token, its waiters.
    Inspect(lockmesh_extproc::inspect::cli::InspectArgs),
    /// The keys at their class's authoritative limit, by digest, fullest and
    /// oldest first (one scan of every open hold).
    Saturated(lockmesh_extproc::inspect::cli::SaturatedArgs),
    /// Class registry files: `check FILE`, `cost FILE`, `apply FILE` (docs/CLASSES.md).
    #[command(subcommand)]
    Class(lockmesh_extproc::classctl::ClassCmd),
    /// Class limits: `change`, `resume`, `cancel`, `show` (docs/CLASSES.md).
    #[command(subcommand)]
    Limit(lockmesh_extproc::classctl::LimitCmd),
    /// The shard map and fenced moves: `show`, `apply`, `cancel` (docs/SCALE.md).
    Shard(lockmesh_extproc::shardctl::ShardArgs),
    /// Two-person admin actions: `request force-release KEY|epoch-advance`,
    /// `approve ID`, `show ID`, `list` (docs/ADMIN.md).
    Admin(lockmesh_extproc::admin_action::cli::AdminArgs),
    /// Advance the epoch: seal, advance (deleting restored holds and waiters),
    /// revoke restored sessions, unseal. Refused if --expected-epoch is stale.
    EpochAdvance(Advance),
    /// Restore a snapshot (with a revision bump) into every member's data
    /// directory, wait for etcd, then advance the epoch.
    Restore(Restore),
    /// Audit queries: `history KEY`, `by-identity ID --since --until`, `longest`,
    /// `expiries`, `events KIND`, `recent` (docs/AUDIT.md).
    Audit(lockmesh_extproc::audit::cli::AuditArgs),
    /// Print the etcdctl commands that create lockmesh's etcd roles and users
    /// (least privilege per component, docs/ADMIN.md) and enable auth.
    EtcdRoles {
        /// lockmesh key root.
        #[arg(long, default_value = "/lockmesh")]
        root: String,
    },
    /// Run a command while holding a lock (like `etcdctl lock`): the token is in
    /// its environment (LOCKMESH_TOKEN...); when the lock is lost it gets SIGTERM,
    /// then SIGKILL after --grace-ms. Exits with the command's code.
    Run(lockmesh_client::run::RunArgs),
    /// Check everything an operator must act on: versions (lockctl, arbiters, etcd),
    /// seal, etcd members and quorum, draining classes, fenced classes without a
    /// passing pause test, advisory classes with expired waivers. Exit 0 healthy,
    /// 1 something is wrong, 64 bad arguments.
    Doctor(lockmesh_extproc::doctor::DoctorArgs),
}

#[derive(Args)]
struct Advance {
    /// etcd client URLs, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    endpoints: Vec<String>,
    /// lockmesh key root, e.g. /lockmesh.
    #[arg(long)]
    root: String,
    /// The epoch you believe is current; the advance is refused if it is not.
    #[arg(long)]
    expected_epoch: u64,
    /// The new epoch. Without it, one above the highest epoch in the --marks files.
    #[arg(long)]
    new_epoch: Option<u64>,
    /// Arbiter marks files (their `marks_file`), to take the new epoch from.
    #[arg(long)]
    marks: Vec<PathBuf>,
}

#[derive(Args)]
struct Restore {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockctl: {e}");
            return ExitCode::from(1);
        }
    };
    // `class` and `limit` have their own exit codes (lockmesh_extproc::classctl).
    match &cli.cmd {
        Cmd::Class(c) => return rt.block_on(lockmesh_extproc::classctl::class(c)),
        Cmd::Limit(l) => return rt.block_on(lockmesh_extproc::classctl::limit(l)),
        Cmd::Shard(s) => return rt.block_on(lockmesh_extproc::shardctl::main(s)),
        Cmd::Audit(a) => return rt.block_on(lockmesh_extproc::audit::cli::main(a)),
        Cmd::Admin(a) => return rt.block_on(lockmesh_extproc::admin_action::cli::main(a)),
        Cmd::Inspect(a) => return rt.block_on(lockmesh_extproc::inspect::cli::inspect(a)),
        Cmd::Saturated(a) => return rt.block_on(lockmesh_extproc::inspect::cli::saturated_main(a)),
        Cmd::Doctor(a) => return rt.block_on(lockmesh_extproc::doctor::main(a)),
        Cmd::EtcdRoles { root } => {
            print!("{}", lockmesh_extproc::admin_action::etcd_roles::etcdctl_script(root));
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    // `run` exits with its command's code (see lockmesh_client::run).
    let cmd = match cli.cmd {
        Cmd::Run(args) => return ExitCode::from(rt.block_on(lockmesh_client::run::main(args))),
        cmd => cmd,
    };
    let mut out = std::io::stdout();
    let result = rt.block_on(async {
        match cmd {
            Cmd::Run(_) => Ok(()), // answered above
            // answered above
            Cmd::Class(_)
            | Cmd::Limit(_)
            | Cmd::Shard(_)
            | Cmd::Audit(_)
            | Cmd::Admin(_)
            | Cmd::EtcdRoles { .. }
            | Cmd::Inspect(_)
            | Cmd::Saturated(_)
            | Cmd::Doctor(_) => Ok(()),
            Cmd::EpochAdvance(a) => advance(&a, &mut out).await,
            Cmd::Restore(r) => {
                let members = r.members.iter().map(|m| parse_member(m)).collect::<Result<Vec<_>, _>>()?;
                let target = target_of(&r.advance)?;
                println!("restore: new epoch will be {target}");
                restore::restore_snapshot(
                    &r.etcdutl,
                    &r.snapshot,
                    &members,
                    &r.initial_cluster_token,
                    r.bump_revision,
                    &mut out,
                )?;
                let mut c =
                    restore::wait_for_etcd(&r.advance.endpoints, Duration::from_secs(r.wait_timeout_s), &mut out)
                        .await?;
                restore::advance(&mut c, &r.advance.root, r.advance.expected_epoch, target, &mut out).await
            }
        }
    });
    match result {
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

fn target_of(a: &Advance) -> Result<u64, RestoreError> {
    let marks: Vec<&std::path::Path> = a.marks.iter().map(PathBuf::as_path).collect();
    restore::choose_epoch(a.expected_epoch, a.new_epoch, &marks)
}

async fn advance(a: &Advance, out: &mut std::io::Stdout) -> Result<(), RestoreError> {
    let target = target_of(a)?;
    let mut c = restore::wait_for_etcd(&a.endpoints, Duration::from_secs(30), out).await?;
    restore::advance(&mut c, &a.root, a.expected_epoch, target, out).await
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
