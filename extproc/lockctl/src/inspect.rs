//! `lockctl inspect KEY` and `lockctl saturated` (docs/OPERATIONS.md).
//!
//! - `inspect KEY`: the key's digest, authoritative class, limit and state, its
//!   holders (slot, identity, instance, session, epoch, age: never the token) and,
//!   with `--admin-url` and an operator token, the waiters queued on those
//!   arbiters (waiters live in the arbiter's memory, not in etcd).
//! - `saturated`: the keys at their class's authoritative limit, by digest, fullest
//!   and oldest first, from one scan of every open hold.
//!
//! Exit codes: 0 answered, 64 bad arguments, 1 etcd (or an arbiter) did not answer.

use std::{collections::HashMap, process::ExitCode, time::Duration};

use clap::Args;
use lockmesh_core::LockKey;
use serde_json::json;

use lockmesh_lock::now_ms;
use lockmesh_ops::inspect::{human_ms, inspect_key, read_policies, saturated, scan_holds, DEFAULT_SCAN_MAX};

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
        let mut c = client(&a.etcd).await?;
        tokio::time::timeout(TIMEOUT, inspect_key(&mut c, &a.etcd.root, &key, now_ms()))
            .await
            .map_err(|_| format!("etcd: no answer within {TIMEOUT:?}"))?
            .map_err(|e| format!("etcd: {e}"))
    };
    let view = match view.await {
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
                    let n = serde_json::from_str::<serde_json::Value>(&body).ok().and_then(|v| v["waiters"].as_u64());
                    *waiters.get_or_insert(0) += n.unwrap_or(0);
                }
                Ok((code, body)) => {
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    errors.push(format!("{url}: {code} {}", v["code"].as_str().unwrap_or("")));
                }
                Err(e) => errors.push(e),
            }
        }
    }
    if a.json {
        let mut v = serde_json::to_value(&view).unwrap_or_default();
        v["waiters"] = json!(waiters);
        v["waiter_errors"] = json!(errors);
        println!("{v}");
    } else {
        println!("digest   {}", view.digest);
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
        let v = json!({"revision": scan.revision, "holds_scanned": scan.holds, "truncated": scan.truncated,
                       "saturated": keys});
        println!("{v}");
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
