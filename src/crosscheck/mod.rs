//! "Is my GPU bit-exact with the reference?" — the cross-check. So far:
//!
//! * [`probe`] — the adapter, its limits, and what the numerics contract
//!   assumes of a device, measured on it (fused `fma`, subnormals, contraction, …);
//! * [`sweep`] — every backend primitive on both devices over random inputs
//!   and the hard cases of [`cases`], compared bit for bit;
//! * [`trace`] — every backend primitive call in order, with the model path
//!   that issued it and a hash of its output; off by default (one
//!   thread-local read per primitive then).

pub mod cases;
pub mod probe;
pub mod sweep;
pub mod trace;
