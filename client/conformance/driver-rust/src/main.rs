//! The Rust SDK's conformance driver: one JSON request per stdin line, one reply per
//! request and unsolicited events on stdout (client/conformance/README.md). Each
//! request runs as its own task, so a waiting campaign blocks nothing else.

use std::{
    collections::HashMap,
    io::Write,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use lockmesh_client::{
    CampaignOptions, Client, Config, Error, HoldState, Leadership, LockGuard, LockMode, LockOptions,
};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt, BufReader};

/// A named hold: the guards of one acquire, or a leadership.
enum Hold {
    Guards(Vec<LockGuard>),
    Leader(Leadership),
}

#[derive(Default)]
struct State {
    sessions: HashMap<String, Client>,
    holds: HashMap<String, Hold>,
}

struct Driver {
    state: Mutex<State>,
    out: Mutex<std::io::Stdout>,
    start: Instant,
}

/// A failed request: a stable code and a message.
struct Fail(String, String);

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail(e.code().to_owned(), e.to_string())
    }
}

fn bad(why: impl Into<String>) -> Fail {
    Fail("bad_request".into(), why.into())
}

fn unknown(what: &str) -> Fail {
    Fail("unknown_name".into(), format!("no such {what}"))
}

impl Driver {
    fn emit(&self, v: &Value) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        // A closed stdout means the runner is gone; nothing to tell.
        let _ = writeln!(out, "{v}");
        let _ = out.flush();
    }

    fn t_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

fn str_arg<'a>(req: &'a Value, name: &str) -> Result<&'a str, Fail> {
    req.get(name).and_then(Value::as_str).ok_or_else(|| bad(format!("missing string argument {name}")))
}

fn ms_arg(req: &Value, name: &str) -> Result<Option<Duration>, Fail> {
    match req.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|ms| Some(Duration::from_millis(ms))).ok_or_else(|| bad(format!("{name}: not ms"))),
    }
}

fn state_name(s: HoldState) -> &'static str {
    s.as_str()
}

async fn open_session(d: &Arc<Driver>, req: &Value) -> Result<Value, Fail> {
    let name = str_arg(req, "session")?.to_owned();
    let env = |k: &str| std::env::var(k).map_err(|_| Fail("config".into(), format!("{k} is not set")));
    let mut config =
        Config::new(env("LOCKMESH_ENDPOINT")?, env("LOCKMESH_CA")?, env("LOCKMESH_CERT")?, env("LOCKMESH_CERT_KEY")?);
    if let Ok(r) = std::env::var("LOCKMESH_RESOLVE") {
        config.resolve = Some(r.parse().map_err(|_| Fail("config".into(), "LOCKMESH_RESOLVE: not host:port".into()))?);
    }
    if let Some(m) = ms_arg(req, "margin_ms")? {
        config.margin = m;
    }
    if let Some(m) = ms_arg(req, "acquire_slack_ms")? {
        config.acquire_slack = m;
    }
    if let Some(m) = ms_arg(req, "request_timeout_ms")? {
        config.request_timeout = m;
    }
    let (df, dj) = (d.clone(), d.clone());
    let (nf, nj) = (name.clone(), name.clone());
    let client = Client::with_jeopardy(
        config,
        move |f| {
            df.emit(&json!({"event": "fenced", "session": nf, "lease": f.session, "keys": f.keys,
                "reason": f.reason.as_str(), "t_ms": df.t_ms()}));
        },
        move |j| {
            let kind = if j.state == HoldState::Jeopardy { "jeopardy" } else { "safe" };
            dj.emit(&json!({"event": kind, "session": nj, "lease": j.session, "keys": j.keys, "t_ms": dj.t_ms()}));
        },
    )?;
    d.state.lock().unwrap_or_else(|e| e.into_inner()).sessions.insert(name, client);
    Ok(json!({}))
}

fn client(d: &Driver, req: &Value) -> Result<Client, Fail> {
    let name = str_arg(req, "session")?;
    d.state.lock().unwrap_or_else(|e| e.into_inner()).sessions.get(name).cloned().ok_or_else(|| unknown("session"))
}

fn take_hold(d: &Driver, req: &Value) -> Result<Hold, Fail> {
    let name = str_arg(req, "hold")?;
    d.state.lock().unwrap_or_else(|e| e.into_inner()).holds.remove(name).ok_or_else(|| unknown("hold"))
}

fn put_hold(d: &Driver, name: Option<&str>, h: Hold) {
    if let Some(n) = name {
        d.state.lock().unwrap_or_else(|e| e.into_inner()).holds.insert(n.to_owned(), h);
    }
}

async fn handle(d: &Arc<Driver>, req: &Value) -> Result<Value, Fail> {
    let op = str_arg(req, "op")?;
    match op {
        "open_session" => open_session(d, req).await,
        "close_session" => {
            let c = client(d, req)?;
            c.shutdown().await;
            Ok(json!({}))
        }
        "acquire" => {
            let c = client(d, req)?;
            let mut opts = LockOptions::default().wait(ms_arg(req, "wait_ms")?.unwrap_or(Duration::ZERO));
            if let Some(t) = ms_arg(req, "timeout_ms")? {
                opts = opts.timeout(t);
            }
            if let Some(p) = req.get("permits") {
                let k = p.as_u64().and_then(|k| u32::try_from(k).ok()).ok_or_else(|| bad("permits"))?;
                opts = opts.permits(k);
            }
            if let Some(m) = req.get("mode") {
                opts = opts.mode(match m.as_str() {
                    Some("shared") => LockMode::Shared,
                    Some("exclusive") => LockMode::Exclusive,
                    _ => return Err(bad("mode: shared or exclusive")),
                });
            }
            if let Some(cl) = req.get("class").and_then(Value::as_str) {
                opts = opts.class(cl);
            }
            let guards = match req.get("keys") {
                Some(ks) => {
                    let keys: Vec<&str> = ks
                        .as_array()
                        .ok_or_else(|| bad("keys: a list"))?
                        .iter()
                        .map(|k| k.as_str().ok_or_else(|| bad("keys: strings")))
                        .collect::<Result<_, _>>()?;
                    c.lock_all(&keys, opts).await?
                }
                None => vec![c.lock(str_arg(req, "key")?, opts).await?],
            };
            let first = guards.first().ok_or_else(|| bad("no keys"))?;
            let tokens: Vec<String> = guards.iter().map(|g| g.token().to_string()).collect();
            let reply = json!({"token": tokens[0], "tokens": tokens, "lease": first.session(),
                "ttl_s": first.ttl().as_secs()});
            put_hold(d, req.get("as").and_then(Value::as_str), Hold::Guards(guards));
            Ok(reply)
        }
        "release" | "resign" => {
            match take_hold(d, req)? {
                Hold::Guards(gs) => {
                    for g in gs {
                        g.release().await?;
                    }
                }
                Hold::Leader(l) => l.resign().await?,
            }
            Ok(json!({}))
        }
        "can_start" | "token" | "claim" => {
            let name = str_arg(req, "hold")?;
            let st = d.state.lock().unwrap_or_else(|e| e.into_inner());
            let (can, state, token, proof, left) = match st.holds.get(name).ok_or_else(|| unknown("hold"))? {
                Hold::Guards(gs) => {
                    let g = gs.first().ok_or_else(|| bad("empty hold"))?;
                    (g.can_start(), g.state(), g.token(), g.proof().map(str::to_owned), g.remaining_ttl())
                }
                Hold::Leader(l) => {
                    (l.can_start(), l.state(), l.token(), l.proof().map(str::to_owned), l.remaining_ttl())
                }
            };
            // Floored to whole ms: a caller that read its clock before this request
            // may add it to that time and stay before the SDK's deadline.
            let left = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
            Ok(json!({"can_start": can, "state": state_name(state), "token": token.to_string(), "proof": proof,
                "remaining_ms": left}))
        }
        "held" => {
            let mut held = client(d, req)?.held();
            held.sort();
            Ok(json!({"held": held}))
        }
        "campaign" => {
            let c = client(d, req)?;
            let opts = CampaignOptions {
                value: req.get("value").and_then(Value::as_str).map(str::to_owned),
                wait: ms_arg(req, "wait_ms")?,
                ..Default::default()
            };
            let l = c.campaign(str_arg(req, "key")?, opts).await?;
            let reply = json!({"token": l.token().to_string(), "lease": l.session()});
            put_hold(d, req.get("as").and_then(Value::as_str), Hold::Leader(l));
            Ok(reply)
        }
        "proclaim" => {
            let name = str_arg(req, "hold")?.to_owned();
            let value = str_arg(req, "value")?.to_owned();
            let Hold::Leader(mut l) = take_hold(d, req)? else {
                return Err(bad("not a leadership"));
            };
            let r = l.proclaim(value).await;
            put_hold(d, Some(&name), Hold::Leader(l));
            r?;
            Ok(json!({}))
        }
        "observe" => {
            let c = client(d, req)?;
            let o = c.observe(str_arg(req, "key")?).next().await?;
            Ok(match o.leader {
                Some(l) => json!({"has_leader": true, "value": l.value}),
                None => json!({"has_leader": false, "value": null}),
            })
        }
        "sleep" => {
            tokio::time::sleep(ms_arg(req, "ms")?.unwrap_or_default()).await;
            Ok(json!({}))
        }
        other => Err(bad(format!("unknown op {other}"))),
    }
}

#[tokio::main]
async fn main() {
    if let Ok(fault) = std::env::var("LOCKMESH_SDK_PLANTED") {
        if !fault.is_empty() && !lockmesh_client::planted::plant(&fault) {
            eprintln!("driver: this SDK plants no fault named {fault}");
            std::process::exit(64);
        }
    }
    let d = Arc::new(Driver { state: Mutex::default(), out: Mutex::new(std::io::stdout()), start: Instant::now() });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let req: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                d.emit(&json!({"id": null, "ok": false, "error": "bad_request", "message": format!("not JSON: {e}")}));
                continue;
            }
        };
        let id = req.get("id").cloned().unwrap_or(Value::Null);
        if req.get("op").and_then(Value::as_str) == Some("exit") {
            d.emit(&json!({"id": id, "ok": true}));
            std::process::exit(0);
        }
        let d = d.clone();
        tokio::spawn(async move {
            let mut reply = match handle(&d, &req).await {
                Ok(Value::Object(m)) => m,
                Ok(_) => Map::new(),
                Err(Fail(code, message)) => {
                    let mut m = Map::new();
                    m.insert("ok".into(), json!(false));
                    m.insert("error".into(), json!(code));
                    m.insert("message".into(), json!(message));
                    m
                }
            };
            reply.entry("ok").or_insert(json!(true));
            reply.insert("id".into(), id);
            d.emit(&Value::Object(reply));
        });
    }
}
