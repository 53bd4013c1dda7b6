//! The CPU reference of the data movement primitives.

use super::CopyOps;
use crate::backend::cpu::{both, for_each_run, CpuStorage, Elem};
use crate::backend::BinaryLayout;
use crate::Result;

impl CopyOps for CpuStorage {
    fn strided_copy(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<CpuStorage> {
        Ok(both!(self, x => strided_copy_t(x, shape, strides, offset)))
    }

    fn concat(parts: &[&CpuStorage], outer: usize, sizes: &[usize], inner: usize) -> Result<CpuStorage> {
        Ok(match parts[0] {
            CpuStorage::F32(_) => {
                let guards: Vec<_> = parts.iter().map(|p| p.f32s()).collect();
                let slices: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
                f32::wrap(concat_t(&slices, outer, sizes, inner))
            }
            CpuStorage::F64(_) => {
                let guards: Vec<_> = parts
                    .iter()
                    .map(|p| match p {
                        CpuStorage::F64(b) => b.get(),
                        CpuStorage::F32(_) => unreachable!("dtypes checked by the dispatch"),
                    })
                    .collect();
                let slices: Vec<&[f64]> = guards.iter().map(|g| g.as_slice()).collect();
                f64::wrap(concat_t(&slices, outer, sizes, inner))
            }
        })
    }

    fn gather_rows(&self, ids: &[u32], d: usize) -> Result<CpuStorage> {
        Ok(both!(self, x => {
            let mut out = Vec::with_capacity(ids.len() * d);
            for &i in ids {
                out.extend_from_slice(&x[i as usize * d..(i as usize + 1) * d]);
            }
            out
        }))
    }

    fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize) -> Result<CpuStorage> {
        Ok(both!(self, g => {
            let mut out = vec![Elem::ZERO; v * d];
            for (n, &i) in ids.iter().enumerate() {
                let row = &mut out[i as usize * d..(i as usize + 1) * d];
                row.iter_mut().zip(&g[n * d..(n + 1) * d]).for_each(|(o, &x)| *o = Elem::add(*o, x));
            }
            out
        }))
    }
}

fn strided_copy_t<T: Elem>(x: &[T], shape: &[usize], strides: &[usize], offset: usize) -> Vec<T> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let layout = BinaryLayout {
        shape: shape.to_vec(),
        lhs_strides: strides.to_vec(),
        rhs_strides: vec![0; shape.len()],
    };
    let x = &x[offset..];
    for_each_run(&layout, |li, _, len, lst, _| {
        if lst == 1 {
            out.extend_from_slice(&x[li..li + len]);
        } else {
            out.extend((0..len).map(|t| x[li + t * lst]));
        }
    });
    out
}

fn concat_t<T: Elem>(parts: &[&[T]], outer: usize, sizes: &[usize], inner: usize) -> Vec<T> {
    let total: usize = sizes.iter().sum();
    let mut out = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for (p, &s) in parts.iter().zip(sizes) {
            out.extend_from_slice(&p[o * s * inner..(o + 1) * s * inner]);
        }
    }
    out
}
