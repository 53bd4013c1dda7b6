//! `tinyllm`: train, compare, evaluate and sample small Llamas. A thin shell:
//! parse the flags, hand them to `tinyllm::train`, print what comes back.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use tinyllm::train::checkpoint::{self, Verified};
use tinyllm::train::config::{DeviceChoice, TrainConfig, TrainOptions};
use tinyllm::train::data::Corpus;
use tinyllm::train::trainer::{eval_text, sample_text, select_device};
use tinyllm::train::{compare, Progress};

#[derive(Parser)]
#[command(
    name = "tinyllm",
    version,
    about = "Train small Llama-style language models with mixed precision"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a model (defaults: the `small` preset on the embedded corpus, bf16,
    /// micro-batches with accumulation, activation checkpointing).
    Train(TrainArgs),
    /// MS-L11: float32 full batch vs bf16 + micro-batches + accumulation + checkpointing.
    Compare(CompareArgs),
    /// Mean cross-entropy of a checkpoint on a text.
    Eval(EvalArgs),
    /// Sample text from a checkpoint.
    Generate(GenerateArgs),
    /// GPU kernel throughput on this machine's adapter (matmul, fused finite
    /// check + unscale, fused AdamW) against the device's own baselines.
    Bench(BenchArgs),
}

#[derive(Args)]
struct BenchArgs {
    /// Large shapes too (1024³, the capstone's full-batch products).
    #[arg(long)]
    full: bool,
    /// Skip the float32 matmuls (slow where the device's fma must be emulated).
    #[arg(long)]
    no_f32: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Clone, Default)]
struct RunFlags {
    /// Model and recipe: capstone, small or tiny.
    #[arg(long)]
    preset: Option<String>,
    /// A UTF-8 text file to train on (default: the embedded corpus).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    steps: Option<usize>,
    /// Peak learning rate (AdamW; linear warmup, cosine decay to a tenth).
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f32>,
    #[arg(long, value_parser = count_u64, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// auto (GPU if an adapter exists), cpu or gpu.
    #[arg(long)]
    device: Option<String>,
    /// Sequences per optimizer step.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    batch: Option<usize>,
    /// Sequences per micro-batch (gradients accumulate over the batch).
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    micro_batch: Option<usize>,
    /// Micro-batches per step.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    accum: Option<usize>,
    /// Memory budget of activation checkpointing, in layers.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    ckpt_budget: Option<usize>,
    /// Gradient-norm clip (0 = off; default 1).
    #[arg(long, allow_negative_numbers = true)]
    clip: Option<f32>,
    /// Validate every N steps (0 = only at the end).
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    eval_every: Option<usize>,
    /// Warmup steps.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    warmup: Option<usize>,
    /// Dropout probability.
    #[arg(long, allow_negative_numbers = true)]
    dropout: Option<f32>,
    /// Output directory.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Plain log lines even on a terminal.
    #[arg(long)]
    plain: bool,
    /// Time every backend primitive during the training steps and print the
    /// table at the end (wall clock; on the GPU only the host's recording time).
    #[arg(long)]
    profile: bool,
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    run: RunFlags,
    /// Float32 throughout.
    #[arg(long, group = "prec")]
    fp32: bool,
    /// bf16 matmuls over float32 masters (the default).
    #[arg(long, group = "prec")]
    bf16: bool,
    /// fp16 matmuls with dynamic loss scaling.
    #[arg(long, group = "prec")]
    fp16: bool,
    /// Precision by name: fp32, bf16 or fp16.
    #[arg(long, group = "prec")]
    precision: Option<String>,
    /// Recompute activations during backward (the default).
    #[arg(long)]
    checkpoint_activations: bool,
    /// Keep every activation instead.
    #[arg(long, conflicts_with = "checkpoint_activations")]
    no_checkpoint_activations: bool,
    /// Write a checkpoint every N steps (0 = only at the end).
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    save_every: Option<usize>,
    /// Continue the run saved in DIR (its checkpoint/ subdirectory or DIR itself).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Bytes of text to sample at the end.
    #[arg(long, default_value_t = 160, value_parser = count, allow_negative_numbers = true)]
    sample_len: usize,
}

#[derive(Args)]
struct CompareArgs {
    #[command(flatten)]
    run: RunFlags,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct EvalArgs {
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to evaluate on (default: the embedded corpus).
    #[arg(long)]
    data: Option<PathBuf>,
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
struct GenerateArgs {
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long, default_value = "")]
    prompt: String,
    /// Bytes to generate.
    #[arg(long, default_value_t = 300, value_parser = count, allow_negative_numbers = true)]
    len: usize,
    /// Softmax temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the k most likely bytes (0 = all).
    #[arg(long, default_value_t = 40, value_parser = count, allow_negative_numbers = true)]
    top_k: usize,
    #[arg(long, default_value_t = 0, value_parser = count_u64, allow_negative_numbers = true)]
    seed: u64,
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// A whole number flag: a clear message instead of Rust's parse error.
fn count(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .map_err(|_| format!("{s:?} is not a whole number: expected 0, 1, 2, …"))
}

fn count_u64(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<u64>()
        .map_err(|_| format!("{s:?} is not a whole number: expected 0, 1, 2, …"))
}

/// The most bytes `generate --len` / `train --sample-len` produce.
const MAX_SAMPLE: usize = 1_000_000;

fn check_sample_len(flag: &str, n: usize) -> tinyllm::Result<()> {
    if n > MAX_SAMPLE {
        return Err(tinyllm::Error::config(format!(
            "{flag} must be 0..={MAX_SAMPLE} bytes (got {n})"
        )));
    }
    Ok(())
}

impl RunFlags {
    fn options(&self) -> TrainOptions {
        TrainOptions {
            preset: self.preset.clone(),
            data: self.data.clone(),
            steps: self.steps,
            lr: self.lr,
            seed: self.seed,
            device: self.device.clone(),
            batch: self.batch,
            micro_batch: self.micro_batch,
            accum: self.accum,
            ckpt_budget: self.ckpt_budget,
            clip: self.clip,
            eval_every: self.eval_every,
            warmup: self.warmup,
            dropout: self.dropout,
            out: self.out.clone(),
            ..TrainOptions::default()
        }
    }
    fn progress(&self) -> Progress {
        if self.plain {
            Progress::Lines
        } else {
            Progress::Auto
        }
    }
}

fn train_options(a: &TrainArgs) -> TrainOptions {
    let precision = if a.fp32 {
        Some("fp32".to_string())
    } else if a.fp16 {
        Some("fp16".to_string())
    } else if a.bf16 {
        Some("bf16".to_string())
    } else {
        a.precision.clone()
    };
    TrainOptions {
        precision,
        checkpoint_activations: if a.no_checkpoint_activations {
            Some(false)
        } else if a.checkpoint_activations {
            Some(true)
        } else {
            None
        },
        save_every: a.save_every,
        ..a.run.options()
    }
}

/// For `--resume`: the saved run's config, with the flags a continuation may
/// change (steps, output, evaluation and save cadence, device) applied; any
/// other flag that differs from the saved run is an error.
fn resume_config(a: &TrainArgs, dir: &std::path::Path) -> tinyllm::Result<TrainConfig> {
    let saved = Verified::open(dir)?.train_state()?.config;
    let o = train_options(a);
    let given = TrainConfig::resolve(&TrainOptions {
        preset: o.preset.clone().or(Some(saved.preset.clone())),
        ..o.clone()
    })?;
    let mut cfg = saved.clone();
    let checks: [(&str, bool, bool); 9] = [
        ("--preset", o.preset.is_some(), given.preset != saved.preset),
        ("--data", o.data.is_some(), given.data != saved.data),
        ("--lr", o.lr.is_some(), given.lr != saved.lr),
        ("--seed", o.seed.is_some(), given.seed != saved.seed),
        (
            "--fp32/--bf16/--fp16",
            o.precision.is_some(),
            given.precision != saved.precision,
        ),
        (
            "--batch/--micro-batch/--accum",
            o.batch.is_some() || o.micro_batch.is_some() || o.accum.is_some(),
            (given.batch, given.micro_batch) != (saved.batch, saved.micro_batch),
        ),
        (
            "--checkpoint-activations/--ckpt-budget",
            o.checkpoint_activations.is_some() || o.ckpt_budget.is_some(),
            given.ckpt_budget != saved.ckpt_budget,
        ),
        ("--clip", o.clip.is_some(), given.clip != saved.clip),
        (
            "--warmup/--dropout",
            o.warmup.is_some() || o.dropout.is_some(),
            (given.warmup, given.model.dropout) != (saved.warmup, saved.model.dropout),
        ),
    ];
    for (flag, set, differs) in checks {
        if set && differs {
            return Err(tinyllm::Error::config(format!(
                "{flag} differs from the run being resumed ({}); a resumed run keeps its recipe (only --steps, --out, --eval-every, --save-every and --device may change)",
                dir.display()
            )));
        }
    }
    if let Some(s) = o.steps {
        cfg.steps = s;
    }
    if let Some(e) = o.eval_every {
        cfg.eval_every = e;
    }
    if let Some(s) = o.save_every {
        cfg.save_every = s;
    }
    if let Some(d) = &o.device {
        cfg.device = d
            .parse::<DeviceChoice>()
            .map_err(|e| e.context("--device"))?;
    }
    cfg.out = o.out.clone().unwrap_or_else(|| {
        let d = checkpoint::resolve_dir(dir);
        d.parent().map(|p| p.to_path_buf()).unwrap_or(d)
    });
    Ok(cfg)
}

fn cmd_train(a: TrainArgs) -> tinyllm::Result<()> {
    check_sample_len("--sample-len", a.sample_len)?;
    let cfg = match &a.resume {
        Some(dir) => resume_config(&a, dir).map_err(|e| e.context("--resume"))?,
        None => TrainConfig::resolve(&train_options(&a))?,
    };
    if a.run.profile {
        tinyllm::profile::start();
    }
    let summary = tinyllm::train::run(cfg.clone(), a.resume.as_deref(), a.run.progress())?;
    if let Some(p) = tinyllm::profile::take() {
        println!(
            "\nprofile of {} training steps ({} device):\n{p}",
            summary.history.len(),
            summary.device
        );
    }
    let model = checkpoint::load_model(&summary.checkpoint, summary.device)?;
    let last = summary.history.last();
    println!();
    println!(
        "done: {} steps in {:.0} s — final train loss {:.4} (mean of the last steps), validation loss {}",
        cfg.steps,
        summary.seconds,
        summary.final_loss,
        summary.final_val_loss.map(|v| format!("{v:.4}")).unwrap_or("-".into())
    );
    if let Some(first) = summary.history.first() {
        println!(
            "loss went from {:.4} at step {} to {:.4} at step {}",
            first.loss,
            first.step,
            last.unwrap().loss,
            last.unwrap().step
        );
    }
    println!("sample (temperature 0.8, top-k 40):");
    println!("----");
    println!(
        "{}",
        sample_text(&model, "The ", a.sample_len, 0.8, 40, cfg.seed)?
    );
    println!("----");
    println!("files:");
    println!(
        "  metrics     {}",
        summary.out.join("metrics.jsonl").display()
    );
    println!("  loss plot   {}", summary.out.join("loss.svg").display());
    println!("  checkpoint  {}/ (model.safetensors, config.json, optimizer.safetensors, trainer_state.json, manifest.json)", summary.checkpoint.display());
    println!(
        "continue with: tinyllm train --resume {} --steps {}",
        summary.out.display(),
        cfg.steps * 2
    );
    Ok(())
}

fn cmd_compare(a: CompareArgs) -> tinyllm::Result<()> {
    let progress = if a.json {
        Progress::Quiet
    } else {
        a.run.progress()
    };
    let c = compare::compare(&a.run.options(), progress)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string(&c).map_err(|e| tinyllm::Error::config(e.to_string()))?
        );
    } else {
        println!("{}", c.table());
    }
    Ok(())
}

fn device_of(s: &str) -> tinyllm::Result<tinyllm::Device> {
    let (d, note) = select_device(
        s.parse::<DeviceChoice>()
            .map_err(|e| e.context("--device"))?,
    )?;
    if let Some(n) = note {
        eprintln!("{n}");
    }
    Ok(d)
}

fn cmd_eval(a: EvalArgs) -> tinyllm::Result<()> {
    let device = device_of(&a.device)?;
    let model =
        checkpoint::load_model(&a.checkpoint, device).map_err(|e| e.context("--checkpoint"))?;
    let corpus = Corpus::load(a.data.as_ref())?;
    let (loss, tokens) = eval_text(&model, &corpus, tinyllm::precision::Precision::Fp32)?;
    println!(
        "{}: mean cross-entropy {loss:.4} nats/byte ({:.3} bits/byte) over {tokens} tokens of {}",
        checkpoint::resolve_dir(&a.checkpoint).display(),
        loss / std::f32::consts::LN_2,
        corpus.name
    );
    Ok(())
}

fn cmd_generate(a: GenerateArgs) -> tinyllm::Result<()> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        return Err(tinyllm::Error::config(format!(
            "--temperature must be 0 (greedy) or positive, got {}",
            a.temperature
        )));
    }
    check_sample_len("--len", a.len)?;
    let device = device_of(&a.device)?;
    let model =
        checkpoint::load_model(&a.checkpoint, device).map_err(|e| e.context("--checkpoint"))?;
    println!(
        "{}",
        sample_text(&model, &a.prompt, a.len, a.temperature, a.top_k, a.seed)?
    );
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> tinyllm::Result<()> {
    let defaults = tinyllm::bench::BenchOptions::default();
    let opts = tinyllm::bench::BenchOptions {
        full: a.full || defaults.full,
        f32_matmul: !a.no_f32,
        ..defaults
    };
    let report = tinyllm::bench::run_gpu(&opts).map_err(|e| e.context("bench"))?;
    if a.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tinyllm::memory::keep_freed_host_memory();
    // TINYLLM_THREADS=n caps the CPU's threads for large products and AdamW
    // updates (results never depend on it).
    if let Ok(t) = std::env::var("TINYLLM_THREADS") {
        match t.trim().parse::<usize>() {
            Ok(n) if n >= 1 => tinyllm::set_cpu_threads(Some(n)),
            _ => {
                eprintln!("error: TINYLLM_THREADS must be a whole number ≥ 1 (got {t:?})");
                return ExitCode::FAILURE;
            }
        }
    }
    let res = match cli.cmd {
        Cmd::Train(a) => cmd_train(a),
        Cmd::Compare(a) => cmd_compare(a),
        Cmd::Eval(a) => cmd_eval(a),
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::Bench(a) => cmd_bench(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
