#![warn(missing_docs)]
// Without the GPU backend its WGSL sources and launch helpers go unused.
#![cfg_attr(not(feature = "gpu"), allow(dead_code))]
//! Train small Llama-style language models with mixed precision you can
//! trust: bf16/fp16 autocast, dynamic loss scaling, gradient accumulation
//! weighted `n_i/N` and activation recompute, on the CPU or any GPU
//! through wgpu — and every GPU kernel held bit for bit to a CPU reference
//! and an executable spec under one numerics contract.
//!
//! ```toml
//! [dependencies]
//! tinyllm = { path = "../tinyllm" }   # the library and the GPU; default-features = false: CPU only
//! ```
//!
//! A model, an optimizer and one mixed-precision step per batch of
//! micro-batches ([`MixedStep`] names the settings of [`train_step_mixed`]):
//!
//! ```
//! use tinyllm::nn::{Layer, Linear, Module};
//! use tinyllm::optim::{AdamW, AdamWConfig};
//! use tinyllm::precision::{DynamicLossScaler, Precision};
//! use tinyllm::{ops::mse, Device, Generator, MixedStep, Tensor};
//!
//! let dev = Device::Cpu; // or Device::Gpu: the same bits
//! let gen = Generator::new(0);
//! let model = Linear::new(4, 1, true, &gen, dev)?;
//! let mut opt = AdamW::new(model.parameters(), AdamWConfig::new(1e-2))?;
//! let mut scaler = DynamicLossScaler::default();
//! let x = Tensor::randn(&[32, 4], 1.0, &gen, dev)?;
//! let y = x.sum(-1, true)?;
//! // four micro-batches of 8 rows: one batch of 32
//! let micro: Vec<(Tensor, Tensor)> = (0..4)
//!     .map(|i| Ok((x.narrow(0, 8 * i, 8)?, y.narrow(0, 8 * i, 8)?)))
//!     .collect::<tinyllm::Result<_>>()?;
//! for _ in 0..20 {
//!     MixedStep::new(Precision::Fp16)
//!         .scaler(&mut scaler)
//!         .clip(1.0)
//!         .run(&model, &micro, |(x, y)| mse(&model.forward(x)?, y), &mut opt)?;
//! }
//! # Ok::<(), tinyllm::Error>(())
//! ```
//!
//! A Llama in a loop of your own, saved as a Hugging Face folder:
//! [`train::save_model`], [`train::load_model`], [`train::TrainState`];
//! training in a worker thread: [`train::HostState`]. The `tinyllm` command
//! (train, compare, eval, generate, crosscheck, bench, device-check) is the
//! `tinyllm-cli` package beside this one; its README is the guide.
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
//!   scaler; [`recompute`] adds activation recompute; [`train_step_mixed`]
//!   (in `train::step`) accumulates micro-batches and takes one mixed-precision step;
//! * [`optim`] updates the float32 master weights (SGD, AdamW, gradient clipping);
//! * [`crosscheck`] asks whether the GPU gives the reference's bits: a device
//!   probe, a sweep of every primitive, a training lockstep, a primitive trace.

// The README's Rust snippets run as doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

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
pub mod roofline;
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
