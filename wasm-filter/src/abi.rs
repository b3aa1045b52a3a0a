//! The proxy-wasm host calls whose SDK wrappers (proxy-wasm 0.2.5) panic on statuses
//! Envoy does return, called directly so every status comes back as an `Err`
//! (docs/DECISIONS.md F-7). A panic here would trap the VM and strand every paused request
//! on the worker, so these calls (the first three made on other contexts' behalf
//! during hand-offs) must not be able to panic:
//!
//! - `proxy_send_local_response`: Envoy answers `BadArgument` to a second local reply
//!   on one stream;
//! - `proxy_replace_header_map_value`: `BadArgument` once the request headers are
//!   gone (the stream was resumed or ended);
//! - `proxy_continue_stream`: mapped for completeness;
//! - `proxy_set_property`: `NotFound` without a stream, `BadArgument` when the
//!   value is refused; the unlocked mark ([`set_unlocked_mark`]) must fail closed,
//!   not trap.
//!
//! The statuses are read as plain integers: a value outside the SDK's `Status` enum
//! would be undefined behaviour if read as that enum.
#![allow(unsafe_code)]

use proxy_wasm::types::{MapType, StreamType};

#[allow(clashing_extern_declarations)]
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_set_property(path_data: *const u8, path_size: usize, value_data: *const u8, value_size: usize) -> u32;
}

/// The value ext_proc's matcher skips on.
const UNLOCKED_MARK_VALUE: &[u8] = b"1";

/// Marks the effective context's request as let through unlocked: the one thing
/// that lets the sidecar skip ext_proc (docs/TRANSPARENT.md "Unlocked routes").
pub(crate) fn set_unlocked_mark() -> Result<(), HostStatus> {
    // Envoy keeps a Wasm property `name` in the stream's filter state under
    // `wasm.<name>`, where the sidecar's ext_proc matcher reads it
    // (`FilterStateInput`); filter state is per stream and no client can write it.
    let name = lockmesh_core::headers::UNLOCKED_PROPERTY;
    // SAFETY: as above (a one-element property path is the name's bytes).
    status(unsafe {
        proxy_set_property(name.as_ptr(), name.len(), UNLOCKED_MARK_VALUE.as_ptr(), UNLOCKED_MARK_VALUE.len())
    })
}

/// A host status other than `Ok` (proxy-wasm ABI numbering: 1 NotFound, 2 BadArgument…).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostStatus(pub u32);

fn status(code: u32) -> Result<(), HostStatus> {
    if code == 0 {
        Ok(())
    } else {
        Err(HostStatus(code))
    }
}

/// The ABI's header map encoding: count, then `(name len, value len)` pairs, then
/// each name and value NUL-terminated.
pub fn serialize_map(map: &[(&str, &str)]) -> Vec<u8> {
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    let mut out = Vec::new();
    out.extend_from_slice(&len(map.len()));
    for (name, value) in map {
        out.extend_from_slice(&len(name.len()));
        out.extend_from_slice(&len(value.len()));
    }
    for (name, value) in map {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out
}

/// Answers the effective context's request locally (performed by Envoy after the
/// current callback returns).
pub(crate) fn send_http_response(status_code: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostStatus> {
    let hdrs = serialize_map(headers);
    // SAFETY: every pointer/length pair names a live buffer for the duration of the
    // call; the host copies what it needs.
    let code = unsafe {
        proxy_send_local_response(
            status_code,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            hdrs.as_ptr(),
            hdrs.len(),
            -1,
        )
    };
    status(code)
}

/// Sets (replaces) a request header of the effective context.
pub(crate) fn set_request_header(name: &str, value: &str) -> Result<(), HostStatus> {
    // SAFETY: as above.
    let code = unsafe {
        proxy_replace_header_map_value(
            MapType::HttpRequestHeaders as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    };
    status(code)
}

/// Resumes the effective context's paused request (performed after the callback).
pub(crate) fn resume_http_request() -> Result<(), HostStatus> {
    // SAFETY: no pointers.
    status(unsafe { proxy_continue_stream(StreamType::HttpRequest as u32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_encoding_matches_the_abi() {
        assert_eq!(
            serialize_map(&[("a", "bc")]),
            [&1u32.to_le_bytes()[..], &1u32.to_le_bytes(), &2u32.to_le_bytes(), b"a\0bc\0"].concat()
        );
    }
}
