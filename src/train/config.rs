//! A training run's settings: what the user gave ([`TrainOptions`], every
//! field optional) resolved against the preset's defaults and validated into a
//! [`TrainConfig`]. Every rejection says what is allowed.

use crate::backend::round::Format;
use crate::nn::llama::LlamaConfig;
use crate::precision::{AmaxReduction, CastPolicy, CastTable, Fp8Config, Precision};
use crate::recompute::{check_budget, checkpoint_schedule, min_ckpt_budget, Recompute};
use crate::{bail, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceChoice {
    /// The GPU when an adapter exists, else the CPU (with a one-line note).
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The GPU backend; a run fails when no adapter exists.
    Gpu,
    /// The executable spec: every primitive as its contract states it, one
    /// thread, no SIMD — slow; for checking a run against the contract.
    Spec,
}

impl DeviceChoice {
    /// The choice as the `--device` flag spells it: `auto`, `cpu`, `gpu` or `spec`
    /// (what [`str::parse`] reads back).
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Auto => "auto",
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Gpu => "gpu",
            DeviceChoice::Spec => "spec",
        }
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "gpu" => Ok(DeviceChoice::Gpu),
            "spec" => Ok(DeviceChoice::Spec),
            _ => bail!(
                Config,
                "unknown device {s:?}: expected auto, cpu, gpu or spec"
            ),
        }
    }
}

/// What the user asked for; `None` takes the preset's default.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// The model and recipe: `tiny`, `small` or `capstone` (default `small`).
    pub preset: Option<String>,
    /// A UTF-8 text file to train on (default: the embedded corpus).
    pub data: Option<PathBuf>,
    /// The optimizer step to stop at (the preset's default: 30 for `tiny`,
    /// 100 for `small`, 2000 for `capstone`).
    pub steps: Option<usize>,
    /// The peak learning rate, reached after warmup (the preset's default:
    /// 1e-2, 3e-3 or 1e-3).
    pub lr: Option<f32>,
    /// Seeds the initial weights, dropout, the train/validation split and
    /// the batch order (default 1337).
    pub seed: Option<u64>,
    /// Where to run (default [`DeviceChoice::Auto`]). The CLI's `--device`
    /// string parses into one (`"cpu".parse()`).
    pub device: Option<DeviceChoice>,
    /// The precision recipe (default [`Precision::Bf16`]). The CLI's
    /// `--precision` string parses into one (`"fp16".parse()`; also
    /// `float32`, `bfloat16`, `float16`).
    pub precision: Option<Precision>,
    /// Sequences per optimizer step.
    pub batch: Option<usize>,
    /// Sequences per forward and backward pass. Any two of `batch`,
    /// `micro_batch` and `accum` fix the third; given none, the preset's
    /// batch (8, 16 or 32) in micro-batches of 4, 4 or 8.
    pub micro_batch: Option<usize>,
    /// Micro-batches accumulated per optimizer step; it must equal
    /// `batch / micro_batch` rounded up.
    pub accum: Option<usize>,
    /// `Some(false)` turns the default checkpointing off; `Some(true)` asks
    /// for it (the default). It means the block half of
    /// [`recompute`](Self::recompute): with a policy given as well, the two
    /// must agree (`Some(true)` with `blocks` or `both`, `Some(false)` with
    /// `none` or `attention`), else resolving is an error naming both flags.
    pub checkpoint_activations: Option<bool>,
    /// What backward recomputes (`--recompute none|attention|blocks|both`;
    /// default `blocks`, today's activation checkpointing). `blocks` and
    /// `both` checkpoint the blocks at [`ckpt_budget`](Self::ckpt_budget);
    /// `attention` and `both` recompute every attention's core.
    pub recompute: Option<Recompute>,
    /// The activation-checkpointing budget, in layers of activations held at
    /// the peak, in [`budget_range`](crate::recompute::budget_range) of the
    /// layer count (default: the smallest the model allows,
    /// [`min_ckpt_budget`]). Needs checkpointing on.
    pub ckpt_budget: Option<usize>,
    /// Gradient-norm clip (default 1.0); 0 turns clipping off.
    pub clip: Option<f32>,
    /// Validation every N steps; 0 = only at the end.
    pub eval_every: Option<usize>,
    /// Checkpoint every N steps; 0 = only at the end.
    pub save_every: Option<usize>,
    /// Steps of linear learning-rate warmup (default a tenth of `steps`, at
    /// most 100).
    pub warmup: Option<usize>,
    /// The dropout probability, in `[0, 1)` (the presets have none).
    pub dropout: Option<f32>,
    /// The output directory for checkpoints, metrics and plot (default
    /// `runs/latest`).
    pub out: Option<PathBuf>,
    /// The cast policy (`--cast-policy`): a built-in's name (`matmuls`, the
    /// default; `torch`; `pure` — at the precision's 16-bit format) or a
    /// JSON file ([`CastPolicy`]'s form).
    pub cast_policy: Option<String>,
    /// `--fp8`: the Linear layers' products in fp8 with per-tensor delayed
    /// scaling (the rest under bf16 autocast). `Some(true)` asks for it.
    pub fp8: Option<bool>,
    /// `--amax-history N`: amaxes each fp8 scale is fitted to (default 16).
    pub amax_history: Option<usize>,
    /// `--fp8-margin M`: powers of two of headroom below the fp8 maximum
    /// (default 0; negative is refused).
    pub fp8_margin: Option<i64>,
    /// `--amax-reduction max|most_recent` (default `max`).
    pub amax_reduction: Option<AmaxReduction>,
}

/// The fp8 recipe the options ask for: `None` without `--fp8`. fp8 runs
/// the rest of the model under bf16 autocast (E5M2 gradients have fp16's
/// range problem solved by their scales, not by a loss scaler), so it
/// refuses `--fp16` and `--fp32`; its own flags need it, a history of at
/// least 1 and a margin of at least 0.
fn resolve_fp8(o: &TrainOptions) -> Result<Option<Fp8Config>> {
    if !o.fp8.unwrap_or(false) {
        for (flag, given) in [
            ("--amax-history", o.amax_history.is_some()),
            ("--fp8-margin", o.fp8_margin.is_some()),
            ("--amax-reduction", o.amax_reduction.is_some()),
        ] {
            if given {
                bail!(Config, "{flag} needs --fp8");
            }
        }
        return Ok(None);
    }
    if let Some(p @ (Precision::Fp16 | Precision::Fp32)) = o.precision {
        bail!(
            Config,
            "--fp8 cannot be combined with --{}: fp8 runs the rest of the model under bf16 autocast",
            p.name()
        );
    }
    let history = o.amax_history.unwrap_or(Fp8Config::default().history);
    if history == 0 {
        bail!(Config, "--amax-history must be at least 1 (got 0)");
    }
    let margin = o.fp8_margin.unwrap_or(0);
    if !(0..=64).contains(&margin) {
        bail!(
            Config,
            "--fp8-margin must be between 0 and 64 powers of two (got {margin})"
        );
    }
    Ok(Some(Fp8Config {
        history,
        reduction: o.amax_reduction.unwrap_or(AmaxReduction::Max),
        margin: margin as u32,
    }))
}

/// A fully resolved, validated run (saved in every checkpoint).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// The preset the run was resolved from.
    pub preset: String,
    /// The model's architecture (the preset's, with the run's dropout).
    pub model: LlamaConfig,
    /// The training text (absolute; `None`: the embedded corpus). A resumed
    /// run checks the text by its SHA-256, not by this path.
    pub data: Option<PathBuf>,
    /// The optimizer step the run stops at.
    pub steps: usize,
    /// The step the learning-rate schedule ends at: the first run's planned
    /// total. A run extended past it (`--resume DIR --steps 2N`) holds the
    /// schedule's last rate, `lr · min_lr_frac`, instead of re-stretching it.
    /// (0 in a checkpoint written before this field existed: read as `steps`.)
    #[serde(default)]
    pub schedule_steps: usize,
    /// The peak learning rate, reached at the end of warmup.
    pub lr: f32,
    /// The cosine schedule decays to `lr · min_lr_frac` (0.1 from
    /// [`resolve`](Self::resolve)).
    pub min_lr_frac: f32,
    /// Steps of linear learning-rate warmup.
    pub warmup: usize,
    /// AdamW's decoupled weight decay (0.01 from [`resolve`](Self::resolve)).
    pub weight_decay: f32,
    /// Seeds the initial weights, dropout, the split and the batch order.
    pub seed: u64,
    /// Where to run (resolved to a device when the run starts).
    pub device: DeviceChoice,
    /// The precision recipe of every step.
    pub precision: Precision,
    /// Sequences per optimizer step.
    pub batch: usize,
    /// Sequences per forward and backward pass.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step: `batch / micro_batch` rounded up
    /// (the last may be smaller).
    pub accum: usize,
    /// Layer units of activations kept, when checkpointing (`None`:
    /// activation checkpointing off).
    pub ckpt_budget: Option<usize>,
    /// Whether every attention's core is recomputed in backward
    /// ([`Llama::set_attention_recompute`](crate::nn::llama::Llama::set_attention_recompute));
    /// with [`ckpt_budget`](Self::ckpt_budget) it makes the run's
    /// [`recompute`](Self::recompute) policy. (Absent in checkpoints written
    /// before it existed, and in those of runs without it: off.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recompute_attention: bool,
    /// The cast policy of every step (`None`: `matmuls`, plain autocast at
    /// the precision's format; also what checkpoints written before policies
    /// existed load as).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cast_policy: Option<CastPolicy>,
    /// fp8 with delayed scaling for the Linear layers' products (`None`:
    /// off; also what checkpoints written before fp8 existed load as).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Fp8Config>,
    /// The gradient-norm clip (`None`: no clipping).
    pub clip: Option<f32>,
    /// Validation every N steps; 0 = only at the end.
    pub eval_every: usize,
    /// Validation windows per evaluation.
    pub eval_rows: usize,
    /// Checkpoint every N steps; 0 = only at the end.
    pub save_every: usize,
    /// The output directory.
    pub out: PathBuf,
}

/// The key the batch-order stream's seed is drawn with (`seed ^ DATA_KEY`),
/// so it differs from the weights' and dropout's streams of the same seed.
const DATA_KEY: u64 = 0x0ba7_c4e5_0000;

/// The largest batch, in sequences (a larger one is a typo, not a plan).
pub const MAX_BATCH_SEQUENCES: usize = 1 << 16;

/// The largest model a config may describe, in bytes of float32 weights
/// (a corrupt or hand-edited config must not make the loader allocate petabytes).
pub const MAX_MODEL_BYTES: usize = 16 << 30;

/// The most tokens one optimizer step may read.
pub const MAX_TOKENS_PER_STEP: usize = 1 << 24;

/// The most optimizer steps a run may ask for (far more than any run takes,
/// and small enough that every count derived from it fits).
pub const MAX_STEPS: usize = 1 << 40;

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

/// `--cast-policy`'s value: `None` for `matmuls` (the default), a
/// built-in at `precision`'s format, or a policy read from a JSON file.
/// Errors name the flag: an unknown name, a file that cannot be read or
/// parsed, an unknown op or format in it, or any policy but `matmuls` on
/// a float32 run (which rounds nothing).
pub fn resolve_cast_policy(arg: Option<&str>, precision: Precision) -> Result<Option<CastPolicy>> {
    let Some(arg) = arg else { return Ok(None) };
    if arg == "matmuls" {
        return Ok(None);
    }
    let low = |what: &str| {
        match precision.format() {
        Some(f) => Ok(f),
        None => Err(crate::Error::config(format!(
            "--cast-policy {what} needs a 16-bit precision (--bf16 or --fp16): a float32 run rounds nothing"
        ))),
    }
    };
    if CastPolicy::is_builtin(arg) {
        return Ok(Some(CastPolicy::builtin(arg, low(arg)?)?));
    }
    let path = std::path::Path::new(arg);
    if !arg.ends_with(".json") && !path.exists() {
        bail!(
            Config,
            "--cast-policy: unknown policy {arg:?}: expected matmuls, torch, pure or a .json file"
        );
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| crate::Error::config(format!("--cast-policy: cannot read {arg}: {e}")))?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or(arg);
    let policy = CastPolicy::from_json(&text, stem)
        .map_err(|e| e.context(format!("--cast-policy {arg}")))?;
    low(arg)?;
    Ok(Some(policy))
}

impl TrainConfig {
    /// Resolves `o` against its preset's recipe (the `train` defaults: the
    /// `small` preset, bf16, micro-batches with accumulation, activation
    /// checkpointing), then [`validate`](Self::validate)s the result: every
    /// check lives there, so a flag's rule is written once.
    pub fn resolve(o: &TrainOptions) -> Result<TrainConfig> {
        let preset = o.preset.clone().unwrap_or_else(|| "small".into());
        let mut model = LlamaConfig::preset(&preset).map_err(|e| e.context("--preset"))?;
        if let Some(p) = o.dropout {
            model.dropout = p;
        }
        let r = recipe(&preset);
        let steps = o.steps.unwrap_or(r.steps);
        let device = o.device.unwrap_or(DeviceChoice::Auto);
        let fp8 = resolve_fp8(o)?;
        let precision = o.precision.unwrap_or(Precision::Bf16);
        let cast_policy = resolve_cast_policy(o.cast_policy.as_deref(), precision)?;

        // Any two of batch, micro-batch and accum fix the third; the batch is
        // split into ceil(batch / micro) micro-batches (the last may be
        // smaller). The arithmetic is total (a 0 stays in its own field for
        // `validate` to name); a given accum is kept, to be checked.
        let (batch, micro) = match (o.batch, o.micro_batch, o.accum) {
            (Some(b), Some(m), _) => (b, m),
            (Some(b), None, Some(k)) => (b, b.div_ceil(k.max(1))),
            (Some(b), None, None) => (b, r.micro.min(b).max(1)),
            (None, Some(m), Some(k)) => (m.saturating_mul(k.max(1)), m),
            (None, Some(m), None) => (r.batch.max(m), m),
            (None, None, Some(k)) => (r.micro.saturating_mul(k.max(1)), r.micro),
            (None, None, None) => (r.batch, r.micro),
        };
        let accum = o.accum.unwrap_or(batch.div_ceil(micro.max(1)));

        // Options that contradict each other (not a config's invariant).
        // --checkpoint-activations / --no-checkpoint-activations are the block
        // half of --recompute: given both, they must agree.
        let ckpt_on = match (o.recompute, o.checkpoint_activations) {
            (None, c) => c.unwrap_or(true),
            (Some(p), None) => p.blocks(),
            (Some(p), Some(c)) if p.blocks() == c => c,
            (Some(p), Some(c)) => {
                let (flag, says) = match c {
                    true => ("--checkpoint-activations", "checkpoints no blocks"),
                    false => ("--no-checkpoint-activations", "checkpoints blocks"),
                };
                bail!(
                    Config,
                    "{flag} contradicts --recompute {p} (which {says}): give --recompute {} alone",
                    Recompute::new(c, p.attention())
                )
            }
        };
        if !ckpt_on && o.ckpt_budget.is_some() {
            match o.recompute {
                Some(p) => bail!(
                    Config,
                    "--ckpt-budget needs activation checkpointing: --recompute {p} checkpoints no blocks (use --recompute blocks or both)"
                ),
                None => bail!(
                    Config,
                    "--ckpt-budget needs activation checkpointing (drop --no-checkpoint-activations)"
                ),
            }
        }
        let recompute_attention = o.recompute.is_some_and(Recompute::attention);
        let ckpt_budget = ckpt_on.then(|| {
            o.ckpt_budget
                .unwrap_or_else(|| min_ckpt_budget(model.n_layers))
        });
        let clip = match o.clip {
            None => Some(1.0),
            Some(0.0) => None,
            c => c,
        };
        let cfg = TrainConfig {
            preset,
            model,
            data: o
                .data
                .as_ref()
                .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone())),
            steps,
            schedule_steps: steps,
            lr: o.lr.unwrap_or(r.lr),
            min_lr_frac: 0.1,
            warmup: o.warmup.unwrap_or((steps / 10).min(100)),
            weight_decay: 0.01,
            seed: o.seed.unwrap_or(1337),
            device,
            precision,
            batch,
            micro_batch: micro,
            accum,
            ckpt_budget,
            recompute_attention,
            cast_policy,
            fp8,
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

    /// The config that continues `saved` (a checkpoint's run) with the
    /// options `o`. A continuation may change `--steps` (the schedule stays
    /// the one planned: see [`schedule_steps`](Self::schedule_steps)),
    /// `--out`, `--eval-every`, `--save-every`, `--device` and `--data` (the
    /// same text, wherever it now lies: the trainer checks its SHA-256). Every
    /// other option given must resolve to the saved value: options left out
    /// are taken from `saved`, so only a real difference is an error, and it
    /// names the flag, the saved value and the given one.
    pub fn resume(saved: &TrainConfig, o: &TrainOptions) -> Result<TrainConfig> {
        saved.validate()?;
        let batch_flags = [o.batch, o.micro_batch, o.accum]
            .iter()
            .filter(|v| v.is_some())
            .count();
        let filled = TrainOptions {
            preset: Some(o.preset.clone().unwrap_or_else(|| saved.preset.clone())),
            data: None,
            // Resolved against the planned schedule (a --warmup check must
            // not see a shorter continuation); `steps` is set below.
            steps: Some(saved.schedule_steps),
            lr: o.lr.or(Some(saved.lr)),
            seed: o.seed.or(Some(saved.seed)),
            device: Some(o.device.unwrap_or(saved.device)),
            precision: Some(o.precision.unwrap_or(saved.precision)),
            batch: match batch_flags {
                0 => Some(saved.batch),
                1 => o.batch.or(Some(saved.batch)),
                _ => o.batch,
            },
            micro_batch: match batch_flags {
                0 => Some(saved.micro_batch),
                1 if o.batch.is_some() => Some(saved.micro_batch),
                _ => o.micro_batch,
            },
            accum: o.accum,
            // A policy given is resolved as given (checked against the saved
            // one below); otherwise the saved policy, with the blocks as
            // --checkpoint-activations says if given.
            checkpoint_activations: match o.recompute {
                Some(_) => o.checkpoint_activations,
                None => o
                    .checkpoint_activations
                    .or(Some(saved.ckpt_budget.is_some())),
            },
            recompute: o.recompute.or_else(|| {
                let blocks = o
                    .checkpoint_activations
                    .unwrap_or(saved.ckpt_budget.is_some());
                Some(Recompute::new(blocks, saved.recompute_attention))
            }),
            ckpt_budget: match o.checkpoint_activations == Some(false)
                || o.recompute.is_some_and(|p| !p.blocks())
            {
                true => o.ckpt_budget,
                false => o.ckpt_budget.or(saved.ckpt_budget),
            },
            clip: o.clip.or(Some(saved.clip.unwrap_or(0.0))),
            eval_every: o.eval_every.or(Some(saved.eval_every)),
            save_every: o.save_every.or(Some(saved.save_every)),
            warmup: o.warmup.or(Some(saved.warmup)),
            dropout: o.dropout.or(Some(saved.model.dropout)),
            out: Some(o.out.clone().unwrap_or_else(|| saved.out.clone())),
            // a policy given is resolved and checked below; the saved one
            // (perhaps from a file no longer there) is kept
            cast_policy: o.cast_policy.clone(),
            fp8: Some(o.fp8.unwrap_or(saved.fp8.is_some())),
            amax_history: o.amax_history.or(saved.fp8.map(|c| c.history)),
            fp8_margin: o.fp8_margin.or(saved.fp8.map(|c| c.margin as i64)),
            amax_reduction: o.amax_reduction.or(saved.fp8.map(|c| c.reduction)),
        };
        let given = TrainConfig::resolve(&filled)?;
        if o.cast_policy.is_some() && given.cast_policy() != saved.cast_policy() {
            let (now, was) = (given.cast_policy(), saved.cast_policy());
            let why = match now.name() == was.name() {
                true => " (same name, different entries)",
                false => "",
            };
            bail!(Config,
                "--cast-policy differs from the run being resumed ({} given, the run has {}{why}); a resumed run keeps its recipe",
                now.name(), was.name()
            );
        }
        let opt = |v: Option<f32>| v.map_or("off".to_string(), |x| x.to_string());
        let ckpt = |b: Option<usize>| b.map_or("off".to_string(), |b| format!("budget {b}"));
        let checks = [
            (
                "--preset",
                o.preset.is_some(),
                saved.preset.clone(),
                given.preset.clone(),
            ),
            (
                "--lr",
                o.lr.is_some(),
                saved.lr.to_string(),
                given.lr.to_string(),
            ),
            (
                "--seed",
                o.seed.is_some(),
                saved.seed.to_string(),
                given.seed.to_string(),
            ),
            (
                "--fp32/--bf16/--fp16",
                o.precision.is_some(),
                saved.precision.name().into(),
                given.precision.name().into(),
            ),
            (
                "--batch/--micro-batch/--accum",
                batch_flags > 0,
                format!(
                    "batch {} in micro-batches of {}",
                    saved.batch, saved.micro_batch
                ),
                format!(
                    "batch {} in micro-batches of {}",
                    given.batch, given.micro_batch
                ),
            ),
            (
                "--checkpoint-activations/--ckpt-budget",
                o.checkpoint_activations.is_some() || o.ckpt_budget.is_some(),
                ckpt(saved.ckpt_budget),
                ckpt(given.ckpt_budget),
            ),
            (
                "--recompute",
                o.recompute.is_some(),
                saved.recompute().name().into(),
                given.recompute().name().into(),
            ),
            ("--clip", o.clip.is_some(), opt(saved.clip), opt(given.clip)),
            (
                "--fp8/--amax-history/--fp8-margin/--amax-reduction",
                o.fp8.is_some()
                    || o.amax_history.is_some()
                    || o.fp8_margin.is_some()
                    || o.amax_reduction.is_some(),
                format!("{:?}", saved.fp8),
                format!("{:?}", given.fp8),
            ),
            (
                "--warmup",
                o.warmup.is_some(),
                saved.warmup.to_string(),
                given.warmup.to_string(),
            ),
            (
                "--dropout",
                o.dropout.is_some(),
                saved.model.dropout.to_string(),
                given.model.dropout.to_string(),
            ),
        ];
        for (flag, set, was, now) in checks {
            if set && was != now {
                bail!(Config,
                    "{flag} differs from the run being resumed ({now} given, the run has {was}); a resumed run keeps its recipe (only --steps, --out, --eval-every, --save-every, --device and --data may change)"
                );
            }
        }
        let cfg = TrainConfig {
            data: o
                .data
                .as_ref()
                .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
                .or_else(|| saved.data.clone()),
            steps: o.steps.unwrap_or(saved.steps),
            schedule_steps: saved.schedule_steps,
            device: given.device,
            eval_every: given.eval_every,
            save_every: given.save_every,
            out: given.out,
            ..saved.clone()
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The run's cast policy, `matmuls` at the precision's format when none
    /// was given (float32 runs: `matmuls` at bf16, never applied).
    pub fn cast_policy(&self) -> CastPolicy {
        match &self.cast_policy {
            Some(p) => p.clone(),
            None => {
                let f = self.precision.format().unwrap_or(Format::Bf16);
                CastPolicy::new("matmuls", CastTable::matmuls(f))
            }
        }
    }

    /// Checks every invariant of a run: what the flags gave
    /// ([`resolve`](Self::resolve)) and what a checkpoint's `trainer_state.json`
    /// says (perhaps hand-edited). An error names the flag (or field) and what
    /// is allowed.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if !(0.0..1.0).contains(&c.model.dropout) {
            bail!(
                Config,
                "--dropout must be in [0, 1) (got {})",
                c.model.dropout
            );
        }
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
        if c.steps > MAX_STEPS || c.schedule_steps > MAX_STEPS {
            bail!(
                Config,
                "--steps must be at most {MAX_STEPS} (got {})",
                c.steps.max(c.schedule_steps)
            );
        }
        if c.schedule_steps == 0 {
            bail!(Config, "schedule_steps must be at least 1 (got 0)");
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
        // The micro-batch first: with only --micro-batch given, the batch is
        // derived from it, and the error must name the flag that was given.
        for (flag, v) in [("--micro-batch", c.micro_batch), ("--batch", c.batch)] {
            if v == 0 {
                bail!(Config, "{flag} must be at least 1 (got 0)");
            }
            if v > MAX_BATCH_SEQUENCES {
                bail!(
                    Config,
                    "{flag} must be 1..={MAX_BATCH_SEQUENCES} sequences (got {v})"
                );
            }
        }
        if c.accum == 0 {
            bail!(Config, "--accum must be at least 1 (got 0)");
        }
        if c.micro_batch > c.batch {
            bail!(Config,
                "--micro-batch {} is larger than the batch of {} sequences: use a micro-batch of 1..={}",
                c.micro_batch, c.batch, c.batch
            );
        }
        let k = c.batch.div_ceil(c.micro_batch);
        if c.accum != k {
            bail!(Config,
                "--accum {} does not match a batch of {} in micro-batches of {} (that is {k} micro-batches); give any two of --batch, --micro-batch, --accum",
                c.accum, c.batch, c.micro_batch
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
        if let Some(b) = c.ckpt_budget {
            check_budget(c.model.n_layers, b).map_err(|e| e.context("--ckpt-budget"))?;
        }
        if let Some(clip) = c.clip {
            if !(clip.is_finite() && clip > 0.0) {
                bail!(
                    Config,
                    "--clip must be a positive number, or 0 to turn clipping off (got {clip})"
                );
            }
        }
        if c.warmup >= c.schedule_steps && c.schedule_steps > 1 {
            bail!(
                Config,
                "--warmup {} must be shorter than the run ({} steps)",
                c.warmup,
                c.schedule_steps
            );
        }
        if c.eval_rows == 0 {
            bail!(Config, "eval_rows must be at least 1");
        }
        Ok(())
    }

    /// The learning rate of step `step` (1-based): linear warmup, then a
    /// cosine from `lr` down to `lr · min_lr_frac` at step `schedule_steps`,
    /// held there by any step after it.
    pub fn lr_at(&self, step: usize) -> f32 {
        let lr = self.lr as f64;
        if step <= self.warmup {
            return (lr * step as f64 / self.warmup.max(1) as f64) as f32;
        }
        let span = self.schedule_steps.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        let floor = lr * self.min_lr_frac as f64;
        (floor + (lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())) as f32
    }

    /// The learning rate an optimizer holds after `step` steps of this run:
    /// [`lr`](Self::lr) before the first (what the trainer builds AdamW
    /// with), then the rate of the last step taken, [`lr_at`](Self::lr_at)`(step)`.
    /// A checkpoint's optimizer must hold it
    /// ([`TrainState::check`](crate::train::checkpoint::TrainState::check)).
    pub fn lr_after(&self, step: usize) -> f32 {
        if step == 0 {
            self.lr
        } else {
            self.lr_at(step)
        }
    }

    /// The batch-order stream a run starts with (seeded from
    /// [`seed`](Self::seed)): the trainer draws its batches from it, and a
    /// checkpoint records where it got to.
    pub fn data_order(&self) -> crate::rng::Generator {
        crate::rng::Generator::new(self.seed ^ DATA_KEY)
    }

    /// What backward recomputes: blocks when checkpointing
    /// ([`ckpt_budget`](Self::ckpt_budget)), the attention core when
    /// [`recompute_attention`](Self::recompute_attention).
    pub fn recompute(&self) -> Recompute {
        Recompute::new(self.ckpt_budget.is_some(), self.recompute_attention)
    }

    /// Tokens per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.model.context
    }

    /// The precision and its cast policy, e.g. `bf16 (cast policy torch)`.
    fn cast_label(&self) -> String {
        match &self.cast_policy {
            Some(p) => format!("{} (cast policy {})", self.precision.name(), p.name()),
            None => self.precision.name().to_string(),
        }
    }

    /// The precision, its cast policy and `+ fp8 linears` under fp8 (e.g.
    /// `bf16 (cast policy torch) + fp8 linears`): what the memory plan's
    /// header names.
    pub fn recipe_label(&self) -> String {
        match self.fp8 {
            Some(_) => self.cast_label() + " + fp8 linears",
            None => self.cast_label(),
        }
    }

    /// One line describing the recipe.
    pub fn describe(&self) -> String {
        format!(
            "preset {} ({} params: C={} layers={} heads={} hidden={} context={}), {} steps, lr {:e} (warmup {}, cosine to {:e} at step {}{}), batch {} = {} micro-batch(es) of {}, {}, {}, clip {}",
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
            self.schedule_steps,
            if self.steps > self.schedule_steps {
                ", then held"
            } else {
                ""
            },
            self.batch,
            self.accum,
            self.micro_batch,
            self.cast_label() + &match self.fp8 {
                Some(c) => format!(
                    " + fp8 linears (E4M3/E5M2, delayed scaling: amax history {} {:?}, margin {})",
                    c.history, c.reduction, c.margin
                ),
                None => String::new(),
            },
            match self.ckpt_budget {
                Some(b) => format!("activation checkpointing (budget {b} layers, schedule {:?})", checkpoint_schedule(self.model.n_layers, b).unwrap_or_default()),
                None => "no activation checkpointing".into(),
            } + if self.recompute_attention { ", attention core recomputed" } else { "" },
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
        // Extended past its plan, the schedule holds its last rate.
        let longer = TrainConfig {
            steps: 200,
            ..c.clone()
        };
        assert!((1..=200).all(|s| longer.lr_at(s) == c.lr_at(s.min(100))));
    }

    #[test]
    fn smallest_checkpoint_budgets() {
        assert_eq!(min_ckpt_budget(4), 3);
        assert_eq!(min_ckpt_budget(8), 5);
        assert_eq!(min_ckpt_budget(1), 1);
        assert!(check_budget(4, 5)
            .unwrap_err()
            .to_string()
            .contains("3..=4"));
    }

    /// `--recompute` with and without `--checkpoint-activations`: agreeing
    /// flags combine, contradicting ones are refused naming both, and the
    /// resolved policy is what a resumed run keeps.
    #[test]
    fn recompute_policies_resolve_and_contradictions_name_the_flags() {
        let with = |r: Option<&str>, ck: Option<bool>, budget: Option<usize>| {
            TrainConfig::resolve(&TrainOptions {
                preset: Some("tiny".into()),
                recompute: r.map(|r| r.parse().unwrap()),
                checkpoint_activations: ck,
                ckpt_budget: budget,
                ..Default::default()
            })
        };
        let policy = |r, ck| with(r, ck, None).unwrap().recompute();
        assert_eq!(policy(None, None), Recompute::Blocks, "the default");
        assert_eq!(policy(None, Some(false)), Recompute::None);
        for p in Recompute::ALL {
            assert_eq!(policy(Some(p.name()), None), p);
            assert_eq!(policy(Some(p.name()), Some(p.blocks())), p);
            let e = with(Some(p.name()), Some(!p.blocks()), None)
                .unwrap_err()
                .to_string();
            let flag = match p.blocks() {
                true => "--no-checkpoint-activations contradicts --recompute",
                false => "--checkpoint-activations contradicts --recompute",
            };
            assert!(
                e.contains(flag) && e.contains(&format!("--recompute {}", p.name())),
                "{e}"
            );
        }
        let both = with(Some("both"), None, Some(4)).unwrap();
        assert_eq!(
            (both.ckpt_budget, both.recompute_attention),
            (Some(4), true)
        );
        assert!(both.describe().contains("attention core recomputed"));
        let e = with(Some("attention"), None, Some(3))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--ckpt-budget") && e.contains("--recompute attention"),
            "{e}"
        );
        let e = "sometimes"
            .parse::<Recompute>()
            .unwrap_err()
            .context("--recompute");
        assert!(
            e.to_string()
                .starts_with("--recompute: unknown recompute policy \"sometimes\""),
            "{e}"
        );
        // The plan of each policy: attention recomputation only matters with dropout.
        let drop = |r: &str| {
            TrainConfig::resolve(&TrainOptions {
                preset: Some("tiny".into()),
                recompute: Some(r.parse().unwrap()),
                dropout: Some(0.1),
                ..Default::default()
            })
            .unwrap()
            .memory_plan()
            .unwrap()
        };
        assert!(drop("attention").activations < drop("none").activations);
        assert!(drop("both").activations < drop("blocks").activations);
        assert_eq!(
            policy(Some("attention"), None),
            Recompute::Attention,
            "and without dropout it is still the policy asked for"
        );

        // Resuming keeps the policy; a different one is refused by name.
        let saved = with(Some("both"), None, None).unwrap();
        let resumed = TrainConfig::resume(&saved, &TrainOptions::default()).unwrap();
        assert_eq!(resumed.recompute(), Recompute::Both);
        let again = TrainOptions {
            recompute: Some(Recompute::Both),
            ..Default::default()
        };
        assert_eq!(
            TrainConfig::resume(&saved, &again).unwrap().recompute(),
            Recompute::Both
        );
        for other in ["none", "attention", "blocks"] {
            let e = TrainConfig::resume(
                &saved,
                &TrainOptions {
                    recompute: Some(other.parse().unwrap()),
                    ..Default::default()
                },
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("--recompute differs") && e.contains("the run has both"),
                "{other}: {e}"
            );
        }
        // A checkpoint written before the field: off.
        let mut json = serde_json::to_value(with(None, None, None).unwrap()).unwrap();
        assert!(
            json.get("recompute_attention").is_none(),
            "not written when off"
        );
        json.as_object_mut().unwrap().remove("recompute_attention");
        let old: TrainConfig = serde_json::from_value(json).unwrap();
        assert_eq!(old.recompute(), Recompute::Blocks);
    }

    /// `--cast-policy`: the built-ins at the precision's format, a JSON
    /// file, clear errors naming the flag; a resume keeps the policy and
    /// refuses another by name; a checkpoint without the field is `matmuls`.
    #[test]
    fn cast_policy_flag_resume_and_old_checkpoints() {
        use crate::precision::{OpClass, Rule};
        let with = |p: Option<&str>, precision: Option<Precision>| {
            TrainConfig::resolve(&TrainOptions {
                preset: Some("tiny".into()),
                precision,
                cast_policy: p.map(String::from),
                ..Default::default()
            })
        };
        let plain = with(None, None).unwrap();
        assert_eq!(plain.cast_policy, None);
        assert_eq!(
            with(Some("matmuls"), None).unwrap(),
            plain,
            "matmuls is the default"
        );
        let torch = with(Some("torch"), Some(Precision::Fp16)).unwrap();
        let t = torch.cast_policy().table();
        assert_eq!(
            (torch.cast_policy().name(), t.rule(OpClass::Matmul)),
            ("torch", Rule::Round(Format::Fp16))
        );
        assert!(torch.describe().contains("cast policy torch"));
        let e = with(Some("pure"), Some(Precision::Fp32))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--cast-policy pure needs a 16-bit precision"),
            "{e}"
        );
        let e = with(Some("sometimes"), None).unwrap_err().to_string();
        assert!(
            e.starts_with("--cast-policy: unknown policy \"sometimes\""),
            "{e}"
        );

        // a file: named by its stem unless it names itself
        let dir = std::env::temp_dir().join(format!("tinyllm-cast-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p.to_str().unwrap().to_string()
        };
        let mine = file(
            "mine.json",
            r#"{"ops": {"matmul": "bf16", "rms_norm": "bf16"}}"#,
        );
        let cfg = with(Some(&mine), None).unwrap();
        assert_eq!(cfg.cast_policy().name(), "mine");
        assert_eq!(
            cfg.cast_policy().table().rule(OpClass::RmsNorm),
            Rule::Round(Format::Bf16)
        );
        for (name, text, says) in [
            (
                "op.json",
                r#"{"ops": {"layer_norm": "bf16"}}"#,
                "unknown op \"layer_norm\"",
            ),
            (
                "fmt.json",
                r#"{"ops": {"softmax": "fp12"}}"#,
                "unknown format \"fp12\"",
            ),
            ("bad.json", r#"{"ops": "#, "malformed JSON"),
        ] {
            let f = file(name, text);
            let e = with(Some(&f), None).unwrap_err().to_string();
            assert!(
                e.starts_with("--cast-policy ") && e.contains(says),
                "{name}: {e}"
            );
        }
        let missing = dir.join("gone.json");
        let e = with(Some(missing.to_str().unwrap()), None)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--cast-policy: cannot read"), "{e}");

        // resume: kept when not given, the same accepted, another refused by name
        let saved = with(Some("pure"), None).unwrap();
        let resumed = TrainConfig::resume(&saved, &TrainOptions::default()).unwrap();
        assert_eq!(resumed.cast_policy, saved.cast_policy);
        let again = TrainOptions {
            cast_policy: Some("pure".into()),
            ..Default::default()
        };
        assert_eq!(
            TrainConfig::resume(&saved, &again).unwrap().cast_policy,
            saved.cast_policy
        );
        for other in ["matmuls", "torch", mine.as_str()] {
            let o = TrainOptions {
                cast_policy: Some(other.into()),
                ..Default::default()
            };
            let e = TrainConfig::resume(&saved, &o).unwrap_err().to_string();
            assert!(
                e.contains("--cast-policy differs") && e.contains("the run has pure"),
                "{other}: {e}"
            );
        }
        let o = TrainOptions {
            cast_policy: Some("torch".into()),
            ..Default::default()
        };
        let e = TrainConfig::resume(&plain, &o).unwrap_err().to_string();
        assert!(e.contains("(torch given, the run has matmuls)"), "{e}");

        // the checkpoint's JSON: written when set and read back; absent in
        // older checkpoints (and in default runs'), which load as matmuls
        let json = serde_json::to_value(&saved).unwrap();
        assert_eq!(json["cast_policy"]["name"], "pure");
        let back: TrainConfig = serde_json::from_value(json).unwrap();
        assert_eq!(back, saved);
        let json = serde_json::to_value(&plain).unwrap();
        assert!(json.get("cast_policy").is_none(), "not written for matmuls");
        let old: TrainConfig = serde_json::from_value(json).unwrap();
        assert_eq!(old.cast_policy().name(), "matmuls");
        assert_eq!(old.cast_policy().table(), CastTable::matmuls(Format::Bf16));
        std::fs::remove_dir_all(&dir).ok();
    }
}
