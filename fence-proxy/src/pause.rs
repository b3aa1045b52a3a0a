//! The pause test kit (ADR-17).
