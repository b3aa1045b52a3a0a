//! `lockmesh_arbiter_shadow_decisions_total{namespace, class, decision, reason}`:
//! the decisions of classes' candidate policies that differ from the enforced ones
//! (`lockmesh_lock::shadow`), counted at this arbiter since it started. Labels are
//! bounded: a namespace the registry names (else `other`), a class, two decisions
//! and three reasons.

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, MetricType},
};

/// Encodes `lockmesh_lock::shadow::Shadow::totals` at scrape time.
pub(super) struct ShadowCollector(pub(super) std::sync::Arc<crate::lock::Runtime>);

impl std::fmt::Debug for ShadowCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShadowCollector")
    }
}

impl Collector for ShadowCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "lockmesh_arbiter_shadow_decisions",
            "Decisions a class's candidate policy would have made differently from the enforced one, at this arbiter (would_refuse: the enforced policy granted or renewed; would_grant: it refused), by namespace, class, decision and reason.",
            None,
            MetricType::Counter,
        )?;
        for c in self.0.shadow().totals() {
            let labels = [
                ("namespace", c.namespace.as_str()),
                ("class", c.class.as_str()),
                ("decision", c.decision.as_str()),
                ("reason", c.reason.as_str()),
            ];
            ConstCounter::new(c.count).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
