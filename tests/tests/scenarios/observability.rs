//! Issue 9 item 2 (ADR-22): the expositions of the arbiter, the audit tailer and
//! fence-proxy pass `promtool check metrics`; the alert rules pass `promtool check
//! rules` and their unit tests (`promtool test rules`); the dashboard parses and
//! names only metrics that exist; no metric has a key, token or identity label
//! (nor such a value); and the logs of a run (arbiter, Envoy at its pinned `info`
//! level, tailer) hold none of the tokens or raw keys it used.

use std::{collections::BTreeSet, path::PathBuf, process::Command, time::Duration};

use lockmesh_load::prom;
use lockmesh_tests::{
    fence::{ensure_signing_key, FenceProxyProcess, KvStore},
    repo_root, Stack,
};

use super::audit::{head, Tailer};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

/// Label names a lockmesh metric may carry (ADR-22): bounded dimensions and enums.
const ALLOWED_LABELS: &[&str] = &[
    "namespace",
    "class",
    "tier",
    "cluster",
    "route",
    "code",
    "outcome",
    "reason",
    "kind",
    "end",
    "le",
    "state",
    "capability",
    "etcd_cluster",
    "quota",
    "step",
    "cause",
];
// `capability`: the closed set of keyspace capabilities (lockmesh_keyspace::upgrade);
// `etcd_cluster`: the clusters of the arbiter's own config; `quota`: the four
// quotas (lockmesh_core::quota::Quota); `step`: the five etcd steps of a lock cycle
// (lockmesh_lock::steps::Step); `cause`: the six causes a group of grants is
// refused for (lockmesh_lock::GroupRefusal).

fn promtool() -> PathBuf {
    let p = repo_root().join(".tools/promtool/usr/bin/promtool");
    assert!(p.is_file(), "{} missing: run ./scripts/setup", p.display());
    p
}

/// `promtool check <what> [file]` with `input` on stdin; panics with its output.
pub(super) fn promtool_check(args: &[&str], input: Option<&str>) {
    use std::io::Write;
    let mut child = Command::new(promtool())
        .arg("check")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.unwrap_or_default().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // `check metrics` prints lint problems and exits 3 on any; anything printed is a failure.
    assert!(
        out.status.success() && (args[0] != "metrics" || text.trim().is_empty()),
        "promtool check {args:?}:\n{text}\n--- input ---\n{}",
        input.unwrap_or_default()
    );
}

/// The alert rules' unit tests (`deploy/monitoring/rules_test.yaml`): among them,
/// LockmeshOldestHoldOverClassThreshold fires for each class past its own
/// threshold (or the default), and not before.
#[test]
fn the_alert_rules_pass_their_promtool_unit_tests() {
    let out = Command::new(promtool())
        .args(["test", "rules", "rules_test.yaml"])
        .current_dir(repo_root().join("deploy/monitoring"))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("SUCCESS"), "promtool test rules:\n{text}");
}

#[tokio::test]
async fn expositions_pass_promtool_and_carry_no_key_token_or_identity() {
    // `payments` is a namespace the registry names; `billing` is not (label `other`).
    let registry = format!(
        "{}  - name: pay\n    prefixes: [\"payments\"]\n    tier: coord\n    ttl_s: 15\n    enforcement: advisory\n    risk_owner: lockmesh-tests\n    waiver_expiry: \"2099-12-31\"\n",
        lockmesh_tests::DEFAULT_TEST_REGISTRY
    );
    let st = Stack::builder("obs").envoy_config("lock-tier").registry(registry).start().await.unwrap();
    let tailer = Tailer::start(&st, "").await;
    let a = st.client("payments", "obs-worker").unwrap();
    let b = st.client("payments", "obs-other").unwrap();
    let mut secrets: Vec<String> = Vec::new();
    // Traffic that fills every labelled family: grants, a gated refusal, a release,
    // an expiry, a renewal failure.
    let key = "payments/obs-secret-order-7731";
    secrets.push(key.into());
    let r = a.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t = r.json["token"].as_str().unwrap().to_owned();
    let gated = b.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(gated.code(), 409, "{}", gated.body);
    a.post(REL, &[("x-lock-key", key), ("x-lock-token", &t)]).await.unwrap();
    secrets.push(t);
    // `billing` is allowed by the filter's grants but named by no class prefix.
    let unlisted = "billing/obs-secret-9920";
    secrets.push(unlisted.into());
    let r = st.client("billing", "obs").unwrap().post(ACQ, &[("x-lock-key", unlisted)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    secrets.push(r.json["token"].as_str().unwrap().to_owned());
    let s = a.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    let short = "short/obs-secret-expiring-4410";
    secrets.push(short.into());
    let r = a.post(ACQ, &[("x-lock-key", short), ("x-lock-session", &sid)]).await.unwrap();
    secrets.push(r.json["token"].as_str().unwrap().to_owned());
    // Let the short session (ttl 3 s) expire, then renew it: a renewal failure.
    lockmesh_tests::eventually(Duration::from_secs(15), async || {
        let r = a.get("/v1/locks", &[("x-lock-key", short)]).await?;
        anyhow::ensure!(r.json["holders"].as_array().is_some_and(|h| h.is_empty()), "still held");
        Ok(())
    })
    .await;
    let k = a.post("/v1/sessions/keepalive", &[("x-lock-session", &sid)]).await.unwrap();
    assert_eq!(k.code(), 410, "{}", k.body);
    tailer.caught_up(head(&st).await).await;

    let (_, arbiter) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    for want in [
        "lockmesh_arbiter_acquires_total{namespace=\"payments\",class=\"pay\",tier=\"coord\",outcome=\"granted\"} 1",
        "lockmesh_arbiter_acquires_total{namespace=\"payments\",class=\"pay\",tier=\"coord\",outcome=\"key_gated\"} 1",
        "lockmesh_arbiter_acquires_total{namespace=\"other\",class=\"default\",tier=\"entity\",outcome=\"granted\"} 1",
        "lockmesh_arbiter_grant_latency_seconds_bucket{namespace=\"payments\"",
        "lockmesh_arbiter_renewal_failures_total{reason=\"expired\"} 1",
        "lockmesh_arbiter_etcd_reachable 1",
        // Issue 21 item 2 (its nonzero value is checked by jeopardy::the_vm_jeopardy_gauge_*).
        "lockmesh_arbiter_vm_sessions_in_jeopardy{etcd_cluster=\"coord\"} 0",
        // Issue 21 item 4 (ADR-033), by namespace and class: every pair the registry
        // declares, from 0 (their nonzero values: hold_waits::*).
        "lockmesh_arbiter_oldest_hold_seconds{namespace=\"payments\",class=\"pay\"} ",
        "lockmesh_arbiter_open_holds{namespace=\"payments\",class=\"pay\"} ",
        "lockmesh_arbiter_gated_waiters{namespace=\"payments\",class=\"pay\"} 0",
        "lockmesh_arbiter_oldest_gated_wait_seconds{namespace=\"other\",class=\"default\"} 0",
    ] {
        assert!(arbiter.contains(want), "{want} missing from the arbiter's /metrics:\n{arbiter}");
    }
    let audit = tailer.metrics().await;
    for want in [
        "lockmesh_audit_hold_seconds_bucket{namespace=\"payments\"",
        "lockmesh_audit_expiries_total{namespace=\"short\"",
    ] {
        assert!(audit.contains(want), "{want} missing from the tailer's /metrics:\n{audit}");
    }
    // fence-proxy, after one refused write.
    let dir = tempfile::tempdir().unwrap();
    let sk = ensure_signing_key(dir.path()).unwrap();
    let kv = KvStore::start().await.unwrap();
    let fence = FenceProxyProcess::builder(kv.port())
        .trust(&sk.kid, &sk.pub_file)
        .routes("routes:\n  - name: items\n    path: /items/{id}\n    reads: [GET]\n    resource: \"items/{id}\"\n    lock_key: \"payments/items/{id}\"")
        .start()
        .await
        .unwrap();
    let _ = reqwest::Client::new().put(format!("{}/items/1", fence.url())).body("x").send().await.unwrap();
    let (_, fence_expo) = fence.admin_get("/metrics").await.unwrap();
    assert!(fence_expo.contains("lockmesh_fence_requests_total{"), "{fence_expo}");

    let mut known = BTreeSet::new();
    for (who, expo) in [("arbiter", &arbiter), ("audit", &audit), ("fence-proxy", &fence_expo)] {
        promtool_check(&["metrics"], Some(expo));
        known.extend(prom::families(expo));
        for sample in prom::parse(expo) {
            for (l, _) in &sample.labels {
                assert!(ALLOWED_LABELS.contains(&l.as_str()), "{who}: label {l:?} is not a bounded label: {sample:?}");
            }
            // The name and every label value: all of a sample line but its number.
            let texts = std::iter::once(&sample.name).chain(sample.labels.iter().map(|(_, v)| v));
            for text in texts {
                for s in &secrets {
                    assert!(!text.contains(s.as_str()), "{who}: a key or token in a metric: {sample:?}");
                }
                assert!(!text.contains("spiffe://"), "{who}: an identity in a metric: {sample:?}");
            }
        }
    }

    // The rules and the dashboard name only metrics some exposition has.
    let mon = repo_root().join("deploy/monitoring");
    promtool_check(&["rules", mon.join("rules.yaml").to_str().unwrap()], None);
    let rules: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(mon.join("rules.yaml")).unwrap()).unwrap();
    let crd: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(mon.join("prometheusrule.yaml")).unwrap()).unwrap();
    assert_eq!(crd["spec"]["groups"], rules["groups"], "prometheusrule.yaml drifted from rules.yaml");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(mon.join("dashboard.json")).unwrap()).unwrap();
    let mut exprs: Vec<String> = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    for g in rules["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            exprs.push(r["expr"].as_str().unwrap().to_owned());
        }
    }
    assert!(exprs.len() > 20);
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("lockmesh_") {
            let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .fold(name.clone(), |n, s| n.strip_suffix(s).unwrap_or(&n).to_owned());
            assert!(known.contains(&family), "{name} (in {e:?}) is not exposed by any lockmesh component");
            rest = &rest[i + name.len()..];
        }
    }

    // Logs of the run: no token and no raw key.
    let logs = [
        ("arbiter", std::fs::read_to_string(st.arbiter(0).log_path()).unwrap()),
        ("envoy", std::fs::read_to_string(st.envoy().log_path()).unwrap_or_default()),
        ("audit", tailer.log()),
    ];
    for (who, text) in &logs {
        assert!(!text.is_empty(), "{who}: empty log (wrong path?)");
    }
    for (who, text) in &logs {
        for s in &secrets {
            assert!(!text.contains(s.as_str()), "{who}'s log contains a token or raw key ({s})");
        }
    }
}
