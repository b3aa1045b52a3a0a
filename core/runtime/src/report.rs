//! What a binary prints when its configuration is refused.

use std::{io::Write, process::ExitCode};

/// The exit code of an invalid configuration or command line (sysexits.h
/// `EX_USAGE`); runtime failures exit 1.
pub const EX_USAGE: u8 = 64;

/// Prints every error of `file` to stderr and returns exit code 64 ([`EX_USAGE`]),
/// for startup and `--check-config` alike.
///
/// The text, kept from what the binaries printed before:
///
/// ```text
/// invalid configuration (2 errors):
///   fence.yaml: listen: "8080" is not host:port: invalid socket address syntax
///   fence.yaml: routes[0].path: "items/{id}" must start with '/'
/// lockmesh-fence-proxy: fence.yaml refused, exit 64
/// ```
///
/// Each error is printed as given, indented by two spaces (each should carry the
/// file and field path already, STYLE §5); the last line names `binary` and `file`,
/// so the report says which file was refused even when an error does not.
pub fn report_config_errors(binary: &str, file: &str, errors: &[String]) -> ExitCode {
    let mut stderr = std::io::stderr().lock();
    // Nothing to do when stderr is gone: the exit code still says it.
    let _ = stderr.write_all(render(binary, file, errors).as_bytes());
    ExitCode::from(EX_USAGE)
}

fn render(binary: &str, file: &str, errors: &[String]) -> String {
    let mut s = format!("invalid configuration ({} errors):\n", errors.len());
    for e in errors {
        s.push_str("  ");
        s.push_str(e);
        s.push('\n');
    }
    s.push_str(&format!("{binary}: {file} refused, exit {EX_USAGE}\n"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_then_the_binary_and_file() {
        let errs = ["f.yaml: a: bad".to_owned(), "LOCKMESH_X (overrides f.yaml: b): empty".to_owned()];
        assert_eq!(
            render("lockmesh-x", "f.yaml", &errs),
            "invalid configuration (2 errors):\n  f.yaml: a: bad\n  LOCKMESH_X (overrides f.yaml: b): empty\nlockmesh-x: f.yaml refused, exit 64\n"
        );
    }

    #[test]
    fn it_exits_64() {
        assert_eq!(report_config_errors("lockmesh-x", "f.yaml", &["f.yaml: a: bad".into()]), ExitCode::from(64));
    }
}
