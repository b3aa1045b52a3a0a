//! The PostgreSQL reference fence (issue 6, item 3) against a real PostgreSQL 15
//! started by the harness as its own non-root user: the fence column is checked in
//! the same statement as the write (strict and allow-equal), concurrent writers never
//! move it backwards, and the pause kit passes against it.

use std::sync::Arc;
use std::time::Duration;

use lockmesh_core::{pause::Verdict, FencingToken};
use lockmesh_fence_proxy::{
    route::EqualRule,
    store::postgres::{connect, PgFence, WriteOutcome},
};
use lockmesh_tests::{
    fence::{ensure_signing_key, pausekit_bin},
    postgres::PostgresProcess,
    Stack,
};

fn tok(v: u64) -> FencingToken {
    FencingToken::from_packed(v).unwrap()
}

#[tokio::test]
async fn the_server_runs_as_its_own_user_and_the_fence_refuses_stale_and_equal_per_variant() {
    let pg = PostgresProcess::start().await.unwrap();
    // PostgreSQL refuses root: when the tests run as root, it runs as another user.
    let status = std::fs::read_to_string(format!("/proc/{}/status", pg.pid().unwrap())).unwrap();
    let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap().split_whitespace().nth(1).unwrap().to_owned();
    assert_ne!(uid, "0", "postgres runs as root");

    let c = connect(&pg.url()).await.unwrap();
    let strict = PgFence::try_new("strict_items", EqualRule::Strict).unwrap();
    let allow = PgFence::try_new("allow_items", EqualRule::Allow).unwrap();
    for f in [&strict, &allow] {
        f.ensure_table(&c).await.unwrap();
        assert_eq!(f.write(&c, "r", "v10", tok(10)).await.unwrap(), WriteOutcome::Applied);
        assert_eq!(f.write(&c, "r", "v9", tok(9)).await.unwrap(), WriteOutcome::Stale, "{}", f.table());
        assert_eq!(f.read(&c, "r").await.unwrap(), Some(("v10".into(), tok(10))));
    }
    // Equal: strict refuses, allow writes and keeps the fence.
    assert_eq!(strict.write(&c, "r", "again", tok(10)).await.unwrap(), WriteOutcome::Stale);
    assert_eq!(strict.read(&c, "r").await.unwrap(), Some(("v10".into(), tok(10))));
    assert_eq!(allow.write(&c, "r", "again", tok(10)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(allow.read(&c, "r").await.unwrap(), Some(("again".into(), tok(10))));
    // Higher tokens advance both; other rows are independent.
    for f in [&strict, &allow] {
        assert_eq!(f.write(&c, "r", "v11", tok(11)).await.unwrap(), WriteOutcome::Applied);
        assert_eq!(f.write(&c, "other", "v1", tok(1)).await.unwrap(), WriteOutcome::Applied);
        assert_eq!(f.read(&c, "r").await.unwrap(), Some(("v11".into(), tok(11))));
    }
    assert_eq!(strict.read(&c, "missing").await.unwrap(), None);
    // The largest token lockmesh can mint fits the bigint column.
    let max =
        FencingToken::mint(lockmesh_core::token::EPOCH_LIMIT - 1, lockmesh_core::token::REVISION_LIMIT - 1).unwrap();
    assert_eq!(strict.write(&c, "r", "max", max).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(strict.read(&c, "r").await.unwrap(), Some(("max".into(), max)));
}

#[tokio::test]
async fn concurrent_writers_never_move_the_fence_backwards_and_the_highest_token_wins() {
    let pg = PostgresProcess::start().await.unwrap();
    let fence = Arc::new(PgFence::try_new("race", EqualRule::Strict).unwrap());
    fence.ensure_table(&connect(&pg.url()).await.unwrap()).await.unwrap();
    // A reader watches the row while 8 writers race with shuffled tokens 1..=400.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (fence, done, url) = (fence.clone(), done.clone(), pg.url());
        tokio::spawn(async move {
            let c = connect(&url).await.unwrap();
            let (mut last, mut reads) = (0u64, 0u32);
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some((v, t)) = fence.read(&c, "row").await.unwrap() {
                    assert!(t.get() >= last, "the fence went backwards: {last} then {}", t.get());
                    assert_eq!(v, format!("w{}", t.get()), "the value is not the one written with its token");
                    last = t.get();
                    reads += 1;
                }
            }
            reads
        })
    };
    let mut tokens: Vec<u64> = (1..=400).collect();
    for i in (1..tokens.len()).rev() {
        tokens.swap(i, rand::random_range(0..=i));
    }
    let writers = tokens.chunks(50).map(|chunk| {
        let (fence, url, chunk) = (fence.clone(), pg.url(), chunk.to_vec());
        tokio::spawn(async move {
            let c = connect(&url).await.unwrap();
            let mut applied = Vec::new();
            for t in chunk {
                if fence.write(&c, "row", &format!("w{t}"), tok(t)).await.unwrap() == WriteOutcome::Applied {
                    applied.push(t);
                }
            }
            applied
        })
    });
    let applied: Vec<Vec<u64>> = futures::future::try_join_all(writers).await.unwrap();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let reads = reader.await.unwrap();
    let c = connect(&pg.url()).await.unwrap();
    assert_eq!(fence.read(&c, "row").await.unwrap(), Some(("w400".into(), tok(400))));
    let all: Vec<u64> = applied.iter().flatten().copied().collect();
    assert!(all.contains(&400), "the highest token was refused: {all:?}");
    // Each writer's applied tokens rise, and fewer than all writes applied (they raced).
    assert!(applied.iter().all(|a| a.windows(2).all(|w| w[0] < w[1])), "{applied:?}");
    assert!(all.len() < 400, "every write applied: the fence refused nothing");
    assert!(reads > 0, "the reader never saw the row");
}

#[tokio::test]
async fn the_pause_kit_passes_against_the_postgresql_reference_fence() {
    let pg = PostgresProcess::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let st = Stack::builder("pg-pause")
        .envoy_config("lock-tier")
        .arbiter_extra_yaml(key.arbiter_yaml())
        .start()
        .await
        .unwrap();
    let cert = st.pki().client("payments", "pausekit").unwrap();
    let out = dir.path().join("pg.yaml");
    let status = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(pausekit_bin().unwrap())
            .arg("run")
            .args(["--lock-url", &format!("https://localhost:{}", st.envoy().listener_port())])
            .arg("--ca")
            .arg(st.pki().ca_cert_path())
            .arg("--cert")
            .arg(&cert.cert_path)
            .arg("--key")
            .arg(&cert.key_path)
            .args(["--lock-key", "short/pg1", "--resource-url", &pg.url(), "--pg-table", "pause_items"])
            .arg("--out")
            .arg(&out)
            .status(),
    )
    .await
    .expect("the pause kit finishes within 60 s")
    .unwrap();
    let doc: lockmesh_core::pause::PauseTestResult =
        serde_saphyr::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(status.code(), Some(0), "{doc:#?}");
    assert_eq!(doc.verdict, Verdict::Pass);
    assert_eq!((doc.evidence.first_write_status, doc.evidence.second_write_status), (200, 200), "{doc:#?}");
    assert_eq!(doc.evidence.late_write_status, 409, "the statement refused the late write: {doc:#?}");
    assert!(doc.evidence.paused_ms > doc.evidence.ttl_s * 1000);
    assert!(doc.resource.starts_with("postgresql reference fence postgres://127.0.0.1:"), "{}", doc.resource);
    assert!(!doc.resource.contains("lockmesh@"), "credentials in the document: {}", doc.resource);
    // The row holds the second holder's write with its (greater) token.
    let c = connect(&pg.url()).await.unwrap();
    let table = PgFence::try_new("pause_items", EqualRule::Strict).unwrap();
    let (value, _) = table.read(&c, "short/pg1").await.unwrap().unwrap();
    assert!(value.ends_with("-second"), "{value}");
}
