//! The training loop. One optimizer step reads top to bottom:
//!
//! ```text
//! batch  = data.sample_batch(data_rng, B)          the same rows however it is split
//! micro  = batch.split(micro_batch)                k micro-batches, weights n_i / N
//! lr     = schedule(step)
//! report = MixedStep { precision, scaler, clip, cast_policy }.run(model, micro, loss, opt)
//!            zero grads → for each micro-batch: forward under autocast (blocks
//!            checkpointed), loss · n_i/N (· S), backward → unscale (fp16) →
//!            clip → AdamW step (or skip and back off)
//! ```
//!
//! [`run`] wraps it in the loop of a whole run: admit the run (its output
//! directory, its memory), then per step train, watch for divergence,
//! evaluate, record and save on their cadences, and stop cleanly on Ctrl-C.

use crate::backend::Device;
use crate::memory;
use crate::nn::llama::Llama;
use crate::nn::Module;
use crate::ops::cross_entropy;
use crate::optim::{AdamW, AdamWConfig, Optimizer};
use crate::precision::{
    autocast, fp8_scope, CastPolicy, DelayedScaling, DynamicLossScaler, Precision,
};
use crate::rng::Generator;
use crate::train::bar::duration;
use crate::train::checkpoint::{self, TrainState, Verified};
use crate::train::config::{DeviceChoice, TrainConfig};
use crate::train::data::{Batch, Corpus, Dataset};
use crate::train::fault::{self, LossHook};
use crate::train::infer::{self, EvalMode};
use crate::train::interrupt;
use crate::train::metrics::{MetricsLog, StepMetrics};
use crate::train::outdir::{self, DirLock};
use crate::train::plan::{self, mib, MemoryPlan};
use crate::train::plot::{chart_svg, Panel, Series};
use crate::train::provenance::Provenance;
use crate::train::step::MixedStep;
use crate::{bail, Error, Result, Tensor};
use std::cell::RefCell;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

/// Picks the device for `choice`: `auto` takes the GPU when an adapter exists
/// and falls back to the CPU with a one-line note; `gpu` without one is an error.
pub fn select_device(choice: DeviceChoice) -> Result<(Device, Option<String>)> {
    match choice {
        DeviceChoice::Cpu => Ok((Device::Cpu, None)),
        DeviceChoice::Spec => Ok((
            Device::Spec,
            Some("device: the executable spec (every primitive as its contract states it; slow)".into()),
        )),
        DeviceChoice::Gpu => match crate::backend::adapter_name() {
            Ok(name) => Ok((Device::Gpu, Some(format!("device: GPU {name}")))),
            Err(e) => bail!(Device, "--device gpu: no GPU adapter is available ({e}); use --device cpu or auto"),
        },
        DeviceChoice::Auto => match crate::backend::adapter_name() {
            // A software adapter (Mesa's lavapipe, SwiftShader) runs the same
            // kernels on the CPU, far slower than the CPU reference itself.
            Ok(name) if is_software_adapter() => Ok((
                Device::Cpu,
                Some(format!("device: only a software GPU adapter ({name}); training on the CPU (--device gpu forces it)")),
            )),
            Ok(name) => Ok((Device::Gpu, Some(format!("device: GPU {name}")))),
            Err(e) => Ok((Device::Cpu, Some(format!("device: no GPU adapter ({e}); training on the CPU")))),
        },
    }
}

/// Whether the GPU backend's adapter is a CPU-based software implementation.
fn is_software_adapter() -> bool {
    #[cfg(feature = "gpu")]
    return crate::gpu::adapter().is_ok_and(|a| a.software);
    #[cfg(not(feature = "gpu"))]
    false
}

/// A run in progress: model, optimizer, scaler, data and their positions.
pub struct Trainer {
    /// The run's resolved config.
    pub(crate) cfg: TrainConfig,
    /// The device the model and optimizer state live on.
    pub(crate) device: Device,
    /// The model being trained (its float32 master weights).
    pub(crate) model: Llama,
    /// AdamW over the model's parameters.
    pub(crate) opt: AdamW,
    /// The dynamic loss scaler, for fp16 runs only (`None` otherwise).
    pub(crate) scaler: Option<DynamicLossScaler>,
    /// The fp8 recipe's delayed scales, for `--fp8` runs only.
    pub(crate) fp8: Option<Rc<RefCell<DelayedScaling>>>,
    /// The corpus, split into training and validation pieces.
    pub(crate) data: Dataset,
    /// The batch-order stream: its state is the data position.
    pub(crate) data_rng: Generator,
    /// The corpus's name: `embedded` or its path.
    pub(crate) corpus_name: String,
    /// The corpus's SHA-256 (hex), saved in every checkpoint.
    pub(crate) fingerprint: String,
    /// Optimizer steps taken so far.
    pub(crate) step: usize,
    /// The planned memory of one step.
    pub(crate) plan: MemoryPlan,
    /// Applied to the first micro-batch's loss of every step: the test-only
    /// faults of `train::fault` (`None` unless `TINYLLM_FAULT` arms one).
    pub(crate) loss_hook: Option<LossHook>,
    /// The last step's batch (to tell why its loss was not finite).
    last_batch: Option<Batch>,
    /// The run's identity: drawn when it starts, kept by its resumes in its
    /// own directory, written into every checkpoint and metrics line.
    run_id: String,
    /// The build and device of every process of the run, this one last.
    builds: Vec<Provenance>,
}

/// What a run holds, to read (and the optimizer, to adjust between steps).
impl Trainer {
    /// The run's resolved config.
    pub fn config(&self) -> &TrainConfig {
        &self.cfg
    }
    /// The device the model and optimizer state live on.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The model being trained (its float32 master weights).
    pub fn model(&self) -> &Llama {
        &self.model
    }
    /// AdamW over the model's parameters.
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }
    /// AdamW, to change its settings or state between steps.
    pub fn optimizer_mut(&mut self) -> &mut AdamW {
        &mut self.opt
    }
    /// The model and its optimizer at once (restoring a checkpoint into them).
    pub fn model_and_optimizer_mut(&mut self) -> (&Llama, &mut AdamW) {
        (&self.model, &mut self.opt)
    }
    /// The dynamic loss scaler, for fp16 runs only.
    pub fn scaler(&self) -> Option<&DynamicLossScaler> {
        self.scaler.as_ref()
    }
    /// The corpus, split into training and validation pieces.
    pub fn data(&self) -> &Dataset {
        &self.data
    }
    /// The batch-order stream: its state is the data position.
    pub fn data_rng(&self) -> &Generator {
        &self.data_rng
    }
    /// Optimizer steps taken so far.
    pub fn step(&self) -> usize {
        self.step
    }
    /// The planned memory of one step.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }
}

impl Trainer {
    /// A fresh run on `device` over `corpus`.
    pub fn new(cfg: TrainConfig, device: Device, corpus: &Corpus) -> Result<Trainer> {
        let data = Dataset::new(corpus, cfg.model.context, cfg.seed)?;
        let model = Llama::new(&cfg.model, cfg.seed, device)?
            .with_recompute(cfg.ckpt_budget)
            .map_err(|e| e.context("--ckpt-budget"))?
            .with_attention_recompute(cfg.recompute_attention);
        let opt = AdamW::new(
            model.parameters(),
            AdamWConfig {
                weight_decay: cfg.weight_decay,
                ..AdamWConfig::new(cfg.lr)
            },
        )?;
        let scaler = (cfg.precision == Precision::Fp16).then(DynamicLossScaler::default);
        let fp8 = match cfg.fp8 {
            Some(c) => Some(Rc::new(RefCell::new(DelayedScaling::new(c)?))),
            None => None,
        };
        let plan = cfg.memory_plan()?;
        Ok(Trainer {
            data_rng: cfg.data_order(),
            cfg,
            device,
            model,
            opt,
            scaler,
            fp8,
            data,
            corpus_name: corpus.name.clone(),
            fingerprint: corpus.fingerprint.clone(),
            step: 0,
            plan,
            loss_hook: fault::loss_hook(),
            last_batch: None,
            run_id: outdir::new_run_id(),
            builds: vec![Provenance::here(device)],
        })
    }

    /// Continues the run saved in `dir` with `cfg` (the saved config with the
    /// overrides a resume allows). The corpus must be the one it was trained
    /// on: the same text by its SHA-256, wherever it lies now.
    pub fn resume(
        cfg: TrainConfig,
        device: Device,
        corpus: &Corpus,
        dir: &Path,
    ) -> Result<Trainer> {
        let ck = Verified::open(dir)?;
        let st = ck.train_state()?;
        if st.data_fingerprint != corpus.fingerprint {
            bail!(
                Config,
                "--resume {}: the checkpoint was trained on {} (SHA-256 {}), not on {} ({}); give --data the text it was trained on",
                dir.display(),
                st.data_name,
                st.data_fingerprint,
                corpus.name,
                corpus.fingerprint
            );
        }
        let mut t = Trainer::new(cfg, device, corpus)?;
        let st = checkpoint::restore(&ck, &t.model, &mut t.opt)?;
        let state_file = || format!("{}/{}", ck.dir.display(), checkpoint::STATE_FILE);
        match (&mut t.scaler, &st.scaler) {
            (Some(s), Some(saved)) => s
                .load_state_dict(saved)
                .map_err(|e| e.context(state_file()))?,
            (None, None) => {}
            (Some(_), None) if st.config.precision == Precision::Fp16 => bail!(
                Checkpoint,
                "{}: an fp16 run's state has no \"scaler\" entry (the loss scaler's scale and counters); the checkpoint is incomplete",
                state_file()
            ),
            _ => bail!(
                Config,
                "--resume: the checkpoint's precision ({}) differs from this run's",
                st.config.precision.name()
            ),
        }
        match (&t.fp8, &st.fp8) {
            (Some(r), Some(saved)) => {
                *r.borrow_mut() =
                    DelayedScaling::from_state(saved).map_err(|e| e.context(state_file()))?
            }
            (None, None) => {}
            (Some(_), None) => bail!(
                Checkpoint,
                "{}: an fp8 run's state has no \"fp8\" entry (the amax histories and scales); the checkpoint is incomplete",
                state_file()
            ),
            (None, Some(_)) => bail!(
                Config,
                "--resume: the checkpoint is an fp8 run's; this run is not"
            ),
        }
        if !st.run_id.is_empty() {
            t.run_id = st.run_id.clone();
        }
        t.builds = st.builds.iter().cloned().chain(t.builds).collect();
        t.model.rng.set_state(st.model_rng);
        t.data_rng.set_state(st.data_rng);
        t.step = st.step;
        // The rate of the last step taken (the next step sets its own).
        t.opt.set_lr(t.cfg.lr_after(t.step));
        Ok(t)
    }

    /// The state a checkpoint records.
    pub fn state(&self) -> TrainState {
        TrainState {
            format: checkpoint::FORMAT.into(),
            step: self.step,
            config: self.cfg.clone(),
            scaler: self.scaler.as_ref().map(|s| s.state_dict()),
            fp8: self.fp8.as_ref().map(|r| r.borrow().state()),
            model_rng: self.model.rng.state(),
            data_rng: self.data_rng.state(),
            adam_steps: (0..self.model.parameters().len())
                .map(|i| self.opt.state(i).map(|s| s.2))
                .collect(),
            data_name: self.corpus_name.clone(),
            data_fingerprint: self.fingerprint.clone(),
            run_id: self.run_id.clone(),
            builds: self.builds.clone(),
        }
    }

    /// The run's identity (see [`TrainState::run_id`]).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Writes `run_dir/checkpoint/`.
    pub fn save(&self, run_dir: &Path) -> Result<PathBuf> {
        checkpoint::save(run_dir, &self.model, &self.opt, &self.state())
    }

    /// One optimizer step (see the module docs). Returns its metrics (no
    /// validation loss); `peak_bytes` is this step's measured peak.
    pub fn train_step(&mut self) -> Result<StepMetrics> {
        let t0 = Instant::now();
        memory::reset_peak();
        let step = self.step + 1;
        let batch = self.data.sample_batch(&self.data_rng, self.cfg.batch);
        let micro = batch.split(self.cfg.micro_batch);
        let lr = self.cfg.lr_at(step);
        self.opt.set_lr(lr);
        let (model, hook) = (&self.model, self.loss_hook);
        let mut first = true;
        let settings = MixedStep {
            precision: self.cfg.precision,
            scaler: self.scaler.as_mut(),
            clip: self.cfg.clip,
            cast_policy: self.cfg.cast_policy.as_ref().map(CastPolicy::table),
            fp8: self.fp8.clone(),
        };
        let report = settings.run(
            model,
            &micro,
            |mb: &Batch| {
                let hook = hook.filter(|_| std::mem::take(&mut first));
                micro_loss(model, mb, hook.map(|h| (h, step)))
            },
            &mut self.opt,
        );
        self.last_batch = Some(batch);
        if report.is_err() {
            // No step was taken: the optimizer keeps the last step's rate.
            self.opt.set_lr(self.cfg.lr_after(self.step));
        }
        let report = report?;
        self.step = step;
        let secs = t0.elapsed().as_secs_f64().max(1e-9);
        let phases = memory::phase_peaks();
        Ok(StepMetrics {
            step,
            loss: report.loss,
            val_loss: None,
            lr,
            scale: report.scale,
            skipped: report.skipped,
            grad_norm: report.grad_norm,
            fp8_saturated: report.fp8_saturated,
            tokens_per_s: self.cfg.tokens_per_step() as f64 / secs,
            peak_bytes: memory::peak_bytes(),
            forward_peak_bytes: Some(phases.forward),
            backward_peak_bytes: Some(phases.backward),
            tokens: step * self.cfg.tokens_per_step(),
            elapsed_s: 0.0, // the run loop knows the run's clock
            process_peak_bytes: memory::process_peak_rss(),
            device_peak_bytes: crate::backend::device_peak_bytes(self.device),
            resumed: false, // the run loop knows where it started
            run: Some(self.run_id.clone()),
            provenance: None, // the run loop knows where its process started
        })
    }

    /// Validation loss on the held-out windows, under the run's cast policy.
    pub fn evaluate(&self) -> Result<f32> {
        let b = self.data.val_batch(self.cfg.eval_rows);
        // an fp8 run is evaluated in fp8, at its current scales (an
        // evaluation records no amaxes)
        let _fp8 = self.fp8.as_ref().map(fp8_scope);
        infer::evaluate_under(
            &self.model,
            &b,
            self.cfg.cast_table(),
            self.cfg.micro_batch.max(8),
        )
    }

    /// Why the last step's loss was not finite, from the same batch's first
    /// micro-batch in float32 (dropout off): finite there, the run's 16-bit
    /// forward pass overflowed; not finite, the model (or the loss) itself is.
    pub fn explain_non_finite(&self) -> String {
        let Some(batch) = &self.last_batch else {
            return String::new();
        };
        let mb = &batch.split(self.cfg.micro_batch)[0];
        let f32_loss = (|| -> Result<f64> {
            let _ng = crate::no_grad();
            let _ac = autocast(None);
            let _eval = EvalMode::new(&self.model);
            let hook = self.loss_hook.map(|h| (h, self.step.max(1)));
            micro_loss(&self.model, mb, hook)?.item()
        })();
        match (self.cfg.precision, f32_loss) {
            (_, Err(e)) => format!("(the float32 check failed: {e})"),
            (Precision::Fp16, Ok(l)) if l.is_finite() => format!(
                "the same batch has a finite loss in float32 ({l:.4}), so the fp16 forward pass overflows (values beyond fp16's largest, 65504); a loss scale cannot help, it only scales the backward pass: train with --bf16, or a lower --lr"
            ),
            (_, Ok(l)) if l.is_finite() => format!(
                "the same batch has a finite loss in float32 ({l:.4}): the {} forward pass loses it",
                self.cfg.precision.name()
            ),
            (_, Ok(l)) => format!(
                "the loss of the same batch is {l} in float32 too: the model itself gives a non-finite loss (weights grown too large: a lower --lr), not a rounding or range problem"
            ),
        }
    }

    /// All parameter and moment values (for bit-for-bit comparisons).
    pub fn snapshot(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let mut out = Vec::new();
        for (i, (n, p)) in self.model.named_parameters().into_iter().enumerate() {
            out.push((n.clone(), p.to_vec_f32()?));
            if let Some((m, v, k)) = self.opt.state(i) {
                out.push((format!("{n}.exp_avg"), m.to_vec_f32()?));
                out.push((format!("{n}.exp_avg_sq"), v.to_vec_f32()?));
                out.push((format!("{n}.step"), vec![*k as f32]));
            }
        }
        Ok(out)
    }
}

/// One micro-batch's cross-entropy, through `hook` (a test fault, with its
/// step) when one is given.
fn micro_loss(model: &Llama, mb: &Batch, hook: Option<(LossHook, usize)>) -> Result<Tensor> {
    let logits = model.forward(&mb.ids, mb.rows, mb.t)?;
    let loss = {
        let _traced = crate::trace::path("loss");
        cross_entropy(&logits, &mb.targets)?
    };
    match hook {
        Some((hook, step)) => hook(model, loss, step),
        None => Ok(loss),
    }
}

/// How a run reports progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// A progress bar when stderr is a terminal, plain lines otherwise.
    Auto,
    /// Plain log lines.
    Lines,
    /// Only errors.
    Quiet,
}

/// How a run starts in its output directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start<'a> {
    /// A new run; refused when the directory already holds one.
    Fresh,
    /// A new run that first deletes the run the directory holds (tinyllm's
    /// checkpoints, metrics and plot; nothing else).
    Overwrite,
    /// Continues the run saved in this directory.
    Resume(&'a Path),
}

/// What a run reports when it returns (finished or interrupted).
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// The run's output directory.
    pub out: PathBuf,
    /// The run's last checkpoint (`None`: interrupted before it wrote one).
    pub checkpoint: Option<PathBuf>,
    /// The step that checkpoint holds.
    pub checkpoint_step: usize,
    /// The signal (SIGINT, SIGTERM, SIGHUP) that stopped the run before `cfg.steps`.
    pub interrupted: Option<i32>,
    /// Every step's metrics, a resumed run's earlier steps included.
    pub history: Vec<StepMetrics>,
    /// Mean training loss of the last few steps (min(10, steps/5) but at least 1).
    pub final_loss: f32,
    /// The last step's validation loss, if that step evaluated.
    pub final_val_loss: Option<f32>,
    /// The planned memory of one step.
    pub plan: MemoryPlan,
    /// The highest measured peak of any step (tensor bytes, [`crate::memory`]).
    pub peak_bytes: usize,
    /// The process's resident high-water mark through the training steps
    /// and their validation (since the process started, or since
    /// [`memory::restart_process_peak`]), the largest over the run's
    /// processes when it was resumed; `None` where the platform does not
    /// say. Saving checkpoints is not in it.
    pub process_peak_bytes: Option<usize>,
    /// On the GPU: the peak bytes of its tensor buffers, pooled ones
    /// included (what the device held; since the last
    /// [`restart_device_peak`](crate::gpu::restart_device_peak)), the
    /// largest over the run's processes.
    pub device_peak_bytes: Option<usize>,
    /// Wall-clock seconds of the whole run, summed over its resumes (the
    /// time between an interruption and its resume not counted).
    pub seconds: f64,
    /// The device the run trained on (from [`finished_run`]: the device its
    /// config selects now).
    pub device: Device,
    /// The build and device of every process of the run, oldest first (its
    /// start and each resume).
    pub builds: Vec<Provenance>,
}

/// Mean of the last few losses (the compare table's "final loss").
pub fn tail_mean(losses: &[f32]) -> f32 {
    let n = (losses.len() / 5).clamp(1, 10).min(losses.len().max(1));
    let tail = &losses[losses.len().saturating_sub(n)..];
    (tail.iter().map(|&x| x as f64).sum::<f64>() / tail.len().max(1) as f64) as f32
}

/// Writes `out/loss.svg` from the history.
pub fn write_plot(out: &Path, title: &str, history: &[StepMetrics]) -> Result<()> {
    let train = Series {
        name: "training loss (the batch, in the run's precision)",
        color: "#1f77b4",
        points: history
            .iter()
            .map(|m| (m.step as f64, m.loss as f64))
            .collect(),
        dots: false,
    };
    let val = Series {
        name: "validation loss (held-out windows)",
        color: "#d62728",
        points: history
            .iter()
            .filter_map(|m| m.val_loss.map(|v| (m.step as f64, v as f64)))
            .collect(),
        dots: true,
    };
    let panel = Panel {
        y_label: "loss (nats/byte, log scale)",
        log_y: true,
        height: 340.0,
        series: vec![train, val],
        marks: resume_marks(history),
        zero_line: false,
    };
    checkpoint::write_atomic(
        out,
        outdir::PLOT_FILE,
        chart_svg(title, &[panel]).as_bytes(),
    )
}

/// A mark at each checkpoint a run was resumed from.
pub fn resume_marks(history: &[StepMetrics]) -> Vec<(f64, String)> {
    history
        .iter()
        .filter(|m| m.resumed)
        .map(|m| ((m.step - 1) as f64, format!("resumed at {}", m.step - 1)))
        .collect()
}

/// One line on stderr unless quiet. A closed or full stderr is not an error:
/// the run goes on (its metrics and checkpoints are its record).
pub(crate) fn say(progress: Progress, msg: &str) {
    if progress != Progress::Quiet {
        let _ = writeln!(std::io::stderr(), "{msg}");
    }
}

/// fp16 steps skipped in a row, and how many of them, in a row at the end,
/// had a non-finite loss.
#[derive(Clone, Copy, Debug, Default)]
struct Skips {
    /// The first step of the current run of skipped steps.
    since: Option<usize>,
    non_finite_losses: usize,
}

impl Skips {
    fn update(&mut self, m: &StepMetrics) {
        if m.skipped {
            self.since.get_or_insert(m.step);
            self.non_finite_losses = if m.loss.is_finite() {
                0
            } else {
                self.non_finite_losses + 1
            };
        } else {
            *self = Skips::default();
        }
    }
}

/// Non-finite losses in a row that end an fp16 run. One overflowing batch is
/// skipped like any overflow; a forward pass that overflows batch after batch
/// is a diverged model, which no loss scale can bring back.
pub const MAX_NON_FINITE_LOSSES: usize = 5;

/// Work done around chosen steps of a run, outside the step itself (and its
/// timing and profile): the cross-check's CPU replay of a GPU step
/// (`crosscheck::lockstep::Replay`, `tinyllm train --crosscheck-every K`).
pub trait StepCheck {
    /// Once, before the first step, with the run's trainer: a check that
    /// cannot work on this run says so here, not steps later.
    fn begin(&mut self, _tr: &Trainer) -> Result<()> {
        Ok(())
    }
    /// Whether optimizer step `step` (1-based) is checked.
    fn wants(&self, step: usize) -> bool;
    /// Before a checked step, with the trainer in the state it starts from.
    fn before(&mut self, tr: &Trainer) -> Result<()>;
    /// After it; an error stops the run (the step's metrics are still logged).
    fn after(&mut self, tr: &Trainer, m: &StepMetrics) -> Result<()>;
}

/// Runs (or continues) a training run to `cfg.steps`, writing metrics, plot
/// and checkpoints under `cfg.out`, which it holds locked for the whole run.
/// On SIGINT/SIGTERM/SIGHUP (once `interrupt::install`ed) it finishes the current
/// step, saves, and returns a summary saying so.
///
/// Train the `tiny` Llama for a few steps in bf16, then load its checkpoint
/// and evaluate it on the run's held-out windows:
///
/// ```
/// use tinyllm::train::{checkpoint, infer, run, Progress, Start, TrainConfig, TrainOptions};
/// use tinyllm::Device;
///
/// let out = std::env::temp_dir().join(format!("tinyllm-doc-run-{}", std::process::id()));
/// let cfg = TrainConfig::resolve(&TrainOptions {
///     preset: Some("tiny".into()),
///     device: Some(tinyllm::train::DeviceChoice::Cpu),
///     steps: Some(6),
///     out: Some(out.clone()),
///     ..Default::default()
/// })?;
/// let summary = run(cfg, Start::Overwrite, Progress::Quiet)?;
/// assert_eq!(summary.checkpoint_step, 6);
/// assert!(summary.history[5].loss < summary.history[0].loss);
///
/// let model = checkpoint::load_model(&out, Device::Cpu)?; // out/checkpoint
/// assert_eq!(model.cfg.context, 16);
/// let held_out = infer::heldout(&out, Device::Cpu, None)?;
/// assert!(held_out.loss.is_finite() && held_out.windows > 0);
/// # std::fs::remove_dir_all(&out).ok();
/// # Ok::<(), tinyllm::Error>(())
/// ```
pub fn run(cfg: TrainConfig, start: Start, progress: Progress) -> Result<RunSummary> {
    run_checked(cfg, start, progress, None)
}

/// [`run`] with a [`StepCheck`] around the steps it wants.
pub fn run_checked(
    cfg: TrainConfig,
    start: Start,
    progress: Progress,
    mut check: Option<&mut dyn StepCheck>,
) -> Result<RunSummary> {
    let t_start = Instant::now();
    // A profile the caller started (`tinyllm train --profile`) sees the
    // training steps only: everything else here is paused.
    let _not_profiled = crate::profile::pause();
    // The files first: a missing --data is reported before any device probe.
    let corpus = Corpus::load(cfg.data.as_ref()).map_err(|e| match (start, &cfg.data) {
        (Start::Resume(_), Some(p)) if !p.exists() => e.context(format!(
            "the run was trained on {}, which is no longer there; if it moved, give --data with its new path (the text is recognised by its SHA-256)",
            p.display()
        )),
        _ => e,
    })?;
    let (device, note) = select_device(cfg.device)?;
    if let Some(n) = note {
        say(progress, &n);
    }
    let _lock = DirLock::acquire(&cfg.out)?;
    let own = prepare_out(&cfg, start)?;
    for limit in plan::memory_limits(device)? {
        plan::admit(&cfg, limit)?;
    }
    let mut tr = match start {
        Start::Resume(dir) => {
            let mut tr = Trainer::resume(cfg.clone(), device, &corpus, dir)?;
            if own {
                check_same_run(&cfg.out, &tr)?;
            } else {
                // A checkpoint continued in another directory is a new run.
                tr.run_id = outdir::new_run_id();
            }
            tr
        }
        _ => Trainer::new(cfg.clone(), device, &corpus)?,
    };
    // Everything that can refuse the run has passed: only now is the old
    // one deleted.
    if start == Start::Overwrite {
        outdir::clear_run(&cfg.out)?;
    }
    describe_run(&tr, &corpus, start, progress);
    if tr.step >= cfg.steps {
        // Resuming a finished run to its own length is done already: say so
        // and report it, as a run that was never interrupted would have.
        if own && tr.step == cfg.steps {
            if let Some(done) = finished_run(&cfg)? {
                let (s, steps) = (tr.step, cfg.steps);
                say(progress, &format!("the run already finished at step {s} of {steps}: nothing to do (a larger --steps extends it)"));
                return Ok(done);
            }
        }
        bail!(
            Config,
            "the run is already at step {} of {}: give a larger --steps to continue it",
            tr.step,
            cfg.steps
        );
    }
    if let Some(c) = check.as_deref_mut() {
        c.begin(&tr)?;
    }
    let mut lp = Loop::new(&tr, start, progress)?;
    let interrupted = loop {
        if let Some(sig) = interrupt::requested() {
            break Some(sig);
        }
        if tr.step >= cfg.steps {
            break None;
        }
        lp.step(&mut tr, check.as_deref_mut())?;
    };
    if interrupted.is_some() {
        lp.save_on_interrupt(&tr)?;
    }
    Ok(lp.finish(tr, interrupted, device, t_start))
}

/// The summary of the finished run in `cfg.out` (its checkpoint holds step
/// `cfg.steps` or later), rebuilt from that checkpoint and `metrics.jsonl`;
/// `None` when the directory holds no run or one that has not finished.
/// The process peak is the largest any of the run's processes reported.
pub fn finished_run(cfg: &TrainConfig) -> Result<Option<RunSummary>> {
    if outdir::existing_run(&cfg.out).is_none() {
        return Ok(None);
    }
    let dir = checkpoint::resolve_dir(&cfg.out);
    let Ok(ck) = Verified::open(&dir) else {
        return Ok(None);
    };
    let state = ck.train_state()?;
    let step = state.step;
    if step < cfg.steps {
        return Ok(None);
    }
    let history: Vec<StepMetrics> = MetricsLog::read(&cfg.out.join("metrics.jsonl"))?
        .into_iter()
        .filter(|m| m.step <= step)
        .collect();
    let losses: Vec<f32> = history.iter().map(|m| m.loss).collect();
    let (device, _) = select_device(cfg.device)?;
    Ok(Some(RunSummary {
        out: cfg.out.clone(),
        checkpoint: Some(dir),
        checkpoint_step: step,
        interrupted: None,
        final_loss: tail_mean(&losses),
        final_val_loss: history.last().and_then(|m| m.val_loss),
        plan: cfg.memory_plan()?,
        peak_bytes: history.iter().map(|m| m.peak_bytes).max().unwrap_or(0),
        process_peak_bytes: history.iter().filter_map(|m| m.process_peak_bytes).max(),
        device_peak_bytes: history.iter().filter_map(|m| m.device_peak_bytes).max(),
        seconds: history.last().map_or(0.0, |m| m.elapsed_s),
        device,
        history,
        builds: state.builds,
    }))
}

/// Checks the output directory before anything is written to it: not inside
/// a checkpoint, nothing there that is not tinyllm's under the names a run
/// writes, no earlier run unless it is the one resumed or is to be
/// overwritten. Returns whether a resume continues the directory's own run
/// (its checkpoint is the directory's current one); a resume of any other
/// checkpoint is a new run and needs a directory without one.
fn prepare_out(cfg: &TrainConfig, start: Start) -> Result<bool> {
    let out = &cfg.out;
    outdir::check_not_in_checkpoint(out)?;
    outdir::check_no_foreign(out)?;
    let resumed = match start {
        Start::Fresh => None,
        Start::Overwrite => return Ok(false),
        Start::Resume(dir) => Some(checkpoint::resolve_dir(dir)),
    };
    let canon = |p: &Path| p.canonicalize().ok();
    let current = checkpoint::resolve_dir(out);
    let own = resumed
        .as_deref()
        .is_some_and(|ck| canon(ck).is_some() && canon(ck) == canon(&current));
    if let Some(what) = outdir::existing_run(out).filter(|_| !own) {
        let quoted = shell_quote(&out.display().to_string());
        if let Some(ck) = &resumed {
            bail!(Config,
                "--out {} already holds a run ({what}), and --resume {} is not its current checkpoint: continuing that one there would replace the run. Continue it as a new run with --out NEW_DIR, or continue the run in {} with `tinyllm train --resume {quoted} --steps N`",
                out.display(),
                ck.display(),
                out.display()
            );
        }
        bail!(Config,
            "--out {} already holds a run ({what}): continue it with `tinyllm train --resume {quoted} --steps N`, replace it with --overwrite, or give another --out",
            out.display()
        );
    }
    Ok(own)
}

/// Refuses a checkpoint that belongs to another run than the metrics beside
/// it (a checkpoint directory copied in from elsewhere): continuing it would
/// splice two runs' histories.
fn check_same_run(out: &Path, tr: &Trainer) -> Result<()> {
    let path = out.join(outdir::METRICS_FILE);
    let Ok(history) = MetricsLog::read(&path) else {
        return Ok(());
    };
    let logged = history.iter().rev().find_map(|m| m.run.clone());
    match logged {
        Some(id) if id != tr.run_id => bail!(Config,
            "{}/checkpoint belongs to run {} but {} to run {id}: the checkpoint was copied in from another run. Continue it as a run of its own with --out NEW_DIR, or move it back",
            out.display(),
            tr.run_id,
            path.display()
        ),
        _ => Ok(()),
    }
}

fn describe_run(tr: &Trainer, corpus: &Corpus, start: Start, progress: Progress) {
    let cfg = &tr.cfg;
    say(progress, &cfg.describe());
    say(
        progress,
        &format!(
            "data: {} ({} bytes; {} training and {} validation pieces)",
            corpus.name,
            corpus.tokens.len(),
            tr.data.train.len(),
            tr.data.val.len()
        ),
    );
    say(progress, &tr.plan.describe(cfg, cfg.model.context));
    if let Start::Resume(dir) = start {
        say(
            progress,
            &format!("resumed at step {} from {}", tr.step, dir.display()),
        );
    }
}

/// The loop's state beside the trainer: what was reported and saved.
struct Loop {
    /// When this process's part of the run began, and the run's seconds
    /// before it (from the metrics of the run it resumes).
    clock: (Instant, f64),
    /// The step this process started from (the ETA counts its own steps).
    first_step: usize,
    out: PathBuf,
    progress: Progress,
    log: MetricsLog,
    history: Vec<StepMetrics>,
    /// The last checkpoint written (or resumed from) and its step.
    last_saved: Option<(PathBuf, usize)>,
    skips: Skips,
    bar: Option<crate::train::bar::Bar>,
    log_every: usize,
    peak: usize,
    plot_failed: bool,
}

impl Loop {
    fn new(tr: &Trainer, start: Start, progress: Progress) -> Result<Loop> {
        let log = MetricsLog::open(&tr.cfg.out, tr.step)?;
        let history = if tr.step > 0 {
            MetricsLog::read(log.path()).unwrap_or_default()
        } else {
            vec![]
        };
        let last_saved = match start {
            Start::Resume(d) => Some((checkpoint::resolve_dir(d), tr.step)),
            _ => None,
        };
        let steps = tr.cfg.steps;
        let bar = (progress == Progress::Auto && std::io::stderr().is_terminal())
            .then(|| crate::train::bar::Bar::new(steps as u64, tr.step as u64));
        let elapsed_before = history.last().map_or(0.0, |m: &StepMetrics| m.elapsed_s);
        Ok(Loop {
            clock: (Instant::now(), elapsed_before),
            first_step: tr.step,
            out: tr.cfg.out.clone(),
            progress,
            log,
            history,
            last_saved,
            skips: Skips::default(),
            bar,
            log_every: (steps / 20).max(1),
            peak: 0,
            plot_failed: false,
        })
    }

    /// One step of the run: train (checked, when asked), watch, evaluate,
    /// record, save.
    fn step<'c>(
        &mut self,
        tr: &mut Trainer,
        check: Option<&mut (dyn StepCheck + 'c)>,
    ) -> Result<()> {
        let step = tr.step + 1;
        let mut check = check.filter(|c| c.wants(step));
        if let Some(c) = check.as_deref_mut() {
            c.before(tr).map_err(|e| self.stopped(step, e))?;
        }
        // A profile leaves out this process's first step when more follow:
        // it touches the step's memory for the first time (and a GPU builds
        // its pipelines), which no later step repeats.
        let warm_up = step == self.first_step + 1 && step < tr.cfg.steps;
        let t0 = Instant::now();
        let mut m = {
            let _profiled = (!warm_up).then(crate::profile::step);
            tr.train_step()
        }
        .map_err(|e| self.stopped(step, e))?;
        if warm_up {
            crate::profile::leave_out(t0.elapsed());
        }
        m.elapsed_s = self.clock.1 + self.clock.0.elapsed().as_secs_f64();
        m.resumed = self.first_step > 0 && step == self.first_step + 1;
        if step == self.first_step + 1 {
            m.provenance = tr.builds.last().cloned();
        }
        if let Some(c) = check {
            if let Err(e) = c.after(tr, &m) {
                let _ = self.log.append(&m);
                return Err(self.stopped(step, e));
            }
        }
        self.peak = self.peak.max(m.peak_bytes);
        self.skips.update(&m);
        let watched = self.watch(tr, &m).and_then(|()| {
            if self.eval_due(tr) {
                m.val_loss = Some(self.validation_loss(tr)?);
                // the step's peaks include its validation
                m.process_peak_bytes = memory::process_peak_rss();
                m.device_peak_bytes = crate::backend::device_peak_bytes(tr.device);
            }
            Ok(())
        });
        if let Err(e) = watched {
            // The step that stops the run is in the metrics too (best effort).
            let _ = self.log.append(&m);
            return Err(e);
        }
        self.record(tr, m)?;
        if self.save_due(tr) {
            self.save(tr)?;
        }
        Ok(())
    }

    /// Ends an fp16 run whose losses stay non-finite (see
    /// [`MAX_NON_FINITE_LOSSES`]), or that ends on one.
    fn watch(&self, tr: &Trainer, m: &StepMetrics) -> Result<()> {
        let n = self.skips.non_finite_losses;
        if n == 0 || (n < MAX_NON_FINITE_LOSSES && tr.step < tr.cfg.steps) {
            return Ok(());
        }
        let first = m.step + 1 - n;
        let what = if n == 1 {
            format!("the loss of the last step is {}", m.loss)
        } else {
            format!(
                "the loss was non-finite on {n} steps in a row (steps {first}-{}), each skipped",
                m.step
            )
        };
        let why = tr.explain_non_finite();
        Err(self.stopped(m.step, Error::numerical(format!("{what}: {why}"))))
    }

    /// The validation loss, which must be finite.
    fn validation_loss(&self, tr: &Trainer) -> Result<f32> {
        let v = tr.evaluate().map_err(|e| self.stopped(tr.step, e))?;
        if !v.is_finite() {
            let why = tr.explain_non_finite();
            let e = Error::numerical(format!("the validation loss is {v}: {why}"));
            return Err(self.stopped(tr.step, e));
        }
        Ok(v)
    }

    fn eval_due(&self, tr: &Trainer) -> bool {
        let e = tr.cfg.eval_every;
        tr.step == tr.cfg.steps
            || (e > 0 && tr.step.is_multiple_of(e) && interrupt::requested().is_none())
    }

    /// A checkpoint is due at the last step and on the `--save-every`
    /// cadence, which waits while fp16 steps are being skipped: the last
    /// checkpoint then stays the one from before the trouble began.
    fn save_due(&self, tr: &Trainer) -> bool {
        let e = tr.cfg.save_every;
        tr.step == tr.cfg.steps
            || (e > 0 && tr.step.is_multiple_of(e) && self.skips.since.is_none())
    }

    /// The metrics line, the progress line or bar, the plot.
    fn record(&mut self, tr: &Trainer, m: StepMetrics) -> Result<()> {
        self.log.append(&m).map_err(|e| self.stopped(m.step, e))?;
        let msg = format!(
            "loss {:.4}{} lr {:.2e} scale {}{} {:.0} tok/s",
            m.loss,
            m.val_loss
                .map(|v| format!(" val {v:.4}"))
                .unwrap_or_default(),
            m.lr,
            m.scale,
            // fp8 runs: the step's saturated values, run total so far
            tr.fp8
                .as_ref()
                .map(|r| format!(
                    " fp8 sat {} (total {})",
                    m.fp8_saturated.unwrap_or(0),
                    r.borrow().saturated_total()
                ))
                .unwrap_or_default(),
            m.tokens_per_s
        );
        let last = tr.step == tr.cfg.steps;
        match &self.bar {
            Some(b) => {
                b.update(tr.step as u64, &msg, self.clock.0.elapsed().as_secs_f64());
            }
            None if tr.step.is_multiple_of(self.log_every)
                || last
                || m.val_loss.is_some()
                || tr.step == 1 =>
            {
                let skipped = if m.skipped {
                    " (skipped: overflow)"
                } else {
                    ""
                };
                let eta = if last {
                    String::new()
                } else {
                    let per_step = self.clock.0.elapsed().as_secs_f64()
                        / (tr.step - self.first_step).max(1) as f64;
                    format!(
                        " eta {}",
                        duration((tr.cfg.steps - tr.step) as f64 * per_step)
                    )
                };
                say(
                    self.progress,
                    &format!("step {:>5}/{} {msg}{skipped}{eta}", tr.step, tr.cfg.steps),
                );
            }
            None => {}
        }
        let has_val = m.val_loss.is_some();
        self.history.push(m);
        if has_val {
            let title = format!("tinyllm {} ({})", tr.cfg.preset, tr.cfg.precision.name());
            // The plot is a view of metrics.jsonl: failing to draw it stops nothing.
            if let Err(e) = write_plot(&self.out, &title, &self.history) {
                if !std::mem::replace(&mut self.plot_failed, true) {
                    say(
                        self.progress,
                        &format!("warning: {e}; training goes on without its plot"),
                    );
                }
            }
        }
        Ok(())
    }

    fn save(&mut self, tr: &Trainer) -> Result<()> {
        match tr.save(&self.out) {
            Ok(p) => {
                self.last_saved = Some((p, tr.step));
                Ok(())
            }
            Err(e) => {
                let step = tr.step;
                Err(self.stopped(
                    step,
                    e.map_message(|m| {
                        format!("the checkpoint of step {step} could not be written: {m}")
                    }),
                ))
            }
        }
    }

    /// After a signal: saves the step reached unless it is saved already or
    /// its loss was not finite (then the last good checkpoint stays).
    fn save_on_interrupt(&mut self, tr: &Trainer) -> Result<()> {
        let saved = self.last_saved.as_ref().map(|s| s.1);
        if saved != Some(tr.step)
            && self.history.last().is_some_and(|m| m.step == tr.step)
            && self.skips.non_finite_losses == 0
        {
            self.save(tr)?;
        }
        if let Some(b) = &self.bar {
            b.finish();
        }
        Ok(())
    }

    /// Where the run stands, for an error that stops it.
    fn status(&self) -> String {
        match &self.last_saved {
            Some((dir, s)) => {
                let before = match self.skips.since {
                    Some(t) if *s < t => {
                        format!(", from before the skipped steps that began at step {t}")
                    }
                    _ => String::new(),
                };
                format!(
                    "the last good checkpoint, {} (step {s}{before}), is intact",
                    dir.display()
                )
            }
            None => "no checkpoint had been written yet".into(),
        }
    }

    /// `e`, as the error that stops the run at `step`, with where it stands.
    fn stopped(&self, step: usize, e: Error) -> Error {
        if let Some(b) = &self.bar {
            b.finish();
        }
        let status = self.status();
        e.map_message(|m| format!("training stopped at step {step} ({status}): {m}"))
    }

    fn finish(
        self,
        tr: Trainer,
        interrupted: Option<i32>,
        device: Device,
        t_start: Instant,
    ) -> RunSummary {
        if let (Some(b), None) = (&self.bar, interrupted) {
            b.finish();
        }
        let losses: Vec<f32> = self.history.iter().map(|m| m.loss).collect();
        let summary = RunSummary {
            checkpoint: self.last_saved.as_ref().map(|s| s.0.clone()),
            checkpoint_step: self.last_saved.as_ref().map_or(0, |s| s.1),
            interrupted,
            final_loss: tail_mean(&losses),
            final_val_loss: self.history.last().and_then(|m| m.val_loss),
            plan: tr.plan,
            peak_bytes: self
                .history
                .iter()
                .map(|m| m.peak_bytes)
                .fold(self.peak, usize::max),
            // per step, over the run's processes: the same figure a finished
            // run read back from its metrics gives
            process_peak_bytes: self
                .history
                .iter()
                .filter_map(|m| m.process_peak_bytes)
                .max(),
            device_peak_bytes: self
                .history
                .iter()
                .filter_map(|m| m.device_peak_bytes)
                .max(),
            // the whole run's, over its resumes (as a finished run read back says)
            seconds: self.clock.1 + t_start.elapsed().as_secs_f64(),
            device,
            history: self.history,
            out: self.out,
            builds: tr.builds.clone(),
        };
        let phase =
            |f: fn(&StepMetrics) -> Option<usize>| summary.history.iter().filter_map(f).max();
        let phases = match (
            phase(|m| m.forward_peak_bytes),
            phase(|m| m.backward_peak_bytes),
        ) {
            (Some(f), Some(b)) => format!(" (forward {}, backward {})", mib(f), mib(b)),
            _ => String::new(),
        };
        say(
            self.progress,
            &format!(
                "memory: planned peak {} (forward {}, backward {}) · measured peak {}{phases} (tinyllm::memory, largest step)",
                mib(summary.plan.total),
                mib(summary.plan.forward_peak),
                mib(summary.plan.backward_peak),
                mib(summary.peak_bytes)
            ),
        );
        summary
    }
}

/// `s` as one word for a POSIX shell (quoted only when it needs to be).
pub fn shell_quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}
