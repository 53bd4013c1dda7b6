//! The spec of the reductions: each fold written out in the contract's order.

#![forbid(unsafe_code)]

use super::{ReduceOp, ReduceOps, NORM_CHUNK};
use crate::backend::math::{div, exp};
use crate::backend::spec::{fma, maximum, SpecStorage};
use crate::Result;

impl ReduceOps for SpecStorage {
    fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<SpecStorage> {
        let x = self.get();
        let mut y = Vec::with_capacity(outer * inner);
        for o in 0..outer {
            for i in 0..inner {
                let mut acc = match op {
                    ReduceOp::Sum => -0.0,
                    ReduceOp::Max => f32::NEG_INFINITY,
                };
                for k in 0..r {
                    let v = x[(o * r + k) * inner + i];
                    acc = match op {
                        ReduceOp::Sum => acc + v,
                        ReduceOp::Max => maximum(acc, v),
                    };
                }
                y.push(acc);
            }
        }
        Ok(SpecStorage::new(y))
    }

    fn softmax_rows(&self, rows: usize, n: usize, scale: f32, causal: bool) -> Result<SpecStorage> {
        let x = self.get();
        let mut y = Vec::with_capacity(rows * n);
        for r in 0..rows {
            let query = r % n.max(1);
            let v: Vec<f32> = (0..n)
                .map(|j| match () {
                    _ if causal && j > query => f32::NEG_INFINITY,
                    _ if scale == 1.0 => x[r * n + j],
                    _ => x[r * n + j] * scale,
                })
                .collect();
            let m = v.iter().fold(f32::NEG_INFINITY, |m, &vj| maximum(m, vj));
            let e: Vec<f32> = v.iter().map(|&vj| exp(vj - m)).collect();
            let s = e.iter().fold(-0.0, |s, &ej| s + ej);
            y.extend(e.iter().map(|&ej| div(ej, s)));
        }
        Ok(SpecStorage::new(y))
    }

    fn softmax_rows_backward(&self, g: &SpecStorage, rows: usize, n: usize, scale: f32) -> Result<SpecStorage> {
        let (y, g) = (self.get(), g.get());
        let mut dx = Vec::with_capacity(rows * n);
        for r in 0..rows {
            let row = r * n..(r + 1) * n;
            let dot = row.clone().fold(-0.0, |dot, i| fma(g[i], y[i], dot));
            for i in row {
                let d = y[i] * (g[i] - dot);
                dx.push(if scale == 1.0 { d } else { d * scale });
            }
        }
        Ok(SpecStorage::new(dx))
    }

    fn chunk_sum_squares(bufs: &[&SpecStorage]) -> Result<Vec<f32>> {
        let mut partials = Vec::new();
        for b in bufs {
            for chunk in b.get().chunks(NORM_CHUNK) {
                partials.push(chunk.iter().fold(-0.0, |acc, &x| fma(x, x, acc)));
            }
        }
        Ok(partials)
    }
}
