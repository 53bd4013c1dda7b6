//! Data movement: strided copies (every view that is not a reshape —
//! transpose, permute, slice, broadcast-expand), concatenation, and the
//! embedding's row gather with its scatter-add backward.
//!
//! ## Contract
//! * `strided_copy`: output element at multi-index `idx` (row-major over
//!   `shape`) reads `src[offset + Σ idx·strides]`; no arithmetic, so no bit
//!   can change.
//! * `concat`: `(outer, sizes[i], inner)` parts joined along the middle axis.
//! * `gather_rows`: row `i` of the output is row `ids[i]` of the table.
//! * `scatter_add_rows` (gather's backward): row `r` of the `(v, d)` output is
//!   `+0.0 + Σ g[i]` over the `i` with `ids[i] == r`, added in ascending `i`
//!   (no float atomics anywhere: deterministic on every device).

mod cpu;
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::primitive;
use super::{Storage, MAX_DIMS};
use crate::{bail, Result};

/// The two devices' data movement (see the module docs for the contract).
pub trait CopyOps: Sized {
    fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Self>;
    fn concat(parts: &[&Self], outer: usize, sizes: &[usize], inner: usize) -> Result<Self>;
    /// `self` is the table `(v, d)`; ids are in range (checked by the caller).
    fn gather_rows(&self, ids: &[u32], d: usize) -> Result<Self>;
    /// `self` is `(ids.len(), d)`; returns `(v, d)`, added to `e` (the
    /// gradient gathered so far, `(v, d)`) as an add would when given.
    fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize, e: Option<&Self>) -> Result<Self>;
}

fn check_ids(ids: &[u32], v: usize) -> Result<()> {
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= v) {
        bail!(Index, "index {bad} out of range for a table of {v} rows");
    }
    Ok(())
}

impl Storage {
    /// Gathers a strided view into a new contiguous buffer.
    pub fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Storage> {
        if shape.len() > MAX_DIMS {
            bail!(
                Shape,
                "view with {} dimensions: at most {MAX_DIMS} are supported",
                shape.len()
            );
        }
        let describe = || format!("shape {shape:?} strides {strides:?} offset {offset}");
        Ok(primitive!("strided copy", describe, [self] => |x| x.strided_copy(shape, strides, offset)))
    }

    /// Concatenates `(outer, sizes[i], inner)` views along the middle axis.
    pub fn concat(parts: &[&Storage], outer: usize, sizes: &[usize], inner: usize) -> Result<Storage> {
        if parts.is_empty() {
            bail!(Shape, "concat of no tensors");
        }
        let describe = || format!("({outer}, {sizes:?}, {inner})");
        Ok(primitive!("concat", describe, slice parts => |xs| CopyOps::concat(&xs, outer, sizes, inner)))
    }

    /// Embedding lookup: `self` is a table `(v, d)`; returns `(ids.len(), d)`.
    pub fn gather_rows(&self, ids: &[u32], d: usize) -> Result<Storage> {
        check_ids(ids, self.len() / d.max(1))?;
        let describe = || format!("{} ids, rows of {d}", ids.len());
        Ok(primitive!("gather rows", describe, [self] => |x| x.gather_rows(ids, d)))
    }

    /// The backward of [`gather_rows`](Self::gather_rows): `self` is
    /// `(ids.len(), d)`; returns `(v, d)`, with `e`'s values added to it
    /// (`e + sum`, the sum an add of its own would form) when given.
    pub fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize, e: Option<&Storage>) -> Result<Storage> {
        check_ids(ids, v)?;
        if let Some(e) = e.filter(|e| e.len() != v * d) {
            bail!(Shape, "scatter-add rows: an earlier gradient of {} values for ({v}, {d})", e.len());
        }
        let describe = || format!("{} ids into ({v}, {d}){}", ids.len(), if e.is_some() { " adding" } else { "" });
        let mut parts = vec![self];
        parts.extend(e);
        Ok(primitive!("scatter-add rows", describe, slice &parts => |xs| xs[0].scatter_add_rows(ids, v, d, xs.get(1).copied())))
    }
}
