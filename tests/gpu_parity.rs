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
use tinyllm::backend::gpu::variant::{with_kernels, Kernels};
use tinyllm::backend::round::{self, Format};
use tinyllm::backend::Family;
use tinyllm::backend::{Device, MatmulDims, ReduceOp, Storage, UnaryOp};
use tinyllm::crosscheck::cases::{adversarial, same};
use tinyllm::crosscheck::sweep;

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

/// Runs one family of the library's sweep with `device` held to the
/// executable spec: every row bit-identical.
fn sweep_family(device: Device, f: Family) {
    let rows = sweep::run(&[device], &[f], &mut |_| {}).unwrap();
    assert!(!rows.is_empty());
    let mut failures = Vec::new();
    for r in &rows {
        eprintln!(
            "{}: {} cases, {} values, {} differ",
            r.label(),
            r.cases,
            r.values,
            r.differing
        );
        if !r.bit_identical() {
            failures.push(format!("{}: {:?}", r.label(), r));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The family's sweep with the hardware kernels forced. On a software
/// adapter (lavapipe) the matmul's whole sweep (about 60 pipelines) takes
/// well over a minute cold, so there it runs only with
/// `TINYLLM_SWEEP_HARDWARE=1`, and by default three pipelines over the
/// tile's edge cases ([`matmul_tiled_edges`]) and attention's not at all
/// (its kernels have no hardware variant: `gpu` runs them); every other
/// family's sweep runs whole. On a hardware adapter `gpu` already runs these kernels.
fn sweep_hardware(f: Family) {
    let software = tinyllm::backend::gpu::adapter().unwrap().software;
    let whole = std::env::var("TINYLLM_SWEEP_HARDWARE").as_deref() == Ok("1");
    match f {
        Family::Matmul if software && !whole => matmul_tiled_edges(),
        // attention's kernels are the same in both variants
        Family::Attention if software && !whole => {}
        _ => sweep_family(Device::Gpu, f),
    }
}

/// The tiled matmul's edges against the CPU (itself held to the spec by
/// `sweep_matmul::cpu`): blocks past the matrix in m and n, k below, at and
/// across a staged tile (`TILE_K` 16), batches, both transposes, f32 (the
/// soft fma) and bf16, a causal mask across a block's diagonal, and
/// specials planted among the operands.
fn matmul_tiled_edges() {
    use tinyllm::backend::Causal;
    let mut rng = Rng(0x711e);
    // products past f32's range among them (huge values), which an unfused
    // fma leaves to the exponent check
    let sp = [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        0.0,
        -0.0,
        3.0e38,
        -1.0e30,
    ];
    let case = |rng: &mut Rng,
                (batch, m, k, n): (usize, usize, usize, usize),
                ta: bool,
                tb: bool,
                causal: Causal,
                round: Option<Format>| {
        let mut a: Vec<f32> = (0..batch * m * k).map(|_| rng.moderate()).collect();
        let b: Vec<f32> = (0..batch * k * n).map(|_| rng.moderate()).collect();
        for (i, v) in a.iter_mut().enumerate() {
            if i % 37 == 5 {
                *v = sp[i % sp.len()];
            }
        }
        let d = MatmulDims {
            batch,
            m,
            k,
            n,
            trans_a: ta,
            trans_b: tb,
            a_batch_stride: m * k,
            b_batch_stride: k * n,
            causal,
            tokens: Default::default(),
        };
        let (ca, ga) = pair(&a);
        let (cb, gb) = pair(&b);
        let want = vals(&ca.matmul(&cb, d, round).unwrap());
        let got = vals(&ga.matmul(&gb, d, round).unwrap());
        assert_bits(&format!("tiled {}", d.describe(round)), &want, &got, &[]);
    };
    for shape in [
        (2, 65, 17, 70),
        (1, 5, 7, 3),
        (1, 66, 16, 65),
        (1, 130, 33, 64),
    ] {
        case(&mut rng, shape, true, false, Causal::No, Some(Format::Bf16));
    }
    for shape in [(1, 70, 33, 129), (2, 9, 1, 66)] {
        case(&mut rng, shape, false, true, Causal::No, None);
    }
    case(
        &mut rng,
        (2, 70, 9, 70),
        false,
        true,
        Causal::Outputs,
        Some(Format::Bf16),
    );
    // A bf16 product past f32's largest value after an infinity: the exact
    // chain gives -inf; an unfused fma rounds the product to +inf first and
    // gives NaN, unless the guard sends the chain to fma_c.
    let (ca, ga) = pair(&[f32::NEG_INFINITY, 1.5 * 2f32.powi(127)]);
    let (cb, gb) = pair(&[1.0, 2.0]);
    let d = pair_products(1);
    let round = Some(Format::Bf16);
    let want = vals(&ca.matmul(&cb, d, round).unwrap());
    assert_eq!(want[0].to_bits(), f32::NEG_INFINITY.to_bits());
    let got = vals(&ga.matmul(&gb, d, round).unwrap());
    assert_bits("tiled: a product past f32's range", &want, &got, &[]);
}

/// `sweeps! { name => Family, … }`: each family's sweep, the fast CPU kernels
/// against the spec (every run, GPU or not) and the GPU against the spec —
/// the kernels the adapter gets (`gpu`) and the hardware variant forced
/// (`gpu_hardware`, see [`sweep_hardware`]: on lavapipe the software variant
/// is the adapter's, so both are held to the spec here) — and a test that
/// the list names every family of the backend's one list, once.
macro_rules! sweeps {
    ($($name:ident => $family:expr),+ $(,)?) => {
        $(mod $name {
            use super::*;
            #[test]
            fn cpu() {
                sweep_family(Device::Cpu, $family);
            }
            #[test]
            fn gpu() {
                require_gpu!();
                sweep_family(Device::Gpu, $family);
            }
            #[test]
            fn gpu_hardware() {
                require_gpu!();
                // in a child: its cold compiles run beside this process's
                common::in_child(concat!(stringify!($name), "::gpu_hardware"), &[], || {
                    with_kernels(Kernels::Hardware, || sweep_hardware($family))
                });
            }
        })+

        #[test]
        fn every_family_has_a_parity_sweep() {
            let mut listed = vec![$($family),+];
            listed.sort_by_key(|f| f.code());
            assert_eq!(listed, Family::ALL.to_vec());
        }
    };
}

sweeps! {
    sweep_elementwise_and_rounding => Family::Elementwise,
    sweep_reductions_and_softmax => Family::Reduce,
    sweep_matmul => Family::Matmul,
    sweep_attention => Family::Attention,
    sweep_fused => Family::Fused,
    sweep_copies => Family::Copy,
    sweep_pack => Family::Pack,
    sweep_dropout => Family::Dropout,
    sweep_update_kernels => Family::Update,
}

/// The same adapter through wgpu's GL backend (WGSL compiled to GLSL: a
/// second shader front end): every family's sweep of the kernels the adapter
/// gets, and a two-step `tiny` lockstep in each precision, bit-identical to
/// the CPU. In a child process (the backend is chosen once per process),
/// beside this binary's other tests: its cold compiles take minutes on
/// lavapipe, one at a time (wgpu's GL context serialises them). Named to
/// sort early: libtest starts tests in name order, and this, the binary's
/// longest, would otherwise run alone at its end.
#[test]
fn gl_front_end_keeps_every_bit() {
    use tinyllm::precision::Precision;
    let env = [("WGPU_BACKEND", "gl")];
    common::in_child("gl_front_end_keeps_every_bit", &env, || {
        require_gpu!();
        let info = tinyllm::backend::gpu::adapter().unwrap();
        assert_eq!(info.backend, "Gl", "WGPU_BACKEND=gl reached {info:?}");
        assert!(info.shaders.starts_with("WGSL"), "{}", info.shaders);
        for f in Family::ALL {
            sweep_family(Device::Gpu, f);
        }
        for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
            common::assert_tiny_lockstep(2, precision, "through GL");
        }
    });
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
        tokens: Default::default(),
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

/// A batch of `batch` products (1×2)·(2×1): `(c, a)·(1, b)` is `fma(a, b, c)`.
fn pair_products(batch: usize) -> MatmulDims {
    MatmulDims {
        batch,
        m: 1,
        k: 2,
        n: 1,
        trans_a: false,
        trans_b: false,
        a_batch_stride: 2,
        b_batch_stride: 2,
        causal: Default::default(),
        tokens: Default::default(),
    }
}

/// The sweep's 20,000 fma triples (`(c, a)·(1, b) = fma(a, b, c)`) on the
/// CPU are `f32::mul_add` exactly (the sweep holds the GPU to the CPU).
#[test]
fn fused_multiply_add_triples_are_mul_add() {
    let n = 20_000;
    let (a, b, want) = sweep::fma_triples(n);
    let c = vals(&cpu(&a).matmul(&cpu(&b), pair_products(n), None).unwrap());
    assert_bits("fma triples: cpu vs mul_add", &want, &c, &[]);
}

/// The finite check's flag on the CPU is the expected one for each set of
/// buffers of the sweep's shape (the sweep holds the GPU's flag to the CPU's).
#[test]
fn finite_check_flags() {
    let n = sweep::N_UPDATE;
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

// ------------------------------------------------ fused transformer ops ----

/// `rows` rows of `d`: every third row adversarial (specials, any bit
/// pattern: ±0, subnormals, ±inf, NaN), the rest moderate values, one row of
/// ±0 and one of subnormals (their sums of squares underflow).
fn rows_of(rng: &mut Rng, rows: usize, d: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * d);
    for r in 0..rows {
        match r % 5 {
            0 => x.extend(adversarial(rng, d)),
            3 => x.extend((0..d).map(|j| if j % 2 == 0 { 0.0 } else { -0.0 })),
            4 if r > 5 => {
                x.extend((0..d).map(|j| {
                    f32::from_bits(1 + 977 * j as u32) * if j % 3 == 0 { -1.0 } else { 1.0 }
                }))
            }
            _ => x.extend((0..d).map(|_| rng.moderate())),
        }
    }
    x
}

#[test]
fn rms_norm_forward_and_backward() {
    require_gpu!();
    let mut rng = Rng(41);
    // row lengths off the 64-wide workgroup (1, 13, 67, 130) and on it (64);
    // odd row counts; one to three leading axes (dw's nested sums)
    for (lead, d) in [
        (vec![1], 1),
        (vec![3], 67),
        (vec![5, 3], 64),
        (vec![2, 3, 5], 13),
        (vec![11], 130),
        (vec![2, 1, 7], 5),
    ] {
        let rows: usize = lead.iter().product();
        let x = rows_of(&mut rng, rows, d);
        let mut w: Vec<f32> = (0..d).map(|_| rng.moderate()).collect();
        if d > 2 {
            w[1] = -0.0;
            w[2] = f32::from_bits(5);
        }
        let g = rows_of(&mut rng, rows, d);
        let e = rows_of(&mut rng, rows, d);
        let ((xc, xg), (wc, wg), (gc, gg), (ec, eg)) = (pair(&x), pair(&w), pair(&g), pair(&e));
        for eps in [1e-5, 0.0, 1e-38] {
            let what = format!("rms_norm {lead:?} x {d} eps {eps}");
            let (yc, rc) = xc.rms_norm(&wc, rows, d, eps).unwrap();
            let (yg, rg) = xg.rms_norm(&wg, rows, d, eps).unwrap();
            assert_bits(&what, &vals(&yc), &vals(&yg), &[&x]);
            assert_bits(&format!("{what}: rstd"), &vals(&rc), &vals(&rg), &[]);
            let bc = xc
                .rms_norm_backward(&wc, &rc, &gc, None, None, &lead, d, true, true)
                .unwrap();
            let bg = xg
                .rms_norm_backward(&wg, &rg, &gg, None, None, &lead, d, true, true)
                .unwrap();
            // dx added into an earlier gradient
            let ac = xc
                .rms_norm_backward(&wc, &rc, &gc, Some(&ec), None, &lead, d, true, false)
                .unwrap();
            let ag = xg
                .rms_norm_backward(&wg, &rg, &gg, Some(&eg), None, &lead, d, true, false)
                .unwrap();
            for (k, (c, g)) in [(bc.0, bg.0), (bc.1, bg.1), (ac.0, ag.0)]
                .into_iter()
                .enumerate()
            {
                let (c, g) = (c.unwrap(), g.unwrap());
                assert_bits(
                    &format!("{what}: backward output {k}"),
                    &vals(&c),
                    &vals(&g),
                    &[&x],
                );
            }
        }
    }
}

#[test]
fn swiglu_forward_and_backward() {
    require_gpu!();
    let mut rng = Rng(43);
    for n in [1, 63, 1000] {
        let mut gate = adversarial(&mut rng, n);
        // σ's interesting range: exp over- and underflow, ±0
        for (i, v) in gate.iter_mut().enumerate().filter(|(i, _)| i % 5 == 1) {
            *v = -110.0 + (i % 220) as f32;
        }
        let up = adversarial(&mut rng, n);
        let g = adversarial(&mut rng, n);
        let ((ac, ag), (uc, ug), (gc, gg)) = (pair(&gate), pair(&up), pair(&g));
        assert_bits(
            &format!("swiglu {n}"),
            &vals(&ac.swiglu(&uc).unwrap()),
            &vals(&ag.swiglu(&ug).unwrap()),
            &[&gate, &up],
        );
        let (dc, ec) = ac.swiglu_backward(&uc, &gc).unwrap();
        let (dg, eg) = ag.swiglu_backward(&ug, &gg).unwrap();
        assert_bits(
            &format!("swiglu {n}: d gate"),
            &vals(&dc),
            &vals(&dg),
            &[&gate, &up, &g],
        );
        assert_bits(
            &format!("swiglu {n}: d up"),
            &vals(&ec),
            &vals(&eg),
            &[&gate, &up, &g],
        );
    }
}

#[test]
fn rope_forward_and_backward() {
    require_gpu!();
    let mut rng = Rng(47);
    // (rows = blocks · t · heads, d): odd t, d = 2 (one pair), 130 (off the
    // workgroup); several heads move rows between the two layouts
    for (blocks, t, d, heads, real) in [
        (3, 5, 8, 1, true),
        (1, 7, 2, 1, false),
        (2, 3, 130, 1, true),
        (3, 1, 6, 1, false),
        (2, 5, 8, 3, true),
        (3, 4, 6, 2, false),
    ] {
        let rows = blocks * t * heads;
        let (cos, sin) = if real {
            tinyllm::nn::llama::rope_tables(t, d, 10000.0)
        } else {
            (adversarial(&mut rng, t * d), adversarial(&mut rng, t * d))
        };
        let x = rows_of(&mut rng, rows, d);
        let g = rows_of(&mut rng, rows, d);
        let ((xc, xg), (cc, cg), (sc, sg), (gc, gg)) = (pair(&x), pair(&cos), pair(&sin), pair(&g));
        let what = format!("rope {rows}x{d} t {t} heads {heads}");
        // the inputs line up with the outputs where no rows move
        let (xs, gs): (&[&[f32]], &[&[f32]]) = if heads == 1 {
            (&[&x], &[&g])
        } else {
            (&[], &[])
        };
        assert_bits(
            &what,
            &vals(&xc.rope(&cc, &sc, t, d, heads).unwrap()),
            &vals(&xg.rope(&cg, &sg, t, d, heads).unwrap()),
            xs,
        );
        assert_bits(
            &format!("{what}: backward"),
            &vals(&gc.rope_backward(&cc, &sc, t, d, heads).unwrap()),
            &vals(&gg.rope_backward(&cg, &sg, t, d, heads).unwrap()),
            gs,
        );
    }
}

#[test]
fn cross_entropy_forward_and_backward() {
    require_gpu!();
    let mut rng = Rng(53);
    for (rows, v) in [(7, 67), (5, 256), (1, 1), (9, 130), (3, 2), (45, 33)] {
        let mut x: Vec<f32> = (0..rows * v).map(|_| rng.unif(-30.0, 30.0)).collect();
        if rows >= 5 {
            for j in 0..v {
                x[j] = if j % 3 == 0 { f32::NEG_INFINITY } else { -0.0 }; // masked logits
                x[v + j] = -90.0 - 0.37 * j as f32; // tiny exps (subnormal)
                x[2 * v + j] = 1e30 * if j % 2 == 0 { 1.0 } else { -1.0 }; // huge
                x[3 * v + j] = f32::from_bits(1 + j as u32); // subnormal logits
            }
            x[4 * v] = f32::NAN;
        }
        let targets: Vec<u32> = (0..rows).map(|_| rng.below(v) as u32).collect();
        // in the random rows (from the sixth) the target holds much of the
        // mass without being the max (only there is its gradient a + gS·e
        // far from a, with an inexact product)
        for r in (5..rows).filter(|_| v > 1) {
            let row = &mut x[r * v..(r + 1) * v];
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) + (v as f32).ln();
            let t = targets[r] as usize;
            row[t] = m;
            row[(t + 1) % v] = m + rng.unif(0.05, 1.0);
        }
        let (xc, xg) = pair(&x);
        let what = format!("cross_entropy {rows}x{v}");
        let (lc, sc) = xc.cross_entropy(&targets, v).unwrap();
        let (lg, sg) = xg.cross_entropy(&targets, v).unwrap();
        assert_bits(&what, &vals(&lc), &vals(&lg), &[]);
        assert_bits(&format!("{what}: stats"), &vals(&sc), &vals(&sg), &[]);
        // the loss's upstream gradient: 1, a loss scale, ±0, subnormal, inf, NaN
        for seed in [1.0, 1024.0, 0.0, -0.0, 3e-42, f32::INFINITY, f32::NAN] {
            let (gc, gg) = pair(&[seed]);
            assert_bits(
                &format!("{what}: backward, seed {seed}"),
                &vals(&xc.cross_entropy_backward(&targets, &sc, &gc, v).unwrap()),
                &vals(&xg.cross_entropy_backward(&targets, &sg, &gg, v).unwrap()),
                &[&x],
            );
        }
    }
}

// ------------------------------------------------------------ plumbing ----

#[test]
fn reports_the_adapter() {
    require_gpu!();
    let name = tinyllm::backend::gpu::adapter_name().unwrap();
    let fma = tinyllm::backend::gpu::fma_mode().unwrap();
    let a = tinyllm::backend::gpu::adapter().unwrap();
    eprintln!(
        "GPU adapter: {name}; fma: {fma} (fused: {}); subnormals: {}; shaders: {}",
        a.fma_fused, a.subnormals, a.shaders
    );
    if a.shaders.starts_with("HLSL") {
        // HLSL has no f32 fma: the emulation whatever the probe found
        assert_eq!(fma, "soft");
    } else if std::env::var("TINYLLM_GPU_FMA").is_err() {
        // the route follows the probe's fma finding alone
        assert_eq!(fma == "native", a.fma_fused);
    }
    // each backend's hardened path, or WGSL with the reason
    let hardened = match a.backend.as_str() {
        "Vulkan" => "SPIR-V passthrough",
        "Metal" => "MSL passthrough",
        "Dx12" => "HLSL passthrough",
        _ => "WGSL compiled by the backend, not hardened (GL: WGSL to GLSL",
    };
    assert!(
        a.shaders.starts_with(hardened)
            || a.shaders
                .starts_with("WGSL compiled by the backend, not hardened ("),
        "{}: {}",
        a.backend,
        a.shaders
    );
    if std::env::var("TINYLLM_GPU_SHADERS").is_err() && name.contains("llvmpipe") {
        assert!(
            a.shaders.starts_with(hardened),
            "{}: {}",
            a.backend,
            a.shaders
        );
    }
    if name.contains("llvmpipe") {
        assert!(!a.fma_fused, "lavapipe's fma is not fused");
        assert_eq!(a.subnormals, "kept", "lavapipe keeps subnormals");
    }
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
    // RMSNorm's weight gradient sums 70001 / 2 rows per column in passes that
    // carry two levels of nested sums: (7, 5000, 2), a level ending mid-pass
    let (lead, d) = ([7usize, 5000], 2usize);
    let xs = &x[..70_000];
    let (cx, gx) = pair(xs);
    let w = [1.5f32, -0.75];
    let (cw, gw) = pair(&w);
    let (_, cr) = cx.rms_norm(&cw, 35_000, d, 1e-5).unwrap();
    let (_, gr) = gx.rms_norm(&gw, 35_000, d, 1e-5).unwrap();
    let want = cx
        .rms_norm_backward(&cw, &cr, &cx, None, None, &lead, d, false, true)
        .unwrap()
        .1
        .unwrap();
    let got = gx
        .rms_norm_backward(&gw, &gr, &gx, None, None, &lead, d, false, true)
        .unwrap()
        .1
        .unwrap();
    assert_bits(
        "rms_norm dw over 35000 rows",
        &vals(&want),
        &vals(&got),
        &[],
    );
    // the same added into an earlier gradient (the last pass adds it)
    let dw = |x: &Storage, w: &Storage, r: &Storage| {
        vals(
            &x.rms_norm_backward(w, r, x, None, Some(w), &lead, d, false, true)
                .unwrap()
                .1
                .unwrap(),
        )
    };
    assert_bits(
        "rms_norm dw over 35000 rows, added",
        &dw(&cx, &cw, &cr),
        &dw(&gx, &gw, &gr),
        &[],
    );
    // cross-entropy's mean folds 35000 row losses in passes
    let targets: Vec<u32> = (0..35_000).map(|i| (i % 2) as u32).collect();
    let (lc, _) = cx.cross_entropy(&targets, 2).unwrap();
    let (lg, _) = gx.cross_entropy(&targets, 2).unwrap();
    assert_bits("cross_entropy over 35000 rows", &vals(&lc), &vals(&lg), &[]);
    // a vocabulary row that long is refused on lavapipe, like softmax's
    let one: Vec<u32> = vec![5];
    let ce = g.cross_entropy(&one, n);
    if tinyllm::backend::gpu::adapter_name()
        .unwrap()
        .contains("llvmpipe")
    {
        let e = ce.unwrap_err().to_string();
        assert!(e.contains("loop limit"), "{e}");
    } else {
        let want = vals(&c.cross_entropy(&one, n).unwrap().0);
        assert_bits(
            "cross_entropy row of 70001",
            &want,
            &vals(&ce.unwrap().0),
            &[],
        );
    }
}

// ------------------------------------- the hardware matmul's tiling ----

/// Global loads and fmas of a stretch of a kernel, read off naga's IR.
#[derive(Clone, Copy, Debug, Default)]
struct Work {
    /// Storage-buffer loads, at most (both arms of every `if` counted).
    loads: usize,
    /// Fused multiply-adds, at least (the poorer arm of every `if`; a
    /// `fma_c` call is one, a vector `fma` one per lane).
    fmas: usize,
}

struct Ir {
    module: naga::Module,
    info: naga::valid::ModuleInfo,
}

impl Ir {
    fn new(src: &str) -> Ir {
        let module = naga::front::wgsl::parse_str(src).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::default(),
        )
        .validate(&module)
        .unwrap();
        Ir { module, info }
    }

    /// Whether `e` (in `f`) points into a storage buffer.
    fn is_storage(&self, f: &naga::Function, mut e: naga::Handle<naga::Expression>) -> bool {
        loop {
            match f.expressions[e] {
                naga::Expression::Access { base, .. }
                | naga::Expression::AccessIndex { base, .. } => e = base,
                naga::Expression::GlobalVariable(g) => {
                    return matches!(
                        self.module.global_variables[g].space,
                        naga::AddressSpace::Storage { .. }
                    )
                }
                _ => return false,
            }
        }
    }

    /// The work of `block` in `f` (whose analysis is `fi`), calls followed
    /// (except into `fma_c`, one fma, and into the math library's `m_*`,
    /// none). A loop inside it panics: its trip count is unknown here.
    fn block(
        &self,
        f: &naga::Function,
        fi: &naga::valid::FunctionInfo,
        block: &naga::Block,
    ) -> Work {
        use naga::Statement as S;
        let mut w = Work::default();
        for st in block.iter() {
            match st {
                S::Emit(range) => {
                    for e in range.clone() {
                        match f.expressions[e] {
                            naga::Expression::Load { pointer } if self.is_storage(f, pointer) => {
                                w.loads += 1
                            }
                            naga::Expression::Math {
                                fun: naga::MathFunction::Fma,
                                ..
                            } => {
                                w.fmas += match fi[e].ty.inner_with(&self.module.types) {
                                    naga::TypeInner::Vector { size, .. } => *size as usize,
                                    _ => 1,
                                }
                            }
                            _ => {}
                        }
                    }
                }
                S::Block(b) => {
                    let x = self.block(f, fi, b);
                    w.loads += x.loads;
                    w.fmas += x.fmas;
                }
                S::If { accept, reject, .. } => {
                    let (x, y) = (self.block(f, fi, accept), self.block(f, fi, reject));
                    w.loads += x.loads + y.loads;
                    w.fmas += x.fmas.min(y.fmas);
                }
                S::Switch { cases, .. } => {
                    let ws: Vec<Work> = cases.iter().map(|c| self.block(f, fi, &c.body)).collect();
                    w.loads += ws.iter().map(|x| x.loads).sum::<usize>();
                    w.fmas += ws.iter().map(|x| x.fmas).min().unwrap_or(0);
                }
                S::Loop { .. } => panic!("a loop of unknown trip count inside the counted stretch"),
                S::Call { function, .. } => {
                    let callee = &self.module.functions[*function];
                    let name = callee.name.as_deref().unwrap_or("");
                    if name == "fma_c" {
                        w.fmas += 1;
                    } else if name.starts_with("m_") {
                        // the math library: functions of their arguments
                        // alone (no buffer loads), their fmas not counted
                    } else {
                        let x = self.block(callee, &self.info[*function], &callee.body);
                        w.loads += x.loads;
                        w.fmas += x.fmas;
                    }
                }
                _ => {}
            }
        }
        w
    }

    /// The k loop of entry point `entry`: the innermost loop doing fmas, and
    /// the loop around it if any (then the inner one runs `TILE_K` times per
    /// outer iteration). Returns the work of one outer iteration (or of one
    /// iteration, without an outer loop) and the inner loop's trip count.
    fn k_loop(&self, entry: &str) -> (Work, usize) {
        let i = self
            .module
            .entry_points
            .iter()
            .position(|e| e.name == entry)
            .unwrap();
        let f = &self.module.entry_points[i].function;
        let fi = self.info.get_entry_point(i);
        // (outer loop body, inner loop body), the first loop nest found
        fn find<'a>(
            b: &'a naga::Block,
            outer: Option<&'a naga::Block>,
        ) -> Option<(Option<&'a naga::Block>, &'a naga::Block)> {
            for st in b.iter() {
                let hit = match st {
                    naga::Statement::Loop { body, .. } => {
                        // the innermost loop of the nest
                        find(body, Some(body)).or(Some((outer, body)))
                    }
                    naga::Statement::Block(x) => find(x, outer),
                    naga::Statement::If { accept, reject, .. } => {
                        find(accept, outer).or_else(|| find(reject, outer))
                    }
                    _ => None,
                };
                if hit.is_some() {
                    return hit;
                }
            }
            None
        }
        let (outer, inner) = find(&f.body, None).expect("no loop");
        let per_step = self.block(f, fi, inner);
        let Some(outer) = outer else {
            return (per_step, 1);
        };
        let tile_k = self
            .module
            .constants
            .iter()
            .find(|(_, c)| c.name.as_deref() == Some("TILE_K"))
            .map(|(_, c)| match self.module.global_expressions[c.init] {
                naga::Expression::Literal(naga::Literal::U32(v)) => v as usize,
                ref e => panic!("TILE_K is {e:?}"),
            })
            .expect("a loop nest needs the inner trip count TILE_K");
        // the outer body with the inner loop counted TILE_K times
        (self.around(f, fi, outer, inner, tile_k), tile_k)
    }

    /// The work of `block`, the loop whose body is `inner` counted `times`.
    fn around(
        &self,
        f: &naga::Function,
        fi: &naga::valid::FunctionInfo,
        block: &naga::Block,
        inner: &naga::Block,
        times: usize,
    ) -> Work {
        let mut w = Work::default();
        for st in block.iter() {
            let x = match st {
                naga::Statement::Loop { body, .. } if std::ptr::eq(body, inner) => {
                    let x = self.block(f, fi, inner);
                    Work {
                        loads: x.loads * times,
                        fmas: x.fmas * times,
                    }
                }
                naga::Statement::Block(b) => self.around(f, fi, b, inner, times),
                naga::Statement::If { accept, reject, .. } => {
                    let (x, y) = (
                        self.around(f, fi, accept, inner, times),
                        self.around(f, fi, reject, inner, times),
                    );
                    Work {
                        loads: x.loads + y.loads,
                        fmas: x.fmas.min(y.fmas),
                    }
                }
                _ => self.block(f, fi, &naga::Block::from_vec(vec![st.clone()])),
            };
            w.loads += x.loads;
            w.fmas += x.fmas;
        }
        w
    }
}

/// The hardware matmul stages its operand tiles in workgroup memory: in the
/// shipped WGSL, the k loop of `matmul_tiled` issues at most one global load
/// per 8 fmas (counted in naga's IR: both arms of a 16-bit operand's load
/// counted, the poorer arm of the format's fma). The register-tile kernel
/// for lavapipe loads straight from the buffers, and would fail this.
#[test]
fn matmul_tiled_loads_at_most_one_global_value_per_8_fmas() {
    let f = tinyllm::backend::gpu_families()
        .into_iter()
        .find(|f| f.name == "matmul")
        .unwrap();
    for native in [false, true] {
        let ir = Ir::new(&tinyllm::backend::gpu::pipelines::compose(f, native));
        let (w, tile_k) = ir.k_loop("matmul_tiled");
        eprintln!(
            "matmul_tiled: {} global loads per {} fmas (TILE_K {tile_k})",
            w.loads, w.fmas
        );
        assert!(
            w.fmas > 0 && w.loads * 8 <= w.fmas,
            "matmul_tiled: {w:?} per tile of {tile_k} terms"
        );
        let (s, _) = ir.k_loop("matmul");
        eprintln!(
            "matmul (software variant): {} global loads per {} fmas",
            s.loads, s.fmas
        );
        assert!(
            s.loads * 8 > s.fmas,
            "the count should see the untiled kernel's loads: {s:?}"
        );
    }
}

/// Every hardware kernel a capstone training step launches (`--preset
/// capstone`: micro-batch 8 of context 512) runs at least `MIN_LANES`
/// invocations per workgroup — per row block for the row kernels, per
/// 64×64 output block for the products: the workgroup sizes are the shipped
/// WGSL's (naga), the grids the launchers'.
#[test]
fn hardware_kernels_launch_at_least_64_invocations_per_workgroup_at_the_capstone() {
    use tinyllm::backend::gpu::variant::MIN_LANES;
    use tinyllm::backend::launches::{step_dispatches, StepShapes};
    let cfg = tinyllm::nn::llama::LlamaConfig::preset("capstone").unwrap();
    let micro_batch = 8;
    let s = StepShapes {
        tokens: micro_batch * cfg.context,
        d: cfg.d_model,
        hidden: cfg.hidden,
        heads: cfg.n_heads,
        t: cfg.context,
        vocab: cfg.vocab_size,
    };
    let mut irs = std::collections::HashMap::new();
    let mut failures = Vec::new();
    for variant in [Kernels::Hardware, Kernels::Software] {
        for dispatch in step_dispatches(variant, s) {
            let family = dispatch.kernel.family;
            let ir = irs.entry(family.name).or_insert_with(|| {
                Ir::new(&tinyllm::backend::gpu::pipelines::compose(family, false))
            });
            let ep = ir
                .module
                .entry_points
                .iter()
                .find(|e| e.name == dispatch.kernel.entry)
                .unwrap();
            let lanes: u32 = ep.workgroup_size.iter().product();
            let (x, y, z) = dispatch.groups;
            eprintln!(
                "{}: {} ({}::{}): {x}x{y}x{z} workgroups of {lanes}",
                variant.name(),
                dispatch.what,
                family.name,
                dispatch.kernel.entry
            );
            if variant == Kernels::Hardware && lanes < MIN_LANES {
                failures.push(format!(
                    "{}: {} invocations per workgroup",
                    dispatch.kernel.entry, lanes
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}
