//! The CPU reference of 16-bit storage: word-aligned chunks on the kernel
//! threads, each a plain loop compiled into the AVX2 copy.

use super::{pattern, widen_bits, PackOps};
use crate::backend::cpu::{cpu_threads, simd, CpuStorage};
use crate::backend::round::{bf16_f32, fp16_f32, round_f32, Format};
use crate::Result;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Words per task: all of them below 2^17 words (handing out a task costs
/// more than such a pass), else an even share of the threads.
fn chunk_words(words: usize) -> usize {
    if words < 1 << 17 {
        return words.max(1);
    }
    words.div_ceil(cpu_threads())
}

impl PackOps for CpuStorage {
    fn pack(&self, fmt: Format) -> Result<(CpuStorage, Option<usize>)> {
        let x = self.f32s();
        let words = x.len().div_ceil(2);
        // No zero fill: the pass writes every word (pairs, then an odd tail).
        let mut w_vec = Vec::<f32>::with_capacity(words);
        let w = &mut w_vec.spare_capacity_mut()[..words];
        let c = chunk_words(words);
        let changed = if c >= words {
            pack_words(w, &x, fmt)
        } else {
            w.par_chunks_mut(c)
                .zip(x.par_chunks(2 * c))
                .map(|(w, x)| pack_words(w, x, fmt))
                .sum()
        };
        // SAFETY: pack_words wrote all `words` words of every chunk.
        unsafe { w_vec.set_len(words) };
        Ok((CpuStorage::from_f32(w_vec), Some(changed)))
    }

    fn unpack(&self, fmt: Format, n: usize) -> Result<CpuStorage> {
        let w = self.f32s();
        // the words hold exactly n values, or some outputs would go unwritten
        assert_eq!(w.len(), n.div_ceil(2), "16-bit storage of {n} values");
        // No zero fill: the pass writes every value (pairs, then an odd tail).
        let mut y_vec = Vec::<f32>::with_capacity(n);
        let y = &mut y_vec.spare_capacity_mut()[..n];
        let c = chunk_words(w.len());
        if c >= w.len() {
            unpack_words(y, &w, fmt);
        } else {
            y.par_chunks_mut(2 * c)
                .zip(w.par_chunks(c))
                .for_each(|(y, w)| unpack_words(y, w, fmt));
        }
        // SAFETY: unpack_words wrote all `n` values of every chunk.
        unsafe { y_vec.set_len(n) };
        Ok(CpuStorage::from_f32(y_vec))
    }
}

simd::multiversion! {
    /// x: (n) -> w: (⌈n/2⌉), every word written; returns how many values
    /// rounding changed (NaNs aside).
    fn pack_words(w: &mut [MaybeUninit<f32>], x: &[f32], fmt: Format) -> usize {
        let differs = |r: f32, v: f32| u32::from(r.to_bits() != v.to_bits() && !v.is_nan());
        let mut changed = 0u32;
        let pairs = x.len() / 2;
        match fmt {
            // branch-free, so the loop vectorises: the pattern is the top half
            Format::Bf16 => {
                for (w, p) in w.iter_mut().zip(x.chunks_exact(2)) {
                    let (a, b) = (bf16_f32(p[0]), bf16_f32(p[1]));
                    changed += differs(a, p[0]) + differs(b, p[1]);
                    w.write(f32::from_bits((a.to_bits() >> 16) | (b.to_bits() & 0xffff_0000)));
                }
            }
            Format::Fp16 => {
                for (w, p) in w.iter_mut().zip(x.chunks_exact(2)) {
                    let (a, b) = (fp16_f32(p[0]), fp16_f32(p[1]));
                    changed += differs(a, p[0]) + differs(b, p[1]);
                    w.write(f32::from_bits(pattern(a, fmt) | (pattern(b, fmt) << 16)));
                }
            }
        }
        if x.len() % 2 == 1 {
            let v = x[x.len() - 1];
            let r = round_f32(v, fmt);
            changed += differs(r, v);
            w[pairs].write(f32::from_bits(pattern(r, fmt)));
        }
        changed as usize
    }
}

simd::multiversion! {
    /// w: (⌈n/2⌉) -> y: (n), every value written
    fn unpack_words(y: &mut [MaybeUninit<f32>], w: &[f32], fmt: Format) {
        let pairs = y.len() / 2;
        match fmt {
            Format::Bf16 => {
                for (p, w) in y.chunks_exact_mut(2).zip(w) {
                    let b = w.to_bits();
                    p[0].write(f32::from_bits(b << 16));
                    p[1].write(f32::from_bits(b & 0xffff_0000));
                }
            }
            Format::Fp16 => {
                for (p, w) in y.chunks_exact_mut(2).zip(w) {
                    let b = w.to_bits();
                    p[0].write(f32::from_bits(widen_bits(b & 0xffff, fmt)));
                    p[1].write(f32::from_bits(widen_bits(b >> 16, fmt)));
                }
            }
        }
        if y.len() % 2 == 1 {
            y[y.len() - 1].write(f32::from_bits(widen_bits(w[pairs].to_bits() & 0xffff, fmt)));
        }
    }
}
