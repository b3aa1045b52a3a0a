//! A gate client process (`lockmesh-gate holder ...`): loops acquire → (fenced
//! write) → keepalive → release → close through the lock tier's HTTP API, and
//! appends one JSON line per operation (call and return time, outcome) to its
//! output file. It is a process so the gate can SIGSTOP it past its TTL.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result};

use super::history::{clock_skew_ms, now_us, ClientOp, Outcome};
use lockmesh_tests::client::LockClient;

/// Per-request timeout of a holder: an answer later than this is unknown.
pub(crate) const HOLDER_REQUEST_TIMEOUT: Duration = Duration::from_secs(6);

/// What one holder does.
#[derive(Debug, Clone, clap::Args)]
pub struct HolderArgs {
    /// Label in the history (`h0`, `s1`).
    #[arg(long)]
    pub name: String,
    /// Lock-tier Envoy listener ports (one is picked per operation).
    #[arg(long, value_delimiter = ',')]
    pub envoy_ports: Vec<u16>,
    /// CA PEM.
    #[arg(long)]
    pub ca: PathBuf,
    /// Client certificate PEM.
    #[arg(long)]
    pub cert: PathBuf,
    /// Client key PEM.
    #[arg(long)]
    pub key: PathBuf,
    /// Lock keys to loop over.
    #[arg(long, value_delimiter = ',')]
    pub keys: Vec<String>,
    /// fence-proxy URL: write `<url>/items/<last key segment>` under each grant.
    #[arg(long)]
    pub fence_url: Option<String>,
    /// Longest simulated work under a grant, ms.
    #[arg(long, default_value_t = 300)]
    pub work_ms: u64,
    /// JSON-lines output file.
    #[arg(long)]
    pub out: PathBuf,
}

struct Holder {
    args: HolderArgs,
    clients: Vec<LockClient>,
    http: reqwest::Client,
    out: std::fs::File,
}

/// Runs the loop until the process is stopped.
pub async fn run(args: HolderArgs) -> Result<()> {
    let mut clients = Vec::new();
    for &p in &args.envoy_ports {
        clients.push(LockClient::new(p, &args.ca, Some((&args.cert, &args.key)))?);
    }
    anyhow::ensure!(!clients.is_empty() && !args.keys.is_empty(), "holder needs envoy ports and keys");
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.out)
        .with_context(|| format!("open {}", args.out.display()))?;
    let http = reqwest::Client::builder().timeout(HOLDER_REQUEST_TIMEOUT).build()?;
    let mut h = Holder { args, clients, http, out };
    loop {
        h.round().await;
    }
}

// === impl Holder ===

impl Holder {
    fn client(&self) -> &LockClient {
        &self.clients[rand::random_range(0..self.clients.len())]
    }

    fn record(&mut self, op: &str, key: &str, token: Option<u64>, call_us: u64, res: (Outcome, u16, Option<String>)) {
        let (outcome, status, code) = res;
        let rec = ClientOp {
            process: self.args.name.clone(),
            op: op.into(),
            key: key.into(),
            token,
            call_us,
            ret_us: now_us(),
            outcome,
            status,
            code,
            skew_ms: clock_skew_ms(),
        };
        if let Ok(line) = serde_json::to_string(&rec) {
            // One write per line: a killed holder leaves at most one torn line.
            let _ = self.out.write_all(format!("{line}\n").as_bytes());
        }
    }

    async fn call(&self, path: &str, headers: &[(&str, &str)]) -> (Outcome, u16, Option<String>, serde_json::Value) {
        let c = self.client().clone();
        match tokio::time::timeout(HOLDER_REQUEST_TIMEOUT, c.post(path, headers)).await {
            Ok(Ok(r)) => {
                let code = r.header("x-lockmesh-error").map(str::to_owned);
                let outcome = match r.code() {
                    200 => Outcome::Ok,
                    // A refusal with a code is an answer: nothing happened.
                    _ if code.is_some() => Outcome::Fail,
                    _ => Outcome::Unknown,
                };
                (outcome, r.code(), code, r.json)
            }
            _ => (Outcome::Unknown, 0, None, serde_json::Value::Null),
        }
    }

    async fn round(&mut self) {
        let key = {
            let keys = &self.args.keys;
            keys[rand::random_range(0..keys.len())].clone()
        };
        let call = now_us();
        let (o, st, code, json) =
            self.call("/v1/locks/acquire", &[("x-lock-key", &key), ("x-lock-wait-ms", "2000")]).await;
        let token = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        self.record("acquire", &key, token, call, (o, st, code));
        let (Outcome::Ok, Some(token)) = (o, token) else {
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
            return;
        };
        let session = json["session"].as_str().unwrap_or_default().to_owned();
        let proof = json["proof"].as_str().unwrap_or_default().to_owned();
        let work = rand::random_range(0..=self.args.work_ms);
        tokio::time::sleep(Duration::from_millis(work)).await;
        let tok = token.to_string();
        if let Some(url) = self.args.fence_url.clone() {
            let id = key.rsplit('/').next().unwrap_or_default().to_owned();
            let call = now_us();
            let r = self
                .http
                .put(format!("{url}/items/{id}"))
                .header("x-lock-token", &tok)
                .header("x-lock-proof", &proof)
                .body(format!("{}:{tok}", self.args.name))
                .send()
                .await;
            let res = match r {
                Ok(r) => {
                    let code = r.headers().get("x-lockmesh-error").and_then(|v| v.to_str().ok()).map(str::to_owned);
                    let s = r.status().as_u16();
                    let o = match s {
                        200 => Outcome::Ok,
                        // 504: forwarded, may or may not have landed.
                        504 => Outcome::Unknown,
                        _ => Outcome::Fail,
                    };
                    (o, s, code)
                }
                Err(_) => (Outcome::Unknown, 0, None),
            };
            self.record("write", &key, Some(token), call, res);
        }
        let call = now_us();
        let (o, st, code, _) = self.call("/v1/sessions/keepalive", &[("x-lock-session", &session)]).await;
        self.record("keepalive", &key, Some(token), call, (o, st, code));
        let call = now_us();
        let hs = [("x-lock-key", key.as_str()), ("x-lock-token", tok.as_str()), ("x-lock-session", session.as_str())];
        let (o, st, code, _) = self.call("/v1/locks/release", &hs).await;
        self.record("release", &key, Some(token), call, (o, st, code));
        let call = now_us();
        let (o, st, code, _) = self.call("/v1/sessions/close", &[("x-lock-session", &session)]).await;
        self.record("close", &key, Some(token), call, (o, st, code));
    }
}

/// Reads a holder's output file (a torn last line is skipped).
pub(crate) fn read_ops(path: &std::path::Path) -> Vec<ClientOp> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}
