//! The CPU reference of 16-bit storage: word-aligned chunks on the kernel
//! threads, each a plain loop compiled into the AVX2 copy — and for bf16,
//! where the CPU has AVX-512F, 16 values per step with the rounding, the
//! count of changed values and the narrowing to 16 bits in vector registers.

use super::{pattern, widen_bits, PackOps};
use crate::backend::cpu::pool;
use crate::backend::cpu::{assume_init_mut, cpu_threads, fill, new_vec, simd, write_exact, CpuStorage};
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
        let kernel = pack_kernel(fmt);
        let c = chunk_words(words);
        let mut changed = 0;
        // No zero fill: the pass writes every word (pairs, then an odd tail).
        let w = new_vec(words, |w, written| {
            if c >= words {
                let (w, n) = kernel(w, &x, fmt);
                written.add(w);
                changed = n;
            } else {
                for (w, n) in pool::map(w.chunks_mut(c).zip(x.chunks(2 * c)), |(w, x)| kernel(w, x, fmt)) {
                    written.add(w);
                    changed += n;
                }
            }
        });
        Ok((CpuStorage::from_f32(w), Some(changed)))
    }

    /// One value at a time: only the batched attention (spec and GPU) permutes
    /// 16-bit values this way; the CPU's attention reads them in place.
    fn unpack_strided(&self, fmt: Format, shape: &[usize], strides: &[usize], offset: usize) -> Result<CpuStorage> {
        let w = self.f32s();
        let n: usize = shape.iter().product();
        let mut y = Vec::with_capacity(n);
        for i in 0..n {
            // i's multi-index, innermost axis first, onto the view's strides
            let (mut rest, mut e) = (i, offset);
            for (&s, &st) in shape.iter().zip(strides).rev() {
                e += (rest % s) * st;
                rest /= s;
            }
            let h = (w[e / 2].to_bits() >> (16 * (e % 2))) & 0xffff;
            y.push(f32::from_bits(super::widen_bits(h, fmt)));
        }
        Ok(CpuStorage::from_f32(y))
    }

    fn unpack(&self, fmt: Format, n: usize) -> Result<CpuStorage> {
        let w = self.f32s();
        // the words hold exactly n values, or some outputs would go unwritten
        assert_eq!(w.len(), n.div_ceil(2), "16-bit storage of {n} values");
        let kernel = unpack_kernel(fmt);
        let c = chunk_words(w.len());
        // No zero fill: the pass writes every value (pairs, then an odd tail).
        let y = new_vec(n, |y, written| {
            if c >= w.len() {
                written.add(kernel(y, &w, fmt));
            } else {
                written.add_all(pool::map(y.chunks_mut(2 * c).zip(w.chunks(c)), |(y, w)| kernel(y, w, fmt)));
            }
        });
        Ok(CpuStorage::from_f32(y))
    }
}

/// The widest unpack pass this CPU has for `fmt`.
fn unpack_kernel(fmt: Format) -> UnpackWords {
    match fmt {
        #[cfg(target_arch = "x86_64")]
        Format::Bf16 if simd::level() == simd::Level::Avx512 => avx512::unpack_bf16,
        _ => unpack_words,
    }
}

/// Values `0..n` of the 16-bit `words` (`fmt`), widened on the calling
/// thread: a block of an operand that a kernel reads from its kept copy.
pub(crate) fn widen_words(words: &[f32], fmt: Format, n: usize) -> Vec<f32> {
    new_vec(n, |y, written| written.add(unpack_kernel(fmt)(y, &words[..n.div_ceil(2)], fmt)))
}

/// A pack pass over one chunk: `(words, values, format)`, the words handed
/// back written with how many values rounding changed.
pub(crate) type PackWords = for<'w> fn(&'w mut [MaybeUninit<f32>], &[f32], Format) -> (&'w mut [f32], usize);

/// The pack kernel of `fmt` on this CPU: values to words, with how many
/// values rounding changed.
pub(crate) fn pack_kernel(fmt: Format) -> PackWords {
    match fmt {
        #[cfg(target_arch = "x86_64")]
        Format::Bf16 if simd::level() == simd::Level::Avx512 => avx512::pack_bf16,
        _ => pack_words,
    }
}
/// An unpack pass over one chunk: `(values, words, format)`, the values
/// handed back written.
type UnpackWords = for<'y> fn(&'y mut [MaybeUninit<f32>], &[f32], Format) -> &'y mut [f32];

simd::multiversion! {
    /// x: (n) -> w: (⌈n/2⌉), every word written and handed back, with how
    /// many values rounding changed (NaNs aside).
    fn pack_words<'w>(w: &'w mut [MaybeUninit<f32>], x: &[f32], fmt: Format) -> (&'w mut [f32], usize) {
        let differs = |r: f32, v: f32| u32::from(r.to_bits() != v.to_bits() && !v.is_nan());
        let mut changed = 0u32;
        let pairs = x.len() / 2;
        let w = fill(w, |w, written| {
            let (whole, tail) = w.split_at_mut(pairs);
            let x2 = x.chunks_exact(2);
            written.add(match fmt {
                // branch-free, so the loop vectorises: the pattern is the top half
                Format::Bf16 => write_exact(
                    whole,
                    x2.map(|p| {
                        let (a, b) = (bf16_f32(p[0]), bf16_f32(p[1]));
                        changed += differs(a, p[0]) + differs(b, p[1]);
                        f32::from_bits((a.to_bits() >> 16) | (b.to_bits() & 0xffff_0000))
                    }),
                ),
                Format::Fp16 => write_exact(
                    whole,
                    x2.map(|p| {
                        let (a, b) = (fp16_f32(p[0]), fp16_f32(p[1]));
                        changed += differs(a, p[0]) + differs(b, p[1]);
                        f32::from_bits(pattern(a, fmt) | (pattern(b, fmt) << 16))
                    }),
                ),
            });
            if x.len() % 2 == 1 {
                let v = x[x.len() - 1];
                let r = round_f32(v, fmt);
                changed += differs(r, v);
                written.add(write_exact(tail, [f32::from_bits(pattern(r, fmt))]));
            }
        });
        (w, changed as usize)
    }
}

simd::multiversion! {
    /// w: (⌈n/2⌉) -> y: (n), every value written and handed back
    fn unpack_words<'y>(y: &'y mut [MaybeUninit<f32>], w: &[f32], fmt: Format) -> &'y mut [f32] {
        assert_eq!(w.len(), y.len().div_ceil(2), "a word for every two values");
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
        // SAFETY: the loop wrote both values of each of the `pairs` pairs
        // (there are as many words, asserted above), and the odd last value
        // was written after it: every value of `y`. (Pairs written as arrays
        // of two keep this loop as it vectorises.)
        unsafe { assume_init_mut(y) }
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
    use crate::backend::cpu::{assume_init_mut, fill};
    use crate::backend::round::{bf16_lanes_avx512, Format};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// [`pack_words`] for bf16 (`fmt` is bf16).
    pub(super) fn pack_bf16<'w>(w: &'w mut [MaybeUninit<f32>], x: &[f32], fmt: Format) -> (&'w mut [f32], usize) {
        assert!(fmt == Format::Bf16 && is_x86_feature_detected!("avx512f"));
        assert_eq!(w.len(), x.len().div_ceil(2));
        let groups = x.len() / 16;
        let mut changed = 0;
        let w = fill(w, |w, written| {
            let (head, rest) = w.split_at_mut(8 * groups);
            // SAFETY: the CPU has AVX-512F (checked above); `groups` groups of
            // 16 values fill the `8 · groups` words of `head`.
            changed = unsafe { pack_groups(head.as_mut_ptr().cast(), &x[..16 * groups]) };
            // SAFETY: pack_groups wrote every half of `head`'s words.
            written.add(unsafe { assume_init_mut(head) });
            let (rest, n) = pack_words(rest, &x[16 * groups..], fmt);
            written.add(rest);
            changed += n;
        });
        (w, changed)
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
    pub(super) fn unpack_bf16<'y>(y: &'y mut [MaybeUninit<f32>], w: &[f32], fmt: Format) -> &'y mut [f32] {
        assert!(fmt == Format::Bf16 && is_x86_feature_detected!("avx512f"));
        assert_eq!(w.len(), y.len().div_ceil(2));
        let groups = y.len() / 16;
        fill(y, |y, written| {
            let (head, rest) = y.split_at_mut(16 * groups);
            // SAFETY: the CPU has AVX-512F (checked above); the first `8 · groups`
            // words hold the groups' halves.
            written.add(unsafe { unpack_groups(head, w[..8 * groups].as_ptr().cast()) });
            written.add(unpack_words(rest, &w[8 * groups..], fmt));
        })
    }

    /// `y[i]` the float32 of half `i` at `h`, whole groups of 16 (every value
    /// written, `y` handed back).
    ///
    /// # Safety
    /// AVX-512F; `h` is valid for `y.len()` halves.
    #[target_feature(enable = "avx512f")]
    unsafe fn unpack_groups(y: &mut [MaybeUninit<f32>], h: *const u16) -> &mut [f32] {
        assert!(y.len().is_multiple_of(16), "whole groups of 16");
        for (i, g) in y.chunks_exact_mut(16).enumerate() {
            // SAFETY: `g` holds 16 values; `h` holds 16 halves per group.
            unsafe {
                let halves = _mm256_loadu_si256(h.add(16 * i).cast());
                let v = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves));
                _mm512_storeu_ps(g.as_mut_ptr().cast(), _mm512_castsi512_ps(v));
            }
        }
        // SAFETY: `y` is whole groups of 16 (asserted above), and the loop
        // stored all 16 values of each.
        unsafe { assume_init_mut(y) }
    }
}
