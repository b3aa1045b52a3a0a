//! `lockctl upgrade status|enable CAP|disable CAP`: the keyspace version and its
//! capabilities (issue #19; the protocol is `lockmesh_lock::upgrade`).
//!
//! - `status`: the keyspace record (version, enabled capabilities) and every live
//!   arbiter's advertisement (build, listen address, capabilities).
//! - `enable CAP`: the guarded flip: one transaction that commits only if every
//!   live arbiter advertises `CAP` and no advertisement changed since the read.
//!   Refused (exit 2, each arbiter lacking it named) while any lacks it; with
//!   `--wait-s N` it retries for up to N seconds (a stopped arbiter's advertisement
//!   lasts until its lease ends, `AD_TTL_S`).
//! - `disable CAP`: the rollback after a flip (the record compared unchanged).
//!
//! Exit codes: **0** done (or already so), **1** etcd failed, **2** refused: a live
//! arbiter lacks the capability, **3** this lockctl does not know the keyspace (a
//! newer version or capability: upgrade lockctl), **64** bad arguments.
//! Role: `lockmesh-admin` reads (`status`); `enable` and `disable` write
//! `<root>/sys/keyspace` (`lockmesh-admin-epoch` may).

use std::{process::ExitCode, time::Duration};

use clap::{Args, Subcommand};
use lockmesh_lock::upgrade::{self, Capability, UpgradeError};
use serde::Serialize;

use crate::admin::{connect, EtcdArgs};

/// `lockctl upgrade`.
#[derive(Args, Debug)]
pub struct UpgradeArgs {
    #[command(subcommand)]
    cmd: UpgradeCmd,
    #[command(flatten)]
    etcd: EtcdArgs,
    /// JSON output.
    #[arg(long, global = true)]
    json: bool,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum UpgradeCmd {
    /// The keyspace record and every live arbiter's advertisement.
    Status,
    /// Enable a capability once every live arbiter supports it (`all`: every
    /// capability that gates a record kind, one after the other).
    Enable(FlipArgs),
    /// Disable a capability (the rollback after its flip).
    Disable(FlipArgs),
}

/// A flip's arguments.
#[derive(Args, Debug)]
pub struct FlipArgs {
    /// The capability's name.
    cap: String,
    /// Who flips it, recorded in the record.
    #[arg(long, default_value = "lockctl")]
    actor: String,
    /// Retry a refusal for up to this many seconds (enable only).
    #[arg(long, default_value_t = 0)]
    wait_s: u64,
}

#[derive(Serialize)]
struct StatusOut {
    version: u32,
    enabled: Vec<String>,
    revision: i64,
    arbiters: Vec<AdOut>,
    lockctl_refuses: Option<String>,
}

#[derive(Serialize)]
struct AdOut {
    key: String,
    build: String,
    listen: String,
    version: u32,
    capabilities: Vec<String>,
}

fn print<T: Serialize>(json: bool, v: &T, human: String) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        print!("{human}");
    }
}

fn code_of(e: &UpgradeError) -> u8 {
    match e {
        UpgradeError::Lacking { .. } | UpgradeError::Raced => 2,
        UpgradeError::Refused(_) => 3,
        UpgradeError::Etcd(_) => 1,
    }
}

/// How long a request etcd refused with `revision of auth store is old` (its
/// users or roles changed under this login; nothing was applied) is sent again
/// on a new login, at least (a flip's `--wait-s` may allow longer): while other
/// components' users are being created, a fresh login can be overtaken again.
const AUTH_RETRY_FOR: Duration = Duration::from_secs(10);

fn auth_store_old<T>(r: &Result<T, UpgradeError>) -> bool {
    matches!(r, Err(UpgradeError::Etcd(m)) if m.contains("revision of auth store is old"))
}

/// `lockctl upgrade ...`.
pub async fn main(a: &UpgradeArgs) -> ExitCode {
    if a.etcd.endpoints.is_empty() {
        eprintln!("lockctl upgrade: --endpoints: required (or LOCKMESH_ETCD_ENDPOINTS)");
        return ExitCode::from(64);
    }
    let mut client = match connect(&a.etcd).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lockctl upgrade: {e}");
            return ExitCode::from(1);
        }
    };
    let root = a.etcd.root.as_str();
    match &a.cmd {
        UpgradeCmd::Status => {
            let keys = lockmesh_lock::Keys::new(root);
            let mut view = upgrade::read_view(&mut client, &keys).await;
            let until = tokio::time::Instant::now() + AUTH_RETRY_FOR;
            while auth_store_old(&view) && tokio::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if let Ok(c) = connect(&a.etcd).await {
                    client = c;
                }
                view = upgrade::read_view(&mut client, &keys).await;
            }
            let view = match view {
                Ok(v) => v,
                Err(e) => {
                    eprintln!("lockctl upgrade status: {e}");
                    return ExitCode::from(code_of(&e));
                }
            };
            let rec = view.record.clone().unwrap_or_else(upgrade::KeyspaceRecord::baseline);
            let out = StatusOut {
                version: rec.version,
                enabled: rec.enabled.clone(),
                revision: view.revision,
                lockctl_refuses: upgrade::Support::full().refusal(view.record.as_ref()).map(|r| r.to_string()),
                arbiters: view
                    .advertisements
                    .iter()
                    .map(|(key, ad, _)| AdOut {
                        key: key.clone(),
                        build: ad.as_ref().map_or("unreadable".into(), |a| a.build.clone()),
                        listen: ad.as_ref().map_or_else(String::new, |a| a.listen.clone()),
                        version: ad.as_ref().map_or(0, |a| a.version),
                        capabilities: ad.as_ref().map_or_else(Vec::new, |a| a.capabilities.clone()),
                    })
                    .collect(),
            };
            let mut h = format!(
                "keyspace version {}, enabled [{}]{}\n",
                out.version,
                out.enabled.join(", "),
                if view.record.is_none() { " (no record: the baseline)" } else { "" }
            );
            for ad in &out.arbiters {
                h.push_str(&format!(
                    "  arbiter {} build {} listen {} version {} supports [{}]\n",
                    ad.key,
                    ad.build,
                    ad.listen,
                    ad.version,
                    ad.capabilities.join(", ")
                ));
            }
            if let Some(r) = &out.lockctl_refuses {
                h.push_str(&format!("lockctl refuses this keyspace: {r}\n"));
            }
            print(a.json, &out, h);
            if out.lockctl_refuses.is_some() {
                ExitCode::from(3)
            } else {
                ExitCode::SUCCESS
            }
        }
        UpgradeCmd::Enable(f) | UpgradeCmd::Disable(f) => {
            let on = matches!(a.cmd, UpgradeCmd::Enable(_));
            let caps: Vec<Capability> = if f.cap == "all" {
                Capability::GATED.to_vec()
            } else if let Some(cap) = Capability::parse(&f.cap) {
                vec![cap]
            } else {
                let known: Vec<&str> = Capability::ALL.iter().map(|c| c.as_str()).collect();
                eprintln!("lockctl upgrade: unknown capability {:?} (known: all, {})", f.cap, known.join(", "));
                return ExitCode::from(64);
            };
            for cap in caps {
                let code = flip_one(a, &mut client, root, cap, f, on).await;
                if code != 0 {
                    return ExitCode::from(code);
                }
            }
            ExitCode::SUCCESS
        }
    }
}

/// One capability's flip, retried as `--wait-s` says; the exit code.
async fn flip_one(
    a: &UpgradeArgs,
    client: &mut etcd_client::Client,
    root: &str,
    cap: Capability,
    f: &FlipArgs,
    on: bool,
) -> u8 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(f.wait_s);
    let auth_until = deadline.max(tokio::time::Instant::now() + AUTH_RETRY_FOR);
    loop {
        let r = if on {
            upgrade::enable(client, root, cap, &f.actor).await
        } else {
            upgrade::disable(client, root, cap, &f.actor).await
        };
        if auth_store_old(&r) && tokio::time::Instant::now() < auth_until {
            // Nothing was applied; a new login reads the current roles.
            tokio::time::sleep(Duration::from_millis(200)).await;
            if let Ok(c) = connect(&a.etcd).await {
                *client = c;
            }
            continue;
        }
        match r {
            Ok(done) => {
                let verb = if on { "enabled" } else { "disabled" };
                let h = if done.changed {
                    format!(
                        "{} {verb} at revision {} ({} live arbiter(s) compared); enabled now [{}]\n",
                        cap.as_str(),
                        done.revision,
                        done.arbiters,
                        done.record.enabled.join(", ")
                    )
                } else {
                    format!("{} was already {verb}; nothing changed\n", cap.as_str())
                };
                print(a.json, &done, h);
                return 0;
            }
            Err(e @ (UpgradeError::Lacking { .. } | UpgradeError::Raced)) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                eprintln!("lockctl upgrade {} {}: {e}", if on { "enable" } else { "disable" }, cap.as_str());
                return code_of(&e);
            }
        }
    }
}
