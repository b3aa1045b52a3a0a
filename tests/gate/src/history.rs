//! What a gate run records: client operations, the store's revision-ordered
//! history (an etcd watch with previous values), the writes the fenced store
//! accepted, and the fault schedule. Everything is plain serde data so a failing
//! history can be written out and checked again.

use serde::{Deserialize, Serialize};

/// Microseconds since the unix epoch on the machine's real clock: one time line
/// for the gate, its recorder and its holders, also in a holder whose clock the
/// gate steps (a raw `clock_gettime` system call, which libfaketime, interposing
/// the libc function, does not see).
pub fn now_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime(2) writes one timespec through the valid pointer it
    // is given and has no other precondition.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::syscall(libc::SYS_clock_gettime, libc::CLOCK_REALTIME, &raw mut ts) };
    if rc != 0 {
        return process_now_us();
    }
    let us = i128::from(ts.tv_sec) * 1_000_000 + i128::from(ts.tv_nsec) / 1000;
    u64::try_from(us).unwrap_or(0)
}

/// Microseconds since the unix epoch on this process's own clock (`SystemTime`:
/// stepped under libfaketime).
pub(crate) fn process_now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// How far this process's wall clock is from the real one, ms (0 unless stepped).
pub(crate) fn clock_skew_ms() -> i64 {
    let own = i128::from(process_now_us());
    let real = i128::from(now_us());
    i64::try_from((own - real) / 1000).unwrap_or(0)
}

/// The outcome of one client operation. An unknown outcome stays unknown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The service (or store) answered success.
    Ok,
    /// It answered a refusal: nothing happened.
    Fail,
    /// No answer (timeout, connection lost, 5xx from Envoy without a code).
    #[default]
    Unknown,
}

/// One client operation with its call and return times.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientOp {
    /// The holder process (`h0`, `s1`, ...).
    pub process: String,
    /// `acquire`, `write`, `keepalive`, `release` or `close` (a campaigner's
    /// `campaign` and `resign` are an acquire and a release); an SDK holder also
    /// records `valid` (its claim, [`ClientOp::valid_until_us`]) and `fenced` (its
    /// fence callback ran for the session of `token`'s hold).
    pub op: String,
    /// The lock key.
    pub key: String,
    /// The token the op carried (write, release) or received (acquire).
    pub token: Option<u64>,
    /// Call time, unix µs.
    pub call_us: u64,
    /// Return time, unix µs.
    pub ret_us: u64,
    pub outcome: Outcome,
    /// HTTP status (0 without an answer) and error code, for reading.
    pub status: u16,
    /// `x-lockmesh-error` code, if any.
    pub code: Option<String>,
    /// How far the process's own wall clock was from the real one at the call,
    /// ms (non-zero while the gate steps its clock, [`super::clock`]).
    #[serde(default)]
    pub skew_ms: i64,
    /// An SDK holder's claim (`op: "valid"`, made at `call_us` under the hold of
    /// `token`): the SDK's fence deadline, on the real time line, unix µs. The SDK
    /// promises the hold lasts at least until then unless its holder releases it
    /// (`sdk_deadline_conservative`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub valid_until_us: Option<u64>,
    /// The session the op named (`x-lock-session`, 16 hex digits), when the
    /// checker compares it: a campaign's (`leader_on_own_session`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The session TTL an acquire that opened its own session was answered
    /// (`ttl_s`), ms: its holder keeps the SDK's margin, so its hold is its own
    /// from the answer until the call time + this TTL − [`SDK_MARGIN_US`] or its
    /// release, whichever is first (`advisory_intervals_within_limit`). `None`
    /// for every other op (an acquire on a session opened earlier, a renewal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// The slots a grant holds (`permits` of the answer: `x-lock-permits`, all N
    /// of an exclusive hold), when the answer said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
    /// One key of a multi-key acquire (`/v1/locks/acquire-all`, one op per key,
    /// all with the grant's one token): it may wait while this key is free.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub multi: bool,
}

/// The SDK's default margin (`lockmesh_client::Config::margin`, 1 s), µs: a
/// holder that keeps it treats its hold as its own until its session's send
/// time + TTL − this margin.
pub const SDK_MARGIN_US: u64 = 1_000_000;

impl ClientOp {
    /// An op that asks for a grant: an `acquire`, or a `campaign` (an acquire of
    /// an election's key).
    pub fn asks_grant(&self) -> bool {
        self.op == "acquire" || self.op == "campaign"
    }

    /// An op that ends a grant by its token: a `release`, or a `resign`.
    pub fn ends_grant(&self) -> bool {
        self.op == "release" || self.op == "resign"
    }
}

/// The name of the coord cluster (the arbiters' `etcd:`), whose history is
/// [`History::segments`].
pub(crate) const COORD: &str = "coord";

/// One event of the etcd watch on the run's root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdEvent {
    /// Revision at which it committed (several events share one transaction's).
    pub revision: i64,
    /// `true` for a put, `false` for a delete.
    pub put: bool,
    /// The etcd key.
    pub key: String,
    /// The new value (put), as text.
    pub value: String,
    /// The key's create revision after a put.
    pub create_revision: i64,
    /// The lease of the put.
    pub lease: i64,
    /// The previous value, if any (prev_kv).
    pub prev_value: Option<String>,
    /// The previous create revision, if any.
    pub prev_create_revision: Option<i64>,
    /// When the recorder received it, unix µs (after the commit).
    pub observed_us: u64,
}

/// The store history between two restores.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// The snapshot revision this segment was restored from (0 for the first).
    pub base_revision: i64,
    /// The restore's `--bump-revision` (0: none): the segment's revisions start
    /// above `base_revision + bump`, its state is the snapshot's.
    #[serde(default)]
    pub bump: i64,
    /// Events in revision order, all above `base_revision`.
    pub events: Vec<EtcdEvent>,
}

/// A write the fenced store received (accepted by fence-proxy), in arrival order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreWrite {
    /// The resource path (`/items/<id>`).
    pub resource: String,
    /// The lock key guarding it.
    pub lock_key: String,
    /// The forwarded `x-lock-token`.
    pub token: u64,
    /// The body (`<process>:<token>`).
    pub body: String,
}

/// One request of a transparent holder as the upstream behind the inbound
/// sidecar saw it ([`super::upstream`]): the sidecar forwards a request only
/// once its key is granted, with the grant's token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamExec {
    /// The lock key the sidecar derived (`x-lock-key` as forwarded).
    pub key: String,
    /// The forwarded `x-lock-token` (`None`: absent or not a number).
    pub token: Option<u64>,
    /// The holder that sent it (the body's `<process>:` prefix).
    pub process: String,
    /// When it arrived at the upstream, unix µs.
    pub arrived_us: u64,
    /// When the upstream answered it, unix µs; `None` if it never answered (the
    /// request was reset first: the sidecar was killed, the caller gave up).
    pub left_us: Option<u64>,
}

/// One injected fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    /// Kind (`member_kill`, `quorum_loss`, `restore`, ...).
    pub kind: String,
    /// What exactly (which member, arbiter, holder).
    pub detail: String,
    /// Start, unix µs.
    pub start_us: u64,
    /// End (healed), unix µs.
    pub end_us: u64,
}

/// The store history of one more etcd cluster: an entity shard of a run with
/// shards ([`super::harness::GateOptions::shards`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterHistory {
    /// The cluster's name in the arbiters' `clusters:` (`shard-a`).
    pub name: String,
    /// Its segments, one per restore plus the first.
    pub segments: Vec<Segment>,
}

/// One shard move (`lockctl shard apply`) the run made.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    /// The lock-key namespace whose keys moved (every gate key is in `payments`).
    pub namespace: String,
    /// The cluster its keys left.
    pub from: String,
    /// The cluster they moved to.
    pub to: String,
    /// The shard map versions before and after.
    pub versions: (u64, u64),
    /// When `lockctl shard apply` was started, unix µs (no key had moved before).
    pub start_us: u64,
    /// When it reported the move applied, unix µs (every cluster resumed).
    pub end_us: u64,
}

/// Everything one gate run recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    /// The etcd key root of the run.
    pub root: String,
    /// Holder limit per lock-key prefix (`payments/gate/sem` → 3); others are 1.
    pub limits: Vec<(String, usize)>,
    /// The class of each lock-key prefix whose limit may change during the run:
    /// from the commit of its authoritative policy record (`<root>/c/<class>`,
    /// written by `lockctl limit change`) on, that record's limit replaces
    /// [`History::limits`].
    #[serde(default)]
    pub classes: Vec<(String, String)>,
    /// Lock-key prefixes of durable-fairness classes: their grants follow the
    /// waiter queue (`durable_order_kept`).
    #[serde(default)]
    pub durable: Vec<String>,
    /// Lock-key prefixes of classes with a lock-delay (`lock_delay_s`):
    /// `lock_delay_kept` holds their keys to it.
    #[serde(default)]
    pub delayed: Vec<String>,
    /// Lock-key prefixes of election classes: whatever the class's limit, never
    /// two leaderships of one key at once (`one_leader_per_term`).
    #[serde(default)]
    pub elections: Vec<String>,
    /// Store segments of the coord cluster (the only one without shards), one per
    /// restore plus the first.
    pub segments: Vec<Segment>,
    /// The other clusters' store histories (entity shards), if the run had any.
    #[serde(default)]
    pub shards: Vec<ClusterHistory>,
    /// The shard moves the run made.
    #[serde(default)]
    pub moves: Vec<Move>,
    /// Client operations (any order; the checker sorts).
    pub ops: Vec<ClientOp>,
    /// Writes the store received, in arrival order.
    pub writes: Vec<StoreWrite>,
    /// Requests of transparent holders that reached the upstream behind the
    /// inbound sidecar, in arrival order (`transparent_*` checks).
    #[serde(default)]
    pub upstream: Vec<UpstreamExec>,
    /// Quota'd namespaces: (namespace, the most live hold slots its quotas allow
    /// at once outside fault windows, the documented overshoot included;
    /// `quota_holds_bounded`).
    #[serde(default)]
    pub quotas: Vec<(String, usize)>,
    /// Lock-key prefixes of fail-open classes (`on_quorum_loss: open`): their
    /// token-0 answers are unprotected grants (`checker::open`, `checker::ops`).
    #[serde(default)]
    pub open: Vec<String>,
    /// Lock-key prefixes of classes with a candidate (shadow) policy: the
    /// enforced limit alone decides (`candidate_never_decides`).
    #[serde(default)]
    pub shadow: Vec<String>,
    /// The fault schedule as executed.
    pub faults: Vec<Fault>,
    /// Quorum-loss windows, unix µs (start, end): no member majority ran.
    pub quorum_loss: Vec<(u64, u64)>,
    /// Set when the recorder could not follow the store (a gap): the run fails.
    pub gaps: Vec<String>,
}

/// A hold record as the arbiter stores it (the fields the checker needs).
#[derive(Debug, Clone, Deserialize)]
pub struct HoldValue {
    /// The lock key.
    pub key: String,
    /// The epoch of the grant.
    pub epoch: u64,
    /// A read-write hold's mode (`shared`, `exclusive`), if its acquire named one.
    #[serde(default)]
    pub mode: Option<String>,
}

/// A release marker (`<root>/r/<digest>`, `lockmesh_keyspace::ReleaseMarker`).
#[derive(Debug, Clone, Deserialize)]
pub struct MarkerValue {
    /// The released grant's epoch; absent in a transparent (filter VM) release's
    /// marker, which names the hold by its revision alone.
    #[serde(default)]
    pub epoch: Option<u64>,
    /// The released grant's revision.
    pub revision: i64,
    /// Whether the filter released it at the end of a transparent request.
    #[serde(default)]
    pub transparent: bool,
}

/// The epoch record (`<root>/sys/epoch`).
#[derive(Debug, Clone, Deserialize)]
pub struct EpochValue {
    pub epoch: u64,
    /// Explicit seal of an advance in progress.
    #[serde(default)]
    pub sealed: Option<String>,
}

// === impl History ===

impl History {
    /// The holder limit of `key` (longest matching prefix on `/` boundaries; 1 if none).
    pub(crate) fn limit_of(&self, key: &str) -> usize {
        longest(&self.limits, key).map_or(1, |n| *n)
    }

    /// The class [`History::classes`] gives `key` (longest matching prefix).
    pub(crate) fn class_of(&self, key: &str) -> Option<&str> {
        longest(&self.classes, key).map(String::as_str)
    }

    /// Whether `key` is of a durable-fairness class.
    pub(crate) fn is_durable(&self, key: &str) -> bool {
        self.durable.iter().any(|p| covers(p, key))
    }

    /// Whether `key` is an election's ([`History::elections`]).
    pub(crate) fn is_election(&self, key: &str) -> bool {
        self.elections.iter().any(|p| covers(p, key))
    }

    /// Whether `key` is of a class with a candidate policy ([`History::shadow`]).
    pub(crate) fn is_shadow(&self, key: &str) -> bool {
        self.shadow.iter().any(|p| covers(p, key))
    }

    /// Whether `key`'s class has a lock-delay ([`History::delayed`]).
    pub(crate) fn is_delayed(&self, key: &str) -> bool {
        self.delayed.iter().any(|p| covers(p, key))
    }

    /// Every cluster's store history, the coord cluster ([`COORD`]) first, then
    /// each shard in recording order.
    pub fn clusters(&self) -> Vec<(&str, &[Segment])> {
        std::iter::once((COORD, self.segments.as_slice()))
            .chain(self.shards.iter().map(|c| (c.name.as_str(), c.segments.as_slice())))
            .collect()
    }

    /// Every store segment with its cluster, in [`History::clusters`] order: the
    /// index into this list is a violation's `segment`.
    pub(crate) fn store_segments(&self) -> Vec<(&str, &Segment)> {
        self.clusters().into_iter().flat_map(|(c, segs)| segs.iter().map(move |s| (c, s))).collect()
    }

    /// The cluster of every committed grant: (lock key, token) → cluster name.
    pub fn grant_homes(&self) -> std::collections::HashMap<(String, u64), String> {
        let mut out = std::collections::HashMap::new();
        let holds = format!("{}/l/", self.root);
        for (cluster, segment) in self.store_segments() {
            for e in segment.events.iter().filter(|e| e.put && e.prev_value.is_none() && e.key.starts_with(&holds)) {
                if let Ok(hv) = serde_json::from_str::<HoldValue>(&e.value) {
                    out.insert((hv.key, token_of(hv.epoch, e.create_revision)), cluster.to_owned());
                }
            }
        }
        out
    }

    /// The keys `m` really moved: each was handed a grant on `m.from` whose
    /// answer came before the move started and one on `m.to` asked for after it
    /// ended (so a rebalance history cannot pass without a key changing home
    /// under its holders).
    pub fn keys_granted_across(&self, m: &Move) -> Vec<String> {
        let homes = self.grant_homes();
        let home = |o: &ClientOp| o.token.and_then(|t| homes.get(&(o.key.clone(), t))).map(String::as_str);
        let acquired = || self.ops.iter().filter(|o| o.op == "acquire" && o.outcome == Outcome::Ok);
        let before: std::collections::BTreeSet<&str> = acquired()
            .filter(|o| o.ret_us < m.start_us && home(o) == Some(m.from.as_str()))
            .map(|o| o.key.as_str())
            .collect();
        let after: std::collections::BTreeSet<&str> = acquired()
            .filter(|o| o.call_us > m.end_us && home(o) == Some(m.to.as_str()))
            .map(|o| o.key.as_str())
            .collect();
        before.intersection(&after).map(|k| (*k).to_owned()).collect()
    }

    /// Counts of faults by kind, sorted by kind.
    pub fn faults_by_kind(&self) -> Vec<(String, usize)> {
        let mut m = std::collections::BTreeMap::<String, usize>::new();
        for f in &self.faults {
            *m.entry(f.kind.clone()).or_default() += 1;
        }
        m.into_iter().collect()
    }
}

/// Whether lock-key prefix `p` covers `key` (on a `/` boundary).
fn covers(p: &str, key: &str) -> bool {
    key == p || key.strip_prefix(p).is_some_and(|r| r.starts_with('/'))
}

/// The value of the longest prefix in `table` that covers `key`.
fn longest<'a, T>(table: &'a [(String, T)], key: &str) -> Option<&'a T> {
    table.iter().filter(|(p, _)| covers(p, key)).max_by_key(|(p, _)| p.len()).map(|(_, v)| v)
}

/// The epoch×2^48 + revision token of a grant.
pub(crate) fn token_of(epoch: u64, revision: i64) -> u64 {
    (epoch << 48) | (u64::try_from(revision).unwrap_or(0) & ((1 << 48) - 1))
}
