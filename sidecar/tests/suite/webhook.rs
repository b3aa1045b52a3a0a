//! Real-shaped AdmissionReview v1 requests through the webhook's decision: the
//! patch (applied with the independent `json-patch` crate) yields the golden pod,
//! injection is idempotent, un-annotated pods and other kinds are untouched, and
//! an opted-in pod without persistent marks is denied with a clear message.

use base64::Engine;
use lockmesh_sidecar::{
    annotations,
    inject::{self, Outcome},
    webhook::{review, AdmissionResponse, Verdict},
    Companion, Config,
};
use serde_json::{json, Value};

use crate::fixtures;

/// The injector's defaults with the orders store's metrics exporter (a container
/// of the StatefulSet fixture) listed as a companion by the admins.
fn config() -> Config {
    let companion = Companion { name: "metrics".into(), image: "registry.example.com/orders-exporter:*".into() };
    Config { companions: vec![companion], ..Config::default() }
}

/// The webhook's response to a fixture, and the request's object.
fn answer(body: &[u8]) -> (AdmissionResponse, Verdict, Value) {
    let request: Value = serde_json::from_slice(body).unwrap();
    let (review, verdict) = review(body, &config()).unwrap();
    assert_eq!(review.api_version, "admission.k8s.io/v1");
    assert_eq!(review.kind, "AdmissionReview");
    let response = review.response.unwrap();
    assert_eq!(response.uid, request["request"]["uid"].as_str().unwrap(), "uid must be echoed");
    (response, verdict, request["request"]["object"].clone())
}

/// Applies the response's base64 JSONPatch to `object`.
fn patched(response: &AdmissionResponse, object: &Value) -> Value {
    assert_eq!(response.patch_type.as_deref(), Some("JSONPatch"));
    let bytes = base64::engine::general_purpose::STANDARD.decode(response.patch.as_ref().unwrap()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
    let mut doc = object.clone();
    json_patch::patch(&mut doc, &patch).unwrap();
    doc
}

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod["spec"]["containers"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap()
}

fn env(c: &Value, name: &str) -> Option<String> {
    c["env"].as_array()?.iter().find(|e| e["name"] == name).map(|e| e["value"].as_str().unwrap().to_owned())
}

/// The review of an injected pod: as the API server would send it.
fn review_of(pod: &Value, uid: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": "payments", "operation": "CREATE", "object": pod}
    }))
    .unwrap()
}

#[test]
fn opted_in_pod_gets_the_fence_with_its_marks_claim() {
    let (response, verdict, pod) = answer(&fixtures::admission("pod-opted-in.json"));
    assert!(response.allowed && response.status.is_none(), "{response:?}");
    assert_eq!(verdict, Verdict::Injected);
    let out = patched(&response, &pod);
    fixtures::golden_json("golden/pod-opted-in.json", &out);

    // Independently of the golden file: the proxy took the client port, the store
    // moved to loopback, the marks are on the named claim.
    let fence = container(&out, inject::CONTAINER);
    assert_eq!(fence["ports"][0], json!({"name": "http", "containerPort": 8080, "protocol": "TCP"}));
    assert_eq!(env(fence, inject::ENV_UPSTREAM).as_deref(), Some("http://127.0.0.1:15081"));
    let store = container(&out, "ledger");
    assert!(store.get("ports").is_none(), "the store must not keep the client port: {store}");
    assert_eq!(env(store, "LEDGER_PORT").as_deref(), Some("15081"));
    assert_eq!(env(store, "LEDGER_BIND").as_deref(), Some("127.0.0.1"));
    assert_eq!(env(store, "LEDGER_DATA").as_deref(), Some("/data"), "unrelated env must survive");
    let marks = out["spec"]["volumes"].as_array().unwrap().iter().find(|v| v["name"] == inject::MARKS_VOLUME).unwrap();
    assert_eq!(
        marks,
        &json!({"name": inject::MARKS_VOLUME, "persistentVolumeClaim": {"claimName": "ledger-fence-marks"}})
    );
    assert!(!serde_json::to_string(&out).unwrap().contains("emptyDir"));
    assert!(fence["readinessProbe"]["httpGet"].is_object() && fence["livenessProbe"]["httpGet"].is_object());
    assert!(fence["resources"]["limits"]["memory"].is_string());
    assert_eq!(out["metadata"]["labels"][annotations::FENCED_LABEL], "true");
    assert_eq!(out["metadata"]["labels"][annotations::BACKEND_PORT_LABEL], "15081");
    assert_eq!(out["spec"]["securityContext"]["fsGroup"], 65532);
}

#[test]
fn statefulset_replica_keeps_its_claim_and_is_warned_about_its_probe() {
    let (response, verdict, pod) = answer(&fixtures::admission("pod-statefulset-replica.json"));
    assert_eq!(verdict, Verdict::Injected, "{response:?}");
    let out = patched(&response, &pod);
    fixtures::golden_json("golden/pod-statefulset-replica.json", &out);
    let vols: Vec<&Value> =
        out["spec"]["volumes"].as_array().unwrap().iter().filter(|v| v["name"] == inject::MARKS_VOLUME).collect();
    assert_eq!(vols.len(), 1, "the controller's marks volume is reused, not duplicated");
    let store = container(&out, "orders");
    assert_eq!(store["ports"], json!([{"name": "gossip", "containerPort": 7946, "protocol": "TCP"}]));
    assert_eq!(container(&out, inject::CONTAINER)["ports"][0]["name"], "api");
    assert_eq!(response.warnings.len(), 1, "{:?}", response.warnings);
    assert!(response.warnings[0].contains("readinessProbe (GET /health on port 8080) now passes through fence-proxy"));
    // The probe's named port moved with the port: it now names the number.
    assert_eq!(store["readinessProbe"]["httpGet"]["port"], 8080);
}

#[test]
fn injection_is_idempotent() {
    for fixture in ["pod-opted-in.json", "pod-statefulset-replica.json"] {
        let (response, _, pod) = answer(&fixtures::admission(fixture));
        let once = patched(&response, &pod);
        // The pure function: inject(inject(p)) == inject(p).
        let Outcome::Injected(i) = inject::inject(&pod, &config()).unwrap() else { panic!("not injected") };
        assert_eq!(i.object, once);
        assert_eq!(inject::inject(&once, &config()).unwrap(), Outcome::AlreadyInjected);
        // The webhook: an injected pod is allowed with no patch.
        let (again, verdict, _) = answer(&review_of(&once, "5f5f5f5f-0000-4000-8000-000000000001"));
        assert_eq!(verdict, Verdict::Untouched);
        assert!(again.allowed && again.patch.is_none() && again.patch_type.is_none(), "{again:?}");
    }
}

#[test]
fn pod_without_the_annotation_is_untouched() {
    let (response, verdict, _) = answer(&fixtures::admission("pod-no-annotation.json"));
    assert_eq!(verdict, Verdict::Untouched);
    assert!(response.allowed);
    assert_eq!(response.patch, None);
    assert_eq!(response.patch_type, None);
    assert!(response.warnings.is_empty());
}

#[test]
fn bare_pod_without_a_marks_claim_is_denied() {
    let (response, verdict, _) = answer(&fixtures::admission("pod-no-marks-claim.json"));
    assert_eq!(verdict, Verdict::Denied);
    assert!(!response.allowed && response.patch.is_none());
    let status = response.status.unwrap();
    assert_eq!(status.code, 400);
    assert!(
        status.message.starts_with(
            "lockmesh fence injection refused: [marks_claim_missing] metadata.annotations[\"lockmesh.io/fence-marks-claim\"]: required: name an existing PersistentVolumeClaim"
        ),
        "{}",
        status.message
    );
}

#[test]
fn marks_in_scratch_space_are_denied() {
    let (response, verdict, _) = answer(&fixtures::admission("pod-emptydir-marks.json"));
    assert_eq!(verdict, Verdict::Denied);
    let message = response.status.unwrap().message;
    assert!(
        message.contains(
            "[marks_not_persistent] spec.volumes: volume lockmesh-fence-marks must be a persistentVolumeClaim"
        ),
        "{message}"
    );
}

#[test]
fn other_kinds_are_allowed_untouched() {
    let (response, verdict, _) = answer(&fixtures::admission("deployment-not-a-pod.json"));
    assert_eq!(verdict, Verdict::Untouched);
    assert!(response.allowed && response.patch.is_none());
}

#[test]
fn every_problem_is_listed_in_one_denial() {
    let mut body: Value = serde_json::from_slice(&fixtures::admission("pod-opted-in.json")).unwrap();
    let ann = &mut body["request"]["object"]["metadata"]["annotations"];
    ann.as_object_mut().unwrap().remove("lockmesh.io/fence-config");
    ann.as_object_mut().unwrap().remove("lockmesh.io/fence-backend-port-env");
    ann["lockmesh.io/fence-store-port"] = json!("grpc");
    let (response, _, _) = answer(&serde_json::to_vec(&body).unwrap());
    let message = response.status.unwrap().message;
    for code in ["[store_port]", "[store_not_moved]", "[config_map_missing]"] {
        assert!(message.contains(code), "{code} missing from: {message}");
    }
}

#[test]
fn bad_bodies_are_errors_not_reviews() {
    assert!(review(b"not json", &Config::default()).is_err());
    let v1beta1 = br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"u","kind":{"group":"","version":"v1","kind":"Pod"},"operation":"CREATE"}}"#;
    let e = review(v1beta1, &Config::default()).unwrap_err().to_string();
    assert_eq!(
        e,
        "apiVersion must be admission.k8s.io/v1 and kind AdmissionReview, got admission.k8s.io/v1beta1 AdmissionReview"
    );
}

#[test]
fn host_network_pods_are_refused() {
    let mut body: Value = serde_json::from_slice(&fixtures::admission("pod-opted-in.json")).unwrap();
    body["request"]["object"]["spec"]["hostNetwork"] = json!(true);
    let (response, verdict, _) = answer(&serde_json::to_vec(&body).unwrap());
    assert_eq!(verdict, Verdict::Denied);
    let message = response.status.unwrap().message;
    assert!(
        message.contains("[workload_shape] spec.hostNetwork: a fenced pod cannot use the host network"),
        "{message}"
    );
}
