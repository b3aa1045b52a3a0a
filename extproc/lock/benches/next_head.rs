//! Criterion benchmark of what every acquire of a mutex key asks of this
//! arbiter's memory before it touches etcd (issue 20): the policy cache (the
//! authoritative class map and the class's policy, read by every grant's gate
//! and, while the policy watch is open, by the next head that skips its read)
//! and the note of who was granted the key (`HeldBy`: made at every grant,
//! checked by the next head).
//! `cargo bench -p lockmesh-lock --bench next_head`.
//!
//! The regression each would catch: an allocation or a clone on a path that
//! runs per acquire. The `clone` case shows what that costs: the cache kept
//! the records by value before 2026-12-05, and every grant's gate cloned the
//! whole map (every prefix and class name) and the policy (its notes).

// A benchmark binary: unwrap on fixed inputs is the point.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{hint::black_box, sync::Arc};

use criterion::{criterion_group, criterion_main, Criterion};
use lockmesh_core::{
    headers::SessionId,
    policy::{ChangeNote, ClassPolicy},
    FencingToken, LockKey,
};
use lockmesh_lock::{
    mutex::{AcquireRequest, Grant},
    policy::{ClassMapRecord, PolicyCache},
    session::Caller,
    wait::{HeldBy, Queues},
};

/// Twelve classes on twelve prefixes, as a platform team's registry might hold.
fn registry() -> lockmesh_core::ClassRegistry {
    let mut yaml = String::from(
        "platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: \"bench\" }\nclasses:\n  - { name: \
         default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: \"2099-12-31\" }\n",
    );
    for i in 0..12 {
        yaml.push_str(&format!(
            "  - {{ name: team{i}, prefixes: [\"team{i}/orders\"], ttl_s: 15, enforcement: advisory, risk_owner: t, \
             waiver_expiry: \"2099-12-31\" }}\n"
        ));
    }
    lockmesh_registry::parse(&yaml).unwrap()
}

fn note() -> ChangeNote {
    ChangeNote {
        actor: "arbiter".into(),
        reason: "bootstrap from the registry".into(),
        at_ms: 1,
        action: "create".into(),
    }
}

fn request(reg: &lockmesh_core::ClassRegistry, caller: &str, lease: i64) -> AcquireRequest {
    let key = LockKey::parse(b"team7/orders/2026/12/order-8812345").unwrap();
    AcquireRequest {
        class: reg.class_of(&key).clone(),
        key,
        caller: Caller { identity: caller.into(), instance: Some("worker-7f9c".into()) },
        session: SessionId::from_lease(lease),
        deadline: tokio::time::Instant::now(),
        try_once: false,
        hold_id: None,
        session_owner: None,
        unverified_caller: None,
        permits: lockmesh_core::headers::Permits::Count(1),
        mode: None,
        election: false,
        session_indexed: false,
    }
}

fn policy_cache(c: &mut Criterion) {
    let reg = registry();
    let cache = PolicyCache::default();
    let map = Arc::new(ClassMapRecord::from_registry(&reg, note()));
    let policy = Arc::new(ClassPolicy::new("team7", "team7/1", 1, note()).unwrap());
    let g = cache.generation();
    cache.keep_map(map.clone(), 10, g);
    cache.keep_policy("team7", policy.clone(), 11, g);
    let key = "team7/orders/2026/12/order-8812345";
    c.bench_function("policy cache: limit (the next head's check)", |b| {
        b.iter(|| cache.limit(black_box("team7"), black_box(key)).unwrap())
    });
    c.bench_function("policy cache: the gate's reads (map, class_of, policy)", |b| {
        b.iter(|| {
            let (m, mr) = cache.map().unwrap();
            let class = m.class_of(black_box(key));
            let (p, pr) = cache.policy(class).unwrap();
            black_box((p.limit, mr, pr))
        })
    });
    c.bench_function("policy cache: the same reads cloning the records (the regression)", |b| {
        b.iter(|| {
            let m: ClassMapRecord = (*cache.map().unwrap().0).clone();
            let class = m.class_of(black_box(key)).to_owned();
            let p: ClassPolicy = (*cache.policy(&class).unwrap().0).clone();
            black_box((p.limit, m.map.len()))
        })
    });
}

fn held_by(c: &mut Criterion) {
    let reg = registry();
    let holder = request(&reg, "spiffe://mesh.example/ns/payments/sa/holder", 0x0250_a229_4332_e903);
    let next = request(&reg, "spiffe://mesh.example/ns/payments/sa/next", 0x0250_a229_4332_e904);
    let grant = Grant {
        token: FencingToken::mint(1, 1_000_000).unwrap(),
        session: holder.session.unwrap(),
        ttl_s: 15,
        class: "team7".into(),
        existing: false,
        new_session: false,
        permits: 1,
        mode: None,
    };
    let queues = Queues::default();
    // A thousand keys noted, as on an arbiter with that many held mutex keys.
    for i in 0..1000 {
        let k = LockKey::parse(format!("team7/orders/k{i}").as_bytes()).unwrap();
        queues.note_held(&k.digest(), HeldBy::of(&holder, &grant, i));
    }
    let d = holder.key.digest();
    let sid = next.session.unwrap();
    c.bench_function("held_by: note a grant (the grant's side)", |b| {
        b.iter(|| queues.note_held(&d, HeldBy::of(black_box(&holder), &grant, 1_000_000)))
    });
    c.bench_function("held_by: look up and check (the next head's side)", |b| {
        b.iter(|| queues.held_by(&d).is_some_and(|h| !h.may_answer(black_box(&next), sid)))
    });
}

criterion_group!(benches, policy_cache, held_by);
criterion_main!(benches);
