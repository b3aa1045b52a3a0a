//! Scenarios: audit_query (issue #17).
