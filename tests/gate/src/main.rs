//! `lockmesh-gate`: the long release gate (docs/GATE.md), and the holder process
//! the gate's histories run.
//!
//! ```text
//! cargo build --release --target wasm32-wasip1 -p lockmesh-wasm-filter
//! cargo build -p lockmesh-extproc -p lockmesh-fence-proxy -p lockmesh-tests --bin lockmesh-gate
//! target/debug/lockmesh-gate long --minutes 60 --out gate-out
//! ```
//!
//! `long` runs fault-injected histories back to back on fresh systems, prints a
//! line per history while it runs and a summary at the end (histories checked,
//! faults injected by kind, violations). Exit 0 only when every history passed;
//! 1 on a violation, a checker timeout or a history that could not run; 64 on
//! invalid arguments. `holder` is the client loop (started by the gate itself).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lockmesh_gate::{self as gate, holder::HolderArgs, polyglot::DriverArgs, schedule, GateOptions};
use tokio::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "The lockmesh release gate: fault-injected histories, checked")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run histories until the time is up, then print the summary.
    Long {
        /// Total minutes (histories start while time remains).
        #[arg(long, default_value_t = 60.0)]
        minutes: f64,
        /// Faults per history.
        #[arg(long, default_value_t = 24)]
        faults: usize,
        /// Seconds of fault-free load between faults.
        #[arg(long, default_value_t = 2.0)]
        gap_s: f64,
        /// Where failing histories are written.
        #[arg(long, default_value = "gate-out")]
        out: PathBuf,
        /// Run with a coord cluster and two entity shards, moving every gate key
        /// between the shards (`rebalance` steps, at least two per history:
        /// there and back) among the faults that apply there (docs/GATE.md).
        #[arg(long)]
        rebalance: bool,
    },
    /// Check a history a run wrote (`history.json` of a failing history) again,
    /// with this build's checker: exit 0 if it passes, 1 if not.
    Check {
        /// The history file.
        history: PathBuf,
    },
    /// A gate client process (internal).
    Holder(HolderCmd),
}

/// A holder's arguments: its loop, and the SDK driver it holds through if any.
#[derive(Debug, clap::Args)]
struct HolderCmd {
    #[command(flatten)]
    args: HolderArgs,
    #[command(flatten)]
    driver: DriverArgs,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // A driver holder becomes its SDK's driver before any thread starts.
    if let Cmd::Holder(h) = &args.cmd {
        if h.driver.driver.is_some() && !h.driver.driven {
            eprintln!("lockmesh-gate holder: {:#}", gate::polyglot::exec_driver(&h.args, &h.driver));
            return ExitCode::from(1);
        }
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,lockmesh_gate=info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockmesh-gate: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match args.cmd {
        Cmd::Holder(h) => {
            let r = rt.block_on(async {
                if h.driver.driver.is_some() {
                    gate::polyglot::run(h.args, h.driver).await
                } else {
                    gate::holder::run(h.args).await
                }
            });
            // A driver holder's stdin reader would hold a waiting shutdown.
            rt.shutdown_background();
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("lockmesh-gate holder: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Check { history } => {
            let h: gate::history::History = match std::fs::read(&history)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(h) => h,
                Err(e) => {
                    eprintln!("lockmesh-gate check: {}: {e}", history.display());
                    return ExitCode::from(64);
                }
            };
            let verdict = gate::checker::check(&h, Duration::from_secs(600));
            println!("{}", verdict.explain());
            if verdict.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Cmd::Long { minutes, faults, gap_s, out, rebalance } => {
            if !(minutes > 0.0 && gap_s >= 0.0 && faults > 0) {
                eprintln!("lockmesh-gate: --minutes and --faults must be positive, --gap-s not negative");
                return ExitCode::from(64);
            }
            let plan = Plan { faults, gap: Duration::from_secs_f64(gap_s), rebalance };
            rt.block_on(long(Duration::from_secs_f64(minutes * 60.0), plan, out))
        }
    }
}

/// What each history of a long run gets.
struct Plan {
    faults: usize,
    gap: Duration,
    rebalance: bool,
}

/// The gate classes' TTL, µs (a transparent request answered after staying
/// longer was held across renewals).
const GATE_TTL_US: u64 = 3_000_000;

async fn long(total: Duration, plan: Plan, out: PathBuf) -> ExitCode {
    let start = Instant::now();
    let (mut histories, mut failed, mut errors) = (0usize, 0usize, 0usize);
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    let (mut grants, mut ops, mut writes) = (0usize, 0usize, 0usize);
    let (mut moves, mut moved) = (0usize, 0usize);
    let (mut upstream, mut long_answered) = (0usize, 0usize);
    println!(
        "lockmesh-gate long: {:.0} min, {} faults per history{}, output in {}",
        total.as_secs_f64() / 60.0,
        plan.faults,
        if plan.rebalance { " (coord + 2 entity shards, rebalances among them)" } else { "" },
        out.display()
    );
    while start.elapsed() < total {
        let n = histories + errors + 1;
        let (opts, kinds) = if plan.rebalance {
            (GateOptions::rebalance(&format!("gate{n}")), schedule::random_rebalance(plan.faults))
        } else {
            (GateOptions::gate(&format!("gate{n}")), schedule::random(plan.faults))
        };
        let t0 = Instant::now();
        match gate::run_history(opts, &kinds, plan.gap, &out).await {
            Ok((h, v, path)) => {
                histories += 1;
                for (k, c) in h.faults_by_kind() {
                    *by_kind.entry(k).or_default() += c;
                }
                moves += h.moves.len();
                upstream += h.upstream.len();
                long_answered +=
                    h.upstream.iter().filter(|e| e.left_us.is_some_and(|l| l - e.arrived_us > GATE_TTL_US)).count();
                moved += h.moves.iter().filter(|m| !h.keys_granted_across(m).is_empty()).count();
                if let gate::Verdict::Pass(s) = &v {
                    grants += s.grants;
                    ops += s.ops;
                    writes += s.writes;
                }
                let took = t0.elapsed().as_secs();
                match path {
                    None => println!(
                        "[{:>5}s] history {n}: {} ({took}s, {} faults)",
                        start.elapsed().as_secs(),
                        v.explain(),
                        h.faults.len()
                    ),
                    Some(p) => {
                        failed += 1;
                        println!(
                            "[{:>5}s] history {n}: {}\n  written to {}",
                            start.elapsed().as_secs(),
                            v.explain(),
                            p.display()
                        );
                    }
                }
            }
            Err(e) => {
                errors += 1;
                println!("[{:>5}s] history {n}: could not run: {e:#}", start.elapsed().as_secs());
            }
        }
    }
    println!("\n== lockmesh-gate summary ({:.1} min) ==", start.elapsed().as_secs_f64() / 60.0);
    println!("histories checked: {histories} ({failed} failed; {errors} could not run)");
    println!("checked: {grants} committed grants, {ops} client operations, {writes} fenced writes");
    println!("transparent requests at the upstream: {upstream} ({long_answered} answered after staying past the TTL)");
    if plan.rebalance {
        println!("moves: {moves} ({moved} with a key granted on its old home before and on its new home after)");
    }
    println!("faults injected by kind:");
    for (k, c) in &by_kind {
        println!("  {k:<18} {c}");
    }
    println!(
        "violations: {}",
        if failed == 0 { "none".to_owned() } else { format!("{failed} histories (see {})", out.display()) }
    );
    if failed == 0 && errors == 0 && histories > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
