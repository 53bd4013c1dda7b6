//! The GPU launchers of the reductions (`reduce.wgsl`).

use super::{ReduceOp, ReduceOps, NORM_CHUNK};
use crate::backend::gpu::context::{ctx, Context};
use crate::backend::gpu::pipelines::{gpu_params, Family, Kernel};
use crate::backend::gpu::variant::Kernels;
use crate::backend::gpu::{grid1d, u32_of, GpuStorage, LOOP_PASS};
use crate::{bail, Result};

gpu_params! {
    /// `reduce.wgsl` `ReduceParams`: x: (outer, r, inner) -> y: (outer, inner),
    /// this pass covering k in `[k0, k1)`.
    pub struct ReduceParams { outer: u32, r: u32, inner: u32, op: u32, k0: u32, k1: u32 }
}

gpu_params! {
    /// `reduce.wgsl` `RowsParams`: softmax over `rows` rows of `n`, of the
    /// values times `scale` (f32 bits), causally masked when `causal` is 1.
    pub struct RowsParams { rows: u32, n: u32, scale: u32, causal: u32 }
}

gpu_params! {
    /// `reduce.wgsl` `ChunkParams`: one buffer's chunk partials, written from `offset`.
    pub struct ChunkParams { n: u32, chunk: u32, offset: u32 }
}

pub const FAMILY: Family = Family {
    name: "reduce",
    sources: &[include_str!("../../../shaders/reduce.wgsl")],
    needs_math: true,
    consts: super::wgsl_consts,
    entries: &[
        "reduce",
        "softmax_rows",
        "softmax_rows_backward",
        "softmax_rows_staged",
        "softmax_rows_backward_staged",
        "chunk_sum_squares",
    ],
    params: &[
        ReduceParams::LAYOUT,
        RowsParams::LAYOUT,
        ChunkParams::LAYOUT,
    ],
};

const REDUCE: Kernel = Kernel::new(&FAMILY, "reduce");
const SOFTMAX: Kernel = Kernel::new(&FAMILY, "softmax_rows");
const SOFTMAX_BACKWARD: Kernel = Kernel::new(&FAMILY, "softmax_rows_backward");
const SOFTMAX_STAGED: Kernel = Kernel::new(&FAMILY, "softmax_rows_staged");
const SOFTMAX_BACKWARD_STAGED: Kernel = Kernel::new(&FAMILY, "softmax_rows_backward_staged");
const CHUNK_SUM_SQUARES: Kernel = Kernel::new(&FAMILY, "chunk_sum_squares");

/// Softmax rows run as one fused loop nest per row (`per_n` loop iterations
/// per element of a row: 3 forward, 2 backward; the staged hardware variant
/// 6 and 4); on a device that caps shader loops (lavapipe) a row that long
/// would be cut short silently, so it is refused instead.
fn check_row_loops(c: &Context, what: &str, n: usize, per_n: usize) -> Result<()> {
    if c.info.name.contains("llvmpipe") && per_n * n > 60_000 {
        bail!(
            Device,
            "{what} over rows of {n} elements exceeds the loop limit of this software device ({}: 65,535 shader loop iterations)",
            c.info.name
        );
    }
    Ok(())
}

/// The softmax kernels of `variant`: (forward, backward), and their loop
/// iterations per element of a row (see [`check_row_loops`]).
pub fn softmax_kernels(variant: Kernels) -> ((Kernel, usize), (Kernel, usize)) {
    match variant {
        Kernels::Software => ((SOFTMAX, 3), (SOFTMAX_BACKWARD, 2)),
        Kernels::Hardware => ((SOFTMAX_STAGED, 6), (SOFTMAX_BACKWARD_STAGED, 4)),
    }
}

impl ReduceOps for GpuStorage {
    fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<GpuStorage> {
        let c = ctx()?;
        let n = outer * inner;
        let out = GpuStorage::alloc(c, n)?;
        // Passes of at most LOOP_PASS steps each (see reduce.wgsl); at least one.
        let mut k0 = 0;
        loop {
            let k1 = (k0 + LOOP_PASS).min(r);
            let prm = ReduceParams {
                outer: u32_of(outer, "outer")?,
                r: u32_of(r, "r")?,
                inner: u32_of(inner, "inner")?,
                op: op.code(),
                k0: k0 as u32,
                k1: k1 as u32,
            };
            c.dispatch(&REDUCE, &prm, &[self.bind(), out.bind()], grid1d(n))?;
            k0 = k1;
            if k0 >= r {
                break;
            }
        }
        Ok(out)
    }

    /// One invocation per row (the software variant), or a workgroup per 64
    /// rows (the hardware one): the same grid.
    fn softmax_rows(&self, rows: usize, n: usize, scale: f32, causal: bool) -> Result<GpuStorage> {
        let c = ctx()?;
        let ((kernel, per_n), _) = softmax_kernels(Kernels::of(c));
        check_row_loops(c, "softmax", n, per_n)?;
        let out = GpuStorage::alloc(c, rows * n)?;
        if n == 0 {
            return Ok(out);
        }
        let prm = RowsParams {
            rows: u32_of(rows, "rows")?,
            n: u32_of(n, "n")?,
            scale: scale.to_bits(),
            causal: causal as u32,
        };
        c.dispatch(&kernel, &prm, &[self.bind(), out.bind()], grid1d(rows))?;
        Ok(out)
    }

    fn softmax_rows_backward(
        &self,
        g: &GpuStorage,
        rows: usize,
        n: usize,
        scale: f32,
    ) -> Result<GpuStorage> {
        let c = ctx()?;
        let (_, (kernel, per_n)) = softmax_kernels(Kernels::of(c));
        check_row_loops(c, "softmax backward", n, per_n)?;
        let out = GpuStorage::alloc(c, rows * n)?;
        if n == 0 {
            return Ok(out);
        }
        let prm = RowsParams {
            rows: u32_of(rows, "rows")?,
            n: u32_of(n, "n")?,
            scale: scale.to_bits(),
            causal: 0,
        };
        c.dispatch(
            &kernel,
            &prm,
            &[self.bind(), g.bind(), out.bind()],
            grid1d(rows),
        )?;
        Ok(out)
    }

    /// Every buffer's partials land in one device buffer, read back once.
    fn chunk_sum_squares(bufs: &[&GpuStorage]) -> Result<Vec<f32>> {
        let total: usize = bufs.iter().map(|b| b.len().div_ceil(NORM_CHUNK)).sum();
        if total == 0 {
            return Ok(Vec::new());
        }
        let c = ctx()?;
        let partials = GpuStorage::alloc(c, total)?;
        let mut offset = 0usize;
        for b in bufs {
            let chunks = b.len().div_ceil(NORM_CHUNK);
            if chunks == 0 {
                continue;
            }
            let prm = ChunkParams {
                n: u32_of(b.len(), "n")?,
                chunk: NORM_CHUNK as u32,
                offset: u32_of(offset, "offset")?,
            };
            c.dispatch(
                &CHUNK_SUM_SQUARES,
                &prm,
                &[b.bind(), partials.bind()],
                grid1d(chunks),
            )?;
            offset += chunks;
        }
        partials.download()
    }
}
