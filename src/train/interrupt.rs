//! Ctrl-C, SIGTERM and SIGHUP (a closed terminal) during a run. The first signal only sets a flag: the
//! trainer finishes the step it is in, writes a checkpoint and returns (the
//! CLI then prints how to resume and exits with 128 + the signal's number). A
//! second signal exits at once, as an impatient user expects: checkpoints are
//! written atomically, so even that loses no more than the current step.

use std::sync::atomic::{AtomicI32, Ordering};

/// The first signal received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// SIGINT (Ctrl-C).
pub const SIGINT: i32 = 2;
/// SIGTERM (`kill`, a job scheduler's stop).
pub const SIGTERM: i32 = 15;
/// SIGHUP (the terminal the run was started from closed).
pub const SIGHUP: i32 = 1;

/// The signals that stop a run cleanly.
#[cfg(unix)]
const STOPPING: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// The signal that asked the run to stop, if one did.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// A signal's name, for messages.
pub fn name(sig: i32) -> &'static str {
    match sig {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// Routes SIGINT, SIGTERM and SIGHUP to the flag above for the rest of the process
/// (the CLI's `train`). Without it they keep their default action.
#[cfg(unix)]
pub fn install() -> crate::Result<()> {
    extern "C" fn on_signal(sig: libc::c_int) {
        // Only async-signal-safe calls here: an atomic swap, write(2), _exit(2).
        if SIGNAL.swap(sig, Ordering::SeqCst) != 0 {
            unsafe { libc::_exit(128 + sig) };
        }
        let msg = b"\ntinyllm: stopping after this step to write a checkpoint (signal again to quit at once)\n";
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    }
    for sig in STOPPING {
        // SA_RESTART: a file write interrupted by the signal carries on.
        let ok = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut()) == 0
        };
        if !ok {
            return Err(crate::Error::io(
                format!("cannot install the handler of {}", name(sig)),
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

/// Gives SIGINT, SIGTERM and SIGHUP their default action back: once a run has
/// returned (everything saved), a signal ends the process at once.
#[cfg(unix)]
pub fn uninstall() {
    for sig in STOPPING {
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
}

/// Elsewhere signals keep their default action (the run is not saved).
#[cfg(not(unix))]
pub fn install() -> crate::Result<()> {
    Ok(())
}

/// Elsewhere there is no handler to take back.
#[cfg(not(unix))]
pub fn uninstall() {}
