//! The emulated 16-bit rounding (spec M09.1) on every f32 bit pattern, against
//! the `half` crate, and the f64 path against the f32 one and against
//! constructed near-tie values that double rounding through f32 gets wrong.
//!
//! Also the square root: the contract's software `sqrt_soft` (the GPU's
//! algorithm) against the CPU's hardware `sqrt` on every bit pattern — the
//! equality that lets the CPU backend use the hardware instruction — and the
//! division: its fast path against the soft algorithm for every dividend
//! mantissa (the pairs as a whole cannot be swept).
//!
//! Meant for the release-mode suite (`cargo test --release`): the two
//! exhaustive sweeps take a few seconds each there.

use std::sync::atomic::{AtomicU64, Ordering};
use tinyllm::backend::round::{
    bf16_f32, e4m3_f32, e5m2_f32, fp16_f32, fp8_f32, fp8_f64, round_f32, round_f64, Format, Fp8,
};

const FORMATS: [Format; 2] = [Format::Bf16, Format::Fp16];

fn threads() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

/// Same value: both NaN, or the same bits (so signed zeros must match).
fn same32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn same64(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Runs `check(i)` for every `i` in `0..n`, split into one contiguous range
/// per thread; returns the number of failures and the first few failing `i`.
fn sweep(n: u64, check: impl Fn(u64) -> bool + Sync) -> (u64, Vec<u64>) {
    let t = threads();
    let per = n.div_ceil(t);
    let failures = AtomicU64::new(0);
    let mut examples = Vec::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..t)
            .map(|k| {
                let (check, failures) = (&check, &failures);
                s.spawn(move || {
                    let mut ex = Vec::new();
                    let mut bad = 0u64;
                    let (lo, hi) = (k * per, ((k + 1) * per).min(n));
                    // Branch-free counting per block (so the loop vectorises);
                    // a block with failures is rescanned for examples.
                    let mut b = lo;
                    while b < hi {
                        let e = (b + 4096).min(hi);
                        let c: u32 = (b..e).map(|i| u32::from(!check(i))).sum();
                        if c > 0 {
                            bad += u64::from(c);
                            ex.extend((b..e).filter(|&i| !check(i)).take(5 - ex.len().min(5)));
                        }
                        b = e;
                    }
                    failures.fetch_add(bad, Ordering::Relaxed);
                    ex
                })
            })
            .collect();
        for h in handles {
            examples.extend(h.join().unwrap());
        }
    });
    examples.truncate(8);
    (failures.into_inner(), examples)
}

/// How many `i` in `lo..hi` have `sqrt_soft` and the hardware square root
/// of `f32::from_bits(i)` differ.
#[inline(always)]
fn sqrt_mismatches_in(lo: u64, hi: u64) -> u32 {
    use tinyllm::backend::math::{sqrt, sqrt_soft};
    let mut bad = 0;
    for i in lo..hi {
        let x = f32::from_bits(i as u32);
        bad += u32::from(sqrt_soft(x).to_bits() != sqrt(x).to_bits());
    }
    bad
}

/// [`sqrt_mismatches_in`] compiled with the fma instruction: `sqrt_soft`'s
/// `mul_add`s otherwise each call libm's `fmaf` (the same value, several
/// times slower).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn sqrt_mismatches_fma(lo: u64, hi: u64) -> u32 {
    sqrt_mismatches_in(lo, hi)
}

fn sqrt_mismatches(lo: u64, hi: u64) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the instruction.
        return unsafe { sqrt_mismatches_fma(lo, hi) };
    }
    sqrt_mismatches_in(lo, hi)
}

#[test]
fn soft_sqrt_equals_the_hardware_sqrt_on_every_f32() {
    use tinyllm::backend::math::{sqrt, sqrt_soft};
    const BLOCK: u64 = 1 << 16;
    let (bad, ex) = sweep_blocks((1 << 32) / BLOCK, |b| {
        let (lo, hi) = (b * BLOCK, (b + 1) * BLOCK);
        if sqrt_mismatches(lo, hi) == 0 {
            return Vec::new();
        }
        (lo..hi)
            .filter_map(|i| {
                let x = f32::from_bits(i as u32);
                let (soft, hard) = (sqrt_soft(x).to_bits(), sqrt(x).to_bits());
                (soft != hard)
                    .then(|| format!("{i:#010x}: soft {soft:#010x}, hardware {hard:#010x}"))
            })
            .collect()
    });
    assert_eq!(bad, 0, "sqrt mismatches, e.g. {ex:#?}");
}

#[test]
fn bf16_every_f32_bit_pattern_matches_half() {
    let (bad, ex) = sweep(1 << 32, |i| {
        let x = f32::from_bits(i as u32);
        same32(bf16_f32(x), half::bf16::from_f32(x).to_f32())
    });
    let show: Vec<String> = ex
        .iter()
        .map(|&i| {
            let x = f32::from_bits(i as u32);
            format!(
                "{i:#010x} ({x:e}): ours {:e}, half {:e}",
                bf16_f32(x),
                half::bf16::from_f32(x).to_f32()
            )
        })
        .collect();
    assert_eq!(bad, 0, "bf16 mismatches, e.g. {show:#?}");
}

/// The float8 crate's conversion (saturating: past the largest finite it
/// gives ±max), with this crate's rule for overflow on top: E4M3 saturates
/// too, E5M2 rounds to ±inf from 61440 on (halfway to 2^16).
fn fp8_reference(x: f32, e5m2: bool) -> f32 {
    if e5m2 {
        if x.abs() >= 61440.0 {
            return f32::INFINITY.copysign(x);
        }
        float8::F8E5M2::from_f32(x).to_f32()
    } else {
        float8::F8E4M3::from_f32(x).to_f32()
    }
}

/// Every f32 bit pattern rounded to E4M3 and to E5M2 (spec: going further's
/// fp8): round to nearest even, subnormals, saturation or inf, NaN, signed
/// zero — against the float8 crate. fp8 keeps at most 3 of f32's 23
/// mantissa bits, so a correctly rounded result depends on the top 20 bits
/// (sign, exponent, 11 mantissa bits: every rounding boundary and tie lies
/// there, the subnormals' included) and on whether any of the low 12 is
/// set, as a sticky bit. The crate is asked once per class (at low bits 1
/// and 0xfff, which must agree) and every pattern of ours is held to its
/// class's answer: the crate's conversion is ten times slower than ours.
#[test]
fn fp8_every_f32_bit_pattern_matches_float8() {
    for (name, e5m2, ours) in [
        ("e4m3", false, e4m3_f32 as fn(f32) -> f32),
        ("e5m2", true, e5m2_f32 as fn(f32) -> f32),
    ] {
        let of = |top: u32, low: u32| fp8_reference(f32::from_bits(top << 12 | low), e5m2);
        let classes: Vec<[u32; 2]> = (0..1u32 << 20)
            .map(|top| {
                let sticky = of(top, 1);
                assert!(same32(sticky, of(top, 0xfff)), "{name}: class {top:#x}");
                [of(top, 0).to_bits(), sticky.to_bits()]
            })
            .collect();
        let reference = |x: f32| {
            let b = x.to_bits();
            f32::from_bits(classes[(b >> 12) as usize][usize::from(b & 0xfff != 0)])
        };
        let (bad, ex) = sweep(1 << 32, |i| {
            let x = f32::from_bits(i as u32);
            same32(ours(x), reference(x))
        });
        let show: Vec<String> = ex
            .iter()
            .map(|&i| {
                let x = f32::from_bits(i as u32);
                format!(
                    "{i:#010x} ({x:e}): ours {:e}, float8 {:e}",
                    ours(x),
                    fp8_reference(x, e5m2)
                )
            })
            .collect();
        assert_eq!(bad, 0, "{name} mismatches, e.g. {show:#?}");
    }
}

/// The f64 path of the fp8 rounding gives the f32 path's value on f32
/// values: every pattern of the top 20 bits, with the low 12 bits 0, 1,
/// 0x800 or 0xfff. fp8 keeps at most 3 of f32's 23 mantissa bits, so every
/// tie and rounding boundary lies at bit 19 or above and the low 12 bits
/// only ever count as "some bits set" (sticky): these four cover them.
#[test]
fn fp8_f64_path_equals_f32_path_on_f32_values() {
    const LOW: [u32; 4] = [0, 1, 0x800, 0xfff];
    for f in [Fp8::E4M3, Fp8::E5M2] {
        let (bad, ex) = sweep(4 << 20, |i| {
            let x = f32::from_bits(((i as u32 >> 2) << 12) | LOW[i as usize & 3]);
            same64(fp8_f64(f64::from(x), f), f64::from(fp8_f32(x, f)))
        });
        assert_eq!(bad, 0, "{f:?}: f64 path differs at {ex:#x?}");
    }
}

#[test]
fn fp16_every_f32_bit_pattern_matches_half() {
    // half's slice conversion (the same rounding as `f16::from_f32`, with the
    // vectorised F16C instructions where the CPU has them) keeps this fast.
    use half::slice::HalfFloatSliceExt;
    const BLOCK: u64 = 4096;
    let (bad, ex) = sweep_blocks((1 << 32) / BLOCK, |blk| {
        let xs: Vec<f32> = (blk * BLOCK..(blk + 1) * BLOCK)
            .map(|i| f32::from_bits(i as u32))
            .collect();
        let mut h = vec![half::f16::ZERO; xs.len()];
        h.convert_from_f32_slice(&xs);
        let mut want = vec![0.0f32; xs.len()];
        h.convert_to_f32_slice(&mut want);
        let c: u32 = xs
            .iter()
            .zip(&want)
            .map(|(&x, &w)| u32::from(!same32(fp16_f32(x), w)))
            .sum();
        if c == 0 {
            return vec![];
        }
        xs.iter()
            .zip(&want)
            .filter(|(&x, &w)| !same32(fp16_f32(x), w))
            .map(|(&x, &w)| {
                let one = half::f16::from_f32(x).to_f32();
                format!(
                    "{:#010x} ({x:e}): ours {:e}, half {w:e} (scalar {one:e})",
                    x.to_bits(),
                    fp16_f32(x)
                )
            })
            .collect()
    });
    assert_eq!(bad, 0, "fp16 mismatches, e.g. {ex:#?}");
}

/// Runs `check(block)` for every block in `0..blocks` over the threads;
/// `check` returns a description of every failure in its block.
fn sweep_blocks(blocks: u64, check: impl Fn(u64) -> Vec<String> + Sync) -> (u64, Vec<String>) {
    let t = threads();
    let per = blocks.div_ceil(t);
    let mut bad = 0;
    let mut examples = Vec::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..t)
            .map(|k| {
                let check = &check;
                s.spawn(move || {
                    let mut bad = 0u64;
                    let mut ex = Vec::new();
                    for b in k * per..((k + 1) * per).min(blocks) {
                        let f = check(b);
                        bad += f.len() as u64;
                        let room = 5 - ex.len().min(5);
                        ex.extend(f.into_iter().take(room));
                    }
                    (bad, ex)
                })
            })
            .collect();
        for h in handles {
            let (b, e) = h.join().unwrap();
            bad += b;
            examples.extend(e.into_iter().take(5));
        }
    });
    (bad, examples)
}

#[test]
fn f64_path_equals_f32_path_on_f32_values() {
    // Every 97th bit pattern (97 is odd, so every exponent and sign and many
    // mantissa endings occur), plus the boundary values.
    for fmt in FORMATS {
        let (bad, ex) = sweep((1u64 << 32) / 97 + 1, |i| {
            let x = f32::from_bits((i * 97) as u32);
            same64(round_f64(x as f64, fmt), round_f32(x, fmt) as f64)
        });
        assert_eq!(
            bad,
            0,
            "{fmt}: f64 and f32 paths differ at patterns {:x?}",
            ex.iter().map(|i| i * 97).collect::<Vec<_>>()
        );
    }
    let special = [
        0.0f32,
        -0.0,
        1.0,
        -1.0,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        1.0e-45,
        -1.0e-45,
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        65536.0,
        3.4e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        2.0e-8,
        2.9802322e-8,
        5.9604645e-8,
        6.1035156e-5,
    ];
    for fmt in FORMATS {
        for x in special {
            let (a, b) = (round_f64(x as f64, fmt), round_f32(x, fmt) as f64);
            assert!(same64(a, b), "{fmt}: {x:e}: f64 path {a:e}, f32 path {b:e}");
        }
    }
}

/// The two values of the format around a positive tie `t` (an f32 that lies
/// exactly halfway), as f64: (below, above). Above the largest finite value
/// the upper neighbour is +inf.
fn tie_neighbours(t: f32, fmt: Format) -> (f64, f64) {
    let b = t.to_bits();
    match fmt {
        Format::Bf16 => {
            let lo = b & 0xffff_0000;
            (
                f32::from_bits(lo) as f64,
                f32::from_bits(lo + 0x1_0000) as f64,
            )
        }
        Format::Fp16 => {
            let q = if t >= 2f32.powi(-14) {
                // normal: spacing 2^(e - 10)
                2f64.powi(((b >> 23) as i32 - 127) - 10)
            } else {
                2f64.powi(-24)
            };
            let lo = (t as f64 / q).floor() * q;
            let hi = lo + q;
            (lo, if hi > 65504.0 { f64::INFINITY } else { hi })
        }
    }
}

/// Every positive tie of the format that is an f32 value.
fn ties(fmt: Format) -> Vec<f32> {
    match fmt {
        // low 16 bits exactly 0x8000, any exponent below inf/NaN (f32 subnormals too)
        Format::Bf16 => (0..0xff * 0x80u32)
            .map(|hi| f32::from_bits((hi << 16) | 0x8000))
            .collect(),
        Format::Fp16 => {
            // subnormal: odd multiples of 2^-25 below 2^-14
            let mut v: Vec<f32> = (0..1024u32)
                .map(|k| ((2 * k + 1) as f32) * 2f32.powi(-25))
                .collect();
            // normal: low 13 bits 0x1000, exponents 2^-14 ..= 2^15
            for e in 113u32..=142 {
                for m in 0..1024u32 {
                    v.push(f32::from_bits((e << 23) | (m << 13) | 0x1000));
                }
            }
            v
        }
    }
}

#[test]
fn f64_near_ties_round_from_f64_directly() {
    for fmt in FORMATS {
        let ts = ties(fmt);
        let mut double_rounding_differs = 0;
        let mut checked = 0;
        for &t in &ts {
            let (lo, hi) = tie_neighbours(t, fmt);
            let t64 = t as f64;
            // the tie itself: to the even neighbour, as the f32 path does
            let r = round_f64(t64, fmt);
            assert!(same64(r, round_f32(t, fmt) as f64), "{fmt}: tie {t:e}");
            assert!(r == lo || r == hi);
            // just above and just below: the upper and lower neighbour, whatever
            // their parity. The 2^-30 offsets vanish when narrowed to f32 (which
            // would turn them into the tie and round to even).
            let above = [
                f64::from_bits(t64.to_bits() + 1),
                t64 * (1.0 + 2f64.powi(-30)),
            ];
            let below = [
                f64::from_bits(t64.to_bits() - 1),
                t64 * (1.0 - 2f64.powi(-30)),
            ];
            for (xs, want) in [(above, hi), (below, lo)] {
                for x in xs {
                    for sign in [1.0, -1.0] {
                        let got = round_f64(sign * x, fmt);
                        let want = sign * want;
                        assert!(
                            same64(got, want),
                            "{fmt}: {:e} (near the tie {t:e}) rounds to {got:e}, expected {want:e}",
                            sign * x
                        );
                        checked += 1;
                        if !same64(round_f32((sign * x) as f32, fmt) as f64, want) {
                            double_rounding_differs += 1;
                        }
                    }
                }
            }
        }
        // Half the constructed values are ones that rounding through f32 gets wrong.
        assert!(checked >= 4 * ts.len());
        assert!(
            double_rounding_differs >= checked / 4,
            "{fmt}: only {double_rounding_differs} of {checked} would double-round"
        );
    }
    // The overflow boundaries, from either side.
    let e = 2f64.powi(-30);
    assert_eq!(round_f64(65520.0 * (1.0 - e), Format::Fp16), 65504.0);
    assert_eq!(round_f64(65520.0, Format::Fp16), f64::INFINITY);
    assert_eq!(
        round_f64(-65520.0 * (1.0 + e), Format::Fp16),
        f64::NEG_INFINITY
    );
    let bmax = f32::from_bits(0x7f7f_0000) as f64;
    let bnd = f32::from_bits(0x7f7f_8000) as f64;
    assert_eq!(round_f64(bnd * (1.0 - e), Format::Bf16), bmax);
    assert_eq!(round_f64(bnd, Format::Bf16), f64::INFINITY);
    assert_eq!(round_f64(1.0e300, Format::Bf16), f64::INFINITY);
    assert_eq!(round_f64(-1.0e300, Format::Fp16), f64::NEG_INFINITY);
    // Below the smallest subnormal's half: zero, sign kept.
    assert_eq!(
        round_f64(-1.0e-300, Format::Bf16).to_bits(),
        (-0.0f64).to_bits()
    );
    assert_eq!(
        round_f64(2f64.powi(-25) * (1.0 + e), Format::Fp16),
        2f64.powi(-24)
    );
    assert_eq!(round_f64(2f64.powi(-25), Format::Fp16), 0.0);
}

/// The neighbours of a (non-negative, finite) format value `r` as f64.
fn neighbours(r: f64, fmt: Format) -> (Option<f64>, f64) {
    let (bits, from): (u16, fn(u16) -> f64) = match fmt {
        Format::Bf16 => (half::bf16::from_f64(r).to_bits(), |b| {
            half::bf16::from_bits(b).to_f64()
        }),
        Format::Fp16 => (half::f16::from_f64(r).to_bits(), |b| {
            half::f16::from_bits(b).to_f64()
        }),
    };
    let down = (bits > 0).then(|| from(bits - 1));
    (down, from(bits + 1))
}

#[test]
fn f64_rounds_to_the_nearest_value_ties_to_even() {
    // Random f64 values across each format's range: the result is a value of
    // the format, no farther from x than either of its neighbours, and even on
    // a tie.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for fmt in FORMATS {
        let (emin, emax) = match fmt {
            Format::Bf16 => (-140, 127),
            Format::Fp16 => (-26, 15),
        };
        for _ in 0..500_000 {
            let r64 = next();
            let e = emin + (r64 % (emax - emin + 1) as u64) as i32;
            let m = 1.0 + (next() >> 11) as f64 * 2f64.powi(-53);
            let x = m * 2f64.powi(e);
            let max = match fmt {
                Format::Bf16 => f32::from_bits(0x7f7f_0000) as f64,
                Format::Fp16 => 65504.0,
            };
            if x > max {
                continue; // the overflow boundaries are checked by construction
            }
            let r = round_f64(x, fmt);
            assert!(r.is_finite(), "{fmt}: {x:e} -> {r:e}");
            let r32 = r as f32;
            assert!(
                r32 as f64 == r && round_f32(r32, fmt) == r32,
                "{fmt}: {r:e} is not a format value"
            );
            let (down, up) = neighbours(r, fmt);
            let d = (x - r).abs();
            let even = match fmt {
                Format::Bf16 => half::bf16::from_f64(r).to_bits() & 1 == 0,
                Format::Fp16 => half::f16::from_f64(r).to_bits() & 1 == 0,
            };
            for nb in down.into_iter().chain([up]) {
                let dn = (x - nb).abs();
                assert!(
                    d < dn || (d == dn && even),
                    "{fmt}: {x:e} -> {r:e}, but {nb:e} is nearer"
                );
            }
            // and the sign is symmetric
            assert_eq!(round_f64(-x, fmt), -r);
        }
    }
}

/// The CPU's fast division (hardware `/` where it provably has the soft
/// division's bits, `math::div_lanes`) against the contract's `div`, for every
/// dividend mantissa against 48 divisors (the edges of the binade, mantissas
/// with few or many ones, and pseudo-random ones). For normal results a
/// quotient's bits depend only on the two mantissas, so each divisor here is
/// checked against all 2^23 dividends at once; the dividend also takes both
/// binades around the divisor, so quotients fall on both sides of 1.
#[test]
fn fast_division_equals_the_soft_one_for_every_dividend_mantissa() {
    use tinyllm::backend::cpu::simd::LANES;
    use tinyllm::backend::math::{div, div_lanes};
    let mut divisors: Vec<u32> = vec![
        0, 1, 2, 3, 0x7f_ffff, 0x7f_fffe, 0x40_0000, 0x40_0001, 0x3f_ffff, 0x20_0000, 0x60_0000,
        0x55_5555, 0x2a_aaaa, 0x35_04f3, 0x00_0800, 0x7f_f800,
    ];
    let mut s = 0x2545_f491u32;
    while divisors.len() < 48 {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        divisors.push(s & 0x7f_ffff);
    }
    let groups = (1u64 << 23) / LANES as u64;
    let (bad, ex) = sweep(divisors.len() as u64 * groups * 2, |i| {
        let (pair, g) = (i / groups, i % groups);
        let b = f32::from_bits(0x3f80_0000 | divisors[(pair / 2) as usize]);
        // dividends in [1, 2) or in [0.5, 1), negative for odd groups
        let exp = if pair % 2 == 0 {
            0x3f80_0000
        } else {
            0x3f00_0000
        };
        let sign = ((g & 1) as u32) << 31;
        let a: [f32; LANES] = std::array::from_fn(|k| {
            f32::from_bits(sign | exp | (g as u32 * LANES as u32 + k as u32))
        });
        let q = div_lanes(a, [b; LANES]);
        (0..LANES).all(|k| q[k].to_bits() == div(a[k], b).to_bits())
    });
    assert_eq!(bad, 0, "groups where div_lanes differs from div: {ex:?}");
}
