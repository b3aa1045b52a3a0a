//! The one pure injection function shared by `lockmesh-inject` and the webhook:
//! an object (Pod, Deployment or StatefulSet, as JSON) and the injector
//! [`Config`] in, the object with fence-proxy in front of its store out.
//!
//! What injection does to an opted-in pod (template), all or nothing:
//! - the store's client-facing `containerPort` entry (number, name, protocol) is
//!   moved from the store container to the injected `lockmesh-fence` container, so
//!   Services (by `targetPort` number or name) and clients now reach fence-proxy;
//! - the store is told to listen on `127.0.0.1:<backend port>` through the
//!   environment variables named by the pod's annotations;
//! - fence-proxy gets its ConfigMap mounted read-only, a persistent volume for
//!   its marks (a named claim, or a StatefulSet claim template; never scratch
//!   space), resources, readiness and liveness probes on its admin port, a
//!   non-root read-only security context, and env telling it where to listen
//!   and forward;
//! - labels `lockmesh.io/fenced` and `lockmesh.io/fenced-backend-port` (selected by
//!   the NetworkPolicy) and the `lockmesh.io/fence-status` annotation, whose
//!   presence makes a second injection a no-op.

use serde_json::{json, Map, Value};

use crate::{
    annotations::{self, Request},
    config::Config,
    refusal::{Code, InjectError, Refusal},
};

mod plan;

use plan::{plan, Plan};

/// Name of the injected container.
pub const CONTAINER: &str = "lockmesh-fence";
/// Name of the injected ConfigMap volume.
pub(crate) const CONFIG_VOLUME: &str = "lockmesh-fence-config";
/// Name of the marks volume (and of the StatefulSet claim template).
pub const MARKS_VOLUME: &str = "lockmesh-fence-marks";
/// Where fence-proxy's ConfigMap is mounted.
pub(crate) const CONFIG_DIR: &str = "/etc/lockmesh/fence";
/// The key fence-proxy reads from its ConfigMap.
pub(crate) const CONFIG_FILE: &str = "fence-proxy.yaml";
/// Where the marks volume is mounted.
pub const MARKS_DIR: &str = "/var/lib/lockmesh/marks";
/// Name of fence-proxy's admin container port.
pub(crate) const ADMIN_PORT_NAME: &str = "fence-admin";
/// Env: the address fence-proxy listens on for clients.
pub const ENV_LISTEN: &str = "LOCKMESH_FENCE_LISTEN";
/// Env: the URL fence-proxy forwards admitted requests to (the store on loopback).
pub const ENV_UPSTREAM: &str = "LOCKMESH_FENCE_UPSTREAM";
/// Env: the address of fence-proxy's admin listener.
pub const ENV_ADMIN_LISTEN: &str = "LOCKMESH_FENCE_ADMIN_LISTEN";
/// Env: the directory of fence-proxy's durable marks.
pub const ENV_MARKS_DIR: &str = "LOCKMESH_FENCE_MARKS_DIR";

/// The result of [`inject`].
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// No opt-in, or a kind without a pod template: nothing to do.
    Untouched,
    /// The `lockmesh.io/fence-status` annotation is present: nothing to do.
    AlreadyInjected,
    /// The fence was injected.
    Injected(Injected),
}

/// An injected object and what the caller should know about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Injected {
    /// The whole object, injected.
    pub object: Value,
    /// Advice that does not refuse the injection (for example a store probe that
    /// now goes through fence-proxy).
    pub warnings: Vec<String>,
    /// The loopback port the store moved to.
    pub backend_port: u16,
}

/// Where the marks volume comes from, by workload kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MarksSource {
    /// A bare Pod: an existing `lockmesh-fence-marks` PVC volume (a StatefulSet's
    /// pod) or the claim named by annotation.
    PodVolumeOrClaim,
    /// A Deployment: the claim named by annotation (one replica).
    Claim,
    /// A StatefulSet: a claim template per replica.
    ClaimTemplate,
}

/// Injects fence-proxy into `object` if its pod (template) opted in.
///
/// Pure: no I/O, the input is not modified, and `inject` of an injected object
/// returns [`Outcome::AlreadyInjected`]. Kinds other than Pod, Deployment and
/// StatefulSet are untouched unless their pod template opted in, which is refused
/// (they cannot keep one fence with its own persistent marks per store).
pub fn inject(object: &Value, config: &Config) -> Result<Outcome, InjectError> {
    let kind = object.get("kind").and_then(Value::as_str).unwrap_or("");
    let admin = admin_policy(object, kind, config);
    if !admin.is_empty() {
        return Err(admin.into());
    }
    let mut out = object.clone();
    let result = match kind {
        "Pod" => inject_template(&mut out, "", MarksSource::PodVolumeOrClaim, config),
        "Deployment" => {
            let shape = deployment_shape(object);
            match inject_template(&mut out, "spec.template.", MarksSource::Claim, config) {
                Ok(Some(_)) if !shape.is_empty() => Err(shape),
                Err(mut errs) => {
                    errs.extend(shape);
                    Err(errs)
                }
                other => other,
            }
        }
        "StatefulSet" => inject_template(&mut out, "spec.template.", MarksSource::ClaimTemplate, config),
        _ => {
            return match refuse_other_kind(object, kind) {
                Some(r) => Err(vec![r].into()),
                None => Ok(Outcome::Untouched),
            }
        }
    };
    match result {
        Ok(None) => {
            let at = if kind == "Pod" { "metadata" } else { "spec.template.metadata" };
            let meta = if kind == "Pod" { object.get("metadata") } else { object.pointer("/spec/template/metadata") };
            match annotations::read(meta.and_then(|m| m.get("annotations")), at) {
                Ok(Request::AlreadyInjected) => Ok(Outcome::AlreadyInjected),
                _ => Ok(Outcome::Untouched),
            }
        }
        Ok(Some((warnings, backend_port))) => Ok(Outcome::Injected(Injected { object: out, warnings, backend_port })),
        Err(errs) => Err(errs.into()),
    }
}

/// The injector's admin-owned decisions a pod cannot override (its config's
/// `store_selector` and `fence_config_map`, and what makes a pod "already
/// injected"). Every refusal here is [`Code::AdminPolicy`]:
/// - a pod (template) carrying the status annotation without a container named
///   [`CONTAINER`] of the configured image claims an injection that did not happen;
/// - a pod the store selector matches that does not opt in (no annotation, or
///   `disabled`) would run its store without a fence;
/// - a pod naming a fence ConfigMap other than `fence_config_map` would choose
///   the fence's trusted signing keys.
fn admin_policy(object: &Value, kind: &str, config: &Config) -> Vec<Refusal> {
    let (tpl, at) = match kind {
        "Pod" => (Some(object), "metadata"),
        "Deployment" | "StatefulSet" => (object.pointer("/spec/template"), "spec.template.metadata"),
        _ => (None, ""),
    };
    let Some(tpl) = tpl else { return Vec::new() };
    let mut errs = Vec::new();
    let ann = |k: &str| tpl.pointer("/metadata/annotations").and_then(|a| a.get(k)).and_then(Value::as_str);
    let field = |k: &str| format!("{at}.annotations[\"{k}\"]");
    let fenced = tpl.pointer("/spec/containers").and_then(Value::as_array).is_some_and(|cs| {
        cs.iter().any(|c| {
            c.get("name").and_then(Value::as_str) == Some(CONTAINER)
                && c.get("image").and_then(Value::as_str) == Some(config.image.as_str())
        })
    });
    if ann(annotations::STATUS).is_some() && !fenced {
        errs.push(Refusal::new(
            Code::AdminPolicy,
            field(annotations::STATUS),
            format!(
                "the status annotation is believed only with a {CONTAINER} container of image {}: remove it to be injected",
                config.image
            ),
        ));
    }
    let labels = tpl.pointer("/metadata/labels");
    let selected = !config.store_pod_labels.is_empty()
        && config
            .store_pod_labels
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)).and_then(Value::as_str) == Some(v.as_str()));
    if selected && !fenced && ann(annotations::FENCE) != Some("enabled") {
        let pairs: Vec<String> = config.store_pod_labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        errs.push(Refusal::new(
            Code::AdminPolicy,
            field(annotations::FENCE),
            format!(
                "this pod is a fenced store by the injector's store_selector ({}): it is injected or refused, never \
                 left unfenced; set lockmesh.io/fence: enabled with its settings",
                pairs.join(",")
            ),
        ));
    }
    if let (Some(want), Some(got)) = (&config.fence_config_map, ann(annotations::CONFIG_MAP)) {
        if want != got {
            errs.push(Refusal::new(
                Code::AdminPolicy,
                field(annotations::CONFIG_MAP),
                format!(
                    "{got:?}: the fence's config and trusted keys come from the injector's ConfigMap {want:?} only"
                ),
            ));
        }
    }
    errs
}

/// A Deployment keeps one fence per store only with one replica and no overlap
/// between the old and the new pod on the same marks claim.
fn deployment_shape(object: &Value) -> Vec<Refusal> {
    let mut errs = Vec::new();
    let replicas = object.pointer("/spec/replicas").and_then(Value::as_i64).unwrap_or(1);
    if replicas > 1 {
        errs.push(Refusal::new(
            Code::WorkloadShape,
            "spec.replicas",
            format!("a fenced Deployment must have at most 1 replica, got {replicas}: replicas would share one marks claim (a second writer); use a StatefulSet, which gets a claim per replica"),
        ));
    }
    let strategy = object.pointer("/spec/strategy/type").and_then(Value::as_str).unwrap_or("RollingUpdate");
    if strategy != "Recreate" {
        errs.push(Refusal::new(
            Code::WorkloadShape,
            "spec.strategy.type",
            format!("must be Recreate for a fenced Deployment, got {strategy}: a rolling update runs the old and the new fence on one marks claim at once"),
        ));
    }
    errs
}

fn refuse_other_kind(object: &Value, kind: &str) -> Option<Refusal> {
    let (pointer, at) = match kind {
        "CronJob" => {
            ("/spec/jobTemplate/spec/template/metadata/annotations", "spec.jobTemplate.spec.template.metadata")
        }
        _ => ("/spec/template/metadata/annotations", "spec.template.metadata"),
    };
    let opted_in = object.pointer(pointer).and_then(|a| a.get(annotations::FENCE)).and_then(Value::as_str);
    (opted_in == Some("enabled")).then(|| {
        Refusal::new(
            Code::WorkloadShape,
            format!("{at}.annotations[\"{}\"]", annotations::FENCE),
            format!("kind {kind} cannot be fenced: only a Pod, a single-replica Deployment or a StatefulSet keeps one fence with its own persistent marks per store"),
        )
    })
}

/// Injects into the pod template at `at` (`""` for a Pod, `spec.template.` for a
/// workload). `Ok(None)`: not requested or already injected.
fn inject_template(
    root: &mut Value,
    at: &str,
    marks: MarksSource,
    config: &Config,
) -> Result<Option<(Vec<String>, u16)>, Vec<Refusal>> {
    let tpl_pointer = if at.is_empty() { "" } else { "/spec/template" };
    let Some(tpl) = root.pointer(tpl_pointer) else {
        return Err(vec![Refusal::new(Code::Malformed, at.trim_end_matches('.'), "missing pod template")]);
    };
    let req = match annotations::read(tpl.pointer("/metadata/annotations"), &format!("{at}metadata"))? {
        Request::Inject(r) => r,
        Request::NotRequested | Request::AlreadyInjected => return Ok(None),
    };
    let has_claim_template = existing_claim_template(root).is_some();
    let plan = plan(tpl, at, &req, marks, has_claim_template, config)?;
    let Some(tpl) = root.pointer_mut(tpl_pointer) else {
        return Err(vec![Refusal::new(Code::Malformed, at, "missing pod template")]);
    };
    apply(tpl, &plan, config);
    if plan.add_claim_template {
        let size = req.marks_size.clone().unwrap_or_else(|| config.marks_size.clone());
        let mut spec = json!({"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}});
        if let Some(class) = &req.marks_storage_class {
            spec["storageClassName"] = json!(class);
        }
        let claim = json!({
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": MARKS_VOLUME, "labels": {annotations::FENCED_LABEL: "true"}},
            "spec": spec,
        });
        if let Some(spec) = root.get_mut("spec").and_then(Value::as_object_mut) {
            array_at(spec, "volumeClaimTemplates").push(claim);
        }
    }
    Ok(Some((plan.warnings, plan.backend_port)))
}

/// `Some(index)` when a StatefulSet already has a claim template for the marks.
fn existing_claim_template(root: &Value) -> Option<usize> {
    root.pointer("/spec/volumeClaimTemplates")
        .and_then(Value::as_array)?
        .iter()
        .position(|t| t.pointer("/metadata/name").and_then(Value::as_str) == Some(MARKS_VOLUME))
}

fn apply(tpl: &mut Value, plan: &Plan, config: &Config) {
    let fence = fence_container(plan, config);
    let Some(spec) = tpl.get_mut("spec").and_then(Value::as_object_mut) else { return };
    if let Some(store) = spec.get_mut("containers").and_then(|c| c.get_mut(plan.store)).and_then(Value::as_object_mut) {
        let ports = array_at(store, "ports");
        ports.remove(plan.port_index);
        if ports.is_empty() {
            store.remove("ports");
        }
        let env = array_at(store, "env");
        if let Some(name) = &plan.backend_port_env {
            set_env(env, name, &plan.backend_port.to_string());
        }
        if let Some(name) = &plan.backend_host_env {
            set_env(env, name, "127.0.0.1");
        }
        if env.is_empty() {
            store.remove("env");
        }
        // The kubelet resolves a named probe port in the probe's own container, and
        // the name moved to fence-proxy: point such probes at the number (they now
        // reach fence-proxy, as the warnings say).
        if let Some(name) = plan.port.get("name").and_then(Value::as_str) {
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
                for handler in ["httpGet", "tcpSocket", "grpc"] {
                    if let Some(port) =
                        store.get_mut(probe).and_then(|p| p.get_mut(handler)).and_then(|h| h.get_mut("port"))
                    {
                        if port.as_str() == Some(name) {
                            *port = json!(plan.public_port);
                        }
                    }
                }
            }
        }
    }
    array_at(spec, "containers").push(fence);
    let volumes = array_at(spec, "volumes");
    volumes.push(json!({"name": CONFIG_VOLUME, "configMap": {"name": plan.config_map}}));
    if let Some(v) = &plan.marks_volume {
        volumes.push(v.clone());
    }
    if plan.add_fs_group {
        // The marks claim must be writable by fence-proxy's non-root user.
        object_at(spec, "securityContext").insert("fsGroup".into(), json!(config.run_as_user));
    }
    let Some(meta) = tpl.as_object_mut().map(|t| object_at(t, "metadata")) else { return };
    let labels = object_at(meta, "labels");
    labels.insert(annotations::FENCED_LABEL.into(), json!("true"));
    labels.insert(annotations::BACKEND_PORT_LABEL.into(), json!(plan.backend_port.to_string()));
    let status = json!({
        "version": 1,
        "container": CONTAINER,
        "storePort": plan.public_port,
        "backendPort": plan.backend_port,
        "marks": plan.marks_desc,
        "image": config.image,
    });
    object_at(meta, "annotations").insert(annotations::STATUS.into(), json!(status.to_string()));
}

fn fence_container(plan: &Plan, config: &Config) -> Value {
    let admin = config.admin_port;
    let probe = |path: &str, period: u32| json!({"httpGet": {"path": path, "port": ADMIN_PORT_NAME}, "periodSeconds": period, "timeoutSeconds": 2, "failureThreshold": 3});
    json!({
        "name": CONTAINER,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "args": ["--config", format!("{CONFIG_DIR}/{CONFIG_FILE}")],
        "env": [
            {"name": ENV_LISTEN, "value": format!("0.0.0.0:{}", plan.public_port)},
            {"name": ENV_UPSTREAM, "value": format!("http://127.0.0.1:{}", plan.backend_port)},
            {"name": ENV_ADMIN_LISTEN, "value": format!("0.0.0.0:{admin}")},
            {"name": ENV_MARKS_DIR, "value": MARKS_DIR},
        ],
        "ports": [plan.port, {"name": ADMIN_PORT_NAME, "containerPort": admin, "protocol": "TCP"}],
        "readinessProbe": probe(&config.readiness_path, 5),
        "livenessProbe": probe(&config.liveness_path, 10),
        "resources": {"requests": config.requests, "limits": config.limits},
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": config.run_as_user,
            "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": true},
            {"name": MARKS_VOLUME, "mountPath": MARKS_DIR},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    })
}

fn set_env(env: &mut Vec<Value>, name: &str, value: &str) {
    let entry = json!({"name": name, "value": value});
    match env.iter_mut().find(|e| e.get("name").and_then(Value::as_str) == Some(name)) {
        Some(e) => *e = entry,
        None => env.push(entry),
    }
}

/// The array at `key`, created (or replacing a non-array) if needed.
fn array_at<'a>(m: &'a mut Map<String, Value>, key: &str) -> &'a mut Vec<Value> {
    let slot = m.entry(key).or_insert_with(|| json!([]));
    if !slot.is_array() {
        *slot = json!([]);
    }
    match slot {
        Value::Array(a) => a,
        // Const-like invariant: the slot was made an array just above.
        _ => unreachable!("just made an array"),
    }
}

/// The object at `key`, created (or replacing a non-object) if needed.
fn object_at<'a>(m: &'a mut Map<String, Value>, key: &str) -> &'a mut Map<String, Value> {
    let slot = m.entry(key).or_insert_with(|| json!({}));
    if !slot.is_object() {
        *slot = json!({});
    }
    match slot {
        Value::Object(o) => o,
        // Const-like invariant: the slot was made an object just above.
        _ => unreachable!("just made an object"),
    }
}
