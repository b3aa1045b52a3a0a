//! Free loopback ports.
//!
//! A port is found by binding it on 127.0.0.1, checking it is free, and closing
//! the socket again, so a child process can bind it. Ports are taken **below the
//! kernel's ephemeral range** (`net.ipv4.ip_local_port_range`, usually from
//! 32768): the kernel hands ephemeral ports to every outgoing connection and every
//! `:0` bind on the machine, and one of those could otherwise take a port between
//! the moment it is handed out here and the moment the child binds it (seen in
//! CI: an Envoy that could not bind its listener). Below that range only an
//! explicit bind can take it. A process-wide set remembers every port handed
//! out, so two processes of one test binary (which run tests in parallel
//! threads) are never given the same port, even after the first one has exited
//! and its port is free again: a restarted process keeps its ports, and nobody
//! else may take them in the meantime.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::{Mutex, OnceLock};

/// Ports handed out (or bound directly by the harness) in this process.
fn handed_out() -> &'static Mutex<HashSet<u16>> {
    static PORTS: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    PORTS.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Returns a loopback TCP port that is free now, below the ephemeral range,
/// and that no other caller in this process has been given.
///
/// Only a program binding that very port explicitly can take it before the
/// child does. On a machine whose ephemeral range leaves too few ports below it
/// (under 4096), ports come from the kernel's `:0` choice instead.
///
/// # Panics
///
/// When no port can be bound on 127.0.0.1 (the machine is out of ports), which
/// no test can recover from.
pub fn free_port() -> u16 {
    let (low, high) = below_ephemeral();
    for _ in 0..1000 {
        let candidate = if high > low { rand::random_range(low..high) } else { 0 };
        let port = match TcpListener::bind(("127.0.0.1", candidate)).and_then(|l| l.local_addr()) {
            Ok(addr) => addr.port(),
            Err(_) if candidate != 0 => continue, // in use: try another
            Err(e) => panic!("cannot bind 127.0.0.1:0 to find a free port: {e}"),
        };
        if reserve(port) {
            return port;
        }
    }
    panic!("no free loopback port after 1000 attempts")
}

/// The range ports are drawn from: from 10000 (above the usual fixed service
/// ports) to the start of the ephemeral range; empty when that leaves fewer
/// than 4096 ports.
fn below_ephemeral() -> (u16, u16) {
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = 10000;
    if start >= low + 4096 {
        (low, start)
    } else {
        (0, 0)
    }
}

/// Records `port` as handed out; returns `false` if it already was.
///
/// Used for ports the harness binds itself (the test backend binds `:0`
/// directly and keeps the socket), so [`free_port`] never hands them out.
pub fn reserve(port: u16) -> bool {
    handed_out().lock().unwrap_or_else(|poisoned| poisoned.into_inner()).insert(port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_unique_and_remembered() {
        // A port is free when handed out (bound here while held: nothing else
        // may have it), lies below the ephemeral range, goes to one caller
        // only, and stays taken after it is closed. Below the ephemeral range
        // nothing but an explicit bind can take it in between, so each port is
        // the first 50 are bound again after all were handed out: other tests of this
        // binary bind `:0` and open connections in parallel, which took a
        // just-closed port twice in CI when ports came from the kernel's `:0`.
        let held: Vec<TcpListener> = (0..5)
            .map(|_| {
                let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
                assert!(reserve(l.local_addr().unwrap().port()));
                l
            })
            .collect();
        let held_ports: HashSet<u16> = held.iter().map(|l| l.local_addr().unwrap().port()).collect();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let (low, high) = below_ephemeral();
        let rebound: Vec<TcpListener> = if high > low {
            ports.iter().take(50).map(|&p| TcpListener::bind(("127.0.0.1", p)).unwrap()).collect()
        } else {
            Vec::new()
        };
        drop(rebound);
        if high > low {
            assert!(ports.iter().all(|p| (low..high).contains(p)), "a port outside {low}..{high}: {ports:?}");
        }
        let unique: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(unique.len(), ports.len(), "a port was handed out twice");
        assert!(unique.is_disjoint(&held_ports), "a port bound by the harness was handed out");
        assert!(!reserve(ports[0]), "a handed-out port is remembered");
    }
}
