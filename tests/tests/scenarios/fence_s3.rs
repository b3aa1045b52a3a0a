//! The S3 reference fence (`lockmesh_fence_proxy::store::s3`) against a real
//! S3-compatible server: moto 5.2.5, started by the harness (`lockmesh_tests::s3`)
//! serving one request at a time, which gives its conditional writes the atomicity
//! real S3 promises. Current tokens write, stale ones are refused, equal per rule;
//! the ABA case (a newer holder rewriting the same bytes); deletes are fenced
//! tombstones; concurrent writers never move the fence backwards; and the pause kit
//! passes on an `s3://` resource. Each property has a planted twin
//! (`PlantedFault`, feature `test-faults`) that fails it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockmesh_core::{
    pause::{check_pause_result, PauseTestResult, Verdict},
    FencingToken,
};
use lockmesh_fence_proxy::{
    route::EqualRule,
    store::s3::{Credentials, PlantedFault, Prepare, S3Client, S3Fence, WriteOutcome},
};
use lockmesh_tests::{
    fence::{ensure_signing_key, pausekit_bin},
    s3::{MotoServer, TEST_ACCESS_KEY, TEST_REGION, TEST_SECRET_KEY},
    Stack,
};

fn tok(v: u64) -> FencingToken {
    FencingToken::from_packed(v).unwrap()
}

fn fence(moto: &MotoServer, bucket: &str, equal: EqualRule) -> S3Fence {
    let creds = Credentials::new(TEST_ACCESS_KEY, TEST_SECRET_KEY, None);
    S3Fence::try_new(S3Client::new(&moto.endpoint(), TEST_REGION, creds).unwrap(), bucket, equal).unwrap()
}

async fn raw_etag(moto: &MotoServer, bucket: &str, key: &str) -> String {
    moto.client().get(bucket, key).await.unwrap().unwrap().etag.unwrap()
}

fn ready(p: Prepare) -> lockmesh_fence_proxy::store::s3::Prepared {
    match p {
        Prepare::Ready(p) => p,
        Prepare::Stale => panic!("the token did not pass the check"),
    }
}

#[tokio::test]
async fn current_tokens_write_stale_are_refused_and_equal_follows_the_rule() {
    let moto = MotoServer::start().await.unwrap();
    moto.create_bucket("items").await.unwrap();
    let strict = fence(&moto, "items", EqualRule::Strict);
    let allow = fence(&moto, "items", EqualRule::Allow);
    for (f, k) in [(&strict, "s/r"), (&allow, "a/r")] {
        assert_eq!(f.write(k, b"v10", tok(10)).await.unwrap(), WriteOutcome::Applied);
        assert_eq!(f.write(k, b"v9", tok(9)).await.unwrap(), WriteOutcome::Stale, "{k}");
        assert_eq!(f.read(k).await.unwrap(), Some((b"v10".to_vec(), tok(10))));
        // The object is the envelope: the token is in its bytes.
        let raw = moto.client().get("items", k).await.unwrap().unwrap();
        assert_eq!(raw.text(), "lockmesh-fence/1 token=10 live\nv10");
    }
    // Equal: strict refuses, allow writes and keeps the token.
    assert_eq!(strict.write("s/r", b"again", tok(10)).await.unwrap(), WriteOutcome::Stale);
    assert_eq!(strict.read("s/r").await.unwrap(), Some((b"v10".to_vec(), tok(10))));
    assert_eq!(allow.write("a/r", b"again", tok(10)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(allow.read("a/r").await.unwrap(), Some((b"again".to_vec(), tok(10))));
    // Higher tokens advance both; keys are independent; a missing key reads None.
    for (f, k) in [(&strict, "s/r"), (&allow, "a/r")] {
        assert_eq!(f.write(k, b"v11", tok(11)).await.unwrap(), WriteOutcome::Applied);
        assert_eq!(f.read(k).await.unwrap(), Some((b"v11".to_vec(), tok(11))));
    }
    assert_eq!(strict.write("s/other", b"v1", tok(1)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(strict.read("s/missing").await.unwrap(), None);
    // The largest token lockmesh can mint round-trips.
    let max =
        FencingToken::mint(lockmesh_core::token::EPOCH_LIMIT - 1, lockmesh_core::token::REVISION_LIMIT - 1).unwrap();
    assert_eq!(strict.write("s/r", b"max", max).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(strict.read("s/r").await.unwrap(), Some((b"max".to_vec(), max)));
    // An object written around the fence is refused, not overwritten.
    assert_eq!(moto.client().put("items", "s/plain", b"no envelope", &[]).await.unwrap().status, 200);
    let e = strict.write("s/plain", b"v", tok(99)).await.unwrap_err();
    assert_eq!(e.code(), "not_enveloped", "{e}");
    assert_eq!(moto.client().get("items", "s/plain").await.unwrap().unwrap().text(), "no envelope");
    // A missing bucket is an error with S3's code, not "no object".
    let e = fence(&moto, "no-such-bucket", EqualRule::Strict).write("k", b"v", tok(1)).await.unwrap_err();
    assert_eq!(e.code(), "store_error");
    assert!(e.to_string().contains("404 NoSuchBucket"), "{e}");
}

#[tokio::test]
async fn every_fenced_request_passes_moto_s_sigv4_check_and_a_wrong_secret_is_refused() {
    let moto = MotoServer::start().await.unwrap();
    moto.create_bucket("signed").await.unwrap();
    let (id, secret) = moto.enforce_signatures().await.unwrap();
    let signed = |secret: &str| {
        let client = S3Client::new(&moto.endpoint(), TEST_REGION, Credentials::new(&id, secret, None)).unwrap();
        S3Fence::try_new(client, "signed", EqualRule::Strict).unwrap()
    };
    let f = signed(&secret);
    // Ranged GETs, If-None-Match and If-Match PUTs, reads, tombstones; a key
    // that needs URI encoding.
    let key = "dir/a b+\u{e9}~(1).txt";
    assert_eq!(f.write(key, b"v5", tok(5)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(f.write(key, b"v6", tok(6)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(f.write(key, b"v4", tok(4)).await.unwrap(), WriteOutcome::Stale);
    assert_eq!(f.read(key).await.unwrap(), Some((b"v6".to_vec(), tok(6))));
    assert_eq!(f.delete(key, tok(7)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(f.read(key).await.unwrap(), None);
    // Positive control: moto does check. A wrong secret, and the unsigned test
    // client, are refused.
    let e = signed("not-the-secret").write("other", b"v", tok(1)).await.unwrap_err();
    assert_eq!(e.code(), "store_error");
    assert!(e.to_string().contains("403 SignatureDoesNotMatch"), "{e}");
    let e = moto.client().get("signed", "other").await.unwrap_err().to_string();
    assert!(e.contains("answered 403"), "{e}");
}

#[tokio::test]
async fn a_newer_holder_rewriting_the_same_bytes_does_not_let_the_stale_holders_if_match_pass() {
    let moto = MotoServer::start().await.unwrap();
    moto.create_bucket("aba").await.unwrap();
    // The envelope fence, then the planted one that keeps the token in metadata.
    for planted in [false, true] {
        let mut f = fence(&moto, "aba", EqualRule::Strict);
        if planted {
            f = f.planted(PlantedFault::TokenInMetadata);
        }
        let key = if planted { "planted" } else { "envelope" };
        assert_eq!(f.write(key, b"same", tok(5)).await.unwrap(), WriteOutcome::Applied);
        let before = raw_etag(&moto, "aba", key).await;
        // Holder A (token 10) reads the object and checks its token, then stalls.
        let a = ready(f.prepare(key, tok(10)).await.unwrap());
        // Holder B (token 20) writes the same bytes meanwhile.
        assert_eq!(f.write(key, b"same", tok(20)).await.unwrap(), WriteOutcome::Applied);
        let after = raw_etag(&moto, "aba", key).await;
        // A's conditional PUT carries the ETag it read.
        let late = f.commit(a, Some(b"same")).await.unwrap();
        let stored = f.read(key).await.unwrap().unwrap();
        if planted {
            // The hole: the bytes are the same, so is the ETag, and A's stale
            // write lands over B's, moving the token back.
            assert_eq!(before, after, "the planted fence's ETag changed");
            assert_eq!(late, WriteOutcome::Applied);
            assert_eq!(stored.1, tok(10));
        } else {
            assert_ne!(before, after, "the envelope's ETag did not change with the token");
            assert_eq!(late, WriteOutcome::Stale, "the stale holder's If-Match passed");
            assert_eq!(stored, (b"same".to_vec(), tok(20)));
        }
    }
}

#[tokio::test]
async fn a_write_prepared_before_a_newer_holder_is_refused_at_its_put_and_lands_without_the_condition() {
    let moto = MotoServer::start().await.unwrap();
    moto.create_bucket("window").await.unwrap();
    for planted in [false, true] {
        let mut f = fence(&moto, "window", EqualRule::Strict);
        if planted {
            f = f.planted(PlantedFault::OmitCondition);
        }
        let (key, fresh) = if planted { ("planted", "planted-new") } else { ("fenced", "fenced-new") };
        assert_eq!(f.write(key, b"v5", tok(5)).await.unwrap(), WriteOutcome::Applied);
        let a = ready(f.prepare(key, tok(10)).await.unwrap());
        assert_eq!(f.write(key, b"v20", tok(20)).await.unwrap(), WriteOutcome::Applied);
        let late = f.commit(a, Some(b"v10")).await.unwrap();
        // The first write of a key: If-None-Match. A holder that found no object
        // loses to the one that created it meanwhile.
        let b = ready(f.prepare(fresh, tok(10)).await.unwrap());
        assert_eq!(f.write(fresh, b"v30", tok(30)).await.unwrap(), WriteOutcome::Applied);
        let late_first = f.commit(b, Some(b"v10")).await.unwrap();
        if planted {
            assert_eq!((late, late_first), (WriteOutcome::Applied, WriteOutcome::Applied));
            assert_eq!(f.read(key).await.unwrap(), Some((b"v10".to_vec(), tok(10))));
            assert_eq!(f.read(fresh).await.unwrap(), Some((b"v10".to_vec(), tok(10))));
        } else {
            assert_eq!((late, late_first), (WriteOutcome::Stale, WriteOutcome::Stale));
            assert_eq!(f.read(key).await.unwrap(), Some((b"v20".to_vec(), tok(20))));
            assert_eq!(f.read(fresh).await.unwrap(), Some((b"v30".to_vec(), tok(30))));
        }
    }
}

#[tokio::test]
async fn deletes_are_fenced_tombstones_that_keep_the_token() {
    let moto = MotoServer::start().await.unwrap();
    moto.create_bucket("del").await.unwrap();
    let f = fence(&moto, "del", EqualRule::Strict);
    assert_eq!(f.write("k", b"v10", tok(10)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(f.delete("k", tok(5)).await.unwrap(), WriteOutcome::Stale);
    assert_eq!(f.read("k").await.unwrap(), Some((b"v10".to_vec(), tok(10))));
    assert_eq!(f.delete("k", tok(20)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(f.read("k").await.unwrap(), None);
    let st = f.state("k").await.unwrap().unwrap();
    assert!(st.deleted && st.token == tok(20), "{st:?}");
    assert_eq!(moto.client().get("del", "k").await.unwrap().unwrap().text(), "lockmesh-fence/1 token=20 deleted\n");
    // A stale holder cannot bring the object back; a newer one can.
    assert_eq!(f.write("k", b"v15", tok(15)).await.unwrap(), WriteOutcome::Stale);
    assert_eq!(f.read("k").await.unwrap(), None);
    // A delete prepared before a newer write is refused at its PUT.
    let d = ready(f.prepare("k", tok(25)).await.unwrap());
    assert_eq!(f.write("k", b"v30", tok(30)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(f.commit(d, None).await.unwrap(), WriteOutcome::Stale);
    assert_eq!(f.read("k").await.unwrap(), Some((b"v30".to_vec(), tok(30))));
    // A key that never existed gets a tombstone too.
    assert_eq!(f.delete("never", tok(40)).await.unwrap(), WriteOutcome::Applied);
    assert_eq!(f.write("never", b"v39", tok(39)).await.unwrap(), WriteOutcome::Stale);

    // Why not a conditional DeleteObject: moto honours If-Match on it, but the
    // deleted object forgets its token and a stale holder then creates the key.
    let c = moto.client();
    assert_eq!(c.delete("del", "k", &[("if-match", "\"0000\"")]).await.unwrap().status, 412);
    let etag = raw_etag(&moto, "del", "k").await;
    assert_eq!(c.delete("del", "k", &[("if-match", &etag)]).await.unwrap().status, 204);
    assert_eq!(f.write("k", b"stale", tok(1)).await.unwrap(), WriteOutcome::Applied);
}

#[tokio::test]
async fn concurrent_writers_never_move_the_fence_backwards_and_the_highest_token_wins() {
    let moto = MotoServer::start().await.unwrap();
    moto.create_bucket("race").await.unwrap();
    let f = Arc::new(fence(&moto, "race", EqualRule::Strict));
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (f, done) = (f.clone(), done.clone());
        tokio::spawn(async move {
            let (mut last, mut reads) = (0u64, 0u32);
            while !done.load(Ordering::SeqCst) {
                if let Some((v, t)) = f.read("row").await.unwrap() {
                    assert!(t.get() >= last, "the fence went backwards: {last} then {}", t.get());
                    assert_eq!(
                        v,
                        format!("w{}", t.get()).into_bytes(),
                        "the value is not the one written with its token"
                    );
                    last = t.get();
                    reads += 1;
                }
            }
            reads
        })
    };
    // 8 writers race with shuffled tokens 1..=200.
    let mut tokens: Vec<u64> = (1..=200).collect();
    for i in (1..tokens.len()).rev() {
        tokens.swap(i, rand::random_range(0..=i));
    }
    let writers = tokens.chunks(25).map(|chunk| {
        let (f, chunk) = (f.clone(), chunk.to_vec());
        tokio::spawn(async move {
            let mut applied = Vec::new();
            for t in chunk {
                if f.write("row", format!("w{t}").as_bytes(), tok(t)).await.unwrap() == WriteOutcome::Applied {
                    applied.push(t);
                }
            }
            applied
        })
    });
    let applied: Vec<Vec<u64>> = futures::future::try_join_all(writers).await.unwrap();
    done.store(true, Ordering::SeqCst);
    let reads = reader.await.unwrap();
    assert_eq!(f.read("row").await.unwrap(), Some((b"w200".to_vec(), tok(200))));
    let all: Vec<u64> = applied.iter().flatten().copied().collect();
    assert!(all.contains(&200), "the highest token was refused: {all:?}");
    assert!(applied.iter().all(|a| a.windows(2).all(|w| w[0] < w[1])), "{applied:?}");
    // Fewer than all writes applied: they raced, and the fence refused some.
    assert!(all.len() < 200, "every write applied: the fence refused nothing");
    assert!(reads > 0, "the reader never saw the row");
}

async fn run_kit(
    st: &Stack,
    moto: &MotoServer,
    resource: &str,
    lock_key: &str,
    planted: Option<&str>,
    out: &std::path::Path,
) -> (i32, PauseTestResult) {
    let cert = st.pki().client("payments", "pausekit").unwrap();
    let mut cmd = tokio::process::Command::new(pausekit_bin().unwrap());
    cmd.arg("run")
        .args(["--lock-url", &format!("https://localhost:{}", st.envoy().listener_port())])
        .arg("--ca")
        .arg(st.pki().ca_cert_path())
        .arg("--cert")
        .arg(&cert.cert_path)
        .arg("--key")
        .arg(&cert.key_path)
        .args(["--lock-key", lock_key, "--resource-url", resource])
        .arg("--out")
        .arg(out)
        .envs(moto.aws_env());
    if let Some(p) = planted {
        cmd.args(["--s3-planted-fault", p]);
    }
    let status = tokio::time::timeout(Duration::from_secs(60), cmd.status())
        .await
        .expect("the pause kit finishes within 60 s")
        .unwrap();
    let doc: PauseTestResult = serde_saphyr::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    (status.code().unwrap_or(-1), doc)
}

#[tokio::test]
async fn the_pause_kit_passes_on_the_s3_fence_and_fails_when_the_put_omits_the_condition() {
    let moto = MotoServer::start().await.unwrap();
    moto.create_bucket("pause").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key = ensure_signing_key(dir.path()).unwrap();
    let st = Stack::builder("s3-pause")
        .envoy_config("lock-tier")
        .arbiter_extra_yaml(key.arbiter_yaml())
        .start()
        .await
        .unwrap();
    let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let f = fence(&moto, "pause", EqualRule::Allow);

    // The fence: the holder, frozen between its check and its PUT, is refused.
    let out = dir.path().join("s3.yaml");
    let (code, doc) = run_kit(&st, &moto, "s3://pause/kit", "short/s3a", None, &out).await;
    assert_eq!(code, 0, "{doc:#?}");
    assert_eq!(doc.verdict, Verdict::Pass);
    assert_eq!((doc.evidence.first_write_status, doc.evidence.second_write_status), (200, 200), "{doc:#?}");
    assert_eq!(doc.evidence.late_write_status, 409, "the conditional PUT refused the late write: {doc:#?}");
    assert!(doc.evidence.paused_ms > doc.evidence.ttl_s * 1000);
    assert!(
        doc.evidence.steps.iter().any(|s| s.contains("checked its token") && s.contains(": ready;")),
        "the holder was not frozen between its check and its PUT: {:#?}",
        doc.evidence.steps
    );
    assert_eq!(doc.resource, format!("s3 conditional-put fence {} bucket pause object kit/short/s3a", moto.endpoint()));
    assert_eq!(check_pause_result(&doc, "short", now()), Ok(()));
    let (value, _) = f.read("kit/short/s3a").await.unwrap().unwrap();
    assert!(value.ends_with(b"-second"), "{}", String::from_utf8_lossy(&value));

    // Planted: the same fence whose PUTs carry no If-Match. The late write lands.
    let out = dir.path().join("planted.yaml");
    let (code, doc) = run_kit(&st, &moto, "s3://pause/kit", "short/s3b", Some("omit-condition"), &out).await;
    assert_eq!(code, 1, "{doc:#?}");
    assert_eq!(doc.verdict, Verdict::Fail);
    assert_eq!(doc.evidence.late_write_status, 200, "{doc:#?}");
    assert!(doc.evidence.resource_saw_late_write, "{doc:#?}");
    assert!(check_pause_result(&doc, "short", now()).is_err());
    let (value, _) = f.read("kit/short/s3b").await.unwrap().unwrap();
    assert!(value.ends_with(b"-late"), "{}", String::from_utf8_lossy(&value));
}
