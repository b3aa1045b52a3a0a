//! The SPIFFE identity of an mTLS peer.

use std::{collections::VecDeque, sync::Mutex};

use x509_parser::{certificate::X509Certificate, extensions::GeneralName, prelude::FromDer};

/// The SPIFFE ID of a DER certificate: its one URI SAN, when that URI starts with
/// `spiffe://`.
///
/// `None` when the certificate does not parse, has no subject alternative name
/// extension or more than one, has no URI SAN, has several URI SANs (an X509-SVID
/// carries exactly one, SPIFFE X509-SVID §2; a second one could name another
/// workload), or its URI SAN is not a `spiffe://` URI. DNS, IP and e-mail SANs are
/// ignored. The certificate's chain and validity are not checked here: the TLS
/// handshake that presented it did that.
pub fn spiffe_id_of(der: &[u8]) -> Option<String> {
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    // Err: a duplicated extension; Ok(None): no SAN extension.
    let san = cert.subject_alternative_name().ok()??;
    let mut uris = san.value.general_names.iter().filter_map(|n| match n {
        GeneralName::URI(u) => Some(*u),
        _ => None,
    });
    let (Some(uri), None) = (uris.next(), uris.next()) else {
        return None;
    };
    uri.starts_with("spiffe://").then(|| uri.to_owned())
}

/// How many certificates [`spiffe_id_of_cached`] remembers.
const SEEN_MAX: usize = 16;

/// [`spiffe_id_of`], remembering the answers for the last [`SEEN_MAX`]
/// certificates by their exact DER bytes. The arbiter is called by a few Envoys,
/// each presenting the same certificate on every ext_proc stream (one stream per
/// request), and parsing it is most of what identifying the caller costs (the
/// runtime's `peer_id` criterion bench). The answer is a function of the bytes
/// alone, so a remembered one is the one a parse would give; whether the
/// certificate is accepted at all is the TLS handshake's decision, made per
/// connection as before. A certificate without a SPIFFE ID is not remembered.
pub fn spiffe_id_of_cached(der: &[u8]) -> Option<String> {
    static SEEN: Mutex<VecDeque<(Box<[u8]>, String)>> = Mutex::new(VecDeque::new());
    {
        let seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, id)) = seen.iter().find(|(d, _)| **d == *der) {
            return Some(id.clone());
        }
    }
    let id = spiffe_id_of(der)?;
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.len() >= SEEN_MAX {
        seen.pop_front();
    }
    seen.push_back((der.into(), id.clone()));
    Some(id)
}

#[cfg(test)]
mod tests {
    use rcgen::{CertificateParams, KeyPair, SanType};

    use super::*;

    fn cert(sans: Vec<SanType>) -> Vec<u8> {
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    fn uri(u: &str) -> SanType {
        SanType::URI(u.try_into().unwrap())
    }

    fn dns(d: &str) -> SanType {
        SanType::DnsName(d.try_into().unwrap())
    }

    #[test]
    fn the_one_spiffe_uri_san_is_the_identity() {
        let id = "spiffe://lockmesh.test/ns/payments/sa/worker";
        assert_eq!(spiffe_id_of(&cert(vec![uri(id)])).as_deref(), Some(id));
        // Other kinds of SAN beside it do not matter.
        assert_eq!(spiffe_id_of(&cert(vec![dns("localhost"), uri(id)])).as_deref(), Some(id));
    }

    #[test]
    fn zero_or_several_uri_sans_or_another_scheme_is_no_identity() {
        assert_eq!(spiffe_id_of(&cert(vec![])), None);
        assert_eq!(spiffe_id_of(&cert(vec![dns("spiffe.example")])), None);
        assert_eq!(spiffe_id_of(&cert(vec![uri("https://lockmesh.test/ns/payments")])), None);
        let two = vec![uri("spiffe://lockmesh.test/ns/a/sa/x"), uri("spiffe://lockmesh.test/ns/b/sa/y")];
        assert_eq!(spiffe_id_of(&cert(two)), None);
        let mixed = vec![uri("spiffe://lockmesh.test/ns/a/sa/x"), uri("https://example.com/")];
        assert_eq!(spiffe_id_of(&cert(mixed)), None);
    }

    #[test]
    fn garbage_is_no_identity() {
        assert_eq!(spiffe_id_of(b""), None);
        assert_eq!(spiffe_id_of(b"-----BEGIN CERTIFICATE-----"), None);
        let der = cert(vec![uri("spiffe://lockmesh.test/x")]);
        assert_eq!(spiffe_id_of(&der[..der.len() / 2]), None);
    }

    #[test]
    fn the_cache_answers_what_a_parse_of_the_same_bytes_does() {
        let ids: Vec<String> = (0..SEEN_MAX + 4).map(|i| format!("spiffe://lockmesh.test/ns/n/sa/w{i}")).collect();
        let certs: Vec<Vec<u8>> = ids.iter().map(|id| cert(vec![uri(id)])).collect();
        // More certificates than it remembers, twice round: every answer is the
        // parse's, whether remembered, evicted or new.
        for _ in 0..2 {
            for (c, id) in certs.iter().zip(&ids) {
                assert_eq!(spiffe_id_of_cached(c).as_deref(), Some(id.as_str()));
            }
        }
        // A certificate with no SPIFFE ID stays refused (and is not remembered).
        let none = cert(vec![dns("localhost")]);
        assert_eq!(spiffe_id_of_cached(&none), None);
        assert_eq!(spiffe_id_of_cached(&none), None);
        // One byte changed is another certificate: parsed, not matched.
        let mut bent = certs[0].clone();
        let last = bent.len() - 1;
        bent[last] ^= 1;
        assert_eq!(spiffe_id_of_cached(&bent), spiffe_id_of(&bent));
    }
}
