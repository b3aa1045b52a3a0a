//! The audit queries (`lockctl audit ...` and the tailer's `/v1/audit/*`).

use serde::{Deserialize, Serialize};

use super::{
    event::{AuditEvent, EventKind, HoldRow},
    store::{Store, StoreError},
};

/// A query, as the CLI and the HTTP API name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "query", rename_all = "snake_case")]
pub enum Query {
    /// Every event of one key, by digest (the CLI digests the raw key locally).
    History { digest: String },
    /// Holds of one identity overlapping `[since_ms, until_ms]`.
    ByIdentity {
        /// SPIFFE ID.
        identity: String,
        /// Window start, unix ms.
        since_ms: u64,
        /// Window end, unix ms.
        until_ms: u64,
    },
    /// The longest holds (open ones counted up to now).
    Longest {
        /// Most holds to answer, longest first.
        limit: usize,
    },
    /// Holds that ended by expiry, without a release.
    Expiries {
        /// Window start, unix ms.
        since_ms: u64,
    },
    /// The most recent events of the current history, newest first.
    Recent {
        /// Most events to answer; capped at [`MAX_RECENT`].
        limit: usize,
    },
    /// Events of one kind (gaps, restores, limit changes...) since a time.
    Events {
        kind: EventKind,
        /// Window start, unix ms.
        since_ms: u64,
    },
    /// The reconciliation list (ADR-04): every unprotected grant (a fail-open
    /// class's token-0 grant during a quorum loss) granted in `[since_ms,
    /// until_ms]`, of one outage if named, with how it ended.
    Unprotected {
        /// Window start, unix ms.
        since_ms: u64,
        /// Window end, unix ms.
        until_ms: u64,
        /// Only this outage (`<cluster>-<declared ms>`, as the arbiter logged it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        outage: Option<String>,
    },
    /// What promoting each class's candidate policy would have changed since a
    /// time (shadow policies, docs/CLASSES.md): the `would_refuse` and
    /// `would_grant` events summed by class, decision and reason.
    Shadow {
        /// Window start, unix ms.
        since_ms: u64,
    },
}

/// One row of a [`Query::Shadow`] answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowSum {
    pub class: String,
    /// `would_refuse` or `would_grant`.
    pub decision: EventKind,
    /// `key_gated`, `lock_delay` or `session_expired`.
    pub reason: String,
    /// Decisions (each event stands for its record's `count`).
    pub decisions: u64,
    /// Distinct keys among the events (by digest; a session's decision has none).
    pub keys: u64,
    /// The enforced and the candidate value of the latest event.
    pub enforced: u64,
    pub candidate: u64,
    /// The latest event, unix ms.
    pub last_ms: u64,
}

/// One unprotected grant, joined with its end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnprotectedGrant {
    /// The grant id.
    pub grant_id: String,
    /// The outage it was granted in.
    pub outage: String,
    /// The etcd cluster (arbiter config name) whose quorum was lost.
    pub cluster: String,
    /// The etcd cluster id its records were shipped to.
    pub cluster_id: String,
    /// The epoch the arbiter last read there.
    pub epoch: u64,
    /// The key's namespace.
    pub namespace: String,
    pub class: String,
    pub digest: String,
    /// Raw key (JSON output only; the table shows the digest).
    pub key: String,
    /// Holder SPIFFE ID.
    pub identity: String,
    /// Holder's declared instance (`x-lock-instance`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Grant time, unix ms.
    pub granted_ms: u64,
    /// The class TTL it would lapse after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// How it ended (release or expiry, with the reason), if that was shipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<UnprotectedEnd>,
}

/// The end of an unprotected grant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnprotectedEnd {
    /// Release or expiry.
    pub kind: EventKind,
    /// When, unix ms.
    pub at_ms: u64,
    /// `ttl`, `arbiter_restart`, `caller_gone`, `reconcile` (none for a release).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Most events a `recent` query answers.
pub(crate) const MAX_RECENT: usize = 1000;

/// A hold with its duration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldSpan {
    #[serde(flatten)]
    pub hold: HoldRow,
    /// Held for, ms (to now for an open hold).
    pub held_ms: u64,
    /// Still open as far as the tailer knows.
    pub open: bool,
}

/// A query's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    Events {
        /// In revision order.
        events: Vec<AuditEvent>,
    },
    Shadow {
        /// By class, decision and reason.
        rows: Vec<ShadowSum>,
    },
    Holds {
        /// Ordered by the query.
        holds: Vec<HoldSpan>,
    },
    /// Unprotected grants, in grant order.
    Unprotected {
        /// One per grant id.
        grants: Vec<UnprotectedGrant>,
    },
}

fn detail_str(e: &AuditEvent, f: &str) -> Option<String> {
    e.detail.as_ref()?.get(f)?.as_str().map(str::to_owned)
}

/// The unprotected grants among `events` granted in `[since_ms, until_ms]` (of
/// `outage` if named), one per grant id (a record shipped into two histories is
/// listed once), joined with their ends.
pub fn unprotected(events: &[AuditEvent], since_ms: u64, until_ms: u64, outage: Option<&str>) -> Vec<UnprotectedGrant> {
    let mut ends = std::collections::HashMap::new();
    let mut grants = std::collections::BTreeMap::new();
    for e in events.iter().filter(|e| e.unprotected) {
        let Some(id) = detail_str(e, "grant_id") else { continue };
        if e.kind.ends_hold() {
            ends.entry(id).or_insert(UnprotectedEnd { kind: e.kind, at_ms: e.at_ms, reason: detail_str(e, "reason") });
            continue;
        }
        if e.kind != EventKind::Grant || e.at_ms < since_ms || e.at_ms > until_ms {
            continue;
        }
        let o = detail_str(e, "outage").unwrap_or_default();
        if outage.is_some_and(|want| want != o) {
            continue;
        }
        let key = e.key.clone().unwrap_or_default();
        grants.entry(id.clone()).or_insert(UnprotectedGrant {
            grant_id: id,
            outage: o,
            cluster: detail_str(e, "cluster").unwrap_or_default(),
            cluster_id: e.cluster_id.clone(),
            epoch: e.epoch,
            namespace: key.split('/').next().unwrap_or_default().to_owned(),
            class: e.class.clone().unwrap_or_default(),
            digest: e.digest.clone().unwrap_or_default(),
            key,
            identity: e.identity.clone().unwrap_or_default(),
            instance: e.instance.clone(),
            granted_ms: e.at_ms,
            ttl_s: e.detail.as_ref().and_then(|d| d["ttl_s"].as_u64()),
            end: None,
        });
    }
    let mut out: Vec<UnprotectedGrant> = grants.into_values().collect();
    for g in &mut out {
        g.end = ends.remove(&g.grant_id);
    }
    out.sort_by(|a, b| a.granted_ms.cmp(&b.granted_ms).then_with(|| a.grant_id.cmp(&b.grant_id)));
    out
}

fn span(h: HoldRow, now_ms: u64) -> HoldSpan {
    let end = h.end.as_ref().map_or(now_ms, |e| e.at_ms);
    HoldSpan { held_ms: end.saturating_sub(h.granted_ms), open: h.end.is_none(), hold: h }
}

/// Runs `q` against the store.
pub fn run(store: &Store, q: &Query, now_ms: u64) -> Result<Answer, StoreError> {
    Ok(match q {
        Query::History { digest } => Answer::Events { events: store.history(digest)? },
        Query::ByIdentity { identity, since_ms, until_ms } => {
            let mut holds: Vec<HoldSpan> = store
                .holds()?
                .into_iter()
                .filter(|h| &h.identity == identity)
                .filter(|h| h.granted_ms <= *until_ms && h.end.as_ref().is_none_or(|e| e.at_ms >= *since_ms))
                .map(|h| span(h, now_ms))
                .collect();
            holds.sort_by_key(|h| (h.hold.granted_ms, h.hold.grant_revision));
            Answer::Holds { holds }
        }
        Query::Longest { limit } => {
            let mut holds: Vec<HoldSpan> =
                store.holds()?.into_iter().filter(|h| h.granted_ms > 0).map(|h| span(h, now_ms)).collect();
            holds.sort_by(|a, b| b.held_ms.cmp(&a.held_ms).then(a.hold.grant_revision.cmp(&b.hold.grant_revision)));
            holds.truncate(*limit);
            Answer::Holds { holds }
        }
        Query::Expiries { since_ms } => Answer::Events {
            events: store
                .events()?
                .into_iter()
                .filter(|e| e.kind == EventKind::Expiry && e.at_ms >= *since_ms)
                .collect(),
        },
        Query::Recent { limit } => Answer::Events { events: store.recent((*limit).min(MAX_RECENT))? },
        Query::Events { kind, since_ms } => Answer::Events {
            events: store.events()?.into_iter().filter(|e| e.kind == *kind && e.at_ms >= *since_ms).collect(),
        },
        Query::Unprotected { since_ms, until_ms, outage } => {
            Answer::Unprotected { grants: unprotected(&store.events()?, *since_ms, *until_ms, outage.as_deref()) }
        }
        Query::Shadow { since_ms } => Answer::Shadow { rows: shadow(&store.events()?, *since_ms) },
    })
}

/// Sums the shadow decisions (`would_refuse`, `would_grant`) at or after `since_ms`.
pub fn shadow(events: &[AuditEvent], since_ms: u64) -> Vec<ShadowSum> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut rows: BTreeMap<(String, EventKind, String), (ShadowSum, BTreeSet<String>)> = BTreeMap::new();
    for e in events {
        if !matches!(e.kind, EventKind::WouldRefuse | EventKind::WouldGrant) || e.at_ms < since_ms {
            continue;
        }
        let num = |f: &str| e.detail.as_ref().and_then(|d| d[f].as_u64()).unwrap_or(0);
        let reason = detail_str(e, "reason").unwrap_or_default();
        let class = e.class.clone().unwrap_or_default();
        let (row, keys) = rows.entry((class.clone(), e.kind, reason.clone())).or_insert_with(|| {
            let row = ShadowSum {
                class,
                decision: e.kind,
                reason,
                decisions: 0,
                keys: 0,
                enforced: 0,
                candidate: 0,
                last_ms: 0,
            };
            (row, BTreeSet::new())
        });
        row.decisions += num("count").max(1);
        if e.at_ms >= row.last_ms {
            (row.last_ms, row.enforced, row.candidate) = (e.at_ms, num("enforced"), num("candidate"));
        }
        keys.extend(e.digest.clone());
        row.keys = keys.len() as u64;
    }
    rows.into_values().map(|(r, _)| r).collect()
}

/// Human output: one line per event or hold. Keys are shown as digests (the raw
/// key is in `--json`, for investigators with access to the store).
pub fn render(a: &Answer) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    match a {
        Answer::Events { events } => {
            let _ = writeln!(
                s,
                "{:<10} {:<16} {:<6} {:<13} {:<16} {:<16} identity",
                "revision", "kind", "epoch", "at_ms", "digest", "session"
            );
            for e in events {
                let _ = writeln!(
                    s,
                    "{:<10} {:<16} {:<6} {:<13} {:<16} {:<16} {}",
                    e.revision,
                    e.kind.as_str(),
                    e.epoch,
                    e.at_ms,
                    e.digest.as_deref().map_or("-", |d| d.get(..16).unwrap_or(d)),
                    e.session.as_deref().unwrap_or("-"),
                    e.identity.as_deref().unwrap_or("-"),
                );
            }
            let _ = writeln!(s, "{} events", events.len());
        }
        Answer::Holds { holds } => {
            let _ = writeln!(
                s,
                "{:<10} {:<12} {:<16} {:<16} {:<10} identity",
                "grant_rev", "held_ms", "end", "digest", "class"
            );
            for h in holds {
                let end = h.hold.end.as_ref().map_or("open", |e| e.kind.as_str());
                let d = &h.hold.digest;
                let _ = writeln!(
                    s,
                    "{:<10} {:<12} {:<16} {:<16} {:<10} {}",
                    h.hold.grant_revision,
                    h.held_ms,
                    end,
                    d.get(..16).unwrap_or(d),
                    h.hold.class,
                    h.hold.identity
                );
            }
            let _ = writeln!(s, "{} holds", holds.len());
        }
        Answer::Shadow { rows } => {
            let _ = writeln!(
                s,
                "{:<16} {:<13} {:<16} {:>10} {:>8} {:>9} {:>10} last_ms",
                "class", "decision", "reason", "decisions", "keys", "enforced", "candidate"
            );
            for r in rows {
                let _ = writeln!(
                    s,
                    "{:<16} {:<13} {:<16} {:>10} {:>8} {:>9} {:>10} {}",
                    r.class,
                    r.decision.as_str(),
                    r.reason,
                    r.decisions,
                    r.keys,
                    r.enforced,
                    r.candidate,
                    r.last_ms
                );
            }
            let _ = writeln!(
                s,
                "promoting each candidate would have changed {} decisions",
                rows.iter().map(|r| r.decisions).sum::<u64>()
            );
        }
        Answer::Unprotected { grants } => {
            let _ = writeln!(
                s,
                "{:<14} {:<12} {:<12} {:<16} {:<8} {:<16} {:<26} identity",
                "granted_ms", "namespace", "class", "digest", "end", "end_reason", "outage"
            );
            for g in grants {
                let end = g.end.as_ref().map_or("open", |e| e.kind.as_str());
                let reason = g.end.as_ref().and_then(|e| e.reason.as_deref()).unwrap_or("-");
                let _ = writeln!(
                    s,
                    "{:<14} {:<12} {:<12} {:<16} {:<8} {:<16} {:<26} {}",
                    g.granted_ms,
                    g.namespace,
                    g.class,
                    g.digest.get(..16).unwrap_or(&g.digest),
                    end,
                    reason,
                    g.outage,
                    g.identity
                );
            }
            let _ = writeln!(s, "{} unprotected grants", grants.len());
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: EventKind, grant: &str, outage: &str, at_ms: u64, timeline: u32) -> AuditEvent {
        AuditEvent {
            cluster_id: "00000000000000aa".into(),
            timeline,
            epoch: 1,
            revision: 0,
            etcd_key: format!("/r/u/{grant}/{}", kind.as_str()),
            kind,
            digest: Some("ab".repeat(32)),
            key: Some("jobs/secret-1".into()),
            identity: Some("spiffe://td/ns/jobs/sa/w".into()),
            instance: None,
            class: Some("batch".into()),
            session: None,
            grant_revision: None,
            slot: None,
            at_ms,
            detail: Some(serde_json::json!({ "grant_id": grant, "outage": outage, "cluster": "coord", "ttl_s": 30,
                                             "reason": (kind == EventKind::Expiry).then_some("ttl") })),
            unprotected: true,
        }
    }

    #[test]
    fn the_reconciliation_list_joins_ends_filters_windows_and_outages_and_dedupes() {
        let mut protected = ev(EventKind::Grant, "p", "o1", 150, 0);
        protected.unprotected = false;
        let events = vec![
            ev(EventKind::Grant, "g1", "o1", 100, 0),
            ev(EventKind::Release, "g1", "o1", 120, 0),
            ev(EventKind::Grant, "g2", "o1", 110, 0),
            ev(EventKind::Expiry, "g2", "o1", 140, 0),
            // Shipped again into a later history: listed once.
            ev(EventKind::Grant, "g2", "o1", 110, 1),
            ev(EventKind::Grant, "g3", "o2", 500, 1),
            protected,
        ];
        let all = unprotected(&events, 0, u64::MAX, None);
        let ids: Vec<_> = all.iter().map(|g| g.grant_id.as_str()).collect();
        assert_eq!(ids, ["g1", "g2", "g3"]);
        assert_eq!(all[0].end.as_ref().map(|e| e.kind), Some(EventKind::Release));
        assert_eq!(all[1].end.as_ref().and_then(|e| e.reason.as_deref()), Some("ttl"));
        assert!(all[2].end.is_none());
        assert_eq!((all[0].namespace.as_str(), all[0].ttl_s), ("jobs", Some(30)));
        assert_eq!(unprotected(&events, 0, u64::MAX, Some("o2")).len(), 1);
        assert_eq!(unprotected(&events, 105, 200, None).len(), 1);
        let table = render(&Answer::Unprotected { grants: all });
        assert!(table.contains("3 unprotected grants") && table.contains("release") && table.contains(" open "));
        assert!(!table.contains("secret"), "the table shows digests, never raw keys");
    }

    #[test]
    fn shadow_sums_decisions_by_class_decision_and_reason_since_a_time() {
        let sh = |kind: EventKind, digest: Option<&str>, at_ms: u64, count: u64, reason: &str| AuditEvent {
            digest: digest.map(str::to_owned),
            detail: Some(serde_json::json!({ "count": count, "reason": reason, "enforced": 4, "candidate": at_ms })),
            key: None,
            unprotected: false,
            ..ev(kind, "-", "-", at_ms, 0)
        };
        let events = vec![
            sh(EventKind::WouldRefuse, Some("d1"), 50, 9, "key_gated"),
            sh(EventKind::WouldRefuse, Some("d1"), 100, 3, "key_gated"),
            sh(EventKind::WouldRefuse, Some("d2"), 110, 1, "key_gated"),
            sh(EventKind::WouldGrant, Some("d1"), 120, 2, "lock_delay"),
            sh(EventKind::WouldRefuse, None, 130, 1, "session_expired"),
            ev(EventKind::Grant, "g", "o", 140, 0),
        ];
        let rows = shadow(&events, 100);
        let got: Vec<_> =
            rows.iter().map(|r| (r.decision.as_str(), r.reason.as_str(), r.decisions, r.keys, r.candidate)).collect();
        assert_eq!(
            got,
            [
                ("would_refuse", "key_gated", 4, 2, 110),
                ("would_refuse", "session_expired", 1, 0, 130),
                ("would_grant", "lock_delay", 2, 1, 120)
            ]
        );
        let table = render(&Answer::Shadow { rows });
        assert!(table.contains("would have changed 7 decisions"), "{table}");
    }
}
