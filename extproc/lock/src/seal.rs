//! Restore safety: the seal (docs/DECISIONS.md ADR-03).
//!
//! `etcdutl snapshot restore` with the original `--initial-cluster` and token keeps
//! the cluster id, rolls revisions back (or, with `--bump-revision`, ahead) and
//! brings restored holds back. So the arbiter keeps a durable high-water mark of
//! what it has seen, in a small local file, and seals when the cluster is behind it:
//!
//! | check | source (linearizable only) | restore it catches |
//! |---|---|---|
//! | cluster id | every response header vs mark and epoch record | a restore that changed the id |
//! | revision | linearizable reads and grant commits vs the revision floor | restore without bump |
//! | epoch | the epoch record vs mark | a restore to before an advance |
//! | grant clock | the mod revision of `<root>/sys/clock`, which every grant puts and compares | restore with or without bump, under any etcd role |
//! | raft (term, index) | status of the member that is leader, read after a linearizable read through it | restore with bump (the raft log restarts); root only |
//! | raft term | the `raft_term` of every linearizable answer's header (seal-check reads, grant and hand-off commits) | a restore to a cluster whose term is below what this arbiter saw, even one it slept through; any role |
//!
//! The grant clock is one key every grant and hand-off transaction writes (an empty
//! value, no lease), so its mod revision is the commit revision of the latest grant
//! on the cluster. A restore brings back the key as the snapshot had it: below what
//! this arbiter saw after the snapshot, whatever `--bump-revision` did to the store's
//! revision, since a bump moves only revisions written after the restore. Every grant
//! compares the clock's mod revision at or above the arbiter's clock mark, so the
//! first grant after such a restore fails its compare, writes nothing and seals
//! (`clock_behind_mark`); the seal check compares it once a second. Unlike etcd's
//! `Status` it needs no root: a plain read and write of one key the arbiter's role
//! grants. A role without that grant (a deployment whose roles predate it) turns the
//! clock off, loudly (`/status` `marks.clock_off`, a warning each minute), and the raft check
//! is then the only guard against a bumped restore.
//!
//! The raft term needs no root either: etcd puts in every response header the
//! term of the last entry the answering member applied (0 when it has applied
//! none since it started: unknown, ignored). A linearizable answer comes after
//! the member applied everything committed before the request, so across such
//! answers the term never goes down; a restore starts a new raft log, and the
//! restored cluster elects from term 1 again. So an answer below the term mark is
//! from a restored cluster, even for an arbiter that was down through the whole
//! lost stretch (its revision and clock marks predate the snapshot, so they cannot
//! tell). It is blind when the cluster before the restore never got past the
//! restored cluster's term (no leader change since it started or was last
//! restored): docs/OPERATIONS.md says what the restore runbook does about it.
//!
//! A lagging follower cannot seal: revisions come from linearizable answers only,
//! and raft positions only from a member that proves it leads by serving a
//! linearizable read itself. The seal clears only when the epoch record shows a
//! newer epoch without an explicit seal (the guarded epoch advance); marks are
//! then re-based on the new epoch.

use std::{
    path::{Path, PathBuf},
    sync::Mutex,
};

use serde::{Deserialize, Serialize};

use super::now_ms;

/// Why the arbiter is sealed (a bounded metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealReason {
    /// The etcd cluster id differs from the mark or the epoch record.
    ClusterIdMismatch,
    /// A linearizable revision is below the mark.
    RevisionBehindMark,
    /// The epoch record's epoch is below the mark.
    EpochBehindMark,
    /// The leader's raft (term, index) is below the mark.
    RaftBehindMark,
    /// The grant clock's mod revision is below the mark (a restore, bumped or not).
    ClockBehindMark,
    /// A linearizable answer's raft term is below the mark (a restore: the raft
    /// log restarted).
    TermBehindMark,
    /// The epoch record carries an explicit seal (an epoch advance in progress).
    Explicit,
}

impl SealReason {
    /// Every reason, for metrics.
    pub const ALL: [SealReason; 6] = [
        SealReason::ClusterIdMismatch,
        SealReason::RevisionBehindMark,
        SealReason::EpochBehindMark,
        SealReason::RaftBehindMark,
        SealReason::ClockBehindMark,
        SealReason::Explicit,
    ];

    /// The wire and label string.
    pub fn as_str(self) -> &'static str {
        match self {
            SealReason::ClusterIdMismatch => "cluster_id_mismatch",
            SealReason::RevisionBehindMark => "revision_behind_mark",
            SealReason::EpochBehindMark => "epoch_behind_mark",
            SealReason::RaftBehindMark => "raft_behind_mark",
            SealReason::TermBehindMark => "term_behind_mark",
            SealReason::ClockBehindMark => "clock_behind_mark",
            SealReason::Explicit => "explicit",
        }
    }
}

/// The current seal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealInfo {
    pub reason: SealReason,
    /// Detail for operators (numbers, never keys or tokens).
    pub detail: String,
    /// When it was declared, unix ms.
    pub since_ms: u64,
}

/// The durable high-water mark.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marks {
    /// The key root these marks belong to.
    pub root: String,
    /// Cluster id (16 hex digits), empty until first seen.
    pub cluster_id: String,
    /// Highest epoch seen.
    pub epoch: u64,
    /// Highest linearizable revision seen in this epoch.
    pub revision: i64,
    /// Highest leader raft term seen in this epoch.
    pub raft_term: u64,
    /// Highest leader raft index seen at that term.
    pub raft_index: u64,
    /// Highest mod revision of the grant clock seen in this epoch (0: none yet;
    /// marks files of builds before the clock have none).
    #[serde(default)]
    pub clock: i64,
    /// Highest raft term a linearizable answer's header carried in this epoch
    /// (0: none yet; marks files of builds before the term mark have none).
    #[serde(default)]
    pub term: u64,
    /// Last update, unix ms.
    pub updated_ms: u64,
}

/// One round of linearizable observations.
#[derive(Debug, Clone, Copy)]
pub struct Observation<'a> {
    /// Cluster id in the response header.
    pub cluster: u64,
    /// Cluster id in the epoch record.
    pub record_cluster: u64,
    /// Epoch in the epoch record.
    pub epoch: u64,
    /// The record's explicit seal.
    pub explicit: Option<&'a str>,
    /// The revision floor captured before the read was sent.
    pub floor: i64,
    /// The read's revision.
    pub revision: i64,
    /// The leader's (term, index), if a member proved it leads.
    pub raft: Option<(u64, u64)>,
    /// The clock mark captured before the read was sent.
    pub clock_floor: i64,
    /// The grant clock's mod revision (0: absent), `None` when it is off.
    pub clock: Option<i64>,
    /// The raft term in the read's header.
    pub term: u64,
    /// The record's `prior` epochs: a move's soft advance (`lock::home`) keeps the
    /// epoch it advanced from there, a guarded (restore) advance clears them.
    pub prior: &'a [u64],
}

/// Seal state and marks.
pub struct Seal {
    path: Option<PathBuf>,
    marks: Mutex<Marks>,
    persisted: Mutex<Marks>,
    state: Mutex<Option<SealInfo>>,
    /// Why the grant clock is off (`None`: on). On from the start (grants compare
    /// it); a seal check that finds the role may not read and write it turns it off.
    clock_off: Mutex<Option<String>>,
    /// When the clock's state was last logged, unix ms.
    clock_said: Mutex<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// === impl Seal ===

impl Seal {
    /// Loads marks from `path` (a missing file starts empty). A file written for
    /// another root is refused.
    pub fn load(path: Option<&Path>, root: &str) -> Result<Self, String> {
        let mut marks = Marks { root: root.to_owned(), ..Marks::default() };
        if let Some(p) = path {
            match std::fs::read(p) {
                Ok(b) => {
                    let m: Marks =
                        serde_json::from_slice(&b).map_err(|e| format!("{}: not a marks file: {e}", p.display()))?;
                    if m.root != root {
                        return Err(format!("{}: marks belong to root {:?}, not {root:?}", p.display(), m.root));
                    }
                    marks = m;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("{}: {e}", p.display())),
            }
        }
        Ok(Self {
            path: path.map(Path::to_owned),
            persisted: Mutex::new(marks.clone()),
            marks: Mutex::new(marks),
            state: Mutex::new(None),
            clock_off: Mutex::new(None),
            clock_said: Mutex::new(0),
        })
    }

    /// The seal, if sealed.
    pub fn current(&self) -> Option<SealInfo> {
        lock(&self.state).clone()
    }

    /// The marks in memory.
    pub fn marks(&self) -> Marks {
        lock(&self.marks).clone()
    }

    /// The lowest revision a linearizable answer to a request sent now may carry.
    pub(crate) fn revision_floor(&self) -> i64 {
        lock(&self.marks).revision
    }

    /// The clock mark a grant in epoch `epoch` compares, `None` while the clock is
    /// off or when `epoch` is above the marks' (an epoch advance, which ends every
    /// restored hold, that the next seal check re-bases the marks on: the mark
    /// then belongs to the store before the advance).
    pub(crate) fn clock_floor(&self, epoch: u64) -> Option<i64> {
        if lock(&self.clock_off).is_some() {
            return None;
        }
        let m = lock(&self.marks);
        // Marks not yet based on an epoch (no seal check and no grant yet) hold
        // clock 0: the compare passes and the grant puts the clock.
        (epoch <= m.epoch || m.epoch == 0).then_some(m.clock)
    }

    /// Why the grant clock is off, `None` when it is on.
    pub fn clock_off(&self) -> Option<String> {
        lock(&self.clock_off).clone()
    }

    /// Records whether the role may use the grant clock (each seal check).
    /// Returns whether to say so in the log: when it changed, and once a minute
    /// while it stays off.
    pub(crate) fn set_clock_off(&self, why: Option<String>) -> bool {
        let mut c = lock(&self.clock_off);
        let changed = c.is_some() != why.is_some();
        let now = now_ms();
        let mut said = lock(&self.clock_said);
        let say = changed || (why.is_some() && now.saturating_sub(*said) >= 60_000);
        if say {
            *said = now;
        }
        *c = why;
        say
    }

    /// Raises the clock mark after a grant in `epoch` committed (its commit
    /// revision is the clock's mod revision: the grant put it).
    pub(crate) fn observe_clock(&self, rev: i64, epoch: u64) {
        let mut m = lock(&self.marks);
        Self::base(&mut m, epoch);
        if rev > m.clock {
            m.clock = rev;
        }
    }

    /// Marks that no seal check has based yet take the epoch of the first grant
    /// they observe (its transaction compared that epoch record): the first check
    /// then compares against what the grants saw instead of taking its own read
    /// as the start of a new epoch, which would accept a restore that came between
    /// those grants and that check.
    fn base(m: &mut Marks, epoch: u64) {
        if m.epoch == 0 {
            m.epoch = epoch;
        }
    }

    /// Declares a seal (the first reason stays until the epoch advances).
    pub fn seal(&self, reason: SealReason, detail: String) {
        let mut s = lock(&self.state);
        if s.is_none() {
            tracing::error!(reason = reason.as_str(), %detail, "SEALED: the lock service refuses every request until an operator advances the epoch");
            *s = Some(SealInfo { reason, detail, since_ms: now_ms() });
        }
    }

    /// The raft term in the header of a committed grant or hand-off in `epoch`:
    /// below the term mark it seals (a restore; the caller's `unsealed` check then
    /// refuses), else it raises the mark.
    pub(crate) fn observe_term(&self, term: u64, epoch: u64) {
        // 0: a member that has applied no entry since it started (etcd takes the
        // header's term from the last applied entry): unknown, not low.
        if term == 0 || super::test_faults::on(super::test_faults::TestFault::SkipTermMark) {
            return;
        }
        let mut m = lock(&self.marks);
        Self::base(&mut m, epoch);
        if m.epoch != epoch {
            // A grant of an epoch the marks have not re-based to yet (a guarded
            // advance the seal check has not read): its cluster restarted the
            // marks, so this term is no evidence either way.
            return;
        }
        if term < m.term {
            let why = format!("raft term {term} below mark {}", m.term);
            drop(m);
            self.seal(SealReason::TermBehindMark, why);
            return;
        }
        m.term = term;
    }

    /// Raises the revision mark after a grant in `epoch` committed.
    pub(crate) fn observe_revision(&self, rev: i64, epoch: u64) {
        let mut m = lock(&self.marks);
        Self::base(&mut m, epoch);
        if rev > m.revision {
            m.revision = rev;
        }
    }

    /// Checks one round of linearizable observations against the marks and, if
    /// they pass, raises the marks. `raft` is `None` when no member proved it leads.
    pub fn check(&self, o: &Observation<'_>) {
        let Observation { cluster, epoch, explicit, revision, raft, clock, term, prior, .. } = *o;
        // 0: the member has applied no entry since it started (its term is
        // unknown, not low).
        let term =
            Some(term).filter(|t| *t > 0 && !super::test_faults::on(super::test_faults::TestFault::SkipTermMark));
        let cluster_hex = super::epoch::cluster_hex(cluster);
        let mut m = lock(&self.marks);
        // A move's soft advance from the epoch this arbiter marked keeps that
        // epoch's holds valid (`prior`): it is no guarded advance, so it neither
        // clears a seal nor restarts the marks (a restore before it is still the
        // restore it was). Only the guarded advance, which clears `prior`, does.
        let soft = m.epoch > 0
            && prior.contains(&m.epoch)
            && !super::test_faults::on(super::test_faults::TestFault::SoftAdvanceUnseals);
        if epoch > m.epoch && explicit.is_none() && soft {
            m.epoch = epoch;
            drop(m);
            if self.current().is_some() {
                tracing::warn!(epoch, "epoch advanced by a move while sealed: still sealed until the guarded advance");
                return;
            }
            return self.check(&Observation { prior: &[], ..*o });
        }
        if epoch > m.epoch && explicit.is_none() {
            // A newer epoch without an explicit seal: the guarded advance happened.
            // Marks restart in the new epoch; any seal clears.
            if self.current().is_some() {
                tracing::warn!(epoch, "epoch advanced: unsealed");
            }
            *m = Marks {
                root: m.root.clone(),
                cluster_id: cluster_hex.clone(),
                epoch,
                revision,
                raft_term: 0,
                raft_index: 0,
                clock: clock.unwrap_or(0),
                term: term.unwrap_or(0),
                updated_ms: now_ms(),
            };
            if let Some((t, i)) = raft {
                (m.raft_term, m.raft_index) = (t, i);
            }
            *lock(&self.state) = None;
            return;
        }
        let verdict = verdict(&m, o, &cluster_hex, term);
        match verdict {
            Some((reason, detail)) => {
                drop(m);
                self.seal(reason, detail);
            }
            None if self.current().is_none() => {
                m.cluster_id = cluster_hex;
                m.epoch = m.epoch.max(epoch);
                m.revision = m.revision.max(revision);
                m.clock = m.clock.max(clock.unwrap_or(0));
                if let Some(t) = term {
                    m.term = m.term.max(t);
                }
                if let Some(ti) = raft {
                    if ti > (m.raft_term, m.raft_index) {
                        (m.raft_term, m.raft_index) = ti;
                    }
                }
                m.updated_ms = now_ms();
            }
            None => {}
        }
    }

    /// Writes the marks durably (temp file, fsync, rename) when they changed.
    pub fn persist(&self) -> std::io::Result<()> {
        let Some(path) = &self.path else { return Ok(()) };
        let m = self.marks();
        {
            let p = lock(&self.persisted);
            if (p.epoch, p.revision, p.raft_term, p.raft_index, p.clock, p.term, &p.cluster_id)
                == (m.epoch, m.revision, m.raft_term, m.raft_index, m.clock, m.term, &m.cluster_id)
            {
                return Ok(());
            }
        }
        let tmp = path.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(&m).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        *lock(&self.persisted) = m;
        Ok(())
    }
}

/// The seal an observation `o` calls for against the marks `m` (`cluster_hex`:
/// its cluster in hex; `term`: its raft term when known), or `None`.
fn verdict(m: &Marks, o: &Observation<'_>, cluster_hex: &str, term: Option<u64>) -> Option<(SealReason, String)> {
    if let Some(why) = o.explicit {
        Some((SealReason::Explicit, format!("epoch record sealed: {why}")))
    } else if (!m.cluster_id.is_empty() && m.cluster_id != *cluster_hex) || o.cluster != o.record_cluster {
        Some((
            SealReason::ClusterIdMismatch,
            format!(
                "cluster {cluster_hex}, mark {:?}, epoch record {}",
                m.cluster_id,
                super::epoch::cluster_hex(o.record_cluster)
            ),
        ))
    } else if o.epoch < m.epoch {
        Some((SealReason::EpochBehindMark, format!("epoch {} below mark {}", o.epoch, m.epoch)))
    } else if o.revision < o.floor {
        Some((SealReason::RevisionBehindMark, format!("revision {} below mark {}", o.revision, o.floor)))
    } else if let Some(c) = o.clock.filter(|c| *c < o.clock_floor) {
        Some((SealReason::ClockBehindMark, format!("grant clock {c} below mark {}", o.clock_floor)))
    } else if let Some((t, i)) = o.raft.filter(|ti| *ti < (m.raft_term, m.raft_index)) {
        Some((
            SealReason::RaftBehindMark,
            format!("leader raft ({t}, {i}) below mark ({}, {})", m.raft_term, m.raft_index),
        ))
    } else if let Some(t) = term.filter(|t| *t < m.term) {
        Some((SealReason::TermBehindMark, format!("raft term {t} below mark {}", m.term)))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seal() -> Seal {
        Seal::load(None, "/r").unwrap()
    }

    fn obs(
        cluster: u64,
        record_cluster: u64,
        epoch: u64,
        explicit: Option<&str>,
        floor: i64,
        revision: i64,
        raft: Option<(u64, u64)>,
    ) -> Observation<'_> {
        Observation {
            cluster,
            record_cluster,
            epoch,
            explicit,
            floor,
            revision,
            raft,
            clock_floor: 0,
            clock: None,
            term: 0,
            prior: &[],
        }
    }

    /// Grants before the first seal check: a restore between them and that check
    /// is caught by it (it once took its own read as a new epoch's start), and the
    /// grants put the clock.
    #[test]
    fn grants_before_the_first_check_base_the_marks_and_a_restore_before_it_seals() {
        let s = seal();
        assert_eq!(s.clock_floor(2), Some(0), "unbased marks: the first grants compare and put the clock");
        s.observe_revision(13, 2);
        s.observe_clock(13, 2);
        assert_eq!((s.marks().epoch, s.marks().revision, s.clock_floor(2)), (2, 13, Some(13)));
        // The first check reads the restored store: revision 7, same epoch.
        s.check(&obs(7, 7, 2, None, s.revision_floor(), 7, None));
        assert_eq!(s.current().map(|i| i.reason), Some(SealReason::RevisionBehindMark));
        // A guarded advance after those grants still restarts the marks.
        let a = seal();
        a.observe_revision(13, 2);
        a.check(&obs(7, 7, 3, None, a.revision_floor(), 7, None));
        assert_eq!((a.current(), a.marks().epoch, a.marks().revision), (None, 3, 7));
    }

    #[test]
    fn a_moves_soft_advance_neither_unseals_nor_restarts_the_marks() {
        let s = seal();
        s.check(&obs(7, 7, 1, None, 0, 15, Some((3, 9))));
        // A restore: revisions back below the mark.
        s.check(&obs(7, 7, 1, None, 15, 12, Some((3, 9))));
        assert_eq!(s.current().map(|i| i.reason), Some(SealReason::RevisionBehindMark));
        // `lockctl shard apply` advances the epoch softly (epoch 1 kept in prior).
        s.check(&Observation { prior: &[1], ..obs(7, 7, 2, None, 15, 13, Some((3, 10))) });
        assert_eq!(s.current().map(|i| i.reason), Some(SealReason::RevisionBehindMark), "a soft advance unsealed");
        assert_eq!(s.marks().epoch, 2);
        // Only the guarded advance (prior cleared) unseals.
        s.check(&obs(7, 7, 3, None, 15, 14, Some((3, 11))));
        assert_eq!(s.current(), None);
        // On a healthy cluster a soft advance keeps the marks and stays unsealed.
        let h = seal();
        h.check(&obs(7, 7, 1, None, 0, 15, Some((3, 9))));
        h.check(&Observation { prior: &[1], ..obs(7, 7, 2, None, 15, 16, Some((3, 10))) });
        assert_eq!((h.current(), h.marks().epoch, h.marks().revision), (None, 2, 16));
        // ... and still seals a restore after it.
        h.check(&Observation { prior: &[1], ..obs(7, 7, 2, None, 16, 10, Some((3, 10))) });
        assert_eq!(h.current().map(|i| i.reason), Some(SealReason::RevisionBehindMark));
    }

    #[test]
    fn a_grant_clock_behind_its_mark_seals_whatever_the_revision_and_raft_say() {
        let s = seal();
        let o = |floor, revision, clock_floor, clock| Observation {
            clock_floor,
            clock,
            ..obs(7, 7, 1, None, floor, revision, None)
        };
        s.check(&o(0, 10, 0, Some(8)));
        s.check(&o(10, 20, 8, Some(19)));
        assert_eq!((s.current(), s.marks().clock), (None, 19));
        // The clock off (None) is never compared, whatever the mark.
        s.check(&o(20, 25, 19, None));
        assert_eq!(s.current(), None);
        // A bumped restore: revisions far ahead, the clock back where the snapshot had it.
        s.check(&o(25, 1_000_030, 19, Some(12)));
        assert_eq!(s.current().map(|i| i.reason), Some(SealReason::ClockBehindMark));
        // The epoch advance re-bases the clock mark on the restored clock.
        s.check(&o(25, 1_000_040, 19, Some(12)).clone());
        s.check(&Observation { epoch: 2, ..o(25, 1_000_050, 19, Some(12)) });
        assert_eq!((s.current(), s.marks().clock), (None, 12));
    }

    #[test]
    fn a_healthy_history_never_seals_and_raises_marks() {
        let s = seal();
        s.check(&obs(7, 7, 1, None, 0, 10, Some((2, 20))));
        s.check(&obs(7, 7, 1, None, 10, 15, Some((2, 25))));
        s.check(&obs(7, 7, 1, None, 15, 15, Some((3, 5)))); // new term, index restarts counting
        assert_eq!(s.current(), None);
        let m = s.marks();
        assert_eq!((m.epoch, m.revision, m.raft_term, m.raft_index), (1, 15, 3, 5));
    }

    /// The term of linearizable answers: a check or a committed grant below the
    /// mark seals; a guarded advance re-bases it; a grant of an epoch the marks
    /// have not re-based to is no evidence.
    #[test]
    fn a_raft_term_below_the_mark_seals_from_a_check_or_a_grant() {
        let s = seal();
        s.check(&Observation { term: 4, ..obs(7, 7, 1, None, 0, 10, None) });
        s.observe_term(5, 1);
        assert_eq!((s.marks().term, s.current()), (5, None));
        // An arbiter that slept through a snapshot and restore: revision and
        // clock are past its marks, only the term shows the restarted raft log.
        s.check(&Observation { term: 2, ..obs(7, 7, 1, None, 10, 40, None) });
        assert_eq!(s.current().map(|i| i.reason), Some(SealReason::TermBehindMark));
        s.check(&Observation { term: 2, ..obs(7, 7, 2, None, 10, 40, None) });
        assert_eq!((s.current(), s.marks().term), (None, 2), "the guarded advance re-bases the term");

        let z = seal();
        z.observe_term(3, 1);
        z.observe_term(0, 1);
        z.check(&Observation { term: 0, ..obs(7, 7, 1, None, 0, 10, None) });
        assert_eq!((z.current(), z.marks().term), (None, 3), "0 is a member that applied nothing yet: unknown");

        let g = seal();
        g.observe_term(6, 1);
        g.observe_term(2, 2);
        assert_eq!(g.current(), None, "a grant of a newer epoch than the marks");
        g.observe_term(3, 1);
        assert_eq!(g.current().map(|i| i.reason), Some(SealReason::TermBehindMark));
    }

    #[test]
    fn each_restore_signature_seals_and_only_an_advance_unseals() {
        for (cluster, epoch, rev, raft, want) in [
            (8, 1, 20, Some((3, 9)), SealReason::ClusterIdMismatch),
            (7, 0, 20, Some((3, 9)), SealReason::EpochBehindMark),
            (7, 1, 12, Some((3, 9)), SealReason::RevisionBehindMark),
            (7, 1, 1_000_020, Some((2, 4)), SealReason::RaftBehindMark),
        ] {
            let s = seal();
            s.check(&obs(7, 7, 1, None, 0, 15, Some((3, 9))));
            s.check(&obs(cluster, cluster, epoch, None, 15, rev, raft));
            assert_eq!(s.current().map(|i| i.reason), Some(want));
            // Catching up does not unseal; a new epoch does.
            s.check(&obs(7, 7, 1, None, 15, 2_000_000, Some((9, 9))));
            assert!(s.current().is_some());
            s.check(&obs(7, 7, 2, Some("advance in progress"), 15, 30, Some((3, 10))));
            assert!(s.current().is_some());
            s.check(&obs(7, 7, 2, None, 15, 30, Some((3, 10))));
            assert_eq!(s.current(), None);
            assert_eq!(s.marks().epoch, 2);
        }
    }

    #[test]
    fn marks_survive_a_restart_and_refuse_another_root() {
        let dir = std::env::temp_dir().join(format!("lockmesh-seal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("marks.json");
        let s = Seal::load(Some(&p), "/r").unwrap();
        s.check(&obs(7, 7, 1, None, 0, 42, Some((2, 9))));
        s.persist().unwrap();
        let again = Seal::load(Some(&p), "/r").unwrap();
        assert_eq!(again.marks().revision, 42);
        assert!(Seal::load(Some(&p), "/other").is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
