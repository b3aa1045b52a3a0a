//! The etcd roles of a lockmesh deployment (ADR-05, ADR-20): one per component,
//! each with the least it needs under the key root. `lockctl etcd-roles` prints
//! them as `etcdctl` commands; the test suite applies the same definitions.
//!
//! etcd's permissions are read, write or readwrite on a key or prefix; *write
//! covers put and delete alike*. A role that may delete holds may put one. So the
//! approved two-person actions (force release, epoch advance) are executed by the
//! **arbiter** with its own role, which puts and deletes holds anyway, after it
//! verified both operators ([`super::server`]); the operators' role
//! `lockmesh-admin` only reads. `lockctl restore` and `lockctl epoch-advance`
//! without approval (a restored cluster, no arbiter serving) need the separate
//! break-glass role `lockmesh-admin-epoch`.

/// A permission type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Perm {
    /// Range and watch.
    Read,
    /// Put and delete.
    Write,
    /// Both.
    ReadWrite,
}

/// One permission on a key (or, with `prefix`, every key starting with it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Type.
    pub perm: Perm,
    /// Key or prefix.
    pub key: String,
    /// Whether `key` is a prefix.
    pub prefix: bool,
}

/// A role: name, what it is for, and its grants.
#[derive(Debug, Clone)]
pub struct Role {
    /// etcd role (and user) name.
    pub name: &'static str,
    /// Who uses it.
    pub purpose: &'static str,
    /// Its permissions.
    pub grants: Vec<Grant>,
}

fn g(perm: Perm, root: &str, rest: &str, prefix: bool) -> Grant {
    Grant { perm, key: format!("{root}/{rest}"), prefix }
}

/// The roles for key root `root`.
pub fn roles(root: &str) -> Vec<Role> {
    let r = root.trim_end_matches('/');
    let rw = |rest: &str, prefix: bool| g(Perm::ReadWrite, r, rest, prefix);
    vec![
        Role {
            name: "lockmesh-arbiter",
            purpose: "the arbiter: holds, sessions, markers, waiters, VM sessions, class policies, the epoch record, \
                      shipped unprotected grants; executes approved admin actions (force records, admin requests \
                      and their log)",
            grants: vec![
                rw("sys/epoch", false),
                // The grant clock every grant puts (restore detection, `lock::seal`).
                rw("sys/clock", false),
                rw("sys/classmap", false),
                // Several clusters (docs/SCALE.md): the shard map and epoch counter
                // (coord), every cluster's home record, session extensions.
                rw("sys/shardmap", false),
                rw("sys/epochs", false),
                rw("sys/home", false),
                // The keyspace version and capabilities (`lock::upgrade`): the
                // arbiter reads the record and advertises its own support on a
                // lease; it writes the record only on a fresh install (compared
                // absent, the keyspace empty); operators flip capabilities.
                rw("sys/keyspace", false),
                rw("sys/arbiters/", true),
                rw("sx/", true),
                rw("s/", true),
                rw("l/", true),
                rw("r/", true),
                rw("x/", true),
                rw("c/", true),
                rw("v/", true),
                rw("q/", true),
                rw("f/", true),
                // Lock-delay guards and records (`lock::delay`), classes with a delay only.
                rw("g/", true),
                rw("d/", true),
                // Shadow decisions' audit records (`lock::shadow`), classes with a candidate only.
                rw("w/", true),
                rw("adm/", true),
                // Shipped unprotected-grant records (fail-open classes, ADR-04).
                rw("u/", true),
            ],
        },
        Role {
            name: "lockmesh-admin",
            purpose:
                "operators' inspection (lockctl): read the root; writes nothing (the arbiter executes admin actions)",
            grants: vec![g(Perm::Read, r, "", true)],
        },
        Role {
            name: "lockmesh-admin-epoch",
            purpose: "break glass: approved epoch advance and restore, shard moves (lockctl shard apply|cancel: \
                      each moving cluster's epoch record), session revokes (the whole root)",
            grants: vec![rw("", true)],
        },
        Role {
            name: "lockmesh-classes",
            purpose: "operators' limit, class and capability changes (lockctl limit change|resume|cancel, \
                      class apply, upgrade enable|disable): read the root (verification counts holds), write \
                      the class policies, the prefix map, the shard map, the epoch counter, the home records \
                      and the keyspace record; no hold, session or epoch record (shard moves advance epoch \
                      records: lockmesh-admin-epoch)",
            grants: vec![
                g(Perm::Read, r, "", true),
                rw("c/", true),
                rw("sys/classmap", false),
                rw("sys/shardmap", false),
                rw("sys/epochs", false),
                rw("sys/home", false),
                rw("sys/keyspace", false),
            ],
        },
        Role {
            name: "lockmesh-audit",
            purpose: "the audit tailer: watch the root, and its election key",
            grants: vec![g(Perm::Read, r, "", true), rw("sys/audit-leader", false)],
        },
    ]
}

/// The etcd role each `lockctl` command needs (`None`: it does not talk to etcd).
/// `shard` reads the arbiter config's `etcd:` section, so its user is the one that
/// file names: give operators a copy naming theirs.
pub const COMMAND_ROLES: &[(&str, Option<&str>)] = &[
    ("inspect", Some("lockmesh-admin")),
    ("saturated", Some("lockmesh-admin")),
    ("doctor", Some("lockmesh-admin")),
    ("limit show", Some("lockmesh-admin")),
    ("shard show", Some("lockmesh-admin")),
    ("limit change|resume|cancel", Some("lockmesh-classes")),
    ("class apply", Some("lockmesh-classes")),
    // A move advances each moving cluster's epoch record (a soft advance that
    // keeps the old epoch's holds valid): the break-glass role's power.
    ("shard apply|cancel", Some("lockmesh-admin-epoch")),
    ("upgrade status", Some("lockmesh-admin")),
    ("upgrade enable|disable", Some("lockmesh-classes")),
    ("epoch-advance", Some("lockmesh-admin-epoch")),
    ("restore", Some("lockmesh-admin-epoch")),
    ("admin ...", None),
    ("audit ...", None),
    ("run", None),
    ("class check|cost|crds", None),
    ("etcd-roles", None),
];

/// [`COMMAND_ROLES`] as `#` comment lines, so the printed script still runs.
pub fn command_roles_table() -> String {
    let mut s = String::from("# lockctl command -> etcd role (--etcd-user; no command needs root)\n");
    for (cmd, role) in COMMAND_ROLES {
        let role = role.unwrap_or("- (no etcd: the arbiter, the audit tailer or files)");
        s.push_str(&format!("#   {cmd:<28} {role}\n"));
    }
    s
}

/// `etcdctl` commands creating the roles and one user per role (passwords are
/// read interactively: `--interactive`), then enabling auth.
pub fn etcdctl_script(root: &str) -> String {
    let mut s = String::from(
        "# lockmesh etcd roles (ADR-05). Run with ETCDCTL_ENDPOINTS, ETCDCTL_CACERT and a root login.\n\
         etcdctl user add root --interactive\n\
         etcdctl user grant-role root root\n",
    );
    for role in roles(root) {
        s.push_str(&format!("\n# {}: {}\netcdctl role add {}\n", role.name, role.purpose, role.name));
        for gr in &role.grants {
            let perm = match gr.perm {
                Perm::Read => "read",
                Perm::Write => "write",
                Perm::ReadWrite => "readwrite",
            };
            let prefix = if gr.prefix { " --prefix=true" } else { "" };
            s.push_str(&format!("etcdctl role grant-permission {}{prefix} {perm} {}\n", role.name, gr.key));
        }
        s.push_str(&format!(
            "etcdctl user add {} --interactive\netcdctl user grant-role {} {}\n",
            role.name, role.name, role.name
        ));
    }
    s.push('\n');
    s.push_str(&command_roles_table());
    s.push_str("\netcdctl auth enable\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_role_only_reads_and_the_arbiter_executes() {
        let rs = roles("/lm/");
        let admin = rs.iter().find(|r| r.name == "lockmesh-admin").unwrap();
        assert!(admin.grants.iter().all(|g| g.perm == Perm::Read), "{:?}", admin.grants);
        let arb = rs.iter().find(|r| r.name == "lockmesh-arbiter").unwrap();
        let writes: Vec<&str> = arb.grants.iter().filter(|g| g.perm != Perm::Read).map(|g| g.key.as_str()).collect();
        for k in ["/lm/l/", "/lm/f/", "/lm/adm/", "/lm/s/", "/lm/sys/epoch"] {
            assert!(writes.contains(&k), "arbiter cannot write {k}: {writes:?}");
        }
        assert!(!writes.contains(&"/lm/sys/audit-leader") && !writes.contains(&"/lm/"), "{writes:?}");
        let audit = rs.iter().find(|r| r.name == "lockmesh-audit").unwrap();
        assert!(audit.grants.iter().filter(|g| g.perm != Perm::Read).all(|g| g.key == "/lm/sys/audit-leader"));
        let s = etcdctl_script("/lm");
        assert!(s.contains("etcdctl role grant-permission lockmesh-admin --prefix=true read /lm/\n"), "{s}");
        assert!(s.contains("etcdctl role grant-permission lockmesh-arbiter --prefix=true readwrite /lm/f/\n"), "{s}");
        assert!(s.contains("etcdctl user grant-role root root\n"), "{s}");
        assert!(s.ends_with("etcdctl auth enable\n"));
    }

    /// Every command's role exists, none is root, and the classes role writes the
    /// policies and maps but no hold, session or epoch record.
    #[test]
    fn every_command_names_an_existing_least_role() {
        let rs = roles("/lm");
        for (cmd, role) in COMMAND_ROLES {
            if let Some(role) = role {
                assert!(rs.iter().any(|r| r.name == *role), "{cmd}: no role {role}");
            }
        }
        let classes = rs.iter().find(|r| r.name == "lockmesh-classes").unwrap();
        let writes: Vec<&str> =
            classes.grants.iter().filter(|g| g.perm != Perm::Read).map(|g| g.key.as_str()).collect();
        assert!(writes.contains(&"/lm/c/") && writes.contains(&"/lm/sys/classmap"), "{writes:?}");
        for k in ["/lm/l/", "/lm/s/", "/lm/sys/epoch", "/lm/", "/lm/f/"] {
            assert!(!writes.contains(&k), "lockmesh-classes writes {k}");
        }
        let t = command_roles_table();
        assert!(t.lines().all(|l| l.starts_with('#')), "{t}");
        assert!(t.contains("limit change|resume|cancel") && t.contains("lockmesh-classes"), "{t}");
    }
}
