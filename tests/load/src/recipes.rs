//! `lockmesh-load --recipes`: the coordination recipes of issue 22 side by side,
//! in one run on one machine (docs/BENCHMARKS.md, "Recipes"): lockmesh through
//! its lock tier, etcd's own services on the same etcd, and ZooKeeper's recipes
//! through kazoo (ZooKeeper 3.8 from Debian and kazoo from PyPI, installed by
//! `scripts/setup --bench` only).
//!
//! | recipe | lockmesh | etcd | ZooKeeper (kazoo) |
//! |---|---|---|---|
//! | `mutex` | acquire and release of one key by every client, on its session | v3lock `Lock` on the client's lease, `Unlock` | `Lock(path)` |
//! | `mutex-own` | the same, each client its own key (uncontended) | the same, a key per client | `Lock` of a path per client |
//! | `election` | campaign on the client's session, resign at once | v3election `Campaign` on the client's lease, `Resign` | `Election.run` with an empty leader function |
//! | `rw` | `x-lock-mode`: client i % 4 == 0 exclusive, the others shared, N = clients | none (etcd's `concurrency` has no read-write lock) | `WriteLock` / `ReadLock` alike |
//! | `multikey` | `acquire-all` of keys i and i+1 of a ring of `clients` keys, released one by one | v3lock `Lock` of both keys in key order, `Unlock` both | `Lock` of both in key order, released |
//! | `permits` | 2 of a key's 4 permits (`x-lock-permits: 2`) | none | `Semaphore(max_leases=2)`, one lease each: at most two holders, as here |
//!
//! Each client loops acquire → release (no work) for a warm-up and a measured
//! window; a cycle counts when it ends inside the window, its time is from its
//! acquire's call to its release's answer. The systems run one after another,
//! never at once.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _, Result};
use etcd_client::{Client, LockOptions, ResignOptions};
use lockmesh_tests::Stack;
use tokio::time::Instant;

use super::lockmesh::{lock_tier_http, post};
use super::report::Floor;

/// The recipes, in report order.
pub const RECIPES: [&str; 6] = ["mutex", "mutex-own", "election", "rw", "multikey", "permits"];

/// The registry of the stack this mode starts: the read-write class has as many
/// slots as there are clients (each exclusive hold takes them all, at most 64).
fn registry(clients: usize) -> String {
    format!(
        r#"platform: {{ min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "bench registry" }}
classes:
  - {{ name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: bench, waiver_expiry: "2099-12-31" }}
  - {{ name: rw, prefixes: ["load/rw"], ttl_s: 15, max_holders: {clients}, enforcement: advisory, risk_owner: bench,
      waiver_expiry: "2099-12-31" }}
  - {{ name: perm, prefixes: ["load/perm"], ttl_s: 15, max_holders: 4, enforcement: advisory, risk_owner: bench,
      waiver_expiry: "2099-12-31" }}
"#
    )
}

/// One recipe on one system.
#[derive(Debug, Clone)]
pub struct RecipeResult {
    pub recipe: &'static str,
    pub system: &'static str,
    pub cycles: u64,
    pub per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub errors: u64,
}

/// What every client of one run shares.
struct Window {
    start: Instant,
    end: Instant,
    times: Mutex<Vec<f64>>,
    errors: Mutex<u64>,
}

impl Window {
    fn new(warmup: f64, seconds: f64) -> Arc<Self> {
        let start = Instant::now() + Duration::from_secs_f64(warmup);
        Arc::new(Self {
            start,
            end: start + Duration::from_secs_f64(seconds),
            times: Mutex::default(),
            errors: Mutex::default(),
        })
    }

    fn done(&self) -> bool {
        Instant::now() >= self.end
    }

    fn cycle(&self, began: Instant) {
        let now = Instant::now();
        if now >= self.start && now <= self.end {
            self.times.lock().unwrap_or_else(|p| p.into_inner()).push((now - began).as_secs_f64() * 1000.0);
        }
    }

    async fn error(&self) {
        *self.errors.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    fn result(&self, recipe: &'static str, system: &'static str, seconds: f64) -> RecipeResult {
        let mut t = self.times.lock().unwrap_or_else(|p| p.into_inner()).clone();
        t.sort_by(f64::total_cmp);
        let pct =
            |q: f64| t.get(((q * t.len() as f64) as usize).min(t.len().saturating_sub(1))).copied().unwrap_or(0.0);
        RecipeResult {
            recipe,
            system,
            cycles: t.len() as u64,
            per_s: t.len() as f64 / seconds,
            p50_ms: pct(0.5),
            p99_ms: pct(0.99),
            errors: *self.errors.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }
}

/// Runs every recipe on every system; `python` is `.tools/bench/bin/python`.
///
/// `only` names the recipes to run (all when empty).
pub async fn run(
    clients: usize,
    seconds: f64,
    warmup: f64,
    python: &Path,
    quiet: bool,
    only: &[String],
) -> Result<Vec<RecipeResult>> {
    ensure!((2..=64).contains(&clients), "--recipes wants 2 to 64 clients");
    if let Some(bad) = only.iter().find(|r| !RECIPES.contains(&r.as_str())) {
        bail!("unknown recipe {bad:?}: one of {}", RECIPES.join(", "));
    }
    ensure!(
        python.is_file(),
        "{} is missing: run scripts/setup --bench (it installs ZooKeeper and kazoo)",
        python.display()
    );
    let st = Stack::builder("recipes")
        .envoy_config("lock-tier")
        .envoy_concurrency(2)
        .plaintext_etcd()
        .registry(registry(clients))
        .start()
        .await?;
    let zk = ZooKeeper::start().await?;
    let mut out = Vec::new();
    for recipe in RECIPES.into_iter().filter(|r| only.is_empty() || only.iter().any(|o| o == r)) {
        let w = Window::new(warmup, seconds);
        lockmesh(&st, recipe, clients, &w).await?;
        out.push(w.result(recipe, "lockmesh", seconds));
        if recipe != "rw" && recipe != "permits" {
            let w = Window::new(warmup, seconds);
            etcd(&st.etcd().endpoints(), &format!("{}/bench", st.root()), recipe, clients, &w).await?;
            out.push(w.result(recipe, if recipe == "election" { "etcd v3election" } else { "etcd v3lock" }, seconds));
        }
        out.push(zk.run(python, recipe, clients, seconds, warmup).await?);
        if !quiet {
            for r in out.iter().filter(|r| r.recipe == recipe) {
                eprintln!("{recipe}: {} {:.0} cycles/s, p50 {:.1} ms", r.system, r.per_s, r.p50_ms);
            }
        }
    }
    Ok(out)
}

/// lockmesh's side: one client (connection, session) per task.
async fn lockmesh(st: &Stack, recipe: &'static str, clients: usize, w: &Arc<Window>) -> Result<()> {
    let port = st.envoy().listener_port();
    let ca = st.pki().ca_cert_path();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let c = st.pki().client("load", &format!("w{i}"))?;
        let http = lock_tier_http(port, &ca, &c.cert_path, &c.key_path, false)?;
        let base = format!("https://localhost:{port}");
        let key = match recipe {
            "election" => "load/elect/e".to_owned(),
            "rw" => "load/rw/k".to_owned(),
            "permits" => "load/perm/k".to_owned(),
            "mutex" => "load/mutex/hot".to_owned(),
            "mutex-own" => format!("load/mutex/k{i}"),
            _ => format!("load/ring/k{i}"),
        };
        let (s, _, j) = post(&http, &format!("{base}/v1/sessions"), &[("x-lock-key", key.as_str())]).await?;
        ensure!(s == 200, "open a session: {s} {j}");
        let session = j["session"].as_str().context("no session")?.to_owned();
        let w = w.clone();
        tasks.push(tokio::spawn(async move {
            let mut renewed = Instant::now();
            let keys = format!("{key} load/ring/k{}", (i + 1) % clients);
            let mode = if i % 4 == 0 { "exclusive" } else { "shared" };
            while !w.done() {
                if renewed.elapsed() > Duration::from_secs(4) {
                    let _ =
                        post(&http, &format!("{base}/v1/sessions/keepalive"), &[("x-lock-session", &session)]).await;
                    renewed = Instant::now();
                }
                let began = Instant::now();
                let mut ask = vec![("x-lock-session", session.as_str()), ("x-lock-wait-ms", "30000")];
                let path = match recipe {
                    "election" => "/v1/elections/campaign",
                    "multikey" => "/v1/locks/acquire-all",
                    _ => "/v1/locks/acquire",
                };
                match recipe {
                    "multikey" => ask.push(("x-lock-keys", keys.as_str())),
                    _ => ask.push(("x-lock-key", key.as_str())),
                }
                match recipe {
                    "rw" => ask.push(("x-lock-mode", mode)),
                    "permits" => ask.push(("x-lock-permits", "2")),
                    _ => {}
                }
                let token = match post(&http, &format!("{base}{path}"), &ask).await {
                    Ok((s, _, j)) if s == 200 => j["token"].as_str().unwrap_or_default().to_owned(),
                    _ => {
                        w.error().await;
                        continue;
                    }
                };
                let release = if recipe == "election" { "/v1/elections/resign" } else { "/v1/locks/release" };
                let released: Vec<&str> =
                    if recipe == "multikey" { keys.split(' ').collect() } else { vec![key.as_str()] };
                let mut ok = true;
                for k in released {
                    let h = [("x-lock-key", k), ("x-lock-token", token.as_str()), ("x-lock-session", session.as_str())];
                    ok &= matches!(post(&http, &format!("{base}{release}"), &h).await, Ok((s, _, _)) if s == 200);
                }
                if ok {
                    w.cycle(began);
                } else {
                    w.error().await;
                }
            }
            let _ = post(&http, &format!("{base}/v1/sessions/close"), &[("x-lock-session", &session)]).await;
        }));
    }
    for t in tasks {
        t.await?;
    }
    Ok(())
}

/// etcd's side: one client (connection, lease) per task.
async fn etcd(endpoints: &[String], prefix: &str, recipe: &'static str, clients: usize, w: &Arc<Window>) -> Result<()> {
    let mut tasks = Vec::new();
    for i in 0..clients {
        let mut c = Client::connect(endpoints, None).await.context("connect to etcd")?;
        let lease = c.lease_grant(60, None).await?.id();
        let w = w.clone();
        let (name, mut ring) = (
            format!("{prefix}/elect"),
            match recipe {
                "mutex" => vec![format!("{prefix}/mutex/hot")],
                "mutex-own" => vec![format!("{prefix}/mutex/k{i}")],
                _ => vec![format!("{prefix}/ring/k{i}"), format!("{prefix}/ring/k{}", (i + 1) % clients)],
            },
        );
        ring.sort();
        tasks.push(tokio::spawn(async move {
            while !w.done() {
                let began = Instant::now();
                let ok = if recipe == "election" {
                    match c.campaign(name.as_str(), format!("c{i}"), lease).await {
                        Ok(r) => match r.leader().cloned() {
                            Some(l) => c.resign(Some(ResignOptions::new().with_leader(l))).await.is_ok(),
                            None => false,
                        },
                        Err(_) => false,
                    }
                } else {
                    let mut held = Vec::new();
                    for k in &ring {
                        match c.lock(k.as_str(), Some(LockOptions::new().with_lease(lease))).await {
                            Ok(r) => held.push(r.key().to_vec()),
                            Err(_) => break,
                        }
                    }
                    let all = held.len() == ring.len();
                    for k in held {
                        let _ = c.unlock(k).await;
                    }
                    all
                };
                if ok {
                    w.cycle(began);
                } else {
                    w.error().await;
                }
            }
            let _ = c.lease_revoke(lease).await;
        }));
    }
    for t in tasks {
        t.await?;
    }
    Ok(())
}

/// A standalone ZooKeeper 3.8 (Debian's, `ZooKeeperServerMain`) on a free
/// loopback port, in a temporary directory; killed on drop.
struct ZooKeeper {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl ZooKeeper {
    const JAR: &'static str = "/usr/share/java/zookeeper.jar";

    async fn start() -> Result<Self> {
        ensure!(
            Path::new(Self::JAR).is_file(),
            "{} is missing: run scripts/setup --bench (it installs ZooKeeper 3.8 from Debian)",
            Self::JAR
        );
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = std::process::Command::new("java")
            .args(["-Xmx512m", "-cp", Self::JAR, "org.apache.zookeeper.server.ZooKeeperServerMain"])
            .arg(port.to_string())
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("start ZooKeeper (java; run scripts/setup --bench)")?;
        let zk = Self { child, port, _dir: dir };
        let until = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            if Instant::now() > until {
                bail!("ZooKeeper did not listen on {port} within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(zk)
    }

    async fn run(
        &self,
        python: &Path,
        recipe: &'static str,
        clients: usize,
        seconds: f64,
        warmup: f64,
    ) -> Result<RecipeResult> {
        let script: PathBuf = lockmesh_tests::repo_root().join("tests/load/kazoo_recipes.py");
        let out = tokio::process::Command::new(python)
            .arg(&script)
            .args(["--hosts", &format!("127.0.0.1:{}", self.port), "--recipe", recipe])
            .args([
                "--clients",
                &clients.to_string(),
                "--seconds",
                &seconds.to_string(),
                "--warmup",
                &warmup.to_string(),
            ])
            .output()
            .await
            .context("run kazoo_recipes.py")?;
        ensure!(out.status.success(), "kazoo_recipes.py {recipe}: {}", String::from_utf8_lossy(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).context("kazoo_recipes.py output")?;
        let f = |k: &str| j[k].as_f64().unwrap_or(0.0);
        Ok(RecipeResult {
            recipe,
            system: "ZooKeeper (kazoo)",
            cycles: j["cycles"].as_u64().unwrap_or(0),
            per_s: f("per_s"),
            p50_ms: f("p50_ms"),
            p99_ms: f("p99_ms"),
            errors: j["errors"].as_u64().unwrap_or(0),
        })
    }
}

impl Drop for ZooKeeper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The report: one row per recipe and system, with lockmesh's rate as a ratio of
/// each peer's (above 1: lockmesh completes more cycles). With a bench-floor
/// arbiter (`floor`) the lockmesh rows are that floor, and the goal lines say
/// whether the floor itself reaches each goal instead.
pub fn render(results: &[RecipeResult], clients: usize, seconds: f64, floor: Option<Floor>) -> String {
    let mut s =
        format!("recipes: {clients} clients, {seconds} s measured per recipe and system, no work under a grant\n");
    match floor {
        Some(Floor::Mesh) => s.push_str(
            "FLOOR: the arbiter is the bench-floor build: the lockmesh rows are Envoy, the Wasm filter, ext_proc and the arbiter answering without etcd\n",
        ),
        Some(Floor::Etcd) => s.push_str(
            "ETCD FLOOR: the arbiter is the bench-floor build at its etcd level: the lockmesh rows make lockmesh's etcd requests (grant, raft check where etcd answers it, release or one-transaction hand-off) without the lock logic around them\n",
        ),
        None => {}
    }
    s.push_str("| recipe | system | cycles/s | cycle p50 ms | cycle p99 ms | errors | lockmesh / this |\n|---|---|---|---|---|---|---|\n");
    for r in results {
        let ours = results.iter().find(|x| x.recipe == r.recipe && x.system == "lockmesh").map_or(0.0, |x| x.per_s);
        let ratio =
            if r.system == "lockmesh" || r.per_s == 0.0 { "".to_owned() } else { format!("{:.2}x", ours / r.per_s) };
        s.push_str(&format!(
            "| {} | {} | {:.0} | {:.1} | {:.1} | {} | {} |\n",
            r.recipe, r.system, r.per_s, r.p50_ms, r.p99_ms, r.errors, ratio
        ));
    }
    // Issue 20's goals against ZooKeeper's lock recipe.
    for (recipe, what, goal) in [("mutex", "one hot key", 1.2), ("mutex-own", "uncontended", 1.5)] {
        let find = |system: &str| results.iter().find(|r| r.recipe == recipe && r.system == system);
        let (Some(ours), Some(zk)) = (find("lockmesh"), find("ZooKeeper (kazoo)").filter(|z| z.per_s > 0.0)) else {
            continue;
        };
        let x = ours.per_s / zk.per_s;
        let reach = if x >= goal { "reachable" } else { "NOT reachable on this design" };
        match floor {
            None => {
                let verdict = if x >= goal { "met" } else { "NOT met" };
                s.push_str(&format!(
                    "goal recipes {recipe}: {what} cycles/s >= {goal:.1}x ZooKeeper's lock recipe: {x:.2}x, {verdict}\n"
                ));
            }
            Some(f) => {
                let which = if f == Floor::Mesh { "mesh" } else { "etcd" };
                s.push_str(&format!(
                    "floor recipes {recipe}: {what} cycles/s of the {which} floor / ZooKeeper's lock recipe {x:.2}x (goal {goal:.1}x): {reach}\n"
                ));
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(recipe: &'static str, system: &'static str, per_s: f64) -> RecipeResult {
        RecipeResult { recipe, system, cycles: 0, per_s, p50_ms: 1.0, p99_ms: 2.0, errors: 0 }
    }

    /// A floor run's lockmesh rows are the floor: its lines say whether the floor
    /// reaches each goal, never that the goal is met.
    #[test]
    fn a_floor_run_reports_reach_not_goals() {
        let rows = [
            row("mutex", "lockmesh", 500.0),
            row("mutex", "ZooKeeper (kazoo)", 400.0),
            row("mutex-own", "lockmesh", 1000.0),
            row("mutex-own", "ZooKeeper (kazoo)", 800.0),
        ];
        let text = render(&rows, 8, 10.0, None);
        assert!(
            text.contains("goal recipes mutex: one hot key cycles/s >= 1.2x ZooKeeper's lock recipe: 1.25x, met"),
            "{text}"
        );
        assert!(
            text.contains(
                "goal recipes mutex-own: uncontended cycles/s >= 1.5x ZooKeeper's lock recipe: 1.25x, NOT met"
            ),
            "{text}"
        );
        let text = render(&rows, 8, 10.0, Some(Floor::Etcd));
        assert!(!text.contains("goal recipes"), "{text}");
        assert!(text.contains("floor recipes mutex: one hot key cycles/s of the etcd floor / ZooKeeper's lock recipe 1.25x (goal 1.2x): reachable"), "{text}");
        assert!(
            text.contains("floor recipes mutex-own: uncontended cycles/s of the etcd floor / ZooKeeper's lock recipe 1.25x (goal 1.5x): NOT reachable on this design"),
            "{text}"
        );
        let text = render(&rows, 8, 10.0, Some(Floor::Mesh));
        assert!(text.contains("floor recipes mutex: one hot key cycles/s of the mesh floor / ZooKeeper's lock recipe 1.25x (goal 1.2x): reachable"), "{text}");
    }
}
