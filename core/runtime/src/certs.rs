//! Certificates that reload: an identity (chain and key) and a trust bundle read
//! from three PEM files and re-read while the service runs (issue #16 item 3), or
//! a trust bundle alone, for a client that presents no certificate
//! ([`ReloadingCerts::watch_ca`]: the etcd clients with `tls.ca` only).
//!
//! The SPIFFE helper and Kubernetes secret volumes rotate a workload's files by an
//! atomic directory swap: the files are symlinks through a `..data` link that is
//! renamed onto a new directory. Inotify on the files themselves misses that, so
//! [`ReloadingCerts::watch`] polls: every `every` it reads the three files (the
//! bundle alone for [`ReloadingCerts::watch_ca`]) and, when their content
//! (SHA-256 over all of them) differs from the last set it saw, parses them. A set
//! that does not parse, has no certificate or no CA, or whose key does not match
//! its leaf certificate (a swap caught half-way) is logged and ignored: the
//! previous identity and bundle stay in use and the set is tried again once its
//! content changes.
//!
//! The rustls configurations it hands out ([`ReloadingCerts::server_config`],
//! [`ReloadingCerts::client_config`]) read the current identity and bundle at each
//! handshake: connections already established keep the certificates they
//! negotiated, new handshakes present the new leaf and verify peers with the new
//! bundle. Peers are verified by rustls's WebPki verifiers, built per load, so an
//! expired or untrusted peer certificate is refused as with a static
//! configuration. Key material is never logged: a refused set is logged by its
//! file paths and the parse error only.

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, RwLock, Weak,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use rustls::{
    client::{
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
        ResolvesClientCert, WebPkiServerVerifier,
    },
    crypto::CryptoProvider,
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName, UnixTime},
    server::{
        danger::{ClientCertVerified, ClientCertVerifier},
        ClientHello, ResolvesServerCert, WebPkiClientVerifier,
    },
    sign::CertifiedKey,
    DigitallySignedStruct, DistinguishedName, SignatureScheme,
};
use sha2::{Digest, Sha256};

/// The three files of one identity, as the SPIFFE helper or a Kubernetes secret
/// volume lays them down: the leaf certificate (followed by any intermediates),
/// its private key, and the CA bundle peers are verified against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of the leaf.
    pub key: PathBuf,
    /// PEM CA bundle: every certificate in it is a trust anchor (during a CA roll
    /// it holds the old and the new CA).
    pub ca: PathBuf,
}

/// Whether a server asks for, and insists on, a client certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// A client without a certificate chaining to the bundle is refused in the
    /// handshake.
    Required,
    /// A certificate is asked for and, when presented, must chain to the bundle;
    /// a client without one completes the handshake (the service refuses it later,
    /// with its own error code).
    Optional,
    /// No certificate is asked for.
    None,
}

/// Why a set of certificate files was refused.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// A file could not be read.
    #[error("{what} {}: {source}", path.display())]
    Read {
        /// Which of the three files (`cert`, `key`, `ca`).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file was read but does not hold what it should (no PEM block of the
    /// right kind, a block that does not parse, a CA rustls will not take).
    #[error("{what} {}: {reason}", path.display())]
    Parse {
        /// Which of the three files (`cert`, `key`, `ca`).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong with it (never the key's content).
        reason: String,
    },
    /// The key is not the leaf certificate's (or of a kind the provider cannot
    /// load): typically a directory swap read half-way.
    #[error("key {} does not match certificate {}: {reason}", key.display(), cert.display())]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason.
        reason: String,
    },
}

/// What one [`ReloadingCerts`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// An identity and its bundle ([`ReloadingCerts::watch`]).
    Identity(CertFiles),
    /// A bundle alone ([`ReloadingCerts::watch_ca`]).
    Bundle(PathBuf),
}

// === impl Source ===

impl Source {
    /// The CA bundle file.
    fn ca(&self) -> &Path {
        match self {
            Self::Identity(f) => &f.ca,
            Self::Bundle(ca) => ca,
        }
    }
}

/// One loaded set: what a handshake reads.
struct Loaded {
    /// The chain and signing key presented to peers; `None` for a bundle alone.
    key: Option<Arc<CertifiedKey>>,
    /// Client-certificate verifiers over this set's bundle (required, optional).
    client_required: Arc<dyn ClientCertVerifier>,
    client_optional: Arc<dyn ClientCertVerifier>,
    /// Server-certificate verifier over this set's bundle.
    server: Arc<WebPkiServerVerifier>,
    /// The leaf's `notAfter`; for a bundle alone, the earliest CA's.
    not_after: SystemTime,
}

/// An identity (chain and key) and trust bundle, or a trust bundle alone, that
/// reload when their files change; see the module documentation for the polling
/// and what a bad set does.
///
/// Dropping the last `Arc` stops the background poll (it holds a weak reference).
pub struct ReloadingCerts {
    source: Source,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<Loaded>>,
    /// SHA-256 over the last file contents seen (loaded or refused): a refused set
    /// is logged once, not at every poll.
    seen: RwLock<[u8; 32]>,
    generation: AtomicU64,
    changed: tokio::sync::watch::Sender<u64>,
}

impl fmt::Debug for ReloadingCerts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingCerts")
            .field("source", &self.source)
            .field("generation", &self.generation())
            .field("not_after", &self.not_after())
            .finish_non_exhaustive()
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, CertError> {
    std::fs::read(path).map_err(|source| CertError::Read { what, path: path.to_owned(), source })
}

/// The files' contents (certificate and key: `None` for a bundle alone) and
/// their digest.
struct Contents {
    identity: Option<(Vec<u8>, Vec<u8>)>,
    ca: Vec<u8>,
    digest: [u8; 32],
}

fn read_all(source: &Source) -> Result<Contents, CertError> {
    let (identity, ca) = match source {
        Source::Identity(files) => {
            let cert = read("cert", &files.cert)?;
            let key = read("key", &files.key)?;
            (Some((cert, key)), read("ca", &files.ca)?)
        }
        Source::Bundle(ca) => (None, read("ca", ca)?),
    };
    let mut h = Sha256::new();
    let parts = identity.iter().flat_map(|(c, k)| [c, k]).chain([&ca]);
    for part in parts {
        // Length-prefixed, so moving bytes from one file to the next is a change.
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    Ok(Contents { identity, ca, digest: h.finalize().into() })
}

fn certs_of(what: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let parse = |reason: String| CertError::Parse { what, path: path.to_owned(), reason };
    let certs = CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>().map_err(|e| parse(e.to_string()))?;
    if certs.is_empty() {
        return Err(parse("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

fn not_after_of(what: &'static str, path: &Path, cert: &CertificateDer<'_>) -> Result<SystemTime, CertError> {
    use x509_parser::prelude::FromDer as _;
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(cert.as_ref())
        .map_err(|e| CertError::Parse { what, path: path.to_owned(), reason: e.to_string() })?;
    let secs = cert.validity().not_after.timestamp();
    Ok(match u64::try_from(secs) {
        Ok(s) => UNIX_EPOCH + Duration::from_secs(s),
        Err(_) => UNIX_EPOCH,
    })
}

/// The chain and key of an identity, and the leaf's `notAfter`.
fn load_identity(
    files: &CertFiles,
    cert: &[u8],
    key: &[u8],
    provider: &Arc<CryptoProvider>,
) -> Result<(Arc<CertifiedKey>, SystemTime), CertError> {
    let chain = certs_of("cert", &files.cert, cert)?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| CertError::Parse {
        what: "key",
        path: files.key.clone(),
        reason: e.to_string(),
    })?;
    let not_after = not_after_of("cert", &files.cert, &chain[0])?;
    let key = CertifiedKey::from_der(chain, key, provider).map_err(|e| CertError::KeyMismatch {
        cert: files.cert.clone(),
        key: files.key.clone(),
        reason: e.to_string(),
    })?;
    Ok((Arc::new(key), not_after))
}

fn load(source: &Source, c: &Contents, provider: &Arc<CryptoProvider>) -> Result<Loaded, CertError> {
    let identity = match (source, &c.identity) {
        (Source::Identity(files), Some((cert, key))) => Some(load_identity(files, cert, key, provider)?),
        _ => None,
    };
    let ca_path = source.ca();
    let bad_ca =
        |e: &dyn fmt::Display| CertError::Parse { what: "ca", path: ca_path.to_owned(), reason: e.to_string() };
    let mut roots = rustls::RootCertStore::empty();
    // A bundle alone reports its earliest CA's expiry as its own.
    let mut earliest = None::<SystemTime>;
    for ca in certs_of("ca", ca_path, &c.ca)? {
        let expiry = not_after_of("ca", ca_path, &ca)?;
        earliest = Some(earliest.map_or(expiry, |t| t.min(expiry)));
        roots.add(ca).map_err(|e| bad_ca(&e))?;
    }
    let (key, not_after) = match identity {
        Some((key, not_after)) => (Some(key), not_after),
        None => (None, earliest.unwrap_or(UNIX_EPOCH)),
    };
    let roots = Arc::new(roots);
    let client_required =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build().map_err(|e| bad_ca(&e))?;
    let client_optional = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| bad_ca(&e))?;
    let server =
        WebPkiServerVerifier::builder_with_provider(roots, provider.clone()).build().map_err(|e| bad_ca(&e))?;
    Ok(Loaded { key, client_required, client_optional, server, not_after })
}

impl ReloadingCerts {
    /// Loads the files once (an error if any is missing or does not parse, or the
    /// key does not match the certificate), then re-reads them every `every` in the
    /// background: a tokio task when called inside a runtime, a thread otherwise.
    /// A changed set that loads replaces the current one (the generation goes up);
    /// one that does not is logged and ignored. `every` of zero loads once and
    /// never polls.
    pub fn watch(files: CertFiles, every: Duration) -> Result<Arc<Self>, CertError> {
        Self::start(Source::Identity(files), every)
    }

    /// [`ReloadingCerts::watch`] for a CA bundle alone: a client that verifies
    /// servers against the bundle of the moment and presents no certificate (the
    /// etcd clients with `tls.ca` only, authenticated by user and password). Its
    /// [`client_config`](Self::client_config) offers no client certificate; it has
    /// no identity to serve with, so every handshake on its
    /// [`server_config`](Self::server_config) fails.
    pub fn watch_ca(ca: PathBuf, every: Duration) -> Result<Arc<Self>, CertError> {
        Self::start(Source::Bundle(ca), every)
    }

    fn start(source: Source, every: Duration) -> Result<Arc<Self>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let contents = read_all(&source)?;
        let loaded = load(&source, &contents, &provider)?;
        let (changed, _) = tokio::sync::watch::channel(1);
        let this = Arc::new(Self {
            source,
            provider,
            current: RwLock::new(Arc::new(loaded)),
            seen: RwLock::new(contents.digest),
            generation: AtomicU64::new(1),
            changed,
        });
        if !every.is_zero() {
            spawn_poll(Arc::downgrade(&this), every);
        }
        Ok(this)
    }

    /// Reads the files now and loads them if their content changed since the last
    /// read. `Ok(true)`: a new set is in use; `Ok(false)`: nothing changed; `Err`:
    /// the changed set was refused (the previous one stays). The background poll
    /// calls this; a test may call it to skip the wait.
    pub fn reload_now(&self) -> Result<bool, CertError> {
        let contents = read_all(&self.source)?;
        {
            let mut seen = self.seen.write().unwrap_or_else(|e| e.into_inner());
            if *seen == contents.digest {
                return Ok(false);
            }
            *seen = contents.digest;
        }
        let loaded = load(&self.source, &contents, &self.provider)?;
        let not_after = loaded.not_after;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(loaded);
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.changed.send_replace(generation);
        let not_after_unix_s = not_after.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        match &self.source {
            Source::Identity(f) => {
                tracing::info!(cert = %f.cert.display(), generation, not_after_unix_s, "certificates reloaded")
            }
            Source::Bundle(ca) => {
                tracing::info!(ca = %ca.display(), generation, not_after_unix_s, "certificates reloaded")
            }
        }
        Ok(true)
    }

    /// Number of successful loads so far (1 after [`watch`](Self::watch)); tests
    /// and metrics read it.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// A receiver that sees the generation each time a new set is loaded, for a
    /// client that must act on a rotation (reconnect, re-register).
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The identity's files watched; `None` for a bundle alone
    /// ([`ReloadingCerts::watch_ca`]).
    pub fn files(&self) -> Option<&CertFiles> {
        match &self.source {
            Source::Identity(f) => Some(f),
            Source::Bundle(_) => None,
        }
    }

    /// The CA bundle file watched.
    pub fn ca_file(&self) -> &Path {
        self.source.ca()
    }

    /// Expiry (`notAfter`) of the current leaf, for a metric or `doctor`; for a
    /// bundle alone, of its CA that expires first.
    pub fn not_after(&self) -> SystemTime {
        self.current().not_after
    }

    /// The current leaf certificate (DER), e.g. to read its SPIFFE ID; `None` for
    /// a bundle alone.
    pub fn leaf(&self) -> Option<CertificateDer<'static>> {
        self.current().key.as_ref().map(|k| k.cert[0].clone())
    }

    fn current(&self) -> Arc<Loaded> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A rustls server configuration whose certificate resolver and client
    /// certificate verifier read the current identity and bundle at each
    /// handshake. `client_auth` says whether a client certificate is asked for and
    /// required; `alpn` is the protocols offered, most preferred first.
    ///
    /// Session resumption is off, so every handshake verifies the client against
    /// the current bundle. The verifier sends no CA hints (an empty
    /// `certificate_authorities` list, which RFC 8446 §4.3.2 lets the client
    /// answer with any certificate it has).
    pub fn server_config(self: &Arc<Self>, client_auth: ClientAuth, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let builder = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            // The ring provider supports the default versions: this cannot fail.
            .unwrap_or_else(|_| unreachable!("ring supports TLS 1.2 and 1.3"));
        let builder = match client_auth {
            ClientAuth::None => builder.with_no_client_auth(),
            ClientAuth::Required | ClientAuth::Optional => {
                builder.with_client_cert_verifier(Arc::new(ClientVerifier {
                    certs: self.clone(),
                    required: client_auth == ClientAuth::Required,
                }))
            }
        };
        let mut c = builder.with_cert_resolver(Arc::new(Resolver(self.clone())));
        // No resumption: a resumed session skips the certificates, so a client
        // whose CA was removed (or whose leaf expired) would get back in on an old
        // ticket. Every handshake is a full one, verified against the current bundle.
        c.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        c.send_tls13_tickets = 0;
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(c)
    }

    /// A rustls client configuration presenting the current identity (none for a
    /// bundle alone) and verifying servers with the current bundle, at each
    /// handshake. `alpn` is the protocols offered (`h2` for gRPC).
    pub fn client_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let builder = rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap_or_else(|_| unreachable!("ring supports TLS 1.2 and 1.3"))
            .dangerous()
            // Not a weakening: ServerVerifier delegates to the WebPki verifier of
            // the current bundle (chain, validity, name).
            .with_custom_certificate_verifier(Arc::new(ServerVerifier(self.clone())));
        let mut c = match self.source {
            Source::Identity(_) => builder.with_client_cert_resolver(Arc::new(Resolver(self.clone()))),
            Source::Bundle(_) => builder.with_no_client_auth(),
        };
        // No resumption, as on the server side: each connection verifies the
        // server's current certificate against the current bundle.
        c.resumption = rustls::client::Resumption::disabled();
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(c)
    }
}

fn spawn_poll(this: Weak<ReloadingCerts>, every: Duration) {
    // One poll: false when the certificates are gone and the loop should end.
    let poll = move || -> bool {
        let Some(certs) = this.upgrade() else { return false };
        if let Err(e) = certs.reload_now() {
            tracing::warn!(error = %e, generation = certs.generation(), "certificate files refused; keeping the current set");
        }
        true
    };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    // Three small files: read inline rather than on the blocking pool.
                    if !poll() {
                        break;
                    }
                }
            });
        }
        Err(_) => {
            let spawned = std::thread::Builder::new().name("cert-reload".into()).spawn(move || loop {
                std::thread::sleep(every);
                if !poll() {
                    break;
                }
            });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "certificate reload thread not started: certificates will not reload");
            }
        }
    }
}

/// Presents the current chain, as a server and as a client.
struct Resolver(Arc<ReloadingCerts>);

impl fmt::Debug for Resolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Resolver").field(&self.0.source).finish()
    }
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.current().key.clone()
    }
}

impl ResolvesClientCert for Resolver {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.0.current().key.clone()
    }

    fn has_certs(&self) -> bool {
        self.0.current().key.is_some()
    }
}

/// Verifies client certificates with the current bundle's WebPki verifier.
struct ClientVerifier {
    certs: Arc<ReloadingCerts>,
    required: bool,
}

impl fmt::Debug for ClientVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientVerifier").field("ca", &self.certs.source.ca()).field("required", &self.required).finish()
    }
}

impl ClientVerifier {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let cur = self.certs.current();
        if self.required {
            cur.client_required.clone()
        } else {
            cur.client_optional.clone()
        }
    }
}

impl ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.required
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints would borrow from a set that may be replaced mid-handshake.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner().verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner().supported_verify_schemes()
    }
}

/// Verifies server certificates with the current bundle's WebPki verifier.
struct ServerVerifier(Arc<ReloadingCerts>);

impl fmt::Debug for ServerVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ServerVerifier").field(&self.0.source.ca()).finish()
    }
}

impl ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.current().server.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.current().server.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.current().server.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().server.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests;
