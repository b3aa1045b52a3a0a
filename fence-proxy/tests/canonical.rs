//! fence-proxy decides on the canonical path (issue #17): real processes, the
//! `lockmesh-fence-proxy` binary in front of a Python store that percent-decodes,
//! merges slashes and resolves dot segments before it looks a path up
//! (`tests/store/normalising_store.py`), with requests written byte for byte on a
//! TCP socket so no client library normalises them first.
//!
//! The two reproductions of the issue: a stale token writing `PUT /items/%38` under
//! a lock key coarser than the resource (it had a mark of its own, and the store
//! applied it to `/items/8`), and the `unlisted` guard's holder writing
//! `PUT //items/8` without the item's lock. Both are refused now, with every other
//! non-canonical spelling, and the store never sees them. Positive controls in the
//! same runs: the store really normalises (a direct `/items/%38` lands on
//! `/items/8`), and canonical reads and writes get their normal answers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use ed25519_dalek::{
    pkcs8::{spki::der::pem::LineEnding, EncodePublicKey as _},
    SigningKey,
};
use lockmesh_core::{
    proof::{self, GrantClaims, KeyId},
    ClassName, FencingToken, LockKey,
};

/// Kills the child on drop, so a failed assertion leaves no process behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Setup {
    fence: SocketAddr,
    store: SocketAddr,
    key: SigningKey,
    _procs: (Proc, Proc),
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts the store and a fence over it with `routes` (YAML, `routes:` and/or
/// `unlisted:`), and waits until the fence answers `/healthz`.
fn start(routes: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/store/normalising_store.py");
    let mut store = Command::new("python3").arg(script).stdout(Stdio::piped()).spawn().expect("python3");
    let mut line = String::new();
    BufReader::new(store.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let store_addr: SocketAddr = format!("127.0.0.1:{}", line.trim()).parse().unwrap();
    let store = Proc(store);

    let key = SigningKey::from_bytes(&[5; 32]);
    let pem = key.verifying_key().to_public_key_pem(LineEnding::LF).unwrap();
    std::fs::write(dir.path().join("k1.pub.pem"), pem).unwrap();
    let (listen, admin) = (free_port(), free_port());
    let config = format!(
        "listen: \"127.0.0.1:{listen}\"\nadmin_listen: \"127.0.0.1:{admin}\"\nupstream: \"http://{store_addr}\"\n\
         marks_dir: marks\ntrusted_keys:\n  - {{ key_id: k1, public_key_file: k1.pub.pem }}\n{routes}\n"
    );
    let file = dir.path().join("fence.yaml");
    std::fs::write(&file, config).unwrap();
    let fence = Proc(
        Command::new(env!("CARGO_BIN_EXE_lockmesh-fence-proxy"))
            .arg("--config")
            .arg(&file)
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    let admin_addr: SocketAddr = format!("127.0.0.1:{admin}").parse().unwrap();
    // Up to 20 s (400 tries, 50 ms apart).
    let healthy = (0..400).any(|_| {
        let up = send(admin_addr, "GET /healthz HTTP/1.1\r\nhost: f\r\n\r\n").is_some_and(|r| r.status == 200);
        if !up {
            std::thread::sleep(Duration::from_millis(50));
        }
        up
    });
    assert!(healthy, "fence-proxy did not become healthy");
    Setup {
        fence: format!("127.0.0.1:{listen}").parse().unwrap(),
        store: store_addr,
        key,
        _procs: (fence, store),
        _dir: dir,
    }
}

struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// Writes `head` (request line and headers, ending in an empty line) as is, with
/// `connection: close` added, and reads the whole answer. `None` when the
/// connection fails.
fn send(addr: SocketAddr, head: &str) -> Option<Answer> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let head = head.strip_suffix("\r\n").unwrap_or(head);
    s.write_all(format!("{head}connection: close\r\n\r\n").as_bytes()).ok()?;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some(Answer { status, head: head.to_ascii_lowercase(), body: body.to_owned() })
}

impl Setup {
    fn proof(&self, key: &str, token: u64) -> String {
        let claims = GrantClaims::new(
            &LockKey::parse(key.as_bytes()).unwrap(),
            FencingToken::from_packed(token).unwrap(),
            ClassName::parse("payments").unwrap(),
        );
        proof::sign(&self.key, &KeyId::parse("k1").unwrap(), &claims)
    }

    /// `method target` with a grant of `key` at `token` and an empty body.
    fn write(&self, method: &str, target: &str, key: &str, token: u64) -> Answer {
        let proof = self.proof(key, token);
        let head = format!(
            "{method} {target} HTTP/1.1\r\nhost: fence\r\nx-lock-proof: {proof}\r\nx-lock-token: {token}\r\ncontent-length: 0\r\n\r\n"
        );
        send(self.fence, &head).expect("fence answered")
    }

    /// What the store applied: (normalised path, token) per write, in order.
    fn writes(&self) -> Vec<(String, String)> {
        let a = send(self.store, "GET /_writes HTTP/1.1\r\nhost: store\r\n\r\n").unwrap();
        a.body
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["path"].as_str().unwrap().to_owned(), v["token"].as_str().unwrap().to_owned())
            })
            .collect()
    }
}

/// Asserts a `400 bad_request` from fence-proxy's canonical check.
fn assert_not_canonical(a: &Answer, what: &str) {
    assert_eq!(a.status, 400, "{what}: {}", a.body);
    assert!(a.head.contains("x-lockmesh-error: bad_request"), "{what}: {}", a.head);
    let body: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(body["code"], "bad_request", "{what}");
    let m = body["message"].as_str().unwrap();
    assert!(m.starts_with("the request target is not canonical: "), "{what}: {m}");
}

/// Every spelling that a normalising store reads as `/items/8` (or another item)
/// but that is not the canonical `/items/8`.
const ITEM_8_SPELLINGS: &[&str] = &[
    "/items/%38",
    "//items/8",
    "/items//8",
    "/%69tems/8",
    "/items/./8",
    "/items/../items/8",
    "/x/../items/8",
    "/items/%2E/8",
    "/items/%2e%2e/items/8",
    "/items%2F8",
    "/items%2f8",
    "/items/8%00",
    "/items/%2538",
    "/items/8;v=1",
];

#[test]
fn a_stale_token_cannot_write_another_spelling_under_a_coarse_key() {
    // One lock guards every item; each item has its own mark.
    let s = start(
        "routes:\n  - name: items\n    path: /items/{id}\n    reads: [GET]\n    resource: \"items/{id}\"\n    lock_key: \"payments/items\"",
    );
    // Positive control: the store normalises, so %38 is item 8 to it.
    let direct = send(s.store, "PUT /items/%38 HTTP/1.1\r\nhost: store\r\ncontent-length: 0\r\n\r\n").unwrap();
    assert_eq!(direct.status, 200);
    assert_eq!(s.writes(), [("/items/8".to_owned(), "-".to_owned())]);

    // The current holder writes item 8 at token 200; the old grant (100) is stale.
    assert_eq!(s.write("PUT", "/items/8", "payments/items", 200).status, 200);
    assert_eq!(s.write("PUT", "/items/8", "payments/items", 100).status, 409);
    // The reproduction: the stale grant under another spelling of item 8.
    let a = s.write("PUT", "/items/%38", "payments/items", 100);
    assert_not_canonical(&a, "/items/%38");
    assert!(a.body.contains("escapes a character that has a plain spelling"), "{}", a.body);
    for target in ITEM_8_SPELLINGS {
        let a = s.write("PUT", target, "payments/items", 100);
        assert_not_canonical(&a, target);
    }
    // Reads are classified on the canonical path too: nothing odd is forwarded.
    let a = send(s.fence, "GET /items/%38 HTTP/1.1\r\nhost: fence\r\n\r\n").unwrap();
    assert_not_canonical(&a, "GET /items/%38");
    assert_eq!(send(s.fence, "GET /items/8 HTTP/1.1\r\nhost: fence\r\n\r\n").unwrap().status, 200);
    // A canonical escape that has no plain spelling is its own resource.
    assert_eq!(s.write("PUT", "/items/a%20b", "payments/items", 100).status, 200);
    assert_eq!(
        s.writes(),
        [
            ("/items/8".to_owned(), "-".to_owned()),
            ("/items/8".to_owned(), "200".to_owned()),
            ("/items/a b".to_owned(), "100".to_owned())
        ],
        "only the canonical writes reached the store"
    );
}

#[test]
fn the_unlisted_guard_cannot_reach_a_listed_resource() {
    let s = start(
        "routes:\n  - name: items\n    path: /items/{id}\n    resource: \"items/{id}\"\n    lock_key: \"payments/items/{id}\"\n\
         unlisted: { resource: \"store\", lock_key: \"payments/store\" }",
    );
    // The guard's holder writes unlisted paths (positive control) ...
    assert_eq!(s.write("PUT", "/other", "payments/store", 10).status, 200);
    // ... and the item's holder writes the item.
    assert_eq!(s.write("PUT", "/items/8", "payments/items/8", 20).status, 200);
    // The reproduction: the guard's grant on a spelling of /items/8.
    let a = s.write("PUT", "//items/8", "payments/store", 11);
    assert_not_canonical(&a, "//items/8");
    assert!(a.body.contains("empty segment"), "{}", a.body);
    for (i, target) in ITEM_8_SPELLINGS.iter().enumerate() {
        let a = s.write("PUT", target, "payments/store", 12 + i as u64);
        assert_not_canonical(&a, target);
    }
    assert_eq!(
        s.writes(),
        [("/other".to_owned(), "10".to_owned()), ("/items/8".to_owned(), "20".to_owned())],
        "the guard's grant never reached an item"
    );
}

#[test]
fn absolute_form_and_asterisk_targets_are_refused() {
    let s = start(
        "routes:\n  - name: items\n    path: /items/{id}\n    resource: \"items/{id}\"\n    lock_key: \"payments/items/{id}\"\n\
         unlisted: { resource: \"store\", lock_key: \"payments/store\" }",
    );
    let store = s.store;
    // hyper hands these to fence-proxy with a scheme and authority, not as an
    // origin-form path; they are refused, whatever the path inside.
    for target in [
        "http://fence/items/8".to_owned(),
        format!("http://{store}/items/8"),
        "http://fence//items/8".to_owned(),
        "HTTP://fence/other".to_owned(),
    ] {
        let a = s.write("PUT", &target, "payments/store", 5);
        assert_not_canonical(&a, &target);
        assert!(a.body.contains("origin form"), "{}", a.body);
    }
    let a = send(s.fence, "OPTIONS * HTTP/1.1\r\nhost: fence\r\n\r\n").unwrap();
    assert_not_canonical(&a, "OPTIONS *");
    assert!(s.writes().is_empty());
}

/// `curl --http2-prior-knowledge --path-as-is` (h2c: fence-proxy's server also speaks
/// HTTP/2 without TLS): the status and the `x-lockmesh-error` value.
fn h2_write(s: &Setup, target: &str, key: &str, token: u64) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "--http2-prior-knowledge", "--path-as-is", "-X", "PUT"])
        .args(["-w", "%{http_code} %{http_version} %header{x-lockmesh-error}"])
        .args(["-H", &format!("x-lock-proof: {}", s.proof(key, token)), "-H", &format!("x-lock-token: {token}")])
        .arg(format!("http://{}{target}", s.fence))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut it = text.split(' ');
    let status = it.next().and_then(|c| c.parse().ok()).unwrap_or(0);
    assert_eq!(it.next(), Some("2"), "answered over HTTP/2: {text}");
    (status, it.next().unwrap_or_default().to_owned())
}

#[test]
fn over_http2_the_path_is_checked_the_same() {
    let s = start(
        "routes:\n  - name: items\n    path: /items/{id}\n    resource: \"items/{id}\"\n    lock_key: \"payments/items\"\n\
         unlisted: { resource: \"store\", lock_key: \"payments/store\" }",
    );
    assert_eq!(h2_write(&s, "/items/8", "payments/items", 50), (200, String::new()));
    for target in ITEM_8_SPELLINGS {
        assert_eq!(h2_write(&s, target, "payments/items", 40), (400, "bad_request".to_owned()), "{target}");
        assert_eq!(h2_write(&s, target, "payments/store", 40), (400, "bad_request".to_owned()), "{target}");
    }
    assert_eq!(s.writes(), [("/items/8".to_owned(), "50".to_owned())]);
}
