//! `lockctl inspect KEY` and `lockctl saturated` (docs/OPERATIONS.md).
//!
//! - `inspect KEY`: the key's digest, authoritative class, limit and state, its
//!   holders (slot, identity, instance, session, epoch, age: never the token) and,
//!   with `--admin-url` and an operator token, the waiters queued on those
//!   arbiters (waiters live in the arbiter's memory, not in etcd).
//!   With `--config arbiter.yaml` (a split deployment) the key is read on its
//!   home cluster (the coord cluster's shard map), which is printed.
//! - `saturated`: the keys at their class's authoritative limit, by digest, fullest
//!   and oldest first, from one scan of every open hold.
//!
//! Exit codes: 0 answered, 64 bad arguments, 1 etcd (or an arbiter) did not answer.

use std::{collections::HashMap, process::ExitCode, time::Duration};

use clap::Args;
use lockmesh_core::{
    wire::{
        console::{ConsoleErrorBody, ConsoleWaiters},
        inspect::{HolderInfo, InspectReport, SaturatedKey, SaturatedReport},
    },
    LockKey,
};

use lockmesh_lock::now_ms;
use lockmesh_ops::etcd_retry::retry_auth;
use lockmesh_ops::inspect::{
    human_ms, inspect_key, read_policies, saturated, scan_holds, KeyView, Saturated, DEFAULT_SCAN_MAX,
};

use crate::{
    admin::{connect, EtcdArgs},
    doctor::admin_get,
};

/// `lockctl inspect KEY`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The raw lock key, e.g. payments/order-42 (digested locally for etcd).
    key: String,
    #[command(flatten)]
    etcd: EtcdArgs,
    /// An arbiter's admin address (repeat, or comma separated) to count the key's
    /// waiters on; needs an operator token (LOCKMESH_ADMIN_TOKEN) its console accepts.
    #[arg(long = "admin-url", value_delimiter = ',', env = "LOCKMESH_ARBITER_ADMIN_URLS")]
    admin_urls: Vec<String>,
    /// The operator's token for --admin-url (prefer the environment variable).
    #[arg(long, env = "LOCKMESH_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// JSON output.
    #[arg(long)]
    json: bool,
    /// A split deployment: the arbiter config (its `etcd:`, `clusters:` and root).
    /// The key is read on the cluster the shard map homes it on, which is printed.
    #[arg(long, conflicts_with = "endpoints")]
    config: Option<std::path::PathBuf>,
}

/// `lockctl saturated`.
#[derive(Args, Debug)]
pub struct SaturatedArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// Only this class.
    #[arg(long)]
    class: Option<String>,
    /// How many keys to show.
    #[arg(long, default_value_t = 20)]
    top: usize,
    /// Most holds to scan.
    #[arg(long, default_value_t = DEFAULT_SCAN_MAX)]
    max_holds: usize,
    /// JSON output.
    #[arg(long)]
    json: bool,
}

const TIMEOUT: Duration = Duration::from_secs(10);

async fn client(a: &EtcdArgs) -> Result<etcd_client::Client, String> {
    tokio::time::timeout(TIMEOUT, connect(a))
        .await
        .map_err(|_| format!("etcd: no answer within {TIMEOUT:?}"))?
        .map_err(|e| e.to_string())
}

/// Runs `lockctl inspect`.
pub async fn inspect(a: &InspectArgs) -> ExitCode {
    let key = match LockKey::parse(a.key.as_bytes()) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("lockctl inspect: KEY: {e}");
            return ExitCode::from(64);
        }
    };
    let view = async {
        match &a.config {
            Some(config) => home_view(config, &key).await.map(|(v, c)| (v, Some(c))),
            None => {
                let mut c = client(&a.etcd).await?;
                view_on(&mut c, &a.etcd.root, &key).await.map(|v| (v, None))
            }
        }
    };
    let (view, cluster) = match view.await {
        Ok(v) => v,
        Err(e) => {
            eprintln!("lockctl inspect: {e}");
            return ExitCode::from(1);
        }
    };
    // Waiters: summed over the arbiters asked; unknown without any.
    let mut waiters: Option<u64> = None;
    let mut errors = Vec::new();
    if !a.admin_urls.is_empty() {
        let Some(token) = a.token.as_deref() else {
            eprintln!("lockctl inspect: --admin-url needs an operator token (LOCKMESH_ADMIN_TOKEN)");
            return ExitCode::from(64);
        };
        for url in &a.admin_urls {
            let path = format!("/console/api/waiters/{}", view.digest);
            match admin_get(url, &path, Some(token), TIMEOUT).await {
                Ok((200, body)) => {
                    let n = serde_json::from_str::<ConsoleWaiters>(&body).map_or(0, |w| w.waiters);
                    *waiters.get_or_insert(0) += n;
                }
                Ok((code, body)) => {
                    let refusal = serde_json::from_str::<ConsoleErrorBody>(&body).map(|b| b.code);
                    errors.push(format!("{url}: {code} {}", refusal.unwrap_or_default()));
                }
                Err(e) => errors.push(e),
            }
        }
    }
    if a.json {
        let mut r = report(&view, waiters, &errors);
        r.cluster = cluster;
        println!("{}", serde_json::to_string(&r).unwrap_or_default());
    } else {
        println!("digest   {}", view.digest);
        if let Some(c) = &cluster {
            println!("cluster  {c} (the key's home in the shard map)");
        }
        println!(
            "class    {}  limit {}  state {}{}",
            view.class.as_deref().unwrap_or("? (no authoritative map)"),
            view.limit.map_or("?".into(), |l| l.to_string()),
            view.state.as_deref().unwrap_or("?"),
            view.pending_target.map(|t| format!(" (pending limit {t})")).unwrap_or_default()
        );
        println!(
            "holders  {} (etcd revision {})  waiters {}",
            view.holders.len(),
            view.revision,
            waiters.map_or("unknown (pass --admin-url with an operator token)".into(), |w| w.to_string())
        );
        for h in &view.holders {
            println!(
                "  slot {:<3} {:<10} session {}  epoch {}  {}{}",
                h.slot,
                human_ms(h.age_ms),
                h.session,
                h.epoch,
                h.identity,
                h.instance.as_deref().map(|i| format!(" instance {i}")).unwrap_or_default()
            );
        }
        for e in &errors {
            eprintln!("lockctl inspect: waiters: {e}");
        }
    }
    if errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

async fn view_on(c: &mut etcd_client::Client, root: &str, key: &LockKey) -> Result<KeyView, String> {
    tokio::time::timeout(TIMEOUT, inspect_key(c, root, key, now_ms()))
        .await
        .map_err(|_| format!("etcd: no answer within {TIMEOUT:?}"))?
        .map_err(|e| format!("etcd: {e}"))
}

/// The key's view on its home cluster of the deployment `config` names: the class
/// from the coord cluster's authoritative map, the home from its shard map (the
/// coord cluster while there is no map), then the holders and policy there.
async fn home_view(config: &std::path::Path, key: &LockKey) -> Result<(KeyView, String), String> {
    let clusters = lockmesh_lock::clusters::Clusters::load_arbiter_file(config).map_err(|e| e.join("; "))?;
    let tiers = clusters.connect().await.map_err(|e| e.to_string())?;
    let coord = tiers.coord();
    let at_coord = view_on(&mut coord.cluster().client(), &clusters.root, key).await?;
    let map =
        retry_auth(&coord.cluster().client(), move |_| coord.home().read_map()).await.map_err(|e| e.to_string())?;
    let class = at_coord.class.clone().unwrap_or_default();
    let home = map.as_ref().and_then(|(m, _)| m.current.home(&class, key.as_str()).map(str::to_owned));
    match home.and_then(|h| tiers.get(&h).cloned()) {
        Some(store) if store.cluster_name() != coord.cluster_name() => {
            let mut view = view_on(&mut store.cluster().client(), &clusters.root, key).await?;
            // The class comes from the coord cluster's map, the authoritative one.
            view.class = at_coord.class;
            Ok((view, store.cluster_name().to_owned()))
        }
        _ => Ok((at_coord, coord.cluster_name().to_owned())),
    }
}

/// `lockctl inspect --json`: the etcd view with the waiters counted on the arbiters.
fn report(view: &KeyView, waiters: Option<u64>, errors: &[String]) -> InspectReport {
    InspectReport {
        class: view.class.clone(),
        cluster: None,
        digest: view.digest.clone(),
        holders: view
            .holders
            .iter()
            .map(|h| HolderInfo {
                age_ms: h.age_ms,
                epoch: h.epoch,
                identity: h.identity.clone(),
                instance: h.instance.clone(),
                session: h.session.clone(),
                slot: h.slot,
            })
            .collect(),
        limit: view.limit,
        pending_target: view.pending_target,
        revision: view.revision,
        state: view.state.clone(),
        waiter_errors: errors.to_vec(),
        waiters,
    }
}

/// A key of `lockctl saturated --json` (no arbiter asked: no `waiters_here`).
fn saturated_key(k: &Saturated) -> SaturatedKey {
    SaturatedKey {
        class: k.class.clone(),
        cluster: None,
        digest: k.digest.clone(),
        holders: k.holders,
        limit: k.limit,
        oldest_age_ms: k.oldest_age_ms,
        waiters_here: None,
    }
}

/// Runs `lockctl saturated`.
pub async fn saturated_main(a: &SaturatedArgs) -> ExitCode {
    let run = async {
        let mut c = client(&a.etcd).await?;
        let policies = tokio::time::timeout(TIMEOUT, read_policies(&mut c, &a.etcd.root))
            .await
            .map_err(|_| format!("etcd: no answer within {TIMEOUT:?}"))?
            .map_err(|e| format!("etcd: {e}"))?;
        let scan = tokio::time::timeout(TIMEOUT * 6, scan_holds(&mut c, &a.etcd.root, a.max_holds, now_ms()))
            .await
            .map_err(|_| format!("etcd: the scan did not finish within {:?}", TIMEOUT * 6))?
            .map_err(|e| format!("etcd: {e}"))?;
        Ok::<_, String>((policies, scan))
    };
    let (policies, scan) = match run.await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("lockctl saturated: {e}");
            return ExitCode::from(1);
        }
    };
    let limits: HashMap<String, u32> = policies.values().map(|p| (p.class.clone(), p.limit)).collect();
    let keys = saturated(&scan, &limits, a.class.as_deref(), a.top);
    if a.json {
        let r = SaturatedReport {
            holds_scanned: u64::try_from(scan.holds).unwrap_or(u64::MAX),
            revision: scan.revision,
            saturated: keys.iter().map(saturated_key).collect(),
            truncated: scan.truncated,
        };
        println!("{}", serde_json::to_string(&r).unwrap_or_default());
    } else {
        println!("{:<64}  {:<16} {:>8}  oldest", "digest", "class", "holders");
        for k in &keys {
            println!(
                "{:<64}  {:<16} {:>4}/{:<3}  {}",
                k.digest,
                k.class,
                k.holders,
                k.limit,
                human_ms(k.oldest_age_ms)
            );
        }
        println!(
            "{} saturated keys shown; {} holds scanned at revision {}{}",
            keys.len(),
            scan.holds,
            scan.revision,
            if scan.truncated { " (truncated: raise --max-holds)" } else { "" }
        );
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use lockmesh_ops::inspect::HolderInfo as Holder;
    use serde_json::json;

    use super::*;

    /// `--json` prints the bytes it printed when it built them through
    /// `serde_json::Value` (keys sorted): the scenarios and operators' scripts read them.
    #[test]
    fn json_output_keeps_its_bytes() {
        let holder = |slot, instance: Option<&str>| Holder {
            slot,
            identity: "spiffe://t/a".into(),
            instance: instance.map(Into::into),
            session: "000000000000002a".into(),
            epoch: 1,
            age_ms: 12,
        };
        for (pending_target, waiters, errors) in
            [(None, None, vec![]), (Some(1), Some(3), vec!["http://a:1: 401 admin.unauthenticated".to_owned()])]
        {
            let view = KeyView {
                digest: "ab".repeat(32),
                class: Some("default".into()),
                limit: Some(2),
                state: Some("draining".into()),
                pending_target,
                holders: vec![holder(0, None), holder(1, Some("i-1"))],
                revision: 42,
            };
            let mut before = serde_json::to_value(&view).unwrap();
            before["waiters"] = json!(waiters);
            before["waiter_errors"] = json!(errors);
            assert_eq!(serde_json::to_string(&report(&view, waiters, &errors)).unwrap(), before.to_string());
        }
        let keys = vec![Saturated {
            digest: "cd".repeat(32),
            class: "default".into(),
            holders: 2,
            limit: 2,
            oldest_age_ms: 7,
        }];
        let before = json!({"revision": 42, "holds_scanned": 9, "truncated": true, "saturated": keys}).to_string();
        let r = SaturatedReport {
            holds_scanned: 9,
            revision: 42,
            saturated: keys.iter().map(saturated_key).collect(),
            truncated: true,
        };
        assert_eq!(serde_json::to_string(&r).unwrap(), before);
    }
}
