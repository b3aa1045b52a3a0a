//! Supervised child processes: the common part of etcd, Envoy and the arbiter.
//!
//! A [`ChildProcess`] remembers its command line, so it can be started again
//! with the same arguments (same ports, same data directory). Its stdout and
//! stderr are appended to one log file, which is printed (last 200 lines) when
//! the owning test panics. It is killed with SIGKILL on `Drop`.
//!
//! Every child is spawned from one long-lived "spawner" thread with
//! `prctl(PR_SET_PDEATHSIG, SIGKILL)`. The death signal fires when the thread
//! that forked the child exits, not the process: forking from a test thread
//! would kill the shared etcd as soon as the first test finished. The spawner
//! thread lives as long as the test binary, so children die with the binary
//! even when `Drop` never runs (statics, `process::exit`, SIGKILL of the test).

// This is the module of the crate that uses `unsafe` (with `gate::history::now_us`,
// a raw clock_gettime): `pre_exec` (which runs `prctl`, and `unlink` of a
// libfaketime leftover, between fork and exec) and `kill(2)` for SIGSTOP, SIGCONT
// and SIGTERM have no safe std API. All are async-signal-safe libc calls.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use tokio::time::Instant;

/// How often readiness and exit are polled.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// How many log lines are printed when a test fails.
pub const LOG_TAIL_LINES: usize = 200;

/// A child process with a fixed command line, a log file and kill-on-drop.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log_path: PathBuf,
    extra_logs: Vec<PathBuf>,
    child: Mutex<Option<Child>>,
}

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

// === impl ChildProcess ===

impl ChildProcess {
    /// Describes a process; nothing runs until [`ChildProcess::start`].
    ///
    /// `name` labels log dumps ("etcd-1", "envoy"); `log_path` receives stdout
    /// and stderr, appended across restarts.
    pub fn new(
        name: impl Into<String>,
        program: impl Into<PathBuf>,
        args: Vec<String>,
        log_path: impl Into<PathBuf>,
    ) -> Self {
        remember_panics();
        Self {
            name: name.into(),
            program: program.into(),
            args,
            envs: Vec::new(),
            log_path: log_path.into(),
            extra_logs: Vec::new(),
            child: Mutex::new(None),
        }
    }

    /// Adds an environment variable for the child.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// Adds another log file (written by the process itself, e.g. Envoy's
    /// `--log-path`) to print when a test fails.
    pub fn extra_log(mut self, path: impl Into<PathBuf>) -> Self {
        self.extra_logs.push(path.into());
        self
    }

    /// The label used in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file receiving the child's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The command line, for messages.
    pub fn command_line(&self) -> String {
        let mut line = self.program.display().to_string();
        for arg in &self.args {
            line.push(' ');
            line.push_str(arg);
        }
        line
    }

    /// Spawns the process. Fails if it is already running.
    pub fn start(&self) -> Result<()> {
        let mut slot = self.slot();
        if let Some(child) = slot.as_mut() {
            if child.try_wait()?.is_none() {
                bail!("{} is already running (pid {})", self.name, child.id());
            }
        }
        let mut log = File::options()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .with_context(|| format!("open log {}", self.log_path.display()))?;
        writeln!(log, "=== lockmesh-tests: starting {}", self.command_line())?;
        let faketime = self.preloads_faketime();
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = spawn_with_pdeathsig(cmd, faketime)
            .with_context(|| format!("spawn {}: {}", self.name, self.command_line()))?;
        *slot = Some(child);
        Ok(())
    }

    /// The pid while the process runs (also while paused).
    pub fn pid(&self) -> Option<u32> {
        let mut slot = self.slot();
        let child = slot.as_mut()?;
        match child.try_wait() {
            Ok(None) => Some(child.id()),
            _ => None,
        }
    }

    /// Whether the process has been started and has not exited.
    pub fn is_running(&self) -> bool {
        self.pid().is_some()
    }

    /// The exit status if the process was started and has exited.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        self.slot().as_mut()?.try_wait().ok().flatten()
    }

    /// SIGKILL, then reap. A no-op if the process is not running.
    pub fn kill(&self) {
        if let Some(child) = self.slot().as_mut() {
            // Errors mean the process is already gone; both calls reap or no-op.
            let _ = child.kill();
            let _ = child.wait();
            if self.preloads_faketime() {
                remove_faketime_shm(child.id());
            }
        }
    }

    /// Whether the child runs under libfaketime (the gate's clock steps).
    ///
    /// libfaketime keeps `/dev/shm/faketime_shm_<pid>` and
    /// `/dev/shm/sem.faketime_sem_<pid>` while a process runs and leaves them when
    /// it is killed; a later process that gets the same pid then dies at start
    /// ("shm_open failed: File exists"). Such a child removes its own pid's
    /// leftovers before exec, and [`ChildProcess::kill`] removes them after the reap.
    fn preloads_faketime(&self) -> bool {
        self.envs.iter().any(|(k, v)| k == "LD_PRELOAD" && v.contains("faketime"))
    }

    /// SIGSTOP: the process stays alive but does nothing (a GC pause, a frozen VM).
    ///
    /// Returns once every thread is stopped: signal delivery is asynchronous,
    /// and a thread still running could answer one more request.
    pub fn pause(&self) -> Result<()> {
        self.signal(libc::SIGSTOP)?;
        let pid = self.pid().context("process exited while pausing")?;
        let deadline = Duration::from_secs(2);
        let mut waited = Duration::ZERO;
        while !all_threads_stopped(pid) {
            if waited >= deadline {
                bail!("{}: threads still running {deadline:?} after SIGSTOP", self.name);
            }
            // A bounded wait of a few ms at most in practice; pause() stays sync.
            std::thread::sleep(Duration::from_millis(1));
            waited += Duration::from_millis(1);
        }
        Ok(())
    }

    /// SIGCONT after [`ChildProcess::pause`].
    pub fn resume(&self) -> Result<()> {
        self.signal(libc::SIGCONT)
    }

    /// SIGTERM (after SIGCONT, in case it is paused), then waits up to
    /// `grace` for the exit, then SIGKILL. A no-op if the process is not running.
    pub async fn stop(&self, grace: Duration) -> Result<()> {
        if !self.is_running() {
            return Ok(());
        }
        self.signal(libc::SIGCONT)?;
        self.signal(libc::SIGTERM)?;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !self.is_running() {
                return Ok(());
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
        tracing::warn!(name = %self.name, ?grace, "no exit after SIGTERM; sending SIGKILL");
        self.kill();
        Ok(())
    }

    /// Sends `signal` to the running process.
    pub fn signal(&self, signal: libc::c_int) -> Result<()> {
        let mut slot = self.slot();
        let child = slot.as_mut().ok_or_else(|| anyhow!("{} was never started", self.name))?;
        if let Some(status) = child.try_wait()? {
            bail!("{} is not running (exited: {status})", self.name);
        }
        let pid = libc::pid_t::try_from(child.id())?;
        // SAFETY: kill(2) has no memory-safety preconditions. The pid is our
        // unreaped child (checked above under the lock), so it cannot have been
        // reused by another process.
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(io::Error::last_os_error()).with_context(|| format!("kill({pid}, {signal}) for {}", self.name));
        }
        Ok(())
    }

    /// Polls `probe` every [`POLL_INTERVAL`] until it succeeds, the process
    /// exits (error with its log), or `timeout` passes (error with the last
    /// probe error and the log).
    pub async fn wait_ready(&self, timeout: Duration, mut probe: impl AsyncFnMut() -> Result<()>) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last_err = anyhow!("not probed yet");
        loop {
            if let Some(status) = self.exit_status() {
                bail!("{} exited during startup ({status})\n{}", self.name, self.log_tails());
            }
            match probe().await {
                Ok(()) => return Ok(()),
                Err(e) => last_err = e,
            }
            if Instant::now() >= deadline {
                bail!("{} not ready after {timeout:?}: {last_err:#}\n{}", self.name, self.log_tails());
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// The last [`LOG_TAIL_LINES`] lines of each log, with headers.
    pub fn log_tails(&self) -> String {
        let mut out = String::new();
        for path in std::iter::once(&self.log_path).chain(&self.extra_logs) {
            out.push_str(&format!("----- last {LOG_TAIL_LINES} lines of {} log {} -----\n", self.name, path.display()));
            out.push_str(&tail(path, LOG_TAIL_LINES));
        }
        out
    }

    fn slot(&self) -> MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let started = self.slot().is_some();
        self.kill();
        if started && std::thread::panicking() {
            eprintln!("{}", self.log_tails());
            // CI shows the end of the output: say again why the test failed,
            // after the logs that would otherwise bury the panic message.
            if let Some(why) = PANIC_MESSAGE.with(|m| m.borrow().clone()) {
                eprintln!("----- the test failed (repeated after {}'s log): {why}", self.name);
            }
        }
    }
}

thread_local! {
    /// The message of the panic this thread is unwinding from, for [`ChildProcess`]'s
    /// drop to repeat after the log tails it prints.
    static PANIC_MESSAGE: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Installs (once per binary) a panic hook that keeps the panic's message and
/// location for the panicking thread, then runs the hook that was there before.
fn remember_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let text = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(a panic without a message)".to_owned());
            let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
            // Bounded: a history dump in a message must not double the output.
            let text: String = text.chars().take(4000).collect();
            PANIC_MESSAGE.with(|m| *m.borrow_mut() = Some(format!("{text}{at}")));
            previous(info);
        }));
    });
}

/// The last `lines` lines of a file, or a note saying why it cannot be read.
pub fn tail(path: &Path, lines: usize) -> String {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) => return format!("(cannot read {}: {e})\n", path.display()),
    };
    let mut last = VecDeque::with_capacity(lines);
    for line in BufReader::new(file).split(b'\n').map_while(Result::ok) {
        if last.len() == lines {
            last.pop_front();
        }
        last.push_back(String::from_utf8_lossy(&line).into_owned());
    }
    let mut out = String::new();
    for line in last {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// Whether every thread of `pid` is in state `T` (stopped) per `/proc`.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // "tid (comm) S ...": comm may hold spaces and parentheses.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                .is_some_and(|state| state == 'T' || state == 't')
        })
    })
}

/// libfaketime's shared-memory names for a pid (see `ChildProcess::preloads_faketime`).
const FAKETIME_SHM: [&[u8]; 2] = [b"/dev/shm/faketime_shm_", b"/dev/shm/sem.faketime_sem_"];

/// Removes libfaketime's leftovers of a reaped child.
fn remove_faketime_shm(pid: u32) {
    for prefix in FAKETIME_SHM {
        let _ = std::fs::remove_file(format!("{}{pid}", String::from_utf8_lossy(prefix)));
    }
}

/// In a forked child before exec: unlinks libfaketime's leftovers of an earlier
/// process with this pid. Async-signal-safe (getpid, unlink; no allocation).
fn unlink_own_faketime_shm() {
    // SAFETY: getpid(2) has no preconditions.
    let mut n = unsafe { libc::getpid() }.unsigned_abs();
    let mut digits = [0u8; 10];
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for prefix in FAKETIME_SHM {
        let mut path = [0u8; 48];
        let digits = &digits[start..];
        path[..prefix.len()].copy_from_slice(prefix);
        path[prefix.len()..prefix.len() + digits.len()].copy_from_slice(digits);
        // SAFETY: `path` is NUL-terminated (zeroed past the digits; 26 + 10 < 48).
        unsafe { libc::unlink(path.as_ptr().cast()) };
    }
}

/// Spawns `cmd` from the spawner thread, with SIGKILL as its parent-death signal
/// (and libfaketime's leftovers of its pid removed first if `faketime`).
fn spawn_with_pdeathsig(mut cmd: Command, faketime: bool) -> io::Result<Child> {
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe calls (prctl, getppid, getpid, unlink); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The test binary may have died between fork and prctl.
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(io::Error::other("parent exited before exec"));
            }
            if faketime {
                unlink_own_faketime_shm();
            }
            Ok(())
        });
    }
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner().send((cmd, reply_tx)).map_err(|_| io::Error::other("spawner thread is gone"))?;
    reply_rx.recv().map_err(|_| io::Error::other("spawner thread dropped the request"))?
}

/// The sender to the spawner thread, started on first use.
fn spawner() -> &'static mpsc::Sender<SpawnRequest> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        // Detached on purpose: it must outlive every test thread (see module doc).
        // The sender lives in a static, so `recv` never fails and it never exits.
        let spawned = std::thread::Builder::new().name("lockmesh-spawner".into()).spawn(move || {
            while let Ok((mut cmd, reply)) = rx.recv() {
                let _ = reply.send(cmd.spawn());
            }
        });
        if let Err(e) = spawned {
            panic!("cannot start the spawner thread: {e}");
        }
        tx
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn start_pause_stop_and_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sh.log");
        let p = ChildProcess::new("sh", "/bin/sh", vec!["-c".into(), "echo hello; exec sleep 30".into()], &log);
        p.start().unwrap();
        assert!(p.is_running());
        assert!(p.start().is_err(), "double start must fail");
        p.pause().unwrap();
        assert!(all_threads_stopped(p.pid().unwrap()));
        p.resume().unwrap();
        p.wait_ready(Duration::from_secs(5), async || {
            anyhow::ensure!(tail(&log, 10).contains("hello"));
            Ok(())
        })
        .await
        .unwrap();
        p.stop(Duration::from_secs(5)).await.unwrap();
        assert!(!p.is_running());
        assert!(p.signal(libc::SIGTERM).is_err());
        // Restart appends to the same log.
        p.start().unwrap();
        p.kill();
        assert_eq!(tail(&log, 10).matches("starting").count(), 2);
    }

    #[tokio::test]
    async fn early_exit_is_reported_with_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let p = ChildProcess::new(
            "false",
            "/bin/sh",
            vec!["-c".into(), "echo boom; exit 3".into()],
            dir.path().join("x.log"),
        );
        p.start().unwrap();
        let err = p.wait_ready(Duration::from_secs(5), async || anyhow::bail!("never")).await.unwrap_err().to_string();
        assert!(err.contains("exited during startup"), "{err}");
        assert!(err.contains("boom"), "{err}");
    }
}
