//! How often a training step waits for the GPU. Alone in its own test binary:
//! the GPU work counters are process-wide, so no other test may run beside
//! these, and these take turns (`ONE_AT_A_TIME`).

use tinyllm::gpu::GpuCounters;
use tinyllm::nn::{Layer, Linear};
use tinyllm::ops::mse;
use tinyllm::{grad_accumulate, Device, Generator, Tensor};

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Accumulating k micro-batches reads their losses back once, not k times
/// (each readback is a full GPU sync), and the loss is their weighted sum.
#[test]
fn grad_accumulate_reads_the_losses_back_once() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let dev = Device::Gpu;
    let gen = Generator::new(0);
    let model = Linear::new(4, 1, true, &gen, dev).unwrap();
    let x = Tensor::randn(&[16, 4], 1.0, &gen, dev).unwrap();
    let y = x.sum(-1, true).unwrap();
    let micro: Vec<(Tensor, Tensor)> = [(0, 3), (3, 5), (8, 8)]
        .iter()
        .map(|&(at, len)| (x.narrow(0, at, len).unwrap(), y.narrow(0, at, len).unwrap()))
        .collect();
    let loss_fn = |(x, y): &(Tensor, Tensor)| mse(&model.forward(x)?, y);
    let expected: f64 = micro
        .iter()
        .map(|b| b.0.shape()[0] as f64 / 16.0 * loss_fn(b).unwrap().item().unwrap())
        .sum();
    let before = GpuCounters::now();
    let loss = grad_accumulate(&micro, loss_fn, None).unwrap();
    let work = GpuCounters::now().since(before);
    assert_eq!(work.readbacks, 1, "{work:?}");
    assert!(work.dispatches > 0, "{work:?}");
    assert_eq!(loss, expected as f32);
}

/// A whole mixed-precision step with clipping waits for the GPU once: for
/// the losses, the gradients' finite check and the clipping norm together —
/// with the loss scaler and without it. The reported loss is the one
/// `grad_accumulate` computes from the same state.
#[test]
fn a_training_step_reads_back_once() {
    use tinyllm::nn::Module;
    use tinyllm::optim::{AdamW, AdamWConfig};
    use tinyllm::precision::{DynamicLossScaler, Precision};
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let dev = Device::Gpu;
    for scaled in [false, true] {
        let gen = Generator::new(1);
        let model = Linear::new(4, 1, true, &gen, dev).unwrap();
        let x = Tensor::randn(&[12, 4], 1.0, &gen, dev).unwrap();
        let y = x.sum(-1, true).unwrap();
        let micro: Vec<(Tensor, Tensor)> = [(0, 4), (4, 8)]
            .iter()
            .map(|&(at, len)| (x.narrow(0, at, len).unwrap(), y.narrow(0, at, len).unwrap()))
            .collect();
        let loss_fn = |(x, y): &(Tensor, Tensor)| mse(&model.forward(x)?, y);
        let expected = grad_accumulate(&micro, loss_fn, None).unwrap();
        let mut opt = AdamW::new(model.parameters(), AdamWConfig::new(1e-3)).unwrap();
        let mut scaler = DynamicLossScaler::new(1.0, 2.0, 0.5, 10).unwrap();
        let before = GpuCounters::now();
        let report = tinyllm::train_step_mixed(
            &model,
            &micro,
            loss_fn,
            &mut opt,
            Precision::Fp32,
            scaled.then_some(&mut scaler),
            Some(1.0),
        )
        .unwrap();
        let work = GpuCounters::now().since(before);
        assert_eq!(work.readbacks, 1, "scaler {scaled}: {work:?}");
        assert_eq!(report.loss, expected, "scaler {scaled}");
        assert!(report.grad_norm.is_some());
    }
}

/// The capstone's C1 recipe (`--preset capstone --bf16 --micro-batch 8
/// --accum 4 --checkpoint-activations`): its layers, heads, accumulation and
/// recompute, with tiny widths and `(context, micro-batch)` as given. The
/// GPU work of a step depends on the layers, the micro-batches and the code
/// paths, not on the widths or the rows (while the rows stay below the
/// kernels' loop pass, 16,384): the full-size step counts the same.
fn c1_narrow(context: usize, micro_batch: usize) -> tinyllm::train::config::TrainConfig {
    use tinyllm::train::config::{TrainConfig, TrainOptions};
    let mut cfg = TrainConfig::resolve(&TrainOptions {
        preset: Some("capstone".into()),
        device: Some(tinyllm::train::config::DeviceChoice::Gpu),
        precision: Some(tinyllm::precision::Precision::Bf16),
        micro_batch: Some(micro_batch),
        accum: Some(4),
        checkpoint_activations: Some(true),
        steps: Some(4),
        ..Default::default()
    })
    .unwrap();
    let m = &mut cfg.model;
    (m.d_model, m.hidden, m.context) = (m.n_heads * 4, 24, context);
    cfg
}

/// The GPU work of the second and third C1 optimizer steps (the first
/// creates the optimizer's moments), which must be equal.
fn c1_counts(context: usize, micro_batch: usize) -> GpuCounters {
    use tinyllm::train::data::Corpus;
    use tinyllm::train::Trainer;
    let cfg = c1_narrow(context, micro_batch);
    let mut t = Trainer::new(cfg, Device::Gpu, &Corpus::embedded()).unwrap();
    t.train_step().unwrap();
    let mut steps = Vec::new();
    for _ in 0..2 {
        let before = GpuCounters::now();
        t.train_step().unwrap();
        steps.push(GpuCounters::now().since(before));
    }
    assert_eq!(steps[0], steps[1], "the counts are deterministic");
    steps[0]
}

/// What one C1 optimizer step sends the GPU: dispatches (the target
/// is 600: see BENCHMARKS.md for what would close the gap), queue submits
/// (at most 8: a submit per 1,024 params slots and the readback's) and one
/// readback. Counts are exact; a change that adds GPU work fails here.
const C1_STEP: GpuCounters = GpuCounters {
    dispatches: 758,
    submits: 1,
    readbacks: 1,
};

#[test]
fn a_c1_step_counts_its_gpu_work() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let got = c1_counts(64, 2);
    eprintln!("C1 step (context 64, micro-batch 2): {got:?}");
    assert_eq!(got, C1_STEP);
    assert!(got.submits <= 8 && got.readbacks == 1);
}

/// The same counts at the capstone's context and micro-batch (slow on a
/// software device: `cargo test --release --test gpu_sync -- --ignored`).
#[test]
#[ignore]
fn a_full_length_c1_step_counts_the_same() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if !tinyllm::testing::gpu_available() {
        return;
    }
    let got = c1_counts(512, 8);
    eprintln!("C1 step (context 512, micro-batch 8): {got:?}");
    assert_eq!(got, C1_STEP);
}
