//! What every lockmesh service binary shares (the arbiter, the audit tailer,
//! fence-proxy, the injector webhook, `lockctl`) and the Wasm filter cannot have:
//! native I/O only, so it is a crate of its own beside `lockmesh-core`.
//!
//! # Layout
//! - [`certs`]: [`ReloadingCerts`], an identity and CA bundle (or a CA bundle
//!   alone) that reload when their files change, and the rustls configurations
//!   that read them per handshake.
//! - [`channel`]: [`reloading_channel`], a tonic client channel over TLS from a
//!   [`ReloadingCerts`] that fails over between endpoints (etcd's transport).
//! - [`chain`]: [`error_chain`], an error and its causes on one line.
//! - [`serve`]: [`serve_tls`], the HTTP/1.1-over-TLS accept loop, and
//!   [`tls_incoming`], handshaken TLS streams for tonic.
//! - [`signal`]: [`shutdown`], the one future a service's `run(listener, config,
//!   shutdown)` is given: the first SIGINT or SIGTERM.
//! - [`peer`]: [`spiffe_id_of`], the SPIFFE ID of an mTLS peer's certificate.
//! - [`report`]: [`report_config_errors`], what a binary prints and exits with when
//!   its configuration is refused (exit 64, EX_USAGE).
//! - [`yaml`]: [`parse_yaml`], a configuration file's YAML into its serde type, the
//!   error naming the field path and the line.
#![forbid(unsafe_code)]

pub mod certs;
pub mod chain;
pub mod channel;
pub mod peer;
pub mod report;
pub mod serve;
pub mod signal;
pub mod yaml;

pub use self::{
    certs::{CertError, CertFiles, ClientAuth, ReloadingCerts},
    chain::error_chain,
    channel::{ca_client_config, failover_channel, reloading_channel, ChannelOptions, ChannelTls},
    peer::{spiffe_id_of, spiffe_id_of_cached},
    report::{report_config_errors, EX_USAGE},
    serve::{serve_tls, tls_incoming, ServeTls, TlsPeer},
    signal::shutdown,
    yaml::{parse_yaml, YamlError},
};
