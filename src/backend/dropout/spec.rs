//! The spec of the dropout mask: one Philox draw per element.

#![forbid(unsafe_code)]

use super::DropoutOps;
use crate::backend::spec::SpecStorage;
use crate::rng::{draw_u32, uniform01};
use crate::Result;

impl DropoutOps for SpecStorage {
    fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> Result<SpecStorage> {
        let keep = |i: usize| uniform01(draw_u32(seed, offset, i as u64)) >= p;
        Ok(SpecStorage::new((0..n).map(|i| if keep(i) { scale } else { 0.0 }).collect()))
    }
}
