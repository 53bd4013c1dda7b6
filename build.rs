//! Records which source a binary was built from (the git commit, and whether
//! the tracked files differed from it) for the provenance every run writes.
//! Outside a git checkout (a published crate) no commit is recorded.
//!
//! It also fingerprints the sources that decide a run's bits — the numerics
//! fingerprint `compare` holds both sides to — whether or not git is there.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The sources that decide the bits of a run: the primitives and kernels,
/// the ops and autograd, the model, the optimizer, precision, recompute, the
/// random numbers, and the step and the batches. Presentation (progress,
/// plots, files, the CLI) is left out, so changing it keeps the fingerprint.
const NUMERICS: [&str; 12] = [
    "shaders",
    "src/backend",
    "src/ops",
    "src/tensor",
    "src/nn",
    "src/optim",
    "src/math.rs",
    "src/precision.rs",
    "src/recompute.rs",
    "src/rng.rs",
    "src/train/step.rs",
    "src/train/data.rs",
];

fn files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for e in entries {
            files(&e, out);
        }
    } else if p.is_file() {
        out.push(p.to_path_buf());
    }
}

/// FNV-1a (64 bits) over each file's path and bytes, in path order.
fn fingerprint() -> String {
    let mut all = Vec::new();
    for p in NUMERICS {
        files(Path::new(p), &mut all);
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for f in all {
        let bytes = std::fs::read(&f).unwrap_or_default();
        let name = f.to_string_lossy().replace('\\', "/");
        for b in name.bytes().chain([0]).chain(bytes).chain([0]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    // Any source change can change the dirty flag; a commit moves HEAD.
    for p in [
        "src",
        "shaders",
        "Cargo.toml",
        ".git/HEAD",
        ".git/index",
        ".git/refs",
    ] {
        println!("cargo:rerun-if-changed={p}");
    }
    println!("cargo:rustc-env=TINYLLM_NUMERICS={}", fingerprint());
    if let Some(commit) = git(&["rev-parse", "HEAD"]) {
        println!("cargo:rustc-env=TINYLLM_GIT_COMMIT={commit}");
        let dirty =
            git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        println!("cargo:rustc-env=TINYLLM_GIT_DIRTY={dirty}");
    }
}
