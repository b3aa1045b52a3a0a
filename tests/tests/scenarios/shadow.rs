//! Issue 21 item 3: shadow policies (`candidate:` on a class, `lockmesh_lock::shadow`,
//! docs/CLASSES.md). A candidate is evaluated beside the enforced policy and never
//! decides:
//!
//! - a stricter candidate limit: the enforced limit keeps granting, and each grant
//!   the candidate would have refused is counted by namespace and class
//!   (`lockmesh_arbiter_shadow_decisions_total`), shown in `/status` and the
//!   console's state, and audited (`would_refuse` events, `lockctl audit shadow`);
//! - a looser candidate limit never causes a grant the enforced limit refuses: each
//!   refusal it would have granted is counted `would_grant`, and the key never has
//!   more holders than the enforced limit (checked in etcd).
//!
//! With the candidate planted as the decider (`test_faults: [shadow_decides]`) both
//! checks fail.

use etcd_client::GetOptions;
use lockmesh_tests::{LockClient, Stack};
use serde_json::Value;

use super::audit::Tailer;

const ACQ: &str = "/v1/locks/acquire";

/// `strict`: 4 holders enforced, a candidate of 2. `loose`: a mutex, a candidate of 3.
const REGISTRY: &str = r#"classes:
  - { name: default, default: true, ttl_s: 30, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: strict, prefixes: ["payments/sh-strict"], ttl_s: 30, max_holders: 4, candidate: { max_holders: 2 },
      enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: loose, prefixes: ["payments/sh-loose"], ttl_s: 30, candidate: { max_holders: 3 },
      enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

async fn stack(name: &str, faults: &[&str]) -> Stack {
    let mut b = Stack::builder(name).envoy_config("lock-tier").registry(REGISTRY);
    if !faults.is_empty() {
        b = b
            .arbiter_extra_yaml(format!("\ntest_faults: [{}]\n", faults.join(", ")))
            .arbiter_env("LOCKMESH_TEST_FAULTS", "1");
    }
    b.start().await.unwrap()
}

/// The holds of `key` in etcd now.
async fn holders(st: &Stack, key: &str) -> i64 {
    let d = lockmesh_core::LockKey::parse(key.as_bytes()).unwrap().digest();
    let mut c = st.etcd().client().await.unwrap();
    let opts = GetOptions::new().with_prefix().with_count_only();
    c.get(format!("{}/l/{d}/h/", st.root()), Some(opts)).await.unwrap().count()
}

/// The shadow counter's value for `(class, decision, reason)`, 0 without a series.
async fn counted(st: &Stack, class: &str, decision: &str, reason: &str) -> u64 {
    let (_, m) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    let series = format!(
        "lockmesh_arbiter_shadow_decisions_total{{namespace=\"payments\",class=\"{class}\",decision=\"{decision}\",reason=\"{reason}\"}} "
    );
    m.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0, |v| v.trim().parse().unwrap())
}

async fn acquire(c: &LockClient, key: &str) -> (u16, Value) {
    let r = c.post(ACQ, &[("x-lock-key", key), ("x-lock-wait-ms", "0")]).await.unwrap();
    (r.code(), r.json)
}

/// The `/status` and console-state rows for `class` (one arbiter, last 24 h).
async fn status_rows(st: &Stack, class: &str) -> Vec<Value> {
    let (_, body) = st.arbiter(0).admin_get("/status").await.unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    v["shadow"].as_array().unwrap().iter().filter(|r| r["class"] == class).cloned().collect()
}

/// What went wrong with a stricter candidate (empty: nothing).
async fn stricter(st: &Stack, tailer: Option<&Tailer>) -> Vec<String> {
    let mut wrong = Vec::new();
    let key = "payments/sh-strict/k";
    // Four holders, each on a session of its own: the enforced limit (4) grants
    // every one; the candidate (2) would have refused the third and the fourth.
    for i in 0..4 {
        let c = st.client("payments", &format!("s{i}")).unwrap();
        let (code, body) = acquire(&c, key).await;
        if code != 200 {
            wrong.push(format!("holder {i} of 4 (enforced limit 4) was refused: {code} {body}"));
        }
    }
    let c = st.client("payments", "s4").unwrap();
    let (code, body) = acquire(&c, key).await;
    if (code, body["reason"].as_str()) != (409, Some("key_gated")) {
        wrong.push(format!("a fifth holder over the enforced limit was answered {code} {body}"));
    }
    let held = holders(st, key).await;
    if held != 4 {
        wrong.push(format!("{held} holders in etcd, the enforced limit is 4"));
    }
    let n = counted(st, "strict", "would_refuse", "key_gated").await;
    if n != 2 {
        wrong.push(format!("would_refuse counted {n} times, the candidate would have refused 2 grants"));
    }
    if !wrong.is_empty() {
        return wrong;
    }
    let rows = status_rows(st, "strict").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0]["decision"].as_str(), rows[0]["reason"].as_str(), rows[0]["count"].as_u64()),
        (Some("would_refuse"), Some("key_gated"), Some(2))
    );
    let (_, m) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    assert!(!m.contains("sh-strict"), "a raw key in the metrics");
    if let Some(t) = tailer {
        // The audit: each differing decision is a would_refuse event of the class
        // with the key's digest (never the key), and `lockctl audit shadow` sums them.
        let digest = lockmesh_core::LockKey::parse(key.as_bytes()).unwrap().digest().to_string();
        // The tailer may lag on a loaded machine: poll its answer, not its checkpoint.
        lockmesh_tests::assert_eventually!(60, async || {
            let rows = t.lockctl(&["shadow", "--since", "1h"]);
            let rows = rows["rows"].as_array().cloned().unwrap_or_default();
            anyhow::ensure!(rows.len() == 1 && rows[0]["decisions"] == 2, "not yet: {rows:?}");
            assert_eq!(
                (rows[0]["class"].as_str(), rows[0]["decision"].as_str()),
                (Some("strict"), Some("would_refuse"))
            );
            assert_eq!((rows[0]["reason"].as_str(), rows[0]["keys"].as_u64()), (Some("key_gated"), Some(1)));
            let events = t.lockctl(&["events", "would_refuse"]);
            for e in events["events"].as_array().unwrap() {
                assert_eq!((e["digest"].as_str(), e["key"].as_str()), (Some(digest.as_str()), None), "{e}");
                assert_eq!((e["detail"]["enforced"].as_u64(), e["detail"]["candidate"].as_u64()), (Some(4), Some(2)));
            }
            Ok(())
        });
    }
    wrong
}

/// What went wrong with a looser candidate (empty: nothing).
async fn looser(st: &Stack) -> Vec<String> {
    let mut wrong = Vec::new();
    let key = "payments/sh-loose/k";
    let a = st.client("payments", "a").unwrap();
    let (code, body) = acquire(&a, key).await;
    assert_eq!(code, 200, "{body}");
    // Three more acquires, one after another (each reaches the arbiter): the
    // enforced mutex refuses each; the candidate (3) would have granted each.
    for i in 0..3 {
        let c = st.client("payments", &format!("l{i}")).unwrap();
        let (code, body) = acquire(&c, key).await;
        if code != 409 {
            wrong.push(format!("acquire {i} of a held mutex was answered {code} {body}"));
        }
        let held = holders(st, key).await;
        if held != 1 {
            wrong.push(format!("{held} holders of a mutex in etcd"));
        }
    }
    let n = counted(st, "loose", "would_grant", "key_gated").await;
    if wrong.is_empty() && n != 3 {
        wrong.push(format!("would_grant counted {n} times, the candidate would have granted 3 acquires"));
    }
    wrong
}

/// A stricter candidate (`strict`) and a looser one (`loose`) on one stack.
#[tokio::test]
async fn a_candidate_is_counted_and_audited_and_never_decides() {
    let st = stack("shadow", &[]).await;
    let tailer = Tailer::start(&st, "").await;
    let mut wrong = stricter(&st, Some(&tailer)).await;
    wrong.extend(looser(&st).await);
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// The checks above fail when the candidate decides.
#[tokio::test]
async fn planted_a_candidate_that_decides_fails_both_checks() {
    let st = stack("shadow-planted", &["shadow_decides"]).await;
    let loose = looser(&st).await;
    assert!(
        loose.iter().any(|w| w.contains("holders of a mutex")),
        "the looser candidate's grants went unseen: {loose:#?}"
    );
    let strict = stricter(&st, None).await;
    assert!(
        strict.iter().any(|w| w.contains("was refused")),
        "the stricter candidate's refusals went unseen: {strict:#?}"
    );
}
