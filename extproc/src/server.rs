//! The ext_proc service (`envoy.service.ext_proc.v3.ExternalProcessor`).
//!
//! One gRPC stream per HTTP request. Rules this module keeps, because Envoy forwards
//! a request **unlocked** when a processor ends the stream with OK before answering
//! (docs/DECISIONS.md F-3):
//! - every `request_headers` message gets an explicit answer: an
//!   `ImmediateResponse` (API routes) or a refusal; a stream that cannot be answered
//!   ends with a non-OK status, never OK;
//! - a stream whose first message is `response_headers` is a local reply from an
//!   earlier filter (the Wasm filter's 400): it is passed through and released
//!   nothing;
//! - while an acquire waits, an inbound end or error, or Envoy closing our
//!   response stream, cancels the wait; a grant that commits anyway is released.

use std::{collections::HashMap, panic::AssertUnwindSafe, pin::Pin, sync::Arc};

use envoy_types::pb::{
    envoy::{
        config::core::v3::{HeaderValue, HeaderValueOption},
        r#type::v3::HttpStatus,
        service::ext_proc::v3::{
            external_processor_server::ExternalProcessor, processing_request, processing_response, CommonResponse,
            HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingRequest, ProcessingResponse,
        },
    },
    google::protobuf::{value::Kind, Duration as PbDuration, Struct},
};
use futures::{FutureExt as _, Stream};
use lockmesh_core::{headers, Code};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::{
    api::{self, ApiRequest},
    config::ClientKind,
    metrics::route_label,
    respond::{ApiError, ApiResponse},
    state::State,
    transparent,
};

/// Attribute carrying the downstream peer's SPIFFE ID.
pub(crate) const PEER_URI_SAN: &str = "connection.uri_san_peer_certificate";
const ATTR_NS: &str = "envoy.filters.http.ext_proc";

/// How long an acquire waits before the arbiter stretches Envoy's ext_proc
/// `message_timeout` to cover its wait. Envoy's `message_timeout` must be longer
/// (lockmesh's configs use 3 s; `docs/OPERATIONS.md`).
pub(crate) const OVERRIDE_AFTER: std::time::Duration = std::time::Duration::from_millis(1000);

/// The ext_proc service.
pub struct Arbiter {
    state: Arc<State>,
}

impl Arbiter {
    /// A service over `state`.
    pub fn new(state: Arc<State>) -> Self {
        Self { state }
    }
}

type Out = Result<ProcessingResponse, Status>;

/// The ext_proc client of a stream: its SPIFFE ID and how far it is believed.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    /// The SPIFFE ID of its client certificate.
    pub(crate) id: String,
    /// Vouching client or self client.
    pub(crate) kind: ClientKind,
}

#[tonic::async_trait]
impl ExternalProcessor for Arbiter {
    type ProcessStream = Pin<Box<dyn Stream<Item = Out> + Send + 'static>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Only lockmesh's own Envoys may call. A vouching client (outside every
        // workload pod) vouches for its callers' identity attributes; a self client
        // (an in-pod sidecar) acts under its own SPIFFE ID only.
        let client = request
            .peer_certs()
            .and_then(|certs| certs.first().and_then(|c| lockmesh_runtime::spiffe_id_of_cached(c.as_ref())))
            .and_then(|id| self.state.config.client_kind(&id).map(|kind| Client { id, kind }));
        let Some(envoy) = client else {
            return Err(Status::permission_denied("client certificate is not an allowed lockmesh Envoy"));
        };
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        // The stream's last word (F-3): a stream the handler left unanswered, or a
        // handler that panicked, ends with a non-OK status, never with OK.
        // One task per stream (issue 20: a second task only to catch a panic cost
        // every request a spawn and a cross-thread wake-up).
        let state = self.state.clone();
        tokio::spawn(async move {
            let served = AssertUnwindSafe(serve_stream(state, envoy, inbound, tx.clone())).catch_unwind().await;
            let fail = match served {
                Ok(Ok(())) => return,
                Ok(Err(status)) => status,
                Err(_) => Status::internal("the ext_proc handler failed before answering"),
            };
            let _ = tx.send(Err(fail)).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

fn header_map(h: &[HeaderValue]) -> Vec<(String, Vec<u8>)> {
    h.iter()
        .map(|v| {
            let raw = if v.raw_value.is_empty() { v.value.as_bytes().to_vec() } else { v.raw_value.clone() };
            (v.key.to_ascii_lowercase(), raw)
        })
        .collect()
}

fn attr_string(attrs: &HashMap<String, Struct>, name: &str) -> Option<String> {
    match attrs.get(ATTR_NS)?.fields.get(name)?.kind.as_ref()? {
        Kind::StringValue(s) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

fn immediate(r: &ApiResponse, details: &str) -> ProcessingResponse {
    let mut set = vec![opt("content-type", "application/json")];
    set.extend(r.headers.iter().map(|(k, v)| opt(k, v)));
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(r.status) }),
            headers: Some(HeaderMutation { set_headers: set, remove_headers: Vec::new() }),
            body: r.body.clone().into_bytes(),
            grpc_status: None,
            details: details.to_owned(),
        })),
        ..Default::default()
    }
}

fn opt(k: &str, v: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: k.to_owned(), value: String::new(), raw_value: v.as_bytes().to_vec() }),
        ..Default::default()
    }
}

fn refusal(code: Code, message: &str) -> ApiResponse {
    ApiError::new(code, message).into()
}

/// How young a request must be for a rerun after etcd refused it for an auth
/// store change ([`lockmesh_lock::auth_refusals`]).
const AUTH_RERUN_WITHIN: std::time::Duration = std::time::Duration::from_secs(4);

/// How many times a request runs at most when etcd keeps refusing it for auth
/// store changes (each refusal applied nothing; several come in a row while an
/// operator, or a test harness, adds users and roles one after the other), the
/// n-th rerun after 50 x 2^n ms.
const AUTH_RUNS: u32 = 6;

/// What the arbiter answers to `request_headers`.
pub enum Answer {
    /// An `ImmediateResponse`: the request never reaches an upstream.
    Reply(ApiResponse),
    /// Transparent mode: the lock is held; the request goes on upstream with these
    /// header changes.
    Forward {
        /// Headers to set (overwriting any of the same name).
        set: Vec<(&'static str, String)>,
        /// Headers to remove.
        remove: Vec<&'static str>,
    },
}

fn forward(set: &[(&'static str, String)], remove: &[&'static str]) -> ProcessingResponse {
    let headers = HeadersResponse {
        response: Some(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: set.iter().map(|(k, v)| opt(k, v)).collect(),
                remove_headers: remove.iter().map(|h| (*h).to_owned()).collect(),
            }),
            ..Default::default()
        }),
    };
    ProcessingResponse { response: Some(processing_response::Response::RequestHeaders(headers)), ..Default::default() }
}

/// Serves one ext_proc stream. `Ok` when the first message was answered (or the
/// answer could not be delivered because Envoy closed our side); `Err` with the
/// non-OK status the stream must end with otherwise (F-3): a first message that
/// fails to decode, an inbound error or end before any message, an unexpected
/// first message, and a request that ended before its answer.
async fn serve_stream(
    state: Arc<State>,
    envoy: Client,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Out>,
) -> Result<(), Status> {
    let first = match inbound.message().await {
        Ok(Some(m)) => m,
        Ok(None) => return Err(Status::aborted("the ext_proc stream ended before its first message")),
        Err(e) => {
            return Err(Status::invalid_argument(format!("the first ext_proc message is unreadable: {}", e.message())))
        }
    };
    match first.request {
        Some(processing_request::Request::RequestHeaders(h)) => {
            let hdrs = h.headers.map(|m| header_map(&m.headers)).unwrap_or_default();
            request_headers(&state, &envoy, &first.attributes, hdrs, inbound, tx).await
        }
        Some(processing_request::Request::ResponseHeaders(_)) => {
            // A local reply made before ext_proc (e.g. the filter's 400): pass it on.
            let resp = ProcessingResponse {
                response: Some(processing_response::Response::ResponseHeaders(HeadersResponse::default())),
                ..Default::default()
            };
            let _ = tx.send(Ok(resp)).await;
            Ok(())
        }
        _ => Err(Status::failed_precondition("unexpected first ext_proc message")),
    }
}

async fn request_headers(
    state: &Arc<State>,
    client: &Client,
    attrs: &HashMap<String, Struct>,
    hdrs: Vec<(String, Vec<u8>)>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Out>,
) -> Result<(), Status> {
    let received = tokio::time::Instant::now();
    let get = |n: &str| hdrs.iter().find(|(k, _)| k == n).map(|(_, v)| String::from_utf8_lossy(v).into_owned());
    let method = get(":method").unwrap_or_default();
    let path = get(":path").unwrap_or_default();
    let path = path.split('?').next().unwrap_or_default().to_owned();
    // Transparent mode (the filter marked it): a request-scoped lock, or a request
    // its route lets through unlocked. Trusted only with the filter's stamp below.
    let mode = transparent::mode(&hdrs);
    let route = if matches!(mode, Ok(Some(_))) { "transparent" } else { route_label(&method, &path) };
    let answer = |mut r: ApiResponse| {
        state.metrics.request(route, code_of(&r));
        let sealed = state.store.seal().current().map_or("false", |s| s.reason.as_str());
        r.headers.push((headers::SEALED, sealed.to_owned()));
        immediate(&r, "lockmesh")
    };
    // The filter stamps every request it passed; without the stamp the request did
    // not go through it, and its headers cannot be trusted.
    if get(headers::FILTERED).as_deref() != Some(headers::FILTER_PROTOCOL) {
        let r = refusal(Code::Internal, "the request did not pass the lockmesh filter");
        let _ = tx.send(Ok(answer(r))).await;
        return Ok(());
    }
    let claimed = attr_string(attrs, PEER_URI_SAN).filter(|s| s.starts_with("spiffe://"));
    // Whom the request acts as: the caller a vouching client names, or a self
    // client itself, whatever caller it names (that one is kept as unverified).
    let (identity, unverified_caller) = match client.kind {
        ClientKind::Vouching => (claimed, None),
        ClientKind::SelfClient => (Some(client.id.clone()), claimed.filter(|c| *c != client.id)),
    };
    let Some(identity) = identity else {
        let _ = tx
            .send(Ok(answer(refusal(Code::Unauthenticated, "a verified SPIFFE client certificate is required"))))
            .await;
        return Ok(());
    };
    let lock = match headers::parse_lock_headers(hdrs.iter().map(|(k, v)| (k.as_str(), v.as_slice()))) {
        Ok(l) => l,
        Err(e) => {
            let _ = tx.send(Ok(answer(refusal(Code::BadRequest, &e.to_string())))).await;
            return Ok(());
        }
    };
    let budget_ms = match hdrs.iter().find(|(k, _)| k == headers::BUDGET_MS) {
        Some((_, v)) => match headers::parse_budget_ms(v) {
            Ok(b) => Some(b),
            Err(e) => {
                let _ = tx.send(Ok(answer(refusal(Code::Internal, &e.to_string())))).await;
                return Ok(());
            }
        },
        None => None,
    };
    let mode = match mode {
        Ok(m) => m,
        Err(e) => {
            let _ = tx.send(Ok(answer(e.into()))).await;
            return Ok(());
        }
    };
    let self_client = client.kind == ClientKind::SelfClient;
    // Only what the filter stamped (it strips every client's `x-lockmesh-*`).
    let granted_ns = hdrs
        .iter()
        .find(|(k, _)| k == headers::GRANTED_NS)
        .map(|(_, v)| String::from_utf8_lossy(v).split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect());
    let req =
        ApiRequest { method, path, lock, budget_ms, identity, unverified_caller, self_client, granted_ns, received };
    // An acquire (a campaign too) or an election observer that may wait stretches
    // Envoy's per-message timer to cover the wait, but only once it has waited
    // OVERRIDE_AFTER: most grants answer well before Envoy's `message_timeout`,
    // and the extra message would cost every acquire a gRPC frame in both processes.
    let waits = route == "transparent"
        || api::Route::of(req.method.as_bytes(), req.path.as_bytes()).is_some_and(api::Route::waits);
    let mut stretch = if waits { api::wait_of(state, &req).ok().filter(|w| !w.is_zero()) } else { None };
    let stretch_at = received + OVERRIDE_AFTER;
    let cancel = CancellationToken::new();
    // The handler runs inside this stream's task (no task of its own: issue 20),
    // polled by the loop below beside Envoy's side of the stream. A panic in it
    // ends the stream with a non-OK status (the caller of `serve_stream`).
    let task = {
        // Borrowed, not cloned: the handler no longer outlives this function.
        let (req, cancel, envoy, mode) = (&req, &cancel, client.id.as_str(), &mode);
        async move {
            let mut ran = 0;
            loop {
                let refusals = lockmesh_lock::auth_refusals();
                let r = match mode {
                    Some(transparent::Mode::Locked { vm, hold }) => {
                        transparent::acquire(state, envoy, vm, *hold, req, cancel).await
                    }
                    _ => {
                        let (r, undo) = api::handle(state, req, cancel).await;
                        (Answer::Reply(r), undo)
                    }
                };
                ran += 1;
                // etcd refused a call because its users or roles changed under the
                // login (nothing applied; the clients logged in again): again, up to
                // AUTH_RUNS runs while the request is young, rather than a 503 the
                // caller must retry.
                let again = ran < AUTH_RUNS
                    && r.1.is_none()
                    && matches!(&r.0, Answer::Reply(a) if a.code == Some(Code::Unavailable))
                    && lockmesh_lock::auth_refusals() != refusals
                    && !cancel.is_cancelled()
                    && received.elapsed() < AUTH_RERUN_WITHIN;
                if !again {
                    break r;
                }
                tracing::debug!(route, "etcd's auth store moved under this request; running it again");
                tokio::time::sleep(std::time::Duration::from_millis(50 << ran)).await;
            }
        }
    };
    tokio::pin!(task);
    let mut inbound_open = true;
    let (resp, undo) = loop {
        tokio::select! {
            r = &mut task => break r,
            // Nothing more is expected from Envoy while we hold the request: an
            // end, an error or a stray message all mean the caller is gone.
            _ = inbound.message(), if inbound_open => {
                inbound_open = false;
                cancel.cancel();
            }
            _ = tx.closed(), if !cancel.is_cancelled() => cancel.cancel(),
            _ = tokio::time::sleep_until(stretch_at), if stretch.is_some() => {
                // One override per processing state; it must come before the answer,
                // which this loop sends only after it.
                let t = stretch.take().unwrap_or_default() + std::time::Duration::from_secs(2);
                let ovr = ProcessingResponse {
                    override_message_timeout: Some(PbDuration {
                        seconds: i64::try_from(t.as_secs()).unwrap_or(i64::MAX),
                        nanos: i32::try_from(t.subsec_nanos()).unwrap_or(0),
                    }),
                    ..Default::default()
                };
                if tx.send(Ok(ovr)).await.is_err() {
                    cancel.cancel();
                }
            }
        }
    };
    let msg = match resp {
        Answer::Reply(r) => answer(r),
        Answer::Forward { set, remove } => {
            state.metrics.request(route, "ok");
            forward(&set, &remove)
        }
    };
    let delivered = !cancel.is_cancelled() && tx.send(Ok(msg)).await.is_ok();
    if let Some(u) = undo {
        if !delivered {
            state.metrics.abandoned();
            u.run().await;
        }
    }
    if delivered || tx.is_closed() {
        Ok(())
    } else {
        // The request ended (inbound end, error or stray message) before its answer.
        Err(Status::cancelled("the request ended before the arbiter answered it"))
    }
}

/// The `code` label of an answer: its refusal's code, `ok` for a 200.
fn code_of(r: &ApiResponse) -> &'static str {
    match r.code {
        Some(c) => c.as_str(),
        None if r.status == 200 => "ok",
        None => "other",
    }
}
