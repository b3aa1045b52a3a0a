//! Planted faults for the SDK conformance suite (client/conformance/README.md):
//! a fault the suite must catch, switched on only by its driver program calling
//! [`plant`]. Nothing in the library reads the environment for it, so an
//! application never runs with one.

use std::sync::atomic::{AtomicBool, Ordering};

static DEADLINE_FROM_ANSWER: AtomicBool = AtomicBool::new(false);

/// Switches on the planted fault `name`; false if this SDK has none of that name.
/// `deadline_from_answer`: the fence deadline counts from a keepalive's answer,
/// not its send (the bug ADR-12 rules out).
pub fn plant(name: &str) -> bool {
    match name {
        "deadline_from_answer" => {
            DEADLINE_FROM_ANSWER.store(true, Ordering::Relaxed);
            true
        }
        _ => false,
    }
}

/// Whether `deadline_from_answer` is planted.
pub(crate) fn deadline_from_answer() -> bool {
    DEADLINE_FROM_ANSWER.load(Ordering::Relaxed)
}
