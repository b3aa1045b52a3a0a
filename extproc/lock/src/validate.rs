//! ValidateToken's read (ADR-16 in docs/DECISIONS.md): whether a token is the current
//! grant of its key, by one linearizable etcd read.

use etcd_client::{GetOptions, Txn, TxnOp, TxnOpResponse};
use lockmesh_core::{FencingToken, LockKey};

use crate::{epoch::EpochRecord, HoldRecord, LockError, Store};

/// Whether `token` is the current grant of `key`, by one linearizable read.
pub async fn is_current(store: &Store, key: &LockKey, token: FencingToken) -> Result<bool, LockError> {
    let k = store.keys();
    let txn = Txn::new().and_then([
        TxnOp::get(k.holds(&key.digest()), Some(GetOptions::new().with_prefix())),
        TxnOp::get(k.epoch(), None),
    ]);
    let r = store.call(store.client().txn(txn)).await?;
    let mut ranges = r.op_responses().into_iter().filter_map(|op| match op {
        TxnOpResponse::Get(g) => Some(g),
        _ => None,
    });
    let (Some(holds), Some(epoch)) = (ranges.next(), ranges.next()) else {
        return Err(LockError::Internal("validate read returned fewer ranges than asked".into()));
    };
    let record: EpochRecord = match epoch.kvs().first() {
        Some(kv) => serde_json::from_slice(kv.value())
            .map_err(|e| LockError::Internal(format!("epoch record does not parse: {e}")))?,
        // No epoch record yet: nothing was ever granted under this root.
        None => return Ok(false),
    };
    if let Some(why) = record.sealed {
        return Err(LockError::Sealed(why));
    }
    // The current epoch, or an older one a move's advance kept live (`lock::home`).
    if token.epoch() != record.epoch && !record.prior.contains(&token.epoch()) {
        return Ok(false);
    }
    let rev = i64::try_from(token.revision()).map_err(|e| LockError::Internal(e.to_string()))?;
    Ok(holds.kvs().iter().any(|kv| {
        kv.create_revision() == rev
            && serde_json::from_slice::<HoldRecord>(kv.value()).is_ok_and(|h| h.epoch == token.epoch())
    }))
}
