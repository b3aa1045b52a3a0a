//! Every shipped Envoy configuration passes the real `envoy --mode validate`
//! (against the built Wasm module), and none of them can let a lock route fail
//! open: ext_proc never allows failure, never runs in observability mode, the
//! spurious-response guard is pinned on, and every Wasm filter fails closed.

use lockmesh_tests::{envoy::EnvoyProcess, repo_root};

fn shipped() -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(repo_root().join("envoy-config"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no shipped Envoy configs");
    v
}

#[tokio::test]
async fn every_shipped_config_passes_envoy_validate() {
    for path in shipped() {
        let verdict = EnvoyProcess::builder(path.to_str().unwrap()).validate().await.unwrap();
        if let Err(out) = verdict {
            panic!("{} rejected by envoy --mode validate:\n{out}", path.display());
        }
    }
}

#[test]
fn no_shipped_config_can_fail_open() {
    for path in shipped() {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.display();
        let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        let mut procs = Vec::new();
        let mut wasms = Vec::new();
        walk(&doc, &mut procs, &mut wasms);
        for p in &procs {
            assert_ne!(p["failure_mode_allow"].as_bool(), Some(true), "{name}: ext_proc failure_mode_allow");
            assert_ne!(p["observability_mode"].as_bool(), Some(true), "{name}: ext_proc observability_mode");
            assert_ne!(p["disable_immediate_response"].as_bool(), Some(true), "{name}: immediate responses disabled");
        }
        for w in &wasms {
            let policy = w["config"]["failure_policy"].as_str();
            assert_eq!(policy, Some("FAIL_CLOSED"), "{name}: wasm failure_policy");
            assert_ne!(w["config"]["fail_open"].as_bool(), Some(true), "{name}: wasm fail_open");
        }
        if !procs.is_empty() {
            assert!(
                text.contains("envoy.reloadable_features.ext_proc_fail_close_spurious_resp: true"),
                "{name}: the spurious-response guard is not pinned on"
            );
        }
    }
}

fn walk<'a>(v: &'a serde_yaml::Value, procs: &mut Vec<&'a serde_yaml::Value>, wasms: &mut Vec<&'a serde_yaml::Value>) {
    match v {
        serde_yaml::Value::Mapping(m) => {
            match m.get("@type").and_then(|t| t.as_str()) {
                Some("type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor") => {
                    procs.push(v)
                }
                Some("type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm") => wasms.push(v),
                _ => {}
            }
            m.values().for_each(|c| walk(c, procs, wasms));
        }
        serde_yaml::Value::Sequence(s) => s.iter().for_each(|c| walk(c, procs, wasms)),
        _ => {}
    }
}

/// A wait the filter admits must fit inside the ext_proc `max_message_timeout` and
/// the listener's `request_timeout`, or Envoy would cut a legitimate wait short.
#[test]
fn waits_fit_inside_envoys_timeouts() {
    let secs = |v: &serde_yaml::Value| v.as_str().and_then(|s| s.strip_suffix('s')).and_then(|s| s.parse::<f64>().ok());
    for path in shipped() {
        let text = std::fs::read_to_string(&path).unwrap();
        let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        let (mut procs, mut wasms) = (Vec::new(), Vec::new());
        walk(&doc, &mut procs, &mut wasms);
        for w in &wasms {
            let conf: serde_json::Value =
                serde_json::from_str(w["config"]["configuration"]["value"].as_str().unwrap_or("{}")).unwrap();
            let wait_s = conf["max_wait_ms"].as_f64().unwrap_or(30_000.0) / 1000.0;
            for p in &procs {
                let max = secs(&p["max_message_timeout"]).expect("ext_proc max_message_timeout");
                assert!(
                    wait_s + 2.0 <= max,
                    "{}: max wait {wait_s}s + 2s > max_message_timeout {max}s",
                    path.display()
                );
            }
            for rt in text.lines().filter_map(|l| l.trim().strip_prefix("request_timeout:")) {
                let rt: f64 = rt.trim().trim_end_matches('s').parse().unwrap();
                assert!(
                    wait_s + 5.0 <= rt,
                    "{}: max wait {wait_s}s leaves no margin under request_timeout {rt}s",
                    path.display()
                );
            }
        }
    }
}
