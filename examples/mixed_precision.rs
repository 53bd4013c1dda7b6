//! Mixed-precision training of a small Llama, next to float32.
//!
//! The `tiny` preset trained twice on the embedded corpus from the same seed:
//! float32 with the whole batch at once, and bf16 with two micro-batches
//! (gradients accumulated, weighted by their rows) and activation
//! recompute. Prints both losses at every step, then both models'
//! validation losses and the peak tensor bytes of a step.
//!
//! ```text
//! cargo run --release --example mixed_precision [-- STEPS]
//! ```
//! Default: 40 steps (a few seconds on a laptop CPU).

use tinyllm::train::data::Corpus;
use tinyllm::train::{DeviceChoice, TrainConfig, TrainOptions, Trainer};
use tinyllm::{Device, Result};

fn trainer(
    precision: &str,
    micro_batch: usize,
    checkpointing: bool,
    steps: usize,
) -> Result<Trainer> {
    let cfg = TrainConfig::resolve(&TrainOptions {
        preset: Some("tiny".into()),
        device: Some(DeviceChoice::Cpu),
        precision: Some(precision.parse()?),
        steps: Some(steps),
        batch: Some(8),
        micro_batch: Some(micro_batch),
        checkpoint_activations: Some(checkpointing),
        ..Default::default()
    })?;
    Trainer::new(cfg, Device::Cpu, &Corpus::embedded())
}

fn main() -> Result<()> {
    let steps: usize = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .map_err(|_| tinyllm::Error::config(format!("STEPS: not a count: {s:?}")))?,
        None => 40,
    };
    let mut fp32 = trainer("fp32", 8, false, steps)?;
    let mut bf16 = trainer("bf16", 4, true, steps)?;
    println!("tiny preset, batch 8: float32 (1 × 8) vs bf16 (2 micro-batches × 4, checkpointing)");
    println!(
        "{:>5}  {:>12}  {:>12}  {:>10}",
        "step", "fp32 loss", "bf16 loss", "bf16−fp32"
    );
    let (mut peak32, mut peak16) = (0, 0);
    for _ in 0..steps {
        let (a, b) = (fp32.train_step()?, bf16.train_step()?);
        (peak32, peak16) = (peak32.max(a.peak_bytes), peak16.max(b.peak_bytes));
        println!(
            "{:>5}  {:>12.5}  {:>12.5}  {:>+10.5}",
            a.step,
            a.loss,
            b.loss,
            b.loss - a.loss
        );
    }
    let (va, vb) = (fp32.evaluate()?, bf16.evaluate()?);
    println!(
        "validation loss: fp32 {va:.5}, bf16 {vb:.5} ({:+.2}%)",
        100.0 * (vb - va) / va
    );
    println!(
        "peak tensor bytes of a step: fp32 {:.2} MiB, bf16 {:.2} MiB",
        peak32 as f64 / (1 << 20) as f64,
        peak16 as f64 / (1 << 20) as f64
    );
    Ok(())
}
