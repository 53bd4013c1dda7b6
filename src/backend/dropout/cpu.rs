//! The CPU reference of the dropout mask.

use super::DropoutOps;
use crate::backend::cpu::CpuStorage;
use crate::rng;
use crate::Result;

impl DropoutOps for CpuStorage {
    fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> Result<CpuStorage> {
        Ok(CpuStorage::from_f32(
            rng::draws(seed, offset, n)
                .map(|u| if rng::uniform01(u) >= p { scale } else { 0.0 })
                .collect(),
        ))
    }
}
