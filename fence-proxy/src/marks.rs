//! Durable high-water marks, one per resource, in an embedded redb database in
//! `marks_dir` (`marks.redb`).
//!
//! - Every advance is its own write transaction, committed with redb's default
//!   `Durability::Immediate` (fsync) before the write is forwarded.
//! - Single writer: redb holds an exclusive `flock` on the file for as long as the
//!   database is open, so a second fence-proxy on the same volume fails to start
//!   ([`MarksError::InUse`]). Each marks database has a random instance id, created
//!   with it; fence-proxy forwards it (`x-lockmesh-fence-instance`) and shows it on
//!   `/readyz`, so two fences writing one store from two volumes can be told apart.
//! - The rule (docs/FENCING.md): one fence-proxy, one marks volume per store.

use std::path::{Path, PathBuf};

use lockmesh_core::FencingToken;
use redb::{Database, ReadableTable as _, TableDefinition};

use crate::{route::EqualRule, token::MarkDecision};

const MARKS: TableDefinition<'_, &str, u64> = TableDefinition::new("marks");
const META: TableDefinition<'_, &str, &str> = TableDefinition::new("meta");
/// File name of the marks database inside `marks_dir`.
pub(crate) const DB_FILE: &str = "marks.redb";

/// The open marks database.
pub struct Marks {
    db: Database,
    instance: String,
    path: PathBuf,
}

/// Why the marks store failed. Messages never carry a resource id.
#[derive(Debug, thiserror::Error)]
pub enum MarksError {
    /// Another process has the database open.
    #[error("{0} is in use by another fence-proxy: one fence-proxy per marks volume and store")]
    InUse(String),
    /// I/O or database error.
    #[error("marks store: {0}")]
    Store(String),
    /// A stored value is not a fencing token (corruption).
    #[error("marks store holds a value that is not a fencing token")]
    Corrupt,
}

fn store(e: impl std::fmt::Display) -> MarksError {
    MarksError::Store(e.to_string())
}

// === impl Marks ===

impl Marks {
    /// Opens (or creates) `dir/marks.redb`, taking the exclusive lock.
    pub fn open(dir: &Path) -> Result<Self, MarksError> {
        std::fs::create_dir_all(dir).map_err(|e| MarksError::Store(format!("create {}: {e}", dir.display())))?;
        let path = dir.join(DB_FILE);
        let db = Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => MarksError::InUse(path.display().to_string()),
            e => MarksError::Store(format!("open {}: {e}", path.display())),
        })?;
        let txn = db.begin_write().map_err(store)?;
        let instance = {
            let _ = txn.open_table(MARKS).map_err(store)?;
            let mut meta = txn.open_table(META).map_err(store)?;
            let existing = meta.get("instance_id").map_err(store)?.map(|v| v.value().to_owned());
            match existing {
                Some(id) => id,
                None => {
                    let id = format!("{:016x}", rand::random::<u64>());
                    meta.insert("instance_id", id.as_str()).map_err(store)?;
                    id
                }
            }
        };
        txn.commit().map_err(store)?;
        Ok(Self { db, instance, path })
    }

    /// This marks database's instance id.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mark of `resource`.
    pub fn get(&self, resource: &str) -> Result<Option<FencingToken>, MarksError> {
        let txn = self.db.begin_read().map_err(store)?;
        let t = txn.open_table(MARKS).map_err(store)?;
        let v = t.get(resource).map_err(store)?.map(|v| v.value());
        v.map(|v| FencingToken::from_packed(v).map_err(|_| MarksError::Corrupt)).transpose()
    }

    /// Applies the mark rule to `token` and, when it advances, makes the new mark
    /// durable before returning. The compare and the write are one transaction.
    pub fn check_and_advance(
        &self,
        resource: &str,
        token: FencingToken,
        equal: EqualRule,
    ) -> Result<MarkDecision, MarksError> {
        // Most refusals and allowed equals need no write transaction.
        let d = crate::token::check(self.get(resource)?, token, equal);
        if d != MarkDecision::Advance {
            return Ok(d);
        }
        let txn = self.db.begin_write().map_err(store)?;
        let d = {
            let mut t = txn.open_table(MARKS).map_err(store)?;
            let cur = t.get(resource).map_err(store)?.map(|v| v.value());
            let cur = cur.map(|v| FencingToken::from_packed(v).map_err(|_| MarksError::Corrupt)).transpose()?;
            let d = crate::token::check(cur, token, equal);
            if d == MarkDecision::Advance {
                t.insert(resource, token.get()).map_err(store)?;
            }
            d
        };
        txn.commit().map_err(store)?;
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(v: u64) -> FencingToken {
        FencingToken::from_packed(v).unwrap()
    }

    #[test]
    fn marks_survive_reopen_and_a_second_opener_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let m = Marks::open(dir.path()).unwrap();
        let id = m.instance().to_owned();
        assert_eq!(m.check_and_advance("r", tok(5), EqualRule::Strict).unwrap(), MarkDecision::Advance);
        assert_eq!(m.check_and_advance("r", tok(5), EqualRule::Strict).unwrap(), MarkDecision::Stale);
        assert_eq!(m.check_and_advance("r", tok(5), EqualRule::Allow).unwrap(), MarkDecision::Equal);
        assert_eq!(m.check_and_advance("r", tok(3), EqualRule::Allow).unwrap(), MarkDecision::Stale);
        assert!(matches!(Marks::open(dir.path()), Err(MarksError::InUse(_))));
        drop(m);
        let m = Marks::open(dir.path()).unwrap();
        assert_eq!(m.instance(), id);
        assert_eq!(m.get("r").unwrap(), Some(tok(5)));
        assert_eq!(m.get("other").unwrap(), None);
    }
}
