//! Plugin configuration: a JSON object in `PluginConfig.configuration`
//! (a `google.protobuf.StringValue`). Parsing is pure so a host-side test can run it
//! over every configuration embedded in `envoy-config/*.yaml`.

use serde::Deserialize;

/// Upper bound of `max_wait_ms`: an hour, Envoy's own ext_proc timeout ceiling.
pub const MAX_WAIT_CEILING_MS: u64 = 3_600_000;

/// The filter's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Longest `x-lock-wait-ms` accepted; longer asks get `400 bad_request`. Must stay
    /// below the listener's request timeout and the ext_proc message timeout.
    pub max_wait_ms: u64,
    /// TEST ONLY: a request carrying this header traps the VM, so tests can prove a
    /// VM crash fails closed. Never set in a deployed config.
    pub test_trap_header: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    /// Default 30000 ms.
    max_wait_ms: Option<u64>,
    test_trap_header: Option<String>,
}

/// Parses the plugin configuration; every error carries its field path.
pub fn parse(bytes: &[u8]) -> Result<Config, Vec<String>> {
    let raw: RawConfig = if bytes.iter().all(u8::is_ascii_whitespace) {
        RawConfig {
            max_wait_ms: None,
            test_trap_header: None,
        }
    } else {
        serde_json::from_slice(bytes).map_err(|e| vec![format!("configuration: {e}")])?
    };
    let mut errs = Vec::new();
    let max_wait_ms = raw.max_wait_ms.unwrap_or(30_000);
    if max_wait_ms > MAX_WAIT_CEILING_MS {
        errs.push(format!(
            "max_wait_ms: {max_wait_ms} is above the ceiling {MAX_WAIT_CEILING_MS}"
        ));
    }
    if let Some(h) = &raw.test_trap_header {
        if h.is_empty() || !h.bytes().all(|b| b.is_ascii_lowercase() || b == b'-') {
            errs.push("test_trap_header: must be a lowercase header name".into());
        }
    }
    if errs.is_empty() {
        Ok(Config {
            max_wait_ms,
            test_trap_header: raw.test_trap_header,
        })
    } else {
        Err(errs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_errors() {
        assert_eq!(parse(b"").unwrap().max_wait_ms, 30_000);
        assert_eq!(
            parse(br#"{"max_wait_ms": 5000}"#).unwrap().max_wait_ms,
            5000
        );
        assert_eq!(
            parse(br#"{"max_wait_ms": 99999999, "test_trap_header": "X"}"#).unwrap_err(),
            vec![
                "max_wait_ms: 99999999 is above the ceiling 3600000".to_string(),
                "test_trap_header: must be a lowercase header name".to_string()
            ]
        );
        assert!(parse(br#"{"max_wait": 1}"#).unwrap_err()[0].contains("unknown field"));
    }
}
