//! Issue 21 item 2: the jeopardy signal (Chubby's jeopardy and grace period), on
//! real etcd, arbiter and Envoy. Between a holder's first failed keepalive and its
//! fence deadline its session is in jeopardy; an acknowledged keepalive before the
//! deadline ends it (recovery), the deadline ends it in the fence.
//!
//! - The SDK tells the jeopardy callback when it starts and when it recovers, and
//!   the guard's state says it; a cut that ends before the deadline is no fence, a
//!   longer one is told as jeopardy first, then as the fence.
//! - `lockctl run` keeps `LOCKMESH_JEOPARDY_FILE` in existence exactly while the
//!   lock is in jeopardy (and once it is lost), and sends the signal the user asked
//!   for at each change; without `--jeopardy-signal` a command with no handler
//!   lives through jeopardy.
//! - The arbiter's `lockmesh_arbiter_vm_sessions_in_jeopardy{etcd_cluster}` counts
//!   transparent VM sessions whose renewal failed while their etcd cluster is cut,
//!   and falls back to 0 when the cluster answers again.
//!
//! The cuts are SIGSTOPs (Envoy for the SDK, the etcd member for the VM
//! sessions). The `payments/jeo` class has a 6 s TTL: a keepalive every 2 s,
//! each failing after 1 s without an answer, the fence deadline 5 s after the
//! last acknowledged send (margin 1 s), so jeopardy lasts about 2 s before it.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use lockmesh_client::{Client, HoldState, LockOptions, LossReason};
use lockmesh_tests::{backend::DELAY_HEADER, Stack};
use tokio::time::{sleep, Instant};

use super::sdk::{config, lockctl_run};

/// The default test registry and the 6 s class.
fn registry() -> String {
    format!(
        "{}  - name: jeo\n    prefixes: [\"payments/jeo\"]\n    ttl_s: 6\n    enforcement: advisory\n    risk_owner: lockmesh-tests\n    waiver_expiry: \"2099-12-31\"\n",
        lockmesh_tests::DEFAULT_TEST_REGISTRY
    )
}

/// What the SDK told, in order.
type Told = Arc<Mutex<Vec<(Instant, String)>>>;

/// Polls `check` every 20 ms until it holds; panics after `within`.
async fn until(within: Duration, what: &str, mut check: impl FnMut() -> bool) -> Instant {
    let end = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < end, "{what}: not within {within:?}");
        sleep(Duration::from_millis(20)).await;
    }
    Instant::now()
}

fn kinds(told: &Told) -> Vec<String> {
    told.lock().unwrap().iter().map(|(_, k)| k.clone()).collect()
}

#[tokio::test]
async fn an_sdk_holder_passes_through_jeopardy_before_its_fence_and_a_short_cut_clears_it() {
    let st = Stack::builder("jeo-sdk").envoy_config("lock-tier").registry(registry()).start().await.unwrap();
    let told = Told::default();
    let (on_fence, on_jeopardy) = (told.clone(), told.clone());
    let client = Client::with_jeopardy(
        config(&st, "payments", "jeo"),
        move |f| on_fence.lock().unwrap().push((Instant::now(), format!("fence {}", f.reason))),
        move |j| {
            assert!(j.remaining > Duration::ZERO, "told with no time left: {j:?}");
            let what = format!("{} {}", j.state, j.keys.join(","));
            on_jeopardy.lock().unwrap().push((Instant::now(), what));
        },
    )
    .unwrap();
    let k = "payments/jeo/sdk";
    let g = client.lock(k, LockOptions::default()).await.unwrap();
    assert_eq!((g.ttl(), g.state()), (Duration::from_secs(6), HoldState::Safe));
    let clock = || client.sessions()[0].clock;
    until(Duration::from_secs(6), "a keepalive acknowledged", || clock().acked >= 1).await;

    // A cut shorter than the time left: Envoy stops until jeopardy is told, then
    // answers again.
    st.envoy().pause().unwrap();
    let cut = Instant::now();
    let entered = until(Duration::from_secs(6), "jeopardy told", || !kinds(&told).is_empty()).await;
    let old_deadline = clock().deadline;
    let (state, can_start, remaining) = (g.state(), g.can_start(), g.remaining_ttl());
    st.envoy().resume().unwrap();
    assert_eq!(kinds(&told), vec![format!("jeopardy {k}")]);
    assert_eq!((state, can_start), (HoldState::Jeopardy, false), "the guard did not say jeopardy");
    assert!(remaining > Duration::ZERO && clock().failed >= 1);
    let recovered = until(Duration::from_secs(4), "recovery told", || kinds(&told).len() >= 2).await;
    assert_eq!(kinds(&told), vec![format!("jeopardy {k}"), format!("safe {k}")]);
    assert!(recovered < old_deadline, "recovered after the deadline it was in jeopardy for");
    assert_eq!((g.state(), g.can_start()), (HoldState::Safe, true));
    // Past the deadline the cut threatened, nothing more is told: no fence.
    tokio::time::sleep_until(old_deadline + Duration::from_millis(500)).await;
    assert_eq!(kinds(&told).len(), 2, "{:?}", kinds(&told));
    assert_eq!(g.lost(), None);
    let short = (entered - cut, recovered - entered);

    // A cut past the deadline: jeopardy first, then the fence, once each.
    st.envoy().pause().unwrap();
    let cut = Instant::now();
    until(Duration::from_secs(10), "the fence", || kinds(&told).len() >= 4).await;
    st.envoy().resume().unwrap();
    let t = told.lock().unwrap().clone();
    assert_eq!(
        t.iter().map(|(_, w)| w.as_str()).collect::<Vec<_>>(),
        [format!("jeopardy {k}"), format!("safe {k}"), format!("jeopardy {k}"), "fence deadline".into()],
        "jeopardy must be told before the fence"
    );
    assert!(t[2].0 < t[3].0);
    assert_eq!(g.state(), HoldState::Lost(LossReason::Deadline));
    sleep(Duration::from_millis(300)).await;
    assert_eq!(kinds(&told).len(), 4, "told after the fence: {:?}", kinds(&told));
    eprintln!(
        "jeopardy figures: short cut: jeopardy {:?} after it, recovery {:?} later; long cut: jeopardy {:?} and fence {:?} after it",
        short.0,
        short.1,
        t[2].0 - cut,
        t[3].0 - cut
    );
}

/// The lines a command wrote to `out`.
fn lines(out: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(out).unwrap_or_default().lines().map(str::to_owned).collect()
}

/// A command that records its jeopardy file's path, every change of its existence
/// (polled every 50 ms) and, with `trap`, what the file said when a signal came,
/// until `stop` exists.
fn recorder(out: &std::path::Path, stop: &std::path::Path, trap: &str) -> String {
    format!(
        r#"F="$LOCKMESH_JEOPARDY_FILE"; O={o}
{trap}
trap 'echo "term $(cat "$F" 2>/dev/null)" >> $O; exit 42' TERM
echo "start $F" > $O
prev=
while [ ! -e {stop} ]; do
  if [ -e "$F" ]; then now=present; else now=absent; fi
  if [ "$now" != "$prev" ]; then echo "file $now" >> $O; prev=$now; fi
  sleep 0.05
done
exit 0"#,
        o = out.display(),
        stop = stop.display(),
    )
}

#[tokio::test]
async fn lockctl_run_tells_its_command_of_jeopardy_by_file_and_only_by_the_signal_asked_for() {
    let st = Stack::builder("jeo-run").envoy_config("lock-tier").registry(registry()).start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (out, stop) = (dir.path().join("out"), dir.path().join("stop"));

    // 1. --jeopardy-signal USR1, a short cut: the file exists while in jeopardy,
    //    the signal comes at its start (file there) and at recovery (file gone).
    let trap = format!(
        r#"trap 'if [ -e "$F" ]; then echo "usr1 $(cat "$F")" >> {o}; else echo "usr1 none" >> {o}; fi' USR1"#,
        o = out.display()
    );
    let script = recorder(&out, &stop, &trap);
    let child =
        lockctl_run(&st, "jeo-sig", "payments/jeo/run-sig", &["--jeopardy-signal", "USR1"], &script).spawn().unwrap();
    until(Duration::from_secs(10), "the command started", || lines(&out).len() >= 2).await;
    let path = std::path::PathBuf::from(lines(&out)[0].strip_prefix("start ").unwrap());
    let private = path.parent().unwrap().to_owned();
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&private).unwrap().permissions().mode() & 0o777, 0o700, "{path:?}");
    }
    assert_eq!(lines(&out)[1..], ["file absent"], "jeopardy before any cut");
    st.envoy().pause().unwrap();
    let cut = Instant::now();
    let seen =
        until(Duration::from_secs(6), "the signal in jeopardy", || lines(&out).iter().any(|l| l.starts_with("usr1")))
            .await;
    st.envoy().resume().unwrap();
    until(Duration::from_secs(4), "the signal at recovery", || {
        lines(&out).iter().filter(|l| l.starts_with("usr1")).count() >= 2
    })
    .await;
    until(Duration::from_secs(2), "the file gone", || lines(&out).last().is_some_and(|l| l == "file absent")).await;
    let recovered = Instant::now();
    std::fs::write(&stop, "").unwrap();
    let o = tokio::time::timeout(Duration::from_secs(5), child.wait_with_output()).await.unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    let l = lines(&out);
    assert_eq!(o.status.code(), Some(0), "{stderr}\n{l:?}");
    assert!(!stderr.contains("lock lost"), "{stderr}");
    assert!(stderr.contains("in jeopardy") && stderr.contains("jeopardy is over"), "{stderr}");
    let signals: Vec<&str> = l.iter().filter(|l| l.starts_with("usr1")).map(String::as_str).collect();
    assert_eq!(signals, ["usr1 jeopardy", "usr1 none"], "the file at each signal: {l:?}");
    let files: Vec<&str> = l.iter().filter(|l| l.starts_with("file")).map(String::as_str).collect();
    assert_eq!(files, ["file absent", "file present", "file absent"], "{l:?}");
    assert!(!private.exists(), "the private directory outlived lockctl");
    eprintln!(
        "jeopardy figures: lockctl run: the jeopardy signal seen {:?} after the cut, the file gone {:?} after that",
        seen - cut,
        recovered - seen
    );

    // 2. No --jeopardy-signal, a cut past the deadline: a command with no handler
    //    but TERM's lives through jeopardy (file there), then gets SIGTERM at the
    //    fence with the file saying so.
    let (out, stop) = (dir.path().join("out2"), dir.path().join("stop2"));
    let script = recorder(&out, &stop, "");
    let child = lockctl_run(&st, "jeo-quiet", "payments/jeo/run-quiet", &[], &script).spawn().unwrap();
    until(Duration::from_secs(10), "the command started", || lines(&out).len() >= 2).await;
    st.envoy().pause().unwrap();
    let o = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output()).await.unwrap().unwrap();
    st.envoy().resume().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    let l = lines(&out);
    assert_eq!(o.status.code(), Some(42), "not ended by SIGTERM at the fence: {stderr}\n{l:?}");
    assert_eq!(l[1..], ["file absent", "file present", "term lost deadline"], "{stderr}");
    assert!(stderr.contains("in jeopardy") && stderr.contains("lock lost (deadline)"), "{stderr}");
}

/// `lockmesh_arbiter_vm_sessions_in_jeopardy{etcd_cluster="coord"}` and the
/// whole exposition. While etcd is cut a scrape takes the arbiter's etcd call
/// timeout (`/metrics` reads the class policies), hence the long wait.
async fn vm_jeopardy(st: &Stack) -> (u64, String) {
    let port = st.arbiter(0).admin_port();
    let r = lockmesh_tests::probe::http_get_within(port, "/metrics", Duration::from_secs(15)).await.unwrap();
    let (status, body) = (r.status, r.body);
    assert_eq!(status, 200, "{body}");
    let series = "lockmesh_arbiter_vm_sessions_in_jeopardy{etcd_cluster=\"coord\"} ";
    let n = body.lines().find_map(|l| l.strip_prefix(series)).unwrap_or_else(|| panic!("no {series}in:\n{body}"));
    (n.trim().parse().unwrap(), body)
}

/// `lockmesh_arbiter_requests_total{route="vm_keepalive",code="ok"}`.
async fn vm_keepalives(st: &Stack) -> u64 {
    let (_, body) = st.arbiter(0).admin_get("/metrics").await.unwrap();
    let series = "lockmesh_arbiter_requests_total{route=\"vm_keepalive\",code=\"ok\"} ";
    body.lines().find_map(|l| l.strip_prefix(series)).map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn the_vm_jeopardy_gauge_rises_while_the_cluster_is_cut_and_falls_when_it_answers() {
    let st = Stack::builder("jeo-vm").envoy_config("inbound-sidecar").own_etcd(1).start().await.unwrap();
    let worker = st.client("payments", "worker").unwrap();
    // A transparent request holding its key (default class, TTL 15 s: renewed
    // every 5 s) at the upstream through the whole test.
    let key = "payments/jeo-vm-4417";
    let first = tokio::spawn({
        let w = worker.clone();
        async move { w.post("/jobs/1", &[("x-lock-key", key), (DELAY_HEADER, "60000")]).await }
    });
    let token = lockmesh_tests::assert_eventually!(10, async || {
        let seen = st.backend().requests();
        anyhow::ensure!(seen.len() == 1, "the request is not at the upstream yet");
        Ok(seen[0].header("x-lock-token").unwrap().to_owned())
    });
    let mut etcd = st.etcd().client().await.unwrap();
    let vms = etcd
        .get(format!("{}/v/", st.root()), Some(etcd_client::GetOptions::new().with_prefix().with_keys_only()))
        .await
        .unwrap();
    let vm_keys: Vec<String> = vms.kvs().iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect();
    assert_eq!(vm_keys.len(), 1, "{vm_keys:?}");
    // The VM's session renewed by the arbiter (so it knows it), the last time
    // just now; the next renewal is due 5 s later. Cut etcd shortly before it, so
    // the gauge has most of the TTL to show jeopardy in before the lease could lapse.
    let before = vm_keepalives(&st).await;
    let renewed =
        until_async(Duration::from_secs(12), "a VM keepalive", async || vm_keepalives(&st).await > before).await;
    assert_eq!(vm_jeopardy(&st).await.0, 0, "in jeopardy before any cut");
    sleep(Duration::from_secs(3)).await;

    st.etcd().member(0).pause().unwrap();
    let cut = Instant::now();
    let mut during = String::new();
    let rose = until_async(Duration::from_secs(15), "the gauge rises while etcd is cut", async || {
        let (n, body) = vm_jeopardy(&st).await;
        during = body;
        n >= 1
    })
    .await;
    st.etcd().member(0).resume().unwrap();
    let resumed = Instant::now();
    let (n, _) = vm_jeopardy(&st).await;
    assert_eq!(n, 1, "one VM session is in jeopardy");
    // It falls by recovery: before the TTL (15 s) since that last renewal runs out,
    // which would also clear it (the lease is gone by then).
    let lapse = renewed + Duration::from_secs(14);
    let fell = until_async(lapse - Instant::now(), "the gauge falls once etcd answers", async || {
        vm_jeopardy(&st).await.0 == 0
    })
    .await;
    // The hold is still there, so a second request of its key is refused while the
    // first is at the upstream.
    let r = worker.post("/jobs/2", &[("x-lock-key", key), ("x-lock-wait-ms", "0")]).await.unwrap();
    assert_eq!((r.code(), r.header("x-lockmesh-error")), (409, Some("contended")), "{}", r.body);
    assert!(!first.is_finished(), "the first request ended");
    first.abort();

    // The exposition with the gauge up passes promtool and carries no key, token,
    // VM id or session.
    super::observability::promtool_check(&["metrics"], Some(&during));
    let vm = vm_keys[0].strip_prefix(&format!("{}/v/", st.root())).unwrap().split('/').next().unwrap().to_owned();
    for secret in [key, token.as_str(), vm.as_str()] {
        assert!(!during.contains(secret), "{secret:?} in the arbiter's metrics");
    }
    eprintln!(
        "jeopardy figures: VM gauge up {:?} after the etcd cut, back to 0 {:?} after etcd resumed",
        rose - cut,
        fell - resumed
    );
}

/// Polls the async `check` every 100 ms until it holds; panics after `within`.
async fn until_async(within: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) -> Instant {
    let end = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < end, "{what}: not within {within:?}");
        sleep(Duration::from_millis(100)).await;
    }
    Instant::now()
}
