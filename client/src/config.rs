//! Client configuration: where the lock tier is, the workload identity, and the
//! timing knobs of the two-stage loss behaviour.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use crate::Error;

/// How a [`crate::Client`] reaches the lock tier and times its sessions.
#[derive(Clone, Debug)]
pub struct Config {
    /// The lock tier's HTTPS base URL, e.g. `https://lock-tier:18000`. No default.
    pub endpoint: String,
    /// PEM file of the CA that signs the lock tier's certificate (the only trust
    /// root used). No default.
    pub ca_pem: PathBuf,
    /// PEM file of the workload's client certificate (its SPIFFE ID is the URI SAN).
    pub cert_pem: PathBuf,
    /// PEM file of the client certificate's private key.
    pub key_pem: PathBuf,
    /// Connect to this address instead of resolving the endpoint's host (TLS still
    /// checks the host name). Default: resolve.
    pub resolve: Option<SocketAddr>,
    /// How often `ca_pem`, `cert_pem` and `key_pem` are re-read for a rotation (by
    /// content: an atomic directory swap, as the SPIFFE helper and Kubernetes
    /// secret volumes make it, is seen). Connections opened after a change present
    /// the new certificate and trust the new bundle; open ones keep theirs; a set
    /// that does not load is logged and the previous one kept. `None`: read once,
    /// by [`crate::Client::new`]. Default 10 s; at least 100 ms.
    pub cert_reload: Option<Duration>,
    /// Safety margin subtracted from the TTL for the fence deadline
    /// (`send time of the last acknowledged keepalive + TTL - margin`). Must be
    /// below every session's TTL. Default 1 s (the API's advice).
    pub margin: Duration,
    /// Added to an acquire's wait for its request timeout, and to the time after
    /// which the lock tier can no longer grant an acquire whose answer was lost.
    /// Default 5 s.
    pub acquire_slack: Duration,
    /// Timeout of requests that do not wait (open, release, holds, close).
    /// Keepalives use the smaller of this and TTL/6. Default 5 s.
    pub request_timeout: Duration,
    /// The lock tier's request timeout (Envoy `request_timeout`, 45 s in the shipped
    /// config): an acquire whose answer was lost is checked once more this long
    /// after it was sent, in case it sat in the tier past its wait. Default 45 s.
    pub tier_request_timeout: Duration,
}

// === impl Config ===

impl Config {
    /// A configuration with the defaults above.
    pub fn new(
        endpoint: impl Into<String>,
        ca_pem: impl Into<PathBuf>,
        cert_pem: impl Into<PathBuf>,
        key_pem: impl Into<PathBuf>,
    ) -> Self {
        Self {
            endpoint: endpoint.into(),
            ca_pem: ca_pem.into(),
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
            resolve: None,
            cert_reload: Some(Duration::from_secs(10)),
            margin: Duration::from_secs(1),
            acquire_slack: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            tier_request_timeout: Duration::from_secs(45),
        }
    }

    /// Checks the values that need no I/O; returns the first error found, naming
    /// the field.
    pub fn validate(&self) -> Result<(), Error> {
        let scheme_ok = self.endpoint.starts_with("https://") && self.endpoint.len() > "https://".len();
        if !scheme_ok {
            return Err(Error::Config {
                field: "endpoint",
                why: "must be an https:// URL (the tier is mTLS only)".into(),
            });
        }
        if self.endpoint.ends_with('/') {
            return Err(Error::Config { field: "endpoint", why: "must not end with '/'".into() });
        }
        if self.margin.is_zero() {
            return Err(Error::Config { field: "margin", why: "must be above zero".into() });
        }
        let reload = self.cert_reload.map(|d| ("cert_reload", d));
        let bounded = [("acquire_slack", self.acquire_slack), ("request_timeout", self.request_timeout)];
        for (field, d) in bounded.into_iter().chain(reload) {
            if d < Duration::from_millis(100) {
                return Err(Error::Config { field, why: format!("{d:?} is below the minimum 100ms") });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        let ok = Config::new("https://localhost:18000", "ca", "c", "k");
        assert!(ok.validate().is_ok());
        let e = Config { endpoint: "http://x".into(), ..ok.clone() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "endpoint: must be an https:// URL (the tier is mTLS only)");
        let e = Config { margin: Duration::ZERO, ..ok.clone() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "margin: must be above zero");
        let e = Config { request_timeout: Duration::from_millis(5), ..ok.clone() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "request_timeout: 5ms is below the minimum 100ms");
        let e = Config { cert_reload: Some(Duration::from_millis(5)), ..ok.clone() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "cert_reload: 5ms is below the minimum 100ms");
        assert!(Config { cert_reload: None, ..ok }.validate().is_ok());
    }
}
