//! The lockmesh holder SDK: take locks through the lock tier's HTTP API (mTLS with
//! the workload's SPIFFE certificate) and behave safely when the service goes dark.
//!
//! ```no_run
//! # async fn demo() -> Result<(), lockmesh_client::Error> {
//! use std::time::Duration;
//! use lockmesh_client::{Client, Config, LockOptions};
//!
//! let config = Config::new("https://lock-tier:18000", "ca.pem", "svid.pem", "svid-key.pem");
//! let client = Client::new(config, |fence| {
//!     // Every hold of fence.session is gone: stop writing with its tokens.
//!     eprintln!("lost {} locks ({})", fence.keys.len(), fence.reason);
//! })?;
//! let guard = client.lock("payments/order-42", LockOptions::default().wait(Duration::from_secs(5))).await?;
//! while guard.can_start() && guard.remaining_ttl() > Duration::from_secs(2) {
//!     // one unit of work, fenced with guard.token()
//! #   break;
//! }
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! What it does (docs/SDK.md has the whole contract):
//! - **Sessions** (ADR-10): one per TTL per client, opened on first use, each
//!   renewed by one keepalive every TTL/3 however many holds it carries. Requests
//!   carry a per-process instance id (`x-lock-instance`), so the service can name a
//!   leak as a leak.
//! - **Two-stage loss** (ADR-12): from the first failed keepalive the session is
//!   in *jeopardy*: [`LockGuard::can_start`] is false, [`LockGuard::state`] says
//!   [`HoldState::Jeopardy`], and the optional jeopardy callback
//!   ([`Client::with_jeopardy`]) is told; a later acknowledged keepalive ends it
//!   (told too). At `send time of the last acknowledged keepalive + TTL - margin`
//!   the required fence callback runs. `session_expired` or an epoch change is
//!   loss at once.
//! - **Re-entrancy** (ADR-13) is counted here: only the outermost acquire and the
//!   final release reach the service.
//! - **No leaks**: an acquire whose answer is lost, or whose caller stopped
//!   waiting, is resolved from the session's holds and released if unwanted.
//!
//! # Layout
//! - [`clock`]: the pure two-stage loss clock.
//! - [`ledger`]: the pure re-entrancy ledger.
//! - `api`: one method per HTTP route, failures classified by effect.
//! - `tls`: the workload's certificate, key and the tier's CA, re-read when the
//!   files change ([`Config::cert_reload`]).
//! - `session`: a session and its keepalive task.
//! - `client`, `guard`, `acquire`: the public handles and the acquire task.
//! - [`election`]: [`Client::campaign`], [`Leadership`] and [`Observer`] (leader
//!   election on the same grants).
//! - [`run`]: `lockctl run KEY -- CMD` and `lockctl elect NAME -- CMD`.
#![deny(unsafe_code)]

mod acquire;
mod api;
mod client;
pub mod clock;
mod config;
pub mod election;
mod error;
mod guard;
pub mod ledger;
#[doc(hidden)]
pub mod planted;
pub mod run;
mod session;
mod tls;

pub use client::{instance_id, Client, FenceEvent, JeopardyEvent, LockOptions, OnFence, OnJeopardy, Stats};
pub use clock::{HoldState, LossReason};
pub use config::Config;
pub use election::{CampaignOptions, LeaderInfo, Leadership, Observation, Observer};
pub use error::Error;
pub use guard::LockGuard;
pub use lockmesh_core::headers::LockMode;
pub use session::SessionStatus;
