//! GPU vs CPU parity, bit for bit, for every backend primitive.
//!
//! Each test runs the same primitive on `Device::Cpu` (the reference) and
//! `Device::Gpu` with random shapes and adversarial values (±0, subnormals,
//! ±inf, NaN, rounding ties, the fp16 overflow boundary, huge and tiny
//! exponents) and compares `to_bits()` of every output. The one relaxation:
//! a NaN equals a NaN of any payload or sign (IEEE leaves NaN payloads to the
//! implementation; the contract only promises NaN-ness).
//!
//! Without a GPU adapter the tests print "no GPU adapter; skipping" and pass,
//! unless `TINYLLM_REQUIRE_GPU=1` is set (as in CI with lavapipe): then they fail.
//! Shapes are small: lavapipe is a software device.

mod common;
use common::Rng;
use tinyllm::backend::round::{self, Format};
use tinyllm::backend::{
    AdamWConsts, BinaryLayout, BinaryOp, Device, MatmulDims, ReduceOp, Storage, UnaryOp,
};

macro_rules! require_gpu {
    () => {
        if !tinyllm::testing::gpu_available() {
            return;
        }
    };
}

// ------------------------------------------------------------ helpers ----

/// Values every primitive must survive.
fn specials() -> Vec<f32> {
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

/// `n` values: specials, any-bit-pattern values (all exponents), moderate ones.
fn adversarial(rng: &mut Rng, n: usize) -> Vec<f32> {
    let sp = specials();
    (0..n)
        .map(|i| match i % 4 {
            0 => sp[rng.below(sp.len())],
            1 => f32::from_bits(rng.next() as u32),
            2 => rng.moderate(),
            _ => rng.unif(-12.0, 12.0),
        })
        .collect()
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

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

fn vals(s: &Storage) -> Vec<f32> {
    s.to_vec_f32().unwrap()
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![0; shape.len()];
    let mut acc = 1;
    for d in (0..shape.len()).rev() {
        st[d] = acc;
        acc *= shape[d];
    }
    st
}

/// Strides of `shape` within a tensor of `full` shape (0 where broadcast).
fn broadcast_strides(part: &[usize], full: &[usize]) -> Vec<usize> {
    let pad = full.len() - part.len();
    let own = contiguous_strides(part);
    (0..full.len())
        .map(|d| {
            if d < pad || part[d - pad] == 1 {
                0
            } else {
                own[d - pad]
            }
        })
        .collect()
}

// ------------------------------------------------------- elementwise ----

#[test]
fn unary_every_op() {
    require_gpu!();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut x = adversarial(&mut rng, 1500);
    x.extend(specials());
    // exp/log/sigmoid territory: dense sweeps around the interesting ranges
    for i in 0..200 {
        x.push(-110.0 + i as f32 * 1.0037);
        x.push(f32::from_bits(0x0000_1000 + i * 0x0003_0001)); // subnormals
    }
    let (c, g) = pair(&x);
    // every op (the enum's own list), plus more scalars for the scalar ops
    let mut ops = UnaryOp::ALL.to_vec();
    ops.extend([
        UnaryOp::AddScalar(0.1),
        UnaryOp::AddScalar(-1e-40),
        UnaryOp::MulScalar(-3.0),
        UnaryOp::MulScalar(1e-30),
        UnaryOp::DivScalar(7.0),
        UnaryOp::DivScalar(1e-39),
        UnaryOp::DivScalar(0.0),
        UnaryOp::RDivScalar(1.0),
        UnaryOp::RDivScalar(-3e38),
    ]);
    for op in ops {
        let a = vals(&c.unary(op).unwrap());
        let b = vals(&g.unary(op).unwrap());
        assert_bits(&format!("{op:?}"), &a, &b, &[&x]);
    }
}

#[test]
fn unary_on_empty_and_single() {
    require_gpu!();
    for data in [vec![], vec![-0.0f32]] {
        let (c, g) = pair(&data);
        for op in [UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Round(Format::Fp16)] {
            assert_bits(
                "tiny unary",
                &vals(&c.unary(op).unwrap()),
                &vals(&g.unary(op).unwrap()),
                &[],
            );
        }
    }
}

#[test]
fn binary_every_op_with_broadcasting() {
    require_gpu!();
    let mut rng = Rng(42);
    // (lhs shape, rhs shape) -> broadcast to the elementwise max
    let cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![257], vec![257]),
        (vec![3, 1, 5], vec![1, 4, 5]),
        (vec![4, 6], vec![6]),
        (vec![4, 6], vec![4, 1]),
        (vec![5], vec![1]),
        (vec![], vec![]),
        (vec![2, 1, 3, 1, 2, 3], vec![1, 2, 1, 2, 2, 1]),
        (vec![1, 1], vec![3, 7]),
        (vec![0, 3], vec![1, 3]),
    ];
    let ops = BinaryOp::ALL;
    for (ls, rs) in cases {
        let nd = ls.len().max(rs.len());
        let pad = |s: &[usize]| {
            let mut v = vec![1; nd - s.len()];
            v.extend_from_slice(s);
            v
        };
        let (lp, rp) = (pad(&ls), pad(&rs));
        // numpy broadcasting: a size-1 dimension takes the other's size (even 0)
        let shape: Vec<usize> = (0..nd)
            .map(|d| if lp[d] == 1 { rp[d] } else { lp[d] })
            .collect();
        let layout = BinaryLayout {
            shape: shape.clone(),
            lhs_strides: broadcast_strides(&lp, &shape),
            rhs_strides: broadcast_strides(&rp, &shape),
        };
        let a = adversarial(&mut rng, ls.iter().product());
        let mut b = adversarial(&mut rng, rs.iter().product());
        // equal pairs matter for Eq, Maximum(±0) and x - x
        for (i, v) in b.iter_mut().enumerate() {
            if i % 5 == 0 && i < a.len() {
                *v = if i % 10 == 0 { a[i] } else { -a[i] };
            }
        }
        let (ac, ag) = pair(&a);
        let (bc, bg) = pair(&b);
        for op in ops {
            let c = vals(&ac.binary(&bc, op, &layout).unwrap());
            let g = vals(&ag.binary(&bg, op, &layout).unwrap());
            assert_bits(&format!("{op:?} {ls:?} with {rs:?}"), &c, &g, &[]);
        }
    }
}

#[test]
fn binary_all_special_pairs() {
    require_gpu!();
    // every (special, special) pair, contiguous
    let sp = specials();
    let mut a = Vec::new();
    let mut b = Vec::new();
    for &x in &sp {
        for &y in &sp {
            a.push(x);
            b.push(y);
        }
    }
    let layout = BinaryLayout {
        shape: vec![a.len()],
        lhs_strides: vec![1],
        rhs_strides: vec![1],
    };
    let (ac, ag) = pair(&a);
    let (bc, bg) = pair(&b);
    for op in BinaryOp::ALL {
        let c = vals(&ac.binary(&bc, op, &layout).unwrap());
        let g = vals(&ag.binary(&bg, op, &layout).unwrap());
        assert_bits(&format!("{op:?} special pairs"), &c, &g, &[&a, &b]);
    }
}

#[test]
fn division_sweep() {
    require_gpu!();
    // random operands of every exponent: the crate's div, not the device's
    let mut rng = Rng(7);
    let a: Vec<f32> = (0..4000)
        .map(|_| f32::from_bits(rng.next() as u32))
        .collect();
    let b: Vec<f32> = (0..4000)
        .map(|i| {
            if i % 3 == 0 {
                rng.moderate()
            } else {
                f32::from_bits(rng.next() as u32)
            }
        })
        .collect();
    let layout = BinaryLayout {
        shape: vec![a.len()],
        lhs_strides: vec![1],
        rhs_strides: vec![1],
    };
    let (ac, ag) = pair(&a);
    let (bc, bg) = pair(&b);
    let c = vals(&ac.binary(&bc, BinaryOp::Div, &layout).unwrap());
    let g = vals(&ag.binary(&bg, BinaryOp::Div, &layout).unwrap());
    assert_bits("div sweep", &c, &g, &[&a, &b]);
}

// ------------------------------------------------------------ rounding ----

/// Stratified: every f32 exponent with mantissas at and around both formats'
/// ties, the fp16 overflow boundary, fp16 and f32 subnormals.
#[test]
fn rounding_stratified() {
    require_gpu!();
    let mut x = Vec::new();
    let mantissas: [u32; 16] = [
        0, 1, 0x7fff, 0x8000, 0x8001, 0x1_8000, 0x1_7fff, 0x0fff, 0x1000, 0x1001, 0x3000, 0x2fff,
        0x7f_ffff, 0x7f_8000, 0x7f_f000, 0x40_0000,
    ];
    for e in 0..=255u32 {
        for &m in &mantissas {
            for s in [0u32, 0x8000_0000] {
                x.push(f32::from_bits(s | (e << 23) | m));
            }
        }
    }
    // around 65504 / 65520 (fp16 overflow) bit by bit
    for b in 0x477f_e000u32..0x4780_0010 {
        if b % 7 == 0 || (0x477f_efe0..0x477f_f020).contains(&b) {
            x.push(f32::from_bits(b));
            x.push(-f32::from_bits(b));
        }
    }
    // fp16 subnormal range: k * 2^-25 (odd k are ties) and neighbours
    for k in 0..2100u32 {
        let v = k as f32 * 2f32.powi(-25);
        x.push(v);
        x.push(f32::from_bits(v.to_bits() + 1));
        x.push(-v);
    }
    let (c, g) = pair(&x);
    for f in [Format::Bf16, Format::Fp16] {
        let a = vals(&c.unary(UnaryOp::Round(f)).unwrap());
        let b = vals(&g.unary(UnaryOp::Round(f)).unwrap());
        assert_bits(&format!("round {f}"), &a, &b, &[&x]);
        // and the CPU side is the round.rs function itself
        for (i, &v) in x.iter().enumerate() {
            assert!(same(a[i], round::round_f32(v, f)));
        }
    }
}

// ----------------------------------------------------------- reduction ----

#[test]
fn reduce_sum_and_max() {
    require_gpu!();
    let mut rng = Rng(3);
    let shapes = [
        (1, 1, 1),
        (1, 37, 1),
        (3, 5, 7),
        (2, 1, 9),
        (4, 0, 3),
        (1, 300, 2),
        (7, 3, 1),
        (0, 4, 4),
    ];
    for (o, r, i) in shapes {
        for mode in 0..3 {
            let x: Vec<f32> = (0..o * r * i)
                .map(|_| match mode {
                    0 => rng.moderate(),
                    1 => [0.0, -0.0, 1e-45, -1e-45][rng.below(4)], // signed zeros, subnormals
                    _ => adversarial(&mut rng, 1)[0],
                })
                .collect();
            let (c, g) = pair(&x);
            for op in ReduceOp::ALL {
                assert_bits(
                    &format!("{op:?} {o}x{r}x{i} mode {mode}"),
                    &vals(&c.reduce(op, o, r, i).unwrap()),
                    &vals(&g.reduce(op, o, r, i).unwrap()),
                    &[],
                );
            }
        }
    }
}

#[test]
fn softmax_forward_and_backward() {
    require_gpu!();
    let mut rng = Rng(11);
    for (rows, n) in [(1, 1), (5, 13), (3, 64), (2, 257), (4, 2)] {
        let mut x: Vec<f32> = (0..rows * n).map(|_| rng.unif(-20.0, 20.0)).collect();
        // rows with tiny exponentials (subnormal e^x), -inf, NaN, ±0, all-equal
        if rows >= 3 {
            for j in 0..n {
                x[j] = -90.0 - 0.37 * j as f32;
                x[n + j] = if j % 3 == 0 { f32::NEG_INFINITY } else { -0.0 };
            }
            x[2 * n] = f32::NAN;
        }
        if rows >= 4 {
            for j in 0..n {
                x[3 * n + j] = 1.5;
            }
        }
        let (c, g) = pair(&x);
        let gr: Vec<f32> = (0..rows * n).map(|_| rng.moderate()).collect();
        let (gc, gg) = pair(&gr);
        // plain, scaled, and attention's scaled + causal (masked keys are −inf
        // whatever they hold, so the NaN and −inf rows also meet the mask)
        for (scale, causal) in [(1.0, false), (0.125, false), (0.125, true), (0.3, true)] {
            let what = format!("softmax {rows}x{n} scale {scale} causal {causal}");
            let yc = c.softmax_rows(rows, n, scale, causal).unwrap();
            let yg = g.softmax_rows(rows, n, scale, causal).unwrap();
            assert_bits(&what, &vals(&yc), &vals(&yg), &[&x]);
            assert_bits(
                &format!("{what}: backward"),
                &vals(&yc.softmax_rows_backward(&gc, rows, n, scale).unwrap()),
                &vals(&yg.softmax_rows_backward(&gg, rows, n, scale).unwrap()),
                &[],
            );
        }
    }
}

/// Rows with trailing −inf (a causal mask's shape), which the CPU fills with
/// +0 without computing them: every tail length, −inf also in the middle, a
/// whole −inf row, +inf and NaN maxima with −inf tails.
#[test]
fn softmax_of_causally_masked_rows() {
    require_gpu!();
    let mut rng = Rng(13);
    let n = 11;
    let mut x = Vec::new();
    for i in 0..n {
        // row i: the causal mask of query i (entries past i are −inf)
        x.extend((0..n).map(|j| {
            if j > i {
                f32::NEG_INFINITY
            } else {
                rng.unif(-30.0, 30.0)
            }
        }));
    }
    let mut extra = |row: Vec<f32>| x.extend(row);
    let mut mid = vec![f32::NEG_INFINITY; n];
    (mid[0], mid[3], mid[5]) = (-1.0, 2.0, -0.0);
    extra(mid);
    extra(vec![f32::NEG_INFINITY; n]);
    let mut inf = vec![f32::NEG_INFINITY; n];
    (inf[0], inf[1]) = (f32::INFINITY, 3.0);
    extra(inf);
    let mut nan = vec![f32::NEG_INFINITY; n];
    (nan[0], nan[2]) = (1.0, f32::NAN);
    extra(nan);
    let rows = x.len() / n;
    let (c, g) = pair(&x);
    let yc = c.softmax_rows(rows, n, 1.0, false).unwrap();
    assert_bits(
        "masked softmax",
        &vals(&yc),
        &vals(&g.softmax_rows(rows, n, 1.0, false).unwrap()),
        &[&x],
    );
    // and the CPU's shortcut is the full computation: the tails are +0
    let y = vals(&yc);
    for i in 0..n - 1 {
        assert!(y[i * n + i + 1..(i + 1) * n]
            .iter()
            .all(|v| v.to_bits() == 0));
    }
}

#[test]
fn sum_squares_chunks() {
    require_gpu!();
    let mut rng = Rng(5);
    let a: Vec<f32> = (0..3000).map(|_| rng.moderate()).collect();
    let b: Vec<f32> = vec![1e-30, 3.0e19]; // tiny squares underflow, big ones don't
    let e: Vec<f32> = vec![];
    let d: Vec<f32> = (0..1025).map(|_| rng.unif(-1e-20, 1e-20)).collect(); // subnormal squares
    let (ac, ag) = pair(&a);
    let (bc, bg) = pair(&b);
    let (ec, eg) = pair(&e);
    let (dc, dg) = pair(&d);
    let c = Storage::sum_squares(&[&ac, &bc, &ec, &dc]).unwrap();
    let g = Storage::sum_squares(&[&ag, &bg, &eg, &dg]).unwrap();
    assert_bits("sum_squares", &[c], &[g], &[]);
    let c = Storage::sum_squares(&[&dc]).unwrap();
    let g = Storage::sum_squares(&[&dg]).unwrap();
    assert_bits("sum_squares subnormal", &[c], &[g], &[]);
}

// ---------------------------------------------------------------- matmul ----

#[test]
fn matmul_all_layouts_and_rounding() {
    require_gpu!();
    let mut rng = Rng(0xfeed);
    // (batch, m, k, n, a broadcast over batch, b broadcast over batch)
    let shapes = [
        (1, 1, 1, 1, false, false),
        (1, 5, 7, 3, false, false),
        (2, 33, 17, 35, false, false),
        (3, 4, 9, 1, true, false),
        (2, 1, 9, 6, false, true),
        (1, 6, 0, 5, false, false),
        (2, 8, 64, 8, false, false),
        (1, 37, 3, 1, false, false),
        (1, 0, 4, 3, false, false),
    ];
    for (batch, m, k, n, bca, bcb) in shapes {
        for ta in [false, true] {
            for tb in [false, true] {
                for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
                    let na = if bca { 1 } else { batch };
                    let nb = if bcb { 1 } else { batch };
                    let mut a: Vec<f32> = (0..na * m * k).map(|_| rng.moderate()).collect();
                    let b: Vec<f32> = (0..nb * k * n).map(|_| rng.moderate()).collect();
                    // a few adversarial operands (subnormal products, ties, inf)
                    for (i, v) in a.iter_mut().enumerate() {
                        if i % 11 == 3 {
                            *v = specials()[i % specials().len()];
                        }
                    }
                    let dims = MatmulDims {
                        batch,
                        m,
                        k,
                        n,
                        trans_a: ta,
                        trans_b: tb,
                        a_batch_stride: if bca { 0 } else { m * k },
                        b_batch_stride: if bcb { 0 } else { k * n },
                    };
                    let (ac, ag) = pair(&a);
                    let (bc, bg) = pair(&b);
                    let c = vals(&ac.matmul(&bc, dims, round).unwrap());
                    let g = vals(&ag.matmul(&bg, dims, round).unwrap());
                    assert_bits(&format!("matmul {dims:?} {round:?}"), &c, &g, &[]);
                }
            }
        }
    }
}

/// The kernel's specialisations (format x trans_a x trans_b, one pipeline each)
/// on shapes that cross its 64x64 workgroup tile and 8x8 invocation tile
/// raggedly, with a long k (the accumulator is carried through every p), and
/// batch broadcasting.
#[test]
fn matmul_specialisations_ragged_tiles_long_k() {
    require_gpu!();
    let mut rng = Rng(0x7a11);
    // (batch, m, k, n, a broadcast, b broadcast)
    let shapes = [
        (1, 65, 300, 71, false, false),
        (2, 9, 1031, 130, false, true),
        (1, 130, 5, 7, true, false),
        (3, 64, 64, 64, false, false),
        (1, 1, 777, 129, false, false),
        (1, 127, 2, 1, false, false),
    ];
    for (batch, m, k, n, bca, bcb) in shapes {
        for ta in [false, true] {
            for tb in [false, true] {
                for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
                    let na = if bca { 1 } else { batch };
                    let nb = if bcb { 1 } else { batch };
                    let mut a: Vec<f32> = (0..na * m * k).map(|_| rng.moderate()).collect();
                    let b: Vec<f32> = (0..nb * k * n).map(|_| rng.moderate()).collect();
                    for (i, v) in a.iter_mut().enumerate() {
                        if i % 97 == 5 {
                            *v = specials()[i % specials().len()];
                        }
                    }
                    let dims = MatmulDims {
                        batch,
                        m,
                        k,
                        n,
                        trans_a: ta,
                        trans_b: tb,
                        a_batch_stride: if bca { 0 } else { m * k },
                        b_batch_stride: if bcb { 0 } else { k * n },
                    };
                    let (ac, ag) = pair(&a);
                    let (bc, bg) = pair(&b);
                    let c = vals(&ac.matmul(&bc, dims, round).unwrap());
                    let g = vals(&ag.matmul(&bg, dims, round).unwrap());
                    assert_bits(&format!("matmul {dims:?} {round:?}"), &c, &g, &[]);
                }
            }
        }
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

/// Short k with operands of every bit pattern: each output is one or two
/// general fmas (`fma(a1, b1, fma(a0, b0, 0))`), so this checks the kernels'
/// fused multiply-add itself — including the integer emulation used where the
/// device's `fma` is not fused — on specials, subnormals, overflow and ties.
#[test]
fn matmul_random_bits_short_k() {
    require_gpu!();
    let mut rng = Rng(0xabcdef);
    let sp = specials();
    for k in [1usize, 2, 3] {
        let (m, n) = (40, 40);
        let mut pick = |i: usize| match i % 3 {
            0 => f32::from_bits(rng.next() as u32),
            1 => sp[rng.below(sp.len())],
            _ => {
                // exponents near the subnormal and overflow edges
                let e = [0u32, 1, 2, 60, 63, 64, 65, 190, 191, 192, 253, 254][rng.below(12)];
                f32::from_bits((rng.next() as u32 & 0x807f_ffff) | (e << 23))
            }
        };
        let a: Vec<f32> = (0..m * k).map(&mut pick).collect();
        let b: Vec<f32> = (0..k * n).map(&mut pick).collect();
        let dims = MatmulDims {
            batch: 1,
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
            a_batch_stride: 0,
            b_batch_stride: 0,
        };
        let (ac, ag) = pair(&a);
        let (bc, bg) = pair(&b);
        let c = vals(&ac.matmul(&bc, dims, None).unwrap());
        let g = vals(&ag.matmul(&bg, dims, None).unwrap());
        assert_bits(&format!("matmul random bits k={k}"), &c, &g, &[]);
    }
}

/// The contract's fma on its own, on 20,000 triples: a batched `(1, 2) @ (2, 1)`
/// matmul with A = [c, a] and B = [1, b] computes `fma(a, b, fma(c, 1, +0))`,
/// i.e. `fma(a, b, c)` (c == -0 becomes +0). Triples are built to stress
/// the single rounding: near-total cancellation, ties, subnormal results,
/// overflow, specials. Checked against `f32::mul_add` and the CPU backend.
#[test]
fn fused_multiply_add_sweep() {
    require_gpu!();
    let mut rng = Rng(0x5eed);
    let sp = specials();
    let n = 20_000;
    let mut a = Vec::with_capacity(2 * n);
    let mut b = Vec::with_capacity(2 * n);
    let mut want = Vec::with_capacity(n);
    for i in 0..n {
        let x = if i % 7 == 0 {
            sp[rng.below(sp.len())]
        } else {
            rng.moderate()
        };
        let y = match i % 5 {
            0 => f32::from_bits(rng.next() as u32 & 0xbfff_ffff), // any small-ish exponent
            1 => sp[rng.below(sp.len())],
            _ => rng.moderate(),
        };
        let c = match i % 6 {
            // cancel the rounded product: only the product's rounding error survives
            0 | 1 => -(x * y),
            2 => -(x * y) * (1.0 + 2f32.powi(-20)),
            3 => f32::from_bits(rng.next() as u32),
            4 => sp[rng.below(sp.len())],
            _ => rng.moderate() * 2f32.powi(rng.below(60) as i32 - 30),
        };
        let c = if c == 0.0 { 0.0 } else { c }; // -0 would become +0 in the first step
        a.extend_from_slice(&[c, x]);
        b.extend_from_slice(&[1.0, y]);
        want.push(x.mul_add(y, c));
    }
    let dims = MatmulDims {
        batch: n,
        m: 1,
        k: 2,
        n: 1,
        trans_a: false,
        trans_b: false,
        a_batch_stride: 2,
        b_batch_stride: 2,
    };
    let (ac, ag) = pair(&a);
    let (bc, bg) = pair(&b);
    let c = vals(&ac.matmul(&bc, dims, None).unwrap());
    let g = vals(&ag.matmul(&bg, dims, None).unwrap());
    assert_bits("fma sweep: cpu vs mul_add", &want, &c, &[]);
    assert_bits("fma sweep: gpu vs cpu", &c, &g, &[]);
}

// ----------------------------------------------------------- data moves ----

#[test]
fn strided_copy_views() {
    require_gpu!();
    let mut rng = Rng(17);
    let x = adversarial(&mut rng, 720);
    let (c, g) = pair(&x);
    // (shape, strides, offset)
    let cases: Vec<(Vec<usize>, Vec<usize>, usize)> = vec![
        (vec![720], vec![1], 0),
        (vec![6, 120], vec![120, 1], 0),
        (vec![120, 6], vec![1, 120], 0),          // transpose
        (vec![3, 4], vec![20, 2], 7),             // slice with step and offset
        (vec![2, 3, 4, 5], vec![1, 2, 6, 24], 0), // permute
        (vec![4, 5], vec![0, 1], 100),            // broadcast expand
        (vec![2, 2, 2, 2, 2, 2], vec![1, 2, 4, 8, 16, 32], 5),
        (vec![1, 1, 1], vec![0, 0, 0], 719),
        (vec![0, 5], vec![5, 1], 0),
        (vec![], vec![], 3),
    ];
    for (shape, strides, off) in cases {
        assert_bits(
            &format!("strided_copy {shape:?} {strides:?} +{off}"),
            &vals(&c.strided_copy(&shape, &strides, off).unwrap()),
            &vals(&g.strided_copy(&shape, &strides, off).unwrap()),
            &[],
        );
    }
}

#[test]
fn concat_parts() {
    require_gpu!();
    let mut rng = Rng(23);
    for (outer, sizes, inner) in [
        (3usize, vec![2usize, 0, 5, 1], 4usize),
        (1, vec![7], 1),
        (5, vec![1, 1], 3),
    ] {
        let parts: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&s| adversarial(&mut rng, outer * s * inner))
            .collect();
        let pc: Vec<Storage> = parts.iter().map(|p| pair(p).0).collect();
        let pg: Vec<Storage> = parts.iter().map(|p| pair(p).1).collect();
        let rc: Vec<&Storage> = pc.iter().collect();
        let rg: Vec<&Storage> = pg.iter().collect();
        assert_bits(
            &format!("concat {outer} {sizes:?} {inner}"),
            &vals(&Storage::concat(&rc, outer, &sizes, inner).unwrap()),
            &vals(&Storage::concat(&rg, outer, &sizes, inner).unwrap()),
            &[],
        );
    }
}

#[test]
fn gather_and_scatter_rows() {
    require_gpu!();
    let mut rng = Rng(29);
    let (v, d) = (11, 6);
    let table = adversarial(&mut rng, v * d);
    let (tc, tg) = pair(&table);
    // repeated ids, unused rows, out of order
    let ids: Vec<u32> = vec![3, 0, 3, 10, 7, 3, 0, 5, 5, 5, 1, 3];
    assert_bits(
        "gather_rows",
        &vals(&tc.gather_rows(&ids, d).unwrap()),
        &vals(&tg.gather_rows(&ids, d).unwrap()),
        &[],
    );
    // gradients whose sums depend on order (cancellation, mixed magnitudes)
    let mut grad = Vec::new();
    for i in 0..ids.len() * d {
        grad.push(match i % 4 {
            0 => rng.moderate() * 1e8,
            1 => rng.moderate(),
            2 => [-0.0, 1e-45, f32::INFINITY, -1e-40][rng.below(4)],
            _ => rng.moderate() * 1e-8,
        });
    }
    let (gc, gg) = pair(&grad);
    assert_bits(
        "scatter_add_rows",
        &vals(&gc.scatter_add_rows(&ids, v, d).unwrap()),
        &vals(&gg.scatter_add_rows(&ids, v, d).unwrap()),
        &[],
    );
    // no ids at all
    let (ec, eg) = pair(&[]);
    assert_bits(
        "scatter nothing",
        &vals(&ec.scatter_add_rows(&[], 3, 2).unwrap()),
        &vals(&eg.scatter_add_rows(&[], 3, 2).unwrap()),
        &[],
    );
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
        let ((xc, xg), (wc, wg), (gc, gg)) = (pair(&x), pair(&w), pair(&g));
        for eps in [1e-5, 0.0, 1e-38] {
            let what = format!("rms_norm {lead:?} x {d} eps {eps}");
            let (yc, rc) = xc.rms_norm(&wc, rows, d, eps).unwrap();
            let (yg, rg) = xg.rms_norm(&wg, rows, d, eps).unwrap();
            assert_bits(&what, &vals(&yc), &vals(&yg), &[&x]);
            assert_bits(&format!("{what}: rstd"), &vals(&rc), &vals(&rg), &[]);
            let bc = xc
                .rms_norm_backward(&wc, &rc, &gc, &lead, d, true, true)
                .unwrap();
            let bg = xg
                .rms_norm_backward(&wg, &rg, &gg, &lead, d, true, true)
                .unwrap();
            for (k, (c, g)) in [(bc.0, bg.0), (bc.1, bg.1), (bc.2, bg.2)]
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
    // (rows = blocks · t, d): odd t, d = 2 (one pair), 130 (off the workgroup)
    for (blocks, t, d, real) in [
        (3, 5, 8, true),
        (1, 7, 2, false),
        (2, 3, 130, true),
        (3, 1, 6, false),
    ] {
        let rows = blocks * t;
        let (cos, sin) = if real {
            tinyllm::nn::llama::rope_tables(t, d, 10000.0)
        } else {
            (adversarial(&mut rng, t * d), adversarial(&mut rng, t * d))
        };
        let x = rows_of(&mut rng, rows, d);
        let g = rows_of(&mut rng, rows, d);
        let ((xc, xg), (cc, cg), (sc, sg), (gc, gg)) = (pair(&x), pair(&cos), pair(&sin), pair(&g));
        let what = format!("rope {rows}x{d} t {t}");
        assert_bits(
            &what,
            &vals(&xc.rope(&cc, &sc, t, d).unwrap()),
            &vals(&xg.rope(&cg, &sg, t, d).unwrap()),
            &[&x],
        );
        assert_bits(
            &format!("{what}: backward"),
            &vals(&gc.rope_backward(&cc, &sc, t, d).unwrap()),
            &vals(&gg.rope_backward(&cg, &sg, t, d).unwrap()),
            &[&g],
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

// ------------------------------------------------------------ randomness ----

#[test]
fn dropout_mask_philox() {
    require_gpu!();
    for (n, p, scale, seed, offset) in [
        (1001usize, 0.1f32, 1.0 / 0.9f32, 0u64, 0u64),
        (7, 0.5, 2.0, 0xdead_beef_1234_5678, 0xffff_fffe), // the 64-bit counter carries
        (4096, 0.0, 1.0, 1, 0xffff_ffff_ffff_fff0),        // and wraps
        (33, 1.0, 3.0, u64::MAX, 12345),
        (0, 0.3, 1.0, 5, 5),
    ] {
        let c = Storage::dropout_mask(n, p, scale, seed, offset, Device::Cpu).unwrap();
        let g = Storage::dropout_mask(n, p, scale, seed, offset, Device::Gpu).unwrap();
        assert_bits(
            &format!("dropout n={n} p={p} seed={seed:#x} offset={offset:#x}"),
            &vals(&c),
            &vals(&g),
            &[],
        );
    }
}

// ----------------------------------------------------- optimizer & scaler ----

/// Length of the optimizer-kernel test buffers: two full workgroups and a
/// ragged third at lavapipe's 256 elements per lane (many on a real GPU).
const N_OPTIM: usize = 2 * 64 * 256 + 77;

#[test]
fn finite_check_unscale_flags_and_values() {
    require_gpu!();
    let mut rng = Rng(31);
    let inv = 2f32.powi(-16);
    // (buffers, expected finite). The first spans several workgroups of the
    // kernel on every adapter (64 lanes x PER_LANE elements: 256 elements on a
    // GPU, 16384 on lavapipe), with a ragged end.
    let finite_bufs: Vec<Vec<f32>> = vec![
        (0..N_OPTIM).map(|_| rng.moderate() * 1e4).collect(),
        vec![f32::MAX, -f32::MAX, 1e-45, -0.0, 3e-39],
        vec![],
    ];
    let mut with_inf = finite_bufs.clone();
    with_inf[1][2] = f32::NEG_INFINITY;
    let mut with_nan = finite_bufs.clone();
    with_nan[0][N_OPTIM - 1] = f32::NAN; // the last element of the last, partial workgroup
    let mut mid_inf = finite_bufs.clone();
    mid_inf[0][16384 + 64 * 7 + 5] = f32::INFINITY; // past the first workgroup, lane 5
    let mut only_last = finite_bufs.clone();
    only_last.push(vec![1.0, 2.0, f32::INFINITY]);
    for (bufs, want) in [
        (finite_bufs, true),
        (with_inf, false),
        (with_nan, false),
        (mid_inf, false),
        (only_last, false),
    ] {
        let cs: Vec<Storage> = bufs.iter().map(|b| pair(b).0).collect();
        let gs: Vec<Storage> = bufs.iter().map(|b| pair(b).1).collect();
        let fc = Storage::finite_check_unscale(&cs.iter().collect::<Vec<_>>(), inv).unwrap();
        let fg = Storage::finite_check_unscale(&gs.iter().collect::<Vec<_>>(), inv).unwrap();
        assert_eq!(fc, want);
        assert_eq!(fg, want, "GPU finite flag");
        for (c, g) in cs.iter().zip(&gs) {
            assert_bits("unscaled values", &vals(c), &vals(g), &[]);
        }
    }
}

#[test]
fn scale_in_place_matches() {
    require_gpu!();
    let mut rng = Rng(37);
    let x = adversarial(&mut rng, N_OPTIM); // several workgroups, ragged
    for c in [0.5f32, 0.3, 1e-30, -7.0] {
        let (a, b) = pair(&x);
        a.scale_in_place(c).unwrap();
        b.scale_in_place(c).unwrap();
        assert_bits(&format!("scale {c}"), &vals(&a), &vals(&b), &[&x]);
    }
}

#[test]
fn adamw_steps() {
    require_gpu!();
    let mut rng = Rng(41);
    let n = N_OPTIM; // several workgroups, ragged
    let p: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
    let (pc, pg) = pair(&p);
    let zeros = vec![0.0f32; n];
    let (mc, mg) = pair(&zeros);
    let (vc, vg) = pair(&zeros);
    let (lr, b1, b2, eps, wd) = (1e-3f64, 0.9f64, 0.999f64, 1e-8f64, 0.01f64);
    for t in 1..=4 {
        let mut g: Vec<f32> = (0..n).map(|_| rng.moderate() * 1e-3).collect();
        g[0] = 0.0;
        g[1] = 1e-42;
        g[2] = 1e10;
        let (gc, gg) = pair(&g);
        let c = AdamWConsts {
            decay: (1.0 - lr * wd) as f32,
            beta1: b1 as f32,
            omb1: (1.0 - b1) as f32,
            beta2: b2 as f32,
            omb2: (1.0 - b2) as f32,
            step_size: (lr / (1.0 - b1.powi(t))) as f32,
            bc2_sqrt: (1.0 - b2.powi(t)).sqrt() as f32,
            eps: eps as f32,
        };
        pc.adamw_step(&gc, &mc, &vc, &c).unwrap();
        pg.adamw_step(&gg, &mg, &vg, &c).unwrap();
        assert_bits(&format!("adamw p step {t}"), &vals(&pc), &vals(&pg), &[]);
        assert_bits(&format!("adamw m step {t}"), &vals(&mc), &vals(&mg), &[]);
        assert_bits(&format!("adamw v step {t}"), &vals(&vc), &vals(&vg), &[]);
    }
}

#[test]
fn sgd_steps_with_and_without_momentum() {
    require_gpu!();
    let mut rng = Rng(43);
    let n = 513;
    for momentum in [None, Some(0.9f32)] {
        let p: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
        let (pc, pg) = pair(&p);
        let (bc, bg) = pair(&vec![0.0f32; n]);
        for step in 0..3 {
            let g: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
            let (gc, gg) = pair(&g);
            let first = step == 0;
            match momentum {
                None => {
                    pc.sgd_step(&gc, None, 0.1, 0.0, 1e-4, first).unwrap();
                    pg.sgd_step(&gg, None, 0.1, 0.0, 1e-4, first).unwrap();
                }
                Some(mu) => {
                    pc.sgd_step(&gc, Some(&bc), 0.1, mu, 1e-4, first).unwrap();
                    pg.sgd_step(&gg, Some(&bg), 0.1, mu, 1e-4, first).unwrap();
                    assert_bits("sgd buf", &vals(&bc), &vals(&bg), &[]);
                }
            }
            assert_bits(
                &format!("sgd {momentum:?} step {step}"),
                &vals(&pc),
                &vals(&pg),
                &[],
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
/// Every kernel loop that can run longer (reductions, a matmul's k, a scatter
/// row's contributions) must still give the CPU's bits.
#[test]
fn loops_longer_than_lavapipes_iteration_cap() {
    require_gpu!();
    let n = 70_001;
    let mut rng = Rng(91);
    let x: Vec<f32> = (0..n).map(|_| rng.moderate()).collect();
    let (c, g) = pair(&x);
    for op in ReduceOp::ALL {
        let want = vals(&c.reduce(op, 1, n, 1).unwrap());
        let got = vals(&g.reduce(op, 1, n, 1).unwrap());
        assert_bits(&format!("reduce {op:?} over {n}"), &want, &got, &[&x]);
    }
    let ones = vec![1.0f32; n];
    let (_, g1) = pair(&ones);
    assert_eq!(
        vals(&g1.reduce(ReduceOp::Sum, 1, n, 1).unwrap()),
        vec![n as f32]
    );
    // Softmax rows run as one fused loop nest per row: on lavapipe a row this
    // long is refused with a clear error (never a silently truncated result);
    // elsewhere it matches.
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
    // (1, k) @ (k, 2) with k past the cap
    let b: Vec<f32> = (0..2 * n).map(|_| rng.moderate()).collect();
    let (cb, gb) = pair(&b);
    for round in [None, Some(Format::Bf16)] {
        let d = MatmulDims {
            batch: 1,
            m: 1,
            k: n,
            n: 2,
            trans_a: false,
            trans_b: false,
            a_batch_stride: 0,
            b_batch_stride: 0,
        };
        let want = vals(&c.matmul(&cb, d, round).unwrap());
        let got = vals(&g.matmul(&gb, d, round).unwrap());
        assert_bits(&format!("matmul k={n} {round:?}"), &want, &got, &[&x]);
    }
    // one embedding row gathered 70001 times: its gradient sums every one
    let ids = vec![1u32; n];
    let want = vals(&c.scatter_add_rows(&ids, 3, 1).unwrap());
    let got = vals(&g.scatter_add_rows(&ids, 3, 1).unwrap());
    assert_bits("scatter of 70001 rows into one", &want, &got, &[&x]);
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
        .rms_norm_backward(&cw, &cr, &cx, &lead, d, false, true)
        .unwrap()
        .2
        .unwrap();
    let got = gx
        .rms_norm_backward(&gw, &gr, &gx, &lead, d, false, true)
        .unwrap()
        .2
        .unwrap();
    assert_bits(
        "rms_norm dw over 35000 rows",
        &vals(&want),
        &vals(&got),
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
