//! The class registry file: loading (the same code for startup, hot reload and
//! `lockctl class check`), hot reload, the arbiter's defence-in-depth re-check of
//! LockGrant authorisation, and the class part of `/status` and `/metrics`.
//!
//! The registry comes from one [`RegistrySource`]: a registry file
//! (`registry_file`) or a directory of LockClass/LockGrant manifests
//! (`registry_dir`, `lockmesh_registry::crd::manifests`).
//!
//! Hot reload (ADR-24): a task reads the source every second and compares a hash
//! of its content (the file's bytes; the directory's file names and bytes) with
//! the last one seen. A valid new registry replaces the old at once; its
//! classes' missing policy records are created. An invalid one is refused with
//! every error logged, the last good set keeps serving, and `/status` and the
//! `lockmesh_arbiter_registry_reload_errors` gauge show the refusal until a good
//! one arrives. A directory is read once per check and that one reading is both
//! hashed and loaded, so a kubelet's `..data` swap between the two cannot pair
//! one content's hash with another content's registry. Limits (`max_holders`) and the prefix map are desired state: a
//! reload does not change the authoritative records (`lockctl limit` does), and
//! `/status` shows where desired and authoritative differ.

use std::{
    path::{Path, PathBuf},
    sync::{atomic::AtomicU64, Arc, Mutex},
    time::Duration,
};

use lockmesh_core::{
    class::{ClassRegistry, Enforcement, RawPlatform},
    grant::Operation,
    wire::status::{ClassStatus, ClassesReport, ClassesStatus, RegistryStatus, Waiver},
};
use lockmesh_telemetry::labels::{tier_label, Described};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::{
    api::{ApiRequest, Route},
    lock::now_ms,
    respond::ApiError,
    state::State,
};

use lockmesh_registry::crd::manifests::{self, Snapshot};
pub use lockmesh_registry::{check_pause_file, crd, load, parse, parse_at, today};

/// How often the registry file is read for changes.
pub(crate) const RELOAD_PERIOD: Duration = Duration::from_secs(1);

/// The outcome of the last reload attempts.
#[derive(Debug, Default)]
pub struct ReloadStatus(Mutex<ReloadInner>);

#[derive(Debug, Default, Clone)]
struct ReloadInner {
    /// Hash of the bytes last seen (good or bad).
    seen: Option<u64>,
    /// Errors of the current file, if it was refused.
    errors: Vec<String>,
    loaded_ms: u64,
    reloads: u64,
    refused: u64,
}

/// Where the class registry is read from (the arbiter's `registry_file` or
/// `registry_dir`).
#[derive(Clone, Debug)]
pub enum RegistrySource {
    /// One registry YAML (`registry_file`).
    File(PathBuf),
    /// A directory of LockClass/LockGrant manifests (`registry_dir`) and the TTL
    /// limits they are checked under (`registry_platform`).
    Dir {
        /// The directory.
        dir: PathBuf,
        /// The `platform:` section the manifests lack.
        platform: RawPlatform,
        /// The `quotas:` section the manifests lack (`registry_quotas`).
        quotas: lockmesh_core::quota::RawQuotas,
    },
}

/// One reading of a source: the content's hash and what it loads to.
struct Reading {
    hash: u64,
    snapshot: Option<Snapshot>,
}

fn hash(bytes: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

// === impl RegistrySource ===

impl RegistrySource {
    /// The file or the directory.
    pub fn path(&self) -> &Path {
        match self {
            Self::File(p) | Self::Dir { dir: p, .. } => p,
        }
    }

    /// The config field naming it, for errors.
    pub fn field(&self) -> &'static str {
        match self {
            Self::File(_) => "registry_file",
            Self::Dir { .. } => "registry_dir",
        }
    }

    /// The directory a fenced class's relative `pause_test_result` resolves
    /// against: the registry file's directory, or the manifest directory.
    pub fn pause_base(&self) -> PathBuf {
        match self {
            Self::File(p) => p.parent().map(Path::to_owned).unwrap_or_default(),
            Self::Dir { dir, .. } => dir.clone(),
        }
    }

    /// Loads and validates the registry (startup, `--check-config`); errors name
    /// the file (and, for manifests, the document) and the field, every one.
    pub fn load(&self) -> Result<ClassRegistry, Vec<String>> {
        match self {
            Self::File(p) => load(p),
            Self::Dir { dir, platform, quotas } => manifests::load_dir_with(dir, platform, quotas),
        }
    }

    /// Reads the content once; `None` when there is nothing to read now (a file
    /// missing mid-rename, an unreadable directory): not a new registry.
    fn read(&self) -> Option<Reading> {
        match self {
            Self::File(p) => std::fs::read(p).ok().map(|b| Reading { hash: hash(&b), snapshot: None }),
            Self::Dir { dir, .. } => Snapshot::read(dir).ok().map(|s| Reading { hash: s.hash(), snapshot: Some(s) }),
        }
    }

    /// Loads what `r` read (a file is read again by the loader, as before).
    fn load_reading(&self, r: Reading) -> Result<ClassRegistry, Vec<String>> {
        match (self, r.snapshot) {
            (Self::Dir { dir, platform, quotas }, Some(s)) => {
                let reg = s.parse_with(platform, quotas)?;
                manifests::warn_lowered(dir, &reg);
                Ok(reg)
            }
            _ => self.load(),
        }
    }
}

// === impl ReloadStatus ===

impl ReloadStatus {
    fn get(&self) -> ReloadInner {
        self.0.lock().map(|g| g.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    fn update(&self, f: impl FnOnce(&mut ReloadInner)) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
    }
}

/// Reads the registry every [`RELOAD_PERIOD`] and swaps in a changed, valid
/// one. `path` is the config's `registry_file` field value: when it is the
/// config's manifest directory, the directory is read (with its
/// `registry_platform`), else the file at `path`.
pub async fn watch(state: Arc<State>, path: PathBuf) {
    let source = match &state.config.registry_source {
        s @ RegistrySource::Dir { dir, .. } if *dir == path => s.clone(),
        _ => RegistrySource::File(path),
    };
    if let Some(r) = source.read() {
        state.registry_status.update(|s| {
            s.seen = Some(r.hash);
            s.loaded_ms = now_ms();
        });
    }
    loop {
        tokio::time::sleep(RELOAD_PERIOD).await;
        reload_once(&state, &source).await;
    }
}

/// One reload check (also called by tests).
pub(crate) async fn reload_once(state: &State, source: &RegistrySource) {
    let Some(reading) = source.read() else {
        return;
    };
    let h = reading.hash;
    if state.registry_status.get().seen == Some(h) {
        return;
    }
    match source.load_reading(reading) {
        Ok(reg) => {
            for w in reg.warnings(today()) {
                tracing::warn!(warning = %w, "class registry");
            }
            if let Err(e) = state.tiers.bootstrap_policies(&reg).await {
                // The records of new classes are created on first grant instead.
                tracing::warn!(error = %e, "could not create the policy records of the reloaded registry yet");
            }
            state.set_registry(reg);
            state.registry_status.update(|s| {
                s.seen = Some(h);
                s.errors.clear();
                s.loaded_ms = now_ms();
                s.reloads += 1;
            });
            state.metrics.classes.reloads.inc();
            tracing::info!(source = %source.path().display(), "class registry reloaded");
        }
        Err(errs) => {
            for e in &errs {
                tracing::error!(error = %e, "class registry refused; the last good registry keeps serving");
            }
            state.registry_status.update(|s| {
                s.seen = Some(h);
                s.errors = errs;
                s.refused += 1;
            });
        }
    }
}

/// The arbiter's own authorisation check (ADR-19): when the registry carries
/// LockGrant documents, `req.identity` must hold `op` on the request's key (no
/// key: somewhere). For a vouching client it is defence in depth behind the
/// filter; for a self client (`tls.self_clients`) it is the only check, under the
/// self client's own identity, so a registry without LockGrants refuses it.
/// Every path runs it: the API routes ([`api_operation`]) and transparent
/// requests (`acquire`).
pub fn authorise(state: &State, req: &ApiRequest, op: Operation) -> Result<(), ApiError> {
    let denied = || ApiError::new(lockmesh_core::Code::Denied, "not permitted");
    let reg = state.registry();
    let Some(grants) = reg.grants() else {
        return if req.self_client { Err(denied()) } else { Ok(()) };
    };
    // Every key the request names (`x-lock-key`, each of `x-lock-keys`): one key
    // denied denies the request, with the same answer whichever it is.
    let mut keys = req.lock.key.iter().chain(req.lock.keys.iter().flatten()).peekable();
    let ok = match keys.peek() {
        Some(_) => keys.all(|key| grants.allowed(&req.identity, key, op)),
        None => grants.holds_any(&req.identity, op),
    };
    if ok {
        Ok(())
    } else {
        Err(denied())
    }
}

/// The operation an API request needs ([`Route::operation`]); a path under
/// `/v1/admin/` needs `admin`, and an unknown route `acquire` (it is answered
/// `not_found` after the check, so a refusal does not tell routes apart).
pub fn api_operation(method: &str, path: &str) -> Operation {
    match Route::of(method.as_bytes(), path.as_bytes()) {
        Some(r) => r.operation(),
        None if path.starts_with(lockmesh_core::route::ADMIN_PREFIX) => Operation::Admin,
        None => Operation::Acquire,
    }
}

/// The class part of `/status`: registry reload state, each class's desired and
/// authoritative policy, and draining ages.
pub(crate) async fn classes_status(state: &State) -> ClassesStatus {
    let r = state.registry_status.get();
    let reg = state.registry();
    let now = now_ms();
    let (policies, map) = match state.store.policies().read_all().await {
        Ok(p) => p,
        Err(e) => return ClassesStatus::Unreadable { error: e.to_string() },
    };
    let classes = reg
        .classes()
        .iter()
        .map(|c| {
            let p = policies.iter().find(|p| p.class == c.name.as_str());
            let advisory = match &c.enforcement {
                Enforcement::Advisory { waiver_expiry_day, risk_owner } => {
                    Some(Waiver { risk_owner: risk_owner.clone(), expired: *waiver_expiry_day < today() })
                }
                Enforcement::Fenced => None,
            };
            ClassStatus {
                name: c.name.to_string(),
                ttl_s: c.ttl_s,
                tier: tier_label(c.tier).to_owned(),
                desired_limit: c.max_holders,
                advisory,
                limit: p.map(|p| p.limit),
                state: p.map(|p| p.state),
                change_epoch: p.map(|p| p.change_epoch),
                pending_target: p.and_then(|p| p.pending_target),
                policy_id: p.map(|p| p.policy_id.clone()),
                draining_age_ms: p.and_then(|p| p.draining_age_ms(now)),
                last_change: p.map(|p| p.last.clone()),
                desired_differs: p.is_none_or(|p| p.limit != c.max_holders),
            }
        })
        .collect();
    ClassesStatus::Read(ClassesReport {
        registry: RegistryStatus {
            valid: r.errors.is_empty(),
            errors: r.errors,
            loaded_ms: r.loaded_ms,
            reloads: r.reloads,
            refused: r.refused,
        },
        map_matches_registry: map.as_ref().map(|m| m.matches(&reg)),
        classes,
    })
}

/// The class families of `/metrics` (label: a class name of the registry in force).
#[derive(Debug, Default)]
pub struct ClassMetrics {
    reload_errors: Gauge,
    /// Bumped by [`reload_once`] with each registry file it loads.
    reloads: Counter,
    waiver_expired: Described<Family<ClassLabel, Gauge>>,
    limit: Described<Family<ClassLabel, Gauge>>,
    draining_seconds: Described<Family<ClassLabel, Gauge<f64, AtomicU64>>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

/// What the class families show at one scrape, read by [`class_values`].
#[derive(Debug, Default)]
pub struct ClassValues {
    reload_errors: usize,
    /// Each class of the registry and whether its waiver has expired.
    waiver_expired: Vec<(String, bool)>,
    /// Each class with a policy record: its authoritative limit and draining age,
    /// seconds; `None` when the policies could not be read (the families are empty).
    policies: Option<Vec<(String, u32, f64)>>,
}

// === impl ClassMetrics ===

impl ClassMetrics {
    /// Adds the class families to `registry` (the registry's copies share these values).
    pub fn register(&self, registry: &mut Registry) {
        // prometheus-client appends `_total` to a counter's name and `.` to its help.
        registry.register(
            "lockmesh_arbiter_registry_reload_errors",
            "Errors of the refused registry file (0: the file in use is the file on disk)",
            self.reload_errors.clone(),
        );
        registry.register(
            "lockmesh_arbiter_registry_reloads",
            "Registry files loaded after startup",
            self.reloads.clone(),
        );
        registry.register(
            "lockmesh_arbiter_class_waiver_expired",
            "1 when an advisory class's waiver has expired",
            self.waiver_expired.clone(),
        );
        registry.register(
            "lockmesh_arbiter_class_limit",
            "The authoritative holder limit per key of a class",
            self.limit.clone(),
        );
        registry.register(
            "lockmesh_arbiter_class_draining_seconds",
            "How long a class has been draining a limit change (0: active)",
            self.draining_seconds.clone(),
        );
    }

    /// Shows `v`: a class that left the registry leaves the families.
    pub fn set(&self, v: &ClassValues) {
        self.reload_errors.set(i64::try_from(v.reload_errors).unwrap_or(i64::MAX));
        self.waiver_expired.clear();
        for (class, expired) in &v.waiver_expired {
            self.waiver_expired.get_or_create(&ClassLabel { class: class.clone() }).set(i64::from(*expired));
        }
        self.limit.clear();
        self.draining_seconds.clear();
        for (class, limit, draining_s) in v.policies.iter().flatten() {
            let l = ClassLabel { class: class.clone() };
            self.limit.get_or_create(&l).set(i64::from(*limit));
            self.draining_seconds.get_or_create(&l).set(*draining_s);
        }
    }
}

/// The class part of `/metrics` now: reload state, waivers, and the authoritative
/// policies of the registry's classes (read from etcd).
pub(crate) async fn class_values(state: &State) -> ClassValues {
    let r = state.registry_status.get();
    let reg = state.registry();
    let expired = reg.expired_waivers(today());
    let waiver_expired = reg.classes().iter().map(|c| (c.name.to_string(), expired.contains(&&c.name))).collect();
    let now = now_ms();
    let policies = state.store.policies().read_all().await.ok().map(|(policies, _)| {
        policies
            .iter()
            .filter(|p| reg.get(&p.class).is_some())
            .map(|p| (p.class.clone(), p.limit, p.draining_age_ms(now).map_or(0.0, |ms| ms as f64 / 1000.0)))
            .collect()
    });
    ClassValues { reload_errors: r.errors.len(), waiver_expired, policies }
}

#[cfg(test)]
mod tests;
