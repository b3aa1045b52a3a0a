//! lockmesh-sidecar's integration tests, one binary (2-core machines):
//! AdmissionReview fixtures through the webhook function, the CLI binary on
//! multi-document YAML, the real HTTPS webhook process, and offline validation
//! of deploy/ and of the injector's output against Kubernetes schemas.

// A test binary: assertions by unwrap are the point, helpers included.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod admin_policy;
mod cli;
mod fixtures;
mod lookalikes;
mod tls;
mod validate;
mod webhook;
