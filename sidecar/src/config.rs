//! The injector's one `Config`: what the injected fence-proxy container looks like.
//!
//! Read from a YAML file (`--config`) with unknown keys refused; every field is
//! optional and has the default documented on it. Parsing goes `RawConfig` (serde)
//! to `Config` (validated), collecting every error with its field path.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use serde::Deserialize;

/// Default fence-proxy image. A placeholder: pin your registry's digest in production.
pub(crate) const DEFAULT_IMAGE: &str = "ghcr.io/lockmesh/fence-proxy:0.1.0";
/// Default port of fence-proxy's admin listener (health, readiness, metrics).
pub const DEFAULT_ADMIN_PORT: u16 = 15300;
/// Default loopback port the store is moved to when its pod names none.
pub const DEFAULT_BACKEND_PORT: u16 = 15081;
/// Default UID the fence-proxy container runs as (the distroless `nonroot` user).
pub(crate) const DEFAULT_RUN_AS_USER: i64 = 65532;
/// Default size of the marks volume claim a StatefulSet gets.
pub(crate) const DEFAULT_MARKS_SIZE: &str = "1Gi";

/// The validated injector configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// fence-proxy image reference. Default [`DEFAULT_IMAGE`].
    pub image: String,
    /// `imagePullPolicy` of the injected container: `Always`, `IfNotPresent` or
    /// `Never`. Default `IfNotPresent`.
    pub image_pull_policy: String,
    /// Port of fence-proxy's admin listener (probes and metrics hit it).
    /// Default [`DEFAULT_ADMIN_PORT`].
    pub admin_port: u16,
    /// Loopback port the store moves to when the pod's
    /// `lockmesh.io/fence-backend-port` is absent. Default [`DEFAULT_BACKEND_PORT`].
    pub default_backend_port: u16,
    /// UID (and, when the pod sets none, `fsGroup`) of the fence-proxy container.
    /// Default [`DEFAULT_RUN_AS_USER`].
    pub run_as_user: i64,
    /// Container resource requests (`cpu`, `memory`). Default 50m and 32Mi.
    pub requests: BTreeMap<String, String>,
    /// Container resource limits (`cpu`, `memory`). Default 1 CPU and 256Mi.
    pub limits: BTreeMap<String, String>,
    /// Storage request of the marks claim template added to StatefulSets, unless
    /// the pod template sets `lockmesh.io/fence-marks-size`. Default 1Gi.
    pub marks_size: String,
    /// HTTP path of fence-proxy's readiness endpoint on the admin port. Default `/readyz`.
    pub readiness_path: String,
    /// HTTP path of fence-proxy's liveness endpoint on the admin port. Default `/healthz`.
    pub liveness_path: String,
    /// The admin-owned store selector (`store_selector:`): which pods are fenced
    /// stores, injected or refused whatever their own annotations say. A pod is
    /// selected when ANY of its parts matches; none of them lets a pod leave a
    /// selection. Besides these, every pod the webhook receives on `/mutate/store`
    /// (namespaces labelled `lockmesh.io/fence-injection: store`, chosen by the
    /// MutatingWebhookConfiguration) is selected.
    pub store_selector: StoreSelector,
    /// The ConfigMap holding fence-proxy.yaml (and so the fence's trusted signing
    /// keys), chosen by the admin. When set, a pod naming another in
    /// `lockmesh.io/fence-config` is refused; a pod naming none gets this one.
    pub fence_config_map: Option<String>,
    /// Containers the admins allow beside the store and the fence in a fenced
    /// pod (`companions:`), each by name AND image. Every container of a pod
    /// shares its loopback, so any other long-running container (a regular one,
    /// or an init container with `restartPolicy: Always`) could re-expose the
    /// store's own port past the fence: a fenced pod holding one is refused.
    /// Default none.
    pub companions: Vec<Companion>,
}

/// One container the admins allow beside a fenced store (`companions:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Companion {
    /// The container's name, exactly.
    pub name: String,
    /// Its image: an exact reference, or a prefix ending in `*` (for example
    /// `docker.io/istio/proxyv2:*`, or a registry path pinned by digest).
    pub image: String,
}

impl Companion {
    /// Whether a container named `name` running `image` is this companion.
    pub fn admits(&self, name: &str, image: &str) -> bool {
        name == self.name
            && match self.image.strip_suffix('*') {
                Some(prefix) => image.starts_with(prefix),
                None => image == self.image,
            }
    }
}

/// Which pods are fenced stores, by what the admins own. Every part adds pods to
/// the selection; an empty selector selects nothing (pods may then opt in by
/// annotation, and opt out).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreSelector {
    /// Namespaces every pod of which is a store (`namespaces:`). The webhook reads
    /// the namespace from the AdmissionReview (the API server's, not the pod's);
    /// `lockmesh-inject` from the object's `metadata.namespace`.
    pub namespaces: BTreeSet<String>,
    /// `(namespace, service account)` pairs whose pods are stores
    /// (`service_accounts: ["ns/name"]`). A pod chooses its service account, so
    /// this only adds pods: a store pod running as another account is selected
    /// only by the other parts.
    pub service_accounts: BTreeSet<(String, String)>,
    /// Labels a pod must all carry to be a store (`pod_labels:`). The pod writes
    /// its own labels, so this is an opt-in the pod cannot take back by
    /// annotation, never a way to select a namespace's stores: a pod dropping the
    /// label leaves this part of the selection (use `namespaces` or the
    /// `store` namespace label for that).
    pub pod_labels: BTreeMap<String, String>,
}

impl StoreSelector {
    /// Whether no part is set.
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty() && self.service_accounts.is_empty() && self.pod_labels.is_empty()
    }
}

/// One configuration error, with the file and field it concerns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {field}: {message}")]
pub struct ConfigError {
    /// The file read (or `<inline>`).
    pub file: String,
    /// Dotted field path, or `-` for an error no field is to blame for (a syntax error).
    pub field: String,
    /// Why the value is refused.
    pub message: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    image: Option<String>,
    image_pull_policy: Option<String>,
    admin_port: Option<u16>,
    default_backend_port: Option<u16>,
    run_as_user: Option<i64>,
    resources: Option<RawResources>,
    marks_size: Option<String>,
    readiness_path: Option<String>,
    liveness_path: Option<String>,
    store_selector: Option<RawStoreSelector>,
    fence_config_map: Option<String>,
    #[serde(default)]
    companions: Vec<RawCompanion>,
}

/// One entry of `companions:` in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCompanion {
    name: String,
    image: String,
}

/// `store_selector:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStoreSelector {
    #[serde(default)]
    namespaces: Vec<String>,
    #[serde(default)]
    service_accounts: Vec<String>,
    pod_labels: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResources {
    requests: Option<BTreeMap<String, String>>,
    limits: Option<BTreeMap<String, String>>,
}

// === impl Config ===

impl Default for Config {
    fn default() -> Self {
        let pair = |cpu: &str, mem: &str| {
            BTreeMap::from([("cpu".to_owned(), cpu.to_owned()), ("memory".to_owned(), mem.to_owned())])
        };
        Self {
            image: DEFAULT_IMAGE.to_owned(),
            image_pull_policy: "IfNotPresent".to_owned(),
            admin_port: DEFAULT_ADMIN_PORT,
            default_backend_port: DEFAULT_BACKEND_PORT,
            run_as_user: DEFAULT_RUN_AS_USER,
            requests: pair("50m", "32Mi"),
            limits: pair("1", "256Mi"),
            marks_size: DEFAULT_MARKS_SIZE.to_owned(),
            readiness_path: "/readyz".to_owned(),
            liveness_path: "/healthz".to_owned(),
            store_selector: StoreSelector::default(),
            fence_config_map: None,
            companions: Vec::new(),
        }
    }
}

impl Config {
    /// What the injector selects and excludes, in words (`--check-config` prints it).
    pub fn selection(&self) -> Vec<String> {
        let sel = &self.store_selector;
        let mut out = vec![
            "namespaces sent: those the MutatingWebhookConfiguration's namespaceSelectors send, never kube-system or \
             lockmesh-system: lockmesh.io/fence-injection=store to /mutate/store (every pod there is a store), \
             lockmesh.io/fence-injection=enabled to /mutate (this file decides)"
                .to_owned(),
        ];
        if !sel.namespaces.is_empty() {
            let ns: Vec<&str> = sel.namespaces.iter().map(String::as_str).collect();
            out.push(format!("stores: every pod in namespace {} is injected or refused", ns.join(", ")));
        }
        if !sel.service_accounts.is_empty() {
            let sas: Vec<String> = sel.service_accounts.iter().map(|(n, s)| format!("{n}/{s}")).collect();
            out.push(format!(
                "stores: every pod running as service account {} is injected or refused (a pod choosing another \
                 account is selected only by the other rules)",
                sas.join(", ")
            ));
        }
        if !sel.pod_labels.is_empty() {
            let pairs: Vec<String> = sel.pod_labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push(format!(
                "stores: every pod labelled {} is injected or refused, whatever its annotations say (an opt-in: a \
                 pod without the label is selected only by the other rules)",
                pairs.join(",")
            ));
        }
        if sel.is_empty() {
            out.push(
                "stores on /mutate: pods annotated lockmesh.io/fence: enabled (no store_selector: a pod may opt out; \
                 only namespaces labelled lockmesh.io/fence-injection=store are fenced whatever their pods say)"
                    .into(),
            );
        } else {
            out.push(
                "other pods on /mutate: injected when annotated lockmesh.io/fence: enabled, else untouched".into(),
            );
        }
        out.push(match &self.fence_config_map {
            Some(cm) => format!("fence config and trusted keys: ConfigMap {cm} only (a pod naming another is refused)"),
            None => "fence config and trusted keys: the ConfigMap the pod names (no fence_config_map; a selected \
                     store is refused)"
                .into(),
        });
        out.push(format!(
            "already injected: only a pod equal to what the injector itself makes of it; a {} container, init \
             container, volume or status annotation of the pod's own is replaced, never believed",
            crate::inject::CONTAINER
        ));
        out.push(if self.companions.is_empty() {
            "beside the store and the fence: no other long-running container (it would share the store's loopback)"
                .to_owned()
        } else {
            let list: Vec<String> = self.companions.iter().map(|c| format!("{} ({})", c.name, c.image)).collect();
            format!("beside the store and the fence: only {}", list.join(", "))
        });
        out
    }

    /// Reads and validates a configuration file (the same code serves startup and
    /// `--check-config`).
    pub fn load(path: &Path) -> Result<Self, Vec<ConfigError>> {
        let file = path.display().to_string();
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text, &file),
            Err(e) => Err(vec![ConfigError { file, field: "-".into(), message: format!("cannot read: {e}") }]),
        }
    }

    /// Parses YAML text; `file` only labels the errors. Returns every error found.
    pub fn parse(text: &str, file: &str) -> Result<Self, Vec<ConfigError>> {
        let raw: RawConfig = if text.trim().is_empty() {
            RawConfig::default()
        } else {
            lockmesh_runtime::parse_yaml(text).map_err(|e| {
                vec![ConfigError {
                    file: file.to_owned(),
                    field: e.path.unwrap_or_else(|| "-".into()),
                    message: e.message,
                }]
            })?
        };
        Self::try_from_raw(raw, file)
    }

    fn try_from_raw(raw: RawConfig, file: &str) -> Result<Self, Vec<ConfigError>> {
        let mut errs = Vec::new();
        let mut err = |field: &str, message: String| {
            errs.push(ConfigError { file: file.to_owned(), field: field.to_owned(), message })
        };
        let mut c = Self::default();
        if let Some(image) = raw.image {
            if image.trim().is_empty() || image.chars().any(char::is_whitespace) {
                err("image", format!("must be a non-empty image reference without spaces, got {image:?}"));
            }
            c.image = image;
        }
        if let Some(p) = raw.image_pull_policy {
            if !matches!(p.as_str(), "Always" | "IfNotPresent" | "Never") {
                err("image_pull_policy", format!("must be Always, IfNotPresent or Never, got {p:?}"));
            }
            c.image_pull_policy = p;
        }
        for (field, value, slot) in [
            ("admin_port", raw.admin_port, &mut c.admin_port),
            ("default_backend_port", raw.default_backend_port, &mut c.default_backend_port),
        ] {
            if let Some(v) = value {
                if v == 0 {
                    err(field, "must be a port in 1..=65535, got 0".into());
                }
                *slot = v;
            }
        }
        if c.admin_port == c.default_backend_port {
            err("admin_port", format!("must differ from default_backend_port, both are {}", c.admin_port));
        }
        if let Some(uid) = raw.run_as_user {
            if uid <= 0 {
                err("run_as_user", format!("must be a non-root uid above 0, got {uid}"));
            }
            c.run_as_user = uid;
        }
        if let Some(r) = raw.resources {
            for (name, map, slot) in [("requests", r.requests, &mut c.requests), ("limits", r.limits, &mut c.limits)] {
                let Some(map) = map else { continue };
                for (k, v) in &map {
                    if !matches!(k.as_str(), "cpu" | "memory" | "ephemeral-storage") {
                        err(
                            &format!("resources.{name}.{k}"),
                            "unknown resource: use cpu, memory or ephemeral-storage".into(),
                        );
                    } else if !is_quantity(v) {
                        err(&format!("resources.{name}.{k}"), format!("{v:?} is not a Kubernetes quantity"));
                    }
                }
                *slot = map;
            }
        }
        if let Some(size) = raw.marks_size {
            if !is_quantity(&size) {
                err("marks_size", format!("{size:?} is not a Kubernetes quantity (for example 1Gi)"));
            }
            c.marks_size = size;
        }
        for (field, value, slot) in [
            ("readiness_path", raw.readiness_path, &mut c.readiness_path),
            ("liveness_path", raw.liveness_path, &mut c.liveness_path),
        ] {
            if let Some(p) = value {
                if !p.starts_with('/') {
                    err(field, format!("must be an absolute HTTP path, got {p:?}"));
                }
                *slot = p;
            }
        }
        if let Some(sel) = raw.store_selector {
            let pod_labels = sel.pod_labels.unwrap_or_default();
            if sel.namespaces.is_empty() && sel.service_accounts.is_empty() && pod_labels.is_empty() {
                err(
                    "store_selector",
                    "must name namespaces, service_accounts or pod_labels (omit store_selector for none)".into(),
                );
            }
            for ns in &sel.namespaces {
                if !crate::annotations::is_dns_label(ns) {
                    err("store_selector.namespaces", format!("{ns:?} is not a namespace name (a DNS-1123 label)"));
                }
                c.store_selector.namespaces.insert(ns.clone());
            }
            for sa in &sel.service_accounts {
                match sa.split_once('/') {
                    Some((ns, name))
                        if crate::annotations::is_dns_label(ns) && crate::annotations::is_dns_subdomain(name) =>
                    {
                        c.store_selector.service_accounts.insert((ns.to_owned(), name.to_owned()));
                    }
                    _ => err("store_selector.service_accounts", format!("{sa:?} is not NAMESPACE/SERVICE_ACCOUNT")),
                }
            }
            for (k, v) in &pod_labels {
                if k.is_empty() || k.contains(char::is_whitespace) || v.contains(char::is_whitespace) {
                    err(&format!("store_selector.pod_labels.{k}"), format!("{k:?}: {v:?} is not a label pair"));
                }
            }
            c.store_selector.pod_labels = pod_labels;
        }
        if let Some(cm) = raw.fence_config_map {
            if !crate::annotations::is_dns_subdomain(&cm) {
                err("fence_config_map", format!("{cm:?} is not an object name (a DNS-1123 subdomain)"));
            }
            c.fence_config_map = Some(cm);
        }
        for (i, comp) in raw.companions.into_iter().enumerate() {
            let field = format!("companions[{i}]");
            if comp.name == crate::inject::CONTAINER || !crate::annotations::is_dns_label(&comp.name) {
                err(
                    &format!("{field}.name"),
                    format!("{:?} is not a container name other than the fence's", comp.name),
                );
            }
            let prefix = comp.image.strip_suffix('*').unwrap_or(&comp.image);
            // A prefix names one repository up to its tag or digest: `*` alone or
            // `registry/*` would admit any image there.
            let last = prefix.rsplit('/').next().unwrap_or_default();
            let one_repository = comp.image == prefix || last.contains([':', '@']);
            if prefix.is_empty()
                || comp.image.chars().any(char::is_whitespace)
                || prefix.contains('*')
                || !one_repository
            {
                err(
                    &format!("{field}.image"),
                    format!(
                        "{:?} must be an image reference with a tag or digest, or a prefix of one ending in `*` \
                         after its `:` or `@`",
                        comp.image
                    ),
                );
            }
            c.companions.push(Companion { name: comp.name, image: comp.image });
        }
        if !c.store_selector.is_empty() && c.fence_config_map.is_none() {
            err(
                "fence_config_map",
                "required with store_selector: a selected store's fence config and trusted keys must be the \
                 admin's ConfigMap, not one the pod names"
                    .into(),
            );
        }
        if errs.is_empty() {
            Ok(c)
        } else {
            Err(errs)
        }
    }
}

/// Whether `s` is a Kubernetes resource quantity: digits with an optional
/// fraction, then an optional SI or binary suffix (`500m`, `1.5`, `256Mi`, `1G`).
pub(crate) fn is_quantity(s: &str) -> bool {
    let digits_end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, suffix) = s.split_at(digits_end);
    let mut parts = num.split('.');
    let whole_ok = parts.next().is_some_and(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()));
    let frac_ok = parts.next().is_none_or(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()));
    whole_ok
        && frac_ok
        && parts.next().is_none()
        && matches!(suffix, "" | "m" | "k" | "M" | "G" | "T" | "P" | "E" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_the_default() {
        assert_eq!(Config::parse("", "c.yaml").unwrap(), Config::default());
    }

    #[test]
    fn every_error_is_reported_with_its_field() {
        let errs = Config::parse(
            "image_pull_policy: Sometimes\nadmin_port: 15081\nmarks_size: lots\nreadiness_path: readyz\nresources: {limits: {gpu: '1'}}\n",
            "c.yaml",
        )
        .unwrap_err();
        let got: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "c.yaml: image_pull_policy: must be Always, IfNotPresent or Never, got \"Sometimes\"",
                "c.yaml: admin_port: must differ from default_backend_port, both are 15081",
                "c.yaml: resources.limits.gpu: unknown resource: use cpu, memory or ephemeral-storage",
                "c.yaml: marks_size: \"lots\" is not a Kubernetes quantity (for example 1Gi)",
                "c.yaml: readiness_path: must be an absolute HTTP path, got \"readyz\"",
            ]
        );
    }

    #[test]
    fn unknown_keys_are_refused() {
        let errs = Config::parse("imagee: x\n", "c.yaml").unwrap_err();
        assert!(errs[0].message.contains("unknown field `imagee`"), "{errs:?}");
        assert_eq!(errs[0].field, "imagee", "{errs:?}");
    }

    #[test]
    fn companions_name_one_repository_and_never_the_fence() {
        let c = Config::parse(
            "companions:\n- {name: istio-proxy, image: 'docker.io/istio/proxyv2:*'}\n- {name: exporter, image: 'reg:5000/exp@sha256:ab'}\n",
            "c.yaml",
        )
        .unwrap();
        assert!(c.companions[0].admits("istio-proxy", "docker.io/istio/proxyv2:1.24.0"));
        assert!(!c.companions[0].admits("istio-proxy", "docker.io/istio/proxyv2-evil:1"));
        assert!(!c.companions[0].admits("relay", "docker.io/istio/proxyv2:1.24.0"));
        assert!(c.companions[1].admits("exporter", "reg:5000/exp@sha256:ab"));
        assert!(!c.companions[1].admits("exporter", "reg:5000/exp@sha256:abc"));
        for bad in [
            "{name: x, image: '*'}",
            "{name: x, image: 'reg:5000/*'}",
            "{name: lockmesh-fence, image: 'a:1'}",
            "{name: x, image: 'a:*b*'}",
        ] {
            let errs = Config::parse(&format!("companions: [{bad}]\n"), "c.yaml").unwrap_err();
            assert!(errs[0].field.starts_with("companions[0]"), "{bad}: {errs:?}");
        }
    }

    #[test]
    fn quantities() {
        for ok in ["1", "500m", "1.5", "256Mi", "1Gi", "10G"] {
            assert!(is_quantity(ok), "{ok}");
        }
        for bad in ["", "Gi", "1.", ".5", "1GB", "-1", "1 Gi", "1.2.3"] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }
}
