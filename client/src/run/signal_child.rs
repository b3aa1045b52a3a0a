//! Sending a signal to the child: the one place this crate uses `unsafe`, because
//! tokio's `Child` can only send SIGKILL and `lockctl run` must send SIGTERM first.
#![allow(unsafe_code)]

use tokio::process::Child;

/// Sends `sig` to `child` if it has not been reaped. Failures (it exited
/// meanwhile) are ignored: the caller is waiting for its status anyway.
pub(crate) fn send(child: &Child, sig: libc::c_int) {
    // `id()` is None once the child has been reaped, so the pid cannot have been
    // reused by another process.
    let Some(pid) = child.id().and_then(|p| libc::pid_t::try_from(p).ok()) else {
        return;
    };
    // SAFETY: kill(2) takes two integers and touches no memory of this process.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "signal to the command not delivered");
    }
}
