//! The lockmesh protocol shared by the Wasm filter, the arbiter, the fence proxy and
//! the holder SDK. Nothing here does I/O, so it builds for `wasm32-wasip1`.
//!
//! # Layout
//! - [`headers`]: every header name and the parsers that turn raw header bytes into
//!   validated values (one canonical form each).
//! - [`key`]: [`LockKey`] and its domain-separated SHA-256 digest, the only form a key
//!   takes in etcd key names, logs and metrics.
//! - [`token`]: [`FencingToken`], `epoch x 2^48 + commit revision`.
//! - [`code`]: the stable error codes and the one table deciding each one's status,
//!   retryability and headers.
//! - [`class`]: the class schema and the longest-prefix registry lookup.
//! - [`policy`]: a class's authoritative limit and the limit-change protocol.
//! - [`pause`]: the pause test result document and its validity check.
//! - [`quota`]: per-namespace quotas (sessions, holds, waiters, acquire rate).
//! - [`shard`]: the shard map and rendezvous homing of keys on clusters (ADR-07, ADR-09).
//! - [`wire`]: every JSON body lockmesh speaks, as serde types (one module per
//!   surface: API, VM routes, `/status`, console, admin, audit, `lockctl --json`).
//! - [`canon`]: the one canonical form of a request path, shared by the filter and
//!   fence-proxy (issue #17).
//! - [`route`]: the lock API's routes, one table of method and path read by the
//!   filter's classification and the arbiter's dispatch.
//! - [`template`]: path and key templates (`/orders/{id}` -> `payments/order-{id}`),
//!   shared by the filter's bound keys and fence-proxy's routes.
//! - `proof` (feature `proof`): Ed25519 grant proofs that fences verify offline.
#![forbid(unsafe_code)]

pub mod canon;
pub mod class;
pub mod code;
pub mod grant;
pub mod headers;
pub mod key;
pub mod pause;
pub mod policy;
#[cfg(feature = "proof")]
pub mod proof;
pub mod quota;
pub mod route;
pub mod shard;
pub mod template;
pub mod token;
pub mod wire;

pub use class::{ClassName, ClassRegistry, ClassSpec};
pub use code::{AnyCode, Code, Reason};
pub use key::{KeyDigest, LockKey};
pub use token::FencingToken;
