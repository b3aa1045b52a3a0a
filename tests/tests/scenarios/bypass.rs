//! Scenarios: no way around the lock (issue #17, "Done when").
//!
//! The adversarial corpus `tests/fixtures/bypass/corpus.json` (path encodings,
//! double encoding, dot segments, case, backslashes, `;`, absolute-form targets,
//! underscore and case twins of every lock and lockmesh header, duplicates) is sent
//! byte for byte (curl `--request-target`, headers as written) over HTTP/1.1 and
//! HTTP/2 to a real Envoy in front of a real normalising WSGI application
//! (`tests/fixtures/bypass/wsgi_upstream.py`: Python's `wsgiref`, which decodes the
//! path and reads `x_lock_token` as `HTTP_X_LOCK_TOKEN`). The application logs every
//! request it served with the path as it understood it, and the verdict is taken
//! from that log, not from the status codes:
//!
//! - no request reaches a locked path (as the application understood it) without a
//!   lock the arbiter granted;
//! - on a bound route (`/orders/{id}`) the lock is the one for the order the
//!   application serves (`payments/order-{id}`);
//! - no value a client forged for a header only lockmesh may set reaches the
//!   application, nor any `x-lockmesh-*` header, nor an underscore twin of a lock,
//!   lockmesh or identity header.
//!
//! The canonical requests of the corpus (class `control`) must get their normal
//! answers in the same run: a filter that refused everything would fail.
//!
//! Configs: the shipped inbound sidecar; the same with the HCM path and header
//! settings taken out (planted: the filter's own checks must hold alone); the Istio
//! shape (those settings taken out and the `EnvoyFilter` patch of
//! `deploy/istio/envoyfilter.yaml` applied instead); the shipped application
//! sidecar (its only route, `/v1/`, must not be escaped); and the planted naive
//! gate `tests/fixtures/bypass/naive-gate.yaml` (both layers off), through which
//! the corpus must find bypasses, or the detector is broken.
//!
//! fence-proxy: the same kind of application plays a normalising store behind a
//! fence with a per-item route, a route whose lock is coarser than its resources
//! and an `unlisted` guard. Writes aimed at item 8 with another item's grant, with
//! a stale grant of the coarse lock, and with the guard's grant must never be
//! applied to a resource their lock does not guard, nor stale (HTTP/1.1 only:
//! fence-proxy serves HTTP/1.1).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use lockmesh_tests::paths::{repo_root, temp_dir};
use lockmesh_tests::process::ChildProcess;
use lockmesh_tests::{free_port, EnvoyBuilder, EnvoyProcess, Stack};
use serde::Deserialize;
use serde_json::Value;
use tempfile::TempDir;

const FIXTURES: &str = "tests/fixtures/bypass";

/// The corpus file.
#[derive(Debug, Clone, Deserialize)]
struct Corpus {
    /// Every forged value of a header only lockmesh may set contains it.
    forged_marker: String,
    /// Writes aimed at another resource of a fenced route.
    fence: FenceTargets,
    entries: Vec<Entry>,
}

/// The corpus's fence section: targets with `{r}` (the route) and `{rx}` (the
/// route with its first byte percent-encoded).
#[derive(Debug, Clone, Deserialize)]
struct FenceTargets {
    targets: Vec<String>,
}

/// One request of the corpus.
#[derive(Debug, Clone, Deserialize)]
struct Entry {
    class: String,
    method: String,
    /// The request target, sent as is.
    target: String,
    /// `[name, value]` pairs, sent as is and in order.
    headers: Vec<(String, String)>,
    protocols: Vec<Proto>,
    /// Controls only: the status a canonical request gets.
    #[serde(default)]
    expect: Option<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Proto {
    Http1,
    Http2,
}

/// One request as the WSGI application served it (a line of its log).
#[derive(Debug, Clone, Deserialize)]
struct Seen {
    method: String,
    raw_target: String,
    understood: String,
    header_names: Vec<String>,
    lock_headers: BTreeMap<String, String>,
}

fn corpus() -> Corpus {
    let path = repo_root().join(FIXTURES).join("corpus.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// === the upstream ===

/// `wsgi_upstream.py` on a free port, logging to a file of its own.
struct Upstream {
    _process: ChildProcess,
    port: u16,
    log: PathBuf,
    _dir: TempDir,
}

impl Upstream {
    async fn start() -> Result<Self> {
        let dir = temp_dir("wsgi-")?;
        let port = free_port();
        let log = dir.path().join("seen.jsonl");
        let script = repo_root().join(FIXTURES).join("wsgi_upstream.py");
        let args = vec![
            script.display().to_string(),
            "--port".into(),
            port.to_string(),
            "--log".into(),
            log.display().to_string(),
        ];
        let process = ChildProcess::new("wsgi-upstream", "python3", args, dir.path().join("wsgi.stdio.log"));
        process.start()?;
        process
            .wait_ready(Duration::from_secs(10), async || {
                tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
                Ok(())
            })
            .await?;
        Ok(Self { _process: process, port, log, _dir: dir })
    }

    /// Every request served so far (the log is written before each answer).
    fn seen(&self) -> Vec<Seen> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("upstream log line {l:?}: {e}")))
            .collect()
    }
}

// === the client ===

/// Where the corpus goes: a port, over mTLS with a workload identity or plain.
struct Target {
    port: u16,
    /// CA, client certificate and key; `None` for a plain-HTTP listener.
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
}

/// Sends each entry once over `proto` (one curl process, `--next` between
/// requests, each with exactly its own target and headers) and returns the
/// statuses in order; `0` where no answer came (a reset stream, a closed
/// connection).
async fn send_all(entries: &[&Entry], proto: Proto, to: &Target) -> Result<Vec<u16>> {
    if to.tls.is_none() && proto == Proto::Http2 && entries.len() > 1 {
        // Plain HTTP/2 (prior knowledge): curl's `--next` batch lost every answer
        // after a refused request on the shared connection, so each request gets
        // its own curl and connection there.
        let mut codes = Vec::with_capacity(entries.len());
        for e in entries {
            codes.extend(Box::pin(send_all(&[*e], proto, to)).await?);
        }
        return Ok(codes);
    }
    let mut args: Vec<String> = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            args.push("--next".into());
        }
        args.extend(["-s", "-o", "/dev/null", "-w", "%{http_code}\\n", "--max-time", "10"].map(String::from));
        let url = match &to.tls {
            Some((ca, cert, key)) => {
                for (flag, path) in [("--cacert", ca), ("--cert", cert), ("--key", key)] {
                    args.push(flag.into());
                    args.push(path.display().to_string());
                }
                args.push(if proto == Proto::Http1 { "--http1.1" } else { "--http2" }.into());
                format!("https://localhost:{}/", to.port)
            }
            None => {
                args.push(if proto == Proto::Http1 { "--http1.1" } else { "--http2-prior-knowledge" }.into());
                format!("http://127.0.0.1:{}/", to.port)
            }
        };
        args.extend(["-X".into(), e.method.clone(), "--request-target".into(), e.target.clone()]);
        for (name, value) in &e.headers {
            args.push("-H".into());
            args.push(format!("{name}: {value}"));
        }
        args.push(url);
    }
    let out = tokio::process::Command::new("curl")
        .args(&args)
        .kill_on_drop(true)
        .output()
        .await
        .context("run curl (Debian package curl, built with HTTP/2)")?;
    let codes: Vec<u16> = String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim().parse().unwrap_or(0)).collect();
    if codes.len() != entries.len() {
        bail!("curl answered {} of {} requests: {}", codes.len(), entries.len(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(codes)
}

/// Statuses per (class, protocol), printed as the outcome table.
type Outcomes = BTreeMap<(String, Proto), BTreeMap<u16, usize>>;

/// Sends the whole corpus over both protocols (HTTP/1.1 first); returns every
/// control whose answer was not its `expect` (controls are judged by `expect_of`,
/// which may replace the corpus's value) and the outcome table.
async fn run_corpus(
    entries: &[Entry],
    to: &Target,
    expect_of: impl Fn(&Entry) -> Option<u16>,
) -> (Vec<String>, Outcomes) {
    let mut wrong = Vec::new();
    let mut outcomes = Outcomes::new();
    for proto in [Proto::Http1, Proto::Http2] {
        let batch: Vec<&Entry> = entries.iter().filter(|e| e.protocols.contains(&proto)).collect();
        let codes = send_all(&batch, proto, to).await.unwrap();
        for (e, code) in batch.iter().zip(codes) {
            *outcomes.entry((e.class.clone(), proto)).or_default().entry(code).or_default() += 1;
            if let Some(want) = expect_of(e) {
                if code != want {
                    wrong.push(format!("{proto:?} {} {} {:?}: {code}, want {want}", e.method, e.target, e.headers));
                }
            }
        }
    }
    (wrong, outcomes)
}

fn print_outcomes(config: &str, outcomes: &Outcomes) {
    println!("bypass corpus against {config}: status -> count, per class and protocol");
    for ((class, proto), codes) in outcomes {
        let codes: Vec<String> = codes.iter().map(|(c, n)| format!("{c}x{n}")).collect();
        println!("  {class:16} {proto:?}: {}", codes.join(" "));
    }
}

// === the verdict ===

/// What the application's log must show for one config.
struct Oracle {
    /// Paths (segment-aware prefixes) served without a lock.
    unlocked: &'static [&'static str],
    /// Path templates of one `{var}` segment each, and the key that must guard them.
    bound: &'static [(&'static str, &'static str)],
}

/// The shipped inbound sidecar's routes (`envoy-config/src/plugins.json`):
/// `/public` unlocked, `/orders/{id}` bound to `payments/order-{id}`, the rest locked.
const INBOUND: Oracle = Oracle { unlocked: &["/public"], bound: &[("/orders/{id}", "payments/order-{id}")] };

/// Headers only lockmesh (or Envoy's verified handshake) may set, as WSGI reads
/// them: a forged value in any of them at the application is a bypass.
const RESERVED: [&str; 9] = [
    "HTTP_X_LOCK_TOKEN",
    "HTTP_X_LOCK_EPOCH",
    "HTTP_X_LOCK_REVISION",
    "HTTP_X_LOCK_PROOF",
    "HTTP_X_LOCK_GRANT",
    "HTTP_X_LOCK_SESSION",
    "HTTP_X_LOCK_INSTANCE",
    "HTTP_X_SPIFFE_ID",
    "HTTP_X_FORWARDED_CLIENT_CERT",
];

fn covers(prefix: &str, path: &str) -> bool {
    path == prefix || path.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('/'))
}

/// The key a one-variable template binds `path` to, if the template matches.
fn bound_key(template: &str, key: &str, path: &str) -> Option<String> {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    if t.len() != p.len() {
        return None;
    }
    let mut out = key.to_owned();
    for (ts, ps) in t.iter().zip(&p) {
        match ts.strip_prefix('{').and_then(|v| v.strip_suffix('}')) {
            Some(var) if !ps.is_empty() => out = out.replace(&format!("{{{var}}}"), ps),
            Some(_) => return None,
            None if ts == ps => {}
            None => return None,
        }
    }
    Some(out)
}

/// Whether a header name, read the way WSGI reads it, is a lock, lockmesh or
/// identity header.
fn is_lock_header(name: &str) -> bool {
    let folded = name.to_ascii_lowercase().replace('_', "-");
    folded.starts_with("x-lock-")
        || folded.starts_with("x-lockmesh-")
        || folded == "x-spiffe-id"
        || folded == "x-forwarded-client-cert"
}

/// Every bypass in the application's log under `oracle`, one line each.
fn bypasses(seen: &[Seen], marker: &str, oracle: &Oracle) -> Vec<String> {
    let mut found = Vec::new();
    for s in seen {
        let at = format!("{} {:?} (understood {:?})", s.method, s.raw_target, s.understood);
        let h = |n: &str| s.lock_headers.get(n).map(String::as_str);
        for name in &s.header_names {
            if name.contains('_') && is_lock_header(name) {
                found.push(format!("{at}: underscore twin {name:?} reached the application"));
            }
        }
        for (name, value) in &s.lock_headers {
            if name.starts_with("HTTP_X_LOCKMESH_") {
                found.push(format!("{at}: lockmesh's own header {name}={value:?} reached the application"));
            }
            if RESERVED.contains(&name.as_str()) && value.contains(marker) {
                found.push(format!("{at}: forged {name}={value:?} reached the application"));
            }
        }
        if !oracle.unlocked.iter().any(|p| covers(p, &s.understood)) {
            let num = |n: &str| h(n).and_then(|v| v.parse::<u64>().ok());
            match (num("HTTP_X_LOCK_TOKEN"), num("HTTP_X_LOCK_EPOCH"), num("HTTP_X_LOCK_REVISION")) {
                (Some(t), Some(e), Some(r)) if e < 1 << 16 && r < 1 << 48 && t == (e << 48) + r => {}
                _ => found.push(format!(
                    "{at}: a locked path served without a granted lock (token {:?})",
                    h("HTTP_X_LOCK_TOKEN")
                )),
            }
        }
        for (template, key) in oracle.bound {
            if let Some(want) = bound_key(template, key, &s.understood) {
                if h("HTTP_X_LOCK_KEY") != Some(want.as_str()) {
                    found.push(format!(
                        "{at}: served under lock key {:?}, not the resource's {want:?}",
                        h("HTTP_X_LOCK_KEY")
                    ));
                }
            }
        }
    }
    found
}

// === configs ===

/// The HCM settings block as rendered into the shipped configs (the fragment,
/// indented as the HCM's fields are).
fn hcm_safety_block() -> String {
    let frag = repo_root().join("envoy-config/src/fragments/hcm-path-safety.yaml");
    let text = std::fs::read_to_string(&frag).unwrap();
    text.lines().map(|l| if l.is_empty() { "\n".to_owned() } else { format!("{:16}{l}\n", "") }).collect()
}

/// The HCM fields the Istio `EnvoyFilter`'s `NETWORK_FILTER` patch merges, as YAML
/// lines at the inbound sidecar's HCM indentation.
fn istio_hcm_patch() -> String {
    let path = repo_root().join("deploy/istio/envoyfilter.yaml");
    let doc: Value = serde_saphyr::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let patch = doc["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["applyTo"] == "NETWORK_FILTER" && p["match"]["context"] == "SIDECAR_INBOUND")
        .expect("the EnvoyFilter patches the inbound HCM");
    assert_eq!(patch["patch"]["operation"], "MERGE");
    fn yaml(v: &Value, indent: usize, out: &mut String) {
        for (k, v) in v.as_object().unwrap() {
            if k == "@type" {
                continue;
            }
            match v {
                Value::Object(_) => {
                    out.push_str(&format!("{:indent$}{k}:\n", ""));
                    yaml(v, indent + 2, out);
                }
                Value::String(s) => out.push_str(&format!("{:indent$}{k}: {s}\n", "")),
                other => out.push_str(&format!("{:indent$}{k}: {other}\n", "")),
            }
        }
    }
    let mut out = String::new();
    yaml(&patch["patch"]["value"]["typed_config"], 16, &mut out);
    out
}

/// A stack (etcd, one arbiter) for an inbound-sidecar-shaped Envoy in front of
/// the WSGI application, with the corpus sent as `payments/worker`. The arbiter
/// lists the sidecar's own SVID as a self client, with LockGrants
/// ([`lockmesh_tests::StackBuilder::inbound_sidecar`]).
struct Setup {
    _stack: Stack,
    upstream: Upstream,
    _envoy: EnvoyProcess,
    target: Target,
}

async fn inbound(name: &str, envoy: EnvoyBuilder) -> Setup {
    let (stack, upstream) = tokio::join!(Stack::builder(name).inbound_sidecar().start(), Upstream::start());
    let (stack, upstream) = (stack.unwrap(), upstream.unwrap());
    let envoy = envoy
        .cert_dir(stack.pki().dir())
        .arbiter_port(stack.arbiter(0).grpc_port())
        .upstream_port(upstream.port)
        .start()
        .await
        .unwrap();
    let cert = stack.pki().client("payments", "worker").unwrap();
    let target = Target {
        port: envoy.listener_port(),
        tls: Some((stack.pki().ca_cert_path(), cert.cert_path.clone(), cert.key_path.clone())),
    };
    Setup { _stack: stack, upstream, _envoy: envoy, target }
}

/// Runs the corpus through an inbound-sidecar-shaped config and asserts the
/// verdict and the controls.
async fn holds(config: &str, setup: Setup) {
    let c = corpus();
    let (wrong, outcomes) = run_corpus(&c.entries, &setup.target, |e| e.expect).await;
    print_outcomes(config, &outcomes);
    let seen = setup.upstream.seen();
    let found = bypasses(&seen, &c.forged_marker, &INBOUND);
    assert!(found.is_empty(), "{config}: {} bypass(es):\n{}", found.len(), found.join("\n"));
    assert!(wrong.is_empty(), "{config}: canonical requests did not get their normal answer:\n{}", wrong.join("\n"));
    assert!(!seen.is_empty(), "{config}: nothing reached the application");
}

#[tokio::test]
async fn the_corpus_finds_no_way_past_the_shipped_inbound_sidecar() {
    let setup = inbound("bypass-shipped", EnvoyProcess::builder("inbound-sidecar")).await;
    holds("inbound-sidecar", setup).await;
}

/// Planted config: the HCM settings taken out. The filter's own checks
/// (canonical paths, folded header names, bound keys) hold alone.
#[tokio::test]
async fn without_the_hcm_settings_the_filters_own_checks_still_hold() {
    let envoy = EnvoyProcess::builder("inbound-sidecar").replace(hcm_safety_block(), "");
    let setup = inbound("bypass-nohcm", envoy).await;
    holds("inbound-sidecar without the HCM settings", setup).await;
}

/// The Istio shape: the inbound sidecar with its own HCM settings replaced by
/// what the `EnvoyFilter` patch merges into Istio's inbound HCM.
#[tokio::test]
async fn the_corpus_finds_no_way_past_the_istio_shape() {
    let envoy = EnvoyProcess::builder("inbound-sidecar").replace(hcm_safety_block(), istio_hcm_patch());
    let setup = inbound("bypass-istio", envoy).await;
    holds("inbound-sidecar with the Istio EnvoyFilter patch", setup).await;
}

/// The detector works: through a gate with both layers off (no HCM settings, no
/// lockmesh filter, Envoy routes matching the raw path) the corpus reaches locked
/// paths without a lock and carries forged tokens and underscore twins.
#[tokio::test]
async fn through_a_gate_without_either_layer_the_corpus_finds_bypasses() {
    let gate = repo_root().join(FIXTURES).join("naive-gate.yaml");
    let setup = inbound("bypass-naive", EnvoyProcess::builder(gate.to_str().unwrap())).await;
    let c = corpus();
    let (_, outcomes) = run_corpus(&c.entries, &setup.target, |_| None).await;
    print_outcomes("the naive gate", &outcomes);
    let found = bypasses(&setup.upstream.seen(), &c.forged_marker, &INBOUND);
    for kind in ["a locked path served without a granted lock", "forged HTTP_X_LOCK_TOKEN", "underscore twin"] {
        assert!(
            found.iter().any(|f| f.contains(kind)),
            "the detector missed {kind:?}; it found:\n{}",
            found.join("\n")
        );
    }
}

/// The application sidecar routes only `/v1/` (to the lock tier; here to the WSGI
/// application in its place): no spelling reaches anything else, and no underscore
/// twin passes. The corpus runs with `/public` read as `/v1`.
#[tokio::test]
async fn the_corpus_cannot_leave_the_application_sidecars_lock_api_route() {
    let upstream = Upstream::start().await.unwrap();
    let listen = free_port();
    let tail = "      typed_extension_protocol_options:\n        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n          \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n          explicit_http_config:\n            http2_protocol_options: {}\n";
    let text = std::fs::read_to_string(repo_root().join("envoy-config/app-sidecar.yaml")).unwrap();
    let tls_at =
        text.find("      transport_socket:\n        name: envoy.transport_sockets.tls").expect("the cluster's TLS");
    let cluster_tls = text[tls_at..].to_owned();
    // The lock-tier cluster becomes plain HTTP/1.1 to the application; the admin
    // port becomes the harness's (it waits for /ready there).
    // Only the header comment still names run/certs/ once the TLS is gone.
    let no_certs = temp_dir("bypass-certs-").unwrap();
    let _envoy = EnvoyProcess::builder("app-sidecar")
        .cert_dir(no_certs.path())
        .replace(cluster_tls, "")
        .replace(tail, "")
        .replace("port_value: 18000", format!("port_value: {}", upstream.port))
        .replace("port_value: 15001", format!("port_value: {listen}"))
        .replace("port_value: 15000", "port_value: 18001")
        .start()
        .await
        .unwrap();
    let c = corpus();
    let entries: Vec<Entry> =
        c.entries.iter().cloned().map(|e| Entry { target: e.target.replace("/public", "/v1"), ..e }).collect();
    let to = Target { port: listen, tls: None };
    let expect = |e: &Entry| e.expect.map(|_| if e.target.starts_with("/v1/") { 200 } else { 404 });
    let (wrong, outcomes) = run_corpus(&entries, &to, expect).await;
    print_outcomes("app-sidecar", &outcomes);
    let mut found = Vec::new();
    for s in upstream.seen() {
        if !s.understood.starts_with("/v1/") {
            found.push(format!("{} {:?} was served as {:?}, outside /v1/", s.method, s.raw_target, s.understood));
        }
        for name in s.header_names.iter().filter(|n| n.contains('_') && is_lock_header(n)) {
            found.push(format!("{} {:?}: underscore twin {name:?} passed", s.method, s.raw_target));
        }
    }
    assert!(found.is_empty(), "app-sidecar: {} bypass(es):\n{}", found.len(), found.join("\n"));
    assert!(wrong.is_empty(), "app-sidecar: canonical requests did not get their normal answer:\n{}", wrong.join("\n"));
}

// === fence-proxy ===

/// The fence's routes: one lock per item, one lock for every `coarse` resource,
/// and the guard for everything else (docs/FENCING.md).
const FENCE_ROUTES: &str = "routes:\n  - name: items\n    path: /items/{id}\n    reads: [GET, HEAD]\n    resource: \"items/{id}\"\n    lock_key: \"payments/items/{id}\"\n  - name: coarse\n    path: /coarse/{id}\n    reads: [GET]\n    resource: \"coarse/{id}\"\n    lock_key: \"payments/coarse\"\nunlisted: { resource: \"store\", lock_key: \"payments/store\" }";

/// The lock that guards what the store applied at `path` (as it understood it).
fn fence_key(path: &str) -> String {
    let seg: Vec<&str> = path.split('/').collect();
    match seg.as_slice() {
        ["", "items", id] if !id.is_empty() => format!("payments/items/{id}"),
        ["", "coarse", id] if !id.is_empty() => "payments/coarse".into(),
        _ => "payments/store".into(),
    }
}

/// A grant: token and proof.
#[derive(Clone)]
struct Grant {
    token: String,
    proof: String,
}

async fn acquire(c: &lockmesh_tests::LockClient, key: &str) -> Grant {
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", key), ("x-lock-wait-ms", "10000")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let f = |n: &str| r.json[n].as_str().unwrap_or_else(|| panic!("no {n} in {}", r.body)).to_owned();
    Grant { token: f("token"), proof: f("proof") }
}

async fn release(c: &lockmesh_tests::LockClient, key: &str, g: &Grant) {
    let r = c.post("/v1/locks/release", &[("x-lock-key", key), ("x-lock-token", &g.token)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
}

/// `e` as a write to the fence for route `r` with grant `g`: PUT, the corpus's
/// target with `/public` read as `/{r}/7` and `orders/1` as `8`, its headers but
/// the token and proof, which are `g`'s.
fn fence_write(e: &Entry, r: &str, g: &Grant) -> Entry {
    let target = e.target.replace("/public", &format!("/{r}/7")).replace("orders/1", "8");
    let mut headers: Vec<(String, String)> = e
        .headers
        .iter()
        .filter(|(n, _)| !matches!(n.to_ascii_lowercase().as_str(), "x-lock-token" | "x-lock-proof"))
        .cloned()
        .collect();
    headers.push(("x-lock-token".into(), g.token.clone()));
    headers.push(("x-lock-proof".into(), g.proof.clone()));
    Entry { method: "PUT".into(), target, headers, protocols: vec![Proto::Http1], expect: None, ..e.clone() }
}

#[tokio::test]
async fn no_write_passes_the_fence_under_another_resource_or_stale() {
    let dir = tempfile::tempdir().unwrap();
    let key = lockmesh_tests::fence::ensure_signing_key(dir.path()).unwrap();
    let (stack, store) = tokio::join!(
        Stack::builder("bypass-fence").envoy_config("lock-tier").arbiter_extra_yaml(key.arbiter_yaml()).start(),
        Upstream::start()
    );
    let (stack, store) = (stack.unwrap(), store.unwrap());
    let fence = lockmesh_tests::fence::FenceProxyProcess::builder(store.port)
        .trust(&key.kid, &key.pub_file)
        .routes(FENCE_ROUTES)
        .start()
        .await
        .unwrap();
    let a = stack.client("payments", "a").unwrap();
    let to = Target { port: fence.port(), tls: None };
    let put = |target: &str, g: &Grant, expect: u16| Entry {
        class: "control".into(),
        method: "PUT".into(),
        target: target.into(),
        headers: vec![("x-lock-token".into(), g.token.clone()), ("x-lock-proof".into(), g.proof.clone())],
        protocols: vec![Proto::Http1],
        expect: Some(expect),
    };
    // The grants: item 7 (held), the guard (held), and the coarse lock twice: the
    // first grant writes coarse/8, the second overwrites it, so the first is stale there.
    let item7 = acquire(&a, "payments/items/7").await;
    let guard = acquire(&a, "payments/store").await;
    let old = acquire(&a, "payments/coarse").await;
    let (wrong, _) = run_corpus(&[put("/coarse/8", &old, 200)], &to, |e| e.expect).await;
    assert!(wrong.is_empty(), "{wrong:?}");
    release(&a, "payments/coarse", &old).await;
    let new = acquire(&a, "payments/coarse").await;
    // Controls: each grant writes what it guards.
    let controls = [
        put("/coarse/8", &new, 200),
        put("/items/7", &item7, 200),
        put("/misc/1", &guard, 200),
        put("/items/9", &item7, 403),
    ];
    let c = corpus();
    let mut writes: Vec<Entry> = controls.to_vec();
    for (r, g) in [("items", &item7), ("coarse", &old), ("items", &guard)] {
        writes.extend(c.entries.iter().map(|e| fence_write(e, r, g)));
        let rx = format!("{:02X}", r.as_bytes()[0]) + &r[1..];
        for t in &c.fence.targets {
            let e = Entry {
                class: "fence".into(),
                method: "PUT".into(),
                target: t.replace("{rx}", &rx).replace("{r}", r),
                headers: Vec::new(),
                protocols: vec![Proto::Http1],
                expect: None,
            };
            writes.push(fence_write(&e, r, g));
        }
    }
    let (wrong, outcomes) = run_corpus(&writes, &to, |e| e.expect).await;
    print_outcomes("fence-proxy", &outcomes);
    let key_of: BTreeMap<String, &str> = [
        (&item7, "payments/items/7"),
        (&guard, "payments/store"),
        (&old, "payments/coarse"),
        (&new, "payments/coarse"),
    ]
    .into_iter()
    .map(|(g, k)| (g.token.clone(), k))
    .collect();
    let mut found = Vec::new();
    let mut mark: BTreeMap<String, u64> = BTreeMap::new();
    for s in store.seen() {
        let at = format!("{} {:?} (applied at {:?})", s.method, s.raw_target, s.understood);
        let token = s.lock_headers.get("HTTP_X_LOCK_TOKEN").map(String::as_str).unwrap_or("");
        let Some(k) = key_of.get(token) else {
            found.push(format!("{at}: written with token {token:?}, not one granted"));
            continue;
        };
        if *k != fence_key(&s.understood) {
            found.push(format!("{at}: written under {k}, not {}", fence_key(&s.understood)));
        }
        let t: u64 = token.parse().unwrap();
        if let Some(prev) = mark.insert(s.understood.clone(), t) {
            if t <= prev {
                found.push(format!("{at}: token {t} written after {prev} (stale)"));
            }
        }
    }
    assert!(found.is_empty(), "fence-proxy: {} bypass(es):\n{}", found.len(), found.join("\n"));
    assert!(wrong.is_empty(), "fence-proxy: controls:\n{}", wrong.join("\n"));
}

#[test]
fn the_corpus_has_ten_variants_of_every_class_over_both_protocols() {
    let c = corpus();
    assert!(c.forged_marker.len() >= 16, "the marker must be unmistakable");
    let classes = [
        "path_encoding",
        "double_encoding",
        "dot_segments",
        "case",
        "backslash",
        "semicolon",
        "absolute_form",
        "header_twins",
        "duplicates",
    ];
    for class in classes {
        for proto in [Proto::Http1, Proto::Http2] {
            let n = c.entries.iter().filter(|e| e.class == class && e.protocols.contains(&proto)).count();
            assert!(n >= 10, "{class} over {proto:?}: {n} variants, want at least 10");
        }
    }
    for e in &c.entries {
        assert!(e.class == "control" || classes.contains(&e.class.as_str()), "unknown class {:?}", e.class);
        assert_eq!(e.expect.is_some(), e.class == "control", "{e:?}: only controls carry expect");
        assert!(!e.protocols.is_empty(), "{e:?}: no protocol");
    }
    // Every lock and lockmesh header has an underscore twin in the corpus.
    for name in lockmesh_core::headers::LOCK_HEADERS.iter().chain(&[
        lockmesh_core::headers::EPOCH,
        lockmesh_core::headers::REVISION,
        lockmesh_core::headers::PROOF,
        lockmesh_core::headers::FILTERED,
        lockmesh_core::headers::UNLOCKED,
        lockmesh_core::headers::VM,
        lockmesh_core::headers::HOLD,
        lockmesh_core::headers::BUDGET_MS,
    ]) {
        let twin = name.replace('-', "_");
        assert!(
            c.entries.iter().any(|e| e.headers.iter().any(|(n, _)| n == &twin)),
            "no underscore twin of {name} in the corpus"
        );
    }
}

#[test]
fn the_oracle_reads_templates_and_prefixes_on_segments() {
    assert_eq!(bound_key("/orders/{id}", "payments/order-{id}", "/orders/7").as_deref(), Some("payments/order-7"));
    assert_eq!(bound_key("/orders/{id}", "payments/order-{id}", "/orders/7/x"), None);
    assert_eq!(bound_key("/orders/{id}", "payments/order-{id}", "/orders/"), None);
    assert!(covers("/public", "/public") && covers("/public", "/public/x") && !covers("/public", "/publicx"));
    assert!(is_lock_header("X_Lock_Token") && is_lock_header("x_spiffe_id") && !is_lock_header("x_request_id"));
}
