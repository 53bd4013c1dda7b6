//! The crate's own f32 math library: the Rust half of the numerics contract.
//!
//! Division, square root, exp, log and sigmoid are built here from operations
//! that are exactly rounded everywhere (`+ - *`, `fma`, `floor`, bit casts), so
//! the CPU reference and the WGSL kernels (`shaders/mathlib.wgsl`, a line-for-line
//! twin of this file) produce the same bits. Nothing here calls a platform
//! `exp`, `ln` or a hardware divide whose accuracy a GPU driver may relax.
//!
//! Two rules keep the twins identical:
//! * every multiply that feeds an add is an explicit `mul_add` here and an
//!   explicit `fma` in WGSL, so a compiler's contraction choices never matter;
//! * special values (NaN, ±inf, ±0) are decided on bit patterns before any
//!   arithmetic, in the same order on both sides.
//!
//! Accuracy: `div` and `sqrt` are correctly rounded for normal results (one
//! Newton/Markstein correction step); `exp` and `log` are within about one ulp.

/// `2^n` for `n` in `-126..=127`, built from bits.
#[inline]
pub fn pow2i(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// `x * 2^n` for `n` in `-252..=254`, as two exact power-of-two products (only
/// the second can round, when the result is subnormal).
#[inline]
pub fn scale2(x: f32, n: i32) -> f32 {
    let n1 = n / 2;
    x * pow2i(n1) * pow2i(n - n1)
}

/// Splits a finite, non-zero `|x|` into `(m, e)` with `m` in `[1, 2)` and `|x| = m * 2^e`.
#[inline]
fn frexp_abs(x: f32) -> (f32, i32) {
    let mut bits = x.to_bits() & 0x7fff_ffff;
    let mut e_adj = 0;
    if bits < 0x0080_0000 {
        // Subnormal: scale by 2^24 first (exact) so the exponent field is meaningful.
        bits = (f32::from_bits(bits) * 16_777_216.0).to_bits();
        e_adj = -24;
    }
    let e = ((bits >> 23) as i32) - 127 + e_adj;
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    (m, e)
}

#[inline]
fn is_nan_bits(b: u32) -> bool {
    (b & 0x7fff_ffff) > 0x7f80_0000
}

const QNAN: u32 = 0x7fc0_0000;

/// `a / b`, correctly rounded for normal results.
///
/// Mantissas are divided in `[1, 2)` with a reciprocal from a linear guess and
/// three Newton steps, then one Markstein correction `q + (a - q b) r`; the
/// exponent is applied afterwards with [`scale2`].
pub fn div(a: f32, b: f32) -> f32 {
    let (ab, bb) = (a.to_bits(), b.to_bits());
    let sign = (ab ^ bb) & 0x8000_0000;
    let (aa, ba) = (ab & 0x7fff_ffff, bb & 0x7fff_ffff);
    if is_nan_bits(ab) || is_nan_bits(bb) {
        return f32::from_bits(QNAN);
    }
    if ba == 0x7f80_0000 {
        // x / ±inf
        return if aa == 0x7f80_0000 {
            f32::from_bits(QNAN)
        } else {
            f32::from_bits(sign)
        };
    }
    if ba == 0 {
        // x / ±0
        return if aa == 0 {
            f32::from_bits(QNAN)
        } else {
            f32::from_bits(sign | 0x7f80_0000)
        };
    }
    if aa == 0x7f80_0000 {
        return f32::from_bits(sign | 0x7f80_0000);
    }
    if aa == 0 {
        return f32::from_bits(sign);
    }
    let (ma, ea) = frexp_abs(a);
    let (mb, eb) = frexp_abs(b);
    // r ≈ 1/mb: the minimax line 24/17 - 8/17 mb on [1, 2), then Newton r += r (1 - mb r).
    let mut r = (-8.0f32 / 17.0).mul_add(mb, 24.0 / 17.0);
    for _ in 0..3 {
        let e = (-mb).mul_add(r, 1.0);
        r = r.mul_add(e, r);
    }
    let q0 = ma * r;
    let rem = (-q0).mul_add(mb, ma);
    let q = rem.mul_add(r, q0);
    let d = ea - eb;
    if d > 128 {
        return f32::from_bits(sign | 0x7f80_0000);
    }
    if d < -151 {
        return f32::from_bits(sign);
    }
    f32::from_bits(scale2(q, d).to_bits() | sign)
}

/// `sqrt(x)`, correctly rounded for normal inputs; `sqrt(-0) = -0`, negative → NaN.
pub fn sqrt(x: f32) -> f32 {
    let b = x.to_bits();
    if is_nan_bits(b) {
        return f32::from_bits(QNAN);
    }
    if (b & 0x7fff_ffff) == 0 {
        return x;
    }
    if b & 0x8000_0000 != 0 {
        return f32::from_bits(QNAN);
    }
    if b == 0x7f80_0000 {
        return x;
    }
    let (mut m, mut e) = frexp_abs(x);
    if e & 1 != 0 {
        // Make the exponent even: m in [2, 4).
        m *= 2.0;
        e -= 1;
    }
    // y ≈ 1/sqrt(m): the bit-trick guess, then Newton y += y/2 (1 - m y²).
    let mut y = f32::from_bits(0x5f37_59df - (m.to_bits() >> 1));
    for _ in 0..3 {
        let t = m * y;
        let r = (-t).mul_add(y, 1.0);
        y = (y * 0.5).mul_add(r, y);
    }
    // s ≈ sqrt(m), corrected once: s += (m - s²) y/2.
    let s0 = m * y;
    let d = (-s0).mul_add(s0, m);
    let s = d.mul_add(y * 0.5, s0);
    scale2(s, e / 2)
}

/// `1 / sqrt(x)`, as `div(1, sqrt(x))`.
pub fn rsqrt(x: f32) -> f32 {
    div(1.0, sqrt(x))
}

/// `e^x`, within about one ulp.
///
/// `x = n ln2 + r` with `|r| <= ln2/2` (ln2 split in two for an exact
/// reduction), a degree-7 Taylor polynomial for `e^r` in Horner form, then
/// `2^n` applied with [`scale2`].
pub fn exp(x: f32) -> f32 {
    let b = x.to_bits();
    if is_nan_bits(b) {
        return f32::from_bits(QNAN);
    }
    if x > 88.72284 {
        return f32::INFINITY;
    }
    if x < -103.97209 {
        return 0.0;
    }
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // 0x3f317200: few mantissa bits, so n * LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6; // ln2 - LN2_HI
    let n = x.mul_add(LOG2E, 0.5).floor();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = 1.0f32 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    scale2(p, n as i32)
}

/// Natural logarithm, within about one ulp. `log(±0) = -inf`, negative → NaN.
///
/// `x = m 2^e` with `m` in `[sqrt(1/2), sqrt(2))`; `log m = 2 atanh(s)` with
/// `s = (m-1)/(m+1)`, `|s| < 0.172`, by its odd series to `s^13`.
pub fn log(x: f32) -> f32 {
    let b = x.to_bits();
    if is_nan_bits(b) {
        return f32::from_bits(QNAN);
    }
    if (b & 0x7fff_ffff) == 0 {
        return f32::NEG_INFINITY;
    }
    if b & 0x8000_0000 != 0 {
        return f32::from_bits(QNAN);
    }
    if b == 0x7f80_0000 {
        return x;
    }
    let (mut m, mut e) = frexp_abs(x);
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = div(m - 1.0, m + 1.0);
    let s2 = s * s;
    let mut p = 2.0f32 / 13.0;
    p = p.mul_add(s2, 2.0 / 11.0);
    p = p.mul_add(s2, 2.0 / 9.0);
    p = p.mul_add(s2, 2.0 / 7.0);
    p = p.mul_add(s2, 2.0 / 5.0);
    p = p.mul_add(s2, 2.0 / 3.0);
    p = p.mul_add(s2, 2.0);
    let lm = p * s;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let ef = e as f32;
    ef.mul_add(LN2_HI, ef.mul_add(LN2_LO, lm))
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    div(1.0, 1.0 + exp(-x))
}

/// `x * sigmoid(x)` (SiLU, the Llama MLP's gate activation).
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn div_and_sqrt_are_correctly_rounded_on_a_sweep() {
        let mut s = 0x1234_5678u32;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let a = f32::from_bits((s & 0x3fff_ffff) | 0x2000_0000)
                * if s & 1 == 0 { 1.0 } else { -1.0 };
            let b = f32::from_bits((s.rotate_left(7) & 0x3fff_ffff) | 0x2000_0000);
            assert_eq!(div(a, b).to_bits(), (a / b).to_bits(), "{a} / {b}");
            assert_eq!(sqrt(b).to_bits(), b.sqrt().to_bits(), "sqrt {b}");
        }
    }

    #[test]
    fn special_values_follow_ieee() {
        assert!(div(0.0, 0.0).is_nan());
        assert_eq!(div(1.0, 0.0), f32::INFINITY);
        assert_eq!(div(-1.0, 0.0), f32::NEG_INFINITY);
        assert_eq!(div(1.0, -f32::INFINITY).to_bits(), (-0.0f32).to_bits());
        assert!(div(f32::INFINITY, f32::INFINITY).is_nan());
        assert_eq!(sqrt(-0.0).to_bits(), (-0.0f32).to_bits());
        assert!(sqrt(-1.0).is_nan());
        assert_eq!(sqrt(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(log(1.0), 0.0);
        assert_eq!(log(0.0), f32::NEG_INFINITY);
        assert!(log(-1.0).is_nan());
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
    }

    #[test]
    fn exp_and_log_are_within_two_ulps() {
        let mut x = -100.0f32;
        while x < 88.0 {
            assert!(ulps(exp(x), (x as f64).exp() as f32) <= 2, "exp {x}");
            x += 0.0137;
        }
        let mut x = 1e-38f32;
        while x < 1e38 {
            assert!(ulps(log(x), (x as f64).ln() as f32) <= 2, "log {x}");
            x *= 1.0137;
        }
        // subnormal inputs
        assert!(ulps(log(1e-44), (1e-44f32 as f64).ln() as f32) <= 2);
    }
}
