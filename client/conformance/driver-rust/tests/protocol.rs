//! The driver's own protocol edges, without a lock tier: every line gets one answer
//! carrying its id, and a bad line is answered with a stable code instead of ending
//! the driver. (The scenarios themselves run in `tests/tests/scenarios/conformance.rs`;
//! this test also makes `cargo test --workspace --no-run` build the driver binary
//! those scenarios start.)

// A test binary: a failed unwrap is a failed check, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use serde_json::Value;

/// Sends `lines`, reads one answer per line (the driver answers concurrently, so in any
/// order), then asks it to exit.
fn run(lines: &[&str], env: &[(&str, &str)]) -> (Vec<Value>, Option<i32>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockmesh-conformance-driver"))
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the driver starts");
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut out = Vec::new();
    for l in lines {
        // The driver may have exited already (a refused planted fault): a closed pipe is fine.
        let _ = writeln!(stdin, "{l}");
    }
    let mut read = |out: &mut Vec<Value>| {
        let mut l = String::new();
        if stdout.read_line(&mut l).unwrap() == 0 {
            return false;
        }
        out.push(serde_json::from_str(&l).expect("every answer is one JSON line"));
        true
    };
    for _ in lines {
        if !read(&mut out) {
            break;
        }
    }
    if writeln!(stdin, r#"{{"id": "bye", "op": "exit"}}"#).is_ok() {
        read(&mut out);
    }
    drop(stdin);
    (out, child.wait().unwrap().code())
}

#[test]
fn bad_lines_get_stable_codes_and_the_driver_goes_on() {
    let (out, code) = run(
        &[
            "not json",
            r#"{"id": 1, "op": "no-such-op"}"#,
            r#"{"id": 2, "op": "release", "hold": "never-acquired"}"#,
            r#"{"id": 3}"#,
        ],
        &[],
    );
    assert_eq!(code, Some(0), "exit ends the driver cleanly: {out:?}");
    let by_id = |id: Value| out.iter().find(|v| v["id"] == id).unwrap_or_else(|| panic!("no answer for {id}: {out:?}"));
    assert_eq!(by_id(Value::Null)["error"], "bad_request");
    assert_eq!(by_id(1.into())["error"], "bad_request");
    assert_eq!(by_id(2.into())["error"], "unknown_name");
    assert_eq!(by_id(3.into())["error"], "bad_request");
    assert_eq!(by_id("bye".into())["ok"], true);
    assert_eq!(out.len(), 5, "one answer per line: {out:?}");
    for v in &out {
        if v["id"] != "bye" {
            assert_eq!(v["ok"], false, "{v}");
        }
    }
}

#[test]
fn an_unknown_planted_fault_is_refused_before_any_line() {
    let (out, code) = run(&[r#"{"id": 1, "op": "open_session"}"#], &[("LOCKMESH_SDK_PLANTED", "no-such-fault")]);
    assert_eq!(code, Some(64));
    assert!(out.is_empty(), "{out:?}");
}
