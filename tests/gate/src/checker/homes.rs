//! The checks across homes: a key that moves between clusters (a shard move)
//! keeps every property it has on one cluster. Each cluster's store history is
//! exact in itself (revision order); what orders commits of *different* clusters
//! is real time, bounded on both sides:
//!
//! - **after**: a commit at revision `r` came after the real time carried by
//!   every clock tick or barrier the same cluster committed at or before `r` (the
//!   gate reads the time, then writes it: `recorder::Ticker`);
//! - **before**: it came before the recorder received it, or any later revision
//!   of its cluster, and before a client was answered with its token.
//!
//! Within a cluster, segments (restores) follow each other in real time too. With
//! those bounds, and never anything the arbiter or `lockctl` says:
//!
//! | check | property |
//! |---|---|
//! | `tokens_increase` | a token handed out for a key is above every token handed out for it on another cluster by a grant that committed before it |
//! | `holders_within_limit` | never more than N holds of a key at one time over all clusters (a hold counts from when its grant surely committed until its delete surely had not) |
//!
//! Both only report what the bounds prove (a pair whose order the bounds leave
//! open is not reported), so a correct history never fails them; the same
//! properties within one cluster are the exact checks of the parent module.

use std::collections::{BTreeMap, HashMap};

use super::{Budget, Grant, TimedOut, Violation};
use crate::history::{History, Outcome, Segment};
use crate::recorder::{BARRIER_KEY, TICK_KEY};

/// Real-time bounds on the commits of one cluster.
struct ClusterBounds {
    /// Per committed revision, in real-time order: (store segment, revision, the
    /// latest time it surely committed after, the earliest it surely committed
    /// before), unix µs.
    at: Vec<(usize, i64, u64, u64)>,
    /// Per store segment: the lower bound at its last revision.
    end_lo: HashMap<usize, u64>,
}

/// A grant with its real-time bounds.
#[derive(Debug, Clone, Copy)]
struct Timed {
    gi: usize,
    /// Committed before this time (µs).
    commit_hi: u64,
    /// Committed after this time.
    commit_lo: u64,
    /// Its hold was surely still there until this time (µs; `u64::MAX` never
    /// bounded: not used).
    held_until: u64,
    /// Handed to a client (an acquire answered with its token).
    handed: bool,
}

// === impl ClusterBounds ===

impl ClusterBounds {
    fn build(h: &History, b: &mut Budget, first: usize, segments: &[Segment]) -> Result<Self, TimedOut> {
        let lo_keys = [format!("{}/{TICK_KEY}", h.root), format!("{}/{BARRIER_KEY}", h.root)];
        let mut at: Vec<(usize, i64, u64, u64)> = Vec::new();
        for (k, seg) in segments.iter().enumerate() {
            for e in &seg.events {
                b.tick("homes")?;
                let lo = if e.put && lo_keys.contains(&e.key) { e.value.trim().parse::<u64>().unwrap_or(0) } else { 0 };
                match at.last_mut() {
                    Some(last) if last.0 == first + k && last.1 == e.revision => {
                        last.2 = last.2.max(lo);
                        last.3 = last.3.min(e.observed_us);
                    }
                    _ => at.push((first + k, e.revision, lo, e.observed_us)),
                }
            }
        }
        // Bounds carry forward (lower) and backward (upper) in commit order.
        for i in 1..at.len() {
            at[i].2 = at[i].2.max(at[i - 1].2);
        }
        for i in (0..at.len().saturating_sub(1)).rev() {
            at[i].3 = at[i].3.min(at[i + 1].3);
        }
        let end_lo = at.iter().map(|a| (a.0, a.2)).collect();
        Ok(Self { at, end_lo })
    }

    fn get(&self, segment: usize, revision: i64) -> Option<&(usize, i64, u64, u64)> {
        self.at.binary_search_by(|a| (a.0, a.1).cmp(&(segment, revision))).ok().map(|i| &self.at[i])
    }
}

/// Runs the checks across homes (nothing with one cluster).
pub(super) fn check(h: &History, b: &mut Budget, grants: &[Grant], v: &mut Vec<Violation>) -> Result<(), TimedOut> {
    let clusters = h.clusters();
    if clusters.len() < 2 {
        return Ok(());
    }
    let mut bounds = Vec::new();
    let mut first = 0;
    for (_, segments) in &clusters {
        bounds.push(ClusterBounds::build(h, b, first, segments)?);
        first += segments.len();
    }
    // The earliest answer that handed out each grant's token.
    let mut by_token: HashMap<(&str, u64), Vec<usize>> = HashMap::new();
    for (i, g) in grants.iter().enumerate() {
        by_token.entry((g.key.as_str(), g.token)).or_default().push(i);
    }
    let mut answered: HashMap<usize, u64> = HashMap::new();
    for op in &h.ops {
        b.tick("homes")?;
        let (Some(t), true, Outcome::Ok) = (op.token, op.asks_grant(), op.outcome) else { continue };
        // A token several grants carry (never, unless a restore reused an epoch) links none.
        if let Some([gi]) = by_token.get(&(op.key.as_str(), t)).map(Vec::as_slice) {
            let at = answered.entry(*gi).or_insert(op.ret_us);
            *at = (*at).min(op.ret_us);
        }
    }
    let mut per_key: BTreeMap<&str, Vec<Timed>> = BTreeMap::new();
    for (gi, g) in grants.iter().enumerate() {
        b.tick("homes")?;
        let cb = &bounds[g.cluster];
        let Some(&(_, _, commit_lo, hi)) = cb.get(g.segment, g.revision) else { continue };
        let commit_hi = answered.get(&gi).map_or(hi, |&a| a.min(hi));
        // Deleted: not before the delete's lower bound. Never deleted: there at
        // least until the end of its own segment (carried over, or lost with a
        // restore after it).
        let held_until = match g.close {
            Some((s, r)) => cb.get(s, r).map_or(0, |a| a.2),
            None => cb.end_lo.get(&g.segment).copied().unwrap_or(0),
        };
        per_key.entry(g.key.as_str()).or_default().push(Timed {
            gi,
            commit_hi,
            commit_lo,
            held_until,
            handed: answered.contains_key(&gi),
        });
    }
    for (key, list) in &per_key {
        tokens_across(h, b, grants, key, list, v)?;
        holders_across(h, b, grants, key, list, v)?;
    }
    Ok(())
}

/// `tokens_increase` across homes: for each handed grant, the highest token handed
/// out on each other cluster by a grant that surely committed before it.
fn tokens_across(
    h: &History,
    b: &mut Budget,
    grants: &[Grant],
    key: &str,
    list: &[Timed],
    v: &mut Vec<Violation>,
) -> Result<(), TimedOut> {
    let clusters = h.clusters();
    let mut by_cluster: BTreeMap<usize, Vec<Timed>> = BTreeMap::new();
    for t in list.iter().filter(|t| t.handed) {
        by_cluster.entry(grants[t.gi].cluster).or_default().push(*t);
    }
    if by_cluster.len() < 2 {
        return Ok(());
    }
    // Per cluster, by commit_hi: the running maximum token and its grant.
    let mut running: BTreeMap<usize, (Vec<u64>, Vec<usize>)> = BTreeMap::new();
    for (c, ts) in &mut by_cluster {
        ts.sort_by_key(|t| t.commit_hi);
        let (mut his, mut best) = (Vec::new(), Vec::new());
        for t in ts.iter() {
            let keep = best.last().copied().filter(|&g: &usize| grants[g].token >= grants[t.gi].token);
            his.push(t.commit_hi);
            best.push(keep.unwrap_or(t.gi));
        }
        running.insert(*c, (his, best));
    }
    for (&c2, ts) in &by_cluster {
        // Per other cluster, the first later grant whose token is not above, and how many more.
        let mut found: BTreeMap<usize, (usize, usize, usize)> = BTreeMap::new();
        for t in ts {
            b.tick("homes")?;
            let g2 = &grants[t.gi];
            for (&c1, (his, best)) in &running {
                if c1 == c2 {
                    continue;
                }
                let n = his.partition_point(|&hi| hi < t.commit_lo);
                let Some(&g1) = n.checked_sub(1).and_then(|i| best.get(i)) else { continue };
                if grants[g1].token >= g2.token {
                    found.entry(c1).and_modify(|f| f.2 += 1).or_insert((g1, t.gi, 0));
                }
            }
        }
        for (c1, (g1, g2, more)) in found {
            let (a, z) = (&grants[g1], &grants[g2]);
            let (ta, tz) = (list.iter().find(|t| t.gi == g1), list.iter().find(|t| t.gi == g2));
            let (a_hi, z_lo) = (ta.map_or(0, |t| t.commit_hi), tz.map_or(0, |t| t.commit_lo));
            v.push(Violation {
                check: "tokens_increase",
                explanation: format!(
                    "{key}: across homes, the grant on {} at revision {} handed out token {} (epoch {}), not above token {} (epoch {}) handed out by the grant on {} at revision {}, which committed before it (by {a_hi} µs; the later one after {z_lo} µs){}",
                    clusters[c2].0,
                    z.revision,
                    z.token,
                    z.epoch,
                    a.token,
                    a.epoch,
                    clusters[c1].0,
                    a.revision,
                    if more > 0 { format!("; {more} more grants on {} after it are below it too", clusters[c2].0) } else { String::new() }
                ),
                segment: z.segment,
                revisions: (z.revision, z.revision),
                time_us: (a_hi, z_lo.max(a_hi)),
            });
        }
    }
    Ok(())
}

/// `holders_within_limit` across homes: a sweep over the intervals in which each
/// hold of `key` surely existed; an excess involving two clusters or more is
/// reported once per stretch.
fn holders_across(
    h: &History,
    b: &mut Budget,
    grants: &[Grant],
    key: &str,
    list: &[Timed],
    v: &mut Vec<Violation>,
) -> Result<(), TimedOut> {
    if list.iter().map(|t| grants[t.gi].cluster).collect::<std::collections::BTreeSet<_>>().len() < 2 {
        return Ok(());
    }
    let limit = h.limit_of(key);
    let clusters = h.clusters();
    // (time, 0 = ends / 1 = begins, timed index): at one instant ends come first.
    let mut edges: Vec<(u64, u8, usize)> = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if t.commit_hi < t.held_until {
            edges.push((t.commit_hi, 1, i));
            edges.push((t.held_until, 0, i));
        }
    }
    edges.sort_unstable();
    let mut open: Vec<usize> = Vec::new();
    let mut reported = false;
    for (at, begins, i) in edges {
        b.tick("homes")?;
        if begins == 0 {
            open.retain(|&o| o != i);
            if open.len() <= limit {
                reported = false;
            }
            continue;
        }
        open.push(i);
        let cs: std::collections::BTreeSet<usize> = open.iter().map(|&o| grants[list[o].gi].cluster).collect();
        if open.len() > limit && cs.len() > 1 && !reported {
            reported = true;
            let holds: Vec<String> = open
                .iter()
                .map(|&o| {
                    let (t, g) = (&list[o], &grants[list[o].gi]);
                    format!(
                        "token {} on {} (revision {}, granted by {} µs, still held at {} µs)",
                        g.token, clusters[g.cluster].0, g.revision, t.commit_hi, t.held_until
                    )
                })
                .collect();
            let until = open.iter().map(|&o| list[o].held_until).min().unwrap_or(at);
            let g = &grants[list[i].gi];
            v.push(Violation {
                check: "holders_within_limit",
                explanation: format!(
                    "{key} had {} holds at once across homes from {at} µs to {until} µs (limit {limit}): {}",
                    open.len(),
                    holds.join("; ")
                ),
                segment: g.segment,
                revisions: (g.revision, g.revision),
                time_us: (at, until),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::check;
    use crate::history::{token_of, ClientOp, ClusterHistory, EtcdEvent, History, Outcome, Segment};

    const ROOT: &str = "/g";

    fn ev(rev: i64, put: bool, key: &str, value: &str, at_ms: u64) -> EtcdEvent {
        EtcdEvent {
            revision: rev,
            put,
            key: key.to_owned(),
            value: value.to_owned(),
            create_revision: rev,
            lease: 7,
            prev_value: if put { None } else { Some("{}".into()) },
            prev_create_revision: None,
            observed_us: at_ms * 1000,
        }
    }

    /// A tick carrying `time_ms`, committed at revision `rev`, observed at `at_ms`.
    fn tick(rev: i64, time_ms: u64, at_ms: u64) -> EtcdEvent {
        ev(rev, true, "/g/gate/tick", &(time_ms * 1000).to_string(), at_ms)
    }

    fn epoch(rev: i64, e: u64, at_ms: u64) -> EtcdEvent {
        ev(rev, true, "/g/sys/epoch", &format!(r#"{{"epoch":{e}}}"#), at_ms)
    }

    fn grant(rev: i64, key: &str, e: u64, at_ms: u64) -> EtcdEvent {
        ev(rev, true, "/g/l/d0/h/0000", &format!(r#"{{"key":"{key}","epoch":{e},"owner":"x"}}"#), at_ms)
    }

    fn del(rev: i64, at_ms: u64) -> EtcdEvent {
        ev(rev, false, "/g/l/d0/h/0000", "", at_ms)
    }

    fn acquire(token: u64, call_ms: u64, ret_ms: u64) -> ClientOp {
        ClientOp {
            process: "h0".into(),
            op: "acquire".into(),
            key: "k/a".into(),
            token: Some(token),
            call_us: call_ms * 1000,
            ret_us: ret_ms * 1000,
            outcome: Outcome::Ok,
            status: 200,
            code: None,
            skew_ms: 0,
            valid_until_us: None,
            session: None,
            ..Default::default()
        }
    }

    /// Key `k/a` held on shard-a (epoch `ea`) from 100 to 200 ms, then, after a
    /// move, on shard-b (epoch `eb`) from `b_at` ms (its delete at 900 ms).
    fn moved(ea: u64, eb: u64, b_at: u64) -> History {
        // Each hold ends in its holder's release (the marker names it).
        let released = |e: u64, at_ms| ev(5, true, "/g/r/d0", &format!(r#"{{"epoch":{e},"revision":3}}"#), at_ms);
        let a = vec![
            epoch(1, ea, 10),
            tick(2, 90, 95),
            grant(3, "k/a", ea, 100),
            tick(4, 150, 155),
            del(5, 200),
            released(ea, 200),
        ];
        let b = vec![
            epoch(1, eb, 10),
            tick(2, b_at - 10, b_at - 5),
            grant(3, "k/a", eb, b_at),
            tick(4, 880, 885),
            del(5, 900),
            released(eb, 900),
        ];
        History {
            root: ROOT.into(),
            segments: vec![Segment { base_revision: 0, bump: 0, events: vec![epoch(1, 1, 10), tick(2, 5, 12)] }],
            shards: vec![
                ClusterHistory {
                    name: "shard-a".into(),
                    segments: vec![Segment { base_revision: 0, bump: 0, events: a }],
                },
                ClusterHistory {
                    name: "shard-b".into(),
                    segments: vec![Segment { base_revision: 0, bump: 0, events: b }],
                },
            ],
            ops: vec![acquire(token_of(ea, 3), 90, 110), acquire(token_of(eb, 3), b_at - 10, b_at + 10)],
            ..History::default()
        }
    }

    fn checks(h: &History) -> Vec<(&'static str, String)> {
        check(h, Duration::from_secs(5)).violations().iter().map(|v| (v.check, v.explanation.clone())).collect()
    }

    #[test]
    fn a_move_to_a_higher_epoch_after_the_old_hold_ended_passes() {
        let h = moved(2, 3, 400);
        assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    }

    #[test]
    fn a_token_below_the_old_homes_is_caught_across_homes() {
        // shard-b's epoch is below shard-a's: the move skipped the epoch advance.
        let found = checks(&moved(3, 2, 400));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, "tokens_increase");
        assert!(found[0].1.contains("across homes") && found[0].1.contains("on shard-b"), "{}", found[0].1);
    }

    #[test]
    fn two_holders_on_two_clusters_at_once_are_caught() {
        // shard-b grants at 150 ms while shard-a's hold surely lasts until its tick at 150
        // and its delete at 200 ms: a tick carrying 180 ms commits on shard-a before the delete.
        let mut h = moved(2, 3, 160);
        h.shards[0].segments[0].events[3] = tick(4, 180, 185);
        let found = checks(&h);
        assert!(found.iter().any(|(c, e)| *c == "holders_within_limit" && e.contains("across homes")), "{found:?}");
    }

    #[test]
    fn an_order_the_bounds_leave_open_is_not_reported() {
        // shard-b's grant commits after 50 ms and before 170 ms, shard-a's before
        // 100 ms: either may be first, so the lower token on shard-b is no proof.
        // shard-a's hold is deleted after 150 ms and before 200 ms: the two holds
        // may or may not overlap.
        let mut h = moved(3, 2, 170);
        h.shards[1].segments[0].events[1] = tick(2, 50, 52);
        assert!(checks(&h).is_empty(), "{:?}", checks(&h));
    }
}
