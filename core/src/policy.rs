//! The authoritative policy of a class and its limit-change protocol (seed 000,
//! "Lowering a limit").
//!
//! The YAML registry is desired state. What grants obey is one [`ClassPolicy`]
//! record per class in etcd, which every grant transaction compares (by mod
//! revision), the analogue of the seed's shared policy-row lock. The transitions
//! here are pure; the arbiter and `lockctl` run each one as a single etcd
//! transaction guarded by the record's mod revision, so two writers never both
//! commit a change from the same state.
//!
//! Lowering a limit from `L` to `T < L`:
//! 1. [`ClassPolicy::begin_lower`]: state `draining`, pending target `T`, change
//!    epoch `+1`. From this commit on no grant of the class commits (every grant
//!    compares the record, and a draining record admits nothing).
//! 2. Verification, outside any exclusive window: the maximum open count of any
//!    key of the class, read at or after step 1's revision under a bounded timeout.
//!    Open counts can only fall meanwhile. A timeout is `verification_incomplete`:
//!    nothing changes, the class stays draining.
//! 3. [`ClassPolicy::activate`] with the epoch and target from step 1 and the
//!    observed maximum: the lower limit becomes authoritative only if the maximum
//!    is within it; otherwise nothing changes (still draining, old limit).
//!
//! [`ClassPolicy::check_pending`] is the resume validation (no write);
//! [`ClassPolicy::cancel`] restores the old limit and reopens admission in one
//! transition. Both refuse a stale epoch or another target without any change.
//! Raising a limit is immediate ([`ClassPolicy::raise`]). One pending change per
//! class: every change refuses while one is draining.
//!
//! Invariant (model-checked in `tests/policy_model.rs`): no committed state has an
//! authoritative limit below the open grants of any key of the class.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Admission state of a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyState {
    /// Grants are admitted up to `limit`.
    Active,
    /// A limit change is pending: no grant is admitted.
    Draining,
}

/// Who changed a policy, when and why (the audit trail of limit changes).
///
/// Members are in alphabetical order: `/status` and `lockctl shard show` printed
/// this note through `serde_json::Value`, which sorts keys, and the typed bodies
/// ([`crate::wire`]) keep those bytes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChangeNote {
    /// What the transition was: `create`, `raise`, `drain`, `activate`, `cancel`.
    pub action: String,
    /// The operator or component that asked (`lockctl` user, `arbiter:bootstrap`).
    pub actor: String,
    /// Unix ms of the transition.
    pub at_ms: u64,
    /// Why, in the operator's words.
    pub reason: String,
}

/// The authoritative policy of one class.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClassPolicy {
    pub class: String,
    /// Identity of this policy's concurrency namespace; a new id is a new namespace.
    pub policy_id: String,
    /// The authoritative limit of holders per key.
    pub limit: u32,
    /// Whether grants are admitted: [`PolicyState::Draining`] admits none.
    pub state: PolicyState,
    /// Incremented by every change that starts, ends or cancels a transition.
    pub change_epoch: u64,
    /// The lower limit a draining change is heading for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_target: Option<u32>,
    /// Unix ms the class started draining.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining_since_ms: Option<u64>,
    /// True while the class drains for a prefix-map change (`lockctl class
    /// apply`) rather than a limit change: [`ClassPolicy::finish_move`] ends it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pending_move: bool,
    /// The last transition.
    pub last: ChangeNote,
}

/// Why a transition was refused. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyError {
    /// A change is already pending (one per class).
    ChangePending {
        /// The pending change's `change_epoch`.
        epoch: u64,
        /// The limit the pending change is heading for.
        target: u32,
    },
    /// The request's epoch or target is not the pending change's.
    Stale {
        /// Epoch the request carried.
        epoch: u64,
        /// Target the request carried.
        target: u32,
        /// The record's epoch.
        current_epoch: u64,
        /// The record's pending target, if any.
        current_target: Option<u32>,
    },
    /// Verification saw a key above the target: still draining, old limit.
    OverTarget {
        /// The largest open count seen.
        observed: u32,
        /// The limit the drain is heading for.
        target: u32,
    },
    /// A limit must be at least 1 (0 would pause every key of the class).
    Zero,
    /// The request would not change the limit (or a lower/raise mix-up).
    NoChange {
        /// Current limit.
        limit: u32,
        /// The limit the request asked for.
        target: u32,
    },
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::ChangePending { epoch, target } => {
                write!(f, "change_pending: a change to {target} (epoch {epoch}) is draining; resume or cancel it first")
            }
            PolicyError::Stale { epoch, target, current_epoch, current_target } => write!(
                f,
                "stale: epoch {epoch} target {target} is not the pending change (epoch {current_epoch}, target {})",
                current_target.map_or("none".to_owned(), |t| t.to_string())
            ),
            PolicyError::OverTarget { observed, target } => write!(
                f,
                "over_target: a key has {observed} open grants, above the target {target}; still draining, the old \
                 limit stays"
            ),
            PolicyError::Zero => f.write_str("limit must be at least 1: 0 would pause every key of the class"),
            PolicyError::NoChange { limit, target } => write!(f, "no_change: the limit is {limit}, asked {target}"),
        }
    }
}

impl std::error::Error for PolicyError {}

// === impl ClassPolicy ===

impl ClassPolicy {
    /// A new active policy.
    pub fn new(class: &str, policy_id: &str, limit: u32, note: ChangeNote) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::Zero);
        }
        Ok(Self {
            class: class.to_owned(),
            policy_id: policy_id.to_owned(),
            limit,
            state: PolicyState::Active,
            change_epoch: 1,
            pending_target: None,
            draining_since_ms: None,
            pending_move: false,
            last: note,
        })
    }

    /// Drains the class for a prefix-map change: no grant of it commits until
    /// [`ClassPolicy::finish_move`] (written in the same transaction as the new
    /// map, or alone to cancel). A class already draining for a move is returned
    /// unchanged (the apply resumes); one draining a limit change is refused.
    pub fn begin_move(&self, note: ChangeNote) -> Result<Self, PolicyError> {
        if self.pending_move {
            return Ok(self.clone());
        }
        self.idle()?;
        Ok(Self {
            state: PolicyState::Draining,
            change_epoch: self.change_epoch + 1,
            pending_move: true,
            draining_since_ms: Some(note.at_ms),
            last: note,
            ..self.clone()
        })
    }

    /// Ends a move drain begun at change epoch `epoch`: active again, same limit.
    pub fn finish_move(&self, epoch: u64, note: ChangeNote) -> Result<Self, PolicyError> {
        if !(self.pending_move && self.change_epoch == epoch) {
            return Err(PolicyError::Stale {
                epoch,
                target: self.limit,
                current_epoch: self.change_epoch,
                current_target: self.pending_target,
            });
        }
        Ok(Self {
            state: PolicyState::Active,
            change_epoch: self.change_epoch + 1,
            pending_move: false,
            draining_since_ms: None,
            last: note,
            ..self.clone()
        })
    }

    /// True when grants are admitted.
    pub fn admits(&self) -> bool {
        self.state == PolicyState::Active
    }

    fn idle(&self) -> Result<(), PolicyError> {
        match (self.state, self.pending_target) {
            (PolicyState::Active, _) => Ok(()),
            (PolicyState::Draining, t) => {
                Err(PolicyError::ChangePending { epoch: self.change_epoch, target: t.unwrap_or(self.limit) })
            }
        }
    }

    /// Raises the limit at once (more holders can never be over a limit).
    pub fn raise(&self, target: u32, note: ChangeNote) -> Result<Self, PolicyError> {
        self.idle()?;
        if target <= self.limit {
            return Err(PolicyError::NoChange { limit: self.limit, target });
        }
        Ok(Self { limit: target, change_epoch: self.change_epoch + 1, last: note, ..self.clone() })
    }

    /// Step 1 of a lowering: drain, recording the target. Returns the new record;
    /// its `change_epoch` and `pending_target` are what resume and cancel carry.
    pub fn begin_lower(&self, target: u32, note: ChangeNote) -> Result<Self, PolicyError> {
        self.idle()?;
        if target == 0 {
            return Err(PolicyError::Zero);
        }
        if target >= self.limit {
            return Err(PolicyError::NoChange { limit: self.limit, target });
        }
        Ok(Self {
            state: PolicyState::Draining,
            change_epoch: self.change_epoch + 1,
            pending_target: Some(target),
            draining_since_ms: Some(note.at_ms),
            last: note,
            ..self.clone()
        })
    }

    /// Validates that `(epoch, target)` is the pending change (resume, and the
    /// first check of activate and cancel).
    pub fn check_pending(&self, epoch: u64, target: u32) -> Result<(), PolicyError> {
        if self.state == PolicyState::Draining && self.change_epoch == epoch && self.pending_target == Some(target) {
            Ok(())
        } else {
            Err(PolicyError::Stale {
                epoch,
                target,
                current_epoch: self.change_epoch,
                current_target: self.pending_target,
            })
        }
    }

    /// Step 3: makes the target authoritative if `observed` (the largest open count
    /// verified after the drain committed) is within it.
    pub fn activate(&self, epoch: u64, target: u32, observed: u32, note: ChangeNote) -> Result<Self, PolicyError> {
        self.check_pending(epoch, target)?;
        if observed > target {
            return Err(PolicyError::OverTarget { observed, target });
        }
        Ok(Self {
            limit: target,
            state: PolicyState::Active,
            change_epoch: self.change_epoch + 1,
            pending_target: None,
            draining_since_ms: None,
            last: note,
            ..self.clone()
        })
    }

    /// Cancels the pending change: the old limit, active again, in one transition.
    pub fn cancel(&self, epoch: u64, target: u32, note: ChangeNote) -> Result<Self, PolicyError> {
        self.check_pending(epoch, target)?;
        Ok(Self {
            state: PolicyState::Active,
            change_epoch: self.change_epoch + 1,
            pending_target: None,
            draining_since_ms: None,
            last: note,
            ..self.clone()
        })
    }

    /// How long the class has been draining at `now_ms`, ms.
    pub fn draining_age_ms(&self, now_ms: u64) -> Option<u64> {
        self.draining_since_ms.map(|s| now_ms.saturating_sub(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(action: &str) -> ChangeNote {
        ChangeNote { actor: "t".into(), reason: "r".into(), at_ms: 10, action: action.into() }
    }

    #[test]
    fn lower_verify_activate_and_every_refusal() {
        let p = ClassPolicy::new("c", "c/1", 3, note("create")).unwrap();
        assert_eq!(ClassPolicy::new("c", "c/1", 0, note("create")), Err(PolicyError::Zero));
        assert_eq!(p.begin_lower(3, note("drain")), Err(PolicyError::NoChange { limit: 3, target: 3 }));
        let d = p.begin_lower(1, note("drain")).unwrap();
        assert!(!d.admits());
        assert_eq!((d.change_epoch, d.pending_target, d.limit), (2, Some(1), 3));
        assert_eq!(d.begin_lower(2, note("drain")), Err(PolicyError::ChangePending { epoch: 2, target: 1 }));
        assert_eq!(d.raise(5, note("raise")), Err(PolicyError::ChangePending { epoch: 2, target: 1 }));
        assert!(matches!(d.check_pending(1, 1), Err(PolicyError::Stale { .. })));
        assert!(matches!(d.check_pending(2, 2), Err(PolicyError::Stale { .. })));
        assert_eq!(d.activate(2, 1, 3, note("activate")), Err(PolicyError::OverTarget { observed: 3, target: 1 }));
        let a = d.activate(2, 1, 1, note("activate")).unwrap();
        assert_eq!((a.limit, a.state, a.change_epoch, a.pending_target), (1, PolicyState::Active, 3, None));
        assert!(matches!(a.cancel(2, 1, note("cancel")), Err(PolicyError::Stale { .. })));
        let c = d.cancel(2, 1, note("cancel")).unwrap();
        assert_eq!((c.limit, c.state, c.change_epoch), (3, PolicyState::Active, 3));
        assert_eq!(c.draining_age_ms(100), None);
        assert_eq!(d.draining_age_ms(100), Some(90));
        assert_eq!(a.raise(4, note("raise")).unwrap().limit, 4);
    }

    #[test]
    fn a_move_drains_resumes_and_finishes_without_touching_the_limit() {
        let p = ClassPolicy::new("c", "c/1", 3, note("create")).unwrap();
        let m = p.begin_move(note("move")).unwrap();
        assert!(!m.admits() && m.pending_move);
        assert_eq!((m.change_epoch, m.limit, m.pending_target), (2, 3, None));
        assert_eq!(m.begin_move(note("move")).unwrap(), m, "a second apply resumes");
        assert!(matches!(m.begin_lower(1, note("drain")), Err(PolicyError::ChangePending { .. })));
        assert!(matches!(m.check_pending(2, 3), Err(PolicyError::Stale { .. })), "not a limit change");
        assert!(matches!(m.finish_move(1, note("apply")), Err(PolicyError::Stale { .. })));
        let f = m.finish_move(2, note("apply")).unwrap();
        assert!(f.admits() && !f.pending_move);
        assert_eq!((f.change_epoch, f.limit), (3, 3));
        let d = p.begin_lower(1, note("drain")).unwrap();
        assert!(matches!(d.begin_move(note("move")), Err(PolicyError::ChangePending { .. })));
    }
}
