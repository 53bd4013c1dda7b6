//! Reductions over axes. Order (the contract's): each reduced axis is summed
//! ascending from −0 by the `reduce` primitive; several axes are reduced one
//! after another, innermost first.

use crate::backend::ReduceOp;
use crate::tensor::shape::{axis, numel};
use crate::{bail, Result, Tensor};

fn split(shape: &[usize], ax: usize) -> (usize, usize, usize) {
    (numel(&shape[..ax]), shape[ax], numel(&shape[ax + 1..]))
}

impl Tensor {
    fn reduce_axis(&self, op: ReduceOp, ax: isize, keepdim: bool) -> Result<(Tensor, Vec<usize>)> {
        let ax = axis(ax, self.dims())?;
        if self.dims() == 0 {
            bail!(Shape, "reduction over an axis of a 0-d tensor");
        }
        let (o, r, i) = split(self.shape(), ax);
        let s = self.storage().reduce(op, o, r, i)?;
        let mut kshape = self.shape().to_vec();
        kshape[ax] = 1;
        let mut out = kshape.clone();
        if !keepdim {
            out.remove(ax);
        }
        let _ = s.len();
        Ok((Tensor::from_storage(s, &out)?, kshape))
    }

    /// Sum over one axis; backward broadcasts `g` back.
    pub fn sum(&self, ax: isize, keepdim: bool) -> Result<Tensor> {
        let (y, kshape) = self.reduce_axis(ReduceOp::Sum, ax, keepdim)?;
        let in_shape = self.shape().to_vec();
        Ok(Tensor::record(
            y.storage(),
            y.shape().to_vec(),
            "sum",
            &[self],
            move |g| Ok(vec![Some(g.reshape(&kshape)?.broadcast_to(&in_shape)?)]),
        ))
    }

    /// Sum of every element, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])?.sum(0, false)
    }

    /// Mean over one axis: the sum divided by the count (the crate's division).
    pub fn mean(&self, ax: isize, keepdim: bool) -> Result<Tensor> {
        // the sum checks the axis (a 0-d tensor has none)
        let total = self.sum(ax, keepdim)?;
        let n = self.shape()[axis(ax, self.dims())?];
        total.div_scalar(n as f64)
    }

    /// Mean of every element, as a 0-d tensor.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.sum_all()?.div_scalar(self.numel() as f64)
    }

    /// Maximum over one axis (NaN propagates). Backward: the gradient is shared
    /// equally among the positions that attain the maximum.
    pub fn max(&self, ax: isize, keepdim: bool) -> Result<Tensor> {
        let (y, kshape) = self.reduce_axis(ReduceOp::Max, ax, keepdim)?;
        let x = self.clone();
        let yk = y.reshape(&kshape)?;
        let axu = axis(ax, self.dims())? as isize;
        Ok(Tensor::record(
            y.storage(),
            y.shape().to_vec(),
            "max",
            &[self],
            move |g| {
                let mask = x.detach().eq_mask(&yk)?;
                let count = mask.sum(axu, true)?;
                Ok(vec![Some(g.reshape(&kshape)?.div(&count)?.mul(&mask)?)])
            },
        ))
    }

    /// Sums a broadcast result back to `shape` (the backward of broadcasting):
    /// leading extra axes and axes where `shape` has 1 are summed, innermost first.
    pub fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let lead = self.dims() - shape.len();
        let mut t = self.clone();
        for ax in (0..self.dims()).rev() {
            let keep = ax >= lead && shape[ax - lead] == t.shape()[ax];
            if !keep && t.shape()[ax] != 1 || (ax < lead) {
                t = t.sum(ax as isize, true)?;
            }
        }
        t.reshape(shape)
    }
}
