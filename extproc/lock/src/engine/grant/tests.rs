//! The builder sends what the grant paths sent before it: a grant of one key
//! the same bytes as `try_grant` assembled inline, a grant of several keys the
//! same compares, writes and reads as `try_grant_all` did (in the one order of
//! the builder), over every combination of the concerns.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use lockmesh_core::{headers::SessionId, KeyDigest, LockKey};

use super::*;

const POLICY: (&str, i64) = ("/t/c/pay", 11);
const MAP: (&str, i64) = ("/t/sys/classmap", 12);
const HOME: (&str, i64) = ("/t/sys/home", 13);
const AD: (&str, i64) = ("/t/sys/arbiters/a", 77);

fn digest(k: &str) -> KeyDigest {
    LockKey::parse(k.as_bytes()).unwrap().digest()
}

fn sid() -> SessionId {
    SessionId::from_lease(0x1234_5678).unwrap()
}

/// Each combination of the counts in `radix`, as a list of digits.
fn combinations(radix: &[usize]) -> impl Iterator<Item = Vec<usize>> + '_ {
    let total: usize = radix.iter().product();
    (0..total).map(move |mut i| {
        radix
            .iter()
            .map(|r| {
                let d = i % r;
                i /= r;
                d
            })
            .collect()
    })
}

fn exclusion(k: &Keys, d: &KeyDigest, how: usize) -> ExclusionOps {
    let key = k.exclusion(d);
    let lease = PutOptions::new().with_lease(sid().lease());
    match how {
        0 => ExclusionOps { compare: None, put: None, read: None },
        1 => ExclusionOps {
            compare: Some(Compare::create_revision(key.as_str(), CompareOp::Equal, 0)),
            put: None,
            read: Some(key),
        },
        _ => ExclusionOps {
            compare: Some(Compare::create_revision(key.as_str(), CompareOp::Equal, 0)),
            put: Some(TxnOp::put(key.as_str(), Vec::<u8>::new(), Some(lease))),
            read: Some(key),
        },
    }
}

fn delay_ops(k: &Keys, d: &KeyDigest) -> DelayOps {
    let (g, r) = (k.delay_guard(d), k.lock_delay(d));
    DelayOps {
        compares: vec![
            Compare::create_revision(g.as_str(), CompareOp::Equal, 0),
            Compare::create_revision(r.as_str(), CompareOp::Equal, 0),
        ],
        put: TxnOp::put(g.as_str(), b"guard".to_vec(), None),
        reads: [g, r],
    }
}

fn legacy_exclusion(e: ExclusionOps) -> (Option<Compare>, Option<TxnOp>, Option<TxnOp>, bool) {
    let read = e.read.map(|key| TxnOp::get(key, Some(GetOptions::new().with_keys_only())));
    let reads = read.is_some();
    (e.compare, e.put, read, reads)
}

fn legacy_delay(o: DelayOps) -> (Vec<Compare>, TxnOp, [TxnOp; 2]) {
    let [g, r] = o.reads;
    (o.compares, o.put, [TxnOp::get(g, None), TxnOp::get(r, None)])
}

fn gate_compares() -> Vec<Compare> {
    vec![
        Compare::mod_revision(POLICY.0, CompareOp::Equal, POLICY.1),
        Compare::mod_revision(MAP.0, CompareOp::Equal, MAP.1),
        Compare::mod_revision(HOME.0, CompareOp::Equal, HOME.1),
    ]
}

fn gate_reads() -> Vec<TxnOp> {
    vec![TxnOp::get(POLICY.0, None), TxnOp::get(MAP.0, None), TxnOp::get(HOME.0, None)]
}

/// The single-key grant as `try_grant` built it inline (its order of pushes).
#[allow(clippy::too_many_arguments)]
fn legacy_single(
    k: &Keys,
    d: &KeyDigest,
    opened: Option<Vec<u8>>,
    skip_epoch: bool,
    count_first: bool,
    n: u32,
    slot_nos: &[u32],
    planted_slots: &[String],
    attempt: Option<&str>,
    hold: Vec<u8>,
    excl: ExclusionOps,
    indexed: bool,
    delay: Option<DelayOps>,
    fair: Fair<'_>,
    clock: Option<i64>,
    count_after: bool,
    ad: Option<&(String, i64)>,
) -> Txn {
    let sid = sid();
    let (epoch_key, holds, sess_key) = (k.epoch(), k.holds(d), k.session(sid));
    let mut slots: Vec<String> = slot_nos.iter().map(|s| k.slot(d, *s)).collect();
    let lease = PutOptions::new().with_lease(sid.lease());
    let mut when = vec![Compare::mod_revision(epoch_key.as_str(), CompareOp::Equal, 5)];
    for (no, name) in slot_nos.iter().zip(&slots) {
        when.push(Compare::create_revision(name.as_str(), CompareOp::Equal, 0).with_range(k.slot(d, no + 1)));
    }
    when.push(Compare::create_revision(k.slot(d, n), CompareOp::Equal, 0).with_range(keys::prefix_end(&holds)));
    if skip_epoch {
        when.remove(0);
    }
    if count_first {
        when.truncate(1);
        slots = planted_slots.to_vec();
    }
    let mut then = Vec::new();
    let mut els = Vec::new();
    match opened {
        Some(v) => {
            then.push(TxnOp::put(sess_key.as_str(), v.clone(), Some(lease.clone())));
            els.push(TxnOp::put(sess_key.as_str(), v, Some(lease.clone())));
        }
        None => when.push(Compare::lease(sess_key.as_str(), CompareOp::Equal, sid.lease())),
    }
    if let Some(a) = attempt {
        when.push(Compare::create_revision(k.attempt(sid, a), CompareOp::Equal, 0));
    }
    for name in &slots {
        then.push(TxnOp::put(name.as_str(), hold.clone(), Some(lease.clone())));
    }
    let (compare, put, read, _) = legacy_exclusion(excl);
    when.extend(compare);
    then.extend(put);
    if indexed {
        then.push(TxnOp::put(k.hold_index(sid, d), Vec::<u8>::new(), Some(lease.clone())));
    }
    let delay_reads = delay.map(|o| {
        let (cmp, put, reads) = legacy_delay(o);
        when.extend(cmp);
        then.push(put);
        reads
    });
    when.extend(fair.compares(k, d));
    then.extend(fair.ops());
    els.push(TxnOp::get(holds.as_str(), Some(GetOptions::new().with_prefix())));
    els.push(TxnOp::get(sess_key.as_str(), None));
    els.push(TxnOp::get(epoch_key.as_str(), None));
    if let Some(c) = clock {
        when.push(Compare::mod_revision(k.clock(), CompareOp::Greater, c - 1));
        then.push(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
        els.push(TxnOp::get(k.clock(), None));
    }
    els.extend(delay_reads.into_iter().flatten());
    els.extend(read);
    if count_after {
        then.push(TxnOp::get(holds.as_str(), Some(GetOptions::new().with_prefix().with_count_only())));
    }
    if let Some((key, lease)) = ad {
        when.push(Compare::lease(key.as_str(), CompareOp::Equal, *lease));
        els.push(TxnOp::get(key.as_str(), Some(GetOptions::new().with_keys_only())));
    }
    when.extend(gate_compares());
    els.extend(gate_reads());
    Txn::new().when(when).and_then(then).or_else(els)
}

#[test]
fn the_single_key_grant_is_the_transaction_try_grant_built() {
    let k = Keys::new("/t");
    let d = digest("payments/a");
    let gate = PolicyGate::for_test(5, POLICY, MAP, HOME);
    let ad = (AD.0.to_owned(), AD.1);
    let waiter = k.waiters(&d) + "/0001";
    // opened, slots, skip epoch, count first, attempt, exclusion, indexed, delay,
    // fair, clock, count after, advertisement
    let mut n_checked = 0;
    for c in combinations(&[2, 2, 2, 2, 2, 3, 2, 2, 3, 2, 2, 2]) {
        let opened = (c[0] == 1).then(|| b"{\"record\":1}".to_vec());
        let (n, slot_nos): (u32, Vec<u32>) = if c[1] == 0 { (1, vec![0]) } else { (5, vec![1, 2, 4]) };
        let planted: Vec<String> = (0..slot_nos.len() as u32).map(|i| k.slot(&d, 1000 + i)).collect();
        let attempt = (c[4] == 1).then_some("00000000000000a1");
        let fair = match c[8] {
            0 => Fair::Memory,
            1 => Fair::Arrival,
            _ => Fair::Waiter { key: &waiter, rev: 90 },
        };
        let clock = (c[9] == 1).then_some(42);
        let advert = (c[11] == 1).then_some(&ad);
        let slots: Vec<(u32, String)> = if c[3] == 1 {
            planted.iter().enumerate().map(|(i, s)| (1000 + i as u32, s.clone())).collect()
        } else {
            slot_nos.iter().map(|s| (*s, k.slot(&d, *s))).collect()
        };
        let (built, ..) = build(
            &GrantTxn {
                keys: &k,
                sid: sid(),
                opened: opened.clone(),
                epoch_rev: (c[2] == 0).then_some(5),
                attempt,
                each: vec![KeyGrant {
                    d: &d,
                    slots: slots.clone(),
                    slot_compares: if c[3] == 1 { SlotCompares::Skipped } else { SlotCompares::Limit(n) },
                    hold: b"hold".to_vec(),
                    exclusion: exclusion(&k, &d, c[5]),
                    indexed: c[6] == 1,
                    delay: (c[7] == 1).then(|| delay_ops(&k, &d)),
                    fair,
                    count_after: c[10] == 1,
                }],
                clock,
                advert,
                gate: &gate,
            },
            Form::Alone,
        );
        let legacy = legacy_single(
            &k,
            &d,
            opened,
            c[2] == 1,
            c[3] == 1,
            n,
            &slot_nos,
            &planted,
            attempt,
            b"hold".to_vec(),
            exclusion(&k, &d, c[5]),
            c[6] == 1,
            (c[7] == 1).then(|| delay_ops(&k, &d)),
            fair,
            clock,
            c[10] == 1,
            advert,
        );
        // Both planted switches at once left the first slot compare standing in
        // the epoch's place (`remove(0)`, then `truncate(1)`); no scenario plants
        // both, and the builder then compares neither.
        if c[2] == 1 && c[3] == 1 {
            continue;
        }
        assert_eq!(format!("{built:?}"), format!("{legacy:?}"), "combination {c:?}");
        n_checked += 1;
    }
    assert_eq!(n_checked, 6912);
}

/// The lists of the multi-key grant as `try_grant_all` built it inline.
#[allow(clippy::too_many_arguments)]
fn legacy_multi(
    k: &Keys,
    ds: &[KeyDigest],
    slots: &[u32],
    n: u32,
    first_only: bool,
    opened: Option<Vec<u8>>,
    attempt: Option<&str>,
    excl: Vec<ExclusionOps>,
    indexed: bool,
    delay: bool,
    fair: Fair<'_>,
    clock: Option<i64>,
    ad: Option<&(String, i64)>,
) -> [Vec<String>; 3] {
    let sid = sid();
    let lease = PutOptions::new().with_lease(sid.lease());
    let sess_key = k.session(sid);
    let mut when = vec![Compare::mod_revision(k.epoch(), CompareOp::Equal, 5)];
    let (mut then, mut els, mut delay_reads, mut excl_reads) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    if let Some(a) = attempt {
        when.push(Compare::create_revision(k.attempt(sid, a), CompareOp::Equal, 0));
    }
    for (i, (d, e)) in ds.iter().zip(excl).enumerate() {
        let slot = slots[i].min(n - 1);
        let name = k.slot(d, slot);
        if !first_only || i == 0 {
            when.push(Compare::create_revision(name.as_str(), CompareOp::Equal, 0).with_range(k.slot(d, slot + 1)));
            when.push(
                Compare::create_revision(k.slot(d, n), CompareOp::Equal, 0).with_range(keys::prefix_end(&k.holds(d))),
            );
        }
        when.extend(fair.compares(k, d));
        then.push(TxnOp::put(name.as_str(), format!("hold{i}").into_bytes(), Some(lease.clone())));
        let (compare, _, read, _) = legacy_exclusion(e);
        when.extend(compare);
        excl_reads.extend(read);
        if indexed {
            then.push(TxnOp::put(k.hold_index(sid, d), Vec::<u8>::new(), Some(lease.clone())));
        }
        if delay {
            let (cmp, put, reads) = legacy_delay(delay_ops(k, d));
            when.extend(cmp);
            then.push(put);
            delay_reads.extend(reads);
        }
        els.push(TxnOp::get(k.holds(d), Some(GetOptions::new().with_prefix())));
    }
    match opened {
        Some(v) => {
            then.push(TxnOp::put(sess_key.as_str(), v.clone(), Some(lease.clone())));
            els.push(TxnOp::put(sess_key.as_str(), v, Some(lease.clone())));
        }
        None => when.push(Compare::lease(sess_key.as_str(), CompareOp::Equal, sid.lease())),
    }
    els.push(TxnOp::get(sess_key.as_str(), None));
    els.push(TxnOp::get(k.epoch(), None));
    if let Some(c) = clock {
        when.push(Compare::mod_revision(k.clock(), CompareOp::Greater, c - 1));
        then.push(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
        els.push(TxnOp::get(k.clock(), None));
    }
    els.extend(delay_reads);
    els.extend(excl_reads);
    if let Some((key, lease)) = ad {
        when.push(Compare::lease(key.as_str(), CompareOp::Equal, *lease));
        els.push(TxnOp::get(key.as_str(), Some(GetOptions::new().with_keys_only())));
    }
    when.extend(gate_compares());
    els.extend(gate_reads());
    [
        when.iter().map(|c| format!("{c:?}")).collect(),
        then.iter().map(|o| format!("{o:?}")).collect(),
        els.iter().map(|o| format!("{o:?}")).collect(),
    ]
}

#[test]
fn the_multi_key_grant_holds_what_try_grant_all_sent() {
    let k = Keys::new("/t");
    let ds: Vec<KeyDigest> = ["payments/a", "payments/b", "payments/c"].iter().map(|s| digest(s)).collect();
    let gate = PolicyGate::for_test(1, POLICY, MAP, HOME);
    let ad = (AD.0.to_owned(), AD.1);
    let slots = [0, 0, 0];
    // first only, opened, attempt, exclusion, indexed, delay, fair, clock, advertisement
    let mut n_checked = 0;
    for c in combinations(&[2, 2, 2, 2, 2, 2, 2, 2, 2]) {
        let opened = (c[1] == 1).then(|| b"{\"record\":1}".to_vec());
        let attempt = (c[2] == 1).then_some("00000000000000a1");
        let fair = if c[6] == 1 { Fair::Arrival } else { Fair::Memory };
        let clock = (c[7] == 1).then_some(42);
        let advert = (c[8] == 1).then_some(&ad);
        let each = ds
            .iter()
            .enumerate()
            .map(|(i, d)| KeyGrant {
                d,
                slots: vec![(slots[i], k.slot(d, slots[i]))],
                slot_compares: if c[0] == 0 || i == 0 { SlotCompares::Limit(1) } else { SlotCompares::Skipped },
                hold: format!("hold{i}").into_bytes(),
                exclusion: exclusion(&k, d, if c[3] == 1 { 1 } else { 0 }),
                indexed: c[4] == 1,
                delay: (c[5] == 1).then(|| delay_ops(&k, d)),
                fair,
                count_after: false,
            })
            .collect();
        let (built, _) = assemble(
            &GrantTxn {
                keys: &k,
                sid: sid(),
                opened: opened.clone(),
                epoch_rev: Some(5),
                attempt,
                each,
                clock,
                advert,
                gate: &gate,
            },
            Form::Alone,
        );
        let excl: Vec<ExclusionOps> = ds.iter().map(|d| exclusion(&k, d, if c[3] == 1 { 1 } else { 0 })).collect();
        let legacy = legacy_multi(
            &k,
            &ds,
            &slots,
            1,
            c[0] == 1,
            opened,
            attempt,
            excl,
            c[4] == 1,
            c[5] == 1,
            fair,
            clock,
            advert,
        );
        let sorted = |mut lists: [Vec<String>; 3]| {
            lists.iter_mut().for_each(|l| l.sort());
            lists
        };
        let lists = built.debug_lists();
        assert_eq!(sorted(lists.clone()), sorted(legacy), "combination {c:?}");
        // The one order: the failure branch reads each key's holders first (after
        // an opened session's record), in the order of the keys.
        let first = usize::from(c[1] == 1);
        for (i, d) in ds.iter().enumerate() {
            let want = format!("{:?}", k.holds(d).into_bytes());
            assert!(lists[2][first + i].contains(&want), "{}", lists[2][first + i]);
        }
        n_checked += 1;
    }
    assert_eq!(n_checked, 512);
}
