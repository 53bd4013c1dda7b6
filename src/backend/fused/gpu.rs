//! The GPU launchers of the fused primitives (`fused.wgsl`).

use super::{swiglu_then_product, CeKept, FusedOps, Kept, SwigluProduct};
use crate::backend::gpu::context::{ctx, Context};
use crate::backend::gpu::pipelines::{gpu_params, no_consts, Family, Kernel};
use crate::backend::gpu::variant::Kernels;
use crate::backend::gpu::{grid1d, u32_of, GpuStorage, LOOP_PASS};
use crate::backend::matmul::{Halves, MatmulDims};
use crate::backend::pack::PackOps;
use crate::backend::round::{fmt_code, Format};
use crate::backend::MAX_DIMS;
use crate::{bail, Result};

gpu_params! {
    /// `fused.wgsl` `NormParams`: RMSNorm over `rows` rows of `d`; `d_f` and
    /// `eps` are f32 bits; `zero` is 0 (the kernels' opaque zero, see `sep`).
    pub struct NormParams { rows: u32, d: u32, d_f: u32, eps: u32, zero: u32 }
}

gpu_params! {
    /// `fused.wgsl` `NormBackParams` (a uniform buffer): RMSNorm's backward
    /// over `rows` rows of `d`, adding into an earlier gradient when
    /// `earlier` is 1; the workgroups past `row_groups` fold the weight's
    /// gradient over every row as `DwParams` says (`earlier_dw`: add into
    /// its earlier gradient; `spans` padded to two `vec4`s).
    pub struct NormBackParams {
        rows: u32,
        d: u32,
        d_f: u32,
        earlier: u32,
        zero: u32,
        row_groups: u32,
        levels: u32,
        earlier_dw: u32,
        spans: [u32; 8],
    }
}

gpu_params! {
    /// `fused.wgsl` `DwParams`: RMSNorm's weight gradient over rows `[r0, r1)`
    /// of `rows`, nested over `levels` folds of `spans` rows each.
    pub struct DwParams {
        rows: u32,
        d: u32,
        levels: u32,
        r0: u32,
        r1: u32,
        zero: u32,
        earlier: u32,
        _pad1: u32,
        spans: [u32; MAX_DIMS],
    }
}

gpu_params! {
    /// `fused.wgsl` `EltParams`: `n` elements.
    pub struct EltParams { n: u32, zero: u32, keep: u32, _pad: u32 }
}

gpu_params! {
    /// `fused.wgsl` `SwigluBackParams`: `n` elements, the FMT_* codes of
    /// the gate and up when kept in 16-bit storage (0: float32).
    pub struct SwigluBackParams { n: u32, zero: u32, gate_half: u32, up_half: u32 }
}

gpu_params! {
    /// `fused.wgsl` `RopeParams`: `n = rows·d` elements, tables of `t`
    /// positions, `heads` rows per position.
    pub struct RopeParams { n: u32, t: u32, d: u32, heads: u32, zero: u32 }
}

gpu_params! {
    /// `fused.wgsl` `CeParams`: `rows` rows of `v` logits; `rows_f` f32 bits;
    /// `keep` the FMT_* code of the words the keeping entries write.
    pub struct CeParams { rows: u32, v: u32, rows_f: u32, zero: u32, keep: u32 }
}

gpu_params! {
    /// `fused.wgsl` `CeBackParams`: `CeParams`, and the FMT_* code of the
    /// logits kept in 16-bit storage (0: float32 values).
    pub struct CeBackParams { rows: u32, v: u32, rows_f: u32, zero: u32, x_half: u32 }
}

gpu_params! {
    /// `fused.wgsl` `CeSumParams`: this pass folds row losses `[k0, k1)`.
    pub struct CeSumParams { rows: u32, k0: u32, k1: u32, rows_f: u32 }
}

pub const FAMILY: Family = Family {
    name: "fused",
    sources: &[
        include_str!("../../../shaders/rope.wgsl"),
        include_str!("../../../shaders/fused.wgsl"),
    ],
    needs_math: true,
    consts: no_consts,
    entries: &[
        "rms_norm",
        "rms_norm_backward_rows",
        "rms_norm_backward_dw",
        "swiglu",
        "swiglu_backward",
        "rope",
        "rope_pair",
        "rope_backward",
        "rope_backward_pair",
        "cross_entropy_rows",
        "cross_entropy_mean",
        "cross_entropy_backward",
        "rms_norm_staged",
        "rms_norm_backward_rows_staged",
        "cross_entropy_rows_staged",
        "cross_entropy_mean_staged",
        "cross_entropy_backward_elems",
        "cross_entropy_rows_keeping",
        "cross_entropy_rows_staged_keeping",
    ],
    params: &[
        NormParams::LAYOUT,
        NormBackParams::LAYOUT,
        DwParams::LAYOUT,
        EltParams::LAYOUT,
        SwigluBackParams::LAYOUT,
        RopeParams::LAYOUT,
        CeParams::LAYOUT,
        CeBackParams::LAYOUT,
        CeSumParams::LAYOUT,
    ],
};

const RMS_NORM: Kernel = Kernel::new(&FAMILY, "rms_norm");
const RMS_NORM_BACKWARD_ROWS: Kernel = Kernel::new(&FAMILY, "rms_norm_backward_rows");
const RMS_NORM_BACKWARD_DW: Kernel = Kernel::new(&FAMILY, "rms_norm_backward_dw");
const SWIGLU: Kernel = Kernel::new(&FAMILY, "swiglu");
const SWIGLU_BACKWARD: Kernel = Kernel::new(&FAMILY, "swiglu_backward");
const ROPE: Kernel = Kernel::new(&FAMILY, "rope");
const ROPE_PAIR: Kernel = Kernel::new(&FAMILY, "rope_pair");
const ROPE_BACKWARD: Kernel = Kernel::new(&FAMILY, "rope_backward");
const ROPE_BACKWARD_PAIR: Kernel = Kernel::new(&FAMILY, "rope_backward_pair");
const CE_ROWS: Kernel = Kernel::new(&FAMILY, "cross_entropy_rows");
const CE_MEAN: Kernel = Kernel::new(&FAMILY, "cross_entropy_mean");
const CE_BACKWARD: Kernel = Kernel::new(&FAMILY, "cross_entropy_backward");
const RMS_NORM_STAGED: Kernel = Kernel::new(&FAMILY, "rms_norm_staged");
const RMS_NORM_BACKWARD_ROWS_STAGED: Kernel = Kernel::new(&FAMILY, "rms_norm_backward_rows_staged");
const CE_ROWS_STAGED: Kernel = Kernel::new(&FAMILY, "cross_entropy_rows_staged");
const CE_MEAN_STAGED: Kernel = Kernel::new(&FAMILY, "cross_entropy_mean_staged");
const CE_BACKWARD_ELEMS: Kernel = Kernel::new(&FAMILY, "cross_entropy_backward_elems");
const CE_ROWS_KEEPING: Kernel = Kernel::new(&FAMILY, "cross_entropy_rows_keeping");
const CE_ROWS_STAGED_KEEPING: Kernel = Kernel::new(&FAMILY, "cross_entropy_rows_staged_keeping");

/// One dispatch's kernel and grid.
pub type Launch = (Kernel, (u32, u32, u32));

/// The row kernels' dispatches for `rows` rows of `width` (`variant`'s
/// kernels, the grids the launchers below record; the mean's first pass):
/// RMSNorm forward, its backward's rows, the cross-entropy's rows, its mean
/// and its backward.
pub fn row_launches(variant: Kernels, rows: usize, width: usize) -> [Launch; 5] {
    match variant {
        Kernels::Software => [
            (RMS_NORM, grid1d(rows)),
            (RMS_NORM_BACKWARD_ROWS, norm_backward_grid(rows, width)),
            (CE_ROWS, grid1d(rows)),
            (CE_MEAN, (1, 1, 1)),
            (CE_BACKWARD, grid1d(rows)),
        ],
        Kernels::Hardware => [
            (RMS_NORM_STAGED, grid1d(rows)),
            (RMS_NORM_BACKWARD_ROWS_STAGED, norm_backward_grid(rows, width)),
            (CE_ROWS_STAGED, grid1d(rows)),
            (CE_MEAN_STAGED, (1, 1, 1)),
            (CE_BACKWARD_ELEMS, grid1d(rows * width)),
        ],
    }
}

/// RMSNorm's backward in one dispatch: the rows' workgroups, then those
/// of the weight gradient's `d` columns.
fn norm_backward_grid(rows: usize, d: usize) -> (u32, u32, u32) {
    grid1d((rows.div_ceil(64) + d.div_ceil(64)) * 64)
}

/// Loop iterations per element of a row, of the software kernels and of the
/// staged ones (two per element and fold: staging, folding).
fn row_loops(variant: Kernels, software: usize, folds: usize) -> usize {
    match variant {
        Kernels::Software => software,
        Kernels::Hardware => 2 * folds + 2,
    }
}

/// The row kernels run each row as one invocation's loops; on a device that
/// caps shader loops (lavapipe) a row that long would be cut short silently,
/// so it is refused instead.
fn check_row_loops(c: &Context, what: &str, n: usize, loops: usize) -> Result<()> {
    if c.info.name.contains("llvmpipe") && n * loops > 60_000 {
        bail!(
            Device,
            "{what} over rows of {n} elements exceeds the loop limit of this software device ({}: 65,535 shader loop iterations)",
            c.info.name
        );
    }
    Ok(())
}

/// `n` as the f32 the CPU's `T::from_f64(n as f64)` gives, as bits.
fn f32_bits_of(n: usize) -> u32 {
    (n as f64 as f32).to_bits()
}

impl FusedOps for GpuStorage {
    /// One invocation per row.
    fn rms_norm(&self, w: &GpuStorage, rows: usize, d: usize, eps: f64) -> Result<(GpuStorage, GpuStorage)> {
        let c = ctx()?;
        let variant = Kernels::of(c);
        check_row_loops(c, "rms_norm", d, row_loops(variant, 2, 1))?;
        let (y, rstd) = (GpuStorage::alloc(c, rows * d)?, GpuStorage::alloc(c, rows)?);
        let prm = NormParams {
            rows: u32_of(rows, "rows")?,
            d: u32_of(d, "d")?,
            d_f: f32_bits_of(d),
            eps: (eps as f32).to_bits(),
            zero: 0,
        };
        let (kernel, groups) = row_launches(variant, rows, d)[0];
        c.dispatch(&kernel, &prm, &[self.bind(), w.bind(), y.bind(), rstd.bind()], groups)?;
        Ok((y, rstd))
    }

    /// `dx`: one invocation per row (or a workgroup's lanes); `dw`: one per
    /// column, in the same dispatch where every row fits one pass, else in
    /// passes of its own.
    fn rms_norm_backward(
        &self,
        w: &GpuStorage,
        rstd: &GpuStorage,
        g: &GpuStorage,
        ex: Option<&GpuStorage>,
        ew: Option<&GpuStorage>,
        spans: &[usize],
        d: usize,
        want_dx: bool,
        want_dw: bool,
    ) -> Result<(Option<GpuStorage>, Option<GpuStorage>)> {
        let c = ctx()?;
        let rows = rstd.len();
        if want_dw && spans.len() > MAX_DIMS {
            bail!(Shape, "rms_norm backward: at most {MAX_DIMS} leading axes");
        }
        let mut sp = [1u32; 8];
        for (s, &v) in sp.iter_mut().zip(spans) {
            *s = u32_of(v, "rows")?;
        }
        // without an earlier gradient the kernels read none: g stands in
        let (e, e_dw) = (ex.unwrap_or(g), ew.unwrap_or(g));
        let dw_along = want_dw && rows <= LOOP_PASS;
        let (mut dx, mut dw) = (None, None);
        if want_dx || dw_along {
            let variant = Kernels::of(c);
            if want_dx {
                check_row_loops(c, "rms_norm backward", d, row_loops(variant, 2, 1))?;
                dx = Some(GpuStorage::alloc(c, rows * d)?);
            }
            if dw_along {
                dw = Some(GpuStorage::alloc(c, d)?);
            }
            // an output not made binds a value of its own: two writable
            // bindings of one buffer are refused
            let spare = match (&dx, &dw) {
                (Some(_), Some(_)) => None,
                _ => Some(GpuStorage::alloc(c, 1)?),
            };
            let row_groups = if want_dx { rows.div_ceil(64) } else { 0 };
            let dw_groups = if dw_along { d.div_ceil(64) } else { 0 };
            let prm = NormBackParams {
                rows: u32_of(rows, "rows")?,
                d: u32_of(d, "d")?,
                d_f: f32_bits_of(d),
                earlier: u32::from(ex.is_some()),
                zero: 0,
                row_groups: u32_of(row_groups, "rows")?,
                levels: spans.len() as u32,
                earlier_dw: u32::from(ew.is_some()),
                spans: sp,
            };
            let (kernel, _) = row_launches(variant, rows, d)[1];
            let out_dx = dx.as_ref().or(spare.as_ref()).expect("dx or a spare");
            let out_dw = dw.as_ref().or(spare.as_ref()).expect("dw or a spare");
            let bufs = [self.bind(), w.bind(), rstd.bind(), g.bind(), e.bind(), out_dx.bind(), out_dw.bind(), e_dw.bind()];
            c.dispatch(&kernel, &prm, &bufs, grid1d((row_groups + dw_groups) * 64))?;
        }
        if want_dw && !dw_along {
            let out = GpuStorage::alloc(c, d)?;
            let state = GpuStorage::alloc(c, MAX_DIMS * d)?;
            let mut sp6 = [1u32; MAX_DIMS];
            sp6.copy_from_slice(&sp[..MAX_DIMS]);
            // passes of at most LOOP_PASS rows
            let mut r0 = 0;
            while r0 < rows {
                let r1 = (r0 + LOOP_PASS).min(rows);
                let prm = DwParams {
                    rows: u32_of(rows, "rows")?,
                    d: u32_of(d, "d")?,
                    levels: spans.len() as u32,
                    r0: r0 as u32,
                    r1: r1 as u32,
                    zero: 0,
                    earlier: u32::from(ew.is_some()),
                    _pad1: 0,
                    spans: sp6,
                };
                c.dispatch(
                    &RMS_NORM_BACKWARD_DW,
                    &prm,
                    &[self.bind(), rstd.bind(), g.bind(), state.bind(), out.bind(), e_dw.bind()],
                    grid1d(d),
                )?;
                r0 = r1;
            }
            dw = Some(out);
        }
        Ok((dx, dw))
    }

    fn swiglu(&self, up: &GpuStorage) -> Result<GpuStorage> {
        let c = ctx()?;
        let n = self.len();
        let y = GpuStorage::alloc(c, n)?;
        let prm = EltParams {
            n: u32_of(n, "length")?,
            zero: 0,
            keep: 0,
            _pad: 0,
        };
        c.dispatch(&SWIGLU, &prm, &[self.bind(), up.bind(), y.bind(), y.bind(), y.bind()], grid1d(n))?;
        Ok(y)
    }

    /// The same dispatch, writing the words too.
    fn swiglu_keeping(&self, up: &GpuStorage, keep: Format) -> Result<Kept<GpuStorage>> {
        let c = ctx()?;
        let n = self.len();
        let y = GpuStorage::alloc(c, n)?;
        let (wg, wu) = (GpuStorage::alloc(c, n.div_ceil(2))?, GpuStorage::alloc(c, n.div_ceil(2))?);
        let prm = EltParams {
            n: u32_of(n, "length")?,
            zero: 0,
            keep: fmt_code(Some(keep)),
            _pad: 0,
        };
        c.dispatch(&SWIGLU, &prm, &[self.bind(), up.bind(), y.bind(), wg.bind(), wu.bind()], grid1d(n))?;
        Ok((y, [(wg, None), (wu, None)]))
    }

    /// One dispatch where the product can compute SwiGLU as it loads A
    /// (`GpuStorage::swiglu_product`); the two primitives otherwise.
    fn swiglu_matmul(
        &self,
        up: &GpuStorage,
        rhs: &GpuStorage,
        d: MatmulDims,
        round: Option<Format>,
        addend: Option<&GpuStorage>,
        keep: Option<Format>,
    ) -> Result<SwigluProduct<GpuStorage>> {
        match self.swiglu_product(up, rhs, d, round, addend, keep)? {
            Some((c, words)) => Ok((c, words.map(|w| w.map(|w| (w, None))))),
            None => swiglu_then_product(self, up, rhs, d, round, addend, keep),
        }
    }

    fn swiglu_backward(&self, up: &GpuStorage, g: &GpuStorage, halves: Halves) -> Result<(GpuStorage, GpuStorage)> {
        let c = ctx()?;
        let n = g.len();
        let (dg, du) = (GpuStorage::alloc(c, n)?, GpuStorage::alloc(c, n)?);
        let prm = SwigluBackParams {
            n: u32_of(n, "length")?,
            zero: 0,
            gate_half: fmt_code(halves.a),
            up_half: fmt_code(halves.b),
        };
        c.dispatch(
            &SWIGLU_BACKWARD,
            &prm,
            &[self.bind(), up.bind(), g.bind(), dg.bind(), du.bind()],
            grid1d(n),
        )?;
        Ok((dg, du))
    }

    fn rope(&self, cos: &GpuStorage, sin: &GpuStorage, t: usize, d: usize, heads: usize) -> Result<GpuStorage> {
        rope_launch(&ROPE, self, cos, sin, (t, d, heads))
    }

    /// Both in one dispatch.
    fn rope_pair(
        &self,
        other: &GpuStorage,
        cos: &GpuStorage,
        sin: &GpuStorage,
        (t, d, heads): (usize, usize, usize),
    ) -> Result<(GpuStorage, GpuStorage)> {
        rope_pair_launch(&ROPE_PAIR, [self, other], cos, sin, (t, d, heads))
    }

    fn rope_backward(&self, cos: &GpuStorage, sin: &GpuStorage, t: usize, d: usize, heads: usize) -> Result<GpuStorage> {
        rope_launch(&ROPE_BACKWARD, self, cos, sin, (t, d, heads))
    }

    /// Both in one dispatch.
    fn rope_backward_pair(
        &self,
        other: &GpuStorage,
        cos: &GpuStorage,
        sin: &GpuStorage,
        (t, d, heads): (usize, usize, usize),
    ) -> Result<(GpuStorage, GpuStorage)> {
        rope_pair_launch(&ROPE_BACKWARD_PAIR, [self, other], cos, sin, (t, d, heads))
    }

    /// One invocation per row, then one that folds the row losses in order
    /// (the hardware variant: a workgroup per 64 rows, then one workgroup).
    fn cross_entropy(&self, targets: &[u32], v: usize) -> Result<(GpuStorage, GpuStorage)> {
        cross_entropy_launch(self, targets, v, None)
    }

    /// The same dispatches, the rows' writing the words too where `v` is
    /// even (no word spans two rows); else the forward, then the pack.
    fn cross_entropy_keeping(&self, targets: &[u32], v: usize, keep: Format) -> Result<CeKept<GpuStorage>> {
        if !v.is_multiple_of(2) || targets.is_empty() {
            return Ok((self.cross_entropy(targets, v)?, PackOps::pack(self, keep)?));
        }
        let words = GpuStorage::alloc(ctx()?, targets.len() * v / 2)?;
        let ce = cross_entropy_launch(self, targets, v, Some((keep, &words)))?;
        Ok((ce, (words, None)))
    }

    /// One invocation per row (or per element); kept 16-bit logits read as kept.
    fn cross_entropy_backward(
        &self,
        half: Option<Format>,
        targets: &[u32],
        stats: &GpuStorage,
        g: &GpuStorage,
        v: usize,
    ) -> Result<GpuStorage> {
        let c = ctx()?;
        let variant = Kernels::of(c);
        // the hardware kernel is elementwise: no loop over the row
        check_row_loops(c, "cross_entropy backward", v, usize::from(variant == Kernels::Software))?;
        let rows = targets.len();
        let dx = GpuStorage::alloc(c, rows * v)?;
        if rows * v == 0 {
            return Ok(dx);
        }
        let prm = CeBackParams {
            rows: u32_of(rows, "rows")?,
            v: u32_of(v, "v")?,
            rows_f: f32_bits_of(rows),
            zero: 0,
            x_half: fmt_code(half),
        };
        let ids = c.buffer_with(bytemuck::cast_slice(targets));
        let (kernel, groups) = row_launches(variant, rows, v)[4];
        c.dispatch(&kernel, &prm, &[self.bind(), (&ids).into(), stats.bind(), g.bind(), dx.bind()], groups)?;
        Ok(dx)
    }
}

/// The cross-entropy's dispatches over the logits `x`; with `keep`, the rows'
/// kernel also writes them as 16-bit words of that format into its buffer.
fn cross_entropy_launch(
    x: &GpuStorage,
    targets: &[u32],
    v: usize,
    keep: Option<(Format, &GpuStorage)>,
) -> Result<(GpuStorage, GpuStorage)> {
    let c = ctx()?;
    let variant = Kernels::of(c);
    check_row_loops(c, "cross_entropy", v, row_loops(variant, 2, 2))?;
    let rows = targets.len();
    let launches = row_launches(variant, rows, v);
    let (loss, stats) = (GpuStorage::alloc(c, 1)?, GpuStorage::alloc(c, 2 * rows)?);
    let rowloss = GpuStorage::alloc(c, rows)?;
    let prm = CeParams {
        rows: u32_of(rows, "rows")?,
        v: u32_of(v, "v")?,
        rows_f: f32_bits_of(rows),
        zero: 0,
        keep: fmt_code(keep.map(|(f, _)| f)),
    };
    if rows > 0 {
        let ids = c.buffer_with(bytemuck::cast_slice(targets));
        let (kernel, groups) = launches[2];
        let mut bufs = vec![x.bind(), (&ids).into(), stats.bind(), rowloss.bind()];
        let kernel = match keep {
            Some((_, words)) => {
                bufs.push(words.bind());
                match variant {
                    Kernels::Software => CE_ROWS_KEEPING,
                    Kernels::Hardware => CE_ROWS_STAGED_KEEPING,
                }
            }
            None => kernel,
        };
        c.dispatch(&kernel, &prm, &bufs, groups)?;
    }
    // Passes of at most LOOP_PASS rows, at least one (no rows: the mean of nothing).
    let mut k0 = 0;
    loop {
        let k1 = (k0 + LOOP_PASS).min(rows);
        let sp = CeSumParams {
            rows: prm.rows,
            k0: k0 as u32,
            k1: k1 as u32,
            rows_f: prm.rows_f,
        };
        let (kernel, groups) = launches[3];
        c.dispatch(&kernel, &sp, &[rowloss.bind(), loss.bind()], groups)?;
        k0 = k1;
        if k0 >= rows {
            break;
        }
    }
    Ok((loss, stats))
}

/// RoPE either way: one invocation per element.
fn rope_launch(
    k: &Kernel,
    x: &GpuStorage,
    cos: &GpuStorage,
    sin: &GpuStorage,
    (t, d, heads): (usize, usize, usize),
) -> Result<GpuStorage> {
    let c = ctx()?;
    let n = x.len();
    let y = GpuStorage::alloc(c, n)?;
    let prm = rope_params(n, (t, d, heads))?;
    c.dispatch(k, &prm, &[x.bind(), cos.bind(), sin.bind(), y.bind()], grid1d(n))?;
    Ok(y)
}

/// `k` (`rope_pair` or `rope_backward_pair`) over two tensors of one
/// length: one dispatch, an invocation per element of either.
fn rope_pair_launch(
    k: &Kernel,
    [x0, x1]: [&GpuStorage; 2],
    cos: &GpuStorage,
    sin: &GpuStorage,
    (t, d, heads): (usize, usize, usize),
) -> Result<(GpuStorage, GpuStorage)> {
    let c = ctx()?;
    let n = x0.len();
    let (y0, y1) = (GpuStorage::alloc(c, n)?, GpuStorage::alloc(c, n)?);
    let prm = rope_params(n, (t, d, heads))?;
    let bind = [x0.bind(), x1.bind(), cos.bind(), sin.bind(), y0.bind(), y1.bind()];
    c.dispatch(k, &prm, &bind, grid1d(2 * n))?;
    Ok((y0, y1))
}

/// RoPE's parameters for `n` elements of each tensor.
fn rope_params(n: usize, (t, d, heads): (usize, usize, usize)) -> Result<RopeParams> {
    Ok(RopeParams {
        n: u32_of(n, "length")?,
        t: u32_of(t, "t")?,
        d: u32_of(d, "d")?,
        heads: u32_of(heads, "heads")?,
        zero: 0,
    })
}
