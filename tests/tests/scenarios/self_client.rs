//! Scenarios: self_client (issue #17).
