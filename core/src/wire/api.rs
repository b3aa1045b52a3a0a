//! The lock API's success answers (docs/API.md), one type per route. The arbiter
//! answers them through ext_proc; the SDK (`lockmesh-client`) and the test harness
//! read them. A refusal on any route is an [`super::error::ErrorBody`].
//!
//! | Route | Answer |
//! |---|---|
//! | `POST /v1/locks/acquire` | [`Acquired`] |
//! | `POST /v1/locks/release` | [`Released`] |
//! | `GET /v1/locks` | [`LockInfo`] |
//! | `POST /v1/sessions` | [`SessionOpened`] |
//! | `POST /v1/sessions/keepalive` | [`SessionRenewed`] |
//! | `POST /v1/sessions/close` | [`SessionClosed`] |
//! | `GET /v1/sessions/holds` | [`SessionHolds`] |
//! | `POST /v1/tokens/validate` | [`TokenValidity`] |
//! | `POST /v1/elections/campaign` | [`Acquired`] |
//! | `POST /v1/elections/proclaim` | [`Proclaimed`] |
//! | `POST /v1/elections/resign` | [`Released`] |
//! | `GET /v1/elections` | [`Election`] |

use serde::{Deserialize, Serialize};

use crate::{headers::SessionId, FencingToken};

/// `POST /v1/locks/acquire`, granted. Two forms: a protected grant (a fencing
/// token on a session) and, for a fail-open class during a declared quorum loss
/// (ADR-04), an unprotected grant from the arbiter's memory (`unprotected: true`,
/// token `"0"`, no session, released by its `grant` id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acquired {
    /// The key's class, as the registry names it.
    pub class: String,
    /// The etcd cluster that granted it (`coord` or a shard's name,
    /// `docs/SCALE.md`): the token's epoch is that cluster's, and only a higher
    /// epoch *of the same cluster* voids it. Absent from an older arbiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// The token's epoch (for an unprotected grant: the epoch the arbiter last read).
    pub epoch: u64,
    /// The lowest epoch of the granting cluster whose holds are still honoured,
    /// when it is below `epoch`: a shard move's soft epoch advance keeps earlier
    /// epochs' holds valid, so a holder fences its holds only below this one.
    /// Absent when only `epoch` is honoured, and from an older arbiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub honoured_from: Option<u64>,
    /// True when the caller's session already held the key (an idempotent retry):
    /// nothing new was granted.
    pub existing: bool,
    /// The unprotected grant's id (32 hex digits), by which it is released
    /// (`x-lock-grant`). Absent on a protected grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<String>,
    /// True when the acquire opened the session it names (no `x-lock-session` sent).
    pub new_session: bool,
    /// How many of the key's slots the grant holds, when more than one
    /// (`x-lock-permits`, or every slot for an exclusive hold); all are released
    /// together by the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
    /// The read-write mode the acquire named (`x-lock-mode`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<crate::headers::LockMode>,
    /// The outage the unprotected grant was made in (`<cluster>-<declared ms>`, as
    /// the audit store names it). Absent on a protected grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outage: Option<String>,
    /// The signed grant proof (`v1.<kid>.<payload>.<sig>`, also in `x-lock-proof`),
    /// or `null` when the arbiter signs nothing or the grant is unprotected.
    #[serde(default)]
    pub proof: Option<String>,
    /// The token's etcd commit revision (0 for an unprotected grant).
    pub revision: u64,
    /// The session holding the grant, or `null` for an unprotected grant.
    #[serde(default)]
    pub session: Option<SessionId>,
    /// The fencing token as a decimal string (`epoch x 2^48 + revision`; also in
    /// `x-lock-token`); `"0"` for an unprotected grant, which no fence accepts.
    /// Read it with [`Acquired::fencing_token`].
    pub token: String,
    /// The session's TTL, seconds (the class TTL).
    pub ttl_s: u64,
    /// True for an unprotected grant: no fencing, no session (ADR-04).
    pub unprotected: bool,
}

/// `POST /v1/locks/acquire-all`, granted: every key of `x-lock-keys`, by one
/// etcd transaction, on one session. Each key's token is the same number (the
/// transaction's commit revision at the cluster's epoch), and for each key it is
/// higher than any token that key had before.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquiredAll {
    /// The keys' class.
    pub class: String,
    /// The etcd cluster that granted them (`coord` or a shard's name).
    pub cluster: String,
    /// The tokens' epoch.
    pub epoch: u64,
    /// The lowest epoch of the granting cluster whose holds are still honoured,
    /// when it is below `epoch` (see [`Acquired::honoured_from`]). Absent when
    /// only `epoch` is honoured, and from an older arbiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub honoured_from: Option<u64>,
    /// True when the caller's session already held every key by one grant (an
    /// idempotent retry): nothing new was granted.
    pub existing: bool,
    /// True when the acquire opened the session it names.
    pub new_session: bool,
    /// The tokens' etcd commit revision.
    pub revision: u64,
    /// The session holding every key.
    pub session: SessionId,
    /// Every key's fencing token, as a decimal string (also in `x-lock-token`).
    pub token: String,
    /// The session's TTL, seconds (the class TTL).
    pub ttl_s: u64,
    /// Each key's grant, in key order (bytewise): release each by its key and
    /// token, or all by closing the session.
    pub keys: Vec<KeyGrant>,
}

/// One key of a multi-key grant ([`AcquiredAll`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyGrant {
    /// The key, as sent.
    pub key: String,
    /// Its fencing token (the grant's token).
    pub token: String,
    /// Its signed grant proof, or `null` when the arbiter signs nothing.
    #[serde(default)]
    pub proof: Option<String>,
}

/// `POST /v1/locks/release`, done: the grant named is gone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// Always true on a 200 answer (a grant that is not the caller's is refused
    /// `not_holder` instead).
    pub released: bool,
    /// True when the grant released was unprotected (named by `x-lock-grant`);
    /// absent otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unprotected: bool,
}

/// `GET /v1/locks`: who holds a key, as the caller may see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockInfo {
    /// The key's class.
    pub class: String,
    /// The holders now, in slot order.
    pub holders: Vec<Holder>,
    /// The class's holder limit per key as the registry states it (the
    /// authoritative limit may differ during a limit change).
    pub max_holders: u32,
    /// Acquires of the key queued at the answering arbiter now (not fleet-wide).
    pub waiting_here: u64,
    /// Time left of the key's lock-delay, ms (a class with `lock_delay_s` whose
    /// last hold ended without a release); absent when the key is in none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_delay_ms: Option<u64>,
}

/// One holder of a key in [`LockInfo`]. The token and session are shown only for
/// the caller's own holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// Time held, ms (from the grant's wall clock; informational).
    pub age_ms: u64,
    /// The holder's SPIFFE ID.
    pub identity: String,
    /// The hold's session, for the caller's own hold only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionId>,
    /// The hold's token, for the caller's own hold only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<FencingToken>,
    /// True for the caller's own hold; absent otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub you: bool,
    /// How many of the key's slots this hold takes, when more than one
    /// (`x-lock-permits`, or every slot for an exclusive hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
    /// The hold's read-write mode (`x-lock-mode`), when its acquire named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<crate::headers::LockMode>,
}

/// `POST /v1/sessions`: a new session (also in `x-lock-session`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionOpened {
    /// The class the session was opened for (that of `x-lock-key` or
    /// `x-lock-class`, else the default class); its keys share the TTL.
    pub class: String,
    /// The session id.
    pub session: SessionId,
    /// The session's TTL, seconds: renew it well within this.
    pub ttl_s: u64,
}

/// `POST /v1/sessions/keepalive`: the session's lease was renewed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRenewed {
    /// The session renewed.
    pub session: SessionId,
    /// The TTL it was renewed for, seconds, counted from when the arbiter renewed it.
    pub ttl_s: u64,
}

/// `POST /v1/sessions/close`: the session and every hold on it are gone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionClosed {
    /// Always true on a 200 answer.
    pub closed: bool,
}

/// `GET /v1/sessions/holds`: every hold of one of the caller's sessions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionHolds {
    /// The holds, one per key.
    pub holds: Vec<SessionHold>,
    /// The session listed.
    pub session: SessionId,
}

/// One hold in [`SessionHolds`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionHold {
    /// Grant time, unix ms (the arbiter's wall clock; informational).
    pub acquired_ms: u64,
    /// The key's class at grant time.
    pub class: String,
    /// The etcd cluster holding it (see [`Acquired::cluster`]). Absent from an
    /// older arbiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// The token's epoch.
    pub epoch: u64,
    /// The lowest epoch of the hold's cluster whose holds are still honoured,
    /// when it is below `epoch` (a shard move's soft advance: see
    /// [`Acquired::honoured_from`]). Absent when only `epoch` and later ones are
    /// honoured, and from an older arbiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub honoured_from: Option<u64>,
    /// The raw lock key (the caller's own).
    pub key: String,
    /// The token's etcd commit revision.
    pub revision: u64,
    /// The hold's fencing token.
    pub token: FencingToken,
}

/// `POST /v1/tokens/validate` (ADR-16's fallback): whether a token is the current
/// grant of a key at the read's revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenValidity {
    /// True when the token is a current hold of the key in the current epoch.
    pub current: bool,
}

/// `POST /v1/elections/proclaim`: the leader's value is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proclaimed {
    /// Always true on a 200 answer.
    pub proclaimed: bool,
}

/// `GET /v1/elections`: an election's leadership, as of `cursor`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Election {
    /// The key's class.
    pub class: String,
    /// The leader, or `null` when nobody leads.
    #[serde(default)]
    pub leader: Option<Leader>,
    /// Where this answer stands in the election's history: send it as
    /// `x-lock-after` to wait for the next change. Opaque (32 lowercase hex
    /// digits): it names no etcd revision, so no token can be read from it.
    pub cursor: String,
    /// True when the leadership (leader or value) changed after `x-lock-after` and
    /// this is the state right after the first such change (or, with `gap`, the
    /// state now); false when the wait ended first (the state is `x-lock-after`'s,
    /// unchanged) or no `x-lock-after` was sent (the state now).
    pub changed: bool,
    /// True when the arbiter could not resume from `x-lock-after` (etcd compacted
    /// its history past it, or another arbiter or an earlier run of this one
    /// answered it): this is the state now, and changes between may be missing.
    /// Absent otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gap: bool,
}

/// The leader of an [`Election`]. Like a [`Holder`] in [`LockInfo`]: the token is
/// shown only to the leader itself, naming its session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leader {
    /// The leader's SPIFFE ID.
    pub identity: String,
    /// The value the leader proclaimed under this leadership, if it proclaimed one.
    #[serde(default)]
    pub value: Option<String>,
    /// When the leadership was granted, unix ms (the arbiter's wall clock;
    /// informational).
    pub since_ms: u64,
    /// The leadership's fencing token (its term: a later leader's is larger), for
    /// the caller's own leadership only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<FencingToken>,
    /// True when the caller leads (naming the leadership's session); absent otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub you: bool,
}

// === impl Acquired ===

impl Acquired {
    /// The fencing token, or `None` for an unprotected grant's `"0"` (or a token
    /// that does not parse).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.token.parse().ok()
    }
}
