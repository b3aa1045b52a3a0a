//! One etcd transaction, assembled by the concerns that take part in it, and
//! read back through the handles they were given, never by position.
//!
//! A concern (the epoch, a key's slots, the session, the grant clock, the policy
//! gate…) adds its compares, its writes for either branch and its reads; each
//! read returns a [`Read`] naming the branch and the place it landed. etcd
//! answers a transaction with one response per operation of the branch that ran,
//! in order, so [`Answer::get`] is the one place that indexes a response list:
//! no decoder counts the reads another concern pushed before its own.

use etcd_client::{Compare, GetOptions, GetResponse, Txn, TxnOp, TxnOpResponse, TxnResponse};

pub(crate) use super::group::Header;

/// Which branch of a transaction an operation runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Branch {
    /// Every compare held (`then`).
    Success,
    /// A compare failed (`else`).
    Failure,
}

/// A read placed in one branch; only [`Answer::get`] turns it into its response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a read nobody looks at is a wasted operation"]
pub(crate) struct Read {
    branch: Branch,
    at: usize,
}

/// A transaction being built: compares, then the two branches' operations, each
/// list in the order the concerns added to it.
#[derive(Default)]
pub(crate) struct TxnBuilder {
    when: Vec<Compare>,
    then: Vec<TxnOp>,
    els: Vec<TxnOp>,
}

impl TxnBuilder {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// One compare.
    pub(crate) fn compare(&mut self, c: Compare) {
        self.when.push(c);
    }

    /// Several compares, in order.
    pub(crate) fn compares(&mut self, cs: impl IntoIterator<Item = Compare>) {
        self.when.extend(cs);
    }

    /// A write (or a nested transaction) run when every compare held.
    pub(crate) fn on_success(&mut self, op: TxnOp) {
        self.then.push(op);
    }

    /// Writes run when every compare held, in order.
    pub(crate) fn on_success_all(&mut self, ops: impl IntoIterator<Item = TxnOp>) {
        self.then.extend(ops);
    }

    /// A write run when a compare failed.
    pub(crate) fn on_failure(&mut self, op: TxnOp) {
        self.els.push(op);
    }

    /// A read of `key` in `branch`.
    pub(crate) fn read(&mut self, branch: Branch, key: impl Into<Vec<u8>>, opts: Option<GetOptions>) -> Read {
        let list = match branch {
            Branch::Success => &mut self.then,
            Branch::Failure => &mut self.els,
        };
        list.push(TxnOp::get(key, opts));
        Read { branch, at: list.len() - 1 }
    }

    /// The lengths of the compare list and of the two branches (etcd's
    /// `--max-txn-ops` bounds each).
    pub(crate) fn lengths(&self) -> (usize, usize, usize) {
        (self.when.len(), self.then.len(), self.els.len())
    }

    /// Each list's operations as their `Debug` text (compares, success,
    /// failure), for tests that compare what two builds hold.
    #[cfg(test)]
    pub(crate) fn debug_lists(&self) -> [Vec<String>; 3] {
        [
            self.when.iter().map(|c| format!("{c:?}")).collect(),
            self.then.iter().map(|o| format!("{o:?}")).collect(),
            self.els.iter().map(|o| format!("{o:?}")).collect(),
        ]
    }

    /// The transaction.
    pub(crate) fn build(self) -> Txn {
        Txn::new().when(self.when).and_then(self.then).or_else(self.els)
    }
}

/// A transaction's answer, read through [`Read`] handles.
pub(crate) struct Answer {
    succeeded: bool,
    header: Option<Header>,
    ops: Vec<TxnOpResponse>,
}

impl Answer {
    pub(crate) fn of(r: &TxnResponse) -> Self {
        let header =
            r.header().map(|h| Header { revision: h.revision(), cluster_id: h.cluster_id(), raft_term: h.raft_term() });
        Self { succeeded: r.succeeded(), header, ops: r.op_responses() }
    }

    /// The answer of a member of a group (`engine::group`): its own outcome and
    /// reads, under the group's header.
    pub(crate) fn member(nested: &TxnResponse, header: Header) -> Self {
        Self { succeeded: nested.succeeded(), header: Some(header), ops: nested.op_responses() }
    }

    /// PLANTED BUG (group scenarios): the answer read as a success.
    pub(crate) fn planted_success(&mut self) {
        self.succeeded = true;
    }

    /// The store's revision when etcd answered (the commit's, on a success).
    pub(crate) fn revision(&self) -> Option<i64> {
        self.header.map(|h| h.revision)
    }

    /// The answer's header: revision, cluster and raft term.
    pub(crate) fn header(&self) -> Option<Header> {
        self.header
    }

    /// Whether the success branch ran.
    pub(crate) fn succeeded(&self) -> bool {
        self.succeeded
    }

    /// What read `r` found; `None` when its branch did not run (or etcd's answer
    /// lacks it, which a caller treats as an internal error).
    pub(crate) fn get(&self, r: Read) -> Option<&GetResponse> {
        let ran = if self.succeeded { Branch::Success } else { Branch::Failure };
        if r.branch != ran {
            return None;
        }
        match self.ops.get(r.at)? {
            TxnOpResponse::Get(g) => Some(g),
            _ => None,
        }
    }

    /// Read `r`, which the branch that ran must carry.
    pub(crate) fn must(&self, r: Read) -> Result<&GetResponse, crate::LockError> {
        self.get(r).ok_or_else(|| crate::LockError::Internal("etcd transaction answer without an expected read".into()))
    }
}

/// Whether read `g` found a key.
pub(crate) fn found(g: Option<&GetResponse>) -> bool {
    g.is_some_and(|g| !g.kvs().is_empty())
}

/// The mod revision of the first key read `g` found, 0 when none.
pub(crate) fn mod_revision(g: Option<&GetResponse>) -> i64 {
    g.and_then(|g| g.kvs().first()).map_or(0, etcd_client::KeyValue::mod_revision)
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::CompareOp;

    #[test]
    fn reads_are_numbered_per_branch_in_the_order_added() {
        let mut b = TxnBuilder::new();
        b.compare(Compare::version("a", CompareOp::Equal, 0));
        b.on_success(TxnOp::put("a", "1", None));
        let s = b.read(Branch::Success, "a", None);
        b.on_failure(TxnOp::put("b", "1", None));
        let f1 = b.read(Branch::Failure, "a", None);
        let f2 = b.read(Branch::Failure, "b", None);
        assert_eq!(s, Read { branch: Branch::Success, at: 1 });
        assert_eq!((f1.at, f2.at), (1, 2));
        assert_eq!(b.lengths(), (1, 2, 3));
        let want = Txn::new()
            .when([Compare::version("a", CompareOp::Equal, 0)])
            .and_then([TxnOp::put("a", "1", None), TxnOp::get("a", None)])
            .or_else([TxnOp::put("b", "1", None), TxnOp::get("a", None), TxnOp::get("b", None)]);
        assert_eq!(format!("{:?}", b.build()), format!("{want:?}"));
    }
}
