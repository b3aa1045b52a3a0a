//! The grant engine's transactions: [`txn`] builds one and reads its answer by
//! handle; [`grant`] assembles the grant transaction of one or several keys
//! from its concerns; [`commit`] sends it and makes the checks every grant's
//! answer gets.

pub(crate) mod commit;
pub(crate) mod grant;
pub(crate) mod txn;
