//! The device probe: which adapter the GPU backend runs on, its limits, and —
//! measured on the device, one operation at a time (`shaders/probe.wgsl`, run by `backend::gpu::probe_ops`)
//! — whether it does what the numerics contract assumes: a fused `fma`,
//! gradual underflow in every operation the kernels use, no contraction of a
//! product and a sum written apart, rounding to nearest even, signed zeros,
//! inf and NaN, no reassociation of constants.
//!
//! Each [`Finding`] says what was assumed, how many cases held, the first
//! that did not, and what follows on this device: nothing (it holds), the
//! path the backend takes instead that keeps the contract (handled), or which
//! results can differ and why (differs). Facts the kernels never rely on
//! (the device's own `/`, `sqrt`, `exp`) are reported for information.

use super::hex;
use crate::backend::gpu::arith;
use crate::backend::gpu::context::ctx;
use crate::backend::gpu::probe_ops::{self as device, ProbeOp};
use crate::crosscheck::cases::same;
use crate::Result;
use serde::Serialize;
use std::collections::BTreeMap;

/// What a finding means for the contract on this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// The device does what the contract assumes.
    Holds,
    /// It does not, and the backend keeps the contract another way.
    Handled,
    /// It does not, and some results can differ from the CPU's (said how).
    Differs,
    /// A fact the kernels do not rely on.
    Info,
}

impl Status {
    /// The status as the report prints it: `holds`, `handled`, `DIFFERS` or
    /// `info`.
    pub fn name(self) -> &'static str {
        match self {
            Status::Holds => "holds",
            Status::Handled => "handled",
            Status::Differs => "DIFFERS",
            Status::Info => "info",
        }
    }
}

/// One operation on the device whose result was not the contract's.
#[derive(Clone, Debug, Serialize)]
pub struct ProbeCase {
    /// The operation as the kernels write it, e.g. `fma(a, b, c)` or `a * b`.
    pub op: &'static str,
    /// The operands as f32 bit patterns (hex).
    pub operands: Vec<String>,
    /// The contract's result (IEEE single precision, computed on the CPU), as
    /// an f32 bit pattern in hex.
    pub want: String,
    /// The device's result, as an f32 bit pattern in hex.
    pub got: String,
}

/// One assumption of the contract, checked.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// A short key (`fma_fused`, `subnormal_mul`, …).
    pub check: &'static str,
    /// What the contract assumes of the device.
    pub assumption: &'static str,
    /// Whether every case held.
    pub holds: bool,
    /// Operations run on the device for this check.
    pub cases: usize,
    /// Cases whose result was not the contract's.
    pub failed: usize,
    /// The first such case (`None` when every case held).
    pub first_failure: Option<ProbeCase>,
    /// What the result means for the contract on this device.
    pub status: Status,
    /// What follows on this device.
    pub consequence: String,
}

/// The adapter, its limits and the findings.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    /// The adapter's name, as the driver reports it.
    pub adapter: String,
    /// Vulkan, Metal, Dx12 or Gl.
    pub backend: String,
    /// wgpu's device type: `DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`,
    /// `Cpu` (a software adapter) or `Other`.
    pub device_type: String,
    /// The driver's name.
    pub driver: String,
    /// The driver's version or other details, as the driver reports them.
    pub driver_info: String,
    /// The multiply-add the kernels use: `native` (the device's, fused) or
    /// `soft` (the integer emulation).
    pub fma_path: &'static str,
    /// How the kernels reach the driver: hardened SPIR-V (with the float
    /// controls requested and granted) or WGSL, and why.
    pub shaders: String,
    /// What the start-up probe found of f32 subnormals under `*`, `+` and
    /// `fma`: `kept` or `flushed` (the findings `subnormal_*` say where).
    pub subnormals: &'static str,
    /// The limits the backend depends on, by wgpu's names.
    pub limits: BTreeMap<&'static str, u64>,
    /// One finding per checked assumption, in a fixed order (`fma_fused` first).
    pub findings: Vec<Finding>,
}

impl Probe {
    /// The findings whose consequence is that results can differ.
    pub fn differing(&self) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(|f| f.status == Status::Differs)
    }

    /// Whether the device's own `fma` is fused (the first finding).
    pub fn fma_fused(&self) -> bool {
        self.findings
            .iter()
            .find(|f| f.check == "fma_fused")
            .is_some_and(|f| f.holds)
    }
}

fn p2(k: i32) -> f32 {
    2f32.powi(k)
}

fn sub(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// The cases of one finding: `(op, [a, b, c])`.
type Cases = Vec<(ProbeOp, [f32; 3])>;

fn with(op: ProbeOp, v: &[[f32; 3]]) -> Cases {
    v.iter().map(|&x| (op, x)).collect()
}

/// Triples whose fused and unfused results differ, on normal operands with
/// normal results (so a device that fuses but flushes subnormals passes): the
/// start-up probe's ([`arith::fused_fma_cases`]).
fn fma_triples() -> Vec<[f32; 3]> {
    arith::fused_fma_cases()
}

/// Every finding's cases, assumption and what follows when it fails.
struct Check {
    key: &'static str,
    assumption: &'static str,
    cases: Cases,
    /// The status when a case fails, and why.
    on_failure: (Status, String),
    /// The status when every case holds (`Info` for facts not relied on).
    on_success: Status,
}

fn checks(native_fma: bool) -> Vec<Check> {
    use ProbeOp::*;
    let (s1, smid, smax) = (sub(1), sub(0x0040_0000), sub(0x007f_ffff));
    let min = f32::MIN_POSITIVE;
    let flush = |what: &str| {
        (
            Status::Differs,
            format!(
                "results can differ wherever {what} meets f32 subnormals (|x| < 2^-126): \
                 the device flushes them to zero, the contract keeps gradual underflow \
                 (tiny activations, gradients that underflow, products of small values); \
                 the crate's division, square root, exp and log and the bf16/fp16 roundings \
                 take integer steps where subnormals occur and are not affected"
            ),
        )
    };
    // The device's fma on triples whose fma is the same fused or not (the
    // start-up probe's: subnormals alone), and the kernels' fma_c on those and
    // on subnormal results that need the fusion (fma_c is fused either way).
    let exact = arith::subnormal_cases();
    let mut subnormal_fma = with(Fma, &exact);
    subnormal_fma.extend(with(FmaC, &exact));
    subnormal_fma.extend(with(
        FmaC,
        &[
            [p2(-70) * 1.5, p2(-70) * 1.25, p2(-140)],
            [p2(-75) * 1.000_000_1, p2(-75), -p2(-149)],
        ],
    ));
    let fma_route = if native_fma {
        "the kernels keep the device's fma (fma_c), as it is fused: the integer fma would keep \
         the subnormals of the multiply-adds alone, not those of the kernels' own * and +, at \
         ten times the cost of all f32 work; so f32 multiply-adds whose values fall below \
         2^-126 (matmul sums, the optimizers' updates) can differ"
    } else {
        "the kernels' f32 multiply-adds use fma_c = the integer emulation (the device's fma is \
         not fused), which keeps subnormals; the device's own fma remains"
    };
    let subnormal_fma_failure = (
        Status::Differs,
        format!(
            "the device's fma flushes f32 subnormals (|x| < 2^-126): {fma_route}; the rounded \
             (bf16/fp16) matmuls always use the device's fma, so their outputs can differ \
             wherever a product or a running sum falls below 2^-126 (no guarded path is taken \
             for them)"
        ),
    );
    let unfused_caveat =
        "rounded (bf16/fp16) matmuls use the device's fma for speed where the product of \
         two rounded operands is exact in f32, and track the magnitudes of the bf16 operands \
         each chain reads: where a product may pass f32's largest value or fall below \
         2^-126, the chain runs again with fma_c";
    vec![
        Check {
            key: "fma_fused",
            assumption: "fma(a, b, c) is one correctly rounded operation (fused), on normal operands",
            cases: with(Fma, &fma_triples()),
            on_failure: (
                if native_fma {
                    Status::Differs
                } else {
                    Status::Handled
                },
                if native_fma {
                    "the backend was told to use the device's fma anyway (TINYLLM_GPU_FMA=native): \
                     every kernel's multiply-adds can differ"
                        .to_string()
                } else {
                    format!(
                        "the kernels' f32 multiply-adds use fma_c = the integer emulation \
                         (math.wgsl), which is bit-exact; {unfused_caveat}"
                    )
                },
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "fma_contract",
            assumption: "the kernels' fma_c is one correctly rounded fma on normal operands, overflow included",
            cases: with(FmaC, &fma_triples()),
            on_failure: (
                Status::Differs,
                "every kernel's multiply-adds (matmul, division, exp, log, the optimizers) can differ".into(),
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "subnormal_load_store",
            assumption: "f32 subnormals survive loads, stores and bitcasts (kernel inputs and results)",
            cases: [
                with(Copy, &[[s1, 0.0, 0.0], [-s1, 0.0, 0.0], [smid, 0.0, 0.0], [smax, 0.0, 0.0], [-sub(0x0012_3456), 0.0, 0.0]]),
                with(Bits, &[[smid, 0.0, 0.0], [s1, sub(2), 0.0], [min, sub(0x0080_0001), 0.0]]),
            ]
            .concat(),
            on_failure: flush("any primitive's input or output"),
            on_success: Status::Holds,
        },
        Check {
            key: "subnormal_add",
            assumption: "+ and − keep subnormal operands and results",
            cases: [
                with(Add, &[[s1, s1, 0.0], [smax, s1, 0.0], [smid, -smid, 0.0], [-s1, 0.0, 0.0]]),
                with(Sub, &[[min, s1, 0.0], [1.5 * min, min, 0.0]]),
            ]
            .concat(),
            on_failure: flush("an addition"),
            on_success: Status::Holds,
        },
        Check {
            key: "subnormal_mul",
            assumption: "× keeps subnormal operands and results",
            cases: with(
                Mul,
                &[[smid, 1.0, 0.0], [p2(-70), p2(-70), 0.0], [smax, 2.0, 0.0], [s1, 0.5, 0.0], [sub(3), 0.5, 0.0], [-s1, 1.0, 0.0]],
            ),
            on_failure: flush("a multiplication"),
            on_success: Status::Holds,
        },
        Check {
            key: "subnormal_fma",
            assumption: "fma (the device's and fma_c) keeps subnormal operands and results",
            cases: subnormal_fma,
            on_failure: subnormal_fma_failure,
            on_success: Status::Holds,
        },
        Check {
            key: "subnormal_div",
            assumption: "the crate's division keeps subnormal operands and results",
            cases: with(
                Div,
                &[[smid, 1.0, 0.0], [1.0, 1.5 * p2(127), 0.0], [s1, 2.0, 0.0], [sub(3), 2.0, 0.0], [smax, min, 0.0], [1e-38, 3.0, 0.0], [smax, 3.0, 0.0], [3.0, smid, 0.0]],
            ),
            on_failure: (
                Status::Differs,
                "the crate's division takes its exponents in and out by integer steps and works \
                 on mantissas in [1, 2), so no subnormal meets float arithmetic in it: a failure \
                 here is a device fault beyond flushing, and every division (softmax, norms, \
                 AdamW) can differ"
                    .into(),
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "subnormal_rounding",
            assumption: "bf16/fp16 rounding (integer steps) keeps subnormal inputs and results",
            cases: [
                with(Bf16, &[[smid, 0.0, 0.0], [sub(0x8000), 0.0, 0.0], [sub(0x1_8000), 0.0, 0.0], [-smax, 0.0, 0.0]]),
                with(Fp16, &[[p2(-25), 0.0, 0.0], [3.0 * p2(-25), 0.0, 0.0], [p2(-24), 0.0, 0.0], [smid, 0.0, 0.0], [p2(-14) - p2(-25), 0.0, 0.0]]),
            ]
            .concat(),
            on_failure: flush("a bf16/fp16 rounding"),
            on_success: Status::Holds,
        },
        Check {
            key: "no_contraction",
            assumption: "a product and a sum written as two operations are not contracted into an fma",
            cases: with(
                MulThenAdd,
                &[[1.0 + p2(-12), 1.0 + p2(-12), -1.0], [0.1, 10.0, -1.0], [1.0 / 3.0, 3.0, -1.0], [1.0 + p2(-23), 1.0 - p2(-23), -1.0]],
            ),
            on_failure: (
                Status::Handled,
                "the compiler fuses a * b + c: the kernels write every multiply-add that matters \
                 as an explicit fma_c, and where they write a product then a sum the product is \
                 exact (math.wgsl's rules), so contraction cannot change their bits; the sweep \
                 is the evidence"
                    .into(),
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "round_to_nearest_even",
            assumption: "+ − × round to nearest, ties to even",
            cases: [
                with(Add, &[[1.0, p2(-24), 0.0], [1.0, 3.0 * p2(-24), 0.0], [1.0 + p2(-23), p2(-24), 0.0]]),
                with(Sub, &[[1.0, p2(-25), 0.0]]),
                with(Mul, &[[1.0 + p2(-12), 1.0 + p2(-12), 0.0], [1.0 + p2(-23), 1.0 + p2(-23), 0.0]]),
            ]
            .concat(),
            on_failure: (
                Status::Differs,
                "every arithmetic result can differ: the device does not round to nearest even".into(),
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "signed_zero",
            assumption: "the sign of zero is kept (−0 + −0 = −0, 0 × −1 = −0, …)",
            cases: [
                with(Copy, &[[-0.0, 0.0, 0.0]]),
                with(Add, &[[-0.0, -0.0, 0.0], [-0.0, 0.0, 0.0]]),
                with(Sub, &[[0.0, 0.0, 0.0], [-0.0, 0.0, 0.0]]),
                with(Mul, &[[-0.0, 5.0, 0.0], [0.0, -1.0, 0.0]]),
                with(FmaC, &[[-0.0, 5.0, 0.0], [-0.0, 5.0, -0.0]]),
            ]
            .concat(),
            on_failure: (
                Status::Differs,
                "the sign of zero results can differ (it shows in reductions that start from −0, \
                 in maximum and in division by zero)"
                    .into(),
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "inf_nan",
            assumption: "inf and NaN pass through arithmetic as IEEE says",
            cases: [
                with(Copy, &[[f32::NAN, 0.0, 0.0], [f32::NEG_INFINITY, 0.0, 0.0]]),
                with(Add, &[[f32::INFINITY, 1.0, 0.0], [f32::MAX, f32::MAX, 0.0], [f32::NAN, 1.0, 0.0]]),
                with(Sub, &[[f32::INFINITY, f32::INFINITY, 0.0]]),
                with(Mul, &[[0.0, f32::INFINITY, 0.0], [f32::MAX, 2.0, 0.0], [f32::NEG_INFINITY, -1.0, 0.0]]),
                with(Div, &[[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, f32::INFINITY, 0.0]]),
            ]
            .concat(),
            on_failure: (
                Status::Differs,
                "non-finite values can come out differently: overflow checks (the loss scaler), \
                 masked softmax rows and NaN propagation can differ"
                    .into(),
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "no_reassociation",
            assumption: "float expressions with constants are not regrouped ((x + 2^23) − 2^23 is not x)",
            cases: with(Fold, &[[1.5, 0.0, 0.0], [0.25, 0.0, 0.0], [-1.5, 0.0, 0.0], [2.5, 0.0, 0.0]]),
            on_failure: (
                Status::Handled,
                "the compiler regroups float constants: the kernels never rely on the grouping \
                 of constant operations (round.wgsl rounds fp16 subnormals with integer steps, \
                 where the CPU uses this very expression)"
                    .into(),
            ),
            on_success: Status::Holds,
        },
        Check {
            key: "native_math",
            assumption: "(not relied on) the device's own /, sqrt and exp are correctly rounded",
            cases: [
                with(NativeDiv, &[[1.0, 3.0, 0.0], [2.0, 3.0, 0.0], [smid, 3.0, 0.0], [7.0, 1.1, 0.0]]),
                with(NativeSqrt, &[[2.0, 0.0, 0.0], [3.0, 0.0, 0.0], [smid, 0.0, 0.0]]),
                with(NativeExp, &[[1.0, 0.0, 0.0], [0.5, 0.0, 0.0], [-10.0, 0.0, 0.0], [10.0, 0.0, 0.0]]),
            ]
            .concat(),
            on_failure: (
                Status::Info,
                "not used: the kernels divide, take roots and exponentials with the crate's own \
                 routines (math.wgsl), built from + − × fma and bit operations"
                    .into(),
            ),
            on_success: Status::Info,
        },
    ]
}

/// Probes the GPU backend's adapter (creating the device on first use).
pub fn run() -> Result<Probe> {
    let c = ctx()?;
    let info = crate::gpu::adapter()?;
    let checks = checks(c.native_fma);
    let all: Cases = checks
        .iter()
        .flat_map(|k| k.cases.iter().copied())
        .collect();
    let got = device::run(&all)?;
    let mut at = 0;
    let mut findings = Vec::new();
    for k in checks {
        let mut failed = 0;
        let mut first = None;
        for &(op, [a, b, cc]) in &k.cases {
            let want = op.reference(a, b, cc);
            let g = got[at];
            at += 1;
            if !same(want, g) {
                failed += 1;
                first.get_or_insert_with(|| ProbeCase {
                    op: op.name(),
                    operands: [a, b, cc].iter().map(|&x| hex(x)).collect(),
                    want: hex(want),
                    got: hex(g),
                });
            }
        }
        let holds = failed == 0;
        let (status, consequence) = if holds {
            (k.on_success, String::new())
        } else {
            k.on_failure.clone()
        };
        findings.push(Finding {
            check: k.key,
            assumption: k.assumption,
            holds,
            cases: k.cases.len(),
            failed,
            first_failure: first,
            status,
            consequence,
        });
    }
    let l = &c.limits;
    Ok(Probe {
        adapter: info.name,
        backend: info.backend,
        device_type: format!("{:?}", c.info.device_type),
        driver: info.driver,
        driver_info: info.driver_info,
        fma_path: info.fma,
        shaders: info.shaders,
        subnormals: info.subnormals,
        limits: BTreeMap::from([
            (
                "max_storage_buffer_binding_size",
                l.max_storage_buffer_binding_size as u64,
            ),
            ("max_buffer_size", l.max_buffer_size),
            (
                "max_storage_buffers_per_shader_stage",
                l.max_storage_buffers_per_shader_stage as u64,
            ),
            (
                "max_compute_workgroups_per_dimension",
                l.max_compute_workgroups_per_dimension as u64,
            ),
            (
                "max_compute_invocations_per_workgroup",
                l.max_compute_invocations_per_workgroup as u64,
            ),
            (
                "max_compute_workgroup_storage_size",
                l.max_compute_workgroup_storage_size as u64,
            ),
            (
                "min_storage_buffer_offset_alignment",
                l.min_storage_buffer_offset_alignment as u64,
            ),
        ]),
        findings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(native_fma: bool, key: &str) -> Check {
        checks(native_fma)
            .into_iter()
            .find(|c| c.key == key)
            .unwrap_or_else(|| panic!("no check {key}"))
    }

    /// The fusion checks ask about fusion alone: no subnormal operand or
    /// result, so a device that fuses but flushes passes them.
    #[test]
    fn the_fusion_checks_stay_in_the_normal_range() {
        let subnormal = |x: f32| x != 0.0 && x.abs() < f32::MIN_POSITIVE;
        for key in ["fma_fused", "fma_contract"] {
            for (op, [a, b, c]) in check(false, key).cases {
                let r = op.reference(a, b, c);
                assert!(
                    ![a, b, c, r].into_iter().any(subnormal),
                    "{key}: {op:?}({a:e}, {b:e}, {c:e})"
                );
            }
        }
    }

    /// A flushing device's subnormal fma finding names the route the
    /// backend takes — the device's fused fma kept, or the integer one — and
    /// the rounded matmuls, which use the device's fma either way.
    #[test]
    fn the_subnormal_fma_finding_names_the_route() {
        let native = check(true, "subnormal_fma").on_failure;
        let soft = check(false, "subnormal_fma").on_failure;
        assert_eq!((native.0, soft.0), (Status::Differs, Status::Differs));
        assert!(native.1.contains("keep the device's fma"), "{}", native.1);
        assert!(soft.1.contains("integer emulation"), "{}", soft.1);
        for text in [&native.1, &soft.1] {
            assert!(
                text.contains("bf16/fp16") && text.contains("2^-126"),
                "{text}"
            );
        }
    }
}
