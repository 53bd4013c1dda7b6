//! The GPU launchers of the data movement primitives (`shaders/copy.wgsl`).

use super::CopyOps;
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::{grid1d, pad6, u32_of, GpuStorage, LOOP_PASS};
use crate::backend::MAX_DIMS;
use crate::Result;

gpu_params! {
    /// `copy.wgsl` `StridedParams`: the view's shape and strides, padded on the left.
    pub struct StridedParams {
        n: u32,
        offset: u32,
        _pad0: u32,
        _pad1: u32,
        shape: [u32; MAX_DIMS],
        strides: [u32; MAX_DIMS],
    }
}

gpu_params! {
    /// `copy.wgsl` `ConcatParams`: one part of `outer` rows of `seg` elements,
    /// written at `dst` of output rows of `row` elements.
    pub struct ConcatParams { outer: u32, seg: u32, row: u32, dst: u32 }
}

gpu_params! {
    /// `copy.wgsl` `GatherParams`: `count` rows of `d`.
    pub struct GatherParams { count: u32, d: u32 }
}

gpu_params! {
    /// `copy.wgsl` `ScatterParams`: this pass sums list entries
    /// `[rowptr[r] + skip, + chunk)` of each output row; `add` 1: it is the
    /// last, and stores the earlier gradient plus the sum.
    pub struct ScatterParams { v: u32, d: u32, skip: u32, chunk: u32, add: u32 }
}

pub const FAMILY: Family = Family {
    name: "copy",
    sources: &[include_str!("../../../shaders/copy.wgsl")],
    needs_math: false,
    consts: no_consts,
    entries: &["strided_copy", "concat_part", "gather_rows", "scatter_add_rows"],
    params: &[
        StridedParams::LAYOUT,
        ConcatParams::LAYOUT,
        GatherParams::LAYOUT,
        ScatterParams::LAYOUT,
    ],
};

const STRIDED_COPY: Kernel = Kernel::new(&FAMILY, "strided_copy");
const CONCAT_PART: Kernel = Kernel::new(&FAMILY, "concat_part");
const GATHER_ROWS: Kernel = Kernel::new(&FAMILY, "gather_rows");
const SCATTER_ADD_ROWS: Kernel = Kernel::new(&FAMILY, "scatter_add_rows");

impl CopyOps for GpuStorage {
    fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<GpuStorage> {
        let c = ctx()?;
        let n: usize = shape.iter().product();
        let out = GpuStorage::alloc(c, n)?;
        let (shape, strides) = pad6(shape, strides)?;
        let prm = StridedParams {
            n: u32_of(n, "length")?,
            offset: u32_of(offset, "offset")?,
            _pad0: 0,
            _pad1: 0,
            shape,
            strides,
        };
        c.dispatch(&STRIDED_COPY, &prm, &[self.bind(), out.bind()], grid1d(n))?;
        Ok(out)
    }

    /// One copy dispatch per part.
    fn concat(parts: &[&GpuStorage], outer: usize, sizes: &[usize], inner: usize) -> Result<GpuStorage> {
        let c = ctx()?;
        let total: usize = sizes.iter().sum();
        let out = GpuStorage::alloc(c, outer * total * inner)?;
        let mut dst = 0usize;
        for (p, &s) in parts.iter().zip(sizes) {
            let seg = s * inner;
            let prm = ConcatParams {
                outer: u32_of(outer, "outer")?,
                seg: u32_of(seg, "segment")?,
                row: u32_of(total * inner, "row")?,
                dst: u32_of(dst * inner, "offset")?,
            };
            c.dispatch(&CONCAT_PART, &prm, &[p.bind(), out.bind()], grid1d(outer * seg))?;
            dst += s;
        }
        Ok(out)
    }

    fn gather_rows(&self, ids: &[u32], d: usize) -> Result<GpuStorage> {
        let c = ctx()?;
        let n = ids.len() * d;
        let out = GpuStorage::alloc(c, n)?;
        if n == 0 {
            return Ok(out);
        }
        let idb = c.buffer_with(bytemuck::cast_slice(ids));
        let prm = GatherParams {
            count: u32_of(ids.len(), "ids")?,
            d: u32_of(d, "d")?,
        };
        c.dispatch(&GATHER_ROWS, &prm, &[self.bind(), (&idb).into(), out.bind()], grid1d(n))?;
        Ok(out)
    }

    /// Scatter-add rows into `(v, d)` without float atomics: the host builds,
    /// per output row, the ascending list of source rows (CSR), and each output
    /// element sums its list in order.
    fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize, e: Option<&GpuStorage>) -> Result<GpuStorage> {
        let c = ctx()?;
        let out = GpuStorage::alloc(c, v * d)?;
        if v * d == 0 {
            return Ok(out);
        }
        // Counting sort of i by ids[i]: stable, so each row's list ascends.
        let mut rowptr = vec![0u32; v + 1];
        for &i in ids {
            rowptr[i as usize + 1] += 1;
        }
        for r in 0..v {
            rowptr[r + 1] += rowptr[r];
        }
        let mut fill = rowptr.clone();
        let mut list = vec![0u32; ids.len()];
        for (i, &r) in ids.iter().enumerate() {
            list[fill[r as usize] as usize] = i as u32;
            fill[r as usize] += 1;
        }
        let rp = c.buffer_with(bytemuck::cast_slice(&rowptr));
        let ls = c.buffer_with(bytemuck::cast_slice(&list));
        // Rows with more contributions than LOOP_PASS take several passes (copy.wgsl).
        let longest = (0..v)
            .map(|r| (rowptr[r + 1] - rowptr[r]) as usize)
            .max()
            .unwrap_or(0);
        let mut skip = 0;
        loop {
            let prm = ScatterParams {
                v: u32_of(v, "v")?,
                d: u32_of(d, "d")?,
                skip: skip as u32,
                chunk: LOOP_PASS as u32,
                add: u32::from(e.is_some() && skip + LOOP_PASS >= longest),
            };
            // without an earlier gradient the kernel reads none: g stands in
            let e = e.unwrap_or(self);
            c.dispatch(
                &SCATTER_ADD_ROWS,
                &prm,
                &[self.bind(), (&rp).into(), (&ls).into(), out.bind(), e.bind()],
                grid1d(v * d),
            )?;
            skip += LOOP_PASS;
            if skip >= longest {
                break;
            }
        }
        Ok(out)
    }
}
