//! The TLS accept loops of lockmesh's listeners, over a rustls server
//! configuration (usually [`ReloadingCerts::server_config`](crate::ReloadingCerts::server_config),
//! so each new handshake presents the current certificate).
//!
//! - [`serve_tls`]: HTTP/1.1 (the audit tailer's query port, the injector
//!   webhook). Each connection's service is made by `make_service` from the
//!   [`TlsPeer`] (address, client chain, SPIFFE ID), so a router can carry the
//!   caller's identity as an extension. Handshakes run concurrently, each bounded by
//!   [`ServeTls::handshake_timeout`]; when `shutdown` completes the listener closes
//!   and connections in flight get [`ServeTls::drain_timeout`] to finish.
//! - [`tls_incoming`]: the accepted, handshaken streams for tonic's
//!   `serve_with_incoming_shutdown` (the arbiter's gRPC port). tonic implements
//!   `Connected` for `tokio_rustls::server::TlsStream<TcpStream>`, so a handler
//!   still reads the client chain with `request.peer_certs()` and the address with
//!   `request.remote_addr()`.
//!
//! A failed or timed-out handshake is logged at debug level with the peer address
//! and dropped; it never stops the loop.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use hyper_util::{rt::TokioIo, server::graceful::GracefulShutdown, service::TowerToHyperService};
use rustls::pki_types::CertificateDer;
use tokio::net::{TcpListener, TcpStream};

/// The client of one TLS connection, as the handshake verified it.
#[derive(Debug, Clone)]
pub struct TlsPeer {
    /// Its address.
    pub addr: SocketAddr,
    /// The chain it presented, leaf first (empty without a client certificate).
    pub certs: Vec<CertificateDer<'static>>,
    /// The leaf's SPIFFE ID ([`spiffe_id_of`](crate::spiffe_id_of)), if any.
    pub spiffe_id: Option<String>,
}

/// How [`serve_tls`] bounds handshakes and the drain, and names itself in logs.
#[derive(Debug, Clone, Copy)]
pub struct ServeTls {
    /// The listener's name in log lines (`"query port"`, `"webhook"`).
    pub name: &'static str,
    /// Longest a TLS handshake may take. [`ServeTls::new`]: 10 s.
    pub handshake_timeout: Duration,
    /// Longest in-flight requests get after shutdown. [`ServeTls::new`]: 10 s.
    pub drain_timeout: Duration,
}

impl ServeTls {
    /// A listener called `name`, with 10 s handshake and drain bounds.
    pub fn new(name: &'static str) -> Self {
        Self { name, handshake_timeout: Duration::from_secs(10), drain_timeout: Duration::from_secs(10) }
    }
}

/// Accepts one TCP connection, retrying after a short pause on an accept error (a
/// full file table must not spin the loop).
async fn accept(listener: &TcpListener, name: &'static str) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(a) => return a,
            Err(e) => {
                tracing::warn!(listener = name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The TLS handshake of `tcp`, bounded by `timeout`; `None` (logged) when it fails.
async fn handshake(
    acceptor: &tokio_rustls::TlsAcceptor,
    tcp: TcpStream,
    peer: SocketAddr,
    timeout: Duration,
    name: &'static str,
) -> Option<tokio_rustls::server::TlsStream<TcpStream>> {
    match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => Some(tls),
        Ok(Err(e)) => {
            tracing::debug!(listener = name, %peer, error = %e, "tls handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(listener = name, %peer, "tls handshake timed out");
            None
        }
    }
}

/// Serves HTTP/1.1 over TLS on `listener` until `shutdown` completes, then drains
/// (see the module documentation). `make_service` is called once per connection,
/// after the handshake, with the verified client.
pub async fn serve_tls<M, S, B>(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    opts: ServeTls,
    make_service: M,
    shutdown: impl Future<Output = ()>,
) where
    M: Fn(TlsPeer) -> S + Send + Sync + 'static,
    S: tower_service::Service<http::Request<hyper::body::Incoming>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let make_service = Arc::new(make_service);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, addr) = tokio::select! {
            () = &mut shutdown => break,
            a = accept(&listener, opts.name) => a,
        };
        let (acceptor, make_service, watcher) = (acceptor.clone(), make_service.clone(), graceful.watcher());
        tokio::spawn(async move {
            let Some(tls) = handshake(&acceptor, tcp, addr, opts.handshake_timeout, opts.name).await else {
                return;
            };
            let certs: Vec<CertificateDer<'static>> =
                tls.get_ref().1.peer_certificates().map(|c| c.to_vec()).unwrap_or_default();
            let spiffe_id = certs.first().and_then(|c| crate::spiffe_id_of(c.as_ref()));
            let service = TowerToHyperService::new(make_service(TlsPeer { addr, certs, spiffe_id }));
            let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(listener = opts.name, peer = %addr, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(opts.drain_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!(listener = opts.name, "in-flight requests did not finish within the drain timeout");
    }
}

/// The TLS streams accepted on `listener`, handshaken concurrently (a slow client
/// holds up no other), with `TCP_NODELAY` set, for tonic's
/// `serve_with_incoming_shutdown`. Failed handshakes are logged and skipped: the
/// stream yields no errors. Accepting stops when the stream is dropped.
pub fn tls_incoming(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    handshake_timeout: Duration,
    name: &'static str,
) -> impl tokio_stream::Stream<Item = Result<tokio_rustls::server::TlsStream<TcpStream>, std::io::Error>> + Send + 'static
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let (tcp, addr) = tokio::select! {
                () = tx.closed() => break,
                a = accept(&listener, name) => a,
            };
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(listener = name, peer = %addr, error = %e, "TCP_NODELAY not set");
            }
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                if let Some(tls) = handshake(&acceptor, tcp, addr, handshake_timeout, name).await {
                    let _ = tx.send(Ok(tls)).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
