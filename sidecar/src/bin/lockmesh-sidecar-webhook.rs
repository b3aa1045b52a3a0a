//! `lockmesh-sidecar-webhook --tls-cert tls.crt --tls-key tls.key [--listen 0.0.0.0:9443] [--config injector.yaml]`
//! serves the fence injection as a Kubernetes mutating admission webhook
//! (`POST /mutate`, AdmissionReview v1) over HTTPS, printing
//! `listening on ADDR` once bound. SIGTERM or Ctrl-C drains and exits 0.
//! `--check-config FILE` validates an injector configuration and exits (0 or 64).

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc};

use clap::Parser;
use lockmesh_sidecar::{server, Config};

const BINARY: &str = "lockmesh-sidecar-webhook";

/// lockmesh fence-proxy injection webhook.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:9443")]
    listen: SocketAddr,
    /// PEM certificate chain the API server verifies (its caBundle's CA signs it).
    #[arg(long, required_unless_present = "check_config")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of the certificate.
    #[arg(long, required_unless_present = "check_config")]
    tls_key: Option<PathBuf>,
    /// Injector configuration; defaults when absent.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Validate this injector configuration and exit.
    #[arg(long)]
    check_config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_target(false)
        .init();
    let config = match args.check_config.as_ref().or(args.config.as_ref()) {
        None => Config::default(),
        Some(path) => match Config::load(path) {
            Ok(c) => c,
            Err(errs) => {
                let errs: Vec<String> = errs.iter().map(ToString::to_string).collect();
                return lockmesh_runtime::report_config_errors(BINARY, &path.display().to_string(), &errs);
            }
        },
    };
    if let Some(path) = &args.check_config {
        // What it selects and excludes, one line each.
        for line in config.selection() {
            println!("{line}");
        }
        eprintln!("{} is valid", path.display());
        return ExitCode::SUCCESS;
    }
    let (Some(cert), Some(key)) = (args.tls_cert, args.tls_key) else {
        eprintln!("--tls-cert and --tls-key are required");
        return ExitCode::from(lockmesh_runtime::EX_USAGE);
    };
    let certs = match server::CertFiles::load(&cert, &key) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("cannot load the serving certificate: {e}");
            return ExitCode::from(lockmesh_runtime::EX_USAGE);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("cannot listen on {}: {e}", args.listen);
                return ExitCode::FAILURE;
            }
        };
        match listener.local_addr() {
            Ok(addr) => println!("listening on {addr}"),
            Err(e) => {
                eprintln!("cannot read the bound address: {e}");
                return ExitCode::FAILURE;
            }
        }
        match server::run(listener, certs, Arc::new(config), lockmesh_runtime::shutdown()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("webhook failed: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
