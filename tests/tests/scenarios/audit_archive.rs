//! The archives (ADR-21, `lockmesh_audit::archive`) on moto's S3 server (moto
//! 5.2.5, `lockmesh_tests::s3`): the tailer writes the closed grants of a real
//! history (releases, a session expiry, a force release by two operators) as a
//! Parquet file for the day into a bucket, read back with pyarrow 26.0.1
//! (`.tools/chdb`), every grant of the history in it with the store's columns;
//! the force release goes into an object-locked bucket (compliance mode) whose
//! version refuses deletion. Planted: an archive that skips the last, partial day
//! (`test_faults: [archive_skips_last_day]`) leaves the day's file out.

use std::{collections::BTreeSet, time::Duration};

use lockmesh_audit::{archive, store::Store};
use lockmesh_devcerts::jwt::Issuer;
use lockmesh_tests::{eventually, paths::profile_dir, ports::free_port, process::ChildProcess, s3::MotoServer, Stack};
use serde_json::Value;

use super::{
    admin::{operators_yaml, token, Admin, ISS},
    audit::{head, Tailer},
    audit_clickhouse::{quiet_stop, up},
};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const GRANTS: &str = "lockmesh-grants";
const FORCE: &str = "lockmesh-force";

fn tok(r: &lockmesh_tests::client::Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token: {}", r.body)).parse().unwrap()
}

fn rev_of(token: u64) -> i64 {
    i64::try_from(token & ((1 << 48) - 1)).unwrap()
}

async fn tailer(st: &Stack, s3: &MotoServer, faults: &[&str]) -> Tailer {
    let dir = tempfile::tempdir().unwrap();
    let (admin_port, query_port) = (free_port(), free_port());
    let operator = st.pki().client("lockmesh-system", "lockctl").unwrap();
    let faults: Vec<String> = faults.iter().map(|f| format!("{f:?}")).collect();
    let cfg = format!(
        "etcd_endpoints: {:?}\netcd_root: {:?}\nstore_file: audit.redb\nadmin_listen: \"127.0.0.1:{admin_port}\"\n\
         checkpoint_interval_ms: 200\nelection_ttl_s: 3\n{}\
         archive: {{ endpoint: {:?}, grants_bucket: {GRANTS}, force_bucket: {FORCE}, force_retention_days: 1, \
         interval_ms: 1000 }}\ntest_faults: [{}]\n",
        st.etcd().endpoints(),
        st.root(),
        st.etcd_users().audit_yaml("lockmesh-audit"),
        s3.endpoint(),
        faults.join(", "),
    );
    std::fs::write(dir.path().join("audit.yaml"), cfg).unwrap();
    let mut process = ChildProcess::new(
        "audit",
        profile_dir().join("lockmesh-audit"),
        vec!["--config".into(), dir.path().join("audit.yaml").display().to_string()],
        dir.path().join("audit.log"),
    )
    .env("RUST_LOG", "info")
    .env("LOCKMESH_TEST_FAULTS", "1");
    for (k, v) in s3.aws_env() {
        process = process.env(k, v);
    }
    let t = Tailer { process, admin_port, query_port, operator, ca: st.pki().ca_cert_path(), dir };
    t.process.start().unwrap();
    up(&t).await;
    t
}

/// The rows of a Parquet file, read by pyarrow.
fn pyarrow_rows(file: &std::path::Path) -> anyhow::Result<Vec<Value>> {
    let python = lockmesh_tests::repo_root().join(".tools/chdb/bin/python");
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import json, sys, pyarrow.parquet as pq; print(json.dumps(pq.read_table(sys.argv[1]).to_pylist()))",
        ])
        .arg(file)
        .output()?;
    anyhow::ensure!(out.status.success(), "pyarrow: {}", String::from_utf8_lossy(&out.stderr));
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Drives the history; answers the expected (grant revision, end kind) of every
/// closed hold, the day's file's rows (or none), and the store's closed holds.
async fn run(name: &str, faults: &[&str]) -> (BTreeSet<(i64, String)>, Option<Vec<Value>>, Tailer, MotoServer) {
    let dir = tempfile::tempdir().unwrap();
    let idp = Issuer::generate("k1").unwrap();
    std::fs::write(dir.path().join("jwks.json"), idp.jwks()).unwrap();
    // Its own etcd: the checkpoint reaches the head only if no other test writes there.
    let st = Stack::builder(name)
        .envoy_config("lock-tier")
        .own_etcd(1)
        .arbiter_extra_yaml(operators_yaml(&dir.path().join("jwks.json"), ISS))
        .start()
        .await
        .unwrap();
    let s3 = MotoServer::start().await.unwrap();
    s3.create_bucket(GRANTS).await.unwrap();
    s3.create_locked_bucket(FORCE).await.unwrap();
    let tailer = tailer(&st, &s3, faults).await;
    let a = st.client("payments", "a").unwrap();
    let mut want = BTreeSet::new();
    for i in 0..3 {
        let k = format!("payments/arch-{i}");
        let t = tok(&a.post(ACQ, &[("x-lock-key", &k)]).await.unwrap());
        a.post(REL, &[("x-lock-key", &k), ("x-lock-token", &t.to_string())]).await.unwrap();
        want.insert((rev_of(t), "release".to_owned()));
    }
    let s = a.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    let t = tok(&a.post(ACQ, &[("x-lock-key", "short/arch-exp"), ("x-lock-session", &sid)]).await.unwrap());
    want.insert((rev_of(t), "expiry".to_owned()));
    let key = "payments/arch-wedged";
    let t = tok(&a.post(ACQ, &[("x-lock-key", key)]).await.unwrap());
    want.insert((rev_of(t), "force_release".to_owned()));
    let adm = Admin::new(&st);
    let (code, p) =
        adm.run(&["request", "force-release", key, "--reason", "archive scenario"], Some(&token(&idp, "alice", 600)));
    assert_eq!(code, 0, "{p}");
    let (code, o) = adm.run(&["approve", p["request"]["id"].as_str().unwrap()], Some(&token(&idp, "bob", 600)));
    assert_eq!(code, 0, "{o}");
    eventually(Duration::from_secs(15), async || {
        let r = a.get("/v1/locks", &[("x-lock-key", "short/arch-exp")]).await?;
        anyhow::ensure!(r.json["holders"].as_array().is_some_and(|h| h.is_empty()), "still held");
        Ok(())
    })
    .await;
    tailer.caught_up(head(&st).await).await;
    let cluster = {
        let r = lockmesh_tests::probe::http_get(tailer.admin_port, "/v1/audit/checkpoint").await.unwrap();
        let v: Value = serde_json::from_str(&r.body).unwrap();
        v["checkpoint"]["cluster_id"].as_str().unwrap().to_owned()
    };
    let day = archive::day_of(lockmesh_lock::now_ms());
    let file = dir.path().join("day.parquet");
    let key = format!("grants/{cluster}/{day}.parquet");
    // The archiver writes every second: wait until the day's file has every hold
    // (or, planted, give it 5 passes).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(if faults.is_empty() { 20 } else { 6 });
    let mut rows = None;
    while tokio::time::Instant::now() < deadline {
        if let Some(r) = s3.client().get(GRANTS, &key).await.unwrap() {
            std::fs::write(&file, &r.body).unwrap();
            let got = pyarrow_rows(&file).unwrap();
            let pairs: BTreeSet<(i64, String)> = got
                .iter()
                .map(|r| (r["grant_revision"].as_i64().unwrap(), r["end_kind"].as_str().unwrap().to_owned()))
                .collect();
            rows = Some(got);
            if want.is_subset(&pairs) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    quiet_stop(&st, &tailer).await;
    (want, rows, tailer, s3)
}

#[tokio::test]
async fn the_archives_hold_every_grant_in_parquet_and_lock_force_releases() {
    let (want, rows, tailer, s3) = run("audit-archive", &[]).await;
    let rows = rows.expect("no Parquet file for the day");
    // Every closed hold of the store, column by column, and nothing else.
    let store = Store::open(&tailer.dir.path().join("audit.redb")).unwrap();
    let closed: Vec<_> = store.holds().unwrap().into_iter().filter(|h| h.end.is_some()).collect();
    let as_row = |h: &lockmesh_audit::event::HoldRow| {
        let e = h.end.as_ref().unwrap();
        serde_json::json!({"digest": h.digest, "key": h.key, "identity": h.identity, "class": h.class,
            "session": h.session, "epoch": h.epoch, "grant_revision": h.grant_revision, "granted_ms": h.granted_ms,
            "end_kind": e.kind.as_str(), "end_revision": e.revision, "end_ms": e.at_ms})
    };
    let ours: BTreeSet<String> = closed.iter().map(|h| as_row(h).to_string()).collect();
    let theirs: BTreeSet<String> = rows.iter().map(Value::to_string).collect();
    assert_eq!(theirs, ours, "the day's file is not the store's closed holds");
    let pairs: BTreeSet<(i64, String)> =
        closed.iter().map(|h| (h.grant_revision, h.end.as_ref().unwrap().kind.as_str().to_owned())).collect();
    assert!(want.is_subset(&pairs), "{want:?} not all in {pairs:?}");

    // The force release is in the locked bucket, in compliance mode; its version
    // cannot be deleted.
    let list = s3.client().request(reqwest::Method::GET, FORCE, "?list-type=2", &[], Vec::new()).await.unwrap();
    let text = list.text();
    let keys: Vec<&str> = text.split("<Key>").skip(1).filter_map(|s| s.split_once("</Key>").map(|(k, _)| k)).collect();
    assert_eq!(keys.len(), 1, "one force record: {text}");
    let obj = s3.client().get(FORCE, keys[0]).await.unwrap().expect("force record readable");
    let rec: Value = serde_json::from_slice(&obj.body).unwrap();
    assert_eq!(rec["kind"], "force_release", "{rec}");
    assert_eq!(obj.header("x-amz-object-lock-mode"), Some("COMPLIANCE"), "{:?}", obj.headers);
    let version = obj.header("x-amz-version-id").expect("a versioned object").to_owned();
    let del = s3
        .client()
        .request(reqwest::Method::DELETE, FORCE, &format!("{}?versionId={version}", keys[0]), &[], Vec::new())
        .await
        .unwrap();
    assert_eq!(del.status, 403, "deleting the locked version: {}", del.text());
    assert!(del.text().contains("AccessDenied"), "{}", del.text());
    let again = s3
        .client()
        .request(reqwest::Method::GET, FORCE, &format!("{}?versionId={version}", keys[0]), &[], Vec::new())
        .await
        .unwrap();
    assert_eq!(again.status, 200, "the locked version is still there");
    eprintln!("audit_archive: {} holds in the day's Parquet file, force record {} locked", rows.len(), keys[0]);
}

/// Planted: the archiver skips the last (here the only, partial) day.
#[tokio::test]
async fn planted_an_archive_that_skips_the_last_partial_day_is_caught() {
    let (_, rows, _tailer, _s3) = run("audit-archive-planted", &["archive_skips_last_day"]).await;
    assert!(rows.is_none(), "the day's file was written: {rows:?}");
}
