//! `lockctl audit ...`: queries of the audit store, through the running tailer's
//! query port (`--url https://...`, with the operator's client certificate and,
//! when the tailer checks them, token) or, with the tailer stopped, the store
//! file (`--db`). A raw key is digested here and only its digest is sent.

use std::{path::PathBuf, process::ExitCode};

use clap::{Args, Subcommand};
use lockmesh_core::LockKey;

use lockmesh_audit::{
    query::{self, Answer, Query},
    store::Store,
};
use lockmesh_lock::now_ms;
use lockmesh_ops::audit_client::QueryAuth;

/// `lockctl audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// The tailer's query port (its `query.listen`), e.g.
    /// https://lockmesh-audit.lockmesh-system:18091.
    #[arg(long, conflicts_with = "db", global = true)]
    pub url: Option<String>,
    /// CA bundle (PEM) that signed the query port's certificate (required with https://).
    #[arg(long, global = true, env = "LOCKMESH_AUDIT_CA")]
    pub ca: Option<PathBuf>,
    /// This tool's client certificate (PEM); its SPIFFE ID must be in the
    /// tailer's `query.allowed_clients`.
    #[arg(long = "cert", global = true, env = "LOCKMESH_ADMIN_CERT")]
    pub cert_file: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long = "key", global = true, env = "LOCKMESH_ADMIN_KEY")]
    pub key_file: Option<PathBuf>,
    /// The operator's token, when the tailer checks tokens (`query.operators`);
    /// prefer the environment variable: argv is visible to others.
    #[arg(long, global = true, env = "LOCKMESH_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// The store file (only while no tailer has it open).
    #[arg(long, global = true)]
    pub db: Option<PathBuf>,
    /// JSON output (with raw keys) instead of the table (digests only).
    #[arg(long, global = true)]
    pub json: bool,
    /// The query.
    #[command(subcommand)]
    pub cmd: AuditCmd,
}

/// Audit queries.
#[derive(Debug, Subcommand)]
pub enum AuditCmd {
    /// Every event of one lock key (the key is digested locally).
    History {
        /// The raw lock key, e.g. payments/order-42.
        key: String,
    },
    /// Holds of one identity that overlap a window.
    ByIdentity {
        /// SPIFFE ID.
        identity: String,
        /// Window start: unix ms, or an age like 15m, 2h, 7d. Default: the beginning.
        #[arg(long)]
        since: Option<String>,
        /// Window end: unix ms or an age. Default: now.
        #[arg(long)]
        until: Option<String>,
    },
    /// The longest holds (open holds count up to now).
    Longest {
        /// How many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Holds that ended by expiry, with no release.
    Expiries {
        /// Window start: unix ms or an age. Default: the beginning.
        #[arg(long)]
        since: Option<String>,
    },
    /// The most recent events (of the tailer's current history), newest first.
    Recent {
        /// How many (at most 1000).
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// The reconciliation list (ADR-04): every unprotected grant (token 0, a
    /// fail-open class during a quorum loss) in a window or of one outage.
    Unprotected {
        /// Window start: unix ms or an age. Default: the beginning.
        #[arg(long)]
        since: Option<String>,
        /// Window end: unix ms or an age. Default: now.
        #[arg(long)]
        until: Option<String>,
        /// Only this outage (`<cluster>-<declared ms>`, as the arbiter logged it).
        #[arg(long)]
        outage: Option<String>,
    },
    /// What promoting each class's candidate policy (shadow mode,
    /// docs/CLASSES.md) would have changed: its would_refuse and would_grant
    /// decisions summed by class and reason.
    Shadow {
        /// Window start: unix ms or an age. Default: 24h.
        #[arg(long, default_value = "24h")]
        since: String,
    },
    /// Events of one kind: gap, restore, limit_change, epoch, force_release, ...
    Events {
        /// The event kind.
        kind: String,
        /// Window start: unix ms or an age. Default: the beginning.
        #[arg(long)]
        since: Option<String>,
    },
}

/// Parses a time: unix ms, or an age (`30s`, `15m`, `2h`, `7d`) before `now_ms`.
pub fn parse_time(s: &str, now_ms: u64) -> Result<u64, String> {
    if let Ok(ms) = s.parse::<u64>() {
        return Ok(ms);
    }
    let (n, unit) = s.split_at(s.len().saturating_sub(1));
    let n: u64 = n.parse().map_err(|_| format!("{s:?} is neither unix ms nor an age like 15m, 2h, 7d"))?;
    let mult = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{s:?}: unit must be s, m, h or d")),
    };
    Ok(now_ms.saturating_sub(n.saturating_mul(mult)))
}

/// Builds the query of a command.
pub fn query_of(cmd: &AuditCmd, now_ms: u64) -> Result<Query, String> {
    // `--since` defaults to the beginning, `--until` to now.
    let since = |s: &Option<String>| time_flag("--since", s, now_ms, 0);
    let until = |s: &Option<String>| time_flag("--until", s, now_ms, now_ms);
    Ok(match cmd {
        AuditCmd::History { key } => {
            let k = LockKey::parse(key.as_bytes()).map_err(|e| format!("KEY: {e}"))?;
            Query::History { digest: k.digest().to_string() }
        }
        AuditCmd::ByIdentity { identity, since: s, until: u } => {
            Query::ByIdentity { identity: identity.clone(), since_ms: since(s)?, until_ms: until(u)? }
        }
        AuditCmd::Longest { limit } => Query::Longest { limit: *limit },
        AuditCmd::Unprotected { since: s, until: u, outage } => {
            Query::Unprotected { since_ms: since(s)?, until_ms: until(u)?, outage: outage.clone() }
        }
        AuditCmd::Recent { limit } => Query::Recent { limit: *limit },
        AuditCmd::Events { kind, since: s } => Query::Events {
            kind: lockmesh_audit::EventKind::parse(kind).ok_or_else(|| {
                let all: Vec<&str> = lockmesh_audit::EventKind::ALL.iter().map(|k| k.as_str()).collect();
                format!("KIND: {kind:?} is not one of {}", all.join(", "))
            })?,
            since_ms: since(s)?,
        },
        AuditCmd::Expiries { since: s } => Query::Expiries { since_ms: since(s)? },
        AuditCmd::Shadow { since: s } => Query::Shadow { since_ms: since(&Some(s.clone()))? },
    })
}

/// The value of a time flag (`--since`/`--until`), `default` when absent; an
/// error names the flag.
fn time_flag(flag: &str, value: &Option<String>, now_ms: u64, default: u64) -> Result<u64, String> {
    value.as_deref().map_or(Ok(default), |s| parse_time(s, now_ms).map_err(|e| format!("{flag}: {e}")))
}

/// How long `lockctl audit --url` waits for the tailer's answer.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// POSTs a query (`body`, JSON) to the tailer's `/v1/audit/query` at `url` with
/// `auth` and returns the answer's body (any transfer encoding).
pub(crate) async fn post(url: &str, body: &str, auth: &QueryAuth) -> Result<String, String> {
    lockmesh_ops::audit_client::post(url, body, auth, TIMEOUT).await
}

/// Runs `lockctl audit`: exit 0, 64 for a bad argument, 1 when the store or the
/// tailer cannot answer.
pub async fn main(a: &AuditArgs) -> ExitCode {
    let now = now_ms();
    let q = match query_of(&a.cmd, now) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("lockctl audit: {e}");
            return ExitCode::from(64);
        }
    };
    let answer: Result<Answer, String> = match (&a.url, &a.db) {
        (Some(url), _) => match serde_json::to_string(&q) {
            Ok(body) => {
                let auth = QueryAuth {
                    ca: a.ca.clone(),
                    cert: a.cert_file.clone(),
                    key: a.key_file.clone(),
                    token: a.token.clone(),
                };
                post(url, &body, &auth).await.and_then(|b| serde_json::from_str(&b).map_err(|e| format!("{url}: {e}")))
            }
            Err(e) => Err(e.to_string()),
        },
        (None, Some(db)) => Store::open(db).and_then(|s| query::run(&s, &q, now)).map_err(|e| e.to_string()),
        (None, None) => {
            eprintln!("lockctl audit: --url (the tailer's query port) or --db (its store file) is required");
            return ExitCode::from(64);
        }
    };
    match answer {
        Ok(ans) => {
            if a.json {
                println!("{}", serde_json::to_string_pretty(&ans).unwrap_or_default());
            } else {
                print!("{}", query::render(&ans));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lockctl audit: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_keys() {
        assert_eq!(parse_time("1700000000000", 5).unwrap(), 1_700_000_000_000);
        assert_eq!(parse_time("2h", 10_000_000).unwrap(), 10_000_000 - 7_200_000);
        assert!(parse_time("2w", 0).unwrap_err().contains("unit"));
        let q = query_of(&AuditCmd::History { key: "payments/order-42".into() }, 0).unwrap();
        let Query::History { digest } = q else { panic!() };
        assert_eq!(digest.len(), 64);
        assert!(!digest.contains("order"));
        assert!(query_of(&AuditCmd::History { key: "nonamespace".into() }, 0).is_err());
        let e = query_of(&AuditCmd::Events { kind: "gapp".into(), since: None }, 0).unwrap_err();
        assert!(e.starts_with("KIND: \"gapp\" is not one of grant, release"), "{e}");
    }

    /// The tailer's answer is read whatever its framing; a refusal is reported as
    /// its status line and body.
    #[tokio::test]
    async fn post_reads_chunked_answers_and_reports_refusals() {
        use crate::doctor::tests::serve_once;
        let chunked =
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n3\r\n\":1\r\n1\r\n}\r\n0\r\n\r\n";
        let (url, req) = serve_once(Some(chunked.into())).await;
        let token = QueryAuth { token: Some("t0k".into()), ..Default::default() };
        assert_eq!(post(&url, r#"{"query":"recent","limit":1}"#, &token).await.unwrap(), r#"{"a":1}"#);
        let head = req.await.unwrap().to_ascii_lowercase();
        assert!(head.starts_with("post /v1/audit/query http/1.1\r\n"), "{head}");
        assert!(head.contains("\r\ncontent-type: application/json\r\n"), "{head}");
        assert!(head.contains("\r\nauthorization: bearer t0k\r\n"), "{head}");
        let body = r#"{"error":"store: locked"}"#;
        let refused = format!("HTTP/1.1 500 Internal Server Error\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        let (url, _req) = serve_once(Some(refused)).await;
        let none = QueryAuth::default();
        assert_eq!(
            post(&url, "{}", &none).await.unwrap_err(),
            format!("{url}: HTTP/1.1 500 Internal Server Error {{\"error\":\"store: locked\"}}")
        );
        // The metrics port answers no query: the error says where the API is.
        let (url, _req) = serve_once(Some("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".into())).await;
        assert!(post(&url, "{}", &none).await.unwrap_err().contains("the tailer's query port"));
        assert!(post("ftp://x:1", "{}", &none).await.unwrap_err().contains("must start with https://"));
        assert!(post("https://x:1", "{}", &none).await.unwrap_err().starts_with("--ca: required"));
    }
}
