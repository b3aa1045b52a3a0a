//! Read-only views of the lock key space for operators, shared by `lockctl
//! inspect`, `lockctl saturated` and the arbiter's console (`console`):
//!
//! - [`inspect_key`]: one key's holders (identity, instance, session, age), its
//!   authoritative class, limit and admission state.
//! - [`scan_holds`]: every open hold under the root, read page by page at one
//!   revision, grouped by class (open grants, oldest) and by key digest, from
//!   which [`saturated`] takes the keys at their authoritative limit.
//!
//! Nothing here writes. A scan names keys by digest only (the hold records carry
//! the raw key; it is dropped as soon as the record is read), so its output may go
//! to a console or a terminal; [`inspect_key`] is asked about one raw key the
//! operator typed, and shows holders' identities as `lockctl admin` does.

use std::collections::{BTreeMap, HashMap};

use etcd_client::{Client, GetOptions};
use lockmesh_core::{policy::ClassPolicy, LockKey};
use serde::Serialize;

use crate::etcd_retry::Etcd;
use lockmesh_lock::{keys::prefix_end, policy::ClassMapRecord, HoldRecord, Keys};

/// Holds read per etcd range request while scanning.
pub(crate) const SCAN_PAGE: i64 = 1000;
/// Default bound of a scan (holds); beyond it the result says `truncated`.
pub const DEFAULT_SCAN_MAX: usize = 100_000;

/// One holder of a key, as an operator sees it (never the token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HolderInfo {
    /// Slot (0..limit-1).
    pub slot: u32,
    /// Holder identity (SPIFFE ID).
    pub identity: String,
    /// Declared instance, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Session id (16 hex digits).
    pub session: String,
    /// Epoch of the grant.
    pub epoch: u64,
    /// Time held, ms (from the grant's wall clock; informational).
    pub age_ms: u64,
}

/// One key as `lockctl inspect` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyView {
    /// The key's digest (what etcd, logs and the audit store name it by).
    pub digest: String,
    /// Its authoritative class (the prefix map in etcd), if the map exists.
    pub class: Option<String>,
    /// The class's authoritative holder limit.
    pub limit: Option<u32>,
    /// `active` or `draining`.
    pub state: Option<String>,
    /// The pending lowered limit while draining.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending_target: Option<u32>,
    /// The holders, by slot.
    pub holders: Vec<HolderInfo>,
    /// The etcd revision the holders were read at.
    pub revision: i64,
}

/// Open grants of one class.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ClassHolds {
    /// Open holds of the class, across all its keys.
    pub open: u64,
    /// Keys with at least one hold.
    pub keys: u64,
    /// Age of the oldest open hold, ms.
    pub oldest_age_ms: u64,
    /// Open holds by age: `ages[i]` are younger than [`AGE_BOUNDS_MS`]`[i]` and at
    /// least the bound before old; the last, at least the last bound (the
    /// console's hold-age distribution; not in `lockctl`'s output).
    #[serde(skip)]
    pub ages: [u64; AGE_BOUNDS_MS.len() + 1],
}

/// The upper bounds of [`ClassHolds::ages`]' buckets, ms: 1 s, 5 s, 10 s, 30 s,
/// 1 min, 5 min, 15 min, 1 h, 4 h.
pub const AGE_BOUNDS_MS: [u64; 9] = [1_000, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000, 3_600_000, 14_400_000];

/// The bucket of [`ClassHolds::ages`] a hold `age_ms` old counts in.
pub fn age_bucket(age_ms: u64) -> usize {
    AGE_BOUNDS_MS.iter().position(|b| age_ms < *b).unwrap_or(AGE_BOUNDS_MS.len())
}

/// The holds of one key (by digest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyHolds {
    pub digest: String,
    /// The class recorded in its holds.
    pub class: String,
    /// Open holds on this key.
    pub holders: u32,
    /// Age of its oldest hold, ms.
    pub oldest_age_ms: u64,
}

/// Every open hold under a root, at one revision.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HoldScan {
    /// By class name.
    pub classes: BTreeMap<String, ClassHolds>,
    /// By key digest, in digest order.
    pub keys: Vec<KeyHolds>,
    /// Hold records read, across every class.
    pub holds: usize,
    /// True when the scan stopped at its bound before the end of the range.
    pub truncated: bool,
    /// The etcd revision every page was read at.
    pub revision: i64,
}

/// A key at its authoritative limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Saturated {
    pub digest: String,
    pub class: String,
    /// Open holds on this key.
    pub holders: u32,
    /// The class's authoritative limit.
    pub limit: u32,
    /// Age of its oldest hold, ms.
    pub oldest_age_ms: u64,
}

/// Every class policy record under the root, by class.
pub async fn read_policies(
    client: &mut Client,
    root: &str,
) -> Result<BTreeMap<String, ClassPolicy>, etcd_client::Error> {
    let keys = Keys::new(root);
    let r = Etcd::of(client).get(keys.class_policies(), Some(GetOptions::new().with_prefix())).await?;
    Ok(r.kvs()
        .iter()
        .filter_map(|kv| serde_json::from_slice::<ClassPolicy>(kv.value()).ok())
        .map(|p| (p.class.clone(), p))
        .collect())
}

/// Reads one key's holders, its authoritative class and its policy.
pub async fn inspect_key(
    client: &mut Client,
    root: &str,
    key: &LockKey,
    now_ms: u64,
) -> Result<KeyView, etcd_client::Error> {
    let keys = Keys::new(root);
    let d = key.digest();
    let etcd = Etcd::of(client);
    let r = etcd.get(keys.holds(&d), Some(GetOptions::new().with_prefix())).await?;
    let revision = r.header().map_or(0, |h| h.revision());
    let holders = r
        .kvs()
        .iter()
        .filter_map(|kv| {
            let h: HoldRecord = serde_json::from_slice(kv.value()).ok()?;
            let slot = std::str::from_utf8(kv.key()).ok()?.rsplit('/').next()?.parse().ok()?;
            Some(HolderInfo {
                slot,
                identity: h.owner,
                instance: h.instance,
                session: format!("{:016x}", kv.lease()),
                epoch: h.epoch,
                age_ms: now_ms.saturating_sub(h.acquired_ms),
            })
        })
        .collect();
    let map = etcd.get(keys.class_map(), None).await?;
    let class = map
        .kvs()
        .first()
        .and_then(|kv| serde_json::from_slice::<ClassMapRecord>(kv.value()).ok())
        .map(|m| m.class_of(key.as_str()).to_owned());
    let policy = match &class {
        Some(c) => etcd
            .get(keys.class_policy(c), None)
            .await?
            .kvs()
            .first()
            .and_then(|kv| serde_json::from_slice::<ClassPolicy>(kv.value()).ok()),
        None => None,
    };
    Ok(KeyView {
        digest: d.to_string(),
        class,
        limit: policy.as_ref().map(|p| p.limit),
        state: policy.as_ref().map(|p| state_str(p).to_owned()),
        pending_target: policy.as_ref().and_then(|p| p.pending_target),
        holders,
        revision,
    })
}

/// `active` or `draining`.
pub fn state_str(p: &ClassPolicy) -> &'static str {
    match p.state {
        lockmesh_core::policy::PolicyState::Active => "active",
        lockmesh_core::policy::PolicyState::Draining => "draining",
    }
}

/// Reads every hold under `root` (up to `max`), page by page at the revision of
/// the first page, so the result is one consistent snapshot.
pub async fn scan_holds(
    client: &mut Client,
    root: &str,
    max: usize,
    now_ms: u64,
) -> Result<HoldScan, etcd_client::Error> {
    let keys = Keys::new(root);
    let prefix = keys.all_locks();
    let end = prefix_end(&prefix);
    let mut from = prefix.into_bytes();
    let mut scan = HoldScan::default();
    let mut per_key: BTreeMap<String, KeyHolds> = BTreeMap::new();
    loop {
        let left = max.saturating_sub(scan.holds);
        let page = SCAN_PAGE.min(i64::try_from(left).unwrap_or(SCAN_PAGE)).max(1);
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(page);
        if scan.revision > 0 {
            opts = opts.with_revision(scan.revision);
        }
        let r = Etcd::of(client).get(from.clone(), Some(opts)).await?;
        if scan.revision == 0 {
            scan.revision = r.header().map_or(0, |h| h.revision());
        }
        for kv in r.kvs() {
            if scan.holds >= max {
                scan.truncated = true;
                break;
            }
            let (Some(d), Ok(h)) = (keys.digest_of_hold(kv.key()), serde_json::from_slice::<HoldRecord>(kv.value()))
            else {
                continue;
            };
            scan.holds += 1;
            let age = now_ms.saturating_sub(h.acquired_ms);
            let k = per_key.entry(d.to_string()).or_insert_with(|| KeyHolds {
                digest: d.to_string(),
                class: h.class.clone(),
                holders: 0,
                oldest_age_ms: 0,
            });
            k.holders += 1;
            k.oldest_age_ms = k.oldest_age_ms.max(age);
            let c = scan.classes.entry(h.class).or_default();
            c.open += 1;
            c.oldest_age_ms = c.oldest_age_ms.max(age);
            c.ages[age_bucket(age)] += 1;
        }
        match r.kvs().last() {
            Some(last) if r.more() && !scan.truncated => {
                from = last.key().to_vec();
                from.push(0);
            }
            Some(_) if r.more() => {
                scan.truncated = true;
                break;
            }
            _ => break,
        }
    }
    for k in per_key.values() {
        if let Some(c) = scan.classes.get_mut(&k.class) {
            c.keys += 1;
        }
    }
    scan.keys = per_key.into_values().collect();
    Ok(scan)
}

/// The keys of `scan` at (or above, after a lowering) their class's authoritative
/// limit, fullest and then oldest first, at most `top`; `class` filters.
pub fn saturated(scan: &HoldScan, limits: &HashMap<String, u32>, class: Option<&str>, top: usize) -> Vec<Saturated> {
    let mut out: Vec<Saturated> = scan
        .keys
        .iter()
        .filter(|k| class.is_none_or(|c| c == k.class))
        .filter_map(|k| {
            let limit = *limits.get(&k.class)?;
            (k.holders >= limit).then(|| Saturated {
                digest: k.digest.clone(),
                class: k.class.clone(),
                holders: k.holders,
                limit,
                oldest_age_ms: k.oldest_age_ms,
            })
        })
        .collect();
    out.sort_by(|a, b| b.holders.cmp(&a.holders).then(b.oldest_age_ms.cmp(&a.oldest_age_ms)));
    out.truncate(top);
    out
}

/// Saturated keys of every class of `scan` (for counts per class).
pub fn saturated_per_class(scan: &HoldScan, limits: &HashMap<String, u32>) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for k in &scan.keys {
        if limits.get(&k.class).is_some_and(|l| k.holders >= *l) {
            *out.entry(k.class.clone()).or_default() += 1;
        }
    }
    out
}

/// A duration in ms for people: `850ms`, `12.3s`, `4m05s`, `2h03m`, `3d04h`.
pub fn human_ms(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms}ms"),
        1..=59 => format!("{}.{}s", s, (ms % 1000) / 100),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kh(d: &str, class: &str, n: u32, age: u64) -> KeyHolds {
        KeyHolds { digest: d.into(), class: class.into(), holders: n, oldest_age_ms: age }
    }

    #[test]
    fn saturated_keys_are_those_at_their_limit_fullest_then_oldest_first() {
        let scan = HoldScan {
            keys: vec![kh("a", "pool", 3, 10), kh("b", "pool", 2, 99), kh("c", "mutex", 1, 5), kh("d", "pool", 3, 50)],
            ..Default::default()
        };
        let limits = HashMap::from([("pool".to_string(), 3), ("mutex".to_string(), 1)]);
        let s = saturated(&scan, &limits, None, 10);
        let order: Vec<&str> = s.iter().map(|k| k.digest.as_str()).collect();
        assert_eq!(order, ["d", "a", "c"]);
        assert_eq!(saturated(&scan, &limits, Some("pool"), 1).len(), 1);
        // A class without a policy record is never guessed at.
        assert!(saturated(&scan, &HashMap::new(), None, 10).is_empty());
        // Over the limit (after a lowering) counts as saturated.
        let low = HashMap::from([("pool".to_string(), 2)]);
        assert_eq!(saturated(&scan, &low, Some("pool"), 10).len(), 3);
        assert_eq!(saturated_per_class(&scan, &limits).get("pool"), Some(&2));
    }

    #[test]
    fn a_hold_counts_in_the_age_bucket_below_its_bound() {
        assert_eq!(age_bucket(0), 0);
        assert_eq!(age_bucket(999), 0);
        assert_eq!(age_bucket(1_000), 1);
        assert_eq!(age_bucket(59_999), 4);
        assert_eq!(age_bucket(14_399_999), 8);
        assert_eq!(age_bucket(14_400_000), AGE_BOUNDS_MS.len());
        assert_eq!(age_bucket(u64::MAX), AGE_BOUNDS_MS.len());
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(human_ms(850), "850ms");
        assert_eq!(human_ms(12_345), "12.3s");
        assert_eq!(human_ms(245_000), "4m05s");
        assert_eq!(human_ms(7_380_000), "2h03m");
        assert_eq!(human_ms(273_600_000), "3d04h");
    }
}
