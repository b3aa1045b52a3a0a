//! Issue 9 (ADR-22): the arbiter and the audit tailer export tracing spans over
//! OTLP/HTTP (JSON) when `telemetry.otlp_endpoint` is set. A tiny collector in the
//! test receives them: acquire and release spans carry class, namespace, tier,
//! outcome and wait, the grant transaction is an etcd span inside its acquire's
//! trace, the tailer's commits carry their event counts, and no exported byte holds
//! a token, a raw key, a session or an identity.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{body::Bytes, http::HeaderMap, routing::post, Router};
use lockmesh_tests::{eventually, Stack};
use serde_json::Value;

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

/// Every request the collector received: (content type, body).
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// An OTLP/HTTP traces receiver on a free loopback port.
async fn collector() -> (u16, Received) {
    let got: Received = Arc::default();
    let app = Router::new().route(
        "/v1/traces",
        post({
            let got = got.clone();
            move |headers: HeaderMap, body: Bytes| async move {
                let ct = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
                got.lock().unwrap().push((ct, body.to_vec()));
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, got)
}

/// Every exported span of `service` (`service.name`), flattened.
fn spans(got: &Received, service: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for (_, body) in got.lock().unwrap().iter() {
        let v: Value = serde_json::from_slice(body).unwrap();
        for rs in v["resourceSpans"].as_array().unwrap() {
            if rs["resource"]["attributes"][0]["value"]["stringValue"] != service {
                continue;
            }
            for ss in rs["scopeSpans"].as_array().unwrap() {
                out.extend(ss["spans"].as_array().unwrap().iter().cloned());
            }
        }
    }
    out
}

fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"].as_array()?.iter().find(|a| a["key"] == key).map(|a| &a["value"])
}

fn attr_str<'a>(span: &'a Value, key: &str) -> Option<&'a str> {
    attr(span, key).and_then(|v| v["stringValue"].as_str())
}

#[tokio::test]
async fn spans_arrive_over_otlp_http_without_tokens_or_keys() {
    let (port, got) = collector().await;
    let st = Stack::builder("otlp")
        .envoy_config("lock-tier")
        .arbiter_extra_yaml(format!(
            "telemetry: {{ otlp_endpoint: \"http://127.0.0.1:{port}\", export_interval_ms: 200 }}"
        ))
        .start()
        .await
        .unwrap();
    let telemetry = format!("telemetry: {{ otlp_endpoint: \"http://127.0.0.1:{port}\", export_interval_ms: 200 }}");
    let _tailer = crate::audit::Tailer::start(&st, &telemetry).await;
    let c = st.client("payments", "otlp").unwrap();
    let key = "payments/otlp/order-77";
    let r = c.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let token = r.json["token"].as_str().unwrap().to_owned();
    let session = r.json["session"].as_str().unwrap().to_owned();
    let r = c.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 409, "{}", r.body);
    let r = c.post(REL, &[("x-lock-key", key), ("x-lock-token", &token)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let r = c.post(REL, &[("x-lock-key", key), ("x-lock-token", &token)]).await.unwrap();
    assert_ne!(r.code(), 200, "{}", r.body);

    // Two acquires (granted, key_gated) and two releases (released, not_holder).
    let all = eventually(Duration::from_secs(15), async || {
        let all = spans(&got, "lockmesh-arbiter");
        let outcomes: Vec<(&str, &str)> = all
            .iter()
            .filter(|s| s["name"] != "lockmesh.etcd")
            .filter_map(|s| Some((s["name"].as_str()?, attr_str(s, "outcome")?)))
            .collect();
        for want in [
            ("lockmesh.acquire", "granted"),
            ("lockmesh.acquire", "key_gated"),
            ("lockmesh.release", "released"),
            ("lockmesh.release", "not_holder"),
        ] {
            anyhow::ensure!(outcomes.contains(&want), "{want:?} not among {outcomes:?}");
        }
        Ok(all)
    })
    .await;
    let granted =
        all.iter().find(|s| s["name"] == "lockmesh.acquire" && attr_str(s, "outcome") == Some("granted")).unwrap();
    assert_eq!(attr_str(granted, "class"), Some("default"), "{granted}");
    assert!(attr_str(granted, "namespace").is_some() && attr_str(granted, "tier").is_some(), "{granted}");
    let wait_ms: u64 = attr(granted, "wait_ms").and_then(|v| v["intValue"].as_str()).unwrap().parse().unwrap();
    assert!(wait_ms < 10_000, "{granted}");
    let digest = attr_str(granted, "key_digest").unwrap();
    assert_eq!(digest.len(), 16, "the short digest only: {granted}");
    let (start, end): (u64, u64) = (
        granted["startTimeUnixNano"].as_str().unwrap().parse().unwrap(),
        granted["endTimeUnixNano"].as_str().unwrap().parse().unwrap(),
    );
    assert!(start > 0 && end >= start, "{granted}");
    // The grant transaction: an etcd txn span of the same trace, child of the acquire.
    let txn = all
        .iter()
        .find(|s| {
            s["name"] == "lockmesh.etcd" && attr_str(s, "op") == Some("txn") && s["parentSpanId"] == granted["spanId"]
        })
        .unwrap_or_else(|| panic!("no grant txn under {granted}"));
    assert_eq!(txn["traceId"], granted["traceId"]);
    assert_eq!(txn["kind"], 3, "SPAN_KIND_CLIENT");

    // The tailer's commits of those events (one batch or more).
    let commits = eventually(Duration::from_secs(15), async || {
        let commits = spans(&got, "lockmesh-audit");
        let events: u64 = commits
            .iter()
            .filter(|s| s["name"] == "lockmesh.audit_commit" && attr_str(s, "outcome") == Some("ok"))
            .filter_map(|s| attr(s, "events")?["intValue"].as_str()?.parse::<u64>().ok())
            .sum();
        anyhow::ensure!(events >= 2, "audit commits with {events} events so far: {commits:?}");
        Ok(commits)
    })
    .await;

    // Attribute keys are the allowed ones only, and no exported byte holds a secret.
    for s in all.iter().chain(&commits) {
        for a in s["attributes"].as_array().unwrap() {
            let k = a["key"].as_str().unwrap();
            assert!(lockmesh_telemetry::ALLOWED.contains(&k), "attribute {k} exported: {s}");
        }
    }
    let me = st.pki().workload_spiffe_id("payments", "otlp");
    for (ct, body) in got.lock().unwrap().iter() {
        assert_eq!(ct, "application/json");
        let text = String::from_utf8_lossy(body);
        for secret in [token.as_str(), key, session.as_str(), me.as_str(), "spiffe://"] {
            assert!(!text.contains(secret), "{secret:?} exported: {text}");
        }
    }
}
