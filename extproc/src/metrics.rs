//! Prometheus metrics. Labels are bounded enums only (route, code); never a key,
//! token, session or identity (ADR-22).

use std::{collections::BTreeMap, fmt::Write, sync::Mutex};

/// The route label of a request path: a closed set.
pub fn route_label(method: &str, path: &str) -> &'static str {
    match (method, path) {
        ("POST", "/v1/locks/acquire") => "acquire",
        ("POST", "/v1/locks/release") => "release",
        ("GET", "/v1/locks") => "inspect",
        ("POST", "/v1/sessions") => "session_open",
        ("POST", "/v1/sessions/keepalive") => "keepalive",
        ("POST", "/v1/sessions/close") => "session_close",
        ("GET", "/v1/sessions/holds") => "session_holds",
        _ => "other",
    }
}

/// Counters.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    abandoned: Mutex<u64>,
}

impl Metrics {
    /// Counts one answered request.
    pub fn request(&self, route: &'static str, code: &'static str) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((route, code)).or_default() += 1;
        }
    }

    /// Counts a grant undone because its caller left.
    pub fn abandoned(&self) {
        if let Ok(mut m) = self.abandoned.lock() {
            *m += 1;
        }
    }

    /// The text exposition.
    pub fn render(&self, waiting_keys: usize, seal: Option<(crate::lock::seal::SealReason, u64)>) -> String {
        let mut s = String::new();
        s.push_str("# HELP lockmesh_arbiter_requests_total API requests answered, by route and result code.\n");
        s.push_str("# TYPE lockmesh_arbiter_requests_total counter\n");
        if let Ok(m) = self.requests.lock() {
            for ((route, code), n) in m.iter() {
                let _ = writeln!(s, "lockmesh_arbiter_requests_total{{route=\"{route}\",code=\"{code}\"}} {n}");
            }
        }
        s.push_str(
            "# HELP lockmesh_arbiter_abandoned_grants_total Grants released at once because the caller had gone.\n",
        );
        s.push_str("# TYPE lockmesh_arbiter_abandoned_grants_total counter\n");
        let _ =
            writeln!(s, "lockmesh_arbiter_abandoned_grants_total {}", self.abandoned.lock().map(|g| *g).unwrap_or(0));
        s.push_str("# HELP lockmesh_arbiter_waiting_keys Keys with at least one waiter queued on this arbiter.\n");
        s.push_str("# TYPE lockmesh_arbiter_waiting_keys gauge\n");
        let _ = writeln!(s, "lockmesh_arbiter_waiting_keys {waiting_keys}");
        s.push_str("# HELP lockmesh_arbiter_sealed 1 while the arbiter is sealed for this reason (restore safety).\n");
        s.push_str("# TYPE lockmesh_arbiter_sealed gauge\n");
        for r in crate::lock::seal::SealReason::ALL {
            let v = u8::from(seal.is_some_and(|(sr, _)| sr == r));
            let _ = writeln!(s, "lockmesh_arbiter_sealed{{reason=\"{}\"}} {v}", r.as_str());
        }
        s.push_str(
            "# HELP lockmesh_arbiter_sealed_since_seconds Unix time the current seal was declared (0 when unsealed).\n",
        );
        s.push_str("# TYPE lockmesh_arbiter_sealed_since_seconds gauge\n");
        let _ = writeln!(s, "lockmesh_arbiter_sealed_since_seconds {}", seal.map_or(0, |(_, ms)| ms / 1000));
        s
    }
}
