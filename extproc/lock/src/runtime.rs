//! What one arbiter configures and counts, handed to every cluster's [`Store`]
//! it opens (`Store::connect_with`; a tier's other stores share their coord
//! store's): the hand-off policy, the class registry's lock-delays, shadow
//! candidates and quotas, and what those count at this arbiter.
//!
//! Nothing here is process-wide: two arbiters in one process (the load tool's
//! in-process engine, a test) each keep their own, and a registry reload reaches
//! every store of its arbiter through [`Runtime::set_registry`] at once.
//!
//! What stays process-wide are the counters `/metrics` exposes once per process
//! (hand-off results, step timings, groups, fail-open figures): they count, and
//! decide nothing.
//!
//! [`Store`]: crate::Store

use std::sync::Arc;

use lockmesh_core::ClassRegistry;

use crate::{delay::Delays, quota::Quotas, shadow::Shadow, wait::Handoff};

/// One arbiter's configuration and per-arbiter books; see the module docs.
#[derive(Default)]
pub struct Runtime {
    handoff: Handoff,
    delays: Delays,
    shadow: Shadow,
    quotas: Arc<Quotas>,
}

impl Runtime {
    /// A runtime with `handoff`, before any registry (no delays, no candidates,
    /// no quotas: [`Runtime::set_registry`] gives them).
    pub fn new(handoff: Handoff) -> Arc<Self> {
        Arc::new(Self { handoff, ..Self::default() })
    }

    /// A runtime with the default hand-off and `reg`'s classes (tools and tests).
    pub fn with_registry(reg: &ClassRegistry) -> Arc<Self> {
        let rt = Self::new(Handoff::default());
        rt.set_registry(reg);
        rt
    }

    /// Takes a (re)loaded registry: every store of this runtime follows it from
    /// its next decision on.
    pub fn set_registry(&self, reg: &ClassRegistry) {
        self.quotas.set_registry(reg);
        self.delays.set_registry(reg);
        self.shadow.set_registry(reg);
    }

    /// Whether and how releases hand keys over.
    pub fn handoff(&self) -> Handoff {
        self.handoff
    }

    /// The lock-delays of the registry in force.
    pub fn delays(&self) -> &Delays {
        &self.delays
    }

    /// The shadow candidates and what they decided here.
    pub fn shadow(&self) -> &Shadow {
        &self.shadow
    }

    /// The quotas in force and what this arbiter counts against them.
    pub fn quotas(&self) -> &Arc<Quotas> {
        &self.quotas
    }
}
