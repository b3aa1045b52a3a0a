//! The grant transaction, built from its concerns in one place.
//!
//! [`build`] makes the grant of one key (mutex, k permits, read-write,
//! campaign) and of several keys in one commit (multi-key acquire) alike. Each
//! concern adds its part to the [`TxnBuilder`] and keeps the handles of its
//! reads in [`GrantReads`]; the grant's failure branch is decoded through those,
//! so a concern added, removed or moved changes no other concern's decoding.
//!
//! The builder is pure: what needs etcd (the epoch, the policy gate, the free
//! slots) is read before, by the caller.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, TxnOp};
use lockmesh_core::{headers::SessionId, KeyDigest};

use super::txn::{Branch, Read, TxnBuilder};
use crate::{
    keys,
    mutex::ExclusionOps,
    mutex::Fair,
    policy::GateReads,
    policy::PolicyGate,
    test_faults::{self, TestFault},
    Keys,
};

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

/// One key of a grant: its slots, its hold and the records of its own.
pub(crate) struct KeyGrant<'a> {
    pub d: &'a KeyDigest,
    /// Slot numbers and the names they are held under.
    pub slots: Vec<(u32, String)>,
    pub slot_compares: SlotCompares,
    /// The hold record put into each slot.
    pub hold: Vec<u8>,
    pub exclusion: ExclusionOps,
    /// Whether the session's hold index key of this key is put.
    pub indexed: bool,
    pub delay: Option<DelayOps>,
    pub fair: Fair<'a>,
    /// Whether the success branch counts the key's holders after the grant (shadow).
    pub count_after: bool,
}

/// Everything a grant transaction of one or several keys is built from. All
/// keys commit together or none does, on one session, under one epoch.
pub(crate) struct GrantTxn<'a> {
    pub keys: &'a Keys,
    pub sid: SessionId,
    /// The record of a session opened for this acquire (put in both branches);
    /// `None`: the caller's session, compared by its lease.
    pub opened: Option<Vec<u8>>,
    /// The epoch record's mod revision compared; `None` compares none (planted).
    pub epoch_rev: Option<i64>,
    pub attempt: Option<&'a str>,
    pub each: Vec<KeyGrant<'a>>,
    /// The grant clock's mark: compared at or above, put, read on a refusal.
    pub clock: Option<i64>,
    /// This arbiter's advertisement (key, lease) compared.
    pub advert: Option<&'a (String, i64)>,
    pub gate: &'a PolicyGate,
}

/// How a grant transaction is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// Alone: with its epoch compare and the grant clock.
    Alone,
    /// As a member of a group (`engine::group`): the group makes the epoch
    /// compare and the grant clock once, at the outer level.
    Member,
}

/// Where a grant's reads landed.
pub(crate) struct GrantReads {
    /// Each key's holder count after the grant (success branch; shadow only).
    pub count: Vec<Option<Read>>,
    /// Each key's holders, in the order of the keys.
    pub holders: Vec<Read>,
    pub session: Read,
    pub epoch: Read,
    pub clock: Option<Read>,
    /// Each key's lock-delay guard and record (`None`: no delay compared).
    pub delay: Vec<Option<[Read; 2]>>,
    /// Each key's exclusion record (`None`: not compared).
    pub exclusion: Vec<Option<Read>>,
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

fn keys_only() -> Option<GetOptions> {
    Some(GetOptions::new().with_keys_only())
}

/// The grant transaction of `g.each`, and where its reads are.
///
/// Compares: the epoch; each key's slots and limit; the session's lease (a put
/// on a dead lease would fail the whole transaction: the compare fails it first
/// and says why); the attempt fence; each key's exclusion record, lock-delay
/// records and durable queue; the grant clock; this arbiter's advertisement; the
/// policy gate. Success: the opened session's record, each key's holds,
/// exclusion record, hold index key, delay guard and queue entry delete, the
/// grant clock. Failure: the opened session's record, and what the refusal is
/// decided from. The order is fixed; a grant of one key is the order the
/// single-key path always sent.
///
/// A [`Form::Member`] leaves the epoch compare and the grant clock to its group
/// and keeps everything else, so its failure branch is decoded as a lone one's.
pub(crate) fn build(g: &GrantTxn<'_>, form: Form) -> (etcd_client::Txn, GrantReads, (usize, usize, usize)) {
    let (b, reads) = assemble(g, form);
    let lengths = b.lengths();
    let (when, then, _) = lengths;
    debug_assert!(when + then <= crate::multi::MAX_TXN_OPS, "{when} compares, {then} writes");
    (b.build(), reads, lengths)
}

fn assemble(g: &GrantTxn<'_>, form: Form) -> (TxnBuilder, GrantReads) {
    let (k, sid) = (g.keys, g.sid);
    let lease = Some(PutOptions::new().with_lease(sid.lease()));
    let member = form == Form::Member;
    let mut b = TxnBuilder::new();
    if let Some(v) = &g.opened {
        b.on_success(TxnOp::put(k.session(sid), v.clone(), lease.clone()));
        b.on_failure(TxnOp::put(k.session(sid), v.clone(), lease.clone()));
    }
    if let (Some(rev), false) = (g.epoch_rev, member) {
        b.compare(Compare::mod_revision(k.epoch(), CompareOp::Equal, rev));
    }
    for key in &g.each {
        if let SlotCompares::Limit(n) = key.slot_compares {
            slot_compares(&mut b, k, key.d, &key.slots, n);
        }
    }
    // The session's lease, compared: a put on a dead lease would fail the whole
    // transaction (a group with it); the compare fails first and says why.
    // PLANTED BUG (group scenarios) when a member skips it.
    if g.opened.is_none() && !(member && test_faults::on(TestFault::GroupNoLeaseGuard)) {
        b.compare(Compare::lease(k.session(sid), CompareOp::Equal, sid.lease()));
    }
    // The attempt's fence (`Keys::attempt`), for a session the caller keeps.
    if let Some(a) = g.attempt {
        b.compare(Compare::create_revision(k.attempt(sid, a), CompareOp::Equal, 0));
    }
    let mut later = Vec::with_capacity(g.each.len());
    for key in &g.each {
        for (_, name) in &key.slots {
            b.on_success(TxnOp::put(name.as_str(), key.hold.clone(), lease.clone()));
        }
        let ExclusionOps { compare, put, read } = &key.exclusion;
        b.compares(compare.iter().cloned());
        b.on_success_all(put.iter().cloned());
        if key.indexed {
            b.on_success(TxnOp::put(k.hold_index(sid, key.d), Vec::<u8>::new(), lease.clone()));
        }
        let delay = key.delay.as_ref().map(|ops| {
            b.compares(ops.compares.iter().cloned());
            b.on_success(ops.put.clone());
            ops.reads.clone()
        });
        b.compares(key.fair.compares(k, key.d));
        b.on_success_all(key.fair.ops());
        later.push((key.d, delay, read.clone(), key.count_after));
    }
    let holders = later
        .iter()
        .map(|(d, ..)| b.read(Branch::Failure, k.holds(d), Some(GetOptions::new().with_prefix())))
        .collect();
    let session = b.read(Branch::Failure, k.session(sid), None);
    let epoch = b.read(Branch::Failure, k.epoch(), None);
    // The grant clock (`seal`): at or above this arbiter's mark, and put, so a
    // restored store fails here before it can grant anything.
    // PLANTED BUG (group scenarios) when a member carries the clock.
    let clock = g.clock.filter(|_| !member || test_faults::on(TestFault::GroupClockInMember));
    let clock = super::clock::guard(k, clock, &mut b).map(super::clock::ClockGuard::read);
    let delay = later
        .iter_mut()
        .map(|(_, delay, ..)| {
            delay
                .take()
                .map(|[guard, record]| [b.read(Branch::Failure, guard, None), b.read(Branch::Failure, record, None)])
        })
        .collect();
    let exclusion = later
        .iter_mut()
        .map(|(_, _, read, _)| read.take().map(|key| b.read(Branch::Failure, key, keys_only())))
        .collect();
    // Shadow mode (`shadow`): a stricter candidate limit needs the holder count
    // after the grant; a read in the same transaction, no round trip.
    let count = later
        .iter()
        .map(|(d, _, _, count)| {
            count.then(|| b.read(Branch::Success, k.holds(d), Some(GetOptions::new().with_prefix().with_count_only())))
        })
        .collect();
    // An arbiter paused through a capability flip grants nothing until it has
    // read the record again (`upgrade::Guard`).
    let advert = g.advert.map(|(key, lease)| {
        b.compare(Compare::lease(key.as_str(), CompareOp::Equal, *lease));
        b.read(Branch::Failure, key.as_str(), keys_only())
    });
    let gate = g.gate.add_to(&mut b);
    (b, GrantReads { count, holders, session, epoch, clock, delay, exclusion, advert, gate })
}

#[cfg(test)]
mod tests;
