//! Checks of the workspace's shape rather than its behaviour, read from Cargo and
//! the sources (no process of lockmesh runs):
//!
//! - the arrows between the workspace's crates point one way (`LAYERS`), and the
//!   arbiter links neither the SDK, the CLIs nor the test PKI;
//! - the shipped build has no planted faults: `lockmesh-extproc` without the
//!   release gate's `test-faults`, the Wasm module without `test-trap`, and no
//!   shipped binary with the dev PKI's token minter (`lockmesh-devcerts`);
//! - the services build their JSON bodies from `core::wire` types, not `json!`;
//! - the lock recipe's process-wide statics are counters only: its
//!   configuration is passed in (`lockmesh_lock::runtime`).
//!
//! Each check says in a comment which planted change makes it fail.

// A test binary: a failed unwrap is a failed check, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize;

/// Each workspace crate: its layer, and the workspace crates it may have as
/// normal dependencies (today's edges). Every allowed edge points to a lower
/// layer, so no cycle and no upward arrow can be added without changing this table.
///
/// 0 foundations: the wire types (`lockmesh-core`), the service runtime, the dev
///   PKI; the empty Wasm filter the filter tax is measured against (no lockmesh crate);
///   the S3 request signer
/// 1 what builds on the wire types alone: the etcd records, how to reach etcd,
///   telemetry, the SDK, the Wasm filter, the fence proxy, the sidecar
/// 2 the etcd recipe (`lockmesh-lock`); the class registry loader and its CRDs;
///   the SDK conformance suite's Rust driver
/// 3 the operator workflows (`lockmesh-ops`)
/// 4 the arbiter and the audit tailer (whose query port checks operators with the
///   ops verifier); the test harness, which gives each stack the shipped etcd roles
///   (`lockmesh_ops::admin::etcd_roles`)
/// 5 `lockctl`, which drives the operator workflows, the audit query and the SDK;
///   the harness's gate and load libraries
const LAYERS: &[(&str, u8, &[&str])] = &[
    ("lockmesh-core", 0, &[]),
    ("lockmesh-runtime", 0, &[]),
    ("lockmesh-devcerts", 0, &[]),
    ("lockmesh-empty-filter", 0, &[]),
    ("lockmesh-sigv4", 0, &[]),
    ("lockmesh-keyspace", 1, &["lockmesh-core"]),
    ("lockmesh-etcd", 1, &["lockmesh-runtime"]),
    ("lockmesh-registry", 2, &["lockmesh-core", "lockmesh-keyspace", "lockmesh-runtime"]),
    ("lockmesh-telemetry", 1, &["lockmesh-core"]),
    ("lockmesh-client", 1, &["lockmesh-core", "lockmesh-runtime"]),
    ("lockmesh-conformance-driver", 2, &["lockmesh-client"]),
    ("lockmesh-wasm-filter", 1, &["lockmesh-core"]),
    ("lockmesh-fence-proxy", 1, &["lockmesh-core", "lockmesh-runtime", "lockmesh-sigv4"]),
    ("lockmesh-sidecar", 1, &["lockmesh-runtime"]),
    ("lockmesh-tests", 4, &["lockmesh-core", "lockmesh-devcerts", "lockmesh-ops"]),
    (
        "lockmesh-lock",
        2,
        &["lockmesh-core", "lockmesh-etcd", "lockmesh-keyspace", "lockmesh-runtime", "lockmesh-telemetry"],
    ),
    ("lockmesh-gate", 5, &["lockmesh-client", "lockmesh-core", "lockmesh-devcerts", "lockmesh-tests"]),
    (
        "lockmesh-load",
        5,
        &["lockmesh-core", "lockmesh-devcerts", "lockmesh-lock", "lockmesh-registry", "lockmesh-tests"],
    ),
    ("lockmesh-ops", 3, &["lockmesh-core", "lockmesh-keyspace", "lockmesh-lock", "lockmesh-runtime"]),
    (
        "lockmesh-extproc",
        4,
        &[
            "lockmesh-core",
            "lockmesh-keyspace",
            "lockmesh-lock",
            "lockmesh-ops",
            "lockmesh-registry",
            "lockmesh-runtime",
            "lockmesh-telemetry",
        ],
    ),
    (
        "lockmesh-audit",
        4,
        &[
            "lockmesh-core",
            "lockmesh-etcd",
            "lockmesh-keyspace",
            "lockmesh-ops",
            "lockmesh-registry",
            "lockmesh-runtime",
            "lockmesh-sigv4",
            "lockmesh-telemetry",
        ],
    ),
    (
        "lockmesh-lockctl",
        5,
        &[
            "lockmesh-audit",
            "lockmesh-client",
            "lockmesh-core",
            "lockmesh-keyspace",
            "lockmesh-lock",
            "lockmesh-ops",
            "lockmesh-registry",
            "lockmesh-runtime",
        ],
    ),
];

/// The shipped binaries: none may link the dev PKI (its operator token minter).
const SHIPPED: &[&str] =
    &["lockmesh-extproc", "lockmesh-lockctl", "lockmesh-audit", "lockmesh-fence-proxy", "lockmesh-sidecar"];

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    dependencies: Vec<Dependency>,
    targets: Vec<Target>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
    /// `bin`, `lib`, `test`, `bench`, `example`, ...
    kind: Vec<String>,
}

#[derive(Deserialize)]
struct Dependency {
    name: String,
    /// `None` for a normal dependency, else `dev` or `build`.
    kind: Option<String>,
}

fn root() -> PathBuf {
    lockmesh_tests::repo_root()
}

/// Runs cargo (the one running these tests) in the workspace; its stdout.
fn cargo(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO")).args(args).current_dir(root()).output().unwrap();
    assert!(out.status.success(), "cargo {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The package names `cargo tree ... --prefix none` prints (`name vX.Y.Z ...`).
fn tree(args: &[&str]) -> BTreeSet<String> {
    let mut all = vec!["tree", "--locked", "--prefix", "none"];
    all.extend_from_slice(args);
    cargo(&all).lines().filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect()
}

/// The workspace crates' normal dependencies on each other.
fn workspace_edges() -> BTreeMap<String, BTreeSet<String>> {
    let m: Metadata = serde_json::from_str(&cargo(&["metadata", "--format-version", "1", "--no-deps"])).unwrap();
    let names: BTreeSet<&str> = m.packages.iter().map(|p| p.name.as_str()).collect();
    m.packages
        .iter()
        .map(|p| {
            let deps = p
                .dependencies
                .iter()
                .filter(|d| d.kind.is_none() && names.contains(d.name.as_str()))
                .map(|d| d.name.clone())
                .collect();
            (p.name.clone(), deps)
        })
        .collect()
}

/// scripts/test builds once with `cargo test --workspace --no-run`, and cargo builds a
/// package's binaries as runnable executables (`target/<profile>/<bin>`, where the
/// scenarios look for them) only for that package's own integration tests. So every
/// package with a binary needs one, or a clean clone's scenarios find no binary
/// (planted: delete client/conformance/driver-rust/tests/, which is how the Rust
/// conformance driver went missing on CI once).
#[test]
fn every_package_with_a_binary_has_an_integration_test() {
    let m: Metadata = serde_json::from_str(&cargo(&["metadata", "--format-version", "1", "--no-deps"])).unwrap();
    let kind = |p: &Package, k: &str| -> Vec<String> {
        p.targets.iter().filter(|t| t.kind.iter().any(|x| x == k)).map(|t| t.name.clone()).collect()
    };
    let missing: Vec<String> = m
        .packages
        .iter()
        .filter(|p| !kind(p, "bin").is_empty() && kind(p, "test").is_empty())
        .map(|p| format!("{} (bins {:?})", p.name, kind(p, "bin")))
        .collect();
    assert!(missing.is_empty(), "packages whose binaries `cargo test --no-run` would not build: {missing:?}");
}

/// Fails if any workspace crate depends on one its row does not allow (planted:
/// add `lockmesh-extproc = { workspace = true }` to extproc/ops/Cargo.toml, or
/// `lockmesh-lock` to client/Cargo.toml), or if a crate has no row (a new crate
/// must be placed in a layer).
#[test]
fn arrows_between_workspace_crates_point_one_way() {
    let layer: BTreeMap<&str, u8> = LAYERS.iter().map(|(n, l, _)| (*n, *l)).collect();
    for (name, l, allowed) in LAYERS {
        for a in *allowed {
            assert!(layer[a] < *l, "LAYERS: {name} (layer {l}) may not depend on {a} (layer {})", layer[a]);
        }
    }
    let mut wrong = Vec::new();
    for (name, deps) in workspace_edges() {
        let Some((_, _, allowed)) = LAYERS.iter().find(|(n, _, _)| *n == name) else {
            wrong.push(format!("{name}: not in LAYERS; give it a layer and its allowed dependencies"));
            continue;
        };
        for d in deps.iter().filter(|d| !allowed.contains(&d.as_str())) {
            wrong.push(format!("{name} -> {d}: not an allowed edge"));
        }
    }
    assert!(wrong.is_empty(), "workspace layering broken:\n  {}", wrong.join("\n  "));
}

/// Fails if the arbiter links the SDK, a CLI or the dev PKI, or a library it
/// links uses clap (planted: add `lockmesh-client` or `clap` to the normal
/// dependencies of extproc/lock/Cargo.toml); or if the operator workflows or
/// lockctl link the arbiter (planted: `lockmesh-extproc` in extproc/ops/Cargo.toml).
#[test]
fn the_arbiter_links_no_sdk_cli_or_test_pki_and_nothing_links_the_arbiter() {
    let arbiter = tree(&["-p", "lockmesh-extproc", "-e", "normal"]);
    for banned in ["lockmesh-client", "lockmesh-devcerts", "lockmesh-lockctl"] {
        assert!(!arbiter.contains(banned), "lockmesh-extproc links {banned}");
    }
    // clap parses the arbiter's own two flags (extproc/src/main.rs) and nothing
    // else: no library under it may bring a command line.
    let clap_users =
        cargo(&["tree", "--locked", "-p", "lockmesh-extproc", "-e", "normal", "-i", "clap", "--prefix", "depth"]);
    let direct: BTreeSet<&str> =
        clap_users.lines().filter_map(|l| l.strip_prefix('1')).filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(direct, BTreeSet::from(["lockmesh-extproc"]), "only the arbiter's main may use clap");
    for tool in ["lockmesh-ops", "lockmesh-lockctl"] {
        assert!(!tree(&["-p", tool, "-e", "normal"]).contains("lockmesh-extproc"), "{tool} links the arbiter");
    }
}

/// Fails if a normal build of the arbiter turns on the release gate's planted
/// faults (planted: `features = ["test-faults"]` on lockmesh-lock in
/// extproc/Cargo.toml's `[dependencies]`), and shows the check can see the
/// feature: the same tree with `--features test-faults` has it.
#[test]
fn the_shipped_arbiter_has_no_planted_faults() {
    let planted = |extra: &[&str]| {
        // Inverted at lockmesh-lock: its enabled features, with who enables them
        // (the root's own `--features` show only in this direction).
        let mut args =
            vec!["tree", "--locked", "-p", "lockmesh-extproc", "-e", "features,normal", "-i", "lockmesh-lock"];
        args.extend_from_slice(extra);
        cargo(&args).contains(r#"lockmesh-lock feature "test-faults""#)
    };
    assert!(!planted(&[]), "a normal build of lockmesh-extproc enables lockmesh-lock's test-faults");
    assert!(planted(&["--features", "test-faults"]), "the check no longer sees the feature it looks for");
}

/// Fails if any crate of the workspace turns on the arbiter's `bench-floor`
/// feature (acquires granted without etcd, `extproc/src/floor.rs`; planted:
/// `features = ["bench-floor"]` on lockmesh-extproc in tests/Cargo.toml), and shows
/// the check can see the feature: the same tree with it turned on has it.
#[test]
fn no_crate_builds_the_arbiter_as_the_bench_floor() {
    let has_floor = |tree: String| tree.contains(r#"lockmesh-extproc feature "bench-floor""#);
    // Every edge into the arbiter from the workspace, test and build edges too
    // (the release gate's test-faults shows here: lockmesh-tests turns it on).
    let workspace =
        cargo(&["tree", "--locked", "--workspace", "-e", "features,normal,dev,build", "-i", "lockmesh-extproc"]);
    assert!(
        workspace.contains(r#"lockmesh-extproc feature "test-faults""#),
        "the tree is not the one expected: {workspace}"
    );
    assert!(!has_floor(workspace), "a crate of the workspace builds lockmesh-extproc with bench-floor");
    let on = cargo(&[
        "tree",
        "--locked",
        "-p",
        "lockmesh-extproc",
        "-e",
        "features,normal",
        "-i",
        "lockmesh-extproc",
        "--features",
        "bench-floor",
    ]);
    assert!(has_floor(on), "the check no longer sees the feature it looks for");
}

/// Fails if the shipped Wasm module's build enables `test-trap` (planted:
/// `default = ["test-trap"]` in wasm-filter/Cargo.toml), or the module file
/// holds the trap's strings (planted: drop the last, plain build of the module
/// from scripts/test, so the test variant stays in its place). The test variant
/// holds them: the byte check can see what it looks for.
#[test]
fn the_shipped_wasm_module_has_no_test_trap() {
    let trap = |extra: &[&str]| {
        let mut args = vec![
            "tree",
            "--locked",
            "-p",
            "lockmesh-wasm-filter",
            "-e",
            "features",
            "--target",
            "wasm32-wasip1",
            "-i",
            "lockmesh-wasm-filter",
        ];
        args.extend_from_slice(extra);
        cargo(&args).contains(r#"lockmesh-wasm-filter feature "test-trap""#)
    };
    assert!(!trap(&[]), "the shipped Wasm filter's build enables test-trap");
    assert!(trap(&["--features", "test-trap"]), "the check no longer sees the feature it looks for");
    // Not `test_trap`: the shipped parser names `test_trap_header` to refuse it.
    // These are the trap's panic (wasm-filter/src/trap.rs) and its startup
    // warning (wasm-filter/src/root.rs), compiled only with the feature.
    let markers: [&[u8]; 2] = [b"lockmesh test trap", b"TEST ONLY test_trap_header"];
    let holds = |path: &Path, m: &[u8]| std::fs::read(path).unwrap().windows(m.len()).any(|w| w == m);
    let shipped = lockmesh_tests::envoy::wasm_module().unwrap();
    let test = lockmesh_tests::envoy::wasm_test_module().unwrap();
    for m in markers {
        let text = String::from_utf8_lossy(m);
        assert!(!holds(&shipped, m), "{} holds {text:?}: the test variant was shipped", shipped.display());
        assert!(holds(&test, m), "{} lacks {text:?}: the byte check cannot see the trap", test.display());
    }
}

/// Fails if a shipped binary links the dev PKI and its operator token minter
/// (planted: move `lockmesh-devcerts` from `[dev-dependencies]` to
/// `[dependencies]` in extproc/ops/Cargo.toml).
#[test]
fn no_shipped_binary_links_the_token_minter() {
    for bin in SHIPPED {
        assert!(!tree(&["-p", bin, "-e", "normal"]).contains("lockmesh-devcerts"), "{bin} links lockmesh-devcerts");
    }
}

/// Source files exempt from the `json!` scan, and why.
const JSON_EXEMPT: &[(&str, &str)] = &[
    // Builds CustomResourceDefinition schemas: Kubernetes API objects, not
    // lockmesh wire bodies.
    ("extproc/registry/src/crd.rs", "Kubernetes CRD schemas"),
];

/// Fails while a service builds a JSON body with `json!` instead of a type
/// (planted: `serde_json::json!({"ok": true})` in any extproc/src file outside
/// its `#[cfg(test)]` module). The sidecar (sidecar/src) is not scanned: it edits
/// arbitrary pod objects of the Kubernetes API, which are not lockmesh wire bodies.
#[test]
fn services_build_no_json_bodies_with_the_json_macro() {
    let root = root();
    let mut files = Vec::new();
    for dir in ["extproc", "fence-proxy/src"] {
        sources(&root.join(dir), &mut files);
    }
    let mut found = BTreeMap::<String, Vec<usize>>::new();
    for f in files {
        let rel = f.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
        let in_src = rel.split('/').any(|c| c == "src");
        let test_file = rel.ends_with("/tests.rs") || rel.split('/').any(|c| c == "tests" || c == "benches");
        if !in_src || test_file || JSON_EXEMPT.iter().any(|(p, _)| *p == rel) {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            // A file's tests sit in its trailing `#[cfg(test)]` module.
            if code.starts_with("#[cfg(test)]") {
                break;
            }
            if !code.starts_with("//") && code.contains("json!(") {
                found.entry(rel.clone()).or_default().push(i + 1);
            }
        }
    }
    let report: Vec<String> = found.iter().map(|(f, lines)| format!("{f}: lines {lines:?}")).collect();
    assert!(report.is_empty(), "json! outside tests (build the body from a type):\n  {}", report.join("\n  "));
}

/// The process-wide statics the lock recipe keeps, each with why it may be one:
/// counters and figures `/metrics` shows once per process, which decide nothing,
/// and the planted-fault hooks of test builds. Configuration and what decisions
/// read (the hand-off policy, the registry's delays, candidates and quotas, the
/// keyspace gate's state) live in the runtime context a store is given
/// (`lockmesh_lock::runtime`), so two arbiters in one process never share them.
const LOCK_STATICS: &[(&str, &str, &str)] = &[
    ("wait.rs", "HANDOFFS", "hand-off counters"),
    ("wait.rs", "BOOKS", "every store's waiters' book, for the gated-waiter figures"),
    ("wait.rs", "FIGURES", "wake-up and pickup histograms"),
    ("vm.rs", "RENEWAL_FAILURES", "keepalive failure counters"),
    ("vm.rs", "JEOPARDY", "VM sessions in jeopardy, a gauge"),
    ("engine/group.rs", "GROUPS", "group commit counters"),
    ("policy_watch.rs", "EVENTS", "policy watch event counter"),
    ("policy_watch.rs", "OPEN", "policy watches open, a gauge"),
    ("cluster.rs", "AUTH_REFUSALS", "auth-store refusal counter"),
    ("steps.rs", "STEPS", "etcd step timings"),
    ("failopen/mod.rs", "STATS", "fail-open counters"),
    ("test_faults.rs", "ACTIVE", "planted faults (test builds)"),
    ("test_faults.rs", "FIRST", "planted faults' first-time memory (test builds)"),
    ("tiers.rs", "IN_TURN", "the planted fault seal_rounds_in_turn (test builds)"),
];

/// Fails when the lock recipe gains a process-wide static that is not a
/// counter (planted: `static DELAYS: RwLock<..>` back in extproc/lock/src/delay.rs,
/// the registry's lock-delays the runtime context holds).
#[test]
fn the_lock_recipe_keeps_its_configuration_in_the_runtime_context() {
    let dir = root().join("extproc/lock/src");
    let mut files = Vec::new();
    sources(&dir, &mut files);
    let mut found = BTreeSet::new();
    for f in files {
        let rel = f.strip_prefix(&dir).unwrap().to_string_lossy().into_owned();
        if rel.ends_with("/tests.rs") {
            continue;
        }
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            let code = line.trim_start();
            if code.starts_with("#[cfg(test)]") {
                break;
            }
            let item = code.strip_prefix("pub ").or_else(|| code.strip_prefix("pub(crate) ")).unwrap_or(code);
            if let Some(rest) = item.strip_prefix("static ") {
                let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                found.insert((rel.clone(), name));
            }
        }
    }
    let allowed: BTreeSet<(String, String)> =
        LOCK_STATICS.iter().map(|(f, n, _)| ((*f).to_owned(), (*n).to_owned())).collect();
    let extra: Vec<_> = found.difference(&allowed).collect();
    let gone: Vec<_> = allowed.difference(&found).collect();
    assert!(
        extra.is_empty(),
        "statics in extproc/lock/src outside LOCK_STATICS (pass them in the runtime context): {extra:?}"
    );
    assert!(gone.is_empty(), "LOCK_STATICS names statics that no longer exist: {gone:?}");
}

/// The most methods `Store` may have (the sum over its `impl Store` blocks in
/// extproc/lock/src): lowered as parts of it become types of their own, never
/// raised. A part split off holds the cluster handle, not the store.
const STORE_METHODS_AT_MOST: usize = 121;

/// The parts split off `Store`, by file and type: none holds a `Store`.
const STORE_PARTS: &[(&str, &str)] = &[
    ("cluster.rs", "Cluster"),
    ("home.rs", "Home"),
    ("epoch.rs", "Epoch"),
    ("policy.rs", "Policies"),
    ("delay.rs", "LockDelay"),
];

/// Fails when `Store` grows (planted: a method added to an `impl Store` block)
/// or a part split off it takes a `Store` back into its fields.
#[test]
fn the_store_only_shrinks_and_its_parts_hold_no_store() {
    let dir = root().join("extproc/lock/src");
    let mut files = Vec::new();
    sources(&dir, &mut files);
    let mut methods = 0;
    for f in &files {
        let mut in_store = false;
        for line in std::fs::read_to_string(f).unwrap().lines() {
            if line.starts_with("impl Store {") {
                in_store = true;
            } else if in_store && line == "}" {
                in_store = false;
            } else if in_store {
                let item = line.strip_prefix("    ").unwrap_or_default();
                // `pub`, `pub(crate)`, `pub(super)`…
                let item = match item.strip_prefix("pub") {
                    Some(rest) if rest.starts_with('(') => rest.split_once(") ").map_or(rest, |(_, r)| r),
                    Some(rest) => rest.trim_start(),
                    None => item,
                };
                let item = item.strip_prefix("async ").unwrap_or(item);
                if item.starts_with("fn ") {
                    methods += 1;
                }
            }
        }
    }
    assert!(
        methods <= STORE_METHODS_AT_MOST,
        "Store has {methods} methods, more than {STORE_METHODS_AT_MOST}: give the new one to the part it belongs to"
    );
    for (file, ty) in STORE_PARTS {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let start = text.find(&format!("pub struct {ty} {{")).unwrap_or_else(|| panic!("{file}: no struct {ty}"));
        let body = &text[start..start + text[start..].find("\n}").unwrap()];
        assert!(!body.contains("Store"), "{file}: {ty} holds a Store: {body}");
    }
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}
