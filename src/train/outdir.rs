//! A run's output directory: one process at a time, nothing in it replaced or
//! deleted that tinyllm did not write, and no link in it ever followed for a
//! write or a delete.
//!
//! * **The lock.** A run holds an exclusive lock on `DIR/.tinyllm.lock` (an OS
//!   file lock, released when the process ends, however it ends) from before
//!   it writes anything until it returns; the file holds the holder's pid, so
//!   a second process is refused with a message that names it. A checkpoint
//!   save takes the same lock (re-entrantly within a process), so the staging
//!   directory `checkpoint.next/` is only ever written by its holder. The lock
//!   file is opened without following a link and must be a regular file.
//! * **Ownership.** A `checkpoint`, `checkpoint.prev` or `checkpoint.next`
//!   entry is tinyllm's only when it is a real directory (not a link) that
//!   holds a tinyllm manifest and nothing but the files that manifest lists,
//!   or (a staging directory cut short) the staging marker and checkpoint
//!   files, or nothing at all. Anything else there is the user's: a run
//!   refuses to start rather than replace or delete it, and a delete removes
//!   only the files the manifest (or the staging marker) names.
//! * **Writing.** Every file is written under a fresh, unpredictable name
//!   created exclusively (`O_EXCL`: never an existing file or link), fsynced
//!   and renamed over its target; `metrics.jsonl` and `loss.svg` must be
//!   regular files when they exist.
//! * **An existing run.** A new run into a directory that holds one (a
//!   checkpoint or metrics) is refused unless it is resumed (`--resume`) or
//!   explicitly replaced (`--overwrite`, which deletes only tinyllm's files).

use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The lock file in a run's output directory; it holds the holder's pid.
pub const LOCK_FILE: &str = ".tinyllm.lock";
/// The first file of every staging directory: it marks a partial
/// `checkpoint.next/` as tinyllm's (its manifest is written last).
pub const STAGING_MARKER: &str = ".tinyllm-staging";
/// The names a run's checkpoints use (see [`checkpoint`](super::checkpoint)).
pub const CHECKPOINT_DIRS: [&str; 3] = ["checkpoint", "checkpoint.prev", "checkpoint.next"];
/// A run's metrics, one JSON line per step (see [`metrics`](super::metrics)).
pub const METRICS_FILE: &str = "metrics.jsonl";
/// A run's loss curves, redrawn at every evaluation.
pub const PLOT_FILE: &str = "loss.svg";
/// The SHA-256 and size of every other file of a checkpoint, written last.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The checkpoint format this version writes and reads, recorded in the
/// manifest and the trainer state; any other is refused.
pub const FORMAT: &str = "tinyllm-checkpoint-1";
/// The format of a model folder's manifest (weights and config only, as
/// [`save_model`](super::checkpoint::save_model) writes them): a folder of
/// this format is never a run's checkpoint.
pub const MODEL_FORMAT: &str = "tinyllm-model-1";
/// The files a checkpoint holds besides its manifest (and the Hugging Face
/// files beside the weights, [`HF_FILES`](super::hf::HF_FILES), which a
/// checkpoint written before them lacks).
pub const CHECKPOINT_FILES: [&str; 4] = [
    "model.safetensors",
    "config.json",
    "optimizer.safetensors",
    "trainer_state.json",
];
/// The largest manifest read (a real one is a few hundred bytes).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// One file of a checkpoint, as its manifest records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// SHA-256 of the file, hex.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// A checkpoint's `manifest.json`: its format and every other file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// File name → hash and size.
    pub files: BTreeMap<String, FileEntry>,
}

// ------------------------------------------------------------ opening files

/// Opens `p` without following a link at its last component and without
/// blocking (a FIFO opens at once instead of waiting for a writer), then
/// checks that what was opened is a regular file. `follow`: a link at `p` is
/// followed (readers); never for a file that is written.
fn open_regular(p: &Path, opts: &mut OpenOptions, follow: bool) -> std::io::Result<File> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let flags = libc::O_NONBLOCK | if follow { 0 } else { libc::O_NOFOLLOW };
        opts.custom_flags(flags);
    }
    #[cfg(not(unix))]
    if !follow
        && p.symlink_metadata()
            .is_ok_and(|m| m.file_type().is_symlink())
    {
        return Err(std::io::Error::other("a symbolic link"));
    }
    let f = opts.open(p).map_err(|e| {
        // ELOOP is what O_NOFOLLOW answers for a link.
        #[cfg(unix)]
        if e.raw_os_error() == Some(libc::ELOOP) {
            return std::io::Error::other(format!(
                "it is a symbolic link ({}): tinyllm never writes through a link",
                link_target(p)
            ));
        }
        e
    })?;
    let kind = f.metadata()?.file_type();
    if !kind.is_file() {
        return Err(std::io::Error::other(format!(
            "it is {}, not a regular file",
            kind_name(&kind)
        )));
    }
    Ok(f)
}

fn kind_name(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a special file"
    }
}

fn link_target(p: &Path) -> String {
    std::fs::read_link(p).map_or_else(|_| "?".into(), |t| format!("to {}", t.display()))
}

/// Whether `p` is a symbolic link (a dangling one too).
pub fn is_link(p: &Path) -> bool {
    p.symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink())
}

/// Whether anything (a dangling link too) is at `p`.
pub fn present(p: &Path) -> bool {
    p.symlink_metadata().is_ok()
}

/// Reads a regular file that should be `expected` bytes long (`None`: at most
/// `max`): a FIFO, a device or a directory is refused before a byte is read,
/// and no more than the expected size is ever read. Links are followed
/// (reading through one writes nothing).
pub fn read_regular(p: &Path, expected: Option<u64>, max: u64) -> std::io::Result<Vec<u8>> {
    let f = open_regular(p, OpenOptions::new().read(true), true)?;
    let len = f.metadata()?.len();
    let cap = match expected {
        Some(n) if n != len => {
            return Err(std::io::Error::other(format!(
                "{len} bytes, the manifest records {n} (truncated or partly written)"
            )))
        }
        Some(n) => n,
        None if len > max => {
            return Err(std::io::Error::other(format!(
                "{len} bytes is far too large (at most {max})"
            )))
        }
        None => len,
    };
    let mut bytes = Vec::with_capacity(cap as usize);
    f.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 != cap {
        return Err(std::io::Error::other(format!(
            "{} bytes read, {cap} expected (the file changed while it was read)",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Opens `p` to append to it: never through a link, only a regular file.
pub fn open_append(p: &Path) -> std::io::Result<File> {
    open_regular(p, OpenOptions::new().append(true), false)
}

/// 64 bits no one can guess (std's hasher keys come from the OS's random
/// source), for temporary names and run ids.
fn unpredictable() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A fresh run id: 16 random hex digits.
pub fn new_run_id() -> String {
    format!("{:016x}", unpredictable())
}

/// A name no one can guess: a temporary file beside `name` in its directory.
fn temp_name(name: &str) -> String {
    format!(
        ".{name}.tmp-{}-{:016x}",
        std::process::id(),
        unpredictable()
    )
}

/// Whether `entry` is one of [`temp_name`]'s names for `name`.
fn is_temp_of(entry: &str, name: &str) -> bool {
    entry
        .strip_prefix('.')
        .and_then(|e| e.strip_prefix(name))
        .is_some_and(|rest| rest.starts_with(".tmp-"))
}

/// Creates a new temporary file for `dir/name` under an unpredictable name,
/// exclusively (an existing file or link there is never opened).
pub fn create_temp(dir: &Path, name: &str) -> std::io::Result<(File, PathBuf)> {
    let mut last = None;
    for _ in 0..16 {
        let tmp = dir.join(temp_name(name));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((f, tmp)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free temporary name")))
}

/// Writes `bytes` to `dir/name` atomically: a new temporary file in `dir`
/// (`create_temp`), fsynced, renamed over the target (a link there is
/// replaced, never written through), then the directory fsynced.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    write_atomic_with(dir, name, |f| f.write_all(bytes))?;
    sync_dir(dir);
    Ok(())
}

/// [`write_atomic`] with the contents written by `write` and without the
/// directory sync (a caller writing several files syncs once). On an error
/// the temporary file is removed and the target is as it was.
pub fn write_atomic_with(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<()> {
    let target = dir.join(name);
    let mut tmp = None;
    let res = (|| -> std::io::Result<()> {
        let (mut f, p) = create_temp(dir, name)?;
        tmp = Some(p.clone());
        write(&mut f)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&p, &target)
    })();
    if let Err(e) = res {
        if let Some(p) = tmp {
            let _ = std::fs::remove_file(p);
        }
        return Err(Error::io(format!("cannot write {}", target.display()), e));
    }
    Ok(())
}

/// Makes a directory's entries (renames) durable. Best effort: a filesystem
/// that cannot fsync a directory (some network mounts) is not an error.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Reads and parses a checkpoint manifest (a regular file of at most
/// [`MAX_MANIFEST_BYTES`]); its bytes too, to tell a replaced one.
pub fn read_manifest(dir: &Path) -> std::result::Result<(Manifest, Vec<u8>), String> {
    let p = dir.join(MANIFEST_FILE);
    let bytes = read_regular(&p, None, MAX_MANIFEST_BYTES).map_err(|e| e.to_string())?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| format!("corrupt: {e}"))?;
    Ok((m, bytes))
}

// ------------------------------------------------------------------ the lock

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
    /// A directory inside a checkpoint is refused before anything is created
    /// ([`check_not_in_checkpoint`]).
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        check_not_in_checkpoint(dir)?;
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
        let mut f = open_regular(
            &path,
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false),
            false,
        )
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

// ---------------------------------------------------------------- ownership

/// What is under one of the checkpoint names.
#[derive(Debug)]
pub enum Entry {
    /// Nothing.
    Absent,
    /// A checkpoint directory of tinyllm's: the files to delete to remove it,
    /// the ones that mark it as tinyllm's last; `complete` when it holds a
    /// manifest.
    Ours {
        /// Its files, in the order a delete removes them.
        files: Vec<PathBuf>,
        /// Whether it holds a manifest (a finished checkpoint).
        complete: bool,
    },
    /// Something tinyllm did not write, and why it is not tinyllm's.
    Foreign(String),
}

/// Looks at `p` without following a link: what it is, and whether tinyllm
/// wrote it (see the module docs).
pub fn inspect(p: &Path) -> Entry {
    let meta = match p.symlink_metadata() {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Entry::Absent,
        Err(e) => return Entry::Foreign(format!("cannot be read ({e})")),
    };
    if meta.file_type().is_symlink() {
        return Entry::Foreign(format!(
            "is a symbolic link ({}): tinyllm never writes or deletes through a link",
            link_target(p)
        ));
    }
    if !meta.is_dir() {
        return Entry::Foreign(format!("is {}", kind_name(&meta.file_type())));
    }
    let names: Vec<(String, std::fs::FileType)> = match std::fs::read_dir(p) {
        Ok(d) => d
            .filter_map(|e| e.ok())
            .filter_map(|e| Some((e.file_name().into_string().ok()?, e.file_type().ok()?)))
            .collect(),
        Err(e) => return Entry::Foreign(format!("cannot be listed ({e})")),
    };
    let has = |n: &str| names.iter().any(|(m, t)| m == n && t.is_file());
    let manifest = has(MANIFEST_FILE)
        .then(|| read_manifest(p).ok())
        .flatten()
        .filter(|(m, _)| m.format == FORMAT);
    // The names this directory may hold: the manifest's files, or (a staging
    // directory cut short) any checkpoint file.
    let allowed: Vec<&str> = match &manifest {
        Some((m, _)) => m.files.keys().map(String::as_str).collect(),
        None if has(STAGING_MARKER) => CHECKPOINT_FILES
            .iter()
            .chain(&super::hf::HF_FILES)
            .copied()
            .collect(),
        None if names.is_empty() => vec![],
        None => return Entry::Foreign(format!("holds no tinyllm {MANIFEST_FILE}")),
    };
    let mut files = Vec::new();
    let mut markers = Vec::new();
    for (n, t) in &names {
        let known = allowed.contains(&n.as_str())
            || n == MANIFEST_FILE
            || n == STAGING_MARKER
            || allowed
                .iter()
                .chain(&[MANIFEST_FILE])
                .any(|a| is_temp_of(n, a));
        if !known {
            return Entry::Foreign(format!(
                "holds {n:?}, which tinyllm did not write (tinyllm deletes only the files its manifest lists): move it out of {}",
                p.display()
            ));
        }
        if !t.is_file() {
            return Entry::Foreign(format!(
                "holds {n:?}, which is {} (tinyllm writes only regular files)",
                kind_name(t)
            ));
        }
        if n == MANIFEST_FILE || n == STAGING_MARKER {
            markers.push(p.join(n));
        } else {
            files.push(p.join(n));
        }
    }
    files.extend(markers);
    Entry::Ours {
        files,
        complete: manifest.is_some(),
    }
}

/// Whether `p` is a checkpoint directory tinyllm may replace ([`inspect`]).
pub fn is_ours(p: &Path) -> bool {
    matches!(inspect(p), Entry::Ours { .. })
}

/// Deletes a checkpoint directory of tinyllm's ([`inspect`]; anything else is
/// refused, nothing absent is an error). Only the files its manifest (or the
/// staging marker) accounts for are deleted, the ones that make it ours last,
/// so a crash part-way leaves it still recognisably ours.
pub fn remove_ours(p: &Path) -> Result<()> {
    let files = match inspect(p) {
        Entry::Absent => return Ok(()),
        Entry::Foreign(why) => bail!(
            Config,
            "{} is not a tinyllm checkpoint: it {why}; tinyllm does not delete it",
            p.display()
        ),
        Entry::Ours { files, .. } => files,
    };
    let io = |e| Error::io(format!("cannot delete {}", p.display()), e);
    for f in files {
        std::fs::remove_file(f).map_err(io)?;
    }
    std::fs::remove_dir(p).map_err(io)
}

/// Refuses `dir` if an entry tinyllm would replace or delete there is not
/// tinyllm's: a checkpoint name holding something else, or a link or a
/// special file (a FIFO, a device) at the lock, metrics or plot file. (A
/// directory there only makes that file's write fail.)
pub fn check_no_foreign(dir: &Path) -> Result<()> {
    for name in CHECKPOINT_DIRS {
        let p = dir.join(name);
        if let Entry::Foreign(why) = inspect(&p) {
            bail!(Config,
                "{} exists but is not a tinyllm checkpoint: it {why}; tinyllm never replaces or deletes what it did not write: move it elsewhere, or give another --out",
                p.display()
            );
        }
    }
    for name in [LOCK_FILE, METRICS_FILE, PLOT_FILE] {
        let p = dir.join(name);
        if let Ok(m) = p.symlink_metadata() {
            if !m.is_file() && !m.is_dir() {
                let what = if m.file_type().is_symlink() {
                    format!("a symbolic link ({})", link_target(&p))
                } else {
                    kind_name(&m.file_type()).to_string()
                };
                bail!(Config,
                    "{} is {what}: tinyllm writes its own {name} there and never writes through a link or into a special file; remove it, or give another --out",
                    p.display()
                );
            }
        }
    }
    Ok(())
}

/// Refuses an output directory that is, or is inside, a checkpoint (a
/// directory holding a tinyllm manifest or staging marker, or one named as a
/// checkpoint beside a run's lock file): a run's files there would break its
/// owner's next save.
pub fn check_not_in_checkpoint(out: &Path) -> Result<()> {
    if let Some(a) = checkpoint_containing(out) {
        bail!(Config,
            "--out {} is inside the checkpoint {}: a run's own files may not go into a checkpoint (its run's next save would replace them); give an --out outside it",
            out.display(),
            a.display()
        );
    }
    Ok(())
}

/// The checkpoint `p` is or lies inside, if any (see
/// [`check_not_in_checkpoint`]).
pub fn checkpoint_containing(out: &Path) -> Option<PathBuf> {
    // The path as it resolves: the part that exists, canonical, then the rest.
    let mut base = out.to_path_buf();
    let mut rest = Vec::new();
    while !present(&base) {
        match (base.file_name(), base.parent()) {
            (Some(n), Some(q)) => {
                rest.push(n.to_os_string());
                base = if q.as_os_str().is_empty() {
                    ".".into()
                } else {
                    q.to_path_buf()
                };
            }
            _ => return None,
        }
    }
    let Ok(mut full) = base.canonicalize() else {
        return None;
    };
    full.extend(rest.iter().rev());
    for a in full.ancestors() {
        let ours = |marker: &str| match marker {
            MANIFEST_FILE => read_manifest(a).is_ok_and(|(m, _)| m.format == FORMAT),
            _ => a.join(marker).symlink_metadata().is_ok_and(|m| m.is_file()),
        };
        let named = a
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| CHECKPOINT_DIRS.contains(&n))
            && a.parent().is_some_and(|r| present(&r.join(LOCK_FILE)));
        if named || ours(MANIFEST_FILE) || ours(STAGING_MARKER) {
            return Some(a.to_path_buf());
        }
    }
    None
}

/// What `dir` holds of an earlier run, in words (`None`: nothing).
pub fn existing_run(dir: &Path) -> Option<String> {
    let ck = CHECKPOINT_DIRS
        .iter()
        .map(|n| dir.join(n))
        .find(|p| matches!(inspect(p), Entry::Ours { complete: true, .. }));
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
/// Call it only once the new run has passed every check that can refuse it.
pub fn clear_run(dir: &Path) -> Result<()> {
    check_no_foreign(dir)?;
    for name in CHECKPOINT_DIRS {
        remove_ours(&dir.join(name))?;
    }
    for name in [METRICS_FILE, PLOT_FILE] {
        let p = dir.join(name);
        // check_no_foreign saw a regular file or nothing.
        if p.symlink_metadata().is_ok_and(|m| m.is_file()) {
            std::fs::remove_file(&p)
                .map_err(|e| Error::io(format!("--overwrite: cannot delete {}", p.display()), e))?;
        }
    }
    Ok(())
}
