//! The audit tailer's query API (`POST /v1/audit/query`, docs/AUDIT.md) as a
//! client, for `lockctl audit` and the console.

use std::time::Duration;

use lockmesh_core::wire::audit::{Answer, Query};

/// Sends `query` to the tailer at `url` (`http://host:port`) and reads its answer.
/// Errors name the URL and what went wrong (never a key: queries carry digests
/// or the caller's own key, which the answer echoes only to that caller).
pub async fn query(url: &str, query: &Query, timeout: Duration) -> Result<Answer, String> {
    let body = post(url, &serde_json::to_string(query).map_err(|e| e.to_string())?, timeout).await?;
    serde_json::from_str(&body).map_err(|e| format!("{url}: the answer does not parse: {e}"))
}

/// POSTs `body` (JSON) to `url`'s `/v1/audit/query` and returns the answer's body
/// when the status is 200.
pub async fn post(url: &str, body: &str, timeout: Duration) -> Result<String, String> {
    let base = url.trim_end_matches('/');
    if !base.starts_with("http://") && !base.starts_with("https://") {
        return Err(format!("--url {url:?} must start with http:// or https://"));
    }
    let client = reqwest::Client::builder().timeout(timeout).build().map_err(|e| e.to_string())?;
    let r = client
        .post(format!("{base}/v1/audit/query"))
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .map_err(|e| format!("{url}: {}", lockmesh_runtime::error_chain(&e)))?;
    let status = r.status();
    let text = r.text().await.map_err(|e| format!("{url}: {}", lockmesh_runtime::error_chain(&e)))?;
    if status != reqwest::StatusCode::OK {
        return Err(format!("{url}: HTTP/1.1 {status} {}", text.trim()));
    }
    Ok(text)
}
