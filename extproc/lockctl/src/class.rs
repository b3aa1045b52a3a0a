//! `lockctl class` and `lockctl limit` (docs/CLASSES.md).
//!
//! - `class check FILE`: validates a registry file offline with the arbiter's own
//!   loader; prints every error with its field path (exit 64; a TTL refused at a
//!   floor says why the floor matters) or `OK`, the TTL limits in force and why
//!   each matters, a note for each class whose TTL sits at a floor (or below an
//!   ADR-11 default floor the registry lowered) saying why that floor matters,
//!   and any warnings (expired waivers, floors lowered below the ADR-11 defaults).
//!
//! Every FILE argument may also be a directory of LockClass/LockGrant manifests
//! (the arbiter's `registry_dir`, `lockmesh_registry::crd::manifests`),
//! checked under the ADR-11 default TTL limits (manifests carry no `platform:`;
//! the arbiter's `registry_platform` can lower them).
//! - `class crds [FILE] [--out DIR]`: the LockClass and LockGrant CRDs for the
//!   TTL limits of FILE's `platform:` section (the defaults without FILE, which
//!   is what deploy/crds ships), to stdout or as DIR/lockclass.yaml and
//!   DIR/lockgrant.yaml: a deployment that lowers a floor installs these.
//! - `class cost FILE`: per class, the keepalive load and the liveness bound of
//!   its TTL (ADR-11), for the review of a class change. With `--endpoints`:
//!   instead, each namespace's live sessions and holds on that cluster against
//!   FILE's quotas (`--json`: a `QuotaReport`), flagged at 80 %.
//! - `class apply FILE --endpoints .. --root ..`: makes the file's prefix map
//!   authoritative through the drain discipline ([`lockmesh_ops::reconcile`]'s
//!   `apply`): exit 0 applied, unchanged or cancelled; 2 still draining (`held`
//!   or `verification_incomplete`: re-run to resume, or `--cancel`); 3 refused (a
//!   change that moves keys between the coord and the entity tier of a split
//!   deployment, nothing written); 1 etcd or conflict; 64 invalid file. With
//!   `--config arbiter.yaml` it runs on every cluster of the config, each on its
//!   own map and records ([`fleet`]): one line with each cluster's outcome,
//!   the worst step's exit code; re-running resumes, `--cancel` cancels everywhere.
//! - `limit change|resume|cancel|show`: the limit-change protocol on the
//!   authoritative policy records ([`lockmesh_ops::reconcile`]). Each prints one JSON
//!   line. With `--config arbiter.yaml` (a split deployment) the command runs on
//!   every cluster of the config ([`fleet_limit`]): one line with each cluster's
//!   outcome; `change` re-run with the same `--to` resumes where it stopped. Exit 0: raised, activated, cancelled or shown; 2: still draining
//!   (`over_target` or `verification_incomplete`, resume or cancel later with the
//!   printed `change_epoch` and `pending_target`); 3: refused by the protocol
//!   (stale, change pending, no change), nothing changed; 1: etcd or conflict.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use clap::{Args, Subcommand};
use lockmesh_core::class::{
    cost::{self, CostInput, DEFAULT_ELECTION_TIMEOUT_MS},
    Platform, PLATFORM_DEFAULT_TTL_S, WHY_ADVISORY_MIN_TTL, WHY_MAX_TTL, WHY_MIN_TTL,
};
use lockmesh_core::ClassRegistry;
use lockmesh_registry::crd;

use lockmesh_ops::etcd_retry::retry_auth;
use lockmesh_ops::reconcile::{Admin, AdminError, ApplyOutcome, Outcome};

use crate::admin::EtcdArgs;

/// `lockctl class ...`.
#[derive(Subcommand, Debug)]
pub enum ClassCmd {
    /// Validate a registry file offline (the arbiter's loader).
    Check {
        /// The registry YAML, or a directory of LockClass/LockGrant manifests.
        file: PathBuf,
    },
    /// Print the LockClass/LockGrant CRDs for a registry's TTL limits.
    Crds {
        /// The registry YAML (validated first); without it, the default limits.
        file: Option<PathBuf>,
        /// Write lockclass.yaml and lockgrant.yaml here instead of printing them.
        #[arg(long)]
        out: Option<PathBuf>,
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
        /// With --endpoints: also each namespace's live sessions and holds on
        /// that cluster against the file's quotas (read-only; `lockmesh-admin`).
        #[command(flatten)]
        etcd: EtcdArgs,
        /// Print the quota use as JSON (`QuotaReport`) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Make the file's prefix-to-class map authoritative (drain, verify, apply), on
    /// one cluster (--endpoints) or on every cluster of a split deployment (--config).
    #[command(after_help = "\
Exit: 0 applied, unchanged or cancelled (on every cluster); 2 still draining (held or
verification_incomplete: re-run the same command to resume, or --cancel); 3 refused,
nothing written (a change that moves keys between the coord and the entity tier: run
`lockctl shard apply --tier` first); 1 etcd unreachable or a concurrent change; 64
invalid file.

Examples:
  # Every cluster of a split deployment, one JSON line with each cluster's outcome:
  lockctl class apply registry.yaml --config arbiter.yaml --reason 'payments/x to class pool'
  # One cluster:
  lockctl class apply registry.yaml --endpoints https://etcd:2379 --root /lockmesh")]
    Apply {
        /// The registry YAML.
        file: PathBuf,
        /// A split deployment: the arbiter config (its `etcd:`, `clusters:` and
        /// root); the apply then runs on every cluster it names, each on its own
        /// authoritative map, and prints each cluster's outcome (docs/SCALE.md).
        #[arg(long, conflicts_with = "endpoints")]
        config: Option<PathBuf>,
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
    /// A split deployment: the arbiter config (its `etcd:`, `clusters:` and root);
    /// the command then acts on every cluster it names, one after another, and
    /// prints each cluster's outcome (docs/SCALE.md). Re-running `change` resumes.
    #[arg(long, conflicts_with = "endpoints")]
    pub config: Option<PathBuf>,
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
        /// The pending change's epoch (printed by `change`; with `--config`, each
        /// cluster's own is read instead).
        #[arg(long, required_unless_present = "config")]
        epoch: Option<u64>,
        /// The pending change's target.
        #[arg(long = "to")]
        to: u32,
    },
    /// Cancel the pending lowering: the old limit, active again.
    Cancel {
        #[command(flatten)]
        target: Target,
        /// The pending change's epoch (with `--config`, each cluster's own).
        #[arg(long, required_unless_present = "config")]
        epoch: Option<u64>,
        /// The pending change's target (with `--config`, each cluster's own).
        #[arg(long = "to", required_unless_present = "config")]
        to: Option<u32>,
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
        ClassCmd::Crds { file, out } => return crds(file.as_deref(), out.as_deref()),
        ClassCmd::Check { file } => (file, None),
        ClassCmd::Cost { file, etcd, json, .. } if !etcd.endpoints.is_empty() => {
            return quota_use(file, etcd, *json).await;
        }
        ClassCmd::Cost { file, sessions, leader_changes, election_timeout_ms, class, .. } => {
            let input = CostInput {
                sessions: *sessions,
                leader_changes: *leader_changes,
                election_timeout_ms: *election_timeout_ms,
            };
            (file, Some((input, class.clone())))
        }
    };
    let reg = match load(file) {
        Ok(r) => r,
        Err(errs) => {
            eprintln!("invalid registry ({} errors):", errs.len());
            for e in errs {
                eprintln!("  {e}");
                if let Some(why) = floor_why(&e) {
                    eprintln!("    why the floor matters: {why}");
                }
            }
            return ExitCode::from(64);
        }
    };
    match cost_args {
        None => {
            println!("{}: OK ({} classes)", file.display(), reg.classes().len());
            print!("{}", floors_text(&reg, file));
            print!("{}", at_floor_text(&reg));
            for w in reg.warnings(lockmesh_registry::today()) {
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

/// `class cost FILE --endpoints ..`: each namespace's sessions and holds on the
/// cluster, listed once at one revision, against FILE's quotas; `alert` at 80 %.
/// Exit 0, 1 when etcd cannot be read, 64 for an invalid file. Waiters and the
/// acquire rate are counted at the arbiters (their console and metrics), so
/// only their limits show here.
async fn quota_use(file: &Path, etcd: &EtcdArgs, json: bool) -> ExitCode {
    use lockmesh_core::wire::console::{ConsoleQuota, QuotaReport, QuotaUse};
    let reg = match load(file) {
        Ok(r) => r,
        Err(errs) => {
            for e in errs {
                eprintln!("  {e}");
            }
            return ExitCode::from(64);
        }
    };
    let conn = match etcd.connection() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockctl: {e}");
            return ExitCode::from(64);
        }
    };
    let client = match conn.connect().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockctl: etcd: {e}");
            return ExitCode::from(1);
        }
    };
    let quotas = lockmesh_lock::quota::Quotas::default();
    quotas.set_registry(&reg);
    let (keys, quotas) = (&lockmesh_lock::Keys::new(&etcd.root), &quotas);
    let count = retry_auth(&client, |mut c| async move {
        lockmesh_lock::quota::count(quotas, &mut c, keys, Duration::from_secs(5)).await
    });
    let (used, revision) = match count.await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("lockctl: etcd: {e}");
            return ExitCode::from(1);
        }
    };
    let table = reg.quotas();
    let mut names: std::collections::BTreeSet<String> = used.keys().cloned().collect();
    names.extend(table.listed().map(|(n, _)| n.to_owned()));
    let namespaces: Vec<ConsoleQuota> = names
        .into_iter()
        .map(|n| {
            let l = table.limits(&n);
            let u = used.get(&n).copied().unwrap_or_default();
            let (sessions, holds) = (QuotaUse::of(u.sessions, l.sessions), QuotaUse::of(u.holds, l.holds));
            ConsoleQuota {
                alert: sessions.alerting() || holds.alerting(),
                cluster: etcd.root.clone(),
                namespace: n,
                sessions,
                holds,
                waiters: None,
                acquires_per_s: l.acquires_per_s,
            }
        })
        .collect();
    let report = QuotaReport { revision, namespaces };
    if json {
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
        return ExitCode::SUCCESS;
    }
    println!("quota use at etcd revision {} (root {}):", report.revision, etcd.root);
    println!("  {:<24} {:>22} {:>22} {:>9} {:>11}", "namespace", "sessions", "holds", "waiters", "acquires/s");
    let d = table.default_limits();
    for q in &report.namespaces {
        let cell = |u: &QuotaUse| format!("{}/{} ({} %)", u.used, u.limit, u.percent);
        println!(
            "  {:<24} {:>22} {:>22} {:>9} {:>11}{}",
            q.namespace,
            cell(&q.sessions),
            cell(&q.holds),
            table.limits(&q.namespace).waiters,
            q.acquires_per_s,
            if q.alert { "  ALERT: at or above 80 %" } else { "" }
        );
    }
    println!(
        "  (unlisted namespaces: sessions {}, holds {}, waiters {}, acquires/s {}; waiters and the rate are \
         counted at the arbiters: console and lockmesh_quota_* metrics)",
        d.sessions, d.holds, d.waiters, d.acquires_per_s
    );
    ExitCode::SUCCESS
}

/// A registry file, or (a directory) the registry of the LockClass/LockGrant
/// manifests in it under the default TTL limits: the arbiter's own loaders.
fn load(path: &Path) -> Result<ClassRegistry, Vec<String>> {
    if path.is_dir() {
        crd::load_dir(path, &lockmesh_core::class::RawPlatform::default())
    } else {
        lockmesh_registry::load(path)
    }
}

/// Why the floor matters, for a loader error refusing a TTL at a floor (the
/// registry's `ttl_s` or a manifest's `spec.ttlSeconds`); `None` for other errors.
fn floor_why(e: &str) -> Option<&'static str> {
    let message = [".ttl_s: ", "spec.ttlSeconds: "].iter().find_map(|f| e.split_once(f).map(|(_, m)| m))?;
    if message.contains("below the advisory floor") {
        return Some(WHY_ADVISORY_MIN_TTL);
    }
    if !message.contains("outside the platform range") {
        return None;
    }
    // `{ttl}s is outside the platform range {min}s to {max}s`.
    let secs = |m: &str| m.trim().trim_end_matches('s').parse::<u64>().ok();
    let ttl = secs(message.split(' ').next()?)?;
    let max = secs(message.rsplit("to ").next()?)?;
    Some(if ttl > max { WHY_MAX_TTL } else { WHY_MIN_TTL })
}

/// One note per class whose TTL sits at a floor in force, or below an ADR-11
/// default floor that the registry lowered, saying why that floor matters: the
/// reviewer of such a class sees what the margin protects.
fn at_floor_text(reg: &ClassRegistry) -> String {
    let p = reg.platform();
    let d = Platform::DEFAULT;
    let mut s = String::new();
    for c in reg.classes() {
        let advisory = matches!(c.enforcement, lockmesh_core::class::Enforcement::Advisory { .. });
        let (floor, field, default, why) = if advisory {
            (p.advisory_min_ttl_s, "advisory_min_ttl_s", d.advisory_min_ttl_s, WHY_ADVISORY_MIN_TTL)
        } else {
            (p.min_ttl_s, "min_ttl_s", d.min_ttl_s, WHY_MIN_TTL)
        };
        let place = if c.ttl_s < default {
            format!("below the ADR-11 default {field} {default}s (lowered here to {floor}s)")
        } else if c.ttl_s == floor {
            format!("at the floor {field} {floor}s")
        } else {
            continue;
        };
        s += &format!("  note: class {}: ttl_s {}s is {place}: {why}\n", c.name, c.ttl_s);
    }
    s
}

/// The TTL limits of a valid registry and why each matters; one warning per
/// limit it loosens below the ADR-11 defaults, with its reason and how to
/// regenerate the CRDs (they encode the defaults).
fn floors_text(reg: &lockmesh_core::ClassRegistry, file: &Path) -> String {
    let p = reg.platform();
    let (lowered, reason) = reg.lowered_floors();
    let mut s = format!(
        "  platform: TTL {}s to {}s (default {}s), advisory classes at least {}s{}\n",
        p.min_ttl_s,
        p.max_ttl_s,
        PLATFORM_DEFAULT_TTL_S,
        p.advisory_min_ttl_s,
        if lowered.is_empty() { ": the ADR-11 defaults, as deploy/crds encodes them" } else { "" }
    );
    for (field, value, why) in [
        ("min_ttl_s", p.min_ttl_s, WHY_MIN_TTL),
        ("max_ttl_s", p.max_ttl_s, WHY_MAX_TTL),
        ("advisory_min_ttl_s", p.advisory_min_ttl_s, WHY_ADVISORY_MIN_TTL),
    ] {
        s += &format!("    {field} {value}s: {why}\n");
    }
    for l in &lowered {
        s += &format!("  warning: {}: {l} (reason: {:?})\n", file.display(), reason.unwrap_or_default());
    }
    if !lowered.is_empty() {
        s += &format!(
            "  warning: {}: the CRDs in deploy/crds encode the default floors; install the ones for this registry: \
             lockctl class crds {} --out DIR\n",
            file.display(),
            file.display()
        );
    }
    s
}

/// `class crds`: the CRDs for FILE's TTL limits (or the defaults).
fn crds(file: Option<&Path>, out: Option<&Path>) -> ExitCode {
    let platform = match file.map(load) {
        None => Platform::DEFAULT,
        Some(Ok(reg)) => reg.platform(),
        Some(Err(errs)) => {
            eprintln!("invalid registry ({} errors):", errs.len());
            for e in errs {
                eprintln!("  {e}");
            }
            return ExitCode::from(64);
        }
    };
    let mut docs = Vec::new();
    for (name, v) in crd::crds_for(&platform) {
        let text = match crd::render(&v) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("lockctl: cannot render {name}: {e}");
                return ExitCode::from(1);
            }
        };
        match out {
            Some(dir) => {
                let path = dir.join(name);
                if let Err(e) = std::fs::write(&path, &text) {
                    eprintln!("lockctl: cannot write {}: {e}", path.display());
                    return ExitCode::from(1);
                }
                println!("{}", path.display());
            }
            None => docs.push(text),
        }
    }
    if out.is_none() {
        print!("{}", docs.join("---\n"));
    }
    ExitCode::SUCCESS
}

async fn apply(cmd: &ClassCmd, file: &std::path::Path) -> ExitCode {
    let ClassCmd::Apply { etcd, actor, reason, verify_timeout_ms, cancel, config, .. } = cmd else {
        return ExitCode::from(64);
    };
    let reg = match load(file) {
        Ok(r) => r,
        Err(errs) => {
            for e in errs {
                eprintln!("  {e}");
            }
            return ExitCode::from(64);
        }
    };
    let timeout = Duration::from_millis(*verify_timeout_ms);
    if let Some(config) = config {
        return fleet(
            config,
            |admin| {
                let reg = &reg;
                async move { admin.apply_map(reg, reason, timeout, *cancel).await.map(|o| (exit_of_apply(&o), o)) }
            },
            actor,
        )
        .await;
    }
    let admin = match connect(etcd, actor).await {
        Ok(a) => a,
        Err(code) => return code,
    };
    match admin.apply_map(&reg, reason, timeout, *cancel).await {
        Ok(o) => {
            println!("{}", serde_json::to_string(&o).unwrap_or_default());
            ExitCode::from(exit_of_apply(&o))
        }
        Err(e) => fail(&e),
    }
}

/// 2 while an apply still drains (`held`, `verification_incomplete`), else 0.
fn exit_of_apply(o: &ApplyOutcome) -> u8 {
    match o {
        ApplyOutcome::Held { .. } | ApplyOutcome::VerificationIncomplete { .. } => 2,
        _ => 0,
    }
}

/// 2 while a limit change still drains (`over_target`, `verification_incomplete`), else 0.
fn exit_of_limit(o: &Outcome) -> u8 {
    match o {
        Outcome::OverTarget { .. } | Outcome::VerificationIncomplete { .. } => 2,
        _ => 0,
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
    if let Some(config) = &t.config {
        return fleet_limit(cmd, t, config).await;
    }
    let admin = match connect(&t.etcd, &t.actor).await {
        Ok(a) => a,
        Err(code) => return code,
    };
    let timeout = Duration::from_millis(t.verify_timeout_ms);
    let r = match cmd {
        LimitCmd::Change { to, .. } => admin.change(&t.class, *to, &t.reason, timeout).await,
        LimitCmd::Resume { epoch, to, .. } => {
            admin.resume(&t.class, epoch.unwrap_or_default(), *to, &t.reason, timeout).await
        }
        LimitCmd::Cancel { epoch, to, .. } => {
            admin.cancel(&t.class, epoch.unwrap_or_default(), to.unwrap_or_default(), &t.reason).await
        }
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
            ExitCode::from(exit_of_limit(&o))
        }
        Err(e) => fail(&e),
    }
}

/// One cluster's part of a fleet-wide command.
#[derive(serde::Serialize)]
struct ClusterStep {
    cluster: String,
    /// The step's outcome, or `null` after an error.
    outcome: Option<serde_json::Value>,
    /// Why the step failed, or `null`.
    error: Option<String>,
}

/// `lockctl limit ... --config arbiter.yaml`: the command on every cluster of the
/// deployment ([`fleet`]), each on its own record (each cluster has its own
/// policy records and its own change epochs). Exit 2 when one still drains
/// (re-run `change` with the same `--to` to resume it, or `cancel --config`).
async fn fleet_limit(cmd: &LimitCmd, t: &Target, config: &Path) -> ExitCode {
    let timeout = Duration::from_millis(t.verify_timeout_ms);
    fleet(
        config,
        |admin| async move {
            let r = match cmd {
                LimitCmd::Change { to, .. } | LimitCmd::Resume { to, .. } => {
                    admin.converge(&t.class, *to, &t.reason, timeout).await
                }
                LimitCmd::Cancel { .. } => admin.cancel_pending(&t.class, &t.reason).await,
                LimitCmd::Show { .. } => admin.read(&t.class).await.map(|(policy, _)| Outcome::Unchanged { policy }),
            };
            r.map(|o| (exit_of_limit(&o), o))
        },
        &t.actor,
    )
    .await
}

/// Runs `step` on every cluster of the deployment `config` names, in name order
/// (`coord` and the shards), each through its own connection. One JSON line:
/// `{"clusters":[{"cluster","outcome","error"}]}`. The worst step decides the
/// exit code: 1 (a cluster could not be reached, or a concurrent change) over 3
/// (refused, nothing changed there) over 2 (still draining: re-run to resume) over
/// 0 (done); a failing cluster does not stop the others. 64 for a config that
/// does not validate.
async fn fleet<O, F, Fut>(config: &Path, step: F, actor: &str) -> ExitCode
where
    O: serde::Serialize,
    F: Fn(Admin) -> Fut,
    Fut: std::future::Future<Output = Result<(u8, O), AdminError>>,
{
    let clusters = match lockmesh_lock::clusters::Clusters::load_arbiter_file(config) {
        Ok(c) => c,
        Err(errs) => {
            eprintln!("lockctl: {}", errs.join("; "));
            return ExitCode::from(64);
        }
    };
    // Planted bugs of the config are lockctl's too (`skip_tier_check`); a test
    // build only, and refused unless LOCKMESH_TEST_FAULTS=1.
    lockmesh_lock::test_faults::install(&clusters.test_faults);
    let tiers = match clusters.connect().await {
        Ok(t) => t,
        Err(e) => {
            eprintln!("lockctl: {e}");
            return ExitCode::from(1);
        }
    };
    let (mut rows, mut exit) = (Vec::new(), 0u8);
    let mut stores: Vec<_> = tiers.stores().cloned().collect();
    stores.sort_by(|a, b| a.cluster_name().cmp(b.cluster_name()));
    let coord = tiers.coord().cluster().client();
    for store in stores {
        let admin = Admin::from_client(store.cluster().client(), &clusters.root, actor).with_keyspace(coord.clone());
        let cluster = store.cluster_name().to_owned();
        let (outcome, error, code) = match step(admin).await {
            Ok((code, o)) => (serde_json::to_value(&o).ok(), None, code),
            Err(e) => (None, Some(e.to_string()), if e.refused() { 3 } else { 1 }),
        };
        // The worst step decides: 1 (unreachable) over 3 (refused) over 2 (draining).
        let rank = |c: u8| match c {
            1 => 3,
            3 => 2,
            2 => 1,
            _ => 0,
        };
        if rank(code) > rank(exit) {
            exit = code;
        }
        rows.push(ClusterStep { cluster, outcome, error });
    }
    #[derive(serde::Serialize)]
    struct Fleet {
        clusters: Vec<ClusterStep>,
    }
    println!("{}", serde_json::to_string(&Fleet { clusters: rows }).unwrap_or_default());
    ExitCode::from(exit)
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
    ExitCode::from(if e.refused() { 3 } else { 1 })
}
