//! The tailer's configuration file (`lockmesh-audit --config audit.yaml`), YAML with
//! unknown fields refused; every error is collected and names its field.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use serde::Deserialize;

/// Default `checkpoint_interval_ms`.
pub const DEFAULT_CHECKPOINT_MS: u64 = 2000;
/// Default `compaction_window_s` (etcd `--auto-compaction-retention=1h`).
pub const DEFAULT_COMPACTION_WINDOW_S: u64 = 3600;

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
    pub etcd_tls: Option<lockmesh_lock::connect::RawEtcdTls>,
    /// etcd user (auth enabled; the role `lockmesh-audit`, docs/ADMIN.md), with
    /// `etcd_password_file`.
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (trailing newline ignored).
    pub etcd_password_file: Option<String>,
    /// The embedded store file (redb). Put it on a persistent volume: it holds the
    /// checkpoint, and the checkpoint is the restore detector.
    pub store_file: String,
    /// Admin HTTP listen address: `/metrics`, `/healthz`, `POST /v1/audit/query`.
    /// The query answers carry identities and raw keys: keep it off the mesh.
    pub admin_listen: String,
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
    pub etcd_auth: lockmesh_lock::connect::EtcdClientAuth,
    /// Store file.
    pub store_file: PathBuf,
    /// Admin listen address.
    pub admin_listen: SocketAddr,
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
fn etcd_auth(
    raw: &RawConfig,
    base: &Path,
    name: &str,
    errs: &mut Vec<String>,
) -> lockmesh_lock::connect::EtcdClientAuth {
    let parts = lockmesh_lock::connect::EtcdAuthFields {
        endpoints: &raw.etcd_endpoints,
        tls: raw.etcd_tls.as_ref(),
        user: raw.etcd_user.as_deref(),
        password_file: raw.etcd_password_file.as_deref(),
    };
    lockmesh_lock::connect::validate_etcd_auth(&parts, "etcd_", base, name, errs)
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
            lockmesh_lock::registry::load(&resolve(base, p))
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
                checkpoint_interval_ms,
                compaction_window_s,
                instance,
                election_ttl_s,
                registry,
                seal_on_restore: raw.seal_on_restore.unwrap_or(true),
                clickhouse,
                telemetry,
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
    }
}
