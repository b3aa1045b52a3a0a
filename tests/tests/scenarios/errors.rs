//! Issue #15's acceptance test: one error code is one answer on every port, and the
//! SDK's retry decision is core's.
//!
//! The lock plane speaks [`Code`] (`core/src/code.rs`) everywhere: the Wasm filter's
//! local answers and the arbiter's ext_proc answers through the lock tier's Envoy
//! (`lock-tier.yaml`), the transparent-mode refusals through the inbound sidecar
//! (`inbound-sidecar.yaml`), and the filter's VM routes (`/internal/v1/vm/*`) on the
//! arbiter's ext_proc port. Each refusal provoked here passes [`assert_canonical`],
//! and a code seen on two or more ports must have the same status and the same
//! lockmesh headers on each. The operator plane (`AdminError` in
//! `extproc/ops/src/admin/mod.rs`) answers the same refusal alike on the admin-action
//! routes (ext_proc port) and the console's API (admin port).
//!
//! Not provoked (no port can be driven to them from a test without faults):
//! `unauthenticated` (the lock tier's TLS refuses a caller without a certificate
//! before the filter runs), `leaked`, `session_class_mismatch`, `sealed`,
//! `unavailable`, `draining`, `internal` and `spool_full`; `not_found` and
//! `lock_required` exist on one port each (the filter's route table).

use std::{collections::BTreeMap, path::Path, time::Duration};

use lockmesh_core::{
    code::{error_body, AnyCode},
    headers,
    wire::{admin::AdminErrorBody, ErrorBody},
    Code, Reason,
};
use lockmesh_devcerts::jwt::Issuer;
use lockmesh_tests::{backend::DELAY_HEADER, eventually_true, LockClient, Resp, Stack, TEST_TRUST_DOMAIN};
use reqwest::Method;
use serde_json::{json, Value};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const VALIDATE: &str = "/v1/tokens/validate";
const ISS: &str = "https://idp.errors.test";

/// The lock tier's grant of the test payments identity, and the same with `validate`
/// (the shipped grants do not have it; as in `fencing.rs`).
const PAYMENTS_GRANT: &str = r#"{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments", "short"], "operations": ["acquire", "inspect"]}"#;
const PAYMENTS_GRANT_VALIDATE: &str = r#"{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments", "short"], "operations": ["acquire", "inspect", "validate"]}"#;

/// `billing` is homed in another region (as in `scale.rs`): its keys answer `wrong_region`.
const REGION: &str = "region:\n  name: eu-1\n  namespaces: { billing: us-1 }\n";

/// The arbiters' `max_wait_ms`, below the filters' 30000: a wait between the two
/// passes the filter and is refused by the arbiter, naming this bound.
const ARBITER_MAX_WAIT_MS: u64 = 5000;

/// Checks one lock-plane refusal against core's table and returns its code.
///
/// Each property fails under a planted change:
/// - the body is an `ErrorBody` with a known code: the filter's `error_body` writes
///   `"error"` for `"code"`;
/// - status is `Code::status`: `Decision::reject` in `wasm-filter/src/decide.rs`
///   answers a literal 400 for every code;
/// - `x-lockmesh-error` is the code, once: `wasm-filter/src/worker.rs` stops adding
///   `Code::error_headers`, or `respond.rs` appends them twice;
/// - `retry-after` iff `Code::retry_after_s`: `validate::rate_limited` answers
///   without it, or the filter's `queue_full` loses it;
/// - `content-type: application/json`: `ApiResponse::into_response` in
///   `extproc/src/respond.rs` says `text/plain` (tried: the VM routes' `bad_request`
///   fails);
/// - the bytes are `error_body`'s (serde's, with a region): `ErrorBody`'s fields are
///   reordered, or `error_body` stops escaping `"`;
/// - `region` with `wrong_region` only, also in `x-lockmesh-region`; `reason` with
///   `contended` only: `ApiError::wrong_region` drops the header.
fn assert_canonical(r: &Resp, what: &str) -> Code {
    let ctx = format!("{what}: {} {:?} {}", r.code(), r.headers, r.body);
    let body: ErrorBody = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{ctx}: not an ErrorBody: {e}"));
    let code = body.code.known().unwrap_or_else(|| panic!("{ctx}: unknown code"));
    assert_eq!(r.code(), code.status(), "{ctx}: status");
    let errors: Vec<_> = r.headers.get_all(headers::ERROR).iter().map(|v| v.to_str().unwrap().to_owned()).collect();
    assert_eq!(errors, [code.as_str()], "{ctx}: {}", headers::ERROR);
    let retry: Vec<_> =
        r.headers.get_all(headers::RETRY_AFTER).iter().map(|v| v.to_str().unwrap().to_owned()).collect();
    let want_retry: Vec<String> = code.retry_after_s().map(|s| s.to_string()).into_iter().collect();
    assert_eq!(retry, want_retry, "{ctx}: {}", headers::RETRY_AFTER);
    let types: Vec<_> = r.headers.get_all("content-type").iter().map(|v| v.to_str().unwrap().to_owned()).collect();
    assert_eq!(types, ["application/json"], "{ctx}: content-type");
    let reason = body.reason.as_ref().map(|r| r.known().unwrap_or_else(|| panic!("{ctx}: unknown reason")));
    assert!(reason.is_none() || code == Code::Contended, "{ctx}: a reason without contended");
    match &body.region {
        None => {
            assert_ne!(code, Code::WrongRegion, "{ctx}: wrong_region names no region");
            assert_eq!(r.body, error_body(code, &body.message, reason), "{ctx}: not error_body's bytes");
        }
        Some(region) => {
            assert_eq!(code, Code::WrongRegion, "{ctx}: a region without wrong_region");
            assert_eq!(r.header(headers::REGION), Some(region.as_str()), "{ctx}: {}", headers::REGION);
            assert_eq!(r.body, serde_json::to_string(&body).unwrap(), "{ctx}: not ErrorBody's bytes");
        }
    }
    code
}

/// The headers two answers of one code must share: `content-type`, `retry-after`
/// and every `x-lockmesh-*` (Envoy's and axum's own, `date` and the like, differ)
/// but [`headers::SEALED`]: that one is the arbiter's seal state, set on every
/// answer of its ext_proc stream, 200s included (`extproc/src/server.rs`), not part
/// of a refusal; the filter's local answers and the VM routes do not carry it.
/// [`Refusals::expect`] checks its value where it is present.
fn lockmesh_headers(r: &Resp) -> Vec<(String, String)> {
    let mut h: Vec<_> = r
        .headers
        .iter()
        .filter(|(n, _)| {
            let n = n.as_str();
            n == "content-type"
                || n == headers::RETRY_AFTER
                || (n.starts_with(headers::INTERNAL_PREFIX) && n != headers::SEALED)
        })
        .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap_or("<not text>").to_owned()))
        .collect();
    h.sort();
    h
}

/// One refusal as seen: where, its code, status and lockmesh headers.
struct Seen {
    port: &'static str,
    what: String,
    code: Code,
    status: u16,
    headers: Vec<(String, String)>,
}

/// Every refusal of the scenario, for the comparison across ports.
#[derive(Default)]
struct Refusals(Vec<Seen>);

impl Refusals {
    /// [`assert_canonical`], then the code must be `want`; returns the body.
    fn expect(&mut self, port: &'static str, what: &str, r: &Resp, want: Code) -> ErrorBody {
        let code = assert_canonical(r, &format!("{port}: {what}"));
        assert_eq!(code, want, "{port}: {what}: {}", r.body);
        let sealed: Vec<_> = r.headers.get_all(headers::SEALED).iter().map(|v| v.to_str().unwrap()).collect();
        assert!(sealed.is_empty() || sealed == ["false"], "{port}: {what}: sealed {sealed:?} in an unsealed stack");
        self.0.push(Seen { port, what: what.to_owned(), code, status: r.code(), headers: lockmesh_headers(r) });
        serde_json::from_str(&r.body).unwrap()
    }

    /// For every code seen on two or more ports: the same status and lockmesh
    /// headers on each. Returns those codes. Fails if, say, the arbiter's answers
    /// (`respond.rs`) gained an `x-lockmesh-*` header the filter's lack, or the
    /// filter's `contended` carried a `retry-after` the arbiter's does not.
    fn assert_same_across_ports(&self) -> Vec<Code> {
        let mut by_code: BTreeMap<&str, Vec<&Seen>> = BTreeMap::new();
        for s in &self.0 {
            by_code.entry(s.code.as_str()).or_default().push(s);
        }
        let mut shared = Vec::new();
        for seen in by_code.values() {
            let first = seen[0];
            for s in seen {
                assert_eq!(
                    (s.status, &s.headers),
                    (first.status, &first.headers),
                    "{}: {} ({}) differs from {} ({})",
                    s.code,
                    s.port,
                    s.what,
                    first.port,
                    first.what
                );
            }
            let mut ports: Vec<&str> = seen.iter().map(|s| s.port).collect();
            ports.dedup();
            if ports.len() >= 2 {
                shared.push(first.code);
            }
        }
        shared
    }
}

fn token(r: &Resp) -> String {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token in {}", r.body)).to_owned()
}

/// Waiters queued for `k` on the lock tier: in the filter and at the arbiter.
async fn queued(st: &Stack, c: &LockClient, k: &str) -> u64 {
    let stats = st.envoy().stats().await.unwrap();
    let name = "lockmesh_filter_queue_depth.ns.payments: ";
    let in_filter = stats.lines().find_map(|l| l.split_once(name).map(|(_, n)| n.trim().parse::<u64>().unwrap()));
    let r = c.get("/v1/locks", &[("x-lock-key", k)]).await.unwrap();
    in_filter.unwrap_or(0) + r.json["waiting_here"].as_u64().unwrap_or(0)
}

async fn wait_queued(st: &Stack, c: &LockClient, k: &str, n: u64) {
    eventually_true(Duration::from_secs(10), "waiters queued", || async { queued(st, c, k).await == n }).await;
}

/// A JSON POST with `cert` to the arbiter's ext_proc port (HTTP/2 by ALPN).
async fn post_ext_proc(st: &Stack, cert: (&Path, &Path), path: &str, auth: Option<&str>, body: &Value) -> Resp {
    let c = LockClient::new(st.arbiter(0).grpc_port(), &st.pki().ca_cert_path(), Some(cert)).unwrap();
    let bearer = auth.map(|t| format!("Bearer {t}"));
    let mut h = vec![("content-type", "application/json")];
    if let Some(b) = &bearer {
        h.push(("authorization", b.as_str()));
    }
    let r = c.request(Method::POST, path, &h, serde_json::to_vec(body).unwrap()).await.unwrap();
    assert_eq!(r.version, reqwest::Version::HTTP_2, "{path}");
    r
}

#[tokio::test]
async fn every_lock_refusal_is_cores_answer_on_every_port() {
    // The lock tier: one worker (so the queue bound below is one queue), a queue of
    // one waiter per key, validate granted and rate limited to 2/s, billing homed
    // elsewhere, the arbiter's wait bound below the filter's.
    let lock_tier = Stack::builder("errors-lock-tier")
        .envoy_config("lock-tier")
        .envoy_concurrency(1)
        .envoy_replace(r#""max_queue_per_key": 1000"#, r#""max_queue_per_key": 1"#)
        .envoy_replace(PAYMENTS_GRANT, PAYMENTS_GRANT_VALIDATE)
        .max_wait_ms(ARBITER_MAX_WAIT_MS)
        .arbiter_extra_yaml("validate_rate_per_s: 2")
        .arbiter_extra_yaml(REGION)
        .start();
    let sidecar =
        Stack::builder("errors-sidecar").envoy_config("inbound-sidecar").max_wait_ms(ARBITER_MAX_WAIT_MS).start();
    let (st, sc) = tokio::try_join!(lock_tier, sidecar).unwrap();
    let mut seen = Refusals::default();
    let a = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();

    // --- The filter's local answers (lock tier).
    let r = a.post(ACQ, &[("x-lock-key", "payments/a//b")]).await.unwrap();
    let e = seen.expect("filter", "malformed x-lock-key", &r, Code::BadRequest);
    assert!(e.message.contains("x-lock-key"), "{}", r.body);
    let r = a.post(ACQ, &[("x-lock-key", "payments/a"), ("x-lock-wait-ms", "40000")]).await.unwrap();
    let e = seen.expect("filter", "wait above the filter's bound", &r, Code::BadRequest);
    assert!(e.message.contains("30000"), "the filter's bound: {}", r.body);
    let r = a.get("/v1/nope", &[]).await.unwrap();
    seen.expect("filter", "unknown /v1 route", &r, Code::NotFound);
    let r = a.post(ACQ, &[("x-lock-key", "billing/not-mine")]).await.unwrap();
    seen.expect("filter", "key outside the caller's grants", &r, Code::Denied);

    // --- The arbiter's answers through ext_proc (lock tier).
    let r = a.post(ACQ, &[("x-lock-key", "payments/a"), ("x-lock-wait-ms", "10000")]).await.unwrap();
    let e = seen.expect("arbiter", "wait above the arbiter's bound", &r, Code::BadRequest);
    assert!(e.message.contains(&ARBITER_MAX_WAIT_MS.to_string()), "the arbiter's bound: {}", r.body);
    let r = a.post(REL, &[("x-lock-key", "payments/a")]).await.unwrap();
    seen.expect("arbiter", "release without a token", &r, Code::BadRequest);
    let r = a.get("/v1/locks", &[("x-lock-key", "payments/a"), ("x-lock-class", "short")]).await.unwrap();
    seen.expect("arbiter", "x-lock-class other than the key's", &r, Code::ClassMismatch);
    let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", "00000000000000ff")]).await.unwrap();
    seen.expect("arbiter", "keepalive of no session", &r, Code::SessionExpired);
    let held = "payments/errors/held";
    let granted = a.post(ACQ, &[("x-lock-key", held)]).await.unwrap();
    assert_eq!(granted.code(), 200, "{}", granted.body);
    let r = b.post(ACQ, &[("x-lock-key", held), ("x-lock-wait-ms", "0")]).await.unwrap();
    let e = seen.expect("arbiter", "key held, wait 0", &r, Code::Contended);
    assert_eq!(e.reason.and_then(|r| r.known()), Some(Reason::KeyGated), "{}", r.body);
    let wrong = (token(&granted).parse::<u64>().unwrap() + 1).to_string();
    let r = a.post(REL, &[("x-lock-key", held), ("x-lock-token", &wrong)]).await.unwrap();
    seen.expect("arbiter", "release with a wrong token", &r, Code::NotHolder);
    // Validate over its rate: every refusal is canonical, and one is rate_limited.
    let mut limited = 0;
    for _ in 0..8 {
        let r = a.post(VALIDATE, &[("x-lock-key", held), ("x-lock-token", &token(&granted))]).await.unwrap();
        if r.code() != 200 {
            seen.expect("arbiter", "validate over validate_rate_per_s", &r, Code::RateLimited);
            limited += 1;
        }
    }
    assert!(limited > 0, "8 validates at once were all under a rate of 2/s");
    let r = st.client("billing", "a").unwrap().post(ACQ, &[("x-lock-key", "billing/inv-1")]).await.unwrap();
    let e = seen.expect("arbiter", "key homed in another region", &r, Code::WrongRegion);
    assert_eq!(e.region.as_deref(), Some("us-1"), "{}", r.body);

    // --- A full queue and a waiter whose wait ends in the queue: the filter's
    // answers; the head, waiting at the arbiter, is answered by the arbiter.
    let crowded = "payments/errors/crowded";
    assert_eq!(a.post(ACQ, &[("x-lock-key", crowded)]).await.unwrap().code(), 200);
    let head = st.client("payments", "head").unwrap();
    let head =
        tokio::spawn(async move { head.post(ACQ, &[("x-lock-key", crowded), ("x-lock-wait-ms", "4000")]).await });
    wait_queued(&st, &a, crowded, 1).await;
    let w = st.client("payments", "w").unwrap();
    let waiter = tokio::spawn(async move { w.post(ACQ, &[("x-lock-key", crowded), ("x-lock-wait-ms", "1500")]).await });
    wait_queued(&st, &a, crowded, 2).await;
    let late = st.client("payments", "late").unwrap();
    let r = late.post(ACQ, &[("x-lock-key", crowded), ("x-lock-wait-ms", "3000")]).await.unwrap();
    seen.expect("filter", "one waiter more than max_queue_per_key", &r, Code::QueueFull);
    let r = tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap().unwrap();
    let e = seen.expect("filter", "wait ended in the filter's queue", &r, Code::Contended);
    assert_eq!(e.reason.and_then(|r| r.known()), Some(Reason::KeyGated), "{}", r.body);
    let r = tokio::time::timeout(Duration::from_secs(10), head).await.unwrap().unwrap().unwrap();
    seen.expect("arbiter", "wait ended at the arbiter", &r, Code::Contended);

    // --- The VM routes on the arbiter's ext_proc port, with Envoy's certificate
    // and, refused, with a workload's.
    let envoy = st.pki().envoy_client();
    let envoy = (envoy.cert_path.as_path(), envoy.key_path.as_path());
    let r = post_ext_proc(&st, envoy, "/internal/v1/vm/keepalive", None, &json!({"vm": "not-a-vm-id"})).await;
    let e = seen.expect("vm", "keepalive with a bad vm id", &r, Code::BadRequest);
    assert!(e.message.starts_with("vm:"), "{}", r.body);
    let rel = json!({"vm": "NOT-HEX", "key": "payments/a", "hold": 1});
    let r = post_ext_proc(&st, envoy, "/internal/v1/vm/release", None, &rel).await;
    seen.expect("vm", "release with a bad vm id", &r, Code::BadRequest);
    let workload = st.pki().client("payments", "a").unwrap();
    let vm = json!({"vm": "0123456789abcdef0123456789abcdef"});
    let r = post_ext_proc(&st, (&workload.cert_path, &workload.key_path), "/internal/v1/vm/keepalive", None, &vm).await;
    seen.expect("vm", "keepalive with a workload's certificate", &r, Code::Denied);

    // --- Transparent mode (inbound sidecar): the filter's refusals and the arbiter's, on
    // `/jobs` (the caller chooses the key there; `/orders/{id}` binds it).
    let w = sc.client("payments", "worker").unwrap();
    let r = w.post("/jobs/1", &[]).await.unwrap();
    seen.expect("transparent", "locked route without x-lock-key", &r, Code::LockRequired);
    let r = w.post("/jobs/1", &[("x-lock-key", "billing/not-mine")]).await.unwrap();
    seen.expect("transparent", "key outside the caller's grants", &r, Code::Denied);
    let r = w.post("/jobs/1", &[("x-lock-key", "payments/a//b")]).await.unwrap();
    seen.expect("transparent", "malformed x-lock-key", &r, Code::BadRequest);
    let r = w.post("/jobs/1", &[("x-lock-key", "payments/tp"), ("x-lock-wait-ms", "10000")]).await.unwrap();
    let e = seen.expect("transparent", "wait above the arbiter's bound", &r, Code::BadRequest);
    assert!(e.message.contains(&ARBITER_MAX_WAIT_MS.to_string()), "the arbiter's bound: {}", r.body);
    let slow = tokio::spawn({
        let w = w.clone();
        async move { w.post("/jobs/2", &[("x-lock-key", "payments/tp-held"), (DELAY_HEADER, "1500")]).await }
    });
    eventually_true(Duration::from_secs(10), "the slow request reached the backend", || async {
        !sc.backend().requests().is_empty()
    })
    .await;
    let other = sc.client("payments", "other").unwrap();
    let r = other.post("/jobs/2", &[("x-lock-key", "payments/tp-held"), ("x-lock-wait-ms", "0")]).await.unwrap();
    seen.expect("transparent", "key held by a request in flight, wait 0", &r, Code::Contended);
    assert_eq!(slow.await.unwrap().unwrap().code(), 200);
    assert_eq!(sc.backend().requests().len(), 1, "a refused request reached the upstream");

    // --- One code, one answer, whichever port gave it.
    let shared = seen.assert_same_across_ports();
    for code in [Code::BadRequest, Code::Denied, Code::Contended] {
        assert!(shared.contains(&code), "{code} was not compared across ports: {shared:?}");
    }
}

/// An operator token for `sub`: fresh, signed in with a second factor (`amr`, as
/// `require_mfa` wants), with the operator role unless `role` is false.
fn operator_token(idp: &Issuer, sub: &str, role: bool) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let mut claims =
        json!({"iss": ISS, "aud": "lockmesh-admin", "sub": sub, "exp": now + 600, "iat": now, "amr": ["pwd", "otp"]});
    if role {
        claims["realm_access"] = json!({"roles": ["lock-operator"]});
    }
    idp.token(&claims).unwrap()
}

/// An operator-plane answer, as compared across ports.
#[derive(Debug, PartialEq)]
struct OpAnswer {
    status: u16,
    code: String,
    members: Vec<String>,
    www_authenticate: Option<String>,
    content_type: Option<String>,
}

impl OpAnswer {
    fn of(status: u16, hdrs: &reqwest::header::HeaderMap, body: &str) -> Self {
        let b: AdminErrorBody = serde_json::from_str(body).unwrap_or_else(|e| panic!("{status} {body}: {e}"));
        let v: Value = serde_json::from_str(body).unwrap();
        let members = v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        let h = |n: &str| hdrs.get(n).map(|v| v.to_str().unwrap().to_owned());
        Self { status, code: b.code, members, www_authenticate: h("www-authenticate"), content_type: h("content-type") }
    }
}

/// A lock-tier stack whose arbiter has an `operators` section (the lockctl
/// client allowed, a fresh issuer's JWKS) and `extra` YAML after it; the issuer
/// and the directory holding its JWKS come back with it.
async fn operators_stack(name: &str, extra: &str) -> (Stack, Issuer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let idp = Issuer::generate("k1").unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, idp.jwks()).unwrap();
    let operators = format!(
        "operators: {{ allowed_clients: [\"spiffe://{TEST_TRUST_DOMAIN}/ns/lockmesh-system/sa/lockctl\"], \
         jwks_file: {:?}, issuer: {ISS:?}, max_token_age_s: 900 }}{extra}",
        jwks.display().to_string()
    );
    let st = Stack::builder(name).envoy_config("lock-tier").arbiter_extra_yaml(operators).start().await.unwrap();
    (st, idp, dir)
}

/// The same refusal on the admin-action routes (ext_proc port, an allowed admin
/// client's certificate) and on the console's API (admin port): same status, same
/// `{code, message}` body, `www-authenticate: Bearer` on the 401s on both. Fails if
/// the console's `Refusal` dropped `www-authenticate`, or `AdminError::status` were
/// bypassed on either port (e.g. the admin actions answering 403 for a missing token).
#[tokio::test]
async fn operator_refusals_are_one_answer_on_both_ports() {
    let (st, idp, _dir) = operators_stack("errors-operators", "").await;
    let admin_client = st.pki().client("lockmesh-system", "lockctl").unwrap();
    let console = format!("http://127.0.0.1:{}/console/api/state", st.arbiter(0).admin_port());
    let http = reqwest::Client::new();

    let forged = operator_token(&Issuer::generate("k1").unwrap(), "mallory", true);
    let no_role = operator_token(&idp, "carol", false);
    let cases = [
        ("no token", None, "admin.token_missing", 401),
        ("a forged token", Some(forged.as_str()), "admin.token_invalid", 401),
        ("a token without the role", Some(no_role.as_str()), "admin.role_missing", 403),
    ];
    for (what, tok, code, status) in cases {
        let cert = (admin_client.cert_path.as_path(), admin_client.key_path.as_path());
        let path = lockmesh_ops::admin::routes::REQUEST;
        let r = post_ext_proc(&st, cert, path, tok, &json!({})).await;
        let actions = OpAnswer::of(r.code(), &r.headers, &r.body);
        let mut req = http.get(&console);
        if let Some(t) = tok {
            req = req.bearer_auth(t);
        }
        let r = req.send().await.unwrap();
        let (s, h) = (r.status().as_u16(), r.headers().clone());
        let on_console = OpAnswer::of(s, &h, &r.text().await.unwrap());
        let want = OpAnswer {
            status,
            code: code.to_owned(),
            members: vec!["code".into(), "message".into()],
            www_authenticate: (status == 401).then(|| "Bearer".to_owned()),
            content_type: Some("application/json".into()),
        };
        assert_eq!(actions, want, "{what}: the admin action {path}");
        assert_eq!(on_console, want, "{what}: the console");
    }
    // The control: the operator's own token is let in on the console.
    let r = http.get(&console).bearer_auth(operator_token(&idp, "alice", true)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
}

/// The console's API answers only peers in `console.api_from` (loopback by
/// default): the admin port is plain HTTP, so an operator token must not be
/// accepted from a peer whose traffic crossed a network. Here the arbiter answers
/// only 127.0.0.2: the same valid token from 127.0.0.1 is refused with
/// `403 console.remote_refused` before it is looked at (and with none), and from
/// 127.0.0.2 it is let in; the page and /metrics stay open to every peer.
/// Fails if the peer check is dropped (127.0.0.1 would get 200), or if it read a
/// header a client writes (`x-forwarded-for` is sent naming the allowed peer).
#[tokio::test]
async fn the_console_api_answers_only_the_peers_it_is_configured_for() {
    let extra = "\nconsole: { api_from: [\"127.0.0.2/32\"] }";
    let (st, idp, _dir) = operators_stack("errors-console-peers", extra).await;
    let admin = st.arbiter(0).admin_port();
    let token = operator_token(&idp, "alice", true);
    let from = |ip: [u8; 4]| reqwest::Client::builder().local_address(std::net::IpAddr::from(ip)).build().unwrap();
    let api = format!("http://127.0.0.1:{admin}/console/api/state");
    for (what, tok, xff) in [
        ("a valid token", Some(token.as_str()), None),
        ("no token", None, None),
        ("a valid token naming the allowed peer in x-forwarded-for", Some(token.as_str()), Some("127.0.0.2")),
    ] {
        let mut req = from([127, 0, 0, 1]).get(&api);
        if let Some(t) = tok {
            req = req.bearer_auth(t);
        }
        if let Some(x) = xff {
            req = req.header("x-forwarded-for", x).header("forwarded", format!("for={x}"));
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap();
        assert_eq!((status, body["code"].as_str()), (403, Some("console.remote_refused")), "{what}: {body}");
    }
    for path in ["/console", "/metrics", "/healthz"] {
        let r = from([127, 0, 0, 1]).get(format!("http://127.0.0.1:{admin}{path}")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
    }
    // The control: the allowed peer with the operator's token.
    let r = from([127, 0, 0, 2]).get(&api).bearer_auth(&token).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
}

/// The SDK decides retries by `Code::retryable` for every code, through its public
/// `Error` (refusals keep the service's code; `contended` and `unavailable` have
/// variants of their own). Fails if `Error::retryable` in `client/src/error.rs`
/// answered from its own list (e.g. `leaked` retryable) or core's table changed
/// without the SDK following. The mapping from a wire refusal to `Error`
/// (`CallError::into_error`) is crate-private; `client/src/error.rs`'s own test
/// covers it.
#[test]
fn the_sdks_retry_decision_is_cores_for_every_code() {
    use lockmesh_client::Error;
    for code in Code::ALL {
        let e = Error::Refused { status: code.status(), code: code.into(), message: "m".into() };
        assert_eq!((e.code(), e.retryable()), (code.as_str(), code.retryable()), "{code}");
    }
    let contended = Error::Contended { reason: Reason::KeyGated.as_str().into() };
    assert_eq!((contended.code(), contended.retryable()), ("contended", Code::Contended.retryable()));
    let unavailable = Error::Unavailable("x".into());
    assert_eq!((unavailable.code(), unavailable.retryable()), ("unavailable", Code::Unavailable.retryable()));
    let unknown = Error::Refused { status: 418, code: AnyCode::parse("teapot"), message: "m".into() };
    assert!(!unknown.retryable(), "a code this build does not know is never retried");
}
