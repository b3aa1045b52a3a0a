//! `lockmesh-fence-bench`: fence-proxy's overhead against going straight to the
//! store, in one run (docs/BENCHMARKS.md, "fence-proxy overhead").
//!
//! ```text
//! cargo build -p lockmesh-fence-proxy -p lockmesh-tests --bin lockmesh-fence-bench
//! target/debug/lockmesh-fence-bench --seconds 5 --concurrency 8 --rounds 2
//! ```
//!
//! It starts the harness's HTTP key-value store ([`KvStore`]) and a real
//! fence-proxy process in front of it, trusting a freshly generated grant signing
//! key, then runs C clients, each writing (`PUT`) its own resource in a closed loop,
//! in three workloads per round:
//! - `direct`: straight to the store;
//! - `fence-equal`: through fence-proxy on an `equal: allow` route, every write
//!   carrying the same valid grant (proof verified, mark read, no mark write);
//! - `fence-advance`: through fence-proxy on a `strict` route, every write with a
//!   new, higher grant (proof verified, mark advanced and fsynced, then forwarded).
//!
//! Grants are signed here with the key fence-proxy trusts, as the arbiter would.
//! Exits 64 on invalid arguments, 1 on a failure or any write that was not 200.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use ed25519_dalek::pkcs8::DecodePrivateKey as _;
use lockmesh_core::{proof, ClassName, FencingToken, LockKey};
use lockmesh_tests::fence::{ensure_signing_key, FenceProxyProcess, KvStore};
use tokio::time::Instant;

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(about = "fence-proxy throughput and latency against the bare store, same run")]
struct Args {
    /// Measured seconds per workload and round (at most 120).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Unmeasured seconds before each measurement.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Concurrent clients, each writing its own resource (1 to 256).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Rounds of the three workloads (interleaved, so drift hits all alike).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Body bytes per write.
    #[arg(long, default_value_t = 128)]
    body_bytes: usize,
}

const ROUTES: &str = "routes:\n  - name: eq\n    path: /eq/{id}\n    resource: \"eq/{id}\"\n    lock_key: \"bench/eq/{id}\"\n    equal: allow\n  - name: adv\n    path: /adv/{id}\n    resource: \"adv/{id}\"\n    lock_key: \"bench/adv/{id}\"";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Workload {
    Direct,
    FenceEqual,
    FenceAdvance,
}

struct Minter {
    key: ed25519_dalek::SigningKey,
    kid: proof::KeyId,
    class: ClassName,
}

#[derive(Default)]
struct Sample {
    writes: u64,
    lat_us: Vec<u32>,
}

// === impl Minter ===

impl Minter {
    fn proof(&self, lock_key: &str, token: u64) -> Result<String> {
        let key = LockKey::parse(lock_key.as_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
        let tok = FencingToken::from_packed(token).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(proof::sign(&self.key, &self.kid, &proof::GrantClaims::new(&key, tok, self.class.clone())))
    }
}

// === impl Workload ===

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Direct => "direct",
            Workload::FenceEqual => "fence-equal",
            Workload::FenceAdvance => "fence-advance",
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(64) } else { ExitCode::SUCCESS };
        }
    };
    if !(0.5..=120.0).contains(&args.seconds) || !(1..=256).contains(&args.concurrency) || args.rounds == 0 {
        eprintln!("lockmesh-fence-bench: --seconds must be 0.5-120, --concurrency 1-256, --rounds at least 1");
        return ExitCode::from(64);
    }
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockmesh-fence-bench: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let sk = ensure_signing_key(dir.path())?;
    let pem = std::fs::read_to_string(&sk.key_file)?;
    let minter = Arc::new(Minter {
        key: ed25519_dalek::SigningKey::from_pkcs8_pem(&pem).context("signing key")?,
        kid: proof::KeyId::parse(&sk.kid).map_err(|e| anyhow::anyhow!("{e}"))?,
        class: ClassName::parse("default").map_err(|e| anyhow::anyhow!("{e}"))?,
    });
    let store = KvStore::start().await?;
    let fence = FenceProxyProcess::builder(store.port()).trust(&sk.kid, &sk.pub_file).routes(ROUTES).start().await?;
    let direct = format!("http://127.0.0.1:{}", store.port());
    eprintln!(
        "fence-bench: {} clients, {}s per workload, {} rounds; store :{}, fence-proxy :{}",
        args.concurrency,
        args.seconds,
        args.rounds,
        store.port(),
        fence.port()
    );
    let mut totals: Vec<(Workload, Sample)> = Vec::new();
    let mut next_token = 1_000u64;
    for round in 1..=args.rounds {
        for w in [Workload::Direct, Workload::FenceEqual, Workload::FenceAdvance] {
            let base = if w == Workload::Direct { direct.clone() } else { fence.url() };
            let s = measure(&args, w, &base, &minter, &mut next_token).await?;
            let secs = args.seconds;
            eprintln!("fence-bench: round {round} {:<13} {:>8.0} writes/s", w.name(), s.writes as f64 / secs);
            match totals.iter_mut().find(|(x, _)| *x == w) {
                Some((_, t)) => {
                    t.writes += s.writes;
                    t.lat_us.extend(s.lat_us);
                }
                None => totals.push((w, s)),
            }
        }
    }
    let secs = args.seconds * args.rounds as f64;
    let direct_rate = totals.first().map_or(0.0, |(_, s)| s.writes as f64 / secs);
    println!("| workload | writes/s | ratio to direct | p50 ms | p99 ms |");
    println!("|---|---|---|---|---|");
    for (w, s) in &mut totals {
        s.lat_us.sort_unstable();
        let q = |p: f64| s.lat_us.get(((s.lat_us.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0) as f64 / 1e3;
        let rate = s.writes as f64 / secs;
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.2} |",
            w.name(),
            rate,
            rate / direct_rate.max(f64::MIN_POSITIVE),
            q(0.5),
            q(0.99)
        );
    }
    Ok(())
}

async fn measure(args: &Args, w: Workload, base: &str, m: &Arc<Minter>, next: &mut u64) -> Result<Sample> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(args.concurrency).build()?;
    let body = "x".repeat(args.body_bytes);
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..args.concurrency {
        // Tokens: the equal workload uses one grant per client; the advancing one
        // hands each client its own increasing range, above every earlier round's.
        let first = *next + (c as u64) * 10_000_000;
        let (http, body, stop, measuring, m) = (http.clone(), body.clone(), stop.clone(), measuring.clone(), m.clone());
        let (path, lock_key) = match w {
            Workload::Direct | Workload::FenceEqual => (format!("{base}/eq/{c}"), format!("bench/eq/{c}")),
            Workload::FenceAdvance => (format!("{base}/adv/{c}"), format!("bench/adv/{c}")),
        };
        tasks.push(tokio::spawn(async move {
            let mut s = Sample::default();
            let mut token = first;
            let mut proof = m.proof(&lock_key, token)?;
            while !stop.load(Ordering::Relaxed) {
                if w == Workload::FenceAdvance {
                    token += 1;
                    proof = m.proof(&lock_key, token)?;
                }
                let t0 = Instant::now();
                let r = http
                    .put(&path)
                    .header("x-lock-token", token.to_string())
                    .header("x-lock-proof", &proof)
                    .body(body.clone())
                    .send()
                    .await?;
                let status = r.status().as_u16();
                let _ = r.bytes().await?;
                ensure!(status == 200, "{} write answered {status}", w.name());
                if measuring.load(Ordering::Relaxed) {
                    s.writes += 1;
                    s.lat_us.push(u32::try_from(t0.elapsed().as_micros()).unwrap_or(u32::MAX));
                }
            }
            anyhow::Ok(s)
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(args.warmup)).await;
    measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let mut total = Sample::default();
    for t in tasks {
        let s = t.await??;
        total.writes += s.writes;
        total.lat_us.extend(s.lat_us);
    }
    *next += (args.concurrency as u64 + 1) * 10_000_000;
    Ok(total)
}
