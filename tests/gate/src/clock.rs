//! Clock steps (libfaketime) for holders and arbiters.
//!
//! A process started with [`FakeClock::env`] runs with
//! `LD_PRELOAD=libfaketime.so.1` and reads its clock offset from its own
//! `FAKETIME_TIMESTAMP_FILE` (re-read at most a second after a change,
//! `FAKETIME_CACHE_DURATION=1`), so the gate steps its clock mid-run without a
//! restart by rewriting that file. Two modes, fixed per process at start:
//!
//! - **wall** (`FAKETIME_DONT_FAKE_MONOTONIC=1`): only `CLOCK_REALTIME` (Rust's
//!   `SystemTime`) steps. This is the step a real machine sees (NTP, an operator's
//!   `date -s`, a VM restored from a snapshot): Linux never steps `CLOCK_MONOTONIC`.
//! - **wall+monotonic**: `CLOCK_MONOTONIC` (std and tokio `Instant`) steps with it,
//!   beyond what a real machine does. In a tokio process a forward step fires the
//!   pending timers at the runtime's next wake-up (timeouts and waits end early); a
//!   backward step delays the timers pending at the step by up to its size (the
//!   process keeps doing I/O but its sleeps and timeouts stall), while timers set
//!   in that window whose deadline falls before the runtime's high-water mark
//!   fire at once.
//!
//! etcd is never preloaded: its leases expire on its own clock, which is what
//! keeps a stepped process from extending a hold. The gate records every
//! operation's times from the real clock ([`super::history::now_us`] bypasses
//! libfaketime), so a stepped holder's history stays on the gate's time line.
//!
//! Library: `LOCKMESH_FAKETIME_LIB` or `<repo>/.tools/faketime/...` (scripts/setup).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context as _, Result};

use lockmesh_tests::paths::{repo_root, tool};

/// How often a preloaded process re-reads its offset, seconds.
pub(crate) const CACHE_S: u64 = 1;

/// The libfaketime shared library (`LOCKMESH_FAKETIME_LIB` or the pinned install).
pub(crate) fn faketime_lib() -> Result<PathBuf> {
    tool(
        "LOCKMESH_FAKETIME_LIB",
        repo_root().join(".tools/faketime/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
        "libfaketime",
    )
}

/// Which clocks of a process step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockMode {
    /// `CLOCK_REALTIME` only (what real clock steps do).
    Wall,
    /// `CLOCK_REALTIME` and `CLOCK_MONOTONIC` (tokio timers too).
    WallAndMonotonic,
}

/// One clock step the schedule injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockStep {
    /// +30 s, then back after the hold.
    Forward30,
    /// −30 s, then back after the hold.
    Backward30,
    /// +1 h, kept for the rest of the run (a large forward jump past every TTL).
    ForwardHour,
}

/// Every step, for random choice.
pub(crate) const STEPS: [ClockStep; 3] = [ClockStep::Forward30, ClockStep::Backward30, ClockStep::ForwardHour];

/// A preloaded process's clock: its offset file and mode.
#[derive(Debug)]
pub struct FakeClock {
    label: String,
    file: PathBuf,
    mode: ClockMode,
    lib: PathBuf,
    /// The kept offset (large jumps accumulate), seconds.
    base_s: Mutex<i64>,
}

// === impl ClockMode ===

impl ClockMode {
    /// The name in fault details.
    pub fn name(self) -> &'static str {
        match self {
            ClockMode::Wall => "wall",
            ClockMode::WallAndMonotonic => "wall+monotonic",
        }
    }
}

// === impl ClockStep ===

impl ClockStep {
    /// The offset it adds, seconds.
    pub fn seconds(self) -> i64 {
        match self {
            ClockStep::Forward30 => 30,
            ClockStep::Backward30 => -30,
            ClockStep::ForwardHour => 3600,
        }
    }

    /// Whether it is kept (not stepped back after the hold).
    pub fn kept(self) -> bool {
        self == ClockStep::ForwardHour
    }
}

// === impl FakeClock ===

impl FakeClock {
    /// A clock at offset 0 whose file lives in `dir`; fails if libfaketime is
    /// not installed.
    pub fn new(dir: &Path, label: &str, mode: ClockMode) -> Result<Self> {
        let lib = faketime_lib()?;
        let file = dir.join(format!("faketime-{label}.rc"));
        let c = Self { label: label.into(), file, mode, lib, base_s: Mutex::new(0) };
        c.write(0)?;
        Ok(c)
    }

    /// The label of the process (`arbiter 0`, `h1`).
    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn mode(&self) -> ClockMode {
        self.mode
    }

    /// The environment that preloads libfaketime with this clock.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            ("LD_PRELOAD".to_owned(), self.lib.display().to_string()),
            ("FAKETIME_TIMESTAMP_FILE".to_owned(), self.file.display().to_string()),
            ("FAKETIME_CACHE_DURATION".to_owned(), CACHE_S.to_string()),
            // File times stay real (log rotation, cert reloads).
            ("NO_FAKE_STAT".to_owned(), "1".to_owned()),
        ];
        if self.mode == ClockMode::Wall {
            env.push(("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()));
        }
        env
    }

    /// Steps the clock by `step` from its kept offset; returns the offset now in force.
    pub fn step(&self, step: ClockStep) -> Result<i64> {
        let mut base = self.base_s.lock().unwrap_or_else(|p| p.into_inner());
        let offset = *base + step.seconds();
        self.write(offset)?;
        if step.kept() {
            *base = offset;
        }
        Ok(offset)
    }

    /// The kept offset, seconds.
    pub(crate) fn step_offset(&self) -> i64 {
        *self.base_s.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Steps back to the kept offset (the end of a step that is not kept).
    pub(crate) fn heal(&self) -> Result<i64> {
        let base = *self.base_s.lock().unwrap_or_else(|p| p.into_inner());
        self.write(base)?;
        Ok(base)
    }

    /// Writes the offset atomically (libfaketime may read the file at any time).
    fn write(&self, offset_s: i64) -> Result<()> {
        let tmp = self.file.with_extension("rc.tmp");
        std::fs::write(&tmp, format!("{offset_s:+}\n")).with_context(|| format!("write {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.file).with_context(|| format!("rename to {}", self.file.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_write_signed_offsets_and_only_the_large_jump_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let c = FakeClock::new(dir.path(), "h0", ClockMode::Wall).unwrap();
        let read = || std::fs::read_to_string(dir.path().join("faketime-h0.rc")).unwrap();
        assert_eq!(read(), "+0\n");
        assert_eq!(c.step(ClockStep::Backward30).unwrap(), -30);
        assert_eq!(read(), "-30\n");
        assert_eq!(c.heal().unwrap(), 0);
        assert_eq!(c.step(ClockStep::ForwardHour).unwrap(), 3600);
        assert_eq!(c.step(ClockStep::Forward30).unwrap(), 3630);
        assert_eq!(c.heal().unwrap(), 3600);
        assert_eq!(read(), "+3600\n");
        assert!(c.env().iter().any(|(k, v)| k == "FAKETIME_DONT_FAKE_MONOTONIC" && v == "1"));
    }
}
