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
//! - `lockctl upgrade status|enable CAP|disable CAP`: the keyspace version and its
//!   capabilities, enabled by a flip guarded on every live arbiter (issue #19).
//!
//! One file per subcommand; the workflows behind them are `lockmesh-ops` (and, for
//! shard moves, `lockmesh-lock`). The restore runbook is `docs/OPERATIONS.md`.

mod admin;
mod audit;
mod class;
mod doctor;
mod inspect;
mod restore;
mod shard;
mod upgrade;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    Inspect(inspect::InspectArgs),
    /// The keys at their class's authoritative limit, by digest, fullest and
    /// oldest first (one scan of every open hold).
    Saturated(inspect::SaturatedArgs),
    /// Class registry files: `check FILE`, `cost FILE`, `apply FILE` (docs/CLASSES.md).
    #[command(subcommand)]
    Class(class::ClassCmd),
    /// Class limits: `change`, `resume`, `cancel`, `show` (docs/CLASSES.md).
    #[command(subcommand)]
    Limit(class::LimitCmd),
    /// The shard map and fenced moves: `show`, `apply`, `cancel` (docs/SCALE.md).
    Shard(shard::ShardArgs),
    /// Two-person admin actions: `request force-release KEY|epoch-advance`,
    /// `approve ID`, `show ID`, `list` (docs/ADMIN.md).
    Admin(admin::AdminArgs),
    /// Advance the epoch: seal, advance (deleting restored holds and waiters),
    /// revoke restored sessions, unseal. Refused if --expected-epoch is stale.
    EpochAdvance(restore::Advance),
    /// Restore a snapshot (with a revision bump) into every member's data
    /// directory, wait for etcd, then advance the epoch.
    Restore(restore::Restore),
    /// Audit queries: `history KEY`, `by-identity ID --since --until`, `longest`,
    /// `expiries`, `events KIND`, `recent` (docs/AUDIT.md).
    Audit(audit::AuditArgs),
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
    Doctor(doctor::DoctorArgs),
    /// The keyspace version and capabilities: `status`, `enable CAP` (refused while
    /// a live arbiter lacks it), `disable CAP`. Exit 0 done, 1 etcd failed, 2
    /// refused, 3 this lockctl does not know the keyspace, 64 bad arguments.
    Upgrade(upgrade::UpgradeArgs),
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
    // Each subcommand decides its own exit codes (`class` and `limit` have
    // several; `run` exits with its command's code, see lockmesh_client::run).
    rt.block_on(async {
        match &cli.cmd {
            Cmd::Class(c) => class::class(c).await,
            Cmd::Limit(l) => class::limit(l).await,
            Cmd::Shard(s) => shard::main(s).await,
            Cmd::Audit(a) => audit::main(a).await,
            Cmd::Admin(a) => admin::main(a).await,
            Cmd::Inspect(a) => inspect::inspect(a).await,
            Cmd::Saturated(a) => inspect::saturated_main(a).await,
            Cmd::Doctor(a) => doctor::main(a).await,
            Cmd::Upgrade(a) => upgrade::main(a).await,
            Cmd::EtcdRoles { root } => {
                print!("{}", lockmesh_ops::admin::etcd_roles::etcdctl_script(root));
                ExitCode::SUCCESS
            }
            Cmd::Run(args) => ExitCode::from(lockmesh_client::run::main(args.clone()).await),
            Cmd::EpochAdvance(a) => restore::epoch_advance(a).await,
            Cmd::Restore(r) => restore::main(r).await,
        }
    })
}
