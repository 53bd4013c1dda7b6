//! The mixed-precision comparison: the same preset, data and seed trained
//! twice — float32 with the whole batch at once, and bf16 with micro-batches,
//! accumulation and activation recompute — then both final models
//! evaluated the same way (float32, the same held-out windows) and both peak
//! memories side by side. It passes when the mixed-precision run ends within
//! 2% of float32's held-out loss with a lower peak memory.
//!
//! The verdict reads the held-out losses, not the training losses (each side
//! computes those in its own precision, on its own batches), and the memory
//! the machine saw — the process's resident peak where the platform reports
//! it — next to the tensor bytes the crate counts.

use crate::memory;
use crate::precision::Precision;
use crate::train::config::{TrainConfig, TrainOptions};
use crate::train::plan::mib;
use crate::train::plot::{chart_svg, Panel, Series};
use crate::train::provenance::Provenance;
use crate::train::trainer::{finished_run, run, say, Progress, RunSummary, Start};
use crate::Result;
use serde::Serialize;

/// One side of the comparison.
#[derive(Clone, Debug, Serialize)]
pub struct Side {
    /// `float32` or `mixed`.
    pub label: String,
    /// The side's precision: `fp32`, or the mixed side's `bf16` or `fp16`.
    pub precision: String,
    /// Sequences per micro-batch (the whole batch for float32).
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step (1 for float32).
    pub accum: usize,
    /// The activation-recompute budget in layer units (`None`: off, as
    /// on the float32 side).
    pub ckpt_budget: Option<usize>,
    /// What the side's backward recomputes (`none` on the float32 side).
    pub recompute: String,
    /// Mean of the last training losses, in the side's own precision.
    pub final_loss: f32,
    /// The final model's loss on the held-out windows, evaluated in float32.
    pub heldout_loss: f32,
    /// The memory plan's peak, in bytes.
    pub planned_peak_bytes: usize,
    /// Peak tensor bytes ([`crate::memory`]).
    pub measured_peak_bytes: usize,
    /// The process's resident peak during this side alone, where known.
    pub process_peak_bytes: Option<usize>,
    /// On the GPU: the device's peak bytes of tensor buffers, the pool's
    /// cached ones included, during this side alone.
    pub device_peak_bytes: Option<usize>,
    /// Wall-clock seconds of the side's run.
    pub seconds: f64,
}

/// The comparison's result: both sides, how far apart their held-out losses
/// are, whether the mixed side's peak memory is lower, and the verdict.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// The preset both sides trained.
    pub preset: String,
    /// Optimizer steps per side.
    pub steps: usize,
    /// Sequences per optimizer step (the same on both sides).
    pub batch: usize,
    /// The seed both sides used.
    pub seed: u64,
    /// The float32, full-batch side.
    pub fp32: Side,
    /// The mixed-precision side (micro-batches, accumulation, recompute).
    pub mixed: Side,
    /// |mixed − fp32| / fp32 of the float32 held-out losses.
    pub rel_diff: f32,
    /// The largest `rel_diff` the recipe is allowed: 2 % for a 16-bit
    /// recipe (the milestone), 3 % with fp8 products.
    pub tolerance: f32,
    /// Whether `rel_diff` is at most `tolerance`.
    pub within_tolerance: bool,
    /// Whether the mixed side's peak memory is lower: the process peaks when
    /// both are known, else the tensor peaks.
    pub lower_peak: bool,
    /// Both of the above: the comparison passes.
    pub pass: bool,
    /// The path of the loss plot, `compare.svg`.
    pub plot: String,
    /// The distinct numerics fingerprints of every process of both sides
    /// (`unknown` for records older than the fingerprint): one entry when
    /// the two sides are one experiment.
    pub numerics: Vec<String>,
    /// The distinct builds (commit, `+dirty` when the tree differed from it)
    /// of every process of both sides.
    pub commits: Vec<String>,
}

/// How far the recipe's held-out loss may be from float32's: MS-L11's 2 % for
/// 16-bit autocast; fp8's 3-bit mantissas are held to 3 %.
pub fn tolerance(cfg: &TrainConfig) -> f32 {
    match cfg.fp8 {
        Some(_) => 0.03,
        None => 0.02,
    }
}

/// The precision's name, with `+fp8` for an fp8 run (its Linear layers'
/// products in fp8, the rest at the precision).
fn recipe_name(cfg: &TrainConfig) -> String {
    match cfg.fp8 {
        Some(_) => format!("{}+fp8", cfg.precision.name()),
        None => cfg.precision.name().into(),
    }
}

fn side(label: &str, cfg: &TrainConfig, s: &RunSummary, heldout_loss: f32) -> Side {
    Side {
        label: label.into(),
        precision: match &cfg.cast_policy {
            Some(p) => format!("{} {}", recipe_name(cfg), p.name()),
            None => recipe_name(cfg),
        },
        micro_batch: cfg.micro_batch,
        accum: cfg.accum,
        ckpt_budget: cfg.ckpt_budget,
        recompute: cfg.recompute().name().into(),
        final_loss: s.final_loss,
        heldout_loss,
        planned_peak_bytes: s.plan.total,
        measured_peak_bytes: s.peak_bytes,
        process_peak_bytes: s.process_peak_bytes,
        device_peak_bytes: s.device_peak_bytes,
        seconds: s.seconds,
    }
}

/// The run's final model (its last checkpoint) on the held-out windows of
/// the run's corpus, in float32: the same windows for both sides (same
/// corpus, context and seed).
fn heldout_loss(s: &RunSummary) -> Result<f32> {
    let dir = s.checkpoint.as_ref().ok_or_else(|| {
        crate::Error::checkpoint(format!("compare: {} saved no checkpoint", s.out.display()))
    })?;
    Ok(crate::train::infer::heldout(dir, s.device, None)?.loss)
}

/// Which side(s) of the comparison this call trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sides {
    /// The float32 side, then the mixed one.
    Both,
    /// Only the float32 side.
    Fp32,
    /// Only the mixed-precision side.
    Mixed,
}

/// Whether [`compare`] compares sides trained by builds whose numerics
/// differ (their [`Provenance::numerics`] fingerprints): losses from two
/// different contracts are not one experiment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixedBuilds {
    /// Refuse, naming the builds (the default).
    Refuse,
    /// Compare, and say so in the report.
    Allow,
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
        /// The finished side: `fp32` or `mixed`.
        done: &'static str,
        /// The side still to run: `fp32` or `mixed`.
        missing: &'static str,
        /// The comparison's output directory.
        out: std::path::PathBuf,
    },
}

/// Trains the sides asked for under `opts.out` (default `runs/compare`):
/// `fp32/` and `mixed/`, one after the other, and, once both are finished,
/// compares them and writes `compare.svg`. A long comparison can run one side
/// per call (`sides`) and continue an interrupted side (`Existing::Resume`).
/// Both sides take `opts` resolved as for `train` (the mixed side's
/// precision bf16 or fp16; `fp32` is refused); the float32 side then takes
/// the whole batch at once without recompute.
///
/// An error when the precision asked for is float32, when `existing` is
/// [`Existing::Refuse`] and a side's directory
/// already holds a run, when a signal interrupts a side, or when a run or
/// the held-out evaluation fails.
pub fn compare(
    opts: &TrainOptions,
    existing: Existing,
    sides: Sides,
    builds: MixedBuilds,
    progress: Progress,
) -> Result<Outcome> {
    let mut o = opts.clone();
    let out = o.out.take().unwrap_or_else(|| "runs/compare".into());
    // The mixed side checkpoints its blocks unless --recompute says otherwise.
    let mixed_cfg = TrainConfig::resolve(&TrainOptions {
        out: Some(out.join("mixed")),
        checkpoint_activations: match o.recompute {
            Some(_) => o.checkpoint_activations,
            None => Some(true),
        },
        ..o.clone()
    })?;
    if mixed_cfg.precision == Precision::Fp32 {
        crate::bail!(
            Config,
            "compare trains float32 against a 16-bit recipe: give --bf16 or --fp16 (or neither: bf16)"
        );
    }
    let fp32_cfg = TrainConfig {
        precision: Precision::Fp32,
        micro_batch: mixed_cfg.batch,
        accum: 1,
        ckpt_budget: None,
        recompute_attention: false,
        // the policy is the mixed side's recipe; float32 rounds nothing
        cast_policy: None,
        fp8: None,
        out: out.join("fp32"),
        ..mixed_cfg.clone()
    };
    crate::train::outdir::check_not_in_checkpoint(&out)?;
    for side in [&fp32_cfg.out, &mixed_cfg.out] {
        if crate::train::outdir::is_link(side) {
            crate::bail!(Config,
                "{} is a symbolic link: compare writes its sides into --out itself and never through a link; remove it, or give another --out",
                side.display()
            );
        }
    }
    // A side already saved continues its own recipe: what this call gives
    // is checked against it as `train --resume` checks, and refused by name.
    let (fp32_cfg, mixed_cfg) = if existing == Existing::Resume {
        let fp32_opts = TrainOptions {
            micro_batch: None,
            accum: None,
            checkpoint_activations: None,
            recompute: None,
            ckpt_budget: None,
            precision: None,
            cast_policy: None,
            fp8: None,
            amax_history: None,
            fp8_margin: None,
            amax_reduction: None,
            out: Some(fp32_cfg.out.clone()),
            ..o.clone()
        };
        let mixed_opts = TrainOptions {
            out: Some(mixed_cfg.out.clone()),
            ..o.clone()
        };
        (
            saved_recipe(fp32_cfg, &fp32_opts)?,
            saved_recipe(mixed_cfg, &mixed_opts)?,
        )
    } else {
        (fp32_cfg, mixed_cfg)
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
    // Before any training: the builds that wrote the sides so far, and this
    // one where it trains a side now.
    if builds == MixedBuilds::Refuse && existing == Existing::Resume {
        let mut seen = Vec::new();
        for (cfg, trains) in [
            (&fp32_cfg, sides != Sides::Mixed),
            (&mixed_cfg, sides != Sides::Fp32),
        ] {
            seen.extend(saved_builds(&cfg.out)?);
            if trains {
                seen.push(Provenance::here(crate::Device::Cpu));
            }
        }
        check_one_numerics(&seen)?;
    }
    let fp32_title = format!("float32, full batch of {}", fp32_cfg.batch);
    let mixed_title = format!(
        "{}{}, {} micro-batches of {}, {}",
        recipe_name(&mixed_cfg),
        match &mixed_cfg.cast_policy {
            Some(p) => format!(" (cast policy {})", p.name()),
            None => String::new(),
        },
        mixed_cfg.accum,
        mixed_cfg.micro_batch,
        match mixed_cfg.recompute() {
            crate::recompute::Recompute::Blocks => "checkpointing".to_string(),
            p => format!("recompute {p}"),
        }
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
    let all: Vec<Provenance> = a.builds.iter().chain(&b.builds).cloned().collect();
    if builds == MixedBuilds::Refuse {
        check_one_numerics(&all)?;
    }
    let (ha, hb) = (heldout_loss(&a)?, heldout_loss(&b)?);
    let rel = ((hb - ha) / ha).abs();
    let peaks = |s: &RunSummary| match s.process_peak_bytes {
        Some(p) => format!("peak {} process, {} tensors", mib(p), mib(s.peak_bytes)),
        None => format!("peak {} tensors", mib(s.peak_bytes)),
    };
    let names = [
        format!("float32, full batch ({})", peaks(&a)),
        format!("mixed precision ({})", peaks(&b)),
    ];
    let losses = |s: &RunSummary| -> Vec<(f64, f64)> {
        s.history
            .iter()
            .map(|m| (m.step as f64, m.loss as f64))
            .collect()
    };
    let last = |s: &RunSummary, v: f32| vec![(s.checkpoint_step as f64, v as f64)];
    let heldout = [
        format!("float32 final model, held-out: {ha:.4}"),
        format!("mixed final model, held-out: {hb:.4}"),
    ];
    let curves = Panel {
        y_label: "training loss (nats/byte, log scale)",
        log_y: true,
        height: 320.0,
        series: vec![
            Series {
                name: &names[0],
                color: "#1f77b4",
                points: losses(&a),
                dots: false,
            },
            Series {
                name: &names[1],
                color: "#ff7f0e",
                points: losses(&b),
                dots: false,
            },
            Series {
                name: &heldout[0],
                color: "#1f77b4",
                points: last(&a, ha),
                dots: true,
            },
            Series {
                name: &heldout[1],
                color: "#ff7f0e",
                points: last(&b, hb),
                dots: true,
            },
        ],
        marks: vec![],
        zero_line: false,
    };
    // The milestone is about this difference, too small to see between the curves.
    let diff: Vec<(f64, f64)> = a
        .history
        .iter()
        .zip(&b.history)
        .filter(|(x, y)| x.step == y.step)
        .map(|(x, y)| (x.step as f64, y.loss as f64 - x.loss as f64))
        .collect();
    let difference = Panel {
        y_label: "mixed − float32 (nats/byte)",
        log_y: false,
        height: 160.0,
        series: vec![Series {
            name: "training loss, mixed − float32, per step",
            color: "#2ca02c",
            points: diff,
            dots: false,
        }],
        marks: vec![],
        zero_line: true,
    };
    let plot = out.join("compare.svg");
    let svg = chart_svg(
        &format!(
            "{}: float32 vs {} + accumulation + checkpointing",
            mixed_cfg.preset,
            recipe_name(&mixed_cfg)
        ),
        &[curves, difference],
    );
    crate::train::checkpoint::write_atomic(&out, "compare.svg", svg.as_bytes())?;
    let tol = tolerance(&mixed_cfg);
    let within = rel <= tol;
    // what the machine saw where it says, the crate's tensor bytes otherwise
    let lower = match (machine_peak(&a), machine_peak(&b)) {
        (Some((pa, _)), Some((pb, _))) => pb < pa,
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
        tolerance: tol,
        within_tolerance: within,
        lower_peak: lower,
        pass: within && lower,
        plot: plot.display().to_string(),
        numerics: distinct(&all, numerics_of),
        commits: distinct(&all, commit_of),
    })))
}

fn numerics_of(p: &Provenance) -> String {
    p.numerics.clone().unwrap_or_else(|| "unknown".into())
}

fn commit_of(p: &Provenance) -> String {
    let c = p.commit.as_deref().unwrap_or("no git commit");
    format!("{c}{}", if p.dirty { "+dirty" } else { "" })
}

/// The distinct values of `key` over `builds`, in first-seen order.
fn distinct(builds: &[Provenance], key: fn(&Provenance) -> String) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for k in builds.iter().map(key) {
        if !v.contains(&k) {
            v.push(k);
        }
    }
    v
}

/// The builds recorded in a side's checkpoint (none: no run there yet).
fn saved_builds(out: &std::path::Path) -> Result<Vec<Provenance>> {
    if crate::train::outdir::existing_run(out).is_none() {
        return Ok(Vec::new());
    }
    let dir = crate::train::checkpoint::resolve_dir(out);
    Ok(crate::train::checkpoint::Verified::open(&dir)
        .and_then(|ck| ck.train_state())
        .map_err(|e| e.context(format!("compare --resume: {}", out.display())))?
        .builds)
}

/// An error naming the fingerprints when `builds` do not share one.
fn check_one_numerics(builds: &[Provenance]) -> Result<()> {
    let fps = distinct(builds, numerics_of);
    if fps.len() > 1 {
        let named: Vec<String> = builds
            .iter()
            .map(|p| format!("{} ({})", numerics_of(p), commit_of(p)))
            .collect();
        crate::bail!(
            Config,
            "compare: the sides come from builds whose numerics differ ({}): their losses are not one experiment. Train both sides with one build (--overwrite), or compare them anyway with --allow-mixed-builds",
            distinct_strs(&named).join(", ")
        );
    }
    Ok(())
}

fn distinct_strs(v: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in v {
        if !out.contains(s) {
            out.push(s.clone());
        }
    }
    out
}

/// The memory the machine saw for a side: the GPU's tensor buffers (pool
/// included) on the GPU, the process's resident peak on the CPU.
fn machine_peak(s: &RunSummary) -> Option<(usize, &'static str)> {
    match s.device {
        crate::Device::Gpu => s.device_peak_bytes.map(|b| (b, "device")),
        crate::Device::Cpu | crate::Device::Spec => s.process_peak_bytes.map(|b| (b, "process")),
    }
}

/// A side's config when its directory holds a run: the saved recipe with
/// what `opts` may change ([`TrainConfig::resume`]); else `cfg` as resolved.
fn saved_recipe(cfg: TrainConfig, opts: &TrainOptions) -> Result<TrainConfig> {
    if crate::train::outdir::existing_run(&cfg.out).is_none() {
        return Ok(cfg);
    }
    let dir = crate::train::checkpoint::resolve_dir(&cfg.out);
    let saved = crate::train::checkpoint::Verified::open(&dir)
        .and_then(|ck| ck.train_state())
        .map_err(|e| e.context(format!("compare --resume: {}", cfg.out.display())))?
        .config;
    TrainConfig::resume(&saved, opts).map_err(|e| {
        e.context(format!(
            "compare --resume: the side in {} was trained with another recipe",
            cfg.out.display()
        ))
    })
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
    // Each side's peaks start from what the process holds before it (and
    // without the other side's pooled GPU buffers).
    crate::backend::restart_device_peak();
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
    /// The comparison as text: a Markdown table of both sides (training and
    /// held-out loss, planned, tensor and process peaks), then the relative
    /// difference, the peak memories, the verdict and the plot's path.
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
                    + if s.recompute == "attention" || s.recompute == "both" {
                        ", attn recompute"
                    } else {
                        ""
                    }
            );
            format!(
                "| {:<24} | {:>10.4} | {:>13.4} | {:>12} | {:>12} | {:>12} | {:>12} |\n",
                how,
                s.final_loss,
                s.heldout_loss,
                mib(s.planned_peak_bytes),
                mib(s.measured_peak_bytes),
                opt_mib(s.process_peak_bytes),
                opt_mib(s.device_peak_bytes)
            )
        };
        let mut t = format!(
            "Mixed precision against float32 — preset {}, {} steps, batch {}, seed {}\n\n",
            self.preset, self.steps, self.batch, self.seed
        );
        t += "| run                      | train loss | held-out loss | planned peak | tensor peak  | process peak | device peak  |\n";
        t += "|--------------------------|-----------:|--------------:|-------------:|-------------:|-------------:|-------------:|\n";
        t += &row(&self.fp32);
        t += &row(&self.mixed);
        let (pa, pb, which) = match (
            (self.fp32.device_peak_bytes, self.mixed.device_peak_bytes),
            (self.fp32.process_peak_bytes, self.mixed.process_peak_bytes),
        ) {
            ((Some(a), Some(b)), _) => (a, b, "device"),
            (_, (Some(a), Some(b))) => (a, b, "process"),
            _ => (
                self.fp32.measured_peak_bytes,
                self.mixed.measured_peak_bytes,
                "tensor",
            ),
        };
        t +=
            &format!(
            "\n(train loss: mean of the last steps in each run's own precision; held-out loss: \
             both final models in float32 on the same held-out windows; device peak: the GPU's \
             tensor buffers, pooled ones included)\n\
             relative difference of held-out losses: {:.2}% ({} {:.0}%)\n\
             {which} peak memory: {} → {} ({})\nbuilds: {}\nverdict: {}\nplot: {}\n",
            100.0 * self.rel_diff,
            if self.within_tolerance { "within" } else { "NOT within" },
            100.0 * self.tolerance,
            mib(pa),
            mib(pb),
            if self.lower_peak { "lower" } else { "NOT lower" },
            self.builds_line(),
            if self.pass { "PASS" } else { "FAIL" },
            self.plot
        );
        t
    }

    /// Which builds trained the two sides, as the report says it.
    fn builds_line(&self) -> String {
        match (self.numerics.as_slice(), self.commits.as_slice()) {
            ([n], [c]) if !c.ends_with("+dirty") && c != "no git commit" => {
                format!("one build of the same code, commit {c} (numerics {n})")
            }
            ([n], cs) => format!("one numerics fingerprint {n}, over builds {}", cs.join(", ")),
            (ns, cs) => format!(
                "{} numerics fingerprints ({}) over builds {}: compared as asked (--allow-mixed-builds)",
                ns.len(),
                ns.join(", "),
                cs.join(", ")
            ),
        }
    }
}
