//! Planted faults for the SDK conformance suite (client/conformance/README.md):
//! a fault the suite must catch, switched on only by its driver program calling
//! [`plant`]. Nothing in the library reads the environment for it, so an
//! application never runs with one.

use std::sync::atomic::{AtomicBool, Ordering};

static DEADLINE_FROM_ANSWER: AtomicBool = AtomicBool::new(false);
static IGNORE_HONOURED_FROM: AtomicBool = AtomicBool::new(false);

/// Switches on the planted fault `name`; false if this SDK has none of that name.
/// `deadline_from_answer`: the fence deadline counts from a keepalive's answer,
/// not its send (the bug ADR-12 rules out). `ignore_honoured_from` (this SDK
/// only): a grant in a newer epoch fences every session holding an older one,
/// whatever epochs the answer says are still honoured (a shard move's soft
/// advance then costs the holds it keeps).
pub fn plant(name: &str) -> bool {
    let flag = match name {
        "deadline_from_answer" => &DEADLINE_FROM_ANSWER,
        "ignore_honoured_from" => &IGNORE_HONOURED_FROM,
        _ => return false,
    };
    flag.store(true, Ordering::Relaxed);
    true
}

/// Whether `deadline_from_answer` is planted.
pub(crate) fn deadline_from_answer() -> bool {
    DEADLINE_FROM_ANSWER.load(Ordering::Relaxed)
}

/// Whether `ignore_honoured_from` is planted.
pub(crate) fn ignore_honoured_from() -> bool {
    IGNORE_HONOURED_FROM.load(Ordering::Relaxed)
}
