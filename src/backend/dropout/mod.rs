//! Dropout masks from the counter-based Philox4x32-10 generator
//! ([`rng`](crate::rng), `dropout.wgsl` its twin): the same bits on every device,
//! and a generator state `(seed, offset)` that is trivially saved and replayed.
//!
//! ## Contract
//! Element `i` of an `n`-element mask is `scale` when
//! `uniform01(draw_u32(seed, offset, i)) >= p`, else `0`.

mod cpu;
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::primitive;
use super::{Device, Storage};
use crate::Result;

/// The two devices' mask generators.
pub trait DropoutOps: Sized {
    fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> Result<Self>;
}

impl Storage {
    /// An `n`-element dropout mask on `device` (see the contract).
    pub fn dropout_mask(
        n: usize,
        p: f32,
        scale: f32,
        seed: u64,
        offset: u64,
        device: Device,
    ) -> Result<Storage> {
        let describe = || format!("n {n} p {p:e} scale {scale:e} seed {seed:#x} offset {offset:#x}");
        Ok(primitive!("dropout mask", describe, device device => |S| S::dropout_mask(n, p, scale, seed, offset)))
    }
}
