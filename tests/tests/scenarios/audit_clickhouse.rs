//! The audit tailer's ClickHouse sink against ClickHouse's own engine (chdb-core
//! 26.9 behind the test's HTTP front, `tests/support/chdb_front.py`; docs/AUDIT.md
//! says what that front is not): the shipped DDL, the tailer's inserts and every
//! audit query as ClickHouse SQL (`lockmesh_audit::clickhouse::reports`) over a
//! real history (grants, releases, expiries, a session close, a force release by
//! two operators, unprotected-grant and shadow records, a restore), with the tailer
//! killed between ClickHouse's answer and its local commit and ClickHouse itself
//! down for a while. Every row (read with FINAL) and every query's answer equal the
//! embedded store's for the same history: no duplicate, no gap. The planted sink
//! that leaves a column out (`test_faults: [clickhouse_drops_column]`) fails the
//! same comparison.

use std::{collections::BTreeSet, path::Path, time::Duration};

use lockmesh_audit::{
    clickhouse::{self, reports, Sink},
    query::{self, Query},
    store::Store,
    AuditEvent, EventKind,
};
use lockmesh_devcerts::jwt::Issuer;
use lockmesh_tests::{
    clickhouse::ChdbFront, eventually, paths::profile_dir, ports::free_port, process::ChildProcess, Stack,
};
use serde_json::{json, Value};

use super::{
    admin::{operators_yaml, token, Admin, ISS},
    audit::{head, Tailer},
};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const TABLE: &str = "lockmesh.audit_events";

/// A tailer like [`Tailer::start`], with the ClickHouse sink on `ch` and the
/// planted `faults` (the environment allows them).
async fn tailer(st: &Stack, ch: &ChdbFront, faults: &[&str]) -> Tailer {
    let dir = tempfile::tempdir().unwrap();
    let (admin_port, query_port) = (free_port(), free_port());
    let operator = st.pki().client("lockmesh-system", "lockctl").unwrap();
    let registry = st.arbiter(0).config_path().parent().unwrap().join("registry.yaml");
    let faults: Vec<String> = faults.iter().map(|f| format!("{f:?}")).collect();
    let cfg = format!(
        "etcd_endpoints: {:?}\netcd_root: {:?}\nstore_file: audit.redb\nadmin_listen: \"127.0.0.1:{admin_port}\"\n\
         checkpoint_interval_ms: 200\nelection_ttl_s: 3\nregistry_file: {:?}\n{}\
         clickhouse: {{ url: {:?}, user: {:?}, password_file: {:?} }}\ntest_faults: [{}]\n",
        st.etcd().endpoints(),
        st.root(),
        registry.display().to_string(),
        st.etcd_users().audit_yaml("lockmesh-audit"),
        ch.url(),
        lockmesh_tests::clickhouse::CH_USER,
        ch.password_file().display().to_string(),
        faults.join(", "),
    );
    std::fs::write(dir.path().join("audit.yaml"), cfg).unwrap();
    let process = ChildProcess::new(
        "audit",
        profile_dir().join("lockmesh-audit"),
        vec!["--config".into(), dir.path().join("audit.yaml").display().to_string()],
        dir.path().join("audit.log"),
    )
    .env("RUST_LOG", "info")
    .env("LOCKMESH_TEST_FAULTS", "1");
    let t = Tailer { process, admin_port, query_port, operator, ca: st.pki().ca_cert_path(), dir };
    t.process.start().unwrap();
    up(&t).await;
    t
}

pub(crate) async fn up(t: &Tailer) {
    let port = t.admin_port;
    t.process
        .wait_ready(Duration::from_secs(20), async || {
            let r = lockmesh_tests::probe::http_get(port, "/metrics").await?;
            anyhow::ensure!(r.body.contains("lockmesh_audit_leader 1"), "not leader yet");
            Ok(())
        })
        .await
        .unwrap();
}

/// Stops the tailer once its checkpoint is the head and the head did not move
/// before the stop: no batch can be half sent (in ClickHouse, not in the store).
pub(crate) async fn quiet_stop(st: &Stack, tailer: &Tailer) {
    loop {
        let h = head(st).await;
        tailer.caught_up(h).await;
        tailer.process.stop(Duration::from_secs(5)).await.unwrap();
        if head(st).await == h {
            return;
        }
        tailer.process.start().unwrap();
        up(tailer).await;
    }
}

/// ClickHouse's engine with the shipped DDL, merges stopped (so rows sent twice
/// stay visible without FINAL until the end).
async fn clickhouse() -> ChdbFront {
    let ch = ChdbFront::start().await.unwrap();
    ch.apply_ddl(&clickhouse::ddl_statements()).await.unwrap();
    // Twice: the DDL is idempotent (IF NOT EXISTS, OR REPLACE).
    ch.apply_ddl(&clickhouse::ddl_statements()).await.unwrap();
    ch.query(&format!("SYSTEM STOP MERGES {TABLE}")).await.unwrap();
    ch
}

fn sink(ch: &ChdbFront) -> Sink {
    let pw = std::fs::read_to_string(ch.password_file()).unwrap();
    Sink::try_new(&ch.url(), "lockmesh", "audit_events", Some(lockmesh_tests::clickhouse::CH_USER.into()), Some(pw))
        .unwrap()
}

fn tok(r: &lockmesh_tests::client::Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token: {}", r.body)).parse().unwrap()
}

/// How many times the tailer logged that ClickHouse accepted a batch.
fn sent(t: &Tailer) -> usize {
    t.log().matches("AUDIT TEST: batch sent to clickhouse").count()
}

/// Every difference between the store at `store_file` (tailer stopped) and
/// ClickHouse: the rows (FINAL) column by column, then each audit query's answer.
/// Empty when they agree.
async fn differences(store_file: &Path, ch: &ChdbFront) -> (Vec<String>, usize) {
    let store = Store::open(store_file).unwrap();
    let cp = store.checkpoint().unwrap().unwrap();
    let ours = store.events().unwrap();
    let mut diffs = Vec::new();
    // 1. The rows, whole.
    let cols =
        "cluster_id, timeline, revision, epoch, kind, etcd_key, digest, key, identity, instance, class, session, \
                grant_revision, slot, at_ms, detail, unprotected";
    let text = ch
        .query(&format!(
            "SELECT {cols} FROM {TABLE} FINAL ORDER BY event_key FORMAT JSONEachRow \
             SETTINGS output_format_json_quote_64bit_integers = 0"
        ))
        .await
        .unwrap();
    let theirs: Vec<AuditEvent> =
        text.lines().filter(|l| !l.is_empty()).map(|l| reports::event_of(l).unwrap()).collect();
    if theirs.len() != ours.len() {
        diffs.push(format!("rows: clickhouse has {} (FINAL), the store {}", theirs.len(), ours.len()));
    }
    let keys = |v: &[AuditEvent]| v.iter().map(AuditEvent::event_key).collect::<BTreeSet<_>>();
    let (k_ours, k_theirs) = (keys(&ours), keys(&theirs));
    for k in k_ours.difference(&k_theirs) {
        diffs.push(format!("gap: {k} is not in clickhouse"));
    }
    for k in k_theirs.difference(&k_ours) {
        diffs.push(format!("extra: {k} is only in clickhouse"));
    }
    for (a, b) in ours.iter().zip(&theirs) {
        if a != b {
            diffs.push(format!("row {}: store {a:?} / clickhouse {b:?}", a.event_key()));
        }
    }
    // 2. Every query, on both, at one `now`.
    let now = lockmesh_lock::now_ms();
    let mid = ours.iter().map(|e| e.at_ms).filter(|&t| t > 0).min().unwrap_or(0) / 2
        + ours.iter().map(|e| e.at_ms).max().unwrap_or(0) / 2;
    let mut qs = vec![
        Query::Longest { limit: 3 },
        Query::Longest { limit: 1000 },
        Query::Expiries { since_ms: 0 },
        Query::Expiries { since_ms: mid },
        Query::Recent { limit: 7 },
        Query::Recent { limit: 5000 },
        Query::Unprotected { since_ms: 0, until_ms: u64::MAX, outage: None },
        Query::Unprotected { since_ms: 0, until_ms: u64::MAX, outage: Some("coord-1".into()) },
        Query::Unprotected { since_ms: mid, until_ms: now, outage: None },
        Query::Shadow { since_ms: 0 },
        Query::Shadow { since_ms: mid },
    ];
    qs.extend(EventKind::ALL.iter().map(|&kind| Query::Events { kind, since_ms: 0 }));
    let digests: BTreeSet<String> = ours.iter().filter_map(|e| e.digest.clone()).collect();
    qs.extend(digests.into_iter().map(|digest| Query::History { digest }));
    let ids: BTreeSet<String> = ours.iter().filter_map(|e| e.identity.clone()).collect();
    for identity in ids {
        qs.push(Query::ByIdentity { identity: identity.clone(), since_ms: 0, until_ms: u64::MAX });
        qs.push(Query::ByIdentity { identity, since_ms: mid, until_ms: now });
    }
    let sink = sink(ch);
    for q in &qs {
        let a = serde_json::to_value(query::run(&store, q, now).unwrap()).unwrap();
        let b = match sink.run(q, now, &cp).await {
            Ok(b) => serde_json::to_value(b).unwrap(),
            Err(e) => {
                diffs.push(format!("{q:?}: clickhouse refused: {e}"));
                continue;
            }
        };
        if a != b {
            diffs.push(format!("{q:?}:\n  store      {a}\n  clickhouse {b}"));
        }
    }
    (diffs, qs.len())
}

/// Writes the records an arbiter ships after a quorum loss (`u/<grant>/<op>`,
/// docs/AUDIT.md) and a class's shadow decisions (`w/<class>`) straight into etcd:
/// the tailer reads them from the history like any other put. `g2` is shipped twice
/// (a re-ship after a crash between shipping and cutting the spool).
async fn shipped_records(st: &Stack) {
    let mut c = st.etcd().client().await.unwrap();
    let now = lockmesh_lock::now_ms();
    let rec = |op: &str, grant: &str, key: &str, outage: &str, at: u64, extra: Value| {
        let mut v = json!({"op": op, "grant": grant, "key": key, "digest": format!("{:064x}", key.len() * 7 + grant.len()),
            "class": "default", "identity": "spiffe://lockmesh.test/ns/jobs/sa/spooler", "epoch": 1,
            "cluster": "coord", "outage": outage, "at_ms": at});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        v.to_string()
    };
    let g1 = "0123456789abcdef0123456789abcdef";
    let g2 = "fedcba9876543210fedcba9876543210";
    let puts = [
        (
            format!("{}/u/{g1}/grant", st.root()),
            rec("grant", g1, "jobs/u-1", "coord-1", now - 5000, json!({"ttl_s": 30})),
        ),
        (
            format!("{}/u/{g1}/release", st.root()),
            rec("release", g1, "jobs/u-1", "coord-1", now - 4000, json!({"reason": "caller_gone"})),
        ),
        (
            format!("{}/u/{g2}/grant", st.root()),
            rec("grant", g2, "jobs/u-2", "coord-2", now - 3000, json!({"ttl_s": 30})),
        ),
    ];
    for (k, v) in &puts {
        c.put(k.as_str(), v.as_str(), None).await.unwrap();
    }
    c.put(puts[2].0.as_str(), puts[2].1.as_str(), None).await.unwrap();
    c.put(
        format!("{}/u/{g2}/expiry", st.root()),
        rec("expiry", g2, "jobs/u-2", "coord-2", now - 1000, json!({"reason": "ttl"})),
        None,
    )
    .await
    .unwrap();
    for (i, (decision, reason, digest)) in [
        ("would_refuse", "key_gated", Some("aa")),
        ("would_refuse", "key_gated", Some("bb")),
        ("would_grant", "lock_delay", None),
    ]
    .into_iter()
    .enumerate()
    {
        let mut r = json!({"at_ms": now - 2000 + i as u64, "candidate": 1 + i, "class": "default", "count": 2 + i,
            "decision": decision, "enforced": 4, "reason": reason});
        if let Some(d) = digest {
            r["digest"] = json!(d.repeat(32));
        }
        c.put(format!("{}/w/default", st.root()), r.to_string(), None).await.unwrap();
    }
}

/// The full history, into both stores; answers the differences and how many
/// queries were compared, and the raw and FINAL row counts before the merge.
#[allow(clippy::too_many_lines)]
async fn run(name: &str, faults: &[&str]) -> (Vec<String>, usize, u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let idp = Issuer::generate("k1").unwrap();
    std::fs::write(dir.path().join("jwks.json"), idp.jwks()).unwrap();
    let st = Stack::builder(name)
        .envoy_config("lock-tier")
        .own_etcd(1)
        .plaintext_etcd()
        .arbiter_extra_yaml(operators_yaml(&dir.path().join("jwks.json"), ISS))
        .start()
        .await
        .unwrap();
    let ch = clickhouse().await;
    let mut pause_faults = faults.to_vec();
    pause_faults.push("pause_after_sink");
    let tailer = tailer(&st, &ch, &pause_faults).await;
    let a = st.client("payments", "a").unwrap();
    let b = st.client("payments", "b").unwrap();
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();

    // 1. Grants and releases.
    for i in 0..3 {
        let k = format!("payments/ch-{i}");
        let t = tok(&a.post(ACQ, &[("x-lock-key", &k)]).await.unwrap());
        let r = a.post(REL, &[("x-lock-key", &k), ("x-lock-token", &t.to_string())]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    // 2. ClickHouse is down for a while: the tailer keeps its checkpoint and
    //    sends again until accepted; nothing is lost. The engine starts again on
    //    its data directory.
    ch.kill();
    let s = b.post("/v1/sessions", &[]).await.unwrap();
    let sid_b = s.json["session"].as_str().unwrap().to_owned();
    tok(&b.post(ACQ, &[("x-lock-key", "payments/ch-session"), ("x-lock-session", &sid_b)]).await.unwrap());
    let c = b.post("/v1/sessions/close", &[("x-lock-session", &sid_b)]).await.unwrap();
    assert_eq!(c.code(), 200, "{}", c.body);
    tokio::time::sleep(Duration::from_secs(2)).await;
    ch.start_again().await.unwrap();
    ch.query(&format!("SYSTEM STOP MERGES {TABLE}")).await.unwrap();
    tailer.caught_up(head(&st).await).await;

    // 3. The tailer is killed after ClickHouse accepted a batch and before the
    //    store committed it: the batch is sent again after the restart. (The
    //    pause is once per process: a fresh one.)
    let before = sent(&tailer);
    tailer.crash_and_restart().await;
    let t = tok(&b.post(ACQ, &[("x-lock-key", "payments/ch-kill")]).await.unwrap());
    eventually(Duration::from_secs(15), async || {
        anyhow::ensure!(sent(&tailer) > before, "no batch sent yet");
        Ok(())
    })
    .await;
    tailer.process.kill();
    b.post(REL, &[("x-lock-key", "payments/ch-kill"), ("x-lock-token", &t.to_string())]).await.unwrap();
    // A session with two holds expires while the tailer is down.
    let s = a.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    for k in ["short/ch-exp-1", "short/ch-exp-2"] {
        tok(&a.post(ACQ, &[("x-lock-key", k), ("x-lock-session", &sid)]).await.unwrap());
    }
    eventually(Duration::from_secs(15), async || {
        let r = a.get("/v1/locks", &[("x-lock-key", "short/ch-exp-1")]).await?;
        anyhow::ensure!(r.json["holders"].as_array().is_some_and(|h| h.is_empty()), "still held");
        Ok(())
    })
    .await;
    tailer.process.start().unwrap();
    up(&tailer).await;
    tailer.caught_up(head(&st).await).await;

    // 4. A force release by two operators (the admin path's transaction).
    let key = "payments/ch-wedged";
    tok(&b.post(ACQ, &[("x-lock-key", key)]).await.unwrap());
    let adm = Admin::new(&st);
    let (alice, bob) = (token(&idp, "alice", 600), token(&idp, "bob", 600));
    let (code, p) = adm.run(&["request", "force-release", key, "--reason", "audit scenario"], Some(&alice));
    assert_eq!(code, 0, "{p}");
    let id = p["request"]["id"].as_str().unwrap().to_owned();
    let (code, o) = adm.run(&["approve", &id], Some(&bob));
    assert_eq!(code, 0, "{o}");

    // 5. Shipped unprotected grants and shadow decisions.
    shipped_records(&st).await;
    tailer.caught_up(head(&st).await).await;

    // 6. A restore behind the checkpoint: a new timeline, a seal. (Stopped
    //    quietly first: a batch ClickHouse accepted but the store did not commit
    //    would never be sent again once its history is restored away, so
    //    ClickHouse would keep events the store lacks; docs/AUDIT.md.)
    quiet_stop(&st, &tailer).await;
    st.etcd().restore_from(&snap, None).await.unwrap();
    tailer.process.start().unwrap();
    up(&tailer).await;
    eventually(Duration::from_secs(20), async || {
        let m = tailer.metrics().await;
        anyhow::ensure!(m.contains("lockmesh_audit_restores_total 1\n"), "no restore yet");
        Ok(())
    })
    .await;
    quiet_stop(&st, &tailer).await;

    let raw = ch.number(&format!("SELECT count() FROM {TABLE}")).await.unwrap();
    let fin = ch.number(&format!("SELECT count() FROM {TABLE} FINAL")).await.unwrap();
    let (diffs, n) = differences(&tailer.dir.path().join("audit.redb"), &ch).await;
    // After the merge, the table holds each event once without FINAL too.
    ch.query(&format!("SYSTEM START MERGES {TABLE}")).await.unwrap();
    ch.query(&format!("OPTIMIZE TABLE {TABLE} FINAL")).await.unwrap();
    let merged = ch.number(&format!("SELECT count() FROM {TABLE}")).await.unwrap();
    assert_eq!(merged, fin, "after OPTIMIZE FINAL the rows sent twice are one");
    let store = Store::open(&tailer.dir.path().join("audit.redb")).unwrap();
    let kinds: BTreeSet<EventKind> = store.events().unwrap().iter().map(|e| e.kind).collect();
    for k in [
        EventKind::Grant,
        EventKind::Release,
        EventKind::Expiry,
        EventKind::SessionRelease,
        EventKind::ForceRelease,
        EventKind::Restore,
        EventKind::WouldRefuse,
        EventKind::WouldGrant,
    ] {
        assert!(kinds.contains(&k), "the history has no {k:?} event: {kinds:?}");
    }
    (diffs, n, raw, fin)
}

#[tokio::test]
async fn clickhouse_holds_the_stores_history_and_answers_every_query_alike() {
    let (diffs, queries, raw, fin) = run("audit-ch", &[]).await;
    assert!(diffs.is_empty(), "{} differences over {queries} queries:\n{}", diffs.len(), diffs.join("\n"));
    assert!(raw > fin, "the batch sent before the kill is in the table twice until merged ({raw} rows, {fin} FINAL)");
    eprintln!("audit_clickhouse: {fin} events, {raw} rows before the merge, {queries} queries equal");
}

/// Planted: the sink leaves `identity` out of its rows. The rows and the
/// by-identity, history and hold queries differ from the store.
#[tokio::test]
async fn planted_a_sink_that_drops_a_column_is_caught() {
    let (diffs, _, _, _) = run("audit-ch-planted", &["clickhouse_drops_column"]).await;
    assert!(diffs.iter().any(|d| d.starts_with("row ")), "the rows compare equal: {diffs:?}");
    assert!(diffs.iter().any(|d| d.starts_with("ByIdentity")), "the by-identity query compares equal: {diffs:?}");
}
