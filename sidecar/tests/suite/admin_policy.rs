//! Issue #17 item 7 and issue 41: injection decided by the admin, not by the pod.
//! With the injector's `store_selector` (`app: ledger-store`) and
//! `fence_config_map` (`ledger-fence`), every way a pod could opt out — the opt-in
//! annotation set to `disabled` or absent, a fence ConfigMap of its own choosing
//! (and so its own trusted signing keys) — is refused with `admin_policy`, never
//! silently skipped; a forged `lockmesh.io/fence-status` or a lookalike fence
//! container is not believed (the injector's own fence replaces it); a selected
//! pod that opts in is injected; an injected pod is recognised only by injecting
//! it again; a pod the selector does not match is untouched (positive control).
//! Selection by namespace and service account (config) and by the `/mutate/store`
//! path. The same reviews also go through the real HTTPS webhook process started
//! with that configuration (`lookalikes.rs` does so with the shipped one).

use lockmesh_sidecar::{
    webhook::{review, review_store, AdmissionResponse, Verdict},
    Config,
};
use serde_json::{json, Value};

use crate::fixtures;

/// The injector configuration of these tests.
pub const CONFIG: &str = "store_selector:\n  pod_labels: {app: ledger-store}\nfence_config_map: ledger-fence\n";

/// The opted-in ledger pod's review, with `edit` applied to its object.
pub fn ledger_review(edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut r: Value = serde_json::from_slice(&fixtures::admission("pod-opted-in.json")).unwrap();
    edit(&mut r["request"]["object"]);
    serde_json::to_vec(&r).unwrap()
}

fn answer(body: &[u8]) -> (AdmissionResponse, Verdict) {
    let config = Config::parse(CONFIG, "injector.yaml").unwrap();
    let (review, verdict) = review(body, &config).unwrap();
    (review.response.unwrap(), verdict)
}

fn annotations(pod: &mut Value) -> &mut serde_json::Map<String, Value> {
    pod["metadata"]["annotations"].as_object_mut().unwrap()
}

/// Every opt-out of a selected store pod, by name.
pub fn opt_outs() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    vec![
        (
            "fence: disabled",
            ledger_review(|p| {
                annotations(p).insert("lockmesh.io/fence".into(), json!("disabled"));
            }),
            "store_selector (app=ledger-store)",
        ),
        (
            "no opt-in annotation",
            ledger_review(|p| {
                annotations(p).remove("lockmesh.io/fence");
            }),
            "injected or refused, never left unfenced",
        ),
        (
            "a fence ConfigMap of its own (its own trusted keys)",
            ledger_review(|p| {
                annotations(p).insert("lockmesh.io/fence-config".into(), json!("my-own-keys"));
            }),
            "come from the injector's ConfigMap \"ledger-fence\" only",
        ),
        (
            "the selector label with every opt-out at once",
            ledger_review(|p| {
                let a = annotations(p);
                a.insert("lockmesh.io/fence".into(), json!("disabled"));
                a.insert("lockmesh.io/fence-status".into(), json!("{}"));
                a.insert("lockmesh.io/fence-config".into(), json!("my-own-keys"));
            }),
            "admin_policy",
        ),
    ]
}

#[test]
fn an_opt_out_of_a_selected_store_is_refused_never_skipped() {
    for (what, body, want) in opt_outs() {
        let (r, verdict) = answer(&body);
        assert_eq!(verdict, Verdict::Denied, "{what}: {r:?}");
        assert!(!r.allowed && r.patch.is_none(), "{what}: {r:?}");
        let message = r.status.unwrap().message;
        assert!(message.contains("admin_policy") && message.contains(want), "{what}: {message}");
    }
}

#[test]
fn a_selected_store_that_opts_in_is_injected_and_then_recognised() {
    let (r, verdict) = answer(&ledger_review(|_| {}));
    assert_eq!(verdict, Verdict::Injected, "{r:?}");
    // Naming no ConfigMap: the injector's own is mounted.
    let (r, verdict) = answer(&ledger_review(|p| {
        annotations(p).remove("lockmesh.io/fence-config");
    }));
    assert_eq!(verdict, Verdict::Injected, "{r:?}");
    let patch = String::from_utf8(
        base64::Engine::decode(&base64::engine::general_purpose::STANDARD, r.patch.unwrap()).unwrap(),
    )
    .unwrap();
    assert!(patch.contains("\"name\":\"ledger-fence\""), "{patch}");
    // An injected pod is left alone: injecting it again gives the same pod.
    let (r, _) = answer(&ledger_review(|_| {}));
    let once = apply(&ledger_object(|_| {}), &r);
    let (again, verdict) = answer(&ledger_review(|p| *p = once.clone()));
    assert_eq!(verdict, Verdict::Untouched, "{again:?}");
    // A pod that only looks injected (status, a fence container of the configured
    // image) gets the injector's fence in place of its own.
    let lookalike = |p: &mut Value| {
        annotations(p).insert("lockmesh.io/fence-status".into(), json!("{}"));
        p["spec"]["containers"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "lockmesh-fence", "image": Config::default().image, "command": ["sleep", "1d"]}));
    };
    let (r, verdict) = answer(&ledger_review(lookalike));
    assert_eq!(verdict, Verdict::Injected, "{r:?}");
    assert!(
        r.warnings[0].contains(
            "the pod's own container lockmesh-fence, annotation lockmesh.io/fence-status are not the injector's"
        ),
        "{:?}",
        r.warnings
    );
    assert_eq!(apply(&ledger_object(lookalike), &r), once);
}

fn ledger_object(edit: impl FnOnce(&mut Value)) -> Value {
    let r: Value = serde_json::from_slice(&ledger_review(edit)).unwrap();
    r["request"]["object"].clone()
}

fn apply(pod: &Value, r: &AdmissionResponse) -> Value {
    let bytes = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, r.patch.as_ref().unwrap()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
    let mut doc = pod.clone();
    json_patch::patch(&mut doc, &patch).unwrap();
    doc
}

/// Selection by what the admins own: a namespace listed in the config, a service
/// account, the store path. Leaving the pod-label selection does not leave these.
#[test]
fn namespaces_and_service_accounts_select_whatever_the_pod_says() {
    let config =
        Config::parse("store_selector:\n  namespaces: [payments]\nfence_config_map: ledger-fence\n", "injector.yaml")
            .unwrap();
    let plain = |p: &mut Value| {
        p["metadata"]["labels"] = json!({"app": "web"});
        p["metadata"]["annotations"] = json!({});
    };
    let (r, verdict) = review(&ledger_review(plain), &config).unwrap();
    assert_eq!(verdict, Verdict::Denied, "{r:?}");
    let message = r.response.unwrap().status.unwrap().message;
    assert!(message.contains("store_selector.namespaces (payments)"), "{message}");
    // The label dropped, the pod opted in: injected.
    let (_, verdict) = review(&ledger_review(|p| p["metadata"]["labels"] = json!({})), &config).unwrap();
    assert_eq!(verdict, Verdict::Injected);
    // Another namespace: not selected.
    let other = ledger_review(|p| {
        plain(p);
        p["metadata"]["namespace"] = json!("shop");
    });
    let mut other: Value = serde_json::from_slice(&other).unwrap();
    other["request"]["namespace"] = json!("shop");
    let (_, verdict) = review(&serde_json::to_vec(&other).unwrap(), &config).unwrap();
    assert_eq!(verdict, Verdict::Untouched);

    let by_sa = Config::parse(
        "store_selector:\n  service_accounts: [payments/ledger]\nfence_config_map: ledger-fence\n",
        "injector.yaml",
    )
    .unwrap();
    let sa = |name: &'static str| {
        ledger_review(move |p| {
            plain(p);
            p["spec"]["serviceAccountName"] = json!(name);
        })
    };
    assert_eq!(review(&sa("ledger"), &by_sa).unwrap().1, Verdict::Denied);
    // A pod choosing another account leaves that part of the selection only.
    assert_eq!(review(&sa("default"), &by_sa).unwrap().1, Verdict::Untouched);

    // The store path: every pod is a store, even with the default config.
    let (r, verdict) = review_store(&ledger_review(plain), &Config::default()).unwrap();
    assert_eq!(verdict, Verdict::Denied);
    let message = r.response.unwrap().status.unwrap().message;
    assert!(message.contains("lockmesh.io/fence-injection=store"), "{message}");
    assert!(message.contains("sets no fence_config_map"), "{message}");
}

#[test]
fn a_pod_the_selector_does_not_match_is_untouched() {
    for labels in [json!({"app": "web"}), json!({}), json!({"app": "ledger-store-2"})] {
        let body = ledger_review(|p| {
            p["metadata"]["labels"] = labels.clone();
            p["metadata"]["annotations"] = json!({});
        });
        let (r, verdict) = answer(&body);
        assert_eq!(verdict, Verdict::Untouched, "{labels}: {r:?}");
        assert!(r.allowed && r.patch.is_none(), "{labels}: {r:?}");
    }
}

#[test]
fn the_config_check_says_what_it_selects_and_excludes() {
    let lines = Config::parse(CONFIG, "injector.yaml").unwrap().selection().join("\n");
    assert!(lines.contains("every pod labelled app=ledger-store is injected or refused"), "{lines}");
    assert!(lines.contains("ConfigMap ledger-fence only"), "{lines}");
    assert!(lines.contains("never kube-system or lockmesh-system"), "{lines}");
    assert!(!lines.contains("may opt out"), "{lines}");
    let default = Config::default().selection().join("\n");
    assert!(default.contains("a pod may opt out"), "{default}");
    let errs = Config::parse("store_selector: {pod_labels: {}}\nfence_config_map: Not_A_Name\n", "i.yaml").unwrap_err();
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert!(text.iter().any(|e| e.starts_with("i.yaml: store_selector: must name")), "{text:?}");
    assert!(text.iter().any(|e| e.starts_with("i.yaml: fence_config_map:")), "{text:?}");
    let errs =
        Config::parse("store_selector: {namespaces: [Bad_NS], service_accounts: [nobody]}\n", "i.yaml").unwrap_err();
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert!(text.iter().any(|e| e.starts_with("i.yaml: store_selector.namespaces:")), "{text:?}");
    assert!(text.iter().any(|e| e.contains("\"nobody\" is not NAMESPACE/SERVICE_ACCOUNT")), "{text:?}");
    assert!(text.iter().any(|e| e.starts_with("i.yaml: fence_config_map: required with store_selector")), "{text:?}");
}

/// The same decisions through the real HTTPS webhook process started with the
/// injector configuration: every opt-out is denied, the positive controls pass.
#[tokio::test]
async fn the_webhook_process_refuses_every_opt_out_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = crate::tls::pki(dir.path());
    let config = dir.path().join("injector.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let (_webhook, base) = crate::tls::start_with(dir.path(), &["--config".as_ref(), config.as_os_str()]);
    let client = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .unwrap();
    let post = async |body: Vec<u8>| -> Value {
        let r = client.post(format!("{base}/mutate")).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["response"].clone()
    };
    for (what, body, want) in opt_outs() {
        let r = post(body).await;
        assert_eq!(r["allowed"], false, "{what}: {r}");
        assert!(r.get("patch").is_none(), "{what}: {r}");
        let message = r["status"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("admin_policy") && message.contains(want), "{what}: {message}");
    }
    let injected = post(ledger_review(|_| {})).await;
    assert_eq!((injected["allowed"].as_bool(), injected["patchType"].as_str()), (Some(true), Some("JSONPatch")));
    let other = post(ledger_review(|p| {
        p["metadata"]["labels"] = json!({"app": "web"});
        p["metadata"]["annotations"] = json!({});
    }))
    .await;
    assert_eq!(other["allowed"], true, "{other}");
    assert!(other.get("patch").is_none(), "{other}");
}
