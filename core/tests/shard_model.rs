//! Model check of the shard move protocol (`lockctl shard apply`, docs/SCALE.md)
//! with stateright: breadth-first over every interleaving of two arbiters that
//! route one key by a cached (possibly stale) copy of the coord map, read the
//! granting cluster's home record and epoch record, and commit later (or fail the
//! compare); releases; an operator that runs intent, drain, verify, epochs, flip and
//! resume one transaction at a time and may crash between any two; a concurrent
//! cancel; and the "finish" that repairs what a crash or cancel left.
//!
//! The maps are real `ShardMap`s: version 0 homes the key on shard `a`, version 1
//! adds shard `b` (the key's rendezvous home becomes `b`), version 2 removes `b`
//! again (back to `a`, which then needs an epoch advance above `b`'s).
//!
//! Properties: never two holds of the key on two clusters; every grant's token
//! (epoch, cluster revision) is above every earlier grant's; and, so the check is not
//! vacuous, the key is granted on `b` and both moves complete. Variants whose grants
//! skip the home-record compare, whose operator flips without verifying, or skips
//! the epoch advance must be caught.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use lockmesh_core::shard::ShardMap;
use stateright::{Checker, Model, Property};

const ARBITERS: usize = 2;
const CLUSTERS: usize = 2;
/// The last map version.
const MAX_VERSION: u8 = 2;

/// One cluster's home record (as versions) and its mod revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Record {
    current: u8,
    pending: Option<u8>,
    modrev: u32,
}

/// What an arbiter read before its grant transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Read {
    cluster: usize,
    record_rev: u32,
    admits: bool,
    epoch: u8,
    epoch_rev: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Pc {
    Idle,
    Drain { from: u8, to: u8, next: usize },
    Verify { from: u8, to: u8, next: usize },
    Epochs { from: u8, to: u8 },
    Flip { from: u8, to: u8 },
    Resume { to: u8, next: usize },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    /// The coord map document: current version and pending change.
    coord: (u8, Option<u8>),
    counter: u8,
    records: [Record; CLUSTERS],
    epoch: [u8; CLUSTERS],
    epoch_rev: [u32; CLUSTERS],
    /// Each cluster's revision (every write in it).
    rev: [u32; CLUSTERS],
    /// The key's hold on each cluster: its token (epoch, revision).
    holds: [Option<(u8, u32)>; CLUSTERS],
    /// Each arbiter's routing version and pending read.
    view: [u8; ARBITERS],
    read: [Option<Read>; ARBITERS],
    op: Pc,
    /// The highest token granted so far, and whether a grant went below it.
    top: Option<(u8, u32)>,
    regressed: bool,
    granted_on_b: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Route(usize),
    Read(usize),
    Commit(usize),
    Release(usize),
    OpStep,
    OpCrash,
    Cancel,
    Finish(usize),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Bug {
    None,
    /// Grants do not compare the home record.
    NoFence,
    /// The operator flips without verifying.
    NoVerify,
    /// The operator never advances an epoch.
    NoEpochAdvance,
}

struct MoveModel {
    /// The key's home per map version (0: a, 1: b).
    homes: [usize; 3],
    bug: Bug,
}

impl MoveModel {
    fn new(bug: Bug) -> Self {
        let a = ShardMap::initial("coord", &["a".into()], []);
        let ab = ShardMap::initial("coord", &["a".into(), "b".into()], []);
        // A key whose rendezvous home moves to `b` when `b` is added.
        let key = (0..100).map(|i| format!("ns/k{i}")).find(|k| ab.home("c", k) == Some("b")).unwrap();
        let idx = |m: &ShardMap| usize::from(m.home("c", &key) == Some("b"));
        let homes = [idx(&a), idx(&ab), idx(&a)];
        assert_eq!(homes, [0, 1, 0]);
        Self { homes, bug }
    }

    fn home(&self, v: u8) -> usize {
        self.homes[usize::from(v)]
    }

    fn admits(&self, r: &Record, c: usize) -> bool {
        self.home(r.current) == c && r.pending.is_none_or(|p| self.home(p) == c)
    }
}

fn write(s: &mut State, c: usize) -> u32 {
    s.rev[c] += 1;
    s.rev[c]
}

impl Model for MoveModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        // Both clusters exist with their epochs allocated from the counter (a: 1, b: 2).
        let rec = Record { current: 0, pending: None, modrev: 1 };
        vec![State {
            coord: (0, None),
            counter: 2,
            records: [rec; CLUSTERS],
            epoch: [1, 2],
            epoch_rev: [1, 1],
            rev: [1, 1],
            holds: [None; CLUSTERS],
            view: [0; ARBITERS],
            read: [None; ARBITERS],
            op: Pc::Idle,
            top: None,
            regressed: false,
            granted_on_b: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        for i in 0..ARBITERS {
            if s.view[i] != s.coord.0 {
                out.push(Action::Route(i));
            }
            out.push(if s.read[i].is_some() { Action::Commit(i) } else { Action::Read(i) });
        }
        for c in 0..CLUSTERS {
            if s.holds[c].is_some() {
                out.push(Action::Release(c));
            }
            if s.records[c].pending.is_some() && s.coord.1 != s.records[c].pending {
                out.push(Action::Finish(c));
            }
        }
        if s.op != Pc::Idle || s.coord.0 < MAX_VERSION || s.coord.1.is_some() {
            out.push(Action::OpStep);
        }
        if s.op != Pc::Idle {
            out.push(Action::OpCrash);
        }
        if s.coord.1.is_some() {
            out.push(Action::Cancel);
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Route(i) => n.view[i] = s.coord.0,
            Action::Read(i) => {
                let c = self.home(s.view[i]);
                let r = &s.records[c];
                n.read[i] = Some(Read {
                    cluster: c,
                    record_rev: r.modrev,
                    admits: self.admits(r, c),
                    epoch: s.epoch[c],
                    epoch_rev: s.epoch_rev[c],
                });
            }
            Action::Commit(i) => {
                let r = s.read[i]?;
                n.read[i] = None;
                let c = r.cluster;
                let fenced = self.bug != Bug::NoFence && s.records[c].modrev != r.record_rev;
                // A refusal (moved or moving), or a failed compare: nothing written.
                if !r.admits || fenced || s.epoch_rev[c] != r.epoch_rev || s.holds[c].is_some() {
                    return Some(n);
                }
                let token = (r.epoch, write(&mut n, c));
                if s.top.is_some_and(|t| token <= t) {
                    n.regressed = true;
                }
                n.top = Some(s.top.map_or(token, |t| t.max(token)));
                n.holds[c] = Some(token);
                n.granted_on_b |= c == 1;
            }
            Action::Release(c) => {
                n.holds[c] = None;
                write(&mut n, c);
            }
            Action::OpCrash => n.op = Pc::Idle,
            Action::Cancel => {
                // The coord document first (compare-and-put), then `Finish` reverts.
                n.coord.1 = None;
            }
            Action::Finish(c) => {
                let p = s.records[c].pending?;
                let current = if p == s.coord.0 { p } else { s.records[c].current };
                n.records[c] = Record { current, pending: None, modrev: write(&mut n, c) };
            }
            Action::OpStep => match s.op {
                Pc::Idle => match s.coord {
                    (cur, Some(p)) => n.op = Pc::Drain { from: cur, to: p, next: 0 },
                    (cur, None) if cur < MAX_VERSION => {
                        n.coord.1 = Some(cur + 1);
                        n.op = Pc::Drain { from: cur, to: cur + 1, next: 0 };
                    }
                    _ => return None,
                },
                Pc::Drain { from, to, next } => {
                    let r = s.records[next];
                    if r.current > from || r.pending.is_some_and(|p| p != to) {
                        n.op = Pc::Idle;
                    } else {
                        if r.pending != Some(to) {
                            n.records[next] = Record { current: from, pending: Some(to), modrev: write(&mut n, next) };
                        }
                        n.op = if next + 1 == CLUSTERS {
                            Pc::Verify { from, to, next: 0 }
                        } else {
                            Pc::Drain { from, to, next: next + 1 }
                        };
                    }
                }
                Pc::Verify { from, to, next } => {
                    let leaving = self.home(from) == next && self.home(to) != next;
                    if leaving && s.holds[next].is_some() && self.bug != Bug::NoVerify {
                        return None; // waits (a timeout is a crash)
                    }
                    n.op = if next + 1 == CLUSTERS {
                        Pc::Epochs { from, to }
                    } else {
                        Pc::Verify { from, to, next: next + 1 }
                    };
                }
                Pc::Epochs { from, to } => {
                    let (l, g) = (self.home(from), self.home(to));
                    if l != g && s.epoch[g] <= s.epoch[l] && self.bug != Bug::NoEpochAdvance {
                        n.counter = s.counter.max(s.epoch[g]).max(s.epoch[l]) + 1;
                        n.epoch[g] = n.counter;
                        n.epoch_rev[g] = write(&mut n, g);
                    }
                    n.op = Pc::Flip { from, to };
                }
                Pc::Flip { from, to } => {
                    if s.coord == (from, Some(to)) {
                        n.coord = (to, None);
                        n.op = Pc::Resume { to, next: 0 };
                    } else if s.coord.0 == to {
                        n.op = Pc::Resume { to, next: 0 };
                    } else {
                        n.op = Pc::Idle; // cancelled or replaced
                    }
                }
                Pc::Resume { to, next } => {
                    let r = s.records[next];
                    if !(r.current >= to && r.pending.is_none()) {
                        n.records[next] = Record { current: to, pending: None, modrev: write(&mut n, next) };
                    }
                    n.op = if next + 1 == CLUSTERS { Pc::Idle } else { Pc::Resume { to, next: next + 1 } };
                }
            },
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("never two holders", |_, s: &State| s.holds.iter().flatten().count() <= 1),
            Property::always("tokens only increase", |_, s: &State| !s.regressed),
            Property::sometimes("granted on the new home", |_, s: &State| s.granted_on_b),
            Property::sometimes("both moves complete", |_, s: &State| {
                s.coord == (MAX_VERSION, None)
                    && s.records.iter().all(|r| r.current == MAX_VERSION && r.pending.is_none())
            }),
        ]
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.rev.iter().all(|&r| r < 9)
    }
}

#[test]
fn the_move_protocol_never_yields_two_holders_nor_a_lower_token() {
    let checker = MoveModel::new(Bug::None).checker().spawn_bfs().join();
    checker.assert_properties();
    let states = checker.unique_state_count();
    assert!(states > 10_000, "the model explored only {states} states");
    println!("shard move model: {states} unique states");
}

fn caught(bug: Bug, property: &'static str) {
    let checker = MoveModel::new(bug).checker().finish_when(stateright::HasDiscoveries::AnyFailures).spawn_bfs().join();
    assert!(checker.discovery(property).is_some(), "the broken variant should break {property:?}");
}

#[test]
fn a_grant_that_skips_the_home_record_is_caught() {
    caught(Bug::NoFence, "never two holders");
}

#[test]
fn a_flip_without_verification_is_caught() {
    caught(Bug::NoVerify, "never two holders");
}

#[test]
fn a_move_without_an_epoch_advance_is_caught() {
    caught(Bug::NoEpochAdvance, "tokens only increase");
}
