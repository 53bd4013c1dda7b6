//! fp8 with per-tensor delayed scaling: the scaled casts exact and the same
//! bits on every device, E4M3 saturating, gradients in E5M2, scales fitted
//! to the amax history (powers of two), saturations counted, and a training
//! step in fp8 bit for bit across devices.

mod common;
use common::*;
use std::cell::RefCell;
use std::rc::Rc;
use tinyllm::backend::round::{fp8_f32, Fp8};
use tinyllm::nn::llama::{Llama, LlamaConfig};
use tinyllm::nn::Module;
use tinyllm::ops::fp8::{amax_of, cast_operand, linear, saturations_of, scaled_round};
use tinyllm::optim::{AdamW, AdamWConfig};
use tinyllm::precision::{AmaxReduction, DelayedScaling, Fp8Config, Precision, Role};
use tinyllm::{MicroBatch, MixedStep};

fn recipe(history: usize, reduction: AmaxReduction) -> Rc<RefCell<DelayedScaling>> {
    let c = Fp8Config {
        history,
        reduction,
        margin: 0,
    };
    Rc::new(RefCell::new(DelayedScaling::new(c).unwrap()))
}

// q/s with q = rd(x·s): the bits of the host reference on every device, and
// exact — every output times s is a value of the format.
device_test!(scaled_cast_is_exact_and_bitwise, |dev| {
    let xs = [
        0.0,
        -0.0,
        1.0,
        -3.0,
        0.3,
        1e-6,
        -2.5e-3,
        13.9,
        14.1,
        -20.0,
        1e30,
        f32::MIN_POSITIVE,
        5.0e-4,
        0.0123,
        -447.0,
        60000.0,
    ];
    for fmt in [Fp8::E4M3, Fp8::E5M2] {
        for scale in [1.0f32, 32.0, 0.25, 2f32.powi(20), 2f32.powi(-20)] {
            let y = vals(&scaled_round(&t(&xs, &[xs.len()], dev), scale, fmt)?);
            for (&x, &y) in xs.iter().zip(&y) {
                let want = fp8_f32((x * scale).clamp(-fmt.max(), fmt.max()), fmt) / scale;
                assert_eq!(
                    y.to_bits(),
                    want.to_bits(),
                    "{fmt:?} scale {scale}: {x} -> {y}, want {want}"
                );
                let q = y * scale;
                assert_eq!(
                    fp8_f32(q, fmt).to_bits(),
                    q.to_bits(),
                    "inexact unscale of {x}"
                );
            }
        }
    }
    // E4M3 saturates at ±448 (never NaN): 20·32 = 640 and −30·32 = −960
    let y = vals(&scaled_round(
        &t(&[20.0, -30.0], &[2], dev),
        32.0,
        Fp8::E4M3,
    )?);
    assert_eq!(y, [14.0, -14.0]);
    // the scaled E5M2 cast saturates as well (its rounding alone gives inf)
    let y = vals(&scaled_round(
        &t(&[70000.0, -1e38, 1000.0], &[3], dev),
        1.0,
        Fp8::E5M2,
    )?);
    assert_eq!(y, [57344.0, -57344.0, 1024.0]);
});

// A max along a long row (an fp8 amax is one row of a whole tensor) is the
// contract's ascending fold of `maximum` however a device groups it: the
// largest value wherever it lies (the first element, inside whole groups of
// lanes, in the ragged end), +0 over −0 among zeros, NaN wherever one is.
device_test!(a_max_along_a_long_row_is_the_ascending_fold, |dev| {
    let fold = |v: &[f32]| {
        let max = |a: f32, b: f32| {
            if a.is_nan() || b.is_nan() {
                f32::NAN
            } else if a == 0.0 && b == 0.0 {
                if a.is_sign_negative() && b.is_sign_negative() {
                    -0.0
                } else {
                    0.0
                }
            } else if b > a {
                b
            } else {
                a
            }
        };
        v[1..].iter().fold(v[0], |a, &b| max(a, b))
    };
    for n in [1usize, 63, 64, 65, 1000, 4099] {
        let base: Vec<f32> = (0..n).map(|i| -1.0 - ((i * 7919) % 1009) as f32).collect();
        let mut rows = vec![base.clone()];
        for at in [0, n / 2, n - 1] {
            let mut v = base.clone();
            v[at] = 5.0;
            rows.push(v);
        }
        rows.push(vec![-0.0; n]);
        let mut zeros = vec![-0.0; n];
        zeros[n - 1] = 0.0;
        rows.push(zeros);
        let mut nan = base.clone();
        nan[n / 3] = f32::NAN;
        rows.push(nan);
        rows.push(vec![f32::NEG_INFINITY; n]);
        for v in rows {
            let want = fold(&v);
            let got = vals(&t(&v, &[1, n], dev).max(1, false)?)[0];
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "n {n}: {got:?} against the fold's {want:?}"
            );
        }
    }
});

// A sum along one row (fp8's saturation count is one row of a whole
// tensor) is the contract's ascending fold from −0 however a device groups
// it: counts and other integer rows, their zeros' signs, and rows where the
// order shows (a term lost to rounding, fractions, a NaN, infinities).
device_test!(a_sum_along_a_long_row_is_the_ascending_fold, |dev| {
    let big = 16_777_216.0f32; // 2^24
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for n in [1usize, 17, 1000, 4099] {
        rows.push((0..n).map(|i| ((i * 7919) % 3 == 0) as u8 as f32).collect());
        rows.push(
            (0..n)
                .map(|i| if i % 2 == 0 { 3.0 } else { -3.0 })
                .collect(),
        );
        rows.push(vec![-0.0; n]);
        let mut z = vec![-0.0; n];
        z[n / 2] = 0.0;
        rows.push(z);
        rows.push((0..n).map(|i| i as f32 * 0.1).collect());
        let mut nan = vec![1.0; n];
        nan[n - 1] = f32::NAN;
        rows.push(nan);
        let mut inf = vec![1.0; n];
        inf[0] = f32::INFINITY;
        rows.push(inf);
    }
    // the order shows: in order, each 1 after 2^24 rounds away (a tie, to
    // even); grouped otherwise, the 1s add up before they meet 2^24
    let mut lost = vec![1.0; 101];
    lost[0] = big;
    rows.push(lost);
    rows.push(vec![big, 1.0, -big]);
    rows.push(vec![1.0, -1.0]);
    for v in rows {
        let want = v.iter().fold(-0.0f32, |a, &b| a + b);
        let got = vals(&t(&v, &[1, v.len()], dev).sum(1, false)?)[0];
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{} terms from {:?}: {got:?} against the fold's {want:?}",
            v.len(),
            &v[..v.len().min(4)]
        );
    }
});

// The amax and the saturation count are device reductions.
device_test!(amax_and_saturations_on_the_device, |dev| {
    let x = t(&[1.0, -3.0, 0.5, -0.0], &[2, 2], dev);
    assert_eq!(vals(&amax_of(&x)?), [3.0]);
    // at scale 32: 640 and 960 exceed 448; 14·32 = 448 does not
    let x = t(&[20.0, -30.0, 1.0, 14.0], &[4], dev);
    assert_eq!(vals(&saturations_of(&x, 32.0, Fp8::E4M3)?), [2.0]);
    assert_eq!(vals(&saturations_of(&x, 1.0, Fp8::E4M3)?), [0.0]);
    // the same values fit E5M2 at 32 (57344 is its maximum)
    assert_eq!(vals(&saturations_of(&x, 32.0, Fp8::E5M2)?), [0.0]);
});

// The gradient arriving for an fp8 product's output is cast to E5M2 with
// its own scale (1 at first): 1000 becomes 1024, where E4M3 would saturate
// at 448. Both gradient products read it; the amaxes are recorded.
device_test!(gradients_are_cast_to_e5m2, |dev| {
    let r = recipe(4, AmaxReduction::Max);
    let x = param(&[1.0, 0.0], &[1, 2], dev);
    let w = param(&[1.0, 0.0], &[1, 2], dev);
    let y = linear(&x, &w, &r)?;
    assert_eq!(vals(&y), [1.0]);
    y.backward_with(&t(&[1000.0], &[1, 1], dev))?;
    assert_eq!(grad(&x), [1024.0, 0.0]);
    assert_eq!(grad(&w), [1024.0, 0.0]);
    let report = r.borrow_mut().update()?;
    assert_eq!(report.saturated, 0);
    let r = r.borrow();
    let ts = r.tensors();
    assert_eq!(ts.len(), 3);
    assert_eq!(ts[2].format, Fp8::E5M2);
    assert_eq!(ts[2].history, [1000f32.to_bits()]);
    // 448/1 = 2^8.8: 256; 57344/1000 = 2^5.8: 32
    assert_eq!(
        (ts[0].scale(), ts[1].scale(), ts[2].scale()),
        (256.0, 256.0, 32.0)
    );
});

/// Casts `xs` as the input of `slot` (recorded), then ends the step.
fn step_with(r: &Rc<RefCell<DelayedScaling>>, slot: usize, xs: &[f32], dev: Device) -> u64 {
    cast_operand(&t(xs, &[xs.len()], dev), r, slot, Role::Input).unwrap();
    r.borrow_mut().update().unwrap().saturated
}

// The scale comes from the history's reduction, not from the step's amax:
// with `max`, a large amax two steps back still sets it; it leaves the
// history after `history` steps. Scales are powers of two, saturations are
// counted, and an evaluation (no grad) records nothing.
device_test!(scales_follow_the_amax_history, |dev| {
    let r = recipe(2, AmaxReduction::Max);
    let slot = r.borrow_mut().slot(7);
    let scale = |r: &Rc<RefCell<DelayedScaling>>| r.borrow().scale(slot, Role::Input);
    assert_eq!(scale(&r), 1.0, "a fresh tensor starts at 1");
    step_with(&r, slot, &[8.0, -1.0], dev);
    assert_eq!(scale(&r), 32.0); // 448/8 = 56
    step_with(&r, slot, &[1.0, 0.5], dev);
    assert_eq!(scale(&r), 32.0, "history [8, 1]: max 8, not this step's 1");
    step_with(&r, slot, &[0.25], dev);
    assert_eq!(scale(&r), 256.0, "history [1, 0.25]: the 8 has left");
    // most_recent follows the step
    let m = recipe(2, AmaxReduction::MostRecent);
    let ms = m.borrow_mut().slot(7);
    step_with(&m, ms, &[8.0], dev);
    step_with(&m, ms, &[1.0], dev);
    assert_eq!(m.borrow().scale(ms, Role::Input), 256.0);
    // 448/3 = 149.3: the power of two below it, so unscaling is exact
    let p = recipe(1, AmaxReduction::Max);
    let ps = p.borrow_mut().slot(0);
    step_with(&p, ps, &[3.0, 0.3], dev);
    assert_eq!(p.borrow().scale(ps, Role::Input), 128.0);
    // at scale 128, 5 and −4 exceed 448: counted; the amax 5 sets 64
    assert_eq!(step_with(&p, ps, &[5.0, -4.0, 3.0], dev), 2);
    assert_eq!(p.borrow().scale(ps, Role::Input), 64.0);
    assert_eq!(p.borrow().saturated_total(), 2);
    // an evaluation casts with the scale but records nothing
    {
        let _ng = tinyllm::no_grad();
        cast_operand(&t(&[1000.0], &[1], dev), &p, ps, Role::Input)?;
    }
    assert_eq!(p.borrow_mut().update()?.saturated, 0);
    assert_eq!(p.borrow().scale(ps, Role::Input), 64.0);
});

struct Rows {
    ids: Vec<u32>,
    rows: usize,
    t: usize,
}

impl MicroBatch for Rows {
    fn rows(&self) -> usize {
        self.rows
    }
}

/// Two bf16 steps of a one-layer tiny Llama, in fp8 or not: the losses,
/// the weights after, and (fp8) the scales and histories, as bits.
fn two_steps(dev: Device, fp8: bool) -> Vec<Vec<u32>> {
    let mut cfg = LlamaConfig::preset("tiny").unwrap();
    cfg.n_layers = 1;
    let m = Llama::new(&cfg, 7, dev).unwrap();
    let mut opt = AdamW::new(m.parameters(), AdamWConfig::new(1e-2)).unwrap();
    let r = recipe(4, AmaxReduction::Max);
    let (rows, t) = (2, 16);
    let mut out = Vec::new();
    for step in 0..2u32 {
        let ids: Vec<u32> = (0..rows * t)
            .map(|i| (i as u32 * 37 + 5 + step * 11) % 256)
            .collect();
        let mb = Rows { ids, rows, t };
        let mut s = MixedStep::new(Precision::Bf16).clip(1.0);
        if fp8 {
            s = s.fp8(&r);
        }
        let report = s
            .run(
                &m,
                std::slice::from_ref(&mb),
                |b: &Rows| {
                    let logits = m.forward(&b.ids, b.rows, b.t)?;
                    tinyllm::ops::cross_entropy(&logits, &b.ids)
                },
                &mut opt,
            )
            .unwrap();
        assert_eq!(report.fp8_saturated.is_some(), fp8);
        out.push(vec![report.loss.to_bits()]);
    }
    out.extend(m.parameters().iter().map(|p| bits(&vals(p))));
    for ts in r.borrow().tensors() {
        out.push(ts.history.iter().copied().chain([ts.scale]).collect());
    }
    out
}

fn reference(dev: Device) -> Device {
    match dev {
        Device::Cpu => Device::Spec,
        _ => Device::Cpu,
    }
}

// Two fp8 training steps give the same losses, weights, histories and
// scales on every device, bit for bit, and differ from plain bf16.
device_test!(fp8_training_is_bitwise_across_devices, |dev| {
    let got = two_steps(dev, true);
    assert_eq!(got, two_steps(reference(dev), true), "{dev:?}");
    // a one-layer Llama: 7 projections and the head, 3 scaled tensors each
    let tensors = got.len() - 2 - two_steps(dev, false).len() + 2;
    assert_eq!(tensors, 8 * 3);
    assert_ne!(got[..2], two_steps(dev, false)[..2], "fp8 changed nothing");
});

// ------------------------------------------------------------ trainer ----

use tinyllm::train::config::{DeviceChoice, TrainConfig, TrainOptions};
use tinyllm::train::data::Corpus;
use tinyllm::train::Trainer;

fn tiny_fp8(extra: TrainOptions) -> TrainConfig {
    TrainConfig::resolve(&TrainOptions {
        preset: Some("tiny".into()),
        device: Some(DeviceChoice::Cpu),
        fp8: Some(true),
        amax_history: Some(4),
        ..extra
    })
    .unwrap()
}

fn snapshot_bits(t: &Trainer) -> Vec<(String, Vec<u32>)> {
    t.snapshot()
        .unwrap()
        .into_iter()
        .map(|(n, v)| (n, bits(&v)))
        .collect()
}

// 4 fp8 steps straight through vs 2, a checkpoint, a resume, 2 more (with
// activation checkpointing, the tiny preset's default): the losses, the
// weights and moments, the amax histories and the scales are equal bit for
// bit; the checkpoint holds the histories.
#[test]
fn fp8_resume_is_bit_for_bit() {
    let corpus = Corpus::embedded();
    let cfg = tiny_fp8(TrainOptions {
        steps: Some(4),
        ..Default::default()
    });
    assert!(cfg.ckpt_budget.is_some());
    let mut a = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
    let la: Vec<u32> = (0..4)
        .map(|_| a.train_step().unwrap().loss.to_bits())
        .collect();
    let dir = tmpdir("fp8-resume");
    let mut b = Trainer::new(cfg.clone(), Device::Cpu, &corpus).unwrap();
    let mut lb: Vec<u32> = (0..2)
        .map(|_| b.train_step().unwrap().loss.to_bits())
        .collect();
    b.save(&dir).unwrap();
    let saved = b.state().fp8.expect("an fp8 run saves its scales");
    assert!(saved.tensors.iter().all(|t| t.history.len() == 2));
    drop(b);
    let mut c = Trainer::resume(cfg, Device::Cpu, &corpus, &dir).unwrap();
    assert_eq!(c.state().fp8.unwrap(), saved, "the scales as saved");
    lb.extend((0..2).map(|_| c.train_step().unwrap().loss.to_bits()));
    assert_eq!(la, lb, "per-step losses");
    assert_eq!(snapshot_bits(&a), snapshot_bits(&c));
    assert_eq!(a.state().fp8, c.state().fp8, "histories and scales");
    // the scales moved off 1 and the histories are full
    let st = a.state().fp8.unwrap();
    assert!(st.tensors.iter().all(|t| t.history.len() == 4));
    assert!(st.tensors.iter().any(|t| t.scale() != 1.0));
    let _ = std::fs::remove_dir_all(&dir);
}

// A tiny fp8 run gives the same losses and weights on the GPU as on the CPU.
#[test]
fn fp8_runs_are_identical_on_cpu_and_gpu() {
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let corpus = Corpus::embedded();
    let cfg = tiny_fp8(TrainOptions {
        steps: Some(2),
        ..Default::default()
    });
    let run = |dev| {
        let mut t = Trainer::new(cfg.clone(), dev, &corpus).unwrap();
        let losses: Vec<u32> = (0..2)
            .map(|_| t.train_step().unwrap().loss.to_bits())
            .collect();
        (losses, snapshot_bits(&t), t.state().fp8)
    };
    assert_eq!(run(Device::Cpu), run(Device::Gpu));
}

// Bad input: a clear error naming the flag.
#[test]
fn fp8_flags_are_validated() {
    let err = |o: TrainOptions| {
        TrainConfig::resolve(&TrainOptions {
            preset: Some("tiny".into()),
            ..o
        })
        .unwrap_err()
        .to_string()
    };
    let fp8 = |o: TrainOptions| TrainOptions {
        fp8: Some(true),
        ..o
    };
    let e = err(fp8(TrainOptions {
        amax_history: Some(0),
        ..Default::default()
    }));
    assert!(e.contains("--amax-history"), "{e}");
    let e = err(fp8(TrainOptions {
        fp8_margin: Some(-1),
        ..Default::default()
    }));
    assert!(e.contains("--fp8-margin"), "{e}");
    let e = err(fp8(TrainOptions {
        precision: Some(Precision::Fp16),
        ..Default::default()
    }));
    assert!(e.contains("--fp8") && e.contains("--fp16"), "{e}");
    let e = err(TrainOptions {
        amax_history: Some(8),
        ..Default::default()
    });
    assert!(e.contains("--amax-history needs --fp8"), "{e}");
    // --fp8 alone: bf16 for the rest, the defaults
    let c = tiny_fp8(TrainOptions::default());
    assert_eq!(c.precision, Precision::Bf16);
    assert_eq!(c.fp8.unwrap().history, 4);
    assert!(c.describe().contains("fp8"));
}

// A resume keeps the recipe: another margin, or fp8 turned on for a run
// that was not fp8, is refused naming the flags; left out, fp8 is kept.
#[test]
fn fp8_resume_keeps_the_recipe() {
    let saved = tiny_fp8(TrainOptions::default());
    let e = TrainConfig::resume(
        &saved,
        &TrainOptions {
            fp8_margin: Some(2),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--fp8-margin"), "{e}");
    let kept = TrainConfig::resume(&saved, &TrainOptions::default()).unwrap();
    assert_eq!(kept.fp8, saved.fp8);
    let plain = TrainConfig::resolve(&TrainOptions {
        preset: Some("tiny".into()),
        ..Default::default()
    })
    .unwrap();
    let e = TrainConfig::resume(
        &plain,
        &TrainOptions {
            fp8: Some(true),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--fp8"), "{e}");
    assert_eq!(
        TrainConfig::resume(&plain, &TrainOptions::default())
            .unwrap()
            .fp8,
        None
    );
}

// The memory plan of an fp8 run is its measured peak, within 5 %: each
// product keeps the 16-bit copies of its own E4M3 operands, and backward's
// E5M2 casts hold their temporaries. A step after the first, which holds
// every buffer a step holds (the first makes AdamW's moments after it).
#[test]
fn fp8_plan_is_the_measured_peak() {
    let cfg = TrainConfig::resolve(&TrainOptions {
        preset: Some("small".into()),
        device: Some(DeviceChoice::Cpu),
        fp8: Some(true),
        micro_batch: Some(4),
        accum: Some(4),
        steps: Some(2),
        ..TrainOptions::default()
    })
    .unwrap();
    let corpus = Corpus::embedded();
    let mut t = Trainer::new(cfg, Device::Cpu, &corpus).unwrap();
    let plan = t.plan().total as f64;
    t.train_step().unwrap();
    let peak = t.train_step().unwrap().peak_bytes as f64;
    let off = (peak - plan) / plan;
    assert!(
        off.abs() <= 0.05,
        "planned {plan} bytes, measured {peak} ({:+.2} %)",
        100.0 * off
    );
}
