//! Transparent, request-scoped locks (`docs/TRANSPARENT.md`): the arbiter's half.
//!
//! The Wasm filter on a transparent route marks a request with its worker VM's id
//! and a hold number ([`headers::VM`], [`headers::HOLD`]). The arbiter then grants
//! the request's `x-lock-key` on that VM's session for the key's class
//! ([`crate::lock::vm`]) and answers `request_headers` with a `CONTINUE` that adds the
//! grant (`x-lock-token`, `x-lock-epoch`, `x-lock-revision`, and `x-lock-proof` when
//! the arbiter has a signing key) and removes the internal
//! headers, so the upstream sees the token and never a client-supplied one (the
//! filter already stripped those; the set here overwrites in any case). A request
//! that is not granted gets the API's error answer and never reaches the upstream.
//!
//! The hold ends when the filter releases it (the request ended), when the VM stops
//! renewing its sessions (Envoy died, the VM trapped), or by a reconcile.
//!
//! The request's key is checked against the registry's LockGrants first, as on the
//! API routes (`crate::registry::authorise`); for a self client
//! (`tls.self_clients`) under the self client's own identity.
//!
//! A key of a fail-open class (ADR-04) during a declared quorum loss is granted
//! unprotected from memory instead (`crate::failopen`): the request is forwarded
//! with `x-lock-token: 0` (and `x-lock-revision: 0`), because its class declared
//! it; the filter releases it by its hold number like any other. Every other
//! class answers `unavailable` and nothing is forwarded.

use std::sync::Arc;

use lockmesh_core::{headers, Code};
use tokio_util::sync::CancellationToken;

use crate::{
    api::{self, ApiRequest, Undo},
    lock::{
        mutex::AcquireRequest,
        session::Caller,
        vm::{self, valid_vm_id},
        Store,
    },
    respond::ApiError,
    server::Answer,
    state::State,
    tiers::{Acquired, HoldFor},
};

/// Internal headers removed before a transparent request goes upstream.
pub(crate) const INTERNAL: [&str; 7] = [
    headers::FILTERED,
    headers::BUDGET_MS,
    headers::VM,
    headers::HOLD,
    headers::UNLOCKED,
    headers::SESSION,
    headers::INSTANCE,
];

/// How the filter marked a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Hold `x-lock-key` for the request's life, on `vm`'s session, as hold `hold`.
    Locked {
        /// The filter VM.
        vm: String,
        /// The hold number.
        hold: u64,
    },
}

fn header<'a>(hdrs: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    hdrs.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
}

/// The request's transparent mode, if the filter marked one. A malformed mark is an
/// internal error: only the filter sets these headers.
pub fn mode(hdrs: &[(String, Vec<u8>)]) -> Result<Option<Mode>, ApiError> {
    let bad = |what: &str| ApiError::new(Code::Internal, format!("the filter's {what} header is malformed"));
    // A request the filter lets through unlocked never reaches the arbiter: its mark
    // is filter state that makes Envoy skip ext_proc (docs/DECISIONS.md ADR-29). The
    // old header mark arriving here means a filter or config out of step, and it is
    // refused rather than forwarded unlocked.
    if header(hdrs, headers::UNLOCKED).is_some() {
        return Err(bad(headers::UNLOCKED));
    }
    let Some(vm) = header(hdrs, headers::VM) else {
        return Ok(None);
    };
    let vm = std::str::from_utf8(vm).ok().filter(|v| valid_vm_id(v)).ok_or_else(|| bad(headers::VM))?;
    let hold = header(hdrs, headers::HOLD)
        .and_then(|h| std::str::from_utf8(h).ok())
        .filter(|h| !h.is_empty() && h.len() <= 20 && h.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|h| h.parse().ok())
        .ok_or_else(|| bad(headers::HOLD))?;
    Ok(Some(Mode::Locked { vm: vm.to_owned(), hold }))
}

/// Grants a transparent request's lock and answers how it goes on.
pub async fn acquire(
    state: &Arc<State>,
    envoy: &str,
    vm: &str,
    hold: u64,
    req: &ApiRequest,
    cancel: &CancellationToken,
) -> (Answer, Option<Undo>) {
    // A key homed in another region is redirected, never forwarded (ADR-08).
    if let Some(key) = &req.lock.key {
        if let Some(region) = state.tiers.wrong_region(key) {
            return (Answer::Reply(ApiError::wrong_region(key.namespace(), region).into()), None);
        }
    }
    match grant(state, envoy, vm, hold, req, cancel).await {
        Ok((set, undo)) => (Answer::Forward { set, remove: INTERNAL.to_vec() }, Some(undo)),
        Err(e) => (Answer::Reply(e.into()), None),
    }
}

async fn grant(
    state: &Arc<State>,
    envoy: &str,
    vm: &str,
    hold: u64,
    req: &ApiRequest,
    cancel: &CancellationToken,
) -> Result<(Vec<(&'static str, String)>, Undo), ApiError> {
    state.store.unsealed()?;
    // The same LockGrant check as the API routes (a self client: under its own
    // identity), before anything is queued or granted.
    crate::registry::authorise(state, req, lockmesh_core::grant::Operation::Acquire)?;
    let key = req
        .lock
        .key
        .clone()
        .ok_or_else(|| ApiError::new(Code::LockRequired, format!("{}: required on this route", headers::KEY)))?;
    let class = api::class_for(state, &req.lock, &key)?;
    let wait = api::wait_of(state, req)?;
    // A transparent hold is one slot: the filter keeps one request of a key in
    // flight per sidecar, so shared holds would not overlap there (docs/API.md).
    api::one_slot_only(&req.lock, "not offered on transparent routes; use the lock API")?;
    // Nor several keys: a transparent request holds its one key.
    if req.lock.keys.is_some() {
        return Err(ApiError::new(
            Code::BadRequest,
            format!("{}: not offered on transparent routes; use the lock API", headers::KEYS),
        ));
    }
    let permits = api::permits_of(&req.lock, &class)?;
    let areq = AcquireRequest {
        key,
        class,
        caller: Caller { identity: req.identity.clone(), instance: None },
        session: None,
        deadline: req.received + wait,
        try_once: wait.is_zero(),
        hold_id: Some(vm::hold_id(vm, hold)),
        session_owner: Some(Store::vm_owner(envoy, vm)),
        unverified_caller: req.unverified_caller.clone(),
        permits,
        mode: req.lock.mode,
        election: false,
        session_indexed: false,
    };
    // The lock API's one entry: the VM's session on the key's home (replaced once
    // when it expired or has another TTL), re-routing, and a fail-open class's
    // unprotected grant during a declared quorum loss.
    let holder = HoldFor::Vm { envoy, vm };
    let (grant, store) = match state.tiers.acquire_or_open(&areq, holder, &state.registry(), cancel).await? {
        Acquired::Protected(g, s) => (g, s),
        Acquired::Unprotected(g, fo) => return Ok(unprotected(g, fo, areq)),
    };
    let t = grant.token;
    let mut set = vec![
        (headers::TOKEN, t.to_string()),
        (headers::EPOCH, t.epoch().to_string()),
        (headers::REVISION, t.revision().to_string()),
    ];
    // The signed grant proof, as an acquire answer carries it: a fence-proxy in front
    // of the upstream (the injected legacy-store shape) refuses a write without one.
    // The filter stripped any client-sent proof; this is the only one upstream sees.
    if let Some(proof) = crate::signing::proof_for(state.config.signing.as_ref(), &areq.key, t, &grant.class) {
        set.push((headers::PROOF, proof));
    }
    Ok((set, Undo::Grant { req: areq, grant, store }))
}

/// The answer to a transparent request granted unprotected (token 0): its class
/// declared `on_quorum_loss: open` and the quorum loss is declared.
fn unprotected(
    g: crate::failopen::MemGrant,
    fo: Arc<crate::failopen::FailOpen>,
    areq: AcquireRequest,
) -> (Vec<(&'static str, String)>, Undo) {
    let set = vec![
        (headers::TOKEN, headers::UNPROTECTED_TOKEN.to_owned()),
        (headers::EPOCH, g.epoch.to_string()),
        (headers::REVISION, "0".to_owned()),
    ];
    (set, Undo::Unprotected { fail_open: fo, req: areq, grant: g.grant })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn reads_the_filter_marks_strictly() {
        let vm = "0123456789abcdef0123456789abcdef";
        assert_eq!(mode(&h(&[("x-lock-key", "a/b")])), Ok(None));
        assert_eq!(
            mode(&h(&[(headers::VM, vm), (headers::HOLD, "7")])),
            Ok(Some(Mode::Locked { vm: vm.to_owned(), hold: 7 }))
        );
        // The old header mark is never forwarded unlocked, whatever its value.
        assert!(mode(&h(&[(headers::UNLOCKED, "1")])).is_err());
        assert!(mode(&h(&[(headers::UNLOCKED, "yes")])).is_err());
        assert!(mode(&h(&[(headers::UNLOCKED, "1"), (headers::VM, vm)])).is_err());
        assert!(mode(&h(&[(headers::VM, "short"), (headers::HOLD, "7")])).is_err());
        assert!(mode(&h(&[(headers::VM, vm)])).is_err());
        assert!(mode(&h(&[(headers::VM, vm), (headers::HOLD, "-1")])).is_err());
        assert!(mode(&h(&[(headers::VM, vm), (headers::HOLD, "99999999999999999999999")])).is_err());
    }
}
