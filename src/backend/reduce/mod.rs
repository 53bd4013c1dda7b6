//! Reductions: sum and max over one axis, row softmax and its backward, and
//! the chunked sums of squares behind gradient clipping.
//!
//! ## Contract (every order fixed, the same on both devices)
//! * `reduce(Sum)` over the middle axis of `(outer, r, inner)`:
//!   `acc = −0; for k ascending: acc = acc + x` (−0 is the exact identity).
//! * `reduce(Max)`: `acc = x_0; for k = 1.. ascending: acc = maximum(acc, x_k)`
//!   (NaN propagates, `+0` over `−0`); the empty max (`r = 0`) is −inf,
//!   written as a bit pattern. No max starts from a constant −inf (a shader
//!   compiler may assume no infinities and fold arithmetic on one); starting
//!   from `x_0` is the same bits, as `maximum(−inf, x) = x` for every `x`.
//! * `softmax_rows` over rows of `n`, with a `scale > 0` and a `causal` flag:
//!   the row's values are `v_j = x_j · scale` (`x_j` itself when `scale` is 1);
//!   its live keys are all `n`, or with `causal` (row `r` the query position
//!   `i = r mod n`) the keys `j ≤ i`, and the masked keys `j > i` are never
//!   read. Then `m = v_0` (key 0 is always live), `m = maximum(m, v_j)` over
//!   the other live keys (in any order: it decides only which NaN wins, and
//!   every NaN `m` gives the same outputs); `e_j = exp(v_j − m)` for a live
//!   key and `+0` for a masked one; `s = Σ e_j` over the live keys ascending
//!   from −0; `y = div(e, s)`. No constant −inf takes part: this is bit for
//!   bit the same as masking with `v_j = −inf` and summing every key (a
//!   masked `exp(−inf − m)` is `+0` for a finite `m`, and for a NaN or
//!   infinite `m` some live `e` is NaN, so every `y` is NaN either way; adding
//!   `+0` to a sum changes only a −0, and `s` is never −0 after key 0, as
//!   `exp` never returns −0). For finite `x` it is bit for bit the composition
//!   `softmax(x · scale + mask)` of the separate ops (`x·s + 0 = x·s` up to
//!   the sign of a zero, which `v − m` does not see), without its two passes.
//! * `softmax_rows_backward` from the output `y`, upstream `g` and the same
//!   `scale`: `dot = Σ g·y` ascending from −0 as `fma(g, y, dot)` over the
//!   whole row, `dx = y · (g − dot)`, then `dx · scale` (unless `scale` is 1).
//! * `sum_squares` over buffers: `total = Σ_buffers Σ_chunks (Σ_{i in chunk}
//!   x_i² by fma, ascending from −0)`, chunks of [`NORM_CHUNK`] elements, the
//!   chunk partials added in order on the host.

pub(crate) mod cpu;
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::{observed_value, on_device, primitive};
use super::{Device, Storage};
use crate::Result;

/// Number of elements each partial sum of [`Storage::sum_squares`] covers.
pub const NORM_CHUNK: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// `acc = -0.0; for r ascending: acc = acc + x` (−0 is the exact identity)
    Sum,
    /// `acc = x_0; for k = 1.. ascending: acc = maximum(acc, x_k)` (NaN
    /// propagates); −inf for an empty axis
    Max,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 2] = [ReduceOp::Sum, ReduceOp::Max];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "reduce sum",
            ReduceOp::Max => "reduce max",
        }
    }
    /// The op's code in `reduce.wgsl` (`R_SUM`, `R_MAX`, generated).
    pub fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
        }
    }
}

/// The `R_*` constants, prepended to `reduce.wgsl`.
pub fn wgsl_consts() -> String {
    ReduceOp::ALL
        .iter()
        .map(|op| {
            let n = op.name().trim_start_matches("reduce ").to_uppercase();
            format!("const R_{n}: u32 = {}u;\n", op.code())
        })
        .collect()
}

/// The two devices' reductions (see the module docs for the contract).
pub trait ReduceOps: Sized {
    /// `(outer, r, inner) -> (outer, inner)`.
    fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<Self>;
    /// Softmax over the rows of `(rows, n)` of `x · scale`, causally masked
    /// when `causal`.
    fn softmax_rows(&self, rows: usize, n: usize, scale: f32, causal: bool) -> Result<Self>;
    /// Softmax backward, `self` the forward's output `y`, times `scale`.
    fn softmax_rows_backward(&self, g: &Self, rows: usize, n: usize, scale: f32) -> Result<Self>;
    /// Every buffer's chunk partials of the sum of squares, in buffer order.
    fn chunk_sum_squares(bufs: &[&Self]) -> Result<Vec<f32>>;
}

impl Storage {
    /// Reduces the middle axis of an `(outer, r, inner)` view to `(outer, inner)`.
    pub fn reduce(&self, op: ReduceOp, outer: usize, r: usize, inner: usize) -> Result<Storage> {
        debug_assert_eq!(outer * r * inner, self.len());
        let describe = || format!("({outer}, {r}, {inner}) -> ({outer}, {inner})");
        Ok(primitive!(op.name(), describe, [self] => |x| x.reduce(op, outer, r, inner)))
    }

    /// Row softmax over the last axis of `(rows, n)` of `x · scale` (`scale >
    /// 0`), with keys after the query position masked when `causal` (see the
    /// contract).
    pub fn softmax_rows(&self, rows: usize, n: usize, scale: f32, causal: bool) -> Result<Storage> {
        debug_assert!(scale > 0.0 && scale.is_finite());
        let describe = || format!("rows {rows} n {n} scale {scale:e} causal {causal}");
        Ok(primitive!("softmax", describe, [self] => |x| x.softmax_rows(rows, n, scale, causal)))
    }

    /// Softmax backward from its output `self` and the upstream gradient,
    /// times the forward's `scale`.
    pub fn softmax_rows_backward(
        &self,
        grad: &Storage,
        rows: usize,
        n: usize,
        scale: f32,
    ) -> Result<Storage> {
        let describe = || format!("rows {rows} n {n} scale {scale:e}");
        Ok(primitive!("softmax backward", describe, [self, grad] => |y, g| {
            y.softmax_rows_backward(g, rows, n, scale)
        }))
    }

    /// Sum of squares of all elements of all buffers, as f32 (see the
    /// contract). Used by gradient clipping; the host takes the square root.
    pub fn sum_squares(bufs: &[&Storage]) -> Result<f32> {
        let _prof = crate::profile::scope("sum of squares");
        if bufs.is_empty() {
            return Ok(0.0);
        }
        let partials: Vec<f32> = on_device!(slice bufs => |xs| ReduceOps::chunk_sum_squares(&xs));
        let total = fold_partials(partials);
        let lens = || {
            let l: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
            format!("buffers {l:?}")
        };
        observed_value("sum of squares", lens, &[], bufs[0].device() == Device::Gpu, total)
    }
}

/// The sum of squares' last step: the chunk partials added in order, on the
/// host (the loss scaler's fused check ends the same way).
pub(crate) fn fold_partials(partials: Vec<f32>) -> f32 {
    partials.into_iter().fold(-0.0f32, |t, p| t + p)
}
