//! The CPU reference of the fused primitives: each the composition's
//! operations in the composition's order (see the contract in `mod.rs`),
//! arranged so the loops vectorise — the sequential folds run four rows in
//! lockstep, the divisions of an elementwise loop a group of lanes at a time.

use super::FusedOps;
use crate::backend::cpu::{fold_ragged, for_lanes_mut, maximum, simd, CpuStorage, Elem};
use crate::backend::math::LANES;
use crate::backend::DType;
use crate::Result;

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
        spans: &[usize],
        d: usize,
        want_dx: bool,
        want_dw: bool,
    ) -> Result<(Option<CpuStorage>, Option<CpuStorage>, Option<CpuStorage>)> {
        Ok(by_dtype!(self, T => {
            let (x, w, r, g) = (T::view(self), T::view(w), T::view(rstd), T::view(g));
            let dx = want_dx.then(|| rms_norm_dx_t::<T>(&x, &w, &r, &g, d));
            let dw = want_dw.then(|| rms_norm_dw_t::<T>(&x, &r, &g, spans, d));
            let (dx1, dx2) = match dx {
                Some((a, b)) => (Some(T::wrap(a)), Some(T::wrap(b))),
                None => (None, None),
            };
            (dx1, dx2, dw.map(T::wrap))
        }))
    }

    fn swiglu(&self, up: &CpuStorage) -> Result<CpuStorage> {
        Ok(by_dtype!(self, T => T::wrap(swiglu_t::<T>(&T::view(self), &T::view(up)))))
    }

    fn swiglu_backward(&self, up: &CpuStorage, g: &CpuStorage) -> Result<(CpuStorage, CpuStorage)> {
        Ok(by_dtype!(self, T => {
            let (dg, du) = swiglu_backward_t::<T>(&T::view(self), &T::view(up), &T::view(g));
            (T::wrap(dg), T::wrap(du))
        }))
    }

    fn rope(&self, cos: &CpuStorage, sin: &CpuStorage, t: usize, d: usize) -> Result<CpuStorage> {
        Ok(by_dtype!(self, T => {
            T::wrap(rope_t::<T>(&T::view(self), &T::view(cos), &T::view(sin), t, d))
        }))
    }

    fn rope_backward(&self, cos: &CpuStorage, sin: &CpuStorage, t: usize, d: usize) -> Result<CpuStorage> {
        Ok(by_dtype!(self, T => {
            T::wrap(rope_backward_t::<T>(&T::view(self), &T::view(cos), &T::view(sin), t, d))
        }))
    }

    fn cross_entropy(&self, targets: &[u32], v: usize) -> Result<(CpuStorage, CpuStorage)> {
        Ok(by_dtype!(self, T => {
            let (loss, stats) = cross_entropy_t::<T>(&T::view(self), targets, v);
            (T::wrap(vec![loss]), T::wrap(stats))
        }))
    }

    fn cross_entropy_backward(
        &self,
        targets: &[u32],
        stats: &CpuStorage,
        g: &CpuStorage,
        v: usize,
    ) -> Result<CpuStorage> {
        Ok(by_dtype!(self, T => {
            let g = T::view(g)[0];
            T::wrap(cross_entropy_backward_t::<T>(&T::view(self), targets, &T::view(stats), g, v))
        }))
    }
}

// ---------------------------------------------------------------- RMSNorm ----

simd::multiversion! {
    /// x: (rows, d), w: (d) -> y: (rows, d), rstd: (rows)
    fn rms_norm_t<T: Elem>(x: &[T], w: &[T], rows: usize, d: usize, eps: T) -> (Vec<T>, Vec<T>) {
        let dn = T::from_f64(d as f64);
        // Each row's sum of squares is the reduction's sequential fold (of
        // rounded squares: `square` then `sum`), four rows in lockstep.
        let ss = if d == 0 {
            vec![T::NEG_ZERO; rows]
        } else {
            fold_ragged(&x[..rows * d], d, &vec![d; rows], T::NEG_ZERO, |a, v| a.add(v.mul(v)))
        };
        // mean, + eps, rsqrt = div(1, sqrt(·)): one of each per row
        let rstd: Vec<T> = ss.iter().map(|&s| T::ONE.div(s.div(dn).add(eps).sqrt())).collect();
        let mut y = Vec::with_capacity(rows * d);
        for (row, &r) in x.chunks_exact(d.max(1)).zip(&rstd) {
            y.extend(row.iter().zip(w).map(|(&v, &wj)| v.mul(r).mul(wj)));
        }
        (y, rstd)
    }
}

simd::multiversion! {
    /// x, g: (rows, d), w: (d), rstd: (rows) -> dx1, dx2: (rows, d)
    fn rms_norm_dx_t<T: Elem>(x: &[T], w: &[T], rstd: &[T], g: &[T], d: usize) -> (Vec<T>, Vec<T>) {
        let rows = rstd.len();
        let (dn, minus_half, two) = (T::from_f64(d as f64), T::from_f64(-0.5), T::from_f64(2.0));
        let (mut dx1, mut dx2) = (Vec::with_capacity(rows * d), Vec::with_capacity(rows * d));
        if d == 0 {
            return (dx1, dx2);
        }
        // gw = g·w for a block of rows, then each row's Σ gw·x as a sequential
        // fold (the reduction of `x·r`'s broadcast gradient), four in lockstep.
        const BLOCK: usize = 64;
        let mut gw = Vec::with_capacity(BLOCK * d);
        for ((xb, gb), rb) in x.chunks(BLOCK * d).zip(g.chunks(BLOCK * d)).zip(rstd.chunks(BLOCK)) {
            gw.clear();
            for grow in gb.chunks_exact(d) {
                gw.extend(grow.iter().zip(w).map(|(&gv, &wv)| gv.mul(wv)));
            }
            let prods: Vec<T> = gw.iter().zip(xb).map(|(&p, &v)| p.mul(v)).collect();
            let grs = fold_ragged(&prods, d, &vec![d; rb.len()], T::NEG_ZERO, |a, p| a.add(p));
            for (((gwr, xr), &gr), &r) in gw.chunks_exact(d).zip(xb.chunks_exact(d)).zip(&grs).zip(rb) {
                // rsqrt's backward (g·y·y·y·(−0.5)), add_scalar's (g), mean's (div by d)
                let gs = gr.mul(r).mul(r).mul(r).mul(minus_half).div(dn);
                dx1.extend(gwr.iter().map(|&p| p.mul(r)));
                dx2.extend(xr.iter().map(|&v| gs.mul(v).mul(two)));
            }
        }
        (dx1, dx2)
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

/// σ(x) = div(1, 1 + exp(−0 − x)) as the unary op computes it: the exps, then
/// the divisions a group of lanes at a time.
#[inline(always)]
fn sigmoid_all<T: Elem>(x: &[T]) -> Vec<T> {
    let mut s: Vec<T> = x.iter().map(|&v| T::ONE.add(T::NEG_ZERO.sub(v).exp())).collect();
    for_lanes_mut(&mut s, |d| T::div_lanes([T::ONE; LANES], d));
    s
}

simd::multiversion! {
    /// gate, up: (n) -> y: (n)
    fn swiglu_t<T: Elem>(gate: &[T], up: &[T]) -> Vec<T> {
        let mut s = sigmoid_all(gate);
        // silu = gate·σ, then · up
        for ((s, &x), &u) in s.iter_mut().zip(gate).zip(up) {
            *s = x.mul(*s).mul(u);
        }
        s
    }
}

simd::multiversion! {
    /// gate, up, g: (n) -> d_gate, d_up: (n)
    fn swiglu_backward_t<T: Elem>(gate: &[T], up: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let mut dg = sigmoid_all(gate);
        let mut du = Vec::with_capacity(gate.len());
        for (((s, &x), &u), &gv) in dg.iter_mut().zip(gate).zip(up).zip(g) {
            let sv = *s;
            du.push(gv.mul(x.mul(sv)));
            // the product's gradient g·up, through silu's: σ·fma(x, 1 − σ, 1)
            *s = gv.mul(u).mul(sv.mul(x.fma(T::ONE.sub(sv), T::ONE)));
        }
        (dg, du)
    }
}

// ------------------------------------------------------------------- RoPE ----

simd::multiversion! {
    /// x: (rows, d), cos, sin: (t, d), row i at position i mod t -> y: (rows, d)
    fn rope_t<T: Elem>(x: &[T], cos: &[T], sin: &[T], t: usize, d: usize) -> Vec<T> {
        let h = d / 2;
        let mut y = Vec::with_capacity(x.len());
        if d == 0 {
            return y;
        }
        for (i, row) in x.chunks_exact(d).enumerate() {
            let p = (i % t) * d;
            let (c, s) = (&cos[p..p + d], &sin[p..p + d]);
            let (x1, x2) = row.split_at(h);
            // x·cos + rotate_half(x)·sin, rotate_half(x) = (−0 − x2, x1)
            y.extend((0..h).map(|j| x1[j].mul(c[j]).add(T::NEG_ZERO.sub(x2[j]).mul(s[j]))));
            y.extend((0..h).map(|j| x2[j].mul(c[h + j]).add(x1[j].mul(s[h + j]))));
        }
        y
    }
}

simd::multiversion! {
    /// g: (rows, d), cos, sin: (t, d) -> dx: (rows, d)
    fn rope_backward_t<T: Elem>(g: &[T], cos: &[T], sin: &[T], t: usize, d: usize) -> Vec<T> {
        let h = d / 2;
        let mut dx = Vec::with_capacity(g.len());
        if d == 0 {
            return dx;
        }
        for (i, row) in g.chunks_exact(d).enumerate() {
            let p = (i % t) * d;
            let (c, s) = (&cos[p..p + d], &sin[p..p + d]);
            let (g1, g2) = row.split_at(h);
            // x's contributions in autograd's order: g·cos, the second half's
            // narrow (+0 pad in front, then −0 − g1·s1 from the neg), the
            // first half's (g2·s2, +0 pad behind)
            dx.extend((0..h).map(|j| g1[j].mul(c[j]).add(T::ZERO).add(g2[j].mul(s[h + j]))));
            dx.extend((0..h).map(|j| {
                g2[j].mul(c[h + j]).add(T::NEG_ZERO.sub(g1[j].mul(s[j]))).add(T::ZERO)
            }));
        }
        dx
    }
}

// ---------------------------------------------------------- cross-entropy ----

/// Rows per block of the cross-entropy's exps (the folds then run four rows in lockstep).
const CE_BLOCK: usize = 32;

simd::multiversion! {
    /// x: (rows, v), targets: (rows) -> loss, stats: (rows, 2) = (max, Σ exp) per row
    fn cross_entropy_t<T: Elem>(x: &[T], targets: &[u32], v: usize) -> (T, Vec<T>) {
        let rows = targets.len();
        let mut stats = Vec::with_capacity(2 * rows);
        let mut total = T::NEG_ZERO;
        if v > 0 {
            let mut e = Vec::with_capacity(CE_BLOCK * v);
            for (b, (xb, tb)) in x[..rows * v].chunks(CE_BLOCK * v).zip(targets.chunks(CE_BLOCK)).enumerate() {
                let lens = vec![v; tb.len()];
                let maxes = fold_ragged(xb, v, &lens, T::NEG_INF, maximum);
                e.clear();
                for (row, &m) in xb.chunks_exact(v).zip(&maxes) {
                    e.extend(row.iter().map(|&xv| xv.sub(m).exp()));
                }
                let sums = fold_ragged(&e, v, &lens, T::NEG_ZERO, |a, y| a.add(y));
                for (k, (&m, &s)) in maxes.iter().zip(&sums).enumerate() {
                    let xt = x[(b * CE_BLOCK + k) * v + tb[k] as usize];
                    // log_softmax at the target, then the sum over rows, in order
                    total = total.add(xt.sub(m).sub(s.log()));
                    stats.push(m);
                    stats.push(s);
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
        let mut dx = Vec::with_capacity(rows * v);
        if v == 0 {
            return dx;
        }
        for ((row, st), &t) in x[..rows * v].chunks_exact(v).zip(stats.chunks_exact(2)).zip(targets) {
            let (m, s) = (st[0], st[1]);
            let gs = gl.div(s);
            let start = dx.len();
            // +0 (the gathered entries' gradient elsewhere) + exp's backward
            dx.extend(row.iter().map(|&xv| T::ZERO.add(gs.mul(xv.sub(m).exp()))));
            let t = t as usize;
            dx[start + t] = a.add(gs.mul(row[t].sub(m).exp()));
        }
        dx
    }
}
