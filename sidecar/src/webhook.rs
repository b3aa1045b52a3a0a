//! The mutating admission webhook's decision: an `admission.k8s.io/v1`
//! AdmissionReview request in, the AdmissionReview response out, with the
//! injection as a base64 JSONPatch. No I/O here; `server` carries it over TLS.
//!
//! Two entry points, chosen by the MutatingWebhookConfiguration (admin-owned):
//! [`review`] (`/mutate`: the injector's config decides which pods are stores)
//! and [`review_store`] (`/mutate/store`: the namespace is a store namespace,
//! every pod in it is a store).
//!
//! Answers:
//! - a Pod CREATE that is selected or opted in: allowed, with the patch (and
//!   warnings); a `lockmesh-fence` container, fence volume, status annotation or
//!   fenced label of the pod's own is replaced by the injector's;
//! - a Pod neither selected nor opted in, a Pod that is already exactly what
//!   injection makes of it, another kind or operation: allowed, no patch;
//! - a Pod that is selected or opted in but cannot be injected: denied (HTTP
//!   code 400 in the status), the message listing every reason with its code
//!   and field.

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    annotations,
    config::Config,
    inject::CONTAINER,
    inject::{inject_in, Outcome, Scope},
    patch,
};

/// The only AdmissionReview version served.
pub(crate) const API_VERSION: &str = "admission.k8s.io/v1";

/// An AdmissionReview (request or response form). Unknown fields are ignored:
/// the API server sends more than the webhook needs.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionReview {
    /// Must be [`API_VERSION`].
    pub api_version: String,
    /// Must be `AdmissionReview`.
    pub kind: String,
    /// Set by the API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<AdmissionRequest>,
    /// Set by the webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<AdmissionResponse>,
}

/// The parts of an admission request the injector reads.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    /// Echoed in the response.
    pub uid: String,
    /// The object's group/version/kind.
    pub kind: GroupVersionKind,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    pub operation: String,
    /// The request's namespace, set by the API server (the object may lack its
    /// own); the store selection reads it.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The object being admitted.
    #[serde(default)]
    pub object: Option<Value>,
    /// The object before an UPDATE.
    #[serde(default)]
    pub old_object: Option<Value>,
    /// The subresource (`ephemeralcontainers` for `kubectl debug`), if any.
    #[serde(default)]
    pub sub_resource: Option<String>,
    /// Whether the request is a dry run (answered the same; the injector has no side effects).
    #[serde(default)]
    pub dry_run: Option<bool>,
}

/// A group/version/kind triple.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct GroupVersionKind {
    /// API group (`""` for the core group).
    #[serde(default)]
    pub group: String,
    /// API version.
    pub version: String,
    pub kind: String,
}

/// The webhook's answer.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    /// The request's uid.
    pub uid: String,
    /// Whether the object is admitted.
    pub allowed: bool,
    /// Why not, when denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    /// Base64 of the JSON Patch, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// `JSONPatch` when `patch` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<String>,
    /// Shown to the user by kubectl.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A denial's status (a subset of `metav1.Status`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
pub struct Status {
    /// HTTP-style code.
    pub code: u16,
    /// Reason (`BadRequest`).
    pub reason: String,
    /// The full message.
    pub message: String,
}

/// Why a body is not a review the webhook can answer (HTTP 400, no review).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON of the AdmissionReview shape.
    #[error("body is not an AdmissionReview: {0}")]
    Json(#[from] serde_json::Error),
    /// Wrong apiVersion or kind.
    #[error("apiVersion must be {API_VERSION} and kind AdmissionReview, got {api_version} {kind}")]
    Version {
        /// What was sent.
        api_version: String,
        /// What was sent.
        kind: String,
    },
    /// No `request` member.
    #[error("AdmissionReview has no request")]
    NoRequest,
}

/// What a review decided, for logs and metrics (never the object itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Patched.
    Injected,
    /// Allowed without a patch (not opted in, already injected, other kind or operation).
    Untouched,
    Denied,
}

/// Answers one AdmissionReview body sent to `/mutate`: the injector's config
/// decides which pods are stores.
pub fn review(body: &[u8], config: &Config) -> Result<(AdmissionReview, Verdict), ReviewError> {
    answer(body, config, false)
}

/// Answers one AdmissionReview body sent to `/mutate/store`: the webhook
/// configuration sends only namespaces labelled `lockmesh.io/fence-injection:
/// store` there, and every pod in them is a fenced store (injected or refused).
pub fn review_store(body: &[u8], config: &Config) -> Result<(AdmissionReview, Verdict), ReviewError> {
    answer(body, config, true)
}

fn answer(body: &[u8], config: &Config, store_namespace: bool) -> Result<(AdmissionReview, Verdict), ReviewError> {
    let review: AdmissionReview = serde_json::from_slice(body)?;
    if review.api_version != API_VERSION || review.kind != "AdmissionReview" {
        return Err(ReviewError::Version { api_version: review.api_version, kind: review.kind });
    }
    let request = review.request.ok_or(ReviewError::NoRequest)?;
    let (response, verdict) = respond(&request, config, store_namespace);
    Ok((
        AdmissionReview {
            api_version: API_VERSION.into(),
            kind: "AdmissionReview".into(),
            request: None,
            response: Some(response),
        },
        verdict,
    ))
}

fn respond(request: &AdmissionRequest, config: &Config, store_namespace: bool) -> (AdmissionResponse, Verdict) {
    let allow = AdmissionResponse {
        uid: request.uid.clone(),
        allowed: true,
        status: None,
        patch: None,
        patch_type: None,
        warnings: Vec::new(),
    };
    let is_pod = request.kind.group.is_empty() && request.kind.version == "v1" && request.kind.kind == "Pod";
    if is_pod && request.operation == "UPDATE" {
        if let (Some(old), Some(new)) = (&request.old_object, &request.object) {
            let problems = guard_update(old, new, request.sub_resource.as_deref(), store_namespace, &config.companions);
            if !problems.is_empty() {
                let message = format!("lockmesh fence: update refused: {}", problems.join("; "));
                return (deny(allow, message), Verdict::Denied);
            }
        }
        return (allow, Verdict::Untouched);
    }
    let Some(pod) = request.object.as_ref().filter(|_| is_pod && request.operation == "CREATE") else {
        return (allow, Verdict::Untouched);
    };
    // The API server may send the object without apiVersion/kind; the request says what it is.
    let mut pod = pod.clone();
    if let Some(m) = pod.as_object_mut() {
        m.entry("kind").or_insert_with(|| Value::from("Pod"));
        m.entry("apiVersion").or_insert_with(|| Value::from("v1"));
    }
    // The namespace the API server admits the pod into (a pod's own
    // metadata.namespace must equal it on CREATE; it is the fallback only).
    let namespace = request
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(|| pod.pointer("/metadata/namespace").and_then(Value::as_str).map(str::to_owned));
    match inject_in(&pod, config, &Scope { namespace, store_namespace }) {
        Ok(Outcome::Injected(injected)) => {
            let ops = patch::diff(&pod, &injected.object);
            match serde_json::to_vec(&ops) {
                Ok(json) => (
                    AdmissionResponse {
                        patch: Some(base64::engine::general_purpose::STANDARD.encode(json)),
                        patch_type: Some("JSONPatch".into()),
                        warnings: injected.warnings,
                        ..allow
                    },
                    Verdict::Injected,
                ),
                Err(e) => (
                    deny(allow, format!("lockmesh fence injection failed: cannot encode the patch: {e}")),
                    Verdict::Denied,
                ),
            }
        }
        Ok(Outcome::Untouched | Outcome::AlreadyInjected) => (allow, Verdict::Untouched),
        Err(e) => (deny(allow, format!("lockmesh fence injection refused: {e}")), Verdict::Denied),
    }
}

/// Why an UPDATE of a running pod would undo its fence (empty when it would not).
/// The webhook injected the fence at CREATE; afterwards a pod's author could
/// still change the fence container's image (the one container field an update
/// may change), drop the labels the NetworkPolicy selects, or add an ephemeral
/// container (`kubectl debug`), which shares the pod's loopback and so reaches
/// the store's own port, or change a companion's image to one the admins did not
/// list (`companions`). For a pod with a `lockmesh-fence` container, and for
/// every pod of a store namespace (`store_namespace`), those are refused.
pub fn guard_update(
    old: &Value,
    new: &Value,
    sub_resource: Option<&str>,
    store_namespace: bool,
    companions: &[crate::config::Companion],
) -> Vec<String> {
    let fence = |p: &Value| -> Vec<Value> {
        p.pointer("/spec/containers")
            .and_then(Value::as_array)
            .map(|cs| cs.iter().filter(|c| c.get("name").and_then(Value::as_str) == Some(CONTAINER)).cloned().collect())
            .unwrap_or_default()
    };
    let label = |p: &Value, k: &str| p.pointer("/metadata/labels").and_then(|l| l.get(k)).cloned();
    let fenced = !fence(old).is_empty() || store_namespace;
    let mut problems = Vec::new();
    if !fenced {
        return problems;
    }
    if fence(old) != fence(new) {
        problems.push(format!("the {CONTAINER} container is the injector's and cannot be changed or removed"));
    }
    for k in [annotations::FENCED_LABEL, annotations::BACKEND_PORT_LABEL] {
        if label(old, k) != label(new, k) {
            problems.push(format!("label {k} selects the fenced store's NetworkPolicy and cannot be changed"));
        }
    }
    // Containers named as a companion keep an image the admins listed for that
    // name; the one other container is the store, whose image is its own.
    let images = |p: &Value| -> Vec<(String, String)> {
        let field = |c: &Value, k: &str| c.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        ["/spec/containers", "/spec/initContainers"]
            .iter()
            .filter_map(|at| p.pointer(at).and_then(Value::as_array))
            .flatten()
            .map(|c| (field(c, "name"), field(c, "image")))
            .collect()
    };
    let before = images(old);
    for (name, image) in images(new) {
        let listed: Vec<_> = companions.iter().filter(|k| k.name == name).collect();
        let changed = !before.iter().any(|(n, i)| *n == name && *i == image);
        if changed && !listed.is_empty() && !listed.iter().any(|k| k.admits(&name, &image)) {
            problems.push(format!(
                "container {name:?} is a companion of a fenced store and may run only the images the admins listed \
                 for it, not {image}"
            ));
        }
    }
    let ephemeral = |p: &Value| p.pointer("/spec/ephemeralContainers").cloned().unwrap_or(Value::Null);
    let ephemeral_added = match (ephemeral(old), ephemeral(new)) {
        (Value::Null, Value::Array(a)) => !a.is_empty(),
        (o, n) => o != n && !n.is_null(),
    };
    if sub_resource == Some("ephemeralcontainers") && ephemeral_added {
        problems.push(
            "an ephemeral container in a fenced store's pod shares its loopback and would reach the store's own \
             port past the fence: debug a copy of the pod instead (kubectl debug --copy-to)"
                .to_owned(),
        );
    }
    problems
}

fn deny(base: AdmissionResponse, message: String) -> AdmissionResponse {
    AdmissionResponse {
        allowed: false,
        status: Some(Status { code: 400, reason: "BadRequest".into(), message }),
        ..base
    }
}
