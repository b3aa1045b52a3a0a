//! Envoy-wide shared data (proxy-wasm `get_shared_data`/`set_shared_data`, one store
//! per `vm_id` shared by every worker): read-modify-write by compare-and-swap.
//!
//! Envoy's `set_shared_data` on a **missing** key succeeds whatever CAS it is given
//! (docs/DECISIONS.md F-9), so "create if absent" does not exist. A write to a value that
//! was missing when read passes [`ABSENT_CAS`], a CAS Envoy's counter practically
//! never holds: if another worker created the value in between, the write fails with
//! `CasMismatch` and is retried on the fresh value instead of overwriting it. (It
//! would be lost only if that value's CAS were exactly `u32::MAX`, one in 2^32.)

use proxy_wasm::{hostcalls, types::Status};

use crate::roster::Roster;

/// Attempts before an update gives up (contention between workers only).
pub(crate) const MAX_ATTEMPTS: usize = 64;
/// The CAS given when writing a value that was missing when read.
pub(crate) const ABSENT_CAS: u32 = u32::MAX;
/// The counter that hands out owner tags.
const OWNER_SEQ: &str = "lockmesh.owner.seq";
/// The digest of the last configuration whose warnings were logged.
const WARNED: &str = "lockmesh.config.warned";

/// Reads a roster; missing reads as empty.
pub(crate) fn read_roster(name: &str) -> Result<Roster, Status> {
    let (bytes, _) = hostcalls::get_shared_data(name)?;
    Ok(Roster::decode(bytes.as_deref().unwrap_or_default()))
}

/// Applies `f` to the current value of `name` and writes the result, retrying on
/// CAS conflicts; `f` may run more than once and must only compute from its input.
/// Nothing is written when the value is unchanged.
pub(crate) fn update_bytes<T>(name: &str, mut f: impl FnMut(Option<&[u8]>) -> (Vec<u8>, T)) -> Result<T, Status> {
    for _ in 0..MAX_ATTEMPTS {
        let (old, cas) = hostcalls::get_shared_data(name)?;
        let (new, out) = f(old.as_deref());
        if old.as_deref() == Some(new.as_slice()) {
            return Ok(out);
        }
        match hostcalls::set_shared_data(name, Some(&new), Some(cas.unwrap_or(ABSENT_CAS))) {
            Ok(()) => return Ok(out),
            Err(Status::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Status::CasMismatch)
}

/// Updates roster `name`: prunes entries stale at `now_ms`, then applies `f`.
pub(crate) fn update_roster<T>(name: &str, now_ms: u64, mut f: impl FnMut(&mut Roster) -> T) -> Result<T, Status> {
    update_bytes(name, |old| {
        let mut r = Roster::decode(old.unwrap_or_default());
        r.prune(now_ms);
        let out = f(&mut r);
        (r.encode(), out)
    })
}

/// A tag no other root context in this Envoy holds (a shared counter).
pub(crate) fn new_owner_tag() -> Result<u32, Status> {
    update_bytes(OWNER_SEQ, |old| {
        let n = old.and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes).wrapping_add(1);
        (n.to_le_bytes().to_vec(), n)
    })
}

/// Whether this root context is the first in the Envoy to load configuration
/// `bytes` (its digest is recorded in shared data), so its warnings are logged once,
/// not once per worker VM. An unreadable store answers true: a repeated warning beats
/// a lost one.
pub(crate) fn first_to_load(bytes: &[u8]) -> bool {
    use std::hash::{Hash, Hasher};
    // `DefaultHasher::new()` has fixed keys: every VM computes the same digest.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    let digest = h.finish().to_le_bytes().to_vec();
    update_bytes(WARNED, |old| (digest.clone(), old != Some(digest.as_slice()))).unwrap_or(true)
}
