//! The gate's checker: exact checks over the store's revision-ordered history,
//! and linking checks between client operations and that history.
//!
//! | check | over | property |
//! |---|---|---|
//! | `fence_monotonic` | store writes, arrival order | per resource, each accepted token is above every token accepted before (strict rule) |
//! | `fence_genuine` | store writes × etcd | each accepted token is a committed grant of the route's lock key |
//! | `holders_within_limit` | etcd, per segment | never more than N committed, unclosed holds of a key (N = 1 for a mutex; from its commit on, the limit of the class's authoritative policy record) |
//! | `writer_alone` | etcd | a read-write lock's exclusive grant (hold record `mode: exclusive`) is never open beside another grant of its key, shared or exclusive (the grant's own slots are one grant) |
//! | `durable_order_kept` | etcd | a grant of a durable-fairness key commits only with no older waiter key queued: the oldest waiter's grant (deleting its own waiter key), or an arrival while none waits |
//! | `lock_delay_kept` | etcd | a key of a class with a lock-delay is granted neither while its lock-delay record exists nor after a hold a client was answered with ended by an expiry or a force release with no lock-delay record since |
//! | `restore_serves_new_epoch` | etcd × client acquires | after a restore (bumped or not), no grant handed to a client carries an epoch that a grant before it carried: the restore is sealed until its epoch advance |
//! | `grant_epoch_current` | etcd | a grant carries the epoch the epoch record holds at its commit, and no grant commits while the record carries an advance's seal |
//! | `release_frees_only_its_grant` | etcd | a release transaction deletes exactly the grant its marker names, never a successor |
//! | `deleted_hold_accounted` | etcd × client acquires | every deleted hold was released by its own holder (a marker naming it), expired or closed with its session (its session record deleted in the same revision), force-released on the record (`<root>/f/<digest>` in the same revision) or purged by an epoch advance; the one other delete allowed is an arbiter taking back a grant no client was answered with |
//! | `tokens_increase` | client acquires × etcd | tokens handed to clients are committed grants, handed to one holder per cluster and key (a multi-key grant hands its one token for each of its keys), and increase per key in grant order, across restores (a campaign is an acquire, a resign a release) |
//! | `one_leader_per_term` | etcd | an election key never has two leaderships open at once, whatever limit its class's policy record allows |
//! | `close_only_when_asked` | etcd × client ops | a hold handed to a client and ended by its session's close (close marker) was released or closed by that client first: a reused header-only session's close never takes a hold it did not see |
//! | `advisory_intervals_within_limit` | client acquires | for holders that keep the SDK's margin (an acquire that opened its session), the intervals from each answer to the earlier of its release call and its call time + TTL − margin never overlap beyond the key's limit (permits counted), per key and epoch |
//! | `no_waiter_on_a_free_key` | client acquires × etcd × faults | outside fault windows, no single-key acquire of a plain mutex key waits more than 3 s while the key, per the store's history, was free the whole time |
//! | `leader_on_own_session` | client campaigns × etcd | a campaign answered leadership holds it on the session it campaigned with, never on one it did not open (etcd's phantom leadership) |
//! | `release_of_open_grant` | client releases × etcd | a release that answered success named a grant still open when it was called |
//! | `quorum_loss_grants_nothing` | client ops × fault windows | no acquire or keepalive called in a quorum-loss window (after the grace) answered success |
//! | `transparent_forwarded_under_grant` | upstream requests × etcd | every request a transparent holder's sidecar forwarded carried a token of a committed grant of its key |
//! | `transparent_hold_spans_request` | upstream requests × etcd | a transparent hold is released (its marker) only after its request left the upstream |
//! | `transparent_renewed` | upstream requests × etcd × faults | a transparent hold's session does not end while its request is at the upstream unless a fault that can stop its renewal was in force (not: a partition of another cluster) |
//! | `quota_holds_bounded` | etcd × faults | outside fault windows, a quota'd namespace never has more live hold slots than its holds quota plus each arbiter's waiters share |
//! | `candidate_never_decides` | client acquires × etcd × faults | outside fault windows, no acquire of a key with a candidate (shadow) policy is refused `contended` while the key had fewer holds than its enforced limit |
//! | `unprotected_marked`, `unprotected_only_in_outage`, `unprotected_never_fenced` | client ops × faults × store writes | a fail-open class's token-0 answer says it is unprotected, comes only while a fault can have cut its arbiter from etcd's quorum, and no fence accepts token 0 |
//! | `sdk_deadline_conservative` | SDK claims × client acquires | an SDK holder's fence deadline never outlives its hold: no other grant of the mutex key (same epoch, greater token) is answered before both the deadline the SDK reported and its own release call |
//!
//! Why not a Porcupine search: every lock operation is an etcd transaction, so the
//! watch gives a total order of commits; client operations are linked to it by
//! token (a token is a commit revision), with unknown outcomes allowed either way.
//! The search a linearizability checker does is then unnecessary.
//!
//! A check that does not finish within its budget is a failure ([`Verdict::TimedOut`]).
//!
//! **Across homes.** A history of a run with shards has one store history per
//! cluster. The store checks run on each cluster's own history; a key that moves
//! between clusters is held to the same properties across them: its handed-out
//! tokens increase in real-time grant order and its holds never exceed the limit
//! at any one time, over every cluster (`homes`: real-time bounds on each
//! commit, from the recorder and the clock ticks).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use super::history::{token_of, ClientOp, EpochValue, EtcdEvent, History, HoldValue, MarkerValue, Outcome};

/// How long after a quorum-loss window opens an old leader may still answer
/// (election timeout and a round trip, doubled for 2 starved cores).
pub(crate) const QUORUM_LOSS_GRACE_US: u64 = 3_000_000;

/// One violated property, with the smallest window that shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    /// The check's name (table in the module doc).
    pub check: &'static str,
    /// A readable explanation naming the grants, tokens and times involved.
    pub explanation: String,
    /// Store segment of the revisions (0 before any restore).
    pub segment: usize,
    /// First and last revision involved (0, 0 when not a store property).
    pub revisions: (i64, i64),
    /// First and last time involved, unix µs.
    pub time_us: (u64, u64),
}

/// What was checked.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Stats {
    /// Committed grants in the etcd history.
    pub grants: usize,
    /// Release transactions.
    pub releases: usize,
    /// Deleted holds, each accounted for (`deleted_hold_accounted`).
    #[serde(default)]
    pub deletes: usize,
    /// Client operations.
    pub ops: usize,
    /// Store writes.
    pub writes: usize,
    /// Segments (1 + restores).
    pub segments: usize,
}

/// The checker's answer.
#[derive(Debug, Clone)]
pub enum Verdict {
    /// Every property held.
    Pass(Stats),
    /// At least one property was violated.
    Fail(Stats, Vec<Violation>),
    /// The checker ran out of time: the gate fails, it never passes.
    TimedOut {
        budget: Duration,
        /// The check that was running.
        stage: &'static str,
    },
    /// The history itself is incomplete (the recorder lost the store): fails.
    Incomplete(Vec<String>),
}

struct Budget {
    deadline: Instant,
    budget: Duration,
    ticks: u64,
}

struct TimedOut(&'static str);

/// A committed grant.
#[derive(Debug, Clone)]
struct Grant {
    /// The cluster, an index into [`History::clusters`].
    cluster: usize,
    /// Index into [`History::store_segments`].
    segment: usize,
    revision: i64,
    key: String,
    epoch: u64,
    token: u64,
    /// The lease its hold was put on (its session's).
    lease: i64,
    /// A read-write lock's exclusive hold (all of the key's slots).
    exclusive: bool,
    observed_us: u64,
    /// When its hold was deleted (observed), if it was.
    closed_us: Option<u64>,
    /// The store segment and revision of that delete (the last, if a restore
    /// brought the hold back).
    close: Option<(usize, i64)>,
    /// How that delete ended the hold.
    end: Option<End>,
}

/// How a hold's delete ended it (the transaction's other writes say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// A release marker of its key in the same revision: its holder released it.
    Released,
    /// Its session record deleted in the same revision, with no close marker:
    /// expired (or revoked by an arbiter).
    SessionEnded,
    /// Its session ended after its holder closed it (close marker): a release.
    SessionClosed,
    /// A force record, or an epoch advance, or anything else.
    Other,
}

/// Tokens handed out for one key on one cluster: (segment, revision, token,
/// answered at µs).
type Handed = Vec<(usize, i64, u64, u64)>;

#[derive(Clone, Default)]
struct State {
    /// Open holds: etcd key → index into the grants list.
    open: HashMap<String, usize>,
    epoch: Option<EpochValue>,
    /// Session records (`<root>/s/<session>`) → the lease they are on.
    sessions: HashMap<String, i64>,
    /// Authoritative limits by class (`<root>/c/<class>`).
    limits: HashMap<String, usize>,
    /// Durable waiter keys (`<root>/q/<digest>/<name>`) → their create revision.
    waiters: BTreeMap<String, i64>,
    /// Sessions with a close marker (`<root>/x/<session>`): their end is a close.
    closed: HashSet<String>,
    /// Leases whose session record a close deleted (with its close marker in the
    /// same or an earlier transaction) before revoking the lease: the holds the
    /// revoke deletes later ended with that close.
    closed_records: HashSet<i64>,
    /// Keys (digests) whose lock-delay record (`<root>/d/<digest>`) exists.
    delays: HashSet<String>,
    /// Keys of a lock-delay class whose last hold, handed to a client, ended by an
    /// expiry or a force release at this revision, with no lock-delay record since.
    owed: HashMap<String, i64>,
}

/// The fields of a class policy record the checker reads.
#[derive(serde::Deserialize)]
struct PolicyValue {
    limit: usize,
}

/// Tokens some client was answered with (an acquire that succeeded), by lock key.
type HandedOut<'a> = HashSet<(&'a str, u64)>;

// === impl Budget ===

impl Budget {
    fn tick(&mut self, stage: &'static str) -> Result<(), TimedOut> {
        if self.ticks.is_multiple_of(256) && Instant::now() >= self.deadline {
            return Err(TimedOut(stage));
        }
        self.ticks += 1;
        Ok(())
    }
}

// === impl Verdict ===

impl Verdict {
    /// Whether the gate passes.
    pub fn passed(&self) -> bool {
        matches!(self, Verdict::Pass(_))
    }

    /// The violations (empty unless `Fail`).
    pub fn violations(&self) -> &[Violation] {
        match self {
            Verdict::Fail(_, v) => v,
            _ => &[],
        }
    }

    /// A readable one-paragraph account.
    pub fn explain(&self) -> String {
        match self {
            Verdict::Pass(s) => format!(
                "pass: {} grants, {} releases, {} client ops, {} store writes, {} segments",
                s.grants, s.releases, s.ops, s.writes, s.segments
            ),
            Verdict::Fail(_, v) => {
                let mut out = format!("FAIL: {} violation(s)\n", v.len());
                for x in v.iter().take(20) {
                    out.push_str(&format!("  [{}] {}\n", x.check, x.explanation));
                }
                out
            }
            Verdict::TimedOut { budget, stage } => {
                format!(
                    "FAIL: the checker did not finish within {budget:?} (in {stage}); a timed-out check fails the gate"
                )
            }
            Verdict::Incomplete(g) => format!("FAIL: the history is incomplete: {}", g.join("; ")),
        }
    }
}

/// Checks `h` within `budget`.
pub fn check(h: &History, budget: Duration) -> Verdict {
    if !h.open.is_empty() {
        // A run with fail-open classes: their token-0 answers are checked on
        // their own and exempt from the rest (`open`).
        return open::check_with_open(h, &h.open, budget);
    }
    let mut b = Budget { deadline: Instant::now() + budget, budget, ticks: 0 };
    if !h.gaps.is_empty() {
        return Verdict::Incomplete(h.gaps.clone());
    }
    match check_in(h, &mut b) {
        Ok((stats, v)) if v.is_empty() => Verdict::Pass(stats),
        Ok((stats, v)) => Verdict::Fail(stats, v),
        Err(TimedOut(stage)) => Verdict::TimedOut { budget: b.budget, stage },
    }
}

fn check_in(h: &History, b: &mut Budget) -> Result<(Stats, Vec<Violation>), TimedOut> {
    let mut v = Vec::new();
    let mut stats = Stats { ops: h.ops.len(), writes: h.writes.len(), segments: h.segments.len(), ..Stats::default() };
    let grants = replay(h, b, &mut v, &mut stats)?;
    check_fence(h, b, &grants, &mut v)?;
    check_clients(h, b, &grants, &mut v)?;
    check_quorum_loss(h, b, &mut v)?;
    check_restored_epochs(h, b, &grants, &mut v)?;
    check_sdk_claims(h, b, &grants, &mut v)?;
    transparent::check(h, b, &grants, &mut v)?;
    recipes::check(h, b, &grants, &mut v)?;
    ops::check(h, b, &grants, &mut v)?;
    homes::check(h, b, &grants, &mut v)?;
    Ok((stats, v))
}

fn parse_kind<'a>(root: &str, key: &'a str) -> Option<(&'static str, &'a str)> {
    let rest = key.strip_prefix(root)?;
    if rest == "/sys/epoch" {
        return Some(("epoch", ""));
    }
    if let Some(r) = rest.strip_prefix("/l/") {
        let (digest, _) = r.split_once("/h/")?;
        return Some(("hold", digest));
    }
    if let Some(s) = rest.strip_prefix("/s/") {
        return (!s.contains('/')).then_some(("session", s));
    }
    if let Some(d) = rest.strip_prefix("/f/") {
        return Some(("force", d));
    }
    if let Some(d) = rest.strip_prefix("/d/") {
        return Some(("delay", d));
    }
    if let Some(s) = rest.strip_prefix("/x/") {
        return Some(("close", s));
    }
    if let Some(c) = rest.strip_prefix("/c/") {
        return (!c.contains('/')).then_some(("policy", c));
    }
    if let Some(q) = rest.strip_prefix("/q/") {
        return q.split_once('/').map(|(digest, _)| ("waiter", digest));
    }
    rest.strip_prefix("/r/").map(|d| ("marker", d))
}

/// Every (lock key, token) some client was answered with.
fn handed_out(h: &History) -> HandedOut<'_> {
    h.ops
        .iter()
        .filter(|o| o.asks_grant() && o.outcome == Outcome::Ok)
        .filter_map(|o| Some((o.key.as_str(), o.token?)))
        .collect()
}

/// Replays every cluster's segments (each from the state at its snapshot
/// revision) and runs the store checks; returns every committed grant.
fn replay(h: &History, b: &mut Budget, v: &mut Vec<Violation>, stats: &mut Stats) -> Result<Vec<Grant>, TimedOut> {
    let mut grants: Vec<Grant> = Vec::new();
    let handed = handed_out(h);
    let mut si = 0;
    for (ci, (_, segments)) in h.clusters().into_iter().enumerate() {
        replay_cluster(h, b, (ci, si), segments, &handed, &mut grants, v, stats)?;
        si += segments.len();
    }
    Ok(grants)
}

/// [`replay`] of one cluster, whose first segment is store segment `first`.
#[allow(clippy::too_many_arguments)]
fn replay_cluster(
    h: &History,
    b: &mut Budget,
    (ci, first): (usize, usize),
    segments: &[super::history::Segment],
    handed: &HandedOut<'_>,
    grants: &mut Vec<Grant>,
    v: &mut Vec<Violation>,
    stats: &mut Stats,
) -> Result<(), TimedOut> {
    let mut start = State::default();
    for (k, seg) in segments.iter().enumerate() {
        let si = first + k;
        let next_base = segments.get(k + 1).map(|s| s.base_revision);
        let mut st = start.clone();
        let mut captured: Option<State> = None;
        let mut i = 0;
        while i < seg.events.len() {
            let rev = seg.events[i].revision;
            if let Some(nb) = next_base {
                if captured.is_none() && rev > nb {
                    captured = Some(st.clone());
                }
            }
            let mut j = i;
            while j < seg.events.len() && seg.events[j].revision == rev {
                j += 1;
            }
            apply_txn(h, b, (ci, si), &seg.events[i..j], handed, &mut st, grants, v, stats)?;
            i = j;
        }
        start = captured.unwrap_or(st);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn apply_txn(
    h: &History,
    b: &mut Budget,
    (ci, si): (usize, usize),
    txn: &[EtcdEvent],
    handed: &HandedOut<'_>,
    st: &mut State,
    grants: &mut Vec<Grant>,
    v: &mut Vec<Violation>,
    stats: &mut Stats,
) -> Result<(), TimedOut> {
    let epoch_before = st.epoch.clone();
    let mut deleted: Vec<(String, usize)> = Vec::new();
    let mut markers: Vec<(String, MarkerValue, &EtcdEvent)> = Vec::new();
    // What else the transaction did that can end a hold: the leases whose
    // session record it deleted (an expiry or a close revokes the lease, which
    // deletes the record and the holds in one revision), the keys it put a force
    // record for, and whether it advanced the epoch (the advance deletes every hold).
    let mut ended_leases: HashSet<i64> = HashSet::new();
    let mut closed_leases: HashSet<i64> = HashSet::new();
    let mut forced: HashSet<&str> = HashSet::new();
    let mut advanced = false;
    // Waiter keys this transaction deleted: (digest, create revision).
    let mut left: Vec<(&str, i64)> = Vec::new();
    // One revision is one transaction: its deletes come before its puts, so a
    // hand-off (the release of `h/0000` and the grant of `h/0000.1` in one
    // transaction) is a release and then a grant, never two holds at once.
    let mut ordered: Vec<&EtcdEvent> = txn.iter().collect();
    ordered.sort_by_key(|e| e.put);
    // Close markers this transaction puts (a close that deletes the session
    // record and puts its marker in one transaction, then revokes the lease).
    let marked: HashSet<&str> = txn
        .iter()
        .filter(|e| e.put)
        .filter_map(|e| parse_kind(&h.root, &e.key).filter(|(k, _)| *k == "close").map(|(_, d)| d))
        .collect();
    for e in ordered {
        b.tick("replay")?;
        let Some((kind, digest)) = parse_kind(&h.root, &e.key) else { continue };
        match (kind, e.put) {
            ("epoch", true) => {
                st.epoch = serde_json::from_str(&e.value).ok();
                let (before, after) = (epoch_before.as_ref().map(|x| x.epoch), st.epoch.as_ref().map(|x| x.epoch));
                advanced |= matches!((before, after), (Some(b), Some(a)) if a > b);
            }
            ("session", true) => {
                st.sessions.insert(e.key.clone(), e.lease);
            }
            ("session", false) => {
                if let Some(l) = st.sessions.remove(&e.key) {
                    ended_leases.insert(l);
                    if st.closed.contains(digest) || marked.contains(digest) {
                        closed_leases.insert(l);
                        st.closed_records.insert(l);
                    }
                }
            }
            ("close", true) => {
                st.closed.insert(digest.to_owned());
            }
            ("delay", true) => {
                st.delays.insert(digest.to_owned());
                st.owed.remove(digest);
            }
            ("delay", false) => {
                st.delays.remove(digest);
            }
            ("force", true) => {
                forced.insert(digest);
            }
            ("policy", true) => {
                if let Ok(p) = serde_json::from_str::<PolicyValue>(&e.value) {
                    st.limits.insert(digest.to_owned(), p.limit);
                }
            }
            ("waiter", true) => {
                st.waiters.insert(e.key.clone(), e.create_revision);
            }
            ("waiter", false) => {
                if let Some(cr) = st.waiters.remove(&e.key) {
                    left.push((digest, cr));
                }
            }
            ("hold", true) if e.prev_value.is_none() => {
                let Ok(hv) = serde_json::from_str::<HoldValue>(&e.value) else { continue };
                let g = Grant {
                    cluster: ci,
                    segment: si,
                    revision: e.revision,
                    key: hv.key.clone(),
                    epoch: hv.epoch,
                    token: token_of(hv.epoch, e.create_revision),
                    lease: e.lease,
                    exclusive: hv.mode.as_deref() == Some("exclusive"),
                    observed_us: e.observed_us,
                    closed_us: None,
                    close: None,
                    end: None,
                };
                stats.grants += 1;
                match &epoch_before {
                    Some(ep) if ep.epoch != hv.epoch => v.push(Violation {
                        check: "grant_epoch_current",
                        explanation: format!(
                            "grant of {} at revision {} carries epoch {} but the epoch record held epoch {} at its commit",
                            hv.key, e.revision, hv.epoch, ep.epoch
                        ),
                        segment: si,
                        revisions: (e.revision, e.revision),
                        time_us: (e.observed_us, e.observed_us),
                    }),
                    Some(ep) if ep.sealed.is_some() => v.push(Violation {
                        check: "grant_epoch_current",
                        explanation: format!(
                            "grant of {} at revision {} committed while the epoch record carried an explicit seal ({:?})",
                            hv.key,
                            e.revision,
                            ep.sealed.as_deref().unwrap_or_default()
                        ),
                        segment: si,
                        revisions: (e.revision, e.revision),
                        time_us: (e.observed_us, e.observed_us),
                    }),
                    _ => {}
                }
                if h.is_delayed(&hv.key) {
                    lock_delay_kept(&hv.key, (si, e), digest, st, v);
                }
                grants.push(g);
                st.open.insert(e.key.clone(), grants.len() - 1);
                let prefix = format!("{}/l/{digest}/h/", h.root);
                let open: Vec<usize> =
                    st.open.iter().filter(|(k, _)| k.starts_with(&prefix)).map(|(_, gi)| *gi).collect();
                let limit = h.class_of(&hv.key).and_then(|c| st.limits.get(c).copied()).unwrap_or(h.limit_of(&hv.key));
                if h.is_durable(&hv.key) {
                    durable_order(h, (si, e), &hv.key, digest, &left, st, v);
                }
                writer_alone(&hv.key, (si, e), &open, grants, v);
                if h.is_election(&hv.key) {
                    one_leader(&hv.key, (si, e), &open, grants, v);
                }
                if open.len() > limit {
                    let first = open.iter().map(|gi| grants[*gi].revision).min().unwrap_or(e.revision);
                    let mut toks: Vec<u64> = open.iter().map(|gi| grants[*gi].token).collect();
                    toks.sort_unstable();
                    v.push(Violation {
                        check: "holders_within_limit",
                        explanation: format!(
                            "{} has {} committed, unclosed holds at revision {} (limit {limit}); their tokens: {toks:?}",
                            hv.key,
                            open.len(),
                            e.revision
                        ),
                        segment: si,
                        revisions: (first, e.revision),
                        time_us: (e.observed_us, e.observed_us),
                    });
                }
            }
            ("hold", false) => {
                if let Some(gi) = st.open.remove(&e.key) {
                    if grants[gi].segment == si {
                        grants[gi].closed_us = Some(e.observed_us);
                    }
                    grants[gi].close = Some((si, e.revision));
                    deleted.push((digest.to_owned(), gi));
                }
            }
            ("marker", true) => {
                if let Ok(m) = serde_json::from_str::<MarkerValue>(&e.value) {
                    markers.push((digest.to_owned(), m, e));
                }
            }
            _ => {}
        }
    }
    for (digest, m, e) in &markers {
        stats.releases += 1;
        for (d, gi) in &deleted {
            let g = &grants[*gi];
            if d == digest && (m.epoch.is_some_and(|me| me != g.epoch) || g.revision != m.revision) {
                let named = match m.epoch {
                    Some(me) => format!("grant {} (epoch {me} revision {})", token_of(me, m.revision), m.revision),
                    None => format!("the transparent hold of revision {}", m.revision),
                };
                v.push(Violation {
                    check: "release_frees_only_its_grant",
                    explanation: format!(
                        "a release naming {named} of {} deleted the hold of grant {} (revision {}): a successor was freed",
                        g.key, g.token, g.revision
                    ),
                    segment: si,
                    revisions: (m.revision.min(g.revision), e.revision),
                    time_us: (g.observed_us, e.observed_us),
                });
            }
        }
    }
    // Every deleted hold, with or without a marker: a release's marker is judged
    // above; any other delete must be an expiry, a close, a force release on the
    // record or an epoch advance, or take back a grant nobody was answered with.
    for (d, gi) in &deleted {
        stats.deletes += 1;
        let released = markers.iter().any(|(md, _, _)| md == d);
        let g = &mut grants[*gi];
        let end = if released {
            End::Released
        } else if closed_leases.contains(&g.lease) || st.closed_records.contains(&g.lease) {
            End::SessionClosed
        } else if ended_leases.contains(&g.lease) {
            End::SessionEnded
        } else {
            End::Other
        };
        g.end = Some(end);
        let g = &grants[*gi];
        // An expiry or a force release of a hold some client was answered with
        // owes the key its lock-delay (`lock_delay_kept`).
        let ended_unreleased = end == End::SessionEnded || (end == End::Other && forced.contains(d.as_str()));
        if ended_unreleased && h.is_delayed(&g.key) && handed.contains(&(g.key.as_str(), g.token)) {
            let rev = txn.first().map_or(0, |e| e.revision);
            st.owed.insert(d.clone(), rev);
        }
        // A hold granted after the debt and ended by its holder: that grant was
        // judged (and reported) at its commit; the key owes nothing more, so one
        // skipped delay is one violation, not one per later grant.
        if matches!(end, End::Released | End::SessionClosed) && st.owed.get(d).is_some_and(|&owed| g.revision > owed) {
            st.owed.remove(d);
        }
        if released
            || ended_leases.contains(&g.lease)
            || end == End::SessionClosed
            || forced.contains(d.as_str())
            || advanced
        {
            continue;
        }
        if !handed.contains(&(g.key.as_str(), g.token)) {
            continue;
        }
        let rev = txn.first().map_or(0, |e| e.revision);
        let at = txn.first().map_or(0, |e| e.observed_us);
        v.push(Violation {
            check: "deleted_hold_accounted",
            explanation: format!(
                "the hold of grant {} of {} (revision {}, handed to a client) was deleted at revision {rev} with no release marker naming it, \
                 no end of its session (lease {:x}), no force record and no epoch advance in that transaction",
                g.token, g.key, g.revision, g.lease
            ),
            segment: si,
            revisions: (g.revision, rev),
            time_us: (g.observed_us, at),
        });
    }
    Ok(())
}

/// `one_leader_per_term` at the put `e` of a hold of election key `key` (`open`:
/// the key's open holds after it): never two leaderships (grants, by revision) at
/// once, whatever limit the class's policy record allows (`holders_within_limit`
/// follows that record, so a raised election class passes it).
fn one_leader(key: &str, (si, e): (usize, &EtcdEvent), open: &[usize], grants: &[Grant], v: &mut Vec<Violation>) {
    let leaders: BTreeMap<i64, u64> = open.iter().map(|gi| (grants[*gi].revision, grants[*gi].token)).collect();
    if leaders.len() < 2 {
        return;
    }
    let first = leaders.keys().next().copied().unwrap_or(e.revision);
    v.push(Violation {
        check: "one_leader_per_term",
        explanation: format!(
            "election {key} has {} leaderships at once at revision {}: tokens {:?}",
            leaders.len(),
            e.revision,
            leaders.values().collect::<Vec<_>>()
        ),
        segment: si,
        revisions: (first, e.revision),
        time_us: (e.observed_us, e.observed_us),
    });
}

/// `writer_alone` at the put `e` of a hold of `key` (`open`: the key's open holds
/// after it, indices into `grants`): a read-write lock's exclusive grant is never
/// beside another grant of the key, shared or exclusive. A grant's slots share
/// its revision; checked once per grant, at its first slot.
fn writer_alone(key: &str, (si, e): (usize, &EtcdEvent), open: &[usize], grants: &[Grant], v: &mut Vec<Violation>) {
    if open.iter().filter(|gi| grants[**gi].revision == e.revision).count() != 1 {
        return;
    }
    let mut by_grant: BTreeMap<i64, (bool, u64)> = BTreeMap::new();
    for gi in open {
        let g = &grants[*gi];
        by_grant.insert(g.revision, (g.exclusive, g.token));
    }
    if by_grant.len() < 2 || !by_grant.values().any(|(x, _)| *x) {
        return;
    }
    let describe: Vec<String> =
        by_grant.values().map(|(x, t)| format!("{t} ({})", if *x { "exclusive" } else { "shared" })).collect();
    let first = by_grant.keys().next().copied().unwrap_or(e.revision);
    v.push(Violation {
        check: "writer_alone",
        explanation: format!(
            "{key} has an exclusive grant beside another at revision {}: open grants {}",
            e.revision,
            describe.join(", ")
        ),
        segment: si,
        revisions: (first, e.revision),
        time_us: (e.observed_us, e.observed_us),
    });
}

/// `lock_delay_kept` at the grant `e` of `key`/// `lock_delay_kept` at the grant `e` of `key`, of a class with a lock-delay: no
/// lock-delay record of the key exists at the commit, and its last hold did not
/// end by an expiry or a force release with no record written since (the delay
/// is owed). Exact over revisions; how long the record lived is etcd's lease.
fn lock_delay_kept(key: &str, (si, e): (usize, &EtcdEvent), digest: &str, st: &State, v: &mut Vec<Violation>) {
    let why = if st.delays.contains(digest) {
        "while its lock-delay record existed".to_owned()
    } else if let Some(rev) = st.owed.get(digest) {
        format!("after its last hold ended without a release at revision {rev}, with no lock-delay since")
    } else {
        return;
    };
    v.push(Violation {
        check: "lock_delay_kept",
        explanation: format!("{key} was granted at revision {} {why}", e.revision),
        segment: si,
        revisions: (st.owed.get(digest).copied().unwrap_or(e.revision), e.revision),
        time_us: (e.observed_us, e.observed_us),
    });
}

/// `durable_order_kept` at the grant `e` of durable key `key`: the waiter keys
/// of its digest still queued after the transaction must all be younger than
/// the waiter key the grant deleted (its own), and with none deleted (an
/// arrival) none may be queued.
fn durable_order(
    h: &History,
    (si, e): (usize, &EtcdEvent),
    key: &str,
    digest: &str,
    left: &[(&str, i64)],
    st: &State,
    v: &mut Vec<Violation>,
) {
    let own = left.iter().filter(|(d, _)| *d == digest).map(|(_, cr)| *cr).min();
    let prefix = format!("{}/q/{digest}/", h.root);
    let older: Vec<i64> = st
        .waiters
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .map(|(_, cr)| *cr)
        .filter(|cr| own.is_none_or(|o| *cr < o))
        .collect();
    if let Some(first) = older.iter().min() {
        let by = match own {
            Some(o) => format!("the waiter queued at revision {o}"),
            None => "an arrival that never queued".to_owned(),
        };
        v.push(Violation {
            check: "durable_order_kept",
            explanation: format!(
                "the grant of durable {key} at revision {} went to {by} while {} older waiter key(s) were queued (the oldest at revision {first}): the queue was overtaken",
                e.revision,
                older.len()
            ),
            segment: si,
            revisions: (*first, e.revision),
            time_us: (e.observed_us, e.observed_us),
        });
    }
}

/// `restore_serves_new_epoch`: every grant handed to a client in a segment after
/// a restore carries an epoch above every grant's of the segments before it on
/// its cluster.
fn check_restored_epochs(
    h: &History,
    b: &mut Budget,
    grants: &[Grant],
    v: &mut Vec<Violation>,
) -> Result<(), TimedOut> {
    let handed = handed_out(h);
    let mut top: BTreeMap<(usize, usize), u64> = BTreeMap::new();
    for g in grants {
        let e = top.entry((g.cluster, g.segment)).or_default();
        *e = (*e).max(g.epoch);
    }
    for g in grants {
        b.tick("restored_epochs")?;
        if !handed.contains(&(g.key.as_str(), g.token)) {
            continue;
        }
        let before = top.range((g.cluster, 0)..(g.cluster, g.segment)).map(|(_, e)| *e).max();
        if let Some(old) = before.filter(|old| g.epoch <= *old) {
            v.push(Violation {
                check: "restore_serves_new_epoch",
                explanation: format!(
                    "after a restore, grant {} of {} (revision {}) was handed out in epoch {}, which grants before the restore already carried (up to epoch {old}): the restored cluster was served before its epoch advance",
                    g.token, g.key, g.revision, g.epoch
                ),
                segment: g.segment,
                revisions: (g.revision, g.revision),
                time_us: (g.observed_us, g.observed_us),
            });
        }
    }
    Ok(())
}

/// `sdk_deadline_conservative`: for each claim of an SDK holder (`valid`: its hold
/// of token T lasts until V), no other client was answered a grant T' of the same
/// mutex key, in T's epoch and above T, before both V and the claimant's release
/// of T was called. Such a T' committed after T's hold was deleted, which its
/// holder had not asked for, at a time the SDK still called the hold valid.
///
/// The claimant's release is the first of its recorded release call and the
/// release etcd committed (T's hold deleted with its key's release marker, which
/// only a release naming T on T's session writes, as a hand-off to T' does): a
/// release still in flight when a history ends is in the store's history but in
/// no client's.
fn check_sdk_claims(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    // Holds their holder released, by key and token: the revision of the release.
    let released_in_store: HashMap<(&str, u64), i64> = grants
        .iter()
        .filter(|g| g.end == Some(End::Released))
        .filter_map(|g| g.close.map(|(_, rev)| ((g.key.as_str(), g.token), rev)))
        .collect();
    let mut acquired: HashMap<&str, Vec<(&ClientOp, u64)>> = HashMap::new();
    let mut released: HashMap<(&str, &str, u64), u64> = HashMap::new();
    for o in &h.ops {
        match (o.op.as_str(), o.token) {
            ("acquire", Some(t)) if o.outcome == Outcome::Ok => {
                acquired.entry(o.key.as_str()).or_default().push((o, t))
            }
            ("release", Some(t)) => {
                let r = released.entry((o.process.as_str(), o.key.as_str(), t)).or_insert(u64::MAX);
                *r = (*r).min(o.call_us);
            }
            _ => {}
        }
    }
    for claim in h.ops.iter().filter(|o| o.op == "valid") {
        let (Some(t), Some(until)) = (claim.token, claim.valid_until_us) else { continue };
        // A deadline not after the claim's own time claims nothing (older holders
        // recorded a zero time left this way).
        if until <= claim.call_us {
            continue;
        }
        if h.limit_of(&claim.key) != 1 {
            continue;
        }
        let release = released.get(&(claim.process.as_str(), claim.key.as_str(), t)).copied().unwrap_or(u64::MAX);
        let bound = until.min(release);
        let store_release = released_in_store.get(&(claim.key.as_str(), t)).copied();
        for (o, t2) in acquired.get(claim.key.as_str()).into_iter().flatten() {
            b.tick("sdk")?;
            // T' committed at or after T's release in etcd (a hand-off commits both).
            let rev2 = i64::try_from(t2 & ((1 << 48) - 1)).unwrap_or(i64::MAX);
            if store_release.is_some_and(|r| r <= rev2) {
                continue;
            }
            if *t2 > t && t2 >> 48 == t >> 48 && o.ret_us < bound {
                v.push(Violation {
                    check: "sdk_deadline_conservative",
                    explanation: format!(
                        "{} was told at {} that its hold of {} (token {t}) lasts until {until}, and had not released it, yet {} was answered grant {t2} of that key at {} ({} ms before that deadline)",
                        claim.process,
                        claim.call_us,
                        claim.key,
                        o.process,
                        o.ret_us,
                        (until.saturating_sub(o.ret_us)) / 1000
                    ),
                    segment: 0,
                    revisions: (0, 0),
                    time_us: (claim.call_us.min(o.ret_us), until),
                });
                break;
            }
        }
    }
    Ok(())
}

fn check_fence(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    let granted: HashSet<(&str, u64)> = grants.iter().map(|g| (g.key.as_str(), g.token)).collect();
    let mut mark: HashMap<&str, u64> = HashMap::new();
    for (i, w) in h.writes.iter().enumerate() {
        b.tick("fence")?;
        if let Some(&m) = mark.get(w.resource.as_str()) {
            if w.token <= m {
                v.push(Violation {
                    check: "fence_monotonic",
                    explanation: format!(
                        "the store accepted write #{i} to {} with token {} after it had accepted token {m} (strict rule: only a greater token writes); body {:?}",
                        w.resource, w.token, w.body
                    ),
                    segment: 0,
                    revisions: (0, 0),
                    time_us: (0, 0),
                });
            }
        }
        let m = mark.entry(w.resource.as_str()).or_insert(0);
        *m = (*m).max(w.token);
        if !granted.contains(&(w.lock_key.as_str(), w.token)) {
            v.push(Violation {
                check: "fence_genuine",
                explanation: format!(
                    "the store accepted write #{i} to {} with token {}, which is no committed grant of {}",
                    w.resource, w.token, w.lock_key
                ),
                segment: 0,
                revisions: (0, 0),
                time_us: (0, 0),
            });
        }
    }
    Ok(())
}

fn check_clients(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    let mut by_token: HashMap<(&str, u64), Vec<usize>> = HashMap::new();
    for (i, g) in grants.iter().enumerate() {
        by_token.entry((g.key.as_str(), g.token)).or_default().push(i);
    }
    // Acquires handed out: (segment, revision) order per key and cluster (across
    // clusters, `homes` orders them by time).
    let mut handed: BTreeMap<(&str, usize), Handed> = BTreeMap::new();
    // Who was handed each token, per cluster and key: a multi-key grant hands
    // one token (its revision) for each of its keys, so tokens are unique per
    // key, not across keys.
    let mut seen_tokens: HashMap<(usize, &str, u64), &str> = HashMap::new();
    for op in &h.ops {
        b.tick("clients")?;
        if op.outcome != Outcome::Ok {
            continue;
        }
        let Some(t) = op.token else { continue };
        // The latest committed grant with this token observed before the answer (a
        // restore can reuse a revision); else the last one (the watch may observe a
        // commit late, e.g. while the member it streams from is paused).
        let g = by_token.get(&(op.key.as_str(), t)).and_then(|ix| {
            ix.iter().rev().find(|&&i| grants[i].observed_us <= op.ret_us + 1_000_000).or(ix.last()).copied()
        });
        match op.op.as_str() {
            _ if op.asks_grant() => {
                let Some(gi) = g else {
                    v.push(Violation {
                        check: "tokens_increase",
                        explanation: format!(
                            "{} was handed token {t} for {} at {} but no committed grant of that key carries it",
                            op.process, op.key, op.ret_us
                        ),
                        segment: 0,
                        revisions: (0, 0),
                        time_us: (op.call_us, op.ret_us),
                    });
                    continue;
                };
                let first = *seen_tokens.entry((grants[gi].cluster, op.key.as_str(), t)).or_insert(op.process.as_str());
                if first != op.process {
                    v.push(Violation {
                        check: "tokens_increase",
                        explanation: format!(
                            "token {t} of {} was handed to two holders ({first} and {})",
                            op.key, op.process
                        ),
                        segment: grants[gi].segment,
                        revisions: (grants[gi].revision, grants[gi].revision),
                        time_us: (op.call_us, op.ret_us),
                    });
                }
                let gr = &grants[gi];
                // A campaign names its session: the leadership must be on it, never
                // on one the campaigner did not open (etcd's phantom leadership).
                if let Some(sent) = op.session.as_deref().filter(|_| op.op == "campaign") {
                    let on = format!("{:016x}", gr.lease);
                    if on != sent {
                        v.push(Violation {
                            check: "leader_on_own_session",
                            explanation: format!(
                                "{} campaigned for {} on session {sent} and was answered leadership {t}, whose hold is on session {on}",
                                op.process, op.key
                            ),
                            segment: gr.segment,
                            revisions: (gr.revision, gr.revision),
                            time_us: (op.call_us, op.ret_us),
                        });
                    }
                }
                handed.entry((op.key.as_str(), gr.cluster)).or_default().push((gr.segment, gr.revision, t, op.ret_us));
            }
            _ if op.ends_grant() => {
                if let Some(closed) = g.and_then(|gi| grants[gi].closed_us) {
                    if closed < op.call_us {
                        v.push(Violation {
                            check: "release_of_open_grant",
                            explanation: format!(
                                "{}'s release of token {t} of {} answered success, but that grant's hold was already gone {} ms before the release was called",
                                op.process,
                                op.key,
                                (op.call_us - closed) / 1000
                            ),
                            segment: 0,
                            revisions: (0, 0),
                            time_us: (closed, op.ret_us),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    let clusters = h.clusters();
    for ((key, ci), mut list) in handed {
        // The cluster is named when there are several.
        let on = if clusters.len() > 1 { format!(" on {}", clusters[ci].0) } else { String::new() };
        list.sort_unstable();
        for w in list.windows(2) {
            b.tick("tokens")?;
            let ((s0, r0, t0, at0), (s1, r1, t1, at1)) = (w[0], w[1]);
            if t1 <= t0 {
                v.push(Violation {
                    check: "tokens_increase",
                    explanation: format!(
                        "{key}{on}: the grant at segment {s1} revision {r1} handed out token {t1}, not above token {t0} of the earlier grant at segment {s0} revision {r0}{}",
                        if s1 > s0 { " (across a restore)" } else { "" }
                    ),
                    segment: s1,
                    revisions: (r0.min(r1), r0.max(r1)),
                    time_us: (at0.min(at1), at0.max(at1)),
                });
            }
        }
    }
    Ok(())
}

fn check_quorum_loss(h: &History, b: &mut Budget, v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    for &(start, end) in &h.quorum_loss {
        for op in &h.ops {
            b.tick("quorum_loss")?;
            let renewing = op.asks_grant() || op.op == "keepalive";
            if renewing && op.outcome == Outcome::Ok && op.call_us >= start + QUORUM_LOSS_GRACE_US && op.ret_us <= end {
                v.push(Violation {
                    check: "quorum_loss_grants_nothing",
                    explanation: format!(
                        "{}'s {} of {} answered success at {} although no etcd majority ran from {start} to {end}",
                        op.process, op.op, op.key, op.ret_us
                    ),
                    segment: 0,
                    revisions: (0, 0),
                    time_us: (op.call_us, op.ret_us),
                });
            }
        }
    }
    Ok(())
}

mod homes;

mod open;
mod ops;

mod recipes;

mod transparent;
pub use self::open::check_with_open;

#[cfg(test)]
mod tests;
