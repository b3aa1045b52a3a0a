-- lockmesh audit events in ClickHouse (docs/AUDIT.md). The tailer inserts with
-- `INSERT INTO lockmesh.audit_events FORMAT JSONEachRow` over the HTTP interface.
-- ReplacingMergeTree on the event key makes replays idempotent: a replayed event
-- has the same key and the same content, and merges keep one row (query with
-- FINAL, or GROUP BY the key, for exact counts before a merge).
CREATE DATABASE IF NOT EXISTS lockmesh;

CREATE TABLE IF NOT EXISTS lockmesh.audit_events
(
    cluster_id     String,
    timeline       UInt32,
    revision       Int64,
    epoch          UInt64,
    kind           LowCardinality(String),
    etcd_key       String,
    event_key      String,
    digest         Nullable(String),
    key            Nullable(String),
    identity       Nullable(String),
    instance       Nullable(String),
    class          LowCardinality(Nullable(String)),
    session        Nullable(String),
    grant_revision Nullable(Int64),
    slot           Nullable(UInt32),
    at_ms          UInt64,
    detail         Nullable(String)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(fromUnixTimestamp64Milli(toInt64(at_ms)))
ORDER BY (cluster_id, timeline, revision, epoch, kind, etcd_key);
