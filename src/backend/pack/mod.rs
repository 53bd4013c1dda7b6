//! 16-bit storage: a float32 buffer whose every value is a bf16 (or fp16)
//! value, kept in half the bytes and widened back exactly. Autograd keeps
//! the activations it saves for backward this way under autocast
//! ([`Saved`](crate::tensor::saved::Saved)).
//!
//! ## Contract
//! * `pack`: value `i` is rounded to the format (the integer
//!   round-to-nearest-even of [`round`](super::round)) and its 16-bit pattern
//!   is stored in word `i / 2` — the low half for even `i`, the high half for
//!   odd `i` (a last odd value leaves the high half 0). bf16's pattern is the
//!   top half of the rounded float32; fp16's is IEEE binary16's (subnormals
//!   `k · 2^-24` kept as `k`). No float arithmetic: integer steps only.
//! * `unpack`: the exact float32 of each pattern. So `unpack(pack(x)) = x`
//!   bit for bit whenever every value of `x` is a value of the format, with
//!   one exception: a NaN keeps its sign and the top of its payload (bf16: 7
//!   bits, fp16: 10), quieted, not the rest.
//! * `unpack_strided`: a strided view of the values, widened — output `i`
//!   is value `offset + Σ_d idx_d·strides_d` (`idx` the row-major multi-index
//!   of `i` over `shape`): `copy`'s `strided_copy` of `unpack`'s values,
//!   without writing them out (attention's permute of a kept 16-bit `v`).
//! * The CPU reference also counts the values that rounding changed, so a
//!   caller that packs values it holds to be 16-bit can check the claim; the
//!   GPU runs the same integer steps and does not count.
//!
//! Both devices keep the words in an ordinary float32 storage of
//! `⌈n / 2⌉` slots (2 bytes per value, counted by [`crate::memory`]); the
//! slots hold bit patterns, never arithmetic.

mod cpu;
pub(crate) use cpu::{pack_kernel, widen_words};
pub(crate) mod spec;
#[cfg(feature = "gpu")]
pub(crate) mod gpu;

use super::round::Format;
use super::{primitive, Lift, Storage};
use crate::Result;

/// A buffer of `len` values of `format`, two per 32-bit word.
#[derive(Clone, Debug)]
pub struct Packed {
    format: Format,
    len: usize,
    words: Storage,
}

/// A 16-bit copy, with the number of values its rounding changed where the
/// device counts them (the CPU; `None` on a GPU).
pub type KeptCopy = (Packed, Option<usize>);

/// The two devices' 16-bit storage (see the module docs for the contract).
pub trait PackOps: Sized {
    /// `self`: n values -> ⌈n/2⌉ words; on the CPU also how many values the
    /// rounding changed (NaNs aside).
    fn pack(&self, fmt: Format) -> Result<(Self, Option<usize>)>;
    /// [`pack`](Self::pack) of each buffer; a GPU packs several in one
    /// dispatch.
    fn pack_many(xs: &[&Self], fmt: Format) -> Result<Vec<(Self, Option<usize>)>> {
        xs.iter().map(|x| x.pack(fmt)).collect()
    }
    /// `self`: ⌈n/2⌉ words -> n values.
    fn unpack(&self, fmt: Format, n: usize) -> Result<Self>;
    /// `self`: words -> the values of the view `(shape, strides, offset)`.
    fn unpack_strided(&self, fmt: Format, shape: &[usize], strides: &[usize], offset: usize) -> Result<Self>;
}

impl Storage {
    /// Every value rounded to `fmt` and kept in 16 bits; with it, on the CPU,
    /// the number of values the rounding changed (`None` on the GPU).
    pub fn pack(&self, fmt: Format) -> Result<(Packed, Option<usize>)> {
        let mut one = Storage::pack_many(&[self], fmt)?;
        Ok(one.pop().expect("one buffer packed"))
    }

    /// [`pack`](Storage::pack) of each buffer (all on one device), as one
    /// primitive: on a GPU, one dispatch for a few buffers at a time.
    pub fn pack_many(xs: &[&Storage], fmt: Format) -> Result<Vec<(Packed, Option<usize>)>> {
        if xs.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(x) = xs.iter().find(|x| x.dtype() != super::DType::F32) {
            crate::bail!(DType, "16-bit storage packs f32 buffers (got {:?})", x.dtype());
        }
        let name = "pack 16-bit";
        let mut prof = crate::profile::scope(name);
        let words: Vec<(Storage, Option<usize>)> = super::on_device!(slice xs => |ds| {
            PackOps::pack_many(&ds, fmt).map(|v| v.into_iter().map(|(w, c)| (w.lift(), c)).collect::<Vec<_>>())
        });
        let outs: Vec<&Storage> = words.iter().map(|(w, _)| w).collect();
        prof.moved(|| super::traffic(name, xs, &outs));
        let describe = || format!("{fmt} n {:?}", xs.iter().map(|x| x.len()).collect::<Vec<_>>());
        super::observed(name, describe, &outs)?;
        Ok(words
            .into_iter()
            .zip(xs)
            .map(|((words, changed), x)| {
                let p = Packed {
                    format: fmt,
                    len: x.len(),
                    words,
                };
                (p, changed)
            })
            .collect())
    }
}

impl Packed {
    /// `len` values of `format` in `words` (as [`PackOps::pack`] writes them).
    pub(crate) fn new(format: Format, len: usize, words: Storage) -> Packed {
        Packed { format, len, words }
    }
    /// The float32 values, widened exactly.
    pub fn unpack(&self) -> Result<Storage> {
        let (fmt, n) = (self.format, self.len);
        Ok(primitive!("unpack 16-bit", || format!("{fmt} n {n}"), [&self.words] => |w| w.unpack(fmt, n)))
    }
    /// The values of the strided view `(shape, strides, offset)`, counted
    /// in values, widened exactly (see the contract).
    pub fn unpack_strided(&self, shape: &[usize], strides: &[usize], offset: usize) -> Result<Storage> {
        let last = offset + shape.iter().zip(strides).map(|(&s, &st)| s.saturating_sub(1) * st).sum::<usize>();
        if shape.len() > super::MAX_DIMS || (shape.iter().all(|&s| s > 0) && last >= self.len) {
            crate::bail!(Shape, "a view {shape:?} strides {strides:?} offset {offset} of {} 16-bit values", self.len);
        }
        let fmt = self.format;
        let describe = || format!("{fmt} shape {shape:?} strides {strides:?} offset {offset}");
        Ok(primitive!("unpack 16-bit", describe, [&self.words] => |w| w.unpack_strided(fmt, shape, strides, offset)))
    }
    /// The format of the values.
    pub fn format(&self) -> Format {
        self.format
    }
    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes the buffer holds (4 per word).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn bytes(&self) -> usize {
        self.words.len() * 4
    }
    /// The raw words (tests and the cross-check read them).
    pub fn words(&self) -> &Storage {
        &self.words
    }
}

#[cfg(test)]
/// A 16-bit pattern of `fmt` for `x` (rounded first): the contract's
/// integer steps, which `pack.wgsl` repeats.
#[inline(always)]
pub fn half_bits(x: f32, fmt: Format) -> u32 {
    pattern(super::round::round_f32(x, fmt), fmt)
}

/// The 16-bit pattern of `r`, a value of `fmt` (already rounded).
#[inline(always)]
pub fn pattern(r: f32, fmt: Format) -> u32 {
    match fmt {
        Format::Bf16 => r.to_bits() >> 16,
        Format::Fp16 => {
            let b = r.to_bits();
            let sign = (b >> 16) & 0x8000;
            let a = b & 0x7fff_ffff;
            if a > 0x7f80_0000 {
                sign | 0x7c00 | ((a >> 13) & 0x3ff) // NaN (quiet: the top payload bit is set)
            } else if a >= 0x4780_0000 {
                sign | 0x7c00 // ±inf (rounding leaves nothing between 65504 and inf)
            } else if a >= 0x3880_0000 {
                sign | (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3ff)
            } else if a == 0 {
                sign
            } else {
                // a subnormal k · 2^-24: k = (1.m) · 2^(e − 126 + 23) = (2^23 | m) >> (126 − e)
                let e = a >> 23;
                sign | ((0x0080_0000 | (a & 0x007f_ffff)) >> (126 - e))
            }
        }
    }
}

/// The float32 of a 16-bit pattern of `fmt`, exactly (as bits).
#[inline(always)]
pub fn widen_bits(h: u32, fmt: Format) -> u32 {
    match fmt {
        Format::Bf16 => h << 16,
        Format::Fp16 => {
            let sign = (h & 0x8000) << 16;
            let (e, m) = ((h >> 10) & 0x1f, h & 0x3ff);
            if e == 31 {
                sign | 0x7f80_0000 | (m << 13)
            } else if e != 0 {
                sign | ((e + 112) << 23) | (m << 13)
            } else if m == 0 {
                sign
            } else {
                let p = 31 - m.leading_zeros(); // the top set bit, 0..=9
                sign | ((p + 103) << 23) | ((m << (23 - p)) & 0x007f_ffff)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 16-bit pattern that is not a NaN widens to a float32 that packs
    /// back to the same pattern, and that float32 is the format's value
    /// (what the rounding functions give for it).
    #[test]
    fn every_pattern_round_trips() {
        for fmt in [Format::Bf16, Format::Fp16] {
            for h in 0..=0xffffu32 {
                let x = f32::from_bits(widen_bits(h, fmt));
                if x.is_nan() {
                    assert!(f32::from_bits(widen_bits(half_bits(x, fmt), fmt)).is_nan());
                    continue;
                }
                assert_eq!(half_bits(x, fmt), h, "{fmt} pattern {h:#06x} -> {x:e}");
                let r = crate::backend::round::round_f32(x, fmt);
                assert_eq!(r.to_bits(), x.to_bits(), "{fmt} {h:#06x} is not a value");
            }
        }
    }

    /// A CPU buffer packs and unpacks to its values rounded, every one of
    /// them, and counts those the rounding changed: empty, odd lengths, and
    /// one past the threads' split (odd, so its last task ends in a half word).
    #[test]
    fn cpu_buffers_round_trip_at_every_length() {
        let gen = crate::Generator::new(21);
        for n in [0, 1, 5, 64, (1 << 18) + 3] {
            let x: Vec<f32> = gen
                .uniform(n)
                .iter()
                .enumerate()
                .map(|(i, u)| (u - 0.5) * 1e3 * if i % 3 == 0 { 1.0 } else { 1.0 + 1.0 / 3.0 })
                .collect();
            for fmt in [Format::Bf16, Format::Fp16] {
                let st = Storage::from_f32(x.clone(), crate::Device::Cpu).unwrap();
                let (p, changed) = st.pack(fmt).unwrap();
                let y = p.unpack().unwrap().to_vec_f32().unwrap();
                let want: Vec<f32> = x.iter().map(|&v| crate::backend::round::round_f32(v, fmt)).collect();
                assert_eq!(y.len(), n);
                let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{fmt}, {n} values");
                let differ = x.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(changed, Some(differ), "{fmt}, {n} values");
            }
        }
    }

    /// fp16 patterns against the IEEE values they stand for.
    #[test]
    fn fp16_patterns_are_ieee_binary16() {
        let v = |h| f32::from_bits(widen_bits(h, Format::Fp16));
        assert_eq!(v(0x3c00), 1.0);
        assert_eq!(v(0xc000), -2.0);
        assert_eq!(v(0x7bff), 65504.0);
        assert_eq!(v(0x0001), 2f32.powi(-24));
        assert_eq!(v(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(v(0x0400), 2f32.powi(-14));
        assert_eq!(v(0x7c00), f32::INFINITY);
        assert_eq!(v(0x8000).to_bits(), (-0.0f32).to_bits());
        assert_eq!(v(0x3555), 0.333_251_95);
    }
}
