//! The arbiter accepts only lockmesh's own Envoys: a caller that reaches its gRPC
//! port directly, even with a certificate from the same CA, cannot present forged
//! identity attributes.

use std::collections::HashMap;

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
use lockmesh_tests::Stack;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

fn forged_request(identity: &str) -> ProcessingRequest {
    let h = |k: &str, v: &str| HeaderValue { key: k.into(), value: String::new(), raw_value: v.as_bytes().to_vec() };
    let attrs = Struct {
        fields: [(
            "connection.uri_san_peer_certificate".to_string(),
            Value { kind: Some(Kind::StringValue(identity.into())) },
        )]
        .into_iter()
        .collect(),
    };
    ProcessingRequest {
        attributes: HashMap::from([("envoy.filters.http.ext_proc".to_string(), attrs)]),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    h(":method", "POST"),
                    h(":path", "/v1/locks/acquire"),
                    h("x-lock-key", "payments/direct"),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

async fn call(
    st: &Stack,
    cert: Option<(&std::path::Path, &std::path::Path)>,
    ca: &std::path::Path,
) -> Result<processing_response::Response, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(ca).unwrap()))
        .domain_name("localhost");
    if let Some((c, k)) = cert {
        tls = tls.identity(Identity::from_pem(std::fs::read(c).unwrap(), std::fs::read(k).unwrap()));
    }
    let ch = Channel::from_shared(format!("https://127.0.0.1:{}", st.arbiter(0).grpc_port()))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = ExternalProcessorClient::new(ch);
    let who = st.pki().workload_spiffe_id("billing", "boss");
    let out = client
        .process(tokio_stream::iter(vec![forged_request(&who)]))
        .await
        .map_err(|s| format!("status {:?}: {}", s.code(), s.message()))?;
    let mut stream = out.into_inner();
    match stream.message().await {
        Ok(Some(r)) => r.response.ok_or_else(|| "empty response".to_string()),
        Ok(None) => Err("stream ended".into()),
        Err(s) => Err(format!("status {:?}: {}", s.code(), s.message())),
    }
}

#[tokio::test]
async fn a_direct_call_without_envoys_certificate_is_refused() {
    let st = Stack::builder("direct-arbiter").start().await.unwrap();
    let ca = st.pki().ca_cert_path();
    // A workload certificate from the same CA: TLS succeeds, the arbiter refuses.
    let w = st.pki().client("billing", "boss").unwrap();
    let e = call(&st, Some((&w.cert_path, &w.key_path)), &ca).await.unwrap_err();
    assert!(e.contains("PermissionDenied"), "{e}");
    // No client certificate, or one from another CA: the handshake fails.
    assert!(call(&st, None, &ca).await.is_err());
    let r = st.pki().rogue();
    assert!(call(&st, Some((&r.cert_path, &r.key_path)), &ca).await.is_err());
    // Even Envoy's own certificate does not let a request skip the filter.
    let env = st.pki().envoy_client();
    match call(&st, Some((&env.cert_path, &env.key_path)), &ca).await.unwrap() {
        processing_response::Response::ImmediateResponse(i) => {
            assert_eq!(i.status.unwrap().code, 500);
            assert!(String::from_utf8_lossy(&i.body).contains("did not pass the lockmesh filter"));
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Nothing was granted by any of these.
    let mut etcd = st.etcd().client().await.unwrap();
    let held = etcd
        .get(format!("{}/l/", st.root()), Some(etcd_client::GetOptions::new().with_prefix().with_count_only()))
        .await
        .unwrap();
    assert_eq!(held.count(), 0);
}
