//! `lockmesh-extproc --config arbiter.yaml` runs the arbiter;
//! `lockmesh-extproc --check-config arbiter.yaml` validates the file (and the
//! registry it names) with the same code and exits 0, or 64 with every error.

use std::{path::PathBuf, process::ExitCode};

use clap::Parser;
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, Layer};

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
            eprintln!("lockmesh-extproc: --config FILE or --check-config FILE is required");
            return ExitCode::from(64);
        }
    };
    let config = match lockmesh_extproc::Config::load(&path) {
        Ok(c) => c,
        Err(errs) => {
            eprintln!("invalid configuration ({} errors):", errs.len());
            for e in errs {
                eprintln!("  {e}");
            }
            return ExitCode::from(64);
        }
    };
    if check {
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
        lockmesh_extproc::run(grpc, admin, config, shutdown()).await
    });
    if let Some(e) = exporter {
        e.shutdown();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockmesh-extproc: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn shutdown() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}
