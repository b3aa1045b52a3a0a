use super::*;

fn raw(classes: Vec<RawClass>) -> RawRegistry {
    RawRegistry { platform: RawPlatform::default(), classes, grants: vec![], quotas: Default::default() }
}

fn class(name: &str, prefixes: &[&str], ttl: Option<u64>, default: bool) -> RawClass {
    RawClass {
        name: name.into(),
        prefixes: prefixes.iter().map(|s| s.to_string()).collect(),
        ttl_s: ttl,
        enforcement: Some("fenced".into()),
        default,
        ..RawClass::default()
    }
}

fn errors(r: &RawRegistry) -> Vec<String> {
    ClassRegistry::try_from_raw(r).unwrap_err().iter().map(ToString::to_string).collect()
}

#[test]
fn longest_prefix_on_segment_boundaries() {
    let r = ClassRegistry::try_from_raw(&raw(vec![
        class("default", &[], None, true),
        class("pay", &["payments"], Some(30), false),
        class("orders", &["payments/orders"], Some(60), false),
    ]))
    .unwrap();
    let of = |k: &str| r.class_of(&LockKey::parse(k.as_bytes()).unwrap()).name.as_str().to_owned();
    assert_eq!(of("payments/orders/1"), "orders");
    assert_eq!(of("payments/orders-archive/1"), "pay");
    assert_eq!(of("payments/x"), "pay");
    assert_eq!(of("other/x"), "default");
    assert!(r.knows_namespace("payments"));
    assert!(!r.knows_namespace("other"));
    let (map, default) = r.prefix_map();
    assert_eq!(map, vec![("payments/orders".to_owned(), "orders".to_owned()), ("payments".into(), "pay".into())]);
    assert_eq!(default, "default");
    assert!(r.grants().is_none());
}

#[test]
fn collects_every_error_with_its_path() {
    let mut bad = class("Bad Name", &["ok", "no//good"], Some(1), true);
    bad.max_holders = Some(0);
    let e = errors(&raw(vec![bad, class("x", &["ok"], Some(400), true)]));
    assert_eq!(
        e,
        vec![
            "classes[0].name: \"Bad Name\" must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric",
            "classes[0].max_holders: must be at least 1: 0 would pause every key of the class, not one key; \
             remove the class's grants to stop it",
            "classes[0].ttl_s: 1s is outside the platform range 5s to 300s",
            "classes[0].prefixes[1]: \"no//good\" is not a namespace or namespace/path",
            "classes[1].ttl_s: 400s is outside the platform range 5s to 300s",
            "classes[1].prefixes[0]: \"ok\" is already claimed by classes[0]",
            "classes: 2 classes have default: true; exactly one may",
        ]
    );
}

#[test]
fn postures_are_checked_field_by_field() {
    let mut fenced3 = class("f", &["f"], None, true);
    fenced3.max_holders = Some(3);
    fenced3.risk_owner = Some("x".into());
    let mut adv = class("a", &["a"], Some(15), false);
    adv.enforcement = Some("advisory".into());
    adv.waiver_expiry = Some("2026-02-30".into());
    adv.fairness = Some("fifo".into());
    adv.on_quorum_loss = Some("open".into());
    adv.pause_test_result = Some("p.yaml".into());
    let mut none = class("n", &[], None, false);
    none.enforcement = None;
    none.tier = Some("edge".into());
    let mut g = RawGrant { identity: "spiffe://td/x".into(), prefixes: vec![], operations: vec!["acquire".into()] };
    g.prefixes.clear();
    let mut r = raw(vec![fenced3, adv, none]);
    r.grants.push(g);
    assert_eq!(
        errors(&r),
        vec![
            "classes[0].max_holders: 3 with enforcement fenced: a high-water fence admits one holder at a time; \
             use 1, or declare the class advisory",
            "classes[0].risk_owner: only advisory classes carry a waiver",
            "classes[1].risk_owner: required for an advisory class (ADR-01): name who owns the risk",
            "classes[1].waiver_expiry: \"2026-02-30\" is not a date YYYY-MM-DD",
            "classes[1].pause_test_result: only a fenced class rests on a pause test",
            "classes[1].ttl_s: 15s is below the advisory floor 30s (a false expiry can duplicate a write)",
            "classes[1].on_quorum_loss: open needs purpose: efficiency (ADR-04: only a declared efficiency class \
             fails open)",
            "classes[1].fairness: \"fifo\" is not memory or durable",
            "classes[2].tier: \"edge\" is not coord or entity",
            "classes[2].enforcement: required (ADR-01): fenced or advisory",
            "grants[0].prefixes: must list at least one key prefix",
        ]
    );
}

#[test]
fn advisory_waivers_expire_into_warnings_and_crd_spellings_parse() {
    let yaml = r#"
platform: { advisory_min_ttl_s: 10, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: d, default: true, enforcement: fenced, tier: coord }
  - { name: a, prefixes: [a], enforcement: advisory, riskOwner: team-a, waiverExpiry: "2025-01-31",
      ttlSeconds: 10, maxHolders: 4, onQuorumLoss: closed, fairness: memory }
grants:
  - { identity: "spiffe://td/ns/a/", prefixes: [a], operations: [acquire] }
"#;
    let raw: RawRegistry = serde_json::from_value(yaml_to_json(yaml)).unwrap();
    let r = ClassRegistry::try_from_raw(&raw).unwrap();
    let a = r.get("a").unwrap();
    assert_eq!((a.ttl_s, a.max_holders, a.tier), (10, 4, Tier::Entity));
    assert_eq!(r.get("d").unwrap().tier, Tier::Coord);
    let day = parse_day("2025-01-31").unwrap();
    assert_eq!(parse_day("1970-01-01"), Some(0));
    assert_eq!(parse_day("2000-03-01"), Some(11_017));
    assert!(r.warnings(day).is_empty());
    assert_eq!(
        r.warnings(day + 3).iter().map(ToString::to_string).collect::<Vec<_>>(),
        vec![
            "classes[1].waiver_expiry: the advisory waiver of class a expired 3 days ago; renew it on the record or \
             fence the class (risk owner team-a)"
        ]
    );
    assert_eq!(r.expired_waivers(day + 1).len(), 1);
    let key = LockKey::parse(b"a/1").unwrap();
    assert!(r.grants().unwrap().allowed("spiffe://td/ns/a/sa/w", &key, crate::grant::Operation::Acquire));
}

/// The flow-style YAML above is also JSON-ish enough for this tiny converter:
/// core has no YAML parser, so the test writes the same document as JSON.
fn yaml_to_json(_: &str) -> serde_json::Value {
    serde_json::json!({
        "platform": { "advisory_min_ttl_s": 10, "lowered_floors_reason": "test registry: short TTLs" },
        "classes": [
            { "name": "d", "default": true, "enforcement": "fenced", "tier": "coord" },
            { "name": "a", "prefixes": ["a"], "enforcement": "advisory", "riskOwner": "team-a",
              "waiverExpiry": "2025-01-31", "ttlSeconds": 10, "maxHolders": 4, "onQuorumLoss": "closed",
              "fairness": "memory" }
        ],
        "grants": [ { "identity": "spiffe://td/ns/a/", "prefixes": ["a"], "operations": ["acquire"] } ]
    })
}

#[test]
fn fenced_classes_are_put_to_the_pause_check() {
    let mut f = class("f", &["f"], None, false);
    f.pause_test_result = Some("f.yaml".into());
    let r = raw(vec![class("d", &[], None, true), f]);
    let asked = std::cell::RefCell::new(Vec::new());
    let check = |c: &str, file: Option<&str>| {
        asked.borrow_mut().push((c.to_owned(), file.map(str::to_owned)));
        match file {
            Some(_) => Ok(()),
            None => Err("required".to_owned()),
        }
    };
    let e = ClassRegistry::try_from_raw_with(&r, &check).unwrap_err();
    assert_eq!(e.iter().map(ToString::to_string).collect::<Vec<_>>(), vec!["classes[0].pause_test_result: required"]);
    assert_eq!(*asked.borrow(), vec![("d".to_owned(), None), ("f".to_owned(), Some("f.yaml".to_owned()))]);
}

#[test]
fn only_a_declared_advisory_efficiency_class_may_fail_open() {
    let advisory = |name: &str, purpose: Option<&str>| {
        let mut c = class(name, &[name], Some(30), false);
        c.enforcement = Some("advisory".into());
        c.risk_owner = Some("team".into());
        c.waiver_expiry = Some("2099-12-31".into());
        c.on_quorum_loss = Some("open".into());
        c.purpose = purpose.map(str::to_owned);
        c
    };
    let mut fenced = class("f", &["f"], None, false);
    fenced.on_quorum_loss = Some("open".into());
    fenced.purpose = Some("efficiency".into());
    let mut odd = class("o", &["o"], None, false);
    odd.on_quorum_loss = Some("ajar".into());
    odd.purpose = Some("speed".into());
    let e = errors(&raw(vec![
        class("d", &[], None, true),
        fenced,
        advisory("c", Some("correctness")),
        advisory("u", None),
        odd,
    ]));
    assert_eq!(
        e,
        vec![
            "classes[1].on_quorum_loss: open needs enforcement advisory, not fenced: a fenced class claims mutual \
             exclusion, which a grant without a quorum cannot keep (ADR-04)",
            "classes[2].on_quorum_loss: open with purpose correctness: a correctness class may only declare closed \
             (ADR-04)",
            "classes[3].on_quorum_loss: open needs purpose: efficiency (ADR-04: only a declared efficiency class \
             fails open)",
            "classes[4].purpose: \"speed\" is not correctness or efficiency",
            "classes[4].on_quorum_loss: \"ajar\" is not closed or open",
        ]
    );
    let r = ClassRegistry::try_from_raw(&raw(vec![class("d", &[], None, true), advisory("e", Some("efficiency"))]))
        .unwrap();
    let e = r.get("e").unwrap();
    assert_eq!((e.on_quorum_loss, e.purpose), (OnQuorumLoss::Open, Some(Purpose::Efficiency)));
    assert_eq!(r.get("d").unwrap().on_quorum_loss, OnQuorumLoss::Closed);
}

#[test]
fn a_lowered_floor_needs_its_reason_and_is_reported() {
    let mut adv = class("a", &[], Some(2), true);
    adv.enforcement = Some("advisory".into());
    adv.risk_owner = Some("team".into());
    adv.waiver_expiry = Some("2099-12-31".into());
    let mut r = raw(vec![adv]);
    r.platform = RawPlatform { min_ttl_s: Some(2), advisory_min_ttl_s: Some(2), ..RawPlatform::default() };
    let e = errors(&r);
    assert_eq!(e.len(), 2, "{e:?}");
    assert!(
        e[0].starts_with(
            "platform.min_ttl_s: 2s lowers the platform floor 5s: say why in platform.lowered_floors_reason"
        ),
        "{e:?}"
    );
    assert!(e[0].contains(WHY_MIN_TTL), "{e:?}");
    assert!(e[1].starts_with("platform.advisory_min_ttl_s: 2s lowers the platform floor 30s"), "{e:?}");
    assert!(e[1].contains(WHY_ADVISORY_MIN_TTL), "{e:?}");
    // A blank reason is no reason.
    r.platform.lowered_floors_reason = Some("  ".into());
    assert_eq!(errors(&r).len(), 2);
    r.platform.lowered_floors_reason = Some("test registry: short TTLs".into());
    let reg = ClassRegistry::try_from_raw(&r).unwrap();
    let (lowered, reason) = reg.lowered_floors();
    assert_eq!(reason, Some("test registry: short TTLs"));
    assert_eq!(
        lowered.iter().map(ToString::to_string).collect::<Vec<_>>(),
        [
            "platform.min_ttl_s: 2s lowers the platform floor 5s",
            "platform.advisory_min_ttl_s: 2s lowers the platform floor 30s"
        ]
    );
    assert_eq!(reg.platform(), Platform { min_ttl_s: 2, max_ttl_s: 300, advisory_min_ttl_s: 2 });
    assert!(reg.warnings(0).is_empty(), "lowered floors are not waiver warnings");
    // A raised ceiling counts too.
    r.platform = RawPlatform { max_ttl_s: Some(600), ..RawPlatform::default() };
    assert_eq!(errors(&r)[0].split(':').next(), Some("platform.max_ttl_s"));
    // A reason with nothing lowered is refused: it would hide a later lowering.
    r.platform = RawPlatform { lowered_floors_reason: Some("why".into()), ..RawPlatform::default() };
    r.classes[0].ttl_s = Some(30);
    assert_eq!(
        errors(&r),
        ["platform.lowered_floors_reason: set, but no floor is lowered: remove it (it would hide a later lowering)"]
    );
    r.platform.lowered_floors_reason = None;
    let reg = ClassRegistry::try_from_raw(&r).unwrap();
    assert_eq!(reg.platform(), Platform::DEFAULT);
    assert_eq!(reg.lowered_floors(), (vec![], None));
}

#[test]
fn the_ttl_verdict_uses_the_default_ttl_and_the_advisory_floor() {
    let p = Platform::DEFAULT;
    assert_eq!(p.check_ttl(None, false), Ok(PLATFORM_DEFAULT_TTL_S));
    assert!(p.check_ttl(None, true).unwrap_err().contains("below the advisory floor 30s"));
    for (ttl, advisory, ok) in [
        (4, false, false),
        (5, false, true),
        (300, false, true),
        (301, false, false),
        (29, true, false),
        (30, true, true),
    ] {
        assert_eq!(p.check_ttl(Some(ttl), advisory).is_ok(), ok, "{ttl} advisory={advisory}");
    }
}

#[test]
fn lock_delay_is_bounded_and_for_mutex_classes_only() {
    let mut ok = class("pay", &["payments"], Some(30), true);
    ok.lock_delay_s = Some(15);
    let r = ClassRegistry::try_from_raw(&raw(vec![ok.clone()])).unwrap();
    assert_eq!(r.class_of(&LockKey::parse(b"payments/x").unwrap()).lock_delay_s, 15);
    let mut long = ok.clone();
    long.lock_delay_s = Some(MAX_LOCK_DELAY_S + 1);
    assert_eq!(
        errors(&raw(vec![long])),
        vec!["classes[0].lock_delay_s: 301 is above 300: a key would stay ungrantable that long after every expiry"]
    );
    let mut sem = ok;
    sem.enforcement = Some("advisory".into());
    sem.risk_owner = Some("x".into());
    sem.waiver_expiry = Some("2099-01-01".into());
    sem.max_holders = Some(3);
    assert_eq!(
        errors(&raw(vec![sem])),
        vec![
            "classes[0].lock_delay_s: 15 with max_holders 3: lock-delay is defined for mutex classes (max_holders 1), \
             where an expiry frees the one hold"
        ]
    );
    // Unset is off.
    let r = ClassRegistry::try_from_raw(&raw(vec![class("d", &[], None, true)])).unwrap();
    assert_eq!(r.class_of(&LockKey::parse(b"x/y").unwrap()).lock_delay_s, 0);
}
