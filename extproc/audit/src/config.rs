//! The tailer's configuration file (`lockmesh-audit --config audit.yaml`), YAML with
//! unknown fields refused; every error is collected and names its field.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;

/// Default `checkpoint_interval_ms`.
pub const DEFAULT_CHECKPOINT_MS: u64 = 2000;
/// Default `compaction_window_s` (etcd `--auto-compaction-retention=1h`).
pub const DEFAULT_COMPACTION_WINDOW_S: u64 = 3600;
/// Default `query.tls.reload_ms`.
pub const DEFAULT_TLS_RELOAD_MS: u64 = 5000;

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// etcd client URLs, `http://host:port`.
    pub etcd_endpoints: Vec<String>,
    /// The lockmesh key root to audit, e.g. `/lockmesh` (the arbiters' `etcd.root`).
    pub etcd_root: String,
    /// Client TLS to etcd, like the arbiter's `etcd.tls`: `{ca, cert, key}`;
    /// `https://` endpoints need it, and with it every endpoint must be one.
    pub etcd_tls: Option<lockmesh_etcd::RawEtcdTls>,
    /// etcd user (auth enabled; the role `lockmesh-audit`, docs/ADMIN.md), with
    /// `etcd_password_file`.
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (trailing newline ignored).
    pub etcd_password_file: Option<String>,
    /// The embedded store file (redb). Put it on a persistent volume: it holds the
    /// checkpoint, and the checkpoint is the restore detector.
    pub store_file: String,
    /// Metrics HTTP listen address: `/metrics`, `/healthz` and `/v1/audit/checkpoint`
    /// only (no identity, no key). Scrapers may reach it; the query API is not here
    /// (`query`).
    pub admin_listen: String,
    /// The operators' query API (`POST /v1/audit/query`) on its own mTLS listener:
    /// its answers carry identities and raw keys. Without it the API is off and
    /// only `lockctl audit --db` reads the store.
    pub query: Option<RawQuery>,
    /// How often events are committed with the checkpoint, ms. Default 2000.
    pub checkpoint_interval_ms: Option<u64>,
    /// etcd's compaction window in seconds (its `--auto-compaction-retention`). The
    /// tailer alarms when it is behind by half of it. Default 3600.
    pub compaction_window_s: Option<u64>,
    /// This replica's name in the election (default: hostname and pid).
    pub instance: Option<String>,
    /// TTL of the election lease, seconds (renewed every third of it). A crashed
    /// leader is replaced within it. Default 10.
    pub election_ttl_s: Option<u64>,
    /// The class registry (labels: namespace and tier from it, never from keys it
    /// does not know). Optional.
    pub registry_file: Option<String>,
    /// Seal the lock service (explicit seal in the epoch record) when the cluster's
    /// revision is behind the checkpoint. Default true.
    pub seal_on_restore: Option<bool>,
    /// Also insert every event into ClickHouse (HTTP interface).
    pub clickhouse: Option<RawClickHouse>,
    /// Tracing spans exported over OTLP/HTTP, like the arbiter's `telemetry`
    /// (`docs/OPERATIONS.md`). Default: off.
    pub telemetry: Option<lockmesh_telemetry::RawTelemetry>,
    /// The archives (`crate::archive`): closed grants as daily Parquet files and
    /// force-release records under object lock, in S3. Default: off.
    pub archive: Option<crate::archive::RawArchive>,
    /// TEST ONLY: planted faults (`crate::test_faults`). Refused unless the
    /// environment sets `LOCKMESH_TEST_FAULTS=1` and the build is a test build.
    #[serde(default)]
    pub test_faults: Vec<String>,
}

/// `query:`: who may call the query API, and how they prove it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQuery {
    /// `host:port` of the query listener (HTTPS, client certificates).
    pub listen: String,
    /// The listener's certificate, key and the CA that client certificates must chain to.
    pub tls: RawQueryTls,
    /// SPIFFE IDs (URI SAN) of the operators' tooling that may query: `lockctl`'s
    /// certificate, the arbiter whose console shows recent events. Any other
    /// client is refused (`admin.client_denied`).
    pub allowed_clients: Vec<String>,
    /// Operators' tokens, checked as the arbiter checks them (its `operators`
    /// section, docs/ADMIN.md): when set, every query also needs a verified
    /// `Authorization: Bearer` token.
    pub operators: Option<RawQueryOperators>,
}

/// The query listener's TLS files (PEM).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQueryTls {
    /// Server certificate chain.
    pub cert: String,
    /// Its private key.
    pub key: String,
    /// CA bundle client certificates must chain to (every certificate in it is
    /// trusted: during a CA roll, the old and the new CA).
    pub client_ca: String,
    /// How often the three files are re-read for a rotation, ms (by content, so
    /// the atomic directory swap of the SPIFFE helper or a Kubernetes secret
    /// volume is seen; a set that does not load is logged and the old one kept).
    /// Default 5000; 0: read once at start, a rotation then needs a restart.
    pub reload_ms: Option<u64>,
}

/// The token checks of the arbiter's `operators` section, field for field (the
/// same verifier, `lockmesh_ops::admin::jwt`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQueryOperators {
    /// The identity provider's JWKS (JSON file), re-read on every query.
    pub jwks_file: String,
    /// Required `iss`.
    pub issuer: String,
    /// Required `aud`. Default `lockmesh-admin`.
    pub audience: Option<String>,
    /// Required role. Default `lock-operator`; `""` for none.
    pub role: Option<String>,
    /// Require an MFA sign-in (`amr`). Default true.
    pub require_mfa: Option<bool>,
    /// A token's `iat` must be at most this old, seconds. Default 900; 0: off.
    pub max_token_age_s: Option<u64>,
}

/// Validated `query`.
#[derive(Debug, Clone)]
pub struct QueryApi {
    /// Listen address.
    pub listen: SocketAddr,
    /// Server certificate chain file.
    pub cert: PathBuf,
    /// Server key file.
    pub key: PathBuf,
    /// Client CA bundle file.
    pub client_ca: PathBuf,
    /// How often the TLS files are re-read; zero: never (`tls.reload_ms: 0`).
    pub reload: Duration,
    /// SPIFFE IDs that may query.
    pub allowed_clients: Vec<String>,
    /// Token checks, if configured.
    pub operators: Option<QueryOperators>,
}

/// Validated `query.operators`.
#[derive(Debug, Clone)]
pub struct QueryOperators {
    /// JWKS file (re-read per query, so a rotated key applies without a restart).
    pub jwks_file: PathBuf,
    /// Required `iss`.
    pub issuer: String,
    /// Required `aud`.
    pub audience: String,
    /// Required role, if any.
    pub role: Option<String>,
    /// MFA sign-in required.
    pub require_mfa: bool,
    /// Token freshness bound, seconds (`None`: off).
    pub max_token_age_s: Option<u64>,
}

impl QueryOperators {
    /// The operators' token verifier with the JWKS as the file holds it now.
    pub fn verifier(&self) -> Result<lockmesh_ops::admin::jwt::Verifier, lockmesh_ops::admin::AdminError> {
        use lockmesh_ops::admin::{jwt, AdminError};
        let text = std::fs::read_to_string(&self.jwks_file)
            .map_err(|e| AdminError::Jwks(format!("{}: {e}", self.jwks_file.display())))?;
        Ok(jwt::Verifier::new(jwt::Jwks::parse(&text)?, self.issuer.clone(), self.audience.clone())
            .with_role(self.role.clone())
            .with_mfa(self.require_mfa)
            .with_max_age(self.max_token_age_s))
    }
}

impl QueryApi {
    /// What this section leaves open, in words (empty when nothing is): printed by
    /// `--check-config` and at every start.
    pub fn weakened(&self) -> Vec<String> {
        let mut w = Vec::new();
        match &self.operators {
            None => w.push(
                "query.operators is not set: any holder of an allowed client certificate may query, without an \
                 operator token"
                    .to_owned(),
            ),
            Some(o) => {
                if !o.require_mfa {
                    w.push("query.operators.require_mfa is false: tokens without an MFA sign-in are accepted".into());
                }
                if o.max_token_age_s.is_none() {
                    w.push("query.operators.max_token_age_s is 0: tokens of any sign-in age are accepted".into());
                }
            }
        }
        w
    }
}

fn query_api(
    raw: &RawQuery,
    admin: Option<SocketAddr>,
    base: &Path,
    name: &str,
    errs: &mut Vec<String>,
) -> Option<QueryApi> {
    let listen = raw
        .listen
        .parse::<SocketAddr>()
        .map_err(|e| errs.push(format!("{name}: query.listen: {:?} is not host:port: {e}", raw.listen)))
        .ok();
    if listen.is_some() && listen == admin {
        errs.push(format!(
            "{name}: query.listen: {:?} is admin_listen: the query API needs its own port, closed to scrapers",
            raw.listen
        ));
    }
    let file = |field: &str, p: &str, errs: &mut Vec<String>| {
        let path = resolve(base, p);
        if let Err(e) = std::fs::metadata(&path) {
            errs.push(format!("{name}: query.tls.{field}: cannot read {p:?}: {e}"));
        }
        path
    };
    let (cert, key, client_ca) = (
        file("cert", &raw.tls.cert, errs),
        file("key", &raw.tls.key, errs),
        file("client_ca", &raw.tls.client_ca, errs),
    );
    if raw.allowed_clients.is_empty() {
        errs.push(format!(
            "{name}: query.allowed_clients: must name at least one SPIFFE ID (lockctl's certificate); an empty list \
             would refuse every operator"
        ));
    }
    for (i, c) in raw.allowed_clients.iter().enumerate() {
        if !c.starts_with("spiffe://") || c.len() <= "spiffe://".len() {
            errs.push(format!("{name}: query.allowed_clients[{i}]: {c:?} is not a spiffe:// URI"));
        }
    }
    let operators = raw.operators.as_ref().map(|o| {
        let jwks_file = resolve(base, &o.jwks_file);
        match std::fs::read_to_string(&jwks_file) {
            Ok(t) => {
                if let Err(e) = lockmesh_ops::admin::jwt::Jwks::parse(&t) {
                    errs.push(format!("{name}: query.operators.jwks_file: {e}"));
                }
            }
            Err(e) => errs.push(format!("{name}: query.operators.jwks_file: cannot read {:?}: {e}", o.jwks_file)),
        }
        if o.issuer.is_empty() {
            errs.push(format!("{name}: query.operators.issuer: must not be empty"));
        }
        let audience = o.audience.clone().unwrap_or_else(|| "lockmesh-admin".into());
        if audience.is_empty() {
            errs.push(format!("{name}: query.operators.audience: must not be empty"));
        }
        let max_token_age_s = o.max_token_age_s.unwrap_or(900);
        if max_token_age_s > 86_400 {
            errs.push(format!("{name}: query.operators.max_token_age_s: {max_token_age_s} is above 86400"));
        }
        QueryOperators {
            jwks_file,
            issuer: o.issuer.clone(),
            audience,
            role: Some(o.role.clone().unwrap_or_else(|| "lock-operator".into())).filter(|r| !r.is_empty()),
            require_mfa: o.require_mfa.unwrap_or(true),
            max_token_age_s: Some(max_token_age_s).filter(|s| *s > 0),
        }
    });
    let reload_ms = raw.tls.reload_ms.unwrap_or(DEFAULT_TLS_RELOAD_MS);
    if reload_ms != 0 && !(100..=3_600_000).contains(&reload_ms) {
        errs.push(format!("{name}: query.tls.reload_ms: {reload_ms} is outside 100 to 3600000 (0: never)"));
    }
    Some(QueryApi {
        listen: listen?,
        cert,
        key,
        client_ca,
        reload: Duration::from_millis(reload_ms),
        allowed_clients: raw.allowed_clients.clone(),
        operators,
    })
}

/// The ClickHouse sink.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawClickHouse {
    /// `http://host:8123` (plain HTTP; put TLS in front or use a local proxy).
    pub url: String,
    /// Database. Default `lockmesh`.
    pub database: Option<String>,
    /// Table. Default `audit_events`.
    pub table: Option<String>,
    /// User (`X-ClickHouse-User`).
    pub user: Option<String>,
    /// File holding the password (`X-ClickHouse-Key`).
    pub password_file: Option<String>,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// etcd endpoints.
    pub etcd_endpoints: Vec<String>,
    /// Key root, no trailing slash.
    pub etcd_root: String,
    /// etcd TLS and user (the password stays out of `Debug`).
    pub etcd_auth: lockmesh_etcd::EtcdClientAuth,
    /// Store file.
    pub store_file: PathBuf,
    /// Metrics listen address.
    pub admin_listen: SocketAddr,
    /// The operators' query API, if configured.
    pub query: Option<QueryApi>,
    /// Checkpoint period, ms.
    pub checkpoint_interval_ms: u64,
    /// Compaction window, s.
    pub compaction_window_s: u64,
    /// Election name.
    pub instance: String,
    /// Election lease TTL, seconds.
    pub election_ttl_s: u64,
    /// Registry, if given.
    pub registry: Option<lockmesh_core::ClassRegistry>,
    /// Seal on restore.
    pub seal_on_restore: bool,
    /// ClickHouse sink.
    pub clickhouse: Option<super::clickhouse::Sink>,
    /// OTLP span export, if configured.
    pub telemetry: Option<lockmesh_telemetry::Telemetry>,
    /// The archives, if configured.
    pub archive: Option<crate::archive::Archiver>,
    /// TEST ONLY planted faults (see `RawConfig::test_faults`).
    pub test_faults: Vec<crate::test_faults::TestFault>,
}

fn resolve(base: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_owned()
    } else {
        base.join(p)
    }
}

/// Validates `etcd_tls`, `etcd_user` and `etcd_password_file` against the
/// endpoints, with the arbiter's own validator.
fn etcd_auth(raw: &RawConfig, base: &Path, name: &str, errs: &mut Vec<String>) -> lockmesh_etcd::EtcdClientAuth {
    let parts = lockmesh_etcd::EtcdAuthFields {
        endpoints: &raw.etcd_endpoints,
        tls: raw.etcd_tls.as_ref(),
        user: raw.etcd_user.as_deref(),
        password_file: raw.etcd_password_file.as_deref(),
    };
    lockmesh_etcd::validate_etcd_auth(&parts, "etcd_", base, name, errs)
}

// === impl Config ===

impl Config {
    /// Reads and validates `path`, collecting every error.
    pub fn load(path: &Path) -> Result<Self, Vec<String>> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| vec![format!("{name}: cannot read: {e}")])?;
        let raw: RawConfig = lockmesh_runtime::parse_yaml(&text).map_err(|e| vec![format!("{name}: {e}")])?;
        Self::try_from_raw(raw, path.parent().unwrap_or(Path::new(".")), &name)
    }

    /// Validates a parsed file.
    pub fn try_from_raw(raw: RawConfig, base: &Path, name: &str) -> Result<Self, Vec<String>> {
        let mut errs = Vec::new();
        if raw.etcd_endpoints.is_empty() {
            errs.push(format!("{name}: etcd_endpoints: must list at least one endpoint"));
        }
        for (i, e) in raw.etcd_endpoints.iter().enumerate() {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                errs.push(format!("{name}: etcd_endpoints[{i}]: {e:?} must start with http:// or https://"));
            }
        }
        let root = raw.etcd_root.trim_end_matches('/').to_owned();
        if !raw.etcd_root.starts_with('/') || root.is_empty() {
            errs.push(format!("{name}: etcd_root: {:?} must start with '/' and not be '/' alone", raw.etcd_root));
        }
        let admin = raw
            .admin_listen
            .parse::<SocketAddr>()
            .map_err(|e| errs.push(format!("{name}: admin_listen: {:?} is not host:port: {e}", raw.admin_listen)));
        let query = raw.query.as_ref().and_then(|q| query_api(q, admin.as_ref().ok().copied(), base, name, &mut errs));
        let checkpoint_interval_ms = raw.checkpoint_interval_ms.unwrap_or(DEFAULT_CHECKPOINT_MS);
        if !(100..=60_000).contains(&checkpoint_interval_ms) {
            errs.push(format!("{name}: checkpoint_interval_ms: {checkpoint_interval_ms} is outside 100 to 60000"));
        }
        let compaction_window_s = raw.compaction_window_s.unwrap_or(DEFAULT_COMPACTION_WINDOW_S);
        if compaction_window_s < 2 {
            errs.push(format!("{name}: compaction_window_s: {compaction_window_s} is below 2"));
        }
        let election_ttl_s = raw.election_ttl_s.unwrap_or(10);
        if !(3..=300).contains(&election_ttl_s) {
            errs.push(format!("{name}: election_ttl_s: {election_ttl_s} is outside 3 to 300"));
        }
        let registry = raw.registry_file.as_ref().and_then(|p| {
            lockmesh_registry::load(&resolve(base, p))
                .map_err(|e| {
                    errs.push(format!("{name}: registry_file:"));
                    errs.extend(e.into_iter().map(|m| format!("  {m}")));
                })
                .ok()
        });
        let clickhouse = raw.clickhouse.as_ref().and_then(|c| {
            let password = match &c.password_file {
                Some(p) => match std::fs::read_to_string(resolve(base, p)) {
                    Ok(s) => Some(s.trim().to_owned()),
                    Err(e) => {
                        errs.push(format!("{name}: clickhouse.password_file: cannot read {p:?}: {e}"));
                        return None;
                    }
                },
                None => None,
            };
            super::clickhouse::Sink::try_new(
                &c.url,
                c.database.as_deref().unwrap_or("lockmesh"),
                c.table.as_deref().unwrap_or("audit_events"),
                c.user.clone(),
                password,
            )
            .map_err(|e| errs.push(format!("{name}: clickhouse.{e}")))
            .ok()
        });
        let etcd_auth = etcd_auth(&raw, base, name, &mut errs);
        let test_faults = crate::test_faults::validate(&raw.test_faults, name, &mut errs);
        let archive = raw.archive.as_ref().and_then(|a| {
            crate::archive::Archiver::try_new(a).map_err(|e| errs.push(format!("{name}: archive.{e}"))).ok()
        });
        let telemetry = lockmesh_telemetry::validate(raw.telemetry.as_ref(), "lockmesh-audit", name, &mut errs);
        let instance = raw.instance.unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_owned()).unwrap_or_default();
            format!("{host}-{}", std::process::id())
        });
        match admin {
            Ok(admin_listen) if errs.is_empty() => Ok(Config {
                etcd_endpoints: raw.etcd_endpoints,
                etcd_root: root,
                etcd_auth,
                store_file: resolve(base, &raw.store_file),
                admin_listen,
                query,
                checkpoint_interval_ms,
                compaction_window_s,
                instance,
                election_ttl_s,
                registry,
                seal_on_restore: raw.seal_on_restore.unwrap_or(true),
                clickhouse,
                telemetry,
                archive,
                test_faults,
            }),
            _ => Err(errs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_every_error_with_its_field() {
        let raw: RawConfig = lockmesh_runtime::parse_yaml(
            "etcd_endpoints: [\"tcp://x\"]\netcd_root: lockmesh\nstore_file: a.redb\nadmin_listen: nope\ncheckpoint_interval_ms: 5\nclickhouse: { url: \"ftp://ch\" }\n",
        )
        .unwrap();
        let errs = Config::try_from_raw(raw, Path::new("/tmp"), "audit.yaml").unwrap_err();
        let text = errs.join("\n");
        for want in ["etcd_endpoints[0]", "etcd_root", "admin_listen", "checkpoint_interval_ms", "clickhouse.url"] {
            assert!(text.contains(&format!("audit.yaml: {want}")), "{want} missing in {text}");
        }
        assert!(lockmesh_runtime::parse_yaml::<RawConfig>("etcd_endpointz: []").is_err());
    }

    /// A file that does not parse is one `file: field: why` line, the field being
    /// the unknown one or the one of the wrong type.
    #[test]
    fn parse_errors_name_the_file_and_the_field() {
        let dir =
            std::env::temp_dir().join(format!("lm-audit-parse-{}-{:x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        let load = |text: &str| {
            let path = dir.join("audit.yaml");
            std::fs::write(&path, text).unwrap();
            let errs = Config::load(&path).unwrap_err();
            assert_eq!(errs.len(), 1, "{errs:?}");
            errs[0].strip_prefix(&format!("{}: ", path.display())).unwrap().to_owned()
        };
        let unknown = load("etcd_endpointz: []\n");
        assert!(unknown.starts_with("etcd_endpointz: unknown field `etcd_endpointz`, expected one of"), "{unknown}");
        assert!(unknown.ends_with("at line 1, column 1"), "{unknown}");
        let typed = load("etcd_endpoints: []\netcd_root: /lm\nstore_file: a\nadmin_listen: x\nelection_ttl_s: ten\n");
        assert!(typed.starts_with("election_ttl_s: invalid u64 at line 5"), "{typed}");
        let nested =
            load("etcd_endpoints: []\netcd_root: /lm\nstore_file: a\nadmin_listen: x\nclickhouse: { url: u, db: d }\n");
        assert!(nested.starts_with("clickhouse.db: unknown field `db`"), "{nested}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn etcd_tls_and_user_are_validated_with_field_paths() {
        let dir = std::env::temp_dir().join(format!("lm-audit-cfg-{}-{:x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ca.pem"), "CA").unwrap();
        std::fs::write(dir.join("pw"), "s3cret\n").unwrap();
        let cfg = |extra: &str, eps: &str| {
            let text = format!(
                "etcd_endpoints: [{eps}]\netcd_root: /lm\nstore_file: a.redb\nadmin_listen: 127.0.0.1:0\n{extra}"
            );
            Config::try_from_raw(lockmesh_runtime::parse_yaml(&text).unwrap(), &dir, "audit.yaml")
        };
        let ok =
            cfg("etcd_tls: { ca: ca.pem }\netcd_user: lockmesh-audit\netcd_password_file: pw\n", "\"https://e:2379\"")
                .unwrap();
        assert_eq!(ok.etcd_auth.ca.as_deref(), Some(&b"CA"[..]));
        assert_eq!(ok.etcd_auth.user, Some(("lockmesh-audit".into(), "s3cret".into())));
        assert!(!format!("{ok:?}").contains("s3cret"), "password in Debug");
        let cases = [
            ("", "\"https://e:2379\"", "audit.yaml: etcd_tls: required for https:// endpoints"),
            (
                "etcd_tls: { ca: ca.pem }\n",
                "\"http://e:2379\"",
                "audit.yaml: etcd_endpoints: with etcd_tls every endpoint",
            ),
            ("etcd_tls: { ca: missing.pem }\n", "\"https://e:2379\"", "audit.yaml: etcd_tls.ca: cannot read"),
            (
                "etcd_tls: { ca: ca.pem, cert: c.pem }\n",
                "\"https://e:2379\"",
                "audit.yaml: etcd_tls.key: required with etcd_tls.cert",
            ),
            ("etcd_user: a\n", "\"http://e:2379\"", "audit.yaml: etcd_password_file: required with etcd_user"),
            (
                "etcd_password_file: pw\n",
                "\"http://e:2379\"",
                "audit.yaml: etcd_user: required with etcd_password_file",
            ),
        ];
        for (extra, eps, want) in cases {
            let errs = cfg(extra, eps).unwrap_err();
            assert!(errs.iter().any(|e| e.starts_with(want)), "{want}: {errs:?}");
        }
    }

    /// The shipped Kubernetes ConfigMap's audit.yaml uses only fields the tailer
    /// knows, with TLS and the least-privilege etcd user.
    #[test]
    fn the_shipped_configmap_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/base/audit/configmap.yaml");
        /// The part of a ConfigMap read here.
        #[derive(Deserialize)]
        struct ConfigMap {
            data: std::collections::BTreeMap<String, String>,
        }
        let cm: ConfigMap = lockmesh_runtime::parse_yaml(&std::fs::read_to_string(path).unwrap()).unwrap();
        let raw: RawConfig = lockmesh_runtime::parse_yaml(&cm.data["audit.yaml"]).unwrap();
        assert_eq!(raw.etcd_user.as_deref(), Some("lockmesh-audit"));
        assert!(raw.etcd_tls.is_some() && raw.etcd_endpoints.iter().all(|e| e.starts_with("https://")));
        // The query API on its own port, for named operators' tools only.
        let q = raw.query.as_ref().expect("the shipped config has a query section");
        assert_ne!(q.listen, raw.admin_listen);
        assert!(!q.allowed_clients.is_empty() && q.allowed_clients.iter().all(|c| c.starts_with("spiffe://")));
    }

    /// A `query` section is checked field by field: its own port, readable TLS
    /// files, at least one SPIFFE ID, a readable JWKS when tokens are checked.
    #[test]
    fn the_query_section_names_its_errors() {
        let raw: RawConfig = lockmesh_runtime::parse_yaml(
            "etcd_endpoints: [\"http://e:2379\"]\netcd_root: /lockmesh\nstore_file: a.redb\nadmin_listen: \"127.0.0.1:1\"\n\
             query: { listen: \"127.0.0.1:1\", tls: { cert: no.pem, key: no.pem, client_ca: no.pem }, \
             allowed_clients: [], operators: { jwks_file: no.json, issuer: \"\" } }\n",
        )
        .unwrap();
        let errs = Config::try_from_raw(raw, Path::new("/nonexistent"), "audit.yaml").unwrap_err().join("\n");
        for want in [
            "query.listen: \"127.0.0.1:1\" is admin_listen",
            "query.tls.cert: cannot read",
            "query.tls.client_ca: cannot read",
            "query.allowed_clients: must name at least one SPIFFE ID",
            "query.operators.jwks_file: cannot read",
            "query.operators.issuer: must not be empty",
        ] {
            assert!(errs.contains(&format!("audit.yaml: {want}")), "{want} missing in {errs}");
        }
        let raw: RawConfig = lockmesh_runtime::parse_yaml(
            "etcd_endpoints: [\"http://e:2379\"]\netcd_root: /lockmesh\nstore_file: a.redb\nadmin_listen: \"127.0.0.1:1\"\n\
             query: { listen: \"127.0.0.1:2\", tls: { cert: /dev/null, key: /dev/null, client_ca: /dev/null }, \
             allowed_clients: [\"lockctl\"] }\n",
        )
        .unwrap();
        let errs = Config::try_from_raw(raw, Path::new("/"), "audit.yaml").unwrap_err().join("\n");
        assert!(errs.contains("query.allowed_clients[0]: \"lockctl\" is not a spiffe:// URI"), "{errs}");
    }
}
