//! `lockctl admin`: request, show, approve and list two-person admin actions
//! (`docs/ADMIN.md`).

use std::{io::Write, path::PathBuf, process::ExitCode};

use clap::{Args, Subcommand};
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use lockmesh_core::ClassRegistry;
use serde_json::json;

use super::{
    flow::{self, Action},
    io,
    jwt::{Jwks, Operator, Verifier},
    AdminError,
};

/// How to reach etcd (shared by the admin commands).
#[derive(Args, Debug, Clone)]
pub struct EtcdArgs {
    /// etcd client URLs, comma separated (required).
    #[arg(long, value_delimiter = ',', global = true, env = "LOCKMESH_ETCD_ENDPOINTS")]
    pub endpoints: Vec<String>,
    /// lockmesh key root.
    #[arg(long, global = true, default_value = "/lockmesh")]
    pub root: String,
    /// etcd user (auth enabled); the password comes from --etcd-password-file.
    #[arg(long, global = true, env = "LOCKMESH_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long, global = true, env = "LOCKMESH_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// CA bundle (PEM) that signed etcd's server certificate; turns TLS on.
    #[arg(long, global = true)]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's client-cert auth.
    #[arg(long, global = true, requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// Client key (PEM).
    #[arg(long, global = true, requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
}

/// How operators' tokens are verified.
#[derive(Args, Debug, Clone)]
pub struct IdentityArgs {
    /// The identity provider's JWKS (a JSON file, e.g. saved from its jwks_uri).
    #[arg(long, env = "LOCKMESH_ADMIN_JWKS")]
    pub jwks: PathBuf,
    /// Required `iss`.
    #[arg(long, env = "LOCKMESH_ADMIN_ISSUER")]
    pub issuer: String,
    /// Required `aud`.
    #[arg(long, env = "LOCKMESH_ADMIN_AUDIENCE", default_value = "lockmesh-admin")]
    pub audience: String,
    /// Required role (in `roles` or Keycloak's `realm_access.roles`); "" for none.
    #[arg(long, env = "LOCKMESH_ADMIN_ROLE", default_value = "lock-operator")]
    pub role: String,
    /// Require an MFA sign-in (`amr`).
    #[arg(long)]
    pub require_mfa: bool,
    /// The operator's token (prefer the environment variable: argv is visible to others).
    #[arg(long, env = "LOCKMESH_ADMIN_TOKEN", hide_env_values = true)]
    pub token: String,
}

/// `lockctl admin ...`.
#[derive(Args, Debug)]
pub struct AdminArgs {
    #[command(subcommand)]
    cmd: AdminCmd,
    #[command(flatten)]
    etcd: EtcdArgs,
    /// Class registry, to show whether the key's class is fenced.
    #[arg(long, global = true)]
    registry: Option<PathBuf>,
    /// JSON output.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum AdminCmd {
    /// Ask for an action; a different operator must approve it.
    #[command(subcommand)]
    Request(RequestCmd),
    /// Approve (and execute) a pending request as a different operator.
    Approve {
        /// The request id.
        id: String,
        #[command(flatten)]
        identity: IdentityArgs,
    },
    /// Show a request with what approving it would do (holds, fenced or not).
    Show {
        /// The request id.
        id: String,
    },
    /// List requests and the action log.
    List,
}

#[derive(Subcommand, Debug)]
enum RequestCmd {
    /// Release every hold of KEY (deleting the holds and writing a force record in one transaction).
    ForceRelease {
        /// The lock key.
        key: String,
        /// Why (required).
        #[arg(long, default_value = "")]
        reason: String,
        /// Also revoke each holder's session (all its other locks go too).
        #[arg(long)]
        revoke_session: bool,
        /// Approval window, seconds.
        #[arg(long, default_value_t = 3600)]
        ttl_s: u64,
        #[command(flatten)]
        identity: IdentityArgs,
    },
    /// Advance the epoch (docs/OPERATIONS.md) from --expected-epoch to --new-epoch.
    EpochAdvance {
        /// The epoch you believe is current.
        #[arg(long)]
        expected_epoch: u64,
        /// The new epoch.
        #[arg(long)]
        new_epoch: u64,
        /// Why (required).
        #[arg(long, default_value = "")]
        reason: String,
        /// Approval window, seconds.
        #[arg(long, default_value_t = 3600)]
        ttl_s: u64,
        #[command(flatten)]
        identity: IdentityArgs,
    },
}

fn read(p: &std::path::Path) -> Result<Vec<u8>, AdminError> {
    std::fs::read(p).map_err(|e| io(format!("{}: {e}", p.display())))
}

/// Connects to etcd with the TLS and user options given.
pub async fn connect(a: &EtcdArgs) -> Result<Client, AdminError> {
    if a.endpoints.is_empty() {
        return Err(io("--endpoints: required (or LOCKMESH_ETCD_ENDPOINTS)"));
    }
    let mut opts = ConnectOptions::new();
    if let Some(user) = &a.etcd_user {
        let file =
            a.etcd_password_file.as_ref().ok_or_else(|| io("--etcd-password-file: required with --etcd-user"))?;
        let pw = String::from_utf8(read(file)?).map_err(|_| io("--etcd-password-file: not UTF-8"))?;
        opts = opts.with_user(user.clone(), pw.trim_end().to_owned());
    }
    if let Some(ca) = &a.etcd_ca {
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?));
        if let (Some(c), Some(k)) = (&a.etcd_cert, &a.etcd_key) {
            tls = tls.identity(Identity::from_pem(read(c)?, read(k)?));
        }
        opts = opts.with_tls(tls);
    }
    Client::connect(&a.endpoints, Some(opts)).await.map_err(io)
}

fn verify(i: &IdentityArgs) -> Result<Operator, AdminError> {
    let text = String::from_utf8(read(&i.jwks)?).map_err(|_| AdminError::Jwks("not UTF-8".into()))?;
    let v = Verifier::new(Jwks::parse(&text)?, i.issuer.clone(), i.audience.clone())
        .with_role(Some(i.role.clone()))
        .with_mfa(i.require_mfa);
    v.verify(&i.token, crate::lock::now_ms() / 1000)
}

fn registry(p: &Option<PathBuf>) -> Result<Option<ClassRegistry>, AdminError> {
    match p {
        None => Ok(None),
        Some(p) => crate::registry::load(p)
            .map(Some)
            .map_err(|errs| io(format!("--registry {}: {}", p.display(), errs.join("; ")))),
    }
}

fn print_preview(out: &mut impl Write, p: &flow::Preview) {
    let r = &p.request;
    let _ = writeln!(out, "request {} ({:?}) by {} : {:?}", r.id, r.state, r.requester.sub, r.action);
    let _ = writeln!(out, "  reason: {}", r.reason);
    for h in &p.holds {
        let _ = writeln!(
            out,
            "  hold slot {} owner {} class {} session {} grant revision {} age {} ms",
            h.slot,
            h.owner,
            h.class,
            h.session.as_deref().unwrap_or("-"),
            h.grant_revision,
            h.age_ms
        );
    }
    if matches!(r.action, Action::ForceRelease { .. }) {
        let _ = writeln!(out, "  class posture: {}", p.enforcement);
    }
    if let Some(w) = &p.warning {
        let _ = writeln!(out, "  WARNING: {w}");
    }
}

/// Runs `lockctl admin`. Exit codes: 0 done, 65 refused request, 77 identity
/// refused (bad, expired or same operator), 1 etcd or file trouble.
pub async fn main(a: &AdminArgs) -> ExitCode {
    let mut out = std::io::stdout();
    let (step, id) = match &a.cmd {
        AdminCmd::Request(_) => ("request", None),
        AdminCmd::Approve { id, .. } => ("approve", Some(id.as_str())),
        AdminCmd::Show { id } => ("show", Some(id.as_str())),
        AdminCmd::List => ("list", None),
    };
    let mut client = match connect(&a.etcd).await {
        Ok(c) => c,
        Err(e) => return fail(a.json, &e),
    };
    let mut who = None;
    let res = run(a, &mut client, &mut who, &mut out).await;
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if matches!(step, "request" | "approve") {
                flow::log_refusal(&mut client, &a.etcd.root, step, id, who.as_ref(), &e).await;
            }
            fail(a.json, &e)
        }
    }
}

fn fail(json: bool, e: &AdminError) -> ExitCode {
    if json {
        println!("{}", json!({"error": e.code(), "message": e.to_string()}));
    }
    eprintln!("lockctl admin: refused [{}]: {e}", e.code());
    ExitCode::from(e.exit_code())
}

async fn run(
    a: &AdminArgs,
    client: &mut Client,
    who: &mut Option<Operator>,
    out: &mut impl Write,
) -> Result<(), AdminError> {
    let root = a.etcd.root.as_str();
    let reg = registry(&a.registry)?;
    let emit = |out: &mut dyn Write, v: serde_json::Value| {
        let _ = writeln!(out, "{v}");
    };
    match &a.cmd {
        AdminCmd::Request(r) => {
            let (action, reason, ttl_s, identity) = match r {
                RequestCmd::ForceRelease { key, reason, revoke_session, ttl_s, identity } => {
                    let d = flow::digest_of(key)?;
                    (
                        Action::ForceRelease { digest: d.to_string(), revoke_session: *revoke_session },
                        reason,
                        ttl_s,
                        identity,
                    )
                }
                RequestCmd::EpochAdvance { expected_epoch, new_epoch, reason, ttl_s, identity } => (
                    Action::EpochAdvance { expected_epoch: *expected_epoch, new_epoch: *new_epoch },
                    reason,
                    ttl_s,
                    identity,
                ),
            };
            let op = verify(identity)?;
            *who = Some(op.clone());
            let req = flow::request(client, root, action, reason, &op, *ttl_s).await?;
            let p = flow::preview(client, root, &req.id, reg.as_ref()).await?;
            if a.json {
                emit(out, serde_json::to_value(&p).map_err(io)?);
            } else {
                let _ = writeln!(
                    out,
                    "requested {}: a different operator must run `lockctl admin approve {}`",
                    req.id, req.id
                );
                print_preview(out, &p);
            }
        }
        AdminCmd::Show { id } => {
            let p = flow::preview(client, root, id, reg.as_ref()).await?;
            if a.json {
                emit(out, serde_json::to_value(&p).map_err(io)?);
            } else {
                print_preview(out, &p);
            }
        }
        AdminCmd::Approve { id, identity } => {
            let op = verify(identity)?;
            *who = Some(op.clone());
            // What the approver approves: shown before it executes.
            let p = flow::preview(client, root, id, reg.as_ref()).await?;
            if !a.json {
                print_preview(out, &p);
            }
            let o = flow::approve(client, root, id, &op, reg.as_ref()).await?;
            if a.json {
                emit(out, json!({"preview": p, "outcome": o}));
            } else {
                let _ = writeln!(
                    out,
                    "approved by {}: executed at revision {} ({} holds released, {} sessions revoked)",
                    op.sub,
                    o.revision,
                    o.released.len(),
                    o.sessions_revoked
                );
                for l in &o.advance_log {
                    let _ = writeln!(out, "  {l}");
                }
            }
        }
        AdminCmd::List => {
            let reqs = flow::list(client, root).await?;
            let log = flow::read_log(client, root).await?;
            if a.json {
                emit(out, json!({"requests": reqs, "log": log}));
            } else {
                for r in &reqs {
                    let _ = writeln!(out, "{} {:?} by {} {:?}: {}", r.id, r.state, r.requester.sub, r.action, r.reason);
                }
                for l in &log {
                    let who = l.operator.as_ref().map_or("-", |o| o.sub.as_str());
                    let _ = writeln!(out, "{} {} {} {}: {}", l.at_ms, l.step, who, l.outcome, l.detail);
                }
            }
        }
    }
    Ok(())
}
