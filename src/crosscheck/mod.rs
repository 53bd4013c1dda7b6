//! "Is my GPU bit-exact with the reference?" — `tinyllm crosscheck`, in four
//! parts that run in order and feed one [`Report`]:
//!
//! ```text
//! probe ──▶ sweep ──▶ lockstep ──(first divergence)──▶ trace replay
//!   │         │          │                                  │
//!   └─────────┴──────────┴──────────▶ Report: text / JSON, verdict, exit status
//! ```
//!
//! * [`probe`] — the adapter, its limits, and what the numerics contract
//!   assumes of a device, measured on it (fused `fma`, subnormals, contraction, …);
//! * [`sweep`] — every backend primitive on both devices over random inputs
//!   and the hard cases of `cases`, compared bit for bit;
//! * [`lockstep`] — a preset trained on both devices from one seed, compared
//!   after every step; the first diverging step is replayed with the
//!   [`trace`] on, which names the first primitive call that differs.
//!
//! Nothing here runs unless asked for: the trace is off by default and costs
//! one thread-local read per primitive then.

#[cfg(feature = "gpu")]
cli_internal!(cases);
#[cfg(feature = "gpu")]
pub mod lockstep;
#[cfg(feature = "gpu")]
pub mod probe;
#[cfg(feature = "gpu")]
mod report;
#[cfg(feature = "gpu")]
pub mod sweep;

/// The primitive trace: every backend primitive call in order, with the model
/// path and phase that issued it and a hash of its output. It lives on the
/// crate's ground floor (`src/trace.rs`, importing nothing of the crate), since
/// the backend, the autograd and the layers record into it; it is published here.
pub mod trace {
    pub use crate::trace::*;
}

#[cfg(feature = "gpu")]
pub use report::{run, Options, Report, Verdict};

/// The bits of `x` as the reports print them (`0x3f800000`).
#[cfg(feature = "gpu")]
fn hex(x: f32) -> String {
    format!("{:#010x}", x.to_bits())
}
