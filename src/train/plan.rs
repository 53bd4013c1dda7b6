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
//! **Activations.** The autograd graph keeps every op's output alive until
//! backward has used it (reshapes share their input's buffer). Counting the
//! outputs of this crate's Llama forward pass, per sequence of `T` tokens
//! (`C` width, `F` MLP width, `H` heads, `V` vocabulary), in float32 values:
//!
//! * one block: `28·T·C + 4·T·F + 4·H·T² + T² + 8·T` — two RMSNorms (3·T·C each:
//!   x², x·r, x·r·w), q/k/v projections and their head permutes (6·T·C), RoPE on q
//!   and k (10·T·C: two products, the half-rotation's two halves, negation and
//!   concatenation, the sum), scores, scaled scores, masked scores and softmax
//!   (4·H·T²) plus the mask (T²), attention output, its permute and the output
//!   projection (3·T·C), two residual sums (2·T·C), the SwiGLU's gate, SiLU, up
//!   and product (4·T·F) and down projection (T·C); dropout adds 4·H·T² + 2·T·C
//!   when on;
//! * the embedding, final norm, LM head and loss: `4·T·C + 4·T·V`.
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
    let mut v = 28 * t * c + 4 * t * f + 4 * h * t * t + t * t + 8 * t;
    if cfg.dropout > 0.0 {
        v += 4 * h * t * t + 2 * t * c;
    }
    v
}

/// Float32 values the embedding, final norm, head and loss keep for one sequence.
pub fn head_values(cfg: &LlamaConfig, t: usize) -> usize {
    4 * t * cfg.d_model + 4 * t * cfg.vocab_size
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
            (max_seg, k - 1, crate::recompute::schedule_peak(&s, cfg.n_layers))
        }
    };
    let activations =
        held_blocks * block + inputs * rows * t * cfg.d_model * f32b + head_values(cfg, t) * rows * f32b;
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
    pub fn describe(&self, rows: usize, t: usize, precision: Precision, ckpt: Option<usize>) -> String {
        let ck = match ckpt {
            Some(b) => format!("checkpointing (budget {b}, peak {} layer units)", self.layer_units),
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
        assert_eq!(full.weights + full.grads + full.optimizer, 16 * cfg.num_params());
        assert_eq!(mixed.weights + mixed.grads + mixed.optimizer, 16 * cfg.num_params());
        assert!(mixed.activations * 4 < full.activations);
        assert_eq!(mixed.layer_units, 5);
        // One 512-token sequence through the 8 blocks, as this forward pass keeps it.
        assert_eq!(block_values(&cfg, 512) * 8 * 4, 382_337_024);
    }
}
