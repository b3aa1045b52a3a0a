//! The operators' query port (`query:` in audit.yaml, docs/AUDIT.md): `POST
//! /v1/audit/query` over HTTPS with client certificates, on a listener of its own
//! so the metrics port, which scrapers reach, answers no query.
//!
//! Queries are answered by the configured store (`crate::reader`: ClickHouse when
//! a `clickhouse:` section is set, else the embedded store), named in each answer's
//! `x-lockmesh-audit-store` header; ClickHouse unreachable is `503`.
//!
//! Who may query is decided by [`Access::authorize`], before the store is read:
//! the client certificate's SPIFFE ID must be one of `query.allowed_clients`
//! and, when `query.operators` is set, an `Authorization: Bearer` token must
//! verify with the arbiter's operator verifier (`lockmesh_ops::admin::jwt`).
//! Refusals are the operator plane's table (`lockmesh_ops::admin::AdminError`:
//! status, stable code, `{"code", "message"}` body), as the arbiter answers them.
//! The token is never logged; a query is logged by its kind and the caller's
//! SPIFFE ID and `sub`, never by what it names.
//!
//! The port's certificate, key and client CA bundle are re-read every
//! `query.tls.reload_ms` (`lockmesh_runtime::certs::ReloadingCerts`): a rotation by
//! atomic directory swap reaches every new handshake, connections already open keep
//! theirs, and a set that does not load is logged and the old one kept.

use std::{future::Future, sync::Arc, time::Duration};

use axum::{
    body::Bytes,
    extract::{DefaultBodyLimit, State},
    http::{header, HeaderMap, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
    Extension, Json, Router,
};
use lockmesh_core::wire::audit::AuditErrorBody;
use lockmesh_ops::admin::AdminError;
use lockmesh_runtime::{
    certs::{CertError, CertFiles, ClientAuth, ReloadingCerts},
    ServeTls, TlsPeer,
};
use tokio::net::TcpListener;

use super::{
    config::{QueryApi, QueryOperators},
    query,
    reader::Reader,
};

/// The response header naming the store that answered (`embedded`, `clickhouse`).
pub const STORE_HEADER: &str = "x-lockmesh-audit-store";

/// Largest query body accepted (a query is a few hundred bytes).
const MAX_BODY: usize = 64 * 1024;

/// Who may query: the configured client identities and token checks.
#[derive(Debug, Clone)]
pub struct Access {
    /// SPIFFE IDs allowed (`query.allowed_clients`).
    pub allowed_clients: Vec<String>,
    /// Token checks (`query.operators`), if any.
    pub operators: Option<QueryOperators>,
}

/// The caller a query was authorised for: its certificate's SPIFFE ID and, with
/// token checks, the operator's `sub`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The client certificate's SPIFFE ID.
    pub client: String,
    /// The verified operator's subject, when tokens are checked.
    pub sub: Option<String>,
}

/// The SPIFFE ID of a connection's client certificate (none without one).
#[derive(Debug, Clone)]
struct PeerId(Option<String>);

impl Access {
    /// The access of a validated `query` section.
    pub fn of(q: &QueryApi) -> Self {
        Self { allowed_clients: q.allowed_clients.clone(), operators: q.operators.clone() }
    }

    /// Decides whether the holder of `peer` (the client certificate's SPIFFE ID,
    /// `None` without a certificate) sending `authorization` may query, at unix
    /// time `now_s`. The certificate is checked first: a token never makes up for
    /// a client that is not an operators' tool.
    pub fn authorize(&self, peer: Option<&str>, authorization: Option<&str>, now_s: u64) -> Result<Caller, AdminError> {
        let client = match peer {
            Some(id) if self.allowed_clients.iter().any(|c| c == id) => id.to_owned(),
            Some(id) => return Err(AdminError::ClientDenied(id.to_owned())),
            None => return Err(AdminError::ClientDenied("(no client certificate)".to_owned())),
        };
        let sub = match &self.operators {
            None => None,
            Some(ops) => {
                let token = lockmesh_ops::admin::bearer(authorization)?;
                Some(ops.verifier()?.verify(token, now_s)?.sub)
            }
        };
        Ok(Caller { client, sub })
    }
}

/// The listener's state.
struct Port {
    access: Access,
    /// The configured store (`crate::reader::for_config`).
    reader: Arc<dyn Reader>,
}

/// An [`AdminError`] as the operator plane answers it: its status, the
/// `{"code","message"}` body, `www-authenticate: Bearer` on a 401.
fn refusal(e: &AdminError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::FORBIDDEN);
    let mut r = (status, Json(e.body())).into_response();
    if e.wants_token() {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    r
}

async fn query_h(
    State(port): State<Arc<Port>>,
    Extension(PeerId(peer)): Extension<PeerId>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let now_s = lockmesh_keyspace::now_ms() / 1000;
    let caller = match port.access.authorize(peer.as_deref(), authorization, now_s) {
        Ok(c) => c,
        Err(e) => {
            // The code and the certificate's SPIFFE ID only: never the token.
            tracing::warn!(code = e.code(), client = peer.as_deref().unwrap_or("-"), "audit query refused");
            return refusal(&e);
        }
    };
    let q: query::Query = match serde_json::from_slice(&body) {
        Ok(q) => q,
        Err(e) => return refusal(&AdminError::BadCall(format!("query: {e}"))),
    };
    tracing::info!(client = %caller.client, sub = caller.sub.as_deref().unwrap_or("-"), query = kind_of(&q), "audit query");
    let store = HeaderValue::from_static(port.reader.name());
    let mut r = match port.reader.answer(&q, lockmesh_keyspace::now_ms()).await {
        Ok(a) => Json(a).into_response(),
        Err(e) => {
            // The store's message (ClickHouse's starts with its error code), never the query.
            tracing::warn!(store = port.reader.name(), query = kind_of(&q), error = %e.log_text(), "audit query failed");
            let status =
                if e.unavailable() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::INTERNAL_SERVER_ERROR };
            (status, Json(AuditErrorBody { error: e.to_string() })).into_response()
        }
    };
    r.headers_mut().insert(STORE_HEADER, store);
    r
}

/// A query's kind, as logged (what it names stays out of the log).
fn kind_of(q: &query::Query) -> &'static str {
    match q {
        query::Query::History { .. } => "history",
        query::Query::ByIdentity { .. } => "by_identity",
        query::Query::Longest { .. } => "longest",
        query::Query::Expiries { .. } => "expiries",
        query::Query::Recent { .. } => "recent",
        query::Query::Events { .. } => "events",
        query::Query::Unprotected { .. } => "unprotected",
        query::Query::Shadow { .. } => "shadow",
    }
}

/// The router of the query port, for connections whose client presented `peer`.
fn router(port: Arc<Port>, peer: Option<String>) -> Router {
    Router::new()
        .route("/v1/audit/query", post(query_h))
        .layer(Extension(PeerId(peer)))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(port)
}

/// The query port's certificate set: the server pair and the client CA bundle,
/// re-read every `query.tls.reload_ms` (`lockmesh_runtime::certs`).
fn certs(q: &QueryApi, every: Duration) -> Result<Arc<ReloadingCerts>, CertError> {
    let files = CertFiles { cert: q.cert.clone(), key: q.key.clone(), ca: q.client_ca.clone() };
    ReloadingCerts::watch(files, every)
}

/// The rustls configuration of the query port over `certs`: the current server
/// pair at each handshake, client certificates verified against the current
/// bundle when presented (a client without one reaches HTTP and is refused there
/// with `admin.client_denied`), HTTP/1.1.
fn server_config(certs: &Arc<ReloadingCerts>) -> Arc<rustls::ServerConfig> {
    certs.server_config(ClientAuth::Optional, &[b"http/1.1"])
}

/// Checks that the TLS files of `q` load as a certificate set (for
/// `--check-config` and before the tailer starts); reads them once, polls nothing.
pub fn check(q: &QueryApi) -> anyhow::Result<()> {
    certs(q, Duration::ZERO).map(drop).map_err(|e| anyhow::anyhow!("query.tls: {e}"))
}

/// Serves the query API on `listener` until `shutdown` completes, then drains
/// in-flight queries for up to 10 s (`lockmesh_runtime::serve_tls`, which hands
/// each connection's router the client certificate's SPIFFE ID).
pub async fn serve(
    listener: TcpListener,
    q: &QueryApi,
    reader: Arc<dyn Reader>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let certs = certs(q, q.reload).map_err(|e| anyhow::anyhow!("query.tls: {e}"))?;
    let port = Arc::new(Port { access: Access::of(q), reader });
    let make = move |peer: TlsPeer| router(port.clone(), peer.spiffe_id);
    lockmesh_runtime::serve_tls(listener, server_config(&certs), ServeTls::new("query port"), make, shutdown).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCKCTL: &str = "spiffe://td/ns/lockmesh-system/sa/lockctl";

    fn access(operators: Option<QueryOperators>) -> Access {
        Access { allowed_clients: vec![LOCKCTL.into()], operators }
    }

    /// The refusals the `audit_query::` scenario asserts, as codes and statuses.
    fn refused(a: &Access, peer: Option<&str>, auth: Option<&str>) -> Option<(&'static str, u16)> {
        a.authorize(peer, auth, 1_700_000_000).err().map(|e| (e.code(), e.status()))
    }

    #[test]
    fn only_an_allowed_client_certificate_may_query() {
        let a = access(None);
        assert_eq!(a.authorize(Some(LOCKCTL), None, 0).unwrap().client, LOCKCTL);
        for peer in [None, Some("spiffe://td/ns/payments/sa/app"), Some("spiffe://td/ns/lockmesh-system/sa/lockctl2")] {
            assert_eq!(refused(&a, peer, Some("Bearer x")), Some(("admin.client_denied", 403)), "{peer:?}");
        }
    }

    /// The scenario's refusal assertion catches a tailer that accepts anyone: a
    /// planted access whose check lets every client through answers a workload,
    /// so the same assertion fails on it.
    #[test]
    fn a_planted_access_that_accepts_anyone_fails_the_refusal_assertion() {
        let workload = Some("spiffe://td/ns/payments/sa/app");
        assert!(refused(&access(None), workload, None).is_some());
        let planted = Access { allowed_clients: vec!["spiffe://td/ns/payments/sa/app".into()], operators: None };
        assert!(refused(&planted, workload, None).is_none(), "the planted access lets the workload query");
    }

    #[test]
    fn with_token_checks_a_token_is_required_after_the_certificate() {
        let dir =
            std::env::temp_dir().join(format!("lm-audit-access-{}-{:x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        let idp = lockmesh_devcerts::jwt::Issuer::generate("k1").unwrap();
        std::fs::write(dir.join("jwks.json"), idp.jwks()).unwrap();
        let ops = QueryOperators {
            jwks_file: dir.join("jwks.json"),
            issuer: "https://idp".into(),
            audience: "lockmesh-admin".into(),
            role: Some("lock-operator".into()),
            require_mfa: true,
            max_token_age_s: Some(900),
        };
        let now = 1_700_000_000u64;
        let token = |roles: &[&str]| {
            let claims = serde_json::json!({"iss": "https://idp", "aud": "lockmesh-admin", "sub": "alice",
                "exp": now + 300, "iat": now - 60, "roles": roles, "amr": ["pwd", "otp"]});
            format!("Bearer {}", idp.token(&claims).unwrap())
        };
        let a = access(Some(ops));
        let ok = a.authorize(Some(LOCKCTL), Some(&token(&["lock-operator"])), now).unwrap();
        assert_eq!(ok, Caller { client: LOCKCTL.into(), sub: Some("alice".into()) });
        assert_eq!(refused(&a, Some(LOCKCTL), None), Some(("admin.token_missing", 401)));
        assert_eq!(refused(&a, Some(LOCKCTL), Some("Bearer a.b.c")), Some(("admin.token_invalid", 401)));
        assert_eq!(refused(&a, Some(LOCKCTL), Some(&token(&[]))), Some(("admin.role_missing", 403)));
        // The certificate is checked first: a good token never admits another client.
        let other = Some("spiffe://td/ns/payments/sa/app");
        assert_eq!(refused(&a, other, Some(&token(&["lock-operator"]))), Some(("admin.client_denied", 403)));
        let _ = std::fs::remove_dir_all(dir);
    }
}
