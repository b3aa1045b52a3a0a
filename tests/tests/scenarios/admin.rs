//! Issue 9: two-person admin actions through the real `lockctl admin` against a
//! live stack (etcd, arbiter, Envoy). `lockctl` carries each operator's token to
//! the arbiter over mTLS (its admin client certificate) and the arbiter verifies
//! and executes: force release and epoch advance refuse one operator, the same
//! operator twice, bad, expired or stale tokens, a caller certificate that is not
//! an admin client and a missing reason, and succeed with two operators plus a
//! reason, leaving records.

use std::{path::Path, process::Command, time::Duration};

use etcd_client::GetOptions;
use lockmesh_devcerts::jwt::Issuer;
use lockmesh_tests::{eventually, paths::profile_dir, ClientCert, Stack, TEST_TRUST_DOMAIN};
use serde_json::{json, Value};

const ACQ: &str = "/v1/locks/acquire";
pub(crate) const ISS: &str = "https://idp.admin.test";

const REGISTRY: &str = r#"platform: { min_ttl_s: 2, advisory_min_ttl_s: 2, lowered_floors_reason: "test registry: short TTLs" }
classes:
  - { name: default, default: true, ttl_s: 15, enforcement: advisory, risk_owner: t, waiver_expiry: "2099-12-31" }
"#;

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

/// A token for `sub` with the operator role, signed in a minute ago and expiring
/// `exp_in` seconds from now.
pub(crate) fn token(idp: &Issuer, sub: &str, exp_in: i64) -> String {
    let exp = (now_s() as i64 + exp_in) as u64;
    idp.token(&json!({"iss": ISS, "aud": "lockmesh-admin", "sub": sub, "exp": exp, "iat": now_s() - 60,
        "realm_access": {"roles": ["lock-operator"]}, "amr": ["pwd", "otp"]}))
        .unwrap()
}

/// The arbiter's `operators` section: lockctl's certificate is the admin client.
pub fn operators_yaml(jwks: &Path, issuer: &str) -> String {
    format!(
        "operators: {{ allowed_clients: [\"spiffe://{TEST_TRUST_DOMAIN}/ns/lockmesh-system/sa/lockctl\"], \
         jwks_file: {:?}, issuer: {issuer:?}, max_token_age_s: 900 }}",
        jwks.display().to_string()
    )
}

pub(crate) struct Admin<'a> {
    st: &'a Stack,
    cert: ClientCert,
}

impl Admin<'_> {
    pub(crate) fn new(st: &Stack) -> Admin<'_> {
        Admin { st, cert: st.pki().client("lockmesh-system", "lockctl").unwrap() }
    }

    /// `lockctl admin <args> --json` with `tok` in LOCKMESH_ADMIN_TOKEN: (exit code, JSON).
    pub(crate) fn run(&self, args: &[&str], tok: Option<&str>) -> (i32, Value) {
        self.run_as(&self.cert, args, tok)
    }

    /// [`Admin::run`] with another client certificate.
    fn run_as(&self, cert: &ClientCert, args: &[&str], tok: Option<&str>) -> (i32, Value) {
        let mut c = Command::new(profile_dir().join("lockctl"));
        c.arg("admin").args(args).arg("--json");
        c.arg("--arbiter").arg(format!("https://127.0.0.1:{}", self.st.arbiter(0).grpc_port()));
        c.arg("--arbiter-ca").arg(self.st.pki().ca_cert_path());
        c.arg("--cert").arg(&cert.cert_path).arg("--key").arg(&cert.key_path);
        match tok {
            Some(t) => c.env("LOCKMESH_ADMIN_TOKEN", t),
            None => c.env_remove("LOCKMESH_ADMIN_TOKEN"),
        };
        let out = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // A token never appears in what lockctl prints.
        if let Some(t) = tok {
            assert!(!stdout.contains(t) && !stderr.contains(t), "token echoed: {stdout} {stderr}");
        }
        let json = serde_json::from_str(stdout.lines().last().unwrap_or("")).unwrap_or(Value::Null);
        (out.status.code().unwrap_or(-1), json)
    }
}

async fn setup(name: &str, dir: &Path) -> (Stack, Issuer) {
    let idp = Issuer::generate("k1").unwrap();
    std::fs::write(dir.join("jwks.json"), idp.jwks()).unwrap();
    let st = Stack::builder(name)
        .envoy_config("lock-tier")
        .registry(REGISTRY)
        .arbiter_extra_yaml(operators_yaml(&dir.join("jwks.json"), ISS))
        .start()
        .await
        .unwrap();
    (st, idp)
}

async fn count(st: &Stack, prefix: &str) -> usize {
    let mut etcd = st.etcd().client().await.unwrap();
    let r = etcd.get(format!("{}/{prefix}", st.root()), Some(GetOptions::new().with_prefix())).await.unwrap();
    r.kvs().len()
}

#[tokio::test]
async fn force_release_needs_two_operators_and_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (st, idp) = setup("admin-force", dir.path()).await;
    let adm = Admin::new(&st);
    let c = st.client("payments", "holder").unwrap();
    let r = c.post(ACQ, &[("x-lock-key", "payments/admin/leaked")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let session = r.json["session"].as_str().map(str::to_owned);
    let (alice, bob) = (token(&idp, "alice", 600), token(&idp, "bob", 600));
    let key = "payments/admin/leaked";

    // Refusals before anything is requested: no reason, expired, forged, no role.
    let (code, j) = adm.run(&["request", "force-release", key], Some(&alice));
    assert_eq!((code, j["error"].as_str()), (65, Some("admin.reason_missing")), "{j}");
    let (code, j) = adm.run(&["request", "force-release", key, "--reason", "leak"], Some(&token(&idp, "alice", -600)));
    assert_eq!((code, j["error"].as_str()), (77, Some("admin.token_expired")), "{j}");
    let forged = token(&Issuer::generate("k1").unwrap(), "alice", 600);
    let (code, j) = adm.run(&["request", "force-release", key, "--reason", "leak"], Some(&forged));
    assert_eq!((code, j["error"].as_str()), (77, Some("admin.token_invalid")), "{j}");
    let no_role = idp
        .token(&json!({"iss": ISS, "aud": "lockmesh-admin", "sub": "eve", "exp": now_s() + 600, "iat": now_s()}))
        .unwrap();
    let (code, j) = adm.run(&["request", "force-release", key, "--reason", "leak"], Some(&no_role));
    assert_eq!((code, j["error"].as_str()), (77, Some("admin.role_missing")), "{j}");
    // Freshness: a valid token whose sign-in is older than max_token_age_s.
    let stale = idp
        .token(&json!({"iss": ISS, "aud": "lockmesh-admin", "sub": "alice", "exp": now_s() + 600,
            "iat": now_s() - 3600, "roles": ["lock-operator"]}))
        .unwrap();
    let (code, j) = adm.run(&["request", "force-release", key, "--reason", "leak"], Some(&stale));
    assert_eq!((code, j["error"].as_str()), (77, Some("admin.token_stale")), "{j}");
    // A valid operator through a certificate that is not an admin client (the
    // holder's workload, the lock-tier Envoy): refused before the token, unrecorded.
    let workload = st.pki().client("payments", "holder").unwrap();
    for cert in [&workload, &st.pki().envoy_client()] {
        let (code, j) = adm.run_as(cert, &["request", "force-release", key, "--reason", "leak"], Some(&alice));
        assert_eq!((code, j["error"].as_str()), (77, Some("admin.client_denied")), "{j}");
    }
    assert_eq!(count(&st, "adm/req/").await, 0);

    // One operator: a pending request that shows the holder and the posture, and releases nothing.
    let reason = "holder wedged since the 02:00 deploy, INC-42";
    let (code, p) = adm.run(&["request", "force-release", key, "--reason", reason, "--revoke-session"], Some(&alice));
    assert_eq!(code, 0, "{p}");
    let id = p["request"]["id"].as_str().unwrap().to_owned();
    assert_eq!(p["request"]["state"], "pending");
    assert_eq!((p["enforcement"].as_str(), p["holds"].as_array().unwrap().len()), (Some("advisory"), 1), "{p}");
    assert!(p["holds"][0]["owner"].as_str().unwrap().contains("holder"), "{p}");
    assert!(p["warning"].as_str().unwrap().contains("ADVISORY"), "{p}");
    assert!(!p.to_string().contains(key), "the raw key is not in the request: {p}");
    assert_eq!(count(&st, "l/").await, 1, "a request alone releases nothing");

    // The same operator cannot approve.
    let (code, j) = adm.run(&["approve", &id], Some(&alice));
    assert_eq!((code, j["error"].as_str()), (77, Some("admin.same_operator")), "{j}");
    assert_eq!(count(&st, "l/").await, 1);

    // A second operator executes: hold deleted, force record and request state written at one revision.
    let (code, o) = adm.run(&["approve", &id], Some(&bob));
    assert_eq!(code, 0, "{o}");
    let rev = o["outcome"]["revision"].as_i64().unwrap();
    assert_eq!(
        (o["outcome"]["released"].as_array().unwrap().len(), o["outcome"]["sessions_revoked"].as_u64()),
        (1, Some(1)),
        "{o}"
    );
    assert_eq!(count(&st, "l/").await, 0);
    let mut etcd = st.etcd().client().await.unwrap();
    let f = etcd.get(format!("{}/f/", st.root()), Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(f.kvs().len(), 1);
    assert_eq!(f.kvs()[0].mod_revision(), rev, "force record and delete in one transaction");
    let rec: Value = serde_json::from_slice(f.kvs()[0].value()).unwrap();
    assert_eq!((rec["requester"]["sub"].as_str(), rec["approver"]["sub"].as_str()), (Some("alice"), Some("bob")));
    // Retention: the record rides on a lease of operators.force_record_retention_s
    // (default 30 days); the audit tailer archived it when it was written.
    let lease = f.kvs()[0].lease();
    assert_ne!(lease, 0, "the force record has no retention lease");
    let ttl = etcd.lease_time_to_live(lease, None).await.unwrap().ttl();
    assert!((30 * 86_400 - 120..=30 * 86_400).contains(&ttl), "retention lease TTL {ttl} s");
    assert_eq!((rec["reason"].as_str(), rec["enforcement"].as_str()), (Some(reason), Some("advisory")));
    let req = etcd.get(format!("{}/adm/req/{id}", st.root()), None).await.unwrap();
    assert_eq!(req.kvs()[0].mod_revision(), rev);
    // The holder's session was revoked: its keepalive fails.
    if let Some(s) = session {
        eventually(Duration::from_secs(5), async || {
            let k = c.post("/v1/sessions/keepalive", &[("x-lock-session", &s)]).await?;
            anyhow::ensure!(k.code() == 410, "keepalive {}: {}", k.code(), k.body);
            Ok(())
        })
        .await;
    }

    // Approving twice is refused; the key is free for a new holder.
    let (code, j) = adm.run(&["approve", &id], Some(&bob));
    assert_eq!((code, j["error"].as_str()), (65, Some("admin.request_not_pending")), "{j}");
    let r = c.post(ACQ, &[("x-lock-key", key)]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);

    // Every action left a record.
    let (code, l) = adm.run(&["list"], None);
    assert_eq!(code, 0, "{l}");
    let outcomes: Vec<(String, String)> = l["log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["step"].as_str().unwrap().to_owned(), e["outcome"].as_str().unwrap().to_owned()))
        .collect();
    let want = [
        ("request", "admin.reason_missing"),
        ("request", "admin.token_expired"),
        ("request", "admin.token_invalid"),
        ("request", "admin.role_missing"),
        ("request", "admin.token_stale"),
        ("request", "ok"),
        ("approve", "admin.same_operator"),
        ("approve", "ok"),
        ("approve", "admin.request_not_pending"),
    ];
    let want: Vec<(String, String)> = want.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
    assert_eq!(outcomes, want);

    // MFA is required by default: a valid operator token without an MFA sign-in is refused.
    let no_mfa = idp
        .token(&json!({"iss": ISS, "aud": "lockmesh-admin", "sub": "alice", "exp": now_s() + 600,
            "iat": now_s(), "roles": ["lock-operator"], "amr": ["pwd"]}))
        .unwrap();
    let (code, j) = adm.run(&["request", "force-release", key, "--reason", "leak"], Some(&no_mfa));
    assert_eq!((code, j["error"].as_str()), (77, Some("admin.mfa_missing")), "{j}");
}

#[tokio::test]
async fn epoch_advance_needs_two_operators() {
    let dir = tempfile::tempdir().unwrap();
    let (st, idp) = setup("admin-epoch", dir.path()).await;
    let adm = Admin::new(&st);
    let c = st.client("payments", "a").unwrap();
    let r = c.post(ACQ, &[("x-lock-key", "payments/admin/e1")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let t0: u64 = r.json["token"].as_str().unwrap().parse().unwrap();
    let e = t0 >> 48;
    let (alice, bob) = (token(&idp, "alice", 600), token(&idp, "bob", 600));
    let (es, ns) = (e.to_string(), (e + 1).to_string());
    let args = ["request", "epoch-advance", "--expected-epoch", &es, "--new-epoch", &ns];
    let (code, j) = adm.run(&args, Some(&alice));
    assert_eq!((code, j["error"].as_str()), (65, Some("admin.reason_missing")), "{j}");
    let mut with_reason = args.to_vec();
    with_reason.extend(["--reason", "restore drill"]);
    let (code, p) = adm.run(&with_reason, Some(&alice));
    assert_eq!(code, 0, "{p}");
    let id = p["request"]["id"].as_str().unwrap().to_owned();
    let (code, j) = adm.run(&["approve", &id], Some(&alice));
    assert_eq!((code, j["error"].as_str()), (77, Some("admin.same_operator")), "{j}");
    let mut etcd = st.etcd().client().await.unwrap();
    let rec = |v: &[u8]| serde_json::from_slice::<Value>(v).unwrap();
    let epoch = etcd.get(format!("{}/sys/epoch", st.root()), None).await.unwrap();
    assert_eq!(rec(epoch.kvs()[0].value())["epoch"].as_u64(), Some(e), "one operator changes nothing");
    let (code, o) = adm.run(&["approve", &id], Some(&bob));
    assert_eq!(code, 0, "{o}");
    let epoch = etcd.get(format!("{}/sys/epoch", st.root()), None).await.unwrap();
    let v = rec(epoch.kvs()[0].value());
    assert_eq!((v["epoch"].as_u64(), v.get("sealed").filter(|s| !s.is_null())), (Some(e + 1), None), "{v}");
    // New grants are in the new epoch.
    let t1 = eventually(Duration::from_secs(10), async || {
        let r = c.post(ACQ, &[("x-lock-key", "payments/admin/e2")]).await?;
        anyhow::ensure!(r.code() == 200, "{}", r.body);
        Ok(r.json["token"].as_str().unwrap_or_default().parse::<u64>()?)
    })
    .await;
    assert_eq!(t1 >> 48, e + 1);
    let (code, j) = adm.run(&["approve", &id], Some(&bob));
    assert_eq!((code, j["error"].as_str()), (65, Some("admin.request_not_pending")), "{j}");
}
