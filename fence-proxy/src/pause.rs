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
//! The resource is HTTP (`PUT <url>` writes the body, `GET <url>` reads it back,
//! e.g. through fence-proxy), or the PostgreSQL reference fence when the URL is
//! `postgres://...`: row `<lock key>` of `--pg-table`, written with the fenced
//! statement of [`crate::store::postgres`] (strict); an applied write counts as
//! 200, a stale one as 409.
//!
//! Or the S3 reference fence ([`crate::store::s3`]) when the URL is
//! `s3://<bucket>/<prefix>`: object `<prefix>/<lock key>` at `--s3-endpoint`
//! (`AWS_ENDPOINT_URL_S3`; path-style), credentials from `AWS_ACCESS_KEY_ID` /
//! `AWS_SECRET_ACCESS_KEY`. There the holder is frozen *inside* its late write:
//! it reads the object and checks its token (`PREPARED`), and only after SIGCONT
//! sends the conditional PUT. That is the window a check-then-write fence cannot
//! close; only the `If-Match` on the ETag read before the pause refuses the write.
//! The S3 writes use `allow` for equal tokens so that the holder's second write
//! under its grant passes the check and reaches that PUT (under `strict` the check
//! alone would refuse it, and the conditional header would go untested); a strict
//! fence refuses everything an allow fence refuses. Progress goes to stderr;
//! tokens and proofs are never printed.

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

use crate::{
    route::EqualRule,
    store::postgres::{self, PgFence, PgFenceError, WriteOutcome},
    store::s3::{self, Credentials, S3Client, S3Fence, S3FenceError},
};

/// Default `--pg-table`.
pub(crate) const DEFAULT_PG_TABLE: &str = "lockmesh_pause_test";

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
    /// The resource URL (`PUT` writes, `GET` reads), e.g. through fence-proxy; or a
    /// `postgres://` URL for the PostgreSQL reference fence.
    #[arg(long)]
    pub resource_url: String,
    /// With a `postgres://` resource: the fenced table (created if missing); the
    /// row is the lock key.
    #[arg(long, default_value = DEFAULT_PG_TABLE)]
    pub pg_table: String,
    /// With an `s3://bucket/prefix` resource: the S3 endpoint, `http(s)://host[:port]`
    /// (path-style requests). Default `https://s3.<region>.amazonaws.com`.
    #[arg(long, env = "AWS_ENDPOINT_URL_S3")]
    pub s3_endpoint: Option<String>,
    /// With an `s3://` resource: the region requests are signed for.
    #[arg(long, env = "AWS_REGION", default_value = "us-east-1")]
    pub s3_region: String,
    /// Test builds only: plant a fault in the S3 fence (`omit-condition`:
    /// PUTs without `If-Match`; `token-in-metadata`: no envelope).
    #[cfg(feature = "test-faults")]
    #[arg(long, hide = true)]
    pub s3_planted_fault: Option<String>,
}

/// Why the kit could not run (a failed verdict is not an error).
#[derive(Debug, thiserror::Error)]
pub enum KitError {
    /// A certificate, key or CA file could not be read.
    #[error("cannot read {0}")]
    Read(String, #[source] std::io::Error),
    /// The TLS client could not be built from the CA, certificate and key.
    #[error("tls client")]
    Tls(#[source] reqwest::Error),
    /// An argument is not usable.
    #[error("{0}")]
    BadArgument(String),
    /// The lock tier refused the acquire.
    #[error("acquire answered {status} {code}")]
    Acquire {
        /// HTTP status.
        status: u16,
        /// The `code` of the answer.
        code: String,
    },
    /// A request to the lock tier or the HTTP resource failed.
    #[error("{0} request failed")]
    Http(&'static str, #[source] reqwest::Error),
    /// The PostgreSQL resource failed.
    #[error(transparent)]
    Postgres(#[from] PgFenceError),
    /// The S3 resource failed.
    #[error(transparent)]
    S3(#[from] S3FenceError),
    /// The holder child broke the line protocol, or signalling it failed.
    #[error("{0}")]
    Holder(String),
    /// I/O with the holder child or the result file.
    #[error("i/o")]
    Io(#[from] std::io::Error),
    /// The result document could not be encoded.
    #[error("encode the result document: {0}")]
    Encode(String),
}

enum Resource {
    Http(String),
    Postgres { fence: PgFence, client: Box<tokio_postgres::Client>, row: String },
    S3 { fence: S3Fence, key: String },
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
    pub class: String,
}

/// Clients for the lock tier and the resource.
pub struct Kit {
    target: Target,
    http: reqwest::Client,
    plain: reqwest::Client,
    resource: Resource,
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// `s3://bucket/prefix` → (bucket, object key `<prefix>/<lock key>`).
fn s3_object(t: &Target) -> Result<Option<(String, String)>, KitError> {
    let Some(rest) = t.resource_url.strip_prefix("s3://") else {
        return Ok(None);
    };
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let prefix = prefix.trim_end_matches('/');
    if bucket.is_empty() || prefix.contains("//") {
        return Err(KitError::BadArgument(format!(
            "--resource-url {:?}: expected s3://<bucket>[/<prefix>]",
            t.resource_url
        )));
    }
    let key = if prefix.is_empty() { t.lock_key.clone() } else { format!("{prefix}/{}", t.lock_key) };
    Ok(Some((bucket.to_owned(), key)))
}

fn s3_endpoint(t: &Target) -> String {
    t.s3_endpoint.clone().unwrap_or_else(|| format!("https://s3.{}.amazonaws.com", t.s3_region))
}

/// What the result document names as the resource: the URL without credentials.
fn describe(t: &Target) -> String {
    if let Ok(Some((bucket, key))) = s3_object(t) {
        return format!("s3 conditional-put fence {} bucket {bucket} object {key}", s3_endpoint(t));
    }
    if !is_postgres(&t.resource_url) {
        return t.resource_url.clone();
    }
    let url = match reqwest::Url::parse(&t.resource_url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.to_string()
        }
        Err(_) => "postgres://(unparsable)".into(),
    };
    format!("postgresql reference fence {url} table {} row {}", t.pg_table, t.lock_key)
}

// === impl Kit ===

impl Kit {
    /// Builds the mTLS client and connects to the resource. `localhost` resolves
    /// to 127.0.0.1.
    pub async fn new(target: Target) -> Result<Self, KitError> {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| KitError::Read(p.display().to_string(), e));
        let ca = read(&target.ca)?;
        let mut pem = read(&target.cert)?;
        pem.push(b'\n');
        pem.extend(read(&target.key)?);
        let url = reqwest::Url::parse(&target.lock_url)
            .map_err(|e| KitError::BadArgument(format!("--lock-url {:?}: {e}", target.lock_url)))?;
        let port = url.port().unwrap_or(443);
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&ca).map_err(KitError::Tls)?)
            .identity(reqwest::Identity::from_pem(&pem).map_err(KitError::Tls)?)
            .resolve("localhost", SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(KitError::Tls)?;
        let plain = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().map_err(KitError::Tls)?;
        let resource = if let Some((bucket, key)) = s3_object(&target)? {
            let client = S3Client::new(
                &s3_endpoint(&target),
                &target.s3_region,
                Credentials::from_env().map_err(S3FenceError::Credentials)?,
            )?;
            let fence = S3Fence::try_new(client, &bucket, EqualRule::Allow)?;
            #[cfg(feature = "test-faults")]
            let fence = match target.s3_planted_fault.as_deref() {
                None => fence,
                Some("omit-condition") => fence.planted(s3::PlantedFault::OmitCondition),
                Some("token-in-metadata") => fence.planted(s3::PlantedFault::TokenInMetadata),
                Some(other) => return Err(KitError::BadArgument(format!("--s3-planted-fault {other:?}"))),
            };
            Resource::S3 { fence, key }
        } else if is_postgres(&target.resource_url) {
            let fence = PgFence::try_new(&target.pg_table, EqualRule::Strict)?;
            let client = postgres::connect(&target.resource_url).await?;
            Resource::Postgres { fence, client: Box::new(client), row: target.lock_key.clone() }
        } else {
            Resource::Http(target.resource_url.clone())
        };
        Ok(Self { target, http, plain, resource })
    }

    /// Creates the PostgreSQL resource's table if missing (a no-op for HTTP and S3).
    pub(crate) async fn prepare(&self) -> Result<(), KitError> {
        if let Resource::Postgres { fence, client, .. } = &self.resource {
            fence.ensure_table(client.as_ref()).await?;
        }
        Ok(())
    }

    /// Acquires the lock key, waiting up to `wait_ms`.
    pub async fn acquire(&self, wait_ms: u64) -> Result<Grant, KitError> {
        let r = self
            .http
            .post(format!("{}/v1/locks/acquire", self.target.lock_url))
            .header(headers::KEY, &self.target.lock_key)
            .header(headers::WAIT_MS, wait_ms.to_string())
            .send()
            .await
            .map_err(|e| KitError::Http("acquire", e))?;
        let status = r.status();
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        if !status.is_success() {
            return Err(KitError::Acquire { status: status.as_u16(), code: v["code"].to_string() });
        }
        let s = |f: &str| v[f].as_str().map(str::to_owned);
        Ok(Grant {
            token: s("token").ok_or_else(|| KitError::Holder("the acquire answer has no token".into()))?,
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

    /// Writes `value` with the grant; returns the HTTP status (PostgreSQL: 200
    /// applied, 409 stale).
    pub async fn write(&self, g: &Grant, value: &str) -> Result<u16, KitError> {
        match &self.resource {
            Resource::Http(url) => {
                let mut req = self.plain.put(url).header(headers::TOKEN, &g.token).body(value.to_owned());
                if let Some(p) = &g.proof {
                    req = req.header(headers::PROOF, p);
                }
                Ok(req.send().await.map_err(|e| KitError::Http("resource write", e))?.status().as_u16())
            }
            Resource::Postgres { fence, client, row } => {
                let token = headers::parse_token(g.token.as_bytes())
                    .map_err(|e| KitError::Holder(format!("the grant's token: {e}")))?;
                Ok(match fence.write(client.as_ref(), row, value, token).await? {
                    WriteOutcome::Applied => 200,
                    WriteOutcome::Stale => 409,
                })
            }
            Resource::S3 { fence, key } => {
                let token = Self::token(g)?;
                Ok(s3_status(fence.write(key, value.as_bytes(), token).await?))
            }
        }
    }

    fn token(g: &Grant) -> Result<lockmesh_core::FencingToken, KitError> {
        headers::parse_token(g.token.as_bytes()).map_err(|e| KitError::Holder(format!("the grant's token: {e}")))
    }

    /// S3: the first half of a write (read and check); `None` for other resources.
    pub async fn prepare_s3(&self, g: &Grant) -> Result<Option<s3::Prepare>, KitError> {
        match &self.resource {
            Resource::S3 { fence, key } => Ok(Some(fence.prepare(key, Self::token(g)?).await?)),
            _ => Ok(None),
        }
    }

    /// S3: the conditional PUT of a prepared write (200 applied, 409 stale).
    pub async fn commit(&self, p: s3::Prepare, value: &str) -> Result<u16, KitError> {
        match (&self.resource, p) {
            (Resource::S3 { fence, .. }, s3::Prepare::Ready(p)) => {
                Ok(s3_status(fence.commit(p, Some(value.as_bytes())).await?))
            }
            _ => Ok(409),
        }
    }

    fn is_s3(&self) -> bool {
        matches!(self.resource, Resource::S3 { .. })
    }

    /// Reads the resource's current value (empty when there is none).
    pub async fn read(&self) -> Result<String, KitError> {
        match &self.resource {
            Resource::Http(url) => {
                let r = self.plain.get(url).send().await.map_err(|e| KitError::Http("resource read", e))?;
                r.text().await.map_err(|e| KitError::Http("resource read", e))
            }
            Resource::Postgres { fence, client, row } => {
                Ok(fence.read(client.as_ref(), row).await?.map(|(v, _)| v).unwrap_or_default())
            }
            Resource::S3 { fence, key } => {
                Ok(fence.read(key).await?.map(|(v, _)| String::from_utf8_lossy(&v).into_owned()).unwrap_or_default())
            }
        }
    }
}

fn s3_status(o: s3::WriteOutcome) -> u16 {
    match o {
        s3::WriteOutcome::Applied => 200,
        s3::WriteOutcome::Stale => 409,
    }
}

/// The holder child: acquire, write `<run>-first`, report, wait for `GO` on stdin,
/// write `<run>-late`, report. Protocol lines on stdout: `ACQUIRED <token> <ttl_s>
/// <class>`, `WROTE <status>`, `LATE <status>`. With an S3 resource the late write
/// is read and checked before `GO` (`PREPARED <ready|stale>`) and PUT after it.
pub async fn holder(target: Target, run: &str) -> Result<(), KitError> {
    let kit = Kit::new(target).await?;
    let g = kit.acquire(10_000).await?;
    let mut out = std::io::stdout();
    writeln!(out, "ACQUIRED {} {} {}", g.token, g.ttl_s, g.class)?;
    let st = kit.write(&g, &format!("{run}-first")).await?;
    writeln!(out, "WROTE {st}")?;
    let prepared = kit.prepare_s3(&g).await?;
    if let Some(p) = &prepared {
        writeln!(out, "PREPARED {}", if matches!(p, s3::Prepare::Ready(_)) { "ready" } else { "stale" })?;
    }
    out.flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let late = format!("{run}-late");
    let st = match prepared {
        Some(p) => kit.commit(p, &late).await.unwrap_or(0),
        None => kit.write(&g, &late).await.unwrap_or(0),
    };
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

fn read_line(r: &mut BufReader<ChildStdout>, prefix: &str) -> Result<Vec<String>, KitError> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let parts: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
    if parts.first().map(String::as_str) != Some(prefix) {
        return Err(KitError::Holder(format!("holder said {:?}, expected {prefix}", line.trim())));
    }
    Ok(parts[1..].to_vec())
}

fn signal(child: &Child, sig: &str) -> Result<(), KitError> {
    let st = Command::new("kill").arg(format!("-{sig}")).arg(child.id().to_string()).status()?;
    if !st.success() {
        return Err(KitError::Holder(format!("kill -{sig} {} failed", child.id())));
    }
    Ok(())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Runs the whole test and returns the result document (also on a failed verdict).
pub async fn run(target: Target, validity_s: u64) -> Result<PauseTestResult, KitError> {
    let run = format!("run{:08x}", rand::random::<u32>());
    let mut p = Progress(Vec::new(), Instant::now());
    let kit = Kit::new(target.clone()).await?;
    kit.prepare().await?;
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("holder")
        .args(["--lock-url", &target.lock_url, "--lock-key", &target.lock_key, "--resource-url", &target.resource_url])
        .args(["--pg-table", &target.pg_table, "--s3-region", &target.s3_region])
        .arg("--ca")
        .arg(&target.ca)
        .arg("--cert")
        .arg(&target.cert)
        .arg("--key")
        .arg(&target.key)
        .args(["--run", &run]);
    if let Some(e) = &target.s3_endpoint {
        cmd.args(["--s3-endpoint", e]);
    }
    #[cfg(feature = "test-faults")]
    if let Some(f) = &target.s3_planted_fault {
        cmd.args(["--s3-planted-fault", f]);
    }
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
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
        resource: describe(&target),
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
) -> Result<(PauseEvidence, String, Grant), KitError> {
    let mut out = BufReader::new(child.stdout.take().ok_or_else(|| KitError::Holder("no child stdout".into()))?);
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
    if kit.is_s3() {
        let r = tokio::task::block_in_place(|| read_line(&mut out, "PREPARED"))?;
        p.step(format!(
            "holder read the object and checked its token for {run}-late: {}; it is frozen before its conditional PUT",
            r.first().map_or("?", String::as_str)
        ));
    }
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
    let stdin = child.stdin.as_mut().ok_or_else(|| KitError::Holder("no child stdin".into()))?;
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
pub fn write_doc(doc: &PauseTestResult, path: &std::path::Path) -> Result<(), KitError> {
    let text = if path.extension().is_some_and(|e| e == "json") {
        serde_json::to_string_pretty(doc).map_err(|e| KitError::Encode(e.to_string()))?
    } else {
        serde_saphyr::to_string(doc).map_err(|e| KitError::Encode(e.to_string()))?
    };
    std::fs::write(path, text)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use lockmesh_core::pause::Verdict;

    use super::*;

    fn target(url: &str) -> Target {
        Target {
            lock_url: "https://localhost:1".into(),
            ca: "ca.pem".into(),
            cert: "c.pem".into(),
            key: "k.pem".into(),
            lock_key: "short/a".into(),
            resource_url: url.into(),
            pg_table: DEFAULT_PG_TABLE.into(),
            s3_endpoint: None,
            s3_region: "eu-west-1".into(),
            #[cfg(feature = "test-faults")]
            s3_planted_fault: None,
        }
    }

    #[test]
    fn s3_resources_name_the_bucket_and_the_object_under_the_prefix() {
        let obj = |u: &str| s3_object(&target(u)).map_err(|e| e.to_string());
        assert_eq!(obj("s3://b/p/q/").unwrap(), Some(("b".into(), "p/q/short/a".into())));
        assert_eq!(obj("s3://b").unwrap(), Some(("b".into(), "short/a".into())));
        assert_eq!(obj("s3://b/").unwrap(), Some(("b".into(), "short/a".into())));
        assert_eq!(obj("http://h/x").unwrap(), None);
        for bad in ["s3:///p", "s3://b/p//q"] {
            assert!(obj(bad).unwrap_err().contains("expected s3://<bucket>[/<prefix>]"), "{bad}");
        }
        assert_eq!(
            describe(&target("s3://b/p")),
            "s3 conditional-put fence https://s3.eu-west-1.amazonaws.com bucket b object p/short/a"
        );
    }

    #[test]
    fn a_written_document_reads_back_equal_as_yaml_and_json() {
        let doc = PauseTestResult {
            schema_version: SCHEMA_VERSION.into(),
            class: "pay".into(),
            resource: "fence-proxy http://10.0.0.5:8080/items/{id}".into(),
            time_unix_s: 1_700_000_000,
            expires_unix_s: 1_700_000_000 + MAX_VALIDITY_S,
            verdict: Verdict::Pass,
            evidence: PauseEvidence {
                ttl_s: 5,
                paused_ms: 7000,
                first_write_status: 200,
                second_write_status: 200,
                late_write_status: 409,
                second_token_greater: true,
                resource_saw_late_write: false,
                // Strings YAML 1.1 would read as other types stay strings.
                steps: vec!["yes".into(), "0123".into(), "late write answered 409: stale_token".into()],
            },
        };
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("r.yaml");
        write_doc(&doc, &yaml).unwrap();
        let back: PauseTestResult = serde_saphyr::from_str(&std::fs::read_to_string(&yaml).unwrap()).unwrap();
        assert_eq!(back, doc);
        let json = dir.path().join("r.json");
        write_doc(&doc, &json).unwrap();
        assert_eq!(serde_json::from_slice::<PauseTestResult>(&std::fs::read(&json).unwrap()).unwrap(), doc);
    }
}
