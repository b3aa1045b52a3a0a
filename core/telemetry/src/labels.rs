//! The bounded labels every lockmesh metric and span carries: namespace (only a
//! namespace the registry names; anything else is `other`), class and tier, never a
//! key, token, session or identity (ADR-22 in docs/DECISIONS.md); the bucket
//! bounds of the latency and hold-time histograms; and [`Described`], the family
//! wrapper that keeps a family's HELP and TYPE lines in the exposition before its
//! first sample.

use lockmesh_core::{ClassRegistry, LockKey};
use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder},
    metrics::MetricType,
};

/// Grant latency buckets, seconds (a grant that waits counts its wait).
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
/// Hold time buckets, seconds.
pub const HOLD_BUCKETS: &[f64] = &[0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0];

/// The bounded labels of a lock metric: namespace, class, tier (in this order in
/// the exposition).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, EncodeLabelSet)]
pub struct LockLabels {
    /// The key's namespace when the registry names it in a prefix, else `other`.
    pub namespace: String,
    /// The key's class (from the registry).
    pub class: String,
    /// The class's tier.
    pub tier: &'static str,
}

/// The tier label of a tier.
pub fn tier_label(t: lockmesh_core::class::Tier) -> &'static str {
    match t {
        lockmesh_core::class::Tier::Coord => "coord",
        lockmesh_core::class::Tier::Entity => "entity",
    }
}

/// The labels of `key` under `reg`: its namespace only if the registry names it.
pub fn lock_labels(reg: &ClassRegistry, key: &LockKey) -> LockLabels {
    let class = reg.class_of(key);
    let ns = key.namespace();
    LockLabels {
        namespace: if reg.knows_namespace(ns) { ns.to_owned() } else { "other".to_owned() },
        class: class.name.to_string(),
        tier: tier_label(class.tier),
    }
}

/// The labels of a raw key string (audit records); unparsable keys are `other`.
pub fn labels_of_raw(reg: &ClassRegistry, key: &str) -> LockLabels {
    match LockKey::parse(key.as_bytes()) {
        Ok(k) => lock_labels(reg, &k),
        Err(_) => LockLabels { namespace: "other".into(), class: "other".into(), tier: "entity" },
    }
}

/// A metric (in practice a `Family`) whose `# HELP` and `# TYPE` lines are written
/// even while it has no sample: prometheus-client leaves an empty family out, but
/// the alert rules and the dashboard (deploy/monitoring) name families such as
/// `lockmesh_arbiter_unprotected_grants_total` that have no label set until their
/// first event, and the exposition must still declare them. Clones share the
/// wrapped metric's values.
#[derive(Debug, Clone, Default)]
pub struct Described<M>(pub M);

// === impl Described ===

impl<M: EncodeMetric> EncodeMetric for Described<M> {
    fn encode(&self, encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

impl<M> std::ops::Deref for Described<M> {
    type Target = M;

    fn deref(&self) -> &M {
        &self.0
    }
}
