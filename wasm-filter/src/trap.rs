//! TEST ONLY, compiled only with the `test-trap` cargo feature: a request carrying
//! the configured `test_trap_header` panics, which traps the Wasm VM, so a scenario
//! can prove that a VM crash fails closed (every request on the worker is refused,
//! none forwarded). The shipped module is built without the feature: it has no such
//! panic, and its configuration parser refuses `test_trap_header`.

use crate::config::Config;

/// Whether `h` may be the trap header: a lowercase header name (Envoy hands the
/// filter lowercase names).
pub(crate) fn valid_header(h: &str) -> bool {
    !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
}

/// Traps the VM when `cfg` names a trap header and `headers` carries it.
pub(crate) fn spring(cfg: &Config, headers: &[(String, Vec<u8>)]) {
    if let Some(trap) = &cfg.test_trap_header {
        if headers.iter().any(|(n, _)| n == trap) {
            panic!("lockmesh test trap");
        }
    }
}
