//! The CPU reference of the data movement primitives.

use super::CopyOps;
use crate::backend::cpu::pool;
use crate::backend::cpu::{
    both, cpu_threads, fill, for_each_run, new_vec, simd, split_at_starts, split_layout, write_exact,
    CpuStorage, Elem,
};
use crate::backend::elementwise::ElementwiseOps;
use crate::backend::{BinaryLayout, BinaryOp};
use crate::Result;
use std::mem::MaybeUninit;

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

    fn scatter_add_rows(&self, ids: &[u32], v: usize, d: usize, e: Option<&CpuStorage>) -> Result<CpuStorage> {
        let sums = both!(self, g => {
            let mut out = vec![Elem::ZERO; v * d];
            for (n, &i) in ids.iter().enumerate() {
                let row = &mut out[i as usize * d..(i as usize + 1) * d];
                row.iter_mut().zip(&g[n * d..(n + 1) * d]).for_each(|(o, &x)| *o = Elem::add(*o, x));
            }
            out
        });
        match e {
            // the earlier gradient plus the sums, as an add of its own adds them
            Some(e) => e.binary(&sums, BinaryOp::Add, &BinaryLayout::flat(v * d)),
            None => Ok(sums),
        }
    }
}

/// The values of a strided view, its pieces (see `split_layout`) on the
/// threads.
fn strided_copy_t<T: Elem>(x: &[T], shape: &[usize], strides: &[usize], offset: usize) -> Vec<T> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Vec::new();
    }
    let layout = BinaryLayout {
        shape: shape.to_vec(),
        lhs_strides: strides.to_vec(),
        rhs_strides: vec![0; shape.len()],
    };
    let x = &x[offset..];
    let pieces = split_layout(&layout, cpu_threads());
    new_vec(n, |out, written| {
        let outs = split_at_starts(out, &pieces);
        written.add_all(pool::map(outs.into_iter().zip(&pieces), |(o, (_, start, _, piece))| {
            copy_piece(o, &x[*start..], piece)
        }));
    })
}

simd::multiversion! {
    /// One piece of a strided view into `o` (the piece's size), handed back written.
    fn copy_piece<'o, T: Elem>(o: &'o mut [MaybeUninit<T>], x: &[T], piece: &BinaryLayout) -> &'o mut [T] {
        fill(o, |o, written| {
            let mut rest = o;
            for_each_run(piece, |li, _, len, lst, _| {
                let (o, tail) = std::mem::take(&mut rest).split_at_mut(len);
                rest = tail;
                written.add(if lst == 1 {
                    write_exact(o, x[li..li + len].iter().copied())
                } else {
                    write_exact(o, (0..len).map(|t| x[li + t * lst]))
                });
            });
            assert!(rest.is_empty(), "the view covers the output");
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::set_cpu_threads;

    /// A transposed view with an offset, large enough to be split over the
    /// threads, against each value read at its own index.
    #[test]
    fn threaded_strided_copies_read_each_value_at_its_index() {
        let (r, c, off) = (257, 133, 5);
        assert!(r * c >= pool::SPLIT_VALUES);
        let x: Vec<f32> = (0..r * c + off).map(|i| i as f32).collect();
        for threads in [1, 3] {
            set_cpu_threads(Some(threads));
            // the (c, r) transpose of the (r, c) rows after `off`, and those rows as they are
            for (shape, strides) in [([c, r], [1, c]), ([r, c], [c, 1])] {
                let got = strided_copy_t(&x, &shape, &strides, off);
                assert_eq!(got.len(), r * c);
                for (k, &v) in got.iter().enumerate() {
                    let (i, j) = (k / shape[1], k % shape[1]);
                    assert_eq!(v, x[off + i * strides[0] + j * strides[1]], "{shape:?} output {k}, {threads} threads");
                }
            }
        }
        set_cpu_threads(None);
    }
}
