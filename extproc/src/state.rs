//! Shared arbiter state.

use std::sync::{Arc, RwLock};

use lockmesh_core::ClassRegistry;

use crate::{config::Config, lock::Store, metrics::Metrics};

/// Everything a request handler needs.
pub struct State {
    /// Validated configuration.
    pub config: Config,
    /// The etcd recipe.
    pub store: Arc<Store>,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The ValidateToken rate limit (`validate_rate_per_s`).
    pub validate_limiter: crate::validate::RateLimiter,
    /// The registry file's reload state (`registry`).
    pub registry_status: crate::registry::ReloadStatus,
    registry: RwLock<Arc<ClassRegistry>>,
}

impl State {
    /// New state.
    pub fn new(config: Config, store: Arc<Store>) -> Self {
        let registry = RwLock::new(Arc::new(config.registry.clone()));
        let validate_limiter = crate::validate::RateLimiter::new(config.validate_rate_per_s);
        Self {
            config,
            store,
            metrics: Metrics::default(),
            validate_limiter,
            registry_status: Default::default(),
            registry,
        }
    }

    /// Replaces the class registry (a valid reload).
    pub fn set_registry(&self, reg: ClassRegistry) {
        let mut g = self.registry.write().unwrap_or_else(|p| p.into_inner());
        *g = Arc::new(reg);
    }

    /// The current class registry.
    pub fn registry(&self) -> Arc<ClassRegistry> {
        self.registry.read().map(|g| g.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }
}
