//! The pause test kit (ADR-17), behind `lockmesh-pausekit`.
//!
//! Against a real resource behind a fence it:
//! 1. starts a holder child process (`lockmesh-pausekit holder`) that acquires the
//!    key through the lock tier (HTTP API, mTLS) and writes `<run>-first` with its
//!    token and proof;
//! 2. freezes the child with SIGSTOP and keeps it frozen past its class TTL;
//! 3. acquires the key itself (granted once the child's session expired) and writes
//!    `<run>-second`;
//! 4. resumes the child (SIGCONT), which writes `<run>-late` with its old grant;
//! 5. reads the resource back and writes a [`PauseTestResult`] (YAML, or JSON for a
//!    `.json` path). Pass: the late write was refused and the resource does not hold
//!    it.
//!
//! The resource is HTTP: `PUT <url>` writes the body, `GET <url>` reads it back.
//! Progress goes to stderr; tokens and proofs are never printed.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    process::{Child, ChildStdout, Command, Stdio},
    time::Duration,
};

use tokio::time::Instant;

use lockmesh_core::{
    headers,
    pause::{PauseEvidence, PauseTestResult, MAX_VALIDITY_S, SCHEMA_VERSION},
};

/// How the kit reaches the lock tier and the resource.
#[derive(Clone, Debug, clap::Args)]
pub struct Target {
    /// The lock tier, `https://localhost:<port>` (Envoy's listener).
    #[arg(long)]
    pub lock_url: String,
    /// CA bundle the lock tier's certificate chains to.
    #[arg(long)]
    pub ca: PathBuf,
    /// Client certificate (PEM) of the workload identity that acquires.
    #[arg(long)]
    pub cert: PathBuf,
    /// Its private key (PEM).
    #[arg(long)]
    pub key: PathBuf,
    /// The lock key guarding the resource.
    #[arg(long)]
    pub lock_key: String,
    /// The resource URL (`PUT` writes, `GET` reads), e.g. through fence-proxy.
    #[arg(long)]
    pub resource_url: String,
}

/// One acquired grant.
#[derive(Clone, Debug)]
pub struct Grant {
    /// Token (decimal).
    pub token: String,
    /// Proof text, if the arbiter signs.
    pub proof: Option<String>,
    /// Class TTL, seconds.
    pub ttl_s: u64,
    /// Class name.
    pub class: String,
}

/// An HTTP client for the lock tier and the resource.
pub struct Kit {
    target: Target,
    http: reqwest::Client,
    plain: reqwest::Client,
}

// === impl Kit ===

impl Kit {
    /// Builds the mTLS client. `localhost` resolves to 127.0.0.1.
    pub fn new(target: Target) -> anyhow::Result<Self> {
        let ca = std::fs::read(&target.ca)?;
        let mut pem = std::fs::read(&target.cert)?;
        pem.push(b'\n');
        pem.extend(std::fs::read(&target.key)?);
        let url = reqwest::Url::parse(&target.lock_url)?;
        let port = url.port().unwrap_or(443);
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&ca)?)
            .identity(reqwest::Identity::from_pem(&pem)?)
            .resolve("localhost", SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            .timeout(Duration::from_secs(60))
            .build()?;
        let plain = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
        Ok(Self { target, http, plain })
    }

    /// Acquires the lock key, waiting up to `wait_ms`.
    pub async fn acquire(&self, wait_ms: u64) -> anyhow::Result<Grant> {
        let r = self
            .http
            .post(format!("{}/v1/locks/acquire", self.target.lock_url))
            .header(headers::KEY, &self.target.lock_key)
            .header(headers::WAIT_MS, wait_ms.to_string())
            .send()
            .await?;
        let status = r.status();
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        anyhow::ensure!(status.is_success(), "acquire answered {status} {}", v["code"]);
        let s = |f: &str| v[f].as_str().map(str::to_owned);
        Ok(Grant {
            token: s("token").ok_or_else(|| anyhow::anyhow!("acquire answer has no token"))?,
            proof: s("proof"),
            ttl_s: v["ttl_s"].as_u64().unwrap_or(0),
            class: s("class").unwrap_or_default(),
        })
    }

    /// Releases a grant (best effort cleanup).
    pub async fn release(&self, g: &Grant) {
        let _ = self
            .http
            .post(format!("{}/v1/locks/release", self.target.lock_url))
            .header(headers::KEY, &self.target.lock_key)
            .header(headers::TOKEN, &g.token)
            .send()
            .await;
    }

    /// Writes `value` with the grant; returns the HTTP status.
    pub async fn write(&self, g: &Grant, value: &str) -> anyhow::Result<u16> {
        let mut req = self.plain.put(&self.target.resource_url).header(headers::TOKEN, &g.token).body(value.to_owned());
        if let Some(p) = &g.proof {
            req = req.header(headers::PROOF, p);
        }
        Ok(req.send().await?.status().as_u16())
    }

    /// Reads the resource's current value.
    pub async fn read(&self) -> anyhow::Result<String> {
        Ok(self.plain.get(&self.target.resource_url).send().await?.text().await?)
    }
}

/// The holder child: acquire, write `<run>-first`, report, wait for `GO` on stdin,
/// write `<run>-late`, report. Protocol lines on stdout: `ACQUIRED <token> <ttl_s>
/// <class>`, `WROTE <status>`, `LATE <status>`.
pub async fn holder(target: Target, run: &str) -> anyhow::Result<()> {
    let kit = Kit::new(target)?;
    let g = kit.acquire(10_000).await?;
    let mut out = std::io::stdout();
    writeln!(out, "ACQUIRED {} {} {}", g.token, g.ttl_s, g.class)?;
    let st = kit.write(&g, &format!("{run}-first")).await?;
    writeln!(out, "WROTE {st}")?;
    out.flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let st = kit.write(&g, &format!("{run}-late")).await.unwrap_or(0);
    writeln!(out, "LATE {st}")?;
    out.flush()?;
    Ok(())
}

struct Progress(Vec<String>, Instant);

impl Progress {
    fn step(&mut self, s: impl Into<String>) {
        let s = format!("[{:>6.1}s] {}", self.1.elapsed().as_secs_f64(), s.into());
        eprintln!("pausekit: {s}");
        self.0.push(s);
    }
}

fn read_line(r: &mut BufReader<ChildStdout>, prefix: &str) -> anyhow::Result<Vec<String>> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let parts: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
    anyhow::ensure!(
        parts.first().map(String::as_str) == Some(prefix),
        "holder said {:?}, expected {prefix}",
        line.trim()
    );
    Ok(parts[1..].to_vec())
}

fn signal(child: &Child, sig: &str) -> anyhow::Result<()> {
    let st = Command::new("kill").arg(format!("-{sig}")).arg(child.id().to_string()).status()?;
    anyhow::ensure!(st.success(), "kill -{sig} {} failed", child.id());
    Ok(())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Runs the whole test and returns the result document (also on a failed verdict).
pub async fn run(target: Target, validity_s: u64) -> anyhow::Result<PauseTestResult> {
    let run = format!("run{:08x}", rand::random::<u32>());
    let mut p = Progress(Vec::new(), Instant::now());
    let kit = Kit::new(target.clone())?;
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .arg("holder")
        .args(["--lock-url", &target.lock_url, "--lock-key", &target.lock_key, "--resource-url", &target.resource_url])
        .arg("--ca")
        .arg(&target.ca)
        .arg("--cert")
        .arg(&target.cert)
        .arg("--key")
        .arg(&target.key)
        .args(["--run", &run])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let result = drive(&kit, &mut child, &run, &mut p).await;
    // Whatever happened, leave no frozen child behind.
    let _ = signal(&child, "CONT");
    let _ = child.kill();
    let _ = child.wait();
    let (ev, class, second) = result?;
    kit.release(&second).await;
    let verdict = PauseTestResult::verdict_of(&ev);
    let now = unix_now();
    Ok(PauseTestResult {
        schema_version: SCHEMA_VERSION.into(),
        class,
        resource: target.resource_url.clone(),
        time_unix_s: now,
        expires_unix_s: now + validity_s.clamp(1, MAX_VALIDITY_S),
        verdict,
        evidence: ev,
    })
}

async fn drive(
    kit: &Kit,
    child: &mut Child,
    run: &str,
    p: &mut Progress,
) -> anyhow::Result<(PauseEvidence, String, Grant)> {
    let mut out = BufReader::new(child.stdout.take().ok_or_else(|| anyhow::anyhow!("no child stdout"))?);
    let a = tokio::task::block_in_place(|| read_line(&mut out, "ACQUIRED"))?;
    let (t1, ttl_s, class) = (
        a.first().cloned().unwrap_or_default(),
        a.get(1).and_then(|s| s.parse().ok()).unwrap_or(0u64),
        a.get(2).cloned().unwrap_or_default(),
    );
    p.step(format!("holder {} acquired (class {class}, ttl {ttl_s}s)", child.id()));
    let w = tokio::task::block_in_place(|| read_line(&mut out, "WROTE"))?;
    let first_write_status: u16 = w.first().and_then(|s| s.parse().ok()).unwrap_or(0);
    p.step(format!("holder wrote {run}-first: {first_write_status}"));
    signal(child, "STOP")?;
    let paused_at = Instant::now();
    p.step("holder frozen (SIGSTOP); waiting for its session to expire and acquiring as the second holder");
    let wait_ms = (ttl_s + 15) * 1000;
    let second = kit.acquire(wait_ms.min(30_000)).await?;
    // Make sure the pause lasts past the TTL even if the grant came early.
    let min_pause = Duration::from_millis(ttl_s * 1000 + 500);
    if paused_at.elapsed() < min_pause {
        tokio::time::sleep(min_pause - paused_at.elapsed()).await;
    }
    p.step(format!("second holder acquired after {} ms", paused_at.elapsed().as_millis()));
    let second_write_status = kit.write(&second, &format!("{run}-second")).await?;
    p.step(format!("second holder wrote {run}-second: {second_write_status}"));
    let paused_ms = u64::try_from(paused_at.elapsed().as_millis()).unwrap_or(u64::MAX);
    signal(child, "CONT")?;
    p.step(format!("holder resumed (SIGCONT) after {paused_ms} ms; it writes {run}-late with its old grant"));
    let stdin = child.stdin.as_mut().ok_or_else(|| anyhow::anyhow!("no child stdin"))?;
    writeln!(stdin, "GO")?;
    stdin.flush()?;
    let l = tokio::task::block_in_place(|| read_line(&mut out, "LATE"))?;
    let late_write_status: u16 = l.first().and_then(|s| s.parse().ok()).unwrap_or(0);
    p.step(format!("late write answered {late_write_status}"));
    let value = kit.read().await?;
    let resource_saw_late_write = value.contains(&format!("{run}-late"));
    p.step(format!("resource now holds {value:?}"));
    let t2: u64 = second.token.parse().unwrap_or(0);
    let t1: u64 = t1.parse().unwrap_or(u64::MAX);
    let ev = PauseEvidence {
        ttl_s,
        paused_ms,
        first_write_status,
        second_write_status,
        late_write_status,
        second_token_greater: t2 > t1,
        resource_saw_late_write,
        steps: std::mem::take(&mut p.0),
    };
    Ok((ev, class, second))
}

/// Writes `doc` as YAML, or JSON when `path` ends in `.json`.
pub fn write_doc(doc: &PauseTestResult, path: &std::path::Path) -> anyhow::Result<()> {
    let text = if path.extension().is_some_and(|e| e == "json") {
        serde_json::to_string_pretty(doc)?
    } else {
        serde_yaml::to_string(doc)?
    };
    std::fs::write(path, text)?;
    Ok(())
}
