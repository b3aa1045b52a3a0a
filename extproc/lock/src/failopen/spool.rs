//! The spool of unprotected grants: a local append-only file, one JSON line per
//! grant, release or expiry, written and fsynced **before** the grant is answered.
//!
//! - **Durability.** [`Spool::append`] writes the lines and calls `fsync` before it
//!   returns; a grant whose line did not reach the disk is never answered. A crash
//!   in the middle of a write leaves a torn last line: [`Spool::open`] cuts the file
//!   back to its last complete line (that grant was never answered).
//! - **Bound.** A grant line that would take the file past `max_bytes` is refused
//!   ([`SpoolError::Full`], code `spool_full`). End lines (release, expiry) are
//!   always written: each grant has at most one, so the file stays below twice the
//!   cap.
//! - **Consumption.** After its records were shipped ([`super::FailOpen::ship`]),
//!   [`Spool::consume`] drops the first `n` bytes: truncation when nothing was
//!   appended since the read, else the tail is copied to a temporary file that is
//!   fsynced and renamed over the spool. A crash before that leaves the records in
//!   place and they are shipped again; shipping is idempotent (the audit event key
//!   of an unprotected record does not depend on the etcd revision it shipped at).
//! - **Secrecy.** Lines carry raw keys and identities (like etcd's hold records and
//!   the audit store): the file is created `0600` and its content never logged.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Write},
    path::{Path, PathBuf},
    sync::Mutex,
};

pub use lockmesh_keyspace::spool::{SpoolOp, SpoolRecord};

/// Why a spool write failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpoolError {
    /// The grant line would take the spool past its cap.
    #[error("the unprotected-grant spool is full ({len} of {max} bytes); nothing is granted unprotected until it is shipped")]
    Full {
        /// Bytes the spool holds now.
        len: u64,
        /// The spool's cap, bytes.
        max: u64,
    },
    /// The file could not be written or synced.
    #[error("the unprotected-grant spool cannot be written: {0}")]
    Io(String),
}

/// An open spool.
#[derive(Debug)]
pub struct Spool {
    path: PathBuf,
    max_bytes: u64,
    file: Mutex<(File, u64)>,
}

fn io(e: std::io::Error) -> SpoolError {
    SpoolError::Io(e.to_string())
}

fn open_append(path: &Path) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.create(true).append(true).read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    o.open(path)
}

fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
}

/// Parses spool bytes: the records, the length of the complete lines, and how
/// many complete lines did not parse.
pub fn parse(bytes: &[u8]) -> (Vec<SpoolRecord>, u64, usize) {
    let mut records = Vec::new();
    let mut bad = 0;
    let mut good_len = 0;
    let mut start = 0;
    for (i, b) in bytes.iter().enumerate() {
        if *b != b'\n' {
            continue;
        }
        let line = &bytes[start..i];
        match serde_json::from_slice::<SpoolRecord>(line) {
            Ok(r) => records.push(r),
            Err(_) if line.is_empty() => {}
            Err(_) => bad += 1,
        }
        start = i + 1;
        good_len = start;
    }
    (records, u64::try_from(good_len).unwrap_or(u64::MAX), bad)
}

// === impl Spool ===

impl Spool {
    /// Opens (or creates, `0600`) the spool at `path` and returns the records it
    /// holds. A torn last line (a crash during a write) is cut off.
    pub fn open(path: &Path, max_bytes: u64) -> Result<(Self, Vec<SpoolRecord>), SpoolError> {
        let existed = path.exists();
        let mut f = open_append(path).map_err(|e| SpoolError::Io(format!("{}: {e}", path.display())))?;
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).map_err(io)?;
        let (records, good, bad) = parse(&bytes);
        if bad > 0 {
            tracing::error!(lines = bad, "unprotected-grant spool lines that do not parse were skipped");
        }
        if good < u64::try_from(bytes.len()).unwrap_or(u64::MAX) {
            tracing::warn!("the unprotected-grant spool ended in a torn line (a crash during a write); cut off");
            f.set_len(good).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        if !existed {
            f.sync_all().map_err(io)?;
            sync_dir(path);
        }
        Ok((Self { path: path.to_owned(), max_bytes, file: Mutex::new((f, good)) }, records))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (File, u64)> {
        self.file.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Current size, bytes.
    pub fn len(&self) -> u64 {
        self.lock().1
    }

    /// True when nothing waits to be shipped.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `records` and fsyncs. When `capped`, refuses (writing nothing) if
    /// the spool would pass its cap.
    pub fn append(&self, records: &[SpoolRecord], capped: bool) -> Result<(), SpoolError> {
        let mut buf = Vec::new();
        for r in records {
            serde_json::to_writer(&mut buf, r).map_err(|e| SpoolError::Io(e.to_string()))?;
            buf.push(b'\n');
        }
        let mut g = self.lock();
        let add = u64::try_from(buf.len()).unwrap_or(u64::MAX);
        if capped && g.1.saturating_add(add) > self.max_bytes {
            return Err(SpoolError::Full { len: g.1, max: self.max_bytes });
        }
        let before = g.1;
        let r = g.0.write_all(&buf).and_then(|()| g.0.sync_data());
        if let Err(e) = r {
            // Never leave half a line for the next write to continue: cut back.
            let _ = g.0.set_len(before);
            return Err(io(e));
        }
        g.1 = before + add;
        Ok(())
    }

    /// The records held now and the byte length they span.
    pub fn read(&self) -> Result<(Vec<SpoolRecord>, u64), SpoolError> {
        let g = self.lock();
        let mut f = File::open(&self.path).map_err(io)?;
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).map_err(io)?;
        let len = usize::try_from(g.1).unwrap_or(usize::MAX).min(bytes.len());
        let (records, good, _) = parse(&bytes[..len]);
        Ok((records, good))
    }

    /// Drops the first `upto` bytes (records shipped): truncation when nothing
    /// was appended since, else the rest is rewritten to a temporary file, synced
    /// and renamed over the spool.
    pub(crate) fn consume(&self, upto: u64) -> Result<(), SpoolError> {
        let mut g = self.lock();
        if upto >= g.1 {
            g.0.set_len(0).map_err(io)?;
            g.0.sync_all().map_err(io)?;
            g.1 = 0;
            return Ok(());
        }
        let mut bytes = Vec::new();
        File::open(&self.path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(io)?;
        let end = usize::try_from(g.1).unwrap_or(usize::MAX).min(bytes.len());
        let from = usize::try_from(upto).unwrap_or(usize::MAX).min(end);
        let tmp = self.path.with_extension("spool-tmp");
        {
            let mut t = File::create(&tmp).map_err(io)?;
            t.write_all(&bytes[from..end]).map_err(io)?;
            t.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, &self.path).map_err(io)?;
        sync_dir(&self.path);
        g.0 = open_append(&self.path).map_err(io)?;
        g.1 = u64::try_from(end - from).unwrap_or(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(op: SpoolOp, grant: &str) -> SpoolRecord {
        SpoolRecord {
            op,
            grant: grant.into(),
            key: "jobs/a".into(),
            digest: "dd".into(),
            class: "batch".into(),
            identity: "spiffe://td/ns/jobs/sa/w".into(),
            instance: None,
            hold_id: None,
            epoch: 1,
            cluster: "coord".into(),
            outage: "coord-1".into(),
            at_ms: 5,
            ttl_s: Some(30),
            reason: None,
        }
    }

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("lm-spool-{}-{:x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn appends_are_durable_lines_and_a_torn_tail_is_cut() {
        let d = dir();
        let p = d.join("u.spool");
        let (s, recs) = Spool::open(&p, 4096).unwrap();
        assert!(recs.is_empty() && s.is_empty());
        s.append(&[rec(SpoolOp::Grant, "g1")], true).unwrap();
        s.append(&[rec(SpoolOp::Release, "g1"), rec(SpoolOp::Grant, "g2")], true).unwrap();
        let on_disk = std::fs::read(&p).unwrap();
        assert_eq!(u64::try_from(on_disk.len()).unwrap(), s.len());
        assert_eq!(on_disk.iter().filter(|b| **b == b'\n').count(), 3);
        drop(s);
        // A crash mid-write: half a line at the end.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"{\"op\":\"grant\",\"gra").unwrap();
        let (s, recs) = Spool::open(&p, 4096).unwrap();
        assert_eq!(
            recs.iter().map(|r| (r.op, r.grant.as_str())).collect::<Vec<_>>(),
            [(SpoolOp::Grant, "g1"), (SpoolOp::Release, "g1"), (SpoolOp::Grant, "g2")]
        );
        assert_eq!(std::fs::read(&p).unwrap(), on_disk);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        }
        drop(s);
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn the_cap_refuses_grants_but_not_ends() {
        let d = dir();
        let (s, _) = Spool::open(&d.join("u.spool"), 600).unwrap();
        let mut n = 0;
        let full = loop {
            match s.append(&[rec(SpoolOp::Grant, &format!("g{n}"))], true) {
                Ok(()) => n += 1,
                Err(e) => break e,
            }
        };
        assert!(n >= 1);
        assert!(matches!(full, SpoolError::Full { max: 600, .. }), "{full:?}");
        let len = s.len();
        s.append(&[rec(SpoolOp::Release, "g0")], false).unwrap();
        assert!(s.len() > len && s.len() > 600);
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn consuming_keeps_what_was_appended_after_the_read() {
        let d = dir();
        let p = d.join("u.spool");
        let (s, _) = Spool::open(&p, 1 << 20).unwrap();
        s.append(&[rec(SpoolOp::Grant, "g1"), rec(SpoolOp::Grant, "g2")], true).unwrap();
        let (recs, upto) = s.read().unwrap();
        assert_eq!(recs.len(), 2);
        s.append(&[rec(SpoolOp::Release, "g1")], false).unwrap();
        s.consume(upto).unwrap();
        let (left, _) = s.read().unwrap();
        assert_eq!(left.iter().map(|r| (r.op, r.grant.as_str())).collect::<Vec<_>>(), [(SpoolOp::Release, "g1")]);
        // Appends continue after the rename, and a full consume truncates.
        s.append(&[rec(SpoolOp::Expiry, "g2")], false).unwrap();
        assert_eq!(Spool::open(&p, 1 << 20).unwrap().1.len(), 2);
        let (_, upto) = s.read().unwrap();
        s.consume(upto).unwrap();
        assert!(s.is_empty());
        assert!(std::fs::read(&p).unwrap().is_empty());
        std::fs::remove_dir_all(d).unwrap();
    }
}
