//! The fused ops (RMSNorm, SwiGLU, RoPE, cross-entropy) against the
//! compositions of single ops they replace (`ops::fused::reference`): the
//! forward values and every gradient autograd computes must be the same bits,
//! on each device, in f32 and (on the CPU) in f64. Gradients come from
//! `backward()` on the output weighted by random values (or the loss times a
//! scale), so every output entry's gradient matters. Inputs mix random values
//! with ±0, subnormals, huge values, ±inf and NaN.

mod common;
use common::*;
use tinyllm::nn::llama::rope_tables;
use tinyllm::nn::{Layer, RmsNorm};
use tinyllm::ops::cross_entropy;
use tinyllm::ops::fused::reference;
use tinyllm::DType;

/// An input of a case: values, shape, whether it requires grad.
struct Input {
    vals: Vec<f64>,
    shape: Vec<usize>,
    grad: bool,
}

fn input(vals: Vec<f64>, shape: &[usize], grad: bool) -> Input {
    assert_eq!(vals.len(), shape.iter().product::<usize>());
    Input {
        vals,
        shape: shape.to_vec(),
        grad,
    }
}

/// Bits of f64 values (f32 tensors are widened exactly); NaN canonicalised.
fn bits64(v: &[f64]) -> Vec<u64> {
    v.iter()
        .map(|x| {
            if x.is_nan() {
                0x7ff8_0000_0000_0000
            } else {
                x.to_bits()
            }
        })
        .collect()
}

/// The output's bits and each input's gradient bits (`None`: no gradient).
type Run = (Vec<u64>, Vec<Option<Vec<u64>>>);

/// Makes fresh leaves of `inputs` on `dev` as `dtype`, runs `f`, weights the
/// output with `weights` (the loss's seed), backpropagates.
fn run(
    dev: Device,
    dtype: DType,
    inputs: &[Input],
    weights: &[f64],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Run> {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|i| {
            let t = match dtype {
                DType::F32 => {
                    Tensor::from_vec(i.vals.iter().map(|&v| v as f32).collect(), &i.shape, dev)
                }
                DType::F64 => Tensor::from_vec_f64(i.vals.clone(), &i.shape, dev),
            }
            .unwrap();
            t.requires_grad_(i.grad)
        })
        .collect();
    let y = f(&leaves)?;
    let out = bits64(&y.to_vec_f64()?);
    let w = match dtype {
        DType::F32 => {
            Tensor::from_vec(weights.iter().map(|&v| v as f32).collect(), y.shape(), dev)?
        }
        DType::F64 => Tensor::from_vec_f64(weights.to_vec(), y.shape(), dev)?,
    };
    y.mul(&w)?.sum_all()?.backward()?;
    let grads = leaves
        .iter()
        .map(|l| l.grad().map(|g| bits64(&g.to_vec_f64().unwrap())))
        .collect();
    Ok((out, grads))
}

/// The fused and the reference runs agree bit for bit (f32 on `dev`; f64 too on the CPU).
fn check(
    what: &str,
    dev: Device,
    inputs: &[Input],
    weights: &[f64],
    fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    composed: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let dtypes: &[DType] = match dev {
        Device::Cpu => &[DType::F32, DType::F64],
        Device::Gpu | Device::Spec => &[DType::F32],
    };
    for &dt in dtypes {
        let a = run(dev, dt, inputs, weights, fused)?;
        let b = run(dev, dt, inputs, weights, composed)?;
        first_difference(&format!("{what} {dt:?} on {dev}: forward"), &a.0, &b.0);
        for (i, (ga, gb)) in a.1.iter().zip(&b.1).enumerate() {
            match (ga, gb) {
                (Some(ga), Some(gb)) => first_difference(
                    &format!("{what} {dt:?} on {dev}: gradient of input {i}"),
                    ga,
                    gb,
                ),
                (None, None) => {}
                _ => panic!("{what} {dt:?} on {dev}: input {i} has a gradient on one side only"),
            }
        }
    }
    Ok(())
}

fn first_difference(what: &str, fused: &[u64], composed: &[u64]) {
    assert_eq!(fused.len(), composed.len(), "{what}: lengths");
    let bad: Vec<usize> = (0..fused.len())
        .filter(|&i| fused[i] != composed[i])
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} differ; first [{i}] fused {:e} composed {:e}",
            bad.len(),
            fused.len(),
            f64::from_bits(fused[i]),
            f64::from_bits(composed[i])
        );
    }
}

/// `n` values: mostly moderate randoms, every 7th from the hard cases
/// (`finite` leaves out ±inf and NaN).
fn values(n: usize, seed: u64, scale: f64, finite: bool) -> Vec<f64> {
    let mut hard = vec![
        0.0,
        -0.0,
        f32::from_bits(1) as f64,
        -(f32::from_bits(0x0040_0000) as f64),
        1e-30,
        -3e19,
        1e25,
        65504.0,
        -1.0,
    ];
    if !finite {
        hard.extend([f64::INFINITY, f64::NEG_INFINITY, f64::NAN]);
    }
    let mut rng = Rng(seed);
    (0..n)
        .map(|i| {
            if i % 7 == 3 {
                hard[rng.below(hard.len())]
            } else {
                rng.unif(-1.0, 1.0) as f64 * scale
            }
        })
        .collect()
}

/// Upstream gradients: randoms with a share of +0 and −0 (where signed zeros
/// meet, the order of the additions shows).
fn weights(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| match rng.below(6) {
            0 => 0.0,
            1 => -0.0,
            _ => rng.unif(-2.0, 2.0) as f64,
        })
        .collect()
}

// ---------------------------------------------------------------- RMSNorm ----

device_test!(rms_norm_is_the_composition, |dev| {
    let eps = 1e-5;
    // (3, 5, 7): two leading axes (nested dw sums); 67 = not a multiple of 64;
    // a size-1 leading axis; a single vector
    for (k, shape) in [vec![3, 5, 7], vec![3, 67], vec![2, 1, 4, 6], vec![9]]
        .into_iter()
        .enumerate()
    {
        let d = *shape.last().unwrap();
        let n: usize = shape.iter().product();
        let seed = 10 * k as u64;
        for finite in [true, false] {
            let x = values(n, seed + 1, 3.0, finite);
            let w = values(d, seed + 2, 1.5, finite);
            let ins = [input(x, &shape, true), input(w, &[d], true)];
            let r = weights(n, seed + 3);
            let what = format!("rms_norm {shape:?} finite {finite}");
            check(&what, dev, &ins, &r, &|t| t[0].rms_norm(&t[1], eps), &|t| {
                reference::rms_norm(&t[0], &t[1], eps)
            })?;
            // the Llama's pattern: x also feeds a residual branch, whose
            // gradient autograd adds first
            check(
                &format!("{what}, with a residual"),
                dev,
                &ins,
                &r,
                &|t| t[0].add(&t[0].rms_norm(&t[1], eps)?),
                &|t| t[0].add(&reference::rms_norm(&t[0], &t[1], eps)?),
            )?;
        }
    }
    // only one side wanting a gradient
    let x = values(40, 7, 2.0, true);
    for (gx, gw) in [(true, false), (false, true)] {
        let ins = [
            input(x.clone(), &[5, 8], gx),
            input(values(8, 8, 1.0, true), &[8], gw),
        ];
        check(
            &format!("rms_norm grads x {gx} w {gw}"),
            dev,
            &ins,
            &weights(40, 9),
            &|t| t[0].rms_norm(&t[1], eps),
            &|t| reference::rms_norm(&t[0], &t[1], eps),
        )?;
    }
});

/// The layer (float32 weight) on an f64 input casts its weight like before.
#[test]
fn rms_norm_layer_on_f64_input_is_the_composition() {
    let ln = RmsNorm::new(6, 1e-5, Device::Cpu).unwrap();
    ln.weight
        .assign(&Tensor::from_vec(randv(6, 3, 1.0), &[6], Device::Cpu).unwrap())
        .unwrap();
    let x0 = values(24, 4, 2.0, true);
    let r = Tensor::from_vec_f64(weights(24, 5), &[4, 6], Device::Cpu).unwrap();
    let mut got = Vec::new();
    for fused in [true, false] {
        ln.weight.zero_grad();
        let x = Tensor::from_vec_f64(x0.clone(), &[4, 6], Device::Cpu)
            .unwrap()
            .requires_grad_(true);
        let y = if fused {
            ln.forward(&x).unwrap()
        } else {
            let w = ln.weight.to_dtype(DType::F64).unwrap();
            reference::rms_norm(&x, &w, ln.eps).unwrap()
        };
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        got.push((
            bits64(&y.to_vec_f64().unwrap()),
            bits64(&x.grad().unwrap().to_vec_f64().unwrap()),
            bits64(&ln.weight.grad().unwrap().to_vec_f64().unwrap()),
        ));
    }
    assert!(got[0] == got[1], "the layer differs from the composition");
}

// ----------------------------------------------------------------- SwiGLU ----

/// Whether a primitive named `name` ran during `f`.
fn ran(name: &str, f: &dyn Fn() -> Result<Run>) -> Result<(Run, bool)> {
    tinyllm::profile::start();
    let out = f();
    let p = tinyllm::profile::take().expect("profiling was on");
    Ok((out?, p.rows.iter().any(|r| r.name == name && r.calls > 0)))
}

// The down projection reading SwiGLU's output (`Tensor::swiglu_matmul_t`)
// against SwiGLU and then the product, under autocast (the gate and up
// products' outputs, as the Llama's MLP has them), with and without the
// residual: the same output and gradients, bit for bit, and SwiGLU never
// run as a primitive of its own.
device_test!(swiglu_into_the_down_product_is_the_composition, |dev| {
    use tinyllm::precision::autocast;
    use tinyllm::Format;
    let (rows, c, f) = (67, 6, 9);
    let ins = [
        input(values(rows * c, 1, 3.0, true), &[1, rows, c], true),
        input(values(f * c, 2, 2.0, true), &[f, c], true),
        input(values(f * c, 3, 2.0, true), &[f, c], true),
        input(values(c * f, 4, 1.0, true), &[c, f], true),
        input(values(rows * c, 5, 1.0, true), &[1, rows, c], true),
    ];
    let w = weights(rows * c, 6);
    for fmt in [Format::Bf16, Format::Fp16] {
        for residual in [true, false] {
            let go = |fused: bool| {
                move |t: &[Tensor]| {
                    let _ac = autocast(fmt);
                    let (g, u) = (t[0].matmul_t(&t[1])?, t[0].matmul_t(&t[2])?);
                    let e = residual.then_some(&t[4]);
                    match (fused, e) {
                        (true, e) => g.swiglu_matmul_t(u, &t[3], e),
                        (false, Some(e)) => g.swiglu(&u)?.matmul_t_add(&t[3], e),
                        (false, None) => g.swiglu(&u)?.matmul_t(&t[3]),
                    }
                }
            };
            let what = format!("{fmt}, residual {residual}, on {dev}");
            let (a, alone) = ran("swiglu", &|| {
                super::run(dev, DType::F32, &ins, &w, &go(true))
            })?;
            let (b, composed) = ran("swiglu", &|| {
                super::run(dev, DType::F32, &ins, &w, &go(false))
            })?;
            assert!(
                !alone && composed,
                "{what}: SwiGLU ran alone {alone}, composed {composed}"
            );
            first_difference(&format!("{what}: forward"), &a.0, &b.0);
            for (i, (ga, gb)) in a.1.iter().zip(&b.1).enumerate() {
                // the residual has a gradient only where it is added
                assert_eq!(ga.is_some(), i < 4 || residual, "{what}: input {i}");
                assert_eq!(ga.is_some(), gb.is_some(), "{what}: input {i}");
                if let (Some(ga), Some(gb)) = (ga, gb) {
                    first_difference(&format!("{what}: gradient of input {i}"), ga, gb);
                }
            }
        }
    }
    // without grad (a checkpointed segment's first forward): nothing kept
    let _ng = tinyllm::no_grad();
    let (a, alone) = ran("swiglu", &|| run_forward(dev, &ins, true))?;
    let (b, _) = ran("swiglu", &|| run_forward(dev, &ins, false))?;
    assert!(!alone, "no grad: SwiGLU ran alone");
    first_difference("no grad: forward", &a.0, &b.0);
});

/// The forward of the down projection of SwiGLU with the residual, under bf16
/// autocast, fused or composed (no backward).
fn run_forward(dev: Device, ins: &[Input], fused: bool) -> Result<Run> {
    let _ac = tinyllm::precision::autocast(tinyllm::Format::Bf16);
    let t: Vec<Tensor> = ins
        .iter()
        .map(|i| Tensor::from_vec(i.vals.iter().map(|&v| v as f32).collect(), &i.shape, dev))
        .collect::<Result<_>>()?;
    let (g, u) = (t[0].matmul_t(&t[1])?, t[0].matmul_t(&t[2])?);
    let y = match fused {
        true => g.swiglu_matmul_t(u, &t[3], Some(&t[4]))?,
        false => g.swiglu(&u)?.matmul_t_add(&t[3], &t[4])?,
    };
    Ok((bits64(&y.to_vec_f64()?), Vec::new()))
}

device_test!(swiglu_is_the_composition, |dev| {
    for (k, shape) in [vec![4, 67], vec![2, 3, 8], vec![1]]
        .into_iter()
        .enumerate()
    {
        let n: usize = shape.iter().product();
        for finite in [true, false] {
            let seed = 100 + 10 * k as u64;
            // gates out to ±100: σ saturates, exp over- and underflows
            let ins = [
                input(values(n, seed, 100.0, finite), &shape, true),
                input(values(n, seed + 1, 2.0, finite), &shape, true),
            ];
            check(
                &format!("swiglu {shape:?} finite {finite}"),
                dev,
                &ins,
                &weights(n, seed + 2),
                &|t| t[0].swiglu(&t[1]),
                &|t| reference::swiglu(&t[0], &t[1]),
            )?;
        }
    }
    // gate and up the same tensor
    let ins = [input(values(30, 7, 4.0, true), &[30], true)];
    check(
        "swiglu(x, x)",
        dev,
        &ins,
        &weights(30, 8),
        &|t| t[0].swiglu(&t[0]),
        &|t| reference::swiglu(&t[0], &t[0]),
    )?;
});

// ------------------------------------------------------------------- RoPE ----

device_test!(rope_is_the_composition, |dev| {
    // (B, H, T, D) with the Llama's tables; D = 2 (one pair); odd T; random tables
    for (k, (shape, real)) in [
        (vec![2, 3, 5, 8], true),
        (vec![3, 7, 2], true),
        (vec![2, 4, 6], false),
        (vec![1, 1, 3, 130], true),
    ]
    .into_iter()
    .enumerate()
    {
        let (t, d) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        let n: usize = shape.iter().product();
        let seed = 200 + 10 * k as u64;
        let (cos, sin) = if real {
            let (c, s) = rope_tables(t, d, 10000.0);
            (
                c.iter().map(|&v| v as f64).collect(),
                s.iter().map(|&v| v as f64).collect(),
            )
        } else {
            (
                values(t * d, seed, 1.0, true),
                values(t * d, seed + 1, 1.0, true),
            )
        };
        for finite in [true, false] {
            let ins = [
                input(values(n, seed + 2, 3.0, finite), &shape, true),
                input(cos.clone(), &[t, d], false),
                input(sin.clone(), &[t, d], false),
            ];
            check(
                &format!("rope {shape:?} finite {finite}"),
                dev,
                &ins,
                &weights(n, seed + 3),
                &|t| t[0].rope(&t[1], &t[2]),
                &|t| reference::rope(&t[0], &t[1], &t[2]),
            )?;
        }
    }
});

// RoPE straight from a projection's (B, T, H·D) into attention's (B, H, T, D)
// is the composition of the reshape, the permute and the rotation.
device_test!(rope_heads_is_the_permuted_composition, |dev| {
    for (k, &(b, t, h, d)) in [(2, 5, 3, 8), (1, 7, 1, 2), (3, 4, 2, 130)]
        .iter()
        .enumerate()
    {
        let n = b * t * h * d;
        let seed = 300 + 10 * k as u64;
        let (c, s) = rope_tables(t, d, 10000.0);
        for finite in [true, false] {
            let ins = [
                input(values(n, seed, 3.0, finite), &[b, t, h * d], true),
                input(c.iter().map(|&v| v as f64).collect(), &[t, d], false),
                input(s.iter().map(|&v| v as f64).collect(), &[t, d], false),
            ];
            check(
                &format!("rope_heads ({b}, {t}, {h}·{d}) finite {finite}"),
                dev,
                &ins,
                &weights(n, seed + 1),
                &|x| x[0].rope_heads(&x[1], &x[2], h),
                &|x| {
                    let heads = x[0].reshape(&[b, t, h, d])?.permute(&[0, 2, 1, 3])?;
                    reference::rope(&heads, &x[1], &x[2])
                },
            )?;
        }
    }
});

// Attention with RoPE inside (`causal_attention_rope`) against RoPE's pair
// and then the token-major attention, forward and every gradient through the
// projections that form q, k and v, bit for bit: in float32, under the
// policies that round the rotated values or not, with the tables side by side
// (a GPU rotates as it reads) and apart (it runs the composition).
device_test!(attention_with_rope_is_rope_then_attention, |dev| {
    use tinyllm::precision::{autocast, CastTable, OpClass, Rule, Scope};
    use tinyllm::Format;
    let tables = [
        None,
        Some(CastTable::matmuls(Format::Bf16)),
        Some(CastTable::pure(Format::Bf16)),
        Some(CastTable::torch(Format::Fp16)),
        Some(CastTable::f32().with(OpClass::Rope, Rule::Round(Format::Fp16))),
    ];
    // every policy on the first shape; on a GPU, where each policy's
    // kernels compile anew (seconds on a software device), the training
    // policy (bf16 matmuls) and the one rounding the rotated values alone,
    // the second shape and the tables apart with the first only
    let shapes = [(2, 13, 3, 8), (1, 5, 2, 6)];
    for (case, &(b, t_, h, d)) in shapes.iter().enumerate() {
        let c = h * d;
        let (cv, sv) = rope_tables(t_, d, 10000.0);
        let (x0, w0, out) = (
            randv(b * t_ * c, 40 + case as u64, 2.0),
            randv(3 * c * c, 50 + case as u64, 0.6),
            randv(b * t_ * c, 60 + case as u64, 1.0),
        );
        for (i, table) in tables.iter().enumerate() {
            for side_by_side in [true, false] {
                let gpu_case = i == 1 || (i == 4 && case == 0 && side_by_side);
                if dev == Device::Gpu && !gpu_case {
                    continue;
                }
                let run = |fused: bool| -> Result<Vec<Vec<u32>>> {
                    let (cos, sin) = (t(&cv, &[t_, d], dev), t(&sv, &[t_, d], dev));
                    if side_by_side {
                        Tensor::colocate(&[&cos, &sin])?;
                    }
                    let x = param(&x0, &[b, t_, c], dev);
                    let ws: Vec<Tensor> = (0..3)
                        .map(|i| param(&w0[i * c * c..(i + 1) * c * c], &[c, c], dev))
                        .collect();
                    let y = {
                        let _ac = autocast(Scope::table(*table));
                        let [q, k, v] = [0, 1, 2].map(|i| x.matmul_t(&ws[i]));
                        let (q, k, v) = (q?, k?, v?);
                        if fused {
                            q.causal_attention_rope(&k, &v, &cos, &sin, h, 0.4)?
                        } else {
                            let (q, k) = q.rope_heads_pair(&k, &cos, &sin, h)?;
                            q.causal_attention_tokens(&k, &v.reshape(&[b, t_, h, d])?, 0.4)?
                        }
                    };
                    y.mul(&t(&out, y.shape(), dev))?.sum_all()?.backward()?;
                    let mut r = vec![bits(&vals(&y)), bits(&grad(&x))];
                    r.extend(ws.iter().map(|w| bits(&grad(w))));
                    Ok(r)
                };
                assert_eq!(
                    run(true)?,
                    run(false)?,
                    "({b}, {t_}, {h}·{d}) {table:?} tables side by side {side_by_side}"
                );
            }
        }
    }
    // q, k and v of one shape (B, T, H·D), named in the error
    let (cos, sin) = (t(&[1.0; 8], &[2, 4], dev), t(&[0.0; 8], &[2, 4], dev));
    let q = t(&randv(16, 1, 1.0), &[1, 2, 8], dev);
    let v = t(&randv(8, 2, 1.0), &[1, 1, 8], dev);
    let e = q
        .causal_attention_rope(&q, &v, &cos, &sin, 2, 0.5)
        .expect_err("two shapes");
    assert!(e.to_string().contains("causal_attention_rope"), "{e}");
    // tables of the wrong shape
    let e = q
        .causal_attention_rope(&q, &q, &cos, &sin.reshape(&[4, 2])?, 2, 0.5)
        .expect_err("tables");
    assert!(e.to_string().contains("tables"), "{e}");
});

// Attention's q and k rotated together are each rotated alone, bit for bit,
// in forward and in the gradients that flow back through them.
device_test!(rope_heads_pair_is_two_rope_heads, |dev| {
    for (k, &(b, t_, h, d)) in [(2, 5, 3, 8), (3, 4, 2, 130)].iter().enumerate() {
        let n = b * t_ * h * d;
        let (c, s) = rope_tables(t_, d, 10000.0);
        let (c, s) = (t(&c, &[t_, d], dev), t(&s, &[t_, d], dev));
        let (qv, kv) = (randv(n, 400 + k as u64, 3.0), randv(n, 500 + k as u64, 3.0));
        let (w1, w2) = (
            t(&randv(n, 600, 1.0), &[b, h, t_, d], dev),
            t(&randv(n, 700, 1.0), &[b, h, t_, d], dev),
        );
        // graph 0: each used once; 1: k's rotation also feeds a longer
        // chain (its gradient complete only after that chain's backward);
        // 2: k's rotation unused (no gradient: the pair's backward can't run)
        let run = |paired: bool, graph: usize| -> Result<Vec<Vec<u32>>> {
            let q = t(&qv, &[b, t_, h * d], dev).requires_grad_(true);
            let kk = t(&kv, &[b, t_, h * d], dev).requires_grad_(true);
            let (a, r) = match paired {
                true => q.rope_heads_pair(&kk, &c, &s, h)?,
                false => (q.rope_heads(&c, &s, h)?, kk.rope_heads(&c, &s, h)?),
            };
            let mut loss = a.mul(&w1)?.sum_all()?;
            if graph < 2 {
                loss = loss.add(&r.mul(&w2)?.sum_all()?)?;
            }
            if graph == 1 {
                let long = r.mul(&w1)?.mul(&w2)?.mul(&w1)?.exp()?.sum_all()?;
                loss = long.add(&loss)?;
            }
            loss.backward()?;
            let grad = |x: &Tensor| x.grad().map(|g| g.to_vec_f32()).transpose();
            Ok(vec![
                bits(&a.to_vec_f32()?),
                bits(&r.to_vec_f32()?),
                bits(&grad(&q)?.expect("q's gradient")),
                bits(&grad(&kk)?.unwrap_or_default()),
            ])
        };
        for graph in 0..3 {
            assert_eq!(
                run(true, graph)?,
                run(false, graph)?,
                "({b}, {t_}, {h}·{d}) graph {graph}"
            );
        }
    }
    // of one shape, named in the error
    let (c, s) = (t(&[1.0; 6], &[3, 2], dev), t(&[0.0; 6], &[3, 2], dev));
    let x = t(&randv(24, 1, 1.0), &[2, 3, 4], dev);
    let other = t(&randv(12, 2, 1.0), &[1, 3, 4], dev);
    let e = x
        .rope_heads_pair(&other, &c, &s, 2)
        .expect_err("two shapes");
    assert!(e.to_string().contains("rope_heads_pair"), "{e}");
});

// ---------------------------------------------------------- cross-entropy ----

device_test!(cross_entropy_is_the_composition, |dev| {
    for (k, (n, v)) in [(7, 67), (5, 256), (1, 1), (3, 2), (41, 33)]
        .into_iter()
        .enumerate()
    {
        let seed = 300 + 10 * k as u64;
        let mut rng = Rng(seed);
        let targets: Vec<u32> = (0..n).map(|_| rng.below(v) as u32).collect();
        for finite in [true, false] {
            let mut x = values(n * v, seed + 1, 8.0, true);
            // most rows' target holds much of the mass without being
            // the max (its exp inexact), next to a slightly larger logit:
            // only there is the target's gradient a + gS·e far from a, so
            // only there would a contracted a + gS·e show
            for (r, &tr) in targets
                .iter()
                .enumerate()
                .filter(|(r, _)| r % 4 != 1 && v > 1)
            {
                let row = &mut x[r * v..(r + 1) * v];
                let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max) + (v as f64).ln();
                row[tr as usize] = m;
                row[(tr as usize + 1) % v] = m + rng.unif(0.05, 1.0) as f64;
            }
            if !finite && n >= 3 {
                // a row with masked (−inf) logits, one with a NaN, one all −inf
                for j in 0..v {
                    if j % 2 == 1 {
                        x[j] = f64::NEG_INFINITY;
                    }
                    x[2 * v + j] = f64::NEG_INFINITY;
                }
                x[v] = f64::NAN;
            }
            // the loss's upstream gradient: 1, a loss scale, ±0, a subnormal
            for scale in [1.0, 1024.0, 0.0, -0.0, f32::from_bits(3) as f64] {
                let ins = [input(x.clone(), &[n, v], true)];
                let tg = targets.clone();
                let tr = targets.clone();
                check(
                    &format!("cross_entropy ({n}, {v}) finite {finite} scale {scale}"),
                    dev,
                    &ins,
                    &[scale],
                    &move |t| cross_entropy(&t[0], &tg),
                    &move |t| reference::cross_entropy(&t[0], &tr),
                )?;
            }
        }
    }
});

// ------------------------------------------------------------- bad input ----

device_test!(bad_inputs_are_shape_and_index_errors, |dev| {
    let shape_err = |r: Result<Tensor>, want: &str| {
        let e = r.expect_err("an error");
        assert!(matches!(e, tinyllm::Error::Shape(_)), "{e}");
        assert!(e.to_string().contains(want), "{e}");
    };
    let x = t(&randv(24, 1, 1.0), &[2, 3, 4], dev);
    // RMSNorm: the weight must match the last axis
    shape_err(x.rms_norm(&t(&[1.0; 3], &[3], dev), 1e-5), "rms_norm");
    shape_err(x.rms_norm(&t(&[1.0; 8], &[2, 4], dev), 1e-5), "rms_norm");
    // SwiGLU: equal shapes
    shape_err(x.swiglu(&t(&randv(12, 2, 1.0), &[3, 4], dev)), "swiglu");
    // RoPE: tables of the last two axes, an even head dimension
    let (c, s) = (t(&[1.0; 12], &[3, 4], dev), t(&[0.0; 12], &[3, 4], dev));
    assert!(x.rope(&c, &s).is_ok());
    shape_err(x.rope(&t(&[1.0; 8], &[2, 4], dev), &s), "rope");
    let odd = t(&randv(18, 3, 1.0), &[2, 3, 3], dev);
    let (c3, s3) = (t(&[1.0; 9], &[3, 3], dev), t(&[0.0; 9], &[3, 3], dev));
    shape_err(odd.rope(&c3, &s3), "even");
    // RoPE into heads: (B, T, H·D) with tables (T, D)
    assert!(x
        .rope_heads(&t(&[1.0; 6], &[3, 2], dev), &t(&[0.0; 6], &[3, 2], dev), 2)
        .is_ok());
    shape_err(x.rope_heads(&c, &s, 3), "rope_heads");
    shape_err(x.rope_heads(&c, &s, 2), "tables");
    // cross-entropy: one target per row, each < vocab
    let logits = t(&randv(12, 4, 1.0), &[3, 4], dev);
    shape_err(cross_entropy(&logits, &[0, 1]), "targets");
    let e = cross_entropy(&logits, &[0, 4, 1]).expect_err("a target past the classes");
    assert!(matches!(e, tinyllm::Error::Index(_)), "{e}");
    assert!(
        e.to_string()
            .contains("target 4 out of range for 4 classes"),
        "{e}"
    );
    assert!(cross_entropy(&logits, &[0, 3, 1]).is_ok());
});
