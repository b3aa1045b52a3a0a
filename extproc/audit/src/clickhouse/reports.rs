//! The audit queries ([`crate::query::Query`]) as ClickHouse SQL over the sink's
//! table, answering what [`crate::query::run`] answers from the embedded store for
//! the same history: the same rows in the same order. Every query reads the table
//! with `FINAL`, so a batch the tailer sent twice (a crash between ClickHouse's
//! answer and the local commit) counts once before the merge that collapses it.
//!
//! Order: the embedded store iterates events by their event key, which is also a
//! column here (`event_key`, compared bytewise in both); holds by their hold id
//! (cluster, timeline, grant revision, etcd key), used as the tie-break of each sort.
//! `tests/tests/scenarios/audit_clickhouse.rs` checks each query against the store.

use serde::Deserialize;
use serde_json::Value;

use super::{Sink, SinkError};
use crate::{
    event::{AuditEvent, EventKind, HoldEnd, HoldRow},
    query::{Answer, HoldSpan, Query, ShadowSum, UnprotectedEnd, UnprotectedGrant, MAX_RECENT},
    store::Checkpoint,
};

/// The kinds that end a hold, as an SQL list.
fn ends_sql() -> String {
    EventKind::ALL.iter().filter(|k| k.ends_hold()).map(|k| format!("'{}'", k.as_str())).collect::<Vec<_>>().join(", ")
}

/// A string literal: ClickHouse's quoting (backslash escapes).
fn lit(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        match c {
            '\'' => out.push_str("\\'"),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\0' => out.push_str("\\0"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// 64-bit integers as JSON numbers, whatever the server's default.
const SETTINGS: &str = "SETTINGS output_format_json_quote_64bit_integers = 0, join_use_nulls = 1";

const EVENT_COLUMNS: &str = "cluster_id, timeline, revision, epoch, kind, etcd_key, digest, key, identity, instance, \
                             class, session, grant_revision, slot, at_ms, detail, unprotected";

/// One hold per (cluster, timeline, grant revision, etcd key): the grant's fields
/// when the grant is in the table, else the end's (a hold granted before the
/// history) with `granted_ms` 0; the end, if any, the last by event key. The
/// aggregates are named `h_*` (an alias equal to a column it reads would be cyclic).
fn holds_sql(table: &str) -> String {
    let ends = ends_sql();
    let pick = |col: &str| {
        format!(
            "if(has_grant, argMaxIf({col}, event_key, kind = 'grant'), argMaxIf({col}, event_key, kind != 'grant'))"
        )
    };
    format!(
        "SELECT cluster_id, timeline, grant_revision, etcd_key, toBool(countIf(kind = 'grant') > 0) AS has_grant, \
         {digest} AS h_digest, {key} AS h_key, {identity} AS h_identity, {class} AS h_class, {epoch} AS h_epoch, \
         {session} AS h_session, if(has_grant, maxIf(at_ms, kind = 'grant'), toUInt64(0)) AS granted_ms, \
         toBool(countIf(kind != 'grant') > 0) AS ended, argMaxIf(kind, event_key, kind != 'grant') AS end_kind, \
         argMaxIf(revision, event_key, kind != 'grant') AS end_revision, \
         argMaxIf(at_ms, event_key, kind != 'grant') AS end_ms \
         FROM {table} FINAL WHERE grant_revision IS NOT NULL AND kind IN ('grant', {ends}) \
         GROUP BY cluster_id, timeline, grant_revision, etcd_key",
        digest = pick("ifNull(digest, '')"),
        key = pick("ifNull(key, '')"),
        identity = pick("ifNull(identity, '')"),
        class = pick("toString(ifNull(class, ''))"),
        epoch = pick("epoch"),
        session = pick("ifNull(session, '')"),
    )
}

/// The SQL of `q` over `table` (`database.table`): `now_ms` dates open holds, `cp`
/// names the current history for [`Query::Recent`].
pub fn sql(q: &Query, table: &str, now_ms: u64, cp: &Checkpoint) -> String {
    let events = |filter: String, order: &str, limit: Option<usize>| {
        format!(
            "SELECT {EVENT_COLUMNS} FROM {table} FINAL WHERE {filter} ORDER BY event_key {order}{} \
             FORMAT JSONEachRow {SETTINGS}",
            limit.map(|l| format!(" LIMIT {l}")).unwrap_or_default()
        )
    };
    let holds = |filter: String, order: &str, limit: Option<usize>| {
        format!(
            "SELECT h_digest AS digest, h_key AS key, h_identity AS identity, h_class AS class, h_epoch AS epoch, \
             h_session AS session, cluster_id, timeline, grant_revision, etcd_key, granted_ms, ended, end_kind, \
             end_revision, end_ms, if(ended, end_ms, toUInt64({now_ms})) AS until_ms, \
             toUInt64(greatest(until_ms, granted_ms) - granted_ms) AS held_ms \
             FROM ({}) WHERE {filter} ORDER BY {order}, cluster_id, timeline, grant_revision, etcd_key{} \
             FORMAT JSONEachRow {SETTINGS}",
            holds_sql(table),
            limit.map(|l| format!(" LIMIT {l}")).unwrap_or_default()
        )
    };
    match q {
        Query::History { digest } => events(format!("digest = {}", lit(digest)), "", None),
        Query::ByIdentity { identity, since_ms, until_ms } => holds(
            format!(
                "identity = {} AND granted_ms <= {until_ms} AND (NOT ended OR end_ms >= {since_ms})",
                lit(identity)
            ),
            "granted_ms, grant_revision",
            None,
        ),
        Query::Longest { limit } => holds("granted_ms > 0".into(), "held_ms DESC, grant_revision", Some(*limit)),
        Query::Expiries { since_ms } => events(format!("kind = 'expiry' AND at_ms >= {since_ms}"), "", None),
        Query::Recent { limit } => events(
            format!("cluster_id = {} AND timeline = {}", lit(&cp.cluster_id), cp.timeline),
            "DESC",
            Some((*limit).min(MAX_RECENT)),
        ),
        Query::Events { kind, since_ms } => {
            events(format!("kind = {} AND at_ms >= {since_ms}", lit(kind.as_str())), "", None)
        }
        Query::Unprotected { since_ms, until_ms, outage } => {
            let ends = ends_sql();
            let gid = "JSONExtractString(detail, 'grant_id')";
            let first = |expr: &str, name: &str| format!("argMin({expr}, event_key) AS {name}");
            let outage_filter = outage
                .as_ref()
                .map(|o| format!(" AND JSONExtractString(detail, 'outage') = {}", lit(o)))
                .unwrap_or_default();
            format!(
                "SELECT g.grant_id AS grant_id, g.outage AS outage, g.cluster AS cluster, g.u_cluster_id AS cluster_id, \
                 g.u_epoch AS epoch, g.namespace AS namespace, g.u_class AS class, g.u_digest AS digest, g.u_key AS key, \
                 g.u_identity AS identity, g.u_instance AS instance, g.granted_ms AS granted_ms, g.ttl_s AS ttl_s, \
                 e.end_kind AS end_kind, e.end_ms AS end_ms, e.end_reason AS end_reason FROM \
                 (SELECT {gid} AS grant_id, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {} \
                  FROM {table} FINAL WHERE unprotected AND kind = 'grant' AND JSONType(detail, 'grant_id') = 'String' \
                  AND at_ms >= {since_ms} AND at_ms <= {until_ms}{outage_filter} GROUP BY grant_id) AS g \
                 LEFT JOIN \
                 (SELECT {gid} AS grant_id, {}, {}, {} \
                  FROM {table} FINAL WHERE unprotected AND kind IN ({ends}) AND JSONType(detail, 'grant_id') = 'String' \
                  GROUP BY grant_id) AS e ON g.grant_id = e.grant_id \
                 ORDER BY g.granted_ms, g.grant_id FORMAT JSONEachRow {SETTINGS}",
                first("JSONExtractString(detail, 'outage')", "outage"),
                first("JSONExtractString(detail, 'cluster')", "cluster"),
                first("cluster_id", "u_cluster_id"),
                first("epoch", "u_epoch"),
                first("splitByChar('/', ifNull(key, ''))[1]", "namespace"),
                first("toString(ifNull(class, ''))", "u_class"),
                first("ifNull(digest, '')", "u_digest"),
                first("ifNull(key, '')", "u_key"),
                first("ifNull(identity, '')", "u_identity"),
                first("instance", "u_instance"),
                first("at_ms", "granted_ms"),
                first("JSONExtract(detail, 'ttl_s', 'Nullable(UInt64)')", "ttl_s"),
                first("kind", "end_kind"),
                first("at_ms", "end_ms"),
                first("JSONExtract(detail, 'reason', 'Nullable(String)')", "end_reason"),
            )
        }
        Query::Shadow { since_ms } => {
            let num = |f: &str| format!("JSONExtractUInt(ifNull(detail, ''), '{f}')");
            format!(
                "SELECT s_class AS class, decision, reason, decisions, keys, enforced, candidate, last_ms FROM \
                 (SELECT toString(ifNull(class, '')) AS s_class, kind AS decision, \
                 JSONExtractString(ifNull(detail, ''), 'reason') AS reason, \
                 sum(greatest({count}, 1)) AS decisions, uniqExact(digest) AS keys, \
                 argMax({enforced}, (at_ms, event_key)) AS enforced, \
                 argMax({candidate}, (at_ms, event_key)) AS candidate, max(at_ms) AS last_ms \
                 FROM {table} FINAL WHERE kind IN ('would_refuse', 'would_grant') AND at_ms >= {since_ms} \
                 GROUP BY s_class, decision, reason) ORDER BY class, decision = 'would_grant', reason \
                 FORMAT JSONEachRow {SETTINGS}",
                count = num("count"),
                enforced = num("enforced"),
                candidate = num("candidate"),
            )
        }
    }
}

#[derive(Deserialize)]
struct HoldSql {
    digest: String,
    key: String,
    identity: String,
    class: String,
    epoch: u64,
    grant_revision: i64,
    session: String,
    granted_ms: u64,
    ended: bool,
    end_kind: String,
    end_revision: i64,
    end_ms: u64,
    held_ms: u64,
}

#[derive(Deserialize)]
struct UnprotectedSql {
    grant_id: String,
    outage: String,
    cluster: String,
    cluster_id: String,
    epoch: u64,
    namespace: String,
    class: String,
    digest: String,
    key: String,
    identity: String,
    instance: Option<String>,
    granted_ms: u64,
    ttl_s: Option<u64>,
    end_kind: Option<String>,
    end_ms: Option<u64>,
    end_reason: Option<String>,
}

fn bad(what: &str, e: impl std::fmt::Display) -> SinkError {
    SinkError::Io(format!("clickhouse answered a row that is not {what}: {e}"))
}

fn kind(s: &str) -> Result<EventKind, SinkError> {
    EventKind::parse(s).ok_or_else(|| bad("an event kind", s))
}

/// One event from a JSONEachRow line (`detail` is JSON text in its column).
pub fn event_of(line: &str) -> Result<AuditEvent, SinkError> {
    let mut v: Value = serde_json::from_str(line).map_err(|e| bad("JSON", e))?;
    if let Some(d) = v.get("detail").and_then(Value::as_str) {
        let parsed: Value = serde_json::from_str(d).map_err(|e| bad("a JSON detail", e))?;
        v["detail"] = parsed;
    }
    serde_json::from_value(v).map_err(|e| bad("an audit event", e))
}

fn lines(body: &str) -> impl Iterator<Item = &str> {
    body.lines().filter(|l| !l.trim().is_empty())
}

/// Parses the answer of [`sql`] for `q`.
pub fn answer(q: &Query, body: &str) -> Result<Answer, SinkError> {
    Ok(match q {
        Query::History { .. } | Query::Expiries { .. } | Query::Recent { .. } | Query::Events { .. } => {
            Answer::Events { events: lines(body).map(event_of).collect::<Result<_, _>>()? }
        }
        Query::ByIdentity { .. } | Query::Longest { .. } => {
            let mut holds = Vec::new();
            for l in lines(body) {
                let h: HoldSql = serde_json::from_str(l).map_err(|e| bad("a hold", e))?;
                let end = if h.ended {
                    Some(HoldEnd { kind: kind(&h.end_kind)?, revision: h.end_revision, at_ms: h.end_ms })
                } else {
                    None
                };
                let hold = HoldRow {
                    digest: h.digest,
                    key: h.key,
                    identity: h.identity,
                    class: h.class,
                    epoch: h.epoch,
                    grant_revision: h.grant_revision,
                    session: h.session,
                    granted_ms: h.granted_ms,
                    end,
                };
                holds.push(HoldSpan { hold, held_ms: h.held_ms, open: !h.ended });
            }
            Answer::Holds { holds }
        }
        Query::Unprotected { .. } => {
            let mut grants = Vec::new();
            for l in lines(body) {
                let u: UnprotectedSql = serde_json::from_str(l).map_err(|e| bad("an unprotected grant", e))?;
                let end = match (u.end_kind.filter(|k| !k.is_empty()), u.end_ms) {
                    (Some(k), Some(at_ms)) => Some(UnprotectedEnd { kind: kind(&k)?, at_ms, reason: u.end_reason }),
                    _ => None,
                };
                grants.push(UnprotectedGrant {
                    grant_id: u.grant_id,
                    outage: u.outage,
                    cluster: u.cluster,
                    cluster_id: u.cluster_id,
                    epoch: u.epoch,
                    namespace: u.namespace,
                    class: u.class,
                    digest: u.digest,
                    key: u.key,
                    identity: u.identity,
                    instance: u.instance,
                    granted_ms: u.granted_ms,
                    ttl_s: u.ttl_s,
                    end,
                });
            }
            Answer::Unprotected { grants }
        }
        Query::Shadow { .. } => Answer::Shadow {
            rows: lines(body)
                .map(|l| serde_json::from_str::<ShadowSum>(l).map_err(|e| bad("a shadow sum", e)))
                .collect::<Result<_, _>>()?,
        },
    })
}

// === impl Sink ===

impl Sink {
    /// Runs `q` against ClickHouse (see the module doc); `cp` is the tailer's
    /// checkpoint (the current history for [`Query::Recent`]).
    pub async fn run(&self, q: &Query, now_ms: u64, cp: &Checkpoint) -> Result<Answer, SinkError> {
        let body = self.statement(&sql(q, &self.table_name(), now_ms, cp)).await?;
        answer(q, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_are_quoted_and_every_query_reads_final() {
        assert_eq!(lit("a'b\\c"), "'a\\'b\\\\c'");
        let cp = Checkpoint { cluster_id: "aa".into(), timeline: 2, ..Default::default() };
        let qs = [
            Query::History { digest: "x'; DROP TABLE t; --".into() },
            Query::ByIdentity { identity: "i".into(), since_ms: 1, until_ms: 2 },
            Query::Longest { limit: 3 },
            Query::Expiries { since_ms: 0 },
            Query::Recent { limit: 5000 },
            Query::Events { kind: EventKind::Gap, since_ms: 0 },
            Query::Unprotected { since_ms: 0, until_ms: 9, outage: Some("o".into()) },
            Query::Shadow { since_ms: 0 },
        ];
        for q in &qs {
            let s = sql(q, "lockmesh.audit_events", 10, &cp);
            assert!(s.contains("lockmesh.audit_events FINAL"), "{s}");
            assert!(s.contains("FORMAT JSONEachRow SETTINGS"), "{s}");
        }
        assert!(sql(&qs[0], "t", 0, &cp).contains("digest = 'x\\'; DROP TABLE t; --'"));
        assert!(sql(&qs[4], "t", 0, &cp).contains(&format!("LIMIT {MAX_RECENT}")));
    }
}
