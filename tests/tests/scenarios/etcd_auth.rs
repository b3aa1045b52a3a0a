//! Issue 9 (ADR-05, ADR-20): etcd with client TLS and auth on, one role per
//! component (`lockmesh_ops::admin::etcd_roles`, the definitions
//! `lockctl etcd-roles` prints). Each role is refused a write outside its job (the
//! operators' `lockmesh-admin` role can neither put nor delete a hold), and the
//! arbiter serves a lock cycle through Envoy over that etcd, logged in as its own
//! user; an approved force release is executed by that arbiter, deleting the hold
//! and writing the force record in one transaction the audit decoder reads as a
//! force release. Every `lockctl` command that talks to etcd reaches it over TLS
//! as the user of its own role (`etcd_roles::COMMAND_ROLES`), and a command run
//! with a role short of what it writes is refused with etcd's `permission denied`.

use etcd_client::{Client, EventType, GetOptions, Permission, WatchOptions};
use lockmesh_audit::{
    decode::{decode, Change, Context, Op, Prev},
    EventKind,
};
use lockmesh_core::policy::{ChangeNote, ClassPolicy};
use lockmesh_devcerts::jwt::Issuer;
use lockmesh_ops::admin::etcd_roles::{roles, Perm, COMMAND_ROLES};
use lockmesh_tests::{
    etcd::EtcdTls, paths::profile_dir, unique_prefix, ArbiterProcess, Backend, DevPki, EnvoyProcess, EtcdCluster,
    LockClient, Stack, TEST_TRUST_DOMAIN,
};
use serde_json::json;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

fn pw(user: &str) -> String {
    format!("pw-{user}-{:08x}", 0x5eed_u32)
}

/// etcd with client TLS from the dev PKI, the lockmesh roles and users for
/// `root`, and auth enabled.
async fn secured(pki: &DevPki, root: &str) -> EtcdCluster {
    let server = pki.arbiter_server();
    let tls = EtcdTls { cert: server.cert_path.clone(), key: server.key_path.clone(), ca: pki.ca_cert_path() };
    let etcd = EtcdCluster::builder().client_tls(tls).start().await.unwrap();
    let mut c = etcd.client().await.unwrap();
    for role in roles(root) {
        c.role_add(role.name).await.unwrap();
        for g in &role.grants {
            let mut p = match g.perm {
                Perm::Read => Permission::read(g.key.as_str()),
                Perm::Write => Permission::write(g.key.as_str()),
                Perm::ReadWrite => Permission::read_write(g.key.as_str()),
            };
            if g.prefix {
                p = p.with_prefix();
            }
            c.role_grant_permission(role.name, p).await.unwrap();
        }
        c.user_add(role.name, pw(role.name), None).await.unwrap();
        c.user_grant_role(role.name, role.name).await.unwrap();
    }
    etcd.enable_auth(&pw("root")).await.unwrap();
    etcd
}

async fn put(c: &mut Client, k: String) -> Result<(), String> {
    c.put(k, "x", None).await.map(|_| ()).map_err(|e| e.to_string())
}

fn denied(r: Result<(), String>, what: &str) {
    let e = r.expect_err(what);
    assert!(e.contains("permission denied"), "{what}: {e}");
}

#[tokio::test]
async fn each_role_is_refused_a_write_outside_its_job() {
    let dir = tempfile::tempdir().unwrap();
    let pki = DevPki::generate(dir.path().join("pki"), TEST_TRUST_DOMAIN).unwrap();
    let root = unique_prefix("etcd-auth");
    let etcd = secured(&pki, &root).await;
    // TLS is on: plain HTTP to the client port fails; auth is on: no user, no read.
    let port = etcd.member(0).client_port();
    let plain = async {
        let mut c = Client::connect([format!("http://127.0.0.1:{port}")], None).await.map_err(|e| e.to_string())?;
        c.get("x", None).await.map(|_| ()).map_err(|e| e.to_string())
    };
    assert!(tokio::time::timeout(std::time::Duration::from_secs(5), plain).await.map_or(true, |r| r.is_err()));
    let mut anon = etcd.client().await.unwrap();
    assert!(anon.get(format!("{root}/sys/epoch"), None).await.is_err(), "auth is off");

    let hold = format!("{root}/l/00ff/h/0000");
    let as_ = |u: &'static str| etcd.client_as(u, Box::leak(pw(u).into_boxed_str()));
    // The arbiter: holds, force records and admin requests (it executes approved
    // admin actions); not the audit election, nothing outside its root.
    let mut arb = as_("lockmesh-arbiter").await.unwrap();
    put(&mut arb, hold.clone()).await.unwrap();
    put(&mut arb, format!("{root}/sys/epoch")).await.unwrap();
    put(&mut arb, format!("{root}/f/00ff")).await.unwrap();
    put(&mut arb, format!("{root}/adm/req/1")).await.unwrap();
    denied(put(&mut arb, format!("{root}/sys/audit-leader")).await, "arbiter takes the audit election");
    denied(put(&mut arb, "/elsewhere/k".into()).await, "arbiter writes outside its root");
    // The operators' admin role reads, and writes nothing: no hold put or deleted,
    // no force record, no admin request, no session, epoch or class policy.
    let mut adm = as_("lockmesh-admin").await.unwrap();
    let n = adm.get(format!("{root}/l/"), Some(GetOptions::new().with_prefix())).await.unwrap().kvs().len();
    assert_eq!(n, 1);
    denied(put(&mut adm, format!("{root}/l/00fe/h/0000")).await, "admin puts a hold");
    denied(adm.delete(hold.clone(), None).await.map(|_| ()).map_err(|e| e.to_string()), "admin deletes a hold");
    denied(put(&mut adm, format!("{root}/f/00ff")).await, "admin writes a force record");
    denied(put(&mut adm, format!("{root}/adm/req/2")).await, "admin writes an admin request");
    denied(put(&mut adm, format!("{root}/s/00000000000000ff")).await, "admin puts a session");
    denied(put(&mut adm, format!("{root}/sys/epoch")).await, "admin puts the epoch record");
    denied(put(&mut adm, format!("{root}/c/default")).await, "admin puts a class policy");
    denied(put(&mut adm, format!("{root}/r/00ff")).await, "admin puts a release marker");
    let n = adm.get(format!("{root}/l/"), Some(GetOptions::new().with_prefix())).await.unwrap().kvs().len();
    assert_eq!(n, 1, "the hold is still there");
    // The audit tailer: reads everything, writes only its election key.
    let mut aud = as_("lockmesh-audit").await.unwrap();
    assert!(aud.get(format!("{root}/"), Some(GetOptions::new().with_prefix())).await.is_ok());
    put(&mut aud, format!("{root}/sys/audit-leader")).await.unwrap();
    denied(put(&mut aud, hold.clone()).await, "audit puts a hold");
    denied(put(&mut aud, format!("{root}/f/00ff")).await, "audit writes a force record");
}

#[tokio::test]
async fn the_arbiter_serves_over_etcd_tls_and_auth() {
    let dir = tempfile::tempdir().unwrap();
    let pki = DevPki::generate(dir.path().join("pki"), TEST_TRUST_DOMAIN).unwrap();
    let root = unique_prefix("etcd-tls");
    let etcd = secured(&pki, &root).await;
    let pw_file = dir.path().join("arbiter.pw");
    std::fs::write(&pw_file, format!("{}\n", pw("lockmesh-arbiter"))).unwrap();
    let idp = Issuer::generate("k").unwrap();
    std::fs::write(dir.path().join("jwks.json"), idp.jwks()).unwrap();
    let arbiter = ArbiterProcess::builder(&pki)
        .etcd_endpoints(etcd.endpoints())
        .root(&root)
        .registry(REGISTRY)
        .etcd_yaml(format!("tls: {{ ca: {:?} }}", pki.ca_cert_path().display().to_string()))
        .etcd_yaml("user: lockmesh-arbiter")
        .etcd_yaml(format!("password_file: {:?}", pw_file.display().to_string()))
        .extra_yaml(crate::admin::operators_yaml(&dir.path().join("jwks.json"), "https://idp"))
        .start()
        .await
        .unwrap();
    let backend = Backend::start().await.unwrap();
    let envoy = EnvoyProcess::builder("lock-tier")
        .cert_dir(pki.dir())
        .upstream_port(backend.port())
        .arbiter_port(arbiter.grpc_port())
        .start()
        .await
        .unwrap();
    let cert = pki.client("payments", "a").unwrap();
    let c =
        LockClient::new(envoy.listener_port(), &pki.ca_cert_path(), Some((&cert.cert_path, &cert.key_path))).unwrap();
    let key = [("x-lock-key", "payments/tls/k")];
    let r = c.post("/v1/locks/acquire", &key).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let tok = r.json["token"].as_str().unwrap().to_owned();
    let r = c.post("/v1/locks/release", &[key[0], ("x-lock-token", &tok)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);

    // A force release approved by two operators, executed by the arbiter as its
    // own etcd user (lockctl holds no etcd credentials at all).
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", "payments/tls/leak")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let tok = |sub: &str| {
        idp.token(&json!({"iss": "https://idp", "aud": "lockmesh-admin", "sub": sub, "exp": now + 600,
            "iat": now - 5, "roles": ["lock-operator"], "amr": ["mfa"]}))
            .unwrap()
    };
    let lockctl = pki.client("lockmesh-system", "lockctl").unwrap();
    let run = |args: &[&str], t: &str| {
        let out = std::process::Command::new(profile_dir().join("lockctl"))
            .arg("admin")
            .args(args)
            .arg("--json")
            .args(["--arbiter", &format!("https://127.0.0.1:{}", arbiter.grpc_port())])
            .arg("--arbiter-ca")
            .arg(pki.ca_cert_path())
            .arg("--cert")
            .arg(&lockctl.cert_path)
            .arg("--key")
            .arg(&lockctl.key_path)
            .env("LOCKMESH_ADMIN_TOKEN", t)
            .output()
            .unwrap();
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("")).unwrap_or_default();
        (out.status.code().unwrap_or(-1), v, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, p, err) = run(&["request", "force-release", "payments/tls/leak", "--reason", "drill"], &tok("alice"));
    assert_eq!(code, 0, "{p} {err}");
    let id = p["request"]["id"].as_str().unwrap().to_owned();
    let digest = p["request"]["action"]["digest"].as_str().unwrap().to_owned();
    let (code, o, err) = run(&["approve", &id], &tok("bob"));
    assert_eq!(code, 0, "{o} {err}");
    assert_eq!(o["outcome"]["released"].as_array().unwrap().len(), 1, "{o}");
    let rev = o["outcome"]["revision"].as_i64().unwrap();

    // One transaction: the hold's delete and the force record at that revision,
    // which the audit decoder (reading as the audit user) calls a force release.
    let mut aud = etcd.client_as("lockmesh-audit", &pw("lockmesh-audit")).await.unwrap();
    let f = aud.get(format!("{root}/f/{digest}"), None).await.unwrap();
    assert_eq!(f.kvs().first().map(|kv| kv.mod_revision()), Some(rev), "force record at the release's revision");
    let opts = WatchOptions::new().with_prefix().with_prev_key().with_start_revision(rev);
    let mut stream = aud.watch(format!("{root}/"), Some(opts)).await.unwrap();
    // The first answer only confirms the watch; the revision's events follow.
    let resp = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            let r = stream.message().await.unwrap().unwrap();
            if !r.events().is_empty() {
                return r;
            }
        }
    })
    .await
    .unwrap();
    let changes: Vec<Change> = resp
        .events()
        .iter()
        .filter_map(|e| {
            let kv = e.kv()?;
            (kv.mod_revision() == rev).then(|| Change {
                op: if e.event_type() == EventType::Delete { Op::Delete } else { Op::Put },
                key: kv.key().to_vec(),
                value: kv.value().to_vec(),
                lease: kv.lease(),
                create_revision: kv.create_revision(),
                prev: e.prev_kv().map(|p| Prev {
                    value: p.value().to_vec(),
                    lease: p.lease(),
                    create_revision: p.create_revision(),
                }),
            })
        })
        .collect();
    let deleted = changes.iter().filter(|c| c.op == Op::Delete && c.key.windows(3).any(|w| w == b"/h/")).count();
    assert_eq!(deleted, 1, "the hold is deleted at the force record's revision: {changes:?}");
    let ctx = Context { root: &root, cluster_id: "00", timeline: 0, epoch: 1, now_ms: 0, closed: &|_: &str| false };
    let events = decode(&ctx, rev, &changes).events;
    let forced: Vec<_> = events.iter().filter(|e| e.kind == EventKind::ForceRelease).collect();
    assert_eq!(forced.len(), 1, "{events:?}");
    assert_eq!(forced[0].digest.as_deref(), Some(digest.as_str()));
    assert_eq!(forced[0].key.as_deref(), Some("payments/tls/leak"));
    let n = aud.get(format!("{root}/l/"), Some(GetOptions::new().with_prefix())).await.unwrap().kvs().len();
    assert_eq!(n, 0, "no hold left");

    // `lockctl shard show` reads the arbiter config's `etcd:` section: a copy naming
    // the read-only lockmesh-admin user reaches the same etcd over TLS.
    let admin_pw = dir.path().join("admin.pw");
    std::fs::write(&admin_pw, format!("{}\n", pw("lockmesh-admin"))).unwrap();
    let cfg = std::fs::read_to_string(arbiter.config_path()).unwrap();
    assert!(cfg.contains("user: lockmesh-arbiter"), "{cfg}");
    let cfg = cfg
        .replace("user: lockmesh-arbiter", "user: lockmesh-admin")
        .replace(&pw_file.display().to_string(), &admin_pw.display().to_string());
    let shard_cfg = arbiter.config_path().with_file_name("lockctl-shard.yaml");
    std::fs::write(&shard_cfg, cfg).unwrap();
    assert_eq!(
        lockmesh_ops::admin::etcd_roles::COMMAND_ROLES.iter().find(|c| c.0 == "shard show").unwrap().1,
        Some("lockmesh-admin")
    );
    let out = std::process::Command::new(profile_dir().join("lockctl"))
        .args(["shard", "show", "--config"])
        .arg(&shard_cfg)
        .output()
        .unwrap();
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "shard show as lockmesh-admin: {so} {se}");
}

/// `lockctl ARGS` against `etcd` as `user` (its password file under `dir`): the
/// endpoints, root and CA as flags, the user and password file through
/// LOCKMESH_ETCD_USER and LOCKMESH_ETCD_PASSWORD_FILE. (exit code, stdout, stderr).
fn lockctl_as(
    etcd: &EtcdCluster,
    pki: &DevPki,
    root: &str,
    dir: &std::path::Path,
    user: &str,
    args: &[&str],
) -> (i32, String, String) {
    let pw_file = dir.join(format!("{user}.pw"));
    std::fs::write(&pw_file, format!("{}\n", pw(user))).unwrap();
    let out = std::process::Command::new(profile_dir().join("lockctl"))
        .args(args)
        .args(["--endpoints", &etcd.endpoints().join(","), "--root", root, "--etcd-ca"])
        .arg(pki.ca_cert_path())
        .env("LOCKMESH_ETCD_USER", user)
        .env("LOCKMESH_ETCD_PASSWORD_FILE", &pw_file)
        .output()
        .unwrap();
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), s(&out.stdout), s(&out.stderr))
}

/// The role `COMMAND_ROLES` names for `cmd`.
fn role_of(cmd: &str) -> &'static str {
    COMMAND_ROLES.iter().find(|(c, _)| *c == cmd).and_then(|(_, r)| *r).unwrap_or_else(|| panic!("no role for {cmd}"))
}

#[tokio::test]
async fn every_lockctl_etcd_command_runs_with_its_own_role_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let pki = DevPki::generate(dir.path().join("pki"), TEST_TRUST_DOMAIN).unwrap();
    let root = unique_prefix("etcd-lockctl");
    let etcd = secured(&pki, &root).await;
    // What an arbiter would have written: the epoch record and a class policy.
    let mut arb = etcd.client_as("lockmesh-arbiter", &pw("lockmesh-arbiter")).await.unwrap();
    arb.put(format!("{root}/sys/epoch"), r#"{"epoch":1,"cluster_id":""}"#, None).await.unwrap();
    let note = ChangeNote { action: "create".into(), actor: "test".into(), at_ms: 1, reason: String::new() };
    let policy = ClassPolicy::new("default", "p1", 4, note).unwrap();
    arb.put(format!("{root}/c/default"), serde_json::to_vec(&policy).unwrap(), None).await.unwrap();
    let run = |cmd: &str, args: &[&str]| lockctl_as(&etcd, &pki, &root, dir.path(), role_of(cmd), args);

    // Read-only views, as lockmesh-admin.
    let (code, out, err) = run("inspect", &["inspect", "payments/x"]);
    assert_eq!(code, 0, "inspect: {out} {err}");
    let (code, out, err) = run("saturated", &["saturated"]);
    assert_eq!(code, 0, "saturated: {out} {err}");
    let (code, out, err) = run("doctor", &["doctor", "--json"]);
    assert!(!out.contains("permission denied") && !err.contains("permission denied"), "doctor: {out} {err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let finding = |check: &str| {
        report["findings"].as_array().into_iter().flatten().find(|f| f["check"] == check).cloned().unwrap_or_default()
    };
    assert_eq!(code, 0, "doctor: {out} {err}");
    assert_eq!(finding("etcd.quorum")["status"], "ok", "doctor: {out} {err}");
    assert_eq!(finding("seal.epoch")["status"], "ok", "doctor ({code}): {out} {err}");
    let (code, out, err) = run("limit show", &["limit", "show", "--class", "default"]);
    assert_eq!(code, 0, "limit show: {out} {err}");
    assert!(out.contains("\"limit\":4"), "{out}");

    // The operators' changes, as lockmesh-classes; the read-only role is refused.
    // class apply first: a lowering verifies against the authoritative prefix map.
    let reg = dir.path().join("registry.yaml");
    std::fs::write(
        &reg,
        format!(
            "{REGISTRY}  - {{ name: solo, prefixes: [\"payments/solo\"], ttl_s: 15, enforcement: advisory, risk_owner: t, \
             waiver_expiry: \"2099-12-31\" }}\n"
        ),
    )
    .unwrap();
    let reg_s = reg.display().to_string();
    let (code, out, err) = run("class apply", &["class", "apply", &reg_s, "--reason", "drill"]);
    assert_eq!(code, 0, "class apply: {out} {err}");
    let mut adm = etcd.client_as("lockmesh-admin", &pw("lockmesh-admin")).await.unwrap();
    let map = adm.get(format!("{root}/sys/classmap"), None).await.unwrap();
    assert_eq!(map.kvs().len(), 1, "class apply wrote the prefix map: {out}");
    let (code, out, err) = lockctl_as(
        &etcd,
        &pki,
        &root,
        dir.path(),
        "lockmesh-admin",
        &["limit", "change", "--class", "default", "--to", "2"],
    );
    assert_eq!(code, 1, "limit change as lockmesh-admin: {out} {err}");
    assert!(err.contains("permission denied"), "the refusal reaches the operator: {err}");
    let change = &["limit", "change", "--class", "default", "--to", "2", "--reason", "drill"];
    let (code, out, err) = run("limit change|resume|cancel", change);
    assert_eq!(code, 0, "limit change: {out} {err}");
    assert!(out.contains("\"outcome\":\"activated\""), "{out}");
    // Nothing is pending now: cancel reaches the record and the protocol refuses (3).
    let cancel = &["limit", "cancel", "--class", "default", "--epoch", "1", "--to", "2"];
    let (code, out, err) = run("limit change|resume|cancel", cancel);
    assert_eq!(code, 3, "limit cancel: {out} {err}");

    // The break-glass epoch advance, as lockmesh-admin-epoch; lockmesh-admin is refused.
    let advance = &["epoch-advance", "--expected-epoch", "1", "--new-epoch", "2"];
    let (code, out, err) = lockctl_as(&etcd, &pki, &root, dir.path(), "lockmesh-admin", advance);
    assert_ne!(code, 0, "epoch-advance as lockmesh-admin: {out} {err}");
    assert!(err.contains("permission denied"), "{out} {err}");
    let (code, out, err) = run("epoch-advance", advance);
    assert_eq!(code, 0, "epoch-advance: {out} {err}");
    let rec = adm.get(format!("{root}/sys/epoch"), None).await.unwrap();
    let rec: serde_json::Value = serde_json::from_slice(rec.kvs()[0].value()).unwrap();
    assert_eq!((rec["epoch"].as_u64(), rec.get("sealed")), (Some(2), None), "{rec}");
}

/// etcd refuses each call of a client whose login predates a change of its users
/// or roles (`revision of auth store is old`), before applying anything; every
/// `Stack` on a shared etcd adds users. The arbiter logs in again and runs the
/// refused request once more: after each change, the next acquire, inspection
/// and release are answered as if nothing happened (before the fix each first
/// request after a change answered 503 `unavailable`).
#[tokio::test]
async fn a_user_change_under_the_arbiters_login_costs_callers_nothing() {
    const ACQ: &str = "/v1/locks/acquire";
    let st = Stack::builder("auth-change").envoy_config("lock-tier").own_etcd(1).secure_etcd().start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let warm = a.post(ACQ, &[("x-lock-key", "payments/warm")]).await.unwrap();
    assert_eq!(warm.code(), 200, "{}", warm.body);
    let mut root = st.etcd().client().await.unwrap();
    let mut n = 0;
    let mut change = async || {
        n += 1;
        root.user_add(format!("bystander-{n}"), "bystander-password", None).await.unwrap();
    };
    for round in 0..3 {
        let key = format!("payments/after-change-{round}");
        change().await;
        let r = a.post(ACQ, &[("x-lock-key", &key)]).await.unwrap();
        assert_eq!(r.code(), 200, "acquire after a user change: {}", r.body);
        let token = r.json["token"].as_str().unwrap().to_owned();
        change().await;
        let h = a.get("/v1/locks", &[("x-lock-key", &key)]).await.unwrap();
        assert_eq!(h.code(), 200, "inspection after a user change: {}", h.body);
        change().await;
        let rel = a.post("/v1/locks/release", &[("x-lock-key", &key), ("x-lock-token", &token)]).await.unwrap();
        assert_eq!(rel.code(), 200, "release after a user change: {}", rel.body);
    }
}

/// An arbiter whose etcd role lacks `sys/clock` (roles applied before the grant
/// clock) serves with the clock off and says why in `/status`; once the role has
/// the grant again the clock is back on within seconds, with no restart, and
/// grants move its mark.
#[tokio::test]
async fn a_role_without_the_grant_clock_serves_says_so_and_recovers_once_granted() {
    const ACQ: &str = "/v1/locks/acquire";
    let st = Stack::builder("clock-role").envoy_config("lock-tier").own_etcd(1).secure_etcd().start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    let status = async || -> anyhow::Result<serde_json::Value> {
        let (_, body) = st.arbiter(0).admin_get("/status").await?;
        Ok(serde_json::from_str(&body)?)
    };
    let r = a.post(ACQ, &[("x-lock-key", "payments/clock-0")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    assert!(status().await.unwrap()["marks"]["clock_off"].is_null());
    let role = st.etcd_users().user("lockmesh-arbiter");
    let clock = format!("{}/sys/clock", st.root());
    let mut root = st.etcd().client().await.unwrap();
    root.role_revoke_permission(role.as_str(), clock.as_str(), None).await.unwrap();
    lockmesh_tests::eventually(std::time::Duration::from_secs(10), async || {
        let s = status().await?;
        let off = s["marks"]["clock_off"].as_str().unwrap_or_default().to_owned();
        anyhow::ensure!(off.contains("sys/clock"), "clock not off: {s}");
        Ok(())
    })
    .await;
    for i in 1..4 {
        let r = a.post(ACQ, &[("x-lock-key", &format!("payments/clock-{i}"))]).await.unwrap();
        assert_eq!(r.code(), 200, "with the clock off: {}", r.body);
    }
    let before = status().await.unwrap()["marks"]["clock"].as_i64().unwrap();
    root.role_grant_permission(role.as_str(), Permission::read_write(clock.as_str())).await.unwrap();
    lockmesh_tests::eventually(std::time::Duration::from_secs(10), async || {
        let s = status().await?;
        anyhow::ensure!(s["marks"]["clock_off"].is_null(), "clock still off: {s}");
        Ok(())
    })
    .await;
    let r = a.post(ACQ, &[("x-lock-key", "payments/clock-after")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    lockmesh_tests::eventually(std::time::Duration::from_secs(5), async || {
        let s = status().await?;
        anyhow::ensure!(s["marks"]["clock"].as_i64().unwrap_or(0) > before, "clock mark not moved: {s}");
        Ok(())
    })
    .await;
}
