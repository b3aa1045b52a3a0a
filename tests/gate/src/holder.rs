//! A gate client process (`lockmesh-gate holder ...`): loops acquire → (fenced
//! write) → keepalive → release → close through the lock tier's HTTP API, and
//! appends one JSON line per operation (call and return time, outcome) to its
//! output file. It is a process so the gate can SIGSTOP it past its TTL.
//!
//! With `--sdk` it holds through the real SDK (`lockmesh-client`) instead:
//! lock → work → the SDK's claim (`valid`: the fence deadline it reports, on the
//! real time line) → fenced write if the guard still lets work start → hold →
//! release, with the SDK renewing its sessions in the background and the fence
//! callback recorded (`fenced`). The checker holds each claim against the
//! grants other clients were answered (`sdk_deadline_conservative`).

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
    /// Hold through the SDK (`lockmesh-client`), one client per Envoy.
    #[arg(long)]
    pub sdk: bool,
    /// SDK mode: how long to keep the hold after the write, ms.
    #[arg(long, default_value_t = 0)]
    pub hold_ms: u64,
    /// Transparent mode: `--envoy-ports` is the inbound sidecar's, and each round
    /// is one request `POST /orders/<last key segment>` that the sidecar locks
    /// (op `treq`); the upstream records what reached it.
    #[arg(long)]
    pub transparent: bool,
    /// Transparent mode: one request in four stays this long (±10 %) at the
    /// upstream, past the class TTL, so its hold must be renewed; 0: none.
    #[arg(long, default_value_t = 0)]
    pub long_ms: u64,
    /// Read-write mode: each acquire names `x-lock-mode`, `exclusive` one time in
    /// three, else `shared` (the keys are of a class with N holders).
    #[arg(long)]
    pub rw: bool,
    /// Election mode: each round opens a session, campaigns on it (op
    /// `campaign`, proclaiming `<name>-<round>`), leads for up to `work_ms`,
    /// resigns (op `resign`) and closes the session.
    #[arg(long)]
    pub campaign: bool,
    /// `x-lock-wait-ms` of every acquire, ms.
    #[arg(long, default_value_t = 2000)]
    pub wait_ms: u64,
    /// Multi-key mode: each round acquires two distinct keys of `keys` in one
    /// grant (`/v1/locks/acquire-all`, one `acquire` op per key, `multi`), renews,
    /// releases each key by the grant's token and closes the session.
    #[arg(long)]
    pub multi: bool,
    /// Reuse mode: each round acquires a key without a session (the answer names
    /// the session S it opened), releases it, and at once acquires another key on
    /// S (`x-lock-session`), renews S and releases that key; the session closes
    /// at its last release, never by a call of the holder.
    #[arg(long)]
    pub reuse: bool,
    /// Permits mode: each acquire asks `x-lock-permits`, 1 to this many.
    #[arg(long)]
    pub permits: Option<u32>,
    /// Fail-open mode (keys of an `on_quorum_loss: open` class): plain rounds,
    /// but an answer of token 0 (an unprotected grant) is recorded with the code
    /// `unprotected` when the answer says `"unprotected": true`, then tried as a
    /// fenced write (op `write`, token 0, at `--open-fence-url`; no fence may
    /// accept it) and released by its grant id (`x-lock-grant`).
    #[arg(long)]
    pub open: bool,
    /// Fail-open mode: the fence-proxy URL its token-0 writes go to.
    #[arg(long)]
    pub open_fence_url: Option<String>,
    /// Sticky mode (the force-release victim): each round acquires a fenced key,
    /// keeps the hold this long (renewing its session every second), then makes
    /// its one fenced write, releases and closes. A hold force-released meanwhile
    /// is not noticed: the write is the holder's next use of its token.
    #[arg(long)]
    pub sticky_ms: Option<u64>,
}

/// How long a transparent holder waits for its request: the grant wait, a long
/// request's stay at the upstream and slack.
const TRANSPARENT_TIMEOUT: Duration = Duration::from_secs(10);

struct Holder {
    args: HolderArgs,
    clients: Vec<LockClient>,
    http: reqwest::Client,
    out: Out,
}

/// The output file, shared with the SDK's fence callback.
#[derive(Clone)]
struct Out(std::sync::Arc<std::sync::Mutex<std::fs::File>>);

// === impl Out ===

impl Out {
    fn write(&self, rec: &ClientOp) {
        if let Ok(line) = serde_json::to_string(rec) {
            // One write per line: a killed holder leaves at most one torn line.
            let mut f = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
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
    let out = Out(std::sync::Arc::new(std::sync::Mutex::new(out)));
    let sdk = if args.sdk { sdk_clients(&args, &out)? } else { Vec::new() };
    let mut h = Holder { args, clients, http, out };
    let mut n = 0u64;
    loop {
        if h.args.transparent {
            n += 1;
            h.transparent_round(n).await;
        } else if h.args.campaign {
            n += 1;
            h.campaign_round(n).await;
        } else if h.args.multi {
            h.multi_round().await;
        } else if h.args.reuse {
            h.reuse_round().await;
        } else if h.args.open {
            h.open_round().await;
        } else if let Some(ms) = h.args.sticky_ms {
            h.sticky_round(ms).await;
        } else if sdk.is_empty() {
            h.round().await;
        } else {
            h.sdk_round(&sdk).await;
        }
    }
}

/// One SDK client per Envoy, each recording its fence callbacks.
fn sdk_clients(args: &HolderArgs, out: &Out) -> Result<Vec<lockmesh_client::Client>> {
    let mut v = Vec::new();
    for &port in &args.envoy_ports {
        let mut c = lockmesh_client::Config::new(format!("https://localhost:{port}"), &args.ca, &args.cert, &args.key);
        c.resolve = Some(std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port)));
        let (out, name) = (out.clone(), args.name.clone());
        let client = lockmesh_client::Client::new(c, move |ev: lockmesh_client::FenceEvent| {
            let at = now_us();
            out.write(&ClientOp {
                process: name.clone(),
                op: "fenced".into(),
                key: ev.keys.join(","),
                token: None,
                call_us: at,
                ret_us: at,
                outcome: Outcome::Ok,
                status: 0,
                code: Some(ev.reason.as_str().to_owned()),
                skew_ms: clock_skew_ms(),
                valid_until_us: None,
                session: None,
                ..Default::default()
            });
        })
        .map_err(|e| anyhow::anyhow!("SDK client for port {port}: {e}"))?;
        v.push(client);
    }
    Ok(v)
}

// === impl Holder ===

impl Holder {
    fn client(&self) -> &LockClient {
        &self.clients[rand::random_range(0..self.clients.len())]
    }

    fn record(&mut self, op: &str, key: &str, token: Option<u64>, call_us: u64, res: (Outcome, u16, Option<String>)) {
        let rec = self.op(op, key, token, call_us, res);
        self.out.write(&rec);
    }

    /// [`Holder::record`] of an op that named `session`.
    fn record_on(
        &mut self,
        op: &str,
        key: &str,
        token: Option<u64>,
        call_us: u64,
        res: (Outcome, u16, Option<String>),
        session: Option<String>,
    ) {
        let rec = ClientOp { session, ..self.op(op, key, token, call_us, res) };
        self.out.write(&rec);
    }

    /// The record of an op that returns now.
    fn op(
        &self,
        op: &str,
        key: &str,
        token: Option<u64>,
        call_us: u64,
        res: (Outcome, u16, Option<String>),
    ) -> ClientOp {
        let (outcome, status, code) = res;
        ClientOp {
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
            ..ClientOp::default()
        }
    }

    /// The record of an acquire answered `json`. `opened`: it named no session,
    /// so the session it holds on was opened for it, after its call: its holder
    /// keeps the SDK's margin from that call (`ttl_ms`).
    fn acquired(
        &self,
        key: &str,
        token: Option<u64>,
        call_us: u64,
        res: (Outcome, u16, Option<String>),
        json: &serde_json::Value,
        opened: bool,
    ) -> ClientOp {
        let fresh = opened && json["existing"].as_bool() != Some(true);
        ClientOp {
            ttl_ms: json["ttl_s"].as_u64().filter(|_| fresh && token.is_some()).map(|s| s * 1000),
            permits: json["permits"].as_u64().and_then(|p| u32::try_from(p).ok()),
            ..self.op("acquire", key, token, call_us, res)
        }
    }

    /// One SDK round on a client picked at random (see the module doc).
    async fn sdk_round(&mut self, sdk: &[lockmesh_client::Client]) {
        let key = {
            let keys = &self.args.keys;
            keys[rand::random_range(0..keys.len())].clone()
        };
        let c = &sdk[rand::random_range(0..sdk.len())];
        let call = now_us();
        let opts = lockmesh_client::LockOptions::default().wait(Duration::from_secs(2));
        let guard = match c.lock(&key, opts).await {
            Ok(g) => g,
            Err(e) => {
                let outcome =
                    if matches!(e, lockmesh_client::Error::OutcomeUnknown) { Outcome::Unknown } else { Outcome::Fail };
                self.record("acquire", &key, None, call, (outcome, 0, Some(e.code().to_owned())));
                tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
                return;
            }
        };
        let token = guard.token().get();
        self.record("acquire", &key, Some(token), call, (Outcome::Ok, 200, None));
        let work = rand::random_range(0..=self.args.work_ms);
        tokio::time::sleep(Duration::from_millis(work)).await;
        // The claim: the SDK's fence deadline, moved onto the real time line. The
        // time is read before the SDK reads its own clock, so call + left is never
        // later than the SDK's deadline. No time left is no claim: the SDK says the
        // hold may be over, and when its deadline passed is not recorded (a holder
        // woken from a pause past its TTL reads zero here).
        let call = now_us();
        let left = u64::try_from(guard.remaining_ttl().as_micros()).unwrap_or(u64::MAX);
        if left > 0 {
            self.out.write(&ClientOp {
                process: self.args.name.clone(),
                op: "valid".into(),
                key: key.clone(),
                token: Some(token),
                call_us: call,
                ret_us: call,
                outcome: Outcome::Ok,
                status: 0,
                code: None,
                skew_ms: clock_skew_ms(),
                valid_until_us: Some(call.saturating_add(left)),
                session: None,
                ..Default::default()
            });
        }
        if guard.can_start() {
            if let Some(url) = self.args.fence_url.clone() {
                let proof = guard.proof().unwrap_or_default().to_owned();
                self.fenced_write(&url, &key, token, &proof).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(self.args.hold_ms)).await;
        let call = now_us();
        let res = match guard.release().await {
            Ok(()) => (Outcome::Ok, 200, None),
            Err(lockmesh_client::Error::OutcomeUnknown) => (Outcome::Unknown, 0, None),
            Err(e) => (Outcome::Fail, 0, Some(e.code().to_owned())),
        };
        self.record("release", &key, Some(token), call, res);
    }

    /// `PUT <url>/items/<last key segment>` with the token and proof; records it.
    async fn fenced_write(&mut self, url: &str, key: &str, token: u64, proof: &str) {
        let id = key.rsplit('/').next().unwrap_or_default().to_owned();
        let tok = token.to_string();
        let call = now_us();
        let r = self
            .http
            .put(format!("{url}/items/{id}"))
            .header("x-lock-token", &tok)
            .header("x-lock-proof", proof)
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
        self.record("write", key, Some(token), call, res);
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

    /// One transparent request (see [`HolderArgs::transparent`]): the key is never
    /// named by the holder, the sidecar derives it from the path.
    async fn transparent_round(&mut self, n: u64) {
        let key = {
            let keys = &self.args.keys;
            keys[rand::random_range(0..keys.len())].clone()
        };
        let id = key.rsplit('/').next().unwrap_or_default().to_owned();
        let long = self.args.long_ms;
        let stay = if long > 0 && rand::random_range(0..4) == 0 {
            rand::random_range(long * 9 / 10..=long * 11 / 10)
        } else {
            rand::random_range(0..=self.args.work_ms)
        };
        let stay = stay.to_string();
        let body = format!("{}:{n}", self.args.name).into_bytes();
        let headers = [("x-lock-wait-ms", "2000"), (lockmesh_tests::backend::DELAY_HEADER, stay.as_str())];
        let c = self.client().clone();
        let call = now_us();
        let res = match tokio::time::timeout(
            TRANSPARENT_TIMEOUT,
            c.request(reqwest::Method::POST, &format!("/orders/{id}"), &headers, body),
        )
        .await
        {
            Ok(Ok(r)) => {
                let code = r.header("x-lockmesh-error").map(str::to_owned);
                let outcome = match r.code() {
                    200 => Outcome::Ok,
                    _ if code.is_some() => Outcome::Fail,
                    _ => Outcome::Unknown,
                };
                (outcome, r.code(), code)
            }
            _ => (Outcome::Unknown, 0, None),
        };
        let refused = res.0 != Outcome::Ok;
        self.record("treq", &key, None, call, res);
        if refused {
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
        }
    }

    async fn round(&mut self) {
        let key = {
            let keys = &self.args.keys;
            keys[rand::random_range(0..keys.len())].clone()
        };
        let call = now_us();
        let mode = if rand::random_range(0..3) == 0 { "exclusive" } else { "shared" };
        let wait = self.args.wait_ms.to_string();
        let permits = self.args.permits.map(|n| rand::random_range(1..=n.max(1)).to_string());
        let mut ask = vec![("x-lock-key", key.as_str()), ("x-lock-wait-ms", wait.as_str())];
        if self.args.rw {
            ask.push(("x-lock-mode", mode));
        }
        if let Some(p) = &permits {
            ask.push(("x-lock-permits", p.as_str()));
        }
        let (o, st, code, json) = self.call("/v1/locks/acquire", &ask).await;
        let token = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        let rec = self.acquired(&key, token, call, (o, st, code), &json, true);
        self.out.write(&rec);
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
            self.fenced_write(&url, &key, token, &proof).await;
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

impl Holder {
    /// Two distinct keys of the holder's list, at random (one if it has one).
    fn two_keys(&self) -> (String, String) {
        let keys = &self.args.keys;
        let a = rand::random_range(0..keys.len());
        let b = if keys.len() > 1 { (a + rand::random_range(1..keys.len())) % keys.len() } else { a };
        (keys[a].clone(), keys[b].clone())
    }

    /// One multi-key round (see [`HolderArgs::multi`]).
    async fn multi_round(&mut self) {
        let (a, b) = self.two_keys();
        let list = format!("{a} {b}");
        let wait = self.args.wait_ms.to_string();
        let call = now_us();
        let (o, st, code, json) = self
            .call("/v1/locks/acquire-all", &[("x-lock-keys", list.as_str()), ("x-lock-wait-ms", wait.as_str())])
            .await;
        let token = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        for k in [&a, &b] {
            let rec = ClientOp { multi: true, ..self.acquired(k, token, call, (o, st, code.clone()), &json, true) };
            self.out.write(&rec);
        }
        let (Outcome::Ok, Some(token)) = (o, token) else {
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
            return;
        };
        let session = json["session"].as_str().unwrap_or_default().to_owned();
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..=self.args.work_ms))).await;
        let call = now_us();
        let (o, st, code, _) = self.call("/v1/sessions/keepalive", &[("x-lock-session", &session)]).await;
        self.record("keepalive", &a, Some(token), call, (o, st, code));
        let tok = token.to_string();
        for k in [&a, &b] {
            let call = now_us();
            let hs = [("x-lock-key", k.as_str()), ("x-lock-token", tok.as_str()), ("x-lock-session", session.as_str())];
            let (o, st, code, _) = self.call("/v1/locks/release", &hs).await;
            self.record("release", k, Some(token), call, (o, st, code));
        }
        let call = now_us();
        let (o, st, code, _) = self.call("/v1/sessions/close", &[("x-lock-session", &session)]).await;
        self.record("close", &a, Some(token), call, (o, st, code));
    }

    /// One reuse round (see [`HolderArgs::reuse`]).
    async fn reuse_round(&mut self) {
        let (k1, k2) = self.two_keys();
        let wait = self.args.wait_ms.to_string();
        let call = now_us();
        let (o, st, code, json) =
            self.call("/v1/locks/acquire", &[("x-lock-key", k1.as_str()), ("x-lock-wait-ms", wait.as_str())]).await;
        let t1 = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        let rec = self.acquired(&k1, t1, call, (o, st, code), &json, true);
        self.out.write(&rec);
        let (Outcome::Ok, Some(t1)) = (o, t1) else {
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
            return;
        };
        let session = json["session"].as_str().unwrap_or_default().to_owned();
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..=self.args.work_ms / 3))).await;
        let tok = t1.to_string();
        let call = now_us();
        let hs = [("x-lock-key", k1.as_str()), ("x-lock-token", tok.as_str()), ("x-lock-session", session.as_str())];
        let (o, st, code, _) = self.call("/v1/locks/release", &hs).await;
        self.record_on("release", &k1, Some(t1), call, (o, st, code), Some(session.clone()));
        if o != Outcome::Ok {
            let call = now_us();
            let (o, st, code, _) = self.call("/v1/sessions/close", &[("x-lock-session", &session)]).await;
            self.record("close", &k1, Some(t1), call, (o, st, code));
            return;
        }
        // At once, on the session the first answer named.
        let call = now_us();
        let ask = [("x-lock-key", k2.as_str()), ("x-lock-session", session.as_str()), ("x-lock-wait-ms", "0")];
        let (o, st, code, json) = self.call("/v1/locks/acquire", &ask).await;
        let t2 = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        let rec =
            ClientOp { session: Some(session.clone()), ..self.acquired(&k2, t2, call, (o, st, code), &json, false) };
        self.out.write(&rec);
        let (Outcome::Ok, Some(t2)) = (o, t2) else { return };
        tokio::time::sleep(Duration::from_millis(rand::random_range(100..=200))).await;
        let call = now_us();
        let (o, st, code, _) = self.call("/v1/sessions/keepalive", &[("x-lock-session", &session)]).await;
        self.record_on("keepalive", &k2, Some(t2), call, (o, st, code), Some(session.clone()));
        let tok = t2.to_string();
        let call = now_us();
        let hs = [("x-lock-key", k2.as_str()), ("x-lock-token", tok.as_str()), ("x-lock-session", session.as_str())];
        let (o, st, code, _) = self.call("/v1/locks/release", &hs).await;
        self.record_on("release", &k2, Some(t2), call, (o, st, code), Some(session.clone()));
        if o != Outcome::Ok {
            let call = now_us();
            let (o, st, code, _) = self.call("/v1/sessions/close", &[("x-lock-session", &session)]).await;
            self.record("close", &k2, Some(t2), call, (o, st, code));
        }
    }

    /// One election round (see [`HolderArgs::campaign`]).
    async fn campaign_round(&mut self, n: u64) {
        let key = {
            let keys = &self.args.keys;
            keys[rand::random_range(0..keys.len())].clone()
        };
        let call = now_us();
        let (o, st, code, json) = self.call("/v1/sessions", &[("x-lock-key", &key)]).await;
        let session = json["session"].as_str().unwrap_or_default().to_owned();
        if o != Outcome::Ok || session.is_empty() {
            self.record("open", &key, None, call, (o, st, code));
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
            return;
        }
        let value = format!("{}-{n}", self.args.name);
        let call = now_us();
        let ask = [
            ("x-lock-key", key.as_str()),
            ("x-lock-session", session.as_str()),
            ("x-lock-wait-ms", "2000"),
            ("x-lock-value", value.as_str()),
        ];
        let (o, st, code, json) = self.call("/v1/elections/campaign", &ask).await;
        let token = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        self.record_on("campaign", &key, token, call, (o, st, code), Some(session.clone()));
        if let (Outcome::Ok, Some(token)) = (o, token) {
            let work = rand::random_range(0..=self.args.work_ms);
            tokio::time::sleep(Duration::from_millis(work)).await;
            let tok = token.to_string();
            let call = now_us();
            let hs =
                [("x-lock-key", key.as_str()), ("x-lock-token", tok.as_str()), ("x-lock-session", session.as_str())];
            let (o, st, code, _) = self.call("/v1/elections/resign", &hs).await;
            self.record_on("resign", &key, Some(token), call, (o, st, code), Some(session.clone()));
        } else {
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
        }
        let call = now_us();
        let (o, st, code, _) = self.call("/v1/sessions/close", &[("x-lock-session", &session)]).await;
        self.record("close", &key, token, call, (o, st, code));
    }
}

impl Holder {
    /// One fail-open round (see [`HolderArgs::open`]).
    async fn open_round(&mut self) {
        let key = {
            let keys = &self.args.keys;
            keys[rand::random_range(0..keys.len())].clone()
        };
        let call = now_us();
        let wait = self.args.wait_ms.to_string();
        let (o, st, code, json) =
            self.call("/v1/locks/acquire", &[("x-lock-key", key.as_str()), ("x-lock-wait-ms", wait.as_str())]).await;
        let token = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        let unprotected = json["unprotected"].as_bool() == Some(true);
        // The mark: an answer that says it is unprotected is recorded with the
        // code `unprotected` (whatever its token; the checker holds the two together).
        let code = if o == Outcome::Ok && unprotected { Some("unprotected".to_owned()) } else { code };
        let rec = self.acquired(&key, token, call, (o, st, code), &json, true);
        self.out.write(&rec);
        let (Outcome::Ok, Some(token)) = (o, token) else {
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
            return;
        };
        if token == 0 {
            if let Some(url) = self.args.open_fence_url.clone() {
                // The route's lock key is the fenced class's (`payments/gate/m/<id>`):
                // token 0 must be refused whatever key it names.
                let id = format!("o{}", key.rsplit('/').next().unwrap_or_default());
                self.fenced_write(&url, &format!("payments/gate/m/{id}"), 0, "").await;
            }
            tokio::time::sleep(Duration::from_millis(rand::random_range(0..=self.args.work_ms))).await;
            let grant = json["grant"].as_str().unwrap_or_default().to_owned();
            let call = now_us();
            let (o, st, code, _) =
                self.call("/v1/locks/release", &[("x-lock-key", key.as_str()), ("x-lock-grant", grant.as_str())]).await;
            self.record("release", &key, Some(0), call, (o, st, code));
            return;
        }
        let session = json["session"].as_str().unwrap_or_default().to_owned();
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..=self.args.work_ms))).await;
        let tok = token.to_string();
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

    /// One sticky round (see [`HolderArgs::sticky_ms`]).
    async fn sticky_round(&mut self, hold_ms: u64) {
        let key = self.args.keys[0].clone();
        let call = now_us();
        let wait = self.args.wait_ms.to_string();
        let (o, st, code, json) =
            self.call("/v1/locks/acquire", &[("x-lock-key", key.as_str()), ("x-lock-wait-ms", wait.as_str())]).await;
        let token = json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
        let rec = self.acquired(&key, token, call, (o, st, code), &json, true);
        self.out.write(&rec);
        let (Outcome::Ok, Some(token)) = (o, token) else {
            tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
            return;
        };
        let session = json["session"].as_str().unwrap_or_default().to_owned();
        let proof = json["proof"].as_str().unwrap_or_default().to_owned();
        let end = tokio::time::Instant::now() + Duration::from_millis(hold_ms);
        while tokio::time::Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let call = now_us();
            let (o, st, code, _) = self.call("/v1/sessions/keepalive", &[("x-lock-session", &session)]).await;
            self.record("keepalive", &key, Some(token), call, (o, st, code));
        }
        if let Some(url) = self.args.fence_url.clone() {
            self.fenced_write(&url, &key, token, &proof).await;
        }
        let tok = token.to_string();
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
