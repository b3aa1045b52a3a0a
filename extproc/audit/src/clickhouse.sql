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
    detail         Nullable(String),
    unprotected    Bool DEFAULT false
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(fromUnixTimestamp64Milli(toInt64(at_ms)))
ORDER BY (cluster_id, timeline, revision, epoch, kind, etcd_key);

-- Tables created before fail-open classes (ADR-04) gain the column.
ALTER TABLE lockmesh.audit_events ADD COLUMN IF NOT EXISTS unprotected Bool DEFAULT false;

-- The reconciliation list (ADR-04): every unprotected grant (token 0, a fail-open
-- class granted from an arbiter's memory during a quorum loss), one row per grant
-- id, with its end when that was shipped. Filter on granted_ms for an outage
-- window, or on outage.
CREATE VIEW IF NOT EXISTS lockmesh.audit_unprotected_grants AS
SELECT
    JSONExtractString(g.detail, 'grant_id') AS grant_id,
    JSONExtractString(g.detail, 'outage')   AS outage,
    JSONExtractString(g.detail, 'cluster')  AS cluster,
    g.cluster_id                            AS cluster_id,
    g.class                                 AS class,
    g.digest                                AS digest,
    g.key                                   AS key,
    g.identity                              AS identity,
    g.at_ms                                 AS granted_ms,
    e.kind                                  AS end_kind,
    e.at_ms                                 AS end_ms
FROM (SELECT * FROM lockmesh.audit_events FINAL WHERE unprotected AND kind = 'grant') AS g
LEFT JOIN (SELECT * FROM lockmesh.audit_events FINAL WHERE unprotected AND kind != 'grant') AS e
    ON JSONExtractString(g.detail, 'grant_id') = JSONExtractString(e.detail, 'grant_id');
