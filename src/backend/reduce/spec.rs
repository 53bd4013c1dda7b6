//! The spec of the reductions: each fold written out in the contract's order.

#![forbid(unsafe_code)]

use super::{ReduceOp, ReduceOps, NORM_CHUNK};
use crate::backend::math::{div, exp};
use crate::backend::spec::{fma, maximum, SpecStorage};
use crate::Result;

/// The empty max, −inf, as a bit pattern (never an operand of arithmetic).
const NEG_INF_BITS: u32 = 0xff80_0000;

impl ReduceOps for SpecStorage {
    fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<SpecStorage> {
        let x = self.get();
        let mut y = Vec::with_capacity(outer * inner);
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| x[(o * r + k) * inner + i];
                let acc = match op {
                    ReduceOp::Sum => (0..r).fold(-0.0, |acc, k| acc + at(k)),
                    // from the first element; the empty max is -inf, written as bits
                    ReduceOp::Max if r == 0 => f32::from_bits(NEG_INF_BITS),
                    ReduceOp::Max => (1..r).fold(at(0), |acc, k| maximum(acc, at(k))),
                };
                y.push(acc);
            }
        }
        Ok(SpecStorage::new(y))
    }

    fn softmax_rows(&self, rows: usize, n: usize, scale: f32, causal: bool) -> Result<SpecStorage> {
        let x = self.get();
        let mut y = Vec::with_capacity(rows * n);
        if n == 0 {
            return Ok(SpecStorage::new(y));
        }
        for r in 0..rows {
            // the live keys: all n, or with causal those up to the query position
            let live = if causal { r % n + 1 } else { n };
            let v = |j: usize| if scale == 1.0 { x[r * n + j] } else { x[r * n + j] * scale };
            let m = (1..live).fold(v(0), |m, j| maximum(m, v(j)));
            let e: Vec<f32> = (0..n).map(|j| if j < live { exp(v(j) - m) } else { 0.0 }).collect();
            let s = e[..live].iter().fold(-0.0, |s, &ej| s + ej);
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
