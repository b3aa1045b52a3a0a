use super::*;
use crate::history::{ClientOp, Segment, StoreWrite};

const ROOT: &str = "/g";
const D: &str = "d0";

fn ev(rev: i64, put: bool, key: &str, value: &str, create: i64, prev: Option<&str>) -> EtcdEvent {
    EtcdEvent {
        revision: rev,
        put,
        key: key.to_owned(),
        value: value.to_owned(),
        create_revision: create,
        lease: 7,
        prev_value: prev.map(str::to_owned),
        prev_create_revision: None,
        observed_us: u64::try_from(rev).unwrap() * 1000,
    }
}

fn epoch(rev: i64, e: u64) -> EtcdEvent {
    ev(rev, true, "/g/sys/epoch", &format!(r#"{{"epoch":{e},"cluster_id":"1"}}"#), 1, None)
}

fn grant(rev: i64, slot: u32, key: &str, e: u64) -> EtcdEvent {
    let k = format!("{ROOT}/l/{D}/h/{slot:04}");
    ev(rev, true, &k, &format!(r#"{{"key":"{key}","epoch":{e},"owner":"x"}}"#), rev, None)
}

fn del(rev: i64, slot: u32) -> EtcdEvent {
    ev(rev, false, &format!("{ROOT}/l/{D}/h/{slot:04}"), "", 0, Some("{}"))
}

fn marker(rev: i64, e: u64, r: i64) -> EtcdEvent {
    ev(rev, true, &format!("{ROOT}/r/{D}"), &format!(r#"{{"epoch":{e},"revision":{r}}}"#), rev, None)
}

fn op(op: &str, token: u64, call: u64, ret: u64) -> ClientOp {
    ClientOp {
        process: "h0".into(),
        op: op.into(),
        key: "k/a".into(),
        token: Some(token),
        call_us: call,
        ret_us: ret,
        outcome: Outcome::Ok,
        status: 200,
        code: None,
        skew_ms: 0,
        valid_until_us: None,
        session: None,
        ..Default::default()
    }
}

fn base(events: Vec<EtcdEvent>) -> History {
    History {
        root: ROOT.into(),
        limits: vec![("k/sem".into(), 3)],
        segments: vec![Segment { base_revision: 0, bump: 0, events }],
        ..History::default()
    }
}

fn t(e: u64, r: i64) -> u64 {
    token_of(e, r)
}

fn checks(h: &History) -> Vec<&'static str> {
    let verdict = check(h, Duration::from_secs(5));
    verdict.violations().iter().map(|v| v.check).collect()
}

#[test]
fn a_correct_history_passes() {
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(3, 0), marker(3, 1, 2), grant(4, 0, "k/a", 1)]);
    h.ops = vec![
        op("acquire", t(1, 2), 1000, 2500),
        op("release", t(1, 2), 2600, 3500),
        op("acquire", t(1, 4), 3000, 4500),
    ];
    h.writes = vec![
        StoreWrite { resource: "/items/a".into(), lock_key: "k/a".into(), token: t(1, 2), body: String::new() },
        StoreWrite { resource: "/items/a".into(), lock_key: "k/a".into(), token: t(1, 4), body: String::new() },
    ];
    let v = check(&h, Duration::from_secs(5));
    assert!(v.passed(), "{}", v.explain());
}

#[test]
fn a_hand_off_in_one_transaction_is_a_release_then_a_grant() {
    // The watch lists the successor's put (slot 0's other name) before the
    // release's delete: one revision, deletes first, one holder throughout.
    let alt = format!("{ROOT}/l/{D}/h/0000.1");
    let next = ev(3, true, &alt, r#"{"key":"k/a","epoch":1,"owner":"y"}"#, 3, None);
    let h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), next, marker(3, 1, 2), del(3, 0)]);
    assert_eq!(checks(&h), Vec::<&str>::new());
    // Without the delete the successor is a second holder.
    let next = ev(3, true, &alt, r#"{"key":"k/a","epoch":1,"owner":"y"}"#, 3, None);
    let h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), next]);
    assert_eq!(checks(&h), vec!["holders_within_limit"]);
}

#[test]
fn a_second_mutex_holder_is_caught() {
    let h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), grant(3, 1, "k/a", 1)]);
    assert_eq!(checks(&h), vec!["holders_within_limit"]);
    // Three holders of a semaphore key with N = 3 are fine, a fourth is not.
    let sem = |r, s| grant(r, s, "k/sem/1", 1);
    let h = base(vec![epoch(1, 1), sem(2, 0), sem(3, 1), sem(4, 2)]);
    assert!(checks(&h).is_empty());
    let h = base(vec![epoch(1, 1), sem(2, 0), sem(3, 1), sem(4, 2), sem(5, 1003)]);
    assert_eq!(checks(&h), vec!["holders_within_limit"]);
}

#[test]
fn a_stale_epoch_grant_and_a_grant_while_sealed_are_caught() {
    let h = base(vec![epoch(1, 1), epoch(2, 2), grant(3, 0, "k/a", 1)]);
    assert_eq!(checks(&h), vec!["grant_epoch_current"]);
    let sealed = ev(2, true, "/g/sys/epoch", r#"{"epoch":1,"cluster_id":"1","sealed":"advance"}"#, 1, None);
    let h = base(vec![epoch(1, 1), sealed, grant(3, 0, "k/a", 1)]);
    assert_eq!(checks(&h), vec!["grant_epoch_current"]);
}

#[test]
fn a_release_that_frees_a_successor_is_caught() {
    // Grant 2 released at 3; grant 4 deleted at 5 by a release naming grant 2.
    let h = base(vec![
        epoch(1, 1),
        grant(2, 0, "k/a", 1),
        del(3, 0),
        marker(3, 1, 2),
        grant(4, 0, "k/a", 1),
        del(5, 0),
        marker(5, 1, 2),
    ]);
    assert_eq!(checks(&h), vec!["release_frees_only_its_grant"]);
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(3, 0), grant(4, 0, "k/a", 1)]);
    h.ops = vec![op("release", t(1, 2), 3500, 3600)];
    assert_eq!(checks(&h), vec!["release_of_open_grant"]);
}

#[test]
fn a_fence_that_accepts_a_lower_token_is_caught() {
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(3, 0), grant(4, 0, "k/a", 1)]);
    let w = |tok| StoreWrite { resource: "/items/a".into(), lock_key: "k/a".into(), token: tok, body: String::new() };
    h.writes = vec![w(t(1, 4)), w(t(1, 2))];
    assert_eq!(checks(&h), vec!["fence_monotonic"]);
    h.writes = vec![w(t(1, 99))];
    assert_eq!(checks(&h), vec!["fence_genuine"]);
}

#[test]
fn tokens_must_increase_across_a_restore() {
    // Segment 0 hands out revision 10; the restore goes back to revision 5 and a
    // grant there in epoch 1 (revision 7) is handed out: lower than before.
    let mut h = base(vec![epoch(1, 1), grant(10, 0, "k/a", 1), del(11, 0), marker(11, 1, 10)]);
    h.segments.push(Segment { base_revision: 5, bump: 0, events: vec![grant(7, 0, "k/a", 1)] });
    h.ops = vec![op("acquire", t(1, 10), 9000, 10_500), op("acquire", t(1, 7), 6000, 7500)];
    assert_eq!(checks(&h), vec!["tokens_increase", "restore_serves_new_epoch"]);
    // After an epoch advance the same revision gives a greater token: fine.
    h.segments[1].events = vec![epoch(6, 2), grant(7, 0, "k/a", 2)];
    h.ops[1].token = Some(t(2, 7));
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    // A token no committed grant carries.
    h.ops[1].token = Some(t(2, 8));
    assert_eq!(checks(&h), vec!["tokens_increase"]);
}

#[test]
fn nothing_is_granted_or_renewed_in_a_quorum_loss_window() {
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1)]);
    h.quorum_loss = vec![(10_000_000, 20_000_000)];
    let mut k = op("keepalive", t(1, 2), 14_000_000, 14_100_000);
    h.ops = vec![k.clone()];
    assert_eq!(checks(&h), vec!["quorum_loss_grants_nothing"]);
    // Within the grace an old leader may still answer; a refusal is always fine.
    k.call_us = 11_000_000;
    h.ops = vec![k.clone()];
    assert!(checks(&h).is_empty());
    k.call_us = 14_000_000;
    k.outcome = Outcome::Unknown;
    h.ops = vec![k];
    assert!(checks(&h).is_empty());
}

#[test]
fn a_checker_that_runs_out_of_time_fails() {
    let mut events = vec![epoch(1, 1)];
    for r in 2..5000 {
        events.push(grant(r, 0, "k/a", 1));
        events.push(del(r, 0));
    }
    let h = base(events);
    let v = check(&h, Duration::ZERO);
    assert!(matches!(v, Verdict::TimedOut { .. }), "{}", v.explain());
    assert!(!v.passed());
    assert!(v.explain().contains("did not finish"), "{}", v.explain());
    assert!(check(&h, Duration::from_secs(30)).passed());
}

#[test]
fn an_incomplete_history_fails() {
    let mut h = base(vec![]);
    h.gaps.push("watch compacted at 7".into());
    assert!(!check(&h, Duration::from_secs(1)).passed());
}

/// A put of `key` on lease `lease` (a session record, a hold on that session).
fn on_lease(mut e: EtcdEvent, lease: i64) -> EtcdEvent {
    e.lease = lease;
    e
}

fn session(rev: i64, lease: i64) -> EtcdEvent {
    on_lease(ev(rev, true, &format!("{ROOT}/s/{lease:016x}"), r#"{"owner":"x"}"#, rev, None), lease)
}

fn session_end(rev: i64, lease: i64) -> EtcdEvent {
    ev(rev, false, &format!("{ROOT}/s/{lease:016x}"), "", 0, Some("{}"))
}

#[test]
fn a_successor_deleted_without_a_marker_is_caught() {
    // Grant 2 is released at 3; grant 4, handed to a client, is deleted at 5
    // with nothing in that transaction saying why.
    let events =
        || vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(3, 0), marker(3, 1, 2), grant(4, 0, "k/a", 1), del(5, 0)];
    let mut h = base(events());
    h.ops = vec![op("acquire", t(1, 2), 1000, 2500), op("acquire", t(1, 4), 3000, 4500)];
    assert_eq!(checks(&h), vec!["deleted_hold_accounted"]);
    let v = check(&h, Duration::from_secs(5));
    assert!(v.explain().contains("no release marker naming it"), "{}", v.explain());
    // A grant no client was answered with may be taken back by its arbiter.
    h.ops.pop();
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
}

#[test]
fn an_expiry_a_close_a_force_release_and_an_epoch_advance_account_for_a_delete() {
    let acquired = vec![op("acquire", t(1, 3), 1000, 3500)];
    let held = || vec![epoch(1, 1), session(2, 0x51), on_lease(grant(3, 0, "k/a", 1), 0x51)];
    // The session's lease ends (expiry or close): its record and hold go in one revision.
    let mut h = base([held(), vec![session_end(4, 0x51), del(4, 0)]].concat());
    h.ops = acquired.clone();
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    // Another session ending in that revision does not account for it.
    let mut h = base([held(), vec![session(4, 0x52), session_end(5, 0x52), del(5, 0)]].concat());
    h.ops = acquired.clone();
    assert_eq!(checks(&h), vec!["deleted_hold_accounted"]);
    // A force release writes its record in the transaction that deletes the hold.
    let force = ev(4, true, &format!("{ROOT}/f/{D}"), r#"{"request_id":"r1"}"#, 4, None);
    let mut h = base([held(), vec![force, del(4, 0)]].concat());
    h.ops = acquired.clone();
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    // A force record of another key does not.
    let other = ev(4, true, &format!("{ROOT}/f/d9"), r#"{"request_id":"r1"}"#, 4, None);
    let mut h = base([held(), vec![other, del(4, 0)]].concat());
    h.ops = acquired.clone();
    assert_eq!(checks(&h), vec!["deleted_hold_accounted"]);
    // The epoch advance deletes every hold with the record's put.
    let mut h = base([held(), vec![epoch(4, 2), del(4, 0)]].concat());
    h.ops = acquired.clone();
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    // Sealing the record (same epoch) is no advance.
    let sealed = ev(4, true, "/g/sys/epoch", r#"{"epoch":1,"cluster_id":"1","sealed":"advance"}"#, 1, None);
    let mut h = base([held(), vec![sealed, del(4, 0)]].concat());
    h.ops = acquired;
    assert_eq!(checks(&h), vec!["deleted_hold_accounted"]);
}

#[test]
fn a_transparent_release_marker_is_read() {
    // The filter's release marker has no epoch: it names the hold by revision.
    let vm = |rev, r: i64| {
        let value = format!(r#"{{"released_ms":5,"revision":{r},"transparent":true}}"#);
        ev(rev, true, &format!("{ROOT}/r/{D}"), &value, rev, None)
    };
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(3, 0), vm(3, 2)]);
    h.ops = vec![op("acquire", t(1, 2), 1000, 2500)];
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    let Verdict::Pass(s) = check(&h, Duration::from_secs(5)) else { unreachable!() };
    assert_eq!((s.releases, s.deletes), (1, 1));
    // One naming another hold frees a successor: seen, not skipped.
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(3, 0), vm(3, 2), grant(4, 0, "k/a", 1)]);
    h.segments[0].events.extend([del(5, 0), vm(5, 2)]);
    h.ops = vec![op("acquire", t(1, 4), 3000, 4500)];
    assert_eq!(checks(&h), vec!["release_frees_only_its_grant"]);
}

#[test]
fn a_bumped_restore_served_in_the_old_epoch_is_caught_though_tokens_rise() {
    // The restore goes back to revision 5 with a bump of 100: the regrant at
    // revision 107 in epoch 1 carries a greater token, yet it was served
    // before the epoch advance.
    let mut h = base(vec![epoch(1, 1), grant(10, 0, "k/a", 1), del(11, 0), marker(11, 1, 10)]);
    h.segments.push(Segment { base_revision: 5, bump: 100, events: vec![grant(107, 0, "k/a", 1)] });
    h.ops = vec![op("acquire", t(1, 10), 9000, 10_500), op("acquire", t(1, 107), 106_000, 107_500)];
    assert_eq!(checks(&h), vec!["restore_serves_new_epoch"]);
    // A grant nobody was answered with (taken back) is not reported.
    h.ops.pop();
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    // In the advanced epoch: fine.
    h.segments[1].events = vec![epoch(106, 2), grant(107, 0, "k/a", 2)];
    h.ops.push(op("acquire", t(2, 107), 106_000, 107_500));
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
}

#[test]
fn a_grant_past_a_lowered_authoritative_limit_is_caught() {
    let policy =
        |rev: i64, limit: u32| ev(rev, true, "/g/c/sem", &format!(r#"{{"limit":{limit},"state":"active"}}"#), 2, None);
    let mut h = base(vec![epoch(1, 1), policy(2, 3), grant(3, 0, "k/sem/a", 1), grant(4, 1, "k/sem/a", 1)]);
    h.classes = vec![("k/sem".into(), "sem".into())];
    assert!(checks(&h).is_empty(), "two of three: {:?}", checks(&h));
    h.segments[0].events.insert(3, policy(4, 1));
    h.segments[0].events[4].revision = 5;
    assert_eq!(checks(&h), vec!["holders_within_limit"], "two holds under a limit lowered to 1");
}

#[test]
fn a_durable_arrival_that_overtakes_a_queued_waiter_is_caught() {
    let waiter = |rev: i64, name: &str| ev(rev, true, &format!("/g/q/{D}/{name}"), "{}", rev, None);
    let left = |rev: i64, name: &str| ev(rev, false, &format!("/g/q/{D}/{name}"), "", 0, Some("{}"));
    let mut h = base(vec![epoch(1, 1), waiter(2, "w1"), waiter(3, "w2"), left(4, "w1"), grant(4, 0, "k/dur/a", 1)]);
    h.durable = vec!["k/dur".into()];
    assert!(checks(&h).is_empty(), "the oldest waiter's grant: {:?}", checks(&h));
    // The younger waiter granted itself past the older one.
    h.segments[0].events =
        vec![epoch(1, 1), waiter(2, "w1"), waiter(3, "w2"), left(4, "w2"), grant(4, 0, "k/dur/a", 1)];
    assert_eq!(checks(&h), vec!["durable_order_kept"]);
    // An arrival while w1 waits.
    h.segments[0].events = vec![epoch(1, 1), waiter(2, "w1"), grant(4, 0, "k/dur/a", 1)];
    assert_eq!(checks(&h), vec!["durable_order_kept"]);
}

#[test]
fn an_sdk_claim_outliving_its_hold_is_caught() {
    let claim =
        |until: u64| ClientOp { op: "valid".into(), valid_until_us: Some(until), ..op("valid", t(1, 2), 3000, 3000) };
    let other = ClientOp { process: "h1".into(), ..op("acquire", t(1, 5), 4000, 6000) };
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(4, 0), grant(5, 0, "k/a", 1)]);
    h.ops = vec![op("acquire", t(1, 2), 1000, 2500), claim(9000), other.clone()];
    // The hold was deleted by no marker or session end here, so only look at the claim check.
    assert!(checks(&h).contains(&"sdk_deadline_conservative"), "{:?}", checks(&h));
    // A deadline before the successor's answer is honest.
    h.ops[1] = claim(5000);
    assert!(!checks(&h).contains(&"sdk_deadline_conservative"), "{:?}", checks(&h));
    // So is a successor after the claimant's own release call.
    h.ops[1] = claim(9000);
    h.ops.push(op("release", t(1, 2), 3500, 3900));
    assert!(!checks(&h).contains(&"sdk_deadline_conservative"), "{:?}", checks(&h));
    // A claim of no time left (the deadline at or before the claim) claims nothing:
    // a holder woken from a pause reads zero after a successor was granted.
    h.ops.pop();
    h.ops[1] = ClientOp { op: "valid".into(), valid_until_us: Some(7000), ..op("valid", t(1, 2), 7000, 7000) };
    assert!(!checks(&h).contains(&"sdk_deadline_conservative"), "{:?}", checks(&h));
    // A release etcd committed (the release marker with the delete) but whose
    // call no client recorded (in flight when the history ended): released.
    h.ops[1] = claim(9000);
    h.segments[0].events = vec![epoch(1, 1), grant(2, 0, "k/a", 1), del(4, 0), marker(4, 1, 2), grant(5, 0, "k/a", 1)];
    assert!(!checks(&h).contains(&"sdk_deadline_conservative"), "{:?}", checks(&h));
    // A successor committed before that release is still caught.
    let other_early = ClientOp { process: "h1".into(), ..op("acquire", t(1, 3), 3500, 3600) };
    h.segments[0].events = vec![
        epoch(1, 1),
        grant(2, 0, "k/a", 1),
        grant(3, 1, "k/a", 1),
        del(4, 0),
        marker(4, 1, 2),
        grant(5, 0, "k/a", 1),
    ];
    h.ops.push(other_early);
    assert!(checks(&h).contains(&"sdk_deadline_conservative"), "{:?}", checks(&h));
}

#[test]
fn transparent_requests_are_held_to_their_grants_and_holds() {
    use crate::history::{Fault, UpstreamExec};
    let exec = |token: Option<u64>, arrived: u64, left: Option<u64>| UpstreamExec {
        key: "k/t/0".into(),
        token,
        process: "t0".into(),
        arrived_us: arrived,
        left_us: left,
    };
    let session = |rev: i64, put: bool| ev(rev, put, "/g/s/00000000000000aa", if put { "{}" } else { "" }, rev, None);
    let tmarker = |rev: i64, r: i64| {
        ev(rev, true, &format!("{ROOT}/r/{D}"), &format!(r#"{{"revision":{r},"transparent":true}}"#), rev, None)
    };
    // Granted at revision 3 (observed at 3 ms), released at revision 9 (9 ms).
    let released = vec![epoch(1, 1), session(2, true), grant(3, 0, "k/t/0", 1), del(9, 0), tmarker(9, 3)];
    let mut h = base(released.clone());
    h.upstream = vec![exec(Some(t(1, 3)), 4000, Some(8000))];
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    // A request reset before its answer is checked for its token only.
    h.upstream = vec![exec(Some(t(1, 3)), 4000, None)];
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    // Released while the request was still at the upstream.
    h.upstream = vec![exec(Some(t(1, 3)), 4000, Some(9500))];
    assert_eq!(checks(&h), vec!["transparent_hold_spans_request"]);
    // Forwarded without a token, or with a token no grant of the key carries.
    h.upstream = vec![exec(None, 4000, Some(5000)), exec(Some(t(1, 4)), 4000, Some(5000))];
    assert_eq!(checks(&h), vec!["transparent_forwarded_under_grant", "transparent_forwarded_under_grant"]);
    // Its session ended (expired) at revision 9 while the request was there.
    let expired = vec![epoch(1, 1), session(2, true), grant(3, 0, "k/t/0", 1), session(9, false), del(9, 0)];
    let mut h = base(expired);
    h.upstream = vec![exec(Some(t(1, 3)), 4000, Some(9500))];
    assert_eq!(checks(&h), vec!["transparent_renewed"], "no fault: the renewal itself failed");
    let fault =
        |kind: &str, detail: &str| Fault { kind: kind.into(), detail: detail.into(), start_us: 1000, end_us: 6000 };
    for (f, excused) in [
        (fault("sidecar_kill", "sidecar killed"), true),
        (fault("cluster_partition", "coord cut from every arbiter"), true),
        (fault("cluster_partition", "shard-a cut from every arbiter"), false),
        (fault("policy_change", "gatesem limit -> 2"), false),
    ] {
        h.faults = vec![f.clone()];
        assert_eq!(checks(&h).is_empty(), excused, "{f:?}: {:?}", checks(&h));
    }
    // Expired after the request left: nothing to say.
    h.faults.clear();
    h.upstream = vec![exec(Some(t(1, 3)), 4000, Some(8000))];
    assert!(checks(&h).is_empty(), "{:?}", checks(&h));
}

#[test]
fn a_grant_inside_an_owed_or_running_lock_delay_is_caught() {
    let session = |rev: i64, put: bool| ev(rev, put, "/g/s/00000000000000aa", if put { "{}" } else { "" }, rev, None);
    let delay = |rev: i64, put: bool| ev(rev, put, &format!("{ROOT}/d/{D}"), if put { "{}" } else { "" }, rev, None);
    let close = |rev: i64| ev(rev, true, "/g/x/00000000000000aa", "{}", rev, None);
    let with = |events: Vec<EtcdEvent>| {
        let mut h = base(events);
        h.delayed = vec!["k".into()];
        h.ops = vec![op("acquire", t(1, 3), 2000, 3500)];
        h
    };
    let start = || vec![epoch(1, 1), session(2, true), grant(3, 0, "k/a", 1)];
    let expired = || [session(5, false), del(5, 0)];
    // Expired, the delay record written, ended by its lease, then granted: kept.
    let mut ok = start();
    ok.extend(expired());
    ok.extend([delay(6, true), delay(8, false), grant(9, 0, "k/a", 1)]);
    assert!(checks(&with(ok)).is_empty(), "{:?}", checks(&with(vec![])));
    // Granted while the record exists.
    let mut inside = start();
    inside.extend(expired());
    inside.extend([delay(6, true), grant(7, 0, "k/a", 1)]);
    assert_eq!(checks(&with(inside)), vec!["lock_delay_kept"]);
    // Granted after the expiry with no record at all (the delay owed).
    let mut owed = start();
    owed.extend(expired());
    owed.push(grant(6, 0, "k/a", 1));
    assert_eq!(checks(&with(owed.clone())), vec!["lock_delay_kept"]);
    // That grant released by its holder: the debt is settled, the next grant is
    // no second violation.
    let mut settled = owed.clone();
    settled.extend([marker(7, 1, 6), del(7, 0), grant(8, 0, "k/a", 1)]);
    assert_eq!(checks(&with(settled)), vec!["lock_delay_kept"]);
    // The same history for a class without a delay, or a hold no client was
    // answered with (an arbiter undoing its own grant), owes nothing.
    assert!(checks(&base(owed.clone())).is_empty());
    let mut unanswered = with(owed);
    unanswered.ops.clear();
    assert!(checks(&unanswered).is_empty());
    // The holder closed its session (close marker first): a release.
    let mut closed = start();
    closed.push(close(4));
    closed.extend(expired());
    closed.push(grant(6, 0, "k/a", 1));
    let mut closed = with(closed);
    closed.ops.push(op("close", t(1, 3), 3600, 3700));
    assert!(checks(&closed).is_empty(), "{:?}", checks(&closed));
}

/// A hold of `key` under digest `d`, slot 0, on lease 7.
fn grant_at(rev: i64, d: &str, key: &str, e: u64) -> EtcdEvent {
    ev(rev, true, &format!("{ROOT}/l/{d}/h/0000"), &format!(r#"{{"key":"{key}","epoch":{e},"owner":"x"}}"#), rev, None)
}

fn of(process: &str, o: ClientOp) -> ClientOp {
    ClientOp { process: process.into(), ..o }
}

fn keyed(key: &str, o: ClientOp) -> ClientOp {
    ClientOp { key: key.into(), ..o }
}

#[test]
fn a_multi_key_grant_hands_one_token_per_key_and_only_a_second_holder_of_one_key_is_caught() {
    // One transaction grants k/a and k/b: one revision, one token for both keys.
    let h0 = |key: &str| ClientOp { multi: true, ..keyed(key, op("acquire", t(1, 2), 1000, 2500)) };
    let mut h = base(vec![epoch(1, 1), grant_at(2, "d0", "k/a", 1), grant_at(2, "d1", "k/b", 1)]);
    h.ops = vec![h0("k/a"), h0("k/b")];
    assert_eq!(checks(&h), Vec::<&str>::new());
    // The same token of k/a handed to another holder too.
    h.ops.push(of("h1", keyed("k/a", op("acquire", t(1, 2), 1200, 2600))));
    let v = check(&h, Duration::from_secs(5));
    assert!(
        v.violations().iter().any(|x| x.explanation.contains("handed to two holders (h0 and h1)")),
        "{}",
        v.explain()
    );
    assert!(v.violations().iter().all(|x| x.check == "tokens_increase"), "{}", v.explain());
}

#[test]
fn two_leaders_of_one_election_are_caught_whatever_the_class_limit() {
    let policy = ev(2, true, "/g/c/lead", r#"{"limit":2}"#, 2, None);
    let mut h = base(vec![epoch(1, 1), policy, grant(3, 0, "k/lead/0", 1), grant(4, 1, "k/lead/0", 1)]);
    h.classes = vec![("k/lead".into(), "lead".into())];
    // Under a limit of 2 two holds pass the holder limit ...
    assert_eq!(checks(&h), Vec::<&str>::new());
    // ... but not as an election's leaderships.
    h.elections = vec!["k/lead".into()];
    assert_eq!(checks(&h), vec!["one_leader_per_term"]);
}

#[test]
fn a_hold_lost_to_a_close_its_holder_did_not_ask_for_is_caught() {
    let session = ev(2, true, "/g/s/0000000000000007", "{}", 2, None);
    // The close marker, then the revoke (the session record and the hold).
    let close = ev(4, true, "/g/x/0000000000000007", "{}", 4, None);
    let ended = ev(5, false, "/g/s/0000000000000007", "", 0, Some("{}"));
    let mut h = base(vec![epoch(1, 1), session, grant(3, 0, "k/a", 1), close, ended, del(5, 0)]);
    h.ops = vec![op("acquire", t(1, 3), 2500, 3500)];
    assert_eq!(checks(&h), vec!["close_only_when_asked"]);
    // Its SDK fenced the session for its expiry: the SDK closes nothing then.
    let fence = |code: &str, at: u64| ClientOp { token: None, code: Some(code.into()), ..op("fenced", 0, at, at) };
    h.ops.push(fence("session_expired", 3700));
    assert_eq!(checks(&h), vec!["close_only_when_asked"]);
    // A fence of an earlier round (before this acquire was called) is not this one.
    h.ops.push(fence("deadline", 2000));
    assert_eq!(checks(&h), vec!["close_only_when_asked"]);
    // Fenced past its deadline: the SDK closes the session itself, asked for.
    h.ops.push(fence("deadline", 3700));
    assert_eq!(checks(&h), Vec::<&str>::new());
    h.ops.truncate(1);
    // Its holder closed the session (or released the hold) first: asked for.
    h.ops.push(op("close", t(1, 3), 3600, 5500));
    assert_eq!(checks(&h), Vec::<&str>::new());
    // A close of an acquire-opened session: one transaction deletes the record
    // and puts the marker, then the revoke deletes what is left on the lease.
    let session = ev(2, true, "/g/s/0000000000000007", "{}", 2, None);
    let close = ev(4, true, "/g/x/0000000000000007", "{}", 4, None);
    let record = ev(4, false, "/g/s/0000000000000007", "", 0, Some("{}"));
    let mut h = base(vec![epoch(1, 1), session, grant(3, 0, "k/a", 1), close, record, del(5, 0)]);
    h.ops = vec![op("acquire", t(1, 3), 2500, 3500)];
    assert_eq!(checks(&h), vec!["close_only_when_asked"]);
    h.ops.push(op("release", t(1, 3), 3600, 5500));
    assert_eq!(checks(&h), Vec::<&str>::new());
}

#[test]
fn advisory_intervals_that_overlap_on_a_mutex_are_caught() {
    // h0's session ended at 3 (an expiry), h1 granted at 4: 1 ms apart, while h0
    // was told a TTL of 8 s at 1 ms (its interval runs to 1 ms + 7 s).
    let session = ev(1, true, "/g/s/0000000000000007", "{}", 1, None);
    let ended = ev(3, false, "/g/s/0000000000000007", "", 0, Some("{}"));
    let mut h = base(vec![epoch(1, 1), session, grant(2, 0, "k/a", 1), ended, del(3, 0), grant(4, 0, "k/a", 1)]);
    let first = op("acquire", t(1, 2), 1000, 2500);
    let second = ClientOp { ttl_ms: Some(3000), ..of("h1", op("acquire", t(1, 4), 3000, 4500)) };
    h.ops = vec![first.clone(), second];
    assert_eq!(checks(&h), Vec::<&str>::new(), "h0 does not keep the margin");
    h.ops[0] = ClientOp { ttl_ms: Some(8000), ..first.clone() };
    assert_eq!(checks(&h), vec!["advisory_intervals_within_limit"]);
    // Released before the other's answer: no overlap.
    h.ops.push(op("release", t(1, 2), 2800, 2900));
    assert_eq!(checks(&h), Vec::<&str>::new());
    // Three permits of four with one more permit beside them: within the limit;
    // with two more, not.
    let mut h = base(vec![epoch(1, 1), grant(2, 0, "k/sem/0", 1), grant(3, 1, "k/sem/0", 1)]);
    h.limits = vec![("k/sem".into(), 4)];
    let a = ClientOp { ttl_ms: Some(8000), permits: Some(3), ..keyed("k/sem/0", op("acquire", t(1, 2), 1000, 2500)) };
    let b = ClientOp { ttl_ms: Some(8000), permits: Some(1), ..keyed("k/sem/0", op("acquire", t(1, 3), 1000, 3500)) };
    h.ops = vec![a, of("h1", b.clone())];
    assert_eq!(checks(&h), Vec::<&str>::new());
    h.ops[1] = of("h1", ClientOp { permits: Some(2), ..b });
    assert_eq!(checks(&h), vec!["advisory_intervals_within_limit"]);
}

#[test]
fn a_waiter_left_waiting_on_a_free_key_is_caught_outside_fault_windows() {
    // k/x held from 2 ms, released at 3 ms; a waiter called at 2.5 ms is refused
    // 4 s later: free for 4 s while it waited.
    let mut h = base(vec![
        epoch(1, 1),
        grant_at(2, "d0", "k/x", 1),
        ev(3, false, "/g/l/d0/h/0000", "", 0, Some("{}")),
        ev(3, true, "/g/r/d0", r#"{"epoch":1,"revision":2}"#, 3, None),
    ]);
    let waited = ClientOp {
        outcome: Outcome::Fail,
        status: 409,
        token: None,
        ..of("h1", keyed("k/x", op("acquire", 0, 2500, 4_003_000)))
    };
    h.ops = vec![keyed("k/x", op("acquire", t(1, 2), 1000, 2200)), waited.clone()];
    assert_eq!(checks(&h), vec!["no_waiter_on_a_free_key"]);
    // Answered 2 s after the release: within the bound.
    h.ops[1] = ClientOp { ret_us: 2_003_000, ..waited.clone() };
    assert_eq!(checks(&h), Vec::<&str>::new());
    // A fault in force: not judged.
    h.ops[1] = waited;
    h.faults = vec![crate::history::Fault {
        kind: "arbiter_pause".into(),
        detail: String::new(),
        start_us: 1_000_000,
        end_us: 2_000_000,
    }];
    assert_eq!(checks(&h), Vec::<&str>::new());
}
