//! Which vector instructions the CPU kernels use, chosen at run time.
//!
//! The kernels are plain Rust written so the compiler vectorises them, plus
//! hand-written ones: the matmul's register tiles and packing (AVX2, and an
//! AVX-512 tile where the CPU has it: twice the columns per tile, twice the
//! multiply-adds per load), the f32 softmax (AVX2; its maxima, exps and
//! divisions on AVX-512 where the CPU has it), and, AVX-512 only, the f32
//! SwiGLU and its backward and bf16 storage's packing and unpacking.
//! The instructions a build may use by default are the target's baseline
//! (SSE2 on x86-64), where `f32::mul_add` — the contract's fma, everywhere —
//! is a library call per element. So every
//! hot kernel is defined through [`multiversion!`], which compiles it twice
//! and, on a CPU that has them, runs the copy with AVX2 and FMA enabled (the
//! helpers it calls are `#[inline(always)]` so they land in that copy). Nothing is
//! needed at build time: a crate that depends on tinyllm gets the same speed
//! as this repository's own binary, and a CPU without AVX2 runs the
//! portable copy instead of faulting.
//!
//! The bits are the same on every path: the kernels' operations and their
//! order are fixed by the contract, `mul_add` is a fused multiply-add
//! whichever instruction computes it, and nothing is reassociated. A unit test
//! runs every primitive on each available path against the portable one.
//!
//! `TINYLLM_CPU=portable` forces the portable path and `TINYLLM_CPU=avx2` caps
//! the matmul at its AVX2 tile (for comparison).

use std::sync::atomic::{AtomicU8, Ordering};

/// f32 lanes in one AVX2 vector: the group [`math::div_lanes`] and
/// [`math::exp_lanes`] work on, and the kernels' row and column groups.
///
/// [`math::div_lanes`]: crate::backend::math::div_lanes
/// [`math::exp_lanes`]: crate::backend::math::exp_lanes
pub const LANES: usize = 8;

/// A set of instructions the kernels may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The build target's baseline.
    Portable = 1,
    /// x86-64 with AVX2 and FMA.
    Avx2 = 2,
    /// AVX2 and FMA plus AVX-512F: the same kernels as `Avx2`, but the
    /// matmul's register tile is two 16-lane vectors (32 columns) wide, and
    /// the softmax's passes, SwiGLU and bf16 packing run 16 lanes at a time.
    Avx512 = 3,
}

impl Level {
    /// A short name, as the reports spell it.
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2+fma",
            Level::Avx512 => "avx512f+avx2+fma",
        }
    }
}

/// 0: not decided yet; else a `Level as u8`.
static LEVEL: AtomicU8 = AtomicU8::new(0);

fn detect() -> Level {
    let cap = std::env::var("TINYLLM_CPU").ok();
    let best = available().into_iter().last().unwrap_or(Level::Portable);
    match cap.as_deref() {
        Some("portable") => Level::Portable,
        Some("avx2") => best.min(Level::Avx2),
        _ => best,
    }
}

/// The level the kernels run at (detected once).
#[inline]
pub fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        3 => Level::Avx512,
        2 => Level::Avx2,
        1 => Level::Portable,
        _ => {
            let l = detect();
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

/// Every level this CPU can run, lowest first.
pub fn available() -> Vec<Level> {
    let mut v = vec![Level::Portable];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        v.push(Level::Avx2);
        if is_x86_feature_detected!("avx512f") {
            v.push(Level::Avx512);
        }
    }
    v
}

/// Forces a level (`None`: detect again). For comparing the paths.
#[cfg(any(test, feature = "test-hooks"))]
pub fn set_level(l: Option<Level>) {
    LEVEL.store(l.map_or(0, |l| l as u8), Ordering::Relaxed);
}

/// The lanes of a group of 16 that lie before `len` (all of them for a
/// whole group), as an AVX-512 mask: a slice's ragged end is one masked load
/// and store, not a copy through the stack.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn first_lanes(len: usize) -> std::arch::x86_64::__mmask16 {
    if len >= 16 {
        0xffff
    } else {
        ((1u32 << len) - 1) as u16
    }
}

/// Eight vectors of eight lanes transposed: lane `l` of vector `q` becomes
/// lane `q` of vector `l` (rows of an 8 × 8 block in, its columns out).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn transpose8(a: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    // pairs of rows interleaved, per 128-bit half (lanes 0..4 | 4..8)
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (x, y) = (a[i / 2 * 2], a[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(x, y)
        } else {
            _mm256_unpackhi_ps(x, y)
        }
    });
    // rows 4h .. 4h + 4 (h = i / 4) of lanes i % 4 | 4 + i % 4
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (h, q) = (i / 4, i % 4);
        let (x, y) = (t[4 * h + q / 2], t[4 * h + 2 + q / 2]);
        if q % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(x, y)
        } else {
            _mm256_shuffle_ps::<0xEE>(x, y)
        }
    });
    std::array::from_fn(|q| {
        if q < 4 {
            _mm256_permute2f128_ps::<0x20>(u[q], u[4 + q])
        } else {
            _mm256_permute2f128_ps::<0x31>(u[q - 4], u[q])
        }
    })
}

/// Each row's first `lens[r]` values of the rows of `x` (`n` wide) added up
/// in order from −0 — each value squared first (rounded) with `SQUARE` — as
/// [`fold_ragged`](super::fold_ragged) folds them: eight rows at a time, one
/// per lane, over the terms they all have (then each row's own rest), so the
/// adds' latency is waited out once per eight rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn row_sums_avx2<const SQUARE: bool>(x: &[f32], n: usize, lens: &[usize]) -> Vec<f32> {
    use std::arch::x86_64::*;
    assert!(x.len() >= lens.len() * n && lens.iter().all(|&l| l <= n));
    let term = |v: f32| if SQUARE { v * v } else { v };
    let mut sums = vec![-0.0f32; lens.len()];
    for (b, (s, l)) in sums.chunks_mut(LANES).zip(lens.chunks(LANES)).enumerate() {
        let r0 = b * LANES;
        let mut j = 0;
        if s.len() == LANES {
            let common = l.iter().copied().min().unwrap_or(0);
            let mut acc = _mm256_set1_ps(-0.0);
            while j + LANES <= common {
                // SAFETY: rows r0 .. r0 + 8 hold the values j .. j + 8 (asserted above).
                let c = transpose8(std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add((r0 + i) * n + j)) }));
                for v in c {
                    acc = _mm256_add_ps(acc, if SQUARE { _mm256_mul_ps(v, v) } else { v });
                }
                j += LANES;
            }
            // SAFETY: `s` holds LANES values.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr(), acc) };
        }
        for (i, (s, &l)) in s.iter_mut().zip(l).enumerate() {
            let row = &x[(r0 + i) * n..];
            *s = row[j..l].iter().fold(*s, |a, &v| a + term(v));
        }
    }
    sums
}

/// Defines a kernel compiled twice — for the build target's baseline and with
/// AVX2 + FMA enabled — that runs the copy for [`level`] (the AVX2 copy at
/// `Avx512`: only the matmul tile, the softmax's passes, SwiGLU and bf16
/// packing have wider twins). Everything the body
/// calls should be `#[inline(always)]` so it is compiled into each copy;
/// closures in the body (the pool's tasks included) inherit the copy's
/// instructions. (A closure handed to a `#[target_feature]` function would
/// not: it is compiled where it is written, for the baseline.)
macro_rules! multiversion {
    // both copies and the dispatch; `$turbo` names the generics where calls
    // cannot infer them
    (@emit [$($attr:tt)*] [$($vis:tt)*] $name:ident [$($gen:tt)*] [$($turbo:tt)*]
        ($($a:ident: $t:ty),*) [$($ret:tt)*] $body:block) => {
        $($attr)*
        $($vis)* fn $name $($gen)* ($($a: $t),*) $($ret)* {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2 $($gen)* ($($a: $t),*) $($ret)* $body
            #[inline(always)]
            fn portable $($gen)* ($($a: $t),*) $($ret)* $body
            match $crate::backend::cpu::simd::level() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: these levels are only set where the CPU reported AVX2 and FMA.
                $crate::backend::cpu::simd::Level::Avx2 | $crate::backend::cpu::simd::Level::Avx512 => unsafe { avx2 $($turbo)* ($($a),*) },
                _ => portable $($turbo)* ($($a),*),
            }
        }
    };
    // type parameters, inferred from the arguments
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<$($g:ident: $b:path),+>)?
        ($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $crate::backend::cpu::simd::multiversion!(@emit [$(#[$m])*] [$vis] $name
            [$(<$($g: $b),+>)?] [] ($($a: $t),*) [$(-> $r)?] $body);
    };
    // lifetimes (the outputs', which the kernel hands back written) and
    // type parameters, inferred from the arguments
    ($(#[$m:meta])* $vis:vis fn $name:ident <$($l:lifetime),+ $(, $g:ident: $b:path)*>
        ($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $crate::backend::cpu::simd::multiversion!(@emit [$(#[$m])*] [$vis] $name
            [<$($l),+ $(, $g: $b)*>] [] ($($a: $t),*) [$(-> $r)?] $body);
    };
    // one const parameter, which the calls name
    ($(#[$m:meta])* $vis:vis fn $name:ident <const $c:ident: usize>
        ($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $crate::backend::cpu::simd::multiversion!(@emit [$(#[$m])*] [$vis] $name
            [<const $c: usize>] [::<$c>] ($($a: $t),*) [$(-> $r)?] $body);
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::round::Format;
    use crate::backend::{
        AdamWConsts, BinaryLayout, BinaryOp, DType, Device, MatmulDims, ReduceOp, Storage, UnaryOp,
    };

    /// Values with every awkward class in them: ±0, subnormals, ±inf, NaN,
    /// huge and tiny magnitudes, bf16/fp16 ties, besides plain randoms.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let gen = crate::Generator::new(seed);
        let specials = [
            0.0,
            -0.0,
            1e-40,
            -3e-39,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            3.0e38,
            1.0 + 1.0 / 256.0, // a bf16 tie
            65520.0,           // the fp16 overflow boundary
            -88.0,
            104.0,
        ];
        gen.uniform(n)
            .into_iter()
            .enumerate()
            .map(|(i, u)| {
                if i % 61 == 3 {
                    specials[i / 61 % specials.len()]
                } else {
                    (u - 0.5) * 8.0
                }
            })
            .collect()
    }

    fn bits(s: &Storage) -> Vec<u32> {
        s.to_vec_f32()
            .unwrap()
            .iter()
            .map(|x| if x.is_nan() { 0x7fc0_0000 } else { x.to_bits() })
            .collect()
    }

    /// Every CPU primitive's output bits, at the current level.
    fn run_all() -> Vec<Vec<u32>> {
        let st = |v: Vec<f32>| Storage::from_f32(v, Device::Cpu).unwrap();
        let x = st(values(1000, 1));
        let y = st(values(1000, 2));
        let mut out = Vec::new();
        for op in UnaryOp::ALL {
            out.push(bits(&x.unary(op).unwrap()));
        }
        // (10, 100) op (1, 100): a broadcast row
        let layout = BinaryLayout {
            shape: vec![10, 100],
            lhs_strides: vec![100, 1],
            rhs_strides: vec![0, 1],
        };
        for op in BinaryOp::ALL {
            out.push(bits(&x.binary(&y, op, &layout).unwrap()));
        }
        for op in ReduceOp::ALL {
            out.push(bits(&x.reduce(op, 10, 25, 4).unwrap()));
            out.push(bits(&x.reduce(op, 40, 25, 1).unwrap()));
        }
        // causally masked rows, as attention makes them
        let masked: Vec<f32> = values(1024, 3)
            .into_iter()
            .enumerate()
            .map(|(i, v)| if i % 32 > i / 32 { f32::NEG_INFINITY } else { v.clamp(-30.0, 30.0) })
            .collect();
        let masked = st(masked);
        for (scale, causal) in [(1.0, false), (0.125, true)] {
            let sm = masked.softmax_rows(32, 32, scale, causal).unwrap();
            out.push(bits(&sm));
            out.push(bits(&sm.softmax_rows_backward(&st(values(1024, 4)), 32, 32, scale).unwrap()));
        }
        out.push(vec![Storage::sum_squares(&[&x, &y]).unwrap().to_bits()]);
        // the fused primitives: RMSNorm over (4, 5, 50) rows, SwiGLU, RoPE
        // over (20, 50) at 10 positions, cross-entropy over (10, 100)
        let w = st(values(50, 11));
        let (yn, rstd) = x.rms_norm(&w, 20, 50, 1e-5).unwrap();
        out.extend([bits(&yn), bits(&rstd)]);
        let (dx, dw) = x.rms_norm_backward(&w, &rstd, &y, None, None, &[4, 5], 50, true, true).unwrap();
        out.extend([dx, dw].iter().map(|s| bits(s.as_ref().unwrap())));
        let earlier = st(values(1000, 16));
        let (dx, _) = x.rms_norm_backward(&w, &rstd, &y, Some(&earlier), None, &[4, 5], 50, true, false).unwrap();
        out.push(bits(&dx.unwrap()));
        out.push(bits(&x.swiglu(&y).unwrap()));
        let (dg, du) = x.swiglu_backward(&y, &st(values(1000, 14))).unwrap();
        out.extend([bits(&dg), bits(&du)]);
        // 16-bit storage: whole vector groups, a ragged rest, an odd last
        // value; signalling and negative NaNs (quieted, not counted as
        // changed); the words' raw bits (a word may read as a NaN)
        for len in [1000, 1001] {
            let mut v = values(len, 15);
            v[5] = f32::from_bits(0x7f80_0001);
            v[100] = f32::from_bits(0xff80_1234);
            for fmt in [Format::Bf16, Format::Fp16] {
                let (packed, changed) = st(v.clone()).pack(fmt).unwrap();
                let words = packed.words().to_vec_f32().unwrap().iter().map(|w| w.to_bits()).collect();
                out.extend([words, vec![changed.unwrap() as u32], bits(&packed.unpack().unwrap())]);
            }
        }
        let (cos, sin) = (st(values(500, 12)), st(values(500, 13)));
        out.push(bits(&x.rope(&cos, &sin, 10, 50, 1).unwrap()));
        out.push(bits(&x.rope_backward(&cos, &sin, 10, 50, 1).unwrap()));
        let targets: Vec<u32> = (0..10).map(|i| (i * 37 % 100) as u32).collect();
        let (loss, stats) = x.cross_entropy(&targets, 100).unwrap();
        out.extend([bits(&loss), bits(&stats)]);
        let seed = st(vec![0.75]);
        out.push(bits(&x.cross_entropy_backward(&targets, &stats, &seed, 100).unwrap()));
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
                let (m, k, n) = (13, 300, 21);
                // finite operands: one NaN would make a whole row of outputs NaN
                let finite = |v: Vec<f32>| v.into_iter().map(|x| if x.is_finite() { x } else { 0.5 }).collect();
                let a = st(finite(values(m * k, 5)));
                let b = st(finite(values(k * n, 6)));
                let d = MatmulDims {
                    batch: 1,
                    m,
                    k,
                    n,
                    trans_a: ta,
                    trans_b: tb,
                    a_batch_stride: 0,
                    b_batch_stride: 0,
                    causal: Default::default(),
                    tokens: Default::default(),
                };
                out.push(bits(&a.matmul(&b, d, round).unwrap()));
            }
        }
        let p = st(values(1003, 7));
        let g = st(values(1003, 8).into_iter().map(|v| v * 1e-3).collect());
        let m = st(values(1003, 9).into_iter().map(|v| v * 1e-4).collect());
        let v = st(values(1003, 10).into_iter().map(|v| (v * 1e-6).abs()).collect());
        let c = AdamWConsts {
            decay: 0.9999,
            beta1: 0.9,
            omb1: 0.1,
            beta2: 0.999,
            omb2: 0.001,
            step_size: 1e-3,
            bc2_sqrt: 0.3,
            eps: 1e-8,
            grad_scale: None,
        };
        p.adamw_step(&g, &m, &v, &c).unwrap();
        out.extend([bits(&p), bits(&m), bits(&v)]);
        let buf = Storage::full(1003, 0.0, DType::F32, Device::Cpu).unwrap();
        p.sgd_step(&g, Some(&buf), 0.1, 0.9, 0.01, false).unwrap();
        out.extend([bits(&p), bits(&buf)]);
        let finite = Storage::finite_check_unscale(&[&p, &x], 0.5).unwrap();
        out.push(vec![finite as u32]);
        out.push(bits(&x));
        out
    }

    #[test]
    fn every_path_gives_the_portable_bits() {
        set_level(Some(Level::Portable));
        let portable = run_all();
        for l in available() {
            set_level(Some(l));
            assert_eq!(level(), l);
            let got = run_all();
            for (i, (a, b)) in got.iter().zip(&portable).enumerate() {
                assert!(a == b, "{l:?}: primitive #{i} differs from the portable path");
            }
        }
        set_level(None);
        assert!(
            cfg!(not(target_arch = "x86_64")) || available().contains(&Level::Avx2),
            "this test should run where AVX2 exists (CI does)"
        );
        eprintln!("paths compared: {:?}", available());
    }
}
