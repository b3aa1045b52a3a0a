//! How lockmesh reaches etcd: endpoints, client TLS and an etcd user, as the
//! arbiter's `etcd:` section and the audit tailer's `etcd_*` fields spell them, with
//! one validation (every error with its field path) and the etcd-client options
//! they make.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A relative path in a config file is relative to the file's directory.
pub fn resolve(base: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_owned()
    } else {
        base.join(p)
    }
}

/// etcd settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEtcd {
    /// Client URLs, `http://host:port`.
    pub endpoints: Vec<String>,
    /// Key prefix of this deployment, e.g. `/lockmesh`. Several deployments can
    /// share one etcd under different roots.
    pub root: String,
    /// Timeout of one etcd call, ms. Default 2000.
    pub op_timeout_ms: Option<u64>,
    /// Client TLS to etcd (`https://` endpoints need it; docs/OPERATIONS.md).
    pub tls: Option<RawEtcdTls>,
    /// etcd user (auth enabled), with `password_file`.
    pub user: Option<String>,
    /// File holding the etcd user's password (trailing newline ignored).
    pub password_file: Option<String>,
}

/// etcd client TLS settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEtcdTls {
    /// CA bundle (PEM) that signed etcd's server certificate.
    pub ca: String,
    /// Client certificate (PEM), if etcd requires one.
    pub cert: Option<String>,
    /// Client key (PEM), with `cert`.
    pub key: Option<String>,
}

/// How the arbiter authenticates to etcd (TLS and a user); the password never
/// appears in `Debug` output.
#[derive(Clone, Default)]
pub struct EtcdClientAuth {
    /// CA PEM, when TLS is on.
    pub ca: Option<Vec<u8>>,
    /// Client certificate and key PEM.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// User and password.
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClientAuth")
            .field("tls", &self.ca.is_some())
            .field("client_cert", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl EtcdClientAuth {
    /// Applies TLS and the user to etcd connect options.
    pub fn apply(&self, mut opts: etcd_client::ConnectOptions) -> etcd_client::ConnectOptions {
        if let Some((u, p)) = &self.user {
            opts = opts.with_user(u.clone(), p.clone());
        }
        if let Some(ca) = &self.ca {
            let mut tls = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca));
            if let Some((c, k)) = &self.identity {
                tls = tls.identity(etcd_client::Identity::from_pem(c, k));
            }
            opts = opts.with_tls(tls);
        }
        opts
    }
}

/// The etcd client fields the arbiter (`etcd.tls`, ...) and the audit tailer
/// (`etcd_tls`, ...) share.
pub struct EtcdAuthFields<'a> {
    /// Endpoints.
    pub endpoints: &'a [String],
    /// TLS files.
    pub tls: Option<&'a RawEtcdTls>,
    /// etcd user.
    pub user: Option<&'a str>,
    /// File holding its password.
    pub password_file: Option<&'a str>,
}

/// Validates etcd TLS and user fields against the endpoints; `prefix` spells the
/// field paths (`etcd.` for the arbiter, `etcd_` for the tailer).
pub fn validate_etcd_auth(
    raw: &EtcdAuthFields<'_>,
    prefix: &str,
    base: &Path,
    name: &str,
    errs: &mut Vec<String>,
) -> EtcdClientAuth {
    let mut auth = EtcdClientAuth::default();
    let read = |field: &str, p: &str, errs: &mut Vec<String>| {
        std::fs::read(resolve(base, p))
            .map_err(|e| errs.push(format!("{name}: {prefix}{field}: cannot read {p:?}: {e}")))
            .ok()
    };
    let https = raw.endpoints.iter().filter(|e| e.starts_with("https://")).count();
    match raw.tls {
        Some(t) => {
            if https != raw.endpoints.len() {
                errs.push(format!("{name}: {prefix}endpoints: with {prefix}tls every endpoint must be https://"));
            }
            auth.ca = read("tls.ca", &t.ca, errs);
            match (&t.cert, &t.key) {
                (Some(c), Some(k)) => {
                    if let (Some(c), Some(k)) = (read("tls.cert", c, errs), read("tls.key", k, errs)) {
                        auth.identity = Some((c, k));
                    }
                }
                (None, None) => {}
                (Some(_), None) => errs.push(format!("{name}: {prefix}tls.key: required with {prefix}tls.cert")),
                (None, Some(_)) => errs.push(format!("{name}: {prefix}tls.cert: required with {prefix}tls.key")),
            }
        }
        None if https > 0 => {
            errs.push(format!("{name}: {prefix}tls: required for https:// endpoints ({prefix}tls.ca names the CA)"))
        }
        None => {}
    }
    match (raw.user, raw.password_file) {
        (Some(u), Some(p)) => {
            if u.is_empty() {
                errs.push(format!("{name}: {prefix}user: must not be empty"));
            }
            if let Some(pw) = read("password_file", p, errs) {
                match String::from_utf8(pw) {
                    Ok(pw) if !pw.trim_end().is_empty() => auth.user = Some((u.to_owned(), pw.trim_end().to_owned())),
                    _ => {
                        errs.push(format!("{name}: {prefix}password_file: {p:?} must hold a non-empty UTF-8 password"))
                    }
                }
            }
        }
        (Some(_), None) => errs.push(format!("{name}: {prefix}password_file: required with {prefix}user")),
        (None, Some(_)) => errs.push(format!("{name}: {prefix}user: required with {prefix}password_file")),
        (None, None) => {}
    }
    auth
}
