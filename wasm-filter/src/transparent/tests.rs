use super::*;

const VM: &str = "0123456789abcdef0123456789abcdef";

#[test]
fn vm_ids_are_128_bit_hex_and_differ() {
    let a = new_vm_id(1, 7);
    let b = new_vm_id(1, 7);
    assert_eq!(a.len(), 32);
    assert!(a.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    assert_ne!(a, b, "RandomState seeds each id");
}

#[test]
fn a_hold_that_never_reached_the_arbiter_is_not_released() {
    let mut h = Holds::new(VM.into());
    let n = h.open(0);
    assert!(!h.end("a/b", n, false, 0));
    assert!(h.due_releases(0).is_empty());
    assert_eq!(h.open_count(), 0);
}

#[test]
fn a_failed_release_is_retried_with_backoff_then_left_to_the_reconcile() {
    let mut h = Holds::new(VM.into());
    let n = h.open(0);
    assert!(h.end("a/b", n, true, 10));
    let mut now = 10;
    for attempt in 0..RELEASE_ATTEMPTS {
        let due = h.due_releases(now);
        assert_eq!(due.len(), 1, "attempt {attempt}");
        assert_eq!(due[0].attempts, attempt);
        let token = 100 + attempt;
        h.sent(token, Call::Release(due[0].clone()), now);
        assert!(h.due_releases(now).is_empty());
        assert!(h.answered(token, 503, b"", now).is_some());
        now += 10_000;
    }
    assert!(h.due_releases(now).is_empty(), "given up after {RELEASE_ATTEMPTS} attempts");
    assert!(!h.has_pending());
}

#[test]
fn release_bodies_name_vm_key_and_hold() {
    let h = Holds::new(VM.into());
    let r = Release { key: "a/b".into(), hold: 3, attempts: 0, not_before_ms: 0 };
    let v: serde_json::Value = serde_json::from_slice(&h.release_body(&r)).unwrap();
    assert_eq!(v, json!({"vm": VM, "key": "a/b", "hold": 3}));
}

#[test]
fn keepalives_start_with_the_first_hold_follow_the_arbiter_and_stop_when_idle() {
    let mut h = Holds::new(VM.into());
    assert_eq!(h.keepalive_due(1_000_000, 5000), None, "no holds, no renewal");
    let n = h.open(0);
    assert_eq!(h.keepalive_due(999, 5000), None);
    assert_eq!(h.keepalive_due(1000, 5000), Some(false));
    h.sent(1, Call::Keepalive { reconcile: false }, 1000);
    assert_eq!(h.keepalive_due(1999, 5000), None, "a period after the send");
    h.answered(1, 200, br#"{"sessions":1,"renew_ms":1000,"reconciled":0}"#, 1100);
    assert_eq!(h.keepalive_due(1999, 5000), None);
    assert_eq!(h.keepalive_due(2000, 5000), Some(false), "counted from the send, not the answer");
    assert_eq!(h.keepalive_due(6000, 5000), Some(true), "reconcile every 5 s");
    h.sent(2, Call::Keepalive { reconcile: true }, 6000);
    // A failed keepalive is retried within half a period.
    h.answered(2, 0, b"", 6100);
    assert_eq!(h.keepalive_due(6599, 5000), None);
    assert_eq!(h.keepalive_due(6600, 5000), Some(false));
    h.end("a/b", n, true, 6600);
    h.sent(3, Call::Keepalive { reconcile: false }, 6600);
    h.answered(3, 200, br#"{"sessions":0,"renew_ms":1000}"#, 6700);
    assert_eq!(h.keepalive_due(100_000, 5000), None, "idle: no sessions, nothing open");
}

/// A keepalive that hangs until its callout timeout (a paused arbiter, or one
/// waiting on a cluster that does not answer) does not hold the next one back: the
/// renewals stay a period apart while calls hang, each renewal is two calls, and
/// at most four are in flight.
#[test]
fn a_hanging_keepalive_does_not_stretch_the_renewal_period() {
    let mut h = Holds::new(VM.into());
    h.open(0);
    assert_eq!(h.keepalive_due(1000, 60_000), Some(false));
    assert_eq!(h.keepalive_calls(), 2, "each renewal is two calls");
    h.sent(1, Call::Keepalive { reconcile: false }, 1000);
    h.sent(2, Call::Keepalive { reconcile: false }, 1000);
    h.answered(1, 200, br#"{"sessions":1,"renew_ms":1000}"#, 1010);
    // Call 2 hangs until its 2 s timeout; the next renewal leaves anyway.
    assert_eq!(h.keepalive_due(1999, 60_000), None);
    assert_eq!(h.keepalive_due(2000, 60_000), Some(false), "the next one leaves while one hangs");
    h.sent(3, Call::Keepalive { reconcile: false }, 2000);
    h.sent(4, Call::Keepalive { reconcile: false }, 2000);
    // Call 4 hangs too: three in flight, room for one more call only.
    h.answered(3, 200, br#"{"sessions":1,"renew_ms":1000}"#, 2020);
    assert_eq!(h.keepalive_due(3000, 60_000), Some(false));
    assert_eq!(h.keepalive_calls(), 2);
    h.sent(5, Call::Keepalive { reconcile: false }, 3000);
    h.sent(6, Call::Keepalive { reconcile: false }, 3000);
    assert_eq!(h.keepalive_due(4000, 60_000), None, "four in flight: the next waits");
    h.answered(2, 0, b"", 4000);
    assert_eq!(h.keepalive_due(4000, 60_000), Some(false), "a timeout frees room and moves nothing later");
    assert_eq!(h.keepalive_calls(), 1, "the bound leaves room for one call");
}

#[test]
fn the_reconcile_lists_open_holds_and_the_next_number() {
    let mut h = Holds::new(VM.into());
    let a = h.open(0);
    let b = h.open(0);
    h.end("a/b", a, true, 0);
    let v: serde_json::Value = serde_json::from_slice(&h.keepalive_body(true)).unwrap();
    assert_eq!(v, json!({"vm": VM, "open": [b], "next": 2}));
    let v: serde_json::Value = serde_json::from_slice(&h.keepalive_body(false)).unwrap();
    assert_eq!(v, json!({"vm": VM}));
}

#[test]
fn an_unknown_callout_token_is_ignored() {
    let mut h = Holds::new(VM.into());
    assert_eq!(h.answered(42, 200, b"{}", 0), None);
}
