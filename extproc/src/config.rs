//! The arbiter's configuration file (YAML, unknown fields refused).
//!
//! Parsing has two stages: [`RawConfig`] (serde) becomes [`Config`] through
//! validation that collects every error, each prefixed with the file and field path
//! (`arbiter.yaml: etcd.root: must start with '/'`). `--check-config` runs the same
//! code as startup. Relative paths are relative to the config file.

use lockmesh_lock::clusters::Clusters;
pub use lockmesh_lock::connect::{validate_etcd_auth, EtcdAuthFields, EtcdClientAuth, RawEtcd, RawEtcdTls};
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use lockmesh_core::class::ClassRegistry;
use serde::Deserialize;

/// Default `max_wait_ms`.
pub const DEFAULT_MAX_WAIT_MS: u64 = 30_000;
/// Ceiling of `max_wait_ms` (Envoy's ext_proc timeout ceiling is one hour).
pub const MAX_WAIT_CEILING_MS: u64 = 3_600_000;
/// Default `handoff_grace_ms`: about the time a hot key's next head takes to reach
/// the arbiter after the new holder's answer left it (docs/BENCHMARKS.md).
const DEFAULT_HANDOFF_GRACE_MS: u64 = 2;
/// Default `validate_rate_per_s`.
pub const DEFAULT_VALIDATE_RATE_PER_S: u32 = 100;

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// ext_proc gRPC listen address (mTLS), e.g. `0.0.0.0:18051`.
    pub listen: String,
    /// Admin HTTP listen address: `/healthz`, `/readyz`, `/metrics`. Keep it off
    /// the mesh's public listeners.
    pub admin_listen: String,
    /// Server certificate and the Envoys allowed to call.
    pub tls: RawTls,
    /// etcd connection and key root.
    pub etcd: RawEtcd,
    /// Path of the class registry YAML (docs/CLASSES.md). Exactly one of
    /// `registry_file` and `registry_dir`.
    pub registry_file: Option<String>,
    /// A directory of `LockClass` and `LockGrant` manifests (ADR-24), as a GitOps
    /// sync or a projected ConfigMap volume lays them down: its `*.yaml`/`*.yml`
    /// files, dotfiles skipped, validated by the CRD's structure and the
    /// registry loader (`lockmesh_registry::crd::manifests`) and re-read
    /// every second. Exactly one of `registry_file` and `registry_dir`.
    pub registry_dir: Option<String>,
    /// With `registry_dir` only: the registry's `platform:` section (manifests
    /// carry none). Default: the ADR-11 floors; lowering one needs
    /// `lowered_floors_reason`, as in a registry file.
    pub registry_platform: Option<lockmesh_core::class::RawPlatform>,
    /// With `registry_dir` only: the registry's `quotas:` section (manifests carry
    /// none; docs/OPERATIONS.md "Quotas"). Default: the built-in per-namespace
    /// limits (`lockmesh_core::quota::DEFAULT_LIMITS`).
    pub registry_quotas: Option<lockmesh_core::quota::RawQuotas>,
    /// Longest wait an acquire may ask for, ms. Default 30000. Keep it below the
    /// Envoy listener's `request_timeout` and ext_proc `max_message_timeout`.
    pub max_wait_ms: Option<u64>,
    /// File holding this arbiter's durable high-water marks (restore detection).
    /// Put it on a volume that survives restarts and rescheduling. Without it an
    /// arbiter detects restores only while it runs.
    pub marks_file: Option<String>,
    /// Grant proof signing key. Without it the arbiter grants as usual but omits
    /// proofs (`x-lock-proof`), and fence-proxy cannot be used with it.
    pub signing: Option<RawSigning>,
    /// Token bucket rate of `POST /v1/tokens/validate`, requests per second on this
    /// arbiter (burst: the same number). Over it: `429 rate_limited`. Default 100.
    pub validate_rate_per_s: Option<u32>,
    /// Hand a released key to its next waiter in the release transaction
    /// (docs/CLASSES.md). Default true; false only to measure what it saves.
    pub handoff: Option<bool>,
    /// How long a release of a key whose last release here handed it over waits
    /// for the next head's offer when none is posted yet, ms (docs/CLASSES.md,
    /// "Hand-off"). Default 2; 0 never waits; at most 1000.
    pub handoff_grace_ms: Option<u64>,
    /// Two-person admin actions executed by this arbiter (`docs/ADMIN.md`): who may
    /// call them and how operators' tokens are verified. Without it the admin
    /// routes answer `admin.not_configured`.
    pub operators: Option<RawOperators>,
    /// Tracing spans exported to an OpenTelemetry collector over OTLP/HTTP
    /// (`docs/OPERATIONS.md`). Default: off.
    pub telemetry: Option<crate::telemetry::RawTelemetry>,
    /// The read-only web console on the admin port (`/console`,
    /// `docs/OPERATIONS.md`). Its API checks operators' tokens exactly as the
    /// admin actions do (`operators`); without `operators` it answers
    /// `admin.not_configured`.
    pub console: Option<RawConsole>,
    /// More etcd clusters by name (like `etcd:` without `root`; `etcd:` is the coord
    /// cluster, `coord`), `docs/SCALE.md`. Default none: one cluster backs both tiers.
    #[serde(default)]
    pub clusters: std::collections::BTreeMap<String, crate::topology::RawCluster>,
    /// The entity tier's clusters for the first shard map (`tiers.entity`).
    pub tiers: Option<crate::topology::RawTiers>,
    /// The region of this arbiter and the home region of each namespace (ADR-08).
    pub region: Option<crate::topology::RawRegion>,
    /// Fail-open classes (ADR-04, `docs/GUARANTEES.md`): where unprotected grants
    /// are spooled and when a quorum loss is declared. Default: the spool beside
    /// `marks_file`, 16 MiB, 3000 ms.
    pub fail_open: Option<RawFailOpen>,
    /// TEST ONLY: planted bugs for the release gate (`docs/GATE.md`):
    /// `skip_epoch_compare`, `release_by_key_name`, `count_before_lock`. Refused
    /// unless the environment sets `LOCKMESH_TEST_FAULTS=1`. Default none.
    #[serde(default)]
    pub test_faults: Vec<String>,
}

/// Fail-open classes (`fail_open:`, ADR-04).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFailOpen {
    /// The spool of unprotected grants: a local append-only file, fsynced before a
    /// grant is answered. Put it on a volume that survives restarts. Other etcd
    /// clusters (`clusters:`) get `<spool_file>.<cluster>`. Default
    /// `unprotected.spool` beside `marks_file`.
    pub spool_file: Option<String>,
    /// Size cap of one spool, bytes: a grant that would pass it is refused
    /// (`spool_full`). Default 16 MiB (4096 to 1 GiB).
    pub max_spool_bytes: Option<u64>,
    /// How long linearizable reads must have failed, with no member reporting a
    /// leader, before the quorum loss is declared and fail-open classes grant from
    /// memory. Default 3000 (1000 to 60000).
    pub quorum_loss_after_ms: Option<u64>,
    /// How long a seal check's read and member probe wait for etcd before the
    /// check counts as failed (the operation timeout if shorter). Default 2000
    /// (200 to 60000).
    pub check_timeout_ms: Option<u64>,
}

/// Default `fail_open.max_spool_bytes`.
pub const DEFAULT_MAX_SPOOL_BYTES: u64 = 16 * 1024 * 1024;
/// Default `fail_open.quorum_loss_after_ms`.
pub const DEFAULT_QUORUM_LOSS_AFTER_MS: u64 = 3000;
/// Default `fail_open.check_timeout_ms` (`lock::failopen::quorum::CHECK_TIMEOUT`).
pub const DEFAULT_CHECK_TIMEOUT_MS: u64 = 2000;

/// Validated `fail_open`.
#[derive(Debug, Clone)]
pub struct FailOpenConfig {
    /// The coord cluster's spool; `None` when neither `spool_file` nor
    /// `marks_file` is set (fail-open classes then fail closed).
    pub spool_file: Option<PathBuf>,
    /// Size cap per spool, bytes.
    pub max_spool_bytes: u64,
    /// Declaration delay, ms.
    pub quorum_loss_after_ms: u64,
    /// A seal check's wait for etcd, ms.
    pub check_timeout_ms: u64,
}

fn fail_open(
    raw: Option<&RawFailOpen>,
    marks_file: Option<&Path>,
    base: &Path,
    name: &str,
    errs: &mut Vec<String>,
) -> FailOpenConfig {
    let spool_file = match raw.and_then(|r| r.spool_file.as_deref()) {
        Some(p) => {
            let p = resolve(base, p);
            if p.parent().is_some_and(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
                errs.push(format!(
                    "{name}: fail_open.spool_file: {:?}: its directory does not exist",
                    p.display().to_string()
                ));
            }
            Some(p)
        }
        None => marks_file.map(|m| m.with_file_name("unprotected.spool")),
    };
    let max_spool_bytes = raw.and_then(|r| r.max_spool_bytes).unwrap_or(DEFAULT_MAX_SPOOL_BYTES);
    if !(4096..=1 << 30).contains(&max_spool_bytes) {
        errs.push(format!("{name}: fail_open.max_spool_bytes: {max_spool_bytes} is outside 4096 to 1073741824"));
    }
    let quorum_loss_after_ms = raw.and_then(|r| r.quorum_loss_after_ms).unwrap_or(DEFAULT_QUORUM_LOSS_AFTER_MS);
    if !(1000..=60_000).contains(&quorum_loss_after_ms) {
        errs.push(format!("{name}: fail_open.quorum_loss_after_ms: {quorum_loss_after_ms} is outside 1000 to 60000"));
    }
    let check_timeout_ms = raw.and_then(|r| r.check_timeout_ms).unwrap_or(DEFAULT_CHECK_TIMEOUT_MS);
    if !(200..=60_000).contains(&check_timeout_ms) {
        errs.push(format!("{name}: fail_open.check_timeout_ms: {check_timeout_ms} is outside 200 to 60000"));
    }
    FailOpenConfig { spool_file, max_spool_bytes, quorum_loss_after_ms, check_timeout_ms }
}

/// Two-person admin actions (`operators:`, `docs/ADMIN.md`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOperators {
    /// SPIFFE IDs (URI SAN) of the admin tooling (`lockctl admin`'s client
    /// certificate) allowed to call the admin routes on the ext_proc port. Never an
    /// Envoy of `tls.allowed_clients`.
    pub allowed_clients: Vec<String>,
    /// The identity provider's JWKS (JSON file), re-read on every admin call so a
    /// rotated key applies without a restart.
    pub jwks_file: String,
    /// Required `iss`.
    pub issuer: String,
    /// Required `aud`. Default `lockmesh-admin`.
    pub audience: Option<String>,
    /// Required role in `roles` or `realm_access.roles`. Default `lock-operator`;
    /// `""` for none.
    pub role: Option<String>,
    /// Require an MFA sign-in (`amr`). Default true; false is logged as a warning
    /// at every start and reported by `lockctl doctor`.
    pub require_mfa: Option<bool>,
    /// Freshness: a token's `iat` must be at most this many seconds old. Default
    /// 900; 0 turns the check off.
    pub max_token_age_s: Option<u64>,
    /// Longest approval window a request may ask for, seconds. Default 86400.
    pub max_request_ttl_s: Option<u64>,
    /// How long a force release's record stays in etcd, seconds (it rides on a
    /// lease; the audit store keeps it for good). Default 30 days; 1 to 366 days.
    pub force_record_retention_s: Option<u64>,
}

/// The console (`console:`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConsole {
    /// The audit tailer's query port (`https://host:port`, its `query.listen`),
    /// whose query API feeds the recent-events panel. Without it the panel says
    /// that no audit store is configured.
    pub audit_url: Option<String>,
    /// The client certificate the console presents to the query port (its SPIFFE
    /// ID must be in the tailer's `query.allowed_clients`) and the CA of the
    /// port's certificate. Required with `audit_url`.
    pub audit_tls: Option<RawConsoleAuditTls>,
    /// Recent audit events shown. Default 20 (1 to 200).
    pub audit_events: Option<usize>,
    /// The Grafana dashboard the page links to (`http://` or `https://`), e.g.
    /// deploy/monitoring's `https://grafana.example/d/lockmesh-overview`.
    pub grafana_url: Option<String>,
    /// Seconds between two samples of the console's history (its plots keep 360
    /// samples: an hour at the default 10; 1 to 60).
    pub history_interval_s: Option<u64>,
    /// The networks whose peers the console API answers (CIDRs). The admin port
    /// is plain HTTP, so by default only loopback peers (`kubectl port-forward`
    /// arrives on the pod's loopback): an operator token never crosses the pod
    /// network in clear. Default `["127.0.0.0/8", "::1/128"]`.
    pub api_from: Option<Vec<String>>,
}

/// `console.audit_tls`: PEM file paths, relative to the config file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConsoleAuditTls {
    /// CA bundle that signed the query port's certificate.
    pub ca: String,
    /// The console's client certificate.
    pub cert: String,
    /// Its key.
    pub key: String,
}

/// Validated `console`.
#[derive(Debug, Clone)]
pub struct Console {
    /// The audit tailer's query port, if any.
    pub audit_url: Option<String>,
    /// CA, client certificate and key for the query port (resolved paths).
    pub audit_tls: Option<ConsoleAuditTls>,
    /// Recent audit events shown.
    pub audit_events: usize,
    /// The Grafana dashboard the page links to, if any.
    pub grafana_url: Option<String>,
    /// Time between two samples of the console's history.
    pub history_interval: std::time::Duration,
    /// The networks whose peers the console API answers.
    pub api_from: Vec<ipnet::IpNet>,
}

impl Default for Console {
    fn default() -> Self {
        Self {
            audit_url: None,
            audit_tls: None,
            audit_events: DEFAULT_CONSOLE_AUDIT_EVENTS,
            grafana_url: None,
            history_interval: std::time::Duration::from_secs(DEFAULT_CONSOLE_HISTORY_INTERVAL_S),
            api_from: default_console_api_from(),
        }
    }
}

/// Default `console.api_from`: loopback only.
pub fn default_console_api_from() -> Vec<ipnet::IpNet> {
    ["127.0.0.0/8", "::1/128"].iter().filter_map(|n| n.parse().ok()).collect()
}

/// Validated `console.audit_tls`.
#[derive(Debug, Clone)]
pub struct ConsoleAuditTls {
    /// CA bundle of the query port's certificate.
    pub ca: PathBuf,
    /// The console's client certificate.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
}

/// Default `console.audit_events`.
pub const DEFAULT_CONSOLE_AUDIT_EVENTS: usize = 20;
/// Default `console.history_interval_s`.
pub const DEFAULT_CONSOLE_HISTORY_INTERVAL_S: u64 = 10;
/// Longest `console.grafana_url`.
const MAX_GRAFANA_URL: usize = 2048;

/// The problem with `console.grafana_url` `u`, if any: an `http://` or `https://`
/// URL with a host, at most 2048 bytes, without spaces, quotes, angle brackets or
/// control characters (the page puts it in a link's `href`).
fn grafana_url_problem(u: &str) -> Option<&'static str> {
    let rest = u.strip_prefix("https://").or_else(|| u.strip_prefix("http://"));
    let host = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or_default());
    if host.is_none_or(str::is_empty) {
        Some("must be an http:// or https:// URL with a host")
    } else if u.len() > MAX_GRAFANA_URL {
        Some("is longer than 2048 bytes")
    } else if u.chars().any(|c| c.is_control() || c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '\\')) {
        Some("holds a space, quote, angle bracket, backslash or control character")
    } else {
        None
    }
}

fn console(raw: Option<&RawConsole>, base: &Path, name: &str, errs: &mut Vec<String>) -> Console {
    let Some(raw) = raw else {
        return Console::default();
    };
    let api_from = match &raw.api_from {
        None => default_console_api_from(),
        Some(nets) => {
            if nets.is_empty() {
                errs.push(format!("{name}: console.api_from: empty: the console API would answer no one"));
            }
            nets.iter()
                .filter_map(|n| match n.parse::<ipnet::IpNet>() {
                    Ok(net) => Some(net.trunc()),
                    Err(e) => {
                        errs.push(format!("{name}: console.api_from: {n:?} is not a CIDR (e.g. 10.0.0.0/8): {e}"));
                        None
                    }
                })
                .collect()
        }
    };
    if let Some(u) = &raw.audit_url {
        let hostport = u.strip_prefix("https://").map(|h| h.trim_end_matches('/'));
        if hostport.is_none_or(|h| h.is_empty() || h.contains('/')) {
            errs.push(format!(
                "{name}: console.audit_url: {u:?} must be https://host:port (the tailer's query.listen; its metrics \
                 port answers no query)"
            ));
        }
    }
    let audit_tls = raw.audit_tls.as_ref().map(|t| ConsoleAuditTls {
        ca: resolve(base, &t.ca),
        cert: resolve(base, &t.cert),
        key: resolve(base, &t.key),
    });
    match (&raw.audit_url, &audit_tls) {
        (Some(_), None) => errs.push(format!(
            "{name}: console.audit_tls: required with audit_url (the query port admits client certificates only)"
        )),
        (None, Some(_)) => errs.push(format!("{name}: console.audit_tls: set without audit_url")),
        _ => {}
    }
    for (field, p) in audit_tls.iter().flat_map(|t| [("ca", &t.ca), ("cert", &t.cert), ("key", &t.key)]) {
        if !p.is_file() {
            errs.push(format!("{name}: console.audit_tls.{field}: {} is not a readable file", p.display()));
        }
    }
    let audit_events = raw.audit_events.unwrap_or(DEFAULT_CONSOLE_AUDIT_EVENTS);
    if !(1..=200).contains(&audit_events) {
        errs.push(format!("{name}: console.audit_events: {audit_events} is outside 1 to 200"));
    }
    if let Some(problem) = raw.grafana_url.as_deref().and_then(grafana_url_problem) {
        errs.push(format!("{name}: console.grafana_url: {problem}"));
    }
    let interval_s = raw.history_interval_s.unwrap_or(DEFAULT_CONSOLE_HISTORY_INTERVAL_S);
    if !(1..=60).contains(&interval_s) {
        errs.push(format!("{name}: console.history_interval_s: {interval_s} is outside 1 to 60"));
    }
    Console {
        audit_url: raw.audit_url.clone(),
        audit_tls,
        audit_events,
        grafana_url: raw.grafana_url.clone(),
        history_interval: std::time::Duration::from_secs(interval_s),
        api_from,
    }
}

/// Grant proof signing (`docs/FENCING.md`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSigning {
    /// PKCS#8 PEM Ed25519 private key (`openssl genpkey -algorithm ed25519`).
    pub key_file: String,
    /// Key id fences look the public key up by: 1-32 characters of `[a-z0-9_-]`.
    pub key_id: String,
}

/// TLS settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    /// PEM server certificate chain.
    pub cert: String,
    /// PEM private key.
    pub key: String,
    /// PEM CA bundle that client certificates must chain to.
    pub client_ca: String,
    /// How often the three files are re-read, ms (a directory swap by the SPIFFE
    /// helper or a Kubernetes secret volume; `lockmesh_runtime::certs`). New
    /// handshakes use the new set; established connections keep theirs. 0: read
    /// once at start. Default 5000.
    #[serde(default)]
    pub reload_ms: Option<u64>,
    /// Vouching clients: exact SPIFFE IDs (URI SAN) of the Envoys outside every
    /// workload pod (the lock tier, a gateway). The caller identity they claim in
    /// ext_proc attributes is believed. Default none; with `self_clients` at least
    /// one entry in all.
    #[serde(default)]
    pub allowed_clients: Vec<String>,
    /// Self clients: in-pod sidecars (the inbound sidecar, an Istio sidecar) that
    /// present the pod's own SVID. Their holds are authorised and recorded under
    /// their own SPIFFE ID, whatever caller they claim (kept as unverified). Exact
    /// IDs or patterns whose `*` segments match one path segment each
    /// (`spiffe://td/ns/*/sa/*`). Default none. A client in neither list is refused.
    #[serde(default)]
    pub self_clients: Vec<String>,
}

/// A `tls.self_clients` entry: an exact SPIFFE ID, or one with `*` for whole path
/// segments (never in the trust domain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelfClient(String);

/// How the arbiter treats an ext_proc client (`tls.allowed_clients`, `tls.self_clients`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKind {
    /// An Envoy outside every workload pod: its claimed caller identity is believed.
    Vouching,
    /// An in-pod sidecar: it acts under its own SPIFFE ID only.
    SelfClient,
}

// === impl SelfClient ===

impl SelfClient {
    /// Parses an entry; the error says what is wrong with it.
    pub fn parse(s: &str) -> Result<Self, String> {
        let Some(rest) = s.strip_prefix("spiffe://") else {
            return Err("is not a spiffe:// URI".into());
        };
        let mut segs = rest.split('/');
        let td = segs.next().unwrap_or_default();
        if td.is_empty() || td.contains('*') {
            return Err("needs a literal trust domain (a pattern never spans trust domains)".into());
        }
        for seg in segs {
            if seg.is_empty() {
                return Err("has an empty path segment".into());
            }
            if seg.contains('*') && seg != "*" {
                return Err("may use * only as a whole path segment".into());
            }
        }
        Ok(SelfClient(s.to_owned()))
    }

    /// True when `id` is this entry, or matches it segment by segment.
    pub fn matches(&self, id: &str) -> bool {
        let (mut p, mut i) = (self.0.split('/'), id.split('/'));
        loop {
            match (p.next(), i.next()) {
                (None, None) => return true,
                (Some("*"), Some(seg)) if !seg.is_empty() => {}
                (Some(a), Some(b)) if a == b => {}
                _ => return false,
            }
        }
    }

    /// The entry as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Default `operators.max_token_age_s`.
pub const DEFAULT_MAX_TOKEN_AGE_S: u64 = 900;
/// Default `operators.max_request_ttl_s`.
pub const DEFAULT_MAX_REQUEST_TTL_S: u64 = 86_400;
/// Default `operators.force_record_retention_s`: 30 days.
pub const DEFAULT_FORCE_RECORD_RETENTION_S: u64 = 30 * 86_400;

/// Validated `operators`.
#[derive(Debug, Clone)]
pub struct Operators {
    /// SPIFFE IDs allowed to call the admin routes.
    pub allowed_clients: Vec<String>,
    /// JWKS file (re-read on every call).
    pub jwks_file: PathBuf,
    /// Required `iss`.
    pub issuer: String,
    /// Required `aud`.
    pub audience: String,
    /// Required role, if any.
    pub role: Option<String>,
    /// Every operator token must come from an MFA sign-in (`amr`).
    pub require_mfa: bool,
    /// Token freshness bound, seconds (`None`: off).
    pub max_token_age_s: Option<u64>,
    /// Longest approval window, seconds.
    pub max_request_ttl_s: u64,
    /// Lease TTL of each force-release record, seconds.
    pub force_record_retention_s: u64,
}

impl Operators {
    /// The safeguards this section turns off, in words (empty when none is):
    /// printed at every start, answered in `/status` and flagged by `lockctl doctor`.
    pub fn weakened(&self) -> Vec<String> {
        let mut w = Vec::new();
        if !self.require_mfa {
            w.push("operators.require_mfa is false: operator tokens without an MFA sign-in (amr) are accepted".into());
        }
        if self.max_token_age_s.is_none() {
            w.push("operators.max_token_age_s is 0: operator tokens of any sign-in age are accepted".into());
        }
        w
    }

    /// A verifier for operators' tokens with the JWKS as the file holds it now.
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

fn operators(raw: &RawOperators, envoys: &[String], base: &Path, name: &str, errs: &mut Vec<String>) -> Operators {
    if raw.allowed_clients.is_empty() {
        errs.push(format!(
            "{name}: operators.allowed_clients: must name at least one SPIFFE ID (lockctl's certificate)"
        ));
    }
    for (i, c) in raw.allowed_clients.iter().enumerate() {
        if !c.starts_with("spiffe://") {
            errs.push(format!("{name}: operators.allowed_clients[{i}]: {c:?} is not a spiffe:// URI"));
        } else if envoys.contains(c) {
            errs.push(format!(
                "{name}: operators.allowed_clients[{i}]: {c:?} is an Envoy (tls.allowed_clients); admin tooling needs its own identity"
            ));
        }
    }
    let jwks_file = resolve(base, &raw.jwks_file);
    match std::fs::read_to_string(&jwks_file) {
        Ok(t) => {
            if let Err(e) = lockmesh_ops::admin::jwt::Jwks::parse(&t) {
                errs.push(format!("{name}: operators.jwks_file: {e}"));
            }
        }
        Err(e) => errs.push(format!("{name}: operators.jwks_file: cannot read {:?}: {e}", raw.jwks_file)),
    }
    if raw.issuer.is_empty() {
        errs.push(format!("{name}: operators.issuer: must not be empty"));
    }
    let audience = raw.audience.clone().unwrap_or_else(|| "lockmesh-admin".into());
    if audience.is_empty() {
        errs.push(format!("{name}: operators.audience: must not be empty"));
    }
    let max_request_ttl_s = raw.max_request_ttl_s.unwrap_or(DEFAULT_MAX_REQUEST_TTL_S);
    if !(60..=30 * 86_400).contains(&max_request_ttl_s) {
        errs.push(format!("{name}: operators.max_request_ttl_s: {max_request_ttl_s} is outside 60 to 2592000"));
    }
    let max_token_age_s = raw.max_token_age_s.unwrap_or(DEFAULT_MAX_TOKEN_AGE_S);
    if max_token_age_s > 86_400 {
        errs.push(format!("{name}: operators.max_token_age_s: {max_token_age_s} is above 86400"));
    }
    let force_record_retention_s = raw.force_record_retention_s.unwrap_or(DEFAULT_FORCE_RECORD_RETENTION_S);
    if !(86_400..=366 * 86_400).contains(&force_record_retention_s) {
        errs.push(format!(
            "{name}: operators.force_record_retention_s: {force_record_retention_s} is outside 86400 to 31622400 (1 to 366 days)"
        ));
    }
    Operators {
        allowed_clients: raw.allowed_clients.clone(),
        jwks_file,
        issuer: raw.issuer.clone(),
        audience,
        role: Some(raw.role.clone().unwrap_or_else(|| "lock-operator".into())).filter(|r| !r.is_empty()),
        require_mfa: raw.require_mfa.unwrap_or(true),
        max_token_age_s: Some(max_token_age_s).filter(|s| *s > 0),
        max_request_ttl_s,
        force_record_retention_s,
    }
}

/// Validates `tls.allowed_clients` and `tls.self_clients`, returning the latter.
fn self_clients(tls: &RawTls, name: &str, errs: &mut Vec<String>) -> Vec<SelfClient> {
    if tls.allowed_clients.is_empty() && tls.self_clients.is_empty() {
        errs.push(format!("{name}: tls.allowed_clients: must name at least one client (here, or in tls.self_clients)"));
    }
    for (i, c) in tls.allowed_clients.iter().enumerate() {
        if !c.starts_with("spiffe://") {
            errs.push(format!("{name}: tls.allowed_clients[{i}]: {c:?} is not a spiffe:// URI"));
        } else if c.contains('*') {
            errs.push(format!(
                "{name}: tls.allowed_clients[{i}]: {c:?}: a vouching client is an exact SPIFFE ID, never a pattern"
            ));
        }
    }
    let parsed: Vec<SelfClient> = tls
        .self_clients
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            SelfClient::parse(c).map_err(|e| errs.push(format!("{name}: tls.self_clients[{i}]: {c:?} {e}"))).ok()
        })
        .collect();
    for (i, c) in tls.allowed_clients.iter().enumerate() {
        if let Some(p) = parsed.iter().find(|p| p.matches(c)) {
            errs.push(format!(
                "{name}: tls.allowed_clients[{i}]: {c:?} is also a self client ({:?}): a client is one or the other",
                p.as_str()
            ));
        }
    }
    parsed
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// ext_proc listen address.
    pub listen: SocketAddr,
    /// Admin listen address.
    pub admin_listen: SocketAddr,
    /// Server certificate PEM.
    pub tls_cert: Vec<u8>,
    /// Server key PEM.
    pub tls_key: Vec<u8>,
    /// Client CA PEM.
    pub client_ca: Vec<u8>,
    /// The listener's certificate, key and client CA files, re-read every
    /// `tls_reload` (zero: never).
    pub tls_files: lockmesh_runtime::CertFiles,
    /// `tls.reload_ms`.
    pub tls_reload: std::time::Duration,
    /// Vouching clients' SPIFFE IDs (`tls.allowed_clients`).
    pub allowed_clients: Vec<String>,
    /// Self clients (`tls.self_clients`).
    pub self_clients: Vec<SelfClient>,
    /// etcd endpoints.
    pub etcd_endpoints: Vec<String>,
    /// Key root, no trailing slash.
    pub etcd_root: String,
    /// etcd call timeout.
    pub op_timeout_ms: u64,
    /// Grants and releases per etcd transaction, and etcd's limits (`etcd.max_group`).
    pub group: lockmesh_lock::GroupLimits,
    /// etcd TLS and user.
    pub etcd_auth: EtcdClientAuth,
    /// More clusters, the entity tier and regional homing (`crate::topology`).
    pub topology: crate::topology::Topology,
    /// The registry's path: the file, or the manifest directory (`registry_dir`);
    /// [`Config::registry_source`] says which.
    pub registry_file: PathBuf,
    /// Where the registry is read from at startup and by the hot reload.
    pub registry_source: crate::registry::RegistrySource,
    /// The registry as loaded at startup.
    pub registry: ClassRegistry,
    /// Longest wait.
    pub max_wait_ms: u64,
    /// One-transaction hand-off on release.
    pub handoff: bool,
    /// The hand-off chain's grace for a late offer, ms.
    pub handoff_grace_ms: u64,
    /// Durable marks file.
    pub marks_file: Option<PathBuf>,
    /// Grant proof signer, if configured.
    pub signing: Option<crate::signing::Signer>,
    /// ValidateToken rate, requests per second.
    pub validate_rate_per_s: u32,
    /// TEST ONLY planted bugs (see `RawConfig::test_faults`).
    pub test_faults: Vec<crate::test_faults::TestFault>,
    /// Two-person admin actions, if configured.
    pub operators: Option<Operators>,
    /// OTLP span export, if configured.
    pub telemetry: Option<crate::telemetry::Telemetry>,
    /// The console.
    pub console: Console,
    /// Fail-open classes: the spool and the quorum-loss declaration.
    pub fail_open: FailOpenConfig,
}

/// `tls.reload_ms` unless set: as often as the audit tailer's query port re-reads its set.
pub const DEFAULT_TLS_RELOAD_MS: u64 = 5000;

pub(crate) fn resolve(base: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_owned()
    } else {
        base.join(p)
    }
}

/// The registry's source: exactly one of `registry_file` and `registry_dir`
/// (a directory), `registry_platform` with `registry_dir` only. `None` after an
/// error.
fn registry_source(
    raw: &RawConfig,
    base: &Path,
    name: &str,
    errs: &mut Vec<String>,
) -> Option<crate::registry::RegistrySource> {
    use crate::registry::RegistrySource;
    match (&raw.registry_file, &raw.registry_dir) {
        (Some(_), Some(_)) => {
            errs.push(format!(
                "{name}: registry_dir: give registry_file (one registry YAML) or registry_dir (a directory of \
                 LockClass/LockGrant manifests), not both"
            ));
            None
        }
        (None, None) => {
            errs.push(format!("{name}: registry_file: required (or registry_dir)"));
            None
        }
        (Some(f), None) => {
            if raw.registry_platform.is_some() {
                errs.push(format!(
                    "{name}: registry_platform: only with registry_dir (a registry file carries its own platform:)"
                ));
            }
            if raw.registry_quotas.is_some() {
                errs.push(format!(
                    "{name}: registry_quotas: only with registry_dir (a registry file carries its own quotas:)"
                ));
            }
            Some(RegistrySource::File(resolve(base, f)))
        }
        (None, Some(d)) => {
            let dir = resolve(base, d);
            if !dir.is_dir() {
                errs.push(format!("{name}: registry_dir: {} is not a directory", dir.display()));
                return None;
            }
            Some(RegistrySource::Dir {
                dir,
                platform: raw.registry_platform.clone().unwrap_or_default(),
                quotas: raw.registry_quotas.clone().unwrap_or_default(),
            })
        }
    }
}

/// Loads and validates a registry file; errors are `file: path: message`.
pub fn load_registry(path: &Path) -> Result<ClassRegistry, Vec<String>> {
    crate::registry::load(path)
}

// === impl Config ===

impl Config {
    /// The operator safeguards this configuration weakens ([`Operators::weakened`]).
    pub fn weakened(&self) -> Vec<String> {
        self.operators.as_ref().map(Operators::weakened).unwrap_or_default()
    }

    /// What connecting every cluster needs (`lockmesh_lock::tiers::Tiers::connect`).
    pub fn tiers_config(&self) -> lockmesh_lock::tiers::TiersConfig<'_> {
        lockmesh_lock::tiers::TiersConfig {
            topology: &self.topology,
            root: &self.etcd_root,
            op_timeout: std::time::Duration::from_millis(self.op_timeout_ms),
            marks_file: self.marks_file.as_deref(),
            fail_open: lockmesh_lock::tiers::FailOpenSettings {
                spool_file: self.fail_open.spool_file.as_deref(),
                max_spool_bytes: self.fail_open.max_spool_bytes,
                quorum_loss_after_ms: self.fail_open.quorum_loss_after_ms,
                check_timeout_ms: self.fail_open.check_timeout_ms,
            },
            group: self.group,
        }
    }

    /// How the ext_proc client with SPIFFE ID `id` is treated; `None`: refused.
    pub fn client_kind(&self, id: &str) -> Option<ClientKind> {
        if self.allowed_clients.iter().any(|c| c == id) {
            Some(ClientKind::Vouching)
        } else if self.self_clients.iter().any(|c| c.matches(id)) {
            Some(ClientKind::SelfClient)
        } else {
            None
        }
    }

    /// Who may call ext_proc and how far each is believed, in words (`--check-config`).
    pub fn clients_summary(&self) -> Vec<String> {
        let list = |v: Vec<&str>| if v.is_empty() { "none".to_owned() } else { v.join(", ") };
        vec![
            format!(
                "vouching clients (their callers' identities are believed): {}",
                list(self.allowed_clients.iter().map(String::as_str).collect())
            ),
            format!(
                "self clients (act under their own identity only): {}",
                list(self.self_clients.iter().map(SelfClient::as_str).collect())
            ),
        ]
    }

    /// Reads, parses and validates `path`, collecting every error.
    pub fn load(path: &Path) -> Result<Self, Vec<String>> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| vec![format!("{name}: cannot read: {e}")])?;
        let raw: RawConfig = lockmesh_runtime::parse_yaml(&text).map_err(|e| vec![format!("{name}: {e}")])?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::try_from_raw(raw, base, &name)
    }

    /// Validates a parsed file.
    pub fn try_from_raw(raw: RawConfig, base: &Path, name: &str) -> Result<Self, Vec<String>> {
        let mut errs = Vec::new();
        let mut err = |field: &str, msg: String| errs.push(format!("{name}: {field}: {msg}"));
        let listen = raw
            .listen
            .parse::<SocketAddr>()
            .map_err(|e| err("listen", format!("{:?} is not host:port: {e}", raw.listen)));
        let admin_listen = raw
            .admin_listen
            .parse::<SocketAddr>()
            .map_err(|e| err("admin_listen", format!("{:?} is not host:port: {e}", raw.admin_listen)));
        let mut read = |field: &str, p: &str| {
            std::fs::read(resolve(base, p))
                .map_err(|e| err(field, format!("cannot read {p:?}: {e}")))
                .unwrap_or_default()
        };
        let tls_cert = read("tls.cert", &raw.tls.cert);
        let tls_key = read("tls.key", &raw.tls.key);
        let client_ca = read("tls.client_ca", &raw.tls.client_ca);
        let mut errs2 = Vec::new();
        let self_clients = self_clients(&raw.tls, name, &mut errs2);
        // The cluster sections, validated as `lockctl shard` validates them.
        let clusters = Clusters::from_raw(
            &raw.etcd,
            &raw.clusters,
            raw.tiers.as_ref(),
            raw.region.as_ref(),
            &raw.test_faults,
            base,
            name,
            &mut errs2,
        );
        let max_wait_ms = raw.max_wait_ms.unwrap_or(DEFAULT_MAX_WAIT_MS);
        if max_wait_ms > MAX_WAIT_CEILING_MS {
            errs2.push(format!("{name}: max_wait_ms: {max_wait_ms} is above the ceiling {MAX_WAIT_CEILING_MS}"));
        }
        let signing = raw.signing.as_ref().and_then(|sg| {
            crate::signing::Signer::load(&resolve(base, &sg.key_file), &sg.key_id)
                .map_err(|e| errs2.push(format!("{name}: signing.{e}")))
                .ok()
        });
        let handoff_grace_ms = raw.handoff_grace_ms.unwrap_or(DEFAULT_HANDOFF_GRACE_MS);
        if handoff_grace_ms > 1000 {
            errs2.push(format!("{name}: handoff_grace_ms: {handoff_grace_ms} is above 1000"));
        }
        let validate_rate_per_s = raw.validate_rate_per_s.unwrap_or(DEFAULT_VALIDATE_RATE_PER_S);
        if !(1..=100_000).contains(&validate_rate_per_s) {
            errs2.push(format!("{name}: validate_rate_per_s: {validate_rate_per_s} is outside 1 to 100000"));
        }
        let operators = raw.operators.as_ref().map(|o| operators(o, &raw.tls.allowed_clients, base, name, &mut errs2));
        let telemetry = crate::telemetry::validate(raw.telemetry.as_ref(), "lockmesh-arbiter", name, &mut errs2);
        let console = console(raw.console.as_ref(), base, name, &mut errs2);
        let registry_source = registry_source(&raw, base, name, &mut errs2);
        let registry_file = registry_source.as_ref().map(|s| s.path().to_owned()).unwrap_or_default();
        let registry = match &registry_source {
            Some(source) => source.load().map_err(|e| {
                errs2.push(format!("{name}: {}:", source.field()));
                errs2.extend(e.into_iter().map(|m| format!("  {m}")));
            }),
            None => Err(()),
        };
        let marks_file = raw.marks_file.map(|p| resolve(base, &p));
        let fail_open = fail_open(raw.fail_open.as_ref(), marks_file.as_deref(), base, name, &mut errs2);
        if let (Ok(reg), false) = (&registry, self_clients.is_empty()) {
            if reg.grants().is_none() {
                errs2.push(format!(
                    "{name}: tls.self_clients: the registry carries no LockGrant documents: the arbiter alone decides \
                     what a self client may lock (its in-pod filter is not trusted), so it needs them"
                ));
            }
        }
        if let Ok(reg) = &registry {
            let open = reg.classes().iter().find(|c| c.on_quorum_loss == lockmesh_core::class::OnQuorumLoss::Open);
            if let (Some(c), None) = (open, &fail_open.spool_file) {
                errs2.push(format!(
                    "{name}: fail_open.spool_file: required: class {} declares on_quorum_loss open and there is no \
                     marks_file to put the spool beside",
                    c.name
                ));
            }
        }
        errs.extend(errs2);
        match (listen, admin_listen, registry, registry_source) {
            (Ok(listen), Ok(admin_listen), Ok(registry), Some(registry_source)) if errs.is_empty() => Ok(Config {
                listen,
                admin_listen,
                tls_cert,
                tls_key,
                client_ca,
                tls_files: lockmesh_runtime::CertFiles {
                    cert: resolve(base, &raw.tls.cert),
                    key: resolve(base, &raw.tls.key),
                    ca: resolve(base, &raw.tls.client_ca),
                },
                tls_reload: std::time::Duration::from_millis(raw.tls.reload_ms.unwrap_or(DEFAULT_TLS_RELOAD_MS)),
                allowed_clients: raw.tls.allowed_clients,
                self_clients,
                etcd_endpoints: clusters.endpoints,
                etcd_root: clusters.root,
                op_timeout_ms: clusters.op_timeout_ms,
                group: clusters.group,
                etcd_auth: clusters.auth,
                topology: clusters.topology,
                registry_file,
                registry_source,
                registry,
                max_wait_ms,
                handoff: raw.handoff.unwrap_or(true),
                handoff_grace_ms,
                marks_file,
                signing,
                validate_rate_per_s,
                test_faults: clusters.test_faults,
                operators,
                telemetry,
                console,
                fail_open,
            }),
            _ => Err(errs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(yaml: &str) -> (Operators, Vec<String>) {
        let raw: RawOperators = serde_saphyr::from_str(yaml).unwrap();
        let mut errs = Vec::new();
        let o = operators(&raw, &[], Path::new("/nonexistent"), "arbiter.yaml", &mut errs);
        (o, errs)
    }

    const BASE: &str =
        "allowed_clients: [\"spiffe://t/ns/ops/sa/lockctl\"]\njwks_file: jwks.json\nissuer: https://idp\n";

    #[test]
    fn operator_safeguards_are_on_unless_turned_off_and_turning_them_off_is_said() {
        let (o, _) = ops(BASE);
        assert!(o.require_mfa, "MFA must be required by default");
        assert_eq!(o.max_token_age_s, Some(DEFAULT_MAX_TOKEN_AGE_S));
        assert_eq!(o.force_record_retention_s, DEFAULT_FORCE_RECORD_RETENTION_S);
        assert!(o.weakened().is_empty(), "{:?}", o.weakened());
        let (o, _) = ops(&format!("{BASE}require_mfa: false\nmax_token_age_s: 0\n"));
        let w = o.weakened();
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("require_mfa") && w[1].contains("max_token_age_s"), "{w:?}");
    }

    #[test]
    fn force_record_retention_is_bounded() {
        for bad in [0, 3600, 367 * 86_400] {
            let (_, errs) = ops(&format!("{BASE}force_record_retention_s: {bad}\n"));
            assert!(errs.iter().any(|e| e.contains("operators.force_record_retention_s")), "{bad}: {errs:?}");
        }
        let (o, errs) = ops(&format!("{BASE}force_record_retention_s: 86400\n"));
        assert!(!errs.iter().any(|e| e.contains("retention")), "{errs:?}");
        assert_eq!(o.force_record_retention_s, 86_400);
    }

    fn console_of(yaml: &str) -> (Console, Vec<String>) {
        let raw: RawConsole = serde_saphyr::from_str(yaml).unwrap();
        let mut errs = Vec::new();
        let c = console(Some(&raw), Path::new("/nonexistent"), "a.yaml", &mut errs);
        (c, errs)
    }

    #[test]
    fn the_grafana_link_is_an_http_url_and_the_history_interval_is_bounded() {
        let (c, errs) = console_of("grafana_url: https://grafana.example/d/lockmesh-overview?orgId=1\n");
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(c.grafana_url.as_deref(), Some("https://grafana.example/d/lockmesh-overview?orgId=1"));
        assert_eq!(c.history_interval, std::time::Duration::from_secs(DEFAULT_CONSOLE_HISTORY_INTERVAL_S));
        for bad in ["javascript:alert(1)", "https://", "ftp://x", "https://a/\"x\"", "https://a/<b>", "//grafana/d/x"] {
            let (_, errs) = console_of(&format!("grafana_url: '{bad}'\n"));
            assert!(errs.iter().any(|e| e.contains("console.grafana_url")), "{bad}: {errs:?}");
        }
        for bad in [0, 61] {
            let (_, errs) = console_of(&format!("history_interval_s: {bad}\n"));
            assert!(errs.iter().any(|e| e.contains("console.history_interval_s")), "{bad}: {errs:?}");
        }
        let (c, errs) = console_of("history_interval_s: 2\n");
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(c.history_interval, std::time::Duration::from_secs(2));
    }

    #[test]
    fn the_console_api_answers_loopback_unless_told_otherwise() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        let answers = |c: &Console, s: &str| c.api_from.iter().any(|n| n.contains(&ip(s)));
        for c in [Console::default(), console_of("grafana_url: https://g/d\n").0] {
            assert!(answers(&c, "127.0.0.1") && answers(&c, "127.9.9.9") && answers(&c, "::1"), "{:?}", c.api_from);
            assert!(
                !answers(&c, "10.0.0.7") && !answers(&c, "192.0.2.2") && !answers(&c, "fd00::2"),
                "{:?}",
                c.api_from
            );
        }
        let (c, errs) = console_of("api_from: [\"10.1.2.3/16\"]\n");
        assert!(errs.is_empty(), "{errs:?}");
        assert!(answers(&c, "10.1.200.1") && !answers(&c, "127.0.0.1"));
        for bad in ["[]", "[\"10.0.0.0\"]", "[\"nope/8\"]"] {
            let (_, errs) = console_of(&format!("api_from: {bad}\n"));
            assert!(errs.iter().any(|e| e.contains("console.api_from")), "{bad}: {errs:?}");
        }
    }

    fn tls(allowed: &[&str], own: &[&str]) -> RawTls {
        RawTls {
            cert: String::new(),
            key: String::new(),
            client_ca: String::new(),
            reload_ms: None,
            allowed_clients: allowed.iter().map(|s| (*s).to_owned()).collect(),
            self_clients: own.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn self_client_patterns_match_whole_segments_of_their_own_trust_domain() {
        let p = SelfClient::parse("spiffe://td/ns/*/sa/*").unwrap();
        assert!(p.matches("spiffe://td/ns/pay/sa/orders"));
        for other in [
            "spiffe://td/ns/pay/sa",
            "spiffe://td/ns/pay/sa/orders/x",
            "spiffe://td/ns//sa/orders",
            "spiffe://other/ns/pay/sa/orders",
            "spiffe://td/lockmesh/envoy",
        ] {
            assert!(!p.matches(other), "{other}");
        }
        let exact = SelfClient::parse("spiffe://td/ns/pay/sa/orders").unwrap();
        assert!(exact.matches("spiffe://td/ns/pay/sa/orders") && !exact.matches("spiffe://td/ns/pay/sa/other"));
        for bad in ["td/ns/*", "spiffe://*/ns/a", "spiffe:///ns/a", "spiffe://td/ns/a*", "spiffe://td//a"] {
            assert!(SelfClient::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_client_is_vouching_or_self_never_both_and_one_list_must_name_someone() {
        let mut errs = Vec::new();
        let own = self_clients(&tls(&["spiffe://td/lockmesh/envoy"], &["spiffe://td/ns/*/sa/*"]), "a.yaml", &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(own.len(), 1);
        let mut errs = Vec::new();
        self_clients(&tls(&["spiffe://td/ns/pay/sa/orders"], &["spiffe://td/ns/*/sa/*"]), "a.yaml", &mut errs);
        assert!(
            errs.iter().any(|e| e.contains("tls.allowed_clients[0]") && e.contains("also a self client")),
            "{errs:?}"
        );
        let mut errs = Vec::new();
        self_clients(&tls(&[], &[]), "a.yaml", &mut errs);
        assert!(errs.iter().any(|e| e.contains("must name at least one client")), "{errs:?}");
        // The Istio shape: self clients only.
        let mut errs = Vec::new();
        self_clients(&tls(&[], &["spiffe://td/ns/*/sa/*"]), "a.yaml", &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        let mut errs = Vec::new();
        self_clients(&tls(&["spiffe://td/ns/*/sa/envoy"], &["spiffe://td/ns/x*/sa/a"]), "a.yaml", &mut errs);
        assert!(errs.iter().any(|e| e.contains("never a pattern")), "{errs:?}");
        assert!(errs.iter().any(|e| e.contains("tls.self_clients[0]") && e.contains("whole path segment")), "{errs:?}");
    }
}
