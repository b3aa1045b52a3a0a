//! `lockctl class` and `lockctl limit` (docs/CLASSES.md).
//!
//! - `class check FILE`: validates a registry file offline with the arbiter's own
//!   loader; prints every error with its field path (exit 64) or `OK` and any
//!   warnings (expired waivers).
//! - `class cost FILE`: per class, the keepalive load and the liveness bound of
//!   its TTL (ADR-11), for the review of a class change.
//! - `class apply FILE --endpoints .. --root ..`: makes the file's prefix map
//!   authoritative through the drain discipline ([`lockmesh_ops::reconcile`]'s
//!   `apply`): exit 0 applied, unchanged or cancelled; 2 still draining (`held`
//!   or `verification_incomplete`: re-run to resume, or `--cancel`); 3 refused; 1
//!   etcd or conflict; 64 invalid file.
//! - `limit change|resume|cancel|show`: the limit-change protocol on the
//!   authoritative policy records ([`lockmesh_ops::reconcile`]). Each prints one JSON
//!   line. Exit 0: raised, activated, cancelled or shown; 2: still draining
//!   (`over_target` or `verification_incomplete`, resume or cancel later with the
//!   printed `change_epoch` and `pending_target`); 3: refused by the protocol
//!   (stale, change pending, no change), nothing changed; 1: etcd or conflict.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Subcommand};
use lockmesh_core::class::cost::{self, CostInput, DEFAULT_ELECTION_TIMEOUT_MS};

use lockmesh_ops::reconcile::{Admin, AdminError, ApplyOutcome, Outcome};

use crate::admin::EtcdArgs;

/// `lockctl class ...`.
#[derive(Subcommand, Debug)]
pub enum ClassCmd {
    /// Validate a registry file offline (the arbiter's loader).
    Check {
        /// The registry YAML.
        file: PathBuf,
    },
    /// Print keepalive load and liveness bound per class (ADR-11).
    Cost {
        /// The registry YAML.
        file: PathBuf,
        /// Live sessions per class to plan for.
        #[arg(long, default_value_t = 1000)]
        sessions: u64,
        /// Leader changes to assume during one expiry.
        #[arg(long, default_value_t = 1)]
        leader_changes: u32,
        /// etcd's election timeout, ms.
        #[arg(long, default_value_t = DEFAULT_ELECTION_TIMEOUT_MS)]
        election_timeout_ms: u64,
        /// Only this class.
        #[arg(long)]
        class: Option<String>,
    },
    /// Make the file's prefix-to-class map authoritative (drain, verify, apply).
    Apply {
        /// The registry YAML.
        file: PathBuf,
        /// etcd (endpoints, root, TLS and user: the `lockmesh-classes` role).
        #[command(flatten)]
        etcd: EtcdArgs,
        /// Who asks (recorded with the change).
        #[arg(long, default_value = "lockctl")]
        actor: String,
        /// Why (recorded with the change).
        #[arg(long, default_value = "")]
        reason: String,
        /// Bound of the verification scan, ms (then `verification_incomplete`).
        #[arg(long, default_value_t = 10_000)]
        verify_timeout_ms: u64,
        /// Reopen the classes a pending apply drained, keeping the old map.
        #[arg(long)]
        cancel: bool,
    },
}

/// Where the policy records are, and who acts.
#[derive(Args, Debug)]
pub struct Target {
    /// etcd (endpoints, root, TLS and user: `lockmesh-classes` for change, resume
    /// and cancel; `show` reads, so `lockmesh-admin` is enough).
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The class.
    #[arg(long)]
    pub class: String,
    /// Who asks (recorded with the change).
    #[arg(long, default_value = "lockctl")]
    pub actor: String,
    /// Why (recorded with the change).
    #[arg(long, default_value = "")]
    pub reason: String,
    /// Bound of the verification scan, ms (then `verification_incomplete`).
    #[arg(long, default_value_t = 10_000)]
    pub verify_timeout_ms: u64,
}

/// `lockctl limit ...`.
#[derive(Subcommand, Debug)]
pub enum LimitCmd {
    /// Raise (immediate) or lower (drain, verify, activate-or-refuse) a limit.
    Change {
        #[command(flatten)]
        target: Target,
        /// The new limit.
        #[arg(long)]
        to: u32,
    },
    /// Resume the pending lowering (re-verify, activate-or-refuse).
    Resume {
        #[command(flatten)]
        target: Target,
        /// The pending change's epoch (printed by `change`).
        #[arg(long)]
        epoch: u64,
        /// The pending change's target.
        #[arg(long = "to")]
        to: u32,
    },
    /// Cancel the pending lowering: the old limit, active again.
    Cancel {
        #[command(flatten)]
        target: Target,
        /// The pending change's epoch.
        #[arg(long)]
        epoch: u64,
        /// The pending change's target.
        #[arg(long = "to")]
        to: u32,
    },
    /// Print the policy record.
    Show {
        #[command(flatten)]
        target: Target,
    },
}

/// Runs `lockctl class ...`.
pub async fn class(cmd: &ClassCmd) -> ExitCode {
    let (file, cost_args) = match cmd {
        ClassCmd::Apply { file, .. } => return apply(cmd, file).await,
        ClassCmd::Check { file } => (file, None),
        ClassCmd::Cost { file, sessions, leader_changes, election_timeout_ms, class } => {
            let input = CostInput {
                sessions: *sessions,
                leader_changes: *leader_changes,
                election_timeout_ms: *election_timeout_ms,
            };
            (file, Some((input, class.clone())))
        }
    };
    let reg = match lockmesh_lock::registry::load(file) {
        Ok(r) => r,
        Err(errs) => {
            eprintln!("invalid registry ({} errors):", errs.len());
            for e in errs {
                eprintln!("  {e}");
            }
            return ExitCode::from(64);
        }
    };
    match cost_args {
        None => {
            println!("{}: OK ({} classes)", file.display(), reg.classes().len());
            for w in reg.warnings(lockmesh_lock::registry::today()) {
                println!("  warning: {}: {w}", file.display());
            }
        }
        Some((input, only)) => {
            for c in reg.classes().iter().filter(|c| only.as_deref().is_none_or(|o| o == c.name.as_str())) {
                print!("{}", cost::render(c, &input));
            }
        }
    }
    ExitCode::SUCCESS
}

async fn apply(cmd: &ClassCmd, file: &std::path::Path) -> ExitCode {
    let ClassCmd::Apply { etcd, actor, reason, verify_timeout_ms, cancel, .. } = cmd else {
        return ExitCode::from(64);
    };
    let reg = match lockmesh_lock::registry::load(file) {
        Ok(r) => r,
        Err(errs) => {
            for e in errs {
                eprintln!("  {e}");
            }
            return ExitCode::from(64);
        }
    };
    let admin = match connect(etcd, actor).await {
        Ok(a) => a,
        Err(code) => return code,
    };
    match admin.apply_map(&reg, reason, Duration::from_millis(*verify_timeout_ms), *cancel).await {
        Ok(o) => {
            println!("{}", serde_json::to_string(&o).unwrap_or_default());
            match o {
                ApplyOutcome::Held { .. } | ApplyOutcome::VerificationIncomplete { .. } => ExitCode::from(2),
                _ => ExitCode::SUCCESS,
            }
        }
        Err(e) => fail(&e),
    }
}

/// Runs `lockctl limit ...`.
pub async fn limit(cmd: &LimitCmd) -> ExitCode {
    let t = match cmd {
        LimitCmd::Change { target, .. }
        | LimitCmd::Resume { target, .. }
        | LimitCmd::Cancel { target, .. }
        | LimitCmd::Show { target } => target,
    };
    let admin = match connect(&t.etcd, &t.actor).await {
        Ok(a) => a,
        Err(code) => return code,
    };
    let timeout = Duration::from_millis(t.verify_timeout_ms);
    let r = match cmd {
        LimitCmd::Change { to, .. } => admin.change(&t.class, *to, &t.reason, timeout).await,
        LimitCmd::Resume { epoch, to, .. } => admin.resume(&t.class, *epoch, *to, &t.reason, timeout).await,
        LimitCmd::Cancel { epoch, to, .. } => admin.cancel(&t.class, *epoch, *to, &t.reason).await,
        LimitCmd::Show { .. } => {
            return match admin.read(&t.class).await {
                Ok((p, _)) => {
                    println!("{}", serde_json::to_string(&p).unwrap_or_default());
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            };
        }
    };
    match r {
        Ok(o) => {
            println!("{}", serde_json::to_string(&o).unwrap_or_default());
            match o {
                Outcome::OverTarget { .. } | Outcome::VerificationIncomplete { .. } => ExitCode::from(2),
                _ => ExitCode::SUCCESS,
            }
        }
        Err(e) => fail(&e),
    }
}

/// The policy records' handle: exit 64 for flags that do not validate, 1 when etcd
/// cannot be reached.
async fn connect(etcd: &EtcdArgs, actor: &str) -> Result<Admin, ExitCode> {
    let conn = etcd.connection().map_err(|e| {
        eprintln!("lockctl: {e}");
        ExitCode::from(64)
    })?;
    Admin::connect(&conn, &etcd.root, actor).await.map_err(|e| fail(&e))
}

fn fail(e: &AdminError) -> ExitCode {
    eprintln!("lockctl: {e}");
    match e {
        AdminError::Refused(_) => ExitCode::from(3),
        _ => ExitCode::from(1),
    }
}
