//! Autograd semantics (spec L0.1) and every op's backward against central
//! finite differences in f64.

mod common;
use common::*;
use tinyllm::ops::{cross_entropy, mse};
use tinyllm::{no_grad, DType, Generator};

/// Checks d(sum(f(x) * w))/dx against central differences, for a fixed random
/// weighting `w` so every output entry matters.
fn gradcheck(shape: &[usize], f: impl Fn(&Tensor) -> Result<Tensor>, seed: u64) {
    let n: usize = shape.iter().product();
    let x0: Vec<f64> = randv(n, seed, 1.0)
        .into_iter()
        .map(|v| v as f64 * 1.5 + 0.1 * (v as f64).signum())
        .collect();
    let x = Tensor::from_vec_f64(x0.clone(), shape, Device::Cpu)
        .unwrap()
        .requires_grad_(true);
    let y = f(&x).unwrap();
    let w: Vec<f64> = randv(y.numel(), seed + 1, 1.0)
        .into_iter()
        .map(f64::from)
        .collect();
    let wt = Tensor::from_vec_f64(w.clone(), y.shape(), Device::Cpu).unwrap();
    y.mul(&wt).unwrap().sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap().to_vec_f64().unwrap();
    let eps = 1e-6;
    for i in 0..n {
        let eval = |d: f64| {
            let mut xv = x0.clone();
            xv[i] += d;
            let xt = Tensor::from_vec_f64(xv, shape, Device::Cpu).unwrap();
            let y = f(&xt).unwrap().to_vec_f64().unwrap();
            y.iter().zip(&w).map(|(a, b)| a * b).sum::<f64>()
        };
        let fd = (eval(eps) - eval(-eps)) / (2.0 * eps);
        let tol = 1e-6 * (1.0 + fd.abs());
        assert!(
            (fd - g[i]).abs() <= tol,
            "element {i}: analytic {} vs finite difference {fd}",
            g[i]
        );
    }
}

fn c64(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec_f64(v.to_vec(), shape, Device::Cpu).unwrap()
}

#[test]
fn finite_differences_unary() {
    gradcheck(&[3, 4], |x| x.neg(), 1);
    gradcheck(&[3, 4], |x| x.exp(), 2);
    gradcheck(&[3, 4], |x| x.square()?.add_scalar(0.5)?.log(), 3);
    gradcheck(&[3, 4], |x| x.square()?.add_scalar(0.5)?.sqrt(), 4);
    gradcheck(&[3, 4], |x| x.square()?.add_scalar(0.5)?.rsqrt(), 5);
    gradcheck(&[3, 4], |x| x.square()?.add_scalar(0.5)?.recip(), 6);
    gradcheck(&[3, 4], |x| x.sigmoid(), 7);
    gradcheck(&[3, 4], |x| x.silu(), 8);
    gradcheck(&[3, 4], |x| x.relu(), 9);
    gradcheck(
        &[3, 4],
        |x| x.mul_scalar(3.0)?.div_scalar(7.0)?.add_scalar(1.0),
        10,
    );
}

#[test]
fn finite_differences_binary_with_broadcasting() {
    let b = c64(&[0.5, -1.5, 2.0, 0.7], &[4]);
    let col = c64(&[1.2, -0.4, 0.9], &[3, 1]);
    gradcheck(&[3, 4], |x| x.add(&b), 11);
    gradcheck(&[3, 4], |x| x.sub(&col), 12);
    gradcheck(&[3, 4], |x| x.mul(&b), 13);
    gradcheck(&[3, 4], |x| x.div(&col), 14);
    gradcheck(&[3, 4], |x| b.div(&x.square()?.add_scalar(1.0)?), 15);
    // the broadcast operand is the one differentiated
    let big = c64(
        &(0..12).map(|i| i as f64 * 0.3 - 1.0).collect::<Vec<_>>(),
        &[3, 4],
    );
    gradcheck(&[4], |x| big.mul(x), 16);
    gradcheck(&[3, 1], |x| big.sub(x), 17);
    gradcheck(&[3, 4], |x| x.mul(x), 18);
}

#[test]
fn finite_differences_reductions_and_views() {
    gradcheck(&[2, 3, 4], |x| x.sum(1, false), 21);
    gradcheck(&[2, 3, 4], |x| x.mean(-1, true), 22);
    gradcheck(&[2, 3, 4], |x| x.max(2, false), 23);
    gradcheck(&[2, 3, 4], |x| x.sum_all(), 24);
    gradcheck(&[2, 3, 4], |x| x.permute(&[2, 0, 1]), 25);
    gradcheck(&[2, 3, 4], |x| x.transpose(0, 2), 26);
    gradcheck(&[2, 3, 4], |x| x.narrow(2, 1, 2), 27);
    gradcheck(
        &[2, 3, 4],
        |x| Tensor::cat(&[x, &x.narrow(1, 0, 1)?], 1),
        28,
    );
    gradcheck(
        &[3, 4],
        |x| x.reshape(&[2, 6])?.broadcast_to(&[5, 2, 6]),
        29,
    );
}

#[test]
fn finite_differences_matmul_every_transpose() {
    let m = c64(
        &randv(20, 31, 1.0)
            .into_iter()
            .map(f64::from)
            .collect::<Vec<_>>(),
        &[4, 5],
    );
    let bm = c64(
        &randv(40, 32, 1.0)
            .into_iter()
            .map(f64::from)
            .collect::<Vec<_>>(),
        &[2, 4, 5],
    );
    gradcheck(&[3, 4], |x| x.matmul(&m), 33);
    gradcheck(&[4, 5], |x| m.transpose(0, 1)?.matmul(x), 34);
    gradcheck(&[3, 5], |x| x.matmul_t(&m), 35);
    gradcheck(
        &[5, 3],
        |x| tinyllm::ops::matmul::matmul_with(x, &m, true, true, None),
        36,
    );
    gradcheck(
        &[4, 3],
        |x| tinyllm::ops::matmul::matmul_with(x, &m, true, false, None),
        37,
    );
    gradcheck(&[2, 3, 4], |x| x.matmul(&bm), 38);
    gradcheck(&[2, 4, 5], |x| bm.matmul_t(x), 39);
    gradcheck(&[2, 3, 4], |x| x.matmul(&m), 40);
    gradcheck(&[4, 5], |x| bm.reshape(&[2, 5, 4])?.matmul(x), 41);
}

#[test]
fn finite_differences_nn_functions() {
    gradcheck(&[3, 5], |x| x.softmax(), 51);
    gradcheck(&[3, 5], |x| x.log_softmax(), 52);
    gradcheck(&[2, 4, 4], |x| x.causal_mask()?.softmax(), 53);
    // causal attention in q, in k and in v
    let other = |seed| {
        let v: Vec<f64> = randv(2 * 5 * 4, seed, 1.0)
            .iter()
            .map(|&x| x as f64)
            .collect();
        c64(&v, &[2, 5, 4])
    };
    let (k, v) = (other(61), other(62));
    gradcheck(&[2, 5, 4], |q| q.causal_attention(&k, &v, 0.5), 58);
    gradcheck(&[2, 5, 4], |k| v.causal_attention(k, &v, 0.5), 59);
    gradcheck(&[2, 5, 4], |v| k.causal_attention(&k, v, 0.5), 60);
    gradcheck(&[4, 6], |x| cross_entropy(x, &[0, 5, 2, 2]), 54);
    let target = c64(&[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], &[2, 3]);
    gradcheck(&[2, 3], |x| mse(x, &target), 55);
    gradcheck(&[5, 3], |x| x.embedding(&[4, 0, 4, 2]), 56);
    let ln = tinyllm::nn::RmsNorm::new(4, 1e-5, Device::Cpu).unwrap();
    gradcheck(&[3, 4], |x| tinyllm::nn::Layer::forward(&ln, x), 57);
}

#[test]
fn grads_accumulate_and_a_tensor_used_twice_gets_both() {
    let x = param(&[3.0], &[1], Device::Cpu);
    x.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad(&x), vec![6.0]);
    x.mul_scalar(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grad(&x), vec![8.0], "backward adds into .grad");
    x.zero_grad();
    assert!(x.grad().is_none());
}

#[test]
fn from_op_records_only_with_grad_mode_and_a_grad_parent() {
    let a = param(&[1.0, 2.0], &[2], Device::Cpu);
    let c = t(&[1.0, 1.0], &[2], Device::Cpu);
    assert!(a.add(&c).unwrap().requires_grad());
    assert!(
        !c.add(&c).unwrap().requires_grad(),
        "no parent requires grad: a constant"
    );
    {
        let _g = no_grad();
        assert!(!a.add(&c).unwrap().requires_grad());
        {
            let _inner = no_grad();
        }
        assert!(
            !tinyllm::is_grad_enabled(),
            "leaving an inner guard keeps the outer one"
        );
        let _on = tinyllm::set_grad_enabled(true);
        assert!(a.add(&c).unwrap().requires_grad());
    }
    assert!(tinyllm::is_grad_enabled());
}

#[test]
fn no_grad_survives_a_panic() {
    let r = std::panic::catch_unwind(|| {
        let _g = no_grad();
        panic!("inside no_grad");
    });
    assert!(r.is_err());
    assert!(
        tinyllm::is_grad_enabled(),
        "grad mode restored during unwinding"
    );
}

#[test]
fn backward_frees_saved_values_as_it_goes() {
    // A chain of 6 (x * 0.5).exp() over 64k floats: each exp saves its output,
    // each scalar product saves nothing.
    let x = Tensor::from_vec(vec![0.01; 1 << 16], &[1 << 16], Device::Cpu)
        .unwrap()
        .requires_grad_(true);
    let mut h = x.clone();
    for _ in 0..6 {
        h = h.mul_scalar(0.5).unwrap().exp().unwrap();
    }
    let loss = h.sum_all().unwrap();
    drop(h);
    let held = tinyllm::memory::live_bytes();
    tinyllm::memory::reset_peak();
    loss.backward().unwrap();
    let peak = tinyllm::memory::peak_bytes();
    // Everything the graph held is released by the end, and the peak during
    // backward stays near the start (values are freed as nodes run, so it never
    // holds the graph plus all the gradients).
    drop(loss);
    let after = tinyllm::memory::live_bytes();
    let one = (1 << 16) * 4;
    assert!(
        after <= 2 * one + 64,
        "after backward only x and its grad remain: {after}"
    );
    assert!(peak <= held + 3 * one, "peak {peak} vs held {held}");
    // The graph holds exactly x and the six exp outputs: the products'
    // results are not kept by anything (ops save only what backward reads).
    assert!(
        (7 * one..7 * one + 64).contains(&held),
        "the graph held {held} bytes, expected 7 x {one}"
    );
}

#[test]
fn backward_twice_is_a_clear_error() {
    let x = param(&[1.0], &[1], Device::Cpu);
    let y = x.exp().unwrap().sum_all().unwrap();
    y.backward().unwrap();
    let e = y.backward().unwrap_err();
    assert!(e.to_string().contains("already freed"), "{e}");
}

#[test]
fn shape_errors_are_clear() {
    let a = t(&[1.0; 6], &[2, 3], Device::Cpu);
    let b = t(&[1.0; 8], &[2, 4], Device::Cpu);
    assert!(a
        .add(&b)
        .unwrap_err()
        .to_string()
        .contains("do not broadcast"));
    assert!(a
        .matmul(&b)
        .unwrap_err()
        .to_string()
        .contains("inner dimensions"));
    assert!(a
        .reshape(&[4])
        .unwrap_err()
        .to_string()
        .contains("cannot reshape"));
    assert!(Tensor::zeros(&[2], DType::F64, Device::Cpu).is_ok());
    let _ = Generator::new(1);
}

// A weight that feeds one node gets its `.grad` of earlier backward passes
// added in as that node's kernel writes its gradient (the product's and
// RMSNorm's stores): the bits of `.grad + new`, the add it replaces, under
// autocast too. A weight used twice still sums its contributions first.
device_test!(accumulated_weight_gradients_are_grad_plus_new, |dev| {
    let w = param(&randv(12, 1, 1.0), &[3, 4], dev);
    let n = param(&randv(4, 2, 1.0), &[4], dev);
    let xs: Vec<Tensor> = (0..2)
        .map(|i| t(&randv(40, 10 + i, 2.0), &[2, 5, 4], dev))
        .collect();
    // one micro-batch's gradients of (w, n), alone or into `.grad`
    let pass = |x: &Tensor, w: &Tensor, n: &Tensor, twice: bool| -> Result<()> {
        let _ac = tinyllm::precision::autocast_bf16();
        let h = x.rms_norm(n, 1e-5)?;
        let mut y = h.matmul_t(w)?;
        if twice {
            y = y.add(&x.matmul_t(w)?)?;
        }
        y.sum_all()?.backward()
    };
    for twice in [false, true] {
        let (w, n) = (
            w.detach().requires_grad_(true),
            n.detach().requires_grad_(true),
        );
        pass(&xs[0], &w, &n, twice)?;
        let first = (grad(&w), grad(&n));
        pass(&xs[1], &w, &n, twice)?;
        // the second micro-batch's contributions alone
        let (w2, n2) = (
            w.detach().requires_grad_(true),
            n.detach().requires_grad_(true),
        );
        pass(&xs[1], &w2, &n2, twice)?;
        let sum =
            |a: &[f32], b: &[f32]| bits(&a.iter().zip(b).map(|(a, b)| a + b).collect::<Vec<_>>());
        assert_eq!(
            bits(&grad(&w)),
            sum(&first.0, &grad(&w2)),
            "w, twice {twice}"
        );
        assert_eq!(
            bits(&grad(&n)),
            sum(&first.1, &grad(&n2)),
            "rms norm weight, twice {twice}"
        );
    }
});
