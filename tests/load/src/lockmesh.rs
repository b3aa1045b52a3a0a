//! The `lockmesh` workload's client: its own mTLS connection to the lock tier,
//! its own session renewed every TTL/3 in the background, then `acquire`
//! (`x-lock-key`, `x-lock-session`, `x-lock-wait-ms`) and `release` (`x-lock-key`,
//! `x-lock-token`, `x-lock-session`). `lockmesh-oneshot` opens no session: each
//! acquire names none and its release names the one the answer gave.
//!
//! HTTP/2 is spoken with prior knowledge: the shipped lock-tier listener sets no
//! `alpn_protocols`, so ALPN would settle on HTTP/1.1, while Envoy's `AUTO` codec
//! recognises the HTTP/2 preface. `http1` forces HTTP/1.1 instead, for comparison.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use tokio::task::JoinHandle;

use super::record::Recorder;
use lockmesh_tests::client::REQUEST_TIMEOUT;

/// One lock-tier client with its session.
pub(crate) struct LockmeshClient {
    http: reqwest::Client,
    base: String,
    class_key: String,
    wait_ms: String,
    session: String,
    /// Whether the client keeps a session of its own (`lockmesh`), or each acquire
    /// opens one (`lockmesh-oneshot`).
    own_session: bool,
    keeper: Option<JoinHandle<()>>,
    token: Option<String>,
    version: String,
    rec: Arc<Recorder>,
}

/// A refusal or an answer that is not the expected JSON.
fn refused(status: reqwest::StatusCode, body: &serde_json::Value) -> anyhow::Error {
    match body["code"].as_str() {
        Some(code) => anyhow::anyhow!("{} {code}", status.as_u16()),
        None => anyhow::anyhow!("{} (no lockmesh error code)", status.as_u16()),
    }
}

/// `POST url` with `headers` and an empty body: status, HTTP version and the body as
/// JSON (`Null` when it is not JSON).
pub(crate) async fn post(
    http: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
) -> Result<(reqwest::StatusCode, reqwest::Version, serde_json::Value)> {
    let mut req = http.post(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await?;
    let (status, version) = (resp.status(), resp.version());
    let bytes = resp.bytes().await?;
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Ok((status, version, json))
}

/// An HTTP client of the lock tier on `https://localhost:<port>` (127.0.0.1) as
/// (`cert`, `key`), trusting only `ca`: one connection, HTTP/2 with prior knowledge
/// (or HTTP/1.1 with `http1`), `TCP_NODELAY`.
pub(crate) fn lock_tier_http(port: u16, ca: &Path, cert: &Path, key: &Path, http1: bool) -> Result<reqwest::Client> {
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("read {}", p.display()));
    let mut pem = read(cert)?;
    pem.push(b'\n');
    pem.extend(read(key)?);
    let builder = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&read(ca)?)?)
        .identity(reqwest::Identity::from_pem(&pem)?)
        .resolve("localhost", SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
        .timeout(REQUEST_TIMEOUT)
        .tcp_nodelay(true);
    let builder = if http1 { builder.http1_only() } else { builder.http2_prior_knowledge() };
    Ok(builder.build()?)
}

// === impl LockmeshClient ===

impl LockmeshClient {
    /// Connects to `https://localhost:<port>` (127.0.0.1) as (`cert`, `key`),
    /// trusting only `ca`, and, with `own_session`, opens a session of
    /// `class_key`'s class.
    pub async fn connect(
        port: u16,
        ca: &Path,
        (cert, key): (&Path, &Path),
        http1: bool,
        (class_key, own_session): (&str, bool),
        wait_ms: u64,
        rec: Arc<Recorder>,
    ) -> Result<Self> {
        let mut c = Self {
            http: lock_tier_http(port, ca, cert, key, http1)?,
            base: format!("https://localhost:{port}"),
            class_key: class_key.to_owned(),
            wait_ms: wait_ms.to_string(),
            session: String::new(),
            own_session,
            keeper: None,
            token: None,
            version: String::new(),
            rec,
        };
        if own_session {
            c.open().await?;
        }
        Ok(c)
    }

    /// The HTTP version of the session answer (`HTTP/2.0` expected).
    pub fn http_version(&self) -> &str {
        &self.version
    }

    async fn open(&mut self) -> Result<()> {
        let url = format!("{}/v1/sessions", self.base);
        let (status, version, json) =
            post(&self.http, &url, &[("x-lock-key", &self.class_key)]).await.context("open session")?;
        if status != 200 {
            return Err(refused(status, &json)).context("open session");
        }
        let session = json["session"].as_str().context("open session: no session in the answer")?.to_owned();
        let ttl_s = json["ttl_s"].as_u64().unwrap_or(15).max(1);
        self.version = format!("{version:?}");
        self.session = session.clone();
        let (http, rec) = (self.http.clone(), self.rec.clone());
        let url = format!("{}/v1/sessions/keepalive", self.base);
        self.keeper = Some(tokio::spawn(async move {
            let period = Duration::from_millis(ttl_s * 1000 / 3);
            loop {
                tokio::time::sleep(period).await;
                match post(&http, &url, &[("x-lock-session", &session)]).await {
                    Ok((s, _, _)) if s == 200 => {}
                    Ok((s, _, j)) => rec.error("lockmesh keepalive", &refused(s, &j).to_string()),
                    Err(e) => rec.error("lockmesh keepalive", &format!("{e:#}")),
                }
            }
        }));
        Ok(())
    }

    /// One acquire; the token.
    pub async fn acquire(&mut self, key: &str) -> Result<u64> {
        let url = format!("{}/v1/locks/acquire", self.base);
        let mut headers = vec![("x-lock-key", key), ("x-lock-wait-ms", self.wait_ms.as_str())];
        if self.own_session {
            headers.push(("x-lock-session", self.session.as_str()));
        }
        let (status, version, json) = post(&self.http, &url, &headers).await?;
        if status != 200 {
            return Err(refused(status, &json));
        }
        if !self.own_session {
            self.session = json["session"].as_str().context("no session in the answer")?.to_owned();
            self.version = format!("{version:?}");
        }
        let token = json["token"].as_str().context("no token in the answer")?;
        let value = token.parse::<u64>().with_context(|| format!("token {token:?} is not a u64"))?;
        self.token = Some(token.to_owned());
        Ok(value)
    }

    /// Releases the grant of the last acquire.
    pub async fn release(&mut self, key: &str) -> Result<()> {
        let Some(token) = self.token.take() else {
            bail!("nothing to release");
        };
        let url = format!("{}/v1/locks/release", self.base);
        let headers =
            [("x-lock-key", key), ("x-lock-token", token.as_str()), ("x-lock-session", self.session.as_str())];
        let (status, _, json) = post(&self.http, &url, &headers).await?;
        if status != 200 {
            return Err(refused(status, &json));
        }
        Ok(())
    }

    /// Closes the session (ending any hold) and opens a new one.
    pub async fn reset(&mut self) -> Result<()> {
        self.end().await;
        if self.own_session {
            self.open().await?;
        }
        Ok(())
    }

    async fn end(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
        self.token = None;
        if self.session.is_empty() {
            return;
        }
        let url = format!("{}/v1/sessions/close", self.base);
        let session = std::mem::take(&mut self.session);
        match post(&self.http, &url, &[("x-lock-session", &session)]).await {
            Ok((s, _, _)) if s == 200 => {}
            // An acquire's own session may have ended with its last hold already.
            Ok((s, _, _)) if s == 410 && !self.own_session => {}
            Ok((s, _, j)) => self.rec.error("lockmesh close", &refused(s, &j).to_string()),
            Err(e) => self.rec.error("lockmesh close", &format!("{e:#}")),
        }
    }

    /// Closes the session.
    pub async fn close(mut self) {
        self.end().await;
    }
}

impl Drop for LockmeshClient {
    fn drop(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
    }
}
