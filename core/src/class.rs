//! The class schema (ADR-01, ADR-04, ADR-07, ADR-11, ADR-14, ADR-24) and the
//! registry lookup.
//!
//! A key's class is decided here, by the longest prefix that covers the key on a `/`
//! boundary, never by the caller. The raw documents (`Raw*`) are what YAML files and
//! the Kubernetes CRDs carry (a `LockClass` is one entry of `classes`, a `LockGrant`
//! one entry of `grants`); [`ClassRegistry::try_from_raw`] validates them and
//! reports every error with its field path, not only the first. Field names are
//! snake_case; the CRD spellings (`maxHolders`, `riskOwner`, ...) are accepted as
//! aliases.
//!
//! # Layout
//! - [`cost`]: the renewal cost and liveness bound of a class (ADR-11).

pub mod cost;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{
    grant::{GrantSet, RawGrant},
    key::{covers, valid_namespace, LockKey},
    quota::{QuotaTable, RawQuotas},
};

/// Platform TTL floor (ADR-11).
pub const PLATFORM_MIN_TTL_S: u64 = 5;
/// Platform TTL ceiling (ADR-11).
pub const PLATFORM_MAX_TTL_S: u64 = 300;
/// Platform default TTL (ADR-11).
pub const PLATFORM_DEFAULT_TTL_S: u64 = 15;
/// TTL floor of advisory classes (ADR-11): a false expiry there can produce a
/// duplicate write.
pub const PLATFORM_ADVISORY_MIN_TTL_S: u64 = 30;
/// etcd's own lease floor with default timing: a registry may not go below it.
pub const ETCD_MIN_TTL_S: u64 = 2;
/// The longest `lock_delay_s` a class may set: a key stays ungrantable that long
/// after its holder's session expired or it was force-released (Consul's
/// lock-delay; docs/CLASSES.md).
pub const MAX_LOCK_DELAY_S: u64 = 300;
/// The highest `max_holders` a class (and a policy record) may carry. A key's
/// holds sit in slots named with four digits (`<root>/l/<digest>/h/0000`, see
/// `lockmesh_keyspace::keys`); a grant compares the range from slot `N` to the end
/// of the key's holds empty, so slot `N`'s name must sort after every slot below
/// it. Up to 9999 every name has four digits and byte order is number order;
/// slot 10000 would sort between `1000` and `1001`. The CRD's `maxHolders`
/// maximum is this value.
pub const MAX_HOLDERS: u32 = 9_999;

/// Why the platform TTL floor matters (ADR-11), for `lockctl class check` and the
/// loader's refusal.
pub const WHY_MIN_TTL: &str = "the TTL is how long a stalled holder keeps its lease: below the floor a short GC \
     pause, disk stall or network blip expires a live holder (a fenced class pays a retry), and renewals at the \
     etcd leader grow as sessions x 3 / ttl per second, toward etcd's own 2 s lease floor";
/// Why the advisory TTL floor matters (ADR-01, ADR-11).
pub const WHY_ADVISORY_MIN_TTL: &str = "an advisory class has no fence: nothing at the resource refuses a holder \
     whose lease expired, so the TTL is the only protection against a paused holder resuming to write while a \
     second holder writes too (a duplicate write)";
/// Why the platform TTL ceiling matters (ADR-11).
pub const WHY_MAX_TTL: &str = "the TTL bounds how long a crashed holder blocks its keys (plus an election timeout \
     per leader change during the expiry)";

/// The TTL limits in force (ADR-11): [`Platform::DEFAULT`] unless a registry's
/// `platform:` section changes them. The arbiter's loader and the CRD generator
/// (`lockmesh_registry::crd`) both read their limits from this one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Platform {
    /// Lowest TTL any class may choose, seconds.
    pub min_ttl_s: u64,
    /// Highest TTL any class may choose, seconds.
    pub max_ttl_s: u64,
    /// Lowest TTL an advisory class may choose, seconds.
    pub advisory_min_ttl_s: u64,
}

/// A platform limit a registry set looser than the default (a floor lowered or
/// the ceiling raised).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoweredFloor {
    /// The registry field, e.g. `min_ttl_s`.
    pub field: &'static str,
    /// What the registry set, seconds.
    pub value_s: u64,
    /// The default it loosens, seconds.
    pub default_s: u64,
    /// Why the default matters ([`WHY_MIN_TTL`], ...).
    pub why: &'static str,
}

impl LoweredFloor {
    /// `lowers the platform floor` or, for `max_ttl_s`, `raises the platform ceiling`.
    pub fn verb(&self) -> &'static str {
        if self.field == "max_ttl_s" {
            "raises the platform ceiling"
        } else {
            "lowers the platform floor"
        }
    }
}

impl fmt::Display for LoweredFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "platform.{}: {}s {} {}s", self.field, self.value_s, self.verb(), self.default_s)
    }
}

// === impl Platform ===

impl Platform {
    /// The ADR-11 limits: 5 s to 300 s, advisory classes at least 30 s. The
    /// shipped CRDs (deploy/crds) encode these.
    pub const DEFAULT: Platform = Platform {
        min_ttl_s: PLATFORM_MIN_TTL_S,
        max_ttl_s: PLATFORM_MAX_TTL_S,
        advisory_min_ttl_s: PLATFORM_ADVISORY_MIN_TTL_S,
    };

    /// The limits of a raw `platform:` section (unset fields keep the default).
    pub fn of(raw: &RawPlatform) -> Self {
        Self {
            min_ttl_s: raw.min_ttl_s.unwrap_or(PLATFORM_MIN_TTL_S),
            max_ttl_s: raw.max_ttl_s.unwrap_or(PLATFORM_MAX_TTL_S),
            advisory_min_ttl_s: raw.advisory_min_ttl_s.unwrap_or(PLATFORM_ADVISORY_MIN_TTL_S),
        }
    }

    /// Every limit looser than [`Platform::DEFAULT`], in field order.
    pub fn lowered_floors(&self) -> Vec<LoweredFloor> {
        let d = Self::DEFAULT;
        let mut out = Vec::new();
        if self.min_ttl_s < d.min_ttl_s {
            out.push(LoweredFloor {
                field: "min_ttl_s",
                value_s: self.min_ttl_s,
                default_s: d.min_ttl_s,
                why: WHY_MIN_TTL,
            });
        }
        if self.max_ttl_s > d.max_ttl_s {
            out.push(LoweredFloor {
                field: "max_ttl_s",
                value_s: self.max_ttl_s,
                default_s: d.max_ttl_s,
                why: WHY_MAX_TTL,
            });
        }
        if self.advisory_min_ttl_s < d.advisory_min_ttl_s {
            out.push(LoweredFloor {
                field: "advisory_min_ttl_s",
                value_s: self.advisory_min_ttl_s,
                default_s: d.advisory_min_ttl_s,
                why: WHY_ADVISORY_MIN_TTL,
            });
        }
        out
    }

    /// The verdict on a class's TTL: `ttl_s` (the class's, or `None` for the
    /// default [`PLATFORM_DEFAULT_TTL_S`]) inside the range, and an advisory class
    /// at or above the advisory floor. `Err` is the message for `ttl_s`.
    pub fn check_ttl(&self, ttl_s: Option<u64>, advisory: bool) -> Result<u64, String> {
        let ttl = ttl_s.unwrap_or(PLATFORM_DEFAULT_TTL_S);
        if ttl < self.min_ttl_s || ttl > self.max_ttl_s {
            Err(format!("{ttl}s is outside the platform range {}s to {}s", self.min_ttl_s, self.max_ttl_s))
        } else if advisory && ttl < self.advisory_min_ttl_s {
            Err(format!(
                "{ttl}s is below the advisory floor {}s (a false expiry can duplicate a write)",
                self.advisory_min_ttl_s
            ))
        } else {
            Ok(ttl)
        }
    }
}

impl Default for Platform {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A class name: 1-63 characters of `[a-z0-9-]`, starting and ending alphanumeric.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ClassName(String);

impl ClassName {
    /// Validates a class name.
    pub fn parse(s: &str) -> Result<Self, String> {
        if valid_namespace(s) {
            Ok(Self(s.to_owned()))
        } else {
            Err("must be 1-63 characters of [a-z0-9-], starting and ending alphanumeric".into())
        }
    }
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClassName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A registry document as written in YAML.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawRegistry {
    /// Platform limits; production leaves them at the ADR-11 defaults. Test
    /// registries may lower the TTL floors (never below etcd's 2 s), only with
    /// `lowered_floors_reason`.
    #[serde(default)]
    pub platform: RawPlatform,
    /// The classes (`LockClass` documents). Exactly one has `default: true`.
    pub classes: Vec<RawClass>,
    /// Prefix grants (`LockGrant` documents). When present the arbiter re-checks
    /// every request against them (the filter checks first).
    #[serde(default)]
    pub grants: Vec<RawGrant>,
    /// Per-namespace quotas ([`crate::quota`]); the built-in defaults without it.
    #[serde(default, skip_serializing_if = "is_default_quotas")]
    pub quotas: RawQuotas,
}

fn is_default_quotas(q: &RawQuotas) -> bool {
    *q == RawQuotas::default()
}

/// Platform limits.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlatform {
    /// Lowest TTL a class may choose, seconds. Default 5.
    pub min_ttl_s: Option<u64>,
    /// Highest TTL a class may choose, seconds. Default 300.
    pub max_ttl_s: Option<u64>,
    /// Lowest TTL an advisory class may choose, seconds. Default 30.
    pub advisory_min_ttl_s: Option<u64>,
    /// Why this registry lowers a floor (or raises the ceiling) below the ADR-11
    /// defaults: required when it does, refused when it does not. The CRDs in
    /// deploy/crds encode the defaults; a deployment that lowers a floor
    /// regenerates them (`lockctl class crds FILE`).
    pub lowered_floors_reason: Option<String>,
}

/// A class's candidate policy (shadow mode): evaluated beside the enforced one,
/// never deciding. Each field unset keeps the enforced value.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RawCandidate {
    /// The limit the candidate would enforce.
    #[serde(alias = "maxHolders")]
    pub max_holders: Option<u32>,
    /// The lock-delay the candidate would enforce, seconds.
    #[serde(alias = "lockDelaySeconds")]
    pub lock_delay_s: Option<u64>,
    /// The session TTL the candidate would give new sessions, seconds.
    #[serde(alias = "ttlSeconds")]
    pub ttl_s: Option<u64>,
}

/// One class (a `LockClass`) as written in YAML.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawClass {
    /// Class name, `[a-z0-9-]`.
    pub name: String,
    /// Key prefixes this class governs (`namespace` or `namespace/path`), matched on
    /// `/` boundaries; the longest match across all classes wins.
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// Cluster tier (ADR-07): `coord` or `entity`. Default `entity`.
    pub tier: Option<String>,
    /// Session TTL in seconds for holds of this class. Default 15; advisory
    /// classes at least 30.
    #[serde(alias = "ttlSeconds")]
    pub ttl_s: Option<u64>,
    /// Required (ADR-01): `fenced` (mutual exclusion claimed, enforced at the
    /// resource; needs a passing pause test) or `advisory` (ordered grants only;
    /// needs `risk_owner` and `waiver_expiry`).
    pub enforcement: Option<String>,
    /// Who owns the risk of an advisory class.
    #[serde(alias = "riskOwner")]
    pub risk_owner: Option<String>,
    /// When an advisory waiver ends, `YYYY-MM-DD` (UTC). An expired waiver is
    /// reported, not refused.
    #[serde(alias = "waiverExpiry", alias = "waiverExpires")]
    pub waiver_expiry: Option<String>,
    /// What happens without an etcd quorum (ADR-04): `closed` (grant nothing) or
    /// `open` (grant from the arbiter's memory with token 0, spooled and audited
    /// as unprotected). `open` needs `enforcement: advisory` and
    /// `purpose: efficiency`. Default `closed`.
    #[serde(alias = "onQuorumLoss")]
    pub on_quorum_loss: Option<String>,
    /// What a second holder costs (ADR-04): `correctness` (damage) or
    /// `efficiency` (wasted work only). Unset says nothing; only a declared
    /// efficiency class may fail open.
    pub purpose: Option<String>,
    /// Most holders of one key at once. Default 1 (a mutex), at most
    /// [`MAX_HOLDERS`]. Fenced classes need 1.
    #[serde(alias = "maxHolders")]
    pub max_holders: Option<u32>,
    /// Waiter order (ADR-14): `memory` (per-arbiter FIFO). Default `memory`.
    pub fairness: Option<String>,
    /// Seconds a key stays ungrantable after its hold ended without its holder
    /// releasing it (the session expired, or a force release): time for a paused
    /// holder to wake and notice before anyone else starts. Default 0 (off), at
    /// most [`MAX_LOCK_DELAY_S`]; mutex classes only (`max_holders` 1).
    #[serde(alias = "lockDelaySeconds")]
    pub lock_delay_s: Option<u64>,
    /// A candidate policy evaluated beside the enforced one (shadow mode,
    /// docs/CLASSES.md): every decision it would make differently is counted and
    /// audited; it never decides.
    #[serde(default)]
    pub candidate: Option<RawCandidate>,
    /// Path of the PauseTestResult document a fenced class rests on (ADR-17).
    #[serde(alias = "pauseTestResult")]
    pub pause_test_result: Option<String>,
    /// The class of keys no prefix covers. Exactly one class sets it.
    #[serde(default)]
    pub default: bool,
}

/// The cluster tier of a class (ADR-07).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Few long-held coordination locks (leader election).
    Coord,
    /// Many short entity locks.
    Entity,
}

/// What a class claims (ADR-01).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    /// Mutual exclusion, enforced where the write lands.
    Fenced,
    /// Ordered, expiring grants only, with a registered risk.
    Advisory {
        /// The named risk owner.
        risk_owner: String,
        /// Waiver end, days since 1970-01-01 (UTC).
        waiver_expiry_day: i64,
    },
}

/// What a class does without an etcd quorum (ADR-04).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnQuorumLoss {
    /// Grant nothing (every class unless declared otherwise).
    #[default]
    Closed,
    /// Grant from the arbiter's memory with token 0, spooled and shipped to the
    /// audit store as unprotected (advisory efficiency classes only).
    Open,
}

/// What a second holder of a key costs (ADR-04).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// Two holders cause damage: the class may only fail closed.
    Correctness,
    /// Two holders only waste work: the class may fail open.
    Efficiency,
}

/// Waiter order (ADR-14).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fairness {
    /// Per-arbiter in-memory FIFO.
    Memory,
    /// Durable waiter keys ordered by create revision.
    Durable,
}

/// A validated class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClassSpec {
    /// Name.
    pub name: ClassName,
    /// Prefixes it governs.
    pub prefixes: Vec<String>,
    /// Tier.
    pub tier: Tier,
    /// Session TTL, seconds.
    pub ttl_s: u64,
    /// Enforcement posture.
    pub enforcement: Enforcement,
    /// Most holders of one key (the desired limit; the authoritative one is the
    /// arbiter's policy record).
    pub max_holders: u32,
    /// Waiter order.
    pub fairness: Fairness,
    /// Lock-delay after an expiry or a force release, seconds (0: none).
    pub lock_delay_s: u64,
    /// The candidate policy evaluated in shadow mode, if any.
    pub candidate: Option<Candidate>,
    /// The pause-test result file of a fenced class, as written.
    pub pause_test_result: Option<String>,
    /// Without an etcd quorum: closed, or open (ADR-04).
    pub on_quorum_loss: OnQuorumLoss,
    /// Correctness or efficiency, when declared.
    pub purpose: Option<Purpose>,
}

/// A validated candidate policy (shadow mode): the values it would enforce, each
/// already resolved against the enforced one (an unset field is the enforced value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Candidate {
    /// Limit.
    pub max_holders: u32,
    /// Lock-delay, seconds.
    pub lock_delay_s: u64,
    /// Session TTL, seconds.
    pub ttl_s: u64,
}

/// The pause-test check of a fenced class: its name and its `pause_test_result`
/// as written; `Err` says why the class may not claim `fenced`.
pub type PauseCheck<'a> = dyn Fn(&str, Option<&str>) -> Result<(), String> + 'a;

/// One validation error: where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field path, e.g. `classes[2].ttl_s`.
    pub path: String,
    /// What is wrong, naming the value and the limit.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The validated registry.
#[derive(Debug, Clone)]
pub struct ClassRegistry {
    classes: Vec<ClassSpec>,
    default: usize,
    /// `(prefix, class index)`, longest prefix first.
    prefixes: Vec<(String, usize)>,
    /// The LockGrant documents, when the registry carries any.
    grants: Option<GrantSet>,
    /// The TTL limits in force.
    platform: Platform,
    /// Why the registry loosens a platform limit, when it does.
    lowered_floors_reason: Option<String>,
    /// The per-namespace quotas.
    quotas: QuotaTable,
}

impl PartialEq for ClassRegistry {
    fn eq(&self, o: &Self) -> bool {
        self.classes == o.classes && self.default == o.default && self.prefixes == o.prefixes && self.quotas == o.quotas
    }
}

fn valid_prefix(p: &str) -> bool {
    let mut segs = p.split('/');
    let ns_ok = segs.next().is_some_and(valid_namespace);
    ns_ok && (!p.contains('/') || LockKey::parse(p.as_bytes()).is_ok())
}

/// Days since 1970-01-01 of a `YYYY-MM-DD` date (proleptic Gregorian).
pub fn parse_day(s: &str) -> Option<i64> {
    let mut it = s.splitn(3, '-');
    let (y, m, d) = (it.next()?, it.next()?, it.next()?);
    if y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let (y, m, d): (i64, i64, i64) = (y.parse().ok()?, m.parse().ok()?, d.parse().ok()?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let mdays = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if !(1..=12).contains(&m) || d < 1 || d > mdays[usize::try_from(m - 1).ok()?] {
        return None;
    }
    // Howard Hinnant's days_from_civil.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some(era * 146_097 + doe - 719_468)
}

// === impl ClassRegistry ===

impl ClassRegistry {
    /// Validates a raw registry's structure, collecting every error. It does not
    /// verify the pause-test results of fenced classes: the arbiter's loader uses
    /// [`ClassRegistry::try_from_raw_with`] (this is for tools and tests that only
    /// read the structure).
    pub fn try_from_raw(raw: &RawRegistry) -> Result<Self, Vec<FieldError>> {
        Self::try_from_raw_with(raw, &|_, _| Ok(()))
    }

    /// Validates a raw registry, collecting every error, and asks `pause_check`
    /// about every fenced class (its name and its `pause_test_result` as
    /// written): an `Err` is reported at `classes[i].pause_test_result` (ADR-17:
    /// no fenced class without a passing, unexpired pause test of its own).
    pub fn try_from_raw_with(raw: &RawRegistry, pause_check: &PauseCheck<'_>) -> Result<Self, Vec<FieldError>> {
        let mut errs = Vec::new();
        let mut err = |path: String, message: String| errs.push(FieldError { path, message });
        let platform = Platform::of(&raw.platform);
        let Platform { min_ttl_s: min_ttl, max_ttl_s: max_ttl, advisory_min_ttl_s: adv_min } = platform;
        if min_ttl < ETCD_MIN_TTL_S {
            err("platform.min_ttl_s".into(), format!("{min_ttl}s is below etcd's lease floor {ETCD_MIN_TTL_S}s"));
        }
        if adv_min < ETCD_MIN_TTL_S {
            err(
                "platform.advisory_min_ttl_s".into(),
                format!("{adv_min}s is below etcd's lease floor {ETCD_MIN_TTL_S}s"),
            );
        }
        if max_ttl < min_ttl {
            err("platform.max_ttl_s".into(), format!("{max_ttl}s is below min_ttl_s {min_ttl}s"));
        }
        let reason = raw.platform.lowered_floors_reason.as_deref().map(str::trim).filter(|r| !r.is_empty());
        let lowered = platform.lowered_floors();
        if reason.is_none() {
            for l in &lowered {
                err(
                    format!("platform.{}", l.field),
                    format!(
                        "{}s {} {}s: say why in platform.lowered_floors_reason (a test registry), and regenerate \
                         the CRDs for these limits (lockctl class crds FILE); {}",
                        l.value_s,
                        l.verb(),
                        l.default_s,
                        l.why
                    ),
                );
            }
        } else if lowered.is_empty() {
            err(
                "platform.lowered_floors_reason".into(),
                "set, but no floor is lowered: remove it (it would hide a later lowering)".into(),
            );
        }
        let mut classes = Vec::new();
        let mut defaults = Vec::new();
        let mut prefixes: Vec<(String, usize)> = Vec::new();
        for (i, c) in raw.classes.iter().enumerate() {
            let at = |f: &str| format!("classes[{i}].{f}");
            let name = match ClassName::parse(&c.name) {
                Ok(n) => Some(n),
                Err(m) => {
                    err(at("name"), format!("{:?} {m}", c.name));
                    None
                }
            };
            if raw.classes[..i].iter().any(|o| o.name == c.name) {
                err(at("name"), format!("{:?} is defined twice", c.name));
            }
            let tier = match c.tier.as_deref() {
                None | Some("entity") => Some(Tier::Entity),
                Some("coord") => Some(Tier::Coord),
                Some(t) => {
                    err(at("tier"), format!("{t:?} is not coord or entity"));
                    None
                }
            };
            let max_holders = c.max_holders.unwrap_or(1);
            if max_holders == 0 {
                err(
                    at("max_holders"),
                    "must be at least 1: 0 would pause every key of the class, not one key; \
                     remove the class's grants to stop it"
                        .into(),
                );
            }
            if max_holders > MAX_HOLDERS {
                err(
                    at("max_holders"),
                    format!(
                        "{max_holders} is above {MAX_HOLDERS}: holder slots are named with four digits, and a \
                         limit past that names slots that sort inside the range of the limit's compare"
                    ),
                );
            }
            let enforcement = match c.enforcement.as_deref() {
                Some("fenced") => {
                    if max_holders > 1 {
                        err(
                            at("max_holders"),
                            format!(
                                "{max_holders} with enforcement fenced: a high-water fence admits one holder at a \
                                 time; use 1, or declare the class advisory"
                            ),
                        );
                    }
                    for (f, set) in
                        [("risk_owner", c.risk_owner.is_some()), ("waiver_expiry", c.waiver_expiry.is_some())]
                    {
                        if set {
                            err(at(f), "only advisory classes carry a waiver".into());
                        }
                    }
                    if let Err(m) = pause_check(&c.name, c.pause_test_result.as_deref()) {
                        err(at("pause_test_result"), m);
                    }
                    Some(Enforcement::Fenced)
                }
                Some("advisory") => {
                    let owner = c.risk_owner.as_deref().map(str::trim).filter(|o| !o.is_empty());
                    if owner.is_none() {
                        err(at("risk_owner"), "required for an advisory class (ADR-01): name who owns the risk".into());
                    }
                    let day = match c.waiver_expiry.as_deref() {
                        None => {
                            err(at("waiver_expiry"), "required for an advisory class (ADR-01): YYYY-MM-DD".into());
                            None
                        }
                        Some(s) => {
                            let d = parse_day(s);
                            if d.is_none() {
                                err(at("waiver_expiry"), format!("{s:?} is not a date YYYY-MM-DD"));
                            }
                            d
                        }
                    };
                    owner
                        .zip(day)
                        .map(|(o, d)| Enforcement::Advisory { risk_owner: o.to_owned(), waiver_expiry_day: d })
                }
                Some(e) => {
                    err(at("enforcement"), format!("{e:?} is not fenced or advisory"));
                    None
                }
                None => {
                    err(at("enforcement"), "required (ADR-01): fenced or advisory".into());
                    None
                }
            };
            if enforcement != Some(Enforcement::Fenced) && c.pause_test_result.is_some() {
                err(at("pause_test_result"), "only a fenced class rests on a pause test".into());
            }
            let ttl_s = platform.check_ttl(c.ttl_s, c.enforcement.as_deref() == Some("advisory")).unwrap_or_else(|m| {
                err(at("ttl_s"), m);
                c.ttl_s.unwrap_or(PLATFORM_DEFAULT_TTL_S)
            });
            let purpose = match c.purpose.as_deref() {
                None => Some(None),
                Some("correctness") => Some(Some(Purpose::Correctness)),
                Some("efficiency") => Some(Some(Purpose::Efficiency)),
                Some(p) => {
                    err(at("purpose"), format!("{p:?} is not correctness or efficiency"));
                    None
                }
            };
            let on_quorum_loss = match c.on_quorum_loss.as_deref() {
                None | Some("closed") => Some(OnQuorumLoss::Closed),
                Some("open") => {
                    // ADR-04: only a declared efficiency class that claims no
                    // exclusion may grant without a quorum.
                    let mut ok = true;
                    if c.enforcement.as_deref() != Some("advisory") {
                        ok = false;
                        err(
                            at("on_quorum_loss"),
                            format!(
                                "open needs enforcement advisory, not {}: a fenced class claims mutual exclusion, \
                                 which a grant without a quorum cannot keep (ADR-04)",
                                c.enforcement.as_deref().unwrap_or("unset")
                            ),
                        );
                    }
                    match c.purpose.as_deref() {
                        Some("efficiency") => {}
                        Some("correctness") => {
                            ok = false;
                            err(
                                at("on_quorum_loss"),
                                "open with purpose correctness: a correctness class may only declare closed (ADR-04)"
                                    .into(),
                            );
                        }
                        None => {
                            ok = false;
                            err(
                                at("on_quorum_loss"),
                                "open needs purpose: efficiency (ADR-04: only a declared efficiency class fails open)"
                                    .into(),
                            );
                        }
                        // Reported at `purpose` above.
                        Some(_) => ok = false,
                    }
                    ok.then_some(OnQuorumLoss::Open)
                }
                Some(o) => {
                    err(at("on_quorum_loss"), format!("{o:?} is not closed or open"));
                    None
                }
            };
            let lock_delay_s = c.lock_delay_s.unwrap_or(0);
            if lock_delay_s > MAX_LOCK_DELAY_S {
                err(
                    at("lock_delay_s"),
                    format!("{lock_delay_s} is above {MAX_LOCK_DELAY_S}: a key would stay ungrantable that long after every expiry"),
                );
            }
            if lock_delay_s > 0 && max_holders > 1 {
                err(
                    at("lock_delay_s"),
                    format!(
                        "{lock_delay_s} with max_holders {max_holders}: lock-delay is defined for mutex classes \
                         (max_holders 1), where an expiry frees the one hold"
                    ),
                );
            }
            let candidate = c.candidate.as_ref().map(|k| Candidate {
                max_holders: k.max_holders.unwrap_or(max_holders),
                lock_delay_s: k.lock_delay_s.unwrap_or(lock_delay_s),
                ttl_s: k.ttl_s.unwrap_or(ttl_s),
            });
            if let (Some(k), Some(raw)) = (candidate, c.candidate.as_ref()) {
                if *raw == RawCandidate::default() {
                    err(at("candidate"), "sets nothing: name max_holders, lock_delay_s or ttl_s, or remove it".into());
                }
                if k.max_holders == 0 || k.max_holders > MAX_HOLDERS {
                    err(at("candidate.max_holders"), format!("{} is outside 1 to {MAX_HOLDERS}", k.max_holders));
                }
                if k.lock_delay_s > MAX_LOCK_DELAY_S {
                    err(at("candidate.lock_delay_s"), format!("{} is above {MAX_LOCK_DELAY_S}", k.lock_delay_s));
                }
                if k.lock_delay_s > 0 && k.max_holders > 1 {
                    err(
                        at("candidate.lock_delay_s"),
                        format!(
                            "{} with max_holders {}: lock-delay is for mutex classes",
                            k.lock_delay_s, k.max_holders
                        ),
                    );
                }
                if let Err(m) = platform.check_ttl(Some(k.ttl_s), c.enforcement.as_deref() == Some("advisory")) {
                    err(at("candidate.ttl_s"), m);
                }
            }
            let fairness = match c.fairness.as_deref() {
                None | Some("memory") => Some(Fairness::Memory),
                Some("durable") => Some(Fairness::Durable),
                Some(f) => {
                    err(at("fairness"), format!("{f:?} is not memory or durable"));
                    None
                }
            };
            for (j, p) in c.prefixes.iter().enumerate() {
                if !valid_prefix(p) {
                    err(at(&format!("prefixes[{j}]")), format!("{p:?} is not a namespace or namespace/path"));
                } else if let Some((_, other)) = prefixes.iter().find(|(q, _)| q == p) {
                    err(at(&format!("prefixes[{j}]")), format!("{p:?} is already claimed by classes[{other}]"));
                } else {
                    prefixes.push((p.clone(), i));
                }
            }
            if c.default {
                defaults.push(i);
            }
            if let (Some(name), Some(tier), Some(enforcement), Some(fairness), Some(on_quorum_loss), Some(purpose)) =
                (name, tier, enforcement, fairness, on_quorum_loss, purpose)
            {
                classes.push(ClassSpec {
                    name,
                    prefixes: c.prefixes.clone(),
                    tier,
                    ttl_s,
                    enforcement,
                    max_holders,
                    fairness,
                    lock_delay_s,
                    candidate,
                    pause_test_result: c.pause_test_result.clone(),
                    on_quorum_loss,
                    purpose,
                });
            }
        }
        match defaults.len() {
            1 => {}
            0 => err("classes".into(), "no class has default: true".into()),
            _ => err("classes".into(), format!("{} classes have default: true; exactly one may", defaults.len())),
        }
        let grants = match GrantSet::try_from_raw(&raw.grants) {
            Ok(g) => (!raw.grants.is_empty()).then_some(g),
            Err(e) => {
                errs.extend(e);
                None
            }
        };
        let quotas = match QuotaTable::try_from_raw(&raw.quotas) {
            Ok(q) => q,
            Err(e) => {
                errs.extend(e.into_iter().map(|(path, message)| FieldError { path, message }));
                QuotaTable::default()
            }
        };
        if !errs.is_empty() {
            return Err(errs);
        }
        prefixes.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Ok(Self {
            classes,
            default: defaults[0],
            prefixes,
            grants,
            platform,
            lowered_floors_reason: reason.map(str::to_owned),
            quotas,
        })
    }

    /// The per-namespace quotas.
    pub fn quotas(&self) -> &QuotaTable {
        &self.quotas
    }

    /// The one namespace every prefix of `class` lies in, if there is one: the
    /// quota namespace of a session opened for the class with no key.
    pub fn class_namespace(&self, class: &str) -> Option<&str> {
        let c = self.get(class)?;
        let mut nss = c.prefixes.iter().map(|p| p.split('/').next().unwrap_or_default());
        let first = nss.next()?;
        nss.all(|n| n == first).then_some(first)
    }

    /// The quota namespace of a session of `class` opened for `key` (the key's
    /// namespace; with no key, [`ClassRegistry::class_namespace`], else
    /// [`crate::quota::UNSCOPED`]).
    pub fn session_namespace(&self, class: &str, key: Option<&LockKey>) -> String {
        match key {
            Some(k) => k.namespace().to_owned(),
            None => self.class_namespace(class).unwrap_or(crate::quota::UNSCOPED).to_owned(),
        }
    }

    /// The TTL limits in force (the CRDs for them: `lockmesh_registry::crd`).
    pub fn platform(&self) -> Platform {
        self.platform
    }

    /// The platform limits this registry loosens below the ADR-11 defaults, with
    /// its `lowered_floors_reason` (always set when the list is not empty). The
    /// arbiter logs them at every load; `lockctl class check` prints why each matters.
    pub fn lowered_floors(&self) -> (Vec<LoweredFloor>, Option<&str>) {
        (self.platform.lowered_floors(), self.lowered_floors_reason.as_deref())
    }

    /// The class of `key`: the longest covering prefix, else the default class.
    pub fn class_of(&self, key: &LockKey) -> &ClassSpec {
        let i = self.prefixes.iter().find(|(p, _)| covers(p, key.as_str())).map_or(self.default, |(_, i)| *i);
        &self.classes[i]
    }

    /// A class by name.
    pub fn get(&self, name: &str) -> Option<&ClassSpec> {
        self.classes.iter().find(|c| c.name.as_str() == name)
    }

    /// The default class.
    pub fn default_class(&self) -> &ClassSpec {
        &self.classes[self.default]
    }

    /// Every class.
    pub fn classes(&self) -> &[ClassSpec] {
        &self.classes
    }

    /// The LockGrant documents, if the registry carries any.
    pub fn grants(&self) -> Option<&GrantSet> {
        self.grants.as_ref()
    }

    /// The prefix-to-class map (`(prefix, class)`, longest prefix first) and the
    /// default class: what the authoritative map in etcd records.
    pub fn prefix_map(&self) -> (Vec<(String, String)>, String) {
        let map = self.prefixes.iter().map(|(p, i)| (p.clone(), self.classes[*i].name.to_string())).collect();
        (map, self.default_class().name.to_string())
    }

    /// True when some class names this namespace in a prefix (metrics label
    /// namespaces from the registry only, never from callers).
    pub fn knows_namespace(&self, ns: &str) -> bool {
        self.prefixes.iter().any(|(p, _)| p.split('/').next() == Some(ns))
    }

    /// What a valid registry should still tell its owner: expired waivers, as
    /// `(path, message)` with `today` in days since 1970-01-01.
    pub fn warnings(&self, today: i64) -> Vec<FieldError> {
        self.classes
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match &c.enforcement {
                Enforcement::Advisory { risk_owner, waiver_expiry_day } if *waiver_expiry_day < today => {
                    Some(FieldError {
                        path: format!("classes[{i}].waiver_expiry"),
                        message: format!(
                            "the advisory waiver of class {} expired {} days ago; renew it on the record or fence \
                             the class (risk owner {risk_owner})",
                            c.name,
                            today - waiver_expiry_day
                        ),
                    })
                }
                _ => None,
            })
            .collect()
    }

    /// Classes whose advisory waiver has expired by `today`.
    pub fn expired_waivers(&self, today: i64) -> Vec<&ClassName> {
        self.classes
            .iter()
            .filter(|c| matches!(c.enforcement, Enforcement::Advisory { waiver_expiry_day, .. } if waiver_expiry_day < today))
            .map(|c| &c.name)
            .collect()
    }
}

#[cfg(test)]
mod tests;
