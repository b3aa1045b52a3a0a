//! Issue 2, minimal classes: the registry decides a key's class from the key;
//! `x-lock-class` may only confirm it, and a session carries holds of its own
//! class's TTL only.

use lockmesh_tests::Stack;

const ACQ: &str = "/v1/locks/acquire";

#[tokio::test]
async fn the_registry_decides_the_class_and_its_ttl() {
    let st = Stack::builder("classes-min").envoy_config("lock-tier").start().await.unwrap();
    let a = st.client("payments", "a").unwrap();
    // The class comes from the key (longest prefix), with its TTL.
    let r = a.post(ACQ, &[("x-lock-key", "short/job")]).await.unwrap();
    assert_eq!(
        (r.code(), r.json["class"].as_str(), r.json["ttl_s"].as_u64()),
        (200, Some("short"), Some(3)),
        "{}",
        r.body
    );
    let r = a.post(ACQ, &[("x-lock-key", "payments/p")]).await.unwrap();
    assert_eq!((r.json["class"].as_str(), r.json["ttl_s"].as_u64()), (Some("default"), Some(15)), "{}", r.body);
    // A caller cannot choose another class.
    let r = a.post(ACQ, &[("x-lock-key", "payments/q"), ("x-lock-class", "short")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (400, Some("class_mismatch")), "{}", r.body);
    let r = a.post(ACQ, &[("x-lock-key", "payments/q"), ("x-lock-class", "default")]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    // A session of class `short` (3 s) cannot carry a hold of class `default` (15 s).
    let s = a.post("/v1/sessions", &[("x-lock-class", "short")]).await.unwrap();
    let sid = s.json["session"].as_str().unwrap().to_owned();
    let r = a.post(ACQ, &[("x-lock-key", "payments/r"), ("x-lock-session", &sid)]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (400, Some("session_class_mismatch")), "{}", r.body);
    let held = a.get("/v1/locks", &[("x-lock-key", "payments/r")]).await.unwrap();
    assert_eq!(held.json["holders"].as_array().map(Vec::len), Some(0), "{}", held.body);
    // An unknown class is refused when opening a session.
    let r = a.post("/v1/sessions", &[("x-lock-class", "nope")]).await.unwrap();
    assert_eq!((r.code(), r.json["code"].as_str()), (400, Some("bad_request")), "{}", r.body);
}
