//! The spec of the fused primitives: each formula of the contract, operation
//! for operation, one row at a time.

#![forbid(unsafe_code)]

use super::FusedOps;
use crate::backend::math::{div, exp, log, sqrt};
use crate::backend::matmul::Halves;
use crate::backend::pack::PackOps;
use crate::backend::round::Format;
use crate::backend::spec::{fma, maximum, SpecStorage};
use crate::Result;

/// `σ(x) = div(1, 1 + exp(−0 − x))`.
fn sigmoid(x: f32) -> f32 {
    div(1.0, 1.0 + exp(-0.0 - x))
}

/// `Σ` from −0 in ascending order.
fn sum(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(-0.0, |acc, v| acc + v)
}

/// The nested sum of `dw`: level `l` folds `spans[l] / spans[l + 1]` sums of
/// the level below, the last level `spans[l]` rows' values, each from −0.
fn nested(spans: &[usize], start: usize, value: &dyn Fn(usize) -> f32) -> f32 {
    match spans {
        [] => -0.0,
        [rows] => sum((start..start + rows).map(value)),
        [outer, rest @ ..] => {
            let inner = rest[0];
            sum((0..outer / inner).map(|k| nested(rest, start + k * inner, value)))
        }
    }
}

impl FusedOps for SpecStorage {
    fn rms_norm(&self, w: &SpecStorage, rows: usize, d: usize, eps: f64) -> Result<(SpecStorage, SpecStorage)> {
        let (x, w) = (self.get(), w.get());
        let (eps, df) = (eps as f32, d as f32);
        let (mut y, mut rstd) = (Vec::with_capacity(rows * d), Vec::with_capacity(rows));
        for row in (0..rows).map(|i| &x[i * d..(i + 1) * d]) {
            let ss = sum(row.iter().map(|&v| v * v));
            let r = div(1.0, sqrt(div(ss, df) + eps));
            y.extend(row.iter().zip(w.iter()).map(|(&v, &wj)| (v * r) * wj));
            rstd.push(r);
        }
        Ok((SpecStorage::new(y), SpecStorage::new(rstd)))
    }

    fn rms_norm_backward(
        &self,
        w: &SpecStorage,
        rstd: &SpecStorage,
        g: &SpecStorage,
        ex: Option<&SpecStorage>,
        ew: Option<&SpecStorage>,
        spans: &[usize],
        d: usize,
        want_dx: bool,
        want_dw: bool,
    ) -> Result<(Option<SpecStorage>, Option<SpecStorage>)> {
        let (x, w, r, g) = (self.get(), w.get(), rstd.get(), g.get());
        let (e, ew) = (ex.map(|e| e.get()), ew.map(|e| e.get()));
        let rows = r.len();
        let df = d as f32;
        let dx = want_dx.then(|| {
            let mut dx = Vec::with_capacity(rows * d);
            for i in 0..rows {
                let at = |j: usize| i * d + j;
                let gw = |j: usize| g[at(j)] * w[j];
                let gr = sum((0..d).map(|j| gw(j) * x[at(j)]));
                let ri = r[i];
                let gs = div((((gr * ri) * ri) * ri) * -0.5, df);
                for j in 0..d {
                    let (dx1, dx2) = (gw(j) * ri, (gs * x[at(j)]) * 2.0);
                    dx.push(match &e {
                        Some(e) => (e[at(j)] + dx1) + dx2,
                        None => dx1 + dx2,
                    });
                }
            }
            SpecStorage::new(dx)
        });
        let dw = want_dw.then(|| {
            let dw = (0..d).map(|j| {
                let s = nested(spans, 0, &|i| g[i * d + j] * (x[i * d + j] * r[i]));
                ew.as_ref().map_or(s, |e| e[j] + s)
            });
            SpecStorage::new(dw.collect())
        });
        Ok((dx, dw))
    }

    fn swiglu(&self, up: &SpecStorage) -> Result<SpecStorage> {
        let (gate, up) = (self.get(), up.get());
        Ok(SpecStorage::new(gate.iter().zip(up.iter()).map(|(&a, &b)| (a * sigmoid(a)) * b).collect()))
    }

    fn swiglu_backward(&self, up: &SpecStorage, g: &SpecStorage, halves: Halves) -> Result<(SpecStorage, SpecStorage)> {
        // a 16-bit operand's values, widened
        let values = |s: &SpecStorage, f: Option<Format>| match f {
            Some(f) => Ok::<_, crate::Error>(s.unpack(f, g.len())?.get().clone()),
            None => Ok(s.get().clone()),
        };
        let (gate, up, g) = (values(self, halves.a)?, values(up, halves.b)?, g.get());
        let (mut da, mut db) = (Vec::with_capacity(gate.len()), Vec::with_capacity(gate.len()));
        for i in 0..gate.len() {
            let s = sigmoid(gate[i]);
            da.push((g[i] * up[i]) * (s * fma(gate[i], 1.0 - s, 1.0)));
            db.push(g[i] * (gate[i] * s));
        }
        Ok((SpecStorage::new(da), SpecStorage::new(db)))
    }

    fn rope(&self, cos: &SpecStorage, sin: &SpecStorage, t: usize, d: usize, heads: usize) -> Result<SpecStorage> {
        let (x, c, s) = (self.get(), cos.get(), sin.get());
        let h = d / 2;
        let mut y = Vec::with_capacity(x.len());
        for (b, hh, p) in head_major_rows(x.len(), t, d, heads) {
            let src = ((b * t + p) * heads + hh) * d; // token-major (b, p, hh)
            let xr = |j: usize| x[src + j];
            let (cr, sr) = (|j: usize| c[p * d + j], |j: usize| s[p * d + j]);
            for j in 0..d {
                y.push(match j < h {
                    true => xr(j) * cr(j) + (-0.0 - xr(j + h)) * sr(j),
                    false => xr(j) * cr(j) + xr(j - h) * sr(j),
                });
            }
        }
        Ok(SpecStorage::new(y))
    }

    fn rope_backward(&self, cos: &SpecStorage, sin: &SpecStorage, t: usize, d: usize, heads: usize) -> Result<SpecStorage> {
        let (g, c, s) = (self.get(), cos.get(), sin.get());
        let h = d / 2;
        let mut dx = vec![0.0f32; g.len()];
        for (row, (b, hh, p)) in head_major_rows(g.len(), t, d, heads).enumerate() {
            let dst = ((b * t + p) * heads + hh) * d; // token-major (b, p, hh)
            let gr = |j: usize| g[row * d + j];
            let (cr, sr) = (|j: usize| c[p * d + j], |j: usize| s[p * d + j]);
            for j in 0..d {
                dx[dst + j] = match j < h {
                    true => ((gr(j) * cr(j)) + 0.0) + gr(j + h) * sr(j + h),
                    false => ((gr(j) * cr(j)) + (-0.0 - gr(j - h) * sr(j - h))) + 0.0,
                };
            }
        }
        Ok(SpecStorage::new(dx))
    }

    fn cross_entropy(&self, targets: &[u32], v: usize) -> Result<(SpecStorage, SpecStorage)> {
        let x = self.get();
        let rows = targets.len();
        let (mut stats, mut ps) = (Vec::with_capacity(2 * rows), Vec::with_capacity(rows));
        for (i, &t) in targets.iter().enumerate() {
            let row = &x[i * v..(i + 1) * v];
            let m = row[1..].iter().fold(row[0], |m, &xj| maximum(m, xj));
            let s = sum(row.iter().map(|&xj| exp(xj - m)));
            ps.push((row[t as usize] - m) - log(s));
            stats.extend([m, s]);
        }
        let loss = -0.0 - div(sum(ps.into_iter()), rows as f32);
        Ok((SpecStorage::new(vec![loss]), SpecStorage::new(stats)))
    }

    fn cross_entropy_backward(&self, half: Option<Format>, targets: &[u32], stats: &SpecStorage, g: &SpecStorage, v: usize) -> Result<SpecStorage> {
        let widened = match half {
            Some(f) => Some(self.unpack(f, targets.len() * v)?),
            None => None,
        };
        let (x, stats) = (widened.as_ref().unwrap_or(self).get(), stats.get());
        let g2 = div(-0.0 - g.at(0), targets.len() as f32);
        let a = 0.0 + g2;
        let gl = -0.0 - a;
        let mut dx = Vec::with_capacity(x.len());
        for (i, &t) in targets.iter().enumerate() {
            let (m, s) = (stats[2 * i], stats[2 * i + 1]);
            let gs = div(gl, s);
            for j in 0..v {
                let b = if j == t as usize { a } else { 0.0 };
                dx.push(b + gs * exp(x[i * v + j] - m));
            }
        }
        Ok(SpecStorage::new(dx))
    }
}

/// The rows of a head-major `(B, heads, t, d)` buffer of `len` values, in
/// order, as `(b, head, position)`.
fn head_major_rows(len: usize, t: usize, d: usize, heads: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let blocks = len / (t * heads * d).max(1);
    (0..blocks).flat_map(move |b| (0..heads).flat_map(move |hh| (0..t).map(move |p| (b, hh, p))))
}
