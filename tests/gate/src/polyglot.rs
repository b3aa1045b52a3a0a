//! Driver holders (`lockmesh-gate holder --driver python|go`): the SDK holder
//! loop of [`super::holder`] run through another language's SDK, by way of its
//! conformance driver (client/conformance/README.md). The SDK logic is that
//! language's; this process only sends JSON lines and records ops in the gate's
//! history format, on the real clock.
//!
//! # Two processes, one pid for the gate
//!
//! The process the gate starts (its pid is the one a `holder_pause` stops) first
//! starts the **wrapper**, this binary again with `--driven`, whose stdin and
//! stdout are piped to it, and then replaces itself with the **driver** (`exec`):
//! so SIGSTOP stops the SDK itself, its renewals included, as it stops the Rust
//! SDK holders. The wrapper dies with the driver (parent-death signal).
//!
//! # A round
//!
//! `acquire` (the SDK's lock, waiting `--wait-ms`) → work → a **claim**: the
//! driver's `claim` op answers the SDK's token, proof, `can_start` and time left
//! to its fence deadline (`remaining_ms`, floored); the wrapper reads the clock
//! before sending it, so call time + time left is never later than the SDK's
//! deadline (op `valid`, `sdk_deadline_conservative`) → a fenced write with the
//! token and proof if `can_start` → `--hold-ms` with a claim every 200 ms →
//! `release`. The SDK's fence callback (event `fenced`) is recorded as op
//! `fenced`. An error the SDK reports as `outcome_unknown` (or a driver's own
//! failure, `driver_error`) is recorded unknown; any other code is a refusal.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

use super::history::{clock_skew_ms, now_us, ClientOp, Outcome};
use super::holder::{HolderArgs, HOLDER_REQUEST_TIMEOUT};
use lockmesh_tests::paths::repo_root;

/// A driver that has not answered a request in this long is broken (a paused
/// driver answers once resumed; an SDK call gives up well within it): the
/// wrapper exits with an error, and the gate fails the run.
const DRIVER_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a holder claims while it keeps a hold (`--hold-ms`).
const CLAIM_EVERY: Duration = Duration::from_millis(200);

/// An SDK the gate holds through, by its conformance driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// `client/python` (the venv scripts/setup makes).
    Python,
    /// `client/go` (the toolchain scripts/setup installs).
    Go,
}

impl Lang {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Lang::Python => "python",
            Lang::Go => "go",
        }
    }

    /// The prefix of its holders' labels in a history (`kpy0`, `kgo0`: SDK
    /// holders, so a `holder_pause` picks them too).
    pub fn label(self) -> &'static str {
        match self {
            Lang::Python => "kpy",
            Lang::Go => "kgo",
        }
    }

    /// The driver's program and arguments, as the conformance runner starts it,
    /// or why it is not installed and the setup step that installs it.
    pub fn driver_command(self) -> Result<(PathBuf, Vec<String>)> {
        let root = repo_root();
        match self {
            Lang::Python => {
                let py = root.join(".tools/python-sdk/bin/python");
                let script = root.join("client/python/conformance_driver.py");
                if !py.is_file() {
                    bail!(
                        "the Python SDK's venv is missing ({}): run scripts/setup (scripts/setup.d/python-sdk.sh)",
                        py.display()
                    );
                }
                Ok((py, vec![script.display().to_string()]))
            }
            Lang::Go => {
                let file = root.join(".tools/go/GOROOT");
                let goroot = std::fs::read_to_string(&file).unwrap_or_default();
                if goroot.trim().is_empty() || !PathBuf::from(goroot.trim()).join("bin/go").is_file() {
                    bail!(
                        "the Go toolchain is missing ({}): run scripts/setup (scripts/setup.d/go.sh)",
                        file.display()
                    );
                }
                Ok((root.join("client/go/conformance-driver.sh"), Vec::new()))
            }
        }
    }
}

/// The driver holder's arguments (beside [`HolderArgs`]).
#[derive(Debug, Clone, clap::Args)]
pub struct DriverArgs {
    /// Hold through this language's SDK, by its conformance driver (see the
    /// module doc): the first `--envoy-ports` port is its endpoint.
    #[arg(long, value_enum)]
    pub driver: Option<Lang>,
    /// The SDK's margin (`margin_ms` of the driver's `open_session`); its
    /// default if absent.
    #[arg(long)]
    pub margin_ms: Option<u64>,
    /// A planted fault of the SDK (`LOCKMESH_SDK_PLANTED` of the driver, e.g.
    /// `deadline_from_answer`): twin scenarios only.
    #[arg(long)]
    pub planted: Option<String>,
    /// Internal: this process is the wrapper half.
    #[arg(long, hide = true)]
    pub driven: bool,
}

/// In the process the gate started, before any runtime or thread: starts the
/// wrapper (this binary with the same arguments and `--driven`, its stdin the
/// driver's stdout and its stdout the driver's stdin), then replaces this
/// process with the driver. Returns only on a failure.
pub fn exec_driver(args: &HolderArgs, d: &DriverArgs) -> anyhow::Error {
    match try_exec_driver(args, d) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

fn try_exec_driver(args: &HolderArgs, d: &DriverArgs) -> Result<std::convert::Infallible> {
    use std::os::unix::process::CommandExt as _;
    let lang = d.driver.context("no --driver")?;
    let (program, dargs) = lang.driver_command()?;
    let port = *args.envoy_ports.first().context("a driver holder needs an Envoy port")?;
    let (to_driver_r, to_driver_w) = std::io::pipe()?;
    let (from_driver_r, from_driver_w) = std::io::pipe()?;
    let exe = std::env::current_exe()?;
    let mut wrapper = std::process::Command::new(exe);
    wrapper.args(std::env::args_os().skip(1)).arg("--driven").stdin(from_driver_r).stdout(to_driver_w);
    // SAFETY: the closure runs in the forked child before exec and makes one
    // async-signal-safe call (prctl); it allocates nothing. This process has one
    // thread, the one that forks and then execs the driver, so the signal comes
    // when the driver exits.
    #[allow(unsafe_code)]
    unsafe {
        wrapper.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    wrapper.spawn().context("start the driver holder's wrapper")?;
    let mut cmd = std::process::Command::new(&program);
    cmd.args(&dargs)
        .stdin(to_driver_r)
        .stdout(from_driver_w)
        .env("LOCKMESH_ENDPOINT", format!("https://localhost:{port}"))
        .env("LOCKMESH_RESOLVE", format!("127.0.0.1:{port}"))
        .env("LOCKMESH_CA", &args.ca)
        .env("LOCKMESH_CERT", &args.cert)
        .env("LOCKMESH_CERT_KEY", &args.key)
        .env_remove("LOCKMESH_SDK_PLANTED");
    if let Some(f) = &d.planted {
        cmd.env("LOCKMESH_SDK_PLANTED", f);
    }
    let e = cmd.exec();
    bail!("exec the {} driver {}: {e}", lang.name(), program.display())
}

/// The output file.
#[derive(Clone)]
struct Out(Arc<Mutex<std::fs::File>>);

impl Out {
    fn write(&self, rec: &ClientOp) {
        if let Ok(line) = serde_json::to_string(rec) {
            // One write per line: a killed holder leaves at most one torn line.
            let mut f = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// Replies awaited, by request id.
type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// The wrapper's end of the driver: requests on stdout, replies and events on stdin.
struct Driver {
    out: tokio::io::Stdout,
    pending: Pending,
    next: u64,
}

/// A request the driver answered `ok: false`: its stable code.
struct Refused(String);

impl Driver {
    async fn call(&mut self, op: &str, mut req: Value) -> Result<Result<Value, Refused>> {
        self.next += 1;
        let id = self.next;
        req["id"] = json!(id);
        req["op"] = json!(op);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id, tx);
        self.out.write_all(format!("{req}\n").as_bytes()).await.context("write to the driver")?;
        self.out.flush().await.context("write to the driver")?;
        let reply = match tokio::time::timeout(DRIVER_TIMEOUT, rx).await {
            Ok(Ok(v)) => v,
            Ok(Err(_)) => bail!("the driver exited"),
            Err(_) => bail!("the driver did not answer {op} within {DRIVER_TIMEOUT:?}"),
        };
        if reply["ok"].as_bool() == Some(true) {
            Ok(Ok(reply))
        } else {
            Ok(Err(Refused(reply["error"].as_str().unwrap_or("driver_error").to_owned())))
        }
    }
}

/// The outcome of an SDK call that failed with `code`: unknown for
/// `outcome_unknown` and a driver's own failure, else a refusal.
fn failed(code: String) -> (Outcome, u16, Option<String>) {
    let o = if matches!(code.as_str(), "outcome_unknown" | "driver_error") { Outcome::Unknown } else { Outcome::Fail };
    (o, 0, Some(code))
}

/// The wrapper: the loop of the module doc until the driver exits.
pub async fn run(args: HolderArgs, d: DriverArgs) -> Result<()> {
    anyhow::ensure!(d.driven, "a driver holder's loop runs in its wrapper (--driven)");
    anyhow::ensure!(!args.keys.is_empty(), "holder needs keys");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.out)
        .with_context(|| format!("open {}", args.out.display()))?;
    let out = Out(Arc::new(Mutex::new(file)));
    let pending: Pending = Arc::default();
    let reader = {
        let (pending, out, name) = (pending.clone(), out.clone(), args.name.clone());
        tokio::spawn(async move {
            let mut lines = BufReader::new(tokio::io::stdin()).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
                if v["event"].as_str() == Some("fenced") {
                    let at = now_us();
                    let keys: Vec<&str> =
                        v["keys"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
                    out.write(&ClientOp {
                        process: name.clone(),
                        op: "fenced".into(),
                        key: keys.join(","),
                        call_us: at,
                        ret_us: at,
                        outcome: Outcome::Ok,
                        code: v["reason"].as_str().map(str::to_owned),
                        skew_ms: clock_skew_ms(),
                        ..Default::default()
                    });
                } else if let Some(id) = v["id"].as_u64() {
                    let tx = pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&id);
                    if let Some(tx) = tx {
                        let _ = tx.send(v);
                    }
                }
            }
            // The driver is gone: every call waiting fails.
            pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        })
    };
    let http = reqwest::Client::builder().timeout(HOLDER_REQUEST_TIMEOUT).build()?;
    let mut h = Wrapper { driver: Driver { out: tokio::io::stdout(), pending, next: 0 }, args, out, http };
    let mut open = json!({"session": "s"});
    if let Some(m) = d.margin_ms {
        open["margin_ms"] = json!(m);
    }
    if let Err(Refused(code)) = h.driver.call("open_session", open).await? {
        bail!("the driver refused open_session: {code}");
    }
    let r = loop {
        if let Err(e) = h.round().await {
            break Err(e);
        }
    };
    reader.abort();
    r
}

struct Wrapper {
    driver: Driver,
    args: HolderArgs,
    out: Out,
    http: reqwest::Client,
}

impl Wrapper {
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

    fn record(&self, op: &str, key: &str, token: Option<u64>, call_us: u64, res: (Outcome, u16, Option<String>)) {
        self.out.write(&self.op(op, key, token, call_us, res));
    }

    /// One round (see the module doc).
    async fn round(&mut self) -> Result<()> {
        let key = self.args.keys[rand::random_range(0..self.args.keys.len())].clone();
        let call = now_us();
        let ask = json!({"session": "s", "key": key, "as": "h", "wait_ms": self.args.wait_ms});
        let token = match self.driver.call("acquire", ask).await? {
            Ok(r) => r["token"].as_str().and_then(|t| t.parse::<u64>().ok()),
            Err(Refused(code)) => {
                self.record("acquire", &key, None, call, failed(code));
                tokio::time::sleep(Duration::from_millis(rand::random_range(20..150))).await;
                return Ok(());
            }
        };
        let Some(token) = token else {
            // Granted, but no token to hold it by: unknown, and given back.
            self.record("acquire", &key, None, call, (Outcome::Unknown, 0, Some("driver_error".into())));
            let _ = self.driver.call("release", json!({"hold": "h"})).await?;
            return Ok(());
        };
        self.record("acquire", &key, Some(token), call, (Outcome::Ok, 200, None));
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..=self.args.work_ms))).await;
        if let Some((true, proof)) = self.claim(&key, token).await? {
            if let Some(url) = self.args.fence_url.clone() {
                self.fenced_write(&url, &key, token, &proof).await;
            }
        }
        let until = tokio::time::Instant::now() + Duration::from_millis(self.args.hold_ms);
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(CLAIM_EVERY.min(until - tokio::time::Instant::now())).await;
            self.claim(&key, token).await?;
        }
        let call = now_us();
        let res = match self.driver.call("release", json!({"hold": "h"})).await? {
            Ok(_) => (Outcome::Ok, 200, None),
            Err(Refused(code)) => failed(code),
        };
        self.record("release", &key, Some(token), call, res);
        Ok(())
    }

    /// The driver's `claim` of the hold of `token`, recorded as op `valid` when
    /// the SDK reports time left; `(can_start, proof)`.
    async fn claim(&mut self, key: &str, token: u64) -> Result<Option<(bool, String)>> {
        // Read before the request: the SDK reads its own clock later, so call +
        // time left is never later than its deadline.
        let call = now_us();
        let Ok(r) = self.driver.call("claim", json!({"hold": "h"})).await? else { return Ok(None) };
        let left_ms = r["remaining_ms"].as_u64().unwrap_or(0);
        if left_ms > 0 {
            self.out.write(&ClientOp {
                process: self.args.name.clone(),
                op: "valid".into(),
                key: key.into(),
                token: Some(token),
                call_us: call,
                ret_us: call,
                outcome: Outcome::Ok,
                skew_ms: clock_skew_ms(),
                valid_until_us: Some(call.saturating_add(left_ms.saturating_mul(1000))),
                ..Default::default()
            });
        }
        let can = r["can_start"].as_bool() == Some(true);
        Ok(Some((can, r["proof"].as_str().unwrap_or_default().to_owned())))
    }

    /// `PUT <url>/items/<last key segment>` with the token and proof; recorded
    /// as the SDK holders' writes are.
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
}
