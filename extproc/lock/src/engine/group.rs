//! Grants and releases committed in groups: one etcd transaction of nested
//! transactions, one raft proposal and one fsync for all of them
//! (docs/DECISIONS.md, ADR-34).
//!
//! Per cluster, a [`Committer`] takes the members that arrive while its previous
//! group is in flight and sends them as one transaction. Each member is the
//! transaction it would have sent alone, less the epoch compare and the grant
//! clock, which the group makes once at the outer level; it keeps its own
//! compares and its own outcome. The rules that keep a group safe:
//!
//! - **One operation per lock key per group**, in arrival order: a member that
//!   names a key an earlier member of the group names, or an earlier member left
//!   waiting names, waits for a later group. Nested compares see the store before
//!   the whole transaction, so two members of one key would both see it free.
//! - **The epoch and the clock at the outer level.** A group commits only in the
//!   epoch and above the clock mark its members were built against; a restore or
//!   a new epoch refuses the whole group, and each member is sent alone, where its
//!   own compares read the refusal and seal or retry as a lone grant does.
//! - **Nothing outside a member fails the group.** A grant's puts on its session
//!   lease are guarded by its compare of the session record's lease (a dead lease
//!   fails that compare first: etcd then commits the others). Anything etcd
//!   refuses before applying (a lease it no longer knows, a duplicate key, too
//!   many operations, too large) refuses the group as a whole: nothing was
//!   applied, each member is sent alone and the refusal is counted by cause.
//! - **Within etcd's limits** ([`Limits`]): the outer list (members and the
//!   clock put) plus the longest list of any member plus the level of a
//!   member's own nested transaction within `--max-txn-ops`, the group's size within
//!   `--max-request-bytes`. A member that arrives when nothing is in flight goes
//!   at once, with no timer.
//! - **An unknown outcome is each member's to resolve.** A group etcd did not
//!   answer may have committed: every member hears "did not answer" and resolves
//!   its own outcome as a lone grant does (the attempt fence), never guessed.
//!
//! Members of one group commit at one revision, so their tokens are equal across
//! keys and still unique and rising per key (ADR-02).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, TxnOpResponse, TxnResponse};
use lockmesh_keyspace::Keys;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::test_faults::{self, TestFault};

/// The largest group and etcd's limits on one transaction, as configured
/// (`etcd.max_group`, `etcd.max_txn_ops`, `etcd.max_request_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Members per group; 1 sends every transaction alone (no committer).
    pub max_group: usize,
    /// Groups in flight at once (a member whose key is in flight waits for its
    /// group's answer).
    pub in_flight: usize,
    /// etcd's `--max-txn-ops` (default 128).
    pub max_txn_ops: usize,
    /// etcd's `--max-request-bytes` (default 1.5 MiB).
    pub max_request_bytes: usize,
}

impl Limits {
    /// One transaction per grant and release.
    pub const ALONE: Limits = Limits { max_group: 1, in_flight: 2, max_txn_ops: 128, max_request_bytes: 1_572_864 };
}

impl Default for Limits {
    fn default() -> Self {
        Self::ALONE
    }
}

/// What a member's group must hold at the outer level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Outer {
    /// The epoch record's mod revision (`None`: the member compares none; a
    /// release).
    pub epoch_rev: Option<i64>,
    /// The grant clock's mark (`engine::clock`).
    pub clock: Option<i64>,
}

/// One member: the transaction it would send alone, less the outer compares.
pub(crate) struct Member {
    /// The lock keys it acts on (one operation per key per group).
    pub keys: Vec<Vec<u8>>,
    pub txn: Txn,
    /// The longest of its compare, success and failure lists, plus
    /// [`NESTED_LEVEL`].
    pub longest: usize,
    /// Its size in the group's request ([`member_len`]).
    pub bytes: usize,
    pub outer: Outer,
}

impl Member {
    /// A member of `txn` built by `b`'s lengths.
    pub(crate) fn new(keys: Vec<Vec<u8>>, lengths: (usize, usize, usize), txn: Txn, outer: Outer) -> Self {
        let bytes = member_len(&txn);
        Self { keys, txn, longest: lengths.0.max(lengths.1).max(lengths.2) + NESTED_LEVEL, bytes, outer }
    }
}

/// The level a member's own nested transaction needs: a hold's end deletes its
/// exclusion record under a compare of its create revision (`mutex::end_ops`:
/// one compare, one delete). etcd checks each nested transaction against what
/// the levels above it leave of `--max-txn-ops` (the outer list, then its
/// member's longest list), so every member counts one more.
const NESTED_LEVEL: usize = 1;

/// What became of a member.
pub(crate) enum Grouped {
    /// Its group committed: its own nested answer, and the group's header.
    Answered { nested: TxnResponse, header: Header },
    /// Its group did not run as one (refused before applying, or the outer
    /// compares failed): send it alone.
    Alone,
    /// etcd did not answer the group (it may have committed): the text to
    /// answer `unavailable` with, which reads as an unknown outcome.
    Unknown(String),
}

/// The header of a group's answer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Header {
    pub revision: i64,
    pub cluster_id: u64,
    pub raft_term: u64,
}

/// The causes a group is refused for, as counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The outer compares failed (a new epoch, a restored store).
    Moved,
    /// `duplicate key given in txn request`.
    DuplicateKey,
    /// `requested lease not found`.
    LeaseNotFound,
    /// `too many operations in txn request`.
    TooManyOps,
    /// `request is too large`.
    TooLarge,
    /// Anything else etcd refused before applying.
    Other,
}

impl Refusal {
    pub const ALL: [Refusal; 6] = [
        Refusal::Moved,
        Refusal::DuplicateKey,
        Refusal::LeaseNotFound,
        Refusal::TooManyOps,
        Refusal::TooLarge,
        Refusal::Other,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Moved => "moved",
            Refusal::DuplicateKey => "duplicate_key",
            Refusal::LeaseNotFound => "lease_not_found",
            Refusal::TooManyOps => "too_many_ops",
            Refusal::TooLarge => "too_large",
            Refusal::Other => "other",
        }
    }

    fn of(text: &str) -> Self {
        if text.contains("duplicate key") {
            Refusal::DuplicateKey
        } else if text.contains("lease not found") {
            Refusal::LeaseNotFound
        } else if text.contains("too many operations") {
            Refusal::TooManyOps
        } else if text.contains("too large") {
            Refusal::TooLarge
        } else {
            Refusal::Other
        }
    }
}

/// Groups sent, members they carried, time members waited for a group, and
/// groups refused by cause, since the process started.
#[derive(Debug)]
pub struct GroupStats {
    groups: AtomicU64,
    members: AtomicU64,
    queued_nanos: AtomicU64,
    largest: AtomicU64,
    refused: [AtomicU64; 6],
}

/// This process's group counters (`lockmesh_arbiter_group_*`).
pub static GROUPS: GroupStats = GroupStats {
    groups: AtomicU64::new(0),
    members: AtomicU64::new(0),
    queued_nanos: AtomicU64::new(0),
    largest: AtomicU64::new(0),
    refused: [const { AtomicU64::new(0) }; 6],
};

impl GroupStats {
    /// Groups sent.
    pub fn groups(&self) -> u64 {
        self.groups.load(Relaxed)
    }
    /// Members the groups carried.
    pub fn members(&self) -> u64 {
        self.members.load(Relaxed)
    }
    /// Total seconds members waited before their group was sent.
    pub fn queued_seconds(&self) -> f64 {
        self.queued_nanos.load(Relaxed) as f64 / 1e9
    }
    /// The largest group sent.
    pub fn largest(&self) -> u64 {
        self.largest.load(Relaxed)
    }
    /// Groups refused for `cause`.
    pub fn refused(&self, cause: Refusal) -> u64 {
        self.refused[cause as usize].load(Relaxed)
    }
}

struct Waiting {
    member: Member,
    since: Instant,
    tx: oneshot::Sender<Grouped>,
}

#[derive(Default)]
struct State {
    limits: Limits,
    waiting: Vec<Waiting>,
    /// Groups in flight.
    flying: usize,
    /// The lock keys of the groups in flight.
    in_flight: HashSet<Vec<u8>>,
}

/// The group committer of one etcd cluster.
pub(crate) struct Committer {
    client: Client,
    keys: Keys,
    op_timeout: Duration,
    state: Mutex<State>,
}

impl Committer {
    pub(crate) fn new(client: Client, keys: Keys, op_timeout: Duration) -> Self {
        Self { client, keys, op_timeout, state: Mutex::default() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn set_limits(&self, limits: Limits) {
        self.state().limits = limits;
    }

    /// Whether members are grouped at all (`max_group` above 1).
    pub(crate) fn enabled(&self) -> bool {
        self.state().limits.max_group > 1
    }

    /// Queues `member` and waits for what became of it.
    pub(crate) async fn submit(self: &Arc<Self>, member: Member) -> Grouped {
        let (tx, rx) = oneshot::channel();
        self.state().waiting.push(Waiting { member, since: Instant::now(), tx });
        self.pump();
        rx.await.unwrap_or_else(|_| Grouped::Unknown("etcd did not answer within the group committer".into()))
    }

    /// Sends the groups that can go: while fewer than `in_flight` are in flight
    /// and a member waits whose keys are not. Each goes in its own task, so a
    /// caller that leaves never strands a group.
    fn pump(self: &Arc<Self>) {
        let mut s = self.state();
        while s.flying < s.limits.in_flight.max(1) {
            let limits = s.limits;
            let st = &mut *s;
            let group = take_group(&mut st.waiting, &limits, &st.in_flight);
            if group.is_empty() {
                return;
            }
            let keys: Vec<Vec<u8>> = group.iter().flat_map(|w| w.member.keys.iter().cloned()).collect();
            s.in_flight.extend(keys.iter().cloned());
            s.flying += 1;
            let landing = Landing { committer: self.clone(), keys };
            tokio::spawn(async move {
                landing.committer.send(group).await;
                drop(landing);
            });
        }
    }

    async fn send(&self, group: Vec<Waiting>) {
        let k = &self.keys;
        let now = Instant::now();
        let n = group.len();
        // The group's size by etcd's two limits, for a refusal's log line.
        let longest = group.iter().map(|w| w.member.longest).max().unwrap_or(0);
        let bytes: usize = group.iter().map(|w| w.member.bytes).sum();
        GROUPS.groups.fetch_add(1, Relaxed);
        GROUPS.members.fetch_add(n as u64, Relaxed);
        GROUPS.largest.fetch_max(n as u64, Relaxed);
        let queued: u128 = group.iter().map(|w| now.duration_since(w.since).as_nanos()).sum();
        GROUPS.queued_nanos.fetch_add(u64::try_from(queued).unwrap_or(u64::MAX), Relaxed);
        let first = group[0].member.outer;
        let epoch_rev = group.iter().find_map(|w| w.member.outer.epoch_rev);
        let clock = group.iter().filter_map(|w| w.member.outer.clock).max();
        let mut when = Vec::new();
        let mut then = Vec::with_capacity(n + 1);
        if let Some(rev) = epoch_rev {
            when.push(Compare::mod_revision(k.epoch(), CompareOp::Equal, rev));
        }
        if let (Some(mark), true) = (clock, first.clock.is_some()) {
            when.push(Compare::mod_revision(k.clock(), CompareOp::Greater, mark - 1));
            then.push(TxnOp::put(k.clock(), Vec::<u8>::new(), None));
        }
        let offset = then.len();
        let mut txs = Vec::with_capacity(n);
        for w in group {
            then.push(TxnOp::txn(w.member.txn));
            txs.push(w.tx);
        }
        let txn = Txn::new().when(when).and_then(then);
        let answer = tokio::time::timeout(self.op_timeout, self.client.clone().txn(txn)).await;
        let r = match answer {
            Err(_) => return answer_all(txs, || unknown(format!("{:?}", self.op_timeout))),
            Ok(Err(e)) => {
                let text = e.to_string();
                if super::super::mutex::outcome_unknown(&crate::unavailable(e)) {
                    return answer_all(txs, || Grouped::Unknown(text.clone()));
                }
                let cause = Refusal::of(&text);
                GROUPS.refused[cause as usize].fetch_add(1, Relaxed);
                tracing::warn!(
                    members = n,
                    longest,
                    bytes,
                    cause = cause.label(),
                    error = %text,
                    "etcd refused a group before applying it; each member goes alone"
                );
                return answer_all(txs, || Grouped::Alone);
            }
            Ok(Ok(r)) => r,
        };
        if test_faults::on(TestFault::GroupAnswerLost) {
            // PLANTED (group scenarios): the group committed and its answer is
            // lost, as when etcd's answer misses the deadline.
            return answer_all(txs, || unknown("the planted group answer loss".into()));
        }
        if !r.succeeded() {
            GROUPS.refused[Refusal::Moved as usize].fetch_add(1, Relaxed);
            return answer_all(txs, || Grouped::Alone);
        }
        let header = r.header().map_or(Header { revision: 0, cluster_id: 0, raft_term: 0 }, |h| Header {
            revision: h.revision(),
            cluster_id: h.cluster_id(),
            raft_term: h.raft_term(),
        });
        let mut answers = r.op_responses().into_iter().skip(offset);
        for tx in txs {
            let out = match answers.next() {
                Some(TxnOpResponse::Txn(nested)) => Grouped::Answered { nested, header },
                // etcd answers every nested transaction; one missing is not a
                // refusal anyone may read: its outcome is unknown.
                _ => unknown("an answer without the member's nested transaction".into()),
            };
            let _ = tx.send(out);
        }
    }
}

/// A group in flight: when its task ends (answered, or unwound: its members'
/// senders drop and they hear an unknown outcome), its keys are free again and
/// the next groups go.
struct Landing {
    committer: Arc<Committer>,
    keys: Vec<Vec<u8>>,
}

impl Drop for Landing {
    fn drop(&mut self) {
        {
            let mut s = self.committer.state();
            for k in &self.keys {
                s.in_flight.remove(k);
            }
            s.flying = s.flying.saturating_sub(1);
        }
        self.committer.pump();
    }
}

fn unknown(what: String) -> Grouped {
    Grouped::Unknown(format!("etcd did not answer within {what} (a group)"))
}

fn answer_all(txs: Vec<oneshot::Sender<Grouped>>, out: impl Fn() -> Grouped) {
    for tx in txs {
        let _ = tx.send(out());
    }
}

/// Takes the next group out of `waiting`, in arrival order: members of one
/// outer shape as the first that joins, one per lock key and none of a key in
/// flight, within `limits`. A member left waiting blocks its keys for the rest
/// of this group, so operations on one key keep their order.
fn take_group(waiting: &mut Vec<Waiting>, limits: &Limits, flying: &HashSet<Vec<u8>>) -> Vec<Waiting> {
    let (mut keys, mut blocked) = (HashSet::new(), HashSet::new());
    let (mut count, mut longest, mut bytes) = (0usize, 0usize, 0usize);
    let mut shape: Option<Outer> = None;
    let mut epoch_rev = None;
    let mut take = Vec::with_capacity(waiting.len());
    let budget = limits.max_request_bytes.saturating_sub(OUTER_BYTES);
    // PLANTED BUG (group scenarios): two operations of one key in a group.
    let same_key = test_faults::on(TestFault::GroupSameKey);
    for w in waiting.iter() {
        let m = &w.member;
        let free =
            m.keys.iter().all(|k| !flying.contains(k) && (same_key || !blocked.contains(k) && !keys.contains(k)));
        let joins = free
            && match shape {
                // The first to join goes whatever its shape and size.
                None => true,
                Some(first) => {
                    m.outer.clock.is_some() == first.clock.is_some()
                        && (m.outer.epoch_rev.is_none() || epoch_rev.is_none() || m.outer.epoch_rev == epoch_rev)
                        && count < limits.max_group
                        && (count + 2) + longest.max(m.longest) <= limits.max_txn_ops
                        && bytes + m.bytes <= budget
                }
            };
        take.push(joins);
        if joins {
            shape = shape.or(Some(m.outer));
            count += 1;
            longest = longest.max(m.longest);
            bytes += m.bytes;
            epoch_rev = epoch_rev.or(m.outer.epoch_rev);
            keys.extend(m.keys.iter().cloned());
        } else {
            blocked.extend(m.keys.iter().cloned());
        }
    }
    let mut group = Vec::with_capacity(count);
    for (w, joins) in std::mem::take(waiting).into_iter().zip(take) {
        if joins {
            group.push(w);
        } else {
            waiting.push(w);
        }
    }
    group
}

/// An upper bound of a transaction's size as a member of a group's request: its
/// `Debug` text, which spells every byte of a key or value as at least three
/// characters and every field and message by name (3 to 15 times the encoding;
/// etcd-client does not expose the request it encodes). Only a negative number
/// encodes longer than its text, and no transaction here holds one. No
/// allocation: the characters are only counted.
fn member_len(txn: &Txn) -> usize {
    struct Count(usize);
    impl std::fmt::Write for Count {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0 += s.len();
            Ok(())
        }
    }
    let mut c = Count(0);
    let _ = std::fmt::Write::write_fmt(&mut c, format_args!("{txn:?}"));
    c.0
}

/// What a group's request holds besides its members, at most: the outer
/// compares (epoch, clock), the clock put, and the raft request's header etcd
/// adds before it checks `--max-request-bytes` (the request id and the user
/// name, well under its 256 bytes), with room to spare.
pub(crate) const OUTER_BYTES: usize = 2048;

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::TxnOp;

    /// A waiting member (nobody listens to its answer: formation never sends one).
    fn waiting(keys: &[&str], outer: Outer, ops: usize) -> Waiting {
        let (tx, _) = oneshot::channel();
        let txn = Txn::new().and_then((0..ops).map(|i| TxnOp::put(format!("k{i}"), "v", None)).collect::<Vec<_>>());
        let member = Member::new(keys.iter().map(|k| k.as_bytes().to_vec()).collect(), (0, ops, 0), txn, outer);
        Waiting { member, since: Instant::now(), tx }
    }

    const AT5: Outer = Outer { epoch_rev: Some(5), clock: Some(9) };
    const RELEASE: Outer = Outer { epoch_rev: None, clock: Some(7) };

    fn keys_of(group: &[Waiting]) -> Vec<String> {
        group
            .iter()
            .map(|w| w.member.keys.iter().map(|k| String::from_utf8_lossy(k)).collect::<Vec<_>>().join("+"))
            .collect()
    }

    #[test]
    fn one_operation_per_key_and_a_skipped_key_blocks_its_later_operations() {
        let limits = Limits { max_group: 64, ..Limits::ALONE };
        let mut w: Vec<Waiting> = [&["a"][..], &["b"], &["a"], &["c", "a"], &["c"], &["d"]]
            .into_iter()
            .map(|keys| waiting(keys, AT5, 3))
            .collect();
        let g = take_group(&mut w, &limits, &HashSet::new());
        // The second `a` waits; `c+a` waits behind it, and so does the `c` after it.
        assert_eq!(keys_of(&g), ["a", "b", "d"]);
        assert_eq!(keys_of(&w), ["a", "c+a", "c"]);
        let g = take_group(&mut w, &limits, &HashSet::new());
        assert_eq!(keys_of(&g), ["a"]);
        let g = take_group(&mut w, &limits, &HashSet::new());
        assert_eq!(keys_of(&g), ["c+a"]);
        assert_eq!(keys_of(&take_group(&mut w, &limits, &HashSet::new())), ["c"]);
        assert!(take_group(&mut w, &limits, &HashSet::new()).is_empty());
    }

    #[test]
    fn a_key_in_flight_joins_no_group_and_holds_back_its_later_operations() {
        let limits = Limits { max_group: 64, ..Limits::ALONE };
        let mut w: Vec<Waiting> =
            ([&["a"][..], &["b"], &["b", "c"], &["c"]]).into_iter().map(|keys| waiting(keys, AT5, 3)).collect();
        let flying = HashSet::from([b"a".to_vec(), b"c".to_vec()]);
        assert_eq!(keys_of(&take_group(&mut w, &limits, &flying)), ["b"]);
        assert_eq!(keys_of(&w), ["a", "b+c", "c"]);
        assert_eq!(keys_of(&take_group(&mut w, &limits, &HashSet::new())), ["a", "b+c"]);
    }

    #[test]
    fn members_share_the_first_members_epoch_and_a_release_joins_any() {
        let limits = Limits { max_group: 64, ..Limits::ALONE };
        let other_epoch = Outer { epoch_rev: Some(6), clock: Some(9) };
        let no_clock = Outer { epoch_rev: Some(5), clock: None };
        let mut w: Vec<Waiting> = [("a", RELEASE), ("b", AT5), ("c", other_epoch), ("d", no_clock), ("e", RELEASE)]
            .into_iter()
            .map(|(k, o)| waiting(&[k], o, 3))
            .collect();
        let g = take_group(&mut w, &limits, &HashSet::new());
        assert_eq!(keys_of(&g), ["a", "b", "e"]);
        assert_eq!(keys_of(&take_group(&mut w, &limits, &HashSet::new())), ["c"]);
        assert_eq!(keys_of(&take_group(&mut w, &limits, &HashSet::new())), ["d"]);
    }

    #[test]
    fn a_group_stays_within_max_group_and_etcds_operation_limit() {
        let mut w: Vec<Waiting> = (0..200).map(|i| waiting(&[&format!("k{i}")], AT5, 20)).collect();
        assert_eq!(take_group(&mut w, &Limits { max_group: 8, ..Limits::ALONE }, &HashSet::new()).len(), 8);
        // etcd's rule: members plus the longest member's list (20) and its own
        // nested level, plus the clock put at the outer level, within
        // --max-txn-ops.
        let g = take_group(
            &mut w,
            &Limits { max_group: 1024, max_txn_ops: 128, max_request_bytes: 1 << 30, ..Limits::ALONE },
            &HashSet::new(),
        );
        assert_eq!(g.len(), 128 - 20 - 1 - 1);
        // A lone member goes even when it alone exceeds a limit (etcd answers).
        let g = take_group(
            &mut w,
            &Limits { max_group: 64, max_txn_ops: 10, max_request_bytes: 1 << 30, ..Limits::ALONE },
            &HashSet::new(),
        );
        assert_eq!(g.len(), 1);
    }

    #[test]
    fn a_group_stays_within_the_request_size() {
        let mut w: Vec<Waiting> = (0..64).map(|i| waiting(&[&format!("k{i}")], AT5, 20)).collect();
        let one = w[0].member.bytes;
        // Room for ten members beside the outer compares and the clock put.
        let limits = Limits {
            max_group: 64,
            max_txn_ops: 1024,
            max_request_bytes: OUTER_BYTES + 10 * one + one / 2,
            ..Limits::ALONE
        };
        let g = take_group(&mut w, &limits, &HashSet::new());
        assert_eq!(g.len(), 10, "members of {one} bytes");
    }
}
