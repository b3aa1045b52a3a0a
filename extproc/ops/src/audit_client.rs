//! The audit tailer's query API (`POST /v1/audit/query` on its query port,
//! docs/AUDIT.md) as a client, for `lockctl audit` and the console.
//!
//! The query port takes HTTPS with a client certificate whose SPIFFE ID it
//! admits, and, when it checks operators' tokens, `Authorization: Bearer`
//! ([`QueryAuth`]). A plain `http://` URL sends neither: the metrics port
//! answers such a query 404, which is reported with where the API lives.

use std::{path::PathBuf, time::Duration};

use lockmesh_core::wire::audit::{Answer, Query};

/// How a caller proves it is an operator to the query port.
#[derive(Debug, Clone, Default)]
pub struct QueryAuth {
    /// CA bundle (PEM) that signed the query port's certificate (required for `https://`).
    pub ca: Option<PathBuf>,
    /// The caller's client certificate (PEM); its SPIFFE ID must be in the
    /// tailer's `query.allowed_clients`.
    pub cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    pub key: Option<PathBuf>,
    /// The operator's token, sent as `Authorization: Bearer` (never logged).
    pub token: Option<String>,
}

/// Sends `query` to the tailer at `url` (`https://host:port`, its query port) and
/// reads its answer. Errors name the URL and what went wrong (never a key:
/// queries carry digests or the caller's own key, which the answer echoes only to
/// that caller; never the token).
pub async fn query(url: &str, query: &Query, auth: &QueryAuth, timeout: Duration) -> Result<Answer, String> {
    let body = post(url, &serde_json::to_string(query).map_err(|e| e.to_string())?, auth, timeout).await?;
    serde_json::from_str(&body).map_err(|e| format!("{url}: the answer does not parse: {e}"))
}

fn read(flag: &str, p: &PathBuf) -> Result<Vec<u8>, String> {
    std::fs::read(p).map_err(|e| format!("{flag}: cannot read {}: {e}", p.display()))
}

/// The HTTP client for `base` with `auth`'s CA and client certificate (for `https://`).
fn client(base: &str, auth: &QueryAuth, timeout: Duration) -> Result<reqwest::Client, String> {
    let mut b = reqwest::Client::builder().timeout(timeout).connect_timeout(Duration::from_secs(5));
    if base.starts_with("https://") {
        let ca = auth.ca.as_ref().ok_or("--ca: required with an https:// URL (the CA of the query port)")?;
        let ca = reqwest::Certificate::from_pem(&read("--ca", ca)?).map_err(|e| format!("--ca: {e}"))?;
        b = b.use_rustls_tls().tls_built_in_root_certs(false).add_root_certificate(ca);
        match (&auth.cert, &auth.key) {
            (Some(cert), Some(key)) => {
                let mut pem = read("--cert", cert)?;
                pem.push(b'\n');
                pem.extend(read("--key", key)?);
                b = b.identity(reqwest::Identity::from_pem(&pem).map_err(|e| format!("--cert/--key: {e}"))?);
            }
            (None, None) => {}
            _ => return Err("--cert and --key: give both (the operator's client certificate)".into()),
        }
    }
    b.build().map_err(|e| lockmesh_runtime::error_chain(&e))
}

/// POSTs `body` (JSON) to `url`'s `/v1/audit/query` with `auth` and returns the
/// answer's body (any transfer encoding) when the status is 200; otherwise the
/// status line and the body, e.g. `HTTP/1.1 403 Forbidden {"code":"admin.client_denied",...}`.
pub async fn post(url: &str, body: &str, auth: &QueryAuth, timeout: Duration) -> Result<String, String> {
    let base = url.trim_end_matches('/');
    if !base.starts_with("http://") && !base.starts_with("https://") {
        return Err(format!("--url {url:?} must start with https:// (the tailer's query port)"));
    }
    let failed = |e: reqwest::Error| {
        if e.is_timeout() {
            format!("{url}: no answer within {}s", timeout.as_secs())
        } else {
            format!("{url}: {}", lockmesh_runtime::error_chain(&e))
        }
    };
    let mut rq = client(base, auth, timeout)?
        .post(format!("{base}/v1/audit/query"))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_owned());
    if let Some(t) = &auth.token {
        rq = rq.bearer_auth(t.trim());
    }
    // reqwest's errors name the URL, never a header: the token stays out.
    let resp = rq.send().await.map_err(failed)?;
    let (version, status) = (resp.version(), resp.status());
    let text = resp.text().await.map_err(failed)?;
    if status == reqwest::StatusCode::NOT_FOUND {
        return Err(format!(
            "{url}: {version:?} {status} {} (the query API is on the tailer's query port, https://, query.listen \
             in audit.yaml; its metrics port answers no query)",
            text.trim()
        ));
    }
    if status != reqwest::StatusCode::OK {
        // As the status line reads: `HTTP/1.1 500 Internal Server Error`.
        return Err(format!("{url}: {version:?} {status} {}", text.trim()));
    }
    Ok(text)
}
