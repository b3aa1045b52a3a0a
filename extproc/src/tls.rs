//! mTLS: the arbiter's server identity and the check that only lockmesh's own
//! Envoys (by SPIFFE ID) may call it.

use x509_parser::{extensions::GeneralName, prelude::FromDer};

/// The first URI SAN of a DER certificate (SPIFFE X509-SVIDs carry exactly one).
pub fn uri_san(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::URI(u) => Some((*u).to_owned()),
        _ => None,
    })
}
