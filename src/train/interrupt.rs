//! Ctrl-C, SIGTERM and SIGHUP (a closed terminal) during a run. The first signal only sets a flag: the
//! trainer finishes the step it is in, writes a checkpoint and returns (the
//! CLI then prints how to resume and exits with 128 + the signal's number). A
//! second signal exits at once, as an impatient user expects: checkpoints are
//! written atomically, so even that loses no more than the current step.
//!
//! The handlers are `signal-hook`'s, on Unix and Windows alike (Windows
//! knows SIGINT, Ctrl-C in a console, and SIGTERM; it has no SIGHUP): each
//! signal runs a few actions in the order they were registered, all
//! async-signal-safe (atomic loads and stores, `_exit`, one byte written to a
//! socket), and a thread of ours prints the notice of the first signal.

#[cfg(any(unix, windows))]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The first signal received (0: none).
static SIGNAL: AtomicUsize = AtomicUsize::new(0);
/// Whether a stopping signal has arrived: the next one exits at once.
#[cfg(any(unix, windows))]
static STOPPING_NOW: AtomicBool = AtomicBool::new(false);
/// Whether the signals have their default action back ([`uninstall`]).
#[cfg(any(unix, windows))]
static DEFAULT_ACTION: AtomicBool = AtomicBool::new(false);

/// SIGINT (Ctrl-C).
pub const SIGINT: i32 = 2;
/// SIGTERM (`kill`, a job scheduler's stop).
pub const SIGTERM: i32 = 15;
/// SIGHUP (the terminal the run was started from closed).
pub const SIGHUP: i32 = 1;

/// The signals that stop a run cleanly.
#[cfg(unix)]
const STOPPING: &[i32] = &[
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
];
#[cfg(windows)]
const STOPPING: &[i32] = &[signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM];

/// The notice the first signal prints.
#[cfg(any(unix, windows))]
const NOTICE: &str =
    "\ntinyllm: stopping after this step to write a checkpoint (signal again to quit at once)\n";

/// The signal that asked the run to stop, if one did.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s as i32),
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
/// (the CLI's `train`), until [`uninstall`]. Without it they keep their default action.
#[cfg(any(unix, windows))]
pub fn install() -> crate::Result<()> {
    // The handlers are registered once; `uninstall` and a later `install`
    // only switch them off and on.
    static REGISTERED: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut registered = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    if !*registered {
        register().map_err(|(sig, e)| {
            crate::Error::io(format!("cannot install the handler of {}", name(sig)), e)
        })?;
        *registered = true;
    }
    DEFAULT_ACTION.store(false, Ordering::SeqCst);
    Ok(())
}

/// Each stopping signal's actions, in the order they run, and the thread
/// that prints the notice.
#[cfg(any(unix, windows))]
fn register() -> Result<(), (i32, std::io::Error)> {
    use signal_hook::flag;
    let notice = Notice::new().map_err(|e| (STOPPING[0], e))?;
    for &sig in STOPPING {
        let registered = (|| {
            // after `uninstall`: the default action (the process ends)
            flag::register_conditional_default(sig, &DEFAULT_ACTION)?;
            // a second signal: exit at once, with 128 + its number
            flag::register_conditional_shutdown(sig, 128 + sig, &STOPPING_NOW)?;
            // the first: note which, arm the above, and wake the notice's thread
            flag::register_usize(sig, &SIGNAL, sig as usize)?;
            flag::register(sig, &STOPPING_NOW)?;
            notice.register(sig)
        })();
        registered.map_err(|e| (sig, e))?;
    }
    std::thread::Builder::new()
        .name("tinyllm-signals".into())
        .spawn(move || notice.print())
        .map_err(|e| (STOPPING[0], e))?;
    Ok(())
}

/// What wakes the notice's thread: a byte down a socket pair, written by the
/// handler (the thread sleeps in a read until then).
#[cfg(unix)]
struct Notice {
    read: std::os::unix::net::UnixStream,
    wake: std::os::unix::net::UnixStream,
}

#[cfg(unix)]
impl Notice {
    fn new() -> std::io::Result<Notice> {
        let (read, wake) = std::os::unix::net::UnixStream::pair()?;
        Ok(Notice { read, wake })
    }

    fn register(&self, sig: i32) -> std::io::Result<()> {
        signal_hook::low_level::pipe::register(sig, self.wake.try_clone()?).map(drop)
    }

    /// The notice, once a signal has come in (again after each: only the
    /// first gets here, a second exits).
    fn print(mut self) {
        use std::io::{Read, Write};
        let mut byte = [0u8];
        while self.read.read(&mut byte).is_ok_and(|n| n > 0) {
            let _ = std::io::stderr().write_all(NOTICE.as_bytes());
        }
    }
}

/// Windows has no socket pair for a handler to write to: the notice's thread
/// looks at the flag ten times a second (a run's steps take longer).
#[cfg(windows)]
struct Notice;

#[cfg(windows)]
impl Notice {
    fn new() -> std::io::Result<Notice> {
        Ok(Notice)
    }

    fn register(&self, _sig: i32) -> std::io::Result<()> {
        Ok(())
    }

    fn print(self) {
        use std::io::Write;
        let mut shown = 0;
        loop {
            let s = SIGNAL.load(Ordering::SeqCst);
            if s != shown {
                shown = s;
                let _ = std::io::stderr().write_all(NOTICE.as_bytes());
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Gives SIGINT, SIGTERM and SIGHUP their default action back: once a run has
/// returned (everything saved), a signal ends the process at once.
#[cfg(any(unix, windows))]
pub fn uninstall() {
    DEFAULT_ACTION.store(true, Ordering::SeqCst);
}

/// Elsewhere signals keep their default action (the run is not saved).
#[cfg(not(any(unix, windows)))]
pub fn install() -> crate::Result<()> {
    Ok(())
}

/// Elsewhere there is no handler to take back.
#[cfg(not(any(unix, windows)))]
pub fn uninstall() {}
