//! ClickHouse's engine behind a thin HTTP front, for the audit sink's scenarios
//! ([`ChdbFront`]).
//!
//! The front is `tests/support/chdb_front.py`, run by the Python of the venv that
//! `scripts/setup` makes (`.tools/chdb`, chdb-core with its engine; override the
//! interpreter with `LOCKMESH_CHDB_PYTHON`). It is not ClickHouse's server: its
//! module doc says what it accepts and what it does not check. The engine's data
//! directory is kept across [`ChdbFront::restart`]. A user and a password are
//! required on every request (`X-ClickHouse-User`/`X-ClickHouse-Key`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use tempfile::TempDir;

use crate::paths::{repo_root, temp_dir, tool};
use crate::ports::free_port;
use crate::probe::http_get;
use crate::process::ChildProcess;

/// The user the front admits.
pub const CH_USER: &str = "lockmesh_audit";
/// How long the engine may take to start.
const READY: Duration = Duration::from_secs(60);

/// A running front on a free loopback port; killed on drop.
pub struct ChdbFront {
    port: u16,
    process: ChildProcess,
    password: String,
    dir: TempDir,
    http: reqwest::Client,
}

// === impl ChdbFront ===

impl ChdbFront {
    /// Starts the front on a fresh data directory and waits for `/ping`.
    pub async fn start() -> Result<Self> {
        let python =
            tool("LOCKMESH_CHDB_PYTHON", repo_root().join(".tools/chdb/bin/python"), "chdb-core (.tools/chdb)")?;
        let script = repo_root().join("tests/support/chdb_front.py");
        let dir = temp_dir("chdb-")?;
        let password = format!("pw-{:016x}", rand::random::<u64>());
        std::fs::write(dir.path().join("password"), &password)?;
        let port = free_port();
        let args = vec![
            script.display().to_string(),
            "--port".into(),
            port.to_string(),
            "--path".into(),
            dir.path().join("data").display().to_string(),
            "--user".into(),
            CH_USER.into(),
            "--password-file".into(),
            dir.path().join("password").display().to_string(),
        ];
        let process = ChildProcess::new("chdb-front", python, args, dir.path().join("front.log"));
        let front = Self { port, process, password, dir, http: reqwest::Client::new() };
        front.process.start()?;
        front.wait_up().await?;
        Ok(front)
    }

    async fn wait_up(&self) -> Result<()> {
        let port = self.port;
        self.process
            .wait_ready(READY, async || {
                let r = http_get(port, "/ping").await?;
                anyhow::ensure!(r.body.starts_with("Ok."), "ping answered {:?}", r.body);
                Ok(())
            })
            .await
    }

    /// SIGKILL: requests are refused until [`ChdbFront::start_again`].
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Starts the killed front again on the same data directory.
    pub async fn start_again(&self) -> Result<()> {
        self.process.start()?;
        self.wait_up().await
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A file holding the password (for `clickhouse.password_file`).
    pub fn password_file(&self) -> PathBuf {
        self.dir.path().join("password")
    }

    /// The front's log.
    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }

    /// Runs one statement (the body of a `POST /`) as [`CH_USER`]; its output, or
    /// an error with ClickHouse's message.
    pub async fn query(&self, sql: &str) -> Result<String> {
        let r = self
            .http
            .post(format!("{}/", self.url()))
            .header("X-ClickHouse-User", CH_USER)
            .header("X-ClickHouse-Key", &self.password)
            .body(sql.to_owned())
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .with_context(|| format!("POST {}", self.url()))?;
        let status = r.status();
        let text = r.text().await?;
        if !status.is_success() {
            bail!("clickhouse front answered {status}: {text}");
        }
        Ok(text)
    }

    /// Runs the shipped DDL (`lockmesh_audit::clickhouse::DDL`), one statement per request.
    pub async fn apply_ddl(&self, statements: &[String]) -> Result<()> {
        for s in statements {
            self.query(s).await.with_context(|| format!("DDL statement {s:?}"))?;
        }
        Ok(())
    }

    /// A number answered by `sql` (`SELECT count() ...`).
    pub async fn number(&self, sql: &str) -> Result<u64> {
        let t = self.query(sql).await?;
        t.trim().parse().with_context(|| format!("{sql}: not a number: {t:?}"))
    }
}
