//! Rounding to the emulated 16-bit formats, on bit patterns.
//!
//! Both functions return a value of the *input's* type whose every bit pattern
//! is a value of the 16-bit format, chosen by round-to-nearest, ties-to-even.
//! They never go through a platform conversion (WGSL's f32→f16 has no specified
//! rounding mode); `shaders/round.wgsl` implements the same integer steps.

/// The two emulated storage formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Format {
    /// 8 exponent bits, 7 mantissa bits: float32's range, unit roundoff 2^-8.
    Bf16,
    /// 5 exponent bits, 10 mantissa bits: max 65504, subnormals down to 2^-24.
    Fp16,
}

impl Format {
    /// The format's short name, `"bf16"` or `"fp16"` (what `Display` writes and
    /// `FromStr` accepts).
    pub fn name(self) -> &'static str {
        match self {
            Format::Bf16 => "bf16",
            Format::Fp16 => "fp16",
        }
    }
}

impl std::str::FromStr for Format {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" | "bfloat16" => Ok(Format::Bf16),
            "fp16" | "float16" | "half" => Ok(Format::Fp16),
            _ => Err(crate::Error::config(format!(
                "unknown 16-bit format {s:?}: expected \"bf16\" or \"fp16\""
            ))),
        }
    }
}

/// The WGSL twin of this file's f32 functions.
pub const CAST_WGSL: &str = include_str!("../../../shaders/round.wgsl");

/// A rounding format as the kernels take it (`FMT_*` in WGSL): 0 none, 1 bf16, 2 fp16.
pub fn fmt_code(f: Option<Format>) -> u32 {
    match f {
        None => 0,
        Some(Format::Bf16) => 1,
        Some(Format::Fp16) => 2,
    }
}

/// The `FMT_*` constants, generated from [`fmt_code`] into the WGSL prelude.
pub fn wgsl_consts() -> String {
    [("NONE", None), ("BF16", Some(Format::Bf16)), ("FP16", Some(Format::Fp16))]
        .iter()
        .map(|&(n, f)| format!("const FMT_{n}: u32 = {}u;\n", fmt_code(f)))
        .collect()
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// f32 → nearest bf16 value (kept in an f32): add `0x7fff + lsb` to the bits and
/// clear the low 16. A carry out of the mantissa bumps the exponent, which is
/// exactly round-to-nearest-even, overflow to ±inf included. NaN stays NaN (quieted).
///
/// Written without branches (both results computed, one selected) so loops over
/// slices vectorise; [`round_slice`] is the loop.
#[inline(always)]
pub fn bf16_f32(x: f32) -> f32 {
    let b = x.to_bits();
    let lsb = (b >> 16) & 1;
    let rounded = b.wrapping_add(0x7fff + lsb) & 0xffff_0000;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    f32::from_bits(if nan { b | 0x0040_0000 } else { rounded })
}

/// f32 → nearest fp16 value (kept in an f32).
///
/// * `|x| >= 65520` (halfway between 65504 and 2^16, whose tie goes to the even 2^16): ±inf.
/// * fp16 normals (`|x| >= 2^-14`): drop 13 mantissa bits with the same add-and-mask trick.
/// * below that the quantum is 2^-24: `|x| * 2^24` is exact, and `(y + 2^23) - 2^23` rounds it
///   to the nearest even integer in f32 arithmetic (exact for `y < 2^23`); then scale back.
///
/// Branch-free like [`bf16_f32`]: every case is computed, the right one selected.
#[inline(always)]
pub fn fp16_f32(x: f32) -> f32 {
    let b = x.to_bits();
    let sign = b & 0x8000_0000;
    let a = b & 0x7fff_ffff;
    let lsb = (a >> 13) & 1;
    let normal = sign | (a.wrapping_add(0x0fff + lsb) & !0x1fff);
    let y = f32::from_bits(a) * 16_777_216.0;
    let r = (y + 8_388_608.0) - 8_388_608.0;
    let subnormal = sign | (r * 5.960_464_5e-8).to_bits();
    let mut out = if a >= 0x3880_0000 { normal } else { subnormal };
    out = if a >= 0x477f_f000 {
        sign | 0x7f80_0000
    } else {
        out
    };
    out = if a > 0x7f80_0000 {
        b | 0x0040_0000
    } else {
        out
    };
    f32::from_bits(out)
}

#[inline(always)]
pub fn round_f32(x: f32, fmt: Format) -> f32 {
    match fmt {
        Format::Bf16 => bf16_f32(x),
        Format::Fp16 => fp16_f32(x),
    }
}

/// The 8-bit formats (OCP FP8): E4M3 for weights and activations, E5M2 for
/// gradients. Values are kept in f32s, like the 16-bit formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Fp8 {
    /// 4 exponent bits (bias 7), 3 mantissa bits: max 448, subnormals down
    /// to 2^-9, no infinities — a value past 448 saturates to ±448.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits: max 57344, subnormals
    /// down to 2^-16, with ±inf (overflow rounds to it) and NaN.
    E5M2,
}

impl Fp8 {
    /// `"e4m3"` or `"e5m2"`.
    pub fn name(self) -> &'static str {
        match self {
            Fp8::E4M3 => "e4m3",
            Fp8::E5M2 => "e5m2",
        }
    }
    /// The format as the kernels take it (`FP8_*` in WGSL).
    pub fn code(self) -> u32 {
        match self {
            Fp8::E4M3 => 0,
            Fp8::E5M2 => 1,
        }
    }
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8::E4M3 => 448.0,
            Fp8::E5M2 => 57344.0,
        }
    }
}

/// The `FP8_*` constants, generated from [`Fp8::code`] into the WGSL prelude.
pub fn wgsl_fp8_consts() -> String {
    [Fp8::E4M3, Fp8::E5M2]
        .iter()
        .map(|f| format!("const FP8_{}: u32 = {}u;\n", f.name().to_uppercase(), f.code()))
        .collect()
}

/// `|x|`'s bits (`a`, not NaN) rounded to nearest even with `m` mantissa bits
/// and normals from 2^`emin`, on integers only (a flushing or contracting
/// device computes the same): a normal of the format drops `23 − m` bits with
/// bf16's add-and-mask trick; below 2^`emin` the quantum is 2^(`emin` − m),
/// and the quanta count `n` is the integer mantissa shifted right with the
/// same tie rule, rebuilt as `n · 2^(emin − m)`. No overflow handling.
#[inline(always)]
fn fp8_magnitude(a: u32, m: u32, emin: i32) -> u32 {
    let e = (a >> 23) as i32 - 127;
    if e >= emin {
        let s = 23 - m;
        let lsb = (a >> s) & 1;
        return a.wrapping_add((1 << (s - 1)) - 1 + lsb) & !((1 << s) - 1);
    }
    // f32 normals with their implicit bit; an f32 subnormal is below every
    // fp8 quantum's half, so it goes to 0 with any mantissa.
    if a < 0x0080_0000 {
        return 0;
    }
    let mant = (a & 0x007f_ffff) | 0x0080_0000;
    let s = (emin - e) as u32 + (23 - m); // > 23 - m
    if s >= 25 {
        return 0; // below half the smallest quantum (mant < 2^24)
    }
    let lsb = (mant >> s) & 1;
    let n = (mant + (1 << (s - 1)) - 1 + lsb) >> s;
    if n == 0 {
        return 0;
    }
    // n · 2^(emin − m): the leading bit's place p gives the exponent.
    let p = 31 - n.leading_zeros();
    let exp = (emin - m as i32 + p as i32 + 127) as u32;
    (exp << 23) | ((n << (23 - p)) & 0x007f_ffff)
}

/// f32 → nearest E4M3 value (kept in an f32), ties to even; past ±448
/// (±inf included) it saturates to ±448; NaN stays NaN (quieted).
#[inline(always)]
pub fn e4m3_f32(x: f32) -> f32 {
    let b = x.to_bits();
    let (sign, a) = (b & 0x8000_0000, b & 0x7fff_ffff);
    if a > 0x7f80_0000 {
        return f32::from_bits(b | 0x0040_0000);
    }
    let r = fp8_magnitude(a, 3, -6);
    // 448 = 0x43e0_0000; a value rounding past it (or any above) saturates
    f32::from_bits(sign | r.min(0x43e0_0000))
}

/// f32 → nearest E5M2 value (kept in an f32), ties to even: from 61440
/// (halfway between 57344 and 2^16, whose tie goes to the even 2^16) it is
/// ±inf; NaN stays NaN (quieted).
#[inline(always)]
pub fn e5m2_f32(x: f32) -> f32 {
    let b = x.to_bits();
    let (sign, a) = (b & 0x8000_0000, b & 0x7fff_ffff);
    if a > 0x7f80_0000 {
        return f32::from_bits(b | 0x0040_0000);
    }
    let r = fp8_magnitude(a, 2, -14);
    // 2^16 = 0x4780_0000 and above is past the largest finite: inf
    f32::from_bits(sign | if r >= 0x4780_0000 { 0x7f80_0000 } else { r })
}

/// [`e4m3_f32`] or [`e5m2_f32`].
#[inline(always)]
pub fn fp8_f32(x: f32, f: Fp8) -> f32 {
    match f {
        Fp8::E4M3 => e4m3_f32(x),
        Fp8::E5M2 => e5m2_f32(x),
    }
}

/// f64 → nearest value of an fp8 format, from the f64 directly (as
/// [`round_f64`]): the same rounding as [`fp8_f32`], the same overflow rule.
pub fn fp8_f64(x: f64, f: Fp8) -> f64 {
    if x.is_nan() {
        return x;
    }
    let (mant, emin) = match f {
        Fp8::E4M3 => (3, -6),
        Fp8::E5M2 => (2, -14),
    };
    let max = f64::from(f.max());
    let a = x.abs();
    let v = if a.is_infinite() || a == 0.0 {
        a
    } else {
        let e = (((a.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(emin);
        let quantum = 2f64.powi(e - mant);
        let y = a / quantum; // exact: division by a power of two
        let two52 = 4_503_599_627_370_496.0;
        let r = if y < two52 { (y + two52) - two52 } else { y };
        r * quantum
    };
    let v = match f {
        Fp8::E4M3 => v.min(max),
        Fp8::E5M2 if v > max => f64::INFINITY,
        Fp8::E5M2 => v,
    };
    v.copysign(x)
}

/// [`bf16_f32`] on 8 lanes: the same integer steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn bf16_lanes_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
    let rounded = _mm256_and_si256(_mm256_add_epi32(b, bias), _mm256_set1_epi32(0xffff_0000u32 as i32));
    // |b| > inf's pattern: a NaN (both sides non-negative as i32)
    let nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff)), _mm256_set1_epi32(0x7f80_0000));
    let quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000));
    _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, nan))
}

/// [`bf16_f32`] on 16 lanes: the same integer steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn bf16_lanes_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
    let rounded = _mm512_and_si512(_mm512_add_epi32(b, bias), _mm512_set1_epi32(0xffff_0000u32 as i32));
    let nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff)), _mm512_set1_epi32(0x7f80_0000));
    let quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000));
    _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, rounded, quiet))
}

/// Rounds every element in place: the format is chosen once, outside the loop,
/// so each loop is one vectorised body.
#[inline(always)]
pub fn round_slice(xs: &mut [f32], fmt: Format) {
    match fmt {
        Format::Bf16 => xs.iter_mut().for_each(|x| *x = bf16_f32(*x)),
        Format::Fp16 => xs.iter_mut().for_each(|x| *x = fp16_f32(*x)),
    }
}

/// f64 → nearest value of the format, rounded from the f64 directly (no double
/// rounding through f32): find the quantum (the spacing of the format at `|x|`,
/// or its subnormal spacing), round `|x| / quantum` to the nearest even integer
/// with the `2^52` trick, scale back, and overflow to ±inf past the largest finite.
pub fn round_f64(x: f64, fmt: Format) -> f64 {
    if x.is_nan() || x.is_infinite() || x == 0.0 {
        return x;
    }
    // (mantissa bits, smallest normal exponent, largest finite value)
    let (mant, emin, max) = match fmt {
        Format::Bf16 => (7, -126, f64::from(f32::from_bits(0x7f7f_0000))),
        Format::Fp16 => (10, -14, 65504.0),
    };
    let a = x.abs();
    let e = (((a.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(emin);
    let quantum = 2f64.powi(e - mant);
    let y = a / quantum; // exact: division by a power of two
    let r = if y < 4_503_599_627_370_496.0 {
        (y + 4_503_599_627_370_496.0) - 4_503_599_627_370_496.0
    } else {
        y
    };
    let v = r * quantum;
    // Past the largest finite value the next step would be 2^(emax+1): that is inf.
    let v = if v > max { f64::INFINITY } else { v };
    v.copysign(x)
}
