//! Path and key templates (issue #17). Filled in by the owner of this module.
