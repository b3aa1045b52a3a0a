//! The HTTP API of the lock tier (docs/API.md), one method per route, with every
//! failure classified by what it says about the request's effect:
//!
//! - [`CallError::NotSent`]: the connection could not be made; nothing happened.
//! - [`CallError::Refused`]: the service answered with `{code, message}` (a
//!   [`lockmesh_core::wire::ErrorBody`]); the request had no effect beyond what the
//!   code says.
//! - [`CallError::Unknown`]: the request may have been acted on (timeout, reset,
//!   an answer without a lockmesh error body such as Envoy's 500/504).
//! - [`CallError::FailedOpen`]: an acquire was answered with an unprotected grant
//!   (token 0, ADR-04), which was released again.
//!
//! Every answer is read as its [`lockmesh_core::wire::api`] type; whether a refusal
//! is worth retrying is [`lockmesh_core::Code::retryable`]'s decision.

use std::time::Duration;

use lockmesh_core::{
    code::{AnyCode, AnyReason},
    headers::{self, SessionId},
    wire::{
        api::{
            Acquired as AcquiredBody, Election, Proclaimed, Released, SessionClosed, SessionHolds, SessionOpened,
            SessionRenewed,
        },
        ErrorBody,
    },
    Code, Reason,
};
use reqwest::Method;
use serde::de::DeserializeOwned;

use crate::{
    ledger::{Grant, Proof},
    Config, Error,
};

/// A client for one lock tier, one identity and one instance id.
#[derive(Clone, Debug)]
pub(crate) struct Api {
    http: reqwest::Client,
    base: String,
    instance: String,
}

/// How a call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CallError {
    /// Nothing was sent.
    NotSent(String),
    /// The service's refusal.
    Refused {
        /// HTTP status.
        status: u16,
        /// Stable code (one this build may not know).
        code: AnyCode,
        /// The answer's `message`, for humans.
        message: String,
        /// `reason`, for `contended`.
        reason: Option<AnyReason>,
    },
    /// Sent; the effect is unknown.
    Unknown(String),
    /// An acquire answered with an unprotected grant (a fail-open class during a
    /// quorum loss), which the SDK has released again.
    FailedOpen,
}

/// An acquire's answer.
#[derive(Clone, Debug)]
pub(crate) struct Acquired {
    pub grant: Grant,
    /// The lowest epoch of its cluster whose holds are still honoured
    /// (`honoured_from`; the token's own epoch when absent).
    pub honoured_from: Option<u64>,
}

/// An opened session.
#[derive(Clone, Debug)]
pub(crate) struct Opened {
    pub session: SessionId,
    pub ttl_s: u64,
    pub class: String,
}

// === impl CallError ===

impl CallError {
    /// The service's code, if it answered one this build knows.
    pub(crate) fn code(&self) -> Option<Code> {
        match self {
            CallError::Refused { code, .. } => code.known(),
            _ => None,
        }
    }

    /// The service's code as sent, for logs (`None` when it answered none).
    pub(crate) fn code_str(&self) -> Option<&str> {
        match self {
            CallError::Refused { code, .. } => Some(code.as_str()),
            _ => None,
        }
    }

    /// Whether sending the same request again may succeed: for a refusal,
    /// [`Code::retryable`] (false for a code this build does not know); a request
    /// that got no lockmesh answer may always be sent again.
    pub(crate) fn retryable(&self) -> bool {
        match self {
            CallError::Refused { code, .. } => code.retryable(),
            CallError::NotSent(_) | CallError::Unknown(_) => true,
            CallError::FailedOpen => Error::FailedOpen.retryable(),
        }
    }

    /// The public error for a call whose unknown effect needs no resolution.
    pub(crate) fn into_error(self) -> Error {
        match self {
            CallError::NotSent(m) => Error::Unavailable(m),
            CallError::Unknown(m) => Error::Unavailable(m),
            CallError::FailedOpen => Error::FailedOpen,
            CallError::Refused { code, reason, .. } if code == Code::Contended => Error::Contended {
                reason: reason.map_or_else(|| Reason::KeyGated.as_str().to_owned(), |r| r.as_str().to_owned()),
            },
            CallError::Refused { status, code, message, .. } => Error::Refused { status, code, message },
        }
    }
}

// === impl Api ===

impl Api {
    /// Builds the HTTPS client: the configured CA only, the client certificate,
    /// HTTP/2 or HTTP/1.1 by ALPN; the three files are re-read every `cert_reload`
    /// (`crate::tls`), and each new connection uses the set current at its handshake.
    pub(crate) fn new(config: &Config, instance: String) -> Result<Self, Error> {
        config.validate()?;
        let b = reqwest::Client::builder().use_preconfigured_tls(crate::tls::client_config(config)?);
        let mut b = b.connect_timeout(config.request_timeout).tcp_nodelay(true);
        if let Some(addr) = config.resolve {
            let host =
                config.endpoint.trim_start_matches("https://").split([':', '/']).next().unwrap_or_default().to_owned();
            b = b.resolve(&host, addr);
        }
        let http = b.build().map_err(|e| Error::Config { field: "endpoint", why: format!("https client: {e}") })?;
        Ok(Self { http, base: config.endpoint.clone(), instance })
    }

    /// The per-process instance id sent as `x-lock-instance`.
    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }

    /// Sends one request and reads its answer as `T` (2xx) or as an
    /// [`ErrorBody`] (any other status).
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        hdrs: &[(&'static str, String)],
        timeout: Duration,
    ) -> Result<T, CallError> {
        let mut req = self.http.request(method, format!("{}{path}", self.base)).timeout(timeout);
        req = req.header(headers::INSTANCE, &self.instance);
        for (name, value) in hdrs {
            req = req.header(*name, value);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            // Without a connection nothing was sent; everything else may have been.
            Err(e) if e.is_connect() => return Err(CallError::NotSent(error_chain(&e))),
            Err(e) => return Err(CallError::Unknown(error_chain(&e))),
        };
        let status = resp.status().as_u16();
        let has_code = resp.headers().contains_key(headers::ERROR);
        let body = resp.text().await.map_err(|e| CallError::Unknown(error_chain(&e)))?;
        if (200..300).contains(&status) {
            // The serde error is not shown: it may quote a value (a key, a token).
            return serde_json::from_str(&body).map_err(|e| {
                CallError::Unknown(format!(
                    "{path}: status {status} with an answer that is not its body ({:?} at line {} column {})",
                    e.classify(),
                    e.line(),
                    e.column()
                ))
            });
        }
        match serde_json::from_str::<ErrorBody>(&body) {
            Ok(e) if has_code || status < 500 => {
                Err(CallError::Refused { status, code: e.code, message: e.message, reason: e.reason })
            }
            _ => Err(CallError::Unknown(format!("status {status} without a lockmesh error body"))),
        }
    }

    /// `POST /v1/sessions` for the class of `key`.
    pub(crate) async fn open_session(&self, key: &str, timeout: Duration) -> Result<Opened, CallError> {
        let o: SessionOpened =
            self.call(Method::POST, "/v1/sessions", &[(headers::KEY, key.to_owned())], timeout).await?;
        Ok(Opened { session: o.session, ttl_s: o.ttl_s, class: o.class })
    }

    /// `POST /v1/sessions/keepalive`. Acknowledged only when the answer names
    /// this session and a TTL it was renewed for ([`renewed`]).
    pub(crate) async fn keepalive(&self, session: SessionId, timeout: Duration) -> Result<(), CallError> {
        let r: SessionRenewed = self
            .call(Method::POST, "/v1/sessions/keepalive", &[(headers::SESSION, session.to_string())], timeout)
            .await?;
        renewed(session, &r)
    }

    /// `POST /v1/locks/acquire` on `session`, or `POST /v1/elections/campaign`
    /// when `campaign` is given (with the value to proclaim, if any): the same
    /// grant and answer.
    pub(crate) async fn acquire(
        &self,
        key: &str,
        session: SessionId,
        wait: Duration,
        ask: &[(&'static str, String)],
        campaign: Option<Option<&str>>,
        timeout: Duration,
    ) -> Result<Acquired, CallError> {
        let mut h = vec![
            (headers::KEY, key.to_owned()),
            (headers::SESSION, session.to_string()),
            (headers::WAIT_MS, wait.as_millis().to_string()),
        ];
        // `x-lock-class`, `x-lock-permits`, `x-lock-mode` as the options ask.
        h.extend(ask.iter().cloned());
        if let Some(Some(v)) = campaign {
            h.push((headers::VALUE, v.to_owned()));
        }
        let path = if campaign.is_some() { "/v1/elections/campaign" } else { "/v1/locks/acquire" };
        let a: AcquiredBody = self.call(Method::POST, path, &h, timeout).await?;
        if a.unprotected {
            // Token 0 fences nothing and the grant is on no session: hand it back.
            let grant = a.grant.ok_or_else(|| bad("grant"))?;
            let h = [(headers::KEY, key.to_owned()), (headers::GRANT, grant)];
            if let Err(e) = self.call::<Released>(Method::POST, "/v1/locks/release", &h, timeout).await {
                tracing::warn!(error = ?e.code_str(), "release of an unprotected grant failed; it lapses after the class TTL");
            }
            return Err(CallError::FailedOpen);
        }
        let token = a.fencing_token().ok_or_else(|| bad("token"))?;
        let granted_to = a.session.ok_or_else(|| bad("session"))?;
        if granted_to != session {
            return Err(CallError::Unknown("the grant names another session".into()));
        }
        let grant = Grant {
            key: key.to_owned(),
            token,
            session,
            ttl_s: a.ttl_s,
            class: a.class,
            cluster: a.cluster,
            proof: Proof(a.proof),
        };
        Ok(Acquired { grant, honoured_from: a.honoured_from })
    }

    /// `POST /v1/locks/acquire-all` of `keys` on `session`: one grant per key, in
    /// the order of `keys`, and the lowest epoch their cluster still honours
    /// (`honoured_from`; the tokens' own epoch when absent).
    pub(crate) async fn acquire_all(
        &self,
        keys: &[String],
        session: SessionId,
        wait: Duration,
        class: Option<&str>,
        timeout: Duration,
    ) -> Result<(Vec<Grant>, Option<u64>), CallError> {
        let mut h = vec![
            (headers::KEYS, keys.join(" ")),
            (headers::SESSION, session.to_string()),
            (headers::WAIT_MS, wait.as_millis().to_string()),
        ];
        h.extend(class.map(|c| (headers::CLASS, c.to_owned())));
        let a: lockmesh_core::wire::api::AcquiredAll =
            self.call(Method::POST, "/v1/locks/acquire-all", &h, timeout).await?;
        if a.session != session {
            return Err(CallError::Unknown("the grant names another session".into()));
        }
        let grants = keys
            .iter()
            .map(|key| {
                let k = a.keys.iter().find(|k| k.key == *key).ok_or_else(|| bad("keys"))?;
                Ok(Grant {
                    key: key.clone(),
                    token: k.token.parse().map_err(|_| bad("token"))?,
                    session,
                    ttl_s: a.ttl_s,
                    class: a.class.clone(),
                    cluster: Some(a.cluster.clone()),
                    proof: Proof(k.proof.clone()),
                })
            })
            .collect::<Result<Vec<_>, CallError>>()?;
        Ok((grants, a.honoured_from))
    }

    /// `POST /v1/locks/release` of exactly this grant, or `POST
    /// /v1/elections/resign` of exactly this leadership (`resign`).
    pub(crate) async fn release(&self, g: &Grant, resign: bool, timeout: Duration) -> Result<(), CallError> {
        let h = [
            (headers::KEY, g.key.clone()),
            (headers::TOKEN, g.token.to_string()),
            (headers::SESSION, g.session.to_string()),
        ];
        let path = if resign { "/v1/elections/resign" } else { "/v1/locks/release" };
        let _: Released = self.call(Method::POST, path, &h, timeout).await?;
        Ok(())
    }

    /// `POST /v1/elections/proclaim`: `value` under exactly this leadership.
    pub(crate) async fn proclaim(&self, g: &Grant, value: &str, timeout: Duration) -> Result<(), CallError> {
        let h = [
            (headers::KEY, g.key.clone()),
            (headers::TOKEN, g.token.to_string()),
            (headers::SESSION, g.session.to_string()),
            (headers::VALUE, value.to_owned()),
        ];
        let _: Proclaimed = self.call(Method::POST, "/v1/elections/proclaim", &h, timeout).await?;
        Ok(())
    }

    /// `GET /v1/elections`: the leadership now, or after the first change past
    /// `after`, waiting up to `wait`. Naming `session` shows the caller's own
    /// leadership's token.
    pub(crate) async fn observe(
        &self,
        key: &str,
        after: Option<&str>,
        wait: Duration,
        session: Option<SessionId>,
        timeout: Duration,
    ) -> Result<Election, CallError> {
        let mut h = vec![(headers::KEY, key.to_owned()), (headers::WAIT_MS, wait.as_millis().to_string())];
        if let Some(a) = after {
            h.push((headers::AFTER, a.to_owned()));
        }
        if let Some(s) = session {
            h.push((headers::SESSION, s.to_string()));
        }
        self.call(Method::GET, "/v1/elections", &h, timeout).await
    }

    /// `GET /v1/sessions/holds`.
    /// `GET /v1/sessions/holds`: each hold, with the lowest epoch its cluster
    /// still honours (`honoured_from`; the hold's own epoch when absent).
    pub(crate) async fn holds(
        &self,
        session: SessionId,
        timeout: Duration,
    ) -> Result<Vec<(Grant, Option<u64>)>, CallError> {
        let l: SessionHolds =
            self.call(Method::GET, "/v1/sessions/holds", &[(headers::SESSION, session.to_string())], timeout).await?;
        // A listing names no TTL: the caller fills it in.
        let holds = l.holds.into_iter();
        Ok(holds
            .map(|h| {
                let grant = Grant {
                    key: h.key,
                    token: h.token,
                    session,
                    ttl_s: 0,
                    class: h.class,
                    cluster: h.cluster,
                    proof: Proof::default(),
                };
                (grant, h.honoured_from)
            })
            .collect())
    }

    /// `POST /v1/sessions/close`.
    pub(crate) async fn close(&self, session: SessionId, timeout: Duration) -> Result<(), CallError> {
        let _: SessionClosed =
            self.call(Method::POST, "/v1/sessions/close", &[(headers::SESSION, session.to_string())], timeout).await?;
        Ok(())
    }
}

/// Whether keepalive answer `r` acknowledges renewing `session`: it must name that
/// session and a TTL above zero. Anything else is not an acknowledgement (the
/// answer is not this renewal's, e.g. a misrouted or replayed one): it counts as a
/// failed renewal ([`CallError::Unknown`]), which drains the session, never as one
/// that moves its deadline.
pub(crate) fn renewed(session: SessionId, r: &SessionRenewed) -> Result<(), CallError> {
    if r.session != session {
        return Err(CallError::Unknown("the keepalive answer names another session".into()));
    }
    if r.ttl_s == 0 {
        return Err(CallError::Unknown("the keepalive answer renewed no ttl".into()));
    }
    Ok(())
}

fn bad(field: &str) -> CallError {
    CallError::Unknown(format!("answer without a valid {field}"))
}

/// The error and its sources on one line (reqwest hides the useful part in the
/// chain).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_keepalive_answer_counts_only_for_its_own_session_and_a_renewed_ttl() {
        let (mine, other) = (SessionId::from_lease(7).unwrap(), SessionId::from_lease(8).unwrap());
        assert_eq!(renewed(mine, &SessionRenewed { session: mine, ttl_s: 15 }), Ok(()));
        assert!(matches!(renewed(mine, &SessionRenewed { session: other, ttl_s: 15 }), Err(CallError::Unknown(_))));
        assert!(matches!(renewed(mine, &SessionRenewed { session: mine, ttl_s: 0 }), Err(CallError::Unknown(_))));
    }
}
