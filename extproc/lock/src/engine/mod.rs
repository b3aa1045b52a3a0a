//! The grant engine's transactions: [`txn`] builds one and reads its answer by
//! handle; [`grant`] assembles the grant transaction of one or several keys
//! from its concerns; [`commit`] sends it and makes the checks every grant's
//! answer gets; [`clock`] guards every write a restore could lose with the grant
//! clock; [`end`] sends the transactions that end a grant or a session;
//! [`group`] commits grants and releases in groups of nested transactions.

pub(crate) mod clock;
pub(crate) mod commit;
pub(crate) mod end;
pub(crate) mod grant;
pub(crate) mod group;
pub(crate) mod handoff;
pub(crate) mod txn;
