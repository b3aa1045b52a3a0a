//! Signals and the child: the one place this crate uses `unsafe`, because tokio's
//! `Child` can only send SIGKILL (and `lockctl run` must send SIGTERM first), and
//! tying the child's life to `lockctl`'s needs `prctl` between fork and exec.
#![allow(unsafe_code)]

use tokio::process::{Child, Command};

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

/// The child gets SIGKILL if `lockctl` dies (even by SIGKILL): its lock ends with
/// `lockctl`'s session, and nobody would be left to kill a child that ignored a
/// SIGTERM before that lock expired.
pub(crate) fn term_with_parent(cmd: &mut Command) {
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure runs between fork and exec and only calls the
    // async-signal-safe prctl(2) and getppid(2).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl: then we were reparented.
            if libc::getppid() != parent {
                return Err(std::io::Error::other("lockctl exited before the command started"));
            }
            Ok(())
        });
    }
}
