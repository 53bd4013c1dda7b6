//! The CPU reference of 16-bit storage: word-aligned chunks on the kernel
//! threads, each a plain loop compiled into the AVX2 copy — and for bf16,
//! where the CPU has AVX-512F, 16 values per step with the rounding, the
//! count of changed values and the narrowing to 16 bits in vector registers.

use super::{pattern, widen_bits, PackOps};
use crate::backend::cpu::pool;
use crate::backend::cpu::{cpu_threads, simd, CpuStorage};
use crate::backend::round::{bf16_f32, fp16_f32, round_f32, Format};
use crate::Result;
use std::mem::MaybeUninit;

/// Words per task: all of them below [`pool::SPLIT_VALUES`] values, else an
/// even share of the threads.
fn chunk_words(words: usize) -> usize {
    if 2 * words < pool::SPLIT_VALUES {
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
        let kernel = match fmt {
            #[cfg(target_arch = "x86_64")]
            Format::Bf16 if simd::level() == simd::Level::Avx512 => avx512::pack_bf16,
            _ => pack_words,
        };
        let c = chunk_words(words);
        let changed = if c >= words {
            kernel(w, &x, fmt)
        } else {
            pool::map(w.chunks_mut(c).zip(x.chunks(2 * c)), |(w, x)| kernel(w, x, fmt))
                .into_iter()
                .sum()
        };
        // SAFETY: the kernel wrote all `words` words of every chunk.
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
        let kernel = match fmt {
            #[cfg(target_arch = "x86_64")]
            Format::Bf16 if simd::level() == simd::Level::Avx512 => avx512::unpack_bf16,
            _ => unpack_words,
        };
        let c = chunk_words(w.len());
        if c >= w.len() {
            kernel(y, &w, fmt);
        } else {
            pool::each(y.chunks_mut(2 * c).zip(w.chunks(c)), |(y, w)| kernel(y, w, fmt));
        }
        // SAFETY: the kernel wrote all `n` values of every chunk.
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

/// bf16 storage on 16 lanes: [`pack_words`] and [`unpack_words`] step for
/// step. The words, read as 16-bit halves (little-endian: the low half
/// first), are the values' patterns in order, so a vector of 16 values
/// narrows to 16 halves — 8 words — with one instruction. Whole groups of 16
/// values here; the rest (fewer than 8 words) through the plain loops.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{pack_words, unpack_words};
    use crate::backend::round::{bf16_lanes_avx512, Format};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// [`pack_words`] for bf16 (`fmt` is bf16).
    pub(super) fn pack_bf16(w: &mut [MaybeUninit<f32>], x: &[f32], fmt: Format) -> usize {
        assert!(fmt == Format::Bf16 && is_x86_feature_detected!("avx512f"));
        assert_eq!(w.len(), x.len().div_ceil(2));
        let groups = x.len() / 16;
        // SAFETY: the CPU has AVX-512F (checked above); `groups` groups of 16
        // values fill the first `8 · groups` words.
        let changed = unsafe { pack_groups(w[..8 * groups].as_mut_ptr().cast(), &x[..16 * groups]) };
        changed + pack_words(&mut w[8 * groups..], &x[16 * groups..], fmt)
    }

    /// `x`'s rounded patterns (whole groups of 16), in order, into the halves
    /// at `h`; returns how many values rounding changed (NaNs aside).
    ///
    /// # Safety
    /// AVX-512F; `h` is valid for `x.len()` halves.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_groups(h: *mut u16, x: &[f32]) -> usize {
        let mut changed = 0;
        for (i, g) in x.chunks_exact(16).enumerate() {
            // SAFETY: `g` holds 16 values; `h` holds 16 halves per group.
            unsafe {
                let v = _mm512_loadu_ps(g.as_ptr());
                let (b, r) = (_mm512_castps_si512(v), _mm512_castps_si512(bf16_lanes_avx512(v)));
                let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff)), _mm512_set1_epi32(0x7f80_0000));
                changed += (_mm512_cmpneq_epi32_mask(r, b) & !nan).count_ones() as usize;
                _mm256_storeu_si256(h.add(16 * i).cast(), _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(r)));
            }
        }
        changed
    }

    /// [`unpack_words`] for bf16 (`fmt` is bf16).
    pub(super) fn unpack_bf16(y: &mut [MaybeUninit<f32>], w: &[f32], fmt: Format) {
        assert!(fmt == Format::Bf16 && is_x86_feature_detected!("avx512f"));
        assert_eq!(w.len(), y.len().div_ceil(2));
        let groups = y.len() / 16;
        // SAFETY: the CPU has AVX-512F (checked above); the first `8 · groups`
        // words hold the groups' halves.
        unsafe { unpack_groups(&mut y[..16 * groups], w[..8 * groups].as_ptr().cast()) };
        unpack_words(&mut y[16 * groups..], &w[8 * groups..], fmt);
    }

    /// `y[i]` the float32 of half `i` at `h`, whole groups of 16 (every value
    /// written).
    ///
    /// # Safety
    /// AVX-512F; `h` is valid for `y.len()` halves.
    #[target_feature(enable = "avx512f")]
    unsafe fn unpack_groups(y: &mut [MaybeUninit<f32>], h: *const u16) {
        for (i, g) in y.chunks_exact_mut(16).enumerate() {
            // SAFETY: `g` holds 16 values; `h` holds 16 halves per group.
            unsafe {
                let halves = _mm256_loadu_si256(h.add(16 * i).cast());
                let v = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves));
                _mm512_storeu_ps(g.as_mut_ptr().cast(), _mm512_castsi512_ps(v));
            }
        }
    }
}
