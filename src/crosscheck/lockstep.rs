//! Training lockstep: the same run on the CPU reference and on the GPU from
//! the same seed, compared after every optimizer step — the loss bits and
//! every parameter and AdamW moment buffer. At the first divergence the step
//! is replayed from the state before it on both devices with the
//! [primitive trace](super::trace) on, and the first call whose output differs is named
//! with its model path, shapes, position and both values.
//!
//! The same replay serves a training run (`tinyllm train --device gpu
//! --crosscheck-every K`): [`Replay`] re-runs every K-th GPU step on the CPU
//! from the state before it and stops the run at the first divergence,
//! keeping that state as a checkpoint for a bug report.

use super::cases::diff;
use super::hex;
use crate::backend::Device;
use crate::nn::Module;
use crate::precision::Precision;
use crate::trace::{self, Trace};
use crate::train::checkpoint::{self, TrainState};
use crate::train::data::Corpus;
use crate::train::metrics::StepMetrics;
use crate::train::trainer::StepCheck;
use crate::train::{TrainConfig, TrainOptions, Trainer};
use crate::{Error, Result, Tensor};
use serde::Serialize;
use std::path::PathBuf;

/// One parameter's AdamW moments and step count, on the host (`None`: the
/// parameter has not been updated yet).
type Moments = Option<(Vec<f32>, Vec<f32>, u64)>;

/// Everything a training step reads and changes, on the host: the state a
/// checkpoint records, the weights and the AdamW moments. A trainer restored
/// from it on either device takes the same next step.
pub struct Snapshot {
    state: TrainState,
    params: Vec<Vec<f32>>,
    moments: Vec<Moments>,
}

impl Snapshot {
    /// The trainer's state (its buffers are read back).
    pub fn take(t: &Trainer) -> Result<Snapshot> {
        let params = t.model.parameters();
        let mut moments = Vec::with_capacity(params.len());
        for i in 0..params.len() {
            moments.push(match t.opt.state(i) {
                Some((m, v, k)) => Some((m.to_vec_f32()?, v.to_vec_f32()?, *k)),
                None => None,
            });
        }
        Ok(Snapshot {
            state: t.state(),
            params: params
                .iter()
                .map(Tensor::to_vec_f32)
                .collect::<Result<_>>()?,
            moments,
        })
    }

    /// The step this state is at (the next step taken is `step() + 1`).
    pub fn step(&self) -> usize {
        self.state.step
    }

    /// Puts the state into `t` (a trainer of the same config, any device).
    pub fn restore(&self, t: &mut Trainer) -> Result<()> {
        let device = t.device;
        let params = t.model.parameters();
        if params.len() != self.params.len() {
            return Err(Error::config(format!(
                "a snapshot of {} parameters for a model of {}",
                self.params.len(),
                params.len()
            )));
        }
        for (p, v) in params.iter().zip(&self.params) {
            p.set_storage(crate::backend::Storage::from_f32(v.clone(), device)?)?;
        }
        for (i, (p, mom)) in params.iter().zip(&self.moments).enumerate() {
            let st = match mom {
                Some((m, v, k)) => Some((
                    Tensor::from_vec(m.clone(), p.shape(), device)?,
                    Tensor::from_vec(v.clone(), p.shape(), device)?,
                    *k,
                )),
                None => None,
            };
            t.opt.set_state(i, st)?;
        }
        if let (Some(s), Some(saved)) = (&mut t.scaler, &self.state.scaler) {
            s.load_state_dict(saved)?;
        }
        t.model.rng.set_state(self.state.model_rng);
        t.data_rng.set_state(self.state.data_rng);
        t.step = self.state.step;
        // The rate of the last step taken, as a checkpoint of it records.
        crate::optim::Optimizer::set_lr(&mut t.opt, t.cfg.lr_after(t.step));
        Ok(())
    }

    /// A fresh trainer on `device` in this state.
    pub fn trainer(&self, cfg: &TrainConfig, device: Device, corpus: &Corpus) -> Result<Trainer> {
        let mut t = Trainer::new(cfg.clone(), device, corpus)?;
        self.restore(&mut t)?;
        Ok(t)
    }
}

/// One buffer (or the loss, or a step count) that differs after a step.
#[derive(Clone, Debug, Serialize)]
pub struct BufferDiff {
    /// The value's name: `loss`, `loss scale`, `skipped`, `grad norm`, a
    /// parameter's name, or a parameter's `.exp_avg`, `.exp_avg_sq` or `.step`.
    pub name: String,
    /// Values in the CPU's buffer (for the list of buffers itself: buffers
    /// in the CPU's list).
    pub len: usize,
    /// Values that differ (a difference in length counts each missing value).
    pub differing: usize,
    /// The largest difference between two numbers, in ulps (units in the
    /// last place: how many floats lie between them).
    pub max_ulps: u64,
    /// Whether a NaN stood against a number somewhere (no ulp distance).
    pub nan_vs_number: bool,
    /// The index of the first differing value.
    pub position: usize,
    /// The CPU's value there, as an f32 bit pattern in hex (`-` when only the
    /// lengths differ; for the list of buffers itself, its length).
    pub cpu: String,
    /// The GPU's value there, as for `cpu`.
    pub gpu: String,
}

/// The differing buffers of two equally named lists, in order.
fn compare(cpu: &[(String, Vec<f32>)], gpu: &[(String, Vec<f32>)]) -> Vec<BufferDiff> {
    let mut out = Vec::new();
    for ((name, c), (gname, g)) in cpu.iter().zip(gpu) {
        debug_assert_eq!(name, gname);
        let diff = diff(c, g);
        let mut d = BufferDiff {
            name: name.clone(),
            len: c.len(),
            differing: diff.differing,
            max_ulps: diff.max_ulps,
            nan_vs_number: diff.nan_vs_number,
            position: c.len().min(g.len()),
            cpu: "-".into(),
            gpu: "-".into(),
        };
        if d.differing > 0 {
            if let Some(i) = diff.first {
                (d.position, d.cpu, d.gpu) = (i, hex(c[i]), hex(g[i]));
            }
            out.push(d);
        }
    }
    if cpu.len() != gpu.len() {
        out.push(BufferDiff {
            name: "(the list of buffers)".into(),
            len: cpu.len(),
            differing: cpu.len().abs_diff(gpu.len()),
            max_ulps: 0,
            nan_vs_number: false,
            position: cpu.len().min(gpu.len()),
            cpu: format!("{} buffers", cpu.len()),
            gpu: format!("{} buffers", gpu.len()),
        });
    }
    out
}

/// A step's results as named values: the loss, the scale, the flags, then
/// every parameter, moment and step count.
fn step_values(t: &Trainer, m: &StepMetrics) -> Result<Vec<(String, Vec<f32>)>> {
    let mut v = vec![
        ("loss".to_string(), vec![m.loss]),
        ("loss scale".to_string(), vec![m.scale]),
        ("skipped".to_string(), vec![m.skipped as u8 as f32]),
        (
            "grad norm".to_string(),
            vec![m.grad_norm.unwrap_or(f32::NAN)],
        ),
    ];
    v.extend(t.snapshot()?);
    Ok(v)
}

/// The first primitive call whose output differs between the two replays.
#[derive(Clone, Debug, Serialize)]
pub struct FirstCall {
    /// Calls in the CPU's and the GPU's trace of the step.
    pub calls: (usize, usize),
    /// The call's 0-based position in the trace (the call as the CPU made it).
    pub index: usize,
    /// `forward`, `backward`, `recompute` or `optimizer`.
    pub phase: &'static str,
    /// `layers.3.self_attn.softmax`: the model path and the primitive.
    pub site: String,
    /// The call's shapes and parameters.
    pub args: String,
    /// Set when the GPU made a different call at this position (not just a
    /// different output): the runs had already parted.
    pub gpu_call: Option<String>,
    /// The call before it (identical on both), for orientation.
    pub previous: Option<String>,
    /// Output values of the call (0 when the CPU's step had already ended).
    pub values: usize,
    /// Output values that differ (0 when the outputs were not compared:
    /// the calls themselves differ).
    pub differing: usize,
    /// The largest difference between two output numbers, in ulps.
    pub max_ulps: u64,
    /// Whether a NaN stood against a number in the outputs.
    pub nan_vs_number: bool,
    /// The first differing output position (`None` when the calls themselves
    /// differ, or the outputs were not captured).
    pub position: Option<usize>,
    /// The CPU's output there, as an f32 bit pattern in hex.
    pub cpu: Option<String>,
    /// The GPU's output there, as an f32 bit pattern in hex.
    pub gpu: Option<String>,
}

impl std::fmt::Display for FirstCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "call #{} of {} ({}): {} [{}]",
            self.index, self.calls.0, self.phase, self.site, self.args
        )?;
        if let Some(g) = &self.gpu_call {
            return write!(f, "; the GPU made a different call there: {g}");
        }
        if let (Some(p), Some(c), Some(g)) = (self.position, &self.cpu, &self.gpu) {
            let u = if self.nan_vs_number {
                "NaN against a number".to_string()
            } else {
                format!("at most {} ulp", self.max_ulps)
            };
            write!(
                f,
                "; {} of {} output values differ ({u}), first at [{p}]: cpu {c}, gpu {g}",
                self.differing, self.values
            )?;
        }
        Ok(())
    }
}

/// Replays one step from `pre` on `device` with the trace on.
fn traced_step(
    pre: &Snapshot,
    cfg: &TrainConfig,
    device: Device,
    corpus: &Corpus,
    capture: Option<usize>,
) -> Result<Trace> {
    let mut t = pre.trainer(cfg, device, corpus)?;
    trace::start(capture);
    let r = t.train_step();
    let tr = trace::finish();
    r.map_err(|e| e.context(format!("replaying step {} on the {device}", pre.step() + 1)))?;
    Ok(tr)
}

/// Replays the step after `pre` on both devices with the trace on and names
/// the first call whose output differs (`Ok(None)`: the replays agreed).
pub fn first_differing_call(
    pre: &Snapshot,
    cfg: &TrainConfig,
    corpus: &Corpus,
) -> Result<Option<FirstCall>> {
    let tc = traced_step(pre, cfg, Device::Cpu, corpus, None)?;
    let tg = traced_step(pre, cfg, Device::Gpu, corpus, None)?;
    let Some(i) = tc.first_difference(&tg) else {
        return Ok(None);
    };
    let (c, g) = (tc.calls.get(i), tg.calls.get(i));
    // the call at `i` as the CPU made it (or where its step ended), nothing
    // compared yet
    let at = |phase, site, args, values| FirstCall {
        calls: (tc.calls.len(), tg.calls.len()),
        index: i,
        phase,
        site,
        args,
        gpu_call: None,
        previous: i.checked_sub(1).map(|j| tc.calls[j].to_string()),
        values,
        differing: 0,
        max_ulps: 0,
        nan_vs_number: false,
        position: None,
        cpu: None,
        gpu: None,
    };
    let Some(c) = c else {
        let g = g.expect("one trace is longer");
        let mut fc = at(
            g.phase,
            "(the CPU's step ended here)".into(),
            String::new(),
            0,
        );
        fc.gpu_call = Some(g.to_string());
        return Ok(Some(fc));
    };
    let mut fc = at(c.phase, c.site(), c.args.clone(), c.len);
    match g {
        Some(g) if (g.name, &g.args, g.len) == (c.name, &c.args, c.len) => {
            // Same call, different output: replay once more on each device,
            // keeping that call's values.
            let vc = traced_step(pre, cfg, Device::Cpu, corpus, Some(i))?.captured;
            let vg = traced_step(pre, cfg, Device::Gpu, corpus, Some(i))?.captured;
            if let (Some(vc), Some(vg)) = (vc, vg) {
                let d = compare(&[("call".into(), vc)], &[("call".into(), vg)]);
                if let Some(d) = d.first() {
                    fc.differing = d.differing;
                    fc.max_ulps = d.max_ulps;
                    fc.nan_vs_number = d.nan_vs_number;
                    fc.position = Some(d.position);
                    fc.cpu = Some(d.cpu.clone());
                    fc.gpu = Some(d.gpu.clone());
                }
            }
        }
        Some(g) => fc.gpu_call = Some(g.to_string()),
        None => fc.gpu_call = Some("(the GPU's step ended here)".into()),
    }
    Ok(Some(fc))
}

/// The first step whose results differ.
#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    /// The optimizer step (0: the initial weights already differ).
    pub step: usize,
    /// The step's loss on the CPU (NaN at step 0).
    pub loss_cpu: f32,
    /// The step's loss on the GPU (NaN at step 0).
    pub loss_gpu: f32,
    /// How many named values (loss, scale, buffers) differ.
    pub buffers_differing: usize,
    /// The first few of them (at most six), in order.
    pub buffers: Vec<BufferDiff>,
    /// From the traced replay.
    pub first_call: Option<FirstCall>,
    /// What the replay could not say (it agreed, or was not run).
    pub note: Option<String>,
    /// Where the state before the step was saved (a training run's check).
    pub saved: Option<PathBuf>,
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "first divergence at step {}: loss cpu {} ({}) gpu {} ({}); {} value list(s) differ:",
            self.step,
            self.loss_cpu,
            hex(self.loss_cpu),
            self.loss_gpu,
            hex(self.loss_gpu),
            self.buffers_differing
        )?;
        for b in &self.buffers {
            let u = if b.nan_vs_number {
                "NaN against a number".to_string()
            } else {
                format!("at most {} ulp", b.max_ulps)
            };
            writeln!(
                f,
                "  {}: {} of {} differ ({u}), first at [{}]: cpu {} gpu {}",
                b.name, b.differing, b.len, b.position, b.cpu, b.gpu
            )?;
        }
        if let Some(c) = &self.first_call {
            writeln!(f, "first differing primitive call in the replayed step:")?;
            writeln!(f, "  {c}")?;
            if let Some(p) = &c.previous {
                writeln!(f, "  (the call before it, identical on both: {p})")?;
            }
        }
        if let Some(n) = &self.note {
            writeln!(f, "{n}")?;
        }
        if let Some(s) = &self.saved {
            writeln!(
                f,
                "the state before step {} is saved in {} (resume it with --device cpu or gpu to replay the step)",
                self.step,
                s.display()
            )?;
        }
        Ok(())
    }
}

/// How many differing value lists a divergence lists by name.
const SHOWN: usize = 6;

/// Compares a step's results on both trainers; on a difference, replays it
/// from `pre` with the trace (when given) to find the first differing call.
fn check_step(
    pre: Option<&Snapshot>,
    cfg: &TrainConfig,
    corpus: &Corpus,
    cpu: (&Trainer, &StepMetrics),
    gpu: (&Trainer, &StepMetrics),
) -> Result<Option<Divergence>> {
    let diffs = compare(&step_values(cpu.0, cpu.1)?, &step_values(gpu.0, gpu.1)?);
    if diffs.is_empty() {
        return Ok(None);
    }
    let (first_call, note) = match pre {
        Some(pre) => match first_differing_call(pre, cfg, corpus)? {
            Some(c) => (Some(c), None),
            None => (
                None,
                Some(
                    "the traced replay of the step agreed call for call: the device did not \
                     repeat its own result (non-deterministic), or the difference lies outside \
                     the backend's primitives"
                        .to_string(),
                ),
            ),
        },
        None => (None, None),
    };
    Ok(Some(Divergence {
        step: cpu.1.step,
        loss_cpu: cpu.1.loss,
        loss_gpu: gpu.1.loss,
        buffers_differing: diffs.len(),
        buffers: diffs.into_iter().take(SHOWN).collect(),
        first_call,
        note,
        saved: None,
    }))
}

/// A lockstep run's result.
#[derive(Clone, Debug, Serialize)]
pub struct Lockstep {
    /// The preset trained (`tiny`, `small` or `capstone`).
    pub preset: String,
    /// The precision recipe: `fp32`, `bf16` or `fp16`.
    pub precision: &'static str,
    /// Optimizer steps asked for.
    pub steps: usize,
    /// Steps whose every value was identical, before any divergence.
    pub identical_steps: usize,
    /// Values lists compared after each step (loss, scale, flags, buffers).
    pub compared: usize,
    /// The first step that differed; `None` when every step agreed.
    pub divergence: Option<Divergence>,
}

impl Lockstep {
    /// Whether every step gave the same bits on both devices.
    pub fn bit_identical(&self) -> bool {
        self.divergence.is_none()
    }
}

/// What to run in lockstep.
#[derive(Clone, Debug)]
pub struct LockstepOptions {
    /// The preset to train (`tiny`, `small` or `capstone`), with its recipe.
    pub preset: String,
    /// Optimizer steps to take and compare.
    pub steps: usize,
    /// The precision recipe of both runs.
    pub precision: Precision,
    /// `None`: the trainer's default seed.
    pub seed: Option<u64>,
}

/// A lockstep of no steps would compare nothing and pass: refused.
pub(crate) fn check_steps(steps: usize) -> Result<()> {
    if steps == 0 {
        crate::bail!(
            Config,
            "the lockstep needs at least 1 step (0 would compare nothing)"
        );
    }
    Ok(())
}

/// `steps` optimizer steps of the preset's recipe at `precision` on both
/// devices, compared after each (see the module docs). Needs a GPU adapter;
/// `steps` ≥ 1.
pub fn run(o: &LockstepOptions, progress: &mut dyn FnMut(&str)) -> Result<Lockstep> {
    check_steps(o.steps)?;
    let cfg = TrainConfig::resolve(&TrainOptions {
        preset: Some(o.preset.clone()),
        steps: Some(o.steps),
        precision: Some(o.precision),
        seed: o.seed,
        device: Some(crate::train::DeviceChoice::Gpu),
        ..TrainOptions::default()
    })?;
    let corpus = Corpus::load(cfg.data.as_ref())?;
    let mut cpu = Trainer::new(cfg.clone(), Device::Cpu, &corpus)?;
    let mut gpu = Trainer::new(cfg.clone(), Device::Gpu, &corpus)?;
    let mut out = Lockstep {
        preset: o.preset.clone(),
        precision: o.precision.name(),
        steps: o.steps,
        identical_steps: 0,
        compared: 0,
        divergence: None,
    };
    // the initial weights come from the host's generator: the same everywhere
    let init = compare(&cpu.snapshot()?, &gpu.snapshot()?);
    if !init.is_empty() {
        out.divergence = Some(Divergence {
            step: 0,
            loss_cpu: f32::NAN,
            loss_gpu: f32::NAN,
            buffers_differing: init.len(),
            buffers: init.into_iter().take(SHOWN).collect(),
            first_call: None,
            note: Some("the initial weights differ before any step".into()),
            saved: None,
        });
        return Ok(out);
    }
    for step in 1..=o.steps {
        let pre = Snapshot::take(&cpu)?;
        let mc = cpu
            .train_step()
            .map_err(|e| e.context(format!("lockstep step {step} on the CPU")))?;
        let mg = gpu
            .train_step()
            .map_err(|e| e.context(format!("lockstep step {step} on the GPU")))?;
        let values = step_values(&cpu, &mc)?.len();
        out.compared = values;
        if let Some(d) = check_step(Some(&pre), &cfg, &corpus, (&cpu, &mc), (&gpu, &mg))? {
            progress(&format!(
                "lockstep {} {}: step {step} differs",
                o.preset,
                o.precision.name()
            ));
            out.divergence = Some(d);
            return Ok(out);
        }
        out.identical_steps = step;
        progress(&format!(
            "lockstep {} {}: step {step}/{} bit-identical (loss {:.4}, {values} value lists)",
            o.preset,
            o.precision.name(),
            o.steps,
            mc.loss
        ));
    }
    Ok(out)
}

/// `tinyllm train --device gpu --crosscheck-every K`: every K-th step is
/// replayed on the CPU from the state before it; the first step whose results
/// differ stops the run with the trace report, and the state before that step
/// is saved in `OUT/crosscheck-step-N/` (a checkpoint, with the report beside it).
pub struct Replay {
    every: usize,
    corpus: Corpus,
    pre: Option<Snapshot>,
    /// Steps replayed so far, all identical.
    pub checked: usize,
}

impl Replay {
    /// A check every `every` steps of the run `cfg` (its corpus is loaded here).
    pub fn new(every: usize, cfg: &TrainConfig) -> Result<Replay> {
        if every == 0 {
            return Err(Error::config(
                "the replay interval must be 1 or more (every K-th step is replayed)",
            ));
        }
        Ok(Replay {
            every,
            corpus: Corpus::load(cfg.data.as_ref())?,
            pre: None,
            checked: 0,
        })
    }
}

impl StepCheck for Replay {
    fn begin(&mut self, tr: &Trainer) -> Result<()> {
        if tr.device != Device::Gpu {
            return Err(Error::config(format!(
                "--crosscheck-every compares the GPU with the CPU reference, and this run is on the {}: train with --device gpu",
                tr.device
            )));
        }
        Ok(())
    }

    fn wants(&self, step: usize) -> bool {
        step.is_multiple_of(self.every)
    }

    fn before(&mut self, tr: &Trainer) -> Result<()> {
        self.pre = Some(Snapshot::take(tr)?);
        Ok(())
    }

    fn after(&mut self, tr: &Trainer, m: &StepMetrics) -> Result<()> {
        let Some(pre) = self.pre.take() else {
            return Ok(());
        };
        let mut cpu = pre.trainer(&tr.cfg, Device::Cpu, &self.corpus)?;
        let mc = cpu
            .train_step()
            .map_err(|e| e.context(format!("the CPU replay of step {}", m.step)))?;
        let Some(mut d) = check_step(Some(&pre), &tr.cfg, &self.corpus, (&cpu, &mc), (tr, m))?
        else {
            self.checked += 1;
            return Ok(());
        };
        // Keep the state before the step: a checkpoint that replays it.
        let dir = tr.cfg.out.join(format!("crosscheck-step-{}", m.step));
        if crate::train::outdir::is_link(&dir) {
            return Err(Error::config(format!(
                "{} is a symbolic link: the kept state of a diverging step is written into --out itself, never through a link",
                dir.display()
            )));
        }
        pre.trainer(&tr.cfg, Device::Cpu, &self.corpus)?
            .save(&dir)?;
        d.saved = Some(dir.clone());
        let report = format!(
            "GPU adapter: {}\n{d}",
            crate::gpu::adapter_name().unwrap_or_default()
        );
        checkpoint::write_atomic(&dir, "crosscheck.txt", report.as_bytes())?;
        let json = serde_json::to_vec_pretty(&d).map_err(|e| Error::config(e.to_string()))?;
        checkpoint::write_atomic(&dir, "crosscheck.json", &json)?;
        Err(Error::Divergence(format!(
            "the GPU's step {} differs from the CPU reference's (checked every {} steps, {} earlier checks identical):\n{report}",
            m.step, self.every, self.checked
        )))
    }
}
