//! Operator actions as gate steps (docs/GATE.md "Faults"): each runs the real
//! `lockctl` an operator would, while every holder keeps contending, and
//! **asserts that it took effect** (else the run fails), as the link faults do.
//!
//! - [`force_release`]: the two-person `lockctl admin request force-release` and
//!   `lockctl admin approve` of the victim `f0`'s live hold (its fenced key
//!   [`STICKY_KEY`]); asserts the force record exists and the hold is gone, then
//!   a probe is granted the key (after its lock-delay) and writes through the
//!   fence, and the victim's next write with its old token must be refused by
//!   the fence (`409 stale_token`).
//! - [`class_apply`]: moves [`APPLY_PREFIX`] between the classes `gatecaa` (TTL
//!   3 s) and `gatecab` (TTL 4 s) in every arbiter's registry (hot reload) and
//!   makes the map authoritative with `lockctl class apply` (drain, verify,
//!   apply); asserts the authoritative map (`<root>/sys/classmap`) gives the
//!   prefix its new class.
//! - [`rw_limit_change`]: `lockctl limit change --class gaterw` lowers the
//!   read-write class from 3 to 2 (drain, verify, activate), the next one raises
//!   it back (at once); asserts the class's policy record carries the new limit.
//!   `writer_alone` and `holders_within_limit` (which follows that record) hold
//!   across it.
//!
//! Planted inert (`GateCluster::plant_inert_faults`) an action skips what acts
//! (the approval, the reload and apply, the limit change) and its took-effect
//! check fails the run naming it (`gate_ops`).

use std::collections::HashSet;
use std::path::Path;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use lockmesh_devcerts::jwt::{ensure_issuer, operator_claims, Issuer};
use lockmesh_devcerts::TEST_TRUST_DOMAIN;

use super::harness::{
    gate_registry, GateCluster, APPLY_PREFIX, APPLY_SPARE_PREFIX, MOVE_VERIFY_TIMEOUT_MS, QUOTA_HOLDS, QUOTA_WAITERS,
    RW_N, STICKY_KEY, STICKY_MS,
};
use super::history::{clock_skew_ms, now_us, ClientOp, Outcome};
use super::holder::read_ops;
use super::recorder::EtcdLogin;
use lockmesh_tests::client::LockClient;
use lockmesh_tests::paths::profile_dir;

/// The read-write keys' class, whose limit [`rw_limit_change`] lowers and raises.
pub(crate) const RW_CLASS: &str = "gaterw";
/// The limit [`rw_limit_change`] lowers the read-write class to.
pub(crate) const RW_LOWERED: usize = 2;
/// The operators' identity provider (the arbiters' `operators.issuer`).
const ISSUER: &str = "https://idp.gate.test";
/// Where the issuer's key and JWKS live under the run's directory.
const ADMIN_DIR: &str = "admin";

/// Runs whose [`APPLY_PREFIX`] is in class `gatecab` (by etcd root).
static MOVED: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));
/// Runs whose read-write class is lowered (by etcd root).
static LOWERED: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

fn toggled(set: &Mutex<HashSet<String>>, root: &str) -> bool {
    set.lock().unwrap_or_else(|p| p.into_inner()).contains(root)
}

fn toggle(set: &Mutex<HashSet<String>>, root: &str) {
    let mut s = set.lock().unwrap_or_else(|p| p.into_inner());
    if !s.remove(root) {
        s.insert(root.to_owned());
    }
}

/// The most live hold slots of the quota'd namespace at once that its quotas
/// allow outside fault windows with `arbiters` arbiters: its `holds` quota plus
/// each arbiter's acquires admitted together before any of them committed (at
/// most its `waiters` share, the quota divided by the live arbiters, rounded
/// up): docs/OPERATIONS.md "How exact". The other part of that bound (what other
/// arbiters admit while a watch is broken, about a second) is a fault's.
pub(crate) fn quota_bound(arbiters: usize) -> usize {
    QUOTA_HOLDS + arbiters * QUOTA_WAITERS.div_ceil(arbiters.max(1))
}

/// The arbiters' `operators:` section (docs/ADMIN.md): the gate's `lockctl`
/// certificate is the admin client, the issuer's JWKS is written under `dir`.
pub(crate) fn operators_yaml(dir: &Path) -> Result<String> {
    let idp = issuer(dir)?;
    let jwks = dir.join(ADMIN_DIR).join("jwks.json");
    std::fs::write(&jwks, idp.jwks())?;
    Ok(format!(
        "operators: {{ allowed_clients: [\"spiffe://{TEST_TRUST_DOMAIN}/ns/lockmesh-system/sa/lockctl\"], \
         jwks_file: {:?}, issuer: {ISSUER:?}, max_token_age_s: 900 }}",
        jwks.display().to_string()
    ))
}

fn issuer(dir: &Path) -> Result<Issuer> {
    ensure_issuer(&dir.join(ADMIN_DIR), "gate")
}

/// The gate's registry with the fenced mutex class at `ttl_s`, and
/// [`APPLY_PREFIX`] in the class the run's last [`class_apply`] gave it.
pub(crate) fn registry_for(root: &str, ttl_s: u64) -> String {
    let text = gate_registry(ttl_s);
    if toggled(&MOVED, root) {
        swap_apply_prefix(&text)
    } else {
        text
    }
}

/// `text` with [`APPLY_PREFIX`] and [`APPLY_SPARE_PREFIX`] swapped between
/// their classes.
fn swap_apply_prefix(text: &str) -> String {
    let (a, b) = (format!("[\"{APPLY_PREFIX}\"]"), format!("[\"{APPLY_SPARE_PREFIX}\"]"));
    text.replace(&a, "[\"\u{0}\"]").replace(&b, &a).replace("[\"\u{0}\"]", &b)
}

/// `lockctl <args> --config <the gate's lockctl config> --actor .. --reason ..`:
/// exit code, stdout and stderr.
async fn lockctl(g: &GateCluster, args: &[String]) -> Result<(i32, String, String)> {
    let mut cmd = tokio::process::Command::new(profile_dir().join("lockctl"));
    cmd.args(args).arg("--config").arg(g.dir().join("lockctl.yaml"));
    cmd.args(["--actor", "lockmesh-gate", "--reason", "gate operator action"]).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .context("lockctl did not return in 90 s")?
        .context("run lockctl (cargo build -p lockmesh-extproc)")?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Every cluster's etcd endpoints and read-only login (`GateCluster::reader`):
/// the coord cluster first, then each shard.
fn clusters(g: &GateCluster) -> Result<Vec<(String, Vec<String>, EtcdLogin)>> {
    let mut all = vec![("coord".to_owned(), g.etcd.endpoints(), g.reader(None)?)];
    for (i, s) in g.shards.iter().enumerate() {
        all.push((s.name.clone(), s.etcd.endpoints(), g.reader(Some(i))?));
    }
    Ok(all)
}

/// The value of `key` on the cluster at `endpoints`, if any, with its mod revision.
async fn read(login: &EtcdLogin, endpoints: &[String], key: &str) -> Result<Option<(serde_json::Value, i64)>> {
    let mut c = login.connect(endpoints).await?;
    let r = c.get(key, None).await?;
    Ok(r.kvs().first().map(|kv| (serde_json::from_slice(kv.value()).unwrap_or_default(), kv.mod_revision())))
}

/// A `class_apply` step (see the module doc).
pub async fn class_apply(g: &GateCluster) -> Result<()> {
    let start = now_us();
    let live = !g.is_inert("class_apply");
    let to_b = !toggled(&MOVED, &g.root);
    let class = if to_b { "gatecab" } else { "gatecaa" };
    // The arbiters' registry as it is now (TTL, sidecar grants), the prefix swapped.
    let first = g.arbiters.first().context("no arbiter")?;
    let dir0 = first.config_path().parent().context("arbiter config without a directory")?;
    let text = swap_apply_prefix(&std::fs::read_to_string(dir0.join("registry.yaml"))?);
    if live {
        toggle(&MOVED, &g.root);
    }
    for a in g.arbiters.iter().filter(|_| live) {
        let dir = a.config_path().parent().context("arbiter config without a directory")?;
        let tmp = dir.join("registry.yaml.new");
        std::fs::write(&tmp, &text)?;
        std::fs::rename(&tmp, dir.join("registry.yaml"))?;
    }
    let file = g.dir().join(format!("class-apply-{}.yaml", now_us()));
    std::fs::write(&file, &text)?;
    // The hot reload (a second), then the apply, run again until it reports
    // the map applied (exit 2: still draining, held keys).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let args: Vec<String> = ["class".to_owned(), "apply".to_owned(), file.display().to_string()]
        .into_iter()
        .chain(["--verify-timeout-ms".to_owned(), MOVE_VERIFY_TIMEOUT_MS.to_string()])
        .collect();
    let end = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut tries = 0;
    while live {
        tries += 1;
        let (code, out, err) = lockctl(g, &args).await?;
        if code == 0 {
            break;
        }
        if tokio::time::Instant::now() >= end {
            bail!("class_apply: lockctl class apply did not finish in 60 s: exit {code}: {out}{err}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Took effect: every cluster's authoritative map gives the prefix its new class.
    let probe = format!("{APPLY_PREFIX}/0");
    for (name, eps, login) in clusters(g)? {
        let key = format!("{}/sys/classmap", g.root);
        let Some((map, rev)) = read(&login, &eps, &key).await? else {
            bail!("class_apply: {name} has no authoritative class map after lockctl class apply");
        };
        let got = class_of(&map, &probe);
        ensure!(
            got.as_deref() == Some(class),
            "class_apply did not take effect on {name}: its map (revision {rev}) gives {probe} class {got:?}, not {class}"
        );
    }
    g.note(
        "class_apply",
        format!("{APPLY_PREFIX} -> class {class} (lockctl class apply x{tries}; every cluster's map says so)"),
        start,
    );
    Ok(())
}

/// The class a `ClassMapRecord` (`{"map": [[prefix, class], ..], "default": ..}`,
/// longest prefix first) gives `key`.
fn class_of(map: &serde_json::Value, key: &str) -> Option<String> {
    let covers = |p: &str| key == p || key.strip_prefix(p).is_some_and(|r| r.starts_with('/'));
    let entries = map["map"].as_array()?;
    let hit = entries.iter().filter_map(|e| Some((e[0].as_str()?, e[1].as_str()?))).find(|(p, _)| covers(p));
    hit.map(|(_, c)| c.to_owned()).or_else(|| map["default"].as_str().map(str::to_owned))
}

/// A `rw_limit_change` step (see the module doc).
pub async fn rw_limit_change(g: &GateCluster) -> Result<()> {
    let start = now_us();
    let lower = !toggled(&LOWERED, &g.root);
    let to = if lower { RW_LOWERED } else { RW_N };
    if !g.is_inert("rw_limit_change") {
        g.set_class_limit(RW_CLASS, to).await?;
        toggle(&LOWERED, &g.root);
    }
    // Took effect: the class's policy record carries the new limit on every
    // cluster that has one (the rw keys' home has).
    let key = format!("{}/c/{RW_CLASS}", g.root);
    let mut seen = 0;
    for (name, eps, login) in clusters(g)? {
        if let Some((rec, rev)) = read(&login, &eps, &key).await? {
            let limit = rec["limit"].as_u64();
            ensure!(
                limit == Some(to as u64),
                "rw_limit_change did not take effect on {name}: {key} (revision {rev}) says limit {limit:?}, not {to}"
            );
            seen += 1;
        }
    }
    ensure!(seen > 0, "rw_limit_change: no cluster has a policy record of {RW_CLASS}");
    let how = if lower { "lowered (drain, verify, activate)" } else { "raised (at once)" };
    g.note(
        "rw_limit_change",
        format!("{RW_CLASS} limit -> {to}, {how}; the record says {to} on {seen} cluster(s)"),
        start,
    );
    Ok(())
}

/// `lockctl admin <args> --json` against arbiter `i` as the operator `sub`
/// (a token minted on that arbiter's clock): exit code and JSON.
async fn admin(g: &GateCluster, i: usize, sub: &str, args: &[&str]) -> Result<(i32, serde_json::Value)> {
    let offset = g.arbiter_clocks.get(i).and_then(Option::as_ref).map_or(0, super::clock::FakeClock::step_offset);
    let now = i64::try_from(now_us() / 1_000_000).unwrap_or(0) + offset;
    let tok = issuer(g.dir())?
        .token(&operator_claims(ISSUER, sub, u64::try_from(now - 5).unwrap_or(0), 600))
        .map_err(|e| anyhow::anyhow!("operator token: {e}"))?;
    let cert = g.pki.client("lockmesh-system", "lockctl")?;
    let mut c = tokio::process::Command::new(profile_dir().join("lockctl"));
    c.arg("admin").args(args).arg("--json");
    c.arg("--arbiter").arg(format!("https://127.0.0.1:{}", g.arbiters[i].grpc_port()));
    c.arg("--arbiter-ca").arg(g.pki.ca_cert_path());
    c.arg("--cert").arg(&cert.cert_path).arg("--key").arg(&cert.key_path);
    c.env("LOCKMESH_ADMIN_TOKEN", tok).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), c.output()).await.context("lockctl admin: 60 s")??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or(serde_json::Value::Null);
    Ok((out.status.code().unwrap_or(-1), json))
}

/// The victim's grant it holds now with at least `left` of its hold to go:
/// its last op is a granted acquire of [`STICKY_KEY`] (or a renewal of it)
/// answered less than [`STICKY_MS`] − `left` ago.
fn victim_hold(out: &Path, left: Duration) -> Option<u64> {
    let ops = read_ops(out);
    let last = ops.iter().rev().find(|o| o.process == "f0")?;
    if !(last.op == "acquire" || last.op == "keepalive") {
        return None;
    }
    let acq = ops.iter().rev().find(|o| o.process == "f0" && o.op == "acquire")?;
    let token = acq.token.filter(|_| acq.outcome == Outcome::Ok)?;
    let age = now_us().saturating_sub(acq.ret_us);
    let budget = (STICKY_MS * 1000).saturating_sub(u64::try_from(left.as_micros()).unwrap_or(u64::MAX));
    (age < budget && last.token == Some(token)).then_some(token)
}

/// A `force_release` step (see the module doc).
pub async fn force_release(g: &GateCluster) -> Result<()> {
    let start = now_us();
    let victim = g.holders.iter().find(|h| h.name == "f0").context("force_release: no victim holder f0 runs")?;
    let out = victim.out.clone();
    // A force release, the key's lock-delay (2 s) and the probe's grant and write
    // must fit before the victim's write.
    let left = Duration::from_millis(7000);
    let mut tries = 0;
    let (token, i, rev) = loop {
        tries += 1;
        ensure!(tries <= 4, "force_release: the victim's hold changed under four requests");
        let wait_end = tokio::time::Instant::now() + Duration::from_millis(STICKY_MS + 15_000);
        let token = loop {
            if let Some(t) = victim_hold(&out, left) {
                break t;
            }
            ensure!(tokio::time::Instant::now() < wait_end, "force_release: the victim f0 held nothing to release");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let reason = "gate: holder f0 wedged (force_release step)";
        // An arbiter that cannot be reached (`admin.unavailable`: one a fault
        // just paused or whose clock it stepped) is not the step's subject: the
        // operator asks another, as here (three arbiters at most).
        let mut asked = 0;
        let first = rand::random_range(0..g.arbiters.len());
        let (i, p) = loop {
            // A different arbiter on each try, starting at a random one.
            let i = (first + asked) % g.arbiters.len();
            let (code, p) = admin(g, i, "alice", &["request", "force-release", STICKY_KEY, "--reason", reason]).await?;
            asked += 1;
            if code != 0 && p["error"] == "admin.unavailable" && asked < 3 {
                tracing::warn!(arbiter = i, %p, "gate force_release: arbiter unreachable; asking another");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            ensure!(code == 0, "force_release: lockctl admin request through arbiter {i}: exit {code}: {p}");
            break (i, p);
        };
        let id = p["request"]["id"].as_str().context("force_release: the request has no id")?.to_owned();
        if g.is_inert("force_release") {
            // Planted inert: requested, never approved.
            break (token, i, -1);
        }
        let (code, o) = admin(g, i, "bob", &["approve", &id]).await?;
        if code == 0 {
            let rev = o["outcome"]["revision"].as_i64().context("force_release: the outcome has no revision")?;
            let released = o["outcome"]["released"].as_array().map_or(0, Vec::len);
            ensure!(released >= 1, "force_release: the approval released nothing: {o}");
            break (token, i, rev);
        }
        // The victim's hold moved on between request and approval
        // (`admin.holds_changed`, `admin.no_hold`): try its next hold.
        tracing::info!(code, %o, "gate force_release: approval refused; trying again");
    };
    // Took effect: the force record exists (at the approval's revision) and the
    // victim's hold is gone.
    let mut record = false;
    let mut holds = 0;
    for (_, eps, login) in clusters(g)? {
        let mut c = login.connect(&eps).await?;
        let f = c.get(format!("{}/f/", g.root), Some(etcd_client::GetOptions::new().with_prefix())).await?;
        record |= f.kvs().iter().any(|kv| kv.mod_revision() == rev);
        let l = c.get(format!("{}/l/", g.root), Some(etcd_client::GetOptions::new().with_prefix())).await?;
        holds += l
            .kvs()
            .iter()
            .filter(|kv| {
                let v: serde_json::Value = serde_json::from_slice(kv.value()).unwrap_or_default();
                v["key"].as_str() == Some(STICKY_KEY) && (kv.create_revision() as u64) == (token & ((1 << 48) - 1))
            })
            .count();
    }
    ensure!(record, "force_release did not take effect: no force record at revision {rev}");
    ensure!(holds == 0, "force_release did not take effect: f0's hold (token {token}) is still there");
    // The probe: granted the key after its lock-delay, writes through the fence.
    let (probe, probe_write) = probe_write(g, &out).await?;
    ensure!(probe > token, "force_release: the probe's token {probe} is not above the victim's {token}");
    ensure!(probe_write == 200, "force_release: the probe's fenced write was answered {probe_write}");
    // The victim's next write, with its old token: refused by the fence.
    let end = tokio::time::Instant::now() + Duration::from_millis(STICKY_MS + 10_000);
    let write = loop {
        let w = read_ops(&out).into_iter().find(|o| o.process == "f0" && o.op == "write" && o.token == Some(token));
        if let Some(w) = w {
            break w;
        }
        ensure!(tokio::time::Instant::now() < end, "force_release: the victim never wrote with token {token}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(
        write.outcome == Outcome::Fail && write.status == 409,
        "force_release: the victim's write with its force-released token {token} was answered {} {:?} ({:?}), not a fence refusal",
        write.status,
        write.code,
        write.outcome
    );
    g.note(
        "force_release",
        format!(
            "{STICKY_KEY}: f0's grant {token} force-released through arbiter {i} (record at revision {rev}); \
             probe granted {probe} and wrote; f0's next write refused {} {:?}",
            write.status, write.code
        ),
        start,
    );
    Ok(())
}

/// The probe of [`force_release`]: acquires [`STICKY_KEY`] (waiting out its
/// lock-delay), writes through the fence, releases and closes, recording each
/// op (as `f0probe`) in the victim's output file. Returns its token and its
/// write's status.
async fn probe_write(g: &GateCluster, out: &Path) -> Result<(u64, u16)> {
    let ports = g.envoy_ports();
    let port = ports[rand::random_range(0..ports.len())];
    let cert = g.pki.client("payments", "gate-f0probe")?;
    let c = LockClient::new(port, &g.pki.ca_cert_path(), Some((&cert.cert_path, &cert.key_path)))?;
    let file = std::fs::OpenOptions::new().append(true).open(out)?;
    let record = |op: &str, token: Option<u64>, call: u64, status: u16, code: Option<String>| {
        let outcome = match status {
            200 => Outcome::Ok,
            _ if code.is_some() => Outcome::Fail,
            _ => Outcome::Unknown,
        };
        let rec = ClientOp {
            process: "f0probe".into(),
            op: op.into(),
            key: STICKY_KEY.into(),
            token,
            call_us: call,
            ret_us: now_us(),
            outcome,
            status,
            code,
            skew_ms: clock_skew_ms(),
            ..ClientOp::default()
        };
        if let Ok(line) = serde_json::to_string(&rec) {
            use std::io::Write as _;
            let _ = (&file).write_all(format!("{line}\n").as_bytes());
        }
    };
    let code_of = |r: &lockmesh_tests::client::Resp| r.header("x-lockmesh-error").map(str::to_owned);
    let call = now_us();
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", STICKY_KEY), ("x-lock-wait-ms", "5000")]).await;
    let r = match r {
        Ok(r) => r,
        Err(e) => {
            record("acquire", None, call, 0, None);
            bail!("force_release: the probe's acquire got no answer: {e}");
        }
    };
    let token = r.json["token"].as_str().and_then(|t| t.parse::<u64>().ok());
    record("acquire", token, call, r.code(), code_of(&r));
    let Some(token) = token.filter(|_| r.code() == 200) else {
        bail!("force_release: the probe was not granted {STICKY_KEY}: {} {}", r.code(), r.body);
    };
    let session = r.json["session"].as_str().unwrap_or_default().to_owned();
    let proof = r.json["proof"].as_str().unwrap_or_default().to_owned();
    let tok = token.to_string();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(6)).build()?;
    let call = now_us();
    let id = STICKY_KEY.rsplit('/').next().unwrap_or_default();
    let w = http
        .put(format!("{}/items/{id}", g.fence.url()))
        .header("x-lock-token", &tok)
        .header("x-lock-proof", &proof)
        .body(format!("f0probe:{tok}"))
        .send()
        .await;
    let status = w.as_ref().map_or(0, |w| w.status().as_u16());
    let wcode = w.as_ref().ok().and_then(|w| w.headers().get("x-lockmesh-error")?.to_str().ok().map(str::to_owned));
    record("write", Some(token), call, status, wcode);
    let call = now_us();
    let hs = [("x-lock-key", STICKY_KEY), ("x-lock-token", tok.as_str()), ("x-lock-session", session.as_str())];
    let r = c.post("/v1/locks/release", &hs).await;
    let (st, code) = r.as_ref().map_or((0, None), |r| (r.code(), code_of(r)));
    record("release", Some(token), call, st, code);
    let call = now_us();
    let r = c.post("/v1/sessions/close", &[("x-lock-session", session.as_str())]).await;
    let (st, code) = r.as_ref().map_or((0, None), |r| (r.code(), code_of(r)));
    record("close", Some(token), call, st, code);
    Ok((token, status))
}
