//! The crate's own f32 math library: the Rust half of the numerics contract.
//!
//! Division, square root, exp, log and sigmoid are built here from operations
//! that are exactly rounded everywhere (`+ - *`, `fma`, `floor`, bit casts), so
//! the CPU reference and the WGSL kernels (`shaders/mathlib.wgsl`, the twin of
//! this file) produce the same bits. Nothing here calls a platform `exp`, `ln`
//! or a hardware divide whose accuracy a GPU driver may relax.
//!
//! Three rules keep the twins identical:
//! * every multiply that feeds an add is an explicit `mul_add` here and an
//!   explicit `fma` in WGSL, so a compiler's contraction choices never matter;
//! * special values (NaN, ±inf, ±0) are decided on bit patterns, in the same
//!   priority on both sides;
//! * the main path is the same sequence of operations on both sides.
//!
//! The WGSL returns early on special values; here every function is written
//! **branch-free**: the main path runs on whatever the input is (it is finite
//! and harmless for every bit pattern) and the special results are selected
//! afterwards, lowest priority first, so the last select is the first `if` of
//! the twin. That lets the compiler vectorise loops over slices (8 lanes with
//! AVX2) — the elementwise ops, softmax and AdamW spend their time here — and
//! changes no bit: the main path's value is simply discarded where the twin
//! would have returned early.
//!
//! Accuracy: `div` is correctly rounded for normal results (one
//! Newton/Markstein correction step), `sqrt` for every input (checked
//! exhaustively, which lets the CPU use the hardware square root, see
//! [`sqrt`]); `exp` and `log` are within about one ulp.

/// `if c { a } else { b }` on bit patterns; with both sides already computed
/// this compiles to a blend, never a branch.
#[inline(always)]
fn sel(c: bool, a: u32, b: u32) -> u32 {
    if c {
        a
    } else {
        b
    }
}

/// `2^n` for `n` in `-126..=127`, built from bits.
#[inline(always)]
pub fn pow2i(n: i32) -> f32 {
    f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

/// `x * 2^n` for `n` in `-252..=254`, as two exact power-of-two products (only
/// the second can round, when the result is subnormal).
#[inline(always)]
pub fn scale2(x: f32, n: i32) -> f32 {
    let n1 = n / 2;
    x * pow2i(n1) * pow2i(n - n1)
}

/// Splits `|x|` into `(m, e)` with `m` in `[1, 2)` and `|x| = m * 2^e` when `x`
/// is finite and non-zero; for other inputs `m` is still in `[1, 2)` and `e`
/// within `-151..=128` (meaningless, and discarded by the callers).
#[inline(always)]
fn frexp_abs(x: f32) -> (f32, i32) {
    let bits = x.to_bits() & 0x7fff_ffff;
    // Subnormal: scale by 2^24 first (exact) so the exponent field is meaningful.
    let sub = bits < 0x0080_0000;
    let bits = sel(sub, (f32::from_bits(bits) * 16_777_216.0).to_bits(), bits);
    let e = ((bits >> 23) as i32) - 127 - if sub { 24 } else { 0 };
    let m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    (m, e)
}

#[inline(always)]
fn is_nan_bits(b: u32) -> bool {
    (b & 0x7fff_ffff) > 0x7f80_0000
}

const QNAN: u32 = 0x7fc0_0000;
const INF: u32 = 0x7f80_0000;

/// `a / b`, correctly rounded for normal results.
///
/// Mantissas are divided in `[1, 2)` with a reciprocal from a linear guess and
/// three Newton steps, then one Markstein correction `q + (a - q b) r`; the
/// exponent is applied afterwards with [`scale2`]. (Written as
/// `Divisor::new(b).div(a)`: the same operations in the same order.)
#[inline(always)]
pub fn div(a: f32, b: f32) -> f32 {
    Divisor::new(b).div(a)
}

/// The half of [`div`] that depends on the divisor alone — its split into
/// mantissa and exponent and the Newton reciprocal — done once for a row of
/// divisions by the same value (softmax's sum, a scalar, AdamW's bias
/// correction). `Divisor::new(b).div(a)` *is* `div(a, b)`, bit for bit.
#[derive(Clone, Copy, Debug)]
pub struct Divisor {
    bits: u32,
    mb: f32,
    eb: i32,
    r: f32,
}

impl Divisor {
    #[inline(always)]
    pub fn new(b: f32) -> Divisor {
        let (mb, eb) = frexp_abs(b);
        // r ≈ 1/mb: the minimax line 24/17 - 8/17 mb on [1, 2), then Newton r += r (1 - mb r).
        let mut r = (-8.0f32 / 17.0).mul_add(mb, 24.0 / 17.0);
        for _ in 0..3 {
            let e = (-mb).mul_add(r, 1.0);
            r = r.mul_add(e, r);
        }
        Divisor {
            bits: b.to_bits(),
            mb,
            eb,
            r,
        }
    }

    /// `a / b` for this divisor `b`.
    #[inline(always)]
    pub fn div(&self, a: f32) -> f32 {
        let Divisor {
            bits: bb,
            mb,
            eb,
            r,
        } = *self;
        let ab = a.to_bits();
        let sign = (ab ^ bb) & 0x8000_0000;
        let (aa, ba) = (ab & 0x7fff_ffff, bb & 0x7fff_ffff);
        let (ma, ea) = frexp_abs(a);
        let q0 = ma * r;
        let rem = (-q0).mul_add(mb, ma);
        let q = rem.mul_add(r, q0);
        let d = ea - eb;
        let mut out = scale2(q, d.clamp(-151, 128)).to_bits() | sign;
        // The twin's early returns, in reverse order.
        out = sel(d < -151, sign, out);
        out = sel(d > 128, sign | INF, out);
        out = sel(aa == 0, sign, out);
        out = sel(aa == INF, sign | INF, out);
        out = sel(ba == 0, sel(aa == 0, QNAN, sign | INF), out); // x / ±0
        out = sel(ba == INF, sel(aa == INF, QNAN, sign), out); // x / ±inf
        out = sel(is_nan_bits(ab) || is_nan_bits(bb), QNAN, out);
        f32::from_bits(out)
    }
}

/// `sqrt(x)` with the contract's bits: the IEEE square root, NaNs made the
/// canonical quiet NaN.
///
/// The contract's algorithm is [`sqrt_soft`] (the twin of WGSL's `m_sqrt`). It
/// is correctly rounded for **every** f32 input — `tests/rounding_exhaustive.rs`
/// checks all 2^32 bit patterns against the platform square root, which Rust
/// specifies as IEEE (correctly rounded) — so the CPU may use the hardware
/// instruction and still produce exactly the GPU's bits, at a fraction of the
/// cost. (Division has no such shortcut: the soft division double-rounds
/// subnormal results, and its pairs of inputs cannot be checked exhaustively.)
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    // Selected on bits: a float select between NaNs may be folded away.
    let h = x.sqrt().to_bits();
    f32::from_bits(sel(is_nan_bits(h), QNAN, h))
}

/// `sqrt(x)`, correctly rounded; `sqrt(-0) = -0`, negative → NaN: the contract's
/// algorithm, the twin of WGSL's `m_sqrt`.
#[inline(always)]
pub fn sqrt_soft(x: f32) -> f32 {
    let b = x.to_bits();
    let (m, e) = frexp_abs(x);
    // Make the exponent even: m in [2, 4) when it was odd.
    let odd = e & 1 != 0;
    let m = if odd { m * 2.0 } else { m };
    let e = if odd { e - 1 } else { e };
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
    let mut out = scale2(s, e / 2).to_bits();
    out = sel(b == INF, b, out);
    out = sel(b & 0x8000_0000 != 0, QNAN, out);
    out = sel(b & 0x7fff_ffff == 0, b, out);
    out = sel(is_nan_bits(b), QNAN, out);
    f32::from_bits(out)
}

/// `1 / sqrt(x)`, as `div(1, sqrt(x))`.
#[inline(always)]
pub fn rsqrt(x: f32) -> f32 {
    div(1.0, sqrt(x))
}

/// `e^x`, within about one ulp.
///
/// `x = n ln2 + r` with `|r| <= ln2/2` (ln2 split in two for an exact
/// reduction), a degree-7 Taylor polynomial for `e^r` in Horner form, then
/// `2^n` applied with [`scale2`].
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const HI: f32 = 88.72284; // above it e^x overflows
    const LO: f32 = -103.97209; // below it e^x underflows to 0
    let b = x.to_bits();
    // The main path on x clamped to the range where it is meaningful (a NaN
    // becomes LO): the results outside are selected below.
    #[allow(clippy::manual_clamp)] // clamp would keep a NaN; max/min drop it
    let xc = x.max(LO).min(HI);
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // 0x3f317200: few mantissa bits, so n * LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6; // ln2 - LN2_HI
    let n = xc.mul_add(LOG2E, 0.5).floor();
    let r = (-n).mul_add(LN2_HI, xc);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = 1.0f32 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // SAFETY: n = floor(xc log2(e) + 1/2) with xc in [LO, HI] is a whole number
    // in [-150, 128], never NaN. (`as` would saturate, which the compiler does
    // lane by lane — scalar code in the middle of the vector loop.)
    let n: i32 = unsafe { n.to_int_unchecked() };
    let mut out = scale2(p, n).to_bits();
    out = sel(x < LO, 0, out);
    out = sel(x > HI, INF, out);
    out = sel(is_nan_bits(b), QNAN, out);
    f32::from_bits(out)
}

/// Natural logarithm, within about one ulp. `log(±0) = -inf`, negative → NaN.
///
/// `x = m 2^e` with `m` in `[sqrt(1/2), sqrt(2))`; `log m = 2 atanh(s)` with
/// `s = (m-1)/(m+1)`, `|s| < 0.172`, by its odd series to `s^13`.
#[inline(always)]
pub fn log(x: f32) -> f32 {
    let b = x.to_bits();
    let (m, e) = frexp_abs(x);
    let big = m > std::f32::consts::SQRT_2;
    let m = if big { m * 0.5 } else { m };
    let e = if big { e + 1 } else { e };
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
    let mut out = ef.mul_add(LN2_HI, ef.mul_add(LN2_LO, lm)).to_bits();
    out = sel(b == INF, b, out);
    out = sel(b & 0x8000_0000 != 0, QNAN, out);
    out = sel(b & 0x7fff_ffff == 0, 0xff80_0000, out);
    out = sel(is_nan_bits(b), QNAN, out);
    f32::from_bits(out)
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    div(1.0, 1.0 + exp(-x))
}

/// `x * sigmoid(x)` (SiLU, the Llama MLP's gate activation).
#[inline(always)]
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
            assert_eq!(sqrt_soft(b).to_bits(), b.sqrt().to_bits(), "sqrt {b}");
        }
    }

    #[test]
    fn special_values_follow_ieee() {
        assert!(div(0.0, 0.0).is_nan());
        assert_eq!(div(1.0, 0.0), f32::INFINITY);
        assert_eq!(div(-1.0, 0.0), f32::NEG_INFINITY);
        assert_eq!(div(1.0, -f32::INFINITY).to_bits(), (-0.0f32).to_bits());
        assert!(div(f32::INFINITY, f32::INFINITY).is_nan());
        for sqrt in [sqrt, sqrt_soft] {
            assert_eq!(sqrt(-0.0).to_bits(), (-0.0f32).to_bits());
            assert_eq!(sqrt(-1.0).to_bits(), QNAN);
            assert_eq!(sqrt(f32::from_bits(0xff80_0001)).to_bits(), QNAN);
            assert_eq!(sqrt(f32::INFINITY), f32::INFINITY);
        }
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
