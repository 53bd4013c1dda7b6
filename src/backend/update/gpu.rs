//! The GPU launchers of the in-place updates (`update.wgsl`). The elementwise
//! kernels take `PER_LANE` elements per invocation, an override chosen per
//! adapter ([`Context::update_per_lane`](crate::backend::gpu::context::Context)).

use super::{AdamWConsts, AdamWItem, UpdateOps};
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::{grid1d, u32_of, GpuStorage};
use crate::backend::reduce::NORM_CHUNK;
use crate::Result;

gpu_params! {
    /// `update.wgsl` `ScaleParams`: `n` elements times the f32 `c` (bits).
    pub struct ScaleParams { n: u32, c: u32 }
}

/// Gradients (AdamW: parameters) one dispatch takes (`SLOTS` in
/// update.wgsl): the per-slot arrays of its parameters fill a uniform buffer.
/// The slots' values lie in one buffer each (the gradients and, for AdamW,
/// the parameters and both moments laid out alike), so that the bindings
/// stay within WebGPU's least of 8 storage buffers whatever the count.
pub const SLOTS: usize = 128;

gpu_params! {
    /// `update.wgsl` `CheckParams`: up to [`SLOTS`] gradients of `n`
    /// elements from `off` in one buffer, times the f32 `c` (bits), in chunks
    /// of `chunk`, `end` the running count of their chunks, their partials
    /// written from `offset` (a uniform buffer).
    pub struct CheckParams {
        c: u32,
        chunk: u32,
        offset: u32,
        _pad: u32,
        off: [u32; SLOTS],
        n: [u32; SLOTS],
        end: [u32; SLOTS],
    }
}

gpu_params! {
    /// `update.wgsl` `AdamWParams`: [`AdamWConsts`] as f32 bits (the step
    /// size and the bias correction per slot); `zero` is 0 (the kernel's
    /// opaque zero, see `sep` in math.wgsl); per slot, the offset of its
    /// parameter, moments and gradient and the running count of elements to
    /// its end (a uniform buffer, from a 16-byte boundary).
    pub struct AdamWParams {
        decay: u32,
        beta1: u32,
        omb1: u32,
        beta2: u32,
        omb2: u32,
        eps: u32,
        scale_grad: u32,
        grad_scale: u32,
        zero: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
        off: [u32; SLOTS],
        end: [u32; SLOTS],
        step_size: [u32; SLOTS],
        bc2_sqrt: [u32; SLOTS],
    }
}

gpu_params! {
    /// `update.wgsl` `SgdParams` (f32 bits; `first` 1 on the first momentum step).
    pub struct SgdParams { n: u32, lr: u32, momentum: u32, wd: u32, first: u32 }
}

pub const FAMILY: Family = Family {
    name: "update",
    sources: &[include_str!("../../../shaders/update.wgsl")],
    needs_math: true,
    consts: no_consts,
    entries: &[
        "scale_in_place",
        "finite_check_unscale",
        "adamw_step",
        "sgd_step",
        "sgd_momentum_step",
    ],
    params: &[
        ScaleParams::LAYOUT,
        CheckParams::LAYOUT,
        AdamWParams::LAYOUT,
        SgdParams::LAYOUT,
    ],
};

const CHECK: Kernel = Kernel::new(&FAMILY, "finite_check_unscale");
const SGD: Kernel = Kernel::new(&FAMILY, "sgd_step");
const SGD_MOMENTUM: Kernel = Kernel::new(&FAMILY, "sgd_momentum_step");

/// A `PER_LANE` kernel specialised for this adapter, and its grid for `n` elements.
fn per_lane(entry: &'static str, n: usize) -> Result<(Kernel, (u32, u32, u32))> {
    let lanes = ctx()?.update_per_lane;
    Ok((
        Kernel::new(&FAMILY, entry).with("PER_LANE", lanes),
        grid1d(n.div_ceil(lanes as usize)),
    ))
}

/// One AdamW dispatch over `group` (at most [`SLOTS`], laid out as
/// [`UpdateOps::adamw_many`] groups them), bound from the first item's views.
fn adamw_slots(group: &[AdamWItem<'_, GpuStorage>]) -> Result<()> {
    let first = &group[0];
    let k = &first.c;
    let (mut off, mut end, mut step_size, mut bc2_sqrt) = ([0u32; SLOTS], [0u32; SLOTS], [0u32; SLOTS], [0u32; SLOTS]);
    let mut total = 0usize;
    for s in 0..SLOTS {
        if let Some(it) = group.get(s) {
            let at = it.p.offset_from(first.p).expect("grouped items share the parameters' buffer");
            off[s] = u32_of(at, "offset")?;
            total += it.p.len();
            step_size[s] = it.c.step_size.to_bits();
            bc2_sqrt[s] = it.c.bc2_sqrt.to_bits();
        }
        end[s] = u32_of(total, "length")?;
    }
    let (kernel, grid) = per_lane("adamw_step", total)?;
    let prm = AdamWParams {
        decay: k.decay.to_bits(),
        beta1: k.beta1.to_bits(),
        omb1: k.omb1.to_bits(),
        beta2: k.beta2.to_bits(),
        omb2: k.omb2.to_bits(),
        eps: k.eps.to_bits(),
        scale_grad: k.grad_scale.is_some() as u32,
        grad_scale: k.grad_scale.unwrap_or(1.0).to_bits(),
        zero: 0,
        _pad0: 0,
        _pad1: 0,
        _pad2: 0,
        off,
        end,
        step_size,
        bc2_sqrt,
    };
    let bind = [first.p.bind(), first.m.bind(), first.v.bind(), first.g.bind()];
    ctx()?.dispatch(&kernel, &prm, &bind, grid)
}

impl UpdateOps for GpuStorage {
    /// One kernel per run of up to [`SLOTS`] buffers that lie in one buffer
    /// (the trainer lays the gradients out so: one dispatch), all OR-ing into
    /// ONE 4-byte flag and writing their chunk partials into one buffer, in
    /// order; both read back once, with `also`.
    fn finite_check_unscale(
        bufs: &[&GpuStorage],
        inv_scale: f32,
        also: &[&GpuStorage],
    ) -> Result<(bool, Vec<f32>, Vec<f64>)> {
        let c = ctx()?;
        let f32s = |b: Vec<u8>| -> Vec<f32> {
            b.chunks_exact(4).map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect()
        };
        // `also`'s values, after whatever `parts` reads first: one readback
        let also_parts = also.iter().map(|a| (a.bind(), 4 * a.len() as u64));
        let chunks: usize = bufs.iter().map(|b| b.len().div_ceil(NORM_CHUNK)).sum();
        if chunks == 0 {
            let got = c.read_many(&also_parts.collect::<Vec<_>>())?;
            return Ok((true, Vec::new(), got.into_iter().flat_map(f32s).map(f64::from).collect()));
        }
        // A fresh buffer is zero-initialised by wgpu.
        let flag = c.buffer_with(&[0u8; 4]);
        let partials = GpuStorage::alloc(c, chunks)?;
        let full: Vec<&GpuStorage> = bufs.iter().copied().filter(|b| !b.is_empty()).collect();
        let mut offset = 0;
        let mut rest = &full[..];
        while let Some(first) = rest.first() {
            // the gradients after the first in its buffer, past its start
            let take = 1 + rest[1..rest.len().min(SLOTS)]
                .iter()
                .take_while(|b| b.offset_from(first).is_some())
                .count();
            let (group, later) = rest.split_at(take);
            rest = later;
            // offsets, lengths and running chunk counts; unused slots empty,
            // ending with the last gradient
            let (mut off, mut n, mut end, mut chunks) = ([0u32; SLOTS], [0u32; SLOTS], [0u32; SLOTS], 0);
            for s in 0..SLOTS {
                if let Some(b) = group.get(s) {
                    off[s] = u32_of(b.offset_from(first).expect("grouped above"), "offset")?;
                    n[s] = u32_of(b.len(), "length")?;
                    chunks += b.len().div_ceil(NORM_CHUNK);
                }
                end[s] = u32_of(chunks, "chunks")?;
            }
            let prm = CheckParams {
                c: inv_scale.to_bits(),
                chunk: NORM_CHUNK as u32,
                offset: u32_of(offset, "offset")?,
                _pad: 0,
                off,
                n,
                end,
            };
            let bind = [(&flag).into(), partials.bind(), first.bind()];
            c.dispatch(&CHECK, &prm, &bind, grid1d(chunks))?;
            offset += chunks;
        }
        let mut parts = vec![((&flag).into(), 4), (partials.bind(), 4 * chunks as u64)];
        parts.extend(also_parts);
        let mut got = c.read_many(&parts)?.into_iter();
        let v = got.next().unwrap_or_default();
        let finite = u32::from_le_bytes([v[0], v[1], v[2], v[3]]) == 0;
        let partials = got.next().map_or_else(Vec::new, f32s);
        let values = got.flat_map(f32s).map(f64::from).collect();
        Ok((finite, partials, values))
    }

    fn scale_in_place(&self, s: f32) -> Result<()> {
        let (k, grid) = per_lane("scale_in_place", self.len())?;
        let prm = ScaleParams {
            n: u32_of(self.len(), "length")?,
            c: s.to_bits(),
        };
        ctx()?.dispatch(&k, &prm, &[self.bind()], grid)
    }

    fn adamw_step(&self, g: &GpuStorage, m: &GpuStorage, v: &GpuStorage, c: &AdamWConsts) -> Result<()> {
        GpuStorage::adamw_many(&[AdamWItem { p: self, g, m, v, c: *c }])
    }

    /// Up to [`SLOTS`] consecutive items a dispatch, while their parameters
    /// lie in one buffer, their first moments, second moments and gradients
    /// in three others, all four laid out alike (each item's at one offset
    /// from the first item's), and the constants other than the step size
    /// and the bias correction agree.
    fn adamw_many(items: &[AdamWItem<'_, GpuStorage>]) -> Result<()> {
        let mut rest = items;
        while let Some(first) = rest.first() {
            let joins = |it: &AdamWItem<'_, GpuStorage>| {
                let at = it.p.offset_from(first.p);
                at.is_some()
                    && at == it.m.offset_from(first.m)
                    && at == it.v.offset_from(first.v)
                    && at == it.g.offset_from(first.g)
                    && {
                    let (a, b) = (&it.c, &first.c);
                    (a.decay, a.beta1, a.omb1, a.beta2, a.omb2, a.eps, a.grad_scale)
                        == (b.decay, b.beta1, b.omb1, b.beta2, b.omb2, b.eps, b.grad_scale)
                }
            };
            let n = 1 + rest[1..rest.len().min(SLOTS)].iter().take_while(|it| joins(it)).count();
            adamw_slots(&rest[..n])?;
            rest = &rest[n..];
        }
        Ok(())
    }

    fn sgd_step(
        &self,
        g: &GpuStorage,
        buf: Option<&GpuStorage>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()> {
        let c = ctx()?;
        let prm = SgdParams {
            n: u32_of(self.len(), "length")?,
            lr: lr.to_bits(),
            momentum: momentum.to_bits(),
            wd: wd.to_bits(),
            first: first as u32,
        };
        let grid = grid1d(self.len());
        match buf {
            None => c.dispatch(&SGD, &prm, &[self.bind(), g.bind()], grid),
            Some(b) => c.dispatch(&SGD_MOMENTUM, &prm, &[self.bind(), g.bind(), b.bind()], grid),
        }
    }
}
