//! Mixed precision (spec L11.1, first half): `cast`, `autocast`, the dynamic
//! loss scaler, gradient accumulation and `train_step_mixed`, on every device.
//!
//! The hand examples use the spec's section 3 numbers exactly; the rest compare
//! against independent references (the `half` crate for rounding, an explicit
//! `cast` composition for autocast, float32 runs for the differential tests).
//! `mutants/run.sh` checks that each pitfall of spec section 5 fails a test here.

mod common;
use common::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tinyllm::nn::{Layer, Linear, Module, Sequential, Silu};
use tinyllm::ops::mse;
use tinyllm::optim::{clip_grad_norm_, AdamW, AdamWConfig, Optimizer, Sgd};
use tinyllm::precision::{
    autocast, autocast_bf16, autocast_dtype, autocast_named, cast, round_to_bf16,
    DynamicLossScaler, Precision, ScalerState,
};
use tinyllm::{grad_accumulate, train_step_mixed, DType, Format, Generator};

// ------------------------------------------------------------- helpers ----

/// The reference rounding: the `half` crate (independent of the crate's own).
fn rd(x: f32, fmt: Format) -> f32 {
    match fmt {
        Format::Bf16 => half::bf16::from_f32(x).to_f32(),
        Format::Fp16 => half::f16::from_f32(x).to_f32(),
    }
}

fn rd_all(v: &[f32], fmt: Format) -> Vec<f32> {
    v.iter().map(|&x| rd(x, fmt)).collect()
}

/// A model that is just a list of parameters (for the hand examples).
struct Params(Vec<Tensor>);

impl Module for Params {
    fn parameters(&self) -> Vec<Tensor> {
        self.0.clone()
    }
}

fn sgd(params: Vec<Tensor>, lr: f32) -> Sgd {
    Sgd::new(params, lr, 0.0, 0.0).unwrap()
}

fn set_grad(p: &Tensor, g: &[f32], dev: Device) {
    p.set_grad(Some(t(g, p.shape(), dev)));
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Values, bit patterns of every leaf's gradient (None where there is none).
type Run = (Vec<u32>, Vec<Option<Vec<u32>>>);

/// Zeroes the leaves' gradients, builds `f()`, backpropagates `seed` and
/// returns the output's bits and every leaf's gradient bits.
fn run_bits(f: &dyn Fn() -> Result<Tensor>, leaves: &[&Tensor], seed: &[f32]) -> Result<Run> {
    for l in leaves {
        l.zero_grad();
    }
    let y = f()?;
    let out = bits(&vals(&y));
    if leaves.iter().any(|l| l.requires_grad()) {
        let s = Tensor::from_vec(seed.to_vec(), y.shape(), y.device())?;
        y.backward_with(&s)?;
    }
    let grads = leaves
        .iter()
        .map(|l| l.grad().map(|g| bits(&vals(&g))))
        .collect();
    Ok((out, grads))
}

fn random_t(shape: &[usize], seed: u64, scale: f32, dev: Device, trainable: bool) -> Tensor {
    let n: usize = shape.iter().product();
    let x = t(&randv(n, seed, scale), shape, dev);
    if trainable {
        x.requires_grad_(true)
    } else {
        x
    }
}

// ------------------------------------------------------- hand examples ----

device_test!(hand_example_bf16_matmul, |dev| {
    let a = param(&[1.0, 1.0], &[1, 2], dev);
    let b = param(&[1.0, 2f32.powi(-8)], &[2, 1], dev);

    // 1 + 2^-8 lies exactly halfway between 1 and 1 + 2^-7: ties to even, 1.0.
    let y = {
        let _ac = autocast_bf16();
        a.matmul(&b)?
    };
    assert_eq!(bits(&vals(&y)), bits(&[1.0]), "bf16 product of 1 + 2^-8");
    // L = sum(Y): Ā = rd(Ȳ) rd(B)ᵀ = [1, 2^-8], B̄ = rd(A)ᵀ rd(Ȳ) = [1, 1]ᵀ.
    y.sum_all()?.backward()?;
    assert_eq!(bits(&grad(&a)), bits(&[1.0, 2f32.powi(-8)]));
    assert_eq!(bits(&grad(&b)), bits(&[1.0, 1.0]));

    // The same product outside autocast is the float32 1.00390625.
    assert_eq!(autocast_dtype(), None);
    let y32 = a.matmul(&b)?;
    assert_eq!(bits(&vals(&y32)), bits(&[1.003_906_3]));

    // An input of 1.01 is stored as 1.0078125 = 1 + 2^-7.
    let x = param(&[1.01], &[1], dev);
    let c = cast(&x, Format::Bf16)?;
    assert_eq!(bits(&vals(&c)), bits(&[1.007_812_5]));
    assert_eq!(
        bits(&vals(&round_to_bf16(&t(&[1.01], &[1], dev))?)),
        bits(&[1.007_812_5])
    );

    // With A = [1.01, 1] the operand is read as 1.0078125, the product
    // 1.0078125 + 2^-8 = 1 + 3·2^-8 is again a tie (1.0078125 | 1.015625), to
    // even 1.015625; with the upstream gradient 1.01 (not a bf16 value) every
    // gradient is computed from rd(1.01) = 1.0078125.
    let a2 = param(&[1.01, 1.0], &[1, 2], dev);
    let y2 = {
        let _ac = autocast_bf16();
        a2.matmul(&b)?
    };
    assert_eq!(bits(&vals(&y2)), bits(&[1.015_625]));
    y2.backward_with(&t(&[1.01], &[1, 1], dev))?;
    assert_eq!(
        bits(&grad(&a2)),
        bits(&[1.007_812_5, 1.007_812_5 * 2f32.powi(-8)])
    );
    b.zero_grad();
    let y3 = {
        let _ac = autocast_bf16();
        a2.matmul(&b)?
    };
    y3.backward_with(&t(&[1.0], &[1, 1], dev))?;
    assert_eq!(bits(&grad(&b)), bits(&[1.007_812_5, 1.0]));
});

device_test!(hand_example_accumulation, |dev| {
    // One weight w = 1, x = [1, 2, 3, 4], targets 2x, loss mean((w x - 2x)^2).
    let w = param(&[1.0], &[1], dev);
    let loss_fn = |(x, y): &(Tensor, Tensor)| mse(&x.mul(&w)?, y);
    let batch = |xs: &[f32]| {
        let ys: Vec<f32> = xs.iter().map(|x| 2.0 * x).collect();
        (t(xs, &[xs.len()], dev), t(&ys, &[xs.len()], dev))
    };

    // One batch: loss 7.5, gradient -15.
    let one = [batch(&[1.0, 2.0, 3.0, 4.0])];
    let l = grad_accumulate(&one, loss_fn, None)?;
    assert_eq!(l, 7.5);
    assert_eq!(grad(&w), vec![-15.0]);
    w.zero_grad();

    // Micro-batches of 1 and 3 rows, weighted 1/4 and 3/4: the same loss and
    // gradient (weighting 1/2 would give -10.67, not weighting -21.3; only the
    // last micro-batch would give -14.5; the unweighted mean loss is 5.33).
    let micro = [batch(&[1.0]), batch(&[2.0, 3.0, 4.0])];
    let l = grad_accumulate(&micro, loss_fn, None)?;
    assert!(
        (l - 7.5).abs() <= 1e-6,
        "accumulated loss {l}, expected 7.5"
    );
    let g = grad(&w)[0];
    assert!(
        (g + 15.0).abs() <= 1e-5,
        "accumulated gradient {g}, expected -15"
    );

    // The micro-batches' own numbers: L_1 = 1, L_2 = 29/3; gradients -2, -58/3.
    w.zero_grad();
    let l1 = loss_fn(&micro[0])?;
    l1.backward()?;
    assert_eq!((l1.item()?, grad(&w)[0]), (1.0, -2.0));
    w.zero_grad();
    let l2 = loss_fn(&micro[1])?;
    l2.backward()?;
    assert!((l2.item()? - 29.0 / 3.0).abs() < 1e-5);
    assert!((grad(&w)[0] as f64 + 58.0 / 3.0).abs() < 1e-5);
    w.zero_grad();

    // It adds onto what .grad already holds (no zeroing inside).
    w.set_grad(Some(t(&[100.0], &[1], dev)));
    grad_accumulate(&micro, loss_fn, None)?;
    assert!((grad(&w)[0] - 85.0).abs() <= 1e-5);
    w.zero_grad();

    // With a scaler the gradient is S times larger, the loss reported unscaled.
    let s = DynamicLossScaler::new(8.0, 2.0, 0.5, 10)?;
    let l = grad_accumulate(&micro, loss_fn, Some(&s))?;
    assert!((l - 7.5).abs() <= 1e-6, "loss reported unscaled, got {l}");
    assert!((grad(&w)[0] + 120.0).abs() <= 1e-4, "got {:?}", grad(&w));
});

device_test!(accumulation_seeds_each_backward_as_its_composition, |dev| {
    // grad_accumulate seeds each micro-batch's backward with (1·S)·(n_i/N),
    // formed on the host: the bits of the backward through S·((n_i/N)·L_i),
    // at weights (3/7, 4/7) that f32 rounds, with and without a scaler.
    let w = param(&[0.3, -1.7], &[2], dev);
    let loss_fn = |(x, y): &(Tensor, Tensor)| mse(&x.mul(&w)?.sum(-1, false)?, y);
    let batch = |rows: usize, at: f32| {
        let xs: Vec<f32> = (0..2 * rows).map(|i| at + 0.37 * i as f32).collect();
        let ys: Vec<f32> = (0..rows).map(|i| 0.11 * i as f32 - at).collect();
        (t(&xs, &[rows, 2], dev), t(&ys, &[rows], dev))
    };
    let micro = [batch(3, 0.5), batch(4, -1.25)];
    for scale in [None, Some(1024.0)] {
        let s = scale
            .map(|s| DynamicLossScaler::new(s, 2.0, 0.5, 10))
            .transpose()?;
        w.zero_grad();
        grad_accumulate(&micro, loss_fn, s.as_ref())?;
        let got = grad(&w);
        w.zero_grad();
        for (mb, share) in micro.iter().zip([3.0 / 7.0, 4.0 / 7.0]) {
            let weighted = loss_fn(mb)?.mul_scalar(share)?;
            match &s {
                Some(s) => s.scale_loss(&weighted)?.backward()?,
                None => weighted.backward()?,
            }
        }
        assert_eq!(bits(&got), bits(&grad(&w)), "scale {scale:?}");
    }
});

device_test!(hand_example_loss_scaler, |dev| {
    // S = 8, growth 2, backoff 1/2, interval 2, SGD lr 0.5 on one parameter at 0.
    let w = param(&[0.0], &[1], dev);
    let mut opt = sgd(vec![w.clone()], 0.5);
    let mut s = DynamicLossScaler::new(8.0, 2.0, 0.5, 2)?;
    let params = [w.clone()];
    // (scaled g, stepped, w after, S after, good steps)
    let trace: [(f32, bool, f32, f32, u64); 5] = [
        (8.0, true, -0.5, 8.0, 1),
        (f32::INFINITY, false, -0.5, 4.0, 0),
        (4.0, true, -1.0, 4.0, 1),
        (8.0, true, -2.0, 8.0, 0), // grown: second good step in a row
        (16.0, true, -3.0, 8.0, 1),
    ];
    for (i, &(g, stepped, w_after, s_after, good)) in trace.iter().enumerate() {
        set_grad(&w, &[g], dev);
        let did = s.step(&mut opt, &params, None)?;
        let step = i + 1;
        assert_eq!(did, stepped, "step {step}: stepped");
        assert_eq!(vals(&w), vec![w_after], "step {step}: w");
        assert_eq!(s.loss_scale(), s_after, "step {step}: S");
        assert_eq!(s.good_steps(), good, "step {step}: good steps");
    }
    // scale() multiplies the loss by S.
    let l = t(&[0.75], &[], dev);
    assert_eq!(vals(&s.scale_loss(&l)?), vec![6.0]);
});

// ---------------------------------------------------------------- cast ----

device_test!(cast_rounds_both_directions, |dev| {
    // Ties, overflow, subnormals, signed zero, and random values.
    let mut xs: Vec<f32> = vec![
        1.01,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        1.0 + 2f32.powi(-11),
        -(1.0 + 3.0 * 2f32.powi(-11)),
        65504.0,
        65519.0,
        65520.0,
        -70000.0,
        3.0e38,
        2f32.powi(-24),
        2f32.powi(-25),
        3.0 * 2f32.powi(-26),
        1.0e-8,
        -0.0,
        0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0e-40,
    ];
    xs.extend(randv(45, 7, 3.0));
    let n = xs.len();
    let mut seed: Vec<f32> = randv(n, 8, 2.0);
    seed[0] = 1.01;
    for fmt in [Format::Bf16, Format::Fp16] {
        let x = param(&xs, &[n], dev);
        let y = cast(&x, fmt)?;
        assert_eq!(y.dtype(), DType::F32);
        assert_eq!(y.shape(), &[n]);
        assert_eq!(bits(&vals(&y)), bits(&rd_all(&xs, fmt)), "{fmt} forward");
        // The gradient passes through the conversion and arrives rounded.
        y.backward_with(&t(&seed, &[n], dev))?;
        let g = grad(&x);
        assert_eq!(bits(&g), bits(&rd_all(&seed, fmt)), "{fmt} backward");
        assert_ne!(
            bits(&g),
            bits(&seed),
            "{fmt}: the seed is not all 16-bit values"
        );
        // Composed: cast(cast(x) * 3) backprops rd(3 · rd(seed)).
        x.zero_grad();
        let z = cast(&cast(&x, fmt)?.mul_scalar(3.0)?, fmt)?;
        z.backward_with(&t(&seed, &[n], dev))?;
        let want: Vec<f32> = seed.iter().map(|&s| rd(3.0 * rd(s, fmt), fmt)).collect();
        assert_eq!(bits(&grad(&x)), bits(&want), "{fmt} chained backward");
    }
    // Hand values of the two formats.
    let x = t(
        &[1.0 + 2f32.powi(-8), 65520.0, 2f32.powi(-25), 1.0e-8],
        &[4],
        dev,
    );
    assert_eq!(
        vals(&cast(&x, Format::Bf16)?),
        vec![1.0, 65536.0, 2f32.powi(-25), rd(1.0e-8, Format::Bf16)]
    );
    assert_eq!(
        vals(&cast(&x, Format::Fp16)?),
        vec![1.0 + 2f32.powi(-8), f32::INFINITY, 0.0, 0.0]
    );

    // float64 stays float64 and rounds from the f64 value directly (CPU only:
    // the GPU backend is f32).
    if dev == Device::Cpu {
        let eps = 2f64.powi(-40);
        // 1 + 2^-8 + 2^-40 is above the bf16 tie: 1 + 2^-7 (through f32 it
        // would first become the tie 1 + 2^-8 and then round to even, 1.0).
        // 1 + 2^-11 + 2^-40 is above the fp16 tie: 1 + 2^-10 (through f32: 1).
        let cases: [(Format, f64, f64, f64, f64); 4] = [
            (
                Format::Bf16,
                1.0 + 2f64.powi(-8) + eps,
                1.0 + 2f64.powi(-7),
                0.3,
                0.30078125,
            ),
            (
                Format::Bf16,
                -(1.0 + 3.0 * 2f64.powi(-8) - eps),
                -(1.0 + 2f64.powi(-7)),
                1.01,
                1.0078125,
            ),
            (
                Format::Fp16,
                1.0 + 2f64.powi(-11) + eps,
                1.0 + 2f64.powi(-10),
                0.1,
                0.0999755859375,
            ),
            (
                Format::Fp16,
                1.0 + 3.0 * 2f64.powi(-11) - eps,
                1.0 + 2f64.powi(-10),
                1.0e-3,
                0.0010004043579101562,
            ),
        ];
        for (fmt, x0, want, g0, gwant) in cases {
            let x =
                Tensor::from_vec_f64(vec![x0, 1.0 / 3.0], &[2], Device::Cpu)?.requires_grad_(true);
            let y = cast(&x, fmt)?;
            assert_eq!(y.dtype(), DType::F64, "{fmt}: cast keeps f64");
            let yv = y.to_vec_f64()?;
            assert_eq!(
                yv[0].to_bits(),
                want.to_bits(),
                "{fmt}: cast({x0:e}) = {:e}",
                yv[0]
            );
            assert_eq!(yv[1] as f32, rd(1.0 / 3.0, fmt), "{fmt}: 1/3");
            let seed = Tensor::from_vec_f64(vec![g0, 1.0], &[2], Device::Cpu)?;
            y.backward_with(&seed)?;
            let g = x.grad().unwrap();
            assert_eq!(g.dtype(), DType::F64, "{fmt}: the gradient keeps f64");
            let gv = g.to_vec_f64()?;
            assert_eq!(
                gv[0].to_bits(),
                gwant.to_bits(),
                "{fmt}: gradient of {g0} = {:e}",
                gv[0]
            );
        }
        // An f64 value just above an f32 tie that f32 would round to the tie.
        let x = Tensor::from_vec_f64(
            vec![1.0 + 2f64.powi(-8) + 2f64.powi(-30)],
            &[1],
            Device::Cpu,
        )?;
        assert_eq!(round_to_bf16(&x)?.to_vec_f64()?, vec![1.0 + 2f64.powi(-7)]);
        assert_eq!(round_to_bf16(&x)?.dtype(), DType::F64);
    }
});

// ------------------------------------------------------------ autocast ----

device_test!(autocast_matmul_matches_rounded_reference, |dev| {
    for (fi, fmt) in [Format::Bf16, Format::Fp16].into_iter().enumerate() {
        let s0 = 100 * fi as u64;
        let mut differs_from_f32 = 0;
        // (a, b, product) triples: trainable and constant operands, transposed
        // operands, the constant on the left ("reflected"), batched products.
        type Case = (Tensor, Tensor, fn(&Tensor, &Tensor) -> Result<Tensor>);
        let cases: Vec<Case> = vec![
            (
                random_t(&[5, 7], s0 + 1, 2.0, dev, true),
                random_t(&[7, 9], s0 + 2, 2.0, dev, true),
                |a, b| a.matmul(b),
            ),
            (
                random_t(&[7, 19], s0 + 3, 2.0, dev, false),
                random_t(&[19, 18], s0 + 4, 2.0, dev, true),
                |a, b| a.matmul(b),
            ),
            (
                random_t(&[6, 4], s0 + 5, 2.0, dev, true),
                random_t(&[5, 4], s0 + 6, 2.0, dev, true),
                |a, b| a.matmul_t(b),
            ),
            (
                random_t(&[7, 5], s0 + 7, 2.0, dev, true),
                random_t(&[7, 3], s0 + 8, 2.0, dev, false),
                |a, b| a.transpose(0, 1)?.matmul(b),
            ),
            (
                random_t(&[3, 9], s0 + 9, 2.0, dev, false),
                random_t(&[4, 3], s0 + 10, 2.0, dev, true),
                |a, b| b.matmul(a), // the trainable operand on the left
            ),
            (
                random_t(&[2, 3, 4], s0 + 11, 2.0, dev, true),
                random_t(&[4, 5], s0 + 12, 2.0, dev, true),
                |a, b| a.matmul(b),
            ),
            (
                random_t(&[2, 3, 4], s0 + 13, 2.0, dev, true),
                random_t(&[2, 6, 4], s0 + 14, 2.0, dev, true),
                |a, b| a.matmul_t(b),
            ),
            (
                random_t(&[64, 64], s0 + 15, 1.0, dev, true),
                random_t(&[64, 65], s0 + 16, 1.0, dev, true),
                |a, b| a.matmul(b),
            ),
        ];
        for (ci, (a, b, f)) in cases.iter().enumerate() {
            let shape = f(a, b)?.shape().to_vec();
            let n: usize = shape.iter().product();
            let seed = randv(n, s0 + 50 + ci as u64, 3.0);
            let auto = run_bits(
                &|| {
                    let _ac = autocast(fmt);
                    f(a, b)
                },
                &[a, b],
                &seed,
            )?;
            assert_eq!(autocast_dtype(), None);
            let reference = run_bits(
                &|| cast(&f(&cast(a, fmt)?, &cast(b, fmt)?)?, fmt),
                &[a, b],
                &seed,
            )?;
            assert_eq!(auto.0, reference.0, "{fmt} case {ci}: product");
            assert_eq!(auto.1, reference.1, "{fmt} case {ci}: gradients");
            assert!(
                auto.1.iter().any(|g| g.is_some()),
                "case {ci} has gradients"
            );
            let plain = run_bits(&|| f(a, b), &[a, b], &seed)?;
            if plain.0 != auto.0 {
                differs_from_f32 += 1;
            }
        }
        assert_eq!(differs_from_f32, 8, "{fmt}: every product differs from f32");

        // Linear (x Wᵀ + b) on a 3-d input: the bias add stays float32.
        let gen = Generator::new(3 + fi as u64);
        let lin = Linear::new(5, 7, true, &gen, dev)?;
        let x = random_t(&[3, 4, 5], s0 + 70, 2.0, dev, true);
        let (w, bias) = (lin.weight.clone(), lin.bias.clone().unwrap());
        let seed = randv(3 * 4 * 7, s0 + 71, 1.0);
        let auto = run_bits(
            &|| {
                let _ac = autocast(fmt);
                lin.forward(&x)
            },
            &[&x, &w, &bias],
            &seed,
        )?;
        let reference = run_bits(
            &|| {
                let x2 = cast(&x.reshape(&[12, 5])?, fmt)?;
                cast(&x2.matmul_t(&cast(&w, fmt)?)?, fmt)?
                    .add(&bias)?
                    .reshape(&[3, 4, 7])
            },
            &[&x, &w, &bias],
            &seed,
        )?;
        assert_eq!(auto.0, reference.0, "{fmt} Linear: output");
        assert_eq!(auto.1, reference.1, "{fmt} Linear: gradients of x, W, b");
        let plain = run_bits(&|| lin.forward(&x), &[&x, &w, &bias], &seed)?;
        assert_ne!(plain.0, auto.0, "{fmt} Linear differs from f32");
    }
});

device_test!(autocast_grads_are_bf16_and_masters_stay_fp32, |dev| {
    let gen = Generator::new(11);
    let lin = Linear::new(8, 5, true, &gen, dev)?;
    let x = random_t(&[6, 8], 12, 1.0, dev, false);
    let y = random_t(&[6, 5], 13, 1.0, dev, false);
    let loss = |fmt: Option<Format>| -> Result<Vec<f32>> {
        lin.weight.zero_grad();
        let _ac = autocast(fmt);
        mse(&lin.forward(&x)?, &y)?.backward()?;
        Ok(grad(&lin.weight))
    };
    let g16 = loss(Some(Format::Bf16))?;
    let g32 = loss(None)?;
    assert_eq!(
        bits(&g16),
        bits(&rd_all(&g16, Format::Bf16)),
        "weight gradients are bf16 values"
    );
    assert_ne!(
        bits(&g32),
        bits(&rd_all(&g32, Format::Bf16)),
        "f32 gradients are not"
    );
    assert_eq!(lin.weight.grad().unwrap().dtype(), DType::F32);
    let scale = max_abs(&g32);
    for (a, b) in g16.iter().zip(&g32) {
        assert!((a - b).abs() <= 0.03 * scale, "bf16 grad {a} vs f32 {b}");
    }

    // A 1e-3 update to a weight of 1.0 survives in the f32 master (in bf16 the
    // spacing below 1 is 2^-8 and 0.999 would round straight back to 1).
    let l1 = Linear::new(1, 1, false, &gen, dev)?;
    l1.weight.assign(&t(&[1.0], &[1, 1], dev))?;
    let mut opt = sgd(l1.parameters(), 1e-3);
    let mb = [(t(&[1.0], &[1, 1], dev), t(&[0.0], &[1, 1], dev))];
    let lf = |(x, _): &(Tensor, Tensor)| l1.forward(x)?.sum_all();
    let r = train_step_mixed(&l1, &mb, lf, &mut opt, Precision::Bf16, None, None)?;
    assert_eq!(r.loss, 1.0);
    assert_eq!(grad(&l1.weight), vec![1.0]);
    let w = vals(&l1.weight)[0];
    assert_eq!(w, (-1e-3f32).mul_add(1.0, 1.0), "w = 1 - 1e-3 in f32");
    assert_eq!(
        rd(w, Format::Bf16),
        1.0,
        "the update is below bf16's spacing"
    );
    assert_eq!(l1.weight.dtype(), DType::F32);
    for _ in 0..9 {
        train_step_mixed(&l1, &mb, lf, &mut opt, Precision::Bf16, None, None)?;
    }
    let w = vals(&l1.weight)[0];
    assert!((w - 0.99).abs() < 1e-6, "ten 1e-3 updates land: {w}");

    // AdamW under autocast keeps float32 weights that are not bf16 values.
    let mut adam = AdamW::new(lin.parameters(), AdamWConfig::new(1e-3))?;
    let mb = [(x.clone(), y.clone())];
    let lf = |(x, y): &(Tensor, Tensor)| mse(&lin.forward(x)?, y);
    for _ in 0..3 {
        train_step_mixed(&lin, &mb, lf, &mut adam, Precision::Bf16, None, None)?;
    }
    let wv = vals(&lin.weight);
    assert_eq!(lin.weight.dtype(), DType::F32);
    let off_grid = wv.iter().filter(|&&v| rd(v, Format::Bf16) != v).count();
    assert!(
        off_grid >= wv.len() / 2,
        "master weights stay f32: {off_grid} of {} off the bf16 grid",
        wv.len()
    );
    let (m, v, _) = adam.state(0).unwrap();
    assert_eq!((m.dtype(), v.dtype()), (DType::F32, DType::F32));
});

device_test!(autocast_restores_matmul, |dev| {
    let a = random_t(&[4, 6], 21, 2.0, dev, false);
    let b = random_t(&[6, 5], 22, 2.0, dev, false);
    let prod = || bits(&vals(&a.matmul(&b).unwrap()));
    let p32 = prod();
    let (pbf, pfp) = {
        let _g = autocast(Format::Bf16);
        let pbf = prod();
        drop(_g);
        let _g = autocast(Format::Fp16);
        (pbf, prod())
    };
    assert!(
        p32 != pbf && p32 != pfp && pbf != pfp,
        "three distinct products"
    );
    assert_eq!(autocast_dtype(), None);
    assert_eq!(prod(), p32);

    // A panic inside the block (intentional: the message below is expected).
    let r = catch_unwind(AssertUnwindSafe(|| {
        let _ac = autocast_bf16();
        assert_eq!(prod(), pbf);
        panic!("intentional panic inside autocast (test_autocast_restores_matmul)");
    }));
    assert!(r.is_err());
    assert_eq!(autocast_dtype(), None, "a panic leaves autocast on");
    assert_eq!(prod(), p32, "matmul after the panic is float32 again");

    // Nesting: inner fp16 inside outer bf16; leaving the inner restores bf16.
    {
        let _outer = autocast_bf16();
        assert_eq!(autocast_dtype(), Some(Format::Bf16));
        {
            let _inner = autocast(Format::Fp16);
            assert_eq!(autocast_dtype(), Some(Format::Fp16));
            assert_eq!(prod(), pfp, "the innermost format applies");
        }
        assert_eq!(
            autocast_dtype(),
            Some(Format::Bf16),
            "leaving the inner block"
        );
        assert_eq!(prod(), pbf, "the rest of the outer block is bf16");
        // A panic in a nested block restores the outer one, not float32.
        let r = catch_unwind(AssertUnwindSafe(|| {
            let _inner = autocast(Format::Fp16);
            panic!("intentional panic in a nested autocast (test_autocast_restores_matmul)");
        }));
        assert!(r.is_err());
        assert_eq!(autocast_dtype(), Some(Format::Bf16));
        assert_eq!(prod(), pbf);
        // A float32 block inside switches autocast off, then back on.
        {
            let _off = autocast(None);
            assert_eq!(prod(), p32);
        }
        assert_eq!(prod(), pbf);

        // An unknown name is an error that changes nothing.
        let e = autocast_named("fp8");
        assert!(e.is_err(), "fp8 is not a format");
        assert!(e.err().unwrap().to_string().contains("fp8"));
        assert_eq!(autocast_dtype(), Some(Format::Bf16));
        assert_eq!(prod(), pbf);
        {
            let _n = autocast_named("fp16")?;
            assert_eq!(prod(), pfp);
        }
        assert_eq!(prod(), pbf);
    }
    assert_eq!(autocast_dtype(), None);
    assert!(autocast_named("fp8").is_err());
    assert_eq!(autocast_dtype(), None);
    assert_eq!(prod(), p32);
});

// -------------------------------------------------------- loss scaling ----

device_test!(fp16_underflow_is_rescued_by_loss_scaling, |dev| {
    // L = Σ c ⊙ (x Wᵀ) with |c| < 2^-25: the upstream gradient c flushes to
    // zero in fp16, so W gets nothing; scaled by S = 2^16 it lands in fp16's
    // normal range, and unscaled it matches float32.
    let gen = Generator::new(5);
    let lin = Linear::new(3, 2, false, &gen, dev)?;
    let xv = randv(12, 31, 1.0);
    let cv: Vec<f32> = randv(8, 32, 2.5e-8);
    let x = t(&xv, &[4, 3], dev);
    let c = t(&cv, &[4, 2], dev);
    assert!(max_abs(&cv) < 2f32.powi(-25));
    let mb = [(x.clone(), c.clone())];
    let lf = |(x, c): &(Tensor, Tensor)| lin.forward(x)?.mul(c)?.sum_all();
    let w0 = vals(&lin.weight);

    // float32 reference gradient: tiny but not zero.
    let mut opt = sgd(lin.parameters(), 1.0);
    train_step_mixed(&lin, &mb, lf, &mut opt, Precision::Fp32, None, None)?;
    let g32 = grad(&lin.weight);
    assert!(
        g32.iter().all(|&g| g != 0.0 && g.abs() < 2f32.powi(-23)),
        "{g32:?}"
    );
    lin.weight.assign(&t(&w0, &[2, 3], dev))?;

    // fp16 without scaling: every weight gradient vanishes.
    let r = train_step_mixed(&lin, &mb, lf, &mut opt, Precision::Fp16, None, None)?;
    assert!(!r.skipped);
    assert_eq!(
        grad(&lin.weight),
        vec![0.0; 6],
        "fp16 flushes the tiny gradients"
    );
    assert_eq!(vals(&lin.weight), w0);

    // fp16 with S = 2^16: the unscaled gradients match float32 to fp16 precision.
    let mut s = DynamicLossScaler::new(65536.0, 2.0, 0.5, 2000)?;
    let r = train_step_mixed(&lin, &mb, lf, &mut opt, Precision::Fp16, Some(&mut s), None)?;
    assert!(!r.skipped);
    assert_eq!(r.scale, 65536.0);
    let g16 = grad(&lin.weight);
    for (i, (a, b)) in g16.iter().zip(&g32).enumerate() {
        // |error| <= a few fp16 roundings of Σ_r |c_r x_r|
        let (o, j) = (i / 3, i % 3);
        let mag: f32 = (0..4).map(|r| (cv[r * 2 + o] * xv[r * 3 + j]).abs()).sum();
        assert!(
            (a - b).abs() <= 4.0 * 2f32.powi(-11) * mag + 1e-12,
            "weight grad {i}: fp16+scaling {a:e} vs f32 {b:e}"
        );
    }
    assert!(g16.iter().all(|&g| g != 0.0), "rescued: {g16:?}");
    // The step used the true (unscaled) gradient: w - 1.0 · g.
    let w1 = vals(&lin.weight);
    for ((w1, w0), g) in w1.iter().zip(&w0).zip(&g16) {
        assert_eq!(*w1, (-1.0f32).mul_add(*g, *w0));
    }
});

device_test!(scaler_skips_inf_steps, |dev| {
    // Direct: one infinite (then one NaN) entry in one of two parameters.
    let w1 = param(&[0.5, -0.25], &[2], dev);
    let w2 = param(&[1.5, 2.0, -3.0], &[3], dev);
    let params = [w1.clone(), w2.clone()];
    let mut opt = sgd(params.to_vec(), 0.1);
    let mut s = DynamicLossScaler::new(1024.0, 2.0, 0.5, 1000)?;
    for (k, bad) in [f32::INFINITY, f32::NAN, f32::NEG_INFINITY]
        .into_iter()
        .enumerate()
    {
        set_grad(&w1, &[1.0, 2.0], dev);
        set_grad(&w2, &[3.0, bad, 4.0], dev);
        assert!(
            !s.step(&mut opt, &params, None)?,
            "a non-finite gradient skips"
        );
        assert_eq!(vals(&w1), vec![0.5, -0.25], "no weight changes");
        assert_eq!(vals(&w2), vec![1.5, 2.0, -3.0], "no weight changes");
        assert!(
            w1.grad().is_none() && w2.grad().is_none(),
            "gradients dropped"
        );
        assert_eq!(s.loss_scale(), 1024.0 / 2f32.powi(k as i32 + 1));
        assert_eq!(s.good_steps(), 0);
    }
    // The next good step is unscaled by the halved S (128).
    set_grad(&w1, &[128.0, 256.0], dev);
    assert!(s.step(&mut opt, &params, None)?);
    assert_eq!(
        vals(&w1),
        vec![(-0.1f32).mul_add(1.0, 0.5), (-0.1f32).mul_add(2.0, -0.25)]
    );
    assert!(w2.grad().is_none());
    assert_eq!(vals(&w2), vec![1.5, 2.0, -3.0]);

    // A loop without zero_grad (backward adds into .grad): after a skip the
    // next backward starts from nothing, not from inf.
    let w = param(&[1.0], &[1], dev);
    let mut opt = sgd(vec![w.clone()], 0.5);
    let mut s = DynamicLossScaler::new(4.0, 2.0, 0.5, 1000)?;
    let big = t(&[f32::MAX], &[1], dev);
    w.mul(&big)?.sum_all()?.mul_scalar(4.0)?.backward()?; // overflows to inf
    assert!(!s.step(&mut opt, std::slice::from_ref(&w), None)?);
    s.scale_loss(&w.mul_scalar(3.0)?.sum_all()?)?.backward()?; // scaled gradient 3 · S = 6
    assert_eq!(grad(&w), vec![6.0]);
    assert!(s.step(&mut opt, std::slice::from_ref(&w), None)?);
    assert_eq!(vals(&w), vec![1.0 - 0.5 * 3.0]);

    // Through fp16 training: |true gradient| of 64..100 overflows fp16 (max
    // 65504) for every S >= 1024, so S halves on each skipped step until the
    // scaled gradients fit; then steps succeed and S stays put.
    let gen = Generator::new(9);
    let lin = Linear::new(3, 2, false, &gen, dev)?;
    let x = t(&randv(12, 41, 1.0), &[4, 3], dev);
    let cv: Vec<f32> = randv(8, 42, 1.0)
        .into_iter()
        .map(|u| (64.0 + 36.0 * u.abs()).copysign(u))
        .collect();
    let mb = [(x, t(&cv, &[4, 2], dev))];
    let lf = |(x, c): &(Tensor, Tensor)| lin.forward(x)?.mul(c)?.sum_all();
    let mut opt = sgd(lin.parameters(), 1e-3);
    let mut s = DynamicLossScaler::new(65536.0, 2.0, 0.5, 1000)?;
    let w0 = vals(&lin.weight);
    let mut skipped = 0;
    let mut prev_scale = s.loss_scale();
    loop {
        let r = train_step_mixed(&lin, &mb, lf, &mut opt, Precision::Fp16, Some(&mut s), None)?;
        if !r.skipped {
            assert_eq!(r.scale, prev_scale, "a good step keeps S (interval 1000)");
            break;
        }
        skipped += 1;
        assert_eq!(r.scale, prev_scale / 2.0, "each skip halves S");
        assert_eq!(vals(&lin.weight), w0, "a skipped step changes no weight");
        assert!(lin.weight.grad().is_none());
        prev_scale = r.scale;
        assert!(skipped < 20, "S never came down far enough");
    }
    assert!(
        skipped >= 7,
        "S = 65536 .. 1024 must all overflow, skipped {skipped}"
    );
    let w1 = vals(&lin.weight);
    assert!(w1.iter().all(|v| v.is_finite()) && w1 != w0);
    for _ in 0..3 {
        let r = train_step_mixed(&lin, &mb, lf, &mut opt, Precision::Fp16, Some(&mut s), None)?;
        assert!(!r.skipped && r.scale == prev_scale);
    }
});

device_test!(scaler_unscales_before_clipping, |dev| {
    // A true gradient [3, 4] (norm 5), scaled by S = 1024, clipped to 1.
    let w = param(&[0.0, 0.0], &[2], dev);
    let mut opt = sgd(vec![w.clone()], 1.0);
    let mut s = DynamicLossScaler::new(1024.0, 2.0, 0.5, 1000)?;
    set_grad(&w, &[3072.0, 4096.0], dev);
    assert!(s.step(&mut opt, std::slice::from_ref(&w), Some(1.0))?);
    assert_eq!(s.last_grad_norm(), Some(5.0), "the norm in true units");
    let got = vals(&w);
    assert!(
        (got[0] + 0.6).abs() < 1e-6 && (got[1] + 0.8).abs() < 1e-6,
        "{got:?}"
    );

    // Bit for bit what float32 gives without a scaler (unscaling by 2^10 is exact).
    let w_ref = param(&[0.0, 0.0], &[2], dev);
    let mut opt_ref = sgd(vec![w_ref.clone()], 1.0);
    set_grad(&w_ref, &[3.0, 4.0], dev);
    assert_eq!(clip_grad_norm_(std::slice::from_ref(&w_ref), 1.0)?, 5.0);
    opt_ref.step()?;
    assert_eq!(bits(&vals(&w_ref)), bits(&got));

    // Through train_step_mixed: loss = S-scaled 3 a + 4 b, reported norm 5.
    let p = param(&[1.0, 1.0], &[2], dev);
    let model = Params(vec![p.clone()]);
    let mut opt = sgd(vec![p.clone()], 1.0);
    let mut s = DynamicLossScaler::new(1024.0, 2.0, 0.5, 1000)?;
    let mb = [(t(&[3.0, 4.0], &[2], dev), t(&[0.0], &[1], dev))];
    let lf = |(c, _): &(Tensor, Tensor)| p.mul(c)?.sum_all();
    let r = train_step_mixed(
        &model,
        &mb,
        lf,
        &mut opt,
        Precision::Fp32,
        Some(&mut s),
        Some(1.0),
    )?;
    assert_eq!(r.grad_norm, Some(5.0));
    assert!(!r.skipped);
    let got = vals(&p);
    assert!(
        (got[0] - 0.4).abs() < 1e-6 && (got[1] - 0.2).abs() < 1e-6,
        "{got:?}"
    );
});

// The training step scales clipped gradients inside AdamW's update (one
// pass per parameter): the same weights, moments and clipped gradients, bit
// for bit, as clip_grad_norm_ followed by the update — over two steps that
// clip and one that does not.
device_test!(clipping_inside_the_update_is_clip_then_step, |dev| {
    let init = [randv(300, 71, 1.0), randv(37, 72, 1.0)];
    let make = || -> Vec<Tensor> { init.iter().map(|v| param(v, &[v.len()], dev)).collect() };
    let (fused, plain) = (make(), make());
    let cfg = AdamWConfig::new(1e-2);
    let (mut opt_f, mut opt_p) = (
        AdamW::new(fused.clone(), cfg)?,
        AdamW::new(plain.clone(), cfg)?,
    );
    let model = Params(fused.clone());
    for (step, size) in [(0u64, 10.0f32), (1, 10.0), (2, 0.01)] {
        let c: Vec<Tensor> = init
            .iter()
            .enumerate()
            .map(|(i, v)| {
                t(
                    &randv(v.len(), 80 + 2 * step + i as u64, size),
                    &[v.len()],
                    dev,
                )
            })
            .collect();
        let loss = |ps: &[Tensor]| -> Result<Tensor> {
            ps[0]
                .mul(&c[0])?
                .sum_all()?
                .add(&ps[1].mul(&c[1])?.sum_all()?)
        };
        let mb = [(t(&[0.0], &[1], dev), t(&[0.0], &[1], dev))];
        let r = train_step_mixed(
            &model,
            &mb,
            |_| loss(&fused),
            &mut opt_f,
            Precision::Fp32,
            None,
            Some(1.0),
        )?;
        for p in &plain {
            p.zero_grad();
        }
        loss(&plain)?.backward()?;
        let norm = clip_grad_norm_(&plain, 1.0)?;
        opt_p.step()?;
        assert_eq!(r.grad_norm.map(f32::to_bits), Some(norm.to_bits()));
        assert_eq!(norm > 1.0, step < 2, "steps 1 and 2 clip, step 3 does not");
        for (i, (f, p)) in fused.iter().zip(&plain).enumerate() {
            assert_eq!(bits(&vals(f)), bits(&vals(p)), "step {step}: weights {i}");
            assert_eq!(bits(&grad(f)), bits(&grad(p)), "step {step}: gradients {i}");
            let (sf, sp) = (opt_f.state(i).unwrap(), opt_p.state(i).unwrap());
            assert_eq!(bits(&vals(&sf.0)), bits(&vals(&sp.0)), "step {step}: m {i}");
            assert_eq!(bits(&vals(&sf.1)), bits(&vals(&sp.1)), "step {step}: v {i}");
        }
    }
});

device_test!(scaler_state_dict_roundtrip, |dev| {
    let w = param(&[0.0], &[1], dev);
    let mut opt = sgd(vec![w.clone()], 0.0);
    let params = [w.clone()];
    let good = |s: &mut DynamicLossScaler, opt: &mut Sgd| {
        set_grad(&w, &[1.0], dev);
        assert!(s.step(opt, &params, None).unwrap());
    };
    let mut a = DynamicLossScaler::new(8.0, 2.0, 0.5, 3)?;
    good(&mut a, &mut opt);
    good(&mut a, &mut opt);
    let sd = a.state_dict();
    assert_eq!(
        sd,
        ScalerState {
            scale: 8.0,
            growth: 2.0,
            backoff: 0.5,
            interval: 3,
            good_steps: 2
        }
    );
    // Through JSON, as a checkpoint stores it.
    let json = serde_json::to_string(&sd).unwrap();
    let sd2: ScalerState = serde_json::from_str(&json).unwrap();
    let mut b = DynamicLossScaler::default();
    assert_eq!(b.loss_scale(), 65536.0);
    b.load_state_dict(&sd2)?;
    assert_eq!((b.loss_scale(), b.good_steps()), (8.0, 2));
    assert_eq!(b.state_dict(), sd);
    // The resumed scaler grows on the same step as the original.
    good(&mut a, &mut opt);
    good(&mut b, &mut opt);
    assert_eq!((a.loss_scale(), a.good_steps()), (16.0, 0));
    assert_eq!((b.loss_scale(), b.good_steps()), (16.0, 0));
    assert_eq!(a, b);

    // Bad arguments are errors.
    for (init, growth, backoff, interval) in [
        (0.0, 2.0, 0.5, 10),
        (-8.0, 2.0, 0.5, 10),
        (f32::INFINITY, 2.0, 0.5, 10),
        (f32::NAN, 2.0, 0.5, 10),
        (8.0, 1.0, 0.5, 10),
        (8.0, 0.5, 0.5, 10),
        (8.0, f32::NAN, 0.5, 10),
        (8.0, 2.0, 1.0, 10),
        (8.0, 2.0, 0.0, 10),
        (8.0, 2.0, 1.5, 10),
        (8.0, 2.0, 0.5, 0),
        // Not powers of two: the unscale would not be exact.
        (1000.0, 2.0, 0.5, 10),
        (3.0, 2.0, 0.5, 10),
        (1e-40, 2.0, 0.5, 10),
        (8.0, 3.0, 0.5, 10),
        (8.0, 2.0, 0.75, 10),
    ] {
        assert!(
            DynamicLossScaler::new(init, growth, backoff, interval).is_err(),
            "new({init}, {growth}, {backoff}, {interval}) must fail"
        );
        let bad = ScalerState {
            scale: init,
            growth,
            backoff,
            interval,
            good_steps: 0,
        };
        let before = b.clone();
        assert!(
            b.load_state_dict(&bad).is_err(),
            "load of {bad:?} must fail"
        );
        assert_eq!(b, before, "a failed load changes nothing");
    }
    let bad = ScalerState {
        good_steps: 3,
        ..sd.clone()
    };
    assert!(b.load_state_dict(&bad).is_err(), "good_steps >= interval");
    assert_eq!((b.loss_scale(), b.good_steps()), (16.0, 0));
    let e = DynamicLossScaler::new(1000.0, 2.0, 0.5, 10).unwrap_err();
    assert!(
        e.to_string().contains("must be a power of two") && e.to_string().contains("1024"),
        "{e}"
    );
});

// --------------------------------------------------------- accumulation ----

device_test!(accumulation_equals_one_big_batch, |dev| {
    let gen = Generator::new(21);
    let mut model = Sequential::default();
    model.push(Linear::new(4, 8, true, &gen, dev)?);
    model.push(Silu);
    model.push(Linear::new(8, 3, true, &gen, dev)?);
    let x = t(&randv(32 * 4, 22, 1.0), &[32, 4], dev);
    let y = t(&randv(32 * 3, 23, 1.0), &[32, 3], dev);
    let params = model.parameters();
    let lf = |(x, y): &(Tensor, Tensor)| mse(&model.forward(x)?, y);

    let one = [(x.clone(), y.clone())];
    let l_one = grad_accumulate(&one, lf, None)?;
    let g_one: Vec<Vec<f32>> = params.iter().map(grad).collect();
    let direct = mse(&model.forward(&x)?, &y)?.item()? as f32;
    assert_eq!(l_one, direct);
    for p in &params {
        p.zero_grad();
    }

    let mut micro = vec![];
    let mut start = 0;
    for n in [5, 11, 16] {
        micro.push((x.narrow(0, start, n)?, y.narrow(0, start, n)?));
        start += n;
    }
    let l = grad_accumulate(&micro, lf, None)?;
    assert!((l - l_one).abs() <= 1e-6, "loss {l} vs one batch {l_one}");
    let mut worst = 0.0f32;
    for (p, g1) in params.iter().zip(&g_one) {
        for (a, b) in grad(p).iter().zip(g1) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(worst <= 1e-6, "gradients differ from one batch by {worst}");
    assert!(
        g_one.iter().flatten().any(|g| g.abs() > 1e-2),
        "non-trivial gradients"
    );

    // train_step_mixed over the micro-batches steps like one batch.
    let w0: Vec<Vec<f32>> = params.iter().map(vals).collect();
    let mut opt = sgd(params.clone(), 0.1);
    let r = train_step_mixed(&model, &micro, lf, &mut opt, Precision::Fp32, None, None)?;
    assert!((r.loss - l_one).abs() <= 1e-6);
    for ((p, w0), g1) in params.iter().zip(&w0).zip(&g_one) {
        for ((w, w0), g) in vals(p).iter().zip(w0).zip(g1) {
            assert!((w - (w0 - 0.1 * g)).abs() <= 1e-6);
        }
    }
});

// --------------------------------------------------- train_step_mixed ----

/// A small MLP regression problem: 48 rows, 6 -> 16 -> 3.
fn mlp(dev: Device) -> Result<Sequential> {
    let gen = Generator::new(77);
    let mut m = Sequential::default();
    m.push(Linear::new(6, 16, true, &gen, dev)?);
    m.push(Silu);
    m.push(Linear::new(16, 3, true, &gen, dev)?);
    Ok(m)
}

device_test!(train_step_mixed_bf16_tracks_fp32, |dev| {
    let n = 48;
    let xv = randv(n * 6, 51, 1.0);
    let teacher = randv(6 * 3, 52, 1.0);
    let noise = randv(n * 3, 53, 0.1);
    let mut yv = vec![0.0f32; n * 3];
    for r in 0..n {
        for o in 0..3 {
            let s: f32 = (0..6).map(|i| xv[r * 6 + i] * teacher[i * 3 + o]).sum();
            yv[r * 3 + o] = s + noise[r * 3 + o];
        }
    }
    let x = t(&xv, &[n, 6], dev);
    let y = t(&yv, &[n, 3], dev);
    // Micro-batches of unequal size (20 + 28), as an epoch's last batch would be.
    let micro = [
        (x.narrow(0, 0, 20)?, y.narrow(0, 0, 20)?),
        (x.narrow(0, 20, 28)?, y.narrow(0, 20, 28)?),
    ];
    let train = |prec: Precision| -> Result<(f32, f32, Vec<f32>)> {
        let m = mlp(dev)?;
        let lf = |(x, y): &(Tensor, Tensor)| mse(&m.forward(x)?, y);
        let mut opt = AdamW::new(m.parameters(), AdamWConfig::new(1e-2))?;
        let mut first = None;
        for _ in 0..60 {
            let r = train_step_mixed(&m, &micro, lf, &mut opt, prec, None, None)?;
            assert!(!r.skipped && r.loss.is_finite());
            first.get_or_insert(r.loss);
        }
        // Evaluate both in float32.
        let fin = mse(&m.forward(&x)?, &y)?.item()? as f32;
        Ok((first.unwrap(), fin, vals(&m.parameters()[0])))
    };
    let (first32, fin32, w32) = train(Precision::Fp32)?;
    let (first16, fin16, w16) = train(Precision::Bf16)?;
    assert!(
        fin32 < 0.3 * first32,
        "float32 learns: {first32} -> {fin32}"
    );
    assert!(fin16 < 0.3 * first16, "bf16 learns: {first16} -> {fin16}");
    assert!(
        (fin16 - fin32).abs() <= 0.02 * fin32,
        "bf16 ends at {fin16}, float32 at {fin32}: more than 2% apart"
    );
    assert_ne!(first16, first32, "the bf16 run really rounds");
    assert_ne!(bits(&w16), bits(&w32));
});

device_test!(train_step_mixed_rejects_nan_loss, |dev| {
    let gen = Generator::new(61);
    let lin = Linear::new(3, 2, true, &gen, dev)?;
    let params = lin.parameters();
    let before: Vec<Vec<u32>> = params.iter().map(|p| bits(&vals(p))).collect();
    let mut xv = randv(12, 62, 1.0);
    xv[4] = f32::NAN;
    let good = (
        t(&randv(12, 64, 1.0), &[4, 3], dev),
        t(&randv(8, 65, 1.0), &[4, 2], dev),
    );
    let bad = (t(&xv, &[4, 3], dev), t(&randv(8, 63, 1.0), &[4, 2], dev));
    // A NaN loss whose gradients are all finite (a constant NaN term has
    // derivative 1): only the loss check can stop this update.
    // (First, as pitfall 17 must fail here: the update itself, not a message.)
    let lf_nan = |(x, y): &(Tensor, Tensor)| mse(&lin.forward(x)?, y)?.add_scalar(f64::NAN);
    let l = lf_nan(&good)?;
    l.backward()?;
    assert!(l.item()?.is_nan());
    assert!(
        params.iter().all(|p| grad(p).iter().all(|g| g.is_finite())),
        "the gradients of the NaN loss are finite"
    );
    for p in &params {
        p.zero_grad();
    }
    for prec in [Precision::Fp32, Precision::Bf16] {
        let mut opt = AdamW::new(params.clone(), AdamWConfig::new(1e-2))?;
        let one = [good.clone()];
        let r = train_step_mixed(&lin, &one, lf_nan, &mut opt, prec, None, Some(1.0));
        assert_eq!(
            params.iter().map(|p| bits(&vals(p))).collect::<Vec<_>>(),
            before,
            "{prec:?}: a NaN loss with finite gradients updated the weights"
        );
        assert!(opt.state(0).is_none(), "{prec:?}: the optimizer stepped");
        let e = r.expect_err("a NaN loss with finite gradients is an error");
        assert!(e.to_string().contains("non-finite loss"), "{prec:?}: {e}");
    }
    let micro = [good.clone(), bad];
    let lf = |(x, y): &(Tensor, Tensor)| mse(&lin.forward(x)?, y);
    for prec in [Precision::Fp32, Precision::Bf16] {
        let mut opt = AdamW::new(params.clone(), AdamWConfig::new(1e-2))?;
        let r = train_step_mixed(&lin, &micro, lf, &mut opt, prec, None, None);
        // An error that says what went wrong: the loss itself is not finite
        // (the gradient check behind it would only report the symptom).
        let e = r.expect_err("a NaN loss is an error").to_string();
        assert!(
            e.contains("non-finite loss"),
            "{prec:?}: the error names the loss: {e}"
        );
        let after: Vec<Vec<u32>> = params.iter().map(|p| bits(&vals(p))).collect();
        assert_eq!(after, before, "{prec:?}: no update was made");
        assert!(
            opt.state(0).is_none(),
            "{prec:?}: the optimizer never stepped"
        );
        assert!(
            params.iter().all(|p| p.grad().is_none()),
            "gradients dropped"
        );
        // With clipping too.
        let r = train_step_mixed(&lin, &micro, lf, &mut opt, prec, None, Some(1.0));
        assert!(r.is_err());
        assert_eq!(
            params.iter().map(|p| bits(&vals(p))).collect::<Vec<_>>(),
            before
        );
    }
    // An infinite loss too.
    let mut yv = randv(8, 66, 1.0);
    yv[0] = f32::INFINITY;
    let inf = [(good.0.clone(), t(&yv, &[4, 2], dev))];
    let mut opt = sgd(params.clone(), 0.1);
    assert!(train_step_mixed(&lin, &inf, lf, &mut opt, Precision::Fp32, None, None).is_err());
    assert_eq!(
        params.iter().map(|p| bits(&vals(p))).collect::<Vec<_>>(),
        before
    );
    // With a scaler the same batch is a skipped step, not an error.
    let mut s = DynamicLossScaler::new(1024.0, 2.0, 0.5, 10)?;
    let r = train_step_mixed(
        &lin,
        &micro,
        lf,
        &mut opt,
        Precision::Fp32,
        Some(&mut s),
        None,
    )?;
    assert!(r.skipped && r.loss.is_nan() && r.scale == 512.0);
    assert_eq!(
        params.iter().map(|p| bits(&vals(p))).collect::<Vec<_>>(),
        before
    );
    // And a finite batch steps.
    let r = train_step_mixed(&lin, &[good], lf, &mut opt, Precision::Fp32, None, None)?;
    assert!(!r.skipped && r.loss.is_finite());
    assert_ne!(
        params.iter().map(|p| bits(&vals(p))).collect::<Vec<_>>(),
        before
    );
});

device_test!(train_step_mixed_fp32_opens_no_autocast, |dev| {
    // Spec L11.1: autocast(precision), "none for fp32" — an fp32 step inside
    // an enclosing autocast keeps it (its matmuls round); bf16/fp16 steps
    // open their own, and the enclosing state is back after every step.
    let gen = Generator::new(71);
    let lin = Linear::new(3, 2, false, &gen, dev)?;
    let mb = [(
        t(&randv(12, 72, 1.0), &[4, 3], dev),
        t(&randv(8, 73, 1.0), &[4, 2], dev),
    )];
    let mut opt = sgd(lin.parameters(), 0.0);
    let (bf, fp) = (Some(Format::Bf16), Some(Format::Fp16));
    for (outer, prec, inside) in [
        (None, Precision::Fp32, None),
        (bf, Precision::Fp32, bf),
        (fp, Precision::Fp32, fp),
        (bf, Precision::Fp16, fp),
        (None, Precision::Bf16, bf),
    ] {
        let _ac = outer.map(autocast);
        let mut seen = vec![];
        let lf = |(x, y): &(Tensor, Tensor)| {
            seen.push(autocast_dtype());
            mse(&lin.forward(x)?, y)
        };
        let r = train_step_mixed(&lin, &mb, lf, &mut opt, prec, None, None)?;
        assert_eq!(seen, vec![inside], "{outer:?} around a {prec:?} step");
        assert_eq!(autocast_dtype(), outer, "restored after the step");
        // The loss is the one of the matmuls' format.
        let want = {
            let _ac = inside.map(autocast);
            mse(&lin.forward(&mb[0].0)?, &mb[0].1)?.item()? as f32
        };
        assert_eq!(r.loss.to_bits(), want.to_bits(), "{outer:?} {prec:?}");
    }
});

device_test!(precision_names_parse_and_print, |_dev| {
    use tinyllm::precision::Precision;
    for (s, p) in [
        ("fp32", Precision::Fp32),
        ("float32", Precision::Fp32),
        ("bf16", Precision::Bf16),
        ("bfloat16", Precision::Bf16),
        ("fp16", Precision::Fp16),
        ("float16", Precision::Fp16),
    ] {
        assert_eq!(s.parse::<Precision>()?, p, "{s}");
    }
    assert_eq!(Precision::Fp32.name(), "fp32");
    assert_eq!(Precision::Bf16.name(), "bf16");
    assert_eq!(Precision::Fp16.name(), "fp16");
    assert_eq!(Precision::Bf16.format(), Some(Format::Bf16));
    assert_eq!(Precision::Fp32.format(), None);
    let e = "fp8".parse::<Precision>().unwrap_err();
    assert!(e.to_string().contains("fp32, bf16 or fp16"), "{e}");
});

device_test!(scaler_reports_the_scale_floor_instead_of_looping, |dev| {
    // A gradient that is infinite at every scale: each step skips and halves
    // S; once S falls below MIN_SCALE (2^-24) the step is an error, not one more
    // skip, so a poisoned run stops instead of looping forever.
    use tinyllm::precision::DynamicLossScaler;
    let p = param(&[1.0], &[1], dev);
    let mut opt = Sgd::new(vec![p.clone()], 0.1, 0.0, 0.0)?;
    let mut s = DynamicLossScaler::new(1.0, 2.0, 0.5, 10)?;
    let mut skips = 0;
    let err = loop {
        p.set_grad(Some(t(&[f32::INFINITY], &[1], dev)));
        match s.step(&mut opt, std::slice::from_ref(&p), None) {
            Ok(false) => skips += 1,
            Ok(true) => panic!("stepped on an infinite gradient"),
            Err(e) => break e,
        }
        assert!(skips < 100, "no floor");
    };
    // S = 2^-k after k skips; 2^-25 is the first below 2^-24.
    assert_eq!(skips, 24);
    assert!(err.to_string().contains("loss scale fell"), "{err}");
    assert_eq!(vals(&p), vec![1.0], "no update reached the weights");
    assert!(p.grad().is_none(), "the poisoned gradients were dropped");
});

// ------------------------------------------------ 16-bit operands ----

// A product reading an operand from 16-bit storage (as backward reads the
// activations autograd kept) equals the product over its unpacked values,
// bit for bit: bf16 and fp16, A, B or both packed, every layout, and sizes
// odd enough that rows and batches start in the middle of a word. On the CPU
// also whole panels of both operands (its vector packing) and products
// rounding to the other format or not at all (it skips re-rounding only
// values of the product's own format); lavapipe takes minutes over those.
device_test!(products_read_16_bit_operands_as_their_values, |dev| {
    use tinyllm::backend::{Causal, MatmulDims, Operand, Storage};
    let cpu = dev == Device::Cpu;
    let sizes: &[(usize, usize, usize, usize)] = if cpu {
        &[(3, 7, 13, 9), (2, 13, 21, 70)]
    } else {
        &[(3, 7, 13, 9)]
    };
    for &(batch, m, k, n) in sizes {
        let mut a = randv(batch * m * k, 5, 40.0);
        let b = randv(batch * k * n, 6, 3.0);
        for (i, v) in a.iter_mut().enumerate().filter(|(i, _)| i % 11 == 4) {
            *v = [0.0, -0.0, 1e-41, f32::INFINITY, f32::NAN, 70000.0][i % 6];
        }
        for fmt in [Format::Bf16, Format::Fp16] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let d = MatmulDims {
                    batch,
                    m,
                    k,
                    n,
                    trans_a: ta,
                    trans_b: tb,
                    a_batch_stride: m * k,
                    b_batch_stride: k * n,
                    causal: Causal::No,
                    tokens: Default::default(),
                };
                let (sa, sb) = (
                    Storage::from_f32(a.clone(), dev)?,
                    Storage::from_f32(b.clone(), dev)?,
                );
                let (pa, pb) = (sa.pack(fmt)?.0, sb.pack(fmt)?.0);
                let (wa, wb) = (Operand::Values(pa.unpack()?), Operand::Values(pb.unpack()?));
                let (ha, hb) = (Operand::Half(pa), Operand::Half(pb));
                let other = [Format::Bf16, Format::Fp16].into_iter().find(|&f| f != fmt);
                let rounds = if cpu {
                    vec![Some(fmt), other, None]
                } else {
                    vec![Some(fmt)]
                };
                for round in rounds {
                    let want = bits(&wa.matmul(&wb, d, round)?.to_vec_f32()?);
                    for (what, x, y) in [("A", &ha, &wb), ("B", &wa, &hb), ("A and B", &ha, &hb)] {
                        let got = bits(&x.matmul(y, d, round)?.to_vec_f32()?);
                        assert!(
                        got == want,
                        "{fmt} {what} in 16 bits, rounded to {round:?}, ta {ta} tb {tb}, {m}×{k}×{n}: differs from unpacked"
                    );
                    }
                }
            }
        }
    }
});
