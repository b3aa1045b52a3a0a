//! The grant engine's transactions: [`txn`] builds one and reads its answer by
//! handle; [`grant`] assembles the grant transactions from their concerns.

pub(crate) mod grant;
pub(crate) mod txn;
