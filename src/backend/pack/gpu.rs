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

gpu_params! {
    /// `pack.wgsl` `PackSlotParams`: up to [`PACK_SLOTS`] buffers of format
    /// `fmt`, `n[s]` values in slot `s` (0: unused).
    pub struct PackSlotParams { fmt: u32, n: [u32; PACK_SLOTS] }
}

/// Buffers one `pack` dispatch takes (with their words and the
/// parameters, 7 storage bindings: within WebGPU's least of 8).
pub const PACK_SLOTS: usize = 3;

pub const FAMILY: Family = Family {
    name: "pack",
    sources: &[include_str!("../../../shaders/pack.wgsl")],
    needs_math: true,
    consts: no_consts,
    entries: &["pack", "unpack", "unpack_strided"],
    params: &[PackParams::LAYOUT, PackSlotParams::LAYOUT, UnpackStridedParams::LAYOUT],
};

const PACK: Kernel = Kernel::new(&FAMILY, "pack");
const UNPACK: Kernel = Kernel::new(&FAMILY, "unpack");
const UNPACK_STRIDED: Kernel = Kernel::new(&FAMILY, "unpack_strided");

impl PackOps for GpuStorage {
    fn pack(&self, fmt: Format) -> Result<(GpuStorage, Option<usize>)> {
        let mut one = Self::pack_many(&[self], fmt)?;
        Ok(one.pop().expect("one buffer packed"))
    }

    /// [`PACK_SLOTS`] buffers a dispatch.
    fn pack_many(xs: &[&GpuStorage], fmt: Format) -> Result<Vec<(GpuStorage, Option<usize>)>> {
        let c = ctx()?;
        let mut out = Vec::with_capacity(xs.len());
        for group in xs.chunks(PACK_SLOTS) {
            let words = group
                .iter()
                .map(|x| GpuStorage::alloc(c, x.len().div_ceil(2)))
                .collect::<Result<Vec<_>>>()?;
            let mut n = [0u32; PACK_SLOTS];
            for (s, x) in group.iter().enumerate() {
                n[s] = u32_of(x.len(), "length")?;
            }
            let prm = PackSlotParams {
                fmt: fmt_code(Some(fmt)),
                n,
            };
            // unused slots bound to the first buffer and its words, never touched
            let slot = |s: usize| group.get(s).unwrap_or(&group[0]).bind();
            let word = |s: usize| words.get(s).unwrap_or(&words[0]).bind();
            let mut bind: Vec<crate::backend::gpu::Bind> = (0..PACK_SLOTS).map(slot).collect();
            bind.extend((0..PACK_SLOTS).map(word));
            let most = group.iter().map(|x| x.len().div_ceil(2)).max().unwrap_or(0);
            c.dispatch(&PACK, &prm, &bind, grid1d(most))?;
            out.extend(words.into_iter().map(|w| (w, None)));
        }
        Ok(out)
    }

    fn unpack(&self, fmt: Format, n: usize) -> Result<GpuStorage> {
        let c = ctx()?;
        let y = GpuStorage::alloc(c, n)?;
        let prm = PackParams {
            n: u32_of(n, "length")?,
            fmt: fmt_code(Some(fmt)),
        };
        c.dispatch(&UNPACK, &prm, &[self.bind(), y.bind()], grid1d(n))?;
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
        c.dispatch(&UNPACK_STRIDED, &prm, &[self.bind(), y.bind()], grid1d(n))?;
        Ok(y)
    }
}
