//! The GPU launcher of the dropout mask (`dropout.wgsl`): one invocation per four
//! elements (one Philox block).

use super::DropoutOps;
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::{grid1d, u32_of, GpuStorage};
use crate::Result;

gpu_params! {
    /// `dropout.wgsl` `DropoutParams` (`p`, `scale` as f32 bits; 64-bit seed and
    /// offset as halves).
    pub struct DropoutParams {
        n: u32,
        p: u32,
        scale: u32,
        seed_lo: u32,
        seed_hi: u32,
        off_lo: u32,
        off_hi: u32,
    }
}

pub const FAMILY: Family = Family {
    name: "dropout",
    sources: &[include_str!("../../../shaders/dropout.wgsl")],
    needs_math: true,
    consts: no_consts,
    entries: &["dropout_mask"],
    params: &[DropoutParams::LAYOUT],
};

const DROPOUT_MASK: Kernel = Kernel::new(&FAMILY, "dropout_mask");

impl DropoutOps for GpuStorage {
    fn dropout_mask(n: usize, p: f32, scale: f32, seed: u64, offset: u64) -> Result<GpuStorage> {
        let c = ctx()?;
        let out = GpuStorage::alloc(c, n)?;
        let prm = DropoutParams {
            n: u32_of(n, "length")?,
            p: p.to_bits(),
            scale: scale.to_bits(),
            seed_lo: seed as u32,
            seed_hi: (seed >> 32) as u32,
            off_lo: offset as u32,
            off_hi: (offset >> 32) as u32,
        };
        c.dispatch(&DROPOUT_MASK, &prm, &[out.bind()], grid1d(n.div_ceil(4)))?;
        Ok(out)
    }
}
