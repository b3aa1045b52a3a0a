//! A minimal HTTP GET of a loopback port, for readiness and admin probes.
//!
//! Each call builds its own client and keeps no idle connection: the shared etcd
//! outlives the tokio runtime of the test that started it, and a pooled
//! connection created in one runtime cannot be used from another. Each call
//! opens, uses and closes its own connection.

use std::time::Duration;

use anyhow::{Context as _, Result};

/// Default per-call deadline for connect, request and the whole answer. A paused
/// (SIGSTOP) process accepts connections in the kernel but never answers.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A decoded HTTP response.
#[derive(Clone, Debug)]
pub struct ProbeResponse {
    /// HTTP status code.
    pub status: u16,
    /// Body, with any transfer encoding (chunked) removed.
    pub body: String,
}

/// `GET path` from `127.0.0.1:port` within [`PROBE_TIMEOUT`].
pub async fn http_get(port: u16, path: &str) -> Result<ProbeResponse> {
    http_get_within(port, path, PROBE_TIMEOUT).await
}

/// `GET path` from `127.0.0.1:port` within `timeout`.
pub async fn http_get_within(port: u16, path: &str, timeout: Duration) -> Result<ProbeResponse> {
    tokio::time::timeout(timeout, get(port, path))
        .await
        .with_context(|| format!("GET 127.0.0.1:{port}{path}: timed out"))?
        .with_context(|| format!("GET 127.0.0.1:{port}{path}"))
}

async fn get(port: u16, path: &str) -> Result<ProbeResponse, reqwest::Error> {
    // Loopback only: no proxy from the environment, no connection kept.
    let client = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(0).build()?;
    let resp =
        client.get(format!("http://127.0.0.1:{port}{path}")).header(reqwest::header::ACCEPT, "*/*").send().await?;
    let status = resp.status().as_u16();
    // Not UTF-8 (a binary body) is read lossily, as a probe only looks for text.
    let body = String::from_utf8_lossy(&resp.bytes().await?).into_owned();
    Ok(ProbeResponse { status, body })
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// A loopback port answering each connection with `reply` after reading the
    /// request head.
    async fn serve(reply: &'static [u8]) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(reply).await;
            }
        });
        port
    }

    #[tokio::test]
    async fn reads_plain_and_chunked() {
        let plain = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nLIVE").await;
        let r = http_get(plain, "/ready").await.unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "LIVE"));
        let chunked = serve(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .await;
        let r = http_get(chunked, "/ready").await.unwrap();
        assert_eq!((r.status, r.body.as_str()), (503, "abcde"));
        let garbage = serve(b"garbage").await;
        assert!(http_get(garbage, "/").await.is_err());
    }

    #[tokio::test]
    async fn a_silent_port_times_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let e = http_get_within(port, "/ready", Duration::from_millis(200)).await.unwrap_err();
        assert_eq!(e.to_string(), format!("GET 127.0.0.1:{port}/ready: timed out"));
        drop(listener);
    }
}
