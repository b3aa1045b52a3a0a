//! TEST ONLY: planted bugs for the release gate (`docs/GATE.md`).
//!
//! Compiled in only with the cargo feature `test-faults`, which only the test
//! harness turns on (`lockmesh-tests`). Without it, [`on`] is a constant `false`
//! (every planted branch is dead code the compiler removes), [`parse`](TestFault::parse)
//! knows no fault, and [`install`] plants nothing: a shipped build cannot be
//! configured into an unsafe one. `tests/tests/layout.rs` checks that the shipped
//! arbiter's dependency tree never turns the feature on.
//!
//! A gate that cannot catch a bug proves nothing, so the gate's targeted
//! scenarios turn these on and check that the checker fails. They are switched
//! on by the arbiter config field `test_faults: [..]`, which is refused unless
//! the environment sets `LOCKMESH_TEST_FAULTS=1`, and logged at `error` level at
//! startup. No shipped config names them.

#[cfg(feature = "test-faults")]
use std::sync::OnceLock;

/// The environment variable that must be `1` for `test_faults` to be accepted.
pub(crate) const ENV: &str = "LOCKMESH_TEST_FAULTS";

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestFault {
    /// Grants do not compare the epoch record: a grant may carry an epoch that is
    /// no longer current at its commit (an epoch advance during a restore).
    SkipEpochCompare,
    /// Release of a mutex hold on the caller's session deletes slot 0 by name,
    /// without comparing the grant: a stale release frees a successor (etcd #22082).
    ReleaseByKeyName,
    /// A semaphore grant counts the holders, then puts its own hold without
    /// comparing the count: racing grants exceed N.
    CountBeforeLock,
    /// The home fence admits a key its cluster's record homes elsewhere, and the
    /// arbiter never re-reads the shard map (`lock::home`, `tiers`): after a move,
    /// grants routed by the stale map commit on the keys' old home.
    SkipHomeGate,
    /// Session and VM keepalives renew the clusters in turn and stop at the first
    /// that fails (`tiers`; the code before issue 18 item 1): with one cluster
    /// unreachable, sessions and transparent holds on the clusters after it lapse.
    RenewInTurn,
    /// `lockctl shard apply` skips step 3 (the epoch advance of every cluster that
    /// gains keys above every cluster that loses them, `shardctl`): a key moving to
    /// a cluster with a lower epoch is granted tokens below its old home's. Read by
    /// `lockctl` from the config it is given, never by the arbiter.
    SkipMoveEpochAdvance,
    /// `lockctl shard apply` skips steps 1 and 2 (drain and verify): holds of
    /// moving keys are still live on their old home when the new home starts
    /// granting them. Read by `lockctl` only.
    SkipMoveDrain,
    /// `lockctl class apply` skips its tier check (`lockmesh_ops::reconcile`'s
    /// `tier_crossings`): a prefix handed to a class of the other tier moves its
    /// keys between the coord cluster and a shard outside the fenced move, so the
    /// old cluster's holds outlive the new cluster's first grant. Read by `lockctl` only.
    SkipTierCheck,
    /// Grants neither compare nor put the grant clock and the seal check does not
    /// read it (`lock::seal`): under a non-root etcd role a restore with
    /// `--bump-revision` then passes every check and restored-free keys are granted
    /// again.
    SkipClockCompare,
    /// Acquires and session opens skip every quota check (`lock::quota`): one
    /// namespace can take sessions, holds and waiters without bound.
    SkipQuota,
    /// Grants take the key's limit from the YAML registry (`max_holders`), not from
    /// the authoritative policy record: after `lockctl limit change` lowers a
    /// limit, grants still fill the old one.
    RegistryLimit,
    /// Session leases are granted the TTL this process first saw for the class
    /// (a cache a registry reload does not clear), while the session record and
    /// the answer carry the class's current TTL: after a TTL is raised, a holder
    /// is told a longer TTL than its lease has.
    StaleSessionTtl,
    /// Not a bug: stands in for production's non-root etcd role, under which
    /// `Status` is denied and the seal check reads no raft position
    /// (`lock::seal`). The gate's etcd runs without auth (every client is root),
    /// so without this switch the raft check would hide what the grant clock
    /// alone must catch after a bumped restore.
    NoRaftCheck,
    /// The seal neither compares nor raises the raft-term mark that every
    /// linearizable answer's header feeds (`lock::seal`): an arbiter down since
    /// before a snapshot grants in the old epoch on the restored cluster.
    SkipTermMark,
    /// Session and VM keepalives renew leases on a sealed (restored) cluster too:
    /// the snapshot's holds stay standing while their holders renew, and a move
    /// of their keys off that cluster never verifies.
    RenewSealed,
    /// An existing hold found by a read (`Store::checked_read`: an idempotent
    /// re-acquire, a leak) is answered with no seal, mark, clock or epoch check:
    /// right after a restore, a hold the snapshot brought back is answered as
    /// held, with a token older than grants made after the snapshot.
    UncheckedExistingRead,
    /// `lockctl epoch-advance --epochs-from` takes the epoch it allocated from the
    /// coord counter for one the operator named: a re-run refuses the advance an
    /// earlier run left half-done, and the shard stays sealed. Read by `lockctl`
    /// from the config it is given, never by the arbiter.
    AdvanceEpochAsGiven,
    /// TEST SWITCH, not a bug: the arbiter's once-a-second seal round does not
    /// run, so only requests can notice a restore (a scenario's window between a
    /// restore and the round made as wide as it needs).
    NoSealRound,
    /// The clusters' once-a-second seal rounds take turns (one round at a time,
    /// as one loop over the clusters did): a cluster whose etcd stalls holds back
    /// every other cluster's quorum-loss declaration and its end.
    SealRoundsInTurn,
    /// A sealed cluster still opens sessions, and a session homed on a sealed
    /// cluster is still granted keys on the others: the guarded epoch advance
    /// then ends that session and its holds elsewhere behind its holder's back.
    SessionsIgnoreSeal,
    /// The first grant of a durable-fairness key does not compare the key's
    /// waiter range empty (`lock::durable`): an arrival overtakes queued waiters.
    SkipQueueCompare,
    /// A VM keepalive's reconcile (`lock::vm`) releases every hold numbered below
    /// the filter's next number, also those whose requests are still open: a long
    /// transparent request loses its hold while it is at the upstream.
    ReconcileOpenHolds,
    /// Grants of a class with `lock_delay_s` neither compare nor put the lock-delay
    /// guard (`lock::delay`): a key whose holder's session expired is granted at once.
    SkipLockDelay,
    /// The answer to `POST /v1/sessions` carries `ttl_s` as a string (`"15"`): a
    /// reply docs/openapi.yaml does not allow, which the OpenAPI scenario's
    /// schemathesis run must report (`tests/tests/scenarios/openapi.rs`).
    WireDrift,
    /// `POST /v1/elections/proclaim` checks that the caller's identity holds the
    /// election, not that its token is the current leadership (`lock::election`): a
    /// resigned leader of the same workload overwrites its successor's value.
    ProclaimWithoutToken,
    /// `GET /v1/elections` waits for any change after the resume point, then
    /// answers the state now (`lock::election`): changes between two polls merge,
    /// and an observer misses leaderships.
    ObserveCoalesces,
    /// A campaign whose session is gone while it waits campaigns on with a new
    /// session (the arbiter's `api`): the caller, whose session is lost, is made
    /// leader anyway (etcd's phantom leadership).
    CampaignAfterSessionLoss,
    /// The quota ledger reports the newest open hold of a namespace and class as
    /// its oldest (`lock::quota`): an old stuck hold hides behind any younger hold
    /// of its class, and `lockmesh_arbiter_oldest_hold_seconds` stays low.
    OldestHoldNewest,
    /// A class's candidate limit decides grants instead of the enforced one
    /// (`lock::mutex`): shadow mode fails open for a looser candidate and refuses
    /// for a stricter one (`tests/tests/scenarios/shadow.rs`).
    ShadowDecides,
    /// The console's history (the arbiter's `console::history`) records at each
    /// sample what it read at the previous one: every plotted point is one sample
    /// late (`tests/tests/scenarios/console.rs`).
    ConsoleHistoryLag,
    /// A multi-key grant (`lock::multi`) compares only its first key free: the
    /// others are put over any holder (`tests/tests/scenarios/multikey.rs`).
    MultiKeyFirstOnly,
    /// An exclusive hold (`x-lock-mode: exclusive`) takes one slot instead of all
    /// N (`lock::mutex`): a writer beside readers (the gate's `writer_alone`).
    ExclusiveOneSlot,
    /// Not a bug: the read a head makes of a key granted here (`lock::mutex`,
    /// `held_read`) waits 3 s first, so a scenario can release the key while that
    /// read is in flight (`tests/tests/scenarios/handoff.rs`). While it is on, a
    /// head always reads (it never skips the read for another session's hold).
    SlowHeldRead,
    /// That head posts its hand-off offer after the read instead of before it
    /// (`lock::mutex`, the order before 2026-12-04): a release during the read
    /// finds no offer, and the key takes two commits instead of one. While it is
    /// on, a head always reads, as with [`TestFault::SlowHeldRead`].
    OfferAfterRead,
    /// Not a bug: an acquire waits 400 ms before it enters its key's queue here
    /// (`lock::mutex`, `acquire_in`), so a scenario can release a key before the
    /// next head reaches the arbiter (`tests/tests/scenarios/handoff.rs`).
    SlowQueueEntry,
    /// The head of a key granted here skips its read of the holders even when
    /// the hold is its own session's or its caller's (`lock::mutex`): an
    /// idempotent re-acquire or a leaked hold waits for itself instead of being
    /// answered at once (`tests/tests/scenarios/held_memo.rs`).
    SkipReadForAnyone,
    /// The policy watch (`lock::policy_watch`) counts a change of a class's
    /// policy but keeps the cache: a head that skips its read waits under a
    /// limit that was raised (`tests/tests/scenarios/held_memo.rs`).
    PolicyWatchKeepsCache,
    /// The arbiter keeps its note of a grant it made after the quota ledger saw
    /// that hold deleted (an expiry, a revoke, a release elsewhere; `lock::wait`):
    /// the next head waits for a hold that no longer exists until its watch
    /// wakes it (`tests/tests/scenarios/held_memo.rs`).
    KeepEndedHeld,
    /// A release that hands the key to a header-only waiter (its acquire opened
    /// its session and offered the record, `lock::mutex`) puts the hold but not
    /// the session's record: the hold stands on a lease no record names, so the
    /// waiter cannot use or release its session (`tests/tests/scenarios/held_memo.rs`).
    HandoffDropsRecord,
    /// Grants neither put nor compare a key's exclusion record: a shared grant
    /// after a limit raise sits beside an exclusive hold
    /// (`tests/tests/scenarios/holder_safety.rs`).
    SkipExclusion,
    /// A campaign is granted under whatever limit the class's policy record
    /// has: two leaders after a limit raise (`tests/tests/scenarios/holder_safety.rs`).
    CampaignAnyLimit,
    /// An acquire-opened session's grants put no hold index: its close at its
    /// last release cannot see a grant that raced it
    /// (`tests/tests/scenarios/holder_safety.rs`).
    SessionHoldsUnindexed,
    /// A retired VM session that carries no hold is left to lapse instead of
    /// closed: an arbiter that still caches it grants on it in its last second
    /// (`tests/tests/scenarios/edges_vm.rs`).
    RetiredLapseByRead,
    /// A waiting acquire's own session is renewed a third of its TTL after each
    /// renewal's answer, not from each send: slow answers push renewals past the
    /// TTL (`tests/tests/scenarios/holder_safety.rs`).
    RenewAfterAnswer,
    /// A re-acquire of a held key answers the mode it asked for, not the held
    /// one, and grants it (`tests/tests/scenarios/holder_safety.rs`).
    EchoAskedMode,
    /// A grant on the caller's session whose answer etcd never gave is answered
    /// `unavailable` without fencing its attempt: it may commit after the answer
    /// and leave a hold its holder does not know (`tests/tests/scenarios/holder_safety.rs`).
    NoAttemptFence,
    /// Writers of gated record kinds neither ask the keyspace gate nor compare
    /// the arbiter's advertisement (`lock::upgrade::Guard`): a kind is written
    /// before its capability is enabled (`tests/tests/scenarios/upgrade.rs`).
    UngatedWrites,
    /// The lock API's release ends a transparent hold whose caller names its
    /// token, while its request may still be at the upstream
    /// (`tests/tests/scenarios/holder_safety.rs`).
    ApiReleasesTransparent,
    /// A session opened without a key is charged to its class's namespace
    /// whoever opens it: one tenant spends another's session quota
    /// (`tests/tests/scenarios/holder_safety.rs`).
    ChargeAnyNamespace,
    /// A move's soft epoch advance is taken for the guarded one: a cluster sealed
    /// after a restore is unsealed by `lockctl shard apply` (`lock::seal` tests).
    SoftAdvanceUnseals,
    /// Releases and closes neither compare nor put the grant clock: a bumped
    /// restore that lost only releases is not seen, and the released hold
    /// stands again (`tests/tests/scenarios/edges_grant.rs`).
    ReleaseSkipsClock,
    /// A session's close revokes its lease bare on the clusters it extends to (no
    /// close marker there): their holds' ends read as expiries and wait out the
    /// lock-delay (`tests/tests/scenarios/recipe_edges.rs`).
    ExtensionBareRevoke,
    /// A clean stop leaves the marks as the last once-a-second check wrote them
    /// (`tests/tests/scenarios/edges_grant.rs`).
    NoPersistAtStop,
    /// A re-acquire's check for the caller's own hold (`lock::mutex`,
    /// `classify_holders`) takes any session's hold of the key for the caller's:
    /// a contender is answered the holder's grant and token (the gate's
    /// `tokens_increase`, per cluster and key).
    ExistingAnySession,
    /// A gated waiter (`lock::wait`) ignores its key's watch, releases through
    /// its arbiter and the poll, and looks again only at its deadline: it waits
    /// on a free key (the gate's `no_waiter_on_a_free_key`).
    WaiterSleepsToDeadline,
    /// The lock-delay watch (`lock::delay`) watches again from "now" after a
    /// break, not from the last revision it saw: a hold that ended in the gap
    /// starts its delay only at the key's next grant attempt
    /// (`tests/tests/scenarios/recipe_edges.rs`).
    DelayRewatchFromNow,
    /// A grant taken back after its commit (`lock::mutex`, `take_back`: an
    /// answer lost and resolved in the background, a seal found after the
    /// commit) leaves its session's hold index key: an acquire-opened session
    /// can then not close at its last release and lapses at its TTL
    /// (`tests/tests/scenarios/holder_safety.rs`).
    TakeBackKeepsIndex,
    /// Not a bug: the lock-delay watch breaks right after each hold delete it
    /// handles and watches again 5 s later, so a scenario can end a hold in the
    /// gap (`tests/tests/scenarios/recipe_edges.rs`).
    DelayWatchGap,
    /// A grant committed in a group (`engine::group`) is answered granted
    /// whatever its own nested compares said: a member refused inside a
    /// committed group is told it holds the key
    /// (`tests/tests/scenarios/group_commit.rs`).
    GroupMemberOutcomeIgnored,
    /// A grant member of a group does not compare its session record's lease:
    /// a member whose session is gone puts on a dead lease, and etcd refuses the
    /// whole group (its neighbours are sent alone).
    GroupNoLeaseGuard,
    /// The committer puts two operations on one lock key into one group.
    GroupSameKey,
    /// A grant member carries the grant clock's compare and put itself, as a
    /// lone grant does: two members put the clock key and etcd refuses the group.
    GroupClockInMember,
    /// A group commits and its answer is lost (as when it misses the deadline);
    /// with `GroupUnknownGuessed` the members take the loss for a refusal
    /// instead of resolving it through the attempt fence.
    GroupAnswerLost,
    /// With `GroupAnswerLost`: a member whose group's outcome is unknown
    /// answers `unavailable` without resolving it: the grant stands in etcd,
    /// held by nobody who knows.
    GroupUnknownGuessed,
}

#[cfg(feature = "test-faults")]
static ACTIVE: OnceLock<Vec<TestFault>> = OnceLock::new();

// === impl TestFault ===

impl TestFault {
    /// Parses a config name (`skip_epoch_compare`, `release_by_key_name`,
    /// `count_before_lock`, `skip_home_gate`, `skip_move_epoch_advance`,
    /// `skip_move_drain`).
    #[cfg(feature = "test-faults")]
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "skip_epoch_compare" => Some(Self::SkipEpochCompare),
            "release_by_key_name" => Some(Self::ReleaseByKeyName),
            "count_before_lock" => Some(Self::CountBeforeLock),
            "skip_home_gate" => Some(Self::SkipHomeGate),
            "renew_in_turn" => Some(Self::RenewInTurn),
            "skip_move_epoch_advance" => Some(Self::SkipMoveEpochAdvance),
            "skip_move_drain" => Some(Self::SkipMoveDrain),
            "skip_tier_check" => Some(Self::SkipTierCheck),
            "skip_clock_compare" => Some(Self::SkipClockCompare),
            "skip_quota" => Some(Self::SkipQuota),
            "registry_limit" => Some(Self::RegistryLimit),
            "stale_session_ttl" => Some(Self::StaleSessionTtl),
            "skip_queue_compare" => Some(Self::SkipQueueCompare),
            "reconcile_open_holds" => Some(Self::ReconcileOpenHolds),
            "skip_lock_delay" => Some(Self::SkipLockDelay),
            "no_raft_check" => Some(Self::NoRaftCheck),
            "skip_term_mark" => Some(Self::SkipTermMark),
            "renew_sealed" => Some(Self::RenewSealed),
            "unchecked_existing_read" => Some(Self::UncheckedExistingRead),
            "advance_epoch_as_given" => Some(Self::AdvanceEpochAsGiven),
            "no_seal_round" => Some(Self::NoSealRound),
            "seal_rounds_in_turn" => Some(Self::SealRoundsInTurn),
            "sessions_ignore_seal" => Some(Self::SessionsIgnoreSeal),
            "wire_drift" => Some(Self::WireDrift),
            "proclaim_without_token" => Some(Self::ProclaimWithoutToken),
            "observe_coalesces" => Some(Self::ObserveCoalesces),
            "campaign_after_session_loss" => Some(Self::CampaignAfterSessionLoss),
            "shadow_decides" => Some(Self::ShadowDecides),
            "oldest_hold_newest" => Some(Self::OldestHoldNewest),
            "console_history_lag" => Some(Self::ConsoleHistoryLag),
            "multi_key_first_only" => Some(Self::MultiKeyFirstOnly),
            "exclusive_one_slot" => Some(Self::ExclusiveOneSlot),
            "slow_held_read" => Some(Self::SlowHeldRead),
            "offer_after_read" => Some(Self::OfferAfterRead),
            "slow_queue_entry" => Some(Self::SlowQueueEntry),
            "skip_read_for_anyone" => Some(Self::SkipReadForAnyone),
            "policy_watch_keeps_cache" => Some(Self::PolicyWatchKeepsCache),
            "keep_ended_held" => Some(Self::KeepEndedHeld),
            "handoff_drops_record" => Some(Self::HandoffDropsRecord),
            "skip_exclusion" => Some(Self::SkipExclusion),
            "campaign_any_limit" => Some(Self::CampaignAnyLimit),
            "session_holds_unindexed" => Some(Self::SessionHoldsUnindexed),
            "retired_lapse_by_read" => Some(Self::RetiredLapseByRead),
            "renew_after_answer" => Some(Self::RenewAfterAnswer),
            "echo_asked_mode" => Some(Self::EchoAskedMode),
            "no_attempt_fence" => Some(Self::NoAttemptFence),
            "ungated_writes" => Some(Self::UngatedWrites),
            "api_releases_transparent" => Some(Self::ApiReleasesTransparent),
            "charge_any_namespace" => Some(Self::ChargeAnyNamespace),
            "soft_advance_unseals" => Some(Self::SoftAdvanceUnseals),
            "release_skips_clock" => Some(Self::ReleaseSkipsClock),
            "extension_bare_revoke" => Some(Self::ExtensionBareRevoke),
            "no_persist_at_stop" => Some(Self::NoPersistAtStop),
            "existing_any_session" => Some(Self::ExistingAnySession),
            "waiter_sleeps_to_deadline" => Some(Self::WaiterSleepsToDeadline),
            "group_member_outcome_ignored" => Some(Self::GroupMemberOutcomeIgnored),
            "group_no_lease_guard" => Some(Self::GroupNoLeaseGuard),
            "group_same_key" => Some(Self::GroupSameKey),
            "group_clock_in_member" => Some(Self::GroupClockInMember),
            "group_answer_lost" => Some(Self::GroupAnswerLost),
            "group_unknown_guessed" => Some(Self::GroupUnknownGuessed),
            "delay_rewatch_from_now" => Some(Self::DelayRewatchFromNow),
            "delay_watch_gap" => Some(Self::DelayWatchGap),
            "take_back_keeps_index" => Some(Self::TakeBackKeepsIndex),
            _ => None,
        }
    }

    /// A build without the feature `test-faults` knows no planted fault.
    #[cfg(not(feature = "test-faults"))]
    pub fn parse(_name: &str) -> Option<Self> {
        None
    }
}

/// Installs the planted bugs for this process (once; later calls are ignored).
#[cfg(feature = "test-faults")]
pub fn install(faults: &[TestFault]) {
    if faults.is_empty() {
        return;
    }
    for f in faults {
        tracing::error!(fault = ?f, "TEST FAULT PLANTED: this arbiter is deliberately unsafe (release gate only)");
    }
    let _ = ACTIVE.set(faults.to_vec());
}

/// Without the feature there is nothing to install.
#[cfg(not(feature = "test-faults"))]
pub fn install(_faults: &[TestFault]) {}

/// Whether `fault` is planted in this process.
#[cfg(feature = "test-faults")]
pub fn on(fault: TestFault) -> bool {
    ACTIVE.get().is_some_and(|v| v.contains(&fault))
}

/// The TTL a new session lease of `class` is granted: `ttl_s`, or with
/// [`TestFault::StaleSessionTtl`] planted the first TTL this process saw for
/// the class.
#[cfg(feature = "test-faults")]
pub(crate) fn lease_ttl(class: &str, ttl_s: u64) -> u64 {
    static FIRST: OnceLock<std::sync::Mutex<std::collections::HashMap<String, u64>>> = OnceLock::new();
    if !on(TestFault::StaleSessionTtl) {
        return ttl_s;
    }
    let mut m = FIRST.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *m.entry(class.to_owned()).or_insert(ttl_s) // PLANTED BUG (release gate): a stale TTL.
}

/// Without the feature a lease gets the class's TTL.
#[cfg(not(feature = "test-faults"))]
#[inline(always)]
pub(crate) fn lease_ttl(_class: &str, ttl_s: u64) -> u64 {
    ttl_s
}

/// Without the feature no fault is ever planted.
#[cfg(not(feature = "test-faults"))]
#[inline(always)]
pub const fn on(_fault: TestFault) -> bool {
    false
}

/// Whether this build can plant faults at all (feature `test-faults`).
pub(crate) const ENABLED: bool = cfg!(feature = "test-faults");
