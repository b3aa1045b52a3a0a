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
    History {
        /// Key digest.
        digest: String,
    },
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
        /// How many.
        limit: usize,
    },
    /// Holds that ended by expiry, without a release.
    Expiries {
        /// Window start, unix ms.
        since_ms: u64,
    },
    /// The most recent events of the current history, newest first.
    Recent {
        /// How many.
        limit: usize,
    },
    /// Events of one kind (gaps, restores, limit changes...) since a time.
    Events {
        /// The kind.
        kind: EventKind,
        /// Window start, unix ms.
        since_ms: u64,
    },
}

/// Most events a `recent` query answers.
pub const MAX_RECENT: usize = 1000;

/// A hold with its duration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldSpan {
    /// The hold.
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
    /// Events.
    Events {
        /// In revision order.
        events: Vec<AuditEvent>,
    },
    /// Holds.
    Holds {
        /// Ordered by the query.
        holds: Vec<HoldSpan>,
    },
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
    })
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
    }
    s
}
