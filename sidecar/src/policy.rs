//! The NetworkPolicies that keep other pods off a fenced store's own port.
//!
//! [`store_namespace_policy`] is for store namespaces (every pod a store): it
//! selects every pod of the namespace (`podSelector: {}`), so a pod that edits
//! its labels after admission is still covered; the injector keeps every store
//! there on the one backend port it closes. [`network_policy`] is for namespaces
//! where only some pods are fenced, and selects by the injector's labels.
//!
//! It selects the pods the injector labelled with one backend port
//! (`lockmesh.io/fenced: "true"`, `lockmesh.io/fenced-backend-port: "<port>"`) and
//! allows ingress on every TCP port except that one (two `endPort` ranges), and on
//! every UDP and SCTP port, so it takes nothing away but the store's own port.
//! Policies with the same labels are identical, so several in one namespace add
//! nothing to each other's allowances.
//!
//! Limits, stated in docs/DEPLOY.md: NetworkPolicy never filters traffic between
//! containers of one pod (they share the network namespace), so the store must
//! also bind 127.0.0.1; policies are additive, so another policy that allows all
//! ingress to these pods reopens the port; and a CNI without NetworkPolicy
//! support ignores it.

use serde_json::{json, Value};

use crate::annotations::{BACKEND_PORT_LABEL, FENCED_LABEL};

/// Name of the policy for one backend port.
pub fn name(backend_port: u16) -> String {
    format!("lockmesh-fence-backend-{backend_port}")
}

/// Name of the store namespace's policy for one backend port.
pub fn store_namespace_name(backend_port: u16) -> String {
    format!("lockmesh-fence-store-namespace-{backend_port}")
}

/// The NetworkPolicy for pods whose store moved to `backend_port`, in
/// `namespace` (omitted when `None`, so `kubectl apply -n` chooses).
pub fn network_policy(namespace: Option<&str>, backend_port: u16) -> Value {
    let selector = json!({"matchLabels": {FENCED_LABEL: "true", BACKEND_PORT_LABEL: backend_port.to_string()}});
    closing(namespace, name(backend_port), selector, backend_port)
}

/// The NetworkPolicy of a store namespace: every pod of the namespace, labels or
/// not, admits ingress on every port but `backend_port`.
pub fn store_namespace_policy(namespace: Option<&str>, backend_port: u16) -> Value {
    closing(namespace, store_namespace_name(backend_port), json!({}), backend_port)
}

fn closing(namespace: Option<&str>, name: String, selector: Value, backend_port: u16) -> Value {
    let mut tcp = Vec::new();
    if backend_port > 1 {
        tcp.push(json!({"protocol": "TCP", "port": 1, "endPort": backend_port - 1}));
    }
    if backend_port < u16::MAX {
        tcp.push(json!({"protocol": "TCP", "port": backend_port + 1, "endPort": u16::MAX}));
    }
    tcp.push(json!({"protocol": "UDP", "port": 1, "endPort": u16::MAX}));
    tcp.push(json!({"protocol": "SCTP", "port": 1, "endPort": u16::MAX}));
    let mut metadata = json!({
        "name": name,
        "labels": {"app.kubernetes.io/part-of": "lockmesh", "app.kubernetes.io/component": "fence"},
    });
    if let Some(ns) = namespace {
        metadata["namespace"] = json!(ns);
    }
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": tcp}],
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the policy admits TCP traffic to `port`.
    fn admits(policy: &Value, port: u64) -> bool {
        policy["spec"]["ingress"][0]["ports"].as_array().unwrap().iter().any(|p| {
            p["protocol"] == "TCP" && p["port"].as_u64().unwrap() <= port && port <= p["endPort"].as_u64().unwrap()
        })
    }

    #[test]
    fn only_the_backend_port_is_closed() {
        for backend in [1u16, 8080, 15081, 65535] {
            let p = network_policy(Some("shop"), backend);
            for port in [1u64, 80, 8080, 15080, 15081, 15082, 65535] {
                assert_eq!(admits(&p, port), port != u64::from(backend), "backend {backend}, port {port}");
            }
            assert_eq!(p["spec"]["podSelector"]["matchLabels"][BACKEND_PORT_LABEL], backend.to_string());
            let n = store_namespace_policy(Some("shop"), backend);
            for port in [1u64, 8080, 15081, 65535] {
                assert_eq!(admits(&n, port), port != u64::from(backend), "backend {backend}, port {port}");
            }
            assert_eq!(n["spec"]["podSelector"], json!({}), "every pod of the namespace, whatever its labels");
        }
    }
}
