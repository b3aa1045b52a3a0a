//! `lockmesh-demo-store --listen 127.0.0.1:18070 --data run/store/data.json`: the
//! quick start's key-value store behind fence-proxy (`lockmesh_tests::demo_store`).
//! Stops on SIGTERM or SIGINT. Exits 64 on invalid arguments, 1 on any other failure.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};

/// Exit code for invalid arguments (EX_USAGE).
const EX_USAGE: u8 = 64;

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(about = "The lockmesh quick start's demo key-value store (plain HTTP)")]
struct Args {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:18070")]
    listen: SocketAddr,
    /// The data file (JSON; read at start, rewritten after each change).
    #[arg(long)]
    data: PathBuf,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(EX_USAGE) } else { ExitCode::SUCCESS };
        }
    };
    match serve(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockmesh-demo-store: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("bind {}", args.listen))?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    println!("demo store on http://{} (data {})", args.listen, args.data.display());
    lockmesh_tests::demo_store::run(listener, args.data, shutdown).await
}
