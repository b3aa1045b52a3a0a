//! Reference fences inside stores (the first recommendation, ADR-16).
