//! The SDK's TLS: the workload's SVID, its key and the tier's CA bundle, re-read
//! when the files change (`lockmesh_runtime::certs::ReloadingCerts`), as the SPIFFE
//! helper and a Kubernetes secret volume rotate them (an atomic swap of the
//! directory the three files are links into).
//!
//! reqwest connects with one rustls configuration whose certificate resolver and
//! server verifier read the current set at each handshake: a connection opened
//! after a rotation presents the new certificate and verifies the tier with the new
//! bundle (every certificate in `ca_pem` is a trust anchor, so a CA roll's old+new
//! bundle works), and a connection already open keeps the certificate it was made
//! with (TLS checks certificates at the handshake only). A changed set that does
//! not load (half written, a key that does not match its certificate) is logged and
//! the set before it kept. With [`Config::cert_reload`] `None` the files are read
//! once, by [`crate::Client::new`].

use std::time::Duration;

use lockmesh_runtime::certs::{CertError, CertFiles, ReloadingCerts};

use crate::{Config, Error};

/// What the SDK offers by ALPN: HTTP/2, else HTTP/1.1 (what reqwest offers with
/// its own TLS setup).
const ALPN: &[&[u8]] = &[b"h2", b"http/1.1"];

/// The rustls client configuration of `config`'s identity and trust bundle,
/// re-read every `config.cert_reload`. The watched set lives as long as the
/// configuration (its resolver and verifier hold it); its poll ends with it.
pub(crate) fn client_config(config: &Config) -> Result<rustls::ClientConfig, Error> {
    let files = CertFiles { cert: config.cert_pem.clone(), key: config.key_pem.clone(), ca: config.ca_pem.clone() };
    // Zero: load once, no poll.
    let certs = ReloadingCerts::watch(files, config.cert_reload.unwrap_or(Duration::ZERO))
        .map_err(|e| Error::Config { field: field_of(&e), why: e.to_string() })?;
    Ok(certs.client_config(ALPN).as_ref().clone())
}

/// The [`Config`] field a refused set is named by.
fn field_of(e: &CertError) -> &'static str {
    match e {
        CertError::Read { what: "ca", .. } | CertError::Parse { what: "ca", .. } => "ca_pem",
        CertError::Read { what: "key", .. } | CertError::Parse { what: "key", .. } | CertError::KeyMismatch { .. } => {
            "key_pem"
        }
        CertError::Read { .. } | CertError::Parse { .. } => "cert_pem",
    }
}
