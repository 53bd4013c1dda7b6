//! Milestone MS-L11: the same preset, data and seed trained twice — float32
//! with the whole batch at once, and bf16 with micro-batches, accumulation and
//! activation checkpointing — then final losses and peak memories side by side.

use crate::precision::Precision;
use crate::train::config::{TrainConfig, TrainOptions};
use crate::train::plan::mib;
use crate::train::plot::{loss_svg, Series};
use crate::train::trainer::{run, say, Progress, RunSummary, Start};
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
    pub final_loss: f32,
    pub planned_peak_bytes: usize,
    pub measured_peak_bytes: usize,
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
    /// |mixed − fp32| / fp32 of the final losses.
    pub rel_diff: f32,
    pub within_2_percent: bool,
    pub lower_peak: bool,
    pub pass: bool,
    pub plot: String,
}

fn side(label: &str, cfg: &TrainConfig, s: &RunSummary) -> Side {
    Side {
        label: label.into(),
        precision: cfg.precision.name().into(),
        micro_batch: cfg.micro_batch,
        accum: cfg.accum,
        ckpt_budget: cfg.ckpt_budget,
        final_loss: s.final_loss,
        planned_peak_bytes: s.plan.total,
        measured_peak_bytes: s.peak_bytes,
        seconds: s.seconds,
    }
}

/// Runs both trainings under `opts.out` (default `runs/compare`): `fp32/` and
/// `mixed/`, and writes `compare.svg` with both loss curves. Runs already
/// there are refused unless `overwrite`.
pub fn compare(opts: &TrainOptions, overwrite: bool, progress: Progress) -> Result<Comparison> {
    let start = if overwrite {
        Start::Overwrite
    } else {
        Start::Fresh
    };
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
    if progress != Progress::Quiet {
        say(
            progress,
            &format!("== float32, full batch of {} ==", fp32_cfg.batch),
        );
    }
    let a = run(fp32_cfg.clone(), start, progress)?;
    stop_if_interrupted(&a)?;
    if progress != Progress::Quiet {
        say(
            progress,
            &format!(
                "== {}, {} micro-batches of {}, checkpointing ==",
                mixed_cfg.precision.name(),
                mixed_cfg.accum,
                mixed_cfg.micro_batch
            ),
        );
    }
    let b = run(mixed_cfg.clone(), start, progress)?;
    stop_if_interrupted(&b)?;
    let rel = ((b.final_loss - a.final_loss) / a.final_loss).abs();
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
            series("float32, full batch", "#1f77b4", &a),
            series("mixed precision", "#ff7f0e", &b),
        ],
    );
    crate::train::checkpoint::write_atomic(&out, "compare.svg", svg.as_bytes())?;
    let within = rel <= 0.02;
    let lower = b.peak_bytes < a.peak_bytes;
    Ok(Comparison {
        preset: mixed_cfg.preset.clone(),
        steps: mixed_cfg.steps,
        batch: mixed_cfg.batch,
        seed: mixed_cfg.seed,
        fp32: side("float32", &fp32_cfg, &a),
        mixed: side("mixed", &mixed_cfg, &b),
        rel_diff: rel,
        within_2_percent: within,
        lower_peak: lower,
        pass: within && lower,
        plot: plot.display().to_string(),
    })
}

/// A run a signal stopped is not a comparison.
fn stop_if_interrupted(s: &RunSummary) -> Result<()> {
    match s.interrupted {
        Some(sig) => Err(crate::Error::io(
            format!(
                "compare: interrupted by {} ({} has the checkpoint of step {})",
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
                "| {:<24} | {:>10.4} | {:>12} | {:>13} |\n",
                how,
                s.final_loss,
                mib(s.planned_peak_bytes),
                mib(s.measured_peak_bytes)
            )
        };
        let mut t = format!(
            "MS-L11 — preset {}, {} steps, batch {}, seed {}\n\n",
            self.preset, self.steps, self.batch, self.seed
        );
        t += "| run                      | final loss | planned peak | measured peak |\n";
        t += "|--------------------------|-----------:|-------------:|--------------:|\n";
        t += &row(&self.fp32);
        t += &row(&self.mixed);
        t += &format!(
            "\nrelative difference of final losses: {:.2}% ({} 2%)\npeak memory: {} → {} ({})\nverdict: {}\nplot: {}\n",
            100.0 * self.rel_diff,
            if self.within_2_percent { "within" } else { "NOT within" },
            mib(self.fp32.measured_peak_bytes),
            mib(self.mixed.measured_peak_bytes),
            if self.lower_peak { "lower" } else { "NOT lower" },
            if self.pass { "PASS" } else { "FAIL" },
            self.plot
        );
        t
    }
}
