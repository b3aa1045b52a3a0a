//! Issue #16: docs/OPERATIONS.md's restore and limit-change runbooks, executed as
//! written against production's etcd shape (client TLS, auth on, the shipped roles:
//! `StackBuilder::secure_etcd`, whatever `LOCKMESH_TEST_ETCD` says).
//!
//! The commands come from the doc's `sh` blocks themselves ([`runbook`]): each
//! `lockctl` line is run with its flags in the doc's order; only the values that
//! name this machine (endpoints, CA, password files, data directories, snapshot,
//! marks files, the epoch a previous step printed) are filled in ([`Fill`]). Every
//! `--etcd-user` the doc names must be the role `etcd_roles::COMMAND_ROLES` gives
//! that command, and the command runs as that role's user of the stack (never
//! root). A flag the doc adds that the test has no value for, or a path it does not
//! know, fails the test: the doc cannot drift from what is run.
//!
//! The audit tailer runs through both restores under its read-only role
//! (`lockmesh-audit`): after the runbook's bumped restore it carries on; after a
//! restore without bump (behind its checkpoint) it records a `restore` event with
//! `sealed_target: null` (its role may not write the epoch record), the arbiter
//! seals on its own marks, and the break-glass `epoch-advance` (as
//! `lockmesh-admin-epoch`) brings it back with tokens above every earlier one.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use lockmesh_ops::admin::etcd_roles::COMMAND_ROLES;
use lockmesh_tests::{eventually, paths::profile_dir, EtcdUsers, Stack};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::audit::{head, Tailer};

const OPERATIONS: &str = include_str!("../../../docs/OPERATIONS.md");
const ACQ: &str = "/v1/locks/acquire";
const REL: &str = "/v1/locks/release";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
  - { name: pool, prefixes: ["payments/pool"], ttl_s: 15, max_holders: 3, enforcement: advisory, risk_owner: t,
      waiver_expiry: "2099-12-31" }
"#;

/// The `lockctl` command lines of the `sh` blocks under `## <section>` in
/// docs/OPERATIONS.md, continuation lines joined, comments dropped, split as a
/// shell would.
fn runbook(section: &str) -> Vec<Vec<String>> {
    let start = OPERATIONS.find(&format!("\n## {section}\n")).unwrap_or_else(|| panic!("no section {section:?}"));
    let body = &OPERATIONS[start + 1..];
    let body = &body[..body[3..].find("\n## ").map_or(body.len(), |e| e + 3)];
    let mut cmds = Vec::new();
    for block in body.split("```sh\n").skip(1) {
        let block = &block[..block.find("```").expect("an unterminated sh block")];
        let mut line = String::new();
        for l in block.lines() {
            let l = l.trim();
            if l.starts_with('#') || l.is_empty() {
                continue;
            }
            match l.strip_suffix('\\') {
                Some(head) => line.push_str(head),
                None => {
                    line.push_str(l);
                    if line.starts_with("lockctl ") {
                        cmds.push(shlex::split(&line).unwrap_or_else(|| panic!("cannot split {line:?}")));
                    }
                    line.clear();
                }
            }
        }
    }
    assert!(!cmds.is_empty(), "no lockctl command in {section:?}");
    cmds
}

/// The role `COMMAND_ROLES` gives `lockctl <words>` (`limit resume` is in
/// `limit change|resume|cancel`).
fn role_of(words: &[String]) -> &'static str {
    let matches = |entry: &str| {
        let mut e = entry.split(' ');
        let first = e.next().unwrap_or_default();
        first == words[0] && e.next().is_none_or(|alts| words.get(1).is_some_and(|w| alts.split('|').any(|a| a == w)))
    };
    COMMAND_ROLES
        .iter()
        .find(|(entry, _)| matches(entry))
        .and_then(|(_, role)| *role)
        .unwrap_or_else(|| panic!("no etcd role for lockctl {words:?}"))
}

/// How a doc command line becomes an argv on this machine.
struct Fill<'a> {
    users: &'a EtcdUsers,
    endpoints: String,
    root: String,
    /// Flag -> the values this machine has for it (a repeated flag in the doc, e.g.
    /// `--member m0=... --member m1=...`, takes all of them at its first use).
    values: BTreeMap<&'static str, Vec<String>>,
}

impl Fill<'_> {
    /// (subcommand words, argv after `lockctl`, role) for `cmd`.
    fn argv(&self, cmd: &[String]) -> (Vec<String>, Vec<String>, &'static str) {
        assert_eq!(cmd[0], "lockctl");
        let words: Vec<String> = cmd[1..].iter().take_while(|t| !t.starts_with("--")).cloned().collect();
        let role = role_of(&words);
        let mut argv = words.clone();
        let mut done = Vec::new();
        let mut flags = cmd[1 + words.len()..].iter();
        while let Some(flag) = flags.next() {
            assert!(flag.starts_with("--"), "{words:?}: {flag:?} is not a flag");
            let value = flags.next().unwrap_or_else(|| panic!("{words:?}: {flag} without a value"));
            let filled: Vec<String> = match flag.as_str() {
                "--etcd-user" => {
                    assert_eq!(value, role, "lockctl {words:?} runs as COMMAND_ROLES' {role}");
                    vec![self.users.user(role)]
                }
                "--etcd-password-file" => vec![self.users.password_file(role).display().to_string()],
                "--etcd-ca" => vec![self.users.ca().expect("a TLS etcd").display().to_string()],
                "--endpoints" => vec![self.endpoints.clone()],
                "--root" => vec![self.root.clone()],
                f => match self.values.get(f) {
                    Some(_) if done.contains(&f) => continue,
                    Some(v) => v.clone(),
                    // A value that names no machine (a class, a count, who and why) is run as written.
                    None => {
                        assert!(
                            !value.contains("...") && !value.contains('/') && !value.ends_with(".db"),
                            "{words:?}: no value on this machine for {f} {value:?} (did the doc change?)"
                        );
                        vec![value.clone()]
                    }
                },
            };
            done.push(flag.as_str());
            for v in filled {
                argv.push(flag.clone());
                argv.push(v);
            }
        }
        assert!(argv.iter().any(|a| a == "--etcd-user"), "lockctl {words:?} in the doc names no etcd user");
        (words, argv, role)
    }
}

fn lockctl_cmd(argv: &[String]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(profile_dir().join("lockctl"));
    // Only the flags: no LOCKMESH_ETCD_* from the environment the tests run in.
    for v in ["ENDPOINTS", "CA", "CERT", "KEY", "USER", "PASSWORD_FILE"] {
        c.env_remove(format!("LOCKMESH_ETCD_{v}"));
    }
    c.args(argv).kill_on_drop(true);
    c
}

async fn run(argv: &[String]) -> (i32, Value, String) {
    let out = lockctl_cmd(argv).output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let json = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
    let text = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), json, text)
}

fn token(r: &lockmesh_tests::Resp) -> u64 {
    r.json["token"].as_str().unwrap_or_else(|| panic!("no token: {}", r.body)).parse().unwrap()
}

/// The arbiter's `/status` (an error while it does not answer 200, for `eventually`).
async fn status(st: &Stack) -> anyhow::Result<Value> {
    let (code, body) = st.arbiter(0).admin_get("/status").await?;
    anyhow::ensure!(code == 200, "/status: {code} {body}");
    Ok(serde_json::from_str(&body)?)
}

async fn marks_reach(marks: &Path, rev: u64) {
    eventually(Duration::from_secs(10), async || {
        let m: Value = serde_json::from_slice(&std::fs::read(marks)?)?;
        anyhow::ensure!(m["revision"].as_u64().unwrap_or(0) >= rev, "marks at {}", m["revision"]);
        Ok(())
    })
    .await;
}

async fn stack(name: &str, marks: &Path) -> Stack {
    Stack::builder(name)
        .envoy_config("lock-tier")
        .secure_etcd()
        .registry(REGISTRY)
        .arbiter_extra_yaml(format!("marks_file: {:?}", marks.display().to_string()))
        .start()
        .await
        .unwrap()
}

fn fill<'a>(st: &'a Stack, values: &[(&'static str, Vec<String>)]) -> Fill<'a> {
    Fill {
        users: st.etcd_users(),
        endpoints: st.etcd().endpoints().join(","),
        root: st.root().to_owned(),
        values: values.iter().cloned().collect(),
    }
}

#[test]
fn every_runbook_command_names_its_role_and_nothing_of_root() {
    for section in ["Restore runbook", "Limit-change runbook"] {
        for cmd in runbook(section) {
            let words: Vec<String> = cmd[1..].iter().take_while(|t| !t.starts_with("--")).cloned().collect();
            let role = role_of(&words);
            let user = cmd.iter().position(|t| t == "--etcd-user").map(|i| cmd[i + 1].as_str());
            assert_eq!(user, Some(role), "{section}: lockctl {words:?}");
            for f in ["--etcd-ca", "--etcd-password-file", "--endpoints", "--root"] {
                assert!(cmd.iter().any(|t| t == f), "{section}: lockctl {words:?} without {f}");
            }
            assert!(cmd.iter().all(|t| t != "root"), "{section}: a root credential in {cmd:?}");
        }
    }
    let limit: Vec<String> = runbook("Limit-change runbook").iter().map(|c| format!("{} {}", c[1], c[2])).collect();
    assert_eq!(limit, ["limit show", "limit change", "limit resume", "limit cancel"]);
}

/// The restore runbook's one command, as written, as `lockmesh-admin-epoch` over
/// TLS, with the arbiter serving and the audit tailer tailing under its read-only
/// role: restored, sealed, advanced, revoked, unsealed; the arbiter serves tokens of
/// the new epoch above every earlier one, the restored holder's session is gone,
/// and the tailer carries on past the restore.
#[tokio::test]
async fn the_restore_runbook_runs_as_written_under_auth_with_the_tailer_running() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let st = stack("runbook-restore", &marks).await;
    let tailer = Tailer::start(&st, "seal_on_restore: true\n").await;
    let a = st.client("payments", "a").unwrap();
    let restored = a.post(ACQ, &[("x-lock-key", "payments/held")]).await.unwrap();
    assert_eq!(restored.code(), 200, "{}", restored.body);
    let session = restored.json["session"].as_str().unwrap().to_owned();
    // Taking the snapshot is not part of the runbook: etcd's Snapshot RPC wants root.
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    let mut max_before = 0;
    for i in 0..4 {
        let k = format!("payments/later-{i}");
        let t = token(&a.post(ACQ, &[("x-lock-key", &k)]).await.unwrap());
        a.post(REL, &[("x-lock-key", &k), ("x-lock-token", &t.to_string())]).await.unwrap();
        max_before = max_before.max(t);
    }
    marks_reach(&marks, max_before & ((1 << 48) - 1)).await;
    tailer.caught_up(head(&st).await).await;

    // Step 1 of the runbook: stop every member, move its data directory away.
    let m = st.etcd().member(0);
    m.stop().await.unwrap();
    std::fs::rename(m.data_dir(), dir.path().join("m0-old")).unwrap();
    let etcdutl = lockmesh_tests::etcd::etcdutl_bin().unwrap();
    let members =
        st.etcd().members().iter().map(|m| format!("{}={}={}", m.name(), m.data_dir().display(), m.peer_url()));
    let f = fill(
        &st,
        &[
            ("--snapshot", vec![snap.display().to_string()]),
            ("--member", members.collect()),
            ("--initial-cluster-token", vec![st.etcd().token().to_owned()]),
            ("--etcdutl", vec![etcdutl.display().to_string()]),
            ("--marks", vec![marks.display().to_string()]),
        ],
    );
    let cmds = runbook("Restore runbook");
    assert_eq!(cmds.len(), 1, "the restore runbook is one command: {cmds:?}");
    let (words, argv, role) = f.argv(&cmds[0]);
    assert_eq!((words.as_slice(), role), (&["restore".to_owned()][..], "lockmesh-admin-epoch"));
    // Step 2: the command; start the members when it says so.
    let mut child = lockctl_cmd(&argv).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut log = Vec::new();
    while let Some(l) = lines.next_line().await.unwrap() {
        if l.starts_with("waiting for etcd") {
            m.restart().await.unwrap();
        }
        log.push(l);
    }
    let out = child.wait_with_output().await.unwrap();
    let log = log.join("\n");
    assert!(out.status.success(), "{log}\n{}", String::from_utf8_lossy(&out.stderr));
    for step in ["headroom", "1/4 sealed", "2/4 advanced", "3/4 revoked", "4/4 unsealed"] {
        assert!(log.contains(step), "no {step:?} in:\n{log}");
    }

    // As the runbook says: the arbiter sees the new epoch, re-bases its marks, serves.
    eventually(Duration::from_secs(15), async || {
        anyhow::ensure!(status(&st).await?["sealed"] == false, "still sealed");
        Ok(())
    })
    .await;
    let r = a.post(ACQ, &[("x-lock-key", "payments/held")]).await.unwrap();
    assert_eq!(r.code(), 200, "the restored hold was ended: {}", r.body);
    let after = token(&r);
    assert!(after > max_before && after >> 48 == 2, "{after} vs {max_before}");
    let r = a.post("/v1/sessions/keepalive", &[("x-lock-session", &session)]).await.unwrap();
    assert_eq!(r.code(), 410, "the restored session is revoked: {}", r.body);
    // The tailer, read-only, carries on past the restore.
    tailer.caught_up(head(&st).await).await;
    assert!(tailer.process.is_running(), "{}", tailer.log());
}

/// A restore without bump (behind the audit checkpoint) while the tailer runs under
/// the read-only `lockmesh-audit` role: it records the restore unsealed
/// (`sealed_target: null`, its role may not write the epoch record) and carries on;
/// the arbiter seals on its own marks (docs/OPERATIONS.md), and the break-glass
/// `lockctl epoch-advance` as `lockmesh-admin-epoch` unseals it with larger tokens.
#[tokio::test]
async fn a_restore_under_auth_is_recorded_unsealed_by_the_read_only_tailer_and_the_arbiter_seals() {
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks.json");
    let st = stack("runbook-restore-tailer", &marks).await;
    let tailer = Tailer::start(&st, "seal_on_restore: true\n").await;
    let a = st.client("payments", "a").unwrap();
    let snap = dir.path().join("snap.db");
    st.etcd().snapshot_save(&snap).await.unwrap();
    let mut max_before = 0;
    for i in 0..3 {
        let k = format!("payments/audit-{i}");
        let t = token(&a.post(ACQ, &[("x-lock-key", &k)]).await.unwrap());
        a.post(REL, &[("x-lock-key", &k), ("x-lock-token", &t.to_string())]).await.unwrap();
        max_before = max_before.max(t);
    }
    marks_reach(&marks, max_before & ((1 << 48) - 1)).await;
    tailer.caught_up(head(&st).await).await;
    st.etcd().restore_from(&snap, None).await.unwrap();

    let events = eventually(Duration::from_secs(20), async || {
        let v = tailer.lockctl(&["events", "restore"]);
        anyhow::ensure!(v["events"].as_array().is_some_and(|e| !e.is_empty()), "no restore event yet: {v}");
        Ok(v)
    })
    .await;
    let ev = &events["events"][0];
    assert!(ev["detail"].get("sealed_target").is_some_and(Value::is_null), "{events}");
    assert!(tailer.log().contains("may not write the epoch"), "{}", tailer.log());
    assert!(tailer.process.is_running(), "{}", tailer.log());
    // The epoch record is not sealed by the tailer; the arbiter seals on its marks.
    let reason = eventually(Duration::from_secs(15), async || {
        let s = status(&st).await?;
        anyhow::ensure!(s["sealed"] == true, "not sealed: {s}");
        Ok(s["seal_reason"].as_str().unwrap_or_default().to_owned())
    })
    .await;
    assert_eq!(reason, "revision_behind_mark");
    let r = a.post(ACQ, &[("x-lock-key", "payments/while-sealed")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("sealed")), "{}", r.body);

    // The break-glass advance, as its role's user.
    let users = st.etcd_users();
    let mut argv: Vec<String> = ["epoch-advance", "--expected-epoch", "1", "--new-epoch", "2"].map(String::from).into();
    for (flag, v) in [
        ("--endpoints", st.etcd().endpoints().join(",")),
        ("--root", st.root().to_owned()),
        ("--etcd-ca", users.ca().unwrap().display().to_string()),
        ("--etcd-user", users.user("lockmesh-admin-epoch")),
        ("--etcd-password-file", users.password_file("lockmesh-admin-epoch").display().to_string()),
    ] {
        argv.extend([flag.to_owned(), v]);
    }
    let (code, _, text) = run(&argv).await;
    assert_eq!(code, 0, "{text}");
    eventually(Duration::from_secs(15), async || {
        anyhow::ensure!(status(&st).await?["sealed"] == false, "still sealed");
        Ok(())
    })
    .await;
    let after = token(&a.post(ACQ, &[("x-lock-key", "payments/after")]).await.unwrap());
    assert!(after > max_before && after >> 48 == 2, "{after} vs {max_before}");
    tailer.caught_up(head(&st).await).await;
}

/// The limit-change runbook as written: show (lockmesh-admin), change to 1 with
/// three holds open (exit 2, draining), resume after they ended (activated), then a
/// second lowering cancelled; each writing step as lockmesh-classes over TLS.
#[tokio::test]
async fn the_limit_change_runbook_runs_as_written_with_each_command_as_its_role() {
    let dir = tempfile::tempdir().unwrap();
    let st = stack("runbook-limits", &dir.path().join("marks.json")).await;
    let c = st.client("payments", "a").unwrap();
    let key = [("x-lock-key", "payments/pool/k")];
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let r = c.post(ACQ, &key).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
        tokens.push(token(&r));
    }
    let cmds = runbook("Limit-change runbook");
    let mut f = fill(&st, &[]);
    let argv = |f: &Fill<'_>, i: usize| f.argv(&cmds[i]);

    // 1. show, read-only.
    let (_, show, role) = argv(&f, 0);
    assert_eq!(role, "lockmesh-admin");
    let (code, v, text) = run(&show).await;
    assert_eq!(code, 0, "{text}");
    assert_eq!(v["limit"], 3, "{v}");
    // 2. change to 1 with three holds: drains, stays draining (exit 2).
    let (_, change, role) = argv(&f, 1);
    assert_eq!(role, "lockmesh-classes");
    let (code, v, text) = run(&change).await;
    assert_eq!(code, 2, "{text}");
    let epoch = v["policy"]["change_epoch"].as_u64().unwrap_or_else(|| panic!("{text}"));
    let r = c.post(ACQ, &[("x-lock-key", "payments/pool/other")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (503, Some("draining")), "{}", r.body);
    // 3. the holds end; resume activates.
    for t in &tokens {
        let r = c.post(REL, &[key[0], ("x-lock-token", &t.to_string())]).await.unwrap();
        assert_eq!(r.code(), 200, "{}", r.body);
    }
    f.values.insert("--epoch", vec![epoch.to_string()]);
    let (_, resume, role) = argv(&f, 2);
    assert_eq!(role, "lockmesh-classes");
    // The verification waits outside any exclusive window: resume until it activates.
    let mut resumed = run(&resume).await;
    for _ in 0..20 {
        if resumed.0 != 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        resumed = run(&resume).await;
    }
    let (code, v, text) = resumed;
    assert_eq!(code, 0, "{text}");
    assert_eq!((v["policy"]["limit"].as_u64(), v["policy"]["state"].as_str()), (Some(1), Some("active")), "{v}");
    let (code, v, text) = run(&show).await;
    assert_eq!((code, v["limit"].as_u64()), (0, Some(1)), "{text}");
    // A stale cancel (the resumed epoch) is refused with exit 3, changing nothing.
    let (_, cancel, role) = argv(&f, 3);
    assert_eq!(role, "lockmesh-classes");
    let (code, _, text) = run(&cancel).await;
    assert_eq!(code, 3, "{text}");

    // The cancel branch: raise to 3 (immediate), lower to 1 over a hold of two, cancel.
    let raise: Vec<String> = change.iter().map(|a| if a == "1" { "3".to_owned() } else { a.clone() }).collect();
    let (code, _, text) = run(&raise).await;
    assert_eq!(code, 0, "{text}");
    for _ in 0..2 {
        assert_eq!(c.post(ACQ, &key).await.unwrap().code(), 200);
    }
    let (code, v, text) = run(&change).await;
    assert_eq!(code, 2, "{text}");
    f.values.insert("--epoch", vec![v["policy"]["change_epoch"].as_u64().unwrap().to_string()]);
    let (_, cancel, _) = argv(&f, 3);
    let (code, v, text) = run(&cancel).await;
    assert_eq!(code, 0, "{text}");
    assert_eq!((v["policy"]["limit"].as_u64(), v["policy"]["state"].as_str()), (Some(3), Some("active")), "{v}");
    assert_eq!(c.post(ACQ, &key).await.unwrap().code(), 200, "admission is back");
}
