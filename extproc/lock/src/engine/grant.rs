//! The grant transactions, built from their concerns in one place.
//!
//! [`single`] builds a grant of one key (mutex, k permits, read-write,
//! campaign), [`multi`] a grant of several keys in one commit. Each concern adds
//! its part to the [`TxnBuilder`] and keeps the handles of its reads in
//! [`GrantReads`]; the grant's failure branch is decoded through those, so a
//! concern added, removed or moved changes no other concern's decoding.
//!
//! Both builders are pure: what needs etcd (the epoch, the policy gate, the free
//! slots) is read before, by the caller.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, TxnOp};
use lockmesh_core::{headers::SessionId, KeyDigest};

use super::txn::{Branch, Read, TxnBuilder};
use crate::{keys, mutex::ExclusionOps, mutex::Fair, policy::GateReads, policy::PolicyGate, Keys};

/// Which holder-slot compares a grant makes.
pub(crate) enum SlotCompares {
    /// Each slot's range empty, and nothing held at the limit or above.
    Limit(u32),
    /// None (a planted bug counts the holders before and compares nothing).
    Skipped,
}

/// A key's lock-delay part: its guard put, both records compared absent and
/// read on a refusal (`delay`).
pub(crate) struct DelayOps {
    pub compares: Vec<Compare>,
    pub put: TxnOp,
    pub reads: [String; 2],
}

/// Everything a grant transaction of one key is built from.
pub(crate) struct SingleGrant<'a> {
    pub keys: &'a Keys,
    pub d: &'a KeyDigest,
    pub sid: SessionId,
    /// The record of a session opened for this acquire (put in both branches);
    /// `None`: the caller's session, compared by its lease.
    pub opened: Option<Vec<u8>>,
    /// The epoch record's mod revision compared; `None` compares none (planted).
    pub epoch_rev: Option<i64>,
    /// Slot numbers and the names they are held under.
    pub slots: &'a [(u32, String)],
    pub slot_compares: SlotCompares,
    pub attempt: Option<&'a str>,
    /// The hold record put into each slot.
    pub hold: Vec<u8>,
    pub exclusion: ExclusionOps,
    /// Whether the session's hold index key is put.
    pub indexed: bool,
    pub delay: Option<DelayOps>,
    pub fair: Fair<'a>,
    /// The grant clock's mark: compared at or above, put, read on a refusal.
    pub clock: Option<i64>,
    /// Whether the success branch counts the key's holders after the grant (shadow).
    pub count_after: bool,
    /// This arbiter's advertisement (key, lease) compared.
    pub advert: Option<&'a (String, i64)>,
    pub gate: &'a PolicyGate,
}

/// Where a grant's reads landed.
pub(crate) struct GrantReads {
    /// The key's holders after the grant (success branch; shadow only).
    pub count: Option<Read>,
    /// Each key's holders, in the order of the keys.
    pub holders: Vec<Read>,
    pub session: Read,
    pub epoch: Read,
    pub clock: Option<Read>,
    /// Each key's lock-delay guard and record.
    pub delay: Vec<[Read; 2]>,
    /// Each key's exclusion record.
    pub exclusion: Vec<Read>,
    pub advert: Option<Read>,
    pub gate: GateReads,
}

/// One key's slots compared empty, and its holds at the limit and above.
fn slot_compares(b: &mut TxnBuilder, k: &Keys, d: &KeyDigest, slots: &[(u32, String)], n: u32) {
    for (no, name) in slots {
        // The slot's range is empty: neither of its two names (`keys`) is held.
        b.compare(Compare::create_revision(name.as_str(), CompareOp::Equal, 0).with_range(k.slot(d, no + 1)));
    }
    // Empty range [slot N, end of the key's holds): no holder above the limit.
    b.compare(Compare::create_revision(k.slot(d, n), CompareOp::Equal, 0).with_range(keys::prefix_end(&k.holds(d))));
}

/// The session: a record put in both branches for a session opened here, else
/// the caller's session compared by its lease (a put on a dead lease would fail
/// the whole transaction; a compare fails it first and says why).
fn session_record(b: &mut TxnBuilder, k: &Keys, sid: SessionId, opened: &Option<Vec<u8>>) {
    if let Some(v) = opened {
        let lease = Some(PutOptions::new().with_lease(sid.lease()));
        b.on_success(TxnOp::put(k.session(sid), v.clone(), lease.clone()));
        b.on_failure(TxnOp::put(k.session(sid), v.clone(), lease));
    }
}

fn clock(b: &mut TxnBuilder, k: &Keys, mark: Option<i64>) -> Option<Read> {
    let c = mark?;
    // The grant clock (`seal`): at or above this arbiter's mark, and put, so a
    // restored store fails here before it can grant anything.
    b.compare(Compare::mod_revision(k.clock(), CompareOp::Greater, c - 1));
    b.on_success(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
    Some(b.read(Branch::Failure, k.clock(), None))
}

fn advert(b: &mut TxnBuilder, ad: Option<&(String, i64)>) -> Option<Read> {
    let (key, lease) = ad?;
    // An arbiter paused through a capability flip grants nothing until it has
    // read the record again (`upgrade::Guard`).
    b.compare(Compare::lease(key.as_str(), CompareOp::Equal, *lease));
    Some(b.read(Branch::Failure, key.as_str(), Some(GetOptions::new().with_keys_only())))
}

fn keys_only() -> Option<GetOptions> {
    Some(GetOptions::new().with_keys_only())
}

/// The grant transaction of one key, and where its reads are.
pub(crate) fn single(g: SingleGrant<'_>) -> (etcd_client::Txn, GrantReads) {
    let (k, d, sid) = (g.keys, g.d, g.sid);
    let lease = Some(PutOptions::new().with_lease(sid.lease()));
    let mut b = TxnBuilder::new();
    session_record(&mut b, k, sid, &g.opened);
    if let Some(rev) = g.epoch_rev {
        b.compare(Compare::mod_revision(k.epoch(), CompareOp::Equal, rev));
    }
    if let SlotCompares::Limit(n) = g.slot_compares {
        slot_compares(&mut b, k, d, g.slots, n);
    }
    if g.opened.is_none() {
        b.compare(Compare::lease(k.session(sid), CompareOp::Equal, sid.lease()));
    }
    // The attempt's fence (`Keys::attempt`), for a session the caller keeps.
    if let Some(a) = g.attempt {
        b.compare(Compare::create_revision(k.attempt(sid, a), CompareOp::Equal, 0));
    }
    for (_, name) in g.slots {
        b.on_success(TxnOp::put(name.as_str(), g.hold.clone(), lease.clone()));
    }
    let ExclusionOps { compare, put, read: excl_read } = g.exclusion;
    b.compares(compare);
    if let Some(p) = put {
        b.on_success(p);
    }
    if g.indexed {
        b.on_success(TxnOp::put(k.hold_index(sid, d), Vec::<u8>::new(), lease.clone()));
    }
    let delay_keys = g.delay.map(|ops| {
        b.compares(ops.compares);
        b.on_success(ops.put);
        ops.reads
    });
    b.compares(g.fair.compares(k, d));
    for op in g.fair.ops() {
        b.on_success(op);
    }
    let holders = b.read(Branch::Failure, k.holds(d), Some(GetOptions::new().with_prefix()));
    let session = b.read(Branch::Failure, k.session(sid), None);
    let epoch = b.read(Branch::Failure, k.epoch(), None);
    let clock = clock(&mut b, k, g.clock);
    let delay =
        delay_keys.map(|[guard, record]| [b.read(Branch::Failure, guard, None), b.read(Branch::Failure, record, None)]);
    let exclusion = excl_read.map(|key| b.read(Branch::Failure, key, keys_only()));
    // Shadow mode (`shadow`): a stricter candidate limit needs the holder count
    // after the grant; a read in the same transaction, no round trip.
    let count = g
        .count_after
        .then(|| b.read(Branch::Success, k.holds(d), Some(GetOptions::new().with_prefix().with_count_only())));
    let advert = advert(&mut b, g.advert);
    let gate = g.gate.add_to(&mut b);
    let reads = GrantReads {
        count,
        holders: vec![holders],
        session,
        epoch,
        clock,
        delay: delay.into_iter().collect(),
        exclusion: exclusion.into_iter().collect(),
        advert,
        gate,
    };
    (b.build(), reads)
}

/// One key of a multi-key grant.
pub(crate) struct MultiKey<'a> {
    pub d: &'a KeyDigest,
    /// The slot compared and the name it is held under.
    pub slot: (u32, String),
    /// Whether its slot and limit are compared (a planted bug compares one key).
    pub compared: bool,
    pub hold: Vec<u8>,
    pub exclusion: ExclusionOps,
    pub indexed: bool,
    pub delay: Option<DelayOps>,
}

/// Everything a multi-key grant transaction is built from.
pub(crate) struct MultiGrant<'a> {
    pub keys: &'a Keys,
    pub sid: SessionId,
    pub opened: Option<Vec<u8>>,
    pub epoch_rev: i64,
    /// The limit of every key (one class).
    pub limit: u32,
    pub attempt: Option<&'a str>,
    pub each: Vec<MultiKey<'a>>,
    pub fair: Fair<'a>,
    pub clock: Option<i64>,
    pub advert: Option<&'a (String, i64)>,
    pub gate: &'a PolicyGate,
}

/// The grant transaction of several keys, and where its reads are.
pub(crate) fn multi(g: MultiGrant<'_>) -> (etcd_client::Txn, GrantReads) {
    let (k, sid) = (g.keys, g.sid);
    let lease = Some(PutOptions::new().with_lease(sid.lease()));
    let mut b = TxnBuilder::new();
    b.compare(Compare::mod_revision(k.epoch(), CompareOp::Equal, g.epoch_rev));
    if let Some(a) = g.attempt {
        b.compare(Compare::create_revision(k.attempt(sid, a), CompareOp::Equal, 0));
    }
    let (mut holders, mut delay_keys, mut excl_keys) = (Vec::new(), Vec::new(), Vec::new());
    for key in g.each {
        let d = key.d;
        if key.compared {
            slot_compares(&mut b, k, d, std::slice::from_ref(&key.slot), g.limit);
        }
        b.compares(g.fair.compares(k, d));
        b.on_success(TxnOp::put(key.slot.1.as_str(), key.hold, lease.clone()));
        // Exclusion (`Keys::exclusion`): no key of the acquire is held exclusively.
        b.compares(key.exclusion.compare);
        excl_keys.extend(key.exclusion.read);
        if key.indexed {
            b.on_success(TxnOp::put(k.hold_index(sid, d), Vec::<u8>::new(), lease.clone()));
        }
        if let Some(ops) = key.delay {
            b.compares(ops.compares);
            b.on_success(ops.put);
            delay_keys.push(ops.reads);
        }
        holders.push(b.read(Branch::Failure, k.holds(d), Some(GetOptions::new().with_prefix())));
    }
    session_record(&mut b, k, sid, &g.opened);
    if g.opened.is_none() {
        b.compare(Compare::lease(k.session(sid), CompareOp::Equal, sid.lease()));
    }
    let session = b.read(Branch::Failure, k.session(sid), None);
    let epoch = b.read(Branch::Failure, k.epoch(), None);
    let clock = clock(&mut b, k, g.clock);
    let delay = delay_keys
        .into_iter()
        .map(|[guard, record]| [b.read(Branch::Failure, guard, None), b.read(Branch::Failure, record, None)])
        .collect();
    let exclusion = excl_keys.into_iter().map(|key| b.read(Branch::Failure, key, keys_only())).collect();
    let advert = advert(&mut b, g.advert);
    let gate = g.gate.add_to(&mut b);
    let reads = GrantReads { count: None, holders, session, epoch, clock, delay, exclusion, advert, gate };
    let (when, then, _) = b.lengths();
    debug_assert!(when + then <= crate::multi::MAX_TXN_OPS);
    (b.build(), reads)
}

#[cfg(test)]
mod tests;
