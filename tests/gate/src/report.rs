//! Writes a failing history out: the whole history, each violation's smallest
//! failing window (the store events of its revisions, the client operations and
//! faults around its times) and the fault schedule, plus a readable summary.

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::Serialize;

use super::checker::{Verdict, Violation};
use super::history::{ClientOp, EtcdEvent, Fault, History};

/// Client operations and faults within this much of a window are shown with it.
const MARGIN_US: u64 = 1_000_000;

#[derive(Serialize)]
struct Window<'a> {
    violation: &'a Violation,
    /// The cluster of `events` (`coord` unless the run had shards).
    cluster: &'a str,
    events: Vec<&'a EtcdEvent>,
    ops: Vec<&'a ClientOp>,
    faults: Vec<&'a Fault>,
}

#[derive(Serialize)]
struct Report<'a> {
    verdict: String,
    windows: Vec<Window<'a>>,
    schedule: &'a [Fault],
    history_file: String,
}

/// Writes `history.json`, `violation.json` and `violation.txt` under a new
/// directory in `dir`; returns that directory.
pub fn write(dir: &Path, h: &History, v: &Verdict) -> Result<PathBuf> {
    let out = dir.join(format!("gate-failure-{}", super::history::now_us()));
    std::fs::create_dir_all(&out)?;
    let history_file = out.join("history.json");
    std::fs::write(&history_file, serde_json::to_vec(h)?)?;
    let windows: Vec<Window<'_>> = v.violations().iter().map(|x| window(h, x)).collect();
    let report =
        Report { verdict: v.explain(), windows, schedule: &h.faults, history_file: history_file.display().to_string() };
    std::fs::write(out.join("violation.json"), serde_json::to_vec_pretty(&report)?)?;
    let mut text = v.explain();
    text.push_str("\nfault schedule:\n");
    for f in &h.faults {
        text.push_str(&format!("  {} {} ({} ms) {}\n", f.start_us, f.kind, (f.end_us - f.start_us) / 1000, f.detail));
    }
    text.push_str(&format!(
        "\nwindows: {}\nhistory: {}\n",
        out.join("violation.json").display(),
        history_file.display()
    ));
    std::fs::write(out.join("violation.txt"), text)?;
    Ok(out)
}

fn window<'a>(h: &'a History, x: &'a Violation) -> Window<'a> {
    let (r0, r1) = x.revisions;
    let segments = h.store_segments();
    let (cluster, events) = segments
        .get(x.segment)
        .map(|(c, s)| (*c, s.events.iter().filter(|e| r0 > 0 && e.revision >= r0 && e.revision <= r1).collect()))
        .unwrap_or_default();
    let (t0, t1) = x.time_us;
    let near = |a: u64, b: u64| t0 > 0 && b + MARGIN_US >= t0 && a <= t1 + MARGIN_US;
    let ops = h.ops.iter().filter(|o| near(o.call_us, o.ret_us)).collect();
    let faults = h.faults.iter().filter(|f| near(f.start_us, f.end_us)).collect();
    Window { violation: x, cluster, events, ops, faults }
}
