// fma.wgsl — a correctly rounded f32 fused multiply-add in integer arithmetic.
//
// Why: the contract needs `fma(a, b, c)` rounded once, but WGSL only promises
// that `fma` computes a * b + c, not that it is fused. Mesa's llvmpipe
// (lavapipe) lowers fma to a multiply and an add (two roundings: the parity
// tests showed 1-ulp differences in matmul, div, exp, SGD ...). At context
// creation the backend probes the device's `fma`; when it is not exactly
// fused, every kernel's `fma_c` calls `fma_soft` below instead. It uses
// integer operations only, so neither a compiler's float rewriting (llvmpipe
// does reassociate float constants, e.g. (y + 2^23) - 2^23 -> y) nor a
// device's subnormal flushing can change its bits.
//
// Method: |x| = m * 2^e with an integer mantissa m; the 48-bit product of the
// mantissas and c's mantissa are placed in 64-bit registers (vec2<u32>(lo, hi))
// with their top bit at 62, the smaller is shifted right with every lost bit
// ORed into bit 0 (sticky; lost bits only ever occur when the shift is large,
// so cancellation never exposes them), added or subtracted exactly, then
// rounded once to nearest-even at the f32 (or subnormal) position.

// High 32 bits of the 64-bit product a * b (the low half is the wrapping a * b);
// also Philox's multiply (rng.wgsl).
fn mulhi32(a: u32, b: u32) -> u32 {
    let al = a & 0xffffu;
    let ah = a >> 16u;
    let bl = b & 0xffffu;
    let bh = b >> 16u;
    let ll = al * bl;
    let lh = al * bh;
    let hl = ah * bl;
    let hh = ah * bh;
    let mid = (ll >> 16u) + (lh & 0xffffu) + (hl & 0xffffu);
    return hh + (lh >> 16u) + (hl >> 16u) + (mid >> 16u);
}

fn u64_clz(x: vec2<u32>) -> u32 {
    if x.y != 0u {
        return countLeadingZeros(x.y);
    }
    return 32u + countLeadingZeros(x.x);
}

// x << s for s in 0..=63
fn u64_shl(x: vec2<u32>, s: u32) -> vec2<u32> {
    if s == 0u {
        return x;
    }
    if s >= 32u {
        return vec2<u32>(0u, x.x << (s - 32u));
    }
    return vec2<u32>(x.x << s, (x.y << s) | (x.x >> (32u - s)));
}

// x >> s for any s, every bit shifted out ORed into bit 0
fn u64_shr_sticky(x: vec2<u32>, s: u32) -> vec2<u32> {
    if s == 0u {
        return x;
    }
    if s >= 64u {
        return vec2<u32>(select(0u, 1u, (x.x | x.y) != 0u), 0u);
    }
    var r: vec2<u32>;
    var lost: u32;
    if s >= 32u {
        let t = s - 32u;
        r = vec2<u32>(x.y >> t, 0u);
        lost = x.x | (x.y & ((1u << t) - 1u));
    } else {
        r = vec2<u32>((x.x >> s) | (x.y << (32u - s)), x.y >> s);
        lost = x.x & ((1u << s) - 1u);
    }
    if lost != 0u {
        r.x = r.x | 1u;
    }
    return r;
}

fn u64_add(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

fn u64_sub(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    return vec2<u32>(a.x - b.x, a.y - b.y - select(0u, 1u, a.x < b.x));
}

fn u64_lt(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.y < b.y || (a.y == b.y && a.x < b.x);
}

struct MantExp {
    m: u32, // integer mantissa (24 bits for normals)
    e: i32, // |x| = m * 2^e
}

// |x| of a finite non-zero x given as bits without the sign
fn fs_unpack(a: u32) -> MantExp {
    let ex = a >> 23u;
    let fr = a & 0x007fffffu;
    if ex == 0u {
        return MantExp(fr, -149);
    }
    return MantExp(fr | 0x00800000u, i32(ex) - 150);
}

// fma(a, b, c) = a * b + c with one rounding (nearest, ties to even), IEEE
// special values; NaN results are the quiet NaN.
fn fma_soft(a: f32, b: f32, c: f32) -> f32 {
    let ab = bitcast<u32>(a);
    let bb = bitcast<u32>(b);
    let cb = bitcast<u32>(c);
    let sp = (ab ^ bb) & 0x80000000u;
    let sc = cb & 0x80000000u;
    let aa = ab & 0x7fffffffu;
    let ba = bb & 0x7fffffffu;
    let ca = cb & 0x7fffffffu;
    if aa > 0x7f800000u || ba > 0x7f800000u || ca > 0x7f800000u {
        return bitcast<f32>(0x7fc00000u);
    }
    if aa == 0x7f800000u || ba == 0x7f800000u {
        if aa == 0u || ba == 0u {
            return bitcast<f32>(0x7fc00000u); // inf * 0
        }
        if ca == 0x7f800000u && sc != sp {
            return bitcast<f32>(0x7fc00000u); // inf - inf
        }
        return bitcast<f32>(sp | 0x7f800000u);
    }
    if ca == 0x7f800000u {
        return c;
    }
    if aa == 0u || ba == 0u {
        // exact ±0 product: ±0 + c
        if ca == 0u {
            return bitcast<f32>(sp & sc); // -0 only when both are -0
        }
        return c;
    }
    let ua = fs_unpack(aa);
    let ub = fs_unpack(ba);
    var x = vec2<u32>(ua.m * ub.m, mulhi32(ua.m, ub.m)); // the exact product, < 2^48
    let lzp = u64_clz(x);
    x = u64_shl(x, lzp - 1u); // top bit at 62: one bit of headroom for a carry
    var ex = ua.e + ub.e - i32(lzp - 1u);
    var sx = sp;
    if ca != 0u {
        let uc = fs_unpack(ca);
        var y = vec2<u32>(uc.m, 0u);
        let lzc = u64_clz(y);
        y = u64_shl(y, lzc - 1u);
        var ey = uc.e - i32(lzc - 1u);
        var sy = sc;
        // x gets the larger magnitude (both have their top bit at 62)
        if ey > ex || (ey == ex && u64_lt(x, y)) {
            let tx = x;
            x = y;
            y = tx;
            let te = ex;
            ex = ey;
            ey = te;
            let ts = sx;
            sx = sy;
            sy = ts;
        }
        let ys = u64_shr_sticky(y, u32(ex - ey));
        if sx == sy {
            x = u64_add(x, ys);
        } else {
            x = u64_sub(x, ys);
        }
        if x.x == 0u && x.y == 0u {
            return 0.0; // exact cancellation: +0 when rounding to nearest
        }
    }
    // Round x * 2^ex to f32.
    let lz = u64_clz(x);
    x = u64_shl(x, lz);
    let e_top = ex - i32(lz) + 63; // x * 2^ex is in [2^e_top, 2^(e_top + 1))
    if e_top > 127 {
        return bitcast<f32>(sx | 0x7f800000u);
    }
    // Bits below the kept mantissa: 40 for normals, more for subnormals.
    var shift = 40u;
    if e_top < -126 {
        shift = u32(-86 - e_top);
    }
    if shift > 64u {
        return bitcast<f32>(sx); // below half the smallest subnormal
    }
    var m = 0u;
    var rem = x;
    var half = vec2<u32>(0u, 0x80000000u);
    if shift < 64u {
        let t = shift - 32u; // 8..=31
        m = x.y >> t;
        rem = vec2<u32>(x.x, x.y & ((1u << t) - 1u));
        half = vec2<u32>(0u, 1u << (t - 1u));
    }
    if u64_lt(half, rem) || (rem.x == half.x && rem.y == half.y && (m & 1u) == 1u) {
        m = m + 1u;
    }
    var bits: u32;
    if e_top < -126 {
        bits = m; // subnormal; m == 2^23 is the smallest normal, as encoded
    } else {
        bits = (u32(e_top + 126) << 23u) + m; // m's implicit bit carries into the exponent
    }
    if bits >= 0x7f800000u {
        return bitcast<f32>(sx | 0x7f800000u);
    }
    return bitcast<f32>(sx | bits);
}

// mathlib.wgsl — the WGSL half of the numerics contract: the twin of
// src/backend/math.rs (the same operations in the same order; the Rust writes
// the special cases below as selects after the main path, so its loops
// vectorise, uses the hardware square root, proven equal to m_sqrt on all
// 2^32 inputs, and the hardware division where its result provably equals
// m_div's, see math.rs div_lanes). Prepended (with cast.wgsl) to every kernel that needs it, by
// string concatenation at pipeline creation.
//
// Rules (the same as in math.rs):
// * every multiply that feeds an add is an explicit fused multiply-add, written
//   `fma_c` here (see below); where the Rust does `a * b` and then a separate
//   `+`, the WGSL does too, and the product is always exact there (a power of
//   two, or an operand of an fma), so a compiler fusing it could not change bits;
// * special values (NaN, ±inf, ±0) are decided on bit patterns before any
//   arithmetic (WGSL has no isNan, and fast-math compilers may fold x != x);
// * no float arithmetic where a device may flush subnormals and an integer
//   route exists: frexp_abs and scale2 (the exponent in and out of every
//   division, square root, exp and log) work on the bits alone;
// * no arithmetic on a constant infinity or NaN on a path that finite inputs
//   take (a compiler assuming no inf/NaN may fold it): m_sigmoid returns the
//   results of exp's overflow and NaN by bits instead of adding 1 to them;
// * constants are written as hex float literals of the exact f32 the Rust
//   constant expression produces (e.g. -8f32/17f32), never as decimal
//   expressions that a WGSL compiler would evaluate in higher precision.
//
// `fma_c(a, b, c)` is defined in the prelude the backend puts before this file:
// the device's `fma` when a start-up probe shows it is exactly fused, else
// `fma_soft` (fma.wgsl, an integer emulation). WGSL's `fma` need not be fused,
// and on lavapipe it is not (see below).
//
// What lavapipe does (Mesa 22.3.6 llvmpipe, LLVM 15.0.6, x86-64 with FMA3 and
// AVX-512; both its Vulkan and its GL driver), found by tests/gpu_parity.rs:
// * Subnormals: f32 subnormals are preserved, not flushed, as inputs and
//   outputs of `+`, `-`, `*` and of comparisons (`x > 0.0` is true for the
//   smallest subnormal): every primitive's parity test feeds subnormals and
//   matches the CPU bit for bit. The contract therefore keeps IEEE gradual
//   underflow on both sides (no flushing anywhere).
// * `fma` is NOT fused: Mesa lowers it to a multiply and an add (two
//   roundings). Matmul, div, exp, SGD ... differed by 1 ulp with the native
//   `fma`; with `fma_soft` they match. (`fma` on subnormals is therefore just
//   `*` then `+`, both of which keep subnormals.)
// * No contraction of a separate `a * b + c` into an fma was observed.
// * Float expressions with constants ARE reassociated: round.rs's
//   `(y + 2^23) - 2^23` came back as `y`. Code here never relies on the
//   grouping of float constant operations; cast.wgsl's fp16 subnormal path
//   rounds on integers instead.

const QNAN: u32 = 0x7fc00000u;

const M8_17: f32 = -0x1.e1e1e2p-2f; // -8f32 / 17f32
const C24_17: f32 = 0x1.69696ap0f; // 24f32 / 17f32
const R5040: f32 = 0x1.a01a02p-13f; // 1f32 / 5040f32
const R720: f32 = 0x1.6c16c2p-10f;
const R120: f32 = 0x1.111112p-7f;
const R24: f32 = 0x1.555556p-5f;
const R6: f32 = 0x1.555556p-3f;
const T13: f32 = 0x1.3b13b2p-3f; // 2f32 / 13f32
const T11: f32 = 0x1.745d18p-3f;
const T9: f32 = 0x1.c71c72p-3f;
const T7: f32 = 0x1.24924ap-2f;
const T5: f32 = 0x1.99999ap-2f;
const T3: f32 = 0x1.555556p-1f;
const LOG2E: f32 = 0x1.715476p0f;
const SQRT2: f32 = 0x1.6a09e6p0f;
const LN2_HI: f32 = 0x1.62e400p-1f; // 0x3f317200: few mantissa bits, so n * LN2_HI is exact
const LN2_LO: f32 = 0x1.7f7d1cp-20f; // ln2 - LN2_HI
const EXP_HI: f32 = 0x1.62e430p6f; // 88.72284: above it e^x overflows
const EXP_LO: f32 = -0x1.9fe36cp6f; // -103.97209: below it e^x underflows to 0

fn is_nan_bits(b: u32) -> bool {
    return (b & 0x7fffffffu) > 0x7f800000u;
}

// Exponent field all ones: ±inf or NaN (the finite check tests this).
fn is_nonfinite_bits(b: u32) -> bool {
    return (b & 0x7f800000u) == 0x7f800000u;
}

// x * 2^n, correctly rounded (nearest, ties to even), in integer steps on the
// bits alone: no float arithmetic, so a device that flushes subnormals cannot
// change it. Precondition: x normal, ±0, ±inf or NaN (a subnormal x reads as a
// zero), |n| < 2^30; the callers pass a normal x near 1. ±0, ±inf and NaN
// come back as they are. A normal result moves the exponent field; a field
// past 254 is ±inf; a subnormal result shifts the 24-bit significand right by
// 1 - f (clamped to 25, where the value is below half the smallest subnormal:
// WGSL shifts by 32 or more are invalid) and rounds to nearest even on the
// bits shifted out (a significand that rounds up to 2^23 is the smallest
// normal, as encoded).
fn scale2(x: f32, n: i32) -> f32 {
    let b = bitcast<u32>(x);
    let field = i32((b >> 23u) & 0xffu);
    if field == 0 || field == 255 {
        return x;
    }
    let sign = b & 0x80000000u;
    let f = field + n;
    if f >= 255 {
        return bitcast<f32>(sign | 0x7f800000u);
    }
    if f >= 1 {
        return bitcast<f32>(sign | (u32(f) << 23u) | (b & 0x007fffffu));
    }
    let sig = (b & 0x007fffffu) | 0x00800000u;
    let s = u32(min(1 - f, 25));
    var q = sig >> s;
    let rem = sig & ((1u << s) - 1u);
    let half = 1u << (s - 1u);
    if rem > half || (rem == half && (q & 1u) == 1u) {
        q = q + 1u;
    }
    return bitcast<f32>(sign | q);
}

struct Frexp {
    m: f32,
    e: i32,
}

// Splits a finite, non-zero |x| into (m, e), m in [1, 2), |x| = m * 2^e. For
// ±0, ±inf and NaN m is still in [1, 2) (callers discard the result; ±0 gives
// m = 1, e = -151). Integer steps only: a subnormal is normalised by shifting
// its leading bit up to the implicit bit (a leading-zero count), never by a
// float multiply a flushing device would turn into 0.
fn frexp_abs(x: f32) -> Frexp {
    var bits = bitcast<u32>(x) & 0x7fffffffu;
    var s = 0u;
    if bits < 0x00800000u {
        // Subnormal: shift 1..=23 (zero: 24, which leaves field 0).
        s = countLeadingZeros(bits) - 8u;
        bits = bits << s;
    }
    let e = i32(bits >> 23u) - 127 - i32(s);
    let m = bitcast<f32>((bits & 0x007fffffu) | 0x3f800000u);
    return Frexp(m, e);
}

// a / b, correctly rounded for normal results (reciprocal by a linear guess and
// three Newton steps, one Markstein correction, exponent applied by scale2).
// Split in two like the Rust: divisor_new(b) is the half that depends on b
// alone (done once when many values share a divisor), divisor_div the rest.
fn m_div(a: f32, b: f32) -> f32 {
    return divisor_div(divisor_new(b), a);
}

struct Divisor {
    bits: u32,
    mb: f32,
    eb: i32,
    r: f32,
}

fn divisor_new(b: f32) -> Divisor {
    let fb = frexp_abs(b);
    let mb = fb.m;
    // r ≈ 1/mb: the minimax line 24/17 - 8/17 mb on [1, 2), then three
    // Newton steps r += r (1 - mb r), written out: lavapipe counts every loop
    // iteration against its 65,535 per invocation, and a division inside a
    // product's k loop (SwiGLU computed as A is loaded) would spend them.
    var r = fma_c(M8_17, mb, C24_17);
    r = fma_c(r, fma_c(-mb, r, 1.0), r);
    r = fma_c(r, fma_c(-mb, r, 1.0), r);
    r = fma_c(r, fma_c(-mb, r, 1.0), r);
    return Divisor(bitcast<u32>(b), mb, fb.e, r);
}

fn divisor_div(dv: Divisor, a: f32) -> f32 {
    let ab = bitcast<u32>(a);
    let bb = dv.bits;
    let sign = (ab ^ bb) & 0x80000000u;
    let aa = ab & 0x7fffffffu;
    let ba = bb & 0x7fffffffu;
    if is_nan_bits(ab) || is_nan_bits(bb) {
        return bitcast<f32>(QNAN);
    }
    if ba == 0x7f800000u {
        // x / ±inf
        if aa == 0x7f800000u {
            return bitcast<f32>(QNAN);
        }
        return bitcast<f32>(sign);
    }
    if ba == 0u {
        // x / ±0
        if aa == 0u {
            return bitcast<f32>(QNAN);
        }
        return bitcast<f32>(sign | 0x7f800000u);
    }
    if aa == 0x7f800000u {
        return bitcast<f32>(sign | 0x7f800000u);
    }
    if aa == 0u {
        return bitcast<f32>(sign);
    }
    let fa = frexp_abs(a);
    let ma = fa.m;
    let q0 = ma * dv.r;
    let rem = fma_c(-q0, dv.mb, ma);
    let q = fma_c(rem, dv.r, q0);
    let d = fa.e - dv.eb;
    if d > 128 {
        return bitcast<f32>(sign | 0x7f800000u);
    }
    if d < -151 {
        return bitcast<f32>(sign);
    }
    return bitcast<f32>(bitcast<u32>(scale2(q, d)) | sign);
}

// sqrt(x), correctly rounded for every input (all 2^32 checked against the CPU's
// hardware sqrt, which the CPU backend therefore uses); sqrt(-0) = -0, negative -> NaN.
fn m_sqrt(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    if is_nan_bits(b) {
        return bitcast<f32>(QNAN);
    }
    if (b & 0x7fffffffu) == 0u {
        return x;
    }
    if (b & 0x80000000u) != 0u {
        return bitcast<f32>(QNAN);
    }
    if b == 0x7f800000u {
        return x;
    }
    let f = frexp_abs(x);
    var m = f.m;
    var e = f.e;
    if (e & 1) != 0 {
        // Make the exponent even: m in [2, 4).
        m *= 2.0;
        e -= 1;
    }
    // y ≈ 1/sqrt(m): the bit-trick guess, then Newton y += y/2 (1 - m y²).
    var y = bitcast<f32>(0x5f3759dfu - (bitcast<u32>(m) >> 1u));
    for (var i = 0; i < 3; i++) {
        let t = m * y;
        let r = fma_c(-t, y, 1.0);
        y = fma_c(y * 0.5, r, y);
    }
    // s ≈ sqrt(m), corrected once: s += (m - s²) y/2.
    let s0 = m * y;
    let d = fma_c(-s0, s0, m);
    let s = fma_c(d, y * 0.5, s0);
    return scale2(s, e / 2);
}

// 1 / sqrt(x), as div(1, sqrt(x)).
fn m_rsqrt(x: f32) -> f32 {
    return m_div(1.0, m_sqrt(x));
}

// e^x within about one ulp: x = n ln2 + r (ln2 split in two), degree-7 Taylor
// polynomial in Horner form, 2^n applied by scale2.
fn m_exp(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    if is_nan_bits(b) {
        return bitcast<f32>(QNAN);
    }
    if x > EXP_HI {
        return bitcast<f32>(0x7f800000u);
    }
    if x < EXP_LO {
        return 0.0;
    }
    let n = floor(fma_c(x, LOG2E, 0.5));
    var r = fma_c(-n, LN2_HI, x);
    r = fma_c(-n, LN2_LO, r);
    var p = R5040;
    p = fma_c(p, r, R720);
    p = fma_c(p, r, R120);
    p = fma_c(p, r, R24);
    p = fma_c(p, r, R6);
    p = fma_c(p, r, 0.5);
    p = fma_c(p, r, 1.0);
    p = fma_c(p, r, 1.0);
    return scale2(p, i32(n));
}

// Natural logarithm within about one ulp: m in [sqrt(1/2), sqrt(2)),
// log m = 2 atanh(s), s = (m-1)/(m+1), odd series to s^13.
fn m_log(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    if is_nan_bits(b) {
        return bitcast<f32>(QNAN);
    }
    if (b & 0x7fffffffu) == 0u {
        return bitcast<f32>(0xff800000u);
    }
    if (b & 0x80000000u) != 0u {
        return bitcast<f32>(QNAN);
    }
    if b == 0x7f800000u {
        return x;
    }
    let f = frexp_abs(x);
    var m = f.m;
    var e = f.e;
    if m > SQRT2 {
        m *= 0.5;
        e += 1;
    }
    let s = m_div(m - 1.0, m + 1.0);
    let s2 = s * s;
    var p = T13;
    p = fma_c(p, s2, T11);
    p = fma_c(p, s2, T9);
    p = fma_c(p, s2, T7);
    p = fma_c(p, s2, T5);
    p = fma_c(p, s2, T3);
    p = fma_c(p, s2, 2.0);
    let lm = p * s;
    let ef = f32(e);
    return fma_c(ef, LN2_HI, fma_c(ef, LN2_LO, lm));
}

// 1 / (1 + e^-x), with -x written -0.0 - x like the CPU's unary ops. Where
// e^-x overflows (a finite x below -88.72) the formula is div(1, 1 + inf) =
// +0, and for a NaN x it is div(1, 1 + NaN) = the quiet NaN: both are returned
// from exp's bits, so no arithmetic sees the constant inf or NaN m_exp
// returns (the same bits as the formula, which the Rust twin computes).
fn m_sigmoid(x: f32) -> f32 {
    let t = m_exp(-0.0 - x);
    let tb = bitcast<u32>(t);
    if tb == 0x7f800000u {
        return 0.0;
    }
    if is_nan_bits(tb) {
        return bitcast<f32>(QNAN);
    }
    return m_div(1.0, 1.0 + t);
}

// x * sigmoid(x) (SiLU, the Llama MLP's gate activation).
fn m_silu(x: f32) -> f32 {
    return x * m_sigmoid(x);
}

// SwiGLU's value of one gate and up pair, (gate·σ(gate))·up, the first
// product kept apart from the second (see sep): the SwiGLU kernel's output and
// what a product reading it computes as it loads its operand.
fn swiglu_of(gate: f32, up: f32, zero: u32) -> f32 {
    return sep(gate * m_sigmoid(gate), zero) * up;
}

// `maximum` as the contract defines it: NaN wins, then the larger, +0 over -0.
fn maximum_c(a: f32, b: f32) -> f32 {
    if is_nan_bits(bitcast<u32>(a)) {
        return a;
    } else if is_nan_bits(bitcast<u32>(b)) || b > a {
        return b;
    } else if a == b && a == 0.0 && b == 0.0 {
        // ±0: prefer +0 (x + y on ±0 is +0 unless both are -0)
        return a + b;
    }
    return a;
}

// sep(x, zero): x, through its bits ORed with `zero`, a params field the host
// sets to 0. A compiler cannot see the operation behind it, so it can neither
// contract a product with the sum it feeds (one rounding for two) nor regroup
// a chain through it ((a·b)·c into a·(b·c)): the kernels wrap every product
// and sum that the CPU rounds on its own and that feeds another operation of
// the same kind (the tests' adversarial compiler finds every unwrapped one).
fn sep(x: f32, zero: u32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) | zero);
}
