//! Results: one [`WorkloadResult`] per mode × workload, the summary table, the
//! ratios of lockmesh to the two etcd baselines, FIFO and CPU per cycle.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::cpu::Usage;
use super::etcdwork::EtcdWork;
use super::record::{Fairness, GrantRecord, Recorder};
use super::steps::StepWork;
use super::{Mode, Shape, Workload};

/// Latency percentiles (nearest rank), microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Percentiles {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50: u32,
    /// 99th percentile.
    pub p99: u32,
    /// Largest sample.
    pub max: u32,
}

/// What one mode × workload run measured.
#[derive(Clone, Debug)]
pub struct WorkloadResult {
    /// Key mode.
    pub mode: Mode,
    pub workload: Workload,
    /// Keys × clients per key.
    pub shape: Shape,
    /// Cycles whose release answered inside the window.
    pub cycles: u64,
    /// `cycles` per second of the window.
    pub cycles_per_s: f64,
    /// Acquire latency (request sent → grant received), grants inside the window.
    pub acquire: Percentiles,
    /// Release latency, releases inside the window.
    pub release: Percentiles,
    /// Errors by kind (whole run, warmup and drain included).
    pub errors: BTreeMap<String, u64>,
    /// Grants whose token did not strictly increase over the key's previous grant.
    pub out_of_order: u64,
    /// Tokens seen twice across keys (`lockmesh`, `raw-txn`).
    pub duplicates: u64,
    /// FIFO figures, when clients share keys.
    pub fairness: Option<Fairness>,
    /// CPU used during the window.
    pub cpu: Option<Usage>,
    /// What etcd did per cycle during the window (its own counters).
    pub etcd: Option<EtcdWork>,
    /// HTTP version the lock tier answered with (`lockmesh`).
    pub http_version: Option<String>,
    /// Why the workload did not run, if it did not.
    pub failed: Option<String>,
    /// Every grant in grant order per key, when asked for (`keep_grants`).
    pub grants: Vec<GrantRecord>,
    /// The largest `lockmesh_arbiter_oldest_gated_wait_seconds` (over its label
    /// pairs) the arbiter reported in the window, sampled each second; `None`
    /// when the arbiter's metrics were not read (not `--mode zipf`, or no stack).
    pub oldest_gated_s: Option<f64>,
    /// The arbiter's etcd steps per cycle (`crate::steps`); `None` unless the tool
    /// started the stack and the workload goes through the lock tier.
    pub steps: Option<StepWork>,
    seconds: f64,
}

/// Every result of a run.
#[derive(Clone, Debug)]
pub struct Report {
    /// Random id in every key name of the run.
    pub run_id: String,
    /// Measured seconds per workload.
    pub seconds: f64,
    /// Open loop: the cycles per second offered (`LoadOptions::rate`).
    pub rate: Option<f64>,
    /// Results in run order.
    pub results: Vec<WorkloadResult>,
    /// The arbiter was the bench-floor build (extproc/src/floor.rs): its
    /// `lockmesh` rows are that floor.
    pub floor: Option<Floor>,
}

/// The environment variable a bench-floor arbiter needs (extproc/src/floor.rs
/// `ENV`); set, the load tool reports its `lockmesh` rows as the floor.
pub const FLOOR_ENV: &str = "LOCKMESH_BENCH_FLOOR";

/// Which floor a bench-floor arbiter ran (the value of [`FLOOR_ENV`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Floor {
    /// `1`: the mesh floor, no etcd.
    Mesh,
    /// `etcd`: the mesh floor plus an uncontended cycle's etcd requests, made by
    /// the arbiter, without the lock logic around them.
    Etcd,
}

impl Floor {
    /// The floor this process's environment names, if any.
    pub fn from_env() -> Option<Self> {
        match std::env::var(FLOOR_ENV).as_deref() {
            Ok("1") => Some(Self::Mesh),
            Ok("etcd") => Some(Self::Etcd),
            _ => None,
        }
    }
}

/// Nearest-rank percentiles of `v` (sorted here).
pub(crate) fn percentiles(mut v: Vec<u32>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_unstable();
    let rank = |p: f64| {
        let i = (p / 100.0 * v.len() as f64).ceil() as usize;
        v[i.clamp(1, v.len()) - 1]
    };
    Percentiles { n: v.len(), p50: rank(50.0), p99: rank(99.0), max: v[v.len() - 1] }
}

fn ms(us: u32) -> String {
    format!("{:.2}", f64::from(us) / 1000.0)
}

// === impl WorkloadResult ===

impl WorkloadResult {
    pub(crate) fn new(mode: Mode, workload: Workload, shape: Shape) -> Self {
        Self {
            mode,
            workload,
            shape,
            cycles: 0,
            cycles_per_s: 0.0,
            acquire: Percentiles::default(),
            release: Percentiles::default(),
            errors: BTreeMap::new(),
            out_of_order: 0,
            duplicates: 0,
            fairness: None,
            cpu: None,
            etcd: None,
            http_version: None,
            failed: None,
            grants: Vec::new(),
            oldest_gated_s: None,
            steps: None,
            seconds: 0.0,
        }
    }

    pub(crate) fn finish(&mut self, cycles: u64, acq: Vec<u32>, rel: Vec<u32>, rec: &Recorder) {
        self.seconds = self.cpu.map_or(0.0, |c| c.secs);
        self.cycles = cycles;
        self.cycles_per_s = if self.seconds > 0.0 { cycles as f64 / self.seconds } else { 0.0 };
        self.acquire = percentiles(acq);
        self.release = percentiles(rel);
        self.errors = rec.errors();
        self.out_of_order = rec.out_of_order();
        self.duplicates = rec.duplicates();
        self.fairness = (self.shape.per_key > 1).then(|| rec.fairness());
        self.grants = rec.grants();
    }

    /// Token violations of any kind (a safety bug if not zero).
    pub fn token_violations(&self) -> u64 {
        self.out_of_order + self.duplicates
    }

    /// Errors of any kind.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// CPU milliseconds per cycle of etcd, Envoy, the arbiter and the load tool.
    pub(crate) fn cpu_ms_per_cycle(&self) -> [Option<f64>; 4] {
        let Some(c) = self.cpu.filter(|_| self.cycles > 0) else {
            return [None; 4];
        };
        let per = |s: Option<f64>| s.map(|s| s * 1000.0 / self.cycles as f64);
        [per(c.etcd), per(c.envoy), per(c.arbiter), per(c.load)]
    }
}

// === impl Report ===

impl Report {
    /// Token violations over every result.
    pub fn token_violations(&self) -> u64 {
        self.results.iter().map(WorkloadResult::token_violations).sum()
    }

    fn find(&self, mode: Mode, w: Workload) -> Option<&WorkloadResult> {
        self.results.iter().find(|r| r.mode == mode && r.workload == w && r.failed.is_none())
    }

    /// The summary: the table, ratios per mode, FIFO, CPU per cycle, errors.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<12} {:<10} {:>6} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>7} {:>7}",
            "mode",
            "workload",
            "keys",
            "cycles/s",
            "cycles",
            "acq p50",
            "acq p99",
            "acq max",
            "rel p50",
            "rel p99",
            "errors",
            "tokens"
        );
        for r in &self.results {
            if let Some(f) = &r.failed {
                let _ = writeln!(s, "{:<12} {:<10} failed: {f}", r.mode.name(), r.workload.name());
                continue;
            }
            let tokens = match r.token_violations() {
                0 => "ok".to_owned(),
                n => format!("{n} BAD"),
            };
            let _ = writeln!(
                s,
                "{:<12} {:<10} {:>6} {:>9.1} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8} {:>7} {:>7}",
                r.mode.name(),
                r.workload.name(),
                r.shape.to_string(),
                r.cycles_per_s,
                r.cycles,
                ms(r.acquire.p50),
                ms(r.acquire.p99),
                ms(r.acquire.max),
                ms(r.release.p50),
                ms(r.release.p99),
                r.error_count(),
                tokens
            );
        }
        let _ = writeln!(s, "(latencies in ms; keys = keys x clients per key)");
        match self.floor {
            Some(Floor::Mesh) => {
                let _ = writeln!(
                    s,
                    "FLOOR: the arbiter is the bench-floor build: the lockmesh rows are Envoy, the Wasm filter, ext_proc and the arbiter answering without etcd"
                );
            }
            Some(Floor::Etcd) => {
                let _ = writeln!(
                    s,
                    "ETCD FLOOR: the arbiter is the bench-floor build at its etcd level: the lockmesh rows are Envoy, the Wasm filter, ext_proc and the arbiter making lockmesh's etcd requests (grant transaction, raft check where etcd answers it, release or one-transaction hand-off) without the lock logic around them"
                );
            }
            None => {}
        }
        if let Some(r) = self.rate {
            let _ = writeln!(
                s,
                "open loop: {r:.0} cycles/s offered to every workload; one below it was saturated and its cpu line is not at the same rate"
            );
        }
        self.render_ratios(&mut s);
        self.render_fairness(&mut s);
        self.render_cpu(&mut s);
        for r in &self.results {
            for (e, n) in &r.errors {
                let _ = writeln!(s, "error {} {}: {n} x {e}", r.mode.name(), r.workload.name());
            }
        }
        s
    }

    fn render_ratios(&self, s: &mut String) {
        let modes: Vec<Mode> = self.results.iter().map(|r| r.mode).fold(Vec::new(), |mut v, m| {
            if !v.contains(&m) {
                v.push(m);
            }
            v
        });
        for m in modes {
            let Some(lm) = self.find(m, Workload::Lockmesh) else {
                continue;
            };
            let mut parts = Vec::new();
            for base in [Workload::EtcdLock, Workload::RawTxn] {
                if let Some(b) = self.find(m, base).filter(|b| b.cycles_per_s > 0.0) {
                    parts.push(format!("lockmesh/{} {:.2}x cycles/s", base.name(), lm.cycles_per_s / b.cycles_per_s));
                }
            }
            if let Some(b) = self.find(m, Workload::RawTxn).filter(|b| b.acquire.p99 > 0) {
                parts.push(format!(
                    "acquire p99 lockmesh/raw-txn {:.2}x",
                    f64::from(lm.acquire.p99) / f64::from(b.acquire.p99)
                ));
            }
            if let Some(o) = self.find(m, Workload::LockmeshOneShot).filter(|_| lm.cycles_per_s > 0.0) {
                parts.push(format!("lockmesh-oneshot/lockmesh {:.2}x cycles/s", o.cycles_per_s / lm.cycles_per_s));
            }
            if !parts.is_empty() {
                let _ = writeln!(s, "ratios {}: {}", m.name(), parts.join(", "));
            }
        }
        self.render_goals(s);
    }

    /// Issue #8's goals for the modes this run measured, each with its verdict.
    fn render_goals(&self, s: &mut String) {
        match self.floor {
            Some(Floor::Mesh) => return self.render_floor(s),
            Some(Floor::Etcd) => return self.render_etcd_floor(s),
            None => {}
        }
        // At one offered rate every workload that keeps up runs at that rate: a
        // cycles/s ratio says nothing there (only the CPU, keys and latency lines do).
        if self.rate.is_some() {
            self.render_mesh_goals(s);
            self.render_p99_goal(s);
            return;
        }
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        for (mode, floor) in [(Mode::Uncontended, 1.0), (Mode::Hot, 1.0), (Mode::Contended, 1.5)] {
            let (Some(lm), Some(b)) = (self.find(mode, Workload::Lockmesh), self.find(mode, Workload::EtcdLock)) else {
                continue;
            };
            if b.cycles_per_s > 0.0 {
                let r = lm.cycles_per_s / b.cycles_per_s;
                let _ = writeln!(
                    s,
                    "goal {}: cycles/s >= {floor:.1}x etcd-lock: {r:.2}x, {}",
                    mode.name(),
                    verdict(r >= floor)
                );
            }
        }
        for (mode, x) in self.header_only_ratios() {
            let _ = writeln!(
                s,
                "goal {}: header-only cycles/s >= 0.8x with a session: {x:.2}x, {}",
                mode.name(),
                verdict(x >= 0.8)
            );
        }
        self.render_mesh_goals(s);
        self.render_p99_goal(s);
    }

    /// Issue #8's uncontended acquire p99 goal against the raw transaction.
    fn render_p99_goal(&self, s: &mut String) {
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        let uncontended =
            (self.find(Mode::Uncontended, Workload::Lockmesh), self.find(Mode::Uncontended, Workload::RawTxn));
        if let (Some(lm), Some(b)) = uncontended {
            if b.acquire.p99 > 0 {
                let r = f64::from(lm.acquire.p99) / f64::from(b.acquire.p99);
                let _ = writeln!(s, "goal uncontended: acquire p99 <= 1.5x raw-txn: {r:.2}x, {}", verdict(r <= 1.5));
            }
        }
        // The etcd-side floor of an acquire: lockmesh's grant transaction and raft
        // check without the mesh (`raw-txn-design`), against the raw txn.
        if let (Some(d), Some(b)) = (
            self.find(Mode::Uncontended, Workload::RawTxnDesign),
            self.find(Mode::Uncontended, Workload::RawTxn).filter(|b| b.acquire.p99 > 0),
        ) {
            let r = f64::from(d.acquire.p99) / f64::from(b.acquire.p99);
            let _ = writeln!(
                s,
                "floor uncontended: acquire p99 of lockmesh's etcd operations without the mesh (raw-txn-design) <= 1.5x raw-txn ({}): {r:.2}x, {}",
                self.rate_label("closed loop"),
                if r <= 1.5 { "reachable" } else { "NOT reachable on this design" }
            );
        }
    }

    /// How a CPU line was measured: at the offered rate, or `closed`.
    fn rate_label(&self, closed: &str) -> String {
        match self.rate {
            Some(rate) => format!("at {rate:.0} cycles/s offered"),
            None => closed.to_owned(),
        }
    }

    /// A floor run (issue 20): instead of goal lines, where each goal's ratio
    /// stands when the lock logic and etcd cost nothing. A goal the floor itself
    /// misses cannot be met by any change to the lock logic on this design.
    fn render_floor(&self, s: &mut String) {
        let verdict = |reachable: bool| if reachable { "reachable" } else { "NOT reachable on this design" };
        let closed = self.rate.is_none();
        if let (Some(lm), Some(b)) = (
            self.find(Mode::Uncontended, Workload::Lockmesh),
            self.find(Mode::Uncontended, Workload::EtcdLock).filter(|b| b.cycles_per_s > 0.0),
        ) {
            let r = lm.cycles_per_s / b.cycles_per_s;
            if closed {
                let _ = writeln!(
                    s,
                    "floor uncontended: cycles/s floor/etcd-lock {r:.2}x (goal 0.5x): {}",
                    verdict(r >= 0.5)
                );
            }
            let ([_, lv, la, _], [be, _, _, _]) = (lm.cpu_ms_per_cycle(), b.cpu_ms_per_cycle());
            if let (Some(v), Some(a), Some(e)) = (lv, la, be.filter(|e| *e > 0.0)) {
                let r = (v + a) / e;
                let at = self.rate_label("closed loop");
                let _ = writeln!(
                    s,
                    "floor uncontended: (envoy + arbiter) CPU per floor cycle / etcd CPU per etcd-lock cycle ({at}) {r:.2}x (goal 1.5x): {}",
                    verdict(r <= 1.5)
                );
            }
        }
        // A hot key, against the raw txn (which lets clients barge): the floor
        // serialises a key's holders in memory, in arrival order, so its hand-offs
        // cost the mesh path and nothing of etcd; `raw-txn-design` (in the same
        // run) is the etcd-side floor, lockmesh's own operations with the
        // grant-time raft check in each serial hand-off, barging too, so that
        // ratio is the etcd operations' alone.
        let hot = |w| self.find(Mode::Hot, w);
        if let (Some(b), true) = (hot(Workload::RawTxn).filter(|b| b.cycles_per_s > 0.0), closed) {
            let lines = [
                (Workload::Lockmesh, "cycles/s floor/raw-txn", " (goal 0.6x; the raw txn lets clients barge)"),
                (
                    Workload::RawTxnDesign,
                    "cycles/s of lockmesh's etcd operations without the mesh (raw-txn-design) / raw-txn",
                    " (goal 0.6x)",
                ),
            ];
            for (w, what, goal) in lines {
                if let Some(x) = hot(w) {
                    let r = x.cycles_per_s / b.cycles_per_s;
                    let _ = writeln!(s, "floor hot: {what} {r:.2}x{goal}: {}", verdict(r >= 0.6));
                }
            }
        }
        self.render_cpu_budget(s);
        if let (Some(lm), Some(b)) =
            (self.find(Mode::Uncontended, Workload::Lockmesh), self.find(Mode::Uncontended, Workload::RawTxn))
        {
            if b.acquire.p99 > 0 && closed {
                let r = f64::from(lm.acquire.p99) / f64::from(b.acquire.p99);
                let _ = writeln!(
                    s,
                    "floor uncontended: acquire p99 floor/raw-txn {r:.2}x (goal 1.5x): {}",
                    verdict(r <= 1.5)
                );
            }
        }
    }

    /// Each mode's header-only cycles/s (`lockmesh-oneshot`) over `lockmesh`'s.
    fn header_only_ratios(&self) -> impl Iterator<Item = (Mode, f64)> + '_ {
        self.results.iter().filter(|r| r.workload == Workload::LockmeshOneShot).filter_map(|r| {
            let lm = self.find(r.mode, Workload::Lockmesh).filter(|lm| lm.cycles_per_s > 0.0)?;
            Some((r.mode, r.cycles_per_s / lm.cycles_per_s))
        })
    }

    /// An etcd-floor run (issue 20): the goals where they stand when only the
    /// lock logic around the design's etcd requests costs nothing: what no change
    /// to that logic can beat. A hot key's hand-over at this level is lockmesh's
    /// one transaction (and the raft check), in arrival order.
    fn render_etcd_floor(&self, s: &mut String) {
        let verdict = |reachable: bool| if reachable { "reachable" } else { "NOT reachable on this design" };
        if let (Some(lm), Some(b), None) = (
            self.find(Mode::Hot, Workload::Lockmesh),
            self.find(Mode::Hot, Workload::RawTxn).filter(|b| b.cycles_per_s > 0.0),
            self.rate,
        ) {
            let r = lm.cycles_per_s / b.cycles_per_s;
            let _ = writeln!(
                s,
                "floor hot: cycles/s etcd floor/raw-txn {r:.2}x (goal 0.6x; the raw txn lets clients barge): {}",
                verdict(r >= 0.6)
            );
        }
        // The header-only path at this level: a lease per acquire, its record put
        // by the grant, its close marker by the release, its lease revoked.
        for (mode, x) in self.header_only_ratios().filter(|_| self.rate.is_none()) {
            let _ = writeln!(
                s,
                "floor {}: header-only cycles/s of the etcd floor / with a session {x:.2}x (goal 0.8x): {}",
                mode.name(),
                verdict(x >= 0.8)
            );
        }
        let Some(lm) = self.find(Mode::Uncontended, Workload::Lockmesh) else { return };
        if let Some(b) = self.find(Mode::Uncontended, Workload::EtcdLock).filter(|b| b.cycles_per_s > 0.0) {
            if self.rate.is_none() {
                let r = lm.cycles_per_s / b.cycles_per_s;
                let _ = writeln!(
                    s,
                    "floor uncontended: cycles/s etcd floor/etcd-lock {r:.2}x (goal 0.5x): {}",
                    verdict(r >= 0.5)
                );
            }
            let ([le, lv, la, _], [be, _, _, _]) = (lm.cpu_ms_per_cycle(), b.cpu_ms_per_cycle());
            let at = self.rate_label("closed loop");
            if let (Some(v), Some(a), Some(e)) = (lv, la, be.filter(|e| *e > 0.0)) {
                let r = (v + a) / e;
                let _ = writeln!(
                    s,
                    "floor uncontended: (envoy + arbiter) CPU per etcd-floor cycle / etcd CPU per etcd-lock cycle ({at}) {r:.2}x (goal 1.5x): {}",
                    verdict(r <= 1.5)
                );
            }
            if let (Some(l), Some(e)) = (le, be.filter(|e| *e > 0.0)) {
                let r = l / e;
                let _ = writeln!(
                    s,
                    "floor uncontended: etcd CPU per etcd-floor cycle / per etcd-lock cycle ({at}) {r:.2}x (goal 1.0x): {}",
                    verdict(r <= 1.0)
                );
            }
        }
        if let Some(b) = self.find(Mode::Uncontended, Workload::RawTxn).filter(|b| b.acquire.p99 > 0) {
            if self.rate.is_none() {
                let r = f64::from(lm.acquire.p99) / f64::from(b.acquire.p99);
                let _ = writeln!(
                    s,
                    "floor uncontended: acquire p99 etcd floor/raw-txn {r:.2}x (goal 1.5x): {}",
                    verdict(r <= 1.5)
                );
            }
        }
    }

    /// The CPU budget of a floor run (closed loop, every process on the same
    /// cores): a lock cycle through the mesh costs at least the floor's CPU (every
    /// process) plus etcd's work for the cycle's operations, so with every core
    /// busy no lockmesh cycle on this design runs faster than the cores divided by
    /// that. Three lines: with the least etcd work any lock costs (the raw txn's
    /// two proposals); with lockmesh's own operations' (`raw-txn-design`); and
    /// with the etcd-client work those operations add, which the arbiter does and
    /// the floor's arbiter does not, counted only as what the design's client
    /// spends beyond the raw txn's (the load tool's own bookkeeping is the same in
    /// both): a lower bound of that work.
    fn render_cpu_budget(&self, s: &mut String) {
        let verdict = |reachable: bool| if reachable { "reachable" } else { "NOT reachable on this design" };
        let (Some(lm), Some(b), None) = (
            self.find(Mode::Uncontended, Workload::Lockmesh),
            self.find(Mode::Uncontended, Workload::EtcdLock).filter(|b| b.cycles_per_s > 0.0),
            self.rate,
        ) else {
            return;
        };
        let floor: f64 = lm.cpu_ms_per_cycle().iter().map(|x| x.unwrap_or(0.0)).sum();
        let cores = lm.cpu.map_or(0, |c| c.cores);
        if floor <= 0.0 || cores == 0 {
            return;
        }
        let mut line = |ms: f64, what: &str| {
            let most = cores as f64 * 1000.0 / ms;
            let x = most / b.cycles_per_s;
            let _ = writeln!(
                s,
                "floor uncontended: at most {most:.0} cycles/s on {cores} cores busy ({what}): {x:.2}x etcd-lock's (goal 0.5x): {}",
                verdict(x >= 0.5)
            );
        };
        let run = |w| self.find(Mode::Uncontended, w);
        let etcd = |w| run(w).and_then(|r| r.cpu_ms_per_cycle()[0]);
        let client = |w| run(w).and_then(|r| r.cpu_ms_per_cycle()[3]);
        if let Some(e) = etcd(Workload::RawTxn) {
            line(
                floor + e,
                &format!("floor, every process, {floor:.3} ms + raw-txn's etcd {e:.3} ms of CPU per cycle"),
            );
        }
        let Some(e) = etcd(Workload::RawTxnDesign) else { return };
        line(
            floor + e,
            &format!("floor, every process, {floor:.3} ms + raw-txn-design's etcd {e:.3} ms of CPU per cycle"),
        );
        let extra = client(Workload::RawTxnDesign).zip(client(Workload::RawTxn)).map(|(d, r)| d - r);
        if let Some(c) = extra.filter(|c| *c > 0.0) {
            line(
                floor + e + c,
                &format!(
                    "as above + {c:.3} ms of etcd-client CPU that raw-txn-design's client spends beyond raw-txn's"
                ),
            );
        }
    }

    /// Issue #20's uncontended goals, from one run's `cpu` and `etcd` lines:
    /// what the mesh (Envoy and the arbiter) spends per lockmesh cycle against
    /// what etcd spends per etcd-lock cycle, etcd's own CPU and keys written per
    /// cycle, each lockmesh over etcd-lock. With `--rate` both ran at the same
    /// offered rate, which the etcd CPU ratio needs (batching differs with rate).
    fn render_mesh_goals(&self, s: &mut String) {
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        if let (Some(lm), Some(b)) = (
            self.find(Mode::Hot, Workload::Lockmesh),
            self.find(Mode::Hot, Workload::RawTxn).filter(|b| b.cycles_per_s > 0.0),
        ) {
            let r = lm.cycles_per_s / b.cycles_per_s;
            let _ = writeln!(
                s,
                "goal hot: cycles/s >= 0.6x raw-txn (which lets clients barge): {r:.2}x, {}",
                verdict(r >= 0.6)
            );
        }
        let (Some(lm), Some(b)) =
            (self.find(Mode::Uncontended, Workload::Lockmesh), self.find(Mode::Uncontended, Workload::EtcdLock))
        else {
            return;
        };
        if self.rate.is_none() && b.cycles_per_s > 0.0 {
            let r = lm.cycles_per_s / b.cycles_per_s;
            let _ = writeln!(s, "goal uncontended: cycles/s >= 0.5x etcd-lock: {r:.2}x, {}", verdict(r >= 0.5));
        }
        let ([le, lv, la, _], [be, _, _, _]) = (lm.cpu_ms_per_cycle(), b.cpu_ms_per_cycle());
        if let (Some(v), Some(a), Some(e)) = (lv, la, be.filter(|e| *e > 0.0)) {
            let r = (v + a) / e;
            let _ = writeln!(
                s,
                "goal uncontended: (envoy + arbiter) CPU per lockmesh cycle <= 1.5x etcd CPU per etcd-lock cycle: {r:.2}x, {}",
                verdict(r <= 1.5)
            );
        }
        // The etcd-side floor: what etcd spends on lockmesh's own operations per
        // cycle without the mesh (`raw-txn-design`), against etcd-lock.
        if let (Some(d), Some(e)) = (self.find(Mode::Uncontended, Workload::RawTxnDesign), be.filter(|e| *e > 0.0)) {
            if let Some(de) = d.cpu_ms_per_cycle()[0] {
                let r = de / e;
                let at = self.rate_label("closed loop, NOT at one rate");
                let _ = writeln!(
                    s,
                    "floor uncontended: etcd CPU per cycle of lockmesh's etcd operations without the mesh (raw-txn-design) <= 1.0x etcd-lock ({at}): {r:.2}x, {}",
                    if r <= 1.0 { "reachable" } else { "NOT reachable on this design" }
                );
            }
        }
        if let (Some(l), Some(e)) = (le, be.filter(|e| *e > 0.0)) {
            let r = l / e;
            let at = self.rate_label("closed loop, NOT at one rate");
            let _ = writeln!(
                s,
                "goal uncontended: etcd CPU per cycle lockmesh <= 1.0x etcd-lock ({at}): {r:.2}x, {}",
                verdict(r <= 1.0 && self.rate.is_some())
            );
        }
        if let (Some(l), Some(e)) = (&lm.etcd, b.etcd.as_ref().filter(|e| e.puts > 0.0)) {
            let r = l.puts / e.puts;
            let _ = writeln!(
                s,
                "goal uncontended: etcd keys put per cycle lockmesh <= 1.0x etcd-lock: {:.2} vs {:.2} = {r:.2}x, {}",
                l.puts,
                e.puts,
                verdict(r <= 1.0)
            );
        }
    }

    fn render_fairness(&self, s: &mut String) {
        for r in self.results.iter().filter(|r| r.failed.is_none()) {
            let Some(f) = r.fairness else { continue };
            let verdict = if f.max_by_one <= 1 {
                "FIFO kept"
            } else if f.max_by_one == 2 && f.overtaken_waits * 100 <= f.waits {
                "FIFO kept (client-side races only)"
            } else {
                "not FIFO"
            };
            let _ = writeln!(
                s,
                "fifo {} {}: {verdict}: at most {} grants to one client during another's wait, \
                 {} to all others (FIFO bound {}); {} of {} waits overtaken",
                r.mode.name(),
                r.workload.name(),
                f.max_by_one,
                f.max_total,
                r.shape.per_key - 1,
                f.overtaken_waits,
                f.waits
            );
        }
    }

    fn render_cpu(&self, s: &mut String) {
        for r in self.results.iter().filter(|r| r.failed.is_none()) {
            if let Some(g) = r.oldest_gated_s {
                let _ = writeln!(
                    s,
                    "gated {} {}: oldest gated wait at most {g:.3} s (the arbiter's lockmesh_arbiter_oldest_gated_wait_seconds, read each second)",
                    r.mode.name(),
                    r.workload.name()
                );
            }
        }
        for r in self.results.iter().filter(|r| r.failed.is_none()) {
            let Some(c) = r.cpu else { continue };
            let [e, v, a, l] = r.cpu_ms_per_cycle();
            let f = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.3}"));
            let busy =
                |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{:.0}%", 100.0 * x / (c.secs * c.cores as f64)));
            let _ = writeln!(
                s,
                "cpu {} {}: ms/cycle etcd {} envoy {} arbiter {} load {}; machine busy {} \
                 of {} cores, other processes {}",
                r.mode.name(),
                r.workload.name(),
                f(e),
                f(v),
                f(a),
                f(l),
                busy(c.machine),
                c.cores,
                busy(c.other())
            );
        }
        for r in self.results.iter().filter(|r| r.failed.is_none()) {
            if let Some(e) = &r.etcd {
                let _ = writeln!(s, "etcd {} {}: per cycle {}", r.mode.name(), r.workload.name(), e.summary());
            }
        }
        for r in self.results.iter().filter(|r| r.failed.is_none()) {
            if let Some(st) = &r.steps {
                let _ = writeln!(
                    s,
                    "arbiter {} {}: etcd steps per cycle (calls x mean latency) {}",
                    r.mode.name(),
                    r.workload.name(),
                    st.summary()
                );
            }
        }
        if let Some(v) = self.results.iter().find_map(|r| r.http_version.clone()) {
            let _ = writeln!(s, "lock tier answered over {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let p = percentiles((1..=100).rev().collect());
        assert_eq!((p.n, p.p50, p.p99, p.max), (100, 50, 99, 100));
        assert_eq!(percentiles(vec![7]).p99, 7);
        assert_eq!(percentiles(Vec::new()), Percentiles::default());
    }

    fn result(mode: Mode, w: Workload, cycles: u64, etcd_s: f64, mesh_s: f64) -> WorkloadResult {
        result_with_load(mode, w, cycles, etcd_s, mesh_s, 0.0)
    }

    fn result_with_load(mode: Mode, w: Workload, cycles: u64, etcd_s: f64, mesh_s: f64, load_s: f64) -> WorkloadResult {
        let mut r = WorkloadResult::new(mode, w, Shape { keys: 1, per_key: 1, drawn: false });
        r.cpu = Some(Usage {
            secs: 10.0,
            etcd: Some(etcd_s),
            envoy: Some(mesh_s),
            arbiter: Some(mesh_s),
            load: Some(load_s),
            machine: None,
            cores: 2,
        });
        r.cycles = cycles;
        r.cycles_per_s = cycles as f64 / 10.0;
        r
    }

    /// The design floor's lines read `raw-txn-design` from the same run: its hot
    /// cycles against the raw txn's, and the CPU budget with its etcd CPU.
    #[test]
    fn a_floor_run_bounds_the_hot_key_and_the_cpu_budget_by_the_designs_etcd_operations() {
        let report = |design_hot: u64| Report {
            run_id: "t".into(),
            seconds: 10.0,
            rate: None,
            floor: Some(Floor::Mesh),
            results: vec![
                // The floor: 8 000 cycles, 1 ms of CPU each (Envoy + arbiter).
                result(Mode::Uncontended, Workload::Lockmesh, 8000, 0.0, 4.0),
                result(Mode::Uncontended, Workload::EtcdLock, 30000, 10.0, 0.0),
                // The raw txn's client: 0.1 ms per cycle.
                result_with_load(Mode::Uncontended, Workload::RawTxn, 30000, 9.0, 0.0, 3.0),
                // The design's etcd operations: 1.5 ms of etcd CPU and 0.6 ms of
                // client CPU per cycle, 0.5 ms beyond the raw txn's client.
                result_with_load(Mode::Uncontended, Workload::RawTxnDesign, 10000, 15.0, 0.0, 6.0),
                result(Mode::Hot, Workload::Lockmesh, 10000, 0.0, 1.0),
                result(Mode::Hot, Workload::RawTxn, 10000, 5.0, 0.0),
                result(Mode::Hot, Workload::RawTxnDesign, design_hot, 5.0, 0.0),
            ],
        };
        let text = report(4000).render();
        // 2 cores x 1000 / (1.0 + 1.5) = 800 cycles/s, 0.27x etcd-lock's 3 000.
        assert!(
            text.contains(
                "at most 800 cycles/s on 2 cores busy (floor, every process, 1.000 ms + raw-txn-design's etcd 1.500 ms"
            ),
            "{text}"
        );
        assert!(text.contains("0.27x etcd-lock's (goal 0.5x): NOT reachable on this design"), "{text}");
        assert!(text.contains("(raw-txn-design) / raw-txn 0.40x (goal 0.6x): NOT reachable on this design"), "{text}");
        // + 0.5 ms of client CPU: 2 000 / 3.0 = 667 cycles/s, 0.22x.
        assert!(
            text.contains("at most 667 cycles/s on 2 cores busy (as above + 0.500 ms of etcd-client CPU"),
            "{text}"
        );
        assert!(
            text.contains("beyond raw-txn's): 0.22x etcd-lock's (goal 0.5x): NOT reachable on this design"),
            "{text}"
        );
        assert!(
            text.contains(
                "floor hot: cycles/s floor/raw-txn 1.00x (goal 0.6x; the raw txn lets clients barge): reachable"
            ),
            "{text}"
        );
        let text = report(7000).render();
        assert!(text.contains("(raw-txn-design) / raw-txn 0.70x (goal 0.6x): reachable"), "{text}");
        // Without the design's rows (an older run), neither line is printed.
        let mut r = report(4000);
        r.results.retain(|x| x.workload != Workload::RawTxnDesign);
        let text = r.render();
        assert!(!text.contains("raw-txn-design"), "{text}");
    }

    /// An etcd-floor run (the lock logic around the design's etcd requests stubbed
    /// out) bounds the goals, each with its verdict, and prints no `goal` line.
    #[test]
    fn an_etcd_floor_run_bounds_the_uncontended_goals() {
        let mut lm = result(Mode::Uncontended, Workload::Lockmesh, 9000, 9.0, 4.5);
        lm.acquire.p99 = 9000;
        let mut raw = result(Mode::Uncontended, Workload::RawTxn, 20000, 6.0, 0.0);
        raw.acquire.p99 = 4500;
        let report = Report {
            run_id: "t".into(),
            seconds: 10.0,
            rate: None,
            floor: Some(Floor::Etcd),
            results: vec![
                lm,
                // etcd-lock: 20 000 cycles, 0.3 ms of etcd CPU each.
                result(Mode::Uncontended, Workload::EtcdLock, 20000, 6.0, 0.0),
                raw,
                result(Mode::Hot, Workload::Lockmesh, 5000, 5.0, 1.0),
                result(Mode::Hot, Workload::RawTxn, 5000, 5.0, 0.0),
                result(Mode::Hot, Workload::LockmeshOneShot, 2000, 5.0, 1.0),
            ],
        };
        let text = report.render();
        assert!(text.contains("ETCD FLOOR: "), "{text}");
        assert!(!text.lines().any(|l| l.starts_with("goal ")), "{text}");
        assert!(
            text.contains(
                "floor hot: cycles/s etcd floor/raw-txn 1.00x (goal 0.6x; the raw txn lets clients barge): reachable"
            ),
            "{text}"
        );
        // 200 against 500 cycles/s with a session.
        assert!(
            text.contains("floor hot: header-only cycles/s of the etcd floor / with a session 0.40x (goal 0.8x): NOT reachable on this design"),
            "{text}"
        );
        // 900 against 2 000 cycles/s.
        assert!(
            text.contains("cycles/s etcd floor/etcd-lock 0.45x (goal 0.5x): NOT reachable on this design"),
            "{text}"
        );
        // (0.5 + 0.5) ms of mesh CPU per cycle against 0.3 ms of etcd CPU.
        assert!(
            text.contains("(envoy + arbiter) CPU per etcd-floor cycle / etcd CPU per etcd-lock cycle (closed loop) 3.33x (goal 1.5x): NOT reachable"),
            "{text}"
        );
        assert!(
            text.contains("etcd CPU per etcd-floor cycle / per etcd-lock cycle (closed loop) 3.33x (goal 1.0x)"),
            "{text}"
        );
        assert!(
            text.contains("acquire p99 etcd floor/raw-txn 2.00x (goal 1.5x): NOT reachable on this design"),
            "{text}"
        );
        // A faster floor reaches the cycles/s goal.
        let mut fast = report.clone();
        fast.results[0].cycles_per_s = 1200.0;
        assert!(fast.render().contains("cycles/s etcd floor/etcd-lock 0.60x (goal 0.5x): reachable"));
    }
}
