//! Criterion benchmarks of fence-proxy's per-write check (issue #8): the grant
//! verification (proof parse + Ed25519 verify + key digest compare), the pure mark
//! rule, and the durable mark check on redb (an allowed equal: a read transaction;
//! an advance: a write transaction with fsync). `cargo bench -p lockmesh-fence-proxy`.

// A benchmark binary: unwrap on fixed inputs is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderMap, HeaderValue};
use lockmesh_core::{proof, ClassName, FencingToken, LockKey};
use lockmesh_fence_proxy::{
    marks::Marks,
    route::EqualRule,
    token::{check, verify_grant},
};

fn tok(v: u64) -> FencingToken {
    FencingToken::from_packed(v).unwrap()
}

fn bench(c: &mut Criterion) {
    let sk = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
    let kid = proof::KeyId::parse("k1").unwrap();
    let mut verifier = proof::Verifier::new();
    verifier.insert(kid.clone(), sk.verifying_key());
    let key = LockKey::parse(b"payments/orders/order-8812345").unwrap();
    let claims = proof::GrantClaims::new(&key, tok(1 << 40), ClassName::parse("default").unwrap());
    let mut headers = HeaderMap::new();
    headers.insert("x-lock-proof", HeaderValue::from_str(&proof::sign(&sk, &kid, &claims)).unwrap());
    headers.insert("x-lock-token", HeaderValue::from_str(&(1u64 << 40).to_string()).unwrap());
    c.bench_function("verify_grant (parse, Ed25519 verify, key digest)", |b| {
        b.iter(|| verify_grant(black_box(&headers), &verifier, &key).unwrap())
    });
    c.bench_function("mark rule (pure)", |b| {
        b.iter(|| check(black_box(Some(tok(1000))), black_box(tok(1001)), EqualRule::Strict))
    });
    let dir = tempfile::tempdir().unwrap();
    let marks = Marks::open(dir.path()).unwrap();
    marks.check_and_advance("items/1", tok(5), EqualRule::Allow).unwrap();
    c.bench_function("durable mark, allowed equal (redb read)", |b| {
        b.iter(|| marks.check_and_advance(black_box("items/1"), tok(5), EqualRule::Allow).unwrap())
    });
    let mut next = 10u64;
    c.bench_function("durable mark, advance (redb write + fsync)", |b| {
        b.iter(|| {
            next += 1;
            marks.check_and_advance(black_box("items/2"), tok(next), EqualRule::Strict).unwrap()
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
