//! Issue 41, row 1 / item 1: injection that cannot be talked out of. The real
//! `lockmesh-sidecar-webhook` process, over TLS, started with the SHIPPED
//! `deploy/base/webhook/injector.yaml`, on the two paths the shipped
//! MutatingWebhookConfiguration calls (`/mutate` for namespaces labelled
//! `lockmesh.io/fence-injection=enabled`, `/mutate/store` for those labelled
//! `store`).
//!
//! Every lookalike a pod author can write — a `lockmesh-fence` container of the
//! configured image with its own arguments and ConfigMap of signing keys, one
//! running `sleep`, one holding the client port and forwarding to nothing, a
//! forged `lockmesh.io/fence-status`, forged fenced labels, an init container of
//! the fence's name, a tampered fence on a re-admitted pod — must come out with
//! the webhook's OWN fence: the patched pod equals the patched normal store pod.
//! Selection by namespace: in a store namespace a pod without the selector
//! label, with another service account, or with no opt-in at all is injected or
//! refused, never admitted unfenced. Positive controls: a normal store pod gets
//! the patch, an injected pod re-admitted gets none, a pod outside selection is
//! untouched.
//!
//! These tests use only the binary, HTTP and the shipped files, so they also run
//! against an older webhook (issue 41: the lookalikes were admitted unpatched).

use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use crate::{fixtures, tls};

/// The shipped injector configuration's fence ConfigMap and store label.
const FENCE_CONFIG_MAP: &str = "lockmesh-fence";
const STORE_LABEL: (&str, &str) = ("lockmesh.io/store", "true");
const IMAGE: &str = "ghcr.io/lockmesh/fence-proxy:0.1.0";

/// The real webhook process started with the shipped injector.yaml.
struct Shipped {
    _dir: tempfile::TempDir,
    _webhook: tls::Webhook,
    base: String,
    client: reqwest::Client,
}

impl Shipped {
    fn start() -> Self {
        Self::start_adding("")
    }

    /// The webhook with the shipped injector.yaml, `extra` YAML lines appended
    /// (a key given twice is refused, so only keys the shipped file leaves empty).
    fn start_adding(extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ca = tls::pki(dir.path());
        let shipped = fixtures::repo_root().join("deploy/base/webhook/injector.yaml");
        let config = if extra.is_empty() {
            shipped
        } else {
            let text = std::fs::read_to_string(&shipped).unwrap().replace("companions: []\n", "");
            let path = dir.path().join("injector.yaml");
            std::fs::write(&path, format!("{text}{extra}")).unwrap();
            path
        };
        let (webhook, base) = tls::start_with(dir.path(), &["--config".as_ref(), config.as_os_str()]);
        let client = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        Self { _dir: dir, _webhook: webhook, base, client }
    }

    /// The AdmissionReview response for `pod` posted to `path`.
    async fn post(&self, path: &str, pod: &Value) -> Value {
        let body = review_of(pod);
        let r = self.client.post(format!("{}{path}", self.base)).body(body).send().await.unwrap();
        let status = r.status();
        let text = r.text().await.unwrap();
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str::<Value>(&text).unwrap()["response"].clone()
    }
}

fn review_of(pod: &Value) -> Vec<u8> {
    let mut r: Value = serde_json::from_slice(&fixtures::admission("pod-opted-in.json")).unwrap();
    r["request"]["object"] = pod.clone();
    serde_json::to_vec(&r).unwrap()
}

/// A normal store pod for the shipped config: the opted-in ledger pod with the
/// store label and the shipped fence ConfigMap.
fn store_pod() -> Value {
    let r: Value = serde_json::from_slice(&fixtures::admission("pod-opted-in.json")).unwrap();
    let mut pod = r["request"]["object"].clone();
    pod["metadata"]["labels"][STORE_LABEL.0] = json!(STORE_LABEL.1);
    pod["metadata"]["annotations"]["lockmesh.io/fence-config"] = json!(FENCE_CONFIG_MAP);
    pod
}

fn containers(pod: &mut Value) -> &mut Vec<Value> {
    pod["spec"]["containers"].as_array_mut().unwrap()
}

fn annotations(pod: &mut Value) -> &mut serde_json::Map<String, Value> {
    pod["metadata"]["annotations"].as_object_mut().unwrap()
}

/// `pod` with the response's JSON Patch applied (the pod itself when there is none).
fn patched(pod: &Value, response: &Value) -> Value {
    let Some(patch) = response["patch"].as_str() else { return pod.clone() };
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let bytes = base64::engine::general_purpose::STANDARD.decode(patch).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
    let mut doc = pod.clone();
    json_patch::patch(&mut doc, &patch).unwrap();
    doc
}

/// The fence container of a patched pod; exactly one must exist.
fn the_fence(pod: &Value) -> &Value {
    let fences: Vec<&Value> =
        pod["spec"]["containers"].as_array().unwrap().iter().filter(|c| c["name"] == "lockmesh-fence").collect();
    assert_eq!(fences.len(), 1, "exactly one lockmesh-fence container: {pod}");
    fences[0]
}

/// The normal store pod as the webhook injects it (on `/mutate`).
async fn control(webhook: &Shipped) -> Value {
    let pod = store_pod();
    let r = webhook.post("/mutate", &pod).await;
    assert_eq!(r["allowed"], true, "{r}");
    let out = patched(&pod, &r);
    let fence = the_fence(&out);
    assert_eq!(fence["image"], IMAGE);
    assert_eq!(fence["args"], json!(["--config", "/etc/lockmesh/fence/fence-proxy.yaml"]));
    assert!(out["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["name"] == "lockmesh-fence-config" && v["configMap"]["name"] == FENCE_CONFIG_MAP));
    out
}

/// Posts a lookalike and requires the webhook's own fence: allowed, patched, and
/// the patched pod equal to `want` (the patched normal pod), so nothing of the
/// lookalike survives.
async fn must_get_own_fence(webhook: &Shipped, path: &str, what: &str, pod: &Value, want: &Value) {
    let r = webhook.post(path, pod).await;
    assert_eq!(r["allowed"], true, "{what}: refused: {r}");
    assert!(r.get("patch").is_some(), "{what}: GOT THROUGH: admitted with no patch, its own fence kept: {r}");
    let out = patched(pod, &r);
    assert!(
        out == *want,
        "{what}: the patched pod is not the webhook's own injection:\n--- want\n{}\n--- got\n{}",
        serde_json::to_string_pretty(want).unwrap(),
        serde_json::to_string_pretty(&out).unwrap()
    );
}

/// Posts a pod that cannot be injected and requires a refusal whose message
/// contains `want`.
async fn must_be_refused(webhook: &Shipped, path: &str, what: &str, pod: &Value, want: &str) {
    let r = webhook.post(path, pod).await;
    assert_eq!(r["allowed"], false, "{what}: GOT THROUGH: admitted: {r}");
    assert!(r.get("patch").is_none(), "{what}: {r}");
    let message = r["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(want), "{what}: expected {want:?} in: {message}");
}

/// A lookalike `lockmesh-fence` container of the configured image.
fn lookalike(extra: Value) -> Value {
    let mut c = json!({"name": "lockmesh-fence", "image": IMAGE});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

fn forge_status(pod: &mut Value) {
    annotations(pod).insert(
        "lockmesh.io/fence-status".into(),
        json!(r#"{"version":1,"container":"lockmesh-fence","storePort":8080,"backendPort":15081,"marks":"claim:ledger-fence-marks","image":"ghcr.io/lockmesh/fence-proxy:0.1.0"}"#),
    );
}

#[tokio::test]
async fn control_a_normal_store_pod_gets_the_patch() {
    let webhook = Shipped::start();
    let out = control(&webhook).await;
    let store = &out["spec"]["containers"][0];
    assert!(store.get("ports").is_none(), "the store keeps no client port: {store}");
    assert_eq!(the_fence(&out)["ports"][0]["containerPort"], 8080);
}

#[tokio::test]
async fn lookalike_with_its_own_args_and_signing_keys_is_replaced() {
    let webhook = Shipped::start();
    let want = control(&webhook).await;
    let mut pod = store_pod();
    containers(&mut pod).push(lookalike(json!({
        "args": ["--config", "/etc/lockmesh/fence/fence-proxy.yaml"],
        "volumeMounts": [{"name": "lockmesh-fence-config", "mountPath": "/etc/lockmesh/fence", "readOnly": true}],
    })));
    pod["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "lockmesh-fence-config", "configMap": {"name": "my-own-signing-keys"}}));
    forge_status(&mut pod);
    must_get_own_fence(&webhook, "/mutate", "own args and keys", &pod, &want).await;
    // The same with arguments naming another file outright.
    let mut pod = store_pod();
    containers(&mut pod).push(lookalike(json!({"args": ["--config", "/keys/evil.yaml"]})));
    forge_status(&mut pod);
    must_get_own_fence(&webhook, "/mutate", "own config file", &pod, &want).await;
}

#[tokio::test]
async fn lookalike_running_sleep_is_replaced() {
    let webhook = Shipped::start();
    let want = control(&webhook).await;
    let mut pod = store_pod();
    containers(&mut pod).push(lookalike(json!({"command": ["sleep", "infinity"]})));
    forge_status(&mut pod);
    must_get_own_fence(&webhook, "/mutate", "sleep", &pod, &want).await;
}

/// The lookalike holds the client port (the store declares none) and forwards
/// to nothing.
#[tokio::test]
async fn lookalike_holding_the_port_and_forwarding_to_nothing_is_replaced() {
    let webhook = Shipped::start();
    let want = control(&webhook).await;
    let mut pod = store_pod();
    let port = containers(&mut pod)[0].as_object_mut().unwrap().remove("ports").unwrap();
    containers(&mut pod).push(lookalike(json!({
        "ports": port,
        "env": [{"name": "LOCKMESH_FENCE_UPSTREAM", "value": "http://127.0.0.1:1"}],
    })));
    forge_status(&mut pod);
    pod["metadata"]["labels"]["lockmesh.io/fenced"] = json!("true");
    pod["metadata"]["labels"]["lockmesh.io/fenced-backend-port"] = json!("15081");
    must_get_own_fence(&webhook, "/mutate", "forwarding to nothing", &pod, &want).await;
}

#[tokio::test]
async fn forged_status_annotation_alone_is_not_believed() {
    let webhook = Shipped::start();
    let want = control(&webhook).await;
    // A selected store.
    let mut pod = store_pod();
    forge_status(&mut pod);
    must_get_own_fence(&webhook, "/mutate", "forged status, selected", &pod, &want).await;
    // An opted-in pod the selector does not match.
    let mut pod = store_pod();
    pod["metadata"]["labels"] = json!({"app": "ledger-store"});
    forge_status(&mut pod);
    let mut want_unlabelled = want.clone();
    want_unlabelled["metadata"]["labels"].as_object_mut().unwrap().remove(STORE_LABEL.0);
    must_get_own_fence(&webhook, "/mutate", "forged status, opted in", &pod, &want_unlabelled).await;
    // Forged fenced labels as well.
    pod["metadata"]["labels"]["lockmesh.io/fenced"] = json!("true");
    pod["metadata"]["labels"]["lockmesh.io/fenced-backend-port"] = json!("15081");
    must_get_own_fence(&webhook, "/mutate", "forged status and labels", &pod, &want_unlabelled).await;
}

#[tokio::test]
async fn an_init_container_of_the_fence_name_is_removed() {
    let webhook = Shipped::start();
    let want = control(&webhook).await;
    let mut pod = store_pod();
    pod["spec"]["initContainers"] = json!([lookalike(json!({"command": ["true"]}))]);
    forge_status(&mut pod);
    let r = webhook.post("/mutate", &pod).await;
    assert_eq!(r["allowed"], true, "{r}");
    let mut out = patched(&pod, &r);
    assert_eq!(out["spec"]["initContainers"], json!([]), "{out}");
    out["spec"].as_object_mut().unwrap().remove("initContainers");
    assert_eq!(out, want);
}

/// An injected pod re-admitted is left as is (idempotence, by comparison); the
/// same pod with its fence's arguments or image changed gets the fence back.
#[tokio::test]
async fn reinjection_compares_against_the_webhooks_own_spec() {
    let webhook = Shipped::start();
    let injected = control(&webhook).await;
    for path in ["/mutate", "/mutate/store"] {
        let r = webhook.post(path, &injected).await;
        assert_eq!(r["allowed"], true, "{path}: {r}");
        assert!(r.get("patch").is_none(), "{path}: an injected pod is patched again: {r}");
    }
    for (what, field, value) in [
        ("tampered args", "args", json!(["--config", "/keys/evil.yaml"])),
        ("tampered image", "image", json!("evil.example/not-a-fence:1")),
        ("tampered command", "command", json!(["sleep", "infinity"])),
    ] {
        let mut pod = injected.clone();
        let fence = containers(&mut pod).iter_mut().find(|c| c["name"] == "lockmesh-fence").unwrap();
        fence[field] = value;
        must_get_own_fence(&webhook, "/mutate", what, &pod, &injected).await;
        must_get_own_fence(&webhook, "/mutate/store", what, &pod, &injected).await;
    }
}

/// Store namespaces (`/mutate/store`): the pod's labels, service account and
/// opt-in decide nothing.
#[tokio::test]
async fn in_a_store_namespace_a_pod_without_the_selector_label_is_injected() {
    let webhook = Shipped::start();
    let mut want = control(&webhook).await;
    want["metadata"]["labels"].as_object_mut().unwrap().remove(STORE_LABEL.0);
    let mut pod = store_pod();
    pod["metadata"]["labels"].as_object_mut().unwrap().remove(STORE_LABEL.0);
    must_get_own_fence(&webhook, "/mutate/store", "no selector label", &pod, &want).await;
    // The same pod with a forged status and lookalike.
    containers(&mut pod).push(lookalike(json!({"command": ["sleep", "infinity"]})));
    forge_status(&mut pod);
    must_get_own_fence(&webhook, "/mutate/store", "no label, lookalike", &pod, &want).await;
}

#[tokio::test]
async fn in_a_store_namespace_another_service_account_is_injected() {
    let webhook = Shipped::start();
    let want = control(&webhook).await;
    let mut pod = store_pod();
    pod["spec"]["serviceAccountName"] = json!("not-the-store");
    pod["spec"]["serviceAccount"] = json!("not-the-store");
    let mut want_sa = want.clone();
    want_sa["spec"]["serviceAccountName"] = json!("not-the-store");
    want_sa["spec"]["serviceAccount"] = json!("not-the-store");
    must_get_own_fence(&webhook, "/mutate/store", "another service account", &pod, &want_sa).await;
}

#[tokio::test]
async fn in_a_store_namespace_a_pod_cannot_opt_out() {
    let webhook = Shipped::start();
    // A plain pod with neither the label nor any annotation: refused, not skipped.
    let mut pod = store_pod();
    pod["metadata"]["labels"] = json!({"app": "ledger-store"});
    pod["metadata"]["annotations"] = json!({});
    must_be_refused(&webhook, "/mutate/store", "plain pod", &pod, "lockmesh.io/fence-injection=store").await;
    // Opting out.
    let mut pod = store_pod();
    annotations(&mut pod).insert("lockmesh.io/fence".into(), json!("disabled"));
    must_be_refused(&webhook, "/mutate/store", "fence: disabled", &pod, "never left unfenced").await;
    // Its own signing keys.
    let mut pod = store_pod();
    annotations(&mut pod).insert("lockmesh.io/fence-config".into(), json!("my-own-keys"));
    must_be_refused(&webhook, "/mutate/store", "own ConfigMap", &pod, "ConfigMap \"lockmesh-fence\" only").await;
    // A backend port the namespace's NetworkPolicy does not close.
    let mut pod = store_pod();
    annotations(&mut pod).insert("lockmesh.io/fence-backend-port".into(), json!("9090"));
    must_be_refused(&webhook, "/mutate/store", "backend port 9090", &pod, "default_backend_port 15081").await;
}

/// Positive control: outside every selection, a pod that does not opt in is
/// untouched, on `/mutate` (an `enabled` namespace), lookalike container or not.
#[tokio::test]
async fn control_a_pod_outside_selection_is_untouched() {
    let webhook = Shipped::start();
    let mut pod = store_pod();
    pod["metadata"]["labels"] = json!({"app": "web"});
    pod["metadata"]["annotations"] = json!({});
    let r = webhook.post("/mutate", &pod).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(r.get("patch").is_none(), "{r}");
    containers(&mut pod).push(json!({"name": "lockmesh-fence", "image": "busybox", "command": ["sleep", "1"]}));
    let r = webhook.post("/mutate", &pod).await;
    assert!(r["allowed"] == true && r.get("patch").is_none(), "{r}");
}

/// The shipped configuration selects stores and names the fence ConfigMap: its
/// check no longer says that a pod may opt out.
#[test]
fn the_shipped_injector_config_selects_and_pins_the_keys() {
    let config = fixtures::repo_root().join("deploy/base/webhook/injector.yaml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockmesh-sidecar-webhook"))
        .arg("--check-config")
        .arg(&config)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(!stdout.contains("may opt out"), "{stdout}");
    for want in [
        "lockmesh.io/fence-injection=store to /mutate/store",
        "lockmesh.io/store=true",
        "ConfigMap lockmesh-fence only",
        "never believed",
    ] {
        assert!(stdout.contains(want), "{want:?} missing from:\n{stdout}");
    }
}

/// What a variant must come out as.
enum Want {
    /// Allowed with a patch whose result is this pod (the webhook's own fence).
    Own(Value),
    /// Refused.
    Refused,
}

/// The kinds of row 1, each tried with at least [`MIN_PER_KIND`] variants.
const LOOKALIKE: &str = "lookalike fence container";
const FORGED: &str = "forged fence status";
const ESCAPE: &str = "selection escape";
const MIN_PER_KIND: usize = 10;

/// Every lookalike and escape of this module in one table, by kind, with the
/// result of each printed (`--nocapture`): none may be admitted unpatched or
/// with a fence that is not the webhook's own.
fn variants(injected: &Value) -> Vec<(&'static str, &'static str, &'static str, Value, Want)> {
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut p = store_pod();
        edit(&mut p);
        p
    };
    let unlabelled = |p: &Value| {
        let mut p = p.clone();
        p["metadata"]["labels"].as_object_mut().unwrap().remove(STORE_LABEL.0);
        p
    };
    let own_args = with(&|p| {
        containers(p).push(lookalike(json!({"args": ["--config", "/keys/evil.yaml"]})));
        p["spec"]["volumes"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "lockmesh-fence-config", "configMap": {"name": "my-own-signing-keys"}}));
        forge_status(p);
    });
    let sleep = with(&|p| {
        containers(p).push(lookalike(json!({"command": ["sleep", "infinity"]})));
        forge_status(p);
    });
    let nowhere = with(&|p| {
        let port = containers(p)[0].as_object_mut().unwrap().remove("ports").unwrap();
        containers(p).push(lookalike(
            json!({"ports": port, "env": [{"name": "LOCKMESH_FENCE_UPSTREAM", "value": "http://127.0.0.1:1"}]}),
        ));
        forge_status(p);
        p["metadata"]["labels"]["lockmesh.io/fenced"] = json!("true");
    });
    let status = with(&forge_status);
    let status_opted_in = with(&|p| {
        p["metadata"]["labels"] = json!({"app": "ledger-store"});
        forge_status(p);
    });
    let init = with(&|p| {
        p["spec"]["initContainers"] = json!([lookalike(json!({"command": ["true"]}))]);
        forge_status(p);
    });
    let tampered = |field: &str, value: Value| {
        let mut p = injected.clone();
        containers(&mut p).iter_mut().find(|c| c["name"] == "lockmesh-fence").unwrap()[field] = value;
        p
    };
    let mut with_init_emptied = injected.clone();
    with_init_emptied["spec"]["initContainers"] = json!([]);
    let mut other_sa = injected.clone();
    other_sa["spec"]["serviceAccountName"] = json!("not-the-store");
    // The injected pod with one more annotation, or the store label set to `v`.
    let annotated = |p: &Value, k: &str, v: Value| {
        let mut p = p.clone();
        annotations(&mut p).insert(k.into(), v);
        p
    };
    let store_label = |p: &Value, v: &str| {
        let mut p = p.clone();
        p["metadata"]["labels"][STORE_LABEL.0] = json!(v);
        p
    };
    let status_of = |value: Value| {
        with(&|p| {
            annotations(p).insert("lockmesh.io/fence-status".into(), value.clone());
        })
    };
    let mut own_keys_volume = injected.clone();
    for v in own_keys_volume["spec"]["volumes"].as_array_mut().unwrap() {
        if v["name"] == "lockmesh-fence-config" {
            v["configMap"]["name"] = json!("my-own-signing-keys");
        }
    }
    let digest = format!("ghcr.io/lockmesh/fence-proxy@sha256:{}", "0".repeat(64));
    vec![
        (
            LOOKALIKE,
            "/mutate",
            "lookalike with own args and signing keys, forged status",
            own_args,
            Want::Own(injected.clone()),
        ),
        (LOOKALIKE, "/mutate", "lookalike running sleep, forged status", sleep.clone(), Want::Own(injected.clone())),
        (
            LOOKALIKE,
            "/mutate",
            "lookalike holding the port, forwarding to nothing",
            nowhere,
            Want::Own(injected.clone()),
        ),
        (FORGED, "/mutate", "forged status annotation, selected by label", status, Want::Own(injected.clone())),
        (
            FORGED,
            "/mutate",
            "forged status annotation, opted in, not selected",
            status_opted_in,
            Want::Own(unlabelled(injected)),
        ),
        (
            LOOKALIKE,
            "/mutate",
            "init container named lockmesh-fence, forged status",
            init,
            Want::Own(with_init_emptied),
        ),
        (
            LOOKALIKE,
            "/mutate",
            "injected pod, fence args tampered",
            tampered("args", json!(["--config", "/x.yaml"])),
            Want::Own(injected.clone()),
        ),
        (
            LOOKALIKE,
            "/mutate",
            "injected pod, fence image tampered",
            tampered("image", json!("evil.example/x:1")),
            Want::Own(injected.clone()),
        ),
        (
            LOOKALIKE,
            "/mutate/store",
            "injected pod, fence running sleep",
            tampered("command", json!(["sleep", "1d"])),
            Want::Own(injected.clone()),
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: no selector label",
            unlabelled(&store_pod()),
            Want::Own(unlabelled(injected)),
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: no label, lookalike, forged status",
            unlabelled(&sleep),
            Want::Own(unlabelled(injected)),
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: another service account",
            with(&|p| p["spec"]["serviceAccountName"] = json!("not-the-store")),
            Want::Own(other_sa.clone()),
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: no label, no annotations",
            with(&|p| {
                p["metadata"]["labels"] = json!({"app": "ledger-store"});
                p["metadata"]["annotations"] = json!({});
            }),
            Want::Refused,
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: fence disabled",
            with(&|p| {
                annotations(p).insert("lockmesh.io/fence".into(), json!("disabled"));
            }),
            Want::Refused,
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: its own fence ConfigMap",
            with(&|p| {
                annotations(p).insert("lockmesh.io/fence-config".into(), json!("my-own-keys"));
            }),
            Want::Refused,
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: backend port 9090",
            with(&|p| {
                annotations(p).insert("lockmesh.io/fence-backend-port".into(), json!("9090"));
            }),
            Want::Refused,
        ),
        (
            LOOKALIKE,
            "/mutate",
            "lookalike listed before the store, forged status",
            with(&|p| {
                containers(p).insert(0, lookalike(json!({"args": ["--config", "/keys/evil.yaml"]})));
                forge_status(p);
            }),
            Want::Own(injected.clone()),
        ),
        (
            LOOKALIKE,
            "/mutate",
            "lookalike of the image by digest, forged status",
            with(&|p| {
                containers(p).push(lookalike(json!({"image": digest.clone(), "command": ["sleep", "infinity"]})));
                forge_status(p);
            }),
            Want::Own(injected.clone()),
        ),
        (
            LOOKALIKE,
            "/mutate",
            "injected pod, fence upstream env tampered",
            tampered("env", json!([{"name": "LOCKMESH_FENCE_UPSTREAM", "value": "http://127.0.0.1:1"}])),
            Want::Own(injected.clone()),
        ),
        (LOOKALIKE, "/mutate", "injected pod, fence ports removed", tampered("ports", json!([])), Want::Refused),
        (
            LOOKALIKE,
            "/mutate",
            "injected pod, fence runs privileged as root",
            tampered("securityContext", json!({"privileged": true, "runAsUser": 0})),
            Want::Own(injected.clone()),
        ),
        (
            LOOKALIKE,
            "/mutate/store",
            "injected pod, fence keys volume from the pod's own ConfigMap",
            own_keys_volume,
            Want::Own(injected.clone()),
        ),
        (
            FORGED,
            "/mutate",
            "forged status naming another container",
            status_of(json!(r#"{"version":1,"container":"app","storePort":8080,"backendPort":15081}"#)),
            Want::Own(injected.clone()),
        ),
        (
            FORGED,
            "/mutate",
            "forged status naming the store's port as the backend",
            status_of(json!(r#"{"version":1,"container":"lockmesh-fence","storePort":8080,"backendPort":8080}"#)),
            Want::Own(injected.clone()),
        ),
        (FORGED, "/mutate", "forged status as a bare word", status_of(json!("injected")), Want::Own(injected.clone())),
        (FORGED, "/mutate", "forged status empty", status_of(json!("")), Want::Own(injected.clone())),
        (
            FORGED,
            "/mutate",
            "forged status of a later version",
            status_of(json!(r#"{"version":2,"container":"lockmesh-fence"}"#)),
            Want::Own(injected.clone()),
        ),
        (
            FORGED,
            "/mutate",
            "forged status and fenced label",
            with(&|p| {
                forge_status(p);
                p["metadata"]["labels"]["lockmesh.io/fenced"] = json!("true");
            }),
            Want::Own(injected.clone()),
        ),
        (
            FORGED,
            "/mutate",
            "forged status under an upper-case key",
            with(&|p| {
                annotations(p).insert("Lockmesh.io/fence-status".into(), json!("injected"));
            }),
            Want::Own(annotated(injected, "Lockmesh.io/fence-status", json!("injected"))),
        ),
        (
            FORGED,
            "/mutate/store",
            "store namespace: no label, forged status only",
            with(&|p| {
                p["metadata"]["labels"].as_object_mut().unwrap().remove(STORE_LABEL.0);
                forge_status(p);
            }),
            Want::Own(unlabelled(injected)),
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: selector label set to false",
            store_label(&store_pod(), "false"),
            Want::Own(store_label(injected, "false")),
        ),
        (
            ESCAPE,
            "/mutate",
            "selector label value in upper case, opted in",
            store_label(&store_pod(), "TRUE"),
            Want::Own(store_label(injected, "TRUE")),
        ),
        (
            ESCAPE,
            "/mutate/store",
            "store namespace: another service account, no label",
            with(&|p| {
                p["spec"]["serviceAccountName"] = json!("not-the-store");
                p["metadata"]["labels"].as_object_mut().unwrap().remove(STORE_LABEL.0);
            }),
            Want::Own(unlabelled(&other_sa)),
        ),
    ]
}

#[tokio::test]
async fn no_variant_gets_through() {
    let webhook = Shipped::start();
    let injected = control(&webhook).await;
    let mut through = Vec::new();
    let all = variants(&injected);
    let mut per_kind = std::collections::BTreeMap::<&str, usize>::new();
    for (kind, _, _, _, _) in &all {
        *per_kind.entry(kind).or_default() += 1;
    }
    println!("variants per kind: {per_kind:?}");
    for kind in [LOOKALIKE, FORGED, ESCAPE] {
        assert!(per_kind.get(kind).copied().unwrap_or(0) >= MIN_PER_KIND, "{kind}: fewer than {MIN_PER_KIND} variants");
    }
    for (kind, path, what, pod, want) in &all {
        let body = review_of(pod);
        let r = webhook.client.post(format!("{}{path}", webhook.base)).body(body).send().await.unwrap();
        let got = if r.status() != 200 {
            format!("HTTP {}", r.status())
        } else {
            let r = r.json::<Value>().await.unwrap()["response"].clone();
            match (r["allowed"].as_bool(), r.get("patch").is_some()) {
                (Some(true), false) => "GOT THROUGH: admitted unpatched".to_owned(),
                (Some(true), true) => match want {
                    Want::Own(w) if patched(pod, &r) == *w => "ok: the webhook's own fence".to_owned(),
                    _ => "GOT THROUGH: patched, but not with the webhook's own fence".to_owned(),
                },
                _ => match want {
                    Want::Refused => "ok: refused".to_owned(),
                    Want::Own(_) => format!("refused (wanted the own fence): {}", r["status"]["message"]),
                },
            }
        };
        println!("{kind:26} {path:14} {what:60} {got}");
        if !got.starts_with("ok") {
            through.push(format!("{path} {what}: {got}"));
        }
    }
    assert!(through.is_empty(), "{} of {} variants not handled:\n{}", through.len(), all.len(), through.join("\n"));
}

/// An UPDATE review of `old` into `new` (on the `ephemeralcontainers`
/// subresource when `sub` is set), as the API server sends it.
fn update_review(old: &Value, new: &Value, sub: Option<&str>) -> Vec<u8> {
    let mut r: Value = serde_json::from_slice(&fixtures::admission("pod-opted-in.json")).unwrap();
    r["request"]["operation"] = json!("UPDATE");
    r["request"]["oldObject"] = old.clone();
    r["request"]["object"] = new.clone();
    r["request"]["options"] = json!({"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"});
    if let Some(sub) = sub {
        r["request"]["subResource"] = json!(sub);
    }
    serde_json::to_vec(&r).unwrap()
}

/// After admission the pod's author cannot undo the fence: the fence's image
/// (`kubectl set image`), the fenced labels, an ephemeral container sharing the
/// pod's loopback (`kubectl debug`). Other updates pass (positive controls).
#[tokio::test]
async fn an_admitted_fence_cannot_be_undone_by_an_update() {
    let webhook = Shipped::start();
    let injected = control(&webhook).await;
    let post = async |path: &str, body: Vec<u8>| -> Value {
        let r = webhook.client.post(format!("{}{path}", webhook.base)).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["response"].clone()
    };
    let debug = json!([{"name": "debugger", "image": "busybox", "command": ["sh"], "targetContainerName": "ledger"}]);
    let mut image = injected.clone();
    containers(&mut image).iter_mut().find(|c| c["name"] == "lockmesh-fence").unwrap()["image"] = json!("busybox");
    let mut unlabelled = injected.clone();
    unlabelled["metadata"]["labels"].as_object_mut().unwrap().remove("lockmesh.io/fenced");
    let mut ephemeral = injected.clone();
    ephemeral["spec"]["ephemeralContainers"] = debug.clone();
    for path in ["/mutate", "/mutate/store"] {
        for (what, new, sub, want) in [
            ("fence image changed", &image, None, "container is the injector's"),
            ("fenced label removed", &unlabelled, None, "label lockmesh.io/fenced"),
            ("ephemeral container", &ephemeral, Some("ephemeralcontainers"), "shares its loopback"),
        ] {
            let r = post(path, update_review(&injected, new, sub)).await;
            assert_eq!(r["allowed"], false, "{path} {what}: GOT THROUGH: {r}");
            let message = r["status"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(want), "{path} {what}: {message}");
        }
        // Positive control: an unrelated label change of the fenced pod.
        let mut relabelled = injected.clone();
        relabelled["metadata"]["labels"]["tier"] = json!("gold");
        let r = post(path, update_review(&injected, &relabelled, None)).await;
        assert!(r["allowed"] == true && r.get("patch").is_none(), "{path}: {r}");
    }
    // Positive control: a pod without a fence, outside store namespaces, may be debugged.
    let mut web = store_pod();
    web["metadata"]["labels"] = json!({"app": "web"});
    web["metadata"]["annotations"] = json!({});
    let mut debugged = web.clone();
    debugged["spec"]["ephemeralContainers"] = debug;
    let r = post("/mutate", update_review(&web, &debugged, Some("ephemeralcontainers"))).await;
    assert_eq!(r["allowed"], true, "{r}");
    // In a store namespace it may not.
    let r = post("/mutate/store", update_review(&web, &debugged, Some("ephemeralcontainers"))).await;
    assert_eq!(r["allowed"], false, "{r}");
}

/// A pod whose fence came with it (a `lockmesh-inject`ed template) reaches the
/// webhook with the API server's defaults filled in: still the injector's own,
/// allowed with no patch; a default-looking change that is not a default is not.
#[tokio::test]
async fn an_injected_pod_with_api_defaults_is_recognised() {
    let webhook = Shipped::start();
    let injected = control(&webhook).await;
    let mut defaulted = injected.clone();
    let fence = containers(&mut defaulted).iter_mut().find(|c| c["name"] == "lockmesh-fence").unwrap();
    fence["terminationMessagePath"] = json!("/dev/termination-log");
    for probe in ["readinessProbe", "livenessProbe"] {
        fence[probe]["successThreshold"] = json!(1);
        fence[probe]["httpGet"]["scheme"] = json!("HTTP");
    }
    for v in defaulted["spec"]["volumes"].as_array_mut().unwrap() {
        if v["name"] == "lockmesh-fence-config" {
            v["configMap"]["defaultMode"] = json!(420);
        }
    }
    for path in ["/mutate", "/mutate/store"] {
        let r = webhook.post(path, &defaulted).await;
        assert!(r["allowed"] == true && r.get("patch").is_none(), "{path}: {r}");
    }
    let mut https = defaulted.clone();
    containers(&mut https).iter_mut().find(|c| c["name"] == "lockmesh-fence").unwrap()["readinessProbe"]["httpGet"]
        ["scheme"] = json!("HTTPS");
    must_get_own_fence(&webhook, "/mutate/store", "probe scheme changed", &https, &injected).await;
}

/// A pod holding another long-running container beside the store: every
/// container shares the pod's loopback, so one of them could re-expose the
/// store's own port (socat, an nginx stream, an SSH tunnel) past the fence.
/// Only the admins' `companions` (by name and image) may run beside a store.
fn relay_variants() -> Vec<(&'static str, &'static str, Value)> {
    let beside = |extra: Value| {
        let mut p = store_pod();
        annotations(&mut p).insert("lockmesh.io/fence-store-container".into(), json!("ledger"));
        containers(&mut p).push(extra);
        p
    };
    let socat = json!({"name": "relay", "image": "alpine/socat:1.8",
        "args": ["TCP-LISTEN:9000,fork,reuseaddr", "TCP:127.0.0.1:15081"], "ports": [{"containerPort": 9000}]});
    let mut native = store_pod();
    native["spec"]["initContainers"] = json!([{"name": "relay", "image": "alpine/socat:1.8", "restartPolicy": "Always",
        "args": ["TCP-LISTEN:9000,fork", "TCP:127.0.0.1:15081"]}]);
    let mut store_named_relay = store_pod();
    annotations(&mut store_named_relay).insert("lockmesh.io/fence-store-container".into(), json!("relay"));
    containers(&mut store_named_relay).push(json!({"name": "relay", "image": "alpine/socat:1.8",
        "ports": [{"name": "http", "containerPort": 8081}], "env": [{"name": "PORT", "value": "8081"}]}));
    annotations(&mut store_named_relay).insert("lockmesh.io/fence-store-port".into(), json!("8081"));
    vec![
        ("/mutate", "socat relay container", beside(socat.clone())),
        ("/mutate/store", "socat relay container, store namespace", beside(socat)),
        ("/mutate", "relay with no declared port", beside(json!({"name": "relay", "image": "alpine/socat:1.8"}))),
        ("/mutate", "native sidecar init container relay", native),
        (
            "/mutate",
            "relay under a companion's name (metrics), another image",
            beside(json!({"name": "metrics", "image": "alpine/socat:1.8"})),
        ),
        (
            "/mutate",
            "companion's image under another name",
            beside(json!({"name": "relay", "image": "registry.example.com/exporter:2.0"})),
        ),
        (
            "/mutate",
            "companion's repository as a longer name",
            beside(json!({"name": "metrics", "image": "registry.example.com/exporter-evil:2.0"})),
        ),
        (
            "/mutate",
            "companion's image on another registry",
            beside(json!({"name": "metrics", "image": "evil.example/registry.example.com/exporter:2.0"})),
        ),
        (
            "/mutate",
            "second copy of the store's own image",
            beside(json!({"name": "ledger-2", "image": "registry.example.com/ledger-store:4.2.1"})),
        ),
        ("/mutate", "the relay named as the store, the real store beside it", store_named_relay),
        ("/mutate", "two companions, one relay among them", {
            let mut p = beside(json!({"name": "metrics", "image": "registry.example.com/exporter:2.0"}));
            containers(&mut p).push(json!({"name": "nginx", "image": "nginx:1.27", "command": ["nginx"]}));
            p
        }),
    ]
}

/// The admins' companion the relay tests list (a metrics exporter).
const COMPANION: &str = "companions:\n- {name: metrics, image: 'registry.example.com/exporter:*'}\n";

#[tokio::test]
async fn no_container_beside_a_store_re_exposes_its_port() {
    let variants = relay_variants();
    assert!(variants.len() >= MIN_PER_KIND);
    for (config, webhook) in [("shipped", Shipped::start()), ("with a companion", Shipped::start_adding(COMPANION))] {
        for (path, what, pod) in &variants {
            must_be_refused(&webhook, path, &format!("{config}: {what}"), pod, "[unlisted_container]").await;
        }
    }
    // Positive controls: the listed companion beside the store is injected, the
    // shipped config (no companions) refuses it, a run-to-completion init
    // container is allowed.
    let webhook = Shipped::start_adding(COMPANION);
    let mut with_exporter = store_pod();
    annotations(&mut with_exporter).insert("lockmesh.io/fence-store-container".into(), json!("ledger"));
    containers(&mut with_exporter).push(json!({"name": "metrics", "image": "registry.example.com/exporter:2.0"}));
    let r = webhook.post("/mutate", &with_exporter).await;
    assert!(r["allowed"] == true && r.get("patch").is_some(), "the listed companion: {r}");
    let out = patched(&with_exporter, &r);
    the_fence(&out);
    let shipped = Shipped::start();
    must_be_refused(&shipped, "/mutate", "companion under the shipped config", &with_exporter, "[unlisted_container]")
        .await;
    let mut migrate = store_pod();
    migrate["spec"]["initContainers"] =
        json!([{"name": "migrate", "image": "registry.example.com/ledger-store:4.2.1"}]);
    let r = shipped.post("/mutate", &migrate).await;
    assert!(r["allowed"] == true && r.get("patch").is_some(), "a run-to-completion init container: {r}");

    // After admission a companion keeps an image the admins listed for it.
    let admitted = out;
    let post = async |body: Vec<u8>| -> Value {
        let r = webhook.client.post(format!("{}/mutate", webhook.base)).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["response"].clone()
    };
    let mut swapped = admitted.clone();
    containers(&mut swapped).iter_mut().find(|c| c["name"] == "metrics").unwrap()["image"] = json!("alpine/socat:1.8");
    let r = post(update_review(&admitted, &swapped, None)).await;
    assert_eq!(r["allowed"], false, "a companion's image swapped for a relay: GOT THROUGH: {r}");
    assert!(r["status"]["message"].as_str().unwrap_or_default().contains("companion"), "{r}");
    let mut upgraded = admitted.clone();
    containers(&mut upgraded).iter_mut().find(|c| c["name"] == "metrics").unwrap()["image"] =
        json!("registry.example.com/exporter:2.1");
    let r = post(update_review(&admitted, &upgraded, None)).await;
    assert_eq!(r["allowed"], true, "a listed image for the companion: {r}");
}
