//! `lockmesh-extproc --config arbiter.yaml` runs the arbiter;
//! `lockmesh-extproc --check-config arbiter.yaml` validates the file (and the
//! registry it names) with the same code and exits 0, or 64 with every error.

use std::{path::PathBuf, process::ExitCode};

use clap::Parser;
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, Layer};

/// The binary's name, in its stderr lines.
const BINARY: &str = "lockmesh-extproc";

/// The lockmesh arbiter (Envoy ext_proc service).
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Configuration file to run with.
    #[arg(long, conflicts_with = "check_config")]
    config: Option<PathBuf>,
    /// Validate this configuration file and exit.
    #[arg(long)]
    check_config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Logs as before (RUST_LOG, default info); spans for OTLP only once
    // `telemetry` starts them, never in the log lines.
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_target(false).with_filter(lockmesh_telemetry::log_filter()))
        .with(lockmesh_telemetry::layer())
        .init();
    let (path, check) = match (args.config, args.check_config) {
        (_, Some(p)) => (p, true),
        (Some(p), None) => (p, false),
        (None, None) => {
            eprintln!("{BINARY}: --config FILE or --check-config FILE is required");
            return ExitCode::from(lockmesh_runtime::EX_USAGE);
        }
    };
    #[cfg(feature = "bench-floor")]
    {
        if !lockmesh_extproc::floor::allowed() {
            eprintln!(
                "{BINARY}: this is a bench-floor build (locks granted without the lock logic); it runs only for benchmarks, with {}=1 (no etcd) or {0}=etcd (the etcd requests only)",
                lockmesh_extproc::floor::ENV
            );
            return ExitCode::from(lockmesh_runtime::EX_USAGE);
        }
        tracing::error!(level = ?lockmesh_extproc::floor::level(), "BENCH-FLOOR BUILD: every acquire is granted without the lock logic; never serve with it");
    }
    // Capabilities switched off for this process (lockmesh_lock::upgrade): an
    // unknown name is a configuration error, not a silent no-op.
    if let Err(e) = lockmesh_lock::upgrade::Support::from_env() {
        eprintln!("{BINARY}: {e}");
        return ExitCode::from(lockmesh_runtime::EX_USAGE);
    }
    let config = match lockmesh_extproc::Config::load(&path) {
        Ok(c) => c,
        Err(errs) => return lockmesh_runtime::report_config_errors(BINARY, &path.display().to_string(), &errs),
    };
    // A weakened operator safeguard is said loudly, at every start and check.
    for w in config.weakened() {
        eprintln!("{BINARY}: {}: warning: {w}", path.display());
    }
    if check {
        // Who may call ext_proc, and how far each is believed (docs/DEPLOY.md).
        for line in config.clients_summary() {
            println!("{}: {line}", path.display());
        }
        println!("{}: OK", path.display());
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let exporter = config.telemetry.as_ref().and_then(lockmesh_telemetry::start);
    let result: anyhow::Result<()> = rt.block_on(async move {
        let grpc = tokio::net::TcpListener::bind(config.listen).await?;
        let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
        lockmesh_extproc::run(grpc, admin, config, lockmesh_runtime::shutdown()).await
    });
    if let Some(e) = exporter {
        e.shutdown();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{BINARY}: {e:#}");
            ExitCode::from(1)
        }
    }
}
