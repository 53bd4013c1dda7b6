//! The CPU reference of the dropout mask.

use super::DropoutOps;
use crate::backend::cpu::CpuStorage;
use crate::rng;
use crate::Result;

impl DropoutOps for CpuStorage {
    fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> Result<CpuStorage> {
        Ok(CpuStorage::from_f32(
            (0..n as u64)
                .map(|i| {
                    if rng::uniform01(rng::draw_u32(seed, offset, i)) >= p {
                        scale
                    } else {
                        0.0
                    }
                })
                .collect(),
        ))
    }
}
