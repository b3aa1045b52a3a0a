//! Pure request decisions, tested on the host. [`crate::http`] gathers host state,
//! calls [`on_request_headers`] and applies the [`Decision`].

use lockmesh_core::{code::error_body, headers, Code};

use crate::config::Config;

/// Longest SPIFFE ID accepted (the SPIFFE spec's URI limit).
pub const MAX_SPIFFE_ID_LEN: usize = 2048;

/// What to do with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Answer locally; nothing reaches the arbiter.
    Reject {
        /// HTTP status.
        status: u32,
        /// Stable code.
        code: Code,
        /// JSON body.
        body: String,
    },
    /// Pass the request on after removing and setting headers.
    Forward {
        /// Header names to remove (client-supplied internal or identity headers).
        remove: Vec<String>,
        /// Headers to set.
        set: Vec<(&'static str, String)>,
    },
}

impl Decision {
    fn reject(code: Code, message: &str) -> Self {
        Decision::Reject {
            status: u32::from(code.http_status()),
            code,
            body: error_body(code, message, None),
        }
    }
}

/// Checks a SPIFFE ID's shape: `spiffe://trust-domain/path`, printable ASCII.
pub fn valid_spiffe_id(id: &[u8]) -> bool {
    let Some(rest) = id.strip_prefix(b"spiffe://") else {
        return false;
    };
    let td_len = rest.iter().position(|b| *b == b'/').unwrap_or(rest.len());
    id.len() <= MAX_SPIFFE_ID_LEN
        && td_len > 0
        && rest[..td_len]
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(b))
        && rest.iter().all(|b| b.is_ascii_graphic())
}

/// Decides a request from its headers (names lowercase, raw value bytes) and the
/// mTLS peer's URI SAN, if any.
pub fn on_request_headers(
    cfg: &Config,
    hdrs: &[(String, Vec<u8>)],
    peer_uri_san: Option<&[u8]>,
) -> Decision {
    // Authenticate first: an unauthenticated caller learns nothing about its headers.
    // There is no insecure mode: without a verified SPIFFE ID nothing passes.
    if !peer_uri_san.is_some_and(valid_spiffe_id) {
        return Decision::reject(
            Code::Unauthenticated,
            "a verified SPIFFE client certificate is required",
        );
    }
    let lock =
        match headers::parse_lock_headers(hdrs.iter().map(|(n, v)| (n.as_str(), v.as_slice()))) {
            Ok(h) => h,
            Err(e) => return Decision::reject(Code::BadRequest, &e.to_string()),
        };
    if let Some(w) = lock.wait_ms {
        if w > cfg.max_wait_ms {
            let msg = format!(
                "{}: {w} ms is above the maximum {} ms",
                headers::WAIT_MS,
                cfg.max_wait_ms
            );
            return Decision::reject(Code::BadRequest, &msg);
        }
    }
    let mut remove: Vec<String> = hdrs
        .iter()
        .map(|(n, _)| n)
        .filter(|n| {
            n.starts_with(headers::INTERNAL_PREFIX)
                || headers::FORGEABLE_IDENTITY.contains(&n.as_str())
                || *n == headers::EPOCH
                || *n == headers::REVISION
        })
        .cloned()
        .collect();
    remove.dedup();
    let mut set = vec![(headers::FILTERED, headers::FILTER_PROTOCOL.to_owned())];
    if let Some(w) = lock.wait_ms {
        // No queueing in the filter yet: the whole wait is left.
        set.push((headers::BUDGET_MS, w.to_string()));
    }
    Decision::Forward { remove, set }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> Config {
        crate::config::parse(b"").unwrap()
    }

    fn h(pairs: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_vec()))
            .collect()
    }

    const ID: &[u8] = b"spiffe://lockmesh.test/ns/payments/sa/worker";

    #[test]
    fn unauthenticated_is_refused_first() {
        let d = on_request_headers(&cfg(), &h(&[("x-lock-key", b"bad key")]), None);
        assert!(matches!(
            d,
            Decision::Reject {
                status: 401,
                code: Code::Unauthenticated,
                ..
            }
        ));
        let d = on_request_headers(&cfg(), &[], Some(b"https://evil"));
        assert!(matches!(d, Decision::Reject { status: 401, .. }));
    }

    #[test]
    fn bad_headers_name_the_header() {
        let d = on_request_headers(&cfg(), &h(&[("x-lock-wait-ms", b"-1")]), Some(ID));
        let Decision::Reject { status, body, .. } = d else {
            panic!()
        };
        assert_eq!(status, 400);
        assert!(body.contains("x-lock-wait-ms"), "{body}");
        let d = on_request_headers(&cfg(), &h(&[("x-lock-wait-ms", b"30001")]), Some(ID));
        assert!(matches!(d, Decision::Reject { status: 400, .. }));
    }

    #[test]
    fn strips_internal_and_identity_headers_and_stamps_budget() {
        let d = on_request_headers(
            &cfg(),
            &h(&[
                ("x-lock-key", b"ns/a"),
                ("x-lock-wait-ms", b"250"),
                ("x-lockmesh-budget-ms", b"999999"),
                ("x-forwarded-client-cert", b"By=spiffe://x"),
                ("x-lock-epoch", b"9"),
            ]),
            Some(ID),
        );
        let Decision::Forward { remove, set } = d else {
            panic!()
        };
        assert_eq!(
            remove,
            vec![
                "x-lockmesh-budget-ms",
                "x-forwarded-client-cert",
                "x-lock-epoch"
            ]
        );
        assert!(set.contains(&(headers::BUDGET_MS, "250".into())));
        assert!(set.contains(&(headers::FILTERED, "1".into())));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn never_panics(
            names in proptest::collection::vec(prop_oneof![
                Just("x-lock-key".to_string()), Just("x-lock-wait-ms".to_string()),
                Just("x-lock-session".to_string()), Just("x-lock-token".to_string()),
                Just("x-lock-class".to_string()), Just("x-lock-instance".to_string()),
                Just("x-lockmesh-x".to_string()), "[a-z-]{1,12}"], 0..8),
            vals in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..600), 8),
            id in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64)),
        ) {
            let hdrs: Vec<_> = names.into_iter().zip(vals).collect();
            let _ = on_request_headers(&cfg(), &hdrs, id.as_deref());
        }
    }
}
