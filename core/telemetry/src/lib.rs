//! What lockmesh's services report, shared by the arbiter, the lock recipe and the
//! audit tailer.
//!
//! # Layout
//! - [`labels`]: the bounded labels of every metric and span (namespace, class,
//!   tier; ADR-22 in docs/DECISIONS.md) and a fixed-bucket histogram.
//! - [`otlp`]: tracing spans exported to an OpenTelemetry collector over OTLP/HTTP,
//!   with the redaction that keeps keys, tokens and identities out.
#![forbid(unsafe_code)]

pub mod labels;
pub mod otlp;

pub use otlp::*;
