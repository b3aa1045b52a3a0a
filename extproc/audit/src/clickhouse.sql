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
-- id (a record shipped into two histories is listed once: its first row by event
-- key), with its end when that was shipped (the first by event key). Filter on
-- granted_ms for an outage window, or on outage. `lockctl audit unprotected` answers
-- the same rows (lockmesh_audit::query::unprotected); aggregates are named u_* and
-- renamed outside (an alias equal to a column it reads would be cyclic).
CREATE OR REPLACE VIEW lockmesh.audit_unprotected_grants AS
SELECT
    g.grant_id     AS grant_id,
    g.outage       AS outage,
    g.cluster      AS cluster,
    g.u_cluster_id AS cluster_id,
    g.u_class      AS class,
    g.u_digest     AS digest,
    g.u_key        AS key,
    g.u_identity   AS identity,
    g.granted_ms   AS granted_ms,
    e.end_kind     AS end_kind,
    e.end_ms       AS end_ms
FROM
(
    SELECT
        JSONExtractString(detail, 'grant_id')                     AS grant_id,
        argMin(JSONExtractString(detail, 'outage'), event_key)    AS outage,
        argMin(JSONExtractString(detail, 'cluster'), event_key)   AS cluster,
        argMin(cluster_id, event_key)                             AS u_cluster_id,
        argMin(toString(ifNull(class, '')), event_key)            AS u_class,
        argMin(ifNull(digest, ''), event_key)                     AS u_digest,
        argMin(ifNull(key, ''), event_key)                        AS u_key,
        argMin(ifNull(identity, ''), event_key)                   AS u_identity,
        argMin(at_ms, event_key)                                  AS granted_ms
    FROM lockmesh.audit_events FINAL
    WHERE unprotected AND kind = 'grant' AND JSONType(detail, 'grant_id') = 'String'
    GROUP BY grant_id
) AS g
LEFT JOIN
(
    SELECT
        JSONExtractString(detail, 'grant_id') AS grant_id,
        argMin(kind, event_key)               AS end_kind,
        argMin(at_ms, event_key)              AS end_ms
    FROM lockmesh.audit_events FINAL
    WHERE unprotected AND kind IN ('release', 'session_release', 'expiry', 'force_release', 'epoch_purge', 'unmarked_delete')
      AND JSONType(detail, 'grant_id') = 'String'
    GROUP BY grant_id
) AS e ON g.grant_id = e.grant_id
SETTINGS join_use_nulls = 1;
