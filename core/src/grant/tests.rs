use proptest::prelude::*;

use super::*;

fn grant(identity: &str, prefixes: &[&str], ops: &[&str]) -> RawGrant {
    RawGrant {
        identity: identity.into(),
        prefixes: prefixes.iter().map(|s| s.to_string()).collect(),
        operations: ops.iter().map(|s| s.to_string()).collect(),
    }
}

fn key(k: &str) -> LockKey {
    LockKey::parse(k.as_bytes()).unwrap()
}

const PAY: &str = "spiffe://lockmesh.test/ns/payments/sa/worker";

#[test]
fn prefixes_match_on_segment_boundaries_and_identities_by_prefix() {
    let set = GrantSet::try_from_raw(&[
        grant("spiffe://lockmesh.test/ns/payments/", &["payments/orders"], &["acquire"]),
        grant(PAY, &["billing"], &["inspect"]),
    ])
    .unwrap();
    assert_eq!(set.len(), 2);
    let ok = |id: &str, k: &str, op| set.allowed(id, &key(k), op);
    assert!(ok(PAY, "payments/orders", Operation::Acquire));
    assert!(ok(PAY, "payments/orders/7/x", Operation::Acquire));
    assert!(!ok(PAY, "payments/orders-archive", Operation::Acquire));
    assert!(!ok(PAY, "payments/other", Operation::Acquire));
    assert!(!ok(PAY, "payments/orders/7", Operation::Inspect));
    assert!(ok(PAY, "billing/x", Operation::Inspect));
    assert!(!ok(PAY, "billing/x", Operation::Acquire));
    let other = "spiffe://lockmesh.test/ns/payments/sa/reporter";
    assert!(ok(other, "payments/orders/1", Operation::Acquire));
    assert!(!ok(other, "billing/x", Operation::Inspect), "exact grant leaked");
    // A prefix pattern covers only IDs under it, on its '/' boundary.
    assert!(!ok("spiffe://lockmesh.test/ns/payments-evil/sa/x", "payments/orders/1", Operation::Acquire));
    assert!(!ok("spiffe://other.test/ns/payments/sa/worker", "payments/orders/1", Operation::Acquire));
    assert!(set.holds_any(other, Operation::Acquire));
    assert!(!set.holds_any(other, Operation::Inspect));
    assert!(set.holds_any(PAY, Operation::Inspect));
    assert!(!set.holds_any("spiffe://lockmesh.test/ns/billing/sa/x", Operation::Acquire));
}

#[test]
fn trust_domain_wide_grants_and_merging() {
    let set = GrantSet::try_from_raw(&[
        grant("spiffe://lockmesh.test/", &["shared"], &["inspect"]),
        grant("spiffe://lockmesh.test/", &["shared"], &["acquire"]),
    ])
    .unwrap();
    let id = "spiffe://lockmesh.test/anything/at/all";
    assert!(set.allowed(id, &key("shared/k"), Operation::Inspect));
    assert!(set.allowed(id, &key("shared/k"), Operation::Acquire));
    assert!(!set.allowed(id, &key("shared/k"), Operation::Admin));
    assert!(GrantSet::try_from_raw(&[]).unwrap().is_empty());
}

#[test]
fn collects_every_error_with_its_path() {
    let e = GrantSet::try_from_raw(&[
        grant("spiffe://lockmesh.test/ns/a/", &["a"], &["acquire"]),
        grant("http://x/", &[], &["lock", "inspect", "inspect"]),
        grant("spiffe://lockmesh.test", &["a", "A/b", "a", "a/"], &[]),
        grant("spiffe://Bad/x", &["a"], &["admin"]),
        grant("spiffe://td/ns//x/", &["a"], &["admin"]),
    ])
    .unwrap_err();
    let s: Vec<String> = e.iter().map(ToString::to_string).collect();
    assert_eq!(
        s,
        vec![
            "grants[1].identity: \"http://x/\" must start with spiffe://",
            "grants[1].prefixes: must list at least one key prefix",
            "grants[1].operations[0]: \"lock\" is not one of acquire, inspect, validate, admin",
            "grants[1].operations[2]: \"inspect\" is listed twice",
            "grants[2].identity: \"spiffe://lockmesh.test\" names no workload; write spiffe://lockmesh.test/ to grant the whole trust domain",
            "grants[2].prefixes[1]: \"A/b\" is not a namespace or namespace/path",
            "grants[2].prefixes[2]: \"a\" is listed twice",
            "grants[2].prefixes[3]: \"a/\" is not a namespace or namespace/path",
            "grants[2].operations: must list at least one of acquire, inspect, validate, admin",
            "grants[3].identity: \"spiffe://Bad/x\" needs a trust domain of [a-z0-9-._]",
            "grants[4].identity: \"spiffe://td/ns//x/\" has an empty, '.' or '..' path segment or a character outside [A-Za-z0-9-._]",
        ]
    );
}

#[test]
fn ten_thousand_grants_compile_and_answer() {
    let grants: Vec<RawGrant> = (0..10_000)
        .map(|i| {
            grant(
                &format!("spiffe://lockmesh.test/ns/team{}/", i % 500),
                &[&format!("team{}/p{}", i % 500, i)],
                &["acquire", "inspect"],
            )
        })
        .collect();
    let set = GrantSet::try_from_raw(&grants).unwrap();
    assert_eq!(set.len(), 10_000);
    let id = "spiffe://lockmesh.test/ns/team7/sa/w";
    // 100k lookups stay far below a second even unoptimised: no per-request scan.
    for i in 0..100_000u32 {
        let k = key(&format!("team7/p{}/x", 7 + 500 * (i % 20)));
        assert!(set.allowed(id, &k, Operation::Acquire));
    }
    assert!(!set.allowed(id, &key("team8/p8"), Operation::Acquire));
}

fn arb_identity() -> impl Strategy<Value = String> {
    (
        prop_oneof![Just("a.test"), Just("b.test")],
        proptest::collection::vec(prop_oneof![Just("ns"), Just("x"), Just("y")], 0..4),
        any::<bool>(),
    )
        .prop_map(|(td, segs, trailing)| {
            let mut s = format!("spiffe://{td}/{}", segs.join("/"));
            if trailing && !s.ends_with('/') {
                s.push('/');
            }
            s
        })
}

fn arb_path(min: usize) -> impl Strategy<Value = String> {
    (
        prop_oneof![Just("p"), Just("q")],
        proptest::collection::vec(prop_oneof![Just("a"), Just("b"), Just("a-b")], min..4),
    )
        .prop_map(|(ns, segs)| {
            std::iter::once(ns.to_string()).chain(segs.into_iter().map(str::to_string)).collect::<Vec<_>>().join("/")
        })
}

fn arb_grant() -> impl Strategy<Value = RawGrant> {
    (
        arb_identity(),
        proptest::collection::btree_set(arb_path(0), 1..3),
        proptest::collection::btree_set(0usize..4, 1..3),
    )
        .prop_map(|(identity, prefixes, ops)| RawGrant {
            identity,
            prefixes: prefixes.into_iter().collect(),
            operations: ops.into_iter().map(|o| Operation::ALL[o].as_str().to_string()).collect(),
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The compiled index answers exactly what a scan of the uncompiled grants does.
    #[test]
    fn compiled_lookup_equals_the_naive_scan(
        grants in proptest::collection::vec(arb_grant(), 0..12),
        queries in proptest::collection::vec((arb_identity(), arb_path(1), 0usize..4), 1..24),
    ) {
        let valid: Vec<RawGrant> = grants
            .into_iter()
            .filter(|g| parse_identity_pattern(&g.identity).is_ok())
            .collect();
        let set = GrantSet::try_from_raw(&valid).unwrap();
        for (id, k, op) in queries {
            let op = Operation::ALL[op];
            let naive = valid.iter().any(|g| g.allows(&id, &k, op));
            prop_assert_eq!(set.allowed(&id, &key(&k), op), naive, "{} {} {}", id, k, op);
            let naive_any = valid.iter().any(|g| {
                g.matches_identity(&id) && g.operations.iter().any(|o| o == op.as_str())
            });
            prop_assert_eq!(set.holds_any(&id, op), naive_any);
        }
    }

    #[test]
    fn arbitrary_raw_grants_never_panic(
        identity in "\\PC{0,40}",
        prefixes in proptest::collection::vec("\\PC{0,20}", 0..4),
        operations in proptest::collection::vec("\\PC{0,10}", 0..4),
    ) {
        let g = RawGrant { identity, prefixes, operations };
        if let Ok(set) = GrantSet::try_from_raw(std::slice::from_ref(&g)) {
            prop_assert_eq!(set.len(), 1);
        }
    }
}
