//! User-facing ops. Each file holds a family; each op's backward sits right
//! beside its forward, in the closure each op records with its result.

pub mod attention;
pub mod elementwise;
pub mod fp8;
pub mod fused;
pub mod index;
pub mod matmul;
pub mod nn;
pub mod reduce;
pub mod view;

pub use fused::cross_entropy;
pub use nn::{dropout, mse};

use crate::backend::round::Format;
use crate::backend::{Storage, UnaryOp};
use crate::{Result, Tensor};

/// `s` stored in `f` (the autocast policy's format for the op that wrote
/// it): rounded to it, or as it is for float32.
pub(crate) fn stored(s: Storage, f: Option<Format>) -> Result<Storage> {
    match f {
        Some(f) => s.unary(UnaryOp::Round(f)),
        None => Ok(s),
    }
}

/// The gradient arriving for an output stored in `f`: rounded to it (the
/// storage conversion's backward), or as it is for float32.
pub(crate) fn arrived(g: &Tensor, f: Option<Format>) -> Result<Tensor> {
    match f {
        // rounding is idempotent: a gradient a rounded product wrote is
        // passed on as it is, without a copy
        Some(f) if g.half() != Some(f) => {
            Tensor::from_storage(g.storage().unary(UnaryOp::Round(f))?, g.shape())
        }
        _ => Ok(g.clone()),
    }
}

/// `t` stored in `f`: a node whose forward rounds `t` to `f` and whose
/// backward rounds the arriving gradient to `f` (the storage conversion of
/// [`cast`](crate::precision::cast)); `t` itself for float32. For ops the
/// policy rounds after the fact (a residual sum, the embedding's rows).
pub(crate) fn stored_as(t: Tensor, f: Option<Format>) -> Result<Tensor> {
    let Some(f) = f else { return Ok(t) };
    let s = stored(t.storage(), Some(f))?;
    let y = Tensor::record(s, t.shape().to_vec(), "store", &[&t], move |g| {
        Ok(vec![Some(arrived(g, Some(f))?)])
    });
    Ok(y.with_half(Some(f)))
}
