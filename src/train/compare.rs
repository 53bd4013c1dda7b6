//! Milestone MS-L11: the same preset, data and seed trained twice — float32
//! with the whole batch at once, and bf16 with micro-batches, accumulation and
//! activation checkpointing — then both final models evaluated the same way
//! (float32, the same held-out windows) and both peak memories side by side.
//!
//! The verdict reads the held-out losses, not the training losses (each side
//! computes those in its own precision, on its own batches), and the memory
//! the machine saw — the process's resident peak where the platform reports
//! it — next to the tensor bytes the crate counts.

use crate::memory;
use crate::precision::Precision;
use crate::train::config::{TrainConfig, TrainOptions};
use crate::train::data::{Corpus, Dataset};
use crate::train::plan::mib;
use crate::train::plot::{loss_svg, Series};
use crate::train::trainer::{finished_run, run, say, Progress, RunSummary, Start};
use crate::Result;
use serde::Serialize;

/// One side of the comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Side {
    pub label: String,
    pub precision: String,
    pub micro_batch: usize,
    pub accum: usize,
    pub ckpt_budget: Option<usize>,
    /// Mean of the last training losses, in the side's own precision.
    pub final_loss: f32,
    /// The final model's loss on the held-out windows, evaluated in float32.
    pub heldout_loss: f32,
    pub planned_peak_bytes: usize,
    /// Peak tensor bytes ([`crate::memory`]).
    pub measured_peak_bytes: usize,
    /// The process's resident peak during this side alone, where known.
    pub process_peak_bytes: Option<usize>,
    pub seconds: f64,
}

/// The MS-L11 table.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub preset: String,
    pub steps: usize,
    pub batch: usize,
    pub seed: u64,
    pub fp32: Side,
    pub mixed: Side,
    /// |mixed − fp32| / fp32 of the float32 held-out losses.
    pub rel_diff: f32,
    pub within_2_percent: bool,
    pub lower_peak: bool,
    pub pass: bool,
    pub plot: String,
}

fn side(label: &str, cfg: &TrainConfig, s: &RunSummary, heldout_loss: f32) -> Side {
    Side {
        label: label.into(),
        precision: cfg.precision.name().into(),
        micro_batch: cfg.micro_batch,
        accum: cfg.accum,
        ckpt_budget: cfg.ckpt_budget,
        final_loss: s.final_loss,
        heldout_loss,
        planned_peak_bytes: s.plan.total,
        measured_peak_bytes: s.peak_bytes,
        process_peak_bytes: s.process_peak_bytes,
        seconds: s.seconds,
    }
}

/// The run's final model (its last checkpoint) on the held-out windows of
/// the run's corpus, in float32: the same windows for both sides (same
/// corpus, context and seed).
fn heldout_loss(cfg: &TrainConfig, s: &RunSummary) -> Result<f32> {
    let dir = s.checkpoint.as_ref().ok_or_else(|| {
        crate::Error::checkpoint(format!("compare: {} saved no checkpoint", s.out.display()))
    })?;
    let model = crate::train::checkpoint::load_model(dir, s.device)?;
    let corpus = Corpus::load(cfg.data.as_ref())?;
    let data = Dataset::new(&corpus, model.cfg.context, cfg.seed)?;
    let batch = data.val_batch(cfg.eval_rows);
    crate::train::infer::evaluate(&model, &batch, Precision::Fp32, cfg.micro_batch.max(8))
}

/// Which side(s) of the comparison this call trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sides {
    Both,
    Fp32,
    Mixed,
}

/// How [`compare`] treats the runs `--out` already holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Refuse them.
    Refuse,
    /// Delete them and start again.
    Overwrite,
    /// Keep a finished side, continue an unfinished one.
    Resume,
}

/// What a call to [`compare`] ends with.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Both sides are finished: the comparison.
    Compared(Box<Comparison>),
    /// Only `done` is finished; the other side is still to run.
    OneSide {
        done: &'static str,
        missing: &'static str,
        out: std::path::PathBuf,
    },
}

/// Trains the sides asked for under `opts.out` (default `runs/compare`):
/// `fp32/` and `mixed/`, one after the other, and, once both are finished,
/// compares them and writes `compare.svg`. A long comparison can run one side
/// per call (`sides`) and continue an interrupted side (`Existing::Resume`).
pub fn compare(
    opts: &TrainOptions,
    existing: Existing,
    sides: Sides,
    progress: Progress,
) -> Result<Outcome> {
    let mut o = opts.clone();
    let out = o.out.take().unwrap_or_else(|| "runs/compare".into());
    if o.precision.as_deref() == Some("fp32") {
        o.precision = None;
    }
    let mixed_cfg = TrainConfig::resolve(&TrainOptions {
        out: Some(out.join("mixed")),
        checkpoint_activations: Some(true),
        ..o.clone()
    })?;
    let fp32_cfg = TrainConfig {
        precision: Precision::Fp32,
        micro_batch: mixed_cfg.batch,
        accum: 1,
        ckpt_budget: None,
        out: out.join("fp32"),
        ..mixed_cfg.clone()
    };
    if existing == Existing::Refuse {
        for cfg in [&fp32_cfg, &mixed_cfg] {
            if let Some(what) = crate::train::outdir::existing_run(&cfg.out) {
                crate::bail!(Config,
                    "{} already holds a comparison's run ({what}): continue it with --resume, replace it with --overwrite, or give another --out",
                    out.display()
                );
            }
        }
    }
    let fp32_title = format!("float32, full batch of {}", fp32_cfg.batch);
    let mixed_title = format!(
        "{}, {} micro-batches of {}, checkpointing",
        mixed_cfg.precision.name(),
        mixed_cfg.accum,
        mixed_cfg.micro_batch
    );
    let a = one_side(
        &fp32_cfg,
        &fp32_title,
        existing,
        sides != Sides::Mixed,
        progress,
    )?;
    let b = one_side(
        &mixed_cfg,
        &mixed_title,
        existing,
        sides != Sides::Fp32,
        progress,
    )?;
    let (a, b) = match (a, b) {
        (Some(a), Some(b)) => (a, b),
        (Some(_), None) => {
            return Ok(Outcome::OneSide {
                done: "fp32",
                missing: "mixed",
                out,
            })
        }
        (None, Some(_)) => {
            return Ok(Outcome::OneSide {
                done: "mixed",
                missing: "fp32",
                out,
            })
        }
        (None, None) => crate::bail!(
            Config,
            "compare: neither side has finished in {}",
            out.display()
        ),
    };
    let (ha, hb) = (heldout_loss(&fp32_cfg, &a)?, heldout_loss(&mixed_cfg, &b)?);
    let rel = ((hb - ha) / ha).abs();
    let peaks = |s: &RunSummary| match s.process_peak_bytes {
        Some(p) => format!("peak {} process, {} tensors", mib(p), mib(s.peak_bytes)),
        None => format!("peak {} tensors", mib(s.peak_bytes)),
    };
    let names = [
        format!("float32, full batch ({})", peaks(&a)),
        format!("mixed precision ({})", peaks(&b)),
    ];
    let series = |name, color, s: &RunSummary| Series {
        name,
        color,
        points: s
            .history
            .iter()
            .map(|m| (m.step as f64, m.loss as f64))
            .collect(),
        dots: false,
    };
    let plot = out.join("compare.svg");
    let svg = loss_svg(
        &format!(
            "{}: float32 vs {} + accumulation + checkpointing",
            mixed_cfg.preset,
            mixed_cfg.precision.name()
        ),
        &[
            series(&names[0], "#1f77b4", &a),
            series(&names[1], "#ff7f0e", &b),
        ],
    );
    crate::train::checkpoint::write_atomic(&out, "compare.svg", svg.as_bytes())?;
    let within = rel <= 0.02;
    // what the machine saw where it says, the crate's tensor bytes otherwise
    let lower = match (a.process_peak_bytes, b.process_peak_bytes) {
        (Some(pa), Some(pb)) => pb < pa,
        _ => b.peak_bytes < a.peak_bytes,
    };
    Ok(Outcome::Compared(Box::new(Comparison {
        preset: mixed_cfg.preset.clone(),
        steps: mixed_cfg.steps,
        batch: mixed_cfg.batch,
        seed: mixed_cfg.seed,
        fp32: side("float32", &fp32_cfg, &a, ha),
        mixed: side("mixed", &mixed_cfg, &b, hb),
        rel_diff: rel,
        within_2_percent: within,
        lower_peak: lower,
        pass: within && lower,
        plot: plot.display().to_string(),
    })))
}

/// One side: trained here when `train` (fresh, or continued when resuming),
/// else only read back if it has finished. `None`: not finished.
fn one_side(
    cfg: &TrainConfig,
    title: &str,
    existing: Existing,
    train: bool,
    progress: Progress,
) -> Result<Option<RunSummary>> {
    let resume = existing == Existing::Resume;
    if !train || resume {
        if let Some(done) = finished_run(cfg)? {
            if train {
                say(
                    progress,
                    &format!("== {title}: finished in {} ==", cfg.out.display()),
                );
            }
            return Ok(Some(done));
        }
    }
    if !train {
        return Ok(None);
    }
    say(progress, &format!("== {title} =="));
    let start = match existing {
        Existing::Resume if crate::train::outdir::existing_run(&cfg.out).is_some() => {
            Start::Resume(&cfg.out)
        }
        Existing::Overwrite => Start::Overwrite,
        _ => Start::Fresh,
    };
    // Each side's process peak starts from what the process holds before it.
    memory::restart_process_peak();
    let s = run(cfg.clone(), start, progress)?;
    stop_if_interrupted(&s)?;
    Ok(Some(s))
}

/// A run a signal stopped is not a comparison.
fn stop_if_interrupted(s: &RunSummary) -> Result<()> {
    match s.interrupted {
        Some(sig) => Err(crate::Error::io(
            format!(
                "compare: interrupted by {} ({} has the checkpoint of step {}; continue with the same command and --resume)",
                crate::train::interrupt::name(sig),
                s.out.display(),
                s.checkpoint_step
            ),
            std::io::ErrorKind::Interrupted.into(),
        )),
        None => Ok(()),
    }
}

impl Comparison {
    /// The MS-L11 table as text.
    pub fn table(&self) -> String {
        let opt_mib = |b: Option<usize>| b.map_or("n/a".to_string(), mib);
        let row = |s: &Side| {
            let how = format!(
                "{}, {}×{}{}",
                s.precision,
                s.accum,
                s.micro_batch,
                s.ckpt_budget
                    .map(|b| format!(", ckpt {b}"))
                    .unwrap_or_default()
            );
            format!(
                "| {:<24} | {:>10.4} | {:>13.4} | {:>12} | {:>12} | {:>12} |\n",
                how,
                s.final_loss,
                s.heldout_loss,
                mib(s.planned_peak_bytes),
                mib(s.measured_peak_bytes),
                opt_mib(s.process_peak_bytes)
            )
        };
        let mut t = format!(
            "MS-L11 — preset {}, {} steps, batch {}, seed {}\n\n",
            self.preset, self.steps, self.batch, self.seed
        );
        t += "| run                      | train loss | held-out loss | planned peak | tensor peak  | process peak |\n";
        t += "|--------------------------|-----------:|--------------:|-------------:|-------------:|-------------:|\n";
        t += &row(&self.fp32);
        t += &row(&self.mixed);
        let (pa, pb, which) = match (self.fp32.process_peak_bytes, self.mixed.process_peak_bytes) {
            (Some(a), Some(b)) => (a, b, "process"),
            _ => (
                self.fp32.measured_peak_bytes,
                self.mixed.measured_peak_bytes,
                "tensor",
            ),
        };
        t +=
            &format!(
            "\n(train loss: mean of the last steps in each run's own precision; held-out loss: \
             both final models in float32 on the same held-out windows)\n\
             relative difference of held-out losses: {:.2}% ({} 2%)\n\
             {which} peak memory: {} → {} ({})\nverdict: {}\nplot: {}\n",
            100.0 * self.rel_diff,
            if self.within_2_percent { "within" } else { "NOT within" },
            mib(pa),
            mib(pb),
            if self.lower_peak { "lower" } else { "NOT lower" },
            if self.pass { "PASS" } else { "FAIL" },
            self.plot
        );
        t
    }
}
