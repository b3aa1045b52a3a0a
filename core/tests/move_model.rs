//! Model check of the class-move protocol (`lockctl class apply`, docs/CLASSES.md
//! "Moving prefixes between classes") with stateright: breadth-first over every
//! interleaving of two arbiters granting and releasing on two keys under cached
//! (possibly stale) views of the class map and policy records, and two operator
//! processes that drain, verify, flip the map, cancel and crash between any two
//! steps, repeatedly moving key 0 between a mutex class and a 2-holder class.
//!
//! The arbiters grant the way `extproc/src/lock/mutex.rs` does: the transaction
//! compares the class map's and the key's class record's mod revisions as the
//! arbiter read them, requires the record active, and the slot predicate (fewer
//! holders than the class's limit). The operators' steps are single transactions on
//! the records and the map, as `extproc/src/reconcile/apply.rs` writes them.
//!
//! Properties: every open hold of a key was granted under the class the
//! authoritative map gives the key now (one key is never two locks), and no key has
//! more holders than that class admits; the map does move (not vacuous). Variants
//! that flip without verifying, or without comparing the records as drained (a
//! concurrent run reopened and a grant slipped in), are caught. (A grant that
//! skipped the map compare alone would not be caught: the flip rewrites every
//! record of a moved class, so the record compare already fails a stale view.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use stateright::{Checker, Model, Property};

const KEYS: usize = 2;
const ARBITERS: usize = 2;
const OPERATORS: usize = 2;
/// Class 0: a mutex. Class 1: up to 2 holders.
const LIMIT: [u32; 2] = [1, 2];
/// Bounded history: at most this many map flips and record writes.
const MAX_MAP_REV: u8 = 3;
const MAX_REC_REV: u8 = 5;

/// Key 0 is class 0 under the even maps and class 1 under the odd ones; key 1
/// stays in class 0.
fn class_of(map_rev: u8, key: usize) -> usize {
    usize::from(key == 0 && map_rev % 2 == 1)
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Record {
    rev: u8,
    draining: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Op {
    Idle,
    /// Step 1 in progress: classes drained so far, with the map it started from.
    Draining {
        map: u8,
        done: [Option<u8>; 2],
    },
    /// Step 2: both classes drained at these record revisions; verification next.
    Drained {
        map: u8,
        revs: [u8; 2],
    },
    /// Step 2 passed (no open hold on the moving key when read).
    Verified {
        map: u8,
        revs: [u8; 2],
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    map: u8,
    records: [Record; 2],
    /// Open holds per key and the class each was granted under.
    holds: [[u32; 2]; KEYS],
    /// Each arbiter's cached map revision and record revisions.
    seen: [(u8, [u8; 2]); ARBITERS],
    ops: [Op; OPERATORS],
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Grant(usize, usize),
    Refresh(usize),
    Release(usize, usize),
    DrainStep(usize),
    Verify(usize),
    Flip(usize),
    Cancel(usize),
    Crash(usize),
}

struct MoveModel {
    skip_verification: bool,
    flip_ignores_records: bool,
}

impl Model for MoveModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let r = Record { rev: 0, draining: false };
        vec![State {
            map: 0,
            records: [r.clone(), r],
            holds: [[0; 2]; KEYS],
            seen: [(0, [0, 0]); ARBITERS],
            ops: [Op::Idle, Op::Idle],
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        for a in 0..ARBITERS {
            for k in 0..KEYS {
                out.push(Action::Grant(a, k));
            }
            if s.seen[a] != (s.map, [s.records[0].rev, s.records[1].rev]) {
                out.push(Action::Refresh(a));
            }
        }
        for k in 0..KEYS {
            for c in 0..2 {
                if s.holds[k][c] > 0 {
                    out.push(Action::Release(k, c));
                }
            }
        }
        for (i, op) in s.ops.iter().enumerate() {
            match op {
                Op::Idle if s.map < MAX_MAP_REV => out.push(Action::DrainStep(i)),
                Op::Idle => {}
                Op::Draining { .. } => out.push(Action::DrainStep(i)),
                Op::Drained { .. } => out.push(Action::Verify(i)),
                Op::Verified { .. } => out.push(Action::Flip(i)),
            }
            if *op != Op::Idle {
                out.push(Action::Cancel(i));
                out.push(Action::Crash(i));
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        let revs = |s: &State| [s.records[0].rev, s.records[1].rev];
        match action {
            Action::Grant(a, k) => {
                let (map_seen, rec_seen) = s.seen[a];
                // The arbiter classifies the key by its cached map.
                let c = class_of(map_seen, k);
                let map_ok = map_seen == s.map;
                let total: u32 = s.holds[k].iter().sum();
                if !map_ok || rec_seen[c] != s.records[c].rev || s.records[c].draining || total >= LIMIT[c] {
                    return None;
                }
                n.holds[k][c] += 1;
            }
            Action::Refresh(a) => n.seen[a] = (s.map, revs(s)),
            Action::Release(k, c) => n.holds[k][c] -= 1,
            Action::DrainStep(i) => {
                let (map, mut done) = match &s.ops[i] {
                    Op::Idle => (s.map, [None, None]),
                    Op::Draining { map, done } => (*map, *done),
                    _ => return None,
                };
                // Both classes the move touches (key 0's class under each map),
                // one compare-and-put each, in order.
                let c = usize::from(done[0].is_some());
                if s.records[c].rev >= MAX_REC_REV {
                    return None;
                }
                n.records[c] = Record { rev: s.records[c].rev + 1, draining: true };
                done[c] = Some(n.records[c].rev);
                n.ops[i] = match done {
                    [Some(r0), Some(r1)] => Op::Drained { map, revs: [r0, r1] },
                    _ => Op::Draining { map, done },
                };
            }
            Action::Verify(i) => {
                let Op::Drained { map, revs } = s.ops[i].clone() else { return None };
                // Reads the moving key's holds (any class).
                let held: u32 = s.holds[0].iter().sum();
                if held > 0 && !self.skip_verification {
                    // `held`: the operator stops here (re-run or cancel later).
                    n.ops[i] = Op::Drained { map, revs };
                    if n == *s {
                        return None;
                    }
                } else {
                    n.ops[i] = Op::Verified { map, revs };
                }
            }
            Action::Flip(i) => {
                let Op::Verified { map, revs: drained } = s.ops[i].clone() else { return None };
                n.ops[i] = Op::Idle;
                // One transaction: the map and every record as drained, else nothing.
                let records_ok = self.flip_ignores_records || revs(s) == drained;
                if s.map == map && records_ok && s.records.iter().all(|r| r.rev < MAX_REC_REV) {
                    n.map = s.map + 1;
                    for r in &mut n.records {
                        *r = Record { rev: r.rev + 1, draining: false };
                    }
                }
            }
            Action::Cancel(i) => {
                // Reopens the classes this run drained, under the map it started
                // from; a moved map or a record written since makes it fail.
                let (map, done) = match &s.ops[i] {
                    Op::Draining { map, done } => (*map, *done),
                    Op::Drained { map, revs } | Op::Verified { map, revs } => (*map, [Some(revs[0]), Some(revs[1])]),
                    Op::Idle => return None,
                };
                n.ops[i] = Op::Idle;
                if s.map == map && (0..2).all(|c| done[c].is_none_or(|r| r == s.records[c].rev)) {
                    for (c, drained) in done.iter().enumerate() {
                        if drained.is_some() && s.records[c].rev < MAX_REC_REV {
                            n.records[c] = Record { rev: s.records[c].rev + 1, draining: false };
                        }
                    }
                }
            }
            Action::Crash(i) => n.ops[i] = Op::Idle,
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("one key is one lock: every hold has the key's current class", |_, s: &State| {
                (0..KEYS).all(|k| {
                    let c = class_of(s.map, k);
                    s.holds[k][1 - c] == 0
                })
            }),
            Property::always("no key above its class's limit", |_, s: &State| {
                (0..KEYS).all(|k| s.holds[k].iter().sum::<u32>() <= LIMIT[class_of(s.map, k)])
            }),
            Property::sometimes("the map moves there and back", |_, s: &State| s.map >= 2),
            Property::sometimes("a moved key is held under its new class", |_, s: &State| s.holds[0][1] == 2),
        ]
    }
}

#[test]
fn the_class_move_protocol_never_makes_one_key_two_locks() {
    let checker = MoveModel { skip_verification: false, flip_ignores_records: false }.checker().spawn_bfs().join();
    checker.assert_properties();
    let states = checker.unique_state_count();
    assert!(states > 10_000, "the model explored only {states} states");
    println!("move model: {states} unique states");
}

#[test]
fn a_flip_without_verification_is_caught() {
    let checker = MoveModel { skip_verification: true, flip_ignores_records: false }
        .checker()
        .finish_when(stateright::HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    assert!(checker.discovery("one key is one lock: every hold has the key's current class").is_some());
}

#[test]
fn a_flip_that_does_not_compare_the_drained_records_is_caught() {
    let checker = MoveModel { skip_verification: false, flip_ignores_records: true }
        .checker()
        .finish_when(stateright::HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    assert!(checker.discovery("one key is one lock: every hold has the key's current class").is_some());
}
