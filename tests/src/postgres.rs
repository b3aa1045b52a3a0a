//! A real PostgreSQL server for the reference fence tests ([`PostgresProcess`]).
//!
//! Binaries: `PG_BINDIR`, else the directory named in `<repo>/.tools/postgresql/BINDIR`
//! that `scripts/setup` writes (the system's `/usr/lib/postgresql/15/bin` when
//! installed, else Debian's packages extracted into `.tools/postgresql`).
//!
//! PostgreSQL refuses to run as root. When the tests run as root, the server runs as
//! the system user [`PG_USER`] (created with `useradd` if missing) through
//! `setpriv`, which execs in place, so the harness's pid is the postmaster's and
//! `--pdeathsig` kills it with the test binary. Otherwise it runs as the current
//! user. Each server gets a free loopback port, a fresh `initdb` in a temporary
//! directory, TCP only (no Unix socket), `trust` auth for the superuser
//! [`PG_SUPERUSER`], and `fsync=off` (the tests check statements, not crash
//! durability). Dropping it asks for a fast shutdown (SIGINT), then kills it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use tempfile::TempDir;

use crate::paths::{repo_root, temp_dir};
use crate::ports::free_port;
use crate::process::ChildProcess;

/// The system user the server runs as when the tests run as root.
pub const PG_USER: &str = "lockmesh-pg";
/// The database superuser `initdb` creates (trust auth on loopback).
pub const PG_SUPERUSER: &str = "lockmesh";
/// How long startup may take.
pub const PG_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a fast shutdown may take on drop before SIGKILL.
const PG_STOP_GRACE: Duration = Duration::from_secs(5);

/// A running PostgreSQL server; shut down on drop.
#[derive(Debug)]
pub struct PostgresProcess {
    port: u16,
    process: ChildProcess,
    _dir: TempDir,
}

// === impl PostgresProcess ===

impl PostgresProcess {
    /// `initdb` a fresh cluster and start the server; waits until it accepts
    /// connections.
    pub async fn start() -> Result<Self> {
        let bindir = pg_bindir()?;
        let dir = temp_dir("pg-")?;
        let run_as = run_as()?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .with_context(|| format!("chown {} to {PG_USER}", dir.path().display()))?;
        }
        let data = dir.path().join("data");
        let log = dir.path().join("postgres.log");
        let initdb = wrap(
            run_as,
            &bindir.join("initdb"),
            &[
                "-D",
                &data.display().to_string(),
                "-U",
                PG_SUPERUSER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ],
        );
        let out = Command::new(&initdb.0)
            .args(&initdb.1)
            .envs(lib_env(&bindir))
            .output()
            .with_context(|| format!("run {}", bindir.join("initdb").display()))?;
        if !out.status.success() {
            bail!(
                "initdb failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let port = free_port();
        let (program, args) = wrap(
            run_as,
            &bindir.join("postgres"),
            &[
                "-D",
                &data.display().to_string(),
                "-p",
                &port.to_string(),
                "-h",
                "127.0.0.1",
                "-k",
                "",
                "-F",
                "-c",
                "max_connections=60",
            ],
        );
        let mut process = ChildProcess::new("postgres", program, args, &log);
        for (k, v) in lib_env(&bindir) {
            process = process.env(k, v);
        }
        process.start()?;
        let pg = Self { port, process, _dir: dir };
        pg.process
            .wait_ready(PG_READY_TIMEOUT, async || {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if !text.contains("database system is ready to accept connections") {
                    bail!("no \"ready to accept connections\" line in the log yet");
                }
                Ok(())
            })
            .await?;
        Ok(pg)
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://lockmesh@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://{PG_SUPERUSER}@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// SIGKILL.
    pub fn kill(&self) {
        self.process.kill();
    }
}

impl Drop for PostgresProcess {
    fn drop(&mut self) {
        // Fast shutdown: roll back sessions, exit; SIGKILL (ChildProcess's drop)
        // if it takes longer.
        if self.process.signal(libc::SIGINT).is_ok() {
            let mut waited = Duration::ZERO;
            while self.process.is_running() && waited < PG_STOP_GRACE {
                std::thread::sleep(Duration::from_millis(20));
                waited += Duration::from_millis(20);
            }
        }
    }
}

/// The PostgreSQL binaries directory, or a fix-it error.
pub fn pg_bindir() -> Result<PathBuf> {
    let dir = match std::env::var_os("PG_BINDIR").filter(|p| !p.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => {
            let f = repo_root().join(".tools/postgresql/BINDIR");
            let text = std::fs::read_to_string(&f)
                .with_context(|| format!("postgresql not installed: run scripts/setup (no {})", f.display()))?;
            PathBuf::from(text.trim())
        }
    };
    for b in ["postgres", "initdb"] {
        if !dir.join(b).is_file() {
            bail!(
                "postgresql not installed: run scripts/setup (no {} in {}; override with PG_BINDIR)",
                b,
                dir.display()
            );
        }
    }
    Ok(dir)
}

/// Extracted packages need their own libpq on the library path.
fn lib_env(bindir: &Path) -> Vec<(String, String)> {
    let tools = repo_root().join(".tools/postgresql");
    if bindir.starts_with(&tools) {
        vec![("LD_LIBRARY_PATH".into(), tools.join("usr/lib/x86_64-linux-gnu").display().to_string())]
    } else {
        Vec::new()
    }
}

/// `None` when not root; else the uid and gid of [`PG_USER`], created if missing.
fn run_as() -> Result<Option<(u32, u32)>> {
    let me = Command::new("id").arg("-u").output().context("run id -u")?;
    if String::from_utf8_lossy(&me.stdout).trim() != "0" {
        return Ok(None);
    }
    static USERADD: Mutex<()> = Mutex::new(());
    let _once = USERADD.lock().unwrap_or_else(|p| p.into_inner());
    let id = |flag: &str| -> Option<u32> {
        let o = Command::new("id").args([flag, PG_USER]).output().ok()?;
        o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().parse().ok()).flatten()
    };
    if id("-u").is_none() {
        let st = Command::new("useradd")
            .args(["--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"])
            .args(["--shell", "/usr/sbin/nologin", PG_USER])
            .status()
            .context("run useradd (PostgreSQL refuses root: the tests run it as its own user)")?;
        // 9: the user exists (another test binary created it meanwhile).
        if !st.success() && st.code() != Some(9) {
            bail!("useradd {PG_USER} failed ({st}): PostgreSQL refuses to run as root");
        }
    }
    match (id("-u"), id("-g")) {
        (Some(u), Some(g)) => Ok(Some((u, g))),
        _ => bail!("user {PG_USER} has no uid/gid after useradd"),
    }
}

/// The command line, wrapped in `setpriv` when running as another user.
fn wrap(run_as: Option<(u32, u32)>, program: &Path, args: &[&str]) -> (PathBuf, Vec<String>) {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    match run_as {
        None => (program.to_owned(), args),
        Some((uid, gid)) => {
            let mut v = vec![
                format!("--reuid={uid}"),
                format!("--regid={gid}"),
                "--clear-groups".into(),
                "--pdeathsig=KILL".into(),
                "--".into(),
                program.display().to_string(),
            ];
            v.extend(args);
            (PathBuf::from("setpriv"), v)
        }
    }
}
