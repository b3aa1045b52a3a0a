//! lockmesh-sidecar injects fence-proxy in front of a legacy store's container.
//!
//! One pure function, [`inject::inject_in`] (and [`inject::inject`], which reads
//! the namespace from the object), turns a Pod, Deployment or StatefulSet (JSON)
//! that the admins' selection makes a store, or that opted in, into the same
//! object with the injector's own fence-proxy in front of its store. Nothing the
//! pod writes about its fence is believed: a fence container, volume, status
//! annotation or label of its own is replaced unless the object is already
//! exactly what injection makes of it.
//!
//! Two thin front ends share it: `lockmesh-inject` rewrites manifests like
//! `istioctl kube-inject` ([`manifest`]), and `lockmesh-sidecar-webhook` is a
//! mutating admission webhook answering AdmissionReview v1 with a JSON Patch
//! ([`webhook`], served over rustls by [`server`]). docs/DEPLOY.md describes the
//! annotations, what the store must support, and the limits.
//!
//! # Layout
//! - [`annotations`]: the opt-in annotations, the labels and status the injector writes
//! - [`mod@inject`]: the pure injection function
//! - [`patch`]: RFC 6902 diff for the webhook's patch
//! - [`policy`]: the NetworkPolicy keeping other pods off the store's port
//! - [`manifest`]: multi-document YAML rewrite (the CLI)
//! - [`webhook`]: AdmissionReview v1 in, AdmissionReview response out
//! - [`server`]: HTTPS server with certificate reload
//! - [`config`]: the injector's `Config`
//! - [`refusal`]: refusal codes and messages
#![forbid(unsafe_code)]

pub mod annotations;
pub mod config;
pub mod inject;
pub mod manifest;
pub mod patch;
pub mod policy;
pub mod refusal;
pub mod server;
pub mod webhook;

pub use config::{Companion, Config};
pub use inject::{inject, inject_in, Injected, Outcome, Scope};
pub use refusal::{Code, InjectError, Refusal};
