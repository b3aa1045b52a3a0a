//! The shutdown signal of a service binary.
//!
//! One merged behaviour for every binary (they had four copies): SIGINT (Ctrl-C)
//! and SIGTERM (what Kubernetes and systemd send) both start a graceful stop. A
//! handler that cannot be installed is logged at `warn` and only that signal is
//! lost, never the other; an error never resolves the future, so it cannot stop a
//! healthy service by itself. A second signal is not handled here: the binary's
//! graceful drain decides how long it takes.

use std::future::pending;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// The installed handlers; a `None` handler could not be installed.
struct Signals {
    interrupt: Option<Signal>,
    terminate: Option<Signal>,
}

/// Resolves on the first SIGINT or SIGTERM the process receives, after logging
/// `shutting down: finishing requests in flight` at `info` with the signal's name.
///
/// Must be polled inside a tokio runtime (as `run(..., shutdown())` does); the
/// handlers are installed when it is first polled, and until then a signal has its
/// default action (the process ends). If neither handler can be installed it logs
/// at `error` and never resolves (stop the process with SIGKILL).
pub async fn shutdown() {
    let signal = Signals::install().received().await;
    tracing::info!(signal, "shutting down: finishing requests in flight");
}

// === impl Signals ===

impl Signals {
    /// Installs both handlers; needs a tokio runtime.
    fn install() -> Self {
        let install = |kind: SignalKind, name: &str| match signal(kind) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(signal = name, error = %e, "cannot install the signal handler; that signal will not stop the service gracefully");
                None
            }
        };
        let signals = Self {
            interrupt: install(SignalKind::interrupt(), "SIGINT"),
            terminate: install(SignalKind::terminate(), "SIGTERM"),
        };
        if signals.interrupt.is_none() && signals.terminate.is_none() {
            tracing::error!("no shutdown signal handler installed: only SIGKILL stops this process");
        }
        signals
    }

    /// The name of the first signal received.
    async fn received(mut self) -> &'static str {
        tokio::select! {
            () = wait(self.interrupt.as_mut()) => "SIGINT",
            () = wait(self.terminate.as_mut()) => "SIGTERM",
        }
    }
}

/// Resolves when `s` receives its signal; never for a missing handler or once the
/// runtime's signal driver is gone.
async fn wait(s: Option<&mut Signal>) {
    if let Some(s) = s {
        if s.recv().await.is_some() {
            return;
        }
    }
    pending().await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn raise(sig: &str) {
        let pid = std::process::id().to_string();
        let status = std::process::Command::new("kill").args(["-s", sig, &pid]).status().unwrap();
        assert!(status.success(), "kill -s {sig} failed");
    }

    // One test for both signals: handlers of the same process see every signal, so
    // two tests running at once would see each other's.
    #[tokio::test]
    async fn sigint_and_sigterm_each_resolve_it_and_are_named() {
        for (sig, name) in [("TERM", "SIGTERM"), ("INT", "SIGINT")] {
            let signals = Signals::install();
            assert!(signals.interrupt.is_some() && signals.terminate.is_some());
            let waiting = tokio::spawn(signals.received());
            raise(sig);
            let got = tokio::time::timeout(Duration::from_secs(10), waiting).await.unwrap().unwrap();
            assert_eq!(got, name);
        }
        // The public future resolves the same way (its handlers are installed on its
        // first poll, so keep re-raising until it has seen one).
        let stop = tokio::spawn(shutdown());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !stop.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "shutdown() did not resolve on SIGTERM");
            raise("TERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.await.unwrap();
    }

    #[tokio::test]
    async fn a_missing_handler_never_resolves() {
        let none = Signals { interrupt: None, terminate: None };
        assert!(tokio::time::timeout(Duration::from_millis(50), none.received()).await.is_err());
    }
}
