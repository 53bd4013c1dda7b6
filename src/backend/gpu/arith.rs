//! The start-up probe of the device's own arithmetic, and the one choice it
//! makes: which multiply-add the kernels' `fma_c` is.
//!
//! Two questions, asked apart because a device can fail either one alone:
//! * **is `fma` fused** — one rounding — on normal operands whose exact
//!   product needs the fusion ([`fused_fma_cases`])? Then `fma_c` is the
//!   device's `fma`; else the integer emulation `fma_soft` (`shaders/math.wgsl`,
//!   bit-exact, about 10× slower).
//! * **do f32 subnormals survive** `*`, `+` and `fma`, as operands and as
//!   results ([`subnormal_cases`])? Real drivers may flush them (Mesa's AMD and
//!   Intel Vulkan drivers unless asked, Direct3D always).
//!
//! A device that flushes subnormals but fuses keeps its `fma`
//! ([`native_fma`]): the soft fma would keep the subnormals of the
//! multiply-adds alone, while the kernels' own `*` and `+` — and the bf16/fp16
//! matmuls, which always use the device's `fma` — flush them anyway. It would
//! buy no bit-exactness, at ten times the cost of all f32 work. What flushing
//! does change is a finding of the cross-check's probe (`crosscheck::probe`),
//! which names the route taken. The crate's division, square root, `exp`,
//! `log` and the bf16/fp16 roundings take integer steps wherever a subnormal
//! can occur (`frexp_abs`, `scale2`, `round.wgsl`), so flushing leaves them as
//! they are.

/// What the start-up probe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArithFindings {
    /// `fma(a, b, c)` rounds once on every [`fused_fma_cases`] triple.
    pub fma_fused: bool,
    /// `*`, `+` and `fma` keep the subnormal operands and results of every
    /// [`subnormal_cases`] triple.
    pub subnormals_kept: bool,
}

/// Whether the kernels' `fma_c` is the device's `fma` (else the integer
/// emulation): `forced` (`TINYLLM_GPU_FMA=native` / `=soft`) when given,
/// otherwise exactly when the device's `fma` is fused — whatever subnormals
/// do (see the module docs).
pub fn native_fma(found: ArithFindings, forced: Option<bool>) -> bool {
    forced.unwrap_or(found.fma_fused)
}

fn p2(k: i32) -> f32 {
    2f32.powi(k)
}

/// Triples `(a, b, c)` whose fused and unfused `fma` differ, every operand
/// and every result a normal number (or zero), so a device that flushes
/// subnormals but fuses passes them: inexact products, cancellation, and
/// products past f32's range whose sum is back inside it.
pub fn fused_fma_cases() -> Vec<[f32; 3]> {
    vec![
        [1.0 + p2(-12), 1.0 + p2(-12), -1.0],
        [1.0 + p2(-23), 1.0 - p2(-23), -1.0],
        [0.1, 10.0, -1.0],
        [1.0 / 3.0, 3.0, -1.0],
        [1.234_567_9, 7.654_321, -9.449_772],
        [3.0e38, 2.0, -3.0e38],
        [p2(64), p2(64), -1.5 * p2(127)],
    ]
}

/// Triples with subnormal operands or results of `a * b`, `a + c` and
/// `fma(a, b, c)`, each `fma` the same fused or not (an exact product, or
/// `c = 0`): these ask about subnormals alone.
pub fn subnormal_cases() -> Vec<[f32; 3]> {
    let sub = f32::from_bits;
    let (s1, smid, smax) = (sub(1), sub(0x0040_0000), sub(0x007f_ffff));
    vec![
        [p2(-70), p2(-70), 0.0], // a product of normals: 2^-140
        [smid, 1.0, s1], // subnormal operands and sums
        [s1, 1.0, s1], // the smallest subnormal, twice
        [f32::MIN_POSITIVE, 0.5, 0.0], // 2^-127
        [p2(-100), p2(-40), -p2(-141)], // 2^-140 - 2^-141
        [smax, 1.0, s1], // smax + s1: the smallest normal
        [smax, 2.0, 0.0], // a subnormal operand, a normal product
        [sub(3), 0.5, 0.0], // 1.5 ulp: a tie, to 2
        [-smid, 1.0, 0.0], // negative
    ]
}

/// The results the contract gives for one case: `[fma(a, b, c), a * b, a + c]`.
pub fn reference([a, b, c]: [f32; 3]) -> [f32; 3] {
    [a.mul_add(b, c), a * b, a + c]
}

/// What `got` (per case, the device's `[fma, *, +]`: [`ARITH_PROBE`]'s
/// output) says, for [`fused_fma_cases`] then [`subnormal_cases`]: fused
/// when every fused case's `fma` is the reference's; subnormals kept when
/// every subnormal case's three results are.
pub fn findings(fused: &[[f32; 3]], sub: &[[f32; 3]], got: &[[f32; 3]]) -> ArithFindings {
    assert_eq!(got.len(), fused.len() + sub.len());
    let bits = |v: [f32; 3]| v.map(f32::to_bits);
    let (gf, gs) = got.split_at(fused.len());
    ArithFindings {
        fma_fused: fused.iter().zip(gf).all(|(&t, &g)| g[0].to_bits() == reference(t)[0].to_bits()),
        subnormals_kept: sub.iter().zip(gs).all(|(&t, &g)| bits(g) == bits(reference(t))),
    }
}

/// Kernel of the start-up probe: for case `i` (operands `d[6i..6i+3]`),
/// `d[6i+3] = fma(a, b, c)`, `d[6i+4] = a * b`, `d[6i+5] = a + c`, with the
/// device's own operations (operands from a buffer, so nothing can be folded).
pub const ARITH_PROBE: &str = "
@group(0) @binding(0) var<storage, read_write> d: array<f32>;
@compute @workgroup_size(1)
fn probe() {
    let n = arrayLength(&d) / 6u;
    for (var i = 0u; i < n; i++) {
        let a = d[6u * i];
        let b = d[6u * i + 1u];
        let c = d[6u * i + 2u];
        d[6u * i + 3u] = fma(a, b, c);
        d[6u * i + 4u] = a * b;
        d[6u * i + 5u] = a + c;
    }
}
";

#[cfg(test)]
mod tests {
    use super::*;

    /// A device's answers to the probe, emulated: `fused` or a multiply then
    /// an add; `flush`: subnormal operands read as zero and subnormal results
    /// written as zero (same sign), as a flushing GPU does.
    fn device(fused: bool, flush: bool) -> impl Fn([f32; 3]) -> [f32; 3] {
        let ftz = move |x: f32| {
            if flush && x != 0.0 && x.abs() < f32::MIN_POSITIVE {
                f32::from_bits(x.to_bits() & 0x8000_0000)
            } else {
                x
            }
        };
        move |[a, b, c]: [f32; 3]| {
            let (a, b, c) = (ftz(a), ftz(b), ftz(c));
            let fma = if fused {
                a.mul_add(b, c)
            } else {
                ftz(std::hint::black_box(a * b)) + c
            };
            [ftz(fma), ftz(a * b), ftz(a + c)]
        }
    }

    fn probe(fused: bool, flush: bool) -> ArithFindings {
        let (f, s) = (fused_fma_cases(), subnormal_cases());
        let got: Vec<[f32; 3]> = f.iter().chain(&s).map(|&t| device(fused, flush)(t)).collect();
        findings(&f, &s, &got)
    }

    /// The two findings come apart: each emulated device is seen as it is.
    #[test]
    fn the_probe_tells_fusion_from_flushing() {
        for fused in [false, true] {
            for flush in [false, true] {
                let got = probe(fused, flush);
                assert_eq!(got, ArithFindings { fma_fused: fused, subnormals_kept: !flush }, "fused {fused} flush {flush}");
            }
        }
    }

    /// The hardware fma is kept wherever it is fused, flushing or not; the
    /// soft fma is taken wherever it is not; the override wins.
    #[test]
    fn the_fma_route_follows_fusion_alone() {
        assert!(native_fma(probe(true, true), None), "fused, subnormals flushed: native");
        assert!(native_fma(probe(true, false), None), "fused, subnormals kept: native");
        assert!(!native_fma(probe(false, false), None), "unfused: soft");
        assert!(!native_fma(probe(false, true), None), "unfused and flushing: soft");
        assert!(!native_fma(probe(true, true), Some(false)));
        assert!(native_fma(probe(false, false), Some(true)));
    }

    /// The cases ask what they claim: every fused case tells a fused from an
    /// unfused fma without a subnormal anywhere; every subnormal case's
    /// `fma` is the same fused or not, and some value in it is subnormal.
    #[test]
    fn the_cases_ask_one_question_each() {
        let subnormal = |x: f32| x != 0.0 && x.abs() < f32::MIN_POSITIVE;
        for t in fused_fma_cases() {
            let [a, b, c] = t;
            let r = reference(t);
            assert!(!t.iter().chain(&r).any(|&x| subnormal(x)), "{t:?}");
            assert_ne!(r[0].to_bits(), (std::hint::black_box(a * b) + c).to_bits(), "{t:?}");
        }
        for t in subnormal_cases() {
            let [a, b, c] = t;
            let r = reference(t);
            assert_eq!(r[0].to_bits(), (std::hint::black_box(a * b) + c).to_bits(), "{t:?}: needs the fusion");
            assert!(t.iter().chain(&r).any(|&x| subnormal(x)), "{t:?}");
        }
    }
}
