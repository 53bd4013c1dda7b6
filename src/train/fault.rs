//! Test-only fault injection, driven by one environment variable, so the
//! reliability tests can crash the real binary at exact points and poison
//! chosen steps. Unset (always, outside tests) it costs one cached lookup.
//!
//! `TINYLLM_FAULT` is a comma-separated list of `POINT@STEP` (`@STEP` may be
//! left off: every step):
//!
//! * checkpoint writes (STEP: the step being saved) — at `POINT` the process
//!   prints `TINYLLM_FAULT_PAUSED POINT@STEP` on stderr and sleeps until it is
//!   killed (the test sends SIGKILL):
//!   * `write:FILE` — half of `FILE`'s temporary file written, not yet fsynced
//!     or renamed;
//!   * `wrote:FILE` — `FILE` renamed into place in `checkpoint.next/`;
//!   * `staged` — `checkpoint.next/` complete and synced, before the swap;
//!   * `swap` — between the two renames (`checkpoint/` moved aside to
//!     `checkpoint.prev/`, `checkpoint.next/` not yet in its place);
//!   * `swapped` — both renames done, `checkpoint.prev/` not yet removed.
//! * numerical faults (STEP: the optimizer step, 1-based), applied to the
//!   first micro-batch's loss:
//!   * `loss-inf`, `loss-nan` — the loss (and so every gradient) is ±inf / NaN;
//!   * `grad-inf` — the loss stays finite but one parameter's gradient is
//!     infinite (`+ Σ √(p − p)`: value 0, derivative 1/0).

use std::sync::OnceLock;

fn faults() -> &'static [(String, Option<usize>)] {
    static F: OnceLock<Vec<(String, Option<usize>)>> = OnceLock::new();
    F.get_or_init(|| {
        std::env::var("TINYLLM_FAULT")
            .unwrap_or_default()
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| match s.trim().rsplit_once('@') {
                Some((p, n)) => (p.to_string(), n.parse().ok()),
                None => (s.trim().to_string(), None),
            })
            .collect()
    })
}

/// Whether fault `point` is armed for `step`.
pub fn armed(point: &str, step: usize) -> bool {
    faults()
        .iter()
        .any(|(p, s)| p == point && s.is_none_or(|s| s == step))
}

/// Pauses forever at `point` when it is armed for `step` (see the module docs).
pub fn pause_point(point: &str, step: usize) {
    if armed(point, step) {
        eprintln!("TINYLLM_FAULT_PAUSED {point}@{step}");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}
