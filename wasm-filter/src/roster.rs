//! Rosters: the Envoy-wide lists the workers of one Envoy share through proxy-wasm
//! shared data (one process-wide store per `vm_id`, updated by compare-and-swap).
//!
//! A roster value holds named records, each an ordered list of [`Entry`]s that name
//! a request by its worker (`owner`, a tag unique per root context in this Envoy) and
//! its context id, with a time after which the entry is stale. Two uses:
//!
//! - **The backlog** (ADR-14): per lock key, the waiters queued on any worker, in the
//!   order they were queued. Keys hash into [`BACKLOG_BUCKETS`] values, so shared
//!   data holds a bounded number of entries however many keys ever queued (shared
//!   data keys can never be deleted, only emptied).
//! - **Tier-1 local limits**: per `local_limits` prefix, the acquire requests inside
//!   this Envoy.
//!
//! Stale entries (their owner trapped, or missed its cleanup) are dropped by whoever
//! rewrites the value next, so a lost entry costs a bounded delay, never a stuck key.
//! Decoding never fails: an unreadable value reads as empty and is overwritten.

/// Number of shared-data values the backlog is spread over.
pub(crate) const BACKLOG_BUCKETS: u32 = 256;
/// How long after its deadline a backlog entry is considered abandoned, ms.
pub(crate) const BACKLOG_GRACE_MS: u64 = 2_000;

const VERSION: u8 = 1;

/// A request on some worker of this Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The worker (root context) that owns it.
    pub owner: u32,
    /// Its HTTP context id on that worker.
    pub ctx: u32,
    /// After this time (ms) the entry is stale and is dropped.
    pub expires_ms: u64,
}

/// A decoded roster value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Roster {
    records: Vec<(String, Vec<Entry>)>,
}

/// The shared-data name of the backlog bucket holding `key`.
pub(crate) fn backlog_bucket(key: &str) -> String {
    // FNV-1a: stable across workers and builds (std's hashers are not guaranteed to be).
    let h = key.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    format!("lockmesh.backlog.{}", h % BACKLOG_BUCKETS)
}

/// The shared-data name of the in-flight roster of local limit `prefix`.
pub(crate) fn limit_roster(prefix: &str) -> String {
    format!("lockmesh.limit.{prefix}")
}

// === impl Roster ===

impl Roster {
    /// Decodes a shared-data value; anything unreadable is an empty roster.
    pub fn decode(bytes: &[u8]) -> Self {
        Self::try_decode(bytes).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        if bytes.is_empty() {
            return Some(Self::default());
        }
        if r.u8()? != VERSION {
            return None;
        }
        let n = r.u32()?;
        let mut records = Vec::new();
        for _ in 0..n {
            let len = usize::try_from(r.u32()?).ok()?;
            let name = String::from_utf8(r.take(len)?.to_vec()).ok()?;
            let m = r.u32()?;
            let mut entries = Vec::new();
            for _ in 0..m {
                entries.push(Entry { owner: r.u32()?, ctx: r.u32()?, expires_ms: r.u64()? });
            }
            records.push((name, entries));
        }
        r.0.is_empty().then_some(Self { records })
    }

    /// The shared-data value.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        push_len(&mut out, self.records.len());
        for (name, entries) in &self.records {
            push_len(&mut out, name.len());
            out.extend_from_slice(name.as_bytes());
            push_len(&mut out, entries.len());
            for e in entries {
                out.extend_from_slice(&e.owner.to_le_bytes());
                out.extend_from_slice(&e.ctx.to_le_bytes());
                out.extend_from_slice(&e.expires_ms.to_le_bytes());
            }
        }
        out
    }

    /// Drops entries stale at `now_ms`, and records left empty.
    pub(crate) fn prune(&mut self, now_ms: u64) {
        for (_, entries) in &mut self.records {
            entries.retain(|e| e.expires_ms >= now_ms);
        }
        self.records.retain(|(_, entries)| !entries.is_empty());
    }

    /// Appends `entry` to record `name`.
    pub fn push(&mut self, name: &str, entry: Entry) {
        match self.records.iter_mut().find(|(n, _)| n == name) {
            Some((_, entries)) => entries.push(entry),
            None => self.records.push((name.to_owned(), vec![entry])),
        }
    }

    /// Removes `(owner, ctx)` from record `name`; true if it was there.
    pub fn remove(&mut self, name: &str, owner: u32, ctx: u32) -> bool {
        let Some(i) = self.records.iter().position(|(n, _)| n == name) else {
            return false;
        };
        let Some((_, entries)) = self.records.get_mut(i) else {
            return false;
        };
        let before = entries.len();
        entries.retain(|e| (e.owner, e.ctx) != (owner, ctx));
        let removed = entries.len() != before;
        if entries.is_empty() {
            self.records.remove(i);
        }
        removed
    }

    fn entries(&self, name: &str) -> &[Entry] {
        self.records.iter().find(|(n, _)| n == name).map_or(&[], |(_, e)| e.as_slice())
    }

    /// The oldest entry of `name` not stale at `now_ms`.
    pub(crate) fn first_live(&self, name: &str, now_ms: u64) -> Option<Entry> {
        self.entries(name).iter().find(|e| e.expires_ms >= now_ms).copied()
    }

    /// Entries of `name` not stale at `now_ms`.
    pub fn live(&self, name: &str, now_ms: u64) -> usize {
        self.entries(name).iter().filter(|e| e.expires_ms >= now_ms).count()
    }

    /// Whether `(owner, ctx)` is in record `name`.
    pub fn contains(&self, name: &str, owner: u32, ctx: u32) -> bool {
        self.entries(name).iter().any(|e| (e.owner, e.ctx) == (owner, ctx))
    }
}

fn push_len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1)?.first().copied()
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn e(owner: u32, ctx: u32, expires_ms: u64) -> Entry {
        Entry { owner, ctx, expires_ms }
    }

    #[test]
    fn order_liveness_and_removal() {
        let mut r = Roster::default();
        r.push("k", e(1, 10, 100));
        r.push("k", e(2, 10, 500));
        r.push("j", e(1, 11, 500));
        assert_eq!(r.first_live("k", 50), Some(e(1, 10, 100)));
        assert_eq!(r.first_live("k", 101), Some(e(2, 10, 500)));
        assert_eq!(r.live("k", 101), 1);
        assert!(r.contains("k", 2, 10) && !r.contains("k", 2, 11));
        assert!(r.remove("k", 2, 10) && !r.remove("k", 2, 10));
        r.prune(101);
        assert_eq!(r.first_live("k", 0), None);
        assert_eq!(Roster::decode(&r.encode()), r);
        assert_eq!(backlog_bucket("payments/a"), backlog_bucket(&String::from("payments/a")));
        assert!(backlog_bucket("x").starts_with("lockmesh.backlog."));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        #[test]
        fn round_trips(records in proptest::collection::vec(
            ("[a-z/]{1,20}", proptest::collection::vec((any::<u32>(), any::<u32>(), any::<u64>()), 1..5)),
            0..5,
        )) {
            let mut r = Roster::default();
            for (name, entries) in &records {
                for (o, c, x) in entries {
                    r.push(name, e(*o, *c, *x));
                }
            }
            prop_assert_eq!(Roster::decode(&r.encode()), r);
        }

        #[test]
        fn garbage_decodes_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let r = Roster::decode(&bytes);
            let _ = r.first_live("x", 0);
        }
    }
}
