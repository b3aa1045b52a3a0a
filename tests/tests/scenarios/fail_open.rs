//! Issue 10 item 4 (ADR-04): fail-open efficiency classes, on real etcd, arbiter,
//! Envoy and audit tailer. During a quorum loss (a 3-member cluster with two
//! members killed; the transparent case uses one member killed) a class that
//! declares `on_quorum_loss: open` is granted from the arbiter's memory with token
//! 0, each grant durable in the local spool before it is answered; every other
//! class answers `unavailable` and grants nothing. After the quorum returns (and an
//! arbiter restart in between) the spool is shipped and `lockctl audit
//! unprotected` lists every unprotected grant with how it ended. The registry's
//! refusals are in `extproc`'s own tests (`classes_min` runs the loader too).

use std::path::Path;

use lockmesh_client::{Error as SdkError, LockOptions};
use lockmesh_tests::{assert_eventually, probe::http_get_within, Stack};
use serde_json::Value;

use super::audit::{head, Tailer};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

/// An open class on `payments/batch` (an advisory efficiency class) and the
/// closed default for every other key.
const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - name: default
    default: true
    ttl_s: 15
    enforcement: advisory
    risk_owner: lockmesh-tests
    waiver_expiry: "2099-12-31"
    purpose: correctness
  - name: batch
    prefixes: ["payments/batch"]
    ttl_s: 60
    enforcement: advisory
    risk_owner: lockmesh-tests
    waiver_expiry: "2099-12-31"
    purpose: efficiency
    on_quorum_loss: open
"#;

fn fail_open_yaml(spool: &Path) -> String {
    format!("fail_open: {{ spool_file: {:?}, quorum_loss_after_ms: 1000 }}", spool.display().to_string())
}

/// An admin GET; during a quorum loss `/status`, `/metrics` and `/readyz` each
/// wait for one etcd read to time out (2 s), so the probe waits longer.
async fn admin(st: &Stack, path: &str) -> (u16, String) {
    let r = http_get_within(st.arbiter(0).admin_port(), path, std::time::Duration::from_secs(8)).await.unwrap();
    (r.status, r.body)
}

async fn status(st: &Stack) -> Value {
    let (code, body) = admin(st, "/status").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Waits until the arbiter has declared the quorum loss.
async fn declared(st: &Stack, secs: u64) -> String {
    assert_eventually!(secs, async || {
        let v = status(st).await;
        let f = &v["fail_open"][0];
        anyhow::ensure!(f["quorum_loss_declared"] == true, "not declared: {f}");
        Ok(f["outage"].as_str().unwrap().to_owned())
    })
}

fn unix_ms() -> u64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    u64::try_from(d.as_millis()).unwrap()
}

/// The spool's lines.
fn spool_lines(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p).unwrap_or_default().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn s(r: &lockmesh_tests::Resp, f: &str) -> String {
    r.json[f].as_str().unwrap_or_else(|| panic!("no {f}: {}", r.body)).to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_class_grants_token_zero_during_a_quorum_loss_and_the_audit_lists_it_after() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("unprotected.spool");
    let st = Stack::builder("failopen")
        .envoy_config("lock-tier")
        .own_etcd(3)
        .registry(REGISTRY)
        .arbiter_extra_yaml(fail_open_yaml(&spool))
        .start()
        .await
        .unwrap();
    let a = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();
    let (open_key, closed_key) = ("payments/batch/job-7", "payments/orders/order-7");
    // An SDK holder with a session of the open class (TTL 60 s: its next
    // keepalive, which would drain it, comes after the outage's checks).
    let sdk_key = "payments/batch/job-8";
    let (sdk, _fences) = super::sdk::sdk(super::sdk::config(&st, "payments", "c"));
    sdk.lock(sdk_key, LockOptions::default()).await.unwrap().release().await.unwrap();

    // With a quorum the open class is granted from etcd like any class.
    let r = a.post(ACQ, &[("x-lock-key", open_key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t: u64 = s(&r, "token").parse().unwrap();
    assert!(t > 0 && r.json["unprotected"] == false, "{}", r.body);
    let rel = [("x-lock-key", open_key), ("x-lock-token", &t.to_string()), ("x-lock-session", &s(&r, "session"))];
    assert_eq!(a.post(REL, &rel).await.unwrap().code(), 200);
    assert_eq!(status(&st).await["fail_open"][0]["quorum_loss_declared"], false);

    // Quorum lost: two of three members killed.
    let killed_ms = unix_ms();
    st.etcd().member(1).kill();
    st.etcd().member(2).kill();
    let outage = declared(&st, 20).await;
    assert!(outage.starts_with("coord-"), "{outage}");
    // Declared within `quorum_loss_after_ms` (1 s) + 10 s of the loss
    // (docs/GUARANTEES.md G8h: two checks, each at most a 2 s read and a 2 s
    // member probe, a second apart), plus 2 s for a loaded machine. A check
    // whose read, login and member probe each waited out the operation timeout
    // took several of them per round.
    let declared_ms: u64 = outage.trim_start_matches("coord-").parse().unwrap();
    let took = declared_ms.saturating_sub(killed_ms);
    assert!(took <= 13_000, "the loss was declared {took} ms after the members were killed");

    // A closed class grants nothing: `unavailable`, as before ADR-04.
    let r = a.post(ACQ, &[("x-lock-key", closed_key)]).await.unwrap();
    assert_eq!((r.code(), r.header("x-lockmesh-error")), (503, Some("unavailable")), "{}", r.body);

    // The open class: token 0, a grant id, no session; durable in the spool before the answer.
    let r = a.post(ACQ, &[("x-lock-key", open_key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert_eq!((r.header("x-lock-token"), s(&r, "token").as_str()), (Some("0"), "0"), "{}", r.body);
    assert!(r.json["unprotected"] == true && r.json["session"].is_null() && r.json["proof"].is_null(), "{}", r.body);
    assert_eq!((r.json["class"].as_str(), r.json["outage"].as_str()), (Some("batch"), Some(outage.as_str())));
    let g1 = s(&r, "grant");
    assert_eq!(r.header("x-lock-grant"), Some(g1.as_str()));
    let lines = spool_lines(&spool);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!((lines[0]["op"].as_str(), lines[0]["grant"].as_str()), (Some("grant"), Some(g1.as_str())));
    assert_eq!((lines[0]["class"].as_str(), lines[0]["outage"].as_str()), (Some("batch"), Some(outage.as_str())));

    // Exclusion among this arbiter's unprotected holds; only the holder releases.
    let r = b.post(ACQ, &[("x-lock-key", open_key)]).await.unwrap();
    assert_eq!((r.code(), r.header("x-lockmesh-error")), (409, Some("contended")), "{}", r.body);
    let r = b.post(REL, &[("x-lock-key", open_key), ("x-lock-grant", &g1)]).await.unwrap();
    assert_eq!((r.code(), r.header("x-lockmesh-error")), (409, Some("not_holder")), "{}", r.body);
    let r = a.post(REL, &[("x-lock-key", open_key), ("x-lock-grant", &g1)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let r = b.post(ACQ, &[("x-lock-key", open_key)]).await.unwrap();
    assert_eq!((r.code(), s(&r, "token").as_str()), (200, "0"), "{}", r.body);
    let g2 = s(&r, "grant");
    let ops: Vec<String> = spool_lines(&spool).iter().map(|l| l["op"].as_str().unwrap().to_owned()).collect();
    assert_eq!(ops, ["grant", "release", "grant"]);
    let (_, m) = admin(&st, "/metrics").await;
    assert!(
        m.contains(
            "lockmesh_arbiter_unprotected_grants_total{namespace=\"payments\",class=\"batch\",tier=\"entity\"} 2\n"
        ),
        "{m}"
    );
    assert!(m.contains("lockmesh_arbiter_quorum_loss_declared 1\n"));
    let (code, ready) = admin(&st, "/readyz").await;
    assert_eq!(code, 200, "fail-open classes keep the arbiter ready: {ready}");

    // The SDK takes protected grants only: it hands an unprotected one back at
    // once, so the key is free for the next caller.
    assert_eq!(sdk.lock(sdk_key, LockOptions::default()).await.err(), Some(SdkError::FailedOpen));
    let r = a.post(ACQ, &[("x-lock-key", sdk_key)]).await.unwrap();
    assert_eq!((r.code(), s(&r, "token").as_str()), (200, "0"), "the SDK left its grant held: {}", r.body);
    let g4 = s(&r, "grant");
    assert_eq!(a.post(REL, &[("x-lock-key", sdk_key), ("x-lock-grant", &g4)]).await.unwrap().code(), 200);
    let sdk_ops: Vec<(String, String)> = spool_lines(&spool)
        .iter()
        .filter(|l| l["key"] == sdk_key)
        .map(|l| (l["op"].as_str().unwrap().to_owned(), l["grant"].as_str().unwrap().to_owned()))
        .collect();
    let g3 = sdk_ops.first().map(|(_, g)| g.clone()).unwrap_or_default();
    let want = [("grant", &g3), ("release", &g3), ("grant", &g4), ("release", &g4)];
    assert_eq!(sdk_ops, want.map(|(o, g)| (o.to_owned(), g.clone())), "{sdk_ops:?}");

    // The arbiter crashes holding g2; the quorum returns; it restarts from its spool.
    st.arbiter(0).kill();
    let (r1, r2) = tokio::join!(st.etcd().member(1).restart(), st.etcd().member(2).restart());
    r1.unwrap();
    r2.unwrap();
    st.arbiter(0).restart().await.unwrap();
    assert_eventually!(20, async || {
        let f = &status(&st).await["fail_open"][0];
        anyhow::ensure!(f["quorum_loss_declared"] == false && f["spool_bytes"] == 0, "not shipped: {f}");
        Ok(())
    });
    assert!(spool_lines(&spool).is_empty());

    // The audit store has every unprotected grant, marked, with its end.
    let tailer = Tailer::start(&st, "").await;
    tailer.caught_up(head(&st).await).await;
    let v = tailer.lockctl(&["unprotected", "--outage", &outage]);
    let grants = v["grants"].as_array().unwrap();
    let mut got: Vec<(&str, &str, Option<&str>, &str)> = grants
        .iter()
        .map(|g| {
            let end = &g["end"];
            (
                g["grant_id"].as_str().unwrap(),
                end["kind"].as_str().unwrap(),
                end["reason"].as_str(),
                g["key"].as_str().unwrap(),
            )
        })
        .collect();
    got.sort();
    let mut want = [
        (g1.as_str(), "release", None, open_key),
        (g2.as_str(), "expiry", Some("arbiter_restart"), open_key),
        (g3.as_str(), "release", None, sdk_key),
        (g4.as_str(), "release", None, sdk_key),
    ];
    want.sort();
    assert_eq!(got, want, "{v}");
    for g in grants {
        assert_eq!((g["class"].as_str(), g["namespace"].as_str()), (Some("batch"), Some("payments")), "{g}");
    }
    let events = tailer.lockctl(&["history", open_key]);
    let unprotected: Vec<&Value> =
        events["events"].as_array().unwrap().iter().filter(|e| e["unprotected"] == true).collect();
    assert_eq!(unprotected.len(), 4, "two grants and their ends: {events}");
    assert!(unprotected.iter().all(|e| e["revision"] == 0 && e["session"].is_null()));
    // The closed class left no trace: nothing was granted.
    let closed = tailer.lockctl(&["history", closed_key]);
    assert!(closed["events"].as_array().unwrap().is_empty(), "{closed}");
    // The table shows digests, never the raw key; the logs never name it either.
    let url = format!("https://127.0.0.1:{}", tailer.query_port);
    let out = std::process::Command::new(lockmesh_tests::paths::profile_dir().join("lockctl"))
        .args(["audit", "--url", &url, "--ca"])
        .arg(&tailer.ca)
        .arg("--cert")
        .arg(&tailer.operator.cert_path)
        .arg("--key")
        .arg(&tailer.operator.key_path)
        .arg("unprotected")
        .env_remove("LOCKMESH_ADMIN_TOKEN")
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("4 unprotected grants") && !table.contains("job-7"), "{table}");
    let log = std::fs::read_to_string(st.arbiter(0).log_path()).unwrap();
    assert!(log.contains("QUORUM LOST") && log.contains("UNPROTECTED grant"), "{log}");
    for secret in [open_key, closed_key, sdk_key, &g1, &g2, &g3, &g4] {
        assert!(!log.contains(secret), "the arbiter log names {secret}");
    }

    // With the quorum back the open class is fenced again.
    let r = a.post(ACQ, &[("x-lock-key", open_key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert!(s(&r, "token").parse::<u64>().unwrap() > t && r.json["unprotected"] == false, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transparent_route_forwards_token_zero_only_for_a_class_that_declared_it() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("unprotected.spool");
    let st = Stack::builder("failopen-tp")
        .envoy_config("inbound-sidecar")
        .own_etcd(1)
        .registry(REGISTRY)
        .arbiter_extra_yaml(fail_open_yaml(&spool))
        .start()
        .await
        .unwrap();
    let c = st.client("payments", "worker").unwrap();
    let r = c.post("/jobs/1", &[("x-lock-key", "payments/batch/tp-1")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let before: u64 = st.backend().requests()[0].header("x-lock-token").unwrap().parse().unwrap();
    assert!(before > 0);

    // The only member is killed: no quorum.
    st.etcd().member(0).kill();
    declared(&st, 20).await;
    let r = c.post("/jobs/2", &[("x-lock-key", "payments/orders/tp-2"), ("x-lock-wait-ms", "0")]).await.unwrap();
    assert_eq!((r.code(), r.header("x-lockmesh-error")), (503, Some("unavailable")), "{}", r.body);
    assert_eq!(st.backend().requests().len(), 1, "a closed class's request reached the upstream");
    let r = c.post("/jobs/3", &[("x-lock-key", "payments/batch/tp-3"), ("x-lock-wait-ms", "0")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let seen = st.backend().requests();
    assert_eq!(seen.len(), 2);
    assert_eq!((seen[1].header("x-lock-token"), seen[1].header("x-lock-revision")), (Some("0"), Some("0")));
    assert!(seen[1].headers.iter().all(|(k, _)| !k.starts_with("x-lockmesh-") && k != "x-lock-grant"));
    // The request ended: the filter released its hold, from memory, and the spool
    // says so (the hold leaves memory just before its release line is fsynced).
    assert_eventually!(10, async || {
        let f = &status(&st).await["fail_open"][0];
        anyhow::ensure!(f["unprotected_holds"] == 0, "still held: {f}");
        anyhow::ensure!(spool_lines(&spool).len() >= 2, "release not spooled yet");
        Ok(())
    });
    let ops: Vec<(String, Option<String>)> = spool_lines(&spool)
        .iter()
        .map(|l| {
            (
                l["op"].as_str().unwrap().to_owned(),
                l["hold_id"].as_str().map(|h| h.split('/').nth(1).unwrap().to_owned()),
            )
        })
        .collect();
    assert_eq!(ops.len(), 2, "{ops:?}");
    assert_eq!((ops[0].0.as_str(), ops[1].0.as_str()), ("grant", "release"));
    assert!(ops[0].1.is_some() && ops[0].1 == ops[1].1, "{ops:?}");
}

/// The arbiter's loader, through `lockctl class check`: open only on an advisory
/// class of purpose efficiency, each refusal at its field path.
#[test]
fn the_registry_refuses_open_on_a_fenced_or_a_correctness_class() {
    let dir = tempfile::tempdir().unwrap();
    let check = |yaml: &str| {
        let f = dir.path().join("registry.yaml");
        std::fs::write(&f, yaml).unwrap();
        let out = std::process::Command::new(lockmesh_tests::paths::profile_dir().join("lockctl"))
            .args(["class", "check"])
            .arg(&f)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, _) = check(REGISTRY);
    assert_eq!(code, Some(0), "the scenario registry is valid");
    let bad = REGISTRY.replace("    purpose: efficiency\n", "    purpose: correctness\n");
    let (code, err) = check(&bad);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("classes[1].on_quorum_loss: open with purpose correctness"), "{err}");
    let bad = REGISTRY.replace("    enforcement: advisory\n    risk_owner: lockmesh-tests\n    waiver_expiry: \"2099-12-31\"\n    purpose: efficiency\n", "    enforcement: fenced\n    purpose: efficiency\n");
    let (code, err) = check(&bad);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("classes[1].on_quorum_loss: open needs enforcement advisory, not fenced"), "{err}");
    let bad = REGISTRY.replace("    purpose: efficiency\n", "");
    let (_, err) = check(&bad);
    assert!(err.contains("classes[1].on_quorum_loss: open needs purpose: efficiency"), "{err}");
}
