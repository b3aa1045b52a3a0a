//! A gRPC client channel (tonic) whose TLS handshakes present the current
//! certificate of a [`ReloadingCerts`] and verify the server with its current
//! bundle: the etcd client's transport (`lockmesh_etcd`), which
//! etcd-client's own TLS options would fix at connect time.
//!
//! The channel holds one HTTP/2 connection. Its connector ignores the URI tonic
//! asks for and tries the endpoints in turn, starting one further along at each
//! connect, until a TCP connection and a TLS handshake succeed; each attempt is
//! bounded by [`ChannelOptions::connect_timeout`]. When the connection breaks (a
//! member restarts or is partitioned), tonic connects again through the same
//! connector, so the new connection goes to the next member that answers and
//! presents the certificate current at that moment. A rotation does not close
//! the connection in use: etcd checks a client certificate at the handshake
//! only, so calls, watches and lease keep-alives on it carry on, and the next
//! connection uses the new certificate. With a bundle alone
//! ([`ReloadingCerts::watch_ca`]: a CA, no client certificate) the same holds for
//! the CA: each new connection verifies the member against the bundle current at
//! its handshake, which is how the etcd clients follow an etcd CA roll.
//!
//! [`failover_channel`] is the same channel with a fixed TLS configuration
//! ([`ca_client_config`]: a CA, no client certificate) or none (plaintext). Every
//! etcd client of lockmesh connects through one of the two, instead of through
//! etcd-client's own connect (a tower balancer over the endpoints): one transport,
//! whatever the security, so how a member restart, a partition or a restore is
//! met is the same in every deployment and in the tests of each.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use hyper_util::rt::TokioIo;
use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};

use crate::ReloadingCerts;

/// Timeouts and keep-alive of a [`reloading_channel`].
#[derive(Debug, Clone, Copy)]
pub struct ChannelOptions {
    /// Bound of one connect attempt (TCP and TLS) to one endpoint.
    pub connect_timeout: Duration,
    /// Bound of each request (tonic's per-request timeout); `None`: unbounded.
    pub request_timeout: Option<Duration>,
    /// HTTP/2 keep-alive: ping interval and how long an answer may take. A
    /// connection whose peer stops answering is closed and connected again.
    pub keep_alive: Option<(Duration, Duration)>,
}

/// One endpoint: where to connect and the name its certificate must carry.
#[derive(Debug, Clone)]
struct Target {
    addr: String,
    name: ServerName<'static>,
}

/// How a [`failover_channel`] secures its connections.
#[derive(Clone)]
pub enum ChannelTls {
    /// Plaintext TCP: `http://host:port` (or `host:port`) endpoints.
    Plain,
    /// TLS with this client configuration: `https://host:port` (or `host:port`)
    /// endpoints. It should offer ALPN `h2`.
    Tls(Arc<rustls::ClientConfig>),
}

impl std::fmt::Debug for ChannelTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Plain => "Plain",
            Self::Tls(_) => "Tls",
        })
    }
}

/// A TLS client configuration that verifies servers against the CA bundle
/// `ca_pem` (every certificate in it a trust anchor) and presents no certificate;
/// ALPN `h2`, no session resumption. The error says what does not parse.
pub fn ca_client_config(ca_pem: &[u8]) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(ca.map_err(|e| format!("ca: {e}"))?).map_err(|e| format!("ca: {e}"))?;
    }
    if roots.is_empty() {
        return Err("ca: no certificate in the bundle".into());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut c = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.resumption = rustls::client::Resumption::disabled();
    c.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(c))
}

/// Parses an endpoint into a target: `https://host:port` (or `host:port`) for a
/// TLS channel, `http://host:port` (or `host:port`) for a plaintext one.
fn target(endpoint: &str, tls: bool) -> Result<Target, String> {
    let rest = if tls { endpoint.strip_prefix("https://") } else { endpoint.strip_prefix("http://") };
    let rest = rest.unwrap_or(endpoint);
    if tls && rest.starts_with("http://") {
        return Err(format!("{endpoint:?}: a TLS channel needs an https:// endpoint"));
    }
    if !tls && rest.starts_with("https://") {
        return Err(format!("{endpoint:?}: an https:// endpoint needs TLS (a CA)"));
    }
    let authority = rest.split('/').next().unwrap_or(rest);
    let uri: http::Uri =
        format!("https://{authority}").parse().map_err(|e| format!("{endpoint:?} is not host:port: {e}"))?;
    let host = uri.host().ok_or_else(|| format!("{endpoint:?}: no host"))?;
    let port = uri.port_u16().unwrap_or(2379);
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let name = ServerName::try_from(bare.to_owned()).map_err(|e| format!("{endpoint:?}: host {bare:?}: {e}"))?;
    let addr = if bare.contains(':') { format!("[{bare}]:{port}") } else { format!("{bare}:{port}") };
    Ok(Target { addr, name })
}

/// A connection, plaintext or TLS.
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// The connector: the endpoints tried in turn, TLS (when set) from `tls`.
#[derive(Clone)]
struct Connector {
    targets: Arc<Vec<Target>>,
    next: Arc<AtomicUsize>,
    tls: Option<tokio_rustls::TlsConnector>,
    timeout: Duration,
}

impl Connector {
    async fn connect(self) -> Result<TokioIo<Box<dyn Io>>, std::io::Error> {
        let n = self.targets.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut last = std::io::Error::other("no endpoint");
        for i in 0..n {
            let t = &self.targets[(start + i) % n];
            let attempt = async {
                let tcp = TcpStream::connect(&t.addr).await?;
                tcp.set_nodelay(true)?;
                Ok::<Box<dyn Io>, std::io::Error>(match &self.tls {
                    Some(tls) => Box::new(tls.connect(t.name.clone(), tcp).await?),
                    None => Box::new(tcp),
                })
            };
            match tokio::time::timeout(self.timeout, attempt).await {
                Ok(Ok(tls)) => return Ok(TokioIo::new(tls)),
                Ok(Err(e)) => {
                    tracing::debug!(endpoint = %t.addr, error = %e, "grpc connect failed; trying the next endpoint");
                    last = e;
                }
                Err(_) => {
                    tracing::debug!(endpoint = %t.addr, "grpc connect timed out; trying the next endpoint");
                    last =
                        std::io::Error::new(std::io::ErrorKind::TimedOut, format!("connect to {} timed out", t.addr));
                }
            }
        }
        Err(last)
    }
}

impl tower_service::Service<http::Uri> for Connector {
    type Response = TokioIo<Box<dyn Io>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        Box::pin(self.clone().connect())
    }
}

/// A lazily connecting tonic channel to `endpoints` (`https://host:port`, one at
/// least) over TLS from `certs` (ALPN `h2`; an identity and bundle, or a bundle
/// alone), as the module documentation describes. The error names an endpoint
/// that does not parse.
pub fn reloading_channel(
    endpoints: &[String],
    certs: &Arc<ReloadingCerts>,
    opts: ChannelOptions,
) -> Result<tonic::transport::Channel, String> {
    failover_channel(endpoints, ChannelTls::Tls(certs.client_config(&[b"h2"])), opts)
}

/// A lazily connecting tonic channel to `endpoints` over one connection at a time,
/// plaintext or TLS with a fixed configuration: the channel of
/// [`reloading_channel`] (the module documentation) without the reloading.
pub fn failover_channel(
    endpoints: &[String],
    tls: ChannelTls,
    opts: ChannelOptions,
) -> Result<tonic::transport::Channel, String> {
    let is_tls = matches!(tls, ChannelTls::Tls(_));
    let targets = endpoints.iter().map(|e| target(e, is_tls)).collect::<Result<Vec<_>, _>>()?;
    let Some(first) = targets.first() else {
        return Err("no endpoint".into());
    };
    // The scheme is http: TLS is the connector's; tonic adds none of its own.
    let mut endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", first.addr))
        .map_err(|e| format!("{}: {e}", first.addr))?;
    if let Some(t) = opts.request_timeout {
        endpoint = endpoint.timeout(t);
    }
    if let Some((interval, timeout)) = opts.keep_alive {
        endpoint = endpoint.http2_keep_alive_interval(interval).keep_alive_timeout(timeout).keep_alive_while_idle(true);
    }
    let connector = Connector {
        targets: Arc::new(targets),
        next: Arc::new(AtomicUsize::new(0)),
        tls: match tls {
            ChannelTls::Plain => None,
            ChannelTls::Tls(c) => Some(tokio_rustls::TlsConnector::from(c)),
        },
        timeout: opts.connect_timeout,
    };
    Ok(endpoint.connect_with_connector_lazy(connector))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_into_an_address_and_a_name() {
        let t = target("https://127.0.0.1:2379", true).unwrap();
        assert_eq!(t.addr, "127.0.0.1:2379");
        assert!(matches!(t.name, ServerName::IpAddress(_)));
        let t = target("etcd-0.etcd:2380", true).unwrap();
        assert_eq!(t.addr, "etcd-0.etcd:2380");
        assert!(matches!(t.name, ServerName::DnsName(_)));
        assert_eq!(target("https://[::1]:2379", true).unwrap().addr, "[::1]:2379");
        assert_eq!(target("https://etcd", true).unwrap().addr, "etcd:2379");
        assert!(target("http://127.0.0.1:2379", true).is_err());
        assert_eq!(target("http://127.0.0.1:2379", false).unwrap().addr, "127.0.0.1:2379");
        assert_eq!(target("127.0.0.1:2379", false).unwrap().addr, "127.0.0.1:2379");
        assert!(target("https://127.0.0.1:2379", false).is_err());
    }

    #[test]
    fn a_ca_config_needs_a_certificate() {
        assert!(ca_client_config(b"").is_err());
        assert!(ca_client_config(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").is_err());
    }
}
