//! A run's output directory: one process at a time, and nothing in it
//! replaced or deleted that tinyllm did not write.
//!
//! * **The lock.** A run holds an exclusive lock on `DIR/.tinyllm.lock` (an OS
//!   file lock, released when the process ends, however it ends) from before
//!   it writes anything until it returns; the file holds the holder's pid, so
//!   a second process is refused with a message that names it. A checkpoint
//!   save takes the same lock (re-entrantly within a process), so the staging
//!   directory `checkpoint.next/` is only ever written by its holder.
//! * **Ownership.** A `checkpoint`, `checkpoint.prev` or `checkpoint.next`
//!   entry is tinyllm's only when it is a directory holding a tinyllm
//!   `manifest.json`, or (a staging directory cut short) the staging marker
//!   written into it first, or nothing at all (an empty directory loses
//!   nothing). Anything else under those names is the user's: a run refuses to
//!   start rather than replace or delete it.
//! * **An existing run.** A new run into a directory that holds one (a
//!   checkpoint or metrics) is refused unless it is resumed (`--resume`) or
//!   explicitly replaced (`--overwrite`, which deletes only tinyllm's files).

use crate::train::checkpoint::{self, MANIFEST_FILE};
use crate::{bail, Error, Result};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The lock file in a run's output directory; it holds the holder's pid.
pub const LOCK_FILE: &str = ".tinyllm.lock";
/// The first file of every staging directory: it marks a partial
/// `checkpoint.next/` as tinyllm's (its manifest is written last).
pub const STAGING_MARKER: &str = ".tinyllm-staging";
/// The names a run's checkpoints use (see [`checkpoint`]).
pub const CHECKPOINT_DIRS: [&str; 3] = ["checkpoint", "checkpoint.prev", "checkpoint.next"];
/// A run's metrics, one JSON line per step (see [`metrics`](super::metrics)).
pub const METRICS_FILE: &str = "metrics.jsonl";
/// A run's loss curves, redrawn at every evaluation.
pub const PLOT_FILE: &str = "loss.svg";

/// Directories this process holds the lock of (the lock is re-entrant within
/// a process: a save inside a run does not lock against its own run).
fn held() -> &'static Mutex<HashSet<PathBuf>> {
    static H: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    H.get_or_init(Default::default)
}

/// The exclusive lock on an output directory; released on drop.
pub struct DirLock {
    /// `None` when this process already held the lock (a nested acquire).
    file: Option<(File, PathBuf)>,
}

impl DirLock {
    /// Creates `dir` if needed and locks it, or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("cannot create {}", dir.display()), e))?;
        let key = dir
            .canonicalize()
            .map_err(|e| Error::io(format!("cannot resolve {}", dir.display()), e))?;
        let mut held = held().lock().unwrap_or_else(|p| p.into_inner());
        if held.contains(&key) {
            return Ok(DirLock { file: None });
        }
        let path = dir.join(LOCK_FILE);
        let io = |what: &str, e| Error::io(format!("{what} {}", path.display()), e);
        // Not truncated before it is locked: the holder's pid stays readable.
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io("cannot open the lock file", e))?;
        match f.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = f.read_to_string(&mut pid);
                let pid = match pid.trim() {
                    "" => "pid unknown".to_string(),
                    p => format!("pid {p}"),
                };
                bail!(Config,
                    "{} is in use by another tinyllm process ({pid}, which holds {}): wait for it to finish, or give another --out",
                    dir.display(),
                    path.display()
                );
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io("cannot lock", e)),
        }
        f.set_len(0)
            .and_then(|()| f.rewind())
            .and_then(|()| writeln!(f, "{}", std::process::id()))
            .map_err(|e| io("cannot write", e))?;
        held.insert(key.clone());
        Ok(DirLock {
            file: Some((f, key)),
        })
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        if let Some((_f, key)) = self.file.take() {
            held()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
            // `_f` closes here, which releases the OS lock.
        }
    }
}

/// Whether `p` is a checkpoint directory tinyllm may replace: it holds a
/// manifest of tinyllm's format or the staging marker, or it is empty (a
/// staging directory cut short before its marker).
pub fn is_ours(p: &Path) -> bool {
    if !p.is_dir() {
        return false;
    }
    if p.join(STAGING_MARKER).is_file()
        || std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_none())
    {
        return true;
    }
    let mut head = Vec::new();
    let read =
        File::open(p.join(MANIFEST_FILE)).and_then(|f| f.take(1 << 20).read_to_end(&mut head));
    read.is_ok()
        && serde_json::from_slice::<serde_json::Value>(&head)
            .is_ok_and(|v| v["format"] == checkpoint::FORMAT)
}

/// Deletes a checkpoint directory of tinyllm's ([`is_ours`]; anything else is
/// refused). The files that make it ours go last, so a crash part-way leaves
/// it still recognisably ours; only files are deleted (tinyllm writes no
/// subdirectories: one there is left, and the directory with it).
pub fn remove_ours(p: &Path) -> Result<()> {
    if !is_ours(p) {
        bail!(
            Config,
            "{} is not a tinyllm checkpoint: tinyllm does not delete it",
            p.display()
        );
    }
    let io = |e| Error::io(format!("cannot delete {}", p.display()), e);
    let mut last = Vec::new();
    for entry in std::fs::read_dir(p).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        if name == MANIFEST_FILE || name == STAGING_MARKER {
            last.push(entry.path());
        } else if entry.file_type().map_err(io)?.is_file() {
            std::fs::remove_file(entry.path()).map_err(io)?;
        }
    }
    for f in last {
        std::fs::remove_file(f).map_err(io)?;
    }
    std::fs::remove_dir(p).map_err(io)
}

/// Refuses `dir` if one of the checkpoint names in it is not tinyllm's: a run
/// would have to replace or delete it.
pub fn check_no_foreign(dir: &Path) -> Result<()> {
    for name in CHECKPOINT_DIRS {
        let p = dir.join(name);
        if p.symlink_metadata().is_ok() && !is_ours(&p) {
            bail!(Config,
                "{} exists but is not a tinyllm checkpoint (no tinyllm {MANIFEST_FILE} in it): tinyllm never replaces or deletes what it did not write; move it elsewhere, or give another --out",
                p.display()
            );
        }
    }
    Ok(())
}

/// What `dir` holds of an earlier run, in words (`None`: nothing).
pub fn existing_run(dir: &Path) -> Option<String> {
    let ck = CHECKPOINT_DIRS
        .iter()
        .map(|n| dir.join(n))
        .find(|p| is_ours(p) && p.join(MANIFEST_FILE).is_file());
    let metrics = std::fs::metadata(dir.join(METRICS_FILE)).is_ok_and(|m| m.len() > 0);
    match (ck, metrics) {
        (None, false) => None,
        (Some(p), _) => Some(format!("its checkpoint is {}", p.display())),
        (None, true) => Some(format!(
            "{} of an earlier run, without a checkpoint",
            dir.join(METRICS_FILE).display()
        )),
    }
}

/// Deletes what tinyllm wrote of an earlier run in `dir` (its checkpoint
/// directories, metrics and plot), for `--overwrite`; anything else stays.
pub fn clear_run(dir: &Path) -> Result<()> {
    check_no_foreign(dir)?;
    for name in CHECKPOINT_DIRS {
        let p = dir.join(name);
        if p.exists() {
            remove_ours(&p)?;
        }
    }
    for name in [METRICS_FILE, PLOT_FILE] {
        let p = dir.join(name);
        if p.is_file() {
            std::fs::remove_file(&p)
                .map_err(|e| Error::io(format!("--overwrite: cannot delete {}", p.display()), e))?;
        }
    }
    Ok(())
}
