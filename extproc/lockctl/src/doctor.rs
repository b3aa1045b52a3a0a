//! `lockctl doctor`: one look at everything an operator must act on.
//!
//! | check | source | fails when |
//! |---|---|---|
//! | `lockctl.version` | this binary | never (reported) |
//! | `arbiter.version`, `arbiter.seal` | each `--admin-url`'s `/status` | unreachable; sealed (a version differing from lockctl's warns) |
//! | `operators.safeguards` | each `/status`'s `operators` (none without it) | per entry of `weakened` (MFA off, no token age bound, ...) |
//! | `etcd.reachable` | `--endpoints` | no endpoint answers |
//! | `etcd.member` | each member's status, through its own client URL | a member does not answer or reports errors (a version below 3.5.28 warns) |
//! | `etcd.quorum` | the member statuses | a majority of voting members does not answer, or no leader is agreed |
//! | `etcd.alarm` | etcd's alarm list | any alarm (`NOSPACE`, `CORRUPT`) |
//! | `etcd.db_size` | each member's status against `--etcd-quota-bytes` | at or above 95 % of the backend quota (80 % warns) |
//! | `etcd.leases` | etcd's lease list | never: above `--lease-warn` leases warns |
//! | `keyspace.version` | `<root>/sys/keyspace` | this lockctl does not know its version or an enabled capability |
//! | `keyspace.arbiters` | `<root>/sys/arbiters/` | a live arbiter lacks an enabled capability (it refuses every request) |
//! | `keyspace.gated_kinds` | the keys of each gated kind (`g/`, `d/`, `w/`, `l/*/w`, `s/*/h/`, `s/*/a/`) | never: records of a kind whose capability is not enabled warn (written by an earlier build, or left after a disable) |
//! | `seal.epoch` | `<root>/sys/epoch` | the record carries an explicit seal (an epoch advance is unfinished) |
//! | `class.draining` | `<root>/c/<class>` | a class is draining (it admits nothing until resumed or cancelled) |
//! | `class.pause_test` | `--registry` | a fenced class's PauseTestResult is missing, failing or expired (ending within `--warn-days` warns) |
//! | `class.waiver` | `--registry` | an advisory class's waiver has expired (ending within `--warn-days` warns) |
//! | `class.limit` | `--registry` and etcd | never: a desired limit differing from the authoritative one warns |
//!
//! Exit codes: **0** nothing failed (warnings allowed), **1** at least one check
//! failed, **64** bad arguments (no endpoints, an unreadable registry file).
//! Human output by default; `--json` prints one JSON document.

pub use lockmesh_ops::pause::{day_string, pause_status};
use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use clap::Args;
use lockmesh_core::{
    class::{Enforcement, RawRegistry},
    wire::status::{OperatorsStatus, StatusReply},
    ClassRegistry,
};
use serde::Serialize;

use lockmesh_lock::{epoch::EpochRecord, now_ms, Keys};
use lockmesh_ops::{
    etcd_retry::{retry_auth, Etcd},
    etcd_view::{cluster_view, lease_count, quota_use, ClusterView},
    inspect::{human_ms, read_policies, state_str},
};

use crate::admin::{connect, EtcdArgs};

/// The lowest etcd server version without the known lock-safety bugs (docs/DECISIONS.md F-1).
pub const ETCD_FLOOR: (u64, u64, u64) = (3, 5, 28);

/// `lockctl doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// The class registry file: checks the pause tests of fenced classes and the
    /// waivers of advisory classes (as the arbiter would at its next reload).
    #[arg(long, env = "LOCKMESH_REGISTRY")]
    registry: Option<PathBuf>,
    /// An arbiter's admin address, e.g. http://10.0.0.7:18052 (repeat, or comma
    /// separated): its version and its own seal (marks-based seals are not in etcd).
    #[arg(long = "admin-url", value_delimiter = ',', env = "LOCKMESH_ARBITER_ADMIN_URLS")]
    admin_urls: Vec<String>,
    /// Warn about pause tests and waivers ending within this many days.
    #[arg(long, default_value_t = 14)]
    warn_days: u64,
    /// etcd's backend quota (`--quota-backend-bytes` of the members; deploy/base/etcd
    /// sets etcd's default, 2 GiB): each member's database size is reported against it.
    #[arg(long, default_value_t = 2_147_483_648)]
    etcd_quota_bytes: u64,
    /// Warn when etcd holds more leases than this.
    #[arg(long, default_value_t = 100_000)]
    lease_warn: usize,
    /// Bound of each call (etcd, arbiters), ms.
    #[arg(long, default_value_t = 3000)]
    timeout_ms: u64,
    /// JSON output.
    #[arg(long)]
    json: bool,
}

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Fine.
    Ok,
    /// Worth a look; does not fail the run.
    Warn,
    /// Something is wrong: exit 1.
    Fail,
    /// Not checked (the input it needs was not given or not reachable).
    Skip,
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// The check, e.g. `class.draining`.
    pub check: &'static str,
    /// Its verdict.
    pub status: Status,
    /// What it is about (a class, a member, an arbiter URL).
    pub subject: String,
    /// What was found and, when something is wrong, what to do.
    pub detail: String,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// This lockctl's version.
    pub lockctl_version: &'static str,
    /// The key root checked.
    pub root: String,
    /// Every finding, in check order.
    pub findings: Vec<Finding>,
    /// Failing checks.
    pub failures: usize,
    /// Warnings.
    pub warnings: usize,
}

/// GETs `path` from an arbiter's admin address (`http://host:port`), with a
/// bearer token if given, within `timeout` (connect, request and the whole body);
/// returns the status code and the body. Errors name the address, never the
/// token (reqwest's errors carry the URL, not the headers).
pub async fn admin_get(
    base: &str,
    path: &str,
    bearer: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let hostport = base
        .strip_prefix("http://")
        .map(|h| h.trim_end_matches('/'))
        .filter(|h| !h.is_empty() && !h.contains('/'))
        .ok_or_else(|| format!("{base:?}: an admin address is http://host:port"))?;
    let failed = |e: reqwest::Error| {
        if e.is_timeout() {
            format!("{base}: no answer within {timeout:?}")
        } else {
            format!("{base}: {}", lockmesh_runtime::error_chain(&e))
        }
    };
    let client = reqwest::Client::builder().timeout(timeout).build().map_err(failed)?;
    let mut rq = client.get(format!("http://{hostport}{path}"));
    if let Some(t) = bearer {
        rq = rq.bearer_auth(t);
    }
    let resp = rq.send().await.map_err(failed)?;
    let code = resp.status().as_u16();
    let body = resp.text().await.map_err(failed)?;
    Ok((code, body))
}

fn version_tuple(v: &str) -> Option<(u64, u64, u64)> {
    let mut it = v.split(['.', '-', '+']).map(|p| p.parse::<u64>().ok());
    Some((it.next()??, it.next()??, it.next()??))
}

/// Collects findings.
struct Doctor {
    findings: Vec<Finding>,
}

impl Doctor {
    fn add(&mut self, check: &'static str, status: Status, subject: impl Into<String>, detail: impl Into<String>) {
        self.findings.push(Finding { check, status, subject: subject.into(), detail: detail.into() });
    }

    async fn arbiters(&mut self, urls: &[String], timeout: Duration) {
        let mine = env!("CARGO_PKG_VERSION");
        if urls.is_empty() {
            self.add(
                "arbiter.version",
                Status::Skip,
                "-",
                "pass --admin-url http://ARBITER:18052 (each arbiter) to check versions and seals",
            );
        }
        for url in urls {
            let status = match admin_get(url, "/status", None, timeout).await {
                Ok((200, body)) => serde_json::from_str::<StatusReply>(&body).map_err(|e| format!("{url}/status: {e}")),
                Ok((code, _)) => Err(format!("{url}/status answered {code}")),
                Err(e) => Err(e),
            };
            let s = match status {
                Ok(s) => s,
                Err(e) => {
                    self.add("arbiter.version", Status::Fail, url, format!("unreachable: {e}"));
                    continue;
                }
            };
            // An arbiter too old to report its version answers without one (read as "").
            match s.version.as_str() {
                "" => {
                    self.add("arbiter.version", Status::Warn, url, "does not report its version (older than lockctl)")
                }
                v if v == mine => self.add("arbiter.version", Status::Ok, url, v),
                v => self.add("arbiter.version", Status::Warn, url, format!("{v} (lockctl is {mine})")),
            }
            if s.sealed {
                let reason = s.seal_reason.as_deref().unwrap_or("unknown");
                let detail = s.seal_detail.as_deref().unwrap_or("");
                self.add(
                    "arbiter.seal",
                    Status::Fail,
                    url,
                    format!("sealed ({reason}): {detail}; every request is refused until the epoch advance (docs/OPERATIONS.md, restore runbook)"),
                );
            } else {
                self.add("arbiter.seal", Status::Ok, url, "not sealed");
            }
            // An arbiter too old to have the grant clock reports no `clock_off` (on).
            match &s.marks.clock_off {
                Some(why) => self.add(
                    "arbiter.grant_clock",
                    Status::Warn,
                    url,
                    format!("off: {why}; re-apply the roles of `lockctl etcd-roles` (docs/OPERATIONS.md)"),
                ),
                None => self.add("arbiter.grant_clock", Status::Ok, url, "on: every grant compares it"),
            }
            if let Some(ops) = &s.operators {
                self.operators(url, ops);
            }
        }
    }

    /// `operators.safeguards`: one failure per safeguard an arbiter reports turned
    /// off (its `/status` `operators.weakened`, docs/ADMIN.md), a pass when none is.
    fn operators(&mut self, url: &str, ops: &OperatorsStatus) {
        if ops.weakened.is_empty() {
            let age = ops.max_token_age_s.map_or("off".to_owned(), |s| format!("{s} s"));
            let detail = format!(
                "MFA required, token age bound {age}, force-release records kept {} s",
                ops.force_record_retention_s
            );
            self.add("operators.safeguards", Status::Ok, url, detail);
        }
        for w in &ops.weakened {
            self.add("operators.safeguards", Status::Fail, url, format!("weakened: {w}"));
        }
    }

    fn cluster(&mut self, v: &ClusterView) {
        if let Some(e) = &v.error {
            self.add("etcd.quorum", Status::Fail, "cluster", format!("{e}: no quorum answers linearizable requests"));
            return;
        }
        for m in &v.members {
            let subject = format!("{} ({})", if m.name.is_empty() { "-" } else { &m.name }, m.id);
            let root_only =
                !m.errors.is_empty() && m.errors.iter().all(|e| e == lockmesh_ops::etcd_view::STATUS_ROOT_ONLY);
            if m.reachable && root_only {
                // It answered; its status is not for this (least-privilege) user.
                self.add("etcd.member", Status::Ok, subject, format!("answers; {}", m.errors.join("; ")));
                continue;
            }
            if !m.reachable || !m.errors.is_empty() {
                let url = m.url.as_deref().unwrap_or("-");
                self.add("etcd.member", Status::Fail, subject, format!("{url}: {}", m.errors.join("; ")));
                continue;
            }
            let version = m.version.clone().unwrap_or_default();
            let role = match (m.leader, m.learner) {
                (true, _) => "leader",
                (_, true) => "learner",
                _ => "follower",
            };
            let detail = match m.raft_term {
                Some(term) => format!("etcd {version}, {role}, raft term {term} index {}", m.raft_index.unwrap_or(0)),
                None => format!("etcd {version}"),
            };
            if version_tuple(&version).is_some_and(|t| t < ETCD_FLOOR) {
                let (a, b, c) = ETCD_FLOOR;
                self.add(
                    "etcd.member",
                    Status::Warn,
                    subject,
                    format!("{detail}: below {a}.{b}.{c} (lease and stale-read fixes: docs/DECISIONS.md F-1)"),
                );
            } else {
                self.add("etcd.member", Status::Ok, subject, detail);
            }
        }
        let summary = format!(
            "{} of {} voting members answer; leader {}",
            v.voting_reachable,
            v.voting,
            v.leader.as_deref().unwrap_or("none agreed")
        );
        self.add(
            "etcd.quorum",
            if v.quorum { Status::Ok } else { Status::Fail },
            v.cluster_id.clone().unwrap_or_default(),
            summary,
        );
        for a in &v.alarms {
            let fix = if a.starts_with("NOSPACE") {
                "the backend quota is reached and etcd refuses every write (grants included): compact, \
                 defragment each member, then `etcdctl alarm disarm`"
            } else {
                "etcd refuses writes until it is resolved and disarmed"
            };
            self.add("etcd.alarm", Status::Fail, "cluster", format!("{a}: {fix}"));
        }
    }

    /// `etcd.db_size` per member against the quota, and `etcd.leases`.
    async fn limits(&mut self, v: &ClusterView, client: &mut etcd_client::Client, a: &DoctorArgs, timeout: Duration) {
        let quota = a.etcd_quota_bytes;
        for m in v.members.iter().filter(|m| m.reachable) {
            let Some(size) = m.db_size else { continue };
            let subject = format!("{} ({})", if m.name.is_empty() { "-" } else { &m.name }, m.id);
            let (pct, verdict) = quota_use(size, quota);
            let detail = format!("database {} MiB of the {} MiB backend quota ({pct} %)", size >> 20, quota >> 20);
            let (status, detail) = match verdict {
                0 => (Status::Ok, detail),
                1 => (Status::Warn, format!("{detail}: compact and defragment before etcd raises NOSPACE")),
                _ => (Status::Fail, format!("{detail}: at the quota etcd raises NOSPACE and refuses every write")),
            };
            self.add("etcd.db_size", status, subject, detail);
        }
        match lease_count(client, timeout).await {
            Ok(n) if n > a.lease_warn => self.add(
                "etcd.leases",
                Status::Warn,
                "cluster",
                format!("{n} leases (above --lease-warn {}): look for leaked sessions", a.lease_warn),
            ),
            Ok(n) => self.add("etcd.leases", Status::Ok, "cluster", format!("{n} leases")),
            Err(e) => self.add("etcd.leases", Status::Skip, "cluster", e),
        }
    }

    /// `keyspace.version` and `keyspace.arbiters` (`lockmesh_lock::upgrade`).
    async fn keyspace(&mut self, client: &mut etcd_client::Client, root: &str, timeout: Duration) {
        use lockmesh_lock::upgrade::{read_view, KeyspaceRecord, Support};
        let keys = &Keys::new(root);
        let read = retry_auth(client, |mut c| async move { read_view(&mut c, keys).await });
        let view = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return self.add("keyspace.version", Status::Fail, root, e.to_string()),
            Err(_) => return self.add("keyspace.version", Status::Fail, root, format!("no answer within {timeout:?}")),
        };
        let rec = view.record.clone().unwrap_or_else(KeyspaceRecord::baseline);
        let summary = format!("version {}, enabled [{}]", rec.version, rec.enabled.join(", "));
        match Support::full().refusal(view.record.as_ref()) {
            Some(r) => self.add("keyspace.version", Status::Fail, root, format!("{summary}: {r} (lockctl)")),
            None => self.add("keyspace.version", Status::Ok, root, summary),
        }
        if view.advertisements.is_empty() {
            self.add("keyspace.arbiters", Status::Warn, root, "no arbiter advertises its capabilities (none runs, or each is older than the keyspace record or lacks its etcd grant)");
        }
        for (key, ad, _) in &view.advertisements {
            let Some(ad) = ad else {
                self.add("keyspace.arbiters", Status::Fail, key, "unreadable advertisement");
                continue;
            };
            let lacking: Vec<&str> = rec.enabled.iter().filter(|e| !ad.supports(e)).map(String::as_str).collect();
            let detail = format!("build {}, listen {}, supports [{}]", ad.build, ad.listen, ad.capabilities.join(", "));
            if lacking.is_empty() && ad.version >= rec.version {
                self.add("keyspace.arbiters", Status::Ok, key, detail);
            } else {
                self.add(
                    "keyspace.arbiters",
                    Status::Fail,
                    key,
                    format!(
                        "{detail}: lacks enabled [{}], so it refuses every request: replace it with a newer build",
                        lacking.join(", ")
                    ),
                );
            }
        }
        self.gated_kinds(client, root, &rec, timeout).await;
    }

    /// `keyspace.gated_kinds`: how many records of each gated kind exist, read
    /// with keys-only scans of `l/` and `s/` and counts of `g/`, `d/`, `w/`.
    async fn gated_kinds(
        &mut self,
        client: &mut etcd_client::Client,
        root: &str,
        rec: &lockmesh_lock::upgrade::KeyspaceRecord,
        timeout: Duration,
    ) {
        use lockmesh_lock::upgrade::Capability as C;
        let root = root.trim_end_matches('/');
        let scan = async {
            let mut counts: Vec<(C, i64)> = Vec::new();
            for (cap, p) in [(C::LockDelayGuards, "g/"), (C::LockDelayGuards, "d/"), (C::ShadowRecords, "w/")] {
                let opts = etcd_client::GetOptions::new().with_prefix().with_count_only();
                let n = Etcd::of(client).get(format!("{root}/{p}"), Some(opts)).await?.count();
                counts.push((cap, n));
            }
            for (p, pick) in [
                ("l/", &[(2usize, "w", C::ExclusionRecords)][..]),
                ("s/", &[(2, "h", C::SessionHoldIndex), (2, "a", C::AttemptFences)][..]),
            ] {
                let opts = etcd_client::GetOptions::new().with_prefix().with_keys_only();
                let r = Etcd::of(client).get(format!("{root}/{p}"), Some(opts)).await?;
                for (at, seg, cap) in pick {
                    let n = r
                        .kvs()
                        .iter()
                        .filter(|kv| {
                            let k = String::from_utf8_lossy(kv.key());
                            k.get(root.len() + 1..).is_some_and(|rest| rest.split('/').nth(*at) == Some(*seg))
                        })
                        .count();
                    counts.push((*cap, i64::try_from(n).unwrap_or(i64::MAX)));
                }
            }
            Ok::<_, etcd_client::Error>(counts)
        };
        let counts = match tokio::time::timeout(timeout, scan).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return self.add("keyspace.gated_kinds", Status::Skip, root, e.to_string()),
            Err(_) => {
                return self.add("keyspace.gated_kinds", Status::Skip, root, format!("no answer within {timeout:?}"))
            }
        };
        let mut total: Vec<(C, i64)> = Vec::new();
        for (c, n) in counts {
            match total.iter_mut().find(|(t, _)| *t == c) {
                Some(t) => t.1 += n,
                None => total.push((c, n)),
            }
        }
        let detail: Vec<String> = total.iter().map(|(c, n)| format!("{} {n}", c.as_str())).collect();
        let stray: Vec<&str> =
            total.iter().filter(|(c, n)| *n > 0 && !rec.is_enabled(*c)).map(|(c, _)| c.as_str()).collect();
        if stray.is_empty() {
            self.add("keyspace.gated_kinds", Status::Ok, root, detail.join(", "));
        } else {
            self.add(
                "keyspace.gated_kinds",
                Status::Warn,
                root,
                format!(
                    "{}: records of [{}] exist while not enabled (an earlier build wrote them, or a disable left them): \
                     honoured; a build lacking them must not run until they are gone",
                    detail.join(", "),
                    stray.join(", ")
                ),
            );
        }
    }

    async fn etcd_records(
        &mut self,
        client: &mut etcd_client::Client,
        root: &str,
        timeout: Duration,
    ) -> Option<Vec<lockmesh_core::policy::ClassPolicy>> {
        let keys = Keys::new(root);
        match tokio::time::timeout(timeout, Etcd::of(client).get(keys.epoch(), None)).await {
            Ok(Ok(r)) => match r.kvs().first().map(|kv| serde_json::from_slice::<EpochRecord>(kv.value())) {
                None => self.add("seal.epoch", Status::Warn, root, "no epoch record: no arbiter has started under this root"),
                Some(Err(e)) => self.add("seal.epoch", Status::Fail, root, format!("the epoch record is unreadable: {e}")),
                Some(Ok(rec)) => match &rec.sealed {
                    Some(why) => self.add(
                        "seal.epoch",
                        Status::Fail,
                        root,
                        format!(
                            "epoch {} sealed ({why}), advancing to {}: every arbiter refuses; finish with lockctl epoch-advance --expected-epoch {} --new-epoch {}",
                            rec.epoch,
                            rec.target.map_or("?".into(), |t| t.to_string()),
                            rec.epoch,
                            rec.target.map_or("N".into(), |t| t.to_string()),
                        ),
                    ),
                    None => self.add("seal.epoch", Status::Ok, root, format!("epoch {}, not sealed", rec.epoch)),
                },
            },
            Ok(Err(e)) => self.add("seal.epoch", Status::Fail, root, format!("cannot read the epoch record: {e}")),
            Err(_) => self.add("seal.epoch", Status::Fail, root, format!("the epoch record: no answer within {timeout:?}")),
        }
        let policies = match tokio::time::timeout(timeout, read_policies(client, root)).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                self.add("class.draining", Status::Fail, root, format!("cannot read the class policies: {e}"));
                return None;
            }
            Err(_) => {
                self.add("class.draining", Status::Fail, root, format!("class policies: no answer within {timeout:?}"));
                return None;
            }
        };
        let now = now_ms();
        let mut draining = 0;
        for p in policies.values().filter(|p| state_str(p) == "draining") {
            draining += 1;
            let age = p.draining_age_ms(now).map_or("?".into(), human_ms);
            let what = if p.pending_move {
                format!("draining for a prefix move for {age}: finish with lockctl class apply FILE, or reopen with --cancel")
            } else {
                let to = p.pending_target.map_or("?".into(), |t| t.to_string());
                format!(
                    "draining a limit change {} -> {to} for {age}, admitting nothing: lockctl limit resume|cancel --class {} --epoch {} --to {to}",
                    p.limit, p.class, p.change_epoch
                )
            };
            self.add("class.draining", Status::Fail, p.class.clone(), what);
        }
        if draining == 0 {
            self.add("class.draining", Status::Ok, root, format!("no class is draining ({} classes)", policies.len()));
        }
        Some(policies.into_values().collect())
    }

    fn registry(
        &mut self,
        file: &Path,
        text: &str,
        policies: Option<&[lockmesh_core::policy::ClassPolicy]>,
        warn_days: u64,
    ) {
        let name = file.display().to_string();
        let raw: RawRegistry = match lockmesh_runtime::parse_yaml(text) {
            Ok(r) => r,
            Err(e) => {
                self.add("class.registry", Status::Fail, name, format!("not a registry: {e}"));
                return;
            }
        };
        // The structure without the pause-test files, which are judged one by one below.
        let reg = match ClassRegistry::try_from_raw(&raw) {
            Ok(r) => r,
            Err(errs) => {
                let all: Vec<String> = errs.iter().map(ToString::to_string).collect();
                self.add("class.registry", Status::Fail, name, format!("invalid: {}", all.join("; ")));
                return;
            }
        };
        let base = file.parent().unwrap_or(Path::new("."));
        let now_s = now_ms() / 1000;
        let today = lockmesh_registry::today();
        let soon_s = warn_days.saturating_mul(86_400);
        for c in reg.classes() {
            let class = c.name.as_str();
            match &c.enforcement {
                Enforcement::Fenced => {
                    let p = pause_status(base, class, c.pause_test_result.as_deref(), now_s);
                    let until = p.expires_unix_s.map(|e| day_string(i64::try_from(e / 86_400).unwrap_or(0)));
                    if !p.passing {
                        self.add(
                            "class.pause_test",
                            Status::Fail,
                            class,
                            format!("fenced without a passing pause test: {}; run lockmesh-pausekit again", p.detail),
                        );
                    } else if p.expires_unix_s.is_some_and(|e| e <= now_s + soon_s) {
                        self.add(
                            "class.pause_test",
                            Status::Warn,
                            class,
                            format!("{}; expires {}", p.detail, until.unwrap_or_default()),
                        );
                    } else {
                        self.add(
                            "class.pause_test",
                            Status::Ok,
                            class,
                            format!("{}; valid until {}", p.detail, until.unwrap_or_default()),
                        );
                    }
                }
                Enforcement::Advisory { risk_owner, waiver_expiry_day } => {
                    let day = day_string(*waiver_expiry_day);
                    let days_left = waiver_expiry_day - today;
                    if days_left < 0 {
                        self.add(
                            "class.waiver",
                            Status::Fail,
                            class,
                            format!("advisory waiver expired on {day} ({} days ago, risk owner {risk_owner}): renew it on the record or fence the class", -days_left),
                        );
                    } else if u64::try_from(days_left).unwrap_or(0) <= warn_days {
                        self.add(
                            "class.waiver",
                            Status::Warn,
                            class,
                            format!("advisory waiver ends on {day} (risk owner {risk_owner})"),
                        );
                    } else {
                        self.add(
                            "class.waiver",
                            Status::Ok,
                            class,
                            format!("advisory until {day} (risk owner {risk_owner})"),
                        );
                    }
                }
            }
            if let Some(p) = policies.and_then(|ps| ps.iter().find(|p| p.class == class)) {
                if p.limit != c.max_holders && p.pending_target != Some(c.max_holders) {
                    self.add(
                        "class.limit",
                        Status::Warn,
                        class,
                        format!(
                            "the registry desires max_holders {}, the authoritative limit is {} (lockctl limit change)",
                            c.max_holders, p.limit
                        ),
                    );
                }
            }
        }
    }
}

/// etcd 3.5 answers a member's status only to its root user once auth is on; no
/// lockmesh role is root (`lockctl etcd-roles`). A member whose status is denied
/// is asked a linearizable read of `<root>/sys/epoch` through its own client URL
/// instead: answering one means it is reachable and part of a quorum with a
/// leader (its version and raft position stay unknown, and say so).
async fn reads_where_status_is_denied(view: &mut ClusterView, etcd: &EtcdArgs, timeout: Duration) {
    let key = Keys::new(&etcd.root).epoch();
    let mut read_any = false;
    for m in view.members.iter_mut() {
        let (Some(url), false) = (m.url.clone(), m.reachable) else { continue };
        if !m.errors.iter().any(|e| e.contains("permission denied")) {
            continue;
        }
        let mut one = etcd.clone();
        one.endpoints = vec![url];
        let read = async {
            let c = connect(&one).await.map_err(|e| e.to_string())?;
            Etcd::of(&c).get(key.as_str(), None).await.map_err(|e| e.to_string())
        };
        if let Ok(Ok(_)) = tokio::time::timeout(timeout, read).await {
            m.reachable = true;
            m.errors.clear();
            m.version = Some("unknown (its status needs etcd's root; a linearizable read answered)".into());
            read_any = true;
        }
    }
    if read_any {
        view.voting_reachable = view.members.iter().filter(|m| !m.learner && m.reachable).count() as u64;
        if view.leader.is_none() {
            view.leader = Some("present (a linearizable read answered)".into());
        }
        view.quorum = view.voting > 0 && view.voting_reachable * 2 > view.voting;
    }
}

/// Runs every check.
pub async fn run(a: &DoctorArgs) -> Result<Report, String> {
    let timeout = Duration::from_millis(a.timeout_ms.max(1));
    if a.etcd.endpoints.is_empty() {
        return Err("--endpoints: required (or LOCKMESH_ETCD_ENDPOINTS)".into());
    }
    let registry = match &a.registry {
        Some(p) => {
            Some((p.clone(), std::fs::read_to_string(p).map_err(|e| format!("--registry {}: {e}", p.display()))?))
        }
        None => None,
    };
    let mut d = Doctor { findings: Vec::new() };
    d.add("lockctl.version", Status::Ok, "lockctl", env!("CARGO_PKG_VERSION"));
    d.arbiters(&a.admin_urls, timeout).await;
    let client = match tokio::time::timeout(timeout, connect(&a.etcd)).await {
        Ok(Ok(c)) => Some(c),
        Ok(Err(e)) => {
            d.add("etcd.reachable", Status::Fail, a.etcd.endpoints.join(","), e.to_string());
            None
        }
        Err(_) => {
            d.add("etcd.reachable", Status::Fail, a.etcd.endpoints.join(","), format!("no answer within {timeout:?}"));
            None
        }
    };
    let mut policies = None;
    if let Some(mut client) = client {
        let etcd = a.etcd.clone();
        let mut view = cluster_view(&mut client, timeout, move |url| {
            let mut one = etcd.clone();
            one.endpoints = vec![url];
            async move { connect(&one).await.map_err(|e| e.to_string()) }
        })
        .await;
        reads_where_status_is_denied(&mut view, &a.etcd, timeout).await;
        d.cluster(&view);
        d.limits(&view, &mut client, a, timeout).await;
        d.keyspace(&mut client, &a.etcd.root, timeout).await;
        policies = d.etcd_records(&mut client, &a.etcd.root, timeout).await;
    } else {
        d.add("class.draining", Status::Skip, &a.etcd.root, "etcd did not answer");
    }
    match &registry {
        Some((file, text)) => d.registry(file, text, policies.as_deref(), a.warn_days),
        None => d.add("class.pause_test", Status::Skip, "-", "pass --registry FILE to check pause tests and waivers"),
    }
    let failures = d.findings.iter().filter(|f| f.status == Status::Fail).count();
    let warnings = d.findings.iter().filter(|f| f.status == Status::Warn).count();
    Ok(Report {
        lockctl_version: env!("CARGO_PKG_VERSION"),
        root: a.etcd.root.clone(),
        findings: d.findings,
        failures,
        warnings,
    })
}

/// The human rendering.
pub fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "lockctl doctor: lockctl {}, root {}", r.lockctl_version, r.root);
    for f in &r.findings {
        let tag = match f.status {
            Status::Ok => "ok  ",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        };
        let _ = writeln!(s, "  {tag}  {:<17} {:<24} {}", f.check, f.subject, f.detail);
    }
    let verdict = if r.failures == 0 { "healthy" } else { "something is wrong" };
    let _ = writeln!(s, "{} failing, {} warnings: {verdict}", r.failures, r.warnings);
    s
}

/// `lockctl doctor`: exit 0 healthy, 1 something failed, 64 bad arguments.
pub async fn main(a: &DoctorArgs) -> ExitCode {
    let report = match run(a).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("lockctl doctor: {e}");
            return ExitCode::from(64);
        }
    };
    let out = if a.json { serde_json::to_string_pretty(&report).unwrap_or_default() + "\n" } else { render(&report) };
    let _ = std::io::stdout().write_all(out.as_bytes());
    if report.failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn days_round_trip_and_versions_compare() {
        for s in ["1970-01-01", "2000-02-29", "2026-12-31", "2099-03-01"] {
            let d = lockmesh_core::class::parse_day(s).unwrap();
            assert_eq!(day_string(d), s);
        }
        assert!(version_tuple("3.5.16").unwrap() < ETCD_FLOOR);
        assert!(version_tuple("3.5.30").unwrap() >= ETCD_FLOOR);
        assert_eq!(version_tuple("3.6.0-rc.1"), Some((3, 6, 0)));
        assert_eq!(version_tuple("x"), None);
    }

    /// A loopback server answering its first connection with `reply` (raw bytes, so
    /// the answer can be chunked) or, without one, never answering; yields the
    /// request head it read.
    pub(crate) async fn serve_once(reply: Option<String>) -> (String, tokio::task::JoinHandle<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                head.extend_from_slice(&buf[..n]);
            }
            match reply {
                Some(r) => s.write_all(r.as_bytes()).await.unwrap(),
                None => tokio::time::sleep(Duration::from_secs(5)).await,
            }
            String::from_utf8_lossy(&head).into_owned()
        });
        (base, task)
    }

    #[tokio::test]
    async fn admin_get_reads_a_chunked_answer_and_sends_the_bearer() {
        let (base, req) = serve_once(Some(
            "HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"wa\r\n9\r\niters\":3}\r\n0\r\n\r\n"
                .into(),
        ))
        .await;
        let got = admin_get(&base, "/console/api/waiters/ab", Some("t0k"), Duration::from_secs(5)).await.unwrap();
        assert_eq!(got, (503, "{\"waiters\":3}".to_owned()));
        let head = req.await.unwrap().to_ascii_lowercase();
        assert!(head.starts_with("get /console/api/waiters/ab http/1.1\r\n"), "{head}");
        assert!(head.contains("\r\nauthorization: bearer t0k\r\n"), "{head}");
        assert!(admin_get("https://a:1", "/status", None, Duration::from_secs(1))
            .await
            .unwrap_err()
            .contains("http://host:port"));
    }

    #[tokio::test]
    async fn admin_get_gives_up_after_its_timeout() {
        let (base, _req) = serve_once(None).await;
        let e = admin_get(&base, "/status", None, Duration::from_millis(200)).await.unwrap_err();
        assert_eq!(e, format!("{base}: no answer within 200ms"));
    }

    /// `/status` is read as the arbiter's `StatusReply`: a sealed arbiter fails
    /// `arbiter.seal` with its reason and detail, an old one without a version warns.
    #[tokio::test]
    async fn a_sealed_arbiter_fails_and_an_unversioned_one_warns() {
        let body = r#"{"sealed":true,"seal_reason":"revision_behind_mark","seal_detail":"revision 3 < mark 9"}"#;
        let reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        let (base, _req) = serve_once(Some(reply)).await;
        let mut d = Doctor { findings: Vec::new() };
        d.arbiters(std::slice::from_ref(&base), Duration::from_secs(5)).await;
        let f = |check: &str| d.findings.iter().find(|f| f.check == check).cloned().unwrap();
        assert_eq!(f("arbiter.version").status, Status::Warn);
        assert!(f("arbiter.version").detail.contains("does not report its version"));
        let seal = f("arbiter.seal");
        assert_eq!(seal.status, Status::Fail);
        assert!(seal.detail.starts_with("sealed (revision_behind_mark): revision 3 < mark 9;"), "{}", seal.detail);
    }

    /// An arbiter whose role lacks the grant clock warns `arbiter.grant_clock` with
    /// its reason; one without `clock_off` (on, or older than the clock) passes.
    #[tokio::test]
    async fn a_grant_clock_that_is_off_warns() {
        for (marks, want) in [
            (r#"{"clock":0,"clock_off":"the etcd role may not read and write sys/clock"}"#, Status::Warn),
            (r#"{"clock":42,"clock_off":null}"#, Status::Ok),
            (r#"{"epoch":1}"#, Status::Ok),
        ] {
            let body = format!(r#"{{"sealed":false,"version":"x","marks":{marks}}}"#);
            let reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
            let (base, _req) = serve_once(Some(reply)).await;
            let mut d = Doctor { findings: Vec::new() };
            d.arbiters(std::slice::from_ref(&base), Duration::from_secs(5)).await;
            let f = d.findings.iter().find(|f| f.check == "arbiter.grant_clock").cloned().unwrap();
            assert_eq!(f.status, want, "{marks}: {}", f.detail);
            if want == Status::Warn {
                assert!(f.detail.contains("sys/clock") && f.detail.contains("etcd-roles"), "{}", f.detail);
            }
        }
    }

    /// Each weakened safeguard is one failure; none weakened is one pass; an arbiter
    /// without an `operators` section gives no finding.
    #[tokio::test]
    async fn weakened_operator_safeguards_fail_one_by_one() {
        let weak = r#"{"sealed":false,"version":"x","operators":{"require_mfa":false,"max_token_age_s":null,"force_record_retention_s":60,"weakened":["require_mfa is false","max_token_age_s is 0"]}}"#;
        let strong = r#"{"sealed":false,"version":"x","operators":{"require_mfa":true,"max_token_age_s":900,"force_record_retention_s":60,"weakened":[]}}"#;
        let none = r#"{"sealed":false,"version":"x"}"#;
        let mut found = Vec::new();
        for body in [weak, strong, none] {
            let reply = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
            let (base, _req) = serve_once(Some(reply)).await;
            let mut d = Doctor { findings: Vec::new() };
            d.arbiters(std::slice::from_ref(&base), Duration::from_secs(5)).await;
            found.push(d.findings.into_iter().filter(|f| f.check == "operators.safeguards").collect::<Vec<_>>());
        }
        let weak = &found[0];
        assert_eq!(weak.len(), 2, "{weak:?}");
        assert!(weak.iter().all(|f| f.status == Status::Fail));
        assert_eq!(weak[0].detail, "weakened: require_mfa is false");
        assert_eq!(weak[1].detail, "weakened: max_token_age_s is 0");
        assert_eq!(found[1].len(), 1);
        assert_eq!(found[1][0].status, Status::Ok);
        assert_eq!(found[1][0].detail, "MFA required, token age bound 900 s, force-release records kept 60 s");
        assert!(found[2].is_empty(), "{:?}", found[2]);
    }

    #[test]
    fn a_registry_with_an_expired_waiver_and_a_missing_pause_test_fails() {
        let text = "classes:\n  - { name: d, default: true, ttl_s: 60, enforcement: advisory, risk_owner: t, waiver_expiry: \"2020-01-01\" }\n  - { name: f, prefixes: [f], ttl_s: 15, enforcement: fenced, pause_test_result: missing.yaml }\n  - { name: a, prefixes: [a], ttl_s: 60, enforcement: advisory, risk_owner: t, waiver_expiry: \"2099-01-01\" }\n";
        let mut d = Doctor { findings: Vec::new() };
        d.registry(Path::new("/nonexistent/registry.yaml"), text, None, 14);
        let st = |check: &str, subject: &str| {
            d.findings.iter().find(|f| f.check == check && f.subject == subject).map(|f| f.status)
        };
        assert_eq!(st("class.waiver", "d"), Some(Status::Fail));
        assert_eq!(st("class.waiver", "a"), Some(Status::Ok));
        assert_eq!(st("class.pause_test", "f"), Some(Status::Fail));
        let r = Report { lockctl_version: "x", root: "/r".into(), failures: 2, warnings: 0, findings: d.findings };
        let h = render(&r);
        assert!(h.contains("FAIL  class.waiver") && h.contains("expired on 2020-01-01"), "{h}");
        assert!(h.ends_with("2 failing, 0 warnings: something is wrong\n"), "{h}");
    }
}
