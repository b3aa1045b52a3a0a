//! Scenarios: bypass (issue #17).
