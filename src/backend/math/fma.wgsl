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
