//! `lockmesh-fence-proxy --config fence.yaml` runs the fence;
//! `lockmesh-fence-proxy --check-config fence.yaml` validates the file with the same
//! code and exits 0, or 64 with every error. Runtime failures exit 1.

use std::{path::PathBuf, process::ExitCode};

use clap::Parser;

const BINARY: &str = "lockmesh-fence-proxy";

/// The lockmesh fencing proxy.
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
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_target(false)
        .init();
    let (path, check) = match (args.config, args.check_config) {
        (_, Some(p)) => (p, true),
        (Some(p), None) => (p, false),
        (None, None) => {
            eprintln!("lockmesh-fence-proxy: --config FILE or --check-config FILE is required");
            return ExitCode::from(lockmesh_runtime::EX_USAGE);
        }
    };
    let config = match lockmesh_fence_proxy::Config::load(&path) {
        Ok(c) => c,
        Err(errs) => return lockmesh_runtime::report_config_errors(BINARY, &path.display().to_string(), &errs),
    };
    if config.accept_lower_tokens {
        tracing::error!("TEST FAULT PLANTED: accept_lower_tokens forwards stale writes; this fence does not fence");
    }
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
    let result: anyhow::Result<()> = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let admin = tokio::net::TcpListener::bind(config.admin_listen).await?;
        lockmesh_fence_proxy::run(listener, admin, config, lockmesh_runtime::shutdown()).await?;
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{BINARY}: {e:#}");
            ExitCode::from(1)
        }
    }
}
