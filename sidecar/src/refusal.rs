//! Why an injection is refused: stable codes, the field concerned and the reason.
//!
//! The injector collects every problem of an object before refusing it, so one
//! round trip shows the user all of them (the webhook joins them into the
//! admission denial, the CLI prints one per line).

use std::fmt;

/// A stable, machine-readable reason for refusing an injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// A `lockmesh.io/fence*` annotation has a value the injector cannot use.
    AnnotationInvalid,
    /// An annotation starts with `lockmesh.io/fence` but is not one the injector
    /// knows (a typo would otherwise silently drop a setting).
    UnknownAnnotation,
    /// The store container cannot be determined or does not exist.
    StoreContainer,
    /// The store's client-facing port cannot be determined or is not TCP.
    StorePort,
    /// Nothing tells the store to move to its loopback backend port.
    StoreNotMoved,
    /// A port the injection needs is already used in the pod.
    PortConflict,
    /// No ConfigMap for fence-proxy's configuration was named.
    ConfigMapMissing,
    /// No persistent volume for the marks: a bare pod names no claim.
    MarksClaimMissing,
    /// The pod's marks volume exists but is not a PersistentVolumeClaim.
    MarksNotPersistent,
    /// A container or volume with an injected name already exists.
    NameClash,
    /// The workload shape cannot keep one fence instance per store.
    WorkloadShape,
    /// The object is not a well-formed Kubernetes object of its kind.
    Malformed,
    /// A pod tries to decide its own fencing against the injector's admin-owned
    /// config: a selected store opting out, a status annotation without the fence
    /// container, or a fence ConfigMap other than the configured one.
    AdminPolicy,
    /// A long-running container other than the store and the fence, not one of
    /// the injector's `companions`: it would share the store's loopback.
    UnlistedContainer,
}

/// One reason an injection is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Stable reason code.
    pub code: Code,
    /// Path of the offending field, for example
    /// `metadata.annotations["lockmesh.io/fence-store-port"]`.
    pub field: String,
    /// Why, naming the value and the knob that fixes it.
    pub message: String,
}

/// Every reason one object cannot be injected (never empty).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct InjectError {
    /// The problems, in the order they were found.
    pub refusals: Vec<Refusal>,
}

// === impl Code ===

impl Code {
    /// The stable snake_case name used in messages and docs.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::AnnotationInvalid => "annotation_invalid",
            Code::UnknownAnnotation => "unknown_annotation",
            Code::StoreContainer => "store_container",
            Code::StorePort => "store_port",
            Code::StoreNotMoved => "store_not_moved",
            Code::PortConflict => "port_conflict",
            Code::ConfigMapMissing => "config_map_missing",
            Code::MarksClaimMissing => "marks_claim_missing",
            Code::MarksNotPersistent => "marks_not_persistent",
            Code::NameClash => "name_clash",
            Code::WorkloadShape => "workload_shape",
            Code::Malformed => "malformed",
            Code::AdminPolicy => "admin_policy",
            Code::UnlistedContainer => "unlisted_container",
        }
    }
}

// === impl Refusal ===

impl Refusal {
    /// A refusal of `field` for `message`.
    pub fn new(code: Code, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { code, field: field.into(), message: message.into() }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}: {}", self.code.as_str(), self.field, self.message)
    }
}

// === impl InjectError ===

impl fmt::Display for InjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.refusals.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            r.fmt(f)?;
        }
        Ok(())
    }
}

impl From<Vec<Refusal>> for InjectError {
    fn from(refusals: Vec<Refusal>) -> Self {
        Self { refusals }
    }
}
