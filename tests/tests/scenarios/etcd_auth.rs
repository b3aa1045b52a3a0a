//! Issue 9 (ADR-05, ADR-20): etcd with client TLS and auth on, one role per
//! component (`lockmesh_extproc::admin_action::etcd_roles`, the definitions
//! `lockctl etcd-roles` prints). Each role is refused a write outside its job, and
//! the arbiter serves a lock cycle through Envoy over that etcd, logged in as its
//! own user; a force release runs as the admin user.

use std::path::Path;

use etcd_client::{Client, GetOptions, Permission};
use lockmesh_extproc::admin_action::{
    etcd_roles::{roles, Perm},
    jwt::mint::Issuer,
};
use lockmesh_tests::{
    etcd::EtcdTls, paths::profile_dir, unique_prefix, ArbiterProcess, Backend, DevPki, EnvoyProcess, EtcdCluster,
    LockClient, TEST_TRUST_DOMAIN,
};
use serde_json::json;

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2 }
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
    // The arbiter: holds yes; force records, admin requests, the audit election no.
    let mut arb = as_("lockmesh-arbiter").await.unwrap();
    put(&mut arb, hold.clone()).await.unwrap();
    put(&mut arb, format!("{root}/sys/epoch")).await.unwrap();
    denied(put(&mut arb, format!("{root}/f/00ff")).await, "arbiter writes a force record");
    denied(put(&mut arb, format!("{root}/adm/req/1")).await, "arbiter writes an admin request");
    denied(put(&mut arb, format!("{root}/sys/audit-leader")).await, "arbiter takes the audit election");
    denied(put(&mut arb, "/elsewhere/k".into()).await, "arbiter writes outside its root");
    // The admin: delete holds and write force records; no session, epoch or class policy.
    let mut adm = as_("lockmesh-admin").await.unwrap();
    let n = adm.get(format!("{root}/l/"), Some(GetOptions::new().with_prefix())).await.unwrap().kvs().len();
    assert_eq!(n, 1);
    put(&mut adm, format!("{root}/f/00ff")).await.unwrap();
    adm.delete(hold.clone(), None).await.unwrap();
    denied(put(&mut adm, format!("{root}/s/00000000000000ff")).await, "admin puts a session");
    denied(put(&mut adm, format!("{root}/sys/epoch")).await, "admin puts the epoch record");
    denied(put(&mut adm, format!("{root}/c/default")).await, "admin puts a class policy");
    denied(put(&mut adm, format!("{root}/r/00ff")).await, "admin puts a release marker");
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
    let arbiter = ArbiterProcess::builder(&pki)
        .etcd_endpoints(etcd.endpoints())
        .root(&root)
        .registry(REGISTRY)
        .etcd_yaml(format!("tls: {{ ca: {:?} }}", pki.ca_cert_path().display().to_string()))
        .etcd_yaml("user: lockmesh-arbiter")
        .etcd_yaml(format!("password_file: {:?}", pw_file.display().to_string()))
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

    // A force release as the admin user (TLS + password), two operators.
    let r = c.post("/v1/locks/acquire", &[("x-lock-key", "payments/tls/leak")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let idp = Issuer::generate("k").unwrap();
    std::fs::write(dir.path().join("jwks.json"), idp.jwks()).unwrap();
    let adm_pw = dir.path().join("admin.pw");
    std::fs::write(&adm_pw, pw("lockmesh-admin")).unwrap();
    let exp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 600;
    let tok = |sub: &str| {
        idp.token(
            &json!({"iss": "https://idp", "aud": "lockmesh-admin", "sub": sub, "exp": exp, "roles": ["lock-operator"]}),
        )
        .unwrap()
    };
    let run = |args: &[&str], t: &str, pwf: &Path| {
        let out = std::process::Command::new(profile_dir().join("lockctl"))
            .arg("admin")
            .args(args)
            .args(["--json", "--root", &root, "--endpoints", &etcd.endpoints().join(",")])
            .args(["--etcd-user", "lockmesh-admin", "--etcd-ca", &pki.ca_cert_path().display().to_string()])
            .arg("--etcd-password-file")
            .arg(pwf)
            .env("LOCKMESH_ADMIN_JWKS", dir.path().join("jwks.json"))
            .env("LOCKMESH_ADMIN_ISSUER", "https://idp")
            .env("LOCKMESH_ADMIN_TOKEN", t)
            .output()
            .unwrap();
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("")).unwrap_or_default();
        (out.status.code().unwrap_or(-1), v, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, p, err) =
        run(&["request", "force-release", "payments/tls/leak", "--reason", "drill"], &tok("alice"), &adm_pw);
    assert_eq!(code, 0, "{p} {err}");
    let id = p["request"]["id"].as_str().unwrap().to_owned();
    let (code, o, err) = run(&["approve", &id], &tok("bob"), &adm_pw);
    assert_eq!(code, 0, "{o} {err}");
    assert_eq!(o["outcome"]["released"].as_array().unwrap().len(), 1, "{o}");
    // A wrong etcd password is refused by etcd.
    let bad = dir.path().join("bad.pw");
    std::fs::write(&bad, "nope").unwrap();
    let (code, _, err) = run(&["list"], &tok("bob"), &bad);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("admin.unavailable"), "{err}");
}
