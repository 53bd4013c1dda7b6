//! Does this GPU give the CPU reference's bits? The `tiny` preset trained on
//! both devices from the same seed, compared after every step: the loss and
//! every parameter, bit for bit.
//!
//! ```text
//! cargo run --release --example gpu_vs_cpu [-- STEPS [PRECISION]]
//! ```
//! Defaults: 5 steps of bf16. Exit status 0 when every step is bit-identical,
//! 1 at the first difference (which is printed), 2 without a GPU adapter.
//! `tinyllm crosscheck` goes further: every primitive, and a trace of the
//! call where a run first differs.

use std::process::ExitCode;
use tinyllm::train::data::Corpus;
use tinyllm::train::{DeviceChoice, TrainConfig, TrainOptions, Trainer};
use tinyllm::{Device, Result};

fn trainer(device: Device, precision: &str, steps: usize) -> Result<Trainer> {
    let cfg = TrainConfig::resolve(&TrainOptions {
        preset: Some("tiny".into()),
        device: Some(device.to_string().parse::<DeviceChoice>()?),
        precision: Some(precision.parse()?),
        steps: Some(steps),
        ..Default::default()
    })?;
    Trainer::new(cfg, device, &Corpus::embedded())
}

fn main() -> Result<ExitCode> {
    let mut args = std::env::args().skip(1);
    let steps: usize = match args.next() {
        Some(s) => s
            .parse()
            .map_err(|_| tinyllm::Error::config(format!("STEPS: not a count: {s:?}")))?,
        None => 5,
    };
    let precision = args.next().unwrap_or_else(|| "bf16".into());
    let adapter = match tinyllm::gpu::adapter_name() {
        Ok(name) => name,
        Err(e) => {
            eprintln!("no GPU to compare: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    println!("CPU reference vs {adapter}, tiny preset, {precision}, {steps} steps");
    let (mut cpu, mut gpu) = (
        trainer(Device::Cpu, &precision, steps)?,
        trainer(Device::Gpu, &precision, steps)?,
    );
    for _ in 0..steps {
        let (a, b) = (cpu.train_step()?, gpu.train_step()?);
        let (sa, sb) = (cpu.snapshot()?, gpu.snapshot()?);
        let differing = sa.iter().zip(&sb).find_map(|((name, x), (_, y))| {
            let n = x
                .iter()
                .zip(y)
                .filter(|(p, q)| p.to_bits() != q.to_bits())
                .count();
            (n > 0).then(|| format!("{name}: {n} of {} values differ", x.len()))
        });
        let same_loss = a.loss.to_bits() == b.loss.to_bits();
        match (same_loss, differing) {
            (true, None) => println!(
                "step {}: loss {} (0x{:08x}) and all {} tensors bit-identical",
                a.step,
                a.loss,
                a.loss.to_bits(),
                sa.len()
            ),
            (_, what) => {
                println!(
                    "step {}: DIFFERS — loss cpu 0x{:08x} gpu 0x{:08x}; {}",
                    a.step,
                    a.loss.to_bits(),
                    b.loss.to_bits(),
                    what.unwrap_or_else(|| "parameters equal".into())
                );
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    println!("bit-identical at every step");
    Ok(ExitCode::SUCCESS)
}
