//! Scenarios: self_client (issue #17 items 4 and 5), against real etcd and arbiter
//! processes (and a real Envoy for the transparent path).
//!
//! - An ext_proc stream never ends with OK before its answer: a first message that
//!   does not decode fails the stream (Envoy would read OK as "continue unlocked",
//!   docs/DECISIONS.md F-3); a well-formed one still gets its answer.
//! - A self client (an in-pod sidecar, `tls.self_clients`) acts under its own
//!   SPIFFE ID: naming another identity for a key that identity is granted and the
//!   sidecar is not gets no grant (API or transparent), while its own transparent
//!   request is granted. The planted control lists the same sidecar as a vouching
//!   client (`tls.allowed_clients`): the forged claim then gets its grant, which
//!   is what the refusal assertions would catch.

use std::collections::HashMap;

use bytes::{Buf, BufMut, Bytes};
use envoy_types::pb::{
    envoy::{
        config::core::v3::{HeaderMap, HeaderValue},
        service::ext_proc::v3::{
            external_processor_client::ExternalProcessorClient, processing_request, processing_response, HttpHeaders,
            ProcessingRequest,
        },
    },
    google::protobuf::{value::Kind, Struct, Value},
};
use lockmesh_core::headers;
use lockmesh_tests::{ClientCert, Stack};
use tonic::{
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    transport::{Certificate, Channel, ClientTlsConfig, Identity},
    Status,
};

/// The ext_proc method's gRPC path.
const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// A gRPC channel to the stack's first arbiter, presenting `cert`.
async fn channel(st: &Stack, cert: &ClientCert) -> Channel {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(st.pki().ca_cert_path()).unwrap()))
        .identity(Identity::from_pem(std::fs::read(&cert.cert_path).unwrap(), std::fs::read(&cert.key_path).unwrap()))
        .domain_name("localhost");
    Channel::from_shared(format!("https://127.0.0.1:{}", st.arbiter(0).grpc_port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A codec that sends its messages' bytes as they are and reads the answers' bytes
/// without decoding them: it puts on the wire what no protobuf encoder would.
#[derive(Clone, Copy, Default)]
struct RawCodec;

struct RawBytes;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawBytes;
    type Decoder = RawBytes;

    fn encoder(&mut self) -> RawBytes {
        RawBytes
    }

    fn decoder(&mut self) -> RawBytes {
        RawBytes
    }
}

impl Encoder for RawBytes {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawBytes {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// Sends `messages` (raw gRPC message bodies) as one ext_proc stream and returns
/// what came back: the answers' bytes, then the stream's end status.
async fn raw_stream(ch: Channel, messages: Vec<Bytes>) -> (Vec<Bytes>, Status) {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.unwrap();
    let req = tonic::Request::new(tokio_stream::iter(messages));
    let path = http::uri::PathAndQuery::from_static(PROCESS);
    let mut stream = match grpc.streaming(req, path, RawCodec).await {
        Ok(r) => r.into_inner(),
        Err(s) => return (Vec::new(), s),
    };
    let mut answers = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(b)) => answers.push(b),
            Ok(None) => return (answers, Status::ok("")),
            Err(s) => return (answers, s),
        }
    }
}

fn hv(k: &str, v: &str) -> HeaderValue {
    HeaderValue { key: k.into(), value: String::new(), raw_value: v.as_bytes().to_vec() }
}

/// A `request_headers` message as a lockmesh Envoy sends it: the filter's stamp, the
/// given headers, and `claimed` as the downstream peer's SPIFFE ID.
fn request(claimed: &str, extra: &[(&str, &str)]) -> ProcessingRequest {
    let attrs = Struct {
        fields: [(
            "connection.uri_san_peer_certificate".to_string(),
            Value { kind: Some(Kind::StringValue(claimed.into())) },
        )]
        .into_iter()
        .collect(),
    };
    let mut hdrs = vec![hv(headers::FILTERED, headers::FILTER_PROTOCOL)];
    hdrs.extend(extra.iter().map(|(k, v)| hv(k, v)));
    ProcessingRequest {
        attributes: HashMap::from([("envoy.filters.http.ext_proc".to_string(), attrs)]),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers: hdrs }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The answer to one `request_headers` message sent as `cert`: `Ok` with the
/// answer, `Err` with the stream's status when there was none.
async fn answer(
    st: &Stack,
    cert: &ClientCert,
    msg: ProcessingRequest,
) -> Result<processing_response::Response, Status> {
    let mut client = ExternalProcessorClient::new(channel(st, cert).await);
    // Envoy keeps its side open until the answer: an end before it cancels the request.
    let outbound = futures::StreamExt::chain(tokio_stream::iter(vec![msg]), futures::stream::pending());
    let mut stream = client.process(outbound).await?.into_inner();
    loop {
        match stream.message().await? {
            // A stretch of Envoy's timer comes before the answer: skip it.
            Some(r) if r.response.is_none() => continue,
            Some(r) => return Ok(r.response.unwrap()),
            None => return Err(Status::ok("the stream ended with OK and no answer")),
        }
    }
}

/// An `ImmediateResponse`'s HTTP status and its `x-lockmesh-error` code.
fn immediate(r: &processing_response::Response) -> (i32, String) {
    let processing_response::Response::ImmediateResponse(i) = r else {
        panic!("expected an ImmediateResponse, got {r:?}");
    };
    let code = i
        .headers
        .iter()
        .flat_map(|m| &m.set_headers)
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == headers::ERROR)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
        .unwrap_or_default();
    (i.status.as_ref().map_or(0, |s| s.code), code)
}

#[tokio::test]
async fn an_undecodable_first_message_fails_the_stream_and_a_well_formed_one_is_answered() {
    let st = Stack::builder("self-undecodable").start().await.unwrap();
    let envoy = st.pki().envoy_client();
    // Field 1 with wire type 7 (none exists): no protobuf decoder reads it.
    let (answers, status) = raw_stream(channel(&st, &envoy).await, vec![Bytes::from_static(b"\x0f\xff\xff")]).await;
    assert!(answers.is_empty(), "answers to an undecodable message: {answers:?}");
    assert_ne!(status.code(), tonic::Code::Ok, "an undecodable first message ended the stream with OK: {status:?}");
    // A stream that ends before its first message fails too.
    let (answers, status) = raw_stream(channel(&st, &envoy).await, Vec::new()).await;
    assert!(answers.is_empty());
    assert_ne!(status.code(), tonic::Code::Ok, "an empty stream ended with OK: {status:?}");
    // The control: a well-formed request on the same port is answered (a grant).
    let who = st.pki().workload_spiffe_id("payments", "worker");
    let r = answer(
        &st,
        &envoy,
        request(&who, &[(":method", "POST"), (":path", "/v1/locks/acquire"), (headers::KEY, "payments/undecodable")]),
    )
    .await
    .unwrap();
    assert_eq!(immediate(&r), (200, String::new()), "{r:?}");
}

/// A registry whose LockGrants give `boss` the `payments/` keys and the sidecar
/// (`orders/sidecar`) the `orders/` keys.
fn granted_registry() -> String {
    format!(
        "{}grants:\n  - {{ identity: \"spiffe://lockmesh.test/ns/billing/sa/boss\", prefixes: [\"payments\"], \
         operations: [acquire] }}\n  - {{ identity: \"spiffe://lockmesh.test/ns/orders/sa/sidecar\", prefixes: \
         [\"orders\"], operations: [acquire] }}\n",
        lockmesh_tests::arbiter::DEFAULT_TEST_REGISTRY
    )
}

/// Rewrites the first arbiter's `tls.allowed_clients` line to `tls_lines` and restarts it.
async fn retrust(st: &Stack, tls_lines: &str) {
    let path = st.arbiter(0).config_path();
    let yaml = std::fs::read_to_string(path).unwrap();
    let line = yaml.lines().find(|l| l.trim_start().starts_with("allowed_clients:")).unwrap().to_owned();
    std::fs::write(path, yaml.replace(&line, tls_lines)).unwrap();
    st.arbiter(0).restart().await.unwrap();
}

/// Holds under the stack's root.
async fn holds(st: &Stack) -> i64 {
    let mut etcd = st.etcd().client().await.unwrap();
    let opts = etcd_client::GetOptions::new().with_prefix().with_count_only();
    etcd.get(format!("{}/l/", st.root()), Some(opts)).await.unwrap().count()
}

const VM: &str = "0123456789abcdef0123456789abcdef";

#[tokio::test]
async fn a_self_client_cannot_borrow_an_identity_and_its_own_transparent_request_is_granted() {
    let st = Stack::builder("self-client").registry(granted_registry()).start().await.unwrap();
    let envoy_id = st.pki().envoy_spiffe_id();
    retrust(&st, &format!("  allowed_clients: [{envoy_id:?}]\n  self_clients: [\"spiffe://lockmesh.test/ns/*/sa/*\"]"))
        .await;
    let sidecar = st.pki().client("orders", "sidecar").unwrap();
    let boss = st.pki().workload_spiffe_id("billing", "boss");
    // The API: an acquire naming boss for boss's key. No grant, no proof.
    let acquire = [(":method", "POST"), (":path", "/v1/locks/acquire"), (headers::KEY, "payments/forged")];
    let r = answer(&st, &sidecar, request(&boss, &acquire)).await.unwrap();
    assert_eq!(immediate(&r), (403, "denied".to_owned()), "{r:?}");
    // The transparent path: the same claim with the filter's marks.
    let marks = |key: &'static str| {
        [(":method", "POST"), (":path", "/orders/1"), (headers::KEY, key), (headers::VM, VM), (headers::HOLD, "1")]
    };
    let r = answer(&st, &sidecar, request(&boss, &marks("payments/forged"))).await.unwrap();
    assert_eq!(immediate(&r), (403, "denied".to_owned()), "{r:?}");
    assert_eq!(holds(&st).await, 0, "a forged claim left a hold");
    // Its own key, whatever caller it names: forwarded with a token, held under its
    // own identity, the claimed caller kept as unverified.
    let r = answer(&st, &sidecar, request(&boss, &marks("orders/1"))).await.unwrap();
    let processing_response::Response::RequestHeaders(h) = &r else { panic!("expected a forward, got {r:?}") };
    let set = h.response.as_ref().and_then(|c| c.header_mutation.as_ref()).map(|m| m.set_headers.clone());
    let set = set.unwrap_or_default();
    assert!(set.iter().filter_map(|o| o.header.as_ref()).any(|h| h.key == headers::TOKEN), "{set:?}");
    let mut etcd = st.etcd().client().await.unwrap();
    let held = etcd.get(format!("{}/l/", st.root()), Some(etcd_client::GetOptions::new().with_prefix())).await.unwrap();
    let rec: serde_json::Value = serde_json::from_slice(held.kvs()[0].value()).unwrap();
    assert_eq!(rec["owner"], st.pki().workload_spiffe_id("orders", "sidecar"), "{rec}");
    assert_eq!(rec["unverified_caller"], boss.as_str(), "{rec}");
}

#[tokio::test]
async fn planted_control_the_sidecar_as_a_vouching_client_lets_the_forged_claim_through() {
    let st = Stack::builder("self-client-planted").registry(granted_registry()).start().await.unwrap();
    let sidecar_id = st.pki().workload_spiffe_id("orders", "sidecar");
    retrust(&st, &format!("  allowed_clients: [{sidecar_id:?}]")).await;
    let sidecar = st.pki().client("orders", "sidecar").unwrap();
    let boss = st.pki().workload_spiffe_id("billing", "boss");
    let acquire = [(":method", "POST"), (":path", "/v1/locks/acquire"), (headers::KEY, "payments/forged")];
    let r = answer(&st, &sidecar, request(&boss, &acquire)).await.unwrap();
    // The bug the refusal above detects: a borrowed identity gets its grant.
    assert_eq!(immediate(&r), (200, String::new()), "{r:?}");
    assert_eq!(holds(&st).await, 1);
}

/// The certificate file (in the PKI directory) the shipped SDS secret `file`
/// (`envoy-config/sds/<file>`) names.
fn shipped_secret_cert(file: &str) -> String {
    let text = std::fs::read_to_string(lockmesh_tests::repo_root().join("envoy-config/sds").join(file)).unwrap();
    let doc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let cert = doc["resources"][0]["tls_certificate"]["certificate_chain"]["filename"].as_str().unwrap();
    cert.strip_prefix(lockmesh_tests::envoy::CERT_DIR_PREFIX).unwrap().to_owned()
}

/// The SDS secret file the shipped inbound sidecar presents to the arbiters with.
fn shipped_sidecar_secret() -> String {
    let text = std::fs::read_to_string(lockmesh_tests::repo_root().join("envoy-config/inbound-sidecar.yaml")).unwrap();
    let files: std::collections::BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.split("path_config_source: { path: envoy-config/sds/").nth(1))
        .filter_map(|l| l.split(',').next())
        .filter(|f| *f != "server-cert.yaml" && *f != "mesh-ca.yaml")
        .map(str::to_owned)
        .collect();
    assert_eq!(files.len(), 1, "one client certificate to the arbiters: {files:?}");
    files.into_iter().next().unwrap()
}

/// The stack's certificate at `file` (a PKI file name): the vouching
/// `envoy-client.pem` or a workload's `<ns>_<sa>.pem`.
fn pki_cert(st: &Stack, file: &str) -> ClientCert {
    let stem = file.strip_suffix(".pem").unwrap();
    if stem == "envoy-client" {
        return st.pki().envoy_client();
    }
    let (ns, sa) = stem.split_once('_').unwrap_or_else(|| panic!("{file}: not <ns>_<sa>.pem"));
    let cert = st.pki().client(ns, sa).unwrap();
    assert!(cert.cert_path.ends_with(file), "{}", cert.cert_path.display());
    cert
}

/// An acquire's grant proof (`proof` of the answer's JSON body), empty if none.
fn proof(r: &processing_response::Response) -> String {
    let processing_response::Response::ImmediateResponse(i) = r else { return String::new() };
    let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap_or_default();
    body["proof"].as_str().unwrap_or_default().to_owned()
}

/// Issue 41 row 6, with the arbiter configured as the quick start configures it
/// (the lock tier's certificate vouching, the inbound sidecar's SVID a self client,
/// LockGrants in the registry, grant proofs signed): a hand-built ext_proc request
/// presenting the certificate the shipped inbound sidecar presents (which any
/// process in its pod can read) and claiming billing/job gets no grant and no
/// proof for a billing key; its own payments key is held under its own identity.
/// Planted: the certificate the sidecar presented before (the lock tier's vouching
/// `arbiter-client-cert.yaml`) gets the forged claim its grant and signed proof.
#[tokio::test]
async fn the_shipped_sidecars_certificate_cannot_borrow_a_callers_identity() {
    let registry = format!(
        "{}grants:\n  - {{ identity: \"spiffe://lockmesh.test/ns/payments/\", prefixes: [\"payments\"], operations: \
         [acquire] }}\n  - {{ identity: \"spiffe://lockmesh.test/ns/billing/\", prefixes: [\"billing\"], operations: \
         [acquire] }}\n",
        lockmesh_tests::arbiter::DEFAULT_TEST_REGISTRY
    );
    let keys = tempfile::tempdir().unwrap();
    let signing = lockmesh_tests::fence::ensure_signing_key(keys.path()).unwrap();
    let st = Stack::builder("self-client-shipped")
        .registry(registry)
        .arbiter_extra_yaml(signing.arbiter_yaml())
        .start()
        .await
        .unwrap();
    let secret = shipped_sidecar_secret();
    let sidecar = pki_cert(&st, &shipped_secret_cert(&secret));
    let envoy = st.pki().envoy_client();
    assert_ne!(sidecar.spiffe_id, envoy.spiffe_id, "the shipped sidecar ({secret}) presents the vouching identity");
    retrust(&st, &format!("  allowed_clients: [{:?}]\n  self_clients: [{:?}]", envoy.spiffe_id, sidecar.spiffe_id))
        .await;
    let job = st.pki().workload_spiffe_id("billing", "job");
    let acquire = |key: &'static str| [(":method", "POST"), (":path", "/v1/locks/acquire"), (headers::KEY, key)];
    let r = answer(&st, &sidecar, request(&job, &acquire("billing/forged"))).await.unwrap();
    assert_eq!(immediate(&r), (403, "denied".to_owned()), "{r:?}");
    assert_eq!(proof(&r), "");
    assert_eq!(holds(&st).await, 0, "a forged claim left a hold");
    // Its own namespace's key: granted, under its own identity.
    let r = answer(&st, &sidecar, request(&job, &acquire("payments/own"))).await.unwrap();
    assert_eq!(immediate(&r), (200, String::new()), "{r:?}");
    let mut etcd = st.etcd().client().await.unwrap();
    let held = etcd.get(format!("{}/l/", st.root()), Some(etcd_client::GetOptions::new().with_prefix())).await.unwrap();
    let rec: serde_json::Value = serde_json::from_slice(held.kvs()[0].value()).unwrap();
    assert_eq!(rec["owner"], sidecar.spiffe_id.as_str(), "{rec}");
    assert_eq!(rec["unverified_caller"], job.as_str(), "{rec}");

    // Planted: the certificate the inbound sidecar shipped with before.
    let old = pki_cert(&st, &shipped_secret_cert("arbiter-client-cert.yaml"));
    let r = answer(&st, &old, request(&job, &acquire("billing/forged"))).await.unwrap();
    assert_eq!(immediate(&r), (200, String::new()), "{r:?}");
    assert!(!proof(&r).is_empty(), "the vouching certificate's forged grant carries a signed proof: {r:?}");
}
