//! Issue #23, item 2: `docs/openapi.yaml` is the lock API's contract, and it cannot
//! drift from the code that answers it.
//!
//! - [`the_document_names_every_route_code_and_header`]: the document is valid
//!   OpenAPI 3.1 (`openapi-spec-validator`), its operations are the lock API's route
//!   table (`lockmesh_core::route::API_ROUTES`), its error codes are core's table with
//!   each code under its status and `retry-after` where the table says, and its
//!   headers are core's header names.
//! - [`every_answer_body_is_a_wire_struct_the_document_allows`]: every answer body
//!   type of `lockmesh_core::wire` (`api`, `ErrorBody`), serialised, is valid
//!   against its schema (JSON Schema 2020-12, `jsonschema`), each schema names
//!   exactly the members the struct can print and requires exactly those it always
//!   prints, and a drifted body (a member renamed, retyped or added) is refused.
//! - [`schemathesis_finds_no_answer_outside_the_document`]: schemathesis drives a
//!   live stack (etcd, arbiter, lock-tier Envoy) with the document's test profile
//!   and every check: no 5xx, no status, header or body the document does not
//!   allow, no request refused that the document allows or accepted that it
//!   refuses, no request that hangs; the stack answers normally afterwards. With
//!   the arbiter's planted `wire_drift` (`POST /v1/sessions` answers `ttl_s` as a
//!   string) the same run fails on that operation's body.
//!
//! The tools (`openapi-spec-validator`, `schemathesis`, `jsonschema`) are the PyPI
//! packages `scripts/setup` pins into `.tools/openapi`; a missing one fails here.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use lockmesh_core::{
    code::RETRY_AFTER_S,
    headers::{self, SessionId},
    quota::Quota,
    route::API_ROUTES,
    wire::{
        api::{
            Acquired, AcquiredAll, Election, Holder, KeyGrant, Leader, LockInfo, Proclaimed, Released, SessionClosed,
            SessionHold, SessionHolds, SessionOpened, SessionRenewed, TokenValidity,
        },
        ErrorBody,
    },
    Code, FencingToken, Reason,
};
use lockmesh_tests::{repo_root, Stack, DEFAULT_TEST_REGISTRY};
use serde_json::{json, Value};

/// The document, as shipped.
const DOC: &str = include_str!("../../../docs/openapi.yaml");

/// The lock tier's grant of the test payments identity, and the same with
/// `validate` (as in `errors.rs`): the schemathesis client may call every route.
const PAYMENTS_GRANT: &str = r#"{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments", "short"], "operations": ["acquire", "inspect"]}"#;
const PAYMENTS_GRANT_VALIDATE: &str = r#"{"identity": "spiffe://lockmesh.test/ns/payments/", "prefixes": ["payments", "short"], "operations": ["acquire", "inspect", "validate"]}"#;

/// The lock tier's shipped `max_wait_ms` (envoy-config/lock-tier.yaml), replaced by
/// the test profile's.
const FILTER_MAX_WAIT: &str = r#""max_wait_ms": 30000"#;

/// Test cases per operation and phase (schemathesis `--max-examples`).
const MAX_EXAMPLES: u32 = 12;

/// Longest a single request may take before schemathesis reports it (a hang). Far
/// above the profile's wait, Envoy's ext_proc message timeout (3 s) included.
const REQUEST_TIMEOUT_S: u32 = 10;

/// The whole schemathesis run's bound: a run that takes longer hangs.
const RUN_TIMEOUT: Duration = Duration::from_secs(240);

fn doc() -> Value {
    serde_saphyr::from_str(DOC).expect("docs/openapi.yaml is YAML")
}

/// `<repo>/.tools/openapi/bin/<tool>`; missing means scripts/setup did not run.
fn tool(name: &str) -> PathBuf {
    let p = repo_root().join(".tools/openapi/bin").join(name);
    assert!(p.is_file(), "{} is missing: run ./scripts/setup (it installs the OpenAPI tools)", p.display());
    p
}

/// Follows a local `$ref` (`#/components/...`) from the document root.
fn resolve<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let ptr = r.strip_prefix('#').unwrap_or_else(|| panic!("not a local $ref: {r}"));
            resolve(doc, doc.pointer(ptr).unwrap_or_else(|| panic!("dangling $ref {r}")))
        }
        None => v,
    }
}

/// Runs `openapi-spec-validator` on `path`.
fn validate_spec(path: &Path) {
    let out = Command::new(tool("openapi-spec-validator")).arg(path).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("OK"), "openapi-spec-validator {}: {text}", path.display());
}

/// Every `(method, path, operation)` of the document.
fn operations(doc: &Value) -> Vec<(String, String, &Value)> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            ops.push((method.to_ascii_uppercase(), path.clone(), op));
        }
    }
    ops
}

/// The codes a response (component) lists in its JSON body's `code` enum.
fn response_codes(doc: &Value, resp: &Value) -> Vec<String> {
    let resp = resolve(doc, resp);
    let Some(schema) = resp.pointer("/content/application~1json/schema") else {
        return Vec::new();
    };
    let Some(all) = schema.get("allOf").and_then(Value::as_array) else {
        return Vec::new();
    };
    all.iter()
        .filter_map(|s| s.pointer("/properties/code/enum"))
        .flat_map(|e| e.as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_owned()))
        .collect()
}

#[test]
fn the_document_names_every_route_code_and_header() {
    validate_spec(&repo_root().join("docs/openapi.yaml"));
    let doc = doc();
    assert_eq!(doc["openapi"], "3.1.0");

    // Routes: exactly the route table.
    let documented: BTreeSet<(String, String)> = operations(&doc).into_iter().map(|(m, p, _)| (m, p)).collect();
    let routed: BTreeSet<(String, String)> =
        API_ROUTES.iter().map(|(m, p, _)| ((*m).to_owned(), (*p).to_owned())).collect();
    assert_eq!(documented, routed, "docs/openapi.yaml's operations vs lockmesh_core::route::API_ROUTES");

    // Codes: the enum is Code::ALL, in order.
    let all: Vec<&str> = Code::ALL.iter().map(|c| c.as_str()).collect();
    let listed: Vec<&str> = doc["components"]["schemas"]["ErrorCode"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(listed, all, "ErrorCode's enum vs Code::ALL");

    // The body's reasons and quotas: core's.
    let members = |name: &str| -> Vec<String> {
        let e = &doc["components"]["schemas"]["ErrorBody"]["properties"][name]["enum"];
        e.as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect()
    };
    let reasons: Vec<String> = Reason::ALL.iter().map(|r| r.as_str().to_owned()).collect();
    assert_eq!(members("reason"), reasons, "ErrorBody.reason vs Reason::ALL");
    let quotas: Vec<String> = Quota::ALL.iter().map(|q| q.as_str().to_owned()).collect();
    assert_eq!(members("quota"), quotas, "ErrorBody.quota vs Quota::ALL");

    // Each response component lists codes of one status, carries `retry-after` iff
    // one of them does, `x-lockmesh-region` iff `wrong_region`, and together they
    // list every code exactly once.
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    let mut status_of_component: BTreeMap<String, u16> = BTreeMap::new();
    for (name, resp) in doc["components"]["responses"].as_object().unwrap() {
        let codes: Vec<Code> = response_codes(&doc, resp)
            .iter()
            .map(|c| Code::parse(c).unwrap_or_else(|| panic!("{name}: {c} is not a code of core's table")))
            .collect();
        if codes.is_empty() {
            continue;
        }
        for c in &codes {
            if let Some(other) = seen.insert(c.as_str().to_owned(), name.clone()) {
                panic!("{c} is listed by both {other} and {name}");
            }
        }
        let statuses: BTreeSet<u16> = codes.iter().map(|c| c.status()).collect();
        assert_eq!(statuses.len(), 1, "{name} lists codes of several statuses: {codes:?}");
        status_of_component.insert(name.clone(), codes[0].status());
        let hdrs = resp["headers"].as_object().cloned().unwrap_or_default();
        assert!(hdrs.contains_key(headers::ERROR), "{name}: no {}", headers::ERROR);
        let retry = codes.iter().any(|c| c.retry_after_s().is_some());
        assert_eq!(
            hdrs.contains_key(headers::RETRY_AFTER),
            retry,
            "{name}: {} vs Code::retry_after_s",
            headers::RETRY_AFTER
        );
        let region = codes.contains(&Code::WrongRegion);
        assert_eq!(hdrs.contains_key(headers::REGION), region, "{name}: {}", headers::REGION);
        if !codes.iter().any(|c| matches!(c, Code::BadRequest | Code::Internal | Code::Sealed | Code::Unavailable)) {
            // Only 400, 500 and 503 may come from Envoy itself, without the header.
            assert_eq!(resolve(&doc, &hdrs[headers::ERROR])["required"], true, "{name}: {} required", headers::ERROR);
        }
    }
    let missing: Vec<&&str> = all.iter().filter(|c| !seen.contains_key(**c)).collect();
    assert!(missing.is_empty(), "codes no response of docs/openapi.yaml lists: {missing:?}");
    assert_eq!(
        resolve(&doc, &doc["components"]["headers"]["RetryAfter"])["schema"]["const"],
        RETRY_AFTER_S.to_string(),
        "retry-after's value"
    );

    // Every operation: each refusal component sits under its own status, every
    // parameter is a header of core's LOCK_HEADERS, and only lockmesh's answer
    // headers are documented.
    let answer_headers: BTreeSet<&str> = [
        headers::TOKEN,
        headers::SESSION,
        headers::PROOF,
        headers::GRANT,
        headers::SEALED,
        headers::ERROR,
        headers::REGION,
        headers::RETRY_AFTER,
    ]
    .into();
    let mut request_headers = BTreeSet::new();
    let mut documented_answer_headers = BTreeSet::new();
    for (method, path, op) in operations(&doc) {
        let at = format!("{method} {path}");
        for p in op["parameters"].as_array().unwrap() {
            let p = resolve(&doc, p);
            assert_eq!(p["in"], "header", "{at}: every parameter is a header");
            let name = p["name"].as_str().unwrap();
            assert!(headers::LOCK_HEADERS.contains(&name), "{at}: {name} is not one of core's LOCK_HEADERS");
            assert!(!headers::never_from_client(name), "{at}: {name} is stripped from every client");
            request_headers.insert(name.to_owned());
        }
        assert!(op.get("requestBody").is_none(), "{at}: no route reads a body");
        for (status, resp) in op["responses"].as_object().unwrap() {
            let status: u16 = status.parse().unwrap_or_else(|_| panic!("{at}: status {status}"));
            if let Some(r) = resp.get("$ref").and_then(Value::as_str) {
                let name = r.rsplit('/').next().unwrap();
                if let Some(s) = status_of_component.get(name) {
                    assert_eq!(*s, status, "{at}: {name} under {status}");
                }
            }
            for h in resolve(&doc, resp)["headers"].as_object().into_iter().flat_map(|m| m.keys()) {
                assert!(answer_headers.contains(h.as_str()), "{at} {status}: {h} is not a lockmesh answer header");
                documented_answer_headers.insert(h.clone());
            }
        }
    }
    let lock_headers: BTreeSet<String> = headers::LOCK_HEADERS.iter().map(|h| (*h).to_owned()).collect();
    assert_eq!(request_headers, lock_headers, "request headers vs core's LOCK_HEADERS");
    let answer_headers: BTreeSet<String> = answer_headers.iter().map(|h| (*h).to_owned()).collect();
    assert_eq!(documented_answer_headers, answer_headers, "answer headers documented");
    let acquired = &doc["paths"]["/v1/locks/acquire"]["post"]["responses"]["200"]["headers"];
    for h in [headers::TOKEN, headers::SESSION, headers::PROOF, headers::GRANT] {
        assert!(acquired.get(h).is_some(), "an acquire's answer documents {h}");
    }
    assert_eq!(acquired[headers::TOKEN]["required"], true);
    let opened = &doc["paths"]["/v1/sessions"]["post"]["responses"]["200"]["headers"];
    assert_eq!(opened[headers::SESSION]["required"], true, "a session's answer names it in {}", headers::SESSION);
}

/// One body to check against a schema of the document (a JSON pointer), and
/// whether the schema must accept it.
struct Case {
    schema: String,
    what: String,
    body: Value,
    valid: bool,
}

fn case(schema: &str, what: &str, body: &impl serde::Serialize, valid: bool) -> Case {
    Case { schema: schema.to_owned(), what: what.to_owned(), body: serde_json::to_value(body).unwrap(), valid }
}

/// Validates every case with `jsonschema` (Draft 2020-12, the dialect of OpenAPI
/// 3.1), formats checked; returns one line per case the validator disagrees with.
const VALIDATE_PY: &str = r##"
import json, sys
import jsonschema
req = json.load(sys.stdin)
bad = []
for c in req["cases"]:
    root = {"$ref": "#" + c["schema"], "components": req["doc"]["components"]}
    errs = list(jsonschema.Draft202012Validator(root, format_checker=jsonschema.FormatChecker()).iter_errors(c["body"]))
    if bool(errs) == c["valid"]:
        bad.append("%s: %s" % (c["what"], "; ".join(e.message for e in errs) or "accepted, should be refused"))
print(json.dumps(bad))
"##;

fn jsonschema_disagreements(doc: &Value, cases: &[Case]) -> Vec<String> {
    let req = json!({
        "doc": doc,
        "cases": cases.iter().map(|c| json!({"schema": c.schema, "what": c.what, "body": c.body, "valid": c.valid})).collect::<Vec<_>>(),
    });
    let mut child = Command::new(tool("python"))
        .args(["-c", VALIDATE_PY])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(req.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "jsonschema (run ./scripts/setup): {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The member names of each object schema (`properties`) must be the members the
/// struct prints in some body, and `required` those it prints in every body.
fn assert_members(doc: &Value, schema: &str, bodies: &[Value]) {
    let s = doc.pointer(schema).unwrap_or_else(|| panic!("no schema {schema}"));
    let props: BTreeSet<String> = s["properties"].as_object().unwrap().keys().cloned().collect();
    let required: BTreeSet<String> =
        s["required"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
    let keys = |b: &Value| b.as_object().unwrap().keys().cloned().collect::<BTreeSet<String>>();
    let some: BTreeSet<String> = bodies.iter().flat_map(keys).collect();
    let every: BTreeSet<String> = bodies.iter().map(keys).reduce(|a, b| &a & &b).unwrap_or_default();
    assert_eq!(props, some, "{schema}: properties vs the members the wire struct prints");
    assert_eq!(required, every, "{schema}: required vs the members the wire struct always prints");
    assert_eq!(s["additionalProperties"], false, "{schema}: closed, so a drift shows");
}

/// The `Token` schema accepts exactly what the arbiter's token parser accepts (a
/// canonical decimal from 1 to 2^63 - 1), but for a revision of 0 (a multiple of
/// 2^48), which no pattern can say and the schema's description does. A pattern
/// that lets 19-digit values above 2^63 - 1 through (the one before) fails here:
/// schemathesis generated one and the arbiter answered `400` to a request the
/// document called valid.
#[test]
fn the_token_pattern_is_the_token_parser() {
    let doc = doc();
    let mut candidates: Vec<String> = [
        "1",
        "9",
        "10",
        "281474976710657",
        "999999999999999999",
        "1000000000000000000",
        "9223372036854775807",
        "9223372036854775808",
        "9223372036854775810",
        "9223372036854775899",
        "9300000000000000000",
        "9999999999999999999",
        "18446744073709551615",
        "18446744073709551616",
        "0",
        "01",
        "+1",
        "",
        "1 ",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    // Each power of ten's neighbours, and the largest value of every epoch step.
    for k in 1..=19u32 {
        let p = 10u128.pow(k);
        candidates.extend([(p - 1).to_string(), (p + 1).to_string()]);
    }
    for e in [1u64, 2, 3552, 3553, 32766, 32767] {
        candidates.push(((e << 48) + 1).to_string());
        candidates.push(((e << 48) + (1 << 48) - 1).to_string());
    }
    let cases: Vec<Case> = candidates
        .iter()
        .filter(|s| s.parse::<u128>().map_or(true, |v| v % (1u128 << 48) != 0 || v == 0))
        .map(|s| {
            let valid = s.parse::<lockmesh_core::FencingToken>().is_ok();
            case("/components/schemas/Token", &format!("token {s:?}"), s, valid)
        })
        .collect();
    let bad = jsonschema_disagreements(&doc, &cases);
    assert!(bad.is_empty(), "the Token pattern and the token parser disagree:\n{}", bad.join("\n"));
}

#[test]
fn every_answer_body_is_a_wire_struct_the_document_allows() {
    let doc = doc();
    let schema = |name: &str| format!("/components/schemas/{name}");
    let sid = SessionId::from_lease(0x0250_a229_4332_e903).unwrap();
    let token = FencingToken::mint(1, 3).unwrap();
    let acquired = Acquired {
        class: "default".into(),
        cluster: Some("coord".into()),
        epoch: 1,
        honoured_from: None,
        existing: false,
        grant: None,
        new_session: true,
        permits: None,
        mode: None,
        outage: None,
        proof: Some("v1.k1.cGF5bG9hZA.c2ln".into()),
        revision: 3,
        session: Some(sid),
        token: token.to_string(),
        ttl_s: 15,
        unprotected: false,
    };
    let acquired_bare = Acquired { cluster: None, proof: None, existing: true, new_session: false, ..acquired.clone() };
    let acquired_permits = Acquired {
        permits: Some(3),
        mode: Some(lockmesh_core::headers::LockMode::Exclusive),
        honoured_from: Some(0),
        ..acquired.clone()
    };
    let unprotected = Acquired {
        class: "batch".into(),
        cluster: None,
        epoch: 1,
        honoured_from: None,
        existing: false,
        grant: Some("5f0c2b0123456789abcdef0123456789".into()),
        new_session: false,
        permits: None,
        mode: None,
        outage: Some("coord-1764486221123".into()),
        proof: None,
        revision: 0,
        session: None,
        token: headers::UNPROTECTED_TOKEN.into(),
        ttl_s: 20,
        unprotected: true,
    };
    let own = Holder {
        age_ms: 1520,
        identity: "spiffe://lockmesh.test/ns/payments/sa/a".into(),
        session: Some(sid),
        token: Some(token),
        you: true,
        permits: None,
        mode: None,
    };
    let other = Holder {
        age_ms: 3,
        identity: "spiffe://lockmesh.test/ns/payments/sa/b".into(),
        session: None,
        token: None,
        you: false,
        permits: Some(2),
        mode: Some(lockmesh_core::headers::LockMode::Shared),
    };
    let info = LockInfo {
        class: "default".into(),
        holders: vec![own.clone(), other.clone()],
        lock_delay_ms: Some(1200),
        max_holders: 1,
        waiting_here: 2,
    };
    let hold = SessionHold {
        acquired_ms: 1_764_486_221_123,
        class: "default".into(),
        cluster: Some("coord".into()),
        epoch: 1,
        honoured_from: None,
        key: "payments/orders-42".into(),
        revision: 3,
        token,
    };
    let hold_bare = SessionHold { cluster: None, ..hold.clone() };
    // After a shard move's soft advance: epoch 2, epoch 1's holds still honoured.
    let honoured = SessionHold { epoch: 2, honoured_from: Some(1), ..hold.clone() };
    let holds = SessionHolds { holds: vec![hold.clone(), hold_bare.clone(), honoured], session: sid };
    let opened = SessionOpened { class: "default".into(), session: sid, ttl_s: 15 };
    let proclaimed = Proclaimed { proclaimed: true };
    let leader = Leader {
        identity: "spiffe://lockmesh.test/ns/payments/sa/a".into(),
        since_ms: 1_764_486_221_123,
        token: None,
        value: Some("10.0.0.7:8443 primary".into()),
        you: false,
    };
    let leader_bare = Leader { value: None, ..leader.clone() };
    let leader_you = Leader { token: Some(token), you: true, ..leader.clone() };
    let cursor = "5f0c2b7e91d4a8c3e07b6a5d4c3b2a19".to_owned();
    let election = Election {
        changed: true,
        class: "default".into(),
        cursor: cursor.clone(),
        gap: false,
        leader: Some(leader.clone()),
    };
    let election_bare = Election { changed: false, leader: Some(leader_bare.clone()), ..election.clone() };
    let election_you = Election { leader: Some(leader_you.clone()), ..election.clone() };
    let election_none = Election { gap: true, leader: None, ..election.clone() };

    let key_grant = |key: &str, proof: Option<&str>| KeyGrant {
        key: key.into(),
        token: token.to_string(),
        proof: proof.map(str::to_owned),
    };
    let all = AcquiredAll {
        class: "default".into(),
        cluster: "coord".into(),
        epoch: 1,
        honoured_from: None,
        existing: false,
        new_session: true,
        revision: 3,
        session: sid,
        token: token.to_string(),
        ttl_s: 15,
        keys: vec![key_grant("payments/a", Some("v1.k1.cGF5bG9hZA.c2ln")), key_grant("payments/b", None)],
    };
    let mut cases = vec![
        case(&schema("AcquiredAll"), "multi-key grant", &all, true),
        case(
            &schema("AcquiredAll"),
            "multi-key grant after a soft advance",
            &AcquiredAll { epoch: 2, honoured_from: Some(1), ..all.clone() },
            true,
        ),
        case(
            &schema("AcquiredAll"),
            "one key is no multi-key grant",
            &AcquiredAll { keys: vec![key_grant("payments/a", None)], ..all.clone() },
            false,
        ),
        case(&schema("Acquired"), "protected grant", &acquired, true),
        case(&schema("Acquired"), "protected grant, no cluster or proof", &acquired_bare, true),
        case(&schema("Acquired"), "a 3-permit exclusive grant", &acquired_permits, true),
        case(&schema("Acquired"), "unprotected grant", &unprotected, true),
        case(&schema("Released"), "released", &Released { released: true, unprotected: false }, true),
        case(&schema("Released"), "released unprotected", &Released { released: true, unprotected: true }, true),
        case(&schema("LockInfo"), "lock info", &info, true),
        case(
            &schema("LockInfo"),
            "lock info, nobody",
            &LockInfo { holders: vec![], lock_delay_ms: None, ..info.clone() },
            true,
        ),
        case(&schema("SessionOpened"), "session opened", &opened, true),
        case(&schema("SessionRenewed"), "session renewed", &SessionRenewed { session: sid, ttl_s: 15 }, true),
        case(&schema("SessionClosed"), "session closed", &SessionClosed { closed: true }, true),
        case(&schema("SessionHolds"), "session holds", &holds, true),
        case(&schema("SessionHolds"), "no holds", &SessionHolds { holds: vec![], session: sid }, true),
        case(&schema("TokenValidity"), "current", &TokenValidity { current: true }, true),
        case(&schema("TokenValidity"), "not current", &TokenValidity { current: false }, true),
        case(&schema("Proclaimed"), "proclaimed", &proclaimed, true),
        case(&schema("Election"), "a leader with a value", &election, true),
        case(&schema("Election"), "a leader without a value", &election_bare, true),
        case(&schema("Election"), "the caller leads", &election_you, true),
        case(&schema("Election"), "nobody leads, a gap", &election_none, true),
    ];
    // Drifts the schemas must refuse: the planted `wire_drift` body, a member
    // renamed or added, a protected grant with an unprotected token, a token as a
    // number, a code under another status.
    let mut drifted = serde_json::to_value(&opened).unwrap();
    drifted["ttl_s"] = json!("15");
    cases.push(case(&schema("SessionOpened"), "ttl_s as a string (wire_drift)", &drifted, false));
    let mut renamed = serde_json::to_value(&SessionRenewed { session: sid, ttl_s: 15 }).unwrap();
    renamed["ttl"] = renamed["ttl_s"].take();
    renamed.as_object_mut().unwrap().remove("ttl_s");
    cases.push(case(&schema("SessionRenewed"), "ttl_s renamed", &renamed, false));
    let mut extra = serde_json::to_value(&acquired).unwrap();
    extra["lease"] = json!(42);
    cases.push(case(&schema("Acquired"), "an undocumented member", &extra, false));
    let zero = Acquired { token: headers::UNPROTECTED_TOKEN.into(), ..acquired.clone() };
    cases.push(case(&schema("Acquired"), "token 0 on a protected grant", &zero, false));
    let mut spaced = serde_json::to_value(&election).unwrap();
    spaced["leader"]["value"] = json!(" lead");
    cases.push(case(&schema("Election"), "a value with a leading space", &spaced, false));
    let mut revision = serde_json::to_value(&election).unwrap();
    revision["cursor"] = json!(9);
    cases.push(case(&schema("Election"), "a revision for a cursor", &revision, false));
    let mut number = serde_json::to_value(&hold).unwrap();
    number["token"] = json!(token.get());
    cases.push(case(&schema("SessionHold"), "token as a number", &number, false));

    // Every code's body under the response of its status (as the document lists
    // it), with what it carries; and under a response of another status, refused.
    let responses = doc["components"]["responses"].as_object().unwrap();
    let component_of = |code: Code| {
        responses
            .iter()
            .find(|(_, r)| response_codes(&doc, r).iter().any(|c| c == code.as_str()))
            .map(|(n, _)| n.clone())
            .unwrap_or_else(|| panic!("no response lists {code}"))
    };
    let mut error_bodies = Vec::new();
    for code in Code::ALL {
        let mut body = ErrorBody::new(code, "what is wrong, for people");
        match code {
            Code::Contended => body = body.with_reason(Reason::KeyGated),
            Code::WrongRegion => body = body.with_region("us-1"),
            Code::QuotaExceeded => body.quota = Some(Quota::Sessions.as_str().into()),
            _ => {}
        }
        let at = |name: &str| format!("/components/responses/{name}/content/application~1json/schema");
        let own = component_of(code);
        cases.push(case(&at(&own), &format!("{code} under {own}"), &body, true));
        let foreign = [Code::BadRequest, Code::Denied].map(component_of).into_iter().find(|c| *c != own).unwrap();
        cases.push(case(&at(&foreign), &format!("{code} under {foreign}"), &body, false));
        error_bodies.push(serde_json::to_value(&body).unwrap());
    }
    let mut unknown = error_bodies[0].clone();
    unknown["code"] = json!("no_such_code");
    cases.push(case(&schema("ErrorBody"), "an unknown code", &unknown, false));

    let bad = jsonschema_disagreements(&doc, &cases);
    assert!(bad.is_empty(), "docs/openapi.yaml vs lockmesh_core::wire:\n{}", bad.join("\n"));

    // The members: what each struct prints, nothing more, nothing less.
    assert_members(
        &doc,
        &schema("Acquired"),
        &[v(&acquired), v(&acquired_bare), v(&unprotected), v(&acquired_permits)],
    );
    let released =
        [v(&Released { released: true, unprotected: false }), v(&Released { released: true, unprotected: true })];
    assert_members(&doc, &schema("Released"), &released);
    let all_honoured = AcquiredAll { epoch: 2, honoured_from: Some(1), ..all.clone() };
    assert_members(&doc, &schema("AcquiredAll"), &[v(&all), v(&all_honoured)]);
    assert_members(&doc, &schema("KeyGrant"), &[v(&all.keys[0]), v(&all.keys[1])]);
    assert_members(&doc, &schema("LockInfo"), &[v(&info), v(&LockInfo { lock_delay_ms: None, ..info.clone() })]);
    assert_members(&doc, &schema("Holder"), &[v(&own), v(&other)]);
    assert_members(&doc, &schema("SessionOpened"), &[v(&opened)]);
    assert_members(&doc, &schema("SessionRenewed"), &[v(&SessionRenewed { session: sid, ttl_s: 15 })]);
    assert_members(&doc, &schema("SessionClosed"), &[v(&SessionClosed { closed: true })]);
    assert_members(&doc, &schema("SessionHolds"), &[v(&holds)]);
    let hold_honoured = SessionHold { epoch: 2, honoured_from: Some(1), ..hold.clone() };
    assert_members(&doc, &schema("SessionHold"), &[v(&hold), v(&hold_bare), v(&hold_honoured)]);
    assert_members(&doc, &schema("TokenValidity"), &[v(&TokenValidity { current: true })]);
    assert_members(&doc, &schema("Proclaimed"), &[v(&proclaimed)]);
    assert_members(&doc, &schema("Election"), &[v(&election), v(&election_bare), v(&election_none)]);
    assert_members(&doc, &schema("Leader"), &[v(&leader), v(&leader_bare), v(&leader_you)]);
    assert_members(&doc, &schema("ErrorBody"), &error_bodies);
}

/// A wire struct as JSON.
fn v(x: &impl serde::Serialize) -> Value {
    serde_json::to_value(x).unwrap()
}

/// The document's test profile applied (`x-lockmesh-test-profile`): the maximum
/// wait, and `x-lock-class` narrowed to the stack registry's classes. Returns the
/// copy's path and the maximum wait, ms.
fn test_profile(dir: &Path) -> (PathBuf, u64) {
    let mut doc = doc();
    let profile = doc["x-lockmesh-test-profile"].clone();
    let max_wait_ms = profile["max_wait_ms"].as_u64().expect("x-lockmesh-test-profile.max_wait_ms");
    let wait = doc.pointer_mut("/components/parameters/WaitMs/schema/maximum").expect("WaitMs's maximum");
    assert!(wait.as_u64().unwrap() >= max_wait_ms, "the profile lowers the maximum wait");
    *wait = json!(max_wait_ms);
    let registry: Value = serde_saphyr::from_str(DEFAULT_TEST_REGISTRY).unwrap();
    let classes: Vec<Value> = registry["classes"].as_array().unwrap().iter().map(|c| c["name"].clone()).collect();
    assert_eq!(profile["classes"], json!(classes), "the profile's classes are the test registry's");
    doc["components"]["parameters"]["Class"]["schema"] = json!({ "type": "string", "enum": classes });
    let path = dir.join("openapi.test-profile.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    validate_spec(&path);
    (path, max_wait_ms)
}

/// schemathesis's `positive_data_acceptance` with the refusals of a well-formed
/// request that docs/openapi.yaml states and no schema can (`400 class_mismatch`
/// and `session_class_mismatch`: the registry decides a key's class; a release
/// naming both `x-lock-token` and `x-lock-grant`, or neither; an acquire's
/// `x-lock-permits` beside `x-lock-mode`, or above the key's limit; a multi-key
/// acquire's keys of two classes, named twice or too long), and only for requests whose
/// headers its schemas accept (the coverage phase labels an optional header's
/// `0` positive whatever its pattern says).
const HOOKS_PY: &str = r##"# schemathesis hooks of the OpenAPI scenario (tests/tests/scenarios/openapi.rs).
import json
import os
import re

import jsonschema
import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi import checks as builtin

DOC = json.load(open(os.environ["LOCKMESH_OPENAPI_PROFILE"]))
# Refusals of a well-formed request that depend on state no schema can see: the
# registry decides a key's class (x-lock-class only checks it), and a session's.
SEMANTIC_400 = {"class_mismatch", "session_class_mismatch"}


def _schema_valid(case):
    """Whether every header the case sent is valid against its parameter's schema
    (the coverage phase may label a value positive that is not)."""
    op = DOC["paths"][case.operation.path][case.operation.method.lower()]
    for ref in op["parameters"]:
        p = DOC["components"]["parameters"][ref["$ref"].rsplit("/", 1)[1]]
        value = (case.headers or {}).get(p["name"])
        if value is None:
            continue
        schema = dict(p["schema"], components=DOC["components"])
        if schema.get("type") == "integer":
            if not re.fullmatch(r"0|[1-9][0-9]*", str(value)):
                return False
            value = int(value)
        if not jsonschema.Draft202012Validator(schema).is_valid(value):
            return False
    return True


@schemathesis.check
def lockmesh_positive_data_acceptance(ctx, response, case):
    """positive_data_acceptance, but for the refusals the document states that a
    schema cannot: SEMANTIC_400, and a release naming both a token and a grant."""
    try:
        return builtin.positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if not _schema_valid(case):
            return None
        if response.status_code == 400:
            try:
                body = json.loads(response.content)
                code, message = body.get("code"), str(body.get("message", ""))
            except (ValueError, AttributeError):
                code, message = None, ""
            if code in SEMANTIC_400:
                return None
            headers = case.headers or {}
            # A release names one grant: by token or (unprotected) by grant id.
            if case.operation.path == "/v1/locks/release" and ("x-lock-token" in headers) == ("x-lock-grant" in headers):
                return None
            # A multi-key acquire the schema allows and the registry or the key
            # grammar refuses: keys of two classes, a key twice or too long, a key
            # of a fail-open class; each refusal names x-lock-keys.
            if case.operation.path == "/v1/locks/acquire-all" and message.startswith("x-lock-keys:"):
                return None
            # An acquire's size: both x-lock-permits and x-lock-mode, more permits
            # than the key's limit (the registry's), or more than one slot on a
            # fail-open class; each refusal names x-lock-permits.
            if (
                case.operation.path == "/v1/locks/acquire"
                and ("x-lock-permits" in headers or headers.get("x-lock-mode") == "exclusive")
                and message.startswith("x-lock-permits:")
            ):
                return None
        raise
"##;

/// The statuses a well-formed request may be refused with: `410 session_expired`
/// (a well-formed id that names no session of the caller's) and `421` besides
/// schemathesis's defaults.
const CONFIG_TOML: &str = r#"[checks.positive_data_acceptance]
expected-statuses = ["2xx", "401", "403", "404", "409", "410", "421", "429", "5xx"]
"#;

/// The outcome of one schemathesis run.
struct Run {
    ok: bool,
    output: String,
    junit: String,
    took: Duration,
}

/// Runs schemathesis against `url` with `client`'s certificate, every check and
/// phase, `extra` arguments last.
async fn schemathesis(schema: &Path, url: &str, st: &Stack, report: &Path, extra: &[&str]) -> Run {
    let client = st.pki().client("payments", "openapi").unwrap();
    let junit = report.join("junit.xml");
    let (hooks, config) = (report.join("hooks.py"), report.join("schemathesis.toml"));
    std::fs::write(&hooks, HOOKS_PY).unwrap();
    std::fs::write(&config, CONFIG_TOML).unwrap();
    let mut cmd = tokio::process::Command::new(tool("schemathesis"));
    cmd.arg("--no-color")
        .args(["--config-file", &config.display().to_string()])
        .args(["run", &schema.display().to_string(), "--url", url])
        // Every check but two: `unsupported_method` wants 405 where this API
        // answers 404 `not_found` (a route is its method and path), and
        // `positive_data_acceptance` runs as HOOKS_PY's
        // `lockmesh_positive_data_acceptance`.
        .args(["--checks", "all", "--exclude-checks", "unsupported_method,positive_data_acceptance"])
        .args(["--phases", "examples,coverage,fuzzing,stateful"])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--request-timeout", &REQUEST_TIMEOUT_S.to_string()])
        .args(["--request-cert", &client.cert_path.display().to_string()])
        .args(["--request-cert-key", &client.key_path.display().to_string()])
        .args(["--tls-verify", &st.pki().ca_cert_path().display().to_string()])
        .args(["--generation-database", "none"])
        .args(["--workers", "2"])
        .args(["--report", "junit", "--report-junit-path", &junit.display().to_string()])
        .args(extra)
        .current_dir(report)
        .env("SCHEMATHESIS_HOOKS", &hooks)
        .env("LOCKMESH_OPENAPI_PROFILE", schema)
        .kill_on_drop(true)
        .stdin(Stdio::null());
    let started = Instant::now();
    let out = tokio::time::timeout(RUN_TIMEOUT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("schemathesis did not finish within {RUN_TIMEOUT:?}"))
        .unwrap();
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Run {
        ok: out.status.success(),
        output,
        junit: std::fs::read_to_string(&junit).unwrap_or_default(),
        took: started.elapsed(),
    }
}

/// A test stack whose lock tier and arbiter bound waits at the profile's maximum,
/// the arbiter with `faults` planted.
async fn stack(name: &str, max_wait_ms: u64, faults: &[&str]) -> Stack {
    let mut b = Stack::builder(name)
        .envoy_config("lock-tier")
        .envoy_concurrency(1)
        .envoy_replace(FILTER_MAX_WAIT, format!(r#""max_wait_ms": {max_wait_ms}"#))
        .envoy_replace(PAYMENTS_GRANT, PAYMENTS_GRANT_VALIDATE)
        .max_wait_ms(max_wait_ms);
    if !faults.is_empty() {
        b = b
            .arbiter_extra_yaml(format!("test_faults: [{}]", faults.join(", ")))
            .arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    b.start().await.unwrap()
}

#[tokio::test]
async fn schemathesis_finds_no_answer_outside_the_document() {
    let dir = lockmesh_tests::paths::temp_dir("openapi-").unwrap();
    let (schema, max_wait_ms) = test_profile(dir.path());
    let (control, planted) =
        tokio::join!(stack("openapi", max_wait_ms, &[]), stack("openapi-planted", max_wait_ms, &["wire_drift"]));

    // The control: every operation, every check.
    let report = dir.path().join("control");
    std::fs::create_dir_all(&report).unwrap();
    let url = format!("https://127.0.0.1:{}", control.envoy().listener_port());
    let run = schemathesis(&schema, &url, &control, &report, &[]).await;
    eprintln!("schemathesis (control) took {:?}", run.took);
    assert!(run.ok, "schemathesis found answers outside docs/openapi.yaml:\n{}\n{}", run.output, run.junit);
    for op in ["POST /v1/locks/acquire", "POST /v1/sessions", "GET /v1/sessions/holds"] {
        assert!(run.output.contains(op), "schemathesis tested {op}:\n{}", run.output);
    }
    // Nothing crashed or hangs: the stack still grants and releases.
    let c = control.client("payments", "after").unwrap();
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", "payments/openapi-after")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t = r.json["token"].as_str().unwrap().to_owned();
    let s = r.json["session"].as_str().unwrap().to_owned();
    let r = c
        .post(
            "/v1/locks/release",
            &[("x-lock-key", "payments/openapi-after"), ("x-lock-token", &t), ("x-lock-session", &s)],
        )
        .await
        .unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);

    // The planted drift: the session route's body, caught by the body check.
    let report = dir.path().join("planted");
    std::fs::create_dir_all(&report).unwrap();
    let url = format!("https://127.0.0.1:{}", planted.envoy().listener_port());
    let run = schemathesis(&schema, &url, &planted, &report, &["--include-operation-id", "openSession"]).await;
    eprintln!("schemathesis (planted wire_drift) took {:?}", run.took);
    assert!(!run.ok, "the planted wire_drift passed:\n{}", run.output);
    assert!(
        run.output.contains("Response violates schema") && run.output.contains("ttl_s"),
        "the planted wire_drift fails on the body's ttl_s:\n{}",
        run.output
    );
}
