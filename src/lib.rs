#![warn(missing_docs)]
// Without the GPU backend its WGSL sources and launch helpers go unused.
#![cfg_attr(not(feature = "gpu"), allow(dead_code))]
// The crate's front page is the README (its example runs as a doctest).
#![doc = include_str!("../README.md")]
//!
//! ## The modules
//!
//! The pipeline, top to bottom:
//!
//! * [`train`] turns text into batches and micro-batches and runs the loop;
//! * [`nn`] builds the model (Linear, RMSNorm, attention, the Llama) from [`Tensor`] ops;
//!   [`module`] says what a model is ([`Module`](module::Module), [`Layer`](module::Layer));
//! * [`ops`] are the differentiable operations, each forward beside its backward;
//! * [`tensor`] records the graph and runs `backward`, freeing saved values as it goes;
//! * a backend executes primitives on the CPU reference or the GPU (wgpu,
//!   WGSL), under one numerics contract so both give the same bits;
//! * [`precision`] adds bf16/fp16 emulation (`cast`, `autocast`) and the dynamic loss
//!   scaler; [`recompute`] adds activation checkpointing; [`train_step_mixed`]
//!   (in `train::step`) accumulates micro-batches and takes one mixed-precision step;
//! * [`optim`] updates the float32 master weights (SGD, AdamW, gradient clipping);
//! * [`crosscheck`] asks whether the GPU gives the reference's bits: a device
//!   probe, a sweep of every primitive, a training lockstep, a primitive trace.

/// The backend's primitives are internal; the `test-hooks` feature (on for
/// the crate's own tests and benches) makes them reachable.
macro_rules! internal {
    ($($m:ident),*) => {$(
        #[cfg(feature = "test-hooks")]
        #[doc(hidden)]
        pub mod $m;
        #[cfg(not(feature = "test-hooks"))]
        mod $m;
    )*};
}
internal!(backend);

/// Modules the `tinyllm` binary and the crate's tests use but a library user
/// does not (the run directory, signals, plots, the metrics file, hashing):
/// public, and hidden from the docs, only with the `cli` or `test-hooks`
/// feature. Without them, what only the binary calls goes unused.
macro_rules! cli_internal {
    ($($m:ident),*) => {$(
        #[cfg(any(feature = "cli", feature = "test-hooks"))]
        #[doc(hidden)]
        pub mod $m;
        #[cfg(not(any(feature = "cli", feature = "test-hooks")))]
        #[allow(dead_code)]
        pub(crate) mod $m;
    )*};
}
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod testing;

#[cfg(all(feature = "gpu", feature = "ndarray"))]
pub mod bench;
pub mod crosscheck;
pub mod error;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod math;
pub mod memory;
pub mod module;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod precision;
pub mod profile;
pub mod recompute;
pub mod rng;
pub mod tensor;
mod trace;
pub mod train;

pub use backend::cpu::{cpu_spin, set_cpu_spin, set_cpu_threads};
pub use backend::round::Format;
pub use backend::{DType, Device};
pub use error::{Error, Result};
pub use rng::Generator;
pub use tensor::{is_grad_enabled, no_grad, set_grad_enabled, Tensor};
pub use train::step::{grad_accumulate, train_step_mixed, MicroBatch, MixedStep, StepReport};

/// The vector instructions the CPU kernels use on this machine, chosen at run
/// time: `"avx512f+avx2+fma"` (the AVX2 kernels with a matmul tile 32 columns
/// wide and the softmax, SwiGLU and bf16 packing on 16 lanes; capped at AVX2
/// by `TINYLLM_CPU=avx2`), `"avx2+fma"` or `"portable"`
/// (the build target's baseline; forced by `TINYLLM_CPU=portable`). Every path
/// gives the same bits.
pub fn cpu_kernel_path() -> &'static str {
    backend::cpu::simd::level().name()
}
