//! Typed key templates on real processes (issue 41 item 3): a route
//! `/orders/{id:uint}` takes only the one decimal spelling of an order id, so no
//! other spelling of order 7 (`/orders/07`, `/orders/+7`, `/orders/7.json`, ...)
//! can lock a key other than order 7's: each is refused `400 bad_request`, naming
//! the placeholder, and never forwarded.
//!
//! - The shipped inbound sidecar (`envoy-config/inbound-sidecar.yaml`, a real Envoy
//!   and arbiter in front of the recording backend): every variant, with or
//!   without a caller's own `x-lock-key`, is refused by the filter and never
//!   reaches the backend or falls to the catch-all `/` route where the caller
//!   chooses the key; `/orders/7` is locked as `payments/order-7`.
//! - fence-proxy in front of a store, with an `unlisted` guard: every variant is
//!   refused (the grant of the variant's own key, or the guard's) and the store
//!   never sees it; `/orders/7` is written under order 7's grant.
//!
//! Each has a planted twin with the untyped `{id}` the configs shipped before:
//! there the same variants reach the upstream under keys other than order 7's,
//! so the detector is shown to see what the typed templates refuse.

use lockmesh_tests::fence::{ensure_signing_key, FenceProxyProcess, KvStore};
use lockmesh_tests::{Stack, StackBuilder};

/// Spellings of order 7 other than `7` that an HTTP client sends as written (no
/// raw space: clients trim or encode it, and the canon refuses it anyway).
const VARIANTS: &[&str] = &[
    "07",
    "007",
    "00000000000000000007",
    "+7",
    "-7",
    "7.json",
    "7.",
    "7.0",
    "7,",
    "7~",
    "7:",
    "7@",
    "7=",
    "7-",
    "7_",
    "7e0",
    "0x7",
    "%37",
    "%2B7",
    "7%20",
    // u64::MAX + 8: wraps to 7 in a store that parses with overflow.
    "18446744073709551623",
];

/// What the variants got: those forwarded under another key, and the refusals.
#[derive(Debug, Default)]
struct Outcome {
    /// `(path, key the upstream was told or the fence checked)`.
    other_key: Vec<(String, String)>,
    /// `(path, status, error code, body)`.
    refused: Vec<(String, u16, String, String)>,
    /// Forwarded under order 7's own key (`/orders/%37`: Envoy's `normalize_path`
    /// decodes an escaped digit, so the filter sees `/orders/7`).
    same_key: Vec<String>,
}

fn sidecar(name: &str) -> StackBuilder {
    Stack::builder(name).envoy_config("inbound-sidecar")
}

/// Sends every variant (and the trailing-slash twin of the first few) through the
/// sidecar, with `extra` headers, and reads the answers and the backend's log.
async fn through_sidecar(st: &Stack, extra: &[(&str, &str)]) -> Outcome {
    let c = st.client("payments", "worker").unwrap();
    let mut out = Outcome::default();
    let paths: Vec<String> = VARIANTS
        .iter()
        .map(|v| format!("/orders/{v}"))
        .chain(["07", "+7", "7.json"].iter().map(|v| format!("/orders/{v}/")))
        .collect();
    for p in &paths {
        st.backend().clear();
        let r = c.post(p, extra).await.unwrap();
        let seen = st.backend().requests();
        match r.code() {
            200 => {
                assert_eq!(seen.len(), 1, "{p}: {seen:?}");
                let key = seen[0].header("x-lock-key").unwrap_or("(none)").to_owned();
                if key == "payments/order-7" {
                    assert_eq!(seen[0].path, "/orders/7", "{p}");
                    out.same_key.push(p.clone());
                } else {
                    out.other_key.push((p.clone(), key));
                }
            }
            code => {
                assert!(seen.is_empty(), "{p}: answered {code} but reached the backend: {seen:?}");
                let err = r.header("x-lockmesh-error").unwrap_or("").to_owned();
                out.refused.push((p.clone(), code, err, r.body.clone()));
            }
        }
    }
    out
}

#[tokio::test]
async fn the_inbound_sidecar_refuses_every_other_spelling_of_an_order_id() {
    let st = sidecar("typed-sidecar").start().await.unwrap();
    let c = st.client("payments", "worker").unwrap();
    // The one spelling is locked as order 7 and forwarded.
    let r = c.post("/orders/7", &[]).await.unwrap();
    assert_eq!(r.code(), 200, "{}", r.body);
    let seen = st.backend().requests();
    assert_eq!(seen.last().and_then(|s| s.header("x-lock-key")), Some("payments/order-7"));

    // Every other spelling: refused by the filter, without or with the caller's own
    // key (which the catch-all `/` route would otherwise lock).
    for extra in [&[][..], &[("x-lock-key", "payments/anything")][..]] {
        let out = through_sidecar(&st, extra).await;
        assert!(out.other_key.is_empty(), "{extra:?}: locked other keys: {:#?}", out.other_key);
        // `/orders/%37` reaches the filter as `/orders/7` (Envoy decodes it): order
        // 7's key, or refused as a differing key when the caller sends another.
        let same: &[&str] = if extra.is_empty() { &["/orders/%37"] } else { &[] };
        assert_eq!(out.same_key, same, "{extra:?}");
        assert_eq!(out.refused.len(), VARIANTS.len() + 3 - same.len(), "{extra:?}: {:#?}", out.refused);
        for (p, code, err, body) in &out.refused {
            assert_eq!((*code, err.as_str()), (400, "bad_request"), "{p}: {body}");
            // The canon refuses an escaped `+` first; the rest name `{id}`.
            let other = (p == "/orders/%2B7" && body.contains("escapes a character that has a plain spelling"))
                || (p == "/orders/%37" && body.contains("the one sent differs"));
            assert!(other || body.contains("path segment {id} must be a uint"), "{p}: {body}");
            let seg = p.trim_start_matches("/orders/").trim_end_matches('/');
            assert!(!body.contains(&format!("{seg}\"")) && !body.contains(&format!(" {seg} ")), "{p}: {body}");
        }
    }
}

/// Planted: the shipped sidecar with the untyped `{id}` it shipped before. The
/// same variants reach the application locked under keys other than order 7's.
#[tokio::test]
async fn planted_an_untyped_id_lets_other_spellings_lock_other_keys() {
    let st = sidecar("typed-planted").envoy_replace("{id:uint}", "{id}").start().await.unwrap();
    let out = through_sidecar(&st, &[]).await;
    let refused: Vec<&str> = out.refused.iter().map(|(p, ..)| p.as_str()).collect();
    println!("untyped {{id}}: {} of {} variants locked another key", out.other_key.len(), VARIANTS.len() + 3);
    // Only escapes are refused (by the canon, or as no valid key); `%37` is
    // decoded by Envoy to `/orders/7`.
    assert_eq!(refused, ["/orders/%2B7", "/orders/7%20"], "{:#?}", out.refused);
    assert_eq!(out.same_key, ["/orders/%37"]);
    assert_eq!(out.other_key.len(), VARIANTS.len() + 3 - 3, "{:#?}", out.other_key);
    assert!(out.other_key.contains(&("/orders/07".into(), "payments/order-07".into())), "{:#?}", out.other_key);
}

// === fence-proxy ===

const ROUTES: &str = "routes:\n  - name: orders\n    path: /orders/{id:uint}\n    reads: [GET]\n    resource: \"orders/{id}\"\n    lock_key: \"payments/order-{id}\"\nunlisted: { resource: \"store\", lock_key: \"payments/store\" }";

struct Fence {
    proc: FenceProxyProcess,
    store: KvStore,
    key: ed25519_dalek::SigningKey,
    _dir: tempfile::TempDir,
}

async fn fence(routes: &str) -> Fence {
    use ed25519_dalek::pkcs8::DecodePrivateKey as _;
    let store = KvStore::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let k = ensure_signing_key(dir.path()).unwrap();
    let proc =
        FenceProxyProcess::builder(store.port()).trust(&k.kid, &k.pub_file).routes(routes).start().await.unwrap();
    let key = ed25519_dalek::SigningKey::from_pkcs8_pem(&std::fs::read_to_string(&k.key_file).unwrap()).unwrap();
    Fence { proc, store, key, _dir: dir }
}

impl Fence {
    /// `PUT path` with a genuine grant of `lock_key` at `token`: (status, code, body).
    async fn put(&self, path: &str, lock_key: &str, token: u64) -> (u16, String, String) {
        use lockmesh_core::{proof, ClassName, FencingToken, LockKey};
        let claims = proof::GrantClaims::new(
            &LockKey::parse(lock_key.as_bytes()).unwrap(),
            FencingToken::from_packed(token).unwrap(),
            ClassName::parse("payments").unwrap(),
        );
        let p = proof::sign(&self.key, &proof::KeyId::parse("dev1").unwrap(), &claims);
        let r = reqwest::Client::new()
            .put(format!("{}{path}", self.proc.url()))
            .header("x-lock-proof", p)
            .header("x-lock-token", token.to_string())
            .body("v")
            .send()
            .await
            .unwrap();
        let code = r.headers().get("x-lockmesh-error").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        (r.status().as_u16(), code, r.text().await.unwrap())
    }

    /// Writes every variant with its own key's grant and with the guard's; the
    /// writes the store received under a key other than order 7's.
    async fn variants(&self) -> Outcome {
        let mut out = Outcome::default();
        let mut token = (1u64 << 48) + 100;
        for v in VARIANTS {
            let path = format!("/orders/{v}");
            for lock_key in [format!("payments/order-{v}"), "payments/store".to_owned()] {
                if lockmesh_core::LockKey::parse(lock_key.as_bytes()).is_err() {
                    continue;
                }
                token += 1;
                let before = self.store.requests().len();
                let (status, code, body) = self.put(&path, &lock_key, token).await;
                let reached = self.store.requests().len() > before;
                if status == 200 {
                    assert!(reached, "{path}: 200 without the store");
                    out.other_key.push((path.clone(), lock_key));
                } else {
                    assert!(!reached, "{path}: {status} but the store saw it");
                    out.refused.push((path.clone(), status, code, body));
                }
            }
        }
        out
    }
}

#[tokio::test]
async fn fence_proxy_refuses_every_other_spelling_of_an_order_id() {
    let f = fence(ROUTES).await;
    let (status, _, body) = f.put("/orders/7", "payments/order-7", (1 << 48) + 1).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(f.store.get("/orders/7").as_deref(), Some("v"));
    let out = f.variants().await;
    assert!(out.other_key.is_empty(), "written under other keys: {:#?}", out.other_key);
    assert!(out.refused.len() >= VARIANTS.len(), "{:#?}", out.refused);
    for (p, status, code, body) in &out.refused {
        assert_eq!((*status, code.as_str()), (400, "bad_request"), "{p}: {body}");
        let canon = p.contains("%37") || p.contains("%2B");
        assert!(canon || body.contains("path segment {id} must be a uint"), "{p}: {body}");
    }
    assert_eq!(f.store.requests().len(), 1, "only /orders/7 reached the store");
}

/// Planted: the untyped `{id}`. Each variant is a write of another resource under
/// its own key, which a store that parses numbers reads as order 7.
#[tokio::test]
async fn planted_fence_proxy_with_an_untyped_id_writes_other_spellings_under_other_keys() {
    let f = fence(&ROUTES.replace("{id:uint}", "{id}")).await;
    let out = f.variants().await;
    println!("untyped {{id}} at the fence: {} writes under another key", out.other_key.len());
    let written: Vec<&str> = out.other_key.iter().map(|(p, _)| p.as_str()).collect();
    assert!(written.contains(&"/orders/07") && written.contains(&"/orders/+7"), "{written:?}");
    assert_eq!(out.other_key.len(), VARIANTS.len() - 3, "{:#?}\n{:#?}", out.other_key, out.refused);
}
