//! Transparent requests (docs/TRANSPARENT.md) in the checker: the inbound
//! sidecar forwards a request only under a grant of its key, and the hold lasts
//! until the request leaves the upstream. The upstream records each request's
//! arrival and answer on the real time line ([`UpstreamExec`]); the store's
//! history says how and when each hold ended. A commit happened before the
//! recorder received it, so a delete observed before a request's answer surely
//! committed while the request was still at the upstream.
//!
//! | check | property |
//! |---|---|
//! | `transparent_forwarded_under_grant` | every forwarded request carried a token, and the token is a committed grant of the request's key (no class of the gate fails open, so never token 0) |
//! | `transparent_hold_spans_request` | a hold its release marker ended was not released before its request's answer left the upstream (the filter releases when the request ends, the reconcile only holds no request has open) |
//! | `transparent_renewed` | a hold whose session ended (expired) while its request was at the upstream had a fault in force that can stop its renewal within the 8 s before: its sidecar killed, an arbiter or etcd fault, a partition of the hold's own cluster. Not: a partition of *another* cluster (every cluster's sessions are renewed on their own), a policy change, a holder's fault |
//!
//! Requests reset before their answer (no answer time) are checked for their
//! token only: when their request ended is not known.

use std::collections::HashMap;

use super::{Budget, End, Grant, TimedOut, Violation};
use crate::history::{History, UpstreamExec};

/// How far before a session's end a fault still counts as its cause: the longest
/// class TTL of a run (5 s after a policy change) plus a renewal period and slack.
const RENEWAL_WINDOW_US: u64 = 8_000_000;

/// Fault kinds that cannot stop a transparent hold's renewal.
const NOT_RENEWAL_FAULTS: [&str; 3] = ["policy_change", "holder_pause", "holder_clock_step"];

pub(super) fn check(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    if h.upstream.is_empty() {
        return Ok(());
    }
    let clusters: Vec<&str> = h.clusters().into_iter().map(|(c, _)| c).collect();
    let by_token: HashMap<(&str, u64), &Grant> = grants.iter().map(|g| ((g.key.as_str(), g.token), g)).collect();
    for e in &h.upstream {
        b.tick("transparent")?;
        let Some(g) = e.token.and_then(|t| by_token.get(&(e.key.as_str(), t))) else {
            v.push(Violation {
                check: "transparent_forwarded_under_grant",
                explanation: format!(
                    "a request of {} for {} reached the upstream at {} with {}",
                    e.process,
                    e.key,
                    e.arrived_us,
                    match e.token {
                        None => "no token".to_owned(),
                        Some(t) => format!("token {t}, which is no committed grant of that key"),
                    }
                ),
                segment: 0,
                revisions: (0, 0),
                time_us: (e.arrived_us, e.left_us.unwrap_or(e.arrived_us)),
            });
            continue;
        };
        let (Some(left), Some(closed), Some(end)) = (e.left_us, g.closed_us, g.end) else { continue };
        if closed >= left {
            continue;
        }
        let cluster = clusters.get(g.cluster).copied().unwrap_or("coord");
        match end {
            End::Released => v.push(violation(
                "transparent_hold_spans_request",
                e,
                g,
                closed,
                "was released (its marker) before the request's answer left the upstream: the key was free while the request ran",
            )),
            End::SessionEnded if !renewal_fault(h, cluster, closed) => v.push(violation(
                "transparent_renewed",
                e,
                g,
                closed,
                &format!(
                    "ended with its session while the request was at the upstream, and no fault that can stop its renewal on {cluster} was in force in the {} s before",
                    RENEWAL_WINDOW_US / 1_000_000
                ),
            )),
            _ => {}
        }
    }
    Ok(())
}

fn violation(check: &'static str, e: &UpstreamExec, g: &Grant, closed: u64, what: &str) -> Violation {
    Violation {
        check,
        explanation: format!(
            "the hold of grant {} of {} (revision {}) {what}: the request of {} arrived at {}, the delete was recorded at {closed}, the answer left at {}",
            g.token,
            g.key,
            g.revision,
            e.process,
            e.arrived_us,
            e.left_us.unwrap_or_default()
        ),
        segment: g.segment,
        revisions: (g.revision, g.close.map_or(g.revision, |(_, r)| r)),
        time_us: (e.arrived_us, e.left_us.unwrap_or(closed)),
    }
}

/// Whether a fault that can stop the renewal of a session on `cluster` was in
/// force in the [`RENEWAL_WINDOW_US`] before `at`.
fn renewal_fault(h: &History, cluster: &str, at: u64) -> bool {
    let from = at.saturating_sub(RENEWAL_WINDOW_US);
    h.faults.iter().filter(|f| f.start_us <= at && f.end_us >= from).any(|f| {
        if NOT_RENEWAL_FAULTS.contains(&f.kind.as_str()) {
            return false;
        }
        if f.kind == "cluster_partition" {
            return f.detail.split(' ').next() == Some(cluster);
        }
        true
    })
}
