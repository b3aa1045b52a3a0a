//! `lockmesh-load`: acquire → release cycles through lockmesh and, against the
//! same etcd in the same run, through etcd's v3lock service and a raw
//! put-if-absent transaction; prints progress each second and a summary table
//! (docs/BENCHMARKS.md).
//!
//! ```text
//! cargo build --release --target wasm32-wasip1 -p lockmesh-wasm-filter
//! cargo build -p lockmesh-extproc -p lockmesh-tests --bin lockmesh-load
//! target/debug/lockmesh-load --seconds 15 --concurrency 8 --mode uncontended,hot,contended --keys 16
//! ```
//!
//! By default it starts its own stack with the test harness (one etcd member, one
//! arbiter, the lock-tier Envoy with `--concurrency 2`). With `--etcd` and/or
//! `--envoy https://localhost:PORT --ca --cert --key` it loads an existing
//! deployment on loopback instead. Exits 64 on invalid arguments, 1 on a failure,
//! a workload that could not run, or any token that did not strictly increase
//! (`--scale`: on any false expiry).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use lockmesh_load::{self as load, LoadOptions, Mode, Target, Workload};
use lockmesh_tests::Stack;

/// Exit code for invalid arguments (EX_USAGE).
const EX_USAGE: u8 = 64;
/// `--filter-tax`: alternating rounds of plain and unlocked, so the baseline's own
/// spread is measured in the same run.
const TAX_ROUNDS: usize = 3;

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(about = "Load lockmesh, etcd's v3lock and a raw etcd txn lock side by side")]
struct Args {
    /// Measured seconds per workload and mode (at most 600).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Seconds of unmeasured cycles before each measurement.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Clients per key (hot, contended), or keys of one client each (uncontended).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Key modes, comma-separated: uncontended, hot, contended, zipf.
    #[arg(long, default_value = "uncontended")]
    mode: String,
    /// Keys in contended mode (each with --concurrency clients).
    #[arg(long, default_value_t = 16)]
    keys: usize,
    /// Workloads, comma-separated: lockmesh, etcd-lock, raw-txn (and, by name only,
    /// lockmesh-oneshot, raw-txn-marker, raw-txn-design and engine: the grant
    /// engine in this process, no Envoy and no arbiter process).
    #[arg(long, default_value = "lockmesh,etcd-lock,raw-txn")]
    workloads: String,
    /// `x-lock-wait-ms` of lockmesh acquires; the limit of every workload's acquire.
    #[arg(long, default_value_t = 30_000)]
    wait_ms: u64,
    /// Speak HTTP/1.1 to the lock tier (default: HTTP/2 with prior knowledge).
    #[arg(long)]
    http1: bool,
    /// The stack's etcd in production's shape: client TLS and auth on, the arbiter
    /// logged in as the shipped least-privilege role, the etcd workloads (etcd-lock,
    /// raw-txn) as root over the same TLS. Default: plaintext etcd without auth for
    /// every workload alike.
    #[arg(long)]
    secure_etcd: bool,
    /// The engine workload: the most grants and releases one etcd transaction
    /// may carry. 1 sends each alone (the engine before group commit); at most
    /// 1024.
    #[arg(long, default_value_t = 1)]
    max_group: u32,
    /// Members of the etcd cluster this tool starts, on loopback (1 or 3).
    #[arg(long, default_value_t = 1)]
    etcd_members: usize,
    /// Pin every etcd member to core 0 and this process to the other cores
    /// (`taskset`; without it, or on one core, nothing is pinned and the output
    /// says so).
    #[arg(long)]
    pin_etcd: bool,
    /// --mode zipf: the Zipf exponent s (key i from 1 drawn with weight 1/i^s over
    /// --keys keys, --concurrency clients in all).
    #[arg(long, default_value_t = 1.1)]
    zipf: f64,
    /// The most holders per key of the class the load keys get on the stack this
    /// tool starts (1: a mutex; N: a semaphore of N).
    #[arg(long, default_value_t = 1)]
    limit: u32,
    /// Open loop: offer this many cycles per second in all (each client starts a
    /// cycle every clients/RATE seconds, late ones at once, never a backlog), so
    /// every workload is measured at the same rate; default: closed loop.
    #[arg(long, value_name = "CYCLES_PER_S")]
    rate: Option<f64>,
    /// Envoy `--concurrency` of the stack this tool starts.
    #[arg(long, default_value_t = 2)]
    envoy_concurrency: u32,
    /// An existing etcd on loopback: comma-separated `http://127.0.0.1:PORT`.
    #[arg(long, value_name = "ENDPOINTS")]
    etcd: Option<String>,
    /// An existing lock tier on loopback: `https://localhost:PORT`.
    #[arg(long, value_name = "URL", requires_all = ["ca", "cert", "key"])]
    envoy: Option<String>,
    /// CA certificate (PEM) the lock tier's server certificate chains to.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Client certificate (PEM, a SPIFFE URI SAN) every client presents.
    #[arg(long)]
    cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Lock keys start with this (`namespace[/more]`); with --envoy, choose a prefix
    /// the certificate's identity is granted (e.g. `payments/load`).
    #[arg(long, default_value = "load")]
    key_prefix: String,
    /// Instead of lock cycles: the cost of the lockmesh filters on a forwarded route
    /// (inbound-sidecar.yaml): plain Envoy vs unlocked requests through the filter vs
    /// transparent request-scoped locks, --concurrency clients, --seconds each.
    #[arg(long)]
    filter_tax: bool,
    /// Instead of lock cycles: attach HOLDS holds to SESSIONS sessions, renew them for
    /// three TTL/3 intervals and report keepalives and etcd's raft proposals and lease
    /// renewals over that window (e.g. `10000:10`).
    #[arg(long, value_name = "HOLDS:SESSIONS", conflicts_with = "scale")]
    renewal: Option<String>,
    /// Instead of lock cycles: attach HOLDS holds (distinct keys, through the lock
    /// tier) to SESSIONS sessions of a class with TTL --ttl, renew each session once
    /// per TTL/3 through the full path and keep them --hold-minutes; fails on any
    /// false expiry (e.g. `250000:40000`; docs/BENCHMARKS.md).
    #[arg(long, value_name = "HOLDS:SESSIONS")]
    scale: Option<String>,
    /// --scale: minutes to keep the holds after attaching them.
    #[arg(long, default_value_t = 10.0)]
    hold_minutes: f64,
    /// --scale: TTL of the sessions' class, seconds (5..=300).
    #[arg(long, default_value_t = lockmesh_load::scale::MAX_TTL_S)]
    ttl: u64,
    /// --scale: acquires in flight while attaching.
    #[arg(long, default_value_t = 64)]
    attach_concurrency: usize,
    /// Instead of lock cycles: the coordination recipes (election, read-write,
    /// multi-key, k permits) through lockmesh, etcd's own services and ZooKeeper's
    /// recipes (kazoo), --concurrency clients, --seconds each; needs
    /// `scripts/setup --bench` (docs/BENCHMARKS.md, recipes).
    #[arg(long)]
    recipes: bool,
    /// --recipes: run only this recipe (repeatable; default every recipe).
    #[arg(long, value_name = "NAME")]
    recipe: Vec<String>,
    /// --recipes: the Python with kazoo (default: `.tools/bench/bin/python`).
    #[arg(long)]
    python: Option<PathBuf>,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
    /// A top-level line added to the config of the arbiter this tool starts
    /// (repeatable), e.g. `--arbiter-yaml 'handoff: false'`. Set `ARBITER_BIN` to
    /// run another build of the arbiter (e.g. target/release/lockmesh-extproc).
    #[arg(long, value_name = "YAML")]
    arbiter_yaml: Vec<String>,
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(EX_USAGE) } else { ExitCode::SUCCESS };
        }
    };
    let opts = match options(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("lockmesh-load: {e:#}");
            return ExitCode::from(EX_USAGE);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockmesh-load: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(spec) = &args.scale {
        return scale(&rt, &args, spec);
    }
    if let Some(spec) = &args.renewal {
        let Some((holds, sessions)) = holds_sessions(spec) else {
            eprintln!("lockmesh-load: --renewal wants HOLDS:SESSIONS, e.g. 10000:10");
            return ExitCode::from(EX_USAGE);
        };
        let result = rt.block_on(load::renewal::run(holds, sessions, !args.quiet));
        return report(result, Some(describe_machine()), load::renewal::render, |r| r.holds_after == r.holds);
    }
    if args.recipes {
        let python = args.python.clone().unwrap_or_else(|| lockmesh_tests::repo_root().join(".tools/bench/bin/python"));
        let (n, secs, warm) = (args.concurrency, opts.seconds.as_secs_f64(), opts.warmup.as_secs_f64());
        let result = rt.block_on(load::recipes::run(n, secs, warm, &python, args.quiet, &args.recipe));
        let floor = load::report::Floor::from_env();
        let render = |r: &Vec<_>| load::recipes::render(r, n, secs, floor);
        return report(result, Some(describe_machine()), render, |r| !r.is_empty());
    }
    if args.filter_tax {
        let (secs, warm) = (opts.seconds, opts.warmup);
        let result = rt.block_on(load::tax::run(args.concurrency, secs, warm, TAX_ROUNDS, !args.quiet));
        let render = |results: &Vec<_>| load::tax::render(results, args.concurrency, secs);
        return report(result, Some(describe_machine()), render, |results| results.iter().all(|r| r.errors == 0));
    }
    let passed = |(r, _): &(load::Report, Vec<String>)| {
        r.token_violations() == 0 && r.results.iter().all(|r| r.failed.is_none())
    };
    let render = |(r, notes): &(load::Report, Vec<String>)| {
        let mut s = r.render();
        for n in notes {
            s.push_str(n);
            s.push('\n');
        }
        s
    };
    report(rt.block_on(run(&args, &opts)), None, render, passed)
}

/// Prints a finished run's report (after a `machine:` line when given) and
/// answers 0 when it passed; a run that could not finish prints why and
/// answers 1, like one that did not pass.
fn report<R>(
    result: Result<R>,
    machine: Option<String>,
    render: impl FnOnce(&R) -> String,
    passed: impl FnOnce(&R) -> bool,
) -> ExitCode {
    match result {
        Ok(r) => {
            if let Some(m) = machine {
                println!("machine: {m}");
            }
            print!("{}", render(&r));
            if passed(&r) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("lockmesh-load: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// `HOLDS:SESSIONS`.
fn holds_sessions(spec: &str) -> Option<(usize, usize)> {
    spec.split_once(':').and_then(|(h, s)| Some((h.parse::<usize>().ok()?, s.parse::<usize>().ok()?)))
}

/// `--scale`: runs it and prints the report.
fn scale(rt: &tokio::runtime::Runtime, args: &Args, spec: &str) -> ExitCode {
    let Some((holds, sessions)) = holds_sessions(spec) else {
        eprintln!("lockmesh-load: --scale wants HOLDS:SESSIONS, e.g. 250000:40000");
        return ExitCode::from(EX_USAGE);
    };
    let minutes = args.hold_minutes;
    if !(minutes.is_finite() && minutes > 0.0 && minutes <= 60.0) {
        eprintln!("lockmesh-load: --hold-minutes must be in (0, 60]");
        return ExitCode::from(EX_USAGE);
    }
    let opts = load::scale::ScaleOptions {
        holds,
        sessions,
        hold: Duration::from_secs_f64(minutes * 60.0),
        ttl_s: args.ttl,
        attach_concurrency: args.attach_concurrency,
        envoy_concurrency: args.envoy_concurrency,
        arbiter_yaml: args.arbiter_yaml.clone(),
        progress: (!args.quiet).then_some(Duration::from_secs(10)),
        starve: 0,
    };
    if let Err(e) = opts.validate() {
        eprintln!("lockmesh-load: --scale: {e:#}");
        return ExitCode::from(EX_USAGE);
    }
    let machine = format!(
        "{}; etcd: {}; envoy: {} --concurrency {}; arbiter: {}",
        describe_machine(),
        tool_version(load_bin(lockmesh_tests::etcd::etcd_bin())),
        tool_version(load_bin(lockmesh_tests::envoy::envoy_bin())),
        args.envoy_concurrency,
        lockmesh_tests::arbiter::arbiter_bin().map(|p| p.display().to_string()).unwrap_or_default(),
    );
    report(rt.block_on(load::scale::run(&opts)), Some(machine), |r| r.render(), |r| r.passed())
}

fn options(a: &Args) -> Result<LoadOptions> {
    ensure!(
        a.seconds.is_finite() && a.warmup.is_finite() && a.warmup >= 0.0,
        "--seconds and --warmup must be finite, --warmup not negative"
    );
    let opts = LoadOptions {
        seconds: Duration::from_secs_f64(a.seconds.max(0.0)),
        warmup: Duration::from_secs_f64(a.warmup),
        concurrency: a.concurrency,
        keys: a.keys,
        modes: load::parse_list::<Mode>(&a.mode).context("--mode")?,
        workloads: load::parse_list::<Workload>(&a.workloads).context("--workloads")?,
        wait_ms: a.wait_ms,
        http1: a.http1,
        rate: a.rate,
        zipf: a.zipf,
        limit: a.limit,
        progress: !a.quiet,
        keep_grants: false,
        max_group: a.max_group,
    };
    load::engine::check_max_group(a.max_group).context("--max-group")?;
    opts.validate()?;
    ensure!(matches!(a.etcd_members, 1 | 3), "--etcd-members: {} must be 1 or 3", a.etcd_members);
    if a.envoy.is_some() || a.etcd.is_some() {
        if opts.workloads.iter().any(|w| w.lock_tier()) {
            ensure!(a.envoy.is_some(), "the lockmesh workloads need --envoy");
        }
        if opts.workloads.iter().any(|w| !w.lock_tier()) {
            ensure!(a.etcd.is_some(), "the etcd workloads need --etcd");
        }
    }
    Ok(opts)
}

/// `host:port` of a loopback URL with scheme `scheme`, or an error.
fn loopback_port(url: &str, scheme: &str) -> Result<u16> {
    let u = reqwest::Url::parse(url).with_context(|| format!("{url:?} is not a URL"))?;
    ensure!(u.scheme() == scheme, "{url}: the scheme must be {scheme}");
    let host = u.host_str().unwrap_or_default();
    ensure!(matches!(host, "localhost" | "127.0.0.1" | "[::1]"), "{url}: loopback only (localhost, 127.0.0.1)");
    u.port().with_context(|| format!("{url}: give the port"))
}

async fn run(a: &Args, opts: &LoadOptions) -> Result<(load::Report, Vec<String>)> {
    if a.envoy.is_some() || a.etcd.is_some() {
        let etcd: Vec<String> = match &a.etcd {
            Some(list) => list.split(',').map(|s| s.trim().to_owned()).collect(),
            None => Vec::new(),
        };
        for e in &etcd {
            loopback_port(e, "http").context("--etcd")?;
        }
        let port = match &a.envoy {
            Some(u) => Some(loopback_port(u, "https").context("--envoy")?),
            None => None,
        };
        let file = |p: &Option<PathBuf>| p.clone().unwrap_or_default();
        let target =
            Target::external(etcd, port, file(&a.ca), file(&a.cert), file(&a.key)).with_key_prefix(&a.key_prefix);
        ensure!(
            a.etcd_members == 1 && !a.pin_etcd,
            "--etcd-members and --pin-etcd apply to the stack this tool starts"
        );
        println!("target: existing deployment ({}); run id below", describe_machine());
        return load::run_noted(&target, opts).await;
    }
    // Plaintext whatever LOCKMESH_TEST_ETCD says unless --secure-etcd: every workload
    // then runs on the one production-shaped etcd (`Target::from_stack`).
    // Without a lock-tier workload no Envoy and no arbiter runs (the etcd and
    // engine workloads alone).
    let tier = opts.workloads.iter().any(|w| w.lock_tier());
    let b = Stack::builder("load").envoy_concurrency(a.envoy_concurrency);
    let b = if tier { b.envoy_config("lock-tier") } else { b.arbiters(0) };
    let mut b = if a.secure_etcd { b.secure_etcd() } else { b.plaintext_etcd() }.own_etcd(a.etcd_members);
    for line in &a.arbiter_yaml {
        b = b.arbiter_extra_yaml(line.clone());
    }
    if opts.limit > 1 {
        b = b.registry(load::limited_registry(opts.limit));
    }
    let st = b.start().await.context(
        "start the stack (scripts/setup installs etcd and Envoy; build the arbiter and the Wasm filter first)",
    )?;
    let members = match st.etcd().members().len() {
        1 => String::new(),
        n => format!(", {n} members on loopback"),
    };
    let etcd_shape = if st.etcd().is_secure() {
        "; TLS and auth: the arbiter (and the engine workload) as the shipped lockmesh-arbiter role, the etcd workloads as root"
    } else {
        "; plaintext, no auth"
    };
    let etcd_version = tool_version(load_bin(lockmesh_tests::etcd::etcd_bin()));
    if tier {
        println!(
            "stack: etcd {} ({etcd_version}{members}{etcd_shape}), envoy https://localhost:{} --concurrency {} ({}), 1 arbiter; {}",
            st.etcd().endpoints().join(","),
            st.envoy().listener_port(),
            a.envoy_concurrency,
            tool_version(load_bin(lockmesh_tests::envoy::envoy_bin())),
            describe_machine()
        );
        println!(
            "arbiter: {} {}",
            lockmesh_tests::arbiter::arbiter_bin().map(|p| p.display().to_string()).unwrap_or_default(),
            if a.arbiter_yaml.is_empty() { String::new() } else { format!("with {:?}", a.arbiter_yaml) }
        );
    } else {
        println!(
            "stack: etcd {} ({etcd_version}{members}{etcd_shape}), no Envoy, no arbiter process; {}",
            st.etcd().endpoints().join(","),
            describe_machine()
        );
    }
    if a.pin_etcd {
        let pids: Vec<u32> = st.etcd().members().iter().filter_map(|m| m.pid()).collect();
        println!("pinned: {}", pin(&pids));
    }
    load::run_noted(&Target::from_stack(&st)?.with_key_prefix(&a.key_prefix), opts).await
}

/// Pins the etcd processes `pids` (every thread) to core 0 and this process
/// (every thread, so the runtime's workers too) to cores 1.. with `taskset`;
/// says what it did, or why nothing was pinned.
fn pin(pids: &[u32]) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        return "nothing (one core)".into();
    }
    let taskset = |cpus: &str, pid: u32| {
        std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", cpus, &pid.to_string()])
            .stdout(std::process::Stdio::null())
            .status()
    };
    let rest = if cores == 2 { "1".to_owned() } else { format!("1-{}", cores - 1) };
    for &pid in pids {
        match taskset("0", pid) {
            Ok(s) if s.success() => {}
            Ok(s) => return format!("nothing (taskset -a -p -c 0 {pid} answered {s})"),
            Err(e) => return format!("nothing (no taskset: {e})"),
        }
    }
    match taskset(&rest, std::process::id()) {
        Ok(s) if s.success() => format!("etcd ({} member(s)) on core 0, this load tool on cores {rest}", pids.len()),
        Ok(s) => format!("etcd on core 0; this load tool not (taskset answered {s})"),
        Err(e) => format!("etcd on core 0; this load tool not ({e})"),
    }
}

fn load_bin(p: Result<PathBuf>) -> Option<PathBuf> {
    p.ok()
}

/// The first line of `<bin> --version`.
fn tool_version(bin: Option<PathBuf>) -> String {
    bin.and_then(|b| std::process::Command::new(b).arg("--version").output().ok())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout).lines().find(|l| !l.trim().is_empty()).map(|l| l.trim().to_owned())
        })
        .unwrap_or_else(|| "version unknown".into())
}

/// `N cores, <CPU model>`.
fn describe_machine() -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cores} cores, {model}")
}
