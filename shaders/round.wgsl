// cast.wgsl — rounding to the emulated 16-bit formats, on bit patterns: the
// twin of the f32 functions of src/backend/round.rs. Never WGSL's f32->f16
// conversion, whose rounding mode is unspecified. Each result is an f32 whose
// value is exactly representable in the format, chosen by round-to-nearest,
// ties-to-even; NaN stays NaN (quieted), ±inf stay, signed zero is kept.

// FMT_NONE, FMT_BF16, FMT_FP16: generated from round::fmt_code (the prelude).

// f32 -> nearest bf16 value: add 0x7fff + lsb to the bits and clear the low 16;
// a carry out of the mantissa bumps the exponent (overflow to ±inf included).
fn bf16_f32(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    if (b & 0x7fffffffu) > 0x7f800000u {
        return bitcast<f32>(b | 0x00400000u);
    }
    let lsb = (b >> 16u) & 1u;
    return bitcast<f32>((b + (0x7fffu + lsb)) & 0xffff0000u); // u32 + wraps, like wrapping_add
}

// f32 -> nearest fp16 value.
// * |x| >= 65520 (halfway between 65504 and 2^16, whose tie goes to the even 2^16): ±inf.
// * fp16 normals (|x| >= 2^-14): drop 13 mantissa bits with the add-and-mask trick.
// * below that the quantum is 2^-24: k = |x| * 2^24 rounded to the nearest even
//   integer, result k * 2^-24. round.rs computes k as (y + 2^23) - 2^23 in f32;
//   here it is done on the integer mantissa instead (the same value, exactly),
//   because llvmpipe folds (y + 2^23) - 2^23 into y — a float rewrite a WGSL
//   compiler may make — and a device that flushes subnormals could not even
//   read the input. Integer steps are immune to both.
fn fp16_f32(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    let sign = b & 0x80000000u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return bitcast<f32>(b | 0x00400000u);
    }
    if a >= 0x477ff000u {
        return bitcast<f32>(sign | 0x7f800000u);
    }
    if a >= 0x38800000u {
        let lsb = (a >> 13u) & 1u;
        return bitcast<f32>(sign | ((a + 0x0fffu + lsb) & ~0x1fffu));
    }
    // |x| = mant * 2^(ex - 150) (ex >= 1) or frac * 2^-149, so |x| * 2^24 = mant >> s
    let ex = a >> 23u;
    var mant = a & 0x007fffffu;
    var s = 125u;
    if ex != 0u {
        mant = mant | 0x00800000u;
        s = 126u - ex; // >= 14 since ex <= 112 here
    }
    if s > 24u {
        return bitcast<f32>(sign); // mant < 2^24 <= 2^(s-1): below half a quantum
    }
    var k = mant >> s;
    let rem = mant & ((1u << s) - 1u);
    let half = 1u << (s - 1u);
    if rem > half || (rem == half && (k & 1u) == 1u) {
        k = k + 1u;
    }
    if k == 0u {
        return bitcast<f32>(sign);
    }
    // k * 2^-24 from bits: k in 1..=1024, e = floor(log2 k)
    let e = 31u - countLeadingZeros(k);
    let bits = ((e + 103u) << 23u) | ((k << (23u - e)) & 0x007fffffu);
    return bitcast<f32>(sign | bits);
}

// Rounds to the format selected by a FMT_* code (FMT_NONE: unchanged).
fn round_fmt(x: f32, fmt: u32) -> f32 {
    if fmt == FMT_BF16 {
        return bf16_f32(x);
    } else if fmt == FMT_FP16 {
        return fp16_f32(x);
    }
    return x;
}

// The 16-bit pattern of x rounded to format `fmt`: the twin of pack/mod.rs
// `half_bits` (16-bit storage, written by pack.wgsl and by products that keep
// their A operand).
fn half_bits(x: f32, fmt: u32) -> u32 {
    if fmt == FMT_BF16 {
        return bitcast<u32>(bf16_f32(x)) >> 16u;
    }
    let b = bitcast<u32>(fp16_f32(x));
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return sign | 0x7c00u | ((a >> 13u) & 0x3ffu);
    }
    if a >= 0x47800000u {
        return sign | 0x7c00u;
    }
    if a >= 0x38800000u {
        return sign | (((a >> 23u) - 112u) << 10u) | ((a >> 13u) & 0x3ffu);
    }
    if a == 0u {
        return sign;
    }
    let e = a >> 23u;
    return sign | ((0x00800000u | (a & 0x007fffffu)) >> (126u - e));
}

// The float32 bits of a 16-bit pattern `h` of format `fmt`, exactly: the twin
// of pack/mod.rs `widen_bits` (16-bit storage, and products that read it).
fn widen_bits(h: u32, fmt: u32) -> u32 {
    if fmt == FMT_BF16 {
        return h << 16u;
    }
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if e == 31u {
        return sign | 0x7f800000u | (m << 13u);
    }
    if e != 0u {
        return sign | ((e + 112u) << 23u) | (m << 13u);
    }
    if m == 0u {
        return sign;
    }
    let p = firstLeadingBit(m);
    return sign | ((p + 103u) << 23u) | ((m << (23u - p)) & 0x007fffffu);
}

// Value e of 16-bit storage of format `fmt` from its word w (value e in the
// low half of word e / 2 for even e).
fn half_value(w: u32, e: u32, fmt: u32) -> f32 {
    return bitcast<f32>(widen_bits((w >> (16u * (e & 1u))) & 0xffffu, fmt));
}

// ---- fp8: the twin of round/mod.rs's e4m3_f32, e5m2_f32 (integer steps only).
// FP8_E4M3, FP8_E5M2: generated from round::Fp8::code (the prelude).

// |x|'s bits `a` (not NaN) rounded to nearest even with `m` mantissa bits and
// normals from 2^emin; no overflow handling.
fn fp8_magnitude(a: u32, m: u32, emin: i32) -> u32 {
    let e = i32(a >> 23u) - 127;
    if e >= emin {
        let s = 23u - m;
        let lsb = (a >> s) & 1u;
        return (a + ((1u << (s - 1u)) - 1u + lsb)) & ~((1u << s) - 1u);
    }
    if a < 0x00800000u {
        return 0u;
    }
    let mant = (a & 0x007fffffu) | 0x00800000u;
    let s = u32(emin - e) + (23u - m);
    if s >= 25u {
        return 0u;
    }
    let lsb = (mant >> s) & 1u;
    let n = (mant + (1u << (s - 1u)) - 1u + lsb) >> s;
    if n == 0u {
        return 0u;
    }
    let p = firstLeadingBit(n);
    let ex = u32(emin - i32(m) + i32(p) + 127);
    return (ex << 23u) | ((n << (23u - p)) & 0x007fffffu);
}

// f32 -> nearest E4M3 value; past ±448 (±inf too) saturates; NaN stays NaN.
fn e4m3_f32(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    let sign = b & 0x80000000u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return bitcast<f32>(b | 0x00400000u);
    }
    return bitcast<f32>(sign | min(fp8_magnitude(a, 3u, -6), 0x43e00000u));
}

// f32 -> nearest E5M2 value; from 61440 on ±inf; NaN stays NaN.
fn e5m2_f32(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    let sign = b & 0x80000000u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return bitcast<f32>(b | 0x00400000u);
    }
    var r = fp8_magnitude(a, 2u, -14);
    if r >= 0x47800000u {
        r = 0x7f800000u;
    }
    return bitcast<f32>(sign | r);
}

fn round_fp8(x: f32, f: u32) -> f32 {
    if f == FP8_E4M3 {
        return e4m3_f32(x);
    }
    return e5m2_f32(x);
}
