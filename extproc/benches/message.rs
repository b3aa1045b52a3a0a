//! Criterion benchmark of the arbiter's per-request message handling (issue #8):
//! decoding Envoy's `request_headers` ProcessingRequest (12 headers and the peer's
//! SPIFFE ID attribute), collecting the header map the way `server.rs` does,
//! parsing the lock headers and the transparent marks, and encoding an
//! ImmediateResponse. Everything a request costs the arbiter before etcd.
//! `cargo bench -p lockmesh-extproc --bench message`.
//!
//! Issue 20: the shipped configs forward only `:method`, `:path` and the
//! `x-lock*` headers to the arbiter (`forward_rules`). Two more cases show what
//! that saves: a request as a browser-ish client sends it (cookies, tracing,
//! accept headers: 20 headers) in full, and the same request as the arbiter now
//! receives it. A config that lost its `forward_rules` would cost every request
//! the difference; a header-handling change that scales badly with the header
//! count shows in the full case first.

// A benchmark binary: unwrap on fixed inputs is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::HashMap, hint::black_box};

use criterion::{criterion_group, criterion_main, Criterion};
use envoy_types::pb::{
    envoy::{
        config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption},
        r#type::v3::HttpStatus,
        service::ext_proc::v3::{
            processing_request, processing_response, HeaderMutation, HttpHeaders, ImmediateResponse, ProcessingRequest,
            ProcessingResponse,
        },
    },
    google::protobuf::{value::Kind, Struct, Value},
};
use lockmesh_core::headers;
use prost::Message;

/// The 12-header request of the first case.
const TWELVE: [(&str, &str); 12] = [
    (":method", "POST"),
    (":path", "/v1/locks/acquire"),
    (":authority", "lockmesh.example"),
    (":scheme", "https"),
    ("user-agent", "lockmesh-client/0.1"),
    ("x-request-id", "0b7c9f3e-6c57-4a7e-9c1c-5b1d2f7c8e11"),
    ("x-lock-key", "payments/orders/2026/11/order-8812345"),
    ("x-lock-wait-ms", "5000"),
    ("x-lock-session", "0250a2294332e903"),
    ("x-lock-instance", "worker-7f9c"),
    ("x-lockmesh-filtered", "1"),
    ("x-lockmesh-budget-ms", "4990"),
];

/// What a client with the usual extras sends besides [`TWELVE`].
const EXTRAS: [(&str, &str); 8] = [
    ("accept", "application/json, text/plain, */*"),
    ("accept-encoding", "gzip, deflate, br"),
    ("accept-language", "en-GB,en;q=0.9"),
    ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ("tracestate", "vendor=opaque-value-1,other=opaque-value-2"),
    ("cookie", "session=3f1e9a7c2b8d4e6f0a1b2c3d4e5f6a7b; theme=dark; region=eu-west-1; consent=analytics:0,ads:0"),
    ("x-forwarded-proto", "https"),
    ("content-length", "0"),
];

/// Whether `forward_rules` (envoy-config/src/fragments/extproc-forward-rules.yaml)
/// sends header `k` to the arbiter.
fn forwarded(k: &str) -> bool {
    k == ":method" || k == ":path" || k.starts_with("x-lock") || k.starts_with("x_lock")
}

fn request(hdrs: &[(&str, &str)]) -> Vec<u8> {
    let headers = HeaderMap {
        headers: hdrs
            .iter()
            .map(|(k, v)| HeaderValue { key: (*k).to_owned(), value: String::new(), raw_value: v.as_bytes().to_vec() })
            .collect(),
    };
    let mut fields = HashMap::new();
    fields.insert(
        "connection.uri_san_peer_certificate".to_owned(),
        Value { kind: Some(Kind::StringValue("spiffe://prod.example/ns/payments/sa/worker".into())) },
    );
    let mut attributes = HashMap::new();
    attributes.insert("envoy.filters.http.ext_proc".to_owned(), Struct { fields });
    let req = ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers),
            end_of_stream: true,
            ..Default::default()
        })),
        attributes,
        ..Default::default()
    };
    req.encode_to_vec()
}

fn handle(bytes: &[u8]) -> usize {
    let req = ProcessingRequest::decode(bytes).unwrap();
    let Some(processing_request::Request::RequestHeaders(h)) = req.request else { unreachable!() };
    let hdrs: Vec<(String, Vec<u8>)> = h
        .headers
        .map(|m| m.headers.into_iter().map(|v| (v.key.to_ascii_lowercase(), v.raw_value)).collect())
        .unwrap_or_default();
    let lock = headers::parse_lock_headers(hdrs.iter().map(|(k, v)| (k.as_str(), v.as_slice()))).unwrap();
    let mode = lockmesh_extproc::transparent::mode(&hdrs).unwrap();
    let body = format!(r#"{{"token":"281474976710659","session":"{}"}}"#, lock.session.unwrap());
    let resp = ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: 200 }),
            headers: Some(HeaderMutation {
                set_headers: vec![HeaderValueOption {
                    header: Some(HeaderValue {
                        key: "x-lock-token".into(),
                        value: String::new(),
                        raw_value: b"281474976710659".to_vec(),
                    }),
                    ..Default::default()
                }],
                remove_headers: Vec::new(),
            }),
            body: body.into_bytes(),
            grpc_status: None,
            details: "lockmesh".into(),
        })),
        ..Default::default()
    };
    resp.encode_to_vec().len() + usize::from(mode.is_some())
}

fn bench(c: &mut Criterion) {
    let bytes = request(&TWELVE);
    c.bench_function("ext_proc request_headers: decode, parse, answer", |b| b.iter(|| handle(black_box(&bytes))));
    let full: Vec<(&str, &str)> = TWELVE.iter().chain(EXTRAS.iter()).copied().collect();
    let bytes = request(&full);
    c.bench_function("ext_proc request_headers, 20 headers sent in full", |b| b.iter(|| handle(black_box(&bytes))));
    let subset: Vec<(&str, &str)> = full.iter().copied().filter(|(k, _)| forwarded(k)).collect();
    let bytes = request(&subset);
    c.bench_function("ext_proc request_headers, the same as forward_rules send it", |b| {
        b.iter(|| handle(black_box(&bytes)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
