//! Batched matrix products: `C[b] = op(A[b]) @ op(B[b])`, with transposed
//! operands read in place and, under autocast, rounding to bf16/fp16.
//!
//! ## Contract
//! Each output is `acc = +0.0; for p in 0..k ascending: acc = fma(a[i,p],
//! b[p,j], acc)`. With `round = Some(fmt)` both operands are rounded to `fmt`
//! as they are read and the output is rounded once. Tiling and threading may
//! split rows, columns and batches, never `k`; rounding is idempotent, so a
//! kernel may round an operand once when it loads (or packs) a tile.

mod cpu;
pub(crate) mod gpu;

use super::round::Format;
use super::Storage;
use super::on_device;
use crate::Result;

/// A batched matmul `C[b] = op(A[b]) @ op(B[b])`, `op(A)` of shape (m, k),
/// `op(B)` of shape (k, n). `trans_a` means A is stored (k, m); `trans_b`, B
/// stored (n, k). A batch stride of 0 broadcasts one matrix over the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulDims {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a_batch_stride: usize,
    pub b_batch_stride: usize,
}

/// The two devices' products (see the module docs for the contract).
pub trait MatmulOps: Sized {
    fn matmul(&self, rhs: &Self, d: MatmulDims, round: Option<Format>) -> Result<Self>;
}

impl Storage {
    /// The contract's matmul; `self` is A, `rhs` is B.
    pub fn matmul(&self, rhs: &Storage, dims: MatmulDims, round: Option<Format>) -> Result<Storage> {
        let _prof = crate::profile::product_scope(crate::profile::Product {
            batch: dims.batch,
            m: dims.m,
            k: dims.k,
            n: dims.n,
            trans_a: dims.trans_a,
            trans_b: dims.trans_b,
        });
        Ok(on_device!([self, rhs] => |a, b| a.matmul(b, dims, round)))
    }
}
