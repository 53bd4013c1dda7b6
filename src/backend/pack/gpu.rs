//! The GPU launchers of 16-bit storage (`pack.wgsl`).

use super::PackOps;
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::{grid1d, u32_of, GpuStorage};
use crate::backend::round::{fmt_code, Format};
use crate::Result;

gpu_params! {
    /// `pack.wgsl` `PackParams`: n values of format `fmt`.
    pub struct PackParams { n: u32, fmt: u32 }
}

pub const FAMILY: Family = Family {
    name: "pack",
    sources: &[include_str!("../../../shaders/pack.wgsl")],
    needs_math: true,
    consts: no_consts,
    entries: &["pack", "unpack"],
    params: &[PackParams::LAYOUT],
};

const PACK: Kernel = Kernel::new(&FAMILY, "pack");
const UNPACK: Kernel = Kernel::new(&FAMILY, "unpack");

impl PackOps for GpuStorage {
    fn pack(&self, fmt: Format) -> Result<(GpuStorage, Option<usize>)> {
        let c = ctx()?;
        let n = self.len();
        let words = GpuStorage::alloc(c, n.div_ceil(2))?;
        let prm = PackParams {
            n: u32_of(n, "length")?,
            fmt: fmt_code(Some(fmt)),
        };
        c.dispatch(&PACK, &prm, &[self.buf(), words.buf()], grid1d(n.div_ceil(2)))?;
        Ok((words, None))
    }

    fn unpack(&self, fmt: Format, n: usize) -> Result<GpuStorage> {
        let c = ctx()?;
        let y = GpuStorage::alloc(c, n)?;
        let prm = PackParams {
            n: u32_of(n, "length")?,
            fmt: fmt_code(Some(fmt)),
        };
        c.dispatch(&UNPACK, &prm, &[self.buf(), y.buf()], grid1d(n))?;
        Ok(y)
    }
}
