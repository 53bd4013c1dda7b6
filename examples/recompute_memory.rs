//! Activation recompute (the spec's checkpointing), planned against measured.
//!
//! An `n`-layer stack of Linear(width → width) + SiLU blocks on the CPU, trained
//! one step for every memory budget from `n` (no checkpointing) down to the
//! smallest feasible one. For each budget it prints the checkpoint schedule, its
//! planned peak `P = (k − 1) + max_j s_j` in layer units and in bytes (`P` ×
//! one layer's activation bytes, measured), the bytes the graph actually holds
//! between forward and backward, the measured overall peak (forward and
//! backward, parameter gradients included), how many layer forwards were
//! recomputed, and whether every gradient equals the plain run's bit for bit.
//!
//! ```text
//! cargo run --release --example recompute_memory [-- LAYERS ROWS WIDTH]
//! ```
//! Defaults: 8 layers, 4096 rows (e.g. 8 sequences of 512 tokens), width 512.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Instant;
use tinyllm::memory;
use tinyllm::nn::{Layer, Linear, Module};
use tinyllm::recompute::{checkpoint_schedule, checkpoint_sequential, schedule_peak};
use tinyllm::{Device, Generator, Result, Tensor};

struct Block {
    lin: Linear,
    calls: Rc<Cell<usize>>,
}

impl Module for Block {
    fn parameters(&self) -> Vec<Tensor> {
        self.lin.parameters()
    }
}

impl Layer for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.calls.set(self.calls.get() + 1);
        self.lin.forward(x)?.silu()
    }
}

fn mib(b: usize) -> String {
    format!("{:.2} MiB", b as f64 / (1024.0 * 1024.0))
}

struct Row {
    held: usize,
    peak: usize,
    forwards: usize,
    grads: Vec<Vec<u32>>,
    secs: f64,
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments: LAYERS ROWS WIDTH (integers)"))
        .collect();
    let n = args.first().copied().unwrap_or(8);
    let rows = args.get(1).copied().unwrap_or(4096);
    let width = args.get(2).copied().unwrap_or(512);
    let dev = Device::Cpu;

    let gen = Generator::new(0);
    let calls = Rc::new(Cell::new(0usize));
    let layers: Vec<Rc<dyn Layer>> = (0..n)
        .map(|_| {
            Ok(Rc::new(Block {
                lin: Linear::new(width, width, true, &gen, dev)?,
                calls: calls.clone(),
            }) as Rc<dyn Layer>)
        })
        .collect::<Result<_>>()?;
    let params: Vec<Tensor> = layers.iter().flat_map(|l| l.parameters()).collect();
    let x = Tensor::uniform(&[rows, width], 1.0, &gen, dev)?;
    let r = Tensor::uniform(&[rows, width], 1.0, &gen, dev)?;

    // One layer's activation bytes: what a single block's graph holds (its
    // matmul output, the bias sum, the SiLU output), measured.
    let layer_bytes = {
        let base = memory::live_bytes();
        let y = layers[0].forward(&x)?;
        let held = memory::live_bytes() - base;
        drop(y);
        held
    };

    let run = |budget: Option<usize>| -> Result<Row> {
        for p in &params {
            p.zero_grad();
        }
        calls.set(0);
        let t0 = Instant::now();
        let base = memory::live_bytes();
        memory::reset_peak();
        let out = match budget {
            None => {
                let mut h = x.clone();
                for l in &layers {
                    h = l.forward(&h)?;
                }
                h
            }
            Some(b) => checkpoint_sequential(&layers, &x, b, &[])?,
        };
        let loss = out.mul(&r)?.sum_all()?;
        drop(out);
        let held = memory::live_bytes() - base;
        loss.backward()?;
        drop(loss);
        let peak = memory::peak_bytes() - base;
        let grads = params
            .iter()
            .map(|p| {
                p.grad()
                    .expect("a gradient")
                    .to_vec_f32()
                    .map(|v| v.iter().map(|f| f.to_bits()).collect())
            })
            .collect::<Result<_>>()?;
        Ok(Row {
            held,
            peak,
            forwards: calls.get(),
            grads,
            secs: t0.elapsed().as_secs_f64(),
        })
    };

    let plain = run(None)?;
    let weight_bytes: usize = params.iter().map(|p| p.numel() * 4).sum();
    println!(
        "{n} × (Linear({width}→{width}) + SiLU), input {rows}×{width} f32 ({}), CPU",
        mib(rows * width * 4)
    );
    println!(
        "one layer's activations: {} measured; parameter gradients: {} (inside every peak)",
        mib(layer_bytes),
        mib(weight_bytes)
    );
    println!(
        "plain run (no checkpoint_sequential): held {}, peak {}, {} forwards\n",
        mib(plain.held),
        mib(plain.peak),
        plain.forwards
    );
    println!(
        "| budget | schedule       | segments     |  P | planned P×layer | held fwd→bwd | held/plain | overall peak | peak/plain | recomputed | grads = plain | time  |"
    );
    println!(
        "|-------:|----------------|--------------|---:|----------------:|-------------:|-----------:|-------------:|-----------:|-----------:|---------------|------:|"
    );
    let mut budget = n;
    loop {
        let sched = match checkpoint_schedule(n, budget) {
            Ok(s) => s,
            Err(e) => {
                println!("\nbudget {budget}: {e}");
                break;
            }
        };
        let sizes: Vec<usize> = (0..sched.len())
            .map(|j| sched.get(j + 1).copied().unwrap_or(n) - sched[j])
            .collect();
        let p = schedule_peak(&sched, n);
        let row = run(Some(budget))?;
        println!(
            "| {budget:>6} | {:<14} | {:<12} | {p:>2} | {:>15} | {:>12} | {:>9.0}% | {:>12} | {:>9.0}% | {:>10} | {:<13} | {:>4.1}s |",
            format!("{sched:?}"),
            format!("{sizes:?}"),
            mib(p * layer_bytes),
            mib(row.held),
            100.0 * row.held as f64 / plain.held as f64,
            mib(row.peak),
            100.0 * row.peak as f64 / plain.peak as f64,
            row.forwards - n,
            if row.grads == plain.grads { "bit for bit" } else { "DIFFERENT" },
            row.secs,
        );
        if budget == 0 {
            break;
        }
        budget -= 1;
    }
    Ok(())
}
