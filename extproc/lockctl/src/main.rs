//! `lockctl`: operator commands for lockmesh.
//!
//! - `lockctl epoch-advance`: the guarded epoch advance (seal, advance and delete
//!   restored holds, revoke restored sessions, unseal); resumable.
//! - `lockctl restore`: restore an etcd snapshot with a revision bump into each
//!   member's data directory, wait for the members to be started, then run the
//!   epoch advance. Safe to re-run after a crash at any step.
//! - `lockctl run KEY -- CMD ARGS...`: run a command under a lock, and `lockctl
//!   elect NAME -- CMD ARGS...`: run one only while leader of an election (the
//!   holder SDK's `lockmesh_client::run`).
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

/// The five most common tasks, in `lockctl --help`.
const EXAMPLES: &str = "\
Examples:
  # Who holds a key, and how long (digested locally; never the token):
  lockctl inspect payments/order-42 --endpoints https://etcd:2379 --root /lockmesh --etcd-ca ca.pem \\
    --etcd-user lockmesh-admin --etcd-password-file admin.pw

  # Run a command under a lock (waiting up to 30 s); it is stopped if the lock is lost,
  # and gets SIGUSR1 when the lock enters jeopardy or recovers (see $LOCKMESH_JEOPARDY_FILE):
  lockctl run payments/nightly-report --endpoint https://lock-tier:8443 --ca ca.pem --cert svid.pem \\
    --cert-key svid-key.pem --wait-ms 30000 --jeopardy-signal USR1 -- ./report.sh

  # Everything an operator must act on (seal, quorum, draining classes, etcd's size):
  lockctl doctor --endpoints https://etcd:2379 --etcd-ca ca.pem --admin-url http://arbiter:18052

  # Release a wedged holder's lock: two operators and a reason (LOCKMESH_ARBITER_URL,
  # LOCKMESH_ADMIN_TOKEN and the admin certificate set as in docs/ADMIN.md):
  lockctl admin request force-release payments/order-42 --reason 'INC-42: holder wedged'
  lockctl admin approve REQUEST_ID

  # Lower a class's limit on every cluster, resumably (re-run to resume):
  lockctl limit change --config arbiter.yaml --class pool --to 2 --reason 'capacity review'

Every command's --help explains it; docs/OPERATIONS.md, docs/CLASSES.md, docs/AUDIT.md and docs/ADMIN.md
are the runbooks. Shell completions: `lockctl completions bash|zsh|fish`; man pages: `lockctl man DIR`.";

/// lockmesh operator commands.
#[derive(Parser)]
#[command(
    name = "lockctl",
    version,
    about = "lockmesh operator commands: inspect a key, saturated keys by digest, class check and cost, \
             limit change/resume/cancel, two-person force release and epoch advance, restore, audit \
             queries, running a command under a lock, and doctor",
    after_help = EXAMPLES
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
    /// Class registry files: `check FILE`, `cost FILE`, `apply FILE` (one cluster, or
    /// every cluster of a split deployment with `--config`; docs/CLASSES.md).
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
    /// then SIGKILL after --grace-ms. While the lock is in jeopardy (a keepalive
    /// failed, the fence deadline not yet come) the file named by
    /// LOCKMESH_JEOPARDY_FILE exists (recovery removes it); --jeopardy-signal SIG
    /// also signals the command then and on recovery. Exits with the command's code.
    Run(lockmesh_client::run::RunArgs),
    /// Run a command only while leader of an election (like `etcdctl elect`):
    /// campaigns for NAME (until leader, or --wait-ms), runs the command with the
    /// leadership's token in its environment as `run` does, and resigns when it
    /// ends; when the leadership is lost the command gets SIGTERM, then SIGKILL
    /// after --grace-ms. --value is proclaimed with the leadership (observers see
    /// it). Exits with the command's code; 75 if not leader within --wait-ms.
    Elect(lockmesh_client::run::ElectArgs),
    /// Check everything an operator must act on: versions (lockctl, arbiters, etcd),
    /// seal, etcd members and quorum, draining classes, fenced classes without a
    /// passing pause test, advisory classes with expired waivers. Exit 0 healthy,
    /// 1 something is wrong, 64 bad arguments.
    Doctor(doctor::DoctorArgs),
    /// The keyspace version and capabilities: `status`, `enable CAP` (refused while
    /// a live arbiter lacks it), `disable CAP`. Exit 0 done, 1 etcd failed, 2
    /// refused, 3 this lockctl does not know the keyspace, 64 bad arguments.
    Upgrade(upgrade::UpgradeArgs),
    /// Print a shell completion script: `lockctl completions bash > /etc/bash_completion.d/lockctl`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write man pages (lockctl.1 and one per subcommand, lockctl-inspect.1, ...) into DIR.
    Man {
        /// The directory (created if missing), e.g. /usr/local/share/man/man1.
        dir: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match &cli.cmd {
        Cmd::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut cmd, "lockctl", &mut std::io::stdout());
            return ExitCode::SUCCESS;
        }
        Cmd::Man { dir } => return man(dir),
        _ => {}
    }
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockctl: {e}");
            return ExitCode::from(1);
        }
    };
    // Each subcommand decides its own exit codes (`class` and `limit` have
    // several; `run` exits with its command's code, see lockmesh_client::run).
    let code = rt.block_on(async {
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
            Cmd::Elect(args) => ExitCode::from(lockmesh_client::run::elect_main(args.clone()).await),
            Cmd::EpochAdvance(a) => restore::epoch_advance(a).await,
            Cmd::Restore(r) => restore::main(r).await,
            Cmd::Completions { .. } | Cmd::Man { .. } => ExitCode::SUCCESS,
        }
    });
    // Said, not hidden: an operator (and the test suite) can tell that etcd's
    // users or roles changed while the command ran.
    let retried = lockmesh_ops::etcd_retry::auth_retries();
    if retried > 0 {
        eprintln!(
            "lockctl: etcd refused {retried} request(s) because its users or roles changed under this login \
             (nothing of them was applied); logged in again and sent them again"
        );
    }
    code
}

/// `lockctl man DIR`: the man pages of lockctl and of every subcommand.
fn man(dir: &std::path::Path) -> ExitCode {
    let cmd = <Cli as clap::CommandFactory>::command();
    let r = std::fs::create_dir_all(dir).and_then(|()| clap_mangen::generate_to(cmd, dir));
    match r {
        Ok(()) => {
            println!("man pages written to {}", dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lockctl man: {}: {e}", dir.display());
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_is_consistent_and_its_completions_and_man_pages_name_every_subcommand() {
        Cli::command().debug_assert();
        let mut out = Vec::new();
        clap_complete::generate(clap_complete::Shell::Bash, &mut Cli::command(), "lockctl", &mut out);
        let bash = String::from_utf8(out).unwrap();
        let dir = std::env::temp_dir().join(format!("lockctl-man-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        clap_mangen::generate_to(Cli::command(), &dir).unwrap();
        for sub in Cli::command().get_subcommands().map(|c| c.get_name().to_owned()) {
            assert!(bash.contains(&sub), "bash completion lacks {sub}");
            let page = dir.join(format!("lockctl-{sub}.1"));
            assert!(page.exists(), "no man page {}", page.display());
        }
        let top = std::fs::read_to_string(dir.join("lockctl.1")).unwrap();
        assert!(top.contains(".TH lockctl") && top.contains("force\\-release"), "{top}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Each example of `lockctl --help`, split as a shell would (single quotes,
    /// `\\` continuations).
    fn examples() -> Vec<Vec<String>> {
        split_examples(EXAMPLES)
    }

    /// The `lockctl ...` lines of a help text, split as a shell would.
    fn split_examples(text: &str) -> Vec<Vec<String>> {
        let joined = text.replace("\\\n", " ");
        joined
            .lines()
            .filter_map(|l| l.trim().strip_prefix("lockctl "))
            .map(|l| {
                let (mut words, mut cur, mut quoted) = (vec!["lockctl".to_owned()], String::new(), false);
                for c in l.chars() {
                    match c {
                        '\'' => quoted = !quoted,
                        ' ' if !quoted => {
                            if !cur.is_empty() {
                                words.push(std::mem::take(&mut cur));
                            }
                        }
                        c => cur.push(c),
                    }
                }
                if !cur.is_empty() {
                    words.push(cur);
                }
                words
            })
            .collect()
    }

    #[test]
    fn the_class_apply_examples_parse() {
        let cmd = Cli::command();
        let apply = cmd.find_subcommand("class").and_then(|c| c.find_subcommand("apply")).unwrap();
        let ex = split_examples(&apply.get_after_help().unwrap().to_string());
        assert_eq!(ex.len(), 2, "{ex:?}");
        for words in ex {
            if let Err(e) = Cli::try_parse_from(&words) {
                panic!("{words:?}: {e}");
            }
        }
        // --config and --endpoints name different deployments: not both.
        let both = ["lockctl", "class", "apply", "r.yaml", "--config", "a.yaml", "--endpoints", "http://e:2379"];
        assert!(Cli::try_parse_from(both).is_err());
    }

    #[test]
    fn every_help_example_parses() {
        let ex = examples();
        assert_eq!(ex.len(), 6, "{ex:?}");
        for mut words in ex {
            if words[1] == "admin" {
                // The examples take the operator's token from LOCKMESH_ADMIN_TOKEN.
                words.extend(["--token".to_owned(), "t".to_owned()]);
            }
            if let Err(e) = Cli::try_parse_from(&words) {
                panic!("{words:?}: {e}");
            }
        }
    }
}
