//! # tinyllm
//!
//! Train small Llama-style language models with mixed precision on any GPU,
//! checked bit for bit against a CPU reference.
//!
//! The pipeline, top to bottom:
//!
//! * [`train`] turns text into batches and micro-batches and runs the loop;
//! * [`nn`] builds the model (Linear, RMSNorm, attention, the Llama) from [`Tensor`] ops;
//! * [`ops`] are the differentiable operations, each forward beside its backward;
//! * [`tensor`] records the graph and runs `backward`, freeing saved values as it goes;
//! * [`backend`] executes primitives on the CPU reference or the GPU (wgpu, `shaders/`),
//!   under one numerics contract so both give the same bits;
//! * [`precision`] adds bf16/fp16 emulation (`cast`, `autocast`) and the dynamic loss
//!   scaler; [`recompute`] adds activation checkpointing; [`train_step_mixed`]
//!   (in `train::step`) accumulates micro-batches and takes one mixed-precision step;
//! * [`optim`] updates the float32 master weights (SGD, AdamW, gradient clipping).

pub mod backend;
pub mod bench;
pub mod error;
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
pub mod testing;
pub mod train;

pub use backend::round::Format;
pub use backend::{DType, Device};
pub use error::{Error, Result};
pub use rng::Generator;
pub use tensor::{is_grad_enabled, no_grad, set_grad_enabled, Tensor};
pub use train::step::{grad_accumulate, train_step_mixed, MicroBatch, StepReport};

/// The README's example runs as a doctest, so it cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
