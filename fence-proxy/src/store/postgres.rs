//! The PostgreSQL reference fence: a `fence_token` column updated in the same
//! statement as the guarded write, so the check and the write are one atomic step.
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS items (
//!   id text PRIMARY KEY, value text NOT NULL,
//!   fence_token bigint NOT NULL CHECK (fence_token >= 0));
//! -- strict: only a greater token writes (one write per grant per row)
//! INSERT INTO items AS t (id, value, fence_token) VALUES ($1, $2, $3)
//! ON CONFLICT (id) DO UPDATE SET value = EXCLUDED.value, fence_token = EXCLUDED.fence_token
//! WHERE t.fence_token < EXCLUDED.fence_token;    -- 0 rows affected: stale, nothing written
//! -- allow-equal: ... WHERE t.fence_token <= EXCLUDED.fence_token;
//! ```
//!
//! Under PostgreSQL's default READ COMMITTED, `ON CONFLICT DO UPDATE` locks the
//! conflicting row and evaluates the `WHERE` against its latest committed version,
//! so two writers cannot both pass the check on the same old value: the mark never
//! goes backwards. The same shape fits any guarded `UPDATE`:
//! `UPDATE items SET ..., fence_token = $t WHERE id = $id AND fence_token < $t`.
//!
//! What the column does not know is which lock a token belongs to (tokens are
//! comparable across keys): the application must pass the token of the lock that
//! guards the row. Tokens are stored as `bigint`: lockmesh tokens (epoch x 2^48 +
//! revision, epoch below 2^15) always fit; [`PgFenceError::TokenRange`] is the
//! defensive check before the statement runs.

use lockmesh_core::FencingToken;
use tokio_postgres::{GenericClient, NoTls};

use crate::route::EqualRule;

/// Longest table name (PostgreSQL's identifier limit).
pub(crate) const MAX_TABLE_LEN: usize = 63;

/// A fenced table: `id text PRIMARY KEY, value text, fence_token bigint`.
#[derive(Clone, Debug)]
pub struct PgFence {
    table: String,
    equal: EqualRule,
    write_sql: String,
    read_sql: String,
}

/// What a fenced write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The row was inserted or updated; its fence is now the token.
    Applied,
    /// The token was below the fence (or equal under `strict`): nothing written.
    Stale,
}

/// Why a fenced statement could not run.
#[derive(Debug, thiserror::Error)]
pub enum PgFenceError {
    /// The table name is not a plain, unquoted SQL identifier.
    #[error("table {0:?} must be 1 to 63 characters of [a-z0-9_], starting with a letter or _")]
    BadTable(String),
    /// The token is above `bigint`'s range.
    #[error("token {0} does not fit the fence column (bigint, at most 9223372036854775807)")]
    TokenRange(u64),
    /// A stored fence is not a token (negative: the table was written around the fence).
    #[error("the fence column holds {0}, which is not a fencing token")]
    Corrupt(i64),
    /// The server refused the statement or the connection failed.
    #[error("postgresql")]
    Db(#[source] tokio_postgres::Error),
}

/// Connects (no TLS: loopback or a pod-local server) and drives the connection on
/// a background task. `conninfo` is a `postgres://` URL or `key=value` string.
pub async fn connect(conninfo: &str) -> Result<tokio_postgres::Client, PgFenceError> {
    let (client, conn) = tokio_postgres::connect(conninfo, NoTls).await.map_err(PgFenceError::Db)?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "postgresql connection closed");
        }
    });
    Ok(client)
}

// === impl PgFence ===

impl PgFence {
    /// A fence over `table` with the equal-token rule `equal`.
    pub fn try_new(table: &str, equal: EqualRule) -> Result<Self, PgFenceError> {
        let ok = !table.is_empty()
            && table.len() <= MAX_TABLE_LEN
            && table.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !table.as_bytes()[0].is_ascii_digit();
        if !ok {
            return Err(PgFenceError::BadTable(table.to_owned()));
        }
        let op = match equal {
            EqualRule::Strict => "<",
            EqualRule::Allow => "<=",
        };
        Ok(Self {
            table: table.to_owned(),
            equal,
            write_sql: format!(
                "INSERT INTO {table} AS t (id, value, fence_token) VALUES ($1, $2, $3) \
                 ON CONFLICT (id) DO UPDATE SET value = EXCLUDED.value, fence_token = EXCLUDED.fence_token \
                 WHERE t.fence_token {op} EXCLUDED.fence_token"
            ),
            read_sql: format!("SELECT value, fence_token FROM {table} WHERE id = $1"),
        })
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// The equal-token rule.
    pub fn equal(&self) -> EqualRule {
        self.equal
    }

    /// `CREATE TABLE IF NOT EXISTS` for the fenced table.
    pub(crate) fn create_table_sql(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY, value text NOT NULL, \
             fence_token bigint NOT NULL CHECK (fence_token >= 0))",
            self.table
        )
    }

    /// The fenced write: `$1` id, `$2` value, `$3` token; 1 row affected when it
    /// applied, 0 when the token was stale.
    pub fn write_sql(&self) -> &str {
        &self.write_sql
    }

    /// Creates the table if it does not exist.
    pub async fn ensure_table(&self, c: &impl GenericClient) -> Result<(), PgFenceError> {
        c.batch_execute(&self.create_table_sql()).await.map_err(PgFenceError::Db)
    }

    /// Writes `value` to row `id` if `token` passes the fence, in one statement.
    pub async fn write(
        &self,
        c: &impl GenericClient,
        id: &str,
        value: &str,
        token: FencingToken,
    ) -> Result<WriteOutcome, PgFenceError> {
        let t = i64::try_from(token.get()).map_err(|_| PgFenceError::TokenRange(token.get()))?;
        let n = c.execute(self.write_sql.as_str(), &[&id, &value, &t]).await.map_err(PgFenceError::Db)?;
        Ok(if n == 1 { WriteOutcome::Applied } else { WriteOutcome::Stale })
    }

    /// The row's value and fence, if it exists.
    pub async fn read(&self, c: &impl GenericClient, id: &str) -> Result<Option<(String, FencingToken)>, PgFenceError> {
        let row = c.query_opt(self.read_sql.as_str(), &[&id]).await.map_err(PgFenceError::Db)?;
        row.map(|r| {
            let t: i64 = r.get(1);
            let tok = u64::try_from(t).ok().and_then(|u| FencingToken::from_packed(u).ok());
            tok.map(|tok| (r.get::<_, String>(0), tok)).ok_or(PgFenceError::Corrupt(t))
        })
        .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers_and_the_rule_picks_the_operator() {
        for bad in ["", "1x", "Items", "a-b", "a;drop table x", &"a".repeat(64)] {
            assert!(matches!(PgFence::try_new(bad, EqualRule::Strict), Err(PgFenceError::BadTable(_))), "{bad}");
        }
        let s = PgFence::try_new("items_2", EqualRule::Strict).unwrap();
        assert!(s.write_sql().ends_with("WHERE t.fence_token < EXCLUDED.fence_token"), "{}", s.write_sql());
        let a = PgFence::try_new("items_2", EqualRule::Allow).unwrap();
        assert!(a.write_sql().ends_with("WHERE t.fence_token <= EXCLUDED.fence_token"), "{}", a.write_sql());
        assert!(s.create_table_sql().starts_with("CREATE TABLE IF NOT EXISTS items_2 ("));
    }
}
