//! The spec of data movement: every output element read from its source.

#![forbid(unsafe_code)]

use super::CopyOps;
use crate::backend::spec::{dot, multi_index, SpecStorage};
use crate::Result;

impl CopyOps for SpecStorage {
    fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<SpecStorage> {
        let x = self.get();
        let n: usize = shape.iter().product();
        let out = (0..n).map(|i| x[offset + dot(&multi_index(i, shape), strides)]).collect();
        Ok(SpecStorage::new(out))
    }

    fn concat(parts: &[&SpecStorage], outer: usize, sizes: &[usize], inner: usize) -> Result<SpecStorage> {
        let mut out = Vec::new();
        for o in 0..outer {
            for (part, &size) in parts.iter().zip(sizes) {
                let x = part.get();
                out.extend_from_slice(&x[o * size * inner..(o + 1) * size * inner]);
            }
        }
        Ok(SpecStorage::new(out))
    }

    fn gather_rows(&self, ids: &[u32], d: usize) -> Result<SpecStorage> {
        let table = self.get();
        let mut out = Vec::with_capacity(ids.len() * d);
        for &id in ids {
            let row = id as usize * d;
            out.extend_from_slice(&table[row..row + d]);
        }
        Ok(SpecStorage::new(out))
    }

    fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize, e: Option<&SpecStorage>) -> Result<SpecStorage> {
        let g = self.get();
        let mut out = Vec::with_capacity(v * d);
        for r in 0..v {
            for j in 0..d {
                let mut acc = 0.0f32;
                for (i, &id) in ids.iter().enumerate() {
                    if id as usize == r {
                        acc += g[i * d + j];
                    }
                }
                // the earlier gradient plus the sum, as an add adds them
                out.push(match e {
                    Some(e) => e.get()[r * d + j] + acc,
                    None => acc,
                });
            }
        }
        Ok(SpecStorage::new(out))
    }
}
