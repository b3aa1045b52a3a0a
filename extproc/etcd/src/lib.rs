//! How lockmesh reaches etcd: endpoints, client TLS and an etcd user, as the
//! arbiter's `etcd:` section and the audit tailer's `etcd_*` fields spell them, with
//! one validation (every error with its field path) and the etcd-client options
//! they make.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

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
    /// The most grants and releases one etcd transaction carries
    /// (`engine::group`); 1 sends each alone. Default 64.
    pub max_group: Option<usize>,
    /// Groups in flight at once per cluster (`engine::group`). Default 2.
    pub groups_in_flight: Option<usize>,
    /// etcd's `--max-txn-ops`, which a group stays within. Default 128 (etcd's).
    pub max_txn_ops: Option<usize>,
    /// etcd's `--max-request-bytes`, which a group stays within. Default
    /// 1572864 (etcd's).
    pub max_request_bytes: Option<usize>,
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
    /// The CA, certificate and key by path, when a client certificate is set: the
    /// connection then re-reads them ([`EtcdClientAuth::reloading_certs`],
    /// [`EtcdClientAuth::connect`]) rather than fixing `ca` and `identity` at
    /// connect, as etcd-client's own TLS options do.
    pub files: Option<lockmesh_runtime::CertFiles>,
    /// The CA bundle by path, when TLS is on: without a client certificate the
    /// connection re-reads it alone ([`EtcdClientAuth::reloading_certs`]), so an
    /// etcd CA roll needs no client restart (docs/OPERATIONS.md).
    pub ca_file: Option<PathBuf>,
}

/// How often the etcd client's TLS files (the CA bundle, and the client
/// certificate and key when set) are re-read ([`EtcdClientAuth::reloading_certs`]).
pub const ETCD_CERT_RELOAD: Duration = Duration::from_secs(5);

impl std::fmt::Debug for EtcdClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClientAuth")
            .field("tls", &self.ca.is_some())
            .field("client_cert", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .field("files", &self.files)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

impl EtcdClientAuth {
    /// The user, and the token refresh, on etcd-client's options.
    fn apply_user(&self, mut opts: etcd_client::ConnectOptions) -> etcd_client::ConnectOptions {
        if let Some((u, p)) = &self.user {
            // etcd's simple auth tokens live in the server's memory: a restarted or
            // restored member answers every old token `invalid auth token`. With the
            // refresh on, the client logs in again and retries the call once, so an
            // etcd restart under auth costs one round trip, not a stuck arbiter.
            opts = opts.with_user(u.clone(), p.clone()).with_auto_token_refresh(true);
        }
        opts
    }

    /// The TLS files, loaded and re-read every `every`: the client certificate,
    /// key and CA when a client certificate is configured, the CA bundle alone
    /// otherwise ([`lockmesh_runtime::ReloadingCerts::watch_ca`]); `None` on
    /// plaintext. One set serves every client of a cluster. The error names the
    /// file that does not load.
    pub fn reloading_certs(
        &self,
        every: Duration,
    ) -> Result<Option<std::sync::Arc<lockmesh_runtime::ReloadingCerts>>, lockmesh_runtime::CertError> {
        match (&self.files, &self.ca_file) {
            (Some(f), _) => lockmesh_runtime::ReloadingCerts::watch(f.clone(), every).map(Some),
            (None, Some(ca)) => lockmesh_runtime::ReloadingCerts::watch_ca(ca.clone(), every).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// Connects to `endpoints` over one failover channel
    /// ([`lockmesh_runtime::failover_channel`]: one connection at a time, the next
    /// endpoint when it breaks, never an endpoint dropped for good), with the user
    /// and token refresh of [`EtcdClientAuth::apply_user`] (etcd-client's
    /// `from_channel`). With `certs` (from [`EtcdClientAuth::reloading_certs`]) every
    /// new connection presents the certificate current at its handshake (if one is
    /// configured) and verifies the members against the bundle current then;
    /// without `certs` but with `ca`, TLS verifies the members against `ca` as read
    /// at validation; with neither, plaintext. `timeouts` bound each connect and
    /// each request.
    pub async fn connect(
        &self,
        endpoints: &[String],
        certs: Option<&std::sync::Arc<lockmesh_runtime::ReloadingCerts>>,
        timeouts: lockmesh_runtime::ChannelOptions,
    ) -> Result<etcd_client::Client, etcd_client::Error> {
        self.connect_as(endpoints, certs, timeouts, Login::Now).await
    }

    /// [`EtcdClientAuth::connect`], logging the user in now or [`Login::Later`].
    pub async fn connect_as(
        &self,
        endpoints: &[String],
        certs: Option<&std::sync::Arc<lockmesh_runtime::ReloadingCerts>>,
        timeouts: lockmesh_runtime::ChannelOptions,
        login: Login,
    ) -> Result<etcd_client::Client, etcd_client::Error> {
        let channel = match (certs, &self.ca) {
            (Some(certs), _) => lockmesh_runtime::reloading_channel(endpoints, certs, timeouts),
            (None, Some(ca)) => lockmesh_runtime::ca_client_config(ca).and_then(|c| {
                lockmesh_runtime::failover_channel(endpoints, lockmesh_runtime::ChannelTls::Tls(c), timeouts)
            }),
            (None, None) => {
                lockmesh_runtime::failover_channel(endpoints, lockmesh_runtime::ChannelTls::Plain, timeouts)
            }
        }
        .map_err(etcd_client::Error::InvalidArgs)?;
        let opts = match login {
            Login::Now => self.apply_user(etcd_client::ConnectOptions::new()),
            // No user yet (so no request is made), the refresh on for when
            // [`login_later`] has set it.
            Login::Later => etcd_client::ConnectOptions::new().with_auto_token_refresh(self.user.is_some()),
        };
        etcd_client::Client::from_channel(etcd_client::Channel::Tonic(channel), Some(opts)).await
    }
}

/// When [`EtcdClientAuth::connect_as`] logs the user in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Login {
    /// At connect: the connect fails when etcd does not answer the login.
    Now,
    /// Not at connect ([`login_later`] does it): the client makes no request
    /// until used, and its calls go without a token until the login succeeds.
    Later,
}

/// Whether a failed login at connect may be retried later rather than fail the
/// connect: etcd did not answer it (unreachable, no quorum, timed out), as
/// opposed to refusing it (a wrong password or user, auth not enabled), which
/// is a configuration error to report at once.
pub fn login_may_wait(e: &etcd_client::Error) -> bool {
    // gRPC status codes (the gRPC spec's numbers): INVALID_ARGUMENT 3 (a wrong user
    // or password), PERMISSION_DENIED 7, FAILED_PRECONDITION 9 (auth not
    // enabled), UNAUTHENTICATED 16.
    const REFUSED: [i32; 4] = [3, 7, 9, 16];
    match e {
        etcd_client::Error::GRpcStatus(s) => !REFUSED.contains(&i32::from(s.code())),
        etcd_client::Error::InvalidArgs(_) | etcd_client::Error::InvalidUri(_) => false,
        _ => true,
    }
}

/// Logs `clients` (made with [`Login::Later`]) in as `user` in the background,
/// every `every` until each has logged in once; from then on etcd-client's own
/// token refresh keeps them logged in. Each client's clones share its token.
pub fn login_later(clients: Vec<etcd_client::Client>, user: (String, String), every: Duration, what: String) {
    tokio::spawn(async move {
        let mut left = clients;
        let mut attempts = 0u32;
        loop {
            let mut failed = Vec::new();
            let mut last_error = None;
            for mut c in left {
                match tokio::time::timeout(every.max(Duration::from_secs(1)), c.update_user(Some(user.clone()))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        last_error = Some(e.to_string());
                        failed.push(c);
                    }
                    Err(_) => {
                        last_error = Some("timed out".to_owned());
                        failed.push(c);
                    }
                }
            }
            if failed.is_empty() {
                tracing::info!(cluster = %what, attempts, "etcd login done (it was deferred at start)");
                return;
            }
            attempts += 1;
            if attempts % 30 == 1 {
                tracing::warn!(cluster = %what, attempts, error = last_error.as_deref().unwrap_or(""),
                    "etcd login deferred: this cluster's calls fail until it succeeds");
            }
            left = failed;
            tokio::time::sleep(every).await;
        }
    });
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
    let lead = format!("{name}: ");
    validate_with(raw, &|f| format!("{prefix}{f}"), base, &lead, errs)
}

/// How `lockctl`'s flags spell the fields of [`EtcdAuthFields`] in errors.
pub fn flag_name(field: &str) -> String {
    match field {
        "endpoints" => "--endpoints",
        "tls" | "tls.ca" => "--etcd-ca",
        "tls.cert" => "--etcd-cert",
        "tls.key" => "--etcd-key",
        "user" => "--etcd-user",
        "password_file" => "--etcd-password-file",
        other => other,
    }
    .to_owned()
}

/// The one validation behind [`validate_etcd_auth`] and [`EtcdConnection::from_fields`]:
/// `field` spells a field path (`tls.ca`, `user`, ...) as the source names it and
/// `lead` starts every error.
fn validate_with(
    raw: &EtcdAuthFields<'_>,
    field: &dyn Fn(&str) -> String,
    base: &Path,
    lead: &str,
    errs: &mut Vec<String>,
) -> EtcdClientAuth {
    let mut auth = EtcdClientAuth::default();
    let read = |f: &str, p: &str, errs: &mut Vec<String>| {
        std::fs::read(resolve(base, p))
            .map_err(|e| errs.push(format!("{lead}{}: cannot read {p:?}: {e}", field(f))))
            .ok()
    };
    let https = raw.endpoints.iter().filter(|e| e.starts_with("https://")).count();
    match raw.tls {
        Some(t) => {
            if https != raw.endpoints.len() {
                errs.push(format!(
                    "{lead}{}: with {} every endpoint must be https://",
                    field("endpoints"),
                    field("tls")
                ));
            }
            auth.ca = read("tls.ca", &t.ca, errs);
            auth.ca_file = auth.ca.is_some().then(|| resolve(base, &t.ca));
            match (&t.cert, &t.key) {
                (Some(c), Some(k)) => {
                    let files = lockmesh_runtime::CertFiles {
                        cert: resolve(base, c),
                        key: resolve(base, k),
                        ca: resolve(base, &t.ca),
                    };
                    if let (Some(c), Some(k)) = (read("tls.cert", c, errs), read("tls.key", k, errs)) {
                        auth.identity = Some((c, k));
                        auth.files = Some(files);
                    }
                }
                (None, None) => {}
                (Some(_), None) => {
                    errs.push(format!("{lead}{}: required with {}", field("tls.key"), field("tls.cert")))
                }
                (None, Some(_)) => {
                    errs.push(format!("{lead}{}: required with {}", field("tls.cert"), field("tls.key")))
                }
            }
        }
        None if https > 0 => errs.push(format!(
            "{lead}{}: required for https:// endpoints ({} names the CA)",
            field("tls"),
            field("tls.ca")
        )),
        None => {}
    }
    match (raw.user, raw.password_file) {
        (Some(u), Some(p)) => {
            if u.is_empty() {
                errs.push(format!("{lead}{}: must not be empty", field("user")));
            }
            if let Some(pw) = read("password_file", p, errs) {
                match String::from_utf8(pw) {
                    Ok(pw) if !pw.trim_end().is_empty() => auth.user = Some((u.to_owned(), pw.trim_end().to_owned())),
                    _ => errs
                        .push(format!("{lead}{}: {p:?} must hold a non-empty UTF-8 password", field("password_file"))),
                }
            }
        }
        (Some(_), None) => errs.push(format!("{lead}{}: required with {}", field("password_file"), field("user"))),
        (None, Some(_)) => errs.push(format!("{lead}{}: required with {}", field("user"), field("password_file"))),
        (None, None) => {}
    }
    auth
}

/// Connect timeout of an [`EtcdConnection`] unless its source sets one.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Request timeout of an [`EtcdConnection`] unless its source sets one.
pub(crate) const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Everything needed to reach one etcd cluster: endpoints, the validated TLS files
/// and user (read once, by [`validate_etcd_auth`]'s rules), and timeouts. The
/// arbiter's `etcd:` section, the audit tailer's `etcd_*` fields and `lockctl`'s
/// etcd flags all become one of these; the password never appears in `Debug`.
#[derive(Clone, Debug)]
pub struct EtcdConnection {
    /// Client URLs.
    pub endpoints: Vec<String>,
    /// TLS and user, already read from their files.
    pub auth: EtcdClientAuth,
    /// Bound of establishing the connection.
    pub connect_timeout: Duration,
    /// Bound of each request on it.
    pub request_timeout: Duration,
}

impl EtcdConnection {
    /// Validates `raw` (files relative to `base`) with the one validation; `field`
    /// spells field paths as the source names them (`|f| format!("etcd.{f}")` for a
    /// config file, [`flag_name`] for flags), and errors start with `lead`.
    pub fn from_fields(
        raw: &EtcdAuthFields<'_>,
        field: &dyn Fn(&str) -> String,
        base: &Path,
        lead: &str,
    ) -> Result<Self, Vec<String>> {
        let mut errs = Vec::new();
        if raw.endpoints.is_empty() {
            errs.push(format!("{lead}{}: at least one endpoint is required", field("endpoints")));
        }
        let auth = validate_with(raw, field, base, lead, &mut errs);
        if !errs.is_empty() {
            return Err(errs);
        }
        Ok(Self {
            endpoints: raw.endpoints.to_vec(),
            auth,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        })
    }

    /// The arbiter's `etcd:` section (field paths `etcd.*`, files relative to `base`,
    /// its `op_timeout_ms` as the request timeout).
    pub fn from_raw(raw: &RawEtcd, base: &Path, name: &str) -> Result<Self, Vec<String>> {
        let parts = EtcdAuthFields {
            endpoints: &raw.endpoints,
            tls: raw.tls.as_ref(),
            user: raw.user.as_deref(),
            password_file: raw.password_file.as_deref(),
        };
        let mut c = Self::from_fields(&parts, &|f| format!("etcd.{f}"), base, &format!("{name}: "))?;
        if let Some(ms) = raw.op_timeout_ms {
            c.request_timeout = Duration::from_millis(ms);
        }
        Ok(c)
    }

    /// Connects (no request is made: the first one shows whether etcd answers and
    /// whether the user may do it), over [`EtcdClientAuth::connect`]'s channel.
    pub async fn connect(&self) -> Result<etcd_client::Client, etcd_client::Error> {
        let certs = self
            .auth
            .reloading_certs(ETCD_CERT_RELOAD)
            .map_err(|e| etcd_client::Error::InvalidArgs(format!("etcd tls: {e}")))?;
        let timeouts = lockmesh_runtime::ChannelOptions {
            connect_timeout: self.connect_timeout,
            request_timeout: Some(self.request_timeout),
            keep_alive: None,
        };
        self.auth.connect(&self.endpoints, certs.as_ref(), timeouts).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(endpoints: &'a [String], tls: Option<&'a RawEtcdTls>) -> EtcdAuthFields<'a> {
        EtcdAuthFields { endpoints, tls, user: Some("u"), password_file: Some("missing-pw") }
    }

    #[test]
    fn errors_name_the_field_as_the_source_spells_it() {
        let eps = vec!["https://127.0.0.1:2379".to_owned()];
        let tls = RawEtcdTls { ca: "missing-ca.pem".into(), cert: Some("c.pem".into()), key: None };
        let dir = Path::new("/nonexistent-lockmesh");
        let errs = EtcdConnection::from_fields(&fields(&eps, Some(&tls)), &flag_name, dir, "").unwrap_err();
        assert!(errs.iter().any(|e| e.starts_with("--etcd-ca: cannot read \"missing-ca.pem\"")), "{errs:?}");
        assert!(errs.iter().any(|e| e == "--etcd-key: required with --etcd-cert"), "{errs:?}");
        assert!(errs.iter().any(|e| e.starts_with("--etcd-password-file: cannot read")), "{errs:?}");
        let errs = EtcdConnection::from_fields(&fields(&eps, Some(&tls)), &|f| format!("etcd.{f}"), dir, "a.yaml: ")
            .unwrap_err();
        assert!(errs.iter().any(|e| e.starts_with("a.yaml: etcd.tls.ca: cannot read")), "{errs:?}");
        let none: Vec<String> = vec![];
        let errs = EtcdConnection::from_fields(
            &EtcdAuthFields { endpoints: &none, tls: None, user: None, password_file: None },
            &flag_name,
            dir,
            "",
        )
        .unwrap_err();
        assert_eq!(errs, vec!["--endpoints: at least one endpoint is required".to_owned()]);
        let errs = EtcdConnection::from_fields(
            &EtcdAuthFields { endpoints: &eps, tls: None, user: None, password_file: None },
            &flag_name,
            dir,
            "",
        )
        .unwrap_err();
        assert_eq!(errs, vec!["--etcd-ca: required for https:// endpoints (--etcd-ca names the CA)".to_owned()]);
    }

    /// With the CA only, the connection watches the bundle by path
    /// (`reloading_certs` reads the file, not the bytes read at validation).
    #[test]
    fn a_ca_only_connection_reloads_its_bundle_file() {
        let dir = std::env::temp_dir().join(format!("lockmesh-connect-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ca.pem"), "not a certificate").unwrap();
        let eps = vec!["https://127.0.0.1:2379".to_owned()];
        let tls = RawEtcdTls { ca: "ca.pem".into(), cert: None, key: None };
        let raw = EtcdAuthFields { endpoints: &eps, tls: Some(&tls), user: None, password_file: None };
        let c = EtcdConnection::from_fields(&raw, &flag_name, &dir, "").unwrap();
        assert_eq!((c.auth.ca_file.as_deref(), c.auth.files.is_none()), (Some(dir.join("ca.pem").as_path()), true));
        let e = c.auth.reloading_certs(Duration::ZERO).unwrap_err();
        assert!(matches!(e, lockmesh_runtime::CertError::Parse { what: "ca", .. }), "{e}");
        assert!(EtcdClientAuth::default().reloading_certs(Duration::ZERO).unwrap().is_none(), "plaintext");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_the_files_and_keeps_the_password_out_of_debug() {
        let dir = std::env::temp_dir().join(format!("lockmesh-connect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("pw"), "s3cret\n").unwrap();
        let eps = vec!["http://127.0.0.1:2379".to_owned()];
        let raw =
            EtcdAuthFields { endpoints: &eps, tls: None, user: Some("lockmesh-admin"), password_file: Some("pw") };
        let c = EtcdConnection::from_fields(&raw, &flag_name, &dir, "").unwrap();
        assert_eq!(c.auth.user, Some(("lockmesh-admin".to_owned(), "s3cret".to_owned())));
        assert!(!format!("{c:?}").contains("s3cret"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
