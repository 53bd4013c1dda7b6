//! The GPU launchers of 16-bit storage (`pack.wgsl`).

use super::PackOps;
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::{grid1d, pad6, u32_of, GpuStorage};
use crate::backend::MAX_DIMS;
use crate::backend::round::{fmt_code, Format};
use crate::Result;

gpu_params! {
    /// `pack.wgsl` `PackParams`: n values of format `fmt`.
    pub struct PackParams { n: u32, fmt: u32 }
}

gpu_params! {
    /// `pack.wgsl` `UnpackStridedParams`: the view `(shape, strides, offset)`
    /// of values of format `fmt`, `n` of them.
    pub struct UnpackStridedParams {
        n: u32,
        fmt: u32,
        offset: u32,
        _pad0: u32,
        shape: [u32; MAX_DIMS],
        strides: [u32; MAX_DIMS],
    }
}

pub const FAMILY: Family = Family {
    name: "pack",
    sources: &[include_str!("../../../shaders/pack.wgsl")],
    needs_math: true,
    consts: no_consts,
    entries: &["pack", "unpack", "unpack_strided"],
    params: &[PackParams::LAYOUT, UnpackStridedParams::LAYOUT],
};

const PACK: Kernel = Kernel::new(&FAMILY, "pack");
const UNPACK: Kernel = Kernel::new(&FAMILY, "unpack");
const UNPACK_STRIDED: Kernel = Kernel::new(&FAMILY, "unpack_strided");

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

    fn unpack_strided(&self, fmt: Format, shape: &[usize], strides: &[usize], offset: usize) -> Result<GpuStorage> {
        let c = ctx()?;
        let n: usize = shape.iter().product();
        let y = GpuStorage::alloc(c, n)?;
        let (shape, strides) = pad6(shape, strides)?;
        let prm = UnpackStridedParams {
            n: u32_of(n, "length")?,
            fmt: fmt_code(Some(fmt)),
            offset: u32_of(offset, "offset")?,
            _pad0: 0,
            shape,
            strides,
        };
        c.dispatch(&UNPACK_STRIDED, &prm, &[self.buf(), y.buf()], grid1d(n))?;
        Ok(y)
    }
}
