//! Restore and epoch advance: the operator side of restore safety (ADR-03).
//!
//! The epoch advance is a resumable state machine kept in the epoch record itself,
//! so it is safe to re-run after a crash at any step:
//!
//! ```text
//! {E, unsealed}  --1 seal-->  {E, sealed, target F}
//!                --2 advance, delete every hold and waiter (one txn)-->  {F, sealed}
//!                --3 revoke every session lease under the root-->        {F, sealed}
//!                --4 unseal-->  {F, unsealed}
//! ```
//!
//! Each step is a transaction guarded by the record's mod revision. An advance
//! whose expected epoch is stale changes nothing. Leases cannot be revoked in a
//! transaction, so step 3 runs after the advance and before unsealing: restored
//! holders' keepalives fail and they stop.

use std::{io::Write, path::Path, time::Duration};

use etcd_client::{Client, Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};
use lockmesh_core::token::{EPOCH_LIMIT, REVISION_LIMIT};

use crate::etcd_retry::Etcd;

use lockmesh_lock::{
    connect::EtcdConnection,
    epoch::{cluster_hex, EpochRecord},
    seal::Marks,
    Keys,
};

/// Default `--bump-revision` of a restore: far above any realistic gap between a
/// snapshot and the last revision served, far below 2^48.
pub const DEFAULT_BUMP: u64 = 1_000_000_000;
/// Refuse a restore that leaves less revision headroom than this.
pub const MIN_HEADROOM: u64 = 1 << 40;

/// Why an advance or restore stopped.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The expected epoch is not the record's (someone else advanced): nothing changed.
    #[error("expected epoch {expected} but the epoch record holds {current}: nothing changed")]
    StaleExpected {
        /// Given.
        expected: u64,
        /// Found.
        current: u64,
    },
    /// Another advance to a different epoch is in progress.
    #[error("an advance to epoch {0} is in progress; re-run with --new-epoch {0}")]
    OtherTarget(u64),
    /// No target epoch and no marks to take it from.
    #[error("refusing to guess the new epoch: pass --new-epoch or --marks FILE")]
    NoTarget,
    /// The target is not above everything seen.
    #[error("new epoch {new} must be above {floor} (expected epoch and every mark)")]
    TargetTooLow {
        /// Asked.
        new: u64,
        /// Highest seen.
        floor: u64,
    },
    /// The epoch space is exhausted.
    #[error("epoch {0} would reach the limit 32767")]
    EpochExhausted(u64),
    /// Too little revision headroom.
    #[error("snapshot revision {rev} + bump {bump} leaves {headroom} revisions under 2^48, below the minimum {MIN_HEADROOM}")]
    Headroom {
        /// Snapshot revision.
        rev: u64,
        /// Bump.
        bump: u64,
        /// What is left.
        headroom: u64,
    },
    /// Anything else (etcd, files, tools).
    #[error("{0}")]
    Other(String),
}

fn other(e: impl std::fmt::Display) -> RestoreError {
    RestoreError::Other(e.to_string())
}

/// Picks the new epoch: `--new-epoch`, else one above the highest of the expected
/// epoch and every marks file; refuses to guess.
pub fn choose_epoch(expected: u64, new_epoch: Option<u64>, marks: &[&Path]) -> Result<u64, RestoreError> {
    let floor = epoch_floor(expected, marks)?;
    let new = match (new_epoch, marks.is_empty()) {
        (Some(n), _) => n,
        (None, false) => floor + 1,
        (None, true) => return Err(RestoreError::NoTarget),
    };
    if new <= floor {
        return Err(RestoreError::TargetTooLow { new, floor });
    }
    if new >= EPOCH_LIMIT {
        return Err(RestoreError::EpochExhausted(new));
    }
    Ok(new)
}

/// The epoch a new one must be above: `expected` and every marks file's epoch.
pub fn epoch_floor(expected: u64, marks: &[&Path]) -> Result<u64, RestoreError> {
    let mut floor = expected;
    for p in marks {
        let m: Marks = serde_json::from_slice(&std::fs::read(p).map_err(|e| other(format!("{}: {e}", p.display())))?)
            .map_err(|e| other(format!("{}: {e}", p.display())))?;
        floor = floor.max(m.epoch);
    }
    Ok(floor)
}

async fn read_record(client: &mut Client, keys: &Keys) -> Result<(EpochRecord, i64, u64), RestoreError> {
    let r = Etcd::of(client).get(keys.epoch(), None).await.map_err(other)?;
    let cluster = r.header().map(|h| h.cluster_id()).unwrap_or_default();
    let kv = r.kvs().first().ok_or_else(|| other("no epoch record under this root"))?;
    let rec: EpochRecord = serde_json::from_slice(kv.value()).map_err(other)?;
    Ok((rec, kv.mod_revision(), cluster))
}

async fn put_record(
    client: &mut Client,
    keys: &Keys,
    mod_rev: i64,
    rec: &EpochRecord,
    extra: Vec<TxnOp>,
) -> Result<bool, RestoreError> {
    let mut ops = vec![TxnOp::put(keys.epoch(), serde_json::to_vec(rec).map_err(other)?, None::<PutOptions>)];
    ops.extend(extra);
    let txn = Txn::new().when([Compare::mod_revision(keys.epoch(), CompareOp::Equal, mod_rev)]).and_then(ops);
    Ok(Etcd::of(client).txn(txn).await.map_err(other)?.succeeded())
}

/// The new epoch of an advance, and who chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The operator named it (`--new-epoch`): a run that finds an advance to
    /// another epoch in progress stops and names that epoch.
    Given(u64),
    /// lockctl chose it (from `--marks` or the coord cluster's counter), so each
    /// run may choose anew. A run that finds an earlier run's advance made (the
    /// record sealed in its target epoch) finishes that advance: its epoch is
    /// already taken. A run that finds only a seal naming another target (an
    /// earlier run's step 1, or the audit tailer's restore seal) re-aims it at
    /// this run's epoch: a seal alone took no epoch, and this one is known to be
    /// free.
    Chosen(u64),
}

impl Target {
    /// The epoch asked for.
    pub fn epoch(self) -> u64 {
        match self {
            Target::Given(e) | Target::Chosen(e) => e,
        }
    }
}

/// Runs (or resumes) the epoch advance from `expected` to `target`, printing each
/// step and what it verified.
pub async fn advance(
    client: &mut Client,
    root: &str,
    expected: u64,
    target: Target,
    out: &mut impl Write,
) -> Result<(), RestoreError> {
    let chosen = matches!(target, Target::Chosen(_));
    let mut target = target.epoch();
    let keys = Keys::new(root);
    let say = |out: &mut dyn Write, s: String| {
        let _ = writeln!(out, "{s}");
        let _ = out.flush();
    };
    // Whether this run made the advance (step 2); a resumed run says it found it.
    let mut advanced_here = false;
    for _ in 0..20 {
        let (rec, mod_rev, cluster) = read_record(client, &keys).await?;
        let bound = cluster_hex(cluster);
        match (rec.epoch, rec.sealed.is_some(), rec.target) {
            (e, false, _) if e == target => {
                say(out, format!("done: epoch {target} is current, bound to cluster {bound}, unsealed"));
                return Ok(());
            }
            (e, false, _) if e == expected => {
                let sealed = EpochRecord {
                    epoch: expected,
                    cluster_id: rec.cluster_id.clone(),
                    sealed: Some(format!("epoch advance {expected} -> {target} in progress")),
                    target: Some(target),
                    prior: rec.prior.clone(),
                };
                if put_record(client, &keys, mod_rev, &sealed, vec![]).await? {
                    say(out, format!("1/4 sealed: epoch record {expected} carries an explicit seal; every arbiter refuses requests"));
                }
            }
            (e, true, t) if e == expected && t != Some(target) => {
                if !chosen {
                    return Err(RestoreError::OtherTarget(t.unwrap_or_default()));
                }
                let aimed = EpochRecord { target: Some(target), ..rec };
                if put_record(client, &keys, mod_rev, &aimed, vec![]).await? {
                    say(out, format!("1/4 sealed: the epoch record {expected} was sealed for epoch {}; re-aimed at epoch {target}", t.map_or("?".to_owned(), |t| t.to_string())));
                }
            }
            (e, true, _) if e == expected => {
                let advanced = EpochRecord {
                    epoch: target,
                    cluster_id: bound.clone(),
                    sealed: Some(format!("epoch advance {expected} -> {target}: revoking restored sessions")),
                    target: Some(target),
                    // Every hold is deleted below: no older epoch stays live.
                    prior: Vec::new(),
                };
                let del = |p: String| TxnOp::delete(p, Some(DeleteOptions::new().with_prefix()));
                let holds = count(client, &keys.all_locks()).await?;
                let extra = vec![del(keys.all_locks()), del(format!("{}/q/", root.trim_end_matches('/')))];
                if put_record(client, &keys, mod_rev, &advanced, extra).await? {
                    advanced_here = true;
                    say(out, format!("2/4 advanced: epoch {expected} -> {target} bound to cluster {bound}; deleted {holds} restored holds and every waiter in the same transaction"));
                }
            }
            (e, true, t) if e == target && t == Some(target) => {
                if !advanced_here {
                    advanced_here = true;
                    say(out, format!("2/4 advanced earlier: the record already holds epoch {target} bound to cluster {bound} (an earlier run made the advance, with the delete of every restored hold and waiter)"));
                }
                let sessions = format!("{}/s/", root.trim_end_matches('/'));
                let r = Etcd::of(client)
                    .get(sessions.as_str(), Some(GetOptions::new().with_prefix()))
                    .await
                    .map_err(other)?;
                let mut revoked = 0;
                for kv in r.kvs() {
                    match Etcd::of(client).lease_revoke(kv.lease()).await {
                        Ok(_) => revoked += 1,
                        Err(e) if e.to_string().contains("lease not found") => {
                            // Already gone: remove the record if the lease was.
                            let _ = Etcd::of(client).delete(kv.key(), None).await;
                        }
                        Err(e) => return Err(other(e)),
                    }
                }
                let left = count(client, &sessions).await? + count(client, &keys.all_locks()).await?;
                if left != 0 {
                    return Err(other(format!("{left} sessions or holds remain after revoking; re-run")));
                }
                say(out, format!("3/4 revoked {revoked} restored session leases; verified: no session and no hold left under {root}"));
                let open = EpochRecord {
                    epoch: target,
                    cluster_id: bound.clone(),
                    sealed: None,
                    target: None,
                    prior: Vec::new(),
                };
                if put_record(client, &keys, mod_rev, &open, vec![]).await? {
                    say(
                        out,
                        format!("4/4 unsealed: epoch {target}; every new token is above every token issued before"),
                    );
                }
            }
            // An earlier run made the advance to another epoch (step 2's shape:
            // sealed in its own target) and stopped before unsealing.
            (e, true, Some(t)) if t == e && e > expected => {
                if !chosen {
                    return Err(RestoreError::OtherTarget(e));
                }
                say(out, format!("an earlier run advanced {expected} -> {e} and did not finish: finishing that advance (epoch {target} is not used)"));
                target = e;
            }
            (current, _, _) => return Err(RestoreError::StaleExpected { expected, current }),
        }
    }
    Err(other("the epoch record kept changing under the advance; re-run"))
}

async fn count(client: &mut Client, prefix: &str) -> Result<i64, RestoreError> {
    let r =
        Etcd::of(client).get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.map_err(other)?;
    Ok(r.count())
}

/// One member of a restored cluster.
#[derive(Debug, Clone)]
pub struct Member {
    /// `--name`.
    pub name: String,
    /// Data directory to create.
    pub data_dir: std::path::PathBuf,
    /// `--initial-advertise-peer-urls`.
    pub peer_url: String,
}

/// Restores `snapshot` into each member's data directory with `etcdutl`, bumping
/// revisions by `bump` (checked against 2^48). A directory that already holds this
/// restore (its stamp matches) is kept, so a re-run continues.
pub fn restore_snapshot(
    etcdutl: &Path,
    snapshot: &Path,
    members: &[Member],
    token: &str,
    bump: u64,
    out: &mut impl Write,
) -> Result<(), RestoreError> {
    let status = std::process::Command::new(etcdutl)
        .args(["snapshot", "status", "-w", "json"])
        .arg(snapshot)
        .output()
        .map_err(|e| other(format!("{}: {e}", etcdutl.display())))?;
    if !status.status.success() {
        return Err(other(format!("etcdutl snapshot status: {}", String::from_utf8_lossy(&status.stderr))));
    }
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).map_err(other)?;
    let rev = v["revision"].as_u64().ok_or_else(|| other("snapshot status without revision"))?;
    let hash = v["hash"].as_u64().unwrap_or_default();
    let headroom = REVISION_LIMIT.saturating_sub(rev.saturating_add(bump));
    if headroom < MIN_HEADROOM {
        return Err(RestoreError::Headroom { rev, bump, headroom });
    }
    let _ = writeln!(
        out,
        "snapshot revision {rev}, bump {bump}: revisions restart at {}, headroom {headroom} under 2^48",
        rev + bump
    );
    let cluster: Vec<String> = members.iter().map(|m| format!("{}={}", m.name, m.peer_url)).collect();
    let stamp_text = format!("{{\"snapshot_hash\":{hash},\"bump\":{bump}}}");
    for m in members {
        let stamp = m.data_dir.join("lockmesh-restore.json");
        if m.data_dir.exists() {
            if std::fs::read_to_string(&stamp).ok().as_deref() == Some(stamp_text.as_str()) {
                let _ = writeln!(out, "member {}: {} already holds this restore; kept", m.name, m.data_dir.display());
                continue;
            }
            return Err(other(format!("{} exists and is not this restore: move it away first", m.data_dir.display())));
        }
        let o = std::process::Command::new(etcdutl)
            .args(["snapshot", "restore"])
            .arg(snapshot)
            .arg(format!("--data-dir={}", m.data_dir.display()))
            .arg(format!("--name={}", m.name))
            .arg(format!("--initial-cluster={}", cluster.join(",")))
            .arg(format!("--initial-cluster-token={token}"))
            .arg(format!("--initial-advertise-peer-urls={}", m.peer_url))
            .arg(format!("--bump-revision={bump}"))
            .arg("--mark-compacted")
            .output()
            .map_err(other)?;
        if !o.status.success() {
            let _ = std::fs::remove_dir_all(&m.data_dir);
            return Err(other(format!("etcdutl snapshot restore: {}", String::from_utf8_lossy(&o.stderr))));
        }
        std::fs::write(&stamp, &stamp_text).map_err(other)?;
        let _ = writeln!(out, "member {}: restored into {}", m.name, m.data_dir.display());
    }
    Ok(())
}

/// Waits until etcd at `conn`'s endpoints answers a read of `root`'s epoch record
/// (over its TLS, as its user: a key its role may read), printing once that it waits. A refusal that waiting cannot cure (a
/// permission or authentication error) ends the wait at once with etcd's message.
pub async fn wait_for_etcd(
    conn: &EtcdConnection,
    root: &str,
    timeout: Duration,
    out: &mut impl Write,
) -> Result<Client, RestoreError> {
    let endpoints = &conn.endpoints;
    let probe = Keys::new(root).epoch();
    let _ = writeln!(out, "waiting for etcd at {} (start the restored members now)", endpoints.join(","));
    let _ = out.flush();
    let end = tokio::time::Instant::now() + timeout;
    loop {
        let attempt = async {
            let c = conn.connect().await?;
            Etcd::of(&c).get(probe.as_str(), None).await?;
            Ok::<_, etcd_client::Error>(c)
        };
        match tokio::time::timeout(Duration::from_secs(2), attempt).await {
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) if refused(&e) => return Err(other(format!("etcd at {}: {e}", endpoints.join(",")))),
            _ => {}
        }
        if tokio::time::Instant::now() >= end {
            return Err(other(format!("etcd at {} did not answer within {timeout:?}", endpoints.join(","))));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// An answer that retrying cannot change: the user may not read, or its
/// credentials are wrong.
fn refused(e: &etcd_client::Error) -> bool {
    let s = e.to_string();
    s.contains("permission denied") || s.contains("authentication failed") || s.contains("invalid auth token")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_to_guess_and_to_go_backwards() {
        assert!(matches!(choose_epoch(1, None, &[]), Err(RestoreError::NoTarget)));
        assert_eq!(choose_epoch(1, Some(2), &[]).unwrap(), 2);
        assert!(matches!(choose_epoch(3, Some(3), &[]), Err(RestoreError::TargetTooLow { .. })));
        assert!(matches!(
            choose_epoch(EPOCH_LIMIT - 1, None, &[Path::new("/nonexistent")]),
            Err(RestoreError::Other(_))
        ));
        assert!(matches!(choose_epoch(EPOCH_LIMIT - 1, Some(EPOCH_LIMIT), &[]), Err(RestoreError::EpochExhausted(_))));
    }
}
