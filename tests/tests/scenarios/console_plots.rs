//! Issue 23 item 3: the console's plots agree with the arbiter's `/metrics`.
//!
//! Under load (a waiter gated behind a key at its limit, grants with releases,
//! `key_gated` refusals), the page is rendered by a real Chromium driven through
//! chromedriver (WebDriver), screenshots are written at 1280x800 and 390x844
//! (`target/test-output/console/`), and the figures the page plots (read from its
//! SVG's and values tables' data attributes) are compared with `/metrics` read at
//! the same moment: each class's grants and refusals since the start (the newest
//! sample's `data-total`) equal `lockmesh_arbiter_acquires_total` summed by
//! class; the sample that closes the window of the burst counts exactly the
//! counters' growth over the burst (the counters read just before and after it,
//! with no other sample inside it); the waiters line is
//! `lockmesh_arbiter_gated_waiters`; the oldest hold is
//! `lockmesh_arbiter_oldest_hold_seconds` aged from the sample to the scrape; the
//! hold-age bars add up to `lockmesh_arbiter_open_holds`. The drill-down of a
//! class is opened and closed from the keyboard and lists its saturated key with
//! the waiter. A planted lagging history (`console_history_lag`) fails the check.

use std::{path::Path, time::Duration};

use lockmesh_load::prom;
use lockmesh_tests::{
    paths::{repo_root, target_dir, tool},
    ports::free_port,
    process::ChildProcess,
    LockClient, Stack,
};
use serde_json::{json, Value};

const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";
/// The W3C WebDriver name of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// The WebDriver key codes of Enter and Escape.
const ENTER: &str = "\u{E007}";
const ESCAPE: &str = "\u{E00C}";

fn now_ms() -> u64 {
    u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// Where the scenario writes its screenshots.
pub(super) fn output_dir() -> std::path::PathBuf {
    let dir = target_dir().join("test-output").join("console");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Standard base64 (the WebDriver screenshot encoding), padding accepted.
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace() && *c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, c)| n | (val(*c) << (18 - 6 * i)));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// A headless Chromium driven by chromedriver over WebDriver (HTTP + JSON).
pub(super) struct Browser {
    http: reqwest::Client,
    base: String,
    /// The browser's pid (chromedriver's `goog:processID`), killed on drop.
    browser_pid: Option<i32>,
    _driver: ChildProcess,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver and one headless session.
    pub(super) async fn start() -> Self {
        let root = repo_root().join(".tools/chromium/bin");
        let driver_bin =
            tool("LOCKMESH_CHROMEDRIVER", root.join("chromedriver"), "chromedriver (Debian, the console test)")
                .unwrap();
        let chromium = tool("LOCKMESH_CHROMIUM", root.join("chromium"), "chromium (Debian, the console test)").unwrap();
        let port = free_port();
        let profile = tempfile::tempdir().unwrap();
        let driver = ChildProcess::new(
            "chromedriver",
            driver_bin,
            vec![format!("--port={port}")],
            profile.path().join("chromedriver.log"),
        );
        driver.start().unwrap();
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let base = format!("http://127.0.0.1:{port}");
        driver
            .wait_ready(Duration::from_secs(20), async || {
                let v: Value = http.get(format!("{base}/status")).send().await?.json().await?;
                anyhow::ensure!(v["value"]["ready"] == true, "chromedriver not ready: {v}");
                Ok(())
            })
            .await
            .unwrap();
        let caps = json!({"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
            "binary": chromium.display().to_string(),
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                     "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
                     format!("--user-data-dir={}", profile.path().join("chrome").display())],
        }}}});
        let v: Value = http.post(format!("{base}/session")).json(&caps).send().await.unwrap().json().await.unwrap();
        let id = v["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no WebDriver session: {v}")).to_owned();
        let browser_pid = v["value"]["capabilities"]["goog:processID"].as_i64().and_then(|p| i32::try_from(p).ok());
        Self { http, base: format!("{base}/session/{id}"), browser_pid, _driver: driver, _profile: profile }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut r = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            r = r.json(&b);
        }
        let v: Value = r.send().await.unwrap().json().await.unwrap();
        assert!(v["value"].get("error").is_none(), "WebDriver {path}: {v}");
        v["value"].clone()
    }

    pub(super) async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url }))).await;
    }

    /// Runs `script` (a function body; `return` gives the value) in the page.
    pub(super) async fn exec(&self, script: &str) -> Value {
        self.call(reqwest::Method::POST, "/execute/sync", Some(json!({ "script": script, "args": [] }))).await
    }

    /// Polls `script` until it returns something truthy (within 20 s).
    pub(super) async fn until(&self, script: &str, what: &str) -> Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let v = self.exec(script).await;
            if !(v.is_null() || v == false) {
                return v;
            }
            assert!(tokio::time::Instant::now() < deadline, "the page did not show {what} within 20 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Emulates a viewport of `width` x `height` CSS pixels (`mobile`: a phone).
    pub(super) async fn viewport(&self, width: u32, height: u32, mobile: bool) {
        let params = json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile });
        let cmd = json!({ "cmd": "Emulation.setDeviceMetricsOverride", "params": params });
        self.call(reqwest::Method::POST, "/goog/cdp/execute", Some(cmd)).await;
    }

    /// Writes the viewport as PNG to `path`.
    pub(super) async fn screenshot(&self, path: &Path) {
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64_decode(v.as_str().unwrap());
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        std::fs::write(path, png).unwrap();
    }

    /// Types `keys` into the element `css` (focusing it first), as a keyboard would.
    pub(super) async fn keys(&self, css: &str, keys: &str) {
        let e =
            self.call(reqwest::Method::POST, "/element", Some(json!({ "using": "css selector", "value": css }))).await;
        let id = e[ELEMENT].as_str().unwrap().to_owned();
        self.call(reqwest::Method::POST, &format!("/element/{id}/value"), Some(json!({ "text": keys }))).await;
    }

    pub(super) async fn quit(self) {
        let _ = self.http.delete(&self.base).send().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // A session not quit (a failed assertion): its browser would outlive chromedriver.
        if let Some(pid) = self.browser_pid.filter(|p| *p > 0) {
            // SAFETY: kill(2) of the one process chromedriver reported starting for us.
            #[allow(unsafe_code)]
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// One `/metrics` read and the wall-clock interval it was answered in.
struct Scrape {
    samples: Vec<prom::Sample>,
    sent_ms: u64,
    recv_ms: u64,
}

impl Scrape {
    async fn of(st: &Stack) -> Self {
        let sent_ms = now_ms();
        let (code, text) = st.arbiter(0).admin_get("/metrics").await.unwrap();
        assert_eq!(code, 200, "{text}");
        Self { samples: prom::parse(&text), sent_ms, recv_ms: now_ms() }
    }

    /// The samples of `name` for `class`, summed (`max`: the highest).
    fn by_class(&self, name: &str, class: &str, keep: impl Fn(&prom::Sample) -> bool, max: bool) -> f64 {
        let v = self.samples.iter().filter(|s| s.name == name && s.label("class") == Some(class) && keep(s));
        if max {
            v.map(|s| s.value).fold(0.0, f64::max)
        } else {
            v.map(|s| s.value).sum()
        }
    }

    /// `class`'s acquires answered here: granted, or refused (every outcome but
    /// granted and cancelled), as the console's history counts them.
    fn acquires(&self, class: &str, granted: bool) -> u64 {
        let keep = |s: &prom::Sample| {
            let o = s.label("outcome").unwrap_or_default();
            if granted {
                o == "granted"
            } else {
                o != "granted" && o != "cancelled"
            }
        };
        self.by_class("lockmesh_arbiter_acquires_total", class, keep, false) as u64
    }

    fn gated(&self, class: &str) -> f64 {
        self.by_class("lockmesh_arbiter_gated_waiters", class, |_| true, false)
    }

    fn open_holds(&self) -> f64 {
        self.samples.iter().filter(|s| s.name == "lockmesh_arbiter_open_holds").map(|s| s.value).sum()
    }
}

/// What the scenario's stack holds for the plot check: `pool_full` is a key of
/// class `pool` at its limit (a waiter queues behind it), `ledger_full` one of
/// class `ledger` at its limit (acquires are refused `key_gated`), `pool_free` a
/// key of `pool` with room (grants and releases).
pub(super) struct Load<'a> {
    pub client: &'a LockClient,
    pub pool_full: &'a str,
    pub ledger_full: &'a str,
    pub pool_free: &'a str,
    pub pool_full_digest: String,
}

/// The console's history, as its API answers it.
async fn history(http: &reqwest::Client, admin: u16, token: &str) -> Value {
    let r = http.get(format!("http://127.0.0.1:{admin}/console/api/history")).bearer_auth(token).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.json().await.unwrap()
}

fn sample_times(h: &Value) -> Vec<u64> {
    h["at_ms"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect()
}

/// Waits for the history's first sample taken after `after_ms` (within 30 s).
async fn sample_after(http: &reqwest::Client, admin: u16, token: &str, after_ms: u64) -> (Value, u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let h = history(http, admin, token).await;
        if let Some(t) = sample_times(&h).into_iter().find(|t| *t > after_ms) {
            return (h, t);
        }
        assert!(tokio::time::Instant::now() < deadline, "no history sample after {after_ms} within 30 s: {h}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The burst: three grants of `pool_free`, each released, and two acquires of
/// `ledger_full` refused `key_gated`.
async fn burst(l: &Load<'_>) {
    for _ in 0..3 {
        let r = l.client.post(ACQ, &[("x-lock-key", l.pool_free), ("x-lock-wait-ms", "0")]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        let token = r.json["token"].as_str().unwrap().to_owned();
        let r = l.client.post(REL, &[("x-lock-key", l.pool_free), ("x-lock-token", &token)]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    for _ in 0..2 {
        let r = l.client.post(ACQ, &[("x-lock-key", l.ledger_full), ("x-lock-wait-ms", "0")]).await.unwrap();
        assert_eq!(r.code(), 409, "{}", r.body);
    }
}

/// What the page shows, read from its data attributes.
const READ_PAGE: &str = r##"
const q = (s) => [...document.querySelectorAll(s)];
const lines = {};
for (const chart of ["chart-grants", "chart-refusals", "chart-waiters", "chart-oldest"]) {
  lines[chart] = {};
  for (const p of q("#" + chart + " path[data-class]")) {
    lines[chart][p.dataset.class] = { last: p.dataset.last, lastAt: p.dataset.lastAt, total: p.dataset.total ?? null };
  }
}
const rows = {};
for (const chart of ["chart-grants", "chart-refusals", "chart-waiters"]) {
  rows[chart] = {};
  for (const tr of q("#" + chart + " tr[data-at]")) {
    const cells = {};
    for (const td of tr.querySelectorAll("td[data-key]")) {
      cells[td.dataset.key] = { value: td.dataset.value, count: td.dataset.count ?? null };
    }
    rows[chart][tr.dataset.at] = cells;
  }
}
const bars = q("#chart-ages rect[data-count]").map((r) => Number(r.dataset.count));
const etcd = document.querySelector("#chart-etcd path[data-series='etcd_mean_ms']");
const grafana = document.querySelector("#plot-links a.grafana");
return { lines, rows, bars, etcdMean: etcd ? etcd.dataset.last : null,
  grafana: grafana ? grafana.getAttribute("href") : null,
  overflow: document.documentElement.scrollWidth - window.innerWidth };
"##;

/// The page's figure `v` (a data attribute's text) as a number.
fn f(v: &Value, what: &str) -> f64 {
    v.as_str().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{what}: not a number: {v}"))
}

/// The plot check: load as above, the page rendered in `browser` at
/// `console_url`, its figures compared with `/metrics`. `Err` says which figure
/// disagrees. Screenshots go to `shots` when given.
pub(super) async fn plots_agree(
    st: &Stack,
    browser: &Browser,
    console_url: &str,
    token: &str,
    l: &Load<'_>,
    shots: Option<&Path>,
) -> Result<(), String> {
    let admin = st.arbiter(0).admin_port();
    let http = reqwest::Client::new();
    // A waiter gated behind the pool key at its limit, for the whole check.
    let waiter = tokio::spawn({
        let (c, key) = (l.client.clone(), l.pool_full.to_owned());
        async move { c.post(ACQ, &[("x-lock-key", &key), ("x-lock-wait-ms", "30000")]).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while Scrape::of(st).await.gated("pool") < 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "the waiter is not gated within 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The burst between two samples, with no sample inside it (else again): the
    // sample after it counts exactly what /metrics grew by over it.
    let mut attempt = 0;
    let (before, after, window_end, window_start) = loop {
        attempt += 1;
        let (_, t_a) = sample_after(&http, admin, token, now_ms()).await;
        let before = Scrape::of(st).await;
        let start = now_ms();
        burst(l).await;
        let end = now_ms();
        let (h, p) = sample_after(&http, admin, token, end).await;
        let after = Scrape::of(st).await;
        let times = sample_times(&h);
        let prev = times.iter().copied().filter(|t| *t < p).max().unwrap();
        if prev < start {
            assert!(prev >= t_a, "samples go back in time: {times:?}");
            break (before, after, p, prev);
        }
        assert!(attempt < 4, "a sample fell inside each of 3 bursts: {times:?}");
    };
    // The page at 1280x800, once it plots the burst's sample.
    browser.viewport(1280, 800, false).await;
    browser.goto(console_url).await;
    browser
        .until(
            &format!(
                "const p = document.querySelector('#chart-grants path[data-class=\"pool\"]'); \
                 return p && Number(p.dataset.lastAt) >= {window_end};"
            ),
            "the burst's sample",
        )
        .await;
    if let Some(dir) = shots {
        browser.screenshot(&dir.join("console-1280x800.png")).await;
    }
    let page = browser.exec(READ_PAGE).await;
    let now = Scrape::of(st).await;
    let mut errors = Vec::new();
    let mut expect = |ok: bool, what: String| {
        if !ok {
            errors.push(what);
        }
    };
    // Since the start: the newest sample's totals are the counters now (nothing
    // was answered since the burst but the waiter, which still waits).
    for (chart, class, granted) in
        [("chart-grants", "pool", true), ("chart-refusals", "ledger", false), ("chart-grants", "ledger", true)]
    {
        let line = &page["lines"][chart][class];
        let want = now.acquires(class, granted);
        let (a, b) = (after.acquires(class, granted), want);
        assert_eq!(a, b, "{class}: the counter moved after the burst");
        if line.is_null() {
            expect(want == 0, format!("{chart}: no line for {class}, /metrics says {want}"));
            continue;
        }
        let total = f(&line["total"], "total") as u64;
        expect(total == want, format!("{chart} {class}: the newest sample's total {total}, /metrics {want}"));
    }
    // The burst's window: its sample counts the counters' growth over the burst.
    let at = window_end.to_string();
    let dt_s = (window_end - window_start) as f64 / 1000.0;
    for (chart, class, granted) in [("chart-grants", "pool", true), ("chart-refusals", "ledger", false)] {
        let grew = after.acquires(class, granted) - before.acquires(class, granted);
        assert!(grew > 0, "{class}: the burst moved nothing");
        let cell = &page["rows"][chart][&at][class];
        if cell.is_null() {
            expect(false, format!("{chart}: no value of {class} at the burst's sample {at}: {}", page["rows"][chart]));
            continue;
        }
        let count = f(&cell["count"], "count") as u64;
        expect(count == grew, format!("{chart} {class}: {count} in the burst's window, /metrics grew by {grew}"));
        let rate = f(&cell["value"], "rate");
        let want = grew as f64 / dt_s;
        expect((rate - want).abs() < 0.002, format!("{chart} {class}: {rate}/s plotted, {grew} in {dt_s} s"));
    }
    // Waiters: the pool waiter, at the burst's sample and now.
    let gated = now.gated("pool");
    assert_eq!(gated, 1.0, "the waiter left early");
    match page["rows"]["chart-waiters"][&at]["pool"]["value"].as_str() {
        Some(v) => expect(v == "1", format!("waiters at the burst's sample: {v}, /metrics 1")),
        None => expect(false, format!("no waiters value at {at}: {}", page["rows"]["chart-waiters"])),
    }
    let last = &page["lines"]["chart-waiters"]["pool"];
    expect(last["last"] == "1", format!("the newest waiters sample {last}, /metrics {gated}"));
    // The oldest hold: /metrics' age less the time from the newest sample to the scrape.
    let line = &page["lines"]["chart-oldest"]["pool"];
    if line.is_null() {
        expect(false, format!("no oldest-hold line for pool: {}", page["lines"]["chart-oldest"]));
    } else {
        let (age_s, at_ms) = (f(&line["last"], "oldest"), f(&line["lastAt"], "lastAt") as u64);
        let gauge = now.by_class("lockmesh_arbiter_oldest_hold_seconds", "pool", |_| true, true);
        let low = gauge - now.recv_ms.saturating_sub(at_ms) as f64 / 1000.0 - 0.05;
        let high = gauge - now.sent_ms.saturating_sub(at_ms) as f64 / 1000.0 + 0.05;
        expect((low..=high).contains(&age_s), format!("oldest hold {age_s} s at the sample, /metrics {gauge} s later"));
    }
    // Hold ages: every open hold in one bar.
    let bars: f64 = page["bars"].as_array().unwrap().iter().map(|b| b.as_f64().unwrap()).sum();
    expect(
        bars == now.open_holds(),
        format!("hold-age bars add up to {bars}, /metrics {} open holds", now.open_holds()),
    );
    expect(f(&page["etcdMean"], "etcd mean") >= 0.0, "etcd latency".into());
    expect(page["overflow"].as_i64() == Some(0), format!("1280 wide: the page overflows by {}", page["overflow"]));

    // At a phone's width: drawn again to fit, nothing wider than the screen.
    browser.viewport(390, 844, true).await;
    browser
        .until(
            "const s = document.querySelector('#chart-grants svg'); return s && Number(s.getAttribute('width')) <= 370;",
            "charts redrawn at a phone's width",
        )
        .await;
    if let Some(dir) = shots {
        browser.screenshot(&dir.join("console-390x844.png")).await;
    }
    let overflow = browser.exec("return document.documentElement.scrollWidth - window.innerWidth;").await;
    expect(overflow.as_i64() == Some(0), format!("390 wide: the page overflows by {overflow}"));
    // The drill-down from the keyboard: Enter on the class, its saturated key with
    // the waiter; Escape closes it and gives the focus back.
    browser.keys("#grants button[data-drill='pool']", ENTER).await;
    let digest = &l.pool_full_digest;
    let waiters = browser
        .until(
            &format!(
                "const d = document.getElementById('drill'); \
                 const td = d.hidden ? null : d.querySelector('tr[data-digest=\"{digest}\"] td[data-waiters]'); \
                 return td && document.activeElement === d ? td.dataset.waiters : null;"
            ),
            "pool's drill-down with the focus",
        )
        .await;
    expect(waiters == "1", format!("the drill-down shows {waiters} waiters on the saturated key, /metrics 1"));
    if let Some(dir) = shots {
        browser.exec("document.getElementById('drill').scrollIntoView({ block: 'start' });").await;
        browser.screenshot(&dir.join("console-drill-390x844.png")).await;
    }
    browser.keys("#drill", ESCAPE).await;
    browser
        .until(
            "return document.getElementById('drill').hidden && document.activeElement.dataset.drill === 'pool';",
            "the drill-down closed, the focus back on its class",
        )
        .await;
    waiter.abort();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}
