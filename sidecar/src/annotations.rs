//! The pod annotations that opt a pod into the fence and configure it, and the
//! labels and status annotation the injector writes.
//!
//! Every key under `lockmesh.io/fence` is either listed here or refused, so a
//! misspelt setting cannot be silently ignored.

use serde_json::{Map, Value};

use crate::refusal::{Code, Refusal};

/// Opt-in: `enabled` injects the fence, `disabled` (or no annotation) leaves the pod alone.
pub(crate) const FENCE: &str = "lockmesh.io/fence";
/// Name of the store container. Optional when the pod has exactly one container.
pub(crate) const STORE_CONTAINER: &str = "lockmesh.io/fence-store-container";
/// The store's client-facing container port, by number or name. Optional when
/// the store container declares exactly one port.
pub(crate) const STORE_PORT: &str = "lockmesh.io/fence-store-port";
/// The loopback port the store moves to. Default: the injector's `default_backend_port`.
pub(crate) const BACKEND_PORT: &str = "lockmesh.io/fence-backend-port";
/// Name of an environment variable the injector sets on the store to the backend port.
pub(crate) const BACKEND_PORT_ENV: &str = "lockmesh.io/fence-backend-port-env";
/// Name of an environment variable the injector sets on the store to `127.0.0.1`.
pub(crate) const BACKEND_HOST_ENV: &str = "lockmesh.io/fence-backend-host-env";
/// ConfigMap holding `fence-proxy.yaml` (required).
pub(crate) const CONFIG_MAP: &str = "lockmesh.io/fence-config";
/// Existing PersistentVolumeClaim for the marks (required for bare pods and Deployments).
pub(crate) const MARKS_CLAIM: &str = "lockmesh.io/fence-marks-claim";
/// Storage request of the marks claim template added to a StatefulSet.
pub(crate) const MARKS_SIZE: &str = "lockmesh.io/fence-marks-size";
/// Storage class of the marks claim template added to a StatefulSet.
pub(crate) const MARKS_STORAGE_CLASS: &str = "lockmesh.io/fence-marks-storage-class";
/// Written by the injector: JSON describing what was injected. Informational
/// only: it is never believed (a pod can write it), and a pod carrying it is
/// injected again unless it already is exactly what the injector makes of it.
pub(crate) const STATUS: &str = "lockmesh.io/fence-status";
/// Label written by the injector on every fenced pod (`"true"`).
pub const FENCED_LABEL: &str = "lockmesh.io/fenced";
/// Label written by the injector: the store's backend port, which the
/// NetworkPolicy for that port selects on.
pub const BACKEND_PORT_LABEL: &str = "lockmesh.io/fenced-backend-port";

const KNOWN: [&str; 11] = [
    FENCE,
    STORE_CONTAINER,
    STORE_PORT,
    BACKEND_PORT,
    BACKEND_PORT_ENV,
    BACKEND_HOST_ENV,
    CONFIG_MAP,
    MARKS_CLAIM,
    MARKS_SIZE,
    MARKS_STORAGE_CLASS,
    STATUS,
];

/// What a pod template's annotations ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// No opt-in (or `disabled`): the object stays untouched unless the admin's
    /// store selection picks it.
    NotRequested,
    /// Inject with these settings.
    Inject(FenceRequest),
}

/// The opt-in settings, syntactically validated (not yet checked against the pod).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FenceRequest {
    /// [`STORE_CONTAINER`].
    pub store_container: Option<String>,
    /// [`STORE_PORT`].
    pub store_port: Option<PortRef>,
    /// [`BACKEND_PORT`].
    pub backend_port: Option<u16>,
    /// [`BACKEND_PORT_ENV`].
    pub backend_port_env: Option<String>,
    /// [`BACKEND_HOST_ENV`].
    pub backend_host_env: Option<String>,
    /// [`CONFIG_MAP`].
    pub config_map: Option<String>,
    /// [`MARKS_CLAIM`].
    pub marks_claim: Option<String>,
    /// [`MARKS_SIZE`].
    pub marks_size: Option<String>,
    /// [`MARKS_STORAGE_CLASS`].
    pub marks_storage_class: Option<String>,
}

/// A container port named by number or by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRef {
    /// `containerPort` number.
    Number(u16),
    /// Port `name`.
    Name(String),
}

/// Reads the annotations of a pod (template) whose metadata sits at `at` (for
/// error paths, e.g. `spec.template.metadata`).
pub fn read(annotations: Option<&Value>, at: &str) -> Result<Request, Vec<Refusal>> {
    let empty = Map::new();
    let map = match annotations {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(m)) => m,
        Some(_) => return Err(vec![Refusal::new(Code::Malformed, format!("{at}.annotations"), "must be a map")]),
    };
    let field = |k: &str| format!("{at}.annotations[\"{k}\"]");
    let mut errs = Vec::new();
    let mut get = |k: &str| -> Option<String> {
        match map.get(k) {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => {
                errs.push(Refusal::new(Code::Malformed, field(k), "must be a string"));
                None
            }
        }
    };
    let opt_in = get(FENCE);
    // The status annotation is read only to check it is a string; it decides nothing.
    let _status = get(STATUS);
    let mut req = FenceRequest {
        store_container: get(STORE_CONTAINER),
        backend_port_env: get(BACKEND_PORT_ENV),
        backend_host_env: get(BACKEND_HOST_ENV),
        config_map: get(CONFIG_MAP),
        marks_claim: get(MARKS_CLAIM),
        marks_size: get(MARKS_SIZE),
        marks_storage_class: get(MARKS_STORAGE_CLASS),
        ..FenceRequest::default()
    };
    let store_port = get(STORE_PORT);
    let backend_port = get(BACKEND_PORT);
    match opt_in.as_deref() {
        None | Some("disabled") => return Ok(Request::NotRequested),
        Some("enabled") => {}
        Some(other) => errs.push(Refusal::new(
            Code::AnnotationInvalid,
            field(FENCE),
            format!("must be \"enabled\" or \"disabled\", got {other:?}"),
        )),
    }
    for k in map.keys() {
        if k.starts_with(FENCE) && !KNOWN.contains(&k.as_str()) {
            errs.push(Refusal::new(
                Code::UnknownAnnotation,
                field(k),
                format!("unknown lockmesh fence annotation (known: {})", KNOWN.join(", ")),
            ));
        }
    }
    let mut bad = |k: &str, why: String| errs.push(Refusal::new(Code::AnnotationInvalid, field(k), why));
    if let Some(c) = &req.store_container {
        if !is_dns_label(c) {
            bad(STORE_CONTAINER, format!("{c:?} is not a container name (a DNS-1123 label)"));
        }
    }
    if let Some(p) = store_port {
        match parse_port_ref(&p) {
            Some(r) => req.store_port = Some(r),
            None => bad(STORE_PORT, format!("{p:?} is neither a port number 1-65535 nor a port name")),
        }
    }
    if let Some(p) = backend_port {
        match p.parse::<u16>() {
            Ok(n) if n > 0 => req.backend_port = Some(n),
            _ => bad(BACKEND_PORT, format!("{p:?} is not a port number 1-65535")),
        }
    }
    for (k, v) in [(BACKEND_PORT_ENV, &req.backend_port_env), (BACKEND_HOST_ENV, &req.backend_host_env)] {
        if let Some(v) = v {
            if !is_env_name(v) {
                bad(k, format!("{v:?} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"));
            }
        }
    }
    for (k, v) in [
        (CONFIG_MAP, &req.config_map),
        (MARKS_CLAIM, &req.marks_claim),
        (MARKS_STORAGE_CLASS, &req.marks_storage_class),
    ] {
        if let Some(v) = v {
            if !is_dns_subdomain(v) {
                bad(k, format!("{v:?} is not an object name (a DNS-1123 subdomain)"));
            }
        }
    }
    if let Some(s) = &req.marks_size {
        if !crate::config::is_quantity(s) {
            bad(MARKS_SIZE, format!("{s:?} is not a Kubernetes quantity (for example 1Gi)"));
        }
    }
    if errs.is_empty() {
        Ok(Request::Inject(req))
    } else {
        Err(errs)
    }
}

fn parse_port_ref(s: &str) -> Option<PortRef> {
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse::<u16>().ok().filter(|n| *n > 0).map(PortRef::Number);
    }
    is_port_name(s).then(|| PortRef::Name(s.to_owned()))
}

/// An IANA service name as Kubernetes accepts for a port name: 1-15 lowercase
/// alphanumerics or `-`, at least one letter, no leading, trailing or double `-`.
pub(crate) fn is_port_name(s: &str) -> bool {
    (1..=15).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

pub(crate) fn is_dns_label(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

fn is_env_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_') && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn absent_or_disabled_is_not_requested() {
        assert_eq!(read(None, "metadata").unwrap(), Request::NotRequested);
        let a = json!({FENCE: "disabled", "lockmesh.io/fence-typo": "x"});
        assert_eq!(read(Some(&a), "metadata").unwrap(), Request::NotRequested);
    }

    #[test]
    fn status_decides_nothing() {
        let a = json!({FENCE: "enabled", STATUS: "{}"});
        assert_eq!(read(Some(&a), "metadata").unwrap(), Request::Inject(FenceRequest::default()));
        let a = json!({STATUS: "{}"});
        assert_eq!(read(Some(&a), "metadata").unwrap(), Request::NotRequested);
    }

    #[test]
    fn every_bad_value_is_reported() {
        let a = json!({
            FENCE: "yes", STORE_PORT: "0", BACKEND_PORT: "70000", BACKEND_PORT_ENV: "1PORT",
            CONFIG_MAP: "Fence_Config", MARKS_SIZE: "big", "lockmesh.io/fence-marks-clam": "m"
        });
        let errs = read(Some(&a), "metadata").unwrap_err();
        let got: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(got.len(), 7, "{got:#?}");
        assert!(got[0].starts_with("[annotation_invalid] metadata.annotations[\"lockmesh.io/fence\"]: must be"));
        assert!(got[1].starts_with("[unknown_annotation] metadata.annotations[\"lockmesh.io/fence-marks-clam\"]"));
        assert!(got.iter().any(|e| e.contains("\"0\" is neither a port number")));
        assert!(got.iter().any(|e| e.contains("\"70000\" is not a port number")));
        assert!(got.iter().any(|e| e.contains("\"1PORT\" is not an environment variable name")));
        assert!(got.iter().any(|e| e.contains("\"Fence_Config\" is not an object name")));
        assert!(got.iter().any(|e| e.contains("\"big\" is not a Kubernetes quantity")));
    }

    #[test]
    fn port_refs() {
        assert_eq!(parse_port_ref("8080"), Some(PortRef::Number(8080)));
        assert_eq!(parse_port_ref("http"), Some(PortRef::Name("http".into())));
        for bad in ["0", "65536", "HTTP", "-a", "a--b", "sixteen-chars-xx"] {
            assert_eq!(parse_port_ref(bad), None, "{bad}");
        }
    }
}
