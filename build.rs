//! Records which source a binary was built from (the git commit, and whether
//! the tracked files differed from it) for the provenance every run writes.
//! Outside a git checkout (a published crate) nothing is recorded.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    // Any source change can change the dirty flag; a commit moves HEAD.
    for p in ["src", "Cargo.toml", ".git/HEAD", ".git/index", ".git/refs"] {
        println!("cargo:rerun-if-changed={p}");
    }
    if let Some(commit) = git(&["rev-parse", "HEAD"]) {
        println!("cargo:rustc-env=TINYLLM_GIT_COMMIT={commit}");
        let dirty =
            git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        println!("cargo:rustc-env=TINYLLM_GIT_DIRTY={dirty}");
    }
}
