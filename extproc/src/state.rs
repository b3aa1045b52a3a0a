//! Shared arbiter state.

use std::sync::{Arc, RwLock};

use lockmesh_core::ClassRegistry;

use crate::{config::Config, lock::Store, metrics::Metrics};

/// Everything a request handler needs.
pub struct State {
    /// Validated configuration.
    pub config: Config,
    /// The etcd recipe on the coord cluster (the only cluster unless `clusters:`).
    pub store: Arc<Store>,
    /// Every cluster and where each key goes (`crate::tiers`).
    pub tiers: Arc<crate::tiers::Tiers>,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The ValidateToken rate limit (`validate_rate_per_s`).
    pub validate_limiter: crate::validate::RateLimiter,
    /// The registry file's reload state (`registry`).
    pub registry_status: crate::registry::ReloadStatus,
    /// The keyspace version and capabilities this arbiter supports, its
    /// advertisement and its refusal (`lockmesh_lock::upgrade`, issue #19).
    pub upgrade: Arc<crate::lock::upgrade::Gate>,
    /// Seals election observers' cursors (`crate::cursor`).
    pub cursor: crate::cursor::CursorKey,
    registry: RwLock<Arc<ClassRegistry>>,
}

impl State {
    /// New state over one cluster (`store`) ([`State::with_tiers`] for more).
    pub fn new(config: Config, store: Arc<Store>) -> Self {
        // Every store of this arbiter shares the coord store's runtime.
        store.runtime().set_registry(&config.registry);
        let registry = RwLock::new(Arc::new(config.registry.clone()));
        let validate_limiter = crate::validate::RateLimiter::new(config.validate_rate_per_s);
        let tiers = Arc::new(crate::tiers::Tiers::new(
            [(store.cluster_name().to_owned(), store.clone())].into(),
            vec![store.cluster_name().to_owned()],
            config.topology.region.clone(),
        ));
        let cursor = crate::cursor::CursorKey::new(config.signing.as_ref());
        let upgrade = crate::lock::upgrade::Gate::new(support_from_env());
        let metrics = Metrics::new(store.runtime().clone(), upgrade.clone());
        Self {
            config,
            store,
            tiers,
            metrics,
            validate_limiter,
            registry_status: Default::default(),
            upgrade,
            cursor,
            registry,
        }
    }

    /// The same state over `tiers` (whose coord store is `store`).
    pub(crate) fn with_tiers(mut self, tiers: Arc<crate::tiers::Tiers>) -> Self {
        self.tiers = tiers;
        self
    }

    /// Replaces the class registry (a valid reload).
    pub(crate) fn set_registry(&self, reg: ClassRegistry) {
        self.store.runtime().set_registry(&reg);
        let mut g = self.registry.write().unwrap_or_else(|p| p.into_inner());
        *g = Arc::new(reg);
    }

    /// The current class registry.
    pub fn registry(&self) -> Arc<ClassRegistry> {
        self.registry.read().map(|g| g.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }
}

/// What this arbiter supports: everything, minus `LOCKMESH_CAPABILITIES_OFF`
/// (`lockmesh_lock::upgrade`). `main` refuses an unknown name before it gets here;
/// should one reach here anyway, the arbiter supports no capability at all, which
/// refuses more, never less.
fn support_from_env() -> crate::lock::upgrade::Support {
    crate::lock::upgrade::Support::from_env().unwrap_or_else(|e| {
        tracing::error!("{e}; supporting no capability");
        crate::lock::upgrade::Support::without(&crate::lock::upgrade::Capability::ALL)
    })
}
