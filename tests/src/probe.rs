//! A minimal HTTP/1.1 GET over a fresh loopback TCP connection.
//!
//! Readiness and admin probes use it instead of a pooled HTTP client because
//! the shared etcd outlives the tokio runtime of the test that started it: a
//! connection pool created in one runtime cannot be used from another. Each
//! call opens, uses and closes its own connection.

use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Default per-call deadline for connect, write and read. A paused (SIGSTOP)
/// process accepts connections in the kernel but never answers.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A decoded HTTP response.
#[derive(Clone, Debug)]
pub struct ProbeResponse {
    /// Status code.
    pub status: u16,
    /// Body, with chunked transfer encoding removed.
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

async fn get(port: u16, path: &str) -> Result<ProbeResponse> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\nAccept: */*\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    parse(&raw)
}

fn parse(raw: &[u8]) -> Result<ProbeResponse> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").context("no end of headers in response")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let chunked = lines.any(|line| {
        let lower = line.to_ascii_lowercase();
        lower.starts_with("transfer-encoding:") && lower.contains("chunked")
    });
    let body = if chunked { dechunk(body)? } else { body.to_vec() };
    Ok(ProbeResponse { status, body: String::from_utf8_lossy(&body).into_owned() })
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = data.windows(2).position(|w| w == b"\r\n").context("truncated chunk size line")?;
        let size_field = String::from_utf8_lossy(&data[..eol]);
        let size_hex = size_field.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16).with_context(|| format!("bad chunk size {size_hex:?}"))?;
        data = &data[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size + 2 {
            bail!("truncated chunk: want {size} bytes, have {}", data.len());
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked() {
        let plain = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nLIVE").unwrap();
        assert_eq!((plain.status, plain.body.as_str()), (200, "LIVE"));
        let chunked = parse(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((chunked.status, chunked.body.as_str()), (503, "abcde"));
        assert!(parse(b"garbage").is_err());
    }
}
