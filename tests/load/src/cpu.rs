//! CPU time and memory of the processes under load, from `/proc` (Linux only;
//! elsewhere every figure is absent).
//!
//! Per process: `utime + stime` from `/proc/<pid>/stat`; the machine: busy and
//! total jiffies from the `cpu` line of `/proc/stat`. Both count in USER_HZ, which
//! Linux fixes at 100 for user space. Memory: `VmRSS` and `VmHWM` (peak RSS) from
//! `/proc/<pid>/status`; the load average from `/proc/loadavg`.

use tokio::time::Instant;

/// Jiffies per second in `/proc` (USER_HZ).
const USER_HZ: f64 = 100.0;

/// The pids whose CPU time is reported.
#[derive(Clone, Copy, Debug, Default)]
pub struct Procs {
    /// The (first) etcd member.
    pub etcd: Option<u32>,
    /// The lock-tier Envoy.
    pub envoy: Option<u32>,
    /// The (first) arbiter.
    pub arbiter: Option<u32>,
}

/// CPU counters at one instant.
#[derive(Clone, Debug)]
pub struct Sample {
    at: Instant,
    procs: Procs,
    ticks: [Option<u64>; 4],
    machine: Option<(u64, u64)>,
}

/// CPU used between two samples.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// Wall time, seconds.
    pub secs: f64,
    /// CPU seconds of etcd, Envoy, the arbiter and this process.
    pub etcd: Option<f64>,
    /// See `etcd`.
    pub envoy: Option<f64>,
    /// See `etcd`.
    pub arbiter: Option<f64>,
    /// See `etcd`.
    pub load: Option<f64>,
    /// CPU seconds of the whole machine (all cores).
    pub machine: Option<f64>,
    /// Cores (`nproc`).
    pub cores: usize,
}

/// Resident memory of one process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// `VmRSS`, KiB.
    pub rss_kib: u64,
    /// `VmHWM`: the highest RSS so far, KiB.
    pub peak_kib: u64,
}

/// Resident memory of `pid` (`"self"` for this process).
pub fn memory(pid: &str) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
    };
    Some(Memory { rss_kib: field("VmRSS:")?, peak_kib: field("VmHWM:")? })
}

/// The 1-, 5- and 15-minute load averages (`uptime`).
pub(crate) fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut v = text.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some([v.next()??, v.next()??, v.next()??])
}

fn proc_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields
    // 14 and 15 of the whole line, 12th and 13th after the name.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line.split_whitespace().skip(1).take(8).filter_map(|x| x.parse().ok()).collect();
    if v.len() < 8 {
        return None;
    }
    let total: u64 = v.iter().sum();
    let idle = v[3] + v[4];
    Some((total - idle, total))
}

/// The pid of a running process whose command line contains `needle` and whose
/// program name ends with `program` (e.g. Envoy by its config path).
pub(crate) fn find_pid(needle: &str, program: &str) -> Option<u32> {
    let entries = std::fs::read_dir("/proc").ok()?;
    entries.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let mut args = cmd.split(|b| *b == 0);
        let argv0 = String::from_utf8_lossy(args.next()?);
        let hit = argv0.ends_with(program) && args.any(|a| String::from_utf8_lossy(a).contains(needle));
        hit.then_some(pid)
    })
}

// === impl Procs ===

impl Procs {
    /// The first etcd member, the (first) lock-tier Envoy and the first arbiter of
    /// a harness stack.
    pub(crate) fn of_stack(st: &lockmesh_tests::Stack) -> Self {
        Self {
            etcd: st.etcd().members().first().and_then(|m| m.pid()),
            arbiter: st.arbiters().first().and_then(|a| a.pid()),
            envoy: find_pid(&st.envoy().config_path().display().to_string(), "envoy"),
        }
    }

    /// Memory of etcd, Envoy, the arbiter and this process, in that order.
    pub fn memory(&self) -> [Option<Memory>; 4] {
        let m = |p: Option<u32>| p.and_then(|p| memory(&p.to_string()));
        [m(self.etcd), m(self.envoy), m(self.arbiter), memory("self")]
    }
}

// === impl Sample ===

impl Sample {
    /// Reads the counters of `procs`, this process and the machine now.
    pub fn take(procs: &Procs) -> Self {
        let t = |p: Option<u32>| p.and_then(|p| proc_ticks(&p.to_string()));
        Self {
            at: Instant::now(),
            procs: *procs,
            ticks: [t(procs.etcd), t(procs.envoy), t(procs.arbiter), proc_ticks("self")],
            machine: machine_ticks(),
        }
    }

    /// CPU used from `earlier` to `self`.
    pub fn since(&self, earlier: &Sample) -> Usage {
        let d = |i: usize| match (self.ticks[i], earlier.ticks[i]) {
            (Some(a), Some(b)) if a >= b => Some((a - b) as f64 / USER_HZ),
            _ => None,
        };
        let machine = match (self.machine, earlier.machine) {
            (Some((a, _)), Some((b, _))) if a >= b => Some((a - b) as f64 / USER_HZ),
            _ => None,
        };
        debug_assert_eq!(self.procs.etcd, earlier.procs.etcd);
        Usage {
            secs: (self.at - earlier.at).as_secs_f64(),
            etcd: d(0),
            envoy: d(1),
            arbiter: d(2),
            load: d(3),
            machine,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

// === impl Usage ===

impl Usage {
    /// Machine CPU not used by the four processes, seconds: whatever else ran.
    pub fn other(&self) -> Option<f64> {
        let ours: f64 = [self.etcd, self.envoy, self.arbiter, self.load].iter().flatten().sum();
        self.machine.map(|m| (m - ours).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_the_machine() {
        let a = Sample::take(&Procs::default());
        let b = Sample::take(&Procs::default());
        let u = b.since(&a);
        if cfg!(target_os = "linux") {
            assert!(u.load.is_some() && u.machine.is_some(), "{u:?}");
            let m = memory("self").expect("own /proc/self/status");
            assert!(m.rss_kib > 0 && m.peak_kib >= m.rss_kib, "{m:?}");
            assert!(load_average().is_some());
            assert_eq!(Procs::default().memory()[0], None);
        }
        assert_eq!(u.etcd, None);
    }
}
