//! The release gate (issue 7, ADR-23): fault-injected histories of the real
//! system, checked for stale writes, over-limit grants, token order, releases
//! that free a successor, and grants or renewals during quorum loss.
//!
//! # Layout
//!
//! - [`harness`]: [`GateCluster`]: 3 etcd members, 2 arbiters behind fault
//!   proxies, 2 Envoys, a store behind fence-proxy, holder processes.
//! - [`faultproxy`]: the userspace TCP fault proxy (cut, delay).
//! - [`holder`]: the client process loop (`lockmesh-gate holder`).
//! - [`polyglot`]: holders through the Python and Go SDKs (`holder --driver`).
//! - [`recorder`]: the etcd watch with previous values (the store's history).
//! - [`history`]: what a run records.
//! - [`schedule`]: fault kinds and their injection.
//! - [`actions`]: operator actions as schedule steps (force release, class apply, limit changes).
//! - [`clock`]: clock steps of holders and arbiters (libfaketime).
//! - [`checker`]: the checks; a timeout fails.
//! - [`report`]: writes a failing history, its smallest window and the schedule.
//! - [`upstream`]: the upstream behind the inbound sidecar of the transparent holders.
//!
//! `docs/GATE.md` documents the modes (quick gate in the test command, long gate
//! `lockmesh-gate long`).

pub mod actions;
pub mod checker;
pub mod clock;
pub mod faultproxy;
pub mod harness;
pub mod history;
pub mod holder;
pub mod polyglot;
pub mod recorder;
pub mod report;
pub mod schedule;
pub mod upstream;

use std::time::Duration;

use anyhow::Result;

pub use checker::{check, Verdict, Violation};
pub use harness::{GateCluster, GateOptions};
pub use history::History;

/// The checker's budget for one history.
pub const CHECK_BUDGET: Duration = Duration::from_secs(60);

/// Finishes `g`'s run and checks its history within [`CHECK_BUDGET`]; on anything
/// but a pass the report is written under the run's directory and printed, and its
/// text is returned with the verdict (the scenarios' one way to end a run).
pub async fn finish_and_check(g: &GateCluster) -> Result<(History, Verdict, Option<String>)> {
    let h = g.finish().await?;
    let v = check(&h, CHECK_BUDGET);
    let text = if v.passed() {
        None
    } else {
        let dir = report::write(g.dir(), &h, &v)?;
        let text = std::fs::read_to_string(dir.join("violation.txt"))?;
        eprintln!("{text}");
        Some(text)
    };
    Ok((h, v, text))
}

/// One fault-injected history on a fresh system: start, load, `schedule`, finish,
/// check. On anything but a pass the history, the failing windows and the schedule
/// are written to `out_dir` (see [`report::write`]) and the path is returned too.
pub async fn run_history(
    opts: GateOptions,
    schedule: &[schedule::FaultKind],
    gap: Duration,
    out_dir: &std::path::Path,
) -> Result<(History, Verdict, Option<std::path::PathBuf>)> {
    let mut g = GateCluster::start(opts).await?;
    g.spawn_workload(3, 3)?;
    schedule::run(&g, schedule, gap).await?;
    let h = g.finish().await?;
    let v = check(&h, CHECK_BUDGET);
    let path = match v.passed() {
        true => None,
        false => {
            let p = report::write(out_dir, &h, &v)?;
            g.keep_logs(&p)?;
            Some(p)
        }
    };
    Ok((h, v, path))
}
