//! `lockctl run KEY -- CMD ARGS...`: runs a command while holding a lock, like
//! `etcdctl lock KEY CMD` and `consul lock PREFIX CMD`.
//!
//! - The child gets `LOCKMESH_KEY`, `LOCKMESH_TOKEN`, `LOCKMESH_EPOCH`,
//!   `LOCKMESH_REVISION`, `LOCKMESH_SESSION` and `LOCKMESH_TTL_S` in its
//!   environment; it should present the token to the resource it writes.
//! - When the lock is lost (the fence deadline passed, the service dropped the
//!   session, or the epoch changed) the child gets SIGTERM, then SIGKILL after the
//!   grace period.
//! - SIGTERM and SIGINT sent to `lockctl` are passed on to the child, and the
//!   child gets SIGTERM if `lockctl` dies (Linux `PR_SET_PDEATHSIG`): its lock
//!   ends with `lockctl`'s session.
//! - The exit code is the child's (128 + the signal number if a signal ended it);
//!   the lock is released when the child ends. Codes of `lockctl` itself: 64 a
//!   usage or configuration error, 75 the lock was not granted within the wait,
//!   126 the command could not be started, 127 it was not found, 1 anything else.

use std::{net::SocketAddr, os::unix::process::ExitStatusExt, path::PathBuf, process::ExitStatus, time::Duration};

use tokio::{
    process::{Child, Command},
    signal::unix::{signal, SignalKind},
    sync::watch,
};

use crate::{Client, Config, Error, LockOptions, LossReason};

mod signal_child;

/// Command-line arguments of `lockctl run`.
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[derive(Clone, Debug)]
pub struct RunArgs {
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
    /// How long to wait for the lock, in ms (0: try once).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub wait_ms: u64,
    /// Refuse unless the key's class is this one.
    #[cfg_attr(feature = "cli", arg(long))]
    pub class: Option<String>,
    /// Time between SIGTERM and SIGKILL when the lock is lost, in ms.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 10_000))]
    pub grace_ms: u64,
    /// Fence margin: the child is signalled at `last acknowledged keepalive send
    /// time + TTL - margin`, in ms.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 1_000))]
    pub margin_ms: u64,
    /// The lock key.
    pub key: String,
    /// The command and its arguments (after `--`).
    #[cfg_attr(feature = "cli", arg(last = true, required = true))]
    pub command: Vec<String>,
}

/// Why `lockctl run` did not run the command to its end.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No command after `--`.
    #[error("command: missing (lockctl run KEY -- CMD ARGS...)")]
    NoCommand,
    /// The lock could not be taken.
    #[error("lock: {0}")]
    Lock(#[from] Error),
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
}

// === impl RunError ===

impl RunError {
    /// The exit code `lockctl` uses for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::NoCommand | RunError::Lock(Error::Config { .. }) => 64,
            RunError::Lock(Error::Contended { .. }) => 75,
            RunError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => 127,
            RunError::Spawn { .. } => 126,
            _ => 1,
        }
    }
}

/// Runs `lockctl run` and returns the process exit code; errors are printed.
pub async fn main(args: RunArgs) -> u8 {
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("lockctl run: {e}");
            e.exit_code()
        }
    }
}

/// Takes the lock, runs the command under it, stops the command if the lock is
/// lost, releases the lock; returns the command's exit code.
pub async fn run(args: RunArgs) -> Result<u8, RunError> {
    let (program, rest) = args.command.split_first().ok_or(RunError::NoCommand)?;
    let mut config = Config::new(&args.endpoint, &args.ca, &args.cert, &args.cert_key);
    config.resolve = args.resolve;
    config.cert_reload = Some(Duration::from_millis(args.cert_reload_ms)).filter(|d| !d.is_zero());
    config.margin = Duration::from_millis(args.margin_ms);
    let (lost_tx, mut lost_rx) = watch::channel(None::<LossReason>);
    let client = Client::new(config, move |fence| {
        lost_tx.send_replace(Some(fence.reason));
    })?;
    let mut opts = LockOptions::default().wait(Duration::from_millis(args.wait_ms));
    opts.class = args.class.clone();
    let guard = client.lock(&args.key, opts).await?;

    let mut cmd = Command::new(program);
    cmd.args(rest)
        .env("LOCKMESH_KEY", guard.key())
        .env("LOCKMESH_TOKEN", guard.token().to_string())
        .env("LOCKMESH_EPOCH", guard.epoch().to_string())
        .env("LOCKMESH_REVISION", guard.revision().to_string())
        .env("LOCKMESH_SESSION", guard.session())
        .env("LOCKMESH_TTL_S", guard.ttl().as_secs().to_string())
        .kill_on_drop(true);
    signal_child::term_with_parent(&mut cmd);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(source) => {
            let _ = guard.release().await;
            client.shutdown().await;
            return Err(RunError::Spawn { program: program.clone(), source });
        }
    };
    let status = supervise(&mut child, &mut lost_rx, Duration::from_millis(args.grace_ms)).await;
    let _ = guard.release().await;
    client.shutdown().await;
    Ok(exit_code(status.map_err(RunError::Wait)?))
}

/// Waits for the child; passes SIGTERM/SIGINT on; stops it when the lock is lost.
async fn supervise(
    child: &mut Child,
    lost: &mut watch::Receiver<Option<LossReason>>,
    grace: Duration,
) -> std::io::Result<ExitStatus> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    loop {
        tokio::select! {
            status = child.wait() => return status,
            changed = lost.changed() => {
                let reason = (*lost.borrow()).unwrap_or(LossReason::Closed);
                if changed.is_err() {
                    // The client is gone: the lock cannot be kept.
                    eprintln!("lockctl run: the lock client stopped; stopping the command");
                } else {
                    eprintln!("lockctl run: lock lost ({reason}); sending SIGTERM to the command");
                }
                return stop(child, grace).await;
            }
            _ = term.recv() => signal_child::send(child, libc::SIGTERM),
            _ = int.recv() => signal_child::send(child, libc::SIGINT),
        }
    }
}

/// SIGTERM, then SIGKILL after `grace`.
async fn stop(child: &mut Child, grace: Duration) -> std::io::Result<ExitStatus> {
    signal_child::send(child, libc::SIGTERM);
    tokio::select! {
        status = child.wait() => status,
        _ = tokio::time::sleep(grace) => {
            eprintln!("lockctl run: the command is still running after {grace:?}; sending SIGKILL");
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
        let st = stop(&mut c, Duration::from_millis(300)).await.unwrap();
        assert_eq!(exit_code(st), 128 + 9);
        assert!(t.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn errors_map_to_sysexits() {
        assert_eq!(RunError::NoCommand.exit_code(), 64);
        assert_eq!(RunError::Lock(Error::Contended { reason: "key_gated".into() }).exit_code(), 75);
        let nf = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(RunError::Spawn { program: "x".into(), source: nf }.exit_code(), 127);
        assert_eq!(RunError::Lock(Error::OutcomeUnknown).exit_code(), 1);
    }
}
