//! Shapes, strides and broadcasting (NumPy rules).

use crate::{bail, Result};

/// The number of elements of a tensor of `shape` (1 for the empty shape).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Row-major strides of a contiguous tensor.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![0; shape.len()];
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        s[d] = acc;
        acc *= shape[d];
    }
    s
}

/// The broadcast shape of two shapes, or an error naming both.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i < n - a.len() {
            1
        } else {
            a[i - (n - a.len())]
        };
        let db = if i < n - b.len() {
            1
        } else {
            b[i - (n - b.len())]
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => bail!(Shape, "shapes {a:?} and {b:?} do not broadcast"),
        };
    }
    Ok(out)
}

/// Strides that read a contiguous tensor of shape `src` as if it had shape
/// `out` (0 along broadcast dimensions).
pub fn broadcast_strides(src: &[usize], out: &[usize]) -> Vec<usize> {
    let cs = contiguous_strides(src);
    let lead = out.len() - src.len();
    (0..out.len())
        .map(|i| {
            if i < lead || src[i - lead] == 1 {
                0
            } else {
                cs[i - lead]
            }
        })
        .collect()
}

/// Resolves a possibly negative axis.
pub fn axis(ax: isize, rank: usize) -> Result<usize> {
    let a = if ax < 0 { ax + rank as isize } else { ax };
    if a < 0 || a as usize >= rank.max(1) {
        bail!(Shape, "axis {ax} out of range for a tensor of rank {rank}");
    }
    Ok(a as usize)
}
