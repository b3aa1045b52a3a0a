//! What one workload run records while its clients cycle.
//!
//! Grants are recorded per key under that key's lock, by the client that got the
//! grant, after its acquire answered and before it sends the release. For a mutex
//! that order is the grant order: the next holder's grant commits only after that
//! release. So per key the recorded tokens must strictly increase.
//!
//! FIFO: a client's wait runs from sending its acquire to receiving the grant.
//! Each grant to another client of the key during that wait is counted. A FIFO
//! lock lets every other client in at most once per wait (a client that releases
//! and asks again queues behind the waiters), so `max_by_one` is 1; both ends are
//! seen from the client side, so a boundary race can show 2. `max_total` is at
//! most the number of other clients of the key under FIFO.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One grant, in grant order per key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantRecord {
    /// Key index within the run.
    pub key: u32,
    /// Client index within the run.
    pub client: u32,
    /// The token (see [`super::Workload::tokens_unique`]).
    pub token: u64,
}

/// FIFO figures over all keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fairness {
    /// Most grants one client got while another single client waited.
    pub max_by_one: u32,
    /// Most grants to others during one wait.
    pub max_total: u32,
    /// Waits that saw at least one client served twice (FIFO broken or a race).
    pub overtaken_waits: u64,
    /// Waits observed (grants with a recorded request).
    pub waits: u64,
}

/// The shared recorder of one workload run.
pub(crate) struct Recorder {
    keys: Vec<Mutex<KeyState>>,
    /// Tokens seen, by key: grants of one group share a revision across keys
    /// (docs/DECISIONS.md ADR-02), never on one key.
    seen: Option<Mutex<HashSet<(u32, u64)>>>,
    duplicates: AtomicU64,
    grants: Option<Mutex<Vec<GrantRecord>>>,
    errors: Mutex<BTreeMap<String, u64>>,
    ordered: bool,
}

#[derive(Default)]
struct KeyState {
    last: Option<u64>,
    out_of_order: u64,
    waiting: HashMap<u32, Wait>,
    fair: Fairness,
}

#[derive(Default)]
struct Wait {
    by: HashMap<u32, u32>,
    total: u32,
    overtaken: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// === impl Recorder ===

impl Recorder {
    /// A recorder for `keys` keys; `unique` also checks that no token is granted
    /// twice on one key.
    pub fn new(keys: usize, unique: bool, keep_grants: bool) -> Self {
        Self {
            keys: (0..keys).map(|_| Mutex::default()).collect(),
            seen: unique.then(Mutex::default),
            duplicates: AtomicU64::new(0),
            grants: keep_grants.then(Mutex::default),
            errors: Mutex::default(),
            ordered: true,
        }
    }

    /// Whether tokens must increase per key in grant order (a mutex); with more
    /// holders per key they need not, and out-of-order grants are not counted.
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.ordered = ordered;
        self
    }

    /// Client `client` starts waiting for key `key` (just before sending).
    pub fn requested(&self, key: usize, client: usize) {
        let mut st = lock(&self.keys[key]);
        st.waiting.insert(client as u32, Wait::default());
    }

    /// Client `client` gave up its acquire of `key`.
    pub fn withdrawn(&self, key: usize, client: usize) {
        lock(&self.keys[key]).waiting.remove(&(client as u32));
    }

    /// Client `client` was granted `key` with `token`.
    pub fn granted(&self, key: usize, client: usize, token: u64) {
        let client = client as u32;
        let mut st = lock(&self.keys[key]);
        if self.ordered && st.last.is_some_and(|last| token <= last) {
            st.out_of_order += 1;
        }
        st.last = Some(token);
        if let Some(w) = st.waiting.remove(&client) {
            st.fair.waits += 1;
            st.fair.overtaken_waits += u64::from(w.overtaken);
        }
        let mut fair = st.fair;
        for w in st.waiting.values_mut() {
            let n = w.by.entry(client).or_default();
            *n += 1;
            w.total += 1;
            w.overtaken |= *n > 1;
            fair.max_by_one = fair.max_by_one.max(*n);
            fair.max_total = fair.max_total.max(w.total);
        }
        st.fair = fair;
        if let Some(seen) = &self.seen {
            if !lock(seen).insert((key as u32, token)) {
                self.duplicates.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(g) = &self.grants {
            // Still under the key's lock: the log keeps grant order per key.
            lock(g).push(GrantRecord { key: key as u32, client, token });
        }
    }

    /// Counts an error under `what: message` (messages cut to 120 characters).
    pub fn error(&self, what: &str, message: &str) {
        let msg: String = message.chars().take(120).collect();
        *lock(&self.errors).entry(format!("{what}: {msg}")).or_default() += 1;
    }

    /// Tokens that did not strictly increase over the previous grant of their key.
    pub(crate) fn out_of_order(&self) -> u64 {
        self.keys.iter().map(|k| lock(k).out_of_order).sum()
    }

    /// Tokens seen twice on one key (only when checked).
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// FIFO figures, the worst key's.
    pub fn fairness(&self) -> Fairness {
        self.keys.iter().fold(Fairness::default(), |acc, k| {
            let f = lock(k).fair;
            Fairness {
                max_by_one: acc.max_by_one.max(f.max_by_one),
                max_total: acc.max_total.max(f.max_total),
                overtaken_waits: acc.overtaken_waits + f.overtaken_waits,
                waits: acc.waits + f.waits,
            }
        })
    }

    /// Errors by kind.
    pub fn errors(&self) -> BTreeMap<String, u64> {
        lock(&self.errors).clone()
    }

    /// The grant log, if kept.
    pub fn grants(&self) -> Vec<GrantRecord> {
        self.grants.as_ref().map(|g| lock(g).clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_handoff_counts_one_grant_per_other_client() {
        let r = Recorder::new(1, true, true);
        // Three clients queue; each is served once while the others wait.
        for c in 0..3 {
            r.requested(0, c);
        }
        for (t, c) in [(10, 0), (11, 1), (12, 2)] {
            r.granted(0, c, t);
            r.requested(0, c);
        }
        let f = r.fairness();
        assert_eq!((f.max_by_one, f.max_total, f.overtaken_waits), (1, 2, 0));
        assert_eq!(r.out_of_order(), 0);
        assert_eq!(r.grants().len(), 3);
    }

    #[test]
    fn a_hog_and_a_backwards_token_are_seen() {
        let r = Recorder::new(2, true, false);
        r.requested(0, 0);
        r.requested(0, 1);
        r.granted(0, 0, 5);
        r.requested(0, 0);
        r.granted(0, 0, 4); // backwards, and client 0 again while 1 waits
        r.granted(1, 2, 5); // same token on another key: one group's revision
        assert_eq!(r.duplicates(), 0);
        r.granted(1, 3, 5); // and again on that key: a duplicate
        let f = r.fairness();
        assert_eq!(f.max_by_one, 2);
        assert_eq!(r.out_of_order(), 2);
        assert_eq!(r.duplicates(), 1);
        r.granted(0, 1, 6);
        assert_eq!(r.fairness().overtaken_waits, 1);
    }
}
