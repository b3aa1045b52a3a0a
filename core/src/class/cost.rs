//! What a class's TTL costs and buys (ADR-11), printed next to the knob by
//! `lockctl class cost`.
//!
//! - **Keepalive load**: a holder renews its session every `ttl / 3` (the SDK's
//!   and the arbiter's period), so `sessions x 3 / ttl` renewals per second reach
//!   the etcd leader (renewals are leader-served, not raft entries).
//! - **Liveness bound**: how long a dead holder can keep its key. Normally the TTL
//!   from its last acknowledged renewal. etcd refreshes every lease to the full TTL
//!   plus the election timeout on each leader change (`lessor.Promote`), so each
//!   change just before the expiry adds up to `ttl + election timeout`; a mass expiry
//!   then clears at about 750 leases per second (`defaultLeaseRevokeRate` 1000/s).
//! - **Waiter writes**: `memory` fairness queues for free; `durable` costs two
//!   consensus writes per waiter (put and delete of its `/q` key).

use super::{ClassSpec, Enforcement, Fairness};

/// etcd's default election timeout, ms.
pub const DEFAULT_ELECTION_TIMEOUT_MS: u64 = 1000;
/// Leases etcd revokes per second after a mass expiry (measured ~750 of the 1000/s limit).
pub const REVOKE_RATE_PER_S: f64 = 750.0;

/// The assumptions of a cost estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostInput {
    /// Live sessions of the class (from the namespace's current count, or a plan).
    pub sessions: u64,
    /// etcd's election timeout, ms.
    pub election_timeout_ms: u64,
    /// Leader changes to assume during one dead holder's expiry.
    pub leader_changes: u32,
}

/// The estimate for one class.
#[derive(Clone, Debug, PartialEq)]
pub struct Cost {
    /// Renewal period of one session, ms.
    pub renew_period_ms: u64,
    /// Renewals per second reaching the etcd leader.
    pub keepalives_per_s: f64,
    /// How long a dead holder blocks without a leader change, seconds.
    pub liveness_s: f64,
    /// The same with `leader_changes` leader changes, seconds.
    pub liveness_with_changes_s: f64,
    /// Time to revoke every session of the class at once after a failover, seconds.
    pub mass_expiry_s: f64,
    /// Consensus writes per waiter.
    pub writes_per_waiter: u32,
}

/// Estimates the cost of `class` under `input`.
pub fn estimate(class: &ClassSpec, input: &CostInput) -> Cost {
    let ttl_ms = class.ttl_s.saturating_mul(1000);
    let renew_period_ms = (ttl_ms / 3).max(1);
    let per_change = ttl_ms.saturating_add(input.election_timeout_ms) as f64 / 1000.0;
    Cost {
        renew_period_ms,
        keepalives_per_s: input.sessions as f64 * 1000.0 / renew_period_ms as f64,
        liveness_s: class.ttl_s as f64,
        liveness_with_changes_s: class.ttl_s as f64 + f64::from(input.leader_changes) * per_change,
        mass_expiry_s: input.sessions as f64 / REVOKE_RATE_PER_S,
        writes_per_waiter: match class.fairness {
            Fairness::Memory => 0,
            Fairness::Durable => 2,
        },
    }
}

/// One human-readable paragraph per class, for review comments.
pub fn render(class: &ClassSpec, input: &CostInput) -> String {
    let c = estimate(class, input);
    let posture = match &class.enforcement {
        Enforcement::Fenced => "fenced: a false expiry costs a retry".to_owned(),
        Enforcement::Advisory { risk_owner, .. } => {
            format!("advisory (risk owner {risk_owner}): a false expiry can duplicate a write")
        }
    };
    format!(
        "class {name}: ttl {ttl}s, max_holders {n}, {posture}\n  \
         keepalive load: {s} sessions x 1 renewal / {p} ms = {k:.1} renewals/s at the etcd leader\n  \
         liveness bound: a dead holder blocks up to {l:.0}s; {lc} leader change(s) during its expiry: up to \
         {lw:.1}s (each refreshes leases to ttl + {et} ms election timeout)\n  \
         mass expiry: {s} sessions clear in about {me:.1}s after a failover\n  \
         waiters: {w} consensus writes each ({f})\n",
        name = class.name,
        ttl = class.ttl_s,
        n = class.max_holders,
        s = input.sessions,
        p = c.renew_period_ms,
        k = c.keepalives_per_s,
        l = c.liveness_s,
        lc = input.leader_changes,
        lw = c.liveness_with_changes_s,
        et = input.election_timeout_ms,
        me = c.mass_expiry_s,
        w = c.writes_per_waiter,
        f = match class.fairness {
            Fairness::Memory => "memory FIFO",
            Fairness::Durable => "durable",
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::class::{ClassName, Tier};

    #[test]
    fn load_and_liveness_follow_the_ttl() {
        let class = ClassSpec {
            name: ClassName::parse("pay").unwrap(),
            prefixes: vec![],
            tier: Tier::Entity,
            ttl_s: 15,
            enforcement: Enforcement::Fenced,
            max_holders: 1,
            fairness: Fairness::Memory,
            lock_delay_s: 0,
            candidate: None,
            pause_test_result: None,
            on_quorum_loss: crate::class::OnQuorumLoss::Closed,
            purpose: None,
        };
        let input = CostInput { sessions: 3000, election_timeout_ms: 1000, leader_changes: 1 };
        let c = estimate(&class, &input);
        assert_eq!(c.renew_period_ms, 5000);
        assert!((c.keepalives_per_s - 600.0).abs() < 1e-9);
        assert!((c.liveness_with_changes_s - 31.0).abs() < 1e-9);
        assert!((c.mass_expiry_s - 4.0).abs() < 1e-9);
        let short = ClassSpec { ttl_s: 5, ..class };
        assert!((estimate(&short, &input).keepalives_per_s - 3000.0 * 1000.0 / 1666.0).abs() < 1e-6);
        assert!(render(&short, &input).contains("up to 11.0s"));
    }
}
