//! The ClickHouse sink: `INSERT ... FORMAT JSONEachRow` over ClickHouse's HTTP
//! interface, into the ReplacingMergeTree of `clickhouse.sql` (shipped here and in
//! docs/AUDIT.md). A batch is sent before the embedded store commits it with the
//! checkpoint, and resent until ClickHouse accepts it; a resent batch replaces its
//! own rows (same sorting key), so the table has neither gaps nor duplicates after
//! merges ([`reports`] reads with `FINAL`, so neither before them).
//!
//! The request is unit-tested here; the DDL, the inserts and every query of
//! [`reports`] run on ClickHouse's engine in `tests/tests/scenarios/audit_clickhouse.rs`.

use std::time::Duration;

use reqwest::header::{HeaderValue, CONTENT_TYPE};

use super::event::AuditEvent;

pub mod reports;

/// The DDL of the audit table.
pub const DDL: &str = include_str!("clickhouse.sql");

/// The statements of [`DDL`], one per request (ClickHouse's HTTP interface runs
/// one statement per request): split at a `;` that ends a line, comment lines
/// dropped.
pub fn ddl_statements() -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in DDL.lines() {
        if line.trim_start().starts_with("--") {
            continue;
        }
        let end = line.trim_end().ends_with(';');
        cur.push_str(line.trim_end().trim_end_matches(';'));
        cur.push('\n');
        if end {
            out.push(std::mem::take(&mut cur).trim().to_owned());
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_owned());
    }
    out
}

/// The bound of one insert: connecting, sending and ClickHouse's whole answer.
const TIMEOUT: Duration = Duration::from_secs(10);

/// A configured sink. `Debug` shows the password as `Sensitive`.
#[derive(Debug, Clone)]
pub struct Sink {
    /// `http://host:port`, without a trailing slash.
    base: String,
    database: String,
    table: String,
    /// `X-ClickHouse-User`.
    user: Option<HeaderValue>,
    /// `X-ClickHouse-Key`, marked sensitive.
    password: Option<HeaderValue>,
    http: reqwest::Client,
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

/// A header value from a configured credential; the error names the field, not
/// the value.
fn header(field: &str, v: Option<String>, sensitive: bool) -> Result<Option<HeaderValue>, String> {
    v.map(|v| {
        let mut h = HeaderValue::from_str(&v).map_err(|_| format!("{field}: not a valid HTTP header value"))?;
        h.set_sensitive(sensitive);
        Ok(h)
    })
    .transpose()
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
        let base = format!("http://{host}:{port}");
        reqwest::Url::parse(&base).map_err(|e| format!("url: {url:?}: {e}"))?;
        let http = reqwest::Client::builder()
            .timeout(TIMEOUT)
            .build()
            .map_err(|e| format!("url: cannot build the HTTP client: {e}"))?;
        Ok(Self {
            base,
            database: database.into(),
            table: table.into(),
            user: header("user", user, false)?,
            password: header("password_file", password, true)?,
            http,
        })
    }

    /// `database.table`.
    pub fn table_name(&self) -> String {
        format!("{}.{}", self.database, self.table)
    }

    /// Runs one statement (`sql`, sent as the body) and answers ClickHouse's output;
    /// an error status is [`SinkError::Refused`].
    pub async fn statement(&self, sql: &str) -> Result<String, SinkError> {
        let mut rq = self.http.post(format!("{}/", self.base)).body(sql.to_owned());
        if let Some(u) = &self.user {
            rq = rq.header("X-ClickHouse-User", u.clone());
        }
        if let Some(p) = &self.password {
            rq = rq.header("X-ClickHouse-Key", p.clone());
        }
        let failed = |e: reqwest::Error| SinkError::Io(lockmesh_runtime::error_chain(&e));
        let resp = rq.send().await.map_err(failed)?;
        let status = resp.status();
        let text = resp.text().await.map_err(failed)?;
        if status.is_success() {
            Ok(text)
        } else {
            Err(SinkError::Refused { status: status.as_u16(), body: text.chars().take(500).collect() })
        }
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
                if crate::test_faults::on(crate::test_faults::TestFault::ClickHouseDropsColumn) {
                    o.remove("identity"); // PLANTED FAULT (tests only): a column left out.
                }
            }
            body.push_str(&v.to_string());
            body.push('\n');
        }
        body
    }

    /// The HTTP request an insert of `events` sends: `POST /?query=INSERT ...` with
    /// the rows as its body and the credentials as ClickHouse's headers.
    pub fn request(&self, events: &[AuditEvent]) -> Result<reqwest::Request, SinkError> {
        let query = format!("INSERT INTO {}.{} FORMAT JSONEachRow", self.database, self.table);
        let mut rq = self
            .http
            .post(format!("{}/?query={}", self.base, query.replace(' ', "%20")))
            .header(CONTENT_TYPE, "application/x-ndjson")
            .body(Self::rows(events));
        if let Some(u) = &self.user {
            rq = rq.header("X-ClickHouse-User", u.clone());
        }
        if let Some(p) = &self.password {
            rq = rq.header("X-ClickHouse-Key", p.clone());
        }
        rq.build().map_err(|e| SinkError::Io(lockmesh_runtime::error_chain(&e)))
    }

    /// Inserts `events`; `Ok` only on a 2xx answer (whatever its transfer
    /// encoding), within 10 s.
    pub async fn insert(&self, events: &[AuditEvent]) -> Result<(), SinkError> {
        if events.is_empty() {
            return Ok(());
        }
        let failed = |e: reqwest::Error| {
            SinkError::Io(if e.is_timeout() {
                format!("no answer within {}s", TIMEOUT.as_secs())
            } else {
                lockmesh_runtime::error_chain(&e)
            })
        };
        let resp = self.http.execute(self.request(events)?).await.map_err(failed)?;
        let status = resp.status();
        let text = resp.text().await.map_err(failed)?;
        if status.is_success() {
            Ok(())
        } else {
            Err(SinkError::Refused { status: status.as_u16(), body: text.chars().take(200).collect() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventKind;

    fn event() -> AuditEvent {
        AuditEvent {
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
        }
    }

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
        let e = event();
        let req = s.request(&[e.clone(), e.clone()]).unwrap();
        assert_eq!(req.method(), reqwest::Method::POST);
        // The host and port (the Host header is the URL's) and the query, spaces as %20.
        assert_eq!(
            req.url().as_str(),
            "http://ch.internal:8124/?query=INSERT%20INTO%20lockmesh.audit_events%20FORMAT%20JSONEachRow"
        );
        assert_eq!(req.headers()["x-clickhouse-user"], "tailer");
        let key = &req.headers()["x-clickhouse-key"];
        assert!(key == "pw" && key.is_sensitive(), "the password header is marked sensitive");
        assert!(!format!("{s:?}").contains("\"pw\""), "password in Debug: {s:?}");
        assert_eq!(req.headers()[CONTENT_TYPE], "application/x-ndjson");
        // The body is the rows, whole (reqwest frames it with its length).
        let body = std::str::from_utf8(req.body().and_then(|b| b.as_bytes()).unwrap()).unwrap();
        assert_eq!(body, Sink::rows(&[e.clone(), e.clone()]));
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
        assert!(DDL.contains("CREATE OR REPLACE VIEW lockmesh.audit_unprotected_grants"));
        assert!(Sink::try_new("https://x", "a", "b", None, None).is_err());
        assert!(Sink::try_new("http://x:1", "a;drop", "b", None, None).unwrap_err().starts_with("database:"));
    }

    /// Against a loopback server standing in for ClickHouse: an insert arrives with
    /// its query, credentials and rows; a refusal sent chunked (ClickHouse streams
    /// its exceptions) is read whole and reported with its status.
    #[tokio::test]
    async fn an_insert_reaches_the_server_and_a_chunked_refusal_is_read() {
        use std::{
            collections::HashMap,
            sync::{Arc, Mutex},
        };

        use axum::{
            body::Body,
            extract::{Query, State},
            http::{HeaderMap, StatusCode},
            response::{IntoResponse, Response},
            routing::post,
            Router,
        };

        type Seen = Arc<Mutex<Vec<(String, Option<String>, String)>>>;
        async fn ch(
            State(seen): State<Seen>,
            Query(q): Query<HashMap<String, String>>,
            headers: HeaderMap,
            body: String,
        ) -> Response {
            let query = q.get("query").cloned().unwrap_or_default();
            let user = headers.get("x-clickhouse-user").and_then(|v| v.to_str().ok()).map(str::to_owned);
            let refuse = query.contains("missing");
            seen.lock().unwrap().push((query, user, body));
            if refuse {
                let parts = ["Code: 60. DB::Exception: ", "Table lockmesh.missing does not exist."];
                let stream = futures::stream::iter(parts.map(Ok::<_, std::io::Error>));
                (StatusCode::NOT_FOUND, Body::from_stream(stream)).into_response()
            } else {
                StatusCode::OK.into_response()
            }
        }
        let seen = Seen::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new().route("/", post(ch)).with_state(seen.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });

        let e = event();
        let ok = Sink::try_new(&url, "lockmesh", "audit_events", Some("tailer".into()), None).unwrap();
        ok.insert(&[e.clone()]).await.unwrap();
        ok.insert(&[]).await.unwrap();
        let refused = Sink::try_new(&url, "lockmesh", "missing", None, None).unwrap();
        match refused.insert(&[e.clone()]).await {
            Err(SinkError::Refused { status, body }) => {
                assert_eq!(status, 404);
                assert_eq!(body, "Code: 60. DB::Exception: Table lockmesh.missing does not exist.");
            }
            other => panic!("not a refusal: {other:?}"),
        }
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2, "an empty batch sends nothing: {seen:?}");
        assert_eq!(seen[0].0, "INSERT INTO lockmesh.audit_events FORMAT JSONEachRow");
        assert_eq!(seen[0].1.as_deref(), Some("tailer"));
        assert_eq!(seen[0].2, Sink::rows(&[e]));
        assert_eq!(seen[1].1, None);

        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gone = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let err = Sink::try_new(&gone, "lockmesh", "audit_events", None, None).unwrap().insert(&[event()]).await;
        assert!(matches!(err, Err(SinkError::Io(_))), "{err:?}");
    }
}
