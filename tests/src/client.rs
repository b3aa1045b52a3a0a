//! HTTPS clients for the Envoy listener, one per workload identity.
//!
//! A [`LockClient`] trusts only the test CA, presents the given client
//! certificate (or none), resolves `localhost` to 127.0.0.1 and lets ALPN
//! pick HTTP/2 or HTTP/1.1.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result};
use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};

/// Per-request timeout: longer than the arbiter's default `max_wait_ms` (30 s).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A client bound to `https://localhost:<port>` with one TLS identity.
#[derive(Clone, Debug)]
pub struct LockClient {
    http: reqwest::Client,
    base_url: String,
}

/// A response, fully read.
#[derive(Clone, Debug)]
pub struct Resp {
    /// HTTP status.
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// The body parsed as JSON, `Value::Null` if it is not JSON.
    pub json: serde_json::Value,
    /// The body as text.
    pub body: String,
    /// HTTP version used (HTTP/2 when ALPN chose it).
    pub version: reqwest::Version,
}

// === impl LockClient ===

impl LockClient {
    /// A client for `https://localhost:<port>` trusting `ca_pem` only and
    /// presenting `identity` (certificate and key PEM paths), if given.
    pub fn new(port: u16, ca_pem: &Path, identity: Option<(&Path, &Path)>) -> Result<Self> {
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("read {}", p.display()));
        let identity = match identity {
            Some((cert, key)) => Some((read(cert)?, read(key)?)),
            None => None,
        };
        Self::from_pem(port, &read(ca_pem)?, identity.as_ref().map(|(c, k)| (&c[..], &k[..])))
    }

    /// [`LockClient::new`] from PEM bytes: the CA bundle (every certificate in it
    /// trusted) and the identity's certificate and key, for example one consistent
    /// set read from a directory being rotated.
    pub fn from_pem(port: u16, ca_pem: &[u8], identity: Option<(&[u8], &[u8])>) -> Result<Self> {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .resolve("localhost", SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            .timeout(REQUEST_TIMEOUT);
        for ca in reqwest::Certificate::from_pem_bundle(ca_pem)? {
            builder = builder.add_root_certificate(ca);
        }
        if let Some((cert, key)) = identity {
            let mut pem = cert.to_vec();
            pem.push(b'\n');
            pem.extend_from_slice(key);
            builder = builder.identity(reqwest::Identity::from_pem(&pem)?);
        }
        Ok(Self { http: builder.build()?, base_url: format!("https://localhost:{port}") })
    }

    /// `https://localhost:<port>`.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The underlying reqwest client, for requests the helpers do not cover.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// `GET path` with extra headers.
    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Result<Resp> {
        self.request(Method::GET, path, headers, Vec::new()).await
    }

    /// `POST path` with extra headers and an empty body.
    pub async fn post(&self, path: &str, headers: &[(&str, &str)]) -> Result<Resp> {
        self.request(Method::POST, path, headers, Vec::new()).await
    }

    /// Any request; `path` starts with `/`.
    pub async fn request(&self, method: Method, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Result<Resp> {
        let url = format!("{}{path}", self.base_url);
        let mut req = self.http.request(method.clone(), &url).body(body);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let resp = req.send().await.with_context(|| format!("{method} {url}"))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let version = resp.version();
        let body = resp.text().await.with_context(|| format!("{method} {url}: read body"))?;
        let json = serde_json::from_str(&body).unwrap_or(serde_json::Value::Null);
        Ok(Resp { status, headers, json, body, version })
    }
}

// === impl Resp ===

impl Resp {
    /// The first value of header `name`, if present and valid text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The status as a number.
    pub fn code(&self) -> u16 {
        self.status.as_u16()
    }
}
