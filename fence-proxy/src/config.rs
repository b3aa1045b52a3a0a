//! fence-proxy's configuration file (YAML, unknown fields refused).
//!
//! [`RawConfig`] (serde) becomes [`Config`] through validation that collects every
//! error, each prefixed with the file and field path
//! (`fence.yaml: routes[1].lock_key: ...`). `--check-config` runs the same code as
//! startup. Relative paths are relative to the config file.
//!
//! `listen`, `admin_listen`, `upstream` and `marks_dir` can be overridden by the
//! `LOCKMESH_FENCE_*` variables declared in [`mod@env`] (the injector sets them); a
//! field an override supplies may be left out of the file.
//!
//! ```yaml
//! listen: "0.0.0.0:8080"          # clients reach the store through this
//! admin_listen: "0.0.0.0:8081"    # /healthz /readyz /metrics
//! upstream: "http://127.0.0.1:9000"
//! marks_dir: /var/lib/lockmesh-fence   # a persistent volume, never scratch space
//! upstream_timeout_ms: 10000      # a write not answered by then: 504, resource quarantined
//! quarantine_ms: 30000            # until the store answers that write, at most this long
//! trusted_keys:
//!   - { key_id: k2026-01, public_key_file: /etc/lockmesh/grant-k2026-01.pub.pem }
//! routes:
//!   - name: items
//!     path: /items/{id}
//!     reads: [GET, HEAD]
//!     resource: "items/{id}"
//!     lock_key: "orders/items/{id}"
//!     equal: strict
//!     delete_body: refuse         # or allow: a DELETE may carry a body
//! ```

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use ed25519_dalek::{pkcs8::DecodePublicKey as _, VerifyingKey};
use lockmesh_core::proof::{KeyId, Verifier};
use serde::Deserialize;

use lockmesh_core::template::{PathTemplate, TextTemplate};

use crate::route::{DeleteBody, EqualRule, Route};

pub mod env;

use self::env::{EnvSource, Origin, ProcessEnv};

/// Default `upstream_timeout_ms`.
pub(crate) const DEFAULT_UPSTREAM_TIMEOUT_MS: u64 = 10_000;
/// Default `quarantine_ms`: three times the default `upstream_timeout_ms`.
pub(crate) const DEFAULT_QUARANTINE_MS: u64 = 30_000;
/// Default `max_body_bytes`.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Client-facing listen address, `host:port`. Required unless
    /// `LOCKMESH_FENCE_LISTEN` is set (which overrides it).
    #[serde(default)]
    pub listen: Option<String>,
    /// Admin listen address: `/healthz`, `/readyz`, `/metrics`. Required unless
    /// `LOCKMESH_FENCE_ADMIN_LISTEN` is set (which overrides it).
    #[serde(default)]
    pub admin_listen: Option<String>,
    /// The store, `http://host:port` (plain HTTP on a loopback or pod-local address).
    /// Required unless `LOCKMESH_FENCE_UPSTREAM` is set (which overrides it).
    #[serde(default)]
    pub upstream: Option<String>,
    /// Directory of the durable marks (a persistent volume). Created if missing.
    /// One fence-proxy process per directory: a second one is refused. Required
    /// unless `LOCKMESH_FENCE_MARKS_DIR` is set (which overrides it; a relative
    /// value is then relative to the working directory).
    #[serde(default)]
    pub marks_dir: Option<String>,
    /// Timeout of one forwarded request, ms. Default 10000.
    pub upstream_timeout_ms: Option<u64>,
    /// How long a resource stays quarantined (its writes refused with
    /// `503 fence_quarantined`) after a write to it timed out or lost its
    /// connection, ms, unless the store answers that write sooner. Default 30000.
    pub quarantine_ms: Option<u64>,
    /// Largest request body forwarded, bytes. Default 16 MiB.
    pub max_body_bytes: Option<usize>,
    /// Public keys that grant proofs may be signed with, by key id (several during
    /// a rotation). At least one.
    #[serde(default)]
    pub trusted_keys: Vec<RawTrustedKey>,
    /// Equal-token rule of routes that do not set one: `strict` (default) or `allow`.
    pub default_equal: Option<EqualRule>,
    /// Routes, matched in order; the first whose path template matches wins. At
    /// least one, unless `unlisted` guards every path.
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    /// Guard of every path no route matches. Without it such requests are refused
    /// (`403 unlisted_route`): an unlisted route is a write nobody can authorise.
    pub unlisted: Option<RawGuard>,
    /// TEST ONLY (the release gate's planted bug, docs/GATE.md): forward writes whose
    /// token is below the mark. Refused unless the environment sets
    /// `LOCKMESH_TEST_FAULTS=1`; never in a shipped config. Default false.
    #[serde(default)]
    pub accept_lower_tokens: bool,
}

/// A trusted public key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTrustedKey {
    /// The arbiter's `signing.key_id`.
    pub key_id: String,
    /// SPKI PEM Ed25519 public key (`-----BEGIN PUBLIC KEY-----`).
    pub public_key_file: String,
}

/// One `routes:` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    /// Name used in metrics labels and logs.
    pub name: String,
    /// Path template (`lockmesh_core::template`): `/` segments, literal or `{var}`
    /// (one whole segment); literal segments are in canonical form.
    pub path: String,
    /// Methods that are reads here (pass through). Every other method is a write.
    #[serde(default)]
    pub reads: Vec<String>,
    /// Resource id template (`{var}` from the path, `{header:name}` from a header).
    pub resource: String,
    /// Template of the lock key that guards the resource.
    pub lock_key: String,
    /// Equal-token rule: `strict` or `allow`. Default `default_equal`.
    pub equal: Option<EqualRule>,
    /// Whether a DELETE may carry a body: `refuse` (default) or `allow`.
    #[serde(default)]
    pub delete_body: DeleteBody,
}

/// The guard of unlisted routes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawGuard {
    /// Resource id (templates may use `{header:name}` only).
    pub resource: String,
    /// Lock key template.
    pub lock_key: String,
    /// Equal-token rule: `strict` or `allow`. Default `default_equal`.
    pub equal: Option<EqualRule>,
    /// Whether a DELETE may carry a body: `refuse` (default) or `allow`.
    #[serde(default)]
    pub delete_body: DeleteBody,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Client-facing listen address.
    pub listen: SocketAddr,
    /// Admin listen address.
    pub admin_listen: SocketAddr,
    /// `http://host:port` of the store, without a trailing slash.
    pub upstream: String,
    /// Directory of the marks database (`marks.redb`); one fence-proxy per directory.
    pub marks_dir: PathBuf,
    /// Forwarded request timeout.
    pub upstream_timeout: Duration,
    /// The longest a resource stays quarantined after a write's outcome was lost.
    pub quarantine: Duration,
    /// Largest request body forwarded, bytes.
    pub max_body_bytes: usize,
    /// Checks grant proofs against `trusted_keys`, by key id.
    pub verifier: Verifier,
    /// Routes in order.
    pub routes: Vec<Route>,
    /// Guard of unlisted routes.
    pub unlisted: Option<Route>,
    /// TEST ONLY planted bug: stale tokens are forwarded (see `RawConfig`).
    pub accept_lower_tokens: bool,
}

fn resolve(base: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() {
        p.to_owned()
    } else {
        base.join(p)
    }
}

// === impl Config ===

impl Config {
    /// Reads, parses and validates `path` with the process environment's
    /// overrides, collecting every error. What startup and `--check-config` run.
    pub fn load(path: &Path) -> Result<Self, Vec<String>> {
        Self::load_with(path, &ProcessEnv)
    }

    /// [`Config::load`] with the overrides taken from `env`.
    pub fn load_with(path: &Path, env: &dyn EnvSource) -> Result<Self, Vec<String>> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| vec![format!("{name}: cannot read: {e}")])?;
        let raw: RawConfig = lockmesh_runtime::parse_yaml(&text).map_err(|e| vec![format!("{name}: {e}")])?;
        Self::try_from_raw(raw, path.parent().unwrap_or(Path::new(".")), &name, env)
    }

    /// Validates a parsed file, applying the overrides of `env`.
    pub fn try_from_raw(raw: RawConfig, base: &Path, name: &str, env: &dyn EnvSource) -> Result<Self, Vec<String>> {
        let mut errs = Vec::new();
        // The four overridable fields: (value, how an error names it, origin).
        let mut field = |var: &str, fname: &str, file: &Option<String>| match env::pick(env, var, file.as_ref()) {
            Err(m) => {
                errs.push(format!("{var} (overrides {name}: {fname}): {m}"));
                None
            }
            Ok(None) => {
                errs.push(format!("{name}: {fname}: missing (set it in the file or in {var})"));
                None
            }
            Ok(Some((v, Origin::File))) => Some((v, format!("{name}: {fname}"), Origin::File)),
            Ok(Some((v, Origin::Env))) => Some((v, format!("{var} (overrides {name}: {fname})"), Origin::Env)),
        };
        let listen = field(env::LISTEN, "listen", &raw.listen);
        let admin_listen = field(env::ADMIN_LISTEN, "admin_listen", &raw.admin_listen);
        let upstream = field(env::UPSTREAM, "upstream", &raw.upstream);
        let marks_dir = field(env::MARKS_DIR, "marks_dir", &raw.marks_dir);
        let mut addr = |f: Option<(String, String, Origin)>| {
            let (v, at, _) = f?;
            v.parse::<SocketAddr>().map_err(|e| errs.push(format!("{at}: {v:?} is not host:port: {e}"))).ok()
        };
        let (listen, admin_listen) = (addr(listen), addr(admin_listen));
        let upstream = upstream.and_then(|(v, at, _)| {
            let u = v.trim_end_matches('/').to_owned();
            match u.strip_prefix("http://") {
                Some(hp) if !hp.is_empty() && !hp.contains('/') => Some(u),
                _ => {
                    errs.push(format!("{at}: {v:?} must be http://host:port (no path)"));
                    None
                }
            }
        });
        let marks_dir = marks_dir.and_then(|(v, at, origin)| {
            if v.trim().is_empty() {
                errs.push(format!("{at}: must name a directory on a persistent volume"));
                return None;
            }
            Some(if origin == Origin::Env { PathBuf::from(v) } else { resolve(base, &v) })
        });
        let mut err = |field: &str, msg: String| errs.push(format!("{name}: {field}: {msg}"));
        let timeout_ms = raw.upstream_timeout_ms.unwrap_or(DEFAULT_UPSTREAM_TIMEOUT_MS);
        if !(100..=600_000).contains(&timeout_ms) {
            err("upstream_timeout_ms", format!("{timeout_ms} is outside 100 to 600000"));
        }
        let quarantine_ms = raw.quarantine_ms.unwrap_or(DEFAULT_QUARANTINE_MS);
        if !(100..=3_600_000).contains(&quarantine_ms) {
            err("quarantine_ms", format!("{quarantine_ms} is outside 100 to 3600000"));
        }
        let max_body_bytes = raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        if max_body_bytes == 0 || max_body_bytes > 1 << 30 {
            err("max_body_bytes", format!("{max_body_bytes} is outside 1 to 1073741824"));
        }
        let mut verifier = Verifier::new();
        if raw.trusted_keys.is_empty() {
            err("trusted_keys", "must list at least one public key (the arbiter's signing key)".into());
        }
        for (i, k) in raw.trusted_keys.iter().enumerate() {
            let kid = KeyId::parse(&k.key_id).map_err(|e| err(&format!("trusted_keys[{i}].key_id"), e));
            let file = resolve(base, &k.public_key_file);
            let key = std::fs::read_to_string(&file)
                .map_err(|e| format!("cannot read {}: {e}", file.display()))
                .and_then(|pem| {
                    VerifyingKey::from_public_key_pem(&pem).map_err(|_| {
                        format!("{} is not an SPKI PEM Ed25519 public key (BEGIN PUBLIC KEY)", file.display())
                    })
                })
                .map_err(|e| err(&format!("trusted_keys[{i}].public_key_file"), e));
            if let (Ok(kid), Ok(key)) = (kid, key) {
                if verifier.key_ids().any(|k| *k == kid) {
                    err(&format!("trusted_keys[{i}].key_id"), format!("{kid} is listed twice"));
                }
                verifier.insert(kid, key);
            }
        }
        let default_equal = raw.default_equal.unwrap_or(EqualRule::Strict);
        if raw.routes.is_empty() && raw.unlisted.is_none() {
            err("routes", "must list at least one route (or an unlisted guard)".into());
        }
        let mut routes = Vec::new();
        for (i, r) in raw.routes.iter().enumerate() {
            let at = |f: &str| format!("routes[{i}].{f}");
            if r.name.is_empty() || !r.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
                err(&at("name"), format!("{:?} must be 1+ characters of [A-Za-z0-9_-]", r.name));
            }
            if routes.iter().any(|x: &Route| x.name == r.name) {
                err(&at("name"), format!("{:?} is used by an earlier route", r.name));
            }
            let path = PathTemplate::parse(&r.path).map_err(|e| err(&at("path"), e.to_string()));
            let vars = path.as_ref().map(PathTemplate::vars).unwrap_or_default();
            let resource = TextTemplate::parse(&r.resource, &vars).map_err(|e| err(&at("resource"), e.to_string()));
            let lock_key = TextTemplate::parse(&r.lock_key, &vars).map_err(|e| err(&at("lock_key"), e.to_string()));
            let mut reads = Vec::new();
            for (j, m) in r.reads.iter().enumerate() {
                if m.is_empty() || !m.bytes().all(|b| b.is_ascii_uppercase()) {
                    err(&format!("routes[{i}].reads[{j}]"), format!("{m:?} is not an upper-case HTTP method"));
                }
                reads.push(m.clone());
            }
            if let (Ok(path), Ok(resource), Ok(lock_key)) = (path, resource, lock_key) {
                routes.push(Route {
                    name: r.name.clone(),
                    path: Some(path),
                    reads,
                    resource,
                    lock_key,
                    equal: r.equal.unwrap_or(default_equal),
                    delete_body: r.delete_body,
                });
            }
        }
        let unlisted = raw.unlisted.as_ref().and_then(|g| {
            let resource = TextTemplate::parse(&g.resource, &[]).map_err(|e| err("unlisted.resource", e.to_string()));
            let lock_key = TextTemplate::parse(&g.lock_key, &[]).map_err(|e| err("unlisted.lock_key", e.to_string()));
            match (resource, lock_key) {
                (Ok(resource), Ok(lock_key)) => Some(Route {
                    name: "unlisted".into(),
                    path: None,
                    reads: Vec::new(),
                    resource,
                    lock_key,
                    equal: g.equal.unwrap_or(default_equal),
                    delete_body: g.delete_body,
                }),
                _ => None,
            }
        });
        if raw.accept_lower_tokens && env.var(env::TEST_FAULTS).as_deref() != Some("1") {
            errs.push(format!(
                "{name}: accept_lower_tokens: a planted bug for the release gate, refused unless LOCKMESH_TEST_FAULTS=1"
            ));
        }
        match (listen, admin_listen, upstream, marks_dir) {
            (Some(listen), Some(admin_listen), Some(upstream), Some(marks_dir)) if errs.is_empty() => Ok(Config {
                listen,
                admin_listen,
                upstream,
                marks_dir,
                upstream_timeout: Duration::from_millis(timeout_ms),
                quarantine: Duration::from_millis(quarantine_ms),
                max_body_bytes,
                verifier,
                routes,
                unlisted,
                accept_lower_tokens: raw.accept_lower_tokens,
            }),
            _ => Err(errs),
        }
    }
}
