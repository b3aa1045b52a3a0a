//! The release gate's Python and Go holders (docs/GATE.md "What runs"): the SDK
//! holders' loop through each language's SDK, by its conformance driver
//! (`lockmesh-gate holder --driver`). A short history of them beside a raw and a
//! Rust SDK holder on two fenced keys, each stopped past its TTL once, passes with
//! their claims and fenced writes in it; and the Python SDK's planted fault
//! (`deadline_from_answer`) under a stop that makes it matter is caught by
//! `sdk_deadline_conservative`, its control passing.

use std::time::Duration;

use lockmesh_gate::faultproxy::{FaultProxy, LinkMode};
use lockmesh_gate::harness::{GateCluster, GateOptions, MULTI_PREFIX};
use lockmesh_gate::history::{now_us, ClientOp, Outcome};
use lockmesh_gate::polyglot::Lang;
use lockmesh_gate::{History, Verdict};
use tokio::time::Instant;

/// One member, one arbiter, one Envoy, no workload of its own.
fn small(name: &str) -> GateOptions {
    GateOptions {
        members: 1,
        arbiters: 1,
        envoys: 1,
        clock_steps: false,
        mutex_keys: 0,
        sem_keys: 0,
        durable_keys: 0,
        sdk_holders: 0,
        durable_holders: 0,
        transparent_holders: 0,
        rw_holders: 0,
        campaigners: 0,
        multi_holders: 0,
        reuse_holders: 0,
        permit_holders: 0,
        ..GateOptions::gate(name)
    }
}

/// Finishes and checks (`lockmesh_gate::finish_and_check`).
async fn finish_checked(g: &GateCluster) -> (History, Verdict) {
    let (h, v, _) = lockmesh_gate::finish_and_check(g).await.unwrap();
    (h, v)
}

/// What holder `name` recorded so far.
fn ops_of(g: &GateCluster, name: &str) -> Vec<ClientOp> {
    let h = g.holders.iter().find(|h| h.name == name).unwrap();
    let text = std::fs::read_to_string(&h.out).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn count(h: &History, process: &str, op: &str, outcome: Outcome) -> usize {
    h.ops.iter().filter(|o| o.process == process && o.op == op && o.outcome == outcome).count()
}

/// `kpy0` and `kgo0` (as `GateOptions::gate` spawns them: beside the Rust SDK
/// holders, fenced) hold two fenced keys with a raw holder and a Rust SDK
/// holder; each driver is stopped past the TTL once (a `holder_pause` of the
/// SDK's own process). The history passes every check, and each made claims,
/// fenced writes with its SDK's token and proof, and releases.
#[tokio::test]
async fn python_and_go_holders_hold_the_fenced_keys_through_their_sdks() {
    let opts = GateOptions { mutex_keys: 2, sdk_holders: 1, python_holders: 1, go_holders: 1, ..small("poly") };
    let mut g = GateCluster::start(opts).await.unwrap();
    g.spawn_workload(1, 0).unwrap();
    let names: Vec<String> = g.holders.iter().map(|h| h.name.clone()).collect();
    assert_eq!(names, ["h0", "k0", "kpy0", "kgo0"], "the workload's holders");
    for name in ["kpy0", "kgo0"] {
        let wrote = |o: &ClientOp| o.process == name && o.op == "write" && o.outcome == Outcome::Ok;
        assert!(g.wait_for_op(Duration::from_secs(60), wrote).await, "{name} made no fenced write");
    }
    for name in ["kpy0", "kgo0"] {
        let start = now_us();
        let p = &g.holders.iter().find(|h| h.name == name).unwrap().process;
        p.pause().unwrap();
        tokio::time::sleep(Duration::from_millis(4500)).await;
        p.resume().unwrap();
        g.note("holder_pause", name, start);
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (h, v) = finish_checked(&g).await;
    assert!(v.passed(), "{}", v.explain());
    for name in ["kpy0", "kgo0"] {
        let (claims, writes, releases) = (
            count(&h, name, "valid", Outcome::Ok),
            count(&h, name, "write", Outcome::Ok),
            count(&h, name, "release", Outcome::Ok),
        );
        let fenced = h.ops.iter().filter(|o| o.process == name && o.op == "fenced").count();
        eprintln!("{name}: {claims} claims, {writes} fenced writes, {releases} releases, {fenced} fence callbacks");
        assert!(claims > 2 && writes > 2 && releases > 2, "{name} held through its SDK");
    }
}

/// How long the twin's holder keeps each hold, claiming every 200 ms.
const HOLD_MS: u64 = 8000;
/// How long its driver is stopped with a keepalive's answer waiting.
const STOP: Duration = Duration::from_millis(1400);

/// The Python SDK's planted `deadline_from_answer` (client/conformance/README.md):
/// the fence deadline is counted from a keepalive's answer, not its send.
///
/// Why a stop, and why margin 0: at the gate's 3 s TTL a keepalive waits at most
/// TTL/6 = 0.5 s for its answer, and an answer read after the deadline is a loss,
/// so with the SDK's default 1 s margin the planted shift never reaches past the
/// lease (the claims stay conservative; the gate's default holders cannot show
/// the fault). Here the holder keeps margin 0 (`--margin-ms=0`: the correct SDK's
/// deadline is then its lease's earliest end, send + TTL) and reaches Envoy through
/// a fault proxy. While it holds `mk/0` (an advisory mutex, no lock-delay) with a
/// raw holder `c0` waiting for it, the proxy holds a keepalive's answer; the driver
/// is SIGSTOPped at once, the answer delivered into its socket, and it is resumed
/// 1.4 s later: the SDK reads the answer then, below its deadline, so it is
/// acknowledged. Then the proxy cuts the link: no keepalive renews the lease
/// after that one. The lease ends about 3 s after that send and `c0` is granted
/// the key. The correct SDK's claims end by then (send + 3 s); the planted one's
/// run to the answer + 3 s, 1.4 s later, past `c0`'s grant:
/// `sdk_deadline_conservative`.
#[tokio::test]
async fn planted_deadline_from_answer_in_the_python_sdk_is_caught_by_the_sdk_claims() {
    for bug in [true, false] {
        let mut g = GateCluster::start(small(if bug { "plant-answer" } else { "ctl-answer" })).await.unwrap();
        let key = format!("{MULTI_PREFIX}/0");
        let proxy = FaultProxy::start(g.envoys[0].listener_port()).await.unwrap();
        let mut extra = vec!["--margin-ms=0".to_owned(), "--work-ms=0".to_owned(), format!("--hold-ms={HOLD_MS}")];
        if bug {
            extra.push("--planted=deadline_from_answer".to_owned());
        }
        g.spawn_driver_holder("kpy0", Lang::Python, std::slice::from_ref(&key), proxy.port(), false, &extra).unwrap();
        g.spawn_holder("c0", std::slice::from_ref(&key), false).unwrap();
        let py = g.holders.iter().position(|h| h.name == "kpy0").unwrap();
        let mut took = None;
        for attempt in 1..=4 {
            let since = now_us();
            let granted =
                |o: &ClientOp| o.process == "kpy0" && o.op == "acquire" && o.token.is_some() && o.ret_us > since;
            assert!(g.wait_for_op(Duration::from_secs(30), granted).await, "kpy0 was never granted {key}");
            // Hold the next answer (a keepalive's: nothing else is in flight during
            // the hold) and stop the SDK before it can read it.
            let before = proxy.held().0;
            proxy.set(LinkMode::OneWay);
            let end = Instant::now() + Duration::from_millis(2500);
            while proxy.held().0 == before && Instant::now() < end {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            if proxy.held().0 == before {
                proxy.set(LinkMode::Pass);
                continue;
            }
            let held_at = now_us();
            g.holders[py].process.pause().unwrap();
            proxy.set(LinkMode::Pass);
            tokio::time::sleep(STOP).await;
            g.holders[py].process.resume().unwrap();
            let resumed = now_us();
            tokio::time::sleep(Duration::from_millis(150)).await;
            proxy.set(LinkMode::Cut);
            tokio::time::sleep(Duration::from_millis(3500)).await;
            proxy.set(LinkMode::Pass);
            g.note("holder_pause", format!("kpy0 stopped {STOP:?} with a keepalive's answer waiting, then cut"), since);
            // It took effect if a claim after the SIGCONT counts from that keepalive
            // (its send: by held_at + 3 s; its answer: about resumed + 3 s), not from
            // the one before (about held_at + 2 s).
            let claims: Vec<u64> = ops_of(&g, "kpy0")
                .into_iter()
                .filter(|o| o.op == "valid" && o.call_us > resumed)
                .filter_map(|o| o.valid_until_us)
                .collect();
            let latest = claims.iter().max().copied().unwrap_or(0);
            eprintln!(
                "attempt {attempt}: {} claims after the SIGCONT, the latest deadline {} ms after the answer was held",
                claims.len(),
                latest.saturating_sub(held_at) / 1000
            );
            if latest > held_at + 2_500_000 {
                took = Some(latest - held_at);
                break;
            }
        }
        let took = took.expect("no attempt stopped the SDK with a keepalive's answer waiting");
        if bug {
            assert!(took > 3_300_000, "the planted deadline counts from the answer read after the stop: {took} µs");
        } else {
            assert!(took <= 3_000_000, "the deadline counts from the keepalive's send: {took} µs");
        }
        let c0 = |o: &ClientOp| o.process == "c0" && o.op == "acquire" && o.outcome == Outcome::Ok;
        assert!(g.wait_for_op(Duration::from_secs(10), c0).await, "c0 was never granted {key}");
        let (_, v) = finish_checked(&g).await;
        if bug {
            assert!(!v.passed(), "the planted fault was not caught: {}", v.explain());
            let names: Vec<&str> = v.violations().iter().map(|x| x.check).collect();
            assert!(names.contains(&"sdk_deadline_conservative"), "got {names:?}: {}", v.explain());
        } else {
            assert!(v.passed(), "control: {}", v.explain());
        }
    }
}
