//! Activation memory per precision, measured against the memory plan.
//!
//! One micro-batch of a preset's Llama (default: the capstone, 8 sequences
//! of 512 tokens) in float32, bf16 and fp16 autocast. Under autocast the
//! tensors autograd saves for backward that products read (or that are
//! rounded products) are kept in 16 bits. For each precision it prints:
//!
//! * the bytes the graph holds after the forward pass without recompute,
//!   beside the plan's activation bytes (they agree exactly);
//! * with recompute at the recipe's budget, the peak above the weights
//!   during forward and backward (activations, the backward's working set
//!   and the weight gradients), beside the plan's;
//! * the time of that forward and backward.
//!
//! ```text
//! cargo run --release --example saved_activations [-- PRESET ROWS BUDGET]
//! ```
//! Defaults: capstone 8 5 (the C1 recipe's micro-batch and budget).

use std::time::Instant;
use tinyllm::nn::llama::{Llama, LlamaConfig};
use tinyllm::nn::Module;
use tinyllm::ops::cross_entropy;
use tinyllm::precision::{autocast, Precision};
use tinyllm::train::plan::memory_plan;
use tinyllm::{memory, Device, Result};

fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map_or("capstone", String::as_str);
    let num = |i: usize, d: usize| {
        args.get(i)
            .map_or(d, |a| a.parse().expect("arguments: PRESET ROWS BUDGET"))
    };
    let (rows, budget) = (num(1, 8), num(2, 5));
    let cfg = LlamaConfig::preset(preset)?;
    let t = cfg.context;
    let mut m = Llama::new(&cfg, 0, Device::Cpu)?;
    let ids: Vec<u32> = (0..rows * t).map(|i| (i * 7919 % 251) as u32).collect();
    println!("{preset}: micro-batch {rows} × {t} tokens, checkpointing budget {budget} layers\n");
    println!(
        "{:<6} {:>14} {:>14} {:>18} {:>18} {:>9}",
        "", "held (no ckpt)", "planned", "peak (ckpt, f+b)", "planned", "f+b time"
    );
    let mut held_by = Vec::new();
    for p in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        // Without recompute: what the graph keeps between forward and backward.
        m.set_recompute(None)?;
        let base = memory::live_bytes();
        let loss = {
            let _ac = autocast(p.format());
            cross_entropy(&m.forward(&ids, rows, t)?, &ids)?
        };
        let held = memory::live_bytes() - base - 4; // less the loss itself
        drop(loss);
        let plan = memory_plan(&cfg, rows, t, p, None)?;

        // With recompute: the peak of a whole forward and backward.
        zero_grad(&m);
        m.set_recompute(Some(budget))?;
        let base = memory::live_bytes();
        memory::reset_peak();
        let t0 = Instant::now();
        {
            let _ac = autocast(p.format());
            cross_entropy(&m.forward(&ids, rows, t)?, &ids)?.backward()?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let peak = memory::peak_bytes() - base;
        zero_grad(&m);
        let ck = memory_plan(&cfg, rows, t, p, Some(budget))?;
        println!(
            "{:<6} {:>14} {:>14} {:>18} {:>18} {:>8.2}s",
            p.name(),
            mib(held),
            mib(plan.activations),
            mib(peak),
            mib(ck.activations + ck.backward_working + ck.grads),
            secs
        );
        held_by.push((held, ck.activations));
    }
    let less = |a: usize, b: usize| 100.0 * (1.0 - a as f64 / b as f64);
    println!(
        "\nbf16 keeps {:.1} % less than float32 without checkpointing (measured); \
         the C1 micro-batch's planned activations {:.1} % less",
        less(held_by[1].0, held_by[0].0),
        less(held_by[1].1, held_by[0].1)
    );
    Ok(())
}

fn zero_grad(m: &Llama) {
    for p in m.parameters() {
        p.zero_grad();
    }
}
