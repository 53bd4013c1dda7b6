//! Layers and optimizers (spec L0.4, M10.2–M10.4), on every device.

mod common;
use common::t as t_;
use common::*;
use std::rc::Rc;
use tinyllm::nn::{Dropout, Embedding, Layer, Linear, Module, RmsNorm, Sequential, Silu};
use tinyllm::optim::{clip_grad_norm_, AdamW, AdamWConfig, Optimizer, Sgd};
use tinyllm::Generator;

/// Each of the named bit vectors of a fused run equals the composition's.
fn same_bits(names: &[&str], fused: &[Vec<u32>], composed: &[Vec<u32>], case: &str) {
    for (what, (f, c)) in names.iter().zip(fused.iter().zip(composed)) {
        let diff = f.iter().zip(c).filter(|(a, b)| a != b).count();
        assert_eq!(
            diff,
            0,
            "{what}: {diff} of {} values differ ({case})",
            f.len()
        );
    }
}

/// q, k `(2, 3, t, 8)` and v of `v_shape` (random, from `seed`), under bf16
/// autocast or not: `fused(q, k, v)` against `composed(q, k, v)`, the output
/// and the gradients of q, k and v bit for bit.
fn attention_case(
    dev: Device,
    t: usize,
    bf16: bool,
    seed: u64,
    v_shape: &[usize],
    fused: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    composed: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<()> {
    let shape = [2, 3, t, 8];
    let n = 2 * 3 * t * 8;
    let (q0, k0, v0, w) = (
        randv(n, seed, 2.0),
        randv(n, seed + 1, 2.0),
        randv(n, seed + 2, 1.0),
        randv(n, seed + 3, 1.0),
    );
    let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>| -> Result<Vec<Vec<u32>>> {
        let _ac = bf16.then(tinyllm::precision::autocast_bf16);
        let (q, k, v) = (
            param(&q0, &shape, dev),
            param(&k0, &shape, dev),
            param(&v0, v_shape, dev),
        );
        let y = f(&q, &k, &v)?;
        y.mul(&t_(&w, y.shape(), dev))?.sum_all()?.backward()?;
        Ok(vec![
            bits(&vals(&y)),
            bits(&grad(&q)),
            bits(&grad(&k)),
            bits(&grad(&v)),
        ])
    };
    same_bits(
        &["y", "dq", "dk", "dv"],
        &run(fused)?,
        &run(composed)?,
        &format!("T {t}, bf16 {bf16}"),
    );
    Ok(())
}

// The fused causal attention against the composition it replaces, forward
// and every gradient, bit for bit — in float32 and under bf16 autocast, over
// sequence lengths that cross both devices' tiles raggedly (and, on the CPU,
// two k-blocks of its products).
device_test!(causal_attention_is_its_composition_bit_for_bit, |dev| {
    let lengths: &[usize] = if dev == Device::Cpu {
        &[1, 13, 40, 300]
    } else {
        &[1, 13, 40]
    };
    for &t in lengths {
        for bf16 in [false, true] {
            attention_case(
                dev,
                t,
                bf16,
                1,
                &[2, 3, t, 8],
                &|q, k, v| q.causal_attention(k, v, 0.35),
                &|q, k, v| q.matmul_t(k)?.causal_softmax(0.35)?.matmul(v),
            )?;
        }
    }
});

// The token-major attention (values and output `(B, T, H, D)`, which the
// CPU's per-head schedule reads and writes in place) against the permutes
// around the composition, forward and every gradient, bit for bit.
device_test!(token_major_attention_is_the_permuted_composition, |dev| {
    let lengths: &[usize] = if dev == Device::Cpu {
        &[1, 13, 300]
    } else {
        &[1, 13]
    };
    for &t in lengths {
        for bf16 in [false, true] {
            attention_case(
                dev,
                t,
                bf16,
                5,
                &[2, t, 3, 8],
                &|q, k, v| q.causal_attention_tokens(k, v, 0.35),
                &|q, k, v| {
                    let vh = v.permute(&[0, 2, 1, 3])?;
                    q.matmul_t(k)?
                        .causal_softmax(0.35)?
                        .matmul(&vh)?
                        .permute(&[0, 2, 1, 3])
                },
            )?;
        }
    }
    // shapes that do not fit (B, H, T, D) q, k and (B, T, H, D) v
    let (q, v) = (
        param(&randv(48, 9, 1.0), &[2, 3, 2, 4], dev),
        param(&randv(48, 9, 1.0), &[2, 3, 2, 4], dev),
    );
    let e = q.causal_attention_tokens(&q, &v, 0.5).unwrap_err();
    assert!(
        e.to_string().contains("causal_attention_tokens needs"),
        "{e}"
    );
});

// A residual sum formed by the product (`matmul_t_add`) against the product
// followed by the sum, forward and every gradient, bit for bit — f32 and
// bf16 autocast, batched inputs over ragged tiles and, on the CPU, several
// k-blocks. `x` also feeds a second op that runs first in backward, so its
// gradient from the product adds into one gathered before (the backward's
// addend).
device_test!(residual_sum_in_the_product_is_the_composition, |dev| {
    let shapes: &[(usize, usize, usize, usize)] = if dev == Device::Cpu {
        // a batch split over the threads; one product's rows split (its
        // addend from a row offset), k over several k-blocks
        &[
            (1, 1, 3, 2),
            (2, 7, 13, 5),
            (3, 40, 70, 37),
            (1, 300, 700, 37),
        ]
    } else {
        &[(1, 1, 3, 2), (2, 7, 13, 5)]
    };
    for &(b, t, k, n) in shapes {
        for bf16 in [false, true] {
            let (xs, ws, es) = ([b, t, k], [n, k], [b, t, n]);
            let (x0, w0, e0) = (
                randv(b * t * k, 11, 1.0),
                randv(n * k, 12, 1.0),
                randv(b * t * n, 13, 1.0),
            );
            let (wy, wx) = (randv(b * t * n, 14, 1.0), randv(b * t * k, 15, 1.0));
            // `apart`: x's other use reads a second leaf of the same values,
            // so the two gradients come apart and are added here instead
            let run = |fused: bool, apart: bool| -> Result<Vec<Vec<u32>>> {
                let _ac = bf16.then(tinyllm::precision::autocast_bf16);
                let (x, w, e) = (
                    param(&x0, &xs, dev),
                    param(&w0, &ws, dev),
                    param(&e0, &es, dev),
                );
                let x2 = if apart {
                    param(&x0, &xs, dev)
                } else {
                    x.clone()
                };
                let y = if fused {
                    x.matmul_t_add(&w, &e)?
                } else {
                    e.add(&x.matmul_t(&w)?)?
                };
                // x's other use takes y, so its backward runs before the
                // product's, whose gradient for x adds into it
                let other = x2.mul(&y.sum_all()?)?.mul(&t_(&wx, &xs, dev))?.sum_all()?;
                y.mul(&t_(&wy, &es, dev))?
                    .sum_all()?
                    .add(&other)?
                    .backward()?;
                let dx: Vec<f32> = match apart {
                    true => grad(&x2).iter().zip(grad(&x)).map(|(a, b)| a + b).collect(),
                    false => grad(&x),
                };
                Ok(vec![
                    bits(&vals(&y)),
                    bits(&dx),
                    bits(&grad(&w)),
                    bits(&grad(&e)),
                ])
            };
            // the product's input gradient added into the gathered one
            // equals the two added apart
            let (gathered, apart) = (run(true, false)?, run(true, true)?);
            assert_eq!(
                gathered[1], apart[1],
                "dx ({b}x{t}x{k} -> {n}, bf16 {bf16})"
            );
            let (fused, composed) = (gathered, run(false, false)?);
            same_bits(
                &["y", "dx", "dw", "de"],
                &fused,
                &composed,
                &format!("{b}x{t}x{k} -> {n}, bf16 {bf16}"),
            );
        }
    }
});

// Layers reading one input (q, k and v; gate and up) run as one primitive:
// each output and every gradient is the single layer's, bit for bit, in
// float32 and under bf16 autocast; the weights end up side by side (on a
// GPU one dispatch), through an optimizer step that updates them in place,
// and again after a load puts them apart.
device_test!(shared_input_layers_are_each_layer, |dev| {
    let gen = Generator::new(7);
    let (b, t, k, n) = (2, 4, 16, 8);
    let (x0, w) = (randv(b * t * k, 21, 1.0), randv(b * t * n, 22, 1.0));
    for bf16 in [false, true] {
        let run = |shared: bool| -> Result<Vec<Vec<u32>>> {
            let _ac = bf16.then(tinyllm::precision::autocast_bf16);
            let ls: Vec<Linear> = (0..3)
                .map(|_| Linear::normal(k, n, 0.5, &Generator::new(3), dev))
                .collect::<Result<_>>()?;
            for (i, l) in ls.iter().enumerate() {
                l.weight
                    .assign(&t_(&randv(n * k, 30 + i as u64, 1.0), &[n, k], dev))?;
            }
            let x = param(&x0, &[b, t, k], dev);
            let ys: Vec<Tensor> = match shared {
                true => Linear::forward_shared(&x, [&ls[0], &ls[1], &ls[2]])?.to_vec(),
                false => ls.iter().map(|l| l.forward(&x)).collect::<Result<_>>()?,
            };
            let weighted = |y: &Tensor, i: usize| {
                y.mul_scalar(i as f64 + 1.0)?
                    .mul(&t_(&w, &[b, t, n], dev))?
                    .sum_all()
            };
            let mut loss = weighted(&ys[0], 0)?;
            for (i, y) in ys.iter().enumerate().skip(1) {
                loss = loss.add(&weighted(y, i)?)?;
            }
            loss.backward()?;
            let mut out: Vec<Vec<u32>> = ys.iter().map(|y| bits(&vals(y))).collect();
            out.push(bits(&grad(&x)));
            out.extend(ls.iter().map(|l| bits(&grad(&l.weight))));
            let ws = [&ls[0].weight, &ls[1].weight, &ls[2].weight];
            assert_eq!(
                Tensor::side_by_side(&ws),
                shared || dev != Device::Gpu,
                "laid out (bf16 {bf16})"
            );
            Ok(out)
        };
        same_bits(
            &["q", "k", "v", "dx", "dWq", "dWk", "dWv"],
            &run(true)?,
            &run(false)?,
            &format!("bf16 {bf16}"),
        );
    }
    // side by side through an update in place; apart after a load, then
    // side by side again at the next forward, with the loaded values
    let ls: Vec<Linear> = (0..2)
        .map(|_| Linear::normal(k, n, 0.5, &gen, dev))
        .collect::<Result<_>>()?;
    let ws = [&ls[0].weight, &ls[1].weight];
    let x = param(&x0, &[b, t, k], dev);
    let [g, u] = Linear::forward_shared(&x, [&ls[0], &ls[1]])?;
    g.add(&u)?.sum_all()?.backward()?;
    let mut opt = AdamW::new(
        ws.iter().map(|&w| w.clone()).collect(),
        AdamWConfig::new(1e-2),
    )?;
    opt.step()?;
    assert!(Tensor::side_by_side(&ws), "after the update");
    let loaded = randv(n * k, 40, 1.0);
    ls[1].weight.assign(&t_(&loaded, &[n, k], dev))?;
    assert_eq!(
        Tensor::side_by_side(&ws),
        dev != Device::Gpu,
        "after the load"
    );
    let before = vals(&ls[0].weight);
    let [_, u] = Linear::forward_shared(&x, [&ls[0], &ls[1]])?;
    assert!(Tensor::side_by_side(&ws), "at the next forward");
    assert_eq!(bits(&vals(&ls[1].weight)), bits(&loaded));
    assert_eq!(bits(&vals(&ls[0].weight)), bits(&before));
    assert_eq!(bits(&vals(&u)), bits(&vals(&ls[1].forward(&x)?)));
});

// AdamW over many parameters (on a GPU laid out side by side and updated a
// few a dispatch) gives each parameter the bits an AdamW of its own gives
// it: parameters of odd and empty sizes, one without a gradient at a step
// (its step count falls behind the others'), clipped steps, and a load that
// puts one parameter's buffer apart (laid out again at the next step).
device_test!(adamw_over_many_parameters_is_each_alone, |dev| {
    let shapes: [&[usize]; 7] = [&[5], &[30, 10], &[1], &[0], &[8, 8], &[7], &[3, 3]];
    let make = || -> Vec<Tensor> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| param(&randv(s.iter().product(), 50 + i as u64, 1.0), s, dev))
            .collect()
    };
    let (together, alone) = (make(), make());
    let cfg = AdamWConfig::new(1e-2);
    let mut one = AdamW::new(together.clone(), cfg)?;
    let mut each: Vec<AdamW> = alone
        .iter()
        .map(|p| AdamW::new(vec![p.clone()], cfg))
        .collect::<Result<_>>()?;
    for step in 0..4u64 {
        for (i, (a, b)) in together.iter().zip(&alone).enumerate() {
            // parameter 2 has no gradient at step 1
            let g = (step != 1 || i != 2).then(|| {
                t_(
                    &randv(a.numel(), 100 * step + i as u64, 0.1),
                    a.shape(),
                    dev,
                )
            });
            a.set_grad(g.clone());
            b.set_grad(g.map(|g| t_(&vals(&g), b.shape(), dev)));
        }
        if step == 3 {
            // a load: parameter 4's buffer replaced
            let w = randv(64, 77, 1.0);
            together[4].assign(&t_(&w, &[8, 8], dev))?;
            alone[4].assign(&t_(&w, &[8, 8], dev))?;
        }
        match step {
            2 => {
                one.step_scaled(0.5)?;
                each.iter_mut().try_for_each(|o| o.step_scaled(0.5))?;
            }
            _ => {
                one.step()?;
                each.iter_mut().try_for_each(|o| o.step())?;
            }
        }
        for (i, (a, b)) in together.iter().zip(&alone).enumerate() {
            assert_eq!(
                bits(&vals(a)),
                bits(&vals(b)),
                "parameter {i} after step {step}"
            );
            let (sa, sb) = (one.state(i).unwrap(), each[i].state(0).unwrap());
            assert_eq!(
                (bits(&vals(&sa.0)), bits(&vals(&sa.1)), sa.2),
                (bits(&vals(&sb.0)), bits(&vals(&sb.1)), sb.2)
            );
        }
        let ps: Vec<&Tensor> = together.iter().collect();
        assert!(Tensor::side_by_side(&ps), "laid out after step {step}");
    }
});

device_test!(linear_is_x_w_transposed_plus_b, |dev| {
    let gen = Generator::new(0);
    let l = Linear::new(3, 2, true, &gen, dev)?;
    assert_eq!(l.weight.shape(), &[2, 3], "weight is (out, in)");
    l.weight
        .assign(&t(&[1.0, 2.0, 3.0, -1.0, 0.5, 0.25], &[2, 3], dev))?;
    l.bias
        .as_ref()
        .unwrap()
        .assign(&t(&[0.5, -0.5], &[2], dev))?;
    let x = t(&[1.0, 1.0, 2.0, 0.0, 4.0, -2.0], &[2, 3], dev);
    let y = l.forward(&x)?;
    assert_eq!(
        vals(&y),
        vec![
            1.0 + 2.0 + 6.0 + 0.5,
            -1.0 + 0.5 + 0.5 - 0.5,
            0.0 + 8.0 - 6.0 + 0.5,
            0.0 + 2.0 - 0.5 - 0.5
        ]
    );
    let names: Vec<_> = l.parameters().iter().map(|p| p.shape().to_vec()).collect();
    assert_eq!(
        names,
        vec![vec![2, 3], vec![2]],
        "stable order: weight, bias"
    );
});

device_test!(rmsnorm_normalises_the_last_axis, |dev| {
    let n = RmsNorm::new(4, 0.0, dev)?;
    let x = t(&[2.0, 2.0, 2.0, 2.0, 1.0, -1.0, 1.0, -1.0], &[2, 4], dev);
    let y = n.forward(&x)?;
    assert_eq!(vals(&y), vec![1.0, 1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0]);
});

device_test!(embedding_looks_up_rows_and_scatters_grads, |dev| {
    let e = Embedding::new(4, 2, 1.0, &Generator::new(1), dev)?;
    e.weight
        .assign(&t(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &[4, 2], dev))?;
    let y = e.forward(&[3, 1, 3])?;
    assert_eq!(vals(&y), vec![6.0, 7.0, 2.0, 3.0, 6.0, 7.0]);
    y.sum_all()?.backward()?;
    assert_eq!(
        grad(&e.weight),
        vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 2.0, 2.0]
    );
    assert!(e
        .forward(&[4])
        .unwrap_err()
        .to_string()
        .contains("out of range"));
});

device_test!(dropout_masks_scale_and_replay, |dev| {
    let gen = Generator::new(42);
    let d = Dropout::new(0.25, &gen)?;
    let x = Tensor::ones(&[4096], tinyllm::DType::F32, dev)?;
    let start = gen.state();
    let y1 = vals(&d.forward(&x)?);
    let kept = y1.iter().filter(|&&v| v != 0.0).count();
    assert!((2900..3250).contains(&kept), "about 75% kept, got {kept}");
    assert!(y1
        .iter()
        .all(|&v| v == 0.0 || v == tinyllm::backend::math::div(1.0, 0.75)));
    assert_ne!(gen.state(), start, "the stream advanced");
    gen.set_state(start);
    assert_eq!(
        bits(&vals(&d.forward(&x)?)),
        bits(&y1),
        "same state, same mask"
    );
    d.set_training(false);
    assert_eq!(vals(&d.forward(&x)?), vals(&x), "identity in eval mode");
    assert!(Dropout::new(1.0, &gen).is_err());
});

device_test!(sequential_chains_and_lists_parameters_in_order, |dev| {
    let gen = Generator::new(3);
    let a = Linear::new(4, 8, true, &gen, dev)?;
    let b = Linear::new(8, 2, false, &gen, dev)?;
    let ids = [a.weight.id(), a.bias.as_ref().unwrap().id(), b.weight.id()];
    let s = Sequential::new(vec![Rc::new(a), Rc::new(Silu), Rc::new(b)]);
    let got: Vec<_> = s.parameters().iter().map(|p| p.id()).collect();
    assert_eq!(got, ids);
    let y = s.forward(&t(&randv(12, 5, 1.0), &[3, 4], dev))?;
    assert_eq!(y.shape(), &[3, 2]);
});

/// PyTorch's AdamW in f64, for one scalar parameter.
fn adamw_reference(p0: f64, grads: &[f64], c: AdamWConfig) -> f64 {
    let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
    let (lr, b1, b2, eps, wd) = (
        c.lr as f64,
        c.beta1 as f64,
        c.beta2 as f64,
        c.eps as f64,
        c.weight_decay as f64,
    );
    for (t, &g) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        p *= 1.0 - lr * wd;
        m = b1 * m + (1.0 - b1) * g;
        v = b2 * v + (1.0 - b2) * g * g;
        let denom = (v.sqrt() / (1.0 - b2.powi(t)).sqrt()) + eps;
        p -= lr / (1.0 - b1.powi(t)) * m / denom;
    }
    p
}

device_test!(adamw_follows_pytorchs_formula, |dev| {
    let p = param(&[0.5, -2.0, 3.0], &[3], dev);
    let c = AdamWConfig {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(vec![p.clone()], c)?;
    let gs = [[0.3f32, -1.0, 2.0], [0.1, 0.5, -4.0], [-0.2, 0.0, 1.0]];
    for g in &gs {
        p.set_grad(Some(t(g, &[3], dev)));
        opt.step()?;
    }
    let got = vals(&p);
    for i in 0..3 {
        let want = adamw_reference(
            [0.5, -2.0, 3.0][i],
            &gs.iter().map(|g| g[i] as f64).collect::<Vec<_>>(),
            c,
        );
        assert!(
            (got[i] as f64 - want).abs() < 1e-6 * (1.0 + want.abs()),
            "param {i}: {} vs {want}",
            got[i]
        );
    }
    let (m, v, steps) = opt.state(0).unwrap();
    assert_eq!(*steps, 3);
    assert_eq!(m.shape(), &[3]);
    assert!(vals(v).iter().all(|&x| x >= 0.0));
});

device_test!(sgd_with_momentum_and_weight_decay, |dev| {
    let p = param(&[1.0], &[1], dev);
    let mut opt = Sgd::new(vec![p.clone()], 0.5, 0.9, 0.1)?;
    p.set_grad(Some(t(&[2.0], &[1], dev)));
    opt.step()?; // g' = 2 + 0.1 = 2.1; buf = 2.1; p = 1 - 1.05 = -0.05
    assert_eq!(vals(&p), vec![1.0 - 0.5 * 2.1]);
    p.set_grad(Some(t(&[2.0], &[1], dev)));
    opt.step()?; // g' = 2 + 0.1·(-0.05); buf = 0.9·2.1 + g'; p -= 0.5·buf
    let g2 = 0.1f32.mul_add(-0.05, 2.0);
    let buf = 0.9f32.mul_add(2.1, g2);
    assert_eq!(vals(&p), vec![(-0.5f32).mul_add(buf, -0.05)]);
});

device_test!(optimizers_skip_parameters_without_grad, |dev| {
    let (a, b) = (param(&[1.0], &[1], dev), param(&[1.0], &[1], dev));
    let mut opt = AdamW::new(vec![a.clone(), b.clone()], AdamWConfig::new(0.1))?;
    a.set_grad(Some(t(&[1.0], &[1], dev)));
    opt.step()?;
    assert_ne!(vals(&a), vec![1.0]);
    assert_eq!(
        vals(&b),
        vec![1.0],
        "no gradient, no update (not even weight decay)"
    );
    assert!(opt.state(1).is_none());
});

device_test!(clip_grad_norm_scales_to_the_bound, |dev| {
    let (a, b) = (param(&[0.0, 0.0], &[2], dev), param(&[0.0], &[1], dev));
    a.set_grad(Some(t(&[3.0, 0.0], &[2], dev)));
    b.set_grad(Some(t(&[4.0], &[1], dev)));
    let n = clip_grad_norm_(&[a.clone(), b.clone()], 1.0)?;
    assert_eq!(n, 5.0, "returns the norm before clipping");
    let coef = tinyllm::backend::math::div(1.0, 5.0 + 1e-6);
    assert_eq!(grad(&a), vec![3.0 * coef, 0.0]);
    assert_eq!(grad(&b), vec![4.0 * coef]);
    let n2 = clip_grad_norm_(&[a.clone(), b.clone()], 10.0)?;
    assert!(
        n2 < 1.0 && grad(&b) == vec![4.0 * coef],
        "below the bound nothing changes"
    );
});

// The loss scaler's check measures the norm in the pass that unscales: its
// sum of squares is, bit for bit, the one clipping takes of the unscaled
// buffers (ragged chunks, several buffers, an empty one, one of several
// parts); with an inf anywhere there is none.
device_test!(the_checks_sum_of_squares_is_the_clips, |dev| {
    use tinyllm::backend::Storage;
    let lens = [3000, 0, 1024, 1, 140_000]; // the last cut into parts for the threads
    let host: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| randv(n, 40 + i as u64, 3e4))
        .collect();
    let up = |v: &Vec<f32>| Storage::from_f32(v.clone(), dev);
    let grads: Vec<Storage> = host.iter().map(up).collect::<Result<_>>()?;
    let refs: Vec<&Storage> = grads.iter().collect();
    let check = Storage::finite_check_unscale_reading(&refs, 2f32.powi(-12), &[])?;
    assert!(check.finite);
    let clip = Storage::sum_squares(&refs)?;
    assert_eq!(check.sum_squares.map(f32::to_bits), Some(clip.to_bits()));
    assert!(clip > 0.0);
    let mut bad = host.clone();
    bad[4][4321] = f32::INFINITY;
    let grads: Vec<Storage> = bad.iter().map(up).collect::<Result<_>>()?;
    let refs: Vec<&Storage> = grads.iter().collect();
    let check = Storage::finite_check_unscale_reading(&refs, 1.0, &[])?;
    assert_eq!((check.finite, check.sum_squares), (false, None));
});

device_test!(gradients_of_shared_buffers_are_private, |dev| {
    // a + b gives both leaves the same upstream buffer; clipping one must not
    // touch the other.
    let (a, b) = (param(&[1.0], &[1], dev), param(&[1.0], &[1], dev));
    a.add(&b)?.sum_all()?.backward()?;
    clip_grad_norm_(std::slice::from_ref(&a), 0.5)?;
    assert_eq!(grad(&b), vec![1.0]);
});

// Attention's fused softmax is, bit for bit, the composition it replaces:
// scale, causal mask, softmax — forward and backward.
device_test!(causal_softmax_is_the_scaled_masked_softmax, |dev| {
    for (shape, scale) in [
        (vec![2, 3, 7, 7], 0.125),
        (vec![5, 5], 1.0 / 5f64.sqrt()),
        (vec![1, 1], 1.0),
    ] {
        let n: usize = shape.iter().product();
        let x = t(&randv(n, 3, 12.0), &shape, dev);
        let g = t(&randv(n, 4, 1.0), &shape, dev);
        let fused = x.detach().requires_grad_(true);
        let y = fused.causal_softmax(scale)?;
        y.backward_with(&g)?;
        let composed = x.detach().requires_grad_(true);
        let z = composed.mul_scalar(scale)?.causal_mask()?.softmax()?;
        z.backward_with(&g)?;
        assert_eq!(bits(&vals(&y)), bits(&vals(&z)), "{shape:?} forward");
        assert_eq!(
            bits(&grad(&fused)),
            bits(&grad(&composed)),
            "{shape:?} backward"
        );
    }
    assert!(x_err(&t(&[1.0; 6], &[2, 3], dev)).contains("square"));
});

fn x_err(x: &Tensor) -> String {
    x.causal_softmax(0.5).unwrap_err().to_string()
}

/// A training job moved through [`HostState`] to a worker thread and back
/// takes the steps it would have taken in place: the same weights, AdamW
/// moments and dropout stream, bit for bit (bf16 autocast, dropout on,
/// checkpointing on). `HostState` is `Send`.
fn a_job_moved_to_a_worker_thread_keeps_its_bits(dev: Device) {
    use tinyllm::nn::llama::{Llama, LlamaConfig};
    use tinyllm::precision::Precision;
    use tinyllm::train::data::{Batch, ByteTokenizer};
    use tinyllm::train::HostState;
    use tinyllm::MixedStep;
    fn send<T: Send + 'static>(_: &T) {}
    let mut cfg = LlamaConfig::preset("tiny").unwrap();
    cfg.dropout = 0.1;
    let t = cfg.context;
    let ids = ByteTokenizer::encode(&"a job on the move. ".repeat(2 * t));
    let batch = Batch {
        ids: ids[..4 * t].to_vec(),
        targets: ids[1..4 * t + 1].to_vec(),
        rows: 4,
        t,
    };
    let micro = batch.split(2);
    let steps = |model: &Llama, opt: &mut AdamW, n: usize| {
        for _ in 0..n {
            MixedStep::new(Precision::Bf16)
                .clip(1.0)
                .run(
                    model,
                    &micro,
                    |mb: &Batch| {
                        tinyllm::ops::cross_entropy(
                            &model.forward(&mb.ids, mb.rows, mb.t)?,
                            &mb.targets,
                        )
                    },
                    opt,
                )
                .unwrap();
        }
    };
    let fresh = || {
        let m = Llama::new(&cfg, 7, dev)
            .unwrap()
            .with_recompute(Some(3))
            .unwrap();
        let o = AdamW::new(m.parameters(), AdamWConfig::new(1e-2)).unwrap();
        (m, o)
    };
    // In place: four steps.
    let (model, mut opt) = fresh();
    steps(&model, &mut opt, 4);
    let want = HostState::new(&model, Some(&opt)).unwrap();
    // Two steps here, two in a worker (on the CPU there), then back.
    let (model, mut opt) = fresh();
    steps(&model, &mut opt, 2);
    let job = HostState::new(&model, Some(&opt)).unwrap();
    send(&job);
    let job = std::thread::scope(|s| {
        s.spawn(|| {
            let (model, opt) = job.into_model(Device::Cpu).unwrap();
            let mut opt = opt.unwrap();
            steps(&model, &mut opt, 2);
            HostState::new(&model, Some(&opt)).unwrap()
        })
        .join()
        .unwrap()
    });
    let (model, opt) = job.into_model(dev).unwrap();
    let got = HostState::new(&model, opt.as_ref()).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for ((n, w), (_, g)) in want.weights.iter().zip(&got.weights) {
        assert_eq!(bits(w), bits(g), "{n}");
    }
    let (wa, ga) = (want.adamw.unwrap(), got.adamw.unwrap());
    for (i, (w, g)) in wa.moments.iter().zip(&ga.moments).enumerate() {
        let (w, g) = (w.as_ref().unwrap(), g.as_ref().unwrap());
        assert_eq!(
            (bits(&w.0), bits(&w.1), w.2),
            (bits(&g.0), bits(&g.1), g.2),
            "moments {i}"
        );
    }
    assert_eq!(want.dropout_rng, got.dropout_rng);
}
device_test!(a_job_moves_through_host_state, |dev| {
    a_job_moved_to_a_worker_thread_keeps_its_bits(dev);
});

// ----------------------------------------------------------- error kinds ----

/// Errors are filed under the kind a caller would match on: a dtype
/// mismatch is `DType`, operands on two devices `Device`, a token id outside
/// the vocabulary (the model's check and the table's) `Index`.
#[test]
fn mismatches_and_bad_ids_have_their_own_error_kinds() {
    use tinyllm::nn::llama::{Llama, LlamaConfig};
    use tinyllm::{DType, Error, Tensor};
    let f32s = Tensor::from_vec(vec![1.0; 4], &[4], Device::Cpu).unwrap();
    let f64s = Tensor::from_vec_f64(vec![1.0; 4], &[4], Device::Cpu).unwrap();
    let e = f32s.add(&f64s).expect_err("f32 + f64");
    assert!(matches!(e, Error::DType(_)), "{e:#?}");
    let e = Tensor::zeros(&[4], DType::F64, Device::Spec).expect_err("f64 off the CPU");
    assert!(matches!(e, Error::DType(_)), "{e:#?}");
    let spec = Tensor::from_vec(vec![1.0; 4], &[4], Device::Spec).unwrap();
    let e = f32s.add(&spec).expect_err("cpu + spec");
    assert!(matches!(e, Error::Device(_)), "{e:#?}");

    let cfg = LlamaConfig::preset("tiny").unwrap();
    let m = Llama::new(&cfg, 0, Device::Cpu).unwrap();
    let mut ids = vec![1u32; 4];
    ids[2] = cfg.vocab_size as u32;
    let e = m
        .forward(&ids, 1, 4)
        .expect_err("an id outside the vocabulary");
    assert!(matches!(e, Error::Index(_)), "{e:#?}");
    assert_eq!(e.kind(), "Index");
    let table = Tensor::from_vec(vec![0.0; 6], &[3, 2], Device::Cpu).unwrap();
    let e = table.embedding(&[0, 3]).expect_err("a row past the table");
    assert!(matches!(e, Error::Index(_)), "{e:#?}");
}
