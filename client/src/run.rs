//! `lockctl run KEY -- CMD ARGS...`: runs a command while holding a lock, like
//! `etcdctl lock KEY CMD` and `consul lock PREFIX CMD`; `lockctl elect NAME -- CMD
//! ARGS...` runs one only while leader of an election, like `etcdctl elect NAME
//! CMD` (campaigning until leader unless `--wait-ms` bounds it; `--value` is
//! proclaimed with the leadership). Both work the same way once the command runs,
//! the leadership being the election key's hold:
//!
//! - The child gets `LOCKMESH_KEY`, `LOCKMESH_TOKEN`, `LOCKMESH_EPOCH`,
//!   `LOCKMESH_REVISION`, `LOCKMESH_SESSION` and `LOCKMESH_TTL_S` in its
//!   environment, and `LOCKMESH_PROOF` (the grant's signed proof, for a resource
//!   behind fence-proxy) when the service signs proofs; it should present the
//!   token (and the proof) to the resource it writes.
//! - When the lock is lost (the fence deadline passed, the service dropped the
//!   session, or the epoch changed) the child gets SIGTERM, then SIGKILL after the
//!   grace period.
//! - **Jeopardy** (a keepalive failed; the fence deadline has not come): the file
//!   named by `LOCKMESH_JEOPARDY_FILE` exists from the first failed keepalive until
//!   a later one is acknowledged (recovery removes it), and from the loss of the
//!   lock until the child ends: a child that checks it before each unit of work
//!   never starts one in jeopardy. Its content is `jeopardy` or `lost <reason>`.
//!   The path is `jeopardy` in a new private directory (mode 0700) under the
//!   temporary directory unless `--jeopardy-file` names one. With
//!   `--jeopardy-signal SIG` the child also gets SIG when jeopardy starts and again
//!   when it ends by recovery (the file says which); by default no signal is sent,
//!   since a signal the child does not handle would end it at every keepalive blip.
//! - SIGTERM and SIGINT sent to `lockctl` are passed on to the child, and the
//!   child gets SIGKILL if `lockctl` dies (Linux `PR_SET_PDEATHSIG`): nobody
//!   renews its lock any more, and nobody would be left to kill a child that
//!   ignored a SIGTERM before the lock expired.
//! - The exit code is the child's (128 + the signal number if a signal ended it);
//!   the lock is released (the leadership resigned) when the child ends. Codes of
//!   `lockctl` itself: 64 a usage or configuration error, 75 the lock (the
//!   leadership) was not granted within the wait, 126 the command could not be
//!   started, 127 it was not found, 1 anything else (`elect`: the campaign's
//!   session was lost, or the class cannot hold an election).

use std::{
    net::SocketAddr,
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::ExitStatus,
    time::Duration,
};

use tokio::{
    process::{Child, Command},
    signal::unix::{signal, SignalKind},
    sync::mpsc,
};

use crate::{CampaignOptions, Client, Config, Error, HoldState, LockGuard, LockOptions, LossReason};

mod signal_child;

/// What `lockctl run` and `lockctl elect` share: the lock tier, the workload's
/// certificate, and how the command is told about jeopardy and stopped at a loss.
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[derive(Clone, Debug)]
pub struct HoldArgs {
    /// The lock tier's HTTPS URL.
    #[cfg_attr(feature = "cli", arg(long, env = "LOCKMESH_ENDPOINT"))]
    pub endpoint: String,
    /// PEM file of the CA that signs the lock tier's certificate.
    #[cfg_attr(feature = "cli", arg(long, env = "LOCKMESH_CA"))]
    pub ca: PathBuf,
    /// PEM file of the workload's client certificate (SPIFFE SVID).
    #[cfg_attr(feature = "cli", arg(long, env = "LOCKMESH_CERT"))]
    pub cert: PathBuf,
    /// PEM file of the client certificate's private key.
    #[cfg_attr(feature = "cli", arg(long, env = "LOCKMESH_CERT_KEY"))]
    pub cert_key: PathBuf,
    /// Connect to this address instead of resolving the endpoint's host.
    #[cfg_attr(feature = "cli", arg(long))]
    pub resolve: Option<SocketAddr>,
    /// How often the CA, certificate and key files are re-read for a rotation, in
    /// ms (the SDK's `cert_reload`; 0: read once at start). A command that outlives
    /// its SVID keeps its lock: keepalives on new connections present the rotated one.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 10_000))]
    pub cert_reload_ms: u64,
    /// Refuse unless the key's class is this one.
    #[cfg_attr(feature = "cli", arg(long))]
    pub class: Option<String>,
    /// Time between SIGTERM and SIGKILL when the lock is lost, in ms. Capped at
    /// `--margin-ms`: SIGTERM comes at the fence deadline (`TTL - margin` after the
    /// last acknowledged keepalive was sent), so the command is killed no later
    /// than the hold's own expiry, never while another holder may have the lock.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 1_000))]
    pub grace_ms: u64,
    /// Fence margin: the child is signalled at `last acknowledged keepalive send
    /// time + TTL - margin`, in ms.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 1_000))]
    pub margin_ms: u64,
    /// File that exists while the lock is in jeopardy (a keepalive failed and the
    /// fence deadline has not come) and after it is lost; recovery removes it. The
    /// command finds its path in LOCKMESH_JEOPARDY_FILE. A file already there is
    /// removed at start. Default: `jeopardy` in a new private directory (mode 0700)
    /// under $TMPDIR, removed with it when lockctl exits.
    #[cfg_attr(feature = "cli", arg(long))]
    pub jeopardy_file: Option<PathBuf>,
    /// Also send this signal to the command when the lock enters jeopardy and
    /// again when it recovers (the file says which): a name (USR1, SIGUSR2, HUP,
    /// ...) or a number. Default: no signal (one the command does not handle would
    /// end it at every keepalive blip).
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_signal))]
    pub jeopardy_signal: Option<i32>,
}

/// Command-line arguments of `lockctl run`.
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[derive(Clone, Debug)]
pub struct RunArgs {
    /// The lock tier, the certificate, the loss handling.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub hold: HoldArgs,
    /// How long to wait for the lock, in ms (0: try once).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub wait_ms: u64,
    /// Take this many of the key's N slots at once (x-lock-permits, 1-64).
    #[cfg_attr(feature = "cli", arg(long, conflicts_with = "mode"))]
    pub permits: Option<u32>,
    /// A read-write lock: `shared` (one slot, beside other readers) or
    /// `exclusive` (every slot, alone).
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_mode))]
    pub mode: Option<lockmesh_core::headers::LockMode>,
    /// The lock key.
    pub key: String,
    /// More keys to hold with KEY, all granted at once or none (a multi-key
    /// acquire, up to 16 keys in all, of one class): repeat the flag per key. The
    /// command then also gets LOCKMESH_KEYS (the keys, space-separated) and
    /// LOCKMESH_PROOFS (their proofs, in the same order); the token is the same
    /// for every key.
    #[cfg_attr(feature = "cli", arg(long = "also", value_name = "KEY", conflicts_with_all = ["permits", "mode"]))]
    pub also: Vec<String>,
    /// The command and its arguments (after `--`).
    #[cfg_attr(feature = "cli", arg(last = true, required = true))]
    pub command: Vec<String>,
}

/// Command-line arguments of `lockctl elect`.
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[derive(Clone, Debug)]
pub struct ElectArgs {
    /// The lock tier, the certificate, the loss handling.
    #[cfg_attr(feature = "cli", command(flatten))]
    pub hold: HoldArgs,
    /// How long to campaign, in ms (0: try once). Default: until leader.
    #[cfg_attr(feature = "cli", arg(long))]
    pub wait_ms: Option<u64>,
    /// The value to proclaim with the leadership (1-1024 printable ASCII bytes,
    /// no leading or trailing space): observers of the election see it.
    #[cfg_attr(feature = "cli", arg(long))]
    pub value: Option<String>,
    /// The election: a key of a class with max_holders 1 that fails closed.
    pub name: String,
    /// The command and its arguments (after `--`).
    #[cfg_attr(feature = "cli", arg(last = true, required = true))]
    pub command: Vec<String>,
}

/// Why `lockctl run` (or `elect`) did not run the command to its end.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No command after `--`.
    #[error("command: missing (lockctl run KEY -- CMD ARGS..., lockctl elect NAME -- CMD ARGS...)")]
    NoCommand,
    /// The lock could not be taken.
    #[error("lock: {0}")]
    Lock(#[from] Error),
    /// The leadership could not be won.
    #[error("campaign: {0}")]
    Campaign(Error),
    /// The command could not be started.
    #[error("command {program}: {source}")]
    Spawn {
        /// The command's first word, as given.
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// Waiting for the child failed.
    #[error("waiting for the command: {0}")]
    Wait(#[source] std::io::Error),
    /// The jeopardy file could not be prepared.
    #[error("jeopardy file {path}: {source}")]
    JeopardyFile {
        /// The path.
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What the client tells the supervising loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    /// Jeopardy started (true) or ended by recovery (false).
    Jeopardy(bool),
    /// The lock is lost.
    Lost(LossReason),
}

/// The file that tells the child about jeopardy (`LOCKMESH_JEOPARDY_FILE`).
#[derive(Debug)]
struct JeopardyFile {
    path: PathBuf,
    /// The private directory made for it, removed on drop.
    made_dir: Option<PathBuf>,
}

// === impl RunError ===

impl RunError {
    /// The exit code `lockctl` uses for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::NoCommand | RunError::Lock(Error::Config { .. }) | RunError::Campaign(Error::Config { .. }) => 64,
            RunError::Lock(Error::Contended { .. }) | RunError::Campaign(Error::Contended { .. }) => 75,
            RunError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => 127,
            RunError::Spawn { .. } => 126,
            RunError::JeopardyFile { .. } => 64,
            _ => 1,
        }
    }
}

/// Runs `lockctl run` and returns the process exit code; errors are printed.
pub async fn main(args: RunArgs) -> u8 {
    report(RUN, run(args).await)
}

/// Runs `lockctl elect` and returns the process exit code; errors are printed.
pub async fn elect_main(args: ElectArgs) -> u8 {
    report(ELECT, elect(args).await)
}

fn report(names: Names, r: Result<u8, RunError>) -> u8 {
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("lockctl {}: {e}", names.cmd);
            e.exit_code()
        }
    }
}

/// Takes the lock, runs the command under it, stops the command if the lock is
/// lost, releases the lock; returns the command's exit code.
pub async fn run(args: RunArgs) -> Result<u8, RunError> {
    let (program, rest) = args.command.split_first().ok_or(RunError::NoCommand)?;
    let mut held = Held::new(&args.hold, RUN)?;
    let mut opts = LockOptions::default().wait(Duration::from_millis(args.wait_ms));
    opts.class = args.hold.class.clone();
    (opts.permits, opts.mode) = (args.permits, args.mode);
    let guards = if args.also.is_empty() {
        vec![held.client.lock(&args.key, opts).await?]
    } else {
        let keys: Vec<&str> = std::iter::once(args.key.as_str()).chain(args.also.iter().map(String::as_str)).collect();
        held.client.lock_all(&keys, opts).await?
    };
    let status = held.command(program, rest, &guards).await;
    for g in guards {
        let _ = g.release().await;
    }
    held.client.shutdown().await;
    Ok(exit_code(status?))
}

/// Campaigns until leader (or `--wait-ms`), runs the command while leader, stops
/// it if the leadership is lost, resigns when it ends; returns its exit code.
pub async fn elect(args: ElectArgs) -> Result<u8, RunError> {
    let (program, rest) = args.command.split_first().ok_or(RunError::NoCommand)?;
    let mut held = Held::new(&args.hold, ELECT)?;
    let opts = CampaignOptions {
        wait: args.wait_ms.map(Duration::from_millis),
        value: args.value.clone(),
        class: args.hold.class.clone(),
        round: None,
    };
    let leadership = held.client.campaign(&args.name, opts).await.map_err(RunError::Campaign)?;
    let status = held.command(program, rest, std::slice::from_ref(leadership.guard())).await;
    let _ = leadership.resign().await;
    held.client.shutdown().await;
    Ok(exit_code(status?))
}

/// How a subcommand names itself and what it holds, in its messages.
#[derive(Clone, Copy, Debug)]
struct Names {
    cmd: &'static str,
    hold: &'static str,
}

const RUN: Names = Names { cmd: "run", hold: "lock" };
const ELECT: Names = Names { cmd: "elect", hold: "leadership" };

/// The client and everything that supervises the command under its hold.
struct Held {
    client: Client,
    told: mpsc::UnboundedReceiver<Told>,
    jeopardy: JeopardyFile,
    signal: Option<i32>,
    grace: Duration,
    names: Names,
}

// === impl Held ===

impl Held {
    /// The client for `args`, its fence and jeopardy callbacks feeding `told`.
    fn new(args: &HoldArgs, names: Names) -> Result<Self, RunError> {
        let mut config = Config::new(&args.endpoint, &args.ca, &args.cert, &args.cert_key);
        config.resolve = args.resolve;
        config.cert_reload = Some(Duration::from_millis(args.cert_reload_ms)).filter(|d| !d.is_zero());
        config.margin = Duration::from_millis(args.margin_ms);
        let jeopardy = JeopardyFile::new(args.jeopardy_file.clone())?;
        let (told_tx, told) = mpsc::unbounded_channel();
        let fenced = told_tx.clone();
        let client = Client::with_jeopardy(
            config,
            move |fence| {
                let _ = fenced.send(Told::Lost(fence.reason));
            },
            move |ev| {
                let _ = told_tx.send(Told::Jeopardy(ev.state == HoldState::Jeopardy));
            },
        )?;
        let grace = Duration::from_millis(args.grace_ms.min(args.margin_ms));
        Ok(Self { client, told, jeopardy, signal: args.jeopardy_signal, grace, names })
    }

    /// Runs the command under `guard` until it ends, or until the hold is lost
    /// (then SIGTERM, SIGKILL after the grace).
    async fn command(&mut self, program: &str, rest: &[String], guards: &[LockGuard]) -> Result<ExitStatus, RunError> {
        let guard = guards.first().ok_or(RunError::NoCommand)?;
        let mut cmd = Command::new(program);
        if guards.len() > 1 {
            let keys: Vec<&str> = guards.iter().map(LockGuard::key).collect();
            let proofs: Vec<&str> = guards.iter().map(|g| g.proof().unwrap_or("-")).collect();
            cmd.env("LOCKMESH_KEYS", keys.join(" ")).env("LOCKMESH_PROOFS", proofs.join(" "));
        }
        cmd.args(rest)
            .env("LOCKMESH_KEY", guard.key())
            .env("LOCKMESH_TOKEN", guard.token().to_string())
            .env("LOCKMESH_EPOCH", guard.epoch().to_string())
            .env("LOCKMESH_REVISION", guard.revision().to_string())
            .env("LOCKMESH_SESSION", guard.session())
            .env("LOCKMESH_TTL_S", guard.ttl().as_secs().to_string())
            .env("LOCKMESH_JEOPARDY_FILE", &self.jeopardy.path)
            .kill_on_drop(true);
        if let Some(proof) = guard.proof() {
            cmd.env("LOCKMESH_PROOF", proof);
        }
        signal_child::term_with_parent(&mut cmd);
        let mut child = cmd.spawn().map_err(|source| RunError::Spawn { program: program.to_owned(), source })?;
        let tell = Tell { file: &self.jeopardy, signal: self.signal, names: self.names };
        supervise(&mut child, &mut self.told, &tell, self.grace).await.map_err(RunError::Wait)
    }
}

/// How the child is told about jeopardy: the file, and the signal if asked for.
struct Tell<'a> {
    file: &'a JeopardyFile,
    signal: Option<i32>,
    names: Names,
}

/// Waits for the child; passes SIGTERM/SIGINT on; tells it about jeopardy; stops
/// it when the lock is lost.
async fn supervise(
    child: &mut Child,
    told: &mut mpsc::UnboundedReceiver<Told>,
    tell: &Tell<'_>,
    grace: Duration,
) -> std::io::Result<ExitStatus> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    loop {
        tokio::select! {
            status = child.wait() => return status,
            t = told.recv() => match t {
                Some(Told::Jeopardy(on)) => tell.jeopardy(child, on),
                Some(Told::Lost(reason)) => {
                    tell.file.set(&format!("lost {reason}"));
                    let Names { cmd, hold } = tell.names;
                    eprintln!("lockctl {cmd}: {hold} lost ({reason}); sending SIGTERM to the command");
                    return stop(child, grace, tell.names).await;
                }
                None => {
                    // The client is gone: the lock cannot be kept.
                    tell.file.set("lost closed");
                    eprintln!("lockctl {}: the lock client stopped; stopping the command", tell.names.cmd);
                    return stop(child, grace, tell.names).await;
                }
            },
            _ = term.recv() => signal_child::send(child, libc::SIGTERM),
            _ = int.recv() => signal_child::send(child, libc::SIGINT),
        }
    }
}

// === impl Tell ===

impl Tell<'_> {
    /// Jeopardy started (`on`) or ended by recovery: the file first, then the
    /// signal, so a handler sees the new state in the file.
    fn jeopardy(&self, child: &Child, on: bool) {
        let Names { cmd, hold } = self.names;
        if on {
            eprintln!("lockctl {cmd}: a keepalive failed: the {hold} is in jeopardy (start no new work)");
            self.file.set("jeopardy");
        } else {
            eprintln!("lockctl {cmd}: a keepalive was acknowledged: jeopardy is over");
            self.file.clear();
        }
        if let Some(sig) = self.signal {
            signal_child::send(child, sig);
        }
    }
}

// === impl JeopardyFile ===

impl JeopardyFile {
    /// The file at `given` (a stale one removed), or `jeopardy` in a new private
    /// directory under the temporary directory.
    fn new(given: Option<PathBuf>) -> Result<Self, RunError> {
        let made = |path: &Path, source| RunError::JeopardyFile { path: path.to_owned(), source };
        match given {
            Some(path) => {
                let f = Self { path, made_dir: None };
                f.remove().map_err(|e| made(&f.path, e))?;
                Ok(f)
            }
            None => {
                use std::os::unix::fs::DirBuilderExt;
                let dir = std::env::temp_dir().join(format!(
                    "lockctl-run-{}-{:016x}",
                    std::process::id(),
                    rand::random::<u64>()
                ));
                // `create`, not `create_all`: a directory that already exists (made by
                // someone else) is refused, so nobody else can own it.
                std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(|e| made(&dir, e))?;
                Ok(Self { path: dir.join("jeopardy"), made_dir: Some(dir) })
            }
        }
    }

    /// Makes the file exist with `content` (written beside it, then renamed: it
    /// appears whole). Failures are reported and otherwise ignored: the lock and
    /// the command carry on, and the signal (if asked for) still goes out.
    fn set(&self, content: &str) {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        let r = std::fs::write(&tmp, format!("{content}\n")).and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = r {
            eprintln!("lockctl run: could not write the jeopardy file {}: {e}", self.path.display());
        }
    }

    /// Removes the file (recovery).
    fn clear(&self) {
        if let Err(e) = self.remove() {
            eprintln!("lockctl run: could not remove the jeopardy file {}: {e}", self.path.display());
        }
    }

    fn remove(&self) -> std::io::Result<()> {
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

impl Drop for JeopardyFile {
    fn drop(&mut self) {
        let _ = self.remove();
        if let Some(dir) = &self.made_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `shared` or `exclusive`, for `--mode`.
pub fn parse_mode(s: &str) -> Result<lockmesh_core::headers::LockMode, String> {
    lockmesh_core::headers::parse_mode(s.as_bytes()).map_err(|e| e.why)
}

/// A signal by name (`USR1`, `SIGUSR1`, `usr1`) or number, for `--jeopardy-signal`.
pub fn parse_signal(s: &str) -> Result<i32, String> {
    const NAMES: [(&str, i32); 9] = [
        ("HUP", libc::SIGHUP),
        ("INT", libc::SIGINT),
        ("QUIT", libc::SIGQUIT),
        ("USR1", libc::SIGUSR1),
        ("USR2", libc::SIGUSR2),
        ("ALRM", libc::SIGALRM),
        ("TERM", libc::SIGTERM),
        ("WINCH", libc::SIGWINCH),
        ("PWR", libc::SIGPWR),
    ];
    if let Ok(n) = s.parse::<i32>() {
        return match n {
            1..=64 if n != libc::SIGKILL && n != libc::SIGSTOP => Ok(n),
            _ => Err(format!("{n}: not a signal number that can be handled (1-64, not KILL or STOP)")),
        };
    }
    let upper = s.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    NAMES.iter().find(|(n, _)| *n == name).map(|(_, v)| *v).ok_or_else(|| {
        let known: Vec<&str> = NAMES.iter().map(|(n, _)| *n).collect();
        format!("{s:?}: unknown signal (one of {}, or a number)", known.join(", "))
    })
}

/// SIGTERM, then SIGKILL after `grace`.
async fn stop(child: &mut Child, grace: Duration, names: Names) -> std::io::Result<ExitStatus> {
    signal_child::send(child, libc::SIGTERM);
    tokio::select! {
        status = child.wait() => status,
        _ = tokio::time::sleep(grace) => {
            eprintln!("lockctl {}: the command is still running after {grace:?}; sending SIGKILL", names.cmd);
            child.start_kill()?;
            child.wait().await
        }
    }
}

/// The child's code, or 128 + the signal that ended it (the shell convention).
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c & 0xff).unwrap_or(1),
        (None, Some(s)) => u8::try_from((128 + s) & 0xff).unwrap_or(1),
        (None, None) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn exit_codes_follow_the_shell_convention() {
        let st = Command::new("sh").args(["-c", "exit 7"]).status().await.unwrap();
        assert_eq!(exit_code(st), 7);
        let mut c = Command::new("sleep").arg("10").spawn().unwrap();
        signal_child::send(&c, libc::SIGTERM);
        assert_eq!(exit_code(c.wait().await.unwrap()), 128 + 15);
    }

    #[tokio::test]
    async fn a_child_that_ignores_sigterm_is_killed_after_the_grace() {
        let mut c = Command::new("sh").args(["-c", "trap '' TERM; sleep 10"]).spawn().unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await; // let the trap be set
        let t = tokio::time::Instant::now();
        let st = stop(&mut c, Duration::from_millis(300), RUN).await.unwrap();
        assert_eq!(exit_code(st), 128 + 9);
        assert!(t.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn jeopardy_signals_by_name_or_number_never_kill_or_stop() {
        for s in ["USR1", "SIGUSR1", "usr1", "10"] {
            assert_eq!(parse_signal(s), Ok(libc::SIGUSR1), "{s}");
        }
        assert_eq!(parse_signal("hup"), Ok(libc::SIGHUP));
        for bad in ["KILL", "9", "19", "0", "65", "-1", "USR3", ""] {
            assert!(parse_signal(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_jeopardy_file_lives_in_a_private_directory_and_goes_with_it() {
        use std::os::unix::fs::PermissionsExt;
        let f = JeopardyFile::new(None).unwrap();
        let dir = f.made_dir.clone().unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(!f.path.exists(), "no jeopardy yet");
        f.set("jeopardy");
        assert_eq!(std::fs::read_to_string(&f.path).unwrap(), "jeopardy\n");
        f.clear();
        assert!(!f.path.exists(), "recovery removes it");
        f.clear();
        f.set("lost deadline");
        drop(f);
        assert!(!dir.exists(), "the private directory is removed at exit");
        // A path the user gives: a stale file is removed at start, the directory kept.
        let user = std::env::temp_dir().join(format!("lockctl-run-test-{}", std::process::id()));
        std::fs::create_dir_all(&user).unwrap();
        let path = user.join("j");
        std::fs::write(&path, "stale").unwrap();
        let f = JeopardyFile::new(Some(path.clone())).unwrap();
        assert!(!path.exists(), "a stale file would say jeopardy from the start");
        f.set("jeopardy");
        drop(f);
        assert!(!path.exists() && user.exists());
        std::fs::remove_dir(&user).unwrap();
    }

    #[test]
    fn errors_map_to_sysexits() {
        assert_eq!(RunError::NoCommand.exit_code(), 64);
        assert_eq!(RunError::Lock(Error::Contended { reason: "key_gated".into() }).exit_code(), 75);
        let nf = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(RunError::Spawn { program: "x".into(), source: nf }.exit_code(), 127);
        assert_eq!(RunError::Lock(Error::OutcomeUnknown).exit_code(), 1);
        assert_eq!(RunError::Campaign(Error::Contended { reason: "key_gated".into() }).exit_code(), 75);
        let lost = RunError::Campaign(Error::SessionLost(LossReason::Deadline));
        assert_eq!((lost.exit_code(), lost.to_string().as_str()), (1, "campaign: session lost (deadline)"));
    }
}
