//! The memory plan (spec M05.1): bytes for weights, gradients, optimizer state
//! and activations, given the model, the micro-batch, the precision and the
//! checkpoint schedule — printed before a run, beside the measured peak
//! ([`crate::memory`]) after it.
//!
//! **Parameters.** AdamW keeps 16 bytes per parameter whatever the precision:
//! float32 is 4 (weights) + 4 (grads) + 8 (moments); on bf16 hardware it is
//! 2 (weights) + 2 (grads) + 4 (float32 master) + 8 (moments). This crate
//! *emulates* bf16 (16-bit values in float32 slots), so it stores 4 + 4 + 8.
//!
//! **Activations.** Each op keeps alive only what its backward reads (the
//! graph itself holds no values; reshapes share their input's buffer).
//! Counting what this crate's Llama forward pass keeps, per sequence of `T`
//! tokens (`C` width, `F` MLP width, `H` heads, `V` vocabulary), in float32 values:
//!
//! * one block: `10·T·C + 4·T·F + H·T² + 2·T` — the block input (kept by the
//!   first norm), each RMSNorm's `1/rms` (T) and normalised `x·r` (T·C) and its
//!   output (T·C, read by the projections), q and k after RoPE and v (3·T·C), the
//!   softmax output (H·T²), the attention output before `o_proj` (T·C), the
//!   mid-block residual (T·C, kept by the second norm), and the SwiGLU's gate
//!   pre-activation, SiLU output, up projection and product (4·T·F). Dropout
//!   adds its masks: 2·H·T² (attention: the mask and the dropped weights) and
//!   2·T·C (the two residual branches);
//! * the final norm, LM head and loss: `3·T·C + T·V + 2·T` (the last block's
//!   output, the norm's `1/rms`, `x·r` and output, and the loss's `exp` of the
//!   shifted logits with its row sums).
//!
//! For the capstone (`T` = 512) that is 148.9 MiB of float32 activations for
//! one sequence, beside the chapter's 161 MiB figure for its own forward pass.
//!
//! With checkpointing on a schedule of `k` segments (spec M08.4) the forward
//! pass keeps the `k − 1` checkpointed segments' inputs (`T·C` each) and the
//! activations of one segment at a time: the largest, `max_j s_j` blocks. Backward
//! adds a working set of gradients of about one block's activations.

use crate::nn::llama::LlamaConfig;
use crate::precision::Precision;
use crate::recompute::checkpoint_schedule;
use crate::Result;

/// Planned bytes of one training step.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemoryPlan {
    pub params: usize,
    pub weights: usize,
    pub grads: usize,
    pub optimizer: usize,
    /// Activations held at the end of one micro-batch's forward pass.
    pub activations: usize,
    /// Gradients in flight during backward (about one block's activations).
    pub backward_working: usize,
    /// Layers of activations kept (M08.4's `P`), or `n_layers` without checkpointing.
    pub layer_units: usize,
    pub total: usize,
}

/// Float32 values one block keeps for one sequence (see the module docs).
pub fn block_values(cfg: &LlamaConfig, t: usize) -> usize {
    let (c, f, h) = (cfg.d_model, cfg.hidden, cfg.n_heads);
    let mut v = 10 * t * c + 4 * t * f + h * t * t + 2 * t;
    if cfg.dropout > 0.0 {
        v += 2 * h * t * t + 2 * t * c;
    }
    v
}

/// Float32 values the embedding, final norm, head and loss keep for one sequence.
pub fn head_values(cfg: &LlamaConfig, t: usize) -> usize {
    3 * t * cfg.d_model + t * cfg.vocab_size + 2 * t
}

/// Spec M05.1's `memory_plan(config, batch, precision, checkpointing)`: `rows`
/// sequences of `t` tokens per micro-batch, `ckpt_budget` in layer units.
pub fn memory_plan(
    cfg: &LlamaConfig,
    rows: usize,
    t: usize,
    _precision: Precision,
    ckpt_budget: Option<usize>,
) -> Result<MemoryPlan> {
    let n = cfg.num_params();
    let f32b = 4;
    let block = block_values(cfg, t) * rows * f32b;
    let (held_blocks, inputs, units) = match ckpt_budget {
        None => (cfg.n_layers, 0, cfg.n_layers),
        Some(b) => {
            let s = checkpoint_schedule(cfg.n_layers, b)?;
            let k = s.len();
            let max_seg = (0..k)
                .map(|j| s.get(j + 1).copied().unwrap_or(cfg.n_layers) - s[j])
                .max()
                .unwrap_or(0);
            (
                max_seg,
                k - 1,
                crate::recompute::schedule_peak(&s, cfg.n_layers),
            )
        }
    };
    let activations = held_blocks * block
        + inputs * rows * t * cfg.d_model * f32b
        + head_values(cfg, t) * rows * f32b;
    let p = MemoryPlan {
        params: n,
        weights: n * f32b,
        grads: n * f32b,
        optimizer: 2 * n * f32b,
        activations,
        backward_working: block,
        layer_units: units,
        total: 0,
    };
    Ok(MemoryPlan {
        total: p.weights + p.grads + p.optimizer + p.activations + p.backward_working,
        ..p
    })
}

pub fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

impl MemoryPlan {
    /// The plan as a few lines for the start of a run.
    pub fn describe(
        &self,
        rows: usize,
        t: usize,
        precision: Precision,
        ckpt: Option<usize>,
    ) -> String {
        let ck = match ckpt {
            Some(b) => format!(
                "checkpointing (budget {b}, peak {} layer units)",
                self.layer_units
            ),
            None => "no checkpointing".into(),
        };
        format!(
            "memory plan ({} params, micro-batch {rows}×{t} tokens, {}, {ck}):\n  \
             weights {}  grads {}  AdamW moments {}  activations {}  backward working set {}\n  \
             planned peak {}",
            self.params,
            precision.name(),
            mib(self.weights),
            mib(self.grads),
            mib(self.optimizer),
            mib(self.activations),
            mib(self.backward_working),
            mib(self.total)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpointing_and_micro_batches_lower_the_plan() {
        let cfg = LlamaConfig::preset("capstone").unwrap();
        let full = memory_plan(&cfg, 32, 512, Precision::Fp32, None).unwrap();
        let mixed = memory_plan(&cfg, 8, 512, Precision::Bf16, Some(5)).unwrap();
        // AdamW: 16 bytes per parameter either way (emulated bf16).
        assert_eq!(
            full.weights + full.grads + full.optimizer,
            16 * cfg.num_params()
        );
        assert_eq!(
            mixed.weights + mixed.grads + mixed.optimizer,
            16 * cfg.num_params()
        );
        assert!(mixed.activations * 4 < full.activations);
        assert_eq!(mixed.layer_units, 5);
        // One 512-token sequence through the 8 blocks, as this forward pass keeps it.
        assert_eq!(block_values(&cfg, 512) * 8 * 4, 153_649_152);
    }

    /// The plan's activation count is what the forward pass really holds.
    #[test]
    fn planned_activations_match_the_measured_ones() {
        use crate::nn::llama::Llama;
        use crate::{memory, Device};
        for dropout in [0.0, 0.1] {
            let mut cfg = LlamaConfig::preset("tiny").unwrap();
            cfg.dropout = dropout;
            let m = Llama::new(&cfg, 0, Device::Cpu).unwrap();
            let (b, t) = (3, cfg.context);
            let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % 256) as u32).collect();
            let base = memory::live_bytes();
            let loss =
                crate::ops::cross_entropy(&m.forward(&ids, b, t, None).unwrap(), &ids).unwrap();
            let held = memory::live_bytes() - base;
            let plan = memory_plan(&cfg, b, t, Precision::Fp32, None).unwrap();
            // The loss value itself (4 bytes) is the only thing the plan leaves out.
            assert_eq!(held, plan.activations + 4, "dropout {dropout}");
            drop(loss);
        }
    }
}
