//! The ClickHouse sink: `INSERT ... FORMAT JSONEachRow` over ClickHouse's HTTP
//! interface, into the ReplacingMergeTree of `clickhouse.sql` (shipped here and in
//! docs/AUDIT.md). A batch is sent before the embedded store commits it with the
//! checkpoint, and resent until ClickHouse accepts it; a resent batch replaces its
//! own rows (same sorting key), so the table has neither gaps nor duplicates after
//! merges. ClickHouse is not installed on the development machines, so only the
//! request is tested (`tests` below), not a live insert.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::event::AuditEvent;

/// The DDL of the audit table.
pub const DDL: &str = include_str!("clickhouse.sql");

/// A configured sink.
#[derive(Debug, Clone)]
pub struct Sink {
    host: String,
    port: u16,
    database: String,
    table: String,
    user: Option<String>,
    password: Option<String>,
}

/// Why an insert failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Connecting, writing or reading failed.
    #[error("clickhouse unreachable: {0}")]
    Io(String),
    /// ClickHouse answered with an error status.
    #[error("clickhouse answered {status}: {body}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The start of its message.
        body: String,
    },
}

fn ident_ok(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

// === impl Sink ===

impl Sink {
    /// Validates the settings; errors name the field (`url: ...`).
    pub fn try_new(
        url: &str,
        database: &str,
        table: &str,
        user: Option<String>,
        password: Option<String>,
    ) -> Result<Self, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("url: {url:?} must start with http://"))?;
        let hostport = rest.trim_end_matches('/');
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) => (h, p.parse::<u16>().map_err(|_| format!("url: {url:?} has no valid port"))?),
            None => (hostport, 8123),
        };
        if host.is_empty() || hostport.contains('/') {
            return Err(format!("url: {url:?} must be http://host[:port]"));
        }
        for (field, v) in [("database", database), ("table", table)] {
            if !ident_ok(v) {
                return Err(format!("{field}: {v:?} must be [A-Za-z0-9_]+"));
            }
        }
        Ok(Self { host: host.into(), port, database: database.into(), table: table.into(), user, password })
    }

    /// One JSONEachRow line per event, with the event key and `detail` as a string.
    pub fn rows(events: &[AuditEvent]) -> String {
        let mut body = String::new();
        for e in events {
            let mut v = serde_json::to_value(e).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("event_key".into(), e.event_key().into());
                let detail = o.remove("detail").map(|d| d.to_string());
                o.insert("detail".into(), detail.into());
                // Always set: the reconciliation view filters on it.
                o.insert("unprotected".into(), e.unprotected.into());
            }
            body.push_str(&v.to_string());
            body.push('\n');
        }
        body
    }

    /// The full HTTP/1.1 request an insert of `events` sends.
    pub fn request(&self, events: &[AuditEvent]) -> Vec<u8> {
        let body = Self::rows(events);
        let query = format!("INSERT INTO {}.{} FORMAT JSONEachRow", self.database, self.table);
        let mut req = format!(
            "POST /?query={} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/x-ndjson\r\nContent-Length: {}\r\nConnection: close\r\n",
            query.replace(' ', "%20"),
            self.host,
            self.port,
            body.len()
        );
        if let Some(u) = &self.user {
            req.push_str(&format!("X-ClickHouse-User: {u}\r\n"));
        }
        if let Some(p) = &self.password {
            req.push_str(&format!("X-ClickHouse-Key: {p}\r\n"));
        }
        req.push_str("\r\n");
        let mut out = req.into_bytes();
        out.extend_from_slice(body.as_bytes());
        out
    }

    /// Inserts `events`; `Ok` only on a 2xx answer.
    pub async fn insert(&self, events: &[AuditEvent]) -> Result<(), SinkError> {
        if events.is_empty() {
            return Ok(());
        }
        let io = |e: std::io::Error| SinkError::Io(e.to_string());
        let run = async {
            let mut s = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await.map_err(io)?;
            s.write_all(&self.request(events)).await.map_err(io)?;
            let mut resp = Vec::new();
            s.read_to_end(&mut resp).await.map_err(io)?;
            Ok::<_, SinkError>(resp)
        };
        let resp = tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .map_err(|_| SinkError::Io("no answer within 10s".into()))??;
        let text = String::from_utf8_lossy(&resp);
        let status = text.split(' ').nth(1).and_then(|s| s.parse::<u16>().ok()).unwrap_or(0);
        if (200..300).contains(&status) {
            Ok(())
        } else {
            let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().chars().take(200).collect();
            Err(SinkError::Refused { status, body })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventKind;

    #[test]
    fn the_insert_request_is_json_each_row_into_the_shipped_table() {
        let s = Sink::try_new(
            "http://ch.internal:8124",
            "lockmesh",
            "audit_events",
            Some("tailer".into()),
            Some("pw".into()),
        )
        .unwrap();
        let e = AuditEvent {
            cluster_id: "00000000000000aa".into(),
            timeline: 1,
            epoch: 2,
            revision: 42,
            etcd_key: "/r/l/dd/h/0000".into(),
            kind: EventKind::Expiry,
            digest: Some("dd".into()),
            key: Some("a/b".into()),
            identity: Some("spiffe://x/a".into()),
            instance: None,
            class: Some("default".into()),
            session: Some("000000000000001f".into()),
            grant_revision: Some(40),
            slot: Some(0),
            at_ms: 7,
            detail: Some(serde_json::json!({"x": 1})),
            unprotected: false,
        };
        let req = String::from_utf8(s.request(&[e.clone(), e.clone()])).unwrap();
        let (head, body) = req.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("POST /?query=INSERT%20INTO%20lockmesh.audit_events%20FORMAT%20JSONEachRow HTTP/1.1\r\n")
        );
        assert!(head.contains("Host: ch.internal:8124\r\n"));
        assert!(head.contains("X-ClickHouse-User: tailer\r\n") && head.ends_with("\r\nX-ClickHouse-Key: pw"));
        assert!(head.contains(&format!("Content-Length: {}\r\n", body.len())));
        let lines: Vec<serde_json::Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event_key"], e.event_key());
        assert_eq!(lines[0]["kind"], "expiry");
        assert_eq!(lines[0]["detail"], "{\"x\":1}");
        assert!(lines[0].get("instance").is_none(), "absent fields are left to ClickHouse defaults");
        // Every column of a row exists in the shipped DDL, and the sorting key is the event key's parts.
        for col in lines[0].as_object().unwrap().keys() {
            assert!(DDL.contains(&format!("    {col} ")), "column {col} missing from clickhouse.sql");
        }
        assert!(DDL.contains("ENGINE = ReplacingMergeTree"));
        assert!(DDL.contains("ORDER BY (cluster_id, timeline, revision, epoch, kind, etcd_key)"));
        assert_eq!(lines[0]["unprotected"], false);
        let mut u = e.clone();
        u.unprotected = true;
        let row: serde_json::Value = serde_json::from_str(Sink::rows(&[u]).trim()).unwrap();
        assert_eq!(row["unprotected"], true);
        assert!(DDL.contains("CREATE VIEW IF NOT EXISTS lockmesh.audit_unprotected_grants"));
        assert!(Sink::try_new("https://x", "a", "b", None, None).is_err());
        assert!(Sink::try_new("http://x:1", "a;drop", "b", None, None).unwrap_err().starts_with("database:"));
    }
}
