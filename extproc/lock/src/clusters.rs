//! The etcd clusters a deployment runs on, as the arbiter's config file names them
//! (`etcd:`, `clusters:`, `tiers:`, `region:`; docs/SCALE.md), validated once for
//! the arbiter and for `lockctl shard`, which reads the same file.

use std::{collections::BTreeMap, path::Path, time::Duration};

use serde::Deserialize;

use crate::{
    connect::{validate_etcd_auth, EtcdAuthFields, EtcdClientAuth, RawEtcd},
    test_faults::{self, TestFault},
    tiers::{FailOpenSettings, Tiers, TiersConfig},
    topology::{RawCluster, RawRegion, RawTiers, Topology},
    GroupLimits, LockError, Store,
};

/// Default `etcd.op_timeout_ms`.
pub(crate) const DEFAULT_OP_TIMEOUT_MS: u64 = 2000;

/// The cluster sections of an arbiter config file; every other section is the
/// arbiter's own and ignored here.
#[derive(Debug, Deserialize)]
pub struct RawClusterSections {
    /// The coord cluster.
    pub etcd: RawEtcd,
    /// More clusters by name.
    #[serde(default)]
    pub clusters: BTreeMap<String, RawCluster>,
    /// The entity tier's clusters for the first shard map.
    pub tiers: Option<RawTiers>,
    /// Regional homing.
    pub region: Option<RawRegion>,
    /// TEST ONLY planted bugs (refused by a shipped build and unless
    /// `LOCKMESH_TEST_FAULTS=1`).
    #[serde(default)]
    pub test_faults: Vec<String>,
}

/// The validated clusters of a deployment.
#[derive(Debug)]
pub struct Clusters {
    /// The coord cluster's client URLs.
    pub endpoints: Vec<String>,
    /// The key root every cluster uses.
    pub root: String,
    /// Timeout of one etcd call, ms.
    pub op_timeout_ms: u64,
    /// The largest group and etcd's limits (`etcd.max_group`, ...).
    pub group: GroupLimits,
    /// TLS and user of the coord cluster.
    pub auth: EtcdClientAuth,
    /// The other clusters and the region.
    pub topology: Topology,
    /// TEST ONLY planted bugs.
    pub test_faults: Vec<TestFault>,
}

// === impl Clusters ===

impl Clusters {
    /// Validates the cluster sections, pushing every error (`name: field: why`).
    pub fn from_raw(
        etcd: &RawEtcd,
        clusters: &BTreeMap<String, RawCluster>,
        tiers: Option<&RawTiers>,
        region: Option<&RawRegion>,
        faults: &[String],
        base: &Path,
        name: &str,
        errs: &mut Vec<String>,
    ) -> Self {
        if etcd.endpoints.is_empty() {
            errs.push(format!("{name}: etcd.endpoints: must list at least one endpoint"));
        }
        for (i, e) in etcd.endpoints.iter().enumerate() {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                errs.push(format!("{name}: etcd.endpoints[{i}]: {e:?} must start with http:// or https://"));
            }
        }
        let root = etcd.root.trim_end_matches('/').to_owned();
        if !etcd.root.starts_with('/')
            || root.is_empty()
            || !root.bytes().all(|b| b.is_ascii_alphanumeric() || b"/-_.".contains(&b))
            || root.contains("//")
        {
            errs.push(format!(
                "{name}: etcd.root: {:?} must be like /lockmesh ([A-Za-z0-9/_.-], starting with '/', not '/' alone)",
                etcd.root
            ));
        }
        let op_timeout_ms = etcd.op_timeout_ms.unwrap_or(DEFAULT_OP_TIMEOUT_MS);
        if !(100..=60_000).contains(&op_timeout_ms) {
            errs.push(format!("{name}: etcd.op_timeout_ms: {op_timeout_ms} is outside 100 to 60000"));
        }
        let group = group_limits(etcd, name, errs);
        let mut test_faults = Vec::new();
        for (i, f) in faults.iter().enumerate() {
            match TestFault::parse(f) {
                Some(t) => test_faults.push(t),
                None if !test_faults::ENABLED => errs.push(format!(
                    "{name}: test_faults[{i}]: {f:?}: this build has no planted faults (only a test build, \
                     feature test-faults, has them)"
                )),
                None => errs.push(format!("{name}: test_faults[{i}]: {f:?} is not a known planted bug")),
            }
        }
        if !test_faults.is_empty() && std::env::var(test_faults::ENV).as_deref() != Ok("1") {
            errs.push(format!(
                "{name}: test_faults: planted bugs for the release gate, refused unless {}=1",
                test_faults::ENV
            ));
        }
        let topology = Topology::from_raw(clusters, tiers, region, name, errs, &mut |r, e| etcd_auth(r, base, name, e));
        let auth = etcd_auth(etcd, base, name, errs);
        Self { endpoints: etcd.endpoints.clone(), root, op_timeout_ms, group, auth, topology, test_faults }
    }

    /// Reads the cluster sections of the arbiter config file at `path`.
    pub fn load_arbiter_file(path: &Path) -> Result<Self, Vec<String>> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| vec![format!("{name}: cannot read: {e}")])?;
        let raw: RawClusterSections = lockmesh_runtime::parse_yaml(&text).map_err(|e| vec![format!("{name}: {e}")])?;
        let base = path.parent().unwrap_or(Path::new("."));
        let mut errs = Vec::new();
        let c = Self::from_raw(
            &raw.etcd,
            &raw.clusters,
            raw.tiers.as_ref(),
            raw.region.as_ref(),
            &raw.test_faults,
            base,
            &name,
            &mut errs,
        );
        if errs.is_empty() {
            Ok(c)
        } else {
            Err(errs)
        }
    }

    /// Connects every cluster without marks files or fail-open spools (an operator
    /// tool's view: the default hand-off, no registry; the arbiter connects
    /// through [`Tiers::connect`] with its own).
    pub async fn connect(&self) -> Result<Tiers, LockError> {
        let op_timeout = Duration::from_millis(self.op_timeout_ms);
        let rt = crate::Runtime::new(Default::default());
        let coord = Store::connect_with(&self.endpoints, &self.root, op_timeout, None, &self.auth, &rt).await?;
        let cfg = TiersConfig {
            topology: &self.topology,
            root: &self.root,
            op_timeout,
            marks_file: None,
            fail_open: FailOpenSettings {
                spool_file: None,
                max_spool_bytes: 0,
                quorum_loss_after_ms: u64::MAX,
                check_timeout_ms: 2000,
            },
            group: self.group,
        };
        Tiers::connect(&cfg, coord).await
    }
}

/// Default `etcd.max_group`.
pub const DEFAULT_MAX_GROUP: usize = 64;

/// Validates `etcd.max_group`, `etcd.max_txn_ops` and `etcd.max_request_bytes`.
fn group_limits(raw: &RawEtcd, name: &str, errs: &mut Vec<String>) -> GroupLimits {
    let d = GroupLimits::ALONE;
    let l = GroupLimits {
        max_group: raw.max_group.unwrap_or(DEFAULT_MAX_GROUP),
        in_flight: raw.groups_in_flight.unwrap_or(d.in_flight),
        max_txn_ops: raw.max_txn_ops.unwrap_or(d.max_txn_ops),
        max_request_bytes: raw.max_request_bytes.unwrap_or(d.max_request_bytes),
    };
    if !(1..=1024).contains(&l.max_group) {
        errs.push(format!("{name}: etcd.max_group: {} is outside 1 to 1024 (1 sends each grant alone)", l.max_group));
    }
    if !(1..=8).contains(&l.in_flight) {
        errs.push(format!("{name}: etcd.groups_in_flight: {} is outside 1 to 8", l.in_flight));
    }
    // A lone multi-key grant must fit as it always had to (`multi::MAX_TXN_OPS`).
    if l.max_txn_ops < crate::multi::MAX_TXN_OPS {
        errs.push(format!(
            "{name}: etcd.max_txn_ops: {} is below {}, the most a lone grant of the most keys can need",
            l.max_txn_ops,
            crate::multi::MAX_TXN_OPS
        ));
    }
    if l.max_request_bytes < 65_536 {
        errs.push(format!("{name}: etcd.max_request_bytes: {} is below 65536", l.max_request_bytes));
    }
    l
}

/// Validates `etcd.tls`, `etcd.user` and `etcd.password_file` against the endpoints.
pub fn etcd_auth(raw: &RawEtcd, base: &Path, name: &str, errs: &mut Vec<String>) -> EtcdClientAuth {
    let parts = EtcdAuthFields {
        endpoints: &raw.endpoints,
        tls: raw.tls.as_ref(),
        user: raw.user.as_deref(),
        password_file: raw.password_file.as_deref(),
    };
    validate_etcd_auth(&parts, "etcd.", base, name, errs)
}

#[cfg(test)]
mod etcd_auth_tests {
    use super::*;
    use std::path::PathBuf;

    use crate::connect::RawEtcdTls;

    fn raw(endpoints: &[&str], tls: Option<RawEtcdTls>, user: Option<&str>, pw: Option<&str>) -> RawEtcd {
        RawEtcd {
            endpoints: endpoints.iter().map(|s| s.to_string()).collect(),
            root: "/lm".into(),
            op_timeout_ms: None,
            max_group: None,
            groups_in_flight: None,
            max_txn_ops: None,
            max_request_bytes: None,
            tls,
            user: user.map(str::to_owned),
            password_file: pw.map(str::to_owned),
        }
    }

    #[test]
    fn etcd_tls_and_user_are_validated_with_field_paths() {
        let dir = tempfile_dir();
        std::fs::write(dir.join("ca.pem"), "CA").unwrap();
        std::fs::write(dir.join("pw"), "secret\n").unwrap();
        let tls = || Some(RawEtcdTls { ca: "ca.pem".into(), cert: None, key: None });
        let mut errs = Vec::new();
        let a = etcd_auth(&raw(&["https://e:2379"], tls(), Some("arb"), Some("pw")), &dir, "a.yaml", &mut errs);
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!((a.ca.as_deref(), a.user.clone()), (Some(&b"CA"[..]), Some(("arb".into(), "secret".into()))));
        assert!(!format!("{a:?}").contains("secret"), "password in Debug");
        let cases = [
            (raw(&["https://e:2379"], None, None, None), "a.yaml: etcd.tls: required for https:// endpoints"),
            (raw(&["http://e:2379"], tls(), None, None), "a.yaml: etcd.endpoints: with etcd.tls every endpoint"),
            (raw(&["http://e:2379"], None, Some("arb"), None), "a.yaml: etcd.password_file: required with etcd.user"),
            (raw(&["http://e:2379"], None, None, Some("pw")), "a.yaml: etcd.user: required with etcd.password_file"),
            (
                raw(
                    &["https://e:2379"],
                    Some(RawEtcdTls { ca: "ca.pem".into(), cert: Some("c".into()), key: None }),
                    None,
                    None,
                ),
                "a.yaml: etcd.tls.key: required with etcd.tls.cert",
            ),
            (raw(&["http://e:2379"], None, Some("arb"), Some("missing")), "a.yaml: etcd.password_file: cannot read"),
        ];
        for (r, want) in cases {
            let mut errs = Vec::new();
            etcd_auth(&r, &dir, "a.yaml", &mut errs);
            assert!(errs.iter().any(|e| e.starts_with(want)), "{want}: {errs:?}");
        }
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("lm-etcd-auth-{}-{:x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
