//! The hard cases every primitive must survive bit for bit, and the small
//! generator that mixes them with random values: what the sweep runs on a
//! user's adapter and what the parity tests run in CI (they import these,
//! so the two never drift apart).

/// A small, fast, seedable generator (splitmix64) for test inputs,
/// independent of the crate's own Philox [`Generator`](crate::Generator).
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits (not an `Iterator`: the stream never ends).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    /// Uniform in `[lo, hi)`.
    pub fn unif(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    /// A value with a full 24-bit mantissa and moderate magnitude (so products
    /// are inexact: an unfused multiply-add would show).
    pub fn moderate(&mut self) -> f32 {
        let m = (self.next() as u32 & 0x007f_ffff) | 0x3f80_0000; // [1, 2)
        let e = self.below(9) as i32 - 4;
        let s = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
        s * f32::from_bits(m) * 2f32.powi(e)
    }
    /// Any bit pattern: every exponent, NaNs and infinities included.
    pub fn bits(&mut self) -> f32 {
        f32::from_bits(self.next() as u32)
    }
}

/// Values every primitive must survive (and their negations): ±0, ±1 and
/// small integers, ±inf, NaNs (quiet, negative, signalling pattern), f32
/// subnormals (smallest, mid, largest), the extremes, bf16 and fp16 rounding
/// ties, the fp16 overflow boundary (65504, 65520) and fp16 subnormals, the
/// exp and log edges, and integers past 2^23.
pub fn specials() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        2.0,
        3.0,
        -7.25,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling-pattern NaN
        f32::from_bits(1),           // smallest subnormal
        -f32::from_bits(1),
        f32::from_bits(0x0000_0003),
        f32::from_bits(0x0040_0000), // mid subnormal
        f32::from_bits(0x007f_ffff), // largest subnormal
        -f32::from_bits(0x0012_3456),
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        1.0 + 2f32.powi(-8),       // bf16 tie (to even: 1)
        1.0 + 3.0 * 2f32.powi(-8), // bf16 tie (to even: up)
        -(1.0 + 2f32.powi(-8)),
        1.0 + 2f32.powi(-11), // fp16 tie
        1.0 + 3.0 * 2f32.powi(-11),
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        65536.0,
        2f32.powi(-24),
        2f32.powi(-25), // fp16 subnormal tie (to even: 0)
        3.0 * 2f32.powi(-25),
        2f32.powi(-14),
        2f32.powi(-14) - 2f32.powi(-25),
        88.72,
        88.73,
        -87.0,
        -103.9,
        -104.0,
        -150.0,
        1e30,
        -1e30,
        1e-30,
        1e-38,
        3.0e38,
        std::f32::consts::LN_2,
        std::f32::consts::SQRT_2,
        1e-7,
        16_777_216.0,
        8_388_609.0,
    ];
    let more: Vec<f32> = v.iter().map(|x| -x).collect();
    v.extend(more);
    v
}

/// `n` values cycling through: a special, any bit pattern, a moderate value,
/// a uniform value in `[-12, 12)`.
pub fn adversarial(rng: &mut Rng, n: usize) -> Vec<f32> {
    let sp = specials();
    (0..n)
        .map(|i| match i % 4 {
            0 => sp[rng.below(sp.len())],
            1 => rng.bits(),
            2 => rng.moderate(),
            _ => rng.unif(-12.0, 12.0),
        })
        .collect()
}

/// Whether two results agree under the contract: the same bits, or both NaN
/// (IEEE leaves NaN payloads to the implementation; the contract promises
/// NaN-ness only).
pub fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// How many floats lie between `a` and `b` (0 for [`same`] values; `None`
/// when one is NaN and the other is not: no distance is meaningful).
pub fn ulps(a: f32, b: f32) -> Option<u64> {
    if same(a, b) {
        return Some(0);
    }
    if a.is_nan() || b.is_nan() {
        return None;
    }
    // Floats in order as integers: negatives reversed below the positives.
    let ord = |x: f32| {
        let b = x.to_bits();
        if b & 0x8000_0000 != 0 {
            (!b) as i64
        } else {
            (b | 0x8000_0000) as i64
        }
    };
    Some(ord(a).abs_diff(ord(b)))
}

/// Two outputs compared value by value, as [`same`] and [`ulps`] see them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Values that differ, a value one side lacks (the longer side's tail)
    /// counted as differing.
    pub differing: usize,
    /// The first position where both have a value and the values differ.
    pub first: Option<usize>,
    /// The largest difference between two numbers, in ulps.
    pub max_ulps: u64,
    /// Whether a NaN stood against a number (no ulp distance).
    pub nan_vs_number: bool,
}

/// `a` against `b` (the sweep's spec against a device, the lockstep's CPU
/// against the GPU).
pub fn diff(a: &[f32], b: &[f32]) -> Diff {
    let mut d = Diff {
        differing: a.len().abs_diff(b.len()),
        ..Diff::default()
    };
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if !same(x, y) {
            d.differing += 1;
            d.first.get_or_insert(i);
            match ulps(x, y) {
                Some(u) => d.max_ulps = d.max_ulps.max(u),
                None => d.nan_vs_number = true,
            }
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ulps_counts_floats_between() {
        assert_eq!(ulps(1.0, 1.0), Some(0));
        assert_eq!(ulps(f32::NAN, -f32::NAN), Some(0));
        assert_eq!(ulps(1.0, f32::from_bits(1.0f32.to_bits() + 3)), Some(3));
        assert_eq!(ulps(0.0, -0.0), Some(1));
        assert_eq!(ulps(f32::from_bits(1), -f32::from_bits(1)), Some(3));
        assert_eq!(ulps(f32::MAX, f32::INFINITY), Some(1));
        assert_eq!(ulps(1.0, f32::NAN), None);
        assert_eq!(specials().len(), 106);
    }
}
