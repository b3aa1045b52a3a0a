//! `lockmesh-inject [-f FILE|-] [--config injector.yaml] [--no-network-policy]`
//! rewrites Kubernetes manifests with fence-proxy injected into every opted-in
//! Pod, Deployment and StatefulSet (like `istioctl kube-inject`), writing the
//! result to stdout (or `-o FILE`). Warnings go to stderr. Exit 0 on success, 64
//! for an invalid configuration, 65 (EX_DATAERR) when an object is refused or the
//! input is not YAML, 1 for I/O failures.

use std::{io::Read, path::PathBuf, process::ExitCode};

use clap::Parser;
use lockmesh_sidecar::{manifest, Config};

/// Inject lockmesh's fence-proxy into Kubernetes manifests.
#[derive(Parser)]
#[command(version, about)]
struct Args {
    /// Input manifest (multi-document YAML); `-` reads stdin.
    #[arg(short = 'f', long = "filename", default_value = "-")]
    input: String,
    /// Output file; stdout when absent.
    #[arg(short = 'o', long)]
    output: Option<PathBuf>,
    /// Injector configuration (image, ports, resources); defaults when absent.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Validate this injector configuration and exit.
    #[arg(long)]
    check_config: Option<PathBuf>,
    /// Do not append the NetworkPolicy for each injected backend port.
    #[arg(long)]
    no_network_policy: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = match args.check_config.as_ref().or(args.config.as_ref()) {
        None => Config::default(),
        Some(path) => match Config::load(path) {
            Ok(c) => c,
            Err(errs) => {
                let errs: Vec<String> = errs.iter().map(ToString::to_string).collect();
                return lockmesh_runtime::report_config_errors("lockmesh-inject", &path.display().to_string(), &errs);
            }
        },
    };
    if let Some(path) = &args.check_config {
        // What it selects and excludes, one line each.
        for line in config.selection() {
            println!("{line}");
        }
        eprintln!("lockmesh-inject: {} is valid", path.display());
        return ExitCode::SUCCESS;
    }
    let text = if args.input == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map(|_| s)
    } else {
        std::fs::read_to_string(&args.input)
    };
    let text = match text {
        Ok(t) => t,
        Err(e) => {
            eprintln!("lockmesh-inject: cannot read {}: {e}", args.input);
            return ExitCode::FAILURE;
        }
    };
    let options = manifest::Options { network_policies: !args.no_network_policy };
    let out = match manifest::rewrite(&text, &config, options) {
        Ok(out) => out,
        Err(errs) => {
            eprintln!("lockmesh-inject: {} refused ({} errors):", args.input, errs.len());
            errs.iter().for_each(|e| eprintln!("  {e}"));
            return ExitCode::from(65);
        }
    };
    out.warnings.iter().for_each(|w| eprintln!("lockmesh-inject: warning: {w}"));
    let written = match &args.output {
        Some(path) => std::fs::write(path, &out.yaml),
        None => std::io::Write::write_all(&mut std::io::stdout(), out.yaml.as_bytes()),
    };
    if let Err(e) = written {
        eprintln!("lockmesh-inject: cannot write the output: {e}");
        return ExitCode::FAILURE;
    }
    eprintln!("lockmesh-inject: injected {} object(s)", out.injected);
    ExitCode::SUCCESS
}
