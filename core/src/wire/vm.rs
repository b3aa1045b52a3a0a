//! The Wasm filter's own calls to the arbiter for transparent-mode holds, on the
//! ext_proc port: `POST /internal/v1/vm/keepalive` and `POST /internal/v1/vm/release`.
//! The filter (`wasm-filter/src/transparent.rs`) writes the requests and reads the
//! answers; the arbiter (`extproc/src/internal.rs`) reads and answers them. A
//! refusal is an [`super::error::ErrorBody`] with the API's codes and statuses.
//!
//! Requests refuse unknown members (the arbiter answers `bad_request`), as the
//! arbiter does today; answers tolerate them.

use serde::{Deserialize, Serialize};

/// `POST /internal/v1/vm/keepalive`: renew every session of one filter VM, and
/// with `open`/`next`, reconcile its holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmKeepalive {
    /// With `open`: the next hold number the VM will hand out. Every hold of this
    /// VM numbered below it and not in `open` ended, and is released. Both or
    /// neither of `open` and `next`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<u64>,
    /// The hold numbers of the VM's requests still in flight (at most 100 000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<Vec<u64>>,
    /// The VM id, 32 lowercase hex digits.
    pub vm: String,
}

/// The answer to [`VmKeepalive`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmKeepaliveReply {
    /// Holds released by the reconcile (protected and unprotected).
    pub reconciled: u64,
    /// When to send the next keepalive, ms: a third of the shortest session TTL
    /// (at least 500), or 1000 without sessions.
    pub renew_ms: u64,
    /// Sessions of the VM renewed (0: the VM may stop renewing until its next hold).
    #[serde(default)]
    pub sessions: u64,
}

/// `POST /internal/v1/vm/release`: a transparent request ended; release its hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmRelease {
    /// The hold number the VM gave the request (`x-lockmesh-hold`).
    pub hold: u64,
    /// The raw lock key of the request.
    pub key: String,
    /// The VM id, 32 lowercase hex digits.
    pub vm: String,
}

/// The answer to [`VmRelease`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmReleaseReply {
    /// False when no such hold existed (already released or never granted): the
    /// filter need not retry either way.
    pub released: bool,
}
