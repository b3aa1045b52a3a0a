//! Criterion benchmark of identifying the arbiter's caller (issue 20): the SPIFFE
//! ID of the Envoy's client certificate, asked once per ext_proc stream, which is
//! once per request. `cargo bench -p lockmesh-runtime --bench peer_id`.
//!
//! The regression it would catch: the arbiter parsing the certificate on every
//! stream again (the `parse` case is that cost), or a remembered answer that
//! costs a parse's worth to find.

// A benchmark binary: unwrap on fixed inputs is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use lockmesh_runtime::{spiffe_id_of, spiffe_id_of_cached};
use rcgen::{CertificateParams, KeyPair, SanType};

fn cert(id: &str) -> Vec<u8> {
    let mut params = CertificateParams::default();
    params.subject_alt_names =
        vec![SanType::DnsName("lock-tier".try_into().unwrap()), SanType::URI(id.try_into().unwrap())];
    let key = KeyPair::generate().unwrap();
    params.self_signed(&key).unwrap().der().to_vec()
}

fn peer_id(c: &mut Criterion) {
    // Four lock-tier Envoys; the one asked is the last remembered.
    let certs: Vec<Vec<u8>> =
        (0..4).map(|i| cert(&format!("spiffe://mesh.example/ns/lockmesh/sa/envoy-{i}"))).collect();
    for d in &certs {
        spiffe_id_of_cached(d).unwrap();
    }
    let der = certs.last().unwrap();
    c.bench_function("peer id: x509 parse (every stream, before 2026-12-05)", |b| {
        b.iter(|| spiffe_id_of(black_box(der)).unwrap())
    });
    c.bench_function("peer id: remembered (4 Envoys' certificates)", |b| {
        b.iter(|| spiffe_id_of_cached(black_box(der)).unwrap())
    });
}

criterion_group!(benches, peer_id);
criterion_main!(benches);
