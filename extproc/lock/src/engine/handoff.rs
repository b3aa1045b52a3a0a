//! The hand-off transaction: a release and the grant of the freed slot to the
//! key's head waiter, in one commit.
//!
//! ```text
//! compare  release compares                             the releasing grant
//!          mod_revision(epoch) == E.mod_revision        epoch unchanged
//!          lease(<root>/s/<waiter sid>) == waiter sid    waiter's session alive
//!            (or create_revision(...) == 0 when the waiter's acquire opened
//!            its session: then the record is put too, on the waiter's lease)
//!          create_revision(other name) == 0             the other name is free
//!          create_revision([slot N, end)) == 0          nothing above the limit
//!          policy, class map and home                   as a grant (`PolicyGate`)
//!          this arbiter's advertisement                 as a grant
//!          grant clock at or above the mark             as a grant
//! then     delete the released slot, put the release marker, put the other
//!          name = the waiter's hold (waiter's lease), the releasing grant's
//!          ends, the waiter's index key, the clock, the lock-delay guard
//! ```
//!
//! The slot keeps exactly one hold, so the count of holds of the key is the same
//! before and after: the limit holds as it held before. The new hold is a new
//! key, so its create revision (the token) is this commit's revision. No
//! failure branch: a refused hand-off wrote nothing and the release runs alone.
//!
//! The builder is pure: the caller read the epoch, the gate and the offer.

use etcd_client::{Compare, CompareOp, DeleteOptions, PutOptions, TxnOp};
use lockmesh_core::{headers::SessionId, KeyDigest};

use super::txn::TxnBuilder;
use crate::{keys, policy::PolicyGate, Keys};

/// The waiter's session in a hand-off.
pub(crate) enum WaiterSession {
    /// Alive: compared by its lease.
    Alive,
    /// Opened by the waiter's acquire and not written yet: compared absent and
    /// its record put on the waiter's lease (`None`: not put, a planted bug).
    Opens(Option<Vec<u8>>),
}

/// Everything a hand-off transaction is built from.
pub(crate) struct HandoffTxn<'a> {
    pub keys: &'a Keys,
    pub d: &'a KeyDigest,
    /// The releasing grant's slot key, and the compares that name its grant.
    pub hold_key: &'a [u8],
    pub release_cmp: &'a [Compare],
    /// The releasing grant's ends (`mutex::end_ops`).
    pub ends: &'a [TxnOp],
    /// The epoch record's mod revision compared; `None` compares none (planted).
    pub epoch_rev: Option<i64>,
    pub waiter: SessionId,
    pub session: WaiterSession,
    /// The class's authoritative limit, and the records that say so.
    pub limit: u32,
    pub gate: &'a PolicyGate,
    /// This arbiter's advertisement (key, lease), compared.
    pub advert: Option<(&'a str, i64)>,
    /// The release marker and the marker lease it is put on.
    pub marker: (&'a str, i64),
    /// The waiter's hold record.
    pub hold: Vec<u8>,
    /// Whether the waiter's session keeps a hold index key of this key.
    pub indexed: bool,
    /// The grant clock's mark: compared at or above, put.
    pub clock: Option<i64>,
    /// The lock-delay guard: put naming the waiter (`Some(value)`) or deleted.
    pub delay_guard: Option<Vec<u8>>,
}

/// The hand-off transaction, and the name the waiter's hold is put under.
pub(crate) fn build(h: HandoffTxn<'_>) -> (TxnBuilder, Vec<u8>) {
    let k = h.keys;
    let new_key = Keys::other_name(h.hold_key);
    let mut b = TxnBuilder::new();
    b.compares(h.release_cmp.iter().cloned());
    if let Some(rev) = h.epoch_rev {
        b.compare(Compare::mod_revision(k.epoch(), CompareOp::Equal, rev));
    }
    let sess_key = k.session(h.waiter);
    let on_waiter = || Some(PutOptions::new().with_lease(h.waiter.lease()));
    match h.session {
        WaiterSession::Opens(record) => {
            // The create compare keeps a record a concurrent transaction wrote; a
            // lease revoked since fails the whole transaction (`lease not found`).
            b.compare(Compare::create_revision(sess_key.as_str(), CompareOp::Equal, 0));
            if let Some(v) = record {
                b.on_success(TxnOp::put(sess_key.as_str(), v, on_waiter()));
            }
        }
        WaiterSession::Alive => b.compare(Compare::lease(sess_key.as_str(), CompareOp::Equal, h.waiter.lease())),
    }
    b.compare(Compare::create_revision(new_key.clone(), CompareOp::Equal, 0));
    b.compare(
        Compare::create_revision(k.slot(h.d, h.limit), CompareOp::Equal, 0).with_range(keys::prefix_end(&k.holds(h.d))),
    );
    b.compares(h.gate.compares());
    if let Some((key, lease)) = h.advert {
        b.compare(Compare::lease(key, CompareOp::Equal, lease));
    }
    let (marker, marker_lease) = h.marker;
    b.on_success_all([
        TxnOp::delete(h.hold_key.to_vec(), None::<DeleteOptions>),
        TxnOp::put(k.release_marker(h.d), marker, Some(PutOptions::new().with_lease(marker_lease))),
        TxnOp::put(new_key.clone(), h.hold, on_waiter()),
    ]);
    b.on_success_all(h.ends.iter().cloned());
    if h.indexed {
        b.on_success(TxnOp::put(k.hold_index(h.waiter, h.d), Vec::<u8>::new(), on_waiter()));
    }
    if let Some(c) = h.clock {
        // A failed clock compare hands nothing off; the waiter's own grant
        // attempt then seals.
        b.compare(Compare::mod_revision(k.clock(), CompareOp::Greater, c - 1));
        b.on_success(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
    }
    match h.delay_guard {
        Some(v) => b.on_success(TxnOp::put(k.delay_guard(h.d), v, None)),
        None => b.on_success(TxnOp::delete(k.delay_guard(h.d), None::<DeleteOptions>)),
    }
    (b, new_key)
}

#[cfg(test)]
mod tests {
    use etcd_client::Txn;
    use lockmesh_core::LockKey;

    use super::*;

    /// The hand-off as `Store::handoff` assembled it inline before the builder,
    /// from the same inputs.
    #[allow(clippy::too_many_arguments)]
    fn legacy(
        k: &Keys,
        d: &KeyDigest,
        hold_key: &[u8],
        release_cmp: &[Compare],
        ends: &[TxnOp],
        epoch_rev: Option<i64>,
        sid: SessionId,
        record: Option<Option<Vec<u8>>>,
        n: u32,
        gate: &PolicyGate,
        ad: Option<(&str, i64)>,
        (marker, lease): (&str, i64),
        hold: Vec<u8>,
        indexed: bool,
        clock: Option<i64>,
        delay: Option<Vec<u8>>,
    ) -> Txn {
        let new_key = Keys::other_name(hold_key);
        let mut when = release_cmp.to_vec();
        if let Some(rev) = epoch_rev {
            when.push(Compare::mod_revision(k.epoch(), CompareOp::Equal, rev));
        }
        let sess_key = k.session(sid);
        let mut then = Vec::new();
        match record {
            Some(rec) => {
                when.push(Compare::create_revision(sess_key.as_str(), CompareOp::Equal, 0));
                if let Some(v) = rec {
                    then.push(TxnOp::put(sess_key.as_str(), v, Some(PutOptions::new().with_lease(sid.lease()))));
                }
            }
            None => when.push(Compare::lease(sess_key.as_str(), CompareOp::Equal, sid.lease())),
        }
        when.push(Compare::create_revision(new_key.clone(), CompareOp::Equal, 0));
        when.push(
            Compare::create_revision(k.slot(d, n), CompareOp::Equal, 0).with_range(keys::prefix_end(&k.holds(d))),
        );
        when.extend(gate.compares());
        if let Some((key, lease)) = ad {
            when.push(Compare::lease(key, CompareOp::Equal, lease));
        }
        then.extend([
            TxnOp::delete(hold_key.to_vec(), None::<DeleteOptions>),
            TxnOp::put(k.release_marker(d), marker, Some(PutOptions::new().with_lease(lease))),
            TxnOp::put(new_key.clone(), hold, Some(PutOptions::new().with_lease(sid.lease()))),
        ]);
        then.extend(ends.iter().cloned());
        if indexed {
            then.push(TxnOp::put(
                k.hold_index(sid, d),
                Vec::<u8>::new(),
                Some(PutOptions::new().with_lease(sid.lease())),
            ));
        }
        if let Some(c) = clock {
            when.push(Compare::mod_revision(k.clock(), CompareOp::Greater, c - 1));
            then.push(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
        }
        match delay {
            Some(v) => then.push(TxnOp::put(k.delay_guard(d), v, None)),
            None => then.push(TxnOp::delete(k.delay_guard(d), None::<DeleteOptions>)),
        }
        Txn::new().when(when).and_then(then)
    }

    #[test]
    fn the_builder_sends_what_the_inline_hand_off_sent() {
        let k = Keys::new("/t");
        let d = LockKey::parse(b"orders/7").unwrap().digest();
        let sid = SessionId::from_lease(0x1234_5678).unwrap();
        let gate = PolicyGate::for_test(3, ("/t/c/pay", 11), ("/t/sys/classmap", 12), ("/t/sys/home", 13));
        let hold_key = k.slot(&d, 1).into_bytes();
        let release_cmp = [Compare::create_revision(hold_key.clone(), CompareOp::Equal, 40)];
        let ends = [TxnOp::delete(k.exclusion(&d), None::<DeleteOptions>)];
        let mut tried = 0;
        for bits in 0..(3 * 2 * 2 * 2 * 2 * 2) {
            let (session, rest) = (bits % 3, bits / 3);
            let [epoch, advert, indexed, clock, delay] = [0, 1, 2, 3, 4].map(|i| rest >> i & 1 == 1);
            let record = match session {
                0 => None,
                1 => Some(Some(b"{\"rec\":1}".to_vec())),
                _ => Some(None),
            };
            let epoch_rev = epoch.then_some(9);
            let ad = advert.then_some(("/t/sys/arbiters/a", 77));
            let clock = clock.then_some(120);
            let delay = delay.then(|| b"{\"session\":\"x\"}".to_vec());
            let (built, new_key) = build(HandoffTxn {
                keys: &k,
                d: &d,
                hold_key: &hold_key,
                release_cmp: &release_cmp,
                ends: &ends,
                epoch_rev,
                waiter: sid,
                session: match record.clone() {
                    None => WaiterSession::Alive,
                    Some(r) => WaiterSession::Opens(r),
                },
                limit: 3,
                gate: &gate,
                advert: ad,
                marker: ("{\"m\":1}", 55),
                hold: b"{\"hold\":1}".to_vec(),
                indexed,
                clock,
                delay_guard: delay.clone(),
            });
            assert_eq!(new_key, Keys::other_name(&hold_key));
            let want = legacy(
                &k,
                &d,
                &hold_key,
                &release_cmp,
                &ends,
                epoch_rev,
                sid,
                record,
                3,
                &gate,
                ad,
                ("{\"m\":1}", 55),
                b"{\"hold\":1}".to_vec(),
                indexed,
                clock,
                delay,
            );
            // The request etcd receives; the builder always sets the (empty)
            // failure branch, which only the client's own `c_else` flag records.
            let request = |t: &Txn| {
                let text = format!("{t:?}");
                text.split(", c_when").next().unwrap_or_default().to_owned()
            };
            assert_eq!(request(&built.build()), request(&want), "combination {bits}");
            tried += 1;
        }
        assert_eq!(tried, 96);
    }
}
