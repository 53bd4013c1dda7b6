//! The crate's own f32 math library: the Rust half of the numerics contract.
//!
//! Division, square root, exp, log and sigmoid are built here from operations
//! that are exactly rounded everywhere (`+ - *`, `fma`, `floor`, bit casts), so
//! the CPU reference and the WGSL kernels (`shaders/math.wgsl`, its twin, which
//! also emulates a fused multiply-add where a device lacks one) produce the same bits. Nothing here calls a platform `exp`, `ln`
//! or a hardware divide whose accuracy a GPU driver may relax.
//!
//! Four rules keep the twins identical:
//! * every multiply that feeds an add is an explicit `mul_add` here and an
//!   explicit `fma` in WGSL, so a compiler's contraction choices never matter;
//! * special values (NaN, ±inf, ±0) are decided on bit patterns, in the same
//!   priority on both sides;
//! * exponents go in and out by integer steps on the bits (`frexp_abs`,
//!   [`scale2`]): no subnormal ever meets float arithmetic, so a GPU that
//!   flushes subnormals gives the same bits;
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
//! Newton/Markstein correction step) except possibly within 2^-19 ulp of a
//! tie — which is what lets the CPU take the hardware division wherever the
//! quotient is provably not that close ([`div_lanes`]); `sqrt` is correctly
//! rounded for every input (checked exhaustively, which lets the CPU use the
//! hardware square root, see [`sqrt`]); `exp` and `log` are within about one
//! ulp.

use crate::backend::cpu::simd::LANES;

/// The WGSL twin of this file (`shaders/math.wgsl`), with `fma_soft`: a
/// correctly rounded fma in integer arithmetic, for devices whose `fma` is
/// not fused.
pub const MATH_WGSL: &str = include_str!("../../../shaders/math.wgsl");

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

/// `x · 2^n`, correctly rounded (to nearest, ties to even), in integer steps
/// on the bit pattern alone — no float arithmetic, so a device that flushes
/// subnormals (inputs or results of `*`) cannot change it.
///
/// Precondition: `x` is normal, ±0, ±inf or NaN (a subnormal `x` is not
/// supported: its field 0 reads as a zero), and `|n| < 2^30`; the callers pass
/// a normal `x` near 1 (`div`'s quotient, `exp`'s polynomial, `sqrt`'s
/// root). ±0, ±inf and NaN come back as they are.
///
/// * a normal result: the exponent field moves by `n`, the significand is kept;
/// * a field past 254: ±inf;
/// * a subnormal result (field `f = field + n <= 0`): the 24-bit significand
///   shifted right by `1 − f` (clamped to 25: below that the value is under
///   half the smallest subnormal), rounded to nearest even on the bits shifted
///   out. A significand that rounds up to 2^23 is the smallest normal, as
///   encoded — adding to the bit pattern carries into the exponent field.
///
/// The former float version, `x · 2^(n/2) · 2^(n − n/2)`, rounded once (the
/// first product is exact for the callers' `x`), so the bits are the same
/// (`scale2_is_the_float_formula_wherever_that_is_correctly_rounded`).
#[inline(always)]
pub fn scale2(x: f32, n: i32) -> f32 {
    let b = x.to_bits();
    let sign = b & 0x8000_0000;
    let field = ((b >> 23) & 0xff) as i32;
    let f = field + n;
    let normal = sign | ((f as u32 & 0xff) << 23) | (b & 0x007f_ffff);
    let sig = (b & 0x007f_ffff) | 0x0080_0000;
    let s = (1 - f).clamp(1, 25) as u32;
    let q = sig >> s;
    let rem = sig & ((1 << s) - 1);
    let half = 1 << (s - 1);
    let up = (rem > half || (rem == half && q & 1 == 1)) as u32;
    let mut out = sel(f <= 0, sign | (q + up), normal);
    out = sel(f >= 255, sign | INF, out);
    out = sel(field == 0 || field == 255, b, out);
    f32::from_bits(out)
}

/// Splits `|x|` into `(m, e)` with `m` in `[1, 2)` and `|x| = m * 2^e` when `x`
/// is finite and non-zero; for other inputs `m` is still in `[1, 2)` and `e`
/// within `-151..=128` (meaningless, and discarded by the callers).
///
/// Integer steps only: a subnormal is normalised by shifting its significand
/// left until its leading bit reaches the implicit bit (a leading-zero count),
/// so a device that flushes subnormal inputs of `*` cannot change it. (The
/// former version multiplied a subnormal by 2^24 in float arithmetic; the
/// results are the same for every input, ±0 included: `m = 1`, `e = −151`.)
#[inline(always)]
fn frexp_abs(x: f32) -> (f32, i32) {
    let bits = x.to_bits() & 0x7fff_ffff;
    // Subnormal or zero: the shift that puts the leading bit at bit 23, 1..=23
    // (24 for zero, which leaves 0: field 0, e = -151).
    let sub = bits < 0x0080_0000;
    let s = sel(sub, bits.leading_zeros().wrapping_sub(8), 0);
    let bits = bits << s;
    let e = ((bits >> 23) as i32) - 127 - s as i32;
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
/// exponent is applied afterwards with `scale2`. (Written as
/// `Divisor::new(b).div(a)`: the same operations in the same order.)
#[inline(always)]
pub fn div(a: f32, b: f32) -> f32 {
    Divisor::new(b).div(a)
}

/// The half of [`div`] that depends on the divisor alone — its split into
/// mantissa and exponent and the Newton reciprocal. `Divisor::new(b).div(a)`
/// *is* `div(a, b)`, bit for bit. The WGSL twin (`divisor_new`/`divisor_div`)
/// prepares it once for a row of divisions by the same value (softmax's sum, a
/// scalar, AdamW's bias correction); the CPU's loops divide with [`div_lanes`].
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

/// [`div`] for [`LANES`] pairs at once, bit for bit, mostly from the hardware
/// division — the soft algorithm costs ~10x the whole AdamW update otherwise.
///
/// Why the bits are the same: [`div`] is the contract's algorithm, and it is
/// *not* known to equal IEEE division everywhere (its pairs of inputs cannot be
/// checked exhaustively). What is known:
/// * for a normal result it works on the mantissas `ma / mb` and applies the
///   exponent exactly, so it rounds `v = q0 + rem·r` once, where (with the
///   reciprocal's relative error `|mb·r − 1| ≤ 2^-22`, checked for all 2^23
///   mantissas by `reciprocal_is_within_2_pow_minus_22_for_every_mantissa`)
///   `v` is within 2^-19 ulp of the exact quotient (`q0 = RN(ma·r)` is within
///   4.5 ulp, and `v` misses by that times the reciprocal's error);
/// * rounding to nearest is constant between two consecutive midpoints, so
///   wherever the exact quotient is farther than that from every midpoint,
///   `div` returns the correctly rounded quotient — which is what the hardware
///   returns (IEEE `/`).
///
/// [`div_hw`] computes the hardware quotient `q`, its exact remainder
/// `a − q·b` (one fma) and accepts `q` only when that puts the exact quotient
/// more than 2^-13 ulp from the ends of `q`'s rounding interval (the ties),
/// with every operand and the result well inside the normal range (or
/// `a = ±0`). A group with any lane outside that falls back to [`div`] for the
/// whole group: for real data that is a quotient within 2^-13 ulp of a tie
/// (about one pair in 4,000) or a tiny, huge or special operand.
#[inline(always)]
pub fn div_lanes(a: [f32; LANES], b: [f32; LANES]) -> [f32; LANES] {
    let mut q = [0.0f32; LANES];
    let mut ok = true;
    for i in 0..LANES {
        let (qi, oki) = div_hw(a[i], b[i]);
        q[i] = qi;
        ok &= oki;
    }
    if !ok {
        // Rare: only here does a group pay for the soft division.
        q = div_lanes_soft(a, b);
    }
    q
}

/// [`div`] lane by lane: [`div_lanes`]' fallback, kept out of line so the
/// loops that call it stay small enough to inline; compiled with FMA where
/// the CPU has it (for the baseline its `mul_add`s are library calls, and a
/// group near a tie comes by about once in 250 of 16 lanes).
#[cold]
#[inline(never)]
fn div_lanes_soft(a: [f32; LANES], b: [f32; LANES]) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    if crate::backend::cpu::simd::level() >= crate::backend::cpu::simd::Level::Avx2 {
        // SAFETY: the level is only Avx2 or above where the CPU has AVX2 and FMA.
        return unsafe { div_lanes_fma(a, b) };
    }
    std::array::from_fn(|i| div(a[i], b[i]))
}

/// [`div_lanes_soft`]'s lanes with FMA instructions (the same fused
/// multiply-adds, so the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn div_lanes_fma(a: [f32; LANES], b: [f32; LANES]) -> [f32; LANES] {
    std::array::from_fn(|i| div(a[i], b[i]))
}

/// Exponent fields accepted by [`div_hw`]: 2^-100 ..= the largest finite. At
/// and above 2^-100 the remainder `a − q·b` and the half-ulp bound `h·|b|`
/// (≈ |a|·2^-25) are exact normal numbers, and [`div`]'s result is normal.
const HW_MIN_FIELD: u32 = 27;

/// The hardware quotient `a / b` and whether it provably equals [`div`]'s
/// (see [`div_lanes`]).
#[inline(always)]
pub fn div_hw(a: f32, b: f32) -> (f32, bool) {
    let q = a / b;
    // Exact: q is the correctly rounded quotient and nothing underflows.
    let r = (-q).mul_add(b, a);
    let field = |x: f32| (x.to_bits() >> 23) & 0xff;
    let in_range = |x: f32| (HW_MIN_FIELD..0xff).contains(&field(x));
    // Half an ulp of q, 2^(e_q - 24) (in-range q: field >= 27). When q is a
    // power of two the midpoint below it is only a quarter ulp away, but no
    // quotient of two floats lands there: a/b just below 2^k means a is at
    // least one ulp of a under 2^k·b, so a/b is at least one spacing of the
    // floats below 2^k away from it — twice that midpoint's distance.
    let h = f32::from_bits((field(q) - 24) << 23);
    // |a/b - q| = |r|/|b| must stay 2^-12 of h (2^-13 ulp) inside the
    // interval; h·|b| is exact, the margin's own rounding is far below 2^-13.
    let limit = (h * b.abs()) * (1.0 - 1.0 / 4096.0);
    let general = in_range(a) && in_range(b) && in_range(q) && r.abs() < limit;
    // ±0 / a normal b: both give the signed zero.
    let zero = a.to_bits() & 0x7fff_ffff == 0 && in_range(b);
    (q, general || zero)
}

/// `sqrt(x)` with the contract's bits: the IEEE square root, NaNs made the
/// canonical quiet NaN.
///
/// The contract's algorithm is `sqrt_soft` (the twin of WGSL's `m_sqrt`). It
/// is correctly rounded for **every** f32 input — `tests/rounding_exhaustive.rs`
/// checks all 2^32 bit patterns against the platform square root, which Rust
/// specifies as IEEE (correctly rounded) — so the CPU may use the hardware
/// instruction and still produce exactly the GPU's bits, at a fraction of the
/// cost. (Division has no such blanket shortcut: the soft division
/// double-rounds subnormal results, and its pairs of inputs cannot be checked
/// exhaustively; `div_lanes` takes the hardware's quotient only where it is
/// provably the same.)
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    // Selected on bits: a float select between NaNs may be folded away.
    let h = x.sqrt().to_bits();
    f32::from_bits(sel(is_nan_bits(h), QNAN, h))
}

/// `sqrt(x)`, correctly rounded; `sqrt(-0) = -0`, negative → NaN: the contract's
/// algorithm, the twin of WGSL's `m_sqrt`.
#[inline(always)]
#[cfg(any(test, feature = "test-hooks"))]
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

/// Above it e^x overflows.
const EXP_HI: f32 = 88.72284;
/// Below it e^x underflows to 0.
const EXP_LO: f32 = -103.97209;
/// ln 2 in two parts: `0x3f317200` has few mantissa bits, so `n * LN2_HI` is exact.
const LN2_HI: f32 = 0.693_145_75;
/// ln 2 − `LN2_HI`.
const LN2_LO: f32 = 1.428_606_8e-6;
/// The Taylor coefficients of `e^r`, highest degree first (Horner's order).
const EXP_POLY: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

/// `e^x`, within about one ulp.
///
/// `x = n ln2 + r` with `|r| <= ln2/2` (ln2 split in two for an exact
/// reduction), a degree-7 Taylor polynomial for `e^r` in Horner form, then
/// `2^n` applied with `scale2`.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let b = x.to_bits();
    // The main path on x clamped to the range where it is meaningful (a NaN
    // becomes EXP_LO): the results outside are selected below.
    #[allow(clippy::manual_clamp)] // clamp would keep a NaN; max/min drop it
    let xc = x.max(EXP_LO).min(EXP_HI);
    let n = xc.mul_add(std::f32::consts::LOG2_E, 0.5).floor();
    let r = (-n).mul_add(LN2_HI, xc);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    // SAFETY: n = floor(xc log2(e) + 1/2) with xc in [EXP_LO, EXP_HI] is a whole number
    // in [-150, 128], never NaN. (`as` would saturate, which the compiler does
    // lane by lane — scalar code in the middle of the vector loop.)
    let n: i32 = unsafe { n.to_int_unchecked() };
    let mut out = scale2(p, n).to_bits();
    out = sel(x < EXP_LO, 0, out);
    out = sel(x > EXP_HI, INF, out);
    out = sel(is_nan_bits(b), QNAN, out);
    f32::from_bits(out)
}

/// [`exp`] of [`LANES`] values at once, bit for bit: the same operations in
/// vector registers where the CPU has AVX2 and FMA. (Left to the compiler, a
/// loop of [`exp`] vectorises only 4 wide, and a group of 8 not at all.)
#[inline(always)]
pub fn exp_lanes(x: [f32; LANES]) -> [f32; LANES] {
    #[cfg(target_arch = "x86_64")]
    if crate::backend::cpu::simd::level() >= crate::backend::cpu::simd::Level::Avx2 {
        // SAFETY: the level is only Avx2 or above where the CPU has AVX2 and FMA.
        return unsafe { exp_avx2(x) };
    }
    x.map(exp)
}

/// [`avx2::exp`] on an array of lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_avx2(x: [f32; LANES]) -> [f32; LANES] {
    use std::arch::x86_64::*;
    let mut y = [0.0f32; LANES];
    // SAFETY: `x` and `y` hold LANES = 8 values each.
    unsafe { _mm256_storeu_ps(y.as_mut_ptr(), avx2::exp(_mm256_loadu_ps(x.as_ptr()))) };
    y
}

/// [`exp`] and [`div`] on AVX2 vectors, bit for bit, for kernels written
/// with intrinsics (a vector in and out: no trip through an array).
#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`exp`] of each lane: its steps in its order (clamp, reduce, the
    /// polynomial, `scale2`, then the selects). `scale2` is two float
    /// products by powers of two here: the first is exact for `exp`'s `p`
    /// and `n`, the second rounds once, as the integer `scale2` does — the
    /// same bits on the CPU, which keeps subnormals (no FTZ/DAZ);
    /// `exp_lanes_equals_exp_bit_for_bit` checks every subnormal result.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub fn exp(xv: __m256) -> __m256 {
        let f = _mm256_set1_ps;
        // max(x, EXP_LO) returns its second operand for a NaN x, as f32::max does
        let xc = _mm256_min_ps(_mm256_max_ps(xv, f(EXP_LO)), f(EXP_HI));
        let n = _mm256_floor_ps(_mm256_fmadd_ps(xc, f(std::f32::consts::LOG2_E), f(0.5)));
        let r = _mm256_fnmadd_ps(n, f(LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, f(LN2_LO), r);
        let mut p = f(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, f(*c));
        }
        // scale2: n1 = n / 2 rounded toward zero, then p · 2^n1 · 2^(n − n1)
        let ni = _mm256_cvttps_epi32(n);
        let n1 = _mm256_srai_epi32::<1>(_mm256_add_epi32(ni, _mm256_srli_epi32::<31>(ni)));
        let pow2 = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127))));
        let out = _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(_mm256_sub_epi32(ni, n1)));
        let out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(xv, f(EXP_LO)));
        let out = _mm256_blendv_ps(out, f(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(xv, f(EXP_HI)));
        _mm256_blendv_ps(out, _mm256_castsi256_ps(_mm256_set1_epi32(QNAN as i32)), _mm256_cmp_ps::<_CMP_UNORD_Q>(xv, xv))
    }

    /// [`div_lanes`] on vectors: [`div_hw`]'s test lane by lane, the
    /// soft division for the whole vector when any lane fails it.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub fn div(a: __m256, b: __m256) -> __m256 {
        let q = _mm256_div_ps(a, b);
        // r = a − q·b, exact
        let r = _mm256_fnmadd_ps(q, b, a);
        let bits = _mm256_castps_si256;
        let abs_mask = _mm256_set1_epi32(0x7fff_ffff);
        let field = |x: __m256| _mm256_and_si256(_mm256_srli_epi32::<23>(bits(x)), _mm256_set1_epi32(0xff));
        // HW_MIN_FIELD ≤ field < 0xff, as signed compares (fields are 0..=255)
        let in_range = |x: __m256| {
            let e = field(x);
            _mm256_andnot_si256(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(HW_MIN_FIELD as i32), e),
                _mm256_cmpgt_epi32(_mm256_set1_epi32(0xff), e),
            )
        };
        let abs = |x: __m256| _mm256_castsi256_ps(_mm256_and_si256(bits(x), abs_mask));
        let h = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_sub_epi32(field(q), _mm256_set1_epi32(24))));
        let limit = _mm256_mul_ps(_mm256_mul_ps(h, abs(b)), _mm256_set1_ps(1.0 - 1.0 / 4096.0));
        let close = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(abs(r), limit));
        let general = _mm256_and_si256(_mm256_and_si256(in_range(a), in_range(b)), _mm256_and_si256(in_range(q), close));
        let a_zero = _mm256_cmpeq_epi32(_mm256_and_si256(bits(a), abs_mask), _mm256_setzero_si256());
        let ok = _mm256_or_si256(general, _mm256_and_si256(a_zero, in_range(b)));
        if _mm256_movemask_ps(_mm256_castsi256_ps(ok)) == 0xff {
            return q;
        }
        let (mut av, mut bv) = ([0.0f32; LANES], [0.0f32; LANES]);
        // SAFETY: two arrays of LANES f32 each.
        unsafe {
            _mm256_storeu_ps(av.as_mut_ptr(), a);
            _mm256_storeu_ps(bv.as_mut_ptr(), b);
            _mm256_loadu_ps(div_lanes_soft(av, bv).as_ptr())
        }
    }
}

/// [`exp`] and [`div`] on AVX-512 vectors of 16 lanes, bit for bit: the AVX2
/// steps with mask registers for the selects, and `scale2` as one scaling
/// instruction.
#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`avx2::exp`] on 16 lanes.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub fn exp(xv: __m512) -> __m512 {
        let f = _mm512_set1_ps;
        // max(x, EXP_LO) returns its second operand for a NaN x, as f32::max does
        let xc = _mm512_min_ps(_mm512_max_ps(xv, f(EXP_LO)), f(EXP_HI));
        // floor: round toward −inf, exceptions suppressed
        let n = _mm512_roundscale_ps::<0x09>(_mm512_fmadd_ps(xc, f(std::f32::consts::LOG2_E), f(0.5)));
        let r = _mm512_fnmadd_ps(n, f(LN2_HI), xc);
        let r = _mm512_fnmadd_ps(n, f(LN2_LO), r);
        let mut p = f(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, f(*c));
        }
        // scale2(p, n) in one instruction: p·2^n rounded once, as scale2
        // rounds (to nearest even, subnormals kept)
        let out = _mm512_scalef_ps(p, n);
        let out = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(xv, f(EXP_LO)), out, _mm512_setzero_ps());
        let out = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(xv, f(EXP_HI)), out, f(f32::INFINITY));
        let qnan = _mm512_castsi512_ps(_mm512_set1_epi32(QNAN as i32));
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(xv, xv), out, qnan)
    }

    /// [`avx2::div`] on 16 lanes: the hardware quotient where every lane
    /// passes [`div_hw`]'s test, else the two halves through `avx2::div`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub fn div(a: __m512, b: __m512) -> __m512 {
        let q = _mm512_div_ps(a, b);
        // r = a − q·b, exact
        let r = _mm512_fnmadd_ps(q, b, a);
        let bits = _mm512_castps_si512;
        let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
        let field = |x: __m512| _mm512_and_si512(_mm512_srli_epi32::<23>(bits(x)), _mm512_set1_epi32(0xff));
        // HW_MIN_FIELD ≤ field < 0xff
        let in_range = |x: __m512| {
            let e = field(x);
            _mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(HW_MIN_FIELD as i32))
                & _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(0xff))
        };
        let abs = |x: __m512| _mm512_castsi512_ps(_mm512_and_si512(bits(x), abs_mask));
        let h = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_sub_epi32(field(q), _mm512_set1_epi32(24))));
        let limit = _mm512_mul_ps(_mm512_mul_ps(h, abs(b)), _mm512_set1_ps(1.0 - 1.0 / 4096.0));
        let close = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(abs(r), limit);
        let general = in_range(a) & in_range(b) & in_range(q) & close;
        let a_zero = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits(a), abs_mask), _mm512_setzero_si512());
        if general | (a_zero & in_range(b)) == 0xffff {
            return q;
        }
        let half = |v: __m512, hi: bool| {
            let d = _mm512_castps_pd(v);
            _mm256_castpd_ps(if hi { _mm512_extractf64x4_pd::<1>(d) } else { _mm512_castpd512_pd256(d) })
        };
        let (lo, hi) = (avx2::div(half(a, false), half(b, false)), avx2::div(half(a, true), half(b, true)));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi)))
    }
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

    /// The former `scale2`: two float products by powers of two (the first
    /// exact for the callers' `x`, the second rounding once).
    fn scale2_float(x: f32, n: i32) -> f32 {
        let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
        let n1 = n / 2;
        x * pow2(n1) * pow2(n - n1)
    }

    /// The former `frexp_abs`: a subnormal multiplied by 2^24 in float arithmetic.
    fn frexp_abs_float(x: f32) -> (f32, i32) {
        let bits = x.to_bits() & 0x7fff_ffff;
        let sub = bits < 0x0080_0000;
        let bits = if sub { (f32::from_bits(bits) * 16_777_216.0).to_bits() } else { bits };
        let e = ((bits >> 23) as i32) - 127 - if sub { 24 } else { 0 };
        (f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000), e)
    }

    /// `x · 2^n` rounded once to nearest even: exact in f64 (24 bits times a
    /// power of two well inside its range), then one rounding to f32.
    fn scale2_exact(x: f32, n: i32) -> f32 {
        (x as f64 * 2f64.powi(n)) as f32
    }

    /// Mantissas for the sweeps: a stride through [1, 2), the ends, the ties
    /// of every subnormal shift (low bits 10…0, 10…1, 01…1) and a few more.
    fn mantissas() -> Vec<u32> {
        let mut m: Vec<u32> = (0..1u32 << 23).step_by(97).collect();
        m.extend([0, 1, 2, 3, 0x7f_ffff, 0x7f_fffe, 0x40_0000, 0x40_0001, 0x3f_ffff, 0x20_0000, 0x60_0000]);
        for k in 0..23 {
            m.extend([1 << k, (1 << k) | 1, (1 << k) - 1, (1 << k) + (1 << (k + 1)), 0x7f_ffff ^ (1 << k)]);
        }
        m
    }

    /// The integer `scale2` is `x · 2^n` correctly rounded for every `n` of
    /// the range, `x` across [1, 2) (both signs) and [1/2, 1); and it is the
    /// float formula's bits wherever that one rounds once — which it does for
    /// every `x` in [1, 2) (checked: no pair there differs).
    #[test]
    fn scale2_is_the_float_formula_wherever_that_is_correctly_rounded() {
        let mut pairs = 0usize;
        for m in mantissas() {
            for (field, sign) in [(127u32, 0u32), (127, 0x8000_0000), (126, 0)] {
                let x = f32::from_bits(sign | (field << 23) | m);
                for n in -252..=254 {
                    let (got, want, old) = (scale2(x, n), scale2_exact(x, n), scale2_float(x, n));
                    assert_eq!(got.to_bits(), want.to_bits(), "scale2({x:e}, {n})");
                    if field == 127 || old.to_bits() == want.to_bits() {
                        assert_eq!(got.to_bits(), old.to_bits(), "scale2({x:e}, {n}) against the float formula");
                    }
                    pairs += 1;
                }
            }
        }
        assert!(pairs > 20_000_000);
        // x of other binades, far shifts, and the special values
        for (x, n) in [(f32::MAX, -300), (f32::MIN_POSITIVE, 300), (1.5, -1000), (1.5, 1000), (-3.0, -149), (6.0, -151)] {
            assert_eq!(scale2(x, n).to_bits(), scale2_exact(x, n).to_bits(), "scale2({x:e}, {n})");
        }
        for x in [0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::from_bits(0xffc0_1234)] {
            for n in [-252, -1, 0, 1, 254] {
                assert_eq!(scale2(x, n).to_bits(), x.to_bits(), "scale2({x:e}, {n})");
            }
        }
    }

    /// The integer `frexp_abs` gives the float version's `(m, e)` for every
    /// subnormal (and ±0), a stride of normals and the special values.
    #[test]
    fn frexp_abs_is_the_float_version_for_every_subnormal() {
        let same = |b: u32| {
            let x = f32::from_bits(b);
            let (got, old) = (frexp_abs(x), frexp_abs_float(x));
            assert_eq!((got.0.to_bits(), got.1), (old.0.to_bits(), old.1), "frexp_abs({b:#010x})");
        };
        (0..0x0080_0000u32).for_each(same);
        (0..=u32::MAX / 4099).map(|i| i * 4099).for_each(same);
        for b in [0x8000_0000, 0x8000_0001, 0x807f_ffff, 0x0080_0000, 0x7f7f_ffff, 0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0xffff_ffff] {
            same(b);
        }
        assert_eq!(frexp_abs(0.0), (1.0, -151), "zero: the value the callers discard");
    }

    /// Runs `f` with this thread's x86 FTZ and DAZ flags set — subnormal
    /// results of `* + −` and `fma` written as zero, subnormal operands read as
    /// zero: what a flushing GPU does — and restores the flags after.
    #[cfg(target_arch = "x86_64")]
    fn flushing<R>(f: impl FnOnce() -> R) -> R {
        let mut old = 0u32;
        // SAFETY: stmxcsr / ldmxcsr store and load this thread's MXCSR through
        // valid pointers; the flags change only how subnormals are treated.
        // `f` takes its inputs through `black_box` and gives its results to
        // it, so its float work is ordered between the two loads.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut old, options(nostack)) };
        let on = old | 0x8040;
        // SAFETY: as above (FTZ = bit 15, DAZ = bit 6 of MXCSR, both valid to set).
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &on, options(nostack)) };
        let r = f();
        // SAFETY: as above; `old` is the MXCSR value stored at the start.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &old, options(nostack)) };
        r
    }

    /// The exponent steps (`frexp_abs`, `scale2`) take no float arithmetic,
    /// so flushing subnormals changes none of their results, nor those of the
    /// division, square root, exp and log built on them, where subnormals are
    /// operands or results: every value here is the same with FTZ and DAZ set
    /// as without. (The former float steps fail it: DAZ reads a subnormal as
    /// 0 in `x · 2^24`, FTZ writes `scale2`'s subnormal products as 0.)
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn exponent_steps_survive_flushed_subnormals() {
        use std::hint::black_box;
        let subs: Vec<f32> = (1..0x0080_0000u32).map(f32::from_bits).collect();
        let run = || {
            let mut out: Vec<(&'static str, u32, u32)> = Vec::new();
            let mut put = |what, x: f32, y: u32| out.push((what, x.to_bits(), black_box(y)));
            for &x in black_box(&subs) {
                let x = black_box(x);
                let (m, e) = frexp_abs(x);
                put("frexp_abs m", x, m.to_bits());
                put("frexp_abs e", x, e as u32);
            }
            for &x in black_box(&subs).iter().step_by(61) {
                let x = black_box(x);
                put("div(x, 3)", x, div(x, 3.0).to_bits());
                put("div(x, 0.7)", x, div(x, 0.7).to_bits());
                put("div(1, x)", x, div(1.0, x).to_bits());
                put("div(x, min normal)", x, div(x, f32::MIN_POSITIVE).to_bits());
                put("sqrt", x, sqrt_soft(x).to_bits());
                put("log", x, log(x).to_bits());
            }
            for i in 0..1u32 << 16 {
                let m = black_box(f32::from_bits(0x3f80_0000 | (i * 127)));
                let n = -(i as i32 % 26) - 125;
                put("scale2 into the subnormals", m, scale2(m, n).to_bits());
                put("div(1e-38, m)", m, div(1e-38, m).to_bits());
                let x = black_box(-87.4 - 16.5 * (i as f32 / 65536.0));
                put("exp to a subnormal", x, exp(x).to_bits());
            }
            out
        };
        let plain = run();
        let flushed = flushing(|| {
            // the flags are live: the smallest subnormal times 1 is 0
            assert_eq!(black_box(f32::from_bits(1)) * black_box(1.0), 0.0);
            run()
        });
        assert!(plain.iter().any(|&(w, _, y)| w == "exp to a subnormal" && y != 0 && y < 0x0080_0000));
        for (p, f) in plain.iter().zip(&flushed) {
            assert_eq!(p, f, "{}({:#010x}): {:#010x} unflushed, {:#010x} flushed", p.0, p.1, p.2, f.2);
        }
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

    /// The premise of [`div_lanes`]' proof: the Newton reciprocal of every
    /// mantissa has relative error at most 2^-22 (products of two f32 are exact
    /// in f64).
    #[test]
    fn reciprocal_is_within_2_pow_minus_22_for_every_mantissa() {
        let mut worst = 0.0f64;
        for m in 0..1u32 << 23 {
            let mb = f32::from_bits(0x3f80_0000 | m);
            let r = Divisor::new(mb).r;
            worst = worst.max((mb as f64 * r as f64 - 1.0).abs());
        }
        assert!(worst <= 2f64.powi(-22), "worst |mb r - 1| = {worst:e}");
    }

    /// Pairs for the fast division's tests: mostly random over the whole range
    /// (every sign, exponent and mantissa), a share with both operands in one
    /// binade, specials and boundary exponents, and neighbours of exact
    /// quotients (quotients next to powers of two and to ties).
    fn division_pairs(n: usize) -> Vec<(f32, f32)> {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            1e-45,
            f32::MAX,
            2f32.powi(-100),
            2f32.powi(-99),
            f32::from_bits(0x0d7f_ffff),
            3.0,
            1.5,
            0.1,
        ];
        let mut out = Vec::with_capacity(n + specials.len().pow(2));
        for &a in &specials {
            for &b in &specials {
                out.push((a, b));
            }
        }
        while out.len() < n {
            let x = next();
            let (a, b) = match x % 5 {
                0 => (f32::from_bits(x as u32), f32::from_bits((x >> 32) as u32)),
                1 => (
                    f32::from_bits(0x3f80_0000 | (x as u32 & 0x007f_ffff)),
                    f32::from_bits(0x3f80_0000 | ((x >> 32) as u32 & 0x007f_ffff)),
                ),
                2 => {
                    // a quotient q times b, nudged by a few ulps: a/b lands next
                    // to q, which is often a power of two or has few bits
                    let b = f32::from_bits(0x3f80_0000 | ((x >> 32) as u32 & 0x007f_ffff));
                    let q = f32::from_bits(0x3f00_0000 + ((x as u32 >> 8) & 0x00ff_0000));
                    let a = (b * q).to_bits() as i64 + ((x >> 20) % 7) as i64 - 3;
                    (f32::from_bits(a as u32), b)
                }
                3 => {
                    // a below 2^-100 with b and a/b above it: the remainder
                    // a - q b would not be exact there
                    let a = f32::from_bits(
                        (((x >> 40) as u32 % 20 + 6) << 23) | (x as u32 & 0x807f_ffff),
                    );
                    let b = f32::from_bits(
                        (((x >> 48) as u32 % 50 + 67) << 23) | ((x >> 8) as u32 & 0x007f_ffff),
                    );
                    (a, b)
                }
                _ => {
                    // exponents at the edges of the fast path's range
                    let e = [25u32, 26, 27, 28, 127, 253, 254][(x >> 40) as usize % 7];
                    let a = f32::from_bits((e << 23) | (x as u32 & 0x807f_ffff));
                    let b = f32::from_bits(((x >> 24) as u32 & 0xbfff_ffff) | 0x3000_0000);
                    if x & 1 == 0 {
                        (a, b)
                    } else {
                        (b, a)
                    }
                }
            };
            out.push((a, b));
        }
        out
    }

    /// What the fast division's proof rests on, checked against the exact
    /// quotient (f64 has it to 2^-53, far finer than the 2^-13 ulp in play):
    /// every quotient `div_hw` accepts is more than 2^-16 ulp from the
    /// rounding midpoints on both sides — so the hardware's correctly rounded
    /// result is `div`'s — and the acceptance rate is what makes it fast.
    #[test]
    fn accepted_hardware_quotients_are_far_from_every_midpoint() {
        let pairs = division_pairs(4_000_000);
        let (mut accepted, mut normal_in_one_binade) = (0usize, 0usize);
        let mut near_tie_rejected = 0usize;
        for &(a, b) in &pairs {
            let (q, ok) = div_hw(a, b);
            let both_in_range = (27..255).contains(&((a.to_bits() >> 23) & 0xff))
                && (27..255).contains(&((b.to_bits() >> 23) & 0xff));
            let t = (a as f64 / b as f64).abs();
            let qa = q.abs();
            let q_normal = (1..255).contains(&((q.to_bits() >> 23) & 0xff));
            if both_in_range && q_normal {
                // q's neighbours in f64 (exact), also past f32::MAX
                let ulp = 2f64.powi(((qa.to_bits() >> 23) as i32 - 150).max(-149));
                let below = if qa.to_bits() & 0x007f_ffff == 0 {
                    ulp / 2.0
                } else {
                    ulp
                };
                let qa = qa as f64;
                let (up, dn) = (qa + ulp, qa - below);
                let dist = ((qa + up) / 2.0 - t).min(t - (qa + dn) / 2.0);
                assert!(dist >= 0.0, "{a} / {b}: hardware q {q} is not the nearest");
                if ok {
                    assert!(
                        dist > ulp * 2f64.powi(-16),
                        "{a} / {b}: accepted {dist:e} from a tie"
                    );
                } else if dist < ulp * 2f64.powi(-16) {
                    near_tie_rejected += 1;
                }
                normal_in_one_binade += (t > 1e-25 && t < 1e25) as usize;
            }
            if ok {
                // the proof's other premise: the remainder is exact (in f64
                // q·b is exact and the subtraction cancels exactly)
                let r = (-q).mul_add(b, a) as f64;
                assert_eq!(
                    r,
                    a as f64 - q as f64 * b as f64,
                    "{a} / {b}: inexact remainder"
                );
                assert_eq!(q.to_bits(), div(a, b).to_bits(), "{a} / {b}");
                accepted += 1;
            }
        }
        assert!(
            near_tie_rejected > 0,
            "the sample holds no quotient next to a tie"
        );
        // nearly every ordinary quotient takes the fast path
        assert!(
            accepted as f64 > 0.99 * normal_in_one_binade as f64,
            "{accepted} / {normal_in_one_binade}"
        );
    }

    type DivLanes = fn([f32; LANES], [f32; LANES]) -> [f32; LANES];

    /// The vector divisions: `div_lanes`, and the AVX2 kernels' `avx2::div`
    /// where the CPU has it.
    fn vector_divisions() -> Vec<(&'static str, DivLanes)> {
        let mut v: Vec<(&'static str, DivLanes)> = vec![("div_lanes", div_lanes)];
        #[cfg(target_arch = "x86_64")]
        if crate::backend::cpu::simd::available().contains(&crate::backend::cpu::simd::Level::Avx2) {
            v.push(("avx2::div", |a, b| {
                use std::arch::x86_64::*;
                let mut q = [0.0f32; LANES];
                // SAFETY: listed only where the CPU has AVX2 and FMA; arrays of LANES values.
                unsafe { _mm256_storeu_ps(q.as_mut_ptr(), avx2::div(_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr()))) };
                q
            }));
        }
        v
    }

    /// `f` on 16 lanes of `x` (and `y`), where the CPU has AVX-512.
    #[cfg(target_arch = "x86_64")]
    fn on_avx512(
        x: [f32; 16],
        y: [f32; 16],
        f: unsafe fn(std::arch::x86_64::__m512, std::arch::x86_64::__m512) -> std::arch::x86_64::__m512,
    ) -> Option<[f32; 16]> {
        use std::arch::x86_64::*;
        if !crate::backend::cpu::simd::available().contains(&crate::backend::cpu::simd::Level::Avx512) {
            return None;
        }
        let mut out = [0.0f32; 16];
        // SAFETY: the CPU has AVX-512F (checked above); arrays of 16 values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), f(_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(y.as_ptr()))) };
        Some(out)
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_exp_and_div_equal_the_scalar_bits() {
        let pairs = division_pairs(2_000_000);
        for g in pairs.chunks_exact(16) {
            let (a, b) = (std::array::from_fn(|i| g[i].0), std::array::from_fn(|i| g[i].1));
            let Some(q) = on_avx512(a, b, avx512::div) else { return };
            for i in 0..16 {
                assert_eq!(q[i].to_bits(), div(a[i], b[i]).to_bits(), "avx512::div: {} / {}", a[i], b[i]);
            }
        }
        let (lo, hi) = (EXP_LO.to_bits(), EXP_HI.to_bits());
        let xs: Vec<f32> = (0..=u32::MAX / 251)
            .map(|i| i * 251)
            .chain((-87.0f32).to_bits()..=lo + 4096)
            .chain(hi - 4096..=hi + 4096)
            .map(f32::from_bits)
            .collect();
        for g in xs.chunks_exact(16) {
            let x = std::array::from_fn(|i| g[i]);
            let y = on_avx512(x, x, |x, _| {
                // SAFETY: called by `on_avx512` only where the CPU has AVX-512F.
                unsafe { avx512::exp(x) }
            }).expect("AVX-512 checked above");
            for (y, &v) in y.iter().zip(&x) {
                assert_eq!(y.to_bits(), exp(v).to_bits(), "avx512::exp({v:e})");
            }
        }
    }

    #[test]
    fn vector_divisions_equal_div_bit_for_bit() {
        let pairs = division_pairs(2_000_000);
        for (name, div_v) in vector_divisions() {
            for group in pairs.chunks_exact(LANES) {
                let a: [f32; LANES] = std::array::from_fn(|i| group[i].0);
                let b: [f32; LANES] = std::array::from_fn(|i| group[i].1);
                let q = div_v(a, b);
                for i in 0..LANES {
                    assert_eq!(q[i].to_bits(), div(a[i], b[i]).to_bits(), "{name}: {} / {}", a[i], b[i]);
                }
            }
        }
    }

    #[test]
    fn exp_lanes_equals_exp_bit_for_bit() {
        // every 251st bit pattern, and every pattern whose e^x is subnormal or
        // near the overflow (where the vector scale2 could round differently)
        let strided = (0..=u32::MAX / 251).map(|i| i * 251);
        let (lo, hi) = (EXP_LO.to_bits(), EXP_HI.to_bits());
        let subnormal = (-87.0f32).to_bits()..=lo + 4096;
        let xs: Vec<f32> = strided
            .chain(subnormal)
            .chain(hi - 4096..=hi + 4096)
            .map(f32::from_bits)
            .collect();
        for g in xs.chunks(LANES) {
            let mut x = [0.0f32; LANES];
            x[..g.len()].copy_from_slice(g);
            for (y, &v) in exp_lanes(x).iter().zip(&x) {
                assert_eq!(y.to_bits(), exp(v).to_bits(), "exp({v:e})");
            }
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
