//! What etcd did during a measured window, from its own Prometheus counters
//! (`/metrics` on a client URL): the requests it answered by gRPC method, the raft
//! proposals it committed and the keys its MVCC store wrote. Per cycle, this is
//! the etcd half of a workload's profile: how many transactions, reads and key
//! writes one acquire → release costs.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::prom;

/// Counters read once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EtcdCounters {
    /// `grpc_server_handled_total` by `grpc_method` (unary calls and ended streams).
    pub handled: BTreeMap<String, f64>,
    /// `etcd_server_proposals_committed_total`.
    pub proposals: f64,
    /// `etcd_mvcc_put_total`.
    pub puts: f64,
    /// `etcd_mvcc_delete_total`.
    pub deletes: f64,
    /// `etcd_debugging_lease_renewed_total`.
    pub lease_renewals: f64,
}

/// The difference of two readings, per cycle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EtcdWork {
    /// Requests by method.
    pub handled: BTreeMap<String, f64>,
    /// Raft proposals committed.
    pub proposals: f64,
    /// Keys written.
    pub puts: f64,
    /// Keys deleted.
    pub deletes: f64,
    /// Lease renewals served.
    pub lease_renewals: f64,
}

// === impl EtcdCounters ===

impl EtcdCounters {
    /// Parses Prometheus text; counters absent are zero.
    pub fn parse(text: &str) -> Self {
        let mut c = Self::default();
        for s in prom::parse(text) {
            let v = s.value;
            match s.name.as_str() {
                "grpc_server_handled_total" => {
                    if let Some(m) = s.label("grpc_method") {
                        *c.handled.entry(m.to_owned()).or_default() += v;
                    }
                }
                "etcd_server_proposals_committed_total" => c.proposals += v,
                "etcd_mvcc_put_total" => c.puts += v,
                "etcd_mvcc_delete_total" => c.deletes += v,
                "etcd_debugging_lease_renewed_total" => c.lease_renewals += v,
                _ => {}
            }
        }
        c
    }

    /// Reads `<endpoint>/metrics`; `None` when etcd does not answer.
    pub async fn read(endpoint: &str) -> Option<Self> {
        Some(Self::parse(&metrics_text(endpoint).await.ok()?))
    }

    /// What happened between `before` and this reading, divided by `cycles`.
    pub(crate) fn per_cycle_since(&self, before: &Self, cycles: u64) -> Option<EtcdWork> {
        if cycles == 0 {
            return None;
        }
        let n = cycles as f64;
        let handled = self
            .handled
            .iter()
            .map(|(m, v)| (m.clone(), (v - before.handled.get(m).copied().unwrap_or(0.0)) / n))
            .filter(|(_, v)| *v > 0.0)
            .collect();
        Some(EtcdWork {
            handled,
            proposals: (self.proposals - before.proposals) / n,
            puts: (self.puts - before.puts) / n,
            deletes: (self.deletes - before.deletes) / n,
            lease_renewals: (self.lease_renewals - before.lease_renewals) / n,
        })
    }
}

/// etcd's `/metrics` text from a client URL.
pub(crate) async fn metrics_text(endpoint: &str) -> Result<String> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let url = format!("{}/metrics", endpoint.trim_end_matches('/'));
    Ok(client.get(&url).send().await.and_then(|r| r.error_for_status()).context("read etcd /metrics")?.text().await?)
}

/// Sum of the samples of `metric` over all its labels; `None` when absent.
pub(crate) fn counter(text: &str, metric: &str) -> Option<u64> {
    let mut values = prom::parse(text).into_iter().filter(|s| s.name == metric).map(|s| s.value).peekable();
    values.peek()?;
    Some(values.sum::<f64>() as u64)
}

/// The sample of histogram bucket `name{le="<le>"}`.
pub(crate) fn bucket(text: &str, name: &str, le: &str) -> Option<u64> {
    prom::parse(text).into_iter().find(|s| s.name == name && s.label("le") == Some(le)).map(|s| s.value as u64)
}

// === impl EtcdWork ===

impl EtcdWork {
    /// `proposals 2.00, put 1.00, delete 1.00; requests Txn 2.00, Range 0.01`.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "proposals {:.2}, keys put {:.2}, deleted {:.2}, lease renewals {:.2}; requests",
            self.proposals, self.puts, self.deletes, self.lease_renewals
        );
        if self.handled.is_empty() {
            s.push_str(" none");
        }
        for (i, (m, v)) in self.handled.iter().filter(|(_, v)| **v >= 0.005).enumerate() {
            s.push_str(if i == 0 { " " } else { ", " });
            s.push_str(&format!("{m} {v:.2}"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP grpc_server_handled_total x
grpc_server_handled_total{grpc_code="OK",grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 10
grpc_server_handled_total{grpc_code="FailedPrecondition",grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 2
grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 4
etcd_server_proposals_committed_total 20
etcd_mvcc_put_total 7
etcd_mvcc_delete_total 3
"#;

    #[test]
    fn sums_methods_over_codes_and_divides_by_cycles() {
        let before = EtcdCounters::parse(TEXT);
        assert_eq!(before.handled["Txn"], 12.0);
        let after = EtcdCounters::parse(&TEXT.replace("} 10", "} 30").replace("total 20", "total 40"));
        let w = after.per_cycle_since(&before, 10).unwrap();
        assert_eq!(w.handled.get("Txn"), Some(&2.0));
        assert_eq!(w.handled.get("Range"), None, "no Range during the window");
        assert_eq!(w.proposals, 2.0);
        assert!(w.summary().contains("requests Txn 2.00"), "{}", w.summary());
        assert_eq!(after.per_cycle_since(&before, 0), None);
    }

    #[test]
    fn sums_a_counter_over_its_labels_and_reads_a_bucket() {
        let t = "# HELP x\nfoo_total{a=\"1\"} 2\nfoo_total{a=\"2\"} 3\nfoo_total_other 9\nbar 1\n\
                 h_bucket{le=\"0.5\"} 4\nh_bucket{le=\"1.024\"} 7\n";
        assert_eq!(counter(t, "foo_total"), Some(5));
        assert_eq!(counter(t, "bar"), Some(1));
        assert_eq!(counter(t, "baz"), None);
        assert_eq!(bucket(t, "h_bucket", "1.024"), Some(7));
        assert_eq!(bucket(t, "h_bucket", "2"), None);
    }
}
