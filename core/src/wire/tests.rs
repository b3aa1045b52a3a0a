//! Round trips with the bodies the producers emit today. Each sample is built with
//! the producer's own `json!` expression (copied from the site named above it) and
//! checked twice: the typed value reads it, and writes exactly its bytes again.

use serde::{de::DeserializeOwned, Serialize};
use serde_json::json;

use super::{
    admin::*, api::*, audit::*, console::*, doctor::*, error::ErrorBody, inspect::*, opaque::Opaque, shard::*,
    status::*, vm::*,
};
use crate::{
    code::{AnyCode, AnyReason},
    Code, Reason,
};

const SID: &str = "000000000000002a";
const TOKEN: &str = "281474976710659"; // epoch 1, revision 3
const VM: &str = "0123456789abcdef0123456789abcdef";

/// `sample` reads as a `T` and that `T` writes `sample`'s bytes again.
#[track_caller]
fn same<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(sample: &str) -> T {
    let t: T = serde_json::from_str(sample).unwrap_or_else(|e| panic!("{sample}: {e}"));
    assert_eq!(serde_json::to_string(&t).unwrap(), sample);
    let again: T = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
    assert_eq!(again, t);
    t
}

#[test]
fn api_answers() {
    // extproc/src/api.rs, acquire (protected).
    let protected = json!({
        "token": TOKEN, "epoch": 1, "revision": 3, "session": SID, "ttl_s": 30, "class": "default",
        "existing": false, "new_session": true, "proof": null, "unprotected": false,
    })
    .to_string();
    assert_eq!(
        protected,
        r#"{"class":"default","epoch":1,"existing":false,"new_session":true,"proof":null,"revision":3,"session":"000000000000002a","token":"281474976710659","ttl_s":30,"unprotected":false}"#
    );
    let a: Acquired = same(&protected);
    assert_eq!(a.fencing_token().map(|t| (t.epoch(), t.revision())), Some((1, 3)));
    assert_eq!(a.session.map(|s| s.to_string()).as_deref(), Some(SID));
    // With a proof.
    let proved = protected.replace(r#""proof":null"#, r#""proof":"v1.k.p.s""#);
    assert_eq!(same::<Acquired>(&proved).proof.as_deref(), Some("v1.k.p.s"));
    // extproc/src/api.rs, acquire (unprotected, ADR-04).
    let unprotected = json!({
        "token": "0", "epoch": 1, "revision": 0, "session": null, "ttl_s": 15, "class": "cache",
        "existing": false, "new_session": false, "proof": null, "unprotected": true,
        "grant": "00112233445566778899aabbccddeeff", "outage": "coord-1700000000000",
    })
    .to_string();
    let u: Acquired = same(&unprotected);
    assert_eq!((u.fencing_token(), u.session, u.unprotected), (None, None, true));
    // release, both forms.
    same::<Released>(&json!({ "released": true }).to_string());
    assert!(same::<Released>(&json!({ "released": true, "unprotected": true }).to_string()).unprotected);
    // GET /v1/locks: one foreign holder, one own.
    let info = json!({
        "class": "default", "max_holders": 2, "waiting_here": 1,
        "holders": [
            { "identity": "spiffe://t/other", "age_ms": 12 },
            { "identity": "spiffe://t/me", "age_ms": 5, "token": TOKEN, "session": SID, "you": true },
        ],
    })
    .to_string();
    let i: LockInfo = same(&info);
    assert!(!i.holders[0].you && i.holders[1].you);
    same::<SessionOpened>(&json!({ "session": SID, "ttl_s": 30, "class": "default" }).to_string());
    same::<SessionRenewed>(&json!({ "session": SID, "ttl_s": 30 }).to_string());
    same::<SessionClosed>(&json!({ "closed": true }).to_string());
    let holds = json!({ "session": SID, "holds": [json!({
        "key": "payments/order-42", "token": TOKEN, "epoch": 1, "revision": 3, "class": "default",
        "acquired_ms": 1_700_000_000_000u64,
    })]})
    .to_string();
    assert_eq!(same::<SessionHolds>(&holds).holds[0].token.revision(), 3);
    same::<TokenValidity>(&json!({ "current": false }).to_string());
}

#[test]
fn api_readers_refuse_bad_tokens_and_sessions_and_ignore_new_members() {
    let bad_token = json!({ "session": SID, "holds": [{ "key": "k/1", "token": "0", "epoch": 0, "revision": 0,
        "class": "c", "acquired_ms": 0 }] });
    assert!(serde_json::from_value::<SessionHolds>(bad_token).is_err());
    let bad_session = json!({ "session": "2a", "ttl_s": 30, "class": "c" });
    assert!(serde_json::from_value::<SessionOpened>(bad_session).is_err());
    let newer = json!({ "session": SID, "ttl_s": 30, "class": "c", "region": "eu-1" });
    assert_eq!(serde_json::from_value::<SessionOpened>(newer).unwrap().ttl_s, 30);
}

#[test]
fn error_bodies() {
    // extproc/src/respond.rs via code::error_body.
    let e: ErrorBody = same(r#"{"code":"contended","message":"not granted","reason":"key_gated"}"#);
    assert_eq!((e.code.known(), e.reason.and_then(|r| r.known())), (Some(Code::Contended), Some(Reason::KeyGated)));
    // extproc/src/tiers.rs wrong_region_response: error_body re-parsed, `region` added.
    let mut v: serde_json::Value =
        serde_json::from_str(&crate::code::error_body(Code::WrongRegion, "m", None)).unwrap();
    v["region"] = json!("us-1");
    let w: ErrorBody = same(&v.to_string());
    assert_eq!(w, ErrorBody::new(Code::WrongRegion, "m").with_region("us-1"));
    // extproc/src/internal.rs error(): no reason.
    same::<ErrorBody>(&json!({ "code": "denied", "message": "m" }).to_string());
    // A newer service: an unknown code, an unknown reason, a new member, no message.
    let n: ErrorBody = serde_json::from_str(r#"{"code":"teapot","reason":"moon","hint":1}"#).unwrap();
    assert_eq!(n.code, AnyCode::Unknown("teapot".into()));
    assert_eq!(n.reason, Some(AnyReason::Unknown("moon".into())));
    assert!(n.message.is_empty() && !n.code.retryable());
}

#[test]
fn vm_routes() {
    // wasm-filter/src/transparent.rs keepalive_body and release_body.
    let k: VmKeepalive = same(&json!({ "vm": VM, "open": [3, 5], "next": 7 }).to_string());
    assert_eq!((k.open.as_deref(), k.next), (Some(&[3, 5][..]), Some(7)));
    same::<VmKeepalive>(&json!({ "vm": VM }).to_string());
    same::<VmRelease>(&json!({ "vm": VM, "key": "payments/order-42", "hold": 3 }).to_string());
    // extproc/src/internal.rs answers.
    same::<VmKeepaliveReply>(&json!({ "sessions": 2, "renew_ms": 10_000, "reconciled": 0 }).to_string());
    same::<VmReleaseReply>(&json!({ "released": false }).to_string());
    // The arbiter refuses unknown request members, as its own structs did.
    assert!(serde_json::from_value::<VmRelease>(json!({ "vm": VM, "key": "k/1", "hold": 1, "x": 1 })).is_err());
}

fn class_status(policy: bool) -> serde_json::Value {
    // extproc/src/registry.rs status_json, one class (with or without its policy).
    let last = json!({ "actor": "arbiter:bootstrap", "reason": "first start", "at_ms": 5, "action": "create" });
    let p = |v: serde_json::Value| if policy { v } else { serde_json::Value::Null };
    json!({
        "name": "default", "ttl_s": 30, "tier": "entity", "desired_limit": 1,
        "advisory": if policy { serde_json::Value::Null } else { json!({ "risk_owner": "team-a", "expired": false }) },
        "limit": p(json!(1)), "state": p(json!("active")), "change_epoch": p(json!(1)),
        "pending_target": null, "policy_id": p(json!("p-1")),
        "draining_age_ms": null,
        "last_change": p(last),
        "desired_differs": !policy,
    })
}

#[test]
fn status() {
    // extproc/src/admin.rs status().
    let classes = json!({
        "registry": { "valid": true, "errors": [], "loaded_ms": 1, "reloads": 0, "refused": 0 },
        "map_matches_registry": true,
        "classes": [class_status(true), class_status(false)],
    });
    let status = |classes: serde_json::Value, sealed: bool| {
        json!({
            "version": "0.1.0",
            "sealed": sealed,
            "seal_reason": sealed.then_some("explicit"),
            "seal_detail": sealed.then(|| "epoch advance in progress".to_owned()),
            "sealed_since_ms": sealed.then_some(9u64),
            "marks": { "clock": 40, "clock_off": null, "cluster_id": "00000000000000aa", "epoch": 1, "revision": 42,
                       "raft_term": 2, "raft_index": 77, "updated_ms": 8 },
            "classes": classes,
            "fail_open": [json!({
                "cluster": "coord", "spool": true, "quorum_loss_declared": false, "outage": null,
                "spool_bytes": 0, "unprotected_holds": 0,
            })],
            "shadow": [json!({ "class": "default", "count": 2, "decision": "would_refuse", "reason": "key_gated" })],
        })
        .to_string()
    };
    let s: StatusReply = same(&status(classes, false));
    let ClassesStatus::Read(r) = &s.classes else { panic!("{s:?}") };
    assert_eq!(r.classes[0].last_change.as_ref().map(|n| n.action.as_str()), Some("create"));
    let sealed: StatusReply = same(&status(json!({ "error": "etcd: unavailable" }), true));
    assert_eq!(sealed.classes, ClassesStatus::Unreadable { error: "etcd: unavailable".into() });
    // With an operators section, its safeguards.
    let mut with_ops: serde_json::Value = serde_json::from_str(&status(json!({ "error": "e" }), false)).unwrap();
    with_ops["operators"] = json!({ "force_record_retention_s": 2592000, "max_token_age_s": null,
        "require_mfa": false, "weakened": ["operators.require_mfa is false"] });
    let o: StatusReply = same(&with_ops.to_string());
    assert_eq!(o.operators.map(|o| (o.require_mfa, o.weakened.len())), Some((false, 1)));
    // An arbiter older than `version`: doctor still reads it.
    let old: StatusReply = serde_json::from_str(r#"{"sealed":false}"#).unwrap();
    assert!(old.version.is_empty());
}

#[test]
fn console() {
    // extproc/src/console/mod.rs snapshot(), an advisory and a fenced class.
    let class = |advisory: bool| {
        let enforcement = if advisory {
            json!({ "posture": "advisory", "risk_owner": "team-a", "waiver_expiry": "2099-01-01",
                    "waiver_expired": false })
        } else {
            json!({ "posture": "fenced" })
        };
        let pause = (!advisory).then(|| json!({ "passing": true, "expires_unix_s": 4_000_000_000u64 }));
        json!({
            "name": "default", "tier": "entity", "enforcement": enforcement, "pause_test": pause, "ttl_s": 30,
            "fairness": "memory", "desired_max_holders": 1, "prefixes": ["payments/"],
            "limit": 1, "state": "active", "pending_target": null,
            "open_grants": 1, "keys_held": 1, "oldest_grant_age_ms": 12, "saturated_keys": 1,
            "clusters": [json!({ "cluster": "shard-a", "keys_held": 1, "limit": 1, "oldest_grant_age_ms": 12,
                                 "open_grants": 1, "saturated_keys": 1, "state": "active" })],
        })
    };
    let member = json!({ "id": "8e9e05c52164694d", "name": "etcd-0", "url": "http://127.0.0.1:2379",
        "learner": false, "reachable": true, "version": "3.5.28", "leader": true, "raft_term": 2,
        "raft_index": 77, "db_size": 20480, "errors": [] });
    let state = json!({
        "generated_ms": 10,
        "version": "0.1.0",
        "operator": { "sub": "alice" },
        "seal": { "sealed": false, "reason": null, "detail": null, "since_ms": null, "epoch": 1, "explicit": null },
        "etcd": { "reachable": true, "failing_for_ms": 0, "endpoints": 1, "cluster": {
            "cluster_id": "00000000000000aa", "members": [member], "leader": "8e9e05c52164694d", "voting": 1,
            "voting_reachable": 1, "quorum": true, "alarms": [], "error": null } },
        "registry": { "valid": true, "errors": [], "loaded_ms": 1, "reloads": 0, "refused": 0 },
        "classes": [class(false), class(true)],
        "draining": [json!({ "class": "default", "limit": 2, "pending_target": 1, "change_epoch": 1,
                             "pending_move": false, "draining_age_ms": 30, "cluster": "shard-a" })],
        "saturated": [json!({ "digest": "ab".repeat(32), "class": "default", "holders": 1, "limit": 1,
                              "oldest_age_ms": 12, "waiters_here": 0, "cluster": "shard-a" })],
        "clusters": [json!({ "cluster": "shard-a", "epoch": 2, "etcd": { "cluster_id": "00000000000000bb",
            "members": [member], "leader": "8e9e05c52164694d", "voting": 1, "voting_reachable": 1, "quorum": true,
            "alarms": [], "error": null }, "policies_error": null, "scan": { "holds": 1, "truncated": false,
            "revision": 7 }, "sealed": null })],
        "quotas": [json!({ "cluster": "coord", "namespace": "payments", "acquires_per_s": 2000, "alert": true,
                           "sessions": { "used": 8, "limit": 10, "percent": 80 },
                           "holds": { "used": 1, "limit": 20, "percent": 5 },
                           "waiters": null })],
        "scan": { "holds": 1, "truncated": false, "revision": 42 },
        "grafana_url": "https://grafana.example/d/lockmesh-overview",
        "hold_ages": { "bounds_ms": [1000, 5000], "counts": [0, 1, 0] },
        "holds_and_waits": [json!({ "namespace": "payments", "class": "default", "open_holds": 1,
                                    "oldest_hold_ms": 12, "gated_waiters": 2, "oldest_gated_wait_ms": 9,
                                    "key_gated": 1, "lock_contended": 0, "grants_after_wait": 3, "wakeups": 7,
                                    "pickups": 3, "pickup_mean_ms": 4 })],
        "shadow": [json!({ "class": "default", "count": 2, "decision": "would_grant", "reason": "lock_delay" })],
        "policies_error": null,
        "audit": { "configured": true, "events": [json!({ "kind": "grant", "revision": 42, "epoch": 1,
                   "at_ms": 9, "class": "default", "digest": "ab".repeat(32) })] },
    })
    .to_string();
    let s: ConsoleState = same(&state);
    assert!(matches!(s.classes[1].enforcement, ConsoleEnforcement::Advisory { .. }));
    assert!(s.quotas[0].sessions.alerting() && !s.quotas[0].holds.alerting());
    assert_eq!(s.saturated[0].cluster.as_deref(), Some("shard-a"));
    // A console of an earlier build (no quotas; the coord cluster only: no
    // clusters, no row's cluster) still reads.
    let mut old: serde_json::Value = serde_json::from_str(&state).unwrap();
    let o = old.as_object_mut().unwrap();
    o.remove("quotas");
    o.remove("clusters");
    o.remove("holds_and_waits");
    o.remove("shadow");
    o.remove("grafana_url");
    o.remove("hold_ages");
    for c in o["classes"].as_array_mut().unwrap() {
        c.as_object_mut().unwrap().remove("clusters");
    }
    o["draining"][0].as_object_mut().unwrap().remove("cluster");
    o["saturated"][0].as_object_mut().unwrap().remove("cluster");
    let old = serde_json::from_value::<ConsoleState>(old).unwrap();
    assert!(old.quotas.is_empty() && old.clusters.is_empty() && old.classes[0].clusters.is_empty());
    assert!(old.holds_and_waits.is_empty() && old.shadow.is_empty());
    assert_eq!((old.grafana_url, old.hold_ages), (None, None));
    assert_eq!((old.draining[0].cluster.as_ref(), old.saturated[0].cluster.as_ref()), (None, None));
    // And an older reader (a struct without the new members) reads this one: no
    // answer type denies unknown members.
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct OldDraining {
        class: String,
        limit: u32,
    }
    let d: Vec<OldDraining> =
        serde_json::from_value(serde_json::from_str::<serde_json::Value>(&state).unwrap()["draining"].clone()).unwrap();
    assert_eq!(d[0].class, "default");
    let failed = json!({ "error": "holds: timed out" }).to_string();
    assert_eq!(same::<ConsoleScan>(&failed), ConsoleScan::Failed { error: "holds: timed out".into() });
    same::<ConsoleAudit>(
        &json!({ "configured": false, "message": "no audit store configured (console.audit_url)" }).to_string(),
    );
    same::<ConsoleAudit>(&json!({ "configured": true, "error": "audit tailer: refused" }).to_string());
    same::<ConsoleWaiters>(&json!({ "digest": "ab".repeat(32), "waiters": 3 }).to_string());
    // extproc/src/console/history.rs answer(): two samples, one class.
    let h: ConsoleHistory = same(
        &json!({
            "at_ms": [10_000, 20_000], "capacity": 360, "interval_ms": 10_000, "started_ms": 1, "generated_ms": 20_001,
            "classes": [json!({ "class": "default", "grants": [0, 3], "grants_total": 3, "refusals": [1, 0],
                                "refusals_total": 1, "gated_waiters": [0, 1], "open_holds": [0, 2],
                                "oldest_hold_ms": [0, 900] })],
            "etcd": { "checks": [10, 10], "failures": [0, 1], "mean_us": [800, null], "max_us": [2000, null] },
        })
        .to_string(),
    );
    assert_eq!((h.classes[0].grants[1], h.etcd.mean_us[1]), (3, None));
    // extproc/src/console/mod.rs class_detail().
    same::<ConsoleClassDetail>(
        &json!({
            "class": "default", "generated_ms": 5, "open_grants": 1, "saturated_keys": 1,
            "hold_ages": { "bounds_ms": [1000], "counts": [1, 0] },
            "holds_and_waits": [], "scan": { "holds": 1, "truncated": false, "revision": 42 },
            "saturated": [json!({ "digest": "ab".repeat(32), "class": "default", "holders": 1, "limit": 1,
                                  "oldest_age_ms": 12, "waiters_here": 2, "cluster": "coord" })],
        })
        .to_string(),
    );
    same::<ConsoleErrorBody>(&json!({ "code": "admin.token_missing", "message": "sign in" }).to_string());
}

fn request(state: &str) -> serde_json::Value {
    // extproc/src/admin_action/flow.rs AdminRequest, as server.rs to_json() prints it.
    json!({ "id": "0011223344556677", "reason": "stuck holder",
            "action": { "kind": "force_release", "digest": "ab".repeat(32), "revoke_session": false },
            "requester": { "iss": "https://idp", "sub": "alice" }, "requested_ms": 1, "expires_ms": 2,
            "state": state })
}

#[test]
fn admin() {
    let hold = json!({ "slot": 0, "owner": "spiffe://t/a", "class": "default", "session": SID,
                       "grant_revision": 3, "age_ms": 12 });
    let preview =
        json!({ "request": request("pending"), "holds": [hold], "enforcement": "fenced", "warning": null }).to_string();
    // Through serde_json::Value the tag `kind` sorts after `digest`; typed, a tag
    // prints first: the same JSON, other bytes (see the module docs).
    let p: Preview = serde_json::from_str(&preview).unwrap();
    assert_eq!(serde_json::to_value(&p).unwrap().to_string(), preview);
    let mut done = request("executed");
    done["approver"] = json!({ "iss": "https://idp", "sub": "bob" });
    done["approved_ms"] = json!(3);
    let outcome = json!({ "request": done, "released": [hold], "sessions_revoked": 0, "revision": 50,
                          "advance_log": [] });
    let approve = json!({ "preview": serde_json::from_str::<serde_json::Value>(&preview).unwrap(),
                          "outcome": outcome });
    let a: ApproveReply = serde_json::from_value(approve.clone()).unwrap();
    assert_eq!(serde_json::to_value(&a).unwrap(), approve);
    assert_eq!(a.outcome.request.approver.map(|o| o.sub).as_deref(), Some("bob"));
    let log = json!({ "step": "approve", "request_id": null, "operator": null, "outcome": "admin.same_operator",
                      "detail": "d", "at_ms": 4 });
    let list = json!({ "requests": [request("void")], "log": [log] });
    assert_eq!(serde_json::to_value(serde_json::from_value::<ListReply>(list.clone()).unwrap()).unwrap(), list);
    // extproc/src/admin_action/cli.rs request bodies.
    let epoch = json!({ "kind": "epoch_advance", "expected_epoch": 1, "new_epoch": 2 });
    let body = json!({ "action": epoch, "reason": "restore", "ttl_s": 600 });
    assert!(matches!(
        serde_json::from_value::<RequestBody>(body).unwrap().action,
        Action::EpochAdvance { expected_epoch: 1, new_epoch: 2 }
    ));
    same::<ShowBody>(&json!({ "id": "0011223344556677" }).to_string());
    same::<ApproveBody>(&json!({ "id": "0011223344556677", "shown": [3] }).to_string());
    same::<ApproveBody>(&json!({ "id": "0011223344556677", "shown": null }).to_string());
    same::<ListBody>(&json!({}).to_string());
    same::<AdminErrorBody>(&json!({ "code": "admin.same_operator", "message": "m" }).to_string());
    // An earlier arbiter's `{"error": ...}` is still read.
    let old: AdminErrorBody = serde_json::from_str(r#"{"error":"admin.no_hold","message":"m"}"#).unwrap();
    assert_eq!(old.code, "admin.no_hold");
    assert!(serde_json::from_value::<ShowBody>(json!({ "id": "x", "extra": 1 })).is_err());
}

#[test]
fn audit() {
    // extproc/src/audit: events and holds, as `lockctl audit --json` prints them
    // (struct order; the tailer's HTTP answer sorts keys through Value).
    let events = r#"{"answer":"events","events":[{"cluster_id":"00000000000000aa","timeline":0,"epoch":1,"revision":42,"etcd_key":"/r/l/ab/h/0000","kind":"grant","digest":"ab","key":"k/1","identity":"spiffe://t/a","class":"default","session":"000000000000002a","grant_revision":42,"slot":0,"at_ms":9},{"cluster_id":"00000000000000aa","timeline":0,"epoch":1,"revision":0,"etcd_key":"/r/u/g/grant","kind":"grant","at_ms":9,"detail":{"grant_id":"g","neg":-3,"outage":"coord-1","ratio":0.5,"ttl_s":15,"x":[null,true]},"unprotected":true}]}"#;
    let Answer::Events { events: ev } = same::<Answer>(events) else { panic!() };
    let d = ev[1].detail.as_ref().unwrap();
    assert_eq!((d.get("ttl_s").and_then(Opaque::as_u64), d.get("neg").and_then(Opaque::as_i64)), (Some(15), Some(-3)));
    assert_eq!(d.get("outage").and_then(Opaque::as_str), Some("coord-1"));
    // The tailer's own bytes: the same answer through serde_json::Value.
    let sorted = serde_json::from_str::<serde_json::Value>(events).unwrap().to_string();
    assert_eq!(serde_json::to_value(serde_json::from_str::<Answer>(&sorted).unwrap()).unwrap().to_string(), sorted);
    let holds = r#"{"answer":"holds","holds":[{"digest":"ab","key":"k/1","identity":"spiffe://t/a","class":"default","epoch":1,"grant_revision":42,"session":"000000000000002a","granted_ms":9,"end":{"kind":"expiry","revision":50,"at_ms":40},"held_ms":31,"open":false}]}"#;
    same::<Answer>(holds);
    let grants = r#"{"answer":"unprotected","grants":[{"grant_id":"g","outage":"coord-1","cluster":"coord","cluster_id":"00000000000000aa","epoch":1,"namespace":"k","class":"cache","digest":"ab","key":"k/1","identity":"spiffe://t/a","granted_ms":9,"ttl_s":15,"end":{"kind":"release","at_ms":12}}]}"#;
    same::<Answer>(grants);
    // Queries, as lockctl audit and the console send them.
    let q: Query = serde_json::from_value(json!({ "query": "recent", "limit": 50 })).unwrap();
    assert_eq!(q, Query::Recent { limit: 50 });
    same::<Query>(r#"{"query":"events","kind":"gap","since_ms":0}"#);
    same::<Query>(r#"{"query":"unprotected","since_ms":0,"until_ms":9,"outage":"coord-1"}"#);
    same::<CheckpointReply>(&json!({ "checkpoint": null }).to_string());
    same::<CheckpointReply>(
        r#"{"checkpoint":{"cluster_id":"aa","timeline":1,"revision":42,"epoch":1,"max_epoch":1,"updated_ms":9}}"#,
    );
    same::<AuditErrorBody>(&json!({ "error": "store: locked" }).to_string());
    for k in EventKind::ALL {
        assert_eq!(EventKind::parse(k.as_str()), Some(k));
        assert_eq!(serde_json::to_value(k).unwrap(), json!(k.as_str()));
    }
}

#[test]
fn lockctl_json() {
    // extproc/src/inspect/cli.rs: KeyView through Value plus waiters.
    let inspect = json!({ "digest": "ab".repeat(32), "class": "default", "limit": 1, "state": "active",
        "holders": [json!({ "slot": 0, "identity": "spiffe://t/a", "session": SID, "epoch": 1, "age_ms": 12 })],
        "revision": 42, "waiters": null, "waiter_errors": [] })
    .to_string();
    same::<InspectReport>(&inspect);
    let saturated = json!({ "revision": 42, "holds_scanned": 3, "truncated": false, "saturated": [json!({
        "digest": "ab".repeat(32), "class": "default", "holders": 1, "limit": 1, "oldest_age_ms": 12 })] })
    .to_string();
    assert_eq!(same::<SaturatedReport>(&saturated).saturated[0].waiters_here, None);
    // extproc/src/shardctl.rs: apply (struct order) and show (through Value).
    same::<MoveReport>(
        r#"{"outcome":"applied","from":1,"to":2,"losers":["coord"],"gainers":["shard-b"],"epochs":{"shard-b":2},"verified_at":{"coord":50},"drain_ms":5,"total_ms":9}"#,
    );
    let show = json!({ "map": { "current": { "version": 1 } }, "clusters": {
        "coord": { "home": null, "epoch": 1, "prior_epochs": [] },
        "shard-b": { "home": { "version": 1 }, "epoch": null, "prior_epochs": null } } })
    .to_string();
    same::<ShardShow>(&show);
    // extproc/src/doctor.rs Report (struct order).
    let doctor = r#"{"lockctl_version":"0.1.0","root":"/lockmesh","findings":[{"check":"arbiter.seal","status":"fail","subject":"http://a:18052","detail":"sealed"}],"failures":1,"warnings":0}"#;
    assert_eq!(same::<DoctorReport>(doctor).findings[0].status, Verdict::Fail);
}

#[test]
fn audit_tailer_details() {
    // extproc/audit/src/tailer.rs: the `detail` of the tailer's own restore and gap
    // events, which it writes into the event as a serde_json::Value (keys sorted).
    let restore = json!({ "checkpoint": 42, "current": 7, "sealed_target": 3 }).to_string();
    assert_eq!(same::<RestoreDetail>(&restore), RestoreDetail { checkpoint: 42, current: 7, sealed_target: Some(3) });
    let unsealed = same::<RestoreDetail>(&json!({ "checkpoint": 42, "current": 7, "sealed_target": null }).to_string());
    assert_eq!(unsealed.sealed_target, None);
    let through_value = |sample: &str| -> GapDetail {
        let d: GapDetail = serde_json::from_str(sample).unwrap_or_else(|e| panic!("{sample}: {e}"));
        assert_eq!(serde_json::to_value(&d).unwrap().to_string(), sample);
        d
    };
    let changed =
        json!({ "reason": "cluster changed", "from_cluster": "00000000000000aa", "from_revision": 42 }).to_string();
    assert_eq!(
        through_value(&changed),
        GapDetail::ClusterChanged { from_cluster: "00000000000000aa".into(), from_revision: 42 }
    );
    let compacted = json!({ "reason": "compacted", "from_revision": 43, "to_revision": 99 }).to_string();
    assert_eq!(through_value(&compacted), GapDetail::Compacted { from_revision: 43, to_revision: 99 });
    assert!(serde_json::from_str::<GapDetail>(r#"{"reason":"moon","from_revision":1}"#).is_err());
    // As an event's detail: readers without the tailer's types see the same members.
    let gap: AuditEvent = serde_json::from_value(json!({ "cluster_id": "00000000000000aa", "timeline": 1,
        "epoch": 1, "revision": 99, "etcd_key": "/r/", "kind": "gap", "at_ms": 9,
        "detail": serde_json::from_str::<serde_json::Value>(&compacted).unwrap() }))
    .unwrap();
    let d = gap.detail.unwrap();
    assert_eq!(
        (d.get("reason").and_then(Opaque::as_str), d.get("to_revision").and_then(Opaque::as_i64)),
        (Some("compacted"), Some(99))
    );
}
