// exact.wgsl — when the device's own fma may run a rounded product's chain
// (needs the math prelude's fma_c); shared by the matmul and attention.
//
// With rounded operands (FMT != none) the product of two fp16 values (11+11
// significant bits, magnitudes between 2^-48 and 2^32) is exact in f32, and
// so is the product of two bf16 values (8+8 bits) whose exact value lies in
// f32's normal range: then `a * b + acc` rounds once whether or not the device
// fuses, and the device's own `fma` is bit-exact even where it is not fused
// (lavapipe), and much faster than the integer emulation `fma_c` may be. A
// bf16 product past f32's largest value or below 2^-126 is not exact, so where
// the device's `fma` is not fused (GUARD) a kernel tracks the magnitudes of
// the operands it reads (`Span`) and, if some product may leave the range,
// runs the chain again with `fma_c`.

// Four chains' terms x * y.x, ..., x * y.w with the contract's fma_c.
fn fma4_c(x: f32, y: vec4<f32>, acc: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(fma_c(x, y.x, acc.x), fma_c(x, y.y, acc.y),
                     fma_c(x, y.z, acc.z), fma_c(x, y.w, acc.w));
}

// The magnitudes of the values seen, four running extremes a lane: `hi` the
// largest one's bits shifted left by one (the sign dropped, so the integers
// order as the magnitudes do), `lo` one less than the smallest nonzero one's
// (a zero wraps to 0xffffffff and never wins). Integer steps only, so a device
// that flushes subnormals sees them too.
struct Span {
    hi: vec4<u32>,
    lo: vec4<u32>,
}

fn no_span() -> Span {
    return Span(vec4<u32>(0u), vec4<u32>(0xffffffffu));
}

fn span_add(s: Span, v: vec4<f32>) -> Span {
    let u = bitcast<vec4<u32>>(v) << vec4<u32>(1u);
    return Span(max(s.hi, u), min(s.lo, u - vec4<u32>(1u)));
}

// The biased exponents of the largest and of the smallest nonzero magnitude
// (255 when every value was zero).
fn span_exponents(s: Span) -> vec2<u32> {
    let hi = max(max(s.hi.x, s.hi.y), max(s.hi.z, s.hi.w));
    let lo = min(min(s.lo.x, s.lo.y), min(s.lo.z, s.lo.w));
    return vec2<u32>(hi >> 24u, select((lo + 1u) >> 24u, 255u, lo == 0xffffffffu));
}

// Whether every product of a bf16 value with magnitude exponents `ea` (largest,
// smallest nonzero) and one with `eb` is exact in f32: no subnormal operand, and
// every exact product, between 2^(e_a + e_b - 254) and 2^(e_a + e_b - 252), in
// f32's normal range (16 significant bits fit there). Zeros multiply exactly
// and are left out; an infinity's or NaN's products are exact either way.
fn exact_products(ea: vec2<u32>, eb: vec2<u32>) -> bool {
    return ea.y >= 1u && eb.y >= 1u && ea.y + eb.y >= 128u && ea.x + eb.x <= 380u;
}
