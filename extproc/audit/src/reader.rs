//! Where the audit queries are answered from: one trait, [`Reader`], with the
//! embedded store (redb, [`Store`]) and ClickHouse ([`ClickHouseReader`]) behind it.
//! The query port (`crate::query_port`) answers every query through the reader of
//! the configured store ([`for_config`]): ClickHouse when `audit.yaml` has a
//! `clickhouse:` section, the embedded store otherwise. Both answer the same rows
//! in the same order for the same history (`tests/tests/scenarios/audit_clickhouse.rs`
//! compares them query by query, through the query port too).

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::{
    clickhouse::{Sink, SinkError},
    config::Config,
    query::{self, Answer, Query},
    store::{Store, StoreError},
};

/// Why a query was not answered.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The embedded store failed.
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// ClickHouse was unreachable, refused the query, or answered rows that do not
    /// parse.
    #[error("{0}")]
    ClickHouse(#[from] SinkError),
}

impl ReadError {
    /// Whether the failure is the store's server being away (unreachable), which
    /// the query port answers `503`, rather than a fault (`500`).
    pub fn unavailable(&self) -> bool {
        matches!(self, Self::ClickHouse(SinkError::Io(_)))
    }

    /// The error as logged: ClickHouse's refusal by its status and error code only
    /// (its message may quote the statement, and so what the query names).
    pub fn log_text(&self) -> String {
        match self {
            Self::ClickHouse(SinkError::Refused { status, body }) => {
                let code = body.strip_prefix("Code: ").and_then(|b| b.split('.').next()).unwrap_or("?");
                format!("clickhouse answered {status} (Code: {code})")
            }
            e => e.to_string(),
        }
    }
}

/// A store the audit queries are answered from.
pub trait Reader: Send + Sync {
    /// The store's name as the query port reports it (header
    /// `x-lockmesh-audit-store`): `embedded` or `clickhouse`.
    fn name(&self) -> &'static str;

    /// Answers `q`, open holds counted up to `now_ms`.
    fn answer<'a>(&'a self, q: &'a Query, now_ms: u64) -> BoxFuture<'a, Result<Answer, ReadError>>;
}

/// The embedded store answers from its own tables (`query::run`).
impl Reader for Store {
    fn name(&self) -> &'static str {
        "embedded"
    }

    fn answer<'a>(&'a self, q: &'a Query, now_ms: u64) -> BoxFuture<'a, Result<Answer, ReadError>> {
        Box::pin(async move { Ok(query::run(self, q, now_ms)?) })
    }
}

/// ClickHouse answers with the SQL of `clickhouse::reports` (every read with
/// `FINAL`). The embedded store, which the tailer always keeps for its
/// checkpoint, names the current history (cluster id and timeline) that `recent`
/// reads; before the first checkpoint `recent` answers nothing, as the embedded
/// store does.
pub struct ClickHouseReader {
    sink: Sink,
    checkpoints: Arc<Store>,
}

impl ClickHouseReader {
    /// A reader of the sink's table, with the checkpoint of `checkpoints`.
    pub fn new(sink: Sink, checkpoints: Arc<Store>) -> Self {
        Self { sink, checkpoints }
    }
}

impl Reader for ClickHouseReader {
    fn name(&self) -> &'static str {
        "clickhouse"
    }

    fn answer<'a>(&'a self, q: &'a Query, now_ms: u64) -> BoxFuture<'a, Result<Answer, ReadError>> {
        Box::pin(async move {
            if crate::test_faults::on(crate::test_faults::TestFault::QueryPortReadsEmbedded) {
                // PLANTED FAULT (tests only): the embedded store answers instead.
                return Ok(query::run(&self.checkpoints, q, now_ms)?);
            }
            let cp = match self.checkpoints.checkpoint()? {
                Some(cp) => cp,
                None if matches!(q, Query::Recent { .. }) => return Ok(Answer::Events { events: Vec::new() }),
                None => Default::default(),
            };
            Ok(self.sink.run(q, now_ms, &cp).await?)
        })
    }
}

/// The reader of the configured store: ClickHouse when `cfg.clickhouse` is set,
/// else the embedded `store`.
pub fn for_config(cfg: &Config, store: Arc<Store>) -> Arc<dyn Reader> {
    match &cfg.clickhouse {
        Some(sink) => Arc::new(ClickHouseReader::new(sink.clone(), store)),
        None => store,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (Arc<Store>, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("lm-audit-reader-{}-{:x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        (Arc::new(Store::open(&dir.join("audit.redb")).unwrap()), dir)
    }

    #[tokio::test]
    async fn an_unreachable_clickhouse_is_unavailable_and_a_refusal_is_logged_by_its_code() {
        let (store, dir) = store();
        let embedded: &dyn Reader = store.as_ref();
        assert_eq!(embedded.name(), "embedded");
        let a = embedded.answer(&Query::Longest { limit: 3 }, 0).await.unwrap();
        assert_eq!(a, Answer::Holds { holds: Vec::new() });

        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let sink = Sink::try_new(&url, "lockmesh", "audit_events", None, None).unwrap();
        let ch = ClickHouseReader::new(sink, store.clone());
        assert_eq!(ch.name(), "clickhouse");
        // Before the first checkpoint `recent` is empty on both, without a request.
        assert_eq!(ch.answer(&Query::Recent { limit: 5 }, 0).await.unwrap(), Answer::Events { events: Vec::new() });
        let err = ch.answer(&Query::Longest { limit: 3 }, 0).await.unwrap_err();
        assert!(err.unavailable(), "{err}");

        let refused = ReadError::ClickHouse(SinkError::Refused {
            status: 400,
            body: "Code: 62. DB::Exception: Syntax error near 'spiffe://td/ns/a/sa/b'".into(),
        });
        assert!(!refused.unavailable());
        assert_eq!(refused.log_text(), "clickhouse answered 400 (Code: 62)");
        drop(store);
        let _ = std::fs::remove_dir_all(dir);
    }
}
