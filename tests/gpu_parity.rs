//! GPU vs CPU parity, bit for bit, for every backend primitive.
//!
//! The comparisons themselves are the library's primitive sweep
//! (`tinyllm::crosscheck::sweep`, what `tinyllm crosscheck` runs on a user's
//! adapter): each family's primitives on `Device::Cpu` (the reference) and
//! `Device::Gpu` with random shapes and adversarial values (±0, subnormals,
//! ±inf, NaN, rounding ties, the fp16 overflow boundary, huge and tiny
//! exponents, lengths that are not multiples of any workgroup or tile),
//! `to_bits()` of every output compared. The one relaxation: a NaN equals a
//! NaN of any payload or sign (IEEE leaves NaN payloads to the
//! implementation; the contract only promises NaN-ness). The tests below the
//! sweep check what the sweep does not: the CPU side against independent
//! references (`round.rs`, `f32::mul_add`, expected flags), and the plumbing.
//!
//! Without a GPU adapter the GPU tests print "no GPU adapter; skipping" and
//! pass, unless `TINYLLM_REQUIRE_GPU=1` is set (as in CI with lavapipe): then
//! they fail. Shapes are small: lavapipe is a software device.

mod common;
use common::Rng;
use tinyllm::backend::round::{self, Format};
use tinyllm::backend::{Device, MatmulDims, ReduceOp, Storage, UnaryOp};
use tinyllm::crosscheck::cases::same;
use tinyllm::crosscheck::sweep::{self, Family};

// ------------------------------------------------------------ helpers ----

/// Asserts bit equality, listing the first mismatches (and the inputs if given).
fn assert_bits(what: &str, cpu: &[f32], gpu: &[f32], inputs: &[&[f32]]) {
    assert_eq!(cpu.len(), gpu.len(), "{what}: lengths differ");
    let bad: Vec<usize> = (0..cpu.len()).filter(|&i| !same(cpu[i], gpu[i])).collect();
    if !bad.is_empty() {
        let mut msg = format!("{what}: {} of {} outputs differ\n", bad.len(), cpu.len());
        for &i in bad.iter().take(8) {
            msg += &format!(
                "  [{i}] cpu {:e} ({:#010x}) gpu {:e} ({:#010x})",
                cpu[i],
                cpu[i].to_bits(),
                gpu[i],
                gpu[i].to_bits()
            );
            for (k, inp) in inputs.iter().enumerate() {
                if inp.len() == cpu.len() {
                    msg += &format!("  in{k} {:e} ({:#010x})", inp[i], inp[i].to_bits());
                }
            }
            msg += "\n";
        }
        panic!("{msg}");
    }
}

fn pair(data: &[f32]) -> (Storage, Storage) {
    (
        Storage::from_f32(data.to_vec(), Device::Cpu).unwrap(),
        Storage::from_f32(data.to_vec(), Device::Gpu).unwrap(),
    )
}

fn cpu(data: &[f32]) -> Storage {
    Storage::from_f32(data.to_vec(), Device::Cpu).unwrap()
}

fn vals(s: &Storage) -> Vec<f32> {
    s.to_vec_f32().unwrap()
}

// ------------------------------------------------------------- sweep ----

/// Runs one family of the library's sweep: every row bit-identical, except
/// the row the probe explains (bf16 products outside f32's normal range under
/// an unfused fma), which must be bit-identical wherever the fma is fused.
fn sweep_family(f: Family) {
    let rows = sweep::run(&[f], &mut |_| {}).unwrap();
    assert!(!rows.is_empty());
    let fused = tinyllm::backend::gpu::fma_mode().unwrap() == "native";
    let mut failures = Vec::new();
    for r in &rows {
        eprintln!(
            "{}: {} cases, {} values, {} differ",
            r.label(),
            r.cases,
            r.values,
            r.differing
        );
        assert!(
            r.known.is_none() || !fused,
            "{}: marked known with a fused fma",
            r.label()
        );
        if !r.bit_identical() && r.known.is_none() {
            failures.push(format!("{}: {:?}", r.label(), r));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn sweep_elementwise_and_rounding() {
    require_gpu!();
    sweep_family(Family::Elementwise);
}

#[test]
fn sweep_reductions() {
    require_gpu!();
    sweep_family(Family::Reduce);
}

#[test]
fn sweep_softmax() {
    require_gpu!();
    sweep_family(Family::Softmax);
}

#[test]
fn sweep_matmul() {
    require_gpu!();
    sweep_family(Family::Matmul);
}

#[test]
fn sweep_copies() {
    require_gpu!();
    sweep_family(Family::Copy);
}

#[test]
fn sweep_dropout() {
    require_gpu!();
    sweep_family(Family::Dropout);
}

#[test]
fn sweep_optimizer_kernels() {
    require_gpu!();
    sweep_family(Family::Optim);
}

// ------------------------------------ the CPU side against references ----

/// The CPU's rounding primitive on the sweep's stratified inputs is the
/// `round.rs` function itself (the sweep holds the GPU to the CPU).
#[test]
fn rounding_stratified_is_round_rs() {
    let x = sweep::rounding_inputs();
    let c = cpu(&x);
    for f in [Format::Bf16, Format::Fp16] {
        let a = vals(&c.unary(UnaryOp::Round(f)).unwrap());
        for (i, &v) in x.iter().enumerate() {
            assert!(same(a[i], round::round_f32(v, f)), "{f} of {v:e}");
        }
    }
}

/// The sweep's causally masked rows on the CPU: the tails past the diagonal
/// (which the CPU fills without computing them) are +0, as the full
/// computation gives.
#[test]
fn softmax_of_causally_masked_rows_has_zero_tails() {
    let (x, rows, n) = sweep::masked_softmax_rows();
    let y = vals(&cpu(&x).softmax_rows(rows, n, 1.0, false).unwrap());
    for i in 0..n - 1 {
        assert!(y[i * n + i + 1..(i + 1) * n]
            .iter()
            .all(|v| v.to_bits() == 0));
    }
}

/// Products that are inexact in f32 and sums that cancel: a kernel that did
/// not fuse `a*b+c` into one rounding (or fused where the CPU doesn't) shows here.
#[test]
fn matmul_fma_is_fused() {
    require_gpu!();
    let (m, k, n) = (16, 96, 16);
    let mut rng = Rng(99);
    let a: Vec<f32> = (0..m * k).map(|_| rng.moderate()).collect();
    let b: Vec<f32> = (0..k * n).map(|_| rng.moderate()).collect();
    let dims = MatmulDims {
        batch: 1,
        m,
        k,
        n,
        trans_a: false,
        trans_b: false,
        a_batch_stride: 0,
        b_batch_stride: 0,
        causal: Default::default(),
    };
    let (ac, ag) = pair(&a);
    let (bc, bg) = pair(&b);
    let c = vals(&ac.matmul(&bc, dims, None).unwrap());
    let g = vals(&ag.matmul(&bg, dims, None).unwrap());
    // the reference is the contract written out with f32::mul_add
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                acc = a[i * k + p].mul_add(b[p * n + j], acc);
            }
            assert_eq!(acc.to_bits(), c[i * n + j].to_bits());
        }
    }
    assert_bits("matmul fma", &c, &g, &[]);
}

/// The sweep's 20,000 fma triples (`(c, a)·(1, b) = fma(a, b, c)`) on the
/// CPU are `f32::mul_add` exactly (the sweep holds the GPU to the CPU).
#[test]
fn fused_multiply_add_triples_are_mul_add() {
    let n = 20_000;
    let (a, b, want) = sweep::fma_triples(n);
    let dims = MatmulDims {
        batch: n,
        m: 1,
        k: 2,
        n: 1,
        trans_a: false,
        trans_b: false,
        a_batch_stride: 2,
        b_batch_stride: 2,
        causal: Default::default(),
    };
    let c = vals(&cpu(&a).matmul(&cpu(&b), dims, None).unwrap());
    assert_bits("fma triples: cpu vs mul_add", &want, &c, &[]);
}

/// The finite check's flag on the CPU is the expected one for each set of
/// buffers of the sweep's shape (the sweep holds the GPU's flag to the CPU's).
#[test]
fn finite_check_flags() {
    let n = sweep::N_OPTIM;
    let mut rng = Rng(31);
    let finite: Vec<Vec<f32>> = vec![
        (0..n).map(|_| rng.moderate() * 1e4).collect(),
        vec![f32::MAX, -f32::MAX, 1e-45, -0.0, 3e-39],
        vec![],
    ];
    let mut with_inf = finite.clone();
    with_inf[1][2] = f32::NEG_INFINITY;
    let mut with_nan = finite.clone();
    with_nan[0][n - 1] = f32::NAN;
    let mut mid_inf = finite.clone();
    mid_inf[0][16384 + 64 * 7 + 5] = f32::INFINITY;
    let mut only_last = finite.clone();
    only_last.push(vec![1.0, 2.0, f32::INFINITY]);
    for (bufs, want) in [
        (finite, true),
        (with_inf, false),
        (with_nan, false),
        (mid_inf, false),
        (only_last, false),
    ] {
        let cs: Vec<Storage> = bufs.iter().map(|b| cpu(b)).collect();
        let refs: Vec<&Storage> = cs.iter().collect();
        assert_eq!(
            Storage::finite_check_unscale(&refs, 2f32.powi(-16)).unwrap(),
            want
        );
    }
}

// ------------------------------------------------------------ plumbing ----

#[test]
fn reports_the_adapter() {
    require_gpu!();
    let name = tinyllm::backend::gpu::adapter_name().unwrap();
    let fma = tinyllm::backend::gpu::fma_mode().unwrap();
    eprintln!("GPU adapter: {name}; fma: {fma}");
    assert!(!name.is_empty());
}

#[test]
fn pool_reuses_buffers_and_memory_is_counted() {
    require_gpu!();
    let before = tinyllm::memory::live_bytes();
    let a = Storage::from_f32(vec![1.0; 1000], Device::Gpu).unwrap();
    assert_eq!(tinyllm::memory::live_bytes(), before + 4000);
    drop(a);
    assert_eq!(tinyllm::memory::live_bytes(), before);
    assert!(tinyllm::gpu::pool_bytes() >= 4000);
    // a long chain of small ops: many batches, buffers recycled
    let mut x = Storage::from_f32(vec![0.5; 100], Device::Gpu).unwrap();
    for _ in 0..200 {
        x = x.unary(UnaryOp::MulScalar(1.01)).unwrap();
    }
    let mut y = Storage::from_f32(vec![0.5; 100], Device::Cpu).unwrap();
    for _ in 0..200 {
        y = y.unary(UnaryOp::MulScalar(1.01)).unwrap();
    }
    assert_bits("long chain", &vals(&y), &vals(&x), &[]);
    let z = Storage::from_f32(vec![], Device::Gpu).unwrap();
    assert!(vals(&z).is_empty());
}

// ------------------------------------------------------- long loops ----

/// Lavapipe (llvmpipe) stops any single shader loop after 65,535 iterations.
/// The sweep runs every kernel loop that can run longer (reductions, a
/// matmul's k, a scatter row's contributions) past it against the CPU; here
/// the sum is checked against its exact value, and a softmax row that long,
/// which runs as one loop nest, must be refused on lavapipe with a clear
/// error (never a silently truncated result) and match elsewhere.
#[test]
fn loops_longer_than_lavapipes_iteration_cap() {
    require_gpu!();
    let n = 70_001;
    let ones = vec![1.0f32; n];
    let (_, g1) = pair(&ones);
    assert_eq!(
        vals(&g1.reduce(ReduceOp::Sum, 1, n, 1).unwrap()),
        vec![n as f32]
    );
    let mut rng = Rng(91);
    let x: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
    let (c, g) = pair(&x);
    let sm = g.softmax_rows(1, n, 1.0, false);
    if tinyllm::backend::gpu::adapter_name()
        .unwrap()
        .contains("llvmpipe")
    {
        let e = sm.unwrap_err().to_string();
        assert!(e.contains("loop limit"), "{e}");
    } else {
        let want = vals(&c.softmax_rows(1, n, 1.0, false).unwrap());
        assert_bits("softmax row of 70001", &want, &vals(&sm.unwrap()), &[&x]);
    }
}
