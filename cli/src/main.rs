//! `tinyllm`: train, compare, evaluate and sample small Llamas, and hand a
//! run to PyTorch and back (`export`, `import`). A thin shell:
//! parse the flags, hand them to `tinyllm::train`, print what comes back.
//!
//! Output never panics: a closed stdout or stderr (`tinyllm train | head`)
//! drops the output and the work goes on (a run still saves its checkpoint);
//! `generate` stops early when its reader goes away.

mod device_check;

use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tinyllm::crosscheck::lockstep::Replay;
use tinyllm::precision::Precision;
use tinyllm::train::checkpoint::{self, Verified};
use tinyllm::train::config::{DeviceChoice, TrainConfig, TrainOptions};
use tinyllm::train::data::{ByteTokenizer, Corpus};
use tinyllm::train::infer::{eval_text, generate_with, sample_text, Utf8Stream};
use tinyllm::train::outdir::DirLock;
use tinyllm::train::trainer::{select_device, shell_quote};
use tinyllm::train::{budget, compare, interrupt, Progress, RunSummary, Start, StepCheck};
use tinyllm::Generator;

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
    /// Mixed precision against float32: bf16 + micro-batches + accumulation + checkpointing vs a float32 full batch, both evaluated on held-out text.
    Compare(CompareArgs),
    /// Mean cross-entropy of a checkpoint on a text.
    Eval(EvalArgs),
    /// Sample text from a checkpoint.
    Generate(GenerateArgs),
    /// Write a run's full training state (weights, AdamW moments, schedule,
    /// loss scaler, the next batches) as one safetensors file that PyTorch
    /// continues from (scripts/continue_in_pytorch.py); or, with --check, check one.
    Export(ExportArgs),
    /// Turn a continuation file (the one scripts/continue_in_pytorch.py writes
    /// after its steps) back into a tinyllm run that `train --resume` continues.
    Import(ImportArgs),
    /// GPU kernel throughput on this machine's adapter (matmul, fused finite
    /// check + unscale, fused AdamW) against the device's own baselines.
    Bench(BenchArgs),
    /// Is this GPU bit-exact with the CPU reference? A device probe, every
    /// primitive on both devices, and training in lockstep. Exit status 0:
    /// bit-identical; 1: something differs (the report says what); 2: an error.
    Crosscheck(CrosscheckArgs),
    /// Everything to ask a new GPU, in one JSON report: the cross-check on
    /// every backend the machine offers, the kernel benchmarks, and a few
    /// steps of the capstone recipe with --profile on the GPU and the CPU.
    DeviceCheck(DeviceCheckArgs),
}

#[derive(Args)]
struct DeviceCheckArgs {
    /// A new directory for report.json and the two profiled runs.
    #[arg(long, default_value = "runs/device-check")]
    out: PathBuf,
    /// The profiled runs' model: capstone, small or tiny.
    #[arg(long, default_value = "capstone")]
    preset: String,
    /// Optimizer steps of each profiled run (the first is left out of the
    /// profile, as always) and of the cross-check's lockstep per precision.
    #[arg(long, default_value_t = 3, value_parser = count, allow_negative_numbers = true)]
    steps: usize,
    /// Comma-separated backends to cross-check (default: vulkan,metal,dx12,gl;
    /// one the machine lacks is recorded as such).
    #[arg(long)]
    backends: Option<String>,
    /// Seconds each part may take before it is stopped and recorded as
    /// timed out.
    #[arg(long, default_value_t = 300)]
    part_seconds: u64,
}

#[derive(Args)]
struct CrosscheckArgs {
    /// The lockstep's model and recipe: tiny, small or capstone.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Optimizer steps of the lockstep, per precision (at least 1).
    #[arg(long, default_value_t = 5, value_parser = count, allow_negative_numbers = true)]
    steps: usize,
    /// One precision recipe (fp32, bf16 or fp16) instead of all three.
    #[arg(long)]
    precision: Option<String>,
    /// Leave out the primitive sweep (probe and lockstep only).
    #[arg(long)]
    skip_sweep: bool,
    /// The GPU backend to check: vulkan, gl, metal or dx12 (default: the
    /// first that has an adapter; one device may be reachable through two).
    #[arg(long)]
    backend: Option<String>,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
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
    /// Seed of the initial weights, the data order and dropout (default 1337).
    #[arg(long, value_parser = count_u64, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// auto (GPU if an adapter exists), cpu, gpu or spec (the executable
    /// spec: slow, for checking).
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
    /// What backward recomputes instead of keeping: none, attention (each
    /// attention's scores, softmax, dropout and probabilities·V, from the
    /// kept q, k, v), blocks (activation checkpointing at --ckpt-budget; the
    /// default) or both. Every policy gives the same bits.
    #[arg(long, value_name = "POLICY")]
    recompute: Option<String>,
    /// The format each op class stores its output in under autocast:
    /// matmuls (the default: matmuls in the 16-bit format, the rest
    /// float32), torch (torch.autocast's: softmax, norms and the loss
    /// float32, elementwise ops following their inputs), pure (everything
    /// 16-bit), or a JSON file {"name": …, "ops": {"matmul": "bf16", …}}
    /// (ops matmul, attention_scores, attention_probs, softmax, rms_norm,
    /// swiglu, rope, residual_add, cross_entropy, embedding; formats f32,
    /// bf16, fp16, follow; an op left out is f32). compare applies it to the
    /// mixed side.
    #[arg(long, value_name = "NAME|FILE.json")]
    cast_policy: Option<String>,
    /// The Linear layers' products in fp8 with per-tensor delayed scaling
    /// (E4M3 weights and activations, E5M2 gradients, f32 accumulation;
    /// the rest under bf16 autocast). Not with --fp16 or --fp32. compare
    /// applies it to the mixed side.
    #[arg(long)]
    fp8: bool,
    /// With --fp8: amaxes each scale is fitted to (default 16).
    #[arg(long, value_name = "N", value_parser = count, allow_negative_numbers = true)]
    amax_history: Option<usize>,
    /// With --fp8: powers of two of headroom below the format's maximum
    /// (default 0).
    #[arg(long, value_name = "M", allow_negative_numbers = true)]
    fp8_margin: Option<i64>,
    /// With --fp8: how the history is reduced, max (default) or most_recent.
    #[arg(long, value_name = "max|most_recent")]
    amax_reduction: Option<String>,
    /// Gradient-norm clip (0 = off; default 1).
    #[arg(long, allow_negative_numbers = true)]
    clip: Option<f32>,
    /// Validate every N steps (0 = only at the end).
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    eval_every: Option<usize>,
    /// Write a checkpoint every N steps (0 = only at the end).
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    save_every: Option<usize>,
    /// Warmup steps.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    warmup: Option<usize>,
    /// Dropout probability.
    #[arg(long, allow_negative_numbers = true)]
    dropout: Option<f32>,
    /// Output directory.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Choose --micro-batch, --recompute and --ckpt-budget so that the
    /// planned peak fits SIZE (e.g. 2GiB, 512MiB), recomputing the least;
    /// prints the choice and why, or refuses naming the smallest budget
    /// that fits. A flag given beside it fixes its part of the choice. The
    /// batch stays. compare plans the mixed side (the float32 side takes the
    /// whole batch as always).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    memory_budget: Option<String>,
    /// Plain log lines even on a terminal.
    #[arg(long)]
    plain: bool,
    /// Time every backend primitive during the training steps and print the
    /// table at the end (wall clock; on the GPU only the host's recording
    /// time). The first step is left out when more follow: a warm-up.
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
    /// Recompute activations during backward (the default): --recompute
    /// blocks (with --recompute, it must agree: blocks or both).
    #[arg(long)]
    checkpoint_activations: bool,
    /// Keep every activation instead: --recompute none (with --recompute, it
    /// must agree: none or attention).
    #[arg(long, conflicts_with = "checkpoint_activations")]
    no_checkpoint_activations: bool,
    /// Continue the run saved in DIR (its checkpoint/ subdirectory or DIR
    /// itself) to --steps. Up to the run's planned total it is bit-identical
    /// to an uninterrupted run; past it, the schedule's final learning rate is
    /// held (the cosine schedule is not re-stretched).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Replace the run --out holds (its checkpoints, metrics and plot; nothing
    /// else is deleted) instead of refusing to start.
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Bytes of text to sample at the end.
    #[arg(long, default_value_t = 160, value_parser = count, allow_negative_numbers = true)]
    sample_len: usize,
    /// Replay every K-th step on the CPU reference from the same state (with
    /// --device gpu) and stop at the first divergence with a trace report,
    /// keeping the state before that step in OUT/crosscheck-step-N/.
    #[arg(long, value_name = "K", value_parser = count, allow_negative_numbers = true)]
    crosscheck_every: Option<usize>,
    /// The device's fp32 peak in GFLOP/s for the profile's roofline floor
    /// (overrides the table of known laptop GPUs). Implies --profile.
    #[arg(long, value_name = "GFLOPS", value_parser = positive_finite, allow_negative_numbers = true)]
    peak_gflops: Option<f64>,
    /// The device's memory bandwidth in GB/s for the profile's roofline floor
    /// (overrides the table of known laptop GPUs). Implies --profile.
    #[arg(long, value_name = "GB_PER_S", value_parser = positive_finite, allow_negative_numbers = true)]
    bandwidth: Option<f64>,
}

#[derive(Args)]
struct CompareArgs {
    #[command(flatten)]
    run: RunFlags,
    /// Replace the runs --out holds from an earlier comparison.
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Keep a side that has finished in --out and continue one that was
    /// interrupted (give the same flags as the first time).
    #[arg(long)]
    resume: bool,
    /// Train only this side now (fp32 or mixed); the comparison is printed
    /// once both have finished in --out.
    #[arg(long, value_name = "SIDE", value_parser = ["both", "fp32", "mixed"], default_value = "both")]
    side: String,
    /// Print the result as one JSON object on stdout (progress stays on
    /// stderr).
    #[arg(long)]
    json: bool,
    /// Compare sides whose builds differ in numerics (by default refused:
    /// their losses would not be one experiment).
    #[arg(long)]
    allow_mixed_builds: bool,
}

#[derive(Args)]
struct EvalArgs {
    /// A run directory or its checkpoint/ subdirectory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// A UTF-8 text file to evaluate, every window of it. The text the
    /// checkpoint was trained on (the same by SHA-256, wherever it is now)
    /// gives its held-out windows instead, as without --data: the windows
    /// the run's validation loss saw.
    #[arg(long)]
    data: Option<PathBuf>,
    /// cpu, gpu or auto (GPU if an adapter exists).
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
struct ExportArgs {
    /// A run directory or its checkpoint/ subdirectory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The file to write (docs/continue-in-pytorch.md describes it).
    #[arg(long, required_unless_present = "check")]
    out: Option<PathBuf>,
    /// How many of the run's next batches to include (each a whole step's).
    #[arg(long, default_value_t = 1)]
    batches: usize,
    /// The text the run was trained on, if it has moved (default: the path
    /// the run recorded, or the embedded corpus); checked by its SHA-256.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Check this continuation file (its version, every moment and shape)
    /// against the run instead of writing one.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["out", "data"])]
    check: Option<PathBuf>,
}

#[derive(Args)]
struct ImportArgs {
    /// The continuation file (e.g. OUT/continuation.safetensors of the script).
    #[arg(long)]
    continuation: PathBuf,
    /// The run it continues (its directory or checkpoint/): its config, text
    /// and identity.
    #[arg(long)]
    checkpoint: PathBuf,
    /// A new directory for the run.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct GenerateArgs {
    /// A run directory or its checkpoint/ subdirectory.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text the sample continues (bytes; empty starts from nothing).
    #[arg(long, default_value = "")]
    prompt: String,
    /// Bytes to generate.
    #[arg(long, default_value_t = 300, value_parser = count, allow_negative_numbers = true)]
    len: usize,
    /// Softmax temperature (0 = greedy, never repeating a run of 8 bytes already in the context).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the k most likely bytes (0 = all).
    #[arg(long, default_value_t = 40, value_parser = count, allow_negative_numbers = true)]
    top_k: usize,
    /// Seed of the sampler (the same seed draws the same text).
    #[arg(long, default_value_t = 0, value_parser = count_u64, allow_negative_numbers = true)]
    seed: u64,
    /// cpu, gpu or auto (GPU if an adapter exists).
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// A whole number flag: a clear message instead of Rust's parse error.
fn count(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .map_err(|_| format!("{s:?} is not a whole number: expected 0, 1, 2, …"))
}

/// A rate: a positive, finite number.
fn positive_finite(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a positive, finite number")),
    }
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

/// A flag's string parsed into its type, the error naming the flag.
fn parse_flag<T: std::str::FromStr<Err = tinyllm::Error>>(
    flag: &str,
    v: Option<&str>,
) -> tinyllm::Result<Option<T>> {
    v.map(|s| s.parse::<T>().map_err(|e| e.context(flag)))
        .transpose()
}

impl RunFlags {
    fn options(&self) -> tinyllm::Result<TrainOptions> {
        Ok(TrainOptions {
            preset: self.preset.clone(),
            data: self.data.clone(),
            steps: self.steps,
            lr: self.lr,
            seed: self.seed,
            device: parse_flag("--device", self.device.as_deref())?,
            batch: self.batch,
            micro_batch: self.micro_batch,
            accum: self.accum,
            ckpt_budget: self.ckpt_budget,
            recompute: parse_flag("--recompute", self.recompute.as_deref())?,
            cast_policy: self.cast_policy.clone(),
            fp8: self.fp8.then_some(true),
            amax_history: self.amax_history,
            fp8_margin: self.fp8_margin,
            amax_reduction: parse_flag("--amax-reduction", self.amax_reduction.as_deref())?,
            clip: self.clip,
            eval_every: self.eval_every,
            save_every: self.save_every,
            warmup: self.warmup,
            dropout: self.dropout,
            out: self.out.clone(),
            ..TrainOptions::default()
        })
    }
    fn progress(&self) -> Progress {
        if self.plain {
            Progress::Lines
        } else {
            Progress::Auto
        }
    }
}

fn train_options(a: &TrainArgs) -> tinyllm::Result<TrainOptions> {
    let precision = if a.fp32 {
        Some(Precision::Fp32)
    } else if a.fp16 {
        Some(Precision::Fp16)
    } else if a.bf16 {
        Some(Precision::Bf16)
    } else {
        parse_flag("--precision", a.precision.as_deref())?
    };
    Ok(TrainOptions {
        precision,
        checkpoint_activations: if a.no_checkpoint_activations {
            Some(false)
        } else if a.checkpoint_activations {
            Some(true)
        } else {
            None
        },
        ..a.run.options()?
    })
}

/// For `--resume`: the saved run's config with the flags a continuation may
/// change (see [`TrainConfig::resume`]); `--out` defaults to the run's directory.
/// A run's output directory is locked (when it exists) before its checkpoint
/// is read, so a second process hears that it is in use, not some symptom of
/// the first one's half-finished work.
fn resume_config(a: &TrainArgs, dir: &Path) -> tinyllm::Result<(TrainConfig, Option<DirLock>)> {
    let o = train_options(a)?;
    let resolved = checkpoint::resolve_dir(dir);
    if resolved.join(checkpoint::CONFIG_FILE).exists()
        && !resolved.join(checkpoint::STATE_FILE).exists()
    {
        // A model folder, not a run's checkpoint: said before a lock file is
        // made beside it.
        Verified::open(dir)?.train_state()?;
    }
    // `--resume checkpoint` from inside the run: its parent is `.`.
    let run_dir = match resolved.parent() {
        Some(p) if p.as_os_str().is_empty() => PathBuf::from("."),
        Some(p) => p.to_path_buf(),
        None => PathBuf::from("."),
    };
    let out = o.out.clone().unwrap_or(run_dir);
    let lock = out.is_dir().then(|| DirLock::acquire(&out)).transpose()?;
    let saved = Verified::open(dir)?.train_state()?.config;
    let cfg = TrainConfig::resume(
        &saved,
        &TrainOptions {
            out: Some(out),
            ..o
        },
    )?;
    Ok((cfg, lock))
}

/// A line on stdout; a closed stdout is not an error (the result is saved).
macro_rules! out {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// A line on stderr; a closed stderr is not an error.
macro_rules! note {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `o` with the micro-batch, recompute policy and checkpoint budget that
/// fit `--memory-budget` (when given), the choice and why on stderr.
fn within_budget(o: TrainOptions, flags: &RunFlags) -> tinyllm::Result<TrainOptions> {
    let Some(arg) = flags.memory_budget.as_deref() else {
        return Ok(o);
    };
    let bytes = budget::parse_size(arg).map_err(|e| e.context("--memory-budget"))?;
    let choice = budget::choose(&o, bytes)?;
    note!("{}", choice.explain());
    Ok(choice.apply(&o))
}

fn cmd_train(a: TrainArgs) -> tinyllm::Result<ExitCode> {
    check_sample_len("--sample-len", a.sample_len)?;
    let (cfg, _lock) = match &a.resume {
        Some(_) if a.run.memory_budget.is_some() => tinyllm::bail!(
            Config,
            "--memory-budget chooses a new run's recipe; a resumed run keeps its own (its micro-batch and recompute policy): drop --memory-budget"
        ),
        Some(dir) => resume_config(&a, dir).map_err(|e| e.context("--resume"))?,
        None => {
            let mut o = within_budget(train_options(&a)?, &a.run)?;
            o.out = o.out.or_else(|| Some(fresh_run_dir()));
            (TrainConfig::resolve(&o)?, None)
        }
    };
    let default_out = a.resume.is_none() && a.run.out.is_none();
    let start = match (&a.resume, a.overwrite) {
        (Some(dir), _) => Start::Resume(dir),
        (None, true) => Start::Overwrite,
        (None, false) => Start::Fresh,
    };
    let mut replay = match a.crosscheck_every {
        Some(k) => Some(Replay::new(k, &cfg).map_err(|e| e.context("--crosscheck-every"))?),
        None => None,
    };
    interrupt::install()?;
    if a.run.profile || a.peak_gflops.is_some() || a.bandwidth.is_some() {
        tinyllm::profile::start();
    }
    let check = replay.as_mut().map(|r| r as &mut dyn StepCheck);
    let summary = tinyllm::train::run_checked(cfg.clone(), start, a.run.progress(), check);
    if default_out && cfg.out.is_dir() {
        point_latest(&cfg.out);
    }
    // The run is saved: from here on a signal (say, during the closing
    // sample) ends the process at once.
    interrupt::uninstall();
    let summary = summary?;
    if let Some(sig) = summary.interrupted.or(interrupt::requested()) {
        report_interrupted(&cfg, &summary, sig);
        return Ok(ExitCode::from(128 + sig as u8));
    }
    if let Some(p) = tinyllm::profile::take() {
        let steps = p.steps;
        let warm_up = p.left_out.map_or_else(String::new, |w| {
            format!(
                "; the first step, {:.1} ms, left out as a warm-up",
                w.as_secs_f64() * 1e3
            )
        });
        out!(
            "\nprofile of {steps} training step{} ({} device{warm_up}):\n{p}",
            if steps == 1 { "" } else { "s" },
            summary.device
        );
        if let (Some(g), true) = (p.gpu, steps > 0) {
            let per = |x: u64| x as f64 / steps as f64;
            out!(
                "per optimizer step: {:.1} dispatches, {:.1} queue submits, {:.1} readbacks",
                per(g.dispatches),
                per(g.submits),
                per(g.readbacks)
            );
        }
        // The table of known GPUs by the adapter's name; the CPU has none.
        let adapter = match summary.device {
            tinyllm::Device::Gpu => tinyllm::gpu::adapter_name().ok(),
            _ => None,
        };
        let peak = tinyllm::roofline::Peak::resolve(adapter.as_deref(), a.peak_gflops, a.bandwidth);
        let device = adapter.unwrap_or_else(|| summary.device.to_string());
        out!("{}", p.roofline(&device, peak));
    }
    if let Some(r) = &replay {
        note!(
            "crosscheck: {} replayed step(s) on the CPU reference, all bit-identical",
            r.checked
        );
    }
    let ck = summary.out.join("checkpoint");
    let model = checkpoint::load_model(&ck, summary.device)?;
    out!();
    out!(
        "done: {} steps in {:.0} s — final train loss {:.4} (mean of the last steps), validation loss {}",
        cfg.steps,
        summary.seconds,
        summary.final_loss,
        summary.final_val_loss.map(|v| format!("{v:.4}")).unwrap_or("-".into())
    );
    if let (Some(first), Some(last)) = (summary.history.first(), summary.history.last()) {
        out!(
            "loss went from {:.4} at step {} to {:.4} at step {}",
            first.loss,
            first.step,
            last.loss,
            last.step
        );
    }
    out!("sample (temperature 0.8, top-k 40):");
    out!("----");
    out!(
        "{}",
        sample_text(&model, "The ", a.sample_len, 0.8, 40, cfg.seed)?
    );
    out!("----");
    out!("files:");
    out!(
        "  metrics     {}",
        summary.out.join("metrics.jsonl").display()
    );
    out!("  loss plot   {}", summary.out.join("loss.svg").display());
    out!("  checkpoint  {}/ (a Hugging Face folder: model.safetensors, config.json, tokenizer; with optimizer.safetensors, trainer_state.json, manifest.json)", ck.display());
    let dir = shell_quote(&summary.out.display().to_string());
    if cfg.steps < cfg.schedule_steps {
        out!(
            "continue with: {} train --resume {dir} --steps {}",
            invocation(),
            cfg.schedule_steps
        );
        out!("  (the rest of the planned schedule: the bits of an uninterrupted run)");
    } else {
        let more = cfg
            .steps
            .saturating_mul(2)
            .min(tinyllm::train::config::MAX_STEPS);
        out!(
            "continue with: {} train --resume {dir} --steps {more}",
            invocation()
        );
        out!(
            "  (steps {}..{more} run at the schedule's final learning rate, {:e}: the cosine schedule planned for {} steps is kept, not stretched)",
            cfg.steps + 1,
            cfg.lr_at(cfg.schedule_steps),
            cfg.schedule_steps
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Where a `train` without `--out` writes: a new `runs/<date>-<n>/` for each
/// run (the date in UTC), so a second run never collides with the first;
/// `runs/latest` then points at it ([`point_latest`]).
fn fresh_run_dir() -> PathBuf {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Days since 1970-01-01 to a civil date (the proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (1..)
        .map(|n| PathBuf::from(format!("runs/{y:04}-{m:02}-{d:02}-{n}")))
        .find(|p| !tinyllm::train::outdir::present(p))
        .unwrap_or_else(|| PathBuf::from("runs/latest"))
}

/// Points `runs/latest` at `dir` (one of `runs/`): a link replaced
/// atomically. A `runs/latest` that is not a link (a run an older version
/// kept there) is left as it is, with a note.
fn point_latest(dir: &Path) {
    let latest = Path::new("runs/latest");
    if tinyllm::train::outdir::present(latest) && !tinyllm::train::outdir::is_link(latest) {
        note!(
            "note: runs/latest is a directory, not a link, so it still holds an earlier run; this run is in {}",
            dir.display()
        );
        return;
    }
    #[cfg(unix)]
    if let Some(name) = dir.file_name() {
        let tmp = Path::new("runs").join(format!(".latest.tmp-{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let done =
            std::os::unix::fs::symlink(name, &tmp).and_then(|()| std::fs::rename(&tmp, latest));
        if let Err(e) = done {
            let _ = std::fs::remove_file(&tmp);
            note!(
                "note: could not point runs/latest at {}: {e}",
                dir.display()
            );
        }
    }
}

/// How to run this binary again, for the commands a hint prints: under
/// `cargo run` (cargo sets `CARGO` for the programs it runs) the same cargo
/// command, else `tinyllm`.
fn invocation() -> &'static str {
    match (std::env::var_os("CARGO").is_some(), cfg!(debug_assertions)) {
        (true, false) => "cargo run --release --",
        (true, true) => "cargo run --",
        (false, _) => "tinyllm",
    }
}

/// Where an interrupted run stands and the command that continues it.
fn report_interrupted(cfg: &TrainConfig, s: &RunSummary, sig: i32) {
    let name = interrupt::name(sig);
    match &s.checkpoint {
        Some(ck) if s.checkpoint_step >= cfg.steps => note!(
            "interrupted by {name} after the run finished: its checkpoint (step {}) is {}",
            s.checkpoint_step,
            ck.display()
        ),
        Some(ck) => {
            note!(
                "interrupted by {name}: the run is saved at step {} of {} in {}",
                s.checkpoint_step,
                cfg.steps,
                ck.display()
            );
            note!(
                "resume with: {} train --resume {} --steps {}",
                invocation(),
                shell_quote(&s.out.display().to_string()),
                cfg.steps
            );
        }
        None => note!("interrupted by {name} before the first step: nothing to save"),
    }
}

fn cmd_compare(a: CompareArgs) -> tinyllm::Result<ExitCode> {
    if a.run.profile {
        tinyllm::bail!(
            Config,
            "--profile: compare does not profile its runs; profile one recipe with train --profile"
        );
    }
    // progress goes to stderr, so a long comparison shows it under --json too
    let progress = a.run.progress();
    let existing = match (a.overwrite, a.resume) {
        (true, _) => compare::Existing::Overwrite,
        (_, true) => compare::Existing::Resume,
        _ => compare::Existing::Refuse,
    };
    let sides = match a.side.as_str() {
        "fp32" => compare::Sides::Fp32,
        "mixed" => compare::Sides::Mixed,
        _ => compare::Sides::Both,
    };
    // a signal finishes the current step and saves it, for --resume
    interrupt::install()?;
    let builds = if a.allow_mixed_builds {
        compare::MixedBuilds::Allow
    } else {
        compare::MixedBuilds::Refuse
    };
    let opts = within_budget(a.run.options()?, &a.run)?;
    let c = compare::compare(&opts, existing, sides, builds, progress);
    interrupt::uninstall();
    // An interrupted side is saved; the exit status says which signal, as
    // `train`'s does.
    if let (Err(e), Some(sig)) = (&c, interrupt::requested()) {
        note!("error: {e}");
        return Ok(ExitCode::from(128 + sig as u8));
    }
    let c = match c? {
        compare::Outcome::Compared(c) => c,
        compare::Outcome::OneSide { done, missing, out } => {
            note!(
                "the {done} side has finished in {}; the comparison needs the {missing} side: run the same command with --side {missing} --resume",
                out.display()
            );
            return Ok(ExitCode::SUCCESS);
        }
    };
    if a.json {
        out!(
            "{}",
            serde_json::to_string(&c).map_err(|e| tinyllm::Error::config(e.to_string()))?
        );
    } else {
        out!("{}", c.table());
    }
    Ok(ExitCode::SUCCESS)
}

fn device_of(s: &str) -> tinyllm::Result<tinyllm::Device> {
    let (d, n) = select_device(
        s.parse::<DeviceChoice>()
            .map_err(|e| e.context("--device"))?,
    )?;
    if let Some(n) = n {
        note!("{n}");
    }
    Ok(d)
}

fn cmd_eval(a: EvalArgs) -> tinyllm::Result<ExitCode> {
    // The files first: a missing --data is reported before any device probe.
    let corpus = a.data.as_ref().map(|p| Corpus::load(Some(p))).transpose()?;
    let device = device_of(&a.device)?;
    let dir = checkpoint::resolve_dir(&a.checkpoint);
    // The text the run trained on (by its SHA-256), wherever it is now, is
    // read for its held-out windows: its other windows trained the model.
    // (the checkpoint is only opened for this when --data is given)
    let trained_on = |c: &Corpus| {
        checkpoint::Verified::open(&dir)
            .and_then(|ck| ck.train_state())
            .is_ok_and(|st| st.data_fingerprint == c.fingerprint)
    };
    let (training_text, corpus) = match corpus {
        Some(c) if trained_on(&c) => (Some(c), None),
        other => (None, other),
    };
    let Some(corpus) = corpus else {
        let h = tinyllm::train::infer::heldout(&a.checkpoint, device, training_text)
            .map_err(|e| e.context("--checkpoint"))?;
        out!(
            "{}: mean cross-entropy {:.4} nats/byte ({:.3} bits/byte) on the {} held-out windows of {} (float32)",
            dir.display(),
            h.loss,
            h.loss / std::f32::consts::LN_2,
            h.windows,
            h.corpus
        );
        return Ok(ExitCode::SUCCESS);
    };
    let model =
        checkpoint::load_model(&a.checkpoint, device).map_err(|e| e.context("--checkpoint"))?;
    // A line at every tenth of the text: a long evaluation shows it is moving.
    let mut shown = 0;
    let progress = |done: usize, total: usize| {
        let tenth = done * 10 / total.max(1);
        if tenth > shown {
            shown = tenth;
            note!("eval: {}% ({done} of {total} windows)", tenth * 10);
        }
    };
    let (loss, tokens) = eval_text(
        &model,
        &corpus,
        tinyllm::precision::Precision::Fp32,
        progress,
    )?;
    out!(
        "{}: mean cross-entropy {loss:.4} nats/byte ({:.3} bits/byte) over {tokens} tokens of {}",
        dir.display(),
        loss / std::f32::consts::LN_2,
        corpus.name
    );
    Ok(ExitCode::SUCCESS)
}

/// Streams the sample to stdout as it is drawn (the output is the progress).
/// A reader that goes away (a closed pipe) ends it quietly.
fn cmd_generate(a: GenerateArgs) -> tinyllm::Result<ExitCode> {
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
    let mut stdout = std::io::stdout().lock();
    let mut text = Utf8Stream::default();
    let mut failed = stdout
        .write_all(a.prompt.as_bytes())
        .and_then(|()| stdout.flush())
        .err();
    if failed.is_none() {
        generate_with(
            &model,
            &ByteTokenizer::encode(&a.prompt),
            a.len,
            a.temperature,
            a.top_k,
            &Generator::new(a.seed),
            |id| {
                let s = text.push(id as u8);
                match stdout.write_all(s.as_bytes()).and_then(|()| stdout.flush()) {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(e) => {
                        failed = Some(e);
                        ControlFlow::Break(())
                    }
                }
            },
        )?;
    }
    if failed.is_none() {
        failed = writeln!(stdout, "{}", text.finish()).err();
    }
    match failed {
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(tinyllm::Error::io("cannot write the sample to stdout", e))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

fn cmd_export(a: ExportArgs) -> tinyllm::Result<ExitCode> {
    use tinyllm::train::continuation;
    let ck = Verified::open(&a.checkpoint).map_err(|e| e.context("--checkpoint"))?;
    let st = ck.train_state().map_err(|e| e.context("--checkpoint"))?;
    if let Some(file) = &a.check {
        let c = continuation::read_file(file).map_err(|e| e.context("--check"))?;
        c.check_run(&st.run_id)
            .map_err(|e| e.context(format!("--check {}", file.display())))?;
        out!(
            "{}: a continuation of run {} at step {} ({} batches, {} parameters with AdamW moments): ok",
            file.display(),
            c.meta.run_id,
            c.meta.step,
            c.meta.batches,
            c.moments.iter().filter(|m| m.is_some()).count()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let out = a.out.expect("clap requires --out without --check");
    let corpus = Corpus::load(a.data.as_ref().or(st.config.data.as_ref()))?;
    let meta = continuation::export_to(&ck.dir, &corpus, a.batches, &out)?;
    out!(
        "{}: run {} at step {}: weights, AdamW moments and the batches of steps {}..={}{}",
        out.display(),
        meta.run_id,
        meta.step,
        meta.step + 1,
        meta.step + meta.batches,
        if meta.precision == "fp32" {
            String::new()
        } else {
            let article = if meta.precision.starts_with('f') {
                "an"
            } else {
                "a"
            };
            format!(
                " ({article} {} run: PyTorch continues in float32, so its losses match to that precision only)",
                meta.precision
            )
        }
    );
    Ok(ExitCode::SUCCESS)
}

fn cmd_import(a: ImportArgs) -> tinyllm::Result<ExitCode> {
    use tinyllm::train::continuation;
    let c = continuation::read_file(&a.continuation).map_err(|e| e.context("--continuation"))?;
    let ck = continuation::import(&c, &a.checkpoint, &a.out).map_err(|e| {
        e.context(format!(
            "import {} into {}",
            a.continuation.display(),
            a.out.display()
        ))
    })?;
    out!(
        "{}: run {} at step {}; continue with: tinyllm train --resume {} --steps N",
        ck.display(),
        c.meta.run_id,
        c.meta.step,
        shell_quote(&a.out.display().to_string())
    );
    Ok(ExitCode::SUCCESS)
}

fn cmd_bench(a: BenchArgs) -> tinyllm::Result<ExitCode> {
    let defaults = tinyllm::bench::BenchOptions::default();
    let opts = tinyllm::bench::BenchOptions {
        full: a.full || defaults.full,
        f32_matmul: !a.no_f32,
        ..defaults
    };
    let report = tinyllm::bench::run_gpu(&opts).map_err(|e| e.context("bench"))?;
    if a.json {
        out!("{}", report.to_json());
    } else {
        let _ = write!(std::io::stdout(), "{}", report.table());
    }
    Ok(ExitCode::SUCCESS)
}

fn cmd_device_check(a: DeviceCheckArgs) -> tinyllm::Result<ExitCode> {
    tinyllm::nn::llama::LlamaConfig::preset(&a.preset).map_err(|e| e.context("--preset"))?;
    let plan = device_check::Plan {
        out: a.out,
        preset: a.preset,
        steps: a.steps,
        backends: device_check::backends(a.backends.as_deref())?,
        limit: std::time::Duration::from_secs(a.part_seconds.max(1)),
    };
    let path = device_check::run(&plan, &|msg| note!("device-check: {msg}"))?;
    out!("report: {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// `tinyllm crosscheck`: the report on stdout (or one JSON object), progress
/// on stderr. Errors exit with status 2, not 1, so "differs" is unambiguous.
fn cmd_crosscheck(a: CrosscheckArgs) -> ExitCode {
    let opts = (|| -> tinyllm::Result<tinyllm::crosscheck::Options> {
        let precisions = match &a.precision {
            Some(p) => vec![p
                .parse()
                .map_err(|e: tinyllm::Error| e.context("--precision"))?],
            None => tinyllm::crosscheck::Options::default().precisions,
        };
        tinyllm::nn::llama::LlamaConfig::preset(&a.preset).map_err(|e| e.context("--preset"))?;
        if let Some(b) = &a.backend {
            let b: tinyllm::gpu::Backend = b
                .parse()
                .map_err(|e: tinyllm::Error| e.context("--backend"))?;
            tinyllm::gpu::use_backend(b)?;
        }
        Ok(tinyllm::crosscheck::Options {
            preset: a.preset.clone(),
            steps: a.steps,
            precisions,
            sweep: !a.skip_sweep,
            seed: None,
        })
    })();
    let report =
        opts.and_then(|o| tinyllm::crosscheck::run(&o, &mut |msg| note!("crosscheck: {msg}")));
    match report {
        Ok(r) => {
            if a.json {
                out!("{}", r.json());
            } else {
                let _ = write!(std::io::stdout(), "{}", r.text());
            }
            ExitCode::from(r.exit_code())
        }
        Err(e) => {
            let msg = match e {
                tinyllm::Error::Device(_) => {
                    format!("crosscheck needs a GPU to compare with the CPU reference: {e}")
                }
                _ => e.to_string(),
            };
            note!("error: {msg}");
            if a.json {
                out!("{}", serde_json::json!({ "error": msg, "exit_code": 2 }));
            }
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = tinyllm::memory::keep_freed_host_memory();
    // TINYLLM_THREADS=n caps the CPU's threads for large products and AdamW
    // updates (results never depend on it).
    if let Ok(t) = std::env::var("TINYLLM_THREADS") {
        match t.trim().parse::<usize>() {
            Ok(n) if n >= 1 => tinyllm::set_cpu_threads(Some(n)),
            _ => {
                note!("error: TINYLLM_THREADS must be a whole number ≥ 1 (got {t:?})");
                return ExitCode::FAILURE;
            }
        }
    }
    let res = match cli.cmd {
        Cmd::Train(a) => cmd_train(a),
        Cmd::Compare(a) => cmd_compare(a),
        Cmd::Eval(a) => cmd_eval(a),
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::Export(a) => cmd_export(a),
        Cmd::Import(a) => cmd_import(a),
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::Crosscheck(a) => return cmd_crosscheck(a),
        Cmd::DeviceCheck(a) => cmd_device_check(a),
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            note!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
