//! `lockctl shard`: the shard map and its fenced moves (ADR-09, `docs/SCALE.md`).
//!
//! - `shard show --config arbiter.yaml`: the coord map, any pending change, and
//!   each cluster's home record and epoch, as one JSON document.
//! - `shard apply --config arbiter.yaml [--add C] [--remove C] [--assign NS=C]
//!   [--unassign NS] [--tier CLASS=coord|entity]`: changes the map and applies it
//!   through the move protocol below. Without changes it finishes whatever an
//!   interrupted apply or cancel left (safe to re-run after a crash at any step).
//! - `shard cancel --config arbiter.yaml`: abandons a pending change that has not
//!   flipped; the drained keys reopen under the current map.
//!
//! The move protocol, from map `M` (version v) to `N` (v+1):
//! 1. **intent**: the coord map document records `N` as pending (one
//!    compare-and-put; a second change is refused while one is pending);
//! 2. **drain**: every cluster of `M` and `N` gets `N` as its home record's pending
//!    map; from each write on, that cluster refuses grants of every key that `M`
//!    and `N` home differently (`draining`), in both directions;
//! 3. **verify**: until `--verify-timeout-ms`, every cluster is scanned for holds of
//!    keys that leave it; a timeout exits 2 `held` (still draining: re-run, or
//!    cancel);
//! 4. **epochs**: every cluster that may gain keys gets an epoch above every
//!    cluster that may lose keys (allocated from the coord counter; holds kept);
//! 5. **flip**: the coord map becomes `N` (compare-and-put on the document read
//!    with `N` pending, so a cancel or another apply in between makes it fail);
//! 6. **resume**: every cluster's home record becomes `N` with nothing pending.
//!
//! Exit codes: 0 applied, nothing to do, resumed or cancelled; 2 still draining
//! (`held`); 3 refused (another change pending, invalid map, unknown cluster, a
//! concurrent change); 1 etcd unavailable or an unexpected state.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

use clap::{Args, Subcommand};
pub use lockmesh_core::wire::shard::MoveReport;
use lockmesh_core::{
    policy::ChangeNote,
    shard::ShardMap,
    wire::shard::{ClusterHome, ShardShow},
};
use tokio::time::Instant;

use lockmesh_lock::{
    clusters::Clusters,
    home::{HomeRecord, MapRecord},
    now_ms,
    test_faults::{self, TestFault},
    tiers::Tiers,
    LockError, Store,
};

/// `lockctl shard ...`.
#[derive(Args, Debug)]
pub struct ShardArgs {
    #[command(subcommand)]
    cmd: ShardCmd,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum ShardCmd {
    /// Print the coord map, a pending change, each cluster's home record and epoch.
    Show(Conn),
    /// Change the shard map and apply it (drain, verify, epochs, flip, resume);
    /// without changes, finish an interrupted apply or cancel.
    Apply(ApplyArgs),
    /// Abandon a pending change that has not flipped.
    Cancel(Conn),
}

/// How to reach the clusters: the arbiter's own config file.
#[derive(Args, Debug)]
pub struct Conn {
    /// The arbiter config (its `etcd:`, `clusters:` and key root are used).
    #[arg(long)]
    config: PathBuf,
    /// Who runs the change (recorded in the map document).
    #[arg(long, default_value = "lockctl")]
    actor: String,
    /// Why (recorded in the map document).
    #[arg(long, default_value = "")]
    reason: String,
}

/// `shard apply`.
#[derive(Args, Debug)]
pub struct ApplyArgs {
    #[command(flatten)]
    conn: Conn,
    /// Add an entity shard (a cluster named in the config's `clusters:`).
    #[arg(long)]
    add: Vec<String>,
    /// Remove an entity shard.
    #[arg(long)]
    remove: Vec<String>,
    /// Home a namespace on a cluster (overrides rendezvous hashing): NS=CLUSTER.
    #[arg(long, value_name = "NS=CLUSTER")]
    assign: Vec<String>,
    /// Drop a namespace's assignment (back to rendezvous hashing).
    #[arg(long, value_name = "NS")]
    unassign: Vec<String>,
    /// Move a class between tiers: CLASS=coord or CLASS=entity.
    #[arg(long, value_name = "CLASS=TIER")]
    tier: Vec<String>,
    /// How long to wait for holds of moving keys to end, ms.
    #[arg(long, default_value_t = 30_000)]
    verify_timeout_ms: u64,
}

/// A change to the map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Change {
    /// Shards to add.
    pub add: Vec<String>,
    /// Shards to remove.
    pub remove: Vec<String>,
    /// Namespace assignments.
    pub assign: Vec<(String, String)>,
    /// Namespaces back to hashing.
    pub unassign: Vec<String>,
    /// Classes to move: `(class, true)` to the coord tier, `false` to entity.
    pub tier: Vec<(String, bool)>,
}

/// Options of a move.
#[derive(Debug, Clone)]
pub struct MoveOptions {
    /// How long verification may wait for holds to end.
    pub verify_timeout: Duration,
    /// Who.
    pub actor: String,
    /// Why.
    pub reason: String,
}

/// Why a change was not (fully) applied.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The new map is invalid.
    #[error("the new map is invalid: {}", .0.join("; "))]
    Invalid(Vec<String>),
    /// Another change is pending.
    #[error("change to version {0} is pending: re-run apply without changes to finish it, or cancel it")]
    OtherPending(u64),
    /// A cluster of the maps is not in this config.
    #[error("cluster {0} is not named in this arbiter config (etcd: or clusters:)")]
    Unknown(String),
    /// Holds of moving keys remain after the timeout: still draining.
    #[error("held: holds of moving keys remain ({0:?}); still draining: re-run apply to resume, or cancel")]
    Held(BTreeMap<String, usize>),
    /// A concurrent change.
    #[error("the shard map or a home record changed under this command ({0}); re-run it")]
    Raced(String),
    /// Nothing pending to cancel.
    #[error("nothing is pending")]
    NothingPending,
    /// etcd.
    #[error(transparent)]
    Lock(#[from] LockError),
}

fn note(o: &MoveOptions, action: &str) -> ChangeNote {
    ChangeNote { actor: o.actor.clone(), reason: o.reason.clone(), at_ms: now_ms(), action: action.into() }
}

fn ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

// === impl Change ===

impl Change {
    /// True when it changes nothing.
    pub fn is_empty(&self) -> bool {
        *self == Change::default()
    }

    /// `m` with this change (same version).
    pub fn apply_to(&self, m: &ShardMap) -> ShardMap {
        let mut n = m.clone();
        for a in &self.add {
            if !n.shards.contains(a) {
                n.shards.push(a.clone());
            }
        }
        n.shards.retain(|s| !self.remove.contains(s));
        n.shards.sort();
        for (ns, c) in &self.assign {
            n.overrides.insert(ns.clone(), c.clone());
        }
        for ns in &self.unassign {
            n.overrides.remove(ns);
        }
        for (c, coord) in &self.tier {
            if *coord {
                n.coord_classes.insert(c.clone());
            } else {
                n.coord_classes.remove(c);
            }
        }
        n
    }
}

fn same_content(a: &ShardMap, b: &ShardMap) -> bool {
    ShardMap { version: 0, ..a.clone() } == ShardMap { version: 0, ..b.clone() }
}

fn store<'a>(tiers: &'a Tiers, name: &str) -> Result<&'a Arc<Store>, ShardError> {
    tiers.get(name).ok_or_else(|| ShardError::Unknown(name.to_owned()))
}

/// Applies `change` (or, empty, finishes an interrupted apply or cancel).
pub async fn apply(
    tiers: &Tiers,
    change: &Change,
    o: &MoveOptions,
    say: &mut (dyn FnMut(String) + Send),
) -> Result<MoveReport, ShardError> {
    let started = Instant::now();
    let coord = tiers.coord();
    let (rec, rev) = coord
        .home()
        .read_map()
        .await?
        .ok_or_else(|| LockError::Unavailable("no shard map yet: start an arbiter on this config first".into()))?;
    let (cur, next) = match &rec.pending {
        Some(p) => {
            if !change.is_empty() && !same_content(&change.apply_to(&rec.current), p) {
                return Err(ShardError::OtherPending(p.version));
            }
            say(format!("resuming the pending change {} -> {}", rec.current.version, p.version));
            (rec.current.clone(), p.clone())
        }
        None if change.is_empty() => return finish(tiers, &rec, o, say, started).await,
        None => {
            let mut next = change.apply_to(&rec.current);
            next.version = rec.current.version + 1;
            if same_content(&next, &rec.current) {
                return Ok(MoveReport {
                    outcome: "unchanged".into(),
                    from: rec.current.version,
                    to: rec.current.version,
                    ..Default::default()
                });
            }
            next.validate().map_err(ShardError::Invalid)?;
            for c in next.clusters() {
                store(tiers, &c)?;
            }
            let intent =
                MapRecord { current: rec.current.clone(), pending: Some(next.clone()), last: note(o, "drain") };
            if !coord.home().put_map(&intent, rev).await? {
                return Err(ShardError::Raced("the coord map document".into()));
            }
            say(format!(
                "0/5 intent: version {} -> {} recorded as pending in the coord cluster",
                rec.current.version, next.version
            ));
            (rec.current.clone(), next)
        }
    };
    let union: BTreeSet<String> = cur.clusters().union(&next.clusters()).cloned().collect();
    for c in &union {
        store(tiers, c)?;
    }
    // 2. Drain: every cluster refuses the keys the two maps home differently.
    let skip_drain = test_faults::on(TestFault::SkipMoveDrain);
    if skip_drain {
        // TEST ONLY (release gate): old homes keep granting, nothing is verified.
        say("TEST FAULT skip_move_drain: no drain, no verification".into());
    }
    for c in union.iter().filter(|_| !skip_drain) {
        drain(store(tiers, c)?, &cur, &next, o).await?;
    }
    let drained = Instant::now();
    say(format!("1/5 drained: {} clusters refuse grants of moving keys", union.len()));
    // 3. Verify: no hold of a leaving key remains on any cluster.
    let verified_at = if skip_drain { BTreeMap::new() } else { verify(tiers, &cur, &next, o).await? };
    let drain_ms = ms(drained);
    say(format!("2/5 verified: no hold of a moving key remains ({drain_ms} ms after the drain)"));
    // 4. Epochs: each gainer above every loser.
    let scope = cur.move_scope(&next);
    let mut loser_epochs = BTreeMap::new();
    for l in &scope.losers {
        let s = store(tiers, l)?;
        s.epoch().refresh().await?;
        loser_epochs.insert(l.clone(), s.epoch().read_record().await?.map_or(0, |r| r.epoch));
    }
    let mut epochs = BTreeMap::new();
    let planted = test_faults::on(TestFault::SkipMoveEpochAdvance);
    for g in &scope.gainers {
        let s = store(tiers, g)?;
        s.epoch().refresh().await?;
        let floor = loser_epochs.iter().filter(|(l, _)| *l != g).map(|(_, e)| *e).max().unwrap_or(0);
        let e = if planted {
            // TEST ONLY (release gate): the gainer keeps whatever epoch it has.
            say(format!("TEST FAULT skip_move_epoch_advance: {g} not advanced above {floor}"));
            s.epoch().read_record().await?.map_or(0, |r| r.epoch)
        } else {
            s.epoch().advance_above(floor, coord.home()).await?
        };
        epochs.insert(g.clone(), e);
    }
    say(format!("3/5 epochs: gainers {epochs:?} above losers {loser_epochs:?}"));
    // 5. Flip, only from the document that still has this change pending.
    let (now, rev) =
        coord.home().read_map().await?.ok_or_else(|| LockError::Unavailable("the shard map vanished".into()))?;
    if now.pending.as_ref() == Some(&next) && now.current == cur {
        let flipped = MapRecord { current: next.clone(), pending: None, last: note(o, "flip") };
        if !coord.home().put_map(&flipped, rev).await? {
            return Err(ShardError::Raced("the coord map document at the flip".into()));
        }
    } else if now.current != next {
        return Err(ShardError::Raced("the pending change was cancelled or replaced".into()));
    }
    say(format!("4/5 flipped: the coord map is version {}", next.version));
    // 6. Resume.
    for c in &union {
        resume(store(tiers, c)?, &next, o).await?;
    }
    say(format!("5/5 resumed: version {} in force on {} clusters", next.version, union.len()));
    Ok(MoveReport {
        outcome: "applied".into(),
        from: cur.version,
        to: next.version,
        losers: scope.losers.into_iter().collect(),
        gainers: scope.gainers.into_iter().collect(),
        epochs,
        verified_at,
        drain_ms,
        total_ms: ms(started),
    })
}

/// Step 3: scans every cluster of `cur` until none holds a key that `next` homes
/// elsewhere (or the timeout: `Held`); the revision each was verified at.
async fn verify(
    tiers: &Tiers,
    cur: &ShardMap,
    next: &ShardMap,
    o: &MoveOptions,
) -> Result<BTreeMap<String, i64>, ShardError> {
    let deadline = Instant::now() + o.verify_timeout;
    let mut verified_at = BTreeMap::new();
    loop {
        let mut held = BTreeMap::new();
        for c in &cur.clusters() {
            let (n, at) = store(tiers, c)?.home().moving_holds(cur, next).await?;
            if n > 0 {
                held.insert(c.clone(), n);
            } else {
                verified_at.insert(c.clone(), at);
            }
        }
        if held.is_empty() {
            return Ok(verified_at);
        }
        if Instant::now() >= deadline {
            return Err(ShardError::Held(held));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn drain(s: &Store, cur: &ShardMap, next: &ShardMap, o: &MoveOptions) -> Result<(), ShardError> {
    for _ in 0..5 {
        let (rec, rev) = match s.home().read().await? {
            None => (None, 0),
            Some((h, rev)) => (Some(h), rev),
        };
        if let Some(h) = &rec {
            if h.current.version > cur.version {
                return Err(ShardError::Raced(format!(
                    "cluster {} is at version {}",
                    s.cluster_name(),
                    h.current.version
                )));
            }
            match &h.pending {
                Some(p) if p == next => return Ok(()),
                Some(p) => return Err(ShardError::OtherPending(p.version)),
                None => {}
            }
        }
        let drained = HomeRecord::new(s.cluster_name(), cur.clone(), Some(next.clone()), note(o, "drain"));
        if s.home().put(&drained, rev).await? {
            return Ok(());
        }
    }
    Err(ShardError::Raced(format!("the home record of {}", s.cluster_name())))
}

async fn resume(s: &Store, next: &ShardMap, o: &MoveOptions) -> Result<(), ShardError> {
    for _ in 0..5 {
        let (rec, rev) = match s.home().read().await? {
            None => (None, 0),
            Some((h, rev)) => (Some(h), rev),
        };
        if let Some(h) = &rec {
            if h.current.version > next.version || (h.current == *next && h.pending.is_none()) {
                return Ok(());
            }
        }
        let resumed = HomeRecord::new(s.cluster_name(), next.clone(), None, note(o, "resume"));
        if s.home().put(&resumed, rev).await? {
            return Ok(());
        }
    }
    Err(ShardError::Raced(format!("the home record of {}", s.cluster_name())))
}

/// No change asked and nothing pending in the coord map: resume clusters left
/// with the current map pending (a crash after the flip), revert clusters left
/// with a change the coord map no longer has (a crash during a cancel), and bring
/// forward a record behind the map (a cluster restored from an older snapshot,
/// whose restore deleted its holds; it admits nothing until then).
async fn finish(
    tiers: &Tiers,
    rec: &MapRecord,
    o: &MoveOptions,
    say: &mut (dyn FnMut(String) + Send),
    started: Instant,
) -> Result<MoveReport, ShardError> {
    let mut touched = 0;
    for s in tiers.stores() {
        let Some((h, rev)) = s.home().read().await? else { continue };
        let Some(p) = &h.pending else {
            if h.current.version < rec.current.version {
                let fixed = HomeRecord::new(s.cluster_name(), rec.current.clone(), None, note(o, "repair"));
                if !s.home().put(&fixed, rev).await? {
                    return Err(ShardError::Raced(format!("the home record of {}", s.cluster_name())));
                }
                touched += 1;
                say(format!(
                    "{}: repair (record version {} brought to {})",
                    s.cluster_name(),
                    h.current.version,
                    rec.current.version
                ));
            }
            continue;
        };
        let fixed = if *p == rec.current {
            HomeRecord::new(s.cluster_name(), rec.current.clone(), None, note(o, "resume"))
        } else {
            HomeRecord::new(s.cluster_name(), h.current.clone(), None, note(o, "cancel"))
        };
        if !s.home().put(&fixed, rev).await? {
            return Err(ShardError::Raced(format!("the home record of {}", s.cluster_name())));
        }
        touched += 1;
        say(format!("{}: {}", s.cluster_name(), fixed.last.action));
    }
    Ok(MoveReport {
        outcome: if touched > 0 { "resumed".into() } else { "unchanged".into() },
        from: rec.current.version,
        to: rec.current.version,
        total_ms: ms(started),
        ..Default::default()
    })
}

/// Abandons a pending change that has not flipped: the coord document first (so
/// a concurrent apply cannot flip it any more), then every cluster's record.
pub async fn cancel(tiers: &Tiers, o: &MoveOptions, say: &mut (dyn FnMut(String) + Send)) -> Result<(), ShardError> {
    let coord = tiers.coord();
    let (rec, rev) = coord.home().read_map().await?.ok_or(ShardError::NothingPending)?;
    let Some(p) = rec.pending.clone() else { return Err(ShardError::NothingPending) };
    let cancelled = MapRecord { current: rec.current.clone(), pending: None, last: note(o, "cancel") };
    if !coord.home().put_map(&cancelled, rev).await? {
        return Err(ShardError::Raced("the coord map document".into()));
    }
    say(format!("cancelled version {} in the coord cluster", p.version));
    finish(tiers, &cancelled, o, say, Instant::now()).await.map(|_| ())
}

/// The coord map and every cluster's home record and epoch.
pub async fn show(tiers: &Tiers) -> Result<ShardShow<MapRecord, HomeRecord>, ShardError> {
    let map = tiers.coord().home().read_map().await?.map(|(m, _)| m);
    let mut clusters = BTreeMap::new();
    for s in tiers.stores() {
        let home = s.home().read().await?.map(|(h, _)| h);
        let epoch = s.epoch().read_record().await?;
        clusters.insert(
            s.cluster_name().to_owned(),
            ClusterHome { epoch: epoch.as_ref().map(|e| e.epoch), home, prior_epochs: epoch.map(|e| e.prior) },
        );
    }
    Ok(ShardShow { clusters, map })
}

fn pairs(v: &[String], what: &str) -> Result<Vec<(String, String)>, String> {
    v.iter()
        .map(|s| {
            s.split_once('=')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| format!("--{what} {s:?}: expected A=B"))
        })
        .collect()
}

async fn connect(conn: &Conn) -> Result<Tiers, String> {
    let clusters = Clusters::load_arbiter_file(&conn.config).map_err(|e| e.join("\n"))?;
    // Planted bugs of the config are lockctl's too (`skip_move_epoch_advance`,
    // `skip_move_drain`); a test build only, and refused unless LOCKMESH_TEST_FAULTS=1.
    test_faults::install(&clusters.test_faults);
    clusters.connect().await.map_err(|e| e.to_string())
}

fn exit(e: &ShardError) -> ExitCode {
    eprintln!("lockctl shard: {e}");
    match e {
        ShardError::Held(_) => ExitCode::from(2),
        ShardError::Lock(_) => ExitCode::from(1),
        _ => ExitCode::from(3),
    }
}

/// How long a command etcd refused with `revision of auth store is old` is
/// resumed (each refusal is followed by a new login: `Cluster::call`).
const AUTH_RETRY_FOR: Duration = Duration::from_secs(10);

fn auth_store_old(e: &ShardError) -> bool {
    e.to_string().contains("revision of auth store is old")
}

/// `f` again while etcd refuses it as `auth_store_old`, for at most
/// [`AUTH_RETRY_FOR`] (for reads only).
async fn retry_auth<T>(f: impl AsyncFn() -> Result<T, ShardError>) -> Result<T, ShardError> {
    let until = Instant::now() + AUTH_RETRY_FOR;
    loop {
        match f().await {
            Err(e) if auth_store_old(&e) && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            r => return r,
        }
    }
}

/// Runs `lockctl shard ...`.
pub async fn main(args: &ShardArgs) -> ExitCode {
    let conn = match &args.cmd {
        ShardCmd::Show(c) | ShardCmd::Cancel(c) => c,
        ShardCmd::Apply(a) => &a.conn,
    };
    let tiers = match connect(conn).await {
        Ok(t) => t,
        Err(e) => {
            eprintln!("lockctl shard: {e}");
            return ExitCode::from(1);
        }
    };
    let o =
        MoveOptions { verify_timeout: Duration::from_secs(30), actor: conn.actor.clone(), reason: conn.reason.clone() };
    let mut say = |line: String| eprintln!("{line}");
    match &args.cmd {
        ShardCmd::Show(_) => match retry_auth(async || show(&tiers).await).await {
            Ok(v) => {
                // Through `serde_json::Value`, whose objects sort their keys: the
                // records print with sorted members, the bytes `show` always printed
                // (core/src/wire/mod.rs: same bytes as before).
                println!("{}", serde_json::to_value(&v).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => exit(&e),
        },
        ShardCmd::Cancel(_) => match cancel(&tiers, &o, &mut say).await {
            // As for apply: a cancel recorded and then refused is finished by an
            // empty apply.
            Err(e) if auth_store_old(&e) => {
                let until = Instant::now() + AUTH_RETRY_FOR;
                let mut r = Err(e);
                while r.as_ref().is_err_and(auth_store_old) && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    r = apply(&tiers, &Change::default(), &o, &mut say).await;
                }
                match r {
                    Ok(_) => ExitCode::SUCCESS,
                    Err(e) => exit(&e),
                }
            }
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => exit(&e),
        },
        ShardCmd::Apply(a) => {
            let tier: Result<Vec<(String, bool)>, String> = pairs(&a.tier, "tier").and_then(|v| {
                v.into_iter()
                    .map(|(c, t)| match t.as_str() {
                        "coord" => Ok((c, true)),
                        "entity" => Ok((c, false)),
                        _ => Err(format!("--tier {c}={t}: the tier is coord or entity")),
                    })
                    .collect()
            });
            let (assign, tier) = match (pairs(&a.assign, "assign"), tier) {
                (Ok(x), Ok(y)) => (x, y),
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("lockctl shard: {e}");
                    return ExitCode::from(64);
                }
            };
            let change =
                Change { add: a.add.clone(), remove: a.remove.clone(), assign, unassign: a.unassign.clone(), tier };
            let o = MoveOptions { verify_timeout: Duration::from_millis(a.verify_timeout_ms), ..o };
            let mut r = apply(&tiers, &change, &o, &mut say).await;
            // A step etcd refused because its users or roles changed under this
            // login (nothing of that step applied; the clients have logged in
            // again) is resumed: the change is pending in the coord map, or, if it
            // was already flipped, an empty apply finishes it.
            let until = Instant::now() + AUTH_RETRY_FOR;
            while r.as_ref().is_err_and(auth_store_old) && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(200)).await;
                say("etcd refused a step: its users or roles changed under this login; resuming".into());
                r = match apply(&tiers, &change, &o, &mut say).await {
                    Ok(rep) if rep.outcome == "unchanged" => apply(&tiers, &Change::default(), &o, &mut say).await,
                    other => other,
                };
            }
            match r {
                Ok(r) => {
                    println!("{}", serde_json::to_string(&r).unwrap_or_default());
                    ExitCode::SUCCESS
                }
                Err(e) => exit(&e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_edits_the_map_and_keeps_its_version() {
        let m = ShardMap::initial("coord", &["coord".into()], []);
        let c = Change {
            add: vec!["shard-b".into(), "coord".into()],
            remove: vec![],
            assign: vec![("big".into(), "shard-c".into())],
            unassign: vec![],
            tier: vec![("leader".into(), true)],
        };
        let n = c.apply_to(&m);
        assert_eq!(n.version, 1);
        assert_eq!(n.shards, vec!["coord".to_owned(), "shard-b".to_owned()]);
        assert_eq!(n.overrides.get("big").map(String::as_str), Some("shard-c"));
        assert!(n.coord_classes.contains("leader"));
        assert!(same_content(&Change::default().apply_to(&m), &m));
        let back = Change {
            remove: vec!["shard-b".into()],
            unassign: vec!["big".into()],
            tier: vec![("leader".into(), false)],
            ..Default::default()
        };
        assert!(same_content(&back.apply_to(&n), &m));
    }
}
