//! The SDK conformance suite's runner (client/conformance/README.md): every
//! scenario file in `client/conformance/scenarios/` against every SDK's driver, on
//! real etcd, arbiter and Envoy (`lock-tier.yaml`, the shipped mTLS shape). Faults
//! are real: processes SIGSTOPped or SIGKILLed, answers held or dropped by a TCP
//! relay in front of Envoy, one per driver process.
//!
//! A language is one row of [`DRIVERS`] and one name in the `languages!` list.
//! Each SDK's planted fault runs only against the scenarios whose `catches` names
//! it, and must make each of them fail.

use std::{
    collections::{HashMap, VecDeque},
    path::PathBuf,
    process::Stdio,
    sync::{Arc, Mutex},
    time::Duration,
};

use lockmesh_tests::{client::LockClient, paths::repo_root, Stack};
use serde_json::{json, Value};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, TcpStream},
    process::{Child, ChildStdin, Command},
    sync::watch,
    time::{sleep, Instant},
};

/// How a driver of one language is started.
struct Lang {
    name: &'static str,
    /// The program and its arguments, or why it is not installed (and how to
    /// install it). A missing driver fails its tests: never skipped silently.
    command: fn() -> Result<(PathBuf, Vec<String>), String>,
}

/// One row per language.
const DRIVERS: &[Lang] = &[
    Lang { name: "rust", command: rust_driver },
    Lang { name: "python", command: python_driver },
    Lang { name: "go", command: go_driver },
];

fn rust_driver() -> Result<(PathBuf, Vec<String>), String> {
    let p = lockmesh_tests::paths::profile_dir().join("lockmesh-conformance-driver");
    if p.is_file() {
        Ok((p, vec![]))
    } else {
        Err(format!("{} not built: cargo test --workspace --no-run builds it", p.display()))
    }
}

/// The Go driver's launcher builds it with the pinned toolchain into `<target>/go/bin`
/// (scripts/setup prebuilds it; a source change rebuilds) and execs it.
fn go_driver() -> Result<(PathBuf, Vec<String>), String> {
    let file = repo_root().join(".tools/go/GOROOT");
    let missing =
        || format!("the Go toolchain ({}) is missing: run scripts/setup (scripts/setup.d/go.sh)", file.display());
    let root = std::fs::read_to_string(&file).map_err(|_| missing())?;
    if !PathBuf::from(root.trim()).join("bin/go").is_file() {
        return Err(missing());
    }
    Ok((repo_root().join("client/go/conformance-driver.sh"), vec![]))
}

fn python_driver() -> Result<(PathBuf, Vec<String>), String> {
    let py = repo_root().join(".tools/python-sdk/bin/python");
    let script = repo_root().join("client/python/conformance_driver.py");
    if !py.is_file() {
        return Err(format!("{} missing: run scripts/setup (scripts/setup.d/python-sdk.sh)", py.display()));
    }
    Ok((py, vec![script.display().to_string()]))
}

const SCENARIOS: &[&str] = &[
    "renewal_many_holds",
    "fence_from_send_time",
    "paused_holder",
    "killed_arbiter",
    "answer_lost",
    "etcd_pause",
    "reentrancy_and_leak",
    "permits",
    "modes",
    "election_handover",
    "multikey",
];

macro_rules! languages {
    ($($lang:ident),*) => {$(
        mod $lang {
            macro_rules! scenario {
                ($s:ident) => {
                    #[tokio::test]
                    async fn $s() {
                        if let Err(e) = super::run(stringify!($lang), stringify!($s), None).await {
                            panic!("{}/{}: {e}", stringify!($lang), stringify!($s));
                        }
                    }
                };
            }
            scenario!(renewal_many_holds);
            scenario!(fence_from_send_time);
            scenario!(paused_holder);
            scenario!(killed_arbiter);
            scenario!(answer_lost);
            scenario!(etcd_pause);
            scenario!(reentrancy_and_leak);
            scenario!(permits);
            scenario!(modes);
            scenario!(election_handover);
            scenario!(multikey);

            /// The SDK's planted fault fails every scenario that must catch it.
            #[tokio::test]
            async fn planted_deadline_from_answer_is_caught() {
                super::planted(stringify!($lang), "deadline_from_answer").await;
            }
        }
    )*};
}

languages!(rust, python, go);

#[test]
fn every_scenario_file_is_run_and_parses() {
    let dir = repo_root().join("client/conformance/scenarios");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(".yaml").to_owned())
        .collect();
    files.sort();
    let mut listed: Vec<String> = SCENARIOS.iter().map(|s| (*s).to_owned()).collect();
    listed.sort();
    assert_eq!(files, listed, "scenario files and the runner's list differ");
    for s in SCENARIOS {
        let sc = load(s).unwrap();
        assert_eq!(sc["name"].as_str(), Some(*s), "{s}: name");
        assert!(sc["covers"].is_string(), "{s}: covers");
        for (i, step) in sc["steps"].as_array().unwrap().iter().enumerate() {
            assert!(step.is_object(), "{s} step {i}");
        }
    }
}

/// The Python SDK's unit tests (client/python/tests, unittest: no extra install),
/// in the venv scripts/setup makes; a missing venv fails here, loudly.
#[test]
fn python_sdk_unit_tests() {
    let (py, _) = python_driver().unwrap_or_else(|e| panic!("{e}"));
    let out = std::process::Command::new(py)
        .args(["-m", "unittest", "discover", "-s", "tests"])
        .current_dir(repo_root().join("client/python"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python unit tests failed:\n{text}");
    let ran = text.lines().find(|l| l.starts_with("Ran ")).unwrap_or_default();
    assert!(!ran.is_empty() && !ran.starts_with("Ran 0 "), "no python unit test ran: {text}");
    eprintln!("python sdk: {ran}");
}

fn load(scenario: &str) -> Result<Value, String> {
    let path = repo_root().join(format!("client/conformance/scenarios/{scenario}.yaml"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_saphyr::from_str::<Value>(&text).map_err(|e| format!("{}: {e}", path.display()))
}

async fn planted(lang: &str, fault: &str) {
    let mut caught = 0;
    for s in SCENARIOS {
        let sc = load(s).unwrap();
        let catches = sc["catches"].as_array().cloned().unwrap_or_default();
        if !catches.iter().any(|c| c.as_str() == Some(fault)) {
            continue;
        }
        match run(lang, s, Some(fault)).await {
            Ok(()) => panic!("{lang}: planted {fault} passed {s}, which must catch it"),
            Err(e) => eprintln!("{lang}: planted {fault} caught by {s}: {e}"),
        }
        caught += 1;
    }
    assert!(caught > 0, "no scenario catches {fault}");
}

// === the relay ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Pass,
    /// Answers wait (in order) until the mode changes.
    Hold,
    /// Answers are discarded.
    Drop,
    /// Nothing passes either way.
    Blackhole,
}

/// A TCP relay to Envoy's listener for one driver process; the generation closes
/// every open connection when it changes.
struct Relay {
    port: u16,
    mode: watch::Sender<(Mode, u64)>,
    last_request: Arc<Mutex<Option<Instant>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Relay {
    async fn start(target: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mode, rx) = watch::channel((Mode::Pass, 0));
        let last_request: Arc<Mutex<Option<Instant>>> = Arc::default();
        let last = last_request.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let rx = rx.clone();
                let last = last.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await {
                        relay_conn(client, server, rx, last).await;
                    }
                });
            }
        });
        Relay { port, mode, last_request, accept }
    }

    fn set(&self, m: Mode, close: bool) {
        self.mode.send_modify(|(mode, gen)| {
            *mode = m;
            if close {
                *gen += 1;
            }
        });
    }
}

async fn relay_conn(
    client: TcpStream,
    server: TcpStream,
    mut rx: watch::Receiver<(Mode, u64)>,
    last: Arc<Mutex<Option<Instant>>>,
) {
    let gen = rx.borrow().1;
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let mode = rx.clone();
    let up = async move {
        let mut buf = vec![0u8; 16384];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            *last.lock().unwrap() = Some(Instant::now());
            if mode.borrow().0 == Mode::Blackhole {
                continue;
            }
            if sw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let mut mode = rx.clone();
    let down = async move {
        let mut buf = vec![0u8; 16384];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            loop {
                let m = mode.borrow_and_update().0;
                match m {
                    Mode::Pass => {
                        if cw.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                        break;
                    }
                    Mode::Hold => {
                        if mode.changed().await.is_err() {
                            return;
                        }
                    }
                    Mode::Drop | Mode::Blackhole => break,
                }
            }
        }
    };
    let closed = async move {
        loop {
            if rx.changed().await.is_err() || rx.borrow().1 != gen {
                return;
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = closed => {}
    }
}

// === a driver process ===

struct Proc {
    child: Child,
    stdin: ChildStdin,
    pid: u32,
    replies: Arc<Mutex<HashMap<u64, Value>>>,
    events: Arc<Mutex<VecDeque<(Instant, Value)>>>,
    stderr: Arc<Mutex<String>>,
    next_id: u64,
    relay: Relay,
}

impl Proc {
    async fn start(lang: &Lang, st: &Stack, name: &str, planted: Option<&str>) -> Result<Proc, String> {
        let (program, args) = (lang.command)()?;
        let relay = Relay::start(st.envoy().listener_port()).await;
        let cert = st.pki().client("payments", &format!("cf-{name}")).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&program);
        cmd.args(&args)
            .env("LOCKMESH_ENDPOINT", format!("https://localhost:{}", relay.port))
            .env("LOCKMESH_RESOLVE", format!("127.0.0.1:{}", relay.port))
            .env("LOCKMESH_CA", st.pki().ca_cert_path())
            .env("LOCKMESH_CERT", &cert.cert_path)
            .env("LOCKMESH_CERT_KEY", &cert.key_path)
            .env_remove("LOCKMESH_SDK_PLANTED")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(f) = planted {
            cmd.env("LOCKMESH_SDK_PLANTED", f);
        }
        let mut child = cmd.spawn().map_err(|e| format!("start {}: {e}", program.display()))?;
        let pid = child.id().ok_or("driver exited at once")?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let (replies, events, stderr): (Arc<Mutex<HashMap<u64, Value>>>, Arc<Mutex<VecDeque<_>>>, Arc<Mutex<String>>) =
            Default::default();
        let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let (r, ev, er) = (replies.clone(), events.clone(), stderr.clone());
        let stderr_all = stderr.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = out.next_line().await {
                let at = Instant::now();
                match serde_json::from_str::<Value>(&line) {
                    Ok(v) if v.get("event").is_some() => ev.lock().unwrap().push_back((at, v)),
                    Ok(v) => {
                        let id = v["id"].as_u64().unwrap_or(u64::MAX);
                        r.lock().unwrap().insert(id, v);
                    }
                    Err(_) => er.lock().unwrap().push_str(&format!("[stdout, not JSON] {line}\n")),
                }
            }
        });
        let mut err = BufReader::new(child.stderr.take().ok_or("no stderr")?).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = err.next_line().await {
                let mut s = stderr.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Ok(Proc { child, stdin, pid, replies, events, stderr: stderr_all, next_id: 1, relay })
    }

    async fn send(&mut self, mut req: Value) -> Result<u64, String> {
        let id = self.next_id;
        self.next_id += 1;
        req["id"] = json!(id);
        let line = format!("{req}\n");
        self.stdin.write_all(line.as_bytes()).await.map_err(|e| format!("driver stdin: {e}"))?;
        self.stdin.flush().await.map_err(|e| format!("driver stdin: {e}"))?;
        Ok(id)
    }

    async fn reply(&self, id: u64, within: Duration) -> Result<Value, String> {
        let end = Instant::now() + within;
        loop {
            if let Some(v) = self.replies.lock().unwrap().remove(&id) {
                return Ok(v);
            }
            if Instant::now() > end {
                return Err(format!("no reply within {within:?}"));
            }
            sleep(Duration::from_millis(10)).await;
        }
    }

    fn stderr_tail(&self) -> String {
        let s = self.stderr.lock().unwrap();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    fn signal(&self, sig: &str) -> Result<(), String> {
        let ok = std::process::Command::new("kill")
            .args([sig, &self.pid.to_string()])
            .status()
            .map_err(|e| e.to_string())?
            .success();
        if ok {
            Ok(())
        } else {
            Err(format!("kill {sig} {} failed", self.pid))
        }
    }
}

// === the interpreter ===

const REPLY_WITHIN: Duration = Duration::from_secs(30);

struct Run<'a> {
    lang: &'a Lang,
    st: &'a Stack,
    planted: Option<&'a str>,
    procs: HashMap<String, Proc>,
    vars: HashMap<String, Value>,
    times: HashMap<String, Instant>,
    pending: HashMap<String, (String, u64)>,
    observer: LockClient,
}

/// Runs `scenario` against `lang`'s driver; `Err` says which step failed and why.
async fn run(lang: &str, scenario: &str, planted: Option<&str>) -> Result<(), String> {
    let lang = DRIVERS.iter().find(|d| d.name == lang).ok_or("no such language")?;
    (lang.command)()?;
    let sc = load(scenario)?;
    let registry = std::fs::read_to_string(repo_root().join("client/conformance/registry.yaml")).unwrap();
    let mut b = Stack::builder(format!("cf-{}-{scenario}", lang.name)).envoy_config("lock-tier").registry(registry);
    if sc["own_etcd"].as_bool() == Some(true) {
        b = b.own_etcd(1);
    }
    let st = b.start().await.map_err(|e| format!("stack: {e:#}"))?;
    let observer = st.client("payments", "cf-observer").unwrap();
    lockmesh_tests::eventually(Duration::from_secs(20), async || {
        let r = observer.post("/v1/sessions", &[("x-lock-key", "payments/cf-ready")]).await?;
        anyhow::ensure!(r.code() == 200, "not serving yet: {}", r.body);
        let sid = r.json["session"].as_str().unwrap_or_default().to_owned();
        observer.post("/v1/sessions/close", &[("x-lock-session", sid.as_str())]).await?;
        Ok(())
    })
    .await;
    let mut r = Run {
        lang,
        st: &st,
        planted,
        procs: HashMap::new(),
        vars: HashMap::new(),
        times: HashMap::new(),
        pending: HashMap::new(),
        observer,
    };
    let steps = sc["steps"].as_array().cloned().ok_or("no steps")?;
    let started = Instant::now();
    for (i, step) in steps.iter().enumerate() {
        if let Err(e) = r.step(step).await {
            let mut msg = format!("step {i} {step}: {e}");
            for (name, p) in &r.procs {
                msg.push_str(&format!("\n--- driver {name} stderr ---\n{}", p.stderr_tail()));
            }
            // The arbiter may be stopped by the scenario: let the stack's drop clean up.
            let _ = st.arbiter(0).resume();
            return Err(msg);
        }
    }
    for (name, p) in r.procs.iter_mut() {
        let id = p.send(json!({"op": "exit"})).await?;
        p.reply(id, Duration::from_secs(10)).await.map_err(|e| format!("driver {name} exit: {e}"))?;
        let status = tokio::time::timeout(Duration::from_secs(10), p.child.wait())
            .await
            .map_err(|_| format!("driver {name} still running after exit"))?
            .map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("driver {name} exited {status}"));
        }
    }
    eprintln!("conformance {}/{scenario}: {:?} of steps", lang.name, started.elapsed());
    Ok(())
}

fn ms(step: &Value, field: &str) -> Result<Duration, String> {
    step[field].as_u64().map(Duration::from_millis).ok_or_else(|| format!("{field}: ms expected"))
}

fn s<'v>(step: &'v Value, field: &str) -> Result<&'v str, String> {
    step[field].as_str().ok_or_else(|| format!("{field}: string expected"))
}

const STEP_KEYS: &[&str] = &["drv", "expect", "save", "async"];

impl Run<'_> {
    fn resolve(&self, v: &Value) -> Result<Value, String> {
        Ok(match v {
            Value::String(s) if s.starts_with('$') => {
                self.vars.get(&s[1..]).cloned().ok_or_else(|| format!("{s} was never saved"))?
            }
            Value::Array(a) => Value::Array(a.iter().map(|x| self.resolve(x)).collect::<Result<_, _>>()?),
            other => other.clone(),
        })
    }

    async fn proc(&mut self, name: &str) -> Result<&mut Proc, String> {
        if !self.procs.contains_key(name) {
            let p = Proc::start(self.lang, self.st, name, self.planted).await?;
            self.procs.insert(name.to_owned(), p);
        }
        Ok(self.procs.get_mut(name).unwrap())
    }

    async fn step(&mut self, step: &Value) -> Result<(), String> {
        if step.get("op").is_some() {
            return self.request(step).await;
        }
        if let Some(ms_) = step.get("sleep_ms") {
            sleep(Duration::from_millis(ms_.as_u64().ok_or("sleep_ms")?)).await;
            return Ok(());
        }
        if let Some(name) = step.get("await").and_then(Value::as_str) {
            let (drv, id) = self.pending.remove(name).ok_or_else(|| format!("no pending {name}"))?;
            let within = ms(step, "within_ms")?;
            let reply = self.procs[&drv].reply(id, within).await?;
            return self.expect(step, &reply);
        }
        if let Some(name) = step.get("not_yet").and_then(Value::as_str) {
            let (drv, id) = self.pending.get(name).cloned().ok_or_else(|| format!("no pending {name}"))?;
            sleep(ms(step, "for_ms")?).await;
            if let Some(v) = self.procs[&drv].replies.lock().unwrap().get(&id) {
                return Err(format!("{name} was answered too early: {v}"));
            }
            return Ok(());
        }
        if let Some(drv) = step.get("await_event").and_then(Value::as_str) {
            let kind = s(step, "event")?;
            let end = Instant::now() + ms(step, "within_ms")?;
            let p = self.procs.get(drv).ok_or("no such driver")?;
            let (at, ev) = loop {
                if let Some(e) = p.events.lock().unwrap().pop_front() {
                    break e;
                }
                if Instant::now() > end {
                    return Err(format!("no {kind} event in time"));
                }
                sleep(Duration::from_millis(5)).await;
            };
            if ev["event"] != kind {
                return Err(format!("the next event is {ev}, not {kind}"));
            }
            if let Some(name) = step.get("save").and_then(Value::as_str) {
                self.times.insert(name.to_owned(), at);
            }
            return self.match_fields(step.get("expect"), &ev);
        }
        if let Some(drv) = step.get("no_event").and_then(Value::as_str) {
            sleep(ms(step, "for_ms")?).await;
            let p = self.procs.get(drv).ok_or("no such driver")?;
            if let Some((_, e)) = p.events.lock().unwrap().front() {
                return Err(format!("unexpected event {e}"));
            }
            return Ok(());
        }
        if let Some(check) = step.get("check").and_then(Value::as_str) {
            return self.check(check, step).await;
        }
        if let Some(fault) = step.get("fault").and_then(Value::as_str) {
            return self.fault(fault, step).await;
        }
        Err("unknown step".into())
    }

    async fn request(&mut self, step: &Value) -> Result<(), String> {
        let drv = s(step, "drv")?.to_owned();
        let mut req = serde_json::Map::new();
        for (k, v) in step.as_object().unwrap() {
            if !STEP_KEYS.contains(&k.as_str()) {
                req.insert(k.clone(), self.resolve(v)?);
            }
        }
        let p = self.proc(&drv).await?;
        let id = p.send(Value::Object(req)).await?;
        if let Some(name) = step.get("async").and_then(Value::as_str) {
            self.pending.insert(name.to_owned(), (drv, id));
            return Ok(());
        }
        let reply = self.procs[&drv].reply(id, REPLY_WITHIN).await?;
        self.expect(step, &reply)
    }

    fn expect(&mut self, step: &Value, reply: &Value) -> Result<(), String> {
        let expect = step.get("expect");
        let wants_error = expect.and_then(|e| e.get("error")).cloned();
        match wants_error {
            Some(codes) => {
                if reply["ok"] == true {
                    return Err(format!("answered {reply}, expected error {codes}"));
                }
                let codes = match codes {
                    Value::Array(a) => a,
                    one => vec![one],
                };
                if codes.len() > 1 {
                    // Which of the accepted outcomes came, for the figures.
                    eprintln!("conformance {}: answered {} of {codes:?}", self.lang.name, reply["error"]);
                }
                if !codes.contains(&reply["error"]) {
                    return Err(format!("error {} ({}), expected {codes:?}", reply["error"], reply["message"]));
                }
                return Ok(());
            }
            None => {
                if reply["ok"] != true {
                    return Err(format!("failed: {reply}"));
                }
            }
        }
        if let Some(save) = step.get("save").and_then(Value::as_object) {
            for (name, field) in save {
                let f = field.as_str().ok_or("save: field names")?;
                self.vars.insert(name.clone(), reply[f].clone());
            }
        }
        match expect {
            Some(Value::String(ok)) if ok == "ok" => Ok(()),
            e => self.match_fields(e, reply),
        }
    }

    fn match_fields(&self, expect: Option<&Value>, got: &Value) -> Result<(), String> {
        let Some(map) = expect.and_then(Value::as_object) else { return Ok(()) };
        for (field, want) in map {
            if field == "gt" {
                for (f, than) in want.as_object().ok_or("gt: a map")? {
                    let than = self.resolve(than)?;
                    let num = |v: &Value| v.as_str().and_then(|s| s.parse::<u64>().ok()).or_else(|| v.as_u64());
                    match (num(&got[f]), num(&than)) {
                        (Some(a), Some(b)) if a > b => {}
                        _ => return Err(format!("{f}: {} is not above {than}", got[f])),
                    }
                }
                continue;
            }
            let want = self.resolve(want)?;
            if got[field] != want {
                return Err(format!("{field}: got {}, expected {want} (in {got})", got[field]));
            }
        }
        Ok(())
    }

    async fn holders(&self, key: &str) -> Result<usize, String> {
        let r = self.observer.get("/v1/locks", &[("x-lock-key", key)]).await.map_err(|e| format!("{e:#}"))?;
        if r.code() != 200 {
            return Err(format!("GET /v1/locks: {} {}", r.code(), r.body));
        }
        Ok(r.json["holders"].as_array().map_or(0, Vec::len))
    }

    async fn check(&mut self, check: &str, step: &Value) -> Result<(), String> {
        match check {
            "holders" => {
                let key = s(step, "key")?;
                let want = step["count"].as_u64().ok_or("count")? as usize;
                let end =
                    Instant::now() + step.get("within_ms").map_or(Ok(Duration::ZERO), |_| ms(step, "within_ms"))?;
                loop {
                    let n = self.holders(key).await?;
                    if n == want {
                        return Ok(());
                    }
                    if Instant::now() > end {
                        return Err(format!("{n} holders of {key}, expected {want}"));
                    }
                    sleep(Duration::from_millis(100)).await;
                }
            }
            "lease_alive" => {
                let lease = self.resolve(&step["lease"])?;
                let id =
                    i64::from_str_radix(lease.as_str().ok_or("lease: a session id")?, 16).map_err(|e| e.to_string())?;
                let mut etcd = self.st.etcd().client().await.map_err(|e| format!("{e:#}"))?;
                let ttl = etcd.lease_time_to_live(id, None).await.map_err(|e| e.to_string())?.ttl();
                if ttl < 0 {
                    return Err("etcd no longer has the lease".into());
                }
                Ok(())
            }
            "elapsed" => {
                let t = |k: &str| -> Result<Instant, String> {
                    let name = s(step, k)?.trim_start_matches('$');
                    self.times.get(name).copied().ok_or_else(|| format!("no time {name}"))
                };
                let d = t("to")?.saturating_duration_since(t("from")?);
                if let Some(max) = step.get("at_most_ms").and_then(Value::as_u64) {
                    if d > Duration::from_millis(max) {
                        return Err(format!("{d:?} elapsed, at most {max} ms expected"));
                    }
                }
                if let Some(min) = step.get("at_least_ms").and_then(Value::as_u64) {
                    if d < Duration::from_millis(min) {
                        return Err(format!("{d:?} elapsed, at least {min} ms expected"));
                    }
                }
                eprintln!("conformance {}: elapsed {d:?}", self.lang.name);
                Ok(())
            }
            other => Err(format!("unknown check {other}")),
        }
    }

    async fn fault(&mut self, fault: &str, step: &Value) -> Result<(), String> {
        let st = self.st;
        let e = |e: anyhow::Error| format!("{e:#}");
        match fault {
            "pause_holder" => self.proc(s(step, "drv")?).await?.signal("-STOP"),
            "resume_holder" => self.proc(s(step, "drv")?).await?.signal("-CONT"),
            "kill_arbiter" => {
                st.arbiter(0).kill();
                Ok(())
            }
            "restart_arbiter" => st.arbiter(0).restart().await.map_err(e),
            "pause_arbiter" => st.arbiter(0).pause().map_err(e),
            "resume_arbiter" => st.arbiter(0).resume().map_err(e),
            "pause_etcd" => st.etcd().member(0).pause().map_err(e),
            "resume_etcd" => st.etcd().member(0).resume().map_err(e),
            "hold_answers" => Ok(self.proc(s(step, "drv")?).await?.relay.set(Mode::Hold, false)),
            "release_answers" => Ok(self.proc(s(step, "drv")?).await?.relay.set(Mode::Pass, false)),
            "drop_answers" => Ok(self.proc(s(step, "drv")?).await?.relay.set(Mode::Drop, false)),
            "blackhole" => Ok(self.proc(s(step, "drv")?).await?.relay.set(Mode::Blackhole, false)),
            "restore" => Ok(self.proc(s(step, "drv")?).await?.relay.set(Mode::Pass, true)),
            "await_request" => {
                let since = Instant::now();
                let within = ms(step, "within_ms")?;
                let last = self.proc(s(step, "drv")?).await?.relay.last_request.clone();
                let at = loop {
                    if let Some(t) = *last.lock().unwrap() {
                        if t > since {
                            break t;
                        }
                    }
                    if since.elapsed() > within {
                        return Err(format!("no request within {within:?}"));
                    }
                    sleep(Duration::from_millis(2)).await;
                };
                if let Some(name) = step.get("save").and_then(Value::as_str) {
                    self.times.insert(name.to_owned(), at);
                }
                Ok(())
            }
            other => Err(format!("unknown fault {other}")),
        }
    }
}
