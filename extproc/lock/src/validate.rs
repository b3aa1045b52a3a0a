//! ValidateToken's read (ADR-16 in docs/DECISIONS.md): whether a token is the current
//! grant of its key, by one linearizable etcd read.

use etcd_client::GetOptions;
use lockmesh_core::{FencingToken, LockKey};

use crate::{
    engine::txn::{Answer, Branch, TxnBuilder},
    epoch::EpochRecord,
    HoldRecord, LockError, Store,
};

/// Whether `token` is the current grant of `key`, by one linearizable read.
pub async fn is_current(store: &Store, key: &LockKey, token: FencingToken) -> Result<bool, LockError> {
    let k = store.cluster().keys();
    let mut b = TxnBuilder::new();
    let holds = b.read(Branch::Success, k.holds(&key.digest()), Some(GetOptions::new().with_prefix()));
    let epoch = b.read(Branch::Success, k.epoch(), None);
    let a = Answer::of(&store.cluster().call(store.cluster().client().txn(b.build())).await?);
    let (holds, epoch) = (a.must(holds)?, a.must(epoch)?);
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
