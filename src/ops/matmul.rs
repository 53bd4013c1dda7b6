//! Matrix products. Under [`autocast`](crate::precision::autocast) every
//! product is `cast(cast(a) @ cast(b))`: operands rounded to the 16-bit format,
//! f32 accumulation in the contract's order, the output rounded once; its
//! backward products are rounded the same way (the gradient arrives through a
//! cast, so it is rounded too).

use crate::backend::round::Format;
use crate::backend::MatmulDims;
use crate::tensor::autocast::autocast_dtype;
use crate::tensor::saved::Saved;
use crate::tensor::shape::numel;
use crate::{bail, Result, Tensor};

/// `op(a) @ op(b)` over matching leading (batch) axes; `ta`/`tb` read the last
/// two axes transposed. `a: (.., m, k)` (or `(.., k, m)` when `ta`), `b: (.., k, n)`
/// (or `(.., n, k)` when `tb`) -> `(.., m, n)`.
pub fn matmul_with(
    a: &Tensor,
    b: &Tensor,
    ta: bool,
    tb: bool,
    round: Option<Format>,
) -> Result<Tensor> {
    if a.dims() < 2 || b.dims() < 2 {
        bail!(
            Shape,
            "matmul needs at least 2-d operands, got {:?} and {:?}",
            a.shape(),
            b.shape()
        );
    }
    let (ra, rb) = (a.dims(), b.dims());
    let (m, ka) = if ta {
        (a.shape()[ra - 1], a.shape()[ra - 2])
    } else {
        (a.shape()[ra - 2], a.shape()[ra - 1])
    };
    let (kb, n) = if tb {
        (b.shape()[rb - 1], b.shape()[rb - 2])
    } else {
        (b.shape()[rb - 2], b.shape()[rb - 1])
    };
    if ka != kb {
        bail!(
            Shape,
            "matmul: inner dimensions differ ({:?}{} @ {:?}{})",
            a.shape(),
            if ta { "ᵀ" } else { "" },
            b.shape(),
            if tb { "ᵀ" } else { "" }
        );
    }
    let k = ka;
    let b_dims = b.dims();
    let (lead_a, lead_b) = (&a.shape()[..ra - 2], &b.shape()[..rb - 2]);
    let (batch, b_stride, lead) = if lead_b.is_empty() {
        (numel(lead_a), 0, lead_a.to_vec())
    } else if lead_a == lead_b {
        (numel(lead_a), k * n, lead_a.to_vec())
    } else {
        bail!(Shape, "matmul: batch axes {lead_a:?} and {lead_b:?} differ");
    };
    let dims = MatmulDims {
        batch,
        m,
        k,
        n,
        trans_a: ta,
        trans_b: tb,
        a_batch_stride: m * k,
        b_batch_stride: b_stride,
        causal: Default::default(),
    };
    let s = a.storage().matmul(&b.storage(), dims, round)?;
    let mut shape = lead;
    shape.extend([m, n]);
    // Keep each operand only if the other one needs a gradient, as backward
    // reads it: rounded to the format (in 16 bits) under autocast.
    let (ra, rb) = (a.requires_grad(), b.requires_grad());
    let a_kept = rb.then(|| Saved::operand(a, round)).transpose()?;
    let b_kept = ra.then(|| Saved::operand(b, round)).transpose()?;
    let a_shape = a.shape().to_vec();
    let y = Tensor::record(s, shape, "matmul", &[a, b], move |g| {
        let b_kept = b_kept.map(|b| b.get()).transpose()?;
        let a_kept = a_kept.map(|a| a.get()).transpose()?;
        let ga = match &b_kept {
            None => None,
            Some(b) if !ta => Some(matmul_with(g, b, false, !tb, round)?), // dA = dC op(B)ᵀ
            Some(b) => Some(matmul_with(b, g, tb, true, round)?), // dA = (dC op(B)ᵀ)ᵀ = op(B) dCᵀ
        };
        let gb = match &a_kept {
            None => None,
            Some(a) => {
                // With b shared by the batch, fold the batch into the rows.
                let folded = b_dims == 2 && a_shape.len() > 2;
                let (a2, g2) = if folded {
                    let lead: usize = numel(&a_shape[..a_shape.len() - 2]);
                    // op(A) = Aᵀ per batch must be materialised before folding.
                    let a_op = if ta { a.transpose(-1, -2)? } else { a.clone() };
                    (a_op.reshape(&[lead * m, k])?, g.reshape(&[lead * m, n])?)
                } else {
                    (a.clone(), g.clone())
                };
                let ta2 = ta && !folded;
                Some(if !tb {
                    matmul_with(&a2, &g2, !ta2, false, round)? // dB = op(A)ᵀ dC
                } else {
                    matmul_with(&g2, &a2, true, ta2, round)? // dB = (op(A)ᵀ dC)ᵀ = dCᵀ op(A)
                })
            }
        };
        Ok(vec![ga, gb])
    });
    Ok(y.with_half(round))
}

impl Tensor {
    /// `self @ rhs` (batched over leading axes; a 2-d `rhs` is shared by the
    /// batch). Follows the thread's autocast state.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        matmul_with(self, rhs, false, false, autocast_dtype())
    }
    /// `self @ rhsᵀ` without materialising the transpose (Linear's `x Wᵀ`).
    pub fn matmul_t(&self, rhs: &Tensor) -> Result<Tensor> {
        matmul_with(self, rhs, false, true, autocast_dtype())
    }
}
