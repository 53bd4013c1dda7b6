//! Test-only fault injection (compiled in, but inert without the `test-hooks`
//! feature), driven by one environment variable, so the
//! reliability tests can crash the real binary at exact points, poison chosen
//! steps and fail chosen writes. Unset (always, outside tests) it costs one
//! cached lookup.
//!
//! `TINYLLM_FAULT` is a comma-separated list of `POINT@STEPS`, where `STEPS` is
//! a step `N`, a range `A-B`, or `A-` (from step A on); `@STEPS` may be left
//! off: every step.
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
//! * failed writes: `fail:FILE` — writing `FILE` fails as on a full disk
//!   (ENOSPC): a checkpoint file (STEP: the step being saved) or
//!   `metrics.jsonl` (STEP: the step whose line is appended).
//! * numerical faults (STEP: the optimizer step, 1-based), applied to the
//!   first micro-batch's loss through the trainer's loss hook ([`loss_hook`]):
//!   * `loss-inf`, `loss-nan` — the loss (and so every gradient) is ±inf / NaN;
//!   * `grad-inf` — the loss stays finite but one parameter's gradient is
//!     infinite (`+ Σ √(p − p)`: value 0, derivative 1/0).
//! * `await-signal` (STEP: the optimizer step) — in the middle of that step
//!   (its first forward pass done, before backward) the process prints
//!   `TINYLLM_FAULT_PAUSED await-signal@STEP` and waits until SIGINT or
//!   SIGTERM asks the run to stop, then finishes the step.

use crate::nn::llama::Llama;
use crate::nn::Module;
use crate::{Result, Tensor};
use std::sync::OnceLock;

/// Steps `first..=last` (`None`: every step).
type Steps = Option<(usize, usize)>;

fn parse_steps(s: &str) -> Steps {
    let n = |x: &str| x.trim().parse::<usize>().ok();
    match s.split_once('-') {
        Some((a, "")) => Some((n(a)?, usize::MAX)),
        Some((a, b)) => Some((n(a)?, n(b)?)),
        None => n(s).map(|k| (k, k)),
    }
}

fn faults() -> &'static [(String, Steps)] {
    // Outside the crate's own tests the variable is not even read.
    if cfg!(not(feature = "test-hooks")) {
        return &[];
    }
    static F: OnceLock<Vec<(String, Steps)>> = OnceLock::new();
    F.get_or_init(|| {
        std::env::var("TINYLLM_FAULT")
            .unwrap_or_default()
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| match s.trim().rsplit_once('@') {
                Some((p, n)) => (p.to_string(), parse_steps(n)),
                None => (s.trim().to_string(), None),
            })
            .collect()
    })
}

/// Whether fault `point` is armed for `step`.
pub fn armed(point: &str, step: usize) -> bool {
    faults()
        .iter()
        .any(|(p, s)| p == point && s.is_none_or(|(a, b)| (a..=b).contains(&step)))
}

fn paused(point: &str, step: usize) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "TINYLLM_FAULT_PAUSED {point}@{step}");
}

/// Pauses forever at `point` when it is armed for `step` (see the module docs).
pub fn pause_point(point: &str, step: usize) {
    if armed(point, step) {
        paused(point, step);
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

/// A full disk at `point` (`fail:FILE`) when it is armed for `step`.
pub fn io_point(point: &str, step: usize) -> std::io::Result<()> {
    if armed(point, step) {
        return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
    }
    Ok(())
}

/// A change to the first micro-batch's loss of optimizer step `step`.
pub type LossHook = fn(&Llama, Tensor, usize) -> Result<Tensor>;

/// The trainer's loss hook when a numerical fault or `await-signal` is armed.
pub fn loss_hook() -> Option<LossHook> {
    const POINTS: [&str; 4] = ["loss-inf", "loss-nan", "grad-inf", "await-signal"];
    faults()
        .iter()
        .any(|(p, _)| POINTS.contains(&p.as_str()))
        .then_some(poison as LossHook)
}

/// The numerical faults armed for `step` (see the module docs).
fn poison(model: &Llama, loss: Tensor, step: usize) -> Result<Tensor> {
    if armed("await-signal", step) {
        paused("await-signal", step);
        while crate::train::interrupt::requested().is_none() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    if armed("loss-inf", step) {
        return loss.mul_scalar(f64::INFINITY);
    }
    if armed("loss-nan", step) {
        return loss.mul_scalar(f64::NAN);
    }
    if armed("grad-inf", step) {
        // + Σ √(p − p): adds exactly 0 to the loss, but d√x/dx = 1/(2√x) = inf at 0.
        let p = &model.parameters()[0];
        let zero = p.sub(&p.detach())?.sqrt()?.sum(-1, false)?.sum(-1, false)?;
        return loss.add(&zero);
    }
    Ok(loss)
}
