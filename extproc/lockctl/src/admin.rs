//! `lockctl admin`: request, show, approve and list two-person admin actions
//! (`docs/ADMIN.md`). The arbiter executes them (the arbiter's `admin_actions` routes): this tool
//! only carries the operator's token to it over mTLS and prints the answer.
//!
//! [`EtcdArgs`] and [`connect`] stay for the other commands that read etcd.

use std::{io::Write, path::PathBuf, process::ExitCode};

use clap::{Args, Subcommand};
use etcd_client::Client;
use lockmesh_core::wire::admin::{
    AdminErrorBody, ApproveBody, ApproveReply, ListBody, ListReply, Preview, RequestBody, ShowBody,
};
use lockmesh_lock::connect::{flag_name, EtcdAuthFields, EtcdConnection, RawEtcdTls};
use serde::{de::DeserializeOwned, Serialize};

use lockmesh_ops::admin::{
    flow::{self, Action},
    io, routes as server, AdminError,
};

/// How to reach etcd: flattened into every lockctl command that talks to etcd
/// (inspect, saturated, doctor, class apply, limit, epoch-advance, restore), each
/// flag also read from its `LOCKMESH_ETCD_*` variable; [`EtcdArgs::connection`]
/// validates them as the config files' `etcd:` sections are validated
/// (`lockmesh_etcd`). Which etcd role each command needs:
/// `lockctl etcd-roles`.
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
    /// File holding the etcd user's password (trailing newline ignored).
    #[arg(long, global = true, env = "LOCKMESH_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// CA bundle (PEM) that signed etcd's server certificate; turns TLS on
    /// (every endpoint must then be https://).
    #[arg(long, global = true, env = "LOCKMESH_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's client-cert auth, with --etcd-key.
    #[arg(long, global = true, env = "LOCKMESH_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// Client key (PEM), with --etcd-cert.
    #[arg(long, global = true, env = "LOCKMESH_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    /// The connection options, validated (every error names its flag); files are
    /// read now, relative to the working directory.
    pub fn connection(&self) -> Result<EtcdConnection, String> {
        let s = |p: &Option<PathBuf>| p.as_ref().map(|p| p.to_string_lossy().into_owned());
        let (cert, key) = (s(&self.etcd_cert), s(&self.etcd_key));
        // A certificate without a CA still reaches the validation, which names what is missing.
        let tls = match s(&self.etcd_ca) {
            Some(ca) => Some(RawEtcdTls { ca, cert, key }),
            None if cert.is_some() || key.is_some() => {
                return Err("--etcd-ca: required with --etcd-cert/--etcd-key".into());
            }
            None => None,
        };
        let password_file = s(&self.etcd_password_file);
        let fields = EtcdAuthFields {
            endpoints: &self.endpoints,
            tls: tls.as_ref(),
            user: self.etcd_user.as_deref(),
            password_file: password_file.as_deref(),
        };
        EtcdConnection::from_fields(&fields, &flag_name, std::path::Path::new("."), "").map_err(|e| e.join("; "))
    }
}

/// How to reach an arbiter, which executes the actions (its ext_proc port, mTLS).
#[derive(Args, Debug, Clone)]
pub struct ArbiterArgs {
    /// The arbiter's ext_proc URL, e.g. https://lockmesh-arbiter.lockmesh-system:18051 (required).
    #[arg(long, global = true, env = "LOCKMESH_ARBITER_URL")]
    pub arbiter: Option<String>,
    /// CA bundle (PEM) that signed the arbiter's server certificate (required).
    #[arg(long, global = true, env = "LOCKMESH_ARBITER_CA")]
    pub arbiter_ca: Option<PathBuf>,
    /// This tool's client certificate (PEM); its SPIFFE ID must be in the
    /// arbiter's `operators.allowed_clients` (required).
    #[arg(long = "cert", global = true, env = "LOCKMESH_ADMIN_CERT")]
    pub cert_file: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long = "key", global = true, env = "LOCKMESH_ADMIN_KEY")]
    pub key_file: Option<PathBuf>,
    /// The name to verify the arbiter's certificate against when the URL's host
    /// is not in it (e.g. https://127.0.0.1:18051 through `kubectl port-forward`).
    #[arg(long, global = true)]
    pub server_name: Option<String>,
}

/// The operator's identity token.
#[derive(Args, Debug, Clone)]
pub struct IdentityArgs {
    /// The operator's token (prefer the environment variable: argv is visible to
    /// others). The arbiter verifies it against its JWKS (`operators` in its config).
    #[arg(long, env = "LOCKMESH_ADMIN_TOKEN", hide_env_values = true)]
    pub token: String,
}

/// `lockctl admin ...`.
#[derive(Args, Debug)]
pub struct AdminArgs {
    #[command(subcommand)]
    cmd: AdminCmd,
    #[command(flatten)]
    arbiter: ArbiterArgs,
    /// JSON output.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum AdminCmd {
    /// Ask for an action; a different operator must approve it.
    #[command(subcommand)]
    Request(RequestCmd),
    /// Approve (and so execute) a pending request as a different operator.
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
        /// The lock key (only its digest is sent).
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
    let conn = a.connection().map_err(io)?;
    conn.connect().await.map_err(io)
}

/// A refusal as the arbiter (or this tool) states it: a stable code and a message.
#[derive(Debug)]
struct Refusal {
    code: String,
    message: String,
}

impl From<AdminError> for Refusal {
    fn from(e: AdminError) -> Self {
        Self { code: e.code().into(), message: e.to_string() }
    }
}

/// The HTTPS client of an arbiter's admin routes.
struct Arbiter {
    http: reqwest::Client,
    base: String,
}

impl Arbiter {
    async fn new(a: &ArbiterArgs) -> Result<Self, AdminError> {
        let need =
            |v: &Option<PathBuf>, flag: &str| v.clone().ok_or_else(|| io(format!("{flag}: required (docs/ADMIN.md)")));
        let url = a.arbiter.clone().ok_or_else(|| io("--arbiter: required (or LOCKMESH_ARBITER_URL)"))?;
        let rest = url.strip_prefix("https://").ok_or_else(|| io("--arbiter: must be an https:// URL"))?;
        let (ca, cert, key) =
            (need(&a.arbiter_ca, "--arbiter-ca")?, need(&a.cert_file, "--cert")?, need(&a.key_file, "--key")?);
        let mut pem = read(&cert)?;
        pem.push(b'\n');
        pem.extend(read(&key)?);
        let ca = reqwest::Certificate::from_pem(&read(&ca)?).map_err(|e| io(format!("--arbiter-ca: {e}")))?;
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| io(format!("--cert/--key: {e}")))?;
        let mut b = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca)
            .identity(identity)
            .http2_prior_knowledge()
            .connect_timeout(std::time::Duration::from_secs(5))
            .timeout(std::time::Duration::from_secs(150));
        let hostport = rest.split('/').next().unwrap_or_default();
        let base = match &a.server_name {
            Some(name) => {
                let addr = tokio::net::lookup_host(hostport)
                    .await
                    .ok()
                    .and_then(|mut it| it.next())
                    .ok_or_else(|| io(format!("--arbiter: cannot resolve {hostport:?} (host:port)")))?;
                b = b.resolve(name, addr);
                format!("https://{name}:{}", addr.port())
            }
            None => format!("https://{hostport}"),
        };
        let http = b.build().map_err(|e| io(format!("https client: {e}")))?;
        Ok(Self { http, base })
    }

    /// POSTs `body` to `path` (with the operator's token if any); the answer, or
    /// the arbiter's refusal ([`AdminErrorBody`]).
    async fn call<R: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
        token: Option<&str>,
    ) -> Result<R, Refusal> {
        let mut rq = self.http.post(format!("{}{path}", self.base)).json(body);
        if let Some(t) = token {
            rq = rq.bearer_auth(t.trim());
        }
        // reqwest's errors name the URL, never a header: the token stays out.
        let resp = rq.send().await.map_err(|e| Refusal::from(io(format!("arbiter {}: {e}", self.base))))?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| Refusal::from(io(format!("arbiter answer: {e}"))))?;
        let answer = |e: serde_json::Error| Refusal::from(io(format!("arbiter answer ({status}): {e}")));
        if status.is_success() {
            return serde_json::from_slice(&bytes).map_err(answer);
        }
        let b: AdminErrorBody = serde_json::from_slice(&bytes).map_err(answer)?;
        let message = if b.message.is_empty() { format!("arbiter answered {status}") } else { b.message };
        Err(Refusal { code: b.code, message })
    }
}

fn print_preview(out: &mut impl Write, p: &Preview) {
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

/// Runs `lockctl admin`: every command is executed by the arbiter, which verifies
/// the tokens and writes etcd with its own role. Exit codes: 0 done, 65 refused
/// request, 77 identity refused (bad, expired, stale or same operator, or this
/// tool's certificate), 1 arbiter, etcd or file trouble.
pub async fn main(a: &AdminArgs) -> ExitCode {
    let mut out = std::io::stdout();
    let arbiter = match Arbiter::new(&a.arbiter).await {
        Ok(c) => c,
        Err(e) => return fail(a.json, &e.into()),
    };
    match run(a, &arbiter, &mut out).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(r) => fail(a.json, &r),
    }
}

/// What `lockctl admin --json` prints on a refusal: `{"error": code, "message"}`
/// (the command's output contract; the arbiter's body names the code `code`).
#[derive(Serialize)]
struct CliRefusal<'a> {
    error: &'a str,
    message: &'a str,
}

fn fail(json: bool, r: &Refusal) -> ExitCode {
    if json {
        let out = CliRefusal { error: &r.code, message: &r.message };
        println!("{}", serde_json::to_string(&out).unwrap_or_default());
    }
    eprintln!("lockctl admin: refused [{}]: {}", r.code, r.message);
    ExitCode::from(lockmesh_ops::admin::exit_code_of(&r.code))
}

async fn run(a: &AdminArgs, arbiter: &Arbiter, out: &mut impl Write) -> Result<(), Refusal> {
    fn emit(out: &mut dyn Write, v: &impl Serialize) {
        let _ = writeln!(out, "{}", serde_json::to_string(v).unwrap_or_default());
    }
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
            let body = RequestBody { action, reason: reason.clone(), ttl_s: *ttl_s };
            let p: Preview = arbiter.call(server::REQUEST, &body, Some(&identity.token)).await?;
            if a.json {
                emit(out, &p);
            } else {
                let id = &p.request.id;
                let _ = writeln!(out, "requested {id}: a different operator must run `lockctl admin approve {id}`");
                print_preview(out, &p);
            }
        }
        AdminCmd::Show { id } => {
            let p: Preview = arbiter.call(server::SHOW, &ShowBody { id: id.clone() }, None).await?;
            if a.json {
                emit(out, &p);
            } else {
                print_preview(out, &p);
            }
        }
        AdminCmd::Approve { id, identity } => {
            // What the approver approves is shown first; the arbiter then executes
            // only if the holds are still exactly the ones shown.
            let p: Preview = arbiter.call(server::SHOW, &ShowBody { id: id.clone() }, None).await?;
            if !a.json {
                print_preview(out, &p);
            }
            let revs: Option<Vec<i64>> = matches!(p.request.action, Action::ForceRelease { .. })
                .then(|| p.holds.iter().map(|h| h.grant_revision).collect());
            let body = ApproveBody { id: id.clone(), shown: revs };
            let v: ApproveReply = arbiter.call(server::APPROVE, &body, Some(&identity.token)).await?;
            if a.json {
                emit(out, &v);
            } else {
                let o = &v.outcome;
                let by = o.request.approver.as_ref().map_or("-", |op| op.sub.as_str());
                let _ = writeln!(
                    out,
                    "approved by {by}: executed at revision {} ({} holds released, {} sessions revoked)",
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
            let v: ListReply = arbiter.call(server::LIST, &ListBody {}, None).await?;
            if a.json {
                emit(out, &v);
            } else {
                for r in &v.requests {
                    let _ = writeln!(out, "{} {:?} by {} {:?}: {}", r.id, r.state, r.requester.sub, r.action, r.reason);
                }
                for l in &v.log {
                    let who = l.operator.as_ref().map_or("-", |o| o.sub.as_str());
                    let _ = writeln!(out, "{} {} {} {}: {}", l.at_ms, l.step, who, l.outcome, l.detail);
                }
            }
        }
    }
    Ok(())
}
