//! Model check of the limit-change protocol (`lockmesh_core::policy`) with
//! stateright: breadth-first over every interleaving of two arbiters granting and
//! releasing on two keys, and two operator processes that lower, raise, verify,
//! activate, resume, cancel and crash between any two steps, with every token
//! (change epoch, target) ever handed out replayed later as a stale request.
//!
//! The arbiters grant the way `extproc/src/lock/mutex.rs` does: a grant commits only
//! if the policy record is the one the arbiter read (the transaction compares its
//! mod revision), the record admits, and the key has fewer holders than its limit
//! (the slot predicate). Each operator step is one transaction on the record.
//!
//! Properties: never a committed state with a key above the authoritative limit;
//! a stale request never changes the record; and (so the check is not vacuous) a
//! lowering does activate and an over-target verification does happen. A variant
//! whose activation skips verification must be caught.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use lockmesh_core::policy::{ChangeNote, ClassPolicy, PolicyError};
use stateright::{Checker, Model, Property};

const KEYS: usize = 2;
const ARBITERS: usize = 2;
const OPERATORS: usize = 2;
const MAX_EPOCH: u64 = 6;

/// One operator process (a `lockctl limit` run, or the reconciler).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Op {
    Idle,
    /// Holds a token from step 1 or a resume; verification not started.
    Drained {
        epoch: u64,
        target: u32,
    },
    /// Step 2, reading key by key (not atomic: releases may happen in between).
    Verifying {
        epoch: u64,
        target: u32,
        next: usize,
        observed: u32,
    },
    /// Step 2 done; step 3 next.
    Verified {
        epoch: u64,
        target: u32,
        observed: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    policy: ClassPolicy,
    open: [u32; KEYS],
    /// Whether each arbiter's cached copy of the record is the current one. A stale
    /// copy's content does not matter: the grant's compare fails on it.
    fresh: [bool; ARBITERS],
    ops: [Op; OPERATORS],
    /// Every (epoch, target) token ever returned, replayable at any time.
    tokens: Vec<(u64, u32)>,
    /// Set if a request with a non-current token changed the record.
    stale_applied: bool,
    /// For the `sometimes` properties.
    lowered: bool,
    over_target_seen: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Grant(usize, usize),
    Refresh(usize),
    Release(usize),
    BeginLower(usize, u32),
    Raise(u32),
    VerifyStep(usize),
    Activate(usize),
    Resume(usize, (u64, u32)),
    Cancel((u64, u32)),
    /// A stale activator: a verification from an earlier change that saw `0`.
    StaleActivate((u64, u32)),
    Crash(usize),
}

struct LimitModel {
    /// The broken variant: activation trusts a verification that never read.
    skip_verification: bool,
}

fn note() -> ChangeNote {
    ChangeNote { actor: "model".into(), reason: String::new(), at_ms: 0, action: String::new() }
}

impl Model for LimitModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let p = ClassPolicy::new("c", "c/1", 3, note()).unwrap();
        vec![State {
            fresh: [true; ARBITERS],
            policy: p,
            open: [0; KEYS],
            ops: [Op::Idle, Op::Idle],
            tokens: Vec::new(),
            stale_applied: false,
            lowered: false,
            over_target_seen: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        for a in 0..ARBITERS {
            for k in 0..KEYS {
                out.push(Action::Grant(a, k));
            }
            out.push(Action::Refresh(a));
        }
        for k in 0..KEYS {
            if s.open[k] > 0 {
                out.push(Action::Release(k));
            }
        }
        let epoch_left = s.policy.change_epoch < MAX_EPOCH;
        for (i, op) in s.ops.iter().enumerate() {
            match op {
                Op::Idle if epoch_left => {
                    for t in 1..s.policy.limit {
                        out.push(Action::BeginLower(i, t));
                    }
                }
                Op::Idle => {}
                Op::Drained { .. } | Op::Verifying { .. } => out.push(Action::VerifyStep(i)),
                Op::Verified { .. } => out.push(Action::Activate(i)),
            }
            if *op != Op::Idle {
                out.push(Action::Crash(i));
            }
            if *op == Op::Idle {
                for &t in &s.tokens {
                    out.push(Action::Resume(i, t));
                }
            }
        }
        if epoch_left && s.policy.limit < 3 {
            out.push(Action::Raise(3));
        }
        for &t in &s.tokens {
            if epoch_left {
                out.push(Action::Cancel(t));
            }
            out.push(Action::StaleActivate(t));
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        let current = |p: &ClassPolicy| p.pending_target.map(|t| (p.change_epoch, t));
        match action {
            Action::Grant(a, k) => {
                // The grant transaction: compare the record, then the slot predicate.
                if !s.fresh[a] || !s.policy.admits() || s.open[k] >= s.policy.limit {
                    return None;
                }
                n.open[k] += 1;
            }
            Action::Refresh(a) => {
                if s.fresh[a] {
                    return None;
                }
                n.fresh[a] = true;
            }
            Action::Release(k) => n.open[k] -= 1,
            Action::BeginLower(i, t) => {
                n.policy = s.policy.begin_lower(t, note()).ok()?;
                let tok = (n.policy.change_epoch, t);
                if !n.tokens.contains(&tok) {
                    n.tokens.push(tok);
                }
                n.ops[i] = Op::Drained { epoch: tok.0, target: t };
            }
            Action::Raise(t) => n.policy = s.policy.raise(t, note()).ok()?,
            Action::VerifyStep(i) => match s.ops[i].clone() {
                Op::Drained { epoch, target } if self.skip_verification => {
                    n.ops[i] = Op::Verified { epoch, target, observed: 0 };
                }
                Op::Drained { epoch, target } => {
                    n.ops[i] = Op::Verifying { epoch, target, next: 0, observed: 0 };
                }
                Op::Verifying { epoch, target, next, observed } => {
                    let observed = observed.max(s.open[next]);
                    n.ops[i] = if next + 1 == KEYS {
                        Op::Verified { epoch, target, observed }
                    } else {
                        Op::Verifying { epoch, target, next: next + 1, observed }
                    };
                }
                _ => return None,
            },
            Action::Activate(i) => {
                let Op::Verified { epoch, target, observed } = s.ops[i].clone() else { return None };
                n.ops[i] = Op::Idle;
                match s.policy.activate(epoch, target, observed, note()) {
                    Ok(p) => {
                        n.policy = p;
                        n.lowered = true;
                    }
                    Err(PolicyError::OverTarget { .. }) => n.over_target_seen = true,
                    Err(_) => {}
                }
            }
            Action::Resume(i, (epoch, target)) => {
                // Validation only (no write); a stale token is refused.
                s.policy.check_pending(epoch, target).ok()?;
                n.ops[i] = Op::Drained { epoch, target };
            }
            Action::Cancel((epoch, target)) => {
                if let Ok(p) = s.policy.cancel(epoch, target, note()) {
                    if current(&s.policy) != Some((epoch, target)) {
                        n.stale_applied = true;
                    }
                    n.policy = p;
                } else {
                    return None;
                }
            }
            Action::StaleActivate((epoch, target)) => {
                if current(&s.policy) == Some((epoch, target)) {
                    // Not stale: a current token activates only through a real
                    // verification (`Activate`).
                    return None;
                }
                if let Ok(p) = s.policy.activate(epoch, target, 0, note()) {
                    n.stale_applied = true;
                    n.policy = p;
                } else {
                    return None;
                }
            }
            Action::Crash(i) => n.ops[i] = Op::Idle,
        }
        if n.policy != s.policy {
            n.fresh = [false; ARBITERS];
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no key above the authoritative limit", |_, s: &State| {
                s.open.iter().all(|&o| o <= s.policy.limit)
            }),
            Property::always("stale requests change nothing", |_, s: &State| !s.stale_applied),
            Property::always("one pending change", |_, s: &State| {
                s.policy.admits() == s.policy.pending_target.is_none()
            }),
            Property::sometimes("a lowering activates", |_, s: &State| s.lowered && s.policy.limit == 1),
            Property::sometimes("verification reports over target", |_, s: &State| s.over_target_seen),
        ]
    }
}

#[test]
fn the_limit_change_protocol_keeps_every_key_within_the_authoritative_limit() {
    let checker = LimitModel { skip_verification: false }.checker().spawn_bfs().join();
    checker.assert_properties();
    let states = checker.unique_state_count();
    assert!(states > 10_000, "the model explored only {states} states");
    println!("policy model: {states} unique states");
}

#[test]
fn an_activation_without_verification_is_caught() {
    let checker = LimitModel { skip_verification: true }
        .checker()
        .finish_when(stateright::HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    assert!(
        checker.discovery("no key above the authoritative limit").is_some(),
        "the broken variant should break the invariant"
    );
}
