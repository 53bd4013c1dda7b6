//! The CPU reference of the fused primitives: each the composition's
//! operations in the composition's order (see the contract in `mod.rs`),
//! arranged so the loops vectorise — the sequential folds run four rows in
//! lockstep, the divisions of an elementwise loop a group of lanes at a time.

use super::{swiglu_then_product, FusedOps, SwigluProduct};
use crate::backend::cpu::pool;
use crate::backend::cpu::simd::LANES;
use crate::backend::cpu::{
    assume_init_mut, cpu_threads, fill, fold_ragged, maximum, new_vec, new_vecs, sigmoid_into, simd,
    write_exact, CpuStorage, Elem,
};
use crate::backend::matmul::{Halves, MatmulDims, MatmulOps};
use crate::backend::pack::PackOps;
use crate::backend::pack::widen_words;
use crate::backend::round::Format;
use crate::backend::DType;
use crate::Result;
use std::mem::MaybeUninit;

/// Rows (or elements) per thread for `items` of `len` values each: all of
/// them below [`pool::SPLIT_VALUES`] values or with one thread, else an even
/// share in whole groups of lanes. Rows and elements are independent of each
/// other, so the bits do not depend on the split.
fn per_thread(items: usize, len: usize) -> usize {
    let threads = cpu_threads();
    if items * len < pool::SPLIT_VALUES || threads == 1 || items < 2 {
        return items.max(1);
    }
    items.div_ceil(threads).next_multiple_of(LANES)
}

/// `by_dtype!(storage, T => expr)`: `expr` with `T` the storage's element
/// type (every buffer of a call shares it: the dispatch checked).
macro_rules! by_dtype {
    ($s:expr, $T:ident => $e:expr) => {
        match $s.dtype() {
            DType::F32 => {
                type $T = f32;
                $e
            }
            DType::F64 => {
                type $T = f64;
                $e
            }
        }
    };
}

impl FusedOps for CpuStorage {
    fn rms_norm(&self, w: &CpuStorage, rows: usize, d: usize, eps: f64) -> Result<(CpuStorage, CpuStorage)> {
        Ok(by_dtype!(self, T => {
            let (y, r) = rms_norm_t::<T>(&T::view(self), &T::view(w), rows, d, T::from_f64(eps));
            (T::wrap(y), T::wrap(r))
        }))
    }

    fn rms_norm_backward(
        &self,
        w: &CpuStorage,
        rstd: &CpuStorage,
        g: &CpuStorage,
        ex: Option<&CpuStorage>,
        ew: Option<&CpuStorage>,
        spans: &[usize],
        d: usize,
        want_dx: bool,
        want_dw: bool,
    ) -> Result<(Option<CpuStorage>, Option<CpuStorage>)> {
        Ok(by_dtype!(self, T => {
            let (x, w, r, g) = (T::view(self), T::view(w), T::view(rstd), T::view(g));
            let (ex, ew) = (ex.map(T::view), ew.map(T::view));
            let dx = want_dx.then(|| rms_norm_dx_t::<T>(&x, &w, &r, &g, ex.as_deref().map(Vec::as_slice), d));
            let dw = want_dw.then(|| {
                let mut dw = rms_norm_dw_t::<T>(&x, &r, &g, spans, d);
                if let Some(ew) = &ew {
                    for (v, &e) in dw.iter_mut().zip(ew.iter()) {
                        *v = e.add(*v);
                    }
                }
                dw
            });
            (dx.map(T::wrap), dw.map(T::wrap))
        }))
    }

    fn swiglu(&self, up: &CpuStorage) -> Result<CpuStorage> {
        if self.dtype() == DType::F32 {
            return Ok(CpuStorage::from_f32(swiglu_t(&self.f32s(), &up.f32s(), swiglu_f32())));
        }
        Ok(by_dtype!(self, T => T::wrap(swiglu_t::<T>(&T::view(self), &T::view(up), swiglu_slices))))
    }

    /// Kept in the product's format, SwiGLU's output goes straight into its
    /// 16-bit words, a block at a time ([`swiglu_words`]), and the product
    /// reads them as kept (rounding twice is rounding once): the output is
    /// never whole in float32 beside the gate and up.
    fn swiglu_matmul(
        &self,
        up: &CpuStorage,
        rhs: &CpuStorage,
        d: MatmulDims,
        round: Option<Format>,
        addend: Option<&CpuStorage>,
        keep: Option<Format>,
    ) -> Result<SwigluProduct<CpuStorage>> {
        let Some(f) = keep.filter(|&f| Some(f) == round && self.dtype() == DType::F32) else {
            return swiglu_then_product(self, up, rhs, d, round, addend, keep);
        };
        let (words, changed) = swiglu_words(&self.f32s(), &up.f32s(), f);
        let h = CpuStorage::from_f32(words);
        let halves = Halves { a: Some(f), b: None };
        let c = match addend {
            Some(e) => h.matmul_add(rhs, d, halves, round, e)?,
            None => h.matmul(rhs, d, halves, round)?,
        };
        Ok((c, Some([(h, Some(changed)), self.pack(f)?, up.pack(f)?])))
    }

    fn swiglu_backward(&self, up: &CpuStorage, g: &CpuStorage, halves: Halves) -> Result<(CpuStorage, CpuStorage)> {
        #[cfg(target_arch = "x86_64")]
        let f32_kernel: SwigluBackwardSlices<f32> = match simd::level() {
            simd::Level::Avx512 => avx512::swiglu_backward,
            _ => swiglu_backward_slices,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let f32_kernel: SwigluBackwardSlices<f32> = swiglu_backward_slices;
        if halves != Halves::default() {
            let (dg, du) = swiglu_backward_kept16(&self.f32s(), &up.f32s(), &g.f32s(), halves, f32_kernel);
            return Ok((CpuStorage::from_f32(dg), CpuStorage::from_f32(du)));
        }
        if self.dtype() == DType::F32 {
            let (dg, du) = swiglu_backward_t(&self.f32s(), &up.f32s(), &g.f32s(), f32_kernel);
            return Ok((CpuStorage::from_f32(dg), CpuStorage::from_f32(du)));
        }
        Ok(by_dtype!(self, T => {
            let (dg, du) = swiglu_backward_t::<T>(&T::view(self), &T::view(up), &T::view(g), swiglu_backward_slices);
            (T::wrap(dg), T::wrap(du))
        }))
    }

    fn rope(&self, cos: &CpuStorage, sin: &CpuStorage, t: usize, d: usize, heads: usize) -> Result<CpuStorage> {
        let rows = RopeRows { t, heads, backward: false };
        Ok(by_dtype!(self, T => {
            T::wrap(rope_t::<T>(&T::view(self), &T::view(cos), &T::view(sin), d, rows))
        }))
    }

    fn rope_backward(&self, cos: &CpuStorage, sin: &CpuStorage, t: usize, d: usize, heads: usize) -> Result<CpuStorage> {
        let rows = RopeRows { t, heads, backward: true };
        Ok(by_dtype!(self, T => {
            T::wrap(rope_t::<T>(&T::view(self), &T::view(cos), &T::view(sin), d, rows))
        }))
    }

    fn cross_entropy(&self, targets: &[u32], v: usize) -> Result<(CpuStorage, CpuStorage)> {
        Ok(by_dtype!(self, T => {
            let (loss, stats) = cross_entropy_t::<T>(&T::view(self), targets, v);
            (T::wrap(vec![loss]), T::wrap(stats))
        }))
    }

    /// Kept 16-bit logits are widened first (a copy the plan counts).
    fn cross_entropy_backward(
        &self,
        half: Option<Format>,
        targets: &[u32],
        stats: &CpuStorage,
        g: &CpuStorage,
        v: usize,
    ) -> Result<CpuStorage> {
        if let Some(f) = half {
            let x = crate::backend::pack::PackOps::unpack(self, f, targets.len() * v)?;
            return x.cross_entropy_backward(None, targets, stats, g, v);
        }
        Ok(by_dtype!(self, T => {
            let g = T::view(g)[0];
            T::wrap(cross_entropy_backward_t::<T>(&T::view(self), targets, &T::view(stats), g, v))
        }))
    }
}

// The hot loops below are `for` loops over preallocated outputs, not
// `collect`/`extend` over closures: a kernel's loop must be compiled inside its
// AVX2 copy, and a std iterator function the compiler leaves out of line is
// compiled for the baseline (SSE2, `mul_add` a library call). The outputs are allocated, not zero-filled: each kernel
// writes every value before it reads any back, and hands its output back
// written (`new_vec`, `fill`).

// ---------------------------------------------------------------- RMSNorm ----

/// x: (rows, d), w: (d) -> y: (rows, d), rstd: (rows)
fn rms_norm_t<T: Elem>(x: &[T], w: &[T], rows: usize, d: usize, eps: T) -> (Vec<T>, Vec<T>) {
    let [y, rstd] = new_vecs([rows * d, rows], |[yo, ro], [wy, wr]| {
        if d == 0 {
            let (y, r) = rms_norm_rows(yo, ro, &[], w, 0, eps);
            wy.add(y);
            wr.add(r);
            return;
        }
        let per = per_thread(rows, d);
        let blocks = yo.chunks_mut(per * d).zip(ro.chunks_mut(per)).zip(x[..rows * d].chunks(per * d));
        for (y, r) in pool::map(blocks, |((y, r), x)| rms_norm_rows(y, r, x, w, d, eps)) {
            wy.add(y);
            wr.add(r);
        }
    });
    (y, rstd)
}

simd::multiversion! {
    /// A block of whole rows: x, y: (rows, d), rstd: (rows).
    fn rms_norm_rows<'y, 'r, T: Elem>(
        y: &'y mut [MaybeUninit<T>],
        rstd: &'r mut [MaybeUninit<T>],
        x: &[T],
        w: &[T],
        d: usize,
        eps: T,
    ) -> (&'y mut [T], &'r mut [T]) {
        assert_eq!(y.len(), rstd.len() * d);
        assert_eq!(x.len(), y.len());
        let dn = T::from_f64(d as f64);
        // Each row's sum of squares is the reduction's sequential fold (of
        // rounded squares: `square` then `sum`), four rows in lockstep.
        let ss = if d == 0 {
            vec![T::NEG_ZERO; rstd.len()]
        } else {
            T::row_sums(x, d, rstd.len(), true)
        };
        // mean, + eps, rsqrt = div(1, sqrt(·)): one of each per row
        let rstd = write_exact(rstd, ss.into_iter().map(|s| T::ONE.div(s.div(dn).add(eps).sqrt())));
        if d == 0 {
            return (write_exact(y, []), rstd);
        }
        let y = fill(y, |y, written| {
            for ((yr, xr), &r) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(rstd.iter()) {
                written.add(write_exact(yr, xr.iter().zip(w).map(|(&v, &wj)| v.mul(r).mul(wj))));
            }
        });
        (y, rstd)
    }
}

/// x, g, earlier: (rows, d), w: (d), rstd: (rows) -> dx: (rows, d)
fn rms_norm_dx_t<T: Elem>(x: &[T], w: &[T], rstd: &[T], g: &[T], earlier: Option<&[T]>, d: usize) -> Vec<T> {
    let rows = rstd.len();
    new_vec(rows * d, |dx, written| {
        if d == 0 {
            return;
        }
        let per = per_thread(rows, d);
        let blocks = dx
            .chunks_mut(per * d)
            .zip(x[..rows * d].chunks(per * d))
            .zip(g[..rows * d].chunks(per * d))
            .zip(rstd.chunks(per))
            .enumerate();
        written.add_all(pool::map(blocks, |(b, (((dx, x), g), r))| {
            let e = earlier.map(|e| &e[b * per * d..][..dx.len()]);
            rms_norm_dx_rows(dx, x, w, r, g, e, d)
        }));
    })
}

/// Rows of an RMSNorm backward worked on together: their `g·w·x` stay in
/// cache between the row sums and the outputs.
const DX_BLOCK_ROWS: usize = 16;

simd::multiversion! {
    /// A block of whole rows (`d > 0`): x, g, dx, earlier: (rows, d),
    /// rstd: (rows).
    fn rms_norm_dx_rows<'o, T: Elem>(
        dx: &'o mut [MaybeUninit<T>],
        x: &[T],
        w: &[T],
        rstd: &[T],
        g: &[T],
        earlier: Option<&[T]>,
        d: usize,
    ) -> &'o mut [T] {
        let len = rstd.len() * d;
        assert!(dx.len() == len && x.len() == len && g.len() == len && w.len() == d);
        assert!(earlier.is_none_or(|e| e.len() == len));
        let (dn, minus_half, two) = (T::from_f64(d as f64), T::from_f64(-0.5), T::from_f64(2.0));
        let mut gwx = vec![T::ZERO; DX_BLOCK_ROWS.min(rstd.len()) * d];
        for (b, r) in rstd.chunks(DX_BLOCK_ROWS).enumerate() {
            let span = b * DX_BLOCK_ROWS * d..(b * DX_BLOCK_ROWS + r.len()) * d;
            let (x, g, dxb) = (&x[span.clone()], &g[span.clone()], &mut dx[span.clone()]);
            let gwx = &mut gwx[..r.len() * d];
            for ((o, gr), xr) in gwx.chunks_exact_mut(d).zip(g.chunks_exact(d)).zip(x.chunks_exact(d)) {
                for (((o, &gv), &wv), &xv) in o.iter_mut().zip(gr).zip(w).zip(xr) {
                    *o = gv.mul(wv).mul(xv);
                }
            }
            // each row's Σ g·w·x: the sequential fold of the reduction that
            // sums x·r's broadcast gradient, eight rows a vector
            let grs = T::row_sums(gwx, d, r.len(), false);
            let rows = dxb.chunks_exact_mut(d).zip(g.chunks_exact(d)).zip(x.chunks_exact(d)).zip(grs.iter().zip(r));
            for (i, (((o, gr), xr), (&s, &r))) in rows.enumerate() {
                // rsqrt's backward (g·y·y·y·(−0.5)), add_scalar's (g), mean's (div by d)
                let gs = s.mul(r).mul(r).mul(r).mul(minus_half).div(dn);
                // through x·r (dx1), then through x² (dx2); plain loops, so
                // that they vectorise
                let terms = o.iter_mut().zip(gr).zip(w).zip(xr);
                match earlier {
                    Some(e) => {
                        for ((((o, &gv), &wv), &xv), &ev) in terms.zip(&e[span.start + i * d..][..d]) {
                            o.write(ev.add(gv.mul(wv).mul(r)).add(gs.mul(xv).mul(two)));
                        }
                    }
                    None => {
                        for (((o, &gv), &wv), &xv) in terms {
                            o.write(gv.mul(wv).mul(r).add(gs.mul(xv).mul(two)));
                        }
                    }
                }
            }
        }
        // SAFETY: the blocks of `rstd` cover all its rows, so their spans
        // cover `dx` (its length is asserted above); each block's rows are
        // written in full: `grs` has a sum for each of them, and the row's
        // `o`, `gr`, `w`, `xr` (and `earlier`'s row) all hold `d` values
        // (the lengths asserted above), so its loop writes all `d`. (The
        // loops write through `MaybeUninit`, not `write_exact`: in this form
        // they vectorise.)
        unsafe { assume_init_mut(dx) }
    }
}

simd::multiversion! {
    /// x, g: (rows, d), rstd: (rows) -> dw: (d), the nested sums of
    /// g·(x·r) over the levels `spans` (see `dw_spans`): one accumulator row
    /// per level; a level's fold, complete, is added into the level outside it.
    fn rms_norm_dw_t<T: Elem>(x: &[T], rstd: &[T], g: &[T], spans: &[usize], d: usize) -> Vec<T> {
        let levels = spans.len();
        let mut acc = vec![vec![T::NEG_ZERO; d]; levels];
        if d == 0 {
            return acc.swap_remove(0);
        }
        for (i, ((xr, gr), &r)) in x.chunks_exact(d).zip(g.chunks_exact(d)).zip(rstd).enumerate() {
            let inner = &mut acc[levels - 1];
            for ((a, &xv), &gv) in inner.iter_mut().zip(xr).zip(gr) {
                *a = a.add(gv.mul(xv.mul(r)));
            }
            let mut l = levels - 1;
            while l >= 1 && (i + 1) % spans[l] == 0 {
                let (outer, rest) = acc.split_at_mut(l);
                for (o, a) in outer[l - 1].iter_mut().zip(rest[0].iter_mut()) {
                    *o = o.add(*a);
                    *a = T::NEG_ZERO;
                }
                l -= 1;
            }
        }
        acc.swap_remove(0)
    }
}

// ----------------------------------------------------------------- SwiGLU ----

/// A SwiGLU pass over one slice of elements: `(y, gate, up)`, `y` handed back written.
type SwigluSlices<T> = for<'y> fn(&'y mut [MaybeUninit<T>], &[T], &[T]) -> &'y mut [T];
/// A SwiGLU backward pass over one slice of elements: `(dg, du, gate, up, g)`,
/// `dg` and `du` handed back written.
type SwigluBackwardSlices<T> =
    for<'g, 'u> fn(&'g mut [MaybeUninit<T>], &'u mut [MaybeUninit<T>], &[T], &[T], &[T]) -> (&'g mut [T], &'u mut [T]);

/// gate, up: (n) -> y: (n), `kernel` on each thread's slice
/// This CPU's float32 SwiGLU kernel.
fn swiglu_f32() -> SwigluSlices<f32> {
    #[cfg(target_arch = "x86_64")]
    if simd::level() == simd::Level::Avx512 {
        return avx512::swiglu;
    }
    swiglu_slices
}

/// Values of SwiGLU's output a task computes at a time before packing them.
const WORDS_BLOCK: usize = 2048;

/// gate, up: (n) -> SwiGLU's output as words of two `fmt` values (pack's),
/// with how many values rounding changed: each task computes blocks of
/// [`WORDS_BLOCK`] values into a scratch and packs them.
fn swiglu_words(gate: &[f32], up: &[f32], fmt: Format) -> (Vec<f32>, usize) {
    let (kernel, pack) = (swiglu_f32(), crate::backend::pack::pack_kernel(fmt));
    let words = gate.len().div_ceil(2);
    // whole blocks to each task but the last
    let per = per_thread(words, 2).div_ceil(WORDS_BLOCK / 2) * (WORDS_BLOCK / 2);
    let mut changed = 0;
    let w = new_vec(words, |w, written| {
        let tasks = w.chunks_mut(per).zip(gate.chunks(2 * per)).zip(up.chunks(2 * per));
        for (w, n) in pool::map(tasks, |((w, gate), up)| {
            let mut scratch = Vec::with_capacity(WORDS_BLOCK);
            let mut n = 0;
            let w = fill(w, |w, written| {
                let blocks = w.chunks_mut(WORDS_BLOCK / 2).zip(gate.chunks(WORDS_BLOCK)).zip(up.chunks(WORDS_BLOCK));
                for ((w, gate), up) in blocks {
                    let y = kernel(&mut scratch.spare_capacity_mut()[..gate.len()], gate, up);
                    let (w, k) = pack(w, y, fmt);
                    written.add(w);
                    n += k;
                }
            });
            (w, n)
        }) {
            written.add(w);
            changed += n;
        }
    });
    (w, changed)
}

fn swiglu_t<T: Elem>(gate: &[T], up: &[T], kernel: SwigluSlices<T>) -> Vec<T> {
    let n = gate.len();
    let per = per_thread(n, 1);
    new_vec(n, |y, written| {
        let slices = y.chunks_mut(per).zip(gate.chunks(per)).zip(up.chunks(per));
        written.add_all(pool::map(slices, |((y, gate), up)| kernel(y, gate, up)));
    })
}

simd::multiversion! {
    fn swiglu_slices<'y, T: Elem>(y: &'y mut [MaybeUninit<T>], gate: &[T], up: &[T]) -> &'y mut [T] {
        let y = sigmoid_into(y, gate);
        // silu = gate·σ, then · up
        for ((s, &x), &u) in y.iter_mut().zip(gate).zip(up) {
            *s = x.mul(*s).mul(u);
        }
        y
    }
}

/// gate, up, g: (n) -> d_gate, d_up: (n), `kernel` on each thread's slices
fn swiglu_backward_t<T: Elem>(gate: &[T], up: &[T], g: &[T], kernel: SwigluBackwardSlices<T>) -> (Vec<T>, Vec<T>) {
    let n = gate.len();
    let per = per_thread(n, 1);
    let [dg, du] = new_vecs([n, n], |[dg, du], [wg, wu]| {
        let slices = dg.chunks_mut(per).zip(du.chunks_mut(per)).zip(gate.chunks(per)).zip(up.chunks(per)).zip(g.chunks(per));
        for (dg, du) in pool::map(slices, |((((dg, du), gate), up), g)| kernel(dg, du, gate, up, g)) {
            wg.add(dg);
            wu.add(du);
        }
    });
    (dg, du)
}

/// [`swiglu_backward_t`] with the gate, up or both kept in 16-bit storage
/// (`halves`; their words, two values each): each block of values is widened
/// into scratch as it is reached, so no float32 copy of a whole operand is
/// made — the memory the GPU's kernel, which widens as it loads, uses, and
/// the step's plan counts for both devices.
fn swiglu_backward_kept16(
    gate: &[f32],
    up: &[f32],
    g: &[f32],
    halves: Halves,
    kernel: SwigluBackwardSlices<f32>,
) -> (Vec<f32>, Vec<f32>) {
    const BLOCK: usize = 4096; // even: every block starts on a word
    let n = g.len();
    // values [lo, lo + len) of an operand: its own, or widened from its words
    let values = |s: &[f32], f: Option<Format>, lo: usize, len: usize| -> Vec<f32> {
        match f {
            None => s[lo..lo + len].to_vec(),
            Some(f) => widen_words(&s[lo / 2..], f, len),
        }
    };
    let [dg, du] = new_vecs([n, n], |[dg, du], [wg, wu]| {
        let blocks = dg.chunks_mut(BLOCK).zip(du.chunks_mut(BLOCK)).zip(g.chunks(BLOCK)).enumerate();
        for (dg, du) in pool::map(blocks, |(i, ((dg, du), g))| {
            let (a, b) = (values(gate, halves.a, i * BLOCK, g.len()), values(up, halves.b, i * BLOCK, g.len()));
            kernel(dg, du, &a, &b, g)
        }) {
            wg.add(dg);
            wu.add(du);
        }
    });
    (dg, du)
}

simd::multiversion! {
    fn swiglu_backward_slices<'g, 'u, T: Elem>(
        dg: &'g mut [MaybeUninit<T>],
        du: &'u mut [MaybeUninit<T>],
        gate: &[T],
        up: &[T],
        g: &[T],
    ) -> (&'g mut [T], &'u mut [T]) {
        // du is written by the zip below: every length must agree
        assert!(du.len() == dg.len() && up.len() == dg.len() && g.len() == dg.len());
        let dg = sigmoid_into(dg, gate);
        // `dg` updated in place as `du` is written, in one pass
        let du = write_exact(
            du,
            dg.iter_mut().zip(gate).zip(up).zip(g).map(|(((s, &x), &u), &gv)| {
                let sv = *s;
                // the product's gradient g·up, through silu's: σ·fma(x, 1 − σ, 1)
                *s = gv.mul(u).mul(sv.mul(x.fma(T::ONE.sub(sv), T::ONE)));
                gv.mul(x.mul(sv))
            }),
        );
        (dg, du)
    }
}

/// SwiGLU's f32 passes on 16 lanes where the CPU has AVX-512F: a group's
/// sigmoid, silu and products in one pass (no second sweep over a sigmoid
/// buffer), the same operations as `swiglu_slices` and
/// `swiglu_backward_slices` lane by lane.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::backend::cpu::assume_init_mut;
    use crate::backend::cpu::simd::first_lanes;
    use crate::backend::math::avx512::{div, exp};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// σ(x) = div(1, 1 + exp(−0 − x))
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    fn sigmoid(x: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        div(one, _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_set1_ps(-0.0), x))))
    }

    /// gate, up: (n) -> y: (n), every value written
    pub fn swiglu<'y>(y: &'y mut [MaybeUninit<f32>], gate: &[f32], up: &[f32]) -> &'y mut [f32] {
        assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma"));
        // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked above).
        unsafe { swiglu_wide(y, gate, up) }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    fn swiglu_wide<'y>(y: &'y mut [MaybeUninit<f32>], gate: &[f32], up: &[f32]) -> &'y mut [f32] {
        assert!(gate.len() == y.len() && up.len() == y.len());
        let yp = y.as_mut_ptr().cast::<f32>();
        for i in (0..gate.len()).step_by(16) {
            let m = first_lanes(gate.len() - i);
            // SAFETY: lanes of `m` lie within the three slices (equal lengths).
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(i));
                let u = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
                // silu = gate·σ, then · up
                _mm512_mask_storeu_ps(yp.add(i), m, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid(x)), u));
            }
        }
        // SAFETY: the stores above cover 0..len: one for each 16 values,
        // masked to those that remain at the end.
        unsafe { assume_init_mut(y) }
    }

    /// gate, up, g: (n) -> dg, du: (n), every value written
    pub fn swiglu_backward<'g, 'u>(
        dg: &'g mut [MaybeUninit<f32>],
        du: &'u mut [MaybeUninit<f32>],
        gate: &[f32],
        up: &[f32],
        g: &[f32],
    ) -> (&'g mut [f32], &'u mut [f32]) {
        assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma"));
        // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked above).
        unsafe { swiglu_backward_wide(dg, du, gate, up, g) }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    fn swiglu_backward_wide<'g, 'u>(
        dg: &'g mut [MaybeUninit<f32>],
        du: &'u mut [MaybeUninit<f32>],
        gate: &[f32],
        up: &[f32],
        g: &[f32],
    ) -> (&'g mut [f32], &'u mut [f32]) {
        let n = dg.len();
        assert!(du.len() == n && gate.len() == n && up.len() == n && g.len() == n);
        let (dgp, dup) = (dg.as_mut_ptr().cast::<f32>(), du.as_mut_ptr().cast::<f32>());
        let one = _mm512_set1_ps(1.0);
        for i in (0..n).step_by(16) {
            let m = first_lanes(n - i);
            // SAFETY: lanes of `m` lie within the five slices (equal lengths).
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(i));
                let u = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
                let gv = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
                let s = sigmoid(x);
                _mm512_mask_storeu_ps(dup.add(i), m, _mm512_mul_ps(gv, _mm512_mul_ps(x, s)));
                // the product's gradient g·up, through silu's: σ·fma(x, 1 − σ, 1)
                let ds = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
                _mm512_mask_storeu_ps(dgp.add(i), m, _mm512_mul_ps(_mm512_mul_ps(gv, u), ds));
            }
        }
        // SAFETY: the stores above cover 0..n of both: one for each 16
        // values, masked to those that remain at the end.
        unsafe { (assume_init_mut(dg), assume_init_mut(du)) }
    }
}

// ------------------------------------------------------------------- RoPE ----

/// Which input row an output row of a RoPE reads, and its position: the
/// forward reads token-major `(B, t, heads, d)` rows into head-major `(B,
/// heads, t, d)` ones, the backward the other way.
#[derive(Clone, Copy)]
struct RopeRows {
    t: usize,
    heads: usize,
    backward: bool,
}

impl RopeRows {
    /// `(input row, position)` of output row `o`.
    #[inline(always)]
    fn source(self, o: usize) -> (usize, usize) {
        let (t, h) = (self.t, self.heads);
        if self.backward {
            // o = (b·t + p)·h + head, read from (b·h + head)·t + p
            let (bp, head) = (o / h, o % h);
            ((bp / t * h + head) * t + bp % t, bp % t)
        } else {
            // o = (b·h + head)·t + p, read from (b·t + p)·h + head
            let (bh, p) = (o / t, o % t);
            ((bh / h * t + p) * h + bh % h, p)
        }
    }
}

/// x: rows of d, cos, sin: (t, d) -> y: rows of d, output row o from input
/// row `rows.source(o)`; `backward`: x is the upstream gradient, y the input's.
fn rope_t<T: Elem>(x: &[T], cos: &[T], sin: &[T], d: usize, rows: RopeRows) -> Vec<T> {
    if d == 0 {
        return vec![T::ZERO; x.len()];
    }
    // each row's halves are written pair by pair: d is even, x whole rows
    assert!(d.is_multiple_of(2) && x.len().is_multiple_of(d));
    let per = per_thread(x.len() / d, d);
    new_vec(x.len(), |y, written| {
        written.add_all(pool::map(y.chunks_mut(per * d).enumerate(), |(b, y)| {
            let first = b * per;
            if rows.backward {
                rope_backward_rows(y, x, cos, sin, first, d, rows)
            } else {
                rope_rows(y, x, cos, sin, first, d, rows)
            }
        }));
    })
}

simd::multiversion! {
    /// Output rows `first ..` (`d > 0`) from the rows of `x` they read.
    fn rope_rows<'y, T: Elem>(
        y: &'y mut [MaybeUninit<T>],
        x: &[T],
        cos: &[T],
        sin: &[T],
        first: usize,
        d: usize,
        rows: RopeRows,
    ) -> &'y mut [T] {
        assert!(d.is_multiple_of(2) && y.len().is_multiple_of(d));
        let h = d / 2;
        for (i, yr) in y.chunks_exact_mut(d).enumerate() {
            let (src, p) = rows.source(first + i);
            let xr = &x[src * d..(src + 1) * d];
            let p = p * d;
            let (c1, c2) = cos[p..p + d].split_at(h);
            let (s1, s2) = sin[p..p + d].split_at(h);
            let (x1, x2) = xr.split_at(h);
            let (y1, y2) = yr.split_at_mut(h);
            // x·cos + rotate_half(x)·sin, rotate_half(x) = (−0 − x2, x1)
            for (((((o, &a), &b), &c), &s), (o2, (&c2, &s2))) in y1
                .iter_mut()
                .zip(x1)
                .zip(x2)
                .zip(c1)
                .zip(s1)
                .zip(y2.iter_mut().zip(c2.iter().zip(s2)))
            {
                o.write(a.mul(c).add(T::NEG_ZERO.sub(b).mul(s)));
                o2.write(b.mul(c2).add(a.mul(s2)));
            }
        }
        // SAFETY: `y` is whole rows (asserted above), and each row's loop
        // writes both its halves in full: `y1`, `y2` and the halves of `x`,
        // `cos` and `sin` it zips hold `h = d / 2` values each (the slices
        // of `d` values above). (One loop writing both halves is the form
        // that vectorises; `write_exact` would take a half at a time.)
        unsafe { assume_init_mut(y) }
    }
}

simd::multiversion! {
    /// The backward of output rows `first ..` (`d > 0`) from the rows of the
    /// upstream gradient `g` they read.
    fn rope_backward_rows<'o, T: Elem>(
        dx: &'o mut [MaybeUninit<T>],
        g: &[T],
        cos: &[T],
        sin: &[T],
        first: usize,
        d: usize,
        rows: RopeRows,
    ) -> &'o mut [T] {
        assert!(d.is_multiple_of(2) && dx.len().is_multiple_of(d));
        let h = d / 2;
        for (i, or) in dx.chunks_exact_mut(d).enumerate() {
            let (src, p) = rows.source(first + i);
            let gr = &g[src * d..(src + 1) * d];
            let p = p * d;
            let (c1, c2) = cos[p..p + d].split_at(h);
            let (s1, s2) = sin[p..p + d].split_at(h);
            let (g1, g2) = gr.split_at(h);
            let (o1, o2) = or.split_at_mut(h);
            // x's contributions in autograd's order: g·cos, the second half's
            // narrow (+0 pad in front, then −0 − g1·s1 from the neg), the
            // first half's (g2·s2, +0 pad behind)
            for (((((o, &a), &b), &c), &s), (o2, (&c2, &s2))) in o1
                .iter_mut()
                .zip(g1)
                .zip(g2)
                .zip(c1)
                .zip(s1)
                .zip(o2.iter_mut().zip(c2.iter().zip(s2)))
            {
                o.write(a.mul(c).add(T::ZERO).add(b.mul(s2)));
                o2.write(b.mul(c2).add(T::NEG_ZERO.sub(a.mul(s))).add(T::ZERO));
            }
        }
        // SAFETY: as in `rope_rows`: whole rows, each loop over `h` values
        // of both halves.
        unsafe { assume_init_mut(dx) }
    }
}

// ---------------------------------------------------------- cross-entropy ----

/// Rows per block of the cross-entropy's exps (the folds then run four rows in lockstep).
const CE_BLOCK: usize = 32;

simd::multiversion! {
    /// x: (rows, v), targets: (rows) -> loss, stats: (rows, 2) = (max, Σ exp) per row
    fn cross_entropy_t<T: Elem>(x: &[T], targets: &[u32], v: usize) -> (T, Vec<T>) {
        let rows = targets.len();
        let mut stats = vec![T::ZERO; 2 * rows];
        let mut total = T::NEG_ZERO;
        if v > 0 {
            let mut e = vec![T::ZERO; CE_BLOCK * v];
            let lens = vec![v; CE_BLOCK];
            for (b, (xb, tb)) in x[..rows * v].chunks(CE_BLOCK * v).zip(targets.chunks(CE_BLOCK)).enumerate() {
                let k = tb.len();
                let maxes = fold_ragged(xb, v, &lens[..k], T::NEG_INF, maximum);
                for ((er, xr), &m) in e.chunks_exact_mut(v).zip(xb.chunks_exact(v)).zip(&maxes) {
                    for (o, &xv) in er.iter_mut().zip(xr) {
                        *o = xv.sub(m).exp();
                    }
                }
                let sums = fold_ragged(&e[..k * v], v, &lens[..k], T::NEG_ZERO, |a, y| a.add(y));
                for (r, ((&m, &s), &t)) in maxes.iter().zip(&sums).zip(tb).enumerate() {
                    let row = b * CE_BLOCK + r;
                    // log_softmax at the target, then the sum over rows, in order
                    total = total.add(x[row * v + t as usize].sub(m).sub(s.log()));
                    stats[2 * row] = m;
                    stats[2 * row + 1] = s;
                }
            }
        }
        let loss = T::NEG_ZERO.sub(total.div(T::from_f64(rows as f64)));
        (loss, stats)
    }
}

simd::multiversion! {
    /// x: (rows, v), stats: (rows, 2), the loss's upstream gradient g -> dx: (rows, v)
    fn cross_entropy_backward_t<T: Elem>(x: &[T], targets: &[u32], stats: &[T], g: T, v: usize) -> Vec<T> {
        let rows = targets.len();
        // neg's, div_scalar's and the gather's (scatter-add from +0) backward,
        // then the log-sum-exp's share: the sum of −0 − (that row's gradient)
        let a = T::ZERO.add(T::NEG_ZERO.sub(g).div(T::from_f64(rows as f64)));
        let gl = T::NEG_ZERO.sub(a);
        let mut dx = vec![T::ZERO; rows * v];
        if v == 0 {
            return dx;
        }
        for ((or, xr), (st, &t)) in dx.chunks_exact_mut(v).zip(x.chunks_exact(v)).zip(stats.chunks_exact(2).zip(targets)) {
            let (m, s) = (st[0], st[1]);
            let gs = gl.div(s);
            // +0 (the gathered entries' gradient elsewhere) + exp's backward
            for (o, &xv) in or.iter_mut().zip(xr) {
                *o = T::ZERO.add(gs.mul(xv.sub(m).exp()));
            }
            let t = t as usize;
            or[t] = a.add(gs.mul(xr[t].sub(m).exp()));
        }
        dx
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::set_cpu_threads;
    use crate::backend::{Device, Storage};

    /// Rows and elements split over threads give the one-thread bits: blocks
    /// end mid-way through RoPE's positions and off a group of lanes.
    #[test]
    fn threaded_fused_primitives_give_the_one_thread_bits() {
        let (rows, d, t) = (7 * 443, 100, 7); // above pool::SPLIT_VALUES; 3 blocks of 1040 rows
        let gen = crate::Generator::new(9);
        let st = |v: Vec<f32>| Storage::from_f32(v, Device::Cpu).unwrap();
        let x = st(gen.uniform(rows * d).iter().map(|u| (u - 0.5) * 20.0).collect());
        let g = st(gen.uniform(rows * d));
        let w = st(gen.uniform(d));
        let e = st(gen.uniform(rows * d).iter().map(|u| u - 0.5).collect());
        let (cos, sin) = (st(gen.uniform(t * d)), st(gen.uniform(t * d)));
        let bits = |s: &Storage| -> Vec<u32> {
            s.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let run = || {
            let (y, r) = x.rms_norm(&w, rows, d, 1e-5).unwrap();
            let (a, b) = x.rms_norm_backward(&w, &r, &g, None, None, &[rows], d, true, true).unwrap();
            // each block adds into its own rows of the earlier gradient
            let (c, _) = x.rms_norm_backward(&w, &r, &g, Some(&e), None, &[rows], d, true, false).unwrap();
            let (dg, du) = x.swiglu_backward(&g, &x).unwrap();
            let mut out = vec![bits(&y), bits(&r), bits(&a.unwrap()), bits(&b.unwrap()), bits(&c.unwrap())];
            out.extend([bits(&x.swiglu(&g).unwrap()), bits(&dg), bits(&du)]);
            // one head, and 443 heads of one sequence (rows move between layouts)
            for heads in [1, 443] {
                out.push(bits(&x.rope(&cos, &sin, t, d, heads).unwrap()));
                out.push(bits(&g.rope_backward(&cos, &sin, t, d, heads).unwrap()));
            }
            out
        };
        set_cpu_threads(Some(1));
        let one = run();
        set_cpu_threads(Some(3));
        let three = run();
        set_cpu_threads(None);
        for (i, (a, b)) in one.iter().zip(&three).enumerate() {
            assert!(a == b, "output {i} differs with threads");
        }
    }
}
