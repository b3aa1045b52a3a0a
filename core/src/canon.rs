//! The canonical form of a request path (issue #17). Filled in by the owner of this module.
