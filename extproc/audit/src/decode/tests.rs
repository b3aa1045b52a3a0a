use super::*;

const ROOT: &str = "/t/a";
const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

fn hold(key: &str, owner: &str) -> Vec<u8> {
    serde_json::to_vec(&HoldRecord {
        key: key.into(),
        owner: owner.into(),
        instance: None,
        epoch: 1,
        class: "default".into(),
        acquired_ms: 1000,
        hold_id: None,
        unverified_caller: None,
        permits: None,
        mode: None,
        keys: None,
        attempt: None,
    })
    .unwrap()
}

/// A hold a self client took, naming `claimed` as its caller.
fn self_client_hold(key: &str, owner: &str, claimed: &str) -> Vec<u8> {
    let mut h: HoldRecord = serde_json::from_slice(&hold(key, owner)).unwrap();
    h.unverified_caller = Some(claimed.into());
    serde_json::to_vec(&h).unwrap()
}

fn put(key: String, value: Vec<u8>, lease: i64, create: i64) -> Change {
    Change { op: Op::Put, key: key.into_bytes(), value, lease, create_revision: create, prev: None }
}

fn del(key: String, prev: Vec<u8>, lease: i64, create: i64) -> Change {
    Change {
        op: Op::Delete,
        key: key.into_bytes(),
        value: Vec::new(),
        lease: 0,
        create_revision: 0,
        prev: Some(Prev { value: prev, lease, create_revision: create }),
    }
}

fn decode_at(rev: i64, changes: &[Change], closed: &dyn Fn(&str) -> bool) -> Decoded {
    let ctx = Context { root: ROOT, cluster_id: "00000000000000aa", timeline: 0, epoch: 1, now_ms: 5000, closed };
    decode(&ctx, rev, changes)
}

fn kinds(d: &Decoded) -> Vec<EventKind> {
    d.events.iter().map(|e| e.kind).collect()
}

#[test]
fn a_lease_expiry_deletes_many_holds_at_one_revision_with_distinct_keys() {
    let session =
        serde_json::to_vec(&serde_json::json!({"owner":"spiffe://x/a","class":"default","ttl_s":3,"created_ms":1}))
            .unwrap();
    let changes = vec![
        del(format!("{ROOT}/l/{D1}/h/0000"), hold("a/one", "spiffe://x/a"), 0x1f, 10),
        del(format!("{ROOT}/l/{D2}/h/0000"), hold("a/two", "spiffe://x/a"), 0x1f, 11),
        del(format!("{ROOT}/s/000000000000001f"), session, 0x1f, 9),
    ];
    let d = decode_at(20, &changes, &|_| false);
    assert_eq!(kinds(&d), [EventKind::Expiry, EventKind::Expiry, EventKind::SessionExpiry]);
    assert_eq!(d.events[0].grant_revision, Some(10));
    assert_eq!(d.events[0].key.as_deref(), Some("a/one"));
    assert_eq!(d.events[1].digest.as_deref(), Some(D2));
    let keys: HashSet<String> = d.events.iter().map(AuditEvent::event_key).collect();
    assert_eq!(keys.len(), 3);
    // The same lease end after its holder closed the session: session releases.
    let d = decode_at(20, &changes, &|s| s == "000000000000001f");
    assert_eq!(kinds(&d), [EventKind::SessionRelease, EventKind::SessionRelease]);
}

#[test]
fn a_release_and_a_grant_at_one_revision_are_two_facts() {
    let marker = serde_json::to_vec(&serde_json::json!({"epoch":1,"revision":10,"released_ms":4242})).unwrap();
    let changes = vec![
        del(format!("{ROOT}/l/{D1}/h/0000"), hold("a/one", "spiffe://x/a"), 0x1f, 10),
        put(format!("{ROOT}/r/{D1}"), marker, 0x99, 20),
        put(format!("{ROOT}/l/{D1}/h/0001"), hold("a/one", "spiffe://x/b"), 0x2f, 20),
    ];
    let d = decode_at(20, &changes, &|_| false);
    assert_eq!(kinds(&d), [EventKind::Release, EventKind::Grant]);
    assert_eq!(d.events[0].at_ms, 4242);
    assert_eq!(d.events[1].identity.as_deref(), Some("spiffe://x/b"));
    assert_eq!(d.events[1].grant_revision, Some(20));
    assert_ne!(d.events[0].event_key(), d.events[1].event_key());
}

#[test]
fn a_marker_for_another_grant_does_not_make_a_release() {
    // The marker names grant 7; the deleted hold is grant 10 and its lease is alive.
    let marker = serde_json::to_vec(&serde_json::json!({"epoch":1,"revision":7,"released_ms":1})).unwrap();
    let changes = vec![
        del(format!("{ROOT}/l/{D1}/h/0000"), hold("a/one", "spiffe://x/a"), 0x1f, 10),
        put(format!("{ROOT}/r/{D1}"), marker, 0x99, 20),
    ];
    assert_eq!(kinds(&decode_at(20, &changes, &|_| false)), [EventKind::UnmarkedDelete]);
}

#[test]
fn force_records_epoch_purges_policies_and_close_markers() {
    let force =
        serde_json::to_vec(&serde_json::json!({"requester":"alice","approver":"bob","reason":"stuck"})).unwrap();
    let changes = vec![
        del(format!("{ROOT}/l/{D1}/h/0000"), hold("a/one", "spiffe://x/a"), 0x1f, 10),
        put(format!("{ROOT}/f/{D1}"), force.clone(), 0, 30),
        put(format!("{ROOT}/f/{D2}"), force, 0, 30),
    ];
    let d = decode_at(30, &changes, &|_| false);
    assert_eq!(kinds(&d), [EventKind::ForceRelease, EventKind::ForceRecord]);
    assert_eq!(d.events[0].detail.as_ref().unwrap()["approver"], "bob");

    let rec =
        serde_json::to_vec(&serde_json::json!({"epoch":2,"cluster_id":"00000000000000aa","sealed":"x","target":2}))
            .unwrap();
    let changes = vec![
        put(format!("{ROOT}/sys/epoch"), rec, 0, 1),
        del(format!("{ROOT}/l/{D1}/h/0000"), hold("a/one", "spiffe://x/a"), 0x1f, 10),
    ];
    let d = decode_at(40, &changes, &|_| false);
    assert_eq!(kinds(&d), [EventKind::Epoch, EventKind::EpochPurge]);
    assert_eq!(d.epoch, Some(2));
    assert_eq!(d.events[0].epoch, 2);

    let pol = serde_json::to_vec(&serde_json::json!({"limit":2,"last":{"at_ms":777}})).unwrap();
    let close = serde_json::to_vec(&serde_json::json!({"closed_ms":888})).unwrap();
    let changes = vec![
        put(format!("{ROOT}/c/default"), pol, 0, 3),
        put(format!("{ROOT}/x/000000000000001f"), close, 0x99, 50),
        put(format!("{ROOT}/v/vm/default"), b"x".to_vec(), 0x1f, 50),
        put("/t/other/l/x/h/0000".into(), b"x".to_vec(), 0x1f, 50),
    ];
    let d = decode_at(50, &changes, &|_| false);
    assert_eq!(kinds(&d), [EventKind::LimitChange, EventKind::SessionClose]);
    assert_eq!((d.events[0].at_ms, d.events[1].at_ms), (777, 888));
    assert_eq!(d.closed, ["000000000000001f"]);
}

#[test]
fn shipped_unprotected_records_are_events_whose_key_ignores_the_ship_revision() {
    use lockmesh_keyspace::spool::{SpoolOp, SpoolRecord};
    let rec = |op| SpoolRecord {
        op,
        grant: "0123456789abcdef0123456789abcdef".into(),
        key: "jobs/a".into(),
        digest: D1.into(),
        class: "batch".into(),
        identity: "spiffe://x/a".into(),
        instance: None,
        hold_id: None,
        epoch: 1,
        cluster: "coord".into(),
        outage: "coord-1700000000000".into(),
        at_ms: 1234,
        ttl_s: (op == SpoolOp::Grant).then_some(30),
        reason: None,
    };
    let g = format!("{ROOT}/u/0123456789abcdef0123456789abcdef/grant");
    let r = format!("{ROOT}/u/0123456789abcdef0123456789abcdef/release");
    let first = decode_at(
        40,
        &[
            put(g.clone(), serde_json::to_vec(&rec(SpoolOp::Grant)).unwrap(), 9, 40),
            put(r.clone(), serde_json::to_vec(&rec(SpoolOp::Release)).unwrap(), 9, 40),
        ],
        &|_| false,
    );
    assert_eq!(kinds(&first), [EventKind::Grant, EventKind::Release]);
    let e = &first.events[0];
    assert!(e.unprotected && e.revision == 0 && e.grant_revision.is_none() && e.session.is_none());
    assert_eq!((e.key.as_deref(), e.class.as_deref(), e.at_ms), (Some("jobs/a"), Some("batch"), 1234));
    let detail = e.detail.as_ref().unwrap();
    assert_eq!(detail["grant_id"], "0123456789abcdef0123456789abcdef");
    assert_eq!(
        (detail["outage"].as_str(), detail["shipped_revision"].as_i64()),
        (Some("coord-1700000000000"), Some(40))
    );
    // Shipped again (a crash before the spool was cut): the same event keys.
    let again = decode_at(57, &[put(g, serde_json::to_vec(&rec(SpoolOp::Grant)).unwrap(), 11, 57)], &|_| false);
    assert_eq!(again.events[0].event_key(), first.events[0].event_key());
    // Its lease's end deletes the key: no event.
    let gone = decode_at(90, &[del(r, Vec::new(), 9, 40)], &|_| false);
    assert!(gone.events.is_empty());
    // A protected hold's events are not marked.
    let p = decode_at(91, &[put(format!("{ROOT}/l/{D2}/h/0000"), hold("a/two", "spiffe://x/a"), 7, 91)], &|_| false);
    assert!(!p.events[0].unprotected);
}

#[test]
fn the_arbiters_typed_records_decode_a_transparent_release_and_a_session_open() {
    // As vm.rs writes it: no epoch, `transparent`; the hold goes with its marker.
    let marker =
        serde_json::to_vec(&ReleaseMarker { epoch: None, released_ms: 4343, revision: 10, transparent: true }).unwrap();
    let session = SessionRecord {
        owner: "spiffe://x/a".into(),
        instance: Some("i-1".into()),
        class: "default".into(),
        ttl_s: 15,
        created_ms: 77,
        ns: None,
        by_acquire: false,
    };
    let changes = vec![
        del(format!("{ROOT}/l/{D1}/h/0000"), hold("a/one", "spiffe://x/a"), 0x1f, 10),
        put(format!("{ROOT}/r/{D1}"), marker, 0x99, 20),
        put(format!("{ROOT}/s/000000000000002f"), serde_json::to_vec(&session).unwrap(), 0x2f, 20),
    ];
    let d = decode_at(20, &changes, &|_| false);
    assert_eq!(kinds(&d), [EventKind::Release, EventKind::SessionOpen]);
    assert_eq!(d.events[0].at_ms, 4343);
    let open = &d.events[1];
    assert_eq!(
        (open.identity.as_deref(), open.instance.as_deref(), open.at_ms),
        (Some("spiffe://x/a"), Some("i-1"), 77)
    );
    assert_eq!(open.detail, Some(serde_json::json!({ "ttl_s": 15 })));
}

#[test]
fn a_self_clients_claimed_caller_is_kept_as_unverified_beside_the_holder() {
    let (owner, claimed) = ("spiffe://x/ns/pay/sa/orders", "spiffe://x/ns/billing/sa/boss");
    let held = self_client_hold("a/one", owner, claimed);
    let d = decode_at(10, &[put(format!("{ROOT}/l/{D1}/h/0000"), held.clone(), 0x1f, 10)], &|_| false);
    assert_eq!(kinds(&d), [EventKind::Grant]);
    assert_eq!(d.events[0].identity.as_deref(), Some(owner), "the holder is the self client itself");
    assert_eq!(d.events[0].detail.as_ref().unwrap()[UNVERIFIED_CALLER], claimed);
    // A force release keeps its record's fields and adds the claimed caller.
    let force = serde_json::to_vec(&serde_json::json!({"requester":"alice","approver":"bob"})).unwrap();
    let changes =
        vec![del(format!("{ROOT}/l/{D1}/h/0000"), held, 0x1f, 10), put(format!("{ROOT}/f/{D1}"), force, 0, 30)];
    let d = decode_at(30, &changes, &|_| false);
    assert_eq!(kinds(&d), [EventKind::ForceRelease]);
    let detail = d.events[0].detail.as_ref().unwrap();
    assert_eq!((detail["approver"].as_str(), detail[UNVERIFIED_CALLER].as_str()), (Some("bob"), Some(claimed)));
    // A vouched hold has none.
    let d = decode_at(10, &[put(format!("{ROOT}/l/{D1}/h/0000"), hold("a/one", owner), 0x1f, 10)], &|_| false);
    assert_eq!(d.events[0].detail, None);
}

#[test]
fn a_lock_delay_record_is_its_own_event_with_the_cause_and_delay() {
    let rec = serde_json::to_vec(&serde_json::json!({"cause":"expiry","delay_s":15,"seen_ms":4321})).unwrap();
    let d = decode_at(30, &[put(format!("{ROOT}/d/{D1}"), rec, 0x2a, 30)], &|_| false);
    assert_eq!(kinds(&d), [EventKind::LockDelay]);
    let e = &d.events[0];
    assert_eq!((e.digest.as_deref(), e.at_ms), (Some(D1), 4321));
    assert_eq!(e.detail.as_ref().unwrap()["cause"], "expiry");
    // The guard (`g/`) and the record's end by its lease are no events.
    let guard = serde_json::to_vec(&serde_json::json!({"session":"000000000000001f"})).unwrap();
    let d = decode_at(31, &[put(format!("{ROOT}/g/{D1}"), guard, 0, 31)], &|_| false);
    assert!(d.events.is_empty());
}

#[test]
fn a_shadow_record_is_a_would_refuse_or_would_grant_event_of_its_class() {
    let rec = |decision: &str| {
        serde_json::to_vec(&serde_json::json!({"at_ms": 777, "candidate": 1, "class": "payments", "count": 3,
            "decision": decision, "digest": D1, "enforced": 2, "reason": "key_gated"}))
        .unwrap()
    };
    let d = decode_at(40, &[put(format!("{ROOT}/w/payments"), rec("would_refuse"), 0, 40)], &|_| false);
    assert_eq!(kinds(&d), [EventKind::WouldRefuse]);
    let e = &d.events[0];
    assert_eq!((e.class.as_deref(), e.digest.as_deref(), e.at_ms), (Some("payments"), Some(D1), 777));
    assert_eq!((e.detail.as_ref().unwrap()["count"].as_u64(), e.key.as_deref()), (Some(3), None));
    let d = decode_at(41, &[put(format!("{ROOT}/w/payments"), rec("would_grant"), 0, 41)], &|_| false);
    assert_eq!(kinds(&d), [EventKind::WouldGrant]);
}
