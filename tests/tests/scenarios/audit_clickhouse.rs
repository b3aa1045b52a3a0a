//! The audit tailer's ClickHouse sink against ClickHouse's own engine (chdb-core
//! 26.9 behind the test's HTTP front, `tests/support/chdb_front.py`; docs/AUDIT.md
//! says what that front is not): the shipped DDL, the tailer's inserts and every
//! audit query as ClickHouse SQL (`lockmesh_audit::clickhouse::reports`) over a
//! real history (grants, releases, expiries, a session close, a force release by
//! two operators, unprotected-grant and shadow records, a restore), with the tailer
//! killed between ClickHouse's answer and its local commit and ClickHouse itself
//! down for a while. Every row (read with FINAL) and every query's answer equal the
//! embedded store's for the same history: no duplicate, no gap. The query port
//! answers every query alike with ClickHouse configured (it then reads ClickHouse)
//! and without (it reads the embedded store). The planted sink that leaves a
//! column out (`test_faults: [clickhouse_drops_column]`) fails the same
//! comparison. A row only ClickHouse holds shows that the port reads ClickHouse;
//! the planted port that reads the embedded store instead
//! (`query_port_reads_embedded`) misses it. `scripts/up --clickhouse --demo` runs
//! the quick start with the port answering from ClickHouse.

use std::{collections::BTreeSet, path::Path, time::Duration};

use lockmesh_audit::query_port::STORE_HEADER;
use lockmesh_audit::{
    clickhouse::{self, reports, Sink},
    query::{self, Query},
    store::Store,
    AuditEvent, EventKind,
};
use lockmesh_devcerts::jwt::Issuer;
use lockmesh_tests::{
    clickhouse::ChdbFront, eventually, paths::profile_dir, ports::free_port, process::ChildProcess, LockClient, Stack,
};
use reqwest::Method;
use serde_json::{json, Value};

use super::{
    admin::{operators_yaml, token, Admin, ISS},
    audit::{head, Tailer},
};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
const TABLE: &str = "lockmesh.audit_events";

/// A tailer like [`Tailer::start`], with the ClickHouse sink on `ch`, the query
/// port (lockctl's certificate, no token check) and the planted `faults` (the
/// environment allows them). Its directory also holds `audit-embedded.yaml`: the
/// same config without the `clickhouse:` section ([`embedded_tailer`]).
async fn tailer(st: &Stack, ch: &ChdbFront, faults: &[&str]) -> Tailer {
    let dir = tempfile::tempdir().unwrap();
    let (admin_port, query_port) = (free_port(), free_port());
    let operator = st.pki().client("lockmesh-system", "lockctl").unwrap();
    let server = st.pki().arbiter_server();
    let registry = st.arbiter(0).config_path().parent().unwrap().join("registry.yaml");
    let faults: Vec<String> = faults.iter().map(|f| format!("{f:?}")).collect();
    let cfg = format!(
        "etcd_endpoints: {:?}\netcd_root: {:?}\nstore_file: audit.redb\nadmin_listen: \"127.0.0.1:{admin_port}\"\n\
         checkpoint_interval_ms: 200\nelection_ttl_s: 3\nregistry_file: {:?}\n{}\
         query: {{ listen: \"127.0.0.1:{query_port}\", tls: {{ cert: {:?}, key: {:?}, client_ca: {:?} }}, \
         allowed_clients: [{:?}] }}\ntest_faults: [{}]\n",
        st.etcd().endpoints(),
        st.root(),
        registry.display().to_string(),
        st.etcd_users().audit_yaml("lockmesh-audit"),
        server.cert_path.display().to_string(),
        server.key_path.display().to_string(),
        st.pki().ca_cert_path().display().to_string(),
        operator.spiffe_id,
        faults.join(", "),
    );
    std::fs::write(dir.path().join("audit-embedded.yaml"), &cfg).unwrap();
    let sink = format!(
        "clickhouse: {{ url: {:?}, user: {:?}, password_file: {:?} }}\n",
        ch.url(),
        lockmesh_tests::clickhouse::CH_USER,
        ch.password_file().display().to_string(),
    );
    std::fs::write(dir.path().join("audit.yaml"), cfg + &sink).unwrap();
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
    let qs = queries(&ours, now);
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

/// Every audit query over the history `ours` at `now`: every kind of query, with
/// windows that cut the history, each digest's history and each identity's holds.
fn queries(ours: &[AuditEvent], now: u64) -> Vec<Query> {
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
    qs
}

/// The query port of a running tailer, as lockctl's certificate.
fn api(t: &Tailer) -> LockClient {
    let identity = (t.operator.cert_path.as_path(), t.operator.key_path.as_path());
    LockClient::new(t.query_port, &t.ca, Some(identity)).unwrap()
}

/// `POST /v1/audit/query` with `q`: the answer (JSON; an open hold's `held_ms`,
/// counted to the moment of the query, set to 0) and the store the port named.
async fn ask(c: &LockClient, q: &Query) -> (Value, String) {
    let body = serde_json::to_vec(q).unwrap();
    let r = c.request(Method::POST, "/v1/audit/query", &[("content-type", "application/json")], body).await.unwrap();
    assert_eq!(r.code(), 200, "{q:?}: {}", r.body);
    let store = r.header(STORE_HEADER).unwrap_or("(none)").to_owned();
    let mut a = r.json;
    for h in a.get_mut("holds").and_then(Value::as_array_mut).into_iter().flatten() {
        if h["open"] == json!(true) {
            h["held_ms"] = json!(0);
        }
    }
    (a, store)
}

/// The same tailer (store, ports) run from `audit-embedded.yaml`: no ClickHouse,
/// so its query port answers from the embedded store.
async fn embedded_tailer(t: &Tailer) -> ChildProcess {
    let p = ChildProcess::new(
        "audit-embedded",
        profile_dir().join("lockmesh-audit"),
        vec!["--config".into(), t.dir.path().join("audit-embedded.yaml").display().to_string()],
        t.dir.path().join("audit-embedded.log"),
    )
    .env("RUST_LOG", "info")
    .env("LOCKMESH_TEST_FAULTS", "1");
    p.start().unwrap();
    let port = t.admin_port;
    p.wait_ready(Duration::from_secs(20), async || {
        let r = lockmesh_tests::probe::http_get(port, "/metrics").await?;
        anyhow::ensure!(r.body.contains("lockmesh_audit_leader 1"), "not leader yet");
        Ok(())
    })
    .await
    .unwrap();
    p
}

/// Every query through the query port: first of the tailer with ClickHouse
/// (stopped on entry, stopped on return), then of the same tailer without it.
/// Answers the differences (the answers, and each port naming its store) and how
/// many queries were compared.
async fn api_differences(st: &Stack, t: &Tailer) -> (Vec<String>, usize) {
    let ours = Store::open(&t.dir.path().join("audit.redb")).unwrap().events().unwrap();
    let qs = queries(&ours, lockmesh_lock::now_ms());
    let mut diffs = Vec::new();
    t.process.start().unwrap();
    up(t).await;
    let c = api(t);
    let mut from_ch = Vec::new();
    for q in &qs {
        let (a, store) = ask(&c, q).await;
        if store != "clickhouse" {
            diffs.push(format!("{q:?}: the port with clickhouse configured answered from {store}"));
        }
        from_ch.push(a);
    }
    quiet_stop(st, t).await;
    let embedded = embedded_tailer(t).await;
    for (q, a) in qs.iter().zip(&from_ch) {
        let (b, store) = ask(&c, q).await;
        if store != "embedded" {
            diffs.push(format!("{q:?}: the port without clickhouse answered from {store}"));
        }
        if *a != b {
            diffs.push(format!("api {q:?}:\n  clickhouse {a}\n  embedded   {b}"));
        }
    }
    embedded.stop(Duration::from_secs(5)).await.unwrap();
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
    let (mut diffs, n) = differences(&tailer.dir.path().join("audit.redb"), &ch).await;
    // The query port answers the same through ClickHouse and through the embedded store.
    let (api_diffs, api_n) = api_differences(&st, &tailer).await;
    assert_eq!(api_n, n);
    diffs.extend(api_diffs);
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
    eprintln!(
        "audit_clickhouse: {fin} events, {raw} rows before the merge, {queries} queries equal (store, SQL, and the \
         query port on both stores)"
    );
}

/// Planted: the sink leaves `identity` out of its rows. The rows and the
/// by-identity, history and hold queries differ from the store.
#[tokio::test]
async fn planted_a_sink_that_drops_a_column_is_caught() {
    let (diffs, _, _, _) = run("audit-ch-planted", &["clickhouse_drops_column"]).await;
    assert!(diffs.iter().any(|d| d.starts_with("row ")), "the rows compare equal: {diffs:?}");
    assert!(diffs.iter().any(|d| d.starts_with("ByIdentity")), "the by-identity query compares equal: {diffs:?}");
}

/// A row only ClickHouse holds (inserted by the test beside the tailer's, never in
/// etcd or the embedded store), asked for through the query port of a tailer with
/// ClickHouse configured: answers how many events the port's `history` of that
/// row's digest held, the store the port named, and how many recent events it
/// answered before the insert.
async fn clickhouse_only_row_seen(name: &str, faults: &[&str]) -> (usize, String, usize) {
    let st = Stack::builder(name).envoy_config("lock-tier").own_etcd(1).plaintext_etcd().start().await.unwrap();
    let ch = clickhouse().await;
    let t = tailer(&st, &ch, faults).await;
    let a = st.client("payments", "a").unwrap();
    let k = "payments/ch-only";
    let tk = tok(&a.post(ACQ, &[("x-lock-key", k)]).await.unwrap());
    let r = a.post(REL, &[("x-lock-key", k), ("x-lock-token", &tk.to_string())]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    t.caught_up(head(&st).await).await;
    let c = api(&t);
    let (recent, _) = ask(&c, &Query::Recent { limit: 10 }).await;
    let events: Vec<AuditEvent> = serde_json::from_value(recent["events"].clone()).unwrap();
    let mut only = events.iter().find(|e| e.kind == EventKind::Grant).expect("the grant is recent").clone();
    only.digest = Some("ee".repeat(32));
    only.etcd_key.push_str("/clickhouse-only");
    sink(&ch).insert(&[only]).await.unwrap();
    let (history, store) = ask(&c, &Query::History { digest: "ee".repeat(32) }).await;
    (history["events"].as_array().map_or(0, Vec::len), store, events.len())
}

#[tokio::test]
async fn the_query_port_answers_from_clickhouse_when_it_is_the_store() {
    let (seen, store, recent) = clickhouse_only_row_seen("audit-ch-port", &[]).await;
    assert!(recent >= 2, "the port answered {recent} recent events for a grant and a release");
    assert_eq!(store, "clickhouse");
    assert_eq!(seen, 1, "the row only ClickHouse holds is not in the query port's answer");
}

/// Planted: the port answers from the embedded store while naming ClickHouse
/// (`test_faults: [query_port_reads_embedded]`). Its answers equal ClickHouse's
/// for the tailer's own history, so only the row ClickHouse alone holds tells.
#[tokio::test]
async fn planted_a_query_port_that_reads_the_embedded_store_is_caught() {
    let (seen, store, recent) = clickhouse_only_row_seen("audit-ch-port-planted", &["query_port_reads_embedded"]).await;
    assert!(recent >= 2, "the port answered {recent} recent events for a grant and a release");
    assert_eq!(store, "clickhouse", "the planted port still names clickhouse");
    assert_eq!(seen, 0, "the planted port answered the row only ClickHouse holds");
}

/// Every port `scripts/up --clickhouse` takes (`LOCKMESH_UP_PORT_<NAME>`).
const UP_PORTS: [&str; 14] = [
    "API",
    "API_ADMIN",
    "APP",
    "APP_ADMIN",
    "ARBITER",
    "ARBITER_ADMIN",
    "STORE",
    "FENCE",
    "FENCE_ADMIN",
    "AUDIT_ADMIN",
    "AUDIT_QUERY",
    "ETCD",
    "ETCD_PEER",
    "CLICKHOUSE",
];

/// `scripts/up --clickhouse --demo --no-build`, the quick start a user runs (here
/// on free ports and a temporary run directory): the walkthrough's five steps hold
/// with the audit's query port answering from ClickHouse's engine (steps 4 and 5
/// read it), and the script's own check after the demo says the port named
/// `clickhouse` and answered the grants the table holds.
#[tokio::test]
async fn scripts_up_clickhouse_answers_the_audit_from_clickhouse() {
    use std::process::Stdio;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let log = tmp.path().join("up.log");
    let file = std::fs::File::create(&log).unwrap();
    let mut cmd = tokio::process::Command::new("bash");
    cmd.arg(lockmesh_tests::repo_root().join("scripts/up"))
        .args(["--clickhouse", "--demo", "--no-build"])
        .current_dir(lockmesh_tests::repo_root())
        .env("LOCKMESH_UP_DIR", &dir)
        .env("LOCKMESH_UP_BIN_DIR", profile_dir())
        .env_remove("LOCKMESH_TEST_FAULTS")
        .env_remove("LOCKMESH_UP_FENCE_EXTRA")
        .stdin(Stdio::null())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .process_group(0)
        .kill_on_drop(true);
    for name in UP_PORTS {
        cmd.env(format!("LOCKMESH_UP_PORT_{name}"), free_port().to_string());
    }
    let started = std::time::Instant::now();
    let mut child = cmd.spawn().unwrap();
    let pgid = child.id().unwrap();
    let group = |sig: &str| {
        let _ = std::process::Command::new("kill").arg(format!("-{sig}")).arg("--").arg(format!("-{pgid}")).status();
    };
    let status = match tokio::time::timeout(Duration::from_secs(300), child.wait()).await {
        Ok(s) => s.unwrap(),
        Err(_) => {
            // Its cleanup stops what it started; then the whole group.
            group("TERM");
            if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_err() {
                group("KILL");
            }
            panic!(
                "scripts/up --clickhouse --demo did not end within 300 s:\n{}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
    };
    // The output without terminal colours (ESC [ ... letter).
    let raw = std::fs::read_to_string(&log).unwrap();
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(char::is_ascii_alphabetic);
        } else {
            out.push(c);
        }
    }
    assert!(status.success(), "scripts/up --clickhouse --demo failed:\n{out}");
    for step in 1..=5 {
        assert!(out.contains(&format!("[demo] step {step} proved: ")), "step {step} said nothing:\n{out}");
    }
    assert!(out.contains("the query port answered from clickhouse: "), "no clickhouse check:\n{out}");
    let cfg = std::fs::read_to_string(dir.join("config/audit.yaml")).unwrap();
    assert!(cfg.contains("\nclickhouse: { url: \"http://127.0.0.1:"), "{cfg}");
    let tailer_log = std::fs::read_to_string(dir.join("logs/audit.log")).unwrap();
    assert!(tailer_log.contains("audit queries are answered from the clickhouse store"), "{tailer_log}");
    eprintln!("scripts/up --clickhouse --demo: {:?}", started.elapsed());
}
