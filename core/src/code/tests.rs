//! The code table, as docs/API.md states it, and the hand-written error body.

use super::*;
use crate::wire::ErrorBody;

#[test]
fn codes_round_trip_and_are_unique() {
    for c in Code::ALL {
        assert_eq!(Code::parse(c.as_str()), Some(c));
        assert_eq!(serde_json::to_string(&c).unwrap(), format!("\"{c}\""));
        assert_eq!(serde_json::from_str::<Code>(&format!("\"{c}\"")).unwrap(), c);
        assert_eq!(AnyCode::parse(c.as_str()), AnyCode::Known(c));
    }
    let mut names: Vec<_> = Code::ALL.iter().map(|c| c.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), Code::ALL.len());
    for r in Reason::ALL {
        assert_eq!(serde_json::from_str::<Reason>(&format!("\"{r}\"")).unwrap(), r);
    }
}

#[test]
fn unknown_codes_are_kept_and_never_retryable() {
    assert!(serde_json::from_str::<Code>("\"teapot\"").is_err());
    let c: AnyCode = serde_json::from_str("\"teapot\"").unwrap();
    assert_eq!((c.known(), c.as_str(), c.retryable()), (None, "teapot", false));
    assert_eq!(serde_json::to_string(&c).unwrap(), "\"teapot\"");
    let r: AnyReason = serde_json::from_str("\"moon_phase\"").unwrap();
    assert_eq!(r, AnyReason::Unknown("moon_phase".into()));
}

/// The table as docs/API.md states it; a change here is an API change.
#[test]
fn the_table() {
    use Code::*;
    let table = [
        (BadRequest, 400, false),
        (Unauthenticated, 401, false),
        (Denied, 403, false),
        (ClassMismatch, 400, false),
        (Contended, 409, true),
        (Leaked, 409, false),
        (NotHolder, 409, false),
        (SessionExpired, 410, false),
        (SessionClassMismatch, 400, false),
        (Sealed, 503, true),
        (Unavailable, 503, true),
        (Draining, 503, true),
        (QueueFull, 429, true),
        (NotFound, 404, false),
        (LockRequired, 428, false),
        (RateLimited, 429, true),
        (Internal, 500, false),
        (WrongRegion, 421, false),
        (SpoolFull, 503, true),
        (QuotaExceeded, 429, true),
        (KeysSpanClusters, 409, false),
        (ModeConflict, 409, false),
        (CapabilityDisabled, 503, true),
    ];
    assert_eq!(table.len(), Code::ALL.len());
    for (c, status, retryable) in table {
        assert_eq!((c.status(), c.http_status(), c.retryable()), (status, status, retryable), "{c}");
    }
}

#[test]
fn retry_after_is_on_retryable_codes_only_and_in_the_headers() {
    assert_eq!(RETRY_AFTER_VALUE, RETRY_AFTER_S.to_string());
    for c in Code::ALL {
        let h: Vec<_> = c.error_headers().collect();
        assert_eq!(h[0], (headers::ERROR, c.as_str()));
        match c.retry_after_s() {
            Some(s) => {
                assert!(c.retryable(), "{c} carries retry-after but is not retryable");
                assert_eq!(h[1..], [(headers::RETRY_AFTER, s.to_string().as_str())]);
            }
            None => assert_eq!(h.len(), 1, "{c}"),
        }
    }
    // Today's answers: the arbiter's four 503s, the filter's queue_full and
    // ValidateToken's rate_limited.
    let with: Vec<_> = Code::ALL.into_iter().filter(|c| c.retry_after_s().is_some()).collect();
    assert_eq!(
        with,
        [
            Code::Sealed,
            Code::Unavailable,
            Code::Draining,
            Code::QueueFull,
            Code::RateLimited,
            Code::SpoolFull,
            Code::QuotaExceeded,
            Code::CapabilityDisabled
        ]
    );
}

#[test]
fn error_body_is_serde_jsons_bytes_for_every_code() {
    let messages = [
        "",
        "x-lock-key: required",
        "a \"q\" and \\ back",
        "tab\tnl\ncr\rbs\u{8}ff\u{c}nul\u{0}us\u{1f}del\u{7f}",
        "caf\u{e9} \u{1F512} \u{2028}",
    ];
    for c in Code::ALL {
        for m in messages {
            for r in [None, Some(Reason::KeyGated), Some(Reason::LockContended)] {
                let mut typed = ErrorBody::new(c, m);
                typed.reason = r.map(AnyReason::from);
                let hand = error_body(c, m, r);
                assert_eq!(hand, serde_json::to_string(&typed).unwrap(), "{c} {m:?} {r:?}");
                assert_eq!(serde_json::from_str::<ErrorBody>(&hand).unwrap(), typed);
            }
        }
    }
}
