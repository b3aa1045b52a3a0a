//! Every JSON body lockmesh speaks, as serde types: the server side serialises
//! them, its clients (the SDK, `lockctl`, `lockctl doctor`, the console's tests,
//! the Wasm filter) deserialise them. No reply is built with `json!` and no reader
//! picks fields with `v.get(..)`.
//!
//! # Layout (one module per surface)
//! - [`error`]: the refusal body of the lock API and the VM routes, driven by
//!   [`crate::Code`].
//! - [`api`]: the lock API's answers (`/v1/locks/*`, `/v1/sessions/*`,
//!   `/v1/tokens/validate`).
//! - [`vm`]: the filter's transparent-mode calls (`/internal/v1/vm/*`).
//! - [`status`]: the arbiter's `/status`.
//! - [`console`]: the console's data routes (`/console/api/*`).
//! - [`admin`]: the two-person admin actions (`/internal/v1/admin/*`).
//! - [`audit`]: the audit tailer's queries (`/v1/audit/*`).
//! - [`inspect`], [`shard`], [`doctor`]: what `lockctl inspect`/`saturated`,
//!   `shard` and `doctor` print with `--json`.
//! - [`opaque`]: [`Opaque`], a JSON value carried without being interpreted.
//!
//! # Rules every type here keeps
//! - **Same bytes as before.** Members appear in the order the producer printed
//!   them: bodies that went through `serde_json::Value` (every `json!` reply)
//!   printed their keys sorted, so those types declare their members in
//!   alphabetical order; structs serialised directly (audit, `shard apply`,
//!   `doctor`) keep their declared order. An optional member is either absent
//!   (`skip_serializing_if`) or `null`, exactly as before; each member's doc says
//!   which. Internally tagged enums print their tag first.
//! - **Tolerant readers.** No answer type denies unknown members, and codes are
//!   read as [`crate::code::AnyCode`], so an older client reads a newer server.
//!   Request bodies the server checks strictly keep `deny_unknown_fields`.
//! - **Tokens and session ids are strings** (`"281474976710659"`,
//!   `"000000000000002a"`): JSON numbers above 2^53 lose precision in many readers.
//! - Core has no serde_json outside its tests (it builds for `wasm32-wasip1`);
//!   serde derive only.

pub mod admin;
pub mod api;
pub mod audit;
pub mod console;
pub mod doctor;
pub mod error;
pub mod inspect;
pub mod opaque;
pub mod shard;
pub mod status;
pub mod vm;

pub use error::ErrorBody;
pub use opaque::Opaque;

#[cfg(test)]
mod tests;
