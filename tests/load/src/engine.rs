//! The `engine` workload: the grant engine (`lockmesh_lock`'s [`Tiers`] and
//! [`Store`]) driven in this process, with no Envoy and no arbiter process, so
//! its cycles/s and etcd cost per cycle are the engine's own beside `etcd-lock`
//! and `raw-txn` on the same etcd (docs/BENCHMARKS.md, `engine`).
//!
//! One [`Engine`] per workload run connects as the arbiter does
//! (extproc/src/lib.rs): one [`Store`] on the coord cluster logged in as the
//! shipped `lockmesh-arbiter` role (TLS and auth on a production-shaped etcd),
//! [`Tiers`] over it, the class registry handed to the quota, lock-delay and
//! shadow modules, the keyspace gate advertising and reading the record, the
//! quota ledger and the lock-delay watch started, the class and shard records
//! bootstrapped, and the seal check and tiers round every second.
//!
//! Each holder ([`Holder`]) opens its own session first
//! ([`Tiers::open_session`], as `POST /v1/sessions` does), keeps it alive every
//! TTL/3, and cycles: an acquire built as extproc/src/api.rs builds one
//! ([`Tiers::acquire_or_open`]) and a release naming the session
//! ([`Tiers::release`]). Holders of one key wait in the store's in-memory queue
//! and are handed the key as through the arbiter.
//!
//! `max_group` is the largest number of grants and releases one etcd
//! transaction may carry: 1 commits each alone (the engine before group
//! commit), larger runs the store's group committer with etcd's default limits
//! ([`check_max_group`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use lockmesh_core::{class::ClassRegistry, headers::SessionId, ClassSpec, FencingToken, LockKey};
use lockmesh_lock::{
    connect::EtcdClientAuth,
    home::COORD_CLUSTER,
    mutex::AcquireRequest,
    session::Caller,
    tiers::{Acquired, CancellationToken, FailOpenSettings, HoldFor, Tiers, TiersConfig},
    topology::Topology,
    upgrade::{Gate, Support},
    GroupLimits, Store,
};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::record::Recorder;

/// The shipped role the engine logs in as (deploy's etcd roles).
pub(crate) const ARBITER_ROLE: &str = "lockmesh-arbiter";
/// `etcd.op_timeout_ms` of the arbiter's config when unset.
const OP_TIMEOUT: Duration = Duration::from_millis(2000);
/// One etcd transaction per grant and release: the engine before group commit.
pub const ALONE_MAX_GROUP: u32 = 1;

/// Refuses a `max_group` the engine cannot run (0, or above the arbiter's
/// `etcd.max_group` bound).
pub fn check_max_group(n: u32) -> Result<()> {
    if n == 0 {
        bail!("max_group: 0 is not a group size (1 commits one etcd transaction per grant)");
    }
    if n > 1024 {
        bail!("max_group: {n} is above 1024, the arbiter's bound (etcd.max_group)");
    }
    Ok(())
}

/// How the engine reaches etcd: the coord cluster as the arbiter's config
/// names it.
#[derive(Clone, Debug)]
pub(crate) struct EngineAccess {
    pub endpoints: Vec<String>,
    /// The key root (`etcd.root`).
    pub root: String,
    /// TLS and the arbiter role's user; default: plaintext, no user.
    pub auth: EtcdClientAuth,
}

/// The engine of one workload run and its background tasks.
pub(crate) struct Engine {
    tiers: Arc<Tiers>,
    registry: ClassRegistry,
    /// Keeps the keyspace gate's round running (it ends when the gate drops).
    _gate: Arc<Gate>,
    tasks: Vec<JoinHandle<()>>,
}

// === impl Engine ===

impl Engine {
    /// Connects and starts everything the arbiter starts before it serves.
    pub async fn connect(access: &EngineAccess, registry: &str, max_group: u32) -> Result<Arc<Self>> {
        check_max_group(max_group)?;
        let registry =
            lockmesh_registry::parse(registry).map_err(|e| anyhow!("the engine's class registry: {}", e.join("; ")))?;
        // The engine's own runtime: the registry before the first grant.
        let runtime = lockmesh_lock::Runtime::with_registry(&registry);
        let store = Store::connect_with(&access.endpoints, &access.root, OP_TIMEOUT, None, &access.auth, &runtime)
            .await
            .map_err(|e| anyhow!("connect the engine's store to etcd {:?}: {e}", access.endpoints))?;
        // One cluster backs both tiers, as an arbiter config without `tiers:` says.
        let topology = Topology { entity: vec![COORD_CLUSTER.to_owned()], ..Topology::default() };
        let cfg = TiersConfig {
            topology: &topology,
            root: &access.root,
            op_timeout: OP_TIMEOUT,
            marks_file: None,
            fail_open: FailOpenSettings {
                spool_file: None,
                max_spool_bytes: 0,
                quorum_loss_after_ms: u64::MAX,
                check_timeout_ms: 2000,
            },
            group: GroupLimits { max_group: max_group as usize, ..GroupLimits::ALONE },
        };
        let tiers = Arc::new(Tiers::connect(&cfg, store.clone()).await.map_err(|e| anyhow!("engine tiers: {e}"))?);
        store.epoch().check_seal().await.map_err(|e| anyhow!("engine seal check: {e}"))?;
        let gate = Gate::new(Support::full());
        let mut tasks = vec![gate.clone().start(vec![store.clone()], "lockmesh-load engine".into()).await];
        if let Some(r) = gate.refusal() {
            bail!("the keyspace gate refuses the engine: {r}");
        }
        store.start_ledger();
        store.lock_delay().start_watch();
        let mut boot = tiers.bootstrap(&registry).await;
        for _ in 0..20 {
            if boot.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            boot = tiers.bootstrap(&registry).await;
        }
        boot.map_err(|e| anyhow!("engine bootstrap (shard map, home, class policies): {e}"))?;
        // The arbiter's once-a-second rounds: the seal check and the tiers' round.
        tasks.push(tokio::spawn({
            let (tiers, registry) = (tiers.clone(), registry.clone());
            async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let _ = tiers.seal_round(tiers.coord()).await;
                    tiers.tick(&registry).await;
                }
            }
        }));
        Ok(Arc::new(Self { tiers, registry, _gate: gate, tasks }))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One holder: its own session on the engine, kept alive in the background.
pub(crate) struct Holder {
    engine: Arc<Engine>,
    caller: Caller,
    key: LockKey,
    class: ClassSpec,
    ns: String,
    session: Option<SessionId>,
    keepalive: Option<JoinHandle<()>>,
    held: Option<FencingToken>,
    wait: Duration,
    rec: Arc<Recorder>,
}

// === impl Holder ===

impl Holder {
    /// Holder `i` of `key`: opens its session.
    pub async fn open(engine: Arc<Engine>, i: usize, key: &str, wait_ms: u64, rec: Arc<Recorder>) -> Result<Self> {
        let key = LockKey::parse(key.as_bytes()).map_err(|e| anyhow!("engine key: {e}"))?;
        let class = engine.registry.class_of(&key).clone();
        let ns = engine.registry.session_namespace(class.name.as_str(), Some(&key));
        let caller = Caller {
            identity: format!("spiffe://{}/ns/load/sa/e{i}", lockmesh_tests::TEST_TRUST_DOMAIN),
            instance: None,
        };
        let mut h = Self {
            engine,
            caller,
            key,
            class,
            ns,
            session: None,
            keepalive: None,
            held: None,
            wait: Duration::from_millis(wait_ms),
            rec,
        };
        h.open_session().await?;
        Ok(h)
    }

    async fn open_session(&mut self) -> Result<()> {
        let tiers = &self.engine.tiers;
        let sid = tiers
            .open_session(&self.caller, &self.class, Some(&self.key), &self.ns)
            .await
            .map_err(|e| anyhow!("open session: {e}"))?;
        self.session = Some(sid);
        let every = Duration::from_secs(self.class.ttl_s.max(3) / 3);
        let (engine, caller, rec) = (self.engine.clone(), self.caller.clone(), self.rec.clone());
        self.keepalive = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = engine.tiers.keepalive(sid, &caller).await {
                    rec.error("engine keepalive", &e.to_string());
                }
            }
        }));
        Ok(())
    }

    /// An acquire as the arbiter builds it for `POST /v1/locks/acquire` on the
    /// holder's session; the token.
    pub async fn acquire(&mut self) -> Result<u64> {
        let Some(sid) = self.session else { bail!("no session") };
        let req = AcquireRequest {
            key: self.key.clone(),
            class: self.class.clone(),
            caller: self.caller.clone(),
            session: Some(sid),
            deadline: Instant::now() + self.wait,
            try_once: self.wait.is_zero(),
            hold_id: None,
            session_owner: None,
            unverified_caller: None,
            permits: Default::default(),
            mode: None,
            election: false,
            session_indexed: false,
        };
        let cancel = CancellationToken::new();
        match self.engine.tiers.acquire_or_open(&req, HoldFor::Caller, &self.engine.registry, &cancel).await {
            Ok(Acquired::Protected(g, _)) => {
                self.held = Some(g.token);
                Ok(g.token.get())
            }
            Ok(Acquired::Unprotected(..)) => bail!("an unprotected (fail-open) grant"),
            Err(e) => Err(anyhow!("{e}")),
        }
    }

    /// The release of the last grant, naming the session.
    pub async fn release(&mut self) -> Result<()> {
        let token = self.held.take().context("nothing to release")?;
        self.engine
            .tiers
            .release(&self.class, &self.key, token, &self.caller, self.session)
            .await
            .map_err(|e| anyhow!("{e}"))
    }

    async fn end_session(&mut self) -> Result<()> {
        if let Some(k) = self.keepalive.take() {
            k.abort();
        }
        self.held = None;
        match self.session.take() {
            Some(sid) => self.engine.tiers.close_session(sid, &self.caller).await.map_err(|e| anyhow!("{e}")),
            None => Ok(()),
        }
    }

    /// Closes the session (ending whatever it held) and opens a new one.
    pub async fn reset(&mut self) -> Result<()> {
        if let Err(e) = self.end_session().await {
            self.rec.error("engine close", &format!("{e:#}"));
        }
        self.open_session().await
    }

    /// Closes the session.
    pub async fn close(mut self) {
        if let Err(e) = self.end_session().await {
            self.rec.error("engine close", &format!("{e:#}"));
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(k) = self.keepalive.take() {
            k.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_sizes_within_the_arbiters_bound_run() {
        assert!(check_max_group(1).is_ok());
        assert!(check_max_group(64).is_ok());
        let e = check_max_group(2000).unwrap_err().to_string();
        assert!(e.contains("1024"), "{e}");
        assert!(check_max_group(0).is_err());
    }
}
