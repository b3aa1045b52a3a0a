//! fence-proxy's metrics (`/metrics` on the admin port), in the Prometheus text
//! format 0.0.4 (what `promtool check metrics` reads).
//!
//! | Metric | Type | Labels |
//! | --- | --- | --- |
//! | `lockmesh_fence_requests_total` | counter | `route`, `outcome` |
//!
//! Labels stay bounded (ADR-22): `route` is a route name from the config or
//! `unlisted`, `outcome` is `read`, `write` or an error code of `respond.rs`. No
//! resource, key, token or identity is ever a label.

use prometheus_client::{
    encoding::{prometheus_text, EncodeLabelSet},
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

/// The `Content-Type` of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The registry and its metric families.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: &'static str,
}

// === impl Metrics ===

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        // prometheus-client appends `_total` to a counter's name and `.` to its help.
        registry.register(
            "lockmesh_fence_requests",
            "Requests by route name and outcome (read, write, or an error code)",
            requests.clone(),
        );
        Self { registry, requests }
    }
}

impl Metrics {
    /// Counts one request of `route` that ended in `outcome`.
    pub fn request(&self, route: &str, outcome: &'static str) {
        self.requests.get_or_create(&RequestLabels { route: route.to_owned(), outcome }).inc();
    }

    /// The exposition text ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_keeps_its_names_and_labels() {
        let m = Metrics::default();
        let head = "# HELP lockmesh_fence_requests_total Requests by route name and outcome (read, write, or an error code).\n\
                    # TYPE lockmesh_fence_requests_total counter\n";
        // A family without samples is left out, HELP and TYPE included.
        assert_eq!(m.encode().unwrap(), "");
        m.request("items", "write");
        m.request("items", "write");
        m.request("unlisted", "unlisted_route");
        let text = m.encode().unwrap();
        assert!(text.starts_with(head), "{text}");
        let mut samples: Vec<&str> = text.lines().skip(2).collect();
        samples.sort_unstable();
        assert_eq!(
            samples,
            [
                "lockmesh_fence_requests_total{route=\"items\",outcome=\"write\"} 2",
                "lockmesh_fence_requests_total{route=\"unlisted\",outcome=\"unlisted_route\"} 1",
            ]
        );
    }
}
