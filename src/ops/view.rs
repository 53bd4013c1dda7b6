//! Shape ops: reshape, permute/transpose, narrow (slice), cat, broadcast.
//! Tensors are always contiguous; a view that is not a reshape is one
//! `strided_copy` (its backward is the inverse view).

use crate::backend::Storage;
use crate::tensor::shape::{axis, broadcast_strides, contiguous_strides, numel};
use crate::{bail, Result, Tensor};

impl Tensor {
    /// Same values, another shape with the same number of elements (no copy).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            bail!(
                Shape,
                "cannot reshape {:?} ({} elements) to {shape:?}",
                self.shape(),
                self.numel()
            );
        }
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let in_shape = self.shape().to_vec();
        Ok(Tensor::record(
            self.storage(),
            shape.to_vec(),
            "reshape",
            &[self],
            move |g| Ok(vec![Some(g.reshape(&in_shape)?)]),
        )
        .same_values_as(self))
    }

    /// Reorders the axes: output axis `i` is input axis `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let n = self.dims();
        let mut seen = vec![false; n];
        if perm.len() != n
            || perm
                .iter()
                .any(|&p| p >= n || std::mem::replace(&mut seen[p], true))
        {
            bail!(Shape, "permute {perm:?} is not a permutation of {n} axes");
        }
        let cs = contiguous_strides(self.shape());
        let shape: Vec<usize> = perm.iter().map(|&p| self.shape()[p]).collect();
        let strides: Vec<usize> = perm.iter().map(|&p| cs[p]).collect();
        let s = self.storage().strided_copy(&shape, &strides, 0)?;
        let mut inv = vec![0; n];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(Tensor::record(s, shape, "permute", &[self], move |g| {
            Ok(vec![Some(g.permute(&inv)?)])
        })
        .with_half(self.half()))
    }

    /// Swaps two axes.
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let (a, b) = (axis(a, self.dims())?, axis(b, self.dims())?);
        let mut perm: Vec<usize> = (0..self.dims()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// `len` entries of axis `ax` starting at `start`.
    pub fn narrow(&self, ax: isize, start: usize, len: usize) -> Result<Tensor> {
        let ax = axis(ax, self.dims())?;
        let full = self.shape()[ax];
        if start + len > full {
            bail!(
                Shape,
                "narrow {start}..{} out of range for axis {ax} of size {full}",
                start + len
            );
        }
        let cs = contiguous_strides(self.shape());
        let mut shape = self.shape().to_vec();
        shape[ax] = len;
        let s = self.storage().strided_copy(&shape, &cs, start * cs[ax])?;
        let in_shape = self.shape().to_vec();
        Ok(Tensor::record(s, shape, "narrow", &[self], move |g| {
            // Pad the gradient back with zeros on both sides.
            let mut parts = Vec::new();
            let mut zshape = in_shape.clone();
            if start > 0 {
                zshape[ax] = start;
                parts.push(Tensor::zeros(&zshape, g.dtype(), g.device())?);
            }
            parts.push(g.clone());
            if start + len < full {
                zshape[ax] = full - start - len;
                parts.push(Tensor::zeros(&zshape, g.dtype(), g.device())?);
            }
            Ok(vec![Some(Tensor::cat(
                &parts.iter().collect::<Vec<_>>(),
                ax as isize,
            )?)])
        }))
    }

    /// Concatenates along axis `ax`; all other axes must agree.
    pub fn cat(parts: &[&Tensor], ax: isize) -> Result<Tensor> {
        let first = parts
            .first()
            .ok_or_else(|| crate::Error::shape("cat of no tensors"))?;
        let ax = axis(ax, first.dims())?;
        for p in parts {
            if p.dims() != first.dims()
                || (0..first.dims()).any(|d| d != ax && p.shape()[d] != first.shape()[d])
            {
                bail!(
                    Shape,
                    "cat along axis {ax}: shapes {:?} and {:?} differ elsewhere",
                    first.shape(),
                    p.shape()
                );
            }
        }
        let sizes: Vec<usize> = parts.iter().map(|p| p.shape()[ax]).collect();
        let outer = numel(&first.shape()[..ax]);
        let inner = numel(&first.shape()[ax + 1..]);
        let storages: Vec<Storage> = parts.iter().map(|p| p.storage()).collect();
        let s = Storage::concat(&storages.iter().collect::<Vec<_>>(), outer, &sizes, inner)?;
        let mut shape = first.shape().to_vec();
        shape[ax] = sizes.iter().sum();
        Ok(Tensor::record(s, shape, "cat", parts, move |g| {
            let mut out = Vec::new();
            let mut start = 0;
            for &sz in &sizes {
                out.push(Some(g.narrow(ax as isize, start, sz)?));
                start += sz;
            }
            Ok(out)
        }))
    }

    /// Materialises the broadcast of `self` to `shape`; backward sums back.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let bs = crate::tensor::shape::broadcast_shape(self.shape(), shape)?;
        if bs != shape {
            bail!(Shape, "cannot broadcast {:?} to {shape:?}", self.shape());
        }
        let s = self
            .storage()
            .strided_copy(shape, &broadcast_strides(self.shape(), shape), 0)?;
        let in_shape = self.shape().to_vec();
        Ok(Tensor::record(
            s,
            shape.to_vec(),
            "broadcast_to",
            &[self],
            move |g| Ok(vec![Some(g.sum_to(&in_shape)?)]),
        ))
    }
}
