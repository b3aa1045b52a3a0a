//! The console's history: the arbiter's own figures, sampled every
//! `console.history_interval_s` (default 10 s) into a ring of [`CAPACITY`] samples
//! (an hour at the default), in memory only (a restart starts over), and served as
//! [`ConsoleHistory`] by `GET /console/api/history` for the page's plots.
//!
//! A sample reads what the arbiter already counts, and nothing from etcd:
//!
//! - grants and refusals by class: [`Metrics::class_totals`](crate::metrics::Metrics),
//!   the events of `lockmesh_arbiter_acquires_total` (per arbiter), kept per window;
//! - gated waiters by class: `lock::wait::gated`, as `lockmesh_arbiter_gated_waiters`
//!   (per arbiter);
//! - open holds and the oldest hold by class: [`crate::metrics::hold_rows`], the
//!   quota ledgers' figures of `lockmesh_arbiter_open_holds` and
//!   `lockmesh_arbiter_oldest_hold_seconds` (fleet-wide);
//! - the seal checks' count, failures, mean and slowest time per window:
//!   [`crate::metrics::ETCD`], as `lockmesh_arbiter_etcd_check_seconds`.
//!
//! Classes are metric labels (the registry's, or `other`): bounded. Memory: about
//! 50 bytes per class and sample, 360 samples of 20 classes about 400 KB.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::{Arc, LazyLock, Mutex},
    time::Duration,
};

use lockmesh_core::wire::console::{ConsoleHistory, HistoryClass, HistoryEtcd};

use crate::{
    lock::now_ms,
    metrics::{ClassTotals, EtcdChecks, ETCD},
    state::State,
};

/// Samples kept: an hour at the default interval.
pub const CAPACITY: usize = 360;

/// The process's history (one arbiter per process).
static HISTORY: LazyLock<History> = LazyLock::new(History::default);

/// The figures read at one sample: counters since the start, gauges now.
#[derive(Clone, Debug, Default)]
struct Reading {
    classes: BTreeMap<String, ClassReading>,
    etcd: EtcdChecks,
    /// The slowest seal check since the previous reading, µs.
    etcd_max_us: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct ClassReading {
    totals: ClassTotals,
    gated_waiters: u64,
    open_holds: u64,
    oldest_hold_ms: u64,
}

/// One kept sample: per-window counts and the gauges.
#[derive(Clone, Debug, PartialEq)]
struct Point {
    at_ms: u64,
    classes: BTreeMap<String, ClassPoint>,
    etcd: EtcdPoint,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ClassPoint {
    grants: u64,
    refusals: u64,
    gated_waiters: u64,
    open_holds: u64,
    oldest_hold_ms: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct EtcdPoint {
    checks: u64,
    failures: u64,
    mean_us: Option<u64>,
    max_us: Option<u64>,
}

/// The ring and the reading its newest point was made from.
#[derive(Debug, Default)]
pub struct History {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    started_ms: u64,
    interval: Duration,
    points: VecDeque<Point>,
    /// The reading the newest point was made from (the totals answered).
    last: Reading,
    /// With the test fault `console_history_lag`: the reading of the previous sample.
    held: Option<Reading>,
}

/// Starts sampling every `console.history_interval_s`, from now; the task runs
/// until it is aborted.
pub fn start(state: Arc<State>) -> tokio::task::JoinHandle<()> {
    let interval = state.config.console.history_interval;
    HISTORY.begin(now_ms(), interval);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            HISTORY.sample(read(&state), now_ms());
        }
    })
}

/// The history as `GET /console/api/history` answers it: a series set for each
/// class of `registry_classes` and each class a kept sample has.
pub fn answer(registry_classes: impl IntoIterator<Item = String>) -> ConsoleHistory {
    HISTORY.answer(registry_classes, now_ms())
}

/// What the arbiter counts now, by class label.
fn read(state: &State) -> Reading {
    let mut classes: BTreeMap<String, ClassReading> =
        state.registry().classes().iter().map(|c| (c.name.to_string(), ClassReading::default())).collect();
    for (class, totals) in state.metrics.class_totals() {
        classes.entry(class).or_default().totals = totals;
    }
    let rt = state.store.runtime();
    for (labels, g) in crate::lock::wait::gated(&rt.quotas().lock_labels()) {
        classes.entry(labels.class.clone()).or_default().gated_waiters += g.waiters;
    }
    for ((_, class), (holds, age_ms)) in crate::metrics::hold_rows(rt) {
        let c = classes.entry(class).or_default();
        c.open_holds += holds;
        c.oldest_hold_ms = c.oldest_hold_ms.max(age_ms);
    }
    Reading { classes, etcd: ETCD.checks(), etcd_max_us: ETCD.take_max_us() }
}

// === impl Point ===

impl Point {
    /// The sample at `at_ms` of `cur`, its counts over the window since `prev`.
    fn between(prev: &Reading, cur: &Reading, at_ms: u64) -> Self {
        let classes = cur
            .classes
            .iter()
            .map(|(class, c)| {
                let p = prev.classes.get(class).map(|p| p.totals).unwrap_or_default();
                let point = ClassPoint {
                    grants: c.totals.granted.saturating_sub(p.granted),
                    refusals: c.totals.refused.saturating_sub(p.refused),
                    gated_waiters: c.gated_waiters,
                    open_holds: c.open_holds,
                    oldest_hold_ms: c.oldest_hold_ms,
                };
                (class.clone(), point)
            })
            .collect();
        let checks = cur.etcd.checks.saturating_sub(prev.etcd.checks);
        let sum_us = cur.etcd.sum_us.saturating_sub(prev.etcd.sum_us);
        let etcd = EtcdPoint {
            checks,
            failures: cur.etcd.failures.saturating_sub(prev.etcd.failures),
            mean_us: (checks > 0).then(|| sum_us / checks),
            max_us: (checks > 0).then_some(cur.etcd_max_us),
        };
        Self { at_ms, classes, etcd }
    }
}

// === impl History ===

impl History {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts over at `started_ms`, sampling every `interval`.
    fn begin(&self, started_ms: u64, interval: Duration) {
        *self.inner() = Inner { started_ms, interval, ..Inner::default() };
    }

    /// Keeps the sample of `now` taken at `at_ms`, dropping the oldest beyond [`CAPACITY`].
    fn sample(&self, now: Reading, at_ms: u64) {
        let mut s = self.inner();
        let reading = if crate::test_faults::on(crate::test_faults::TestFault::ConsoleHistoryLag) {
            s.held.replace(now).unwrap_or_default() // PLANTED BUG (tests only): the previous sample's reading.
        } else {
            now
        };
        let point = Point::between(&s.last, &reading, at_ms);
        s.last = reading;
        s.points.push_back(point);
        while s.points.len() > CAPACITY {
            s.points.pop_front();
        }
    }

    fn answer(&self, registry_classes: impl IntoIterator<Item = String>, now_ms: u64) -> ConsoleHistory {
        let s = self.inner();
        let mut names: BTreeSet<String> = registry_classes.into_iter().collect();
        names.extend(s.points.iter().flat_map(|p| p.classes.keys().cloned()));
        let series = |name: &str, f: fn(&ClassPoint) -> u64| -> Vec<u64> {
            s.points.iter().map(|p| p.classes.get(name).map_or(0, f)).collect()
        };
        let classes = names
            .iter()
            .map(|name| {
                let totals = s.last.classes.get(name).map(|c| c.totals).unwrap_or_default();
                HistoryClass {
                    class: name.clone(),
                    gated_waiters: series(name, |c| c.gated_waiters),
                    grants: series(name, |c| c.grants),
                    grants_total: totals.granted,
                    oldest_hold_ms: series(name, |c| c.oldest_hold_ms),
                    open_holds: series(name, |c| c.open_holds),
                    refusals: series(name, |c| c.refusals),
                    refusals_total: totals.refused,
                }
            })
            .collect();
        let etcd = HistoryEtcd {
            checks: s.points.iter().map(|p| p.etcd.checks).collect(),
            failures: s.points.iter().map(|p| p.etcd.failures).collect(),
            max_us: s.points.iter().map(|p| p.etcd.max_us).collect(),
            mean_us: s.points.iter().map(|p| p.etcd.mean_us).collect(),
        };
        ConsoleHistory {
            at_ms: s.points.iter().map(|p| p.at_ms).collect(),
            capacity: CAPACITY as u64,
            classes,
            etcd,
            generated_ms: now_ms,
            interval_ms: u64::try_from(s.interval.as_millis()).unwrap_or(u64::MAX),
            started_ms: s.started_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(granted: u64, refused: u64, waiters: u64, checks: u64, sum_us: u64, max_us: u64) -> Reading {
        let c = ClassReading {
            totals: ClassTotals { granted, refused },
            gated_waiters: waiters,
            open_holds: 2,
            oldest_hold_ms: 900,
        };
        Reading {
            classes: BTreeMap::from([("pool".to_owned(), c)]),
            etcd: EtcdChecks { checks, failures: 0, sum_us },
            etcd_max_us: max_us,
        }
    }

    #[test]
    fn a_sample_counts_its_window_and_keeps_the_gauges() {
        let h = History::default();
        h.begin(1_000, Duration::from_secs(10));
        h.sample(reading(3, 1, 0, 10, 10_000, 2_000), 11_000);
        h.sample(reading(7, 1, 2, 20, 30_000, 5_000), 21_000);
        h.sample(reading(7, 1, 0, 20, 30_000, 0), 31_000);
        let a = h.answer(["default".to_owned()], 31_500);
        assert_eq!((a.at_ms.as_slice(), a.started_ms, a.interval_ms), (&[11_000, 21_000, 31_000][..], 1_000, 10_000));
        // A registry class without a sample has zeros; one a sample has is kept.
        let names: Vec<&str> = a.classes.iter().map(|c| c.class.as_str()).collect();
        assert_eq!(names, ["default", "pool"]);
        assert_eq!(a.classes[0].grants, [0, 0, 0]);
        let pool = &a.classes[1];
        assert_eq!((pool.grants.as_slice(), pool.grants_total), (&[3, 4, 0][..], 7));
        assert_eq!((pool.refusals.as_slice(), pool.refusals_total), (&[1, 0, 0][..], 1));
        assert_eq!(pool.gated_waiters, [0, 2, 0]);
        assert_eq!((pool.open_holds[2], pool.oldest_hold_ms[2]), (2, 900));
        // etcd: the window's checks, their mean and the slowest; nothing without a check.
        assert_eq!(a.etcd.checks, [10, 10, 0]);
        assert_eq!(a.etcd.mean_us, [Some(1_000), Some(2_000), None]);
        assert_eq!(a.etcd.max_us, [Some(2_000), Some(5_000), None]);
    }

    #[test]
    fn the_ring_keeps_the_newest_samples() {
        let h = History::default();
        h.begin(0, Duration::from_secs(1));
        for i in 1..=(CAPACITY as u64 + 5) {
            h.sample(reading(i, 0, 0, i, 0, 0), i * 1_000);
        }
        let a = h.answer([], 0);
        assert_eq!(a.at_ms.len(), CAPACITY);
        assert_eq!((a.at_ms[0], *a.at_ms.last().unwrap()), (6_000, (CAPACITY as u64 + 5) * 1_000));
        assert!(a.classes[0].grants.iter().all(|g| *g == 1));
        assert_eq!(a.classes[0].grants_total, CAPACITY as u64 + 5);
    }
}
