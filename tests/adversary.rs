//! The adversarial compiler (`backend::gpu::adversary`) against the shipped
//! kernels: for each rewrite a driver's compiler may make — contraction,
//! regrouping, subnormal flushing, folding of inf/NaN — the whole primitive
//! sweep and a one-step training lockstep (float32 under contraction, bf16
//! under regrouping, fp16 under folding, all three under flushing), on lavapipe's
//! Vulkan with the kernels rewritten, held bit for bit to the CPU. Where the
//! probe can see what the compiler does (a product and a sum fused, constants
//! regrouped, subnormals flushed) it must see it, and the bits must hold all
//! the same: the kernels' own guards, not the driver, keep the contract.
//!
//! The rewrite is chosen per process (`TINYLLM_GPU_ADVERSARY`: the device,
//! its pipelines and its start-up probe are process-wide), so each test runs
//! itself again in a child process with the variable set, on Vulkan
//! (`WGPU_BACKEND=vulkan`: the rewrite acts on the hardened SPIR-V) and with
//! the software kernels (lavapipe compiles the hardware variants slowly; the
//! parity suite holds those to the same spec).

mod common;
use std::time::Instant;
use tinyllm::backend::gpu::adversary::{self, Adversary};
use tinyllm::backend::gpu::pipelines;
use tinyllm::backend::gpu::spirv::{self, FloatControls};
use tinyllm::backend::Family;
use tinyllm::crosscheck::{probe, sweep};
use tinyllm::precision::Precision;
use tinyllm::Device;

/// Runs `test` again in a child process under `a` (see [`common::in_child`])
/// and requires it to pass; in that child runs `body`.
fn under(a: Adversary, test: &str, body: fn(Adversary)) {
    let env = [
        (adversary::VAR, a.name()),
        ("WGPU_BACKEND", "vulkan"),
        ("TINYLLM_GPU_KERNELS", "software"),
    ];
    common::in_child(test, &env, || {
        assert_eq!(
            adversary::active().unwrap(),
            Some(a),
            "the child runs under its own rewrite"
        );
        require_gpu!();
        body(a);
    });
}

/// The probe's finding `check`: whether it held.
fn holds(p: &probe::Probe, check: &str) -> bool {
    p.findings
        .iter()
        .find(|f| f.check == check)
        .unwrap_or_else(|| panic!("no finding {check}"))
        .holds
}

/// A one-step tiny lockstep in each of `precisions`, bit-identical to the
/// CPU under rewrite `a`.
fn lockstep_holds(a: Adversary, precisions: &[Precision]) {
    for &precision in precisions {
        let t = Instant::now();
        common::assert_tiny_lockstep(1, precision, &format!("under the {} rewrite", a.name()));
        eprintln!(
            "{}: lockstep {} bit-identical in {:.1} s",
            a.name(),
            precision.name(),
            t.elapsed().as_secs_f64()
        );
    }
}

/// The adapter, when it is Vulkan's, the only path whose SPIR-V the
/// adversary rewrites (otherwise says so, for the caller to skip).
fn vulkan_adapter() -> Option<tinyllm::backend::gpu::AdapterInfo> {
    let info = tinyllm::backend::gpu::adapter().unwrap();
    if info.backend != "Vulkan" {
        eprintln!(
            "the adversary rewrites SPIR-V: no Vulkan adapter ({}), skipping",
            info.backend
        );
        return None;
    }
    Some(info)
}

/// A one-step lockstep in `precision` and the sweep of every family whose
/// kernels the rewrite changes (every format of every kernel): bit-identical
/// to the CPU, every row. Each rewrite's lockstep runs one precision (its
/// pipelines compile afresh under each rewrite); the three rewrites that
/// call this cover the three precisions between them.
fn bits_hold(a: Adversary, precision: Precision) {
    let Some(info) = vulkan_adapter() else {
        return;
    };
    assert!(
        info.shaders.starts_with("SPIR-V passthrough"),
        "{}",
        info.shaders
    );
    lockstep_holds(a, &[precision]);
    // the families whose kernels the rewrite changes
    let families: Vec<Family> = Family::ALL
        .into_iter()
        .filter(|&f| kernel_sites(f, info.fma == "native") > 0)
        .collect();
    // a family none of whose kernels changed compiles to the SPIR-V the
    // parity suite's sweep already holds to the CPU: nothing more to learn
    eprintln!("{}: kernels changed in {families:?}, swept", a.name());
    let t = Instant::now();
    let rows = sweep::run(&[Device::Gpu], &families, &mut |_| {}).unwrap();
    let mut failures = Vec::new();
    for r in &rows {
        if !r.bit_identical() {
            failures.push(format!("{}: {:?}", r.label(), r));
        }
    }
    assert!(
        failures.is_empty(),
        "under the {} rewrite:\n{}",
        a.name(),
        failures.join("\n")
    );
    eprintln!(
        "{}: sweep of {} rows bit-identical in {:.1} s",
        a.name(),
        rows.len(),
        t.elapsed().as_secs_f64()
    );
}

/// Operations the process's rewrite changes in the kernels of `f` (its
/// entry points as the device compiles them).
fn kernel_sites(f: Family, native_fma: bool) -> usize {
    let f = f.shaders();
    let before = adversary::sites();
    let src = pipelines::compose(f, native_fma);
    for e in f.entries {
        spirv::compile(&src, e, &[], FloatControls::default()).unwrap();
    }
    adversary::sites() - before
}

/// [`bits_hold`], and the cross-check's probe sees the rewrite: its `check`
/// fails.
fn bits_hold_and_probe_fails(a: Adversary, precision: Precision, check: &str) {
    bits_hold(a, precision);
    let p = probe::run().unwrap();
    assert!(
        !holds(&p, check),
        "the probe missed the {} rewrite ({check})",
        a.name()
    );
}

/// Every product feeding a sum contracted into one exact fma (the float32
/// step: every sum a chain of float32 products): the probe sees
/// the contraction (its product and sum written apart), the kernels' bits
/// do not change (`sep()` hides their products, the rest are explicit `fma_c`).
#[test]
fn contraction_changes_no_bits() {
    under(Adversary::Contract, "contraction_changes_no_bits", |a| {
        bits_hold_and_probe_fails(a, Precision::Fp32, "no_contraction")
    });
}

/// Sums, products and constant pairs regrouped: the probe sees it, the
/// kernels' bits do not change.
#[test]
fn regrouping_changes_no_bits() {
    under(Adversary::Regroup, "regrouping_changes_no_bits", |a| {
        bits_hold_and_probe_fails(a, Precision::Bf16, "no_reassociation")
    });
}

/// Constant inf/NaN arithmetic folded away: the kernels compute with none
/// (the fp16 step: the loss scaler's checks of inf and NaN).
#[test]
fn folding_infinities_changes_no_bits() {
    under(Adversary::Fold, "folding_infinities_changes_no_bits", |a| {
        bits_hold(a, Precision::Fp16)
    });
}

/// Subnormals flushed on the way into and out of every float operation, as
/// a D3D driver or Mesa's AMD and Intel drivers (without DenormPreserve) do:
/// the start-up probe and the cross-check's probe see it, the contract's fma
/// route follows fusion alone, and training stays bit-identical in all three
/// precisions. In the sweep, every primitive that the contract routes through
/// integer steps (roundings, division, square root, exp, log, softmax, the
/// norms, RoPE, cross-entropy, copies, packing, dropout) keeps its bits with
/// subnormal inputs and results; the primitives whose results are subnormal
/// float arithmetic ([`FLUSHED`]) cannot, on such a device, and are what its
/// probe reports as `subnormal_*` differences.
#[test]
fn flushing_is_seen_by_the_probe_and_changes_no_integer_route() {
    under(
        Adversary::Flush,
        "flushing_is_seen_by_the_probe_and_changes_no_integer_route",
        |a| {
            let Some(info) = vulkan_adapter() else {
                return;
            };
            assert_eq!(
                info.subnormals, "flushed",
                "the start-up probe missed the flushing"
            );
            assert_eq!(
                info.fma,
                if info.fma_fused { "native" } else { "soft" },
                "the fma route follows fusion alone"
            );
            let p = probe::run().unwrap();
            for check in ["subnormal_add", "subnormal_mul", "subnormal_fma"] {
                assert!(!holds(&p, check), "the probe's {check} missed the flushing");
            }
            for check in [
                "subnormal_load_store",
                "subnormal_div",
                "subnormal_rounding",
            ] {
                assert!(holds(&p, check), "{check}: an integer route flushed");
            }
            lockstep_holds(a, &[Precision::Fp32, Precision::Bf16, Precision::Fp16]);
            // matmul and the optimizers are products and sums of subnormals
            // through and through: left out; attention's forward is integer
            // routes and guarded products, which must hold
            let families = [
                Family::Elementwise,
                Family::Reduce,
                Family::Fused,
                Family::Copy,
                Family::Pack,
                Family::Dropout,
                Family::Attention,
            ];
            let mut failures = Vec::new();
            for f in families {
                let t = Instant::now();
                let rows = sweep::run(&[Device::Gpu], &[f], &mut |_| {}).unwrap();
                for r in &rows {
                    let flushed = FLUSHED.contains(&r.primitive);
                    eprintln!(
                        "{}: {} of {} values differ{}",
                        r.label(),
                        r.differing,
                        r.values,
                        if flushed { " (flushed arithmetic)" } else { "" }
                    );
                    if !r.bit_identical() && !flushed {
                        failures.push(format!("{}: {:?}", r.label(), r));
                    }
                }
                eprintln!("{f:?}: {:.1} s", t.elapsed().as_secs_f64());
            }
            assert!(
                failures.is_empty(),
                "under the flush rewrite:\n{}",
                failures.join("\n")
            );
        },
    );
}

/// The sweep's primitives whose results are float arithmetic on subnormal
/// operands or with subnormal results: a flushing device changes them.
const FLUSHED: [&str; 19] = [
    "unary neg",
    "unary silu",
    "unary silu grad",
    "unary relu",
    "unary step",
    "unary square",
    "unary add scalar",
    "unary mul scalar",
    "binary add",
    "binary sub",
    "binary mul",
    "binary maximum",
    "binary eq",
    "reduce sum",
    "reduce max",
    "swiglu",
    "swiglu backward",
    "scatter-add rows",
    // the softmax backward's p (dp - dot), subnormal where dp is
    "attention backward",
];
