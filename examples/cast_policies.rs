//! Activation memory per cast policy, measured against the memory plan.
//!
//! One micro-batch of a preset's Llama (default: the capstone, 8 sequences
//! of 512 tokens) in float32 and under bf16 autocast with each built-in
//! cast policy (`matmuls`, `torch`, `pure`). For each it prints:
//!
//! * the bytes the graph holds after the forward pass without recompute,
//!   beside the plan's activation bytes (they agree exactly);
//! * with recompute at the recipe's budget, the peak above the weights
//!   during forward and backward, beside the plan's;
//! * the time of that forward and backward, and its loss.
//!
//! ```text
//! cargo run --release --example cast_policies [-- PRESET ROWS BUDGET]
//! ```
//! Defaults: capstone 8 5 (the C1 recipe's micro-batch and budget).

use std::time::Instant;
use tinyllm::nn::llama::{Llama, LlamaConfig};
use tinyllm::nn::Module;
use tinyllm::ops::cross_entropy;
use tinyllm::precision::{autocast, CastPolicy, CastTable, Scope};
use tinyllm::train::plan::memory_plan_policy;
use tinyllm::{memory, Device, Format, Result};

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
        "{:<8} {:>14} {:>14} {:>18} {:>18} {:>9} {:>8}",
        "", "held (no ckpt)", "planned", "peak (ckpt, f+b)", "planned", "f+b time", "loss"
    );
    let mut runs: Vec<(String, Option<CastTable>)> = vec![("float32".into(), None)];
    for name in ["matmuls", "torch", "pure"] {
        runs.push((
            name.into(),
            Some(CastPolicy::builtin(name, Format::Bf16)?.table()),
        ));
    }
    for (name, table) in runs {
        // Without recompute: what the graph keeps between forward and backward.
        m.set_recompute(None)?;
        let base = memory::live_bytes();
        let loss = {
            let _ac = autocast(Scope::table(table));
            cross_entropy(&m.forward(&ids, rows, t)?, &ids)?
        };
        let held = memory::live_bytes() - base - 4; // less the loss itself
        drop(loss);
        let plan = memory_plan_policy(&cfg, rows, t, table, None, false, false)?;

        // With recompute: the peak of a whole forward and backward.
        zero_grad(&m);
        m.set_recompute(Some(budget))?;
        let base = memory::live_bytes();
        memory::reset_peak();
        let t0 = Instant::now();
        let value = {
            let _ac = autocast(Scope::table(table));
            let loss = cross_entropy(&m.forward(&ids, rows, t)?, &ids)?;
            loss.backward()?;
            loss.item()?
        };
        let secs = t0.elapsed().as_secs_f64();
        let peak = memory::peak_bytes() - base;
        zero_grad(&m);
        let ck = memory_plan_policy(&cfg, rows, t, table, Some(budget), false, false)?;
        println!(
            "{:<8} {:>14} {:>14} {:>18} {:>18} {:>8.2}s {:>8.4}",
            name,
            mib(held),
            mib(plan.activations),
            mib(peak),
            mib(ck.activations + ck.backward_working + ck.grads),
            secs,
            value
        );
    }
    Ok(())
}

fn zero_grad(m: &Llama) {
    for p in m.parameters() {
        p.zero_grad();
    }
}
