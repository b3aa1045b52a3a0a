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
//!   the NetworkPolicy) and the informational `lockmesh.io/fence-status`
//!   annotation. Neither it nor a `lockmesh-fence` container is ever believed: a
//!   second injection is a no-op only because it yields the same object.

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
    /// Not selected and no opt-in, or a kind without a pod template: nothing to do.
    Untouched,
    /// The object is already exactly what injection makes of it (checked by
    /// injecting again, never by believing a status annotation or a container
    /// name): nothing to do.
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
    /// now goes through fence-proxy, or a `lockmesh-fence` container of the pod's
    /// own that was replaced).
    pub warnings: Vec<String>,
    /// The loopback port the store moved to.
    pub backend_port: u16,
}

/// What the caller knows about where the object is admitted, from a source the
/// pod's author does not control.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// The namespace: the AdmissionReview's (the API server's) for the webhook,
    /// the object's `metadata.namespace` for `lockmesh-inject`.
    pub namespace: Option<String>,
    /// Every pod of this namespace is a fenced store, by the webhook
    /// configuration (the namespace label `lockmesh.io/fence-injection: store`
    /// sends its pods to `/mutate/store`).
    pub store_namespace: bool,
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

/// [`inject_in`] with the scope read from the object itself (its
/// `metadata.namespace`), as `lockmesh-inject` does.
pub fn inject(object: &Value, config: &Config) -> Result<Outcome, InjectError> {
    let namespace = object.pointer("/metadata/namespace").and_then(Value::as_str).map(str::to_owned);
    inject_in(object, config, &Scope { namespace, store_namespace: false })
}

/// Injects fence-proxy into `object` if its pod (template) is a store by the
/// admin's selection ([`Scope`], the config's `store_selector`) or opted in.
///
/// Pure: no I/O, the input is not modified. Nothing the pod writes is believed:
/// an object that already holds a `lockmesh-fence` container, a fence config
/// volume, the status annotation or the fenced labels is
/// [`Outcome::AlreadyInjected`] only if injecting it again from scratch yields
/// exactly the same object; otherwise those parts are removed and the fence
/// injected anew (the pod's own fence container is replaced by the injector's),
/// or the object is refused. Kinds other than Pod, Deployment and StatefulSet are
/// untouched unless their pod template opted in or is selected, which is refused
/// (they cannot keep one fence with its own persistent marks per store).
pub fn inject_in(object: &Value, config: &Config, scope: &Scope) -> Result<Outcome, InjectError> {
    let kind = object.get("kind").and_then(Value::as_str).unwrap_or("");
    let (tpl_pointer, at) = match kind {
        "Pod" => ("", "metadata"),
        "Deployment" | "StatefulSet" => ("/spec/template", "spec.template.metadata"),
        _ => {
            return match refuse_other_kind(object, kind, config, scope) {
                Some(r) => Err(vec![r].into()),
                None => Ok(Outcome::Untouched),
            }
        }
    };
    let Some(tpl) = object.pointer(tpl_pointer) else {
        return Err(vec![Refusal::new(Code::Malformed, "spec.template", "missing pod template")].into());
    };
    let selected = selection(tpl, config, scope);
    let admin = admin_policy(tpl, at, selected.as_ref(), config);
    if !admin.is_empty() {
        return Err(admin.into());
    }
    let req = match annotations::read(tpl.pointer("/metadata/annotations"), at)? {
        // A selected pod without the opt-in was refused by admin_policy.
        Request::NotRequested => return Ok(Outcome::Untouched),
        Request::Inject(r) => r,
    };
    let found = markers(tpl);
    if found.is_empty() {
        return fresh(object, kind, config);
    }
    // Idempotence without trust: rebuild the object the fence would have been
    // injected into (the fence's client port back on the store) and inject that;
    // only an identical result is "already injected".
    let mut again = None;
    for before in uninjected(object, tpl_pointer, &req) {
        match fresh(&before, kind, config) {
            Ok(Outcome::Injected(i)) if same_injection(&i.object, object, tpl_pointer) => {
                return Ok(Outcome::AlreadyInjected)
            }
            Ok(Outcome::Injected(i)) if again.is_none() => again = Some(i),
            _ => {}
        }
    }
    // Otherwise those parts are the pod's own: removed, and the injector's fence
    // injected into what remains (or, when the pod's fence container held the
    // client port, into the pod with that port back on the store).
    let note = format!(
        "the pod's own {} {} not the injector's: removed, and the injector's fence injected in their place",
        found.join(", "),
        if found.len() == 1 { "is" } else { "are" }
    );
    let result = match (fresh(&stripped(object, tpl_pointer), kind, config), again) {
        (Err(_), Some(i)) => Ok(Outcome::Injected(i)),
        (first, _) => first,
    };
    match result {
        Ok(Outcome::Injected(mut i)) => {
            i.warnings.insert(0, note);
            Ok(Outcome::Injected(i))
        }
        Ok(other) => Ok(other),
        Err(mut e) => {
            e.refusals.insert(
                0,
                Refusal::new(
                    Code::AdminPolicy,
                    at.replace("metadata", "spec.containers"),
                    format!("{note}; what remains cannot be injected:"),
                ),
            );
            Err(e)
        }
    }
}

/// Injection of an object without any part the injector writes.
fn fresh(object: &Value, kind: &str, config: &Config) -> Result<Outcome, InjectError> {
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
        _ => inject_template(&mut out, "spec.template.", MarksSource::ClaimTemplate, config),
    };
    match result {
        Ok(None) => Ok(Outcome::Untouched),
        Ok(Some((warnings, backend_port))) => Ok(Outcome::Injected(Injected { object: out, warnings, backend_port })),
        Err(errs) => Err(errs.into()),
    }
}

/// Why the admin's selection makes a pod (template) a fenced store.
struct Selected {
    /// In words, for messages.
    why: String,
    /// Selected by its namespace: every pod of it is a store, and the
    /// namespace-wide NetworkPolicy closes the default backend port for all.
    by_namespace: bool,
}

/// Why the admin's selection makes this pod (template) a fenced store, or `None`.
/// Only what the admins own selects for good: the namespace (from the scope, never
/// the object) and its label; a service account or pod labels add pods, and a pod
/// that leaves them is still selected by the namespace.
fn selection(tpl: &Value, config: &Config, scope: &Scope) -> Option<Selected> {
    let ns = scope.namespace.as_deref().unwrap_or("");
    if scope.store_namespace {
        return Some(Selected {
            why: format!("the webhook configuration (namespace {ns:?} is labelled lockmesh.io/fence-injection=store)"),
            by_namespace: true,
        });
    }
    let sel = &config.store_selector;
    if sel.namespaces.contains(ns) {
        return Some(Selected { why: format!("the injector's store_selector.namespaces ({ns})"), by_namespace: true });
    }
    let sa = ["/spec/serviceAccountName", "/spec/serviceAccount"]
        .iter()
        .find_map(|p| tpl.pointer(p).and_then(Value::as_str).filter(|s| !s.is_empty()))
        .unwrap_or("default");
    if sel.service_accounts.contains(&(ns.to_owned(), sa.to_owned())) {
        return Some(Selected {
            why: format!("the injector's store_selector.service_accounts ({ns}/{sa})"),
            by_namespace: false,
        });
    }
    let labels = tpl.pointer("/metadata/labels");
    let by_labels = !sel.pod_labels.is_empty()
        && sel
            .pod_labels
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)).and_then(Value::as_str) == Some(v.as_str()));
    by_labels.then(|| {
        let pairs: Vec<String> = sel.pod_labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        Selected { why: format!("the injector's store_selector ({})", pairs.join(",")), by_namespace: false }
    })
}

/// The injector's admin-owned decisions a pod cannot override. Every refusal here
/// is [`Code::AdminPolicy`]:
/// - a selected pod that does not opt in (no annotation, or `disabled`) would run
///   its store without a fence;
/// - a selected pod when the injector has no `fence_config_map` would get the
///   fence's trusted keys from a ConfigMap of its own choosing;
/// - a pod selected by its namespace asking for a backend port other than the
///   injector's `default_backend_port` would move its store to a port the
///   namespace-wide NetworkPolicy leaves open;
/// - a pod naming a fence ConfigMap other than `fence_config_map` would choose
///   the fence's trusted signing keys.
fn admin_policy(tpl: &Value, at: &str, selected: Option<&Selected>, config: &Config) -> Vec<Refusal> {
    let mut errs = Vec::new();
    let ann = |k: &str| tpl.pointer("/metadata/annotations").and_then(|a| a.get(k)).and_then(Value::as_str);
    let field = |k: &str| format!("{at}.annotations[\"{k}\"]");
    if let Some(Selected { why, by_namespace }) = selected {
        let default = config.default_backend_port;
        if let Some(port) = ann(annotations::BACKEND_PORT).filter(|p| *by_namespace && *p != default.to_string()) {
            errs.push(Refusal::new(
                Code::AdminPolicy,
                field(annotations::BACKEND_PORT),
                format!(
                    "{port:?}: this pod is a fenced store by {why}, where every store's backend port is the \
                     injector's default_backend_port {default}, the one the namespace's NetworkPolicy \
                     (lockmesh-fence-store-namespace-{default}) closes to other pods"
                ),
            ));
        }
        if ann(annotations::FENCE) != Some("enabled") {
            errs.push(Refusal::new(
                Code::AdminPolicy,
                field(annotations::FENCE),
                format!(
                    "this pod is a fenced store by {why}: it is injected or refused, never left unfenced; set \
                     lockmesh.io/fence: enabled with its settings"
                ),
            ));
        }
        if config.fence_config_map.is_none() {
            errs.push(Refusal::new(
                Code::AdminPolicy,
                field(annotations::CONFIG_MAP),
                format!(
                    "this pod is a fenced store by {why}, but the injector sets no fence_config_map: a store's fence \
                     config and trusted keys must come from the admin's ConfigMap, never one the pod names"
                ),
            ));
        }
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

/// The parts of a pod (template) only the injector should write, by name.
fn markers(tpl: &Value) -> Vec<String> {
    let named = |list: &str, name: &str| {
        tpl.pointer(list)
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|c| c.get("name").and_then(Value::as_str) == Some(name)))
    };
    let has = |pointer: &str, key: &str| tpl.pointer(pointer).and_then(|m| m.get(key)).is_some();
    let mut out = Vec::new();
    if named("/spec/containers", CONTAINER) {
        out.push(format!("container {CONTAINER}"));
    }
    if named("/spec/initContainers", CONTAINER) {
        out.push(format!("init container {CONTAINER}"));
    }
    if named("/spec/volumes", CONFIG_VOLUME) {
        out.push(format!("volume {CONFIG_VOLUME}"));
    }
    if has("/metadata/annotations", annotations::STATUS) {
        out.push(format!("annotation {}", annotations::STATUS));
    }
    for label in [annotations::FENCED_LABEL, annotations::BACKEND_PORT_LABEL] {
        if has("/metadata/labels", label) {
            out.push(format!("label {label}"));
        }
    }
    out
}

/// Whether two objects are equal once the API server's defaults of the parts the
/// injector writes are taken out (a pod created from a `lockmesh-inject`ed
/// template reaches the webhook with them filled in).
fn same_injection(ours: &Value, theirs: &Value, tpl_pointer: &str) -> bool {
    ours == theirs || without_defaults(ours, tpl_pointer) == without_defaults(theirs, tpl_pointer)
}

/// `object` with fields of the fence container and the fence config volume
/// removed where they hold the value Kubernetes defaults them to.
fn without_defaults(object: &Value, tpl_pointer: &str) -> Value {
    fn drop_if(m: &mut Map<String, Value>, key: &str, default: &Value) {
        if m.get(key) == Some(default) {
            m.remove(key);
        }
    }
    let mut out = object.clone();
    let Some(spec) = out.pointer_mut(tpl_pointer).and_then(|t| t.get_mut("spec")) else { return out };
    let named = |v: &Value, n: &str| v.get("name").and_then(Value::as_str) == Some(n);
    if let Some(cs) = spec.get_mut("containers").and_then(Value::as_array_mut) {
        for c in cs.iter_mut().filter(|c| named(c, CONTAINER)).filter_map(Value::as_object_mut) {
            drop_if(c, "terminationMessagePath", &json!("/dev/termination-log"));
            for p in c.get_mut("ports").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(p) = p.as_object_mut() {
                    drop_if(p, "protocol", &json!("TCP"));
                }
            }
            for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                let Some(p) = c.get_mut(probe).and_then(Value::as_object_mut) else { continue };
                for (k, v) in
                    [("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1), ("failureThreshold", 3)]
                {
                    drop_if(p, k, &json!(v));
                }
                if let Some(h) = p.get_mut("httpGet").and_then(Value::as_object_mut) {
                    drop_if(h, "scheme", &json!("HTTP"));
                }
            }
        }
    }
    if let Some(vs) = spec.get_mut("volumes").and_then(Value::as_array_mut) {
        for v in vs.iter_mut().filter(|v| named(v, CONFIG_VOLUME)) {
            if let Some(cm) = v.get_mut("configMap").and_then(Value::as_object_mut) {
                drop_if(cm, "defaultMode", &json!(420));
            }
        }
    }
    out
}

/// `object` with every part named by [`markers`] removed (the marks volume stays:
/// the pod's own choice, checked by the plan like any other).
fn stripped(object: &Value, tpl_pointer: &str) -> Value {
    let mut out = object.clone();
    if let Some(tpl) = out.pointer_mut(tpl_pointer) {
        strip(tpl);
    }
    out
}

fn strip(tpl: &mut Value) {
    for (list, name) in [("containers", CONTAINER), ("initContainers", CONTAINER), ("volumes", CONFIG_VOLUME)] {
        if let Some(a) = tpl.pointer_mut(&format!("/spec/{list}")).and_then(Value::as_array_mut) {
            a.retain(|c| c.get("name").and_then(Value::as_str) != Some(name));
        }
    }
    if let Some(a) = tpl.pointer_mut("/metadata/annotations").and_then(Value::as_object_mut) {
        a.remove(annotations::STATUS);
    }
    if let Some(l) = tpl.pointer_mut("/metadata/labels").and_then(Value::as_object_mut) {
        l.remove(annotations::FENCED_LABEL);
        l.remove(annotations::BACKEND_PORT_LABEL);
    }
}

/// The objects an injected object may have been made from: [`strip`]ped, with
/// the fence container's client port (its first) back on the store container,
/// with and without the marks volume (injection adds it when the pod names a
/// claim, and keeps it when the pod already has it). Only guesses, each checked by
/// injecting it and comparing; none when the object has no single fence
/// container to take the port from.
fn uninjected(object: &Value, tpl_pointer: &str, req: &annotations::FenceRequest) -> Vec<Value> {
    let Some(with_port) = port_back(object, tpl_pointer, req) else { return Vec::new() };
    let mut without_marks = with_port.clone();
    let mut added_by_injection = false;
    if let Some(v) = without_marks.pointer_mut(tpl_pointer).and_then(|t| t.pointer_mut("/spec/volumes")) {
        if let Some(a) = v.as_array_mut() {
            a.retain(|v| {
                let marks = v.get("name").and_then(Value::as_str) == Some(MARKS_VOLUME);
                let claim = v.pointer("/persistentVolumeClaim/claimName").and_then(Value::as_str);
                added_by_injection |= marks && claim.is_some() && claim == req.marks_claim.as_deref();
                !marks
            });
        }
    }
    // The likelier guess first: it is also the one a replacement is made from.
    if added_by_injection {
        vec![without_marks, with_port]
    } else {
        vec![with_port, without_marks]
    }
}

fn port_back(object: &Value, tpl_pointer: &str, req: &annotations::FenceRequest) -> Option<Value> {
    let tpl = object.pointer(tpl_pointer)?;
    let is_fence = |c: &&Value| c.get("name").and_then(Value::as_str) == Some(CONTAINER);
    let containers = tpl.pointer("/spec/containers")?.as_array()?;
    let mut fences = containers.iter().filter(is_fence);
    let port = fences.next()?.pointer("/ports/0")?.clone();
    if fences.next().is_some() {
        return None;
    }
    let mut out = stripped(object, tpl_pointer);
    let list = out.pointer_mut(tpl_pointer)?.pointer_mut("/spec/containers")?.as_array_mut()?;
    let store = match &req.store_container {
        Some(name) => list.iter_mut().find(|c| c.get("name").and_then(Value::as_str) == Some(name.as_str()))?,
        None if list.len() == 1 => list.first_mut()?,
        None => return None,
    };
    array_at(store.as_object_mut()?, "ports").push(port);
    Some(out)
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

fn refuse_other_kind(object: &Value, kind: &str, config: &Config, scope: &Scope) -> Option<Refusal> {
    let (pointer, at) = match kind {
        "CronJob" => ("/spec/jobTemplate/spec/template", "spec.jobTemplate.spec.template.metadata"),
        _ => ("/spec/template", "spec.template.metadata"),
    };
    let tpl = object.pointer(pointer)?;
    let opted_in = tpl.pointer("/metadata/annotations").and_then(|a| a.get(annotations::FENCE)).and_then(Value::as_str);
    let why = match selection(tpl, config, scope) {
        Some(Selected { why, .. }) => format!("its pods are fenced stores by {why}, and "),
        None if opted_in == Some("enabled") => String::new(),
        None => return None,
    };
    Some(Refusal::new(
        Code::WorkloadShape,
        format!("{at}.annotations[\"{}\"]", annotations::FENCE),
        format!("{why}kind {kind} cannot be fenced: only a Pod, a single-replica Deployment or a StatefulSet keeps one fence with its own persistent marks per store"),
    ))
}

/// Injects into the pod template at `at` (`""` for a Pod, `spec.template.` for a
/// workload). `Ok(None)`: not requested.
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
        Request::NotRequested => return Ok(None),
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
