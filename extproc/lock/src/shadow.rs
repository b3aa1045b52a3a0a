//! Shadow policies (envoyproxy/ratelimit's `shadow_mode`, without failing open;
//! docs/CLASSES.md): a class may carry a `candidate` policy (a limit, a lock-delay,
//! a TTL) evaluated beside the enforced one. The enforced policy alone decides:
//! nothing here changes an answer, a compare or a write of a grant. Every decision
//! the candidate would make differently is
//!
//! - counted by namespace, class, decision and reason (`lockmesh_arbiter_shadow_decisions_total`),
//! - kept for the last 24 hours by class ([`Shadow::last_day`], `/status` and the console),
//! - and written to the audit: `<root>/w/<class>` (no lease, one key per class,
//!   overwritten) carries the latest decision and how many decisions it stands for,
//!   so the tailer records `would_refuse` / `would_grant` events.
//!
//! Where each decision is taken (`mutex`, `delay`, `session`):
//!
//! | candidate | would_refuse | would_grant |
//! |---|---|---|
//! | `max_holders` below the enforced limit | a grant after which the key has more holders than the candidate allows (`key_gated`) | |
//! | `max_holders` above it | | an acquire refused `key_gated` while the key had fewer holders than the candidate allows (once per acquire) |
//! | `lock_delay_s` above the enforced one | a grant within the candidate's delay of an end without a release this arbiter saw (`lock_delay`) | |
//! | `lock_delay_s` below it | | an acquire refused `lock_delay` after the candidate's delay had passed (once per acquire) |
//! | `ttl_s` below the enforced TTL | a keepalive of a session of the class that came later than the candidate's TTL after the last one etcd saw (`session_expired`: the candidate would have expired it) | |
//!
//! A longer candidate TTL makes no decision this arbiter can see (a keepalive that
//! never came); such candidates are counted for nothing, and docs say so.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use lockmesh_core::{ClassRegistry, ClassSpec, KeyDigest, LockKey};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{now_ms, Store};

pub use lockmesh_keyspace::{ShadowDecision as Decision, ShadowRecord};

/// Audit records written per class and second at most.
pub const AUDIT_PER_S: u32 = 20;

/// One row of [`Shadow::last_day`] and of [`Shadow::totals`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowCount {
    /// The key's namespace when the registry names it, else `other` (totals only;
    /// empty in [`Shadow::last_day`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub namespace: String,
    pub class: String,
    pub decision: Decision,
    pub reason: String,
    pub count: u64,
}

#[derive(Default)]
struct Book {
    /// Since start, by (namespace label, class, decision, reason).
    totals: HashMap<(String, String, Decision, &'static str), u64>,
    /// The last 24 hours, one map per hour (hour since the epoch), oldest first.
    hours: VecDeque<(u64, HashMap<(String, Decision, &'static str), u64>)>,
    /// Audit pacing by class: (second, records written in it, decisions not yet written).
    pace: HashMap<String, (u64, u32, u64)>,
    /// Namespaces the registry names (labels; anything else is `other`).
    namespaces: HashSet<String>,
    /// The registry's classes that carry a candidate, by name.
    classes: HashMap<String, Arc<ClassSpec>>,
}

/// One arbiter's shadow book ([`crate::runtime::Runtime::shadow`]): the
/// registry's candidates, what they decided here, and the ends without a release
/// this arbiter saw.
#[derive(Default)]
pub struct Shadow {
    book: Mutex<Book>,
    /// When this arbiter saw a hold of a key end without a release, by digest (the
    /// candidate lock-delay's memory; bounded by [`MAX_ENDS`]).
    ends: RwLock<HashMap<KeyDigest, Instant>>,
    /// Acquires already counted for a would-grant, with their deadlines (bounded:
    /// an entry goes when its deadline has passed).
    once: Mutex<Vec<(AcquireId, &'static str)>>,
}

const MAX_ENDS: usize = 100_000;

/// The candidate lock-delay of `class` when it differs from the enforced one (the
/// hold-delete watch must then run for it).
pub(crate) fn candidate_delay(class: &ClassSpec) -> Option<u64> {
    class.candidate.filter(|k| k.lock_delay_s != class.lock_delay_s).map(|k| k.lock_delay_s)
}

/// Whether a grant of `class` needs the key's holder count after it (a stricter
/// candidate limit).
pub(crate) fn wants_count(class: &ClassSpec, limit: u32) -> bool {
    class.candidate.is_some_and(|k| k.max_holders < limit)
}

/// One acquire: its session's lease, its key and its deadline (unique enough to
/// count a decision once per acquire across its attempts).
pub(crate) type AcquireId = (i64, KeyDigest, Instant);

impl Shadow {
    /// Runs `f` on the book.
    fn book<R>(&self, f: impl FnOnce(&mut Book) -> R) -> R {
        f(&mut self.book.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Takes the registry's namespaces (at start and at every reload).
    pub fn set_registry(&self, reg: &ClassRegistry) {
        let ns: HashSet<String> = reg
            .classes()
            .iter()
            .flat_map(|c| c.prefixes.iter().map(|p| p.split('/').next().unwrap_or_default().to_owned()))
            .collect();
        let classes = reg
            .classes()
            .iter()
            .filter(|c| c.candidate.is_some())
            .map(|c| (c.name.to_string(), Arc::new(c.clone())))
            .collect();
        self.book(|b| {
            b.namespaces = ns;
            b.classes = classes;
        });
    }

    /// Counts a differing decision of `class`'s candidate on `key` and writes its audit
    /// record (paced) in the background.
    pub(crate) fn note(
        &self,
        store: &Store,
        class: &ClassSpec,
        (ns, digest): (&str, Option<String>),
        decision: Decision,
        reason: &'static str,
        values: (u64, u64),
    ) {
        let now = now_ms();
        let (sec, hour) = (now / 1000, now / 3_600_000);
        let write = self.book(|b| {
            let label = if b.namespaces.contains(ns) { ns.to_owned() } else { "other".to_owned() };
            *b.totals.entry((label, class.name.to_string(), decision, reason)).or_default() += 1;
            if b.hours.back().is_none_or(|(h, _)| *h != hour) {
                b.hours.push_back((hour, HashMap::new()));
            }
            while b.hours.front().is_some_and(|(h, _)| *h + 24 <= hour) {
                b.hours.pop_front();
            }
            if let Some((_, m)) = b.hours.back_mut() {
                *m.entry((class.name.to_string(), decision, reason)).or_default() += 1;
            }
            let p = b.pace.entry(class.name.to_string()).or_insert((sec, 0, 0));
            if p.0 != sec {
                *p = (sec, 0, p.2);
            }
            p.2 += 1;
            if p.1 >= AUDIT_PER_S {
                return None;
            }
            p.1 += 1;
            let count = std::mem::take(&mut p.2);
            Some(count)
        });
        let Some(count) = write else { return };
        let rec = ShadowRecord {
            decision,
            reason: reason.to_owned(),
            class: class.name.to_string(),
            digest,
            count,
            enforced: values.0,
            candidate: values.1,
            at_ms: now,
        };
        // A gated kind (`upgrade`): written only once enabled, comparing this
        // arbiter's advertisement; otherwise only counted.
        if !store.guard().enabled(super::upgrade::Capability::ShadowRecords) {
            return;
        }
        let Ok(ad) = store.guard().advertisement() else { return };
        let (mut client, k) = (store.cluster().client(), store.cluster().keys().shadow_record(class.name.as_str()));
        tokio::spawn(async move {
            let Ok(v) = serde_json::to_vec(&rec) else { return };
            let cmp: Vec<etcd_client::Compare> = ad
                .iter()
                .map(|(key, lease)| etcd_client::Compare::lease(key.as_str(), etcd_client::CompareOp::Equal, *lease))
                .collect();
            let txn = etcd_client::Txn::new().when(cmp).and_then([etcd_client::TxnOp::put(k, v, None)]);
            if let Err(e) = tokio::time::timeout(Duration::from_secs(5), client.txn(txn))
                .await
                .unwrap_or_else(|_| Err(etcd_client::Error::InvalidArgs("timed out".into())))
            {
                tracing::debug!(error = %e, class = %rec.class, "could not write a shadow decision's audit record; it is counted");
            }
        });
    }

    /// The counts since start, by namespace label, class, decision and reason.
    pub fn totals(&self) -> Vec<ShadowCount> {
        let mut v: Vec<ShadowCount> = self.book(|b| {
            b.totals
                .iter()
                .map(|((ns, c, d, r), n)| ShadowCount {
                    namespace: ns.clone(),
                    class: c.clone(),
                    decision: *d,
                    reason: (*r).to_owned(),
                    count: *n,
                })
                .collect()
        });
        v.sort_by(|a, b| {
            (&a.namespace, &a.class, a.decision, &a.reason).cmp(&(&b.namespace, &b.class, b.decision, &b.reason))
        });
        v
    }

    /// The counts of the last 24 hours at this arbiter, by class, decision and reason.
    pub fn last_day(&self) -> Vec<ShadowCount> {
        let hour = now_ms() / 3_600_000;
        let mut sum: HashMap<(String, Decision, &'static str), u64> = HashMap::new();
        self.book(|b| {
            for (h, m) in &b.hours {
                if h + 24 > hour {
                    for (k, n) in m {
                        *sum.entry(k.clone()).or_default() += n;
                    }
                }
            }
        });
        let mut v: Vec<ShadowCount> = sum
            .into_iter()
            .map(|((c, d, r), n)| ShadowCount {
                namespace: String::new(),
                class: c,
                decision: d,
                reason: r.to_owned(),
                count: n,
            })
            .collect();
        v.sort_by(|a, b| (&a.class, a.decision, &a.reason).cmp(&(&b.class, b.decision, &b.reason)));
        v
    }

    /// This arbiter saw the hold of `d` end without a release now.
    pub(crate) fn saw_end(&self, d: &KeyDigest) {
        let mut m = self.ends.write().unwrap_or_else(|p| p.into_inner());
        if m.len() >= MAX_ENDS {
            let cutoff = Instant::now() - Duration::from_secs(u64::from(u16::MAX));
            m.retain(|_, at| *at > cutoff);
            if m.len() >= MAX_ENDS {
                m.clear();
            }
        }
        m.insert(d.clone(), Instant::now());
    }

    /// How long ago this arbiter saw the hold of `d` end without a release.
    pub(crate) fn since_end(&self, d: &KeyDigest) -> Option<Duration> {
        self.ends.read().unwrap_or_else(|p| p.into_inner()).get(d).map(Instant::elapsed)
    }

    // === the decision points ===

    /// After a grant of `key` that left `holders` holders: a stricter candidate limit
    /// or lock-delay would have refused it.
    pub(crate) fn after_grant(
        &self,
        store: &Store,
        class: &ClassSpec,
        key: &LockKey,
        holders: Option<u64>,
        limit: u32,
    ) {
        let Some(k) = class.candidate else { return };
        if let Some(n) = holders {
            if k.max_holders < limit && n > u64::from(k.max_holders) {
                self.note(
                    store,
                    class,
                    (key.namespace(), Some(key.digest().to_string())),
                    Decision::WouldRefuse,
                    "key_gated",
                    (u64::from(limit), u64::from(k.max_holders)),
                );
                return;
            }
        }
        if k.lock_delay_s > class.lock_delay_s {
            if let Some(ago) = self.since_end(&key.digest()) {
                if ago < Duration::from_secs(k.lock_delay_s) {
                    self.note(
                        store,
                        class,
                        (key.namespace(), Some(key.digest().to_string())),
                        Decision::WouldRefuse,
                        "lock_delay",
                        (class.lock_delay_s, k.lock_delay_s),
                    );
                }
            }
        }
    }

    /// Whether this is the first time `id` is counted for `reason`.
    fn first_time(&self, id: &AcquireId, reason: &'static str) -> bool {
        let mut g = self.once.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        g.retain(|((_, _, deadline), _)| *deadline > now);
        if g.iter().any(|(i, r)| i == id && *r == reason) || g.len() >= 10_000 {
            return false;
        }
        g.push((id.clone(), reason));
        true
    }

    /// An acquire refused `key_gated` with `holders` holders: a looser candidate limit
    /// would have granted it. Once per acquire.
    pub(crate) fn after_gated(
        &self,
        store: &Store,
        class: &ClassSpec,
        key: &LockKey,
        holders: u32,
        limit: u32,
        id: &AcquireId,
    ) {
        let Some(k) = class.candidate else { return };
        if k.max_holders > limit && holders < k.max_holders && self.first_time(id, "key_gated") {
            self.note(
                store,
                class,
                (key.namespace(), Some(key.digest().to_string())),
                Decision::WouldGrant,
                "key_gated",
                (u64::from(limit), u64::from(k.max_holders)),
            );
        }
    }

    /// An acquire refused `lock_delay` with `left` of the enforced delay to go: a
    /// shorter candidate delay would have granted it. Once per acquire.
    pub(crate) fn after_delayed(
        &self,
        store: &Store,
        class: &ClassSpec,
        key: &LockKey,
        left: Duration,
        id: &AcquireId,
    ) {
        let Some(k) = class.candidate else { return };
        let passed = Duration::from_secs(class.lock_delay_s).saturating_sub(left);
        if k.lock_delay_s < class.lock_delay_s
            && passed >= Duration::from_secs(k.lock_delay_s)
            && self.first_time(id, "lock_delay")
        {
            self.note(
                store,
                class,
                (key.namespace(), Some(key.digest().to_string())),
                Decision::WouldGrant,
                "lock_delay",
                (class.lock_delay_s, k.lock_delay_s),
            );
        }
    }

    /// A keepalive of a session of `class` (namespace `ns`) whose lease had `remaining`
    /// of `ttl_s` left: a shorter candidate TTL would have let it expire.
    pub(crate) fn at_keepalive(&self, store: &Store, class: &ClassSpec, ns: &str, ttl_s: u64, remaining: Duration) {
        let Some(k) = class.candidate else { return };
        let gap = Duration::from_secs(ttl_s).saturating_sub(remaining);
        if k.ttl_s < ttl_s && gap > Duration::from_secs(k.ttl_s) {
            self.note(store, class, (ns, None), Decision::WouldRefuse, "session_expired", (ttl_s, k.ttl_s));
        }
    }

    /// The class named `name` if its keepalives need the lease's remaining TTL (a
    /// candidate TTL shorter than the enforced one).
    pub(crate) fn ttl_candidate(&self, name: &str) -> Option<Arc<ClassSpec>> {
        self.book(|b| b.classes.get(name).cloned()).filter(|c| c.candidate.is_some_and(|k| k.ttl_s < c.ttl_s))
    }

    /// The candidate lock-delay of class `name`, when it differs from the enforced one.
    pub(crate) fn delay_candidate(&self, name: &str) -> Option<u64> {
        self.book(|b| b.classes.get(name).cloned()).and_then(|c| candidate_delay(&c))
    }

    /// Whether any class has a candidate lock-delay other than its enforced one.
    pub(crate) fn any_delay_candidate(&self) -> bool {
        self.book(|b| b.classes.values().any(|c| candidate_delay(c).is_some()))
    }
}
