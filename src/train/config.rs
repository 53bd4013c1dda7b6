//! A training run's settings: what the user gave ([`TrainOptions`], every
//! field optional) resolved against the preset's defaults and validated into a
//! [`TrainConfig`]. Every rejection says what is allowed.

use crate::nn::llama::LlamaConfig;
use crate::precision::Precision;
use crate::recompute::checkpoint_schedule;
use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceChoice {
    /// The GPU when an adapter exists, else the CPU (with a one-line note).
    Auto,
    Cpu,
    Gpu,
}

impl std::str::FromStr for DeviceChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "gpu" => Ok(DeviceChoice::Gpu),
            _ => bail!(Config, "unknown device {s:?}: expected auto, cpu or gpu"),
        }
    }
}

/// What the user asked for; `None` takes the preset's default.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    pub preset: Option<String>,
    pub data: Option<PathBuf>,
    pub steps: Option<usize>,
    pub lr: Option<f32>,
    pub seed: Option<u64>,
    pub device: Option<String>,
    pub precision: Option<String>,
    /// Sequences per optimizer step.
    pub batch: Option<usize>,
    pub micro_batch: Option<usize>,
    pub accum: Option<usize>,
    /// `Some(false)` turns the default checkpointing off.
    pub checkpoint_activations: Option<bool>,
    pub ckpt_budget: Option<usize>,
    /// Gradient-norm clip; 0 turns clipping off.
    pub clip: Option<f32>,
    /// Validation every N steps; 0 = only at the end.
    pub eval_every: Option<usize>,
    /// Checkpoint every N steps; 0 = only at the end.
    pub save_every: Option<usize>,
    pub warmup: Option<usize>,
    pub dropout: Option<f32>,
    pub out: Option<PathBuf>,
}

/// A fully resolved, validated run (saved in every checkpoint).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub preset: String,
    pub model: LlamaConfig,
    pub data: Option<PathBuf>,
    pub steps: usize,
    pub lr: f32,
    /// The cosine schedule decays to `lr · min_lr_frac`.
    pub min_lr_frac: f32,
    pub warmup: usize,
    pub weight_decay: f32,
    pub seed: u64,
    pub device: DeviceChoice,
    pub precision: Precision,
    pub batch: usize,
    pub micro_batch: usize,
    pub accum: usize,
    /// Layer units of activations kept, when checkpointing.
    pub ckpt_budget: Option<usize>,
    pub clip: Option<f32>,
    pub eval_every: usize,
    /// Validation windows per evaluation.
    pub eval_rows: usize,
    pub save_every: usize,
    pub out: PathBuf,
}

/// The largest batch, in sequences (a larger one is a typo, not a plan).
pub const MAX_BATCH: usize = 1 << 16;

/// The largest model a config may describe, in bytes of float32 weights
/// (a corrupt or hand-edited config must not make the loader allocate petabytes).
pub const MAX_MODEL_BYTES: usize = 16 << 30;

/// The most tokens one optimizer step may read.
pub const MAX_TOKENS_PER_STEP: usize = 1 << 24;

/// The longest context a config may ask for, in tokens.
pub const MAX_CONTEXT: usize = 1 << 16;

/// Refuses a model config whose sizes cannot be meant (before anything is
/// allocated for it): more than [`MAX_MODEL_BYTES`] of weights, a context
/// over [`MAX_CONTEXT`], sizes whose products overflow.
pub fn check_model_size(m: &LlamaConfig) -> Result<()> {
    let (v, c, f, l) = (m.vocab_size, m.d_model, m.hidden, m.n_layers);
    let params = (|| {
        let block = c
            .checked_mul(c)?
            .checked_mul(4)?
            .checked_add(c.checked_mul(f)?.checked_mul(3)?)?
            .checked_add(c.checked_mul(2)?)?;
        v.checked_mul(c)?
            .checked_mul(2)?
            .checked_add(l.checked_mul(block)?)?
            .checked_add(c)
    })();
    if params.is_none_or(|p| p > MAX_MODEL_BYTES / 4) {
        bail!(Config,
            "model config: vocab {v}, d_model {c}, hidden {f}, {l} layers is too large for tinyllm (at most {} MiB of float32 weights)",
            MAX_MODEL_BYTES >> 20
        );
    }
    if m.context > MAX_CONTEXT {
        bail!(
            Config,
            "model config: context {} is longer than tinyllm allows (1..={MAX_CONTEXT} tokens)",
            m.context
        );
    }
    Ok(())
}

/// A preset's training recipe.
struct Recipe {
    steps: usize,
    lr: f32,
    batch: usize,
    micro: usize,
    eval_every: usize,
    eval_rows: usize,
}

fn recipe(preset: &str) -> Recipe {
    match preset {
        "tiny" => Recipe {
            steps: 30,
            lr: 1e-2,
            batch: 8,
            micro: 4,
            eval_every: 10,
            eval_rows: 16,
        },
        "small" => Recipe {
            steps: 100,
            lr: 3e-3,
            batch: 16,
            micro: 4,
            eval_every: 30,
            eval_rows: 32,
        },
        // spec C1: an effective batch of 32 sequences as 4 micro-batches of 8
        _ => Recipe {
            steps: 2000,
            lr: 1e-3,
            batch: 32,
            micro: 8,
            eval_every: 100,
            eval_rows: 64,
        },
    }
}

/// The smallest checkpoint budget `n` layers can have (M08.4's smallest `P`):
/// the default of `--checkpoint-activations`, the most memory it can save.
pub fn min_ckpt_budget(n: usize) -> usize {
    (1..=n).map(|k| (k - 1) + n.div_ceil(k)).min().unwrap_or(1)
}

fn at_least_one(name: &str, v: Option<usize>) -> Result<Option<usize>> {
    match v {
        Some(0) => bail!(Config, "{name} must be at least 1 (got 0)"),
        v => Ok(v),
    }
}

impl TrainConfig {
    /// Resolves and validates `o` (the `train` defaults: the `small` preset,
    /// bf16, micro-batches with accumulation, activation checkpointing).
    pub fn resolve(o: &TrainOptions) -> Result<TrainConfig> {
        let preset = o.preset.clone().unwrap_or_else(|| "small".into());
        let mut model = LlamaConfig::preset(&preset).map_err(|e| e.context("--preset"))?;
        if let Some(p) = o.dropout {
            if !(0.0..1.0).contains(&p) {
                bail!(Config, "--dropout must be in [0, 1) (got {p})");
            }
            model.dropout = p;
        }
        let r = recipe(&preset);
        let steps = at_least_one("--steps", o.steps)?.unwrap_or(r.steps);
        let lr = o.lr.unwrap_or(r.lr);
        if !(lr.is_finite() && lr > 0.0) {
            bail!(Config, "--lr must be a positive number (got {lr})");
        }
        let device: DeviceChoice = o
            .device
            .as_deref()
            .unwrap_or("auto")
            .parse()
            .map_err(|e: Error| e.context("--device"))?;
        let precision: Precision = o
            .precision
            .as_deref()
            .unwrap_or("bf16")
            .parse()
            .map_err(|e: Error| e.context("--precision"))?;

        // Any two of batch, micro-batch and accum fix the third; the batch is
        // split into ceil(batch / micro) micro-batches (the last may be smaller).
        let batch_o = at_least_one("--batch", o.batch)?;
        let micro_o = at_least_one("--micro-batch", o.micro_batch)?;
        let accum_o = at_least_one("--accum", o.accum)?;
        let (batch, micro) = match (batch_o, micro_o, accum_o) {
            (Some(b), Some(m), _) => (b, m),
            (Some(b), None, Some(k)) => (b, b.div_ceil(k)),
            (Some(b), None, None) => (b, r.micro.min(b)),
            (None, Some(m), Some(k)) => (m * k, m),
            (None, Some(m), None) => (r.batch.max(m), m),
            (None, None, Some(k)) => (r.micro * k, r.micro),
            (None, None, None) => (r.batch, r.micro),
        };
        if micro > batch {
            bail!(Config, "--micro-batch {micro} is larger than the batch of {batch} sequences: use a micro-batch of 1..={batch}");
        }
        let accum = batch.div_ceil(micro);
        if let Some(k) = accum_o {
            if k != accum {
                bail!(Config, "--accum {k} does not match a batch of {batch} in micro-batches of {micro} (that is {accum} micro-batches); give any two of --batch, --micro-batch, --accum");
            }
        }

        let ckpt_on = o.checkpoint_activations.unwrap_or(true);
        let ckpt_budget = match (ckpt_on, o.ckpt_budget) {
            (false, Some(_)) => {
                bail!(Config,
                "--ckpt-budget needs activation checkpointing (drop --no-checkpoint-activations)"
            )
            }
            (false, None) => None,
            (true, b) => {
                let b = b.unwrap_or_else(|| min_ckpt_budget(model.n_layers));
                checkpoint_schedule(model.n_layers, b).map_err(|e| e.context("--ckpt-budget"))?;
                Some(b)
            }
        };
        let clip = match o.clip {
            None => Some(1.0),
            Some(0.0) => None,
            Some(c) if c.is_finite() && c > 0.0 => Some(c),
            Some(c) => {
                bail!(
                    Config,
                    "--clip must be a positive number, or 0 to turn clipping off (got {c})"
                )
            }
        };
        let warmup = o.warmup.unwrap_or((steps / 10).min(100));
        if warmup >= steps && steps > 1 {
            bail!(
                Config,
                "--warmup {warmup} must be shorter than the run ({steps} steps)"
            );
        }
        let cfg = TrainConfig {
            preset,
            model,
            data: o.data.clone(),
            steps,
            lr,
            min_lr_frac: 0.1,
            warmup,
            weight_decay: 0.01,
            seed: o.seed.unwrap_or(1337),
            device,
            precision,
            batch,
            micro_batch: micro,
            accum,
            ckpt_budget,
            clip,
            eval_every: o.eval_every.unwrap_or(r.eval_every),
            eval_rows: r.eval_rows,
            save_every: o.save_every.unwrap_or(0),
            out: o
                .out
                .clone()
                .unwrap_or_else(|| PathBuf::from("runs/latest")),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every invariant of a resolved run — what [`resolve`](Self::resolve)
    /// guarantees, re-checked for a config read back from a checkpoint (a
    /// hand-edited `trainer_state.json`): an error names the field and what is allowed.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        c.model.validate()?;
        if c.model.vocab_size != crate::train::data::ByteTokenizer::VOCAB {
            bail!(
                Config,
                "model config: vocab_size must be {} (bytes are tokens), got {}",
                crate::train::data::ByteTokenizer::VOCAB,
                c.model.vocab_size
            );
        }
        check_model_size(&c.model)?;
        if c.steps == 0 {
            bail!(Config, "--steps must be at least 1 (got 0)");
        }
        if !(c.lr.is_finite() && c.lr > 0.0) {
            bail!(Config, "--lr must be a positive number (got {})", c.lr);
        }
        if !(c.min_lr_frac.is_finite() && (0.0..=1.0).contains(&c.min_lr_frac)) {
            bail!(
                Config,
                "min_lr_frac must be in [0, 1] (got {})",
                c.min_lr_frac
            );
        }
        if !(c.weight_decay.is_finite() && c.weight_decay >= 0.0) {
            bail!(
                Config,
                "weight_decay must be a non-negative number (got {})",
                c.weight_decay
            );
        }
        if c.batch == 0 || c.batch > MAX_BATCH {
            bail!(
                Config,
                "--batch must be 1..={MAX_BATCH} sequences (got {})",
                c.batch
            );
        }
        if c.batch.saturating_mul(c.model.context) > MAX_TOKENS_PER_STEP {
            bail!(
                Config,
                "--batch {} × context {} is {} tokens per step; at most {MAX_TOKENS_PER_STEP} fit",
                c.batch,
                c.model.context,
                c.batch.saturating_mul(c.model.context)
            );
        }
        if c.micro_batch == 0 || c.micro_batch > c.batch {
            bail!(
                Config,
                "--micro-batch must be 1..={} (the batch), got {}",
                c.batch,
                c.micro_batch
            );
        }
        if c.accum != c.batch.div_ceil(c.micro_batch) {
            bail!(
                Config,
                "--accum {} does not match a batch of {} in micro-batches of {}",
                c.accum,
                c.batch,
                c.micro_batch
            );
        }
        if let Some(b) = c.ckpt_budget {
            checkpoint_schedule(c.model.n_layers, b).map_err(|e| e.context("--ckpt-budget"))?;
        }
        if let Some(clip) = c.clip {
            if !(clip.is_finite() && clip > 0.0) {
                bail!(
                    Config,
                    "--clip must be a positive number, or 0 to turn clipping off (got {clip})"
                );
            }
        }
        if c.warmup >= c.steps && c.steps > 1 {
            bail!(
                Config,
                "--warmup {} must be shorter than the run ({} steps)",
                c.warmup,
                c.steps
            );
        }
        if c.eval_rows == 0 {
            bail!(Config, "eval_rows must be at least 1");
        }
        Ok(())
    }

    /// The learning rate of step `step` (1-based): linear warmup, then a cosine
    /// from `lr` down to `lr · min_lr_frac` at the last step.
    pub fn lr_at(&self, step: usize) -> f32 {
        let lr = self.lr as f64;
        if step <= self.warmup {
            return (lr * step as f64 / self.warmup.max(1) as f64) as f32;
        }
        let span = (self.steps - self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        let floor = lr * self.min_lr_frac as f64;
        (floor + (lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())) as f32
    }

    /// Tokens per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.model.context
    }

    /// One line describing the recipe.
    pub fn describe(&self) -> String {
        format!(
            "preset {} ({} params: C={} layers={} heads={} hidden={} context={}), {} steps, lr {:e} (warmup {}, cosine to {:e}), batch {} = {} micro-batch(es) of {}, {}, {}, clip {}",
            self.preset,
            self.model.num_params(),
            self.model.d_model,
            self.model.n_layers,
            self.model.n_heads,
            self.model.hidden,
            self.model.context,
            self.steps,
            self.lr,
            self.warmup,
            self.lr * self.min_lr_frac,
            self.batch,
            self.accum,
            self.micro_batch,
            self.precision.name(),
            match self.ckpt_budget {
                Some(b) => format!("activation checkpointing (budget {b} layers, schedule {:?})", checkpoint_schedule(self.model.n_layers, b).unwrap_or_default()),
                None => "no activation checkpointing".into(),
            },
            self.clip.map(|c| c.to_string()).unwrap_or_else(|| "off".into()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lr_schedule_warms_up_then_decays_to_a_tenth() {
        let c = TrainConfig::resolve(&TrainOptions {
            steps: Some(100),
            warmup: Some(10),
            lr: Some(1.0),
            ..Default::default()
        })
        .unwrap();
        assert!((c.lr_at(1) - 0.1).abs() < 1e-6);
        assert_eq!(c.lr_at(10), 1.0);
        assert!((c.lr_at(100) - 0.1).abs() < 1e-6);
        assert!((1..100).all(|s| s <= 10 || c.lr_at(s + 1) <= c.lr_at(s)));
    }

    #[test]
    fn smallest_checkpoint_budgets() {
        assert_eq!(min_ckpt_budget(4), 3);
        assert_eq!(min_ckpt_budget(8), 5);
        assert_eq!(min_ckpt_budget(1), 1);
    }
}
