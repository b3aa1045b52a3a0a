//! The transactions that end something: a release and a session close. Each
//! puts a marker on this arbiter's marker lease (so an audit reader tells it from
//! an expiry) and carries the grant clock as a grant does, since a restore can
//! lose an end too (the released hold or closed session would stand again).

use lockmesh_core::KeyDigest;

use super::{
    clock,
    group::{Member, Outer},
    txn::{Answer, TxnBuilder},
};
use crate::{
    steps::{timed, Step},
    LockError, Store,
};

impl Store {
    /// Sends the transaction `build` writes into a builder, given this arbiter's
    /// marker lease, with the grant clock of the current epoch added after it
    /// ([`clock::guard`]; [`Store::end_clock`] says when there is none). A marker
    /// lease etcd no longer knows is replaced and the transaction built again,
    /// once. Returns the answer, after the clock's outcome (a clock behind its
    /// mark seals and answers `sealed`), and what `build` returned. `step` times
    /// the call when given. The end of one lock key's hold (`group`: its digest)
    /// goes as a member of a group when grouping is on.
    pub(crate) async fn commit_end<R>(
        &self,
        step: Option<Step>,
        what: &str,
        group: Option<&KeyDigest>,
        mut build: impl FnMut(&mut TxnBuilder, i64) -> R,
    ) -> Result<(Answer, R), LockError> {
        let epoch = self.epoch().state().await?.epoch;
        let mark = self.end_clock(epoch);
        if let (Some(d), true) = (group, self.committer().enabled()) {
            // One lock key's end, as a member of a group (`engine::group`): the
            // group puts the clock; anything that keeps the group from running as
            // one sends it alone, below.
            let lease = self.marker_lease().await?;
            let mut b = TxnBuilder::new();
            let out = build(&mut b, lease);
            let member = Member::new(
                vec![d.as_str().as_bytes().to_vec()],
                b.lengths(),
                b.build(),
                Outer { epoch_rev: None, clock: mark },
            );
            let answered = match step {
                Some(step) => timed(step, self.cluster.call(self.grouped(member))).await,
                None => self.cluster.call(self.grouped(member)).await,
            };
            if let Some(answer) = answered? {
                if let (Some(_), Some(rev)) = (mark, answer.revision()) {
                    self.seal().observe_clock(rev, epoch);
                }
                return Ok((answer, out));
            }
        }
        for _ in 0..2 {
            let lease = self.marker_lease().await?;
            let mut b = TxnBuilder::new();
            let out = build(&mut b, lease);
            let guard = clock::guard(self.cluster.keys(), mark, &mut b);
            let txn = b.build();
            let sent = match step {
                Some(step) => timed(step, self.cluster.call(self.cluster.client().txn(txn))).await,
                None => self.cluster.call(self.cluster.client().txn(txn)).await,
            };
            match sent {
                Ok(r) => {
                    let answer = Answer::of(&r);
                    self.clock_outcome(guard, epoch, &answer, what)?;
                    return Ok((answer, out));
                }
                Err(LockError::Unavailable(m)) if m.contains("lease not found") => self.drop_marker_lease().await,
                Err(e) => return Err(e),
            }
        }
        Err(LockError::Unavailable("could not obtain a marker lease".into()))
    }
}
