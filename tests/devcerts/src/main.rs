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
//!
//! Operators of the quick start (docs/QUICKSTART.md):
//!
//! ```text
//! lockmesh-devcerts operator --out run/operators --issuer https://idp.lockmesh.local \
//!     --sub alice --sub bob --valid 12h
//! ```
//!
//! keeps (or writes) the issuer key `issuer-key.pem`, writes its `jwks.json` and
//! mints `<sub>.jwt` afresh for each `--sub` (mode 0600; claims:
//! `lockmesh_devcerts::jwt::operator_claims`).

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
    /// A dev identity provider: its JWKS and a fresh operator token per --sub.
    Operator {
        /// Output directory (issuer-key.pem, jwks.json, <sub>.jwt).
        #[arg(long)]
        out: PathBuf,
        /// The tokens' `iss` (the arbiter's `operators.issuer`).
        #[arg(long)]
        issuer: String,
        /// An operator's `sub`; repeatable.
        #[arg(long = "sub", required = true, value_parser = parse_sub)]
        subs: Vec<String>,
        /// How long each token is valid (`exp` - `iat`).
        #[arg(long, default_value = "12h", value_parser = parse_ttl)]
        valid: std::time::Duration,
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
    if let Some(Command::Operator { out, issuer, subs, valid }) = &args.command {
        return operators(out, issuer, subs, *valid);
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

/// Key id of the dev operator issuer's key.
const OPERATOR_KID: &str = "dev-operators";

/// `operator`: the issuer's JWKS and one token per operator.
fn operators(out: &std::path::Path, issuer: &str, subs: &[String], valid: std::time::Duration) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let idp = lockmesh_devcerts::jwt::ensure_issuer(out, OPERATOR_KID)?;
    let jwks = out.join("jwks.json");
    std::fs::write(&jwks, idp.jwks()).with_context(|| format!("write {}", jwks.display()))?;
    println!("{}", jwks.display());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).context("clock")?.as_secs();
    for sub in subs {
        let claims = lockmesh_devcerts::jwt::operator_claims(issuer, sub, now, valid.as_secs());
        let token = idp.token(&claims).map_err(|e| anyhow::anyhow!("sign the token of {sub}: {e}"))?;
        let file = out.join(format!("{sub}.jwt"));
        let tmp = out.join(format!("{sub}.jwt.tmp"));
        let mut f = std::fs::File::options()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("create {}", tmp.display()))?;
        std::io::Write::write_all(&mut f, token.as_bytes())?;
        std::fs::rename(&tmp, &file).with_context(|| format!("write {}", file.display()))?;
        println!("# operator {sub} -> {}", file.display());
    }
    Ok(())
}

/// Parses an operator's `sub` (it names a file): `[a-z0-9-]`, 1 to 64 characters.
fn parse_sub(value: &str) -> Result<String, String> {
    let ok = (1..=64).contains(&value.len())
        && value.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(value.to_owned())
    } else {
        Err("an operator name is 1 to 64 characters of a-z, 0-9 and -".to_owned())
    }
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
