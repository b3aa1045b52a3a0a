//! Criterion benchmarks of the protocol's hot paths (issue #8): every request runs
//! the header parser; every filtered request runs the grant match; every grant
//! digests its key and packs a token. `cargo bench -p lockmesh-core`.

// A benchmark binary: unwrap on fixed inputs is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use lockmesh_core::{
    grant::{GrantSet, Operation, RawGrant},
    headers, FencingToken, LockKey,
};

/// A typical acquire's headers as Envoy hands them over (pseudo headers included).
fn acquire_headers() -> Vec<(String, Vec<u8>)> {
    [
        (":method", "POST"),
        (":path", "/v1/locks/acquire"),
        (":authority", "lockmesh.example"),
        (":scheme", "https"),
        ("user-agent", "lockmesh-client/0.1"),
        ("accept", "*/*"),
        ("x-request-id", "0b7c9f3e-6c57-4a7e-9c1c-5b1d2f7c8e11"),
        ("x-lock-key", "payments/orders/2026/11/order-8812345"),
        ("x-lock-wait-ms", "5000"),
        ("x-lock-session", "0250a2294332e903"),
        ("x-lock-instance", "worker-7f9c"),
        ("x-lock-class", "default"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
    .collect()
}

/// 10,000 grants: 2,500 namespaces with identity prefixes and exact identities.
fn grants(n: usize) -> GrantSet {
    let raw: Vec<RawGrant> = (0..n)
        .map(|i| {
            let ns = format!("ns{}", i / 4);
            let identity = if i % 2 == 0 {
                format!("spiffe://prod.example/ns/{ns}/")
            } else {
                format!("spiffe://prod.example/ns/{ns}/sa/worker-{i}")
            };
            RawGrant {
                identity,
                prefixes: vec![format!("{ns}/orders/{}", i % 4), format!("{ns}/reports")],
                operations: vec!["acquire".into(), "inspect".into()],
            }
        })
        .collect();
    GrantSet::try_from_raw(&raw).unwrap()
}

fn bench(c: &mut Criterion) {
    let hdrs = acquire_headers();
    c.bench_function("parse_lock_headers (12 headers)", |b| {
        b.iter(|| headers::parse_lock_headers(black_box(&hdrs).iter().map(|(k, v)| (k.as_str(), v.as_slice()))))
    });

    let set = grants(10_000);
    let key = LockKey::parse(b"ns1200/orders/1/order-42").unwrap();
    let denied = LockKey::parse(b"ns1201/orders/1/order-42").unwrap();
    let id = "spiffe://prod.example/ns/ns1200/sa/worker-4801";
    c.bench_function("grant match, 10k grants, allowed", |b| {
        b.iter(|| black_box(&set).allowed(black_box(id), black_box(&key), Operation::Acquire))
    });
    c.bench_function("grant match, 10k grants, denied", |b| {
        b.iter(|| black_box(&set).allowed(black_box(id), black_box(&denied), Operation::Acquire))
    });

    let raw_key = b"payments/orders/2026/11/order-8812345";
    c.bench_function("key parse + digest", |b| b.iter(|| LockKey::parse(black_box(raw_key)).unwrap().digest()));

    c.bench_function("token mint + format + parse", |b| {
        b.iter(|| {
            let t = FencingToken::mint(black_box(3), black_box(123_456_789)).unwrap();
            let s = t.to_string();
            headers::parse_token(s.as_bytes()).unwrap()
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
