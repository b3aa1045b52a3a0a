//! The bounded labels every lockmesh metric and span carries: namespace (only a
//! namespace the registry names; anything else is `other`), class and tier, never a
//! key, token, session or identity (ADR-22 in docs/DECISIONS.md); and a fixed-bucket
//! histogram.

use std::fmt::Write;

use lockmesh_core::{ClassRegistry, LockKey};

/// Grant latency buckets, seconds (a grant that waits counts its wait).
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
/// Hold time buckets, seconds.
pub const HOLD_BUCKETS: &[f64] = &[0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0];

/// The bounded labels of a lock metric: namespace, class, tier.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockLabels {
    /// The key's namespace when the registry names it in a prefix, else `other`.
    pub namespace: String,
    /// The key's class (from the registry).
    pub class: String,
    /// The class's tier.
    pub tier: &'static str,
}

/// A Prometheus histogram with fixed buckets.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
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

// === impl LockLabels ===

impl LockLabels {
    /// `namespace="..",class="..",tier=".."`.
    pub fn render(&self) -> String {
        format!("namespace=\"{}\",class=\"{}\",tier=\"{}\"", self.namespace, self.class, self.tier)
    }
}

// === impl Histogram ===

impl Histogram {
    /// An empty histogram over `bounds` (ascending upper bounds; `+Inf` is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    /// Appends the `_bucket`, `_sum` and `_count` lines of `name{labels}`.
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", self.count);
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}
