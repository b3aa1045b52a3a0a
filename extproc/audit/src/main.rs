//! `lockmesh-audit --config audit.yaml` runs the audit tailer (docs/AUDIT.md);
//! `--check-config audit.yaml` validates the file with the same code and exits 0,
//! or 64 with every error.

use std::{path::PathBuf, process::ExitCode};

use clap::Parser;
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt, Layer};

/// The binary's name, in its stderr lines.
const BINARY: &str = "lockmesh-audit";

/// The lockmesh audit tailer.
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
    // Logs (RUST_LOG, default info) and, once `telemetry` starts them, OTLP spans.
    let log = tracing_subscriber::fmt::layer()
        .with_target(false)
        // Colour codes only on a terminal: log files stay greppable.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    tracing_subscriber::registry()
        .with(log.with_filter(lockmesh_telemetry::log_filter()))
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
    let config = match lockmesh_audit::Config::load(&path) {
        Ok(c) => c,
        Err(errs) => return lockmesh_runtime::report_config_errors(BINARY, &path.display().to_string(), &errs),
    };
    if check {
        // What the query API admits, and what this file leaves open.
        match &config.query {
            Some(q) => {
                if let Err(e) = lockmesh_audit::query_port::check(q) {
                    eprintln!("{BINARY}: {}: query.tls: {e:#}", path.display());
                    return ExitCode::from(lockmesh_runtime::EX_USAGE);
                }
                let tokens = if q.operators.is_some() { "and a verified operator token" } else { "(no token check)" };
                println!("query API on {}: client certificates {} {tokens}", q.listen, q.allowed_clients.join(", "));
                match &config.clickhouse {
                    Some(ch) => println!("query API answers from clickhouse ({})", ch.table_name()),
                    None => println!("query API answers from the embedded store ({})", config.store_file.display()),
                }
                for w in q.weakened() {
                    println!("WARNING: {w}");
                }
            }
            None => println!("query API: off (no query section; lockctl audit --db reads the store)"),
        }
        println!("metrics on {}: /metrics, /healthz, /v1/audit/checkpoint", config.admin_listen);
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
        let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
        let query = match &config.query {
            Some(q) => Some(tokio::net::TcpListener::bind(q.listen).await?),
            None => None,
        };
        lockmesh_audit::tailer::run(config, admin, query, lockmesh_runtime::shutdown()).await
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
