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
//!
//! Rotation (issue #16):
//!
//! ```text
//! lockmesh-devcerts --out run/certs --ttl 2m          # every leaf reissued, valid 2 minutes, same CA
//! lockmesh-devcerts --out run/certs-ca2                # a second CA (and its leaves) in another directory
//! lockmesh-devcerts bundle --out run/both.pem run/certs/ca.pem run/certs-ca2/ca.pem
//! ```
//!
//! `--ttl` takes a number with a unit (`s`, `m`, `h`, `d`). `bundle` writes the
//! CA files given into one trust bundle, in order (old and new CA during a roll).

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
    /// Reissue every leaf (server and client certificates) valid for this long
    /// from now (`90s`, `5m`, `2h`, `1d`), under the existing CA: a rotation.
    #[arg(long, value_name = "DURATION", value_parser = parse_ttl)]
    ttl: Option<std::time::Duration>,
    #[command(subcommand)]
    command: Option<Command>,
}

/// Subcommands beside generating the PKI.
#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Join CA files into one trust bundle (a CA roll's overlap: old and new).
    Bundle {
        /// The bundle to write.
        #[arg(long)]
        out: PathBuf,
        /// CA files (PEM), in the order they are written.
        #[arg(required = true)]
        cas: Vec<PathBuf>,
    },
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
    if let Some(Command::Bundle { out, cas }) = &args.command {
        lockmesh_devcerts::write_bundle(out, cas).with_context(|| format!("write bundle {}", out.display()))?;
        println!("{}", out.display());
        return Ok(());
    }
    let pki = match args.ttl {
        None => DevPki::generate(&args.out, &args.trust_domain),
        Some(ttl) => DevPki::generate_with_ttl(&args.out, &args.trust_domain, ttl),
    }
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

/// Parses a duration: a positive number and a unit, `s`, `m`, `h` or `d`.
fn parse_ttl(value: &str) -> Result<std::time::Duration, String> {
    let split = value.find(|c: char| !c.is_ascii_digit()).unwrap_or(value.len());
    let (n, unit) = value.split_at(split);
    let n: u64 = n.parse().map_err(|_| "expected a number and a unit: 90s, 5m, 2h, 1d".to_owned())?;
    let secs = match unit {
        "s" => Some(n),
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        "d" => n.checked_mul(86_400),
        _ => return Err("the unit must be s, m, h or d".to_owned()),
    };
    match secs {
        Some(s) if s > 0 => Ok(std::time::Duration::from_secs(s)),
        Some(_) => Err("a ttl must be longer than zero".to_owned()),
        None => Err("too long".to_owned()),
    }
}

/// Parses `<namespace>/<service account>`.
fn parse_client(value: &str) -> Result<(String, String), String> {
    match value.split_once('/') {
        Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => Ok((ns.to_owned(), sa.to_owned())),
        _ => Err("expected <namespace>/<service account>".to_owned()),
    }
}
