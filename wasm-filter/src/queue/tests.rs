use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const K: &str = "payments/k";

fn fwd(q: &mut Queues, key: &str, now: u64) -> Option<Promotion> {
    q.promote(key, now, |_| true)
}

#[test]
fn head_only_fifo_with_budget_left() {
    let mut q = Queues::default();
    assert_eq!(q.admit(K, 1, 0, 5000, false, 10), Admission::Forward);
    assert_eq!(q.admit(K, 2, 100, 5000, false, 10), Admission::Queued);
    assert_eq!(q.admit(K, 3, 200, 5000, false, 10), Admission::Queued);
    assert_eq!(q.depth(K), 2);
    assert_eq!(fwd(&mut q, K, 300), None, "head still in flight");
    assert_eq!(q.leave(K, 1), Left::InFlight { queued: false }, "forwarded at admission");
    let Some(Promotion::Forward { waiter, budget_ms }) = fwd(&mut q, K, 1100) else { panic!() };
    assert_eq!((waiter.ctx, budget_ms), (2, 4000));
    assert_eq!(q.in_flight(K), Some(2));
    assert_eq!(fwd(&mut q, K, 1100), None);
    assert_eq!(q.leave(K, 2), Left::InFlight { queued: true }, "promoted from the queue");
    // Another key is independent.
    assert_eq!(q.admit("payments/j", 9, 0, 0, false, 10), Admission::Forward);
}

#[test]
fn try_once_never_overtakes_and_the_bound_holds() {
    let mut q = Queues::default();
    assert_eq!(q.admit(K, 1, 0, 0, false, 1), Admission::Forward);
    assert_eq!(q.admit(K, 2, 0, 0, false, 1), Admission::Contended);
    assert_eq!(q.admit(K, 3, 0, 10, false, 1), Admission::Queued);
    assert_eq!(q.admit(K, 4, 0, 10, false, 1), Admission::QueueFull);
    // An older waiter on another worker holds back a new request, try-once or not.
    assert_eq!(q.admit("a/b", 5, 0, 0, true, 1), Admission::Contended);
    assert_eq!(q.admit("a/b", 6, 0, 9, true, 1), Admission::Queued);
    assert_eq!(q.in_flight("a/b"), None);
    // ...and its waiter goes only when it is first in the backlog.
    assert_eq!(q.promote("a/b", 1, |_| false), None);
    assert!(matches!(q.promote("a/b", 1, |c| c == 6), Some(Promotion::Forward { .. })));
}

#[test]
fn expiry_and_departure_leave_the_queue() {
    let mut q = Queues::default();
    q.admit(K, 1, 0, 0, false, 10);
    q.admit(K, 2, 0, 500, false, 10);
    q.admit(K, 3, 0, 100, false, 10);
    q.admit(K, 4, 0, 9000, false, 10);
    assert_eq!(q.expire(99), vec![]);
    assert_eq!(q.expire(100), vec![(K.to_string(), Waiter { ctx: 3, received_ms: 0, wait_ms: 100 })]);
    assert!(matches!(q.leave(K, 4), Left::Waiting(w) if w.ctx == 4));
    assert_eq!(q.leave(K, 4), Left::Absent);
    assert_eq!(q.keys_with_waiters(), vec![K.to_string()]);
    q.leave(K, 1);
    // The head's slot is free and waiter 2 is past its deadline: answered, not sent.
    assert!(matches!(fwd(&mut q, K, 600), Some(Promotion::Expired(w)) if w.ctx == 2));
    assert_eq!(fwd(&mut q, K, 600), None);
    assert!(q.keys_with_waiters().is_empty());
    assert_eq!(q.admit(K, 5, 600, 0, false, 10), Admission::Forward);
}

#[derive(Debug, Clone)]
enum Op {
    Admit { key: u8, wait: u64 },
    Leave { key: u8, pick: usize },
    Promote { key: u8 },
    Expire,
    Tick(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, prop_oneof![Just(0u64), 1u64..2000]).prop_map(|(key, wait)| Op::Admit { key, wait }),
        2 => (0u8..3, any::<usize>()).prop_map(|(key, pick)| Op::Leave { key, pick }),
        2 => (0u8..3).prop_map(|key| Op::Promote { key }),
        1 => Just(Op::Expire),
        2 => (0u64..700).prop_map(Op::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Model check: one head per key, FIFO promotion, try-once never queued, the bound,
    /// budgets never above the wait, expiry exactly at the deadline.
    #[test]
    fn queue_invariants_hold(ops in proptest::collection::vec(op(), 1..120), max in 1usize..4) {
        let mut q = Queues::default();
        let mut now = 0u64;
        let mut next_ctx = 1u32;
        // Model: per key, contexts in admission order, and which are waiting.
        let mut order: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        let mut waiting: BTreeMap<u32, (String, Waiter)> = BTreeMap::new();
        // Heads that reached the head slot by promotion (they carry a backlog entry).
        let mut promoted: std::collections::BTreeSet<u32> = std::collections::BTreeSet::new();
        for op in ops {
            match op {
                Op::Tick(d) => now += d,
                Op::Admit { key, wait } => {
                    let key = format!("ns/{key}");
                    let ctx = next_ctx;
                    next_ctx += 1;
                    let busy = q.in_flight(&key).is_some() || q.depth(&key) > 0;
                    let depth = q.depth(&key);
                    match q.admit(&key, ctx, now, wait, false, max) {
                        Admission::Forward => prop_assert!(!busy),
                        Admission::Contended => prop_assert!(busy && wait == 0),
                        Admission::QueueFull => prop_assert!(busy && wait > 0 && depth >= max),
                        Admission::Queued => {
                            prop_assert!(busy && wait > 0 && depth < max);
                            order.entry(key.clone()).or_default().push(ctx);
                            waiting.insert(ctx, (key.clone(), Waiter { ctx, received_ms: now, wait_ms: wait }));
                        }
                    }
                }
                Op::Leave { key, pick } => {
                    if next_ctx == 1 {
                        continue;
                    }
                    let key = format!("ns/{key}");
                    let ctx = 1 + (pick % (next_ctx as usize - 1)) as u32;
                    let was_head = q.in_flight(&key) == Some(ctx);
                    let was_waiting = waiting.get(&ctx).is_some_and(|(k, _)| *k == key);
                    match q.leave(&key, ctx) {
                        Left::InFlight { queued } => {
                            prop_assert!(was_head);
                            prop_assert_eq!(queued, promoted.remove(&ctx));
                        }
                        Left::Waiting(w) => {
                            prop_assert!(was_waiting);
                            prop_assert_eq!(waiting.remove(&ctx).map(|x| x.1), Some(w));
                        }
                        Left::Absent => prop_assert!(!was_head && !was_waiting),
                    }
                }
                Op::Promote { key } => {
                    let key = format!("ns/{key}");
                    while let Some(p) = q.promote(&key, now, |_| true) {
                        let w = match p {
                            Promotion::Forward { waiter, budget_ms } => {
                                prop_assert!(budget_ms >= 1 && budget_ms <= waiter.wait_ms);
                                prop_assert_eq!(budget_ms, waiter.deadline_ms() - now);
                                promoted.insert(waiter.ctx);
                                waiter
                            }
                            Promotion::Expired(w) => {
                                prop_assert!(now >= w.deadline_ms());
                                w
                            }
                        };
                        // FIFO: the promoted waiter is the oldest still waiting for the key.
                        let oldest = order[&key].iter().copied().find(|c| waiting.contains_key(c));
                        prop_assert_eq!(oldest, Some(w.ctx));
                        waiting.remove(&w.ctx);
                    }
                }
                Op::Expire => {
                    for (key, w) in q.expire(now) {
                        prop_assert!(w.deadline_ms() <= now);
                        prop_assert_eq!(waiting.remove(&w.ctx).map(|x| x.0), Some(key));
                    }
                    prop_assert!(waiting.values().all(|(_, w)| w.deadline_ms() > now));
                }
            }
            for (key, ctxs) in &order {
                let queued = ctxs.iter().filter(|c| waiting.contains_key(c)).count();
                prop_assert_eq!(q.depth(key), queued);
                prop_assert!(queued <= max);
                if let Some(h) = q.in_flight(key) {
                    prop_assert!(!waiting.contains_key(&h), "head {h} also waiting");
                }
            }
        }
    }
}
