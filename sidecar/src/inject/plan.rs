//! The decision half of injection: every check against the pod (template),
//! collecting all refusals, before anything is changed.

use serde_json::{json, Value};

use super::{MarksSource, ADMIN_PORT_NAME, CONFIG_FILE, CONFIG_VOLUME, CONTAINER, MARKS_VOLUME};
use crate::{
    annotations::{self, FenceRequest, PortRef},
    config::Config,
    refusal::{Code, Refusal},
};

/// Everything decided before the template is touched.
pub(super) struct Plan {
    pub(super) store: usize,
    pub(super) port_index: usize,
    pub(super) port: Value,
    pub(super) public_port: u16,
    pub(super) backend_port: u16,
    pub(super) config_map: String,
    /// The marks volume to add to the pod, if the pod has none.
    pub(super) marks_volume: Option<Value>,
    pub(super) marks_desc: String,
    /// Whether a StatefulSet needs the marks claim template added.
    pub(super) add_claim_template: bool,
    pub(super) backend_port_env: Option<String>,
    pub(super) backend_host_env: Option<String>,
    pub(super) add_fs_group: bool,
    pub(super) warnings: Vec<String>,
}

pub(super) fn plan(
    tpl: &Value,
    at: &str,
    req: &FenceRequest,
    marks: MarksSource,
    has_claim_template: bool,
    config: &Config,
) -> Result<Plan, Vec<Refusal>> {
    let mut errs = Vec::new();
    let ann = |k: &str| format!("{at}metadata.annotations[\"{k}\"]");
    let empty = Vec::new();
    let containers = tpl.pointer("/spec/containers").and_then(Value::as_array).unwrap_or(&empty);
    let init = tpl.pointer("/spec/initContainers").and_then(Value::as_array).unwrap_or(&empty);
    let volumes = tpl.pointer("/spec/volumes").and_then(Value::as_array).unwrap_or(&empty);
    if containers.is_empty() {
        return Err(vec![Refusal::new(
            Code::Malformed,
            format!("{at}spec.containers"),
            "must list at least one container",
        )]);
    }
    if tpl.pointer("/spec/hostNetwork").and_then(Value::as_bool) == Some(true) {
        errs.push(Refusal::new(
            Code::WorkloadShape,
            format!("{at}spec.hostNetwork"),
            "a fenced pod cannot use the host network: its loopback is the node's, so every host process and host-network pod would reach the store's own port, and no NetworkPolicy applies",
        ));
    }
    let name_of = |c: &Value| c.get("name").and_then(Value::as_str).unwrap_or("").to_owned();
    if containers.iter().chain(init).any(|c| name_of(c) == CONTAINER) {
        errs.push(Refusal::new(
            Code::NameClash,
            format!("{at}spec.containers"),
            format!("a container named {CONTAINER} already exists"),
        ));
    }
    if volumes.iter().any(|v| name_of(v) == CONFIG_VOLUME) {
        errs.push(Refusal::new(
            Code::NameClash,
            format!("{at}spec.volumes"),
            format!("a volume named {CONFIG_VOLUME} already exists"),
        ));
    }

    // The store container.
    let store = match &req.store_container {
        Some(name) => containers.iter().position(|c| name_of(c) == *name).or_else(|| {
            errs.push(Refusal::new(
                Code::StoreContainer,
                ann(annotations::STORE_CONTAINER),
                format!("no container named {name:?}"),
            ));
            None
        }),
        None if containers.len() == 1 => Some(0),
        None => {
            errs.push(Refusal::new(
                Code::StoreContainer,
                ann(annotations::STORE_CONTAINER),
                format!("required: the pod has {} containers, name the store's", containers.len()),
            ));
            None
        }
    };

    // Every other long-running container shares the store's loopback, so it could
    // re-expose the store's own port past the fence: only the admins' companions
    // may run beside it. Init containers that run to completion end before the
    // store starts; one with `restartPolicy: Always` runs beside it.
    if let Some(si) = store {
        let beside =
            containers.iter().enumerate().filter(|(i, _)| *i != si).map(|(i, c)| (format!("containers[{i}]"), c));
        let native = init
            .iter()
            .enumerate()
            .filter(|(_, c)| c.get("restartPolicy").and_then(Value::as_str) == Some("Always"))
            .map(|(i, c)| (format!("initContainers[{i}]"), c));
        for (field, c) in beside.chain(native) {
            let (name, image) = (name_of(c), c.get("image").and_then(Value::as_str).unwrap_or(""));
            if name != CONTAINER && !config.companions.iter().any(|k| k.admits(&name, image)) {
                errs.push(Refusal::new(
                    Code::UnlistedContainer,
                    format!("{at}spec.{field}"),
                    format!(
                        "container {name:?} ({image}) would run beside the store and share its loopback, reaching \
                         the store's own port past the fence: move it to another pod, or have the admins list it \
                         (name and image) in the injector's companions"
                    ),
                ));
            }
        }
    }

    // The client-facing port, moved to the proxy.
    let mut port = None;
    if let Some(si) = store {
        let sname = name_of(&containers[si]);
        let ports = containers[si].get("ports").and_then(Value::as_array).unwrap_or(&empty);
        let field = ann(annotations::STORE_PORT);
        let found = match &req.store_port {
            Some(r) => ports.iter().position(|p| port_matches(p, r)).or_else(|| {
                errs.push(Refusal::new(
                    Code::StorePort,
                    field.clone(),
                    format!("container {sname:?} declares no such port ({})", port_ref_str(r)),
                ));
                None
            }),
            None if ports.len() == 1 => Some(0),
            None => {
                errs.push(Refusal::new(
                    Code::StorePort,
                    field.clone(),
                    format!("required: container {sname:?} declares {} ports, name the one clients use", ports.len()),
                ));
                None
            }
        };
        if let Some(pi) = found {
            let p = &ports[pi];
            let proto = p.get("protocol").and_then(Value::as_str).unwrap_or("TCP");
            let number =
                p.get("containerPort").and_then(Value::as_u64).and_then(|n| u16::try_from(n).ok()).filter(|n| *n > 0);
            match number {
                Some(_) if proto != "TCP" => errs.push(Refusal::new(
                    Code::StorePort,
                    field,
                    format!(
                        "port {} of container {sname:?} is {proto}: fence-proxy fronts HTTP over TCP only",
                        p.get("containerPort").unwrap_or(&Value::Null)
                    ),
                )),
                Some(n) => port = Some((pi, p.clone(), n)),
                None => errs.push(Refusal::new(
                    Code::Malformed,
                    format!("{at}spec.containers[{si}].ports[{pi}].containerPort"),
                    "must be a port number 1-65535",
                )),
            }
        }
    }

    // The backend port, and how the store learns it.
    let backend_port = req.backend_port.unwrap_or(config.default_backend_port);
    if req.backend_port.is_none() && req.backend_port_env.is_none() {
        errs.push(Refusal::new(
            Code::StoreNotMoved,
            ann(annotations::BACKEND_PORT_ENV),
            format!(
                "nothing moves the store off its client port: set {} to the environment variable your store reads its listen port from, or set {} to the loopback port the store is already configured to listen on",
                annotations::BACKEND_PORT_ENV,
                annotations::BACKEND_PORT
            ),
        ));
    }
    let mut used: Vec<(u16, String)> = Vec::new();
    for c in containers.iter().chain(init) {
        for p in c.get("ports").and_then(Value::as_array).unwrap_or(&empty) {
            if let Some(n) = p.get("containerPort").and_then(Value::as_u64).and_then(|n| u16::try_from(n).ok()) {
                used.push((n, format!("port {n} of container {:?}", name_of(c))));
            }
            if p.get("name").and_then(Value::as_str) == Some(ADMIN_PORT_NAME) {
                errs.push(Refusal::new(
                    Code::PortConflict,
                    format!("{at}spec.containers"),
                    format!("container {:?} already has a port named {ADMIN_PORT_NAME}", name_of(c)),
                ));
            }
        }
    }
    for (n, what) in &used {
        if *n == backend_port {
            errs.push(Refusal::new(
                Code::PortConflict,
                ann(annotations::BACKEND_PORT),
                format!("backend port {backend_port} is already {what}"),
            ));
        }
        if *n == config.admin_port {
            errs.push(Refusal::new(
                Code::PortConflict,
                format!("{at}spec.containers"),
                format!(
                    "fence-proxy's admin port {} (injector config admin_port) is already {what}",
                    config.admin_port
                ),
            ));
        }
    }
    if backend_port == config.admin_port {
        errs.push(Refusal::new(
            Code::PortConflict,
            ann(annotations::BACKEND_PORT),
            format!("backend port {backend_port} is fence-proxy's admin port"),
        ));
    }

    let Some(config_map) = req.config_map.clone().or_else(|| config.fence_config_map.clone()) else {
        errs.push(Refusal::new(
            Code::ConfigMapMissing,
            ann(annotations::CONFIG_MAP),
            format!("required: name the ConfigMap holding fence-proxy's {CONFIG_FILE} (its routes, keys and verification keys)"),
        ));
        return Err(errs);
    };

    // The marks: persistent, never scratch space.
    let existing = volumes.iter().find(|v| name_of(v) == MARKS_VOLUME);
    let mut marks_volume = None;
    let mut marks_desc = String::new();
    let mut add_claim_template = false;
    match (existing, marks) {
        (Some(v), _) => match v.pointer("/persistentVolumeClaim/claimName").and_then(Value::as_str) {
            Some(claim) if req.marks_claim.as_deref().is_none_or(|c| c == claim) => marks_desc = format!("claim:{claim}"),
            Some(claim) => errs.push(Refusal::new(
                Code::NameClash,
                ann(annotations::MARKS_CLAIM),
                format!("names a claim but volume {MARKS_VOLUME} already mounts claim {claim:?}"),
            )),
            None => errs.push(Refusal::new(
                Code::MarksNotPersistent,
                format!("{at}spec.volumes"),
                format!("volume {MARKS_VOLUME} must be a persistentVolumeClaim: marks in scratch space are lost on reschedule, and a stale token would pass"),
            )),
        },
        (None, MarksSource::ClaimTemplate) => {
            if req.marks_claim.is_some() {
                errs.push(Refusal::new(
                    Code::WorkloadShape,
                    ann(annotations::MARKS_CLAIM),
                    "not allowed on a StatefulSet: each replica gets its own claim from a volumeClaimTemplate, one named claim would be shared by every replica",
                ));
            }
            marks_desc = format!("template:{MARKS_VOLUME}");
            add_claim_template = !has_claim_template;
        }
        (None, MarksSource::PodVolumeOrClaim | MarksSource::Claim) => match &req.marks_claim {
            Some(claim) => {
                marks_volume = Some(json!({"name": MARKS_VOLUME, "persistentVolumeClaim": {"claimName": claim}}));
                marks_desc = format!("claim:{claim}");
            }
            None => errs.push(Refusal::new(
                Code::MarksClaimMissing,
                ann(annotations::MARKS_CLAIM),
                format!(
                    "required: name an existing PersistentVolumeClaim for fence-proxy's marks (or, for a StatefulSet's pods, add a volumeClaimTemplate named {MARKS_VOLUME}); marks are never kept in scratch space, they must survive a restart and a reschedule"
                ),
            )),
        },
    }

    let (Some(store), Some((port_index, port, public_port))) = (store, port) else { return Err(errs) };
    if public_port == config.admin_port {
        errs.push(Refusal::new(
            Code::PortConflict,
            ann(annotations::STORE_PORT),
            format!("store port {public_port} is fence-proxy's admin port (injector config admin_port)"),
        ));
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    let warnings = probe_warnings(&containers[store], &port, public_port);
    let add_fs_group = tpl.pointer("/spec/securityContext/fsGroup").is_none();
    Ok(Plan {
        store,
        port_index,
        port,
        public_port,
        backend_port,
        config_map,
        marks_volume,
        marks_desc,
        add_claim_template,
        backend_port_env: req.backend_port_env.clone(),
        backend_host_env: req.backend_host_env.clone(),
        add_fs_group,
        warnings,
    })
}

fn port_matches(p: &Value, r: &PortRef) -> bool {
    match r {
        PortRef::Number(n) => p.get("containerPort").and_then(Value::as_u64) == Some(u64::from(*n)),
        PortRef::Name(name) => p.get("name").and_then(Value::as_str) == Some(name),
    }
}

fn port_ref_str(r: &PortRef) -> String {
    match r {
        PortRef::Number(n) => format!("number {n}"),
        PortRef::Name(n) => format!("name {n:?}"),
    }
}

/// Store probes on the moved port now reach fence-proxy, not the store.
fn probe_warnings(store: &Value, port: &Value, number: u16) -> Vec<String> {
    let sname = store.get("name").and_then(Value::as_str).unwrap_or("");
    let pname = port.get("name").and_then(Value::as_str);
    let hits = |v: Option<&Value>| match v {
        Some(Value::Number(n)) => n.as_u64() == Some(u64::from(number)),
        Some(Value::String(s)) => Some(s.as_str()) == pname,
        _ => false,
    };
    let mut out = Vec::new();
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let Some(p) = store.get(probe) else { continue };
        if let Some(h) = p.get("httpGet").filter(|h| hits(h.get("port"))) {
            let path = h.get("path").and_then(Value::as_str).unwrap_or("/");
            out.push(format!(
                "container {sname:?} {probe} (GET {path} on port {number}) now passes through fence-proxy: list GET {path} as a read route in {CONFIG_FILE}, or it is treated as a write and refused"
            ));
        } else if p.get("grpc").is_some_and(|g| hits(g.get("port"))) {
            out.push(format!("container {sname:?} {probe} (gRPC on port {number}) now reaches fence-proxy, which fronts HTTP/1 stores only: use an exec probe"));
        } else if p.get("tcpSocket").is_some_and(|t| hits(t.get("port"))) {
            out.push(format!(
                "container {sname:?} {probe} (TCP on port {number}) now checks fence-proxy's listener, not the store"
            ));
        }
    }
    out
}
