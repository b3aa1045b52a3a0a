//! The grant clock in a transaction. A write a restore could lose (a grant, a
//! release, a session close) compares the clock key's mod revision at or above
//! this arbiter's mark and puts the key, so a restored store fails the compare
//! before it can commit anything; a refusal reads the key, and a clock below the
//! mark seals the arbiter (`seal`).

use etcd_client::{Compare, CompareOp, TxnOp};
use lockmesh_keyspace::Keys;

use super::txn::{mod_revision, Answer, Branch, Read, TxnBuilder};
use crate::{seal::SealReason, LockError, Store};

/// The clock's part of one transaction: the mark it compared and its read on a
/// refusal.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClockGuard {
    mark: i64,
    read: Read,
}

impl ClockGuard {
    /// The refusal branch's read of the clock key.
    pub(crate) fn read(self) -> Read {
        self.read
    }
}

/// Adds the clock's compare (at or above `mark`), its put and its refusal read to
/// `b`; nothing without a mark (before this arbiter has one).
pub(crate) fn guard(k: &Keys, mark: Option<i64>, b: &mut TxnBuilder) -> Option<ClockGuard> {
    mark.map(|c| {
        b.compare(Compare::mod_revision(k.clock(), CompareOp::Greater, c - 1));
        b.on_success(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
        ClockGuard { mark: c, read: b.read(Branch::Failure, k.clock(), None) }
    })
}

impl Store {
    /// After a transaction with `guard`: a commit raises the clock mark of
    /// `epoch`; a refusal whose clock read is below the mark seals (a restore) and
    /// answers `sealed`; any other refusal is the caller's to read.
    pub(crate) fn clock_outcome(
        &self,
        guard: Option<ClockGuard>,
        epoch: u64,
        answer: &Answer,
        what: &str,
    ) -> Result<(), LockError> {
        let Some(g) = guard else { return Ok(()) };
        if answer.succeeded() {
            if let Some(rev) = answer.revision() {
                self.seal().observe_clock(rev, epoch);
            }
            return Ok(());
        }
        let at = mod_revision(answer.get(g.read));
        if at < g.mark {
            let why = format!("grant clock {at} below mark {} at {what}", g.mark);
            self.seal().seal(SealReason::ClockBehindMark, why.clone());
            return Err(LockError::Sealed(format!("clock_behind_mark: {why}")));
        }
        Ok(())
    }
}
