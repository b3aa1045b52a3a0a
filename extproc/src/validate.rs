//! ValidateToken (ADR-16's fallback): `POST /v1/tokens/validate` answers whether a
//! token is the current grant of a key, for resources that can store nothing.
//!
//! The answer comes from one linearizable etcd read (a read-only transaction) of the
//! key's hold slots and the epoch record, at one revision: `current` is true when a
//! hold of the key has the token's revision as its create revision, that hold was
//! granted in the token's epoch, and the token's epoch is the record's. It is rate
//! limited by its own token bucket (`validate_rate_per_s`), separately from lock
//! traffic: over the rate the answer is `429 rate_limited` and etcd is not read.
//!
//! "Current" is true at the read's revision only: a resource that validates and then
//! writes is not fenced against a pause between the two (docs/FENCING.md).

pub use lockmesh_lock::validate::is_current;
use std::sync::Mutex;

use lockmesh_core::Code;
use tokio::time::Instant;

use crate::respond::{ApiError, ApiResponse};

/// A token bucket: `rate` tokens per second, burst `rate`.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    state: Mutex<(f64, Instant)>,
}

// === impl RateLimiter ===

impl RateLimiter {
    /// A full bucket of `rate_per_s` (at least 1).
    pub fn new(rate_per_s: u32) -> Self {
        let rate = f64::from(rate_per_s.max(1));
        Self { rate, state: Mutex::new((rate, Instant::now())) }
    }

    /// Takes one token if there is one.
    pub(crate) fn try_take(&self) -> bool {
        self.try_take_at(Instant::now())
    }

    /// [`RateLimiter::try_take`] at `now` (monotonic; an earlier `now` adds nothing).
    pub(crate) fn try_take_at(&self, now: Instant) -> bool {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, at) = *g;
        let refilled = (tokens + now.saturating_duration_since(at).as_secs_f64() * self.rate).min(self.rate);
        if refilled >= 1.0 {
            *g = (refilled - 1.0, now);
            true
        } else {
            *g = (refilled, now);
            false
        }
    }
}

/// The `429 rate_limited` answer (its `retry-after` comes from [`Code`]).
pub fn rate_limited() -> ApiResponse {
    ApiResponse::from(ApiError::new(
        Code::RateLimited,
        "validate calls are over this arbiter's validate_rate_per_s; retry later",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_its_rate_and_refills() {
        let b = RateLimiter::new(3);
        let t0 = Instant::now();
        assert!(b.try_take_at(t0) && b.try_take_at(t0) && b.try_take_at(t0));
        assert!(!b.try_take_at(t0));
        let t1 = t0 + std::time::Duration::from_millis(340);
        assert!(b.try_take_at(t1));
        assert!(!b.try_take_at(t1));
        let t2 = t1 + std::time::Duration::from_secs(10);
        assert!(b.try_take_at(t2) && b.try_take_at(t2) && b.try_take_at(t2));
        assert!(!b.try_take_at(t2));
    }

    #[test]
    fn rate_limited_has_a_stable_code() {
        let r = rate_limited();
        assert_eq!(r.status, 429);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["code"], "rate_limited");
        assert!(r.headers.contains(&("x-lockmesh-error", "rate_limited".to_owned())));
        assert!(r.headers.contains(&("retry-after", "1".to_owned())));
    }
}
