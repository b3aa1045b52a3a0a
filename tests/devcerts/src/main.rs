//! `lockmesh-devcerts`: writes the development PKI for the local demo.
//!
//! ```text
//! lockmesh-devcerts --out run/certs --trust-domain lockmesh.local \
//!     --client payments/worker --client payments/reporter --client billing/job
//! ```
//!
//! Writes the CA, Envoy's and the arbiter's server certs, Envoy's client cert,
//! one client cert per `--client <namespace>/<service account>` and a rogue
//! cert (see `lockmesh_devcerts`) and the Ed25519 grant signing key pair
//! (`grant-signing-key.pem`, `grant-signing-pub.pem`), then prints every file. Existing files
//! are kept, so running it again changes nothing. Exits 64 on invalid
//! arguments and 1 on any other failure.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::Parser;
use lockmesh_devcerts::DevPki;

/// Exit code for invalid arguments (EX_USAGE).
const EX_USAGE: u8 = 64;

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(about = "Write the lockmesh development PKI (idempotent)")]
struct Args {
    /// Output directory (created if missing).
    #[arg(long, default_value = "run/certs")]
    out: PathBuf,
    /// SPIFFE trust domain of every identity.
    #[arg(long, default_value = "lockmesh.local")]
    trust_domain: String,
    /// A workload as `<namespace>/<service account>`; repeatable.
    #[arg(long = "client", value_name = "NS/SA", value_parser = parse_client)]
    clients: Vec<(String, String)>,
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            // --help and --version also arrive here, on stdout.
            return if e.use_stderr() { ExitCode::from(EX_USAGE) } else { ExitCode::SUCCESS };
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockmesh-devcerts: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let pki = DevPki::generate(&args.out, &args.trust_domain)
        .with_context(|| format!("generate PKI in {}", args.out.display()))?;
    let signing = lockmesh_devcerts::signing::ensure_signing_key(&args.out).context("grant signing key")?;
    println!("# grant signing key {} -> {}", signing.kid, signing.key_file.display());
    println!("{}", signing.pub_file.display());
    for (ns, sa) in &args.clients {
        let cert = pki.client(ns, sa)?;
        println!("# {} -> {}", cert.spiffe_id, cert.cert_path.display());
    }
    for file in pki.files()? {
        println!("{}", file.display());
    }
    Ok(())
}

/// Parses `<namespace>/<service account>`.
fn parse_client(value: &str) -> Result<(String, String), String> {
    match value.split_once('/') {
        Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => Ok((ns.to_owned(), sa.to_owned())),
        _ => Err("expected <namespace>/<service account>".to_owned()),
    }
}
