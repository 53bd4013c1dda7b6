//! The spec of 16-bit storage: each value's pattern placed in its half word.

#![forbid(unsafe_code)]

use super::PackOps;
use crate::backend::round::{round_f32, Format};
use crate::backend::spec::{dot, multi_index, SpecStorage};
use crate::Result;

/// The 16-bit pattern of `r`, a value of `fmt`: bf16 the top half of its
/// float32; fp16 IEEE binary16 (a NaN keeps its sign and top payload bits).
fn pattern(r: f32, fmt: Format) -> u32 {
    let b = r.to_bits();
    if fmt == Format::Bf16 {
        return b >> 16;
    }
    let sign = (b >> 31) << 15;
    let a = r.abs();
    if a.is_nan() {
        sign | 0x7c00 | ((b >> 13) & 0x3ff)
    } else if a.is_infinite() {
        sign | 0x7c00
    } else if a < 2f32.powi(-14) {
        sign | (a * 2f32.powi(24)) as u32 // k · 2^-24, k < 1024 (exact)
    } else {
        let e = (a.to_bits() >> 23) as i32 - 127; // -14..=15
        let m = (a.to_bits() >> 13) & 0x3ff;
        sign | (((e + 15) as u32) << 10) | m
    }
}

/// The float32 of a 16-bit pattern of `fmt`, exactly.
fn widen(h: u32, fmt: Format) -> f32 {
    if fmt == Format::Bf16 {
        return f32::from_bits(h << 16);
    }
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let (e, m) = ((h >> 10) & 0x1f, h & 0x3ff);
    match e {
        31 if m == 0 => sign * f32::INFINITY,
        31 => f32::from_bits(((h & 0x8000) << 16) | 0x7f80_0000 | (m << 13)),
        0 => sign * m as f32 * 2f32.powi(-24),
        _ => sign * (1.0 + m as f32 / 1024.0) * 2f32.powi(e as i32 - 15),
    }
}

/// Value `e` of a buffer of packed words: the low half of word `e / 2` for
/// even `e`, the high half for odd.
pub(crate) fn unpacked(words: &[f32], fmt: Format, e: usize) -> f32 {
    let w = words[e / 2].to_bits();
    widen(if e.is_multiple_of(2) { w & 0xffff } else { w >> 16 }, fmt)
}

impl PackOps for SpecStorage {
    fn pack(&self, fmt: Format) -> Result<(SpecStorage, Option<usize>)> {
        let x = self.get();
        let mut words = vec![0u32; x.len().div_ceil(2)];
        let mut changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let r = round_f32(v, fmt);
            if !v.is_nan() && r.to_bits() != v.to_bits() {
                changed += 1;
            }
            words[i / 2] |= pattern(r, fmt) << (16 * (i % 2));
        }
        let words = words.into_iter().map(f32::from_bits).collect();
        Ok((SpecStorage::new(words), Some(changed)))
    }

    fn unpack_strided(&self, fmt: Format, shape: &[usize], strides: &[usize], offset: usize) -> Result<SpecStorage> {
        let words = self.get();
        let n: usize = shape.iter().product();
        let at = |i: usize| offset + dot(&multi_index(i, shape), strides);
        Ok(SpecStorage::new((0..n).map(|i| unpacked(&words, fmt, at(i))).collect()))
    }

    fn unpack(&self, fmt: Format, n: usize) -> Result<SpecStorage> {
        let w = self.get();
        Ok(SpecStorage::new((0..n).map(|e| unpacked(&w, fmt, e)).collect()))
    }
}
