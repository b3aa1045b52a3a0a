//! `lockmesh-pausekit run ... --out result.yaml`: the pause test kit (ADR-17; see
//! `lockmesh_fence_proxy::pause`). Exits 0 when the verdict is pass, 1 when it is
//! fail (the document is written either way), 2 when the run itself failed, 64 on
//! invalid arguments. The resource is an HTTP URL, a `postgres://` URL (the
//! PostgreSQL reference fence) or `s3://bucket/prefix` (the S3 reference fence, at
//! `--s3-endpoint`; credentials from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`).

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use lockmesh_core::pause::Verdict;
use lockmesh_fence_proxy::pause::{self, Target};

/// The lockmesh pause test kit.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the pause test and write the result document.
    Run {
        #[command(flatten)]
        target: Target,
        /// Where to write the PauseTestResult (`.json` for JSON, else YAML).
        #[arg(long)]
        out: PathBuf,
        /// How long the result stays valid, seconds (at most 90 days).
        #[arg(long, default_value_t = 30 * 24 * 3600)]
        validity_s: u64,
    },
    /// The holder child (started by `run`).
    #[command(hide = true)]
    Holder {
        #[command(flatten)]
        target: Target,
        /// Run id (value prefix).
        #[arg(long)]
        run: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(lockmesh_runtime::EX_USAGE) } else { ExitCode::SUCCESS };
        }
    };
    match args.cmd {
        Cmd::Holder { target, run } => match pause::holder(target, &run).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("pausekit holder: {:#}", anyhow::Error::from(e));
                ExitCode::from(2)
            }
        },
        Cmd::Run { target, out, validity_s } => {
            let doc = match pause::run(target, validity_s).await {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("pausekit: the run failed: {:#}", anyhow::Error::from(e));
                    return ExitCode::from(2);
                }
            };
            if let Err(e) = pause::write_doc(&doc, &out) {
                eprintln!("pausekit: cannot write {}: {:#}", out.display(), anyhow::Error::from(e));
                return ExitCode::from(2);
            }
            eprintln!("pausekit: verdict {:?}, written to {}", doc.verdict, out.display());
            if doc.verdict == Verdict::Pass {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
    }
}
