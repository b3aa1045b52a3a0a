//! The webhook's HTTPS server: rustls (via tokio-rustls) in front of an axum
//! router, HTTP/1.1 only.
//!
//! Routes: `POST /mutate` and `POST /mutate/store` (AdmissionReview v1; the
//! second for store namespaces, every pod a store: `webhook::review_store`),
//! `GET /healthz` and `GET /readyz`
//! (200 while serving). The certificate and key are re-read when their files
//! change (checked every [`RELOAD_EVERY`]), so a rotated Secret needs no restart;
//! a rotation that fails to load is logged and the old certificate kept.

use std::{
    future::Future,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
};

use axum::{
    body::Bytes,
    extract::{DefaultBodyLimit, State},
    http::{header, StatusCode},
    response::IntoResponse,
    routing::{get, post},
    Router,
};
use hyper_util::{rt::TokioIo, server::graceful::GracefulShutdown, service::TowerToHyperService};
use rustls::{
    pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use tokio::net::TcpListener;

use crate::{
    config::Config,
    webhook::{review, review_store, ReviewError, Verdict},
};

/// How often the certificate files are checked for rotation.
pub(crate) const RELOAD_EVERY: Duration = Duration::from_secs(30);
/// Largest request body accepted (the API server caps objects well below this).
pub const MAX_BODY: usize = 8 * 1024 * 1024;
/// How long a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long in-flight requests get after shutdown is asked for.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the serving certificate cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file is unreadable or holds no usable item.
    #[error("{path}: {message}")]
    Pem {
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// rustls refused the key or the configuration.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A certificate resolver that serves the current key pair from two PEM files.
#[derive(Debug)]
pub struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<(Option<SystemTime>, Arc<CertifiedKey>)>,
}

// === impl CertFiles ===

impl CertFiles {
    /// Loads the pair once; fails if either file is unusable.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let pair = read_pair(cert, key)?;
        Ok(Self { cert: cert.to_owned(), key: key.to_owned(), current: RwLock::new((modified(cert, key), pair)) })
    }

    /// Re-reads the pair if either file changed. `Ok(true)` when a new pair is served.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let stamp = modified(&self.cert, &self.key);
        let seen = self.current.read().map(|c| c.0).unwrap_or(None);
        if stamp == seen {
            return Ok(false);
        }
        let pair = read_pair(&self.cert, &self.key)?;
        if let Ok(mut c) = self.current.write() {
            *c = (stamp, pair);
        }
        Ok(true)
    }

    /// The DER of the leaf certificate now served.
    pub fn leaf(&self) -> Option<Vec<u8>> {
        self.current.read().ok().and_then(|c| c.1.cert.first().map(|d| d.as_ref().to_vec()))
    }

    /// A rustls server configuration serving these files, HTTP/1.1 by ALPN.
    pub(crate) fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut c = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(c))
    }
}

impl ResolvesServerCert for CertFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| c.1.clone())
    }
}

fn modified(cert: &Path, key: &Path) -> Option<SystemTime> {
    let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    m(cert).max(m(key))
}

fn read_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let pem = |p: &Path, message: String| TlsError::Pem { path: p.display().to_string(), message };
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(|e| pem(cert, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(pem(cert, "no CERTIFICATE block".into()));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| pem(key, e.to_string()))?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key_der)?;
    let pair = CertifiedKey::new(certs, signer);
    pair.keys_match().map_err(|e| pem(key, format!("does not match the certificate: {e}")))?;
    Ok(Arc::new(pair))
}

/// Serves the webhook on `listener` until `shutdown` completes, then drains
/// in-flight requests for up to 10 s.
pub async fn run(
    listener: TcpListener,
    certs: Arc<CertFiles>,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), TlsError> {
    let acceptor = tokio_rustls::TlsAcceptor::from(certs.server_config()?);
    let app = Router::new()
        .route("/mutate", post(mutate))
        .route("/mutate/store", post(mutate_store))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(config);
    let reloader = {
        let certs = certs.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_EVERY);
            loop {
                tick.tick().await;
                match certs.reload() {
                    Ok(true) => tracing::info!("serving certificate reloaded"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "serving certificate rotation failed to load; keeping the old one")
                    }
                }
            }
        })
    };
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "tls handshake failed"),
                Err(_) => return tracing::debug!(%peer, "tls handshake timed out"),
            };
            let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    reloader.abort();
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown()).await.is_err() {
        tracing::warn!("in-flight admission requests did not finish within the drain timeout");
    }
    Ok(())
}

async fn mutate(State(config): State<Arc<Config>>, body: Bytes) -> impl IntoResponse {
    respond(review(&body, &config))
}

async fn mutate_store(State(config): State<Arc<Config>>, body: Bytes) -> impl IntoResponse {
    respond(review_store(&body, &config))
}

fn respond(reviewed: Result<(crate::webhook::AdmissionReview, Verdict), ReviewError>) -> axum::response::Response {
    match reviewed {
        Ok((answer, verdict)) => {
            let uid = answer.response.as_ref().map(|r| r.uid.as_str()).unwrap_or("");
            match verdict {
                Verdict::Denied => tracing::info!(uid, verdict = "denied", "admission review"),
                Verdict::Injected => tracing::info!(uid, verdict = "injected", "admission review"),
                Verdict::Untouched => tracing::debug!(uid, verdict = "untouched", "admission review"),
            }
            match serde_json::to_vec(&answer) {
                Ok(json) => (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], json).into_response(),
                Err(e) => {
                    (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode the review: {e}\n")).into_response()
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "bad admission request");
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
    }
}
